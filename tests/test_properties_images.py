"""Property tests of the image stream (dali_nerf/data/imageorder.py): for any split size, world
size W, images per rank B, resume step and new W' and B', the ranks' batches, step after step,
hold every image exactly once per epoch; windows only group positions; patches stay in gsplat's
range."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from dali_nerf.data.imageorder import ImageStream, patch_offsets, step_positions, window_bounds


@settings(max_examples=200)
@given(n=st.integers(1, 40), w=st.integers(1, 5), b=st.integers(1, 4), resume=st.integers(0, 30),
       w2=st.integers(1, 5), b2=st.integers(1, 4), seed=st.integers(0, 2**63 - 1))
def test_every_image_once_per_epoch_across_ranks_and_an_elastic_resume(n, w, b, resume, w2, b2, seed):
    stream = ImageStream(n, seed)
    got = []
    for k in range(resume):  # W ranks, B images each, step by step
        for r in range(w):
            got += stream.images(step_positions(0, k, b, w, r)).tolist()
    start = resume * b * w  # the saved position; W' ranks with B' continue from it
    k = 0
    while len(got) < 3 * n + resume * b * w:
        for r in range(w2):
            got += stream.images(step_positions(start, k, b2, w2, r)).tolist()
        k += 1
    for e in range(len(got) // n):
        assert sorted(got[e * n:(e + 1) * n]) == list(range(n)), e


@settings(max_examples=100)
@given(n=st.integers(1, 500), window=st.integers(1, 600))
def test_windows_cut_an_epoch_into_near_equal_runs(n, window):
    b = window_bounds(n, window)
    sizes = np.diff(b)
    assert b[0] == 0 and b[-1] == n and sizes.max() <= max(window, 1) and sizes.max() - sizes.min() <= 1
    assert len(sizes) == -(-n // window)


@settings(max_examples=100)
@given(w=st.integers(1, 300), h=st.integers(1, 300), p=st.integers(1, 300), seed=st.integers(0, 2**63 - 1))
def test_patch_corners_in_gsplats_range(w, h, p, seed):
    pos = np.arange(50)
    x, y = patch_offsets(seed, pos, np.full(50, w), np.full(50, h), p)
    assert (x >= 0).all() and (x < max(w - p, 1)).all() and (y >= 0).all() and (y < max(h - p, 1)).all()
    x2, _ = patch_offsets(seed, pos, np.full(50, w), np.full(50, h), p)
    assert np.array_equal(x, x2)  # a function of (seed, position)
