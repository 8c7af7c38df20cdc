"""Epoch mode across REAL processes: over one epoch every pixel of the split is seen exactly once
across all ranks (each rank builds its own RayLoader with its rank / world size)."""

import os
import sys

import numpy as np
import pytest
import torch.multiprocessing as mp

from _tiny_scene import tiny_scene

SIZES = [(24, 16), (20, 12), (16, 16), (30, 10), (12, 9)]  # uneven shards on purpose


def _worker(rank, world_size, scene, out_dir):
    import torch

    torch.set_num_threads(1)
    from dali_nerf.sources import RayLoader

    with RayLoader(scene, rays_per_batch=100, rank=rank, world_size=world_size, seed=7, mode="epoch",
                   rays_per_run=300, num_threads=1) as L:
        L.set_epoch(0)
        idx = torch.cat([next(L)["indices"] for _ in range(len(L))]).numpy()
        np.save(os.path.join(out_dir, f"rank{rank}.npy"), idx)
        np.save(os.path.join(out_dir, f"meta{rank}.npy"), np.array([len(L), L.num_pixels]))


@pytest.mark.slow  # 6 spawned processes importing torch + DALI: ~20-50 s on 2 busy cores
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_pixel_once_across_ranks(tmp_path, world_size):
    scene = tiny_scene(tmp_path / "scene", n=5, kinds=("png_rgb", "jpg"), sizes=SIZES)
    out = tmp_path / "out"
    out.mkdir()
    sys.path.insert(0, os.path.dirname(__file__))
    mp.start_processes(_worker, args=(world_size, scene, str(out)), nprocs=world_size, join=True,
                       start_method="spawn")
    seen = []
    lens = set()
    for r in range(world_size):
        steps, P = np.load(out / f"meta{r}.npy")
        lens.add(int(steps))
        idx = np.load(out / f"rank{r}.npy")
        assert len(idx) == steps * 100 >= P
        seen.append(idx[:P])  # the epoch's first P_r rays of rank r
    assert len(lens) == 1  # same steps per epoch on every rank (DDP lockstep)
    allidx = np.concatenate(seen)
    w = scene.width[allidx[:, 0]]
    pid = [(int(c), int(r), int(k)) for c, r, k in allidx]
    assert np.all(allidx[:, 2] < w) and np.all(allidx[:, 1] < scene.height[allidx[:, 0]])
    assert len(set(pid)) == len(pid) == scene.num_pixels  # exactly once, none twice
