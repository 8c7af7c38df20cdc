"""The study's emulated-device launches: one launch per (method, ranks) runs every sampler, device
step, batch size and trial in-process, in rotation (:func:`schedule`).

``launch`` spawns W rank processes (``multiprocessing`` spawn, no torch.distributed): each builds
its real batch sources once (decode, DALI pipelines, worker processes), then runs the segments in
order; a segment is ``warmup + steps`` steps of :func:`dali_nerf.train.emulation.emulated_step` with one
source at one device step (the device time of a step of the segment's rays, named by what it
stands for: :mod:`dali_nerf.bench.study.steps`), and writes ``<out>/<segment>/metrics.jsonl`` (rank 0),
``metrics.rank<R>.jsonl``, ``config.yaml`` and ``study.json`` — the layout
:func:`dali_nerf.bench.study.read_run` reads. Label of every such row:
:data:`~dali_nerf.train.emulation.EMULATED_LABEL`.

Lockstep: a :class:`~dali_nerf.train.emulation.LockstepBarrier` (POSIX semaphores in shared memory, no sockets): every
segment starts with one; in DDP every step's all-reduce is emulated as this barrier (its
rendezvous: slower ranks hold the others, as NCCL does) plus the link's all-reduce time;
``sync_global`` scatters through shared memory after one. Its own cost — W ranks calling it back to
back with no work — is measured at the start of each launch and reported.

Budgets (equal for every sampler): ``threads`` sampler threads per rank from
:func:`dali_nerf.data.hostbudget.host_budget` (DALI threads for ``rays`` and ``rays_sync``, worker
processes for ``torch_workers``, the training thread's torch threads for ``sync_*``), the same run
size for the DALI sources, and ``train.torch_threads`` for the rank's own thread. A launch may be
pinned to a subset of the host's cores (``launch(..., cpus=...)``: the ranks inherit the CPU
affinity, read their budget from it and refuse one that differs from the launch's), which names
its regime by cores per GPU. The DALI sources are timed over whole runs from a run boundary
(:func:`dali_nerf.train.emulated.warmup_steps`, :func:`~dali_nerf.train.emulated.whole_runs`).

SS: one cell per rank (``ss_grid(W)`` cells), every rank holding all images.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import queue as _queue
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import yaml

from dali_nerf.train.emulated import warmup_steps, whole_runs
from dali_nerf.train.emulation import DeviceLinks, EmulatedDevice, LockstepBarrier, PhaseTimer, emulated_step
from dali_nerf.errors import DaliNerfError
from dali_nerf.launch_env import children_env
from dali_nerf.data.hostbudget import HostBudget, pinned
from dali_nerf.data.imagecache import CacheStore
from dali_nerf.partition import Partition
from dali_nerf.data.plan import SamplingPlan, plan_from_config
from dali_nerf.scenes import scene_from_config
from dali_nerf.sources import make_source
from dali_nerf.sources.runner import was_demoted
from dali_nerf.sources.shm_scatter import ShmLink, ShmScatter

__all__ = ["Segment", "schedule", "pair_order", "with_floor", "launch", "launch_budget", "ss_grid", "segment_plan",
           "FLOOR", "PIPELINED",
           "SYNC_CONTROL", "RAY_SOURCES"]

FLOOR = "ready"
"""Sampler name of the emulation floor (a source that hands out a ready batch)."""
PIPELINED = "rays"
SYNC_CONTROL = "rays_sync"
"""The same sampler as :data:`PIPELINED`, synchronous in the training thread (the overlap's control)."""
RAY_SOURCES = (PIPELINED, SYNC_CONTROL)
"""The sources of our DALI ray graph: timed over whole runs."""


@dataclass(frozen=True)
class Segment:
    name: str
    trial: int
    step_ms: float
    sampler: str
    rays: int
    order: int
    """Position in the launch (0-based)."""
    pair: Optional[str] = None
    """For a baseline: the name of the pipelined segment next to it (its speedup pair)."""
    step_name: str = ""
    """The device step's name (what ``step_ms`` stands for: :mod:`dali_nerf.bench.study.steps`)."""
    grid: str = "main"
    """Which part of the study the segment is: main (the grid), check (the cost model's check
    segments, run once) or cache (the small scene's cache-effect row)."""


def pair_order(baselines: Sequence[str], trial: int, pipelined: str = PIPELINED) -> List[Tuple[str, int]]:
    """One rotation's order: [(sampler, group)]; each group is ``b P b`` (or ``b P``), so every
    baseline runs next to the pipelined run of its group. Baselines rotate by ``trial`` and groups
    rotate by ``trial`` (one baseline: the pair is reversed on odd trials), so no sampler is always
    first or last.

    >>> [s for s, _ in pair_order(["g", "l", "w"], 0)]
    ['g', 'rays', 'l', 'w', 'rays']
    >>> [s for s, _ in pair_order(["g", "l", "w"], 1)]
    ['g', 'rays', 'l', 'rays', 'w']
    >>> [s for s, _ in pair_order(["g", "l"], 1)]
    ['l', 'rays', 'g']
    """
    b = list(baselines)
    if not b:
        return [(pipelined, 0)]
    r = trial % len(b)
    b = b[r:] + b[:r]
    groups = []
    for i in range(0, len(b), 2):
        g = b[i:i + 2]
        groups.append([g[0], pipelined] + g[1:])
    k = trial % len(groups)
    groups = groups[k:] + groups[:k]
    out = []
    for gi, g in enumerate(groups):
        if trial % 2 and len(b) == 1:
            g = g[::-1]
        out += [(s, gi) for s in g]
    return out


def with_floor(order: List[Tuple[str, int]], trial: int) -> List[Tuple[str, int]]:
    """``order`` (of :func:`pair_order`) with the floor inserted between two groups (never between
    a baseline and its pair), at a position rotated by ``trial``.

    >>> [s for s, _ in with_floor([("g", 0), ("rays", 0)], 1)]
    ['g', 'rays', 'ready']
    """
    cuts = [0] + [i for i in range(1, len(order)) if order[i][1] != order[i - 1][1] or order[i][1] < 0] + [len(order)]
    out = list(order)
    out.insert(cuts[trial % len(cuts)], (FLOOR, -1))
    return out


def schedule(samplers: Sequence[str], cells: Sequence[tuple], trials: int,
             check: Sequence[tuple] = (), grid: str = "main") -> List[Segment]:
    """Every segment of one launch, in run order.

    ``cells``: [(device step name, device ms per step, rays per GPU)]: the launch's grid. Per trial,
    the cells in an order rotated by the trial; per cell the samplers in :func:`pair_order` and the
    floor between two of its groups (a position rotated by the trial); ``grid`` labels them. Then,
    once, each of ``check`` (the same kind of cells: the cost model's out-of-sample check at other
    batch sizes), labelled "check": the floor and the samplers once each, in :func:`pair_order`'s
    order.

    >>> [(s.sampler, s.step_ms, s.rays) for s in schedule(["rays"], [("a", 2.0, 4096)], 1)]
    [('ready', 2.0, 4096), ('rays', 2.0, 4096)]
    """
    base = [s for s in samplers if s != PIPELINED]
    has_p = PIPELINED in samplers
    segs: List[Segment] = []

    def add(trial, cell, sampler, label):
        name_, ms, B = cell
        name = f"{sampler}_{_slug(name_)}_{ms:g}ms_b{B}_t{trial}_{len(segs)}"
        segs.append(Segment(name, trial, float(ms), sampler, int(B), len(segs), None, str(name_), label))

    def rotation(t):
        if has_p:
            return pair_order(base, t)
        r = t % max(1, len(base))
        return [(s, -1) for s in base[r:] + base[:r]]

    def add_all(t, cell, order, label):
        start = len(segs)
        pname = {}
        for s, g in order:
            add(t, cell, s, label)
            if s == PIPELINED:
                pname[g] = segs[-1].name
        for i, (s, g) in enumerate(order):
            if s not in (PIPELINED, FLOOR) and g in pname:
                segs[start + i] = dataclasses.replace(segs[start + i], pair=pname[g])

    cells = list(cells)
    for t in range(trials):
        k = t % len(cells) if cells else 0
        for cell in cells[k:] + cells[:k]:
            add_all(t, cell, with_floor(rotation(t), t), grid)
    for cell in check:  # with their own floor: the ideal of a lockstep pair needs one
        add_all(trials, cell, with_floor(rotation(0), 0), "check")
    return segs


def _slug(name: str) -> str:
    """A device step's name as part of a folder name."""
    return "".join(c if c.isalnum() or c == "." else "-" for c in name.replace(" ms", "ms")).strip("-") or "step"


def ss_grid(ranks: int) -> List[int]:
    """The SS partition grid of the emulated launches: one cell per rank, as square as possible."""
    a = int(ranks ** 0.5)
    while ranks % a:
        a -= 1
    return [ranks // a, a]


# ---------------------------------------------------------------------------------------------
# the rank processes


def launch_budget(cfg, ranks: int, cores: Optional[int] = None) -> HostBudget:
    """The budget of an emulated launch of ``ranks`` ranks (on ``cores`` usable cores; None: this
    process's): the host budget for that many local ranks (whatever ``pipeline.num_threads`` /
    ``rays_per_run`` the CPU rows use), at ``pipeline.thread_priority`` resolved for emulated
    devices (:func:`dali_nerf.data.plan.plan_from_config`). A rank reads it again from its own affinity
    and refuses to run on another."""
    emu = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, num_threads=0, rays_per_run=0),
                              train=dataclasses.replace(cfg.train, device="emulated"))
    plan = plan_from_config(emu, 0, ranks, local_ranks=ranks, cores=cores)
    return dataclasses.replace(plan.budget, priority=plan.priority)


