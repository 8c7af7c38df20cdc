"""What every batch source shares: the batch contract's keys, the stall and warm-up accounting
(:class:`BatchStats`), the base class (iteration, ``stats()``, context manager, close on garbage
collection), the plan's settings under the sources' names (:class:`PlanView`), the split's
fingerprint in every state (:func:`scene_state`) and the epoch arithmetic of the global streams.
The machinery of a source that samples ahead — run-ahead thread, starvation guard, runs handed out
step by step, state and close — is :mod:`dali_nerf.sources.runner`, written once for every batch kind.

Batch contract (ARCHITECTURE.md): ``next(source)`` -> dict of torch tensors ``origins`` (B, 3)
f32, ``directions`` (B, 3) f32 unit, ``rgb`` (B, 3) f32, ``indices`` (B, 3) i64, ``near``/``far``
(B, 1) f32 when the scene has bounds; ``stats()``, ``state_dict()`` / ``load_state_dict()``,
``close()`` (idempotent), context manager.
"""

from __future__ import annotations

import operator
import time
from typing import Optional

from dali_nerf.errors import ConfigError
from dali_nerf.scenes import describe_change, scene_fingerprint

__all__ = ["BatchSource", "BatchStats", "BATCH_KEYS", "scene_state", "check_scene_state", "global_epoch_steps",
           "PlanView", "CLOSE_TIMEOUT_S"]

CLOSE_TIMEOUT_S = 5.0
"""How long ``close()`` waits for a background thread (a run or a decode in flight) before it
leaves the thread to finish on its own: shutting down, Ctrl-C included, never waits unbounded."""

BATCH_KEYS = ("origins", "directions", "rgb", "indices", "near", "far")
"""Keys a batch may carry (near/far only when the scene has bounds)."""


class BatchStats:
    """Time blocked in ``__next__`` vs wall time since the first ``__next__`` (shared by every source).

    ``as_dict()`` -> {"steps", "wait_s", "stall_fraction", "warmup_s", "stall_fraction_steady",
    "rays_per_s", "elapsed_s", "runs"}:

    * ``stall_fraction`` = wait_s / elapsed_s, everything since the first ``next()`` was entered;
    * ``warmup_s`` = the wait for the first batch (building the pipeline, loading the operator,
      the first run): the first ``next()``'s duration;
    * ``stall_fraction_steady`` = (wait_s - warmup_s) / (elapsed_s - warmup_s): the stall after
      the first batch arrived (None before the first batch).
    """

    def __init__(self):
        self.steps = 0
        self.wait_s = 0.0
        self.rays = 0
        self.runs = 0
        self.t0: Optional[float] = None
        self.warmup_s: Optional[float] = None

    def start(self) -> float:
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        return now

    def stop(self, t_enter: float, rays: int) -> None:
        waited = time.perf_counter() - t_enter
        self.wait_s += waited
        if self.steps == 0:
            self.warmup_s = waited
        self.steps += 1
        self.rays += rays

    def as_dict(self) -> dict:
        elapsed = 0.0 if self.t0 is None else time.perf_counter() - self.t0
        steady = None
        if self.warmup_s is not None:
            rest = elapsed - self.warmup_s
            steady = (self.wait_s - self.warmup_s) / rest if rest > 0 else 0.0
        return {
            "steps": self.steps,
            "wait_s": self.wait_s,
            "stall_fraction": (self.wait_s / elapsed) if elapsed > 0 else 0.0,
            "warmup_s": self.warmup_s,
            "stall_fraction_steady": steady,
            "rays_per_s": (self.rays / elapsed) if elapsed > 0 else 0.0,
            "elapsed_s": elapsed,
            "runs": self.runs,
        }


def global_epoch_steps(epoch: int, pixels: int, global_batch: int) -> tuple:
    """``(first, count)``: the global steps of ``epoch`` of a global stream of ``pixels`` (P) a
    permutation and ``global_batch`` (G) positions a step: steps [ceil(eP/G), ceil((e+1)P/G)).
    A step that straddles an epoch boundary belongs to the earlier epoch, so ``set_epoch(e)`` then
    ``count`` steps, over e = 0, 1, ..., visit every position exactly once."""
    first = -(-epoch * pixels // global_batch)
    return first, -(-(epoch + 1) * pixels // global_batch) - first


def scene_state(scene) -> dict:
    """``{"scene": fingerprint}``: the part of every source's ``state_dict()`` that names the split
    it samples (:func:`dali_nerf.scenes.scene_fingerprint`, the whole split whatever the rank)."""
    return {"scene": scene_fingerprint(scene)}


def check_scene_state(state: dict, scene, who: str) -> None:
    """Refuse (ConfigError, one line naming what changed) a state saved from another scene than
    ``scene``: other images, sizes, cameras or downscale. A state without a fingerprint (saved
    before sources recorded one) is accepted: there is nothing to compare."""
    saved = state.get("scene") if isinstance(state, dict) else None
    change = describe_change(saved, scene_fingerprint(scene))
    if change is not None:
        raise ConfigError(f"{who}.load_state_dict: the state was saved from another scene than {scene.root} "
                          f"(split {scene.split!r}): {change}; load it into a {who} over the scene it was saved from")


class PlanView:
    """A source's settings under the names they always had, read from its plan (``self.plan``, a
    :class:`~dali_nerf.data.plan.SamplingPlan`: the one record of them; a source copies none):
    rays_per_batch, rays_per_run, steps_per_run, positions_per_run, global_batch, rank,
    world_size, seed, mode, prefetch, device, num_threads (the plan's ``threads``), decode_batch."""


for _name, _field in {"rays_per_batch": "rays_per_batch", "rays_per_run": "rays_per_run",
                      "steps_per_run": "steps_per_run", "positions_per_run": "positions_per_run",
                      "global_batch": "global_batch", "rank": "rank", "world_size": "world_size", "seed": "seed",
                      "mode": "mode", "prefetch": "prefetch", "device": "device", "num_threads": "threads",
                      "decode_batch": "decode_batch"}.items():
    setattr(PlanView, _name, property(operator.attrgetter(f"plan.{_field}"), doc=f"The plan's ``{_field}``."))


class BatchSource:
    """What every batch source shares (RayLoader, the baselines, the SS sources): iteration,
    ``stats()`` from a :class:`BatchStats` in ``self._stats``, the context manager, and ``close()``
    on garbage collection. Subclasses implement ``__next__`` and ``close()`` (idempotent)."""

    def __iter__(self):
        return self

    def stats(self) -> dict:
        """{"steps", "wait_s", "stall_fraction", "warmup_s", "stall_fraction_steady", "rays_per_s",
        "elapsed_s", "runs"} since the first next() (see :class:`BatchStats`)."""
        return self._stats.as_dict()

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
