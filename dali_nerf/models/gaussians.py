"""A small 3D Gaussian splat model: parameters, initialisation from sparse points, rendering
through :func:`~dali_nerf.models.raster.rasterization`, gsplat's loss and learning rates, and a
minimal densification (what it does: :class:`Densifier`).

Parameters (gsplat's ``simple_trainer.py`` names and activations)::

    means (N, 3) world   scales (N, 3) log   quats (N, 4) w x y z   opacities (N,) logit
    sh0 (N, 1, 3)        shN (N, K - 1, 3)   K = (sh_degree + 1)^2 (degree 0 or 1 here)

>>> model = GaussianModel.from_points(scene.points, scene.points_rgb, sh_degree=1)
>>> colors, alphas, info = model.render(viewmats, Ks, width, height)    # (C, H, W, 3), (C, H, W, 1)
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from dali_nerf.models.raster import SH_C0, rasterization

__all__ = ["GaussianModel", "Densifier", "knn_distance", "splat_optimizer", "splat_loss", "render_camera", "PARAMS"]

PARAMS = ("means", "scales", "quats", "opacities", "sh0", "shN")

#: gsplat's learning rates (simple_trainer.py defaults); means' is scaled by the scene's size
LRS = {"means": 1.6e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh0": 2.5e-3, "shN": 2.5e-3 / 20}


def _f32(x) -> np.ndarray:
    """A float32 numpy copy of an array or tensor (a Scene's arrays are read-only)."""
    return x.detach().cpu().numpy().astype(np.float32) if torch.is_tensor(x) else np.array(x, np.float32)


def knn_distance(points: torch.Tensor, k: int = 3, chunk: int = 4096) -> torch.Tensor:
    """(N,) root mean squared distance of each point to its ``k`` nearest others (gsplat's
    initial scale), by chunks of ``chunk`` rows of the distance matrix."""
    n = len(points)
    if n <= 1:
        return torch.ones(n, dtype=points.dtype)
    out = torch.empty(n, dtype=points.dtype)
    kk = min(k, n - 1)
    for s in range(0, n, chunk):
        d2 = torch.cdist(points[s:s + chunk], points).pow(2)
        out[s:s + chunk] = d2.topk(kk + 1, largest=False).values[:, 1:].mean(-1).sqrt()
    return out


class GaussianModel(torch.nn.Module):
    """N Gaussians (module doc); ``grad2d`` / ``seen`` buffers hold the densifier's statistics, so
    a checkpoint (``state_dict``) carries them and a model of any size loads it (the parameters
    are resized to the saved ones first)."""

    def __init__(self, n: int = 0, sh_degree: int = 1):
        super().__init__()
        if sh_degree not in (0, 1):
            raise ValueError(f"sh_degree={sh_degree}: use 0 or 1")
        self.sh_degree = sh_degree
        k = (sh_degree + 1) ** 2
        shapes = {"means": (n, 3), "scales": (n, 3), "quats": (n, 4), "opacities": (n,), "sh0": (n, 1, 3),
                  "shN": (n, k - 1, 3)}
        for name, shape in shapes.items():
            setattr(self, name, torch.nn.Parameter(torch.zeros(shape)))
        self.register_buffer("grad2d", torch.zeros(n))
        self.register_buffer("seen", torch.zeros(n))

    @classmethod
    def from_points(cls, points, rgb, sh_degree: int = 1, init_opacity: float = 0.1, init_scale: float = 1.0):
        """Gaussians at ``points`` (M, 3) with colours ``rgb`` (M, 3) uint8: scale the RMS distance
        to the 3 nearest points (log), identity rotations, opacity ``init_opacity``, SH degree 0
        term from the colour (gsplat's ``rgb_to_sh``), higher terms 0."""
        pts = torch.from_numpy(_f32(points)).reshape(-1, 3)
        if len(pts) == 0:
            raise ValueError("GaussianModel.from_points: no points (the scene has no sparse points)")
        model = cls(len(pts), sh_degree)
        with torch.no_grad():
            model.means.copy_(pts)
            model.scales.copy_(torch.log(knn_distance(pts).clamp_min(1e-7) * init_scale)[:, None].expand(-1, 3))
            model.quats.zero_()[:, 0] = 1.0
            model.opacities.fill_(math.log(init_opacity / (1.0 - init_opacity)))
            col = torch.from_numpy(_f32(rgb)).reshape(-1, 3) / 255.0
            model.sh0.copy_(((col - 0.5) / SH_C0)[:, None, :])
        return model

    @property
    def num_gaussians(self) -> int:
        return int(self.means.shape[0])

    def colors(self) -> torch.Tensor:
        """(N, K, 3) SH coefficients."""
        return torch.cat([self.sh0, self.shN], 1)

    def render(self, viewmats, Ks, width: int, height: int, backgrounds=None, backend: str = "auto",
               near_plane: float = 0.01, far_plane: float = 1e10):
        """(C, H, W, 3) colours, (C, H, W, 1) alphas and the rasteriser's info of C cameras."""
        return rasterization(self.means, self.quats, torch.exp(self.scales), torch.sigmoid(self.opacities),
                             self.colors(), viewmats, Ks, width, height, near_plane=near_plane, far_plane=far_plane,
                             sh_degree=self.sh_degree, backgrounds=backgrounds, backend=backend)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Resize every parameter and buffer to the saved ones, then load. The same Parameter
        objects stay (an optimizer built on them keeps them), so load into a model that has not run a
        backward pass yet (a resumed run's new model): autograd fixes a parameter's shape then."""
        with torch.no_grad():
            for name, t in list(self.named_parameters()) + list(self.named_buffers()):
                if name in state_dict and tuple(state_dict[name].shape) != tuple(t.shape):
                    t.data = torch.zeros(state_dict[name].shape, dtype=t.dtype, device=t.device)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


@torch.no_grad()
def render_camera(model: GaussianModel, c2w, intrinsics, width: int, height: int, background, backend: str = "auto"):
    """(H, W, 3) render of one camera in our convention: ``c2w`` (3, 4) OpenGL camera-to-world,
    ``intrinsics`` (4,) fx, fy, cx, cy (pixel centres at +0.5), ``background`` (3,)."""
    dev = model.means.device
    cv = torch.eye(4, dtype=torch.float32, device=dev)
    cv[:3, :4] = torch.as_tensor(np.array(c2w, np.float32), device=dev)
    cv[:3, 1:3] *= -1.0  # OpenGL -> OpenCV camera axes
    fx, fy, cx, cy = (float(v) for v in intrinsics)
    k = torch.tensor([[fx, 0.0, cx], [0.0, fy, cy], [0.0, 0.0, 1.0]], dtype=torch.float32, device=dev)
    bg = torch.as_tensor(background, dtype=torch.float32, device=dev).reshape(1, 3)
    out, _, _ = model.render(torch.linalg.inv(cv)[None], k[None], int(width), int(height), backgrounds=bg,
                             backend=backend)
    return out[0]


def splat_optimizer(model: GaussianModel, scene_scale: float, total_steps: int, images_per_step: int = 1):
    """(Adam, LambdaLR): gsplat's learning rates (:data:`LRS`; means' times ``scene_scale``), each
    scaled by sqrt(images per step) with gsplat's betas and eps for that batch; the means' decays
    exponentially to 1% over ``total_steps`` (gsplat's ``ExponentialLR``)."""
    bs = max(1, int(images_per_step))
    groups = [{"params": [getattr(model, n)], "name": n, "lr": LRS[n] * math.sqrt(bs) * (scene_scale if n == "means" else 1.0)}
              for n in PARAMS]
    opt = torch.optim.Adam(groups, eps=1e-15 / math.sqrt(bs), betas=(1 - bs * 0.1, 1 - bs * 0.001))
    total = max(1, int(total_steps))
    decay = [lambda s: 0.01 ** (min(s, total) / total)] + [lambda s: 1.0] * (len(PARAMS) - 1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, decay)


def _ssim_map(a: torch.Tensor, b: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Differentiable SSIM of (B, 3, H, W) images, 'valid' region (models/metrics.py's definition)."""
    x = torch.arange(window, dtype=a.dtype, device=a.device) - (window - 1) / 2
    g = torch.exp(-(x ** 2) / (2 * sigma ** 2))
    g = g / g.sum()
    c = a.shape[1]
    stack = torch.cat([a, b, a * a, b * b, a * b], 1)
    stack = F.conv2d(stack, g.reshape(1, 1, -1, 1).expand(5 * c, 1, -1, 1).contiguous(), groups=5 * c)
    stack = F.conv2d(stack, g.reshape(1, 1, 1, -1).expand(5 * c, 1, 1, -1).contiguous(), groups=5 * c)
    ma, mb, aa, bb, ab = stack.split(c, 1)
    va, vb, cov = aa - ma * ma, bb - mb * mb, ab - ma * mb
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    return ((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma * ma + mb * mb + c1) * (va + vb + c2))


def splat_loss(pred: torch.Tensor, target: torch.Tensor, ssim_lambda: float = 0.2, mask=None) -> torch.Tensor:
    """gsplat's loss: ``(1 - l) * L1 + l * (1 - SSIM)`` of (B, H, W, 3) images in [0, 1] (SSIM only
    where the images are at least 11 pixels on a side); ``mask`` (B, H, W) bool keeps pixels: L1
    over the kept pixels (0 when none is kept, where gsplat's mean would be NaN), SSIM of both
    images with the masked pixels zeroed (gsplat's ``simple_trainer``)."""
    if mask is not None:
        kept = (pred - target).abs()[mask]
        l1 = kept.sum() / max(kept.numel(), 1)
        pred, target = pred * mask[..., None], target * mask[..., None]
    else:
        l1 = (pred - target).abs().mean()
    if ssim_lambda <= 0 or min(pred.shape[1:3]) < 11:
        return l1
    s = _ssim_map(pred.permute(0, 3, 1, 2), target.permute(0, 3, 1, 2)).mean()
    return torch.lerp(l1, 1.0 - s, ssim_lambda)


class Densifier:
    """A minimal version of gsplat's ``DefaultStrategy`` (what it does, all of it):

    * after each backward pass until ``stop``, :meth:`observe` (:meth:`increments`, :meth:`add`)
      adds, per Gaussian visible in the step's images, the norm of its 2-D mean's gradient in
      normalised image units (x width / 2, y height / 2, times the images of the step) to
      ``model.grad2d`` and 1 to ``model.seen``;
    * every ``every`` steps from ``start`` to ``stop`` (:meth:`refine`): Gaussians whose mean
      gradient is above ``grad_threshold`` are cloned when their largest scale is at most
      ``small_scale`` x scene scale, else split in two (new means drawn from the Gaussian with a
      generator seeded by the step, scales / 1.6); then those with opacity below ``min_opacity``
      are removed; the statistics restart; the Adam state of new rows is zero;
    * every ``reset_every`` steps opacities are capped at 2 x ``min_opacity``.

    Under data parallelism each step's increments are summed over the ranks (the trainer sends them
    with the gradients' all-reduce), so the statistics, hence the decisions, are the same on every
    replica; ``refine(allreduce=...)`` sums statistics that were gathered per rank instead."""

    def __init__(self, scene_scale: float, start: int = 100, stop: int = 1500, every: int = 100,
                 reset_every: int = 3000, grad_threshold: float = 2e-4, small_scale: float = 0.01,
                 min_opacity: float = 0.005, max_gaussians: int = 200_000):
        self.scene_scale, self.start, self.stop, self.every = float(scene_scale), int(start), int(stop), int(every)
        self.reset_every, self.grad_threshold = int(reset_every), float(grad_threshold)
        self.small_scale, self.min_opacity, self.max_gaussians = float(small_scale), float(min_opacity), int(max_gaussians)

    @torch.no_grad()
    def increments(self, info: dict) -> Optional[torch.Tensor]:
        """(2, N) float32 of this step's images: per Gaussian the summed norm of its 2-D mean's
        gradient (normalised units) where visible, and the number of images it was visible in;
        None without a gradient."""
        g = info["means2d"].grad
        if g is None:
            return None
        c = g.shape[0]
        scale = torch.tensor([info["width"] / 2.0 * c, info["height"] / 2.0 * c], dtype=g.dtype, device=g.device)
        vis = (info["radii"] > 0).all(-1)
        return torch.stack([((g * scale).norm(dim=-1) * vis).sum(0), vis.sum(0).to(g.dtype)]).float()

    @torch.no_grad()
    def add(self, model: GaussianModel, inc: Optional[torch.Tensor]) -> None:
        """Add :meth:`increments` (summed over the ranks under data parallelism) to the statistics."""
        if inc is not None:
            model.grad2d += inc[0].to(model.grad2d.dtype)
            model.seen += inc[1].to(model.seen.dtype)

    def observe(self, model: GaussianModel, info: dict) -> None:
        """:meth:`add` of this process's :meth:`increments` (one process)."""
        self.add(model, self.increments(info))

    def active(self, step: int) -> bool:
        """Whether step ``step``'s statistics can still matter (a refinement is to come)."""
        return step < self.stop

    def due(self, step: int) -> bool:
        return self.start <= step < self.stop and step % self.every == 0

    @torch.no_grad()
    def refine(self, model: GaussianModel, optimizer, step: int, seed: int = 0, allreduce=None) -> dict:
        """Clone / split / prune at ``step`` (class doc); returns the counts."""
        if allreduce is not None:
            allreduce(model.grad2d)
            allreduce(model.seen)
        avg = model.grad2d / model.seen.clamp_min(1)
        high = avg > self.grad_threshold
        room = max(0, self.max_gaussians - model.num_gaussians)
        small = torch.exp(model.scales).max(-1).values <= self.small_scale * self.scene_scale
        clone = torch.nonzero(high & small)[:, 0][:room]
        split = torch.nonzero(high & ~small)[:, 0][:max(0, room - len(clone))]
        gen = torch.Generator(device=model.means.device).manual_seed(int(seed) * 1000003 + int(step))
        new = {n: getattr(model, n).data[clone] for n in PARAMS}
        if len(split):
            from dali_nerf.models.raster import quat_to_rotmat

            s = torch.exp(model.scales.data[split])
            rot = quat_to_rotmat(model.quats.data[split])
            noise = torch.randn((2, len(split), 3), generator=gen, device=s.device)
            offs = (rot @ (noise * s)[..., None])[..., 0]                   # (2, S, 3)
            for n in PARAMS:
                src = getattr(model, n).data[split]
                if n == "means":
                    halves = [src + offs[0], src + offs[1]]
                elif n == "scales":
                    halves = [torch.log(s / 1.6)] * 2
                else:
                    halves = [src, src]
                new[n] = torch.cat([new[n]] + halves)
        keep = torch.ones(model.num_gaussians, dtype=torch.bool, device=model.means.device)
        keep[split] = False  # a split Gaussian is replaced by its two halves
        _resize(model, optimizer, keep, new)
        low = torch.sigmoid(model.opacities.data) < self.min_opacity
        _resize(model, optimizer, ~low, {})
        model.grad2d.zero_()
        model.seen.zero_()
        return {"cloned": int(len(clone)), "split": int(len(split)), "pruned": int(low.sum()), "n": model.num_gaussians}

    @torch.no_grad()
    def maybe_reset(self, model: GaussianModel, optimizer, step: int) -> bool:
        if not self.reset_every or step % self.reset_every or step == 0:
            return False
        cap = math.log(2 * self.min_opacity / (1 - 2 * self.min_opacity))
        model.opacities.data.clamp_(max=cap)
        st = optimizer.state.get(model.opacities, {}) if optimizer is not None else {}
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                st[k].zero_()
        return True


def _resize(model: GaussianModel, optimizer, keep: torch.Tensor, new: dict) -> None:
    """Keep the rows ``keep`` of every parameter and append ``new[name]`` rows, as new Parameter
    objects (autograd keeps each parameter's shape from its first backward pass) that replace the
    old ones in ``optimizer``'s groups, Adam's moments following (new rows 0); the densifier
    buffers restart at 0 for new rows."""
    n_new = len(next(iter(new.values()))) if new else 0
    for n in PARAMS:
        old = getattr(model, n)
        add = new.get(n, old.data[:0])
        p = torch.nn.Parameter(torch.cat([old.data[keep], add]))
        if optimizer is not None:
            for group in optimizer.param_groups:
                group["params"] = [p if q is old else q for q in group["params"]]
            st = optimizer.state.pop(old, None)
            if st is not None:
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in st:
                        st[k] = torch.cat([st[k][keep], torch.zeros_like(add)])
                optimizer.state[p] = st
        setattr(model, n, p)
    for b in ("grad2d", "seen"):
        t = getattr(model, b)
        setattr(model, b, torch.cat([t[keep], torch.zeros(n_new, dtype=t.dtype, device=t.device)]))
