"""RayLoader: the prefetching iterator over our DALI ray graph (the DDP batch source).

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
the shard is sampled through a rolling, double-buffered window of decoded images by
:class:`~dali_nerf.sources.streaming.WindowStream` (one run per ``produce``; see that module for
the window plan and keys). A step may straddle two windows (its rays are concatenated). The
stream depends only on (seed, rank, world_size, W, rays_per_window, position): ``prefetch`` /
``rays_per_run`` do not change it, ``state_dict()`` adds ``window_images`` / ``rays_per_window``,
and resuming decodes the window holding the saved position synchronously. ``close()`` cancels an
in-flight decode and joins the thread.

Global stream (``stream="global"``; the trainers' default, ``pipeline.stream``): step ``k`` is the
split's global positions ``[k G, (k + 1) G)``, G = B x world_size, mapped to pixels by the
operator's global stream (seed and mode alone: the same global batches on any number of ranks,
every pixel of the split exactly once per epoch of P positions, P the split's pixels). Each rank
decodes its image shard as before and its batch for step k holds the rays of those positions
whose pixel is in its shard, in position order (``step_counts`` of the op cut each run into its K
steps), with ``positions`` (n,) their global positions: per-ray keys (jitter, backgrounds) that
are the same on any world size. The counts sum to G over the ranks; a training loss should be
normalised by G (``sum / B`` per rank under DDP's gradient averaging), not by the rank's count.
State = the global step: ``state_dict()`` of any rank at W ranks loads into every rank of a loader
at W' ranks with the same G (``rays_per_batch = G / W'``) and their union continues exactly.
``set_epoch(e)`` moves to step ceil(e P / G) and ``len()`` is that epoch's steps, ceil((e+1) P / G) -
ceil(e P / G): epoch loops partition the steps (a step that straddles an epoch boundary belongs to
the earlier epoch's loop; sync_global likewise). A shard over
``max_bytes`` cannot be sampled this way (every step touches every image of the shard): refused.

>>> loader = RayLoader(scene, rays_per_batch=4096, rank=0, world_size=1, seed=0, prefetch=2)
>>> batch = next(loader)
>>> batch["origins"].shape, batch["indices"].dtype
(torch.Size([4096, 3]), torch.int64)
>>> loader.stats()["stall_fraction"] < 0.05
True
"""

from __future__ import annotations

import functools
import math
from collections import deque
from time import perf_counter
from typing import Optional, Sequence

import numpy as np
import torch

from dali_nerf.errors import ConfigError
from dali_nerf.data.hostbudget import dali_threads
from dali_nerf.data.imagecache import CacheStore
from dali_nerf.data.plan import SamplingPlan
from dali_nerf.pipelines.decode import shard_range, shard_sizes
from dali_nerf.pipelines.rays import GLOBAL_STREAM, INT64_MAX, SHARD_STREAM, ray_pipeline
from dali_nerf.sources.base import (BATCH_KEYS, BatchSource, BatchStats, RunAhead, check_cache_device, check_common,
                                    check_int, check_positive, check_run_size, check_scene_state, demote_if_starved, PlanView,
                                    global_epoch_steps, run_graph, run_phase, scene_state, step_views)
from dali_nerf.sources.streaming import WindowStream, plan_window_images

__all__ = ["RayLoader", "DEFAULT_OUTPUTS"]

DEFAULT_OUTPUTS = ("origins", "directions", "rgb", "indices", "near", "far")
"""RayLoader's batch keys by default (with ``stream="global"`` also ``positions``)."""


def _produce(pipe, keys, K: int, B: int, device: str, copy: bool, split: bool):
    """One run of the ray graph: (consumed, {key: (R, ...)}, K step tuples of views in ``keys``
    order, the steps' ray counts or None). Shard stream: K steps of B rays; global stream
    (``split``): the steps' counts from the op's ``step_counts`` (they vary; 0 is possible)."""
    if not split:
        consumed, run = run_graph(pipe, device, keys, copy)
        return consumed, run, step_views(run, K, B), None
    consumed, run = run_graph(pipe, device, tuple(keys) + ("step_counts",), copy)
    counts = run.pop("step_counts").tolist()  # K ints (CUDA: one small copy to the host per run)
    return consumed, run, list(zip(*(v.split(counts) for v in run.values()))), counts


