"""SamplingPlan: what one rank samples, and with what, resolved once.

Every value a batch source needs — the stream's key (seed, mode, stream id and count), the rays
per step and per DALI run, the sampler threads and their priority, the device, prefetch depth,
worker processes, decode batch and the streaming window — is decided here and nowhere else: this
module is the one caller of :mod:`dali_nerf.data.hostbudget` (threads and run size from the cores a
rank gets, the priority of the threads that sample ahead) and of the device resolution. The
sources, the image cache and the registry read a plan; they do not decide.

Two doors:

* :func:`plan_from_config` — a rank of a run (trainers, the emulated mode, the study): the config's
  values where it sets them (> 0), else the host budget for ``LOCAL_WORLD_SIZE`` ranks sharing this
  host's usable cores; ``pipeline.thread_priority: auto`` resolved for ``train.device`` (cuda and
  emulated: background); ``train.device: emulated`` samples on the host.
* :meth:`SamplingPlan.for_loader` — :class:`~dali_nerf.sources.RayLoader`'s arguments (the drop-in
  API), the same rules.

A spatial-segmentation rank trains several cells: its plan carries them (``cells``, ``num_cells``)
and :meth:`SamplingPlan.stream` gives each cell's stream key, (cell, number of cells), so a cell's
stream is the same whichever rank trains it; a data-parallel rank's stream is (rank, world size),
or, with ``ray_stream`` global (``pipeline.stream``), the split's global stream of G =
``global_batch`` positions a step (B x world size), the seed's alone.

>>> plan = plan_from_config(cfg, rank=0, world_size=2)
>>> plan.threads, plan.rays_per_run, plan.priority, plan.stream()
(1, 65536, 'normal', (0, 2))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from dali_nerf.errors import ConfigError
from dali_nerf.data.imageorder import IMAGE_STREAM
from dali_nerf.data.hostbudget import HostBudget, check_priority, host_budget, resolve_priority, run_size
from dali_nerf.pipelines.decode import shard_range, shard_sizes
from dali_nerf.ops.limits import INT32_MAX
from dali_nerf.pipelines.rays import GLOBAL_STREAM, SHARD_STREAM, RayGraph

__all__ = ["SamplingPlan", "plan_from_config", "resolve_device", "sampling_device", "rays_per_rank_spread",
           "uneven_rays_note", "nearest_divisors", "global_batch_share", "run_stream", "RAY_GRAPH_SOURCES"]


def _positive(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) and not hasattr(v, "__index__") or int(v) <= 0:
        raise ConfigError(f"{name}={v!r}: must be an integer > 0")


def resolve_device(device: str, key: str = "device") -> str:
    """Where sampling runs: "auto" -> "cuda" when a GPU is visible, else "cpu"; "cuda" without a
    GPU is a ConfigError naming ``key``."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"{key}={device!r}: use cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}=cuda: no CUDA device is visible; use {key}=cpu")
    return device


def sampling_device(train_device: str, key: str = "train.device") -> str:
    """The device a run's sources sample on for ``train.device``, and a real run's device (its
    process group and tensors: :func:`dali_nerf.train.runtime.setup_distributed`): emulated devices
    sample on the host (their device work is a timed wait); the others as :func:`resolve_device`."""
    return "cpu" if train_device == "emulated" else resolve_device(train_device, key)


