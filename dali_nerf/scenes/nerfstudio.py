"""nerfstudio / instant-ngp scenes: one ``transforms.json``.

Keys (top level = shared by all frames; the same keys inside a frame override them):
``fl_x``, ``fl_y`` (or instant-ngp's ``camera_angle_x`` / ``camera_angle_y``), ``cx``, ``cy`` (default
w/2, h/2), ``w``, ``h`` (default: the first image's header), ``camera_model``, distortion ``k1..k4``,
``p1``, ``p2``; ``frames: [{"file_path": "images/frame_00001.png", "transform_matrix": 4x4}, ...]``
with ``file_path`` relative to the scene folder. Poses are OpenGL camera-to-world in the dataset's
own world frame; we keep that frame (``world_from_source`` = identity; nerfstudio's optional
``applied_transform`` only describes how that frame was made from COLMAP's and is not reapplied).

* Distortion (COLMAP's camera models, OpenCV's coefficient meaning): ``OPENCV`` / ``PERSPECTIVE`` /
  ``SIMPLE_RADIAL`` / ``RADIAL`` take ``k1``, ``k2``, ``p1``, ``p2`` and optional ``k3`` (OpenCV's
  5-coefficient polynomial model); ``FULL_OPENCV`` adds ``k4``, ``k5``, ``k6`` (OpenCV's rational
  model); ``OPENCV_FISHEYE`` takes ``k1``..``k4`` (``cv2.fisheye``, equidistant). A non-zero ``k4``
  under ``OPENCV`` is refused (nerfstudio reads it as an r^8 term, OpenCV as the rational one: say
  ``FULL_OPENCV`` for the latter), as are coefficients the model does not have and the other models
  (equirectangular, FOV, ...). ``PINHOLE`` / ``SIMPLE_PINHOLE`` must have zero coefficients. The
  images are undistorted once at decode (``dali_nerf/data/finish.py``); the Scene's ``intrinsics`` are
  the undistorted image's, same size, from :func:`._util.undistorted_intrinsics` (alpha = 0: no
  invalid border) at the file's resolution, then scaled like any intrinsics by ``downscale``. The
  distorted camera is kept in ``Scene.file_intrinsics`` / ``distortion`` / ``fisheye``. All-zero
  coefficients: a plain pinhole scene, as before.
* Splits: ``{train,val,test}_filenames`` when present (``val`` falls back to ``test_filenames`` and
  back, both being nerfstudio's eval set); otherwise nerfstudio's fraction rule on the frames
  sorted by file name: ``ceil(0.9 N)`` train images at ``linspace(0, N-1, n_train).astype(int)``, the
  rest eval (``val`` = ``test``).
* Bounds: ``near`` / ``far`` per frame or at the top level, else none. Box: ``aabb`` [[min], [max]]
  when present, else from instant-ngp's ``aabb_scale`` (box of side ``aabb_scale`` centred at
  ``offset`` in ngp's unit cube, mapped back with ngp's ``scale`` / ``offset``, defaults 0.33 and
  0.5), else none. World up: ``up`` when present, else the mean camera up vector over all frames
  of every split (nerfstudio's ``auto_orient`` "up" rule), so every split gets the same ``up``.
* ``downscale`` d: the ``images_d/`` copies (same names, nerfstudio's layout) when all exist, with
  their header sizes; else sizes floor(w/d), images area-averaged at decode. Intrinsics are
  scaled by the exact size ratio.
* Masks: ``mask_path`` per frame (on every frame or on none, as nerfstudio requires), relative to
  the scene folder: single-channel images of the frame's size, 0 = the pixel is never sampled,
  anything else = keep (nerfstudio's reading). With pre-downscaled images the ``masks_d/`` copies
  (nerfstudio's ``downsample_folder_prefix="masks_"``) when they all exist, else the full-size
  masks resized nearest-neighbour at decode (:func:`._util.resolve_masks`,
  :mod:`dali_nerf.data.masks`).

>>> scene = load_scene("data/city", split="train", format="nerfstudio")
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from dali_nerf.errors import SceneError
from dali_nerf.data.imageio import read_header
from dali_nerf.scenes.base import Scene, register_format
from dali_nerf.scenes._util import (as_float, as_matrix, check_bounds, check_focal, check_images_exist, check_poses,
                    check_sizes, lens_arrays, load_json, mean_up, parse_aabb, require, resolve_downscale,
                    resolve_masks)

__all__ = ["detect", "parse", "train_eval_split", "TRAIN_SPLIT_FRACTION"]

TRAIN_SPLIT_FRACTION = 0.9
_DISTORTION = ("k1", "k2", "k3", "k4", "k5", "k6", "p1", "p2")
#: camera_model -> coefficients it may carry (OpenCV's order is k1, k2, p1, p2, k3, k4, k5, k6)
_MODELS = {
    "PINHOLE": (), "SIMPLE_PINHOLE": (),
    "SIMPLE_RADIAL": ("k1",), "RADIAL": ("k1", "k2"),
    "OPENCV": ("k1", "k2", "p1", "p2", "k3"), "PERSPECTIVE": ("k1", "k2", "p1", "p2", "k3"),
    "FULL_OPENCV": ("k1", "k2", "p1", "p2", "k3", "k4", "k5", "k6"),
    "OPENCV_FISHEYE": ("k1", "k2", "k3", "k4"),
}
_OPENCV_ORDER = ("k1", "k2", "p1", "p2", "k3", "k4", "k5", "k6")
_NGP_SCALE, _NGP_OFFSET = 0.33, (0.5, 0.5, 0.5)


def detect(root: Path) -> bool:
    """A nerfstudio / instant-ngp scene has ``transforms.json``."""
    return (Path(root) / "transforms.json").is_file()


def train_eval_split(n: int, fraction: float = TRAIN_SPLIT_FRACTION):
    """nerfstudio's ``get_train_eval_split_fraction``: (train indices, eval indices), each sorted."""
    n_train = math.ceil(n * fraction)
    i_train = np.linspace(0, n - 1, n_train, dtype=int)
    i_eval = np.setdiff1d(np.arange(n), i_train)
    return i_train, i_eval


