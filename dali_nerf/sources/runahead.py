"""The run-ahead thread of a batch source (:class:`RunAhead`), written once for every batch kind:
it makes a graph's runs ahead of the training thread, hands them over paced by the consumer, runs
the graph's own threads at background priority where asked, and watches that the consumer does not
starve (:class:`StarvationGuard`): a starved sampler's threads are raised back to normal priority in
place, or, where the kernel refuses, :class:`SamplerStarved` tells the owner to replace the graph.
Closing it aborts a run nobody will use (the producer's ``abort``), and a process waits at exit
for the runs its owners left in flight (:func:`_wait_left`). :mod:`dali_nerf.sources.runner`
plugs it into :class:`~dali_nerf.sources.runner.RunSource`.
"""

from __future__ import annotations

import atexit
import collections
import queue
import sys
import threading
import time
import warnings
from typing import Callable, Optional

from dali_nerf.data.hostbudget import dali_threads, to_background, to_normal
from dali_nerf.sources.base import CLOSE_TIMEOUT_S

__all__ = ["RunAhead", "StarvationGuard", "SamplerStarved", "SamplerStarvedWarning", "ABORT_AFTER_S",
           "LEFT_EXIT_WAIT_S"]


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
    if alive:
        alive[0][0].join(timeout=min(1.0, timeout))
    alive = [t for t, _ in alive if t.is_alive()]
    if alive:
        print(f"dali_nerf: waiting up to {timeout:g} s for {len(alive)} sampler thread(s) to end their run in flight "
              f"({', '.join(t.name for t in alive)})", file=sys.stderr, flush=True)
    for t in alive:
        t.join(timeout=max(0.0, end - time.monotonic()))


class SamplerStarved(Exception):
    """Raised by :meth:`RunAhead.get` when its background sampler starves the consumer and the
    kernel refuses to raise its priority: the owner replaces the graph
    (:meth:`~dali_nerf.sources.runner.RunSource._next_run`)."""


class SamplerStarvedWarning(RuntimeWarning):
    """A loader's background-priority sampler kept its consumer waiting; it runs at normal priority from then on."""


class StarvationGuard:
    """Does a background-priority sampler keep its consumer waiting?

    Background priority (``SCHED_IDLE``) is for a sampler that is ahead: its threads then take only
    cores nothing else wants. On a host whose cores are all busy with normal-priority work (other
    ranks' threads, other jobs, a training thread launching kernels) such threads get almost no CPU:
    measured on a 2-core Intel Xeon VM (2026-12-05, commit 4612e62) with three busy-looping
    processes beside one RayLoader at 1 ms steps (``benchmarks/starvation.py``), 202 steps/s with
    waits up to 0.5 s, against 879 steps/s at normal priority. A sampler the consumer waits for
    gains nothing from yielding the cores (the consumer is idle meanwhile), whatever keeps it
    behind, so the loaders return it to normal priority.

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

    MAX_STALL = 0.2
    """The default ``max_stall`` (the loaders' guard)."""

    def __init__(self, max_stall: float = MAX_STALL, window_s: float = 1.0):
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
    of the run that differs per local rank (:func:`~dali_nerf.sources.runner.run_phase`), which
    spreads that work over the run.

    ``background``: the ids of the process's DALI threads before ``pipe`` was built
    (:func:`~dali_nerf.data.hostbudget.dali_threads`), to run the pipeline's own DALI threads at
    background priority (:func:`~dali_nerf.data.hostbudget.to_background`, from the first run on;
    never this thread, which holds the GIL while it works); None (default) leaves every thread's
    priority as it is. In background, ``get()`` feeds a :class:`StarvationGuard` (unless ``guard``
    is False), also while it waits, and when the consumer keeps waiting raises those threads back
    to normal priority in place
    (:func:`~dali_nerf.data.hostbudget.to_normal`; ``promoted`` is then True and the guard is off).
    Where the kernel refuses (an unprivileged process may lower its priority but not raise it back)
    it sets ``starved``; a ``get()`` still waiting raises :class:`SamplerStarved`. The owner then
    replaces the graph with one at normal priority
    (:meth:`~dali_nerf.sources.runner.RunSource._demote`) without waiting for the starved run:
    ``close(0, release)`` aborts it and leaves this thread to end and free the graph.
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
