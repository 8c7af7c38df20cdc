"""The one training loop, shared by the DDP and the spatial-segmentation trainers.

A *task* is one radiance field trained on one stream of rays: DDP has one task per rank (the
DistributedDataParallel replica of the whole scene), SS has one task per cell the rank owns. The
loop times every step by phase and writes ``runs/<name>/``:

* ``config.yaml``      the resolved config;
* ``metrics.jsonl``    rank 0, one JSON line per step (``metrics.rank<R>.jsonl`` for other ranks):
  ``step, loss, psnr, rays, wait_s, h2d_s, forward_s, backward_s, sync_s, optimizer_s, step_s``;
  with ``train.eval_every`` = N > 0 also a row ``step, eval_psnr, eval_ssim, eval_render_s, train_s``
  every N steps and at the last step (held-out PSNR curve; its time is outside every phase), and
  with ``train.eval_every_s`` = S > 0 the same row at the first step after every S seconds of
  training time (``train_s``: the loop's wall time minus these evaluations');
* ``summary.json``     test PSNR/SSIM (and ``mean_color_psnr``, the floor), stall fraction, rays/s, per-phase totals, wall time,
  training time and why the run stopped (``stopped_by``: steps, stop_after, max_seconds,
  target_psnr), the ``eval_curve`` (PSNR vs training seconds) with periodic evaluations, the GPU
  memory on a GPU (``gpu_memory``), and method specifics (SS: fusion overhead);
* ``checkpoints/``     atomic per-rank checkpoints (:mod:`dali_nerf.checkpoint`);
* ``renders/*.png``    held-out views, prediction beside ground truth.

Gradient sync is timed by a DDP communication hook that performs the all-reduce and records how
long it took; ``backward_s`` excludes it.

:func:`train` is the sequence of named steps: :func:`setup_distributed`, :func:`prepare_run_dir`,
:func:`load_scenes`, :func:`read_resume_state`, :func:`seed_everything`, ``method.build_tasks``
(the batch sources come from :func:`dali_nerf.sources.build_source`), :func:`restore_tasks`,
:func:`run_steps` (the timed loop, checkpoints, periodic evaluation) and
:func:`evaluate_and_summarise`. Seeds come from :mod:`dali_nerf.seeds`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import cv2
import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from .checkpoint import (CheckpointUnreadable, atomic_write_bytes, atomic_write_text, checkpoint_candidates,
                         commit_checkpoint, resume_checkpoint, save_rank_state)
from .cli import run_cli
from .config import Config, config_to_dict, load_config
from .tblog import TBWriter, step_scalars
from .errors import ConfigError, DaliNerfError
from .models import psnr as psnr_fn, render_image, render_rays, ssim as ssim_fn
from .models.metrics import SSIM_WINDOW
from .models.ray_space import RaySpace, build_space
from .imagecache import eval_cache
from .scenes import describe_change, scene_fingerprint, scene_from_config
from .scenes.bounds import scene_bounds
from .seeds import process_seed, step_seed
from .validate import scan_images

__all__ = ["Task", "Method", "DistEnv", "setup_distributed", "train", "trainer_main", "PHASES",
           "evaluate_field", "eval_subset", "write_renders", "scene_aabb", "prepare_run_dir", "load_scenes",
           "read_resume_state", "restore_tasks", "run_steps", "evaluate_and_summarise", "LoopResult",
           "seed_everything", "step_generator", "PhaseTimer", "scene_space", "train_background", "eval_background",
           "learned_background_init", "mean_color_psnr", "train_task_step", "gpu_memory"]

PHASES = ("wait", "h2d", "forward", "backward", "sync", "optimizer")


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


def setup_distributed(device_pref: str = "auto", torch_threads: int = 0) -> DistEnv:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); initialise
    the process group (nccl on GPU, gloo on CPU) when world size > 1. World size 1 runs without
    torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("train.device: cuda requested but no GPU is visible; use train.device=cpu")
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        threads = torch_threads or max(1, (os.cpu_count() or 1) // max(1, local_world))
        torch.set_num_threads(threads)
    if world > 1 and not dist.is_initialized():
        if (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and rank == 0
                and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
            # torchrun shares its rendezvous store with the process group and does not isolate its
            # keys per restart (pytorch/pytorch#135712): the new group may read a dead rank's address
            print("warning: restarted by torchrun with its shared TCPStore; if the process group does not form, "
                  "launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/RELIABILITY.md)", file=sys.stderr, flush=True)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistEnv(rank, world, local_rank, device)


def scene_aabb(scene) -> torch.Tensor:
    """(2, 3) float32 world box of the scene (:func:`dali_nerf.scenes.bounds.scene_bounds`): the
    scene's ``aabb`` when it has one, else the box around every camera's full frustum between near
    and a robust far, else the camera rule. The field's own box depends on ``model.space``
    (:func:`scene_space`)."""
    return torch.tensor(np.asarray(scene_bounds(scene), np.float32))


def scene_space(cfg: Config, scene) -> RaySpace:
    """The field's space for the training split ``scene`` (``model.space``; auto: world for scenes
    with an aabb, ndc for LLFF, contract otherwise; :mod:`dali_nerf.models.ray_space`). Its
    ``aabb`` is the box of the field and the occupancy grid."""
    return build_space(cfg.model.space, scene, np.asarray(scene_aabb(scene), np.float64), cfg.model.contract_inner)


def learned_background_init(scene):
    """(3,) initial learned colour when ``scene.background_mode`` is "learned", else None (pass
    to ``build_field``)."""
    return np.array(scene.background, np.float32) if scene.background_mode == "learned" else None


def train_background(scene, raw_field, color: torch.Tensor, generator, rays: int, device) -> torch.Tensor:
    """The background a training batch is composited over (ARCHITECTURE.md, "Backgrounds the
    trainer supplies"): "color": ``color`` (3,); "random": a fresh uniform colour per ray (B, 3)
    drawn from the step's ``generator``; "learned": the field's learned colour (3,), with grad."""
    mode = scene.background_mode
    if mode == "random":
        return torch.rand((rays, 3), generator=generator, device=device)
    if mode == "learned":
        return raw_field.background()
    return color


def eval_background(field, scene, device) -> torch.Tensor:
    """(3,) background of evaluation renders: the learned colour when the field learned one (and
    the scene asks for it), else ``scene.background`` (random's evaluation colour too)."""
    if scene.background_mode == "learned" and getattr(field, "background_logit", None) is not None:
        return field.background().detach().to(device)
    return torch.as_tensor(np.array(scene.background), device=device)


# ---------------------------------------------------------------------------------------------
# tasks and methods


@dataclass
class Task:
    """One field trained on one ray stream (DDP: the replica; SS: one cell)."""

    name: str                      # "ddp" or "cell3"
    source: object                 # RayLoader or a baseline: iterator of batch dicts
    field: torch.nn.Module         # the (possibly DDP-wrapped) module whose params are trained
    raw_field: torch.nn.Module     # unwrapped field, for rendering and checkpoints
    occupancy: Optional[torch.nn.Module]
    optimizer: torch.optim.Optimizer
    scheduler: Optional[object] = None
    cell: int = -1
    iterator: object = None
    space: Optional[RaySpace] = None  # the field's space (None: world, the rays as they are)

    def batches(self):
        if self.iterator is None:
            self.iterator = iter(self.source)
        return self.iterator


class Method:
    """What differs between DDP and SS. Subclasses live in trainers/. ``space`` is the
    :class:`RaySpace` its fields live in (set by ``build_tasks``; evaluation uses it)."""

    name = "base"
    space: Optional[RaySpace] = None

    def build_tasks(self, cfg: Config, scene, env: DistEnv) -> List[Task]:
        raise NotImplementedError

    def eval_field(self, cfg: Config, tasks: List[Task], env: DistEnv):
        """Rank 0: (field, occupancy) to evaluate; called on every rank (may communicate)."""
        raise NotImplementedError

    def extra_summary(self, cfg, tasks, env, eval_scene, field, occupancy) -> dict:
        return {}


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


class PhaseTimer:
    """Phase durations of one training step, on the host (CPU) or with CUDA events (GPU).

    ``mark()`` returns a boundary: CPU ``time.perf_counter()``; CUDA an event recorded on
    ``torch.cuda.current_stream()`` (torch's stream only: DALI's prefetch kernels on its own
    streams are not waited for, unlike ``torch.cuda.synchronize()``). ``span(phase, a, b,
    minus)`` adds ``(b - a) - minus`` seconds to ``phase`` once resolved; ``host(phase, s)`` adds
    host seconds now (the wait for a batch). ``resolve(ph)`` at the end of the step: CUDA
    synchronises the last recorded event (one wait on torch's stream, not the device) and reads
    ``elapsed_time`` of every span; then adds everything into the dict ``ph``.

    >>> t = PhaseTimer(torch.device("cpu")); a = t.mark(); b = t.mark(); t.span("forward", a, b)
    >>> ph = {"forward": 0.0}; t.resolve(ph); ph["forward"] >= 0
    True
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._spans = []
        self._host = []
        self._last = None

    @property
    def kind(self) -> str:
        """"cuda_events" or "host"."""
        return "cuda_events" if self.cuda else "host"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream())
            self._last = ev
            return ev
        return time.perf_counter()

    def span(self, phase: str, a, b, minus: float = 0.0) -> None:
        self._spans.append((phase, a, b, minus))

    def host(self, phase: str, seconds: float) -> None:
        self._host.append((phase, seconds))

    def resolve(self, ph: dict) -> None:
        if self.cuda and self._last is not None:
            self._last.synchronize()
        for phase, seconds in self._host:
            ph[phase] += seconds
        for phase, a, b, minus in self._spans:
            d = a.elapsed_time(b) / 1000.0 if self.cuda else b - a
            ph[phase] += d - minus
        self._spans, self._host, self._last = [], [], None


# ---------------------------------------------------------------------------------------------
# helpers


def _rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "numpy": torch.from_numpy(np.frombuffer(np.random.get_state()[1].tobytes(), dtype=np.uint8).copy()),
        "numpy_pos": int(np.random.get_state()[2]),
        "python": repr(random.getstate()),
    }


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    keys = np.frombuffer(s["numpy"].numpy().tobytes(), dtype=np.uint32)
    np.random.set_state(("MT19937", keys, s["numpy_pos"], 0, 0.0))
    st = ast.literal_eval(s["python"])
    random.setstate((st[0], tuple(st[1]), st[2]))


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


def _to_device(batch: dict, device: torch.device) -> dict:
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


_WORLD = RaySpace("world", [[0.0] * 3, [0.0] * 3])  # render_args of world space: the rays unchanged


def _near_far(batch: dict, scene):
    if "near" in batch:
        return batch["near"], batch["far"]
    n = batch["origins"].shape[0]
    near = torch.full((n, 1), 0.0, device=batch["origins"].device)
    far = torch.full((n, 1), 1e3, device=batch["origins"].device)
    return near, far


# ---------------------------------------------------------------------------------------------
# evaluation


def eval_subset(scene, max_images: int = 0):
    """The evaluated views: all of ``scene`` (max_images <= 0) or ``max_images`` evenly spaced."""
    n = scene.num_images if max_images <= 0 else min(max_images, scene.num_images)
    return scene.subset(np.linspace(0, scene.num_images - 1, n).round().astype(np.int64)) if n < scene.num_images else scene


@torch.no_grad()
def evaluate_field(field, occupancy, scene, cfg: Config, device, max_images: int = 0, decode=None,
                   space: Optional[RaySpace] = None):
    """Render held-out views; returns (list of (pred, gt) HxWx3 float tensors, psnr, ssim, seconds).

    Args:
        field: radiance field (``forward(x, d) -> sigma, rgb``), eval mode.
        scene: the eval split Scene; images are decoded with the same DALI decode stage.
        space: the field's :class:`RaySpace` (the one it was trained in; None: world).
    """
    sub = eval_subset(scene, max_images)
    cache = decode if decode is not None else eval_cache(sub)
    bg = eval_background(field, scene, device)
    pairs, ps, ss = [], [], []
    t0 = time.perf_counter()
    for i in range(sub.num_images):
        off, w, h, _ = (int(v) for v in cache.layout[i])
        gt = torch.from_numpy(np.array(cache.pixels[off:off + w * h])).reshape(h, w, 3).float() / 255.0
        near = float(sub.near[i]) if sub.near is not None else 0.0
        far = float(sub.far[i]) if sub.far is not None else 1e3
        pred = render_image(field, torch.as_tensor(np.array(sub.c2w[i]), device=device), torch.as_tensor(np.array(sub.intrinsics[i]), device=device),
                            w, h, near, far, bg, occupancy=occupancy, samples=cfg.model.samples_per_ray,
                            space=space).cpu().clamp(0, 1)
        pairs.append((pred, gt))
        ps.append(psnr_fn(pred, gt))
        ss.append(ssim_fn(pred, gt))
    seconds = time.perf_counter() - t0
    return pairs, float(np.mean(ps)), float(np.mean(ss)), seconds


def mean_color_psnr(pairs) -> float:
    """The floor every PSNR is read against: mean over the views of the PSNR of the view's own
    mean colour (a constant image, the best a field that learned nothing but a colour can do).
    ``pairs``: (pred, gt) HxWx3 as :func:`evaluate_field` returns them."""
    return float(np.mean([psnr_fn(gt.mean(dim=(0, 1), keepdim=True).expand_as(gt), gt) for _, gt in pairs]))


def write_renders(pairs, out_dir: Path, prefix: str = "test") -> List[str]:
    """Write ``<prefix>_NNN.png``: prediction | ground truth side by side."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for i, (pred, gt) in enumerate(pairs):
        img = torch.cat([pred, gt], dim=1).numpy() if gt is not None else pred.numpy()
        img = (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)[:, :, ::-1]
        ok, buf = cv2.imencode(".png", img)
        name = f"{prefix}_{i:03d}.png"
        atomic_write_bytes(out_dir / name, buf.tobytes())
        names.append(name)
    return names


# ---------------------------------------------------------------------------------------------
# the loop


class _MetricsWriter:
    """Appends one JSON line per step. On resume the lines up to the checkpoint are kept (a line
    torn by a kill is dropped) and the rest is rewritten identically by the resumed run. A write
    that fails (disk full) is a one-line error naming the file."""

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        try:
            if resume_step > 0 and path.exists():
                kept = []
                for line in path.read_text().splitlines():
                    try:
                        if json.loads(line).get("step", 0) <= resume_step:
                            kept.append(line)
                    except (json.JSONDecodeError, AttributeError):
                        continue
                atomic_write_text(path, "".join(k + "\n" for k in kept))
            elif path.exists():
                path.unlink()
            self.f = open(path, "a")
        except OSError as e:
            raise DaliNerfError(f"{path}: cannot write metrics ({e.strerror}); free disk space or choose a writable train.runs_dir") from None

    def _guard(self, fn, *a):
        try:
            return fn(*a)
        except OSError as e:
            raise DaliNerfError(f"{self.path}: cannot write metrics ({e.strerror}); free disk space or choose a "
                                f"writable train.runs_dir (the last checkpoint is intact: resume with --resume)") from None

    def write(self, rec: dict):
        self._guard(self.f.write, json.dumps(rec) + "\n")

    def flush(self):
        self._guard(self.f.flush)

    def close(self):
        try:
            self.f.close()
        except OSError:
            pass


def _task_state(task: Task) -> dict:
    st = {
        "field": task.raw_field.state_dict(),
        "optimizer": task.optimizer.state_dict(),
        # the scene's fingerprint is stored once per checkpoint ("scene", checked by read_resume_state)
        "source": ({k: v for k, v in task.source.state_dict().items() if k != "scene"}
                   if hasattr(task.source, "state_dict") else {}),
    }
    if task.space is not None:
        st["space"] = task.space.state()  # dali-nerf render rebuilds the same space from it
    if task.occupancy is not None:
        st["occupancy"] = task.occupancy.state_dict()
    if task.scheduler is not None:
        st["scheduler"] = task.scheduler.state_dict()
    return st


def _load_task_state(task: Task, st: dict) -> None:
    task.raw_field.load_state_dict(st["field"])
    task.optimizer.load_state_dict(st["optimizer"])
    if hasattr(task.source, "load_state_dict"):
        task.source.load_state_dict(st["source"])
    if task.occupancy is not None and "occupancy" in st:
        task.occupancy.load_state_dict(st["occupancy"])
    if task.scheduler is not None and "scheduler" in st:
        task.scheduler.load_state_dict(st["scheduler"])


def _save_checkpoint(run_dir: Path, step: int, tasks: List[Task], env: DistEnv, cfg: Config, scene) -> None:
    """Every rank writes its file, then rank 0 commits the step. ``scene``: the training split,
    whose fingerprint (:func:`dali_nerf.scenes.scene_fingerprint`) the file carries as "scene"."""
    state = {"step": step, "rank": env.rank, "world_size": env.world_size, "method": cfg.method,
             "scene": scene_fingerprint(scene), "tasks": {t.name: _task_state(t) for t in tasks}, "rng": _rng_state()}
    save_rank_state(run_dir / "checkpoints", step, env.rank, state)
    env.barrier()
    if env.rank == 0:
        commit_checkpoint(run_dir / "checkpoints", step)
    env.barrier()


def train(cfg: Config, method: Method, resume: bool = False) -> dict:
    """Run training for ``cfg`` with ``method`` on this process's rank; returns the summary
    (rank 0) or {} (other ranks). ``train.device=emulated`` runs the emulated-device mode
    (:func:`dali_nerf.emulated_train.train_emulated`: no model, device work as timed waits)."""
    threads = torch.get_num_threads()  # setup_distributed sets it per rank; a caller's process gets it back
    try:
        return _train(cfg, method, resume)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: Config, method: Method, resume: bool) -> dict:
    if cfg.train.device == "emulated":
        from dali_nerf.emulated_train import train_emulated

        return train_emulated(cfg, method, resume)
    env = setup_distributed(cfg.train.device, cfg.train.torch_threads)
    prepare_run_dir(cfg.run_dir, env)
    scene, eval_scene = load_scenes(cfg, env)
    resume, saved, folder = read_resume_state(cfg.run_dir, env, resume, scene)
    seed_everything(cfg.pipeline.seed, env.rank)
    tasks = method.build_tasks(cfg, scene, env)
    start_step = restore_tasks(cfg, tasks, saved, folder, env)
    result = run_steps(cfg, method, env, tasks, scene, eval_scene, start_step, resume)
    summary = evaluate_and_summarise(cfg, method, env, tasks, eval_scene, result)
    env.barrier()
    if env.distributed:
        dist.destroy_process_group()
    return summary


def prepare_run_dir(run_dir: Path, env: DistEnv) -> None:
    """Rank 0 creates ``run_dir`` and checks it is writable (a one-line error if not)."""
    if env.rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / ".write_test").write_text("ok")
            (run_dir / ".write_test").unlink()
        except OSError as e:
            raise DaliNerfError(f"{run_dir}: output folder is not writable ({e.strerror}); set train.runs_dir to a writable folder") from None
    env.barrier()


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


