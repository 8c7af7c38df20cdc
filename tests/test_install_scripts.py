"""The README's two commands choose where to install (scripts/_python.sh): the running python3
when its pip accepts installs (an active venv, CI's Python), else — PEP 668, Debian's and
Ubuntu's own python3 — the virtual environment .venv/ in the checkout, created once and reused.

The decision runs for real (pip's own PEP 668 check, real virtual environments); the installs
and the final command are printed, not run (``DALI_NERF_INSTALL_DRY=1``): a real install takes
minutes (docs/INSTALL.md records one). Each test works on a copy of scripts/ in tmp_path, so the
checkout's own .venv/ is never seen or touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEBIAN_PY = Path("/usr/bin/python3")


def _externally_managed(python) -> bool:
    """The PEP 668 marker of ``python``'s stdlib, outside a virtual environment."""
    code = ("import sys, sysconfig, os; print(sys.prefix == sys.base_prefix and "
            "os.path.isfile(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))")
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.strip() == "True"


def _checkout(tmp_path) -> Path:
    root = tmp_path / "checkout"
    shutil.copytree(REPO / "scripts", root / "scripts")
    return root


def _run(root, script, path, *args, env=()):
    e = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PIP_BREAK_SYSTEM_PACKAGES")}
    e.update(PATH=path, DALI_NERF_INSTALL_DRY="1", **dict(env))
    return subprocess.run([shutil.which("bash"), f"scripts/{script}", *args], cwd=root, env=e, capture_output=True, text=True,
                          timeout=120)


needs_debian = pytest.mark.skipif(not (DEBIAN_PY.is_file() and _externally_managed(DEBIAN_PY)),
                                  reason=f"{DEBIAN_PY} is absent or not externally managed (PEP 668): no Debian/Ubuntu "
                                         f"system Python here to refuse the install")


@needs_debian
def test_debian_system_python_gets_a_venv_in_the_checkout_created_once_then_reused(tmp_path):
    root = _checkout(tmp_path)
    r = _run(root, "demo.sh", "/usr/bin:/bin", "--nproc", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "is externally managed (PEP 668): creating the virtual environment .venv/ in this checkout" in lines[0]
    assert ".venv/bin/dali-nerf, or source .venv/bin/activate" in lines[0]
    venv_py = str(root / ".venv" / "bin" / "python")
    assert lines[1:] == ["would run: python3 -m venv --clear .venv",
                         f"would run: {venv_py} -m pip install -q torch==2.13.0",
                         f"would run: {venv_py} -m pip install -q -e .",
                         f"would run: {venv_py} -m dali_nerf demo --nproc 1"], lines
    assert not (root / ".venv").exists()  # the dry mode creates nothing

    # a .venv/ without pip (an interrupted creation) is made anew; one with pip is reused
    subprocess.run([str(DEBIAN_PY), "-m", "venv", "--without-pip", str(root / ".venv")], check=True)
    r = _run(root, "test.sh", "/usr/bin:/bin")
    assert "creating the virtual environment .venv/" in r.stdout and "venv --clear .venv" in r.stdout, r.stdout
    shutil.rmtree(root / ".venv")
    subprocess.run([str(DEBIAN_PY), "-m", "venv", "--without-pip", "--system-site-packages", str(root / ".venv")],
                   check=True)  # pip from the system's site-packages: a working pip, nothing installed
    r = _run(root, "test.sh", "/usr/bin:/bin", "-x")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "is externally managed (PEP 668): using the virtual environment .venv/ in this checkout" in lines[0], lines
    assert lines[1:] == [f"would run: {venv_py} -m pip install -q torch==2.13.0",
                         f"would run: {venv_py} -m pip install -q -e .\\[test\\]",
                         f"would run: {venv_py} -m pytest -q -x"], lines


def test_a_python_that_accepts_installs_is_used_as_it_is(tmp_path):
    """This test's own Python (a virtual environment, or CI's Python): no .venv/, torch kept."""
    if _externally_managed(sys.executable):
        pytest.skip(f"{sys.executable} is itself externally managed")
    bindir = Path(sys.executable).parent
    if not (bindir / "python3").exists():
        pytest.skip(f"{bindir} has no python3")
    root = _checkout(tmp_path)
    r = _run(root, "test.sh", f"{bindir}:/usr/bin:/bin")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    py = subprocess.run([str(bindir / "python3"), "-c", "import sys; print(sys.executable)"], capture_output=True,
                        text=True).stdout.strip()
    assert lines == [f"python: installing into {py} (its pip accepts installs)",  # torch is there: not reinstalled
                     f"would run: {py} -m pip install -q -e .\\[test\\]",
                     f"would run: {py} -m pytest -q"], lines
    assert "virtual environment" not in r.stdout and not (root / ".venv").exists()


def _bin_with(tmp_path, **tools) -> str:
    """A PATH of one folder holding only ``tools`` (name -> target): a machine without the others."""
    b = tmp_path / "bin"
    b.mkdir()
    for name, target in tools.items():
        (b / name).symlink_to(target)
    return str(b)


def test_missing_gxx_is_one_line_naming_the_package(tmp_path):
    root = _checkout(tmp_path)
    path = _bin_with(tmp_path, python3=sys.executable, dirname=shutil.which("dirname"))
    for script in ("demo.sh", "test.sh"):
        r = _run(root, script, path)
        assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
        assert r.stderr == "error: g++ not found (it builds the ray sampler operator); install it (Debian/Ubuntu: " \
                           "sudo apt-get install g++)\n", r.stderr


@needs_debian
def test_missing_python3_venv_is_one_line_naming_the_package(tmp_path):
    """Debian/Ubuntu without python3-venv have no ensurepip: here an ensurepip that cannot be
    imported stands first on the Python path."""
    root = _checkout(tmp_path)
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "ensurepip.py").write_text("raise ImportError('ensurepip is not installed (python3-venv)')\n")
    r = _run(root, "demo.sh", "/usr/bin:/bin", env={"PYTHONPATH": str(shadow)})
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "externally managed (PEP 668)" in r.stderr
    assert "sudo apt-get install python3-venv" in r.stderr, r.stderr
    assert not (root / ".venv").exists()
