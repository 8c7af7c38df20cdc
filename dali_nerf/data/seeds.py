"""Every stream key and sub-seed of a run, derived in one place from (seed, purpose, rank, cell,
epoch / cycle, window, step).

Nothing else in the package mixes seeds: each function below is one *purpose*, and its formula is
the one the project has always used (changing one changes every stream or trajectory that uses
it, so a change of formula is a behaviour change to record, never a refactor).

================= ================================================ ==============================
purpose           function                                         used by
================= ================================================ ==============================
process RNGs      :func:`process_seed` (seed, rank)                training: torch/numpy/random
model init        :func:`init_seed` (seed[, cell])                 trainers: ``torch.manual_seed``
render jitter     :func:`step_seed` (seed, rank, step, cell)       training: per-step generator
per-ray draws     :func:`ray_key` (seed, purpose)                  training, global stream: jitter /
                                                                   background keyed by position
window order      :func:`window_order_keys` (seed, rank, cycle)    sources.streaming: window_plan
window stream     :func:`window_key` (seed, rank, cycle, window)   sources.streaming: the op's seed
baseline blocks   :func:`block_seed` (seed, stream, position)      sources.sync: random mode
baseline epochs   :func:`perm_seed` (seed, stream, epoch)          sources.sync: epoch mode
routed baselines  :func:`routed_stream` (cell | slot)              sources.sync: the stream id
operator          :func:`op_stream_key` (seed, rank, ws, mode)     the op, in C++ (mirror here)
global stream     :func:`op_global_key` (seed, mode)               the op with ``global_pixels``
image order       :func:`image_order_keys` (seed, epoch, n)        sources.imageorder: epoch order
image patches     :func:`patch_draws` (seed, positions, axis)      sources.imageorder: crop offsets
================= ================================================ ==============================

The operator's stream key is computed inside the C++ operator (``dali_nerf/ops/csrc``) from its
``seed``, ``rank``, ``world_size`` and ``mode`` arguments; :func:`op_stream_key` is its Python
mirror, checked against the operator's output by ``tests/test_op.py``. The DDP ray stream passes
(seed, rank, world_size); a streaming window passes ``window_key(...)`` as the op's seed; the SS
stream of cell j passes (seed, rank=j, world_size=number of cells). The split's global stream
(the op's ``global_pixels`` > 0, :mod:`dali_nerf.ops.reference`) is keyed by
:func:`op_global_key` (seed, mode): no rank, no world size.

>>> step_seed(0, 0, 1) == step_seed(0, 0, 1)
True
>>> window_key(0, 0, 0, 0) < 2**63
True
"""

from __future__ import annotations

import numpy as np

__all__ = ["mix64", "mix63", "process_seed", "init_seed", "step_seed", "ray_key", "window_order_keys", "window_key",
           "block_seed", "perm_seed", "routed_stream", "op_stream_key", "op_global_key", "splitmix_finalise",
           "image_order_keys", "patch_draws"]

M64 = (1 << 64) - 1
M63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix_finalise(z: int) -> int:
    """splitmix64's finaliser of one 64-bit value (the op's ``mix64``)."""
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def mix64(*vals: int) -> int:
    """64-bit counter-based hash of a tuple of non-negative ints (splitmix64 finaliser per value)."""
    h = _GOLDEN
    for v in vals:
        h = (h ^ (int(v) & M64)) & M64
        h = (h + _GOLDEN) & M64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & M64
        h ^= h >> 31
    return h


def mix63(*vals: int) -> int:
    """:func:`mix64` as a non-negative 63-bit seed (fits torch's and the op's int64 seed)."""
    return mix64(*vals) & M63


# ---- training -------------------------------------------------------------------------------

def process_seed(seed: int, rank: int) -> int:
    """Seed of a rank's torch / numpy / python RNGs (``training.seed_everything``)."""
    return (seed * 1000003 + rank) % (2**31)


def init_seed(seed: int, cell: int | None = None) -> int:
    """``torch.manual_seed`` before building a field: the DDP replica (identical on every rank)
    or the SS sub-model of ``cell``. A value of 2**64 or more (a seed above ~1.8e16, which
    ``torch.manual_seed`` refused) is reduced mod 2**64; every value that worked is unchanged."""
    if cell is None:
        return seed
    v = seed * 1009 + cell
    return v if v < 2**64 else v % 2**64


def step_seed(seed: int, rank: int, step: int, cell: int = -1) -> int:
    """Seed of the per-step sampling-jitter generator: a pure function of (seed, rank, step, cell),
    so resumed runs and prefetching do not change training."""
    return (seed * 6364136223846793005 + (rank + 1) * 1442695040888963407 + step * 97 + (cell + 1) * 7919) % (2**63)


