"""The study's summary over its configurations and pairs: the like-for-like comparison with the
ISPASS study (:func:`like_for_like`) and the numbers the report and the console quote
(:func:`derive_summary`).

>>> s = derive_summary(derive(dirs))
>>> s["like_for_like"]["headline"]["overlap_gain"]
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from dali_nerf.bench import emulated as em
from dali_nerf.bench.study.rules import BASELINES, PAPER, comparable, main_grid, starved

__all__ = ["like_for_like", "derive_summary"]


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
