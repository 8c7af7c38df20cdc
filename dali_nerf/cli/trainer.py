"""The trainers' command line (trainers/ddp.py, trainers/spatial.py, trainers/splat.py): ``--config FILE|NAME [--resume]
[key=value ...]``, and the run: a real device (:func:`dali_nerf.train.loop.train`) or the
emulated-device mode (:func:`dali_nerf.train.emulated.train_emulated`, ``train.device=emulated``)."""

from __future__ import annotations

import argparse
import json
from typing import Callable

from dali_nerf.cli.command import run_cli
from dali_nerf.cli.train import trainer_module
from dali_nerf.config import load_config
from dali_nerf.errors import ConfigError
from dali_nerf.train.tasks import Method

__all__ = ["trainer_main", "run_training"]


def run_training(cfg, method: Method, resume: bool = False) -> dict:
    """Train ``method`` on this process's rank: ``train.device=emulated`` runs the emulated-device
    mode (no model, device work as timed waits), any other device the training loop. Returns the
    summary on rank 0, {} on the others."""
    if cfg.train.device == "emulated":
        from dali_nerf.train.emulated import train_emulated

        return train_emulated(cfg, method, resume)
    from dali_nerf.train.loop import train

    return train(cfg, method, resume)


def trainer_main(method_factory: Callable[[], Method], default_config: str, argv=None) -> int:
    """Entry point of a trainer script: ``--config FILE|NAME [--resume] [key=value ...]``.

    Returns the exit code (2 for user errors, printed as one line, no traceback)."""
    p = argparse.ArgumentParser(description="dali_nerf trainer (run under torchrun for several ranks)")
    p.add_argument("--config", default=default_config, help="a YAML file or a shipped config's name (dali-nerf train --list)")
    p.add_argument("--resume", action="store_true", help="continue from runs/<name>/checkpoints/latest")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. train.steps=200")
    args = p.parse_args(argv)

    def go():
        cfg = load_config(args.config, args.overrides)
        method = method_factory()
        if cfg.method != method.name:
            right = trainer_module(cfg.method, f"{args.config}: method").rsplit(".", 1)[-1]
            raise ConfigError(f"{args.config}: method: is {cfg.method!r} but this trainer runs {method.name!r}; use "
                              f"trainers/{right}.py (or dali-nerf train, which picks the trainer from method:)")
        summary = run_training(cfg, method, resume=args.resume)
        if summary:
            keys = ("name", "test_psnr_unmasked", "test_psnr", "stall_fraction", "stall_fraction_after_first_step", "warmup_wait_s", "rays_per_s",
                    "wall_s", "device", "step_s", "floor_step_s", "step_over_floor", "host_keeps_up")
            print(json.dumps({k: summary[k] for k in keys if k in summary}), flush=True)
        return 0

    return run_cli(go)
