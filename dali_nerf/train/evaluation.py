"""Evaluation of a run: held-out views rendered and compared (PSNR, SSIM), the mean-colour floor,
the renders written, and the periodic held-out curve (``train.eval_every`` / ``eval_every_s``).

The evaluated views are decoded once per run (:class:`EvalViews`, :func:`dali_nerf.data.imagecache.eval_cache`).

Masked evaluation splits (``Scene.mask_paths``): PSNR is reported on the full image, as for every
scene (``test_psnr``, comparable with unmasked runs), and on the unmasked pixels alone
(``test_psnr_unmasked``: each view's PSNR over its valid pixels, averaged over the views that
have any), which the summary leads with (``psnr_lead``): a capture's masked pixels (people, cars,
the rig) are what the field was told not to learn.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import cv2
import numpy as np
import torch

from dali_nerf.atomic import atomic_write_bytes
from dali_nerf.config import Config
from dali_nerf.train.fieldsetup import eval_background
from dali_nerf.data.imagecache import eval_cache
from dali_nerf.models import psnr as psnr_fn, render_image, ssim as ssim_fn
from dali_nerf.models.ray_space import RaySpace

__all__ = ["eval_subset", "evaluate_field", "EvalResult", "unmasked_psnr", "mean_color_psnr", "write_renders",
           "EvalViews", "PeriodicEval"]


class EvalResult(tuple):
    """``(pairs, psnr, ssim, seconds)`` of :func:`evaluate_field` (it unpacks as that 4-tuple),
    plus ``psnr_unmasked``: the PSNR over the views' unmasked pixels (None when the split has no
    masks) and ``masks``: the views' (H, W) bool masks (None when unmasked)."""

    psnr_unmasked: Optional[float]
    masks: Optional[list]

    def __new__(cls, pairs, psnr, ssim, seconds, masks=None):
        out = super().__new__(cls, (pairs, psnr, ssim, seconds))
        out.masks = masks
        out.psnr_unmasked = None if masks is None else unmasked_psnr(pairs, masks)
        return out


def unmasked_psnr(pairs, masks) -> Optional[float]:
    """Mean over the views with any unmasked pixel of the PSNR over those pixels (None if none has).
    ``pairs``: (pred, gt) HxWx3; ``masks``: (H, W) bool per view (True = unmasked)."""
    ps = [psnr_fn(pred[torch.from_numpy(m)], gt[torch.from_numpy(m)]) for (pred, gt), m in zip(pairs, masks) if m.any()]
    return float(np.mean(ps)) if ps else None


def eval_subset(scene, max_images: int = 0):
    """The evaluated views: all of ``scene`` (max_images <= 0) or ``max_images`` evenly spaced."""
    n = scene.num_images if max_images <= 0 else min(max_images, scene.num_images)
    return scene.subset(np.linspace(0, scene.num_images - 1, n).round().astype(np.int64)) if n < scene.num_images else scene


@torch.no_grad()
def evaluate_field(field, occupancy, scene, cfg: Config, device, max_images: int = 0, decode=None,
                   space: Optional[RaySpace] = None, render=None):
    """Render held-out views; returns an :class:`EvalResult`: (list of (pred, gt) HxWx3 float
    tensors, psnr, ssim, seconds), with ``psnr_unmasked`` and ``masks`` for a masked split.

    Args:
        field: radiance field (``forward(x, d) -> sigma, rgb``), eval mode.
        scene: the eval split Scene; images are decoded with the same DALI decode stage.
        space: the field's :class:`RaySpace` (the one it was trained in; None: world).
        render: ``render(field, sub, i, width, height, background) -> (H, W, 3)`` of view ``i`` of
            the evaluated subset ``sub``, for a method that does not march rays (the method's
            ``render_view``, e.g. Gaussian splats); None: :func:`~dali_nerf.models.render_image`.
    """
    sub = eval_subset(scene, max_images)
    cache = decode if decode is not None else eval_cache(sub)
    bg = eval_background(field, scene, device)
    pairs, ps, ss = [], [], []
    t0 = time.perf_counter()
    for i in range(sub.num_images):
        off, w, h, _ = (int(v) for v in cache.layout[i])
        gt = torch.from_numpy(np.array(cache.pixels[off:off + w * h])).reshape(h, w, 3).float() / 255.0
        if render is not None:
            pred = render(field, sub, i, w, h, bg).cpu().clamp(0, 1)
        else:
            near = float(sub.near[i]) if sub.near is not None else 0.0
            far = float(sub.far[i]) if sub.far is not None else 1e3
            pred = render_image(field, torch.as_tensor(np.array(sub.c2w[i]), device=device),
                                torch.as_tensor(np.array(sub.intrinsics[i]), device=device), w, h, near, far, bg,
                                occupancy=occupancy, samples=cfg.model.samples_per_ray, space=space).cpu().clamp(0, 1)
        pairs.append((pred, gt))
        ps.append(psnr_fn(pred, gt))
        ss.append(ssim_fn(pred, gt))
    seconds = time.perf_counter() - t0
    masks = [cache.image_mask(i) for i in range(sub.num_images)] if cache.masked else None
    return EvalResult(pairs, float(np.mean(ps)), float(np.mean(ss)), seconds, masks)


