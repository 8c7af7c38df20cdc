"""``dali-nerf bench images``: image batches for splatting trainers, our ImageLoader against
gsplat's two paths, measured in the same run (:mod:`dali_nerf.bench.imagepaths`).

    dali-nerf bench images --images 200 --width 800 --height 600 --ranks 1,2,4 --trials 3 --out out/images

For each trial, every (path, ranks) pair runs in an order rotated by the trial (no path always
first): ``ranks`` processes of this node start together, each a rank with torchrun's local
variables, and each measures time to first batch, then in two regimes (the first phase, right
after it, and the steady state: :mod:`dali_nerf.bench.imagepaths`) images/s, the stall under a
``--step-ms`` emulated device step and, at a point all reach, its PSS (with its worker processes).
Per pair and trial: the first batch is the ranks' mean, images/s their sum (the node's), the stall
their mean, the memory their PSS sum (the node's), for each regime. Reported: the mean over
trials and the spread (min-max). Without ``--scene`` a synthetic COLMAP scene is written (smooth noise PNGs; random
cameras; the files' content only sets the decode cost). Before the trials dali_nerf's modules are
copied and compiled to a folder first on the ranks' path (:func:`bytecode_cached`), as an install has them. Writes
``images.json`` and ``images.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

from dali_nerf.atomic import atomic_write_text
from dali_nerf.bench.imagepaths import PATHS
from dali_nerf.errors import ConfigError
from dali_nerf.launch_env import rank_variables

__all__ = ["main", "synthetic_colmap", "run_pair", "summarise", "bytecode_cached", "rank_env", "MAPPED"]


def synthetic_colmap(folder: Path, n: int, width: int, height: int, seed: int = 0) -> Path:
    """A COLMAP folder of ``n`` PNG images (smooth noise) with one PINHOLE camera and random poses."""
    from dali_nerf.scenes.colmap_io import ColmapCamera, ColmapImage, ColmapModel, write_model

    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    small = rng.integers(0, 256, (max(2, height // 16), max(2, width // 16), 3), dtype=np.uint8)
    images = []
    for i in range(n):
        base = cv2.resize(np.roll(small, i, axis=1), (width, height), interpolation=cv2.INTER_CUBIC)
        img = np.clip(base.astype(np.int16) + rng.integers(-12, 13, base.shape), 0, 255).astype(np.uint8)
        cv2.imwrite(str(folder / "images" / f"img_{i:05d}.png"), img)
        q = rng.normal(size=4)
        images.append(ColmapImage(i + 1, q / np.linalg.norm(q), rng.normal(size=3), 1, f"img_{i:05d}.png"))
    cam = ColmapCamera(1, "PINHOLE", width, height, np.array([0.8 * width, 0.8 * width, width / 2, height / 2]))
    write_model(folder / "sparse" / "0", ColmapModel({1: cam}, images, np.arange(1, 11), rng.normal(size=(10, 3)),
                                                     rng.integers(0, 256, (10, 3)).astype(np.uint8), np.zeros(10)))
    return folder


def run_pair(path: str, ranks: int, scene: Path, work: Path, args, tag: str) -> list:
    """One (path, ranks) measurement: ``ranks`` rank processes; their JSON results."""
    sync, scene = (work / f"sync-{tag}").resolve(), scene.resolve()
    sync.mkdir(parents=True)
    if not (work / "lib" / "dali_nerf").is_dir():
        bytecode_cached(work / "lib")
    procs = []
    for r in range(ranks):
        env = {**rank_env(work / "lib"), **rank_variables(r, ranks, r, ranks, f"bench-{os.getpid()}-{tag}"),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "dali_nerf.bench.imagepaths", str(r), str(ranks), path, str(scene),
               str(sync / f"rank{r}.json"), str(sync), str(args.batches), str(args.warmup), str(args.step_ms),
               str(args.seed)]
        # run in the copy's folder: `-m` puts the working directory first on the path, where a
        # checkout's own dali_nerf would come before the compiled copy
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, cwd=work / "lib"))
    for p in procs:
        _, err = p.communicate(timeout=args.timeout)
        if p.returncode != 0:
            raise RuntimeError(f"bench images: {path} x {ranks} ranks failed (exit {p.returncode}): {err[-2000:]}")
    return [json.loads((sync / f"rank{r}.json").read_text()) for r in range(ranks)]


def _node(rows: list) -> dict:
    """The node's numbers of one pair's rank rows (module doc), for both regimes."""
    out = {}
    for pre in ("", "steady_"):
        out[f"{pre}images_per_s"] = float(np.sum([r[f"{pre}images_per_s"] for r in rows]))
        out[f"{pre}stall"] = float(np.mean([r[f"{pre}stall"] for r in rows]))
        out[f"{pre}pss_bytes"] = int(np.sum([r[f"{pre}pss_bytes"] for r in rows]))
    out["first_batch_s"] = float(np.mean([r["first_batch_s"] for r in rows]))
    return out


def summarise(trials: list) -> dict:
    """{"path/ranks": {metric: {"mean", "min", "max", "trials"}}} over the trials' node numbers."""
    keys = sorted({k for t in trials for k in t})
    out = {}
    for k in keys:
        vals = [t[k] for t in trials if k in t]
        out[k] = {m: {"mean": float(np.mean([v[m] for v in vals])), "min": float(np.min([v[m] for v in vals])),
                      "max": float(np.max([v[m] for v in vals])), "trials": len(vals)} for m in vals[0]}
    return out


