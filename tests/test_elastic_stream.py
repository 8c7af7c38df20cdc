"""The global stream through RayLoader (``stream="global"``): the same global batches on any
number of ranks, every pixel of the split exactly once per epoch across all ranks, and a loader
state saved at W ranks that continues the stream exactly at W' ranks.

Each rank is a real RayLoader over its own DALI-decoded image shard of a tiny PNG scene written per
example; a rank's batches are merged with the other ranks' by their ``positions``. The coverage
check is tests/_stream_checks.py::assert_each_pixel_once; the pixels are also compared with the
numpy specification of the stream (dali_nerf/ops/reference.py).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings, strategies as st

from _stream_checks import assert_each_pixel_once, pixel_ids
from _tiny_scene import tiny_scene
from dali_nerf.errors import ConfigError
from dali_nerf.ops import reference as ref
from dali_nerf.sources import RayLoader, SyncGlobalSampler
from dali_nerf.sources.base import global_epoch_steps

SEEDS = st.integers(0, 2 ** 63 - 1)
KEYS = ("origins", "directions", "rgb", "indices", "positions")


@st.composite
def splits(draw, min_images=4, max_images=7, max_side=9):
    n = draw(st.integers(min_images, max_images))
    return draw(st.lists(st.tuples(st.integers(1, max_side), st.integers(1, max_side)), min_size=n, max_size=n))


def _scene(root: Path, sizes):
    return tiny_scene(root, n=len(sizes), sizes=sizes, kinds=("png_rgb",))


def _loader(scene, W, r, G, seed, mode, runs=2, prefetch=1):
    B = G // W
    return RayLoader(scene, rays_per_batch=B, rank=r, world_size=W, seed=seed, mode=mode, stream="global",
                     rays_per_run=runs * B, prefetch=prefetch, num_threads=1)


def _merged(parts):
    """One global batch from the ranks' batches of a step: every key, rows in position order."""
    cat = {k: torch.cat([p[k] for p in parts]) for k in KEYS}
    order = torch.argsort(cat["positions"])
    return {k: v[order] for k, v in cat.items()}


def _steps(loaders, n):
    """n steps of every loader (all ranks of one world size), merged per step."""
    per = [[{k: v.clone() for k, v in next(L).items()} for _ in range(n)] for L in loaders]
    return [_merged([p[i] for p in per]) for i in range(n)]


@settings(max_examples=25)
@given(sizes=splits(), m=st.integers(1, 4), seed=SEEDS, mode=st.sampled_from(["random", "epoch"]),
       start=st.integers(0, 5), steps=st.integers(1, 4), runs=st.integers(1, 3))
def test_global_batches_are_the_same_for_world_sizes_1_to_4(sizes, m, seed, mode, start, steps, runs):
    """G = 12 m (B = G / W for W = 1..4): from any start step (``set_step``), the ranks' batches
    merged by position are the same global batches, key for key and bit for bit, for every W;
    their positions are exactly the step's [k G, (k + 1) G) and their pixels the reference's."""
    G = 12 * m
    with tempfile.TemporaryDirectory() as tmp:
        scene = _scene(Path(tmp), sizes)
        want = None
        for W in range(1, 5):
            loaders = [_loader(scene, W, r, G, seed, mode, runs) for r in range(W)]
            try:
                for L in loaders:
                    L.set_step(start)
                got = _steps(loaders, steps)
            finally:
                for L in loaders:
                    L.close()
            if want is None:
                want = got
                n = np.asarray(scene.width, np.int64) * np.asarray(scene.height, np.int64)
                for k, b in enumerate(got):
                    g = np.arange((start + k) * G, (start + k + 1) * G)
                    assert np.array_equal(b["positions"].numpy(), g)
                    assert np.array_equal(pixel_ids(scene.width, scene.height, b["indices"]),
                                          ref.pixels(seed, mode, n, g))
                continue
            for k, (a, b) in enumerate(zip(want, got)):
                for key in KEYS:
                    assert torch.equal(a[key], b[key]), (W, k, key)


@st.composite
def resumes(draw):
    """(sizes, W, W', G, the resume step's offset from the epoch's first step)."""
    sizes = draw(splits(min_images=4, max_images=6))
    W, W2 = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    G = math.lcm(W, W2) * draw(st.integers(1, 6))
    return sizes, W, W2, G


@settings(max_examples=30)
@given(case=resumes(), seed=SEEDS, epoch=st.integers(0, 3), cut=st.floats(0.0, 1.0), runs=st.integers(1, 3),
       which=st.integers(0, 3))
