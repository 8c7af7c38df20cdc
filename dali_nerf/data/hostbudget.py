"""The host's CPU budget per rank: sampler threads and run size that fit the cores a rank gets.

A rank's loader threads share the host's cores with every other rank on the node. Measured on a
2-core AMD EPYC VM (2026-12-03, 16 emulated DDP ranks at 2 ms device steps, the study's emulated
launch at commit da9281d): each rank a RayLoader with the fixed defaults it had then (2 DALI threads,
262144 rays per run) stepped in 5.26 ms against a 2.17 ms floor while their time in ``next()`` was
3.4% — the loaders' bursts slowed the training processes outside ``next()``; with 1 thread and
65536 rays per run the same ranks stepped in 2.93 ms. So threads and run size follow the cores
per local rank:

* ``cores_per_rank`` = usable cores (``os.sched_getaffinity``) / local ranks (``LOCAL_WORLD_SIZE``);
* ``threads`` = ``cores_per_rank - 1`` (one core's worth left to the rank's own thread: the
  training loop, the host side of device work), at least 1, at most ``max_threads``;
* ``rays_per_run`` = ``RAYS_PER_THREAD`` x threads, a multiple of the batch, at most ``max_run``:
  one run occupies the threads for a bounded time (a short burst) whatever the thread count.

>>> host_budget(4096, local_ranks=16, cores=2)
HostBudget(cores=2, local_ranks=16, cores_per_rank=0.125, threads=1, rays_per_run=65536, priority='normal')
>>> host_budget(4096, local_ranks=8, cores=32).threads
3

Priority. The threads that sample *ahead* (DALI's CPU threads; the ``torch_workers`` worker
processes) do work nobody waits for yet, while the rank's own thread
waits on the device and must run the moment it wakes (launch the next kernels, join the
collective): in lockstep every rank waits for the last one to wake. When the rank's compute is
not on this CPU (a GPU, or the study's emulated devices), :func:`resolve_priority` runs them at
``background`` priority (Linux ``SCHED_IDLE``: they run on cores nothing else wants, and a
waking training thread takes the core at once). Measured on a 2-core Intel Xeon VM (2026-12-04,
commit 087fcd4, ``benchmarks/thread_priority.py``, DDP, emulated devices, step over the floor,
mean of 6 trials each): 8 ranks at 1 ms device steps 1.32x at normal priority and 1.07x
in background; 16 ranks at 2 ms 1.25x and 1.10x.
Where the compute is on the CPU the sampler competes with it for the cores as equals
(``normal``): in background it would get only the cores torch leaves idle. On a host whose cores
are all busy at normal priority, background threads starve; the DALI loaders then return to
normal priority by themselves (:class:`dali_nerf.sources.runahead.StarvationGuard`): in place where
the kernel lets them (:func:`to_normal`), else on new threads.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from dali_nerf.errors import ConfigError
from dali_nerf.launch_env import launch_env

__all__ = ["HostBudget", "host_budget", "run_size", "usable_cores", "first_cores", "pinned", "local_world_size",
           "RAYS_PER_THREAD",
           "PRIORITIES", "check_priority", "resolve_priority", "dali_threads", "to_background",
           "to_normal"]

PRIORITIES = ("normal", "background")
"""Scheduling priorities of the threads that sample ahead (``pipeline.thread_priority`` adds ``auto``)."""

RAYS_PER_THREAD = 65536
"""Rays per DALI run per sampler thread (the run size measured best with 1 thread, 16 ranks on 2 cores)."""


@dataclass(frozen=True)
class HostBudget:
    cores: int
    """Usable cores of this process (its CPU affinity)."""
    local_ranks: int
    """Ranks sharing those cores (LOCAL_WORLD_SIZE under torchrun)."""
    cores_per_rank: float
    """cores / local_ranks."""
    threads: int
    """Sampler threads for this rank's loader (DALI num_threads, torch_workers workers)."""
    rays_per_run: int
    """Rays per DALI run (a multiple of the batch)."""
    priority: str = "normal"
    """Priority of the threads and worker processes that sample ahead (:data:`PRIORITIES`): the
    budget does not decide it (``pipeline.thread_priority`` is resolved by the plan,
    :func:`dali_nerf.data.plan.plan_from_config`); a launch that hands one budget to all its
    samplers records the plan's here."""


def usable_cores() -> int:
    """Cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where unsupported)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def first_cores(n: int) -> Tuple[int, ...]:
    """The first ``n`` of this process's usable cores (its CPU affinity, in order); ConfigError when
    it has fewer."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        raise ConfigError("CPU affinity is not available on this platform: pinning needs Linux") from None
    if not 1 <= int(n) <= len(cpus):
        raise ConfigError(f"{n} cores: this process may run on {len(cpus)} ({', '.join(map(str, cpus))})")
    return tuple(cpus[:int(n)])