def _norm(rel: str) -> str:
    return os.path.normpath(rel.replace("\\", "/"))


def _split_indices(meta: dict, rels: list, split: str, path) -> np.ndarray:
    keys = [f"{s}_filenames" for s in ("train", "val", "test")]
    if any(k in meta for k in keys):
        key = f"{split}_filenames"
        if key not in meta and split in ("val", "test"):
            key = "test_filenames" if split == "val" else "val_filenames"
        if key not in meta:
            raise SceneError(f"{path}: has {', '.join(k for k in keys if k in meta)} but no {split}_filenames; add it")
        names = meta[key]
        if not isinstance(names, list):
            raise SceneError(f"{path}: {key} must be a list of file paths")
        wanted = {_norm(str(x)) for x in names}
        idx = np.array([i for i, r in enumerate(rels) if _norm(r) in wanted], np.int64)
        found = {_norm(rels[i]) for i in idx}
        unknown = sorted(wanted - found)
        if unknown:
            raise SceneError(f"{path}: {key} names {len(unknown)} file(s) that no frame has: {', '.join(unknown[:3])}")
        return idx
    i_train, i_eval = train_eval_split(len(rels))
    return i_train if split == "train" else i_eval


def _camera(meta: dict, fr: dict, path, where: str, first_image: str):
    """fx, fy, cx, cy, (w, h), OpenCV distortion (8,) and fisheye flag of one frame (frame keys
    override shared ones)."""
    get = lambda k, d=None: fr.get(k, meta.get(k, d))  # noqa: E731
    model = str(get("camera_model", "OPENCV")).upper()
    if model not in _MODELS:
        raise SceneError(
            f"{path}: camera_model {model!r} ({where}) is not supported (use one of {', '.join(_MODELS)}); "
            f"undistort the images to pinhole first (ns-process-data or COLMAP image_undistorter)"
        )
    coef = {k: as_float(get(k, 0.0), k, path, where) for k in _DISTORTION}
    extra = [k for k in _DISTORTION if coef[k] != 0.0 and k not in _MODELS[model]]
    if extra:
        k = extra[0]
        hint = ("; nerfstudio reads k4 as an r^8 term, OpenCV as its rational model: write camera_model "
                "FULL_OPENCV for OpenCV's k4..k6") if model in ("OPENCV", "PERSPECTIVE") and k in ("k4", "k5", "k6") else ""
        raise SceneError(
            f"{path}: non-zero distortion {k}={coef[k]:g} ({where}) but camera_model {model} has no {k}{hint}; "
            f"fix camera_model or the coefficients"
        )
    fisheye = model == "OPENCV_FISHEYE"
    order = ("k1", "k2", "k3", "k4") if fisheye else _OPENCV_ORDER
    dist = np.zeros(8, np.float64)
    dist[:len(order)] = [coef[k] for k in order]
    w, h = get("w"), get("h")
    if w is None or h is None:
        hd = read_header(first_image)
        w, h = (hd.width if w is None else w), (hd.height if h is None else h)
    w, h = as_float(w, "w", path, where), as_float(h, "h", path, where)
    if get("fl_x") is not None:
        fx = as_float(get("fl_x"), "fl_x", path, where)
    elif get("camera_angle_x") is not None:
        fx = 0.5 * w / math.tan(0.5 * as_float(get("camera_angle_x"), "camera_angle_x", path, where))
    else:
        raise SceneError(f"{path}: missing key 'fl_x' (or 'camera_angle_x') in {where} and at the top level")
    if get("fl_y") is not None:
        fy = as_float(get("fl_y"), "fl_y", path, where)
    elif get("camera_angle_y") is not None:
        fy = 0.5 * h / math.tan(0.5 * as_float(get("camera_angle_y"), "camera_angle_y", path, where))
    else:
        fy = fx
    cx = as_float(get("cx", w / 2), "cx", path, where)
    cy = as_float(get("cy", h / 2), "cy", path, where)
    if w != int(w) or h != int(h) or max(abs(w), abs(h)) >= 2 ** 31:
        raise SceneError(f"{path}: w, h ({where}) must be integers below 2^31, got {w:g}, {h:g}")
    return (fx, fy, cx, cy), (int(w), int(h)), dist, fisheye


