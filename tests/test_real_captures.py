"""Real-capture training: the field's space (world / NDC / contracted), backgrounds the
trainer supplies (random, learned), and short 2-rank runs on the generated forward-facing (LLFF)
and unbounded (nerfstudio, outward cameras) scenes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dali_nerf.train.checkpoint import RUN_FILE, latest_checkpoint, load_file
from dali_nerf.config import Config, ModelConfig
from dali_nerf.errors import ConfigError
from dali_nerf.train.resume import load_checkpoint
from dali_nerf.models import build_field, make_optimizer, render_rays
from dali_nerf.models.ray_space import RaySpace, resolve_space
from dali_nerf.data.rays import image_rays
from dali_nerf.cli.render import load_run_space
from dali_nerf.scenes import load_scene
from dali_nerf.trainers.spatial import main as spatial_main
from dali_nerf.train.evaluation import evaluate_field
from dali_nerf.train.fieldsetup import eval_background, scene_aabb, scene_space, train_background

from test_trainers import metrics, run_trainer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    """Tiny generated forward (LLFF, 16 views, 2 held out) and unbounded scenes, and objects."""
    from dali_nerf.scenegen import make_scene

    root = tmp_path_factory.mktemp("real")
    make_scene("forward", root / "forward", width=64, height=48, n_train=16, seed=2)
    make_scene("unbounded", root / "unbounded", width=48, height=36, n_train=24, n_val=2, seed=2)
    make_scene("objects", root / "objects", width=16, height=16, n_train=4, n_val=1, n_test=1, seed=2)
    return root


def _cfg(**model):
    cfg = Config()
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


def test_auto_space_rule_and_config_choice(scenes):
    fwd = load_scene(scenes / "forward", split="train", format="llff")
    unb = load_scene(scenes / "unbounded", split="train")
    obj = load_scene(scenes / "objects", split="train")
    assert [resolve_space("auto", s) for s in (fwd, unb, obj)] == ["ndc", "contract", "world"]
    assert resolve_space("world", fwd) == "world"
    # world space for a scene with an aabb is its box exactly, as before
    assert torch.equal(scene_space(_cfg(), obj).aabb, torch.tensor(np.array(obj.aabb, np.float32)))
    with pytest.raises(ConfigError, match="model.space"):
        ModelConfig(space="sphere").validate("model")


def test_ndc_box_holds_every_training_ray(scenes):
    scene = load_scene(scenes / "forward", split="train", format="llff")
    space = scene_space(_cfg(), scene)
    assert space.kind == "ndc"
    box = space.aabb
    assert box[0, 2] == -1.0 and box[1, 2] == 1.0 and (box[1, :2] >= 1.0).all() and torch.equal(box[0], -box[1])
    for i in range(scene.num_images):
        o, d = image_rays(torch.as_tensor(np.array(scene.c2w[i])), torch.as_tensor(np.array(scene.intrinsics[i])),
                          int(scene.width[i]), int(scene.height[i]))
        kw = space.render_args(o, d, None, None)
        assert kw["near"] == 0.0 and kw["far"] == 1.0 and kw["viewdirs"] is d
        for t in (0.0, 0.5, 0.999):
            p = kw["origins"] + t * kw["directions"]
            assert ((p >= box[0] - 1e-5) & (p <= box[1] + 1e-5)).all()
        # the NDC ray at t hits the world point at depth z = o_z / (1 - t) of the same pixel's ray
        t = 0.7
        p_ndc = kw["origins"] + t * kw["directions"]
        z_world = -1.0 / (1.0 - t)  # LLFF: reference frame = world, near plane 1
        s = (z_world - o[:, 2]) / d[:, 2]
        pw = o + s[:, None] * d
        expect = torch.stack([-scene.intrinsics[i][0] / (scene.width[i] / 2) * pw[:, 0] / pw[:, 2],
                              -scene.intrinsics[i][1] / (scene.height[i] / 2) * pw[:, 1] / pw[:, 2],
                              1 + 2 / pw[:, 2]], -1).float()
        assert torch.allclose(p_ndc, expect, atol=1e-4)


def test_contract_space_warps_samples_into_the_field_box(scenes):
    scene = load_scene(scenes / "unbounded", split="train")
    space = scene_space(_cfg(contract_inner=4.0), scene)
    assert space.kind == "contract"
    assert torch.equal(space.aabb, torch.tensor([[-2.0] * 3, [2.0] * 3]))
    box = scene_aabb(scene)
    half = 0.5 * (box[1] - box[0])
    assert torch.allclose(space.inner[1] - space.inner[0], 8.0 * half) and math.isclose(space.split, float(4 * half.max()), rel_tol=1e-6)
    o, d = image_rays(torch.as_tensor(np.array(scene.c2w[0])), torch.as_tensor(np.array(scene.intrinsics[0])), 48, 36)
    kw = space.render_args(o, d, torch.zeros(o.shape[0], 1), torch.full((o.shape[0], 1), 1e10))
    assert kw["spacing"] == "lin_disp" and kw["warp"] is not None and (kw["far"] == space.far).all()
    seen = []

    class Probe(torch.nn.Module):
        aabb = space.aabb

        def forward(self, x, dd):
            seen.append(x)
            return torch.zeros(x.shape[0]), torch.zeros(x.shape[0], 3)

    render_rays(Probe(), kw.pop("origins"), kw.pop("directions"), kw.pop("near"), kw.pop("far"), torch.ones(3),
                samples=16, train=False, **kw)
    x = torch.cat(seen)
    assert x.abs().max() < 2.0 and x.abs().max() > 1.5  # warped: far points reach the contracted shell
    # state round trip (what checkpoints and dali-nerf render use)
    back = RaySpace.from_state(space.state())
    assert back.kind == "contract" and torch.equal(back.inner, space.inner) and back.far == space.far


def test_per_ray_background_and_learned_background_gets_gradients():
    torch.manual_seed(0)
    field = build_field(ModelConfig(resolution=8, sigma_init=0.01), torch.tensor([[-1.0] * 3, [1.0] * 3]),
                        learned_background=np.array([0.2, 0.5, 0.8], np.float32))
    names = dict(field.named_parameters())
    assert "background_logit" in names and "background_logit" in field.state_dict()
    assert torch.allclose(field.background(), torch.tensor([0.2, 0.5, 0.8]), atol=1e-6)
    opt, _ = make_optimizer(field, _cfg())
    assert any(p is names["background_logit"] for g in opt.param_groups for p in g["params"])
    o = torch.zeros(64, 3) - torch.tensor([0.0, 0.0, 3.0])
    d = torch.nn.functional.normalize(torch.randn(64, 3) * 0.1 + torch.tensor([0.0, 0.0, 1.0]), dim=-1)
    out = render_rays(field, o, d, 0.0, 10.0, field.background(), samples=16, train=False)
    loss = ((out["rgb"] - torch.tensor([0.9, 0.1, 0.3])) ** 2).mean()
    loss.backward()
    assert field.background_logit.grad is not None and field.background_logit.grad.abs().min() > 0
    # (B, 3) backgrounds: each ray over its own colour; a (3,) one equals the same colour repeated
    bgs = torch.rand(64, 3)
    with torch.no_grad():
        per_ray = render_rays(field, o, d, 0.0, 10.0, bgs, samples=16, train=False)
        black = render_rays(field, o, d, 0.0, 10.0, torch.zeros(3), samples=16, train=False)
        one = render_rays(field, o, d, 0.0, 10.0, bgs[5], samples=16, train=False)
        rep = render_rays(field, o, d, 0.0, 10.0, bgs[5].expand(64, 3), samples=16, train=False)
    assert torch.allclose(per_ray["rgb"], black["rgb"] + (1 - black["acc"])[:, None] * bgs, atol=1e-6)
    assert torch.equal(one["rgb"], rep["rgb"])
    assert not torch.allclose(per_ray["rgb"], one["rgb"])


def test_train_and_eval_backgrounds_follow_the_scene_mode(scenes):
    gen = torch.Generator().manual_seed(1)
    white = torch.ones(3)
    rnd = load_scene(scenes / "unbounded", split="train", background="random")
    lrn = load_scene(scenes / "unbounded", split="train")
    assert rnd.background_mode == "random" and lrn.background_mode == "learned"
    field = build_field(ModelConfig(resolution=8), torch.tensor([[-1.0] * 3, [1.0] * 3]), learned_background=np.full(3, 0.3))
    b = train_background(rnd, field, white, gen, 16, "cpu")
    assert b.shape == (16, 3) and b.std() > 0
    again = train_background(rnd, field, white, torch.Generator().manual_seed(1), 16, "cpu")
    assert torch.equal(b, again)  # the step's seeded generator: reproducible
    assert train_background(lrn, field, white, gen, 16, "cpu").requires_grad
    assert torch.allclose(eval_background(field, lrn, "cpu"), torch.full((3,), 0.3), atol=1e-6)
    assert torch.equal(eval_background(field, rnd, "cpu"), torch.as_tensor(np.array(rnd.background)))


def test_spatial_trainer_refuses_a_non_world_space(scenes, tmp_path):
    rc = spatial_main(["--config", str(REPO / "configs/ss_city.yaml"), f"scene.path={scenes / 'forward'}", "scene.format=llff",
               "model.space=ndc", f"train.runs_dir={tmp_path}", "train.steps=1"])
    assert rc == 2


# -------------------------------------------------------------------------------------------
# short 2-rank runs: each generated kind learns in its space, and clearly less without it

SMALL = ["pipeline.rays_per_batch=512", "pipeline.rays_per_run=8192", "model.resolution=32", "model.samples_per_ray=32",
         "model.occupancy_resolution=0", "model.hidden=16", "train.checkpoint_every=0", "train.log_every=50",
         "train.eval_images=0"]


def _run(tmp_path, config, scene, name, steps, *extra):
    run_trainer("dali_nerf.trainers.ddp", 2, [f"scene.path={scene}", f"train.runs_dir={tmp_path}", f"name={name}",
                                               f"train.steps={steps}", *SMALL, *extra],
                extra=["--config", str(REPO / "configs" / config)], timeout=900)
    return json.loads((tmp_path / name / "summary.json").read_text())


@pytest.mark.slow
def test_forward_scene_learns_in_ndc(scenes, tmp_path):
    # NDC against world space on this scene is a benchmark row (docs/BENCHMARKS.md, "Real
    # captures"), not asserted: at this size the two differ by ~0.5 dB (17.07 vs 16.55 measured)
    ndc = _run(tmp_path, "ddp_llff.yaml", scenes / "forward", "ndc", 150, "scene.downscale=1")
    floor = ndc["mean_color_psnr"]
    assert ndc["test_psnr"] > floor + 3.0, (ndc["test_psnr"], floor)
    # the space and the learned background travel in the checkpoint; render rebuilds the same PSNR
    folder = latest_checkpoint(tmp_path / "ndc" / "checkpoints")
    st = load_checkpoint(folder, 0)["tasks"]["ddp"]
    assert st["space"]["kind"] == "ndc" and "background_logit" in st["field"]
    # the learned background is all-reduced (the replicas, background included, are equal on both
    # ranks: their digests) and optimised (moved from white)
    digests = [r["replica"] for r in load_file(folder, RUN_FILE)["ranks"]]
    assert len(digests) == 2 and digests[0] == digests[1], digests
    white = torch.full((3,), 0.999)
    assert (st["field"]["background_logit"] - (torch.log(white) - torch.log1p(-white))).abs().max() > 1e-2
    cfg, field, occ, _, space = load_run_space(tmp_path / "ndc")
    assert space.kind == "ndc"
    eval_scene = load_scene(scenes / "forward", split="test", format="llff")
    _, p, _, _ = evaluate_field(field, occ, eval_scene, cfg, torch.device("cpu"), 0, space=space)
    assert abs(p - ndc["test_psnr"]) < 1e-4


@pytest.mark.slow
def test_unbounded_scene_learns_contracted_and_less_in_world_space(scenes, tmp_path):
    con = _run(tmp_path, "ddp_unbounded.yaml", scenes / "unbounded", "contract", 150)
    world = _run(tmp_path, "ddp_unbounded.yaml", scenes / "unbounded", "world", 150, "model.space=world")
    floor = con["mean_color_psnr"]
    assert con["test_psnr"] > floor + 3.0, (con["test_psnr"], floor)
    # world space's box is the camera rule's (it holds only the outward-looking cameras)
    assert con["test_psnr"] > world["test_psnr"] + 3.0, (con["test_psnr"], world["test_psnr"])
    rows = metrics(tmp_path / "contract")
    assert rows[-1]["step"] == 150
    # random backgrounds: each training ray over its own colour, evaluated over Scene.background.
    # Measured on 2026-12-06 (commit 147b142, 2-core VM), 150 steps: 18.14 dB held-out against the
    # 11.46 dB floor (pipeline.seed 1: 17.65), last/first-10-step loss 0.23 (0.24); after 1 step
    # 10.34 dB. Asserted with the other kinds' +3 dB margin, and the loss at most half.
    rnd = _run(tmp_path, "ddp_unbounded.yaml", scenes / "unbounded", "random", 150, "scene.background=random")
    rows = [r for r in metrics(tmp_path / "random") if "loss" in r]
    assert np.mean([r["loss"] for r in rows[-10:]]) < 0.5 * np.mean([r["loss"] for r in rows[:10]])
    assert rnd["test_psnr"] > rnd["mean_color_psnr"] + 3.0, (rnd["test_psnr"], rnd["mean_color_psnr"])
