"""The study's numbers from its runs' metrics files: per run, per configuration (mean and 95%
t-interval over trials) and per (baseline, pipelined) pair (speedup, its ideal from the data stall:
ratios of steps, so geometric means and intervals over trials, the speedup split into a sampler gain and an overlap gain through the same-sampler control
``rays_sync``, the pipelined step's hidden stall, flags with a cause).

A configuration is (device, method, ranks, cores, device step, rays per rank, sampler): ``cores``
are those its ranks ran on (the launch's CPU affinity), so regimes are named by cores per GPU
(cores / ranks); below 1 core per GPU an emulated row is a *starved host*, never compared with the
ISPASS study.

>>> d = derive(["runs/study/study_ddp_sync_global_1_t0_0", "runs/study/study_ddp_rays_1_t0_1"], warmup=10)
>>> d["speedups"][0]["speedup"], d["speedups"][0]["speedup_ci"]
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import yaml

from dali_nerf.train import emulation as emu
from dali_nerf.train.emulation import KEEPS_UP_STALL, KEEPS_UP_STEP
from dali_nerf.errors import DaliNerfError
from dali_nerf.bench import emulated as em

__all__ = ["derive", "read_run", "derive_summary", "mean_ci", "gmean_ci", "keeps_up", "keeps_up_reason", "starved",
           "comparable", "main_grid", "like_for_like", "PHASE_KEYS", "BASELINES", "BAND", "KEEPS_UP_STEP",
           "KEEPS_UP_STALL", "PAPER"]

PHASE_KEYS = ("wait", "h2d", "forward", "backward", "sync", "optimizer")
BASELINES = ("sync_global", "sync_local", "torch_workers")
"""The synchronous baselines (the ISPASS study's sync_global and the usual codebases'); the
same-sampler control ``rays_sync`` is paired with the pipelined run too (its speedup is the overlap
gain) but is not one of them."""
BAND = (1.0 / KEEPS_UP_STEP, KEEPS_UP_STEP)
"""The one threshold (:func:`dali_nerf.train.emulation.keeps_up`), both ways: a pipelined step more than
``KEEPS_UP_STEP`` x its floor's does not keep up (and its pairs are flagged); less than the floor's /
``KEEPS_UP_STEP`` is spread. Without a floor the same band bounds speedup / ideal."""
PAPER = {"stall": 0.433, "speedup_mean": 1.95, "speedup_max": 2.24}
"""What the ISPASS 2024 study reports: input sampling up to 43.3% of training time; overlapping it
with training 1.95x faster on average, 2.24x at most."""


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


def gmean_ci(xs: Sequence[float]) -> tuple:
    """(geometric mean, [lo, hi]) of positive ratios ``xs``: :func:`mean_ci` of their logs, back
    through exp (a 95% interval for the geometric mean, not symmetric about it). The geometric mean
    of per-trial products is the product of the geometric means, so a speedup's two gains multiply
    to it over trials as they do in each trial.

    >>> round(gmean_ci([1.2, 1.5, 1.8])[0] ** 3, 6) == round(1.2 * 1.5 * 1.8, 6)
    True
    """
    x = [v for v in xs if v is not None and math.isfinite(v)]
    if any(v <= 0 for v in x):
        raise DaliNerfError(f"gmean_ci: ratios must be positive, got {x} (a step time of 0 in a metrics file?)")
    m, (lo, hi) = mean_ci([math.log(v) for v in x])
    return math.exp(m), [math.exp(lo), math.exp(hi)]


def _gmean(xs: Sequence[float]) -> float:
    """The geometric mean of positive ratios ``xs`` (one trial's pairs)."""
    return float(np.exp(np.mean(np.log(np.asarray(xs, np.float64)))))


# ---------------------------------------------------------------------------------------------
# one run


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
    (trial, order, pair: the pipelined run next to this baseline; the cores the ranks ran on) and
    ``summary.json`` (test PSNR, SS fusion overhead).

    Returns {"name", "dir", "method", "sampler", "ranks", "device" (cpu | emulated | cuda),
    "emulated_step_ms", "trial", "order", "pair", "rays_per_rank", "steps_used", "phases_s"
    {wait, h2d, forward, backward, sync, optimizer} (mean seconds per step and rank), "compute_s"
    (h2d+forward+backward+optimizer), "step_s", "stall" (wait / step), "rays_per_s" (all ranks),
    "cores" (None when not recorded), "cores_per_gpu" (cores / ranks), "runq_s" (the training
    thread's run-queue wait per step, where the metrics have it), "overshoot_s" (emulated: the
    device wait past the seconds asked, per step), "test_psnr", "fusion" {...}}.
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
                        | {"rays": float(np.mean([r.get("rays", 0) for r in recs])), "n": len(recs)}
                        | {k: float(np.mean([r[f"{k}_s"] for r in recs])) if all(f"{k}_s" in r for r in recs) else None
                           for k in ("cpu", "runq", "overshoot")})
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
    cores = st.get("cores") or (st.get("budget") or {}).get("cores")
    cores = int(cores) if cores else None
    host_busy = float(np.sum(cpu)) / (step * cores) if None not in cpu and step > 0 and cores else None
    extra = {k: (float(np.mean([r[k] for r in per_rank])) if all(r[k] is not None for r in per_rank) else None)
             for k in ("runq", "overshoot")}
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
        "cores": cores, "cores_per_gpu": cores / len(files) if cores else None,
        "runq_s": extra["runq"], "overshoot_s": extra["overshoot"],
        "fusion": {k: v for k, v in summary.items()
                   if k in ("fusion_overhead", "fused_render_s", "single_render_s", "fused_psnr")},
    }


