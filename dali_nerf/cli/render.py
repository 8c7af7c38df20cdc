"""``dali-nerf render``: render a split (beside ground truth, with PSNR) or an orbit from a run.

    dali-nerf render --checkpoint runs/ddp_objects --out renders/ --split test
    dali-nerf render --checkpoint runs/ss_city/checkpoints/step_0002000 --out renders/ --orbit 24

``--checkpoint`` is a run folder (its ``checkpoints/latest`` is used) or a checkpoint step folder.
DDP runs render the one model; SS runs the fused sub-models; splat runs their Gaussians. The field's space (world / NDC /
contracted, ``model.space``) is read from the checkpoint (``tasks.<name>.space``; checkpoints
without it are rebuilt from the config), and a learned background is the run's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import yaml

from dali_nerf.train.checkpoint import (MODEL_FILE, RUN_FILE, cell_file, checkpoint_format, latest_checkpoint, load_file,
                         load_rank_state)
from dali_nerf.config import _build, Config
from dali_nerf.errors import DaliNerfError
from dali_nerf.models import build_field, build_occupancy, render_image
from dali_nerf.models.gaussians import GaussianModel, render_camera
from dali_nerf.models.ray_space import RaySpace
from dali_nerf.partition import Partition
from dali_nerf.scenes import scene_from_config
from dali_nerf.trainers.spatial import build_fused
from dali_nerf.train.evaluation import evaluate_field, write_renders
from dali_nerf.train.fieldsetup import eval_background, scene_space

__all__ = ["load_run", "load_run_space", "orbit_poses", "main"]


def _resolve(path: Path):
    path = Path(path)
    if (path / "checkpoints").is_dir():
        folder = latest_checkpoint(path / "checkpoints")
        run_dir = path
    elif path.name.startswith("step_") and path.is_dir():
        folder, run_dir = path, path.parent.parent
    else:
        raise DaliNerfError(f"{path}: not a run folder or checkpoint step folder; pass runs/<name> or runs/<name>/checkpoints/step_N")
    if folder is None:
        raise DaliNerfError(f"{path}: run has no complete checkpoint yet")
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise DaliNerfError(f"{cfg_path}: missing; the run folder is incomplete")
    cfg = _build(Config, yaml.safe_load(cfg_path.read_text()))
    return cfg, folder, run_dir


def _task_states(folder: Path) -> dict:
    """{task name: its state} of every task of a checkpoint folder, format 2 (``model.pt`` or one
    file per cell, :mod:`dali_nerf.train.resume`) or 1 (one file per rank)."""
    if checkpoint_format(folder) == 2:
        run = load_file(folder, RUN_FILE)
        if run.get("method") == "ss":
            return {f"cell{c}": load_file(folder, cell_file(c))["task"] for c in range(int(run["cells"]))}
        return dict(load_file(folder, MODEL_FILE)["tasks"])
    st0 = load_rank_state(folder, 0)
    tasks = dict(st0["tasks"])
    for r in range(1, int(st0["world_size"])):
        tasks.update(load_rank_state(folder, r)["tasks"])
    return tasks


def load_run_space(path, device="cpu"):
    """(cfg, field, occupancy, scene_train, space) of a run: DDP's model or SS's fused sub-models,
    and the :class:`RaySpace` they were trained in; a splat run's Gaussians (occupancy, space None)."""
    cfg, folder, run_dir = _resolve(Path(path))
    scene = scene_from_config(cfg)
    tasks = _task_states(folder)
    if cfg.method == "splat":  # Gaussians: no ray space, no occupancy grid
        model = GaussianModel(0, cfg.splat.sh_degree)
        model.load_state_dict(tasks["splat"]["field"])
        return cfg, model.to(device).eval(), None, scene, None
    first = next(iter(tasks.values()))
    space = RaySpace.from_state(first["space"]) if "space" in first else scene_space(cfg, scene)
    aabb = space.aabb
    if cfg.method == "ddp":
        fst = tasks["ddp"]["field"]
        field = build_field(cfg.model, aabb, fst["background_logit"].sigmoid() if "background_logit" in fst else None)
        field.load_state_dict(fst)
        occ = build_occupancy(cfg.model, aabb)
        if occ is not None:
            occ.load_state_dict(tasks["ddp"]["occupancy"])
        return cfg, field.to(device).eval(), occ.to(device) if occ is not None else None, scene, space
    partition = Partition.load(run_dir / "partition.json")
    states = {int(name[4:]): t for name, t in tasks.items()}
    field, occ = build_fused(cfg, partition, aabb, states, device)
    return cfg, field, occ, scene, space


