"""Numpy reference of the operator's global stream (the op's ``global_pixels`` > 0).

The stream is defined by the seed, the mode and the split's image sizes alone (ARCHITECTURE.md,
"The operator", "Global stream"): the split's images in split order, pixel ids their row-major
concatenation (image ``i`` at offset ``off_i`` with ``n_i = width_i * height_i`` pixels, ``P`` in
all). Global position ``g >= 0``: epoch ``e = g // P``, ``h = g % P``;

* level 1, slot ``q = (a h + b_e) mod P`` with ``a = weyl_multiplier(P)`` and ``b_e`` a hash of
  (key, e): a bijection of [0, P) per epoch whose windows of G consecutive positions hit every
  pixel range of measure ``mu`` about ``G mu`` times (a Weyl sequence with bounded partial
  quotients);
* level 2, the image ``i`` holding slot ``q`` and ``t = q - off_i``: ``epoch`` mode gives pixel
  ``off_i + F(t)``, F a keyed Feistel bijection of [0, n_i) per (image, epoch); ``random`` mode
  gives ``off_i + hash(key, g) mod n_i`` (iid within the image the slot chose).

Every pixel is visited exactly once per epoch; global batch ``k`` of ``G`` positions is
``[k G, (k + 1) G)`` whatever the world size. A DDP rank whose cache holds the split's pixels
``[lo, hi)`` (a contiguous image range, DALI's shard rule) keeps the positions whose slot lies
there (:func:`kept`), in position order: that is what the op outputs for that cache, ray for ray.

Masked splits (the op's ``valid`` input): the same stream over the split's *valid* pixels, image
``i`` holding ``v_i`` of them (``sizes`` = the valid counts), gives valid-pixel numbers; the k-th
valid pixel of the split (in pixel order) is the ray's pixel (:func:`masked_pixels`). A rank
keeps the positions whose slot lies in its shard's valid range.

This module is the specification the C++ operator is tested against bit for bit
(tests/test_op_global.py); it is also usable by a loader that needs the global batch in numpy
(``pixels(seed, mode, sizes, np.arange(k * G, (k + 1) * G))``).

>>> sizes = np.array([35, 144, 660])
>>> ids = pixels(0, "epoch", sizes, np.arange(839))
>>> bool((np.sort(ids) == np.arange(839)).all())
True
"""

from __future__ import annotations

from functools import lru_cache
from math import isqrt

import numpy as np

from dali_nerf.data.seeds import op_global_key
from dali_nerf.ops.limits import shard_range

__all__ = ["MODES", "weyl_multiplier", "global_key", "epoch_shifts", "slots", "pixels", "masked_pixels", "kept",
           "step_counts", "shard_pixel_range"]

MODES = {"random": 0, "epoch": 1}
"""The op's ``mode`` argument -> the mode number of the stream keys."""

_U = np.uint64
_GOLDEN = 0x9E3779B97F4A7C15
_SHIFT_SALT = 0x5BE0CD19137E2179
_IMAGE_SALT = 0x510E527FADE682D1
_EPOCH_SALT = 0xA54FF53A5F1D36F1  # streams.h EpochPerm::init


def _worst_quotient(a: int, P: int) -> int:
    """The largest partial quotient of the continued fraction of P / a; 0 when gcd(a, P) > 1."""
    u, v, m = P, a, 0
    while v:
        q, t = divmod(u, v)
        m = max(m, q)
        u, v = v, t
    return m if u == 1 else 0


@lru_cache(maxsize=256)
def weyl_multiplier(P: int) -> int:
    """``a``: near ``P (sqrt(5) - 1) / 2``, coprime with P, every partial quotient of P / a at most
    B: the first such a of a0, a0 + 1, a0 - 1, a0 + 2, ... (a0 the nearest integer) inside [1, P)
    and ``|a - a0| < min(P, 2^16)``, for B = 5, 10, 20, ...; 0 for P = 1. Bounded partial
    quotients keep the count of every window of G positions in a pixel range of measure mu within
    a few of ``G mu``.

    >>> weyl_multiplier(839), weyl_multiplier(1016)
    (519, 627)
    """
    if P <= 1:
        return 0
    a0 = (isqrt(5 * P * P) - P + 1) // 2
    radius = min(P, 1 << 16)
    bound = 5
    while True:
        for d in range(radius):
            for a in ((a0,) if d == 0 else (a0 + d, a0 - d)):
                if 1 <= a < P and 0 < _worst_quotient(a, P) <= bound:
                    return a
        bound *= 2


