"""TensorBoard event files beside ``metrics.jsonl``.

:class:`TBWriter` writes a run's scalars (loss, PSNR, stall fraction, rays/s, per-phase seconds)
and evaluation images into ``<run_dir>/tensorboard/`` so that ``tensorboard --logdir runs/`` shows
every run. It needs the ``tensorboard`` package (``torch.utils.tensorboard`` imports it; ``pip
install -e '.[tensorboard]'``). ``mode``:

* ``"auto"`` (default): on when ``tensorboard`` is installed, otherwise off (metrics.jsonl is
  always written; TensorBoard is a view of the same numbers);
* ``"always"``: on; a missing ``tensorboard`` is a one-line ConfigError naming the fix;
* ``"never"``: off.

(Not ``on``/``off``: YAML 1.1 reads those, and ``yes``/``no``, as booleans.)

Nothing is created until the first write (no side effects in the constructor). On resume pass
``purge_step=start_step + 1``: TensorBoard then hides the events a killed run wrote after its last
checkpoint, as ``metrics.jsonl`` drops its lines.

>>> tb = TBWriter(run_dir, mode="auto", purge_step=None)
>>> tb.scalars(10, step_scalars(rec, stall_fraction=0.01, rays_per_s=4.2e6))
>>> tb.image(1000, "test/0", pred_and_gt_hwc_uint8)   # (H, W, 3) uint8 or float in [0, 1]
>>> tb.close()
"""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from typing import Mapping, Optional

import numpy as np
import torch

from dali_nerf.errors import ConfigError, DaliNerfError, stderr_line

__all__ = ["TBWriter", "MODES", "tensorboard_available", "resolve_mode", "step_scalars", "PHASE_KEYS"]

MODES = ("auto", "always", "never")
PHASE_KEYS = ("wait", "h2d", "forward", "backward", "sync", "optimizer")
"""The training loop's phases; their ``<phase>_s`` values in a metrics record become ``phase/<phase>_s``."""


def tensorboard_available() -> bool:
    """True when the ``tensorboard`` package (needed by ``torch.utils.tensorboard``) is importable."""
    return importlib.util.find_spec("tensorboard") is not None


