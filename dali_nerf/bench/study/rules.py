"""What the study compares and how it judges a row or a pair: the baselines, the ISPASS study's
numbers, the one "keeps up" threshold (both ways: :data:`BAND`), the starved host, the pairs that may
be set beside the ISPASS study (:func:`comparable`) and the main grid (:func:`main_grid`).

>>> starved({"device": "emulated", "cores_per_gpu": 0.5}), keeps_up_reason({"stall": 0.03, "step_over_floor": 1.0})
(True, 'stall 3.0% > 2%')
"""

from __future__ import annotations

from typing import List, Optional

from dali_nerf.train import emulation as emu
from dali_nerf.train.emulation import KEEPS_UP_STALL, KEEPS_UP_STEP
from dali_nerf.bench import emulated as em

__all__ = ["BASELINES", "BAND", "PAPER", "KEEPS_UP_STALL", "KEEPS_UP_STEP", "starved", "keeps_up", "keeps_up_reason",
           "comparable", "main_grid", "headline", "headline_rule"]

BASELINES = ("sync_global", "sync_local", "torch_workers")
"""The synchronous baselines (the ISPASS study's sync_global and the usual codebases'); the
same-sampler control ``rays_sync`` is paired with the pipelined run too (its speedup is the overlap
gain) but is not one of them."""
BAND = (1.0 / KEEPS_UP_STEP, KEEPS_UP_STEP)
"""The one threshold (:func:`dali_nerf.train.emulation.keeps_up`), both ways: a pipelined step more than
``KEEPS_UP_STEP`` x its floor's does not keep up (and its pairs are flagged); less than the floor's /
``KEEPS_UP_STEP`` is spread. Without a floor the same band bounds speedup / ideal."""
PAPER = {"stall": 0.433, "speedup_mean": 1.95, "speedup_max": 2.24}
"""What the ISPASS 2024 study reports: input sampling up to 43.3% of training time; overlapping it
with training 1.95x faster on average, 2.24x at most."""


def starved(c: dict) -> bool:
    """An emulated row (or pair) below 1 core per GPU: a host no GPU server is (never compared with
    the ISPASS study)."""
    return c.get("device") == "emulated" and c.get("cores_per_gpu") is not None and c["cores_per_gpu"] < 1


def comparable(x: dict, main: Optional[int] = None) -> bool:
    """A pair the report may set beside the ISPASS study: emulated GPUs, at least 1 core per GPU,
    a synchronous baseline split by the control (both gains), not flagged, of the main grid (not the
    cost model's check segments nor the small scene's cache row) and with the main grid's trials
    (``main``: :func:`main_grid`; None: any)."""
    return (x["device"] == "emulated" and not starved(x) and x.get("cores_per_gpu") is not None
            and x["baseline"] in BASELINES and x.get("sampler_gain") is not None and not x["flags"]
            and (x.get("grid") or "main") == "main" and (main is None or int(x.get("trials") or 0) >= main))


def main_grid(speedups: List[dict]) -> Optional[int]:
    """The trials of the emulated main grid (its pairs: grid "main"): the most any of them has; None
    without one."""
    n = [int(x.get("trials") or 0) for x in speedups if x["device"] == "emulated" and (x.get("grid") or "main") == "main"]
    return max(n) if n else None


def headline_rule(steps: Optional[str] = None) -> str:
    """The headline's rule in words (fixed before the study runs, whatever its result)."""
    return ("DDP against sync_global, the launches on every usable core with at least 2 emulated GPUs and at least 1 "
            "core per GPU, " + (f"the device step {steps!r} (the first measured one), " if steps else "")
            + "every rays per GPU of the sweep, flagged or not")


def headline(x: dict, host_cores: Optional[int], step_name: Optional[str]) -> bool:
    """Whether pair ``x`` is a headline row (:func:`headline_rule`): DDP, sync_global, the main grid,
    ``host_cores`` cores (a launch on every usable core; None: any), >= 2 ranks at >= 1 core per GPU,
    the device step ``step_name`` (None: any)."""
    return (x["device"] == "emulated" and x["method"] == "ddp" and x["baseline"] == "sync_global"
            and (x.get("grid") or "main") == "main" and x["ranks"] >= 2 and x.get("cores_per_gpu") is not None
            and x["cores_per_gpu"] >= 1 and (host_cores is None or x.get("cores") == host_cores)
            and (step_name is None or x.get("step_name") == step_name))


def keeps_up(c: dict) -> Optional[bool]:
    """For a pipelined emulated row with a floor: the host supplies the demand
    (:func:`dali_nerf.train.emulation.keeps_up` of its stall and step over the floor's: the rule of the
    pairs' flags too); None for other rows."""
    if c["device"] != "emulated" or c["sampler"] != em.PIPELINED or c.get("step_over_floor") is None:
        return None
    return emu.keeps_up(c["stall"], c["step_over_floor"])


def keeps_up_reason(c: dict) -> str:
    """Which of :func:`keeps_up`'s rules a row breaks ("" when none)."""
    return ", ".join(emu.keeps_up_reason(c["stall"], c.get("step_over_floor")))
