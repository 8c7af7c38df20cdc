"""The image paths ``dali-nerf bench images`` compares, and one rank's measurement (run as its own
process: ``python -m dali_nerf.bench.imagepaths RANK RANKS PATH SCENE OUT SYNC ...``, with torchrun's
``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` / ``TORCHELASTIC_RUN_ID`` set by the command: the ranks of one node).

* ``ours``: :class:`~dali_nerf.sources.images.ImageLoader` (decoded once per node into memory the
  node's ranks share, batches built ahead by one thread, no worker processes);
* ``workers``: gsplat's default, re-derived (``examples/simple_trainer.py`` + ``datasets/colmap.py``
  Dataset): a torch DataLoader with 4 spawned, persistent worker processes, shuffling the whole
  split on every rank (gsplat has no distributed sampler), each item decoded from its file at
  access (cv2), float32 like gsplat's, pinned;
* ``cache``: gsplat's ``--cache_images`` as a per-process uint8 cache: every rank decodes the
  whole split into its own memory first, then indexes it (no workers).

A rank measures: time to first batch (from building the path to holding its first batch),
images/s with no work between batches (``--batches`` batches after ``--warmup``), and the stall
under an emulated device step (``--step-ms`` of sleep per batch: the share of the wall time spent
in ``next()``); then, at a point every rank of the node reaches, its own PSS plus its worker
processes' (``/proc/<pid>/smaps_rollup``; shared pages split among the processes mapping them, so
the ranks' sum is the node's memory).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import torch

__all__ = ["PATHS", "GsplatStyleDataset", "pss_bytes", "rank_main"]

PATHS = ("ours", "workers", "cache")
WORKERS = 4


class GsplatStyleDataset(torch.utils.data.Dataset):
    """gsplat's Dataset item for a pinhole scene (module doc); ``cache``: decode everything now."""

    def __init__(self, scene, cache: bool = False):
        from dali_nerf.sources.images import intrinsics_matrix, opencv_camtoworld

        self.paths, self.k, self.c2w = list(scene.image_paths), intrinsics_matrix(scene), opencv_camtoworld(scene)
        self.cam = np.zeros(scene.num_images, np.int64) if scene.camera_idx is None else np.asarray(scene.camera_idx)
        self.images = [self._read(i) for i in range(len(self.paths))] if cache else None

    def _read(self, i: int) -> np.ndarray:
        return cv2.cvtColor(cv2.imread(self.paths[i], cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        img = self.images[i] if self.images is not None else self._read(i)
        return {"K": torch.from_numpy(self.k[i]), "camtoworld": torch.from_numpy(self.c2w[i]),
                "image": torch.from_numpy(img if self.images is not None else img.astype(np.float32)),
                "image_id": i, "camera_idx": int(self.cam[i])}


def pss_bytes(pid: int) -> int:
    """PSS of process ``pid`` and its descendants, bytes (0 for a process gone meanwhile)."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            total += next(int(l.split()[1]) for l in f if l.startswith("Pss:")) * 1024
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                for child in f.read().split():
                    total += pss_bytes(int(child))
    except (OSError, StopIteration, ValueError):
        pass
    return total


def _barrier(folder: Path, name: str, rank: int, ranks: int, timeout: float = 1800.0) -> None:
    (folder / f"{name}.{rank}").touch()
    deadline = time.monotonic() + timeout
    while not all((folder / f"{name}.{r}").exists() for r in range(ranks)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench images: rank {rank} waited {timeout:g} s for the others at {name}")
        time.sleep(0.005)


def _source(path: str, scene, rank: int, ranks: int, seed: int):
    if path == "ours":  # the trainers' door: the registry, the plan's threads for LOCAL_WORLD_SIZE ranks
        from dali_nerf.config import load_config
        from dali_nerf.sources.registry import image_source

        cfg = load_config(None, ["method=splat", f"pipeline.seed={seed}", "train.device=cpu"], check_paths=False)
        return image_source(cfg, scene, rank, ranks)
    ds = GsplatStyleDataset(scene, cache=path == "cache")
    g = torch.Generator().manual_seed(seed + rank)
    loader = torch.utils.data.DataLoader(ds, batch_size=1, shuffle=True, generator=g, pin_memory=False,
                                         num_workers=WORKERS if path == "workers" else 0,
                                         persistent_workers=path == "workers",
                                         multiprocessing_context="spawn" if path == "workers" else None)
    return _Forever(loader)


class _Forever:
    """A DataLoader iterated across epochs, as gsplat's trainer does (``iter`` again on StopIteration)."""

    def __init__(self, loader):
        self.loader, self.it = loader, iter(loader)

    def __next__(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)

    def close(self):
        self.it = None


def rank_main(rank: int, ranks: int, path: str, scene_dir: str, out: str, sync: str, batches: int, warmup: int,
              step_ms: float, seed: int) -> dict:
    """One rank's numbers (module doc), written to ``out`` as JSON."""
    from dali_nerf.scenes import load_scene

    sync_dir = Path(sync)
    torch.set_num_threads(1)
    scene = load_scene(scene_dir, "train", format="colmap")
    _barrier(sync_dir, "start", rank, ranks)
    t0 = time.perf_counter()
    src = _source(path, scene, rank, ranks, seed)
    next(src)
    ttfb = time.perf_counter() - t0
    for _ in range(warmup):
        next(src)
    t1 = time.perf_counter()
    for _ in range(batches):
        next(src)
    rate = batches / (time.perf_counter() - t1)
    waited, t2 = 0.0, time.perf_counter()
    for _ in range(batches):
        a = time.perf_counter()
        next(src)
        waited += time.perf_counter() - a
        time.sleep(step_ms / 1000.0)
    stall = waited / (time.perf_counter() - t2)
    _barrier(sync_dir, "measure", rank, ranks)
    pss = pss_bytes(os.getpid())
    _barrier(sync_dir, "measured", rank, ranks)
    res = {"rank": rank, "ranks": ranks, "path": path, "first_batch_s": ttfb, "images_per_s": rate, "stall": stall,
           "pss_bytes": pss}
    Path(out).write_text(json.dumps(res))
    _barrier(sync_dir, "written", rank, ranks)
    src.close()
    return res


if __name__ == "__main__":
    a = sys.argv[1:]
    rank_main(int(a[0]), int(a[1]), a[2], a[3], a[4], a[5], int(a[6]), int(a[7]), float(a[8]), int(a[9]))
