"""``train.device=emulated``: the trainers' emulated-device mode.

    torchrun --nproc_per_node=8 trainers/ddp.py --config configs/ddp_objects.yaml \\
        train.device=emulated train.emulated_step_ms=2 train.steps=300

Each rank's forward/backward/optimizer is a timed wait of ``train.emulated_step_ms`` per 4096 rays
that releases the CPU (as a GPU kernel would), the host-to-device copy and (DDP) the gradient
all-reduce are waits at the :class:`~dali_nerf.train.emulation.DeviceLinks` figures, and everything on
the host is real: decode, the configured batch source (``pipeline.name``, its threads and queues),
and in ``sync_global`` rank 0 sampling every rank's batch, handed over through shared memory.
No model is trained: the run answers "can this host feed N GPUs of this step time with this
pipeline?" for the user's own scene and config. DDP ranks keep lockstep at every step's
all-reduce with a :class:`~dali_nerf.train.emulation.LockstepBarrier` over named semaphores (torchrun's
processes share no parent that could hand them one); its cost with no work is measured and
reported. All ranks must run on one host (the emulated GPUs share its cores).

The run times ``train.steps`` steps of the real source, closes it, then times
``train.emulated_floor_steps`` steps of a ready batch (the emulation floor: sleep overshoot and
scheduling of the ranks on these cores, with no source alive to fill its queues beside it); ``runs/<name>/metrics.jsonl`` has rank 0's steps (phases as the trainer writes them,
``"segment": "floor" | "source"``), ``summary.json`` the means after the warm-up (the batches the
source prefetched meanwhile drained first), the step against the floor, the stall of every rank,
and the label: "device compute emulated by a timed wait; host work real".
"""

from __future__ import annotations

import json
import time
from typing import List, Optional

import numpy as np
import torch.distributed as dist

from dali_nerf.atomic import atomic_write_text
from dali_nerf.config import Config
from dali_nerf.train.emulation import (EMULATED_LABEL, KEEPS_UP_STEP, DeviceLinks, EmulatedDevice, LockstepBarrier,
                                 PhaseTimer, emulated_step, keeps_up, model_grad_bytes, shared_block)
from dali_nerf.errors import ConfigError
from dali_nerf.interrupt import stop_signal
from dali_nerf.launch_env import launch_env
from dali_nerf.data.hostbudget import usable_cores
from dali_nerf.train.runtime import load_scenes, run_folder, setup_distributed, torch_threads_kept
from dali_nerf.data.plan import RAY_GRAPH_SOURCES
from dali_nerf.sources import floor_source
from dali_nerf.sources.runner import was_demoted
from dali_nerf.sources.registry import rank_feed
from dali_nerf.sources.shm_scatter import ShmLink, ShmScatter

__all__ = ["train_emulated", "warmup_steps", "whole_runs", "KEEPS_UP_STEP"]

def warmup_steps(sampler: str, source, prefetch: int, workers: int, base: int = 5) -> int:
    """Untimed steps before a source's timed ones: ``base`` plus the batches it may hold ready
    already (DALI's prefetch queue, the run-ahead queue and the run in hand; the workers' queues),
    so the timed steps see its steady state; for the DALI sources (``rays``, ``rays_sync``) then up
    to the next run boundary (:func:`whole_runs`), counted from the steps the source has given."""
    if sampler == "rays":
        base += (max(1, prefetch) + 2) * int(getattr(source, "steps_per_run", 1))
    elif sampler == "torch_workers":
        return base + max(1, workers) * max(1, prefetch) + 1
    if sampler in RAY_GRAPH_SOURCES:
        done = int(source.stats().get("steps", 0))
        base += -(done + base) % int(source.steps_per_run)
    return base


