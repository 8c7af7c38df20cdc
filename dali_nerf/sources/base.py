"""What every batch source shares: the base class, stats, argument checks, and the one helper
that runs a ray graph and converts its outputs to torch.

Batch contract (ARCHITECTURE.md): ``next(source)`` -> dict of torch tensors ``origins`` (B, 3)
f32, ``directions`` (B, 3) f32 unit, ``rgb`` (B, 3) f32, ``indices`` (B, 3) i64, ``near``/``far``
(B, 1) f32 when the scene has bounds; ``stats()``, ``state_dict()`` / ``load_state_dict()``,
``close()`` (idempotent), context manager.
"""

from __future__ import annotations

import collections
import operator
import queue
import threading
import time
import warnings
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from dali_nerf.data._dali import torch_feed
from dali_nerf.errors import ConfigError
from dali_nerf.data.hostbudget import dali_threads, local_world_size, to_background
from dali_nerf.data.imagecache import available_memory
from dali_nerf.pipelines.rays import GLOBAL_OUTPUTS, INT32_MAX, INT64_MAX, RAY_BYTES, RAY_OUTPUTS
from dali_nerf.scenes import describe_change, scene_fingerprint

__all__ = ["BatchSource", "BatchStats", "BATCH_KEYS", "dali_to_torch", "check_common",
           "check_positive", "check_int", "check_run_size", "MAX_PREFETCH", "check_cache_device", "run_graph", "step_views", "RunAhead", "StarvationGuard",
           "SamplerStarvedWarning", "demote_if_starved", "was_demoted", "scene_state", "check_scene_state",
           "global_epoch_steps", "PlanView"]

BATCH_KEYS = ("origins", "directions", "rgb", "indices", "near", "far")
"""Keys a batch may carry (near/far only when the scene has bounds)."""


class BatchStats:
    """Time blocked in ``__next__`` vs wall time since the first ``__next__`` (shared by every source).

    ``as_dict()`` -> {"steps", "wait_s", "stall_fraction", "warmup_s", "stall_fraction_steady",
    "rays_per_s", "elapsed_s", "runs"}:

    * ``stall_fraction`` = wait_s / elapsed_s, everything since the first ``next()`` was entered;
    * ``warmup_s`` = the wait for the first batch (building the pipeline, loading the operator,
      the first run): the first ``next()``'s duration;
    * ``stall_fraction_steady`` = (wait_s - warmup_s) / (elapsed_s - warmup_s): the stall after
      the first batch arrived (None before the first batch).
    """

    def __init__(self):
        self.steps = 0
        self.wait_s = 0.0
        self.rays = 0
        self.runs = 0
        self.t0: Optional[float] = None
        self.warmup_s: Optional[float] = None

    def start(self) -> float:
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        return now

    def stop(self, t_enter: float, rays: int) -> None:
        waited = time.perf_counter() - t_enter
        self.wait_s += waited
        if self.steps == 0:
            self.warmup_s = waited
        self.steps += 1
        self.rays += rays

    def as_dict(self) -> dict:
        elapsed = 0.0 if self.t0 is None else time.perf_counter() - self.t0
        steady = None
        if self.warmup_s is not None:
            rest = elapsed - self.warmup_s
            steady = (self.wait_s - self.warmup_s) / rest if rest > 0 else 0.0
        return {
            "steps": self.steps,
            "wait_s": self.wait_s,
            "stall_fraction": (self.wait_s / elapsed) if elapsed > 0 else 0.0,
            "warmup_s": self.warmup_s,
            "stall_fraction_steady": steady,
            "rays_per_s": (self.rays / elapsed) if elapsed > 0 else 0.0,
            "elapsed_s": elapsed,
            "runs": self.runs,
        }


MAX_PREFETCH = 1024
"""Largest ``prefetch`` (DALI's ``prefetch_queue_depth``) a source accepts."""


