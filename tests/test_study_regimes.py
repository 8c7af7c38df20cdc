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
from dali_nerf.bench.study import result_section as sections_result
from dali_nerf.bench.study import sections

MS = 1e-3


def _seg(root: Path, name, sampler, ranks, trial, wait, rest, *, pair=None, ems=1.0, cores=2, runq=None, over=None,
         steps=4, rays=4096, grid="main", step_name=None) -> Path:
    """An emulated segment as a launch writes it (config.yaml, study.json with the cores its ranks ran
    on, metrics per rank); step 1 is a warm-up of 1 s phases that must be ignored."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({
        "name": name, "method": "ddp", "pipeline": {"name": sampler, "rays_per_batch": rays, "num_threads": 1},
        "train": {"device": "emulated", "emulated_step_ms": ems}, "bench": {"warmup": 1}}))
    (d / "study.json").write_text(json.dumps({"trial": trial, "pair": pair, "device": "emulated", "grid": grid,
                                              "step_name": step_name, "emulated_step_ms": ems, "cores": cores,
                                              "budget": {"cores": cores}}))
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
            runq=(None, None), over=(None, None), rays=4096, grid="main", step_name=None) -> list:
    """One configuration's trials: sync_global (its step ``base[t]``: half of it waiting), rays_sync
    (``ctl[t]``), the rays run paired with each of them (``pipe[t]``, ``ctl_pipe[t]``) and the floor.
    ``runq`` / ``over``: (pipelined, floor) per-step seconds measured; ``rays``: per GPU and step;
    ``grid``: main | check | cache; ``step_name``: what the device step stands for."""
    dirs = []
    kw = dict(ems=ems, cores=cores, rays=rays, grid=grid, step_name=step_name)
    for t in range(len(base)):
        p = f"{tag}_p{t}"
        q = f"{tag}_q{t}"
        dirs.append(_seg(root, f"{tag}_g{t}", "sync_global", ranks, t, base[t] / 2, base[t] / 2, pair=p, **kw))
        dirs.append(_seg(root, p, "rays", ranks, t, wait_p, pipe[t] - wait_p, runq=runq[0], over=over[0], **kw))
        dirs.append(_seg(root, f"{tag}_s{t}", "rays_sync", ranks, t, 0.3 * ctl[t], 0.7 * ctl[t], pair=q, **kw))
        cp = (ctl_pipe or pipe)[t]
        dirs.append(_seg(root, q, "rays", ranks, t, wait_p, cp - wait_p, runq=runq[0], over=over[0], **kw))
        dirs.append(_seg(root, f"{tag}_f{t}", em.FLOOR, ranks, t, 0.0, floor, runq=runq[1], over=over[1], **kw))
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
    (1 rank on 2 cores at 5 ms: pipelined 1.5x its floor) and one of the cost model's check
    segments (3 ms, run once, labelled "check"), with distinct speedups to look for."""
    dirs = []
    dirs += _regime(tmp_path, "a", 1, 2, 1.0, [4.0 * MS] * 2, [1.6 * MS] * 2, [1.25 * MS] * 2, 1.2 * MS)  # 3.20x
    dirs += _regime(tmp_path, "b", 1, 2, 2.0, [4.6 * MS] * 2, [2.5 * MS] * 2, [2.3 * MS] * 2, 2.2 * MS)  # 2.00x
    dirs += _regime(tmp_path, "c", 2, 2, 1.0, [5.0 * MS] * 2, [1.9 * MS] * 2, [1.6 * MS] * 2, 1.5 * MS)  # 3.125x
    dirs += _regime(tmp_path, "d", 1, 1, 1.0, [3.3 * MS] * 2, [1.7 * MS] * 2, [1.5 * MS] * 2, 1.4 * MS)  # 2.20x
    dirs += _regime(tmp_path, "e", 4, 2, 1.0, [9.99 * MS] * 2, [3.0 * MS] * 2, [1.0 * MS] * 2, 0.95 * MS)  # starved
    dirs += _regime(tmp_path, "f", 1, 2, 5.0, [7.77 * 1.5 * MS] * 2, [6 * MS] * 2, [1.5 * MS] * 2, 1.0 * MS)  # flagged
    dirs += _regime(tmp_path, "g", 1, 2, 3.0, [6.3 * MS], [3.1 * MS], [3.0 * MS], 2.9 * MS, grid="check")  # 2.10x, once
    return study.derive(dirs)