def _key(r: dict) -> tuple:
    return (r["device"], r["method"], r["ranks"], r.get("cores"), r["emulated_step_ms"], r["rays_per_rank"],
            r["sampler"])


def _as(k: tuple, sampler: str) -> tuple:
    """Key ``k`` (of :func:`_key`) with another sampler: the same configuration's floor, pipelined run or control."""
    return k[:-1] + (sampler,)


def starved(c: dict) -> bool:
    """An emulated row (or pair) below 1 core per GPU: a host no GPU server is (never compared with
    the ISPASS study)."""
    return c.get("device") == "emulated" and c.get("cores_per_gpu") is not None and c["cores_per_gpu"] < 1


# ---------------------------------------------------------------------------------------------
# configurations and pairs


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
    if p["stall"] > KEEPS_UP_STALL:
        parts.append(f"the pipelined run still waits {100 * p['stall']:.1f}% of its step (the host does not keep up)")
    if len(parts) == 1:
        parts.append("trial-to-trial spread (run order / machine drift): see the interval")
    return "; ".join(parts)


def _configurations(groups: Dict[tuple, List[dict]]) -> List[dict]:
    """One row per configuration (a group of :func:`read_run` rows with one :func:`_key`): means and
    95% intervals over trials, then the floor's columns (the configuration with sampler ``ready``
    beside it, when there is one) and the stall the wait does not show (:func:`_hidden`)."""
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
            "cores": r0.get("cores"), "cores_per_gpu": r0.get("cores_per_gpu"),
            "trials": len(trials), "runs": len(rs), "steps_used": min(r["steps_used"] for r in rs),
            "warmup": r0["warmup"], "step_s": step, "step_s_trials": step_t, "step_ci": step_ci,
            "stall": stall, "stall_trials": stall_t, "stall_ci": stall_ci, "phases_s": ph,
            "compute_s": ph["h2d"] + ph["forward"] + ph["backward"] + ph["optimizer"],
            "rays_per_s": float(np.mean([r["rays_per_s"] for r in rs])),
            "test_psnr": r0.get("test_psnr"), "fusion": r0.get("fusion") or {},
            "torch_threads": r0.get("torch_threads"), "sampler_threads": r0.get("sampler_threads"),
            "barrier_s": r0.get("barrier_s"), "dirs": [r["dir"] for r in rs],
            "host_busy": _mean_or_none(rs, "host_busy"), "runq_s": _mean_or_none(rs, "runq_s"),
            "overshoot_s": _mean_or_none(rs, "overshoot_s"),
        })
    ckey = {_key(c): c for c in configs}
    for c in configs:
        f = ckey.get(_as(_key(c), em.FLOOR))
        c["floor_step_s"] = f["step_s"] if f is not None else None
        c["step_over_floor"] = c["step_s"] / f["step_s"] if f is not None and f["step_s"] > 0 else None
        # lockstep ranks: a rank also waits at the collective for ranks still sampling; the part of
        # its sync above the floor's is data stall the per-rank wait does not count
        c["stall_lockstep"] = None
        if f is not None and c["step_s"] > 0:
            extra = max(0.0, c["phases_s"]["sync"] - f["phases_s"]["sync"])
            c["stall_lockstep"] = min(1.0, (c["phases_s"]["wait"] + extra) / c["step_s"])
        c.update(_hidden(c, f))
    return configs


