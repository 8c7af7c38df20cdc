"""RayLoader of two installed versions of dali_nerf, paired: delivered rays/s per stream and batch.

    python benchmarks/versions_ab.py --old-python OLD_PY [--new-python PY] [--scene DIR] [--pairs 10]
                                     [--seconds 3] [--rows global:4096,shard:4096,global:65536,shard:65536]
                                     [--yield-gil] [--mask 0.5 [--mask-kind iid|sky] [--rounds 3]]
                                     [--out ab.json]

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

``--mask F``: each process also masks a fraction F of every image (``dali-nerf bench sampler
--mask``'s masks, ``--mask-kind``) and measures the unmasked and the masked loader in ``--rounds``
interleaved rounds of ``--seconds`` each (the order alternating); per version it reports both rates
(the best round of each process, median over processes) and the masked cost per ray (unmasked /
masked rate, the median over a process's rounds, then over processes), and new / old per pair for
the masked and the unmasked rates.
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


MASKED = r"""
import json, statistics, sys, tempfile
import torch
import dali_nerf
from dali_nerf import load_scene
from dali_nerf.bench.masked import masked_scene
from dali_nerf.bench.sampler import measure
from dali_nerf.data.imagecache import CacheStore
from dali_nerf.data.plan import SamplingPlan
from dali_nerf.sources import make_source
scene_dir, stream, rays, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
fraction, kind, rounds = float(sys.argv[6]), sys.argv[7], int(sys.argv[8])
scene = load_scene(scene_dir, split="train")
threads = torch.get_num_threads()
with tempfile.TemporaryDirectory() as d:
    scenes = {"none": scene, "masked": masked_scene(scene, d, fraction, kind)}
    one = SamplingPlan.for_loader(rays, num_threads=threads)
    caches = {k: CacheStore(v, one).full("cpu") for k, v in scenes.items()}
    share = caches["masked"].num_valid / caches["masked"].num_pixels
    plan = SamplingPlan.for_loader(rays, num_threads=threads, rays_per_run=max(262144, rays), prefetch=2, stream=stream)
    rates = {"none": [], "masked": []}
    for r in range(rounds):
        for which in (("none", "masked") if r % 2 == 0 else ("masked", "none")):
            with make_source("rays", scenes[which], plan, cache=caches[which]) as L:
                rates[which].append(measure(L, rays, secs))
cost = statistics.median(a / b for a, b in zip(rates["none"], rates["masked"]))
print(json.dumps({"file": dali_nerf.__file__, "rays_per_s": max(rates["masked"]), "none_per_s": max(rates["none"]),
                  "cost": cost, "rounds": rates, "valid_share": share}))
