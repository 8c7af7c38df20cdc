"""The DDP and SS trainers, run for real under torchrun (gloo on CPU) on tiny generated scenes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dali_nerf.train.checkpoint import RUN_FILE, latest_checkpoint, load_file
from dali_nerf.train.resume import load_checkpoint

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = ["model.resolution=24", "model.samples_per_ray=32", "model.occupancy_resolution=16",
              "model.occupancy_warmup=8", "model.occupancy_every=8", "model.hidden=16",
              "model.sigma_init=0.1", "model.occupancy_threshold=0.005",
              "model.density_components=8", "model.color_components=12"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run_trainer(module, nproc, overrides, *, extra=(), timeout=600, torchrun_args=()):
    if nproc == 1 and not torchrun_args:
        cmd = [sys.executable, "-m", module]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", *(torchrun_args or ["--standalone", f"--nproc_per_node={nproc}"]),
               "-m", module]
    cmd += list(extra) + list(overrides)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO)
    assert r.returncode == 0, f"exit {r.returncode}\nSTDOUT\n{r.stdout[-3000:]}\nSTDERR\n{r.stderr[-5000:]}"
    return r


def metrics(run_dir: Path, name="metrics.jsonl"):
    return [json.loads(l) for l in (run_dir / name).read_text().splitlines() if l.strip()]


def final_params(run_dir: Path, rank=0, task="ddp"):
    st = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"), rank)
    return st["tasks"][task]["field"], st


@pytest.fixture(scope="module")
def objects_scene(tmp_path_factory):
    from dali_nerf.scenegen import make_scene

    root = tmp_path_factory.mktemp("scenes") / "objects"
    make_scene("objects", root, width=32, height=32, n_train=8, n_val=1, n_test=2, seed=3)
    return root


@pytest.fixture(scope="module")
def city_scene(tmp_path_factory):
    from dali_nerf.scenegen import make_scene

    root = tmp_path_factory.mktemp("scenes") / "city"
    make_scene("city", root, width=32, height=24, n_train=16, n_val=2, seed=1)
    return root


def ddp_overrides(scene, runs, name, steps=40, extra=()):
    return ["--config", "configs/ddp_objects.yaml", f"scene.path={scene}", f"train.runs_dir={runs}", f"name={name}",
            f"train.steps={steps}", "train.log_every=10", "train.checkpoint_every=20", "train.eval_images=2",
            "train.lr=0.02", "pipeline.rays_per_batch=512", "pipeline.rays_per_run=4096", *TINY_MODEL, *extra]


def mean_colour_psnr(scene_root, split="test"):
    from dali_nerf.models import psnr
    from dali_nerf.data.imagecache import decode_cache
    from dali_nerf.scenes import load_scene

    sc = load_scene(scene_root, split)
    cache = decode_cache(sc, 0, 1)
    px = torch.from_numpy(np.asarray(cache.pixels)).float() / 255
    return psnr(px.mean(0, keepdim=True).expand_as(px), px)


@pytest.mark.slow
def test_ddp_two_ranks_learns_replicas_identical_and_resume_is_exact(objects_scene, tmp_path):
    runs = tmp_path / "runs"
    # uninterrupted: 40 steps
    run_trainer("dali_nerf.trainers.ddp", 2, ddp_overrides(objects_scene, runs, "full", 40))
    full = runs / "full"
    m = metrics(full)
    assert [r["step"] for r in m] == list(range(1, 41))
    first, last = np.mean([r["loss"] for r in m[:5]]), np.mean([r["loss"] for r in m[-5:]])
    assert last < 0.7 * first, (first, last)
    s = json.loads((full / "summary.json").read_text())
    assert s["world_size"] == 2 and s["method"] == "ddp"
    assert s["test_psnr"] > mean_colour_psnr(objects_scene) + 1.0, s["test_psnr"]
    for k in ("wait", "h2d", "forward", "backward", "sync", "optimizer", "step"):  # rank 0's per-step rows, summed
        assert s["phase_totals_s"][k] == pytest.approx(sum(r[f"{k}_s"] for r in m), rel=1e-9, abs=1e-12), k
    for r in m:  # the phases are parts of the step (host-timed on the CPU)
        assert sum(r[f"{k}_s"] for k in ("wait", "h2d", "forward", "backward", "sync", "optimizer")) <= r["step_s"] * 1.001 + 1e-6, r
    assert s["phase_totals_s"]["sync"] > 0  # gradients were all-reduced
    assert (full / "metrics.rank1.jsonl").is_file() and (full / "config.yaml").is_file()
    assert all((full / "renders" / r).is_file() for r in s["renders"])

    # DDP replicas stay identical: each rank's digest of its field and optimizer, recorded at the
    # checkpoint (the model is stored once)
    p0, st0 = final_params(full, 0)
    _, st1 = final_params(full, 1)
    digests = [r["replica"] for r in load_file(latest_checkpoint(full / "checkpoints"), RUN_FILE)["ranks"]]
    assert len(digests) == 2 and digests[0] == digests[1] and len(digests[0]) == 64, digests
    assert st0["tasks"]["ddp"]["source"]["rank"] == 0 and st1["tasks"]["ddp"]["source"]["rank"] == 1

    # k + resume + k == 2k: same parameters and the same per-step losses
    run_trainer("dali_nerf.trainers.ddp", 2, ddp_overrides(objects_scene, runs, "split", 40, ["train.stop_after=20"]))
    run_trainer("dali_nerf.trainers.ddp", 2, ddp_overrides(objects_scene, runs, "split", 40), extra=["--resume"])
    q0, _ = final_params(runs / "split", 0)
    for k in p0:
        assert torch.equal(p0[k], q0[k]), k
    ms = metrics(runs / "split")
    assert [r["step"] for r in ms] == list(range(1, 41))
    assert [r["loss"] for r in ms] == [r["loss"] for r in m]


@pytest.mark.slow
def test_eval_every_writes_a_psnr_curve_and_does_not_change_training(objects_scene, tmp_path):
    runs = tmp_path / "runs"
    common = ["train.checkpoint_every=0", "train.log_every=4"]
    run_trainer("dali_nerf.trainers.ddp", 1, ddp_overrides(objects_scene, runs, "plain", 12, common))
    run_trainer("dali_nerf.trainers.ddp", 1, ddp_overrides(objects_scene, runs, "curve", 12, [*common, "train.eval_every=5"]))
    plain, curve = metrics(runs / "plain"), metrics(runs / "curve")
    assert not any("eval_psnr" in r for r in plain)  # eval_every=0: evaluated only at the end (summary)
    evals = [r for r in curve if "eval_psnr" in r]
    assert [r["step"] for r in evals] == [5, 10, 12]  # every 5 steps and at the last step
    assert all(np.isfinite(r["eval_psnr"]) and np.isfinite(r["eval_ssim"]) for r in evals)
    s = json.loads((runs / "curve" / "summary.json").read_text())
    # the last row is the final evaluation itself (the same renders, PSNR and SSIM)
    assert evals[-1]["eval_psnr"] == s["test_psnr"] and evals[-1]["eval_ssim"] == s["test_ssim"]
    assert s["test_psnr"] == json.loads((runs / "plain" / "summary.json").read_text())["test_psnr"]
    # the evaluations between steps do not perturb training
    assert [r["loss"] for r in curve if "loss" in r] == [r["loss"] for r in plain]


@pytest.mark.slow
def test_ss_two_ranks_learns_and_fusion_beats_submodels(city_scene, tmp_path):
    runs = tmp_path / "runs"
    ov = ["--config", "configs/ss_city.yaml", f"scene.path={city_scene}", f"train.runs_dir={runs}", "name=ss",
          "train.steps=60", "train.log_every=10", "train.checkpoint_every=0", "train.eval_images=2", "train.lr=0.02",
          "pipeline.rays_per_batch=512", "pipeline.rays_per_run=4096", "partition.grid=[2,2]", *TINY_MODEL]
    run_trainer("dali_nerf.trainers.spatial", 2, ov)
    s = json.loads((runs / "ss" / "summary.json").read_text())
    assert s["method"] == "ss" and s["cells"] == 4 and s["world_size"] == 2  # 2 cells per rank, round-robin
    m0, m1 = metrics(runs / "ss"), metrics(runs / "ss", "metrics.rank1.jsonl")
    for m in (m0, m1):
        assert np.mean([r["loss"] for r in m[-5:]]) < 0.8 * np.mean([r["loss"] for r in m[:5]])
        assert all(r["sync_s"] == 0.0 for r in m)  # no gradient sync in SS
    # Learning, measured against the same run stopped after one step (the untrained field): on
    # 2026-12-06 (commit 147b142, 2-core VM) the fused PSNR went from 15.36 dB after 1 step to 17.90
    # after 60 (pipeline.seed 1 and 2: 17.47, 16.38); asserted: at least 1.25 dB gained, half the
    # gain measured at the config's seed. Not asserted: beating the held-out views' own mean colour
    # (summary mean_color_psnr, 17.99 dB). At this size (32x24, 16 views, a tiny field) the aerial
    # views over the config's grey sky stay just under it, and lower with more steps (150 steps:
    # 17.35; 48x36 with 32 views: 15.9 after 60 steps, 17.8 after 120); benchmarks/ss_vs_ddp.py
    # measures that at full size (SS fused 24.3 dB against a 17.2 dB floor).
    run_trainer("dali_nerf.trainers.spatial", 2, [*ov, "name=ss_step1", "train.steps=1"])
    untrained = json.loads((runs / "ss_step1" / "summary.json").read_text())["fused_psnr"]
    assert s["fused_psnr"] > untrained + 1.25, (s["fused_psnr"], untrained)
    assert np.isfinite(s["mean_color_psnr"]) and s["fused_psnr"] > s["mean_color_psnr"] - 1.0, s
    alone = [a["psnr"] for a in s["submodels_alone"]]
    assert s["fused_psnr"] > max(alone), (s["fused_psnr"], alone)
    assert s["fusion_overhead"] > 0
    assert len(s["acceptance"]) == 2 and all(0 < a < 1 for a in s["acceptance"])  # routing rejected some rays

    # dali-nerf render works on SS runs (fused) too
    out = tmp_path / "r"
    r = subprocess.run([sys.executable, "-m", "dali_nerf", "render", "--checkpoint", str(runs / "ss"), "--out", str(out),
                        "--split", "val"], capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["images"] == 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_node_rendezvous_on_loopback(objects_scene, tmp_path):
    """Multi-node through torchrun's c10d rendezvous: two 'nodes' of one rank each on 127.0.0.1."""
    repo = REPO
    port = _free_port()
    runs = tmp_path / "runs"
    ov = ddp_overrides(objects_scene, runs, "nodes", 6) + ["train.checkpoint_every=0", "train.eval_images=1"]
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=test", "-m", "dali_nerf.trainers.ddp", *ov]
        procs.append(subprocess.Popen(cmd, cwd=repo, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-4000:]
    s = json.loads((runs / "nodes" / "summary.json").read_text())
    assert s["world_size"] == 2
    assert (runs / "nodes" / "metrics.rank1.jsonl").is_file()
