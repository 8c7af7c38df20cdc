"""The runner: the machinery of a batch source that samples ahead, written once and generic over
what a batch holds — the run-ahead thread (:class:`RunAhead`), the stall and warm-up accounting
(:class:`~dali_nerf.sources.base.BatchStats`), the starvation guard (:class:`StarvationGuard`:
a background-priority sampler its consumer waits for returns to normal priority), the stream
state with the split's fingerprint, and close. A batch kind is a *producer* plugged into a
:class:`RunSource`: rays from our DALI ray graph (:class:`~dali_nerf.sources.rays.RayLoader`, its
streaming windows, :class:`~dali_nerf.sources.spatial.SpatialRayLoader`), or whole images and
cameras for a splatting trainer, without a copy of this machinery.

A producer samples in *runs*: a graph (a DALI pipeline, or any handle) built to start at a stream
position gives run after run, each a :class:`Run` of K step batches; the runner hands the steps out
one ``next()`` at a time, takes the next run when one is used up (from the run-ahead thread when
the producer samples ahead), and keeps the cursor: the stream position of the current run's start
and the offset of the next batch in it (its state, and where a graph is rebuilt after a seek, a
loaded state or a starved sampler's return to normal priority).

The producer contract (what a batch kind implements; attributes are fixed at construction):

============================== =================================================================
``kind``, ``who``              names in messages: the source's class ("RayLoader") and the
                               source itself ("RayLoader rank 0")
``thread_name``                the run-ahead thread's name ("dali_nerf-...")
``scene``                      the split it samples (its fingerprint is every state's ``"scene"``)
``ahead``                      True: runs are produced on the run-ahead thread; False: in ``next()``
``linear``                     True: offsets in a run are stream positions (a seek or a state may
                               land anywhere); False: a run consumes a number of positions known
                               once it is made (the routed SS stream)
``steps_per_run``, ``phase_rank``  K and the rank (or cell) that spread co-located sources'
                               run-ahead releases over a run (:func:`run_phase`)
``build(start) -> graph``      a graph whose first run starts at stream position ``start``
``produce(graph) -> Run``      the graph's next run; on the run-ahead thread when ``ahead``, so it
                               touches only ``graph`` and the producer's fixed settings
``release(graph)``             free a graph (its run-ahead thread has stopped)
``abort(graph)`` (optional)    end a run in flight on the run-ahead thread at once (it raises
                               there): a closed or replaced graph's run is nobody's, and on starved
                               cores it could last minutes; without it that run is waited for
``state(start, offset)``       the stream state of the next batch: ``offset`` into the run that
                               starts at ``start`` (a dict; the runner adds ``"scene"``)
``load_state(state)``          check a state against the producer's settings (one-line
                               ConfigError) and return its ``(start, offset)``
``info()``                     what ``stats()`` adds (a dict, may be empty)
``close()``                    free what the producer holds (idempotent)
============================== =================================================================

A toy producer whose step k holds the stream positions ``[4k, 4k + 4)``, two steps a run:

>>> class Counting:
...     kind, who, thread_name, ahead, linear, steps_per_run, phase_rank = ("Counting", "counting",
...         "dali_nerf-counting", True, True, 2, 0)
...     def __init__(self, scene): self.scene = scene
...     def build(self, start): return [start]               # the graph: where its next run starts
...     def produce(self, graph):
...         s, graph[0] = graph[0], graph[0] + 8
...         steps = [(torch.arange(s, s + 4),), (torch.arange(s + 4, s + 8),)]
...         return Run(steps, stride=4, consumed=8, keys=("x",), data={"x": torch.arange(s, s + 8)})
...     def release(self, graph): pass
...     def state(self, start, offset): return {"position": start + offset}
...     def load_state(self, state): return int(state["position"]), 0
...     def info(self): return {}
...     def close(self): pass
>>> src = RunSource(Counting(scene))
>>> [next(src)["x"].tolist() for _ in range(3)]
[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
>>> state = src.state_dict()                    # {"position": 12, "scene": ...}
>>> src.load_state_dict({**state, "position": 2}); next(src)["x"].tolist()
[2, 3, 4, 5]
>>> src.stats()["steps"], src.close()
(4, None)
"""

from __future__ import annotations

import atexit
import collections
import functools
import queue
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from time import perf_counter
from typing import Callable, Optional

