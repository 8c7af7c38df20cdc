"""LLFF forward-facing scenes (``poses_bounds.npy`` + ``images/``), as the original NeRF code reads them.

``poses_bounds.npy`` is (N, 17) float: each row a 3x5 matrix (row-major) followed by the near and
far depth bounds of that image. The 3x5 matrix is ``[down, right, back, position | (H, W, focal)]``:
rotation columns in camera axes [down, right, back] (LLFF / COLMAP-derived), then the camera centre,
then the image height, width and focal length (pixels) of the full-resolution images. Images are
the files of ``images/`` with an image extension, sorted by name (row i <-> i-th file).

Conversion (exactly the NeRF reference ``load_llff_data`` with ``bd_factor=0.75``, ``recenter``):

1. axes: c2w = [col1, -col0, col2, t] -> OpenGL [right, up, back];
2. scale: sc = 1 / (0.75 * min(bounds)); positions and bounds multiplied by sc;
3. recentre: with the average pose C (mean position, summed back axis, summed up axis,
   orthonormalised), poses become inv(C) @ pose.

``world_from_source`` = inv(C) @ diag(sc, sc, sc, 1) maps the file's world to ours. Bounds per
image are the scaled bounds (no NDC). Split: image i is test (and val) when i % 8 == 0, else
train; the normalisation uses all images, whatever the split. World up is the mean camera up
after recentring. ``downscale`` d uses ``images_d/`` when it exists (its files, sorted, must be N;
sizes from its first header), else floor(W/d) x floor(H/d) area-averaged at decode (LLFF's own
images_d are area-like minifications); intrinsics are scaled by the exact size ratio. Background
("auto"): learned for RGB images (nothing to composite), white when the first image has alpha. No box (``aabb`` None): LLFF scenes are unbounded forward-facing.

>>> scene = load_scene("data/fern", split="test", format="llff", downscale=8)
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dali_nerf.errors import SceneError
from dali_nerf.data.imageio import read_header
from dali_nerf.scenes.base import Scene, register_format
from dali_nerf.scenes._util import (DRB_TO_GL, check_bounds, check_focal, check_images_exist, check_poses, check_sizes,
                    downscaled_size, mean_up, scale_intrinsics, visible_files)

__all__ = ["detect", "parse", "LLFF_HOLD", "BD_FACTOR", "normalise"]

LLFF_HOLD = 8
BD_FACTOR = 0.75


def detect(root: Path) -> bool:
    """An LLFF scene has ``poses_bounds.npy``."""
    return (Path(root) / "poses_bounds.npy").is_file()


def _list_images(folder: Path) -> list:
    """The images of ``folder``, sorted by name; hidden files (``._IMG_4026.JPG``) skipped
    (:func:`~dali_nerf.scenes._util.visible_files`)."""
    return [str(folder / f) for f in visible_files(folder)]


def _span(files: list) -> str:
    """The first and last names of a sorted file list, for a count mismatch's message."""
    names = [os.path.basename(f) for f in files]
    return "" if not names else f" ({names[0]}{' .. ' + names[-1] if len(names) > 1 else ''})"


def _normalize(v):
    return v / np.linalg.norm(v)


def normalise(c2w_gl: np.ndarray, bounds: np.ndarray):
    """NeRF's LLFF normalisation (scale by ``BD_FACTOR``, recentre on the average pose).

    Args:
        c2w_gl: (N, 3, 4) OpenGL camera-to-world in the file's world.
        bounds: (N, 2) near, far.
    Returns:
        c2w (N, 3, 4), bounds (N, 2), world_from_source (4, 4).
    """
    sc = 1.0 / (bounds.min() * BD_FACTOR)
    c2w = c2w_gl.copy()
    c2w[:, :, 3] *= sc
    center = c2w[:, :, 3].mean(axis=0)
    z = _normalize(c2w[:, :, 2].sum(axis=0))
    y = c2w[:, :, 1].sum(axis=0)
    x = _normalize(np.cross(y, z))
    y = _normalize(np.cross(z, x))
    avg = np.eye(4)
    avg[:3] = np.stack([x, y, z, center], axis=1)
    inv = np.linalg.inv(avg)
    c2w4 = np.tile(np.eye(4), (len(c2w), 1, 1))
    c2w4[:, :3] = c2w
    out = (inv @ c2w4)[:, :3]
    return out, bounds * sc, inv @ np.diag([sc, sc, sc, 1.0])


