"""Property: an epoch visits every pixel of the split exactly once, disjoint per rank.

The contract (ARCHITECTURE.md, "Stream" and "Loader stream and epochs"): in epoch mode, after
``set_epoch(e)`` the first ``P_r`` rays of rank r visit every pixel of its image shard
(``pipelines/decode.py::shard_range``) exactly once; shards are disjoint, so across ranks every
pixel of the split is visited exactly once; ``len()`` is the same on every rank and covers the
largest shard. Checked through the real sources over hypothesis-drawn image counts and sizes
(so pixel counts, including P < 4 where the Feistel bijection has its smallest domain), world
sizes, batch sizes, run sizes, prefetch depths, seeds and epochs:

* RayLoader (our op's stream), cached and streamed through decoded windows;
* the baselines that claim the same contract: sync_local, torch_workers (its stream is
  sync_local's), and sync_global, whose global stream (B * world_size positions a step) is cut
  into rank slices (rank r gets rows [r B, (r + 1) B) of every global batch; that the scatter
  hands out exactly those slices is tests/test_baseline.py's two-process test).

The coverage check itself is tests/_stream_checks.py::assert_each_pixel_once (reusable for a
global stream). Scenes are tiny PNGs written per example (a few ms) and decoded by the real
decode graph.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from hypothesis import assume, given, settings, strategies as st

from _stream_checks import assert_each_pixel_once
from _tiny_scene import tiny_scene
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.pipelines.decode import shard_range
from dali_nerf.sources import RayLoader, SyncGlobalSampler, SyncLocalSampler, TorchWorkersSampler
from dali_nerf.sources.streaming import WINDOW_IMAGE_OVERHEAD

SEEDS = st.integers(0, 2 ** 63 - 1)


@st.composite
def layouts(draw, max_images=6, min_side=1, max_side=9):
    """(image sizes [(w, h)], world_size)."""
    n = draw(st.integers(1, max_images))
    sizes = draw(st.lists(st.tuples(st.integers(min_side, max_side), st.integers(min_side, max_side)),
                          min_size=n, max_size=n))
    return sizes, draw(st.integers(1, n))


def _scene(root: Path, sizes):
    return tiny_scene(root, n=len(sizes), sizes=sizes, kinds=("png_rgb",))


def _epoch_parts(make, world_size, epoch, num_pixels):
    """Per rank: the first P_r index rows after ``set_epoch(epoch)`` of the source ``make(rank)``;
    asserts len() is equal on every rank and covers the rank's P_r."""
    parts, lens = [], set()
    for r in range(world_size):
        with make(r) as src:
            src.set_epoch(epoch)
            n = len(src)
            lens.add(n)
            idx = torch.cat([next(src)["indices"] for _ in range(n)]).numpy()
            assert len(idx) >= num_pixels(r), (r, len(idx), num_pixels(r))
            parts.append(idx[:num_pixels(r)])
    assert len(lens) == 1, f"steps per epoch differ across ranks: {sorted(lens)}"
    return parts


@settings(max_examples=40)
@given(layout=layouts(), batch=st.integers(1, 70), runs=st.integers(1, 4), prefetch=st.integers(0, 2),
       seed=SEEDS, epoch=st.integers(0, 3))
def test_ray_loader_epoch_visits_each_pixel_once(layout, batch, runs, prefetch, seed, epoch):
    sizes, world = layout
    with tempfile.TemporaryDirectory() as tmp:
        scene = _scene(Path(tmp), sizes)
        shards = [shard_range(scene.num_images, r, world) for r in range(world)]
        px = lambda r: int(sum(w * h for w, h in sizes[shards[r][0]:shards[r][1]]))  # noqa: E731

        def make(r):
            return RayLoader(scene, rays_per_batch=batch, rank=r, world_size=world, seed=seed, mode="epoch",
                             rays_per_run=runs * batch, prefetch=prefetch, num_threads=1)

        parts = _epoch_parts(make, world, epoch, px)
    assert_each_pixel_once(scene, parts, shards)


@st.composite
def streamed_layouts(draw):
    """A layout whose every shard has >= 3 images large enough (pixels * 3 well above the 104
    bytes of camera rows per image) that a budget of two one-image windows is below the shard."""
    world = draw(st.integers(1, 2))
    n = draw(st.integers(3 * world, 7))
    sizes = draw(st.lists(st.tuples(st.integers(9, 16), st.integers(8, 14)), min_size=n, max_size=n))
    return sizes, world


