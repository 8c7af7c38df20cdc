"""The package's layering, pinned so it cannot drift back (ARCHITECTURE.md, "The map" and "The walk").

The data path is one walk: config -> scene (``scenes.scene_from_config``) -> plan (``data/plan.py``,
the only caller of the host budget, the priority, the device and the global batch's share; every
exception listed with its reason in ``RESOLVERS``) -> image cache (``data/imagecache.py``, the one
place that decodes, with ``finish.py``) -> DALI graphs + op (``pipelines/``, ``ops/``, the op's
limits in ``ops/limits.py``) -> sources (``sources/``: the producers and the runner; the registry the
only constructor) -> the loop (``train/loop.py`` and its parts) -> trainers, the emulated mode, the
study. Imports go one way, function-level imports included; modules stay under 600 lines and
functions under 100.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "dali_nerf"
ROOTS = {"dali_nerf": PKG, "dali_nerf.pipelines": REPO / "pipelines", "dali_nerf.trainers": REPO / "trainers"}

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def _modules() -> dict:
    """{module name: path} of every module of the package (pipelines/ and trainers/ installed inside it)."""
    out = {}
    for prefix, root in ROOTS.items():
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if prefix == "dali_nerf" and parts[0] in ("pipelines", "trainers"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix] + parts)] = f
    return out


MODULES = _modules()


def _imports(path: Path, module: str, modules=None):
    """Absolute names imported anywhere in ``path`` (function bodies included): a ``from X import
    y`` names ``X.y`` when that is a module, else ``X``."""
    modules = MODULES if modules is None else modules
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
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
            for a in node.names:
                full = f"{mod}.{a.name}"
                out.append(full if full in modules else mod)
    return out


def _graph() -> dict:
    g = defaultdict(set)
    for name, path in MODULES.items():
        for imp in _imports(path, name):
            if imp in MODULES and imp != name:
                g[name].add(imp)
    return g


def _cycles(g: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(MODULES):
        if v not in index:
            visit(v)
    return out


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_check_sees_one(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from p import b\n")
    (pkg / "b.py").write_text("from p.a import f\n")
    mods = {"p.a": pkg / "a.py", "p.b": pkg / "b.py"}
    g = {m: {i for i in _imports(f, m, mods) if i in mods and i != m} for m, f in mods.items()}
    assert g == {"p.a": {"p.b"}, "p.b": {"p.a"}}
    assert _cycles.__code__  # the same Tarjan as above, on this graph:
    index_graph = defaultdict(set, g)
    global MODULES
    saved, MODULES = MODULES, mods
    try:
        assert _cycles(index_graph) == [["p.a", "p.b"]]
    finally:
        MODULES = saved


# the layers below must not import the layers above them (modules or packages, prefix match)
LOWER = ("dali_nerf.partition", "dali_nerf.sources", "dali_nerf.pipelines", "dali_nerf.data.plan", "dali_nerf.data.imagecache",
         "dali_nerf.data.finish", "dali_nerf.scenes", "dali_nerf.ops", "dali_nerf.data.hostbudget", "dali_nerf.data.seeds",
         "dali_nerf.config", "dali_nerf.data.imageio", "dali_nerf.launch_env", "dali_nerf.interrupt", "dali_nerf.errors")
UPPER = ("dali_nerf.models", "dali_nerf.train.loop", "dali_nerf.bench", "dali_nerf.train.emulation", "dali_nerf.train.emulated",
         "dali_nerf.trainers", "dali_nerf.cli.trainer", "dali_nerf.train.evaluation", "dali_nerf.train.resume", "dali_nerf.train.runtime",
         "dali_nerf.train.tasks", "dali_nerf.train.runlog", "dali_nerf.train.fieldsetup", "dali_nerf.cli.demo", "dali_nerf.cli.train", "dali_nerf.cli.render",
         "dali_nerf.cli.main", "dali_nerf.integrations")


@pytest.mark.parametrize("lower", LOWER)
def test_the_data_path_imports_nothing_above_it(lower):
    for name, path in MODULES.items():
        if _under(name, (lower,)):
            bad = sorted({i for i in _imports(path, name) if _under(i, UPPER)})
            assert not bad, f"{path.relative_to(REPO)} imports {bad}: {lower} sits below them"


def test_pipelines_hold_graphs_only():
    for name, path in MODULES.items():
        if _under(name, ("dali_nerf.pipelines",)):
            bad = sorted({i for i in _imports(path, name) if _under(i, ("dali_nerf.sources", "dali_nerf.data.imagecache",
                                                                          "dali_nerf.data.plan"))})
            assert not bad, f"{path.relative_to(REPO)} imports {bad}: pipelines/ holds DALI graph definitions only"


def test_the_config_and_the_op_read_the_op_limits_low():
    """The op's limits and DALI's shard rule are dali_nerf/ops/limits.py's: the config and the op
    package (its numpy reference) read them there, never from the graphs or the sources above them."""
    for name, path in MODULES.items():
        if _under(name, ("dali_nerf.config", "dali_nerf.ops")):
            bad = sorted({i for i in _imports(path, name) if _under(i, ("dali_nerf.pipelines", "dali_nerf.sources",
                                                                          "dali_nerf.data.plan", "dali_nerf.data.imagecache"))})
            assert not bad, f"{path.relative_to(REPO)} imports {bad}; take the op's limits from dali_nerf.ops.limits"


def test_the_loop_does_not_import_the_emulated_mode_or_the_study():
    for name, path in MODULES.items():
        if _under(name, ("dali_nerf.train.loop", "dali_nerf.train.runtime", "dali_nerf.train.resume", "dali_nerf.train.evaluation",
                         "dali_nerf.train.tasks", "dali_nerf.train.runlog", "dali_nerf.train.emulation")):
            bad = sorted({i for i in _imports(path, name) if _under(i, ("dali_nerf.train.emulated", "dali_nerf.bench",
                                                                          "dali_nerf.cli.main", "dali_nerf.cli.trainer"))})
            assert not bad, f"{path.relative_to(REPO)} imports {bad}"


def test_module_and_function_sizes():
    long_modules, long_functions = [], []
    for name, path in MODULES.items():
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(REPO)} ({n} lines)")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(REPO)}::{node.name} ({size} lines)")
    assert not long_modules and not long_functions, (long_modules, long_functions)


def _calls(path: Path, names) -> list:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if called in names:
                out.append(called)
    return out


# The functions that decode images, and the modules that may call them: the image cache owns decoding
# (dali_nerf/data/imagecache.py: CacheStore.shard / full / window for the sources, eval_cache for the
# evaluated views); the decode benchmarks time decode_cache itself.
DECODERS = {
    "decode_cache": {"dali_nerf.data.imagecache", "dali_nerf.bench.sampler", "dali_nerf.bench.decode"},
    "eval_cache": {"dali_nerf.data.imagecache", "dali_nerf.train.evaluation"},
    "decode_pipeline": {"dali_nerf.data.imagecache"},
    "decode_image_cv2": {"dali_nerf.data.imagecache"},
}


def test_images_are_decoded_by_their_owner_alone():
    """Decoding happens in dali_nerf/data/imagecache.py: no other module (a benchmark's timing and
    the evaluation's views aside) calls a decode function, and no batch source decodes for itself:
    a source samples the cache it is handed or asks the CacheStore it is handed (or its own)."""
    for name, path in _scripts().items():
        bad = sorted({f for f in _calls(path, set(DECODERS)) if name not in DECODERS[f]})
        assert not bad, f"{path.relative_to(REPO)} calls {bad}; decode through dali_nerf.data.imagecache.CacheStore"
    for name, path in MODULES.items():
        if _under(name, ("dali_nerf.sources",)):
            assert not _calls(path, set(DECODERS)), f"{path.relative_to(REPO)} decodes images itself"


def test_the_decode_check_sees_a_source_that_decodes(tmp_path):
    f = tmp_path / "src.py"
    f.write_text("from dali_nerf.data.imagecache import decode_cache\n\nclass S:\n    def __init__(self, scene):\n"
                 "        self.cache = decode_cache(scene, 0, 1)\n")
    assert _calls(f, set(DECODERS)) == ["decode_cache"]


SOURCE_CLASSES = {"RayLoader", "ImageLoader", "SpatialRayLoader", "SyncLocalSampler", "SyncGlobalSampler", "TorchWorkersSampler",
                  "RoutedSyncLocal", "RoutedSyncGlobal", "RoutedTorchWorkers", "ReadySource", "ShmScatter",
                  "global_scatter"}


def test_sources_are_constructed_only_in_the_registry():
    """Outside dali_nerf/sources/registry.py no package module builds a batch source (a source's own
    module may: ``ReadySource.first_of``, ``global_scatter``)."""
    own = {"ShmScatter": "dali_nerf.sources.shm_scatter"}
    for name, path in MODULES.items():
        if name == "dali_nerf.sources.registry":
            continue
        made = [c for c in _calls(path, SOURCE_CLASSES) if own.get(c) != name]
        assert not made, f"{path.relative_to(REPO)} constructs {sorted(set(made))}; build sources with dali_nerf.sources.registry"


# Every helper that decides a rank's sampling (the host budget's threads and run size, the priority of
# the threads that sample ahead, the device, the global batch's share), and the modules besides
# dali_nerf/data/plan.py and dali_nerf/data/hostbudget.py that may call it, each with its reason.
RESOLVERS = {
    "host_budget": {},
    "run_size": {"dali_nerf.bench.study.runs": "the scaling measurement sets n threads' run size as its config's "
                                               "pipeline.rays_per_run, which the plan then takes"},
    "resolve_priority": {},
    "check_priority": {},
    "resolve_device": {},
    "sampling_device": {"dali_nerf.train.loop": "a real run's process group is on the device its plan samples on",
                        "dali_nerf.bench.loop": "its --device, by the trainers' rule"},
    "global_batch_share": {"dali_nerf.train.resume": "a resume's note names the rays per rank the plan resolves",
                           "dali_nerf.integrations.nerfstudio": "its own key, pipeline.datamanager.global-batch"},
    # the host's cores are a fact, read (not decided) for a summary field, the study's provenance, a benchmark
    "usable_cores": {"dali_nerf.train.emulated": "summary.json host_cores",
                     "dali_nerf.bench.study.provenance": "the study's host cores",
                     "benchmarks/starvation.py": "one busy process more than the host's cores"},
}
DECIDERS = {"dali_nerf.data.plan", "dali_nerf.data.hostbudget"}


def _scripts() -> dict:
    """{name: path} of the package's modules and the benchmarks (benchmarks/<file>.py by its path)."""
    return dict(MODULES, **{f"benchmarks/{f.name}": f for f in sorted((REPO / "benchmarks").glob("*.py"))})


def test_the_plan_alone_resolves_budgets_priorities_devices_and_the_global_batch():
    for name, path in _scripts().items():
        if name in DECIDERS:
            continue
        used = {h for h in _calls(path, set(RESOLVERS)) if name not in RESOLVERS[h]}
        assert not used, (f"{path.relative_to(REPO)} calls {sorted(used)}; resolve them once in dali_nerf.data.plan "
                          f"(plan_from_config, SamplingPlan.for_loader)")


def test_the_single_decider_check_sees_a_call(tmp_path):
    """A benchmark that resolves a budget itself is caught, and every listed helper exists."""
    from dali_nerf.data import hostbudget, plan

    f = tmp_path / "bench.py"
    f.write_text("def main():\n    from dali_nerf.data.hostbudget import host_budget\n    return host_budget(4096).threads\n")
    assert _calls(f, set(RESOLVERS)) == ["host_budget"]
    for h in RESOLVERS:
        assert hasattr(hostbudget, h) or hasattr(plan, h), h
    assert "benchmarks/starvation.py" in _scripts()


def test_only_the_lazy_loader_modules_import_dali():
    """DALI is imported in dali_nerf/data/_dali.py (the decode and ray graphs, the torch feed) and the
    operator loader; nowhere else in the package."""
    allowed = {PKG / "data" / "_dali.py", PKG / "ops" / "__init__.py"}
    for name, path in MODULES.items():
        if path in allowed:
            continue
        bad = [i for i in _imports(path, name) if _under(i, ("nvidia.dali",))]
        assert not bad, f"{path.relative_to(REPO)} imports {bad}; go through dali_nerf.data._dali"


def test_the_checks_see_function_level_and_relative_imports(tmp_path):
    f = tmp_path / "g.py"
    f.write_text("def build():\n    from ..sources import RayLoader\n    from dali_nerf.train import loop\n")
    got = _imports(f, "dali_nerf.pipelines.g")
    assert "dali_nerf.sources" in got and "dali_nerf.train.loop" in got


@pytest.mark.parametrize("module", ["dali_nerf", "dali_nerf.sources", "dali_nerf.pipelines.rays", "dali_nerf.train.loop",
                                    "dali_nerf.trainers.spatial"])
def test_importing_the_data_path_imports_no_dali(module):
    code = (f"import sys, {module}; bad = [m for m in sys.modules if m.startswith('nvidia.dali')]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_importing_the_sources_loads_no_model_training_or_study():
    code = ("import sys, dali_nerf.sources; bad = [m for m in sys.modules if m.startswith(('dali_nerf.models', "
            "'dali_nerf.train.loop', 'dali_nerf.bench', 'dali_nerf.emulat'))]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_random_orders_seed_is_printed_first_and_last_also_under_q():
    """scripts/test.sh runs ``pytest -q``, which hides pytest-randomly's header: the conftest prints
    the seed on the first line and in the summary, so a failed run names the order to repeat."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "randomly", "--randomly-seed=4242", "tests/test_seeds.py"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300).stdout.splitlines()
    want = "random order: --randomly-seed=4242 (repeat it: bash scripts/test.sh -p randomly --randomly-seed=4242)"
    assert out[0] == want and want in out[-3:], out[:2] + out[-3:]
    off = subprocess.run(cmd[:3] + ["-p", "no:randomly", "tests/test_seeds.py"], capture_output=True, text=True,
                         cwd=REPO, timeout=300).stdout
    assert "random order" not in off and "passed" in off, off[-500:]
