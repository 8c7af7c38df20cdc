"""RayLoader: batch contract, determinism, resume, prefetch/rays_per_run invariance, stats, shutdown."""

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from _tiny_scene import assert_batch_contract, ref_rays as _ref_rays, tiny_scene
from dali_nerf.errors import ConfigError
from dali_nerf.sources import RayLoader
from dali_nerf.data.imagecache import decode_cache


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    return tiny_scene(tmp_path_factory.mktemp("ld"), n=4, width=24, height=16, kinds=("png_rgba", "jpg"))


@pytest.fixture(scope="module")
def cache(scene):
    return decode_cache(scene, 0, 1)


def _take(loader, n):
    return [{k: v.clone() for k, v in next(loader).items()} for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_batch_contract(scene, cache, mode):
    B = 200
    with RayLoader(scene, rays_per_batch=B, rays_per_run=700, cache=cache, mode=mode, prefetch=2) as L:
        assert L.steps_per_run == 4 and L.rays_per_run == 800
        for _ in range(6):
            b = next(L)
            assert_batch_contract(b, B)
            torch.testing.assert_close(torch.linalg.norm(b["directions"], dim=-1), torch.ones(B), atol=1e-5, rtol=0)
            cam, row, col = b["indices"].T.numpy()
            assert np.all(row < scene.height[cam]) and np.all(col < scene.width[cam])
            pid = cache.layout[cam, 0] + row * cache.layout[cam, 1] + col
            np.testing.assert_array_equal(b["rgb"].numpy(), cache.pixels[pid].astype(np.float32) / 255.0)
            o, d = _ref_rays(scene, b["indices"])
            np.testing.assert_allclose(b["origins"].numpy(), o, atol=1e-5)
            np.testing.assert_allclose(b["directions"].numpy(), d, atol=1e-5)
            np.testing.assert_array_equal(b["near"].numpy()[:, 0], scene.near[cam])
            np.testing.assert_array_equal(b["far"].numpy()[:, 0], scene.far[cam])


def test_no_bounds_no_near_far(tmp_path):
    sc = tiny_scene(tmp_path, n=2, kinds=("png_rgb",), bounds=False)
    with RayLoader(sc, rays_per_batch=64, rays_per_run=128) as L:
        assert set(next(L)) == {"origins", "directions", "rgb", "indices"}


def test_determinism_and_keys(scene, cache):
    a = _take(RayLoader(scene, rays_per_batch=128, rays_per_run=512, cache=cache, seed=3), 5)
    b = _take(RayLoader(scene, rays_per_batch=128, rays_per_run=512, cache=cache, seed=3), 5)
    c = _take(RayLoader(scene, rays_per_batch=128, rays_per_run=512, cache=cache, seed=4), 5)
    assert _same(a, b)
    assert not torch.equal(a[0]["indices"], c[0]["indices"])
    # consecutive steps differ (stream advances)
    assert not torch.equal(a[0]["indices"], a[1]["indices"])


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_prefetch_and_rays_per_run_do_not_change_stream(scene, cache, mode):
    ref = _take(RayLoader(scene, rays_per_batch=96, rays_per_run=96, cache=cache, prefetch=0, mode=mode), 12)
    for prefetch, rpr in ((2, 96), (2, 500), (0, 1000), (3, 96 * 12)):
        got = _take(RayLoader(scene, rays_per_batch=96, rays_per_run=rpr, cache=cache, prefetch=prefetch, mode=mode), 12)
        assert _same(ref, got), (prefetch, rpr)


def test_paced_hand_over_keeps_the_stream(scene, monkeypatch):
    """Co-located ranks release their run-ahead thread at different steps of a run (run_phase);
    the batches do not depend on it, nor on a seek that lands after the release point."""
    from dali_nerf.sources.runner import run_phase

    shard = decode_cache(scene, 3, 4)
    kw = dict(rays_per_batch=96, cache=shard, rank=3, world_size=4)
    ref = _take(RayLoader(scene, rays_per_run=96, prefetch=0, **kw), 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert run_phase(3, 8) == 5
    paced = RayLoader(scene, rays_per_run=96 * 8, prefetch=2, **kw)
    assert _same(ref, _take(paced, 30))
    assert paced._phase == 5
    seeked = RayLoader(scene, rays_per_run=96 * 8, prefetch=2, **kw)
    _take(seeked, 3)
    state = seeked.state_dict()
    state["position"] = 96 * 7  # past this rank's release step of run 0
    seeked.load_state_dict(state)
    assert _same(ref[7:20], _take(seeked, 13))


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_resume_exactly(scene, cache, mode):
    full = RayLoader(scene, rays_per_batch=100, rays_per_run=300, cache=cache, seed=1, mode=mode)
    ref = _take(full, 9)
    part = RayLoader(scene, rays_per_batch=100, rays_per_run=300, cache=cache, seed=1, mode=mode)
    _take(part, 4)  # stops in the middle of run 1
    state = part.state_dict()
    assert state["position"] == 400 and {"position", "epoch"} <= set(state)
    part.close()
    resumed = RayLoader(scene, rays_per_batch=100, rays_per_run=700, cache=cache, seed=1, mode=mode)
    resumed.load_state_dict(state)
    assert _same(ref[4:], _take(resumed, 5))
    with pytest.raises(ConfigError, match="seed"):
        RayLoader(scene, rays_per_batch=100, cache=cache, seed=2, mode=mode).load_state_dict(state)


def test_seek_off_the_step_grid_and_mutated_batches(scene, cache):
    """A resume inside the current run at a position that is not a multiple of B (the slicing
    fallback of __next__) gives the same rays as a loader whose runs start there; batches are
    fresh dicts, so a caller mutating one does not change later or repeated steps."""
    B = 64
    ref = _take(RayLoader(scene, rays_per_batch=B, rays_per_run=B, cache=cache, seed=5, prefetch=0), 8)
    stream = {k: torch.cat([b[k] for b in ref]) for k in ref[0]}
    L = RayLoader(scene, rays_per_batch=B, rays_per_run=8 * B, cache=cache, seed=5)
    first = next(L)
    first.pop("rgb")  # caller mutation of a handed-out dict
    state = dict(L.state_dict(), position=B + 37)  # inside run 0, off the grid
    L.load_state_dict(state)
    got = _take(L, 3)
    for i, b in enumerate(got):
        lo = B + 37 + i * B
        assert set(b) == set(ref[0])
        for k in b:
            assert torch.equal(b[k], stream[k][lo:lo + B]), (i, k)
    L.load_state_dict(dict(state, position=0))  # back onto the grid of the same run
    assert _same([next(L)], ref[:1])


def test_epoch_mode_permutations_and_set_epoch(scene, cache):
    P = cache.num_pixels
    B = 500
    L = RayLoader(scene, rays_per_batch=B, rays_per_run=1500, cache=cache, mode="epoch")
    assert len(L) == -(-P // B)
    orders = []
    for e in range(2):
        L.set_epoch(e)
        idx = torch.cat([next(L)["indices"] for _ in range(len(L))])[:P]
        cam, row, col = idx.T.numpy()
        pid = cache.layout[cam, 0] + row * cache.layout[cam, 1] + col
        assert np.array_equal(np.sort(pid), np.arange(P))  # every pixel exactly once
        orders.append(pid)
    assert not np.array_equal(orders[0], orders[1])
    with pytest.raises(TypeError):
        len(RayLoader(scene, rays_per_batch=B, cache=cache))


def test_stats_and_amortisation(scene, cache):
    L = RayLoader(scene, rays_per_batch=64, rays_per_run=640, cache=cache)
    assert L.steps_per_run == 10
    _take(L, 25)
    s = L.stats()
    assert {"steps", "wait_s", "stall_fraction", "rays_per_s", "elapsed_s", "runs"} <= set(s)
    assert s["steps"] == 25 and s["runs"] == 3
    # BatchStats' definitions, from one as_dict(): stall = wait / elapsed, rays/s = rays / elapsed
    assert 0 < s["wait_s"] <= s["elapsed_s"]
    assert s["stall_fraction"] == pytest.approx(s["wait_s"] / s["elapsed_s"], rel=1e-12)
    assert s["rays_per_s"] == pytest.approx(25 * 64 / s["elapsed_s"], rel=1e-12)
    # warm-up = the first next()'s wait; steady = the stall after the first batch (BatchStats)
    assert 0 < s["warmup_s"] <= s["wait_s"]
    assert s["stall_fraction_steady"] == pytest.approx((s["wait_s"] - s["warmup_s"]) / (s["elapsed_s"] - s["warmup_s"]), rel=1e-3)


def test_cache_on_another_device_is_refused_naming_the_fix(scene, cache):
    """A cache decoded for another device than the loader's is a one-line ConfigError (a host
    cache fed to a GPU graph would fail or be copied to the device every run)."""
    on_gpu = dataclasses.replace(cache, device="cuda")  # what decode_cache(device="cuda") labels its cache
    with pytest.raises(ConfigError, match=r"cache: decoded on cuda but RayLoader runs on cpu; decode it with "
                                          r"decode_cache\(\.\.\., device='cpu'\)"):
        RayLoader(scene, rays_per_batch=64, cache=on_gpu)


def test_batches_stay_valid_after_later_runs(scene, cache):
    """Zero-copy step views must not be overwritten by later DALI runs."""
    L = RayLoader(scene, rays_per_batch=64, rays_per_run=128, cache=cache, prefetch=2)
    held = [next(L) for _ in range(4)]
    copies = [{k: v.clone() for k, v in b.items()} for b in held]
    _take(L, 30)
    assert _same(held, copies)


def test_close_leaves_no_threads(scene, cache):
    before = set(threading.enumerate())
    L = RayLoader(scene, rays_per_batch=64, rays_per_run=256, cache=cache, prefetch=2)
    _take(L, 5)
    L.close()
    L.close()
    assert set(threading.enumerate()) <= before
    with pytest.raises(RuntimeError, match="closed"):
        next(L)


def test_bad_arguments_one_line(scene, cache):
    for kw, key in ((dict(rays_per_batch=0), "rays_per_batch"), (dict(rank=2, world_size=2), "rank"),
                    (dict(mode="shuffle"), "mode"), (dict(prefetch=-1), "prefetch"),
                    (dict(output_map=("rgb", "depth")), "output_map")):
        with pytest.raises(ConfigError, match=key) as e:
            RayLoader(scene, **{"cache": cache, **kw})
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["rays", "sync_local", "sync_global", "torch_workers", "ready"])
def test_build_source_from_config(scene, name):
    from dali_nerf.config import load_config
    from dali_nerf.sources import build_source

    cfg = load_config(None, [f"pipeline.name={name}", "pipeline.rays_per_batch=128", "pipeline.workers=0",
                             "train.device=cpu"], check_paths=False)
    src = build_source(cfg, scene, 0, 1)
    try:
        b = next(src)
        assert b["rgb"].shape == (128, 3) and b["indices"].dtype == torch.int64
        assert {"steps", "wait_s", "stall_fraction", "rays_per_s", "elapsed_s"} <= set(src.stats())
        if name == "ready":  # the floor: sync_local's first batch, again and again
            again = next(src)
            assert again is not b and all(torch.equal(again[k], b[k]) for k in b)
            cfg.pipeline.name = "sync_local"
            with build_source(cfg, scene, 0, 1) as first:
                f = next(first)
                assert all(torch.equal(f[k], b[k]) for k in b), {k: torch.equal(f[k], b[k]) for k in b}
    finally:
        src.close()


def test_defaults_follow_the_host_budget(scene, cache, monkeypatch):
    """RayLoader's num_threads / rays_per_run default to this host's budget per local rank
    (hostbudget.host_budget); explicit values win; the stream does not depend on them."""
    from dali_nerf.data.hostbudget import host_budget
    from dali_nerf.data.plan import SamplingPlan

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # many co-located ranks: 1 thread, 65536 rays per run
    b = host_budget(64)
    auto_plan = SamplingPlan.for_loader(64)
    assert (auto_plan.threads, auto_plan.rays_per_run) == (b.threads, b.rays_per_run) == (1, 65536)
    fixed_plan = SamplingPlan.for_loader(64, num_threads=3, rays_per_run=1000)
    assert (fixed_plan.threads, fixed_plan.rays_per_run, fixed_plan.steps_per_run, fixed_plan.budget) == (3, 1024, 16, None)
    with RayLoader(scene, rays_per_batch=64, cache=cache) as auto, \
            RayLoader(scene, rays_per_batch=64, cache=cache, num_threads=2, rays_per_run=256) as fixed:
        assert (auto.num_threads, auto.rays_per_run) == (1, 65536)
        assert (fixed.num_threads, fixed.rays_per_run) == (2, 256)
        for a, f in zip(_take(auto, 6), _take(fixed, 6)):
            assert torch.equal(a["indices"], f["indices"]) and torch.equal(a["origins"], f["origins"])
    with pytest.raises(ConfigError, match="num_threads"):
        RayLoader(scene, rays_per_batch=64, cache=cache, num_threads=-1)


# ---- RunAhead: the background hand-over of a graph's runs ------------------------------------

def test_run_ahead_order_errors_and_close():
    """Runs come back in order from another thread; a failure reaches every later get(); close()
    ends a producer blocked on the full queue."""
    from dali_nerf.sources.runner import RunAhead

    callers, counter = [], iter(range(1000))

    def produce(pipe):
        callers.append(threading.get_ident())
        k = next(counter)
        if pipe == "fail" and k == 3:
            raise ValueError("run 3 failed")
        return k

    ra = RunAhead("ok", produce, depth=2)
    assert [ra.get() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert threading.get_ident() not in callers
    ra.close()  # the producer waits for a release (or a put): close must still end it
    assert not ra._thread.is_alive()
    ra.close()

    counter = iter(range(1000))
    ra = RunAhead("fail", produce)
    assert [ra.get() for _ in range(3)] == [0, 1, 2]
    for _ in range(2):
        with pytest.raises(ValueError, match="run 3 failed"):
            ra.get()
    ra.close()


def test_run_ahead_paced_produces_when_released():
    """After the first run the thread produces only on release() or when get() finds the queue
    empty (not as soon as the queue has room)."""
    from dali_nerf.sources.runner import RunAhead

    def settle(ra, n):
        deadline = time.time() + 5
        while len(ra.made) < n and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(0.1)  # and no more than n
        return len(ra.made)

    made = []
    ra = RunAhead("p", lambda pipe: made.append(len(made)) or len(made), depth=1)
    ra.made = made
    assert settle(ra, 1) == 1  # the first run only (the queue has room for no more, nor is it asked)
    assert ra.get() == 1 and settle(ra, 1) == 1  # taking it does not start the next
    ra.release()
    assert settle(ra, 2) == 2 and ra.get() == 2
    assert ra.get() == 3  # an empty queue: get() releases it itself instead of waiting forever
    ra.close()
    assert not ra._thread.is_alive()


def test_run_ahead_frees_retired_runs_on_its_thread():
    """A run handed back with retire() is freed by the RunAhead thread, not the caller's."""
    import weakref

    from dali_nerf.sources.runner import RunAhead

    class Run:
        pass

    freed_on = []
    ra = RunAhead("p", lambda pipe: Run(), depth=1)
    run = ra.get()
    weakref.finalize(run, lambda: freed_on.append(threading.get_ident()))
    ra.retire(run)
    del run
    assert freed_on == []  # the thread still holds it
    ra.get()
    ra.release()  # the thread's next run: before it, it drops what was retired
    deadline = time.time() + 5
    while not freed_on and time.time() < deadline:
        time.sleep(0.01)
    assert freed_on and freed_on[0] != threading.get_ident()
    ra.close()


def test_loader_dropped_without_close_ends_its_thread(scene, cache):
    """The hand-over thread holds no reference to its loader: dropping the loader closes it."""
    import gc

    before = set(threading.enumerate())
    L = RayLoader(scene, rays_per_batch=64, rays_per_run=256, cache=cache, prefetch=2)
    _take(L, 5)
    assert len(set(threading.enumerate()) - before) >= 1
    del L
    gc.collect()
    assert set(threading.enumerate()) <= before


def test_source_from_config_is_the_registry_door(tmp_path):
    """The public config door: a YAML file (plus overrides) to the source a rank gets, the same
    stream as the drop-in RayLoader built by hand with the same settings; SS gives one source per
    cell of the rank; a Config object with overrides is refused in one line."""
    import dali_nerf
    from dali_nerf.config import load_config
    from dali_nerf.errors import ConfigError
    from dali_nerf.scenegen import make_scene

    scene_dir = make_scene("objects", tmp_path / "s", width=24, height=24, n_train=4, n_val=1, n_test=1)
    yaml = tmp_path / "c.yaml"
    yaml.write_text(f"name: x\nmethod: ddp\nscene: {{path: {scene_dir}}}\ntrain: {{device: cpu}}\n")
    over = ["pipeline.rays_per_batch=64", "pipeline.rays_per_run=256", "pipeline.num_threads=1"]
    src = dali_nerf.source_from_config(yaml, rank=1, world_size=2, overrides=over)
    try:
        assert isinstance(src, dali_nerf.RayLoader) and (src.rank, src.world_size, src.rays_per_batch) == (1, 2, 64)
        scene = dali_nerf.load_scene(scene_dir, split="train")
        # the config's pipeline.stream defaults to global (the trainers'), the drop-in RayLoader's to shard
        assert src.stream == "global" and src.global_batch == 128
        with dali_nerf.RayLoader(scene, rays_per_batch=64, rank=1, world_size=2, num_threads=1,
                                 rays_per_run=256, stream="global") as hand:
            for _ in range(5):
                a, b = next(src), next(hand)
                assert torch.equal(a["indices"], b["indices"]) and torch.equal(a["origins"], b["origins"])
                assert torch.equal(a["positions"], b["positions"])
    finally:
        src.close()
    city = make_scene("city", tmp_path / "city", width=32, height=24, n_train=6, n_val=1)
    ss = tmp_path / "ss.yaml"
    ss.write_text(f"name: y\nmethod: ss\nscene: {{path: {city}}}\npartition: {{kind: grid, grid: [2, 2]}}\n"
                  f"train: {{device: cpu}}\npipeline: {{rays_per_batch: 32, rays_per_run: 128, num_threads: 1}}\n")
    cells = dali_nerf.source_from_config(ss, rank=0, world_size=2)
    try:
        assert [type(c).__name__ for c in cells] == ["SpatialRayLoader"] * 2 and [c.cell for c in cells] == [0, 2]
        assert next(cells[1])["origins"].shape == (32, 3)
    finally:
        for c in cells:
            c.close()
    with pytest.raises(ConfigError, match="overrides apply to a YAML file"):
        dali_nerf.source_from_config(load_config(yaml), overrides=over)
