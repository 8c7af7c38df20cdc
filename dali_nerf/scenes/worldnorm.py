"""gsplat's world normalisation for COLMAP scenes (``scene.normalize_world: true``).

gsplat's Parser normalises the world by default (``normalize_world_space``; gsplat
``examples/datasets/normalize.py``, read at 11909fc): from every registered camera of the capture
(all splits, in OpenCV camera axes), a similarity that turns the mean camera "up" onto -y (the
shortest rotation), moves the median of the points nearest the origin on the cameras' optical axes to the origin and
scales the median camera distance to 1; then, from the sparse points in that frame, a rotation
onto their principal axes (largest variance on x, smallest on z, right-handed) about their
median; last, the Parser's own step (``examples/datasets/colmap.py``): a half turn about x when
the points' median height is above their mean (it takes most points to lie low, on a floor). Its
poses and points live in that frame; ours, by default, in COLMAP's own
(docs/SPLATTING.md). With this option every split of the scene, its points, ``up``,
``world_from_source`` and (where set) near/far and ``aabb`` move into gsplat's frame, so a gsplat
checkpoint's Gaussians and our batches share one world.

>>> scene = with_gsplat_world(load_scene("data/garden", "train", format="colmap"))  # doctest: +SKIP
>>> scene.world_from_source        # the similarity applied: x_gsplat = T @ x_colmap
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from dali_nerf.errors import SceneError

__all__ = ["gsplat_world_transform", "with_gsplat_world"]


def _align_up(up: np.ndarray) -> np.ndarray:
    """The rotation taking the unit vector ``up`` onto -y (OpenCV's camera up) by the shortest arc,
    as gsplat's code does (its comment speaks of +z; the principal axes decide the final frame);
    ``up`` = +y exactly: gsplat's fallback, the mirror diag(-1, 1, 1)."""
    target = np.array([0.0, -1.0, 0.0])
    axis, c = np.cross(up, target), float(up @ target)
    if c <= -1.0:
        return np.diag([-1.0, 1.0, 1.0])
    k = np.array([[0.0, -axis[2], axis[1]], [axis[2], 0.0, -axis[0]], [-axis[1], axis[0], 0.0]])
    return np.eye(3) + k + k @ k / (1.0 + c)


def gsplat_world_transform(c2w_cv: np.ndarray, points: np.ndarray) -> np.ndarray:
    """(4, 4) float64 T, x_gsplat = T @ x: gsplat's Parser's normalisation (module doc) of cameras
    ``c2w_cv`` (N, 4, 4 or 3, 4; OpenCV axes; every image of the capture) and sparse ``points``
    (M, 3, M >= 4) in their world. T's upper 3x3 is a scale times a rotation. The principal axes'
    signs are LAPACK's (``eigh``), as in gsplat: another numpy build may turn the frame by a half
    turn about an axis."""
    R, t = c2w_cv[:, :3, :3], c2w_cv[:, :3, 3]
    up = (R @ np.array([0.0, -1.0, 0.0])).mean(axis=0)
    align = _align_up(up / np.linalg.norm(up))
    t_a = t @ align.T
    fwd = (align @ R)[:, :, 2]  # the optical axes, aligned
    nearest = t_a - np.sum(fwd * t_a, axis=1, keepdims=True) * fwd  # each axis' point closest to the origin
    shift = -np.median(nearest, axis=0)
    scale = 1.0 / np.median(np.linalg.norm(t_a + shift, axis=1))
    t1 = np.eye(4)
    t1[:3, :3], t1[:3, 3] = scale * align, scale * shift
    p = points @ t1[:3, :3].T + t1[:3, 3]
    centre = np.median(p, axis=0)
    var, vec = np.linalg.eigh(np.cov((p - centre).T))
    vec = vec[:, np.argsort(var)[::-1]]  # largest variance first: the smallest becomes z
    if np.linalg.det(vec) < 0:
        vec[:, 0] = -vec[:, 0]
    t2 = np.eye(4)
    t2[:3, :3], t2[:3, 3] = vec.T, -vec.T @ centre
    T = t2 @ t1
    z = (points @ T[:3, :3].T + T[:3, 3])[:, 2]
    if np.median(z) > np.mean(z):  # the Parser's upside-down fix: most points taken to lie low (a floor)
        T = np.diag([1.0, -1.0, -1.0, 1.0]) @ T
    return T


def with_gsplat_world(scene):
    """``scene`` (a COLMAP split) in gsplat's normalised world (module doc): the transform from
    every registered image and the sparse points of the capture, the same for every split.
    Raises SceneError for another format, fewer than 4 sparse points, a capture the transform is
    undefined for (every camera where their optical axes meet), or a scene already moved from its source world."""
    if not np.array_equal(scene.world_from_source, np.eye(4)):
        raise SceneError(f"{scene.root}: the scene is already moved from its source world (world_from_source is not "
                         f"the identity); apply gsplat's normalisation to the parsed scene only")
    if scene.format != "colmap":
        raise SceneError(f"{scene.root}: gsplat's world normalisation applies to COLMAP scenes, not {scene.format!r}; "
                         f"set scene.normalize_world: false")
    from dali_nerf.scenes.colmap import capture_model, model_folder, opencv_c2w

    model = capture_model(Path(scene.root))
    pts = np.asarray(model.xyz, np.float32).reshape(-1, 3).astype(np.float64)  # the Parser's float32 points
    if len(pts) < 4:
        raise SceneError(f"{model_folder(Path(scene.root))}: {len(pts)} sparse points; gsplat's normalisation aligns "
                         f"the world to their principal axes and needs at least 4: set scene.normalize_world: false")
    try:
        with np.errstate(all="ignore"):
            T = gsplat_world_transform(opencv_c2w(sorted(model.images, key=lambda im: im.name)), pts)
    except np.linalg.LinAlgError:
        T = np.full((4, 4), np.nan)
    if not np.isfinite(T).all() or abs(np.linalg.det(T[:3, :3])) < 1e-300:
        raise SceneError(f"{model_folder(Path(scene.root))}: gsplat's normalisation is undefined for this capture "
                         f"(its cameras or sparse points do not span a scene: e.g. every camera at the point their optical axes meet); "
                         f"set scene.normalize_world: false")
    A, b = T[:3, :3], T[:3, 3]
    s = float(np.linalg.norm(A[0]))  # the scale (gsplat divides the cameras' rotations by it)
    rot = A / s
    c2w = np.empty_like(scene.c2w)
    c2w[:, :, :3] = rot @ scene.c2w[:, :, :3]  # camera axes (ours: OpenGL's) are a right factor: kept
    c2w[:, :, 3] = scene.c2w[:, :, 3] @ A.T + b
    up = rot @ np.asarray(scene.up, np.float64)
    fields = dict(c2w=c2w.astype(scene.c2w.dtype), world_from_source=T @ scene.world_from_source,
                  up=(up / np.linalg.norm(up)).astype(np.float32))
    if scene.points is not None:  # the model's points (the scene's, in file order)
        fields["points"] = (pts @ A.T + b).astype(np.float32)
    if scene.near is not None:
        fields["near"] = scene.near * s
    if scene.far is not None:
        fields["far"] = scene.far * s
    if scene.aabb is not None:
        corners = np.array([[x, y, z] for x in scene.aabb[:, 0] for y in scene.aabb[:, 1] for z in scene.aabb[:, 2]])
        moved = corners @ A.T + b
        fields["aabb"] = np.stack([moved.min(0), moved.max(0)]).astype(np.float32)
    return dataclasses.replace(scene, **fields)