@dataclass(frozen=True)
class SamplingPlan:
    """One rank's sampling, resolved (see the module doc). Read-only; ``dataclasses.replace`` for a variant."""

    rays_per_batch: int
    """B: rays per step of one stream (per rank in DDP, per cell in SS)."""
    rays_per_run: int
    """Rays per DALI run: K * B, K = :attr:`steps_per_run`."""
    threads: int
    """Sampler threads of one source: the DALI CPU threads of its ray graph (an SS rank's cells
    share the rank's threads, :attr:`rank_threads`)."""
    priority: str
    """Priority of the threads (and worker processes) that sample ahead: normal | background."""
    device: str
    """Where the sources sample and the cache lives: cpu | cuda."""
    seed: int = 0
    mode: str = "random"
    """random | epoch."""
    rank: int = 0
    world_size: int = 1
    prefetch: int = 2
    """DALI runs computed ahead (0: synchronous)."""
    workers: int = 2
    """torch_workers: DataLoader worker processes."""
    decode_batch: int = 8
    """Images per decode-graph run."""
    max_bytes: Optional[int] = None
    """Decoded-image budget per rank (None: unlimited); a larger shard is streamed."""
    window_images: int = 0
    rays_per_window: int = 0
    cells: Tuple[int, ...] = ()
    """SS: the cells this rank trains, in slot order (empty: data parallel)."""
    num_cells: int = 0
    budget: Optional[HostBudget] = None
    """The host budget the threads and run size came from (None: both were given)."""
    rank_threads: int = 0
    """The rank's sampler threads (0: :attr:`threads`): the decode's, and the SS cells' share."""
    ray_stream: str = "shard"
    """The DDP ``rays`` source's stream: shard (the rank's own stream over its shard) | global (the
    split's stream of global batches, :attr:`global_batch` positions a step; the rank's batch is
    the part of each in its shard). SS cells and the baselines ignore it."""
    global_batch: int = 0
    """G: global positions per step of the global stream (B x world size; 0 with ``stream`` shard)."""
    stream_version: str = ""
    """The run's training stream, what its checkpoints record (:func:`run_stream`; "" outside a run)."""
    run_global_batch: int = 0
    """G of the run's training stream, kept by an elastic resume: B x world size for the DDP global
    stream and ``sync_global``, 0 for the per-rank and per-cell streams."""

    @property
    def decode_threads(self) -> int:
        """DALI threads of the rank's decode graph: all of the rank's sampler threads."""
        return self.rank_threads or self.threads

    @property
    def steps_per_run(self) -> int:
        """K: steps of B rays per DALI run."""
        return self.rays_per_run // self.rays_per_batch

    @property
    def positions_per_run(self) -> int:
        """Stream positions one DALI run walks: K x G with the global stream (the op's ``rays``;
        the rank keeps about K x B of them), K x B otherwise."""
        return self.steps_per_run * (self.global_batch if self.ray_stream == "global" else self.rays_per_batch)

    def stream(self, cell: Optional[int] = None) -> Tuple[int, int]:
        """(stream id, number of streams) of the op's key: (rank, world size) for data parallel,
        (cell, number of cells) for a spatial-segmentation cell."""
        if cell is None:
            return self.rank, self.world_size
        if not 0 <= int(cell) < self.num_cells:
            raise ConfigError(f"cell={cell}: the partition has {self.num_cells} cells")
        return int(cell), self.num_cells

    def ray_graph(self, scene=None, first_start: int = 0, *, partition=None, cell: Optional[int] = None) -> RayGraph:
        """The ray graph this plan samples with (:class:`~dali_nerf.pipelines.rays.RayGraph`), its
        first run at stream position ``first_start``: a data-parallel rank's stream over its shard
        (:attr:`ray_stream` global: the split's stream, whose pixel count and the shard's first
        pixel come from ``scene``), or cell ``cell``'s stream routed by ``partition`` (SS)."""
        import torch

        common = dict(mode=self.mode, seed=self.seed, first_start=int(first_start), device=self.device,
                      num_threads=self.threads, prefetch=self.prefetch,
                      device_id=torch.cuda.current_device() if self.device == "cuda" else None)
        if partition is not None:
            stream, n = self.stream(cell)
            return RayGraph(self.rays_per_run, stream=stream, num_streams=n, partition=partition, cell=int(cell),
                            **common)
        if self.ray_stream == "global":  # the split's stream: the seed's alone; the cache is the shard [lo, ...)
            from dali_nerf.data.masks import stream_sizes

            px = shard_sizes(scene, self.world_size, stream_sizes(scene))  # a masked split's: its valid pixels
            total = int(px.sum())  # (a fully masked shard keeps no position wherever it begins: inside the op's range)
            return RayGraph(self.positions_per_run, global_pixels=total,
                            shard_begin=min(int(px[:self.rank].sum()), total - 1), step_positions=self.global_batch,
                            **common)
        return RayGraph(self.rays_per_run, stream=self.rank, num_streams=self.world_size, **common)

    def for_source(self, name: str) -> "SamplingPlan":
        """This plan as the source ``name`` runs it: ``rays_sync`` is ``rays`` at prefetch 0 with
        its DALI threads at normal priority (the training thread waits for them: nobody samples
        ahead); every other source as planned."""
        if name == "rays_sync" and (self.prefetch, self.priority) != (0, "normal"):
            return dataclasses.replace(self, prefetch=0, priority="normal")
        return self

    @classmethod
    def for_loader(cls, rays_per_batch: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                   mode: str = "random", prefetch: int = 2, device: str = "cpu", num_threads: Optional[int] = None,
                   rays_per_run: Optional[int] = None, thread_priority: str = "normal", workers: int = 2,
                   decode_batch: int = 8, max_bytes: Optional[int] = None, window_images: int = 0,
                   rays_per_window: int = 0, cells: Sequence[int] = (), num_cells: int = 0,
                   stream: str = "shard") -> "SamplingPlan":
        """The plan of a loader built from its arguments (RayLoader's drop-in API): threads and run
        size where given (> 0), else this host's budget (:func:`dali_nerf.data.hostbudget.host_budget`);
        ``thread_priority`` normal | background; ``stream`` shard | global (G = B x world size)."""
        _positive("rays_per_batch", rays_per_batch)
        B = int(rays_per_batch)
        budget = None
        threads, run = num_threads, rays_per_run
        if not (threads and run):
            budget = host_budget(B)
            threads, run = int(threads or budget.threads), int(run or budget.rays_per_run)
        _positive("rays_per_run", run)
        _positive("num_threads", threads)
        dev = resolve_device(device)
        prio = check_priority(thread_priority)  # a resolved value (a config's auto: plan_from_config)
        G = _global_batch(stream, B, world_size)
        K = _steps_per_run(run, B, G)
        return cls(rays_per_batch=B, rays_per_run=K * B, threads=int(threads), priority=prio, device=dev,
                   seed=int(seed), mode=mode, rank=int(rank), world_size=int(world_size), prefetch=int(prefetch),
                   workers=int(workers), decode_batch=int(decode_batch), max_bytes=max_bytes,
                   window_images=int(window_images), rays_per_window=int(rays_per_window), cells=tuple(cells),
                   num_cells=int(num_cells), budget=budget, ray_stream=stream, global_batch=G)