def _gather_codes(env: DistEnv, code: int) -> List[int]:
    """Every rank's ``code`` (a small int), in rank order: an all-reduce of one-hot rows."""
    if not env.distributed:
        return [int(code)]
    t = torch.zeros(env.world_size, dtype=torch.int64, device=env.device)
    t[env.rank] = int(code)
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def read_resume_state(run_dir: Path, env: DistEnv, resume: bool, scene=None):
    """``(resume, state, folder)``: this rank's checkpoint state (read ``weights_only`` and checked
    before the expensive setup) when resuming, else ``(False, None, None)``. A worker group
    restarted by torchrun ``--max-restarts`` resumes from the last checkpoint by itself.

    The folder is the newest committed checkpoint every rank can read
    (:func:`dali_nerf.checkpoint.resume_checkpoint`): a missing, truncated or corrupt rank file
    makes all ranks fall back to the previous checkpoint, each rank warning (one line on stderr)
    about its own bad file. Refused (one line, nothing written): no checkpoint; none complete; a
    crafted file; another world size; a training split ``scene`` whose fingerprint differs from
    the one saved (images added or removed, sizes, cameras or downscale changed). A checkpoint
    written before fingerprints were saved resumes without the scene check.
    """
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    ckpt_root = run_dir / "checkpoints"
    if restarted and checkpoint_candidates(ckpt_root):
        resume = True
    if not resume:
        return False, None, None
    current = scene_fingerprint(scene) if scene is not None else None

    def check(st, folder: Path):
        path = folder / f"rank{env.rank}.pt"
        missing = [k for k in ("step", "world_size", "tasks", "rng") if not isinstance(st, dict) or k not in st]
        if missing:
            raise CheckpointUnreadable(path, f"not a dali_nerf training checkpoint (no {', '.join(missing)})")
        if st["world_size"] != env.world_size:
            raise DaliNerfError(f"{folder}: saved with world size {st['world_size']}, now {env.world_size}; resume with the same number of ranks")
        change = describe_change(st.get("scene"), current) if current is not None else None
        if change is not None:
            raise DaliNerfError(f"{scene.root}: changed since the checkpoint {folder} was written: {change}; resume with the "
                                f"scene the run was trained on, or start a new run (another name=, without --resume)")

    folder, st, skipped = resume_checkpoint(ckpt_root, env.rank, check, lambda code: _gather_codes(env, code))
    for bad in skipped:
        print(f"warning: {bad.path}: {bad.reason}; every rank resumes from the previous complete checkpoint {folder} "
              f"(step {st['step']})", file=sys.stderr, flush=True)
    return True, st, folder


