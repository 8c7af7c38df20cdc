"""Suite-wide rules: every test passes in any order and alone.

* The order is random (pytest-randomly, in the ``test`` extra): the first line and the summary
  print ``random order: --randomly-seed=N`` (also under ``-q``, which hides pytest-randomly's own
  header line); rerun one order with ``pytest -p randomly --randomly-seed=N`` (or
  ``-p no:randomly`` for file order). pytest-randomly also seeds ``random``, numpy and
  hypothesis from N before each test, so a test's randomness comes from that printed seed unless
  the test states its own.
* Process-global state a test leaves changed fails that test, naming what changed (and is put
  back, so the tests after it are not affected): environment variables, the working directory,
  the handlers of SIGINT / SIGTERM / SIGUSR1, torch's intra-op thread count, and the
  plugin cache folder (``$DALI_NERF_CACHE``). Change them with ``monkeypatch`` (restored before
  this check runs) or restore them yourself.
* hypothesis: no per-example deadline (this 2-core machine drifts by 2x; a deadline would fail
  on load, not on behaviour); examples are bounded per test with ``@settings(max_examples=...)``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("dali_nerf", deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dali_nerf"))
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass

# libraries that edit the environment once, on import (OpenCV's loader adds its folders to
# LD_LIBRARY_PATH): imported here, before any test's snapshot
import cv2  # noqa: E402,F401
import torch  # noqa: E402,F401

# SIGCHLD is not checked: torch's DataLoader installs its worker-failure handler once per process
# (torch.utils.data._utils.signal_handling) and would not reinstall it after a restore
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


# set once per process by design, not per test: pytest's own marker; the DALI host-pool threshold
# dali_nerf sets before DALI's first allocation (hostmem.dali_host_pool: DALI reads it once);
# torch's inductor cache folder, which torch sets on its first compile-related import
_PROCESS_ONCE = ("PYTEST_CURRENT_TEST", "DALI_MALLOC_POOL_THRESHOLD", "TORCHINDUCTOR_CACHE_DIR")


def _environ() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _PROCESS_ONCE}


def _snapshot() -> dict:
    import torch

    return {
        "environ": _environ(),
        "cwd": os.getcwd(),
        "signals": {s: signal.getsignal(s) for s in _SIGNALS},
        "torch_threads": torch.get_num_threads(),
    }


def _restore(before: dict) -> list:
    """Put the process back as ``before``; returns what had changed (one phrase each)."""
    import torch

    changed = []
    env_now = _environ()
    added = sorted(set(env_now) - set(before["environ"]))
    removed = sorted(set(before["environ"]) - set(env_now))
    edited = sorted(k for k in set(env_now) & set(before["environ"]) if env_now[k] != before["environ"][k])
    if added or removed or edited:
        changed.append(f"environment (added {added}, removed {removed}, changed {edited})")
        for k in added:
            del os.environ[k]
        os.environ.update(before["environ"])
    if os.getcwd() != before["cwd"]:
        changed.append(f"working directory ({before['cwd']} -> {os.getcwd()})")
        os.chdir(before["cwd"])
    for s, h in before["signals"].items():
        if signal.getsignal(s) != h:
            changed.append(f"handler of {signal.Signals(s).name}")
            signal.signal(s, h)
    if torch.get_num_threads() != before["torch_threads"]:
        changed.append(f"torch threads ({before['torch_threads']} -> {torch.get_num_threads()})")
        torch.set_num_threads(before["torch_threads"])
    return changed


def _seed_line(config):
    """``random order: --randomly-seed=N (...)``, or None when pytest-randomly is off."""
    seed = getattr(config.option, "randomly_seed", None)
    if not isinstance(seed, int) or not config.pluginmanager.has_plugin("randomly"):
        return None
    return f"random order: --randomly-seed={seed} (repeat it: bash scripts/test.sh -p randomly --randomly-seed={seed})"


def pytest_sessionstart(session):
    line, tr = _seed_line(session.config), session.config.pluginmanager.get_plugin("terminalreporter")
    if line and tr is not None:
        tr.write_line(line)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    line = _seed_line(config)
    if line:
        terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _process_state_is_restored(request):
    before = _snapshot()
    yield
    changed = _restore(before)
    if changed:
        pytest.fail(f"{request.node.nodeid} left process-global state changed: {'; '.join(changed)} "
                    f"(use monkeypatch or restore it)", pytrace=False)


class CudaPlugin(NamedTuple):
    cache: Path
    """The plugin cache it was built in (a folder of this session's)."""
    env: dict
    """What the build set: ``DALI_NERF_CACHE`` (``cache``) and ``DALI_NERF_CUDA_ARCHS`` (``80``)."""
    build: subprocess.CompletedProcess
    """The build: ``build_plugin(cuda=True)`` in a new process; stdout's last line is the library."""


@pytest.fixture(scope="session")
def cuda_plugin(tmp_path_factory):
    """The CUDA plugin compiled by nvcc once per session, into an empty cache of its own, for sm_80
    only (shorter; the default build targets sm_80 and sm_90); None where nvcc is not found.

    Not checked here: ``test_cuda_source_compiles_with_nvcc`` checks it, and the GPU study's dry
    run reuses it for its build step.
    """
    from dali_nerf.ops import _find_nvcc

    if _find_nvcc() is None:
        return None
    cache = tmp_path_factory.mktemp("cuda_plugin")
    env = {"DALI_NERF_CACHE": str(cache), "DALI_NERF_CUDA_ARCHS": "80"}
    code = "from dali_nerf.ops import build_plugin; print(build_plugin(cuda=True))"
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=900)
    return CudaPlugin(cache, env, res)
