"""The study's summary over its configurations and pairs: the headline, by a rule fixed before the
study runs (:func:`~dali_nerf.bench.study.rules.headline`), the like-for-like comparison with the
ISPASS study (:func:`like_for_like`), the small scene's cache row beside the same row of the main
scene, and the numbers the report and the console quote (:func:`derive_summary`): each quoted
number is computed here once.

The control's own cost (measured apart, :mod:`dali_nerf.bench.study.control`: the copy out of
DALI's buffers and the synchronous executor that ``rays_sync`` pays and the pipelined loader does
not) is a factor of its own: control factor = rays_sync step / (rays_sync step - that cost), and the
overlap gain beyond it = overlap gain / control factor.

>>> s = derive_summary(derive(dirs), rule={"host_cores": 2, "step": "measured"}, control=control)
>>> [r["overlap_gain"] for r in s["headline"]["rows"]]
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from dali_nerf.bench import emulated as em
from dali_nerf.bench.study.rules import BASELINES, PAPER, comparable, headline, headline_rule, main_grid, starved

__all__ = ["like_for_like", "derive_summary", "control_factor", "cache_rows"]

_REGIME_KEYS = ("method", "baseline", "cores", "cores_per_gpu", "ranks", "step_name", "emulated_step_ms",
                "rays_per_rank", "speedup", "speedup_ci", "sampler_gain", "sampler_gain_ci", "overlap_gain",
                "overlap_gain_ci", "stall_baseline", "stall_rays_sync", "stall_pipelined", "hidden_stall",
                "pipelined_over_floor", "step_baseline_s", "step_pipelined_s", "step_rays_sync_s", "sampler_threads",
                "flags", "trials", "scene")


def control_factor(x: dict, control: Optional[dict]) -> dict:
    """{"control_cost_s", "control_factor", "control_factor_ci", "overlap_beyond", "overlap_beyond_ci"} of
    pair ``x`` (None each where the control's own cost was not measured at its rays and threads):
    factor = rays_sync step / (rays_sync step - the control's own cost per step), its interval from
    the cost's; overlap beyond = overlap gain / factor, its interval the overlap gain's over the
    factor's (both ends, the wider way)."""
    none = dict.fromkeys(("control_cost_s", "control_factor", "control_factor_ci", "overlap_beyond",
                          "overlap_beyond_ci"))
    ctl = x.get("step_rays_sync_s")
    row = None
    if control and ctl and x.get("overlap_gain") is not None:
        row = next((r for r in control.get("rows", []) if r["rays"] == x["rays_per_rank"]
                    and (x.get("sampler_threads") is None or r["threads"] == x["sampler_threads"])), None)
    if row is None or ctl - max(row["own_ci"]) <= 0:
        return none
    f = ctl / (ctl - row["own_s"])
    f_lo, f_hi = sorted((ctl / (ctl - row["own_ci"][0]), ctl / (ctl - row["own_ci"][1])))
    og, (o_lo, o_hi) = x["overlap_gain"], x["overlap_gain_ci"]
    return {"control_cost_s": row["own_s"], "control_factor": f, "control_factor_ci": [f_lo, f_hi],
            "overlap_beyond": og / f, "overlap_beyond_ci": [o_lo / f_hi, o_hi / f_lo]}


def _regime(x: dict, control: Optional[dict]) -> dict:
    return {k: x.get(k) for k in _REGIME_KEYS} | control_factor(x, control)


def like_for_like(speedups: List[dict], control: Optional[dict] = None) -> Optional[dict]:
    """The ISPASS study's comparison, like for like: its setting (sync_global) split into the
    sampler gain and the overlap gain (and the control's own factor, where measured), over the
    comparable pairs (:func:`~dali_nerf.bench.study.rules.comparable`).

    Returns None without one, else {"baseline": "sync_global", "regimes": [per pair: method, cores,
    cores per GPU, ranks, device step (name, ms), rays per rank, speedup, both gains with intervals,
    the three stalls, the hidden stall, pipelined step / floor, the control factor], "overlap_gain_mean",
    "overlap_gain_max" (over those regimes: the one mean and maximum the report quotes), "paper": :data:`PAPER`}."""
    main = main_grid(speedups)
    rs = [_regime(x, control) for x in speedups if comparable(x, main) and x["baseline"] == "sync_global"]
    if not rs:
        return None
    og = [r["overlap_gain"] for r in rs]
    return {"baseline": "sync_global", "regimes": rs, "overlap_gain_mean": float(np.mean(og)),
            "overlap_gain_max": float(np.max(og)), "paper": dict(PAPER)}


def cache_rows(speedups: List[dict]) -> List[dict]:
    """The cache-effect rows: each small-scene pair (grid "cache") against sync_global, with the same
    configuration's pair of the main scene beside it ({"small", "main" (None when the main grid did
    not run it)})."""
    out = []
    for x in speedups:
        if (x.get("grid") or "main") != "cache" or x["baseline"] != "sync_global":
            continue
        same = [y for y in speedups if (y.get("grid") or "main") == "main" and y["baseline"] == "sync_global"
                and all(y.get(k) == x.get(k) for k in ("method", "ranks", "cores", "step_name", "emulated_step_ms",
                                                        "rays_per_rank"))]
        out.append({"small": {k: x.get(k) for k in _REGIME_KEYS}, "main": {k: same[0].get(k) for k in _REGIME_KEYS}
                    if same else None})
    return out


def derive_summary(derived: dict, rule: Optional[dict] = None, control: Optional[dict] = None) -> dict:
    """Over :func:`derive`'s configurations and pairs: {"pairs", "flagged_pairs", "mean_stall_sync",
    "max_stall_sync", "max_stall_pipelined" (every configuration), "headline": {"rule" (in words),
    "step", "host_cores", "rows" (the pairs of the rule, :func:`~dali_nerf.bench.study.rules.headline`,
    flagged or not, with the control factor)}, "comparable": {"pairs", "mean_speedup", "max_speedup",
    "mean_sampler_gain"} (the pairs of :func:`comparable`) or None, "like_for_like"
    (:func:`like_for_like`), "overlap" (the overlap plot's pairs: every main-grid sync_global pair at
    >= 1 core per GPU, flagged or not, with the control factor), "cache" (:func:`cache_rows`), "starved": {"rows", "max_step_over_floor",
    "max_hidden_stall"} (the starved host's pipelined rows) or None}.

    ``rule``: {"host_cores": the study host's usable cores, "step": the headline device step's name}
    (None: any cores and any step); ``control``: the control's own cost (:mod:`.control`)."""
    configs, speedups = derived["runs"], derived["speedups"]
    sync_stalls = [c["stall"] for c in configs if c["sampler"] in BASELINES]
    pipe_stalls = [c["stall"] for c in configs if c["sampler"] == em.PIPELINED]
    comp = [x for x in speedups if comparable(x, main_grid(speedups))]
    low = [c for c in configs if starved(c) and c["sampler"] == em.PIPELINED]
    rule = rule or {}
    head = [_regime(x, control) for x in speedups if headline(x, rule.get("host_cores"), rule.get("step"))]
    head.sort(key=lambda r: (r["ranks"], r["rays_per_rank"]))
    # the overlap plot's points: every main-grid sync_global pair at >= 1 core per GPU, flagged or not
    over = [_regime(x, control) for x in speedups if x["device"] == "emulated" and x["baseline"] == "sync_global"
            and (x.get("grid") or "main") == "main" and not starved(x) and x.get("cores_per_gpu") is not None
            and x.get("overlap_gain") is not None]
    return {
        "pairs": len(speedups), "flagged_pairs": sum(1 for s in speedups if s["flags"]),
        "mean_stall_sync": float(np.mean(sync_stalls)) if sync_stalls else None,
        "max_stall_sync": float(np.max(sync_stalls)) if sync_stalls else None,
        "max_stall_pipelined": float(np.max(pipe_stalls)) if pipe_stalls else None,
        "headline": {"rule": headline_rule(rule.get("step")), "step": rule.get("step"),
                     "host_cores": rule.get("host_cores"), "rows": head},
        "comparable": {"pairs": len(comp), "mean_speedup": float(np.mean([x["speedup"] for x in comp])),
                       "max_speedup": float(np.max([x["speedup"] for x in comp])),
                       "mean_sampler_gain": float(np.mean([x["sampler_gain"] for x in comp]))} if comp else None,
        "like_for_like": like_for_like(speedups, control), "overlap": over,
        "cache": cache_rows(speedups),
        "starved": {"rows": len(low),
                    "max_step_over_floor": max((c["step_over_floor"] or 0) for c in low),
                    "max_hidden_stall": max((c["hidden_stall"] or 0) for c in low)} if low else None,
    }
