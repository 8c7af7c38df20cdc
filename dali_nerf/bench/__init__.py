"""``dali-nerf bench sampler|study`` (docs/BENCHMARKS.md).

* ``sampler``: one table of delivered rays/s of RayLoader and the baselines at several batch
  sizes, plus decode images/s (:mod:`dali_nerf.bench.sampler`).
* ``study``: the characterization study grid (:mod:`dali_nerf.bench.study`).
"""

from __future__ import annotations

import importlib

from dali_nerf.errors import ConfigError

__all__ = ["main"]


def main(args) -> int:
    """Dispatch on ``args.bench`` ("sampler" | "study")."""
    # imported by name when chosen, as cli.py does for subcommands: `import dali_nerf.bench` and
    # `dali-nerf --help` stay free of torch, DALI and matplotlib
    if args.bench == "sampler":
        return importlib.import_module("dali_nerf.bench.sampler").main(args)
    if args.bench == "study":
        return importlib.import_module("dali_nerf.bench.study").main(args)
    raise ConfigError(f"bench {args.bench!r}: use sampler or study")
