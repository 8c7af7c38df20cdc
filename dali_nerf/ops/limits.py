"""The operator's limits and the shard rule its global stream assumes: what the C++ op and DALI fix,
stated once, low in the house, for every layer that checks a value against them (the config, the
sources, the ray graph, the op's numpy reference).

>>> INT32_MAX, MAX_CELLS, shard_range(7, 1, 3)
(2147483647, 64, (2, 4))
"""

from __future__ import annotations

__all__ = ["INT32_MAX", "INT64_MAX", "MAX_CELLS", "RAY_BYTES", "shard_range"]

INT32_MAX = 2**31 - 1
"""Largest value of the op's ``int`` arguments (``rays``, ``stream``, ``num_streams``, ...)."""
INT64_MAX = 2**63 - 1
"""Largest value of the op's ``int64_t`` arguments (``seed``, ``start``)."""
MAX_CELLS = 64
"""Most centroids one routed op accepts (``kMaxCells`` in ``dali_nerf/ops/csrc/ray_math.h``)."""
RAY_BYTES = 3 * 4 + 3 * 4 + 3 * 4 + 3 * 8 + 4 + 4
"""Bytes of one output ray (origins, directions, rgb f32 x3, indices i64 x3, near, far f32)."""


def shard_range(num_items: int, rank: int, world_size: int) -> tuple[int, int]:
    """DALI's shard rule (``readers.file`` with ``shard_id`` / ``num_shards``): ``[floor(rank * N /
    S), floor((rank + 1) * N / S))``; a DDP rank's image shard, whose pixels the op's global stream
    keeps.

    >>> shard_range(7, 1, 3)
    (2, 4)
    """
    return (num_items * rank) // world_size, (num_items * (rank + 1)) // world_size
