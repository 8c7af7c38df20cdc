"""Checks and conversions shared by the scene parsers (one place, used by all four).

Every function raises :class:`dali_nerf.errors.SceneError` with one line naming the file (and the
frame or key) on bad input.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional, Sequence

import cv2
import numpy as np

from dali_nerf.errors import SceneError
from dali_nerf.data.imageio import IMAGE_EXTENSIONS, check_pixel_limit, max_pixels_limit, read_header

__all__ = [
    "load_json", "require", "as_float", "check_poses", "check_focal", "check_images_exist", "visible_files",
    "downscaled_size", "scale_intrinsics", "prescaled_paths", "mean_up", "DRB_TO_GL", "check_sizes",
    "undistorted_intrinsics", "lens_arrays", "opencv_matrix", "resolve_background", "BACKGROUND_NAMES", "finite32",
]

#: Named backgrounds of ``scene.background`` / ``load_scene(background=)``: name -> (colour, mode).
#: "auto" is resolved per format by :func:`resolve_background`.
BACKGROUND_NAMES = {
    "white": ((1.0, 1.0, 1.0), "color"),
    "black": ((0.0, 0.0, 0.0), "color"),
    "random": ((1.0, 1.0, 1.0), "random"),
    "learned": ((1.0, 1.0, 1.0), "learned"),
}

#: Right-multiplying a 3x3 camera rotation whose columns are [down, right, back] by this gives
#: [right, up, back] columns (OpenGL): new = [col1, -col0, col2].
DRB_TO_GL = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])


def load_json(path: Path) -> dict:
    """Parse a JSON file (dict at top level); missing or malformed -> SceneError with file:line."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise SceneError(f"{path}: file not found") from None
    except OSError as e:
        raise SceneError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise SceneError(f"{path}: not UTF-8 text (invalid byte at offset {e.start}); the file is corrupt, restore it") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SceneError(f"{path}:{e.lineno}:{e.colno}: malformed JSON ({e.msg}); fix the file") from None
    except ValueError as e:  # well-formed JSON Python cannot read: an integer of more than 4300 digits
        raise SceneError(f"{path}: unreadable JSON value ({str(e).split(';')[0]}); fix the file") from None
    if not isinstance(data, dict):
        raise SceneError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def finite32(a) -> np.ndarray:
    """Elementwise: finite, and still finite once stored as float32 (as the Scene stores it)."""
    a = np.asarray(a, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.isfinite(a) & (np.abs(a) <= np.finfo(np.float32).max)


def _short(v, n: int = 60) -> str:
    """repr of a value from a file, at most ``n`` characters (a corrupt file's value may be huge)."""
    try:
        r = repr(v)
    except ValueError:  # an integer over Python's str conversion limit
        return "an integer of more than 4300 digits"
    return r if len(r) <= n else r[:n] + "..."


def require(d: dict, key: str, path, where: str = ""):
    """``d[key]``, or a SceneError naming the key, the file and (optionally) the frame."""
    if not isinstance(d, dict) or key not in d:
        loc = f" in {where}" if where else ""
        raise SceneError(f"{path}: missing key {key!r}{loc}; add it or convert the scene")
    return d[key]


def as_float(v, key: str, path, where: str = "") -> float:
    """A finite float from a JSON value, else a SceneError naming the key."""
    loc = f" ({where})" if where else ""
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise SceneError(f"{path}: key {key!r}{loc} must be a number, got {_short(v)}") from None
    except OverflowError:  # an integer beyond the float range
        raise SceneError(f"{path}: key {key!r}{loc} is out of range (an integer of {len(str(abs(v)))} digits)") from None
    if not math.isfinite(x) or not finite32(x):
        raise SceneError(f"{path}: key {key!r}{loc} is not finite in float32 ({_short(v)})")
    return x


def as_matrix(v, shape: tuple, key: str, path, where: str = "") -> np.ndarray:
    """A float64 array of ``shape`` from a JSON list, else a SceneError naming the key."""
    loc = f" ({where})" if where else ""
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise SceneError(f"{path}: key {key!r}{loc} must be a {'x'.join(map(str, shape))} array of numbers") from None
    if a.shape != shape:
        raise SceneError(f"{path}: key {key!r}{loc} has shape {a.shape}, expected {shape}")
    return a


def check_poses(c2w: np.ndarray, names: Sequence[str], path, tol: float = 1e-3) -> None:
    """Poses must be finite with a rotation part that is orthonormal (|R^T R - I| <= tol) and
    right-handed (det R > 0).

    Args:
        c2w: (N, 3, 4) camera-to-world.
        names: (N,) frame names for the message.
        path: the file the poses came from.
    """
    c2w = np.asarray(c2w, np.float64)
    bad = ~finite32(c2w).all(axis=(1, 2))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SceneError(f"{path}: frame {names[i]!r} has a non-finite pose (or one beyond float32's range); "
                         f"fix or drop the frame")
    r = c2w[:, :, :3]
    err = np.abs(np.einsum("nji,njk->nik", r, r) - np.eye(3)).max(axis=(1, 2))
    if (err > tol).any():
        i = int(np.argmax(err))
        raise SceneError(
            f"{path}: frame {names[i]!r} has a non-orthonormal rotation (max |R^T R - I| = {err[i]:.3g} > "
            f"{tol:g}); poses must be rigid camera-to-world transforms without scale"
        )
    det = np.linalg.det(r)
    if (det <= 0).any():
        i = int(np.flatnonzero(det <= 0)[0])
        raise SceneError(f"{path}: frame {names[i]!r} has a reflected (left-handed) rotation, det = {det[i]:.3g}")


def check_focal(intrinsics: np.ndarray, names: Sequence[str], path) -> None:
    """fx, fy must be finite and > 0; cx, cy finite. ``intrinsics`` (N, 4)."""
    k = np.asarray(intrinsics, np.float64)
    bad = ~finite32(k).all(axis=1) | (k[:, 0] <= 0) | (k[:, 1] <= 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SceneError(
            f"{path}: frame {names[i]!r} has invalid intrinsics fx={k[i, 0]:g} fy={k[i, 1]:g} cx={k[i, 2]:g} "
            f"cy={k[i, 3]:g}; focal lengths must be > 0"
        )


def visible_files(folder, suffixes: Sequence[str] = IMAGE_EXTENSIONS) -> list:
    """Sorted names of the entries of ``folder`` whose suffix (lower case) is one of ``suffixes``,
    hidden ones left out: a name starting with "." (macOS's ``._IMG_4026.JPG`` resource forks and
    ``.DS_Store``, editors' and sync tools' files) is never an image or record of the scene. A
    folder named like an image is kept, for :func:`check_images_exist` to name it as a folder.

    >>> visible_files("scene/images")      # beside ._IMG_0001.JPG and .DS_Store
    ['IMG_0001.JPG', 'IMG_0002.JPG']
    """
    return sorted(f for f in os.listdir(folder) if not f.startswith(".") and os.path.splitext(f)[1].lower() in suffixes)


def check_images_exist(paths: Sequence[str], source, what: str = "images") -> None:
    """Every path must be an existing file; the message lists the first few missing ones, else
    the first few that are folders (a folder is not reported as missing)."""
    bad = [p for p in paths if not os.path.isfile(p)]
    if not bad:
        return
    missing = [p for p in bad if not os.path.isdir(p)]
    found = missing or bad
    shown = ", ".join(str(m) for m in found[:3]) + (f" (+{len(found) - 3} more)" if len(found) > 3 else "")
    if missing:
        raise SceneError(f"{source}: {len(found)} of {len(paths)} {what} missing: {shown}; restore them or fix the file list")
    kind = "are folders, not image files" if len(found) > 1 else "is a folder, not an image file"
    raise SceneError(f"{source}: {len(found)} of {len(paths)} {what} {kind}: {shown}; fix the file list or put the "
                     f"image files there")


def check_sizes(wh: np.ndarray, names: Sequence[str], path) -> None:
    """Image sizes (N, 2) must be positive integers of at most the per-image pixel limit
    (:func:`dali_nerf.data.imageio.max_pixels_limit`), checked from the declaration alone, before any
    cache is sized from it (a declared 200000x200000 would otherwise ask for 447 GiB per 4
    images). Whether each file really has its declared size is checked from the headers by
    ``decode_cache`` and ``dali-nerf validate``."""
    wh = np.asarray(wh)
    bad = (wh <= 0).any(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SceneError(f"{path}: frame {names[i]!r} declares image size {wh[i, 0]}x{wh[i, 1]}; must be > 0")
    px = wh[:, 0].astype(np.int64) * wh[:, 1].astype(np.int64)
    over = px > max_pixels_limit()
    if over.any():
        i = int(np.flatnonzero(over)[0])
        check_pixel_limit(f"{path}: frame {names[i]!r}", wh[i, 0], wh[i, 1], what="declares image size")


def downscaled_size(wh: np.ndarray, d: int) -> np.ndarray:
    """(N, 2) int64 sizes floor(w / d), floor(h / d), at least 1."""
    return np.maximum(np.asarray(wh, np.int64) // int(d), 1)


def scale_intrinsics(k: np.ndarray, wh_old: np.ndarray, wh_new: np.ndarray) -> np.ndarray:
    """Intrinsics (N, 4) fx, fy, cx, cy of images resized from ``wh_old`` (N, 2) to ``wh_new``
    (N, 2): x scaled by w_new / w_old, y by h_new / h_old (exact for a resize that maps the image
    rectangle onto the new one, with +0.5 pixel centres)."""
    k = np.asarray(k, np.float64).copy()
    s = np.asarray(wh_new, np.float64) / np.asarray(wh_old, np.float64)
    k[:, 0] *= s[:, 0]
    k[:, 2] *= s[:, 0]
    k[:, 1] *= s[:, 1]
    k[:, 3] *= s[:, 1]
    return k


def prescaled_paths(paths: Sequence[str], d: int) -> Optional[list]:
    """The paths of a pre-downscaled copy (``<folder>_<d>/<name>``, the nerfstudio / LLFF layout)
    when ``d`` > 1 and *every* such file exists; else None (the decoder resizes)."""
    if d <= 1:
        return None
    out = []
    for p in paths:
        p = Path(p)
        q = p.parent.parent / f"{p.parent.name}_{d}" / p.name
        if not q.is_file():
            return None
        out.append(str(q))
    return out


def prescaled_sizes(paths: Sequence[str], wh_full: np.ndarray) -> np.ndarray:
    """On-disk sizes of pre-downscaled images: the header of the first image of each group of
    equal full-resolution size (one header read per distinct size)."""
    wh_full = np.asarray(wh_full, np.int64)
    out = np.zeros_like(wh_full)
    seen: dict = {}
    for i, p in enumerate(paths):
        key = (int(wh_full[i, 0]), int(wh_full[i, 1]))
        if key not in seen:
            h = read_header(p)
            seen[key] = (h.width, h.height)
        out[i] = seen[key]
    return out


def resolve_downscale(paths: list, k_full: np.ndarray, wh_full: np.ndarray, d: int):
    """Apply ``downscale`` d to images of full-resolution sizes ``wh_full`` (N, 2) and
    intrinsics ``k_full`` (N, 4).

    Returns:
        paths (N,) (the pre-downscaled copies when they all exist), intrinsics (N, 4) scaled by
        the exact ratio, sizes (N, 2) int64 the scene uses, file sizes (N, 2) int64 on disk.
    """
    wh_full = np.asarray(wh_full, np.int64)
    if d <= 1:
        return list(paths), np.asarray(k_full, np.float64), wh_full, wh_full
    pre = prescaled_paths(paths, d)
    if pre is not None:
        wh = prescaled_sizes(pre, wh_full)
        return pre, scale_intrinsics(k_full, wh_full, wh), wh, wh
    wh = downscaled_size(wh_full, d)
    return list(paths), scale_intrinsics(k_full, wh_full, wh), wh, wh_full


def resolve_masks(mask_paths: Sequence[str], wh_full: np.ndarray, file_wh: np.ndarray, d: int, source):
    """The mask files of a split and their declared sizes, after ``downscale`` d.

    Masks go with the image files the scene reads: at d = 1, or when the decode downscales the
    full-resolution images, the masks at full resolution; when the scene reads pre-downscaled
    images (``file_wh`` differs from ``wh_full``), the pre-downscaled masks ``masks_<d>/<name>``
    (nerfstudio's layout) when they all exist, with their header sizes, else the full-resolution
    masks (resized nearest-neighbour at decode). Every file must exist (one line naming them).

    Returns:
        (paths (N,), mask_wh (N, 2) int64).
    """
    check_images_exist(mask_paths, source, "masks")
    wh_full = np.asarray(wh_full, np.int64)
    if d > 1 and not np.array_equal(np.asarray(file_wh), wh_full):
        pre = prescaled_paths(mask_paths, d)
        if pre is not None:
            return pre, prescaled_sizes(pre, wh_full)
    return list(mask_paths), wh_full.copy()


def image_path(root: Path, rel: str, default_ext: str = ".png") -> str:
    """Absolute path of an image named relative to ``root``; ``default_ext`` is appended when the
    name has no image extension and the name itself is not an existing file (Blender style)."""
    p = (root / rel).resolve() if not os.path.isabs(rel) else Path(rel)
    if p.suffix.lower() not in IMAGE_EXTENSIONS and not p.is_file():
        p = p.with_name(p.name + default_ext)
    return str(p)


def mean_up(c2w: np.ndarray) -> np.ndarray:
    """Unit mean of the cameras' up vectors (column 1 of OpenGL c2w (N, 3, 4)); (0, 1, 0) when
    they cancel."""
    u = np.asarray(c2w, np.float64)[:, :, 1].sum(axis=0)
    n = np.linalg.norm(u)
    return u / n if n > 1e-9 else np.array([0.0, 1.0, 0.0])


def parse_aabb(v, path, key: str = "aabb") -> np.ndarray:
    """(2, 3) min/max corners from a JSON value, min < max, else a SceneError naming the key."""
    a = as_matrix(v, (2, 3), key, path)
    if not finite32(a).all() or (a[0] >= a[1]).any():
        raise SceneError(f"{path}: key {key!r} must be [[xmin, ymin, zmin], [xmax, ymax, zmax]] with min < max")
    return a


def check_bounds(near: np.ndarray, far: np.ndarray, names: Sequence[str], path) -> None:
    """Per-image bounds (N,) must be finite with 0 <= near < far."""
    near = np.asarray(near, np.float64)
    far = np.asarray(far, np.float64)
    bad = ~finite32(near) | ~finite32(far) | (near < 0) | (far <= near)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SceneError(f"{path}: frame {names[i]!r} has invalid bounds near={near[i]:g} far={far[i]:g}; need 0 <= near < far")


def undistorted_intrinsics(k: np.ndarray, dist: np.ndarray, fisheye: bool, wh) -> np.ndarray:
    """(4,) float64 fx, fy, cx, cy of the undistorted image of the same size ``wh`` (w, h) as a
    distorted camera ``k`` (4,) with OpenCV coefficients ``dist`` (8,).

    The rule (alpha = 0, "every output pixel valid"): perspective
    ``cv2.getOptimalNewCameraMatrix(K, dist, wh, alpha=0)``; fisheye
    ``cv2.fisheye.estimateNewCameraMatrixForUndistortRectify(K, dist[:4], wh, I, balance=0)``.
    The new camera sees only points the distorted image saw, so the undistorted image has no
    invalid (black) border for the field to learn, at the cost of the periphery that falls outside
    the inner rectangle. Keeping the pinhole K instead (nerfstudio's choice for ray-based models,
    which distort rays rather than images) leaves unseen corners under barrel distortion (a
    scene's masks are undistorted with nearest-neighbour and mask such corners, but unmasked
    scenes have none).
    """
    kk = opencv_matrix(k)
    size = (int(wh[0]), int(wh[1]))
    d = np.asarray(dist, np.float64)
    if fisheye:
        new = cv2.fisheye.estimateNewCameraMatrixForUndistortRectify(kk, d[:4].reshape(4, 1), size, np.eye(3), balance=0.0)
    else:
        new, _ = cv2.getOptimalNewCameraMatrix(kk, d, size, 0.0, size)
    return np.array([new[0, 0], new[1, 1], new[0, 2] + 0.5, new[1, 2] + 0.5], np.float64)


def lens_arrays(k_full, wh_full, file_wh, wh, dist, fisheye):
    """The lens fields of a Scene from full-resolution intrinsics ``k_full`` (N, 4) at ``wh_full``
    (N, 2), the files' sizes ``file_wh``, the scene's sizes ``wh``, OpenCV coefficients ``dist``
    (N, 8) and ``fisheye`` (N,): None when no image is distorted; else (intrinsics (N, 4) of the
    undistorted images at ``wh`` (:func:`undistorted_intrinsics` at the file size, then scaled),
    distortion (N, 8), fisheye (N,), file intrinsics (N, 4) at ``file_wh``)."""
    if not (np.any(dist != 0) or fisheye.any()):
        return None
    k_file = scale_intrinsics(k_full, wh_full, file_wh)  # the distorted camera of the files read
    k_und = k_file.copy()
    for i in np.flatnonzero(np.any(dist != 0, axis=1) | fisheye):
        k_und[i] = undistorted_intrinsics(k_file[i], dist[i], bool(fisheye[i]), file_wh[i])
    return scale_intrinsics(k_und, file_wh, wh), dist, fisheye, k_file


def opencv_matrix(k) -> np.ndarray:
    """(3, 3) float64 OpenCV camera matrix of intrinsics ``k`` (4,) fx, fy, cx, cy in our
    convention (pixel centres at +0.5, as COLMAP and nerfstudio): OpenCV puts pixel centres at
    integers, so its principal point is ``cx - 0.5, cy - 0.5``."""
    return np.array([[k[0], 0.0, k[2] - 0.5], [0.0, k[1], k[3] - 0.5], [0.0, 0.0, 1.0]], np.float64)


def resolve_background(background, fmt: str, first_image: Optional[str] = None):
    """``scene.background`` -> (colour (3,) float tuple, ``Scene.background_mode``).

    Args:
        background: None or "auto" (per format), "white", "black", "random", "learned", or 3
            numbers in [0, 1] (a fixed colour).
        fmt: the scene's format name.
        first_image: the split's first image (its header decides "auto" for non-Blender formats).
    Returns:
        ((r, g, b), mode). "auto": Blender -> white; any other format -> white when the first
        image has alpha (it is composited, as before), else "learned" (an RGB capture: nothing to
        composite; the colour, white, is the learned colour's initial value).
    Raises:
        SceneError: anything else, one line naming ``background``.
    """
    if background is None:
        background = "auto"
    if isinstance(background, str):
        name = background.strip().lower()
        if name == "auto":
            if fmt == "blender" or first_image is None:
                return BACKGROUND_NAMES["white"]
            alpha = read_header(first_image).channels in (2, 4)
            return BACKGROUND_NAMES["white" if alpha else "learned"]
        if name in BACKGROUND_NAMES:
            return BACKGROUND_NAMES[name]
    else:
        try:
            rgb = tuple(float(b) for b in background)
        except (TypeError, ValueError):
            rgb = ()
        if len(rgb) == 3 and all(0.0 <= b <= 1.0 for b in rgb):
            return rgb, "color"
    raise SceneError(
        f"background={background!r}: use auto, {', '.join(BACKGROUND_NAMES)} or 3 numbers in [0, 1] (RGB)"
    )
