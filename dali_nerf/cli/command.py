"""Running a command: user errors become one line and exit code 2, Ctrl-C one line and 130, and
what a command sets for itself is put back after it (used by ``dali-nerf`` and the trainers).

>>> rc = run_cli(lambda: 0)
"""

from __future__ import annotations

import contextlib
import os
import sys

from dali_nerf.errors import DaliNerfError, stderr_line
from dali_nerf.interrupt import Terminated, interrupt_guard

__all__ = ["run_cli"]


@contextlib.contextmanager
def _command_scope():
    """What a command sets for itself is put back after it, so a command run in-process (tests,
    a notebook) leaves the caller's process as it found it: OpenCV's log level (DALI's bundled
    OpenCV logs decoder warnings to stderr; our errors say it in one line) and torch's intra-op
    thread count (the trainers and the study set it per rank)."""
    prev = os.environ.get("OPENCV_LOG_LEVEL")
    os.environ.setdefault("OPENCV_LOG_LEVEL", "ERROR")
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop("OPENCV_LOG_LEVEL", None)
        torch = sys.modules.get("torch")
        if threads is not None and torch is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def run_cli(fn, *args, **kwargs) -> int:
    """Call ``fn`` under :func:`~dali_nerf.interrupt.interrupt_guard`; a :class:`DaliNerfError`
    becomes one line on stderr and exit code 2, Ctrl-C the line ``interrupted`` and 130, the
    checkpoint signal (:class:`~dali_nerf.interrupt.Terminated`) its line and 128 + the signal (end
    the process with :func:`~dali_nerf.interrupt.exit_process`, which bounds the exit too)."""
    try:
        with interrupt_guard(), _command_scope():
            rc = fn(*args, **kwargs)
        return int(rc or 0)
    except DaliNerfError as e:
        stderr_line(f"error: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        stderr_line("interrupted")
        return 130
    except Terminated as e:
        if str(e):
            stderr_line(str(e))
        return e.exit_code
    except BrokenPipeError:
        return 0
