"""Step phase timing (PhaseTimer), the warm-up / steady stall split in the progress bar, the
summary and the trainer's printed JSON, and the batch sources' stats() definitions."""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch

from dali_nerf.sources import base
from dali_nerf.train.phases import PhaseTimer
from dali_nerf.train.runlog import bar_stall as _bar_stall, steady_stall as _steady_stall

REPO = Path(__file__).resolve().parent.parent


def test_phase_timer_cpu_spans_host_and_minus(monkeypatch):
    t = PhaseTimer(torch.device("cpu"))
    assert t.kind == "host" and not t.cuda
    a, b = 1.0, 3.5  # CPU marks are perf_counter values
    t.span("forward", a, b)
    t.span("backward", 4.0, 10.0, 1.5)
    t.host("wait", 0.25)
    t.host("sync", 1.5)
    ph = {"wait": 0.0, "forward": 0.0, "backward": 0.0, "sync": 0.0}
    t.resolve(ph)
    assert ph == {"wait": 0.25, "forward": 2.5, "backward": 4.5, "sync": 1.5}
    t.resolve(ph)  # resolved spans are consumed
    assert ph["forward"] == 2.5
    # a CPU mark is the host's perf_counter reading at the boundary (what span() subtracts)
    from dali_nerf.train import loop as training

    clock = iter([12.5, 13.75])
    monkeypatch.setattr(training.time, "perf_counter", lambda: next(clock))
    m0, m1 = t.mark(), t.mark()
    assert (m0, m1) == (12.5, 13.75)
    t.span("forward", m0, m1)
    t.resolve(ph)
    assert ph["forward"] == 2.5 + 1.25


def test_steady_stall_and_bar_show_warmup_apart():
    totals = {"wait": 2.0 + 0.3, "step": 3.0 + 10.0}
    first = (2.0, 3.0)  # first step: 2 s waiting for the first batch in a 3 s step
    assert _steady_stall(totals, first, 5) == pytest.approx(0.03)
    assert _steady_stall(totals, first, 1) is None and _steady_stall(totals, None, 5) is None
    bar = _bar_stall(totals, first)
    assert bar == {"stall": "3.00%", "warmup": "2.00s"}
    assert _bar_stall({"wait": 2.0, "step": 3.0}, first)["stall"] == "n/a"  # only the first step so far


def test_batch_stats_warmup_and_steady_definition(monkeypatch):
    clock = iter([0.0, 0.0, 2.0, 3.0, 3.5, 8.0])  # start, start(same), stop, start, stop, as_dict

    monkeypatch.setattr(base.time, "perf_counter", lambda: next(clock))
    st = base.BatchStats()
    assert st.as_dict()["warmup_s"] is None and st.as_dict()["stall_fraction_steady"] is None
    t = st.start()
    st.start()  # t0 stays the first entry
    st.stop(t, 10)     # first batch: 2 s of warm-up
    t = st.start()
    st.stop(t, 10)     # 0.5 s waiting later on
    d = st.as_dict()   # at 8 s
    assert d["warmup_s"] == 2.0 and d["wait_s"] == 2.5 and d["elapsed_s"] == 8.0
    assert d["stall_fraction"] == 2.5 / 8.0
    assert d["stall_fraction_steady"] == 0.5 / 6.0


