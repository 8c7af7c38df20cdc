"""Where a study ran: the machine's slug and description, and the commit (clean or ``-dirty``).

>>> machine_slug()
'cpu-2core-x86_64'
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

import torch

from dali_nerf.data.hostbudget import usable_cores

__all__ = ["machine_slug", "machine_desc", "git_commit", "host_cores", "cpu_model", "last_level_cache"]


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity: :func:`dali_nerf.data.hostbudget.usable_cores`),
    what the study's budgets, host capacity and report count: under ``taskset -c 0-3`` a 64-core
    machine is a 4-core host to the study."""
    return usable_cores()


def machine_slug() -> str:
    """``cpu-2core-x86_64`` or ``gpu-<name>-<n>x-<cores>core-<arch>`` (lower case, no spaces; cores:
    :func:`host_cores`)."""
    cores = host_cores()
    arch = platform.machine() or "unknown"
    gpu = None
    try:
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
            gpu = f"gpu-{'-'.join(name.split())}-{torch.cuda.device_count()}x"
    except Exception:  # no driver: a CPU machine
        gpu = None
    return f"{gpu or 'cpu'}-{cores}core-{arch}"


def machine_desc() -> str:
    """``Linux x86_64, 2 CPU cores (<model name>), no GPU`` (the report's machine line; cores:
    :func:`host_cores`, with the machine's count beside it when the affinity allows fewer)."""
    n, total = host_cores(), os.cpu_count() or 1
    desc = f"{platform.system()} {platform.machine()}, {n} CPU cores" + (f" usable of {total}" if n < total else "")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    desc += f" ({line.split(':', 1)[1].strip()})"
                    break
        if torch.cuda.is_available():
            desc += f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
        else:
            desc += ", no GPU"
    except Exception:
        pass
    return desc


def cpu_model() -> Optional[str]:
    """The CPU's model name (/proc/cpuinfo), None where it is not known."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def last_level_cache() -> Optional[str]:
    """The last-level CPU cache of core 0 as sysfs reports it (``260 MiB L3``; a VM reports its
    host's, shared with what else runs there), None where sysfs does not say."""
    best = None
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((d / n).read_text().strip() for n in ("level", "type", "size"))
        except OSError:
            continue
        if kind in ("Unified", "Data") and (best is None or int(level) > best[0]):
            best = (int(level), size)
    if best is None:
        return None
    level, size = best
    m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    n = int(size[:-1]) * m[size[-1]] if size[-1] in m else int(size)
    return f"{n / (1 << 20):.3g} MiB L{level}"


def git_commit(repo: Optional[Path] = None, exclude: str = "docs/study") -> str:
    """``git rev-parse HEAD``, plus ``-dirty`` when tracked or untracked (not ignored) files outside
    ``exclude`` differ from it (the report itself lives under ``exclude``); "unknown" outside git."""
    repo = repo or Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", ".",
                                f":(exclude){exclude}"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")
