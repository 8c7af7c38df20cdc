"""SpatialRayLoader: the spatial-segmentation batch source of one cell, our ray graph routed.

It runs the same operator as the DDP source with the partition's centroids as a 4th input and
``cell=j`` (:func:`dali_nerf.pipelines.rays.ray_pipeline` with ``partition``): each run emits
exactly ``K * B`` rays that cross cell j (exact closed-form test inside the op, no mask
precompute) and reports how many stream positions it consumed. The next run starts right where
the previous one ended, a count known only once that run is done; the graph feeds the op
``start = -1`` after its first run ("continue after your previous run", which the op tracks
itself), so DALI computes ``prefetch`` runs ahead in its own threads like the DDP graph, and each
run's outputs are fresh buffers handed out zero copy. Every rank holds all images of the split —
a ray of any image may cross its cell.

The stream of cell j is keyed by (seed, rank=j, world_size=C): identical whichever rank trains the
cell. ``state_dict()`` = {"run_start", "offset"}: the run's first stream position and the rays of
it already handed out; the op is deterministic given ``start``, so resume is exact. The loader is
a :class:`~dali_nerf.sources.runner.RunSource` of a :class:`CellProducer` (the runner hands out
the steps, runs the graph ahead on its thread, keeps the stall accounting and the state).

>>> src = SpatialRayLoader(scene, partition, cell=0, rays_per_batch=4096)
>>> next(src)["origins"].shape
torch.Size([4096, 3])
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from dali_nerf.data.imagecache import CacheStore
from dali_nerf.data.plan import SamplingPlan
from dali_nerf.errors import ConfigError
from dali_nerf.ops.limits import INT32_MAX, INT64_MAX
from dali_nerf.pipelines.rays import RAY_OUTPUTS, abort_pipeline, ray_pipeline, release_pipeline
from dali_nerf.sources.base import PlanView
from dali_nerf.sources.checks import MAX_PREFETCH, check_cache_device, check_int, check_run_size
from dali_nerf.sources.dalirun import run_graph, step_views
from dali_nerf.sources.runner import Run, RunSource

__all__ = ["SpatialRayLoader", "CellProducer"]

KEYS = RAY_OUTPUTS[:-1]
"""A cell's batch keys: origins, directions, rgb, indices, near, far."""