"""


def measure(python: str, scene: Path, stream: str, rays: int, seconds: float, yield_gil: bool,
            mask: tuple | None = None) -> dict:
    """One fresh process's {"file", "rays_per_s"} (``mask`` = (fraction, kind, rounds): the masked
    rate (the best round), and "none_per_s" (the best unmasked round), "cost", "rounds" ({"none",
    "masked"}: every round's rate) and "valid_share" (the masked cache's valid pixels / pixels))."""
    argv = [str(scene), stream, str(rays), str(seconds), "1" if yield_gil else "0"]
    code = RATE if mask is None else MASKED
    if mask is not None:
        argv += [str(m) for m in mask]
    out = subprocess.run([python, "-c", code, *argv], capture_output=True, text=True, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise SystemExit(f"versions_ab: {python} failed (exit {out.returncode}): {out.stderr.strip()[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def row(args, scene: Path, stream: str, rays: int) -> dict:
    mask = None if args.mask is None else (args.mask, args.mask_kind, args.rounds)
    ratios, new, old, files = [], [], [], set()
    extra = {k: [] for k in ("new_none", "old_none", "new_cost", "old_cost", "none_ratios", "processes")}
    for i in range(args.pairs):
        order = [("new", args.new_python), ("old", args.old_python)]
        got = {}
        for name, py in (order if i % 2 == 0 else order[::-1]):
            got[name] = measure(py, scene, stream, rays, args.seconds, args.yield_gil, mask)
            files.add(got[name]["file"])
        ratios.append(got["new"]["rays_per_s"] / got["old"]["rays_per_s"])
        new.append(got["new"]["rays_per_s"])
        old.append(got["old"]["rays_per_s"])
        line = (f"{stream} {rays} pair {i}: new {new[-1] / 1e6:.1f} old {old[-1] / 1e6:.1f} "
                f"ratio {ratios[-1]:.3f}")
        if mask is not None:
            for v in ("new", "old"):
                extra[f"{v}_none"].append(got[v]["none_per_s"])
                extra[f"{v}_cost"].append(got[v]["cost"])
            extra["none_ratios"].append(got["new"]["none_per_s"] / got["old"]["none_per_s"])
            extra["processes"].append(got)
            line += (f" (masked); unmasked ratio {extra['none_ratios'][-1]:.3f}; cost new "
                     f"{extra['new_cost'][-1]:.3f} old {extra['old_cost'][-1]:.3f}")
        print(line, flush=True)
    res = {"stream": stream, "rays": rays, "new_median": statistics.median(new), "old_median": statistics.median(old),
           "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
           "ratios": ratios, "modules": sorted(files)}
    if mask is not None:
        res.update(extra)
    return res


def spread(xs, unit: str = "") -> str:
    return f"{statistics.median(xs):.3f}{unit} ({min(xs):.2f}-{max(xs):.2f})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old-python", required=True)
    p.add_argument("--new-python", default=sys.executable)
    p.add_argument("--scene", default=None)
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rows", default="global:4096,shard:4096,global:65536,shard:65536")
    p.add_argument("--yield-gil", action="store_true")
    p.add_argument("--mask", type=float, default=None, help="masked fraction of every image (e.g. 0.5)")
    p.add_argument("--mask-kind", default=None, choices=("iid", "sky"), help="with --mask (default iid)")
    p.add_argument("--rounds", type=int, default=None, help="with --mask: interleaved rounds per process (default 3)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.mask is None and (args.mask_kind is not None or args.rounds is not None):
        p.error("--mask-kind and --rounds go with --mask F (e.g. --mask 0.5)")
    if args.mask is not None:
        if not 0.0 < args.mask < 1.0:
            p.error(f"--mask {args.mask}: the masked fraction must be in (0, 1), e.g. 0.5")
        if args.yield_gil:
            p.error("--yield-gil is not measured with --mask: leave one of them out")
        args.mask_kind, args.rounds = args.mask_kind or "iid", args.rounds or 3
    rows = [(s, int(b)) for s, b in (r.split(":") for r in args.rows.split(","))]
    with tempfile.TemporaryDirectory() as tmp:
        scene = Path(args.scene) if args.scene else None
        if scene is None:
            from dali_nerf.scenegen import make_scene

            scene = Path(make_scene("objects", Path(tmp) / "scene", width=400, height=400, n_train=100, n_val=5,
                                    n_test=10, seed=0))
        res = [row(args, scene, s, b) for s, b in rows]
    if args.mask is None:
        print("| stream | rays/batch | new (Mrays/s, median) | old | new / old per pair: median (min-max) |")
        print("|---|---:|---:|---:|---:|")
        for r in res:
            print(f"| {r['stream']} | {r['rays']} | {r['new_median'] / 1e6:.1f} | {r['old_median'] / 1e6:.1f} | "
                  f"{r['ratio_median']:.3f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |")
    else:
        print(f"masks: {args.mask_kind}, {args.mask:.0%} of every image; Mrays/s: medians of each process's best round")
        print("| stream | rays/batch | masked new / old Mrays/s | masked new / old per pair | unmasked new / old "
              "Mrays/s | unmasked new / old per pair | masked cost new | masked cost old |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in res:
            print(f"| {r['stream']} | {r['rays']} | {r['new_median'] / 1e6:.1f} / {r['old_median'] / 1e6:.1f} | "
                  f"{spread(r['ratios'])} | {statistics.median(r['new_none']) / 1e6:.1f} / "
                  f"{statistics.median(r['old_none']) / 1e6:.1f} | {spread(r['none_ratios'])} | "
                  f"{spread(r['new_cost'], 'x')} | {spread(r['old_cost'], 'x')} |")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
