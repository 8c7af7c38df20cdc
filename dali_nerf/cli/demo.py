"""``dali-nerf demo``: the main job on the built-in default.

1. generate the default ``objects`` scene into ``--data`` (kept if it is already there);
2. validate it (every image header);
3. train with ``--nproc`` ranks under torchrun (DDP, our DALI RayLoader);
4. render held-out views, write ``summary.json`` and a short ``report.md`` in ``runs/<name>/``.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from dali_nerf.atomic import atomic_write_text
from dali_nerf.config import config_file, load_config
from dali_nerf.errors import DaliNerfError
from dali_nerf.scenegen import make_scene
from dali_nerf.cli.validate import validate_scene

__all__ = ["main", "launch_trainer", "write_report", "warmup_wait_s"]

DEFAULT_CONFIG = config_file("ddp_objects.yaml")


def launch_trainer(module: str, nproc: int, config: str | None, overrides, resume: bool = False) -> int:
    """Run ``python -m torch.distributed.run --standalone --nproc_per_node N -m <module>``.

    The parent has already validated the config and the scene, so rank errors are rare; a rank's
    one-line error is passed through and its exit code returned."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module]
    if config:
        cmd += ["--config", str(config)]
    if resume:
        cmd.append("--resume")
    cmd += list(overrides)
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: a restarted worker group must not inherit the launcher's
    # store (stale keys; pytorch/pytorch#135712) — see docs/RELIABILITY.md
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), DALI_NERF_PROGRESS="1")
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return subprocess.call(cmd, env=env)


def warmup_wait_s(run_dir: Path, summary: dict) -> float | None:
    """Warm-up: seconds the run's first step waited for its batch, read from rank 0's
    ``metrics.jsonl`` (the record of step ``resumed_from + 1``; its ``wait_s``). That first wait
    includes loading the operator plugin, building the ray pipeline and its first sampling run;
    every later wait (streaming windows included) counts as steady stall. None when the record
    is missing."""
    first = int(summary.get("resumed_from") or 0) + 1
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("step") == first and "wait_s" in rec:
            return float(rec["wait_s"])
    return None


def write_report(run_dir: Path) -> str:
    """A short markdown report from ``summary.json`` (written atomically); returns its text.

    The data stall is shown as warm-up seconds (the wait for the run's first batch, see
    :func:`warmup_wait_s`) and the steady stall after the first step
    (``stall_fraction_after_first_step``), with the overall fraction (warm-up included) labelled
    as such.
    """
    run_dir = Path(run_dir)
    s = json.loads((run_dir / "summary.json").read_text())
    ph = s["phase_totals_s"]
    step = max(ph["step"], 1e-9)
    steady = s.get("stall_fraction_after_first_step")
    warm = warmup_wait_s(run_dir, s)
    steady_s = f"{100 * steady:.2f}% of step time after the first step" if steady is not None \
        else "n/a (a single step, all of it warm-up)"
    warm_s = f"{warm:.2f} s waiting for the first batch" if warm is not None else "unknown (no metrics.jsonl record)"
    lines = [
        f"# {s['name']}: {s['method']} x{s['world_size']} on {s['device']}",
        "",
        f"- test PSNR **{s['test_psnr']:.2f} dB**, SSIM {s['test_ssim']:.3f} ({s['eval_images']} {s['eval_split']} views)",
        f"- {s['steps']} steps x {s['rays_per_batch']} rays/rank, wall time {s['wall_s']:.1f} s, "
        f"{s['rays_per_s'] / 1e6:.2f} Mrays/s trained",
        f"- data stall (pipeline: {s['pipeline']}): steady {steady_s}; warm-up {warm_s} "
        f"(plugin load, pipeline build, first run); overall {100 * s['stall_fraction']:.2f}% including warm-up",
        "",
        "| phase | seconds | share of step |",
        "|---|---|---|",
    ]
    for k in ("wait", "h2d", "forward", "backward", "sync", "optimizer"):
        lines.append(f"| {k} | {ph[k]:.2f} | {100 * ph[k] / step:.1f}% |")
    lines += ["", "Renders (prediction | ground truth): " + ", ".join(f"renders/{r}" for r in s["renders"]), ""]
    text = "\n".join(lines)
    atomic_write_text(run_dir / "report.md", text, hint="free disk space or choose a writable train.runs_dir")
    return text


def main(args) -> int:
    data = Path(args.data)
    config = args.config or (str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None)
    overrides = [f"scene.path={data}"] + list(args.overrides)
    load_config(config, overrides, check_paths=False)  # config errors before any work
    if args.nproc < 1:
        raise DaliNerfError(f"--nproc={args.nproc}: use 1 or more ranks")
    if not data.exists():
        print(f"[1/4] generating the default objects scene into {data}", flush=True)
        make_scene("objects", data)
    else:
        print(f"[1/4] using the existing scene in {data}", flush=True)
    cfg = load_config(config, overrides)
    print("[2/4] validating the scene", flush=True)
    validate_scene(cfg.scene.path, format=cfg.scene.format, progress=False)
    print(f"[3/4] training: {cfg.method} with {args.nproc} ranks, {cfg.train.steps} steps", flush=True)
    module = "dali_nerf.trainers.ddp" if cfg.method == "ddp" else "dali_nerf.trainers.spatial"
    if args.nproc > 1:
        rc = launch_trainer(module, args.nproc, config, overrides)
    else:
        rc = importlib.import_module(module).main((["--config", config] if config else []) + overrides)
    if rc != 0:
        raise DaliNerfError(f"training failed (exit code {rc}); see the messages above")
    print("[4/4] report", flush=True)
    print(write_report(cfg.run_dir), flush=True)
    print(f"outputs in {cfg.run_dir}/", flush=True)
    return 0