def parse(root: Path, split: str, *, downscale: int = 1, background=(1.0, 1.0, 1.0)) -> Scene:
    """Parse one split of the LLFF scene ``root``.

    Returns:
        Scene with c2w (N, 3, 4), intrinsics (N, 4), near/far (N,) (normalised units).
    """
    root = Path(root).resolve()
    path = root / "poses_bounds.npy"
    try:
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise SceneError(f"{path}: file not found") from None
    except (ValueError, OSError) as e:
        raise SceneError(f"{path}: not a readable .npy array ({e}); regenerate it with LLFF's imgs2poses.py") from None
    except Exception as e:  # a corrupt header: numpy parses it as a Python literal (SyntaxError, TokenError, ...)
        raise SceneError(f"{path}: not a readable .npy array (corrupt header: {type(e).__name__}); "
                         f"regenerate it with LLFF's imgs2poses.py") from None
    if arr.ndim != 2 or arr.shape[1] != 17 or arr.shape[0] == 0:
        raise SceneError(f"{path}: has shape {arr.shape}, expected (N, 17) (N poses of 3x5 then near, far)")
    arr = arr.astype(np.float64)
    n = arr.shape[0]
    poses = arr[:, :15].reshape(n, 3, 5)
    bounds = arr[:, 15:17]
    img_dir = root / "images"
    if not img_dir.is_dir():
        raise SceneError(f"{img_dir}: folder not found; an LLFF scene keeps its images in images/")
    files = _list_images(img_dir)
    if len(files) != n:
        raise SceneError(f"{path}: has {n} poses but {img_dir} has {len(files)} images{_span(files)}; they must "
                         f"match one to one (hidden files, named .*, are not counted)")
    names = [os.path.basename(f) for f in files]

    src = poses[:, :, :4]
    check_poses(src, names, path)
    hwf = poses[:, :, 4]
    if not np.isfinite(hwf).all() or (np.abs(hwf[:, :2] - np.round(hwf[:, :2])) > 1e-3).any():
        i = int(np.flatnonzero(~np.isfinite(hwf).all(1) | (np.abs(hwf[:, :2] - np.round(hwf[:, :2])) > 1e-3).any(1))[0])
        raise SceneError(f"{path}: row {i} ({names[i]}) has image size H={hwf[i, 0]:g} W={hwf[i, 1]:g}; must be integers")
    wh_full = np.round(hwf[:, [1, 0]]).astype(np.int64)
    check_sizes(wh_full, names, path)
    k_full = np.stack([hwf[:, 2], hwf[:, 2], wh_full[:, 0] / 2.0, wh_full[:, 1] / 2.0], axis=1)
    check_focal(k_full, names, path)
    check_bounds(bounds[:, 0], bounds[:, 1], names, path)
    if bounds.min() <= 0:
        raise SceneError(f"{path}: near bounds must be > 0 (min is {bounds.min():g})")

    c2w_gl = src.copy()
    c2w_gl[:, :, :3] = src[:, :, :3] @ DRB_TO_GL
    c2w, bds, world_from_source = normalise(c2w_gl, bounds)
    up = mean_up(c2w)

    idx = np.arange(n)
    idx = idx[idx % LLFF_HOLD == 0] if split in ("val", "test") else idx[idx % LLFF_HOLD != 0]
    if len(idx) == 0:
        raise SceneError(f"{path}: split {split!r} has no images ({n} images; every {LLFF_HOLD}th is test)")

    paths = [files[i] for i in idx]
    wh_full, k_full = wh_full[idx], k_full[idx]
    pre_dir = root / f"images_{downscale}"
    if downscale > 1 and pre_dir.is_dir():
        pre = _list_images(pre_dir)
        if len(pre) != n:
            raise SceneError(f"{pre_dir}: has {len(pre)} images{_span(pre)} for {n} poses; regenerate it (or remove it "
                             f"to resize at decode)")
        paths = [pre[i] for i in idx]
        h0 = read_header(paths[0])
        wh = np.tile(np.array([[h0.width, h0.height]], np.int64), (len(idx), 1))
        file_wh = wh
    elif downscale > 1:
        wh = downscaled_size(wh_full, downscale)
        file_wh = wh_full
    else:
        wh = file_wh = wh_full
    k = scale_intrinsics(k_full, wh_full, wh)
    check_images_exist(paths, path)

    return Scene(
        image_paths=paths, c2w=c2w[idx], intrinsics=k, width=wh[:, 0], height=wh[:, 1],
        split=split, format="llff", root=str(root), near=bds[idx, 0], far=bds[idx, 1],
        background=background, downscale=downscale, world_from_source=world_from_source,
        up=up, aabb=None, file_wh=file_wh,
    )


register_format("llff", detect, parse)
