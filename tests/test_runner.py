"""The runner (dali_nerf/sources/runner.py) with a toy producer: the machinery every batch kind gets
without a copy — runs handed out in order (from the run-ahead thread, or in next()), seeks that keep
the run or the graph, a batch off the step grid sliced from the run, the state (with the split's
fingerprint) continued exactly by a new source, a producer whose runs consume more positions than
they hold, a failure handed to next(), a starved background sampler returned to normal priority
with the same batches, close, and a source collected while its thread lives."""

from __future__ import annotations

import gc
import random
import threading
import time
import warnings
import weakref

import pytest
import torch

from _tiny_scene import tiny_scene
from dali_nerf.errors import ConfigError
from dali_nerf.sources.runner import Run, RunSource, SamplerStarvedWarning

B, K, GAP = 4, 3, 5


class Counting:
    """Step k of a run that starts at stream position s holds the positions the run keeps: a linear
    producer keeps [s, s + K B); with ``gap`` it consumes K B + gap positions (like routed rays,
    which skip the rays that miss the cell) and keeps the first K B of them."""

    kind, who, thread_name, steps_per_run, phase_rank = "Counting", "counting", "dali_nerf-counting", K, 0

    def __init__(self, scene, ahead=True, gap=0, fail_at=None):
        self.scene, self.ahead, self.gap, self.linear, self.fail_at = scene, ahead, gap, gap == 0, fail_at
        self.builds, self.threads, self.made = [], set(), 0

    def build(self, start):
        self.builds.append(start)
        return {"next": start}

    def produce(self, graph):
        self.threads.add(threading.get_ident())
        self.made += 1
        if self.fail_at is not None and self.made == self.fail_at:
            raise ValueError(f"run {self.made} failed")
        s = graph["next"]
        graph["next"] = s + K * B + self.gap
        x = torch.arange(s, s + K * B)
        return Run([(v,) for v in x.view(K, B).unbind(0)], B, K * B + self.gap, keys=("x",), data={"x": x})

    def release(self, graph):
        graph["next"] = None

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
