"""The image cache: a rank's images decoded once, finished and packed for the ray sampler.

One rank's images are decoded a single time (CPU decoder here, nvJPEG with ``device="mixed"`` on a
GPU), finished per image (:func:`finish_image`: composited over the scene background, undistorted,
area-downscaled) and packed into three arrays the ray-sampler operator reads (see
ARCHITECTURE.md, "ImageCache"):

============  ========  =======  ============================================================
field         shape     dtype    meaning
============  ========  =======  ============================================================
pixels        (P, 3)    uint8    the shard's images, row-major, concatenated, RGB over background
cameras       (N, 18)   float32  c2w row-major (12), fx, fy, cx, cy, near, far (0, 1e10 unknown)
layout        (N, 4)    int64    pixel offset into ``pixels``, width, height, camera index in split
valid         (L,)      uint64   masked scenes only: the valid-pixel index (a bit per pixel +
                                 rank/select directory, :func:`dali_nerf.data.masks.valid_index`)
valid_counts  (N,)      int64    masked scenes only: each image's valid pixels
============  ========  =======  ============================================================

Masks (``Scene.mask_paths``) are read and finished with their images, once, by
:func:`dali_nerf.data.masks.load_mask` (nearest-neighbour, undistorted with the image's maps,
checked like the images: present, single-channel, of the declared size); ``valid`` lives on the
host also for a GPU cache (the op reads its counts there).

Sharding is DALI's own: shard ``i`` of ``S`` over ``N`` files is the index range
``[floor(i * N / S), floor((i + 1) * N / S))`` (:func:`shard_range`), read with ``pad_last_batch``
(padded duplicates are dropped by label).

Image policy (same as :mod:`dali_nerf.data.imageio`, which also says why the PNGs with a ``tRNS`` chunk,
the gray+alpha PNGs and the gray JPEGs are decoded by OpenCV instead of DALI, per file, into the same
finishing step; EXIF orientation is ignored by both): RGBA is composited over the background exactly,
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
the shard goes through :func:`dali_nerf.data.imageio.check_image` (readable PNG/JPEG header, not
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

import numpy as np
import torch

from dali_nerf.data import hostmem
from dali_nerf.errors import DataError, SceneError
from dali_nerf.data.finish import background_u8, finish_gpu, finish_image, finish_torch, undistort_maps
from dali_nerf.data.imageio import check_image, decode_image_cv2
from dali_nerf.data.masks import check_mask_file, load_mask, unpack_valid, valid_index
from dali_nerf.pipelines.decode import check_shard, decode_pipeline, shard_range

__all__ = ["ImageCache", "decode_cache", "pack_cameras", "FAR_UNKNOWN", "DecodeCancelled", "available_memory",
           "meminfo_bytes", "eval_cache", "CacheStore", "decode_into"]

FAR_UNKNOWN = 1e10
"""``far`` written to ``cameras`` when the scene defines no bounds (``near`` is then 0)."""


class DecodeCancelled(Exception):
    """:func:`decode_cache` stopped because its ``stop`` event was set (not a user error)."""


@dataclass(frozen=True, eq=False)
class ImageCache:
    """One rank's decoded images, packed (arrays read-only; on a GPU ``pixels`` is a CUDA tensor).

    Attributes:
        pixels: (P, 3) uint8 RGB, every image of the shard row-major, concatenated.
        cameras: (N, 18) float32 c2w row-major (12), fx, fy, cx, cy, near, far.
        layout: (N, 4) int64 pixel offset, width, height, camera index in the split.
        rank, world_size: the shard this cache holds.
        device: "cpu" or "cuda" (where ``pixels`` lives).
        valid: masked scenes: (L,) uint64 the valid-pixel index (on the host; the op's ``valid``
            input), else None.
        valid_counts: masked scenes: (N,) int64 valid pixels per image, else None.

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
    valid: Optional[np.ndarray] = None
    valid_counts: Optional[np.ndarray] = None

    @property
    def num_pixels(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def masked(self) -> bool:
        return self.valid is not None

    @property
    def num_valid(self) -> int:
        """Pixels the streams draw from: the valid ones (masked), else all."""
        return self.num_pixels if self.valid_counts is None else int(self.valid_counts.sum())

    @property
    def num_images(self) -> int:
        return int(self.layout.shape[0])

    @property
    def camera_ids(self) -> np.ndarray:
        """(N,) int64 camera index in the split of each cached image."""
        return self.layout[:, 3]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.valid is None else self.valid.nbytes + self.valid_counts.nbytes
        return self.num_pixels * 3 + self.cameras.nbytes + self.layout.nbytes + extra

    def image(self, i: int):
        """(H, W, 3) uint8 view of the i-th cached image."""
        off, w, h, _ = (int(v) for v in self.layout[i])
        return self.pixels[off:off + w * h].reshape(h, w, 3)

    def image_mask(self, i: int) -> Optional[np.ndarray]:
        """(H, W) bool valid pixels of the i-th cached image (a new array), or None when unmasked."""
        if self.valid is None:
            return None
        off, w, h, _ = (int(v) for v in self.layout[i])
        return unpack_valid(self.valid, self.num_pixels)[off:off + w * h].reshape(h, w)


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


# ---------------------------------------------------------------------------------------------
# checks before anything is allocated or decoded


def _check_files(scene, want: np.ndarray, max_pixels: Optional[int]) -> np.ndarray:
    """Every file of ``want`` through :func:`dali_nerf.data.imageio.check_image` (header, tail, pixel
    limit, declared size = ``scene.file_wh``, else width/height at downscale 1): (len(want), 4)
    int64 header width, height, channels, and 1 where OpenCV decodes the file instead of DALI
    (:attr:`dali_nerf.data.imageio.ImageHeader.decoder`: PNGs with ``tRNS`` or gray+alpha, gray
    JPEGs). A declared size that disagrees with the header is
    refused (the header never silently wins): one line naming the file and both sizes; so is an
    image with alpha when ``scene.background_mode`` is random / learned (nothing to composite over)."""
    fwh = scene.file_wh
    if fwh is None and scene.downscale <= 1:
        fwh = np.stack([scene.width, scene.height], 1)
    out = np.zeros((len(want), 4), np.int64)
    for k, i in enumerate(want):
        path = scene.image_paths[int(i)]
        if not os.path.isfile(path):
            if os.path.isdir(path):
                raise DataError(f"{path}: is a folder, not an image file; fix the scene's file list")
            raise DataError(f"{path}: image file not found; restore it or fix the scene's file list")
        h = check_image(path, expected_wh=None if fwh is None else fwh[int(i)], max_pixels=max_pixels)
        out[k] = (h.width, h.height, h.channels, h.decoder == "opencv")
        if h.channels in (2, 4) and scene.background_mode != "color":
            raise DataError(
                f"{path}: has an alpha channel but scene.background={scene.background_mode} keeps no alpha "
                f"(the cache is RGB); set scene.background to white, black or [r, g, b] to composite at decode"
            )
        if scene.mask_paths is not None:  # validated like the image: present, size, single-channel
            check_mask_file(scene.mask_paths[int(i)], scene.mask_wh[int(i)], max_pixels)
    return out


def available_memory(device: str = "cpu") -> int:
    """Bytes that can be allocated now without swapping: ``MemAvailable`` of ``/proc/meminfo``
    (else free physical pages) for "cpu", free device memory for "cuda"."""
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    return meminfo_bytes("MemAvailable", "SC_AVPHYS_PAGES")


def meminfo_bytes(field: str, pages: str) -> int:
    """Bytes of ``/proc/meminfo``'s ``field`` (``MemAvailable``, ``MemTotal``), else ``pages`` x
    the page size from ``os.sysconf`` (``SC_AVPHYS_PAGES``, ``SC_PHYS_PAGES``) where there is no
    such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf(pages)) * int(os.sysconf("SC_PAGE_SIZE"))


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
    fails the header checks or a per-file decode (:func:`dali_nerf.data.imageio.decode_image_cv2`),
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


# ---------------------------------------------------------------------------------------------
# decoding


def _batch_size(n: int, batch: int) -> int:
    """Images per decode run: the size in ``[batch, 2 * batch]`` (at most ``n``) whose last run
    carries the fewest ``pad_last_batch`` duplicates (each one is decoded for nothing); ties -> the
    smallest. ``_batch_size(100, 8) == 10``, ``_batch_size(32, 8) == 8``."""
    batch = max(1, min(int(batch), n))
    return min(range(batch, min(2 * batch, n) + 1), key=lambda b: (math.ceil(n / b) * b - n, b))


def decode_cache(scene, rank: int = 0, world_size: int = 1, *, device: str = "cpu", num_threads: int = 2,
                 batch: int = 8, background=None, indices: Optional[Sequence[int]] = None,
                 stop=None, max_pixels: Optional[int] = None, out: Optional[np.ndarray] = None,
                 mask_out: Optional[np.ndarray] = None) -> ImageCache:
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
        max_pixels: per-image pixel limit (None: :func:`dali_nerf.data.imageio.max_pixels_limit`).
        out: decode into this (P, 3) uint8 C-contiguous host array (memory shared between the ranks of
            a node, :mod:`dali_nerf.data.nodeshare`) instead of a new one; no memory check then.
        mask_out: masked scenes: write the finished masks, one byte a pixel (P,) bool (0 / 1), into
            this host array (the node's shared block of the image loader) as well as the index.

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
    want, files, labels, shard_id, num_shards = _selection(scene, rank, world_size, indices)
    header = _check_files(scene, want, max_pixels)
    by_cv2 = header[:, 3].astype(bool)  # tRNS / gray+alpha PNGs, gray JPEGs: DALI's decoder gets them wrong
    if by_cv2.any():  # DALI reads the others as one unsharded list in the shard's order
        files = [scene.image_paths[int(i)] for i in want[~by_cv2]]
        labels, shard_id, num_shards = [int(i) for i in want[~by_cv2]], 0, 1
    use_gpu = device == "cuda"
    asm = _Assembly(scene, want, header[:, :2], bg, use_gpu)
    if out is None:
        per_pixel = 3 + (scene.mask_paths is not None)  # a masked scene: one more byte a pixel while its index is built
        _check_memory(scene, asm.total * per_pixel, len(want), rank, world_size, device if use_gpu else "cpu",
                      indices is not None)
        asm.allocate()
    else:
        if use_gpu or out.shape != (asm.total, 3) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"decode_cache: out must be a ({asm.total}, 3) uint8 C-contiguous host array")
        asm.pixels = out
    out = asm
    for k in np.flatnonzero(by_cv2):  # the files DALI gets wrong: OpenCV, per file
        _check_stop(stop, scene, len(want))
        cam = int(want[k])
        out.finish(int(k), cam, decode_image_cv2(scene.image_paths[cam], max_pixels=max_pixels))
    n_dali = int((~by_cv2).sum())
    if n_dali:
        _decode_with_dali(out, files, labels, shard_id, num_shards, n_dali, batch, num_threads, stop)
    if not out.done.all():
        missing = scene.image_paths[int(want[np.flatnonzero(~out.done)[0]])]
        raise DataError(f"{missing}: the decode pipeline did not return this image; check the file")
    valid = _masks(out, stop, max_pixels, mask_out) if scene.mask_paths is not None else None
    return _packed(scene, want, out.offsets, out.pixels, use_gpu, rank, world_size, valid)


def _selection(scene, rank: int, world_size: int, indices):
    """``(want, files, labels, shard_id, num_shards)``: the split indices to decode and what
    DALI's reader is given for them (the whole file list with the shard, or ``indices`` as one
    unsharded list)."""
    if indices is None:
        check_shard(scene, rank, world_size)
        lo, hi = shard_range(scene.num_images, rank, world_size)
        return (np.arange(lo, hi, dtype=np.int64), scene.image_paths, range(scene.num_images), rank, world_size)
    want = np.asarray(indices, np.int64)
    if len(want) == 0:
        raise SceneError("decode_cache: empty list of image indices")
    return want, [scene.image_paths[i] for i in want], [int(i) for i in want], 0, 1


def _check_stop(stop, scene, n: int) -> None:
    if stop is not None and stop.is_set():
        raise DecodeCancelled(f"decode of {n} images of {scene.root} cancelled")


class _Assembly:
    """The cache being filled: where each image of ``want`` goes in ``pixels`` and which are done;
    ``finish(k, cam, img)`` checks a decoded image's size and finishes it into its place."""

    def __init__(self, scene, want, header_wh, background, use_gpu: bool):
        self.scene, self.want, self.header_wh, self.bg, self.use_gpu = scene, want, header_wh, background, use_gpu
        px = (scene.width[want] * scene.height[want]).astype(np.int64)
        self.offsets = np.zeros(len(want), np.int64)
        self.offsets[1:] = np.cumsum(px)[:-1]
        self.total = int(px.sum())
        self.pos_of = {int(c): k for k, c in enumerate(want)}
        self.done = np.zeros(len(want), bool)
        self._maps: dict = {}  # lens -> undistortion maps, built once per distinct lens and size
        self._aux: dict = {}   # GPU copies of the maps (as grids) and area weights
        self.pixels = None

    def allocate(self) -> None:
        if self.use_gpu:
            self.pixels = torch.empty((self.total, 3), dtype=torch.uint8, device="cuda")
            self._bg_t = torch.as_tensor(background_u8(self.bg).astype(np.int32), device="cuda")
        else:
            self.pixels = hostmem.empty((self.total, 3), np.uint8)  # huge pages: the sampler reads at random

    def maps_of(self, cam: int):
        sc = self.scene
        if not sc.distorted[cam]:
            return None
        key = (tuple(sc.file_wh[cam]), tuple(sc.intrinsics[cam]), tuple(sc.file_intrinsics[cam]),
               tuple(sc.distortion[cam]), bool(sc.fisheye[cam]))
        if key not in self._maps:
            self._maps[key] = undistort_maps(sc, cam)
        return self._maps[key]

    def finish(self, k: int, cam: int, img) -> None:
        sc = self.scene
        h, w = int(sc.height[cam]), int(sc.width[cam])
        fw, fh = (int(v) for v in self.header_wh[k])
        shape = tuple(img.shape()) if callable(getattr(img, "shape", None)) else tuple(img.shape)
        if shape[0] != fh or shape[1] != fw:
            raise DataError(f"{sc.image_paths[cam]}: decoded size {shape[1]}x{shape[0]} differs from its header "
                            f"{fw}x{fh}; re-export the image")
        dst = slice(int(self.offsets[k]), int(self.offsets[k] + h * w))
        if self.use_gpu and isinstance(img, np.ndarray):
            finish_torch(torch.from_numpy(img).cuda(), self._bg_t, self.pixels[dst].view(h, w, 3), self.maps_of(cam),
                         self._aux)
        elif self.use_gpu:
            finish_gpu(img, self._bg_t, self.pixels[dst].view(h, w, 3), self.maps_of(cam), self._aux)
        else:
            finish_image(np.asarray(img), self.bg, self.pixels[dst].reshape(h, w, 3), self.maps_of(cam))
        self.done[k] = True


