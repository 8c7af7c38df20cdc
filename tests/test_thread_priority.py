"""Priority of the threads that sample ahead (``pipeline.thread_priority``, dali_nerf/data/hostbudget.py):
``background`` runs a loader's DALI threads and the torch_workers processes at SCHED_IDLE and leaves
every other thread as it was (the hand-over thread too: it holds the GIL); the stream does not
depend on it."""

import dataclasses
import os
import threading

import pytest
import torch

from _tiny_scene import tiny_scene
from dali_nerf.config import load_config
from dali_nerf.errors import ConfigError
from dali_nerf.data.hostbudget import check_priority, dali_threads, host_budget, resolve_priority
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.data.plan import plan_from_config
from dali_nerf.sources import RayLoader, SpatialRayLoader, TorchWorkersSampler, build_source

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"),
                                reason="thread priorities are read through Linux's /proc and SCHED_IDLE: runs on Linux")


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    return tiny_scene(tmp_path_factory.mktemp("prio"), n=4, width=24, height=16, kinds=("png_rgba", "jpg"))


@pytest.fixture(scope="module")
def cache(scene):
    return decode_cache(scene, 0, 1)


def _policy(tid: int) -> int:
    return os.sched_getscheduler(tid)


def _hand_over_thread(prefix: str) -> threading.Thread:
    from dali_nerf.sources.runahead import _LEFT  # replaced ones may still be finishing a run

    (t,) = [t for t in threading.enumerate() if t.name.startswith(prefix) and t not in _LEFT]
    return t


def _take(loader, n):
    return [{k: v.clone() for k, v in next(loader).items()} for _ in range(n)]


def test_background_lowers_only_the_loaders_own_threads(scene, cache):
    """Another loader's DALI threads and the training thread keep their priority; the background
    loader's DALI threads (those of its pipeline, all of them after its first run) and its
    hand-over thread run at SCHED_IDLE; both deliver the same stream."""
    main = threading.get_native_id()
    assert _policy(main) == os.SCHED_OTHER
    with RayLoader(scene, rays_per_batch=64, rays_per_run=256, cache=cache, prefetch=2, num_threads=2) as normal:
        a = _take(normal, 6)
        normal_tids = dali_threads()
        assert normal_tids, "a CPU RayLoader runs DALI threads"
        assert all(_policy(t) == os.SCHED_OTHER for t in normal_tids)
        with RayLoader(scene, rays_per_batch=64, rays_per_run=256, cache=cache, prefetch=2, num_threads=2,
                       thread_priority="background") as bg:
            b = _take(bg, 6)
            mine = dali_threads() - normal_tids
            assert len(mine) >= 2  # its thread pool and executor at least
            assert {_policy(t) for t in mine} == {os.SCHED_IDLE}
            # the hand-over threads run Python (they hold the GIL): never lowered (runner._run_ahead_loop)
            hand_over = {_policy(t.native_id) for t in threading.enumerate() if t.name.startswith("dali_nerf-rays")}
            assert hand_over == {os.SCHED_OTHER}
            assert all(_policy(t) == os.SCHED_OTHER for t in normal_tids & dali_threads())
        assert _policy(main) == os.SCHED_OTHER
    for x, y in zip(a, b):
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_spatial_loader_background(tmp_path):
    from dali_nerf.config import PartitionConfig
    from dali_nerf.partition import Partition
    from dali_nerf.scenegen import make_scene
    from dali_nerf.scenes import load_scene

    root = make_scene("city", tmp_path / "city", width=24, height=16, n_train=4, n_val=1)
    sc = load_scene(root, "train", format="mega_nerf")
    part = Partition.from_config(PartitionConfig(grid=[2, 1]), sc)
    c = decode_cache(sc, 0, 1)
    before = dali_threads()
    with SpatialRayLoader(sc, part, 0, rays_per_batch=32, rays_per_run=128, cache=c,
                          thread_priority="background") as L:
        next(L)
        mine = dali_threads() - before
        assert mine and {_policy(t) for t in mine} == {os.SCHED_IDLE}
        assert _policy(_hand_over_thread("dali_nerf-cell0").native_id) == os.SCHED_OTHER