class CellProducer:
    """The runs of our ray graph routed to one cell: the producer of a :class:`SpatialRayLoader`
    (the contract of :mod:`dali_nerf.sources.runner`). A graph is the op's routed DALI pipeline
    started at a stream position; a run is K steps of B accepted rays and consumed the stream
    positions the op reports (known once it is made: not a linear producer)."""

    kind = "SpatialRayLoader"
    linear = False

    def __init__(self, scene, plan: SamplingPlan, cache, partition, cell: int):
        self.scene, self.plan, self.cache, self.partition, self.cell = scene, plan, cache, partition, int(cell)
        self.who, self.thread_name = f"SpatialRayLoader cell {cell}", f"dali_nerf-cell{cell}"
        self.ahead = plan.prefetch > 0 and plan.device == "cpu"
        self.steps_per_run, self.phase_rank = plan.steps_per_run, self.cell

    def _graph(self, start: int):
        """The plan's graph of this cell, its first run at stream position ``start``."""
        return self.plan.ray_graph(first_start=start, partition=self.partition, cell=self.cell)

    def build(self, start: int):
        return ray_pipeline(self.cache, self._graph(start))

    def produce(self, pipe) -> Run:
        p = self.plan
        consumed, run = run_graph(pipe, p.device, KEYS, copy=p.prefetch <= 0)
        return Run(step_views(run, p.steps_per_run, p.rays_per_batch), p.rays_per_batch, consumed, keys=KEYS, data=run)

    def release(self, pipe) -> None:
        release_pipeline(pipe)

    def abort(self, pipe) -> None:
        abort_pipeline(pipe)

    def state(self, start: int, offset: int) -> dict:
        p = self.plan
        return {"run_start": int(start), "offset": int(offset), "cell": self.cell, "seed": p.seed, "mode": p.mode,
                "rays_per_batch": p.rays_per_batch, "rays_per_run": p.rays_per_run}

    def load_state(self, state: dict) -> tuple:
        """Continue the cell's stream exactly. ``rays_per_run`` may differ from the saved loader's
        (an SS rank's cells share its threads, so the run size follows the cells per rank: a run
        resumed on another world size): the accepted stream does not depend on it; when the saved
        offset lies past this loader's first run, the stream position after it is found by one
        run of ``offset`` rays from the saved run's start."""
        p = self.plan
        have = {"cell": self.cell, "seed": p.seed, "mode": p.mode, "rays_per_batch": p.rays_per_batch}
        for k in ("cell", "seed", "mode", "rays_per_batch"):
            if k in state and state[k] != have[k]:
                raise ConfigError(f"load_state_dict: saved {k}={state[k]!r} but this loader has {have[k]!r}")
        saved_run = state.get("rays_per_run", p.rays_per_run)
        check_int("load_state_dict: run_start", state.get("run_start"), 0, INT64_MAX - max(p.rays_per_run, saved_run))
        check_int("load_state_dict: offset", state.get("offset"), 0, max(p.rays_per_run, saved_run))
        start, offset = int(state["run_start"]), int(state["offset"])
        if offset + p.rays_per_batch > p.rays_per_run and offset > 0:
            start, offset = self._advance(start, offset), 0
        return start, offset

    def _advance(self, start: int, rays: int) -> int:
        """The stream position after ``rays`` accepted rays from position ``start`` (one run)."""
        pipe = ray_pipeline(self.cache, dataclasses.replace(self._graph(start), rays=int(rays), prefetch=0))
        try:
            consumed, _ = run_graph(pipe, self.plan.device, (), copy=False)
        finally:
            release_pipeline(pipe)
        return int(start) + consumed

    def info(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class SpatialRayLoader(PlanView, RunSource):
    """Batches of rays crossing one cell, sampled ahead by DALI (``prefetch`` runs).

    Args:
        scene: the split; cache: its ImageCache (all images, world_size 1), or None: the ``store``'s
            (a :class:`~dali_nerf.data.imagecache.CacheStore`; None: one of this loader's own).
        partition: :class:`~dali_nerf.partition.Partition`; cell: the cell j.
        rays_per_batch: B; rays_per_run: rounded up to K * B accepted rays per op run.
        prefetch: runs DALI computes ahead (0: synchronous, each run's outputs copied).
        thread_priority: "normal" | "background", as :class:`~.rays.RayLoader`.
    Yields:
        the batch dict (origins, directions, rgb, indices, near, far), B rays of cell j: the
        accepted rays in stream order, so neither ``prefetch`` nor ``rays_per_run`` changes them.
    """

    def __init__(self, scene, partition, cell: int, rays_per_batch: int = 4096, seed: int = 0, prefetch: int = 2,
                 mode: str = "random", device: str = "cpu", num_threads: Optional[int] = None,
                 rays_per_run: Optional[int] = None, cache=None, decode_batch: int = 8,
                 thread_priority: str = "normal", *, plan: Optional[SamplingPlan] = None,
                 store: Optional[CacheStore] = None):
        if not 0 <= cell < partition.num_cells:
            raise ConfigError(f"cell={cell}: partition has {partition.num_cells} cells")
        if not scene.has_bounds:
            raise ConfigError(f"{scene.root}: spatial routing needs per-image near/far bounds; use a scene format that defines them")
        if plan is None:  # the direct API: its arguments make the plan
            check_int("rays_per_batch", rays_per_batch, 1, INT32_MAX)
            check_int("seed", seed, 0, INT64_MAX)
            check_int("prefetch", prefetch, 0, MAX_PREFETCH)
            if mode not in ("random", "epoch"):
                raise ConfigError(f"mode={mode!r}: use random or epoch")
            plan = SamplingPlan.for_loader(rays_per_batch, seed=seed, mode=mode, prefetch=prefetch, device=device,
                                           num_threads=num_threads, rays_per_run=rays_per_run,
                                           thread_priority=thread_priority, decode_batch=decode_batch,
                                           cells=(int(cell),), num_cells=partition.num_cells)
        self.plan = plan
        self.scene, self.partition, self.cell = scene, partition, int(cell)
        check_run_size(self.steps_per_run, self.rays_per_batch, self.prefetch + 2, self.device)
        if cache is not None:
            check_cache_device(cache, self.device, "SpatialRayLoader")
        self.cache = cache if cache is not None else (store or CacheStore(scene, plan)).full(plan.device)
        self._consumed_total = 0
        self._accepted_total = 0
        super().__init__(CellProducer(scene, plan, self.cache, partition, self.cell), plan.priority)

    @property
    def run_start(self) -> int:
        """Stream position of the run the next batch is taken from."""
        return self._cursor()[0]

    @property
    def offset(self) -> int:
        """Accepted rays of that run already handed out."""
        return self._cursor()[1]

    def _received(self, run: Run) -> None:
        super()._received(run)
        self._consumed_total += run.consumed
        self._accepted_total += run.length

    def stats(self) -> dict:
        """:class:`~dali_nerf.sources.base.BatchStats`'s and ``acceptance``: the rays kept per stream
        position sampled (None before the first run)."""
        d = super().stats()
        d["acceptance"] = self._accepted_total / self._consumed_total if self._consumed_total else None
        return d