def _decode_with_dali(out: _Assembly, files, labels, shard_id, num_shards, n: int, batch: int, num_threads: int,
                      stop) -> None:
    """Decode the ``n`` images DALI reads (``files`` / ``labels`` / shard) in runs of
    :func:`_batch_size`, finishing each into ``out``; a failed run is traced to its file."""
    scene = out.scene
    bs = _batch_size(n, batch)
    runs = math.ceil(n / bs)
    depth = min(2, runs)
    try:
        pipe = decode_pipeline(files, labels, shard_id, num_shards, device="mixed" if out.use_gpu else "cpu",
                               batch_size=bs, num_threads=num_threads,
                               device_id=torch.cuda.current_device() if out.use_gpu else None,
                               prefetch_queue_depth=depth)
    except RuntimeError as e:
        raise DataError(f"{scene.root}: DALI could not build the decode pipeline: {str(e).splitlines()[0]}") from None
    scheduled = 0
    try:
        for r in range(runs):
            _check_stop(stop, scene, len(out.want))
            try:
                # scheduled API: exactly `runs` batches are decoded (run() would prefetch depth - 1
                # batches past the shard's end, decoding images nobody uses)
                if scheduled < runs:
                    pipe.schedule_run()  # the first call prefetches `depth` runs
                    scheduled += depth if r == 0 else 1
                imgs, labs = pipe.outputs()
            except RuntimeError as e:
                # the failing run is the oldest not yet returned: its files come first
                raise DataError(_find_culprit(scene, out.want[~out.done][:depth * bs], e)) from None
            if out.use_gpu:
                labs = labs.as_cpu() if hasattr(labs, "as_cpu") else labs
            for s in range(len(labs)):
                cam = int(np.asarray(labs[s]).reshape(-1)[0])
                k = out.pos_of.get(cam)
                if k is None or out.done[k]:
                    continue  # pad_last_batch duplicate
                out.finish(k, cam, imgs[s])
    finally:
        del pipe