from dali_nerf.data.hostbudget import dali_threads, local_world_size, to_background, to_normal
from dali_nerf.sources.base import CLOSE_TIMEOUT_S, BatchSource, BatchStats, check_scene_state, scene_state

__all__ = ["Run", "RunSource", "RunAhead", "StarvationGuard", "SamplerStarvedWarning", "run_phase", "was_demoted"]


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



class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class _Exit:
    """A run-ahead thread's end, shared by the thread and its :class:`RunAhead` (never the source):
    ``abort()`` ends a run in flight at once (the producer's ``abort(graph)``: a DALI pipeline shut
    down, its run raises on the thread) unless the thread has ended; ``hand_over(release)`` leaves
    freeing the graph to the thread, which calls it as it ends (``end()``)."""

    def __init__(self, abort: Optional[Callable] = None):
        self.lock = threading.Lock()
        self.done = self.aborted = False
        self.release: Optional[Callable] = None
        self._abort = abort

    def abort(self) -> None:
        with self.lock:
            if self._abort is not None and not self.done and not self.aborted:
                self.aborted = True
                self._abort()

    def hand_over(self, release: Callable) -> bool:
        """Leave ``release`` to the thread; False: it has ended (the caller releases)."""
        with self.lock:
            if self.done:
                return False
            self.release = release
            return True

    def end(self) -> None:
        with self.lock:
            self.done, release = True, self.release
        if release is not None:
            release()


def _run_ahead_loop(pipe, produce, q: "queue.Queue", stop: threading.Event, retired: collections.deque,
                    go: threading.Event, background: Optional[frozenset], tids: list, exit_: _Exit) -> None:
    try:
        while not stop.is_set():
            go.wait()  # the consumer's release() (or get() on an empty queue)
            if stop.is_set():
                break
            go.clear()
            retired.clear()  # the consumer's finished runs die here, not on the training thread
            item = produce(pipe)
            if stop.is_set():  # closed meanwhile: the run is nobody's
                break
            if background is not None:
                # the graph's own threads (DALI's, all started by its first run), after that run:
                # the consumer waits for it (yielding the cores gains nothing then), and the guard
                # does not count that wait, so on busy cores a first run at SCHED_IDLE went
                # unnoticed for minutes (2026-12-07: 74 s, two busy loops on 2 cores). Not this
                # thread: it runs Python, and a SCHED_IDLE thread preempted on busy cores while it
                # holds the GIL stops every other Python thread, the training thread too (a
                # priority inversion the guard cannot see: 2026-12-07, SS training beside two busy
                # loops on 2 cores took 11-434 s against 7 s quiet, the training thread waiting
                # for the GIL in close() and before its first step).
                mine = sorted(dali_threads() - background)
                to_background(mine)
                tids.extend(mine)  # what RunAhead.get() raises back when the consumer starves
                background = None
            q.put(item)
    except BaseException as e:  # handed to the consumer's next get(); a closed one's (aborted) is nobody's
        if not stop.is_set():
            q.put(_Failure(e))
    finally:
        retired.clear()
        exit_.end()


_LEFT: "dict[threading.Thread, _Exit]" = {}
"""Run-ahead threads their owners stopped without waiting for the run in flight (a starved sampler
replaced, a close past its timeout), with their ends: waited for at interpreter exit (:func:`_wait_left`)."""
LEFT_EXIT_WAIT_S = 30.0
ABORT_AFTER_S = 0.2
""":meth:`RunAhead.close` waits this long for a run in flight before it aborts it (a run nobody will
use; most end sooner, and a starved one could take minutes)."""


@atexit.register
def _wait_left(timeout: float = LEFT_EXIT_WAIT_S) -> None:
    """At exit, end the runs the threads left by their owners still have in flight and wait for
    those threads (at most ``timeout`` s, saying so in one line after 1 s): a process must not be
    torn down under a thread inside a DALI run (the thread is killed mid-run: "terminate called
    without an active exception", exit status 134)."""
    alive = [(t, e) for t, e in list(_LEFT.items()) if t.is_alive()]
    for _, e in alive:
        e.abort()
    end = time.monotonic() + timeout
    for i, (t, _) in enumerate(alive):
        t.join(timeout=max(0.0, min(end, time.monotonic() + 1.0) - time.monotonic()) if i == 0 else 0.0)
    alive = [t for t, _ in alive if t.is_alive()]
    if alive:
        print(f"dali_nerf: waiting up to {timeout:g} s for {len(alive)} sampler thread(s) to end their run in flight "
              f"({', '.join(t.name for t in alive)})", file=sys.stderr, flush=True)
    for t in alive:
        t.join(timeout=max(0.0, end - time.monotonic()))


