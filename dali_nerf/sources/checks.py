"""The argument checks every batch source shares: one-line ConfigErrors naming the argument and its
range (the ranges are the op's argument types, :data:`dali_nerf.pipelines.rays.OP_ARGS`), before
anything is decoded or built.
"""

from __future__ import annotations

import numpy as np

from dali_nerf.data.imagecache import available_memory
from dali_nerf.errors import ConfigError
from dali_nerf.ops.limits import INT32_MAX, INT64_MAX, RAY_BYTES

__all__ = ["MAX_PREFETCH", "check_int", "check_positive", "check_run_size", "check_cache_device", "check_common"]

MAX_PREFETCH = 1024
"""Largest ``prefetch`` (DALI's ``prefetch_queue_depth``) a source accepts."""


def check_int(name, v, lo: int, hi: int) -> None:
    """ConfigError (one line naming ``name`` and the range) unless ``v`` is an integer in [lo, hi]."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise ConfigError(f"{name}={v!r}: must be an integer in [{lo}, {hi}]")


def check_positive(name, v):
    """ConfigError unless ``v`` is an integer > 0."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ConfigError(f"{name}={v!r}: must be an integer > 0")


def check_run_size(steps_per_run: int, rays_per_batch: int, runs_held: int, device: str, op: bool = True) -> None:
    """Refuse (one line) an op run of ``K * B`` rays that the op's int32 ``rays`` cannot hold
    (``op``), or whose ``runs_held`` output buffers (``RAY_BYTES`` a ray) exceed the memory
    available now (a baseline's batches: ``op=False``)."""
    rays = int(steps_per_run) * int(rays_per_batch)
    if op and rays > INT32_MAX:
        raise ConfigError(f"rays_per_run={rays} ({steps_per_run} steps of rays_per_batch={rays_per_batch}): over the op's "
                          f"limit of {INT32_MAX} rays per run (int32); lower rays_per_run or rays_per_batch")
    need, avail = rays * RAY_BYTES * int(runs_held), available_memory(device)
    if need > avail:
        gib = 1 << 30
        raise ConfigError(f"rays_per_batch={rays_per_batch}: {runs_held} runs of {rays} rays in flight need "
                          f"{need / gib:.1f} GiB ({RAY_BYTES} bytes a ray) but only {avail / gib:.1f} GiB of "
                          f"{'GPU' if device == 'cuda' else 'host'} memory is available; lower rays_per_batch, "
                          f"rays_per_run or prefetch")


def check_cache_device(cache, device: str, who: str) -> None:
    """ConfigError unless the pre-decoded ``cache`` holds its pixels on ``device`` (a host cache
    fed to a GPU graph would be an error or a copy of the whole split every run)."""
    have = getattr(cache, "device", "cpu")
    if have != device:
        raise ConfigError(f"cache: decoded on {have} but {who} runs on {device}; decode it with "
                          f"decode_cache(..., device={device!r}) or build {who} with device={have!r}")


def check_common(scene, rays_per_batch, rank, world_size, seed, prefetch, mode):
    """Shared argument checks of every batch source (one-line ConfigError naming the argument and
    its range; the ranges are the op's argument types, :data:`dali_nerf.pipelines.rays.OP_ARGS`)."""
    check_int("rays_per_batch", rays_per_batch, 1, INT32_MAX)
    check_int("world_size", world_size, 1, INT32_MAX)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank!r}: must be in [0, world_size={world_size})")
    check_int("seed", seed, 0, INT64_MAX)
    check_int("prefetch", prefetch, 0, MAX_PREFETCH)
    if mode not in ("random", "epoch"):
        raise ConfigError(f"mode={mode!r}: use random or epoch")
