"""The study like for like with the ISPASS study, from hand-written emulated runs (known answers):
the speedup split through the same-sampler control rays_sync (sampler gain x overlap gain), regimes
by cores per GPU (the starved host below 1), the hidden stall (inferred, and measured: run-queue
wait and device-wait overshoot), one threshold for "keeps up" and for the flags, and a Result
section that quotes no flagged or starved pair."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from dali_nerf.bench import emulated as em
from dali_nerf.bench import study
from dali_nerf.bench.study import sections

MS = 1e-3


def _seg(root: Path, name, sampler, ranks, trial, wait, rest, *, pair=None, ems=1.0, cores=2, runq=None, over=None,
         steps=4, rays=4096) -> Path:
    """An emulated segment as a launch writes it (config.yaml, study.json with the cores its ranks ran
    on, metrics per rank); step 1 is a warm-up of 1 s phases that must be ignored."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({
        "name": name, "method": "ddp", "pipeline": {"name": sampler, "rays_per_batch": rays, "num_threads": 1},
        "train": {"device": "emulated", "emulated_step_ms": ems}, "bench": {"warmup": 1}}))
    (d / "study.json").write_text(json.dumps({"trial": trial, "pair": pair, "device": "emulated",
                                              "emulated_step_ms": ems, "cores": cores, "budget": {"cores": cores}}))
    for r in range(ranks):
        recs = []
        for s in range(1, steps + 1):
            ph = {"wait": wait, "h2d": 0.0, "forward": rest, "backward": 0.0, "sync": 0.0, "optimizer": 0.0}
            extra = {"runq_s": runq} if runq is not None else {}
            extra |= {"overshoot_s": over} if over is not None else {}
            if s == 1:
                ph, extra = {k: 1.0 for k in ph}, {k: 1.0 for k in extra}
            recs.append(json.dumps({"step": s, "rays": rays, **{f"{k}_s": v for k, v in ph.items()},
                                    "step_s": sum(ph.values()), **extra}))
        (d / ("metrics.jsonl" if r == 0 else f"metrics.rank{r}.jsonl")).write_text("\n".join(recs) + "\n")
    return d


def _regime(root: Path, tag, ranks, cores, ems, base, ctl, pipe, floor, *, ctl_pipe=None, wait_p=0.01 * MS,
            runq=(None, None), over=(None, None), rays=4096) -> list:
    """One configuration's trials: sync_global (its step ``base[t]``: half of it waiting), rays_sync
    (``ctl[t]``), the rays run paired with each of them (``pipe[t]``, ``ctl_pipe[t]``) and the floor.
    ``runq`` / ``over``: (pipelined, floor) per-step seconds measured; ``rays``: per GPU and step."""
    dirs = []
    for t in range(len(base)):
        p = f"{tag}_p{t}"
        q = f"{tag}_q{t}"
        dirs.append(_seg(root, f"{tag}_g{t}", "sync_global", ranks, t, base[t] / 2, base[t] / 2, pair=p, ems=ems,
                         cores=cores, rays=rays))
        dirs.append(_seg(root, p, "rays", ranks, t, wait_p, pipe[t] - wait_p, ems=ems, cores=cores, rays=rays, runq=runq[0],
                         over=over[0]))
        dirs.append(_seg(root, f"{tag}_s{t}", "rays_sync", ranks, t, 0.3 * ctl[t], 0.7 * ctl[t], pair=q, ems=ems,
                         cores=cores, rays=rays))
        cp = (ctl_pipe or pipe)[t]
        dirs.append(_seg(root, q, "rays", ranks, t, wait_p, cp - wait_p, ems=ems, cores=cores, rays=rays, runq=runq[0],
                         over=over[0]))
        dirs.append(_seg(root, f"{tag}_f{t}", em.FLOOR, ranks, t, 0.0, floor, ems=ems, cores=cores, rays=rays, runq=runq[1],
                         over=over[1]))
    return dirs


def _by(d, baseline, ranks=1, cores=2, ems=1.0):
    (x,) = [s for s in d["speedups"] if (s["baseline"], s["ranks"], s["cores"], s["emulated_step_ms"])
            == (baseline, ranks, cores, ems)]
    return x