def test_like_for_like_compares_only_unflagged_regimes_of_at_least_one_core_per_gpu(tmp_path):
    d = _grid(tmp_path)
    s = d["summary"]
    starved = _by(d, "sync_global", ranks=4)
    flagged = _by(d, "sync_global", ems=5.0)
    assert study.starved(starved) and starved["cores_per_gpu"] == 0.5 and not starved["flags"]
    assert flagged["flags"] and not study.starved(flagged)
    once = _by(d, "sync_global", ems=3.0)
    assert once["trials"] == 1 and once["grid"] == "check" and not once["flags"] and not study.starved(once)
    assert study.main_grid(d["speedups"]) == 2
    lf = s["like_for_like"]
    got = {(r["ranks"], r["cores"], r["emulated_step_ms"]) for r in lf["regimes"]}
    assert got == {(1, 2, 1.0), (1, 2, 2.0), (2, 2, 1.0), (1, 1, 1.0)}  # no starved, flagged or check pair
    og = [r["overlap_gain"] for r in lf["regimes"]]
    assert lf["overlap_gain_mean"] == pytest.approx(np.mean(og)) and lf["overlap_gain_max"] == pytest.approx(max(og))
    # the headline by its rule, not by the result: DDP, >= 2 GPUs at >= 1 core per GPU (2 ranks on 2 cores)
    (h,) = s["headline"]["rows"]
    assert (h["ranks"], h["cores"], h["emulated_step_ms"]) == (2, 2, 1.0)
    assert h["speedup"] == pytest.approx(5 / 1.6) and h["sampler_gain"] == pytest.approx(5 / 1.9)
    assert h["overlap_gain"] == pytest.approx(1.9 / 1.6) and "at least 2 emulated GPUs" in s["headline"]["rule"]
    # the one mean: over the comparable pairs (sync_global here; the control is no baseline)
    c = s["comparable"]
    assert c["pairs"] == 4 and c["mean_speedup"] == pytest.approx(np.mean([3.2, 2.0, 3.125, 2.2]))
    assert s["starved"]["rows"] == 1 and s["starved"]["max_step_over_floor"] == pytest.approx(1 / 0.95)


def test_the_headline_is_fixed_by_rule_flagged_or_not_and_says_where_its_interval_holds_one(tmp_path):
    """The rule picks DDP at >= 2 GPUs and >= 1 core per GPU on every usable core, at the named
    device step, at every rays per GPU: a row that does not keep up stays in the headline (flagged,
    said so), a pinned launch or another step does not enter it, and where the overlap gain's
    interval holds 1.0 the sentence says so."""
    dirs = _regime(tmp_path, "a", 2, 2, 9.3, [20 * MS, 20.4 * MS], [10 * MS, 10.6 * MS], [9.8 * MS, 10.5 * MS],
                   9.5 * MS, step_name="measured")  # overlap 1.02x / 1.01x: its interval holds 1.0
    dirs += _regime(tmp_path, "b", 2, 2, 13.8, [40 * MS] * 2, [20 * MS] * 2, [17 * MS] * 2, 14 * MS, rays=65536,
                    step_name="measured")  # pipelined 1.21x its floor: flagged
    dirs += _regime(tmp_path, "c", 2, 2, 13.2, [30 * MS] * 2, [18 * MS] * 2, [14 * MS] * 2, 13.5 * MS,
                    step_name="stated")  # another step: not the headline's
    dirs += _regime(tmp_path, "d", 1, 1, 9.3, [20 * MS] * 2, [10 * MS] * 2, [9.6 * MS] * 2, 9.5 * MS,
                    step_name="measured")  # 1 GPU: not distributed
    d = study.derive(dirs)
    s = study.derive_summary(d, rule={"host_cores": 2, "step": "measured"})
    rows = s["headline"]["rows"]
    assert [(r["ranks"], r["rays_per_rank"], r["step_name"]) for r in rows] == [(2, 4096, "measured"),
                                                                                 (2, 65536, "measured")]
    assert not rows[0]["flags"] and rows[1]["flags"]
    meta = {"machine": "cpu-2core-x86_64", "cpu": "Test CPU"}
    sentence = sections_result.headline_sentence(s, meta)
    assert sentence.startswith("On cpu-2core-x86_64 (Test CPU), 2 emulated GPUs at 1 core per GPU (DDP, device step "
                               "measured: 9.3-13.8 ms;")
    assert f"at 4096 rays per GPU, speedup {rows[0]['speedup']:.2f}x" in sentence
    assert "at 65536 rays per GPU" in sentence and "(flagged: pipelined step 1.21x the floor > 1.15x" in sentence
    assert "The overlap gain's 95% interval holds 1.0 at 4096 rays per GPU: there the study shows no overlap" in sentence
    assert rows[0]["overlap_gain_ci"][0] <= 1.0 <= rows[0]["overlap_gain_ci"][1]
    # on a host with more cores, the 2-core launch is a pinned one: not the rule's
    assert study.derive_summary(d, rule={"host_cores": 4, "step": "measured"})["headline"]["rows"] == []
    text = "\n".join(sections_result.result(s, [c for c in d["runs"]], d["speedups"], meta))
    assert "No regime of this study meets the rule" not in text and sentence in text


