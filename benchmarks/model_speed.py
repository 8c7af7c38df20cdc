"""Model benchmark: ms/step (render fwd + bwd + Adam) and test PSNR vs training wall time.

One process, ``torch.set_num_threads(threads)``; random pixel batches drawn with torch from the
decoded train images (no DALI: this measures the model alone). One rank at 2x the rays per step
approximates the 2-rank DDP setting (each rank 4096 rays, gradients averaged).

    python benchmarks/model_speed.py --scene data/default --rays 8192 --budget 280 \
        --eval-at 30,60,120,200,280 model.resolution=128 model.samples_per_ray=192

Prints one JSON line per evaluation: {"t": train seconds, "step", "ms_per_step", "psnr", ...} and a
final summary line. Evaluation time is excluded from the training clock.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import cv2
import numpy as np
import torch

from dali_nerf.config import Config, apply_overrides, _build, config_to_dict
from dali_nerf.train.fieldsetup import scene_aabb
from dali_nerf.models import build_field, build_occupancy, make_optimizer, psnr, render_image, render_rays, ssim
from dali_nerf.data.rays import rays_from_indices
from dali_nerf.scenes import load_scene


def load_images(scene) -> torch.Tensor:
    """(N, H, W, 3) float32 in [0, 1], RGBA composited over the scene background."""
    out = []
    bg = np.asarray(scene.background, np.float32)
    for p in scene.image_paths:
        im = cv2.imread(p, cv2.IMREAD_UNCHANGED)
        if im is None:
            raise SystemExit(f"{p}: cannot decode")
        im = im.astype(np.float32) / (65535.0 if im.dtype == np.uint16 else 255.0)
        if im.ndim == 2:
            im = np.repeat(im[..., None], 3, -1)
        if im.shape[-1] == 4:
            rgb = im[..., 2::-1]
            a = im[..., 3:4]
            im = rgb * a + bg * (1 - a)
        else:
            im = im[..., ::-1]
        out.append(torch.from_numpy(np.ascontiguousarray(im)))
    return torch.stack(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scene", default="data/default")
    ap.add_argument("--rays", type=int, default=8192, help="rays per step")
    ap.add_argument("--budget", type=float, default=280.0, help="training seconds")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0 = budget only)")
    ap.add_argument("--plan-steps", type=int, default=0, help="steps the lr schedule spans (0 = estimate)")
    ap.add_argument("--eval-at", default="60,120,200,280", help="train seconds at which to evaluate")
    ap.add_argument("--eval-images", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", type=int, default=0, help="print progress every N steps (stderr)")
    ap.add_argument("overrides", nargs="*", help="config key=value (model.*, train.lr ...)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = _build(Config, apply_overrides({}, a.overrides))
    cfg.validate()
    train = load_scene(a.scene, "train")
    test = load_scene(a.scene, "test")
    imgs = load_images(train)
    n, h, w, _ = imgs.shape
    flat = imgs.reshape(-1, 3)
    c2w = torch.tensor(train.c2w)
    k = torch.tensor(train.intrinsics)
    near = float(train.near[0]) if train.near is not None else 2.0
    far = float(train.far[0]) if train.far is not None else 6.0
    bg = torch.as_tensor(train.background, dtype=torch.float32)
    aabb = scene_aabb(train)
    test_imgs = load_images(test)[: a.eval_images]

    torch.manual_seed(a.seed)
    field = build_field(cfg.model, aabb)
    occ = build_occupancy(cfg.model, aabb)
    plan = a.plan_steps or a.steps or 2000
    opt, sched = make_optimizer(field, cfg, total_steps=plan)
    eval_at = sorted(float(x) for x in a.eval_at.split(",") if x)
    print(json.dumps({"config": config_to_dict(cfg)["model"], "lr": cfg.train.lr, "rays": a.rays,
                      "params": sum(p.numel() for p in field.parameters())}), flush=True)

    def evaluate():
        field.eval()
        ps, ss = [], []
        for i in range(test_imgs.shape[0]):
            pred = render_image(field, torch.as_tensor(test.c2w[i]), torch.as_tensor(test.intrinsics[i]),
                                int(test.width[i]), int(test.height[i]), near, far, bg, occupancy=occ,
                                samples=cfg.model.samples_per_ray)
            ps.append(psnr(pred, test_imgs[i]))
            ss.append(ssim(pred, test_imgs[i]))
        field.train()
        return float(np.mean(ps)), float(np.mean(ss))

    clock, step, samples_sum = 0.0, 0, 0
    g_pix = torch.Generator().manual_seed(a.seed)
    last_loss = float("nan")
    while True:
        if a.steps and step >= a.steps:
            break
        if not a.steps and clock >= a.budget:
            break
        t0 = time.perf_counter()
        step += 1
        pix = torch.randint(0, flat.shape[0], (a.rays,), generator=g_pix)
        cam = pix // (h * w)
        rem = pix % (h * w)
        idx = torch.stack([cam, rem // w, rem % w], -1)
        o, d = rays_from_indices(c2w, k, idx)
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
        out = render_rays(field, o, d, near, far, bg, occupancy=occ, samples=cfg.model.samples_per_ray,
                          generator=gen, train=True)
        loss = torch.mean((out["rgb"] - flat[pix]) ** 2)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if occ is not None:
            occ.update(field, step)
        clock += time.perf_counter() - t0
        samples_sum += out["samples"]
        last_loss = float(loss.detach())
        if a.verbose and step % a.verbose == 0:
            print(f"step {step} t {clock:.1f} loss_psnr {-10 * math.log10(last_loss):.2f} samples/ray {out['samples'] / a.rays:.1f}"
                  f" occupied {occ.occupied_fraction if occ is not None else 1:.4f}", file=sys.stderr, flush=True)
        if eval_at and clock >= eval_at[0]:
            while eval_at and clock >= eval_at[0]:
                eval_at.pop(0)
            p, s = evaluate()
            print(json.dumps({"t": round(clock, 1), "step": step, "ms_per_step": round(1000 * clock / step, 1),
                              "samples_per_ray": round(samples_sum / step / a.rays, 1), "train_psnr": round(-10 * math.log10(last_loss), 2),
                              "psnr": round(p, 2), "ssim": round(s, 4),
                              "occupied": round(occ.occupied_fraction, 4) if occ is not None else 1.0}), flush=True)
    p, s = evaluate()
    print(json.dumps({"final": True, "t": round(clock, 1), "step": step, "ms_per_step": round(1000 * clock / max(step, 1), 1),
                      "samples_per_ray": round(samples_sum / max(step, 1) / a.rays, 1), "psnr": round(p, 2), "ssim": round(s, 4)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
