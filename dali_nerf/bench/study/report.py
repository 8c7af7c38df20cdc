"""The study's ``report.md``, ``derived.json`` and PNG plots, written from what the study derived
(:func:`write_report`), and written again from a saved ``derived.json`` (:func:`report_from_derived`:
on the study's own output, the same report.md byte for byte).

>>> report_from_derived("docs/study/cpu-2core-x86_64/derived.json", Path("/tmp/again"))
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import List, Optional, Sequence

from ...atomic import atomic_write_text
from ...errors import DaliNerfError
from .. import costmodel as cm
from .. import plots
from . import sections as S
from .sections import SAMPLER_SECTION, SAMPLER_SKIPPED, SAMPLING_COST

__all__ = ["write_report", "report_from_derived", "sampler_table_of"]


def write_report(out_dir: Path, derived: dict, model: cm.CostModel, validation: List[dict],
                 projection: List[dict], assumptions: "cm.ProjectionAssumptions", meta: dict,
                 sampling: Optional[dict] = None, sampler_table: Optional[str] = None,
                 emulation: Optional[dict] = None, cores: Optional[int] = None) -> Path:
    """Write ``report.md``, ``derived.json`` and the PNG plots into ``out_dir``; returns the report path.

    ``cores``: the study host's CPU cores (the sampler's host capacity); None: this host's."""
    cores = cores if cores is not None else os.cpu_count()
    out_dir.mkdir(parents=True, exist_ok=True)
    runs, sps = derived["runs"], derived["speedups"]
    cpu = [c for c in runs if c["device"] != "emulated"]
    emu = [c for c in runs if c["device"] == "emulated"]
    plots.plot_phases(cpu or runs, out_dir / "phases.png")
    plots.plot_speedups(sps, out_dir / "speedup.png")
    plots.plot_model_check(validation, out_dir / "model_check.png")
    plots.plot_projection(projection, assumptions.lines(), out_dir / "projection.png")
    if emu:
        plots.plot_scaling(emu, out_dir / "scaling.png")

    L = (S.header(meta, emu) + S.result(derived["summary"], emu, sps, meta) + S.cpu_rows(cpu, meta)
         + S.emulated_rows(emu, emulation, meta, sampling, cores) + S.speedup_table(sps)
         + S.sampler_section(sampler_table, sampling) + S.cost_model_section(model, validation, meta)
         + S.projection_section(projection, assumptions))
    L.append("")
    md = model.to_dict()
    report = out_dir / "report.md"
    atomic_write_text(report, "\n".join(L))
    raw = {"meta": meta, "derived": derived, "cost_model": md, "validation": validation,
           "projection_assumptions": assumptions.lines(), "projection": projection,
           "emulation": {k: v for k, v in (emulation or {}).items() if k != "dirs"},
           "sampling": {k: v for k, v in (sampling or {}).items() if k != "profile"}}
    atomic_write_text(out_dir / "derived.json", json.dumps(raw, indent=1, default=lambda o: str(o) if isinstance(o, Path) else float(o)))
    return report


def sampler_table_of(report_md: Path) -> Optional[str]:
    """The ``dali-nerf bench sampler`` table of a study's ``report.md`` (its "Sampler throughput"
    section up to the sampling-cost table or the next section), as :func:`write_report` was given it;
    None when the study skipped it. derived.json does not keep this table: the report is its only record."""
    report_md = Path(report_md)
    if not report_md.is_file():
        raise DaliNerfError(f"{report_md}: missing; the sampler table is kept only in the report written with "
                            "derived.json: put that report.md beside it")
    text = report_md.read_text()
    head = f"\n{SAMPLER_SECTION}\n\n"
    if head not in text:
        raise DaliNerfError(f"{report_md}: no '{SAMPLER_SECTION}' section; not a study report")
    body = text.split(head, 1)[1]
    end = min(i for i in (body.find(f"\n\n{SAMPLING_COST}"), body.find("\n\n## "), len(body)) if i >= 0)
    table = body[:end].strip()
    return None if table == SAMPLER_SKIPPED else table


def _assumptions_of(lines: Sequence[str], projection: List[dict]) -> "cm.ProjectionAssumptions":
    """The :class:`~dali_nerf.bench.costmodel.ProjectionAssumptions` whose ``lines()`` derived.json
    kept (the numbers as printed there), with the node and GPU counts of its projection rows."""
    pats = (r"GPU compute per step: ([\d.]+) ms at (\d+) rays/GPU \((.*)\)$",
            r"host CPU cores per GPU for sampling: (\S+) \(",
            r"all-reduce inside a node: (\d+) us \+ bytes / (\d+) GB/s",
            r"all-reduce across nodes: (\d+) us \+ bytes / (\d+) GB/s")
    m = [re.match(p, x) for p, x in zip(pats, lines)]
    if len(lines) < len(pats) or not all(m):
        raise DaliNerfError("derived.json: projection_assumptions are not the lines this code writes; "
                            "regenerate the report with the code that wrote it")
    a = cm.ProjectionAssumptions(
        gpu_compute_s=float(m[0][1]) * 1e-3, gpu_compute_source=m[0][3], rays_per_rank=int(m[0][2]),
        cores_per_gpu=float(m[1][1]), intra_latency_s=float(m[2][1]) * 1e-6, intra_bytes_per_s=float(m[2][2]) * 1e9,
        inter_latency_s=float(m[3][1]) * 1e-6, inter_bytes_per_s=float(m[3][2]) * 1e9,
        gpus_per_node=tuple(sorted({p["gpus_per_node"] for p in projection})),
        nodes=tuple(sorted({p["nodes"] for p in projection})))
    if a.lines() != list(lines):
        raise DaliNerfError("derived.json: projection_assumptions differ from the lines this code writes; "
                            "regenerate the report with the code that wrote it")
    return a


def report_from_derived(derived_json, out_dir) -> Path:
    """Rewrite a study's ``report.md`` (and plots, derived.json) into ``out_dir`` from its
    ``derived.json``: the derivation, cost model, validation, projection and its assumptions, meta,
    sampling and emulation as it keeps them, the host's cores from ``meta["machine"]``
    (:func:`~dali_nerf.bench.study.provenance.machine_slug`), and the sampler table from the ``report.md`` beside it
    (:func:`sampler_table_of`). Returns the new report's path; on the study's own output the report
    is byte for byte the one the study wrote.

    >>> report_from_derived("docs/study/cpu-2core-x86_64/derived.json", Path("/tmp/again"))"""
    derived_json = Path(derived_json)
    try:
        raw = json.loads(derived_json.read_text())
        meta = raw["meta"]
        cores = int(re.search(r"-(\d+)core-", meta["machine"])[1])
        model = cm.CostModel(**{k: v for k, v in raw["cost_model"].items() if k != "notes"},
                             notes=tuple(raw["cost_model"]["notes"]))
        parts = (raw["derived"], raw["validation"], raw["projection"], raw["projection_assumptions"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DaliNerfError(f"{derived_json}: not a study's derived.json ({type(e).__name__}: {e})") from None
    table = sampler_table_of(derived_json.with_name("report.md"))
    assumptions = _assumptions_of(parts[3], parts[2])
    return write_report(Path(out_dir), parts[0], model, parts[1], parts[2], assumptions, meta,
                        raw.get("sampling") or None, table, raw.get("emulation") or None, cores=cores)
