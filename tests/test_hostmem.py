"""dali_nerf.hostmem: huge-page-backed host buffers behave like np.empty."""

import numpy as np

from dali_nerf import hostmem


def test_large_buffer_is_aligned_writable_and_independent():
    a = hostmem.empty((5 << 20, 3), np.uint8)
    b = hostmem.empty((5 << 20, 3), np.uint8)
    assert a.shape == (5 << 20, 3) and a.dtype == np.uint8 and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % (2 << 20) == 0  # starts on a huge-page boundary
    a[:] = 7
    b[:] = 9
    assert int(a[-1, 2]) == 7 and int(b[0, 0]) == 9
    del b
    assert int(a.sum(dtype=np.int64)) == 7 * a.size  # the mapping lives as long as the view


def test_small_buffer_and_other_dtypes():
    s = hostmem.empty(10)
    assert s.shape == (10,) and s.dtype == np.uint8
    f = hostmem.empty((1 << 20, 2), np.float32)  # 8 MiB
    assert f.shape == (1 << 20, 2) and f.dtype == np.float32 and f.ctypes.data % f.itemsize == 0
