"""``dali-nerf bench study``: the characterization study on this machine, as evidence.

Two kinds of rows, each configuration run ``bench.trials`` times in an order rotated between trials
(:func:`dali_nerf.bench.emulated.pair_order`: every baseline runs next to a pipelined run, and the
speedup of each trial comes from that adjacent pair):

* **cpu**: {DDP, SS} x ``bench.samplers`` x ``bench.ranks``, each run a real trainer process
  (``runs/<runs_dir>/study_<m>_<s>_<r>_t<trial>_<k>/``) with CPU compute;
* **emulated**: one launch per (method, ranks) (:mod:`dali_nerf.bench.emulated`) in which device
  compute, collectives and host-to-device copies are timed waits and host work is real
  (:data:`~dali_nerf.train.emulation.EMULATED_LABEL`), at every ``bench.emulated_step_ms``, beside the
  emulation floor (a source that hands out a ready batch).

Every row runs the same-sampler control ``rays_sync`` too (our DALI sampler synchronous in the
training thread), which splits each speedup into a sampler gain (baseline -> rays_sync) and an
overlap gain (rays_sync -> rays); emulated launches also run pinned to fewer cores
(``bench.emulated_cores``), so regimes are named, and compared, by cores per GPU.

Everything is then derived from the runs' ``metrics*.jsonl`` (:func:`derive`: mean and 95%
t-interval over trials of step time, stall, hidden stall, speedup and its two gains; pairs flagged
when the speedup is not explained by the baseline's stall), the cost model is fit on the small
emulated runs and checked on those it did not see, and ``<bench.out>/<machine>/report.md`` is
written with PNG plots and ``derived.json`` beside it. A cell or launch that failed is listed in
the report, and the command then exits 2 naming it.

    dali-nerf bench study --config configs/study.yaml [key=value ...]

The package, one concern per module, imports one way (down this list):

* :mod:`.runs`        what runs: the CPU grid, the emulated launches, the sampling micro-benchmark,
                      the ``bench sampler`` table;
* :mod:`.report`      report.md / derived.json / plots, and the same report from a derived.json;
* :mod:`.sections`    the report's sections, one function each;
* :mod:`.model`       the cost model on the study's measurements (fit on some runs, checked on the rest);
* :mod:`.derive`      the numbers, from the runs' metrics files: :mod:`.summary` (the like-for-like
                      comparison, the quoted numbers) over :mod:`.pairs` (configurations and pairs)
                      over :mod:`.read` (one run), :mod:`.rules` (what is compared and judged how)
                      and :mod:`.stats` (intervals);
* :mod:`.provenance`  machine and commit.

>>> d = derive(["runs/study/study_ddp_sync_global_1_t0_0", "runs/study/study_ddp_rays_1_t0_1"], warmup=10)
>>> d["speedups"][0]["speedup"], d["speedups"][0]["speedup_ci"]
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import time
from pathlib import Path

from dali_nerf.config import config_to_dict, load_config
from dali_nerf.train.emulation import model_grad_bytes
from dali_nerf.errors import ConfigError, DaliNerfError
from dali_nerf.scenegen import make_scene
from dali_nerf.bench import costmodel as cm
from dali_nerf.bench.study.derive import (BAND, BASELINES, KEEPS_UP_STALL, KEEPS_UP_STEP, PAPER, PHASE_KEYS, comparable, derive,
                     derive_summary, gmean_ci, keeps_up, keeps_up_reason, like_for_like, main_grid, mean_ci,
                     read_run, starved)
from dali_nerf.bench.study.model import fit_and_check, observations, sampling_profile
from dali_nerf.bench.study.provenance import git_commit, host_cores, machine_desc, machine_slug
from dali_nerf.bench.study.provenance import machine_desc as _machine_desc  # main's name for it
from dali_nerf.bench.study.report import REPORT_FORMAT, report_from_derived, sampler_table_of, write_report
from dali_nerf.bench.study.runs import cpu_plan, measure_sampling, run_emulated, run_grid, sampler_table
from dali_nerf.bench.study.sections import result
from dali_nerf.bench.study.runs import sampler_table as _sampler_table  # main's name for it

__all__ = ["main", "derive", "read_run", "machine_slug", "machine_desc", "git_commit", "run_grid", "run_emulated",
           "cpu_plan", "measure_sampling", "sampler_table", "sampling_profile", "write_report", "report_from_derived",
           "sampler_table_of", "observations", "mean_ci", "derive_summary", "fit_and_check", "keeps_up",
           "keeps_up_reason", "PHASE_KEYS", "BASELINES", "BAND", "STEP_MS_SOURCE", "REPORT_FORMAT", "host_cores",
           "comparable", "main_grid", "like_for_like", "starved", "KEEPS_UP_STALL", "KEEPS_UP_STEP", "PAPER", "gmean_ci"]


STEP_MS_SOURCE = ("a stated assumption, not a measurement (no GPU was measured by this project): a range meant to "
                  "cover fast grid-based NeRF training steps on one datacenter GPU, whose fused field kernels take "
                  "milliseconds per step at batch sizes of this order; measure a model's own step with "
                  "dali-nerf bench loop on a GPU (scripts/gpu_study.sh's loop step) and pass its loop.json as "
                  "bench.device_step_file")


def _study_config(config_path, overrides):
    """The loaded config; ``pipeline.global_batch`` refused (the study's rows are per-rank batches
    of its own sizes: the key would be ignored)."""
    cfg = load_config(config_path, overrides, check_paths=False)
    if cfg.pipeline.global_batch:
        raise ConfigError(f"{config_path}: pipeline.global_batch={cfg.pipeline.global_batch}: the study sets the rays "
                          f"per rank of every row itself (pipeline.rays_per_batch, bench.check_rays); leave it 0")
    return cfg


def main(args) -> int:
    """``dali-nerf bench study --config FILE [key=value ...]``."""
    config_path = args.config
    overrides = list(getattr(args, "overrides", []) or [])
    cfg = _study_config(config_path, overrides)
    step_ms_source, device_step = STEP_MS_SOURCE, None
    if cfg.bench.device_step_file:  # the device step measured on a GPU (dali-nerf bench loop), not assumed
        from dali_nerf.bench.loop import read_device_step

        device_step = read_device_step(cfg.bench.device_step_file, cfg.pipeline.rays_per_batch)
        ms = device_step["ms_per_4096"]
        cfg.bench = dataclasses.replace(cfg.bench, emulated_step_ms=[ms], check_step_ms=ms,
                                        emulated_grad_bytes=cfg.bench.emulated_grad_bytes or device_step["grad_bytes"])
        step_ms_source = device_step["source"]
        print(f"device step from {cfg.bench.device_step_file}: {ms:.3f} ms per 4096 rays "
              f"({device_step['compute_ms']:.3f} ms at {device_step['rays']} rays)", flush=True)
    b = cfg.bench
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    if not Path(cfg.scene.path).exists():
        print(f"generating the study scene ({b.scene_kind}, {b.scene_images} images, {b.scene_resolution} px) into {cfg.scene.path}", flush=True)
        make_scene(b.scene_kind, Path(cfg.scene.path), width=b.scene_resolution, height=b.scene_resolution,
                   n_train=b.scene_images)
    commit = git_commit()
    # the gradients of the model whose device step was measured, when it was (the emulated rows' all-reduce)
    grad_bytes = b.emulated_grad_bytes if device_step else model_grad_bytes(cfg.model)
    dirs, failed = ([], [])
    if b.ranks and b.samplers:
        dirs, failed = run_grid(cfg, config_path, overrides)
    emulation = None
    if (b.emulated_ranks or b.emulated_ranks_ss) and b.emulated_samplers and b.emulated_step_ms:
        emulation = run_emulated(cfg, grad_bytes)
        failed = failed + [tuple(f) for f in emulation["failed"]]
    derived = derive(dirs) if dirs else {"trial_runs": [], "runs": [], "speedups": [], "summary": {}}
    if emulation and emulation["dirs"]:
        de = derive(emulation["dirs"])
        derived = {"trial_runs": derived["trial_runs"] + de["trial_runs"], "runs": derived["runs"] + de["runs"],
                   "speedups": derived["speedups"] + de["speedups"]}
        derived["summary"] = derive_summary(derived)
    if not derived["runs"]:
        if failed:
            raise DaliNerfError(f"bench study: nothing ran; {_failed_line(failed)}")
        raise DaliNerfError("bench: no configuration ran (bench.ranks/samplers and bench.emulated_* are all empty)")

    sampling = None
    if b.sampling_sizes:
        print("measuring sampling cost on its own", flush=True)
        sampling = measure_sampling(cfg, b.sampling_sizes)
    B = cfg.pipeline.rays_per_batch
    cores = host_cores()
    model, validation, fit_desc = fit_and_check(derived, b, B, grad_bytes, sampling, cores)

    if b.gpu_step_ms > 0:
        gpu_c, src = b.gpu_step_ms / 1e3, f"bench.gpu_step_ms={b.gpu_step_ms}"
    elif emulation:
        gpu_c = b.check_step_ms * 1e-3 * B / 4096
        src = f"the emulated device step bench.check_step_ms={b.check_step_ms:g} ms per 4096 rays"
    else:
        cpu_c = model.compute_s(B, 1)
        gpu_c, src = cpu_c / b.gpu_cpu_ratio, f"fitted single-core compute {cpu_c * 1e3:.1f} ms / bench.gpu_cpu_ratio={b.gpu_cpu_ratio:g}"
    assumptions = cm.ProjectionAssumptions(gpu_compute_s=gpu_c, gpu_compute_source=src, rays_per_rank=B,
                                           cores_per_gpu=b.cores_per_gpu, scaling=_scaling_note(sampling))
    projection = cm.project(model, assumptions)
    machine = machine_slug()
    cmd = "dali-nerf bench study --config " + shlex.quote(str(config_path)) + "".join(" " + shlex.quote(o) for o in overrides)
    cpu_threads = cfg.train.torch_threads or "cores / ranks"
    budgets = (f"CPU rows: {cfg.pipeline.num_threads or 'host-budget'} sampler thread(s) per rank (DALI threads for rays, "
               f"{cfg.pipeline.workers} worker process(es) for torch_workers, the training thread for sync_*) beside "
               f"{cpu_threads} torch thread(s) for compute")
    if emulation:
        budgets += ("; emulated rows: per launch, the threads of dali_nerf.data.hostbudget.host_budget (cores per local "
                    "rank) for every sampler (DALI threads, worker processes, the training thread's torch threads), "
                    "listed per launch below, with the priority of the threads and processes that sample ahead "
                    "(pipeline.thread_priority, auto: background for emulated devices, the same for the DALI loaders "
                    "and torch_workers; sync_* sample in the training thread)")
    meta = {
        "cores": cores, "emulated_cores": list(b.emulated_cores),
        "machine": machine, "machine_desc": _machine_desc(), "command": cmd, "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": time.perf_counter() - t_start,
        "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
        "steps": b.steps, "warmup": b.warmup, "trials": b.trials, "emulated_steps": b.emulated_steps,
        "emulated_warmup": b.emulated_warmup, "emulated_step_ms": list(b.emulated_step_ms),
        "step_ms_source": step_ms_source, "device_step": device_step, "grad_bytes": grad_bytes, "rays": B, "budgets": budgets, "fit_set": fit_desc,
        "workload": (f"scene {cfg.scene.path}, {B} rays per rank per step, model "
                     + (device_step["model_desc"] + " (whose device step was measured)" if device_step else
                        " ".join(f"{k}={v}" for k, v in config_to_dict(cfg.model).items()))
                     + f", {grad_bytes / 1e6:.2f} MB of gradients"),
        "regime": b.regime, "failed": failed, "stream": cfg.pipeline.stream,
    }
    out = Path(b.out) / machine
    report = write_report(out, derived, model, validation, projection, assumptions, meta, sampling,
                          _sampler_table(cfg), emulation, cores=cores)
    # the report's Result section, as it is written there (one set of numbers, console and report)
    emu = [c for c in derived["runs"] if c["device"] == "emulated"]
    print("\n".join(result(derived["summary"], emu, derived["speedups"], meta)), flush=True)
    print(f"report: {report}", flush=True)
    if failed:
        raise DaliNerfError(f"bench study: the report ({report}) was written without {_failed_line(failed)}")
    return 0


def _failed_line(failed) -> str:
    """``N cell(s) that failed: name (reason; log path), ...`` in one line."""
    return (f"{len(failed)} cell(s) that failed: "
            + "; ".join(f"{n} ({r.splitlines()[0][:200]}; log {lg})" for n, r, lg in failed))


def _scaling_note(sampling) -> str:
    """The projection's statement of per-core sampling scaling: what this host measured (1 thread
    against all its cores) and that above that it is assumed linear."""
    sc = (sampling or {}).get("scaling") or {}
    eff = sc.get("efficiency")
    if not eff:
        return "sampling cost per ray per core as measured here, assumed to scale linearly with cores (not measured)"
    n = sc["threads"][-1]
    return (f"sampling cost per ray per core as measured here; 1 -> {n} threads measured at {sc['rays']} rays: "
            f"{100 * eff['sync']:.0f}% of linear (sync sampler), {100 * eff['loader']:.0f}% (pipelined loader); "
            f"linear above {n} assumed, not measured")
