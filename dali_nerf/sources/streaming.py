"""The streaming-window engine: a shard too large for ``cache.max_bytes`` sampled through a
rolling, double-buffered window of decoded images.

The shard's N images are sampled through *windows* of at most ``W`` images, ``W`` the largest
count for which two windows of the shard's ``W`` largest images fit in ``max_bytes``
(:func:`plan_window_images`; a ConfigError if not even one image per window fits). Cycle ``c`` is
a (seed, rank, c) hash shuffle of the shard's images cut into ``m = ceil(N / W)`` windows of
near-equal size (:func:`window_plan`), so every cycle groups the images differently. Window
``j`` of cycle ``c`` owns a contiguous block of stream positions: its pixel count ``P_j`` (epoch
mode, and random mode by default; a masked scene's windows count their valid pixels, and a window
whose images are all masked owns none) or ``rays_per_window`` (random mode; refused for a window
of only fully masked images), so a cycle is ``P``
positions (or ``m * rays_per_window``) and position ``s`` maps to (cycle, window, local offset)
with no state. Within a window the operator runs over that window's ImageCache with the window
key :func:`dali_nerf.data.seeds.window_key` ``(seed, rank, c, j)`` as its seed and the local offset as
``start``: epoch mode visits each of the window's pixels once (one Feistel permutation of
``P_j``), so cycle ``e`` = epoch ``e`` still visits every pixel of the shard exactly once.

Threads and memory: :class:`WindowStream` owns its decode threads (one per window, each with its
own stop event) and holds at most two windows — ``cur`` (rays are sampled from it) and ``nxt``
(decoded in the background while ``cur`` is consumed): a bounded buffer of one window ahead.
When ``cur``'s last run is sampled, ``cur`` (cache + ray graph) is freed, ``nxt`` becomes current
and the decode of the one after it starts. Each window gets its own ray graph with
``ceil(rest / rays_per_run)`` runs of near-equal size and at most ``runs - 1`` prefetched, so
nothing is sampled past a window's end. ``close()`` cancels an in-flight decode (between decode
runs) and joins the thread. The budget counts window caches (pixels + camera rows); DALI's
transient decode buffers (two runs of up to ``2 * decode_batch`` images) come on top.

The engine knows nothing of the loader that consumes it: it is built from the stream's key and
the sampling settings, and hands out chunks ``(start, end, {key: tensor})``, one ray-graph run
per :meth:`WindowStream.produce` call.

>>> ws = WindowStream(CacheStore(scene, plan), plan, image_ids=ids, px_per_image=px, window_images=4, rays_per_window=0)
>>> start, end, chunk = ws.produce(0)      # the first run of window (0, 0)
>>> ws.close()
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import warnings
from typing import Optional, Sequence

import numpy as np
import torch

from dali_nerf.errors import ConfigError
from dali_nerf.data.imagecache import DecodeCancelled
from dali_nerf.pipelines.rays import ray_pipeline, release_pipeline
from dali_nerf.data.seeds import window_key, window_order_keys
from dali_nerf.sources.base import CLOSE_TIMEOUT_S
from dali_nerf.sources.dalirun import run_graph

__all__ = ["WindowStream", "window_plan", "plan_window_images", "WINDOW_IMAGE_OVERHEAD"]

WINDOW_IMAGE_OVERHEAD = 18 * 4 + 4 * 8
"""Bytes of one image's cameras + layout rows in a window cache."""


def window_plan(image_ids, window_images: int, seed: int, rank: int, cycle: int) -> list:
    """Streaming windows of one cycle: the shard's split indices in a (seed, rank, cycle) shuffle,
    cut into ``m = ceil(N / W)`` windows whose sizes differ by at most one (each <= W).

    Args:
        image_ids: (N,) int64 split indices of the rank's shard; window_images: W >= 1.
    Returns:
        list of m (n_j,) int64 arrays (a partition of ``image_ids``).

    >>> [w.tolist() for w in window_plan(np.arange(5), 2, seed=0, rank=0, cycle=0)]   # doctest: +SKIP
    [[3, 0, 4], ...]
    """
    ids = np.asarray(image_ids, np.int64)
    keys = window_order_keys(seed, rank, cycle, ids)
    order = ids[np.argsort(keys, kind="stable")]
    return np.array_split(order, math.ceil(len(ids) / int(window_images)))


def plan_window_images(px_per_image, max_bytes: int, window_images: int = 0, rank: int = 0) -> int:
    """Images per streaming window W: the most such that two windows of the shard's W largest
    images fit in ``max_bytes`` (``window_images`` > 0 asks for exactly that many, checked).

    Args:
        px_per_image: (N,) pixels of each image of the shard.
    Raises:
        ConfigError: not even two one-image windows fit, or ``window_images`` is too large.
    """
    per = np.sort(np.asarray(px_per_image, np.int64) * 3 + WINDOW_IMAGE_OVERHEAD)[::-1]
    fits = int(np.searchsorted(2 * np.cumsum(per), int(max_bytes), side="right"))
    if fits == 0:
        raise ConfigError(
            f"cache.max_bytes={max_bytes}: streaming keeps two windows decoded and rank {rank}'s largest image "
            f"needs {int(per[0])} bytes; raise cache.max_bytes to at least {2 * int(per[0])} or use a downscale")
    if window_images:
        if window_images > fits:
            raise ConfigError(
                f"cache.window_images={window_images}: two windows of {window_images} images need up to "
                f"{2 * int(np.cumsum(per)[min(window_images, len(per)) - 1])} bytes > cache.max_bytes={max_bytes}; "
                f"use at most {fits} (or 0 = automatic)")
        return min(int(window_images), len(per))
    return min(fits, len(per))


