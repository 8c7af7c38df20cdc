"""The phases of a training step and the one timer that measures them (the trainers' loop, the
emulated-device mode and the study alike).

A step is ``wait`` (blocked in ``next()`` for the batch: the paper's stall), ``h2d`` (host-to-device
copy), ``forward``, ``backward``, ``sync`` (gradient all-reduce) and ``optimizer``; metrics.jsonl
records each as ``<phase>_s`` with ``step_s`` (and ``cpu_s`` where :meth:`PhaseTimer.record` closes
the step).

On a GPU the boundaries are CUDA events recorded on torch's current stream (``mark``): a span is
read once the step's last event completed (``resolve``: one wait on torch's stream, never a
device-wide synchronize that would also wait for the loader's kernels on their own streams). On
the host they are ``time.perf_counter()`` readings.

What the phases do not show: a step can lose time outside ``next()`` to sampling threads that take
the cores (the training thread ready to run but not running). Linux counts that per thread:
:func:`runq_seconds` reads the calling thread's run-queue wait (``/proc/thread-self/schedstat``,
second field, nanoseconds; ~1 us a read through a kept descriptor), and
:meth:`PhaseTimer.record` writes its growth over the step as ``runq_s``; ``note`` adds other
per-step seconds (the emulated device's wait past what it asked for: ``overshoot_s``).

>>> t = PhaseTimer("cpu"); a = t.mark(); b = t.mark(); t.span("forward", a, b)
>>> with t.phase("wait"):
...     pass
>>> rec = t.record(step=1, rays=4096); sorted(k for k in rec if k.endswith("_s"))[:3]
['backward_s', 'cpu_s', 'forward_s']
>>> "runq_s" in rec      # Linux: the training thread's run-queue wait during the step
True
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

__all__ = ["PHASES", "PhaseTimer", "runq_seconds"]

PHASES = ("wait", "h2d", "forward", "backward", "sync", "optimizer")
"""The phases of a step, in order (``<phase>_s`` in metrics.jsonl)."""


_SCHEDSTAT = threading.local()


def runq_seconds() -> Optional[float]:
    """Seconds the calling thread has spent runnable but waiting for a core since it started
    (``/proc/thread-self/schedstat``: on-CPU ns, run-queue ns, time slices); None where the kernel
    does not expose it (not Linux, or no schedstats). The descriptor is opened once per thread
    (``/proc/thread-self`` names the thread that opens it) and re-read with ``pread``."""
    fd = getattr(_SCHEDSTAT, "fd", None)
    if fd is None:
        try:
            fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except (OSError, AttributeError):
            fd = -1
        _SCHEDSTAT.fd = fd
    if fd < 0:
        return None
    try:
        return int(os.pread(fd, 128, 0).split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return None


class PhaseTimer:
    """Seconds per phase of a step, on the host (CPU) or with CUDA events (GPU).

    Recording: ``mark()`` returns a boundary (a ``perf_counter`` reading, or a CUDA event on
    torch's current stream); ``span(phase, a, b, minus)`` adds ``(b - a) - minus`` seconds to
    ``phase`` once resolved; ``add(phase, s)`` adds host seconds now; ``with phase(name):`` times a
    block on the host. Closing a step: ``resolve(ph)`` adds every pending span and host second into
    the dict ``ph`` (CUDA: after one wait on the step's last event), or ``record(step, rays)``
    returns the step's metrics row (``<phase>_s``, ``step_s`` since the previous record,
    ``cpu_s``: this process's CPU seconds meanwhile, every thread of it; ``runq_s``: the recording
    thread's run-queue wait meanwhile, where :func:`runq_seconds` reads it; and every ``note``) and
    starts the next. ``note(key, seconds)`` adds per-step seconds that are no phase (``<key>_s``).
    """

    def __init__(self, device="cpu"):
        self.cuda = str(getattr(device, "type", device)) == "cuda"
        self._spans: list = []
        self._host: list = []
        self._last = None
        self._notes: Dict[str, float] = {}
        self._t0, self._c0, self._q0 = time.perf_counter(), time.process_time(), runq_seconds()

    @property
    def kind(self) -> str:
        """"cuda_events" or "host"."""
        return "cuda_events" if self.cuda else "host"

    def mark(self):
        if self.cuda:  # pragma: no cover - needs a GPU
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream())
            self._last = ev
            return ev
        return time.perf_counter()

    def span(self, phase: str, a, b, minus: float = 0.0) -> None:
        _check(phase)
        self._spans.append((phase, a, b, minus))

    def add(self, phase: str, seconds: float) -> None:
        """Attribute ``seconds`` measured on the host (or elsewhere) to ``phase``."""
        _check(phase)
        self._host.append((phase, seconds))

    host = add

    def note(self, key: str, seconds: float) -> None:
        """Add ``seconds`` to the step's ``<key>_s`` (a per-step quantity that is no phase)."""
        if key in PHASES or key in ("step", "cpu", "runq"):
            raise ValueError(f"note: {key!r} is a field record() writes itself")
        self._notes[key] = self._notes.get(key, 0.0) + float(seconds)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        _check(name)
        t = time.perf_counter()
        try:
            yield
        finally:
            self._host.append((name, time.perf_counter() - t))

    def resolve(self, ph: Optional[Dict[str, float]] = None) -> Dict[str, float]:
        """Add the pending spans and host seconds into ``ph`` (a new dict of every phase when
        None) and return it."""
        ph = dict.fromkeys(PHASES, 0.0) if ph is None else ph
        if self.cuda and self._last is not None:  # pragma: no cover - needs a GPU
            self._last.synchronize()
        for phase, seconds in self._host:
            ph[phase] += seconds
        for phase, a, b, minus in self._spans:
            d = a.elapsed_time(b) / 1000.0 if self.cuda else b - a
            ph[phase] += d - minus
        self._spans, self._host, self._last = [], [], None
        return ph

    def record(self, step: int, rays: int) -> dict:
        """The metrics.jsonl row of the step that ends now; the next step starts."""
        ph = self.resolve()
        now, cpu, q = time.perf_counter(), time.process_time(), runq_seconds()
        rec = {"step": int(step), "rays": int(rays)} | {f"{k}_s": v for k, v in ph.items()}
        rec["step_s"] = now - self._t0
        rec["cpu_s"] = cpu - self._c0
        if q is not None and self._q0 is not None:
            rec["runq_s"] = q - self._q0
        rec.update({f"{k}_s": v for k, v in self._notes.items()})
        self._t0, self._c0, self._q0, self._notes = now, cpu, q, {}
        return rec


def _check(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