def _mean_or_none(rs: List[dict], key: str) -> Optional[float]:
    return float(np.mean([r[key] for r in rs])) if rs and all(r.get(key) is not None for r in rs) else None


def _hidden(c: dict, floor: Optional[dict]) -> dict:
    """The stall a row's wait does not show, against its floor (the same step with a ready batch):

    * ``hidden_stall`` = 1 - floor step / step - wait / step: the share of the step lost outside
      ``next()`` (to sampling threads on shared cores, to waiting in lockstep for slower ranks);
    * measured directly, per step and over the step, beyond the floor's: ``hidden_runq`` (the
      training thread ready to run but without a core: its run-queue wait) and, emulated,
      ``hidden_overshoot`` (the device wait ending later than asked: the rank woken late). The two
      overlap (a late wake-up is both) and neither sees a lockstep wait for another rank.

    Also ``runq_share`` = run-queue wait / step (the floor's included). None where not measured."""
    step = c["step_s"]
    out = {"hidden_stall": None, "hidden_runq": None, "hidden_overshoot": None,
           "runq_share": c["runq_s"] / step if c.get("runq_s") is not None and step > 0 else None}
    if floor is None or step <= 0:
        return out
    out["hidden_stall"] = 1.0 - floor["step_s"] / step - c["phases_s"]["wait"] / step
    for k in ("runq", "overshoot"):
        if c.get(f"{k}_s") is not None and floor.get(f"{k}_s") is not None:
            out[f"hidden_{k}"] = (c[f"{k}_s"] - floor[f"{k}_s"]) / step
    return out


def _adjacent_pairs(rs: List[dict], pipelined: List[dict], by_dir: Dict[Path, dict]) -> List[tuple]:
    """[(trial, baseline run, pipelined run)]: each baseline run of ``rs`` with the pipelined run
    recorded next to it (study.json's "pair"), else the mean of the ``pipelined`` runs of its trial."""
    pairs = []  # (trial, baseline run, pipelined run)
    for r in rs:
        p = None
        if r.get("pair"):
            p = by_dir.get((Path(r["dir"]).parent / r["pair"]).resolve())
        if p is None:  # no adjacency recorded (older runs): the pipelined runs of the same trial
            same = [q for q in pipelined if q["trial"] == r["trial"]] or pipelined
            p = dict(same[0]) | {"step_s": float(np.mean([q["step_s"] for q in same])),
                                 "stall": float(np.mean([q["stall"] for q in same]))}
        pairs.append((r["trial"], r, p))
    return pairs


def _mean_run(rs: List[dict]) -> dict:
    """{"step_s", "stall", "phases_s"}: the means over runs ``rs``."""
    return {"step_s": float(np.mean([b["step_s"] for b in rs])), "stall": float(np.mean([b["stall"] for b in rs])),
            "phases_s": {k: float(np.mean([b["phases_s"][k] for b in rs])) for k in PHASE_KEYS}}