@settings(max_examples=15)
@given(layout=streamed_layouts(), batch=st.integers(1, 90), runs=st.integers(1, 3), seed=SEEDS,
       epoch=st.integers(0, 2), window=st.sampled_from([0, 1]))
def test_streamed_ray_loader_epoch_visits_each_pixel_once(layout, batch, runs, seed, epoch, window):
    """The windowed stream (cache.max_bytes below the shard: windows of ``window`` images, 0 =
    the most that fit) keeps the same contract."""
    sizes, world = layout
    shards = [shard_range(len(sizes), r, world) for r in range(world)]
    per = [[w * h * 3 + WINDOW_IMAGE_OVERHEAD for w, h in sizes[lo:hi]] for lo, hi in shards]
    need = [sum(w * h * 3 for w, h in sizes[lo:hi]) for lo, hi in shards]
    # one budget for all ranks: two windows of the largest image of any shard, below every shard
    max_bytes = max(2 * max(p) for p in per)
    assume(max_bytes < min(need))
    with tempfile.TemporaryDirectory() as tmp:
        scene = _scene(Path(tmp), sizes)

        def make(r):
            L = RayLoader(scene, rays_per_batch=batch, rank=r, world_size=world, seed=seed, mode="epoch",
                          rays_per_run=runs * batch, prefetch=1, num_threads=1, max_bytes=max_bytes,
                          window_images=window)
            assert L.streaming and L.window_images < len(per[r]), "the example was meant to stream"
            return L

        parts = _epoch_parts(make, world, epoch, lambda r: need[r] // 3)
    assert_each_pixel_once(scene, parts, shards)


@settings(max_examples=30)
@given(layout=layouts(), batch=st.integers(1, 70), seed=SEEDS, epoch=st.integers(0, 3),
       kind=st.sampled_from(["sync_local", "torch_workers"]))
def test_shard_baselines_epoch_visit_each_pixel_once(layout, batch, seed, epoch, kind):
    sizes, world = layout
    with tempfile.TemporaryDirectory() as tmp:
        scene = _scene(Path(tmp), sizes)
        shards = [shard_range(scene.num_images, r, world) for r in range(world)]
        caches = [decode_cache(scene, r, world) for r in range(world)]

        def make(r):
            kw = dict(rays_per_batch=batch, rank=r, world_size=world, seed=seed, mode="epoch", cache=caches[r])
            if kind == "torch_workers":
                return TorchWorkersSampler(scene, workers=0, **kw)
            return SyncLocalSampler(scene, **kw)

        parts = _epoch_parts(make, world, epoch, lambda r: caches[r].num_pixels)
    assert_each_pixel_once(scene, parts, shards)


@settings(max_examples=15)
@given(layout=layouts(), batch=st.integers(1, 40), seed=SEEDS, epoch=st.integers(0, 3))
def test_sync_global_epoch_rank_slices_visit_each_pixel_once(layout, batch, seed, epoch):
    """sync_global: rank 0's global stream (key: seed, rank 0), global batch G = B * W; rank r's
    batches are rows [r B, (r + 1) B); ``set_epoch(e)`` and ``len()`` = ceil((e+1)P/G) -
    ceil(eP/G) steps, epochs 0..e in turn (a step straddling a boundary is the earlier epoch's).
    Over epoch e's global positions [e P, (e + 1) P) the rank slices are disjoint and cover the
    split once."""
    sizes, world = layout
    G = batch * world
    with tempfile.TemporaryDirectory() as tmp:
        scene = _scene(Path(tmp), sizes)
        P = scene.num_pixels
        # the global batches, sampled as rank 0 samples them (world_size 1, B * W rays a step)
        starts, batches = [], []
        with SyncGlobalSampler(scene, rays_per_batch=G, seed=seed, mode="epoch") as glob:
            for e in range(epoch + 1):
                glob.set_epoch(e)
                for _ in range(len(glob)):
                    starts.append(glob.position)
                    batches.append(next(glob)["indices"].numpy())
    assert starts == [k * G for k in range(-(-(epoch + 1) * P // G))]
    # position of row i of global step k: k * G + i; keep the epoch's P positions
    parts = [np.concatenate([b[r * batch:(r + 1) * batch] for b in batches]) for r in range(world)]
    pos = [np.concatenate([s + np.arange(r * batch, (r + 1) * batch) for s in starts]) for r in range(world)]
    inside = [(q >= epoch * P) & (q < (epoch + 1) * P) for q in pos]
    assert_each_pixel_once(scene, [p[m] for p, m in zip(parts, inside)])