def test_the_control_factor_and_the_cache_row(tmp_path):
    """The control's own cost (measured apart) becomes a factor of the overlap gain; the small
    scene's row is set beside the same configuration of the main scene, outside the comparison."""
    dirs = _regime(tmp_path, "m", 2, 2, 13.8, [40 * MS] * 2, [20 * MS] * 2, [16 * MS] * 2, 15.5 * MS, rays=65536,
                   step_name="measured")
    dirs += _regime(tmp_path / "small", "m", 2, 2, 13.8, [30 * MS] * 2, [18 * MS] * 2, [15.8 * MS] * 2, 15.5 * MS,
                    rays=65536, step_name="measured", grid="cache")
    d = study.derive(dirs)
    control = {"rows": [{"rays": 65536, "threads": 1, "own_s": 2 * MS, "own_ci": [1.5 * MS, 2.5 * MS]}]}
    s = study.derive_summary(d, rule={"host_cores": 2, "step": "measured"}, control=control)
    (h,) = s["headline"]["rows"]
    assert h["overlap_gain"] == pytest.approx(20 / 16) and h["control_cost_s"] == pytest.approx(2 * MS)
    assert h["control_factor"] == pytest.approx(20 / 18) and h["overlap_beyond"] == pytest.approx(18 / 16)
    assert h["control_factor_ci"] == pytest.approx([20 / 18.5, 20 / 17.5])
    assert [r["grid"] for r in (d["speedups"])] .count("cache") == 2  # sync_global and the control, small scene
    assert [r["rays_per_rank"] for r in s["like_for_like"]["regimes"]] == [65536]  # the cache row is not compared
    (c,) = s["cache"]
    assert c["small"]["overlap_gain"] == pytest.approx(18 / 15.8) and c["main"]["overlap_gain"] == pytest.approx(20 / 16)
    # no control measured at that batch: no factor (not a guess)
    none = study.derive_summary(d, rule={"host_cores": 2, "step": "measured"}, control={"rows": []})
    assert none["headline"]["rows"][0]["control_factor"] is None


def test_the_result_section_quotes_no_flagged_or_starved_pair(tmp_path):
    d = _grid(tmp_path)
    emu = [c for c in d["runs"] if c["device"] == "emulated"]
    meta = {"machine": "cpu-2core-x86_64", "rays": 4096}
    text = "\n".join(sections_result.result(d["summary"], emu, d["speedups"], meta))
    assert "**Headline**, by a rule fixed before the study ran" in text
    # every like-for-like regime in the table: (method, cores per GPU, GPUs on cores, device step)
    for row in ("| ddp | 2 | 1 on 2 | 1 ms |", "| ddp | 2 | 1 on 2 | 2 ms |", "| ddp | 1 | 1 on 1 | 1 ms |"):
        assert text.count(row) == 1, row
    assert text.count("| ddp | 1 | 2 on 2 | 1 ms |") == 2  # the headline's table and the like-for-like one
    assert "| ddp | 0.5 |" not in text and "| 5 ms | 4096 |" not in text  # neither the starved host nor the flagged pair
    assert "| 3 ms | 4096 |" not in text  # nor the check segment
    assert "Starved host (< 1 core per GPU" in text and "the ISPASS study" in text
    assert "43.3%" in text and "1.95x on average" in text
    for x in (_by(d, "sync_global", ranks=4), _by(d, "sync_global", ems=5.0), _by(d, "sync_global", ems=3.0)):
        assert f"{x['speedup']:.2f}x" not in text, x["speedup"]
    assert "the study:" not in text  # "the ISPASS study", named as such
    sentence = sections_result.headline_sentence(d["summary"], meta)
    assert sentence in text and "speedup 3.12x" in sentence and "sampler gain 2.63x" in sentence
    assert "overlap gain 1.19x" in sentence and "2 emulated GPUs at 1 core per GPU" in sentence
    lf = d["summary"]["like_for_like"]
    assert (f"Over these 4 regimes the overlap gain is {lf['overlap_gain_mean']:.2f}x on average, "
            f"{lf['overlap_gain_max']:.2f}x at most") in text


