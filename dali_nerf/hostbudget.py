"""The host's CPU budget per rank: sampler threads and run size that fit the cores a rank gets.

A rank's loader threads share the host's cores with every other rank on the node. Measured on a
2-core machine (issue 14): 16 co-located ranks, each a RayLoader with its defaults (2 DALI
threads, 262144 rays per run), stepped in 5.26 ms against a 2.17 ms floor while their time in
``next()`` was 3.4% — the loaders' bursts slowed the training processes outside ``next()``; with 1
thread and 65536 rays per run the same ranks stepped in 2.93 ms. So threads and run size follow
the cores per local rank:

* ``cores_per_rank`` = usable cores (``os.sched_getaffinity``) / local ranks (``LOCAL_WORLD_SIZE``);
* ``threads`` = ``cores_per_rank - 1`` (one core's worth left to the rank's own thread: the
  training loop, the host side of device work), at least 1, at most ``max_threads``;
* ``rays_per_run`` = ``RAYS_PER_THREAD`` x threads, a multiple of the batch, at most ``max_run``:
  one run occupies the threads for a bounded time (a short burst) whatever the thread count.

>>> host_budget(4096, local_ranks=16, cores=2)
HostBudget(cores=2, local_ranks=16, cores_per_rank=0.125, threads=1, rays_per_run=65536)
>>> host_budget(4096, local_ranks=8, cores=32).threads
3
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .errors import ConfigError

__all__ = ["HostBudget", "host_budget", "loader_budget", "usable_cores", "local_world_size", "RAYS_PER_THREAD"]

RAYS_PER_THREAD = 65536
"""Rays per DALI run per sampler thread (the run size measured best with 1 thread, 16 ranks on 2 cores)."""


@dataclass(frozen=True)
class HostBudget:
    cores: int
    """Usable cores of this process (its CPU affinity)."""
    local_ranks: int
    """Ranks sharing those cores (LOCAL_WORLD_SIZE under torchrun)."""
    cores_per_rank: float
    """cores / local_ranks."""
    threads: int
    """Sampler threads for this rank's loader (DALI num_threads, torch_workers workers)."""
    rays_per_run: int
    """Rays per DALI run (a multiple of the batch)."""


def usable_cores() -> int:
    """Cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where unsupported)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def local_world_size() -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` (set by torchrun), else 1."""
    v = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        n = int(v)
    except ValueError:
        raise ConfigError(f"LOCAL_WORLD_SIZE={v!r}: must be an integer >= 1 (set by torchrun)") from None
    if n < 1:
        raise ConfigError(f"LOCAL_WORLD_SIZE={v!r}: must be an integer >= 1 (set by torchrun)")
    return n


def host_budget(rays_per_batch: int, local_ranks: Optional[int] = None, cores: Optional[int] = None,
                max_threads: int = 4, max_run: int = 262144) -> HostBudget:
    """Sampler threads and rays per run for one rank (see the module docstring for the rule).

    Args:
        rays_per_batch: B, rays per step of this rank.
        local_ranks: ranks sharing the cores (default: :func:`local_world_size`).
        cores: usable cores (default: :func:`usable_cores`).
        max_threads: cap on threads per rank; max_run: cap on rays per run (rounded up to B).
    """
    if int(rays_per_batch) < 1:
        raise ConfigError(f"rays_per_batch={rays_per_batch!r}: must be >= 1")
    n = local_world_size() if local_ranks is None else int(local_ranks)
    c = usable_cores() if cores is None else int(cores)
    if n < 1 or c < 1:
        raise ConfigError(f"host_budget: local_ranks and cores must be >= 1, got {n}, {c}")
    per = c / n
    threads = int(max(1, min(int(max_threads), int(per) - 1)))
    B = int(rays_per_batch)
    run = max(B, min(int(max_run), RAYS_PER_THREAD * threads))
    run = -(-run // B) * B
    return HostBudget(c, n, per, threads, run)


def loader_budget(rays_per_batch: int, num_threads: Optional[int] = None,
                  rays_per_run: Optional[int] = None) -> tuple:
    """(threads, rays_per_run) for a loader: the given values where set (> 0), else this host's
    :func:`host_budget` (the loaders' and ``pipeline.num_threads`` / ``pipeline.rays_per_run``
    default: 0 or None = auto)."""
    if num_threads and rays_per_run:
        return int(num_threads), int(rays_per_run)
    b = host_budget(rays_per_batch)
    return int(num_threads or b.threads), int(rays_per_run or b.rays_per_run)
