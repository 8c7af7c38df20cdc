"""COLMAP scenes: a sparse model ``sparse/0/`` (or ``sparse/``) with ``cameras``, ``images`` and
``points3D`` (``.bin`` or ``.txt``) beside ``images/``: the input of 3D Gaussian Splatting and of
gsplat's ``examples/datasets/colmap.py``, and what nerfstudio's ``ns-process-data`` makes.

Read with our own reader (:mod:`.colmap_io`, checked against pycolmap in tests/test_colmap.py),
so COLMAP scenes need no new dependency. Conversion, per image:

* pose: COLMAP stores world-to-camera ``R(q), t`` in OpenCV camera axes (x right, y down, z
  forward); camera-to-world = ``inv([R | t])`` (float64, as gsplat's Parser), then the y and z
  columns negated: OpenGL axes, our convention. The world is COLMAP's own (``world_from_source``
  = identity; no normalisation), and ``Scene.points`` are in it.
* intrinsics: COLMAP puts pixel centres at +0.5, as we do: fx, fy, cx, cy are read as they are.
  Models PINHOLE, SIMPLE_PINHOLE (f = fx = fy), SIMPLE_RADIAL (k), RADIAL (k1, k2), OPENCV (k1,
  k2, p1, p2), OPENCV_FISHEYE (k1..k4, ``cv2.fisheye``) and FULL_OPENCV (k1, k2, p1, p2, k3..k6,
  OpenCV's rational model); COLMAP's radial and OpenCV models are OpenCV's polynomials, so the
  coefficients go to ``Scene.distortion`` in OpenCV's order and the images are undistorted once at
  decode, to the same size (alpha = 0: :func:`._util.undistorted_intrinsics`). Other models
  (FOV, the other fisheyes, ...) are refused in one line.
* order and split: images sorted by name (gsplat's order); image i is held out (``test`` and
  ``val``) when ``i % 8 == 0`` (gsplat's ``test_every`` = 8, the mip-NeRF 360 rule), else ``train``.
* ``camera_idx``: each image's COLMAP camera as a 0-based index over the sorted camera ids of
  every registered image (gsplat's ``camera_idx``).
* ``downscale`` d (gsplat's ``data_factor``): the ``images_d/`` folder when it has every image
  (the same name, or the same stem with another image extension: ``a.JPG`` -> ``a.png``), used as it
  is, PNG or JPEG, intrinsics scaled by the ratio of its header size to the camera's; else the
  full images are area-averaged at decode to floor(w / d) x floor(h / d). (gsplat uses PNG
  ``images_d`` as they are, as we do; for JPEG ``images_d`` it resizes the full images itself with
  PIL's bicubic filter, so its pixels and ours differ there.)
* sparse points: ``Scene.points`` (M, 3) float32 and ``points_rgb`` (M, 3) uint8 in file order;
  ``aabb``, ``near``, ``far`` None; ``up`` the mean camera up.
* masks: a ``masks/`` folder beside ``images/`` gives every image of the split its mask
  (``Scene.mask_paths``; 0 = never train on the pixel, else keep): ``masks/<name>.png`` (COLMAP's
  ``ImageReader.mask_path`` convention, ``a.jpg`` -> ``a.jpg.png``) or ``masks/<stem>.png``
  (nerfstudio's colmap dataparser with ``masks_path``, ``a.jpg`` -> ``a.png``); an image with
  neither is a one-line error. With ``images_d/`` the ``masks_d/`` copies when they all exist,
  else the full-size masks resized nearest-neighbour (:func:`._util.resolve_masks`). Without the
  folder the scene has no masks.

>>> scene = load_scene("data/garden", split="train", downscale=4)      # images_4/ when present
>>> scene.points.shape
(138766, 3)
"""

from __future__ import annotations

import functools

import os
from pathlib import Path

import numpy as np

from dali_nerf.data.imageio import IMAGE_EXTENSIONS
from dali_nerf.errors import SceneError
from dali_nerf.scenes.base import Scene, register_format
from dali_nerf.scenes._util import (check_focal, check_images_exist, check_poses, check_sizes, downscaled_size,
                                    finite32, lens_arrays, mean_up, prescaled_sizes, resolve_masks, scale_intrinsics)
from dali_nerf.scenes.colmap_io import model_files, read_model, rotation_from_quaternion

__all__ = ["detect", "parse", "TEST_EVERY", "SUPPORTED_MODELS", "model_folder", "camera_arrays", "opencv_c2w",
           "mask_files", "split_indices", "capture_model"]

