"""Rasterising 3D Gaussians: a small pure-torch rasteriser (the CPU path and the test oracle, not a
speed claim) behind gsplat's call, and gsplat's own ``rasterization`` where CUDA and gsplat are.

:func:`rasterization` takes gsplat's arguments (``gsplat.rendering.rasterization``, the subset
our trainer uses) and returns what it returns::

    colors, alphas, info = rasterization(means, quats, scales, opacities, colors, viewmats, Ks, width, height)
    # means (N, 3) world; quats (N, 4) w x y z (normalised inside); scales (N, 3); opacities (N,)
    # colors (N, D) or (C, N, D), or SH coefficients (N, K, 3) with sh_degree
    # viewmats (C, 4, 4) world-to-camera, OpenCV axes; Ks (C, 3, 3), pixel centres at +0.5
    # -> colors (C, H, W, D), alphas (C, H, W, 1), info {"means2d" (C, N, 2), "radii" (C, N, 2), "depths", ...}

The pure-torch path follows gsplat's "classic" mode (``gsplat/cuda/csrc``: projection, EWA
splatting, front-to-back compositing), written from its definitions:

1. camera-space mean ``t = R mu + T``; covariance ``Sigma = R_q S S^T R_q^T`` in camera space
   ``W Sigma W^T``; kept when ``near_plane < t_z < far_plane``;
2. the 2-D covariance ``J W Sigma W^T J^T + eps2d I`` with the perspective Jacobian ``J`` at
   ``t`` (x/z and y/z clamped to 1.3x the field of view, as gsplat does), its inverse (the conic)
   and a 3-sigma extent per axis (``radii``); culled when off screen or ``radii <= radius_clip``;
3. per 16x16 tile, the Gaussians overlapping it sorted by depth; per pixel (centre at +0.5)
   ``alpha = min(0.999, o exp(-0.5 d^T conic d))``, skipped under 1/255; front to back with
   transmittance ``T``, stopping before the Gaussian that would take ``T`` to 1e-4 or below;
   ``color = sum alpha_i T_i c_i + T_final * background``.

SH colours (``sh_degree`` 0 or 1 here; gsplat's up to 4): ``c = 0.5 + sum_l Y_l(d) k_l``,
``d`` the unit direction camera -> mean, clamped at 0, gsplat's basis and signs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["rasterization", "rasterize_torch", "project_gaussians", "quat_to_rotmat", "sh_colors", "SH_C0",
           "SH_C1", "gsplat_available", "TILE"]

SH_C0 = 0.28209479177387814
SH_C1 = 0.4886025119029199
TILE = 8
ALPHA_MIN = 1.0 / 255.0
ALPHA_MAX = 0.999
T_MIN = 1e-4


def gsplat_available(device) -> bool:
    """True when ``device`` is CUDA and ``import gsplat`` works (then :func:`rasterization` uses it)."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import gsplat  # noqa: F401
    except Exception:
        return False
    return True


def quat_to_rotmat(quats: torch.Tensor) -> torch.Tensor:
    """(N, 4) w x y z (any length) -> (N, 3, 3) rotation of the normalised quaternion."""
    w, x, y, z = torch.nn.functional.normalize(quats, dim=-1).unbind(-1)
    return torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1).reshape(-1, 3, 3)


def sh_colors(coeffs: torch.Tensor, dirs: torch.Tensor, degree: int) -> torch.Tensor:
    """(C, N, K, 3) SH coefficients, (C, N, 3) directions -> (C, N, 3) colours
    ``max(0, 0.5 + sum Y_l k_l)`` up to ``degree`` (0 or 1)."""
    if degree not in (0, 1):
        raise ValueError(f"sh_degree={degree}: the torch rasteriser evaluates degrees 0 and 1")
    out = SH_C0 * coeffs[..., 0, :]
    if degree >= 1:
        d = torch.nn.functional.normalize(dirs, dim=-1)
        x, y, z = d[..., 0:1], d[..., 1:2], d[..., 2:3]
        out = out - SH_C1 * y * coeffs[..., 1, :] + SH_C1 * z * coeffs[..., 2, :] - SH_C1 * x * coeffs[..., 3, :]
    return torch.clamp_min(out + 0.5, 0.0)


