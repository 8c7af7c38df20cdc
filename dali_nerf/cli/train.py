"""``dali-nerf train``: train a config with its method's trainer, under torch's elastic launcher.

    dali-nerf train --config ddp_objects --nproc 2 [key=value ...]      # a shipped config, 2 ranks
    dali-nerf train --config my.yaml --nproc 2 --resume                 # a file; continue the run
    dali-nerf train --config ddp_blender_gpu --nnodes 2 --nproc 4 --node-rank 0 \\
        --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id lego-1 --max-restarts 2
    dali-nerf train --list                                              # the shipped configs

The config's ``method:`` picks the trainer module (:data:`TRAINERS`). Once the config and the
scene are checked, the command *becomes* ``python -m torch.distributed.run`` (torchrun: ``os.execve``,
the same pid) with ``--standalone`` on one node, or with the rendezvous options given; so a signal
sent to the command is torchrun's own: on SIGTERM (a scheduler, ``kill``) torchrun passes it to the
ranks, which checkpoint their last common step (:mod:`dali_nerf.train.stopping`), and Ctrl-C stops
them on their bounded path; its exit code is the command's. ``--nproc 1`` without any rendezvous
option or ``--max-restarts`` runs the trainer in this process (no torchrun; the signals are the
trainer's). A process that is already a rank of a launch (``launch_env``: ``WORLD_SIZE`` > 1 or
torchrun's variables) may only do the latter: a torchrun inside a rank is refused in one line.
``torchrun trainers/ddp.py ...`` and ``torchrun -m dali_nerf.trainers.spatial ...`` keep working:
this command starts exactly those modules.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

from dali_nerf.config import load_config
from dali_nerf.config.shipped import describe_config, shipped_configs, shipped_dir
from dali_nerf.errors import ConfigError, DaliNerfError, LaunchError
from dali_nerf.interrupt import DEFAULT_GRACE_S, grace_at_least
from dali_nerf.launch_env import launch_env

__all__ = ["TRAINERS", "LAUNCH_OPTIONS", "trainer_module", "torchrun_command", "launch_trainer", "exec_torchrun",
           "launch_options", "add_arguments", "list_configs", "main"]

TRAINERS = {
    "ddp": "dali_nerf.trainers.ddp",
    "ss": "dali_nerf.trainers.spatial",
    "splat": "dali_nerf.trainers.splat",  # Gaussian splatting (docs/SPLATTING.md)
}
"""``method:`` -> the trainer module run under torchrun (a new method is one line here). An entry
whose module is not installed is refused in one line (:func:`trainer_module`)."""

LAUNCH_OPTIONS = {  # dali-nerf train option -> torchrun option (underscore spellings: every torch >= 2.1)
    "nnodes": "--nnodes", "node_rank": "--node_rank", "rdzv_backend": "--rdzv_backend",
    "rdzv_endpoint": "--rdzv_endpoint", "rdzv_id": "--rdzv_id", "rdzv_conf": "--rdzv_conf",
    "max_restarts": "--max_restarts",
}
"""The rendezvous and restart options passed through to ``torch.distributed.run``."""

TORCHRUN_SHUTDOWN_S = 15.0
"""After Ctrl-C the launching command waits for torchrun this long beyond the ranks' own bound."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def trainer_module(method: str, where: str = "method") -> str:
    """The trainer module of ``method`` (``ddp`` -> ``dali_nerf.trainers.ddp``); a one-line error
    when the method has none here (not in :data:`TRAINERS`, or its module is not installed)."""
    module = TRAINERS.get(method)
    if module is None or not _installed(module):
        have = [m for m, mod in TRAINERS.items() if _installed(mod)]
        raise ConfigError(f"{where}: method {method!r} has no trainer; use one of {', '.join(have)}")
    return module