@contextmanager
def pinned(cpus: Optional[Sequence[int]]):
    """Run the calling thread on ``cpus`` inside the block, and put its affinity back after (None:
    no change). Processes started inside inherit it across fork and exec: this is how a launch of
    ranks (spawned processes, torchrun and its workers) runs on a subset of the host's cores, each
    rank then reading that subset as its usable cores (:func:`usable_cores`, the host budget)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def local_world_size() -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` (set by torchrun), else ``WORLD_SIZE``, else 1
    (:func:`dali_nerf.launch_env.launch_env`, which checks the launcher's variables)."""
    return launch_env().local_world_size


def host_budget(rays_per_batch: int, local_ranks: Optional[int] = None, cores: Optional[int] = None,
                max_threads: int = 4, max_run: int = 262144) -> HostBudget:
    """Sampler threads and rays per run for one rank (see the module docstring for the rule).

    Args:
        rays_per_batch: B, rays per step of this rank.
        local_ranks: ranks sharing the cores (default: :func:`local_world_size`).
        cores: usable cores (default: :func:`usable_cores`).
        max_threads: cap on threads per rank; max_run: cap on rays per run (rounded up to B).
    """
    if int(rays_per_batch) < 1:
        raise ConfigError(f"rays_per_batch={rays_per_batch!r}: must be >= 1")
    n = local_world_size() if local_ranks is None else int(local_ranks)
    c = usable_cores() if cores is None else int(cores)
    if n < 1 or c < 1:
        raise ConfigError(f"host_budget: local_ranks and cores must be >= 1, got {n}, {c}")
    per = c / n
    threads = int(max(1, min(int(max_threads), int(per) - 1)))
    return HostBudget(c, n, per, threads, run_size(rays_per_batch, threads, max_run))


def run_size(rays_per_batch: int, threads: int, max_run: int = 262144) -> int:
    """Rays per DALI run for ``threads`` sampler threads: ``RAYS_PER_THREAD`` each, at most
    ``max_run``, at least one batch, rounded up to a multiple of the batch.

    >>> run_size(4096, 1), run_size(4096, 8), run_size(100000, 1)
    (65536, 262144, 100000)
    """
    B = int(rays_per_batch)
    run = max(B, min(int(max_run), RAYS_PER_THREAD * int(threads)))
    return -(-run // B) * B


def check_priority(value, key: str = "thread_priority", auto: bool = False) -> str:
    """``value`` if it is a valid priority (``auto`` too when ``auto``), else a ConfigError naming ``key``."""
    valid = (("auto",) if auto else ()) + PRIORITIES
    if value not in valid:
        raise ConfigError(f"{key}={value!r}: must be one of {', '.join(valid)}")
    return value


def resolve_priority(value: str, device: str) -> str:
    """``auto`` -> ``background`` when the rank's compute runs off this CPU (``device`` cuda or
    emulated), ``normal`` on the CPU; other values unchanged.

    >>> resolve_priority("auto", "emulated"), resolve_priority("auto", "cpu")
    ('background', 'normal')
    """
    check_priority(value, auto=True)
    if value != "auto":
        return value
    return "normal" if device == "cpu" else "background"


def dali_threads() -> frozenset:
    """Native ids of this process's DALI threads (their names start with ``[DALI]``; Linux only,
    elsewhere empty). A snapshot before a pipeline is built and one after its first run tell its
    threads apart from other pipelines'."""
    out = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return frozenset()
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                if f.read().startswith("[DALI]"):
                    out.add(int(t))
        except OSError:  # the thread ended meanwhile
            pass
    return frozenset(out)


def to_background(tids) -> int:
    """Run the threads ``tids`` (native ids; 0 = the calling thread) at background priority:
    ``SCHED_IDLE`` (an unprivileged thread may always lower itself), else nice 19 where that is
    refused; nothing where the platform has neither. Threads they start later inherit it.
    Returns how many were lowered."""
    n = 0
    for tid in tids:
        try:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
            n += 1
        except (AttributeError, OSError):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), 19)
                n += 1
            except (AttributeError, OSError):
                pass
    return n


def to_normal(tids) -> bool:
    """Return the threads ``tids`` (native ids) that :func:`to_background` lowered to normal
    priority: ``SCHED_OTHER`` at the calling thread's nice value. Linux lets a thread leave
    ``SCHED_IDLE`` (or lower its nice value) only with ``CAP_SYS_NICE`` (root, most containers) or
    an ``RLIMIT_NICE`` that permits it (``ulimit -e``; 0 by default), so an unprivileged process
    is refused. True when every thread runs at normal priority now (a thread that has ended counts);
    False when any was refused or the platform has no such call."""
    try:
        nice = os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return False
    ok = True
    for tid in tids:
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except ProcessLookupError:  # the thread ended
            pass
        except (AttributeError, OSError):
            ok = False
    return ok
