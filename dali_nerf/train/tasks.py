"""What the trainers train: a :class:`Task` is one model on one batch stream (DDP: the field replica
of the rank; SS: one field per cell the rank owns; splat: the Gaussians of the rank, on image
batches); a :class:`Method` builds the tasks and says how to evaluate them (subclasses in trainers/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from dali_nerf.config import Config
from dali_nerf.models.ray_space import RaySpace

__all__ = ["Task", "Method", "close_sources"]


@dataclass
class Task:
    """One field trained on one ray stream (DDP: the replica; SS: one cell)."""

    name: str                      # "ddp" or "cell3"
    source: object                 # RayLoader or a baseline: iterator of batch dicts
    field: torch.nn.Module         # the (possibly DDP-wrapped) module whose params are trained
    raw_field: torch.nn.Module     # unwrapped field, for rendering and checkpoints
    occupancy: Optional[torch.nn.Module]
    optimizer: torch.optim.Optimizer
    scheduler: Optional[object] = None
    cell: int = -1
    iterator: object = None
    space: Optional[RaySpace] = None  # the field's space (None: world, the rays as they are)

    def batches(self):
        if self.iterator is None:
            self.iterator = iter(self.source)
        return self.iterator


class Method:
    """What differs between DDP and SS. Subclasses live in trainers/. ``space`` is the
    :class:`RaySpace` its fields live in (set by ``build_tasks``; evaluation uses it)."""

    name = "base"
    space: Optional[RaySpace] = None
    train_step = None
    """None: the loop's ray-marching step (:func:`dali_nerf.train.loop.train_task_step`). A method
    whose step is not a ray march (Gaussian splats) sets ``train_step(cfg, env, task, step, timer)
    -> (loss, items)``, timing its phases in ``timer`` as that function does."""
    render_view = None
    """None: evaluation marches rays (:func:`dali_nerf.models.render_image`); else
    ``render_view(field, sub, i, width, height, background) -> (H, W, 3)`` renders view ``i`` of the
    evaluated subset ``sub`` (:func:`dali_nerf.train.evaluation.evaluate_field`)."""

    def check(self, cfg: Config, scene) -> None:
        """Refuse (one line) a config this method cannot train, before anything is decoded."""

    def build_tasks(self, cfg: Config, scene, env, feed) -> List[Task]:
        """The rank's tasks: a field around each source of ``feed`` (a built
        :class:`~dali_nerf.sources.registry.Feed`: the rank's plan, sources and, SS, partition and cells)."""
        raise NotImplementedError

    def eval_field(self, cfg: Config, tasks: List[Task], env):
        """Rank 0: (field, occupancy) to evaluate; called on every rank (may communicate)."""
        raise NotImplementedError

    def extra_summary(self, cfg, tasks, env, eval_scene, field, occupancy, views=None) -> dict:
        """Method specifics of ``summary.json`` (rank 0); ``views``: the run's
        :class:`~dali_nerf.train.evaluation.EvalViews` (decoded once)."""
        return {}


def close_sources(tasks: List[Task]) -> None:
    for t in tasks:
        if hasattr(t.source, "close"):
            t.source.close()
