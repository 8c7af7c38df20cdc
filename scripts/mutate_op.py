#!/usr/bin/env python3
"""Planted-bug campaign for the C++ operator (dali_nerf/ops/csrc): how many bugs the op's tests catch.

mutmut mutates Python only, so the op — the product's core — needs its own campaign. Each mutant
changes one token of one CPU source file (``.cc`` / ``.h``; the CUDA ``.cu`` is compiled only where
a GPU runs its tests, so it is not mutated here):

* arithmetic ``+ - * /`` and compound ``+= -= *= /=`` (each to its counterpart);
* comparisons ``< <= > >= == !=`` (bounds: ``<`` <-> ``<=``, ``>`` <-> ``>=``; ``==`` <-> ``!=``);
* logic and bits ``&& || & | ^ << >>`` (``&&`` <-> ``||``, ``&`` <-> ``|``, ``^`` -> ``&``,
  ``<<`` <-> ``>>``);
* integer and floating literals (``0`` -> ``1``, ``n`` -> ``n + 1``; ``0.5`` -> ``0.25``-style
  halving for floats).

Comments, string literals and preprocessor lines are left alone. For each mutant the file is
rewritten in place, the plugin rebuilt (its build key hashes ``csrc/``, so every mutant is its own
build under a scratch ``DALI_NERF_CACHE``), the op's tests run (``TESTS``, stopping at the first
failure), and the file restored. A mutant is

* **killed** when a test fails or errors (or the run passes its time limit: ``timeout``, counted
  as killed and listed),
* **survived** when every test passes,
* **stillborn** when the plugin does not compile (left out of the score: the compiler caught it).

Score = killed / (killed + survived). The campaign shuffles every site with ``--seed`` and runs them in that order until
``--sample`` mutants compiled (a uniform sample of the compiling mutants); report the score of a sample drawn *after* writing tests for an earlier sample's
survivors with another seed — rescoring the same sample overstates it.

    python scripts/mutate_op.py --list                  # count the sites per file, no run
    python scripts/mutate_op.py --sample 40 --seed 1    # run 40 mutants (about a minute each here)
    python scripts/mutate_op.py --show 17 --seed 1   # mutant 17 of seed 1's order: its file, line, change
    python scripts/mutate_op.py --replay .mutation/op/1-40.json   # rerun that file's survivors

Run it in a checkout of its own (it rewrites csrc files while it runs and restores each; it refuses
to start when csrc has uncommitted changes). Results: ``.mutation/op/<seed>-<sample>.json``
(git-ignored). Outside CI: a sample of 40 takes about an hour on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "dali_nerf" / "ops" / "csrc"
OUT = REPO / ".mutation" / "op"
FILES = ("ray_sampler.cc", "writer.cc", "routing.cc", "global.cc", "walk.cc",
         "ray_sampler.h", "streams.h", "ray_math.h", "hd.h", "writer.h", "routing.h", "global.h", "walk.h", "mask.h")
TESTS = ("tests/test_op.py", "tests/test_op_global.py", "tests/test_op_masks.py", "tests/test_properties_rays.py",
         "tests/test_properties_routing.py")
TIMEOUT_S = 900

SWAP = {"+": "-", "-": "+", "*": "/", "/": "*", "+=": "-=", "-=": "+=", "*=": "/=", "/=": "*=",
        "<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==",
        "&&": "||", "||": "&&", "&": "|", "|": "&", "^": "&", "<<": ">>", ">>": "<<"}
# longest first: the lexer must not split ->, ::, ++, <<= ...
_TOKEN = re.compile(r"""
    (?P<skip>//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
  | (?P<num>(?<![\w.])(?:0[xX][0-9a-fA-F]+|\d+\.\d*(?:[eE][-+]?\d+)?|\d+(?:[eE][-+]?\d+)?)[uUlLfF]*(?![\w.]))
  | (?P<op><<=|>>=|->\*?|::|\+\+|--|&&|\|\||<<|>>|<=|>=|==|!=|\+=|-=|\*=|/=|[-+*/<>&|^])
  | (?P<word>[A-Za-z_]\w*)
""", re.S | re.X)


@dataclass(frozen=True)
class Mutant:
    file: str
    start: int  # byte offset of the token in the file
    old: str
    new: str
    line: int


def _sites(name: str, text: str) -> list:
    """Every mutable token of one file (outside comments, strings and preprocessor lines)."""
    out = []
    pre = {i for i, ln in enumerate(text.split("\n")) if ln.lstrip().startswith("#")}
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind in ("skip", "word"):
            continue
        line = text.count("\n", 0, m.start())
        if line in pre:
            continue
        tok = m.group(kind)
        if kind == "op":
            if tok in SWAP:
                out.append(Mutant(name, m.start(), tok, SWAP[tok], line + 1))
        else:
            out.append(Mutant(name, m.start(), tok, _bump(tok), line + 1))
    return out


def _bump(tok: str) -> str:
    """A literal's mutant: integers n -> n + 1 (0 -> 1, 1 -> 0), floats halved."""
    hexa = tok.lower().startswith("0x")
    core = tok.rstrip("uUlL" if hexa else "uUlLfF")
    suffix = tok[len(core):]
    if hexa:
        return hex(int(core, 16) + 1) + suffix
    if any(c in core for c in ".eE"):
        v = float(core) / 2 if float(core) != 0 else 1.0
        return repr(v) + ("f" if "f" in suffix.lower() else "")
    v = int(core)
    return str(0 if v == 1 else v + 1) + suffix


def all_sites() -> list:
    return [s for f in FILES for s in _sites(f, (CSRC / f).read_text())]


def draw(seed: int) -> list:
    """Every site in the order the seed shuffles them: a sample of N is the first N that compile."""
    sites = all_sites()
    random.Random(seed).shuffle(sites)
    return sites


def _apply(m: Mutant, text: str) -> str:
    assert text[m.start:m.start + len(m.old)] == m.old, (m, text[m.start:m.start + 20])
    return text[:m.start] + m.new + text[m.start + len(m.old):]


def _run_one(m: Mutant, cache: str, python: str) -> dict:
    path = CSRC / m.file
    original = path.read_text()
    env = dict(os.environ, DALI_NERF_CACHE=cache, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    try:
        path.write_text(_apply(m, original))
        b = subprocess.run([python, "-c", "from dali_nerf.ops import build_plugin; build_plugin()"],
                           cwd=REPO, env=env, capture_output=True, text=True)
        if b.returncode != 0:
            return {"status": "stillborn", "seconds": time.monotonic() - t0}
        try:
            r = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                                *TESTS], cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "seconds": time.monotonic() - t0}
        tail = [ln for ln in r.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))][:1]
        status = "survived" if r.returncode == 0 else "killed"
        return {"status": status, "seconds": time.monotonic() - t0, "caught_by": tail[0] if tail else ""}
    finally:
        path.write_text(original)