def load_run(path, device="cpu"):
    """(cfg, field, occupancy, scene_train) of a run (:func:`load_run_space` without the space)."""
    return load_run_space(path, device)[:4]


def orbit_poses(scene, n: int) -> np.ndarray:
    """(n, 3, 4) c2w on a circle around the scene's up axis through the mean camera height,
    looking at the point the cameras look at on average (OpenGL axes)."""
    up = scene.up.astype(np.float64)
    pos = scene.c2w[:, :, 3].astype(np.float64)
    fwd = -scene.c2w[:, :, 2].astype(np.float64)
    # least-squares point closest to all optical axes
    A = np.zeros((3, 3)); b = np.zeros(3)
    for p, f in zip(pos, fwd):
        P = np.eye(3) - np.outer(f, f)
        A += P; b += P @ p
    target = np.linalg.lstsq(A, b, rcond=None)[0]
    rel = pos - target
    h = float(np.mean(rel @ up))
    radial = rel - np.outer(rel @ up, up)
    r = float(np.mean(np.linalg.norm(radial, axis=1)))
    e1 = radial[0] / max(np.linalg.norm(radial[0]), 1e-9)
    e2 = np.cross(up, e1)
    poses = []
    for k in range(n):
        a = 2 * math.pi * k / n
        p = target + h * up + r * (math.cos(a) * e1 + math.sin(a) * e2)
        z = p - target; z /= np.linalg.norm(z)              # camera looks down -z
        x = np.cross(up, z); x /= max(np.linalg.norm(x), 1e-9)
        y = np.cross(z, x)
        poses.append(np.stack([x, y, z, p], axis=1))
    return np.asarray(poses, np.float32)


def main(args) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg, field, occ, train_scene, space = load_run_space(args.checkpoint, device)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DaliNerfError(f"{out}: cannot create output folder ({e.strerror}); choose a writable --out") from None
    if args.orbit > 0:
        poses = orbit_poses(train_scene, args.orbit)
        K = torch.as_tensor(np.array(train_scene.intrinsics[0]), device=device)
        w, h = int(train_scene.width[0]), int(train_scene.height[0])
        near = float(train_scene.near[0]) if train_scene.near is not None else 0.0
        far = float(train_scene.far[0]) if train_scene.far is not None else 1e3
        bg = eval_background(field, train_scene, device)
        pairs = []
        for p in poses:
            if cfg.method == "splat":
                img = render_camera(field, p, train_scene.intrinsics[0], w, h, bg, cfg.splat.backend).cpu()
            else:
                img = render_image(field, torch.as_tensor(p, device=device), K, w, h, near, far, bg, occupancy=occ,
                                   samples=cfg.model.samples_per_ray, space=space).cpu()
            pairs.append((img, None))
        names = write_renders(pairs, out, prefix="orbit")
        print(f"wrote {len(names)} orbit views to {out}/")
        return 0
    scene = scene_from_config(cfg, args.split)
    splat = None
    if cfg.method == "splat":  # Gaussians render cameras, not rays
        def splat(f, sub, i, w, h, bg):
            return render_camera(f, sub.c2w[i], sub.intrinsics[i], w, h, bg, cfg.splat.backend)
    pairs, p, s, secs = evaluate_field(field, occ, scene, cfg, device, args.max_images, space=space, render=splat)
    names = write_renders(pairs, out, prefix=args.split)
    print(json.dumps({"split": args.split, "images": len(names), "psnr": p, "ssim": s, "render_s": secs, "out": str(out)}))
    return 0
