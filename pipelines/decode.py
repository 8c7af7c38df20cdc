"""Decode once: DALI ``readers.file`` (sharded like DALI shards) + ``decoders.image`` -> :class:`ImageCache`.

One rank's images are decoded a single time (CPU decoder here, nvJPEG with ``device="mixed"`` on a
GPU), finished per image (:func:`finish_image`: composited over the scene background, undistorted,
area-downscaled) and packed into three arrays the ray-sampler operator reads (see
ARCHITECTURE.md, "ImageCache"):

=========  ========  =======  ===============================================================
field      shape     dtype    meaning
=========  ========  =======  ===============================================================
pixels     (P, 3)    uint8    the shard's images, row-major, concatenated, RGB over background
cameras    (N, 18)   float32  c2w row-major (12), fx, fy, cx, cy, near, far (0, 1e10 unknown)
layout     (N, 4)    int64    pixel offset into ``pixels``, width, height, camera index in split
=========  ========  =======  ===============================================================

Sharding is DALI's own: shard ``i`` of ``S`` over ``N`` files is the index range
``[floor(i * N / S), floor((i + 1) * N / S))`` (:func:`shard_range`), read with ``pad_last_batch``
(padded duplicates are dropped by label).

Image policy (same as :mod:`dali_nerf.imageio`, which also says why the PNGs with a ``tRNS`` chunk
and the gray+alpha PNGs are decoded by OpenCV instead of DALI, per file, into the same finishing
step; EXIF orientation is ignored by both): RGBA is composited over the background exactly,
in integers, as ``round((rgb * a + bg8 * (255 - a)) / 255)`` with ``bg8 = round(255 * bg)``; grayscale is expanded to RGB; 16-bit images
are converted to 8 bit by DALI's decoder as ``round(v / 257)``. Then, at the file's size, a
distorted camera (``Scene.distortion``) is undistorted (:func:`undistort_maps`, ``cv2.remap``
bilinear) to the pinhole camera ``Scene.intrinsics``; then an image declared smaller than its
file (``downscale`` without a pre-downscaled copy) is area-averaged to its declared size
(``cv2.INTER_AREA``: the exact block mean for an integer ratio, area-weighted for a non-integer
one, :func:`area_weights`). ``Scene.background_mode`` random / learned: images with alpha are
refused (nothing to composite over; the cache has no alpha), the rest are stored as they are.

Checks (every entry point that decodes comes here: ``RayLoader``, the baselines, the trainers'
eval split, ``dali-nerf render``, ``dali-nerf bench sampler``), each a one-line
:class:`~dali_nerf.errors.DataError` naming the file: before anything is allocated, every file of
the shard goes through :func:`dali_nerf.imageio.check_image` (readable PNG/JPEG header, not
truncated, within the per-image pixel limit, on-disk size equal to the size the scene declares:
the declaration is never silently replaced by the header) and the cache's bytes are compared with
the memory available; a DALI batch that still fails (damage inside the compressed data) is traced
to its file by a per-file decode; a decoded size that differs from the declared one is refused.

>>> cache = decode_cache(scene, rank=0, world_size=2)
>>> cache.pixels.shape, cache.cameras.shape, cache.layout.shape
((P, 3), (N, 18), (N, 4))
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import cv2
import numpy as np
import torch
import torch.nn.functional as F

from dali_nerf import hostmem
from dali_nerf._dali import dali_api
from dali_nerf.errors import DataError, SceneError
from dali_nerf.imageio import check_image, decode_image_cv2
from dali_nerf.scenes._util import opencv_matrix

__all__ = [
    "ImageCache", "decode_pipeline", "decode_cache", "shard_range", "shard_sizes",
    "pack_cameras", "composite", "background_u8", "FAR_UNKNOWN", "DecodeCancelled", "available_memory",
    "finish_image", "finish_torch", "undistort_maps", "area_weights",
]

FAR_UNKNOWN = 1e10
"""``far`` written to ``cameras`` when the scene defines no bounds (``near`` is then 0)."""


class DecodeCancelled(Exception):
    """:func:`decode_cache` stopped because its ``stop`` event was set (not a user error)."""


def shard_range(num_items: int, rank: int, world_size: int) -> tuple[int, int]:
    """DALI's shard rule: ``[floor(rank * N / S), floor((rank + 1) * N / S))``.

    >>> shard_range(7, 1, 3)
    (2, 4)
    """
    return (num_items * rank) // world_size, (num_items * (rank + 1)) // world_size


def _check_shard(scene, rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise SceneError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
    if world_size > scene.num_images:
        raise SceneError(
            f"{scene.root}: split {scene.split!r} has {scene.num_images} images but world_size={world_size}; "
            f"use at most {scene.num_images} ranks or a scene with more images"
        )


def shard_sizes(scene, world_size: int) -> np.ndarray:
    """Pixels per rank's shard, (world_size,) int64, without decoding anything."""
    _check_shard(scene, 0, world_size)
    px = (scene.width * scene.height).astype(np.int64)
    out = np.zeros(world_size, np.int64)
    for r in range(world_size):
        a, b = shard_range(scene.num_images, r, world_size)
        out[r] = px[a:b].sum()
    return out


