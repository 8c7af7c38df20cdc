"""User-facing errors.

Every problem a user can fix (bad data, bad config, missing compiler, unwritable folder) is raised
as a :class:`DaliNerfError` subclass carrying a one-line message that names the file or field and
what to do. The CLI and the trainers print ``error: <message>`` and exit with code 2, without a
traceback (see :func:`dali_nerf.cli.command.run_cli`).
"""

from __future__ import annotations

import sys

__all__ = ["DaliNerfError", "ConfigError", "SceneError", "PluginBuildError", "DataError", "stderr_line"]


class DaliNerfError(Exception):
    """Base class: a problem in the user's input or environment, reported in one line."""

    exit_code = 2

    def __str__(self) -> str:  # one line, always
        return " ".join(str(a) for a in self.args).replace("\n", " ")


class ConfigError(DaliNerfError):
    """A config key is unknown, of the wrong type, out of range, or names a missing path."""


class SceneError(DaliNerfError):
    """A scene folder or one of its files is missing, malformed or inconsistent."""


class DataError(SceneError):
    """An image cannot be decoded or does not match its declared size/format."""


class PluginBuildError(DaliNerfError):
    """The C++ operator plugin could not be built or loaded."""


def stderr_line(line: str) -> None:
    """Write ``line`` and its newline to stderr in one write, then flush.

    The ranks of a torchrun job share their launcher's stderr pipe; ``print`` writes the text and
    the newline apart, so under ``python -u`` (unbuffered) two ranks' lines can interleave as
    ``interruptedinterrupted``. One write of a short line to a pipe is atomic (PIPE_BUF)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