def global_epoch_steps(epoch: int, pixels: int, global_batch: int) -> tuple:
    """``(first, count)``: the global steps of ``epoch`` of a global stream of ``pixels`` (P) a
    permutation and ``global_batch`` (G) positions a step: steps [ceil(eP/G), ceil((e+1)P/G)).
    A step that straddles an epoch boundary belongs to the earlier epoch, so ``set_epoch(e)`` then
    ``count`` steps, over e = 0, 1, ..., visit every position exactly once."""
    first = -(-epoch * pixels // global_batch)
    return first, -(-(epoch + 1) * pixels // global_batch) - first


def check_int(name, v, lo: int, hi: int) -> None:
    """ConfigError (one line naming ``name`` and the range) unless ``v`` is an integer in [lo, hi]."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise ConfigError(f"{name}={v!r}: must be an integer in [{lo}, {hi}]")


def check_positive(name, v):
    """ConfigError unless ``v`` is an integer > 0."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ConfigError(f"{name}={v!r}: must be an integer > 0")


def check_run_size(steps_per_run: int, rays_per_batch: int, runs_held: int, device: str, op: bool = True) -> None:
    """Refuse (one line) an op run of ``K * B`` rays that the op's int32 ``rays`` cannot hold
    (``op``), or whose ``runs_held`` output buffers (``RAY_BYTES`` a ray) exceed the memory
    available now (a baseline's batches: ``op=False``)."""
    rays = int(steps_per_run) * int(rays_per_batch)
    if op and rays > INT32_MAX:
        raise ConfigError(f"rays_per_run={rays} ({steps_per_run} steps of rays_per_batch={rays_per_batch}): over the op's "
                          f"limit of {INT32_MAX} rays per run (int32); lower rays_per_run or rays_per_batch")
    need, avail = rays * RAY_BYTES * int(runs_held), available_memory(device)
    if need > avail:
        gib = 1 << 30
        raise ConfigError(f"rays_per_batch={rays_per_batch}: {runs_held} runs of {rays} rays in flight need "
                          f"{need / gib:.1f} GiB ({RAY_BYTES} bytes a ray) but only {avail / gib:.1f} GiB of "
                          f"{'GPU' if device == 'cuda' else 'host'} memory is available; lower rays_per_batch, "
                          f"rays_per_run or prefetch")


def check_cache_device(cache, device: str, who: str) -> None:
    """ConfigError unless the pre-decoded ``cache`` holds its pixels on ``device`` (a host cache
    fed to a GPU graph would be an error or a copy of the whole split every run)."""
    have = getattr(cache, "device", "cpu")
    if have != device:
        raise ConfigError(f"cache: decoded on {have} but {who} runs on {device}; decode it with "
                          f"decode_cache(..., device={device!r}) or build {who} with device={have!r}")


def check_common(scene, rays_per_batch, rank, world_size, seed, prefetch, mode):
    """Shared argument checks of every batch source (one-line ConfigError naming the argument and
    its range; the ranges are the op's argument types, :data:`dali_nerf.pipelines.rays.OP_ARGS`)."""
    check_int("rays_per_batch", rays_per_batch, 1, INT32_MAX)
    check_int("world_size", world_size, 1, INT32_MAX)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank!r}: must be in [0, world_size={world_size})")
    check_int("seed", seed, 0, INT64_MAX)
    check_int("prefetch", prefetch, 0, MAX_PREFETCH)
    if mode not in ("random", "epoch"):
        raise ConfigError(f"mode={mode!r}: use random or epoch")


def scene_state(scene) -> dict:
    """``{"scene": fingerprint}``: the part of every source's ``state_dict()`` that names the split
    it samples (:func:`dali_nerf.scenes.scene_fingerprint`, the whole split whatever the rank)."""
    return {"scene": scene_fingerprint(scene)}


def check_scene_state(state: dict, scene, who: str) -> None:
    """Refuse (ConfigError, one line naming what changed) a state saved from another scene than
    ``scene``: other images, sizes, cameras or downscale. A state without a fingerprint (saved
    before sources recorded one) is accepted: there is nothing to compare."""
    saved = state.get("scene") if isinstance(state, dict) else None
    change = describe_change(saved, scene_fingerprint(scene))
    if change is not None:
        raise ConfigError(f"{who}.load_state_dict: the state was saved from another scene than {scene.root} "
                          f"(split {scene.split!r}): {change}; load it into a {who} over the scene it was saved from")


def dali_to_torch(tl, device: str, copy: bool = False) -> torch.Tensor:
    """One pipeline output (a batch of 1 sample) as a torch tensor on ``device``.

    CPU: a zero-copy view (DALI 2.4's asynchronous executor gives each run new buffers, kept alive
    while referenced); ``copy``: the synchronous executor (prefetch 0) reuses its output buffers
    on the next run, so the view is copied, by numpy: ``torch.Tensor.clone`` of a tensor over DALI's
    buffer cost ~7.5 ms per output on the 2-core AMD EPYC VM (2026-12-06: ``run_graph(copy=True)``
    of a 65536-ray run of the six outputs took 48 ms with ``clone``, 0.7 ms with ``np.array``,
    against 0.6 ms without a copy), which made a synchronous run ~80x its sampling. CUDA: a device-to-device copy into a torch tensor.
    """
    if device == "cuda":  # pragma: no cover - needs a GPU
        feed_ndarray, to_torch_type = torch_feed()
        t = tl[0] if hasattr(tl, "__getitem__") else tl.as_tensor()
        dst = torch.empty(tuple(t.shape()), dtype=to_torch_type[t.dtype], device="cuda")
        feed_ndarray(t, dst, cuda_stream=torch.cuda.current_stream())
        return dst
    a = np.asarray(tl[0])
    return torch.from_numpy(np.array(a) if copy else a)


def run_graph(pipe, device: str, keys: Sequence[str], copy: bool):
    """Run a ray graph (:func:`~dali_nerf.pipelines.rays.ray_pipeline`) once: ``(consumed,
    {key: tensor (R, ...)})`` for ``keys`` (a subset of ``RAY_OUTPUTS[:-1]``; a global-stream
    graph also ``step_counts`` (K,) and ``positions`` (R,)), ``consumed`` the stream positions the
    run used. ``copy``: see :func:`dali_to_torch`."""
    outs = pipe.run()
    out = dict(zip(GLOBAL_OUTPUTS if len(outs) == len(GLOBAL_OUTPUTS) else RAY_OUTPUTS, outs))
    consumed = out["consumed"].as_cpu() if device == "cuda" else out["consumed"]
    consumed = int(np.asarray(consumed[0]).reshape(-1)[0])
    return consumed, {k: dali_to_torch(out[k], device, copy) for k in keys}


def run_phase(rank: int, steps_per_run: int, local_world: Optional[int] = None) -> int:
    """The step of each run at which this rank's :class:`RunAhead` is released: spread
    over the first K - 1 steps of the run by local rank (``rank`` modulo ``local_world``, default
    ``LOCAL_WORLD_SIZE``), so co-located ranks in lockstep do not all produce on the same step, and
    every rank leaves its thread at least one step to finish before the run is needed.

    >>> [run_phase(r, 16, local_world=4) for r in range(5)]
    [0, 3, 7, 11, 0]
    >>> run_phase(5, 16, local_world=1), run_phase(1, 2, local_world=4)
    (0, 0)
    """
    k = int(steps_per_run)
    w = local_world_size() if local_world is None else int(local_world)
    if k <= 2 or w <= 1:
        return 0
    return (int(rank) % w) * (k - 1) // w


def step_views(run: dict, steps: int, rays_per_batch: int) -> list:
    """The ``steps`` step batches of a run ``{key: (steps * B, ...)}`` as tuples of (B, ...) views
    in ``run``'s key order, made with one C++ call per output (``unbind``: ~0.6 us a view against
    ~3.7 us for a Python slice); a source hands out ``dict(zip(keys, views[i]))``."""
    return list(zip(*(v.view(steps, rays_per_batch, *v.shape[1:]).unbind(0) for v in run.values())))


CLOSE_TIMEOUT_S = 5.0
"""How long ``close()`` waits for a background thread (a run or a decode in flight) before it
leaves the thread to finish on its own: shutting down, Ctrl-C included, never waits unbounded."""


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _run_ahead_loop(pipe, produce, q: "queue.Queue", stop: threading.Event, retired: collections.deque,
                    go: threading.Event, background: Optional[frozenset]) -> None:
    try:
        if background is not None:
            to_background([0])
        while not stop.is_set():
            go.wait()  # the consumer's release() (or get() on an empty queue)
            if stop.is_set():
                break
            go.clear()
            retired.clear()  # the consumer's finished runs die here, not on the training thread
            item = produce(pipe)
            if background is not None:  # the pipeline's threads all exist after its first run
                to_background(dali_threads() - background)
                background = None
            q.put(item)
    except BaseException as e:  # handed to the consumer's next get()
        q.put(_Failure(e))


class SamplerStarvedWarning(RuntimeWarning):
    """A loader's background-priority sampler kept its consumer waiting; it runs at normal priority from then on."""


class StarvationGuard:
    """Does a background-priority sampler keep its consumer waiting?

    Background priority (``SCHED_IDLE``) is for a sampler that is ahead: its threads then take only
    cores nothing else wants. On a host whose cores are all busy with normal-priority work (other
    ranks' threads, other jobs, a training thread launching kernels) such threads get almost no CPU:
    measured on a 2-core Intel Xeon VM (2026-12-05, commit 4612e62) with three busy-looping
    processes beside one RayLoader at 1 ms steps (``benchmarks/starvation.py``), 202 steps/s with
    waits up to 0.5 s, against 879 steps/s at normal priority. A sampler the consumer waits for gains nothing from yielding the cores (the consumer
    is idle meanwhile), whatever keeps it behind, so the loaders return it to normal priority.

    ``add(t_enter, t_exit)`` records one blocking wait of the consumer; it returns True once the
    waits filled more than ``max_stall`` of a window of at least ``window_s`` wall seconds. Windows
    start at the end of the first wait (the pipeline's build and first run) and are closed only by
    a wait, so time the consumer spends away (evaluation, checkpoints) counts as time not waited.

    >>> g = StarvationGuard(max_stall=0.2, window_s=1.0)
    >>> g.add(0.0, 0.5), g.add(0.6, 0.7), g.add(1.4, 1.6)  # first wait (build) skipped; 0.3 s of 1.1 s waited
    (False, False, True)
    >>> g.add(2.0, 2.05), g.add(2.7, 2.75)  # a new window: 0.1 s of 1.15 s
    (False, False)
    """

    def __init__(self, max_stall: float = 0.2, window_s: float = 1.0):
        self.max_stall, self.window_s = float(max_stall), float(window_s)
        self._t0: Optional[float] = None
        self._waited = 0.0

    def add(self, t_enter: float, t_exit: float) -> bool:
        if self._t0 is None:
            self._t0 = t_exit
            return False
        self._waited += max(0.0, t_exit - t_enter)
        span = t_exit - self._t0
        if span < self.window_s:
            return False
        starved = self._waited > self.max_stall * span
        self._t0, self._waited = t_exit, 0.0
        return starved


class RunAhead:
    """Hands a ray graph's runs to the training thread from a background thread.

    ``pipe.run()`` costs the calling thread ~0.3-1 ms of Python and DALI bookkeeping per run even
    when DALI computed the run ahead (external-source feeds, scheduling the next run, wrapping the
    outputs); done in ``__next__`` it stalls the step that crosses into a new run, and in DDP every
    rank crosses on the same step, so on a shared host the whole lockstep waits for the slowest of
    W such calls. Here one thread per source calls ``produce(pipe)`` (run the graph, convert to
    torch, cut the step views) and keeps up to ``depth`` finished runs in a queue, so
    ``__next__`` only takes a finished run. The thread is the only caller of ``pipe`` while it
    lives; it holds no reference to the source (the source can be collected and closes it).

    ``get()`` -> the next ``produce`` result, in run order (raises what ``produce`` raised);
    ``retire(obj)`` hands a finished run back: the thread drops it before its next run, so the
    training thread does not pay for freeing its ~K x outputs tensors (~50-150 us a run, and in
    DDP every rank frees on the same step); ``close()`` stops and joins the thread (call it before
    releasing the pipeline). Idempotent.

    Paced: after the first run the thread produces the next only when the consumer calls
    ``release()`` (or when ``get()`` finds the queue empty, so it never waits for a run nobody
    asked for). Producing as soon as the queue has room would be right after each ``get()``: every
    co-located DDP rank crosses into a new run on the same step, so all their threads (and the
    DALI runs each ``pipe.run()`` schedules) would work in one burst; the loaders release at a step
    of the run that differs per local rank (:func:`run_phase`), which spreads that work over the run.

    ``background``: the ids of the process's DALI threads before ``pipe`` was built
    (:func:`~dali_nerf.data.hostbudget.dali_threads`), to run this thread and the pipeline's own DALI
    threads at background priority (:func:`~dali_nerf.data.hostbudget.to_background`, from the first
    run on); None (default) leaves every thread's priority as it is. In background, ``get()``
    feeds a :class:`StarvationGuard` (unless ``guard`` is False) and sets ``starved`` when the
    consumer keeps waiting: the owner then rebuilds its pipeline at normal priority
    (:func:`demote_if_starved`; an unprivileged thread may lower its priority but not raise it back).
    """

    def __init__(self, pipe, produce: Callable, depth: int = 1, name: str = "dali_nerf-run-ahead",
                 background: Optional[frozenset] = None, guard: bool = True):
        self.starved = False
        self._guard = StarvationGuard() if (background is not None and guard) else None
        self._q: "queue.Queue" = queue.Queue(maxsize=max(1, int(depth)))
        self._stop = threading.Event()
        self._retired: collections.deque = collections.deque()
        self._go = threading.Event()
        self._go.set()  # the first run is produced ahead
        self._thread = threading.Thread(target=_run_ahead_loop,
                                        args=(pipe, produce, self._q, self._stop, self._retired, self._go,
                                              None if background is None else frozenset(background)),
                                        name=name, daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Let the thread produce its next run now."""
        self._go.set()

    def get(self):
        t = time.perf_counter()
        if self._q.empty():
            self._go.set()  # a consumer about to wait must never wait for a run not yet allowed
        item = self._q.get()
        if self._guard is not None and self._guard.add(t, time.perf_counter()):
            self.starved = True
        if isinstance(item, _Failure):
            self._q.put(item)  # every later get() fails the same way
            raise item.exc
        return item

    def retire(self, obj) -> None:
        """Let the thread drop ``obj`` (a finished run and its step views) before its next run."""
        if obj is not None:
            self._retired.append(obj)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Stop the thread and wait for it at most ``timeout`` seconds (a run in flight finishes
        first). True when it ended; False: it is left running (a daemon thread that holds its own
        reference to the pipeline, so nothing is freed under it) with a ResourceWarning."""
        self._stop.set()
        self._go.set()
        deadline = time.monotonic() + float(timeout)
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:  # unblock a put() on a full queue until the thread sees stop
                while True:
                    self._q.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.01)
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
        if self._thread.is_alive():
            warnings.warn(f"{self._thread.name}: the sampler thread did not stop within {timeout:g} s (a DALI run "
                          f"still in flight); it is left to finish on its own", ResourceWarning, stacklevel=2)
            return False
        return True


def demote_if_starved(loader, who: str) -> bool:
    """At a run boundary of ``loader`` (a RayLoader or SpatialRayLoader: ``_ahead``, ``_drop_pipeline``,
    ``thread_priority``): when its :class:`RunAhead` reports ``starved``, warn once
    (:class:`SamplerStarvedWarning`), switch it to normal priority and drop its pipeline; the next
    fetch rebuilds it at the same stream position, so the batches do not change."""
    ahead = getattr(loader, "_ahead", None)
    if ahead is None or not ahead.starved:
        return False
    warnings.warn(f"{who}: its background-priority sampler threads kept the training thread waiting over "
                  f"{ahead._guard.max_stall:.0%} of the time (busy cores starve them, or the sampling cannot keep up); they run at normal "
                  f"priority from now on (pipeline.thread_priority=normal starts so)", SamplerStarvedWarning,
                  stacklevel=3)
    loader.thread_priority = "normal"
    loader._drop_pipeline()
    return True


def was_demoted(source) -> bool:
    """True when ``source`` (a loader of :func:`demote_if_starved`) started at background priority
    (its plan's) and runs at normal priority now: its starved sampler was returned to normal. A
    source planned at normal priority (the synchronous ``rays_sync``, the baselines) never was."""
    plan = getattr(source, "plan", None)
    return getattr(plan, "priority", None) == "background" and getattr(source, "thread_priority", None) == "normal"


class PlanView:
    """A source's settings under the names they always had, read from its plan (``self.plan``, a
    :class:`~dali_nerf.data.plan.SamplingPlan`: the one record of them; a source copies none):
    rays_per_batch, rays_per_run, steps_per_run, positions_per_run, global_batch, rank,
    world_size, seed, mode, prefetch, device, num_threads (the plan's ``threads``), decode_batch."""


for _name, _field in {"rays_per_batch": "rays_per_batch", "rays_per_run": "rays_per_run",
                      "steps_per_run": "steps_per_run", "positions_per_run": "positions_per_run",
                      "global_batch": "global_batch", "rank": "rank", "world_size": "world_size", "seed": "seed",
                      "mode": "mode", "prefetch": "prefetch", "device": "device", "num_threads": "threads",
                      "decode_batch": "decode_batch"}.items():
    setattr(PlanView, _name, property(operator.attrgetter(f"plan.{_field}"), doc=f"The plan's ``{_field}``."))


class BatchSource:
    """What every batch source shares (RayLoader, the baselines, the SS sources): iteration,
    ``stats()`` from a :class:`BatchStats` in ``self._stats``, the context manager, and ``close()``
    on garbage collection. Subclasses implement ``__next__`` and ``close()`` (idempotent)."""

    def __iter__(self):
        return self

    def stats(self) -> dict:
        """{"steps", "wait_s", "stall_fraction", "warmup_s", "stall_fraction_steady", "rays_per_s",
        "elapsed_s", "runs"} since the first next() (see :class:`BatchStats`)."""
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