def _gains(pairs: List[tuple], trials: List[int], sp_t: List[float], control: Optional[List[dict]],
           is_control: bool) -> dict:
    """The speedup of each trial split through the same-sampler control (``control``: its runs):
    sampler gain = baseline step / control step (a faster sampler, both synchronous), overlap gain =
    control step / the pipelined step paired with the baseline (the same sampler, overlapped). The
    control's own pair: sampler gain 1, overlap gain its speedup. Geometric means and intervals over
    the trials (:func:`gmean_ci`, as the speedup's); None without a control run in every trial.

    sampler gain x overlap gain = speedup exactly (up to rounding), per pair, per trial and over
    trials: both gains divide the same two steps by the same control step, and geometric means
    keep products. Nothing measured can make them disagree, so no flag checks it; what the split
    cannot see is drift between the control's run and the baseline's (they need not be adjacent):
    it lands in the sampler gain, whose interval shows it."""
    none = {k: None for k in ("sampler_gain", "sampler_gain_ci", "sampler_gain_trials", "overlap_gain",
                              "overlap_gain_ci", "overlap_gain_trials")}
    if is_control:
        sg_t, og_t = [1.0] * len(sp_t), list(sp_t)
    else:
        ctl = {t: [q["step_s"] for q in (control or []) if q["trial"] == t] for t in trials}
        if not control or not all(ctl.values()):
            return none
        sg_t, og_t = [], []
        for t in trials:
            s = float(np.mean(ctl[t]))
            tp = [(b, p) for tt, b, p in pairs if tt == t]
            sg_t.append(_gmean([b["step_s"] / s for b, _ in tp]))
            og_t.append(_gmean([s / p["step_s"] for _, p in tp]))
    sg, sg_ci = gmean_ci(sg_t)
    og, og_ci = gmean_ci(og_t)
    return {"sampler_gain": sg, "sampler_gain_ci": sg_ci, "sampler_gain_trials": sg_t, "overlap_gain": og,
            "overlap_gain_ci": og_ci, "overlap_gain_trials": og_t}


def _flags(sp: float, sp_t: List[float], sp_ci, ideal: float, id_ci, use_floor: bool, pc: Optional[dict],
           bmean: dict, stall_data: Optional[float]) -> List[str]:
    """Why a pair's speedup is not explained by the baseline's data stall. With a floor, the
    pipelined row is judged by :func:`dali_nerf.train.emulation.keeps_up` (its stall and its step over
    the floor's), as its "keeps up" column is: a row that does not keep up flags every pair against it."""
    flags = []
    if len(sp_t) > 1 and sp_ci[0] > id_ci[1]:
        flags.append("speedup interval above the ideal's")
    over = pc.get("step_over_floor") if (pc and use_floor) else None
    if over is not None:
        # the rules the row's "keeps up" column breaks, in its words
        flags += [f"pipelined {why}: the host does not keep up" for why in emu.keeps_up_reason(pc["stall"], over)]
        if over < BAND[0]:
            flags.append(f"pipelined step {over:.2f}x the floor < 1/{BAND[1]:g}: faster than the same step with a "
                         f"ready batch")
    else:
        ratio = sp / ideal if ideal > 0 else float("nan")
        if not BAND[0] <= ratio <= BAND[1]:
            flags.append(f"speedup/ideal {ratio:.2f} outside [{BAND[0]:.2f}, {BAND[1]:g}]")
    if stall_data is not None and bmean["stall"] > stall_data + 0.05:
        flags.append(f"the baseline waits {100 * bmean['stall']:.1f}% of its step, more than its step exceeds "
                     f"the floor's ({100 * stall_data:.1f}%): the floor ran slow")
    return flags


