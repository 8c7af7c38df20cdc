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

A rank measures, in two regimes:

* **first phase**: time to first batch (from building the path to holding its first batch),
  images/s with no work between batches (``--batches`` batches after ``--warmup``) and the stall
  under an emulated device step (``--step-ms`` of sleep per batch: the share of the wall time spent
  in ``next()``, the next ``--batches``); then, at a point every rank of the node reaches, its own
  PSS plus its worker processes' (``/proc/<pid>/smaps_rollup``; shared pages split among the
  processes mapping them, so the ranks' sum is the node's memory). ``ours`` serves these batches
  while it still decodes the split (its rate is then the decode rate) as long as they are in the
  first epoch: with fewer images per rank and epoch than ``1 + warmup + 2 batches`` the phase runs
  on into the next epochs; ``cache`` decoded everything before its first batch.
* **steady state**, what a long run lives in: each rank runs on until its path's steady state —
  ``ours``: its next batch is in epoch 1 or later and, kept whole, every image is decoded and its
  decode closed (``stats()["decode_closed"]``); ``cache``: one whole epoch served; ``workers``: no
  run-on (every access decodes its file, in the first epoch as in any later one, so its steady
  state is the same per-access decode, and running on a whole epoch would decode the split
  again) — then, once every rank of the node is there, images/s and the stall over the next
  ``--batches`` batches each, and at a point all ranks reach after them the PSS again, with the
  rank's own PSS by mapping (:func:`pss_by_mapping`).
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

__all__ = ["PATHS", "GsplatStyleDataset", "pss_bytes", "pss_by_mapping", "rank_main"]

PATHS = ("ours", "workers", "cache")
WORKERS = 4
STEADY_WAIT_S = 600.0
"""How long a rank may take to reach its steady state after the first phase (seconds)."""


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


def pss_by_mapping(pid: int, top: int = 40) -> dict:
    """Process ``pid``'s own PSS (not its children's) by mapping, bytes, the ``top`` largest:
    a file by its name (``libtorch_cpu.so``), ``[heap]``, ``[anon]`` (anonymous maps: other malloc
    arenas, thread stacks, numpy and DALI buffers), ``memfd:NAME`` (the node's shared blocks, by the
    name before the first ``-``), ``[stack]``; ``{}`` for a process gone meanwhile."""
    groups: dict = {}
    name = "[anon]"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    where = head[5].strip() if len(head) > 5 else ""
                    if not where:
                        name = "[anon]"
                    elif where.startswith("/memfd:"):
                        name = "memfd:" + where[len("/memfd:"):].split("-")[0]
                    elif where.startswith("/dev/"):  # /dev/zero: a one-rank loader's shared anonymous block
                        name = where.split(" (deleted)")[0]
                    elif where.startswith("/"):
                        name = os.path.basename(where.split(" (deleted)")[0])
                    else:
                        name = where
                elif head and head[0] == "Pss:":
                    groups[name] = groups.get(name, 0) + int(head[1]) * 1024
    except (OSError, ValueError):
        return {}
    return dict(sorted(groups.items(), key=lambda kv: -kv[1])[:top])


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


def _timed(src, batches: int, step_ms: float) -> tuple:
    """``(images/s with no work between batches, stall under a step_ms step)`` over ``batches`` batches each."""
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
    return rate, waited / (time.perf_counter() - t2)


def _run_on(path: str, src, served: int, n: int) -> int:
    """Batches served until ``path``'s steady state (module doc); returns them. ``ours``: its next
    batch is in epoch 1 or later and, with the split kept whole, every image is decoded (the
    loader's ``stats()["decode_closed"]``); ``cache``: one whole epoch served; ``workers``: none."""
    if path == "workers":
        return 0
    limit_s = STEADY_WAIT_S  # a loader that never reports the split decoded is a bug, not a wait
    deadline, extra = time.monotonic() + limit_s, 0
    while not _steady(path, src, served + extra, n):
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench images: {path} did not reach its steady state within {limit_s:g} s")
        if path == "cache" or src.epoch < 1:
            next(src)
            extra += 1
        else:  # in epoch 1 already: the decode thread is giving its memory back (a moment)
            time.sleep(0.005)
    return extra


def _steady(path: str, src, served: int, n: int) -> bool:
    if path == "ours":
        st = src.stats()
        return src.epoch >= 1 and (st["window"] > 0 or st["decode_closed"])
    return served >= n


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
    rate, stall = _timed(src, batches, step_ms)
    served = 1 + warmup + 2 * batches
    _barrier(sync_dir, "measure", rank, ranks)
    pss = pss_bytes(os.getpid())
    _barrier(sync_dir, "measured", rank, ranks)
    served += _run_on(path, src, served, scene.num_images)
    closed = bool(src.stats()["decode_closed"]) if path == "ours" else None
    _barrier(sync_dir, "steady", rank, ranks)  # every rank in its steady state before any is timed there
    steady_rate, steady_stall = _timed(src, batches, step_ms)
    _barrier(sync_dir, "steady-measure", rank, ranks)
    steady_pss, maps = pss_bytes(os.getpid()), pss_by_mapping(os.getpid())
    _barrier(sync_dir, "steady-measured", rank, ranks)
    res = {"rank": rank, "ranks": ranks, "path": path, "first_batch_s": ttfb, "images_per_s": rate, "stall": stall,
           "pss_bytes": pss, "steady_images_per_s": steady_rate, "steady_stall": steady_stall,
           "steady_pss_bytes": steady_pss, "steady_served": served, "steady_decode_closed": closed,
           "steady_pss_maps": maps}
    Path(out).write_text(json.dumps(res))
    _barrier(sync_dir, "written", rank, ranks)
    src.close()
    return res


if __name__ == "__main__":
    a = sys.argv[1:]
    rank_main(int(a[0]), int(a[1]), a[2], a[3], a[4], a[5], int(a[6]), int(a[7]), float(a[8]), int(a[9]))
