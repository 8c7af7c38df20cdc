"""What the study runs: the CPU grid (each cell a trainer process), the emulated launches (one per
method and world size, :mod:`dali_nerf.bench.emulated`), the sampling micro-benchmark for the cost
model, and the ``dali-nerf bench sampler`` table.

>>> dirs, failed = run_grid(cfg, "configs/study.yaml", overrides)
>>> emulation = run_emulated(cfg, grad_bytes)          # {"dirs", "launches", "links", "grad_bytes"}
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ...atomic import atomic_write_text
from ...config import Config
from ...emulation import DeviceLinks
from ...errors import DaliNerfError
from ...hostbudget import HostBudget
from ...plan import plan_from_config
from ...scenes import load_scene
from ...sources import build_source
from .. import emulated as em
from .. import sampler as sb
from .model import sampling_profile

__all__ = ["cpu_plan", "run_grid", "run_emulated", "measure_sampling", "sampler_table"]


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


def run_grid(cfg: Config, config_path: str, overrides: Sequence[str], log=print):
    """Run every CPU cell of ``cfg.bench`` ``bench.trials`` times, each run a trainer process, in
    the rotated order of :func:`cpu_plan`; each run folder gets a ``study.json`` (trial, order,
    pair).

    Returns (run folders that finished, [(cell name, one-line reason, log file)] of those that
    failed); the report lists the failed ones. Every cell failing raises
    :class:`DaliNerfError` naming the first log file."""
    b = cfg.bench
    root = Path(cfg.train.runs_dir)
    root.mkdir(parents=True, exist_ok=True)
    dirs, failed = [], []
    plan = cpu_plan(b.methods, b.samplers, b.ranks, b.trials)
    for i, (m, r, t, s, k, pk) in enumerate(plan):
        name = _cell_name(m, s, r, t, k)
        ov = list(overrides) + [f"method={m}", f"pipeline.name={s}", f"train.steps={b.warmup + b.steps}",
                                f"name={name}", "train.eval_images=1", "train.checkpoint_every=0",
                                f"train.log_every={b.warmup + b.steps}"]
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
            tail = [l for l in logf.read_text().splitlines() if l.strip() and not l.startswith(("W", "[W"))][-1:]
            reason = f"exit {rc}: {tail[0][:300] if tail else 'no output'}"
            failed.append((name, reason, str(logf)))
            log(f"[{i + 1}/{len(plan)}] {name}: FAILED ({reason}); log {logf}")
            continue
        pair = _cell_name(m, em.PIPELINED, r, t, pk) if pk is not None else None
        atomic_write_text(root / name / "study.json", json.dumps({"trial": t, "order": k, "pair": pair, "device": "cpu"}))
        log(f"[{i + 1}/{len(plan)}] {name}: {time.perf_counter() - t0:.1f} s")
        dirs.append(root / name)
    if not dirs and failed:
        first = failed[0]
        raise DaliNerfError(f"every study cell failed; first: {first[0]} ({first[1]}) — log: {first[2]}")
    return dirs, failed


def launch_budget(cfg: Config, ranks: int) -> HostBudget:
    """The budget of an emulated launch of ``ranks`` ranks on this host: the host budget for that
    many local ranks (whatever ``pipeline.num_threads`` / ``rays_per_run`` the CPU rows use), at
    ``pipeline.thread_priority`` resolved for emulated devices (:func:`dali_nerf.plan.plan_from_config`)."""
    emu = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, num_threads=0, rays_per_run=0),
                              train=dataclasses.replace(cfg.train, device="emulated"))
    plan = plan_from_config(emu, 0, ranks, local_ranks=ranks)
    return dataclasses.replace(plan.budget, priority=plan.priority)


def run_emulated(cfg: Config, grad_bytes: int, log=print) -> dict:
    """The emulated launches: for each method and its ``bench.emulated_ranks[_ss]``, one launch
    running the floor and ``bench.emulated_samplers`` at every ``bench.emulated_step_ms``,
    ``bench.trials`` times in rotation (DDP at ``bench.check_ranks`` also the ``bench.check_rays``
    segments, once).

    Returns {"dirs": [segment folders], "launches": [{"method", "ranks", "wall_s", "barrier_s",
    "budget", "segments"}]}."""
    b = cfg.bench
    B = cfg.pipeline.rays_per_batch
    links = DeviceLinks()
    gb = int(b.emulated_grad_bytes or grad_bytes)
    root = Path(cfg.train.runs_dir)
    dirs, launches = [], []
    for m in b.methods:
        for W in (b.emulated_ranks if m == "ddp" else b.emulated_ranks_ss):
            budget = launch_budget(cfg, W)
            segs = em.schedule(b.emulated_samplers, b.emulated_step_ms, b.trials, B,
                               check_rays=b.check_rays if (m == "ddp" and W in b.check_ranks) else (),
                               check_step_ms=b.check_step_ms)
            out = root / f"emu_{m}_{W}"
            if out.exists():
                shutil.rmtree(out)
            r = em.launch(cfg, m, W, segs, out, budget, links, gb, b.emulated_steps, b.emulated_warmup)
            log(f"emulated {m} x{W}: {len(segs)} segments in {r['wall_s']:.1f} s "
                f"(lockstep barrier {r['barrier_s'] * 1e6:.0f} us)")
            dirs += r["dirs"]
            if r["demoted"]:
                log(f"emulated {m} x{W}: starved background samplers returned to normal priority: "
                    f"{'; '.join(r['demoted'])}")
            launches.append({"method": m, "ranks": W, "wall_s": r["wall_s"], "barrier_s": r["barrier_s"],
                             "budget": dataclasses.asdict(budget), "segments": len(segs), "demoted": r["demoted"],
                             "cells": W if m == "ss" else None})
    return {"dirs": dirs, "launches": launches, "links": links.lines(), "grad_bytes": gb}


# ---------------------------------------------------------------------------------------------
# sampling micro-benchmark (independent of the training runs: the cost model is checked on them)


def _time_source(cfg: Config, scene, batches: int, cpu: Optional[list] = None) -> float:
    """Wall seconds per batch of ``cfg.pipeline.name`` alone; ``cpu``: appends the process CPU
    seconds per batch (every thread: the loader's DALI and hand-over threads too)."""
    warm = 2
    if cfg.pipeline.name == "rays":  # cover several DALI runs, not just pops of one prefetched run,
        per_run = plan_from_config(cfg).steps_per_run  # after the first runs
        batches = max(batches, 8 * per_run)
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
    """Seconds per batch of the synchronous sampler (sync_local, world size 1, train.torch_threads) and of our
    pipelined loader with no consumer (its production rate), at each batch size.

    Returns {"sizes", "sync_s" [...], "loader_s" [...], "loader_cpu_s" [...] (process CPU seconds per
    batch, all threads), "sync_cores", "loader_cores", "profile"
    (a :class:`~dali_nerf.bench.costmodel.SamplingProfile`, per-core costs)}."""
    sc = cfg.scene
    scene = load_scene(sc.path, split=sc.train_split, format=sc.format, downscale=sc.downscale, background=sc.background)
    cores = os.cpu_count() or 1
    threads = cfg.train.torch_threads or cores  # as the trainer's rank would run it
    torch.set_num_threads(threads)
    out = {"sizes": list(sizes), "sync_s": [], "loader_s": [], "loader_cpu_s": []}
    for b in sizes:
        c = copy.deepcopy(cfg)
        c.pipeline.rays_per_batch = int(b)
        c.pipeline.name = "sync_local"
        out["sync_s"].append(_time_source(c, scene, batches))
        c.pipeline.name = "rays"
        out["loader_s"].append(_time_source(c, scene, batches, cpu=out["loader_cpu_s"]))
    out["sync_cores"] = threads
    out["loader_cores"] = min(plan_from_config(cfg).threads, cores)
    out["profile"] = sampling_profile(out, cores)
    return out


def sampler_table(cfg: Config) -> Optional[str]:
    """The ``dali-nerf bench sampler`` table (markdown) on the study's scene, at the study's batch
    size and 65536 (``bench.sampler_seconds`` per measurement; 0 skips it)."""
    if cfg.bench.sampler_seconds <= 0:
        return None
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "sampler.md"
        ns = argparse.Namespace(scene=cfg.scene.path, batches=f"{cfg.pipeline.rays_per_batch},65536",
                                seconds=cfg.bench.sampler_seconds, out=str(out))
        sb.main(ns)
        text = out.read_text()
    cmd = (f"dali-nerf bench sampler --scene {cfg.scene.path} --batches {ns.batches} --seconds {ns.seconds:g}")
    return f"`{cmd}` (run by the study):\n\n" + text.split("\n", 2)[-1]
