"""Ray and point parametrisations for real captures: NDC rays for forward-facing scenes (NeRF's
treatment of LLFF) and the mip-NeRF 360 scene contraction for unbounded ones.

The loader's batch stays in world space; these map world rays / points for the field.

**NDC** (NeRF's ``ndc_rays``, closed form; Mildenhall et al. 2020, appendix C). In the reference
camera's frame (OpenGL: camera at the origin looking down -z; for LLFF scenes our parser's world
already is that frame: the recentred average pose) a point ``(x, y, z)``, ``z < 0``, maps to::

    ( -fx / (W / 2) * x / z,   -fy / (H / 2) * y / z,   1 + 2 n / z )

(:func:`world_to_ndc`; ``n`` is the NDC near plane, 1 after LLFF's normalisation). A ray is first
moved to its intersection with the plane ``z = -n``; its NDC image is then the straight ray
``o' + s d'`` and ``s`` in [0, 1) covers the world ray from that plane to infinity (``s = 1 - o_z /
z``), so sampling linearly in ``s`` is sampling linearly in disparity. The principal point is
taken at the image centre (as NeRF does); rays must look forward (``d_z < 0``).

**Contraction** (mip-NeRF 360, eq. 10): ``contract(x) = x`` for ``|x| <= 1``, else ``(2 - 1/|x|)
x / |x|``: the unit ball is kept, everything else is squeezed into the shell 1 < |y| < 2. The norm
is L2 (mip-NeRF 360) or L-inf (``ord=inf``, nerfacto's default: the unit ball is then the cube
[-1, 1]^3 and the image the cube [-2, 2]^3). Points are first normalised with
:func:`normalize_to_box` so the scene's inner box (e.g. :func:`dali_nerf.scenes.bounds.scene_bounds`)
becomes [-1, 1]^3.

>>> o_ndc, d_ndc = ndc_rays(origins, directions, (fx, fy), W, H)   # (B, 3) each
>>> y = contract(normalize_to_box(x, aabb))                         # (P, 3), |y| < 2
"""

from __future__ import annotations

import math
from typing import Tuple, Union

import torch

__all__ = ["ndc_rays", "world_to_ndc", "ndc_to_world", "to_camera_frame", "contract", "uncontract",
           "normalize_to_box", "lin_disp_samples"]

Focal = Union[float, Tuple[float, float]]


def _focal(focal: Focal) -> Tuple[float, float]:
    if isinstance(focal, (tuple, list)):
        return float(focal[0]), float(focal[1])
    return float(focal), float(focal)


def to_camera_frame(origins: torch.Tensor, directions: torch.Tensor, c2w: torch.Tensor):
    """Rays in the frame of the camera ``c2w`` (3, 4) (OpenGL): origins, directions (B, 3) ->
    ``R^T (o - t)``, ``R^T d`` (B, 3)."""
    r, t = c2w[:, :3].to(origins), c2w[:, 3].to(origins)
    return (origins - t) @ r, directions @ r


def world_to_ndc(points: torch.Tensor, focal: Focal, width: float, height: float, near: float = 1.0):
    """NDC image of points in the reference camera's frame.

    Args:
        points: (P, 3) with z < 0 (in front of the camera); focal: f or (fx, fy) in pixels;
        width, height: image size in pixels; near: the NDC near plane n > 0.
    Returns:
        (P, 3): ``(-fx/(W/2) x/z, -fy/(H/2) y/z, 1 + 2 n / z)``; z = -n maps to -1, z -> -inf to 1.
    """
    fx, fy = _focal(focal)
    x, y, z = points.unbind(-1)
    return torch.stack([-fx / (0.5 * width) * x / z, -fy / (0.5 * height) * y / z, 1.0 + 2.0 * near / z], -1)


def ndc_to_world(points_ndc: torch.Tensor, focal: Focal, width: float, height: float, near: float = 1.0):
    """Inverse of :func:`world_to_ndc`: (P, 3) NDC with the last coordinate in [-1, 1) -> (P, 3)
    points in the reference camera's frame (``z = 2 n / (ndc_z - 1)``)."""
    fx, fy = _focal(focal)
    a, b, c = points_ndc.unbind(-1)
    z = 2.0 * near / (c - 1.0)
    return torch.stack([-a * z * (0.5 * width) / fx, -b * z * (0.5 * height) / fy, z], -1)


