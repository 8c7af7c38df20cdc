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
* :func:`rank_feed` / :func:`build_source` — a loaded config and scene: the rank's :class:`Feed`
  (its plan, resolved once; SS: the partition and every rank's cells) whose :meth:`Feed.build`
  makes the sources (the trainers, the emulated mode), or the sources alone;
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

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from dali_nerf.errors import ConfigError
from dali_nerf.data.imagecache import CacheStore
from dali_nerf.data.plan import RAY_GRAPH_SOURCES, SamplingPlan, plan_from_config, run_stream
from dali_nerf.sources.images import ImageLoader
from dali_nerf.sources.rays import RayLoader
from dali_nerf.sources.ready import ReadySource
from dali_nerf.sources.routed_workers import RoutedTorchWorkers
from dali_nerf.sources.shm_scatter import ShmLink, global_scatter
from dali_nerf.sources.spatial import SpatialRayLoader
from dali_nerf.sources.sync import (RoutedSyncGlobal, RoutedSyncLocal, SyncGlobalSampler, SyncLocalSampler,
                                    TorchWorkersSampler)

__all__ = ["build_source", "make_source", "source_from_config", "rank_feed", "Feed", "floor_source", "run_stream",
           "image_source", "image_loader",
           "SOURCES", "SS_SOURCES", "RAY_GRAPH_SOURCES"]

SOURCES = ("rays", "rays_sync", "sync_global", "sync_local", "torch_workers", "ready")
"""Valid ``pipeline.name`` values (data parallel)."""

SS_SOURCES = ("rays", "rays_sync", "sync_local", "sync_global", "torch_workers", "ready")
"""Valid ``pipeline.name`` values with ``method: ss``."""


@dataclass
class Feed:
    """What one rank trains on, resolved once from its config: the :class:`~dali_nerf.data.plan.SamplingPlan`
    (rays per step from ``pipeline.global_batch`` / W where set, threads, priority, device, run
    size, the run's stream), for spatial segmentation the partition and every rank's cells, and,
    once :meth:`build` ran, the rank's sources (DDP: one; SS: one per cell of the rank, in order).

    >>> feed = rank_feed(cfg, scene, rank=0, world_size=2)     # no decoding yet
    >>> feed.plan.rays_per_batch, feed.cells                   # SS: [(0, 2), (1, 3)]
    >>> sources = feed.build()                                 # the registry's sources of the plan
    """

    cfg: object
    scene: object
    plan: SamplingPlan
    partition: object = None
    cells: Optional[List[Tuple[int, ...]]] = None
    sources: list = field(default_factory=list)

    def build(self, *, store: Optional[CacheStore] = None, scatter: Optional[ShmLink] = None) -> list:
        """The rank's sources of the plan (:func:`build_source`), kept in :attr:`sources`."""
        p = self.plan
        if self.cells is None:
            self.sources = [build_source(self.cfg, self.scene, p.rank, p.world_size, plan=p, store=store,
                                         scatter=scatter)]
        else:
            self.sources = build_source(self.cfg, self.scene, p.rank, p.world_size, self.cells,
                                        partition=self.partition, plan=p, store=store, scatter=scatter)
        return self.sources


def rank_feed(cfg, scene, rank: int, world_size: int, **plan_kw) -> Feed:
    """The :class:`Feed` of rank ``rank`` of ``world_size`` for a loaded config and its training
    split (nothing decoded yet): the plan (:func:`~dali_nerf.data.plan.plan_from_config`, with
    ``plan_kw``); SS (``method: ss``): the partition from ``cfg.partition`` over the split's cameras
    and the cells assigned to ranks round-robin (:func:`dali_nerf.partition.assign_rank`, which
    refuses more ranks than cells), the plan for this rank's cells."""
    from dali_nerf.partition import Partition, assign_rank

    if cfg.method != "ss":
        return Feed(cfg, scene, plan_from_config(cfg, rank, world_size, **plan_kw))
    part = Partition.from_config(cfg.partition, scene)
    cells = assign_rank(part.num_cells, world_size)
    plan = plan_from_config(cfg, rank, world_size, cells=cells[rank], num_cells=part.num_cells, **plan_kw)
    return Feed(cfg, scene, plan, part, cells)


def source_from_config(config, rank: int = 0, world_size: int = 1, overrides: Sequence[str] = (), *, scene=None):
    """The source(s) rank ``rank`` of ``world_size`` should use, from a YAML file (or a loaded
    :class:`~dali_nerf.config.Config`) plus ``key=value`` ``overrides``: DDP or SS (``method``),
    pipelined or a baseline (``pipeline.name``). SS: the partition is built from the config over the
    training split's cameras and the cells are assigned to ranks round-robin
    (:func:`dali_nerf.partition.assign_rank`); returns one source per cell of this rank.

    >>> src = source_from_config("configs/ddp_objects.yaml", overrides=["pipeline.rays_per_batch=8192"])
    """
    from dali_nerf.config import Config, load_config
    from dali_nerf.scenes import scene_from_config

    if isinstance(config, Config):
        if overrides:
            raise ConfigError("source_from_config: overrides apply to a YAML file; pass its path, or change the Config")
        cfg = config
    else:
        cfg = load_config(config, list(overrides))
    scene = scene_from_config(cfg) if scene is None else scene
    sources = rank_feed(cfg, scene, rank, world_size).build()
    return sources if cfg.method == "ss" else sources[0]


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
            None: decoded by the ``store`` (:mod:`dali_nerf.data.imagecache`), once per rank.
        plan: the rank's plan (default :func:`dali_nerf.data.plan.plan_from_config` of ``cfg``,
            which resolves ``pipeline.global_batch``).
        store: caches shared with other sources of this rank (default: a new one).
        scatter: ``sync_global`` between emulated ranks (shared memory instead of a process group).
    Returns:
        DDP: one source. SS: a list of sources, one per cell of ``cells[rank]`` in that order
        (slot i samples cell ``cells[rank][i]``).
    Raises:
        ConfigError: an unknown ``pipeline.name``, or one the method does not offer; a
            ``pipeline.global_batch`` the run cannot have.
    """
    if cfg.method == "splat":
        return image_source(cfg, scene, rank, world_size, plan=plan)
    name = cfg.pipeline.name
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
    """The source ``name`` of a resolved ``plan`` (the only constructor of sources), which it takes
    whole (as ``name`` runs it: :meth:`~dali_nerf.data.plan.SamplingPlan.for_source`).

    Data parallel when ``plan.cells`` is empty; else the source of cell ``plan.cells[slot]`` of
    ``partition`` (``cells``: every rank's cells, which ``sync_global`` scatters to). What it
    samples is ``cache`` where given, else what the ``store`` decodes (default: a new
    :class:`~dali_nerf.data.imagecache.CacheStore` of the plan; a source decodes nothing itself):
    DDP the rank's shard (streamed through decoded windows past ``plan.max_bytes``; rank 0 of
    ``sync_global``: every image), SS every image of the split — on ``plan.device`` for the op's
    graph, on the host for the baselines, which sample there. ``output_map``: the batch keys of a
    DDP ``rays`` / ``rays_sync`` source (default: all of them). ``rays_sync`` is ``rays`` on the
    plan at prefetch 0 and normal priority (the module docstring)."""
    plan = plan.for_source(name)
    name = "rays" if name == "rays_sync" else name
    if output_map is not None and (name != "rays" or plan.cells):
        raise ConfigError(f"make_source: output_map is for the rays and rays_sync sources, not {name!r}")
    store = store or CacheStore(scene, plan)
    if not plan.cells:
        return _ddp_source(name, scene, plan, cache, store, scatter, output_map)
    return _ss_source(name, scene, plan, cache, store, partition, cells, slot, scatter)


def _ddp_source(name, scene, p: SamplingPlan, cache, store: CacheStore, scatter, output_map):
    if name == "rays":
        kw = {} if output_map is None else dict(output_map=tuple(output_map))
        return RayLoader(scene, cache=cache, plan=p, store=store, **kw)
    if name == "sync_global" and scatter is not None:  # emulated ranks: through shared memory
        return global_scatter("ddp", scene, p, scatter, cache=cache, store=store)
    if name == "sync_global":  # rank 0 samples every rank's batch: only it needs the images
        return SyncGlobalSampler(scene, cache=cache, plan=p, store=store)
    if name in ("sync_local", "ready"):
        src = SyncLocalSampler(scene, cache=cache, plan=p, store=store)
        return ReadySource.first_of(src) if name == "ready" else src
    if name == "torch_workers":
        return TorchWorkersSampler(scene, cache=cache, plan=p, store=store)
    raise ConfigError(f"pipeline.name: must be one of {', '.join(SOURCES)}, got {name!r}")


def _ss_source(name, scene, p: SamplingPlan, cache, store: CacheStore, partition, cells, slot: int, scatter):
    if partition is None:
        raise ConfigError("make_source: a spatial-segmentation plan needs its partition")
    cell = p.cells[slot]
    # the op's graph samples the images where it runs (CUDA pixels for a CUDA run), the baselines on the host
    if name == "rays":
        return SpatialRayLoader(scene, partition, cell, cache=cache, plan=p, store=store)
    if name == "sync_global" and scatter is not None:  # one cell per emulated rank
        return global_scatter("ss", scene, p, scatter, cache=cache, store=store, partition=partition)
    if name == "sync_global":  # rank 0 samples every rank's cell: only it needs the images
        return RoutedSyncGlobal(scene, partition, cells if cells is not None else [p.cells], p.rank, slot, cache=cache,
                                plan=p, store=store)
    if name == "torch_workers":
        return RoutedTorchWorkers(scene, partition, cell, cache=cache, plan=p, store=store)
    if name in ("sync_local", "ready"):
        src = RoutedSyncLocal(scene, partition, cell, cache=cache, plan=p, store=store)
        return ReadySource.first_of(src) if name == "ready" else src
    raise ConfigError(f"pipeline.name={name}: method ss supports {', '.join(SS_SOURCES)}")


def image_source(cfg, scene, rank: int, world_size: int, plan: Optional[SamplingPlan] = None) -> ImageLoader:
    """The image loader of a splatting run (``method: splat``): ``images.*``, the seed
    ``pipeline.seed``, decode threads and batch from the rank's plan, batches on the plan's device
    (cuda: pinned, copied in ``next()``), node sharing from torchrun's environment."""
    plan = plan or plan_from_config(cfg, rank, world_size)
    im = cfg.images
    return image_loader(scene, images_per_batch=im.images_per_batch, rank=rank, world_size=world_size,
                        seed=cfg.pipeline.seed, prefetch=im.prefetch, patch_size=im.patch_size or None,
                        max_bytes=im.max_bytes or None, device=plan.device, num_threads=plan.threads,
                        decode_batch=plan.decode_batch)


def image_loader(scene, **settings) -> ImageLoader:
    """An image loader of ``scene`` with explicit settings (:class:`~dali_nerf.sources.images.ImageLoader`'s
    arguments): for :func:`image_source` and for integrations that carry their own config
    (nerfstudio's image datamanager)."""
    return ImageLoader(scene, **settings)


def floor_source(batch: dict) -> ReadySource:
    """A floor beside a running source: ``batch`` (copied) handed out again and again."""
    return ReadySource({k: v.clone() for k, v in batch.items()})
