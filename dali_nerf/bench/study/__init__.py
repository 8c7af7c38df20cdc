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
overlap gain (rays_sync -> rays); what the control pays and the pipelined loader does not (the copy
out of DALI's buffers, the synchronous executor) is measured apart (:mod:`.control`) and reported as
its own factor. Emulated launches also run pinned to fewer cores (``bench.emulated_cores``), so
regimes are named, and compared, by cores per GPU; every device step is named by what it stands for
(measured, stated, assumed: :mod:`.steps`) at each of the swept rays per GPU (``bench.rays``), on a
capture-sized scene, with the small scene as one cache-effect row (``bench.small_scene``). The
headline is fixed by a rule before anything runs (:func:`~.rules.headline`).

Everything is then derived from the runs' ``metrics*.jsonl`` (:func:`derive`: mean and 95%
t-interval over trials of step time, stall, hidden stall, speedup and its two gains; pairs flagged
when the speedup is not explained by the baseline's stall), the cost model is fit on the small
emulated runs and checked on those it did not see, and ``<bench.out>/<machine>/report.md`` is
written with PNG plots and ``derived.json`` beside it. A cell or launch that failed is listed in
the report, and the command then exits 2 naming it.

    dali-nerf bench study --config configs/study.yaml [--quotes [--checkout DIR]] [key=value ...]

``--quotes`` also writes what README.md and docs/BENCHMARKS.md quote from the report (:mod:`.quotes`),
once every cell ran: the report, its plots and the sentences that quote it from one command.

The package, one concern per module, imports one way (down this list):

* :mod:`.runs`        what runs: the CPU grid, the emulated launches, the sampling micro-benchmark,
                      the ``bench sampler`` table; :mod:`.control`: the control's own cost;
* :mod:`.quotes`      README's sentences and BENCHMARKS' history row, from a derived.json;
* :mod:`.report`      report.md / derived.json / plots, and the same report from a derived.json;
* :mod:`.result_section`, :mod:`.sections`  the report's sections, one function each (:mod:`.fmt`: how a
                      number is written);
* :mod:`.model`       the cost model on the study's measurements (fit on some runs, checked on the rest);
* :mod:`.derive`      the numbers, from the runs' metrics files: :mod:`.summary` (the like-for-like
                      comparison, the quoted numbers) over :mod:`.pairs` (configurations and pairs)
                      over :mod:`.read` (one run), :mod:`.rules` (what is compared and judged how)
                      and :mod:`.stats` (intervals);
* :mod:`.steps`       the grid: named device steps, rays per GPU, what it leaves out;
* :mod:`.provenance`  machine, CPU, cache and commit.

>>> d = derive(["runs/study/study_ddp_sync_global_1_t0_0", "runs/study/study_ddp_rays_1_t0_1"], warmup=10)
>>> d["speedups"][0]["speedup"], d["speedups"][0]["speedup_ci"]
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

from dali_nerf.config import config_to_dict, load_config
from dali_nerf.train.emulation import model_grad_bytes
from dali_nerf.errors import ConfigError, DaliNerfError
from dali_nerf.scenegen import make_scene
from dali_nerf.scenes import load_scene
from dali_nerf.bench.study import quotes
from dali_nerf.bench.study.control import measure_control
from dali_nerf.bench.study.derive import (BAND, BASELINES, KEEPS_UP_STALL, KEEPS_UP_STEP, PAPER, PHASE_KEYS, comparable,
                                          derive, derive_summary, gmean_ci, keeps_up, keeps_up_reason, like_for_like,
                                          main_grid, mean_ci, read_run, starved)
from dali_nerf.bench.study.model import fit_and_check, observations, sampling_profile
from dali_nerf.bench.study.provenance import (cpu_model, git_commit, host_cores, last_level_cache, machine_desc,
                                              machine_slug)
from dali_nerf.bench.study.report import REPORT_FORMAT, report_from_derived, write_report
from dali_nerf.bench.study.result_section import headline_sentence, result
from dali_nerf.bench.study.runs import (cpu_plan, emulated_launches, launch_budgets, measure_sampling, run_emulated,
                                        run_grid, sampler_table)
from dali_nerf.bench.study.steps import device_steps, grid_rays, headline_step, left_out
from dali_nerf.bench.study.rules import headline_rule

