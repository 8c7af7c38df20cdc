"""The one registry of batch sources: ``cfg.pipeline.name`` (and, for spatial segmentation, the
cells) -> the source(s) of this rank.

============= ============================================ ===========================================
name          DDP (``cells=None``)                         SS (``cells`` = cells of every rank)
============= ============================================ ===========================================
rays          :class:`~.rays.RayLoader` (DALI graph + op)  :class:`~.spatial.SpatialRayLoader`
sync_local    :class:`~.sync.SyncLocalSampler`             :class:`~.sync.RoutedSyncLocal`
sync_global   :class:`~.sync.SyncGlobalSampler`            :class:`~.sync.RoutedSyncGlobal`
torch_workers :class:`~.sync.TorchWorkersSampler`          :class:`~.routed_workers.RoutedTorchWorkers`
ready         :class:`~.ready.ReadySource` (sync_local's   the same of each cell's RoutedSyncLocal
              first batch, again and again: the floor)
============= ============================================ ===========================================

This is also the one place the SS sources' image cache is decoded: every cell of a rank samples
the same cache (all images of the split), decoded once here.

>>> src = build_source(cfg, scene, rank=0, world_size=2)                       # DDP: one source
>>> srcs = build_source(cfg, scene, 0, 2, cells=[[0, 2], [1, 3]], partition=part)  # SS: one per cell
"""

from __future__ import annotations

from dali_nerf.errors import ConfigError
from dali_nerf.hostbudget import loader_budget, resolve_priority
from dali_nerf.imagecache import decode_cache
from dali_nerf.sources.base import resolve_device
from dali_nerf.sources.rays import RayLoader
from dali_nerf.sources.ready import ReadySource
from dali_nerf.sources.routed_workers import RoutedTorchWorkers
from dali_nerf.sources.spatial import SpatialRayLoader
from dali_nerf.sources.sync import (RoutedSyncGlobal, RoutedSyncLocal, SyncGlobalSampler, SyncLocalSampler,
                                    TorchWorkersSampler)

__all__ = ["build_source", "SOURCES", "SS_SOURCES"]

SOURCES = ("rays", "sync_global", "sync_local", "torch_workers", "ready")
"""Valid ``pipeline.name`` values (data parallel)."""

SS_SOURCES = ("rays", "sync_local", "sync_global", "torch_workers", "ready")
"""Valid ``pipeline.name`` values with ``method: ss``."""

_DDP = {"rays": RayLoader, "sync_global": SyncGlobalSampler, "sync_local": SyncLocalSampler,
        "torch_workers": TorchWorkersSampler}


def build_source(cfg, scene, rank: int, world_size: int, cells=None, *, partition=None, cache=None):
    """The batch source(s) of this rank named by ``cfg.pipeline.name`` (same interface for all).

    Args:
        cfg: the run's :class:`~dali_nerf.config.Config` (``pipeline``, ``cache``, ``train.device``).
        scene: the training split.
        rank, world_size: this process's place.
        cells: None for data parallel; for spatial segmentation the cells of every rank
            (``cells[r]``, e.g. :func:`dali_nerf.partition.assign_rank`), with ``partition``.
        cache: SS only: an ImageCache of all images of the split (None = decode it here, once:
            on ``train.device`` for ``rays``, on the host for the routed baselines).
    Returns:
        DDP: one source. SS: a list of sources, one per cell of ``cells[rank]`` in that order
        (slot i samples cell ``cells[rank][i]``).
    Raises:
        ConfigError: an unknown ``pipeline.name``, or one the method does not offer.
    """
    p = cfg.pipeline
    if cells is None:
        if p.name == "ready":
            return ReadySource.first_of(SyncLocalSampler.from_config(cfg, rank, world_size, scene=scene))
        if p.name not in _DDP:
            raise ConfigError(f"pipeline.name: must be one of {', '.join(SOURCES)}, got {p.name!r}")
        return _DDP[p.name].from_config(cfg, rank, world_size, scene=scene)
    if partition is None:
        raise ConfigError("build_source: cells were given without a partition")
    if p.name not in SS_SOURCES:
        raise ConfigError(f"pipeline.name={p.name}: method ss supports {', '.join(SS_SOURCES)}")
    if p.name != "rays" and p.mode != "random":
        raise ConfigError(f"pipeline.mode={p.mode}: the SS baselines sample iid rays only; use pipeline.mode=random")
    threads = loader_budget(p.rays_per_batch, p.num_threads, p.rays_per_run)[0]
    priority = resolve_priority(p.thread_priority, cfg.train.device)
    if cache is None:
        # the op's graph samples the cache where it runs (CUDA pixels for a CUDA run, nvJPEG);
        # the routed baselines sample and route on the host
        device = resolve_device(cfg.train.device) if p.name == "rays" else "cpu"
        cache = decode_cache(scene, 0, 1, device=device, num_threads=threads, batch=cfg.cache.decode_batch)
    out = []
    for slot, cell in enumerate(cells[rank]):
        if p.name == "rays":
            src = SpatialRayLoader(scene, partition, cell, rays_per_batch=p.rays_per_batch, seed=p.seed,
                                   prefetch=p.prefetch, mode=p.mode, device=cfg.train.device,
                                   num_threads=p.num_threads, rays_per_run=p.rays_per_run, cache=cache,
                                   decode_batch=cfg.cache.decode_batch, thread_priority=priority)
        elif p.name == "torch_workers":
            src = RoutedTorchWorkers(scene, partition, cell, p.rays_per_batch, p.seed, prefetch=p.prefetch,
                                     cache=cache, workers=p.workers, num_threads=threads, thread_priority=priority)
        elif p.name in ("sync_local", "ready"):
            src = RoutedSyncLocal(scene, partition, cell, p.rays_per_batch, p.seed, cache=cache,
                                  num_threads=threads)
            if p.name == "ready":
                src = ReadySource.first_of(src)
        else:
            src = RoutedSyncGlobal(scene, partition, cells, rank, slot, p.rays_per_batch, p.seed, cache=cache,
                                   num_threads=threads)
        out.append(src)
    return out
