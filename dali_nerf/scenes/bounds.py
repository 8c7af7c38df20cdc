"""Scene bounds from the cameras: the box around every camera's full frustum between its near and
far bound, and the rule for scenes that have neither near/far nor a box.

:func:`scene_bounds` picks, in order:

1. the scene's own ``aabb`` (Blender, our generated scenes, nerfstudio files that carry one);
2. with per-image near/far: :func:`frustum_aabb`, the box around every camera's frustum between
   near and a robust far (:func:`robust_far`);
3. with neither (the usual COLMAP-made transforms.json): :func:`camera_aabb`, nerfstudio's rule,
   from the camera positions and viewing directions.

It never falls back to the Blender box [-1.5, 1.5]^3.

**Frustum box.** A pixel's ray direction in camera axes is ``d = ((u - cx) / fx, -(v - cy) / fy,
-1)`` (OpenGL, ``u, v`` pixel coordinates) and ``[near, far]`` is a distance along the unit
direction ``d / |d|`` (the project's convention), so a point of the segment is ``(t / |d|) d`` with
``t`` in ``[near, far]``: on the image pyramid at depth ``z = t / |d|`` in ``[near / |d|, far]``.
``|d|`` is largest at an image corner (``u`` in {0, W}, ``v`` in {0, H}: the pixel *edges*, so every
pixel centre is strictly inside), so every segment of every pixel lies in the convex truncated
pyramid spanned by the four corner directions at depths ``near / max|d_corner|`` and ``far``; the
box of its 8 vertices per camera, over all cameras, contains them all. It is not tight: its far
face is at depth ``far``, where the corner rays have gone ``|d_corner| far`` (about 1.15 far for a
55 degree field of view), so it can be up to that factor too large. Depth-convention bounds
(LLFF's ``z`` depths) are inside it too, since ``z <= t``.

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

__all__ = ["scene_bounds", "frustum_corners", "frustum_aabb", "robust_far", "camera_aabb", "focus_point",
           "FAR_MEDIAN_FACTOR"]

FAR_MEDIAN_FACTOR = 3.0
_FOCUS_IN_FRONT = 0.75  # fraction of cameras that must have the focus point in front of them


def frustum_corners(c2w, intrinsics, width, height, near, far) -> np.ndarray:
    """The 8 vertices of each camera's truncated image pyramid holding its pixels' [near, far]
    segments (see the module docstring).

    Args:
        c2w: (N, 3, 4) OpenGL camera-to-world; intrinsics: (N, 4) fx, fy, cx, cy;
        width, height: (N,) or scalars, pixels; near, far: (N,) or scalars, distances along
        unit ray directions.
    Returns:
        (N, 8, 3) float64: the 4 corners at depth ``near / max|d_corner|``, then the 4 at ``far``.
    Example:
        >>> frustum_corners(scene.c2w, scene.intrinsics, scene.width, scene.height, 2.0, 6.0).shape
        (100, 8, 3)
    """
    c2w = np.asarray(c2w, np.float64)
    n = c2w.shape[0]
    k = np.asarray(intrinsics, np.float64).reshape(n, 4)
    w = np.broadcast_to(np.asarray(width, np.float64), (n,))
    h = np.broadcast_to(np.asarray(height, np.float64), (n,))
    near = np.broadcast_to(np.asarray(near, np.float64), (n,))
    far = np.broadcast_to(np.asarray(far, np.float64), (n,))
    u = np.stack([np.zeros(n), w, np.zeros(n), w], 1)  # (N, 4) pixel-edge corners
    v = np.stack([np.zeros(n), np.zeros(n), h, h], 1)
    d = np.stack([(u - k[:, 2:3]) / k[:, 0:1], -(v - k[:, 3:4]) / k[:, 1:2], -np.ones((n, 4))], -1)  # (N, 4, 3)
    z_near = near / np.linalg.norm(d, axis=-1).max(1)  # (N,)
    cam = np.concatenate([d * z_near[:, None, None], d * far[:, None, None]], 1)  # (N, 8, 3) camera axes
    return cam @ np.transpose(c2w[:, :, :3], (0, 2, 1)) + c2w[:, None, :, 3]


def frustum_aabb(c2w, intrinsics, width, height, near, far) -> np.ndarray:
    """(2, 3) float64 min/max box containing every pixel's segment [near, far] of every camera
    (arguments as :func:`frustum_corners`)."""
    pts = frustum_corners(c2w, intrinsics, width, height, near, far).reshape(-1, 3)
    return np.stack([pts.min(0), pts.max(0)])


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
