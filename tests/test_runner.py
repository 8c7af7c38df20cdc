"""The runner (dali_nerf/sources/runner.py, its run-ahead thread in runahead.py) with a toy
producer: the machinery every batch kind gets without a copy — runs handed out in order (from
the run-ahead thread, or in next()), seeks that keep the run or the graph, a batch off the step
grid sliced from the run, the state (with the split's fingerprint) continued exactly by a new
source, a producer whose runs consume more positions than they hold, a failure handed to next(),
a starved background sampler returned to normal priority with the same batches (caught while the
consumer waits), close (a run in flight aborted, or left to end and free its graph; the exit waits
for it), and a source collected while its thread lives."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
import warnings
import weakref

import pytest
import torch

from _priority import GraphThread, can_raise, raise_refused
from _tiny_scene import tiny_scene
from dali_nerf.errors import ConfigError
from dali_nerf.sources.runner import Run, RunSource, SamplerStarvedWarning

B, K, GAP = 4, 3, 5


class _NoThread:
    """A graph without threads of its own."""

    tid = 0

    def stop(self):
        pass


class Counting:
    """Step k of a run that starts at stream position s holds the positions the run keeps: a linear
    producer keeps [s, s + K B); with ``gap`` it consumes K B + gap positions (like routed rays,
    which skip the rays that miss the cell) and keeps the first K B of them."""

    kind, who, thread_name, steps_per_run, phase_rank = "Counting", "counting", "dali_nerf-counting", K, 0

    def __init__(self, scene, ahead=True, gap=0, fail_at=None, slow=None, abortable=False, graph_thread=True):
        self.scene, self.ahead, self.gap, self.linear, self.fail_at = scene, ahead, gap, gap == 0, fail_at
        self.builds, self.threads, self.made = [], set(), 0
        self.slow = slow  # (n, seconds): the first graph's n-th run sleeps that long
        self.slow_end = None  # the scheduling policy of that graph's thread when the run ended
        self.released = {}  # graph number -> the thread that released it
        self.aborted = []  # graph numbers whose run in flight was aborted
        if abortable:
            self.abort = self._abort
        self.graph_thread = graph_thread

    def build(self, start):
        self.builds.append(start)
        # a graph's own thread, as DALI's: what a background source lowers after the first run
        worker = GraphThread("[DALI]counting") if self.graph_thread else _NoThread()
        return {"next": start, "graph": len(self.builds) - 1, "runs": 0, "worker": worker,
                "abort": threading.Event()}

    def _abort(self, graph):
        self.aborted.append(graph["graph"])
        graph["abort"].set()

    def produce(self, graph):
        self.threads.add(threading.get_ident())
        self.made += 1
        graph["runs"] += 1
        if self.slow is not None and graph["graph"] == 0 and graph["runs"] == self.slow[0]:
            if graph["abort"].wait(self.slow[1]):
                raise RuntimeError("aborted")  # as a DALI pipeline shut down under its run
            self.slow_end = os.sched_getscheduler(graph["worker"].tid)
        if self.fail_at is not None and self.made == self.fail_at:
            raise ValueError(f"run {self.made} failed")
        s = graph["next"]
        graph["next"] = s + K * B + self.gap
        x = torch.arange(s, s + K * B)
        return Run([(v,) for v in x.view(K, B).unbind(0)], B, K * B + self.gap, keys=("x",), data={"x": x})

    def release(self, graph):
        graph["next"] = None
        graph["worker"].stop()
        self.released[graph["graph"]] = threading.get_ident()

    def state(self, start, offset):
        return {"start": start, "offset": offset, "gap": self.gap}

    def load_state(self, state):
        if state["gap"] != self.gap:
            raise ConfigError(f"load_state_dict: saved gap={state['gap']} but this source has {self.gap}")
        return int(state["start"]), int(state["offset"])

    def info(self):
        return {"made": self.made}

    def close(self):
        self.closed = True


def kept(n_from: int, count: int, gap: int = 0) -> list:
    """The kept positions ``[n_from, n_from + count)`` of the kept stream (its n-th kept position
    is n + gap x (n // K B))."""
    return [n + gap * (n // (K * B)) for n in range(n_from, n_from + count)]


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    root = tmp_path_factory.mktemp("runner")
    return tiny_scene(root / "a", n=2, width=8, height=8, kinds=("png_rgb",)), \
        tiny_scene(root / "b", n=3, width=8, height=8, kinds=("png_rgb",))


def _take(src, n):
    return [next(src)["x"].tolist() for _ in range(n)]


@pytest.mark.parametrize("ahead", [True, False])
def test_runs_are_handed_out_in_order(scenes, ahead):
    p = Counting(scenes[0], ahead=ahead)
    with RunSource(p) as src:
        got = _take(src, 10)
        assert got == [list(range(B * i, B * (i + 1))) for i in range(10)]
        assert (threading.get_ident() in p.threads) != ahead  # the run-ahead thread, or next() itself
        st = src.stats()
        assert (st["steps"], st["runs"], st["made"]) == (10, 4, p.made) and st["warmup_s"] is not None
        assert st["rays_per_s"] > 0 and p.builds == [0]


def test_seeks_keep_the_run_or_the_graph_and_slice_off_the_step_grid(scenes):
    p = Counting(scenes[0])
    with RunSource(p) as src:
        _take(src, 2)  # run [0, 12) in hand, the next batch at 8
        src._seek(4)  # inside the run, on the grid
        assert _take(src, 1) == [[4, 5, 6, 7]] and p.builds == [0]
        src._seek(2)  # off the grid: a slice of the run
        assert _take(src, 2) == [[2, 3, 4, 5], [6, 7, 8, 9]] and p.builds == [0]
        assert _take(src, 1) == [[10, 11, 12, 13]]  # across two runs: a graph built where the batch starts
        assert p.builds == [0, 10]
        src._seek(22)  # where the live graph's next run starts: the graph is kept
        assert _take(src, 2) == [[22, 23, 24, 25], [26, 27, 28, 29]] and p.builds == [0, 10]
        src._seek(100)
        assert _take(src, 1) == [[100, 101, 102, 103]] and p.builds == [0, 10, 100]


@pytest.mark.parametrize("gap", [0, GAP])
def test_a_state_continues_exactly_in_a_new_source(scenes, gap):
    """Random steps, seeks (linear) and saves (seed printed); a state loaded into a new source gives
    the batches the saved one would have; a state of another scene or another gap is refused."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    with RunSource(Counting(scenes[0], gap=gap)) as src:
        n = 0  # kept positions handed out
        for _ in range(12):
            if gap == 0 and rng.random() < 0.3:
                n = rng.randrange(0, 60)
                src._seek(n)
            k = rng.randrange(0, 5)
            assert sum(_take(src, k), []) == kept(n, k * B, gap)
            n += k * B
            state = src.state_dict()
            with RunSource(Counting(scenes[0], gap=gap)) as again:
                again.load_state_dict(state)
                assert sum(_take(again, 3), []) == kept(n, 3 * B, gap), state
        with pytest.raises(ConfigError, match="saved from another scene"), RunSource(Counting(scenes[1], gap=gap)) as b:
            b.load_state_dict(state)
        with pytest.raises(ConfigError, match="saved gap"), RunSource(Counting(scenes[0], gap=gap + 1)) as b:
            b.load_state_dict(state)


def test_a_non_linear_producer_goes_on_where_each_run_ended(scenes):
    p = Counting(scenes[0], gap=GAP)
    with RunSource(p) as src:
        assert sum(_take(src, 2 * K), []) == kept(0, 2 * K * B, GAP)
        assert src.state_dict()["start"] == 2 * (K * B + GAP) and src.state_dict()["offset"] == 0
        assert p.builds == [0]


def test_a_failure_reaches_next_and_close_stops_everything(scenes):
    p = Counting(scenes[0], fail_at=2)
    src = RunSource(p)
    assert len(_take(src, K)) == K
    for _ in range(2):
        with pytest.raises(ValueError, match="run 2 failed"):
            next(src)
    thread = src._ahead._thread
    src.close()
    src.close()
    assert not thread.is_alive() and p.closed
    with pytest.raises(RuntimeError, match="Counting is closed"):
        next(src)


def test_a_starved_background_sampler_returns_to_normal_with_the_same_batches(scenes):
    p = Counting(scenes[0])
    src = RunSource(p, priority="background")
    try:
        assert _take(src, 2) == [list(range(0, 4)), list(range(4, 8))]
        assert src._ahead._guard is not None
        src._ahead.starved = True  # what the guard sets when the consumer keeps waiting
        with pytest.warns(SamplerStarvedWarning, match="counting: its background-priority sampler"):
            assert _take(src, 2) == [list(range(8, 12)), list(range(12, 16))]
        assert src.thread_priority == "normal" and p.builds == [0, 12] and src._ahead._guard is None
    finally:
        src.close()
    src = RunSource(Counting(scenes[0]), priority="background")
    src.starvation_guard = False  # the instance keeps its sampler in background
    try:
        _take(src, 1)
        assert src._ahead._guard is None
    finally:
        src.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="background priority is Linux's SCHED_IDLE")
@pytest.mark.parametrize("kernel", ["raises", "refuses"])
def test_a_sampler_starving_a_wait_in_progress_returns_to_normal_with_the_same_batches(scenes, kernel):
    """A background sampler whose run does not come (the first graph's third run takes 2.5 s: a
    sampler that gets no CPU) is caught while the consumer still waits, not when the run arrives.
    Where the kernel lets this thread raise the sampler's priority, it is raised in place: the late
    run ends at normal priority and is used, no new graph. Where it refuses (an unprivileged
    process: raise_refused), the graph is replaced at the same position at once, the late run is
    never used, and its thread frees the old graph itself when it ends. The batches are the same."""
    import contextlib

    if kernel == "raises" and not can_raise():
        pytest.skip("this process may not raise a thread's priority (no CAP_SYS_NICE, ulimit -e below 20)")
    p = Counting(scenes[0], slow=(3, 2.5))
    src = RunSource(p, priority="background")
    refuse = raise_refused() if kernel == "refuses" else contextlib.nullcontext()
    try:
        with refuse:
            got = _take(src, 2 * K)  # runs 1 and 2 (the guard's window starts after run 1)
            old = src._ahead._thread
            how = "were raised to normal priority" if kernel == "raises" else "are replaced by threads at normal"
            with pytest.warns(SamplerStarvedWarning, match=how):
                got += _take(src, 1)  # the third run
            late_run_ended = p.slow_end is not None
            got += _take(src, 2 * K - 1)
        assert got == [list(range(i, i + B)) for i in range(0, 4 * K * B, B)]
        assert src.thread_priority == "normal" and src._ahead._guard is None
        if kernel == "raises":
            assert late_run_ended and p.slow_end == os.SCHED_OTHER and p.builds == [0] and src._ahead._thread is old
        else:
            assert not late_run_ended, "the consumer waited for the starved run"
            assert p.builds == [0, 2 * K * B] and src._ahead._thread is not old
            old.join(timeout=30)
            assert not old.is_alive() and p.released.get(0) == old.ident  # freed by its own thread
    finally:
        src.close()


def test_a_starved_graph_without_threads_of_its_own_is_not_replaced(scenes):
    """A background source whose graph lowered no threads (nothing to raise back) that keeps its
    consumer waiting is starved by the sampling, not by its priority: it runs at normal priority from
    then on without a new graph (a new one would only make the consumer wait for a rebuild)."""
    p = Counting(scenes[0], slow=(3, 2.5), graph_thread=False)
    src = RunSource(p, priority="background")
    try:
        with raise_refused():
            with pytest.warns(SamplerStarvedWarning, match="were raised to normal priority"):
                got = _take(src, 3 * K)
        assert got == [list(range(i, i + B)) for i in range(0, 3 * K * B, B)]
        assert p.builds == [0] and src.thread_priority == "normal" and src._ahead._tids == []
    finally:
        src.close()


@pytest.mark.parametrize("abortable", [True, False])
def test_close_aborts_a_run_in_flight_or_leaves_it_to_end_and_free_its_graph(scenes, abortable):
    """A run in flight at close is nobody's: a producer that can abort it (a DALI pipeline shut
    down) has it aborted past ABORT_AFTER_S and close() returns with the thread ended and the graph
    freed; one that cannot is left to end on its own past close's timeout, freeing its graph itself."""
    from dali_nerf.sources import runahead

    p = Counting(scenes[0], slow=(2, 30.0), abortable=abortable)
    src = RunSource(p)
    _take(src, 1)  # run 1 in hand; run 2 (30 s) is released
    deadline = time.monotonic() + 30
    while p.made < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    thread = src._ahead._thread  # in run 2
    if abortable:
        src.close()
        assert not thread.is_alive() and p.aborted == [0] and p.released == {0: threading.get_ident()}
        assert thread not in runahead._LEFT
    else:
        with pytest.warns(ResourceWarning, match="did not stop within 0.5 s"):
            assert not src._ahead.close(timeout=0.5, release=lambda: p.release(src._graph))
        assert thread.is_alive() and thread in runahead._LEFT and p.released == {}
        src._graph["abort"].set()  # the run ends (here: as if aborted)
        thread.join(timeout=10)
        assert not thread.is_alive() and p.released == {0: thread.ident}  # freed by its own thread
        src._ahead = None
        src.close()


def test_exit_waits_for_a_left_run_and_its_release(tmp_path):
    """A process whose run-ahead thread was left with a run in flight waits for it at exit (saying
    so after 1 s) and its graph is freed: the process exits 0, not killed under the run."""
    import subprocess
    import sys

    code = f"""
import threading, time
from dali_nerf.sources.runner import RunAhead
def produce(pipe):
    if pipe["n"] == 1:
        time.sleep(2.0)
    pipe["n"] += 1
    return pipe["n"]
g = {{"n": 0}}
a = RunAhead(g, produce)
a.get(); a.release(); time.sleep(0.2)  # run 2 (2 s) in flight
assert not a.close(timeout=0.0, release=lambda: print("released", g["n"], flush=True))
print("closed", flush=True)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["closed", "released", "2"]
    assert "waiting up to 30 s for 1 sampler thread(s) to end their run in flight (dali_nerf-run-ahead)" in r.stderr


def test_a_source_is_collected_while_its_thread_lives_and_closes_it(scenes):
    """The run-ahead thread holds the producer, never the source: dropping the source closes it."""
    p = Counting(scenes[0])
    src = RunSource(p)
    _take(src, 1)
    thread, ref = src._ahead._thread, weakref.ref(src)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del src
        gc.collect()
    assert ref() is None
    deadline = time.time() + 10
    while thread.is_alive() and time.time() < deadline:
        time.sleep(0.01)
    assert not thread.is_alive() and p.closed
