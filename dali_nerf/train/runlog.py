"""What a run writes as it goes: ``metrics.jsonl`` (one JSON line per step, resumable), extra rows
appended to it, and the progress bar with the stall split into steady and warm-up."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from dali_nerf.atomic import atomic_write_text
from dali_nerf.config import Config
from dali_nerf.errors import DaliNerfError

__all__ = ["MetricsWriter", "append_metrics_row", "steady_stall", "bar_stall", "progress_bar"]


class MetricsWriter:
    """Appends one JSON line per step. On resume the lines up to the checkpoint are kept (a line
    torn by a kill is dropped) and the rest is rewritten identically by the resumed run. A write
    that fails (disk full) is a one-line error naming the file."""

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        try:
            if resume_step > 0 and path.exists():
                kept = []
                for line in path.read_text().splitlines():
                    try:
                        if json.loads(line).get("step", 0) <= resume_step:
                            kept.append(line)
                    except (json.JSONDecodeError, AttributeError):
                        continue
                atomic_write_text(path, "".join(k + "\n" for k in kept))
            elif path.exists():
                path.unlink()
            self.f = open(path, "a")
        except OSError as e:
            raise DaliNerfError(f"{path}: cannot write metrics ({e.strerror}); free disk space or choose a writable train.runs_dir") from None

    def _guard(self, fn, *a):
        try:
            return fn(*a)
        except OSError as e:
            raise DaliNerfError(f"{self.path}: cannot write metrics ({e.strerror}); free disk space or choose a "
                                f"writable train.runs_dir (the last checkpoint is intact: resume with --resume)") from None

    def write(self, rec: dict):
        self._guard(self.f.write, json.dumps(rec) + "\n")

    def flush(self):
        self._guard(self.f.flush)

    def close(self):
        try:
            self.f.close()
        except OSError:
            pass


def append_metrics_row(path: Path, rec: dict) -> None:
    try:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError as e:
        raise DaliNerfError(f"{path}: cannot write metrics ({e.strerror}); free disk space or choose a writable "
                            f"train.runs_dir (the last checkpoint is intact)") from None


def steady_stall(totals: dict, first_step_wait, steps_run: int):
    """Wait / step time over the steps after the run's first (whose wait is the warm-up: plugin
    load, pipeline build, first run); None with fewer than 2 steps."""
    if first_step_wait is None or steps_run < 2:
        return None
    return (totals["wait"] - first_step_wait[0]) / max(totals["step"] - first_step_wait[1], 1e-9)


def bar_stall(totals: dict, first_step_wait) -> dict:
    """The progress bar's stall fields: the steady stall (after the first step) and the warm-up
    seconds (the first step's wait), shown apart."""
    if first_step_wait is None:
        return {}
    steady = steady_stall(totals, first_step_wait, 2)
    rest = totals["step"] - first_step_wait[1]
    return {"stall": f"{100 * steady:.2f}%" if rest > 0 else "n/a", "warmup": f"{first_step_wait[0]:.2f}s"}


def progress_bar(cfg: Config, method, env, start_step: int):
    if env.rank == 0 and sys.stderr.isatty() or os.environ.get("DALI_NERF_PROGRESS") == "1" and env.rank == 0:
        return tqdm(total=cfg.train.steps, initial=start_step, desc=f"{method.name} x{env.world_size}", dynamic_ncols=True,
                    mininterval=0.5 if sys.stderr.isatty() else 15.0)
    return None
