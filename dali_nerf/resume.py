"""A run's checkpoints: what each rank saves (its tasks' fields, optimisers, sources, RNG states),
and the resume: the newest checkpoint every rank can read, checked against the run before the
expensive setup, loaded into the tasks. The files themselves: :mod:`dali_nerf.checkpoint`."""

from __future__ import annotations

import ast
import os
import random
import sys
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
import yaml

from .checkpoint import (CheckpointUnreadable, atomic_write_text, checkpoint_candidates, commit_checkpoint,
                         resume_checkpoint, save_rank_state)
from .config import Config, config_to_dict
from .errors import DaliNerfError
from .runtime import DistEnv, gather_codes
from .scenes import describe_change, scene_fingerprint
from .tasks import Task, close_sources

__all__ = ["save_checkpoint", "read_resume_state", "restore_tasks"]


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


def save_checkpoint(run_dir: Path, step: int, tasks: List[Task], env: DistEnv, cfg: Config, scene) -> None:
    """Every rank writes its file, then rank 0 commits the step. ``scene``: the training split,
    whose fingerprint (:func:`dali_nerf.scenes.scene_fingerprint`) the file carries as "scene"."""
    state = {"step": step, "rank": env.rank, "world_size": env.world_size, "method": cfg.method,
             "scene": scene_fingerprint(scene), "tasks": {t.name: _task_state(t) for t in tasks}, "rng": _rng_state()}
    save_rank_state(run_dir / "checkpoints", step, env.rank, state)
    env.barrier()
    if env.rank == 0:
        commit_checkpoint(run_dir / "checkpoints", step)
    env.barrier()


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

    folder, st, skipped = resume_checkpoint(ckpt_root, env.rank, check, lambda code: gather_codes(env, code))
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
        close_sources(tasks)
        raise
    return start_step
