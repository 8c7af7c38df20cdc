"""The image stream of the splatting trainers: which image, and which patch of it, each global
position holds (pure functions of the seed; no state, no I/O).

* Global position ``g`` of a split of ``N`` images: epoch ``e = g // N``, the image at
  ``order_e[g % N]``, ``order_e`` the stable argsort of :func:`~dali_nerf.data.seeds.image_order_keys`
  (seed, e): every image exactly once per epoch, an order defined by the seed alone.
* Global step ``k`` of a run with ``B`` images per rank on ``W`` ranks that started at position
  ``s`` holds positions ``[s + k G, s + (k + 1) G)``, ``G = B W``; rank ``r`` takes
  ``[s + k G + r B, s + k G + (r + 1) B)``. A resume on W' ranks starts at the saved position:
  the stream, hence each epoch's coverage, continues exactly.
* Windows (memory): epoch e's positions cut into ``ceil(N / M)`` near-equal runs
  (:func:`window_bounds`); window ``(e, j)`` holds the images of its run. The order does not depend
  on the window size M: a window only decides which images are decoded together and when.
* Patches (``patch_size`` p): the image at position g is cropped at ``x = draw_x(g) mod max(w - p,
  1)``, ``y = draw_y(g) mod max(h - p, 1)`` (gsplat's range: ``np.random.randint(0, max(w - p, 1))``),
  draws :func:`~dali_nerf.data.seeds.patch_draws`; its principal point shifted by (x, y).

>>> st = ImageStream(10, seed=0); st.images(np.arange(10)).tolist() == sorted(...)  # a permutation
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from dali_nerf.data.seeds import image_order_keys, patch_draws

__all__ = ["ImageStream", "window_bounds", "step_positions", "patch_offsets", "IMAGE_STREAM"]

IMAGE_STREAM = "images-v1"
"""The formula's version, recorded in states and checkpoints."""


class ImageStream:
    """Position -> image of a split of ``n`` images (module doc); keeps the orders of the last
    few epochs it was asked for."""

    def __init__(self, n: int, seed: int):
        if n <= 0:
            raise ValueError("ImageStream: the split has no images")
        self.n, self.seed = int(n), int(seed)
        self._orders: Dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """(n,) int64: the images of ``epoch`` in stream order."""
        if epoch not in self._orders:
            if len(self._orders) >= 4:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = np.argsort(image_order_keys(self.seed, epoch, self.n), kind="stable").astype(np.int64)
        return self._orders[epoch]

    def images(self, positions) -> np.ndarray:
        """(len(positions),) int64 split indices of the images at global ``positions``."""
        pos = np.asarray(positions, np.int64)
        out = np.empty(len(pos), np.int64)
        for e in np.unique(pos // self.n):
            sel = pos // self.n == e
            out[sel] = self.order(int(e))[pos[sel] % self.n]
        return out


def window_bounds(n: int, window: int) -> np.ndarray:
    """(k + 1,) int64 position offsets within an epoch of its ``k = ceil(n / window)`` windows,
    near-equal (sizes differ by at most one, larger first: ``np.array_split``'s rule)."""
    k = -(-int(n) // max(1, int(window)))
    sizes = np.full(k, n // k, np.int64)
    sizes[: n % k] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def step_positions(start: int, step: int, images_per_batch: int, world_size: int, rank: int) -> np.ndarray:
    """(B,) global positions rank ``rank`` takes at step ``step`` of a run started at ``start``."""
    b = int(images_per_batch)
    first = int(start) + int(step) * b * int(world_size) + int(rank) * b
    return np.arange(first, first + b, dtype=np.int64)


def patch_offsets(seed: int, positions, widths, heights, patch: int):
    """((B,) x, (B,) y) int64 patch corners of the images at ``positions`` of sizes ``widths`` x
    ``heights`` (module doc)."""
    pos = np.asarray(positions, np.int64)
    rx = np.maximum(np.asarray(widths, np.int64) - patch, 1).astype(np.uint64)
    ry = np.maximum(np.asarray(heights, np.int64) - patch, 1).astype(np.uint64)
    return (patch_draws(seed, pos, 0) % rx).astype(np.int64), (patch_draws(seed, pos, 1) % ry).astype(np.int64)
