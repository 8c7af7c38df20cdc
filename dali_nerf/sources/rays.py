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

Masks (``Scene.mask_paths``): every stream above runs over the valid pixels instead of all pixels
(P, P_r, an epoch, ``len()``, the global stream's G positions all count valid pixels; the op
draws the k-th valid pixel, :mod:`dali_nerf.data.masks`), so no batch holds a masked pixel. A
rank whose whole shard is masked is refused with the shard stream (nothing to sample); the
global stream gives it empty batches.

>>> loader = RayLoader(scene, rays_per_batch=4096, rank=0, world_size=1, seed=0, prefetch=2)
>>> batch = next(loader)
>>> batch["origins"].shape, batch["indices"].dtype
(torch.Size([4096, 3]), torch.int64)
>>> loader.stats()["stall_fraction"] < 0.05
True
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional, Sequence

import numpy as np
import torch

from dali_nerf.data.imagecache import CacheStore
from dali_nerf.data.masks import stream_sizes
from dali_nerf.data.plan import SamplingPlan
from dali_nerf.errors import ConfigError
from dali_nerf.pipelines.decode import shard_range, shard_sizes
from dali_nerf.ops.limits import INT64_MAX
from dali_nerf.pipelines.rays import GLOBAL_STREAM, SHARD_STREAM, abort_pipeline, ray_pipeline, release_pipeline
from dali_nerf.sources.base import BATCH_KEYS, PlanView, global_epoch_steps
from dali_nerf.sources.checks import check_cache_device, check_common, check_int, check_positive, check_run_size
from dali_nerf.sources.dalirun import run_graph, step_views
from dali_nerf.sources.runner import Run, RunSource
from dali_nerf.sources.streaming import WindowStream, plan_window_images

__all__ = ["RayLoader", "RayProducer", "WindowProducer", "DEFAULT_OUTPUTS"]

DEFAULT_OUTPUTS = ("origins", "directions", "rgb", "indices", "near", "far")
"""RayLoader's batch keys by default (with ``stream="global"`` also ``positions``)."""


def _check_valid(scene, shard_valid, rank: int, is_global: bool) -> None:
    """A masked split must leave something to sample: one line naming the split (every pixel
    masked) or, with the shard stream, this rank's shard (every pixel of its images masked)."""
    if not scene.masked:
        return
    if int(shard_valid.sum()) == 0:
        raise ConfigError(f"{scene.root}: every pixel of split {scene.split!r} is masked (its masks are all 0); "
                          f"fix the masks or drop mask_path")
    if not is_global and int(shard_valid[rank]) == 0:
        lo, hi = shard_range(scene.num_images, rank, len(shard_valid))
        raise ConfigError(f"{scene.root}: rank {rank}'s shard (images {lo}..{hi - 1} of split {scene.split!r}) is "
                          f"fully masked, so its stream has nothing to sample; use the global stream "
                          f"(pipeline.stream=global, RayLoader stream='global') or fewer ranks")


