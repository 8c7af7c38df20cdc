"""Training on the global stream: the step's loss normalised by G (so W ranks under DDP take the
step one rank takes on the whole global batch), empty batches under DDP, and a run resumed on
other numbers of ranks (torchrun, gloo, CPU) against the uninterrupted run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from _tiny_scene import tiny_scene

G = 48
STEPS = 6
SIZES = [(12, 10), (11, 10), (1, 1)]  # W = 3: one image a rank, rank 2 holds 1 pixel of 231


def _steps(rank: int, world: int, scene, out: str):
    """STEPS of the trainer's own train_task_step on rank ``rank`` of ``world`` (a gloo group when
    world > 1): a tiny field, DDP, the global-stream RayLoader (B = G / world). Saves the field's
    state and this rank's ray counts to ``out``."""
    import dataclasses

    from dali_nerf.config import Config, ModelConfig
    from dali_nerf.models import build_field, make_optimizer
    from dali_nerf.train.phases import PhaseTimer
    from dali_nerf.train.runtime import DistEnv, wrap_ddp
    from dali_nerf.sources import RayLoader
    from dali_nerf.train.tasks import Task
    from dali_nerf.train.loop import train_task_step

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if world > 1:
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=rank, world_size=world)
        env = DistEnv(rank, world, rank, torch.device("cpu"))
        cfg = Config()
        cfg = dataclasses.replace(cfg, model=ModelConfig(resolution=16, samples_per_ray=16, occupancy_resolution=0,
                                                         hidden=16, density_components=4, color_components=4),
                                  train=dataclasses.replace(cfg.train, lr=0.02, steps=STEPS))
        torch.manual_seed(0)
        field = build_field(cfg.model, torch.tensor([[-4.0] * 3, [4.0] * 3]))
        module, sync = wrap_ddp(field, env)
        opt, sched = make_optimizer(field, cfg)
        loader = RayLoader(scene, rays_per_batch=G // world, rank=rank, world_size=world, seed=9, stream="global",
                           rays_per_run=2 * G // world, num_threads=1, prefetch=1)
        task = Task("ddp", loader, module, field, None, opt, sched)
        timer, counts, losses = PhaseTimer(), [], []
        with loader:
            for step in range(1, STEPS + 1):
                loss, n = train_task_step(cfg, env, task, step, scene, torch.ones(3), {"ddp": sync}, timer)
                timer.resolve()
                counts.append(n)
                losses.append(float(loss))
        torch.save({"field": field.state_dict(), "counts": counts, "losses": losses}, f"{out}.r{rank}")
        if world > 1:
            dist.destroy_process_group()
    finally:
        torch.set_num_threads(threads)


def test_three_ranks_take_the_one_rank_step_and_survive_empty_batches(tmp_path):
    """3 gloo ranks (rank 2's shard is one pixel: its batch is mostly empty) against 1 rank on
    the same global batches: the DDP replicas end bit-identical, and equal to the 1-rank field up to
    floating-point reduction order (the loss is sum x W / G per rank, DDP averages: the gradient
    of G's mean error whatever the counts; each ray jittered by its global position)."""
    scene = tiny_scene(tmp_path / "scene", n=3, sizes=SIZES, kinds=("png_rgb",))
    sys.path.insert(0, os.path.dirname(__file__))
    mp.start_processes(_steps, args=(3, scene, str(tmp_path / "w3")), nprocs=3, join=True, start_method="spawn")
    _steps(0, 1, scene, str(tmp_path / "w1"))
    ref = torch.load(tmp_path / "w1.r0", weights_only=True)
    ranks = [torch.load(tmp_path / f"w3.r{r}", weights_only=True) for r in range(3)]
    counts = [r["counts"] for r in ranks]
    assert all(sum(c) == G for c in zip(*counts)), counts  # the ranks' parts of every step sum to G
    assert 0 in counts[2] and ref["counts"] == [G] * STEPS, counts
    for k, v in ref["field"].items():
        assert all(torch.equal(r["field"][k], ranks[0]["field"][k]) for r in ranks), k  # replicas identical
        assert torch.allclose(ranks[0]["field"][k], v, rtol=1e-4, atol=1e-6), (k, float((ranks[0]["field"][k] - v).abs().max()))