def _global_batch(stream: str, rays_per_batch: int, world_size: int) -> int:
    """G of a ``stream``: B x W for global (checked within the op's int64 step_positions), 0 for shard."""
    if stream not in ("shard", "global"):
        raise ConfigError(f"stream={stream!r}: use global or shard")
    if stream == "shard":
        return 0
    G = int(rays_per_batch) * int(world_size)
    if G > INT32_MAX:
        raise ConfigError(f"pipeline.rays_per_batch={rays_per_batch}: the global batch of {world_size} ranks, {G} rays, "
                          f"is over the op's limit of {INT32_MAX} positions per run; lower rays_per_batch")
    return G


def _steps_per_run(run: int, rays_per_batch: int, global_batch: int) -> int:
    """K = ceil(run / B), at least 1; with the global stream at most INT32_MAX // G (a run walks
    K x G positions, the op's int32 ``rays``): K does not change the stream, only its runs."""
    K = max(1, math.ceil(int(run) / int(rays_per_batch)))
    return max(1, min(K, INT32_MAX // global_batch)) if global_batch else K


RAY_GRAPH_SOURCES = ("rays", "rays_sync")
"""The sources that run our DALI ray graph (pipelined and synchronous): the same stream, epoch mode too."""


def run_stream(cfg) -> tuple:
    """(stream version, G) of a run's training stream: what a checkpoint records and an elastic
    resume keeps. DDP ``rays`` (and ``rays_sync``, the same sampler): the global stream (G = B x W
    at the run's start) or the shard stream; ``sync_global``: rank 0's global batch of B x W; SS
    ``rays`` / ``rays_sync``: the cells' own streams; splat: the image stream (:mod:`.imageorder`,
    G 0: nothing to keep across world sizes); the rest: per-rank streams (G 0)."""
    p = cfg.pipeline
    if cfg.method == "splat":  # the image stream: global positions, any world size (no G to keep)
        return IMAGE_STREAM, 0
    if cfg.method == "ss":
        return ("cells-v1" if p.name in RAY_GRAPH_SOURCES else f"ss-{p.name}-v1"), 0
    if p.name in RAY_GRAPH_SOURCES:
        return (GLOBAL_STREAM, 1) if p.stream == "global" else (SHARD_STREAM, 0)
    return (f"{p.name}-v1", 1 if p.name == "sync_global" else 0)


def _run_batch(cfg, world_size: int) -> int:
    """B of a run on ``world_size`` ranks: ``pipeline.global_batch`` G > 0 sets it to G / W (refused
    in one line when the run has no global batch, or W does not divide G, naming the rank counts
    that do); else ``pipeline.rays_per_batch``."""
    p = cfg.pipeline
    G = int(p.global_batch)
    if not G:
        return int(p.rays_per_batch)
    if not run_stream(cfg)[1]:
        raise ConfigError(f"pipeline.global_batch={G}: this run has no global batch (method {cfg.method}, "
                          f"pipeline.name={p.name}, pipeline.stream={p.stream}); set it with method ddp and "
                          f"pipeline.stream=global (or pipeline.name=sync_global), or leave it 0")
    return global_batch_share(G, world_size, f"pipeline.global_batch={G}")


def plan_from_config(cfg, rank: int = 0, world_size: int = 1, *, cells: Sequence[int] = (), num_cells: int = 0,
                     local_ranks: Optional[int] = None, cores: Optional[int] = None,
                     device: Optional[str] = None) -> SamplingPlan:
    """The plan of ``rank`` of ``world_size`` for a :class:`~dali_nerf.config.Config` (``pipeline``,
    ``cache``, ``train.device``); SS: this rank's ``cells`` of ``num_cells``.

    Rays per step: ``pipeline.global_batch`` / W where it is set, else ``pipeline.rays_per_batch``
    (:func:`_run_batch`); the run's stream and its G: :func:`run_stream`. Threads and rays per run:
    ``pipeline.num_threads`` / ``pipeline.rays_per_run`` where > 0, else
    :func:`~dali_nerf.data.hostbudget.host_budget` for ``local_ranks`` ranks (default
    ``LOCAL_WORLD_SIZE``) on ``cores`` usable cores (default this process's affinity). The threads
    are the rank's: an SS rank's ``cells`` share them (each cell's ray graph gets
    ``threads // len(cells)``, at least 1, and a run of that many threads' rays,
    :func:`~dali_nerf.data.hostbudget.run_size`, unless ``pipeline.rays_per_run`` sets it). Priority:
    ``pipeline.thread_priority`` resolved for ``train.device``. Device: ``device`` where given (the
    images in host memory of a GPU run: "cpu"), else :func:`sampling_device` of ``train.device``.
    Prefetch and priority as ``pipeline.name`` runs them (:meth:`SamplingPlan.for_source`)."""
    p, c = cfg.pipeline, cfg.cache
    B = _run_batch(cfg, world_size)
    version, has_global = run_stream(cfg)
    budget = None
    threads, run = p.num_threads, p.rays_per_run
    if not (threads and run):
        budget = host_budget(B, local_ranks=local_ranks, cores=cores)
        threads, run = int(threads or budget.threads), int(run or budget.rays_per_run)
    rank_threads = int(threads)
    if cells:  # an SS rank's cells share its threads (each at least one), and their runs that many threads
        threads = max(1, rank_threads // len(cells))
        run = p.rays_per_run or run_size(B, threads)
    stream = "shard" if cells else p.stream  # an SS cell's stream is already independent of the world size
    G = _global_batch(stream, B, world_size)
    K = _steps_per_run(run, B, G)
    return SamplingPlan(rays_per_batch=B, rays_per_run=K * B, threads=int(threads), rank_threads=rank_threads,
                        priority=resolve_priority(p.thread_priority, cfg.train.device),
                        device=resolve_device(device) if device else sampling_device(cfg.train.device),
                        seed=int(p.seed), mode=p.mode, rank=int(rank),
                        world_size=int(world_size), prefetch=int(p.prefetch), workers=int(p.workers),
                        decode_batch=int(c.decode_batch), max_bytes=c.max_bytes,
                        window_images=int(getattr(c, "window_images", 0)),
                        rays_per_window=int(getattr(c, "rays_per_window", 0)), cells=tuple(int(x) for x in cells),
                        num_cells=int(num_cells), budget=budget, ray_stream=stream, global_batch=G,
                        stream_version=version, run_global_batch=has_global * B * int(world_size)).for_source(p.name)


def rays_per_rank_spread(pixels_per_image: Sequence[int], world_size: int) -> float:
    """Under the global stream a rank samples G x (its shard's pixels / P) rays a step on average
    (DALI's shard rule gives some ranks one image more): the largest rank's share over the mean,
    1.0 when every shard holds as many pixels.

    >>> round(rays_per_rank_spread([160000] * 100, 48), 2)  # 100 equal images on 48 ranks
    1.44
    """
    px = [int(p) for p in pixels_per_image]
    W = int(world_size)
    if W <= 1 or not px:
        return 1.0
    shares = [sum(px[slice(*shard_range(len(px), r, W))]) for r in range(W)]
    return max(shares) * W / sum(shares)


UNEVEN_RAYS = 1.1
"""The spread of rays per rank above which rank 0 says so at start (:func:`uneven_rays_note`)."""


def uneven_rays_note(plan: SamplingPlan, pixels_per_image: Sequence[int]) -> Optional[str]:
    """One line for rank 0's stderr when the global stream's rays per rank are uneven by more than
    :data:`UNEVEN_RAYS` (its step time and GPU memory follow the largest rank), else None."""
    if plan.ray_stream != "global" or plan.world_size <= 1:
        return None
    spread = rays_per_rank_spread(pixels_per_image, plan.world_size)
    if spread <= UNEVEN_RAYS:
        return None
    return (f"note: with the global stream each rank samples the rays of its image shard: {len(pixels_per_image)} "
            f"images over {plan.world_size} ranks give the largest rank {spread:.2f}x the mean of "
            f"{plan.rays_per_batch} rays a step (step time and GPU memory follow it); a number of ranks that "
            f"divides the number of images evens it out")


def global_batch_share(G: int, world: int, key: str, unit: str = "ranks") -> int:
    """G / ``world``: each of ``world`` ranks' mean batch of a global batch G fixed by the setting
    ``key``; a ``world`` that does not divide G is refused in one line naming the nearest that do."""
    if G % world:
        raise ConfigError(f"{key} does not divide among {world} {unit}; use a number of {unit} that divides it "
                          f"({' or '.join(map(str, nearest_divisors(G, world)))}) or change it")
    return G // world


def nearest_divisors(n: int, world: int) -> List[int]:
    """The divisors of ``n`` nearest ``world`` (one that divides ``n``: ``[world]``): the largest
    below it and the smallest above it (if any), e.g. ``nearest_divisors(49152, 40) == [32, 48]``."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divs = sorted(set(small + [n // d for d in small]))
    if world in divs:
        return [world]
    return [d for d in (max((d for d in divs if d < world), default=None), min((d for d in divs if d > world),
                                                                                 default=None)) if d is not None]