@example(case=([(1, 1)] * 4, 1, 2, 6), seed=0, epoch=2, cut=0.0, runs=1, which=0)  # an epoch without a step of its own
def test_an_epoch_across_a_resume_from_W_to_W2_visits_every_pixel_once(case, seed, epoch, cut, runs, which):
    """Epoch mode: W ranks start at ``set_epoch(e)`` and stop at a drawn step inside the epoch;
    the state of one of them (any rank: the state is the global step) is loaded into every rank of
    W' loaders (rays_per_batch = G / W'), which run to the epoch's end. Over both parts, the rays
    whose position lies in the epoch ([e P, (e + 1) P), with the straddling step before the epoch's
    first, which the previous epoch's loop took) visit every pixel of the split exactly once, and
    no position of any step is missing or repeated."""
    sizes, W, W2, G = case
    with tempfile.TemporaryDirectory() as tmp:
        scene = _scene(Path(tmp), sizes)
        P = scene.num_pixels
        first, last = -(-epoch * P // G), -(-(epoch + 1) * P // G)  # the steps of the epoch's loop
        stop = first + round(cut * (last - first))
        rows, states = [], []
        for r in range(W):
            with _loader(scene, W, r, G, seed, "epoch", runs) as L:
                L.set_epoch(epoch)
                assert len(L) == last - first and L.step == first
                for _ in range(stop - first):
                    rows.append(next(L))
                states.append(L.state_dict())
        assert len({s["step"] for s in states}) == 1 and states[0]["step"] == stop
        state = states[which % W]
        for r in range(W2):
            with _loader(scene, W2, r, G, seed, "epoch", runs) as L:
                L.load_state_dict(state)
                assert L.step == stop
                for _ in range(last - stop):
                    rows.append(next(L))
        # (no step at all when G > P puts the whole epoch inside the previous epoch's last step)
        pos = torch.cat([b["positions"] for b in rows]).numpy() if rows else np.zeros(0, np.int64)
        assert np.array_equal(np.sort(pos), np.arange(first * G, last * G)), "a position missing or repeated"
        if first * G > epoch * P:  # the epoch's first positions: the previous epoch's last step
            for r in range(W):
                with _loader(scene, W, r, G, seed, "epoch", runs) as L:
                    L.set_step(first - 1)
                    rows.append(next(L))
    pos = torch.cat([b["positions"] for b in rows]).numpy()
    idx = torch.cat([b["indices"] for b in rows]).numpy()
    inside = (pos >= epoch * P) & (pos < (epoch + 1) * P)
    assert_each_pixel_once(scene, [idx[inside]])


@settings(max_examples=20)
@given(sizes=splits(), seed=SEEDS, mode=st.sampled_from(["random", "epoch"]), k=st.integers(0, 7),
       W=st.integers(1, 4), W2=st.integers(1, 4))
def test_a_state_continues_the_same_batches_on_another_world_size(sizes, seed, mode, k, W, W2):
    """Random and epoch mode: the steps after a resume from W to W' ranks are the uninterrupted
    W-rank stream's (merged by position, bit for bit)."""
    G = math.lcm(W, W2) * 5
    with tempfile.TemporaryDirectory() as tmp:
        scene = _scene(Path(tmp), sizes)
        loaders = [_loader(scene, W, r, G, seed, mode) for r in range(W)]
        try:
            whole = _steps(loaders, k + 3)
            state = loaders[0].state_dict()
        finally:
            for L in loaders:
                L.close()
        loaders = [_loader(scene, W, r, G, seed, mode) for r in range(W)]
        try:
            _steps(loaders, k)
            state = loaders[-1].state_dict()
        finally:
            for L in loaders:
                L.close()
        resumed = [_loader(scene, W2, r, G, seed, mode) for r in range(W2)]
        try:
            for L in resumed:
                L.load_state_dict(state)
            again = _steps(resumed, 3)
        finally:
            for L in resumed:
                L.close()
    for a, b in zip(whole[k:], again):
        for key in KEYS:
            assert torch.equal(a[key], b[key]), key


def test_tiny_shards_get_empty_batches_and_the_counts_sum_to_G(tmp_path):
    """Rank 1's shard is two images of 1 and 2 pixels (3 of the split's 539): of G = 16 rays a
    step it keeps about 0.09, mostly none: its batches are (0, ...) tensors then (every key), and
    the two ranks' counts sum to G every step."""
    scene = tiny_scene(tmp_path, n=4, sizes=[(20, 16), (16, 14), (1, 1), (1, 2)], kinds=("png_rgb",))
    G = 16
    with _loader(scene, 2, 0, G, 3, "random", runs=4) as a, _loader(scene, 2, 1, G, 3, "random", runs=4) as b:
        pairs = [(next(a), next(b)) for _ in range(40)]
    assert all(len(x["positions"]) + len(y["positions"]) == G for x, y in pairs)
    small = [len(y["positions"]) for _, y in pairs]
    assert small.count(0) > 20 and sum(small) > 0, small
    empty = next(y for _, y in pairs if len(y["positions"]) == 0)
    assert {k: tuple(v.shape) for k, v in empty.items()} == {
        "origins": (0, 3), "directions": (0, 3), "rgb": (0, 3), "indices": (0, 3), "near": (0, 1), "far": (0, 1),
        "positions": (0,)}


def test_refusals_are_one_line(tmp_path):
    scene = tiny_scene(tmp_path, n=4, sizes=[(9, 8)] * 4, kinds=("png_rgb",))
    with pytest.raises(ConfigError, match="cache.max_bytes=300: rank 0's shard needs .* cannot stream it through "
                                          "windows; run more ranks, raise cache.max_bytes, or set pipeline.stream=shard"):
        RayLoader(scene, rays_per_batch=16, max_bytes=300, stream="global")
    with pytest.raises(ConfigError, match="output_map: unknown key 'positions'.*needs stream='global'"):
        RayLoader(scene, rays_per_batch=16, output_map=("rgb", "positions"))
    with pytest.raises(ConfigError, match="stream='sideways': use global or shard"):
        RayLoader(scene, rays_per_batch=16, stream="sideways")
    with _loader(scene, 2, 0, 32, 0, "random") as L:
        next(L)
        state = L.state_dict()
    assert state["stream"] == "global-v2" and state["global_batch"] == 32 and state["step"] == 1
    with _loader(scene, 3, 0, 48, 0, "random") as L, pytest.raises(
            ConfigError, match=r"saved global_batch=32 but this loader has 48; the global batch .* use rays_per_batch = 32 / world_size"):
        L.load_state_dict(state)
    with RayLoader(scene, rays_per_batch=16, num_threads=1) as L, pytest.raises(
            ConfigError, match="saved stream 'global-v2' but this loader samples 'shard-v1'"):
        L.load_state_dict(state)
    with RayLoader(scene, rays_per_batch=16, num_threads=1) as L:
        shard = L.state_dict()
    with _loader(scene, 1, 0, 16, 0, "random") as L, pytest.raises(ConfigError, match="saved stream 'shard-v1'"):
        L.load_state_dict(shard)
    with _loader(scene, 1, 0, 16, 0, "random") as L, pytest.raises(ConfigError, match="not a multiple of the global batch"):
        L.load_state_dict(dict(state, global_batch=16, position=17))
    with RayLoader(scene, rays_per_batch=16, num_threads=1) as L, pytest.raises(ConfigError, match="set_step"):
        L.set_step(3)


def test_sync_global_state_resumes_on_another_world_size_with_the_same_global_batch(tmp_path):
    """sync_global's stream is rank 0's, position k G at step k, whatever W (W only cuts each
    global batch into rank slices): a state of W = 3 ranks (B = 4) continues in a 1-rank sampler
    of G = 12 exactly where that sampler's own stream is; another G is refused."""
    scene = tiny_scene(tmp_path, n=4, sizes=[(9, 8)] * 4, kinds=("png_rgb",))
    for mode in ("random", "epoch"):
        with SyncGlobalSampler(scene, rays_per_batch=12, seed=5, mode=mode) as a:
            whole = [next(a)["indices"].clone() for _ in range(6)]
            three = dict(a.state_dict(), position=3 * 12, rank=2, world_size=3, rays_per_batch=4, global_batch=12)
        assert a.state_dict()["stream"] == "sync_global-v1"
        with SyncGlobalSampler(scene, rays_per_batch=12, seed=5, mode=mode) as b:
            b.load_state_dict(three)
            assert all(torch.equal(next(b)["indices"], w) for w in whole[3:])
        with SyncGlobalSampler(scene, rays_per_batch=10, seed=5, mode=mode) as c, pytest.raises(
                ConfigError, match="saved global batch 12 .* this sampler has 10"):
            c.load_state_dict(three)


def test_epoch_loops_partition_the_global_steps():
    """``set_epoch(e)`` + ``len()`` steps (global_epoch_steps) over epochs 0..40: each step once,
    in order; e.g. 20 images of 504x378 with G = 12288 (a boundary inside a step each epoch)."""
    P, G = 20 * 504 * 378, 12288
    steps = [s for e in range(40) for s in range(*(lambda f, n: (f, f + n))(*global_epoch_steps(e, P, G)))]
    assert steps == list(range(len(steps))) and len(steps) == -(-40 * P // G)


@settings(max_examples=12, deadline=None)
@given(sizes=splits(max_images=5, max_side=7), W=st.integers(1, 4), k=st.integers(1, 9), seed=SEEDS,
       epochs=st.integers(2, 4))
def test_len_loops_over_epochs_visit_every_global_position_once(sizes, W, k, seed, epochs):
    """The usual loop, ``set_epoch(e); for _ in range(len(L))``, over several epochs on W ranks
    (G = k W, a step often straddling an epoch boundary): the ranks' positions together are every
    global position from 0 exactly once; the same for sync_global on one rank."""
    G = k * W
    with tempfile.TemporaryDirectory() as tmp:
        scene = _scene(Path(tmp), sizes)
        pos = []
        for r in range(W):
            with _loader(scene, W, r, G, seed, "epoch") as L:
                for e in range(epochs):
                    L.set_epoch(e)
                    pos += [next(L)["positions"] for _ in range(len(L))]
        with SyncGlobalSampler(scene, rays_per_batch=G, seed=seed, mode="epoch") as S:
            sync = []
            for e in range(epochs):
                S.set_epoch(e)
                for _ in range(len(S)):
                    p = S.position
                    sync += range(p, p + len(next(S)["indices"]))
    n = -(-epochs * scene.num_pixels // G) * G
    assert np.array_equal(np.sort(torch.cat(pos).numpy()), np.arange(n)), "a global position missing or repeated"
    assert sync == list(range(n)), "sync_global: a position missing or repeated"