RAY_PURPOSES = {"jitter": 1, "background": 2}
"""The per-ray draws of a training step of the global stream."""


def ray_key(seed: int, purpose: str) -> int:
    """64-bit key of a per-ray draw (``jitter``: the stratified samples; ``background``: a random
    background colour) of the global stream: the ray's draw is a hash of (this key, its global
    position, j) (:func:`dali_nerf.models.keyed.ray_keys`), so it is the same on any rank of
    any world size."""
    return mix64(seed, 0x72617973, RAY_PURPOSES[purpose])  # 0x72617973: "rays"


# ---- streaming windows ----------------------------------------------------------------------

def window_order_keys(seed: int, rank: int, cycle: int, image_ids) -> np.ndarray:
    """(N,) uint64 sort keys of a shard's images in cycle ``cycle`` (their shuffle)."""
    return np.array([mix64(seed, rank, cycle, int(i)) for i in image_ids], np.uint64)


def window_key(seed: int, rank: int, cycle: int, window: int) -> int:
    """The op's seed for window ``window`` of cycle ``cycle`` of rank ``rank``'s stream."""
    return mix63(seed, rank, cycle, window)


# ---- synchronous baselines ------------------------------------------------------------------

def block_seed(seed: int, stream: int, position: int) -> int:
    """Generator seed of the baselines' random-mode block starting at stream ``position``."""
    return mix63(seed, stream, position, 0)


def perm_seed(seed: int, stream: int, epoch: int) -> int:
    """Generator seed of the baselines' epoch-mode permutation ``epoch``."""
    return mix63(seed, stream, epoch, 1)


def routed_stream(cell: int | None = None, slot: int | None = None, workers_cell: int | None = None) -> int:
    """Stream id of a routed (SS) baseline: the cell's own (sync_local: ``cell``), rank 0's shared
    candidate stream of slot ``slot`` (sync_global: ``10_000 + slot``), or the cell's stream of the
    worker-process source (torch_workers: ``20_000 + workers_cell``)."""
    given = [v for v in (cell, slot, workers_cell) if v is not None]
    if len(given) != 1:
        raise ValueError("routed_stream: give exactly one of cell, slot, workers_cell")
    if cell is not None:
        return int(cell)
    return 10_000 + int(slot) if slot is not None else 20_000 + int(workers_cell)


# ---- the operator (mirror of the C++ stream_key) ------------------------------------------------

def op_stream_key(seed: int, rank: int, world_size: int, mode: int) -> int:
    """The operator's stream key (computed in C++; mode 0 = random, 1 = epoch)."""
    k = splitmix_finalise((seed & M64) ^ 0x6A09E667F3BCC908)
    k = splitmix_finalise(k + _GOLDEN * (rank + 1))
    k = splitmix_finalise(k ^ ((0xBB67AE8584CAA73B * (world_size + 1)) & M64))
    return splitmix_finalise(k + mode * 0x3C6EF372FE94F82B)


def op_global_key(seed: int, mode: int) -> int:
    """The operator's key of the split's global stream (computed in C++, ``detail::global_key``):
    the seed and the mode (0 = random, 1 = epoch) alone, so every world size gets the same stream."""
    return splitmix_finalise(op_stream_key(seed, 0, 1, mode) + 0x1F83D9ABFB41BD6B)


# ---- image batches (splatting trainers) -----------------------------------------------------

def _splitmix_np(z: np.ndarray) -> np.ndarray:
    """:func:`splitmix_finalise` over a uint64 array (wrapping arithmetic)."""
    z = z.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def image_order_keys(seed: int, epoch: int, n: int) -> np.ndarray:
    """(n,) uint64 sort keys of a split's n images in epoch ``epoch`` of the image stream: the
    epoch's order is their stable argsort (a function of the seed and the epoch alone)."""
    k = np.uint64(mix64(seed, 0x696D6167, epoch))  # 0x696d6167: "imag"
    with np.errstate(over="ignore"):
        return _splitmix_np(np.arange(n, dtype=np.uint64) * np.uint64(_GOLDEN) + k)


def patch_draws(seed: int, positions, axis: int) -> np.ndarray:
    """(len(positions),) uint64 draws of the patch offset along ``axis`` (0: x, 1: y) of the
    image at each global stream position (a hash of the seed, the position and the axis)."""
    k = np.uint64(mix64(seed, 0x70617463, axis))  # 0x70617463: "patc"
    with np.errstate(over="ignore"):
        return _splitmix_np(np.asarray(positions, np.uint64) * np.uint64(0xD1B54A32D192ED03) ^ k)
