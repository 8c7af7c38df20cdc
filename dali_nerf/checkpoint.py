"""Atomic, per-rank checkpoints.

Layout under ``runs/<name>/checkpoints/``::

    step_000500/rank0.pt, rank1.pt, ...   one file per rank (model, optimizer, loader, RNG state)
    latest                                 text: the name of the newest *complete* step folder

Each rank writes ``rankR.pt`` to a temporary file in the same folder, fsyncs it and renames it
(``os.replace`` is atomic on POSIX; :mod:`dali_nerf.atomic`). After a barrier, rank 0 rewrites ``latest`` the same way. A
kill at any point leaves the previous ``latest`` and its files intact: a reader only ever follows
``latest``. Files are loaded with ``torch.load(weights_only=True)``: checkpoints hold tensors,
numbers, strings, lists and dicts only, so a crafted pickle cannot run code.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Optional

import torch

from .atomic import atomic_write, atomic_write_bytes, atomic_write_json, atomic_write_text
from .errors import DaliNerfError

__all__ = ["save_rank_state", "commit_checkpoint", "latest_checkpoint", "load_rank_state", "atomic_write_bytes", "atomic_write_text",
           "atomic_write_json"]


def save_rank_state(ckpt_root, step: int, rank: int, state: dict) -> Path:
    """Write this rank's state for ``step`` atomically; returns the file. Call on every rank, then
    :func:`commit_checkpoint` after a barrier."""
    folder = Path(ckpt_root) / f"step_{step:07d}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DaliNerfError(f"{folder}: cannot create checkpoint folder ({e.strerror}); choose a writable train.runs_dir") from None
    path = folder / f"rank{rank}.pt"
    atomic_write(path, lambda f: torch.save(state, f))
    return path


def commit_checkpoint(ckpt_root, step: int, keep: int = 2) -> None:
    """Rank 0, after all ranks saved: point ``latest`` at ``step`` and prune older folders."""
    ckpt_root = Path(ckpt_root)
    atomic_write_text(ckpt_root / "latest", f"step_{step:07d}\n")
    folders = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for old in folders[:-keep] if keep > 0 else []:
        if old.name != f"step_{step:07d}":
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(ckpt_root) -> Optional[Path]:
    """Folder of the newest complete checkpoint, or None (no ``latest`` pointer, or the folder it
    names is gone).

    The pointer must hold the name of a folder directly inside ``ckpt_root`` (``step_0000500``):
    an absolute path, a name with a separator or ``..``, or a symlink leading out of
    ``ckpt_root`` is refused, so a crafted pointer cannot make ``--resume`` or ``dali-nerf render``
    load files from elsewhere.

    Raises:
        DaliNerfError: the pointer names something outside ``ckpt_root`` (one line naming it).
    """
    root = Path(ckpt_root)
    p = root / "latest"
    if not p.is_file():
        return None
    try:
        name = p.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise DaliNerfError(f"{p}: cannot read the checkpoint pointer ({e}); delete it or write the name of a step_* folder") from None
    folder = root / name
    inside = (bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name
              and not Path(name).is_absolute())
    if inside and folder.exists():
        inside = folder.resolve().parent == root.resolve()
    if not inside:
        raise DaliNerfError(
            f"{p}: names {name!r}, which is not a checkpoint folder inside {root}; delete the file or "
            f"write the name of one of its step_* folders"
        )
    return folder if folder.is_dir() else None


def load_rank_state(folder, rank: int, map_location="cpu") -> dict:
    """Load ``rankR.pt`` from a checkpoint folder with ``weights_only=True``."""
    path = Path(folder) / f"rank{rank}.pt"
    if not path.is_file():
        raise DaliNerfError(f"{path}: checkpoint file missing; resume with the world size the run was saved with")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "global" in str(e).lower():  # weights_only refused a class / function reference
            raise DaliNerfError(f"{path}: refusing to unpickle: it references Python objects beyond tensors and plain data "
                                f"(possibly crafted); only load checkpoints written by dali_nerf") from None
        raise DaliNerfError(f"{path}: not a readable dali_nerf checkpoint (UnpicklingError); delete it or resume from an older step") from None
    except Exception as e:  # corrupt file or a pickle that is not plain data
        raise DaliNerfError(f"{path}: not a readable dali_nerf checkpoint ({type(e).__name__}); delete it or resume from an older step") from None