def project_gaussians(means, quats, scales, viewmats, Ks, width: int, height: int, near_plane: float = 0.01,
                      far_plane: float = 1e10, eps2d: float = 0.3, radius_clip: float = 0.0):
    """Step 1-2 of the module doc for C cameras and N Gaussians.

    Returns:
        means2d (C, N, 2), conics (C, N, 3) (a, b, c of the inverse 2-D covariance), depths (C, N),
        radii (C, N, 2) int32 (0 where culled).
    """
    rot = quat_to_rotmat(quats)                                   # (N, 3, 3)
    m = rot * scales[:, None, :]                                  # R S
    cov = m @ m.transpose(1, 2)                                   # (N, 3, 3)
    r, t = viewmats[:, None, :3, :3], viewmats[:, None, :3, 3]     # (C, 1, 3, 3), (C, 1, 3)
    tc = (r @ means[None, :, :, None])[..., 0] + t                # (C, N, 3)
    covc = r @ cov[None] @ r.transpose(-1, -2)                    # (C, N, 3, 3)
    fx, fy = Ks[:, 0, 0][:, None], Ks[:, 1, 1][:, None]
    cx, cy = Ks[:, 0, 2][:, None], Ks[:, 1, 2][:, None]
    tz = tc[..., 2]
    valid = (tz > near_plane) & (tz < far_plane)
    z = torch.where(valid, tz, torch.ones_like(tz))
    lim_xp, lim_xn = (width - cx) / fx + 0.3 * (0.5 * width / fx), cx / fx + 0.3 * (0.5 * width / fx)
    lim_yp, lim_yn = (height - cy) / fy + 0.3 * (0.5 * height / fy), cy / fy + 0.3 * (0.5 * height / fy)
    tx = z * torch.minimum(lim_xp, torch.maximum(-lim_xn, tc[..., 0] / z))
    ty = z * torch.minimum(lim_yp, torch.maximum(-lim_yn, tc[..., 1] / z))
    zero = torch.zeros_like(z)
    jac = torch.stack([fx / z, zero, -fx * tx / (z * z), zero, fy / z, -fy * ty / (z * z)], -1).reshape(*z.shape, 2, 3)
    cov2 = jac @ covc @ jac.transpose(-1, -2)
    a, b, c = cov2[..., 0, 0] + eps2d, cov2[..., 0, 1], cov2[..., 1, 1] + eps2d
    det = a * c - b * b
    valid = valid & (det > 0)
    det = torch.where(valid, det, torch.ones_like(det))
    conics = torch.stack([c / det, -b / det, a / det], -1)
    means2d = torch.stack([fx * tc[..., 0] / z + cx, fy * tc[..., 1] / z + cy], -1)
    with torch.no_grad():
        rad = torch.stack([torch.ceil(3.0 * torch.sqrt(a.clamp_min(0))), torch.ceil(3.0 * torch.sqrt(c.clamp_min(0)))], -1)
        valid = valid & (rad.max(-1).values > radius_clip)
        mx, my = means2d[..., 0], means2d[..., 1]
        onscreen = (mx + rad[..., 0] > 0) & (mx - rad[..., 0] < width) & (my + rad[..., 1] > 0) & (my - rad[..., 1] < height)
        valid = valid & onscreen
        radii = torch.where(valid[..., None], rad, torch.zeros_like(rad)).to(torch.int32)
    return means2d, conics, torch.where(valid, tz, torch.zeros_like(tz)), radii