def test_trainer_summary_and_printed_json_split_warmup(tmp_path):
    """A 1-rank CPU DDP run: summary.json and the final printed JSON carry the steady stall and
    the warm-up seconds; the source stats carry warmup_s / stall_fraction_steady; phases are host-timed."""
    from dali_nerf.scenegen import make_scene

    scene = make_scene("objects", tmp_path / "scene", width=24, height=24, n_train=4, n_val=1, n_test=1, seed=3)
    cmd = [sys.executable, "-m", "dali_nerf.trainers.ddp", "--config", "configs/ddp_objects.yaml",
           f"scene.path={scene}", f"train.runs_dir={tmp_path / 'runs'}", "name=t", "train.steps=6",
           "train.log_every=3", "train.checkpoint_every=0", "train.eval_images=1", "pipeline.rays_per_batch=256",
           "pipeline.rays_per_run=1024", "model.resolution=16", "model.samples_per_ray=16",
           "model.occupancy_resolution=8", "model.hidden=8", "model.density_components=4", "model.color_components=6"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    printed = json.loads(r.stdout.strip().splitlines()[-1])
    s = json.loads((tmp_path / "runs" / "t" / "summary.json").read_text())
    for k in ("stall_fraction", "stall_fraction_after_first_step", "warmup_wait_s"):
        assert printed[k] == s[k], k
    rows = [json.loads(l) for l in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert s["warmup_wait_s"] == rows[0]["wait_s"] > 0
    # the stalls are the definitions over the per-step rows (the steady one without the first step)
    wait, step = [r["wait_s"] for r in rows], [r["step_s"] for r in rows]
    assert s["stall_fraction"] == pytest.approx(sum(wait) / sum(step), rel=1e-9)
    assert s["stall_fraction_after_first_step"] == pytest.approx(sum(wait[1:]) / sum(step[1:]), rel=1e-9)
    assert s["phase_timing"] == "host" and s["sync_in_backward"] is False
    st = s["source_stats"]  # BatchStats' definitions (sources/base.py)
    assert st["steps"] == 6 and st["warmup_s"] > 0
    assert st["stall_fraction_steady"] == pytest.approx((st["wait_s"] - st["warmup_s"]) / (st["elapsed_s"] - st["warmup_s"]),
                                                        rel=1e-9)
    assert st["stall_fraction"] == pytest.approx(st["wait_s"] / st["elapsed_s"], rel=1e-9)


def test_ddp_comm_hook_times_on_gloo_and_keeps_overlap_under_nccl(tmp_path, monkeypatch):
    """gloo: the host-timed hook (sync_s measured). NCCL: torch's asynchronous allreduce_hook, no
    per-bucket wait (timer.measured False: the all-reduce is inside backward_s)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from dali_nerf.train import runtime as training  # DistEnv, wrap_ddp, dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        env = training.DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))  # "distributed"
        field = torch.nn.Linear(4, 3)
        module, timer = training.wrap_ddp(field, env)
        module(torch.ones(2, 4)).sum().backward()
        assert timer.measured and timer.seconds > 0  # gloo: the timed hook ran and waited

        hooks = []
        monkeypatch.setattr(DistributedDataParallel, "register_comm_hook", lambda self, st, h: hooks.append((st, h)))
        monkeypatch.setattr(training.dist, "get_backend", lambda *a: "nccl")
        _, timer = training.wrap_ddp(torch.nn.Linear(4, 3), env)
        assert hooks == [(None, default_hooks.allreduce_hook)] and timer.measured is False
    finally:
        dist.destroy_process_group()


def test_record_counts_the_training_threads_wait_for_a_core():
    """``runq_s``: the recording thread's run-queue wait over the step. A thread that never sleeps
    is either on a core or waiting for one, so its CPU time plus ``runq_s`` is the step's wall
    time; pinned to one core beside a process that spins on it, it waits about half of a 0.4 s
    step. The affinity is put back after the block."""
    from dali_nerf.data.hostbudget import first_cores, pinned
    from dali_nerf.train.phases import runq_seconds

    if runq_seconds() is None:
        pytest.skip("no /proc/thread-self/schedstat: Linux with schedstats only")
    before = os.sched_getaffinity(0)
    with pinned(first_cores(1)):
        assert len(os.sched_getaffinity(0)) == 1
        # the spinner says when it spins (on our core: it inherited the affinity); a fixed sleep
        # was not enough for an interpreter to start on a loaded machine
        spin = subprocess.Popen([sys.executable, "-c", "import sys, time\nprint('spinning', flush=True)\n"
                                 "t = time.time() + 3\nwhile time.time() < t: pass"], stdout=subprocess.PIPE, text=True)
        try:
            assert spin.stdout.readline().strip() == "spinning"
            t = PhaseTimer("cpu")
            c0 = time.thread_time()
            t.note("overshoot", 0.25)
            t.note("overshoot", 0.5)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.4:
                pass
            rec = t.record(1, 4096)
            ran = time.thread_time() - c0
        finally:
            spin.kill()
            spin.wait()
    assert os.sched_getaffinity(0) == before
    assert rec["runq_s"] + ran == pytest.approx(rec["step_s"], rel=0.05), (rec, ran)
    assert 0.1 < rec["runq_s"] < rec["step_s"], rec
    assert rec["overshoot_s"] == 0.75 and "overshoot_s" not in t.record(2, 4096)  # per step
    with pytest.raises(ValueError, match="record\\(\\) writes itself"):
        t.note("runq", 1.0)


def test_first_cores_names_the_affinity_it_lacks():
    from dali_nerf.errors import ConfigError
    from dali_nerf.data.hostbudget import first_cores

    cpus = sorted(os.sched_getaffinity(0))
    assert first_cores(len(cpus)) == tuple(cpus) and first_cores(1) == (cpus[0],)
    with pytest.raises(ConfigError, match=f"{len(cpus) + 1} cores: this process may run on {len(cpus)}"):
        first_cores(len(cpus) + 1)