def _masks(out: _Assembly, stop, max_pixels, into: Optional[np.ndarray] = None) -> tuple:
    """The masks of the decoded images, finished like them (their undistortion maps): (the
    valid-pixel index, (N,) valid pixels per image); the byte-per-pixel masks are written to
    ``into`` ((P,) bool) when given."""
    scene = out.scene
    if into is not None and (into.shape != (out.total,) or into.dtype != bool):
        raise ValueError(f"decode_cache: mask_out must be a ({out.total},) bool array")
    valid = np.empty(out.total, bool) if into is None else into
    counts = np.zeros(len(out.want), np.int64)
    for k, cam in enumerate(out.want):
        _check_stop(stop, scene, len(out.want))
        cam = int(cam)
        m = load_mask(scene, cam, out.maps_of(cam), max_pixels).reshape(-1)
        valid[int(out.offsets[k]):int(out.offsets[k]) + m.size] = m
        counts[k] = int(np.count_nonzero(m))
    counts.setflags(write=False)
    return valid_index(valid), counts


def _packed(scene, want, offsets, pixels, use_gpu: bool, rank: int, world_size: int, valid=None) -> ImageCache:
    """The :class:`ImageCache` of the decoded ``pixels`` of split indices ``want`` (arrays frozen;
    ``valid``: (index, counts) of a masked scene)."""
    layout = np.stack([offsets, scene.width[want], scene.height[want], want], axis=1).astype(np.int64)
    cameras = pack_cameras(scene, want)
    for a in (cameras, layout):
        a.setflags(write=False)
    if not use_gpu:
        pixels.setflags(write=False)
    return ImageCache(pixels=pixels, cameras=cameras, layout=layout, rank=rank, world_size=world_size,
                      device="cuda" if use_gpu else "cpu", valid=None if valid is None else valid[0],
                      valid_counts=None if valid is None else valid[1])


