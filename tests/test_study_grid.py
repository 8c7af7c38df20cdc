"""The study's grid: device steps named by what they stand for at each rays per GPU (and a step
measured by ``bench loop`` first), the headline's step by rule, the launches (main grid, check
cells, the small scene's cache row), what the grid leaves out, and the control's own cost measured
apart with the real ray graph."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dali_nerf.config import load_config
from dali_nerf.errors import ConfigError
from dali_nerf.bench.study import steps as st
from dali_nerf.bench.study.runs import emulated_launches

REPO = Path(__file__).resolve().parents[1]


def _cfg(*ov):
    return load_config(REPO / "configs" / "study.yaml", list(ov), check_paths=False)


def test_the_committed_configs_steps_and_headline():
    """configs/study.yaml: the H200-measured step of the study model (not linear in the rays) and
    the stated hash-grid step at every batch of the sweep; the headline takes the measured one."""
    cfg = _cfg()
    steps = st.device_steps(cfg)
    assert st.grid_rays(cfg) == [4096, 16384, 65536]
    assert [(s.name, s.kind) for s in steps] == [("measured", "measured"), ("stated", "stated")]
    assert steps[0].ms == {4096: 9.289, 16384: 9.633, 65536: 13.776}
    assert set(steps[1].ms.values()) == {13.2} and "nerfacc" in steps[1].source
    gpu = json.loads((REPO / "docs" / "gpu" / "h200-2026-12-04" / "gpu_study.json").read_text())
    assert {p["rays"]: round(p["step_ms"], 3) for p in gpu["phases"]} == steps[0].ms  # the file it names
    assert st.headline_step(steps).name == "measured"


def test_steps_not_run_at_a_batch_assumed_steps_and_the_rule_without_a_measured_one():
    cfg = _cfg("bench.rays=[2048,8192]", "bench.device_steps=[{name: s, kind: stated, ms: [0, 5]}]",
               "bench.emulated_step_ms=[2]", "bench.check_rays=[1024]", "bench.check_step_ms=4")
    steps = st.device_steps(cfg)
    assert [(s.name, s.kind, s.ms) for s in steps] == [("s", "stated", {8192: 5.0}),
                                                       ("2 ms/4096", "assumed", {2048: 1.0, 8192: 4.0})]
    assert st.headline_step(steps).name == "s"  # no measured step: the first one
    assert st.check_steps(cfg) == [("check 4 ms/4096", 1.0, 1024)]
    assert [s.name for s in st.device_steps(_cfg("bench.only_steps=[stated]"))] == ["stated"]  # part of the grid
    assert [st.Step.from_dict(s.to_dict()) for s in steps] == steps
    with pytest.raises(ConfigError, match="bench.device_steps: no device step for the emulated launches"):
        st.device_steps(_cfg("bench.device_steps=[]", "bench.emulated_step_ms=[]"))


def test_a_step_measured_by_bench_loop_comes_first(tmp_path):
    loop = tmp_path / "loop.json"
    loop.write_text(json.dumps({"meta": {"grad_bytes": 10, "device_name": "NVIDIA H200", "phase_timing": "cuda_events",
                                         "model_desc": "vm r=16", "command": "dali-nerf bench loop", "commit": "abc"},
                                "device_steps": [{"rays": 16384, "compute_ms": 7.5, "ms_per_4096": 1.875, "trials": 3},
                                                 {"rays": 65536, "compute_ms": 11.0, "ms_per_4096": 0.6875,
                                                  "trials": 3}]}))
    steps = st.device_steps(_cfg(f"bench.device_step_file={loop}"))
    assert (steps[0].name, steps[0].kind, steps[0].ms) == ("loop", "measured", {16384: 7.5, 65536: 11.0})
    assert "NVIDIA H200 (CUDA events)" in steps[0].source and st.headline_step(steps).name == "loop"
    with pytest.raises(ConfigError, match="has a device step at none of bench.rays"):
        st.device_steps(_cfg(f"bench.device_step_file={loop}", "bench.rays=[4096]",
                             "bench.device_steps=[{name: m, ms: [1]}]"))


def test_the_launches_and_what_the_grid_leaves_out():
    """On a 2-core host: DDP and SS at 1 and 2 GPUs on both cores and 1 GPU pinned to 1 core, every
    (step, rays) cell, then the small scene's row at the headline's step; nothing starved."""
    cfg = _cfg()
    steps = st.device_steps(cfg)
    las = emulated_launches(cfg, steps, 2)
    assert [(la["name"], la["grid"]) for la in las] == [
        ("emu_ddp_1", "main"), ("emu_ddp_1_c1", "main"), ("emu_ddp_2", "main"), ("emu_ss_1", "main"),
        ("emu_ss_1_c1", "main"), ("emu_ss_2", "main"), ("emu_ddp_2_small", "cache")]
    assert len(las[0]["cells"]) == 6 and ("measured", 13.776, 65536) in las[0]["cells"]
    assert len(las[3]["cells"]) == 4 and not any(r == 65536 for _, _, r in las[3]["cells"])  # SS: bench.rays_ss
    assert las[-1]["cells"] == [("measured", 13.776, 65536)] and las[-1]["scene"] == "data/study"
    out = st.left_out(cfg, las, 2)
    assert out[0].startswith("the CPU-compute rows") and any(x.startswith("the starved host") for x in out)
    assert "more than 2 emulated GPUs" in out and "SS at rays per GPU other than 4096, 16384 (bench.rays_ss)" in out
    assert out[-1].startswith("SS at 65536 rays per GPU (its routed synchronous baselines")
    assert not any(x.startswith("launches pinned") for x in out)
    # the smaller setting without the pinned launches says it leaves them out
    pinned = _cfg("bench.emulated_cores=[0]")
    assert any(x.startswith("launches pinned to fewer cores than the host's 2") for x in st.left_out(
        pinned, emulated_launches(pinned, steps, 2), 2))
    # a 4-rank launch on 2 cores is the starved host: no longer left out
    assert not any(x.startswith("the starved host") for x in st.left_out(
        cfg, emulated_launches(_cfg("bench.emulated_ranks=[1,2,4]"), steps, 2), 2))


def test_the_controls_own_cost_is_measured_with_the_ray_graph(tmp_path):
    """Each variant timed in every round (control: synchronous executor + copy; no copy; async:
    the pipelined loader's executor driven from the calling thread), per step, and the own cost the
    paired difference control - async over the rounds."""
    from _tiny_scene import tiny_scene
    from dali_nerf.bench.study.control import VARIANTS, measure_control

    scene = tiny_scene(tmp_path / "scene")
    res = measure_control(_cfg(), scene, [128, 256], [(1, 512)], rounds=3, runs=2)
    assert [(r["rays"], r["threads"], r["rays_per_run"], r["steps_per_run"]) for r in res["rows"]] == [
        (128, 1, 512, 4), (256, 1, 512, 2)]
    for r in res["rows"]:
        assert all(len(r[f"{v}_s"]) == 3 and min(r[f"{v}_s"]) > 0 for v in VARIANTS)
        diff = [c - a for c, a in zip(r["control_s"], r["async_s"])]
        assert r["own_s"] == pytest.approx(sum(diff) / 3) and r["own_ci"][0] <= r["own_s"] <= r["own_ci"][1]
        assert r["copy_s"] + r["executor_s"] == pytest.approx(r["own_s"])
