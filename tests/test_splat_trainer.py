"""The Gaussian-splatting trainer under torchrun (gloo, CPU) on a generated COLMAP scene: one
2-rank run that shares its decoded images between the node's ranks (windows under a small node
budget) and checkpoints, resumed on 1 rank (the trainer alone, without torchrun) to the end (the
image stream continues at the saved global position), summary and renders; the loss of a masked
batch (masked pixels never reach a gradient)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from dali_nerf.train.checkpoint import RUN_FILE, latest_checkpoint, load_file
from dali_nerf.train.resume import load_checkpoint

REPO = Path(__file__).resolve().parent.parent


def _run(nproc, overrides, resume=False):
    """``nproc`` ranks under torchrun; 1: the trainer alone (world size 1, no launcher: a few seconds less)."""
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                                 if nproc > 1 else [])
    cmd = launch + ["trainers/splat.py", "--config", "configs/splat_objects.yaml"] + (["--resume"] if resume else []) + overrides
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert r.returncode == 0, f"exit {r.returncode}\nSTDOUT\n{r.stdout[-3000:]}\nSTDERR\n{r.stderr[-5000:]}"
    return r


def test_two_ranks_then_resume_on_one(tmp_path, capsys):
    from dali_nerf.scenegen import make_scene

    scene = make_scene("objects", tmp_path / "scene", width=32, n_train=14, n_val=1, n_test=2, seed=5, layout="colmap")
    over = [f"scene.path={scene}", f"train.runs_dir={tmp_path / 'runs'}", "name=s", "train.steps=8", "train.stop_after=4",
            "train.checkpoint_every=2", "train.eval_images=1", "train.tensorboard=never", "splat.refine_start=2",
            "splat.refine_every=2", "splat.refine_stop=6", "train.device=cpu", f"images.max_bytes={6 * 32 * 32 * 3}"]
    r = _run(2, over)
    run = tmp_path / "runs" / "s"
    st = load_file(latest_checkpoint(run / "checkpoints"), RUN_FILE)
    assert st["method"] == "splat" and st["world_size"] == 2 and st["stream"] == "images-v1" and st["step"] == 4
    # identical replicas (parameters, Adam state and the densifier's statistics) after densifying at steps 2 and 4
    assert st["ranks"][0]["replica"] == st["ranks"][1]["replica"] and "replicas differ" not in r.stderr
    assert st["ranks"][0]["sources"]["splat"]["position"] == 8  # 4 steps x 2 ranks x 1 image
    first = json.loads((run / "summary.json").read_text())
    src = first["source_stats"]  # the node's 2 ranks shared windows of 3 images (two fit the node's budget)
    assert src["local_ranks"] == 2 and first["world_size"] == 2 and src["window"] == 3
    assert 0 < src["peak_bytes"] <= 6 * 32 * 32 * 3
    n_before = first["gaussians"]
    _run(1, [o for o in over if not o.startswith("train.stop_after")], resume=True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["resumed_from"] == 4 and summary["world_size"] == 1
    assert summary["method"] == "splat" and np.isfinite(summary["test_psnr"]) and summary["renders"]
    assert summary["pipeline"] == "images" and summary["rays_per_batch"] is None  # image batches, not rays
    final = load_checkpoint(latest_checkpoint(run / "checkpoints"), 0)
    assert final["ranks"][0]["sources"]["splat"]["position"] == 12  # continued: 4 more steps of 1 image
    assert final["tasks"]["splat"]["field"]["means"].shape[0] == summary["gaussians"] and n_before > 0
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))
    assert all(r["rays"] == 32 * 32 for r in rows if "loss" in r)
    from dali_nerf.cli.render import main as render  # dali-nerf render, in this process

    assert render(argparse.Namespace(checkpoint=str(run), out=str(tmp_path / "r"), split="test", orbit=0, max_images=1)) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["images"] == 1 and abs(out["psnr"] - summary["test_psnr"]) < 1e-4  # the run's own evaluation, again


def test_masked_pixels_never_reach_the_gradient(tmp_path):
    """The splat trainer's loss on a masked batch (the image loader's, a generated scene with
    occluders): the gradients of every Gaussian parameter are the same whatever the masked pixels
    hold, and differ when the batch's mask is dropped (those pixels then train) or when the kept
    pixels change."""
    _check_masked_gradient(tmp_path, 4117)


def _check_masked_gradient(tmp_path, seed: int) -> None:
    import copy

    import torch

    from dali_nerf.config import load_config
    from dali_nerf.scenegen import make_scene
    from dali_nerf.scenes import scene_from_config
    from dali_nerf.sources.images import ImageLoader
    from dali_nerf.trainers.splat import SplatMethod, initial_gaussians

    print("seed", seed)
    root = make_scene("city", tmp_path / "m", width=32, n_train=3, n_val=1, n_test=0, seed=seed, occluders=True)
    cfg = load_config("splat_objects", [f"scene.path={root}", "scene.format=auto",
                                                         f"pipeline.seed={seed}", "splat.init_points=64"])
    scene = scene_from_config(cfg)
    with ImageLoader(scene, seed=seed, num_threads=1) as ld:
        batch = next(ld)
    mask = batch["mask"]
    assert mask.any() and not mask.all()
    model = initial_gaussians(cfg, scene)
    method = SplatMethod()
    method.background = torch.as_tensor(np.array(scene.background), dtype=torch.float32)
    method.backend = "torch"

    def grads(b):
        m = copy.deepcopy(model)
        loss, mse, _ = method.batch_loss(cfg, m, b)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(mse)
        return [p.grad.clone() for p in m.parameters()]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    rng = np.random.default_rng(seed)
    noise = torch.from_numpy(rng.integers(0, 256, batch["image"].shape, dtype=np.uint8))
    other = dict(batch, image=torch.where(mask[..., None], batch["image"], noise))  # masked pixels replaced
    assert not torch.equal(other["image"], batch["image"])
    g0 = grads(batch)
    assert any(bool(g.abs().sum() > 0) for g in g0)
    assert same(grads(other), g0)  # whatever the masked pixels hold
    unmasked = {k: v for k, v in other.items() if k != "mask"}
    assert not same(grads(unmasked), g0)  # without the mask those pixels train
    kept = dict(batch, image=torch.where(mask[..., None], 255 - batch["image"], batch["image"]))
    assert not same(grads(kept), g0)  # and the kept pixels do


def test_a_masked_scene_trains_and_reports_the_unmasked_psnr(tmp_path):
    """The trainer on a generated scene with occluders and masks (one rank, in this process): its
    batches carry the masks, and the summary leads with the PSNR over the test views' unmasked
    pixels, as the ray trainers' does."""
    from dali_nerf.scenegen import make_scene
    from dali_nerf.trainers.splat import main

    root = make_scene("city", tmp_path / "m", width=32, n_train=6, n_val=1, n_test=2, seed=7, occluders=True)
    rc = main(["--config", "splat_objects", f"scene.path={root}", "scene.format=auto",
               f"train.runs_dir={tmp_path / 'runs'}", "name=m", "train.steps=3", "train.eval_images=1",
               "train.tensorboard=never", "train.device=cpu", "splat.init_points=300"])
    assert rc == 0
    s = json.loads((tmp_path / "runs" / "m" / "summary.json").read_text())
    assert s["psnr_lead"] == "unmasked" and np.isfinite(s["test_psnr_unmasked"]) and np.isfinite(s["test_psnr"])
    assert s["test_psnr_unmasked"] != s["test_psnr"] and s["steps"] == 3
