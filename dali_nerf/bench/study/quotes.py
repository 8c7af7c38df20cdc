"""What README.md and docs/BENCHMARKS.md quote from a study, written from its derived.json alone, so
that every number they give is the report's (one source): README's headline sentence and its
sampler rates (the blocks between ``<!-- study:headline -->`` / ``<!-- study:sampler -->`` and their
closing markers), BENCHMARKS' sentence on the committed report (``<!-- study:current -->``) and
its history row (inserted under ``<!-- study:history -->``, newest first).

    python -m dali_nerf.bench.study.quotes docs/study/cpu-2core-x86_64/derived.json            # print them
    python -m dali_nerf.bench.study.quotes docs/study/cpu-2core-x86_64/derived.json --write    # and write them

A derived.json of another format than :data:`~.report.REPORT_FORMAT` is refused in one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

from dali_nerf.atomic import atomic_write_text
from dali_nerf.errors import DaliNerfError
from dali_nerf.bench.study.fmt import ci_x, pct
from dali_nerf.bench.study.report import REPORT_FORMAT
from dali_nerf.bench.study.result_section import headline_sentence

__all__ = ["load", "readme_blocks", "benchmarks_current", "benchmarks_row", "write", "main", "BLOCKS", "HISTORY_MARK"]

BLOCKS = ("headline", "sampler")
"""README's blocks, each between ``<!-- study:NAME -->`` and ``<!-- /study:NAME -->``."""
HISTORY_MARK = "<!-- study:history -->"
"""BENCHMARKS' marker: the history table (format 4) follows it; rows go right under its header."""


def load(derived_json) -> dict:
    """A study's derived.json of the current format; DaliNerfError in one line otherwise."""
    p = Path(derived_json)
    try:
        raw = json.loads(p.read_text())
        fmt = int(raw["meta"].get("format", 1))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DaliNerfError(f"{p}: not a study's derived.json ({type(e).__name__}: {e})") from None
    if fmt != REPORT_FORMAT:
        raise DaliNerfError(f"{p}: a study report of format {fmt}; the quotes are written from format {REPORT_FORMAT}: "
                            f"regenerate it by rerunning its command: {raw['meta'].get('command')}")
    return raw


def _commit(meta: dict) -> str:
    """The report's commit, short (``-dirty`` kept: a report of a tree that differs from its commit says so)."""
    c = meta["commit"]
    return c[:7] + ("-dirty" if c.endswith("-dirty") else "")


def _when(meta: dict) -> str:
    return f"{meta['date'].split(' ')[0]}, {_commit(meta)}"


def _span(vals: List[float], fmt: str) -> str:
    lo, hi = min(vals), max(vals)
    a, b = format(lo, fmt), format(hi, fmt)
    return a if a == b else f"{a}-{b}"


def _sampler_block(raw: dict) -> Optional[str]:
    """README's sampler rates: RayLoader's Mrays/s over the study's batch sizes and its ratios to the
    other sources, from the study's ``bench sampler`` table."""
    sm = (raw.get("sampler") or {}).get("result")
    if not sm or not sm.get("rows"):
        return None
    meta, rows = raw["meta"], sm["rows"]
    rate = [r["rates"]["rays"] / 1e6 for r in rows]
    ratio = {k: [r["rates"]["rays"] / r["rates"][k] for r in rows] for k in ("torch_gather", "sync_local",
                                                                             "sync_global", "torch_workers")}
    bs = [r["rays"] for r in rows]
    return (f"`RayLoader` delivers {_span(rate, '.0f')} Mrays/s at {_span(bs, 'd')} rays per step on "
            f"{sm['cores']} cores ({meta.get('cpu') or meta['machine']}; {sm['scene']['images']} images, "
            f"{sm['scene']['pixels'] / 1e6:.0f} M pixels cached): {_span(ratio['torch_gather'] + ratio['sync_local'], '.1f')}x "
            f"a vectorised torch gather and sampling in the training thread, {_span(ratio['sync_global'], '.1f')}x the "
            f"ISPASS study's synchronous global sampler, {_span(ratio['torch_workers'], '.1f')}x torch DataLoader "
            f"workers (the study's `dali-nerf bench sampler` table, {_when(meta)})")


def readme_blocks(raw: dict) -> Dict[str, str]:
    """{block name: README's text for it} (:data:`BLOCKS`; a block the study has nothing for is left out)."""
    out = {}
    sentence = headline_sentence(raw["derived"]["summary"], raw["meta"])
    if sentence:
        out["headline"] = f"In one sentence, from the report of {_when(raw['meta'])}: {sentence}"
    sampler = _sampler_block(raw)
    if sampler:
        out["sampler"] = sampler
    return out


