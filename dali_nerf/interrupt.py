"""Ctrl-C that always stops a run: a bounded interrupt path for the ``dali-nerf`` command and the trainers.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the trainer, its DataLoader
worker processes (``pipeline.name=torch_workers``), the compiler building the operator. What must
happen then, whatever state the process is in:

1. the main process alone decides: DataLoader workers ignore SIGINT (:func:`ignore_interrupts`,
   their ``worker_init_fn``) and are shut down by the main process's cleanup, so a worker that
   handles the signal first can no longer kill the step with "DataLoader worker exited
   unexpectedly";
2. the first SIGINT raises ``KeyboardInterrupt`` in the main thread as usual: the training loop's
   ``finally`` blocks close the sources (every join and close has a deadline), flush the metrics
   and leave the last complete checkpoint as it was; the command prints one line, ``interrupted``;
3. the process then leaves through :func:`exit_process`: after an interrupt it flushes stdout/stderr
   and ends with ``os._exit(130)``. Interpreter shutdown is not bounded (a dozen atexit handlers,
   among them DALI's pipeline shutdown with a ``gc.collect`` and multiprocessing's unbounded join
   of its children and of its queues' feeder threads), and after an interrupt there is nothing
   left for it to do: our own cleanup already ran;
4. a watchdog bounds steps 2-3: if the process is still alive ``grace_s`` seconds after the first
   SIGINT (``$DALI_NERF_INTERRUPT_GRACE_S``, default 10), it prints every thread's stack
   (faulthandler), kills its descendant processes and exits 130. A second SIGINT (one second or
   more after the first: torchrun forwards the terminal's SIGINT to workers that already had it)
   exits at once, without the stacks.

``SIGUSR1`` prints every thread's stack while the run goes on (``kill -USR1 <pid>``): how to see
where a run that seems stuck is.

>>> with interrupt_guard():
...     pass                # handlers installed for the block, the previous ones restored after
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

from dali_nerf.errors import stderr_line

__all__ = ["interrupt_guard", "quiet_startup", "exit_process", "ignore_interrupts", "interrupts_deferred", "interrupted", "descendants", "kill_descendants",
           "EXIT_INTERRUPTED", "DEFAULT_GRACE_S", "ECHO_S"]

EXIT_INTERRUPTED = 130
"""Exit code after an interrupt (128 + SIGINT, as shells report it)."""

DEFAULT_GRACE_S = 10.0
"""Seconds the cleanup after the first SIGINT may take before the watchdog ends the process."""

ECHO_S = 1.0
"""A second SIGINT sooner than this after the first is the same Ctrl-C delivered twice (by the
terminal and again by torchrun) and is absorbed; a later one ends the process at once."""

_state = {"first": None, "grace_s": DEFAULT_GRACE_S, "watchdog": None}


def interrupted() -> bool:
    """True once this process received SIGINT under :func:`interrupt_guard`."""
    return _state["first"] is not None


def _children(pid: int) -> List[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def descendants(pid: Optional[int] = None) -> List[int]:
    """Pids of every live descendant of ``pid`` (default: this process), children first (Linux /proc)."""
    todo, out = [os.getpid() if pid is None else int(pid)], []
    while todo:
        kids = _children(todo.pop(0))
        out += kids
        todo += kids
    return out


def kill_descendants(sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to every descendant of this process (deepest last found first)."""
    for p in reversed(descendants()):
        try:
            os.kill(p, sig)
        except OSError:
            pass


def _flush() -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass


def _force_exit(why: str, stacks: bool = True) -> None:
    """(Stacks and) one line, descendants killed, exit 130; never returns."""
    try:
        if stacks:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            stderr_line(f"error: {why}; the stacks above show where it was (exit {EXIT_INTERRUPTED})")
        else:
            stderr_line(f"error: {why}")
    except Exception:
        pass
    kill_descendants()
    _flush()
    os._exit(EXIT_INTERRUPTED)


def _watchdog(grace_s: float) -> None:
    time.sleep(grace_s)
    _force_exit(f"still shutting down {grace_s:g} s after the interrupt")


