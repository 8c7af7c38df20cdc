"""SS ``torch_workers``: routed batches of one cell from a torch DataLoader with worker processes.

The background baseline of spatial segmentation, as ``sources.sync.TorchWorkersSampler`` is data
parallel's (nerfstudio-style parallel data manager): ``workers`` processes each sample whole
batches of the cell — candidate rays from :class:`~dali_nerf.sources.sync.PixelSampler`, kept when
they cross the cell (:func:`dali_nerf.partition.ray_cells`, the routed baselines' numpy test) —
and the DataLoader hands them out in batch order with ``prefetch`` batches per worker ahead.

Stream: batch j draws its candidates from stream positions ``j * 2**32 + k * block`` (k = 0, 1, ...
until B rays crossed the cell), so each batch is independent of the others and of which worker
made it, and ``state_dict`` = {"batch": j} resumes exactly. It is not the same random stream as
``RoutedSyncLocal``'s (which continues one stream) nor the operator's.

>>> src = RoutedTorchWorkers(scene, partition, cell=0, rays_per_batch=4096, workers=2)
>>> next(src)["origins"].shape
torch.Size([4096, 3])
"""

from __future__ import annotations

import functools
from typing import Optional

from dali_nerf.data import seeds
from dali_nerf.errors import ConfigError
from dali_nerf.data.imagecache import CacheStore
from dali_nerf.data.plan import SamplingPlan
from dali_nerf.sources.base import BatchSource, BatchStats, check_scene_state, scene_state
from dali_nerf.sources.checks import MAX_PREFETCH, check_int
from dali_nerf.sources.sync import (PixelSampler, WorkerBatches, WorkerLoader, check_workers, routed_plan,
                                    routed_rays)

__all__ = ["RoutedTorchWorkers", "routed_batch"]

_STRIDE = 1 << 32


def routed_batch(sampler, partition, cell: int, j: int, n: int, block: int) -> dict:
    """Batch j of ``cell``: the first ``n`` candidates from positions ``j * 2**32 + ...`` that cross it."""
    return routed_rays(sampler, partition, cell, int(j) * _STRIDE, n, block)[0]


class RoutedTorchWorkers(WorkerLoader, BatchSource):
    """Batches of rays crossing ``cell`` from ``workers`` DataLoader processes (0: in-process).

    Args:
        scene: the split (needs near/far bounds); partition, cell: the routing.
        rays_per_batch: B; seed: stream key (the cell is part of it); prefetch: batches per worker ahead.
        cache: ImageCache of all images of the split (every SS rank holds all of them); None: the
            ``store``'s (a :class:`~dali_nerf.data.imagecache.CacheStore`; None: one of its own).
        workers: worker processes (1 thread each).
        thread_priority: the worker processes' priority ("normal" | "background", as RayLoader).
    Yields:
        the batch dict (origins, directions, rgb (B, 3) f32, indices (B, 3) i64, near/far (B, 1) f32).
    """

    def __init__(self, scene, partition, cell: int, rays_per_batch: int = 4096, seed: int = 0, prefetch: int = 2,
                 cache=None, workers: int = 2, num_threads: int = 2, thread_priority: str = "normal", *,
                 plan: Optional[SamplingPlan] = None, store: Optional[CacheStore] = None):
        if not 0 <= cell < partition.num_cells:
            raise ConfigError(f"cell={cell}: partition has {partition.num_cells} cells")
        if not scene.has_bounds:
            raise ConfigError(f"{scene.root}: spatial routing needs per-image near/far bounds; use a scene format that defines them")
        if plan is None:  # the direct API: its arguments make the plan
            check_workers(workers, "pipeline.workers")
            check_int("prefetch", prefetch, 0, MAX_PREFETCH)
            plan = routed_plan(rays_per_batch, seed, num_threads, prefetch=prefetch, workers=int(workers),
                               thread_priority=thread_priority)
        self.plan = plan
        self.scene, self.partition, self.cell = scene, partition, int(cell)
        self.rays_per_batch, self.seed = plan.rays_per_batch, plan.seed
        self.prefetch = max(1, plan.prefetch)  # batches per worker ahead (a DataLoader needs one at least)
        cache = cache if cache is not None else (store or CacheStore(scene, plan)).full("cpu")
        self.sampler = PixelSampler(cache, scene, self.seed, seeds.routed_stream(workers_cell=self.cell), "random")
        self.batch = 0
        self._stats = BatchStats()
        self._it = None
        self._closed = False

    def _start(self):
        batch = functools.partial(routed_batch, self.sampler, self.partition, self.cell, n=self.rays_per_batch,
                                  block=2 * self.rays_per_batch)
        self._start_workers(WorkerBatches(batch, first=self.batch), self.workers, self.prefetch)

    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError("RoutedTorchWorkers is closed")
        t = self._stats.start()
        if self._it is None:
            self._start()
        b = next(self._it)
        self.batch += 1
        self._stats.stop(t, self.rays_per_batch)
        return b

    def state_dict(self) -> dict:
        return {"batch": self.batch, "cell": self.cell, "seed": self.seed, "rays_per_batch": self.rays_per_batch,
                **scene_state(self.scene)}

    def load_state_dict(self, state: dict) -> None:
        check_scene_state(state, self.scene, "RoutedTorchWorkers")
        for k in ("cell", "seed", "rays_per_batch"):
            if k in state and state[k] != getattr(self, k):
                raise ConfigError(f"load_state_dict: saved {k}={state[k]!r} but this source has {getattr(self, k)!r}")
        self._shutdown()
        self.batch = int(state["batch"])
