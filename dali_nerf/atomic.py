"""Atomic file writes: a temporary file in the same folder, fsynced, then renamed over the target.

``os.replace`` is atomic on POSIX: a reader (or a run killed mid-write) sees either the old file
or the complete new one, never a torn one. The folder is fsynced after the rename. A write that
fails (disk full, file too large, unwritable folder) removes the temporary file and raises a
one-line :class:`~dali_nerf.errors.DaliNerfError` naming the file.

Used by checkpoints (``checkpoint.py``), ``summary.json`` / ``config.yaml`` / ``metrics.jsonl``
rewrites (``training.py``), the demo's ``report.md`` and the study's outputs.

>>> atomic_write_json("runs/x/derived.json", {"a": 1})
>>> atomic_write_text("runs/x/report.md", "# report\\n")
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

from dali_nerf.errors import DaliNerfError

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "atomic_write_json", "DEFAULT_HINT"]

#: What the one-line error of a failed write tells the user to do (callers may pass their own).
DEFAULT_HINT = "free disk space or choose a writable train.runs_dir"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _WriteGuard:
    """File wrapper that remembers the first OSError of a ``write`` (disk full, file too large):
    ``torch.save``'s zip writer reports it only as a RuntimeError ("unexpected pos")."""

    def __init__(self, f):
        self.f = f
        self.error: Optional[OSError] = None

    def write(self, b):
        try:
            return self.f.write(b)
        except OSError as e:
            if self.error is None:
                self.error = e
            raise

    def flush(self):
        return self.f.flush()


def atomic_write(path, write: Callable, hint: str = DEFAULT_HINT) -> None:
    """Call ``write(f)`` on a binary file object, then put the result at ``path`` atomically.

    Args:
        path: the target file.
        write: writes the content to the file object it is given.
        hint: what the error message tells the user to do when the write fails.
    Raises:
        DaliNerfError: the file cannot be written (one line naming ``path``); the previous
            ``path`` is left as it was and no temporary file stays behind.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    guard = None
    try:
        with open(tmp, "wb") as f:
            guard = _WriteGuard(f)
            write(guard)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        err = e if isinstance(e, OSError) else (guard.error if guard is not None else None)
        if err is None:
            raise
        raise DaliNerfError(f"{path}: cannot write ({err.strerror or err}); {hint}") from None
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path, data: bytes, hint: str = DEFAULT_HINT) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename)."""
    atomic_write(path, lambda f: f.write(data), hint)


def atomic_write_text(path, text: str, hint: str = DEFAULT_HINT) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"), hint)


def atomic_write_json(path, obj, hint: str = DEFAULT_HINT, indent: int = 2, default=None) -> None:
    """Write ``obj`` as JSON (``indent`` spaces, trailing newline; ``default`` as in
    :func:`json.dumps`, e.g. ``float`` for numpy scalars) to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent, default=default) + "\n", hint)