def whole_runs(sampler: str, source, steps: int) -> int:
    """Timed steps: ``steps``; for the DALI sources rounded up to whole runs of K steps, so every
    run's cost (synchronous: all on the step that starts the run) counts once per K steps: a window
    of 40 steps of 16-step runs holds 2 or 3 run starts, which skews the mean wait by ~20%."""
    if sampler not in RAY_GRAPH_SOURCES:
        return steps
    k = int(source.steps_per_run)
    return k * max(1, -(-int(steps) // k))


def _shared(env_rank: int, W: int, scatter_bytes: int):
    """(barrier, scatter block): made by rank 0, opened by name on the others (names sent once
    over the process group); (None, None) for one rank."""
    if W == 1:
        return None, None
    spec = [None]
    barrier = shm = None
    if env_rank == 0:
        barrier = LockstepBarrier.named(W)
        shm = shared_block(size=scatter_bytes) if scatter_bytes else None
        spec = [(barrier.spec, shm.name if shm is not None else None)]
    dist.broadcast_object_list(spec, src=0)
    if env_rank != 0:
        barrier = LockstepBarrier.attach(spec[0][0])
        shm = shared_block(spec[0][1]) if spec[0][1] else None
    dist.barrier()  # every rank holds the names before rank 0 could exit and unlink them
    return barrier, shm


def _run(sources, dev, timer, lock, grad_bytes: int, W: int, steps: int, on_device: bool, segment: str) -> List[dict]:
    recs = []
    for k in range(1, steps + 1):
        rays = 0
        for s in sources:
            b = emulated_step(s, dev, timer, on_device=on_device, lockstep=lock, grad_bytes=grad_bytes, ranks=W)
            rays += int(next(iter(b.values())).shape[0])
        recs.append(timer.record(k, rays) | {"segment": segment})
    return recs


def _mean_after(recs: List[dict], warm: int, key: str, n: Optional[int] = None) -> float:
    rows = recs[warm:warm + n if n else None] or recs[-1:]
    return float(np.mean([r[key] for r in rows]))


def train_emulated(cfg: Config, method, resume: bool = False) -> dict:
    """Run the emulated-device mode for ``method`` (a trainer's Method: ``ddp`` or ``ss``); returns
    the summary on rank 0, {} on the others. The checkpoint signal (``train.checkpoint_signal``)
    ends it as Ctrl-C does (it writes no checkpoints): cleanup, then exit 128 + the signal."""
    # setup_distributed sets torch's threads per rank; a caller's process gets them back
    with torch_threads_kept(), stop_signal(cfg.train.checkpoint_signal):
        return _train_emulated(cfg, method, resume)


def _train_emulated(cfg: Config, method, resume: bool) -> dict:
    if resume:
        raise ConfigError("--resume: train.device=emulated trains no model and writes no checkpoints; run without --resume")
    launch = launch_env()
    world, local = launch.world_size, launch.local_world_size
    if local != world:
        raise ConfigError(f"train.device=emulated: every rank must run on this host (the emulated GPUs share its "
                          f"cores); got WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}: use one node")
    env = setup_distributed("cpu", cfg.train.torch_threads)
    with run_folder(cfg.run_dir, env):  # rank 0 holds the run folder's lock to the end
        return _train_emulated_in(cfg, method, env)


def _train_emulated_in(cfg: Config, method, env) -> dict:
    """:func:`train_emulated` in its run folder."""
    t, p = cfg.train, cfg.pipeline
    W, rank = env.world_size, env.rank
    scene, _ = load_scenes(cfg, env)
    if p.name == "sync_global" and not scene.has_bounds:
        raise ConfigError(f"{cfg.scene.path}: sync_global under train.device=emulated needs a scene with near/far "
                          f"bounds; generate one with dali-nerf make-scene")
    # the rank's plan, resolved once (B from pipeline.global_batch; the sampler threads' priority for the
    # emulated device), and SS the cells of every rank; the sources sample on the host
    feed = rank_feed(cfg, scene, rank, W)
    if p.name == "sync_global" and feed.partition is not None and feed.partition.num_cells != W:
        raise ConfigError(f"pipeline.name=sync_global with train.device=emulated: needs one cell per rank "
                          f"({feed.partition.num_cells} cells, {W} ranks); set partition.grid so cells = ranks")
    links = DeviceLinks()
    dev = EmulatedDevice(t.emulated_step_ms, links)
    scatter = ShmScatter.buffer_bytes(W, feed.plan.rays_per_batch) if p.name == "sync_global" else 0
    barrier, shm = _shared(rank, W, scatter)
    try:
        return _train_emulated_shared(cfg, method, env, feed, links, dev, barrier, shm, scatter)
    except BaseException:  # an error or Ctrl-C: break the other ranks' waits, free the named semaphores and the block
        if barrier is not None:
            try:
                barrier.abort()
            except Exception:
                pass
        _release_shared(barrier, shm, rank)
        raise


def _release_shared(barrier, shm, rank: int) -> None:
    """Close this rank's views of the barrier and the scatter block (rank 0, their owner, also
    unlinks them). Idempotent."""
    if barrier is not None:
        barrier.close()
    if shm is not None:
        try:
            shm.close()
        except BufferError:  # a view of it still alive (an interrupted step): the mapping goes with the process
            pass
        if rank == 0:
            try:
                shm.unlink()  # the name goes now, mapped or not
            except FileNotFoundError:
                pass


def _train_emulated_shared(cfg: Config, method, env, feed, links, dev, barrier, shm, scatter: int) -> dict:
    """:func:`train_emulated` once the barrier and the scatter block exist."""
    t, p, plan = cfg.train, cfg.pipeline, feed.plan
    W, rank = env.world_size, env.rank
    timeout = 300.0
    bar = (lambda: barrier.wait(timeout)) if barrier is not None else (lambda: None)
    buf = shm.buf if shm is not None else (bytearray(scatter) if scatter else None)
    sources, ready = [], []
    try:
        sources = feed.build(scatter=ShmLink(buf, bar, dev))  # sync_global: through the shared block
        n_sources = len(sources)
        grad_bytes = model_grad_bytes(cfg.model) if method.name == "ddp" else 0
        lock = bar if (method.name == "ddp" and W > 1) else None
        on_device = p.name == "sync_global"  # the scatter delivers to the device (its copy waits are inside)
        bar()
        n = 200 if W > 1 else 0
        t0 = time.perf_counter()
        for _ in range(n):
            bar()
        barrier_s = (time.perf_counter() - t0) / n if n else 0.0
        # the floor's batch: the source's first (its timed steps come after its warm-up anyway)
        ready = [floor_source(next(s)) for s in sources]
        warm = max(warmup_steps(p.name, s, p.prefetch, p.workers) for s in sources)
        warm = min(warm, t.steps // 2)  # a short run keeps half its steps timed (summary: warmup_steps)
        # the DALI sources: whole runs of the timed steps that fit (all of them when not one run fits)
        whole = whole_runs(p.name, sources[0], 1)
        timed = (t.steps - warm) // whole * whole or (t.steps - warm)
        bar()
        recs = _run(sources, dev, PhaseTimer(), lock, grad_bytes, W, t.steps, on_device, "source")
        bar()
        demoted = any(was_demoted(s) for s in sources)  # starved: back to normal
    finally:
        for s in sources:
            try:
                s.close()
            except Exception:
                pass
        sources = None  # with their views of the shared block
    # the floor after the sources closed: no host work but the ranks' own (a source alive beside it
    # would fill its queues meanwhile and slow the floor)
    fw = 5
    floor = _run(ready, dev, PhaseTimer(), lock, grad_bytes, W, fw + t.emulated_floor_steps, False, "floor") \
        if t.emulated_floor_steps else []
    ready = None
    bar()
    mine = {"rank": rank, "step_s": _mean_after(recs, warm, "step_s", timed),
            "wait_s": _mean_after(recs, warm, "wait_s", timed), "cpu_s": _mean_after(recs, warm, "cpu_s", timed),
            "floor_step_s": _mean_after(floor, fw, "step_s") if floor else None,
            "floor_cpu_s": _mean_after(floor, fw, "cpu_s") if floor else None, "demoted": demoted}
    everyone = [None] * W
    if W > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    if barrier is not None:
        dist.barrier()  # every rank is done with the shared block before its owner closes it
    buf = None
    _release_shared(barrier, shm, rank)
    if env.distributed:
        dist.destroy_process_group()
    if rank != 0:
        return {}
    with open(cfg.run_dir / "metrics.jsonl", "w") as f:
        for r in recs + floor:
            f.write(json.dumps(r) + "\n")
    step_s = float(np.mean([e["step_s"] for e in everyone]))
    floor_s = float(np.mean([e["floor_step_s"] for e in everyone])) if floor else None
    stalls = [e["wait_s"] / max(e["step_s"], 1e-12) for e in everyone]
    cores = usable_cores()
    # the share of the host's cores the ranks' processes kept busy (all their threads), per step
    util = sum(e["cpu_s"] for e in everyone) / max(step_s * cores, 1e-12)
    util_floor = sum(e["floor_cpu_s"] for e in everyone) / max(floor_s * cores, 1e-12) if floor else None
    rays = plan.rays_per_batch * n_sources
    summary = {
        "name": cfg.name, "method": method.name, "world_size": W, "device": "emulated", "label": EMULATED_LABEL,
        "emulated_step_ms": t.emulated_step_ms, "pipeline": p.name, "rays_per_batch": plan.rays_per_batch,
        "cells_per_rank": n_sources if method.name == "ss" else None,
        "steps": t.steps, "warmup_steps": warm, "timed_steps": timed, "floor_steps": t.emulated_floor_steps,
        "step_s": step_s, "floor_step_s": floor_s, "step_over_floor": step_s / floor_s if floor_s else None,
        "stall_fraction": float(np.mean(stalls)), "stall_fraction_ranks": stalls,
        "rays_per_s": W * rays / max(step_s, 1e-12),
        "barrier_s": barrier_s, "grad_bytes": grad_bytes, "device_links": links.lines(),
        "sampler_priority": plan.priority,  # rays_sync: normal (nobody samples ahead)
        "ranks_starved_to_normal": [e["rank"] for e in everyone if e["demoted"]],
        "host_cores": cores, "host_busy": util, "host_busy_floor": util_floor,
        "host_keeps_up": keeps_up(max(stalls), step_s / floor_s if floor_s else None),
    }
    atomic_write_text(cfg.run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary

