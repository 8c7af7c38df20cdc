"""RayLoader: the prefetching iterator over our DALI ray pipeline.

The stream is defined per *ray position*: position ``s`` of rank ``r`` is a pixel of the rank's
shard chosen by the operator from ``(mode, seed, rank, s)`` alone (see ARCHITECTURE.md), and step
``k`` (counted from position 0) is positions ``[k * B, (k + 1) * B)``. Each DALI run samples
``K = ceil(rays_per_run / B)`` steps' worth (``K * B`` rays) to amortise the fixed per-run cost;
``__next__`` hands out zero-copy step slices of the run's outputs. Neither ``prefetch`` nor
``rays_per_run`` changes the stream, and ``state_dict()`` resumes it exactly.

Epoch mode: permutation ``e`` of the rank's ``P`` pixels occupies positions ``[e * P, (e + 1) * P)``.
``set_epoch(e)`` moves to position ``e * P`` (the start of permutation ``e``). An epoch is
``len(loader) = ceil(max_r P_r / B)`` steps — the same on every rank, so DDP ranks stay in lockstep
— and its last step may run past ``(e + 1) * P`` into the next permutation (the stream is
continuous; without ``set_epoch`` it simply continues). The first ``P_r`` rays after ``set_epoch``
visit every pixel of rank r's shard exactly once; shards are disjoint, so across ranks every pixel
of the split is visited exactly once.

Streaming (``max_bytes`` smaller than the rank's decoded shard, ``cache.max_bytes`` in configs):
the shard's N images are sampled through *windows* of at most ``W`` images, ``W`` the largest
count for which two windows of the shard's ``W`` largest images fit in ``max_bytes``
(:func:`plan_window_images`; a ConfigError if not even one image per window fits). Cycle ``c`` is
a (seed, rank, c) hash shuffle of the shard's images cut into ``m = ceil(N / W)`` windows of
near-equal size (:func:`window_plan`), so every cycle groups the images differently. Window
``j`` of cycle ``c`` owns a contiguous block of stream positions: its pixel count ``P_j`` (epoch
mode, and random mode by default) or ``rays_per_window`` (random mode), so a cycle is ``P``
positions (or ``m * rays_per_window``) and position ``s`` maps to (cycle, window, local offset)
with no state. Within a window the operator runs over that window's ImageCache with the window
key ``mix(seed, rank, c, j)`` as its seed and the local offset as ``start``: epoch mode visits
each of the window's pixels once (one Feistel permutation of ``P_j``), so cycle ``e`` = epoch
``e`` still visits every pixel of the shard exactly once (``set_epoch``/``len`` unchanged).
Double buffering: while rays come from window ``w`` a background thread decodes its successor
with the DALI decode pipeline (``decode_cache(indices=...)``); when ``w``'s last run is sampled,
``w`` (cache + ray pipeline) is freed, the successor becomes current and the decode of the one
after it starts, so at most two windows are decoded at any time (``stats()["peak_bytes"]``).
A step may straddle two windows (its rays are concatenated). Each window gets its own ray
pipeline with ``ceil(rest / rays_per_run)`` runs of near-equal size and at most ``runs - 1``
prefetched, so nothing is sampled past a window's end. The stream depends only on (seed, rank,
world_size, W, rays_per_window, position): ``prefetch`` / ``rays_per_run`` do not change it,
``state_dict()`` adds ``window_images`` / ``rays_per_window``, and resuming decodes the window
holding the saved position synchronously. ``close()`` cancels an in-flight decode (between
decode runs) and joins the thread. The budget counts window caches (pixels + camera rows);
DALI's transient decode buffers (two runs of up to ``2 * decode_batch`` images) come on top.

>>> loader = RayLoader(scene, rays_per_batch=4096, rank=0, world_size=1, seed=0, prefetch=2)
>>> batch = next(loader)
>>> batch["origins"].shape, batch["indices"].dtype
(torch.Size([4096, 3]), torch.int64)
>>> loader.stats()["stall_fraction"] < 0.05
True
"""

from __future__ import annotations

import math
import threading
import time
from time import perf_counter
from collections import deque
from typing import Optional, Sequence

import numpy as np
import torch

from .errors import ConfigError

__all__ = ["RayLoader", "BatchStats", "BATCH_KEYS", "resolve_device", "dali_to_torch", "window_plan", "plan_window_images"]

BATCH_KEYS = ("origins", "directions", "rgb", "indices", "near", "far")
"""Keys a batch may carry (near/far only when the scene has bounds)."""


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when available else "cpu"; "cuda" without a GPU is a ConfigError."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r}: use cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda: no CUDA device is visible; use device=cpu")
    return device


class BatchStats:
    """Time blocked in ``__next__`` vs wall time since the first ``__next__`` (shared by every source).

    ``as_dict()`` -> {"steps", "wait_s", "stall_fraction", "rays_per_s", "elapsed_s", "runs"}.
    """

    def __init__(self):
        self.steps = 0
        self.wait_s = 0.0
        self.rays = 0
        self.runs = 0
        self.t0: Optional[float] = None

    def start(self) -> float:
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        return now

    def stop(self, t_enter: float, rays: int) -> None:
        self.wait_s += time.perf_counter() - t_enter
        self.steps += 1
        self.rays += rays

    def as_dict(self) -> dict:
        elapsed = 0.0 if self.t0 is None else time.perf_counter() - self.t0
        return {
            "steps": self.steps,
            "wait_s": self.wait_s,
            "stall_fraction": (self.wait_s / elapsed) if elapsed > 0 else 0.0,
            "rays_per_s": (self.rays / elapsed) if elapsed > 0 else 0.0,
            "elapsed_s": elapsed,
            "runs": self.runs,
        }


def _positive(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ConfigError(f"{name}={v!r}: must be an integer > 0")


def check_common(scene, rays_per_batch, rank, world_size, seed, prefetch, mode):
    """Shared argument checks of every batch source (one-line ConfigError)."""
    _positive("rays_per_batch", rays_per_batch)
    _positive("world_size", world_size)
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank!r}: must be in [0, world_size={world_size})")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed={seed!r}: must be an integer >= 0")
    if not isinstance(prefetch, (int, np.integer)) or prefetch < 0:
        raise ConfigError(f"prefetch={prefetch!r}: must be an integer >= 0")
    if mode not in ("random", "epoch"):
        raise ConfigError(f"mode={mode!r}: use random or epoch")


def dali_to_torch(tl, device: str, copy: bool = False) -> torch.Tensor:
    """One pipeline output (a batch of 1 sample) as a torch tensor on ``device``.

    CPU: a zero-copy view (DALI 2.4's asynchronous executor gives each run new buffers, kept alive
    while referenced); ``copy``: the synchronous executor (prefetch 0) reuses its output buffers
    on the next run, so the view is copied. CUDA: a device-to-device copy into a torch tensor.
    """
    if device == "cuda":  # pragma: no cover - needs a GPU
        from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

        t = tl[0] if hasattr(tl, "__getitem__") else tl.as_tensor()
        dst = torch.empty(tuple(t.shape()), dtype=to_torch_type[t.dtype], device="cuda")
        feed_ndarray(t, dst, cuda_stream=torch.cuda.current_stream())
        return dst
    t = torch.from_numpy(np.asarray(tl[0]))
    return t.clone() if copy else t


