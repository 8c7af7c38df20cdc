"""User-facing errors.

Every problem a user can fix (bad data, bad config, missing compiler, unwritable folder) is raised
as a :class:`DaliNerfError` subclass carrying a one-line message that names the file or field and
what to do. The CLI and the trainers print ``error: <message>`` and exit with code 2, without a
traceback (see :func:`dali_nerf.cli.command.run_cli`).

A message never grows with the input: a value the user gave is formatted with :func:`shown`
(``reprlib``: long strings, lists and nested containers cut with ``...``), and the message itself
is cut at :data:`MAX_MESSAGE` characters.
"""

from __future__ import annotations

import reprlib
import sys

__all__ = ["DaliNerfError", "ConfigError", "LaunchError", "SceneError", "PluginBuildError", "DataError", "stderr_line",
           "shown", "MAX_MESSAGE"]

MAX_MESSAGE = 2000
"""Characters of a one-line message at most; a longer one is cut, saying how much was left out."""

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxlevel = 2
_REPR.maxlong = 40


def shown(value) -> str:
    """``repr(value)`` bounded whatever the value: strings over 80 characters, containers over 6
    items or 2 levels deep and integers over 40 digits are cut with ``...`` (``reprlib``), so a
    value expanded from a YAML alias bomb, or a 4000-digit integer, costs a few hundred
    characters in a message, never its own size.

    >>> shown(list(range(10 ** 6)))
    '[0, 1, 2, 3, 4, 5, ...]'
    """
    try:
        return _REPR.repr(value)
    except Exception:  # e.g. an int past Python's digit limit for str()
        bits = f" of {value.bit_length()} bits" if isinstance(value, int) else ""
        return f"<{type(value).__name__}{bits}>"


class DaliNerfError(Exception):
    """Base class: a problem in the user's input or environment, reported in one line."""

    exit_code = 2

    def __str__(self) -> str:  # one line, always, of bounded length
        text = " ".join(str(a) for a in self.args).replace("\n", " ")
        if len(text) > MAX_MESSAGE:
            text = f"{text[:MAX_MESSAGE]}... ({len(text) - MAX_MESSAGE} more characters)"
        return text


class ConfigError(DaliNerfError):
    """A config key is unknown, of the wrong type, out of range, or names a missing path."""


class LaunchError(ConfigError):
    """A launcher variable (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, TORCHELASTIC_*) is malformed, out of range or inconsistent
    (:mod:`dali_nerf.launch_env`)."""


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
