"""Exposure from the EXIF of a capture's JPEGs, as gsplat's ``load_exposure`` computes it (its
``examples/exif.py`` read at commit 11909fc, ``datasets/colmap.py`` at 0714fc6; docs/SPLATTING.md),
for the ``exposure`` of image batches.

Per image, from the Exif IFD of the *original* file (``images/<name>``: PNG holds no EXIF):
shutter seconds = ExposureTime, else 2^-ShutterSpeedValue; f-number = FNumber, else
2^(ApertureValue / 2); ISO = PhotographicSensitivity, else RecommendedExposureIndex, else
StandardOutputSensitivity, else ISOSpeed; a missing one counts as 1, none at all (or no EXIF, or a
non-positive product) gives no value. EV = log2(seconds / f^2 x ISO); the batch's ``exposure`` is
the image's EV minus the mean EV over every image of the capture that has one (all splits).

Read with a small reader of our own (JPEG APP1 ``Exif`` -> TIFF IFD0 -> the Exif IFD; either byte
order), so exposure needs no new dependency; tested against Pillow's reader where it is installed.
An EXIF block that cannot be read gives no value, like a file without one.

>>> scene = with_exposure(load_scene("data/garden", "train", format="colmap", downscale=4))
>>> scene.exposure[:3]            # EV relative to the capture's mean; NaN where an image has none
"""

from __future__ import annotations

import dataclasses
import math
import struct
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from dali_nerf.errors import SceneError

__all__ = ["read_exif", "exposure_ev", "with_exposure"]

EXPOSURE_TIME, FNUMBER, SHUTTER_SPEED, APERTURE = 33434, 33437, 37377, 37378
ISO_TAGS = (34855, 34858, 34857, 34859)  # gsplat's order: sensitivity, REI, SOS, ISO speed
EXIF_IFD = 34665
_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8}


def _app1_exif(data: bytes) -> Optional[bytes]:
    """The TIFF block of a JPEG's APP1 ``Exif`` segment, or None (not a JPEG, no such segment)."""
    if data[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker in (0xD9, 0xDA):  # end of image, start of scan: no metadata after these
            return None
        size = struct.unpack(">H", data[i + 2:i + 4])[0]
        if marker == 0xE1 and data[i + 4:i + 10] == b"Exif\x00\x00":
            return data[i + 10:i + 2 + size]
        i += 2 + size
    return None


def _ifd(tiff: bytes, offset: int, order: str) -> Dict[int, object]:
    """Tag -> first value of the IFD at ``offset`` (numbers only: RATIONAL as a float)."""
    (n,) = struct.unpack(order + "H", tiff[offset:offset + 2])
    out = {}
    for k in range(n):
        e = offset + 2 + 12 * k
        tag, typ, count = struct.unpack(order + "HHI", tiff[e:e + 8])
        size = _SIZES.get(typ)
        if size is None or count < 1:
            continue
        where = e + 8 if size * count <= 4 else struct.unpack(order + "I", tiff[e + 8:e + 12])[0]
        raw = tiff[where:where + size]
        if len(raw) < size:
            raise ValueError("a value past the block")
        if typ in (5, 10):
            num, den = struct.unpack(order + ("II" if typ == 5 else "ii"), raw)
            out[tag] = num / den if den else float("nan")
        elif typ in (3, 8):
            out[tag] = struct.unpack(order + ("H" if typ == 3 else "h"), raw)[0]
        elif typ in (4, 9):
            out[tag] = struct.unpack(order + ("I" if typ == 4 else "i"), raw)[0]
        elif typ in (11, 12):
            out[tag] = struct.unpack(order + ("f" if typ == 11 else "d"), raw)[0]
    return out


def read_exif(path) -> Dict[int, object]:
    """The Exif IFD's numeric tags of the JPEG ``path`` ({} without EXIF, or where it cannot be read)."""
    with open(path, "rb") as f:
        head = f.read(1 << 17)  # APP1 comes first and holds at most 64 KiB
    tiff = _app1_exif(head)
    if not tiff or tiff[:2] not in (b"II", b"MM"):
        return {}
    order = "<" if tiff[:2] == b"II" else ">"
    try:
        (ifd0,) = struct.unpack(order + "I", tiff[4:8])
        sub = _ifd(tiff, ifd0, order).get(EXIF_IFD)
        return _ifd(tiff, int(sub), order) if isinstance(sub, int) else {}
    except (struct.error, ValueError):
        return {}


def _positive(v) -> Optional[float]:
    v = float(v)
    return v if v > 0.0 and math.isfinite(v) else None


def exposure_ev(path) -> Optional[float]:
    """log2(seconds / f^2 x ISO) of one image (the module doc's rule), or None."""
    tags = read_exif(path)
    seconds = _positive(tags[EXPOSURE_TIME]) if EXPOSURE_TIME in tags else None
    if seconds is None and SHUTTER_SPEED in tags:
        seconds = _positive(2.0 ** -float(tags[SHUTTER_SPEED]))
    f = _positive(tags[FNUMBER]) if FNUMBER in tags else None
    if f is None and APERTURE in tags:
        f = _positive(2.0 ** (float(tags[APERTURE]) / 2.0))
    iso = next((_positive(tags[t]) for t in ISO_TAGS if t in tags and _positive(tags[t])), None)
    if seconds is None and f is None and iso is None:
        return None
    rel = (seconds or 1.0) / (f or 1.0) ** 2 * (iso or 1.0)
    return math.log2(rel) if rel > 0.0 and math.isfinite(rel) else None


def with_exposure(scene):
    """``scene`` (a COLMAP split) with ``exposure``: each image's EV minus the mean over every image
    of the capture with one (NaN where an image has none); the originals ``images/<name>`` are read,
    whatever folder the split decodes (gsplat's rule). Raises SceneError for another format."""
    if scene.format != "colmap":
        raise SceneError(f"{scene.root}: exposure from EXIF is read for COLMAP scenes, not {scene.format!r}; "
                         f"set scene.exposure: false")
    from dali_nerf.scenes.colmap import capture_model, split_indices  # the parser's own model and split

    root = Path(scene.root)
    names = sorted(im.name for im in capture_model(root).images)
    ev = np.array([np.nan if (e := exposure_ev(root / "images" / n)) is None else e for n in names], np.float64)
    idx = split_indices(len(names), scene.split)
    if len(idx) != scene.num_images:  # pragma: no cover - a split this module does not know
        raise SceneError(f"{root}: {scene.num_images} images in the split, {len(idx)} by the COLMAP split rule")
    rel = ev - np.nanmean(ev) if np.isfinite(ev).any() else ev
    return dataclasses.replace(scene, exposure=rel[idx].astype(np.float32))
