"""One trainer per run folder: ``runs/<name>/.lock``.

Two trainers started on the same run folder used to both run, each writing its metrics, its
checkpoints and its ``latest`` over the other's. Rank 0 of a run now holds an exclusive
``flock`` on ``<run_dir>/.lock`` from before it reads anything in the folder until the run ends;
the file names the holder (pid, host, start time). A second trainer is refused in one line naming
it. The kernel drops the lock when its process ends, however it ends (SIGKILL, a crash, a
torchrun restart), so the lock of a dead process is taken over by the next trainer with nothing
to clean up; a lock file left behind by one is just rewritten. On a file system without
``flock`` (some network mounts) the run goes on with a one-line warning: the folder is then not
protected.

>>> with RunLock(run_dir):
...     train()                       # another trainer on run_dir: DaliNerfError naming this one
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Optional

from dali_nerf.errors import DaliNerfError, shown, stderr_line

__all__ = ["RunLock", "LOCK_FILE"]

LOCK_FILE = ".lock"
"""The lock's file in the run folder (removed when the run ends)."""

_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


class RunLock:
    """The exclusive lock of a run folder, held from :meth:`acquire` to :meth:`release` (a context
    manager). ``run_dir`` must exist."""

    def __init__(self, run_dir):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        """Take the lock or raise :class:`DaliNerfError` naming the process that holds it."""
        while self.fd is None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise DaliNerfError(f"{self.run_dir}: output folder is not writable ({e.strerror}); set "
                                    f"train.runs_dir to a writable folder") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise DaliNerfError(f"{self.run_dir}: in use by another trainer ({holder}); wait for it to end or stop "
                                    f"it, or train under another name=") from None
            except OSError as e:
                if e.errno not in _NO_FLOCK:
                    os.close(fd)
                    raise DaliNerfError(f"{self.path}: cannot lock the run folder ({e.strerror})") from None
                stderr_line(f"warning: {self.path}: this file system cannot lock ({e.strerror}); a second trainer "
                            f"started on this run folder would not be stopped")
            if not _still_there(fd, self.path):  # the holder removed it as we opened it: take the new one
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
            self.fd = fd
        return self

    def release(self) -> None:
        """Remove the file and drop the lock (idempotent). The file goes first, while the lock is
        still held, so a trainer waiting for it never locks a file that is no longer the lock."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return shown(text)[1:-1] if text else "a process that has not yet written its pid"


def _still_there(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