def test_a_single_trial_study_leaves_the_check_segments_out_of_the_comparison(tmp_path):
    """With 1 trial (a reduced run) the cost model's check segments (other batch sizes, run once as
    well) are told apart by their label, not by their trials."""
    dirs = _regime(tmp_path, "a", 1, 2, 1.0, [4.0 * MS], [1.6 * MS], [1.25 * MS], 1.2 * MS)  # 3.20x
    dirs += _regime(tmp_path, "b", 2, 2, 1.0, [5.0 * MS], [1.9 * MS], [1.6 * MS], 1.5 * MS)  # 3.125x
    dirs += _regime(tmp_path, "c", 2, 2, 2.0, [9.0 * MS], [3.1 * MS], [3.0 * MS], 2.9 * MS, rays=16384,
                    grid="check")  # check: 3.00x
    d = study.derive(dirs)
    assert study.main_grid(d["speedups"]) == 1
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


def _raw(tmp_path) -> dict:
    """A format-4 derived.json's parts as the quotes read them: a headline at 2 GPUs and the sampler table."""
    dirs = _regime(tmp_path, "a", 2, 2, 9.3, [20 * MS, 20.4 * MS], [10 * MS, 10.6 * MS], [9.8 * MS, 10.5 * MS],
                   9.5 * MS, step_name="measured")
    d = study.derive(dirs)
    d["summary"] = study.derive_summary(d, rule={"host_cores": 2, "step": "measured"})
    rates = [{"rays": 4096, "rates": {"rays": 40e6, "torch_gather": 4e6, "sync_local": 5e6, "sync_global": 2e6,
                                      "torch_workers": 1e6}},
             {"rays": 65536, "rates": {"rays": 50e6, "torch_gather": 5e6, "sync_local": 4e6, "sync_global": 2.5e6,
                                       "torch_workers": 4e6}}]
    meta = {"format": study.REPORT_FORMAT, "date": "2026-12-07 10:00:00", "commit": "abcdef0123456789",
            "machine": "cpu-2core-x86_64", "cpu": "Test CPU", "l3": "32 MiB L3", "wall_s": 1800.4,
            "load_avg_start": 0.2, "command": "dali-nerf bench study --config configs/study.yaml"}
    return {"meta": meta, "derived": d, "sampler": {"command": "c", "result": {
        "rows": rates, "cores": 2, "scene": {"images": 100, "pixels": 64_000_000}}}}