class RayLoader(PlanView, BatchSource):
    """Prefetching iterator of ray batches from our DALI pipeline (infinite; see module doc).

    Args:
        scene: the split to sample (a :class:`~dali_nerf.scenes.Scene`).
        rays_per_batch: B, rays per step for this rank.
        rank, world_size: this rank's shard (DALI's rule, see ``pipelines/decode.py``).
        seed: stream key; mode: "random" (iid) | "epoch" (each pixel once per epoch).
        prefetch: DALI runs computed ahead of the consumer (0 = synchronous).
        device: "cpu" | "cuda" (nvJPEG decode, GPU op, CUDA tensors) | "auto".
        num_threads: DALI CPU threads (None/0: this host's budget per local rank,
            :func:`dali_nerf.data.hostbudget.host_budget`: cores per rank - 1, 1..4).
        rays_per_run: rays per DALI run, rounded up to a multiple of B (K = ceil(rays_per_run / B));
            None/0: 65536 per thread, at most 262144 (the host budget).
        cache: a pre-decoded :class:`~dali_nerf.data.imagecache.ImageCache` of this shard (None: the
            ``store``'s, or decoded windows of it when it exceeds ``max_bytes``).
        output_map: batch keys to return (near/far dropped when the scene has no bounds).
        max_bytes: decoded-image budget per rank (None = unlimited); a shard whose decoded pixels
            exceed it is streamed through two windows of decoded images (see the module doc).
        decode_batch: images per decode-pipeline run.
        window_images: streaming only: images per window (0 = the most that fit, see
            :func:`plan_window_images`).
        rays_per_window: streaming, random mode only: stream positions per window (0 = the
            window's pixel count). Epoch mode always uses the window's pixel count.
        thread_priority: "normal" | "background": the priority of the threads that sample ahead
            (DALI's CPU threads and the hand-over thread; CPU, prefetch > 0, cached shards).
            "background" when this rank's compute is on a GPU and the host's cores are few per
            rank, so the training thread never waits for a core (:mod:`dali_nerf.data.hostbudget`);
            ``auto``: background when ``device`` is cuda (a run's config resolves
            ``pipeline.thread_priority`` from ``train.device``: :func:`dali_nerf.data.plan.plan_from_config`).
            A background sampler that keeps ``next()`` waiting over 20% of a second (a host whose
            cores are all busy starves it) warns once (:class:`~.base.SamplerStarvedWarning`) and
            is rebuilt at normal priority at the next run, at the same stream position
            (``starvation_guard = False`` on the class or instance keeps it in background).
        stream: "shard" (default: the rank's own stream over its shard; every batch has B rays) |
            "global" (the split's stream: global batches of G = B x world_size positions defined
            by the seed alone, the same for every world size; each rank's batch is the part of
            the step's G rays whose image is in its shard, a number of rays that varies around B
            and may be 0; batches also carry ``positions``; see the module doc).
        plan: a resolved :class:`~dali_nerf.data.plan.SamplingPlan` (the registry's door, from a config):
            it replaces every argument above but ``scene``, ``cache`` and ``output_map``.
        store: the :class:`~dali_nerf.data.imagecache.CacheStore` that decodes the shard (or its
            windows) when no ``cache`` is given (None: one of this loader's own).
    Yields:
        dict: origins (B, 3) f32, directions (B, 3) f32 unit, rgb (B, 3) f32, indices (B, 3) i64,
        near/far (B, 1) f32 when the scene has bounds; global stream: (n, ...) with n this rank's
        rays of the step, and positions (n,) i64, each ray's global stream position (increasing).
    """

    starvation_guard = True
    """Background priority: return a starved sampler to normal priority (see ``thread_priority``)."""

    def __init__(self, scene, rays_per_batch: int = 4096, rank: int = 0, world_size: int = 1, seed: int = 0,
                 prefetch: int = 2, mode: str = "random", device: str = "cpu", num_threads: Optional[int] = None,
                 rays_per_run: Optional[int] = None, cache=None,
                 output_map: Sequence[str] = DEFAULT_OUTPUTS,
                 max_bytes: Optional[int] = None, decode_batch: int = 8, window_images: int = 0,
                 rays_per_window: int = 0, thread_priority: str = "normal", stream: str = "shard", *,
                 plan: Optional[SamplingPlan] = None, store: Optional[CacheStore] = None):
        if plan is None:  # the drop-in API: its arguments make the plan
            check_common(scene, rays_per_batch, rank, world_size, seed, prefetch, mode)
            for name, v in (("window_images", window_images), ("rays_per_window", rays_per_window),
                            ("decode_batch", decode_batch)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (1 if name == "decode_batch" else 0):
                    raise ConfigError(f"cache.{name}={v!r}: must be an integer >= {1 if name == 'decode_batch' else 0}")
            if max_bytes is not None:
                check_positive("cache.max_bytes", max_bytes)
            plan = SamplingPlan.for_loader(rays_per_batch, rank=rank, world_size=world_size, seed=seed, mode=mode,
                                           prefetch=prefetch, device=device, num_threads=num_threads,
                                           rays_per_run=rays_per_run, thread_priority=thread_priority,
                                           decode_batch=decode_batch, max_bytes=max_bytes, window_images=window_images,
                                           rays_per_window=rays_per_window, stream=stream)
        else:
            check_common(scene, plan.rays_per_batch, plan.rank, plan.world_size, plan.seed, plan.prefetch, plan.mode)
        is_global = plan.ray_stream == "global"
        if is_global and "positions" not in output_map and output_map == DEFAULT_OUTPUTS:
            output_map = DEFAULT_OUTPUTS + ("positions",)  # a global batch names its rays' global positions
        valid = BATCH_KEYS + (("positions",) if is_global else ())
        for k in output_map:
            if k not in valid:
                raise ConfigError(f"output_map: unknown key {k!r}; valid: {', '.join(valid)}"
                                  + ("; positions needs stream='global'" if k == "positions" else ""))
        self.plan = plan
        self.scene = scene
        self.thread_priority = plan.priority  # the sampler's priority now (a starved one returns to normal)
        self.output_map = tuple(k for k in output_map if scene.has_bounds or k not in ("near", "far"))
        self._shard_pixels = shard_sizes(scene, self.world_size)
        self.split_pixels = int(self._shard_pixels.sum())
        # the rays a run holds: K x B, or this shard's share of K x G positions (global)
        held = (self.rays_per_batch if not is_global else
                -(-self.global_batch * int(self._shard_pixels[self.rank]) // self.split_pixels))
        check_run_size(self.steps_per_run, held, self.prefetch + 2, self.device)
        need = int(self._shard_pixels[self.rank]) * 3
        self._stream: Optional[WindowStream] = None
        self.window_images = 0
        self.rays_per_window = 0
        if cache is None and plan.max_bytes is not None and need > plan.max_bytes and is_global:
            raise ConfigError(f"cache.max_bytes={plan.max_bytes}: rank {self.rank}'s shard needs {need} bytes decoded, "
                              f"and the global stream (pipeline.stream=global) samples every image of the shard at "
                              f"every step, so it cannot stream it through windows; run more ranks, raise "
                              f"cache.max_bytes, or set pipeline.stream=shard (RayLoader stream='shard')")
        if cache is None:  # the store decodes (a default one of this loader's own when none is handed)
            store = store or CacheStore(scene, plan)
        if cache is None and plan.max_bytes is not None and need > plan.max_bytes:
            lo, hi = shard_range(scene.num_images, self.rank, self.world_size)
            px = (scene.width[lo:hi] * scene.height[lo:hi]).astype(np.int64)
            self.window_images = plan_window_images(px, int(plan.max_bytes), plan.window_images, self.rank)
            self.rays_per_window = plan.rays_per_window if self.mode == "random" else 0
            self._stream = WindowStream(store, plan, np.arange(lo, hi), px, self.window_images, self.rays_per_window,
                                        output_map=self.output_map)
            self._chunks = deque()  # (start, end, {key: tensor}) runs not yet fully handed out
            self._prod = 0  # stream position of the next run to sample
        elif cache is None:
            cache = store.shard(plan.device)  # where this loader samples
        elif (cache.rank, cache.world_size) != (self.rank, self.world_size):
            raise ConfigError(f"cache: holds shard {cache.rank}/{cache.world_size}, loader is {self.rank}/{self.world_size}")
        else:
            check_cache_device(cache, self.device, "RayLoader")
        self.cache = cache
        self.num_pixels = cache.num_pixels if cache is not None else int(self._shard_pixels[self.rank])
        self.position = 0
        self.epoch = 0
        self._stats = BatchStats()
        self._pipe = None
        self._ahead: Optional[RunAhead] = None  # the background hand-over of self._pipe's runs (CPU, prefetch > 0)
        self._phase = 0  # the step of each run at which self._ahead may produce the next (run_phase)
        self._run = None  # dict of torch tensors (K*B, ...) of the current run
        self._steps = None  # K tuples of (B, ...) views of self._run, in output_map order
        self._counts = None  # global stream: the K steps' ray counts of self._run
        self._run_start = 0  # stream position of self._run's first ray
        self._closed = False

    @property
    def stream(self) -> str:
        """shard | global (the plan's ``ray_stream``)."""
        return self.plan.ray_stream

    @property
    def streaming(self) -> bool:
        """True when the shard is streamed through decoded windows instead of cached whole."""
        return self._stream is not None

    # ---- iteration ------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Steps per epoch (epoch mode): ceil(max over ranks of shard pixels / B); global stream:
        the steps of the current epoch e (``set_epoch``), ceil((e+1)P/G) - ceil(eP/G), P the
        split's pixels (the same on every rank): ceil(P/G) or one less; a step that straddles an
        epoch boundary belongs to the earlier epoch's loop, so ``set_epoch(e); for _ in
        range(len(loader))`` over e = 0, 1, ... visits every global position exactly once."""
        if self.mode != "epoch":
            raise TypeError("RayLoader in random mode is an infinite stream and has no len(); use mode='epoch'")
        if self.stream == "global":
            return global_epoch_steps(self.epoch, self.split_pixels, self.global_batch)[1]
        return math.ceil(int(self._shard_pixels.max()) / self.rays_per_batch)

    @property
    def _stride(self) -> int:
        """Stream positions one step takes: G (global stream) or B."""
        return self.global_batch if self.stream == "global" else self.rays_per_batch

    def _build(self):
        before = dali_threads() if self.thread_priority == "background" else None
        self._pipe = ray_pipeline(self.cache, self.plan.ray_graph(self.scene, self.position))
        self._next_run_start = self.position
        if self.prefetch > 0 and self.device == "cpu":
            # runs handed over by a background thread (RunAhead); CUDA keeps the hand-over on the
            # training thread, where the outputs are copied on torch's current stream
            produce = functools.partial(_produce, keys=self.output_map, K=self.steps_per_run, B=self.rays_per_batch,
                                        device="cpu", copy=False, split=self.stream == "global")
            # released at this rank's step of each run (run_phase), so co-located ranks in
            # lockstep do not all hand over and schedule their next runs on the same step
            self._ahead = RunAhead(self._pipe, produce, name=f"dali_nerf-rays-r{self.rank}", background=before,
                                   guard=self.starvation_guard)
            self._phase = run_phase(self.rank, self.steps_per_run)

    def _fetch_run(self):
        if self._pipe is None:
            self._build()
        if self._ahead is not None:
            consumed, run, steps, counts = self._ahead.get()
        else:
            consumed, run, steps, counts = _produce(self._pipe, self.output_map, self.steps_per_run, self.rays_per_batch,
                                                    self.device, self.prefetch == 0, self.stream == "global")
        self._stats.runs += 1
        if consumed != self.positions_per_run:
            raise RuntimeError(f"ray_sampler consumed {consumed} positions for {self.positions_per_run}")
        self._run = run
        self._steps = steps  # __next__ hands out dict(zip(keys, steps[i]))
        self._counts = counts
        self._run_start = self._next_run_start
        self._next_run_start += self.positions_per_run

    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError("RayLoader is closed")
        if self._stream is not None:
            return self._next_streaming()
        st = self._stats
        t = perf_counter()
        if st.t0 is None:
            st.t0 = t
        S = self._stride
        off = self.position - self._run_start
        if self._run is None or off < 0 or off + S > self.positions_per_run:
            if self._run is not None and self._pipe is not None and self.position != self._next_run_start:
                self._drop_pipeline()
            if self._ahead is not None and self._run is not None:
                self._ahead.retire((self._run, self._steps))
                demote_if_starved(self, f"RayLoader rank {self.rank}")
            self._run = self._steps = None
            self._fetch_run()
            off = self.position - self._run_start
        k, r = divmod(off, S)
        if r == 0:  # the usual case: a precomputed step (a fresh dict, so callers may mutate it)
            batch = dict(zip(self.output_map, self._steps[k]))
            if k == self._phase and self._ahead is not None:
                self._ahead.release()
            n = S if self._counts is None else self._counts[k]
        else:  # a seek landed inside the run off the step grid (the shard stream only)
            batch = {key: v[off:off + S] for key, v in self._run.items()}
            n = S
        self.position += S
        waited = perf_counter() - t  # BatchStats.stop, inlined (this is the per-step hot path)
        st.wait_s += waited
        if st.steps == 0:
            st.warmup_s = waited
        st.steps += 1
        st.rays += n
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
                self._stats.runs += 1
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
        """Epoch mode: move to the start of permutation ``epoch`` (position epoch * P); with the
        global stream to the first step that starts in the epoch, ceil(epoch P / G) (a step that
        straddles the boundary was the previous epoch's last; ``len()`` counts the epoch's steps).
        Random mode: only recorded (the iid stream has no epochs)."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ConfigError(f"set_epoch({epoch!r}): epoch must be an integer >= 0")
        self.epoch = int(epoch)
        if self.mode == "epoch":
            if self.stream == "global":
                self._seek(global_epoch_steps(self.epoch, self.split_pixels, self.global_batch)[0] * self.global_batch)
            else:
                self._seek(self.epoch * self.num_pixels)

    @property
    def step(self) -> int:
        """Global stream: the global step of the next batch (its first position / G)."""
        return self.position // self._stride

    def set_step(self, step: int) -> None:
        """Global stream: move to global step ``step`` (positions [step G, (step + 1) G)), whatever
        the world size the stream ran on before: the next batch is this rank's part of that step."""
        if self.stream != "global":
            raise ConfigError("set_step: the shard stream has no global steps; use load_state_dict, or stream='global'")
        check_int("set_step: step", step, 0, (INT64_MAX - self.positions_per_run) // self.global_batch)
        self._seek(int(step) * self.global_batch)

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
                if self._run is None or off < 0 or off + self._stride > self.positions_per_run:
                    self._drop_pipeline()

    def _drop_pipeline(self):
        self._run = None
        self._steps = None
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        pipe, self._pipe = self._pipe, None
        del pipe

    def state_dict(self) -> dict:
        """{"stream", "position", "epoch", "steps", "mode", "seed", "rank", "world_size", "rays_per_batch",
        "scene"} and: shard stream "num_pixels" (the rank's; + "window_images", "rays_per_window"
        when streaming); global stream "step" (position / G), "global_batch" (G) and
        "split_pixels" (P). "scene" is the split's fingerprint
        (:func:`dali_nerf.scenes.scene_fingerprint`); "stream" the stream's formula version."""
        state = {"position": self.position, "epoch": self.epoch, "steps": self._stats.steps, "mode": self.mode,
                 "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                 "rays_per_batch": self.rays_per_batch, **scene_state(self.scene)}
        if self.stream == "global":  # rank-free: any world size continues it
            state.update(stream=GLOBAL_STREAM, step=self.step, global_batch=self.global_batch,
                         split_pixels=self.split_pixels)
            return state
        state.update(stream=SHARD_STREAM, num_pixels=self.num_pixels)
        if self._stream is not None:  # the window layout is part of the stream's definition
            state.update(window_images=self.window_images, rays_per_window=self.rays_per_window)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly: the next batch is the one the saved loader would have returned. A state
        saved from another scene (its fingerprint differs: other images, sizes, cameras) or with
        other stream settings is refused with one line naming what differs. A global-stream state
        loads into a loader of any rank and world size with the same global batch: the union of
        the ranks' streams continues exactly (each rank takes its part of the saved next step)."""
        check_scene_state(state, self.scene, "RayLoader")
        mine = GLOBAL_STREAM if self.stream == "global" else SHARD_STREAM
        saved = state.get("stream", SHARD_STREAM)  # states before versions were shard streams
        if saved != mine:
            raise ConfigError(f"load_state_dict: saved stream {saved!r} but this loader samples {mine!r}; resume with "
                              f"the stream the state was saved from (pipeline.stream / RayLoader stream=)")
        keys = (("mode", "seed", "global_batch", "split_pixels") if self.stream == "global" else
                ("mode", "seed", "rank", "world_size", "num_pixels", "window_images", "rays_per_window"))
        for k in keys:
            if state.get(k, 0 if k in ("window_images", "rays_per_window") else getattr(self, k)) != getattr(self, k):
                hint = (f"; the global batch G = rays_per_batch x world size is kept across world sizes: use "
                        f"rays_per_batch = {state[k]} / world_size" if k == "global_batch" else "")
                raise ConfigError(f"load_state_dict: saved {k}={state[k]!r} but this loader has {getattr(self, k)!r}"
                                  f"{hint or '; resume with the same settings'}")
        check_int("load_state_dict: position", state.get("position"), 0, INT64_MAX - self.positions_per_run)
        if state["position"] % self._stride and self.stream == "global":
            raise ConfigError(f"load_state_dict: position={state['position']} is not a multiple of the global batch "
                              f"{self.global_batch}; the state is damaged")
        self.epoch = int(state.get("epoch", 0))
        self._seek(int(state["position"]))

    # ---- stats, shutdown ------------------------------------------------------------------------
    def stats(self) -> dict:
        """{"steps", "wait_s", "stall_fraction", "warmup_s", "stall_fraction_steady", "rays_per_s",
        "elapsed_s", "runs"} since the first next() (definitions: :class:`~.base.BatchStats`);
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
