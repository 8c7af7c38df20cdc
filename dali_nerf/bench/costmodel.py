"""A stated cost model of one training step, fit from what the study measured.

Per rank and step, with ``B`` rays per rank, ``G`` ranks in the job (``W`` per node x ``N``
nodes) and ``c`` CPU cores per rank::

    compute  = compute_fixed_s + compute_per_ray_core_s * B / c_compute       (h2d+fwd+bwd+opt)
    sync     = 0                                                  if G == 1
             = allreduce_latency_s + 2 (G-1)/G * grad_bytes * allreduce_per_byte_s   (ring)
    sampling:
      sync_local   wait = sample_fixed_s + sample_per_ray_core_s * B / c
      sync_global  wait = sample_fixed_s + sample_per_ray_core_s * G*B / c
                          + scatter_per_byte_s * (G-1) * B * ray_bytes        (rank 0 samples all)
      rays         wait = max(0, loader_fixed_s + loader_per_ray_core_s * B / c - (compute + sync))
                                                                (the loader overlaps with compute)
    step     = wait + compute + sync;  stall = wait / step

``c`` is the cores of the process that samples: a rank's own for sync_local and rays; for
sync_global rank 0's (the other ranks wait for its scatter, so on a shared host its threads may
have every core). ``c_compute`` is the cores a rank's torch ops get on a CPU (cores // ranks) and
1 when compute runs on a (emulated) GPU, whose compute time per step is then given (``compute_s``).

>>> obs = [Observation("ddp", "sync_local", 1, 4096, 2, wait_s=0.02, compute_s=0.05, sync_s=0.0, step_s=0.07)]
>>> model = fit(obs, sampling=SamplingProfile(fixed_s=1e-4, per_ray_core_s=1e-8,
...             loader_fixed_s=3e-4, loader_per_ray_core_s=5e-9), grad_bytes=4_000_000)
>>> round(model.predict("sync_local", ranks=1, rays_per_rank=4096, cores_per_rank=2)["wait"], 7)
0.0001205
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

__all__ = ["Observation", "SamplingProfile", "CostModel", "fit", "fit_linear", "validate", "RAY_BYTES", "SAMPLERS"]

RAY_BYTES = 68
"""Bytes of one ray in a batch: origins 12, directions 12, rgb 12, indices 24, near/far 8."""

SAMPLERS = ("sync_global", "sync_local", "rays")


@dataclass(frozen=True)
class Observation:
    """Means per rank and step of one measured configuration (after warm-up)."""

    method: str
    sampler: str
    ranks: int
    rays_per_rank: int
    cores_per_rank: float
    wait_s: float
    compute_s: float
    """h2d + forward + backward + optimizer seconds."""
    sync_s: float
    step_s: float


@dataclass(frozen=True)
class SamplingProfile:
    """Sampling cost measured on its own (seconds per batch = fixed + per_ray_core * B / cores)."""

    fixed_s: float
    """Synchronous sampler: fixed seconds per batch."""
    per_ray_core_s: float
    """Synchronous sampler: seconds per ray on one core."""
    loader_fixed_s: float
    """Pipelined loader (our DALI op): fixed seconds per batch."""
    loader_per_ray_core_s: float
    """Pipelined loader: seconds per ray on one core."""
    cores: float = 1.0
    """Cores the measurement ran on (the per-core costs are already scaled by it)."""


@dataclass(frozen=True)
class CostModel:
    compute_fixed_s: float
    compute_per_ray_core_s: float
    sample_fixed_s: float
    sample_per_ray_core_s: float
    scatter_per_byte_s: float
    allreduce_latency_s: float
    allreduce_per_byte_s: float
    loader_fixed_s: float
    loader_per_ray_core_s: float
    grad_bytes: int
    ray_bytes: int = RAY_BYTES
    notes: tuple = ()
    """How each parameter was obtained (one string each)."""

    def compute_s(self, rays_per_rank: int, cores_per_rank: float) -> float:
        return self.compute_fixed_s + self.compute_per_ray_core_s * rays_per_rank / max(cores_per_rank, 1e-9)

    def sync_s(self, ranks: int, latency_s: Optional[float] = None, per_byte_s: Optional[float] = None) -> float:
        if ranks <= 1:
            return 0.0
        a = self.allreduce_latency_s if latency_s is None else latency_s
        b = self.allreduce_per_byte_s if per_byte_s is None else per_byte_s
        return a + 2.0 * (ranks - 1) / ranks * self.grad_bytes * b

    def wait_s(self, sampler: str, ranks: int, rays_per_rank: int, cores_per_rank: float, busy_s: float) -> float:
        """Seconds a rank waits for its batch; ``busy_s`` = compute + sync of the step."""
        c = max(cores_per_rank, 1e-9)
        if sampler == "sync_local":
            return self.sample_fixed_s + self.sample_per_ray_core_s * rays_per_rank / c
        if sampler == "sync_global":
            return (self.sample_fixed_s + self.sample_per_ray_core_s * ranks * rays_per_rank / c
                    + self.scatter_per_byte_s * (ranks - 1) * rays_per_rank * self.ray_bytes)
        if sampler == "rays":
            produce = self.loader_fixed_s + self.loader_per_ray_core_s * rays_per_rank / c
            return max(0.0, produce - busy_s)
        raise ValueError(f"unknown sampler {sampler!r}")

    def predict(self, sampler: str, ranks: int, rays_per_rank: int, cores_per_rank: float,
                compute_s: Optional[float] = None, sync_s: Optional[float] = None) -> Dict[str, float]:
        """Predicted seconds per step: {"wait", "compute", "sync", "step", "stall"}.

        ``compute_s`` / ``sync_s`` replace the fitted compute / all-reduce terms (a device step known by construction)."""
        comp = self.compute_s(rays_per_rank, cores_per_rank) if compute_s is None else compute_s
        syn = self.sync_s(ranks) if sync_s is None else sync_s
        wait = self.wait_s(sampler, ranks, rays_per_rank, cores_per_rank, comp + syn)
        step = wait + comp + syn
        return {"wait": wait, "compute": comp, "sync": syn, "step": step, "stall": wait / step if step > 0 else 0.0}

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["notes"] = list(self.notes)
        return d


def fit_linear(x: Sequence[float], y: Sequence[float]):
    """Least-squares ``y = a + b x`` with a, b >= 0; returns (a, b). One distinct x: a = 0."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if len(x) == 0:
        return 0.0, 0.0
    if np.ptp(x) <= 1e-12 * max(1.0, float(np.abs(x).max())):
        if x.mean() > 0:
            return 0.0, float(max(0.0, y.mean() / x.mean()))
        return float(y.mean()), 0.0
    A = np.stack([np.ones_like(x), x], 1)
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    if a < 0:  # through the origin
        return 0.0, float(max(0.0, (x @ y) / (x @ x)))
    if b < 0:
        return float(y.mean()), 0.0
    return float(a), float(b)


