"""PNG plots of the study (matplotlib's object API: a Figure saved by the Agg canvas; no pyplot, so no
backend is selected and no global figure state is touched).

* :func:`plot_phases`      stacked bars of the per-phase breakdown per configuration (ms per step);
* :func:`plot_speedups`    measured speedup (95% CI) of the pipelined loader against the ideal 1/(1-data stall);
* :func:`plot_scaling`     emulated rows: stall and step / floor against cores per GPU;
* :func:`plot_model_check` measured vs cost-model step time (fit set and out-of-sample check);
* :func:`plot_overlap`     the overlap gain (95% CI) against the rays per GPU and the device step.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence, Tuple

from matplotlib.figure import Figure

from dali_nerf.train.emulation import KEEPS_UP_STALL, KEEPS_UP_STEP

__all__ = ["plot_phases", "plot_speedups", "plot_scaling", "scaling_rows", "plot_model_check", "plot_overlap",
           "PHASE_COLORS", "SAMPLER_COLORS"]

SAMPLER_COLORS = {"sync_global": "#d62728", "sync_local": "#ff7f0e", "torch_workers": "#9467bd",
                  "rays_sync": "#17becf", "rays": "#2ca02c"}
"""One colour per batch source, in every plot."""
PHASE_COLORS = {"wait": "#d62728", "h2d": "#9467bd", "forward": "#1f77b4", "backward": "#2ca02c",
                "sync": "#ff7f0e", "optimizer": "#8c564b"}


def _save(fig: Figure, path, tight: bool = True) -> Path:
    """Write ``fig`` as a PNG (dpi 110)."""
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def plot_phases(runs: Sequence[dict], path: Path) -> Path:
    """Stacked bars, one per run (``derive()["runs"]``): mean ms per step of each phase."""
    labels = [f"{r['method']}\n{r['sampler']}\nx{r['ranks']}" for r in runs]
    fig = Figure(figsize=(max(6.0, 0.9 * len(runs) + 2), 4.5))
    ax = fig.subplots()
    bottom = [0.0] * len(runs)
    for ph, color in PHASE_COLORS.items():
        vals = [r["phases_s"][ph] * 1e3 for r in runs]
        ax.bar(range(len(runs)), vals, bottom=bottom, color=color, label=ph)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(runs):
        ax.text(i, bottom[i], f"{100 * r['stall']:.0f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("ms per step (mean over ranks)")
    ax.set_title("Phase breakdown per configuration (label: data-wait share)")
    ax.legend(fontsize=8, ncol=3)
    return _save(fig, path)


def plot_speedups(speedups: Sequence[dict], path: Path) -> Path:
    """Measured speedup (mean, 95% interval) against its ideal 1/(1 - data stall of the baseline) (its
    step over the floor's; 1/(1 - wait stall) where no floor ran), one point per
    pair; the y = x line and the flags' band [1/KEEPS_UP_STEP, KEEPS_UP_STEP] x ideal
    (:data:`dali_nerf.train.emulation.KEEPS_UP_STEP`) inside which the stall explains the speedup."""
    fig = Figure(figsize=(6.4, 5.2))
    ax = fig.subplots()
    colors = SAMPLER_COLORS
    markers = {"cpu": "s", "emulated": "o", "cuda": "^"}
    seen = set()
    for x in speedups:
        lo, hi = x.get("speedup_ci") or (x["speedup"], x["speedup"])
        lab = f"{x['device']} vs {x['baseline']}"
        ax.errorbar([x["ideal_speedup"]], [x["speedup"]], yerr=[[x["speedup"] - lo], [hi - x["speedup"]]],
                    fmt=markers.get(x["device"], "x"), color=colors.get(x["baseline"], "gray"), ms=4, lw=0.8,
                    label=None if lab in seen else lab)
        seen.add(lab)
    vals = [x["ideal_speedup"] for x in speedups] + [x["speedup"] for x in speedups] + [1.0]
    top = max(v for v in vals if v == v and v != float("inf")) * 1.15
    ax.plot([0.9, top], [0.9, top], color="black", lw=0.8, label="speedup = ideal")
    lo, hi = 1.0 / KEEPS_UP_STEP, KEEPS_UP_STEP
    ax.fill_between([0.9, top], [lo * 0.9, lo * top], [hi * 0.9, hi * top], color="gray", alpha=0.15,
                    label=f"[1/{hi:g}, {hi:g}] x ideal")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ideal speedup 1 / (1 - data stall of the baseline) = baseline step / floor step")
    ax.set_ylabel("measured speedup of pipelined sampling (95% CI)")
    ax.set_title("Speedup explained by the stall? (outside the band: flagged)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def scaling_rows(configs: Sequence[dict]) -> Tuple[int, List[dict], List[dict]]:
    """(rays per rank, rows, left out) of :func:`plot_scaling`: the emulated rows at the study's
    batch size (the most common), floors aside; those that recorded no core count are left out
    (their cores per GPU is unknown, so no regime: not plotted per rank, which would put them in
    the starved region)."""
    rays = max({c["rays_per_rank"] for c in configs}, key=lambda b: sum(c["rays_per_rank"] == b for c in configs))
    rows = [c for c in configs if c["rays_per_rank"] == rays and c["sampler"] != "ready"]
    return rays, [c for c in rows if c.get("cores_per_gpu")], [c for c in rows if not c.get("cores_per_gpu")]


def plot_scaling(configs: Sequence[dict], path: Path) -> Path:
    """Emulated rows: stall (left) and step / floor (right) against cores per GPU (the cores a
    launch ran on over its ranks; below 1, shaded: the starved host), one row of panels per method,
    one colour per sampler, one line style per device step time (the study's batch size only); the
    keeps-up thresholds (:func:`dali_nerf.train.emulation.keeps_up`) dashed. Rows without a recorded core
    count are left out, and the title says how many (:func:`scaling_rows`)."""
    rays, rows, left_out = scaling_rows(configs)
    methods = sorted({c["method"] for c in rows}) or ["(none)"]
    fig = Figure(figsize=(11, 3.8 * len(methods)))
    axes = fig.subplots(len(methods), 2, squeeze=False)
    steps = sorted({c["emulated_step_ms"] for c in rows})
    styles = ["-", "--", ":", "-."]
    for mi, m in enumerate(methods):
        a1, a2 = axes[mi]
        for s, col in SAMPLER_COLORS.items():
            for si, ms in enumerate(steps):
                pts = sorted(((c["cores_per_gpu"], c) for c in rows
                              if c["method"] == m and c["sampler"] == s and c["emulated_step_ms"] == ms),
                             key=lambda p: (p[0], p[1]["ranks"]))
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                a1.plot(xs, [100 * p[1]["stall"] for p in pts], color=col, ls=styles[si % 4], marker=".",
                        label=f"{s} {ms:g} ms")
                a2.plot(xs, [p[1].get("step_over_floor") or float("nan") for p in pts], color=col, ls=styles[si % 4],
                        marker=".", label=f"{s} {ms:g} ms")
        a1.axhline(100 * KEEPS_UP_STALL, color="gray", lw=0.6, ls="--")
        a2.axhline(KEEPS_UP_STEP, color="gray", lw=0.6, ls="--")
        lo = min([c["cores_per_gpu"] for c in rows] + [1.0])
        for a in (a1, a2):
            a.set_xscale("log", base=2)
            a.set_xlabel("cores per GPU (shaded: < 1, the starved host)")
            if lo < 1:
                a.axvspan(lo / 1.2, 1.0, color="gray", alpha=0.12)
            a.grid(alpha=0.3)
        a1.set_ylabel(f"{m.upper()}: stall (% of step)")
        a2.set_ylabel(f"{m.upper()}: step / emulation floor")
        a2.set_yscale("log")
        if rows:
            a1.legend(fontsize=5, ncol=2)
    note = (f"; {len(left_out)} row(s) without a recorded core count left out" if left_out else "")
    fig.suptitle(f"Emulated GPUs, {rays} rays per rank: device compute emulated by a timed wait; host work real{note}",
                 fontsize=9)
    return _save(fig, path)


def plot_model_check(rows: Sequence[dict], path: Path) -> Path:
    """Measured vs predicted step time (ms), one point per configuration, y = x line."""
    fig = Figure(figsize=(4.8, 4.5))
    ax = fig.subplots()
    meas = [r["step_measured_s"] * 1e3 for r in rows]
    pred = [r["step_predicted_s"] * 1e3 for r in rows]
    markers = {"sync_global": "o", "sync_local": "s", "rays": "^"}
    for r, m, p in zip(rows, meas, pred):
        ax.scatter([m], [p], marker=markers.get(r["sampler"], "x"), color="#d62728" if r.get("set") == "check" else "#1f77b4")
    hi = max(meas + pred + [1e-3]) * 1.3
    lo = max(1e-3, min([v for v in meas + pred if v > 0] + [1.0]) / 1.3)
    ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
    ax.plot([lo, hi], [1.15 * lo, 1.15 * hi], color="gray", lw=0.5, ls="--")
    ax.plot([lo, hi], [lo / 1.15, hi / 1.15], color="gray", lw=0.5, ls="--")
    ax.set_xlabel("measured ms per step")
    ax.set_ylabel("cost model ms per step")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_title("Cost model check (o global, s local, ^ pipelined;\nblue: fit set, red: runs it did not see; dashed +-15%)", fontsize=9)
    return _save(fig, path)


def plot_overlap(regimes: Sequence[dict], path: Path) -> Path:
    """The study's central result: each regime's overlap gain (95% interval) against the rays per GPU
    (left, log2; one line per device step and regime) and against the device step's ms (right; one
    colour per rays per GPU), one row of panels per method; a flagged pair (its host does not keep
    up) drawn as a cross; hollow markers, slightly to the right: the overlap beyond the control's
    own cost (where measured); the dashed line at 1.0."""
    methods = sorted({r["method"] for r in regimes}) or ["(none)"]
    fig = Figure(figsize=(11, 3.9 * len(methods)))
    axes = fig.subplots(len(methods), 2, squeeze=False)
    rays_all = sorted({r["rays_per_rank"] for r in regimes})
    cmap = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    ray_col = {b: cmap[i % len(cmap)] for i, b in enumerate(rays_all)}
    styles = ["-", "--", ":", "-."]

    def bar(ax, x, r, key, color, hollow=False):
        v = r.get(key)
        if v is None:
            return
        lo, hi = r[f"{key}_ci"]
        ax.errorbar([x], [v], yerr=[[v - lo], [hi - v]], fmt="x" if r.get("flags") else "o", ms=4, lw=0.8,
                    color=color, mfc="none" if hollow else color)

    for mi, m in enumerate(methods):
        a1, a2 = axes[mi]
        rows = [r for r in regimes if r["method"] == m]
        lines = sorted({(r.get("step_name") or "", r["ranks"], r["cores"]) for r in rows})
        for li, (name, ranks, cores) in enumerate(lines):
            pts = sorted((r for r in rows if ((r.get("step_name") or ""), r["ranks"], r["cores"]) == (name, ranks, cores)),
                         key=lambda r: r["rays_per_rank"])
            col = cmap[li % len(cmap)]
            a1.plot([r["rays_per_rank"] for r in pts], [r["overlap_gain"] for r in pts], color=col,
                    ls=styles[li % len(styles)], lw=0.8, label=f"{name}, {ranks} GPU(s) on {cores} core(s)")
            for r in pts:
                bar(a1, r["rays_per_rank"], r, "overlap_gain", col)
                bar(a1, r["rays_per_rank"] * 1.06, r, "overlap_beyond", col, hollow=True)
        for r in rows:
            bar(a2, r["emulated_step_ms"], r, "overlap_gain", ray_col[r["rays_per_rank"]])
            bar(a2, r["emulated_step_ms"] * 1.02, r, "overlap_beyond", ray_col[r["rays_per_rank"]], hollow=True)
        for b, c in ray_col.items():
            a2.plot([], [], "o", color=c, label=f"{b} rays per GPU")
        a1.set_xscale("log", base=2)
        if rays_all:
            a1.set_xticks(rays_all, [str(b) for b in rays_all])
        a1.set_xlabel("rays per GPU and step")
        a2.set_xlabel("device step (ms)")
        for a in (a1, a2):
            a.axhline(1.0, color="gray", lw=0.8, ls="--")
            a.set_ylabel(f"{m.upper()}: overlap gain (95% CI)")
            a.grid(alpha=0.3)
            if rows:
                a.legend(fontsize=6)
    fig.suptitle("Overlap gain = rays_sync step / rays step against sync_global's pairs, >= 1 core per GPU (x: flagged; "
                 "hollow: beyond the control's own cost); device compute emulated by a timed wait; host work real",
                 fontsize=9)
    return _save(fig, path)