def test_torch_workers_processes_in_background(scene, cache):
    for prio, want in (("normal", os.SCHED_OTHER), ("background", os.SCHED_IDLE)):
        with TorchWorkersSampler(scene, rays_per_batch=64, cache=cache, workers=1, thread_priority=prio) as s:
            next(s)
            pids = [w.pid for w in s._it._workers]
            assert pids and {_policy(p) for p in pids} == {want}, prio


def test_auto_follows_the_device_and_bad_values_name_the_key(scene):
    assert resolve_priority("auto", "cpu") == "normal"
    assert resolve_priority("auto", "cuda") == resolve_priority("auto", "emulated") == "background"
    assert resolve_priority("normal", "cuda") == "normal"
    # the budget leaves the priority to the plan, which resolves auto for train.device
    assert host_budget(4096, local_ranks=2, cores=2).priority == "normal"
    emulated = load_config(None, ["train.device=emulated", "pipeline.num_threads=0"], check_paths=False)
    assert plan_from_config(emulated, 0, 2, local_ranks=2, cores=2).priority == "background"
    with pytest.raises(ConfigError, match="thread_priority='idle'") as e:
        check_priority("idle")
    assert "normal, background" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="thread_priority"):
        RayLoader(scene, rays_per_batch=64, thread_priority="auto")  # the library takes a resolved value
    with pytest.raises(ConfigError, match="pipeline.thread_priority"):
        load_config(None, ["pipeline.thread_priority=low"], check_paths=False)


def test_config_builds_sources_at_the_resolved_priority(scene):
    cfg = load_config(None, ["pipeline.rays_per_batch=64", "pipeline.rays_per_run=256", "train.device=cpu"],
                      check_paths=False)
    assert cfg.pipeline.thread_priority == "auto"
    with build_source(cfg, scene, 0, 1) as src:
        assert src.thread_priority == "normal"  # compute on this CPU: the sampler competes as an equal
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, thread_priority="background"))
    with build_source(cfg, scene, 0, 1) as src:
        assert src.thread_priority == "background"
        next(src)
        assert {_policy(t) for t in src._ahead._tids} == {os.SCHED_IDLE} and src._ahead._tids


def _burn(stop):
    while not stop.is_set():
        pass


@pytest.mark.parametrize("kernel", ["raises", "refuses"])
def test_starved_background_loader_returns_to_normal_priority(scene, cache, kernel):
    """With every core busy at normal priority (more busy-looping processes than cores), a
    background loader's SCHED_IDLE threads get almost no CPU and next() waits: the loader warns
    once and runs at normal priority — its threads raised in place where the kernel lets this
    thread raise them, else (an unprivileged process: raise_refused) a pipeline rebuilt at once at
    the same position, while the starved one finishes its run when the cores free up and is freed
    by its own thread. The stream does not change."""
    import contextlib
    import multiprocessing as mp
    import time
    import warnings

    from _priority import can_raise, raise_refused
    from dali_nerf.data.hostbudget import usable_cores
    from dali_nerf.sources.runahead import _LEFT, SamplerStarvedWarning

    if kernel == "raises" and not can_raise():
        pytest.skip("this process may not raise a thread's priority (no CAP_SYS_NICE, ulimit -e below 20)")
    kw = dict(rays_per_batch=64, rays_per_run=256, cache=cache, prefetch=2, num_threads=1)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    burners = [ctx.Process(target=_burn, args=(stop,), daemon=True) for _ in range(usable_cores() + 1)]
    got, left = [], set(_LEFT)
    refuse = raise_refused() if kernel == "refuses" else contextlib.nullcontext()
    try:
        for p in burners:
            p.start()
        with warnings.catch_warnings(record=True) as caught, refuse:
            warnings.simplefilter("always")
            before = dali_threads()
            with RayLoader(scene, thread_priority="background", **kw) as L:
                first = None
                deadline = time.monotonic() + 120
                while L.thread_priority == "background" and time.monotonic() < deadline:
                    got += _take(L, 1)
                    if first is None:  # the background graph (its threads are lowered by its first run)
                        first, lowered = L._ahead._thread, list(L._ahead._tids)
                    time.sleep(0.001)  # the device step
                assert L.thread_priority == "normal", "a starved background loader must return to normal priority"
                got += _take(L, 8)  # the pipeline continues the stream
                assert L._ahead is not None and L._ahead._guard is None and lowered
                assert (L._ahead._thread is first) == (kernel == "raises")
                # raised in place, or the replacing graph's own threads
                now = lowered if kernel == "raises" else dali_threads() - before - set(lowered)
                assert now and {_policy(t) for t in now} == {os.SCHED_OTHER}
                replaced = set(_LEFT) - left
    finally:
        stop.set()
        for p in burners:
            p.join(timeout=10)
    for t in replaced:  # the starved thread finishes its run once the cores are free
        t.join(timeout=60)
        assert not t.is_alive()
    assert len(replaced) == (kernel == "refuses")
    warned = [w for w in caught if issubclass(w.category, SamplerStarvedWarning)]
    assert len(warned) == 1 and "RayLoader rank 0" in str(warned[0].message)
    with RayLoader(scene, **kw) as ref:
        want = _take(ref, len(got))
    for x, y in zip(got, want):
        assert all(torch.equal(x[k], y[k]) for k in x)


