"""The C++ DALI ray-sampler operator plugin: lazy build, per-user cache, load once.

Nothing native happens on import. :func:`load_plugin` builds the plugin the first time it is
needed (a few seconds with g++), caches it per user, and loads it once per process; after that
the op is ``nvidia.dali.fn.dali_nerf.ray_sampler`` (schema ``dali_nerf__RaySampler``, contract in
ARCHITECTURE.md, "The operator").

Cache: ``$DALI_NERF_CACHE`` or ``~/.cache/dali_nerf/ops``, one folder per build key (DALI
version and its CUDA flavour: the package, e.g. ``nvidia-dali-cuda130``, and the CUDA version
DALI was built with, so a ``cuda120`` and a ``cuda130`` build of one DALI version never share a
library; sha256 of ``csrc/*``, compiler path and version, flags, CUDA or not) holding
``libdali_nerf_ops.so``, ``manifest.json`` (key, sha256 of the library), ``build.log`` (the last
compiler output), ``builds.log`` (one line per compiler run) and ``last_used`` (touched whenever
the folder's library is returned). A ``filelock.FileLock`` makes several ranks starting at once
build once; the library is written to a temporary file in the same folder and moved into place
with ``os.replace``; the ``.build-<pid>@<host>@*`` temporaries a killed build leaves are removed
by the next build or reuse of the folder on that host once the pid is gone, or by any after a
day (a cache shared by several nodes may not share its locks). A cached library whose sha256 does not match its
manifest, or that fails to load, is rebuilt once automatically.

Pruning (:func:`prune_cache`, after every build or reuse): a key folder unused for
``$DALI_NERF_CACHE_MAX_AGE_DAYS`` days (default 14) is removed, never the folder just used, and
never one whose lock another process holds (a build in progress): it is renamed to a
``.trash-*`` folder under its own lock, then deleted. A process that was waiting for that lock
finds its folder gone and makes it again.

Variants: the CPU-only library is compiled by g++ from the ``.cc`` files (``_CPU_SOURCES``); the
CUDA library is compiled by nvcc from those + ``ray_sampler.cu`` into one ``.so`` that registers
both backends (archs: ``$DALI_NERF_CUDA_ARCHS``, default ``80;90``, plus PTX for the newest), with
``-fmad=false``: no multiply-add is contracted into an FMA, so the device rounds the shared
formula of ``csrc/ray_math.h`` exactly as the host does (bit-identical rays and routing).

>>> from dali_nerf.ops import load_plugin
>>> path = load_plugin()            # builds on first use, then loads
>>> from nvidia.dali import fn      # fn.dali_nerf.ray_sampler(pixels, cameras, layout, rays=4096)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dali_nerf.errors import PluginBuildError

__all__ = ["load_plugin", "build_plugin", "plugin_cache_dir", "prune_cache", "cuda_available", "main", "LIB_NAME",
           "MAX_AGE_DAYS"]

LIB_NAME = "libdali_nerf_ops.so"
_CSRC = Path(__file__).resolve().parent / "csrc"
_CPU_SOURCES = ("ray_sampler.cc", "writer.cc", "routing.cc", "global.cc", "walk.cc")
_CUDA_SOURCES = (*_CPU_SOURCES, "ray_sampler.cu")

MAX_AGE_DAYS = 14.0
"""Default age (days since a key folder's library was last returned) after which it is pruned."""
_STAMP = "last_used"

_load_guard = threading.Lock()
_loaded: dict = {}  # {"path": Path, "cuda": bool} once loaded in this process


def plugin_cache_dir() -> Path:
    """Folder holding one sub-folder per build key: ``$DALI_NERF_CACHE`` or ``~/.cache/dali_nerf/ops``."""
    env = os.environ.get("DALI_NERF_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dali_nerf" / "ops"


# ---------------------------------------------------------------------------------------- tools

def _find_cxx() -> str:
    env = os.environ.get("CXX")
    if env:
        path = shutil.which(env)
        if not path:
            raise PluginBuildError(f"CXX={env} is not an executable: install g++ or fix CXX")
        return path
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    raise PluginBuildError("no C++ compiler (g++/c++) found: install g++ (apt-get install g++) or set CXX")


def _find_nvcc() -> str | None:
    env = os.environ.get("NVCC")
    if env:
        return shutil.which(env)
    path = shutil.which("nvcc")
    if path:
        return path
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def cuda_available() -> bool:
    """True when torch sees a GPU and nvcc is found (what ``load_plugin(cuda=None)`` picks)."""
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a dependency, but be safe
        has_gpu = False
    return bool(has_gpu and _find_nvcc())


def _tool_version(exe: str) -> str:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
        return (out.stdout or out.stderr).strip().splitlines()[-1] if exe.endswith("nvcc") else \
            (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def _pip_nvidia_dirs(sub: str) -> list[Path]:
    try:
        import nvidia
    except ImportError:
        return []
    return [Path(p) / sub for p in getattr(nvidia, "__path__", []) if (Path(p) / sub).is_dir()]


def _system_cuda_roots() -> list[str]:
    return [r for r in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if r]


def _cuda_includes() -> list[str]:
    """Include folders providing cuda_runtime.h (system toolkit first, else pip packages)."""
    for root in _system_cuda_roots():
        if root and (Path(root) / "include" / "cuda_runtime.h").is_file():
            return [str(Path(root) / "include")]
    dirs = []
    for sub in ("cuda_runtime/include", "cuda_nvcc/include", "cuda_cccl/include"):
        dirs += [str(d) for d in _pip_nvidia_dirs(sub)]
    if not any((Path(d) / "cuda_runtime.h").is_file() for d in dirs):
        raise PluginBuildError("cuda_runtime.h not found (needed even for the CPU operator): "
                               "pip install nvidia-cuda-runtime-cu12, or set CUDA_HOME to a CUDA toolkit")
    return dirs


def _dali_flags() -> tuple[str, list[str], list[str]]:
    try:
        import nvidia.dali as dali
        import nvidia.dali.sysconfig as sysconfig
    except ImportError as e:
        raise PluginBuildError(f"DALI is not installed ({e}): pip install nvidia-dali-cuda120") from None
    return dali.__version__, list(sysconfig.get_compile_flags()), list(sysconfig.get_link_flags())


def _dali_flavour() -> str:
    """The installed DALI's CUDA flavour: ``"<package> cuda<N>"``, e.g. ``"nvidia-dali-cuda130
    cuda13000"`` (the distribution that provides ``nvidia.dali`` at DALI's version, and
    ``nvidia.dali.__cuda_version__``, the CUDA version DALI was built with); parts that cannot be
    read are "unknown"."""
    import importlib.metadata as md

    import nvidia.dali as dali

    version = getattr(dali, "__version__", None)
    names = set()
    try:
        for d in md.distributions():
            name = (d.metadata["Name"] or "").lower()
            if name.startswith("nvidia-dali") and d.version == version:
                names.add(name)
    except Exception:  # pragma: no cover - a broken metadata folder must not stop a build
        pass
    return f"{'+'.join(sorted(names)) or 'unknown'} cuda{getattr(dali, '__cuda_version__', 'unknown')}"


def _sources_hash(names) -> str:
    h = hashlib.sha256()
    for p in sorted(_CSRC.iterdir()):
        if p.suffix in (".h", ".cc", ".cu", ".cuh"):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(",".join(names).encode())
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cuda_archs() -> list[str]:
    archs = [a.strip() for a in os.environ.get("DALI_NERF_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
             if a.strip()]
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    return flags


def _build_plan(cuda: bool) -> dict:
    """Compiler command (without output path) and the build key."""
    dali_version, cflags, lflags = _dali_flags()
    incs = [f"-I{d}" for d in _cuda_includes()]
    if cuda:
        nvcc = _find_nvcc()
        if not nvcc:
            raise PluginBuildError("nvcc not found for the CUDA operator: install the CUDA toolkit "
                                   "(or put nvcc on PATH / set CUDA_HOME), or build without --cuda")
        compiler = nvcc
        # -fmad=false: the device rounds a * b + c like the host (ray_math.h: the same bits)
        flags = ["-std=c++20", "-O3", "-shared", "-fmad=false", "-Xcompiler", "-fPIC",
                 "-Xcompiler", "-fno-math-errno", "--expt-relaxed-constexpr",
                 "-Xcompiler", "-Wno-free-nonheap-object", "--threads", "0", *_cuda_archs()]
        sources = _CUDA_SOURCES
    else:
        compiler = _find_cxx()
        flags = ["-std=c++20", "-O3", "-fno-math-errno", "-shared", "-fPIC", "-Wno-free-nonheap-object"]
        sources = _CPU_SOURCES
    flags = flags + cflags + incs
    ident = {
        "dali": dali_version, "dali_flavour": _dali_flavour(), "sources": _sources_hash(sources), "compiler": compiler,
        "compiler_version": _tool_version(compiler), "flags": flags, "link": lflags, "cuda": cuda,
        "python": sys.version_info[:2],
    }
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    key = ("cuda-" if cuda else "cpu-") + key
    cmd = [compiler, *flags, *[str(_CSRC / s) for s in sources]]
    compile_flags = [f for f in flags if f != "-shared"]
    return {"key": key, "cmd": cmd, "link": lflags, "ident": ident, "compiler": compiler, "flags": flags,
            "compile": [[compiler, *compile_flags, "-c", str(_CSRC / s)] for s in sources]}


def _build_jobs() -> int:
    """Compilers run at once: the cores this process may use (a sampling decision reads
    :mod:`dali_nerf.data.hostbudget`; a build only wants them busy)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def _cached_ok(lib: Path, manifest: Path, key: str) -> bool:
    try:
        m = json.loads(manifest.read_text())
        return m.get("key") == key and lib.is_file() and _sha256(lib) == m.get("sha256")
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------- build

def build_plugin(cuda: bool = False, force: bool = False) -> Path:
    """Build the plugin (or reuse the cached build) and return the library path.

    Args:
        cuda: also compile the CUDA backend (needs nvcc); False: CPU backend only, g++.
        force: rebuild even when a valid cached library exists.
    Returns:
        Path of ``libdali_nerf_ops.so`` inside ``plugin_cache_dir() / <key>``.
    Raises:
        PluginBuildError: no compiler, no cuda_runtime.h, compile error (names the log file),
            or an unwritable cache folder.

    Example:
        >>> build_plugin()            # doctest: +SKIP
        PosixPath('/home/me/.cache/dali_nerf/ops/cpu-3f2a.../libdali_nerf_ops.so')
    """
    from filelock import FileLock

    plan = _build_plan(bool(cuda))
    folder = plugin_cache_dir() / plan["key"]
    for _ in range(3):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PluginBuildError(f"cannot create the plugin cache {folder} ({e.strerror}): "
                                   f"set DALI_NERF_CACHE to a writable folder") from None
        with FileLock(str(folder / ".lock")):
            if not (folder / ".lock").is_file():
                continue  # pruned (renamed away) while this process waited for its lock: make it again
            lib = _build_locked(plan, folder, force)
            _touch(folder / _STAMP)
        break
    else:  # pragma: no cover - pruned three times in a row
        raise PluginBuildError(f"{folder}: removed by a concurrent prune three times; retry")
    prune_cache(keep={plan["key"]})
    return lib


def _build_locked(plan: dict, folder: Path, force: bool) -> Path:
    """The cached library of ``plan`` in ``folder`` (its lock held), compiled when missing or bad."""
    lib, manifest, log = folder / LIB_NAME, folder / "manifest.json", folder / "build.log"
    _sweep_dead_builds(folder)
    if not force and _cached_ok(lib, manifest, plan["key"]):
        return lib
    owner = _build_owner()
    fd, tmp = tempfile.mkstemp(prefix=owner, suffix=".so", dir=folder)
    os.close(fd)
    with tempfile.TemporaryDirectory(prefix=owner, dir=folder) as objs:
        # each source compiled by its own compiler process, as many at once as there are cores, then linked
        cmds = [[*c, "-o", os.path.join(objs, f"{i}.o")] for i, c in enumerate(plan["compile"])]
        link = [plan["compiler"], *plan["flags"], *[c[-1] for c in cmds], "-o", tmp, *plan["link"]]
        with open(folder / "builds.log", "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "cmd": link, "compile": cmds}) + "\n")
        try:
            with ThreadPoolExecutor(min(len(cmds), _build_jobs())) as pool:
                results = list(pool.map(lambda c: subprocess.run(c, capture_output=True, text=True), cmds))
            if all(r.returncode == 0 for r in results):
                results.append(subprocess.run(link, capture_output=True, text=True))
        except OSError as e:
            os.unlink(tmp)
            raise PluginBuildError(f"cannot run {cmds[0][0]} ({e.strerror}): install g++ or set CXX") from None
        log.write_text("\n\n".join(f"{' '.join(c)}\n(exit {r.returncode})\n{r.stdout}{r.stderr}"
                                   for c, r in zip(cmds + [link], results)))
    if any(r.returncode != 0 for r in results) or os.path.getsize(tmp) == 0:
        os.unlink(tmp)
        raise PluginBuildError(f"compiling the dali_nerf operator failed: full compiler output in {log}")
    os.replace(tmp, lib)
    manifest.write_text(json.dumps({"key": plan["key"], "sha256": _sha256(lib),
                                    "ident": plan["ident"]}, indent=1))
    return lib


#: a build's temporaries older than this are removed whoever made them (a build never takes an hour)
DEAD_BUILD_AGE_S = 24 * 3600.0


def _build_owner() -> str:
    """The prefix of this process's build temporaries: ``.build-<pid>@<host>@``."""
    return f".build-{os.getpid()}@{socket.gethostname()}@"


def _sweep_dead_builds(folder: Path, now: float | None = None) -> None:
    """Remove the ``.build-*`` temporaries of builds that died in ``folder`` (a process killed while
    it compiled: its library and object folder were never renamed or removed): those this host's
    dead processes made (their pid is gone), and any older than :data:`DEAD_BUILD_AGE_S`. Never a
    living process's on this host, nor another host's recent ones: a cache shared by several nodes
    (a network home) may not share its file locks between them, so a lock held here does not say
    that no other node builds in the folder. Errors are ignored, as the prune's are."""
    now = time.time() if now is None else now
    host = socket.gethostname()
    try:
        left = [p for p in folder.iterdir() if p.name.startswith(".build-")]
    except OSError:
        return
    for p in left:
        m = re.match(r"\.build-(\d+)@([^@]+)@", p.name)
        try:
            old = now - p.lstat().st_mtime > DEAD_BUILD_AGE_S
        except OSError:
            continue
        if not (old or (m is not None and m.group(2) == host and not _alive(int(m.group(1))))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                p.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one we may not signal exists too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _touch(path: Path) -> None:
    try:
        path.touch()
        os.utime(path)
    except OSError:  # a read-only cache still serves its library
        pass


def _last_used(folder: Path) -> float:
    """Seconds since the epoch of the folder's last use: its ``last_used`` stamp, else (a folder
    from before stamps, or a failed build) its manifest, its builds log, the folder itself."""
    for p in (folder / _STAMP, folder / "manifest.json", folder / "builds.log", folder):
        try:
            return p.stat().st_mtime
        except OSError:
            continue
    return 0.0


def prune_cache(keep=(), max_age_days: float | None = None, now: float | None = None) -> list:
    """Remove key folders of :func:`plugin_cache_dir` unused for ``max_age_days`` (default
    ``$DALI_NERF_CACHE_MAX_AGE_DAYS`` or :data:`MAX_AGE_DAYS`; < 0 disables); returns the removed
    folder names.

    Never removed: the folders named in ``keep`` (the one this process uses) and any folder whose
    ``.lock`` another process holds (a build or a reuse in progress). A stale folder is renamed to
    ``.trash-<name>-<pid>`` while its lock is held, then deleted; leftover ``.trash-*`` folders (a
    prune that crashed) are deleted too. Errors are ignored: pruning never fails a build.
    """
    from filelock import FileLock, Timeout

    if max_age_days is None:
        try:
            max_age_days = float(os.environ.get("DALI_NERF_CACHE_MAX_AGE_DAYS", MAX_AGE_DAYS))
        except ValueError:
            max_age_days = MAX_AGE_DAYS
    root = plugin_cache_dir()
    if max_age_days < 0 or not root.is_dir():
        return []
    now = time.time() if now is None else now
    removed = []
    try:
        children = sorted(root.iterdir())
    except OSError:
        return []
    for child in children:
        name = child.name
        if not child.is_dir() or name in keep:
            continue
        if name.startswith(".trash-"):
            shutil.rmtree(child, ignore_errors=True)
            continue
        if not name.startswith(("cpu-", "cuda-")) or now - _last_used(child) < max_age_days * 86400.0:
            continue
        lock = FileLock(str(child / ".lock"), timeout=0)
        trash = root / f".trash-{name}-{os.getpid()}"
        try:
            with lock:
                if now - _last_used(child) < max_age_days * 86400.0:
                    continue  # used while we waited
                os.rename(child, trash)
        except (Timeout, OSError):
            continue  # held by a build in progress, or already gone
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(name)
    return removed


def _load_library(path: Path) -> None:
    import nvidia.dali.plugin_manager as plugin_manager
    plugin_manager.load_library(str(path))


def load_plugin(cuda: bool | None = None) -> Path:
    """Build if needed and load the plugin, once per process; returns the library path.

    Args:
        cuda: True: the CUDA variant (CPU + GPU backends); False: CPU only; None: CUDA when
            ``torch.cuda.is_available()`` and nvcc is found, else CPU only.
    Raises:
        PluginBuildError: as :func:`build_plugin`, or when the library does not load even after
            a rebuild, or when the other variant is already loaded in this process.
    """
    with _load_guard:
        if _loaded:
            if cuda and not _loaded["cuda"]:
                raise PluginBuildError("the CPU-only dali_nerf plugin is already loaded in this process: "
                                       "call load_plugin(cuda=True) before any pipeline is built")
            return _loaded["path"]
        use_cuda = cuda_available() if cuda is None else bool(cuda)
        path = build_plugin(cuda=use_cuda)
        try:
            _load_library(path)
        except Exception:
            path = build_plugin(cuda=use_cuda, force=True)  # stale or corrupt: rebuild once
            try:
                _load_library(path)
            except Exception as e:
                raise PluginBuildError(f"cannot load {path} ({str(e).splitlines()[0][:200]}): "
                                       f"remove {path.parent} and retry, or run dali-nerf build-op --force") from None
        _loaded.update(path=path, cuda=use_cuda)
        return path


def main(args) -> int:
    """``dali-nerf build-op [--cuda] [--force]``: build (or reuse) the plugin and print its path."""
    path = build_plugin(cuda=bool(getattr(args, "cuda", False)), force=bool(getattr(args, "force", False)))
    print(path)
    return 0