TEST_EVERY = 8
"""Image i (in name order) is held out when ``i % TEST_EVERY == 0`` (gsplat's default)."""


def split_indices(n: int, split: str) -> np.ndarray:
    """Indices (in name order) of a capture of ``n`` images that form ``split``: val / test every
    :data:`TEST_EVERY`-th from 0, train the others (gsplat's ``test_every`` rule)."""
    idx = np.arange(n)
    return idx[idx % TEST_EVERY == 0] if split in ("val", "test") else idx[idx % TEST_EVERY != 0]


def capture_model(root: Path):
    """The sparse model of the COLMAP scene ``root`` (:func:`model_folder`), read once per process
    while its files stay as they are (their sizes and modification times key the copy): the parser
    of each split, EXIF exposure and gsplat's world normalisation all read it. Callers must not
    change it."""
    folder = model_folder(Path(root))
    _, paths = model_files(folder)
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(paths.values()))
    return _read_model_once(str(folder), stamp)


@functools.lru_cache(maxsize=4)
def _read_model_once(folder: str, stamp: tuple):
    return read_model(folder)

#: model -> (OpenCV coefficient positions of its extra parameters, fisheye)
SUPPORTED_MODELS = {
    "SIMPLE_PINHOLE": ((), False), "PINHOLE": ((), False), "SIMPLE_RADIAL": ((0,), False),
    "RADIAL": ((0, 1), False), "OPENCV": ((0, 1, 2, 3), False), "OPENCV_FISHEYE": ((0, 1, 2, 3), True),
    "FULL_OPENCV": ((0, 1, 2, 3, 4, 5, 6, 7), False),
}

#: OpenCV camera axes (y down, z forward) <-> OpenGL (y up, z back): negate columns 1 and 2.
CV_TO_GL = np.diag([1.0, -1.0, -1.0])


def model_folder(root: Path) -> Path:
    """The folder of the sparse model: ``sparse/0`` when it holds one, else ``sparse``."""
    for sub in ("sparse/0", "sparse"):
        folder = Path(root) / sub
        try:
            model_files(folder)
            return folder
        except SceneError:
            continue
    return Path(root) / "sparse" / "0"


def detect(root: Path) -> bool:
    """A COLMAP scene has a sparse model in ``sparse/0/`` or ``sparse/``."""
    folder = model_folder(root)
    try:
        model_files(folder)
    except SceneError:
        return False
    return True


def camera_arrays(cam, path) -> tuple:
    """``((fx, fy, cx, cy), distortion (8,) OpenCV order, fisheye)`` of a COLMAP camera."""
    if cam.model not in SUPPORTED_MODELS:
        raise SceneError(f"{path}: camera {cam.id} has model {cam.model}, which is not supported (use one of "
                         f"{', '.join(SUPPORTED_MODELS)}); undistort the images first (colmap image_undistorter)")
    p = np.asarray(cam.params, np.float64)
    if not finite32(p).all():
        raise SceneError(f"{path}: camera {cam.id} has a non-finite parameter; fix the model")
    simple = cam.model in ("SIMPLE_PINHOLE", "SIMPLE_RADIAL", "RADIAL")
    k = (p[0], p[0], p[1], p[2]) if simple else (p[0], p[1], p[2], p[3])
    extra = p[3:] if simple else p[4:]
    slots, fisheye = SUPPORTED_MODELS[cam.model]
    dist = np.zeros(8, np.float64)
    dist[list(slots)] = extra
    return k, dist, fisheye


def opencv_c2w(images) -> np.ndarray:
    """(N, 4, 4) float64 camera-to-world in OpenCV camera axes of COLMAP images: the inverse of
    their world-to-camera matrices, stacked as gsplat's Parser does it (``np.linalg.inv``)."""
    w2c = np.tile(np.eye(4), (len(images), 1, 1))
    for i, im in enumerate(images):
        w2c[i, :3, :3] = rotation_from_quaternion(im.qvec)
        w2c[i, :3, 3] = im.tvec
    return np.linalg.inv(w2c)


def _prescaled(root: Path, names, d: int):
    """Paths of ``images_d/`` copies of every image (same name, or same stem with an image
    extension), or None when the folder is missing or lacks one."""
    folder = root / f"images_{d}"
    if d <= 1 or not folder.is_dir():
        return None
    out = []
    for name in names:
        hit = folder / name
        if not hit.is_file():
            stem = os.path.splitext(name)[0]
            hit = next((folder / (stem + e) for e in IMAGE_EXTENSIONS + tuple(x.upper() for x in IMAGE_EXTENSIONS)
                        if (folder / (stem + e)).is_file()), None)
            if hit is None:
                return None
        out.append(str(hit))
    return out


