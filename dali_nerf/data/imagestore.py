"""Decoded whole images for the image loader: held once per node, under a host budget, decoded
ahead of use by a background thread (the windows of :mod:`dali_nerf.data.imageorder`).

Two regimes, chosen by the budget (``max_bytes`` of decoded pixels per node):

* **everything fits**: the split is decoded once, in chunks that follow the stream from the start
  position (the first chunk is the images of the loader's first run alone, the steps its first
  batch is handed over with, so that batch waits for the decode of those, not of a whole chunk or
  the split), and kept;
* **windows**: window ``(e, j)`` (its images, :func:`~dali_nerf.data.imageorder.window_bounds`) is
  decoded when the loader reaches the previous window and freed when it has passed it: at most
  two windows are held (``peak_bytes``), each at most half the budget; an image is decoded again
  in every epoch.

What decoding holds, and when it is let go: each chunk or window is decoded by a DALI pipeline
built for it and deleted after it (:func:`~dali_nerf.data.imagecache.decode_into`), on the CPU in
DALI runs of at most :data:`DECODE_RUN_BYTES` of decoded pixels (:func:`decode_run_images`: DALI
keeps its runs' host buffers in its pool for the life of the process, so the run size bounds that
for good; nvJPEG runs, on the GPU, keep the plan's decode batch). Kept
whole, once the last chunk is in, the store's decode thread gives back what is left
(:func:`release_decode_memory`: glibc's free heap pages; after nvJPEG runs DALI's unused device
and pinned pool blocks too) and ends; the store is then ``complete`` (the loader's
``stats()["decode_closed"]``; set as the thread's last step) and holds only the node's shared
blocks. Through windows the thread lives on (each window is decoded in its turn, every epoch).

Each chunk or window is one :class:`~dali_nerf.data.nodeshare.Block` of the node: every local rank
decodes its part (:func:`dali_nerf.data.imagecache.decode_into`, DALI, finished as every cache is:
composited, undistorted, downscaled; nvJPEG on a rank's GPU when the loader runs on CUDA) into the
shared memory and all use the whole. A masked scene's block holds, after the chunk's pixels (3
bytes each), their finished masks, one byte a pixel (0 / 1, read as bool), written by the same
decode (the masks the ray caches pack into their valid-pixel index).

>>> store = ImageStore(scene, stream, share, window=64, keep_all=False, start=0)
>>> views = store.images(positions)      # [(H, W, 3) uint8], waiting for their window if needed
>>> views, masks = store.views(positions)  # and [(H, W) bool] (None each when unmasked)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
import time
from typing import Dict, List, Optional

import numpy as np

from dali_nerf.data.imagecache import DecodeCancelled, decode_into
from dali_nerf.data.imageorder import ImageStream, window_bounds

__all__ = ["ImageStore", "plan_windows", "bytes_per_pixel", "decode_run_images", "release_decode_memory",
           "DECODE_RUN_BYTES"]

DECODE_RUN_BYTES = 8 << 20
"""Decoded bytes one DALI CPU decode run of the store aims at (:func:`decode_run_images`): DALI keeps
the host buffers of its runs (its memory pool, :func:`dali_nerf.data.hostmem.dali_host_pool`) for
the life of the process, about two runs' outputs and their files, so big runs of big images cost
every rank that memory for good (measured: ~190 -> ~120 MiB of a rank's anonymous memory with
1600x1200 images, runs of 8 -> 1)."""


def bytes_per_pixel(scene) -> int:
    """Bytes a decoded pixel takes in the store: 3 (RGB), plus 1 (its mask) in a masked scene."""
    return 3 + (scene.mask_paths is not None)


def plan_windows(scene, images_per_step: int, max_bytes: int, local_world: int = 1, decode_batch: int = 8):
    """``(keep_all, window)``: keep the whole split when its decoded pixels (and masks) fit ``max_bytes``
    (then ``window`` is the decode chunk: max(G, decode_batch x local ranks) images); else the
    largest window M for which two windows of the M largest images fit. Raises ValueError (the
    loader words it) when even a window of one global step (``images_per_step`` images) does not."""
    px = np.sort((scene.width * scene.height).astype(np.int64) * bytes_per_pixel(scene))[::-1]
    g = int(images_per_step)
    if int(px.sum()) <= max_bytes:
        return True, max(g, int(decode_batch) * int(local_world))
    m = int(np.searchsorted(np.cumsum(px) * 2, max_bytes, side="right"))
    if m < g:
        need = int(px[:g].sum()) * 2
        raise ValueError(f"two windows of one step's {g} images need {need} bytes, over the budget of {max_bytes}")
    return False, m


def decode_run_images(scene, threads: int, batch: int) -> int:
    """Images per DALI decode run of the store: as many of the split's largest images as fit
    :data:`DECODE_RUN_BYTES`, at least ``threads`` (one per decode thread) and at most ``batch``
    (the plan's decode batch). The run size changes no pixel, only how DALI's runs are cut.

    >>> decode_run_images(scene_1600x1200, threads=1, batch=8), decode_run_images(scene_400x400, 2, 8)
    (1, 8)
    """
    largest = int((scene.width * scene.height).max()) * 3
    return int(max(1, min(int(batch), max(int(threads), DECODE_RUN_BYTES // max(1, largest)))))


def release_decode_memory(device: str = "cpu") -> dict:
    """Give back what decoding left behind once nothing more will be decoded, best effort: after
    nvJPEG runs (``device="cuda"``) DALI's unused pool blocks (``nvidia.dali.backend.
    ReleaseUnusedMemory``: its device and pinned pools, which a CPU decode does not use; only when
    DALI is already imported), and glibc's free heap pages (``malloc_trim(0)``, where the C library
    has it). Returns which ran, e.g. ``{"dali": False, "malloc_trim": True}``, and ``"error"`` (one
    line) where one failed: nothing here may fail a loader that holds every image."""
    done = {"dali": False, "malloc_trim": False}
    backend = sys.modules.get("nvidia.dali.backend")
    if device == "cuda" and backend is not None and hasattr(backend, "ReleaseUnusedMemory"):  # pragma: no cover - GPU
        try:
            backend.ReleaseUnusedMemory()
            done["dali"] = True
        except Exception as e:
            done["error"] = f"ReleaseUnusedMemory: {e}".splitlines()[0]
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        trim = None
    if trim is not None:
        try:
            trim(0)
            done["malloc_trim"] = True
        except Exception as e:  # pragma: no cover - a C library whose symbol misbehaves
            done["error"] = f"malloc_trim: {e}".splitlines()[0]
    return done


class _Chunk:
    """Images ``ids`` in one block: image k's pixels at bytes ``3 offsets[k]`` .. ``3 offsets[k + 1]``,
    its mask (masked scenes) at ``mask_at + offsets[k]`` .. ``mask_at + offsets[k + 1]``."""

    def __init__(self, name: str, ids: np.ndarray, pixels: np.ndarray, masked: bool):
        self.name, self.ids = name, ids
        self.offsets = np.concatenate([[0], np.cumsum(pixels)]).astype(np.int64)  # in pixels
        self.mask_at = 3 * int(self.offsets[-1])
        self.nbytes = (3 + bool(masked)) * int(self.offsets[-1])
        self.masked = bool(masked)
        self.block = None
        self.ready = False

    def pixels(self, array: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """(P, 3) uint8 the pixels of images lo..hi-1 in the block's ``array``."""
        return array[3 * self.offsets[lo]:3 * self.offsets[hi]].reshape(-1, 3)

    def mask(self, array: np.ndarray, lo: int, hi: int) -> Optional[np.ndarray]:
        """(P,) bool the masks of images lo..hi-1 (None unmasked)."""
        if not self.masked:
            return None
        return array[self.mask_at + self.offsets[lo]:self.mask_at + self.offsets[hi]].view(bool)


