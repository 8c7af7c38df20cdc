"""The study: derivation from hand-written metrics (known answers), the cost-model fit on synthetic
measurements (recovers its parameters), report generation, the GPU script's CPU mode, and a
smoke run of the real grid (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dali_nerf.bench import costmodel as cm
from dali_nerf.bench import study
from dali_nerf.bench.study.report import PLOTS
from dali_nerf.cli.command import run_cli
from dali_nerf.errors import DaliNerfError

REPO = Path(__file__).resolve().parents[1]
PH = ("wait", "h2d", "forward", "backward", "sync", "optimizer")


def _write_run(root: Path, method, sampler, ranks, phases_per_rank, steps=8, warmup=3, rays=1024,
               warm_phases=None, summary=None) -> Path:
    """A run folder with config.yaml and metrics*.jsonl: steps <= warmup use ``warm_phases``
    (large values that must be ignored), later steps ``phases_per_rank[r]`` (dict phase -> s)."""
    d = root / f"study_{method}_{sampler}_{ranks}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"name": d.name, "method": method,
                                                   "pipeline": {"name": sampler, "rays_per_batch": rays},
                                                   "bench": {"warmup": warmup}}))
    for r in range(ranks):
        lines = []
        for s in range(1, steps + 1):
            ph = phases_per_rank[r] if s > warmup else (warm_phases or {k: 1.0 for k in PH})
            rec = {"step": s, "loss": 0.1, "psnr": 10.0, "rays": rays}
            rec.update({f"{k}_s": float(ph.get(k, 0.0)) for k in PH})
            rec["step_s"] = float(sum(ph.get(k, 0.0) for k in PH))
            lines.append(json.dumps(rec))
        name = "metrics.jsonl" if r == 0 else f"metrics.rank{r}.jsonl"
        (d / name).write_text("\n".join(lines) + "\n")
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    return d


def _ph(wait, compute, sync=0.0):
    return {"wait": wait, "h2d": 0.0, "forward": compute * 0.4, "backward": compute * 0.4, "sync": sync,
            "optimizer": compute * 0.2}


def test_derive_known_values(tmp_path):
    # sync_global x2: rank waits 0.04 and 0.06 (mean 0.05), compute 0.04, sync 0.01 -> step 0.1
    g = _write_run(tmp_path, "ddp", "sync_global", 2, [_ph(0.04, 0.04, 0.01), _ph(0.06, 0.04, 0.01)])
    # pipelined x2: wait 0.002, compute 0.04, sync 0.008 -> step 0.05
    p = _write_run(tmp_path, "ddp", "rays", 2, [_ph(0.002, 0.04, 0.008)] * 2)
    # sync_local x2: wait 0.025 compute 0.04 sync 0.01 -> 0.075
    l = _write_run(tmp_path, "ddp", "sync_local", 2, [_ph(0.025, 0.04, 0.01)] * 2,
                   summary={"test_psnr": 21.5, "fusion_overhead": 0.3})
    d = study.derive([g, p, l])  # warm-up read from config.yaml (3): the 1.0 s steps are skipped
    runs = {r["sampler"]: r for r in d["runs"]}
    assert runs["sync_global"]["ranks"] == 2
    assert runs["sync_global"]["steps_used"] == 5
    assert runs["sync_global"]["phases_s"]["wait"] == pytest.approx(0.05)
    assert runs["sync_global"]["step_s"] == pytest.approx(0.1)
    assert runs["sync_global"]["stall"] == pytest.approx(0.5)
    assert runs["rays"]["stall"] == pytest.approx(0.002 / 0.05)
    assert runs["sync_global"]["rays_per_s"] == pytest.approx(2 * 1024 / 0.1)
    assert runs["sync_local"]["test_psnr"] == 21.5
    assert runs["sync_local"]["fusion"] == {"fusion_overhead": 0.3}
    sp = {s["baseline"]: s for s in d["speedups"]}
    assert sp["sync_global"]["speedup"] == pytest.approx(0.1 / 0.05)
    assert sp["sync_global"]["ideal_speedup"] == pytest.approx(1 / (1 - 0.5))
    assert sp["sync_local"]["speedup"] == pytest.approx(0.075 / 0.05)
    assert sp["sync_local"]["ideal_speedup"] == pytest.approx(1 / (1 - 0.025 / 0.075))
    assert d["summary"]["pairs"] == 2 and d["summary"]["max_stall_sync"] == pytest.approx(0.5)
    # CPU rows are never set beside the ISPASS study: no comparable pair, no like-for-like regime
    assert d["summary"]["comparable"] is None and d["summary"]["like_for_like"] is None
    assert runs["rays"]["cores"] is None and sp["sync_global"]["sampler_gain"] is None  # no control ran
    # an explicit warm-up overrides config.yaml: including step 3 (1.0 s phases) changes the means
    d0 = study.derive([g], warmup=2)
    assert d0["runs"][0]["steps_used"] == 6
    assert d0["runs"][0]["phases_s"]["wait"] == pytest.approx((1.0 + 5 * 0.05) / 6)


def test_derive_pairs_by_method_and_ranks(tmp_path):
    a = _write_run(tmp_path / "a", "ddp", "sync_local", 1, [_ph(0.03, 0.03)])
    b = _write_run(tmp_path / "b", "ss", "rays", 1, [_ph(0.0, 0.03)])
    d = study.derive([a, b])
    assert d["speedups"] == []  # different methods are never compared


def test_derive_user_errors(tmp_path):
    with pytest.raises(DaliNerfError, match="config.yaml: missing"):
        study.derive([tmp_path / "nope"])
    d = _write_run(tmp_path, "ddp", "rays", 1, [_ph(0.0, 0.03)], steps=3, warmup=3)
    with pytest.raises(DaliNerfError, match="no steps after the 3 warm-up steps"):
        study.derive([d])
    (d / "metrics.jsonl").write_text("{bad json\n")
    with pytest.raises(DaliNerfError, match=r"metrics.jsonl:1: not a JSON line"):
        study.derive([d], warmup=0)


def test_fit_linear():
    a, b = cm.fit_linear([1, 2, 4], [3, 5, 9])
    assert (a, b) == (pytest.approx(1.0), pytest.approx(2.0))
    assert cm.fit_linear([2, 2], [4, 4]) == (0.0, pytest.approx(2.0))


def _truth():
    return cm.CostModel(compute_fixed_s=0.004, compute_per_ray_core_s=2e-6, sample_fixed_s=0.001,
                        sample_per_ray_core_s=5e-6, scatter_per_byte_s=2e-10, allreduce_latency_s=3e-4,
                        allreduce_per_byte_s=1e-9, loader_fixed_s=0.0005, loader_per_ray_core_s=1e-6,
                        grad_bytes=8_000_000)


def test_costmodel_fit_recovers_parameters():
    true = _truth()
    obs = []
    for B in (1024, 4096):
        for W in (1, 2, 4):
            c = max(1, 4 // W)
            for s in ("sync_global", "sync_local", "rays"):
                p = true.predict(s, W, B, c)
                obs.append(cm.Observation("ddp", s, W, B, c, p["wait"], p["compute"], p["sync"], p["step"]))
    prof = cm.SamplingProfile(true.sample_fixed_s, true.sample_per_ray_core_s, true.loader_fixed_s,
                              true.loader_per_ray_core_s)
    m = cm.fit(obs, sampling=prof, grad_bytes=true.grad_bytes)
    for k in ("compute_fixed_s", "compute_per_ray_core_s", "scatter_per_byte_s", "allreduce_latency_s",
              "allreduce_per_byte_s"):
        assert getattr(m, k) == pytest.approx(getattr(true, k), rel=1e-6), k
    rows = cm.validate(m, obs)
    assert max(abs(r["step_error"]) for r in rows) < 1e-9
    # without a separate sampling profile, sync_local waits give the sampling terms
    m2 = cm.fit(obs, sampling=None, grad_bytes=true.grad_bytes)
    assert m2.sample_fixed_s == pytest.approx(true.sample_fixed_s, rel=1e-6)
    assert m2.sample_per_ray_core_s == pytest.approx(true.sample_per_ray_core_s, rel=1e-6)
    assert m2.scatter_per_byte_s == pytest.approx(true.scatter_per_byte_s, rel=1e-6)


def test_costmodel_single_world_size_uses_stated_latency():
    true = _truth()
    obs = []
    for B in (1024, 2048):
        p = true.predict("sync_local", 2, B, 1)
        obs.append(cm.Observation("ddp", "sync_local", 2, B, 1, p["wait"], p["compute"], p["sync"], p["step"]))
    m = cm.fit(obs, grad_bytes=true.grad_bytes, allreduce_latency_s=true.allreduce_latency_s)
    assert m.allreduce_per_byte_s == pytest.approx(true.allreduce_per_byte_s, rel=1e-6)
    assert any("stated" in n for n in m.notes)


def test_costmodel_formulas():
    m = _truth()
    # ring all-reduce: 2 (n-1)/n bytes
    assert m.sync_s(1) == 0.0
    assert m.sync_s(4) == pytest.approx(3e-4 + 1.5 * 8e6 * 1e-9)
    # pipelined: hidden when the loader is faster than compute, exposed remainder otherwise
    p = m.predict("rays", 1, 4096, 1)
    assert p["wait"] == pytest.approx(max(0.0, 0.0005 + 4096e-6 - p["compute"]))
    slow = cm.CostModel(**{**m.to_dict(), "loader_per_ray_core_s": 1e-4, "notes": ()})
    q = slow.predict("rays", 1, 4096, 1)
    assert q["wait"] == pytest.approx(0.0005 + 0.4096 - q["compute"])
    assert q["step"] == pytest.approx(0.0005 + 0.4096)
    g = m.predict("sync_global", 4, 1000, 2)
    assert g["wait"] == pytest.approx(0.001 + 5e-6 * 4000 / 2 + 2e-10 * 3 * 1000 * cm.RAY_BYTES)


def test_emulated_observations_cores():
    """Emulated rows share the host's cores between ranks, except sync_global: rank 0 samples every
    rank's batch while the others wait in the scatter, so its threads get up to the whole host."""
    def row(sampler, W, threads):
        return {"device": "emulated", "method": "ddp", "sampler": sampler, "ranks": W, "rays_per_rank": 4096,
                "sampler_threads": threads, "phases_s": {"wait": 0.001, "sync": 0.0}, "compute_s": 0.002,
                "step_s": 0.003}
    runs = [row(s, W, t) for s in ("sync_global", "sync_local", "rays") for W in (1, 4, 16) for t in (1, 3)]
    runs.append({**row("sync_local", 4, 1), "device": "cpu", "torch_threads": None})
    obs = {(o.sampler, o.ranks, r["sampler_threads"], r["device"]): o.cores_per_rank
           for o, r in zip(study.observations({"runs": runs}, cores=2), runs)}
    assert obs[("sync_global", 16, 1, "emulated")] == 1.0
    assert obs[("sync_global", 16, 3, "emulated")] == 2.0
    assert obs[("sync_global", 1, 3, "emulated")] == 2.0
    for s in ("sync_local", "rays"):
        assert obs[(s, 16, 1, "emulated")] == pytest.approx(2 / 16)
        assert obs[(s, 4, 3, "emulated")] == pytest.approx(0.5)
        assert obs[(s, 1, 1, "emulated")] == 1.0
    assert obs[("sync_local", 4, 1, "cpu")] == 1  # CPU rows: the trainer's cores // ranks, at least 1


