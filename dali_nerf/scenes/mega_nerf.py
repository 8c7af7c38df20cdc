"""Mega-NeRF scenes (the Mill 19 / UrbanScene3D layout Mega-NeRF trains on).

Files::

    coordinates.pt               {'origin_drb': (3,) tensor, 'pose_scale_factor': float}
    {train,val}/rgbs/<name>.{jpg,png}
    {train,val}/metadata/<name>.pt   {'W', 'H', 'intrinsics': (4,) fx fy cx cy,
                                      'c2w': (3, 4), optional 'distortion', 'near', 'far'}

Mega-NeRF's world is DRB (x down, y right, z back) and metadata ``c2w`` is already normalised:
x_world = (x_source - origin_drb) / pose_scale_factor. We keep that normalised world (so a
checkpoint matches Mega-NeRF's own) and record ``world_from_source`` = that affine map from the
metric DRB frame. World up is -x: ``up`` = (-1, 0, 0).

Camera axes (:data:`CAMERA_COLUMNS`): Mega-NeRF's README specifies the stored ``c2w`` as the
camera-in-DRB pose (columns [down, right, back]) *followed by*
``torch.cat([c[:, 1:2], -c[:, :1], c[:, 2:4]], -1)``, and its ``get_rays`` multiplies OpenGL
directions ((u - cx) / fx, -(v - cy) / fy, -1) by ``c2w[:, :3]``. So the stored columns are already
OpenGL [right, up, back] (in the DRB world) and are used as they are; applying the
[col1, -col0, col2] conversion again would rotate every camera by 90 degrees about its axis.

* Splits: ``train``; ``val`` and ``test`` both read ``val/`` (Mega-NeRF has only train/val).
* Bounds: ``near`` / ``far`` from each metadata file, else from ``coordinates.pt``, else derived:
  with r_i = |camera i position| and R = max(1, max_j r_j) over the split (Mega-NeRF normalises the
  cameras into the unit cube, so R is about 1), far_i = r_i + R (the far side of the radius-R
  ball around the origin that holds the cameras and the ground under them; Mega-NeRF's own fixed
  default is far = 2) and near_i = min(1 / pose_scale_factor, 0.01 far_i) (Mega-NeRF's default
  near of 1 metre, in normalised units).
* ``aabb``: the optional ``aabb`` (2, 3) of ``coordinates.pt``, else none.
* Distortion: a non-zero ``distortion`` is refused (undistort the images first), as for nerfstudio.
* ``downscale`` d: sizes floor(W/d), intrinsics scaled by the exact ratio, resized at decode.
* Every ``.pt`` is read with ``torch.load(..., map_location="cpu", weights_only=True)``; a file that
  needs arbitrary unpickling is refused, never executed.

>>> scene = load_scene("data/building", split="val", format="mega_nerf")
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch

from dali_nerf.errors import SceneError
from dali_nerf.scenes.base import Scene, register_format
from dali_nerf.scenes._util import (check_bounds, check_focal, check_poses, check_sizes, downscaled_size,
                    parse_aabb, scale_intrinsics, visible_files)

__all__ = ["detect", "parse", "load_pt", "CAMERA_COLUMNS"]

#: Camera axes of the stored metadata ``c2w`` columns (Mega-NeRF's documented layout).
CAMERA_COLUMNS = "right,up,back"


def detect(root: Path) -> bool:
    """A Mega-NeRF scene has ``coordinates.pt``."""
    return (Path(root) / "coordinates.pt").is_file()


def load_pt(path) -> dict:
    """Read a plain tensor dict with ``torch.load(weights_only=True)``; anything needing arbitrary
    unpickling, or not a dict, is refused with one line naming the file."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise SceneError(f"{path}: file not found") from None
    except pickle.UnpicklingError as e:
        if "unsupported global" not in str(e).lower():  # not a class reference: corrupt / truncated
            raise SceneError(f"{path}: cannot read (corrupt or not a torch.save file); re-save it with torch.save") from None
        raise SceneError(
            f"{path}: refusing to unpickle (needs arbitrary Python objects): not a plain tensor dict; "
            f"re-save it as a dict of tensors / numbers"
        ) from None
    except Exception as e:  # corrupt zip / truncated file
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SceneError(f"{path}: cannot read ({msg[:160]}); re-save it with torch.save") from None
    if not isinstance(obj, dict):
        raise SceneError(f"{path}: expected a dict, got {type(obj).__name__}")
    return obj


def _array(d: dict, key: str, shape, path) -> np.ndarray:
    if key not in d:
        raise SceneError(f"{path}: missing key {key!r}; add it or convert the scene")
    v = d[key]
    try:
        a = np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer beyond the float range
        raise SceneError(f"{path}: key {key!r} must be numeric (float64)") from None
    if shape is not None and a.shape != tuple(shape):
        raise SceneError(f"{path}: key {key!r} has shape {a.shape}, expected {tuple(shape)}")
    return a


def _scalar(d: dict, key: str, path) -> float:
    a = _array(d, key, None, path)
    if a.size != 1 or not np.isfinite(a).all():
        raise SceneError(f"{path}: key {key!r} must be one finite number")
    return float(a.reshape(()))


