"""Exact ray routing: which spatial-segmentation cells a ray segment belongs to (the reference the
C++ op implements), Mega-NeRF's brute force, and the scene's ray segments.

A **ray** (origin ``o``, direction ``d``, segment ``[near, far]``) is in cell ``j`` iff some ``t``
in ``[near, far]`` puts ``p(t) = o + t d`` in cell ``j`` (the point rule of
:mod:`dali_nerf.partition.cells`).

Exact routing (what :func:`ray_cells` computes, and what the C++ op implements): for cell ``j`` and
each ``k != j`` let ``u = P(o - c_j)``, ``v = P(o - c_k)``, ``w = P d`` (``P`` removes the ``up``
component when ``dims == 2``, identity otherwise). The condition
``|u + t w|^2 <= m^2 |v + t w|^2`` is ``a t^2 + b t + c <= 0`` with::

    a = (1 - m^2) |w|^2            (<= 0 since m >= 1)
    b = 2 (u.w - m^2 v.w)
    c = |u|^2 - m^2 |v|^2

so the *forbidden* set ``{t : a t^2 + b t + c > 0}`` is always one open interval: ``(r1, r2)``
between the roots when ``a < 0`` and the discriminant is > 0 (empty otherwise); a half-line when
``a == 0`` (``m == 1`` or ``w == 0``) and ``b != 0``; everything or nothing when ``a == b == 0``
(a ray along ``up`` in 2-D: ``p - c`` is constant in the plane). Roots use the cancellation-free
form ``q = -(b + sign(b) sqrt(D)) / 2``, ``{q / a, c / q}``. The ray is in cell ``j`` iff the
``C - 1`` open forbidden intervals do not cover ``[near, far]``: sort them by left end, let
``M_i = max(near, max_{l < i} hi_l)``; some ``i`` with ``lo_i >= M_i`` and ``M_i <= far`` (or
``M_C <= far``) exhibits a feasible ``t = M_i``. The nearest cell of ``p(near)`` and ``p(far)``
is always included (exact, and robust to rounding at ties), so every ray belongs to >= 1 cell.

Mega-NeRF (``scripts/create_cluster_masks.py``) instead samples 1000 points per ray and tests
``min_t dist_j / (min_k dist_k + 1e-8) <= margin``; :func:`ray_cells_dense` is that brute force.

>>> ray_cells(part, origins, directions, near, far).shape   # (B, C) bool
(4096, 4)
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

from dali_nerf.errors import SceneError
from dali_nerf.data.rays import rays_from_indices
from dali_nerf.partition.cells import Partition

__all__ = ["ray_cells", "ray_cells_dense", "clip_to_bounds", "scene_ray_bounds", "scene_rays",
           "cell_fraction"]


def _as2d(a, name) -> np.ndarray:
    a = np.asarray(a, np.float64)
    if a.ndim != 2 or a.shape[1] != 3:
        raise ValueError(f"{name} must have shape (B, 3), got {a.shape}")
    return a


def _as1d(a, n, name) -> np.ndarray:
    a = np.asarray(a, np.float64).reshape(-1)
    if a.size == 1 and n != 1:
        a = np.full(n, float(a[0]))
    if a.shape != (n,):
        raise ValueError(f"{name} must have shape (B,) or (B, 1), got {a.shape}")
    return a


def _nearest(proj_pts: np.ndarray, proj_c: np.ndarray) -> np.ndarray:
    """(B, 3) projected points, (C, 3) projected centroids -> (B,) index of the nearest."""
    d2 = np.sum((proj_pts[:, None, :] - proj_c[None]) ** 2, -1)
    return np.argmin(d2, 1)


def _ray_cells_chunk(o, d, near, far, cp, m2, P):
    """Exact membership for one chunk. o, d (B, 3) f64; near, far (B,); cp (C, 3) f64 centroids."""
    B, C = o.shape[0], cp.shape[0]
    w = d @ P  # (B, 3) (P symmetric)
    r = (o[:, None, :] - cp[None]) @ P  # (B, C, 3): P(o - c)
    rr = np.sum(r * r, -1)  # (B, C)
    rw = np.einsum("bci,bi->bc", r, w)  # (B, C)
    ww = np.sum(w * w, -1)  # (B,)
    # pairwise (j, k): a, b, c of  |u + t w|^2 - m^2 |v + t w|^2 <= 0, u = r[:, j], v = r[:, k]
    a = np.broadcast_to(((1.0 - m2) * ww)[:, None, None], (B, C, C))
    b = 2.0 * (rw[:, :, None] - m2 * rw[:, None, :])
    c = rr[:, :, None] - m2 * rr[:, None, :]
    lo = np.full((B, C, C), np.inf)
    hi = np.full((B, C, C), -np.inf)
    quad = a < 0
    disc = b * b - 4.0 * a * c
    qm = quad & (disc > 0)
    if qm.any():
        bq, dq, aq, cq = b[qm], disc[qm], a[qm], c[qm]
        q = -0.5 * (bq + np.where(bq >= 0, 1.0, -1.0) * np.sqrt(dq))
        with np.errstate(divide="ignore", invalid="ignore"):
            r1, r2 = q / aq, cq / q
        lo[qm] = np.minimum(r1, r2)
        hi[qm] = np.maximum(r1, r2)
    lin = ~quad & (b != 0)
    if lin.any():
        t0 = -c[lin] / b[lin]
        pos = b[lin] > 0  # b t + c > 0  <=>  t > t0
        lo[lin] = np.where(pos, t0, -np.inf)
        hi[lin] = np.where(pos, np.inf, t0)
    const = ~quad & (b == 0) & (c > 0)
    lo[const], hi[const] = -np.inf, np.inf
    idx = np.arange(C)
    lo[:, idx, idx], hi[:, idx, idx] = np.inf, -np.inf  # k == j imposes nothing
    # do the open intervals (lo, hi) over k cover [near, far]?
    order = np.argsort(lo, axis=-1)
    lo_s = np.take_along_axis(lo, order, -1)
    hi_s = np.take_along_axis(hi, order, -1)
    nb = near[:, None, None]
    reach = np.maximum.accumulate(np.concatenate([np.broadcast_to(nb, (B, C, 1)), hi_s], -1), -1)
    start = np.maximum(reach, nb)  # (B, C, C+1): M_i, the first point not yet known covered
    end = np.concatenate([lo_s, np.broadcast_to(np.inf, (B, C, 1))], -1)  # next forbidden start
    end = np.minimum(end, far[:, None, None])
    with np.errstate(invalid="ignore"):
        width = np.where((end >= start) & np.isfinite(start), end - start, -1.0)  # [start, end] feasible
    best = np.argmax(width, -1)[..., None]  # widest gap (robust witness)
    bw = np.take_along_axis(width, best, -1)[..., 0]
    inside = bw >= 0
    bs = np.take_along_axis(start, best, -1)[..., 0]
    half = np.where(np.isfinite(bw), 0.5 * np.maximum(bw, 0), 1.0 + np.abs(bs))  # far = inf: any t >= start
    t = np.where(inside, bs + half, np.nan)
    # exact anchors: the nearest cell of each (finite) end point satisfies its own condition
    for tt in (far, near):
        ok = np.isfinite(tt)
        if not ok.any():
            continue
        rows = np.nonzero(ok)[0]
        j = _nearest(((o[rows] + tt[rows, None] * d[rows]) @ P), cp @ P)
        t[rows, j] = np.where(inside[rows, j], t[rows, j], tt[rows])
        inside[rows, j] = True
    return inside, t


def clip_to_bounds(bounds, o, d, near, far):
    """Clip segments [near, far] of rays o + t d (B, 3) to the box ``bounds`` (2, 3) (slab
    test); rays that miss the box keep their segment. Returns (near, far) (B,) float64."""
    o = np.asarray(o, np.float64); d = np.asarray(d, np.float64)
    lo_b, hi_b = np.asarray(bounds, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t0, t1 = (lo_b - o) / d, (hi_b - o) / d
    tmin, tmax = np.minimum(t0, t1), np.maximum(t0, t1)
    par = d == 0  # parallel to a slab: inside it or missing the box
    outside = par & ((o < lo_b) | (o > hi_b))
    tmin = np.where(par, -np.inf, tmin); tmax = np.where(par, np.inf, tmax)
    a = np.maximum(np.asarray(near, np.float64), tmin.max(1))
    b = np.minimum(np.asarray(far, np.float64), tmax.min(1))
    hit = (a <= b) & ~outside.any(1)
    return np.where(hit, a, near), np.where(hit, b, far)


def ray_cells(partition: Partition, origins, directions, near, far, chunk: int = 0,
              return_t: bool = False):
    """Exact cell membership of rays (closed form, see the module docstring).

    Args:
        partition: the cells (C of them).
        origins: (B, 3) world; directions: (B, 3) (any length; t is in its units).
        near, far: (B,) or (B, 1) segment bounds, near <= far.
        chunk: rays per vectorised chunk (0 = about 2^19 / C^2).
        return_t: also return a witness.
    Returns:
        (B, C) bool: ray b is in cell j; with ``return_t``, also (B, C) float64 witness: a t in
        [near, far] where the point condition holds (the middle of the widest feasible stretch),
        NaN where the ray is not in the cell.

    Example:
        >>> ray_cells(part, o, d, np.full(len(o), 0.1), np.full(len(o), 6.0)).sum(1).min() >= 1
        True
    """
    o = _as2d(origins, "origins")
    d = _as2d(directions, "directions")
    n = o.shape[0]
    nr, fr = _as1d(near, n, "near"), _as1d(far, n, "far")
    if partition.bounds is not None:
        nr, fr = clip_to_bounds(partition.bounds, o, d, nr, fr)
    cp = partition.centroids.astype(np.float64)
    C = cp.shape[0]
    P = partition.projector()
    m2 = partition.margin ** 2
    chunk = chunk or max(256, (1 << 19) // max(1, C * C))
    out = np.empty((n, C), bool)
    wit = np.empty((n, C)) if return_t else None
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        ins, t = _ray_cells_chunk(o[s:e], d[s:e], nr[s:e], fr[s:e], cp, m2, P)
        out[s:e] = ins
        if return_t:
            wit[s:e] = t
    return (out, wit) if return_t else out


def ray_cells_dense(partition: Partition, origins, directions, near, far, samples: int = 1000,
                    chunk: int = 0, return_ratio: bool = False):
    """Brute-force membership by point sampling (Mega-NeRF's ``create_cluster_masks.py`` way).

    ``samples`` points evenly spaced on ``[near, far]`` (both ends included); ray b is in cell j
    iff some sample has ``dist_j <= margin * min_k dist_k``.

    Args:
        partition: the cells; origins, directions (B, 3); near, far (B,) or (B, 1).
        samples: points per ray.
        return_ratio: also return (B, C) float64 ``min_t dist_j / min_k dist_k``.
    Returns:
        (B, C) bool (and the ratio when asked).
    """
    o = torch.as_tensor(_as2d(origins, "origins"))
    d = torch.as_tensor(_as2d(directions, "directions"))
    n = o.shape[0]
    nr, fr = _as1d(near, n, "near"), _as1d(far, n, "far")
    if partition.bounds is not None:
        nr, fr = clip_to_bounds(partition.bounds, np.asarray(origins), np.asarray(directions), nr, fr)
    nr = torch.as_tensor(nr)
    fr = torch.as_tensor(fr)
    P = torch.as_tensor(partition.projector())
    cp = torch.as_tensor(partition.centroids.astype(np.float64)) @ P
    C = cp.shape[0]
    s = torch.linspace(0.0, 1.0, samples, dtype=torch.float64)
    chunk = chunk or max(1, (1 << 21) // samples)
    ratio = torch.empty((n, C), dtype=torch.float64)
    po, pd = o @ P, d @ P  # P (o + t d) = P o + t P d
    for a in range(0, n, chunk):
        e = min(n, a + chunk)
        t = nr[a:e, None] * (1 - s) + fr[a:e, None] * s  # (b, S)
        p = po[a:e, None, :] + t[..., None] * pd[a:e, None, :]  # (b, S, 3) projected samples
        dist = torch.cdist(p.reshape(-1, 3), cp, compute_mode="donot_use_mm_for_euclid_dist")
        dist = dist.reshape(e - a, samples, C)
        dmin = dist.min(-1, keepdim=True).values
        rat = dist / dmin
        if bool((dmin == 0).any()):  # a sample on a centroid: ratio 1 there, inf elsewhere
            rat = torch.where(dmin > 0, rat, torch.where(dist > 0, torch.inf, 1.0).to(dist.dtype))
        ratio[a:e] = rat.min(1).values
    ratio = ratio.numpy()
    inside = ratio <= partition.margin
    return (inside, ratio) if return_ratio else inside


def scene_ray_bounds(scene, cams, origins, directions) -> Tuple[np.ndarray, np.ndarray]:
    """near, far (B,) for rays of cameras ``cams`` (B,): the scene's per-image bounds, else the
    ray's segment inside ``scene.aabb`` (rays that miss it get near = far = 0).

    Raises:
        SceneError: the scene has neither bounds nor an aabb.
    """
    cams = np.asarray(cams, np.int64)
    if scene.has_bounds:
        return scene.near[cams].astype(np.float64), scene.far[cams].astype(np.float64)
    if scene.aabb is None:
        raise SceneError(f"{scene.root}: the scene has no near/far bounds and no aabb; spatial "
                         f"partitions need ray bounds (add them to the scene or use method ddp)")
    o = np.asarray(origins, np.float64)
    d = np.asarray(directions, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = 1.0 / d
        t1 = (scene.aabb[0].astype(np.float64) - o) * inv
        t2 = (scene.aabb[1].astype(np.float64) - o) * inv
    t1, t2 = np.nan_to_num(t1, nan=-np.inf), np.nan_to_num(t2, nan=np.inf)
    tn = np.max(np.minimum(t1, t2), 1).clip(min=0.0)
    tf = np.min(np.maximum(t1, t2), 1)
    miss = ~(tf > tn)
    tn[miss], tf[miss] = 0.0, 0.0
    return tn, tf


def scene_rays(scene, cams, rows, cols):
    """Rays of pixels, by the project's one ray formula (:func:`dali_nerf.data.rays.rays_from_indices`).

    Args:
        scene: Scene; cams, rows, cols: (B,) integer camera index, pixel row, pixel column.
    Returns:
        origins, directions: (B, 3) float64 (computed in float32, as the op and the trainers do).
    """
    idx = torch.as_tensor(np.stack([cams, rows, cols], -1).astype(np.int64))
    o, d = rays_from_indices(torch.as_tensor(np.array(scene.c2w)), torch.as_tensor(np.array(scene.intrinsics)), idx)
    return o.numpy().astype(np.float64), d.numpy().astype(np.float64)


def cell_fraction(partition: Partition, scene, samples: int = 100_000, seed: int = 0) -> np.ndarray:
    """Fraction of the scene's rays in each cell, from ``samples`` uniformly drawn pixels.

    Rays in a margin band count for every cell they touch, so the fractions sum to >= 1 (the
    excess is the SS method's duplicated work).

    Returns:
        (C,) float64.
    Example:
        >>> cell_fraction(part, scene, 20000)
        array([0.29, 0.27, 0.28, 0.3 ])
    """
    rng = np.random.default_rng(seed)
    sizes = (scene.width * scene.height).astype(np.int64)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    pix = rng.integers(0, int(offs[-1]), size=int(samples))
    cams = np.searchsorted(offs, pix, side="right") - 1
    local = pix - offs[cams]
    rows, cols = local // scene.width[cams], local % scene.width[cams]
    o, d = scene_rays(scene, cams, rows, cols)
    near, far = scene_ray_bounds(scene, cams, o, d)
    return ray_cells(partition, o, d, near, far).mean(0)

