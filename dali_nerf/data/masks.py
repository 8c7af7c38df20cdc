"""Per-pixel masks: read, finished like their images, counted, and packed for the ray sampler.

A scene may carry one mask per image (``Scene.mask_paths``; nerfstudio's ``mask_path``, COLMAP
``masks/`` folders): a single-channel image, 0 = ignore the pixel, anything else = keep it (as
nerfstudio reads it). The decode finishes each mask with its image (:func:`finish_mask`):
resized nearest-neighbour (``cv2.INTER_NEAREST_EXACT``, PIL's ``NEAREST``, which nerfstudio uses)
to the image file's size, undistorted with the image (``cv2.remap`` nearest, pixels whose source
falls outside the file masked: the undistortion border is never trained on), then resized
nearest-neighbour to the declared image size. The cache keeps one bit per pixel plus a small
directory (:func:`valid_index`, the op's ``valid`` input, about 1.5 bits a pixel) and the valid
pixels of each image; the streams draw among valid pixels only.

Every rank needs the split's valid-pixel counts (a global stream's ``global_pixels`` and a rank's
``shard_begin``; every rank's epoch length): :func:`valid_counts` decodes the split's masks once
per process (a single-channel decode each, no image) with the same :func:`load_mask` the cache
uses, so the counts and the cache agree exactly.

>>> idx = valid_index(np.array([0, 1, 1, 0, 1], bool))
>>> idx.dtype, len(idx) == index_length(5, 3)
(dtype('uint64'), True)
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Optional

import cv2
import numpy as np

from dali_nerf.data.imageio import check_image
from dali_nerf.errors import DataError

__all__ = ["valid_index", "index_length", "index_counts", "unpack_valid", "valid_pixel_ids", "select_reference",
           "check_mask_file", "read_mask", "finish_mask", "load_mask", "valid_counts", "stream_sizes", "LINE", "SAMPLE"]

LINE = 384
"""Pixels per line of the valid-pixel index (6 words of bits and their rank directory: 64 bytes)."""
SAMPLE = 256
"""Valid pixels between two select samples of the index."""


def index_length(P: int, V: int) -> int:
    """Words of the valid-pixel index of P pixels, V of them valid: 9 nb + 13 + 2 (ns + 1)."""
    nb, ns = -(-P // LINE), -(-V // SAMPLE)
    return 9 * nb + 13 + 2 * (ns + 1)


def valid_index(valid: np.ndarray) -> np.ndarray:
    """The op's ``valid`` input for a cache whose pixel ``p`` is valid iff ``valid[p]``.

    Layout (uint64, ``dali_nerf/ops/csrc/mask.h``): with nb = ceil(P / 384) lines and
    ns = ceil(V / 256): nb lines of 8 words (the valid pixels before the line; the valid pixels of
    its words 0..k-1 for k = 0..5 in 9-bit fields at bit 9 k, field 6 = 511; its 6 words of bits, bit j
    of word w = pixel 384 b + 64 w + j), a sentinel line whose first word is V, the lines' first
    words again (nb + 1 words, contiguous) and 4 more words of V, then the select samples (ns + 1
    of 2 words: the line lo of every 256th valid pixel, bit 63 set when the next sample's line is
    more than 4 lines further, and the next 4 lines' counts minus 256 j in 16-bit fields, at most
    65535; then the line of the last valid pixel and 0). The lines start on a 64-byte boundary
    (one cache line each).

    Args:
        valid: (P,) bool (any shape: flattened row-major).
    Returns:
        (9 nb + 13 + 2 (ns + 1),) uint64, read-only.
    """
    v = np.ascontiguousarray(valid, bool).reshape(-1)
    P = v.size
    nb = -(-P // LINE)
    padded = np.zeros(nb * LINE, bool)
    padded[:P] = v
    bits = np.packbits(padded, bitorder="little").view("<u8").astype(np.uint64).reshape(nb, 6)
    within = np.cumsum(padded.reshape(nb, 6, 64).sum(2, dtype=np.int64), axis=1)  # words 0..k of each line
    before = np.zeros(nb + 1, np.int64)
    np.cumsum(within[:, 5], out=before[1:])
    V = int(before[-1])
    sub = np.full(nb, 511 << 54, np.uint64)  # field k at bit 9 k: words 0..k-1's valid pixels; field 0 = 0
    for k in range(1, 6):
        sub |= within[:, k - 1].astype(np.uint64) << np.uint64(9 * k)
    ns = -(-V // SAMPLE)
    L = index_length(P, V)
    buf = np.zeros(L + 8, np.uint64)
    at = (-buf.ctypes.data // 8) % 8  # the first line on a 64-byte boundary
    out = buf[at:at + L]
    lines = out[:8 * (nb + 1)].reshape(nb + 1, 8)
    lines[:nb, 0], lines[:nb, 1], lines[:nb, 2:] = before[:nb], sub, bits
    lines[nb, 0] = V
    out[8 * (nb + 1):9 * nb + 9] = before
    out[9 * nb + 9:9 * nb + 13] = V
    targets = np.minimum(np.arange(ns + 1, dtype=np.int64) * SAMPLE, max(V - 1, 0))
    lo = np.searchsorted(before[1:], targets, side="right")  # the line holding each
    samples = out[9 * nb + 13:].reshape(ns + 1, 2)
    padded = np.concatenate([before, np.full(4, V, np.int64)])
    fields = np.zeros(ns + 1, np.uint64)
    for d in range(1, 5):
        delta = np.clip(padded[np.minimum(lo + d, nb + 4)] - np.arange(ns + 1) * SAMPLE, 0, 65535)
        fields |= delta.astype(np.uint64) << np.uint64(16 * (d - 1))
    sparse = np.zeros(ns + 1, bool)
    sparse[:ns] = lo[1:] > lo[:ns] + 4
    samples[:, 0] = lo.astype(np.uint64) | (sparse.astype(np.uint64) << np.uint64(63))
    samples[:ns, 1] = fields[:ns]
    out.setflags(write=False)
    return out


def index_counts(index: np.ndarray, P: int) -> int:
    """V, the valid pixels a valid-pixel index of P pixels counts."""
    return int(index[8 * -(-P // LINE)])


def unpack_valid(index: np.ndarray, P: int) -> np.ndarray:
    """(P,) bool: the valid pixels of a valid-pixel index (the inverse of :func:`valid_index`'s bits)."""
    nb = -(-P // LINE)
    words = np.ascontiguousarray(np.asarray(index[:8 * nb]).reshape(nb, 8)[:, 2:]).astype("<u8")
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:P].astype(bool)


def valid_pixel_ids(cache) -> Optional[np.ndarray]:
    """(V,) int64 the pixel ids of a masked cache's valid pixels, in order (None when unmasked):
    the table the torch baselines draw through."""
    if getattr(cache, "valid", None) is None:
        return None
    return np.flatnonzero(unpack_valid(cache.valid, cache.num_pixels))


def select_reference(valid: np.ndarray, k) -> np.ndarray:
    """The pixel ids of valid pixels ``k`` (the op's select, by a table: for tests and references)."""
    return np.flatnonzero(np.asarray(valid, bool).reshape(-1))[np.asarray(k, np.int64)]


# ---------------------------------------------------------------------------------------------
# mask files


def check_mask_file(path: str, expected_wh, max_pixels: Optional[int] = None) -> None:
    """A mask file's checks before decoding (one line naming the file): present, a readable PNG /
    JPEG of the expected size (:func:`dali_nerf.data.imageio.check_image`), single-channel
    (grayscale, no alpha, no palette)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: mask file not found; restore it or remove the frame's mask_path")
    h = check_image(path, expected_wh=expected_wh, max_pixels=max_pixels)
    if h.channels != 1 or (h.format == "png" and h.colour_type != 0):
        kind = "a palette image" if h.format == "png" and h.colour_type == 3 else f"{h.channels} channels"
        raise DataError(f"{path}: a mask must be single-channel (0 = ignore the pixel, else keep) but it has {kind}; "
                        f"save it as an 8-bit grayscale PNG")


def read_mask(path: str, expected_wh, max_pixels: Optional[int] = None) -> np.ndarray:
    """(h, w) bool of a mask file (nonzero = keep) of the size ``expected_wh`` (w, h), checked
    first (:func:`check_mask_file`)."""
    check_mask_file(path, expected_wh, max_pixels)
    with open(path, "rb") as f:
        data = np.frombuffer(f.read(), np.uint8)
    m = cv2.imdecode(data, cv2.IMREAD_UNCHANGED)  # 8 or 16 bit, as stored
    if m is None or m.ndim != 2:
        raise DataError(f"{path}: the mask cannot be decoded as one channel (corrupt image data); re-export it")
    w, h = (int(v) for v in expected_wh)
    if m.shape != (h, w):
        raise DataError(f"{path}: decoded size {m.shape[1]}x{m.shape[0]} differs from its header {w}x{h}; re-export it")
    return m != 0


def _nearest(m: np.ndarray, wh) -> np.ndarray:
    """``m`` (bool) resized nearest-neighbour to (w, h) as PIL's NEAREST (``INTER_NEAREST_EXACT``)."""
    w, h = (int(v) for v in wh)
    if m.shape == (h, w):
        return m
    return cv2.resize(m.view(np.uint8), (w, h), interpolation=cv2.INTER_NEAREST_EXACT).view(bool)


def finish_mask(m: np.ndarray, file_wh, out_wh, maps=None) -> np.ndarray:
    """A mask read at its file size -> the finished image's (h, w) bool (contiguous).

    Args:
        m: (mh, mw) bool as read.
        file_wh: (w, h) of the image file the mask goes with (the size undistortion works at).
        out_wh: (w, h) of the finished image (the scene's width, height).
        maps: the image's undistortion maps (:func:`dali_nerf.data.finish.undistort_maps`) or None.
    """
    if maps is not None:
        m = _nearest(m, file_wh)
        m = cv2.remap(m.view(np.uint8), maps[0], maps[1], interpolation=cv2.INTER_NEAREST,
                      borderMode=cv2.BORDER_CONSTANT, borderValue=0).view(bool)
    return np.ascontiguousarray(_nearest(m, out_wh))


def _file_wh(scene, i: int):
    if scene.file_wh is not None:
        return scene.file_wh[i]
    return scene.width[i], scene.height[i]


def load_mask(scene, i: int, maps=None, max_pixels: Optional[int] = None) -> np.ndarray:
    """Image ``i``'s finished mask, (height, width) bool (``maps``: its undistortion maps when
    ``scene.distorted[i]``, else None)."""
    m = read_mask(scene.mask_paths[i], scene.mask_wh[i], max_pixels)
    return finish_mask(m, _file_wh(scene, i), (scene.width[i], scene.height[i]), maps)


_COUNTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_COUNTS_LOCK = threading.Lock()


def valid_counts(scene) -> Optional[np.ndarray]:
    """(N,) int64 valid pixels of each image of a masked split (None when it has no masks), from
    its finished masks (:func:`load_mask`, each decoded once per process and scene object)."""
    if scene.mask_paths is None:
        return None
    with _COUNTS_LOCK:
        got = _COUNTS.get(scene)
    if got is None:
        from dali_nerf.data.finish import undistort_maps

        got = np.zeros(scene.num_images, np.int64)
        maps: dict = {}
        for i in range(scene.num_images):
            mp = None
            if scene.distorted[i]:
                key = (tuple(scene.file_wh[i]), tuple(scene.intrinsics[i]), tuple(scene.file_intrinsics[i]),
                       tuple(scene.distortion[i]), bool(scene.fisheye[i]))
                if key not in maps:
                    maps[key] = undistort_maps(scene, i)
                mp = maps[key]
            got[i] = int(np.count_nonzero(load_mask(scene, i, mp)))
        got.setflags(write=False)
        with _COUNTS_LOCK:
            _COUNTS[scene] = got
    return got


def stream_sizes(scene) -> np.ndarray:
    """(N,) int64 what the streams draw from in each image: its valid pixels (masked), else its
    pixels (width x height)."""
    counts = valid_counts(scene)
    return (scene.width * scene.height).astype(np.int64) if counts is None else counts