def parse(root: Path, split: str, *, downscale: int = 1, background=(1.0, 1.0, 1.0)) -> Scene:
    """Parse one split of the Mega-NeRF scene ``root``.

    Returns:
        Scene with c2w (N, 3, 4) (OpenGL camera axes, Mega-NeRF's normalised DRB world),
        intrinsics (N, 4), near/far (N,), up (-1, 0, 0).
    """
    root = Path(root).resolve()
    coord_path = root / "coordinates.pt"
    coords = load_pt(coord_path)
    origin = _array(coords, "origin_drb", (3,), coord_path)
    psf = _scalar(coords, "pose_scale_factor", coord_path)
    if not np.isfinite(origin).all() or psf <= 0:
        raise SceneError(f"{coord_path}: origin_drb must be finite and pose_scale_factor > 0 (got {psf:g})")
    folder = root / ("train" if split == "train" else "val")
    meta_dir, rgb_dir = folder / "metadata", folder / "rgbs"
    for d in (meta_dir, rgb_dir):
        if not d.is_dir():
            raise SceneError(f"{d}: folder not found; a Mega-NeRF split has rgbs/ and metadata/")
    metas = [f for f in visible_files(meta_dir, (".pt",)) if f.endswith(".pt")]  # hidden files (._000001.pt) skipped
    if not metas:
        raise SceneError(f"{meta_dir}: no .pt files; split {split!r} has no images")
    rgbs = {}
    for f in visible_files(rgb_dir):
        rgbs.setdefault(os.path.splitext(f)[0], str(rgb_dir / f))

    paths, poses, ks, whs, names, nears, fars = [], [], [], [], [], [], []
    missing = []
    for f in metas:
        stem = f[:-3]
        mp = meta_dir / f
        if stem not in rgbs:
            missing.append(f"{stem}.jpg|png")
            continue
        m = load_pt(mp)
        for key in ("W", "H"):
            v = _scalar(m, key, mp)
            if v != int(v) or v <= 0:
                raise SceneError(f"{mp}: key {key!r} must be a positive integer, got {v:g}")
        whs.append((int(_scalar(m, "W", mp)), int(_scalar(m, "H", mp))))
        ks.append(_array(m, "intrinsics", (4,), mp))
        poses.append(_array(m, "c2w", (3, 4), mp))
        if m.get("distortion") is not None:
            dist = _array(m, "distortion", None, mp)
            if np.any(dist != 0):
                raise SceneError(
                    f"{mp}: non-zero distortion {np.round(dist.ravel()[:5], 6).tolist()}; undistort the "
                    f"images first (COLMAP image_undistorter) and drop the key"
                )
        nears.append(_scalar(m, "near", mp) if "near" in m else None)
        fars.append(_scalar(m, "far", mp) if "far" in m else None)
        paths.append(rgbs[stem])
        names.append(stem)
    if missing:
        shown = ", ".join(missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
        raise SceneError(f"{rgb_dir}: {len(missing)} of {len(metas)} images missing for metadata/*.pt: {shown}")

    c2w = np.stack(poses)  # already OpenGL camera axes (see CAMERA_COLUMNS)
    check_poses(c2w, names, meta_dir)
    k_full = np.stack(ks)
    wh_full = np.array(whs, np.int64)
    check_sizes(wh_full, names, meta_dir)
    check_focal(k_full, names, meta_dir)
    wh = downscaled_size(wh_full, downscale) if downscale > 1 else wh_full
    k = scale_intrinsics(k_full, wh_full, wh)

    n = len(paths)
    if all(v is not None for v in nears + fars):
        near, far = np.array(nears), np.array(fars)
    elif any(v is not None for v in nears + fars):
        lacking = next(i for i in range(n) if nears[i] is None or fars[i] is None)
        having = next(i for i in range(n) if nears[i] is not None or fars[i] is not None)
        raise SceneError(f"{meta_dir / (names[lacking] + '.pt')}: has no 'near'/'far' but {names[having]}.pt has "
                         f"{'near' if nears[having] is not None else 'far'}; give both in every metadata file or in "
                         f"coordinates.pt")
    elif "near" in coords and "far" in coords:
        near = np.full(n, _scalar(coords, "near", coord_path))
        far = np.full(n, _scalar(coords, "far", coord_path))
    else:
        r = np.linalg.norm(c2w[:, :, 3], axis=1)
        far = r + max(1.0, float(r.max()))
        near = np.minimum(1.0 / psf, 0.01 * far)
    check_bounds(near, far, names, meta_dir)
    aabb = parse_aabb(_array(coords, "aabb", (2, 3), coord_path).tolist(), coord_path) if "aabb" in coords else None

    wfs = np.eye(4)
    wfs[:3, :3] /= psf
    wfs[:3, 3] = -origin / psf
    return Scene(
        image_paths=paths, c2w=c2w, intrinsics=k, width=wh[:, 0], height=wh[:, 1],
        split=split, format="mega_nerf", root=str(root), near=near, far=far,
        background=background, downscale=downscale, world_from_source=wfs,
        up=np.array([-1.0, 0.0, 0.0]), aabb=aabb, file_wh=wh_full,
    )


register_format("mega_nerf", detect, parse)