def test_the_control_splits_each_speedup_into_sampler_and_overlap_gains(tmp_path):
    base, ctl = [7.0 * MS, 7.2 * MS, 6.8 * MS], [2.0 * MS, 2.1 * MS, 1.9 * MS]
    pipe, ctl_pipe = [1.25 * MS, 1.30 * MS, 1.20 * MS], [1.26 * MS, 1.28 * MS, 1.22 * MS]
    dirs = _regime(tmp_path, "a", 1, 2, 1.0, base, ctl, pipe, 1.15 * MS, ctl_pipe=ctl_pipe,
                   runq=(0.10 * MS, 0.02 * MS), over=(0.05 * MS, 0.01 * MS))
    d = study.derive(dirs)
    g = _by(d, "sync_global")
    assert g["cores"] == 2 and g["cores_per_gpu"] == 2.0 and not study.starved(g)
    assert g["speedup_trials"] == pytest.approx([b / p for b, p in zip(base, pipe)])
    assert g["sampler_gain_trials"] == pytest.approx([b / s for b, s in zip(base, ctl)])
    assert g["overlap_gain_trials"] == pytest.approx([s / p for s, p in zip(ctl, pipe)])
    for sp, sg, og in zip(g["speedup_trials"], g["sampler_gain_trials"], g["overlap_gain_trials"]):
        assert sg * og == pytest.approx(sp, rel=1e-12)  # per trial, exactly
    # geometric means and intervals over trials (on the logs), so the gains' product is the speedup
    m, ci = study.mean_ci([np.log(b / s) for b, s in zip(base, ctl)])
    assert g["sampler_gain"] == pytest.approx(np.exp(m)) and g["sampler_gain_ci"] == pytest.approx(np.exp(ci))
    assert g["speedup"] == pytest.approx(np.prod([b / p for b, p in zip(base, pipe)]) ** (1 / 3))
    assert g["sampler_gain"] * g["overlap_gain"] == pytest.approx(g["speedup"], rel=1e-12)
    assert "gains_vs_speedup" not in g
    assert g["stall_rays_sync"] == pytest.approx(0.3) and g["stall_baseline"] == pytest.approx(0.5)
    # the control's own pair: the same sampler, overlapped: sampler gain 1, overlap gain its speedup
    c = _by(d, "rays_sync")
    assert c["speedup_trials"] == pytest.approx([s / p for s, p in zip(ctl, ctl_pipe)])
    assert c["sampler_gain"] == 1.0 and c["overlap_gain"] == pytest.approx(c["speedup"])
    # the pipelined row: its step (both pairs' runs) against the floor, and what the wait does not show
    rays = [r for r in d["runs"] if r["sampler"] == "rays"][0]
    p_mean = np.mean([(a + b) / 2 for a, b in zip(pipe, ctl_pipe)])
    assert rays["step_s"] == pytest.approx(p_mean)
    assert g["pipelined_over_floor"] == pytest.approx(p_mean / (1.15 * MS))
    assert g["hidden_stall"] == pytest.approx(1 - 1.15 * MS / p_mean - 0.01 * MS / p_mean)
    assert g["hidden_runq"] == pytest.approx(0.08 * MS / p_mean)
    assert g["hidden_overshoot"] == pytest.approx(0.04 * MS / p_mean)
    assert rays["runq_share"] == pytest.approx(0.10 * MS / p_mean)
    assert not g["flags"] and not c["flags"]
    # a baseline with no control in its trials has no gains (and no flag for it)
    bare = study.derive([x for x in dirs if "_s" not in x.name])
    assert _by(bare, "sync_global")["sampler_gain"] is None and not _by(bare, "sync_global")["flags"]


def test_a_control_that_varies_across_trials_still_splits_the_speedup_exactly(tmp_path):
    """Baseline 2 ms, pipelined 1 ms, the control 1.2, 1.5, 1.8 ms over three trials: per trial the
    gains multiply to the speedup 2, and over trials too (geometric means; the arithmetic means'
    product was 2.8% off, which flagged the pair and left it out of the comparison). The control's
    swing shows in the gains' intervals, not in a flag."""
    dirs = _regime(tmp_path, "x", 1, 2, 1.0, [2 * MS] * 3, [1.2 * MS, 1.5 * MS, 1.8 * MS], [1 * MS] * 3, 1 * MS)
    d = study.derive(dirs)
    g = _by(d, "sync_global")
    assert g["speedup"] == pytest.approx(2.0) and g["speedup_ci"] == pytest.approx([2.0, 2.0])
    assert g["sampler_gain"] * g["overlap_gain"] == pytest.approx(2.0, rel=1e-12)
    assert g["overlap_gain"] == pytest.approx((1.2 * 1.5 * 1.8) ** (1 / 3))
    assert g["overlap_gain_ci"][1] - g["overlap_gain_ci"][0] > 0.5  # the swing, in the interval
    assert not g["flags"], g["flags"]
    assert study.comparable(g) and [r["overlap_gain"] for r in d["summary"]["like_for_like"]["regimes"]] == \
        pytest.approx([g["overlap_gain"]])