class ImageStore:
    """The module doc's store, seen from one rank. ``images(positions)`` returns views of the
    decoded images (valid until the loader moves past their window); ``close()`` stops the thread
    and releases every block.

    Args:
        scene: the split; stream: its :class:`~dali_nerf.data.imageorder.ImageStream`.
        share: the node's :class:`~dali_nerf.data.nodeshare.NodeShare`.
        window: images per window (windows) or per decode chunk (keep_all).
        keep_all: everything fits (module doc).
        start: the first global position the loader will ask for.
        first: keep_all: images of the first chunk: the loader's first run's (B x W images a step,
            times its steps a run; the first batch is handed over with its run); 0 or more than
            ``window``: ``window``.
        threads, batch: DALI decode threads and images per decode run.
        tag: prefix of the block names (the same on every local rank).
        device: where a rank decodes its part: "cpu" (DALI's CPU decoder) or "cuda" (nvJPEG on the
            rank's GPU, copied into the node's host block).
    """

    def __init__(self, scene, stream: ImageStream, share, window: int, keep_all: bool, start: int = 0,
                 threads: int = 2, batch: int = 8, tag: str = "", device: str = "cpu", first: int = 0):
        self.scene, self.stream, self.share, self.tag, self.device = scene, stream, share, tag, device
        self._gpu = None
        if device == "cuda":  # pragma: no cover - needs a GPU; the thread decodes on the rank's device
            import torch

            self._gpu = torch.cuda.current_device()
        self.window, self.keep_all = int(window), bool(keep_all)
        self.first = int(first) if 0 < int(first) < self.window else self.window
        self.threads, self.batch = int(threads), int(batch)
        # images per DALI decode run: cut by bytes on the CPU, where DALI's host pool keeps the runs'
        # outputs; nvJPEG ("cuda") decodes into device memory and gains from whole batches
        self.run_images = decode_run_images(scene, self.threads, self.batch) if device == "cpu" else self.batch
        self.n = scene.num_images
        self.bounds = window_bounds(self.n, self.window)
        self.nw = len(self.bounds) - 1
        self._px = (scene.width * scene.height).astype(np.int64)  # pixels per image
        self.masked = scene.mask_paths is not None
        self._cv = threading.Condition()
        self._chunks: Dict[object, _Chunk] = {}
        self._where: Dict[int, _Chunk] = {}   # keep_all: image -> its chunk
        self._need = self._window_of(int(start))
        self._error: Optional[BaseException] = None
        self._stop = threading.Event()
        self.peak_bytes = 0
        self.decode_s = 0.0
        self.complete = False  # keep_all: every image of the split is held, its memory given back (the thread ends next)
        self.released: Optional[dict] = None  # what release_decode_memory() gave back at completion
        self._thread = threading.Thread(target=self._run, args=(int(start),), name="dali_nerf-image-windows", daemon=True)
        self._thread.start()

    # ---- the windows ---------------------------------------------------------------------------
    def _window_of(self, position: int) -> int:
        e, h = divmod(int(position), self.n)
        return e * self.nw + int(np.searchsorted(self.bounds, h, side="right")) - 1

    def _window_ids(self, gw: int) -> np.ndarray:
        e, j = divmod(gw, self.nw)
        return self.stream.order(e)[self.bounds[j]:self.bounds[j + 1]]

    def _keep_all_chunks(self, start: int) -> List[np.ndarray]:
        """Every image once, in stream order from ``start``, cut into a first chunk of ``first`` images
        and chunks of ``window`` after it."""
        ids = self.stream.images(np.arange(start, start + 2 * self.n))
        _, seen = np.unique(ids, return_index=True)
        order = ids[np.sort(seen)]
        return [order[:self.first]] + [order[i:i + self.window] for i in range(self.first, self.n, self.window)]

    def _decode(self, chunk: _Chunk) -> None:
        t0 = time.perf_counter()
        blk = self.share.block(chunk.name, chunk.nbytes)

        def fill(array, part, parts):
            k = len(chunk.ids)
            lo, hi = k * part // parts, k * (part + 1) // parts
            if hi > lo:
                decode_into(self.scene, chunk.ids[lo:hi], chunk.pixels(array, lo, hi), threads=self.threads,
                            batch=self.run_images, stop=self._stop, device=self.device, mask_out=chunk.mask(array, lo, hi))

        blk.fill_part(fill)
        blk.wait_ready()
        chunk.block = blk
        self.decode_s += time.perf_counter() - t0

    def _publish(self, key, chunk: _Chunk) -> None:
        with self._cv:
            chunk.ready = True
            self._chunks[key] = chunk
            if self.keep_all:
                for i in chunk.ids:
                    self._where[int(i)] = chunk
            held = sum(c.nbytes for c in self._chunks.values())
            self.peak_bytes = max(self.peak_bytes, held)
            self._cv.notify_all()

    def _run(self, start: int) -> None:
        try:
            if self._gpu is not None:  # pragma: no cover - needs a GPU (a new thread starts on device 0)
                import torch

                torch.cuda.set_device(self._gpu)
            if self.keep_all:
                for k, ids in enumerate(self._keep_all_chunks(start)):
                    if self._stop.is_set():
                        return
                    chunk = _Chunk(f"{self.tag}all{k}", ids, self._px[ids], self.masked)
                    self._decode(chunk)
                    self._publish(k, chunk)
                self._finished()
                return
            gw = self._window_of(start)
            while not self._stop.is_set():
                with self._cv:  # at most two windows: decode gw once the loader is inside gw - 1
                    while not self._stop.is_set() and gw > self._need + 1:
                        self._cv.wait(0.5)
                    self._free_before(self._need)
                if self._stop.is_set():
                    return
                ids = self._window_ids(gw)
                chunk = _Chunk(f"{self.tag}w{gw}", ids, self._px[ids], self.masked)
                self._decode(chunk)
                self._publish(gw, chunk)
                gw += 1
        except DecodeCancelled:
            pass
        except BaseException as e:  # handed to the loader at its next images()
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _finished(self) -> None:
        """keep_all, the whole split held: nothing is decoded again, so what decoding left behind
        is given back (module doc) and the store says it is complete."""
        self.released = release_decode_memory(self.device)
        with self._cv:
            self.complete = True
            self._cv.notify_all()

    def _free_before(self, gw: int) -> None:
        for key in [k for k in self._chunks if k < gw]:
            self._chunks.pop(key).block.release()

    # ---- the loader's side -----------------------------------------------------------------------
    def images(self, positions, ids=None) -> list:
        """[(H, W, 3) uint8 views] of the images at global ``positions`` (their ids ``ids`` when
        known), waiting for their windows; marks the windows before them as done."""
        return self.views(positions, ids)[0]

    def views(self, positions, ids=None) -> tuple:
        """``(images, masks)``: :meth:`images` and [(H, W) bool views] of their masks (None for each
        image of an unmasked scene)."""
        positions = np.asarray(positions, np.int64)
        ids = self.stream.images(positions) if ids is None else np.asarray(ids, np.int64)
        wins = [self._window_of(p) for p in positions]
        out, masks = [], []
        with self._cv:
            if not self.keep_all and min(wins) > self._need:
                self._need = min(wins)
                self._cv.notify_all()
            for i, gw in zip(ids, wins):
                while True:
                    if self._error is not None:
                        raise self._error
                    chunk = self._where.get(int(i)) if self.keep_all else self._chunks.get(gw)
                    if chunk is not None:
                        break
                    if not self._thread.is_alive():
                        raise RuntimeError("the image store's decode thread stopped")
                    self._cv.wait(0.5)
                k = int(np.flatnonzero(chunk.ids == i)[0])
                h, w = int(self.scene.height[i]), int(self.scene.width[i])
                out.append(chunk.pixels(chunk.block.array, k, k + 1).reshape(h, w, 3))
                m = chunk.mask(chunk.block.array, k, k + 1)
                masks.append(None if m is None else m.reshape(h, w))
        return out, masks

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        self._thread.join(timeout=timeout)
        with self._cv:
            for c in self._chunks.values():
                if c.block is not None:
                    c.block.release()
            self._chunks.clear()
            self._where.clear()
