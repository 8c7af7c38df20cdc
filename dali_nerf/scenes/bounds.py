"""Scene bounds from the cameras: the box around every camera's full frustum between its near and
far bound, and the rule for scenes that have neither near/far nor a box.

:func:`scene_bounds` picks, in order:

1. the scene's own ``aabb`` (Blender, our generated scenes, nerfstudio files that carry one);
2. with per-image near/far: :func:`frustum_aabb`, the box around every camera's frustum between
   near and a robust far (:func:`robust_far`);
3. with neither (the usual COLMAP-made transforms.json): :func:`camera_aabb`, nerfstudio's rule,
   from the camera positions and viewing directions.

It never falls back to the Blender box [-1.5, 1.5]^3.

**Frustum box.** A pixel's ray is ``o + t u`` with ``u`` a unit direction through the pixel and
``t`` in ``[near, far]`` (the project's convention: distances along unit directions). Every pixel's
``u`` lies in the convex cone of unit directions through the image rectangle (corners at the pixel
*edges*), so every segment lies in ``{o + t u : u in the cone, t in [near, far]}`` (a truncated
cone with a spherical far cap). :func:`frustum_aabb` is the exact box of that set over all cameras
(per world axis, the farthest point of the cone: see its docstring): it holds every pixel's
segment and is the tightest box that does. Depth-convention bounds (LLFF's ``z`` depths) are
inside it too, since ``z <= t``.

**Robust far.** Per-image far bounds come from the farthest thing each image saw; one image that
sees the sky or down a corridor would set the box for all. Each far is capped at
``FAR_MEDIAN_FACTOR`` (3) times the median far of the scene; ``far_factor=None`` keeps them as they
are (the exact frustum box).

**Camera rule** (nerfstudio's ``nerfstudio-data`` scene box: cameras centred, scaled so the
farthest is at 1 in the max norm, box [-1, 1]^3). The centre is the point nearest to every optical
axis in the least-squares sense (:func:`focus_point`) when the cameras look at a common region
(that point is in front of at least 3/4 of them), else the mean camera position; the box is the
cube around the centre with half side the largest max-norm distance of a camera from it, so it
holds every camera and, for inward-looking captures, what they look at. For outward-looking
captures (cameras in the middle of an unbounded scene) it holds only the cameras: there the box
is the inner region of a scene contraction (:func:`dali_nerf.models.space.contract`), not a
bound of the content.

>>> box = scene_bounds(load_scene("data/fern", split="train", format="llff"))   # (2, 3) float64
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

__all__ = ["scene_bounds", "frustum_aabb", "robust_far", "camera_aabb", "focus_point",
           "FAR_MEDIAN_FACTOR"]

FAR_MEDIAN_FACTOR = 3.0
_FOCUS_IN_FRONT = 0.75  # fraction of cameras that must have the focus point in front of them


def _corner_directions(intrinsics, width, height) -> np.ndarray:
    """(N, 4, 3) unit directions, camera axes, through the image corners (pixel edges) in order
    around the rectangle: (0, 0), (W, 0), (W, H), (0, H)."""
    k = np.asarray(intrinsics, np.float64)
    n = k.shape[0]
    w = np.broadcast_to(np.asarray(width, np.float64), (n,))
    h = np.broadcast_to(np.asarray(height, np.float64), (n,))
    u = np.stack([np.zeros(n), w, w, np.zeros(n)], 1)
    v = np.stack([np.zeros(n), np.zeros(n), h, h], 1)
    d = np.stack([(u - k[:, 2:3]) / k[:, 0:1], -(v - k[:, 3:4]) / k[:, 1:2], -np.ones((n, 4))], -1)
    return d / np.linalg.norm(d, axis=-1, keepdims=True)


def _cone_max(a, c) -> np.ndarray:
    """max of a . u over unit vectors u in the convex cone spanned by the corner directions.

    Args:
        a: (N, M, 3) query directions (unit); c: (N, 4, 3) unit corner directions in order.
    Returns:
        (N, M): 1 where ``a`` is inside the cone, else the largest value over the cone's 4 faces
        (on a face spanned by c1, c2: |p| at the projection p of ``a`` on the face's plane when p
        falls between c1 and c2, else the better of a . c1, a . c2).
    """
    axis = c.sum(1)  # (N, 3): inside the cone
    best = np.full(a.shape[:2], -np.inf)
    inside = np.ones(a.shape[:2], bool)
    for j in range(4):
        c1, c2 = c[:, j], c[:, (j + 1) % 4]
        nrm = np.cross(c1, c2)
        nrm = nrm * np.sign(np.einsum("ni,ni->n", nrm, axis))[:, None]  # pointing into the cone
        nrm = nrm / np.linalg.norm(nrm, axis=1, keepdims=True)
        an = np.einsum("nmi,ni->nm", a, nrm)
        inside &= an >= 0
        p = a - an[..., None] * nrm[:, None]  # (N, M, 3) projection on the face's plane
        g12 = np.einsum("ni,ni->n", c1, c2)[:, None]
        p1, p2 = np.einsum("nmi,ni->nm", p, c1), np.einsum("nmi,ni->nm", p, c2)
        den = 1.0 - g12 * g12  # Gram determinant of the unit c1, c2
        alpha, beta = (p1 - g12 * p2) / den, (p2 - g12 * p1) / den  # p = alpha c1 + beta c2
        on_face = (alpha >= 0) & (beta >= 0)
        ends = np.maximum(np.einsum("nmi,ni->nm", a, c1), np.einsum("nmi,ni->nm", a, c2))
        best = np.maximum(best, np.where(on_face, np.linalg.norm(p, axis=-1), ends))
    return np.where(inside, 1.0, best)


def frustum_aabb(c2w, intrinsics, width, height, near, far) -> np.ndarray:
    """(2, 3) float64 min/max box of every camera's frustum: the points ``o + t u`` with ``u`` a
    unit direction through the image (corners at the pixel edges) and ``t`` in [near, far]; it
    contains every pixel's segment and is the tightest box that does.

    Along a world axis ``e`` the largest ``e . (t u)`` is ``g(max_u e . u)`` with ``g(x) = far x``
    for ``x > 0`` and ``near x`` otherwise; the max of ``e . u`` over the image's cone of unit
    directions is 1 when ``e`` looks into it, else it is reached on one of its four faces.

    Args:
        c2w: (N, 3, 4) OpenGL camera-to-world; intrinsics: (N, 4) fx, fy, cx, cy;
        width, height: (N,) or scalars, pixels; near, far: (N,) or scalars, distances along unit
        ray directions.
    Example:
        >>> frustum_aabb(scene.c2w, scene.intrinsics, scene.width, scene.height, scene.near, scene.far).shape
        (2, 3)
    """
    c2w = np.asarray(c2w, np.float64)
    n = c2w.shape[0]
    near = np.broadcast_to(np.asarray(near, np.float64), (n,))[:, None]
    far = np.broadcast_to(np.asarray(far, np.float64), (n,))[:, None]
    c = _corner_directions(np.asarray(intrinsics, np.float64).reshape(n, 4), width, height)
    axes = np.concatenate([np.eye(3), -np.eye(3)])  # +x, +y, +z, -x, -y, -z (world)
    a = np.einsum("nij,mi->nmj", c2w[:, :, :3], axes)  # (N, 6, 3) the world axes in camera axes
    m = _cone_max(a, c)
    reach = np.where(m > 0, far * m, near * m)  # (N, 6) farthest extent along each world axis
    pos = c2w[:, :, 3]
    return np.stack([(pos - reach[:, 3:]).min(0), (pos + reach[:, :3]).max(0)])


def robust_far(far, factor: Optional[float] = FAR_MEDIAN_FACTOR) -> np.ndarray:
    """Per-image far bounds (N,) capped at ``factor`` x their median (``factor`` None: unchanged).

    Example:
        >>> robust_far(np.array([4.0, 5.0, 6.0, 100.0]))
        array([ 4.,  5.,  6., 16.5])
    """
    far = np.asarray(far, np.float64)
    if factor is None:
        return far.copy()
    return np.minimum(far, float(factor) * float(np.median(far)))


def focus_point(c2w) -> Tuple[np.ndarray, bool]:
    """The point nearest to every optical axis (least squares) and whether the cameras look at it.

    Minimises ``sum_i |(I - f_i f_i^T)(x - p_i)|^2`` over x (``p_i`` camera centres, ``f_i`` unit
    viewing directions), as nerfstudio's ``focus`` centring and instant-ngp's "centre of attention".
    Args:
        c2w: (N, 3, 4) OpenGL camera-to-world.
    Returns:
        (3,) float64 point, and True when it is in front of at least 3/4 of the cameras and the
        axes are not all parallel (then it is the centre of what they look at).
    """
    c2w = np.asarray(c2w, np.float64)
    p = c2w[:, :, 3]
    f = -c2w[:, :, 2] / np.linalg.norm(c2w[:, :, 2], axis=1, keepdims=True)
    m = np.eye(3)[None] - f[:, :, None] * f[:, None, :]  # (N, 3, 3) projectors off each axis
    a, b = m.sum(0), np.einsum("nij,nj->i", m, p)
    eig = np.linalg.eigvalsh(a)
    if eig[0] <= 1e-6 * max(eig[-1], 1e-12):  # parallel axes: no focus
        return p.mean(0), False
    x = np.linalg.solve(a, b)
    in_front = np.einsum("ni,ni->n", f, x[None] - p) > 0
    return x, bool(in_front.mean() >= _FOCUS_IN_FRONT)


def camera_aabb(c2w) -> np.ndarray:
    """(2, 3) float64 box from the cameras alone (the camera rule of the module docstring): a cube
    around the focus point of inward-looking cameras (else their mean position) holding them all.

    Example:
        >>> camera_aabb(scene.c2w)   # cameras on a sphere of radius 4 looking at the origin
        array([[-4., -4., -4.], [ 4.,  4.,  4.]])
    """
    c2w = np.asarray(c2w, np.float64)
    p = c2w[:, :, 3]
    focus, inward = focus_point(c2w)
    centre = focus if inward else p.mean(0)
    half = float(np.abs(p - centre).max())
    half = half if half > 0 else 1.0  # a single camera position: a unit cube around it
    return np.stack([centre - half, centre + half])


def scene_bounds(scene, far_factor: Optional[float] = FAR_MEDIAN_FACTOR) -> np.ndarray:
    """(2, 3) float64 box the radiance field should cover (rule in the module docstring): the
    scene's aabb, else the frustum box between near and the robust far, else the camera rule.

    Args:
        scene: a :class:`~dali_nerf.scenes.Scene` (c2w (N, 3, 4), intrinsics (N, 4), width,
            height, near, far (N,) when known, aabb (2, 3) or None).
        far_factor: cap of each far bound in medians (None: the exact frustum box).
    Example:
        >>> scene_bounds(load_scene("data/default", split="train"))   # has an aabb: that box
        array([[-1.5, -1.5, -1.5], [ 1.5,  1.5,  1.5]])
    """
    if scene.aabb is not None:
        return np.array(scene.aabb, np.float64)
    if scene.has_bounds:
        return frustum_aabb(scene.c2w, scene.intrinsics, scene.width, scene.height, scene.near,
                            robust_far(scene.far, far_factor))
    return camera_aabb(scene.c2w)