def _speedup(k: tuple, rs: List[dict], groups: Dict[tuple, List[dict]], ckey: Dict[tuple, dict],
             by_dir: Dict[Path, dict]) -> Optional[dict]:
    """The speedup row of baseline (or control) group ``k`` (runs ``rs``) against the pipelined
    group of the same configuration (:func:`derive` documents its keys); None when ``k`` is neither
    or has no pipelined group."""
    device, method, ranks, cores, ems, rays, sampler = k
    if sampler not in BASELINES + (em.SYNC_CONTROL,):
        return None
    pk = _as(k, em.PIPELINED)
    if pk not in groups:
        return None
    pairs = _adjacent_pairs(rs, groups[pk], by_dir)
    trials = sorted({t for t, _, _ in pairs})
    fk = _as(k, em.FLOOR)
    floor_t = {t: float(np.mean([q["step_s"] for q in groups[fk] if q["trial"] == t]))
               for t in trials if fk in groups and any(q["trial"] == t for q in groups[fk])}
    use_floor = len(floor_t) == len(trials)
    sp_t, id_t, iw_t, bl, pl = [], [], [], [], []
    for t in trials:
        tp = [(b, p) for tt, b, p in pairs if tt == t]
        sp_t.append(_gmean([b["step_s"] / p["step_s"] for b, p in tp]))
        iw_t.append(_gmean([1.0 / (1.0 - b["stall"]) if b["stall"] < 1 else float("inf") for b, _ in tp]))
        # the data stall: the part of the baseline's step that the same step with no data cost
        # (the floor, same trial) does not have, whatever phase it shows up in
        id_t.append(_gmean([max(1.0, b["step_s"] / floor_t[t]) for b, _ in tp]) if use_floor else iw_t[-1])
        for b, p in tp:
            bl.append(b)
            pl.append(p)
    sp, sp_ci = gmean_ci(sp_t)
    ideal, id_ci = gmean_ci(id_t)
    ideal_w, iw_ci = gmean_ci(iw_t)
    bmean, pmean = _mean_run(bl), _mean_run(pl)
    fc = ckey.get(fk) if use_floor else None
    pc = ckey.get(pk)
    pmean["host_busy"] = pc.get("host_busy") if pc else None
    stall_data = 1.0 - 1.0 / ideal if use_floor and ideal > 0 else None
    gains = _gains(pairs, trials, sp_t, groups.get(_as(k, em.SYNC_CONTROL)), sampler == em.SYNC_CONTROL)
    flags = _flags(sp, sp_t, sp_ci, ideal, id_ci, use_floor, pc, bmean, stall_data)
    bc = ckey.get(k)
    sl = bc.get("stall_lockstep") if bc else None
    ctl = ckey.get(_as(k, em.SYNC_CONTROL))
    return {
        "ideal_speedup_lockstep": (1.0 / (1.0 - sl) if sl < 1 else float("inf")) if sl is not None else None,
        "method": method, "ranks": ranks, "device": device, "emulated_step_ms": ems, "rays_per_rank": rays,
        "cores": cores, "cores_per_gpu": cores / ranks if cores else None,
        "baseline": sampler, "speedup": sp, "speedup_trials": sp_t, "speedup_ci": sp_ci,
        "ideal_speedup": ideal, "ideal_trials": id_t, "ideal_ci": id_ci, "ideal_basis": "floor" if use_floor else "wait",
        "ideal_speedup_wait": ideal_w, "ideal_wait_ci": iw_ci, "stall_data": stall_data,
        "ratio": sp / ideal if ideal > 0 else float("nan"), "flags": flags,
        # with a floor, the pipelined configuration (all its runs) against it, as the host flag reads it
        "cause": _cause(bmean, pc if (fc is not None and pc) else pmean, fc) if flags else None, **gains,
        "pipelined_over_floor": pc.get("step_over_floor") if pc else None,
        "hidden_stall": pc.get("hidden_stall") if pc else None,
        "hidden_runq": pc.get("hidden_runq") if pc else None,
        "hidden_overshoot": pc.get("hidden_overshoot") if pc else None,
        "step_baseline_s": bmean["step_s"], "step_pipelined_s": pmean["step_s"],
        "step_floor_s": float(np.mean(list(floor_t.values()))) if use_floor else None,
        "stall_baseline": bmean["stall"], "stall_pipelined": pmean["stall"],
        "stall_rays_sync": ctl["stall"] if ctl else None, "trials": len(trials),
    }


