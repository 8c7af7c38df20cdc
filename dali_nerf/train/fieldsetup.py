"""A scene's field setup: the box and the space the field lives in, and the backgrounds training
composites over and evaluation renders against (ARCHITECTURE.md, "Backgrounds the trainer supplies").
"""

from __future__ import annotations

import numpy as np
import torch

from dali_nerf.config import Config
from dali_nerf.models.keyed import keyed_uniform
from dali_nerf.models.ray_space import RaySpace, build_space
from dali_nerf.scenes.bounds import scene_bounds

__all__ = ["scene_aabb", "scene_space", "learned_background_init", "train_background", "eval_background"]


def scene_aabb(scene) -> torch.Tensor:
    """(2, 3) float32 world box of the scene (:func:`dali_nerf.scenes.bounds.scene_bounds`): the
    scene's ``aabb`` when it has one, else the box around every camera's full frustum between near
    and a robust far, else the camera rule. The field's own box depends on ``model.space``
    (:func:`scene_space`)."""
    return torch.tensor(np.asarray(scene_bounds(scene), np.float32))


def scene_space(cfg: Config, scene) -> RaySpace:
    """The field's space for the training split ``scene`` (``model.space``; auto: world for scenes
    with an aabb, ndc for LLFF, contract otherwise; :mod:`dali_nerf.models.ray_space`). Its
    ``aabb`` is the box of the field and the occupancy grid."""
    return build_space(cfg.model.space, scene, np.asarray(scene_aabb(scene), np.float64), cfg.model.contract_inner)


def learned_background_init(scene):
    """(3,) initial learned colour when ``scene.background_mode`` is "learned", else None (pass
    to ``build_field``)."""
    return np.array(scene.background, np.float32) if scene.background_mode == "learned" else None


def train_background(scene, raw_field, color: torch.Tensor, generator, rays: int, device, keys=None) -> torch.Tensor:
    """The background a training batch is composited over (ARCHITECTURE.md, "Backgrounds the
    trainer supplies"): "color": ``color`` (3,); "random": a fresh uniform colour per ray (B, 3)
    drawn from the step's ``generator``, or keyed by each ray's global position when ``keys``
    (B,) (:func:`~dali_nerf.models.keyed.ray_keys`) are given; "learned": the field's learned
    colour (3,), with grad."""
    mode = scene.background_mode
    if mode == "random" and keys is not None:
        return keyed_uniform(keys, 3)
    if mode == "random":
        return torch.rand((rays, 3), generator=generator, device=device)
    if mode == "learned":
        return raw_field.background()
    return color


def eval_background(field, scene, device) -> torch.Tensor:
    """(3,) background of evaluation renders: the learned colour when the field learned one (and
    the scene asks for it), else ``scene.background`` (random's evaluation colour too)."""
    if scene.background_mode == "learned" and getattr(field, "background_logit", None) is not None:
        return field.background().detach().to(device)
    return torch.as_tensor(np.array(scene.background), device=device)