def _hand_written_inputs(tmp_path):
    """write_report's inputs from hand-written DDP and SS runs at 1 and 2 ranks (CPU rows only)."""
    dirs = []
    for method in ("ddp", "ss"):
        for W in (1, 2):
            sync = 0.004 if (method == "ddp" and W == 2) else 0.0
            comp = 0.02 * (2 // (3 - W))  # slower per rank with fewer cores
            dirs.append(_write_run(tmp_path / "runs", method, "sync_global", W, [_ph(0.01 * W, comp, sync)] * W))
            dirs.append(_write_run(tmp_path / "runs", method, "sync_local", W, [_ph(0.01, comp, sync)] * W))
            dirs.append(_write_run(tmp_path / "runs", method, "rays", W, [_ph(0.0005, comp * 1.05, sync)] * W))
    d = study.derive(dirs)
    obs = study.observations(d, cores=2)
    model = cm.fit(obs, grad_bytes=1_000_000)
    val = cm.validate(model, obs)
    meta = {"machine": "cpu-2core-test", "machine_desc": "test", "command": "dali-nerf bench study --config X",
            "commit": "abc123-dirty", "date": "now", "wall_s": 1.0, "steps": 5, "warmup": 3, "workload": "w",
            "regime": "tiny", "trials": 1, "rays": 1024, "stream": "global"}
    return d, model, val, meta


def test_report_from_hand_written_runs(tmp_path):
    d, model, val, meta = _hand_written_inputs(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "projection.png").write_bytes(b"an earlier format's plot")
    out = study.write_report(tmp_path / "out", d, model, val, meta)
    text = out.read_text()
    assert "dali-nerf bench study --config X" in text and "abc123-dirty" in text and "NOT a clean commit" in text
    assert "- ray stream of rays and rays_sync (pipeline.stream): global (" in text  # the stream measured
    for png in PLOTS:
        assert (tmp_path / "out" / png).stat().st_size > 1000
        assert (tmp_path / "out" / png).read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "out" / "projection.png").exists() and "Projection" not in text
    raw = json.loads((tmp_path / "out" / "derived.json").read_text())
    assert raw["derived"]["summary"]["max_stall_sync"] == pytest.approx(d["summary"]["max_stall_sync"])
    assert raw["meta"]["format"] == study.REPORT_FORMAT and "format" not in meta  # recorded, the caller's dict untouched


