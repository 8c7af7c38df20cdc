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

>>> t = PhaseTimer("cpu"); a = t.mark(); b = t.mark(); t.span("forward", a, b)
>>> with t.phase("wait"):
...     pass
>>> rec = t.record(step=1, rays=4096); sorted(k for k in rec if k.endswith("_s"))[:3]
['backward_s', 'cpu_s', 'forward_s']
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

__all__ = ["PHASES", "PhaseTimer"]

PHASES = ("wait", "h2d", "forward", "backward", "sync", "optimizer")
"""The phases of a step, in order (``<phase>_s`` in metrics.jsonl)."""


class PhaseTimer:
    """Seconds per phase of a step, on the host (CPU) or with CUDA events (GPU).

    Recording: ``mark()`` returns a boundary (a ``perf_counter`` reading, or a CUDA event on
    torch's current stream); ``span(phase, a, b, minus)`` adds ``(b - a) - minus`` seconds to
    ``phase`` once resolved; ``add(phase, s)`` adds host seconds now; ``with phase(name):`` times a
    block on the host. Closing a step: ``resolve(ph)`` adds every pending span and host second into
    the dict ``ph`` (CUDA: after one wait on the step's last event), or ``record(step, rays)``
    returns the step's metrics row (``<phase>_s``, ``step_s`` since the previous record,
    ``cpu_s``: this process's CPU seconds meanwhile, every thread of it) and starts the next.
    """

    def __init__(self, device="cpu"):
        self.cuda = str(getattr(device, "type", device)) == "cuda"
        self._spans: list = []
        self._host: list = []
        self._last = None
        self._t0, self._c0 = time.perf_counter(), time.process_time()

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
        now, cpu = time.perf_counter(), time.process_time()
        rec = {"step": int(step), "rays": int(rays)} | {f"{k}_s": v for k, v in ph.items()}
        rec["step_s"] = now - self._t0
        rec["cpu_s"] = cpu - self._c0
        self._t0, self._c0 = now, cpu
        return rec


def _check(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
