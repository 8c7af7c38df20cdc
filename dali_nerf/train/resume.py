"""A run's checkpoints: what is saved once per step (format 2) and how a run resumes — on the
same number of ranks, or on another one when its streams allow it. The files themselves:
:mod:`dali_nerf.train.checkpoint`.

Format 2, one step folder (DDP replicas are identical, so the model is stored once):

* ``run.pt`` (rank 0): ``format`` 2, ``step``, ``world_size`` (the ranks that wrote it),
  ``method``, ``pipeline`` (the source's name), ``stream`` (the formula's version:
  ``global-v2`` | ``shard-v1`` | the baseline's), ``global_batch`` G (0 when the stream has
  none), ``seed``, ``mode``, ``scene`` (the training split's fingerprint), ``cells`` (SS: their
  number), ``ranks``: per rank of the writer ``{"rng", "sources", "cells", "replica"}`` (its RNG
  states; DDP: its loader's state and its replica's digest, :func:`replica_digest`; SS: its cells);
* DDP ``model.pt`` (rank 0): ``{"tasks": {"ddp": field, optimizer, scheduler, occupancy, space}}``;
* SS ``cell<C>.pt`` (the rank that trains cell C): that cell's task state with its loader state.

Resume on W' ranks (:func:`read_resume_state`): W' = W: every rank takes its own RNG and loader
state (exactly as before). W' != W (elastic; torchrun ``--nnodes=MIN:MAX`` restarts): allowed for
the DDP global stream (each rank decodes its new shard once and continues the saved global step
with G kept: rays per rank G / W', refused when W' does not divide G), ``sync_global`` (rank 0's
global batch, G kept likewise), the splatting trainer's image stream (every rank continues from
the saved global image position with ``images.images_per_batch`` per rank) and the SS ``rays`` cells (cells reassigned by
:func:`~dali_nerf.partition.assign_rank`; each cell's stream is its own); refused in one line for
per-rank streams (``pipeline.stream=shard``, sync_local, torch_workers, the SS baselines). Format
1 checkpoints (one ``rank<R>.pt`` per rank) resume on their world size only.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import random
import sys
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
import yaml

from dali_nerf.train.checkpoint import (MODEL_FILE, RUN_FILE, CheckpointUnreadable, atomic_write_text, cell_file, checkpoint_candidates,
                         checkpoint_format, commit_checkpoint, load_file, load_rank_state, resume_checkpoint, save_file)
from dali_nerf.config import Config, config_to_dict
from dali_nerf.errors import DaliNerfError
from dali_nerf.launch_env import launch_env
from dali_nerf.partition import assign_rank
from dali_nerf.data.plan import RAY_GRAPH_SOURCES, global_batch_share, nearest_divisors
from dali_nerf.pipelines.rays import GLOBAL_STREAM, SHARD_STREAM
from dali_nerf.train.record import last_step
from dali_nerf.data.imageorder import IMAGE_STREAM
from dali_nerf.train.runtime import DistEnv, gather_codes
from dali_nerf.scenes import describe_change, scene_fingerprint
from dali_nerf.train.tasks import Task, close_sources

__all__ = ["save_checkpoint", "read_resume_state", "restore_tasks", "resumed_config", "load_checkpoint",
           "replica_digest", "ELASTIC", "elastic_launch", "agree_on_checkpoints"]

ELASTIC = {("ddp", GLOBAL_STREAM), ("ddp", "sync_global-v1"), ("ss", "cells-v1"), ("splat", IMAGE_STREAM)}
"""(method, stream) pairs a checkpoint of which resumes on another world size."""


TRAINER_OF = {"ddp": "ddp", "ss": "spatial", "splat": "splat"}
"""The trainer script (trainers/<name>.py) of each method."""


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


def _source_state(task: Task) -> dict:
    # the scene's fingerprint is stored once per checkpoint ("scene", checked by read_resume_state)
    return ({k: v for k, v in task.source.state_dict().items() if k != "scene"}
            if hasattr(task.source, "state_dict") else {})


def _task_state(task: Task, source: bool) -> dict:
    st = {"field": task.raw_field.state_dict(), "optimizer": task.optimizer.state_dict()}
    if source:
        st["source"] = _source_state(task)
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


def replica_digest(task: Task) -> str:
    """SHA-256 of a task's field and optimizer tensors (bytes, in key order): equal on every DDP
    rank (the checkpoint stores one replica; ``run.pt`` keeps each rank's digest)."""
    h = hashlib.sha256()

    def add(obj):
        if isinstance(obj, torch.Tensor):
            h.update(obj.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                h.update(str(k).encode())
                add(obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                add(v)
        else:
            h.update(repr(obj).encode())

    add(task.raw_field.state_dict())
    add(task.optimizer.state_dict()["state"])
    return h.hexdigest()


def save_checkpoint(run_dir: Path, step: int, tasks: List[Task], env: DistEnv, cfg: Config, scene, plan) -> None:
    """Format 2 (module doc): every rank's RNG and (DDP) loader state gathered into rank 0's
    ``run.pt``; DDP's model once (rank 0, ``model.pt``); SS one file per cell, by its rank. Then
    rank 0 commits the step. ``scene``: the training split (its fingerprint is stored); ``plan``:
    the rank's :class:`~dali_nerf.data.plan.SamplingPlan` (the run's stream and global batch)."""
    ss = cfg.method == "ss"
    mine = {"rng": _rng_state(), "sources": {} if ss else {t.name: _source_state(t) for t in tasks},
            "cells": [t.cell for t in tasks] if ss else [],
            "replica": "" if ss else replica_digest(tasks[0])}
    ranks = [mine]
    if env.distributed:
        ranks = [None] * env.world_size
        dist.all_gather_object(ranks, mine)
    root = run_dir / "checkpoints"
    for t in tasks if ss else ():
        save_file(root, step, cell_file(t.cell), {"cell": t.cell, "task": _task_state(t, source=True)})
    if env.rank == 0:
        if len({r["replica"] for r in ranks}) > 1:  # DDP keeps them equal; the file holds rank 0's
            print(f"warning: step {step}: the DDP replicas differ (digests {[r['replica'][:12] for r in ranks]}); "
                  f"the checkpoint holds rank 0's", file=sys.stderr, flush=True)
        run = {"format": 2, "step": step, "world_size": env.world_size, "method": cfg.method,
               "pipeline": cfg.pipeline.name, "stream": plan.stream_version,
               "global_batch": plan.run_global_batch, "seed": cfg.pipeline.seed,
               "mode": cfg.pipeline.mode, "scene": scene_fingerprint(scene), "ranks": ranks,
               "cells": sum(len(r["cells"]) for r in ranks)}
        if not ss:
            save_file(root, step, MODEL_FILE, {"tasks": {t.name: _task_state(t, source=False) for t in tasks}})
        save_file(root, step, RUN_FILE, run)  # last: a folder with run.pt has its other files
    env.barrier()
    if env.rank == 0:
        commit_checkpoint(root, step)
    env.barrier()


def _check_elastic(run: dict, folder: Path, world: int) -> None:
    """Refuse (one line) a format-2 checkpoint that cannot resume on ``world`` ranks."""
    W, stream, method = int(run["world_size"]), run.get("stream"), run.get("method")
    if W == world:
        return
    if (method, stream) not in ELASTIC:
        what = ("pipeline.stream=shard (each rank's own stream over its image shard)" if stream == SHARD_STREAM else
                f"pipeline.name={run.get('pipeline')} (per-rank streams)")
        raise DaliNerfError(f"{folder}: written by {W} ranks with {what}, which resumes on {W} ranks only, not {world}; "
                            f"resume with {W} ranks (a run started with pipeline.stream=global resumes on another "
                            f"number of ranks)")
    G = int(run.get("global_batch") or 0)
    if G and G % world:
        raise DaliNerfError(f"{folder}: the run's global batch of {G} rays ({G // W} per rank x {W} ranks) does not "
                            f"divide among {world} ranks, and it is kept across world sizes; resume on a number of "
                            f"ranks that divides {G}: {' or '.join(map(str, nearest_divisors(G, world)))}")
    C = int(run.get("cells") or 0)
    if method == "ss" and world > C:
        raise DaliNerfError(f"{folder}: the run's {C} cells cannot be shared among {world} ranks (a rank would train "
                            f"none); resume on at most {C} ranks")


def _load_v1(folder: Path, env: DistEnv) -> dict:
    """This rank's format-1 file; a world size it cannot resume on is refused."""
    try:
        st = load_rank_state(folder, env.rank)
    except CheckpointUnreadable:
        if env.rank and not (folder / f"rank{env.rank}.pt").exists():  # a rank the run did not have?
            try:
                other = load_rank_state(folder, 0)
            except CheckpointUnreadable:
                other = None  # rank 0's own read reports it
            if isinstance(other, dict) and other.get("world_size") not in (None, env.world_size):
                _refuse_v1(folder, other["world_size"], env.world_size)
        raise
    path = folder / f"rank{env.rank}.pt"
    missing = [k for k in ("step", "world_size", "tasks", "rng") if not isinstance(st, dict) or k not in st]
    if missing:
        raise CheckpointUnreadable(path, f"not a dali_nerf training checkpoint (no {', '.join(missing)})")
    if st["world_size"] != env.world_size:
        _refuse_v1(folder, st["world_size"], env.world_size)
    return dict(st, format=1)


def _refuse_v1(folder, saved: int, now: int):
    raise DaliNerfError(f"{folder}: saved with world size {saved} in checkpoint format 1 (one file per rank), which "
                        f"resumes on {saved} ranks only, not {now}; resume with the same number of ranks")


def _load_v2(folder: Path, env: DistEnv) -> dict:
    """What this rank needs of a format-2 folder: the run state, then the model (DDP) or the
    files of the cells it trains on ``env.world_size`` ranks (SS), merged as one state."""
    run = load_file(folder, RUN_FILE)
    missing = [k for k in ("step", "world_size", "method", "ranks") if not isinstance(run, dict) or k not in run]
    if missing:
        raise CheckpointUnreadable(folder / RUN_FILE, f"not a dali_nerf training checkpoint (no {', '.join(missing)})")
    _check_elastic(run, folder, env.world_size)
    same = int(run["world_size"]) == env.world_size
    mine = run["ranks"][env.rank] if same else run["ranks"][0]  # elastic: every rank continues rank 0's state
    if run["method"] == "ss":
        tasks = {}
        for c in assign_rank(int(run["cells"]), env.world_size)[env.rank]:
            cell = load_file(folder, cell_file(c))
            tasks[f"cell{c}"] = cell["task"]
    else:
        model = load_file(folder, MODEL_FILE)
        tasks = {name: dict(t, source=mine["sources"].get(name, {})) for name, t in model["tasks"].items()}
    return dict(run, tasks=tasks, rng=mine["rng"] if same else None, format=2)


def load_checkpoint(folder, rank: int = 0, world_size: Optional[int] = None) -> dict:
    """The state rank ``rank`` of ``world_size`` ranks (default: as many as wrote it) resumes from
    in checkpoint ``folder`` (format 2: the run state with ``tasks`` for that rank, its RNG and
    loader states on the same world size; format 1: the rank's file), with the world-size rules
    of a resume (a refusal is a DaliNerfError) but not the scene check: for tools and tests."""
    folder = Path(folder)
    if checkpoint_format(folder) == 1:
        if world_size is None:
            return dict(load_rank_state(folder, rank), format=1)
        return _load_v1(folder, DistEnv(int(rank), int(world_size), int(rank), torch.device("cpu")))
    W = int(world_size or load_file(folder, RUN_FILE)["world_size"])
    return _load_v2(folder, DistEnv(int(rank), W, int(rank), torch.device("cpu")))


def elastic_launch() -> bool:
    """Whether torch's elastic agent (torchrun) started this process: it sets
    ``TORCHELASTIC_RUN_ID`` on every worker of every group start."""
    return launch_env().elastic


RUN_ID_FILE = "torchelastic_run_id"
"""In the checkpoint folder: the ``TORCHELASTIC_RUN_ID`` of the torchrun job that writes there."""


def agree_on_checkpoints(ckpt_root: Path, env: DistEnv) -> bool:
    """Whether the worker group resumes by itself: rank 0 decides, every rank takes its answer
    (one collective, so all ranks decide alike).

    It resumes when ``ckpt_root`` has a committed checkpoint written by this torchrun job: the
    job's ``TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``; a fresh uuid per ``--standalone``
    launch) equals the one its first group recorded in :data:`RUN_ID_FILE`. That covers every
    restart of the job — after a failure (``--max-restarts``) and after a node joined or left
    (``--nnodes=MIN:MAX``) — which the restart count does not: torch's agent restarts the group on
    a membership change without counting it as a retry, and a replacement node's ranks see 0 where
    the survivors see >= 1 (torch/distributed/elastic/agent/server/api.py). Another job (a new
    launch of the same config) starts anew, as without torchrun, with a note; ``--resume``
    continues it instead. Rank 0 records the job's id (a write it cannot make is left to the
    checkpoint's own one-line error)."""
    run_id = launch_env().run_id or ""
    same = False
    if env.rank == 0:
        record = ckpt_root / RUN_ID_FILE
        try:
            recorded = record.read_text().strip() if record.is_file() else None
        except OSError:
            recorded = None
        has = bool(checkpoint_candidates(ckpt_root))
        same = has and recorded == run_id
        if has and not same:
            print(f"note: {ckpt_root} has checkpoints of another torchrun job (rdzv id {recorded or 'unrecorded'}, "
                  f"this one {run_id}): this job starts anew; pass --resume to continue them",
                  file=sys.stderr, flush=True)
        if recorded != run_id:
            try:
                ckpt_root.mkdir(parents=True, exist_ok=True)
                atomic_write_text(record, run_id + "\n")
            except (OSError, DaliNerfError):
                pass
    agreed = bool(gather_codes(env, int(same))[0])
    if agreed and env.rank == 0:
        print(f"note: {ckpt_root} has checkpoints of this torchrun job (rdzv id {run_id}), whose worker group "
              f"restarted: it resumes from the latest", file=sys.stderr, flush=True)
    return agreed


def read_resume_state(run_dir: Path, env: DistEnv, resume: bool, scene=None, cfg: Optional[Config] = None):
    """``(resume, state, folder)``: this rank's checkpoint state (read ``weights_only`` and checked
    before the expensive setup) when resuming, else ``(False, None, None)``. A worker group
    started by torchrun in a run folder with a committed checkpoint (a restart after a failure,
    ``--max-restarts``, or after a node joined or left, ``--nnodes=MIN:MAX``) resumes from it by
    itself, on however many ranks it has, every rank alike (:func:`agree_on_checkpoints`).

    The folder is the newest committed checkpoint every rank can read
    (:func:`dali_nerf.train.checkpoint.resume_checkpoint`): a missing, truncated or corrupt file makes
    all ranks fall back to the previous checkpoint, each rank warning (one line on stderr) about
    its own bad file. Refused (one line, nothing written): no checkpoint; none complete; a crafted
    file; a world size the checkpoint cannot resume on (per-rank streams, format 1, a global batch
    W' does not divide, more ranks than SS cells); another method, ``pipeline.seed`` or
    ``pipeline.mode`` than ``cfg``'s (format 2; the stream's key); a training split
    ``scene`` whose fingerprint differs from the one saved (images added or removed, sizes,
    cameras or downscale changed). A checkpoint written before fingerprints were saved resumes
    without the scene check.
    """
    ckpt_root = run_dir / "checkpoints"
    if not resume and elastic_launch():
        resume = agree_on_checkpoints(ckpt_root, env)
    if not resume:
        return False, None, None
    current = scene_fingerprint(scene) if scene is not None else None

    def load(folder: Path) -> dict:
        return _load_v1(folder, env) if checkpoint_format(folder) == 1 else _load_v2(folder, env)

    def check(st, folder: Path):
        if cfg is not None and st.get("method", cfg.method) != cfg.method:
            raise DaliNerfError(f"{folder}: written by a method {st['method']} run, this is a {cfg.method} run; resume it "
                                f"with trainers/{TRAINER_OF.get(st['method'], 'ddp')}.py")
        for key in ("seed", "mode") if cfg is not None else ():  # the stream's key: found before any rank decodes
            saved, now = st.get(key), getattr(cfg.pipeline, key)
            if saved is not None and saved != now:
                raise DaliNerfError(f"{folder}: written with pipeline.{key}={saved}, this run has {now}; resume with "
                                    f"pipeline.{key}={saved}")
        change = describe_change(st.get("scene"), current) if current is not None else None
        if change is not None:
            raise DaliNerfError(f"{scene.root}: changed since the checkpoint {folder} was written: {change}; resume with the "
                                f"scene the run was trained on, or start a new run (another name=, without --resume)")

    folder, st, skipped = resume_checkpoint(ckpt_root, env.rank, check, lambda code: gather_codes(env, code), load=load)
    for bad in skipped:
        print(f"warning: {bad.path}: {bad.reason}; every rank resumes from the previous complete checkpoint {folder} "
              f"(step {st['step']})", file=sys.stderr, flush=True)
    return True, st, folder


def resumed_config(cfg: Config, st: Optional[dict], env: DistEnv) -> Config:
    """The config a run trains with: a new run's as it is; a resumed run's checkpoint stream and
    global batch win over the config's (a resume continues the run's stream). Format 1: the shard
    stream (the only one then). Global stream / sync_global: ``pipeline.global_batch`` = the
    checkpoint's G, so the rank's plan trains G / W' rays per rank (W' the ranks now; the check
    refused a W' that does not divide G; :func:`~dali_nerf.data.plan.plan_from_config` resolves
    it). Rank 0 prints one note per changed value."""
    if st is None or cfg.method != st.get("method", cfg.method):
        return cfg
    p, notes, W = cfg.pipeline, [], env.world_size
    if st.get("format", 1) == 1:
        if cfg.method == "ddp" and p.name in RAY_GRAPH_SOURCES and p.stream != "shard":
            notes.append("a checkpoint of format 1 continues the shard stream: pipeline.stream=shard")
            p = dataclasses.replace(p, stream="shard")
    elif st.get("pipeline") == p.name:
        if cfg.method == "ddp" and p.name in RAY_GRAPH_SOURCES:
            kind = "global" if st.get("stream") == GLOBAL_STREAM else "shard"
            if kind != p.stream:
                notes.append(f"the run samples the {kind} stream: pipeline.stream={kind}")
                p = dataclasses.replace(p, stream=kind)
        G = int(st.get("global_batch") or 0)
        if G and p.global_batch != G:
            per_rank = global_batch_share(G, W, f"the checkpoint's global batch {G}")  # the plan's B, for the note
            if p.global_batch:
                notes.append(f"its global batch of {G} rays is kept: pipeline.global_batch={G} (was {p.global_batch}), "
                             f"pipeline.rays_per_batch={per_rank} on {W} ranks")
            elif per_rank != p.rays_per_batch:
                notes.append(f"its global batch of {G} rays is kept on {W} ranks: "
                             f"pipeline.rays_per_batch={per_rank} (was {p.rays_per_batch})")
            p = dataclasses.replace(p, global_batch=G)
    if env.rank == 0:
        for n in notes:
            print(f"note: resuming step {st['step']} (written by {st['world_size']} rank(s)): {n}", file=sys.stderr,
                  flush=True)
    return dataclasses.replace(cfg, pipeline=p) if p is not cfg.pipeline else cfg


def restore_tasks(cfg: Config, tasks: List[Task], st: Optional[dict], folder, env: DistEnv) -> int:
    """Load the checkpoint ``st`` (if any) into the tasks and (same world size) the RNGs, then rank
    0 writes the resolved ``config.yaml``. Returns the step to continue after (0 for a new run).
    On any error the tasks' sources are closed."""
    start_step = 0
    try:
        if st is not None:
            try:
                for t in tasks:
                    _load_task_state(t, st["tasks"][t.name])
                if st.get("rng") is not None:
                    _set_rng_state(st["rng"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                lines = [l.strip() for l in str(e).splitlines() if l.strip()]
                what = next((l for l in lines if l.startswith(("size mismatch", "Missing key", "Unexpected key"))),
                            lines[0] if lines else "")[:200]
                where = folder / f"rank{env.rank}.pt" if st.get("format", 1) == 1 else folder
                raise DaliNerfError(f"{where}: does not match this run's config ({type(e).__name__}: {what}); "
                                    f"resume with the config the run was saved with") from None
            start_step = int(st["step"])
        if env.rank == 0 and not (st is not None and start_step >= last_step(cfg)):  # a finished run's is kept
            atomic_write_text(cfg.run_dir / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    except BaseException:
        close_sources(tasks)
        raise
    return start_step
