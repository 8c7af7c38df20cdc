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

import functools
import warnings
from dataclasses import dataclass
from time import perf_counter
from typing import Optional

from dali_nerf.data.hostbudget import dali_threads, local_world_size
from dali_nerf.sources.base import BatchSource, BatchStats, check_scene_state, scene_state
from dali_nerf.sources.runahead import RunAhead, SamplerStarved, SamplerStarvedWarning, StarvationGuard

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
                      f"over {StarvationGuard.MAX_STALL:.0%} of the time (busy cores starve them, or the sampling "
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
