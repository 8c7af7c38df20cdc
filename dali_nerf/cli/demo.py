"""``dali-nerf demo``: the main job on the built-in default.

1. generate the default ``objects`` scene into ``--data`` (kept if it is already there);
2. validate it (every image header);
3. train with ``--nproc`` ranks under torchrun (the config's method; DDP with our DALI RayLoader
   by default; the launch of ``dali-nerf train``);
4. render held-out views, write ``summary.json`` and a short ``report.md`` in ``runs/<name>/``.

Signals: the trainer's torchrun is this command's child (:func:`~dali_nerf.cli.train.launch_trainer`),
in a session of its own. Ctrl-C, or SIGTERM / SIGHUP / SIGQUIT / the config's
``train.checkpoint_signal`` sent to this command alone (``kill <pid>``, a job script, a scheduler that signals the top
process), is passed on to torchrun and its ranks: on the checkpoint signal they write the
checkpoint of their last common step; this command waits for them (bounded), writes no report
and exits with 128 + the signal (143 for SIGTERM) and one line naming the checkpoint folder and
the ``dali-nerf train ... --resume`` that continues it. With ``--nproc 1`` the trainer runs in this
process and handles the signal itself; the command ends the same way.
"""

from __future__ import annotations

import importlib
import json
import shlex
import signal
from pathlib import Path

from dali_nerf.atomic import atomic_write_text
from dali_nerf.config import load_config
from dali_nerf.errors import DaliNerfError
from dali_nerf.interrupt import CHECKPOINT_SIGNALS, Terminated
from dali_nerf.scenegen import make_scene
from dali_nerf.cli.train import launch_trainer, trainer_module
from dali_nerf.cli.validate import validate_scene

__all__ = ["main", "write_report", "warmup_wait_s", "DEFAULT_CONFIG"]

DEFAULT_CONFIG = "ddp_objects"
"""The demo's config: the shipped ``ddp_objects`` (``--config`` takes a file or another shipped name)."""


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
        (f"- {s['steps']} steps x {s['rays_per_batch']} rays/rank, wall time {s['wall_s']:.1f} s, "
         f"{s['rays_per_s'] / 1e6:.2f} Mrays/s trained" if s.get("rays_per_batch") is not None else  # image batches
         f"- {s['steps']} steps x {s.get('images_per_batch')} "
         f"{'patches' if s.get('patch_size') else 'images'}/rank, wall time {s['wall_s']:.1f} s, "
         f"{s['rays_per_s'] / 1e6:.2f} Mpixels/s trained"),
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


def _after_signal(cfg, config: str, nproc: int, overrides, signum: int) -> str:
    """The end of the demo's line after a signal stopped its training: no report; where the
    checkpoint is and the command that continues it."""
    ckpt = cfg.run_dir / "checkpoints"
    resume = shlex.join(["dali-nerf", "train", "--config", config, "--nproc", str(nproc), *overrides, "--resume"])
    if signum == getattr(signal, f"SIG{cfg.train.checkpoint_signal}", None):
        return f"no report written; the last checkpoint is in {ckpt} (`{resume}` continues it)"
    return (f"no report written; not the checkpoint signal (train.checkpoint_signal={cfg.train.checkpoint_signal}): "
            f"the ranks stopped without one; any earlier checkpoint stays in {ckpt}")


def main(args) -> int:
    data = Path(args.data)
    config = args.config or DEFAULT_CONFIG
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
    module = trainer_module(cfg.method, f"{config}: method")
    if args.nproc > 1:
        try:
            rc = launch_trainer(module, args.nproc, config, overrides, checkpoint_signal=cfg.train.checkpoint_signal)
        except Terminated as e:
            raise Terminated(e.signum, f"{e}; {_after_signal(cfg, config, args.nproc, overrides, e.signum)}") from None
    else:
        rc = importlib.import_module(module).main((["--config", config] if config else []) + overrides)
        if rc - 128 in {getattr(signal, f"SIG{n}") for n in CHECKPOINT_SIGNALS}:  # the trainer stopped on it
            raise Terminated(rc - 128, f"terminated by {signal.Signals(rc - 128).name}; "
                                       f"{_after_signal(cfg, config, args.nproc, overrides, rc - 128)}")
    if rc != 0:
        raise DaliNerfError(f"training failed (exit code {rc}); see the messages above")
    print("[4/4] report", flush=True)
    print(write_report(cfg.run_dir), flush=True)
    print(f"outputs in {cfg.run_dir}/", flush=True)
    return 0