def benchmarks_current(raw: dict) -> str:
    """BENCHMARKS' sentence on the committed report: when, where, how long, and its headline's rule."""
    m = raw["meta"]
    return (f"The committed report: {m['date'].split(' ')[0]}, {_commit(m)}, {m['wall_s']:.0f} s on {m['machine']} "
            f"({m.get('cpu') or 'CPU not recorded'}; load average {m.get('load_avg_start', float('nan')):.1f} at its "
            f"start); its headline: {m.get('headline_rule') or '-'}.")


def benchmarks_row(raw: dict) -> str:
    """BENCHMARKS' history row of a study (format 4): date and commit, machine, wall time and load,
    the headline's overlap gains (with the control's factor) per rays per GPU, the like-for-like
    overlap gains, the pipelined stall, the flags and the cache row."""
    meta, s = raw["meta"], raw["derived"]["summary"]
    h = s.get("headline") or {}
    head = "; ".join(f"{r['ranks']} GPUs, {r['rays_per_rank']}: {ci_x(r, 'overlap_gain')}"
                     + ("" if r.get("control_factor") is None else f" (control {r['control_factor']:.2f}x)")
                     for r in h.get("rows") or []) or "-"
    lf = s.get("like_for_like")
    lfs = (f"{lf['overlap_gain_mean']:.2f}x / {lf['overlap_gain_max']:.2f}x over {len(lf['regimes'])}" if lf else "-")
    cache = "; ".join(f"{c['small']['rays_per_rank']} rays: {ci_x(c['small'], 'overlap_gain')} small / "
                      + (ci_x(c["main"], "overlap_gain") if c.get("main") else "-") + " main"
                      for c in s.get("cache") or []) or "-"
    return (f"| {meta['date'].split(' ')[0]} | {_commit(meta)} | {meta.get('cpu') or meta['machine']}, "
            f"{meta.get('l3') or '-'} | {meta['wall_s']:.0f} ({meta.get('load_avg_start', float('nan')):.1f}) | "
            f"{h.get('step') or '-'}: {head} | {lfs} | {pct(s.get('max_stall_pipelined'))} | "
            f"{s.get('flagged_pairs', 0)} of {s.get('pairs', 0)} | {cache} |")


def _replace_block(text: str, name: str, body: str, where: str) -> str:
    pat = re.compile(rf"(<!-- study:{name} -->)(.*?)(<!-- /study:{name} -->)", re.S)
    if not pat.search(text):
        raise DaliNerfError(f"{where}: no <!-- study:{name} --> ... <!-- /study:{name} --> block to write into")
    return pat.sub(lambda m: m[1] + body + m[3], text, count=1)


def _insert_row(text: str, row: str, where: str) -> str:
    if row in text:
        return text
    i = text.find(HISTORY_MARK)
    j = text.find("\n|---", i) if i >= 0 else -1
    if j < 0:
        raise DaliNerfError(f"{where}: no {HISTORY_MARK} followed by a table header to put the row under")
    k = text.index("\n", j + 1)
    return text[:k + 1] + row + "\n" + text[k + 1:]


def write(raw: dict, readme: Path, benchmarks: Path) -> None:
    """README's blocks replaced by :func:`readme_blocks`, BENCHMARKS' current block by
    :func:`benchmarks_current` and its row inserted (once)."""
    text = readme.read_text()
    for name, body in readme_blocks(raw).items():
        text = _replace_block(text, name, body, str(readme))
    bench = _replace_block(benchmarks.read_text(), "current", benchmarks_current(raw), str(benchmarks))
    atomic_write_text(readme, text)
    atomic_write_text(benchmarks, _insert_row(bench, benchmarks_row(raw), str(benchmarks)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dali_nerf.bench.study.quotes", description=__doc__.split("\n")[0])
    ap.add_argument("derived", help="a study's derived.json (format %d)" % REPORT_FORMAT)
    ap.add_argument("--write", action="store_true", help="write README.md's blocks and BENCHMARKS.md's row")
    ap.add_argument("--readme", default="README.md")
    ap.add_argument("--benchmarks", default="docs/BENCHMARKS.md")
    a = ap.parse_args(argv)
    try:
        raw = load(a.derived)
        for name, body in readme_blocks(raw).items():
            print(f"README <!-- study:{name} -->:\n{body}\n")
        print(f"BENCHMARKS <!-- study:current -->:\n{benchmarks_current(raw)}\n")
        print(f"BENCHMARKS row:\n{benchmarks_row(raw)}")
        if a.write:
            write(raw, Path(a.readme), Path(a.benchmarks))
            print(f"written: {a.readme}, {a.benchmarks}")
    except (DaliNerfError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
