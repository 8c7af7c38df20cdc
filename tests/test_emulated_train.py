"""train.device=emulated: the trainers' emulated-device mode (dali_nerf/train/emulated.py), and the
named LockstepBarrier it keeps torchrun's ranks in lockstep with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dali_nerf.train.emulation import RAY_FLOATS, DeviceLinks, LockstepBarrier, keeps_up

REPO = Path(__file__).resolve().parent.parent

ATTACH = textwrap.dedent("""
    import json, sys, time
    from dali_nerf.train.emulation import LockstepBarrier, shared_block
    spec, arrived_name, rank, rounds = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    bar = LockstepBarrier.attach(spec)
    shm = shared_block(arrived_name)
    arrived = shm.buf.cast("i")
    W = bar.parties
    bad = 0
    for k in range(1, rounds + 1):
        arrived[rank] = k
        bar.wait(30)
        seen = [arrived[r] for r in range(W)]
        bad += min(seen) < k or max(seen) > k + 1
    arrived.release(); shm.close(); bar.close()
    print("bad", bad)
""")


def test_named_barrier_keeps_independent_processes_in_rounds():
    """Processes that share no parent with the barrier (as torchrun's ranks) open it by name and
    stay in rounds; the creator takes part and unlinks it at the end."""
    from dali_nerf.train.emulation import shared_block

    W, rounds = 3, 200
    bar = LockstepBarrier.named(W)
    arrived_shm = shared_block(size=4 * W)
    arrived = arrived_shm.buf.cast("i")
    for r in range(W):
        arrived[r] = 0
    spec = json.dumps(bar.spec)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ps = [subprocess.Popen([sys.executable, "-c", ATTACH, spec, arrived_shm.name, str(r), str(rounds)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in (1, 2)]
    bad = 0
    for k in range(1, rounds + 1):
        arrived[0] = k
        bar.wait(30)
        seen = [arrived[r] for r in range(W)]
        bad += min(seen) < k or max(seen) > k + 1
    outs = [p.communicate(timeout=60) for p in ps]
    assert [p.returncode for p in ps] == [0, 0], outs
    assert bad == 0 and all(o.strip().endswith("bad 0") for o, _ in outs), outs
    assert "leaked" not in "".join(e for _, e in outs)  # the openers do not unlink what they do not own
    arrived.release()
    arrived_shm.close()
    arrived_shm.unlink()
    name = bar.spec[2]
    bar.close()
    with pytest.raises(FileNotFoundError):
        shared_block(name)  # the creator unlinked it
    import multiprocessing as mp

    with pytest.raises(ValueError):
        LockstepBarrier(mp.get_context("spawn"), 2).spec  # an inherited barrier has no names


def _run(module: str, nproc: int, overrides: list, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module] \
        if nproc > 1 else [sys.executable, "-m", module]
    return subprocess.run(cmd + overrides, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    from dali_nerf.scenegen import make_scene

    return make_scene("objects", tmp_path_factory.mktemp("emu") / "objects", width=32, height=32, n_train=8, n_val=1,
                      n_test=1, seed=3)


@pytest.mark.parametrize("pipeline", ["rays", "rays_sync", "sync_global"])
def test_ddp_emulated_two_ranks(tmp_path, scene, pipeline):
    """torchrun ... trainers/ddp.py train.device=emulated: no model, device waits, real host work;
    the summary compares the source's step with the floor's, and the phases add up: forward is
    the emulated compute, sync the lockstep all-reduce, wait the source."""
    r = _run("dali_nerf.trainers.ddp", 2, [
        "--config", "configs/ddp_objects.yaml", f"scene.path={scene}", f"train.runs_dir={tmp_path}", "name=emu",
        "train.device=emulated", "train.emulated_step_ms=4", "train.emulated_floor_steps=20", "train.steps=60",
        "pipeline.rays_per_batch=512", "pipeline.rays_per_run=2048", f"pipeline.name={pipeline}"])
    assert r.returncode == 0, r.stderr[-4000:]
    assert "leaked" not in r.stderr  # the shared blocks are unlinked by their owner, once
    s = json.loads((tmp_path / "emu" / "summary.json").read_text())
    assert s["device"] == "emulated" and s["label"] == "device compute emulated by a timed wait; host work real"
    assert s["world_size"] == 2 and s["pipeline"] == pipeline and s["grad_bytes"] > 0
    assert s["floor_step_s"] > 0.5e-3 and s["step_over_floor"] == pytest.approx(s["step_s"] / s["floor_step_s"])
    assert len(s["stall_fraction_ranks"]) == 2 and s["barrier_s"] > 0  # measured, not bounded: a busy host slows it
    # the study's one rule, on the slowest rank's stall
    assert s["host_keeps_up"] is keeps_up(max(s["stall_fraction_ranks"]), s["step_over_floor"])
    # rays_sync: nothing samples ahead (its DALI threads at normal priority, never "starved to normal")
    assert s["sampler_priority"] == ("normal" if pipeline == "rays_sync" else "background")
    assert isinstance(s["ranks_starved_to_normal"], list)
    if pipeline in ("rays", "rays_sync"):  # whole runs of 2048 / 512 = 4 steps, from a run boundary
        assert s["timed_steps"] % 4 == 0 and (1 + s["warmup_steps"]) % 4 == 0, s  # the floor's batch came first
        assert s["ranks_starved_to_normal"] == [] or pipeline == "rays"
    assert 0 < s["host_busy"] <= 1.05 and 0 < s["host_busy_floor"] <= 1.05 and s["host_cores"] >= 1
    rows = [json.loads(x) for x in (tmp_path / "emu" / "metrics.jsonl").read_text().splitlines()]
    assert [x["segment"] for x in rows] == ["source"] * 60 + ["floor"] * 25  # the floor after the source closed
    src = [x for x in rows if x["segment"] == "source"][s["warmup_steps"]:]
    for x in src:
        assert x["forward_s"] >= 0.5e-3 * 0.9  # 4 ms per 4096 rays -> 0.5 ms for 512
        assert x["sync_s"] > 0 and x["wait_s"] + x["h2d_s"] + x["forward_s"] + x["sync_s"] <= x["step_s"] + 1e-6
    L, nb = DeviceLinks(), 512 * (RAY_FLOATS * 4 + 24)
    # h2d is the device time asked: the batch's copy, or sync_global's copy of the global batch +
    # scatter; rays: the global stream (the config's default), this rank's part of G = 1024 rays
    # with their positions (68 + 8 bytes a ray)
    h2d = [L.h2d_s(2 * nb) + L.scatter_s(nb, 2) if pipeline == "sync_global" else L.h2d_s(x["rays"] * 76) for x in src]
    assert all(x["h2d_s"] == pytest.approx(h) for x, h in zip(src, h2d)), (src[0], h2d[0])
    if pipeline == "rays":
        assert len({x["rays"] for x in src}) > 1 and all(abs(x["rays"] - 512) < 200 for x in src)
    json.loads(r.stdout.strip().splitlines()[-1])  # the one-line summary on stdout


def test_ss_emulated_one_rank_and_bad_input(tmp_path):
    from dali_nerf.scenegen import make_scene

    city = make_scene("city", tmp_path / "city", width=32, height=24, n_train=12, n_val=2, seed=1)
    r = _run("dali_nerf.trainers.spatial", 1, [
        "--config", "configs/ss_city.yaml", f"scene.path={city}", f"train.runs_dir={tmp_path}", "name=ss",
        "train.device=emulated", "train.steps=30", "train.emulated_floor_steps=10", "pipeline.rays_per_batch=256"])
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads((tmp_path / "ss" / "summary.json").read_text())
    assert s["method"] == "ss" and s["cells_per_rank"] == 4 and s["grad_bytes"] == 0  # 2x2 cells on one rank
    rows = [json.loads(x) for x in (tmp_path / "ss" / "metrics.jsonl").read_text().splitlines()]
    assert all(x["rays"] == 4 * 256 and x["sync_s"] == 0 for x in rows)
    for bad, field in ((["train.emulated_step_ms=0"], "train.emulated_step_ms"), (["--resume"], "--resume")):
        r = _run("dali_nerf.trainers.spatial", 1, ["--config", "configs/ss_city.yaml", f"scene.path={city}",
                                                   f"train.runs_dir={tmp_path}", "name=bad", "train.device=emulated", *bad])
        assert r.returncode == 2 and field in r.stderr and "Traceback" not in r.stderr, r.stderr
