"""Occupancy grid for empty-space skipping (instant-NGP style, deterministic).

A (R, R, R) grid over the field's aabb keeps a decayed running max of the field's density per
cell and a boolean ``bits`` grid: a cell is occupied while ``1 - exp(-density * step_size)``
exceeds ``threshold``; the bits are dilated by one cell so the culling is conservative. Until the
first update every cell is occupied.

Determinism: ``update(field, step)`` uses a generator seeded from ``step`` alone, so two DDP
ranks holding identical fields compute identical grids, and a resumed run (buffers restored from
the checkpoint) equals an uninterrupted one. Both grids are registered buffers, so they go into
``state_dict()``.

Example:
    >>> occ = OccupancyGrid(torch.tensor([[-1.5] * 3, [1.5] * 3]), 64, step_size=0.03)
    >>> for step in range(1, 1001):
    ...     ...  # optimiser step
    ...     occ.update(field, step)          # updates when step >= warmup and step % every == 0
    >>> occ.occupied(torch.zeros(4, 3))      # (4,) bool
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dali_nerf.config import ModelConfig

__all__ = ["OccupancyGrid", "build_occupancy"]


class OccupancyGrid(nn.Module):
    """Bitfield of occupied cells over an aabb.

    Args:
        aabb: (2, 3) min/max corner.
        resolution: cells per axis R.
        step_size: ray-marching step (world units) the alpha threshold refers to.
        threshold: alpha over one step below which a cell is empty.
        every: update period in steps; warmup: first step that updates.
        decay: running-max decay per update.
        chunk: points per density query during updates.
    Buffers: ``aabb`` (2, 3), ``density`` (R, R, R) float32, ``bits`` (R, R, R) bool.
    """

    def __init__(self, aabb: torch.Tensor, resolution: int, *, step_size: float, threshold: float = 0.005,
                 every: int = 16, warmup: int = 64, decay: float = 0.95, chunk: int = 1 << 17):
        super().__init__()
        aabb = torch.as_tensor(aabb, dtype=torch.float32).reshape(2, 3)
        r = int(resolution)
        self.resolution = r
        self.step_size = float(step_size)
        self.threshold = float(threshold)
        self.every = int(every)
        self.warmup = int(warmup)
        self.decay = float(decay)
        self.chunk = int(chunk)
        self.register_buffer("aabb", aabb.clone())
        self.register_buffer("density", torch.full((r, r, r), float("inf")))
        self.register_buffer("bits", torch.ones((r, r, r), dtype=torch.bool))
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))

    @property
    def ready(self) -> bool:
        """True once the grid has been updated (before that, every cell is occupied)."""
        return bool(self.updates > 0)

    def cell_index(self, x: torch.Tensor):
        """x (..., 3) world -> (flat cell index (...,) int64, inside (...,) bool)."""
        lo, hi = self.aabb[0], self.aabb[1]
        u = (x - lo) * (self.resolution / (hi - lo))
        inside = ((u >= 0) & (u < self.resolution)).all(dim=-1)
        i = u.clamp(0, self.resolution - 1).to(torch.int64)
        r = self.resolution
        return (i[..., 0] * r + i[..., 1]) * r + i[..., 2], inside

    def occupied(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., 3) world -> (...,) bool: inside the aabb and in an occupied cell."""
        idx, inside = self.cell_index(x)
        return self.bits.reshape(-1)[idx] & inside

    @property
    def occupied_fraction(self) -> float:
        return float(self.bits.float().mean())

    @torch.no_grad()
    def update(self, field, step: int, force: bool = False) -> bool:
        """Re-evaluate ``field.density`` at one jittered point per cell (when ``step >= warmup`` and
        ``step % every == 0``, or ``force``). Returns whether it updated.

        Args:
            field: any object with ``density(x (P,3)) -> (P,)`` (the unwrapped module, not DDP).
            step: the optimisation step just taken (1-based); seeds the jitter.
        """
        if not force and (step < self.warmup or step % self.every != 0):
            return False
        r = self.resolution
        dev = self.bits.device
        gen = torch.Generator(device="cpu")
        gen.manual_seed(1_000_003 * int(step) + 12345)
        jitter = torch.rand(r ** 3, 3, generator=gen).to(dev)
        g = torch.arange(r, device=dev)
        cells = torch.stack(torch.meshgrid(g, g, g, indexing="ij"), dim=-1).reshape(-1, 3).to(torch.float32)
        lo, hi = self.aabb[0], self.aabb[1]
        pts = lo + (cells + jitter) * ((hi - lo) / r)
        sigma = torch.cat([field.density(pts[i:i + self.chunk]).float() for i in range(0, pts.shape[0], self.chunk)])
        sigma = sigma.reshape(r, r, r)
        old = self.density
        new = torch.where(torch.isinf(old), sigma, torch.maximum(old * self.decay, sigma))
        self.density.copy_(new)
        # alpha > threshold  <=>  density > -log(1 - threshold) / step_size; like instant-NGP and
        # nerfacc the cut is never above the grid's mean density, so an untrained (or uniformly
        # faint) field is never culled to nothing, which would stop all gradients for good
        cut = min(-math.log1p(-self.threshold) / self.step_size, float(new.mean()))
        occ = new > cut
        occ = F.max_pool3d(occ[None, None].float(), kernel_size=3, stride=1, padding=1)[0, 0] > 0
        self.bits.copy_(occ)
        self.updates += 1
        return True


def build_occupancy(cfg: ModelConfig, aabb: torch.Tensor) -> Optional[OccupancyGrid]:
    """The occupancy grid for ``cfg`` over ``aabb`` (2, 3), or None when
    ``cfg.occupancy_resolution == 0``. Its step size is the aabb diagonal / samples_per_ray."""
    if cfg.occupancy_resolution == 0:
        return None
    aabb = torch.as_tensor(aabb, dtype=torch.float32).reshape(2, 3)
    diag = float(torch.linalg.norm(aabb[1] - aabb[0]))
    return OccupancyGrid(aabb, cfg.occupancy_resolution, step_size=diag / cfg.samples_per_ray,
                         threshold=cfg.occupancy_threshold, every=cfg.occupancy_every,
                         warmup=cfg.occupancy_warmup)
