"""Host buffers for the image cache: ``np.empty`` backed by transparent huge pages where the OS
offers them.

The ray sampler reads one pixel at a random place of the whole cache per ray. With 4 KiB pages
nearly every such read also misses the TLB (a 100-image 400x400 cache spans 12,000 pages; the
TLB covers a few thousand); with 2 MiB pages the whole cache fits in the TLB. Measured on a
2-core AMD EPYC VM with the op's kernel alone: 23 -> 28.7 Mrays/s per thread (benchmarks/,
docs/BENCHMARKS.md).

Linux only (``madvise(MADV_HUGEPAGE)``; the kernel's THP mode must be ``always`` or ``madvise``);
elsewhere, for small buffers, or when the call is refused, it is plain ``np.empty``. The data
and the results never depend on which one was used.

:func:`dali_host_pool` is the other half of host memory: DALI's own allocations (the ray
pipeline's per-run output buffers) come from DALI's host memory pool instead of ``malloc``.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

__all__ = ["empty", "dali_host_pool", "DALI_POOL_ENV", "DALI_POOL_THRESHOLD"]

DALI_POOL_ENV = "DALI_MALLOC_POOL_THRESHOLD"
DALI_POOL_THRESHOLD = "64k"

_HUGE = 2 << 20          # the x86-64 / aarch64 (4 KiB base) huge page size
_MIN_BYTES = 4 << 20     # below this the TLB covers the buffer anyway


def empty(shape, dtype=np.uint8) -> np.ndarray:
    """An uninitialised C-contiguous array, on huge pages when possible.

    Example:
        >>> a = empty((8 << 20, 3)); a.shape, a.dtype, a.flags.writeable
        ((8388608, 3), dtype('uint8'), True)
    """
    dtype = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < _MIN_BYTES or advise is None:
        return np.empty(shape, dtype)
    try:
        m = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(advise)
    except (OSError, ValueError):
        return np.empty(shape, dtype)
    raw = np.frombuffer(m, dtype=np.uint8)  # keeps `m` alive as long as any view of it
    off = (-raw.ctypes.data) % _HUGE        # start on a huge-page boundary
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def dali_host_pool() -> str:
    """Have DALI take its host buffers of 64 KiB and more from its own memory pool.

    DALI allocates host buffers below ``DALI_MALLOC_POOL_THRESHOLD`` (default 32 MiB) with plain
    ``malloc`` and larger ones from a pool. The ray pipeline's outputs are new buffers every run
    (its asynchronous executor hands each run's buffers to the consumer, zero copy), a few MiB
    each: glibc serves those with fresh ``mmap`` pages and unmaps them on free, so runs fault
    their outputs in again (tests/test_hostmem.py counts 19,000-67,000 faults over 50 runs of
    262144 rays). From the pool the same memory is reused (13-16 faults).

    Sets the environment variable unless it is already set (a user's value wins; ``32M`` restores
    DALI's default). DALI reads it once, at its first host allocation in the process, so our
    pipelines call this before they are built; called later it changes nothing. Returns the
    value in force.

    Example:
        >>> dali_host_pool() == os.environ["DALI_MALLOC_POOL_THRESHOLD"]
        True
    """
    return os.environ.setdefault(DALI_POOL_ENV, DALI_POOL_THRESHOLD)
