"""The package as pip installs it: setup.cfg lists its packages by hand, so a wheel is built from the
tree (non-editable: ``pip wheel --no-deps --no-build-isolation``) and must hold every module of
dali_nerf/, pipelines/ and trainers/ (installed as dali_nerf.pipelines / dali_nerf.trainers), the
op's C++ sources and the configs (installed as dali_nerf/configs); and every module imports from an
install of that wheel into a folder of its own (not from this checkout). A new subpackage that
setup.cfg does not list fails here instead of in a user's install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# the tree's folders and where the wheel puts them (setup.cfg package_dir)
PLACES = {"dali_nerf": "dali_nerf", "pipelines": "dali_nerf/pipelines", "trainers": "dali_nerf/trainers",
          "configs": "dali_nerf/configs"}
EXTRAS = {"dali_nerf.integrations.nerfstudio": "nerfstudio"}
"""Modules that need an optional extra (setup.cfg extras_require), imported only where it is
installed: a key names the modules whose names start with it (nerfstudio, nerfstudio_splat)."""


def _wheel_path(path: Path) -> str:
    """Where the wheel holds a file of the tree."""
    rel = path.relative_to(REPO)
    return "/".join([PLACES[rel.parts[0]], *rel.parts[1:]])


def _tree_files() -> dict:
    """{wheel path: kind} of what the wheel must hold: every module, the op's sources, the configs."""
    out = {}
    for top in ("dali_nerf", "pipelines", "trainers"):
        for f in (REPO / top).rglob("*.py"):
            if top == "dali_nerf" and f.relative_to(REPO / top).parts[0] in ("pipelines", "trainers", "configs"):
                continue
            out[_wheel_path(f)] = "module"
    for f in (REPO / "dali_nerf" / "ops" / "csrc").iterdir():
        if f.suffix in (".h", ".cc", ".cu"):
            out[_wheel_path(f)] = "the op's source"
    for f in (REPO / "configs").glob("*.yaml"):
        out[_wheel_path(f)] = "config"
    return out


def _module_name(wheel_path: str) -> str:
    parts = wheel_path[:-len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of the tree (what setup.cfg and pyproject.toml build; the checkout is not
    touched: no build/ or egg-info folder is written into it)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so", "*.pyc")
    for top in ("dali_nerf", "pipelines", "trainers", "configs"):
        shutil.copytree(REPO / top, src / top, ignore=skip)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(root / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = (root / "dist").glob("dali_nerf-*.whl")
    return whl


def _missing(held: set, want: dict) -> list:
    return sorted(f"{p} ({kind})" for p, kind in want.items() if p not in held)


def test_the_wheel_holds_every_module_the_ops_sources_and_the_configs(wheel):
    want = _tree_files()
    missing = _missing(set(zipfile.ZipFile(wheel).namelist()), want)
    assert not missing, f"not in the wheel (add the package to setup.cfg packages / package_data): {missing}"
    assert sum(kind == "config" for kind in want.values()) >= 6 and "dali_nerf/ops/csrc/ray_sampler.cc" in want


def test_the_check_names_a_subpackage_the_wheel_lacks(wheel):
    """A wheel without one subpackage (what setup.cfg without its line builds) is caught, by name."""
    held = {n for n in zipfile.ZipFile(wheel).namelist() if not n.startswith("dali_nerf/sources/")}
    assert _missing(held, _tree_files()) == sorted(f"dali_nerf/sources/{f.name} (module)"
                                                   for f in (REPO / "dali_nerf" / "sources").glob("*.py"))


def test_every_module_imports_from_an_install_of_the_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                        str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    modules = sorted(_module_name(p) for p, kind in _tree_files().items()
                     if kind == "module" and not p.endswith("__main__.py"))
    names = sorted(f.stem for f in (REPO / "configs").glob("*.yaml"))
    code = f"""
import importlib, importlib.util, sys
target = {str(target.resolve())!r}
bad = []
for m in {modules!r}:
    extra = [e for k, e in {EXTRAS!r}.items() if m.startswith(k)]
    if extra and importlib.util.find_spec(extra[0]) is None:
        continue
    mod = importlib.import_module(m)
    if not (getattr(mod, "__file__", None) or "").startswith(target):
        bad.append((m, mod.__file__))
assert not bad, ("imported from outside the install", bad)
from dali_nerf.config import load_config, resolve_config, shipped_configs
assert str(resolve_config("ddp_objects")).startswith(target), resolve_config("ddp_objects")
assert {{n: str(p).startswith(target) for n, p in shipped_configs().items()}} == dict.fromkeys({names!r}, True)
load_config("ss_city", check_paths=False)
print(len(sys.modules))
"""
    # the install first on the path, run away from the checkout (no module of it is importable by cwd)
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
