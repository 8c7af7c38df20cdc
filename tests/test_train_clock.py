"""The trainer's wall clock: ``train.max_seconds`` (stop after the step that reaches it),
``train.eval_every_s`` (held-out PSNR at fixed points of training time) and
``train.target_psnr`` (stop at the evaluation that reaches it). One rank in-process on the CPU
(a tiny scene and model); two ranks under torchrun for the decision every rank must share."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dali_nerf.train.checkpoint import latest_checkpoint
from dali_nerf.config import load_config
from dali_nerf.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.resolution=12", "model.samples_per_ray=8", "model.occupancy_resolution=8", "model.hidden=8",
        "model.density_components=2", "model.color_components=4", "pipeline.rays_per_batch=256",
        "pipeline.rays_per_run=2048", "train.log_every=1000", "train.checkpoint_every=0", "train.eval_images=1",
        "train.tensorboard=never"]


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    from dali_nerf.scenegen import make_scene

    return make_scene("objects", tmp_path_factory.mktemp("clock") / "scene", width=24, height=24, n_train=6,
                      n_val=1, n_test=1, seed=5)


def _cfg(scene, runs, name, extra):
    return load_config("configs/ddp_objects.yaml", [f"scene.path={scene}", f"train.runs_dir={runs}", f"name={name}",
                                                    f"train.torch_threads={torch.get_num_threads()}", *TINY, *extra])


def _train(cfg) -> dict:
    from dali_nerf.trainers.ddp import DDPMethod
    from dali_nerf.train.loop import train

    return train(cfg, DDPMethod())


def _rows(run: Path, name="metrics.jsonl"):
    return [json.loads(line) for line in (run / name).read_text().splitlines() if line.strip()]


def test_max_seconds_stops_after_the_step_that_reaches_it_and_checkpoints_there(scene, tmp_path):
    s = _train(_cfg(scene, tmp_path, "t", ["train.steps=1000", "train.max_seconds=1.0"]))
    run = tmp_path / "t"
    steps = [r for r in _rows(run) if "loss" in r]
    assert s["stopped_by"] == "max_seconds" and s["steps"] < 1000, s
    assert s["steps"] == steps[-1]["step"] == len(steps)
    # the run stopped at the first step that ended past 1 s of training, not later
    assert 1.0 <= s["train_s"] <= 1.0 + steps[-1]["step_s"] + 0.5, (s["train_s"], steps[-1]["step_s"])
    assert latest_checkpoint(run / "checkpoints").name.endswith(str(s["steps"]))
    assert s["steps_planned"] == 1000  # the schedule still spans train.steps: --resume continues it


def test_eval_every_s_evaluates_at_fixed_points_of_training_time(scene, tmp_path):
    """An evaluation after each step at which a point k x every of training time has passed since
    the last one, and none otherwise; the host's speed does not decide the count: with every =
    1 ms every step passes a point (a step takes longer), with every = 10^6 s none does."""
    every = 1e-3
    s = _train(_cfg(scene, tmp_path, "c", ["train.steps=4", f"train.eval_every_s={every}"]))
    rows = _rows(tmp_path / "c")
    evals = [r for r in rows if "eval_psnr" in r]
    periodic, final = evals[:-1], evals[-1]
    assert [r["step"] for r in periodic] == [1, 2, 3], evals  # the last step's is the final evaluation
    slots = [math.floor(r["train_s"] / every) for r in periodic]
    assert slots[0] >= 1 and all(b > a for a, b in zip(slots, slots[1:])), slots  # one per interval, in order
    assert final["step"] == s["steps"] == 4 and final["train_s"] == s["train_s"] and final["eval_psnr"] == s["test_psnr"]
    assert [c["train_s"] for c in s["eval_curve"]] == [r["train_s"] for r in evals]
    # evaluations are outside the training clock: the wall time holds the training and every evaluation
    assert s["wall_s"] >= s["train_s"] + sum(r["eval_render_s"] for r in periodic) - 0.02, s
    s = _train(_cfg(scene, tmp_path, "n", ["train.steps=3", "train.eval_every_s=1e6"]))
    assert [r["step"] for r in _rows(tmp_path / "n") if "eval_psnr" in r] == [3] and len(s["eval_curve"]) == 1


def test_target_psnr_stops_at_the_evaluation_that_reaches_it(scene, tmp_path):
    s = _train(_cfg(scene, tmp_path, "hit", ["train.steps=60", "train.eval_every=3", "train.target_psnr=1.0"]))
    evals = [r for r in _rows(tmp_path / "hit") if "eval_psnr" in r]
    assert s["stopped_by"] == "target_psnr" and s["steps"] == 3, s
    assert s["target_reached_s"] == evals[0]["train_s"] and evals[0]["eval_psnr"] >= 1.0
    assert latest_checkpoint(tmp_path / "hit" / "checkpoints").name.endswith("3")
    s = _train(_cfg(scene, tmp_path, "miss", ["train.steps=6", "train.eval_every=3", "train.target_psnr=99"]))
    assert s["stopped_by"] == "steps" and s["steps"] == 6 and s["target_reached_s"] is None, s


@pytest.mark.parametrize("override, match", [
    (["train.target_psnr=30"], "needs periodic evaluations"),
    (["train.max_seconds=-1"], "train.max_seconds: must be >= 0"),
    (["train.eval_every_s=.nan"], "train.eval_every_s: must be >= 0"),
])
def test_clock_settings_are_checked(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config("configs/ddp_objects.yaml", override, check_paths=False)


@pytest.mark.slow
def test_two_ranks_stop_and_evaluate_at_the_same_step(scene, tmp_path):
    """Rank 0's clock decides for both (broadcast): the ranks end at the same step (DDP would hang
    otherwise), and rank 0's evaluations are at its points of training time."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "dali_nerf.trainers.ddp", "--config", "configs/ddp_objects.yaml", f"scene.path={scene}",
           f"train.runs_dir={tmp_path}", "name=two", "train.steps=100000", "train.max_seconds=2",
           "train.eval_every_s=0.6", *TINY]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), start_new_session=True)
    try:
        _, err = p.communicate(timeout=150)
    except subprocess.TimeoutExpired:  # ranks that disagree hang in DDP's next all-reduce
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail("the two ranks did not finish in 150 s (did they stop at different steps?)")
    assert p.returncode == 0, err[-3000:]
    run = tmp_path / "two"
    s = json.loads((run / "summary.json").read_text())
    r0 = [x["step"] for x in _rows(run) if "loss" in x]
    r1 = [x["step"] for x in _rows(run, "metrics.rank1.jsonl") if "loss" in x]
    assert s["stopped_by"] == "max_seconds" and r0 == r1 == list(range(1, s["steps"] + 1))
    assert len([x for x in _rows(run) if "eval_psnr" in x]) >= 2
