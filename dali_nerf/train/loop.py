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
* ``summary.json``     test PSNR/SSIM (and ``mean_color_psnr``, the floor; a masked evaluation split also
  ``test_psnr_unmasked``, the PSNR over its unmasked pixels, which ``psnr_lead`` names as the lead
  metric), stall fraction, rays/s, per-phase totals, wall time,
  training time and why the run stopped (``stopped_by``: steps, stop_after, max_seconds,
  target_psnr), the ``eval_curve`` (PSNR vs training seconds) with periodic evaluations, the GPU
  memory on a GPU (``gpu_memory``), and method specifics (SS: fusion overhead);
* ``checkpoints/``     atomic per-rank checkpoints (:mod:`dali_nerf.train.checkpoint`);
* ``renders/*.png``    held-out views, prediction beside ground truth.

Gradient sync is timed by a DDP communication hook that performs the all-reduce and records how
long it took (:func:`dali_nerf.train.runtime.wrap_ddp`); ``backward_s`` excludes it.

:func:`train` is the sequence of named steps: the runtime's :func:`~dali_nerf.train.runtime.setup_distributed`,
:func:`~dali_nerf.train.runtime.run_folder` (the folder's lock), :func:`~dali_nerf.train.runtime.load_scenes`, the resume's
:func:`~dali_nerf.train.resume.read_resume_state`, :func:`~dali_nerf.train.runtime.seed_everything`,
the rank's plan and sources (:func:`dali_nerf.sources.registry.rank_feed`, ``Feed.build``),
``method.build_tasks`` (the fields around those sources),
:func:`~dali_nerf.train.resume.restore_tasks`, :func:`run_steps` (the timed loop, checkpoints, periodic
evaluation) and :func:`evaluate_and_summarise`. The emulated-device mode is not trained here:
:func:`dali_nerf.cli.trainer.run_training` sends ``train.device=emulated`` to
:mod:`dali_nerf.train.emulated`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

from dali_nerf.atomic import atomic_write_text
from dali_nerf.config import Config
from dali_nerf.errors import ConfigError
from dali_nerf.interrupt import StopRequest, Terminated, stop_signal
from dali_nerf.train.evaluation import EvalViews, PeriodicEval, evaluate_field, mean_color_psnr, write_renders
from dali_nerf.train.fieldsetup import train_background
from dali_nerf.models import render_rays
from dali_nerf.models.keyed import ray_keys
from dali_nerf.models.ray_space import RaySpace
from dali_nerf.train.phases import PHASES, PhaseTimer, runq_seconds
from dali_nerf.data.plan import SamplingPlan, sampling_device
from dali_nerf.train.record import NO_FIGURES, last_step, loss_at, note_resume, summary_of_record, write_noted
from dali_nerf.train.resume import read_resume_state, restore_tasks, resumed_config, save_checkpoint
from dali_nerf.train.runlog import MetricsWriter, append_metrics_row, bar_stall, progress_bar, steady_stall
from dali_nerf.train.runtime import (DistEnv, gather_codes, gpu_memory, load_scenes, run_folder, seed_everything,
                                     setup_distributed, step_generator, to_device, torch_threads_kept)
from dali_nerf.train.stopping import LAG, StopVote
from dali_nerf.data.seeds import ray_key
from dali_nerf.sources.registry import rank_feed
from dali_nerf.train.tasks import Method, Task, close_sources
from dali_nerf.train.tblog import TBWriter, step_scalars

__all__ = ["train", "run_steps", "evaluate_and_summarise", "LoopResult", "train_task_step", "fetch_batch", "PHASES"]

_WORLD = RaySpace("world", [[0.0] * 3, [0.0] * 3])  # render_args of world space: the rays unchanged


def _near_far(batch: dict, scene):
    if "near" in batch:
        return batch["near"], batch["far"]
    n = batch["origins"].shape[0]
    near = torch.full((n, 1), 0.0, device=batch["origins"].device)
    far = torch.full((n, 1), 1e3, device=batch["origins"].device)
    return near, far


def train(cfg: Config, method: Method, resume: bool = False) -> dict:
    """Run training for ``cfg`` with ``method`` on this process's rank (a real device: cpu, cuda or
    auto); returns the summary (rank 0) or {} (other ranks). The emulated-device mode:
    :func:`dali_nerf.cli.trainer.run_training`."""
    if cfg.train.device == "emulated":
        raise ConfigError("train.device=emulated trains no model: run it with dali_nerf.cli.trainer.run_training "
                          "(or the trainers, trainers/ddp.py and trainers/spatial.py)")
    # setup_distributed sets torch's threads per rank (a caller's process gets them back); the
    # checkpoint signal raises Terminated outside the loop, and is only recorded inside it
    with torch_threads_kept(), stop_signal(cfg.train.checkpoint_signal) as stop:
        env = setup_distributed(sampling_device(cfg.train.device), cfg.train.torch_threads)
        with run_folder(cfg.run_dir, env):  # rank 0 holds the run folder's lock to the end
            scene, eval_scene = load_scenes(cfg, env)
            resume, saved, folder = read_resume_state(cfg.run_dir, env, resume, scene, cfg)
            cfg = resumed_config(cfg, saved, env)  # the checkpoint's stream and global batch (any world size)
            seed_everything(cfg.pipeline.seed, env.rank)
            # the rank's plan, resolved once (SS: the partition and the cells), and nothing decoded yet
            feed = rank_feed(cfg, scene, env.rank, env.world_size, device=env.device.type)
            method.check(cfg, scene)
            feed.build()  # the rank's sources (the registry)
            tasks = method.build_tasks(cfg, scene, env, feed)
            start_step = restore_tasks(cfg, tasks, saved, folder, env)
            if saved is not None and start_step >= last_step(cfg):  # nothing to train: the run's record stays
                summary = finished_run(cfg, method, env, tasks, eval_scene, start_step, feed.plan)
            else:
                with stop.deferred():
                    result = run_steps(cfg, method, env, tasks, scene, eval_scene, start_step, resume, feed.plan, stop)
                if result.signalled:
                    raise Terminated(stop.signum_wanted, _stopped_line(cfg, env, result, stop) if env.rank == 0 else "")
                stop.raise_if_received()  # a signal as the loop ended: no evaluation
                summary = evaluate_and_summarise(cfg, method, env, tasks, eval_scene, result, feed.plan)
            env.barrier()
            if env.distributed:
                dist.destroy_process_group()
            return summary


def _stopped_line(cfg: Config, env: DistEnv, r: "LoopResult", stop: StopRequest) -> str:
    seen = stop.name if stop.received else f"{stop.name} (received by another rank)"
    return (f"stopped by {seen} after step {r.end_step} of {cfg.train.steps}, the last step every rank completed: its "
            f"checkpoint is in {cfg.run_dir / 'checkpoints'}; --resume continues it (a torchrun restart does by itself)")


def finished_run(cfg: Config, method: Method, env: DistEnv, tasks: List[Task], eval_scene, step: int,
                 plan: SamplingPlan) -> dict:
    """A resume at (or past) the run's last step: nothing to train, the run's record kept
    (:mod:`dali_nerf.train.record`). With a summary of record it is kept, the resume noted beside
    it; without one the final evaluation writes it. Returns the summary (rank 0), {} elsewhere."""
    close_sources(tasks)
    record = summary_of_record(cfg.run_dir, step) if env.rank == 0 else None
    has = bool(gather_codes(env, int(record is not None))[0])  # rank 0 decides, every rank follows
    if env.rank == 0:
        print(f"note: {cfg.run_dir} is at step {step}, its last ({last_step(cfg)}): nothing to train; "
              + ("its summary of record is kept, the resume noted in summary.json (resumed_at_end)" if has else
                 "it has no summary of that step: evaluating it"), file=sys.stderr, flush=True)
    if has:
        summary = note_resume(record, step, env.world_size, record=True) if env.rank == 0 else {}
    else:
        r = LoopResult(step, step, {}, None, 0, {"loss": loss_at(cfg.run_dir, step)}, 0.0, [], figures=False)
        summary = evaluate_and_summarise(cfg, method, env, tasks, eval_scene, r, plan)
        if env.rank == 0:
            summary = note_resume(summary, step, env.world_size, record=False)
    if env.rank == 0:
        write_noted(cfg.run_dir, summary)
    return summary


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
    views: Optional[EvalViews] = None   # the run's evaluated views (decoded once)
    signalled: bool = False       # the checkpoint signal stopped it (some rank got it): no evaluation
    figures: bool = True          # False: no segment ran (a resume at the end without a summary of record)


def fetch_batch(task, timer, device):
    """The step's batch from ``task``'s source, the wait for it timed (the host phase ``wait``),
    moved to ``device``; returns ``(batch, m1, m2)``, the timer's marks around the copy (the
    ``h2d`` span). Every trainer's step starts so."""
    t0 = time.perf_counter()
    batch = next(task.batches())
    t1 = time.perf_counter()
    timer.host("wait", t1 - t0)
    m1 = t1 if not timer.cuda else timer.mark()
    batch = to_device(batch, device)
    return batch, m1, timer.mark()


def train_task_step(cfg: Config, env: DistEnv, task: Task, step: int, scene, bg, sync_timers, timer: "PhaseTimer"):
    """One optimisation step of one task, its phases recorded in ``timer`` (resolved by the
    caller at the end of the step); returns (loss tensor, rays).

    A batch of the global stream (it carries ``positions``) has this rank's part of the step's G
    rays, any number of them, 0 included: the loss is ``sum of per-ray errors x W / G`` (DDP
    averages the gradients over W: the step's gradient is that of G's mean error, whatever the
    ranks' counts), each ray's jitter and random background are keyed by its global position
    (:mod:`dali_nerf.models.keyed`), and the loss returned (logged) is the rank's own mean (NaN for
    an empty batch). Other batches: the mean over the batch, jitter from the step's generator."""
    batch, m1, m2 = fetch_batch(task, timer, env.device)
    near, far = _near_far(batch, scene)
    # an SS cell's draws are keyed by its cell, not by the rank that trains it (any world size)
    gen = step_generator(cfg.pipeline.seed, env.rank if task.cell < 0 else 0, step, task.cell, device=env.device)
    b = int(batch["origins"].shape[0])
    positions = batch.get("positions")  # the global stream: per-ray draws keyed by the global ray
    jitter = ray_keys(ray_key(cfg.pipeline.seed, "jitter"), positions) if positions is not None else None
    bg_keys = (ray_keys(ray_key(cfg.pipeline.seed, "background"), positions)
               if positions is not None and scene.background_mode == "random" else None)
    bg_b = train_background(scene, task.raw_field, bg, gen, b, env.device, keys=bg_keys)
    kw = (task.space or _WORLD).render_args(batch["origins"], batch["directions"], near, far)  # world -> field space
    out = render_rays(task.field, kw.pop("origins"), kw.pop("directions"), kw.pop("near"), kw.pop("far"), bg_b,
                      occupancy=task.occupancy, samples=cfg.model.samples_per_ray, generator=gen, train=True,
                      ray_keys=jitter, **kw)
    if positions is None:
        loss = torch.mean((out["rgb"] - batch["rgb"]) ** 2)
        shown = loss.detach()
    else:  # normalised by G, not by this rank's count: (W / G) x its sum; DDP's average makes it G's mean
        sq = ((out["rgb"] - batch["rgb"]) ** 2).sum()
        loss = sq / (3 * task.source.rays_per_batch)
        shown = sq.detach() / (3 * b) if b else torch.tensor(float("nan"))  # the rank's own mean, logged
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
    return shown, b


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


class _Loop:
    """The state of :func:`run_steps`: the writers, the totals, the clock; one method per part of a step."""

    def __init__(self, cfg: Config, method: Method, env: DistEnv, tasks: List[Task], scene, eval_scene,
                 start_step: int, plan: SamplingPlan):
        self.cfg, self.method, self.env, self.tasks, self.scene, self.plan = cfg, method, env, tasks, scene, plan
        self.start_step = start_step
        metrics_name = "metrics.jsonl" if env.rank == 0 else f"metrics.rank{env.rank}.jsonl"
        self.writer = MetricsWriter(cfg.run_dir / metrics_name, start_step)
        self.tb = TBWriter(cfg.run_dir, cfg.train.tensorboard if env.rank == 0 else "never",
                           purge_step=start_step + 1 if start_step else None)
        self.bar = progress_bar(cfg, method, env, start_step)
        # the evaluated views, decoded once for the run (periodic, final and per-cell evaluations)
        self.views = EvalViews(cfg, eval_scene, threads=plan.decode_threads)
        self.periodic_eval = PeriodicEval(cfg, method, env, tasks, self.views)
        self.bg = torch.as_tensor(np.array(scene.background), device=env.device)
        self.totals = {p: 0.0 for p in PHASES}
        self.totals["step"] = 0.0
        self.first_step_wait = None
        self.rays_total = 0
        self.sync_timers = getattr(method, "sync_timers", {})
        self.timer = PhaseTimer(env.device)
        self.last = {}
        self.end_step = last_step(cfg)
        self.stopped_by = "stop_after" if self.end_step < cfg.train.steps else "steps"
        self.vote = StopVote(env, LAG.get(method.name, LAG["ss"]))
        self.clock = _TrainClock(cfg, env)
        self.evals, self.target_reached_s, self.saved_step = [], None, None

    def step(self, step: int) -> dict:
        """One step of every task, timed by phase; its metrics row, written and added to the totals."""
        cfg, env = self.cfg, self.env
        ph = {p: 0.0 for p in PHASES}
        t_step, q0 = time.perf_counter(), runq_seconds()
        losses, nrays = [], 0
        method_step = self.method.train_step  # None: a ray march (Method.train_step)
        for task in self.tasks:
            if method_step is not None:
                loss, n = method_step(cfg, env, task, step, self.timer)
            else:
                loss, n = train_task_step(cfg, env, task, step, self.scene, self.bg, self.sync_timers, self.timer)
            losses.append(loss)
            nrays += n
        self.timer.resolve(ph)  # CUDA: the one wait of the step, on its last event
        loss_v = sum(float(loss) for loss in losses) / len(self.tasks)
        step_s = time.perf_counter() - t_step
        rec = {"step": step, "loss": loss_v, "psnr": -10.0 * math.log10(max(loss_v, 1e-12)), "rays": nrays}
        rec.update({f"{p}_s": ph[p] for p in PHASES})
        rec["step_s"] = step_s
        q1 = runq_seconds()
        if q0 is not None and q1 is not None:  # the training thread's wait for a core (phases.runq_seconds)
            rec["runq_s"] = q1 - q0
        self.writer.write(rec)
        if self.first_step_wait is None:
            self.first_step_wait = (ph["wait"], step_s)
        for p in PHASES:
            self.totals[p] += ph[p]
        self.totals["step"] += step_s
        self.rays_total += nrays
        self.last = rec
        return rec

    def report(self, step: int, rec: dict) -> None:
        """TensorBoard, the progress bar and, every ``log_every`` steps, flushed metrics and a line."""
        cfg, env, totals = self.cfg, self.env, self.totals
        # the steady stall (after the run's first step) and the warm-up apart, as the bar shows them
        self.tb.scalars(step, step_scalars(rec, stall_fraction=steady_stall(totals, self.first_step_wait,
                                                                           step - self.start_step),
                                           rays_per_s=self.rays_total * env.world_size / max(totals["step"], 1e-9))
                        | {"loader/warmup_s": self.first_step_wait[0]})
        if self.bar is not None:
            self.bar.update(1)
            if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                self.bar.set_postfix(**bar_stall(totals, self.first_step_wait), loss=f"{rec['loss']:.4f}",
                                     psnr=f"{rec['psnr']:.1f}",
                                     Mrays=f"{self.rays_total / max(totals['step'], 1e-9) / 1e6 * env.world_size:.2f}")
        if step % cfg.train.log_every == 0:
            self.writer.flush()
            self.tb.flush()
            if self.bar is None and env.rank == 0:
                print(f"step {step}/{cfg.train.steps} loss {rec['loss']:.5f} psnr {rec['psnr']:.2f}", flush=True)

    def checkpoint_and_evaluate(self, step: int) -> None:
        """The wall clock's stop, the periodic checkpoint, the periodic evaluation (off the clock)
        and the target-PSNR stop after ``step``."""
        cfg = self.cfg
        stop, timed_eval = self.clock.due()
        if stop and self.stopped_by != "signal":
            self.end_step, self.stopped_by = step, "max_seconds"
        if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0 and step != self.end_step:
            self.writer.flush()
            save_checkpoint(cfg.run_dir, step, self.tasks, self.env, cfg, self.scene, self.plan)
            self.saved_step = step
        eval_every = cfg.train.eval_every
        if (timed_eval or (eval_every and step % eval_every == 0)) and step != self.end_step:
            train_s = self.clock.seconds()
            t_eval = time.perf_counter()
            row = self.periodic_eval(step)
            self.clock.paused += time.perf_counter() - t_eval
            hit = False
            if row is not None:
                row["train_s"] = train_s
                self.writer.write(row)
                self.writer.flush()
                self.evals.append(row)
                hit = self.clock.target > 0 and row["eval_psnr"] >= self.clock.target
            if self.clock.target > 0 and self.clock.agree(hit)[0]:
                self.end_step, self.stopped_by, self.target_reached_s = step, "target_psnr", train_s

    def close(self) -> list:
        """Writers closed, the sources' stats read, the sources closed; returns the stats."""
        self.writer.close()
        self.tb.close()
        if self.bar is not None:
            self.bar.close()
        stats = [t.source.stats() if hasattr(t.source, "stats") else {} for t in self.tasks]
        close_sources(self.tasks)
        return stats


def run_steps(cfg: Config, method: Method, env: DistEnv, tasks: List[Task], scene, eval_scene, start_step: int,
              resume: bool, plan: SamplingPlan, stop: Optional[StopRequest] = None) -> LoopResult:
    """The timed loop from ``start_step + 1`` to the last step: metrics rows, progress, periodic
    checkpoints and evaluations, the final checkpoint. Closes the tasks' sources. ``plan``: the
    rank's (its decode threads, the stream and global batch its checkpoints record).

    ``stop`` (the checkpoint signal, :func:`dali_nerf.interrupt.stop_signal`): once any rank has it,
    every rank stops after the same step (:class:`~dali_nerf.train.stopping.StopVote`), which is
    checkpointed; the result's ``signalled`` is then True on every rank."""
    loop = _Loop(cfg, method, env, tasks, scene, eval_scene, start_step, plan)
    received = (lambda: stop.received) if stop is not None else (lambda: False)
    t_start = time.perf_counter()
    source_stats = []
    try:
        for step in range(start_step + 1, loop.end_step + 1):
            rec = loop.step(step)
            loop.report(step, rec)
            target = loop.vote.after_step(step, received())
            if target is not None and step >= target:  # every rank completed this step: stop after it
                loop.end_step, loop.stopped_by = step, "signal"
            loop.checkpoint_and_evaluate(step)
            if step == loop.end_step:
                break
        wall = time.perf_counter() - t_start
        train_s = loop.clock.seconds()
        loop.writer.flush()
        if (loop.end_step > start_step or resume) and loop.saved_step != loop.end_step:
            save_checkpoint(cfg.run_dir, loop.end_step, tasks, env, cfg, scene, plan)
        signalled = loop.vote.finish(received())  # every rank alike: leave, or evaluate
    finally:
        source_stats = loop.close()
    return LoopResult(start_step, loop.end_step, loop.totals, loop.first_step_wait, loop.rays_total, loop.last, wall,
                      source_stats, loop.timer.kind, all(t.measured for t in loop.sync_timers.values()), train_s,
                      loop.stopped_by, loop.evals, loop.target_reached_s, loop.views, signalled)


def evaluate_and_summarise(cfg: Config, method: Method, env: DistEnv, tasks: List[Task], eval_scene,
                           r: LoopResult, plan: SamplingPlan) -> dict:
    """Every rank may take part in gathering the field(s); rank 0 renders the held-out views,
    writes the renders and ``summary.json`` (and, with ``train.eval_every``, the last
    ``eval_psnr`` row of metrics.jsonl) and returns the summary; other ranks return {}."""
    field, occupancy = method.eval_field(cfg, tasks, env)
    if env.rank != 0:
        return {}
    sc = cfg.scene
    field.eval()
    views = r.views or EvalViews(cfg, eval_scene)
    res = evaluate_field(field, occupancy, eval_scene, cfg, env.device, cfg.train.eval_images,
                         decode=views.cache(), space=method.space,
                         render=method.render_view)
    pairs, p, s, seconds = res
    masked = {} if res.masks is None else {"test_psnr_unmasked": res.psnr_unmasked}
    renders = write_renders(pairs, cfg.run_dir / "renders", prefix=sc.eval_split)
    with TBWriter(cfg.run_dir, cfg.train.tensorboard) as tb:
        for i, (pred, gt) in enumerate(pairs):
            tb.image(r.end_step, f"{sc.eval_split}/{i}", torch.cat([pred, gt], 1))  # prediction | ground truth
        tb.scalars(r.end_step, {f"eval/{sc.eval_split}_psnr": p, f"eval/{sc.eval_split}_ssim": s,
                                **{f"eval/{sc.eval_split}_psnr_unmasked": v for v in masked.values()}})
    periodic = bool(cfg.train.eval_every or cfg.train.eval_every_s)
    if periodic:
        append_metrics_row(cfg.run_dir / "metrics.jsonl",
                            {"step": r.end_step, "eval_psnr": p, "eval_ssim": s, "eval_render_s": seconds,
                             "train_s": r.train_s, **{"eval_psnr_unmasked": v for v in masked.values()}})
    totals, steps_run = r.totals or {p_: 0.0 for p_ in (*PHASES, "step")}, r.end_step - r.start_step
    summary = {
        "name": cfg.name, "method": method.name, "world_size": env.world_size, "device": str(env.device),
        "steps": r.end_step, "steps_planned": cfg.train.steps, "steps_this_run": steps_run, "resumed_from": r.start_step,
        "rays_per_batch": plan.rays_per_batch, "pipeline": cfg.pipeline.name,
        "stream": plan.stream_version, "global_batch": plan.run_global_batch or None,
        "psnr_lead": "unmasked" if masked else "full", **masked,
        "test_psnr": p, "test_ssim": s, "mean_color_psnr": mean_color_psnr(pairs), "eval_split": sc.eval_split, "eval_images": len(pairs),
        "eval_render_s": seconds,
        "final_train_loss": r.last.get("loss"),
        "phase_totals_s": {p_: totals[p_] for p_ in PHASES} | {"step": totals["step"]},
        "stall_fraction": totals["wait"] / max(totals["step"], 1e-9),
        # the first step includes building the DALI pipeline and the first sampling run
        "stall_fraction_after_first_step": steady_stall(totals, r.first_step_wait, steps_run),
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
    if not r.figures:  # no segment ran: its figures would be zeros, not the run's (dali_nerf.train.record)
        summary.update({k: None for k in NO_FIGURES}, stopped_by=None)
    if cfg.train.target_psnr:
        reached = r.target_reached_s if r.target_reached_s is not None else (r.train_s if p >= cfg.train.target_psnr else None)
        summary.update(target_psnr=cfg.train.target_psnr, target_reached_s=reached)
    if env.device.type == "cuda":
        summary["gpu_memory"] = gpu_memory(env.device)
    summary.update(method.extra_summary(cfg, tasks, env, eval_scene, field, occupancy, views))
    atomic_write_text(cfg.run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary
