"""SpatialRayLoader: rays of its cell, a stream that prefetch and run size do not change, batches
that stay valid after later runs, exact resume, and the op's ``start = -1`` continuation that
lets DALI run a routed pipeline ahead."""

import dataclasses

import numpy as np
import pytest
import torch

from _tiny_scene import assert_batch_contract
from dali_nerf.config import PartitionConfig
from dali_nerf.errors import ConfigError
from dali_nerf.partition import Partition, ray_cells
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.pipelines.rays import RayGraph, ray_pipeline
from dali_nerf.sources import SpatialRayLoader


def spatial_pipeline(cache, part, cell, rays_per_run, mode, seed, **kw):
    """The ray graph routed to ``cell`` with the SS stream key (seed, rank=cell, world_size=C)."""
    return ray_pipeline(cache, RayGraph(rays_per_run, mode, seed, stream=cell, num_streams=part.num_cells, partition=part,
                                        cell=cell, **kw))
from dali_nerf.scenegen import make_scene
from dali_nerf.scenes import load_scene

B = 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = make_scene("city", tmp_path_factory.mktemp("ss") / "city", width=24, height=16, n_train=8, n_val=1)
    scene = load_scene(root, "train", format="mega_nerf")
    part = Partition.from_config(PartitionConfig(grid=[2, 2]), scene)
    return scene, part, decode_cache(scene, 0, 1)


