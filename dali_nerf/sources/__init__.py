"""Every batch source: one runner for the sources that sample ahead, one small base for all, and one
registry.

* :mod:`.base`       BatchSource, BatchStats (stall and warm-up accounting), PlanView (a source's
  settings read from its plan), the split's fingerprint in every state
* :mod:`.runner`     RunSource: the machinery of a source that samples ahead — runs handed out
  step by step, the run-ahead thread (RunAhead), the starvation guard, the state, close — written
  once; a batch kind is a *producer* plugged into it (the contract is the module's doc)
* :mod:`.checks`     the argument checks; :mod:`.dalirun` a DALI graph's run as torch tensors
* :mod:`.rays`       RayLoader: our DALI ray graph + op, prefetching (DDP): RayProducer, WindowProducer
* :mod:`.images`     ImageLoader: whole images + cameras for splatting trainers (gsplat's batches)
* :mod:`.streaming`  WindowStream: a shard larger than ``cache.max_bytes`` through decoded windows
* :mod:`.spatial`    SpatialRayLoader: the ray graph routed to one cell (SS): CellProducer
* :mod:`.sync`       the synchronous baselines (sync_local, sync_global, torch_workers, routed SS)
* :mod:`.ready`      ReadySource: one batch again and again (the benchmarks' floor)
* :mod:`.shm_scatter` ShmScatter: sync_global between emulated ranks, through shared memory
* :mod:`.registry`   the only constructor (``rays``, ``rays_sync`` = rays synchronous, the baselines):
  ``source_from_config`` (YAML -> source), ``rank_feed`` / ``build_source``
  (config + scene), ``make_source`` (a resolved :class:`~dali_nerf.data.plan.SamplingPlan`)

Importing this package imports no DALI: the graphs import it when they are built
(:mod:`dali_nerf.data._dali`).

>>> from dali_nerf.sources import build_source
>>> src = build_source(cfg, scene, rank=0, world_size=1)
>>> batch = next(src)      # origins/directions/rgb (B, 3), indices (B, 3), near/far (B, 1)
"""

from dali_nerf.sources.base import BATCH_KEYS, BatchSource, BatchStats
from dali_nerf.sources.checks import check_cache_device, check_common
from dali_nerf.sources.dalirun import dali_to_torch, run_graph, step_views
from dali_nerf.sources.images import ImageLoader
from dali_nerf.sources.rays import RayLoader
from dali_nerf.sources.ready import ReadySource
from dali_nerf.sources.routed_workers import RoutedTorchWorkers, routed_batch
from dali_nerf.sources.registry import (SOURCES, SS_SOURCES, Feed, build_source, floor_source, make_source, rank_feed,
                                        source_from_config)
from dali_nerf.sources.runner import Run, RunAhead, RunSource
from dali_nerf.sources.spatial import SpatialRayLoader
from dali_nerf.sources.streaming import WindowStream, plan_window_images, window_plan
from dali_nerf.sources.sync import (PixelSampler, RoutedSyncGlobal, RoutedSyncLocal, SyncGlobalSampler,
                                    SyncLocalSampler, TorchWorkersSampler, collective_device, scatter_batches)

__all__ = [
    "BATCH_KEYS", "BatchSource", "BatchStats", "check_cache_device", "check_common", "dali_to_torch", "run_graph",
    "step_views", "RunAhead", "RayLoader", "ImageLoader", "ReadySource", "SpatialRayLoader", "WindowStream", "plan_window_images", "window_plan",
    "PixelSampler", "SyncLocalSampler", "SyncGlobalSampler", "TorchWorkersSampler", "RoutedSyncLocal",
    "RoutedSyncGlobal", "RoutedTorchWorkers", "routed_batch", "scatter_batches", "collective_device", "build_source",
    "make_source", "source_from_config", "floor_source", "SOURCES", "SS_SOURCES", "Run", "RunSource", "Feed", "rank_feed",
]