@dataclass(frozen=True, eq=False)
class ImageCache:
    """One rank's decoded images, packed (arrays read-only; on a GPU ``pixels`` is a CUDA tensor).

    Attributes:
        pixels: (P, 3) uint8 RGB, every image of the shard row-major, concatenated.
        cameras: (N, 18) float32 c2w row-major (12), fx, fy, cx, cy, near, far.
        layout: (N, 4) int64 pixel offset, width, height, camera index in the split.
        rank, world_size: the shard this cache holds.
        device: "cpu" or "cuda" (where ``pixels`` lives).

    Example:
        >>> cache.num_pixels == cache.pixels.shape[0] == int((cache.layout[:, 1] * cache.layout[:, 2]).sum())
        True
    """

    pixels: object
    cameras: np.ndarray
    layout: np.ndarray
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def num_pixels(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def num_images(self) -> int:
        return int(self.layout.shape[0])

    @property
    def camera_ids(self) -> np.ndarray:
        """(N,) int64 camera index in the split of each cached image."""
        return self.layout[:, 3]

    @property
    def nbytes(self) -> int:
        return self.num_pixels * 3 + self.cameras.nbytes + self.layout.nbytes

    def image(self, i: int):
        """(H, W, 3) uint8 view of the i-th cached image."""
        off, w, h, _ = (int(v) for v in self.layout[i])
        return self.pixels[off:off + w * h].reshape(h, w, 3)


def pack_cameras(scene, idx: Sequence[int]) -> np.ndarray:
    """(len(idx), 18) float32 camera rows (c2w row-major, fx, fy, cx, cy, near, far) for split indices."""
    idx = np.asarray(idx, np.int64)
    cams = np.zeros((len(idx), 18), np.float32)
    cams[:, :12] = scene.c2w[idx].reshape(-1, 12)
    cams[:, 12:16] = scene.intrinsics[idx]
    if scene.has_bounds:
        cams[:, 16] = scene.near[idx]
        cams[:, 17] = scene.far[idx]
    else:
        cams[:, 16] = 0.0
        cams[:, 17] = FAR_UNKNOWN
    return cams


def background_u8(background) -> np.ndarray:
    """(3,) uint8 ``round(255 * bg)`` of a background in [0, 1]."""
    return np.clip(np.round(np.asarray(background, np.float64) * 255.0), 0, 255).astype(np.uint8)


def composite(img: np.ndarray, background, out: Optional[np.ndarray] = None) -> np.ndarray:
    """(H, W, C) uint8 with C in {1, 2, 3, 4} -> (H, W, 3) uint8 RGB over ``background`` (3,) in [0, 1].

    1 = gray, 2 = gray + alpha, 3 = RGB, 4 = RGBA; alpha composited exactly in integers as
    ``round((rgb * a + bg8 * (255 - a)) / 255)`` with ``bg8 = round(255 * bg)``. Writes into ``out``.
    """
    c = img.shape[2]
    h, w = img.shape[:2]
    if out is None:
        out = np.empty((h, w, 3), np.uint8)
    if c in (1, 2):
        rgb = np.broadcast_to(img[:, :, :1], (h, w, 3))
    elif c in (3, 4):
        rgb = img[:, :, :3]
    else:
        raise DataError(f"image with {c} channels: expected gray, gray+alpha, RGB or RGBA")
    if c in (2, 4):
        # exact integer compositing with cv2 (SIMD, threaded): uint16 rgb*a + bg8*(255-a) <= 65025,
        # then convertScaleAbs rounds x/255 (never a tie for integers)
        a = img[:, :, c - 1]
        a3 = cv2.merge([a, a, a])
        v = cv2.multiply(np.ascontiguousarray(rgb), a3, dtype=cv2.CV_16U)
        bg8 = background_u8(background)
        w = cv2.multiply(cv2.bitwise_not(a3), (float(bg8[0]), float(bg8[1]), float(bg8[2]), 0.0), dtype=cv2.CV_16U)
        cv2.add(v, w, dst=v)
        if out.flags.c_contiguous:
            cv2.convertScaleAbs(v, dst=out, alpha=1.0 / 255.0)
        else:
            out[...] = cv2.convertScaleAbs(v, alpha=1.0 / 255.0)
    else:
        out[...] = rgb
    return out


# ---------------------------------------------------------------------------------------------
# checks before anything is allocated or decoded


def _check_files(scene, want: np.ndarray, max_pixels: Optional[int]) -> np.ndarray:
    """Every file of ``want`` through :func:`dali_nerf.imageio.check_image` (header, tail, pixel
    limit, declared size = ``scene.file_wh``, else width/height at downscale 1): (len(want), 4)
    int64 header width, height, channels, and 1 where OpenCV decodes the file instead of DALI
    (:attr:`dali_nerf.imageio.ImageHeader.decoder`). A declared size that disagrees with the header is
    refused (the header never silently wins): one line naming the file and both sizes; so is an
    image with alpha when ``scene.background_mode`` is random / learned (nothing to composite over)."""
    fwh = scene.file_wh
    if fwh is None and scene.downscale <= 1:
        fwh = np.stack([scene.width, scene.height], 1)
    out = np.zeros((len(want), 4), np.int64)
    for k, i in enumerate(want):
        path = scene.image_paths[int(i)]
        if not os.path.isfile(path):
            raise DataError(f"{path}: image file not found; restore it or fix the scene's file list")
        h = check_image(path, expected_wh=None if fwh is None else fwh[int(i)], max_pixels=max_pixels)
        out[k] = (h.width, h.height, h.channels, h.decoder == "opencv")
        if h.channels in (2, 4) and scene.background_mode != "color":
            raise DataError(
                f"{path}: has an alpha channel but scene.background={scene.background_mode} keeps no alpha "
                f"(the cache is RGB); set scene.background to white, black or [r, g, b] to composite at decode"
            )
    return out


def available_memory(device: str = "cpu") -> int:
    """Bytes that can be allocated now without swapping: ``MemAvailable`` of ``/proc/meminfo``
    (else free physical pages) for "cpu", free device memory for "cuda"."""
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def _check_memory(scene, need: int, n: int, rank: int, world_size: int, device: str, windowed: bool) -> None:
    """Refuse (one line, with the numbers) a cache of ``need`` bytes that does not fit in the
    memory available now, before allocating it."""
    avail = available_memory(device)
    if need <= avail:
        return
    what = f"a streaming window of {n} images" if windowed else f"rank {rank} of {world_size}: {n} images"
    gib = 1 << 30
    raise DataError(
        f"{scene.root}: split {scene.split!r} ({what}) needs {need / gib:.1f} GiB of decoded pixels ({need} bytes) "
        f"but only {avail / gib:.1f} GiB of {'GPU' if device == 'cuda' else 'host'} memory is available; "
        f"set cache.max_bytes (RayLoader max_bytes=) to stream it through windows, use a downscale, or run more ranks"
    )


def _find_culprit(scene, candidates: Sequence[int], err: Exception) -> str:
    """The one-line message for a DALI decode failure in a batch of ``candidates`` (split
    indices, the failing batch first): the file DALI's message names, else the first file that
    fails the header checks or a per-file decode (:func:`dali_nerf.imageio.decode_image_cv2`),
    else the batch's file range."""
    lines = [l.strip() for l in str(err).splitlines() if l.strip()]
    msg = next((l for l in lines if l.startswith("Failed to decode")), lines[0] if lines else type(err).__name__)
    paths = [scene.image_paths[int(i)] for i in candidates]
    named = next((p for p in paths if os.path.basename(p) in str(err)), None)
    if named is not None:
        return f"{named}: cannot be decoded ({msg}); re-export it as PNG or JPEG"
    for p in paths:
        try:
            check_image(p)
            decode_image_cv2(p)
        except DataError as e:
            return str(e)
    span = f"{paths[0]} .. {paths[-1]}" if len(paths) > 1 else paths[0]
    return (f"{span}: DALI cannot decode one of these {len(paths)} files ({msg}) although each passes the header "
            f"checks and decodes with OpenCV; re-export them as PNG or JPEG")


def decode_pipeline(files, labels, shard_id, num_shards, *, device="cpu",
                    batch_size=8, num_threads=2, device_id=None, prefetch_queue_depth=2):
    """Build (not run) the decode pipeline: ``readers.file`` (sharded, named "Reader",
    ``pad_last_batch``) -> ``decoders.image`` (ANY_DATA keeps alpha / gray). Images come out at
    the files' own size; compositing, undistortion and the area downscale follow per image in
    :func:`decode_cache` (``fn.resize``'s interpolation types, NN / linear / cubic / Lanczos3 /
    triangular / Gaussian, include no documented exact area mean).

    Args:
        files: (N,) image paths of the split; labels: (N,) camera index in the split.
        shard_id, num_shards: DALI sharding (the rank and world size).
        device: "cpu" or "mixed" (nvJPEG; outputs on the GPU).
    Returns:
        A built DALI pipeline whose outputs are (images (H, W, C) uint8, labels (1,) int32).
    """
    fn, pipeline_def, types = dali_api()

    @pipeline_def
    def _decode():
        data, lab = fn.readers.file(
            files=list(files), labels=[int(x) for x in labels], shard_id=shard_id, num_shards=num_shards,
            pad_last_batch=True, name="Reader", random_shuffle=False,
        )
        # pixels as stored (EXIF orientation ignored): the size the header and the scene declare
        img = fn.decoders.image(data, device=device, output_type=types.ANY_DATA, adjust_orientation=False)
        return img, lab

    pipe = _decode(batch_size=batch_size, num_threads=num_threads,
                   device_id=device_id, prefetch_queue_depth=prefetch_queue_depth)
    pipe.build()
    return pipe


# ---------------------------------------------------------------------------------------------
# per-image finishing: composite -> undistort -> area downscale


def area_weights(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) float64 area-averaging weights (``cv2.INTER_AREA``'s definition for
    downscaling): output pixel j averages the input interval ``[j * s, (j + 1) * s)``,
    ``s = n_in / n_out``, each input pixel weighted by its overlap with it. For an integer ``s``
    each row is ``s`` weights of ``1 / s`` (the block mean); otherwise pixels straddling an
    interval's edge count fractionally. Rows sum to 1.

    >>> area_weights(4, 2)
    array([[0.5, 0.5, 0. , 0. ],
           [0. , 0. , 0.5, 0.5]])
    """
    if not 0 < n_out <= n_in:
        raise ValueError(f"area_weights: need 0 < n_out <= n_in, got {n_in} -> {n_out}")
    edges = np.arange(n_out + 1, dtype=np.float64) * n_in / n_out
    i = np.arange(n_in, dtype=np.float64)[None, :]
    w = np.clip(np.minimum(edges[1:, None], i + 1) - np.maximum(edges[:-1, None], i), 0.0, None)
    return w / w.sum(axis=1, keepdims=True)


def undistort_maps(scene, cam: int):
    """(map_x, map_y), each (fh, fw) float32: for each pixel of the undistorted image of camera
    ``cam`` (at the file size ``scene.file_wh[cam]``, intrinsics ``scene.intrinsics[cam]`` scaled
    back to that size) the position in the distorted file image, from
    ``cv2.initUndistortRectifyMap`` / ``cv2.fisheye.initUndistortRectifyMap`` with the file's
    camera ``scene.file_intrinsics[cam]`` and ``scene.distortion[cam]``."""
    fw, fh = (int(v) for v in scene.file_wh[cam])
    w, h = int(scene.width[cam]), int(scene.height[cam])
    sx, sy = fw / w, fh / h  # scale_intrinsics back to the file's size
    k_new = np.asarray(scene.intrinsics[cam], np.float64) * np.array([sx, sy, sx, sy])
    # OpenCV's pixel centres are at integers, ours at +0.5 (opencv_matrix shifts the principal point)
    k_src, k_dst = opencv_matrix(scene.file_intrinsics[cam]), opencv_matrix(k_new)
    dist = np.asarray(scene.distortion[cam], np.float64)
    if scene.fisheye[cam]:
        return cv2.fisheye.initUndistortRectifyMap(k_src, dist[:4].reshape(4, 1), np.eye(3), k_dst, (fw, fh), cv2.CV_32FC1)
    return cv2.initUndistortRectifyMap(k_src, dist, np.eye(3), k_dst, (fw, fh), cv2.CV_32FC1)


def finish_image(img: np.ndarray, background, out: np.ndarray, maps=None) -> np.ndarray:
    """One decoded image (fh, fw, C) uint8 -> ``out`` (h, w, 3) uint8, the cache's image:

    1. :func:`composite` over ``background`` (alpha images; gray -> RGB), at the file's size;
    2. undistort with ``maps`` (:func:`undistort_maps`): ``cv2.remap``, bilinear, border
       replicated (the alpha = 0 intrinsics keep the maps inside the image; replication only
       covers the last sub-pixel);
    3. area downscale to (w, h) when the sizes differ: ``cv2.INTER_AREA`` (an integer factor is
       the exact block mean, rounded; otherwise :func:`area_weights`).

    Composite first, then resample: averaging composited colours is what a camera in front of
    the background would see (averaging straight RGBA would not be).
    """
    h, w = out.shape[:2]
    same = img.shape[0] == h and img.shape[1] == w
    if maps is None and same:
        if img.shape[2] == 3:  # RGB (every colour JPEG): one contiguous copy into the cache
            np.copyto(out, img)
        else:
            composite(img, background, out=out)
        return out
    rgb = img if img.shape[2] == 3 else composite(img, background)
    if maps is not None:
        rgb = cv2.remap(rgb, maps[0], maps[1], cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    if same:
        np.copyto(out, rgb)
    else:
        out[...] = cv2.resize(rgb, (w, h), interpolation=cv2.INTER_AREA)
    return out


def _batch_size(n: int, batch: int) -> int:
    """Images per decode run: the size in ``[batch, 2 * batch]`` (at most ``n``) whose last run
    carries the fewest ``pad_last_batch`` duplicates (each one is decoded for nothing); ties -> the
    smallest. ``_batch_size(100, 8) == 10``, ``_batch_size(32, 8) == 8``."""
    batch = max(1, min(int(batch), n))
    return min(range(batch, min(2 * batch, n) + 1), key=lambda b: (math.ceil(n / b) * b - n, b))


def decode_cache(scene, rank: int = 0, world_size: int = 1, *, device: str = "cpu", num_threads: int = 2,
                 batch: int = 8, background=None, indices: Optional[Sequence[int]] = None,
                 stop=None, max_pixels: Optional[int] = None) -> ImageCache:
    """Decode exactly DALI's shard ``rank`` of ``world_size`` of ``scene`` into an :class:`ImageCache`.

    Args:
        scene: the split (:class:`~dali_nerf.scenes.Scene`).
        rank, world_size: the shard (see :func:`shard_range`); ``world_size`` > images is an error.
        device: "cpu" (DALI CPU decoder) or "cuda" (nvJPEG, ``pixels`` as a CUDA uint8 tensor).
        num_threads: DALI CPU threads; batch: images per pipeline run (raised up to ``2 * batch``
            when that avoids decoding ``pad_last_batch`` duplicates, see :func:`_batch_size`).
        background: (3,) RGB in [0, 1] images with alpha are composited over (default
            ``scene.background``).
        indices: decode these split indices instead of the shard (streaming windows); they are
            read as one unsharded list in the given order.
        stop: optional ``threading.Event``; checked before each decode run, and when set the decode
            ends with :class:`DecodeCancelled` (a background window decode stopping on ``close()``).
        max_pixels: per-image pixel limit (None: :func:`dali_nerf.imageio.max_pixels_limit`).

    Before anything is allocated, every file's header is checked (:func:`_check_files`: readable,
    not truncated, within the pixel limit, of the declared size) and the cache's size is compared
    with the memory available (:func:`available_memory`); a DALI decode failure is traced to the
    file (:func:`_find_culprit`).

    Returns:
        ImageCache with pixels (P, 3) u8, cameras (N, 18) f32, layout (N, 4) i64.
    Raises:
        SceneError: world_size > number of images.  DataError: an image is missing, corrupt,
        truncated, over the pixel limit, of another size than declared, has alpha under
        ``background_mode`` random / learned, or cannot be decoded (one line naming the file); or
        the cache does not fit in memory (one line with the numbers).

    Example:
        >>> cache = decode_cache(scene, 1, 2)
        >>> cache.layout[:, 3]            # split camera indices of shard 1
        array([50, 51, ..., 99])
    """
    bg = scene.background if background is None else np.asarray(background, np.float32)
    if indices is None:
        _check_shard(scene, rank, world_size)
        lo, hi = shard_range(scene.num_images, rank, world_size)
        want = np.arange(lo, hi, dtype=np.int64)
        files, labels, shard_id, num_shards = scene.image_paths, range(scene.num_images), rank, world_size
    else:
        want = np.asarray(indices, np.int64)
        if len(want) == 0:
            raise SceneError("decode_cache: empty list of image indices")
        files = [scene.image_paths[i] for i in want]
        labels, shard_id, num_shards = [int(i) for i in want], 0, 1
    header = _check_files(scene, want, max_pixels)
    widths, heights = scene.width, scene.height
    header_wh = header[:, :2]
    by_cv2 = header[:, 3].astype(bool)  # tRNS / gray+alpha PNGs: DALI's decoder gets them wrong
    if by_cv2.any():  # DALI reads the others as one unsharded list in the shard's order
        files = [scene.image_paths[int(i)] for i in want[~by_cv2]]
        labels, shard_id, num_shards = [int(i) for i in want[~by_cv2]], 0, 1
    distorted = scene.distorted
    maps: dict = {}  # camera -> undistortion maps, built once per distinct lens and size

    def maps_of(cam: int):
        if not distorted[cam]:
            return None
        key = (tuple(scene.file_wh[cam]), tuple(scene.intrinsics[cam]), tuple(scene.file_intrinsics[cam]),
               tuple(scene.distortion[cam]), bool(scene.fisheye[cam]))
        if key not in maps:
            maps[key] = undistort_maps(scene, cam)
        return maps[key]

    use_gpu = device == "cuda"
    dali_device = "mixed" if use_gpu else "cpu"
    dev_id = None
    if use_gpu:
        dev_id = torch.cuda.current_device()

    n = len(want)
    px_count = (widths[want] * heights[want]).astype(np.int64)
    offsets = np.zeros(n, np.int64)
    offsets[1:] = np.cumsum(px_count)[:-1]
    total = int(px_count.sum())
    pos_of = {int(c): k for k, c in enumerate(want)}
    _check_memory(scene, total * 3, n, rank, world_size, device if use_gpu else "cpu", indices is not None)
    if use_gpu:
        pixels = torch.empty((total, 3), dtype=torch.uint8, device="cuda")
        bg_t = torch.as_tensor(background_u8(bg).astype(np.int32), device="cuda")
        gpu_aux: dict = {}  # GPU copies of the maps (as grids) and area weights
    else:
        pixels = hostmem.empty((total, 3), np.uint8)  # huge pages: the sampler reads at random

    done = np.zeros(n, bool)

    def finish(k: int, cam: int, img) -> None:
        h, w = int(heights[cam]), int(widths[cam])
        fw, fh = (int(v) for v in header_wh[k])
        shape = tuple(img.shape()) if callable(getattr(img, "shape", None)) else tuple(img.shape)
        if shape[0] != fh or shape[1] != fw:
            raise DataError(
                f"{scene.image_paths[cam]}: decoded size {shape[1]}x{shape[0]} differs from its header "
                f"{fw}x{fh}; re-export the image"
            )
        dst = slice(int(offsets[k]), int(offsets[k] + h * w))
        if use_gpu and isinstance(img, np.ndarray):
            finish_torch(torch.from_numpy(img).cuda(), bg_t, pixels[dst].view(h, w, 3), maps_of(cam), gpu_aux)
        elif use_gpu:
            _finish_gpu(img, bg_t, pixels[dst].view(h, w, 3), maps_of(cam), gpu_aux)
        else:
            finish_image(np.asarray(img), bg, pixels[dst].reshape(h, w, 3), maps_of(cam))
        done[k] = True

    for k in np.flatnonzero(by_cv2):  # the few PNGs DALI gets wrong: OpenCV, per file
        if stop is not None and stop.is_set():
            raise DecodeCancelled(f"decode of {n} images of {scene.root} cancelled")
        cam = int(want[k])
        finish(int(k), cam, decode_image_cv2(scene.image_paths[cam], max_pixels=max_pixels))
    n_dali = int((~by_cv2).sum())
    if n_dali == 0:
        return _packed(scene, want, offsets, pixels, use_gpu, rank, world_size)
    bs = _batch_size(n_dali, batch)
    runs = math.ceil(n_dali / bs)
    depth = min(2, runs)
    try:
        pipe = decode_pipeline(files, labels, shard_id, num_shards, device=dali_device,
                               batch_size=bs, num_threads=num_threads, device_id=dev_id, prefetch_queue_depth=depth)
    except RuntimeError as e:
        raise DataError(f"{scene.root}: DALI could not build the decode pipeline: {str(e).splitlines()[0]}") from None
    scheduled = 0
    try:
        for r in range(runs):
            if stop is not None and stop.is_set():
                raise DecodeCancelled(f"decode of {n} images of {scene.root} cancelled")
            try:
                # scheduled API: exactly `runs` batches are decoded (run() would prefetch depth - 1
                # batches past the shard's end, decoding images nobody uses)
                if scheduled < runs:
                    pipe.schedule_run()  # the first call prefetches `depth` runs
                    scheduled += depth if r == 0 else 1
                imgs, labs = pipe.outputs()
            except RuntimeError as e:
                # the failing run is the oldest not yet returned: its files come first
                raise DataError(_find_culprit(scene, want[~done][:depth * bs], e)) from None
            if use_gpu:
                labs = labs.as_cpu() if hasattr(labs, "as_cpu") else labs
            for s in range(len(labs)):
                cam = int(np.asarray(labs[s]).reshape(-1)[0])
                k = pos_of.get(cam)
                if k is None or done[k]:
                    continue  # pad_last_batch duplicate
                finish(k, cam, imgs[s])
    finally:
        del pipe
    if not done.all():
        missing = scene.image_paths[int(want[np.flatnonzero(~done)[0]])]
        raise DataError(f"{missing}: the decode pipeline did not return this image; check the file")
    return _packed(scene, want, offsets, pixels, use_gpu, rank, world_size)


def _packed(scene, want, offsets, pixels, use_gpu: bool, rank: int, world_size: int) -> ImageCache:
    """The :class:`ImageCache` of the decoded ``pixels`` of split indices ``want`` (arrays frozen)."""
    layout = np.stack([offsets, scene.width[want], scene.height[want], want], axis=1).astype(np.int64)
    cameras = pack_cameras(scene, want)
    for a in (cameras, layout):
        a.setflags(write=False)
    if not use_gpu:
        pixels.setflags(write=False)
    return ImageCache(pixels=pixels, cameras=cameras, layout=layout, rank=rank, world_size=world_size,
                      device="cuda" if use_gpu else "cpu")


def _finish_gpu(tensor_gpu, bg255, out, maps, aux: dict):  # pragma: no cover - needs a GPU
    """:func:`finish_torch` of one decoded DALI TensorGPU (fh, fw, C) into ``out`` (h, w, 3) uint8 CUDA."""
    img = torch.as_tensor(tensor_gpu, device="cuda")  # __cuda_array_interface__, no host copy
    finish_torch(img, bg255, out, maps, aux)
    torch.cuda.current_stream().synchronize()  # DALI may reuse the decode buffer on the next run


def finish_torch(img, bg255, out, maps=None, aux: Optional[dict] = None):
    """:func:`finish_image` in torch, on ``img``'s device (the GPU decode path; tested on the CPU).

    Args:
        img: (fh, fw, C) uint8 tensor, C in {1, 2, 3, 4}.
        bg255: (3,) int32 tensor ``round(255 * background)`` on the same device.
        out: (h, w, 3) uint8 tensor, written.
        maps: None or :func:`undistort_maps`' (map_x, map_y) numpy arrays.
        aux: dict caching the device copies of the maps (as grids) and the area weights.

    Composite in integers (the same bytes as :func:`composite`); undistort with
    ``grid_sample`` (bilinear, border) on the same maps; area downscale: ``avg_pool2d`` (the
    block mean) for an integer ratio, else ``Wy @ img @ Wx^T`` with :func:`area_weights` in
    float64; rounded. Equal to the CPU path without resampling; within 1 LSB of it (cv2's
    fixed-point rounding) otherwise.
    """
    aux = {} if aux is None else aux
    dev = img.device
    fh, fw, c = img.shape
    h, w = out.shape[:2]
    rgb = img[:, :, :1].expand(-1, -1, 3) if c in (1, 2) else img[:, :, :3]
    if c in (2, 4):
        a = img[:, :, c - 1:c].to(torch.int32)
        rgb = ((rgb.to(torch.int32) - bg255) * a + bg255 * 255 + 127) // 255
    if maps is None and (fh, fw) == (h, w):
        out.copy_(rgb.to(torch.uint8))
        return out
    x = rgb.to(torch.float32).permute(2, 0, 1)  # (3, fh, fw)
    if maps is not None:
        key = ("grid", id(maps[0]))
        if key not in aux:
            gx = (torch.as_tensor(maps[0], device=dev) + 0.5) * (2.0 / fw) - 1.0
            gy = (torch.as_tensor(maps[1], device=dev) + 0.5) * (2.0 / fh) - 1.0
            aux[key] = (maps, torch.stack([gx, gy], -1)[None])  # keeps maps alive: the id stays unique
        x = F.grid_sample(x[None], aux[key][1], mode="bilinear", padding_mode="border", align_corners=False)[0]
    if (fh, fw) != (h, w):
        if fh % h == 0 and fw % w == 0:  # integer ratio: the block mean, no matmul (TF32 cannot touch it)
            x = F.avg_pool2d(x[None], (fh // h, fw // w))[0]
        else:  # exact area weights, float64 so that TF32 matmul settings do not apply
            for n_in, n_out in ((fh, h), (fw, w)):
                if ("area", n_in, n_out) not in aux:
                    aux[("area", n_in, n_out)] = torch.as_tensor(area_weights(n_in, n_out), device=dev)
            x = (aux[("area", fh, h)] @ x.double() @ aux[("area", fw, w)].T).float()
    out.copy_(x.round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0))
    return out
