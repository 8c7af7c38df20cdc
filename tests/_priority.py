"""Whether the kernel lets this thread raise another thread's priority back from SCHED_IDLE (what
a starved background sampler needs, dali_nerf.data.hostbudget.to_normal), set for real for the
calling thread: :func:`raise_refused` takes CAP_SYS_NICE out of its effective set (capabilities
are per thread; the permitted set keeps it, so it is restored after) and lowers RLIMIT_NICE's soft
limit to 0 — an unprivileged process as a cluster job runs. :func:`can_raise` probes the kernel."""

from __future__ import annotations

import ctypes
import os
import resource
import threading
from contextlib import contextmanager

_CAP_SYS_NICE = 23
_VERSION_3 = 0x20080522
_SYS_CAPGET, _SYS_CAPSET = 125, 126  # x86_64


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _caps(data=None):
    libc = ctypes.CDLL(None, use_errno=True)
    hdr, d = _Header(_VERSION_3, 0), (_Data * 2)()
    if libc.syscall(_SYS_CAPGET, ctypes.byref(hdr), d) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    if data is not None:
        if libc.syscall(_SYS_CAPSET, ctypes.byref(hdr), data) != 0:
            raise OSError(ctypes.get_errno(), "capset")
    return d


def can_raise() -> bool:
    """Does the kernel let this thread return a SCHED_IDLE thread to SCHED_OTHER (a real probe)?"""
    box, ready, done = [], threading.Event(), threading.Event()

    def idle():
        box.append(threading.get_native_id())
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        ready.set()
        done.wait()

    t = threading.Thread(target=idle, daemon=True)
    t.start()
    ready.wait()
    try:
        os.sched_setscheduler(box[0], os.SCHED_OTHER, os.sched_param(0))
        return True
    except OSError:
        return False
    finally:
        done.set()
        t.join()


@contextmanager
def raise_refused():
    """The calling thread as an unprivileged one: raising a priority is refused (EPERM)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NICE)
    resource.setrlimit(resource.RLIMIT_NICE, (0, hard))
    before = dropped = None
    if os.uname().machine == "x86_64":
        before = _caps()
        if before[0].effective & (1 << _CAP_SYS_NICE):
            dropped = (_Data * 2)(*[_Data(x.effective, x.permitted, x.inheritable) for x in before])
            dropped[0].effective &= ~(1 << _CAP_SYS_NICE)
            _caps(dropped)
    try:
        yield
    finally:
        if dropped is not None:
            _caps(before)
        resource.setrlimit(resource.RLIMIT_NICE, (soft, hard))


class GraphThread:
    """A thread named as DALI names its threads (``[DALI]...``: what
    :func:`dali_nerf.data.hostbudget.dali_threads` finds), standing for a graph's worker in a toy
    producer: the runner lowers and raises such threads. ``tid``; ``stop()`` ends it."""

    def __init__(self, name: str = "[DALI]toy"):
        self._stop, ready, box = threading.Event(), threading.Event(), []

        def run():
            libc = ctypes.CDLL(None)
            libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: this thread's comm
            box.append(threading.get_native_id())
            ready.set()
            self._stop.wait()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait()
        self.tid = box[0]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
