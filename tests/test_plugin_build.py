"""Lazy plugin build: one compile for concurrent ranks, corrupt caches rebuilt, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dali_nerf.ops as ops
from dali_nerf.errors import PluginBuildError

LOAD_AND_RUN = r"""
import numpy as np
from nvidia.dali import fn, pipeline_def
from dali_nerf.ops import load_plugin
path = load_plugin(cuda={cuda})
pix = np.arange(30, dtype=np.uint8).reshape(10, 3)
cam = np.zeros((1, 18), np.float32); cam[0, :12] = np.eye(3, 4).ravel(); cam[0, 12:18] = [2, 2, 2.5, 1, 0.1, 4]
lay = np.array([[0, 5, 2, 0]], np.int64)
@pipeline_def(batch_size=1, num_threads=1, device_id=None)
def pipe():
    p = fn.external_source(source=lambda: [pix], batch=True)
    c = fn.external_source(source=lambda: [cam], batch=True)
    l = fn.external_source(source=lambda: [lay], batch=True)
    return fn.dali_nerf.ray_sampler(p, c, l, rays=8, mode="epoch")[3]
pp = pipe(); pp.build()
assert np.array(pp.run()[0][0]).shape == (8, 3)
print(path)
"""


def _spawn(cache: Path, cuda: bool = False) -> subprocess.Popen:
    env = {**os.environ, "DALI_NERF_CACHE": str(cache)}
    return subprocess.Popen([sys.executable, "-c", LOAD_AND_RUN.format(cuda=cuda)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out.strip().splitlines()[-1]


def _builds(folder: Path) -> int:
    return len((folder / "builds.log").read_text().splitlines())


@pytest.mark.slow
def test_concurrent_build_once_then_corruption_rebuilt(tmp_path, monkeypatch):
    # two "ranks" start at once on an empty cache: one compiles, the other waits and loads
    procs = [_spawn(tmp_path), _spawn(tmp_path)]
    paths = {_finish(p) for p in procs}
    assert len(paths) == 1
    lib = Path(paths.pop())
    assert lib.parent.parent == tmp_path and lib.name == ops.LIB_NAME
    assert _builds(lib.parent) == 1
    assert not list(lib.parent.glob(".build-*"))  # no temp files left behind

    # a truncated library: sha256 mismatch -> rebuilt once, then loads
    data = lib.read_bytes()
    lib.write_bytes(data[: len(data) // 3])
    assert _finish(_spawn(tmp_path)) == str(lib)
    assert _builds(lib.parent) == 2
    assert lib.read_bytes() == data  # deterministic rebuild

    # garbage whose manifest matches (stale manifest): load_library fails -> rebuilt once
    lib.write_bytes(b"not an ELF file")
    manifest = json.loads((lib.parent / "manifest.json").read_text())
    manifest["sha256"] = ops._sha256(lib)
    (lib.parent / "manifest.json").write_text(json.dumps(manifest))
    assert _finish(_spawn(tmp_path)) == str(lib)
    assert _builds(lib.parent) == 3

    # a valid cache is reused without compiling
    monkeypatch.setenv("DALI_NERF_CACHE", str(tmp_path))
    assert ops.build_plugin(cuda=False) == lib
    assert _builds(lib.parent) == 3


def test_no_compiler_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("DALI_NERF_CACHE", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(PluginBuildError, match=r"no C\+\+ compiler .*install g\+\+") as e:
        ops.build_plugin(cuda=False)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("CXX", "definitely-not-a-compiler")
    with pytest.raises(PluginBuildError, match="CXX=definitely-not-a-compiler"):
        ops.build_plugin(cuda=False)


def test_no_cuda_runtime_header_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("DALI_NERF_CACHE", str(tmp_path))
    monkeypatch.setattr(ops, "_system_cuda_roots", lambda: [])
    monkeypatch.setattr(ops, "_pip_nvidia_dirs", lambda sub: [])
    with pytest.raises(PluginBuildError, match="pip install nvidia-cuda-runtime-cu12"):
        ops.build_plugin(cuda=False)


def test_compile_error_points_at_log(monkeypatch, tmp_path):
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "ray_sampler.cc").write_text('#error "broken on purpose"\n')
    monkeypatch.setenv("DALI_NERF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ops, "_CSRC", src)
    with pytest.raises(PluginBuildError, match=r"full compiler output in .*build\.log") as e:
        ops.build_plugin(cuda=False)
    log = Path(str(e.value).rsplit(" ", 1)[-1])
    assert "broken on purpose" in log.read_text() and "(exit 1)" in log.read_text()
    assert not (log.parent / ops.LIB_NAME).exists()
    assert not list(log.parent.glob(".build-*"))  # neither the library's temporary file nor the objects' folder


def test_import_is_not_native():
    code = ("import sys, dali_nerf, dali_nerf.ops; "
            "assert not any(m.startswith('nvidia.dali') for m in sys.modules), 'dali imported'; "
            "assert not dali_nerf.ops._loaded")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_cuda_source_compiles_with_nvcc(cuda_plugin):
    if cuda_plugin is None:
        pytest.skip("nvcc not found (the CUDA toolkit, or the nvidia-cuda-nvcc-cu12 wheel): the CUDA backend cannot be "
                    "compiled here; runs wherever nvcc is found ($NVCC, PATH, CUDA_HOME), and on a GPU machine the same "
                    "build is the build step of scripts/gpu_study.sh")
    # the session's build (conftest.py: an empty cache, sm_80 only), which the GPU study's dry run reuses
    res = cuda_plugin.build
    assert res.returncode == 0, res.stderr[-3000:]
    lib = Path(res.stdout.strip().splitlines()[-1])
    assert lib.is_file() and lib.parent.name.startswith("cuda-") and lib.parent.parent == cuda_plugin.cache
    first = json.loads((lib.parent / "builds.log").read_text().splitlines()[0])
    assert first["cmd"][0] == ops._find_nvcc()  # the first build in that cache: nvcc's
    env = {**os.environ, **cuda_plugin.env}
    # the CUDA library also carries the CPU backend: load it and run on the CPU
    proc = subprocess.Popen([sys.executable, "-c", LOAD_AND_RUN.format(cuda=True)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert _finish(proc) == str(lib)


PTX_PROBE = r"""
#include "ray_math.h"
#include "streams.h"
using namespace dali_nerf::detail;
__global__ void probe(const float *tab, const double *route, const RouteConsts *rc, uint64_t key, uint64_t P,
                      float *o, float *d, unsigned *flag) {
  int i = threadIdx.x;
  uint64_t pix = stream_pixel(1, key, i, P);
  row_ray(tab, pix / 7, pix % 7, o + 3 * i, d + 3 * i);
  flag[i] = route_decide(*rc, route, pix / 7, pix % 7);
}
"""


def test_device_formula_has_no_fma(tmp_path):
    """The device code of the shared formula (ray_math.h), compiled with the plugin's nvcc flags,
    rounds like the host: no fused multiply-add, no approximate or flush-to-zero instruction in
    its PTX (so the host tests of the formula hold for the GPU's bits). Without -fmad=false the
    same probe has FMAs: the check can fail."""
    nvcc = ops._find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (the CUDA toolkit, or the nvidia-cuda-nvcc-cu12 wheel): the device code cannot be "
                    "compiled here; runs wherever nvcc is found ($NVCC, PATH, CUDA_HOME)")
    plan = ops._build_plan(cuda=True)
    (cu,) = [c for c in plan["compile"] if c[-1].endswith(".cu")]  # the command that compiles the device code
    fp_flags = [f for f in cu if f.startswith(("-fmad", "--fmad", "-use_fast_math", "--use_fast_math",
                                                          "-ftz", "--ftz", "-prec-", "--prec-"))]
    assert "-fmad=false" in fp_flags
    (tmp_path / "probe.cu").write_text(PTX_PROBE)

    def ptx(flags):
        out = tmp_path / "probe.ptx"
        res = subprocess.run([nvcc, "-std=c++20", "-ptx", "-arch=compute_90", *flags, f"-I{ops._CSRC}",
                              str(tmp_path / "probe.cu"), "-o", str(out)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        return out.read_text()

    code = ptx(fp_flags)
    assert "fma." not in code and ".approx" not in code and ".ftz" not in code
    assert "sqrt.rn.f32" in code and "sqrt.rn.f64" in code  # IEEE square roots, as on the host
    assert "fma." in ptx([f for f in fp_flags if not f.startswith("-fmad")])


def test_a_build_killed_midway_leaves_nothing_the_next_build_keeps(tmp_path):
    """A process killed while it compiles (SIGKILL: no handler, no cleanup) leaves its temporary
    library and object folder in the key folder; the next build or reuse of that folder removes
    them (their pid, on this host, is gone) and builds as usual. It keeps a living process's
    temporaries and another host's recent ones (a cache shared by nodes whose locks may not be
    shared), and removes anyone's older than a day."""
    import signal
    import time

    src, cache = tmp_path / "csrc", tmp_path / "cache"
    src.mkdir()
    for i, name in enumerate(ops._CPU_SOURCES):  # a small plugin: one function per source
        (src / name).write_text(f"int dn_probe_{i}() {{ return {i}; }}\n")
    cxx = tmp_path / "slow-cxx"  # compiles as g++ does, after a long pause when DN_SLOW is set
    cxx.write_text('#!/bin/sh\ncase " $* " in *" -c "*) [ -n "$DN_SLOW" ] && sleep 120;; esac\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    env = {**os.environ, "DALI_NERF_CACHE": str(cache), "CXX": str(cxx), "DN_SLOW": "1"}
    code = f"import dali_nerf.ops as o, pathlib; o._CSRC = pathlib.Path({str(src)!r}); o.build_plugin(cuda=False)"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(cache.glob("cpu-*/.build-*")):  # compiling: its temporaries exist
            assert proc.poll() is None and time.monotonic() < deadline, f"the build ended ({proc.poll()}) or never began"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the build and its compilers
        proc.wait(timeout=60)
    (folder,) = cache.glob("cpu-*")
    left = sorted(p.name for p in folder.glob(".build-*"))
    assert any(n.endswith(".so") for n in left) and not (folder / ops.LIB_NAME).exists(), left
    assert all(n.startswith(f".build-{proc.pid}@{__import__('socket').gethostname()}@") for n in left), left
    living = folder / f".build-{os.getpid()}@{__import__('socket').gethostname()}@x.so"  # this test's process
    other = folder / ".build-1@another-node@y"  # another node's build in progress
    stale = folder / ".build-2@another-node@z.so"
    living.write_bytes(b"")
    other.mkdir()
    stale.write_bytes(b"")
    os.utime(stale, (time.time() - 2 * 86400,) * 2)

    env.pop("DN_SLOW")
    code = (f"import dali_nerf.ops as o, pathlib; o._CSRC = pathlib.Path({str(src)!r}); "
            f"print(o.build_plugin(cuda=False))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()) == folder / ops.LIB_NAME and (folder / ops.LIB_NAME).stat().st_size > 0
    assert sorted(folder.glob(".build-*")) == sorted([living, other])