__all__ = ["main", "derive", "read_run", "machine_slug", "machine_desc", "git_commit", "run_grid", "run_emulated",
           "cpu_plan", "measure_sampling", "sampler_table", "sampling_profile", "write_report", "report_from_derived",
           "observations", "mean_ci", "derive_summary", "fit_and_check", "keeps_up", "headline_sentence",
           "keeps_up_reason", "PHASE_KEYS", "BASELINES", "BAND", "REPORT_FORMAT", "host_cores",
           "comparable", "main_grid", "like_for_like", "starved", "KEEPS_UP_STALL", "KEEPS_UP_STEP", "PAPER", "gmean_ci"]


def _study_config(config_path, overrides):
    """The loaded config; ``pipeline.global_batch`` refused (the study's rows are per-rank batches
    of its own sizes: the key would be ignored)."""
    cfg = load_config(config_path, overrides, check_paths=False)
    if cfg.pipeline.global_batch:
        raise ConfigError(f"{config_path}: pipeline.global_batch={cfg.pipeline.global_batch}: the study sets the rays "
                          f"per rank of every row itself (pipeline.rays_per_batch, bench.check_rays); leave it 0")
    return cfg


def _scene_ready(path, b, resolution: int) -> str:
    """Generate the study's scene at ``path`` when missing (``bench.scene_kind``, ``scene_images``
    images of ``resolution`` px); returns its description: images, size and decoded MB."""
    if not Path(path).exists():
        print(f"generating a study scene ({b.scene_kind}, {b.scene_images} images, {resolution} px) into {path}",
              flush=True)
        make_scene(b.scene_kind, Path(path), width=resolution, height=resolution, n_train=b.scene_images)
    sc = load_scene(path, split="train")
    w, h = sc.width.tolist(), sc.height.tolist()
    size = f"{w[0]}x{h[0]}" if len(set(w)) == 1 and len(set(h)) == 1 else "mixed sizes"
    mb = sum(int(x) * int(y) * 3 for x, y in zip(w, h)) / 1e6
    return f"{path}: {sc.num_images} images of {size}, {mb:.0f} MB of decoded RGB"


def _emulate(cfg, steps, grad_bytes, failed):
    """The emulated launches and their derivation: (emulation or None, derived rows or None)."""
    b = cfg.bench
    if not ((b.emulated_ranks or b.emulated_ranks_ss) and b.emulated_samplers and steps):
        return None, None
    emulation = run_emulated(cfg, grad_bytes, steps)
    failed += [tuple(f) for f in emulation["failed"]]
    return emulation, (derive(emulation["dirs"]) if emulation["dirs"] else None)


def main(args) -> int:
    """``dali-nerf bench study --config FILE [key=value ...]``."""
    config_path = args.config
    overrides = list(getattr(args, "overrides", []) or [])
    cfg = _study_config(config_path, overrides)
    b = cfg.bench
    emulating = bool((b.emulated_ranks or b.emulated_ranks_ss) and b.emulated_samplers)
    steps = device_steps(cfg) if emulating else []
    head = headline_step(steps)
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    scenes = {"main": _scene_ready(cfg.scene.path, b, b.scene_resolution)}
    if b.small_scene and emulating:
        scenes["small"] = _scene_ready(b.small_scene, b, b.small_resolution)
    commit = git_commit()
    grad_bytes = b.emulated_grad_bytes or model_grad_bytes(cfg.model)
    dirs, failed = ([], [])
    if b.ranks and b.samplers:
        dirs, failed = run_grid(cfg, config_path, overrides)
    emulation, de = _emulate(cfg, steps, grad_bytes, failed)
    derived = derive(dirs) if dirs else {"trial_runs": [], "runs": [], "speedups": [], "summary": {}}
    if de:
        derived = {k: derived[k] + de[k] for k in ("trial_runs", "runs", "speedups")}
    if not derived["runs"]:
        if failed:
            raise DaliNerfError(f"bench study: nothing ran; {_failed_line(failed)}")
        raise DaliNerfError("bench: no configuration ran (bench.ranks/samplers and bench.emulated_* are all empty)")

    cores = host_cores()
    scene = load_scene(cfg.scene.path, split="train")
    control = None
    if emulation:
        print("measuring the control's own cost apart", flush=True)
        control = measure_control(cfg, scene, sorted(set(grid_rays(cfg)) | set(b.small_rays)), launch_budgets(cfg, steps))
    sampling = None
    if b.sampling_sizes:
        print("measuring sampling cost on its own", flush=True)
        sampling = measure_sampling(cfg, b.sampling_sizes)
    derived["summary"] = derive_summary(derived, rule={"host_cores": cores, "step": head.name if head else None},
                                        control=control)
    B = grid_rays(cfg)[0]
    model, validation, fit_desc = fit_and_check(derived, b, B, grad_bytes, sampling, cores)
    sampler = sampler_table(cfg)
    meta = _meta(cfg, config_path, overrides, steps, head, scenes, commit, t_start, load0, grad_bytes, fit_desc,
                 failed, cores)
    report = write_report(Path(b.out) / machine_slug(), derived, model, validation, meta, sampling, sampler, emulation,
                          control, cores=cores)
    # the report's Result section, as it is written there (one set of numbers, console and report)
    emu = [c for c in derived["runs"] if c["device"] == "emulated"]
    print("\n".join(result(derived["summary"], emu, derived["speedups"], meta)), flush=True)
    print(f"report: {report}", flush=True)
    if failed:
        raise DaliNerfError(f"bench study: the report ({report}) was written without {_failed_line(failed)}")
    if getattr(args, "quotes", False):
        _write_quotes(report.parent / "derived.json", Path(getattr(args, "checkout", ".")))
    return 0