def mask_files(root: Path, names):
    """The masks of images ``names`` in ``root/masks/`` (module doc), or None without the folder."""
    folder = Path(root) / "masks"
    if not folder.is_dir():
        return None
    out = []
    for name in names:
        colmap, stem = folder / (name + ".png"), folder / (os.path.splitext(name)[0] + ".png")
        hit = colmap if colmap.is_file() else stem if stem.is_file() else None
        if hit is None:
            raise SceneError(f"{colmap}: mask not found (the scene has a masks/ folder, so every image needs its mask: "
                             f"masks/<name>.png or masks/<stem>.png); add it or remove the masks/ folder")
        out.append(str(hit))
    return out


def parse(root: Path, split: str, *, downscale: int = 1, background=(1.0, 1.0, 1.0)) -> Scene:
    """Parse one split of the COLMAP scene ``root`` (conversion in the module doc).

    Returns:
        Scene with c2w (N, 3, 4), intrinsics (N, 4), sizes (N,), ``camera_idx`` (N,), the sparse
        ``points`` (M, 3) and ``points_rgb`` (M, 3); lens fields when a camera is distorted.
    """
    root = Path(root).resolve()
    folder = model_folder(root)
    model = capture_model(root)
    path = folder / f"images.{model_files(folder)[0]}"
    if not model.images:
        raise SceneError(f"{path}: has no registered images; reconstruct the scene first")
    images = sorted(model.images, key=lambda im: im.name)
    names = [im.name for im in images]
    ids = sorted({im.camera_id for im in images})
    camera_idx = np.array([ids.index(im.camera_id) for im in images], np.int64)
    c2w_cv = opencv_c2w(images)
    c2w = c2w_cv[:, :3, :4].copy()
    c2w[:, :, :3] = c2w_cv[:, :3, :3] @ CV_TO_GL
    check_poses(c2w, names, path)
    up = mean_up(c2w)

    idx = split_indices(len(images), split)
    if len(idx) == 0:
        raise SceneError(f"{path}: split {split!r} has no images ({len(images)} images; every {TEST_EVERY}th is held out)")
    cams = [model.cameras[images[i].camera_id] for i in idx]
    per = [camera_arrays(c, folder / f"cameras.{model_files(folder)[0]}") for c in cams]
    k_full = np.array([p[0] for p in per], np.float64)
    dist = np.array([p[1] for p in per], np.float64)
    fisheye = np.array([p[2] for p in per], bool)
    wh_full = np.array([[c.width, c.height] for c in cams], np.int64)
    sub_names = [names[i] for i in idx]
    check_sizes(wh_full, sub_names, path)
    check_focal(k_full, sub_names, path)
    paths = [str(root / "images" / n) for n in sub_names]
    check_images_exist(paths, path)

    pre = _prescaled(root, sub_names, downscale)
    if pre is not None:  # images_d/ as they are, intrinsics by their header size
        paths, wh = pre, prescaled_sizes(pre, wh_full)
        file_wh = wh
    else:
        wh = downscaled_size(wh_full, downscale) if downscale > 1 else wh_full
        file_wh = wh_full
    k = scale_intrinsics(k_full, wh_full, wh)
    masks = mask_files(root, sub_names)
    if masks is not None:
        masks = resolve_masks(masks, wh_full, file_wh, downscale, path)
    lens = lens_arrays(k_full, wh_full, file_wh, wh, dist, fisheye)
    if lens is not None:
        k = lens[0]
    return Scene(
        image_paths=paths, c2w=c2w[idx], intrinsics=k, width=wh[:, 0], height=wh[:, 1], split=split,
        format="colmap", root=str(root), background=background, downscale=downscale, world_from_source=np.eye(4),
        up=up, file_wh=file_wh, camera_idx=camera_idx[idx], points=model.xyz.astype(np.float32),
        points_rgb=model.rgb,
        **({} if lens is None else dict(distortion=lens[1], fisheye=lens[2], file_intrinsics=lens[3])),
        **({} if masks is None else dict(mask_paths=masks[0], mask_wh=masks[1])),
    )


register_format("colmap", detect, parse)
