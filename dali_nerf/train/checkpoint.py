"""Atomic checkpoint files: one folder per step, a ``latest`` pointer.

Layout under ``runs/<name>/checkpoints/`` (format 2, :mod:`dali_nerf.train.resume` decides the content)::

    step_000500/run.pt        the run's state, once: step, world size, method, stream, global batch,
                              seed, mode, the scene's fingerprint, every rank's RNG and loader state
                model.pt      DDP: the model, once (field, optimizer, scheduler, occupancy: the
                              replicas are identical)
                cell3.pt ...  SS: one file per cell (its field, optimizer, occupancy, loader state)
    latest                    text: the name of the newest *complete* step folder

Format 1 (written before format 2: one ``rank<R>.pt`` per rank holding everything of that rank)
is still read (:func:`checkpoint_format`, :func:`load_rank_state`).

Each file is written to a temporary file in the same folder, fsynced and renamed (``os.replace``
is atomic on POSIX; :mod:`dali_nerf.atomic`). After a barrier, rank 0 rewrites ``latest`` the
same way. A kill at any point leaves the previous ``latest`` and its files intact: a reader only
ever follows ``latest``. Files are loaded with ``torch.load(weights_only=True)``: checkpoints hold
tensors, numbers, strings, lists and dicts only, so a crafted pickle cannot run code; the zip's
CRC-32 of every record is then verified (``torch.load`` does not check them: a flipped bit inside
a tensor would load silently).

Resuming (:func:`resume_checkpoint`): the newest checkpoint whose files *every* rank can read.
A file that is missing, truncated, corrupt or not a training checkpoint
(:class:`CheckpointUnreadable`) makes every rank fall back to the previous committed folder
(``latest``'s, then the older ``step_*`` folders; ``commit_checkpoint`` keeps 2), each rank
warning about its own bad file; with no complete checkpoint left it is one error naming the bad
files. A crafted file, or a checkpoint that does not fit the run (a world size it cannot resume
on, another scene), is refused at once: those are not damage that an older step repairs.
"""

from __future__ import annotations

import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Callable, List, Optional

import torch

from dali_nerf.atomic import atomic_write, atomic_write_bytes, atomic_write_json, atomic_write_text
from dali_nerf.errors import DaliNerfError

__all__ = ["save_rank_state", "save_file", "commit_checkpoint", "latest_checkpoint", "load_rank_state", "load_file",
           "checkpoint_format", "atomic_write_bytes", "atomic_write_text", "atomic_write_json", "CheckpointUnreadable",
           "checkpoint_candidates", "resume_checkpoint", "RUN_FILE", "MODEL_FILE", "cell_file"]

RUN_FILE = "run.pt"
"""Format 2: the run's state (written once, by rank 0)."""
MODEL_FILE = "model.pt"
"""Format 2, DDP: the model (written once, by rank 0)."""


def cell_file(cell: int) -> str:
    """Format 2, SS: the file of cell ``cell`` (written by the rank that trains it)."""
    return f"cell{int(cell)}.pt"

_STEP = re.compile(r"step_(\d+)$")


class CheckpointUnreadable(DaliNerfError):
    """A rank file that is missing, truncated, corrupt or not a dali_nerf training checkpoint:
    damage an older checkpoint repairs (:func:`resume_checkpoint` falls back). ``path`` is the
    file, ``reason`` what is wrong with it."""

    def __init__(self, path, reason: str, advice: str = "delete it or resume from an older step"):
        super().__init__(f"{path}: {reason}; {advice}")
        self.path, self.reason = Path(path), reason


def save_file(ckpt_root, step: int, name: str, state: dict) -> Path:
    """Write ``state`` as file ``name`` of the folder of ``step`` atomically; returns the file.
    Each rank writes its files, then :func:`commit_checkpoint` after a barrier."""
    folder = Path(ckpt_root) / f"step_{step:07d}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DaliNerfError(f"{folder}: cannot create checkpoint folder ({e.strerror}); choose a writable train.runs_dir") from None
    path = folder / name
    atomic_write(path, lambda f: torch.save(state, f))
    return path


