"""The data path's module graph: pipelines/ holds DALI graphs only, the sources import the graphs
(never the other way), the compatibility modules re-export the sources, and DALI is imported only
when a graph is built."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "dali_nerf"

# modules pipelines/ must not import: the batch sources, the baselines, the training loop, trainers
FORBIDDEN_IN_PIPELINES = ("dali_nerf.sources", "dali_nerf.loader", "dali_nerf.baseline", "dali_nerf.training",
                          "dali_nerf.trainers", "dali_nerf.bench")


def _imports(path: Path, package: str):
    """Absolute names of every module imported anywhere in ``path`` (function bodies included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module
            out.append(mod)
            out += [f"{mod}.{a.name}" for a in node.names]  # "from dali_nerf import baseline"
    return out


def _bad(names, forbidden):
    return sorted({n for n in names for f in forbidden if n == f or n.startswith(f + ".")})


def test_pipelines_import_no_sources_baselines_or_trainers():
    files = sorted((REPO / "pipelines").glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "decode.py", "rays.py"}
    for f in files:
        bad = _bad(_imports(f, "dali_nerf.pipelines"), FORBIDDEN_IN_PIPELINES)
        assert not bad, f"{f.relative_to(REPO)} imports {bad}: pipelines/ holds DALI graph definitions only"


def test_the_checker_sees_relative_and_function_level_imports(tmp_path):
    f = tmp_path / "g.py"
    f.write_text("def build():\n    from ..sources import RayLoader\n    from dali_nerf import baseline\n")
    assert _bad(_imports(f, "dali_nerf.pipelines"), FORBIDDEN_IN_PIPELINES) == [
        "dali_nerf.baseline", "dali_nerf.sources", "dali_nerf.sources.RayLoader"]


def test_nothing_in_the_package_imports_through_the_compatibility_modules():
    roots = [PKG, REPO / "pipelines", REPO / "trainers"]
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            if f.name in ("loader.py", "baseline.py") and f.parent == PKG:
                continue
            bad = _bad(_imports(f, "dali_nerf." + ".".join(f.relative_to(root).parts[:-1])),
                       ("dali_nerf.loader", "dali_nerf.baseline"))
            assert not bad, f"{f.relative_to(REPO)} imports {bad}; import from dali_nerf.sources"


def test_only_the_lazy_loader_modules_import_dali():
    """DALI is imported in dali_nerf/_dali.py (the decode and ray graphs, the torch feed) and the
    operator loader; nowhere else in the package."""
    allowed = {PKG / "_dali.py", PKG / "ops" / "__init__.py"}
    for root in (PKG, REPO / "pipelines", REPO / "trainers"):
        for f in sorted(root.rglob("*.py")):
            if f in allowed:
                continue
            bad = _bad(_imports(f, "dali_nerf"), ("nvidia.dali",))
            assert not bad, f"{f.relative_to(REPO)} imports {bad}; go through dali_nerf._dali"


def test_compatibility_modules_reexport_the_sources():
    import dali_nerf
    from dali_nerf import baseline, loader, sources

    for mod in (loader, baseline):
        for name in mod.__all__:
            assert getattr(mod, name) is getattr(sources, name), f"{mod.__name__}.{name}"
    assert dali_nerf.RayLoader is sources.RayLoader


@pytest.mark.parametrize("module", ["dali_nerf", "dali_nerf.sources", "dali_nerf.pipelines.rays", "dali_nerf.training",
                                    "dali_nerf.trainers.spatial"])
def test_importing_the_data_path_imports_no_dali(module):
    code = (f"import sys, {module}; bad = [m for m in sys.modules if m.startswith('nvidia.dali')]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