def ndc_rays(origins: torch.Tensor, directions: torch.Tensor, focal: Focal, width: float, height: float,
             near: float = 1.0):
    """NeRF's ``ndc_rays``: world rays (in the reference camera's frame) -> NDC rays.

    Args:
        origins, directions: (B, 3) rays (any direction length) with ``d_z < 0``; in the reference
            camera's frame (see :func:`to_camera_frame`).
        focal: f or (fx, fy) of the reference camera, pixels; width, height: its image size.
        near: the NDC near plane n (rays start on ``z = -n``).
    Returns:
        origins_ndc (B, 3) (last coordinate -1), directions_ndc (B, 3) (not unit); the NDC point
        ``origins_ndc + s * directions_ndc``, s in [0, 1), is the NDC image of the world point
        at depth ``z = o_z / (1 - s)`` on the ray (o moved onto z = -n).
    Example:
        >>> o2, d2 = ndc_rays(o, d, 400.0, 504, 378)
        >>> o2[:, 2]
        tensor([-1., -1.])
    """
    fx, fy = _focal(focal)
    t = -(near + origins[:, 2]) / directions[:, 2]
    o = origins + t[:, None] * directions
    ox, oy, oz = o.unbind(-1)
    dx, dy, dz = directions.unbind(-1)
    ax, ay = -fx / (0.5 * width), -fy / (0.5 * height)
    o_ndc = torch.stack([ax * ox / oz, ay * oy / oz, 1.0 + 2.0 * near / oz], -1)
    d_ndc = torch.stack([ax * (dx / dz - ox / oz), ay * (dy / dz - oy / oz), -2.0 * near / oz], -1)
    return o_ndc, d_ndc


def normalize_to_box(x: torch.Tensor, aabb: torch.Tensor) -> torch.Tensor:
    """Points (P, 3) -> the affine image where ``aabb`` (2, 3) becomes [-1, 1]^3 (per axis, as
    nerfacto normalises positions before its contraction)."""
    aabb = aabb.to(x)
    return (x - 0.5 * (aabb[0] + aabb[1])) / (0.5 * (aabb[1] - aabb[0]))


def contract(x: torch.Tensor, ord: float = 2) -> torch.Tensor:
    """mip-NeRF 360 scene contraction: (..., 3) -> (..., 3) with ``|y| < 2`` in the chosen norm.

    Identity inside the unit ball (``|x| <= 1``), ``(2 - 1/|x|) x / |x|`` outside; continuous,
    with continuous first derivative along rays through the origin.
    Args:
        x: (..., 3) points (normalised: the inner region is the unit ball / cube).
        ord: 2 (mip-NeRF 360) or ``math.inf`` (nerfacto).
    Example:
        >>> contract(torch.tensor([[0.5, 0.0, 0.0], [4.0, 0.0, 0.0]]))
        tensor([[0.5000, 0.0000, 0.0000], [1.7500, 0.0000, 0.0000]])
    """
    n = torch.linalg.vector_norm(x, ord=ord, dim=-1, keepdim=True)
    safe = n.clamp_min(1.0)  # |x| <= 1 -> the identity branch; avoids 1/0 at the origin
    return torch.where(n <= 1.0, x, (2.0 - 1.0 / safe) * (x / safe))


def uncontract(y: torch.Tensor, ord: float = 2) -> torch.Tensor:
    """Inverse of :func:`contract` on ``|y| < 2``: (..., 3) -> (..., 3)."""
    n = torch.linalg.vector_norm(y, ord=ord, dim=-1, keepdim=True)
    safe = n.clamp(1.0, 2.0 - 1e-12)
    return torch.where(n <= 1.0, y, y / safe / (2.0 - safe))


def lin_disp_samples(near: torch.Tensor, far: torch.Tensor, u: torch.Tensor, split: float = 1.0) -> torch.Tensor:
    """Sample distances spaced for a contracted scene (nerfacto's ``UniformLinDispPiecewiseSampler``):
    half of the samples linear in t on [near, split], half linear in disparity (1/t) on [split, far].

    Args:
        near, far: (B,) with 0 < near, far > near (far may be inf: disparity reaches 0);
        u: (B, S) sorted in [0, 1] (stratified or midpoints); split: the distance where the spacing
        switches (the inner region's radius seen from the camera; clamped into [near, far]).
    Returns:
        (B, S) sorted distances in [near, far].
    """
    near, far = near[:, None], far[:, None]
    mid = torch.minimum(torch.maximum(torch.full_like(near, float(split)), near), far)
    lin = near + (mid - near) * (2.0 * u)
    inv_far = torch.where(torch.isinf(far), torch.zeros_like(far), 1.0 / far)
    disp = 1.0 / mid + (inv_far - 1.0 / mid) * (2.0 * u - 1.0)
    beyond = torch.where(disp > 0, 1.0 / disp.clamp_min(torch.finfo(u.dtype).tiny), torch.full_like(disp, math.inf))
    return torch.where(u < 0.5, lin, torch.minimum(beyond, far))