def _on_sigint(signum, frame):
    if _state["first"] is None:
        _state["first"] = time.monotonic()
        t = threading.Thread(target=_watchdog, args=(_state["grace_s"],), name="dali_nerf-interrupt-watchdog",
                             daemon=True)
        _state["watchdog"] = t
        t.start()
        raise KeyboardInterrupt
    if time.monotonic() - _state["first"] >= ECHO_S:
        _force_exit("interrupted again during shutdown; exiting without finishing the cleanup", stacks=False)
    # else: the same Ctrl-C arriving twice (torchrun forwards the terminal's SIGINT to its workers,
    # which already had it from the terminal): the cleanup goes on


def _startup_sigint(signum, frame):
    stderr_line("interrupted")
    _flush()
    os._exit(EXIT_INTERRUPTED)


def quiet_startup() -> None:
    """For a script's ``__main__``, before its heavy imports (torch, DALI: seconds): a Ctrl-C
    while they load prints ``interrupted`` and exits 130 at once (nothing has started that needs
    cleaning up), instead of a traceback from inside an import. :func:`interrupt_guard` takes over
    when the command runs."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _startup_sigint)


@contextlib.contextmanager
def interrupt_guard(grace_s: Optional[float] = None):
    """Install the bounded interrupt path (SIGINT -> KeyboardInterrupt + watchdog; SIGUSR1 ->
    stacks) for the block; restore the previous handlers after it. Only in the main thread (a
    no-op elsewhere: signal handlers belong to the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if grace_s is None:
        try:
            grace_s = float(os.environ.get("DALI_NERF_INTERRUPT_GRACE_S", DEFAULT_GRACE_S))
        except ValueError:
            grace_s = DEFAULT_GRACE_S
    _state.update(first=None, grace_s=max(0.1, grace_s), watchdog=None)
    prev = signal.signal(signal.SIGINT, _on_sigint)
    usr1 = False
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
        usr1 = True
    except (AttributeError, ValueError, OSError, RuntimeError):  # no SIGUSR1, or stderr has no fd (captured)
        pass
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)
        if usr1:
            faulthandler.unregister(signal.SIGUSR1)


def exit_process(code: int) -> None:
    """End a command with ``code``. After an interrupt (``code`` 130 or :func:`interrupted`): flush
    and ``os._exit`` without interpreter shutdown (see the module doc); otherwise ``sys.exit``."""
    code = int(code or 0)
    if code == EXIT_INTERRUPTED or interrupted():
        kill_descendants(signal.SIGTERM)  # normally none are left: the sources closed their workers
        _flush()
        os._exit(EXIT_INTERRUPTED)
    sys.exit(code)


@contextlib.contextmanager
def interrupts_deferred():
    """Start worker processes inside this block. A SIGINT that arrives meanwhile is held and
    raised (by the handler in force before the block) when the block ends, so the start is never
    cut in half (a DataLoader iterator interrupted inside its constructor leaves workers behind and
    a traceback from its ``__del__``); and SIGINT is blocked in the calling thread, so a process
    forked here starts with it blocked (the mask is inherited) until its :func:`ignore_interrupts`
    runs."""
    main = threading.current_thread() is threading.main_thread()
    held = []
    prev = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum)) if main else None
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if hasattr(signal, "pthread_sigmask") else None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)  # one pending for this thread is held now
        if main:
            signal.signal(signal.SIGINT, prev)
            if held:
                if callable(prev):
                    prev(signal.SIGINT, None)  # ours arms the watchdog; Python's default raises KeyboardInterrupt
                elif prev == signal.SIG_DFL:
                    os.kill(os.getpid(), signal.SIGINT)


def ignore_interrupts(*_args) -> None:
    """In a worker process (DataLoader ``worker_init_fn``): leave SIGINT to the main process, which
    shuts the workers down itself; then unblock it (see :func:`interrupts_deferred`: a pending
    SIGINT is discarded by the ignore)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