def save_rank_state(ckpt_root, step: int, rank: int, state: dict) -> Path:
    """Format 1: this rank's whole state as ``rank<R>.pt`` (:func:`save_file`)."""
    return save_file(ckpt_root, step, f"rank{rank}.pt", state)


def checkpoint_format(folder) -> int:
    """1 when the step folder holds per-rank files (``rank<R>.pt``, written before format 2), else 2."""
    return 1 if any(Path(folder).glob("rank*.pt")) and not (Path(folder) / RUN_FILE).exists() else 2


def commit_checkpoint(ckpt_root, step: int, keep: int = 2) -> None:
    """Rank 0, after all ranks saved: point ``latest`` at ``step`` and prune older folders."""
    ckpt_root = Path(ckpt_root)
    atomic_write_text(ckpt_root / "latest", f"step_{step:07d}\n")
    folders = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for old in folders[:-keep] if keep > 0 else []:
        if old.name != f"step_{step:07d}":
            shutil.rmtree(old, ignore_errors=True)


def _latest_name(root: Path) -> Optional[str]:
    """The folder name ``root/latest`` holds (checked to stay inside ``root``), or None without
    a pointer."""
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
    return name


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
    name = _latest_name(root)
    if name is None:
        return None
    folder = root / name
    return folder if folder.is_dir() else None


def checkpoint_candidates(ckpt_root) -> List[Path]:
    """The committed checkpoint folders, newest first: the one ``latest`` names (listed even when
    it is gone, so that the caller can say so), then every older ``step_*`` folder (each was
    ``latest`` once). Folders of later steps than ``latest`` were never committed (a kill during
    their write) and are not listed. [] without a ``latest`` pointer.

    >>> checkpoint_candidates("runs/x/checkpoints")
    [PosixPath('runs/x/checkpoints/step_0000008'), PosixPath('runs/x/checkpoints/step_0000004')]
    """
    root = Path(ckpt_root)
    name = _latest_name(root)
    if name is None:
        return []
    m = _STEP.match(name)
    older = []
    if m is not None:
        newest = int(m.group(1))
        for p in root.glob("step_*"):
            mp = _STEP.match(p.name)
            if mp is not None and int(mp.group(1)) < newest and p.is_dir() and not p.is_symlink():
                older.append((int(mp.group(1)), p))
    return [root / name] + [p for _, p in sorted(older, reverse=True)]


def _first_line(e: Exception, limit: int = 120) -> str:
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    return f"{type(e).__name__}: {lines[0][:limit]}" if lines else type(e).__name__


def load_rank_state(folder, rank: int, map_location="cpu") -> dict:
    """Format 1: load ``rank<R>.pt`` of a checkpoint folder (:func:`load_file`)."""
    return load_file(folder, f"rank{rank}.pt", map_location,
                     missing="resume with the world size the run was saved with")


def load_file(folder, name: str, map_location="cpu", missing: str = "restore it or resume from an older step") -> dict:
    """Load file ``name`` of a checkpoint folder with ``weights_only=True`` and verify the CRC-32
    of every record of its zip.

    Raises:
        CheckpointUnreadable: the folder or file is missing (``missing``: what to do), or the file
            is truncated or corrupt (one line naming it; an older checkpoint may be complete).
        DaliNerfError: the file references Python objects beyond plain data (possibly crafted).
    """
    folder = Path(folder)
    path = folder / name
    if not folder.is_dir():
        raise CheckpointUnreadable(folder, "checkpoint folder missing", "restore it or resume from an older step")
    if not path.is_file():
        raise CheckpointUnreadable(path, "checkpoint file missing", missing)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "global" in str(e).lower():  # weights_only refused a class / function reference
            raise DaliNerfError(f"{path}: refusing to unpickle: it references Python objects beyond tensors and plain data "
                                f"(possibly crafted); only load checkpoints written by dali_nerf") from None
        raise CheckpointUnreadable(path, "not a readable dali_nerf checkpoint (UnpicklingError)") from None
    except Exception as e:  # truncated / corrupt file, or a pickle that is not plain data
        raise CheckpointUnreadable(path, f"not a readable dali_nerf checkpoint ({_first_line(e)})") from None
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError):  # torch's legacy (non-zip) format: no checksums to verify
        bad = None
    except Exception as e:  # a damaged zip directory that torch.load still read
        raise CheckpointUnreadable(path, f"corrupt checkpoint ({_first_line(e)})") from None
    if bad is not None:
        raise CheckpointUnreadable(path, f"corrupt checkpoint (checksum mismatch in its record {bad})")
    return state


