"""Every batch source behind one small base (:mod:`.base`), and one registry (:mod:`.registry`).

* :mod:`.base`       BatchSource, BatchStats, dali_to_torch, check_common,
  check_cache_device, run_graph, step_views, RunAhead (a graph's runs handed over by a thread)
* :mod:`.rays`       RayLoader: our DALI ray graph + op, prefetching (DDP)
* :mod:`.streaming`  WindowStream: a shard larger than ``cache.max_bytes`` through decoded windows
* :mod:`.spatial`    SpatialRayLoader: the ray graph routed to one cell (SS)
* :mod:`.sync`       the synchronous baselines (sync_local, sync_global, torch_workers, routed SS)
* :mod:`.ready`      ReadySource: one batch again and again (the benchmarks' floor)
* :mod:`.shm_scatter` ShmScatter: sync_global between emulated ranks, through shared memory
* :mod:`.registry`   the only constructor (``rays``, ``rays_sync`` = rays synchronous, the baselines):
  ``source_from_config`` (YAML -> source), ``build_source``
  (config + scene), ``make_source`` (a resolved :class:`~dali_nerf.data.plan.SamplingPlan`)

Importing this package imports no DALI: the graphs import it when they are built
(:mod:`dali_nerf.data._dali`).

>>> from dali_nerf.sources import build_source
>>> src = build_source(cfg, scene, rank=0, world_size=1)
>>> batch = next(src)      # origins/directions/rgb (B, 3), indices (B, 3), near/far (B, 1)
"""

from dali_nerf.sources.base import (BATCH_KEYS, BatchSource, BatchStats, RunAhead, check_cache_device, check_common,
                                    dali_to_torch, run_graph, step_views)
from dali_nerf.sources.rays import RayLoader
from dali_nerf.sources.ready import ReadySource
from dali_nerf.sources.routed_workers import RoutedTorchWorkers, routed_batch
from dali_nerf.sources.registry import SOURCES, SS_SOURCES, build_source, floor_source, make_source, source_from_config
from dali_nerf.sources.spatial import SpatialRayLoader
from dali_nerf.sources.streaming import WindowStream, plan_window_images, window_plan
from dali_nerf.sources.sync import (PixelSampler, RoutedSyncGlobal, RoutedSyncLocal, SyncGlobalSampler,
                                    SyncLocalSampler, TorchWorkersSampler, collective_device, scatter_batches)

__all__ = [
    "BATCH_KEYS", "BatchSource", "BatchStats", "check_cache_device", "check_common", "dali_to_torch", "run_graph",
    "step_views", "RunAhead", "RayLoader", "ReadySource", "SpatialRayLoader", "WindowStream", "plan_window_images", "window_plan",
    "PixelSampler", "SyncLocalSampler", "SyncGlobalSampler", "TorchWorkersSampler", "RoutedSyncLocal",
    "RoutedSyncGlobal", "RoutedTorchWorkers", "routed_batch", "scatter_batches", "collective_device", "build_source",
    "make_source", "source_from_config", "floor_source", "SOURCES", "SS_SOURCES",
]
