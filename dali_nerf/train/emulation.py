"""Emulated devices: device-side work as timed waits that release the CPU; host work real.

A GPU rank's step is host work (wait for the batch, launch work) plus device work (host-to-device
copy, forward/backward/optimizer kernels, NCCL collectives) during which the host thread is
blocked in a CUDA/NCCL wait and its core is free. :class:`EmulatedDevice` replaces the device work
by ``time.sleep`` of the time the device would take, so that many emulated ranks fit on a few
cores while everything on the host — decode, sampling (synchronous or pipelined on real threads),
the loaders' queues, rank 0 sampling the global batch — runs for real.

Device figures (:class:`DeviceLinks`, all overridable):

* compute: ``step_ms`` per ``ref_rays`` (4096) rays, linear in the rays of the step;
* host-to-device copy: PCIe Gen5 x16, 64 GB/s per direction raw (32 GT/s x 16 lanes, PCI-SIG
  PCIe 5.0 spec; H100/H200 datasheets: 128 GB/s bidirectional); we use 50 GB/s achieved for
  pinned copies and 10 us per copy (launch + DMA setup, the order CUDA's bandwidthTest shows for
  small copies);
* collectives: NVLink 4 (H100/H200 SXM, NVIDIA datasheets: 900 GB/s bidirectional per GPU,
  450 GB/s per direction); we use an NCCL bus bandwidth of 360 GB/s (80% of one direction, the
  efficiency nccl-tests' all_reduce_perf reaches on large messages) and 20 us latency per
  collective (NCCL's small-message all-reduce latency inside one NVLink node is tens of us).
  Ring all-reduce: ``latency + 2 (G-1)/G * bytes / bus_bw``; scatter of a slice: ``latency +
  bytes / bus_bw``.

These are stated assumptions, not measurements: the project's GPU run so far (one H200,
2026-12-04, docs/gpu/h200-2026-12-04/) had a single GPU, so no NCCL collective and no copy on a
multi-GPU node has been measured. A timed wait overshoots (scheduler wake-up); the study measures that as the emulation
floor (a ready batch, :class:`~dali_nerf.sources.ReadySource`, beside each configuration).

>>> dev = EmulatedDevice(step_ms=2.0)
>>> dev.run(4096)["forward"]       # sleeps 2 ms, returns the seconds it was asked to wait
0.002
>>> round(dev.links.allreduce_s(4_000_000, 8) * 1e6)    # 20 us + 1.75 * 4 MB / 360 GB/s
39
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.synchronize import Semaphore
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from dali_nerf.train.phases import PHASES, PhaseTimer
from dali_nerf.sources.shm_scatter import RAY_FLOATS

__all__ = ["DeviceLinks", "EmulatedDevice", "LockstepBarrier", "PhaseTimer", "emulated_step",
           "shared_block", "model_grad_bytes",
           "batch_nbytes", "PHASES", "RAY_FLOATS", "EMULATED_LABEL", "KEEPS_UP_STEP", "KEEPS_UP_STALL",
           "keeps_up", "keeps_up_reason"]

# RAY_FLOATS: float32 columns of a packed ray (dali_nerf.sources.shm_scatter)

EMULATED_LABEL = "device compute emulated by a timed wait; host work real"

KEEPS_UP_STEP = 1.15
"""A source keeps up with its emulated devices when its step is at most this factor of the floor's
(the same step with a ready batch) and its stall at most :data:`KEEPS_UP_STALL` (:func:`keeps_up`)."""
KEEPS_UP_STALL = 0.02
"""The most a source that keeps up may wait for batches, as a share of its step (:func:`keeps_up`)."""


def keeps_up(stall: float, over_floor: Optional[float] = None) -> bool:
    """The one definition of a source keeping up with its devices: ``stall`` (data wait / step) at
    most :data:`KEEPS_UP_STALL` and ``over_floor`` (step / the floor's step; None: no floor ran, the
    stall alone) at most :data:`KEEPS_UP_STEP`. The trainers' emulated mode's ``host_keeps_up``,
    the study's verdict per row, its pairs' flags and the plots' bands all use it.

    >>> keeps_up(0.01, 1.10), keeps_up(0.03, 1.05), keeps_up(0.0, 1.16), keeps_up(0.0)
    (True, False, False, True)
    """
    return stall <= KEEPS_UP_STALL and (over_floor is None or over_floor <= KEEPS_UP_STEP)


def keeps_up_reason(stall: float, over_floor: Optional[float] = None) -> List[str]:
    """Which of :func:`keeps_up`'s rules ``stall`` and ``over_floor`` break, one phrase each ([] when
    none): ``["stall 3.0% > 2%", "step 1.20x the floor > 1.15x"]``."""
    why = []
    if stall > KEEPS_UP_STALL:
        why.append(f"stall {100 * stall:.1f}% > {100 * KEEPS_UP_STALL:g}%")
    if over_floor is not None and over_floor > KEEPS_UP_STEP:
        why.append(f"step {over_floor:.2f}x the floor > {KEEPS_UP_STEP:g}x")
    return why


@dataclass(frozen=True)
class DeviceLinks:
    """Device-side costs of one emulated GPU (see the module docstring for the sources)."""

    ref_rays: int = 4096
    """Rays per step at which ``step_ms`` is given; compute scales linearly with the step's rays."""
    h2d_bytes_per_s: float = 50e9
    """Host-to-device copy bandwidth (PCIe Gen5 x16, achieved for pinned memory)."""
    h2d_latency_s: float = 10e-6
    """Fixed cost of one host-to-device copy."""
    link_bytes_per_s: float = 360e9
    """NCCL bus bandwidth between GPUs of one node (NVLink 4)."""
    link_latency_s: float = 20e-6
    """Latency of one NCCL collective inside a node."""

    def h2d_s(self, nbytes: int) -> float:
        return self.h2d_latency_s + nbytes / self.h2d_bytes_per_s

    def allreduce_s(self, nbytes: int, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return self.link_latency_s + 2.0 * (ranks - 1) / ranks * nbytes / self.link_bytes_per_s

    def scatter_s(self, nbytes_per_rank: int, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return self.link_latency_s + nbytes_per_rank / self.link_bytes_per_s

    def lines(self) -> List[str]:
        return [f"compute: step_ms per {self.ref_rays} rays, linear in the step's rays",
                f"host-to-device copy: {self.h2d_latency_s * 1e6:.0f} us + bytes / {self.h2d_bytes_per_s / 1e9:.0f} GB/s "
                f"(PCIe Gen5 x16: 64 GB/s per direction raw, 50 GB/s taken as achieved)",
                f"all-reduce (ring): {self.link_latency_s * 1e6:.0f} us + 2(G-1)/G bytes / {self.link_bytes_per_s / 1e9:.0f} GB/s "
                f"(NVLink 4: 450 GB/s per direction, 80% as NCCL bus bandwidth)",
                f"scatter from rank 0's GPU: {self.link_latency_s * 1e6:.0f} us + slice bytes / "
                f"{self.link_bytes_per_s / 1e9:.0f} GB/s, after rank 0's host-to-device copy of the global batch"]


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


@dataclass
class EmulatedDevice:
    """One rank's emulated GPU. Copies and collectives are *enqueued* (:meth:`h2d`,
    :meth:`allreduce`, :meth:`scatter`: device time the host does not wait for yet, as
    ``non_blocking`` copies and NCCL calls on a CUDA stream) and :meth:`run` waits for them and the
    step's compute in one timed wait that frees the core: the host blocks once per step, as a
    training thread does at its step's sync point, not once per device operation (on a host with
    more ranks than cores every extra block is an extra wake-up to schedule)."""

    step_ms: float
    """Forward + backward + optimizer milliseconds per ``links.ref_rays`` rays."""
    links: DeviceLinks = field(default_factory=DeviceLinks)
    queued: Dict[str, float] = field(default_factory=lambda: {"h2d": 0.0, "sync": 0.0})
    """Device seconds enqueued and not yet waited for, by phase (copies: h2d; all-reduce: sync)."""

    def compute_s(self, rays: int) -> float:
        return self.step_ms * 1e-3 * rays / self.links.ref_rays

    def _enqueue(self, phase: str, seconds: float) -> float:
        self.queued[phase] += seconds
        return seconds

    def h2d(self, nbytes: int) -> float:
        return self._enqueue("h2d", self.links.h2d_s(nbytes))

    def allreduce(self, nbytes: int, ranks: int) -> float:
        return self._enqueue("sync", self.links.allreduce_s(nbytes, ranks))

    def scatter(self, nbytes_per_rank: int, ranks: int) -> float:
        return self._enqueue("h2d", self.links.scatter_s(nbytes_per_rank, ranks))

    def run(self, rays: int) -> Dict[str, float]:
        """One wait for everything enqueued plus ``rays`` rays of compute (the device runs them
        back to back); returns the seconds asked per phase ({"h2d", "sync", "forward"}) and
        empties the queue."""
        req = dict(self.queued) | {"forward": self.compute_s(rays)}
        self.queued = {"h2d": 0.0, "sync": 0.0}
        _sleep(sum(req.values()))
        return req


def batch_nbytes(batch: dict) -> int:
    """Bytes of a batch dict's tensors (what a host-to-device copy moves)."""
    return int(sum(v.numel() * v.element_size() for v in batch.values()))


def emulated_step(source, dev: EmulatedDevice, timer: PhaseTimer, *, on_device: bool = False,
                  lockstep=None, grad_bytes: int = 0, ranks: int = 1) -> dict:
    """One training step of an emulated rank; returns the batch.

    wait = ``next(source)`` (real host work); then one device wait (:meth:`EmulatedDevice.run`):
    the batch's host-to-device copy (not when ``on_device``: the source already enqueued its
    transfer, as sync_global's scatter does), the previous step's all-reduce, and the compute
    (forward, backward and optimizer as one; backward and optimizer stay 0). The wait is
    attributed by what was asked: h2d and sync their requested device seconds, forward the rest
    (compute and the wait's overshoot; the overshoot alone, the wait past the seconds asked, is also
    noted as ``overshoot_s``: a rank woken late by busy cores). sync (``lockstep`` given) also holds
    the lockstep barrier:
    the all-reduce's rendezvous, which includes waiting for slower ranks; the all-reduce of
    ``grad_bytes`` itself is then enqueued, so it is waited for (and counted) in the next step."""
    with timer.phase("wait"):
        batch = next(source)
    rays = int(next(iter(batch.values())).shape[0])
    if not on_device:
        dev.h2d(batch_nbytes(batch))
    t = time.perf_counter()
    req = dev.run(rays)
    span = time.perf_counter() - t
    timer.add("h2d", req["h2d"])
    timer.add("sync", req["sync"])
    timer.add("forward", max(0.0, span - req["h2d"] - req["sync"]))
    timer.note("overshoot", max(0.0, span - sum(req.values())))
    if lockstep is not None:
        with timer.phase("sync"):
            lockstep()
        dev.allreduce(grad_bytes, ranks)
    return batch


class LockstepBarrier:
    """A barrier for emulated ranks in separate processes whose release wakes every waiter at once.

    ``multiprocessing.Barrier`` (a Condition over semaphores) releases its waiters one at a time
    and waits for each to acknowledge before waking the next: W - 1 context switches in a chain,
    each delayed further when the cores are busy (1.2 ms for 16 ranks on 2 cores, 60% of a 2 ms
    device step). NCCL's rendezvous has no such chain. Here the last rank to arrive posts W - 1
    tokens on a semaphore and returns; the waiters each take one. Two gates alternate by round (a
    rank released from round k can reach round k + 1 before the others of round k took their
    tokens, never round k + 2), so no rank takes another round's token.

    Built in the parent before the ranks are spawned (every rank starts at round 0); pickled to
    the ranks with their arguments. ``wait(timeout)`` and ``abort()`` as ``threading.Barrier``:
    a timeout or an abort breaks the barrier for every rank (``threading.BrokenBarrierError``).
    """

    def __init__(self, ctx, parties: int):
        self.parties = int(parties)
        self._lock = ctx.Lock()
        self._count = ctx.RawValue("i", 0)
        self._broken = ctx.RawValue("b", 0)
        self._gates = (ctx.Semaphore(0), ctx.Semaphore(0))
        self._round = 0
        self._shm = None

    @classmethod
    def named(cls, parties: int) -> "LockstepBarrier":
        """The same barrier for processes this one did not start (torchrun's ranks on one host):
        POSIX named semaphores and a shared-memory block that :meth:`attach` opens by the names in
        :attr:`spec`. The creator owns them: they are unlinked when it exits (the others' handles
        stay valid)."""
        ctx = mp.get_context("spawn")  # spawn-context semaphores keep their names until exit
        b = cls.__new__(cls)
        b.parties, b._round = int(parties), 0
        b._lock = ctx.Semaphore(1)
        b._gates = (ctx.Semaphore(0), ctx.Semaphore(0))
        b._shm, b._owner = shared_block(size=8), True
        b._ints = b._shm.buf.cast("i")
        b._ints[0] = b._ints[1] = 0
        b._count, b._broken = _ShmInt(b._ints, 0), _ShmInt(b._ints, 1)
        return b

    @property
    def spec(self) -> tuple:
        """What :meth:`attach` needs (picklable: send it to the other ranks)."""
        if self._shm is None:
            raise ValueError("LockstepBarrier.spec: only a barrier made by LockstepBarrier.named has names")
        sems = [(s._semlock.kind, s._semlock.maxvalue, s._semlock.name) for s in (self._lock, *self._gates)]
        return self.parties, sems, self._shm.name

    @classmethod
    def attach(cls, spec: tuple) -> "LockstepBarrier":
        """Open a :meth:`named` barrier in another process, by its :attr:`spec`."""
        parties, sems, shm_name = spec
        opened = []
        for kind, maxvalue, name in sems:
            s = Semaphore.__new__(Semaphore)
            s.__setstate__((0, kind, maxvalue, name))  # sem_open(name): what unpickling in a child does
            opened.append(s)
        b = cls.__new__(cls)
        b.parties, b._round = int(parties), 0
        b._lock, b._gates = opened[0], (opened[1], opened[2])
        b._shm, b._owner = shared_block(shm_name), False
        b._ints = b._shm.buf.cast("i")
        b._count, b._broken = _ShmInt(b._ints, 0), _ShmInt(b._ints, 1)
        return b

    def close(self) -> None:
        """Release this process's view of a named barrier's shared block (the creator also
        unlinks it: call it there after every rank is done with the barrier)."""
        if self._shm is not None:
            self._count = self._broken = None
            self._ints.release()
            self._shm.close()
            if self._owner:
                self._shm.unlink()
            self._shm = None
            # the creator's semaphores are unlinked by their multiprocessing finalizers when the
            # objects die: now, not at interpreter exit (which an interrupted run skips)
            self._lock = self._gates = None

    def wait(self, timeout: Optional[float] = None) -> int:
        """Block until all parties called it in this round; returns 0 on the last to arrive, else 1."""
        gate = self._gates[self._round & 1]
        self._round += 1
        with self._lock:
            if self._broken.value:
                raise threading.BrokenBarrierError
            self._count.value += 1
            last = self._count.value == self.parties
            if last:
                self._count.value = 0
        if last:
            for _ in range(self.parties - 1):
                gate.release()
            return 0
        if not gate.acquire(True, timeout):
            self.abort()
            raise threading.BrokenBarrierError
        if self._broken.value:
            raise threading.BrokenBarrierError
        return 1

    def abort(self) -> None:
        """Break the barrier: every waiting rank, and every later call, raises BrokenBarrierError."""
        self._broken.value = 1
        for g in self._gates:
            for _ in range(self.parties):
                g.release()


class _ShmInt:
    """One int32 of a shared block, with ``.value`` as ``multiprocessing.RawValue`` has."""

    def __init__(self, ints: memoryview, i: int):
        self._ints, self._i = ints, i

    @property
    def value(self) -> int:
        return self._ints[self._i]

    @value.setter
    def value(self, v: int) -> None:
        self._ints[self._i] = v


def shared_block(name: Optional[str] = None, size: int = 0) -> shared_memory.SharedMemory:
    """A shared-memory block: a new one of ``size`` bytes (``name`` None; this process owns it
    and unlinks it at exit), or the existing block ``name`` (opened, not owned: Python < 3.13
    would also register it for unlinking when this process exits, which this undoes)."""
    if name is None:
        return shared_memory.SharedMemory(create=True, size=max(1, int(size)))
    shm = shared_memory.SharedMemory(name=name)
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 (bpo-39959)
    except Exception:
        pass
    return shm


def model_grad_bytes(model_cfg) -> int:
    """Bytes of the gradients DDP all-reduces per step: the configured radiance field's parameters."""
    from dali_nerf.models import build_field

    field = build_field(model_cfg, torch.tensor([[-1.5] * 3, [1.5] * 3]))
    return int(sum(q.numel() * q.element_size() for q in field.parameters() if q.requires_grad))