def segment_plan(cfg, B: int, rank: int, W: int, budget: HostBudget, partition=None) -> SamplingPlan:
    """The plan of every source of a launch at ``B`` rays: the launch's budget for all of them
    (the same sampler threads for every sampler: DALI threads, worker processes, the training
    thread's torch threads; the same run size for the DALI sources; its priority), iid rays on the
    host; SS (``partition``): cell ``rank`` (one cell per rank)."""
    p = cfg.pipeline
    seg = dataclasses.replace(cfg, pipeline=dataclasses.replace(
        p, rays_per_batch=int(B), mode="random", num_threads=budget.threads, rays_per_run=budget.rays_per_run,
        workers=budget.threads, thread_priority=budget.priority), train=dataclasses.replace(cfg.train, device="cpu"))
    ss = dict(cells=(rank,), num_cells=partition.num_cells) if partition is not None else {}
    return plan_from_config(seg, rank, W, **ss)


def launch_partition(cfg, method: str, scene, W: int):
    """SS launches: the ``ss_grid(W)`` grid of cells over the scene's cameras (one cell per rank); DDP: None."""
    if method != "ss":
        return None
    return Partition.from_config(dataclasses.replace(cfg.partition, kind="grid", grid=ss_grid(W)), scene)


def _make_source(cfg, method: str, sampler: str, B: int, rank: int, W: int, scene, store: CacheStore,
                 budget: HostBudget, link: ShmLink, partition=None):
    """A launch's batch source (from the registry: :func:`segment_plan`, caches shared by every
    sampler of the rank through ``store``)."""
    if sampler not in (FLOOR, "sync_local", "torch_workers", PIPELINED, SYNC_CONTROL, "sync_global"):
        raise DaliNerfError(f"bench.samplers: {sampler!r} has no emulated source for method {method}")
    plan = segment_plan(cfg, B, rank, W, budget, partition)
    return make_source(sampler, scene, plan, store=store, partition=partition, scatter=link)


