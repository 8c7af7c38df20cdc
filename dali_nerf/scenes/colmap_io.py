"""COLMAP sparse models on disk: ``cameras``, ``images`` and ``points3D``, binary (``.bin``) or
text (``.txt``), read and written (our own reader; tests/test_colmap.py checks it against
``pycolmap``, COLMAP's official bindings, in both directions).

The formats are COLMAP's (``colmap/scene/reconstruction_io.cc``), little-endian:

* ``cameras.bin``: uint64 count; per camera int32 id, int32 model id, uint64 width, uint64 height,
  float64 params[model's count]. Text: ``CAMERA_ID MODEL WIDTH HEIGHT PARAMS...``.
* ``images.bin``: uint64 count; per image uint32 id, float64 qw qx qy qz (world-to-camera
  rotation), float64 tx ty tz, uint32 camera id, the name (NUL-terminated), uint64 number of 2-D
  points, then per point float64 x, y and int64 point3D id (-1: none). Text: two lines per image,
  ``IMAGE_ID QW QX QY QZ TX TY TZ CAMERA_ID NAME`` and ``X Y POINT3D_ID ...``.
* ``points3D.bin``: uint64 count; per point uint64 id, float64 x y z, uint8 r g b, float64 error,
  uint64 track length, then per element uint32 image id, uint32 point2D index. Text:
  ``POINT3D_ID X Y Z R G B ERROR (IMAGE_ID POINT2D_IDX)...``.

Every malformed file is a :class:`~dali_nerf.errors.SceneError` of one line naming the file (and
the record). Observations (2-D points, tracks) are skipped on read: nothing here uses them.

>>> model = read_model("data/garden/sparse/0")
>>> model.cameras[1].model, len(model.images), model.xyz.shape
('PINHOLE', 185, (138766, 3))
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import numpy as np

from dali_nerf.errors import SceneError

__all__ = ["MODELS", "ColmapCamera", "ColmapImage", "ColmapModel", "read_model", "write_model", "model_files",
           "rotation_from_quaternion", "quaternion_from_rotation"]

#: COLMAP's camera models: name -> (model id, number of parameters) (colmap/sensor/models.h).
MODELS = {
    "SIMPLE_PINHOLE": (0, 3), "PINHOLE": (1, 4), "SIMPLE_RADIAL": (2, 4), "RADIAL": (3, 5), "OPENCV": (4, 8),
    "OPENCV_FISHEYE": (5, 8), "FULL_OPENCV": (6, 12), "FOV": (7, 5), "SIMPLE_RADIAL_FISHEYE": (8, 4),
    "RADIAL_FISHEYE": (9, 5), "THIN_PRISM_FISHEYE": (10, 12), "RAD_TAN_THIN_PRISM_FISHEYE": (11, 16),
    "SIMPLE_DIVISION": (12, 4), "DIVISION": (13, 5), "SIMPLE_FISHEYE": (14, 3), "FISHEYE": (15, 4), "EUCM": (16, 6),
    "EQUIRECTANGULAR": (17, 2),
}
_BY_ID = {i: (name, n) for name, (i, n) in MODELS.items()}
_KINDS = ("cameras", "images", "points3D")


@dataclass(frozen=True)
class ColmapCamera:
    """One COLMAP camera: ``model`` name, ``width`` and ``height`` in pixels, ``params`` (K,) float64."""

    id: int
    model: str
    width: int
    height: int
    params: np.ndarray


@dataclass(frozen=True)
class ColmapImage:
    """One registered image: world-to-camera rotation ``qvec`` (w, x, y, z) and translation
    ``tvec``, its camera's id and its ``name`` (relative to the image folder)."""

    id: int
    qvec: np.ndarray
    tvec: np.ndarray
    camera_id: int
    name: str


@dataclass
class ColmapModel:
    """A sparse model: cameras by id, images in file order, points (M,) in file order."""

    cameras: Dict[int, ColmapCamera] = field(default_factory=dict)
    images: List[ColmapImage] = field(default_factory=list)
    point_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    xyz: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.float64))
    rgb: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.uint8))
    error: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))


