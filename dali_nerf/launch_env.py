"""The launcher's variables, read in one place and checked before any rendezvous.

torchrun (and SLURM scripts that mimic it) tell each process who it is through the environment:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
and, under torchrun's elastic agent, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT`` and
``TORCHELASTIC_USE_AGENT_STORE``. Every module that needs one of them calls :func:`launch_env`
(tests/test_launch_env.py fails when another module reads them itself), so a bad value is one line
naming the variable, exit 2 (:class:`~dali_nerf.errors.LaunchError`), never a traceback from
``int('')`` (``WORLD_SIZE=$SLURM_NTASKS`` with the variable unset) nor a 30-minute wait for a
rank that cannot exist (``RANK=2 WORLD_SIZE=2``).

Rules (a variable may be unset; a set one must be well formed):

* every set variable is a decimal integer in range: ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` >= 1;
  ``RANK``, ``LOCAL_RANK``, ``TORCHELASTIC_RESTART_COUNT`` >= 0; ``MASTER_PORT`` a port, 1-65535;
  ``MASTER_ADDR`` a host name or address (no space);
* consistent: ``RANK < WORLD_SIZE`` (unset: 1 process), and, where both sides are set,
  ``LOCAL_WORLD_SIZE <= WORLD_SIZE``, ``LOCAL_RANK < LOCAL_WORLD_SIZE``, ``LOCAL_RANK <= RANK``;
* forming a process group (:func:`group_env`: ``WORLD_SIZE`` > 1) needs ``RANK``,
  ``MASTER_ADDR`` and ``MASTER_PORT``, as ``init_process_group``'s ``env://`` does.

Defaults: ``WORLD_SIZE`` 1, ``RANK`` 0, ``LOCAL_WORLD_SIZE`` = ``WORLD_SIZE`` (the ranks share this
host), ``LOCAL_RANK`` = ``RANK`` when they do, else 0.

>>> env = launch_env()            # no launcher: rank 0 of 1
>>> env.rank, env.world_size, env.local_world_size
(0, 1, 1)
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from dali_nerf.errors import LaunchError, shown

__all__ = ["LaunchEnv", "launch_env", "group_env", "children_env", "rank_variables", "VARIABLES"]

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")
"""Every launcher variable dali_nerf reads (only here)."""

_FIX = "fix the launcher's variables, or unset them to run one process (torchrun sets them all)"
_INT = re.compile(r"\s*[+]?[0-9]{1,18}\s*")


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the launch (checked)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    run_id: Optional[str] = None         # TORCHELASTIC_RUN_ID: set on every worker torchrun starts
    restart_count: int = 0               # TORCHELASTIC_RESTART_COUNT
    agent_store: bool = False            # TORCHELASTIC_USE_AGENT_STORE == "True"

    @property
    def elastic(self) -> bool:
        """Whether torch's elastic agent (torchrun) started this process."""
        return self.run_id is not None


def _int(environ: Mapping[str, str], name: str, lo: int, hi: Optional[int] = None, what: str = "") -> Optional[int]:
    raw = environ.get(name)
    if raw is None:
        return None
    if not _INT.fullmatch(raw) or not lo <= int(raw) <= (hi if hi is not None else int(raw)):
        rng = f"{lo}-{hi}" if hi is not None else f">= {lo}"
        raise LaunchError(f"{name}={shown(raw)}: must be an integer {rng}{what}; {_FIX}")
    return int(raw)


def launch_env(environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """The launcher's variables of ``environ`` (default ``os.environ``), checked (module doc).

    Raises:
        LaunchError: one line naming the variable, its value and what it must be.
    """
    e = os.environ if environ is None else environ
    world = _int(e, "WORLD_SIZE", 1, what=" (the number of ranks)")
    rank = _int(e, "RANK", 0, what=" (this process's rank)")
    local_world = _int(e, "LOCAL_WORLD_SIZE", 1, what=" (the ranks on this host)")
    local_rank = _int(e, "LOCAL_RANK", 0, what=" (this process's rank on its host)")
    port = _int(e, "MASTER_PORT", 1, 65535, " (the port of rank 0's store)")
    restarts = _int(e, "TORCHELASTIC_RESTART_COUNT", 0)
    W, R = world if world is not None else 1, rank if rank is not None else 0
    if R >= W:
        ws = f"WORLD_SIZE={W}" if world is not None else "WORLD_SIZE unset (one process)"
        raise LaunchError(f"RANK={R}: must be less than the number of ranks, {ws} (ranks 0 to {W - 1}); {_FIX}")
    if local_world is not None and world is not None and local_world > world:
        raise LaunchError(f"LOCAL_WORLD_SIZE={local_world}: more ranks on this host than WORLD_SIZE={world} in all; {_FIX}")
    LW = local_world if local_world is not None else W
    if local_rank is not None and local_world is not None and local_rank >= local_world:
        raise LaunchError(f"LOCAL_RANK={local_rank}: must be less than LOCAL_WORLD_SIZE={local_world} "
                          f"(local ranks 0 to {local_world - 1}); {_FIX}")
    if local_rank is not None and rank is not None and local_rank > rank:
        raise LaunchError(f"LOCAL_RANK={local_rank}: larger than RANK={rank} (a host's ranks are a part of all "
                          f"ranks); {_FIX}")
    LR = local_rank if local_rank is not None else (R if LW == W else 0)
    addr = e.get("MASTER_ADDR")
    if addr is not None and (not addr.strip() or any(c.isspace() for c in addr.strip()) or len(addr) > 253):
        raise LaunchError(f"MASTER_ADDR={shown(addr)}: must be the host name or address of rank 0; {_FIX}")
    return LaunchEnv(R, W, LR, LW, addr.strip() if addr is not None else None, port, e.get("TORCHELASTIC_RUN_ID"),
                     restarts or 0, e.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def group_env(environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """:func:`launch_env`, and, with more than one rank, what forming the process group from the
    environment (``env://``) needs: ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``. Call it before
    ``init_process_group``."""
    e = os.environ if environ is None else environ
    env = launch_env(e)
    if env.world_size > 1:
        for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if name not in e:
                raise LaunchError(f"{name}: not set, but WORLD_SIZE={env.world_size} needs it to form the process group "
                                  f"(RANK: this process's rank; MASTER_ADDR, MASTER_PORT: where rank 0 listens); "
                                  f"launch with torchrun, which sets them, or set it")
    return env


@contextlib.contextmanager
def children_env(local_world_size: int):
    """Set ``LOCAL_WORLD_SIZE`` for the processes started inside the block (ranks that share this
    host without a launcher: the study's emulated launches), and put it back after."""
    keep = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(int(local_world_size))
    try:
        yield
    finally:
        if keep is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = keep


def rank_variables(rank: int, world_size: int, local_rank: int, local_world_size: int, run_id: str) -> dict:
    """The launcher's variables of a process started as rank ``rank`` of ``world_size`` (``local_rank``
    of ``local_world_size`` on this host) of the launch ``run_id``, as torchrun sets them (a
    benchmark's ranks started without torchrun: ``dali-nerf bench images``)."""
    return {"RANK": str(int(rank)), "WORLD_SIZE": str(int(world_size)), "LOCAL_RANK": str(int(local_rank)),
            "LOCAL_WORLD_SIZE": str(int(local_world_size)), "TORCHELASTIC_RUN_ID": str(run_id)}
