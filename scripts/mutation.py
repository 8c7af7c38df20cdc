#!/usr/bin/env python3
"""Mutation score of one module group, with mutmut 3.8.

mutmut is a developer tool, not a dependency of the package: ``pip install mutmut==3.8.1`` into
the environment that runs the tests (the test extra: ``pip install -e .[test]``).

    python scripts/mutation.py --list               # the groups, their modules and tests
    python scripts/mutation.py stream               # mutate the group's modules, run its tests, print the score
    python scripts/mutation.py stream --fresh       # from scratch (what docs/RELIABILITY.md records)
    python scripts/mutation.py stream --retest      # retest the mutants not caught (after adding tests)
    python scripts/mutation.py stream --retest --retest-timeouts   # and the timeouts
    python scripts/mutation.py stream --score       # the last run's score, no run
    python scripts/mutation.py stream --survivors   # the diff of every mutant not killed, no run
    python scripts/mutation.py state --sample 100   # 100 mutants drawn at random (--seed 0): an estimate

Each group runs in its own folder ``.mutation/<group>/`` (git-ignored): links to the repository's
``dali_nerf``, ``tests``, ... and a ``setup.cfg`` that is the repository's plus the group's
``[mutmut]`` section, so the repository's setup.cfg carries no mutmut configuration and each
group keeps its own results cache (``.mutation/<group>/mutants/``; a plain run retests only the
functions whose source changed). Inside it run ``mutmut results`` / ``mutmut show <name>`` /
``mutmut run <name>`` as usual. The groups are defined once, in :data:`GROUPS`.

Tests: each group names the test files that exercise its modules in-process. Tests that start
trainer subprocesses or torchrun are left out (their subprocesses import the package afresh and
do not see the mutant under test, and they are slow). ``--max-children`` defaults to 1 (the
shared 2-core machine). Set ``DALI_NERF_CACHE`` so that the operator plugin is built once.

Score: (killed + timeout) / total per module; mutants no selected test reaches ("no tests") count
as survivors, as do "suspicious" ones. The C++ operator is not mutated (mutmut mutates Python).
With ``--sample N`` the score is that of N mutants drawn uniformly (``--seed``) from the group's:
an estimate (about +-6 points at 95% for N = 150 and a score near 85%) where running every mutant
takes hours on two cores; pass the same ``--sample``/``--seed`` to ``--score``, ``--retest`` and
``--survivors``. Changing a group's test selection or mutmut settings makes mutmut drop the
group's results (its config fingerprint changes): rerun the sample after such a change.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["GROUPS", "Group", "main"]

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".mutation"
# what each group folder links to (the package and what the tests read from the checkout)
LINKED = ("dali_nerf", "tests", "pipelines", "trainers", "configs", "scripts", "benchmarks")
ALSO_COPY = ("pipelines", "trainers", "configs", "scripts", "benchmarks")
PYTEST_ARGS = ("-p", "no:randomly", "-q", "--hypothesis-seed=0")


@dataclass(frozen=True)
class Group:
    """One mutation run: the modules mutated (paths from the repository root) and the pytest
    arguments selecting the tests that exercise them (files, node ids, ``--deselect``, ``-k``).
    ``names``: when given, only the mutants whose mutmut name matches one of these fnmatch
    patterns are run and scored (the functions of a module that the group is about, e.g.
    ``*ǁstate_dict__mutmut_*`` for every class's ``state_dict``); the others stay "not checked"
    and are left out of the score."""

    modules: tuple[str, ...]
    tests: tuple[str, ...]
    about: str = ""
    names: tuple[str, ...] = ()


# tests/test_bad_inputs.py's cases that run the CLIs in subprocesses, and those that train in-process
# (ddp_main): in mutmut's forked test runs their DALI pipelines hang (threads waiting on a futex,
# no CPU) until the time limit, which would count each such mutant as "timeout" (caught)
_BAD_INPUTS_SUBPROCESS = tuple(
    a for t in ("test_disk_full_during_checkpoint", "test_validate_cli_one_line_exit_2",
                "test_trainer_cli_corrupt_image_one_line_exit_2", "test_grayscale_and_16bit_train",
                "test_resume_with_a_checkpoint_that_does_not_fit", "test_resume_after_the_scene_changed")
    for a in ("--deselect", f"tests/test_bad_inputs.py::{t}"))

_SEP = "\u01c1"  # mutmut's separator of class and method in a mutant's name (xǁClassǁmethod)

GROUPS: dict[str, Group] = {
    "stream": Group(
        about="stream keys and seeds; the numpy reference of the op's global stream",
        modules=("dali_nerf/data/seeds.py", "dali_nerf/ops/reference.py"),
        tests=("tests/test_seeds.py", "tests/test_op_global.py", "tests/test_op.py",
               "tests/test_properties_stream.py"),
    ),
    "partition": Group(
        about="SS cells, ray routing, fusion weights",
        modules=("dali_nerf/partition/cells.py", "dali_nerf/partition/routing.py",
                 "dali_nerf/partition/blend.py"),
        tests=("tests/test_partition.py", "tests/test_properties_routing.py", "tests/test_fused.py",
               # the op's routing with a box against ray_cells (the rest of test_op.py tests the op)
               "tests/test_op.py::test_routing_with_bounds_matches_partition_reference"),
    ),
    "scenes": Group(
        about="scene parsers, the Scene record, scene fingerprints",
        modules=tuple(f"dali_nerf/scenes/{m}.py" for m in
                      ("blender", "nerfstudio", "llff", "mega_nerf", "_util", "fingerprint", "base")),
        tests=("tests/test_scenes.py", "tests/test_properties_scenes.py", "tests/test_scene_fingerprint.py",
               "tests/test_validate.py", "tests/test_lens_downscale.py", "tests/test_bounds.py",
               "tests/test_bad_inputs.py",
               "--deselect", "tests/test_properties_scenes.py::test_validate_cli_on_a_truncated_file_exits_2_with_one_line",
               *_BAD_INPUTS_SUBPROCESS),
    ),
    "config": Group(
        about="the run configuration: dataclasses, YAML, overrides, checks",
        modules=("dali_nerf/config/load.py", "dali_nerf/config/sections.py", "dali_nerf/config/bench.py",
                 "dali_nerf/config/checks.py"),
        tests=("tests/test_config.py", "tests/test_properties_config.py", "tests/test_bad_inputs.py",
               "--deselect", "tests/test_config.py::test_cli_exit_code_two_no_traceback",
               *_BAD_INPUTS_SUBPROCESS),
    ),
    "state": Group(
        about="the sources' state handling (state_dict / load_state_dict, seeks), the elastic resume rules, "
              "the keyed per-ray draws",
        modules=("dali_nerf/sources/rays.py", "dali_nerf/sources/spatial.py", "dali_nerf/sources/sync.py",
                 "dali_nerf/sources/runner.py", "dali_nerf/sources/base.py", "dali_nerf/train/resume.py",
                 "dali_nerf/data/plan.py", "dali_nerf/models/keyed.py"),
        names=(f"*{_SEP}state_dict__mutmut_*", f"*{_SEP}load_state_dict__mutmut_*", f"*{_SEP}state__mutmut_*",
               f"*{_SEP}load_state__mutmut_*", f"dali_nerf.sources.*{_SEP}_seek__mutmut_*",
               f"dali_nerf.sources.runner.*{_SEP}_cursor__mutmut_*", f"dali_nerf.sources.runner.*{_SEP}_restart__mutmut_*",
               f"dali_nerf.sources.rays.*{_SEP}set_step__mutmut_*", f"dali_nerf.sources.spatial.*{_SEP}_advance__mutmut_*",
               "dali_nerf.sources.base.x_scene_state__mutmut_*", "dali_nerf.sources.base.x_check_scene_state__mutmut_*",
               "dali_nerf.train.resume.x__check_elastic__mutmut_*", "dali_nerf.data.plan.x_run_stream__mutmut_*",
               "dali_nerf.models.keyed.*"),
        tests=("tests/test_keyed.py", "tests/test_elastic_stream.py", "tests/test_resume_rules.py",
               "tests/test_source_state.py", "tests/test_runner.py",
               "tests/test_loader.py::test_resume_exactly", "tests/test_loader.py::test_seek_off_the_step_grid_and_mutated_batches",
               "tests/test_loader.py::test_epoch_mode_permutations_and_set_epoch",
               "tests/test_spatial_loader.py::test_resume_is_exact",
               "tests/test_spatial_loader.py::test_a_state_loads_into_another_run_size",
               "tests/test_streaming.py::test_resume_exactly_across_window_boundary",
               "tests/test_scene_fingerprint.py::test_every_source_refuses_a_state_from_another_scene",
               "tests/test_scene_fingerprint.py::test_rayloader_refuses_another_scene_of_the_same_pixel_count"),
    ),
}

CAUGHT = ("killed", "timeout")
COLUMNS = ("killed", "timeout", "survived", "no tests", "suspicious", "segfault", "skipped", "not checked")


def group_dir(name: str) -> Path:
    return WORK / name


def write_setup(name: str) -> Path:
    """Create ``.mutation/<name>/`` (links + setup.cfg with the group's [mutmut] section)."""
    g, d = GROUPS[name], group_dir(name)
    d.mkdir(parents=True, exist_ok=True)
    for entry in LINKED:
        link = d / entry
        if not link.is_symlink():
            link.symlink_to(Path("..") / ".." / entry)
    lines = ["", "[mutmut]", "source_paths = dali_nerf", "only_mutate ="]
    lines += [f"    {m}" for m in g.modules]
    lines += ["also_copy ="] + [f"    {p}" for p in ALSO_COPY]
    lines += ["pytest_add_cli_args ="] + [f"    {a}" for a in PYTEST_ARGS]
    lines += ["pytest_add_cli_args_test_selection ="] + [f"    {t}" for t in g.tests]
    # a mutant is stopped (and counted as caught, "timeout") after (t + 10) * 3 s of wall time, t the
    # clean run of its tests (mutmut's default (t + 1) * 15 s let each endless cycle-walk of the
    # reference's Feistel permutation run for minutes; the constant keeps the fork's collection
    # of the test files on a loaded machine from counting as a timeout)
    lines += ["timeout_multiplier = 3", "timeout_constant = 10"]
    # the repository's checks on non-Python files would only warn about docs and the like
    lines += ["use_git_change_detection = false", ""]
    text = (REPO / "setup.cfg").read_text() + "\n".join(lines)
    cfg = d / "setup.cfg"
    if not cfg.exists() or cfg.read_text() != text:
        cfg.write_text(text)
    return d


SAMPLED: Optional[set] = None
"""The mutant names of ``--sample`` (None: all of the group's): what the score counts."""


def statuses(name: str, sampled: Optional[set] = ...) -> dict[str, dict[str, str]]:
    """{module: {mutant name: status}} from the group's last run (mutmut's .meta files), over the
    ``sampled`` names (default: :data:`SAMPLED`; None: all of the group's)."""
    from mutmut.stats import status_by_exit_code

    g, out = GROUPS[name], {}
    sampled = SAMPLED if sampled is ... else sampled
    for m in g.modules:
        meta = group_dir(name) / "mutants" / (m + ".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        out[m] = {k: status_by_exit_code[v] for k, v in codes.items()
                  if selected(g, k) and (sampled is None or k in sampled)}
    return out


def selected(g: Group, mutant: str) -> bool:
    """Whether the group runs and scores ``mutant`` (all of its modules' mutants unless ``names``)."""
    return not g.names or any(fnmatch.fnmatchcase(mutant, p) for p in g.names)


def score_table(name: str) -> str:
    """Markdown rows: module | killed / total | % | the counts of each status."""
    rows = ["| module | caught / total | score | " + " | ".join(COLUMNS) + " |",
            "|---" * (3 + len(COLUMNS)) + "|"]
    tot = {c: 0 for c in COLUMNS}
    for m, st in statuses(name).items():
        counts = {c: sum(1 for s in st.values() if s == c) for c in COLUMNS}
        for c in COLUMNS:
            tot[c] += counts[c]
        rows.append(_row(m, counts, len(st)))
    rows.append(_row("**all**", tot, sum(tot.values())))
    return "\n".join(rows)


def _row(label: str, counts: dict, total: int) -> str:
    caught = sum(counts[c] for c in CAUGHT)
    pct = f"{100 * caught / total:.1f}%" if total else "-"
    return f"| {label} | {caught} / {total} | {pct} | " + " | ".join(str(counts[c]) for c in COLUMNS) + " |"


_GENERATE = """
import os
from mutmut.__main__ import (copy_also_copy_files, copy_src_dir, create_mutants, set_mutant_under_test,
                             setup_source_paths, store_lines_covered_by_tests)
set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); store_lines_covered_by_tests(); create_mutants(1)
"""


def generate(name: str) -> None:
    """Write the group's mutants (and their .meta files, which list every mutant's name) without
    running any test: what ``mutmut run`` does first."""
    rc = subprocess.call([sys.executable, "-c", _GENERATE], cwd=group_dir(name), stdout=subprocess.DEVNULL,
                         env={**os.environ, **SINGLE_THREAD})
    if rc:
        raise SystemExit(f"mutant generation failed in {group_dir(name)} (exit {rc})")


def sample(name: str, n: int, seed: int) -> list[str]:
    """``n`` of the group's mutants drawn uniformly without replacement (random.Random(seed) over
    their sorted names): the same draw for the same source and (n, seed)."""
    names = sorted(k for st in statuses(name, sampled=None).values() for k in st)
    return sorted(random.Random(seed).sample(names, min(n, len(names))))


def not_killed(name: str, timeouts: bool = False) -> list[str]:
    """The mutants not caught (with ``timeouts``: not killed, i.e. the timeouts too)."""
    caught = ("killed",) if timeouts else CAUGHT
    return [k for st in statuses(name).values() for k, s in st.items() if s not in caught]


# mutmut forks each mutant's test run from a process that imported the tests (torch, numpy): a
# thread pool started there (OpenMP's, BLAS's) deadlocks in the forked child, which then hangs
# until its time limit and is counted "timeout" (caught) though its tests pass. One thread each:
SINGLE_THREAD = {v: "1" for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


def mutmut(name: str, *args: str) -> int:
    exe = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or "mutmut"
    return subprocess.call([exe, *args], cwd=group_dir(name), env={**os.environ, **SINGLE_THREAD})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("group", nargs="?", choices=sorted(GROUPS))
    ap.add_argument("--list", action="store_true", help="list the groups")
    ap.add_argument("--fresh", action="store_true", help="drop the group's results first")
    ap.add_argument("--retest", action="store_true", help="retest the mutants not caught (survived, no tests, ...)")
    ap.add_argument("--retest-timeouts", action="store_true", help="with --retest: the timeouts too")
    ap.add_argument("--score", action="store_true", help="print the last run's score only")
    ap.add_argument("--survivors", action="store_true", help="print each mutant not killed, with its diff")
    ap.add_argument("--sample", type=int, default=0, metavar="N",
                    help="run and score N of the group's mutants drawn at random (--seed): an estimate of the "
                         "score where running them all takes too long")
    ap.add_argument("--seed", type=int, default=0, help="the --sample draw's seed")
    ap.add_argument("--max-children", type=int, default=1)
    a = ap.parse_args(argv)
    global SAMPLED
    if a.list or not a.group:
        for n, g in GROUPS.items():
            print(f"{n}: {g.about}\n  modules: {' '.join(g.modules)}\n  tests: {' '.join(g.tests)}"
                  + (f"\n  mutants: {' '.join(g.names)}" if g.names else ""))
        return 0
    write_setup(a.group)
    if a.sample:
        if not all((group_dir(a.group) / "mutants" / (m + ".meta")).exists() for m in GROUPS[a.group].modules):
            generate(a.group)
        SAMPLED = set(sample(a.group, a.sample, a.seed))
    if a.survivors:
        for k in not_killed(a.group):
            mutmut(a.group, "show", k)
        return 0
    if not a.score:
        if a.fresh:
            shutil.rmtree(group_dir(a.group) / "mutants", ignore_errors=True)
        names = (not_killed(a.group, a.retest_timeouts) if a.retest else
                 sorted(SAMPLED) if SAMPLED is not None else list(GROUPS[a.group].names))
        if a.retest and not names:
            print("nothing to retest")
        else:
            rc = mutmut(a.group, "run", "--max-children", str(a.max_children), *names)
            if rc:
                return rc
    drawn = f", a sample of {len(SAMPLED)} mutants (--sample {a.sample} --seed {a.seed})" if SAMPLED is not None else ""
    print(f"\nmutation score, group {a.group}{drawn} ({', '.join(GROUPS[a.group].tests)}):\n")
    print(score_table(a.group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
