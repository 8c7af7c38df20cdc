"""Spatial segmentation vs data parallel on the generated `city` scene (docs/BENCHMARKS.md states its target).

Both trainers run configs/ss_city.yaml (model, sampling and loss settings shared) with the same
ranks, the same steps and the same rays per rank per step (SS: ``rays_per_batch`` per cell x
cells per rank), then the table compares held-out PSNR (SS: the fused sub-models) against the
floor (the PSNR of each held-out view's mean colour), wall time and the fusion overhead (fused
render time / one sub-model's).

    python benchmarks/ss_vs_ddp.py --steps 600 --nproc 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from dali_nerf.config import load_config
from dali_nerf.cli.train import torchrun_command
from dali_nerf.scenegen import make_scene

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/ss_city.yaml"


def run(module, config, overrides, nproc):
    cmd = torchrun_command(module, nproc, config, overrides)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{module} failed:\n{r.stderr[-3000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scene", default="data/city", help="generated when missing")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--runs", default="runs/ss_vs_ddp")
    ap.add_argument("--eval-images", type=int, default=6)
    args = ap.parse_args(argv)
    scene = Path(args.scene)
    if not scene.exists():
        make_scene("city", scene)
    cfg = load_config(REPO / CONFIG, [f"scene.path={scene}"])
    rays = cfg.pipeline.rays_per_batch * math.ceil(cfg.partition.num_cells / args.nproc)  # SS: cells round-robin over ranks
    common = [f"scene.path={scene}", f"train.runs_dir={args.runs}", f"train.steps={args.steps}", "train.checkpoint_every=0",
              f"train.eval_images={args.eval_images}", "scene.eval_split=val"]
    run("dali_nerf.trainers.ddp", CONFIG, common + ["method=ddp", "name=ddp", f"pipeline.rays_per_batch={rays}"], args.nproc)
    run("dali_nerf.trainers.spatial", CONFIG, common + ["name=ss"], args.nproc)
    d = json.loads((REPO / args.runs / "ddp" / "summary.json").read_text())
    s = json.loads((REPO / args.runs / "ss" / "summary.json").read_text())
    alone = ", ".join(f"{a['psnr']:.2f}" for a in s["submodels_alone"])
    print(f"city scene {scene}, {args.nproc} ranks, {args.steps} steps, {rays} rays per rank per step "
          f"(SS: {cfg.pipeline.rays_per_batch} per cell), {CONFIG}")
    print("| method | held-out PSNR (dB) | mean-colour floor (dB) | train wall s | stall | notes |")
    print("|---|---|---|---|---|---|")
    print(f"| DDP | {d['test_psnr']:.2f} | {d['mean_color_psnr']:.2f} | {d['wall_s']:.1f} | {100 * d['stall_fraction']:.2f}% | "
          f"one model |")
    print(f"| SS fused | {s['fused_psnr']:.2f} | {s['mean_color_psnr']:.2f} | {s['wall_s']:.1f} | {100 * s['stall_fraction']:.2f}% | "
          f"{s['cells']} cells; sub-models alone: {alone}; fusion overhead {s['fusion_overhead']:.2f}x "
          f"({s['fusion_stats'].get('models_per_point', float('nan')):.2f} models per point); "
          f"acceptance {', '.join(f'{a:.2f}' for a in s['acceptance'] if a is not None)} |")
    print(f"PSNR gap SS - DDP: {s['fused_psnr'] - d['test_psnr']:+.2f} dB (target: within 1 dB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
