"""The op's C++ code compiled for the host, without DALI, as the tests' harnesses load it."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

from dali_nerf import ops

__all__ = ["compile_harness"]


def compile_harness(folder: Path, source: str, *extra: Path, name: str = "harness") -> ctypes.CDLL:
    """Write ``source`` to ``folder/<name>.cc``, compile it with ``extra`` sources by the plugin's
    compiler with the plugin's code flags (``-O3 -fno-math-errno``, no FMA contraction beyond the
    compiler's default) and load it. A compile error fails the test with its last lines."""
    src = folder / f"{name}.cc"
    src.write_text(source)
    lib = folder / f"{name}.so"
    cmd = [ops._find_cxx(), "-std=c++20", "-O3", "-fno-math-errno", "-shared", "-fPIC", f"-I{ops._CSRC}",
           str(src), *map(str, extra), "-o", str(lib)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return ctypes.CDLL(str(lib))