def test_the_quotes_are_the_reports_numbers_and_written_once(tmp_path, capsys):
    """README's blocks and BENCHMARKS' row come from derived.json alone: the headline sentence of the
    report, the sampler rates of its table; --write replaces README's blocks and inserts the row
    once (a second write changes nothing); an older format is refused in one line (exit 2)."""
    from dali_nerf.bench.study import quotes

    raw = _raw(tmp_path / "runs")
    blocks = quotes.readme_blocks(raw)
    sentence = sections_result.headline_sentence(raw["derived"]["summary"], raw["meta"])
    assert blocks["headline"] == f"In one sentence, from the report of 2026-12-07, abcdef0: {sentence}"
    assert blocks["sampler"].startswith("`RayLoader` delivers 40-50 Mrays/s at 4096-65536 rays per step on 2 cores "
                                        "(Test CPU; 100 images, 64 M pixels cached): 8.0-12.5x a vectorised torch "
                                        "gather and sampling in the training thread, 20.0x the ISPASS study's")
    row = quotes.benchmarks_row(raw)
    (h,) = raw["derived"]["summary"]["headline"]["rows"]
    assert row.startswith("| 2026-12-07 | abcdef0 | Test CPU, 32 MiB L3 | 1800 (0.2) | measured: 2 GPUs, 4096: "
                          f"{h['overlap_gain']:.2f}x [")
    readme, bench = tmp_path / "README.md", tmp_path / "BENCHMARKS.md"
    readme.write_text("a <!-- study:sampler -->OLD rates<!-- /study:sampler --> b\n\n<!-- study:headline -->OLD"
                      "<!-- /study:headline -->\n")
    bench.write_text(f"text <!-- study:current -->OLD<!-- /study:current -->\n\n{quotes.HISTORY_MARK}\n| date | commit |\n"
                     f"|---|---|\n| older | row |\n")
    dj = tmp_path / "derived.json"
    dj.write_text(json.dumps(raw, default=float))
    assert quotes.main([str(dj), "--write", "--readme", str(readme), "--benchmarks", str(bench)]) == 0
    text = readme.read_text()
    assert f"<!-- study:headline -->{blocks['headline']}<!-- /study:headline -->" in text and "OLD" not in text
    assert text.startswith(f"a <!-- study:sampler -->{blocks['sampler']}<!-- /study:sampler --> b")
    assert bench.read_text().splitlines()[5:7] == [row, "| older | row |"]
    assert bench.read_text().startswith(f"text <!-- study:current -->{quotes.benchmarks_current(raw)}<!-- /study")
    assert quotes.benchmarks_current(raw).startswith("The committed report: 2026-12-07, abcdef0, 1800 s on "
                                                     "cpu-2core-x86_64 (Test CPU; load average 0.2 at its start)")
    once = (readme.read_text(), bench.read_text())
    assert quotes.main([str(dj), "--write", "--readme", str(readme), "--benchmarks", str(bench)]) == 0
    assert (readme.read_text(), bench.read_text()) == once
    capsys.readouterr()
    dirty = dict(raw, meta=dict(raw["meta"], commit="abcdef0123456789-dirty"))  # a tree that differs: said so
    assert "from the report of 2026-12-07, abcdef0-dirty: On" in quotes.readme_blocks(dirty)["headline"]
    assert quotes.benchmarks_row(dirty).startswith("| 2026-12-07 | abcdef0-dirty |")
    raw["meta"]["format"] = 3
    dj.write_text(json.dumps(raw, default=float))
    assert quotes.main([str(dj)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a study report of format 3" in err[0] and "dali-nerf bench study --config" in err[0]
    raw["meta"]["format"] = study.REPORT_FORMAT
    dj.write_text(json.dumps(raw, default=float))
    readme.write_text("no markers\n")
    assert quotes.main([str(dj), "--write", "--readme", str(readme), "--benchmarks", str(bench)]) == 2
    assert "no <!-- study:headline -->" in capsys.readouterr().err


def test_the_overlap_plot_draws_every_regime_with_its_interval(tmp_path, monkeypatch):
    """overlap.png: one error bar per regime at >= 1 core per GPU of the main grid (the flagged one
    too, as a cross) against the rays per GPU and one against the device step, hollow ones for the
    overlap beyond the control where measured, the 1.0 line."""
    plots, figs = _captured(monkeypatch)
    d = _grid(tmp_path)
    regimes = d["summary"]["overlap"]
    assert len(regimes) == len(d["summary"]["like_for_like"]["regimes"]) + 1  # the flagged one (5 ms)
    assert [r["emulated_step_ms"] for r in regimes if r["flags"]] == [5.0]
    plots.plot_overlap(regimes, tmp_path / "o.png")
    a1, a2 = figs[0].axes[:2]
    for a in (a1, a2):
        bars = [c for c in a.containers]
        assert len(bars) == len(regimes)  # no control measured: no hollow markers
        assert any(ln.get_linestyle() == "--" and list(ln.get_ydata()) == [1.0, 1.0] for ln in a.lines)
    ys = sorted(round(float(c.lines[0].get_ydata()[0]), 9) for c in a1.containers)
    assert ys == sorted(round(r["overlap_gain"], 9) for r in regimes)
    assert sorted(c.lines[0].get_marker() for c in a1.containers) == ["o"] * (len(regimes) - 1) + ["x"]