def _clean_csrc() -> bool:
    r = subprocess.run(["git", "status", "--porcelain", "--", str(CSRC)], cwd=REPO, capture_output=True, text=True)
    return r.returncode == 0 and not r.stdout.strip()


def score(results: list) -> tuple:
    killed = sum(r["status"] in ("killed", "timeout") for r in results)
    survived = sum(r["status"] == "survived" for r in results)
    return killed, survived, (killed / (killed + survived) if killed + survived else float("nan"))


def replay(path: Path, python: str) -> int:
    """Rerun the mutants a results file lists as survived (after tests were written for them)."""
    fields = ("file", "start", "old", "new", "line")
    survivors = [Mutant(**{k: d[k] for k in fields}) for d in json.loads(path.read_text())
                 if d["status"] == "survived"]
    left = 0
    with tempfile.TemporaryDirectory(prefix="mutate_op_cache_") as cache:
        for m in survivors:
            text = (CSRC / m.file).read_text()
            if text[m.start:m.start + len(m.old)] != m.old:
                print(f"{m.file}:{m.line}: the source moved since {path}; draw a new sample", file=sys.stderr)
                return 2
            r = _run_one(m, cache, python)
            left += r["status"] == "survived"
            print(f"{m.file}:{m.line} {m.old!r}->{m.new!r}: {r['status']} ({r['seconds']:.0f} s) "
                  f"{r.get('caught_by', '')}", flush=True)
            for p in Path(cache).iterdir():
                subprocess.run(["rm", "-rf", str(p)])
    print(f"{len(survivors) - left} of {len(survivors)} earlier survivors now killed")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Planted-bug campaign for the C++ operator (csrc).")
    ap.add_argument("--list", action="store_true", help="count the mutation sites per file and stop")
    ap.add_argument("--sample", type=int, default=40,
                    help="how many mutants that compile to run, drawn in the seed's order from every site")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--show", type=int, help="print mutant K of the sample (its file, line, change) and stop")
    ap.add_argument("--replay", type=Path,
                    help="rerun the survivors of this results file against today's tests (csrc unchanged)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose environment runs the tests")
    a = ap.parse_args(argv)
    if a.list:
        sites = all_sites()
        for f in FILES:
            print(f"{f:16s} {sum(s.file == f for s in sites):5d}")
        print(f"{'total':16s} {len(sites):5d}")
        return 0
    mutants = draw(a.seed)
    if a.show is not None:
        m = mutants[a.show]
        line = (CSRC / m.file).read_text().split("\n")[m.line - 1]
        print(f"{m.file}:{m.line}: {m.old!r} -> {m.new!r}\n  {line.strip()}")
        return 0
    if not _clean_csrc():
        print(f"mutate_op: {CSRC.relative_to(REPO)} has uncommitted changes; commit or stash them first "
              "(every mutant is restored from the file as it is)", file=sys.stderr)
        return 2
    if a.replay is not None:
        return replay(a.replay, a.python)
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"{a.seed}-{a.sample}.json"
    done = json.loads(out.read_text()) if out.is_file() else []
    seen = {(d["file"], d["start"]) for d in done}
    print(f"{a.sample} compiling mutants (seed {a.seed}) of {len(mutants)} sites; tests: {' '.join(TESTS)}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="mutate_op_cache_") as cache:
        for i, m in enumerate(mutants):
            if sum(d["status"] != "stillborn" for d in done) >= a.sample:
                break
            if (m.file, m.start) in seen:
                continue
            r = {**asdict(m), "index": i, **_run_one(m, cache, a.python)}
            done.append(r)
            out.write_text(json.dumps(done, indent=1))
            print(f"[{i + 1}] {m.file}:{m.line} {m.old!r}->{m.new!r}: {r['status']} "
                  f"({r['seconds']:.0f} s) {r.get('caught_by', '')}", flush=True)
            for p in Path(cache).iterdir():  # one build per mutant: do not keep them
                subprocess.run(["rm", "-rf", str(p)])
    k, s, sc = score(done)
    still = sum(d["status"] == "stillborn" for d in done)
    print(f"score {k}/{k + s} = {100 * sc:.1f}% killed ({still} stillborn left out); results in {out}")
    for d in done:
        if d["status"] == "survived":
            print(f"  survived: {d['file']}:{d['line']} {d['old']!r} -> {d['new']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
