"""Counter-based random numbers keyed by a ray's global stream position, vectorised in torch.

A training ray of the global stream (:class:`~dali_nerf.sources.RayLoader` with
``stream="global"``) is named by its global position ``g``, the same whichever rank samples it and
however many ranks there are. Its stratified jitter and its random background are drawn here as
pure functions of (key, g, j) — no generator, no state — so a run resumed on another world size
renders every ray with the same jitter as the uninterrupted run.

Every value lives in an int64 tensor as an unsigned 32-bit lane (in [0, 2^32)): the mixer's
multipliers are odd constants below 2^31, so each product is below 2^63 and no int64 operation
overflows (torch gives no unsigned 64-bit arithmetic on every device). The mixer is a 32-bit
xorshift-multiply finaliser (shifts 16, 15, 15; the multipliers of a low-bias 32-bit hash, the
second one reduced below 2^31); uniformity and independence across neighbouring positions and
samples are tested (tests/test_keyed.py).

>>> keys = ray_keys(0x1234_5678_9ABC_DEF0, torch.arange(4096))     # (B,) per-ray keys
>>> u = keyed_uniform(keys, 64)                                      # (B, 64) in [0, 1)
"""

from __future__ import annotations

import torch

__all__ = ["ray_keys", "keyed_uniform", "mix32"]

M32 = 0xFFFFFFFF
_A = 0x21F0AAAD  # < 2^31: a product with a 32-bit lane stays below 2^63
_B = 0x735A2D97  # < 2^31
_GOLDEN32 = 0x9E3779B9


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit finaliser of int64 tensors holding values in [0, 2^32) (a bijection of them)."""
    x = x ^ (x >> 16)
    x = (x * _A) & M32
    x = x ^ (x >> 15)
    x = (x * _B) & M32
    return x ^ (x >> 15)


def ray_keys(key: int, positions: torch.Tensor) -> torch.Tensor:
    """(B,) int64 32-bit keys of rays at global ``positions`` (B,) int64 >= 0 for the 64-bit
    ``key`` of a purpose (:func:`dali_nerf.data.seeds.ray_key`): distinct positions of one 2^32 block
    get distinct keys (each step is a bijection)."""
    p = positions.to(torch.int64)
    k0, k1 = int(key) & M32, (int(key) >> 32) & M32
    h = mix32((p & M32) ^ k0)
    return mix32(h ^ ((p >> 32) & M32) ^ k1)


def keyed_uniform(keys: torch.Tensor, n: int, dtype=torch.float32) -> torch.Tensor:
    """(B, n) uniforms in [0, 1) (24 bits: exact in float32), value j of row i a hash of
    (keys[i], j); ``keys`` (B,) int64 from :func:`ray_keys`, on any device."""
    j = torch.arange(1, int(n) + 1, device=keys.device, dtype=torch.int64) * _GOLDEN32  # j < 2^31: no overflow
    x = mix32((keys[:, None] + j[None, :]) & M32)
    return (x >> 8).to(dtype) * (1.0 / (1 << 24))