def torchrun_command(module: str, nproc: int, config: str | None, overrides, resume: bool = False,
                     launch=()) -> list:
    """``python -m torch.distributed.run [launch | --standalone] --nproc_per_node N -m <module> ...``.

    ``launch``: torchrun options (``["--nnodes", "2", ...]``); without any, ``--standalone`` (one
    node, a local rendezvous).

    >>> torchrun_command("dali_nerf.trainers.ddp", 2, "ddp_objects", ["train.steps=9"])[3:]
    ['--standalone', '--nproc_per_node=2', '-m', 'dali_nerf.trainers.ddp', '--config', 'ddp_objects', 'train.steps=9']
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", *(list(launch) or ["--standalone"]),
           f"--nproc_per_node={nproc}", "-m", module]
    if config:
        cmd += ["--config", str(config)]
    if resume:
        cmd.append("--resume")
    return cmd + list(overrides)


def _torchrun_env() -> dict:
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: a restarted worker group must not inherit the launcher's
    # store (stale keys; pytorch/pytorch#135712) — see docs/RELIABILITY.md
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), DALI_NERF_PROGRESS="1")
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def exec_torchrun(module: str, nproc: int, config: str | None, overrides, resume: bool = False, launch=()):
    """Become :func:`torchrun_command` (``os.execve``: this process, its pid, is torchrun from here
    on, so a signal sent to it is torchrun's, and torchrun's exit code is the command's). Returns
    only on failure to start it (a one-line error)."""
    cmd = torchrun_command(module, nproc, config, overrides, resume, launch)
    env = _torchrun_env()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(cmd[0], cmd, env)
    except OSError as e:
        raise DaliNerfError(f"{cmd[0]}: cannot start torchrun ({e.strerror})") from None


def launch_trainer(module: str, nproc: int, config: str | None, overrides, resume: bool = False,
                   launch=()) -> int:
    """Run :func:`torchrun_command` as a child and return torchrun's exit code (``dali-nerf demo``,
    which goes on after training; ``dali-nerf train`` becomes torchrun instead: :func:`exec_torchrun`).

    The parent has already validated the config and the scene, so rank errors are rare; a rank's
    one-line error is passed through."""
    cmd = torchrun_command(module, nproc, config, overrides, resume, launch)
    proc = subprocess.Popen(cmd, env=_torchrun_env())
    # After a terminal's Ctrl-C (the whole process group gets it) torchrun stops its ranks, each on
    # its bounded path (dali_nerf.interrupt, $DALI_NERF_INTERRUPT_GRACE_S): wait for that rather than
    # kill torchrun mid-shutdown, under a watchdog of this process that outlasts theirs.
    try:
        rank_grace_s = float(os.environ.get("DALI_NERF_INTERRUPT_GRACE_S", DEFAULT_GRACE_S))
    except ValueError:
        rank_grace_s = DEFAULT_GRACE_S
    wait_s = rank_grace_s + TORCHRUN_SHUTDOWN_S
    with grace_at_least(wait_s + 5.0):
        try:
            return proc.wait()
        except KeyboardInterrupt:
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise


def launch_options(args) -> list:
    """The torchrun options of ``dali-nerf train``'s arguments (:data:`LAUNCH_OPTIONS`), in that order."""
    launch = []
    for key, flag in LAUNCH_OPTIONS.items():
        value = getattr(args, key, None)
        if value is not None:
            launch += [flag, str(value)]
    return launch


def add_arguments(p) -> None:
    """``dali-nerf train``'s arguments on the argparse parser ``p``."""
    p.add_argument("--config", default=None,
                   help="a YAML file, or a shipped config's name (see --list), e.g. ddp_objects")
    p.add_argument("--nproc", type=int, default=1,
                   help="ranks (processes) on this node (default 1: in this process unless a rendezvous option is given)")
    p.add_argument("--resume", action="store_true", help="continue from runs/<name>/checkpoints/latest")
    p.add_argument("--list", action="store_true", help="list the shipped configs and exit")
    g = p.add_argument_group("torchrun (several nodes, elastic runs: docs/MULTINODE.md)")
    g.add_argument("--nnodes", default=None, help="nodes, or MIN:MAX for an elastic job")
    g.add_argument("--node-rank", dest="node_rank", default=None, help="this node's rank (static rendezvous)")
    g.add_argument("--rdzv-backend", dest="rdzv_backend", default=None, help="rendezvous backend, e.g. c10d")
    g.add_argument("--rdzv-endpoint", dest="rdzv_endpoint", default=None, help="host:port of the rendezvous")
    g.add_argument("--rdzv-id", dest="rdzv_id", default=None, help="the job's id (the same on every node)")
    g.add_argument("--rdzv-conf", dest="rdzv_conf", default=None, help="e.g. last_call_timeout=30")
    g.add_argument("--max-restarts", dest="max_restarts", type=int, default=None,
                   help="restarts of the worker group; a restart resumes from the newest checkpoint")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. train.steps=200")


def list_configs() -> str:
    """The shipped configs, one per line: name and description."""
    shipped = shipped_configs()
    width = max((len(n) for n in shipped), default=0)
    lines = [f"{n:<{width}}  {describe_config(p)}" for n, p in shipped.items()]
    lines.append(f"({len(shipped)} configs in {shipped_dir()}; --config NAME picks one, --config FILE any other)")
    return "\n".join(lines)


def main(args) -> int:
    """``dali-nerf train``: validate the config and scene here, then start the method's trainer."""
    if args.list:
        print(list_configs(), flush=True)
        return 0
    if not args.config:
        raise ConfigError("--config: required; pass a YAML file or a shipped config's name (dali-nerf train --list)")
    if args.nproc < 1:
        raise ConfigError(f"--nproc={args.nproc}: use 1 or more ranks")
    overrides = list(args.overrides)
    cfg = load_config(args.config, overrides)  # config and scene errors here, before any rank starts
    module = trainer_module(cfg.method, f"{args.config}: method")
    launch = launch_options(args)
    if args.nproc == 1 and not launch:  # one rank, no rendezvous: the trainer in this process
        argv = ["--config", str(args.config)] + (["--resume"] if args.resume else []) + overrides
        return importlib.import_module(module).main(argv)  # its errors: one line, exit 2, as from the trainer
    env = launch_env()  # the launcher's variables (checked: one line naming a bad one)
    if env.world_size > 1 or env.elastic:
        raise LaunchError(f"this process is already rank {env.rank} of a launch (WORLD_SIZE={env.world_size}"
                          f"{', under torchrun' if env.elastic else ''}): start `dali-nerf train` with --nproc 1 and no "
                          f"rendezvous option inside it (the trainer joins that launch), or unset the launcher's variables")
    exec_torchrun(module, args.nproc, args.config, overrides, resume=args.resume, launch=launch)
    return 0  # not reached: torchrun replaced this process
