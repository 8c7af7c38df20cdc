"""Value checks shared by the config sections, and the value sets they check against."""

from __future__ import annotations

import os

from dali_nerf.errors import ConfigError, shown

__all__ = ["SOURCE_NAMES", "STUDY_SAMPLERS", "STREAMS", "MAX_THREADS", "path_value"]

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
        raise ConfigError(f"{key}: must be in [{lo}, {hi}], got {shown(v)}")


def positive(key, v):
    if not v > 0:  # NaN too
        raise ConfigError(f"{key}: must be > 0, got {shown(v)}")


def nonneg(key, v):
    if v < 0:
        raise ConfigError(f"{key}: must be >= 0, got {shown(v)}")


def choice(key, v, choices):
    if v not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(map(str, choices))}, got {shown(v)}")


def path_value(key: str, value: str) -> None:
    """Refuse a path (or a name in one) that no file system holds: a NUL byte, a name over 255
    bytes (NAME_MAX) or a path over 4095 (PATH_MAX), text that does not encode to bytes."""
    try:
        raw = os.fsencode(value)
    except UnicodeError:
        raise ConfigError(f"{key}: {shown(value)} cannot be encoded as a file name; use plain characters") from None
    if b"\0" in raw:
        raise ConfigError(f"{key}: {shown(value)} holds a NUL byte, which no path can; remove it")
    if len(raw) > 4095:
        raise ConfigError(f"{key}: {shown(value)} is {len(raw)} bytes long, over the 4095 of a path (PATH_MAX); "
                          f"shorten it")
    long = [p for p in raw.split(b"/") if len(p) > 255]
    if long:
        raise ConfigError(f"{key}: {shown(value)} has a name of {len(long[0])} bytes, over the 255 a file system "
                          f"holds; shorten it")