def _take(loader, n, clone=True):
    return [{k: v.clone() for k, v in next(loader).items()} if clone else next(loader) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_cache_on_another_device_is_refused(setup):
    scene, part, cache = setup
    with pytest.raises(ConfigError, match="cache: decoded on cuda but SpatialRayLoader runs on cpu"):
        SpatialRayLoader(scene, part, 0, rays_per_batch=64, cache=dataclasses.replace(cache, device="cuda"))


def test_batches_are_rays_of_the_cell(setup):
    scene, part, cache = setup
    with SpatialRayLoader(scene, part, 1, rays_per_batch=B, rays_per_run=4 * B, cache=cache) as L:
        batches = _take(L, 10)
        acc = L.stats()["acceptance"]
    for b in batches:
        assert_batch_contract(b, B)
        cells = ray_cells(part, b["origins"].numpy(), b["directions"].numpy(), b["near"].numpy(), b["far"].numpy())
        assert cells[:, 1].all()
    assert 0.0 < acc < 1.0  # the cell does not take every candidate: routing is at work


@pytest.mark.parametrize("prefetch,rays_per_run", [(2, 4 * B), (2, 16 * B), (3, B), (1, 4 * B)])
def test_prefetch_and_run_size_do_not_change_the_stream(setup, prefetch, rays_per_run):
    """Async runs (DALI computing runs ahead, each continuing the previous one inside the op)
    against the synchronous pipeline fed one run at a time."""
    scene, part, cache = setup
    with SpatialRayLoader(scene, part, 2, rays_per_batch=B, rays_per_run=4 * B, prefetch=0, cache=cache) as L:
        ref = _take(L, 21)
    with SpatialRayLoader(scene, part, 2, rays_per_batch=B, rays_per_run=rays_per_run, prefetch=prefetch,
                          cache=cache) as L:
        assert _same(_take(L, 21), ref)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_held_batches_stay_valid_after_later_runs(setup, prefetch):
    """A batch is a view of its run's outputs: later runs must not write into it (with the
    synchronous executor, which reuses its output buffers, the loader copies)."""
    scene, part, cache = setup
    with SpatialRayLoader(scene, part, 0, rays_per_batch=B, rays_per_run=4 * B, prefetch=prefetch, cache=cache) as L:
        held = _take(L, 12, clone=False)
        copies = [{k: v.clone() for k, v in b.items()} for b in held]
        _take(L, 12)
        assert _same(held, copies)


def test_close_leaves_no_threads(setup):
    """The background hand-over thread (prefetch > 0 on the CPU) ends with close()."""
    import threading

    scene, part, cache = setup
    before = set(threading.enumerate())
    L = SpatialRayLoader(scene, part, 1, rays_per_batch=B, rays_per_run=2 * B, prefetch=2, cache=cache)
    _take(L, 5)
    assert len(set(threading.enumerate()) - before) == 1
    L.close()
    L.close()
    assert set(threading.enumerate()) <= before


@pytest.mark.parametrize("k", [5, 8])  # mid-run (4 steps a run) and at a run boundary
def test_resume_is_exact(setup, k):
    scene, part, cache = setup
    with SpatialRayLoader(scene, part, 3, rays_per_batch=B, rays_per_run=4 * B, cache=cache) as L:
        whole = _take(L, k + 9)
    with SpatialRayLoader(scene, part, 3, rays_per_batch=B, rays_per_run=4 * B, cache=cache) as L:
        _take(L, k)
        state = L.state_dict()
        _take(L, 3)  # the old loader runs on; the state is a snapshot
    with SpatialRayLoader(scene, part, 3, rays_per_batch=B, rays_per_run=4 * B, cache=cache) as L:
        L.load_state_dict(state)
        assert _same(_take(L, 9), whole[k:])


@pytest.mark.parametrize("k", [3, 6, 7])  # offsets 192, 384, 448 of runs of 8 x 64 rays; the new runs hold 2 x 64
def test_a_state_loads_into_another_run_size(setup, k):
    """An SS rank's cells share its threads, so a cell's run size follows the cells per rank: a
    state saved with runs of 8 steps loads into a loader with runs of 2 (a resume on another
    world size) and continues the cell's stream exactly, also when the saved offset lies past the
    new loader's first run (one run of ``offset`` rays finds the stream position after it)."""
    scene, part, cache = setup
    with SpatialRayLoader(scene, part, 2, rays_per_batch=B, rays_per_run=8 * B, cache=cache) as L:
        whole = _take(L, k + 6)
    with SpatialRayLoader(scene, part, 2, rays_per_batch=B, rays_per_run=8 * B, cache=cache) as L:
        _take(L, k)
        state = L.state_dict()
    assert state["offset"] == k * B and state["rays_per_run"] == 8 * B
    for run in (2 * B, 12 * B):
        with SpatialRayLoader(scene, part, 2, rays_per_batch=B, rays_per_run=run, cache=cache) as L:
            L.load_state_dict(state)
            assert _same(_take(L, 6), whole[k:]), run


def test_op_start_minus_one_continues_the_previous_run(setup):
    """Fed ``start = -1``, the op starts where its previous run ended: the runs of an async
    pipeline fed (s0, -1, -1, ...) are those of explicit starts s0, s0 + c0, s0 + c0 + c1, ..."""
    scene, part, cache = setup
    pipe = spatial_pipeline(cache, part, 1, 100, "random", 0, first_start=777, prefetch=2)
    cont = [pipe.run() for _ in range(4)]
    s = 777
    for outs in cont:
        ref = spatial_pipeline(cache, part, 1, 100, "random", 0, first_start=s, prefetch=0).run()
        for a, r in zip(outs, ref):
            assert np.array_equal(np.asarray(a[0]), np.asarray(r[0]))
        s += int(np.asarray(outs[6][0])[0])
    assert s > 777 + 400  # some candidates were rejected


def test_op_start_minus_one_without_a_previous_run_is_an_error(setup):
    scene, part, cache = setup
    pipe = spatial_pipeline(cache, part, 1, 100, "random", 0, first_start=-1, prefetch=0)
    with pytest.raises(RuntimeError, match="continue"):
        pipe.run()


def test_ss_sync_global_scatters_device_tensors_under_nccl(setup, monkeypatch):
    """SS sync_global (RoutedSyncGlobal) goes through the same scatter: under NCCL rank 0 sends
    and receives on the collective device (the GPU), never CPU tensors."""
    from test_baseline import record_scatter
    from dali_nerf.sources.sync import RoutedSyncGlobal

    scene, part, cache = setup
    seen = record_scatter(monkeypatch)
    src = RoutedSyncGlobal(scene, part, [[0], [1]], rank=0, slot=0, rays_per_batch=16, seed=2, cache=cache)
    b = next(src)
    meta = torch.device("meta")
    assert [s[0] for s in seen] == [meta, meta] and all(p == [meta, meta] for _, p in seen)
    assert all(v.device == meta for v in b.values())


def test_ss_sync_global_state_continues_its_slot_and_refuses_another(setup):
    """RoutedSyncGlobal's state (every rank's position of one cell slot) continues the same slot
    exactly and is refused, in one line, by another slot or another number of ranks."""
    from dali_nerf.errors import ConfigError
    from dali_nerf.sources.sync import RoutedSyncGlobal

    scene, part, cache = setup

    def src(slot):
        return RoutedSyncGlobal(scene, part, [[0, 1]], rank=0, slot=slot, rays_per_batch=16, seed=2, cache=cache)

    a = src(0)
    next(a)
    st = a.state_dict()
    want = next(a)
    b = src(0)
    b.load_state_dict(st)
    got = next(b)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ConfigError) as e:
        src(1).load_state_dict(st)
    assert str(e.value) == ("RoutedSyncGlobal.load_state_dict: the state is cell slot 0's on 1 rank(s), this sampler "
                            "slot 1's on 1; load each slot's state into the same slot of a run of as many ranks")
    with pytest.raises(ConfigError, match=r"slot 0's on 2 rank\(s\), this sampler slot 0's on 1"):
        src(0).load_state_dict(dict(st, position=st["position"] * 2))