class _Window:
    """One decoded window: its cache, its place in the stream and (lazily) its ray graph."""

    def __init__(self, cycle, index, ids, offset, length, key, nbytes):
        self.cycle, self.index, self.ids = cycle, index, ids
        self.offset, self.length, self.key, self.nbytes = offset, length, key, nbytes
        self.cache = None
        self.pipe = None
        self.next_local = 0  # window-local stream position of the pipeline's next run
        self.run_size = 0
        self.prefetch = 0
        self.thread: Optional[threading.Thread] = None
        self.stop = threading.Event()
        self.error: Optional[BaseException] = None
        self.counted = False  # nbytes included in the stream's bytes_held

    @property
    def end(self) -> int:
        return self.offset + self.length


class WindowStream:
    """The stream of one rank's shard through decoded windows (see the module doc).

    Args:
        store: the rank's :class:`~dali_nerf.data.imagecache.CacheStore`, which decodes each window
            (:meth:`~dali_nerf.data.imagecache.CacheStore.window`).
        plan: the loader's :class:`~dali_nerf.data.plan.SamplingPlan` (the shard, the stream's seed
            and mode, device, threads, rays per run, prefetch (capped per window)).
        image_ids: (N,) split indices of the shard; px_per_image: (N,) their pixel counts.
        window_images: W (from :func:`plan_window_images`); rays_per_window: 0 = pixel count.
        output_map: batch keys of the chunks.
        positions_per_image: (N,) what the streams draw from in each (a masked scene's valid
            pixels; None: the pixels).
    """

    def __init__(self, store, plan, image_ids, px_per_image, window_images: int, rays_per_window: int,
                 output_map: Sequence[str] = ("origins", "directions", "rgb", "indices", "near", "far"),
                 positions_per_image=None):
        self.store, self.plan = store, plan
        self.device_id = torch.cuda.current_device() if self.plan.device == "cuda" else None
        self.output_map = tuple(output_map)
        self.ids = np.asarray(image_ids, np.int64)
        self.px = {int(i): int(p) for i, p in zip(self.ids, px_per_image)}
        per = px_per_image if positions_per_image is None else positions_per_image
        self.valid = {int(i): int(p) for i, p in zip(self.ids, per)}
        self.W = int(window_images)
        self.m = math.ceil(len(self.ids) / self.W)
        self.rays_per_window = int(rays_per_window)
        self._plans = {}
        self.cycle_len = int(self._plan(0)[2][-1])  # the same every cycle (a partition of the shard)
        self.cur: Optional[_Window] = None
        self.nxt: Optional[_Window] = None
        self._lock = threading.Lock()
        self.bytes_held = 0
        self.peak_bytes = 0
        self.windows_decoded = 0
        self.decode_wait_s = 0.0

    # -- the deterministic window sequence ------------------------------------------------------
    def _plan(self, cycle):
        plan = self._plans.get(cycle)
        if plan is None:
            if len(self._plans) > 4:
                self._plans.clear()
            ws = window_plan(self.ids, self.W, self.plan.seed, self.plan.rank, cycle)
            lens = [sum(self.valid[int(i)] for i in w) if self.rays_per_window == 0 else self.rays_per_window
                    for w in ws]  # its pixels (a masked scene's: the valid ones), or random mode's fixed share
            offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            plan = self._plans[cycle] = (ws, lens, offs)
        return plan

    def _window(self, cycle, j) -> _Window:
        ws, lens, offs = self._plan(cycle)
        ids = ws[j]
        nbytes = sum(self.px[int(i)] for i in ids) * 3 + len(ids) * WINDOW_IMAGE_OVERHEAD
        key = window_key(self.plan.seed, self.plan.rank, cycle, j)
        return _Window(cycle, j, ids, cycle * self.cycle_len + int(offs[j]), int(lens[j]), key, nbytes)

    def locate(self, pos: int):
        """(cycle, window index) of the window holding stream position ``pos``."""
        cycle, q = divmod(int(pos), self.cycle_len)
        _, _, offs = self._plan(cycle)
        j = int(np.searchsorted(offs, q, side="right") - 1)
        return cycle, min(j, self.m - 1)

    def _successor(self, w: _Window):
        return (w.cycle, w.index + 1) if w.index + 1 < self.m else (w.cycle + 1, 0)

    # -- decoding ---------------------------------------------------------------------------------
    def _decode(self, w: _Window) -> None:
        with self._lock:
            self.bytes_held += w.nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes_held)
            w.counted = True
        try:
            if self.plan.device == "cuda" and threading.current_thread() is not threading.main_thread():  # pragma: no cover
                torch.cuda.set_device(self.device_id)  # the current device is per thread
            w.cache = self.store.window(w.ids, stop=w.stop)
            with self._lock:
                self.windows_decoded += 1
        except DecodeCancelled:
            pass
        except BaseException as e:  # re-raised in the consumer thread by _switch
            w.error = e

    def _prefetch(self, cycle, j) -> None:
        w = self._window(cycle, j)
        w.thread = threading.Thread(target=self._decode, args=(w,), daemon=True,
                                    name=f"dali_nerf-stream-r{self.plan.rank}-c{cycle}-w{j}")
        self.nxt = w
        w.thread.start()

    def _release(self, w: Optional[_Window]) -> None:
        if w is None:
            return
        w.stop.set()
        if w.thread is not None:
            w.thread.join(timeout=CLOSE_TIMEOUT_S)  # the decode checks w.stop between its runs
            if w.thread.is_alive():  # it holds its own references: dropping ours frees nothing under it
                warnings.warn(f"{w.thread.name}: the window decode did not stop within {CLOSE_TIMEOUT_S:g} s; it is "
                              f"left to finish on its own", ResourceWarning, stacklevel=2)
            w.thread = None
        if w.pipe is not None:
            pipe, w.pipe = w.pipe, None
            release_pipeline(pipe)
            del pipe
        w.cache = None
        with self._lock:
            if w.counted:
                self.bytes_held -= w.nbytes
                w.counted = False

    def _switch(self, cycle, j) -> _Window:
        """Make window (cycle, j) current: take the prefetched one or decode it synchronously,
        then start decoding its successor in the background."""
        cur = self.cur
        if cur is not None and (cur.cycle, cur.index) == (cycle, j):
            return cur
        self.cur = None
        self._release(cur)
        nxt, self.nxt = self.nxt, None
        if nxt is not None and (nxt.cycle, nxt.index) == (cycle, j):
            t = time.perf_counter()
            nxt.thread.join()
            nxt.thread = None
            self.decode_wait_s += time.perf_counter() - t
            w = nxt
        else:
            self._release(nxt)
            w = self._window(cycle, j)
            t = time.perf_counter()
            self._decode(w)
            self.decode_wait_s += time.perf_counter() - t
        if w.error is not None:
            err = w.error
            w.error = None
            self._release(w)
            raise err
        self.cur = w
        self._prefetch(*self._successor(w))
        return w

    # -- sampling ---------------------------------------------------------------------------------
    def produce(self, pos: int):
        """Sample the run starting at stream position ``pos`` (one ray-graph run):
        ``(pos, end, {key: tensor (end - pos, ...)})``."""
        w = self.cur
        if w is None or not w.offset <= pos < w.end:
            w = self._switch(*self.locate(pos))
        t = pos - w.offset
        if w.cache.num_valid == 0:  # only with rays_per_window: a window of masked images has nothing to sample
            raise ConfigError(f"cache.rays_per_window={self.rays_per_window}: streaming window {w.index} of cycle "
                              f"{w.cycle} (rank {self.plan.rank}) holds only fully masked images; use "
                              f"cache.rays_per_window=0 (windows own their valid pixels)")
        if w.pipe is None or w.next_local != t:
            if w.pipe is not None:
                pipe, w.pipe = w.pipe, None
                release_pipeline(pipe)
                del pipe
            rest = w.length - t
            n_runs = math.ceil(rest / self.plan.rays_per_run)
            w.run_size = math.ceil(rest / n_runs)
            w.prefetch = min(self.plan.prefetch, n_runs - 1)  # no runs computed past the window's end
            # the plan's graph of the shard's stream, keyed by the window, over its positions
            w.pipe = ray_pipeline(w.cache, dataclasses.replace(self.plan.ray_graph(first_start=t), seed=w.key,
                                                               rays=w.run_size, prefetch=w.prefetch))
            w.next_local = t
        consumed, run = run_graph(w.pipe, self.plan.device, self.output_map, copy=w.prefetch == 0)
        if consumed != w.run_size:
            raise RuntimeError(f"ray_sampler consumed {consumed} positions for {w.run_size} rays")
        n = min(w.run_size, w.length - t)
        chunk = {k: v[:n] for k, v in run.items()}
        w.next_local += w.run_size
        if pos + n >= w.end:  # window done: switch now so its successor's decode can start early
            self._switch(*self._successor(w))
        return pos, pos + n, chunk

    def info(self) -> dict:
        return {"streaming": True, "window_images": self.W, "windows_per_cycle": self.m,
                "windows_decoded": self.windows_decoded, "bytes_held": self.bytes_held,
                "peak_bytes": self.peak_bytes, "decode_wait_s": self.decode_wait_s}

    def close(self) -> None:
        """Cancel an in-flight decode, join the thread and free both windows. Idempotent."""
        nxt, self.nxt = self.nxt, None
        cur, self.cur = self.cur, None
        self._release(nxt)
        self._release(cur)
