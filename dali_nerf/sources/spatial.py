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
it already handed out; the op is deterministic given ``start``, so resume is exact.

>>> src = SpatialRayLoader(scene, partition, cell=0, rays_per_batch=4096)
>>> next(src)["origins"].shape
torch.Size([4096, 3])
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from dali_nerf.errors import ConfigError
from dali_nerf.data.hostbudget import dali_threads
from dali_nerf.data.imagecache import CacheStore
from dali_nerf.pipelines.rays import INT32_MAX, INT64_MAX, RAY_OUTPUTS, ray_pipeline, release_pipeline
from dali_nerf.data.plan import SamplingPlan
from dali_nerf.sources.base import (MAX_PREFETCH, BatchSource, PlanView, BatchStats, RunAhead, check_cache_device, check_int,
                                    check_run_size, check_scene_state, demote_if_starved, run_graph, run_phase,
                                    scene_state, step_views)

__all__ = ["SpatialRayLoader"]


class SpatialRayLoader(PlanView, BatchSource):
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

    starvation_guard = True
    """Background priority: return a starved sampler to normal priority (as RayLoader)."""

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
        self.thread_priority = plan.priority  # the sampler's priority now (a starved one returns to normal)
        check_run_size(self.steps_per_run, self.rays_per_batch, self.prefetch + 2, self.device)
        if cache is not None:
            check_cache_device(cache, self.device, "SpatialRayLoader")
        self.cache = cache if cache is not None else (store or CacheStore(scene, plan)).full(plan.device)
        self.run_start, self.offset = 0, 0
        self._run = None            # (start, consumed, {name: (R, ...) tensor}) of the current run
        self._next_run_start = 0    # stream position of the next run the pipeline delivers
        self._consumed_total = 0
        self._accepted_total = 0
        self._stats = BatchStats()
        self._pipe = None
        self._ahead: Optional[RunAhead] = None  # background hand-over of self._pipe's runs (CPU, prefetch > 0)
        self._phase = 0  # the step of each run at which self._ahead may produce the next (run_phase)
        self._steps = None          # K tuples of (B, ...) views of the current run, in RAY_OUTPUTS order
        self._closed = False

    # ---- producing ---------------------------------------------------------------------------
    def _fetch_run(self):
        """The pipeline's next run (a pipeline is built at ``_next_run_start`` when there is none):
        (start, consumed, {name: (R, ...) tensor}, K step views). With ``prefetch`` > 0 on the CPU
        the runs come from a :class:`~.base.RunAhead` thread."""
        K, B = self.steps_per_run, self.rays_per_batch
        if self._pipe is None:
            before = dali_threads() if self.thread_priority == "background" else None
            self._pipe = ray_pipeline(self.cache, self._graph(self._next_run_start))
            if self.prefetch > 0 and self.device == "cpu":
                def produce(pipe):
                    consumed, run = run_graph(pipe, "cpu", RAY_OUTPUTS[:-1], copy=False)
                    return consumed, run, step_views(run, K, B)

                self._ahead = RunAhead(self._pipe, produce, name=f"dali_nerf-cell{self.cell}", background=before,
                                       guard=self.starvation_guard)
                self._phase = run_phase(self.cell, K)
        if self._ahead is not None:
            consumed, run, steps = self._ahead.get()
        else:
            consumed, run = run_graph(self._pipe, self.device, RAY_OUTPUTS[:-1], copy=self.prefetch <= 0)
            steps = step_views(run, K, B)
        start = self._next_run_start
        self._next_run_start += consumed
        return start, consumed, run, steps

    def _graph(self, start: int):
        """The plan's graph of this cell, its first run at stream position ``start``."""
        return self.plan.ray_graph(first_start=start, partition=self.partition, cell=self.cell)

    def _drop_pipeline(self):
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        if self._pipe is not None:
            pipe, self._pipe = self._pipe, None
            release_pipeline(pipe)

    # ---- iteration ---------------------------------------------------------------------------
    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError("SpatialRayLoader is closed")
        t = self._stats.start()
        B = self.rays_per_batch
        if self._run is None or self.offset + B > self.rays_per_run:
            nxt = self.run_start + self._run[1] if self._run is not None else self.run_start
            if nxt != self._next_run_start:  # after load_state_dict: restart the pipeline there
                self._drop_pipeline()
                self._next_run_start = nxt
            if self._ahead is not None and self._run is not None:
                self._ahead.retire((self._run, self._steps))
                demote_if_starved(self, f"SpatialRayLoader cell {self.cell}")
            start, consumed, run, steps = self._fetch_run()
            if self._run is not None:
                self.offset = 0
            self._run = (start, consumed, run)
            self._steps = steps
            self.run_start = start
            self._stats.runs += 1
            self._consumed_total += consumed
            self._accepted_total += self.rays_per_run
        k, r = divmod(self.offset, B)
        if r == 0:  # the usual case: a precomputed step view (a fresh dict, so callers may mutate it)
            batch = dict(zip(RAY_OUTPUTS[:-1], self._steps[k]))
            if k == self._phase and self._ahead is not None:
                self._ahead.release()
        else:  # resumed off the step grid (load_state_dict with an offset that is not a multiple of B)
            batch = {n: v[self.offset:self.offset + B] for n, v in self._run[2].items()}
        self.offset += B
        self._stats.stop(t, B)
        return batch

    def state_dict(self) -> dict:
        start, off = self.run_start, self.offset
        if self._run is not None and off >= self.rays_per_run:
            start, off = start + self._run[1], 0
        return {"run_start": int(start), "offset": int(off), "cell": self.cell, "seed": self.seed,
                "mode": self.mode, "rays_per_batch": self.rays_per_batch, "rays_per_run": self.rays_per_run,
                **scene_state(self.scene)}

    def load_state_dict(self, state: dict) -> None:
        """Continue the cell's stream exactly. ``rays_per_run`` may differ from the saved loader's
        (an SS rank's cells share its threads, so the run size follows the cells per rank: a run
        resumed on another world size): the accepted stream does not depend on it; when the saved
        offset lies past this loader's first run, the stream position after it is found by one
        run of ``offset`` rays from the saved run's start."""
        check_scene_state(state, self.scene, "SpatialRayLoader")
        for k in ("cell", "seed", "mode", "rays_per_batch"):
            if k in state and state[k] != getattr(self, k):
                raise ConfigError(f"load_state_dict: saved {k}={state[k]!r} but this loader has {getattr(self, k)!r}")
        saved_run = state.get("rays_per_run", self.rays_per_run)
        check_int("load_state_dict: run_start", state.get("run_start"), 0, INT64_MAX - max(self.rays_per_run, saved_run))
        check_int("load_state_dict: offset", state.get("offset"), 0, max(self.rays_per_run, saved_run))
        self._drop_pipeline()
        self._run = None
        self.run_start, self.offset = int(state["run_start"]), int(state["offset"])
        if self.offset + self.rays_per_batch > self.rays_per_run and self.offset > 0:
            self.run_start, self.offset = self._advance(self.run_start, self.offset), 0
        self._next_run_start = self.run_start

    def _advance(self, start: int, rays: int) -> int:
        """The stream position after ``rays`` accepted rays from position ``start`` (one run)."""
        pipe = ray_pipeline(self.cache, dataclasses.replace(self._graph(start), rays=int(rays), prefetch=0))
        try:
            consumed, _ = run_graph(pipe, self.device, (), copy=False)
        finally:
            release_pipeline(pipe)
        return int(start) + consumed

    def stats(self) -> dict:
        d = self._stats.as_dict()
        d["acceptance"] = self._accepted_total / self._consumed_total if self._consumed_total else None
        return d

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._drop_pipeline()