@pytest.mark.parametrize("over,keeps", [(1.14, True), (1.16, False)])
def test_keeps_up_and_the_flags_share_one_threshold(tmp_path, over, keeps):
    """A pipelined step 1.14x its floor keeps up and flags no pair; 1.16x does not keep up, and
    every pair against it is flagged with the same threshold: no row reads "keeps up" beside a
    pair flagged for the host."""
    f = 1.0 * MS
    dirs = _regime(tmp_path, "k", 1, 2, 1.0, [4 * MS] * 2, [2 * MS] * 2, [over * f] * 2, f)
    d = study.derive(dirs)
    rays = [r for r in d["runs"] if r["sampler"] == "rays"][0]
    assert rays["step_over_floor"] == pytest.approx(over)
    assert study.keeps_up(rays) is keeps
    for x in d["speedups"]:
        host = [fl for fl in x["flags"] if "the host does not keep up" in fl]
        assert bool(host) is (not keeps), x["flags"]
        assert not host or f"pipelined step {over:.2f}x the floor > 1.15x" in host[0]
    assert study.BAND == (pytest.approx(1 / study.KEEPS_UP_STEP), study.KEEPS_UP_STEP)


def test_a_row_that_waits_does_not_keep_up_and_flags_its_pairs(tmp_path):
    """Stall 3% at a step 1.05x the floor's: within the step band but over the stall limit, so the
    row reads "no" and every pair against it is flagged for that cause (none counts as comparable)."""
    f = 1.0 * MS
    p = 1.05 * f
    dirs = _regime(tmp_path, "w", 1, 2, 1.0, [4 * MS] * 2, [2 * MS] * 2, [p] * 2, f, wait_p=0.03 * p)
    d = study.derive(dirs)
    rays = [r for r in d["runs"] if r["sampler"] == "rays"][0]
    assert rays["stall"] == pytest.approx(0.03) and rays["step_over_floor"] == pytest.approx(1.05)
    assert study.keeps_up(rays) is False and study.keeps_up_reason(rays) == "stall 3.0% > 2%"
    table = "\n".join(sections.emulated_rows([r for r in d["runs"]], None, {"machine": "m"}, None, 2))
    assert "| rays | " in table and "**no**: stall 3.0% > 2%" in table
    assert len(d["speedups"]) == 2  # sync_global and the control rays_sync
    for x in d["speedups"]:
        assert "pipelined stall 3.0% > 2%: the host does not keep up" in x["flags"], x["flags"]
        assert not any("the floor >" in fl for fl in x["flags"]) and "waits for batches" in x["cause"]
        assert not study.comparable(x)
    assert d["summary"]["comparable"] is None and d["summary"]["like_for_like"] is None


def _grid(tmp_path):
    """Regimes: 2 cores per GPU (1 rank on 2 cores) at 1 and 2 ms, 1 core per GPU twice (2 ranks
    on 2 cores; 1 rank pinned to 1 core), a starved host (4 ranks on 2 cores), a flagged pair
    (1 rank on 2 cores at 5 ms: pipelined 1.5x its floor) and a configuration run once as the cost
    model's check segments are (3 ms), with distinct speedups to look for."""
    dirs = []
    dirs += _regime(tmp_path, "a", 1, 2, 1.0, [4.0 * MS] * 2, [1.6 * MS] * 2, [1.25 * MS] * 2, 1.2 * MS)  # 3.20x
    dirs += _regime(tmp_path, "b", 1, 2, 2.0, [4.6 * MS] * 2, [2.5 * MS] * 2, [2.3 * MS] * 2, 2.2 * MS)  # 2.00x
    dirs += _regime(tmp_path, "c", 2, 2, 1.0, [5.0 * MS] * 2, [1.9 * MS] * 2, [1.6 * MS] * 2, 1.5 * MS)  # 3.125x
    dirs += _regime(tmp_path, "d", 1, 1, 1.0, [3.3 * MS] * 2, [1.7 * MS] * 2, [1.5 * MS] * 2, 1.4 * MS)  # 2.20x
    dirs += _regime(tmp_path, "e", 4, 2, 1.0, [9.99 * MS] * 2, [3.0 * MS] * 2, [1.0 * MS] * 2, 0.95 * MS)  # starved
    dirs += _regime(tmp_path, "f", 1, 2, 5.0, [7.77 * 1.5 * MS] * 2, [6 * MS] * 2, [1.5 * MS] * 2, 1.0 * MS)  # flagged
    dirs += _regime(tmp_path, "g", 1, 2, 3.0, [6.3 * MS], [3.1 * MS], [3.0 * MS], 2.9 * MS)  # 2.10x, 1 trial
    return study.derive(dirs)


