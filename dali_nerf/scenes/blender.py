"""Blender synthetic scenes (the NeRF paper's ``nerf_synthetic`` layout).

Files: ``transforms_{train,val,test}.json`` with ``camera_angle_x`` (horizontal field of view,
radians) and ``frames``: ``[{"file_path": "./train/r_0", "transform_matrix": 4x4}, ...]``.
``file_path`` is relative to the scene folder; ``.png`` is appended when it has no image
extension. Poses are already OpenGL camera-to-world (x right, y up, looking down -z), world up
is +z.

Conversion: fx = fy = 0.5 * W / tan(0.5 * camera_angle_x), cx = W / 2, cy = H / 2, with W, H read
from the *first* image's header (Blender renders share one size; ``dali-nerf validate`` checks
every header). Optional top-level keys (written by our generator, absent from the standard set):
``near``, ``far`` (default 2 and 6, the standard bounds of the synthetic scenes) and ``aabb``
[[min], [max]] (default [-1.5, 1.5]^3). ``downscale`` d: sizes floor(W/d), intrinsics scaled by the
exact ratio, images area-averaged at decode (``dali_nerf/data/finish.py``). ``world_from_source`` is the
identity. Background (``load_scene``'s "auto"): white, the synthetic scenes' convention.

>>> scene = load_scene("data/lego", split="train")      # detected by transforms_train.json
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from dali_nerf.errors import SceneError
from dali_nerf.data.imageio import check_pixel_limit, read_header
from dali_nerf.scenes.base import Scene, register_format
from dali_nerf.scenes._util import (as_float, as_matrix, check_bounds, check_focal, check_images_exist, check_poses,
                    image_path, load_json, parse_aabb, require, resolve_downscale)

__all__ = ["detect", "parse", "BLENDER_NEAR", "BLENDER_FAR", "BLENDER_AABB"]

BLENDER_NEAR, BLENDER_FAR = 2.0, 6.0
BLENDER_AABB = ((-1.5, -1.5, -1.5), (1.5, 1.5, 1.5))


def detect(root: Path) -> bool:
    """A Blender scene has ``transforms_train.json``."""
    return (Path(root) / "transforms_train.json").is_file()


def parse(root: Path, split: str, *, downscale: int = 1, background=(1.0, 1.0, 1.0)) -> Scene:
    """Parse ``transforms_<split>.json`` of the Blender scene ``root``.

    Returns:
        Scene with N = len(frames): c2w (N, 3, 4), intrinsics (N, 4), near/far (N,), up +z.
    """
    root = Path(root).resolve()
    path = root / f"transforms_{split}.json"
    if not path.is_file():
        raise SceneError(f"{path}: file not found; this Blender scene has no {split!r} split")
    meta = load_json(path)
    angle = as_float(require(meta, "camera_angle_x", path), "camera_angle_x", path)
    if not 0.0 < angle < math.pi:
        raise SceneError(f"{path}: camera_angle_x={angle:g} must be in (0, pi) radians")
    frames = require(meta, "frames", path)
    if not isinstance(frames, list) or not frames:
        raise SceneError(f"{path}: 'frames' is empty; split {split!r} has no images")

    paths, poses, names = [], [], []
    for i, fr in enumerate(frames):
        where = f"frames[{i}]"
        rel = require(fr, "file_path", path, where)
        if not isinstance(rel, str) or not rel:
            raise SceneError(f"{path}: {where}.file_path must be a non-empty string")
        m = as_matrix(require(fr, "transform_matrix", path, where), (4, 4), "transform_matrix", path, where)
        paths.append(image_path(root, rel, ".png"))
        poses.append(m[:3, :4])
        names.append(rel)
    c2w = np.stack(poses)
    check_poses(c2w, names, path)
    check_images_exist(paths, path)

    h0 = read_header(paths[0])
    check_pixel_limit(paths[0], h0.width, h0.height)  # every image is sized from this header
    n = len(paths)
    wh_full = np.tile(np.array([[h0.width, h0.height]], np.int64), (n, 1))
    focal = 0.5 * h0.width / math.tan(0.5 * angle)
    k_full = np.tile(np.array([[focal, focal, 0.5 * h0.width, 0.5 * h0.height]]), (n, 1))
    check_focal(k_full, names, path)
    paths, k, wh, file_wh = resolve_downscale(paths, k_full, wh_full, downscale)

    near = as_float(meta.get("near", BLENDER_NEAR), "near", path)
    far = as_float(meta.get("far", BLENDER_FAR), "far", path)
    check_bounds(np.array([near]), np.array([far]), ["(scene)"], path)
    aabb = parse_aabb(meta["aabb"], path) if "aabb" in meta else np.array(BLENDER_AABB)

    return Scene(
        image_paths=paths, c2w=c2w, intrinsics=k, width=wh[:, 0], height=wh[:, 1],
        split=split, format="blender", root=str(root), near=np.full(n, near), far=np.full(n, far),
        background=background, downscale=downscale, world_from_source=np.eye(4),
        up=np.array([0.0, 0.0, 1.0]), aabb=aabb, file_wh=file_wh,
    )


register_format("blender", detect, parse)
