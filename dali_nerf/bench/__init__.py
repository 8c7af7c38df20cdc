"""``dali-nerf bench sampler|study|loop|decode|images`` (docs/BENCHMARKS.md).

* ``sampler``: one table of delivered rays/s of RayLoader and the baselines at several batch
  sizes, plus decode images/s (:mod:`dali_nerf.bench.sampler`).
* ``study``: the characterization study grid (:mod:`dali_nerf.bench.study`).
* ``loop``: the training loop's step, wait and stall per source against a ready-batch floor, on
  this machine's training device (:mod:`dali_nerf.bench.loop`).
* ``decode``: decode images/s of the CPU decoder and, on a GPU, nvJPEG (:mod:`dali_nerf.bench.decode`).
* ``images``: image batches for splatting trainers, ImageLoader against gsplat's spawned-worker and
  per-process-cache paths (:mod:`dali_nerf.bench.images`).
"""

from __future__ import annotations

import importlib

from dali_nerf.errors import ConfigError

__all__ = ["main"]


def main(args) -> int:
    """Dispatch on ``args.bench`` ("sampler" | "study" | "loop" | "decode" | "images")."""
    # imported by name when chosen, as cli.py does for subcommands: `import dali_nerf.bench` and
    # `dali-nerf --help` stay free of torch, DALI and matplotlib
    if args.bench in ("sampler", "study", "loop", "decode", "images"):
        return importlib.import_module(f"dali_nerf.bench.{args.bench}").main(args)
    raise ConfigError(f"bench {args.bench!r}: use sampler, study, loop, decode or images")