def test_like_for_like_compares_only_unflagged_regimes_of_at_least_one_core_per_gpu(tmp_path):
    d = _grid(tmp_path)
    s = d["summary"]
    starved = _by(d, "sync_global", ranks=4)
    flagged = _by(d, "sync_global", ems=5.0)
    assert study.starved(starved) and starved["cores_per_gpu"] == 0.5 and not starved["flags"]
    assert flagged["flags"] and not study.starved(flagged)
    once = _by(d, "sync_global", ems=3.0)
    assert once["trials"] == 1 and not once["flags"] and not study.starved(once) and study.main_grid(d["speedups"]) == (2, 4096)
    lf = s["like_for_like"]
    got = {(r["ranks"], r["cores"], r["emulated_step_ms"]) for r in lf["regimes"]}
    assert got == {(1, 2, 1.0), (1, 2, 2.0), (2, 2, 1.0), (1, 1, 1.0)}  # no starved, flagged or single-trial pair
    h = lf["headline"]  # the most cores per GPU, then the most ranks, then the shortest device step
    assert (h["cores_per_gpu"], h["ranks"], h["emulated_step_ms"]) == (2.0, 1, 1.0)
    assert h["speedup"] == pytest.approx(3.2) and h["sampler_gain"] == pytest.approx(2.5)
    assert h["overlap_gain"] == pytest.approx(1.28)
    og = [r["overlap_gain"] for r in lf["regimes"]]
    assert lf["overlap_gain_mean"] == pytest.approx(np.mean(og)) and lf["overlap_gain_max"] == pytest.approx(max(og))
    # the one mean: over the comparable pairs (sync_global here; the control is no baseline)
    c = s["comparable"]
    assert c["pairs"] == 4 and c["mean_speedup"] == pytest.approx(np.mean([3.2, 2.0, 3.125, 2.2]))
    assert s["starved"]["rows"] == 1 and s["starved"]["max_step_over_floor"] == pytest.approx(1 / 0.95)


def test_the_result_section_quotes_no_flagged_or_starved_pair(tmp_path):
    d = _grid(tmp_path)
    emu = [c for c in d["runs"] if c["device"] == "emulated"]
    meta = {"machine": "cpu-2core-x86_64", "rays": 4096}
    text = "\n".join(sections.result(d["summary"], emu, d["speedups"], meta))
    assert "**headline** DDP, 2 cores per GPU (1 emulated GPU on 2 cores), 1 ms device step" in text
    assert "speedup 3.20x" in text and "sampler gain 2.50x" in text and "overlap gain 1.28x" in text
    # every like-for-like regime in the table: (method, cores per GPU, GPUs on cores, device step)
    for row in ("| ddp | 2 | 1 on 2 | 1 |", "| ddp | 2 | 1 on 2 | 2 |", "| ddp | 1 | 2 on 2 | 1 |", "| ddp | 1 | 1 on 1 | 1 |"):
        assert text.count(row) == 1, row
    assert "| ddp | 0.5 |" not in text and "| 5 | 4096 |" not in text  # neither the starved host nor the flagged pair
    assert "| 3 | 4096 |" not in text  # nor the configuration run once
    assert "Starved host (< 1 core per GPU" in text and "the ISPASS study" in text
    assert "43.3%" in text and "1.95x on average" in text
    for x in (_by(d, "sync_global", ranks=4), _by(d, "sync_global", ems=5.0), _by(d, "sync_global", ems=3.0)):
        assert f"{x['speedup']:.2f}x" not in text, x["speedup"]
    assert "the study:" not in text  # "the ISPASS study", named as such
    sentence = sections.headline_sentence(d["summary"], meta)
    assert sentence in text and "3.20x faster" in sentence and "2.50x is a faster sampler" in sentence
    assert "1.28x is overlap" in sentence and "at 2 cores per GPU" in sentence