def _tile_pairs(means2d, radii, depths, width: int, height: int, tile: int):
    """(tile id, gaussian id) pairs of one camera, sorted by tile then depth; tiles across."""
    tx, ty = math.ceil(width / tile), math.ceil(height / tile)
    ids = torch.nonzero(radii.max(-1).values > 0)[:, 0]
    if len(ids) == 0:
        return ids, ids, tx, ty
    m, r = means2d[ids].detach(), radii[ids].to(means2d.dtype)
    x0 = ((m[:, 0] - r[:, 0]) / tile).floor().clamp(0, tx - 1).long()
    x1 = ((m[:, 0] + r[:, 0]) / tile).floor().clamp(0, tx - 1).long()
    y0 = ((m[:, 1] - r[:, 1]) / tile).floor().clamp(0, ty - 1).long()
    y1 = ((m[:, 1] + r[:, 1]) / tile).floor().clamp(0, ty - 1).long()
    nx, ny = x1 - x0 + 1, y1 - y0 + 1
    count = nx * ny
    g = torch.repeat_interleave(torch.arange(len(ids), device=ids.device), count)
    k = torch.arange(int(count.sum()), device=ids.device) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    tiles = (y0[g] + k // nx[g]) * tx + x0[g] + k % nx[g]
    order = torch.argsort(depths[ids][g].detach(), stable=True)       # depth, then tile (stable)
    order = order[torch.argsort(tiles[order], stable=True)]
    return tiles[order], ids[g[order]], tx, ty


def _composite_camera(means2d, conics, opacities, colors, radii, depths, background, width, height, tile):
    """Step 3 for one camera: (H, W, D) colours and (H, W, 1) alphas.

    The (tile, Gaussian) pairs lie flat, sorted by tile then depth, each with its tile's pixels:
    (M, tile^2) alphas, the transmittance from a running sum of ``log(1 - alpha)`` (float64) minus
    its value at the start of the pair's tile."""
    dev, dt = means2d.device, means2d.dtype
    d = colors.shape[-1]
    tiles, gids, tx, ty = _tile_pairs(means2d, radii, depths, width, height, tile)
    n_tiles, p = tx * ty, tile * tile
    img = torch.zeros(n_tiles, p, d, device=dev, dtype=dt)
    acc = torch.zeros(n_tiles, p, device=dev, dtype=dt)
    if len(gids):
        py, px = torch.meshgrid(torch.arange(tile, device=dev, dtype=dt), torch.arange(tile, device=dev, dtype=dt),
                                indexing="ij")
        pix_x = (tiles % tx).to(dt)[:, None] * tile + px.reshape(1, -1) + 0.5          # (M, P)
        pix_y = (tiles // tx).to(dt)[:, None] * tile + py.reshape(1, -1) + 0.5
        m2 = means2d[gids]
        dx, dy = m2[:, 0:1] - pix_x, m2[:, 1:2] - pix_y
        con = conics[gids]
        sigma = 0.5 * (con[:, 0:1] * dx * dx + con[:, 2:3] * dy * dy) + con[:, 1:2] * dx * dy
        alpha = torch.clamp_max(opacities[gids][:, None] * torch.exp(-sigma), ALPHA_MAX)
        alpha = torch.where((sigma >= 0) & (alpha >= ALPHA_MIN), alpha, torch.zeros_like(alpha))
        log_t = torch.cumsum(torch.log1p(-alpha).double(), 0)                             # (M, P) running
        counts = torch.bincount(tiles, minlength=n_tiles)
        first = (torch.cumsum(counts, 0) - counts)[tiles]                                 # the pair's tile start
        base = torch.cat([torch.zeros_like(log_t[:1]), log_t])[first]                     # sum before the tile
        after = torch.exp(log_t - base).to(dt)                                            # T after each pair
        before = after / (1.0 - alpha)                                                    # T before it
        w = torch.where(after > T_MIN, alpha * before, torch.zeros_like(alpha))         # gsplat stops before T <= 1e-4
        img = img.index_add(0, tiles, w[:, :, None] * colors[gids][:, None, :])
        acc = acc.index_add(0, tiles, w)
    img = img.reshape(ty, tx, tile, tile, d).permute(0, 2, 1, 3, 4).reshape(ty * tile, tx * tile, d)[:height, :width]
    acc = acc.reshape(ty, tx, tile, tile).permute(0, 2, 1, 3).reshape(ty * tile, tx * tile)[:height, :width, None]
    if background is not None:
        img = img + (1.0 - acc) * background
    return img, acc


def rasterize_torch(means, quats, scales, opacities, colors, viewmats, Ks, width: int, height: int,
                    near_plane: float = 0.01, far_plane: float = 1e10, sh_degree: Optional[int] = None,
                    backgrounds: Optional[torch.Tensor] = None, eps2d: float = 0.3, radius_clip: float = 0.0,
                    tile_size: int = TILE):
    """The module doc's pure-torch rasteriser (differentiable); see :func:`rasterization`."""
    c = viewmats.shape[0]
    means2d, conics, depths, radii = project_gaussians(means, quats, scales, viewmats, Ks, width, height,
                                                       near_plane, far_plane, eps2d, radius_clip)
    if sh_degree is not None:
        campos = torch.linalg.inv(viewmats)[:, :3, 3]
        cols = sh_colors(colors[None].expand(c, *colors.shape), means[None] - campos[:, None], sh_degree)
    else:
        cols = colors if colors.dim() == 3 else colors[None].expand(c, *colors.shape)
    outs, alphas = [], []
    for i in range(c):
        bg = None if backgrounds is None else backgrounds[i]
        img, acc = _composite_camera(means2d[i], conics[i], opacities, cols[i], radii[i], depths[i], bg, width,
                                     height, tile_size)
        outs.append(img)
        alphas.append(acc)
    info = {"means2d": means2d, "conics": conics, "depths": depths, "radii": radii, "width": width, "height": height,
            "n_cameras": c, "backend": "torch"}
    return torch.stack(outs), torch.stack(alphas), info


def rasterization(means, quats, scales, opacities, colors, viewmats, Ks, width: int, height: int,
                  near_plane: float = 0.01, far_plane: float = 1e10, sh_degree: Optional[int] = None,
                  backgrounds: Optional[torch.Tensor] = None, eps2d: float = 0.3, radius_clip: float = 0.0,
                  backend: str = "auto", **kw):
    """gsplat's ``rasterization`` call (module doc): gsplat itself when ``backend`` is "gsplat", or
    "auto" with CUDA tensors and gsplat installed; else :func:`rasterize_torch`. ``kw`` goes to
    gsplat only (``packed``, ``absgrad``, ``rasterize_mode``, ...).

    Returns:
        colors (C, H, W, D), alphas (C, H, W, 1), info (``info["backend"]``: "gsplat" | "torch").
    """
    if backend == "gsplat" or (backend == "auto" and gsplat_available(means.device)):
        from gsplat.rendering import rasterization as gs

        out, alpha, info = gs(means=means, quats=quats, scales=scales, opacities=opacities, colors=colors,
                              viewmats=viewmats, Ks=Ks, width=width, height=height, near_plane=near_plane,
                              far_plane=far_plane, sh_degree=sh_degree, backgrounds=backgrounds, eps2d=eps2d,
                              radius_clip=radius_clip, **kw)
        info["backend"] = "gsplat"
        return out, alpha, info
    return rasterize_torch(means, quats, scales, opacities, colors, viewmats, Ks, width, height, near_plane,
                           far_plane, sh_degree, backgrounds, eps2d, radius_clip)