def resume_checkpoint(ckpt_root, rank: int, check: Optional[Callable[[dict, Path], None]] = None,
                      gather: Optional[Callable[[int], List[int]]] = None,
                      load: Optional[Callable[[Path], dict]] = None):
    """The checkpoint to resume from: the newest committed folder whose files every rank reads.

    Every rank calls it (it is a collective when ``gather`` is). For each candidate of
    :func:`checkpoint_candidates`, newest first, each rank loads what it needs, ``load(folder)``
    (default: its own format-1 file, :func:`load_rank_state`; ``load`` may raise the same errors
    as ``check``), and runs ``check(state, folder)`` on it; ``gather(code)`` returns
    the codes of all ranks (0: readable, 1: :class:`CheckpointUnreadable`, 2: any other
    :class:`DaliNerfError`), so all ranks take the same decision: every rank's file readable ->
    this folder; some unreadable -> the next older folder; any refusal -> every rank stops.

    Args:
        ckpt_root: ``runs/<name>/checkpoints``.
        rank: this process's rank.
        check: raises :class:`CheckpointUnreadable` for a file that is not a usable checkpoint
            (falls back) or :class:`DaliNerfError` for one that does not fit the run (refused).
        gather: ``code -> [code of rank 0, 1, ...]`` (None: one process, ``[code]``).
    Returns:
        ``(folder, state, skipped)``: this rank's state of the chosen folder, and the
        :class:`CheckpointUnreadable` of this rank's own files in the newer folders skipped.
    Raises:
        DaliNerfError: no ``latest`` pointer; a refusal (this rank's own message, or one naming
            the ranks that refused); or no complete checkpoint left (one line naming the files).
    """
    root = Path(ckpt_root)
    candidates = checkpoint_candidates(root)
    if not candidates:
        raise DaliNerfError(f"{root}: no checkpoint to resume from; run without --resume")
    gather = gather or (lambda code: [code])
    skipped: List[CheckpointUnreadable] = []
    bad_files: List[str] = []
    for folder in candidates:
        state, mine, refused = None, None, None
        try:
            state = load(folder) if load is not None else load_rank_state(folder, rank)
            if check is not None:
                check(state, folder)
        except CheckpointUnreadable as e:
            mine = e
        except DaliNerfError as e:
            refused = e
        codes = gather(2 if refused is not None else 1 if mine is not None else 0)
        if refused is not None:
            raise refused
        if 2 in codes:
            ranks = ", ".join(str(r) for r, c in enumerate(codes) if c == 2)
            raise DaliNerfError(f"{folder}: rank {ranks} refused to resume from this checkpoint (see that rank's error); "
                                f"fix what it names or run without --resume")
        if not any(codes):
            return folder, state, skipped
        if mine is not None:
            skipped.append(mine)
            bad_files.append(f"{mine.path}: {mine.reason}")
        theirs = (lambda r: folder / f"rank{r}.pt") if load is None else (lambda r: folder)
        bad_files += [f"{theirs(r)}: unreadable on rank {r}" for r, c in enumerate(codes) if c and r != rank]
    raise DaliNerfError(f"{root}: no complete checkpoint to resume from ({'; '.join(bad_files)}); restore the files "
                        f"from a copy, or run without --resume to start anew")
