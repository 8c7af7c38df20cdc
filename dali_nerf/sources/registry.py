"""The one registry of batch sources: the only place they are constructed, for the trainers, the
emulated-device mode, the study and the benchmarks alike.

============= ============================================ ===========================================
name          DDP (``cells=None``)                         SS (``cells`` = cells of every rank)
============= ============================================ ===========================================
rays          :class:`~.rays.RayLoader` (DALI graph + op)  :class:`~.spatial.SpatialRayLoader`
rays_sync     the same at ``prefetch=0``: synchronous       the same at ``prefetch=0``
sync_local    :class:`~.sync.SyncLocalSampler`             :class:`~.sync.RoutedSyncLocal`
sync_global   :class:`~.sync.SyncGlobalSampler`            :class:`~.sync.RoutedSyncGlobal`
              (emulated ranks: :class:`~.shm_scatter.ShmScatter`, ``scatter=ShmLink(...)``)
torch_workers :class:`~.sync.TorchWorkersSampler`          :class:`~.routed_workers.RoutedTorchWorkers`
ready         :class:`~.ready.ReadySource` (sync_local's   the same of each cell's RoutedSyncLocal
              first batch, again and again: the floor)
============= ============================================ ===========================================

``rays_sync`` is the study's same-sampler control: the sampler of ``rays`` (the DALI graph and our
op, the plan's threads, run size and stream: the same batches) run in the training thread with no
overlap. Prefetch 0 gives DALI's synchronous executor (``next()`` that crosses into a run waits for
the whole run), no hand-over thread (:class:`~.base.RunAhead` runs only at prefetch > 0), and each
run's outputs copied out of the executor's buffers, which it reuses on the next run (~1 ms per
65536-ray run on 2 cores; the pipelined source hands out DALI's fresh buffers zero-copy). Its DALI
threads keep normal priority: the training thread waits for them (nobody samples ahead). A shard
streamed through decoded windows still decodes the next window on its own thread.

Three doors, one construction:

* :func:`source_from_config` — a YAML file (plus ``key=value`` overrides) to the source a rank
  should use: the public door, beside the drop-in ``RayLoader(scene, ...)``;
* :func:`build_source` — a loaded config and scene (the trainers, the emulated mode);
* :func:`make_source` — a name and a resolved :class:`~dali_nerf.data.plan.SamplingPlan` (the study's
  equal budgets, the benchmarks), every value already decided.

Every value a source needs comes from the plan (:mod:`dali_nerf.data.plan`), every image cache from
:mod:`dali_nerf.data.imagecache` (a :class:`~dali_nerf.data.imagecache.CacheStore` shares one decode between
the sources of a rank: an SS rank's cells, the study's samplers).

>>> src = source_from_config("configs/ddp_objects.yaml", rank=0, world_size=2)             # DDP: one source
>>> srcs = source_from_config("configs/ss_city.yaml", rank=0, world_size=2)                # SS: one per cell
>>> src = build_source(cfg, scene, rank=0, world_size=2)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from dali_nerf.errors import ConfigError
from dali_nerf.data.imagecache import CacheStore
from dali_nerf.pipelines.rays import GLOBAL_STREAM, SHARD_STREAM
from dali_nerf.data.plan import SamplingPlan, global_batch_share, plan_from_config
from dali_nerf.sources.rays import RayLoader
from dali_nerf.sources.ready import ReadySource
from dali_nerf.sources.routed_workers import RoutedTorchWorkers
from dali_nerf.sources.shm_scatter import ShmLink, global_scatter
from dali_nerf.sources.spatial import SpatialRayLoader
from dali_nerf.sources.sync import (RoutedSyncGlobal, RoutedSyncLocal, SyncGlobalSampler, SyncLocalSampler,
                                    TorchWorkersSampler)

__all__ = ["build_source", "make_source", "source_from_config", "floor_source", "run_stream", "global_batch_config",
           "SOURCES", "SS_SOURCES", "RAY_GRAPH_SOURCES"]

SOURCES = ("rays", "rays_sync", "sync_global", "sync_local", "torch_workers", "ready")
"""Valid ``pipeline.name`` values (data parallel)."""

SS_SOURCES = ("rays", "rays_sync", "sync_local", "sync_global", "torch_workers", "ready")
"""Valid ``pipeline.name`` values with ``method: ss``."""

RAY_GRAPH_SOURCES = ("rays", "rays_sync")
"""The sources that run our DALI ray graph (pipelined and synchronous): the same stream, epoch mode too."""


def run_stream(cfg) -> tuple:
    """(stream version, G) of a run's training stream: what a checkpoint records and an elastic
    resume keeps. DDP ``rays`` (and ``rays_sync``, the same sampler): the global stream (G = B x W
    at the run's start) or the shard stream; ``sync_global``: rank 0's global batch of B x W; SS
    ``rays`` / ``rays_sync``: the cells' own streams; the rest: per-rank streams (G 0)."""
    p = cfg.pipeline
    if cfg.method == "ss":
        return ("cells-v1" if p.name in RAY_GRAPH_SOURCES else f"ss-{p.name}-v1"), 0
    if p.name in RAY_GRAPH_SOURCES:
        return (GLOBAL_STREAM, 1) if p.stream == "global" else (SHARD_STREAM, 0)
    return (f"{p.name}-v1", 1 if p.name == "sync_global" else 0)


def global_batch_config(cfg, world_size: int):
    """The config of a run starting on ``world_size`` ranks: ``pipeline.global_batch`` G > 0 sets
    ``rays_per_batch`` = G / W. Refused in one line when the run has no global batch (SS, the
    shard stream, the per-rank baselines) or W does not divide G (naming the rank counts that do)."""
    p = cfg.pipeline
    G = int(p.global_batch)
    if not G:
        return cfg
    if not run_stream(cfg)[1]:
        raise ConfigError(f"pipeline.global_batch={G}: this run has no global batch (method {cfg.method}, "
                          f"pipeline.name={p.name}, pipeline.stream={p.stream}); set it with method ddp and "
                          f"pipeline.stream=global (or pipeline.name=sync_global), or leave it 0")
    B = global_batch_share(G, world_size, f"pipeline.global_batch={G}")
    return dataclasses.replace(cfg, pipeline=dataclasses.replace(p, rays_per_batch=B))


def source_from_config(config, rank: int = 0, world_size: int = 1, overrides: Sequence[str] = (), *, scene=None):
    """The source(s) rank ``rank`` of ``world_size`` should use, from a YAML file (or a loaded
    :class:`~dali_nerf.config.Config`) plus ``key=value`` ``overrides``: DDP or SS (``method``),
    pipelined or a baseline (``pipeline.name``). SS: the partition is built from the config over the
    training split's cameras and the cells are assigned to ranks round-robin
    (:func:`dali_nerf.partition.assign_rank`); returns one source per cell of this rank.

    >>> src = source_from_config("configs/ddp_objects.yaml", overrides=["pipeline.rays_per_batch=8192"])
    """
    from dali_nerf.config import Config, load_config
    from dali_nerf.partition import Partition, assign_rank
    from dali_nerf.scenes import scene_from_config

    if isinstance(config, Config):
        if overrides:
            raise ConfigError("source_from_config: overrides apply to a YAML file; pass its path, or change the Config")
        cfg = config
    else:
        cfg = load_config(config, list(overrides))
    scene = scene_from_config(cfg) if scene is None else scene
    if cfg.method == "ss":
        part = Partition.from_config(cfg.partition, scene)
        return build_source(cfg, scene, rank, world_size, cells=assign_rank(part.num_cells, world_size), partition=part)
    return build_source(cfg, scene, rank, world_size)


def build_source(cfg, scene, rank: int, world_size: int, cells=None, *, partition=None, cache=None,
                 plan: Optional[SamplingPlan] = None, store: Optional[CacheStore] = None,
                 scatter: Optional[ShmLink] = None):
    """The batch source(s) of this rank named by ``cfg.pipeline.name`` (same interface for all).

    Args:
        cfg: the run's :class:`~dali_nerf.config.Config` (``pipeline``, ``cache``, ``train.device``).
        scene: the training split.
        rank, world_size: this process's place.
        cells: None for data parallel; for spatial segmentation the cells of every rank
            (``cells[r]``, e.g. :func:`dali_nerf.partition.assign_rank`), with ``partition``.
        cache: an ImageCache to sample (DDP: this rank's shard; SS: all images of the split);
            None: decoded here (:mod:`dali_nerf.data.imagecache`), once per rank.
        plan: the rank's plan (default :func:`dali_nerf.data.plan.plan_from_config` of ``cfg``).
        store: caches shared with other sources of this rank (default: a new one).
        scatter: ``sync_global`` between emulated ranks (shared memory instead of a process group).
    Returns:
        DDP: one source. SS: a list of sources, one per cell of ``cells[rank]`` in that order
        (slot i samples cell ``cells[rank][i]``).
    Raises:
        ConfigError: an unknown ``pipeline.name``, or one the method does not offer; a
            ``pipeline.global_batch`` the run cannot have (:func:`global_batch_config`).
    """
    name = cfg.pipeline.name
    cfg = global_batch_config(cfg, world_size)  # pipeline.global_batch: rays_per_batch = G / W
    if cells is None:
        if name not in SOURCES:
            raise ConfigError(f"pipeline.name: must be one of {', '.join(SOURCES)}, got {name!r}")
        plan = plan or plan_from_config(cfg, rank, world_size)
        return make_source(name, scene, plan, cache=cache, store=store, scatter=scatter)
    if partition is None:
        raise ConfigError("build_source: cells were given without a partition")
    if name not in SS_SOURCES:
        raise ConfigError(f"pipeline.name={name}: method ss supports {', '.join(SS_SOURCES)}")
    if name not in RAY_GRAPH_SOURCES and cfg.pipeline.mode != "random":
        raise ConfigError(f"pipeline.mode={cfg.pipeline.mode}: the SS baselines sample iid rays only; use pipeline.mode=random")
    plan = plan or plan_from_config(cfg, rank, world_size, cells=cells[rank], num_cells=partition.num_cells)
    store = store or CacheStore(scene, plan)
    return [make_source(name, scene, plan, cache=cache, store=store, partition=partition, cells=cells, slot=slot,
                        scatter=scatter) for slot in range(len(cells[rank]))]


def make_source(name: str, scene, plan: SamplingPlan, *, cache=None, store: Optional[CacheStore] = None,
                partition=None, cells=None, slot: int = 0, scatter: Optional[ShmLink] = None,
                output_map: Optional[Sequence[str]] = None):
    """The source ``name`` of a resolved ``plan`` (the only constructor of sources).

    Data parallel when ``plan.cells`` is empty; else the source of cell ``plan.cells[slot]`` of
    ``partition`` (``cells``: every rank's cells, which ``sync_global`` scatters to). ``cache``
    (else ``store``, else a decode here) is what it samples: DDP the rank's shard (rank 0 of
    ``sync_global``: every image), SS every image of the split — on ``plan.device`` for the op's
    graph, on the host for the baselines, which sample there. Without a cache or a store, a DDP
    ``rays`` source decodes its shard itself, or streams it when it exceeds ``plan.max_bytes``.
    ``output_map``: the batch keys of a DDP ``rays`` / ``rays_sync`` source (default: all of them).
    ``rays_sync`` is ``rays`` on the plan at prefetch 0 and normal priority (the module docstring)."""
    if name == "rays_sync":
        name, plan = "rays", dataclasses.replace(plan, prefetch=0, priority="normal")
    if not plan.cells:
        if name == "rays" and cache is None and store is not None:  # a shared store holds its shard
            cache = store.shard()
        if output_map is not None:
            if name != "rays":
                raise ConfigError(f"make_source: output_map is for the rays and rays_sync sources, not {name!r}")
            return RayLoader(scene, cache=cache, plan=plan, output_map=tuple(output_map))
        return _ddp_source(name, scene, plan, cache, store or CacheStore(scene, plan), scatter)
    return _ss_source(name, scene, plan, cache, store or CacheStore(scene, plan), partition, cells, slot, scatter)


def _ddp_source(name, scene, p: SamplingPlan, cache, store: CacheStore, scatter):
    host = dict(rays_per_batch=p.rays_per_batch, rank=p.rank, world_size=p.world_size, seed=p.seed,
                prefetch=p.prefetch, mode=p.mode, num_threads=p.threads)
    if name == "rays":  # cache None: RayLoader decodes its shard, or streams it past plan.max_bytes
        return RayLoader(scene, cache=cache, plan=p)
    if name == "sync_global" and scatter is not None:
        full = (cache or store.full("cpu")) if p.rank == 0 else None
        return global_scatter("ddp", scene, full, p.seed, p.rank, p.world_size, p.rays_per_batch, scatter.buf,
                              scatter.barrier, scatter.device)
    if name == "sync_global":
        full = (cache or store.full("cpu")) if p.rank == 0 else None
        return SyncGlobalSampler(scene, device=p.device, cache=full, **host)
    shard = cache or store.shard("cpu")
    if name in ("sync_local", "ready"):
        src = SyncLocalSampler(scene, device=p.device, cache=shard, **host)
        return ReadySource.first_of(src) if name == "ready" else src
    if name == "torch_workers":
        return TorchWorkersSampler(scene, device=p.device, cache=shard, workers=p.workers,
                                   thread_priority=p.priority, **host)
    raise ConfigError(f"pipeline.name: must be one of {', '.join(SOURCES)}, got {name!r}")


def _ss_source(name, scene, p: SamplingPlan, cache, store: CacheStore, partition, cells, slot: int, scatter):
    if partition is None:
        raise ConfigError("make_source: a spatial-segmentation plan needs its partition")
    cell = p.cells[slot]
    B, seed, threads = p.rays_per_batch, p.seed, p.threads
    if name == "rays":  # the op's graph samples the cache where it runs (CUDA pixels for a CUDA run)
        return SpatialRayLoader(scene, partition, cell, cache=cache or store.full(), plan=p)
    if name == "sync_global":  # rank 0 samples every rank's cell: only it needs the images
        full = (cache or store.full("cpu")) if p.rank == 0 else None
        if scatter is not None:  # one cell per emulated rank
            return global_scatter("ss", scene, full, seed, p.rank, p.world_size, B, scatter.buf, scatter.barrier,
                                  scatter.device, partition=partition)
        return RoutedSyncGlobal(scene, partition, cells if cells is not None else [p.cells], p.rank, slot, B, seed,
                                cache=full, num_threads=threads)
    full = cache or store.full("cpu")  # the routed baselines sample and route on the host
    if name == "torch_workers":
        return RoutedTorchWorkers(scene, partition, cell, B, seed, prefetch=p.prefetch, cache=full, workers=p.workers,
                                  num_threads=threads, thread_priority=p.priority)
    if name in ("sync_local", "ready"):
        src = RoutedSyncLocal(scene, partition, cell, B, seed, cache=full, num_threads=threads)
        return ReadySource.first_of(src) if name == "ready" else src
    if name == "sync_global" and scatter is not None:  # one cell per emulated rank
        return global_scatter("ss", scene, full if p.rank == 0 else None, seed, p.rank, p.world_size, B,
                              scatter.buf, scatter.barrier, scatter.device, partition=partition)
    if name == "sync_global":
        every = cells if cells is not None else [p.cells]
        return RoutedSyncGlobal(scene, partition, every, p.rank, slot, B, seed, cache=full if p.rank == 0 else None,
                                num_threads=threads)
    raise ConfigError(f"pipeline.name={name}: method ss supports {', '.join(SS_SOURCES)}")


def floor_source(batch: dict) -> ReadySource:
    """A floor beside a running source: ``batch`` (copied) handed out again and again."""
    return ReadySource({k: v.clone() for k, v in batch.items()})