def derive(run_dirs: Sequence, warmup: Optional[int] = None) -> dict:
    """Everything the report states, recomputed from the runs' metrics files.

    Runs are grouped into configurations (device, method, ranks, cores, emulated_step_ms, rays per
    rank, sampler); a configuration's value per trial is the mean of its runs in that trial.
    ``warmup``: the untimed steps of every run (None: each run's own ``bench.warmup``).

    Returns {"trial_runs": [read_run(...)...], "runs": [configuration: {"method", "sampler",
    "ranks", "device", "cores", "cores_per_gpu", "emulated_step_ms", "rays_per_rank", "step_s"
    (mean over trials), "step_s_trials", "step_ci", "stall", "stall_trials", "stall_ci", "phases_s"
    (means), "compute_s", "rays_per_s", "trials", "test_psnr", "fusion", "floor_step_s" (the floor's
    step in the same configuration, else None), "step_over_floor", "hidden_stall", "hidden_runq",
    "hidden_overshoot", "runq_share"}...], "speedups": [{"method", "ranks", "device", "cores",
    "cores_per_gpu", "emulated_step_ms", "rays_per_rank", "baseline" (a baseline or the control
    rays_sync), "speedup" (geometric mean over trials of baseline step / adjacent pipelined step),
    "speedup_trials", "speedup_ci" [lo, hi] (:func:`gmean_ci`), "ideal_speedup" (geometric mean over
    trials of baseline step / floor step), "ideal_ci", "ratio" (speedup / ideal), "sampler_gain"
    (baseline / rays_sync), "overlap_gain" (rays_sync / pipelined; each with "_ci" and "_trials";
    their product is the speedup: :func:`_gains`), "pipelined_over_floor", "hidden_stall", "hidden_runq",
    "hidden_overshoot" (the pipelined row's), "flags" [...], "cause", "step_baseline_s",
    "step_pipelined_s", "stall_baseline", "stall_rays_sync", "stall_pipelined"}...],
    "summary": :func:`derive_summary`}.
    """
    trial_runs = [read_run(d, warmup) for d in run_dirs]
    by_dir = {Path(r["dir"]).resolve(): r for r in trial_runs}
    groups: Dict[tuple, List[dict]] = {}
    for r in trial_runs:
        groups.setdefault(_key(r), []).append(r)
    configs = _configurations(groups)
    ckey = {_key(c): c for c in configs}
    speedups = [s for s in (_speedup(k, rs, groups, ckey, by_dir) for k, rs in groups.items()) if s is not None]
    order = {"cpu": 0, "cuda": 1, "emulated": 2}

    def sort_key(c, sampler):
        return (order.get(c["device"], 3), c["method"], c["emulated_step_ms"] or 0, c["rays_per_rank"],
                -(c.get("cores_per_gpu") or 0), c["ranks"], sampler)
    configs.sort(key=lambda c: sort_key(c, c["sampler"]))
    speedups.sort(key=lambda c: sort_key(c, c["baseline"]))
    out = {"trial_runs": trial_runs, "runs": configs, "speedups": speedups}
    out["summary"] = derive_summary(out)
    return out


def comparable(x: dict, main: Optional[tuple] = None) -> bool:
    """A pair the report may set beside the ISPASS study: emulated GPUs, at least 1 core per GPU,
    a synchronous baseline split by the control (both gains), not flagged, and of the main grid
    (``main``: :func:`main_grid`'s trials and rays per GPU; None: any)."""
    return (x["device"] == "emulated" and not starved(x) and x.get("cores_per_gpu") is not None
            and x["baseline"] in BASELINES and x.get("sampler_gain") is not None and not x["flags"]
            and (main is None or (int(x.get("trials") or 0) >= main[0] and x.get("rays_per_rank") == main[1])))


def main_grid(speedups: List[dict]) -> Optional[tuple]:
    """(trials, rays per GPU) of the emulated main grid: those of the most emulated pairs (then the
    most trials), which leaves out the cost model's check segments (other batch sizes, run once);
    None without an emulated pair."""
    n = Counter((int(x.get("trials") or 0), x.get("rays_per_rank")) for x in speedups if x["device"] == "emulated")
    return max(n, key=lambda k: (n[k], k[0])) if n else None


def _regime(x: dict) -> dict:
    keys = ("method", "baseline", "cores", "cores_per_gpu", "ranks", "emulated_step_ms", "rays_per_rank", "speedup",
            "speedup_ci", "sampler_gain", "sampler_gain_ci", "overlap_gain", "overlap_gain_ci", "stall_baseline",
            "stall_rays_sync", "stall_pipelined", "hidden_stall", "pipelined_over_floor")
    return {k: x.get(k) for k in keys}