class BatchSource:
    """What every batch source shares (RayLoader, the baselines, the SS sources): iteration,
    ``stats()`` from a :class:`BatchStats` in ``self._stats``, the context manager, and ``close()``
    on garbage collection. Subclasses implement ``__next__`` and ``close()`` (idempotent)."""

    def __iter__(self):
        return self

    def stats(self) -> dict:
        """{"steps", "wait_s", "stall_fraction", "rays_per_s", "elapsed_s", "runs"} since the first next()."""
        return self._stats.as_dict()

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class RayLoader(BatchSource):
    """Prefetching iterator of ray batches from our DALI pipeline (infinite; see module doc).

    Args:
        scene: the split to sample (a :class:`~dali_nerf.scenes.Scene`).
        rays_per_batch: B, rays per step for this rank.
        rank, world_size: this rank's shard (DALI's rule, see ``pipelines/decode.py``).
        seed: stream key; mode: "random" (iid) | "epoch" (each pixel once per epoch).
        prefetch: DALI runs computed ahead of the consumer (0 = synchronous).
        device: "cpu" | "cuda" (nvJPEG decode, GPU op, CUDA tensors) | "auto".
        num_threads: DALI CPU threads.
        rays_per_run: rays per DALI run, rounded up to a multiple of B (K = ceil(rays_per_run / B)).
        cache: a pre-decoded :class:`~dali_nerf.pipelines.decode.ImageCache` of this shard.
        output_map: batch keys to return (near/far dropped when the scene has no bounds).
        max_bytes: decoded-image budget per rank (None = unlimited); a shard whose decoded pixels
            exceed it is streamed through two windows of decoded images (see the module doc).
        decode_batch: images per decode-pipeline run.
        window_images: streaming only: images per window (0 = the most that fit, see
            :func:`plan_window_images`).
        rays_per_window: streaming, random mode only: stream positions per window (0 = the
            window's pixel count). Epoch mode always uses the window's pixel count.
    Yields:
        dict: origins (B, 3) f32, directions (B, 3) f32 unit, rgb (B, 3) f32, indices (B, 3) i64,
        near/far (B, 1) f32 when the scene has bounds.
    """

    def __init__(self, scene, rays_per_batch: int = 4096, rank: int = 0, world_size: int = 1, seed: int = 0,
                 prefetch: int = 2, mode: str = "random", device: str = "cpu", num_threads: int = 2,
                 rays_per_run: int = 262144, cache=None,
                 output_map: Sequence[str] = ("origins", "directions", "rgb", "indices", "near", "far"),
                 max_bytes: Optional[int] = None, decode_batch: int = 8, window_images: int = 0,
                 rays_per_window: int = 0):
        from dali_nerf.pipelines.decode import decode_cache, shard_range, shard_sizes

        check_common(scene, rays_per_batch, rank, world_size, seed, prefetch, mode)
        _positive("rays_per_run", rays_per_run)
        _positive("num_threads", num_threads)
        for k in output_map:
            if k not in BATCH_KEYS:
                raise ConfigError(f"output_map: unknown key {k!r}; valid: {', '.join(BATCH_KEYS)}")
        self.scene = scene
        self.rays_per_batch = int(rays_per_batch)
        self.rank, self.world_size, self.seed = int(rank), int(world_size), int(seed)
        self.prefetch, self.mode = int(prefetch), mode
        self.device = resolve_device(device)
        self.num_threads = int(num_threads)
        self.steps_per_run = max(1, math.ceil(int(rays_per_run) / self.rays_per_batch))
        self.rays_per_run = self.steps_per_run * self.rays_per_batch
        self.output_map = tuple(k for k in output_map if scene.has_bounds or k not in ("near", "far"))
        self._shard_pixels = shard_sizes(scene, self.world_size)
        for name, v in (("window_images", window_images), ("rays_per_window", rays_per_window),
                        ("decode_batch", decode_batch)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (1 if name == "decode_batch" else 0):
                raise ConfigError(f"cache.{name}={v!r}: must be an integer >= {1 if name == 'decode_batch' else 0}")
        if max_bytes is not None:
            _positive("cache.max_bytes", max_bytes)
        self.decode_batch = int(decode_batch)
        self._device_id = torch.cuda.current_device() if self.device == "cuda" else None
        need = int(self._shard_pixels[self.rank]) * 3
        self._stream: Optional[_WindowStream] = None
        self.window_images = 0
        self.rays_per_window = 0
        if cache is None and max_bytes is not None and need > max_bytes:
            lo, hi = shard_range(scene.num_images, self.rank, self.world_size)
            px = (scene.width[lo:hi] * scene.height[lo:hi]).astype(np.int64)
            self.window_images = plan_window_images(px, int(max_bytes), int(window_images), self.rank)
            self.rays_per_window = int(rays_per_window) if mode == "random" else 0
            self._stream = _WindowStream(self, np.arange(lo, hi), px, self.window_images, self.rays_per_window,
                                         int(max_bytes))
            self._chunks = deque()  # (start, end, {key: tensor}) runs not yet fully handed out
            self._prod = 0  # stream position of the next run to sample
        elif cache is None:
            cache = decode_cache(scene, self.rank, self.world_size, device=self.device,
                                 num_threads=self.num_threads, batch=decode_batch)
        elif (cache.rank, cache.world_size) != (self.rank, self.world_size):
            raise ConfigError(f"cache: holds shard {cache.rank}/{cache.world_size}, loader is {self.rank}/{self.world_size}")
        self.cache = cache
        self.num_pixels = cache.num_pixels if cache is not None else int(self._shard_pixels[self.rank])
        self.position = 0
        self.epoch = 0
        self._stats = BatchStats()
        self._pipe = None
        self._run = None  # dict of torch tensors (K*B, ...) of the current run
        self._steps = None  # K tuples of (B, ...) views of self._run, in output_map order
        self._run_start = 0  # stream position of self._run's first ray
        self._closed = False

    # ---- construction from a config ------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg, rank: int = 0, world_size: int = 1, scene=None) -> "RayLoader":
        """RayLoader from a :class:`~dali_nerf.config.Config` (``cfg.pipeline``, ``cfg.cache``, ``cfg.scene``)."""
        if scene is None:
            scene = scene_from_config(cfg)
        p = cfg.pipeline
        c = cfg.cache
        return cls(scene, rays_per_batch=p.rays_per_batch, rank=rank, world_size=world_size, seed=p.seed,
                   prefetch=p.prefetch, mode=p.mode, device=cfg.train.device, num_threads=p.num_threads,
                   rays_per_run=p.rays_per_run, max_bytes=c.max_bytes, decode_batch=c.decode_batch,
                   window_images=getattr(c, "window_images", 0), rays_per_window=getattr(c, "rays_per_window", 0))

    @property
    def streaming(self) -> bool:
        """True when the shard is streamed through decoded windows instead of cached whole."""
        return self._stream is not None

    # ---- iteration ------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Steps per epoch (epoch mode): ceil(max over ranks of shard pixels / B)."""
        if self.mode != "epoch":
            raise TypeError("RayLoader in random mode is an infinite stream and has no len(); use mode='epoch'")
        return math.ceil(int(self._shard_pixels.max()) / self.rays_per_batch)

    def _build(self):
        from dali_nerf.pipelines.rays import ray_pipeline

        device_id = torch.cuda.current_device() if self.device == "cuda" else None
        self._pipe = ray_pipeline(self.cache, self.rays_per_run, self.mode, self.seed, self.rank, self.world_size,
                                  first_start=self.position, device=self.device, num_threads=self.num_threads,
                                  prefetch=self.prefetch, device_id=device_id)
        self._next_run_start = self.position

    def _fetch_run(self):
        if self._pipe is None:
            self._build()
        outs = self._pipe.run()
        self._stats.runs += 1
        names = ("origins", "directions", "rgb", "indices", "near", "far", "consumed")
        out = dict(zip(names, outs))
        consumed = int(np.asarray(out["consumed"].as_cpu()[0] if self.device == "cuda" else out["consumed"][0]).reshape(-1)[0])
        if consumed != self.rays_per_run:
            raise RuntimeError(f"ray_sampler consumed {consumed} positions for {self.rays_per_run} rays")
        copy = self.prefetch == 0
        run = {k: self._to_torch(out[k], copy=copy) for k in self.output_map}
        self._run = run
        # the K step batches as views made in one C++ call per output (unbind: ~0.6 us a view vs
        # ~3.7 us for a Python slice); __next__ hands out dict(zip(keys, steps[i]))
        K, B = self.steps_per_run, self.rays_per_batch
        self._steps = list(zip(*(v.view(K, B, *v.shape[1:]).unbind(0) for v in run.values())))
        self._run_start = self._next_run_start
        self._next_run_start += self.rays_per_run

    def _to_torch(self, tl, copy: bool = False) -> torch.Tensor:
        return dali_to_torch(tl, self.device, copy)

    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError("RayLoader is closed")
        if self._stream is not None:
            return self._next_streaming()
        st = self._stats
        t = perf_counter()
        if st.t0 is None:
            st.t0 = t
        B = self.rays_per_batch
        off = self.position - self._run_start
        if self._run is None or off < 0 or off + B > self.rays_per_run:
            if self._run is not None and self._pipe is not None and self.position != self._next_run_start:
                self._drop_pipeline()
            self._run = self._steps = None
            self._fetch_run()
            off = self.position - self._run_start
        k, r = divmod(off, B)
        if r == 0:  # the usual case: a precomputed step (a fresh dict, so callers may mutate it)
            batch = dict(zip(self.output_map, self._steps[k]))
        else:  # a seek landed inside the run off the step grid
            batch = {k: v[off:off + B] for k, v in self._run.items()}
        self.position += B
        st.wait_s += perf_counter() - t  # BatchStats.stop, inlined (this is the per-step hot path)
        st.steps += 1
        st.rays += B
        return batch

    def _next_streaming(self) -> dict:
        """Positions [position, position + B) from the runs of one or two windows (a copy only
        when the step straddles two runs)."""
        t = self._stats.start()
        B = self.rays_per_batch
        lo, hi = self.position, self.position + B
        pieces = []
        p = lo
        while p < hi:
            while self._chunks and self._chunks[0][1] <= p:
                self._chunks.popleft()
            if not self._chunks:
                self._chunks.append(self._stream.produce(self._prod))
                self._prod = self._chunks[-1][1]
                continue
            c0, c1, run = self._chunks[0]
            q = min(c1, hi)
            pieces.append({k: v[p - c0:q - c0] for k, v in run.items()})
            p = q
        batch = pieces[0] if len(pieces) == 1 else {k: torch.cat([pc[k] for pc in pieces]) for k in pieces[0]}
        self.position = hi
        self._stats.stop(t, B)
        return batch

    # ---- epochs, state --------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Epoch mode: move to the start of permutation ``epoch`` (position epoch * P). Random
        mode: only recorded (the iid stream has no epochs)."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ConfigError(f"set_epoch({epoch!r}): epoch must be an integer >= 0")
        self.epoch = int(epoch)
        if self.mode == "epoch":
            self._seek(self.epoch * self.num_pixels)

    def _seek(self, position: int) -> None:
        if self._stream is not None:
            if position != self.position:
                self.position = self._prod = int(position)
                self._chunks.clear()  # produce() switches window / rebuilds the pipeline as needed
            return
        if position != self.position:
            self.position = int(position)
            if self._pipe is not None and self.position != self._next_run_start:
                # keep the current run if the position falls inside it, else rebuild lazily
                off = self.position - self._run_start
                if self._run is None or off < 0 or off + self.rays_per_batch > self.rays_per_run:
                    self._drop_pipeline()

    def _drop_pipeline(self):
        self._run = None
        self._steps = None
        pipe, self._pipe = self._pipe, None
        del pipe

    def state_dict(self) -> dict:
        """{"position", "epoch", "steps", "mode", "seed", "rank", "world_size", "rays_per_batch", "num_pixels"}
        (+ "window_images", "rays_per_window" when streaming)."""
        state = {"position": self.position, "epoch": self.epoch, "steps": self._stats.steps, "mode": self.mode,
                 "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                 "rays_per_batch": self.rays_per_batch, "num_pixels": self.num_pixels}
        if self._stream is not None:  # the window layout is part of the stream's definition
            state.update(window_images=self.window_images, rays_per_window=self.rays_per_window)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly: the next batch is the one the saved loader would have returned."""
        for k in ("mode", "seed", "rank", "world_size", "num_pixels", "window_images", "rays_per_window"):
            if state.get(k, 0 if k in ("window_images", "rays_per_window") else getattr(self, k)) != getattr(self, k):
                raise ConfigError(f"load_state_dict: saved {k}={state[k]!r} but this loader has {getattr(self, k)!r}; "
                                  f"resume with the same settings")
        self.epoch = int(state.get("epoch", 0))
        self._seek(int(state["position"]))

    # ---- stats, shutdown ------------------------------------------------------------------------
    def stats(self) -> dict:
        """{"steps", "wait_s", "stall_fraction", "rays_per_s", "elapsed_s", "runs"} since the first next();
        when streaming also {"streaming", "window_images", "windows_per_cycle", "windows_decoded",
        "bytes_held", "peak_bytes", "decode_wait_s"} (decoded-window bytes now / at most so far)."""
        d = self._stats.as_dict()
        if self._stream is not None:
            d.update(self._stream.info())
        return d

    def close(self) -> None:
        """Release the DALI pipeline(s) (their threads end with them) and, when streaming, stop and
        join the window-decode thread and free both windows. Idempotent."""
        if not self._closed:
            self._closed = True
            self._drop_pipeline()
            if self._stream is not None:
                self._chunks.clear()
                self._stream.close()

    def __repr__(self) -> str:
        return (f"RayLoader(rank={self.rank}/{self.world_size}, B={self.rays_per_batch}, K={self.steps_per_run}, "
                f"mode={self.mode}, seed={self.seed}, prefetch={self.prefetch}, device={self.device}, "
                f"pixels={self.num_pixels}" + (f", streaming W={self.window_images}" if self._stream else "") + ")")


# ---------------------------------------------------------------------------------------------
# streaming: a rolling, double-buffered window of decoded images (see the module docstring)

_M64 = (1 << 64) - 1
_WINDOW_IMAGE_OVERHEAD = 18 * 4 + 4 * 8  # bytes of one image's cameras + layout rows


def _mix64(*vals: int) -> int:
    """64-bit counter-based hash of a tuple of non-negative ints (splitmix64 finaliser per value)."""
    h = 0x9E3779B97F4A7C15
    for v in vals:
        h = (h ^ (int(v) & _M64)) & _M64
        h = (h + 0x9E3779B97F4A7C15) & _M64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
        h ^= h >> 31
    return h


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
    keys = np.array([_mix64(seed, rank, cycle, int(i)) for i in ids], np.uint64)
    order = ids[np.argsort(keys, kind="stable")]
    return np.array_split(order, math.ceil(len(ids) / int(window_images)))


class _Window:
    """One decoded window: its cache, its place in the stream and (lazily) its ray pipeline."""

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


class _WindowStream:
    """The streaming engine behind a RayLoader whose shard does not fit in ``max_bytes``.

    Holds at most two windows: ``cur`` (rays are sampled from it) and ``nxt`` (decoded by a
    background thread while ``cur`` is consumed). ``produce(pos)`` returns the next run's chunk
    ``(start, end, {key: tensor (end - start, ...)})`` starting at stream position ``pos``.
    """

    def __init__(self, loader, image_ids, px_per_image, window_images, rays_per_window, max_bytes):
        self.L = loader
        self.ids = np.asarray(image_ids, np.int64)
        self.px = {int(i): int(p) for i, p in zip(self.ids, px_per_image)}
        self.W = int(window_images)
        self.m = math.ceil(len(self.ids) / self.W)
        self.rays_per_window = int(rays_per_window)
        self.max_bytes = max_bytes
        shard_px = int(sum(self.px.values()))
        self.cycle_len = shard_px if self.rays_per_window == 0 else self.m * self.rays_per_window
        self._plans = {}
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
            ws = window_plan(self.ids, self.W, self.L.seed, self.L.rank, cycle)
            lens = [sum(self.px[int(i)] for i in w) if self.rays_per_window == 0 else self.rays_per_window for w in ws]
            offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            plan = self._plans[cycle] = (ws, lens, offs)
        return plan

    def _window(self, cycle, j) -> _Window:
        ws, lens, offs = self._plan(cycle)
        ids = ws[j]
        nbytes = sum(self.px[int(i)] for i in ids) * 3 + len(ids) * _WINDOW_IMAGE_OVERHEAD
        key = _mix64(self.L.seed, self.L.rank, cycle, j) & ((1 << 63) - 1)
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
        from dali_nerf.pipelines.decode import DecodeCancelled, decode_cache

        L = self.L
        with self._lock:
            self.bytes_held += w.nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes_held)
            w.counted = True
        try:
            if L.device == "cuda" and threading.current_thread() is not threading.main_thread():  # pragma: no cover
                torch.cuda.set_device(L._device_id)  # the current device is per thread
            w.cache = decode_cache(L.scene, L.rank, L.world_size, device=L.device, num_threads=L.num_threads,
                                   batch=L.decode_batch, indices=w.ids, stop=w.stop)
            with self._lock:
                self.windows_decoded += 1
        except DecodeCancelled:
            pass
        except BaseException as e:  # re-raised in the consumer thread by _take
            w.error = e

    def _prefetch(self, cycle, j) -> None:
        w = self._window(cycle, j)
        w.thread = threading.Thread(target=self._decode, args=(w,), daemon=True,
                                    name=f"dali_nerf-stream-r{self.L.rank}-c{cycle}-w{j}")
        self.nxt = w
        w.thread.start()

    def _release(self, w: Optional[_Window]) -> None:
        if w is None:
            return
        w.stop.set()
        if w.thread is not None:
            w.thread.join()
            w.thread = None
        if w.pipe is not None:
            from dali_nerf.pipelines.rays import release_pipeline

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
        """Sample the run starting at stream position ``pos``: (pos, end, {key: tensor (end - pos, ...)})."""
        from dali_nerf.pipelines.rays import ray_pipeline, release_pipeline

        L = self.L
        w = self.cur
        if w is None or not w.offset <= pos < w.end:
            w = self._switch(*self.locate(pos))
        t = pos - w.offset
        if w.pipe is None or w.next_local != t:
            if w.pipe is not None:
                pipe, w.pipe = w.pipe, None
                release_pipeline(pipe)
                del pipe
            rest = w.length - t
            n_runs = math.ceil(rest / L.rays_per_run)
            w.run_size = math.ceil(rest / n_runs)
            w.prefetch = min(L.prefetch, n_runs - 1)  # no runs computed past the window's end
            w.pipe = ray_pipeline(w.cache, w.run_size, L.mode, w.key, L.rank, L.world_size, first_start=t,
                                  device=L.device, num_threads=L.num_threads, prefetch=w.prefetch,
                                  device_id=L._device_id)
            w.next_local = t
        out = dict(zip(("origins", "directions", "rgb", "indices", "near", "far", "consumed"), w.pipe.run()))
        L._stats.runs += 1
        consumed = int(np.asarray(out["consumed"].as_cpu()[0] if L.device == "cuda" else out["consumed"][0]).reshape(-1)[0])
        if consumed != w.run_size:
            raise RuntimeError(f"ray_sampler consumed {consumed} positions for {w.run_size} rays")
        n = min(w.run_size, w.length - t)
        chunk = {k: L._to_torch(out[k], copy=w.prefetch == 0)[:n] for k in L.output_map}
        w.next_local += w.run_size
        if pos + n >= w.end:  # window done: switch now so its successor's decode can start early
            self._switch(*self._successor(w))
        return pos, pos + n, chunk

    def info(self) -> dict:
        return {"streaming": True, "window_images": self.W, "windows_per_cycle": self.m,
                "windows_decoded": self.windows_decoded, "bytes_held": self.bytes_held,
                "peak_bytes": self.peak_bytes, "decode_wait_s": self.decode_wait_s}

    def close(self) -> None:
        nxt, self.nxt = self.nxt, None
        cur, self.cur = self.cur, None
        self._release(nxt)
        self._release(cur)


def plan_window_images(px_per_image, max_bytes: int, window_images: int = 0, rank: int = 0) -> int:
    """Images per streaming window W: the most such that two windows of the shard's W largest
    images fit in ``max_bytes`` (``window_images`` > 0 asks for exactly that many, checked).

    Args:
        px_per_image: (N,) pixels of each image of the shard.
    Raises:
        ConfigError: not even two one-image windows fit, or ``window_images`` is too large.
    """
    per = np.sort(np.asarray(px_per_image, np.int64) * 3 + _WINDOW_IMAGE_OVERHEAD)[::-1]
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


def scene_from_config(cfg):
    """Load ``cfg.scene``'s training split."""
    from dali_nerf.scenes import load_scene

    s = cfg.scene
    return load_scene(s.path, split=s.train_split, format=s.format, downscale=s.downscale, background=s.background)