# ---------------------------------------------------------------------------------------------
# the caches a run needs, each decoded by the rule of its kind (the one place that decodes)


def decode_into(scene, ids, out: np.ndarray, threads: int = 2, batch: int = 8, stop=None, device: str = "cpu",
                mask_out: Optional[np.ndarray] = None):
    """The images ``ids`` (split indices, in order) decoded and finished into ``out`` (their
    packed pixels, (P, 3) uint8 host memory another owner allocated: a node's shared window of
    the image loader, :mod:`dali_nerf.data.imagestore`), and for a masked scene their finished
    masks into ``mask_out`` ((P,) bool, one byte a pixel; the same decode as the ray caches'
    masks). ``device="cuda"``: DALI's mixed decoder (nvJPEG for JPEG) and the finishing on the
    GPU, then one copy of these images to ``out`` (masks are finished on the host either way)."""
    if device == "cuda":  # pragma: no cover - needs a GPU
        cache = decode_cache(scene, 0, 1, device="cuda", num_threads=threads, batch=batch, indices=ids, stop=stop,
                             mask_out=mask_out)
        out[...] = cache.pixels.cpu().numpy()
        return None
    return decode_cache(scene, 0, 1, device="cpu", num_threads=threads, batch=batch, indices=ids, stop=stop, out=out,
                        mask_out=mask_out)