def _write_quotes(derived_json: Path, checkout: Path) -> None:
    """``--quotes [--checkout DIR]``: README.md's and docs/BENCHMARKS.md's study blocks and history row written
    from the report just written (:mod:`.quotes`); one line naming the file when one cannot be."""
    readme, bench = checkout / "README.md", checkout / "docs" / "BENCHMARKS.md"
    try:
        quotes.write(quotes.load(derived_json), readme, bench)
    except (DaliNerfError, OSError) as e:
        raise DaliNerfError(f"bench study --quotes: the report is written, its quotes are not ({e}); write them with "
                            f"python -m dali_nerf.bench.study.quotes {derived_json} --write") from None
    print(f"quoted: {readme}, {bench}", flush=True)


def _meta(cfg, config_path, overrides, steps, head, scenes, commit, t_start, load0, grad_bytes, fit_desc, failed,
          cores) -> dict:
    """derived.json's ``meta``: provenance, the grid (device steps, rays, the headline rule, what it
    leaves out), budgets and workload."""
    b = cfg.bench
    cmd = "dali-nerf bench study --config " + shlex.quote(str(config_path)) + "".join(" " + shlex.quote(o) for o in overrides)
    cpu_threads = cfg.train.torch_threads or "cores / ranks"
    budgets = (f"CPU rows: {cfg.pipeline.num_threads or 'host-budget'} sampler thread(s) per rank (DALI threads for rays, "
               f"{cfg.pipeline.workers} worker process(es) for torch_workers, the training thread for sync_*) beside "
               f"{cpu_threads} torch thread(s) for compute")
    if steps:
        budgets += ("; emulated rows: per launch, the threads of dali_nerf.data.hostbudget.host_budget (cores per local "
                    "rank) for every sampler (DALI threads, worker processes, the training thread's torch threads), "
                    "listed per launch below, with the priority of the threads and processes that sample ahead "
                    "(pipeline.thread_priority, auto: background for emulated devices, the same for the DALI loaders "
                    "and torch_workers; sync_* sample in the training thread)")
    launches = emulated_launches(cfg, steps, cores) if steps else []
    return {
        "cores": cores, "emulated_cores": list(b.emulated_cores), "machine": machine_slug(), "machine_desc": machine_desc(),
        "cpu": cpu_model(), "l3": last_level_cache(), "command": cmd, "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": time.perf_counter() - t_start,
        "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
        "steps": b.steps, "warmup": b.warmup, "trials": b.trials, "emulated_steps": b.emulated_steps,
        "emulated_warmup": b.emulated_warmup, "rays_grid": grid_rays(cfg), "device_steps": [s.to_dict() for s in steps],
        "headline_step": head.name if head else None, "headline_rule": headline_rule(head.name if head else None),
        "left_out": left_out(cfg, launches, cores), "scenes": scenes,
        "grad_bytes": grad_bytes, "rays": grid_rays(cfg)[0], "budgets": budgets, "fit_set": fit_desc,
        "workload": (f"scene {cfg.scene.path}, rays per rank per step {', '.join(map(str, grid_rays(cfg)))}, model "
                     + " ".join(f"{k}={v}" for k, v in config_to_dict(cfg.model).items())
                     + f", {grad_bytes / 1e6:.2f} MB of gradients"),
        "regime": b.regime, "failed": failed, "stream": cfg.pipeline.stream,
    }


def _failed_line(failed) -> str:
    """``N cell(s) that failed: name (reason; log path), ...`` in one line."""
    return (f"{len(failed)} cell(s) that failed: "
            + "; ".join(f"{n} ({r.splitlines()[0][:200]}; log {lg})" for n, r, lg in failed))
