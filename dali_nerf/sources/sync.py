"""The study's synchronous baselines: same interface, batch contract and ``stats()`` as
:class:`~dali_nerf.sources.rays.RayLoader`.

Honest, vectorised torch implementations over the same decoded cache (from the
:class:`~dali_nerf.data.imagecache.CacheStore` each is handed, or one of its own):

* :class:`SyncLocalSampler` — each rank samples its own batch in the training thread:
  ``torch.randint`` pixel ids over its shard -> uint8 gather -> :func:`dali_nerf.data.rays.rays_from_indices`.
* :class:`SyncGlobalSampler` — the paper's setting: rank 0 holds ALL images, samples the global
  batch (B * world_size) inside the training step and scatters one slice to each rank
  (:func:`scatter_batches`; needs an initialised process group when world_size > 1).
* :class:`TorchWorkersSampler` — a ``torch.utils.data.DataLoader`` over an ``IterableDataset`` whose
  ``workers`` processes each produce whole batches (nerfstudio's parallel data manager).
* :class:`RoutedSyncLocal` / :class:`RoutedSyncGlobal` — the spatial-segmentation settings:
  candidate blocks from a :class:`PixelSampler` kept if they cross the cell
  (:func:`dali_nerf.partition.ray_cells`, vectorised numpy), sampled by the rank itself or by
  rank 0 for every rank's cell and scattered.

Streams are position-based like RayLoader's (step k = positions [k*B, (k+1)*B)): random mode
draws position block k with a generator seeded by :func:`dali_nerf.data.seeds.block_seed` (seed,
stream, k); epoch mode maps position s through ``torch.randperm(P)`` of epoch ``s // P`` seeded
by :func:`dali_nerf.data.seeds.perm_seed` (seed, stream, epoch). The stream id is the rank (or
:func:`dali_nerf.data.seeds.routed_stream` for the routed ones). They are deterministic and resumable
but are not the same random stream as the operator's. Masks: valid pixels alone, by a table of ids.

>>> src = SyncLocalSampler(scene, rays_per_batch=4096, rank=0, world_size=1)
>>> next(src)["rgb"].shape
torch.Size([4096, 3])
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from dali_nerf.errors import ConfigError
from dali_nerf.data.hostbudget import to_background
from dali_nerf.data.imagecache import CacheStore
from dali_nerf.data.masks import stream_sizes, valid_pixel_ids
from dali_nerf.launch_env import launch_env
from dali_nerf.interrupt import ignore_interrupts, interrupts_deferred
from dali_nerf.partition import ray_cells
from dali_nerf.pipelines.decode import shard_sizes
from dali_nerf.ops.limits import INT32_MAX, INT64_MAX
from dali_nerf.data.plan import SamplingPlan
from dali_nerf.data.rays import rays_from_indices
from dali_nerf.data.seeds import block_seed, perm_seed, routed_stream
from dali_nerf.sources.base import BatchSource, BatchStats, PlanView, check_scene_state, global_epoch_steps, scene_state
from dali_nerf.sources.checks import check_common, check_int, check_run_size

__all__ = ["SyncLocalSampler", "SyncGlobalSampler", "TorchWorkersSampler", "PixelSampler", "RoutedSyncLocal",
           "RoutedSyncGlobal", "scatter_batches", "collective_device", "WorkerBatches", "WorkerLoader", "routed_rays"]

_FLOAT_KEYS = ("origins", "directions", "rgb")


def collective_device(backend: str, device="cpu") -> torch.device:
    """Where the tensors a collective sends and receives must live: NCCL takes only CUDA tensors,
    on this process's GPU (``torch.device("cuda", LOCAL_RANK)``); other backends (gloo) use
    ``device``."""
    if backend == "nccl":
        return torch.device("cuda", launch_env().local_rank)
    return torch.device(device)


def scatter_batches(batches, rank: int, rays_per_batch: int, has_bounds: bool, device="cpu") -> dict:
    """Rank 0 hands batch ``r`` of ``batches`` to rank r (``torch.distributed.scatter``; a
    collective: every rank calls it, ranks other than 0 with ``batches=None``).

    The float keys (origins, directions, rgb[, near, far]) travel packed as one (B, 9 | 11) f32
    tensor, the indices as one (B, 3) i64 tensor, both sent and received on
    :func:`collective_device` (this rank's GPU under NCCL, else ``device``). Returns this rank's
    batch dict (views of the two, on that device). Used by the DDP and the SS ``sync_global``.
    """
    B = int(rays_per_batch)
    keys = _FLOAT_KEYS + (("near", "far") if has_bounds else ())
    dev = collective_device(dist.get_backend(), device)
    fl = torch.empty((B, 11 if has_bounds else 9), dtype=torch.float32, device=dev)
    ix = torch.empty((B, 3), dtype=torch.int64, device=dev)
    if rank == 0:
        dist.scatter(fl, [torch.cat([g[k] for k in keys], dim=1).to(dev).contiguous() for g in batches], src=0)
        dist.scatter(ix, [g["indices"].to(dev).contiguous() for g in batches], src=0)
    else:
        dist.scatter(fl, None, src=0)
        dist.scatter(ix, None, src=0)
    b = {"origins": fl[:, 0:3], "directions": fl[:, 3:6], "rgb": fl[:, 6:9], "indices": ix}
    if has_bounds:
        b["near"], b["far"] = fl[:, 9:10], fl[:, 10:11]
    return b


class PixelSampler:
    """Pixel ids -> batch dicts over one ImageCache, in torch (picklable; used in worker processes).

    Args:
        cache: ImageCache (pixels (P, 3) u8, cameras (N, 18), layout (N, 4)).
        scene: the split (c2w, intrinsics, near/far by split camera index).
        seed, rank: stream key; mode: "random" | "epoch"; device: "cpu" | "cuda".
    """

    def __init__(self, cache, scene, seed: int, rank: int, mode: str, device: str = "cpu"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only cache arrays: we never write
            px = cache.pixels if isinstance(cache.pixels, torch.Tensor) else torch.from_numpy(cache.pixels)
        self.device = device
        self.pixels = px.to(device)
        lay = torch.from_numpy(np.array(cache.layout))
        self.offsets = lay[:, 0].contiguous().to(device)
        self.widths = lay[:, 1].contiguous().to(device)
        self.cams = lay[:, 3].contiguous().to(device)
        self.c2w = torch.from_numpy(np.array(scene.c2w)).to(device)
        self.intrinsics = torch.from_numpy(np.array(scene.intrinsics)).to(device)
        self.near = torch.from_numpy(np.array(scene.near)).to(device) if scene.has_bounds else None
        self.far = torch.from_numpy(np.array(scene.far)).to(device) if scene.has_bounds else None
        ids = valid_pixel_ids(cache)  # masked: valid pixel k -> its pixel id, by a table (as torch samplers do)
        self.valid_ids = None if ids is None else torch.from_numpy(ids).to(device)
        self.P = int(cache.num_pixels) if ids is None else len(ids)
        if self.P == 0:
            raise ConfigError("PixelSampler: every pixel of the cache is masked; nothing to sample")
        self.seed, self.rank, self.mode = int(seed), int(rank), mode
        self._perms: dict = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        p = self._perms.get(epoch)
        if p is None:
            g = torch.Generator().manual_seed(perm_seed(self.seed, self.rank, epoch))
            p = torch.randperm(self.P, generator=g).to(self.device)
            self._perms = {k: v for k, v in self._perms.items() if k >= epoch - 1}
            self._perms[epoch] = p
        return p

    def pixel_ids(self, position: int, n: int) -> torch.Tensor:
        """(n,) int64 pixel ids of stream positions [position, position + n) (masked: the stream
        draws valid-pixel numbers, mapped to their pixels)."""
        ids = self._ids(position, n)
        return ids if self.valid_ids is None else self.valid_ids[ids]

    def _ids(self, position: int, n: int) -> torch.Tensor:
        if self.mode == "random":
            g = torch.Generator().manual_seed(block_seed(self.seed, self.rank, position))
            return torch.randint(0, self.P, (n,), generator=g).to(self.device)
        parts, s, end = [], position, position + n
        while s < end:
            e, off = divmod(s, self.P)
            take = min(end - s, self.P - off)
            parts.append(self._perm(e)[off:off + take])
            s += take
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def batch(self, pid: torch.Tensor) -> dict:
        """Batch dict (origins, directions, rgb (B, 3) f32, indices (B, 3) i64, near/far (B, 1)) of pixel ids (B,)."""
        img = torch.searchsorted(self.offsets, pid, right=True) - 1
        local = pid - self.offsets[img]
        w = self.widths[img]
        row = torch.div(local, w, rounding_mode="floor")
        col = local - row * w
        cam = self.cams[img]
        indices = torch.stack([cam, row, col], dim=-1)
        rgb = self.pixels[pid].to(torch.float32).div_(255.0)
        o, d = rays_from_indices(self.c2w, self.intrinsics, indices)
        out = {"origins": o, "directions": d, "rgb": rgb, "indices": indices}
        if self.near is not None:
            out["near"] = self.near[cam][:, None]
            out["far"] = self.far[cam][:, None]
        return out

    def sample(self, position: int, n: int) -> dict:
        return self.batch(self.pixel_ids(position, n))


def host_plan(rays_per_batch: int, num_threads: int, **kw) -> SamplingPlan:
    """The plan of a baseline built from its arguments: it samples on the host; ``num_threads``
    decode its cache."""
    kw.setdefault("device", "cpu")
    return SamplingPlan.for_loader(rays_per_batch, num_threads=num_threads, rays_per_run=rays_per_batch, **kw)


def _store(scene, plan: SamplingPlan, store: Optional[CacheStore]) -> CacheStore:
    """The store a source's images come from: the one it is handed, or one of its own."""
    return store if store is not None else CacheStore(scene, plan)


def _args_plan(scene, rays_per_batch, rank, world_size, seed, prefetch, mode, device, num_threads,
               **kw) -> SamplingPlan:
    """The plan of a baseline's direct API (its arguments, checked first: one line naming the argument)."""
    check_common(scene, rays_per_batch, rank, world_size, seed, prefetch, mode)
    return host_plan(rays_per_batch, num_threads, rank=rank, world_size=world_size, seed=seed, prefetch=prefetch,
                     mode=mode, device=device, **kw)


class _Source(PlanView, BatchSource):
    """Common state of a batch source: position/epoch/state_dict/stats/close/context manager."""

    _global = False

    def _init_common(self, scene, plan: SamplingPlan):
        p = plan
        check_common(scene, p.rays_per_batch, p.rank, p.world_size, p.seed, p.prefetch, p.mode)
        self.scene, self.plan = scene, plan
        # rank 0 of sync_global samples every rank's batch
        check_run_size(p.world_size if self._global else 1, p.rays_per_batch, p.prefetch + 2, p.device, op=False)
        self.position = 0
        self.epoch = 0
        self._stats = BatchStats()
        self._closed = False

    # rays this rank's stream advances per step, and pixels per stream epoch
    def _stride(self) -> int:
        return self.rays_per_batch

    def __len__(self) -> int:
        if self.mode != "epoch":
            raise TypeError(f"{type(self).__name__} in random mode is an infinite stream and has no len()")
        return self._epoch_steps()

    def _epoch_pixels(self) -> int:  # a rank's own shard stream (sync_global: the split's)
        return self.sampler.P

    def _epoch_steps(self) -> int:  # the largest shard's pixels (masked: valid ones) over B
        return math.ceil(int(shard_sizes(self.scene, self.world_size, stream_sizes(self.scene)).max()) /
                         self.rays_per_batch)

    def set_epoch(self, epoch: int) -> None:
        """Epoch mode: move to the start of permutation ``epoch``; random mode: recorded only."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ConfigError(f"set_epoch({epoch!r}): epoch must be an integer >= 0")
        self.epoch = int(epoch)
        if self.mode == "epoch":
            self._seek(self._epoch_start())

    def _epoch_start(self) -> int:
        """Stream position of the current epoch's first step."""
        return self.epoch * self._epoch_pixels()

    def _seek(self, position: int) -> None:
        self.position = int(position)

    def state_dict(self) -> dict:
        return {"position": self.position, "epoch": self.epoch, "steps": self._stats.steps, "mode": self.mode,
                "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "rays_per_batch": self.rays_per_batch, **scene_state(self.scene)}

    def load_state_dict(self, state: dict) -> None:
        check_scene_state(state, self.scene, type(self).__name__)
        for k in ("mode", "seed", "rank", "world_size", "rays_per_batch"):
            if k in state and state[k] != getattr(self, k):
                raise ConfigError(f"load_state_dict: saved {k}={state[k]!r} but this sampler has {getattr(self, k)!r}; "
                                  f"resume with the same settings")
        self.epoch = int(state.get("epoch", 0))
        self._seek(int(state["position"]))

    def close(self) -> None:
        self._closed = True


class SyncLocalSampler(_Source):
    """Each rank samples its own batch over its DALI shard, synchronously in ``__next__``.

    Args: as RayLoader (``prefetch`` is accepted and ignored: nothing runs ahead).
    Yields: the batch contract dict, B = rays_per_batch.
    """

    def __init__(self, scene, rays_per_batch: int = 4096, rank: int = 0, world_size: int = 1, seed: int = 0,
                 prefetch: int = 0, mode: str = "random", device: str = "cpu", num_threads: int = 2, cache=None, *,
                 plan: Optional[SamplingPlan] = None, store: Optional[CacheStore] = None):
        self._init_common(scene, plan or _args_plan(scene, rays_per_batch, rank, world_size, seed, prefetch, mode,
                                                    device, num_threads))
        self.cache = cache if cache is not None else _store(scene, self.plan, store).shard("cpu")
        self.sampler = PixelSampler(self.cache, scene, self.seed, self.rank, self.mode, self.device)

    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        t = self._stats.start()
        b = self.sampler.sample(self.position, self.rays_per_batch)
        self.position += self.rays_per_batch
        self._stats.stop(t, self.rays_per_batch)
        return b


class SyncGlobalSampler(_Source):
    """Rank 0 holds all images, samples the global batch B * world_size and scatters it.

    Every rank must call ``next()`` each step (a collective). Rank r receives rows
    ``[r * B, (r + 1) * B)`` of rank 0's global batch. The stream is the global one
    (key: seed, rank 0), so ``position`` advances by ``B * world_size`` per step.
    """

    _global = True

    def __init__(self, scene, rays_per_batch: int = 4096, rank: int = 0, world_size: int = 1, seed: int = 0,
                 prefetch: int = 0, mode: str = "random", device: str = "cpu", num_threads: int = 2, cache=None, *,
                 plan: Optional[SamplingPlan] = None, store: Optional[CacheStore] = None):
        self._init_common(scene, plan or _args_plan(scene, rays_per_batch, rank, world_size, seed, prefetch, mode,
                                                    device, num_threads))
        if self.world_size > 1:
            if not dist.is_available() or not dist.is_initialized():
                raise ConfigError("pipeline.name=sync_global with world_size > 1 needs an initialised "
                                  "torch.distributed process group; run under torchrun")
        self.has_bounds = scene.has_bounds
        self.sampler = None
        if self.rank == 0:
            self.cache = cache if cache is not None else _store(scene, self.plan, store).full("cpu")
            self.sampler = PixelSampler(self.cache, scene, self.seed, 0, self.mode, self.device)
        self._P = int(stream_sizes(scene).sum())  # the split's pixels (masked: its valid pixels)

    def _epoch_pixels(self) -> int:
        return self._P

    def _epoch_steps(self) -> int:
        """The current epoch's global steps (``global_epoch_steps``: they partition the stream)."""
        return global_epoch_steps(self.epoch, self._P, self.rays_per_batch * self.world_size)[1]

    def _epoch_start(self) -> int:
        G = self.rays_per_batch * self.world_size
        return global_epoch_steps(self.epoch, self._P, G)[0] * G

    def state_dict(self) -> dict:
        """The base state plus ``global_batch`` (B x W) and ``stream`` (``sync_global-v1``)."""
        return dict(super().state_dict(), global_batch=self.rays_per_batch * self.world_size, stream="sync_global-v1")

    def load_state_dict(self, state: dict) -> None:
        """Continue rank 0's global stream; the world size may differ from the saved sampler's
        when the global batch B x W is the same (step k is positions [k G, (k + 1) G) of rank 0's
        stream whatever W: W only cuts each global batch into rank slices)."""
        G = self.rays_per_batch * self.world_size
        saved = state.get("global_batch", state.get("rays_per_batch", self.rays_per_batch) * state.get("world_size", 1))
        if saved != G:
            raise ConfigError(f"load_state_dict: saved global batch {saved} (rays_per_batch x world_size) but this sampler "
                              f"has {G}; use rays_per_batch = {saved} / world_size")
        super().load_state_dict({k: v for k, v in state.items() if k not in ("rank", "world_size", "rays_per_batch")})

    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        t = self._stats.start()
        B, W = self.rays_per_batch, self.world_size
        if W == 1:
            b = self.sampler.sample(self.position, B)
        else:
            parts = None
            if self.rank == 0:
                g = self.sampler.sample(self.position, B * W)
                parts = [{k: v[r * B:(r + 1) * B] for k, v in g.items()} for r in range(W)]
            b = scatter_batches(parts, self.rank, B, self.has_bounds, self.device)
        self.position += B * W
        self._stats.stop(t, B)
        return b


# ---------------------------------------------------------------------------------------------
# DataLoader worker processes (TorchWorkersSampler, sources.routed_workers.RoutedTorchWorkers)


class WorkerBatches(torch.utils.data.IterableDataset):
    """Worker w of n yields ``batch(first + w)``, ``batch(first + w + n)``, ... (whole batches), so
    the DataLoader's round-robin over workers hands them out in batch order. ``batch`` (j -> dict)
    must pickle (a module-level function or a functools.partial of one)."""

    def __init__(self, batch, first: int = 0):
        self.batch, self.first = batch, int(first)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, n = (0, 1) if info is None else (info.id, info.num_workers)
        j = self.first + w
        while True:
            yield self.batch(j)
            j += n


def _worker_init(_, background: bool = False):
    ignore_interrupts()  # Ctrl-C is the main process's to handle: it shuts the workers down
    torch.set_num_threads(1)
    if background:
        to_background([0])


class WorkerLoader:
    """Mixin of the sources whose batches come from DataLoader worker processes: ``_start_workers``
    starts them, ``_shutdown`` stops them (the next batch starts them again), ``close`` for good.
    State: ``self._it`` (the DataLoader iterator or None) and ``self._closed``."""

    _it = None
    _closed = False

    @property
    def thread_priority(self) -> str:
        """The worker processes' priority: the plan's (normal | background)."""
        return self.plan.priority

    @property
    def workers(self) -> int:
        """DataLoader worker processes: the plan's."""
        return self.plan.workers

    def _start_workers(self, dataset: WorkerBatches, workers: int, prefetch: int, pin_memory: bool = False) -> None:
        """``workers`` persistent processes (1 torch thread each, ``prefetch`` batches each ahead;
        0 workers: in-process), at ``self.thread_priority`` (background: SCHED_IDLE, as the DALI
        loaders' threads, :mod:`dali_nerf.data.hostbudget`)."""
        kw = {}
        if workers > 0:
            init = functools.partial(_worker_init, background=self.thread_priority == "background")
            kw = dict(persistent_workers=True, prefetch_factor=prefetch, worker_init_fn=init)
        with interrupts_deferred():  # not cut in half by Ctrl-C; workers forked with SIGINT blocked
            self._it = iter(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers,
                                                        pin_memory=pin_memory, **kw))

    def _shutdown(self) -> None:
        it, self._it = self._it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._shutdown()


def check_workers(workers, key: str) -> None:
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 0:
        raise ConfigError(f"{key}={workers!r}: must be an integer >= 0")


def _shard_batch(sampler: PixelSampler, base: int, B: int, j: int) -> dict:
    return sampler.sample(base + j * B, B)


class TorchWorkersSampler(WorkerLoader, _Source):
    """A torch DataLoader with ``workers`` processes, each producing whole batches of this rank's shard.

    Batches arrive in step order (DataLoader's round-robin over workers), so the stream equals
    SyncLocalSampler's for the same arguments. ``workers=0`` samples in-process.
    ``thread_priority``: the worker processes' priority, as RayLoader's sampler threads.
    """

    def __init__(self, scene, rays_per_batch: int = 4096, rank: int = 0, world_size: int = 1, seed: int = 0,
                 prefetch: int = 2, mode: str = "random", device: str = "cpu", num_threads: int = 2,
                 workers: int = 2, cache=None, thread_priority: str = "normal", *, plan: Optional[SamplingPlan] = None,
                 store: Optional[CacheStore] = None):
        if plan is None:
            check_workers(workers, "workers")
            plan = _args_plan(scene, rays_per_batch, rank, world_size, seed, prefetch, mode, device, num_threads,
                              workers=int(workers), thread_priority=thread_priority)
        self._init_common(scene, plan)
        self.cache = cache if cache is not None else _store(scene, self.plan, store).shard("cpu")
        # workers sample on the CPU; batches are pinned and moved to the GPU by the consumer side
        self.sampler = PixelSampler(self.cache, scene, self.seed, self.rank, self.mode, "cpu")
        self._it = None

    def _seek(self, position: int) -> None:
        if int(position) != self.position:
            self._shutdown()
        self.position = int(position)

    def _start(self):
        ds = WorkerBatches(functools.partial(_shard_batch, self.sampler, self.position, self.rays_per_batch))
        self._start_workers(ds, self.workers, max(1, self.prefetch), pin_memory=self.device == "cuda")

    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        t = self._stats.start()
        if self._it is None:
            self._start()
        b = next(self._it)
        if self.device == "cuda":  # pragma: no cover - needs a GPU
            b = {k: v.to("cuda", non_blocking=True) for k, v in b.items()}
        self.position += self.rays_per_batch
        self._stats.stop(t, self.rays_per_batch)
        return b


# ---------------------------------------------------------------------------------------------
# routed baselines (spatial segmentation)


def routed_rays(sampler: PixelSampler, partition, cell: int, position: int, n: int, block: int):
    """(batch of the first ``n`` rays of ``sampler``'s stream from ``position`` that cross ``cell``,
    next position): candidate blocks of ``block`` rays, kept by the numpy exact routing test
    (:func:`dali_nerf.partition.ray_cells`)."""
    parts, got, pos = [], 0, position
    while got < n:
        b = sampler.sample(pos, block)
        pos += block
        keep = ray_cells(partition, b["origins"].numpy(), b["directions"].numpy(),
                         b["near"].numpy()[:, 0], b["far"].numpy()[:, 0])[:, cell]
        idx = torch.from_numpy(np.nonzero(keep)[0])
        parts.append({k: v[idx] for k, v in b.items()})
        got += len(idx)
    return {k: torch.cat([p[k] for p in parts])[:n] for k in parts[0]}, pos


class _RoutedSampler:
    """Candidate blocks from a PixelSampler, kept if they cross ``cell`` (numpy exact routing)."""

    def __init__(self, cache, scene, partition, seed: int, key: int, block: int):
        self.sampler = PixelSampler(cache, scene, seed, key, "random")
        self.partition, self.block = partition, int(block)

    def sample(self, position: int, cell: int, n: int):
        """(batch of n rays of ``cell``, next position)."""
        return routed_rays(self.sampler, self.partition, cell, position, n, self.block)


def routed_plan(rays_per_batch, seed, num_threads: int, **kw) -> SamplingPlan:
    """The plan of a routed baseline's direct API (its arguments checked first)."""
    check_int("rays_per_batch", rays_per_batch, 1, INT32_MAX)
    check_int("seed", seed, 0, INT64_MAX)
    return host_plan(rays_per_batch, num_threads, seed=seed, **kw)


class RoutedSyncLocal(BatchSource):
    """SS ``sync_local``: the rank samples its cell's batch in the training thread."""

    def __init__(self, scene, partition, cell: int, rays_per_batch: int = 4096, seed: int = 0, cache=None,
                 num_threads: int = 2, *, plan: Optional[SamplingPlan] = None, store: Optional[CacheStore] = None):
        self.plan = plan or routed_plan(rays_per_batch, seed, num_threads)
        B = self.plan.rays_per_batch
        cache = cache if cache is not None else _store(scene, self.plan, store).full("cpu")
        self.scene = scene
        self.cell, self.rays_per_batch = int(cell), B
        self._s = _RoutedSampler(cache, scene, partition, self.plan.seed, routed_stream(cell=cell), 2 * B)
        self.position = 0
        self._stats = BatchStats()

    def __next__(self):
        t = self._stats.start()
        b, self.position = self._s.sample(self.position, self.cell, self.rays_per_batch)
        self._stats.stop(t, self.rays_per_batch)
        return b

    def state_dict(self):
        return {"position": self.position, "cell": self.cell, **scene_state(self.scene)}

    def load_state_dict(self, s):
        check_scene_state(s, self.scene, "RoutedSyncLocal")
        self.position = int(s["position"])



class RoutedSyncGlobal(BatchSource):
    """SS ``sync_global`` (the study's setting): rank 0 samples the batches of every rank's
    ``slot``-th cell in the training step and scatters them. A collective: every rank calls
    ``next()`` on its slot-th source in the same order."""

    def __init__(self, scene, partition, cells_per_rank, rank: int, slot: int, rays_per_batch: int = 4096,
                 seed: int = 0, cache=None, num_threads: int = 2, *, plan: Optional[SamplingPlan] = None,
                 store: Optional[CacheStore] = None):
        self.plan = plan or routed_plan(rays_per_batch, seed, num_threads)
        B = self.plan.rays_per_batch
        self.world_size = len(cells_per_rank)
        if len({len(c) for c in cells_per_rank}) != 1:
            raise ConfigError(f"pipeline.name=sync_global with method ss needs the same number of cells on every rank "
                              f"({[len(c) for c in cells_per_rank]}); make partition cells a multiple of the world size")
        if self.world_size > 1 and not dist.is_initialized():
            raise ConfigError("pipeline.name=sync_global with world_size > 1 needs torchrun (an initialised process group)")
        self.scene = scene
        self.rank, self.slot, self.rays_per_batch = int(rank), int(slot), B
        self.cells = [c[slot] for c in cells_per_rank]
        self.position = [0] * self.world_size
        self._s = None
        if self.rank == 0:
            cache = cache if cache is not None else _store(scene, self.plan, store).full("cpu")
            self._s = _RoutedSampler(cache, scene, partition, self.plan.seed, routed_stream(slot=slot), 2 * B)
        self._stats = BatchStats()

    def __next__(self):
        t = self._stats.start()
        B, W = self.rays_per_batch, self.world_size
        if W == 1:
            b, self.position[0] = self._s.sample(self.position[0], self.cells[0], B)
        else:
            parts = None
            if self.rank == 0:
                parts = []
                for r in range(W):
                    g, self.position[r] = self._s.sample(self.position[r], self.cells[r], B)
                    parts.append(g)
            b = scatter_batches(parts, self.rank, B, has_bounds=True)
        self._stats.stop(t, B)
        return b

    def state_dict(self):
        return {"position": list(self.position), "slot": self.slot, **scene_state(self.scene)}

    def load_state_dict(self, s):
        check_scene_state(s, self.scene, "RoutedSyncGlobal")
        slot, ranks = int(s.get("slot", self.slot)), len(s["position"])
        if (slot, ranks) != (self.slot, self.world_size):  # each rank's cell of the slot has its position
            raise ConfigError(f"RoutedSyncGlobal.load_state_dict: the state is cell slot {slot}'s on {ranks} rank(s), "
                              f"this sampler slot {self.slot}'s on {self.world_size}; load each slot's state into "
                              f"the same slot of a run of as many ranks")
        self.position = [int(p) for p in s["position"]]
