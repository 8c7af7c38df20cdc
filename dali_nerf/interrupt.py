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

**The checkpoint signal** (``SIGTERM`` by default, ``train.checkpoint_signal``): what torchrun
sends its workers when it stops or restarts them, and what SLURM sends before a preemption or the
time limit (``--signal=TERM@60``). :func:`stop_signal` installs its handler for a run. While the
training loop runs (:meth:`StopRequest.deferred`) the signal is only recorded: the loop finishes
its step, the ranks agree on a step they all complete (:mod:`dali_nerf.train.stopping`), write its
checkpoint and leave with :class:`Terminated`; the command exits with ``128 + signal`` (143 for
SIGTERM). Outside the loop (setup, the final evaluation) it raises :class:`Terminated` at once, so
``finally`` blocks close what is open. A watchdog bounds both: ``$DALI_NERF_TERM_GRACE_S`` (default
25, inside torchrun's 30 s before its SIGKILL) after the signal, if the run has not left the
handler's block, it prints every thread's stack and exits; a second signal one second or more
after the first exits at once. DataLoader workers
ignore it (torchrun signals each worker's whole process group): the main process shuts them down.
A command that keeps torchrun as its child (``dali-nerf demo``) holds the same handler around its
wait and passes the signal on to torchrun (:func:`dali_nerf.cli.train.launch_trainer`).

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

__all__ = ["interrupt_guard", "grace_at_least", "quiet_startup", "exit_process", "ignore_interrupts", "interrupts_deferred", "interrupted", "children", "descendants", "kill_descendants",
           "EXIT_INTERRUPTED", "DEFAULT_GRACE_S", "ECHO_S", "Terminated", "StopRequest", "stop_signal",
           "CHECKPOINT_SIGNALS", "DEFAULT_TERM_GRACE_S", "env_seconds"]

EXIT_INTERRUPTED = 130
"""Exit code after an interrupt (128 + SIGINT, as shells report it)."""

DEFAULT_GRACE_S = 10.0
"""Seconds the cleanup after the first SIGINT may take before the watchdog ends the process."""

ECHO_S = 1.0
"""A second SIGINT sooner than this after the first is the same Ctrl-C delivered twice (by the
terminal and again by torchrun) and is absorbed; a later one ends the process at once."""

DEFAULT_TERM_GRACE_S = 25.0
"""Seconds from the checkpoint signal to the watchdog's exit (torchrun sends SIGKILL after 30)."""

CHECKPOINT_SIGNALS = ("TERM", "USR2", "HUP", "XCPU")
"""Signals ``train.checkpoint_signal`` may name (``none``: no handler, the signal's default action).
Not INT (Ctrl-C: :func:`interrupt_guard`), USR1 (the stack dump), KILL or STOP (not catchable)."""

_state = {"first": None, "grace_s": DEFAULT_GRACE_S, "watchdog": None}


def env_seconds(var: str, default: float) -> float:
    """Seconds from the environment variable ``var`` (``DALI_NERF_INTERRUPT_GRACE_S``,
    ``DALI_NERF_TERM_GRACE_S``), ``default`` when it is unset or not a number."""
    try:
        return float(os.environ.get(var, default))
    except ValueError:
        return float(default)


def interrupted() -> bool:
    """True once this process received SIGINT under :func:`interrupt_guard`."""
    return _state["first"] is not None


def children(pid: int) -> List[int]:
    """Pids of the live children of ``pid`` (Linux /proc)."""
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
        kids = children(todo.pop(0))
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
        grace_s = env_seconds("DALI_NERF_INTERRUPT_GRACE_S", DEFAULT_GRACE_S)
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


@contextlib.contextmanager
def grace_at_least(grace_s: float):
    """Inside the block, the watchdog of a first SIGINT waits at least ``grace_s`` seconds: for a
    process waiting on children that stop on their own bounded path (``dali-nerf train`` waiting
    for torchrun and its ranks) and must outlast them. Outside :func:`interrupt_guard` it changes
    nothing that runs."""
    prev = _state["grace_s"]
    _state["grace_s"] = max(prev, float(grace_s))
    try:
        yield
    finally:
        _state["grace_s"] = prev


def exit_process(code: int) -> None:
    """End a command with ``code``. After an interrupt (``code`` 130 or :func:`interrupted`) or the
    checkpoint signal (``code`` 128 + one of :data:`CHECKPOINT_SIGNALS`): flush and ``os._exit``
    without interpreter shutdown (see the module doc); otherwise ``sys.exit``."""
    code = int(code or 0)
    signalled = code - 128 in {getattr(signal, f"SIG{n}") for n in CHECKPOINT_SIGNALS}
    if code == EXIT_INTERRUPTED or interrupted() or signalled:
        # normally none are left (the sources closed their workers); a leftover gets SIGKILL, since
        # DataLoader workers ignore SIGINT and the checkpoint signals (ignore_interrupts)
        kill_descendants(signal.SIGKILL)
        _flush()
        os._exit(EXIT_INTERRUPTED if interrupted() else code)
    sys.exit(code)


@contextlib.contextmanager
def interrupts_deferred(block: bool = True):
    """Start worker processes inside this block. A SIGINT that arrives meanwhile is held and
    raised (by the handler in force before the block) when the block ends, so the start is never
    cut in half (a DataLoader iterator interrupted inside its constructor leaves workers behind and
    a traceback from its ``__del__``); and SIGINT is blocked in the calling thread, so a process
    forked here starts with it blocked (the mask is inherited) until its :func:`ignore_interrupts`
    runs. ``block=False``: held only, not blocked (a child that must get SIGINT, e.g. torchrun)."""
    main = threading.current_thread() is threading.main_thread()
    held = []
    prev = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum)) if main else None
    old = (signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
           if block and hasattr(signal, "pthread_sigmask") else None)
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
    """In a worker process (DataLoader ``worker_init_fn``): leave SIGINT and the checkpoint signals
    (:data:`CHECKPOINT_SIGNALS`: torchrun sends SIGTERM to each worker's whole process group) to
    the main process, which shuts the workers down itself (and a worker whose parent died exits by
    itself: torch's worker watchdog); then unblock SIGINT (see :func:`interrupts_deferred`: a
    pending SIGINT is discarded by the ignore)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in CHECKPOINT_SIGNALS:
        signal.signal(getattr(signal, f"SIG{name}"), signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class Terminated(BaseException):
    """The checkpoint signal ended a run (a ``BaseException``, like ``KeyboardInterrupt``: ``except
    Exception`` does not swallow it, ``finally`` blocks run). ``exit_code`` = 128 + the signal;
    ``str()`` is the one line to print (default: what the handler says when it raises; empty on
    ranks that have nothing to add)."""

    def __init__(self, signum: int, message: Optional[str] = None):
        if message is None:
            message = (f"terminated by {signal.Signals(signum).name} outside the training loop; the last complete "
                       f"checkpoint is kept")
        super().__init__(message)
        self.signum = int(signum)
        self.exit_code = 128 + int(signum)


class StopRequest:
    """The checkpoint signal's state in this process: :attr:`signum` once received (None before);
    :meth:`deferred` for the block in which it is only recorded."""

    def __init__(self, signum: Optional[int], grace_s: float):
        self.signum_wanted = signum
        self.signum: Optional[int] = None
        self.first: Optional[float] = None
        self.defer = False
        self.grace_s = grace_s
        self.disarmed = threading.Event()  # set when the handler's block ends: the watchdog stands down
        self.term_prev = None  # SIGTERM's handler before _handle took it over (another checkpoint signal)

    @property
    def received(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or self.signum_wanted).name if (self.signum or self.signum_wanted) else "none"

    @contextlib.contextmanager
    def deferred(self):
        """Record the signal inside the block (the training loop reads :attr:`received` at step
        boundaries); outside it the signal raises :class:`Terminated`."""
        self.defer = True
        try:
            yield self
        finally:
            self.defer = False

    def raise_if_received(self, message: Optional[str] = None) -> None:
        if self.signum is not None:
            raise Terminated(self.signum, message)

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.first is not None:  # the first is being handled
            if now - self.first >= ECHO_S:
                _exit_now(f"{signal.Signals(signum).name} again; exiting without finishing the checkpoint", 128 + signum)
            return  # the same signal delivered twice (torchrun signals each worker's process group)
        self.signum, self.first = signum, now
        if signum != signal.SIGTERM and threading.current_thread() is threading.main_thread():
            # a checkpoint signal other than TERM: a SIGTERM from now on is the same stop, not a
            # second one (torchrun, signalled twice, shuts its workers down again with SIGTERM,
            # its default): recorded, not fatal, so the checkpoint is finished (the watchdog
            # still bounds it); the handler before it comes back when the block ends
            self.term_prev = signal.signal(signal.SIGTERM, self._echo)
        threading.Thread(target=self._watchdog, name="dali_nerf-term-watchdog", daemon=True).start()
        if not self.defer:
            raise Terminated(signum)

    def _echo(self, signum, frame):
        """SIGTERM after another checkpoint signal was received: the stop already under way."""

    def _watchdog(self):
        if self.disarmed.wait(self.grace_s):  # the block ended in time (the process may go on: tests, notebooks)
            return
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except Exception:
            pass
        _exit_now(f"still running {self.grace_s:g} s after {self.name} (DALI_NERF_TERM_GRACE_S); the stacks above "
                  f"show where it was", 128 + (self.signum or 0))


def _exit_now(why: str, code: int) -> None:
    try:
        stderr_line(f"error: {why} (exit {code})")
    except Exception:
        pass
    kill_descendants()
    _flush()
    os._exit(code)


@contextlib.contextmanager
def stop_signal(name: str = "TERM", grace_s: Optional[float] = None):
    """Handle the checkpoint signal ``name`` (one of :data:`CHECKPOINT_SIGNALS`, or ``none``) for
    the block: yields a :class:`StopRequest` (see the module doc); the previous handler is put back
    after. ``none``, or a thread other than the main one: no handler, the request never fires."""
    if grace_s is None:
        grace_s = env_seconds("DALI_NERF_TERM_GRACE_S", DEFAULT_TERM_GRACE_S)
    if name == "none" or threading.current_thread() is not threading.main_thread():
        yield StopRequest(None, grace_s)
        return
    signum = getattr(signal, f"SIG{name}")
    req = StopRequest(signum, max(0.1, grace_s))
    prev = signal.signal(signum, req._handle)
    try:
        yield req
    finally:
        signal.signal(signum, prev)
        if req.term_prev is not None:
            signal.signal(signal.SIGTERM, req.term_prev)
        req.disarmed.set()
