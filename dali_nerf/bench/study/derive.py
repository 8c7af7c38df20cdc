"""The study's numbers from its runs' metrics files: per run (:mod:`.read`), per configuration (mean
and 95% t-interval over trials) and per (baseline, pipelined) pair (speedup, its ideal from the data
stall: ratios of steps, so geometric means and intervals over trials, the speedup split into a
sampler gain and an overlap gain through the same-sampler control ``rays_sync``, the pipelined
step's hidden stall, flags with a cause: :mod:`.pairs`), and the summary (:mod:`.summary`).

A configuration is (device, method, ranks, cores, device step, rays per rank, sampler): ``cores``
are those its ranks ran on (the launch's CPU affinity), so regimes are named by cores per GPU
(cores / ranks); below 1 core per GPU an emulated row is a *starved host*, never compared with the
ISPASS study (:mod:`.rules`).

>>> d = derive(["runs/study/study_ddp_sync_global_1_t0_0", "runs/study/study_ddp_rays_1_t0_1"], warmup=10)
>>> d["speedups"][0]["speedup"], d["speedups"][0]["speedup_ci"]
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

from dali_nerf.bench.study.pairs import configurations, speedup_row
from dali_nerf.bench.study.read import PHASE_KEYS, config_key, read_run
from dali_nerf.bench.study.rules import (BAND, BASELINES, KEEPS_UP_STALL, KEEPS_UP_STEP, PAPER, comparable, keeps_up,
                                         keeps_up_reason, main_grid, starved)
from dali_nerf.bench.study.stats import gmean_ci, mean_ci
from dali_nerf.bench.study.summary import derive_summary, like_for_like

__all__ = ["derive", "read_run", "derive_summary", "mean_ci", "gmean_ci", "keeps_up", "keeps_up_reason", "starved",
           "comparable", "main_grid", "like_for_like", "PHASE_KEYS", "BASELINES", "BAND", "KEEPS_UP_STEP",
           "KEEPS_UP_STALL", "PAPER"]


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
    their product is the speedup: :func:`~dali_nerf.bench.study.pairs.speedup_row`), "pipelined_over_floor", "hidden_stall", "hidden_runq",
    "hidden_overshoot" (the pipelined row's), "flags" [...], "cause", "step_baseline_s",
    "step_pipelined_s", "stall_baseline", "stall_rays_sync", "stall_pipelined"}...],
    "summary": :func:`derive_summary`}.
    """
    trial_runs = [read_run(d, warmup) for d in run_dirs]
    by_dir = {Path(r["dir"]).resolve(): r for r in trial_runs}
    groups: Dict[tuple, List[dict]] = {}
    for r in trial_runs:
        groups.setdefault(config_key(r), []).append(r)
    configs = configurations(groups)
    ckey = {config_key(c): c for c in configs}
    speedups = [s for s in (speedup_row(k, rs, groups, ckey, by_dir) for k, rs in groups.items()) if s is not None]
    order = {"cpu": 0, "cuda": 1, "emulated": 2}

    def sortconfig_key(c, sampler):
        return (order.get(c["device"], 3), c["method"], c["emulated_step_ms"] or 0, c["rays_per_rank"],
                -(c.get("cores_per_gpu") or 0), c["ranks"], sampler)
    configs.sort(key=lambda c: sortconfig_key(c, c["sampler"]))
    speedups.sort(key=lambda c: sortconfig_key(c, c["baseline"]))
    out = {"trial_runs": trial_runs, "runs": configs, "speedups": speedups}
    out["summary"] = derive_summary(out)
    return out
