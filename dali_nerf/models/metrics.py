"""Image metrics: PSNR and SSIM (11x11 Gaussian window, sigma 1.5, K1 = 0.01, K2 = 0.03), pure torch.

Images are (H, W, 3) or (H, W) float tensors (or arrays) in [0, 1].

Example:
    >>> psnr(torch.zeros(4, 4, 3), torch.full((4, 4, 3), 0.1))
    20.0
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["psnr", "ssim", "mse", "SSIM_WINDOW"]

SSIM_WINDOW = 11
"""Side of the SSIM window: evaluated images must be at least this large."""


def _t(x) -> torch.Tensor:
    return torch.as_tensor(x).to(torch.float64)


def mse(pred, target) -> float:
    """Mean squared error of two same-shape images."""
    p, t = _t(pred), _t(target)
    if p.shape != t.shape:
        raise ValueError(f"mse: shapes differ, {tuple(p.shape)} vs {tuple(t.shape)}")
    return float(torch.mean((p - t) ** 2))


def psnr(pred, target) -> float:
    """Peak signal-to-noise ratio in dB for images in [0, 1]: -10 log10(MSE); inf when equal."""
    m = mse(pred, target)
    return float("inf") if m == 0.0 else -10.0 * math.log10(m)


def _gauss(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x ** 2) / (2 * sigma ** 2))
    return g / g.sum()


def ssim(pred, target, window: int = SSIM_WINDOW, sigma: float = 1.5) -> float:
    """Mean SSIM (Wang et al. 2004) with a separable Gaussian window, 'valid' region, per channel.

    Args:
        pred, target: (H, W, C) or (H, W) in [0, 1], H and W >= ``window``.
    Returns:
        float in [-1, 1]; 1.0 for identical images.
    """
    p, t = _t(pred), _t(target)
    if p.shape != t.shape:
        raise ValueError(f"ssim: shapes differ, {tuple(p.shape)} vs {tuple(t.shape)}")
    if p.dim() == 2:
        p, t = p[..., None], t[..., None]
    if min(p.shape[0], p.shape[1]) < window:
        raise ValueError(f"ssim: images must be at least {window}x{window}, got {tuple(p.shape[:2])}")
    c = p.shape[-1]
    x = torch.stack([p, t, p * p, t * t, p * t]).permute(0, 3, 1, 2).reshape(5 * c, 1, p.shape[0], p.shape[1])
    g = _gauss(window, sigma)
    x = F.conv2d(x, g.reshape(1, 1, -1, 1))
    x = F.conv2d(x, g.reshape(1, 1, 1, -1))
    mp, mt, pp, tt, pt = x.reshape(5, c, *x.shape[-2:])
    vp, vt, cov = pp - mp * mp, tt - mt * mt, pt - mp * mt
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * mp * mt + c1) * (2 * cov + c2)) / ((mp * mp + mt * mt + c1) * (vp + vt + c2))
    return float(s.mean())
