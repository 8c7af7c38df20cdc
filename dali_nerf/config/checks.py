"""Value checks shared by the config sections, and the value sets they check against."""

from __future__ import annotations

from dali_nerf.errors import ConfigError

__all__ = ["SOURCE_NAMES", "STUDY_SAMPLERS", "STREAMS", "MAX_THREADS"]

SOURCE_NAMES = ("rays", "rays_sync", "sync_global", "sync_local", "torch_workers", "ready")
"""``pipeline.name`` values (:data:`dali_nerf.sources.registry.SOURCES`, which a test holds equal)."""
STUDY_SAMPLERS = ("sync_global", "sync_local", "torch_workers", "rays_sync", "rays")
"""``bench.samplers`` / ``bench.emulated_samplers`` values (the floor, ``ready``, is always added)."""

STREAMS = ("global", "shard")
"""Valid ``pipeline.stream`` values."""

MAX_THREADS = 1024
"""Largest pipeline.num_threads / prefetch / workers accepted (threads, queued runs, processes)."""


def in_range(key, v, lo, hi):
    if not lo <= v <= hi:
        raise ConfigError(f"{key}: must be in [{lo}, {hi}], got {v}")


def positive(key, v):
    if not v > 0:  # NaN too
        raise ConfigError(f"{key}: must be > 0, got {v}")


def nonneg(key, v):
    if v < 0:
        raise ConfigError(f"{key}: must be >= 0, got {v}")


def choice(key, v, choices):
    if v not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(map(str, choices))}, got {v!r}")
