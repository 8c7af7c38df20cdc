"""One run of the study, read from its folder: per-step means after the warm-up, averaged over its
ranks (:func:`read_run`), and the key that groups runs into configurations (:func:`config_key`).

>>> r = read_run("runs/study/emu_ddp_2/rays_9.289ms_b4096_t0_3")
>>> r["step_s"], r["stall"], r["cores_per_gpu"]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import numpy as np
import yaml

from dali_nerf.errors import DaliNerfError

__all__ = ["read_run", "config_key", "with_sampler", "PHASE_KEYS"]

PHASE_KEYS = ("wait", "h2d", "forward", "backward", "sync", "optimizer")


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

    Reads ``config.yaml`` (method, pipeline.name, rays_per_batch, train.device,
    train.emulated_step_ms, bench.warmup when ``warmup`` is None), ``metrics.jsonl`` and
    ``metrics.rank<R>.jsonl`` (one per rank; world size = their count), ``study.json`` when present
    (trial, order, pair: the pipelined run next to this baseline; the cores the ranks ran on) and
    ``summary.json`` (test PSNR, SS fusion overhead).

    Returns {"name", "dir", "method", "sampler", "ranks", "device" (cpu | emulated | cuda),
    "emulated_step_ms" (the device ms of a step of its rays), "step_name" (what that step stands for),
    "grid" (main | check | cache), "scene" (its path), "trial", "order", "pair", "rays_per_rank", "steps_used", "phases_s"
    {wait, h2d, forward, backward, sync, optimizer} (mean seconds per step and rank), "compute_s"
    (h2d+forward+backward+optimizer), "step_s", "stall" (wait / step), "rays_per_s" (all ranks),
    "cores" (None when not recorded), "cores_per_gpu" (cores / ranks), "runq_s" (the training
    thread's run-queue wait per step, where the metrics have it), "overshoot_s" (emulated: the
    device wait past the seconds asked, per step), "test_psnr", "fusion" {...}}.
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
                        | {"rays": float(np.mean([r.get("rays", 0) for r in recs])), "n": len(recs)}
                        | {k: float(np.mean([r[f"{k}_s"] for r in recs])) if all(f"{k}_s" in r for r in recs) else None
                           for k in ("cpu", "runq", "overshoot")})
    ph = {k: float(np.mean([r[k] for r in per_rank])) for k in PHASE_KEYS}
    step = float(np.mean([r["step"] for r in per_rank]))
    rays_per_step = float(np.sum([r["rays"] for r in per_rank]))
    summary = {}
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    st = {}
    if (run_dir / "study.json").is_file():
        st = json.loads((run_dir / "study.json").read_text())
    pipe = cfg.get("pipeline") or {}
    train = cfg.get("train") or {}
    device = st.get("device") or train.get("device", "cpu")
    device = {"auto": "cpu"}.get(device, device)
    ems = train.get("emulated_step_ms") if device == "emulated" else None
    # the share of the host's cores the ranks' processes kept busy (their threads; emulated rows)
    cpu = [r["cpu"] for r in per_rank]
    cores = st.get("cores") or (st.get("budget") or {}).get("cores")
    cores = int(cores) if cores else None
    host_busy = float(np.sum(cpu)) / (step * cores) if None not in cpu and step > 0 and cores else None
    extra = {k: (float(np.mean([r[k] for r in per_rank])) if all(r[k] is not None for r in per_rank) else None)
             for k in ("runq", "overshoot")}
    return {
        "name": cfg.get("name", run_dir.name), "dir": str(run_dir), "method": cfg.get("method", "ddp"),
        "sampler": pipe.get("name", "rays"), "ranks": len(files), "device": device,
        "emulated_step_ms": float(ems) if ems is not None else None,
        "step_name": st.get("step_name"), "grid": st.get("grid") or "main",
        "scene": st.get("scene") or (cfg.get("scene") or {}).get("path"),
        "trial": int(st.get("trial", 0)), "order": st.get("order"), "pair": st.get("pair"),
        "rays_per_rank": int(round(rays_per_step / len(files))) if rays_per_step > 0 else int(pipe.get("rays_per_batch", 0)),
        "steps_used": min(r["n"] for r in per_rank), "warmup": warmup,
        "phases_s": ph, "compute_s": ph["h2d"] + ph["forward"] + ph["backward"] + ph["optimizer"],
        "step_s": step, "stall": ph["wait"] / step if step > 0 else 0.0,
        "rays_per_s": rays_per_step / step if step > 0 else 0.0,
        "test_psnr": summary.get("test_psnr"),
        "torch_threads": int(train.get("torch_threads", 0) or 0),
        "sampler_threads": int(pipe.get("num_threads", 0) or 0),
        "barrier_s": st.get("barrier_s"), "host_busy": host_busy,
        "cores": cores, "cores_per_gpu": cores / len(files) if cores else None,
        "runq_s": extra["runq"], "overshoot_s": extra["overshoot"],
        "fusion": {k: v for k, v in summary.items()
                   if k in ("fusion_overhead", "fused_render_s", "single_render_s", "fused_psnr")},
    }


def config_key(r: dict) -> tuple:
    """What makes a configuration: (device, method, ranks, cores, scene, grid, device step name, device
    step ms, rays per rank, sampler); the sampler last (:func:`with_sampler`)."""
    return (r["device"], r["method"], r["ranks"], r.get("cores"), r.get("scene"), r.get("grid") or "main",
            r.get("step_name"), r["emulated_step_ms"], r["rays_per_rank"], r["sampler"])


def with_sampler(k: tuple, sampler: str) -> tuple:
    """Key ``k`` (of :func:`config_key`) with another sampler: the same configuration's floor, pipelined run or control."""
    return k[:-1] + (sampler,)