def eval_cache(scene, threads: int = 2, batch: int = 8) -> ImageCache:
    """Every image of an evaluation split (or subset) on the host, where the renders are compared."""
    return decode_cache(scene, 0, 1, device="cpu", num_threads=threads, batch=batch)


class CacheStore:
    """The image caches of one rank's sources: the one owner of their decoding. Every source is
    handed a store (the registry's, shared by the sources of a rank: an SS rank's cells, the study's
    samplers built one after the other in one launch; or a default one of its own, as
    ``RayLoader(scene)`` makes) and asks it for what it samples; no source decodes for itself.

    * :meth:`shard` — this rank's shard (DALI's rule for ``plan.rank`` of ``plan.world_size``): what a
      data-parallel source samples; the whole split when the world size is 1;
    * :meth:`full` — every image (a spatial-segmentation rank: a ray of any image may cross its
      cells; rank 0 of ``sync_global``, which samples for every rank);
    * :meth:`window` — the images of a streaming window of the shard, decoded anew each time (the
      stream frees it when the window is done) and cancelled by ``stop``.

    ``shard`` and ``full`` are decoded once per device (default ``plan.device``, where the rank
    samples) and kept, with the plan's decode threads and batch.

    >>> store = CacheStore(scene, plan)
    >>> store.shard() is store.shard()
    True
    """

    def __init__(self, scene, plan):
        self.scene, self.plan = scene, plan
        self._held: dict = {}

    def shard(self, device: Optional[str] = None) -> ImageCache:
        if self.plan.world_size == 1:
            return self.full(device)
        return self._get("shard", device or self.plan.device)

    def full(self, device: Optional[str] = None) -> ImageCache:
        return self._get("full", device or self.plan.device)

    def window(self, ids, stop=None) -> ImageCache:
        """The images ``ids`` (split indices, in order) of a streaming window of the plan's shard, on
        ``plan.device``; ``stop`` cancels it between decode runs (:class:`DecodeCancelled`)."""
        p = self.plan
        return decode_cache(self.scene, p.rank, p.world_size, device=p.device, num_threads=p.decode_threads,
                            batch=p.decode_batch, indices=ids, stop=stop)

    def _get(self, kind: str, device: str) -> ImageCache:
        key = (kind, device)
        if key not in self._held:
            p = self.plan
            rank, world = (p.rank, p.world_size) if kind == "shard" else (0, 1)
            self._held[key] = decode_cache(self.scene, rank, world, device=device, num_threads=p.decode_threads,
                                           batch=p.decode_batch)
        return self._held[key]

    def clear(self) -> None:
        """Drop the store's references (sources keep the caches they sample alive)."""
        self._held.clear()