def test_a_single_trial_study_leaves_the_check_segments_out_of_the_comparison(tmp_path):
    """With 1 trial (a reduced run) the cost model's check segments (other batch sizes, run once as
    well) are told apart by their batch: the main grid is the batch of the most pairs."""
    dirs = _regime(tmp_path, "a", 1, 2, 1.0, [4.0 * MS], [1.6 * MS], [1.25 * MS], 1.2 * MS)  # 3.20x
    dirs += _regime(tmp_path, "b", 2, 2, 1.0, [5.0 * MS], [1.9 * MS], [1.6 * MS], 1.5 * MS)  # 3.125x
    dirs += _regime(tmp_path, "c", 2, 2, 2.0, [9.0 * MS], [3.1 * MS], [3.0 * MS], 2.9 * MS, rays=16384)  # check: 3.00x
    d = study.derive(dirs)
    assert study.main_grid(d["speedups"]) == (1, 4096)
    check = _by(d, "sync_global", ranks=2, ems=2.0)
    assert check["rays_per_rank"] == 16384 and not check["flags"] and not study.starved(check)
    lf = d["summary"]["like_for_like"]
    assert {(r["ranks"], r["rays_per_rank"]) for r in lf["regimes"]} == {(1, 4096), (2, 4096)}
    assert d["summary"]["comparable"]["pairs"] == 2


def _captured(monkeypatch):
    """The figures the plot functions would save (nothing written)."""
    from dali_nerf.bench import plots

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, tight=True: figs.append(fig) or Path(path))
    return plots, figs


def test_the_plots_draw_the_one_threshold(tmp_path, monkeypatch):
    """speedup.png's band is the flags' [1/1.15, 1.15] x ideal; scaling.png's dashed lines are the
    keeps-up stall and step limits."""
    plots, figs = _captured(monkeypatch)
    d = _grid(tmp_path)
    plots.plot_speedups(d["speedups"], tmp_path / "s.png")
    (band,) = figs[0].axes[0].collections[-1:]  # fill_between, drawn after the error bars
    v = band.get_paths()[0].vertices
    ratios = {round(float(y / x), 9) for x, y in v if x > 0}
    assert ratios == {round(1 / study.KEEPS_UP_STEP, 9), round(study.KEEPS_UP_STEP, 9)}, ratios
    plots.plot_scaling([c for c in d["runs"] if c["device"] == "emulated"], tmp_path / "c.png")
    a1, a2 = figs[1].axes[:2]
    hlines = lambda a: {round(float(ln.get_ydata()[0]), 9) for ln in a.lines  # noqa: E731 (axhline: no label)
                        if ln.get_label().startswith("_") and ln.get_linestyle() == "--"}
    assert round(100 * study.KEEPS_UP_STALL, 9) in hlines(a1) and round(study.KEEPS_UP_STEP, 9) in hlines(a2)


def test_scaling_leaves_out_rows_without_a_core_count(tmp_path, monkeypatch):
    """A row that recorded no cores has no regime: left out of scaling.png (not plotted at 1/ranks,
    inside the starved region), and the title says so."""
    plots, figs = _captured(monkeypatch)
    emu = [c for c in _grid(tmp_path)["runs"] if c["device"] == "emulated"]
    bare = [dict(c, cores=None, cores_per_gpu=None) for c in emu if c["ranks"] == 2]
    rows = [c for c in emu if c["ranks"] != 2] + bare
    rays, kept, out = plots.scaling_rows(rows)
    assert rays == 4096 and out and all(c["ranks"] == 2 for c in out) and all(c["cores_per_gpu"] for c in kept)
    assert len(out) == sum(1 for c in bare if c["rays_per_rank"] == 4096 and c["sampler"] != em.FLOOR)
    plots.plot_scaling(rows, tmp_path / "c.png")
    fig = figs[0]
    xs = {float(x) for a in fig.axes for ln in a.lines if not ln.get_label().startswith("_") for x in ln.get_xdata()}
    assert xs == {c["cores_per_gpu"] for c in kept}, xs  # 2 ranks on 2 cores would be 1.0; at 1/ranks 0.5
    assert f"{len(out)} row(s) without a recorded core count left out" in fig._suptitle.get_text()