class SamplerStarved(Exception):
    """Raised by :meth:`RunAhead.get` when its background sampler starves the consumer and the kernel
    refuses to raise its priority: the owner replaces the graph (:meth:`RunSource._next_run`)."""


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

    ``starving(t_enter, now)`` asks the same of a wait still in progress, so a sampler that gets no
    CPU at all is caught within a window, not when (if ever) its run arrives:

    >>> g.starving(2.8, 3.0), g.starving(2.8, 3.8)  # window from 2.75: 0.25 s is too short; 1.0 s of 1.05 s
    (False, True)
    """

    poll_s = 0.05
    """How often a guarded wait asks :meth:`starving`."""

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

    def starving(self, t_enter: float, now: float) -> bool:
        """Would the wait that began at ``t_enter`` close a starved window if it ended ``now``?"""
        if self._t0 is None:
            return False
        span = now - self._t0
        return span >= self.window_s and self._waited + max(0.0, now - t_enter) > self.max_stall * span


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
    DDP every rank frees on the same step); ``close(timeout, release)`` stops the thread, aborts a
    run in flight it would otherwise wait for (``abort``: the producer's, bound to the graph) and
    frees the graph (``release``) once the thread has let go of it. Idempotent.

    Paced: after the first run the thread produces the next only when the consumer calls
    ``release()`` (or when ``get()`` finds the queue empty, so it never waits for a run nobody
    asked for). Producing as soon as the queue has room would be right after each ``get()``: every
    co-located DDP rank crosses into a new run on the same step, so all their threads (and the
    DALI runs each ``pipe.run()`` schedules) would work in one burst; the loaders release at a step
    of the run that differs per local rank (:func:`run_phase`), which spreads that work over the run.

    ``background``: the ids of the process's DALI threads before ``pipe`` was built
    (:func:`~dali_nerf.data.hostbudget.dali_threads`), to run the pipeline's own DALI threads at
    background priority (:func:`~dali_nerf.data.hostbudget.to_background`, from the first run on;
    never this thread, which holds the GIL while it works); None (default) leaves every thread's
    priority as it is. In background, ``get()``
    feeds a :class:`StarvationGuard` (unless ``guard`` is False), also while it waits, and when the
    consumer keeps waiting raises those threads back to normal priority in place
    (:func:`~dali_nerf.data.hostbudget.to_normal`; ``promoted`` is then True and the guard is off).
    Where the kernel refuses (an unprivileged process may lower its priority but not raise it back)
    it sets ``starved``; a ``get()`` still waiting raises :class:`SamplerStarved`. The owner then
    replaces the graph with one at normal priority (:meth:`RunSource._demote`) without waiting for
    the starved run: ``close(0, release)`` leaves this thread to finish it and free the graph.
    """

    def __init__(self, pipe, produce: Callable, depth: int = 1, name: str = "dali_nerf-run-ahead",
                 background: Optional[frozenset] = None, guard: bool = True, abort: Optional[Callable] = None):
        self.starved = False
        self.promoted = False
        self._guard = StarvationGuard() if (background is not None and guard) else None
        self._q: "queue.Queue" = queue.Queue(maxsize=max(1, int(depth)))
        self._stop = threading.Event()
        self._retired: collections.deque = collections.deque()
        self._go = threading.Event()
        self._go.set()  # the first run is produced ahead
        self._tids: list = []  # its graph's DALI threads, once lowered
        self._exit = _Exit(abort)
        self._thread = threading.Thread(target=_run_ahead_loop,
                                        args=(pipe, produce, self._q, self._stop, self._retired, self._go,
                                              None if background is None else frozenset(background), self._tids,
                                              self._exit),
                                        name=name, daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Let the thread produce its next run now."""
        self._go.set()

    def get(self):
        t = time.perf_counter()
        if self._q.empty():
            self._go.set()  # a consumer about to wait must never wait for a run not yet allowed
        guard = self._guard
        if guard is None:
            item = self._q.get()
        else:
            while True:
                try:
                    item = self._q.get(timeout=guard.poll_s)
                    break
                except queue.Empty:
                    if self._guard is not None and guard.starving(t, time.perf_counter()) and not self._promote():
                        raise SamplerStarved(self._thread.name) from None
            if self._guard is not None and guard.add(t, time.perf_counter()):
                self._promote()
        if isinstance(item, _Failure):
            self._q.put(item)  # every later get() fails the same way
            raise item.exc
        return item

    def _promote(self) -> bool:
        """The consumer starves: raise the sampler's threads to normal priority (a graph that
        started none has nothing to raise). False (and ``starved``) where the kernel refuses."""
        if to_normal(self._tids):
            self.promoted, self._guard = True, None
            return True
        self.starved = True
        return False

    def retire(self, obj) -> None:
        """Let the thread drop ``obj`` (a finished run and its step views) before its next run."""
        if obj is not None:
            self._retired.append(obj)

    def close(self, timeout: float = CLOSE_TIMEOUT_S, release: Optional[Callable] = None) -> bool:
        """Stop the thread and wait for it at most ``timeout`` seconds, then call ``release`` (free
        the graph). A run in flight is nobody's: past :data:`ABORT_AFTER_S` (at once when ``timeout``
        is 0) it is aborted where the producer can (``abort``). True when the thread ended; False:
        it is left to end on its own (a daemon thread holding its own reference to the graph, so
        nothing is freed under it), calls ``release`` itself as it ends, and the process waits for it
        at exit (:func:`_wait_left`). Past a nonzero ``timeout`` that also warns (ResourceWarning)."""
        self._stop.set()
        self._go.set()
        t0 = time.monotonic()
        while True:
            try:  # unblock a put() on a full queue until the thread sees stop
                while True:
                    self._q.get_nowait()
            except queue.Empty:
                pass
            if not self._thread.is_alive():
                break
            waited = time.monotonic() - t0
            if waited >= min(ABORT_AFTER_S, timeout):
                self._exit.abort()
            if waited >= timeout:
                break
            self._thread.join(timeout=0.01)
        if not self._thread.is_alive():
            self._thread.join()
            if release is not None:
                release()
            return True
        for t in [t for t in _LEFT if not t.is_alive()]:
            del _LEFT[t]
        _LEFT[self._thread] = self._exit
        if release is not None and not self._exit.hand_over(release):
            release()  # it ended just now
        if timeout > 0:
            warnings.warn(f"{self._thread.name}: the sampler thread did not stop within {timeout:g} s (a run "
                          f"still in flight); it is left to end on its own", ResourceWarning, stacklevel=2)
        return False


def was_demoted(source) -> bool:
    """True when ``source`` (a :class:`RunSource`) started at background priority
    (its plan's) and runs at normal priority now: its starved sampler was returned to normal. A
    source planned at normal priority (the synchronous ``rays_sync``, the baselines) never was."""
    plan = getattr(source, "plan", None)
    return getattr(plan, "priority", None) == "background" and getattr(source, "thread_priority", None) == "normal"


@dataclass
class Run:
    """One run of a producer: ``steps`` batches in stream order, and how far it moved the stream."""

    steps: list
    """The step batches: tuples in :attr:`keys` order (a batch is ``dict(zip(keys, step))``), or
    dicts when :attr:`keys` is None."""
    stride: int
    """Offset units one step takes in the run (B rays; the global stream: G positions)."""
    consumed: int
    """Stream positions the run used: the graph's next run starts that far on (a linear
    producer's: ``len(steps) * stride``)."""
    keys: Optional[tuple] = None
    counts: Optional[list] = None
    """Items (rays, images) in each step where they vary (the global stream); None: ``stride`` each."""
    data: Optional[dict] = None
    """The run's tensors whole, ``{key: (len(steps) * stride, ...)}``: a batch a seek put off the
    step grid is a slice of them (None: the producer's offsets never leave the grid)."""
    graph_runs: int = 1
    """Graph runs this run took (``stats()["runs"]``)."""

    @property
    def length(self) -> int:
        """Offset units the run's steps cover."""
        return len(self.steps) * self.stride


class RunSource(BatchSource):
    """A batch source made of a producer (the module doc's contract) and the machinery every such
    source shares: runs handed out step by step with the stall and warm-up accounting, the
    run-ahead thread paced by :func:`run_phase`, a background-priority sampler returned to normal
    priority when starved, the cursor and its state (with the split's fingerprint), and close.

    ``priority``: the priority its sampler threads start at (normal | background: the run-ahead
    thread and the DALI threads the producer's graph starts, :mod:`dali_nerf.data.hostbudget`).
    ``starvation_guard = False`` (class or instance) keeps a starved sampler in background.
    """

    starvation_guard = True
    """Background priority: return a starved sampler to normal priority (:class:`StarvationGuard`)."""

    def __init__(self, producer, priority: str = "normal"):
        self.producer = producer
        self.thread_priority = priority  # the sampler's priority now (a starved one returns to normal)
        self._stats = BatchStats()
        self._graph = None  # the producer's live graph (None: built at the next fetch)
        self._ahead: Optional[RunAhead] = None  # the run-ahead thread of the graph (producer.ahead)
        self._phase = 0  # the step of each run at which self._ahead may produce the next (run_phase)
        self._run: Optional[Run] = None  # the run in hand
        self._start = 0  # stream position of the run in hand (or of the next graph's first run)
        self._offset = 0  # offset of the next batch in that run
        self._next_start = 0  # where the live graph's next run starts
        self._closed = False

    # ---- iteration ------------------------------------------------------------------------------
    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError(f"{self.producer.kind} is closed")
        st = self._stats
        t = perf_counter()
        if st.t0 is None:
            st.t0 = t
        run, off = self._run, self._offset
        if run is None or off + run.stride > run.length:
            run = self._next_run()
            off = self._offset
        k, r = divmod(off, run.stride)
        if r == 0:  # the usual case: a precomputed step (a fresh dict, so callers may mutate it)
            batch = dict(zip(run.keys, run.steps[k])) if run.keys is not None else dict(run.steps[k])
            if k == self._phase and self._ahead is not None:
                self._ahead.release()
            n = run.stride if run.counts is None else run.counts[k]
        else:  # a seek or a loaded state put the batch off the step grid: a slice of the run
            batch = {key: v[off:off + run.stride] for key, v in run.data.items()}
            n = run.stride
        self._offset = off + run.stride
        waited = perf_counter() - t  # BatchStats.stop, inlined (this is the per-step hot path)
        st.wait_s += waited
        if st.steps == 0:
            st.warmup_s = waited
        st.steps += 1
        st.rays += n
        return batch

    def _next_run(self) -> Run:
        """The run of the next batch: the live graph's next one, or the first of a graph built
        where the next batch starts (the first fetch; after a seek, a loaded state or a starved
        sampler's return to normal; a batch across two runs of a linear producer)."""
        run = self._run
        if run is not None:
            if self._offset == run.length or not self.producer.linear:
                start = self._start + run.consumed  # the stream goes on where the run ended
            else:
                start = self._start + self._offset  # a batch across two runs: a graph that starts there
            self._start, self._offset, self._run = start, 0, None
            if start != self._next_start:
                self._drop_graph()
            if self._ahead is not None:
                self._ahead.retire(run)  # freed on the run-ahead thread, not this one
                self._demote_if_starved()
        if self._graph is None:
            self._build()
        if self._ahead is None:
            run = self.producer.produce(self._graph)
        else:
            try:
                run = self._ahead.get()
            except SamplerStarved:  # starved mid-wait, the kernel refused to raise it: replace it
                self._demote()
                self._build()
                run = self._ahead.get()
            if self._ahead.promoted and self.thread_priority == "background":
                self._demote()  # raised in place: the graph goes on
        self._received(run)
        self._next_start = self._start + run.consumed
        self._run = run
        return run

    def _received(self, run: Run) -> None:
        """Per-run accounting (a subclass adds its own): graph runs."""
        self._stats.runs += run.graph_runs

    def _build(self) -> None:
        before = dali_threads() if self.thread_priority == "background" else None
        self._graph = self.producer.build(self._start)
        self._next_start = self._start
        if self.producer.ahead:
            # released at this rank's step of each run (run_phase), so co-located ranks in lockstep
            # do not all hand over and schedule their next runs on the same step
            abort = getattr(self.producer, "abort", None)
            self._ahead = RunAhead(self._graph, self.producer.produce, name=self.producer.thread_name,
                                   background=before, guard=self.starvation_guard,
                                   abort=None if abort is None else functools.partial(abort, self._graph))
            self._phase = run_phase(self.producer.phase_rank, self.producer.steps_per_run)

    def _drop_graph(self, wait: bool = True) -> None:
        """Stop the run-ahead thread and free the graph (and the run in hand): the next fetch
        builds a graph at the cursor. ``wait=False``: do not wait for a run in flight (the thread
        finishes it and frees the graph itself: :meth:`RunAhead.close`)."""
        self._run = None
        graph, self._graph = self._graph, None
        release = None if graph is None else functools.partial(self.producer.release, graph)
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close(**({} if wait else {"timeout": 0.0}), release=release)
        elif release is not None:
            release()

    def _demote(self, stacklevel: int = 4) -> None:
        """The sampler starved its consumer: warn once (:class:`SamplerStarvedWarning`) and run at
        normal priority from now on: its threads were raised in place (``promoted``), or else the
        graph is dropped without waiting for the starved run and the next fetch rebuilds it at the
        same stream position (new threads at normal priority), so the batches do not change."""
        ahead = self._ahead
        how = ("were raised to normal priority" if ahead.promoted else
               "are replaced by threads at normal priority (this process may not raise a thread's priority: "
               "CAP_SYS_NICE or ulimit -e 20 lets it)")
        warnings.warn(f"{self.producer.who}: its background-priority sampler threads kept the training thread waiting "
                      f"over {StarvationGuard().max_stall:.0%} of the time (busy cores starve them, or the sampling "
                      f"cannot keep up); they {how} (pipeline.thread_priority=normal starts so)",
                      SamplerStarvedWarning, stacklevel=stacklevel)
        self.thread_priority = "normal"
        if not ahead.promoted:
            self._drop_graph(wait=False)

    def _demote_if_starved(self) -> None:
        """At a run boundary: the guard found the consumer starved after a wait and the kernel
        refused to raise the threads (``starved``): :meth:`_demote`."""
        if self._ahead is not None and self._ahead.starved:
            self._demote(stacklevel=5)

    # ---- the cursor -----------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """A linear producer's stream position of the next batch."""
        return self._start + self._offset

    def _cursor(self) -> tuple:
        """(start, offset) of the next batch: past the end of the run in hand, the next run's start."""
        run = self._run
        if run is not None and self._offset >= run.length:
            return self._start + run.consumed, 0
        return self._start, self._offset

    def _seek(self, position: int) -> None:
        """Move the next batch to stream ``position`` (a linear producer): the run in hand is kept
        when the position falls in it (a slice when off its step grid), the live graph when it
        goes on there; else a graph is built there at the next fetch."""
        position = int(position)
        if position == self.position:
            return
        run = self._run
        if run is not None and 0 <= position - self._start and position - self._start + run.stride <= run.length:
            self._offset = position - self._start
        elif run is not None and position == self._next_start:
            self._offset = position - self._start  # the run is done: the graph's next run is the position's
        else:
            self._restart(position, 0)

    def _restart(self, start: int, offset: int) -> None:
        """The next batch at ``offset`` into the run that starts at ``start``, from a graph built there."""
        self._drop_graph()
        self._start, self._offset = int(start), int(offset)

    # ---- state, stats, shutdown -----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The producer's state of the next batch (:meth:`_cursor`) and ``"scene"``, the split's
        fingerprint (:func:`dali_nerf.scenes.scene_fingerprint`)."""
        return {**self.producer.state(*self._cursor()), **scene_state(self.producer.scene)}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was saved: a state of another scene (its fingerprint
        differs) is refused in one line naming what changed, the rest as the producer checks it."""
        check_scene_state(state, self.producer.scene, self.producer.kind)
        start, offset = self.producer.load_state(state)
        if self.producer.linear:
            self._seek(start + offset)
        else:
            self._restart(start, offset)

    def stats(self) -> dict:
        """:class:`~dali_nerf.sources.base.BatchStats`'s, and what the producer adds (``info()``)."""
        return {**self._stats.as_dict(), **self.producer.info()}

    def close(self) -> None:
        """Stop the run-ahead thread, free the graph and the producer's holdings. Idempotent."""
        if not self._closed:
            self._closed = True
            self._drop_graph()
            self.producer.close()