def like_for_like(speedups: List[dict]) -> Optional[dict]:
    """The ISPASS study's comparison, like for like: its setting (sync_global) split into the
    sampler gain and the overlap gain, over the comparable pairs (:func:`comparable`), per method.

    Returns None without one, else {"baseline": "sync_global", "regimes": [per pair: method,
    cores, cores per GPU, ranks, device step, rays per rank, speedup, both gains with intervals,
    the three stalls, the hidden stall, pipelined step / floor], "headline": the DDP regime with the
    most cores per GPU (then the most ranks, then the shortest device step: where input sampling
    matters most), "overlap_gain_mean", "overlap_gain_max" (DDP and SS), "paper": :data:`PAPER`}."""
    main = main_grid(speedups)
    rs = [_regime(x) for x in speedups if comparable(x, main) and x["baseline"] == "sync_global"]
    if not rs:
        return None
    ddp = [r for r in rs if r["method"] == "ddp"] or rs
    head = max(ddp, key=lambda r: (r["cores_per_gpu"], r["ranks"], -(r["emulated_step_ms"] or 0)))
    og = [r["overlap_gain"] for r in rs]
    return {"baseline": "sync_global", "regimes": rs, "headline": head, "overlap_gain_mean": float(np.mean(og)),
            "overlap_gain_max": float(np.max(og)), "paper": dict(PAPER)}


def derive_summary(derived: dict) -> dict:
    """Over :func:`derive`'s configurations and pairs: {"pairs", "flagged_pairs", "mean_stall_sync",
    "max_stall_sync", "max_stall_pipelined" (every row), "comparable": {"pairs", "mean_speedup",
    "max_speedup", "mean_sampler_gain", "mean_overlap_gain", "max_overlap_gain"} (the pairs of
    :func:`comparable`: the one mean the report and the console quote) or None, "like_for_like"
    (:func:`like_for_like`), "starved": {"rows", "max_step_over_floor", "max_hidden_stall"} (the
    starved host's pipelined rows: configurations, not pairs) or None}."""
    configs, speedups = derived["runs"], derived["speedups"]
    sync_stalls = [c["stall"] for c in configs if c["sampler"] in BASELINES]
    pipe_stalls = [c["stall"] for c in configs if c["sampler"] == em.PIPELINED]
    comp = [x for x in speedups if comparable(x, main_grid(speedups))]
    low = [c for c in configs if starved(c) and c["sampler"] == em.PIPELINED]
    return {
        "pairs": len(speedups), "flagged_pairs": sum(1 for s in speedups if s["flags"]),
        "mean_stall_sync": float(np.mean(sync_stalls)) if sync_stalls else None,
        "max_stall_sync": float(np.max(sync_stalls)) if sync_stalls else None,
        "max_stall_pipelined": float(np.max(pipe_stalls)) if pipe_stalls else None,
        "comparable": {"pairs": len(comp), "mean_speedup": float(np.mean([x["speedup"] for x in comp])),
                       "max_speedup": float(np.max([x["speedup"] for x in comp])),
                       "mean_sampler_gain": float(np.mean([x["sampler_gain"] for x in comp])),
                       "mean_overlap_gain": float(np.mean([x["overlap_gain"] for x in comp])),
                       "max_overlap_gain": float(np.max([x["overlap_gain"] for x in comp]))} if comp else None,
        "like_for_like": like_for_like(speedups),
        "starved": {"rows": len(low),
                    "max_step_over_floor": max((c["step_over_floor"] or 0) for c in low),
                    "max_hidden_stall": max((c["hidden_stall"] or 0) for c in low)} if low else None,
    }


# ---------------------------------------------------------------------------------------------
# the host's verdict on a pipelined emulated row


def keeps_up(c: dict) -> Optional[bool]:
    """For a pipelined emulated row with a floor: the host supplies the demand
    (:func:`dali_nerf.train.emulation.keeps_up` of its stall and step over the floor's: the rule of the
    pairs' flags too); None for other rows."""
    if c["device"] != "emulated" or c["sampler"] != em.PIPELINED or c.get("step_over_floor") is None:
        return None
    return emu.keeps_up(c["stall"], c["step_over_floor"])


def keeps_up_reason(c: dict) -> str:
    """Which of :func:`keeps_up`'s rules a row breaks ("" when none)."""
    return ", ".join(emu.keeps_up_reason(c["stall"], c.get("step_over_floor")))
