"""Masks against transient occluders: the generated `city` scene with an occluder in every image
(``dali-nerf make-scene city --occluders``: a striped figure somewhere else in every view, masked
by each frame's ``mask_path``), trained twice by the DDP trainer with the same seed, steps and
rays: honouring the masks (``scene.masks=use``) and ignoring them (``scene.masks=ignore``: every
pixel trains). The table compares the held-out PSNR over the unmasked pixels (what both runs
should reproduce) and over the full image.

    python benchmarks/masks_psnr.py --steps 400 --nproc 1
    python benchmarks/masks_psnr.py --steps 300 --rays 1024 model.resolution=32 model.samples_per_ray=32   # smaller

Trailing ``key=value`` arguments are config overrides for both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from dali_nerf.cli.train import torchrun_command
from dali_nerf.scenegen import make_scene

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/ss_city.yaml"  # its model and background for the city scene; method=ddp below


def run(config, overrides, nproc):
    cmd = torchrun_command("dali_nerf.trainers.ddp", nproc, config, overrides)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"the DDP trainer failed:\n{r.stderr[-3000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scene", default="data/city_occluded", help="generated (make-scene city --occluders) when missing")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--rays", type=int, default=2048, help="rays per rank per step")
    ap.add_argument("--runs", default="runs/masks_psnr")
    ap.add_argument("--eval-images", type=int, default=6)
    ap.add_argument("--width", type=int, default=None, help="image width of a generated scene (default: make-scene's)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for both runs")
    args = ap.parse_args(argv)
    scene = Path(args.scene)
    if not scene.exists():
        make_scene("city", scene, occluders=True, width=args.width)
    common = [f"scene.path={scene}", "scene.format=nerfstudio", "scene.eval_split=val", "method=ddp",
              f"train.runs_dir={args.runs}", f"train.steps={args.steps}", "train.checkpoint_every=0",
              f"train.eval_images={args.eval_images}", f"pipeline.rays_per_batch={args.rays}", *args.overrides]
    rows = {}
    for masks in ("use", "ignore"):
        run(CONFIG, common + [f"name={masks}", f"scene.masks={masks}"], args.nproc)
        rows[masks] = json.loads((REPO / args.runs / masks / "summary.json").read_text())
    print(f"city scene with occluders {scene}, DDP {args.nproc} rank(s), {args.steps} steps, {args.rays} rays per rank "
          f"per step, {args.eval_images} val views, {CONFIG} model" + (f", overrides {' '.join(args.overrides)}"
                                                                      if args.overrides else ""))
    print("| training | PSNR unmasked pixels (dB) | PSNR full image (dB) | mean-colour floor (dB) | train s |")
    print("|---|---|---|---|---|")
    for masks, what in (("use", "masks honoured"), ("ignore", "masks ignored")):
        s = rows[masks]
        print(f"| {what} | {s['test_psnr_unmasked']:.2f} | {s['test_psnr']:.2f} | {s['mean_color_psnr']:.2f} | "
              f"{s['train_s']:.1f} |")
    gain = rows["use"]["test_psnr_unmasked"] - rows["ignore"]["test_psnr_unmasked"]
    print(f"unmasked-pixel PSNR gain from the masks: {gain:+.2f} dB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
