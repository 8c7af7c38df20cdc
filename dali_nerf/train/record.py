"""A run's record when a resume finds nothing to train.

``--resume`` on a run that already reached its last step (by hand, or a torchrun restart of a
worker group killed after its last checkpoint) used to train no step and then rewrite
``summary.json`` with that empty segment's figures: ``final_train_loss: null``, zero phase
totals, ``rays_per_s: 0.0``. Now such a resume changes nothing the run wrote:

* with a **summary of record** (``summary.json`` of the checkpoint's step): it is kept, and the
  resume is noted beside its figures (``resumed_at_end``: when, on how many ranks); metrics.jsonl,
  the renders, TensorBoard and config.yaml are not touched;
* without one (the run ended after its last checkpoint and before its summary): the final
  evaluation runs (test PSNR, renders, TensorBoard images) and ``summary.json`` is written with
  the figures that belong to the run: ``final_train_loss`` from metrics.jsonl, and ``null`` for
  the timing figures of a segment that never ran (they are in metrics.jsonl, step by step), with
  the same note.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from dali_nerf.atomic import atomic_write_text

__all__ = ["last_step", "summary_of_record", "note_resume", "write_noted", "loss_at", "NO_FIGURES"]

NO_FIGURES = ("phase_totals_s", "stall_fraction", "stall_fraction_after_first_step", "warmup_wait_s", "rays_per_s",
              "wall_s", "train_s", "source_stats")
"""The summary's figures of a training segment; ``null`` when a summary is written for a run
resumed at its end without a summary of record (no segment ran)."""


def last_step(cfg) -> int:
    """The step a run of ``cfg`` ends at: ``train.stop_after`` when set (and below ``train.steps``),
    else ``train.steps``."""
    return min(cfg.train.stop_after or cfg.train.steps, cfg.train.steps)


def summary_of_record(run_dir: Path, step: int) -> Optional[dict]:
    """``summary.json`` of ``run_dir`` when it reports ``step`` (the run's summary at that step),
    else None (missing, unreadable, or of another step)."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("steps") == step else None


def note_resume(summary: dict, step: int, world_size: int, record: bool) -> dict:
    """``summary`` with this resume noted in ``resumed_at_end`` (a list: one entry per such resume)."""
    note = {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "step": int(step), "world_size": int(world_size),
            "trained_steps": 0,
            "summary": "of record, kept" if record else "written by this resume: the run had none at its last step"}
    return dict(summary, resumed_at_end=list(summary.get("resumed_at_end") or []) + [note])


def write_noted(run_dir: Path, summary: dict) -> None:
    atomic_write_text(Path(run_dir) / "summary.json", json.dumps(summary, indent=2))


def loss_at(run_dir: Path, step: int) -> Optional[float]:
    """The training loss of ``step`` in ``metrics.jsonl`` (rank 0's), or None."""
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("step") == step and "loss" in row:
            return row["loss"]
    return None