def _write_segment(out: Path, seg: Segment, rank: int, recs: List[dict], meta: dict) -> None:
    d = out / seg.name
    d.mkdir(parents=True, exist_ok=True)
    name = "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"
    (d / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    if rank == 0:
        (d / "config.yaml").write_text(yaml.safe_dump(meta["config"], sort_keys=False))
        (d / "study.json").write_text(json.dumps(meta["study"], indent=1))


def _rank_main(rank: int, W: int, cfg, method: str, segments: List[Segment], out: str, barrier, buf,
               budget: HostBudget, links: DeviceLinks, grad_bytes: int, steps: int, warmup: int,
               timeout_s: float, msgs) -> None:
    out_p = Path(out)
    log = open(out_p / f"rank{rank}.log", "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sources: Dict[tuple, object] = {}
    try:
        torch.set_num_threads(max(1, budget.threads))
        bar = lambda: barrier.wait(timeout_s)  # noqa: E731
        own = launch_budget(cfg, W)  # from this process's CPU affinity (a pinned launch's ranks inherit it)
        if (own.cores, own.threads) != (budget.cores, budget.threads):
            raise DaliNerfError(f"rank {rank} may run on {own.cores} cores ({own.threads} sampler threads), the "
                                f"launch's budget is for {budget.cores} ({budget.threads}): pin the launch (cpus)")
        scene = scene_from_config(cfg)
        if not scene.has_bounds:
            raise DaliNerfError(f"{cfg.scene.path}: the emulated study needs a scene with near/far bounds (sync_global "
                                f"packs them); generate it with dali-nerf make-scene")
        # every sampler of the rank samples the same caches (shard / all images), decoded once
        part = launch_partition(cfg, method, scene, W)
        store = CacheStore(scene, segment_plan(cfg, cfg.pipeline.rays_per_batch, rank, W, budget, part))
        link = ShmLink(buf, bar, EmulatedDevice(0.0, links))
        for seg in segments:  # build every source before timing anything (decode, pipelines, workers)
            key = (seg.sampler, seg.rays)
            if key not in sources:
                sources[key] = _make_source(cfg, method, seg.sampler, seg.rays, rank, W, scene, store, budget, link,
                                            part)
        bar()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            bar()
        barrier_s = (time.perf_counter() - t0) / n
        lock = bar if (method == "ddp" and W > 1) else None
        for seg in segments:
            src = sources[(seg.sampler, seg.rays)]
            # step_ms is the device time of a step of seg.rays rays (a global-stream rank's share
            # varies a little from step to step: its compute with it)
            dev = EmulatedDevice(seg.step_ms, dataclasses.replace(links, ref_rays=seg.rays))
            if isinstance(src, ShmScatter):
                src.dev = dev
            # drain what the source prefetched while other segments ran; the DALI sources from a run
            # boundary, timed over whole runs (the same on every rank: their sources gave as many steps)
            before = int(src.stats().get("steps", 0)) if hasattr(src, "stats") else None  # batches it gave already
            warm = warmup_steps(seg.sampler, src, cfg.pipeline.prefetch, budget.threads, base=warmup)
            timed = whole_runs(seg.sampler, src, steps)
            bar()
            timer = PhaseTimer()
            recs = []
            for k in range(1, warm + timed + 1):
                emulated_step(src, dev, timer, on_device=isinstance(src, ShmScatter), lockstep=lock,
                              grad_bytes=grad_bytes, ranks=W)
                recs.append(timer.record(k, seg.rays))
            meta = {"config": {"name": seg.name, "method": method, "scene": {"path": str(cfg.scene.path)},
                               "pipeline": {"name": seg.sampler, "rays_per_batch": seg.rays, "num_threads": budget.threads,
                                            "rays_per_run": budget.rays_per_run, "stream": cfg.pipeline.stream,
                                            "prefetch": 0 if seg.sampler == SYNC_CONTROL else cfg.pipeline.prefetch},
                               "train": {"device": "emulated", "emulated_step_ms": seg.step_ms,
                                         "torch_threads": budget.threads},
                               "bench": {"warmup": warm, "steps": timed}},
                    "study": {"trial": seg.trial, "order": seg.order, "pair": seg.pair, "device": "emulated",
                              "emulated_step_ms": seg.step_ms, "step_name": seg.step_name, "grid": seg.grid,
                              "scene": str(cfg.scene.path), "ranks": W, "barrier_s": barrier_s,
                              "cores": own.cores, "source_steps_before": before,
                              "cells": W if method == "ss" else None, "grad_bytes": grad_bytes,
                              "budget": dataclasses.asdict(budget)}}
            _write_segment(out_p, seg, rank, recs, meta)
        # loaders whose background sampler was starved and returned to normal priority (StarvationGuard)
        demoted = sorted(f"{k[0]} ({k[1]} rays)" for k, src in sources.items() if was_demoted(src))
        msgs.put((rank, "ok", (barrier_s, demoted)))
    except BaseException as e:  # reported by the parent with this rank's log
        traceback.print_exc()
        msgs.put((rank, "error", f"{type(e).__name__}: {e}"))
        try:
            barrier.abort()
        except Exception:
            pass
    finally:
        for s in sources.values():
            try:
                s.close()
            except Exception:
                pass
        log.flush()


def launch(cfg, method: str, ranks: int, segments: List[Segment], out: Path, budget: HostBudget,
           links: DeviceLinks, grad_bytes: int, steps: int, warmup: int, timeout_s: float = 300.0,
           cpus: Optional[Sequence[int]] = None) -> dict:
    """Run ``segments`` on ``ranks`` spawned rank processes (pinned to ``cpus`` when given: the
    ranks inherit the affinity, and ``budget`` should be the host budget of that many cores);
    returns {"dirs" (segment folders),
    "barrier_s" (mean seconds of one lockstep barrier with no work, max over ranks), "wall_s",
    "demoted" (["rank R: sampler (B rays)"] for each background loader whose starved sampler
    returned to normal priority during the launch; empty when none did)}.

    Raises :class:`DaliNerfError` naming the failed rank's log when a rank fails."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    barrier = LockstepBarrier(ctx, ranks)
    maxB = max(s.rays for s in segments)
    buf = ctx.RawArray("B", ShmScatter.buffer_bytes(ranks, maxB))
    msgs = ctx.Queue()
    env_keep = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS",)}
    os.environ["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    procs = []
    try:
        with pinned(cpus), children_env(local_world_size=ranks):
            for r in range(ranks):
                p = ctx.Process(target=_rank_main, args=(r, ranks, cfg, method, segments, str(out), barrier, buf,
                                                         budget, links, grad_bytes, steps, warmup, timeout_s, msgs),
                                daemon=False)
                p.start()
                procs.append(p)
    finally:
        for k, v in env_keep.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    done: Dict[int, tuple] = {}
    err, t_err = None, None
    while len(done) < ranks:
        try:
            r, status, val = msgs.get(timeout=5.0)
            done[r] = (status, val)
            # the first failure that is not a broken barrier (the others' reaction to it) names the cause
            if status != "ok" and (err is None or err[1].startswith("BrokenBarrierError")):
                err, t_err = (r, val), t_err or time.perf_counter()
        except _queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in done]
            if dead:
                err = err or (dead[0], f"exit code {procs[dead[0]].exitcode}")
                break
            if t_err is not None and time.perf_counter() - t_err > 60:
                break  # a rank that neither finishes nor fails after another failed: give up on it
    for p in procs:
        p.join(timeout=30 if err is None else 5)
        if p.is_alive():
            p.terminate()
            p.join()
    if err is not None:
        raise DaliNerfError(f"emulated {method} x{ranks}: rank {err[0]} failed ({err[1]}); log {out / f'rank{err[0]}.log'}")
    return {"dirs": [out / s.name for s in segments], "wall_s": time.perf_counter() - t0,
            "barrier_s": max(v[0] for s, v in done.values()),
            "demoted": [f"rank {r}: {d}" for r in sorted(done) for d in done[r][1][1]]}
