"""``dali-nerf bench study``: the characterization study on this machine, as evidence.

Two kinds of rows, each configuration run ``bench.trials`` times in an order rotated between trials
(:func:`dali_nerf.bench.emulated.pair_order`: every baseline runs next to a pipelined run, and the
speedup of each trial comes from that adjacent pair):

* **cpu**: {DDP, SS} x ``bench.samplers`` x ``bench.ranks``, each run a real trainer process
  (``runs/<runs_dir>/study_<m>_<s>_<r>_t<trial>_<k>/``) with CPU compute;
* **emulated**: one launch per (method, ranks) (:mod:`dali_nerf.bench.emulated`) in which device
  compute, collectives and host-to-device copies are timed waits and host work is real
  (:data:`~dali_nerf.emulation.EMULATED_LABEL`), at every ``bench.emulated_step_ms``, beside the
  emulation floor (a source that hands out a ready batch).

Everything is then derived from the runs' ``metrics*.jsonl`` (:func:`derive`: mean and 95%
t-interval over trials of step time, stall and speedup; pairs flagged when the speedup is not
explained by the baseline's stall), the cost model is fit on the small emulated runs and checked
on those it did not see, and ``<bench.out>/<machine>/report.md`` is written with PNG plots and
``derived.json`` beside it.

    dali-nerf bench study --config configs/study.yaml [key=value ...]

>>> d = derive(["runs/study/study_ddp_sync_global_1_t0_0", "runs/study/study_ddp_rays_1_t0_1"], warmup=10)
>>> d["speedups"][0]["speedup"], d["speedups"][0]["speedup_ci"]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import yaml

from ..atomic import atomic_write_text
from ..config import Config, config_to_dict, load_config
from ..emulation import EMULATED_LABEL, RAY_FLOATS, DeviceLinks, EmulatedDevice, model_grad_bytes
from ..errors import ConfigError, DaliNerfError
from ..hostbudget import host_budget, loader_budget, resolve_priority
from ..scenegen import make_scene
from ..scenes import load_scene
from ..sources import build_source
from . import costmodel as cm
from . import emulated as em
from . import plots
from . import sampler as sb

__all__ = ["main", "derive", "read_run", "machine_slug", "git_commit", "run_grid", "run_emulated",
           "measure_sampling", "write_report", "report_from_derived", "sampler_table_of", "observations", "mean_ci", "derive_summary", "fit_and_check", "keeps_up", "keeps_up_reason", "PHASE_KEYS",
           "BAND"]

PHASE_KEYS = ("wait", "h2d", "forward", "backward", "sync", "optimizer")
BASELINES = ("sync_global", "sync_local", "torch_workers")
BAND = (0.9, 1.15)
"""speedup / ideal outside this band flags a pair (the speedup is not explained by the stall)."""


# ---------------------------------------------------------------------------------------------
# machine and provenance


def machine_slug() -> str:
    """``cpu-2core-x86_64`` or ``gpu-<name>-<n>x-<cores>core-<arch>`` (lower case, no spaces)."""
    cores = os.cpu_count() or 1
    arch = platform.machine() or "unknown"
    gpu = None
    try:
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
            gpu = f"gpu-{'-'.join(name.split())}-{torch.cuda.device_count()}x"
    except Exception:  # no driver: a CPU machine
        gpu = None
    return f"{gpu or 'cpu'}-{cores}core-{arch}"


def git_commit(repo: Optional[Path] = None, exclude: str = "docs/study") -> str:
    """``git rev-parse HEAD``, plus ``-dirty`` when tracked or untracked (not ignored) files outside
    ``exclude`` differ from it (the report itself lives under ``exclude``); "unknown" outside git."""
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", ".",
                                f":(exclude){exclude}"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


# ---------------------------------------------------------------------------------------------
# statistics

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def mean_ci(xs: Sequence[float]) -> tuple:
    """(mean, [lo, hi]): the 95% t-interval of the mean (Student's t, n - 1 degrees of freedom);
    one value: [x, x] (no interval can be given: the report says n = 1)."""
    x = np.asarray([v for v in xs if v is not None and math.isfinite(v)], np.float64)
    if x.size == 0:
        return float("nan"), [float("nan"), float("nan")]
    m = float(x.mean())
    if x.size == 1:
        return m, [m, m]
    t = _T975[x.size - 2] if x.size - 1 <= len(_T975) else 1.96
    h = t * float(x.std(ddof=1)) / math.sqrt(x.size)
    return m, [m - h, m + h]


# ---------------------------------------------------------------------------------------------
# derivation from metrics.jsonl


def _read_jsonl(path: Path) -> List[dict]:
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            raise DaliNerfError(f"{path}:{i + 1}: not a JSON line; delete the run folder and rerun the study") from None
    return out


def read_run(run_dir, warmup: Optional[int] = None) -> dict:
    """One run's per-step means after ``warmup`` steps, averaged over its ranks.

    Reads ``config.yaml`` (method, pipeline.name, rays_per_batch, train.device,
    train.emulated_step_ms, bench.warmup when ``warmup`` is None), ``metrics.jsonl`` and
    ``metrics.rank<R>.jsonl`` (one per rank; world size = their count), ``study.json`` when present
    (trial, order, pair: the pipelined run next to this baseline) and ``summary.json`` (test PSNR,
    SS fusion overhead).

    Returns {"name", "dir", "method", "sampler", "ranks", "device" (cpu | emulated | cuda),
    "emulated_step_ms", "trial", "order", "pair", "rays_per_rank", "steps_used", "phases_s"
    {wait, h2d, forward, backward, sync, optimizer} (mean seconds per step and rank), "compute_s"
    (h2d+forward+backward+optimizer), "step_s", "stall" (wait / step), "rays_per_s" (all ranks),
    "test_psnr", "fusion" {...}}.
    """
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise DaliNerfError(f"{cfg_path}: missing; {run_dir} is not a finished training run (rerun the study)")
    cfg = yaml.safe_load(cfg_path.read_text()) or {}
    if warmup is None:
        warmup = int((cfg.get("bench") or {}).get("warmup", 0))
    files = sorted(run_dir.glob("metrics.rank*.jsonl"), key=lambda p: int(p.name.split("rank")[1].split(".")[0]))
    if (run_dir / "metrics.jsonl").is_file():
        files = [run_dir / "metrics.jsonl"] + files
    if not files:
        raise DaliNerfError(f"{run_dir}: no metrics.jsonl; the run did not start (see its log) — rerun the study")
    per_rank = []
    for f in files:
        recs = [r for r in _read_jsonl(f) if int(r.get("step", 0)) > warmup]
        if not recs:
            raise DaliNerfError(f"{f}: no steps after the {warmup} warm-up steps; raise bench.steps or lower bench.warmup")
        per_rank.append({k: float(np.mean([r[f"{k}_s"] for r in recs])) for k in PHASE_KEYS + ("step",)}
                        | {"rays": float(np.mean([r.get("rays", 0) for r in recs])), "n": len(recs),
                           "cpu": float(np.mean([r["cpu_s"] for r in recs])) if all("cpu_s" in r for r in recs) else None})
    ph = {k: float(np.mean([r[k] for r in per_rank])) for k in PHASE_KEYS}
    step = float(np.mean([r["step"] for r in per_rank]))
    rays_per_step = float(np.sum([r["rays"] for r in per_rank]))
    summary = {}
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    st = {}
    if (run_dir / "study.json").is_file():
        st = json.loads((run_dir / "study.json").read_text())
    pipe = cfg.get("pipeline") or {}
    train = cfg.get("train") or {}
    device = st.get("device") or train.get("device", "cpu")
    device = {"auto": "cpu"}.get(device, device)
    ems = train.get("emulated_step_ms") if device == "emulated" else None
    # the share of the host's cores the ranks' processes kept busy (their threads; emulated rows)
    cpu = [r["cpu"] for r in per_rank]
    cores = int(((st.get("budget") or {}).get("cores")) or os.cpu_count() or 1)
    host_busy = float(np.sum(cpu)) / (step * cores) if None not in cpu and step > 0 else None
    return {
        "name": cfg.get("name", run_dir.name), "dir": str(run_dir), "method": cfg.get("method", "ddp"),
        "sampler": pipe.get("name", "rays"), "ranks": len(files), "device": device,
        "emulated_step_ms": float(ems) if ems is not None else None,
        "trial": int(st.get("trial", 0)), "order": st.get("order"), "pair": st.get("pair"),
        "rays_per_rank": int(round(rays_per_step / len(files))) if rays_per_step > 0 else int(pipe.get("rays_per_batch", 0)),
        "steps_used": min(r["n"] for r in per_rank), "warmup": warmup,
        "phases_s": ph, "compute_s": ph["h2d"] + ph["forward"] + ph["backward"] + ph["optimizer"],
        "step_s": step, "stall": ph["wait"] / step if step > 0 else 0.0,
        "rays_per_s": rays_per_step / step if step > 0 else 0.0,
        "test_psnr": summary.get("test_psnr"),
        "torch_threads": int(train.get("torch_threads", 0) or 0),
        "sampler_threads": int(pipe.get("num_threads", 0) or 0),
        "barrier_s": st.get("barrier_s"), "host_busy": host_busy,
        "fusion": {k: v for k, v in summary.items()
                   if k in ("fusion_overhead", "fused_render_s", "single_render_s", "fused_psnr")},
    }


def _key(r: dict) -> tuple:
    return (r["device"], r["method"], r["ranks"], r["emulated_step_ms"], r["rays_per_rank"], r["sampler"])


_HINTS = {
    "sync": "waiting at the lockstep / all-reduce for ranks still sampling: a straggler's sampling reaches every "
            "rank through the collective, and the per-rank wait does not count it",
    "h2d": "the copy's wait ends late: the rank's thread is woken late because the cores are busy sampling",
    "forward": "compute slowed or woken late: sampling competes with it for the cores and caches (thread budgets)",
    "backward": "compute slowed: sampling competes with it for the cores and caches (thread budgets)",
    "optimizer": "compute slowed: sampling competes with it for the cores and caches (thread budgets)",
}


def _cause(b: dict, p: dict, floor: Optional[dict] = None) -> str:
    """Why a pair's speedup differs from its ideal, from the phases. With a ``floor`` (the same
    step with no data cost) the ideal is the baseline's step over the floor's, so the pair is off
    when the pipelined run is off the floor: its step minus the floor's, phase by phase. Without
    one the ideal assumes the pipelined run differs from the baseline only by the baseline's wait:
    the step difference phase by phase, naming the largest phase outside the wait."""
    if floor is not None:
        d = {k: p["phases_s"][k] - floor["phases_s"][k] for k in PHASE_KEYS}
        parts = [f"pipelined step {p['step_s'] / floor['step_s']:.2f}x the floor's ({1e3 * (p['step_s'] - floor['step_s']):+.2f} ms = "
                 + ", ".join(f"{k} {1e3 * v:+.2f}" for k, v in d.items() if abs(v) >= 5e-5) + ")"]
        k = max(d, key=lambda x: d[x])
        if k == "wait" and d[k] > 0:
            parts.append("the pipelined run waits for batches (the host does not keep up)")
        elif d[k] > 0:
            parts.append(f"{k} longer than the floor's: the pipelined loader's host work (its sampling threads, "
                         "the hand-over) takes cores the ranks' own threads need, and in lockstep the slowest "
                         "rank sets every rank's step")
        if p.get("host_busy") is not None and floor.get("host_busy") is not None:
            parts.append(f"the ranks kept the cores {100 * p['host_busy']:.0f}% busy (the floor: "
                         f"{100 * floor['host_busy']:.0f}%)")
        if p["step_s"] < floor["step_s"]:
            parts.append("the pipelined run is faster than the floor: trial-to-trial spread (run order / machine drift)")
        return "; ".join(parts)
    d = {k: b["phases_s"][k] - p["phases_s"][k] for k in PHASE_KEYS}
    parts = [f"step {1e3 * (b['step_s'] - p['step_s']):+.2f} ms = "
             + ", ".join(f"{k} {1e3 * v:+.2f}" for k, v in d.items() if abs(v) >= 5e-5)]
    other = {k: v for k, v in d.items() if k != "wait"}
    k = max(other, key=lambda x: abs(other[x]))
    if abs(other[k]) > 0.1 * max(abs(d["wait"]), 1e-9) and abs(other[k]) > 0.02 * b["step_s"]:
        parts.append(f"{k} {'longer' if other[k] > 0 else 'shorter'} in the baseline: " + (
            _HINTS[k] if other[k] > 0 else "the pipelined loader's threads slow the training thread (shared cores)"))
    if p["stall"] > 0.02:
        parts.append(f"the pipelined run still waits {100 * p['stall']:.1f}% of its step (the host does not keep up)")
    if len(parts) == 1:
        parts.append("trial-to-trial spread (run order / machine drift): see the interval")
    return "; ".join(parts)


def derive(run_dirs: Sequence, warmup: Optional[int] = None) -> dict:
    """Everything the report states, recomputed from the runs' metrics files.

    Runs are grouped into configurations (device, method, ranks, emulated_step_ms, rays per rank,
    sampler); a configuration's value per trial is the mean of its runs in that trial.

    Returns {"trial_runs": [read_run(...)...], "runs": [configuration: {"method", "sampler",
    "ranks", "device", "emulated_step_ms", "rays_per_rank", "step_s" (mean over trials),
    "step_s_trials", "step_ci", "stall", "stall_trials", "stall_ci", "phases_s" (means), "compute_s",
    "rays_per_s", "trials", "test_psnr", "fusion", "floor_step_s" (emulated: the floor's step at the
    same method, ranks and step time, else None)}...], "speedups": [{"method", "ranks", "device",
    "emulated_step_ms", "rays_per_rank", "baseline", "speedup" (mean over trials of baseline step /
    adjacent pipelined step), "speedup_trials", "speedup_ci" [lo, hi], "ideal_speedup" (mean over
    trials of 1 / (1 - stall_baseline)), "ideal_ci", "ratio" (speedup / ideal), "flags" [...],
    "cause", "step_baseline_s", "step_pipelined_s", "stall_baseline", "stall_pipelined"}...],
    "summary": {...}}.
    """
    trial_runs = [read_run(d, warmup) for d in run_dirs]
    by_dir = {Path(r["dir"]).resolve(): r for r in trial_runs}
    groups: Dict[tuple, List[dict]] = {}
    for r in trial_runs:
        groups.setdefault(_key(r), []).append(r)
    configs = []
    for k, rs in groups.items():
        trials = sorted({r["trial"] for r in rs})
        per_t = {t: [r for r in rs if r["trial"] == t] for t in trials}
        step_t = [float(np.mean([r["step_s"] for r in per_t[t]])) for t in trials]
        stall_t = [float(np.mean([r["stall"] for r in per_t[t]])) for t in trials]
        step, step_ci = mean_ci(step_t)
        stall, stall_ci = mean_ci(stall_t)
        ph = {p: float(np.mean([r["phases_s"][p] for r in rs])) for p in PHASE_KEYS}
        r0 = rs[0]
        configs.append({
            "name": r0["name"], "method": r0["method"], "sampler": r0["sampler"], "ranks": r0["ranks"],
            "device": r0["device"], "emulated_step_ms": r0["emulated_step_ms"], "rays_per_rank": r0["rays_per_rank"],
            "trials": len(trials), "runs": len(rs), "steps_used": min(r["steps_used"] for r in rs),
            "warmup": r0["warmup"], "step_s": step, "step_s_trials": step_t, "step_ci": step_ci,
            "stall": stall, "stall_trials": stall_t, "stall_ci": stall_ci, "phases_s": ph,
            "compute_s": ph["h2d"] + ph["forward"] + ph["backward"] + ph["optimizer"],
            "rays_per_s": float(np.mean([r["rays_per_s"] for r in rs])),
            "test_psnr": r0.get("test_psnr"), "fusion": r0.get("fusion") or {},
            "torch_threads": r0.get("torch_threads"), "sampler_threads": r0.get("sampler_threads"),
            "barrier_s": r0.get("barrier_s"), "dirs": [r["dir"] for r in rs],
            "host_busy": float(np.mean([r["host_busy"] for r in rs])) if all(r.get("host_busy") is not None for r in rs) else None,
        })
    ckey = {(c["device"], c["method"], c["ranks"], c["emulated_step_ms"], c["rays_per_rank"], c["sampler"]): c for c in configs}
    for c in configs:
        f = ckey.get((c["device"], c["method"], c["ranks"], c["emulated_step_ms"], c["rays_per_rank"], em.FLOOR))
        c["floor_step_s"] = f["step_s"] if f is not None else None
        c["step_over_floor"] = c["step_s"] / f["step_s"] if f is not None and f["step_s"] > 0 else None
        # lockstep ranks: a rank also waits at the collective for ranks still sampling; the part of
        # its sync above the floor's is data stall the per-rank wait does not count
        c["stall_lockstep"] = None
        if f is not None and c["step_s"] > 0:
            extra = max(0.0, c["phases_s"]["sync"] - f["phases_s"]["sync"])
            c["stall_lockstep"] = min(1.0, (c["phases_s"]["wait"] + extra) / c["step_s"])

    speedups = []
    for k, rs in groups.items():
        device, method, ranks, ems, rays, sampler = k
        if sampler not in BASELINES:
            continue
        pk = (device, method, ranks, ems, rays, em.PIPELINED)
        if pk not in groups:
            continue
        pairs = []  # (trial, baseline run, pipelined run)
        for r in rs:
            p = None
            if r.get("pair"):
                p = by_dir.get((Path(r["dir"]).parent / r["pair"]).resolve())
            if p is None:  # no adjacency recorded (older runs): the pipelined runs of the same trial
                same = [q for q in groups[pk] if q["trial"] == r["trial"]] or groups[pk]
                p = dict(same[0]) | {"step_s": float(np.mean([q["step_s"] for q in same])),
                                     "stall": float(np.mean([q["stall"] for q in same]))}
            pairs.append((r["trial"], r, p))
        trials = sorted({t for t, _, _ in pairs})
        fk = (device, method, ranks, ems, rays, em.FLOOR)
        floor_t = {t: float(np.mean([q["step_s"] for q in groups[fk] if q["trial"] == t]))
                   for t in trials if fk in groups and any(q["trial"] == t for q in groups[fk])}
        use_floor = len(floor_t) == len(trials)
        sp_t, id_t, iw_t, bl, pl = [], [], [], [], []
        for t in trials:
            tp = [(b, p) for tt, b, p in pairs if tt == t]
            sp_t.append(float(np.mean([b["step_s"] / p["step_s"] for b, p in tp])))
            iw_t.append(float(np.mean([1.0 / (1.0 - b["stall"]) if b["stall"] < 1 else float("inf") for b, _ in tp])))
            # the data stall: the part of the baseline's step that the same step with no data cost
            # (the floor, same trial) does not have, whatever phase it shows up in
            id_t.append(float(np.mean([max(1.0, b["step_s"] / floor_t[t]) for b, _ in tp])) if use_floor else iw_t[-1])
            for b, p in tp:
                bl.append(b)
                pl.append(p)
        sp, sp_ci = mean_ci(sp_t)
        ideal, id_ci = mean_ci(id_t)
        ideal_w, iw_ci = mean_ci(iw_t)
        ratio = sp / ideal if ideal > 0 else float("nan")
        flags = []
        if len(sp_t) > 1 and sp_ci[0] > id_ci[1]:
            flags.append("speedup interval above the ideal's")
        if not BAND[0] <= ratio <= BAND[1]:
            flags.append(f"speedup/ideal {ratio:.2f} outside [{BAND[0]}, {BAND[1]}]")
        bmean = {"step_s": float(np.mean([b["step_s"] for b in bl])), "stall": float(np.mean([b["stall"] for b in bl])),
                 "phases_s": {k: float(np.mean([b["phases_s"][k] for b in bl])) for k in PHASE_KEYS}}
        pmean = {"step_s": float(np.mean([p["step_s"] for p in pl])), "stall": float(np.mean([p["stall"] for p in pl])),
                 "phases_s": {k: float(np.mean([p["phases_s"][k] for p in pl])) for k in PHASE_KEYS}}
        fc = ckey.get(fk) if use_floor else None
        pc = ckey.get(pk)
        pmean["host_busy"] = pc.get("host_busy") if pc else None
        stall_data = 1.0 - 1.0 / ideal if use_floor and ideal > 0 else None
        if stall_data is not None and bmean["stall"] > stall_data + 0.05:
            flags.append(f"the baseline waits {100 * bmean['stall']:.1f}% of its step, more than its step exceeds "
                         f"the floor's ({100 * stall_data:.1f}%): the floor ran slow")
        bc = ckey.get((device, method, ranks, ems, rays, sampler))
        sl = bc.get("stall_lockstep") if bc else None
        speedups.append({
            "ideal_speedup_lockstep": (1.0 / (1.0 - sl) if sl < 1 else float("inf")) if sl is not None else None,
            "method": method, "ranks": ranks, "device": device, "emulated_step_ms": ems, "rays_per_rank": rays,
            "baseline": sampler, "speedup": sp, "speedup_trials": sp_t, "speedup_ci": sp_ci,
            "ideal_speedup": ideal, "ideal_trials": id_t, "ideal_ci": id_ci, "ideal_basis": "floor" if use_floor else "wait",
            "ideal_speedup_wait": ideal_w, "ideal_wait_ci": iw_ci, "stall_data": stall_data,
            "ratio": ratio, "flags": flags,
            "cause": _cause(bmean, pmean, fc) if flags else None,
            "step_baseline_s": bmean["step_s"], "step_pipelined_s": pmean["step_s"],
            "step_floor_s": float(np.mean(list(floor_t.values()))) if use_floor else None,
            "stall_baseline": bmean["stall"], "stall_pipelined": pmean["stall"], "trials": len(trials),
        })
    order = {"cpu": 0, "cuda": 1, "emulated": 2}
    configs.sort(key=lambda c: (order.get(c["device"], 3), c["method"], c["emulated_step_ms"] or 0, c["rays_per_rank"],
                                c["ranks"], c["sampler"]))
    speedups.sort(key=lambda c: (order.get(c["device"], 3), c["method"], c["emulated_step_ms"] or 0, c["rays_per_rank"],
                                 c["ranks"], c["baseline"]))
    out = {"trial_runs": trial_runs, "runs": configs, "speedups": speedups}
    out["summary"] = derive_summary(out)
    return out


def derive_summary(derived: dict) -> dict:
    """{"mean_speedup", "max_speedup", "mean_stall_sync", "max_stall_sync", "max_stall_pipelined",
    "flagged_pairs", "pairs"} over :func:`derive`'s configurations and pairs."""
    configs, speedups = derived["runs"], derived["speedups"]
    sync_stalls = [c["stall"] for c in configs if c["sampler"] in BASELINES]
    pipe_stalls = [c["stall"] for c in configs if c["sampler"] == em.PIPELINED]
    sp = [s["speedup"] for s in speedups]
    return {
        "mean_speedup": float(np.mean(sp)) if sp else None,
        "max_speedup": float(np.max(sp)) if sp else None,
        "mean_stall_sync": float(np.mean(sync_stalls)) if sync_stalls else None,
        "max_stall_sync": float(np.max(sync_stalls)) if sync_stalls else None,
        "max_stall_pipelined": float(np.max(pipe_stalls)) if pipe_stalls else None,
        "flagged_pairs": sum(1 for s in speedups if s["flags"]), "pairs": len(speedups),
    }


