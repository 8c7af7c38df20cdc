"""RayLoader of two installed versions of dali_nerf, paired: delivered rays/s per stream and batch.

    python benchmarks/versions_ab.py --old-python OLD_PY [--new-python PY] [--scene DIR] [--pairs 10]
                                     [--seconds 3] [--rows global:4096,shard:4096,global:65536,shard:65536]
                                     [--yield-gil] [--out ab.json]

``OLD_PY`` is a Python with the other version installed (e.g. a venv made with
``--system-site-packages``, so both use the same DALI, torch and compiler, and ``pip install
--no-deps`` of a worktree of the old commit into it: each version then builds its own plugin).
Each measurement is a fresh process: ``RayLoader(scene, rays_per_batch=B, prefetch=2, stream=S)``
on the scene's train split, 30 batches of warm-up, then ``--seconds`` of ``next()`` with no work
between batches (``--yield-gil``: ``time.sleep(0)`` after each, giving the GIL up as a training
step's compute would). Per row ``--pairs`` pairs, each pair the two versions next to each other in
an order that alternates (ABBA); reported: each version's median rays/s and the per-pair ratio
new / old, median (min-max). Without ``--scene`` the 100-image 400x400 ``objects`` scene is
generated into a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RATE = r"""
import json, sys, time
import dali_nerf
from dali_nerf import RayLoader, load_scene
scene_dir, stream, rays, secs, yield_gil = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5] == "1"
ld = RayLoader(load_scene(scene_dir, split="train"), rays_per_batch=rays, rank=0, world_size=1, seed=0, prefetch=2,
               stream=stream)
it = iter(ld)
for _ in range(30):
    next(it)
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < secs:
    next(it)
    n += 1
    if yield_gil:
        time.sleep(0)
dt = time.perf_counter() - t0
ld.close()
print(json.dumps({"file": dali_nerf.__file__, "rays_per_s": n * rays / dt}))
"""


def measure(python: str, scene: Path, stream: str, rays: int, seconds: float, yield_gil: bool) -> dict:
    """One fresh process's {"file", "rays_per_s"}."""
    out = subprocess.run([python, "-c", RATE, str(scene), stream, str(rays), str(seconds), "1" if yield_gil else "0"],
                         capture_output=True, text=True, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise SystemExit(f"versions_ab: {python} failed (exit {out.returncode}): {out.stderr.strip()[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def row(args, scene: Path, stream: str, rays: int) -> dict:
    ratios, new, old, files = [], [], [], set()
    for i in range(args.pairs):
        order = [("new", args.new_python), ("old", args.old_python)]
        got = {}
        for name, py in (order if i % 2 == 0 else order[::-1]):
            r = measure(py, scene, stream, rays, args.seconds, args.yield_gil)
            got[name] = r["rays_per_s"]
            files.add(r["file"])
        ratios.append(got["new"] / got["old"])
        new.append(got["new"])
        old.append(got["old"])
        print(f"{stream} {rays} pair {i}: new {got['new'] / 1e6:.1f} old {got['old'] / 1e6:.1f} "
              f"ratio {ratios[-1]:.3f}", flush=True)
    return {"stream": stream, "rays": rays, "new_median": statistics.median(new), "old_median": statistics.median(old),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratios": ratios, "modules": sorted(files)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old-python", required=True)
    p.add_argument("--new-python", default=sys.executable)
    p.add_argument("--scene", default=None)
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rows", default="global:4096,shard:4096,global:65536,shard:65536")
    p.add_argument("--yield-gil", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = [(s, int(b)) for s, b in (r.split(":") for r in args.rows.split(","))]
    with tempfile.TemporaryDirectory() as tmp:
        scene = Path(args.scene) if args.scene else None
        if scene is None:
            from dali_nerf.scenegen import make_scene

            scene = Path(make_scene("objects", Path(tmp) / "scene", width=400, height=400, n_train=100, n_val=5,
                                    n_test=10, seed=0))
        res = [row(args, scene, s, b) for s, b in rows]
    print("| stream | rays/batch | new (Mrays/s, median) | old | new / old per pair: median (min-max) |")
    print("|---|---:|---:|---:|---:|")
    for r in res:
        print(f"| {r['stream']} | {r['rays']} | {r['new_median'] / 1e6:.1f} | {r['old_median'] / 1e6:.1f} | "
              f"{r['ratio_median']:.3f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