def restore_tasks(cfg: Config, tasks: List[Task], st: Optional[dict], folder, env: DistEnv) -> int:
    """Load the checkpoint ``st`` (if any) into the tasks and the RNGs, then rank 0 writes the
    resolved ``config.yaml``. Returns the step to continue after (0 for a new run). On any error
    the tasks' sources are closed."""
    start_step = 0
    try:
        if st is not None:
            try:
                for t in tasks:
                    _load_task_state(t, st["tasks"][t.name])
                _set_rng_state(st["rng"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                lines = [l.strip() for l in str(e).splitlines() if l.strip()]
                what = next((l for l in lines if l.startswith(("size mismatch", "Missing key", "Unexpected key"))),
                            lines[0] if lines else "")[:200]
                raise DaliNerfError(f"{folder / f'rank{env.rank}.pt'}: does not match this run's config ({type(e).__name__}: {what}); "
                                    f"resume with the config the run was saved with") from None
            start_step = int(st["step"])
        if env.rank == 0:
            atomic_write_text(cfg.run_dir / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    except BaseException:
        _close_sources(tasks)
        raise
    return start_step


def _close_sources(tasks: List[Task]) -> None:
    for t in tasks:
        if hasattr(t.source, "close"):
            t.source.close()


@dataclass
class LoopResult:
    """What the timed loop measured (the summary's inputs)."""

    start_step: int
    end_step: int
    totals: dict                  # seconds per phase and "step", summed over the steps run
    first_step_wait: Optional[tuple]  # (wait_s, step_s) of the first step run
    rays_total: int
    last: dict                    # the last step's metrics row
    wall: float                   # seconds from the loop's start to its last checkpoint
    source_stats: list            # stats() of each task's source
    phase_timing: str = "host"    # PhaseTimer.kind: "host" or "cuda_events"
    sync_measured: bool = True    # False under NCCL: the all-reduce is inside backward_s
    train_s: float = 0.0          # training time: wall minus periodic evaluations (the clock of max_seconds)
    stopped_by: str = "steps"     # steps | stop_after | max_seconds | target_psnr
    evals: list = dataclasses.field(default_factory=list)  # rank 0's periodic evaluation rows (with train_s)
    target_reached_s: Optional[float] = None   # training seconds at the evaluation that reached train.target_psnr


def _steady_stall(totals: dict, first_step_wait, steps_run: int):
    """Wait / step time over the steps after the run's first (whose wait is the warm-up: plugin
    load, pipeline build, first run); None with fewer than 2 steps."""
    if first_step_wait is None or steps_run < 2:
        return None
    return (totals["wait"] - first_step_wait[0]) / max(totals["step"] - first_step_wait[1], 1e-9)


def _bar_stall(totals: dict, first_step_wait) -> dict:
    """The progress bar's stall fields: the steady stall (after the first step) and the warm-up
    seconds (the first step's wait), shown apart."""
    if first_step_wait is None:
        return {}
    steady = _steady_stall(totals, first_step_wait, 2)
    rest = totals["step"] - first_step_wait[1]
    return {"stall": f"{100 * steady:.2f}%" if rest > 0 else "n/a", "warmup": f"{first_step_wait[0]:.2f}s"}


def _progress_bar(cfg: Config, method: Method, env: DistEnv, start_step: int):
    if env.rank == 0 and sys.stderr.isatty() or os.environ.get("DALI_NERF_PROGRESS") == "1" and env.rank == 0:
        return tqdm(total=cfg.train.steps, initial=start_step, desc=f"{method.name} x{env.world_size}", dynamic_ncols=True,
                    mininterval=0.5 if sys.stderr.isatty() else 15.0)
    return None


def train_task_step(cfg: Config, env: DistEnv, task: Task, step: int, scene, bg, sync_timers, timer: "PhaseTimer"):
    """One optimisation step of one task, its phases recorded in ``timer`` (resolved by the
    caller at the end of the step); returns (loss tensor, rays)."""
    t0 = time.perf_counter()
    batch = next(task.batches())
    t1 = time.perf_counter()
    timer.host("wait", t1 - t0)
    m1 = t1 if not timer.cuda else timer.mark()
    batch = _to_device(batch, env.device)
    m2 = timer.mark()
    near, far = _near_far(batch, scene)
    gen = step_generator(cfg.pipeline.seed, env.rank, step, task.cell, device=env.device)
    b = int(batch["origins"].shape[0])
    bg_b = train_background(scene, task.raw_field, bg, gen, b, env.device)
    kw = (task.space or _WORLD).render_args(batch["origins"], batch["directions"], near, far)  # world -> field space
    out = render_rays(task.field, kw.pop("origins"), kw.pop("directions"), kw.pop("near"), kw.pop("far"), bg_b,
                      occupancy=task.occupancy, samples=cfg.model.samples_per_ray, generator=gen, train=True, **kw)
    loss = torch.mean((out["rgb"] - batch["rgb"]) ** 2)
    m3 = timer.mark()
    sync_timer = sync_timers.get(task.name)
    s0 = sync_timer.seconds if sync_timer is not None else 0.0
    task.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    m4 = timer.mark()
    sync = (sync_timer.seconds - s0) if sync_timer is not None else 0.0
    task.optimizer.step()
    if task.scheduler is not None:
        task.scheduler.step()
    if task.occupancy is not None:
        task.occupancy.update(task.raw_field, step)
    m5 = timer.mark()
    timer.span("h2d", m1, m2)
    timer.span("forward", m2, m3)
    timer.span("backward", m3, m4, sync)
    timer.host("sync", sync)
    timer.span("optimizer", m4, m5)
    return loss.detach(), int(batch["origins"].shape[0])


class _PeriodicEval:
    """``train.eval_every``: held-out PSNR of the current field(s) every N steps, as a metrics row
    ``{"step", "eval_psnr", "eval_ssim", "eval_render_s"}`` (rank 0). Every rank calls it (the SS
    method gathers the sub-models); the views are decoded once. Its time is outside every phase."""

    def __init__(self, cfg: Config, method: Method, env: DistEnv, tasks: List[Task], eval_scene):
        self.cfg, self.method, self.env, self.tasks, self.eval_scene = cfg, method, env, tasks, eval_scene
        self.views = None

    def __call__(self, step: int) -> Optional[dict]:
        field, occupancy = self.method.eval_field(self.cfg, self.tasks, self.env)
        row = None
        if self.env.rank == 0:
            n = self.cfg.train.eval_images
            if self.views is None:
                self.views = eval_cache(eval_subset(self.eval_scene, n))
            was_training = field.training
            field.eval()
            _, p, s, seconds = evaluate_field(field, occupancy, self.eval_scene, self.cfg, self.env.device, n,
                                              decode=self.views, space=self.method.space)
            field.train(was_training)
            row = {"step": step, "eval_psnr": p, "eval_ssim": s, "eval_render_s": seconds}
        self.env.barrier()  # the other ranks wait here, not inside the next step's timed phases
        return row


class _TrainClock:
    """``train.max_seconds`` / ``eval_every_s`` / ``target_psnr``: rank 0's training time (the
    loop's wall time minus the periodic evaluations', :attr:`paused`) decides; with several ranks
    the decision is broadcast from rank 0 (one small collective per step, only when one of the
    three is set), so every rank stops or evaluates at the same step."""

    def __init__(self, cfg: Config, env: DistEnv):
        t = cfg.train
        self.max_s, self.every_s, self.target = float(t.max_seconds), float(t.eval_every_s), float(t.target_psnr)
        self.env = env
        self.t0 = time.perf_counter()
        self.paused = 0.0
        self.next_eval = self.every_s

    def seconds(self) -> float:
        return time.perf_counter() - self.t0 - self.paused

    def agree(self, *flags: bool) -> List[bool]:
        """Rank 0's ``flags`` on every rank."""
        if not self.env.distributed:
            return [bool(f) for f in flags]
        dev = self.env.device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=dev)
        dist.broadcast(t, src=0)
        return [bool(v) for v in t.tolist()]

    def due(self) -> List[bool]:
        """[stop (max_seconds reached), evaluate (an eval_every_s point passed)] after a step."""
        if not (self.max_s or self.every_s):
            return [False, False]
        s = self.seconds()
        stop = bool(self.max_s) and s >= self.max_s
        evaluate = bool(self.every_s) and s >= self.next_eval
        while self.every_s and self.next_eval <= s:
            self.next_eval += self.every_s
        return self.agree(stop, evaluate)


def run_steps(cfg: Config, method: Method, env: DistEnv, tasks: List[Task], scene, eval_scene, start_step: int,
              resume: bool) -> LoopResult:
    """The timed loop from ``start_step + 1`` to the last step: metrics rows, progress, periodic
    checkpoints and evaluations, the final checkpoint. Closes the tasks' sources."""
    metrics_name = "metrics.jsonl" if env.rank == 0 else f"metrics.rank{env.rank}.jsonl"
    writer = _MetricsWriter(cfg.run_dir / metrics_name, start_step)
    tb = TBWriter(cfg.run_dir, cfg.train.tensorboard if env.rank == 0 else "never",
                  purge_step=start_step + 1 if start_step else None)
    bar = _progress_bar(cfg, method, env, start_step)
    periodic_eval = _PeriodicEval(cfg, method, env, tasks, eval_scene)
    bg = torch.as_tensor(np.array(scene.background), device=env.device)
    totals = {p: 0.0 for p in PHASES}
    totals["step"] = 0.0
    first_step_wait = None
    rays_total = 0
    sync_timers = getattr(method, "sync_timers", {})
    t_start = time.perf_counter()
    timer = PhaseTimer(env.device)
    last = {}
    end_step = min(cfg.train.stop_after or cfg.train.steps, cfg.train.steps)
    stopped_by = "stop_after" if end_step < cfg.train.steps else "steps"
    eval_every = cfg.train.eval_every
    clock = _TrainClock(cfg, env)
    evals, target_reached_s, saved_step = [], None, None
    try:
        for step in range(start_step + 1, end_step + 1):
            ph = {p: 0.0 for p in PHASES}
            t_step = time.perf_counter()
            loss_sum, nrays, losses = 0.0, 0, []
            for task in tasks:
                loss, n = train_task_step(cfg, env, task, step, scene, bg, sync_timers, timer)
                losses.append(loss)
                nrays += n
            timer.resolve(ph)  # CUDA: the one wait of the step, on its last event
            for loss in losses:
                loss_sum += float(loss)
            step_s = time.perf_counter() - t_step
            loss_v = loss_sum / len(tasks)
            rec = {"step": step, "loss": loss_v, "psnr": -10.0 * math.log10(max(loss_v, 1e-12)), "rays": nrays}
            rec.update({f"{p}_s": ph[p] for p in PHASES})
            rec["step_s"] = step_s
            writer.write(rec)
            if first_step_wait is None:
                first_step_wait = (ph["wait"], step_s)
            for p in PHASES:
                totals[p] += ph[p]
            totals["step"] += step_s
            rays_total += nrays
            last = rec
            # the steady stall (after the run's first step) and the warm-up apart, as the bar shows them
            tb.scalars(step, step_scalars(rec, stall_fraction=_steady_stall(totals, first_step_wait, step - start_step),
                                          rays_per_s=rays_total * env.world_size / max(totals["step"], 1e-9))
                       | {"loader/warmup_s": first_step_wait[0]})
            if bar is not None:
                bar.update(1)
                if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                    bar.set_postfix(**_bar_stall(totals, first_step_wait), loss=f"{loss_v:.4f}", psnr=f"{rec['psnr']:.1f}",
                                    Mrays=f"{rays_total / max(totals['step'], 1e-9) / 1e6 * env.world_size:.2f}")
            if step % cfg.train.log_every == 0:
                writer.flush()
                tb.flush()
                if bar is None and env.rank == 0:
                    print(f"step {step}/{cfg.train.steps} loss {loss_v:.5f} psnr {rec['psnr']:.2f}", flush=True)
            stop, timed_eval = clock.due()
            if stop:
                end_step, stopped_by = step, "max_seconds"
            if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0 and step != end_step:
                writer.flush()
                _save_checkpoint(cfg.run_dir, step, tasks, env, cfg, scene)
                saved_step = step
            if (timed_eval or (eval_every and step % eval_every == 0)) and step != end_step:
                train_s = clock.seconds()
                t_eval = time.perf_counter()
                row = periodic_eval(step)
                clock.paused += time.perf_counter() - t_eval
                hit = False
                if row is not None:
                    row["train_s"] = train_s
                    writer.write(row)
                    writer.flush()
                    evals.append(row)
                    hit = clock.target > 0 and row["eval_psnr"] >= clock.target
                if clock.target > 0 and clock.agree(hit)[0]:
                    end_step, stopped_by, target_reached_s = step, "target_psnr", train_s
            if step == end_step:
                break
        wall = time.perf_counter() - t_start
        train_s = clock.seconds()
        writer.flush()
        if (end_step > start_step or resume) and saved_step != end_step:
            _save_checkpoint(cfg.run_dir, end_step, tasks, env, cfg, scene)
    finally:
        writer.close()
        tb.close()
        if bar is not None:
            bar.close()
        source_stats = [t.source.stats() if hasattr(t.source, "stats") else {} for t in tasks]
        _close_sources(tasks)
    return LoopResult(start_step, end_step, totals, first_step_wait, rays_total, last, wall, source_stats,
                      timer.kind, all(t.measured for t in sync_timers.values()), train_s, stopped_by, evals,
                      target_reached_s)


def evaluate_and_summarise(cfg: Config, method: Method, env: DistEnv, tasks: List[Task], eval_scene,
                           r: LoopResult) -> dict:
    """Every rank may take part in gathering the field(s); rank 0 renders the held-out views,
    writes the renders and ``summary.json`` (and, with ``train.eval_every``, the last
    ``eval_psnr`` row of metrics.jsonl) and returns the summary; other ranks return {}."""
    field, occupancy = method.eval_field(cfg, tasks, env)
    if env.rank != 0:
        return {}
    sc = cfg.scene
    field.eval()
    pairs, p, s, seconds = evaluate_field(field, occupancy, eval_scene, cfg, env.device, cfg.train.eval_images,
                                          space=method.space)
    renders = write_renders(pairs, cfg.run_dir / "renders", prefix=sc.eval_split)
    with TBWriter(cfg.run_dir, cfg.train.tensorboard) as tb:
        for i, (pred, gt) in enumerate(pairs):
            tb.image(r.end_step, f"{sc.eval_split}/{i}", torch.cat([pred, gt], 1))  # prediction | ground truth
        tb.scalars(r.end_step, {f"eval/{sc.eval_split}_psnr": p, f"eval/{sc.eval_split}_ssim": s})
    periodic = bool(cfg.train.eval_every or cfg.train.eval_every_s)
    if periodic:
        _append_metrics_row(cfg.run_dir / "metrics.jsonl",
                            {"step": r.end_step, "eval_psnr": p, "eval_ssim": s, "eval_render_s": seconds,
                             "train_s": r.train_s})
    totals, steps_run = r.totals, r.end_step - r.start_step
    summary = {
        "name": cfg.name, "method": method.name, "world_size": env.world_size, "device": str(env.device),
        "steps": r.end_step, "steps_planned": cfg.train.steps, "steps_this_run": steps_run, "resumed_from": r.start_step,
        "rays_per_batch": cfg.pipeline.rays_per_batch, "pipeline": cfg.pipeline.name,
        "test_psnr": p, "test_ssim": s, "mean_color_psnr": mean_color_psnr(pairs), "eval_split": sc.eval_split, "eval_images": len(pairs),
        "eval_render_s": seconds,
        "final_train_loss": r.last.get("loss"),
        "phase_totals_s": {p_: totals[p_] for p_ in PHASES} | {"step": totals["step"]},
        "stall_fraction": totals["wait"] / max(totals["step"], 1e-9),
        # the first step includes building the DALI pipeline and the first sampling run
        "stall_fraction_after_first_step": _steady_stall(totals, r.first_step_wait, steps_run),
        "warmup_wait_s": r.first_step_wait[0] if r.first_step_wait is not None else None,
        "phase_timing": r.phase_timing,
        "sync_in_backward": not r.sync_measured,
        "rays_per_s": r.rays_total * env.world_size / max(totals["step"], 1e-9),
        "wall_s": r.wall,
        "train_s": r.train_s, "stopped_by": r.stopped_by,
        "source_stats": r.source_stats[0] if len(r.source_stats) == 1 else r.source_stats,
        "renders": renders,
    }
    if periodic:  # held-out PSNR against training seconds, the final evaluation last
        summary["eval_curve"] = [{"step": e["step"], "train_s": e["train_s"], "eval_psnr": e["eval_psnr"]}
                                 for e in r.evals] + [{"step": r.end_step, "train_s": r.train_s, "eval_psnr": p}]
    if cfg.train.target_psnr:
        reached = r.target_reached_s if r.target_reached_s is not None else (r.train_s if p >= cfg.train.target_psnr else None)
        summary.update(target_psnr=cfg.train.target_psnr, target_reached_s=reached)
    if env.device.type == "cuda":
        summary["gpu_memory"] = gpu_memory(env.device)
    summary.update(method.extra_summary(cfg, tasks, env, eval_scene, field, occupancy))
    atomic_write_text(cfg.run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def gpu_memory(device) -> dict:
    """This process's GPU memory on ``device``: torch's peak allocated and reserved bytes since the
    process started (or since ``torch.cuda.reset_peak_memory_stats``), and the device's used bytes
    now (total - free: also DALI's pools, nvJPEG's buffers and any other process)."""
    free, total = torch.cuda.mem_get_info(device)
    return {"torch_peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "torch_peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "device_used_bytes": int(total - free), "device_total_bytes": int(total)}


def _append_metrics_row(path: Path, rec: dict) -> None:
    try:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError as e:
        raise DaliNerfError(f"{path}: cannot write metrics ({e.strerror}); free disk space or choose a writable "
                            f"train.runs_dir (the last checkpoint is intact)") from None


# ---------------------------------------------------------------------------------------------
# CLI shared by trainers/ddp.py and trainers/spatial.py


def trainer_main(method_factory: Callable[[], Method], default_config: str, argv=None) -> int:
    """Entry point of a trainer script: ``--config FILE [--resume] [key=value ...]``.

    Returns the exit code (2 for user errors, printed as one line, no traceback)."""
    p = argparse.ArgumentParser(description="dali_nerf trainer (run under torchrun for several ranks)")
    p.add_argument("--config", default=default_config)
    p.add_argument("--resume", action="store_true", help="continue from runs/<name>/checkpoints/latest")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. train.steps=200")
    args = p.parse_args(argv)

    def go():
        cfg = load_config(args.config, args.overrides)
        method = method_factory()
        if cfg.method != method.name:
            raise ConfigError(f"{args.config}: method: is {cfg.method!r} but this trainer runs {method.name!r}; use trainers/{'ddp' if cfg.method == 'ddp' else 'spatial'}.py")
        summary = train(cfg, method, resume=args.resume)
        if summary:
            keys = ("name", "test_psnr", "stall_fraction", "stall_fraction_after_first_step", "warmup_wait_s", "rays_per_s",
                    "wall_s", "device", "step_s", "floor_step_s", "step_over_floor", "host_keeps_up")
            print(json.dumps({k: summary[k] for k in keys if k in summary}), flush=True)
        return 0

    return run_cli(go)
