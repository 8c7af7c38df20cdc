"""What the study runs: the CPU grid (each cell a trainer process), the emulated launches (one per
method and world size, :mod:`dali_nerf.bench.emulated`), the sampling micro-benchmark for the cost
model, and the ``dali-nerf bench sampler`` table.

>>> dirs, failed = run_grid(cfg, "configs/study.yaml", overrides)
>>> emulation = run_emulated(cfg, grad_bytes, steps)   # {"dirs", "launches", "links", "grad_bytes"}
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from dali_nerf.atomic import atomic_write_text
from dali_nerf.config import Config
from dali_nerf.train.emulation import DeviceLinks
from dali_nerf.errors import DaliNerfError
from dali_nerf.data.hostbudget import first_cores, run_size
from dali_nerf.data.plan import plan_from_config
from dali_nerf.scenes import load_scene
from dali_nerf.sources import build_source
from dali_nerf.bench import emulated as em
from dali_nerf.bench import sampler as sb
from dali_nerf.bench.study.model import sampling_profile
from dali_nerf.bench.study.provenance import host_cores
from dali_nerf.bench.study.steps import check_steps, grid_rays, headline_step

__all__ = ["cpu_plan", "cell_steps", "run_grid", "run_emulated", "emulated_launches", "launch_budgets", "launch_cores",
           "measure_sampling", "measure_scaling", "sampler_table"]


# ---------------------------------------------------------------------------------------------
# the grid: CPU rows (trainer processes) and emulated rows (one launch per method and ranks)


def _cell_name(method: str, sampler: str, ranks: int, trial: int = 0, k: int = 0) -> str:
    return f"study_{method}_{sampler}_{ranks}_t{trial}_{k}"


def cpu_plan(methods: Sequence[str], samplers: Sequence[str], ranks: Sequence[int], trials: int):
    """[(method, ranks, trial, sampler, k, pair k or None)] in run order.

    Per (method, ranks) and trial, the samplers in :func:`~dali_nerf.bench.emulated.pair_order`
    and the floor (``ready``: the same training step with no data cost) between two of its groups
    (:func:`~dali_nerf.bench.emulated.with_floor`)."""
    plan, ok = [], list(samplers)
    for m in methods:
        for r in ranks:
            for t in range(trials):
                base = [s for s in ok if s != em.PIPELINED]
                order = em.pair_order(base, t) if em.PIPELINED in ok else [(s, -1) for s in base]
                order = em.with_floor(order, t)
                pk = {g: i for i, (s, g) in enumerate(order) if s == em.PIPELINED}
                for i, (s, g) in enumerate(order):
                    plan.append((m, r, t, s, i, pk.get(g) if s != em.PIPELINED else None))
    return plan


def cell_steps(cfg: Config, method: str, sampler: str, ranks: int) -> tuple:
    """(warm-up, timed steps) of a CPU cell: ``bench.warmup`` and ``bench.steps``; for the DALI
    sources (``rays``, ``rays_sync``) both rounded up to whole runs of the rank's plan (K steps a
    run), so the timed steps start at a run boundary and hold every run's cost once per K steps."""
    b = cfg.bench
    if sampler not in em.RAY_SOURCES:
        return b.warmup, b.steps
    cells = ()
    if method == "ss":
        n = cfg.partition.num_cells
        cells = tuple(range(max(1, n // ranks)))
        plan = plan_from_config(cfg, 0, ranks, local_ranks=ranks, cells=cells, num_cells=n)
    else:
        plan = plan_from_config(cfg, 0, ranks, local_ranks=ranks)
    k = plan.steps_per_run
    return k * -(-b.warmup // k), k * -(-b.steps // k)


def run_grid(cfg: Config, config_path: str, overrides: Sequence[str], log=print):
    """Run every CPU cell of ``cfg.bench`` ``bench.trials`` times, each run a trainer process, in
    the rotated order of :func:`cpu_plan`, at :func:`cell_steps`; each run folder gets a
    ``study.json`` (trial, order, pair, the cores it ran on).

    Returns (run folders that finished, [(cell name, one-line reason, log file)] of those that
    failed); the report lists the failed ones. Every cell failing raises
    :class:`DaliNerfError` naming the first log file."""
    b = cfg.bench
    root = Path(cfg.train.runs_dir)
    root.mkdir(parents=True, exist_ok=True)
    dirs, failed = [], []
    plan = cpu_plan(b.methods, b.samplers, b.ranks, b.trials)
    cores = host_cores()
    for i, (m, r, t, s, k, pk) in enumerate(plan):
        name = _cell_name(m, s, r, t, k)
        warm, steps = cell_steps(cfg, m, s, r)
        ov = list(overrides) + [f"method={m}", f"pipeline.name={s}", f"train.steps={warm + steps}",
                                f"bench.warmup={warm}", f"bench.steps={steps}",
                                f"name={name}", "train.eval_images=1", "train.checkpoint_every=0",
                                f"train.log_every={warm + steps}"]
        module = "dali_nerf.trainers.ddp" if m == "ddp" else "dali_nerf.trainers.spatial"
        if r == 1:
            cmd = [sys.executable, "-m", module]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={r}", "-m", module]
        cmd += ["--config", str(config_path)] + ov
        logf = root / f"{name}.log"
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env.pop("DALI_NERF_PROGRESS", None)
        t0 = time.perf_counter()
        with open(logf, "w") as f:
            f.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
            f.flush()
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        if rc != 0:
            lines = [l for l in logf.read_text().splitlines()[1:] if l.strip() and not l.startswith(("W", "[W"))]
            said = [l for l in lines if l.startswith("error:")][:1] or lines[-1:]  # the trainer's one-line error
            reason = f"exit {rc}: {said[0][:300] if said else 'no output'}"
            failed.append((name, reason, str(logf)))
            log(f"[{i + 1}/{len(plan)}] {name}: FAILED ({reason}); log {logf}")
            continue
        pair = _cell_name(m, em.PIPELINED, r, t, pk) if pk is not None else None
        atomic_write_text(root / name / "study.json", json.dumps({"trial": t, "order": k, "pair": pair, "device": "cpu",
                                                                  "cores": cores}))
        log(f"[{i + 1}/{len(plan)}] {name}: {time.perf_counter() - t0:.1f} s")
        dirs.append(root / name)
    if not dirs and failed:
        first = failed[0]
        raise DaliNerfError(f"every study cell failed; first: {first[0]} ({first[1]}) — log: {first[2]}")
    return dirs, failed


def launch_cores(b, ranks: int, usable: int) -> List[Optional[int]]:
    """The core counts of the launches at ``ranks`` ranks: None (every usable core) for 0 or a
    count of at least ``usable`` in ``bench.emulated_cores``, and each smaller count N with
    ``ranks <= N`` (at least 1 core per GPU); in that order, without repeats.

    >>> launch_cores(type("B", (), {"emulated_cores": [0, 1]}), 1, 2), launch_cores(type("B", (), {"emulated_cores": [0, 1]}), 2, 2)
    ([None, 1], [None])
    """
    out: List[Optional[int]] = []
    for c in b.emulated_cores or [0]:
        c = None if c == 0 or c >= usable else int(c)
        if (c is None or ranks <= c) and c not in out:
            out.append(c)
    return out


def emulated_launches(cfg, steps, usable: int) -> List[dict]:
    """Every emulated launch of the study, in run order: [{"name", "method", "ranks", "cores" (None:
    every usable core), "cells" [(step name, ms, rays)], "check" [...], "grid", "scene"}].

    The main grid: for each method, each of its ``bench.emulated_ranks[_ss]`` and each core count of
    :func:`launch_cores`, every (device step, rays) of ``steps`` (SS: at ``bench.rays_ss`` where given;
    DDP at ``bench.check_ranks`` on
    every core also the check cells, :func:`~dali_nerf.bench.study.steps.check_steps`). Then the
    cache-effect row: DDP at ``bench.small_ranks`` on every core, on ``bench.small_scene``, at the
    headline's step and ``bench.small_rays`` (the first of the grid's rays when empty)."""
    b = cfg.bench
    rays = grid_rays(cfg)
    out = []
    for m in b.methods:
        mr = [r for r in rays if m == "ddp" or not b.rays_ss or r in b.rays_ss]
        cells = [(s.name, s.ms[r], r) for s in steps for r in mr if r in s.ms]
        for W in (b.emulated_ranks if m == "ddp" else b.emulated_ranks_ss):
            for c in launch_cores(b, W, usable):
                chk = check_steps(cfg) if (m == "ddp" and W in b.check_ranks and c is None) else []
                out.append({"name": f"emu_{m}_{W}" + (f"_c{c}" if c else ""), "method": m, "ranks": W, "cores": c,
                            "cells": cells, "check": chk, "grid": "main", "scene": cfg.scene.path})
    head = headline_step(steps)
    small = [(head.name, head.ms[r], r) for r in (b.small_rays or rays[:1]) if r in head.ms] if head else []
    if b.small_scene and small and "ddp" in b.methods:
        out.append({"name": f"emu_ddp_{b.small_ranks}_small", "method": "ddp", "ranks": b.small_ranks, "cores": None,
                    "cells": small, "check": [], "grid": "cache", "scene": b.small_scene})
    return out


def run_emulated(cfg: Config, grad_bytes: int, steps, log=print) -> dict:
    """The emulated launches of :func:`emulated_launches` (each pinned to its cores), each running the
    floor and ``bench.emulated_samplers`` at every cell, ``bench.trials`` times in rotation. A launch
    that fails is recorded and the others run.

    Returns {"dirs": [segment folders], "launches": [{"method", "ranks", "cores", "wall_s",
    "barrier_s", "budget", "segments", "demoted", "cells", "grid", "scene"}], "failed": [(launch,
    reason, log)], "links", "grad_bytes"}."""
    b = cfg.bench
    links = DeviceLinks()
    gb = int(b.emulated_grad_bytes or grad_bytes)
    root = Path(cfg.train.runs_dir)
    dirs, launches, failed = [], [], []
    for la in emulated_launches(cfg, steps, host_cores()):
        m, W, c, name = la["method"], la["ranks"], la["cores"], la["name"]
        lcfg = dataclasses.replace(cfg, scene=dataclasses.replace(cfg.scene, path=la["scene"]))
        budget = em.launch_budget(lcfg, W, c)
        segs = em.schedule(b.emulated_samplers, la["cells"], b.trials, check=la["check"], grid=la["grid"])
        out = root / name
        if out.exists():
            shutil.rmtree(out)
        try:
            r = em.launch(lcfg, m, W, segs, out, budget, links, gb, b.emulated_steps, b.emulated_warmup,
                          cpus=first_cores(c) if c else None)
        except DaliNerfError as e:
            failed.append((name, str(e), str(out)))
            log(f"emulated {name}: FAILED ({e})")
            continue
        log(f"emulated {name} ({m} x{W} on {budget.cores} cores): {len(segs)} segments in {r['wall_s']:.1f} s "
            f"(lockstep barrier {r['barrier_s'] * 1e6:.0f} us)")
        dirs += r["dirs"]
        if r["demoted"]:
            log(f"emulated {name}: starved background samplers returned to normal priority: {'; '.join(r['demoted'])}")
        launches.append({"method": m, "ranks": W, "cores": budget.cores, "wall_s": r["wall_s"],
                         "barrier_s": r["barrier_s"], "budget": dataclasses.asdict(budget),
                         "segments": len(segs), "demoted": r["demoted"], "cells": W if m == "ss" else None,
                         "grid": la["grid"], "scene": str(la["scene"])})
    return {"dirs": dirs, "launches": launches, "failed": failed, "links": links.lines(), "grad_bytes": gb}


def launch_budgets(cfg, steps) -> List[tuple]:
    """(sampler threads, rays per run) of every emulated launch's host budget (the control's own cost
    is measured at each: :mod:`dali_nerf.bench.study.control`)."""
    out = set()
    for la in emulated_launches(cfg, steps, host_cores()):
        bu = em.launch_budget(cfg, la["ranks"], la["cores"])
        out.add((bu.threads, bu.rays_per_run))
    return sorted(out)


# ---------------------------------------------------------------------------------------------
# sampling micro-benchmark (independent of the training runs: the cost model is checked on them)


def _time_source(cfg: Config, scene, batches: int, cpu: Optional[list] = None) -> float:
    """Wall seconds per batch of ``cfg.pipeline.name`` alone; ``cpu``: appends the process CPU
    seconds per batch (every thread: the loader's DALI and hand-over threads too)."""
    warm = 2
    if cfg.pipeline.name in em.RAY_SOURCES:  # cover several DALI runs, not just pops of one prefetched run,
        per_run = plan_from_config(cfg).steps_per_run  # after the first runs; whole runs
        batches = per_run * max(8, -(-batches // per_run))
        warm = 3 * per_run
    src = build_source(cfg, scene, 0, 1)
    try:
        it = iter(src)
        for _ in range(warm):
            next(it)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(batches):
            next(it)
        if cpu is not None:
            cpu.append((time.process_time() - c0) / batches)
        return (time.perf_counter() - t0) / batches
    finally:
        if hasattr(src, "close"):
            src.close()


def measure_sampling(cfg: Config, sizes: Sequence[int], batches: int = 20) -> dict:
    """Seconds per batch of the synchronous sampler (sync_local, world size 1, train.torch_threads), of our
    pipelined loader with no consumer (its production rate) and of the same loader synchronous
    (rays_sync: sampling and the copy out of DALI's buffers, in the calling thread), at each batch
    size; then the per-core scaling (:func:`measure_scaling`).

    Returns {"sizes", "sync_s" [...], "loader_s" [...], "loader_cpu_s" [...] (process CPU seconds per
    batch, all threads), "rays_sync_s" [...], "sync_cores", "loader_cores", "scaling", "profile"
    (a :class:`~dali_nerf.bench.costmodel.SamplingProfile`, per-core costs)}."""
    sc = cfg.scene
    scene = load_scene(sc.path, split=sc.train_split, format=sc.format, downscale=sc.downscale, background=sc.background)
    cores = host_cores()
    threads = cfg.train.torch_threads or cores  # as the trainer's rank would run it
    torch.set_num_threads(threads)
    out = {"sizes": list(sizes), "sync_s": [], "loader_s": [], "loader_cpu_s": [], "rays_sync_s": []}
    for b in sizes:
        c = copy.deepcopy(cfg)
        c.pipeline.rays_per_batch = int(b)
        c.pipeline.name = "sync_local"
        out["sync_s"].append(_time_source(c, scene, batches))
        c.pipeline.name = "rays"
        out["loader_s"].append(_time_source(c, scene, batches, cpu=out["loader_cpu_s"]))
        c.pipeline.name = em.SYNC_CONTROL
        out["rays_sync_s"].append(_time_source(c, scene, batches))
    out["sync_cores"] = threads
    out["loader_cores"] = min(plan_from_config(cfg).threads, cores)
    out["scaling"] = measure_scaling(cfg, scene, cores, batches)
    torch.set_num_threads(threads)
    out["profile"] = sampling_profile(out, cores)
    return out


def measure_scaling(cfg: Config, scene, cores: int, batches: int = 20, rounds: int = 3) -> dict:
    """How sampling scales with the cores it is given, at ``pipeline.rays_per_batch``: seconds per
    batch with 1 and with ``cores`` threads (torch threads for sync_local; DALI threads, at the host
    budget's run size for that many threads, for the loader and rays_sync), on this host, the best
    of ``rounds`` interleaved rounds (a shared host's other work only ever slows a round down). The
    cost model's per-core costs assume linear scaling; this measures it up to this host's cores.

    Returns {"rays", "threads" [1, cores], "sync_s", "loader_s", "rays_sync_s" (lists by threads),
    "rounds", "efficiency" {"sync", "loader", "rays_sync"}: time at 1 thread / (cores x time at
    ``cores``), 1 = linear; None on a 1-core host}."""
    B = int(cfg.pipeline.rays_per_batch)
    ns = [1] + ([cores] if cores > 1 else [])
    keys = (("sync_local", "sync_s"), ("rays", "loader_s"), (em.SYNC_CONTROL, "rays_sync_s"))
    best = {(n, k): float("inf") for n in ns for _, k in keys}
    for _ in range(rounds):
        for n in ns:
            c = copy.deepcopy(cfg)
            c.pipeline.rays_per_batch, c.pipeline.num_threads, c.pipeline.rays_per_run = B, n, run_size(B, n)
            torch.set_num_threads(n)
            for name, key in keys:
                c.pipeline.name = name
                best[(n, key)] = min(best[(n, key)], _time_source(c, scene, batches))
    out = {"rays": B, "threads": ns, "rounds": rounds} | {k: [best[(n, k)] for n in ns] for _, k in keys}
    out["efficiency"] = ({k: out[f"{k}_s"][0] / (ns[-1] * out[f"{k}_s"][-1]) for k in ("sync", "loader", "rays_sync")}
                         if len(ns) > 1 else None)
    return out


def sampler_table(cfg: Config) -> Optional[dict]:
    """The ``dali-nerf bench sampler`` measurements on the study's scene at its grid's batch sizes
    (:func:`~dali_nerf.bench.sampler.measure_table`, ``bench.sampler_seconds`` per measurement; 0
    skips it): {"command", "result"}, kept in derived.json (the report's table is printed from it)."""
    if cfg.bench.sampler_seconds <= 0:
        return None
    batches = ",".join(str(b) for b in sorted(set(grid_rays(cfg))))
    scene = load_scene(cfg.scene.path, split="train")
    res = sb.measure_table(scene, [int(b) for b in batches.split(",")], cfg.bench.sampler_seconds)
    cmd = f"dali-nerf bench sampler --scene {cfg.scene.path} --batches {batches} --seconds {cfg.bench.sampler_seconds:g}"
    return {"command": cmd, "result": res}