def observations(derived: dict, cores: Optional[int] = None, device: Optional[str] = None) -> List[cm.Observation]:
    """Cost-model observations from :func:`derive`'s configurations (optionally one ``device``).

    Cores per rank: CPU rows: train.torch_threads, else cores // ranks as the trainer sets it;
    emulated rows: min(sampler threads, cores / ranks) (the ranks share the host's cores), except
    sync_global, where rank 0 samples every rank's batch while the others wait for it (idle in the
    scatter's barrier), so its threads have the host to themselves: min(sampler threads, cores)."""
    cores = cores or os.cpu_count() or 1
    out = []
    for r in derived["runs"]:
        if r["sampler"] not in cm.SAMPLERS or (device is not None and r["device"] != device):
            continue
        if r["device"] == "emulated":
            share = cores if r["sampler"] == "sync_global" else cores / r["ranks"]
            c = min(float(r.get("sampler_threads") or 1), share)
        else:
            c = r.get("torch_threads") or max(1, cores // r["ranks"])
        out.append(cm.Observation(r["method"], r["sampler"], r["ranks"], r["rays_per_rank"], c,
                                  r["phases_s"]["wait"], r["compute_s"], r["phases_s"]["sync"], r["step_s"]))
    return out


# ---------------------------------------------------------------------------------------------
# sampling micro-benchmark (independent of the training runs: the cost model is checked on them)


def _time_source(cfg: Config, scene, batches: int, cpu: Optional[list] = None) -> float:
    """Wall seconds per batch of ``cfg.pipeline.name`` alone; ``cpu``: appends the process CPU
    seconds per batch (every thread: the loader's DALI and hand-over threads too)."""
    warm = 2
    if cfg.pipeline.name == "rays":  # cover several DALI runs, not just pops of one prefetched run,
        per_run = -(-loader_budget(cfg.pipeline.rays_per_batch, cfg.pipeline.num_threads,  # after the
                                   cfg.pipeline.rays_per_run)[1] // cfg.pipeline.rays_per_batch)  # first runs
        batches = max(batches, 8 * per_run)
        warm = 3 * per_run
    src = build_source(cfg, scene, 0, 1)
    try:
        it = iter(src)
        for _ in range(warm):
            next(it)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(batches):
            next(it)
        if cpu is not None:
            cpu.append((time.process_time() - c0) / batches)
        return (time.perf_counter() - t0) / batches
    finally:
        if hasattr(src, "close"):
            src.close()


def measure_sampling(cfg: Config, sizes: Sequence[int], batches: int = 20) -> dict:
    """Seconds per batch of the synchronous sampler (sync_local, world size 1, train.torch_threads) and of our
    pipelined loader with no consumer (its production rate), at each batch size.

    Returns {"sizes", "sync_s" [...], "loader_s" [...], "loader_cpu_s" [...] (process CPU seconds per
    batch, all threads), "sync_cores", "loader_cores", "profile"
    (a :class:`~dali_nerf.bench.costmodel.SamplingProfile`, per-core costs)}."""
    sc = cfg.scene
    scene = load_scene(sc.path, split=sc.train_split, format=sc.format, downscale=sc.downscale, background=sc.background)
    cores = os.cpu_count() or 1
    threads = cfg.train.torch_threads or cores  # as the trainer's rank would run it
    torch.set_num_threads(threads)
    out = {"sizes": list(sizes), "sync_s": [], "loader_s": [], "loader_cpu_s": []}
    for b in sizes:
        c = copy.deepcopy(cfg)
        c.pipeline.rays_per_batch = int(b)
        c.pipeline.name = "sync_local"
        out["sync_s"].append(_time_source(c, scene, batches))
        c.pipeline.name = "rays"
        out["loader_s"].append(_time_source(c, scene, batches, cpu=out["loader_cpu_s"]))
    out["sync_cores"] = threads
    out["loader_cores"] = min(loader_budget(cfg.pipeline.rays_per_batch, cfg.pipeline.num_threads,
                                            cfg.pipeline.rays_per_run)[0], cores)
    out["profile"] = sampling_profile(out, cores)
    return out


def sampling_profile(sampling: dict, cores: int) -> cm.SamplingProfile:
    """The cost model's per-core sampling costs from :func:`measure_sampling`'s timings (also as
    derived.json keeps them: "sizes", "sync_s", "loader_s", "sync_cores", "loader_cores")."""
    s0, ks = cm.fit_linear(sampling["sizes"], sampling["sync_s"])
    p0, kp = cm.fit_linear(sampling["sizes"], sampling["loader_s"])
    return cm.SamplingProfile(s0, ks * sampling["sync_cores"], p0, kp * sampling["loader_cores"], cores)


# ---------------------------------------------------------------------------------------------
# the grid: CPU rows (trainer processes) and emulated rows (one launch per method and ranks)


def _cell_name(method: str, sampler: str, ranks: int, trial: int = 0, k: int = 0) -> str:
    return f"study_{method}_{sampler}_{ranks}_t{trial}_{k}"


def cpu_plan(methods: Sequence[str], samplers: Sequence[str], ranks: Sequence[int], trials: int):
    """[(method, ranks, trial, sampler, k, pair k or None)] in run order.

    Per (method, ranks) and trial, the samplers in :func:`~dali_nerf.bench.emulated.pair_order`
    and the floor (``ready``: the same training step with no data cost) between two of its groups
    (:func:`~dali_nerf.bench.emulated.with_floor`)."""
    plan, ok = [], list(samplers)
    for m in methods:
        for r in ranks:
            for t in range(trials):
                base = [s for s in ok if s != em.PIPELINED]
                order = em.pair_order(base, t) if em.PIPELINED in ok else [(s, -1) for s in base]
                order = em.with_floor(order, t)
                pk = {g: i for i, (s, g) in enumerate(order) if s == em.PIPELINED}
                for i, (s, g) in enumerate(order):
                    plan.append((m, r, t, s, i, pk.get(g) if s != em.PIPELINED else None))
    return plan


def run_grid(cfg: Config, config_path: str, overrides: Sequence[str], log=print):
    """Run every CPU cell of ``cfg.bench`` ``bench.trials`` times, each run a trainer process, in
    the rotated order of :func:`cpu_plan`; each run folder gets a ``study.json`` (trial, order,
    pair).

    Returns (run folders that finished, [(cell name, one-line reason, log file)] of those that
    failed); the report lists the failed ones. Every cell failing raises
    :class:`DaliNerfError` naming the first log file."""
    b = cfg.bench
    root = Path(cfg.train.runs_dir)
    root.mkdir(parents=True, exist_ok=True)
    dirs, failed = [], []
    plan = cpu_plan(b.methods, b.samplers, b.ranks, b.trials)
    for i, (m, r, t, s, k, pk) in enumerate(plan):
        name = _cell_name(m, s, r, t, k)
        ov = list(overrides) + [f"method={m}", f"pipeline.name={s}", f"train.steps={b.warmup + b.steps}",
                                f"name={name}", "train.eval_images=1", "train.checkpoint_every=0",
                                f"train.log_every={b.warmup + b.steps}"]
        module = "dali_nerf.trainers.ddp" if m == "ddp" else "dali_nerf.trainers.spatial"
        if r == 1:
            cmd = [sys.executable, "-m", module]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={r}", "-m", module]
        cmd += ["--config", str(config_path)] + ov
        logf = root / f"{name}.log"
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env.pop("DALI_NERF_PROGRESS", None)
        t0 = time.perf_counter()
        with open(logf, "w") as f:
            f.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
            f.flush()
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        if rc != 0:
            tail = [l for l in logf.read_text().splitlines() if l.strip() and not l.startswith(("W", "[W"))][-1:]
            reason = f"exit {rc}: {tail[0][:300] if tail else 'no output'}"
            failed.append((name, reason, str(logf)))
            log(f"[{i + 1}/{len(plan)}] {name}: FAILED ({reason}); log {logf}")
            continue
        pair = _cell_name(m, em.PIPELINED, r, t, pk) if pk is not None else None
        atomic_write_text(root / name / "study.json", json.dumps({"trial": t, "order": k, "pair": pair, "device": "cpu"}))
        log(f"[{i + 1}/{len(plan)}] {name}: {time.perf_counter() - t0:.1f} s")
        dirs.append(root / name)
    if not dirs and failed:
        first = failed[0]
        raise DaliNerfError(f"every study cell failed; first: {first[0]} ({first[1]}) — log: {first[2]}")
    return dirs, failed


def run_emulated(cfg: Config, grad_bytes: int, log=print) -> dict:
    """The emulated launches: for each method and its ``bench.emulated_ranks[_ss]``, one launch
    running the floor and ``bench.emulated_samplers`` at every ``bench.emulated_step_ms``,
    ``bench.trials`` times in rotation (DDP at ``bench.check_ranks`` also the ``bench.check_rays``
    segments, once).

    Returns {"dirs": [segment folders], "launches": [{"method", "ranks", "wall_s", "barrier_s",
    "budget", "segments"}]}."""
    b = cfg.bench
    B = cfg.pipeline.rays_per_batch
    links = DeviceLinks()
    gb = int(b.emulated_grad_bytes or grad_bytes)
    root = Path(cfg.train.runs_dir)
    dirs, launches = [], []
    for m in b.methods:
        for W in (b.emulated_ranks if m == "ddp" else b.emulated_ranks_ss):
            budget = dataclasses.replace(host_budget(B, local_ranks=W),
                                         priority=resolve_priority(cfg.pipeline.thread_priority, "emulated"))
            segs = em.schedule(b.emulated_samplers, b.emulated_step_ms, b.trials, B,
                               check_rays=b.check_rays if (m == "ddp" and W in b.check_ranks) else (),
                               check_step_ms=b.check_step_ms)
            out = root / f"emu_{m}_{W}"
            if out.exists():
                shutil.rmtree(out)
            r = em.launch(cfg, m, W, segs, out, budget, links, gb, b.emulated_steps, b.emulated_warmup)
            log(f"emulated {m} x{W}: {len(segs)} segments in {r['wall_s']:.1f} s "
                f"(lockstep barrier {r['barrier_s'] * 1e6:.0f} us)")
            dirs += r["dirs"]
            if r["demoted"]:
                log(f"emulated {m} x{W}: starved background samplers returned to normal priority: "
                    f"{'; '.join(r['demoted'])}")
            launches.append({"method": m, "ranks": W, "wall_s": r["wall_s"], "barrier_s": r["barrier_s"],
                             "budget": dataclasses.asdict(budget), "segments": len(segs), "demoted": r["demoted"],
                             "cells": W if m == "ss" else None})
    return {"dirs": dirs, "launches": launches, "links": links.lines(), "grad_bytes": gb}


def _demoted_note(launch: dict) -> str:
    """The launch table's note on loaders whose starved background sampler went back to normal priority."""
    d = launch.get("demoted") or []
    return f" (starved, then normal: {len(d)} loader(s): {'; '.join(d)})" if d else ""


def _sampler_table(cfg: Config) -> Optional[str]:
    """The ``dali-nerf bench sampler`` table (markdown) on the study's scene, at the study's batch
    size and 65536 (``bench.sampler_seconds`` per measurement; 0 skips it)."""
    if cfg.bench.sampler_seconds <= 0:
        return None
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "sampler.md"
        ns = argparse.Namespace(scene=cfg.scene.path, batches=f"{cfg.pipeline.rays_per_batch},65536",
                                seconds=cfg.bench.sampler_seconds, out=str(out))
        sb.main(ns)
        text = out.read_text()
    cmd = (f"dali-nerf bench sampler --scene {cfg.scene.path} --batches {ns.batches} --seconds {ns.seconds:g}")
    return f"`{cmd}` (run by the study):\n\n" + text.split("\n", 2)[-1]


# ---------------------------------------------------------------------------------------------
# report


def _fmt_ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _ci_ms(c: dict, key: str = "step") -> str:
    lo, hi = c[f"{key}_ci"]
    return f"{c[f'{key}_s'] * 1e3:.2f} [{lo * 1e3:.2f}, {hi * 1e3:.2f}]"


def _ci_pct(c: dict) -> str:
    lo, hi = c["stall_ci"]
    return f"{100 * c['stall']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def keeps_up(c: dict, band: float = BAND[1]) -> Optional[bool]:
    """For a pipelined emulated row: the host supplies the demand (stall <= 2% and step within
    ``band`` x the floor); None for other rows."""
    if c["device"] != "emulated" or c["sampler"] != em.PIPELINED or c.get("step_over_floor") is None:
        return None
    return c["stall"] <= 0.02 and c["step_over_floor"] <= band


def keeps_up_reason(c: dict, band: float = BAND[1]) -> str:
    """Which of :func:`keeps_up`'s rules a row breaks ("" when none)."""
    why = []
    if c["stall"] > 0.02:
        why.append(f"stall {100 * c['stall']:.1f}% > 2%")
    if (c.get("step_over_floor") or 0) > band:
        why.append(f"step {c['step_over_floor']:.2f}x the floor > {band}x")
    return ", ".join(why)


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

    s = derived["summary"]
    commit = meta["commit"]
    clean = ("the tree outside docs/study/ equals this commit" if not commit.endswith("-dirty") and commit != "unknown"
             else "NOT a clean commit: files outside docs/study/ differ from it (rerun from a clean checkout)")
    L = [f"# Characterization study on `{meta['machine']}`", "",
         "Generated by the command below; do not edit by hand (rerun it).", "",
         f"- command: `{meta['command']}`",
         f"- commit: `{commit}` ({clean})",
         f"- machine: {meta['machine_desc']}",
         f"- date: {meta['date']}, study wall time {meta['wall_s']:.0f} s"
         + (f"; 1-min load average {meta['load_avg_start']:.1f} at start (other processes: near 0 on a quiet "
            f"machine; 1 or more means they shared the cores and inflated the timings), {meta['load_avg_end']:.1f} "
            f"at end (the study's own rank processes count in it)"
            if "load_avg_start" in meta else ""),
         f"- workload: {meta['workload']}",
         f"- timing: {meta['trials']} trials per configuration in an order rotated between trials (each baseline "
         f"runs next to a pipelined run; speedups per trial from those pairs); CPU rows {meta['steps']} timed steps "
         f"after {meta['warmup']} warm-up steps" + (f", emulated rows {meta['emulated_steps']} timed steps after "
                                                  f"{meta['emulated_warmup']} warm-up steps plus the batches the source "
                                                  f"prefetched while other segments ran" if emu else "")
         + "; values are means per step and rank, [lo, hi] the 95% t-interval over trials; stall = data wait / step time",
         f"- budgets (equal for every sampler): {meta.get('budgets', '-')}", ""]
    if meta.get("failed"):
        L += ["## Cells that did not run", ""] + [f"- {n}: {r}" + (f" (log `{lg}`)" if lg != "-" else "")
                                                  for n, r, lg in meta["failed"]] + [""]
    L += ["## Result", ""]
    emu_sp = [x for x in sps if x["device"] == "emulated"]
    if emu:
        L += [f"Emulated rows: {EMULATED_LABEL}.", ""]
        for m in sorted({c["method"] for c in emu}):
            g = [c for c in emu if c["method"] == m and c["sampler"] == "sync_global"
                 and c["rays_per_rank"] == meta["rays"]]
            if g:
                top = max(c["ranks"] for c in g)
                parts = [f"{100 * c['stall']:.1f}% at {c['emulated_step_ms']:g} ms" for c in g if c["ranks"] == top]
                w0 = min(x["ranks"] for x in g)
                low = [f"{100 * c['stall']:.1f}%" for c in g if c["ranks"] == w0]
                L.append(f"- {m.upper()} sync_global stall at {top} emulated GPUs: " + ", ".join(parts)
                         + (f" (at {w0}: {', '.join(low)})" if w0 != top else "") + "; the study: up to 43.3%.")
            sp = [x for x in emu_sp if x["method"] == m and x["rays_per_rank"] == meta["rays"]]
            if sp:
                L.append(f"- {m.upper()} speedup of pipelined sampling over the emulated pairs: mean "
                         f"{np.mean([x['speedup'] for x in sp]):.2f}x, max {np.max([x['speedup'] for x in sp]):.2f}x "
                         f"(the study: 1.95x average, 2.24x max).")
            p = [c for c in emu if c["method"] == m and c["sampler"] == em.PIPELINED and keeps_up(c) is False]
            if p:
                L.append(f"- {m.upper()}: the pipelined CPU sampler does not keep up at " + ", ".join(
                    f"{c['ranks']} GPUs / {c['emulated_step_ms']:g} ms / {c['rays_per_rank']} rays ({keeps_up_reason(c)})"
                    for c in p) + ".")
        L.append("")
    if s["mean_speedup"] is not None:
        L += [f"Over all {s['pairs']} pairs (CPU and emulated): baseline stall {100 * s['mean_stall_sync']:.1f}% on average "
              f"(max {100 * s['max_stall_sync']:.1f}%), pipelined stall at most {100 * s['max_stall_pipelined']:.1f}%; "
              f"{s['flagged_pairs']} of {s['pairs']} pairs flagged (speedup not explained by the baseline's data stall; "
              f"causes in the speedup table).", ""]
    if meta.get("regime"):
        L += ["## CPU rows: regime", "", meta["regime"], ""]
    if cpu:
        L += ["## CPU rows (real CPU compute, trainer processes)", "", "![phases](phases.png)", "",
              "| method | sampler | ranks | trials | step ms [95% CI] | stall [95% CI] | wait | h2d | forward | backward | sync | optimizer | Mrays/s | test PSNR |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in cpu:
            ph = c["phases_s"]
            psnr = f"{c['test_psnr']:.2f}" if c.get("test_psnr") is not None else "-"
            L.append(f"| {c['method']} | {c['sampler']} | {c['ranks']} | {c['trials']} | {_ci_ms(c)} | {_ci_pct(c)} | "
                     + " | ".join(_fmt_ms(ph[k]) for k in PHASE_KEYS)
                     + f" | {c['rays_per_s'] / 1e6:.3f} | {psnr} |")
        fus = [(c["name"], c["fusion"]) for c in cpu if c["fusion"]]
        if fus:
            L += ["", "SS fusion at inference (from summary.json):", ""]
            for name, f in fus:
                L.append(f"- {name}: " + ", ".join(f"{k} = {v:.4g}" if isinstance(v, (int, float)) else f"{k} = {v}"
                                                   for k, v in f.items()))
        L.append("")
    if emu:
        L += [f"## Emulated GPUs ({EMULATED_LABEL})", "", "![scaling](scaling.png)", "",
              "Device-side work as timed waits (the rank's thread sleeps, its core is free):", ""]
        L += [f"- {x}" for x in (emulation or {}).get("links", [])]
        L += [f"- device step times {', '.join(f'{v:g}' for v in meta.get('emulated_step_ms', []))} ms per 4096-ray step: "
              f"{meta.get('step_ms_source', '')}",
              f"- gradients all-reduced per DDP step: {(emulation or {}).get('grad_bytes', 0) / 1e6:.2f} MB",
              "- DDP ranks keep lockstep through a shared-memory barrier each step (the all-reduce's rendezvous); "
              "sync_global: rank 0 samples every rank's batch in its training thread, writes it to shared memory, "
              "every rank copies its slice out after a barrier and waits the emulated transfer; SS: one cell per rank, "
              "no per-step lockstep except sync_global's",
              "- floor: the same step with a source that hands out a ready batch (sleep overshoot, scheduling of many "
              "processes on these cores)", "",
              "Lockstep cost (W ranks calling the barrier back to back, no work), per launch:", "",
              "| method | ranks | cells | barrier us | sampler threads/rank | rays per run | sampler priority | launch s | segments |",
              "|---|---|---|---|---|---|---|---|---|"]
        for la in (emulation or {}).get("launches", []):
            L.append(f"| {la['method']} | {la['ranks']} | {la['cells'] or '-'} | {la['barrier_s'] * 1e6:.0f} | "
                     f"{la['budget']['threads']} | {la['budget']['rays_per_run']} | {la['budget'].get('priority', 'normal')}"
                     f"{_demoted_note(la)} | "
                     f"{la['wall_s']:.0f} | {la['segments']} |")
        capacity = None
        if sampling and sampling.get("loader_cpu_s"):
            per_ray = max(cs / bb for bb, cs in zip(sampling["sizes"], sampling["loader_cpu_s"]))
            capacity = (cores or 1) / per_ray
            L += ["", f"Host capacity of the pipelined sampler: {capacity / 1e6:.1f} Mrays/s on {cores} cores "
                      f"(its CPU time per ray, every thread, measured on its own below, at the costliest batch size); "
                      f"demand = ranks x rays per rank / floor step. A row's host work is the demand's share of it: "
                      f"on shared cores it also slows the ranks' own threads, which the step / floor column shows."]
        L += ["", "host busy = the CPU time of the ranks' processes (every thread: the training thread, DALI's, the "
                  "run-ahead thread; not torch_workers' worker processes) over the step time and the host's cores.",
              "", "| method | device step ms | rays/rank | ranks | sampler | step ms [95% CI] | floor ms | step / floor | stall [95% CI] | wait | h2d | compute | sync | host busy | host keeps up |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in emu:
            ph = c["phases_s"]
            ku = keeps_up(c)
            if ku is None:
                mark = "-"
            else:
                demand = c["ranks"] * c["rays_per_rank"] / (c["floor_step_s"] or 1)
                mark = ("yes" if ku else f"**no**: {keeps_up_reason(c)}") + f" (demand {demand / 1e6:.1f}" + (
                    f" Mrays/s = {100 * demand / capacity:.0f}% of the sampler's capacity on this host)" if capacity
                    else " Mrays/s)")
            sof = f"{c['step_over_floor']:.2f}" if c.get("step_over_floor") is not None else "-"
            busy = "-" if c.get("host_busy") is None else f"{100 * c['host_busy']:.0f}%"
            L.append(f"| {c['method']} | {c['emulated_step_ms']:g} | {c['rays_per_rank']} | {c['ranks']} | {c['sampler']} | "
                     f"{_ci_ms(c)} | {_fmt_ms(c['floor_step_s'])} | {sof} | {_ci_pct(c)} | {_fmt_ms(ph['wait'])} | "
                     f"{_fmt_ms(ph['h2d'])} | {_fmt_ms(ph['forward'] + ph['backward'] + ph['optimizer'])} | {_fmt_ms(ph['sync'])} | "
                     f"{busy} | {mark} |")
        L.append("")
    L += ["## Speedup of pipelined sampling", "", "![speedup](speedup.png)", "",
          "speedup = baseline step / step of the pipelined run next to it, per trial, then mean and 95% interval.", "",
          "ideal = 1 / (1 - data stall of the baseline), per trial, where the data stall is the share of the "
          "baseline's step that the floor (the same step with a ready batch: no data cost, run in the same trial) does "
          "not have: ideal = baseline step / floor step. It counts the stall wherever it shows up: the wait in next(), "
          "and, on shared cores, what the baseline's sampling adds to the other phases (a DDP all-reduce waiting for "
          "a rank still sampling, copies and compute woken late while the cores sample). speedup / ideal is then the "
          "floor's step over the pipelined run's: 1 when pipelining removes all of the data stall. A pair is flagged "
          f"when speedup / ideal is outside [{BAND[0]}, {BAND[1]}] or its speedup interval lies above the ideal's; the "
          "cause column decomposes the pipelined step against the floor's, phase by phase.", "",
          "ideal (wait) = 1 / (1 - wait / step): the ideal from the per-rank wait alone, for comparison (it misses "
          "the stall outside next()); ideal (lockstep) adds the sync above the floor's.", "",
          "| device | method | step ms | rays/rank | ranks | baseline | speedup [95% CI] | ideal [95% CI] | speedup / ideal | ideal (wait) | ideal (lockstep) | data stall baseline | stall baseline | stall pipelined | flag: cause |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in sps:
        fl = "-" if not x["flags"] else f"**{'; '.join(x['flags'])}**: {x['cause']}"
        L.append(f"| {x['device']} | {x['method']} | {'-' if x['emulated_step_ms'] is None else format(x['emulated_step_ms'], 'g')} | "
                 f"{x['rays_per_rank']} | {x['ranks']} | {x['baseline']} | {x['speedup']:.2f}x [{x['speedup_ci'][0]:.2f}, "
                 f"{x['speedup_ci'][1]:.2f}] | {x['ideal_speedup']:.2f}x [{x['ideal_ci'][0]:.2f}, {x['ideal_ci'][1]:.2f}] | "
                 f"{x['ratio']:.2f} | {x['ideal_speedup_wait']:.2f}x | "
                 f"{'-' if x.get('ideal_speedup_lockstep') is None else format(x['ideal_speedup_lockstep'], '.2f') + 'x'} | "
                 f"{'-' if x.get('stall_data') is None else format(100 * x['stall_data'], '.1f') + '%'} | "
                 f"{100 * x['stall_baseline']:.1f}% | {100 * x['stall_pipelined']:.1f}% | {fl} |")
    L += ["", "## Sampler throughput", ""]
    if sampler_table:
        L += [sampler_table.strip(), ""]
    else:
        L += ["(`dali-nerf bench sampler` table: skipped, bench.sampler_seconds = 0.)", ""]
    if sampling:
        L += ["Sampling cost measured on its own for the cost model (world size 1, seconds per batch):", "",
              "| rays per batch | sync sampler ms | sync Mrays/s | pipelined loader ms | loader Mrays/s |", "|---|---|---|---|---|"]
        for bb, a, c in zip(sampling["sizes"], sampling["sync_s"], sampling["loader_s"]):
            L.append(f"| {bb} | {_fmt_ms(a)} | {bb / a / 1e6:.2f} | {_fmt_ms(c)} | {bb / c / 1e6:.2f} |")
        L.append("")
    L += ["## Cost model, checked out of sample", "",
          "Per rank and step (B rays per rank, G ranks, c cores per rank; see dali_nerf/bench/costmodel.py):", "",
          "```",
          "compute = c0 + kc * B / c",
          "sync    = 0 (G = 1) | a + 2 (G-1)/G * grad_bytes * beta      (ring all-reduce; DDP only)",
          "wait    = s0 + ks * B / c                                     (sync_local)",
          "        = s0 + ks * G*B / c + gamma * (G-1) * B * ray_bytes    (sync_global: rank 0 samples, scatters)",
          "        = max(0, p0 + kp * B / c - (compute + sync))           (rays: overlapped with compute)",
          "```", "", "c = the cores of the process that samples: per rank for sync_local and rays (on the emulated host, "
          "min(sampler threads, cores / ranks): the ranks share its cores); for sync_global rank 0's, up to the whole "
          "host's (min(sampler threads, cores)), since the other ranks wait for its scatter.", "",
          f"Fit set: {meta.get('fit_set', '-')}. The model has no torch_workers or SS routing term. Its per-ray "
          "sampling costs are measured with one process alone; many processes sampling at once on shared cores "
          "(sync_local on the emulated host) also pay for the contention (caches, scheduling), which it does not model.", "",
          "| parameter | value |", "|---|---|"]
    md = model.to_dict()
    for k, v in md.items():
        if k == "notes":
            continue
        L.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    L += [""] + [f"- {n}" for n in model.notes]
    L += ["", "![model check](model_check.png)", "",
          "| set | method | sampler | ranks | rays/rank | device step ms | step measured ms | step predicted ms | error | stall measured | stall predicted |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in validation:
        L.append(f"| {v.get('set', '-')} | {v['method']} | {v['sampler']} | {v['ranks']} | {v.get('rays_per_rank', '-')} | "
                 f"{v.get('emulated_step_ms') if v.get('emulated_step_ms') is not None else '-'} | "
                 f"{_fmt_ms(v['step_measured_s'])} | {_fmt_ms(v['step_predicted_s'])} | "
                 f"{100 * v['step_error']:+.1f}% | {100 * v['stall_measured']:.1f}% | {100 * v['stall_predicted']:.1f}% |")
    for name in ("fit", "check"):
        errs = [abs(v["step_error"]) for v in validation if v.get("set") == name]
        if errs:
            L.append(f"\n{name} set: mean absolute step-time error {100 * np.mean(errs):.1f}%, max {100 * np.max(errs):.1f}% "
                     f"over {len(errs)} configurations.")
            per = [(s, [abs(v["step_error"]) for v in validation if v.get("set") == name and v["sampler"] == s])
                   for s in cm.SAMPLERS]
            L.append("(" + "; ".join(f"{s}: mean {100 * np.mean(e):.1f}%, max {100 * np.max(e):.1f}%"
                                     for s, e in per if e) + ")")
    L += ["", "## Projection beyond 16 GPUs (a projection of the cost model, not a measurement)", "",
          "![projection](projection.png)", "", "Assumptions:", ""]
    L += [f"- {a}" for a in assumptions.lines()]
    L += ["", "| nodes | GPUs/node | sampler | step ms | stall | speedup of pipelined |", "|---|---|---|---|---|---|"]
    for p in projection:
        if p["gpus_per_node"] in (1, 8, 64) and p["nodes"] in (1, 8):
            L.append(f"| {p['nodes']} | {p['gpus_per_node']} | {p['sampler']} | {_fmt_ms(p['step_s'])} | {100 * p['stall']:.1f}% | {p['speedup_of_rays']:.2f}x |")
    L.append("")
    report = out_dir / "report.md"
    atomic_write_text(report, "\n".join(L))
    raw = {"meta": meta, "derived": derived, "cost_model": md, "validation": validation,
           "projection_assumptions": assumptions.lines(), "projection": projection,
           "emulation": {k: v for k, v in (emulation or {}).items() if k != "dirs"},
           "sampling": {k: v for k, v in (sampling or {}).items() if k != "profile"}}
    atomic_write_text(out_dir / "derived.json", json.dumps(raw, indent=1, default=lambda o: str(o) if isinstance(o, Path) else float(o)))
    return report


SAMPLER_SECTION = "## Sampler throughput"


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
    end = min(i for i in (body.find("\n\nSampling cost measured on its own"), body.find("\n\n## "), len(body))
              if i >= 0)
    table = body[:end].strip()
    return None if table.startswith("(`dali-nerf bench sampler` table: skipped") else table


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
    (:func:`machine_slug`), and the sampler table from the ``report.md`` beside it
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


def _machine_desc() -> str:
    desc = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    desc += f" ({line.split(':', 1)[1].strip()})"
                    break
        if torch.cuda.is_available():
            desc += f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
        else:
            desc += ", no GPU"
    except Exception:
        pass
    return desc


STEP_MS_SOURCE = ("a stated assumption, not a measurement (no GPU was measured by this project): a range meant to "
                  "cover fast grid-based NeRF training steps on one datacenter GPU, whose fused field kernels take "
                  "milliseconds per step at batch sizes of this order; measure the study model's own step with "
                  "scripts/gpu_study.sh on a GPU and pass it as bench.emulated_step_ms")


def fit_and_check(derived: dict, b, rays: int, grad_bytes: int, sampling: Optional[dict],
                  links: Optional[DeviceLinks] = None):
    """The cost model fit on one set of runs, checked on the others.

    Emulated DDP rows present: fit on ``bench.fit_ranks`` at ``rays`` rays per rank, check on the
    other world sizes and batch sizes. Their device compute is known by construction (the emulated
    step time and host-to-device copy), so predictions take it as given and the model answers for
    the host side: the wait and the sync. Else (CPU rows only) fit and check on the CPU DDP rows,
    in sample, said so. Returns (model, validation rows with "set" fit | check, description)."""
    links = links or DeviceLinks()
    emu_rows = [c for c in derived["runs"] if c["device"] == "emulated" and c["method"] == "ddp"
                and c["sampler"] in cm.SAMPLERS]
    cores = os.cpu_count() or 1
    if emu_rows:
        obs = observations({"runs": emu_rows}, cores=cores)
        fit_i = [i for i, c in enumerate(emu_rows) if c["ranks"] in b.fit_ranks and c["rays_per_rank"] == rays]
        desc = (f"emulated DDP runs at {', '.join(map(str, b.fit_ranks))} ranks and {rays} rays per rank "
                f"({len(fit_i)} configurations); checked on the {len(emu_rows) - len(fit_i)} emulated DDP "
                f"configurations it did not see (other world sizes, other batch sizes); device compute and copies "
                f"are known by construction and given to the model")
        if not fit_i:
            fit_i = list(range(len(emu_rows)))
            desc = "all emulated DDP runs (none at bench.fit_ranks with this batch size: the check is in sample)"
        model = cm.fit([obs[i] for i in fit_i], sampling=sampling["profile"] if sampling else None,
                       grad_bytes=grad_bytes, allreduce_latency_s=b.allreduce_latency_s)
        rows = []
        for i, (c, o) in enumerate(zip(emu_rows, obs)):
            known = EmulatedDevice(c["emulated_step_ms"], links).compute_s(o.rays_per_rank)
            if c["sampler"] != "sync_global":
                known += links.h2d_s(o.rays_per_rank * (RAY_FLOATS * 4 + 24))
            p = model.predict(o.sampler, o.ranks, o.rays_per_rank, o.cores_per_rank, compute_s=known)
            rows.append({"method": o.method, "sampler": o.sampler, "ranks": o.ranks, "rays_per_rank": o.rays_per_rank,
                         "emulated_step_ms": c["emulated_step_ms"], "set": "fit" if i in fit_i else "check",
                         "step_measured_s": o.step_s, "step_predicted_s": p["step"],
                         "stall_measured": o.wait_s / o.step_s if o.step_s > 0 else 0.0, "stall_predicted": p["stall"],
                         "step_error": (p["step"] - o.step_s) / o.step_s if o.step_s > 0 else 0.0})
        return model, rows, desc
    obs = [o for o in observations(derived, cores=cores) if o.method == "ddp"] or observations(derived, cores=cores)
    model = cm.fit(obs, sampling=sampling["profile"] if sampling else None, grad_bytes=grad_bytes,
                   allreduce_latency_s=b.allreduce_latency_s)
    rows = cm.validate(model, obs)
    for o, v in zip(obs, rows):
        v["set"] = "fit"
        v["rays_per_rank"] = o.rays_per_rank
    return model, rows, "the CPU DDP runs (no emulated rows: the check is in sample)"


def main(args) -> int:
    """``dali-nerf bench study --config FILE [key=value ...]``."""
    config_path = args.config
    overrides = list(getattr(args, "overrides", []) or [])
    cfg = load_config(config_path, overrides, check_paths=False)
    b = cfg.bench
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    if not Path(cfg.scene.path).exists():
        print(f"generating the study scene ({b.scene_kind}, {b.scene_images} images, {b.scene_resolution} px) into {cfg.scene.path}", flush=True)
        make_scene(b.scene_kind, Path(cfg.scene.path), width=b.scene_resolution, height=b.scene_resolution,
                   n_train=b.scene_images)
    commit = git_commit()
    grad_bytes = model_grad_bytes(cfg.model)
    dirs, failed = ([], [])
    if b.ranks and b.samplers:
        dirs, failed = run_grid(cfg, config_path, overrides)
    emulation = None
    if (b.emulated_ranks or b.emulated_ranks_ss) and b.emulated_samplers and b.emulated_step_ms:
        emulation = run_emulated(cfg, grad_bytes)
    derived = derive(dirs, warmup=b.warmup) if dirs else {"trial_runs": [], "runs": [], "speedups": [], "summary": {}}
    if emulation:
        de = derive(emulation["dirs"])
        derived = {"trial_runs": derived["trial_runs"] + de["trial_runs"], "runs": derived["runs"] + de["runs"],
                   "speedups": derived["speedups"] + de["speedups"]}
        derived["summary"] = derive_summary(derived)
    if not derived["runs"]:
        raise DaliNerfError("bench: no configuration ran (bench.ranks/samplers and bench.emulated_* are all empty)")

    sampling = None
    if b.sampling_sizes:
        print("measuring sampling cost on its own", flush=True)
        sampling = measure_sampling(cfg, b.sampling_sizes)
    B = cfg.pipeline.rays_per_batch
    model, validation, fit_desc = fit_and_check(derived, b, B, grad_bytes, sampling)

    if b.gpu_step_ms > 0:
        gpu_c, src = b.gpu_step_ms / 1e3, f"bench.gpu_step_ms={b.gpu_step_ms}"
    elif emulation:
        gpu_c = b.check_step_ms * 1e-3 * B / 4096
        src = f"the emulated device step bench.check_step_ms={b.check_step_ms:g} ms per 4096 rays"
    else:
        cpu_c = model.compute_s(B, 1)
        gpu_c, src = cpu_c / b.gpu_cpu_ratio, f"fitted single-core compute {cpu_c * 1e3:.1f} ms / bench.gpu_cpu_ratio={b.gpu_cpu_ratio:g}"
    assumptions = cm.ProjectionAssumptions(gpu_compute_s=gpu_c, gpu_compute_source=src, rays_per_rank=B,
                                           cores_per_gpu=b.cores_per_gpu)
    projection = cm.project(model, assumptions)
    machine = machine_slug()
    cmd = "dali-nerf bench study --config " + shlex.quote(str(config_path)) + "".join(" " + shlex.quote(o) for o in overrides)
    cpu_threads = cfg.train.torch_threads or "cores / ranks"
    budgets = (f"CPU rows: {cfg.pipeline.num_threads or 'host-budget'} sampler thread(s) per rank (DALI threads for rays, "
               f"{cfg.pipeline.workers} worker process(es) for torch_workers, the training thread for sync_*) beside "
               f"{cpu_threads} torch thread(s) for compute")
    if emulation:
        budgets += ("; emulated rows: per launch, the threads of dali_nerf.hostbudget.host_budget (cores per local "
                    "rank) for every sampler (DALI threads, worker processes, the training thread's torch threads), "
                    "listed per launch below, with the priority of the threads and processes that sample ahead "
                    "(pipeline.thread_priority, auto: background for emulated devices, the same for the DALI loaders "
                    "and torch_workers; sync_* sample in the training thread)")
    meta = {
        "machine": machine, "machine_desc": _machine_desc(), "command": cmd, "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": time.perf_counter() - t_start,
        "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
        "steps": b.steps, "warmup": b.warmup, "trials": b.trials, "emulated_steps": b.emulated_steps,
        "emulated_warmup": b.emulated_warmup, "emulated_step_ms": list(b.emulated_step_ms),
        "step_ms_source": STEP_MS_SOURCE, "grad_bytes": grad_bytes, "rays": B, "budgets": budgets, "fit_set": fit_desc,
        "workload": (f"scene {cfg.scene.path}, {B} rays per rank per step, model "
                     + " ".join(f"{k}={v}" for k, v in config_to_dict(cfg.model).items())
                     + f", {grad_bytes / 1e6:.2f} MB of gradients"),
        "regime": b.regime, "failed": failed,
    }
    out = Path(b.out) / machine
    report = write_report(out, derived, model, validation, projection, assumptions, meta, sampling,
                          _sampler_table(cfg), emulation)
    s = derived["summary"]
    if s.get("mean_speedup") is not None:
        print(f"stall sync: mean {100 * s['mean_stall_sync']:.1f}% max {100 * s['max_stall_sync']:.1f}%; "
              f"speedup of pipelined: mean {s['mean_speedup']:.2f}x max {s['max_speedup']:.2f}x; "
              f"{s['flagged_pairs']}/{s['pairs']} pairs flagged", flush=True)
    print(f"report: {report}", flush=True)
    return 0
