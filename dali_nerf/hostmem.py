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
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["empty"]

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