def fit(observations: Sequence[Observation], sampling: Optional[SamplingProfile] = None,
        grad_bytes: int = 0, allreduce_latency_s: float = 1e-4, ray_bytes: int = RAY_BYTES) -> CostModel:
    """Fit the model's parameters from measured configurations.

    * compute: least squares of ``compute_s`` on ``B / cores_per_rank`` over all observations;
    * sampling: from ``sampling`` (measured on its own) when given, else least squares of the
      sync_local waits on ``B / c``; the scatter cost per byte from the sync_global waits at
      G > 1 minus the modelled sampling;
    * all-reduce: latency is ``allreduce_latency_s`` (stated) when all multi-rank runs share one
      world size, else fit; per-byte cost from the DDP runs' sync seconds;
    * loader: from ``sampling`` when given, else from the pipelined runs whose wait is > 0.
    """
    notes: List[str] = []
    obs = list(observations)
    cx = [o.rays_per_rank / max(o.cores_per_rank, 1e-9) for o in obs]
    c0, kc = fit_linear(cx, [o.compute_s for o in obs])
    notes.append(f"compute: least squares over {len(obs)} runs of (h2d+fwd+bwd+opt) on rays/cores")

    if sampling is not None:
        s0, ks = sampling.fixed_s, sampling.per_ray_core_s
        p0, kp = sampling.loader_fixed_s, sampling.loader_per_ray_core_s
        notes.append("sampling: measured on its own (sampler micro-benchmark at several batch sizes)")
    else:
        loc = [o for o in obs if o.sampler == "sync_local"]
        if not loc:
            loc = [o for o in obs if o.sampler == "sync_global" and o.ranks == 1]
        s0, ks = fit_linear([o.rays_per_rank / o.cores_per_rank for o in loc], [o.wait_s for o in loc])
        notes.append(f"sampling: least squares over {len(loc)} synchronous runs' waits")
        pipe = [o for o in obs if o.sampler == "rays" and o.wait_s > 0]
        if pipe:
            p0, kp = fit_linear([o.rays_per_rank / o.cores_per_rank for o in pipe],
                                [o.wait_s + o.compute_s + o.sync_s for o in pipe])
            notes.append("loader: from the pipelined runs that waited")
        else:
            p0, kp = 0.0, 0.0
            notes.append("loader: no pipelined run waited; loader cost taken as hidden (0)")

    glob = [o for o in obs if o.sampler == "sync_global" and o.ranks > 1]
    if glob:
        num = [o.wait_s - (s0 + ks * o.ranks * o.rays_per_rank / o.cores_per_rank) for o in glob]
        den = [(o.ranks - 1) * o.rays_per_rank * ray_bytes for o in glob]
        gamma = max(0.0, float(np.dot(num, den) / np.dot(den, den)))
        notes.append(f"scatter: least squares over {len(glob)} multi-rank sync_global runs")
    else:
        gamma = 0.0
        notes.append("scatter: no multi-rank sync_global run; taken as 0")

    multi = [o for o in obs if o.ranks > 1 and o.method == "ddp"]
    lat, beta = allreduce_latency_s, 0.0
    if multi and grad_bytes > 0:
        xs = [2.0 * (o.ranks - 1) / o.ranks * grad_bytes for o in multi]
        ys = [o.sync_s for o in multi]
        if len({o.ranks for o in multi}) > 1:
            lat, beta = fit_linear(xs, ys)
            notes.append(f"all-reduce: latency and bandwidth fit over {len(multi)} DDP runs")
        else:
            beta = max(0.0, float(np.dot(np.subtract(ys, lat), xs) / np.dot(xs, xs)))
            notes.append(f"all-reduce: latency {lat * 1e6:.0f} us stated (one world size measured); "
                         f"bandwidth fit over {len(multi)} DDP runs ({grad_bytes / 1e6:.2f} MB of gradients)")
    else:
        notes.append("all-reduce: no multi-rank DDP run; bandwidth term 0")
    return CostModel(c0, kc, s0, ks, gamma, lat, beta, p0, kp, int(grad_bytes), ray_bytes, tuple(notes))


def validate(model: CostModel, observations: Sequence[Observation]) -> List[dict]:
    """Per observation: measured vs predicted step seconds and stall, relative step error."""
    rows = []
    for o in observations:
        sync = None if o.method == "ddp" else 0.0  # SS trains independent cells: no gradient sync
        p = model.predict(o.sampler, o.ranks, o.rays_per_rank, o.cores_per_rank, sync_s=sync)
        rows.append({
            "method": o.method, "sampler": o.sampler, "ranks": o.ranks,
            "step_measured_s": o.step_s, "step_predicted_s": p["step"],
            "stall_measured": o.wait_s / o.step_s if o.step_s > 0 else 0.0, "stall_predicted": p["stall"],
            "step_error": (p["step"] - o.step_s) / o.step_s if o.step_s > 0 else 0.0,
        })
    return rows
