"""Property: a checkpoint resumes the exact stream, and any plain state round-trips.

* Sources: a source is advanced a hypothesis-drawn number of steps (after an optional
  ``set_epoch``), its ``state_dict()`` is written with ``dali_nerf.train.checkpoint`` (per-rank file,
  ``commit_checkpoint``, ``latest_checkpoint``, ``load_rank_state``: the trainers' path, with
  ``weights_only=True``), a *fresh* source built with the same stream settings loads it, and its
  next batches equal, key for key and bit for bit, the batches the original source gave after the
  save. Sources: RayLoader (cached and streamed; random and epoch; the fresh loader may use
  another ``prefetch`` and ``rays_per_run``, which ARCHITECTURE.md says do not change the
  stream), SpatialRayLoader (the routed op; another ``prefetch``), sync_local, torch_workers
  (in-process), sync_global (world size 1) and the routed sync_local.
* checkpoint.py itself: any nested state of tensors (any dtype and shape), ints (64-bit), floats,
  strings, bools, None, lists and dicts saved over a random sequence of steps loads back equal
  from ``latest``, which names the last committed step, and ``keep`` prunes all but the newest.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from _tiny_scene import tiny_scene
from dali_nerf.train.checkpoint import commit_checkpoint, latest_checkpoint, load_rank_state, save_rank_state
from dali_nerf.partition import Partition
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.sources import RayLoader, SpatialRayLoader, SyncGlobalSampler, SyncLocalSampler, TorchWorkersSampler
from dali_nerf.sources.sync import RoutedSyncLocal

SEEDS = st.integers(0, 2 ** 63 - 1)
SIZES = [(24, 16), (20, 18), (22, 15), (16, 20), (18, 18), (21, 14)]  # two ranks: each shard streams


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    return tiny_scene(tmp_path_factory.mktemp("ckpt"), n=len(SIZES), sizes=SIZES, kinds=("png_rgb", "jpg"))


@pytest.fixture(scope="module")
def partition(scene):
    # the tiny scene's cameras circle the origin (radius 3, y up): four cells around it
    cen = np.array([[1.5, 0.5, 1.5], [-1.5, 0.5, 1.5], [1.5, 0.5, -1.5], [-1.5, 0.5, -1.5]])
    return Partition(cen, margin=1.15, dims=2, up=(0.0, 1.0, 0.0), kind="kmeans")


def take(src, n):
    return [{k: v.clone() for k, v in next(src).items()} for _ in range(n)]


def checkpoint_round_trip(folder: Path, step: int, rank: int, state: dict) -> dict:
    """The trainers' path: this rank's file, commit, follow ``latest``, load (weights_only)."""
    root = folder / "checkpoints"
    save_rank_state(root, step, rank, {"source": state, "step": step})
    commit_checkpoint(root, step)
    got = load_rank_state(latest_checkpoint(root), rank)
    assert got["step"] == step
    return got["source"]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), i
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), (i, k)


def resume_check(make_first, make_fresh, steps, after, epoch=None, rank=0):
    with tempfile.TemporaryDirectory() as tmp, make_first() as src:
        if epoch is not None:
            src.set_epoch(epoch)
        take(src, steps)
        state = src.state_dict()
        expected = take(src, after)
        loaded = checkpoint_round_trip(Path(tmp), steps, rank, state)
        assert loaded == state
        with make_fresh() as again:
            again.load_state_dict(loaded)
            assert_same_batches(expected, take(again, after))


@settings(max_examples=30)
@given(mode=st.sampled_from(["random", "epoch"]), batch=st.integers(1, 300), runs=st.integers(1, 4),
       runs_again=st.integers(1, 4), prefetch=st.integers(0, 2), prefetch_again=st.integers(0, 2), seed=SEEDS,
       world=st.integers(1, 3), data=st.data())
def test_ray_loader_resumes_the_exact_stream(scene, mode, batch, runs, runs_again, prefetch, prefetch_again, seed,
                                             world, data):
    rank = data.draw(st.integers(0, world - 1), label="rank")
    steps = data.draw(st.integers(0, 12), label="steps before the save")
    epoch = data.draw(st.none() | st.integers(0, 3), label="set_epoch")

    def make(runs, prefetch):
        return lambda: RayLoader(scene, rays_per_batch=batch, rank=rank, world_size=world, seed=seed, mode=mode,
                                 rays_per_run=runs * batch, prefetch=prefetch, num_threads=1)

    resume_check(make(runs, prefetch), make(runs_again, prefetch_again), steps, 3, epoch, rank)


@settings(max_examples=10)
@given(mode=st.sampled_from(["random", "epoch"]), batch=st.integers(1, 200), seed=SEEDS, world=st.integers(1, 2),
       steps=st.integers(0, 10), epoch=st.none() | st.integers(0, 2), data=st.data())
def test_streamed_ray_loader_resumes_the_exact_stream(scene, mode, batch, seed, world, steps, epoch, data):
    """Streaming through decoded windows (cache.max_bytes below the shard): the resumed loader
    decodes the window holding the saved position."""
    rank = data.draw(st.integers(0, world - 1), label="rank")
    budget = 2 * (max(w * h for w, h in SIZES) * 3 + 104)  # two windows of one image

    def make():
        L = RayLoader(scene, rays_per_batch=batch, rank=rank, world_size=world, seed=seed, mode=mode,
                      rays_per_run=2 * batch, prefetch=1, num_threads=1, max_bytes=budget)
        assert L.streaming
        return L

    resume_check(make, make, steps, 3, epoch, rank)


@settings(max_examples=15)
@given(cell=st.integers(0, 3), mode=st.sampled_from(["random", "epoch"]), batch=st.integers(1, 200),
       runs=st.integers(1, 3), prefetch=st.integers(0, 2), prefetch_again=st.integers(0, 2), seed=SEEDS,
       steps=st.integers(0, 10))
def test_spatial_loader_resumes_the_exact_stream(scene, partition, cell, mode, batch, runs, prefetch, prefetch_again,
                                                 seed, steps):
    cache = decode_cache(scene, 0, 1)

    def make(prefetch):
        return lambda: SpatialRayLoader(scene, partition, cell, rays_per_batch=batch, seed=seed, prefetch=prefetch,
                                        mode=mode, rays_per_run=runs * batch, num_threads=1, cache=cache)

    resume_check(make(prefetch), make(prefetch_again), steps, 3)


@settings(max_examples=25)
@given(kind=st.sampled_from(["sync_local", "torch_workers", "sync_global", "routed_sync_local"]),
       mode=st.sampled_from(["random", "epoch"]), batch=st.integers(1, 300), seed=SEEDS, world=st.integers(1, 3),
       steps=st.integers(0, 12), epoch=st.none() | st.integers(0, 3), data=st.data())
def test_baselines_resume_the_exact_stream(scene, partition, kind, mode, batch, seed, world, steps, epoch, data):
    rank = data.draw(st.integers(0, world - 1), label="rank") if kind in ("sync_local", "torch_workers") else 0
    if kind in ("sync_global", "routed_sync_local"):
        world = 1
    if kind == "routed_sync_local":
        epoch = None  # random candidate blocks only
    cache = decode_cache(scene, rank, world)

    def make():
        if kind == "sync_local":
            return SyncLocalSampler(scene, rays_per_batch=batch, rank=rank, world_size=world, seed=seed, mode=mode,
                                    cache=cache)
        if kind == "torch_workers":
            return TorchWorkersSampler(scene, rays_per_batch=batch, rank=rank, world_size=world, seed=seed, mode=mode,
                                       workers=0, cache=cache)
        if kind == "sync_global":
            return SyncGlobalSampler(scene, rays_per_batch=batch, seed=seed, mode=mode, cache=cache)
        return RoutedSyncLocal(scene, partition, cell=rank % 4, rays_per_batch=batch, seed=seed, cache=cache)

    resume_check(make, make, steps, 3, epoch, rank)


# ------------------------------------------------------------------------------ checkpoint.py

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    n = math.prod(shape)
    if dtype.is_floating_point:
        t = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, (n,), generator=g).bool()
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -2 ** 62), min(info.max, 2 ** 62), (n,), generator=g, dtype=torch.int64).to(dtype)
    return t.reshape(shape)


leaves = st.one_of(tensors(), st.integers(-2 ** 63, 2 ** 63 - 1), st.floats(allow_nan=False), st.text(max_size=8),
                   st.booleans(), st.none())
states = st.recursive(leaves, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                     st.dictionaries(st.text(max_size=6), kids, max_size=3)),
                      max_leaves=12)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=25)
@given(saves=st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 3), states), min_size=1, max_size=4),
       keep=st.integers(1, 3))
def test_any_plain_state_round_trips_through_latest(saves, keep):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "checkpoints"
        written = {}
        for step, rank, state in saves:  # steps in any order: `latest` is the last one committed
            save_rank_state(root, step, rank, {"state": state})
            commit_checkpoint(root, step, keep=keep)
            written[(step, rank)] = state
        step, rank, state = saves[-1]
        folder = latest_checkpoint(root)
        assert folder.name == f"step_{step:07d}"
        assert same(load_rank_state(folder, rank)["state"], written[(step, rank)])
        kept = sorted(p.name for p in root.glob("step_*"))
        names = sorted({f"step_{s:07d}" for s, _, _ in saves})
        assert folder.name in kept and len(kept) <= max(keep, 1) + 1
        assert kept == sorted(set(names[-keep:]) | {folder.name}), (kept, names, keep)