def rotation_from_quaternion(q) -> np.ndarray:
    """(3, 3) float64 rotation of a unit quaternion (w, x, y, z), in the operation order of
    Eigen's ``Quaternion::toRotationMatrix`` (what COLMAP and pycolmap compute: the same bits,
    tests/test_colmap.py). A quaternion off unit length by more than 1e-9 is normalised first
    (COLMAP writes unit ones; normalising those would change their last bits)."""
    q = np.asarray(q, np.float64)
    n = float(np.sqrt(np.sum(q * q)))
    w, x, y, z = q / n if abs(n - 1.0) > 1e-9 else q
    tx, ty, tz = 2.0 * x, 2.0 * y, 2.0 * z
    twx, twy, twz = tx * w, ty * w, tz * w
    txx, txy, txz = tx * x, ty * x, tz * x
    tyy, tyz, tzz = ty * y, tz * y, tz * z
    return np.array([[1.0 - (tyy + tzz), txy - twz, txz + twy],
                     [txy + twz, 1.0 - (txx + tzz), tyz - twx],
                     [txz - twy, tyz + twx, 1.0 - (txx + tyy)]], np.float64)


def quaternion_from_rotation(r) -> np.ndarray:
    """(4,) float64 unit quaternion (w, x, y, z) with w >= 0 of a (3, 3) rotation (Shepperd's
    method: the largest of w, x, y, z is computed first, so no branch loses precision)."""
    m = np.asarray(r, np.float64)
    tr = m[0, 0] + m[1, 1] + m[2, 2]
    i = int(np.argmax([tr, m[0, 0], m[1, 1], m[2, 2]]))
    if i == 0:
        s = 2.0 * np.sqrt(1.0 + tr)
        q = [0.25 * s, (m[2, 1] - m[1, 2]) / s, (m[0, 2] - m[2, 0]) / s, (m[1, 0] - m[0, 1]) / s]
    elif i == 1:
        s = 2.0 * np.sqrt(1.0 + m[0, 0] - m[1, 1] - m[2, 2])
        q = [(m[2, 1] - m[1, 2]) / s, 0.25 * s, (m[0, 1] + m[1, 0]) / s, (m[0, 2] + m[2, 0]) / s]
    elif i == 2:
        s = 2.0 * np.sqrt(1.0 + m[1, 1] - m[0, 0] - m[2, 2])
        q = [(m[0, 2] - m[2, 0]) / s, (m[0, 1] + m[1, 0]) / s, 0.25 * s, (m[1, 2] + m[2, 1]) / s]
    else:
        s = 2.0 * np.sqrt(1.0 + m[2, 2] - m[0, 0] - m[1, 1])
        q = [(m[1, 0] - m[0, 1]) / s, (m[0, 2] + m[2, 0]) / s, (m[1, 2] + m[2, 1]) / s, 0.25 * s]
    q = np.array(q, np.float64)
    q /= np.linalg.norm(q)
    return q if q[0] >= 0 else -q


def model_files(folder) -> tuple:
    """``(format, {kind: path})`` of the sparse model in ``folder``: "bin" when cameras.bin,
    images.bin and points3D.bin all exist, else "txt" when the three .txt do; else a SceneError
    naming what is missing."""
    folder = Path(folder)
    for ext in ("bin", "txt"):
        paths = {k: folder / f"{k}.{ext}" for k in _KINDS}
        if all(p.is_file() for p in paths.values()):
            return ext, paths
    have = sorted(p.name for p in folder.glob("*") if p.stem in _KINDS) if folder.is_dir() else []
    raise SceneError(f"{folder}: not a COLMAP sparse model (need cameras, images and points3D, all .bin or all .txt; "
                     f"found {', '.join(have) or 'none'}); export the model with `colmap model_converter`")


# ---------------------------------------------------------------------------------------------
# binary


