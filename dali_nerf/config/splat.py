"""The config sections of the Gaussian-splatting trainer (``method: splat``): ``images`` (the image
loader, :class:`~dali_nerf.sources.images.ImageLoader`) and ``splat`` (the model, its loss,
densification and rasteriser: :mod:`dali_nerf.models.gaussians`)."""

from __future__ import annotations

from dataclasses import dataclass

from dali_nerf.config.checks import MAX_THREADS, choice, in_range, nonneg, positive
from dali_nerf.errors import ConfigError

__all__ = ["ImagesConfig", "SplatConfig"]


@dataclass
class ImagesConfig:
    images_per_batch: int = 1
    """B: images per rank per step (gsplat's batch_size); > 1 needs images of one size or a patch_size.
    A global step holds B x world size images; every image of the split once per epoch across ranks."""
    patch_size: int = 0
    """0: whole images; p > 0: a random p x p patch of each image (gsplat's patch_size), the
    camera's principal point shifted."""
    max_bytes: int = 0
    """Decoded pixels one node may hold, shared by its ranks (0: half the node's physical memory).
    A split larger than this is streamed through two windows of images."""
    prefetch: int = 2
    """Batches built ahead of the training step (>= 1)."""

    def validate(self, key: str):
        in_range(f"{key}.images_per_batch", self.images_per_batch, 1, 1 << 20)
        nonneg(f"{key}.patch_size", self.patch_size)
        nonneg(f"{key}.max_bytes", self.max_bytes)
        in_range(f"{key}.prefetch", self.prefetch, 1, MAX_THREADS)


@dataclass
class SplatConfig:
    sh_degree: int = 1
    """Spherical-harmonic degree of the colours (0 or 1)."""
    init_opacity: float = 0.1
    """Opacity of the initial Gaussians (gsplat's init_opa)."""
    init_scale: float = 1.0
    """Initial scale = this x the RMS distance to the 3 nearest points (gsplat's init_scale)."""
    init_points: int = 5000
    """Scenes without sparse points (not COLMAP): this many Gaussians at random in the scene's box
    (its aabb, else the cameras' bounding box)."""
    ssim_lambda: float = 0.2
    """Loss = (1 - l) L1 + l (1 - SSIM) (gsplat's ssim_lambda)."""
    refine_start: int = 100
    """First step of densification (clone / split / prune every refine_every steps)."""
    refine_stop: int = 1500
    """Densification stops here (gsplat: 15000 of 30000 steps)."""
    refine_every: int = 100
    """Steps between densifications."""
    reset_every: int = 3000
    """Steps between opacity resets (0: never)."""
    grad_threshold: float = 2e-4
    """Mean 2-D gradient (normalised image units) above which a Gaussian is cloned or split."""
    max_gaussians: int = 200000
    """Densification stops adding Gaussians past this count."""
    backend: str = "auto"
    """Rasteriser: auto (gsplat's CUDA rasterization when training on a GPU with gsplat installed,
    else our pure-torch one) | torch | gsplat."""

    def validate(self, key: str):
        choice(f"{key}.sh_degree", self.sh_degree, (0, 1))
        choice(f"{key}.backend", self.backend, ("auto", "torch", "gsplat"))
        if not 0.0 < self.init_opacity < 1.0:
            raise ConfigError(f"{key}.init_opacity: must be in (0, 1), got {self.init_opacity}")
        positive(f"{key}.init_scale", self.init_scale)
        positive(f"{key}.init_points", self.init_points)
        if not 0.0 <= self.ssim_lambda <= 1.0:
            raise ConfigError(f"{key}.ssim_lambda: must be in [0, 1], got {self.ssim_lambda}")
        for k in ("refine_start", "refine_stop", "reset_every"):
            nonneg(f"{key}.{k}", getattr(self, k))
        positive(f"{key}.refine_every", self.refine_every)
        nonneg(f"{key}.grad_threshold", self.grad_threshold)
        positive(f"{key}.max_gaussians", self.max_gaussians)