def _mask_rels(frames: list, rels: list, path) -> list | None:
    """Every frame's ``mask_path`` (None when no frame has one); some but not all: SceneError."""
    masks = [fr.get("mask_path") for fr in frames]
    if all(m is None for m in masks):
        return None
    for fr_rel, m in zip(rels, masks):
        if not isinstance(m, str) or not m:
            raise SceneError(f"{path}: frame {fr_rel!r} has no mask_path but other frames have one; give mask_path "
                             f"(a non-empty string) on every frame or on none")
    return masks


def parse(root: Path, split: str, *, downscale: int = 1, background=(1.0, 1.0, 1.0)) -> Scene:
    """Parse one split of ``root/transforms.json``.

    Returns:
        Scene with c2w (N, 3, 4), intrinsics (N, 4), sizes (N,), optional near/far (N,).
    """
    root = Path(root).resolve()
    path = root / "transforms.json"
    meta = load_json(path)
    frames = require(meta, "frames", path)
    if not isinstance(frames, list) or not frames:
        raise SceneError(f"{path}: 'frames' is empty; the scene has no images")
    for i, fr in enumerate(frames):
        rel = require(fr, "file_path", path, f"frames[{i}]")
        if not isinstance(rel, str) or not rel:
            raise SceneError(f"{path}: frames[{i}].file_path must be a non-empty string")
    order = sorted(range(len(frames)), key=lambda i: _norm(frames[i]["file_path"]))  # nerfstudio sorts by name
    frames = [frames[i] for i in order]
    rels = [fr["file_path"] for fr in frames]
    mask_rels = _mask_rels(frames, rels, path)
    idx = _split_indices(meta, rels, split, path)
    if len(idx) == 0:
        raise SceneError(f"{path}: split {split!r} has no images ({len(frames)} frames in all)")

    paths, poses, ks, whs, names, nears, fars, dists, fishes = [], [], [], [], [], [], [], [], []
    for i in idx:
        fr, rel = frames[i], rels[i]
        where = f"frame {rel!r}"
        m = as_matrix(require(fr, "transform_matrix", path, where), (4, 4), "transform_matrix", path, where)
        p = str((root / rel).resolve()) if not os.path.isabs(rel) else rel
        k, wh, dist, fish = _camera(meta, fr, path, where, p)
        dists.append(dist)
        fishes.append(fish)
        paths.append(p)
        poses.append(m[:3])
        ks.append(k)
        whs.append(wh)
        names.append(rel)
        nears.append(fr.get("near", meta.get("near")))
        fars.append(fr.get("far", meta.get("far")))
    c2w = np.stack(poses)
    k_full = np.array(ks, np.float64)
    wh_full = np.array(whs, np.int64)
    check_poses(c2w, names, path)
    check_sizes(wh_full, names, path)
    check_focal(k_full, names, path)
    check_images_exist(paths, path)
    paths, k, wh, file_wh = resolve_downscale(paths, k_full, wh_full, downscale)
    masks = None
    if mask_rels is not None:
        rel_m = [mask_rels[i] for i in idx]
        masks = resolve_masks([str((root / r).resolve()) if not os.path.isabs(r) else r for r in rel_m], wh_full,
                              file_wh, downscale, path)
    lens = lens_arrays(k_full, wh_full, file_wh, wh, np.array(dists), np.array(fishes, bool))
    if lens is not None:
        k = lens[0]

    near = far = None
    if any(v is not None for v in nears + fars):
        if any(v is None for v in nears + fars):
            raise SceneError(f"{path}: 'near'/'far' given for some frames of split {split!r} but not all; give both everywhere or at the top level")
        near = np.array([as_float(v, "near", path) for v in nears])
        far = np.array([as_float(v, "far", path) for v in fars])
        check_bounds(near, far, names, path)

    if "aabb" in meta:
        aabb = parse_aabb(meta["aabb"], path)
    elif "aabb_scale" in meta:
        a = as_float(meta["aabb_scale"], "aabb_scale", path)
        scale = as_float(meta.get("scale", _NGP_SCALE), "scale", path)
        offset = as_matrix(meta.get("offset", _NGP_OFFSET), (3,), "offset", path)
        # ngp: x_ngp = x * scale + offset; its box is offset +- a/2 (a = 1: the unit cube)
        aabb = np.stack([(-0.5 * a) / scale * np.ones(3), (0.5 * a) / scale * np.ones(3)])
        aabb = aabb + (np.asarray(_NGP_OFFSET) - offset) / scale
    else:
        aabb = None
    if "up" in meta:
        up = as_matrix(meta["up"], (3,), "up", path)
    else:  # a property of the scene, not of the split: every frame's camera votes
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                up = mean_up(np.stack([np.asarray(f["transform_matrix"], np.float64)[:3] for f in frames]))
        except (KeyError, IndexError, TypeError, ValueError, OverflowError):
            up = None
        if up is None or not np.isfinite(up).all():  # another split's frame is malformed: this split's cameras vote
            up = mean_up(c2w)
    if not np.isfinite(up).all() or np.linalg.norm(up) == 0:
        raise SceneError(f"{path}: key 'up' must be a non-zero 3-vector")

    return Scene(
        image_paths=paths, c2w=c2w, intrinsics=k, width=wh[:, 0], height=wh[:, 1],
        split=split, format="nerfstudio", root=str(root), near=near, far=far,
        background=background, downscale=downscale, world_from_source=np.eye(4),
        up=up, aabb=aabb, file_wh=file_wh,
        **({} if lens is None else dict(distortion=lens[1], fisheye=lens[2], file_intrinsics=lens[3])),
        **({} if masks is None else dict(mask_paths=masks[0], mask_wh=masks[1])),
    )


register_format("nerfstudio", detect, parse)