class _Reader:
    def __init__(self, path: Path):
        self.path = path
        try:
            self.data = path.read_bytes()
        except OSError as e:
            raise SceneError(f"{path}: cannot read ({e.strerror or e})") from None
        self.pos = 0

    def take(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if self.pos + n > len(self.data):
            raise SceneError(f"{self.path}: truncated at byte {self.pos} ({what}); re-export the model")
        out = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return out

    def skip(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or self.pos + nbytes > len(self.data):
            raise SceneError(f"{self.path}: truncated at byte {self.pos} ({what}); re-export the model")
        self.pos += nbytes

    def name(self, what: str) -> str:
        end = self.data.find(b"\0", self.pos)
        if end < 0:
            raise SceneError(f"{self.path}: truncated at byte {self.pos} ({what}: unterminated name)")
        raw, self.pos = self.data[self.pos:end], end + 1
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SceneError(f"{self.path}: {what} has a name that is not UTF-8; rename the image") from None


def _count(r: _Reader, per_item_min: int, what: str) -> int:
    (n,) = r.take("<Q", f"number of {what}")
    if n * per_item_min > len(r.data) - r.pos:
        raise SceneError(f"{r.path}: declares {n} {what} but holds far fewer bytes; the file is corrupt")
    return n


def _read_cameras_bin(path: Path) -> Dict[int, ColmapCamera]:
    r = _Reader(path)
    out = {}
    for i in range(_count(r, 24, "cameras")):
        cid, mid, w, h = r.take("<iiQQ", f"camera {i}")
        if mid not in _BY_ID:
            raise SceneError(f"{path}: camera {cid} has an unknown model id {mid}; convert it to a known COLMAP model")
        name, n = _BY_ID[mid]
        out[cid] = ColmapCamera(cid, name, int(w), int(h), np.array(r.take(f"<{n}d", f"camera {cid} params"), np.float64))
    return out


def _read_images_bin(path: Path) -> List[ColmapImage]:
    r = _Reader(path)
    out = []
    for i in range(_count(r, 68, "images")):
        vals = r.take("<I7dI", f"image {i}")
        name = r.name(f"image {vals[0]}")
        (npts,) = r.take("<Q", f"image {vals[0]} number of points")
        r.skip(24 * npts, f"image {vals[0]} points")
        out.append(ColmapImage(vals[0], np.array(vals[1:5], np.float64), np.array(vals[5:8], np.float64), vals[8], name))
    return out


def _read_points_bin(path: Path, model: ColmapModel) -> None:
    r = _Reader(path)
    n = _count(r, 43, "points")
    ids, xyz, rgb, err = np.zeros(n, np.int64), np.zeros((n, 3)), np.zeros((n, 3), np.uint8), np.zeros(n)
    for i in range(n):
        v = r.take("<Q3d3BdQ", f"point {i}")
        ids[i], xyz[i], rgb[i], err[i] = v[0], v[1:4], v[4:7], v[7]
        r.skip(8 * v[8], f"point {v[0]} track")
    model.point_ids, model.xyz, model.rgb, model.error = ids, xyz, rgb, err


# ---------------------------------------------------------------------------------------------
# text


def _lines(path: Path):
    """(line number, fields) of the non-comment lines; images.txt's empty 2-D point lines kept."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SceneError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise SceneError(f"{path}: not UTF-8 text; re-export the model") from None
    for no, line in enumerate(text.splitlines(), 1):
        if not line.startswith("#"):
            yield no, line.split()


def _num(path: Path, no: int, v: str, kind=float):
    try:
        return kind(v)
    except ValueError:
        raise SceneError(f"{path}:{no}: {v!r} is not a{'n integer' if kind is int else ' number'}; fix the line") from None


def _read_cameras_txt(path: Path) -> Dict[int, ColmapCamera]:
    out = {}
    for no, f in _lines(path):
        if not f:
            continue
        if len(f) < 4 or f[1] not in MODELS:
            raise SceneError(f"{path}:{no}: expected CAMERA_ID MODEL WIDTH HEIGHT PARAMS with a COLMAP model, got "
                             f"{' '.join(f[:4])!r}")
        n = MODELS[f[1]][1]
        if len(f) != 4 + n:
            raise SceneError(f"{path}:{no}: camera model {f[1]} takes {n} parameters, the line has {len(f) - 4}")
        cid = _num(path, no, f[0], int)
        out[cid] = ColmapCamera(cid, f[1], _num(path, no, f[2], int), _num(path, no, f[3], int),
                                np.array([_num(path, no, v) for v in f[4:]], np.float64))
    return out


def _read_images_txt(path: Path) -> List[ColmapImage]:
    out, header = [], True
    for no, f in _lines(path):
        if not header:  # the 2-D points line (possibly empty) after each image line
            header = True
            continue
        if not f:
            continue
        if len(f) < 10:
            raise SceneError(f"{path}:{no}: expected IMAGE_ID QW QX QY QZ TX TY TZ CAMERA_ID NAME")
        vals = [_num(path, no, v) for v in f[1:8]]
        out.append(ColmapImage(_num(path, no, f[0], int), np.array(vals[:4]), np.array(vals[4:7]),
                               _num(path, no, f[8], int), f[9]))  # COLMAP reads one token: no spaces
        header = False
    return out


def _read_points_txt(path: Path, model: ColmapModel) -> None:
    ids, xyz, rgb, err = [], [], [], []
    for no, f in _lines(path):
        if not f:
            continue
        if len(f) < 8 or (len(f) - 8) % 2:
            raise SceneError(f"{path}:{no}: expected POINT3D_ID X Y Z R G B ERROR (IMAGE_ID POINT2D_IDX)...")
        ids.append(_num(path, no, f[0], int))
        xyz.append([_num(path, no, v) for v in f[1:4]])
        c = [_num(path, no, v, int) for v in f[4:7]]
        if not all(0 <= v <= 255 for v in c):
            raise SceneError(f"{path}:{no}: colour {c} is outside 0..255")
        rgb.append(c)
        err.append(_num(path, no, f[7]))
    model.point_ids = np.array(ids, np.int64)
    model.xyz = np.array(xyz, np.float64).reshape(-1, 3)
    model.rgb = np.array(rgb, np.uint8).reshape(-1, 3)
    model.error = np.array(err, np.float64)


def read_model(folder) -> ColmapModel:
    """The sparse model in ``folder`` (``.bin`` preferred, else ``.txt``: :func:`model_files`).

    Returns:
        :class:`ColmapModel` (cameras by id; images and points in file order).
    Raises:
        SceneError: a file missing, truncated, malformed, an unknown model, or an image whose
            camera is not in cameras (one line naming the file).
    """
    ext, paths = model_files(folder)
    model = ColmapModel()
    if ext == "bin":
        model.cameras = _read_cameras_bin(paths["cameras"])
        model.images = _read_images_bin(paths["images"])
        _read_points_bin(paths["points3D"], model)
    else:
        model.cameras = _read_cameras_txt(paths["cameras"])
        model.images = _read_images_txt(paths["images"])
        _read_points_txt(paths["points3D"], model)
    for im in model.images:
        if im.camera_id not in model.cameras:
            raise SceneError(f"{paths['images']}: image {im.name!r} names camera {im.camera_id}, which "
                             f"{paths['cameras'].name} does not have; re-export the model")
    return model


# ---------------------------------------------------------------------------------------------
# writing (the scene generator; tests)


def _write_bin(folder: Path, model: ColmapModel) -> None:
    buf = [struct.pack("<Q", len(model.cameras))]
    for c in model.cameras.values():
        mid, n = MODELS[c.model]
        buf.append(struct.pack(f"<iiQQ{n}d", c.id, mid, c.width, c.height, *np.asarray(c.params, np.float64)))
    (folder / "cameras.bin").write_bytes(b"".join(buf))
    buf = [struct.pack("<Q", len(model.images))]
    for im in model.images:
        buf.append(struct.pack("<I7dI", im.id, *im.qvec, *im.tvec, im.camera_id) + im.name.encode() + b"\0")
        buf.append(struct.pack("<Q", 0))
    (folder / "images.bin").write_bytes(b"".join(buf))
    buf = [struct.pack("<Q", len(model.point_ids))]
    for i in range(len(model.point_ids)):
        buf.append(struct.pack("<Q3d3BdQ", int(model.point_ids[i]), *model.xyz[i], *(int(v) for v in model.rgb[i]),
                               float(model.error[i]), 0))
    (folder / "points3D.bin").write_bytes(b"".join(buf))


def _write_txt(folder: Path, model: ColmapModel) -> None:
    lines = ["# Camera list with one line of data per camera:",
             "#   CAMERA_ID, MODEL, WIDTH, HEIGHT, PARAMS[]"]
    lines += [f"{c.id} {c.model} {c.width} {c.height} " + " ".join(repr(float(p)) for p in c.params)
              for c in model.cameras.values()]
    (folder / "cameras.txt").write_text("\n".join(lines) + "\n")
    lines = ["# Image list with two lines of data per image:",
             "#   IMAGE_ID, QW, QX, QY, QZ, TX, TY, TZ, CAMERA_ID, NAME", "#   POINTS2D[] as (X, Y, POINT3D_ID)"]
    for im in model.images:
        lines += [f"{im.id} " + " ".join(repr(float(v)) for v in (*im.qvec, *im.tvec)) + f" {im.camera_id} {im.name}", ""]
    (folder / "images.txt").write_text("\n".join(lines) + "\n")
    lines = ["# 3D point list with one line of data per point:",
             "#   POINT3D_ID, X, Y, Z, R, G, B, ERROR, TRACK[] as (IMAGE_ID, POINT2D_IDX)"]
    lines += [f"{int(model.point_ids[i])} " + " ".join(repr(float(v)) for v in model.xyz[i]) + " "
              + " ".join(str(int(v)) for v in model.rgb[i]) + f" {float(model.error[i])!r}"
              for i in range(len(model.point_ids))]
    (folder / "points3D.txt").write_text("\n".join(lines) + "\n")


def write_model(folder, model: ColmapModel, fmt: str = "bin") -> Path:
    """Write ``model`` into ``folder`` (created) as ``.bin`` or ``.txt`` files; no observations
    (images without 2-D points, points with empty tracks). Returns ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "bin":
        _write_bin(folder, model)
    elif fmt == "txt":
        _write_txt(folder, model)
    else:
        raise ValueError(f"fmt={fmt!r}: use bin or txt")
    return folder