def _run_ready(loader, timeout: float = 120.0) -> None:
    """The controlled consumer's device step: until the loader's next ``next()`` would find its
    next run finished (a consumer slow enough for its sampler, whatever the host's load)."""
    import time

    end = time.monotonic() + timeout
    run = loader._run  # the runner's run in hand (sources/runner.py): the next next() crosses into a new one?
    crossing = run is None or loader._offset + run.stride > run.length
    while crossing and loader._ahead._q.empty() and time.monotonic() < end:
        time.sleep(0.002)


def test_a_loader_that_keeps_up_stays_in_background(scene, cache):
    """A consumer that never waits for its sampler (here: a controlled consumer whose step lasts
    until the next run is ready, so the test does not depend on the host's load; the real timing
    is benchmarks/thread_priority.py's) never trips the starvation guard: over more than two of
    its 1 s windows the loader stays in background, its graph's threads at SCHED_IDLE."""
    import time

    with RayLoader(scene, rays_per_batch=64, rays_per_run=256, cache=cache, prefetch=2, num_threads=1,
                   thread_priority="background") as L:
        next(L)  # the first wait (the build and first run) is never counted
        t_end, runs = time.monotonic() + 2.5, 0
        while time.monotonic() < t_end or runs < 4:
            _run_ready(L)
            before = L._stats.runs
            next(L)
            runs += L._stats.runs - before
        assert L.thread_priority == "background" and not L._ahead.starved
        assert L._ahead._tids and {_policy(t) for t in L._ahead._tids} == {os.SCHED_IDLE}


def test_spatial_loader_demotes_at_a_run_boundary(tmp_path):
    """SpatialRayLoader acts on its RunAhead's starved report (set here as the guard would) at its
    next run: normal priority, a rebuilt pipeline, the same accepted rays."""
    import warnings

    from dali_nerf.config import PartitionConfig
    from dali_nerf.partition import Partition
    from dali_nerf.scenegen import make_scene
    from dali_nerf.scenes import load_scene
    from dali_nerf.sources.runner import SamplerStarvedWarning

    root = make_scene("city", tmp_path / "city", width=24, height=16, n_train=4, n_val=1)
    sc = load_scene(root, "train", format="mega_nerf")
    part = Partition.from_config(PartitionConfig(grid=[2, 1]), sc)
    c = decode_cache(sc, 0, 1)
    kw = dict(rays_per_batch=32, rays_per_run=128, cache=c)
    with SpatialRayLoader(sc, part, 0, **kw) as ref:
        want = _take(ref, 12)
    before = dali_threads()
    with SpatialRayLoader(sc, part, 0, thread_priority="background", **kw) as L:
        got = _take(L, 2)
        old = set(L._ahead._tids)
        L._ahead.starved = True
        with pytest.warns(SamplerStarvedWarning, match="SpatialRayLoader cell 0"):
            got += _take(L, 10)  # crosses a run boundary (4 steps a run)
        assert L.thread_priority == "normal" and L._ahead._guard is None
        new = dali_threads() - before - old  # the rebuilt pipeline's
        assert old and new and {_policy(t) for t in new} == {os.SCHED_OTHER}
    for x, y in zip(got, want):
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_starvation_guard_windows():
    """The guard skips the first wait (build, first run), closes a window only at a wait at least
    window_s after its start, and fires when the waits filled more than max_stall of it."""
    from dali_nerf.sources.runner import StarvationGuard

    g = StarvationGuard(max_stall=0.2, window_s=1.0)
    assert not g.add(0.0, 5.0)               # the build: never counted
    assert not g.add(5.1, 5.5)               # 0.4 s waited, but the window is 0.5 s old
    assert g.add(5.9, 6.1)                   # 0.6 s of 1.1 s
    assert not g.add(6.2, 6.3) and not g.add(8.0, 8.2)  # a new window: 0.3 s of 2.1 s
    g = StarvationGuard(max_stall=0.2, window_s=1.0)
    g.add(0.0, 0.1)
    assert not g.add(30.0, 30.5)             # a long pause without waiting: 0.5 s of 30.4 s