def _table(summary: dict, ranks_list) -> str:
    lines = ["| path | ranks | first batch (s) | images/s, first phase | stall, first phase | PSS after the first "
             "phase (MiB) | images/s, steady | stall, steady | PSS, steady (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ranks in ranks_list:
        for path in PATHS:
            s = summary.get(f"{path}/{ranks}")
            if s is None:
                continue

            def f(m, scale=1.0, fmt="{:.2f}"):
                return (fmt.format(s[m]["mean"] * scale) + " (" + fmt.format(s[m]["min"] * scale) + "-"
                        + fmt.format(s[m]["max"] * scale) + ")")

            cells = [f("first_batch_s")]
            for pre in ("", "steady_"):
                cells += [f(f"{pre}images_per_s", fmt="{:.0f}"), f(f"{pre}stall", 100, "{:.1f}") + " %",
                          f(f"{pre}pss_bytes", 1 / 2**20, "{:.0f}")]
            lines.append(f"| {path} | {ranks} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratios(summary: dict, ranks_list) -> dict:
    out = {}
    for r in ranks_list:
        o, w, c = (summary.get(f"{p}/{r}") for p in PATHS)
        if o and w:
            out[f"first_batch_workers_over_ours/{r}"] = w["first_batch_s"]["mean"] / o["first_batch_s"]["mean"]
        for pre in ("", "steady_"):
            if o and c:
                out[f"{pre}pss_ours_over_cache/{r}"] = o[f"{pre}pss_bytes"]["mean"] / c[f"{pre}pss_bytes"]["mean"]
            if o:
                out[f"{pre}stall_ours/{r}"] = o[f"{pre}stall"]["mean"]
    return out


def _check(args) -> list:
    try:
        ranks = [int(r) for r in str(args.ranks).split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"--ranks {args.ranks!r}: use comma-separated integers, e.g. 1,2,4") from None
    for name, v in (("--ranks", min(ranks or [0])), ("--trials", args.trials), ("--batches", args.batches),
                    ("--images", args.images), ("--width", args.width), ("--height", args.height)):
        if v <= 0:
            raise ConfigError(f"{name}: must be > 0")
    return ranks


#: dali_nerf's subpackages that a checkout keeps outside dali_nerf/ (setup.cfg package_dir) and an
#: install puts inside it
MAPPED = ("pipelines", "trainers", "configs")


def bytecode_cached(lib: Path) -> bool:
    """Lay dali_nerf out in ``lib`` as an install has it (outside the checkout, which this leaves
    as it is: the package, and the folders a checkout keeps beside it, :data:`MAPPED`) and compile
    it there, as installing a wheel does: the rank and worker processes of every path run in
    ``lib`` with it first on ``PYTHONPATH`` and load the bytecode rather than compile every module
    at each start (an editable checkout under ``PYTHONDONTWRITEBYTECODE=1``, as on the machine
    these numbers come from, never has that cache). Not ``PYTHONPYCACHEPREFIX``: under a prefix
    every other module (torch, DALI, numpy) is looked up there too and compiled at each start,
    which doubled an import of torch, cv2 and DALI here (1.6 -> 3.5 s) and slowed the
    spawned-worker path most. True when every module compiled."""
    import shutil

    import dali_nerf

    pkg, dst = Path(dali_nerf.__file__).resolve().parent, lib / "dali_nerf"
    shutil.copytree(pkg, dst, ignore=shutil.ignore_patterns("__pycache__"))
    for name in MAPPED:
        src = pkg.parent / name  # a checkout's (an install has them inside the package, copied above)
        if not (dst / name).exists() and src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    res = subprocess.run([sys.executable, "-m", "compileall", "-q", str(dst)], capture_output=True, text=True, env=env)
    return res.returncode == 0


def rank_env(lib: Path) -> dict:
    """A rank process's environment: this one with ``lib`` (:func:`bytecode_cached`) first on the
    path and no ``PYTHONPYCACHEPREFIX`` (under one, no module's own bytecode is read)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(Path(lib).resolve()) + (os.pathsep + path if path else "")
    return env


def main(args) -> int:
    """``dali-nerf bench images`` (module doc)."""
    ranks_list = _check(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        work = Path(tmp).resolve()
        bytecode = bytecode_cached(work / "lib")
        scene = Path(args.scene) if args.scene else synthetic_colmap(work / "scene", args.images, args.width, args.height)
        pairs = [(p, r) for r in ranks_list for p in PATHS]
        trials, raw = [], []
        for t in range(args.trials):
            node = {}
            for k in range(len(pairs)):
                path, ranks = pairs[(k + t) % len(pairs)]  # rotated: no pair always first or last
                rows = run_pair(path, ranks, scene, work, args, f"t{t}-{path}-{ranks}")
                raw += [dict(r, trial=t) for r in rows]
                node[f"{path}/{ranks}"] = _node(rows)
                print(f"trial {t} {path:8s} {ranks} ranks: " + ", ".join(f"{m} {v:.4g}" for m, v in node[f'{path}/{ranks}'].items()),
                      flush=True)
            trials.append(node)
    summary = summarise(trials)
    res = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host_cores": os.cpu_count(), "scene": args.scene or
                    f"synthetic {args.images} PNG {args.width}x{args.height}", "batches": args.batches,
                    "warmup": args.warmup, "step_ms": args.step_ms, "trials": args.trials, "workers": 4,
                    "bytecode_cached": bytecode},
           "summary": summary, "ratios": _ratios(summary, ranks_list), "ranks": raw}
    atomic_write_text(out / "images.json", json.dumps(res, indent=1))
    table = _table(summary, ranks_list)
    ratios = "\n".join(f"- {k}: {v:.3g}" for k, v in res["ratios"].items())
    atomic_write_text(out / "images.md", f"{table}\n\n{ratios}\n")
    print(table)
    print(ratios)
    return 0