def mean_color_psnr(pairs) -> float:
    """The floor every PSNR is read against: mean over the views of the PSNR of the view's own
    mean colour (a constant image, the best a field that learned nothing but a colour can do).
    ``pairs``: (pred, gt) HxWx3 as :func:`evaluate_field` returns them."""
    return float(np.mean([psnr_fn(gt.mean(dim=(0, 1), keepdim=True).expand_as(gt), gt) for _, gt in pairs]))


def write_renders(pairs, out_dir: Path, prefix: str = "test") -> List[str]:
    """Write ``<prefix>_NNN.png``: prediction | ground truth side by side."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for i, (pred, gt) in enumerate(pairs):
        img = torch.cat([pred, gt], dim=1).numpy() if gt is not None else pred.numpy()
        img = (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)[:, :, ::-1]
        ok, buf = cv2.imencode(".png", img)
        name = f"{prefix}_{i:03d}.png"
        atomic_write_bytes(out_dir / name, buf.tobytes())
        names.append(name)
    return names


class EvalViews:
    """The views a run evaluates (``train.eval_images`` of the evaluation split, evenly spaced),
    decoded once, on first use, with the run's decode settings (``cache.decode_batch``, the plan's
    sampler threads), and shared by the periodic evaluation, the final one and the SS method's
    per-cell renders (:func:`dali_nerf.data.imagecache.eval_cache`)."""

    def __init__(self, cfg: Config, eval_scene, threads: int = 2):
        self.scene = eval_scene
        self.max_images = cfg.train.eval_images
        self.threads, self.batch = int(threads), int(cfg.cache.decode_batch)
        self._cache = None

    def cache(self):
        """The decoded views (an ImageCache of the evaluated subset), decoded at the first call."""
        if self._cache is None:
            self._cache = eval_cache(eval_subset(self.scene, self.max_images), threads=self.threads, batch=self.batch)
        return self._cache


class PeriodicEval:
    """``train.eval_every``: held-out PSNR of the current field(s) every N steps, as a metrics row
    ``{"step", "eval_psnr", "eval_ssim", "eval_render_s"}`` (+ ``eval_psnr_unmasked`` for a masked
    split) (rank 0). Every rank calls it (the SS
    method gathers the sub-models); the views come from the run's :class:`EvalViews`. Its time is
    outside every phase."""

    def __init__(self, cfg: Config, method, env, tasks, views: EvalViews):
        self.cfg, self.method, self.env, self.tasks, self.views = cfg, method, env, tasks, views

    def __call__(self, step: int) -> Optional[dict]:
        field, occupancy = self.method.eval_field(self.cfg, self.tasks, self.env)
        row = None
        if self.env.rank == 0:
            was_training = field.training
            field.eval()
            res = evaluate_field(field, occupancy, self.views.scene, self.cfg, self.env.device,
                                 self.views.max_images, decode=self.views.cache(), space=self.method.space,
                                 render=self.method.render_view)
            _, p, s, seconds = res
            field.train(was_training)
            row = {"step": step, "eval_psnr": p, "eval_ssim": s, "eval_render_s": seconds}
            if res.masks is not None:
                row["eval_psnr_unmasked"] = res.psnr_unmasked
        self.env.barrier()  # the other ranks wait here, not inside the next step's timed phases
        return row