class RayProducer:
    """The runs of our ray graph over a rank's cached shard: the producer of a :class:`RayLoader`
    (the contract of :mod:`dali_nerf.sources.runner`). A graph is the op's DALI pipeline started at
    a stream position (:meth:`~dali_nerf.data.plan.SamplingPlan.ray_graph`); a run is K steps of B
    rays (the shard stream) or the shard's part of K global batches of G positions (the global
    stream: the steps' counts from the op's ``step_counts``; they vary, 0 is possible)."""

    kind = "RayLoader"
    linear = True

    def __init__(self, loader: "RayLoader", cache):
        p = self.plan = loader.plan
        self.scene, self.cache, self.keys = loader.scene, cache, loader.output_map
        self.who, self.thread_name = f"RayLoader rank {p.rank}", f"dali_nerf-rays-r{p.rank}"
        # runs handed over by the run-ahead thread on the CPU; CUDA keeps the hand-over on the
        # training thread, where the outputs are copied on torch's current stream
        self.ahead = p.prefetch > 0 and p.device == "cpu"
        self.steps_per_run, self.phase_rank = p.steps_per_run, p.rank
        self.split = p.ray_stream == "global"
        self.stride = p.global_batch if self.split else p.rays_per_batch
        self.split_pixels = loader.split_pixels
        # the rank's stream's epoch: its shard's pixels (masked: its valid pixels)
        self.num_pixels = cache.num_valid if cache is not None else int(loader._shard_pixels[p.rank])
        self.window_images = self.rays_per_window = 0

    def build(self, start: int):
        return ray_pipeline(self.cache, self.plan.ray_graph(self.scene, start))

    def produce(self, pipe) -> Run:
        """One run of the graph: K step tuples of views in ``keys`` order (a synchronous graph's
        outputs copied out of the executor's buffers, which its next run reuses)."""
        p = self.plan
        copy = p.prefetch == 0
        if not self.split:
            consumed, run = run_graph(pipe, p.device, self.keys, copy)
            steps, counts = step_views(run, p.steps_per_run, p.rays_per_batch), None
        else:
            consumed, run = run_graph(pipe, p.device, tuple(self.keys) + ("step_counts",), copy)
            counts = run.pop("step_counts").tolist()  # K ints (CUDA: one small copy to the host per run)
            steps = list(zip(*(v.split(counts) for v in run.values())))
        if consumed != p.positions_per_run:
            raise RuntimeError(f"ray_sampler consumed {consumed} positions for {p.positions_per_run}")
        return Run(steps, self.stride, consumed, keys=self.keys, counts=counts, data=run)

    def release(self, pipe) -> None:
        release_pipeline(pipe)

    def abort(self, pipe) -> None:
        abort_pipeline(pipe)

    def state(self, start: int, offset: int) -> dict:
        """{"position", "mode", "seed", "rank", "world_size", "rays_per_batch", "stream"} and: shard
        stream "num_pixels" (the rank's; + "window_images", "rays_per_window" when streaming);
        global stream "step" (position / G), "global_batch" (G) and "split_pixels" (P); "stream" is
        the stream's formula version."""
        p, pos = self.plan, start + offset
        state = {"position": pos, "mode": p.mode, "seed": p.seed, "rank": p.rank, "world_size": p.world_size,
                 "rays_per_batch": p.rays_per_batch}
        if self.split:  # rank-free: any world size continues it
            state.update(stream=GLOBAL_STREAM, step=pos // self.stride, global_batch=p.global_batch,
                         split_pixels=self.split_pixels)
        else:
            state.update(stream=SHARD_STREAM, num_pixels=self.num_pixels)
        return state

    def load_state(self, state: dict) -> tuple:
        """The state's (position, 0), refused in one line when it was saved with other stream
        settings; a global-stream state loads into any rank and world size with the same G."""
        p = self.plan
        mine = GLOBAL_STREAM if self.split else SHARD_STREAM
        saved = state.get("stream", SHARD_STREAM)  # states before versions were shard streams
        if saved != mine:
            raise ConfigError(f"load_state_dict: saved stream {saved!r} but this loader samples {mine!r}; resume with "
                              f"the stream the state was saved from (pipeline.stream / RayLoader stream=)")
        have = {"mode": p.mode, "seed": p.seed, "global_batch": p.global_batch, "split_pixels": self.split_pixels,
                "rank": p.rank, "world_size": p.world_size, "num_pixels": self.num_pixels,
                "window_images": self.window_images, "rays_per_window": self.rays_per_window}
        keys = (("mode", "seed", "global_batch", "split_pixels") if self.split else
                ("mode", "seed", "rank", "world_size", "num_pixels", "window_images", "rays_per_window"))
        for k in keys:
            if state.get(k, 0 if k in ("window_images", "rays_per_window") else have[k]) != have[k]:
                hint = (f"; the global batch G = rays_per_batch x world size is kept across world sizes: use "
                        f"rays_per_batch = {state[k]} / world_size" if k == "global_batch" else "")
                raise ConfigError(f"load_state_dict: saved {k}={state[k]!r} but this loader has {have[k]!r}"
                                  f"{hint or '; resume with the same settings'}")
        check_int("load_state_dict: position", state.get("position"), 0, INT64_MAX - p.positions_per_run)
        if state["position"] % self.stride and self.split:
            raise ConfigError(f"load_state_dict: position={state['position']} is not a multiple of the global batch "
                              f"{self.stride}; the state is damaged")
        return int(state["position"]), 0

    def info(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class _Chunks:
    """A streamed shard's "graph": the engine's runs not yet fully handed out, ``(start, end,
    {key: tensor})``, and the stream positions of the next step and of the next run to sample."""

    def __init__(self, start: int):
        self.chunks, self.pos, self.prod = deque(), int(start), int(start)


class WindowProducer(RayProducer):
    """A shard larger than ``max_bytes`` through decoded windows (:class:`WindowStream`, which owns
    the windows' decode threads): the producer of a streaming :class:`RayLoader`. Each run is one
    step of B rays from the engine's runs of one or two windows (a copy only when the step
    straddles two runs), made in ``next()``."""

    def __init__(self, loader: "RayLoader", stream: WindowStream):
        super().__init__(loader, None)
        self.ahead, self.stream = False, stream
        self.window_images, self.rays_per_window = loader.window_images, loader.rays_per_window

    def build(self, start: int) -> _Chunks:
        return _Chunks(start)  # the engine switches windows / rebuilds their graphs as needed

    def produce(self, cur: _Chunks) -> Run:
        """Positions [pos, pos + B) from the engine's runs."""
        B = self.plan.rays_per_batch
        lo, hi = cur.pos, cur.pos + B
        pieces, p, made = [], lo, 0
        while p < hi:
            while cur.chunks and cur.chunks[0][1] <= p:
                cur.chunks.popleft()
            if not cur.chunks:
                cur.chunks.append(self.stream.produce(cur.prod))
                made += 1
                cur.prod = cur.chunks[-1][1]
                continue
            c0, c1, run = cur.chunks[0]
            q = min(c1, hi)
            pieces.append({k: v[p - c0:q - c0] for k, v in run.items()})
            p = q
        batch = pieces[0] if len(pieces) == 1 else {k: torch.cat([pc[k] for pc in pieces]) for k in pieces[0]}
        cur.pos = hi
        return Run([batch], B, B, graph_runs=made)

    def release(self, cur: _Chunks) -> None:
        cur.chunks.clear()

    def state(self, start: int, offset: int) -> dict:
        # the window layout is part of the stream's definition
        return dict(super().state(start, offset), window_images=self.window_images,
                    rays_per_window=self.rays_per_window)

    def info(self) -> dict:
        return self.stream.info()

    def close(self) -> None:
        """Cancel an in-flight window decode, join its thread and free both windows."""
        self.stream.close()


class RayLoader(PlanView, RunSource):
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
            (DALI's CPU threads; CPU, prefetch > 0, cached shards; the hand-over thread, which runs
            Python and so holds the GIL, stays at normal priority).
            "background" when this rank's compute is on a GPU and the host's cores are few per
            rank, so the training thread never waits for a core (:mod:`dali_nerf.data.hostbudget`);
            ``auto``: background when ``device`` is cuda (a run's config resolves
            ``pipeline.thread_priority`` from ``train.device``: :func:`dali_nerf.data.plan.plan_from_config`).
            A background sampler that keeps ``next()`` waiting over 20% of a second (a host whose
            cores are all busy starves it; counted while ``next()`` still waits) warns once
            (:class:`~.runner.SamplerStarvedWarning`) and runs at normal priority from then on: its
            threads raised in place where the kernel allows (CAP_SYS_NICE, or ``ulimit -e`` 20),
            else a pipeline rebuilt at once at the same stream position, the starved run aborted
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
        self.plan, self.scene = plan, scene
        self.output_map = tuple(k for k in output_map if scene.has_bounds or k not in ("near", "far"))
        # what each shard's stream draws from: its pixels, or (masks) its valid pixels
        self._shard_pixels = shard_sizes(scene, self.world_size, stream_sizes(scene))
        self.split_pixels = int(self._shard_pixels.sum())
        _check_valid(scene, self._shard_pixels, self.rank, is_global)
        self.epoch = 0
        # the rays a run holds: K x B, or this shard's share of K x G positions (global)
        held = (self.rays_per_batch if not is_global else
                -(-self.global_batch * int(self._shard_pixels[self.rank]) // self.split_pixels))
        check_run_size(self.steps_per_run, held, self.prefetch + 2, self.device)
        need = int(shard_sizes(scene, self.world_size)[self.rank]) * 3  # decoded bytes
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
            stream = WindowStream(store, plan, np.arange(lo, hi), px, self.window_images, self.rays_per_window,
                                  output_map=self.output_map, positions_per_image=stream_sizes(scene)[lo:hi])
            producer = WindowProducer(self, stream)
        elif cache is None:
            cache = store.shard(plan.device)  # where this loader samples
        elif (cache.rank, cache.world_size) != (self.rank, self.world_size):
            raise ConfigError(f"cache: holds shard {cache.rank}/{cache.world_size}, loader is {self.rank}/{self.world_size}")
        elif cache.masked != scene.masked or cache.num_valid != int(self._shard_pixels[self.rank]):
            raise ConfigError(f"cache: {'has' if cache.masked else 'has no'} masks and {cache.num_valid} pixels to sample "
                              f"but the scene's shard {'has' if scene.masked else 'has no'} masks and "
                              f"{int(self._shard_pixels[self.rank])}; decode the cache from this scene")
        else:
            check_cache_device(cache, self.device, "RayLoader")
        if cache is not None:
            producer = RayProducer(self, cache)
        self.cache = cache
        self.num_pixels = producer.num_pixels
        super().__init__(producer, plan.priority)

    @property
    def stream(self) -> str:
        """shard | global (the plan's ``ray_stream``)."""
        return self.plan.ray_stream

    @property
    def streaming(self) -> bool:
        """True when the shard is streamed through decoded windows instead of cached whole."""
        return isinstance(self.producer, WindowProducer)

    # ---- epochs ---------------------------------------------------------------------------------
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
        return self.position // self.producer.stride

    def set_step(self, step: int) -> None:
        """Global stream: move to global step ``step`` (positions [step G, (step + 1) G)), whatever
        the world size the stream ran on before: the next batch is this rank's part of that step."""
        if self.stream != "global":
            raise ConfigError("set_step: the shard stream has no global steps; use load_state_dict, or stream='global'")
        check_int("set_step: step", step, 0, (INT64_MAX - self.positions_per_run) // self.global_batch)
        self._seek(int(step) * self.global_batch)

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """{"position", "epoch", "steps", "mode", "seed", "rank", "world_size", "rays_per_batch",
        "scene", "stream"} and the stream's own keys (:meth:`RayProducer.state`). "scene" is the
        split's fingerprint (:func:`dali_nerf.scenes.scene_fingerprint`)."""
        return dict(super().state_dict(), epoch=self.epoch, steps=self._stats.steps)

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly: the next batch is the one the saved loader would have returned. A state
        saved from another scene (its fingerprint differs: other images, sizes, cameras) or with
        other stream settings is refused with one line naming what differs. A global-stream state
        loads into a loader of any rank and world size with the same global batch: the union of
        the ranks' streams continues exactly (each rank takes its part of the saved next step)."""
        super().load_state_dict(state)
        self.epoch = int(state.get("epoch", 0))

    def stats(self) -> dict:
        """{"steps", "wait_s", "stall_fraction", "warmup_s", "stall_fraction_steady", "rays_per_s",
        "elapsed_s", "runs"} since the first next() (definitions: :class:`~.base.BatchStats`);
        when streaming also {"streaming", "window_images", "windows_per_cycle", "windows_decoded",
        "bytes_held", "peak_bytes", "decode_wait_s"} (decoded-window bytes now / at most so far)."""
        return super().stats()

    def __repr__(self) -> str:
        return (f"RayLoader(rank={self.rank}/{self.world_size}, B={self.rays_per_batch}, K={self.steps_per_run}, "
                f"mode={self.mode}, seed={self.seed}, prefetch={self.prefetch}, device={self.device}, "
                f"pixels={self.num_pixels}" + (f", streaming W={self.window_images}" if self.streaming else "") + ")")