def test_first_run_is_made_at_normal_priority_then_background():
    """A background source's graph threads make its first run at normal priority (the consumer
    waits for it, and the starvation guard does not count that wait: at SCHED_IDLE on busy cores it
    went unnoticed for minutes), its later runs at SCHED_IDLE; the hand-over thread, which runs
    Python and holds the GIL, is never lowered (a SCHED_IDLE thread preempted while holding the
    GIL stops the training thread too)."""
    from _priority import GraphThread
    from dali_nerf.sources.runner import RunAhead

    seen = []
    before = dali_threads()
    worker = GraphThread("[DALI]prio-test")  # the graph's thread, started by its build

    def produce(pipe):
        seen.append((_policy(worker.tid), _policy(threading.get_native_id())))
        return len(seen)

    ahead = RunAhead(None, produce, depth=1, name="dali_nerf-prio-test", background=before)
    try:
        got = []
        for _ in range(3):
            got.append(ahead.get())
            ahead.release()
    finally:
        assert ahead.close()
        worker.stop()
    assert got == [1, 2, 3] and ahead._tids == [worker.tid]
    assert seen[0] == (os.SCHED_OTHER, os.SCHED_OTHER) and set(seen[1:]) == {(os.SCHED_IDLE, os.SCHED_OTHER)}, seen


def test_close_aborts_a_ray_run_in_flight(scene, cache, monkeypatch):
    """Closing a RayLoader whose next run is in flight shuts its DALI pipeline down under that run
    (on busy cores a SCHED_IDLE run could take minutes, and nobody will use it): close returns with
    the hand-over thread ended, no run left behind, and DALI builds and runs the next loader as usual."""
    import warnings

    from dali_nerf.sources import runahead

    from dali_nerf.sources.rays import RayProducer

    monkeypatch.setattr(runahead, "ABORT_AFTER_S", 0.0)  # abort any run still in flight at close
    cut, produce = [], RayProducer.produce

    def recorded(self, pipe):
        try:
            return produce(self, pipe)
        except Exception as e:  # the run the shutdown cut
            cut.append(e)
            raise

    monkeypatch.setattr(RayProducer, "produce", recorded)
    kw = dict(rays_per_batch=4096, rays_per_run=4096 * 256, cache=cache, prefetch=2, num_threads=1)
    aborted = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        for _ in range(3):
            L = RayLoader(scene, **kw)
            next(L)  # run 1 in hand; run 2 (1 M rays) released at its first step
            thread, ex = L._ahead._thread, L._ahead._exit
            L.close()
            assert not thread.is_alive() and thread not in runahead._LEFT
            aborted += ex.aborted
    assert aborted >= 1 and len(cut) >= 1, (aborted, cut)
    with RayLoader(scene, **kw) as a, RayLoader(scene, **dict(kw, prefetch=0)) as b:
        for _ in range(3):
            x, y = next(a), next(b)
            assert all(torch.equal(x[k], y[k]) for k in x)
