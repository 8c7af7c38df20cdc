"""``dali-nerf bench study``: the characterization study on this machine.

Runs the grid {DDP, SS} x {sync_global, sync_local, rays (pipelined)} x ranks with one base config
(``configs/study.yaml``), each cell a real trainer run (``runs/<runs_dir>/study_<m>_<s>_<r>/``),
then derives everything from the runs' ``metrics*.jsonl`` (:func:`derive`), fits the stated cost
model (:mod:`dali_nerf.bench.costmodel`), projects it to GPU nodes and writes
``<bench.out>/<machine>/report.md`` with PNG plots and ``derived.json`` beside it.

    dali-nerf bench study --config configs/study.yaml [key=value ...]

>>> d = derive(["runs/study/study_ddp_sync_global_1", "runs/study/study_ddp_rays_1"], warmup=10)
>>> d["speedups"][0]["speedup"]        # mean step time sync_global / mean step time rays
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import yaml

from ..config import Config, config_to_dict, load_config
from ..errors import ConfigError, DaliNerfError
from . import costmodel as cm

__all__ = ["main", "derive", "read_run", "machine_slug", "git_commit", "run_grid", "measure_sampling",
           "write_report", "observations", "PHASE_KEYS"]

PHASE_KEYS = ("wait", "h2d", "forward", "backward", "sync", "optimizer")
BASELINES = ("sync_global", "sync_local", "torch_workers")


# ---------------------------------------------------------------------------------------------
# machine and provenance


def machine_slug() -> str:
    """``cpu-2core-x86_64`` or ``gpu-<name>-<n>x-<cores>core-<arch>`` (lower case, no spaces)."""
    cores = os.cpu_count() or 1
    arch = platform.machine() or "unknown"
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
            gpu = f"gpu-{'-'.join(name.split())}-{torch.cuda.device_count()}x"
    except Exception:  # no torch / driver: a CPU machine
        gpu = None
    return f"{gpu or 'cpu'}-{cores}core-{arch}"


def git_commit(repo: Optional[Path] = None) -> str:
    """``git rev-parse HEAD`` plus ``-dirty`` when the working tree has changes; "unknown" outside git."""
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


# ---------------------------------------------------------------------------------------------
# derivation from metrics.jsonl


def _read_jsonl(path: Path) -> List[dict]:
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            raise DaliNerfError(f"{path}:{i + 1}: not a JSON line; delete the run folder and rerun the study") from None
    return out


def read_run(run_dir, warmup: Optional[int] = None) -> dict:
    """One run's per-step means after ``warmup`` steps, averaged over its ranks.

    Reads ``config.yaml`` (method, pipeline.name, rays_per_batch, bench.warmup when ``warmup`` is
    None), ``metrics.jsonl`` and ``metrics.rank<R>.jsonl`` (one per rank; world size = their
    count) and, when present, ``summary.json`` (test PSNR, SS fusion overhead).

    Returns {"name", "method", "sampler", "ranks", "rays_per_rank", "steps_used",
    "phases_s" {wait, h2d, forward, backward, sync, optimizer} (mean seconds per step and rank),
    "compute_s" (h2d+forward+backward+optimizer), "step_s", "stall" (wait / step),
    "rays_per_s" (all ranks), "test_psnr", "fusion" {...}}.
    """
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise DaliNerfError(f"{cfg_path}: missing; {run_dir} is not a finished training run (rerun the study)")
    cfg = yaml.safe_load(cfg_path.read_text()) or {}
    if warmup is None:
        warmup = int((cfg.get("bench") or {}).get("warmup", 0))
    files = sorted(run_dir.glob("metrics.rank*.jsonl"), key=lambda p: int(p.name.split("rank")[1].split(".")[0]))
    if (run_dir / "metrics.jsonl").is_file():
        files = [run_dir / "metrics.jsonl"] + files
    if not files:
        raise DaliNerfError(f"{run_dir}: no metrics.jsonl; the run did not start (see its log) — rerun the study")
    per_rank = []
    for f in files:
        recs = [r for r in _read_jsonl(f) if int(r.get("step", 0)) > warmup]
        if not recs:
            raise DaliNerfError(f"{f}: no steps after the {warmup} warm-up steps; raise bench.steps or lower bench.warmup")
        per_rank.append({k: float(np.mean([r[f"{k}_s"] for r in recs])) for k in PHASE_KEYS + ("step",)}
                        | {"rays": float(np.mean([r.get("rays", 0) for r in recs])), "n": len(recs)})
    ph = {k: float(np.mean([r[k] for r in per_rank])) for k in PHASE_KEYS}
    step = float(np.mean([r["step"] for r in per_rank]))
    rays_per_step = float(np.sum([r["rays"] for r in per_rank]))
    summary = {}
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    pipe = cfg.get("pipeline") or {}
    return {
        "name": cfg.get("name", run_dir.name), "dir": str(run_dir), "method": cfg.get("method", "ddp"),
        "sampler": pipe.get("name", "rays"), "ranks": len(files),
        "rays_per_rank": int(round(rays_per_step / len(files))) if rays_per_step > 0 else int(pipe.get("rays_per_batch", 0)),
        "steps_used": min(r["n"] for r in per_rank), "warmup": warmup,
        "phases_s": ph, "compute_s": ph["h2d"] + ph["forward"] + ph["backward"] + ph["optimizer"],
        "step_s": step, "stall": ph["wait"] / step if step > 0 else 0.0,
        "rays_per_s": rays_per_step / step if step > 0 else 0.0,
        "test_psnr": summary.get("test_psnr"),
        "torch_threads": int((cfg.get("train") or {}).get("torch_threads", 0) or 0),
        "fusion": {k: v for k, v in summary.items()
                   if k in ("fusion_overhead", "fused_render_s", "single_render_s", "fused_psnr")},
    }


def derive(run_dirs: Sequence, warmup: Optional[int] = None) -> dict:
    """Everything the report states, recomputed from the runs' metrics files.

    Returns {"runs": [read_run(...)...], "speedups": [{"method", "ranks", "baseline",
    "step_baseline_s", "step_pipelined_s", "speedup" (baseline step / pipelined step),
    "stall_baseline", "ideal_speedup" (1 / (1 - stall_baseline))}...], "summary": {"mean_speedup",
    "max_speedup", "max_stall_sync", "mean_stall_sync", "max_stall_pipelined"}}.
    """
    runs = [read_run(d, warmup) for d in run_dirs]
    by_key = {(r["method"], r["sampler"], r["ranks"]): r for r in runs}
    speedups = []
    for r in runs:
        if r["sampler"] not in BASELINES:
            continue
        p = by_key.get((r["method"], "rays", r["ranks"]))
        if p is None:
            continue
        speedups.append({
            "method": r["method"], "ranks": r["ranks"], "baseline": r["sampler"],
            "step_baseline_s": r["step_s"], "step_pipelined_s": p["step_s"],
            "speedup": r["step_s"] / p["step_s"] if p["step_s"] > 0 else float("nan"),
            "stall_baseline": r["stall"], "stall_pipelined": p["stall"],
            "ideal_speedup": 1.0 / (1.0 - r["stall"]) if r["stall"] < 1 else float("inf"),
        })
    sync_stalls = [r["stall"] for r in runs if r["sampler"] in BASELINES]
    pipe_stalls = [r["stall"] for r in runs if r["sampler"] == "rays"]
    sp = [s["speedup"] for s in speedups]
    summary = {
        "mean_speedup": float(np.mean(sp)) if sp else None,
        "max_speedup": float(np.max(sp)) if sp else None,
        "mean_stall_sync": float(np.mean(sync_stalls)) if sync_stalls else None,
        "max_stall_sync": float(np.max(sync_stalls)) if sync_stalls else None,
        "max_stall_pipelined": float(np.max(pipe_stalls)) if pipe_stalls else None,
    }
    return {"runs": runs, "speedups": speedups, "summary": summary}


def observations(derived: dict, cores: Optional[int] = None) -> List[cm.Observation]:
    """Cost-model observations from :func:`derive`'s runs (cores per rank = the run's
    train.torch_threads, else cores // ranks as the trainer sets it)."""
    cores = cores or os.cpu_count() or 1
    return [cm.Observation(r["method"], r["sampler"], r["ranks"], r["rays_per_rank"],
                           r.get("torch_threads") or max(1, cores // r["ranks"]),
                           r["phases_s"]["wait"], r["compute_s"], r["phases_s"]["sync"], r["step_s"])
            for r in derived["runs"] if r["sampler"] in cm.SAMPLERS]


# ---------------------------------------------------------------------------------------------
# sampling micro-benchmark (independent of the training runs: the cost model is checked on them)


def _time_source(cfg: Config, scene, batches: int) -> float:
    from ..sources import build_source

    if cfg.pipeline.name == "rays":  # cover several DALI runs, not just pops of one prefetched run
        per_run = -(-cfg.pipeline.rays_per_run // cfg.pipeline.rays_per_batch)
        batches = max(batches, 3 * per_run)
    src = build_source(cfg, scene, 0, 1)
    try:
        it = iter(src)
        for _ in range(2):
            next(it)
        t0 = time.perf_counter()
        for _ in range(batches):
            next(it)
        return (time.perf_counter() - t0) / batches
    finally:
        if hasattr(src, "close"):
            src.close()


def measure_sampling(cfg: Config, sizes: Sequence[int], batches: int = 20) -> dict:
    """Seconds per batch of the synchronous sampler (sync_local, world size 1, train.torch_threads) and of our
    pipelined loader with no consumer (its production rate), at each batch size.

    Returns {"sizes", "sync_s" [...], "loader_s" [...], "sync_cores", "loader_cores", "profile"
    (a :class:`~dali_nerf.bench.costmodel.SamplingProfile`, per-core costs)}."""
    import copy

    import torch

    from ..scenes import load_scene

    sc = cfg.scene
    scene = load_scene(sc.path, split=sc.train_split, format=sc.format, downscale=sc.downscale, background=sc.background)
    cores = os.cpu_count() or 1
    threads = cfg.train.torch_threads or cores  # as the trainer's rank would run it
    torch.set_num_threads(threads)
    out = {"sizes": list(sizes), "sync_s": [], "loader_s": []}
    for b in sizes:
        c = copy.deepcopy(cfg)
        c.pipeline.rays_per_batch = int(b)
        c.pipeline.name = "sync_local"
        out["sync_s"].append(_time_source(c, scene, batches))
        c.pipeline.name = "rays"
        out["loader_s"].append(_time_source(c, scene, batches))
    sync_cores = threads
    loader_cores = min(cfg.pipeline.num_threads, cores)
    s0, ks = cm.fit_linear(sizes, out["sync_s"])
    p0, kp = cm.fit_linear(sizes, out["loader_s"])
    out["sync_cores"], out["loader_cores"] = sync_cores, loader_cores
    out["profile"] = cm.SamplingProfile(s0, ks * sync_cores, p0, kp * loader_cores, cores)
    return out


# ---------------------------------------------------------------------------------------------
# the grid


def _cell_name(method: str, sampler: str, ranks: int) -> str:
    return f"study_{method}_{sampler}_{ranks}"


def run_grid(cfg: Config, config_path: str, overrides: Sequence[str], log=print):
    """Run every (method, sampler, ranks) cell of ``cfg.bench`` as a trainer process.

    Returns (run folders of the cells that finished, [(cell name, one-line reason, log file)] of
    those that failed); the report lists the failed ones. Every cell failing raises
    :class:`DaliNerfError` naming the first log file."""
    b = cfg.bench
    root = Path(cfg.train.runs_dir)
    root.mkdir(parents=True, exist_ok=True)
    dirs, failed = [], []
    cells = [(m, s, r) for m in b.methods for s in b.samplers for r in b.ranks]
    for i, (m, s, r) in enumerate(cells):
        name = _cell_name(m, s, r)
        ov = list(overrides) + [f"method={m}", f"pipeline.name={s}", f"train.steps={b.warmup + b.steps}",
                                f"name={name}", "train.eval_images=1", "train.checkpoint_every=0",
                                f"train.log_every={b.warmup + b.steps}"]
        module = "dali_nerf.trainers.ddp" if m == "ddp" else "dali_nerf.trainers.spatial"
        if r == 1:
            cmd = [sys.executable, "-m", module]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={r}", "-m", module]
        cmd += ["--config", str(config_path)] + ov
        logf = root / f"{name}.log"
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env.pop("DALI_NERF_PROGRESS", None)
        t0 = time.perf_counter()
        with open(logf, "w") as f:
            f.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
            f.flush()
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        if rc != 0:
            tail = [l for l in logf.read_text().splitlines() if l.strip() and not l.startswith(("W", "[W"))][-1:]
            reason = f"exit {rc}: {tail[0][:300] if tail else 'no output'}"
            failed.append((name, reason, str(logf)))
            log(f"[{i + 1}/{len(cells)}] {name}: FAILED ({reason}); log {logf}")
            continue
        log(f"[{i + 1}/{len(cells)}] {name}: {time.perf_counter() - t0:.1f} s")
        dirs.append(root / name)
    if not dirs and failed:
        raise DaliNerfError(f"every study cell failed; first: {failed[0][0]} ({failed[0][1]}) — log: {failed[0][2]}")
    return dirs, failed


def _grad_bytes(cfg: Config) -> int:
    """Bytes of the gradients DDP all-reduces (the radiance field's parameters, float32)."""
    import torch

    from ..models import build_field

    aabb = torch.tensor([[-1.5] * 3, [1.5] * 3])
    field = build_field(cfg.model, aabb)
    return int(sum(p.numel() * p.element_size() for p in field.parameters() if p.requires_grad))


def _sampler_table(cfg: Config) -> Optional[str]:
    """The ``dali-nerf bench sampler`` table (markdown) on the study's scene, at the study's batch
    size and 65536 (``bench.sampler_seconds`` per measurement; 0 skips it)."""
    import argparse
    import tempfile

    if cfg.bench.sampler_seconds <= 0:
        return None
    try:
        from . import sampler as sb
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "sampler.md"
        ns = argparse.Namespace(scene=cfg.scene.path, batches=f"{cfg.pipeline.rays_per_batch},65536",
                                seconds=cfg.bench.sampler_seconds, out=str(out))
        sb.main(ns)
        text = out.read_text()
    cmd = (f"dali-nerf bench sampler --scene {cfg.scene.path} --batches {ns.batches} --seconds {ns.seconds:g}")
    return f"`{cmd}` (run by the study):\n\n" + text.split("\n", 2)[-1]


# ---------------------------------------------------------------------------------------------
# report


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def write_report(out_dir: Path, derived: dict, model: cm.CostModel, validation: List[dict],
                 projection: List[dict], assumptions: "cm.ProjectionAssumptions", meta: dict,
                 sampling: Optional[dict] = None, sampler_table: Optional[str] = None) -> Path:
    """Write ``report.md``, ``derived.json`` and the PNG plots into ``out_dir``; returns the report path."""
    from . import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    plots.plot_phases(derived["runs"], out_dir / "phases.png")
    plots.plot_speedups(derived["speedups"], out_dir / "speedup.png")
    plots.plot_model_check(validation, out_dir / "model_check.png")
    plots.plot_projection(projection, assumptions.lines(), out_dir / "projection.png")

    s = derived["summary"]
    L = [f"# Characterization study on `{meta['machine']}`", "",
         "Generated by the command below; do not edit by hand (rerun it).", "",
         f"- command: `{meta['command']}`",
         f"- commit: `{meta['commit']}`",
         f"- machine: {meta['machine_desc']}",
         f"- date: {meta['date']}, study wall time {meta['wall_s']:.0f} s"
         + (f"; 1-min load average {meta['load_avg_start']:.1f} at start, {meta['load_avg_end']:.1f} at end "
            f"(above the core count = other processes shared the cores and inflated the timings)"
            if "load_avg_start" in meta else ""),
         f"- workload: {meta['workload']}",
         f"- timing: {meta['steps']} timed steps per configuration after {meta['warmup']} warm-up steps "
         f"(means per step and rank; stall = data wait / step time)", ""]
    if meta.get("failed"):
        L += ["## Cells that did not run", ""] + [f"- {n}: {r} (log `{lg}`)" for n, r, lg in meta["failed"]] + [""]
    if meta.get("regime"):
        L += ["## Regime", "", meta["regime"], ""]
    if s["mean_speedup"] is not None:
        L += ["## Result", "",
              f"Synchronous sampling stalls training for {100 * s['mean_stall_sync']:.1f}% of step time on average "
              f"(max {100 * s['max_stall_sync']:.1f}%; the study reports up to 43.3%). Pipelined sampling "
              f"(our DALI RayLoader) stalls at most {100 * s['max_stall_pipelined']:.1f}% and speeds up the step "
              f"{s['mean_speedup']:.2f}x on average, {s['max_speedup']:.2f}x max (the study: 1.95x average, 2.24x max).", ""]
    L += ["## Phase breakdown (ms per step and rank)", "", "![phases](phases.png)", "",
          "| method | sampler | ranks | wait | h2d | forward | backward | sync | optimizer | step | stall | Mrays/s | test PSNR |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in derived["runs"]:
        ph = r["phases_s"]
        psnr = f"{r['test_psnr']:.2f}" if r.get("test_psnr") is not None else "-"
        L.append(f"| {r['method']} | {r['sampler']} | {r['ranks']} | " + " | ".join(_fmt_ms(ph[k]) for k in PHASE_KEYS)
                 + f" | {_fmt_ms(r['step_s'])} | {100 * r['stall']:.1f}% | {r['rays_per_s'] / 1e6:.3f} | {psnr} |")
    fus = [(r["name"], r["fusion"]) for r in derived["runs"] if r["fusion"]]
    if fus:
        L += ["", "SS fusion at inference (from summary.json):", ""]
        for name, f in fus:
            L.append(f"- {name}: " + ", ".join(f"{k} = {v:.4g}" if isinstance(v, (int, float)) else f"{k} = {v}" for k, v in f.items()))
    L += ["", "## Speedup of pipelined sampling", "", "![speedup](speedup.png)", "",
          "speedup = mean step time of the baseline / mean step time with the pipelined loader (same method and ranks); "
          "ideal = 1 / (1 - stall of the baseline).", "",
          "| method | ranks | baseline | step baseline ms | step pipelined ms | speedup | ideal | stall baseline | stall pipelined |",
          "|---|---|---|---|---|---|---|---|---|"]
    for x in derived["speedups"]:
        L.append(f"| {x['method']} | {x['ranks']} | {x['baseline']} | {_fmt_ms(x['step_baseline_s'])} | {_fmt_ms(x['step_pipelined_s'])} | "
                 f"{x['speedup']:.2f}x | {x['ideal_speedup']:.2f}x | {100 * x['stall_baseline']:.1f}% | {100 * x['stall_pipelined']:.1f}% |")
    L += ["", "## Sampler throughput", ""]
    if sampler_table:
        L += [sampler_table.strip(), ""]
    else:
        L += ["(`dali-nerf bench sampler` table: generated when that benchmark is available in this checkout.)", ""]
    if sampling:
        L += ["Sampling cost measured on its own for the cost model (world size 1, seconds per batch):", "",
              "| rays per batch | sync sampler ms | sync Mrays/s | pipelined loader ms | loader Mrays/s |", "|---|---|---|---|---|"]
        for b, a, c in zip(sampling["sizes"], sampling["sync_s"], sampling["loader_s"]):
            L.append(f"| {b} | {_fmt_ms(a)} | {b / a / 1e6:.2f} | {_fmt_ms(c)} | {b / c / 1e6:.2f} |")
        L.append("")
    L += ["## Cost model", "", "Per rank and step (B rays per rank, G ranks, c cores per rank; see dali_nerf/bench/costmodel.py):", "",
          "```",
          "compute = c0 + kc * B / c",
          "sync    = 0 (G = 1) | a + 2 (G-1)/G * grad_bytes * beta      (ring all-reduce; DDP only)",
          "wait    = s0 + ks * B / c                                     (sync_local)",
          "        = s0 + ks * G*B / c + gamma * (G-1) * B * ray_bytes    (sync_global: rank 0 samples, scatters)",
          "        = max(0, p0 + kp * B / c - (compute + sync))           (rays: overlapped with compute)",
          "```", "", "| parameter | value |", "|---|---|"]
    md = model.to_dict()
    for k, v in md.items():
        if k == "notes":
            continue
        L.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    L += [""] + [f"- {n}" for n in model.notes]
    errs = [abs(v["step_error"]) for v in validation]
    L += ["", "Check against the measured runs (step time; the sampling terms are measured separately, so the wait "
          "predictions are out of sample; compute and all-reduce are fit on these runs). The model is data "
          "parallel's: SS sampling also pays for routing and rejected candidates, which it has no term for, so "
          "SS runs are not fitted or checked here:", "", "![model check](model_check.png)", "",
          "| method | sampler | ranks | step measured ms | step predicted ms | error | stall measured | stall predicted |",
          "|---|---|---|---|---|---|---|---|"]
    for v in validation:
        L.append(f"| {v['method']} | {v['sampler']} | {v['ranks']} | {_fmt_ms(v['step_measured_s'])} | {_fmt_ms(v['step_predicted_s'])} | "
                 f"{100 * v['step_error']:+.1f}% | {100 * v['stall_measured']:.1f}% | {100 * v['stall_predicted']:.1f}% |")
    if errs:
        L += ["", f"Mean absolute step-time error {100 * np.mean(errs):.1f}%, max {100 * np.max(errs):.1f}% (target: within 15%)."]
    L += ["", "## Projection beyond this machine", "", "![projection](projection.png)", "", "Assumptions:", ""]
    L += [f"- {a}" for a in assumptions.lines()]
    L += ["", "| nodes | GPUs/node | sampler | step ms | stall | speedup of pipelined |", "|---|---|---|---|---|---|"]
    for p in projection:
        if p["gpus_per_node"] in (1, 8, 64) and p["nodes"] in (1, 8):
            L.append(f"| {p['nodes']} | {p['gpus_per_node']} | {p['sampler']} | {_fmt_ms(p['step_s'])} | {100 * p['stall']:.1f}% | {p['speedup_of_rays']:.2f}x |")
    L.append("")
    report = out_dir / "report.md"
    report.write_text("\n".join(L))
    raw = {"meta": meta, "derived": derived, "cost_model": md, "validation": validation,
           "projection_assumptions": assumptions.lines(), "projection": projection,
           "sampling": {k: v for k, v in (sampling or {}).items() if k != "profile"}}
    (out_dir / "derived.json").write_text(json.dumps(raw, indent=2, default=float))
    return report


def _machine_desc() -> str:
    desc = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    desc += f" ({line.split(':', 1)[1].strip()})"
                    break
        import torch

        if torch.cuda.is_available():
            desc += f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
        else:
            desc += ", no GPU"
    except Exception:
        pass
    return desc


def main(args) -> int:
    """``dali-nerf bench study --config FILE [key=value ...]``."""
    config_path = args.config
    overrides = list(getattr(args, "overrides", []) or [])
    cfg = load_config(config_path, overrides, check_paths=False)
    b = cfg.bench
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    if not Path(cfg.scene.path).exists():
        from ..scenegen import make_scene

        print(f"generating the study scene ({b.scene_kind}, {b.scene_images} images, {b.scene_resolution} px) into {cfg.scene.path}", flush=True)
        make_scene(b.scene_kind, Path(cfg.scene.path), width=b.scene_resolution, height=b.scene_resolution,
                   n_train=b.scene_images)
    dirs, failed = run_grid(cfg, config_path, overrides)
    derived = derive(dirs, warmup=b.warmup)

    sampling = None
    if b.sampling_sizes:
        print("measuring sampling cost on its own", flush=True)
        sampling = measure_sampling(cfg, b.sampling_sizes)
    grad_bytes = _grad_bytes(cfg)
    # The cost model is DDP's (the projection is about data-parallel scaling): SS sampling also pays
    # for routing and rejected candidates, which the model has no term for, so SS runs are neither
    # fitted nor checked against it (their measured numbers are in the tables above).
    obs = [o for o in observations(derived) if o.method == "ddp"] or observations(derived)
    model = cm.fit(obs, sampling=sampling["profile"] if sampling else None, grad_bytes=grad_bytes,
                   allreduce_latency_s=b.allreduce_latency_s)
    validation = cm.validate(model, obs)

    B = cfg.pipeline.rays_per_batch
    if b.gpu_step_ms > 0:
        gpu_c, src = b.gpu_step_ms / 1e3, f"bench.gpu_step_ms={b.gpu_step_ms}"
    else:
        cpu_c = model.compute_s(B, 1)
        gpu_c, src = cpu_c / b.gpu_cpu_ratio, f"measured single-core CPU compute {cpu_c * 1e3:.1f} ms / bench.gpu_cpu_ratio={b.gpu_cpu_ratio:g}"
    assumptions = cm.ProjectionAssumptions(gpu_compute_s=gpu_c, gpu_compute_source=src, rays_per_rank=B,
                                           cores_per_gpu=b.cores_per_gpu)
    projection = cm.project(model, assumptions)
    machine = machine_slug()
    cmd = "dali-nerf bench study --config " + shlex.quote(str(config_path)) + "".join(" " + shlex.quote(o) for o in overrides)
    meta = {
        "machine": machine, "machine_desc": _machine_desc(), "command": cmd, "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": time.perf_counter() - t_start,
        "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
        "steps": b.steps, "warmup": b.warmup, "grad_bytes": grad_bytes,
        "workload": (f"scene {cfg.scene.path}, {B} rays per rank per step, model "
                     + " ".join(f"{k}={v}" for k, v in config_to_dict(cfg.model).items())
                     + f", {grad_bytes / 1e6:.2f} MB of gradients"),
        "regime": b.regime, "failed": failed,
    }
    out = Path(b.out) / machine
    report = write_report(out, derived, model, validation, projection, assumptions, meta, sampling, _sampler_table(cfg))
    s = derived["summary"]
    if s["mean_speedup"] is not None:
        print(f"stall sync: mean {100 * s['mean_stall_sync']:.1f}% max {100 * s['max_stall_sync']:.1f}%; "
              f"speedup of pipelined: mean {s['mean_speedup']:.2f}x max {s['max_speedup']:.2f}x", flush=True)
    print(f"report: {report}", flush=True)
    return 0
