"""Configurations and pairs: a configuration's means and 95% intervals over trials, with its floor
and the stall its wait does not show (:func:`configurations`); a (baseline, pipelined) pair's
speedup, its ideal from the data stall, the split through the same-sampler control into a sampler
gain and an overlap gain, and its flags with a cause (:func:`speedup_row`). Ratios of steps are
geometric means over trials (:func:`~dali_nerf.bench.study.stats.gmean_ci`).

>>> configs = configurations(groups)                  # groups: {config_key: [read_run(...), ...]}
>>> row = speedup_row(k, groups[k], groups, {config_key(c): c for c in configs}, by_dir)
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from dali_nerf.train import emulation as emu
from dali_nerf.bench import emulated as em
from dali_nerf.bench.study.read import PHASE_KEYS, config_key, with_sampler
from dali_nerf.bench.study.rules import BAND, BASELINES, KEEPS_UP_STALL
from dali_nerf.bench.study.stats import gmean, gmean_ci, mean_ci

__all__ = ["configurations", "speedup_row"]


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


def configurations(groups: Dict[tuple, List[dict]]) -> List[dict]:
    """One row per configuration (a group of :func:`read_run` rows with one :func:`~dali_nerf.bench.study.read.config_key`): means and
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
            "step_name": r0.get("step_name"), "grid": r0.get("grid") or "main", "scene": r0.get("scene"),
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
    ckey = {config_key(c): c for c in configs}
    for c in configs:
        f = ckey.get(with_sampler(config_key(c), em.FLOOR))
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
            sg_t.append(gmean([b["step_s"] / s for b, _ in tp]))
            og_t.append(gmean([s / p["step_s"] for _, p in tp]))
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


def speedup_row(k: tuple, rs: List[dict], groups: Dict[tuple, List[dict]], ckey: Dict[tuple, dict],
             by_dir: Dict[Path, dict]) -> Optional[dict]:
    """The speedup row of baseline (or control) group ``k`` (runs ``rs``) against the pipelined
    group of the same configuration (:func:`derive` documents its keys); None when ``k`` is neither
    or has no pipelined group."""
    device, method, ranks, cores, scene, grid, step_name, ems, rays, sampler = k
    if sampler not in BASELINES + (em.SYNC_CONTROL,):
        return None
    pk = with_sampler(k, em.PIPELINED)
    if pk not in groups:
        return None
    pairs = _adjacent_pairs(rs, groups[pk], by_dir)
    trials = sorted({t for t, _, _ in pairs})
    fk = with_sampler(k, em.FLOOR)
    floor_t = {t: float(np.mean([q["step_s"] for q in groups[fk] if q["trial"] == t]))
               for t in trials if fk in groups and any(q["trial"] == t for q in groups[fk])}
    use_floor = len(floor_t) == len(trials)
    sp_t, id_t, iw_t, bl, pl = [], [], [], [], []
    for t in trials:
        tp = [(b, p) for tt, b, p in pairs if tt == t]
        sp_t.append(gmean([b["step_s"] / p["step_s"] for b, p in tp]))
        iw_t.append(gmean([1.0 / (1.0 - b["stall"]) if b["stall"] < 1 else float("inf") for b, _ in tp]))
        # the data stall: the part of the baseline's step that the same step with no data cost
        # (the floor, same trial) does not have, whatever phase it shows up in
        id_t.append(gmean([max(1.0, b["step_s"] / floor_t[t]) for b, _ in tp]) if use_floor else iw_t[-1])
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
    gains = _gains(pairs, trials, sp_t, groups.get(with_sampler(k, em.SYNC_CONTROL)), sampler == em.SYNC_CONTROL)
    flags = _flags(sp, sp_t, sp_ci, ideal, id_ci, use_floor, pc, bmean, stall_data)
    bc = ckey.get(k)
    sl = bc.get("stall_lockstep") if bc else None
    ctl = ckey.get(with_sampler(k, em.SYNC_CONTROL))
    return {
        "ideal_speedup_lockstep": (1.0 / (1.0 - sl) if sl < 1 else float("inf")) if sl is not None else None,
        "method": method, "ranks": ranks, "device": device, "emulated_step_ms": ems, "rays_per_rank": rays,
        "step_name": step_name, "grid": grid, "scene": scene,
        "cores": cores, "cores_per_gpu": cores / ranks if cores else None,
        "sampler_threads": pc.get("sampler_threads") if pc else None, "baseline": sampler, "speedup": sp, "speedup_trials": sp_t, "speedup_ci": sp_ci,
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
        # the pipelined row's stall as its configuration has it (all its runs), as its step / floor and
        # hidden stall: the numbers quoted beside each other come from one place
        "stall_baseline": bmean["stall"], "stall_pipelined": pc["stall"] if pc else pmean["stall"],
        "stall_rays_sync": ctl["stall"] if ctl else None, "step_rays_sync_s": ctl["step_s"] if ctl else None,
        "trials": len(trials),
    }