def global_key(seed: int, mode: str) -> int:
    """The stream's 64-bit key (:func:`dali_nerf.data.seeds.op_global_key`)."""
    return op_global_key(seed, MODES[mode])


def _mix(z) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping)."""
    z = np.array(z, _U, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> _U(30)
        z *= _U(0xBF58476D1CE4E5B9)
        z ^= z >> _U(27)
        z *= _U(0x94D049BB133111EB)
        z ^= z >> _U(31)
    return z


def _mulhi(a, b) -> np.ndarray:
    """High 64 bits of a * b, elementwise (uint64)."""
    a, b = np.asarray(a, _U), np.asarray(b, _U)
    m = _U(0xFFFFFFFF)
    al, ah, bl, bh = a & m, a >> _U(32), b & m, b >> _U(32)
    with np.errstate(over="ignore"):
        ll, hl, lh, hh = al * bl, ah * bl, al * bh, ah * bh
        cross = (ll >> _U(32)) + (hl & m) + lh
        return hh + (hl >> _U(32)) + (cross >> _U(32))


def _mulmod(a: int, h: np.ndarray, P: int) -> np.ndarray:
    """``a * h mod P`` elementwise for h < P <= 2^62 (double-and-add over the bits of h)."""
    h = np.asarray(h, _U)
    r = np.zeros(h.shape, _U)
    x = a % P
    for bit in range(int(P - 1).bit_length()):
        sel = ((h >> _U(bit)) & _U(1)).astype(bool)
        r[sel] += _U(x)
        r[r >= _U(P)] -= _U(P)
        x = (2 * x) % P
    return r


def epoch_shifts(key: int, epochs, P: int) -> np.ndarray:
    """``b_e``: the slot of position ``e P`` of each epoch, uniform in [0, P) (uint64)."""
    e = np.asarray(epochs, _U)
    with np.errstate(over="ignore"):
        return _mulhi(_mix(_U(key) ^ _mix(e + _U(_SHIFT_SALT))), P)


def slots(key: int, P: int, g) -> np.ndarray:
    """Slot ``q`` of each global position g: (n,) int64 in [0, P)."""
    g = np.asarray(g, np.int64)
    e, h = (g // P).astype(_U), (g % P).astype(_U)
    q = _mulmod(weyl_multiplier(P), h, P) + epoch_shifts(key, e, P)
    q[q >= _U(P)] -= _U(P)
    return q.astype(np.int64)


def _feistel_perm(keys: np.ndarray, epochs: np.ndarray, n: np.ndarray, t: np.ndarray) -> np.ndarray:
    """streams.h ``EpochPerm``: the keyed bijection of [0, n) (per element: key, epoch, n) at t."""
    bits = np.full(n.shape, 2, np.int64)  # the least b >= 2 with 2^b >= n
    while ((np.int64(1) << bits) < n).any():
        bits += (np.int64(1) << bits) < n
    with np.errstate(over="ignore"):
        ek = _mix(keys.astype(_U) ^ _mix(epochs.astype(_U) + _U(_EPOCH_SALT)))
        rk = [_mix(ek + _U(_GOLDEN) * _U(r + 1)) for r in range(4)]

    def feistel(x, rks, b):
        lb, hb = (b // 2).astype(_U), (b - b // 2).astype(_U)
        one = _U(1)
        for r in range(4):
            lo, hi = x & ((one << lb) - one), x >> lb
            x = (lo << hb) | ((hi ^ _mix(lo ^ rks[r])) & ((one << hb) - one))
            lb, hb = hb, lb
        return x

    n = n.astype(_U)
    x = feistel(t.astype(_U), rk, bits)
    bad = x >= n
    while bad.any():  # cycle-walking
        x[bad] = feistel(x[bad], [k[bad] for k in rk], bits[bad])
        bad = x >= n
    return x.astype(np.int64)


def pixels(seed: int, mode: str, sizes, g) -> np.ndarray:
    """Global pixel id of each global position.

    Args:
        seed: the stream seed; mode: "random" | "epoch".
        sizes: (N,) pixels of each image of the split, in split order (width * height).
        g: (n,) global positions >= 0.
    Returns:
        (n,) int64 pixel ids of the split (row-major concatenation of its images).

    >>> pixels(3, "random", [6, 10], [0, 1, 2]).shape
    (3,)
    """
    sizes = np.asarray(sizes, np.int64)
    g = np.asarray(g, np.int64)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    P = int(offs[-1])
    key = global_key(seed, mode)
    q = slots(key, P, g)
    img = np.searchsorted(offs, q, side="right") - 1
    off, n = offs[img], sizes[img]
    t = q - off
    if mode == "epoch":
        with np.errstate(over="ignore"):
            ikeys = _mix(_U(key) ^ _mix(off.astype(_U) + _U(_IMAGE_SALT)))
        return off + _feistel_perm(ikeys, g // P, n, t)
    with np.errstate(over="ignore"):
        h = _mix(_U(key) + (g.astype(_U) + _U(1)) * _U(_GOLDEN))
    return off + _mulhi(h, n.astype(_U)).astype(np.int64)


def masked_pixels(seed: int, mode: str, valid, sizes, g) -> np.ndarray:
    """Global pixel id of each global position of a masked split.

    Args:
        valid: (P,) bool, the split's pixels (images in split order, row-major) that may be drawn.
        sizes: (N,) pixels of each image (width * height), summing to P.
        g: (n,) global positions >= 0.
    Returns:
        (n,) int64 pixel ids of the split, all valid: :func:`pixels` over the images' valid
        counts gives valid-pixel numbers, and number k is the split's k-th valid pixel.

    >>> masked_pixels(3, "epoch", [1, 0, 1, 1, 0, 1], [2, 4], [0, 1, 2, 3]).tolist()
    [2, 5, 0, 3]
    """
    valid = np.asarray(valid, bool).reshape(-1)
    sizes = np.asarray(sizes, np.int64)
    ends = np.cumsum(sizes)
    counts = np.diff(np.concatenate([[0], np.cumsum(valid)[ends - 1]]))
    return np.flatnonzero(valid)[pixels(seed, mode, counts, g)]


def kept(seed: int, mode: str, P: int, g, lo: int, hi: int) -> np.ndarray:
    """(n,) bool: the positions a cache holding the split's pixels [lo, hi) keeps."""
    q = slots(global_key(seed, mode), P, g)
    return (q >= lo) & (q < hi)


def step_counts(seed: int, mode: str, P: int, lo: int, hi: int, start: int, step_positions: int,
                steps: int) -> np.ndarray:
    """(steps,) int64: positions kept by the cache [lo, hi) in each step of a run starting at
    ``start`` (a multiple of ``step_positions``)."""
    g = np.arange(start, start + steps * step_positions, dtype=np.int64)
    return kept(seed, mode, P, g, lo, hi).reshape(steps, step_positions).sum(1).astype(np.int64)


def shard_pixel_range(sizes, rank: int, world_size: int) -> tuple[int, int]:
    """Global pixel range [lo, hi) of DALI's image shard ``rank`` of ``world_size``
    (:func:`dali_nerf.ops.limits.shard_range`: images ``[N r // W, N (r + 1) // W)``).

    >>> shard_pixel_range([5, 7, 9], 1, 2)
    (5, 21)
    """
    sizes = np.asarray(sizes, np.int64)
    a, b = shard_range(len(sizes), rank, world_size)
    return int(sizes[:a].sum()), int(sizes[:b].sum())