COMMITTED = sorted((REPO / "docs" / "study").glob("*/derived.json"))


@pytest.mark.parametrize("derived_json", COMMITTED, ids=[p.parent.name for p in COMMITTED])
def test_report_from_committed_derived_json_is_byte_identical(tmp_path, monkeypatch, derived_json):
    """Each committed study's report.md, rewritten from its derived.json alone (plus the sampler table,
    which only the report keeps), is the committed file byte for byte; so is derived.json. The host
    rewriting it has another core count than the study's (the report takes the study's). A report
    of an older format (meta["format"], 1 when absent) is refused in one line naming its command,
    until the study is rerun with this code (the committed report is regenerated then)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    fmt = json.loads(derived_json.read_text())["meta"].get("format", 1)
    if fmt != study.REPORT_FORMAT:
        with pytest.raises(DaliNerfError, match=rf"format {fmt}; this code writes format {study.REPORT_FORMAT} .*"
                                                r"rerunning its command: dali-nerf bench study --config"):
            study.report_from_derived(derived_json, tmp_path / "again")
        assert not (tmp_path / "again").exists()  # nothing half-written
        return
    out = study.report_from_derived(derived_json, tmp_path / "again")
    assert out.read_bytes() == (derived_json.parent / "report.md").read_bytes()
    assert (tmp_path / "again" / "derived.json").read_bytes() == derived_json.read_bytes()
    for png in PLOTS:
        assert (tmp_path / "again" / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("derived_json", COMMITTED, ids=[p.parent.name for p in COMMITTED])
def test_readme_and_benchmarks_quote_the_committed_study(derived_json):
    """One source for every number: README's headline sentence and sampler rates are the tool's,
    written from the committed derived.json (the text between README's study markers equals
    :func:`~dali_nerf.bench.study.quotes.readme_blocks`), and docs/BENCHMARKS.md holds the tool's
    sentence on it and its history row."""
    from dali_nerf.bench.study import quotes

    raw = json.loads(derived_json.read_text())
    if raw["meta"].get("format", 1) != study.REPORT_FORMAT:
        pytest.skip(f"{derived_json}: a report of format {raw['meta'].get('format', 1)}; the quotes are written from "
                    f"format {study.REPORT_FORMAT}: runs once the study is regenerated with this code")
    readme = (REPO / "README.md").read_text()
    blocks = quotes.readme_blocks(raw)
    assert set(blocks) == set(quotes.BLOCKS), "the committed study has no headline or no sampler table"
    for name, body in blocks.items():
        got = readme.split(f"<!-- study:{name} -->", 1)[1].split(f"<!-- /study:{name} -->", 1)[0]
        assert got == body, f"README.md's {name} block should be: {body}"
    bench = (REPO / "docs" / "BENCHMARKS.md").read_text()
    assert quotes.benchmarks_row(raw) in bench
    assert bench.split("<!-- study:current -->", 1)[1].split("<!-- /study:current -->", 1)[0] == \
        quotes.benchmarks_current(raw)


def test_committed_study_exists():
    assert COMMITTED, "no docs/study/*/derived.json: the byte-identical report test has nothing to check"


@pytest.mark.parametrize("with_sampler", [False, True])
def test_report_from_derived_round_trip(tmp_path, with_sampler):
    """write_report -> report_from_derived gives the same report.md and derived.json, with and without
    the sampler table, the sampling cost and the control's own cost, on a host of another core count
    than the one that wrote it."""
    d, model, val, meta = _hand_written_inputs(tmp_path)
    meta["machine"] = "cpu-7core-test"
    sampler = sampling = control = None
    if with_sampler:
        rates = {"rays": 8e6, "torch_gather": 1e6, "sync_local": 1e6, "sync_global": 5e5, "torch_workers": 2e5}
        sampler = {"command": "dali-nerf bench sampler --scene s --batches 8", "result": {
            "rows": [{"rays": 8, "rates": rates}], "ss": [], "decode": {"images": 4, "jpeg": 500.0, "png": 80.0},
            "scene": {"images": 4, "pixels": 1024}, "cores": 7, "threads": 1, "rounds": 3, "seconds": 0.5,
            "stream": "global"}}
        sampling = {"sizes": [128, 256], "sync_s": [1e-3, 2e-3], "loader_s": [1e-4, 2e-4],
                    "loader_cpu_s": [2e-4, 4e-4], "sync_cores": 1, "loader_cores": 1}
        control = {"rounds": 2, "runs": 3, "rows": [{"rays": 128, "threads": 1, "rays_per_run": 512, "steps_per_run": 4,
                                                     "control_s": [3e-4, 3e-4], "no_copy_s": [2e-4, 2e-4],
                                                     "async_s": [1e-4, 1e-4], "own_s": 2e-4, "own_ci": [2e-4, 2e-4],
                                                     "copy_s": 1e-4, "executor_s": 1e-4}]}
    first = study.write_report(tmp_path / "first", d, model, val, meta, sampling, sampler, None, control, cores=7)
    text = first.read_text()
    assert ("| 8 | 8.0 | 1.00 (8.0x) |" in text) == with_sampler and ("own cost ms" in text) == with_sampler
    again = study.report_from_derived(tmp_path / "first" / "derived.json", tmp_path / "again")
    assert again.read_bytes() == first.read_bytes()
    assert (tmp_path / "again" / "derived.json").read_bytes() == (tmp_path / "first" / "derived.json").read_bytes()


def test_report_from_derived_user_errors(tmp_path):
    """One line naming the file: not JSON, a key missing, another format (naming its command)."""
    d, model, val, meta = _hand_written_inputs(tmp_path)
    study.write_report(tmp_path / "first", d, model, val, meta, cores=2)
    src = tmp_path / "first" / "derived.json"
    raw = json.loads(src.read_text())
    src.write_text("{not json")
    with pytest.raises(DaliNerfError, match="derived.json: not a study's derived.json"):
        study.report_from_derived(src, tmp_path / "x")
    src.write_text(json.dumps({**raw, "cost_model": {}}))
    with pytest.raises(DaliNerfError, match="derived.json: not a study's derived.json"):
        study.report_from_derived(src, tmp_path / "x")
    raw["meta"]["format"] = 3
    src.write_text(json.dumps(raw))
    with pytest.raises(DaliNerfError, match="a study report of format 3; this code writes format 4 .*rerunning its "
                                            "command: dali-nerf bench study --config X"):
        study.report_from_derived(src, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_quotes_of_a_checkout_without_benchmarks_name_the_command(tmp_path):
    """``--quotes`` into a checkout that has no docs/BENCHMARKS.md: one line saying the report is
    written and how to write its quotes, README.md untouched."""
    from dali_nerf.bench.study import _write_quotes

    d, model, val, meta = _hand_written_inputs(tmp_path)
    study.write_report(tmp_path / "first", d, model, val, meta, cores=2)
    (tmp_path / "co").mkdir()
    (tmp_path / "co" / "README.md").write_text("<!-- study:headline -->old<!-- /study:headline -->\n")
    with pytest.raises(DaliNerfError, match=r"the report is written, its quotes are not .*BENCHMARKS.md.*; write them "
                                            r"with python -m dali_nerf.bench.study.quotes .*derived.json --write"):
        _write_quotes(tmp_path / "first" / "derived.json", tmp_path / "co")
    assert (tmp_path / "co" / "README.md").read_text() == "<!-- study:headline -->old<!-- /study:headline -->\n"


def test_machine_slug_and_commit():
    slug = study.machine_slug()
    assert slug.endswith(f"{os.cpu_count()}core-{__import__('platform').machine()}")
    assert " " not in slug
    # the checkout's own commit (CI runs a clean clone): the test fails, not passes, when git does
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert len(head) == 40 and int(head, 16) >= 0
    assert study.git_commit(REPO) in (head, head + "-dirty")


def test_git_commit_marks_dirty_trees_outside_the_report(tmp_path):
    """A throwaway repository: HEAD's hash, "-dirty" for a changed or untracked file outside
    docs/study (the report's own folder) only, "unknown" outside any repository."""
    repo = tmp_path / "repo"
    (repo / "docs" / "study").mkdir(parents=True)
    (repo / "a.txt").write_text("a\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "a.txt"], ["commit", "-q", "-m", "one"]):
        subprocess.run(git + cmd, cwd=repo, check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    assert study.git_commit(repo) == head
    (repo / "docs" / "study" / "report.md").write_text("the report\n")
    assert study.git_commit(repo) == head  # the report being written does not dirty the commit
    (repo / "b.txt").write_text("untracked\n")
    assert study.git_commit(repo) == head + "-dirty"
    (repo / "b.txt").unlink()
    (repo / "a.txt").write_text("changed\n")
    assert study.git_commit(repo) == head + "-dirty"
    outside = tmp_path / "plain"
    outside.mkdir()
    assert study.git_commit(outside) == "unknown"


DERIVED_RUN_KEYS = ("method", "sampler", "ranks", "device", "emulated_step_ms", "step_name", "grid", "scene", "step_s", "step_s_trials", "stall",
                    "stall_trials", "cores", "cores_per_gpu", "hidden_stall", "hidden_runq", "hidden_overshoot",
                    "runq_share", "step_over_floor")
DERIVED_PAIR_KEYS = ("speedup", "speedup_ci", "ideal_speedup", "ideal_basis", "ideal_speedup_wait", "stall_data",
                     "sampler_gain", "overlap_gain", "cores_per_gpu", "pipelined_over_floor", "hidden_stall",
                     "stall_rays_sync")


def _check_recomputed(raw):
    """derived.json's numbers are those of the metrics files on disk."""
    again = study.derive([r["dir"] for r in raw["derived"]["trial_runs"]])
    key = ("device", "method", "sampler", "ranks", "cores", "grid", "step_name", "emulated_step_ms", "rays_per_rank")
    want = {tuple(c[k] for k in key): c for c in raw["derived"]["runs"]}
    assert len(want) == len(raw["derived"]["runs"]) == len(again["runs"])
    for c in again["runs"]:
        w = want[tuple(c[k] for k in key)]
        assert c["step_s_trials"] == pytest.approx(w["step_s_trials"]) and c["stall"] == pytest.approx(w["stall"])
    for a, b in zip(again["speedups"], raw["derived"]["speedups"]):
        assert a["speedup"] == pytest.approx(b["speedup"]) and a["ideal_speedup"] == pytest.approx(b["ideal_speedup"])
        assert a["overlap_gain"] == pytest.approx(b["overlap_gain"]) and a["cores"] == b["cores"]


@pytest.mark.slow
def test_study_smoke_end_to_end(tmp_path, monkeypatch):
    """The CPU rows at tiny size: DDP trainer processes (2 ranks: 4 launches), derive, cost model,
    report (the shipped grid leaves the CPU rows out; SS's cells run in test_study_smoke_emulated and
    test_a_failed_cell_is_reported_and_the_command_exits_2)."""
    import argparse

    from dali_nerf.scenegen import make_scene

    monkeypatch.chdir(tmp_path)
    make_scene("objects", tmp_path / "scene", width=24, height=24, n_train=6, n_val=1, n_test=1)
    ov = [f"scene.path={tmp_path / 'scene'}", f"train.runs_dir={tmp_path / 'runs'}", f"bench.out={tmp_path / 'docs'}",
          "bench.steps=4", "bench.warmup=1", "pipeline.rays_per_batch=128", "pipeline.rays_per_run=384",
          "bench.sampling_sizes=[128,256]", "bench.sampler_seconds=0", "bench.methods=[ddp]", "bench.trials=1",
          "bench.samplers=[sync_global,rays_sync,rays]", "bench.ranks=[2]", "bench.emulated_ranks=[]",
          "bench.emulated_ranks_ss=[]", "model.samples_per_ray=4", "model.resolution=8"]
    # as the CLI runs it: the command scope puts back what the study sets (torch threads)
    rc = run_cli(study.main, argparse.Namespace(config=str(REPO / "configs" / "study.yaml"), overrides=ov))
    assert rc == 0
    out = tmp_path / "docs" / study.machine_slug()
    text = (out / "report.md").read_text()
    assert "dali-nerf bench study --config" in text and study.git_commit(REPO) in text
    for png in PLOTS:
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    raw = json.loads((out / "derived.json").read_text())
    done = {(r["method"], r["sampler"], r["ranks"]) for r in raw["derived"]["runs"]}
    assert {(m, s, w) for m in ("ddp",) for s in ("sync_global", "rays_sync", "rays", "ready") for w in (2,)} == done
    # the DALI sources over whole runs of 384 / 128 = 3 steps (warm-up 1 -> 3, timed 4 -> 6), the others as asked
    for r in raw["derived"]["runs"]:
        assert r["device"] == "cpu" and r["cores"] == study.host_cores(), r
        assert (r["steps_used"], r["warmup"]) == ((6, 3) if r["sampler"] in ("rays", "rays_sync") else (4, 1)), r
        assert r["runq_s"] is not None and r["cores_per_gpu"] == pytest.approx(r["cores"] / r["ranks"])
    # every CPU pair has its floor (the trainers with pipeline.name=ready), so its ideal is the
    # baseline's step over the floor's; the control splits each speedup (one trial: exactly)
    for sp in raw["derived"]["speedups"]:
        assert sp["ideal_basis"] == "floor" and sp["step_floor_s"] > 0
        assert sp["sampler_gain"] * sp["overlap_gain"] == pytest.approx(sp["speedup"], rel=1e-9)
    assert raw["derived"]["summary"]["comparable"] is None  # CPU compute: nothing set beside the ISPASS study
    again = study.derive([r["dir"] for r in raw["derived"]["trial_runs"]])
    assert [x["speedup"] for x in again["speedups"]] == pytest.approx([x["speedup"] for x in raw["derived"]["speedups"]])


@pytest.mark.slow
def test_a_failed_cell_is_reported_and_the_command_exits_2(tmp_path, monkeypatch, capsys):
    """One cell of the grid fails for real (SS's ready floor refuses pipeline.mode=epoch, the rays
    cell runs): the report is written with the cell listed under "Cells that did not run", and the
    command exits 2 with one line naming the cell, its trainer's error and its log."""
    from dali_nerf.cli.main import main
    from dali_nerf.scenegen import make_scene

    monkeypatch.chdir(tmp_path)
    make_scene("objects", tmp_path / "scene", width=16, height=16, n_train=4, n_val=1, n_test=1)
    rc = main(["bench", "study", "--config", str(REPO / "configs" / "study.yaml"), f"scene.path={tmp_path / 'scene'}",
               f"train.runs_dir={tmp_path / 'runs'}", f"bench.out={tmp_path / 'docs'}", "bench.ranks=[1]",
               "bench.methods=[ss]", "bench.samplers=[rays]", "pipeline.mode=epoch", "bench.trials=1", "bench.steps=2",
               "bench.warmup=1", "pipeline.rays_per_batch=64", "pipeline.rays_per_run=128", "bench.emulated_ranks=[]",
               "bench.emulated_ranks_ss=[]", "bench.sampling_sizes=[]", "bench.sampler_seconds=0", "model.resolution=8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    log = tmp_path / "runs" / "study_ss_ready_1_t0_0.log"
    assert err[0].startswith("error: bench study: the report (") and "1 cell(s) that failed: study_ss_ready_1_t0_0" in err[0]
    assert "pipeline.mode=epoch: the SS baselines sample iid rays only" in err[0] and str(log) in err[0]
    text = (tmp_path / "docs" / study.machine_slug() / "report.md").read_text()
    assert "## Cells that did not run" in text and "study_ss_ready_1_t0_0: exit 2: error: pipeline.mode=epoch" in text
    assert "| ss | rays | 1 |" in text  # the cell that ran is in the report


@pytest.mark.slow
def test_study_smoke_emulated(tmp_path, monkeypatch, capsys):
    """Emulated DDP launches at 1 and 2 ranks on every core, and 1 rank pinned to 1 core (a 2-rank
    launch on 1 core is not run: under 1 core per GPU), with sync_global, the control rays_sync and
    rays, 1 trial, tiny steps, one named device step, and the small scene's cache row (1 rank,
    generated): report, plots, derived.json with the documented keys (cores per GPU, both gains,
    hidden stall, run-queue and overshoot measured), the DALI sources timed over whole runs, the
    pinned ranks' own host budget read from their affinity, the headline by its rule, the control's
    own cost measured at the grid's batch, and the numbers recomputed from the metrics files."""
    import argparse

    from dali_nerf.scenegen import make_scene

    monkeypatch.chdir(tmp_path)
    make_scene("objects", tmp_path / "scene", width=24, height=24, n_train=8, n_val=1, n_test=1)
    ov = [f"scene.path={tmp_path / 'scene'}", f"train.runs_dir={tmp_path / 'runs'}", f"bench.out={tmp_path / 'docs'}",
          "bench.ranks=[]", "bench.methods=[ddp]", "bench.emulated_ranks=[1,2]", "bench.emulated_ranks_ss=[]",
          "bench.emulated_cores=[0,1]", "bench.emulated_samplers=[sync_global,rays_sync,rays]",
          "bench.rays=[2048]", "bench.device_steps=[{name: test, kind: measured, ms: [2], source: a test}]",
          "bench.trials=1", "bench.emulated_steps=4", "bench.emulated_warmup=1", "bench.check_rays=[]",
          "bench.sampling_sizes=[1024,2048]", "bench.sampler_seconds=0", f"bench.small_scene={tmp_path / 'small'}",
          "bench.small_resolution=16", "bench.scene_images=4", "bench.small_rays=[2048]", "bench.small_ranks=1"]
    co = tmp_path / "checkout"  # --quotes writes into a copy of README.md and docs/BENCHMARKS.md
    (co / "docs").mkdir(parents=True)
    shutil.copy(REPO / "README.md", co / "README.md")
    shutil.copy(REPO / "docs" / "BENCHMARKS.md", co / "docs" / "BENCHMARKS.md")
    # as the CLI runs it: the command scope puts back what the study sets (torch threads)
    rc = run_cli(study.main, argparse.Namespace(config=str(REPO / "configs" / "study.yaml"), overrides=ov,
                                                quotes=True, checkout=str(co)))
    assert rc == 0
    out = tmp_path / "docs" / study.machine_slug()
    text = (out / "report.md").read_text()
    # the one command's quotes: README's blocks, BENCHMARKS' sentence and history row, the tool's
    from dali_nerf.bench.study import quotes

    q = quotes.load(out / "derived.json")
    readme, bench = (co / "README.md").read_text(), (co / "docs" / "BENCHMARKS.md").read_text()
    assert "headline" in quotes.readme_blocks(q) or study.host_cores() < 2
    for name, body in quotes.readme_blocks(q).items():
        assert readme.split(f"<!-- study:{name} -->", 1)[1].split(f"<!-- /study:{name} -->", 1)[0] == body
    assert quotes.benchmarks_row(q) in bench and quotes.benchmarks_current(q) in bench
    assert "device compute emulated by a timed wait; host work real" in text
    assert "Lockstep cost" in text and "floor ms" in text and "cores per GPU" in text
    # the console prints the report's Result section as written there: one set of numbers
    printed = capsys.readouterr().out
    section = text.split("## Result\n", 1)[1].split("\n## ", 1)[0].strip()
    assert section and section in printed
    for png in PLOTS + ("scaling.png",):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    raw = json.loads((out / "derived.json").read_text())
    n = study.host_cores()
    launches = {(1, n), (2, n)} | ({(1, 1)} if n > 1 else set())
    got = {(la["ranks"], la["cores"], la["grid"]) for la in raw["emulation"]["launches"]}
    assert got == {(w, c, "main") for w, c in launches} | {(1, n, "cache")}
    assert all(r["grid"] == "cache" for r in raw["derived"]["runs"] if r["scene"] == str(tmp_path / "small"))
    runs = [r for r in raw["derived"]["runs"] if r["grid"] == "main"]
    assert {(r["sampler"], r["ranks"], r["cores"]) for r in runs} == {
        (s, w, c) for s in ("sync_global", "rays_sync", "rays", "ready") for w, c in launches}
    K = 65536 // 2048  # the host budget's run: 1 sampler thread, 65536 rays
    for r in runs:
        assert all(k in r for k in DERIVED_RUN_KEYS) and r["device"] == "emulated"
        assert (r["emulated_step_ms"], r["step_name"]) == (2.0, "test") and len(r["step_s_trials"]) == 1
        assert len(r["stall_trials"]) == 1
        assert r["floor_step_s"] > 0 and r["cores_per_gpu"] == pytest.approx(r["cores"] / r["ranks"])
        assert r["runq_s"] is not None and r["runq_s"] >= 0 and r["overshoot_s"] >= 0 and r["hidden_stall"] is not None
        # whole runs, from a run boundary, for the DALI sources; bench.emulated_steps for the others
        assert r["steps_used"] == (K if r["sampler"] in ("rays", "rays_sync") else 4), r
    for run in raw["derived"]["trial_runs"]:
        if run["sampler"] in ("rays", "rays_sync"):  # the timed steps start at a run boundary of the source
            before = json.loads((Path(run["dir"]) / "study.json").read_text())["source_steps_before"]
            assert (before + run["warmup"]) % K == 0, (before, run["warmup"])
    sps = raw["derived"]["speedups"]
    assert {(x["baseline"], x["ranks"], x["cores"], x["grid"]) for x in sps} == {
        (b, w, c, "main") for b in ("sync_global", "rays_sync") for w, c in launches} | {
        (b, 1, n, "cache") for b in ("sync_global", "rays_sync")}
    for x in sps:
        assert all(k in x for k in DERIVED_PAIR_KEYS) and len(x["speedup_ci"]) == 2
        # one trial: the gains' product is the speedup exactly; the control's sampler gain is 1
        assert x["sampler_gain"] * x["overlap_gain"] == pytest.approx(x["speedup"], rel=1e-9)
        assert x["baseline"] != "rays_sync" or x["sampler_gain"] == 1.0
    s = raw["derived"]["summary"]
    # the headline by its rule, whatever the timings (a shared machine may flag every pair): DDP, 2 GPUs on
    # every usable core (>= 1 core per GPU), the named step, every rays per GPU
    assert [(r["ranks"], r["cores"], r["rays_per_rank"], r["step_name"]) for r in s["headline"]["rows"]] == (
        [(2, n, 2048, "test")] if n >= 2 else [])
    assert raw["meta"]["headline_step"] == "test" and "at least 2 emulated GPUs" in raw["meta"]["headline_rule"]
    assert [(d["name"], d["kind"], d["ms"]) for d in raw["meta"]["device_steps"]] == [("test", "measured", {"2048": 2.0})]
    assert len(s["cache"]) == 1 and s["cache"][0]["small"]["rays_per_rank"] == 2048
    assert "Cache effect: the same configuration on the small scene" in text and "## Overlap gain" in text
    # the control's own cost, measured apart at the grid's batch and the launches' budget (1 thread here)
    (row,) = raw["control"]["rows"]
    assert (row["rays"], len(row["control_s"])) == (2048, raw["control"]["rounds"]) and row["own_ci"][0] <= row["own_s"]
    assert isinstance(raw["emulation"]["launches"][0]["demoted"], list)
    assert raw["meta"]["format"] == study.REPORT_FORMAT and raw["meta"]["cores"] == n
    # the ray stream measured, pinned in the config, recorded in the meta, the header and every segment
    assert yaml.safe_load((REPO / "configs" / "study.yaml").read_text())["pipeline"]["stream"] == "global"
    assert raw["meta"]["stream"] == "global" and "- ray stream of rays and rays_sync (pipeline.stream): global" in text
    for run in raw["derived"]["trial_runs"]:
        assert yaml.safe_load((Path(run["dir"]) / "config.yaml").read_text())["pipeline"]["stream"] == "global"
    sc = raw["sampling"]["scaling"]
    assert sc["threads"] == ([1, n] if n > 1 else [1]) and len(sc["loader_s"]) == len(sc["threads"])
    assert len(raw["sampling"]["rays_sync_s"]) == 2
    _check_recomputed(raw)
    # the study's own output rewritten from its derived.json: the same report, byte for byte
    again = study.report_from_derived(out / "derived.json", tmp_path / "again")
    assert again.read_bytes() == (out / "report.md").read_bytes()


def test_refit_script_reproduces_the_committed_report(capsys):
    """benchmarks/refit_cost_model.py on the committed derived.json prints the committed report's
    check-set error (the study and the script fit and check the model the same way)."""
    import importlib.util
    import re

    d = REPO / "docs" / "study" / study.machine_slug()
    if not (d / "derived.json").exists():
        pytest.skip(f"no committed study for this machine ({d.name}): runs on a machine whose study report is committed "
                    f"(docs/study/<machine>/derived.json, written by dali-nerf bench study)")
    spec = importlib.util.spec_from_file_location("refit", REPO / "benchmarks" / "refit_cost_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main([str(d / "derived.json"), "--config", str(REPO / "configs" / "study.yaml")])
    out = capsys.readouterr().out
    want = re.search(r"check set: mean absolute step-time error ([\d.]+)%, max ([\d.]+)%", (d / "report.md").read_text())
    assert want, "the report has a check set"
    assert f"check set: mean absolute step-time error {want[1]}%, max {want[2]}%" in out


def test_the_study_refuses_a_global_batch_in_one_line(capsys, monkeypatch):
    """The study sets rays per rank itself; pipeline.global_batch would be ignored silently, so the
    command refuses it: exit 2, one line naming the file and the key, nothing run."""
    from dali_nerf.cli.main import main as cli_main

    import dali_nerf.bench.study as study

    def ran(*a, **k):
        raise AssertionError("the study started")

    for name in ("make_scene", "run_grid", "measure_sampling", "run_emulated"):
        monkeypatch.setattr(study, name, ran)
    monkeypatch.chdir(REPO)
    code = cli_main(["bench", "study", "--config", "configs/study.yaml", "pipeline.global_batch=1536"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: configs/study.yaml: pipeline.global_batch=1536: the study sets the rays per "
                                 "rank of every row itself (pipeline.rays_per_batch, bench.check_rays); leave it 0"], err
