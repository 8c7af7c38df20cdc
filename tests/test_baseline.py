"""Baselines: batch contract vs the cache and rays_from_indices; sync_global scatter with 2 real ranks."""

import os
import sys

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from _tiny_scene import tiny_scene
from dali_nerf.sources import SyncGlobalSampler, SyncLocalSampler, TorchWorkersSampler
from dali_nerf.data.imagecache import decode_cache


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    return tiny_scene(tmp_path_factory.mktemp("bl"), n=4, width=24, height=16, kinds=("png_rgba", "jpg"))


def _check(scene, cache, b, B):
    assert set(b) == {"origins", "directions", "rgb", "indices", "near", "far"}
    for k in ("origins", "directions", "rgb"):
        assert b[k].shape == (B, 3) and b[k].dtype == torch.float32
    assert b["indices"].shape == (B, 3) and b["indices"].dtype == torch.int64
    cam, row, col = b["indices"].T.numpy()
    k = np.searchsorted(cache.layout[:, 3], cam)
    assert np.array_equal(cache.layout[k, 3], cam)
    pid = cache.layout[k, 0] + row * cache.layout[k, 1] + col
    np.testing.assert_array_equal(b["rgb"].numpy(), cache.pixels[pid].astype(np.float32) / 255.0)
    # independent numpy ray reference
    c2w = scene.c2w[cam].astype(np.float64)
    K = scene.intrinsics[cam].astype(np.float64)
    d = np.einsum("bij,bj->bi", c2w[:, :, :3], np.stack([(col + 0.5 - K[:, 2]) / K[:, 0],
                                                         -(row + 0.5 - K[:, 3]) / K[:, 1], -np.ones(B)], -1))
    np.testing.assert_allclose(b["directions"].numpy(), d / np.linalg.norm(d, axis=1, keepdims=True), atol=1e-5)
    np.testing.assert_allclose(b["origins"].numpy(), c2w[:, :, 3], atol=1e-6)
    np.testing.assert_array_equal(b["near"].numpy()[:, 0], scene.near[cam])


@pytest.mark.parametrize("cls", [SyncLocalSampler, SyncGlobalSampler])
@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_sync_contract_and_epoch(scene, cls, mode):
    src = cls(scene, rays_per_batch=300, mode=mode, seed=2)
    cache = decode_cache(scene, 0, 1)
    bs = [next(src) for _ in range(5)]
    for b in bs:
        _check(scene, cache, b, 300)
    s = src.stats()
    assert s["steps"] == 5 and 0 < s["wait_s"] <= s["elapsed_s"]  # synchronous: next() is all wait
    assert s["stall_fraction"] == pytest.approx(s["wait_s"] / s["elapsed_s"], rel=1e-12)
    assert s["rays_per_s"] == pytest.approx(5 * 300 / s["elapsed_s"], rel=1e-12)
    if mode == "epoch":
        P = cache.num_pixels
        src.set_epoch(0)
        idx = torch.cat([next(src)["indices"] for _ in range(len(src))])[:P]
        assert len({tuple(r) for r in idx.tolist()}) == P
    # resume
    st = src.state_dict()
    ref = [next(src)["indices"] for _ in range(3)]
    again = cls(scene, rays_per_batch=300, mode=mode, seed=2)
    again.load_state_dict(st)
    assert all(torch.equal(a, next(again)["indices"]) for a in ref)


def test_sync_local_shard(scene):
    cache = decode_cache(scene, 1, 2)
    b = next(SyncLocalSampler(scene, rays_per_batch=128, rank=1, world_size=2))
    _check(scene, cache, b, 128)
    assert set(b["indices"][:, 0].tolist()) <= {2, 3}


def test_torch_workers_matches_sync_local_stream(scene):
    cache = decode_cache(scene, 0, 1)
    ref = SyncLocalSampler(scene, rays_per_batch=200, seed=5, cache=cache)
    with TorchWorkersSampler(scene, rays_per_batch=200, seed=5, workers=2, cache=cache) as tw:
        for _ in range(5):
            b = next(tw)
            _check(scene, cache, b, 200)
            assert torch.equal(b["indices"], next(ref)["indices"])


def _global_worker(rank, scene, init_file, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        src = SyncGlobalSampler(scene, rays_per_batch=64, rank=rank, world_size=2, seed=9)
        b = [next(src) for _ in range(3)]
        torch.save(b, os.path.join(out_dir, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_sync_global_two_ranks_scatter_disjoint_slices(scene, tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    mp.start_processes(_global_worker, args=(scene, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    got = [torch.load(tmp_path / f"r{r}.pt") for r in range(2)]
    ref = SyncGlobalSampler(scene, rays_per_batch=128, seed=9)  # the global batch, world_size 1
    cache = decode_cache(scene, 0, 1)
    for step in range(3):
        g = next(ref)
        for r in range(2):
            _check(scene, cache, got[r][step], 64)
            for k in g:
                assert torch.equal(got[r][step][k], g[k][r * 64:(r + 1) * 64]), (step, r, k)


def test_collective_device_is_the_local_gpu_under_nccl(monkeypatch):
    from dali_nerf.sources.sync import collective_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert collective_device("nccl") == torch.device("cuda", 1)  # NCCL refuses CPU tensors
    assert collective_device("gloo", "cpu") == torch.device("cpu")


def record_scatter(monkeypatch, backend="nccl"):
    """Run sync_global's scatter in-process as if under ``backend``: the process group calls are
    replaced by recorders of the tensors' devices; ``meta`` stands for the device
    collective_device names (no GPU here)."""
    from dali_nerf.sources import sync

    seen = []
    real = sync.collective_device

    def fake_device(b, device="cpu"):
        assert b == backend and real(b, device) == torch.device("cuda", 0)
        return torch.device("meta")

    def scatter(out, parts=None, src=0):
        seen.append((out.device, None if parts is None else [p.device for p in parts]))

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(sync, "collective_device", fake_device)
    monkeypatch.setattr(sync.dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(sync.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sync.dist, "scatter", scatter)
    return seen


@pytest.mark.parametrize("rank", [0, 1])
def test_sync_global_scatters_device_tensors_under_nccl(scene, monkeypatch, rank):
    seen = record_scatter(monkeypatch)
    src = SyncGlobalSampler(scene, rays_per_batch=32, rank=rank, world_size=2, seed=1)
    b = next(src)
    meta = torch.device("meta")
    assert len(seen) == 2  # the packed floats and the indices
    for out, parts in seen:
        assert out == meta and (parts is None if rank else parts == [meta, meta])
    assert all(v.device == meta for v in b.values())
