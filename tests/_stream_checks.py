"""Coverage checks of epoch streams, shared by the tests that claim "every pixel exactly once".

A stream's epoch is given as one part per rank: the (cam, row, col) index rows the rank received
for the epoch's positions. :func:`assert_each_pixel_once` checks the parts against the split:
every pixel of the split in exactly one part, exactly once, nothing out of range; with
``shards``, also that each part is exactly its rank's image shard. It does not care how the
positions were split among ranks, so a global stream cut into per-rank slices is checked by the
same function as per-rank shard streams.

>>> assert_each_pixel_once(scene, [idx_rank0, idx_rank1], shards=[(0, 3), (3, 5)])
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

__all__ = ["pixel_ids", "assert_each_pixel_once"]


def pixel_ids(width, height, idx) -> np.ndarray:
    """(n, 3) (cam, row, col) -> (n,) int64 pixel ids over the split (image-major, row-major),
    asserting every row names a pixel that exists. ``width``, ``height``: (N,) image sizes."""
    w = np.asarray(width, np.int64)
    h = np.asarray(height, np.int64)
    idx = np.asarray(idx, np.int64).reshape(-1, 3)
    cam, row, col = idx.T
    assert ((cam >= 0) & (cam < len(w))).all(), f"camera index out of range: {cam[(cam < 0) | (cam >= len(w))][:5]}"
    bad = (row < 0) | (row >= h[cam]) | (col < 0) | (col >= w[cam])
    assert not bad.any(), f"{int(bad.sum())} rows name pixels outside their image, e.g. {idx[bad][:3].tolist()}"
    offsets = np.concatenate([[0], np.cumsum(w * h)])
    return offsets[cam] + row * w[cam] + col


def assert_each_pixel_once(scene, parts: Sequence[np.ndarray], shards: Optional[Sequence[tuple]] = None) -> None:
    """Every pixel of ``scene`` (a Scene, or anything with ``width``/``height`` (N,)) appears in
    exactly one of ``parts`` (per rank, (n_r, 3) (cam, row, col)), exactly once; ``shards``
    (optional, per rank: (lo, hi) image range) also requires part r to be exactly the pixels of
    images [lo, hi)."""
    w = np.asarray(scene.width, np.int64)
    h = np.asarray(scene.height, np.int64)
    P = int((w * h).sum())
    ids = [pixel_ids(w, h, p) for p in parts]
    counts = np.bincount(np.concatenate(ids) if ids else np.zeros(0, np.int64), minlength=P)
    missing, twice = np.flatnonzero(counts == 0), np.flatnonzero(counts > 1)
    assert len(missing) == 0 and len(twice) == 0, (
        f"{P} pixels: {len(missing)} never visited (e.g. {missing[:5].tolist()}), {len(twice)} visited more than "
        f"once (e.g. {twice[:5].tolist()}); part sizes {[len(i) for i in ids]}")
    if shards is not None:
        offsets = np.concatenate([[0], np.cumsum(w * h)])
        assert len(shards) == len(ids)
        for r, ((lo, hi), pid) in enumerate(zip(shards, ids)):
            assert np.array_equal(np.sort(pid), np.arange(offsets[lo], offsets[hi])), (
                f"rank {r}: its {len(pid)} pixels are not exactly those of its shard, images [{lo}, {hi})")