def resolve_mode(mode: str, key: str = "train.tensorboard") -> bool:
    """``mode`` (auto | always | never) -> whether to write event files; ConfigError names ``key``."""
    if mode not in MODES:
        raise ConfigError(f"{key}: must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "never":
        return False
    if tensorboard_available():
        return True
    if mode == "always":
        raise ConfigError(f"{key}: 'always' needs the tensorboard package; pip install -e '.[tensorboard]' "
                          f"(or set {key}=auto to train without event files)")
    return False


def step_scalars(rec: Mapping[str, float], stall_fraction: Optional[float] = None,
                 rays_per_s: Optional[float] = None) -> dict:
    """One metrics.jsonl record -> TensorBoard tags.

    ``rec`` holds ``loss``, ``psnr``, ``rays`` and ``<phase>_s`` (training.py's record);
    ``stall_fraction`` and ``rays_per_s`` are the running totals the progress bar shows.
    Returns e.g. ``{"train/loss": .., "train/psnr": .., "loader/stall_fraction": ..,
    "loader/rays_per_s": .., "phase/wait_s": .., ..., "phase/step_s": ..}``.
    """
    out = {}
    for k in ("loss", "psnr"):
        if k in rec:
            out[f"train/{k}"] = float(rec[k])
    if stall_fraction is not None:
        out["loader/stall_fraction"] = float(stall_fraction)
    if rays_per_s is not None:
        out["loader/rays_per_s"] = float(rays_per_s)
    for p in PHASE_KEYS + ("step",):
        if f"{p}_s" in rec:
            out[f"phase/{p}_s"] = float(rec[f"{p}_s"])
    return out


def _hwc_uint8(img) -> np.ndarray:
    """(H, W, 3|4) uint8, or float in [0, 1] (numpy or torch, any device) -> (H, W, C) uint8."""
    a = img.detach().cpu().numpy() if isinstance(img, torch.Tensor) else np.asarray(img)
    if a.ndim != 3 or a.shape[2] not in (1, 3, 4):
        raise ValueError(f"image must be (H, W, 1|3|4), got shape {a.shape}")
    if a.dtype != np.uint8:
        a = np.clip(np.round(a.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
    return a


def _wait_past_existing_events(log_dir: Path, max_wait_s: float = 2.0) -> None:
    """Return once a new event file in ``log_dir`` sorts after every file there.

    TensorBoard reads a run's event files in name order, and a purge (``purge_step``) hides only
    the events of files read before it. A name is ``events.out.tfevents.<second>.<host>.<pid>.<n>``:
    within one second files sort by pid and by a per-process counter as text (``...10`` before
    ``...9``), so a writer opened in the second of an earlier file can sort before it, and the
    killed run's events after the checkpoint show again. Waiting for the next second (at most
    ``max_wait_s``, for a clock set back) makes the new file's second the largest."""
    newest = -1
    for f in log_dir.glob("events.out.tfevents.*"):
        stamp = f.name.split(".")[3]
        if stamp.isdigit():
            newest = max(newest, int(stamp))
    wait = newest + 1 - time.time()
    if wait > 0:
        time.sleep(min(wait, max_wait_s))


class TBWriter:
    """Rank 0's TensorBoard writer for one run (other ranks pass ``mode="never"``).

    Args:
        run_dir: the run folder (``runs/<name>``); events go to ``run_dir/tensorboard``.
        mode: auto | always | never (see the module docstring); resolved here, so a bad value or
            ``always`` without tensorboard fails before training starts.
        purge_step: on resume, ``start_step + 1`` (events at later steps from the killed run are
            hidden); None for a fresh run.
    """

    def __init__(self, run_dir, mode: str = "auto", purge_step: Optional[int] = None):
        self.log_dir = Path(run_dir) / "tensorboard"
        self.enabled = resolve_mode(mode)
        self.purge_step = purge_step
        self._w = None

    def _writer(self):
        if self._w is None:
            from torch.utils.tensorboard import SummaryWriter  # needs tensorboard; only when enabled

            try:
                _wait_past_existing_events(self.log_dir)
                self._w = SummaryWriter(log_dir=str(self.log_dir), purge_step=self.purge_step, flush_secs=30)
            except OSError as e:
                raise DaliNerfError(f"{self.log_dir}: cannot write TensorBoard events ({e.strerror}); "
                                    f"choose a writable train.runs_dir or set train.tensorboard=never") from None
        return self._w

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Write ``{tag: value}`` at ``step`` (e.g. :func:`step_scalars` of a metrics record)."""
        if not self.enabled:
            return
        w = self._writer()
        for tag, v in values.items():
            w.add_scalar(tag, float(v), int(step))

    def image(self, step: int, tag: str, hwc) -> None:
        """Write one image: (H, W, 3) uint8, or float in [0, 1] (numpy or torch)."""
        if not self.enabled:
            return
        self._writer().add_image(tag, _hwc_uint8(hwc), int(step), dataformats="HWC")

    def flush(self) -> None:
        if self._w is not None:
            self._w.flush()

    def close(self, timeout: float = 5.0) -> bool:
        """Close the event file within ``timeout`` seconds; False when its writer thread did not
        finish by then (it is left behind as a daemon: the events flushed before are on disk).

        TensorBoard's close joins its writer thread with no deadline, and after a Ctrl-C that join
        hung past the interrupt's grace period (once, in a random-order suite run under load)."""
        w, self._w = self._w, None
        if w is None:
            return True
        t = threading.Thread(target=w.close, name="dali_nerf-tensorboard-close", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            stderr_line(f"warning: {self.log_dir}: TensorBoard's writer did not close within {timeout:g} s; events "
                        f"after its last flush may be missing")
            return False
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
