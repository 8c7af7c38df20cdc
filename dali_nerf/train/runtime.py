"""The distributed runtime of a training run: the process group (torchrun's environment), DDP with
a timed all-reduce, the run folder and its scenes, the per-process and per-step seeds.

>>> env = setup_distributed("cpu")          # world size 1 without torchrun
>>> with run_folder(cfg.run_dir, env):      # rank 0 holds the folder's lock for the block
...     scene, eval_scene = load_scenes(cfg, env)
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import List

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from dali_nerf.config import Config
from dali_nerf.errors import ConfigError, DaliNerfError
from dali_nerf.launch_env import group_env, launch_env
from dali_nerf.train.runlock import RunLock
from dali_nerf.models.metrics import SSIM_WINDOW
from dali_nerf.scenes import scene_from_config
from dali_nerf.data.seeds import process_seed, step_seed
from dali_nerf.cli.validate import scan_images

__all__ = ["DistEnv", "setup_distributed", "wrap_ddp", "run_folder", "load_scenes", "seed_everything",
           "step_generator", "gather_codes", "gpu_memory", "to_device", "torch_threads_kept"]


# ---------------------------------------------------------------------------------------------
# distributed setup


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self):
        if self.distributed:
            dist.barrier()


def setup_distributed(device: str = "cpu", torch_threads: int = 0) -> DistEnv:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT: :mod:`dali_nerf.launch_env`, checked before any rendezvous); initialise the
    process group (nccl on GPU, gloo on CPU) when world size > 1. World size 1 runs without
    torchrun. ``device``: cpu | cuda, resolved (``train.device``'s auto and its checks:
    :func:`dali_nerf.data.plan.sampling_device`)."""
    launch = launch_env() if dist.is_initialized() else group_env()
    world, rank, local_rank, local_world = launch.world_size, launch.rank, launch.local_rank, launch.local_world_size
    use_cuda = device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        threads = torch_threads or max(1, (os.cpu_count() or 1) // max(1, local_world))
        torch.set_num_threads(threads)
    if world > 1 and not dist.is_initialized():
        if launch.restart_count > 0 and rank == 0 and launch.agent_store:
            # torchrun shares its rendezvous store with the process group and does not isolate its
            # keys per restart (pytorch/pytorch#135712): the new group may read a dead rank's address
            print("warning: restarted by torchrun with its shared TCPStore; if the process group does not form, "
                  "launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/RELIABILITY.md)", file=sys.stderr, flush=True)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistEnv(rank, world, local_rank, device)


# ---------------------------------------------------------------------------------------------
# gradient-sync timing


class _SyncTimer:
    """Seconds spent in the timed all-reduce hook (gloo); ``measured`` is False under NCCL, where
    the hook does not time (sync overlaps backward and is inside ``backward_s``)."""

    def __init__(self):
        self.seconds = 0.0
        self.measured = True


def _timed_allreduce_hook(state: _SyncTimer, bucket):
    """gloo (CPU): the all-reduce of one bucket, waited for and timed on the host."""
    t0 = time.perf_counter()
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    work = dist.all_reduce(buf, async_op=True)
    work.wait()
    state.seconds += time.perf_counter() - t0
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def wrap_ddp(field: torch.nn.Module, env: DistEnv):
    """DistributedDataParallel with a timing all-reduce hook; returns (module, timer).

    gloo: :func:`_timed_allreduce_hook` (host-timed ``sync_s``). NCCL: torch's own asynchronous
    ``allreduce_hook`` (no per-bucket synchronisation, so communication overlaps backward as DDP
    intends); ``timer.measured`` is False and the all-reduce time is inside ``backward_s``."""
    timer = _SyncTimer()
    if not env.distributed:
        return field, timer
    with warnings.catch_warnings():  # torch 2.13 deprecates the name; its successor still syncs at init
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        ddp = DistributedDataParallel(field, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                  broadcast_buffers=False)
    if dist.get_backend() == "nccl":
        timer.measured = False
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        ddp.register_comm_hook(timer, _timed_allreduce_hook)
    return ddp, timer


def gather_codes(env: DistEnv, code: int) -> List[int]:
    """Every rank's ``code`` (a small int), in rank order: an all-reduce of one-hot rows."""
    if not env.distributed:
        return [int(code)]
    t = torch.zeros(env.world_size, dtype=torch.int64, device=env.device)
    t[env.rank] = int(code)
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


# ---------------------------------------------------------------------------------------------
# the run folder, its scenes, seeds


@contextlib.contextmanager
def run_folder(run_dir: Path, env: DistEnv):
    """Rank 0 creates ``run_dir``, takes its lock (:class:`~dali_nerf.train.runlock.RunLock`: one
    trainer per run folder, a dead one's lock taken over) and checks the folder is writable; the
    lock is held for the block. Every rank learns whether rank 0 could (one collective), so a
    refusal is a one-line error on every rank, never ranks waiting in a barrier for a rank 0 that
    left. Raises :class:`DaliNerfError` (one line) naming the folder."""
    lock, err = None, None
    if env.rank == 0:
        try:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DaliNerfError(f"{run_dir}: output folder is not writable ({e.strerror}); set train.runs_dir to a "
                                    f"writable folder") from None
            lock = RunLock(run_dir).acquire()
            try:
                (run_dir / ".write_test").write_text("ok")
                (run_dir / ".write_test").unlink()
            except OSError as e:
                raise DaliNerfError(f"{run_dir}: output folder is not writable ({e.strerror}); set train.runs_dir to a "
                                    f"writable folder") from None
        except DaliNerfError as e:
            err = e
    try:
        failed = gather_codes(env, int(err is not None))[0]
        if err is not None:
            raise err
        if failed:
            raise DaliNerfError(f"{run_dir}: rank 0 could not take the run folder (its error says why)")
        yield
    finally:
        if lock is not None:
            lock.release()


def load_scenes(cfg: Config, env: DistEnv):
    """(training split, evaluation split). Every check a scan can do happens here, before training
    (and before anything in run_dir is rewritten): both splits parsed, every image header of both
    checked (no decoding)."""
    sc = cfg.scene
    scene, eval_scene = scene_from_config(cfg), scene_from_config(cfg, sc.eval_split)
    small = np.flatnonzero(np.minimum(eval_scene.width, eval_scene.height) < SSIM_WINDOW)
    if len(small):
        i = int(small[0])
        raise ConfigError(f"scene.downscale={sc.downscale}: the {sc.eval_split} images become as small as "
                          f"{int(eval_scene.width[i])}x{int(eval_scene.height[i])} ({os.path.basename(eval_scene.image_paths[i])}), "
                          f"under the {SSIM_WINDOW}x{SSIM_WINDOW} window of the evaluation's SSIM; use a smaller scene.downscale")
    show = env.rank == 0 and sys.stderr.isatty()
    scan_images(scene, progress=show)
    if eval_scene.image_paths != scene.image_paths:
        scan_images(eval_scene, progress=show)
    return scene, eval_scene


def seed_everything(seed: int, rank: int) -> None:
    s = process_seed(seed, rank)
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


def step_generator(seed: int, rank: int, step: int, cell: int = -1, device="cpu") -> torch.Generator:
    """The per-step generator for sampling jitter: a pure function of (seed, rank, step, cell), so
    resumed runs and prefetching do not change training."""
    g = torch.Generator(device=device)
    g.manual_seed(step_seed(seed, rank, step, cell))
    return g


def to_device(batch: dict, device: torch.device) -> dict:
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def gpu_memory(device) -> dict:
    """This process's GPU memory on ``device``: torch's peak allocated and reserved bytes since the
    process started (or since ``torch.cuda.reset_peak_memory_stats``), and the device's used bytes
    now (total - free: also DALI's pools, nvJPEG's buffers and any other process)."""
    free, total = torch.cuda.mem_get_info(device)
    return {"torch_peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "torch_peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "device_used_bytes": int(total - free), "device_total_bytes": int(total)}


@contextlib.contextmanager
def torch_threads_kept():
    """Run the block (a training run: :func:`setup_distributed` sets torch's intra-op threads per
    rank) and give the caller's process its thread count back after it."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
