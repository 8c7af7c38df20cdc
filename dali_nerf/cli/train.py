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
this command starts exactly those modules. A checkpoint signal torchrun would die of (USR2, XCPU)
is added to its ``--signals-to-handle`` (:func:`torchrun_signals`).

``dali-nerf demo`` goes on after training, so it keeps torchrun as its child instead
(:func:`launch_trainer`) and passes the signals it gets on to it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import signal
import subprocess
import sys

from dali_nerf.config import load_config
from dali_nerf.config.shipped import describe_config, shipped_configs, shipped_dir
from dali_nerf.errors import ConfigError, DaliNerfError, LaunchError
from dali_nerf.interrupt import (DEFAULT_GRACE_S, DEFAULT_TERM_GRACE_S, Terminated, children, descendants,
                                 env_seconds, grace_at_least, interrupts_deferred, stop_signal)
from dali_nerf.launch_env import launch_env

__all__ = ["TRAINERS", "LAUNCH_OPTIONS", "trainer_module", "torchrun_command", "launch_trainer", "exec_torchrun",
           "tied_to_this_process", "death_signal", "launch_options", "add_arguments", "list_configs", "main"]

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
"""After Ctrl-C or a stop signal the launching command waits for torchrun this long beyond the
ranks' own bound (for a stop signal: beyond torchrun's, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``)."""

PASSED_ON = ("TERM", "HUP", "QUIT")
"""Besides SIGINT, the signals :func:`launch_trainer` passes on to its torchrun (torchrun's own
stop signals; the run's checkpoint signal is added). torchrun runs in a session of its own, so
these reach it only through the launching command, once."""

TORCHRUN_SIGNALS = ("TERM", "INT", "HUP", "QUIT")
"""The signals torchrun handles by default (passes on to its ranks, then exits)."""


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
                     launch=(), checkpoint_signal: str = "TERM") -> list:
    """``python -m torch.distributed.run [launch | --standalone] --nproc_per_node N -m <module> ...``.

    ``launch``: torchrun options (``["--nnodes", "2", ...]``); without any, ``--standalone`` (one
    node, a local rendezvous). ``checkpoint_signal``: the run's (``train.checkpoint_signal``);
    torchrun is told to pass it on where it would not (:func:`torchrun_signals`).

    >>> torchrun_command("dali_nerf.trainers.ddp", 2, "ddp_objects", ["train.steps=9"])[3:]
    ['--standalone', '--nproc_per_node=2', '-m', 'dali_nerf.trainers.ddp', '--config', 'ddp_objects', 'train.steps=9']
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", *(list(launch) or ["--standalone"]),
           *torchrun_signals(checkpoint_signal), f"--nproc_per_node={nproc}", "-m", module]
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


def torchrun_signals(checkpoint_signal: str) -> list:
    """torchrun's options for the run's checkpoint signal: none for one torchrun passes on to its
    ranks anyway (:data:`TORCHRUN_SIGNALS`: TERM, HUP; INT and QUIT are not checkpoint signals) or
    for ``none``; for USR2 or XCPU ``--signals-to-handle`` with it added (torch >= 2.9), so that
    torchrun passes it on rather than die of it; [] where this torchrun has no such option."""
    if checkpoint_signal == "none" or checkpoint_signal in TORCHRUN_SIGNALS:
        return []
    from torch.distributed.run import get_args_parser

    if "--signals-to-handle" not in get_args_parser()._option_string_actions:
        return []
    return ["--signals-to-handle", ",".join(f"SIG{n}" for n in (*TORCHRUN_SIGNALS, checkpoint_signal))]


def exec_torchrun(module: str, nproc: int, config: str | None, overrides, resume: bool = False, launch=(),
                  checkpoint_signal: str = "TERM"):
    """Become :func:`torchrun_command` (``os.execve``: this process, its pid, is torchrun from here
    on, so a signal sent to it is torchrun's, and torchrun's exit code is the command's). Returns
    only on failure to start it (a one-line error). ``checkpoint_signal``: the run's
    (``train.checkpoint_signal``), which torchrun passes on to its ranks."""
    cmd = torchrun_command(module, nproc, config, overrides, resume, launch, checkpoint_signal)
    env = _torchrun_env()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(cmd[0], cmd, env)
    except OSError as e:
        raise DaliNerfError(f"{cmd[0]}: cannot start torchrun ({e.strerror})") from None


def launch_trainer(module: str, nproc: int, config: str | None, overrides, resume: bool = False,
                   launch=(), checkpoint_signal: str = "TERM") -> int:
    """Run :func:`torchrun_command` as a child and return torchrun's exit code (``dali-nerf demo``,
    which goes on after training; ``dali-nerf train`` becomes torchrun instead: :func:`exec_torchrun`).

    torchrun runs in a session of its own and gets its signals from this process, each once,
    whoever sent them: Ctrl-C (SIGINT) raises ``KeyboardInterrupt`` here, SIGTERM, SIGHUP, SIGQUIT
    and the run's ``checkpoint_signal`` raise :class:`~dali_nerf.interrupt.Terminated`
    (:func:`~dali_nerf.interrupt.stop_signal`); either way the signal is passed on to torchrun,
    which passes it to its ranks (on the checkpoint signal they checkpoint their last common step,
    :mod:`dali_nerf.train.stopping`), and this process waits for torchrun under a bound that
    outlasts theirs, then kills torchrun and its ranks, and re-raises: ``Terminated``'s line
    names the signal and torchrun's exit code. A signal while torchrun starts is held until it
    has started (no torchrun left behind unsignalled).

    The parent has already validated the config and the scene, so rank errors are rare; a rank's
    one-line error is passed through."""
    cmd = torchrun_command(module, nproc, config, overrides, resume, launch, checkpoint_signal)
    # torchrun passes a signal on to its ranks if it handles it; else (a checkpoint signal of an
    # older torchrun) the ranks get it from here, and torchrun ends when they have
    direct = {getattr(signal, f"SIG{n}") for n in TORCHRUN_SIGNALS}
    if "--signals-to-handle" in cmd:
        direct.add(getattr(signal, f"SIG{checkpoint_signal}"))
    # bounds: the ranks' own (dali_nerf.interrupt) plus TORCHRUN_SHUTDOWN_S; after a stop signal
    # torchrun itself waits up to TORCH_ELASTIC_SHUTDOWN_TIMEOUT for its ranks before its SIGKILL
    int_wait_s = env_seconds("DALI_NERF_INTERRUPT_GRACE_S", DEFAULT_GRACE_S) + TORCHRUN_SHUTDOWN_S
    term_wait_s = max(env_seconds("DALI_NERF_TERM_GRACE_S", DEFAULT_TERM_GRACE_S),
                      env_seconds("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30.0)) + TORCHRUN_SHUTDOWN_S
    names = [n for n in dict.fromkeys((*PASSED_ON, checkpoint_signal)) if n != "none"]
    death = death_signal(checkpoint_signal, direct)
    proc = None
    with grace_at_least(int_wait_s + 5.0), contextlib.ExitStack() as stack:
        stops = [stack.enter_context(stop_signal(n, grace_s=term_wait_s + 5.0)) for n in names]
        try:
            # the stop signals' deferral ends last: one that arrives as the block ends is recorded
            # (raised just below), never raised while SIGINT's handler is still the held one
            with contextlib.ExitStack() as held:
                for stop in stops:
                    held.enter_context(stop.deferred())
                with interrupts_deferred(block=False):
                    proc = subprocess.Popen(tied_to_this_process(cmd, death), env=_torchrun_env(), start_new_session=True)
            # Popen.wait gives a child 0.25 s after Ctrl-C before it re-raises, assuming the child got
            # the terminal's SIGINT too (bpo-25942): torchrun gets it from here, so pass it on at once
            proc._sigint_wait_secs = 0.0
            for stop in stops:
                stop.raise_if_received()
            return proc.wait()
        except KeyboardInterrupt:
            if proc is not None:
                _stop_torchrun(proc, signal.SIGINT, int_wait_s)
            raise
        except Terminated as e:
            name, ranks = signal.Signals(e.signum).name, e.signum not in direct
            rc = _stop_torchrun(proc, e.signum, term_wait_s, ranks) if proc is not None else None
            how = (f"passed on to the ranks (this torchrun does not pass {name} on), then torchrun ended" if ranks else
                   "passed on to torchrun, which stopped its ranks")
            raise Terminated(e.signum, f"terminated by {name}: {how} (exit code {rc})") from None


def death_signal(checkpoint_signal: str, direct) -> int:
    """The signal torchrun gets if the process that started it dies (:func:`tied_to_this_process`):
    the run's checkpoint signal where torchrun passes it on to the ranks (``direct``), so they
    checkpoint and stop; else SIGTERM (ranks that stop on another signal then stop without one)."""
    ckpt = getattr(signal, f"SIG{checkpoint_signal}", None)
    return ckpt if ckpt in direct else signal.SIGTERM


def tied_to_this_process(cmd: list, signum: int = signal.SIGTERM) -> list:
    """``cmd`` as a command that gets ``signum`` when this process dies, however it dies (SIGKILL,
    the OOM killer: no handler of ours runs), on Linux: ``PR_SET_PDEATHSIG``, set in a small Python
    that then ``exec``s ``cmd`` (the setting survives the exec; the pid is ``cmd``'s), which exits
    at once when this process is already gone, and says in one line when the kernel refuses the
    setting (a seccomp filter; ``cmd`` runs untied). So torchrun, in a session of its own, passes
    the signal on to its ranks, which checkpoint and stop, rather than train on as orphans. The
    signal follows the thread that started the child: call from a thread that outlives it (the
    main thread). Elsewhere ``cmd`` as it is."""
    if not sys.platform.startswith("linux"):  # pragma: no cover - Linux only
        return list(cmd)
    code = ("import ctypes, os, sys\n"
            "if ctypes.CDLL(None).prctl(1, int(sys.argv[2]), 0, 0, 0) != 0:\n"
            "    sys.stderr.write('dali_nerf: the kernel refused a parent-death signal for torchrun: if this process is '\n"
            "                     'killed, stop torchrun and its ranks yourself\\n')\n"
            "if os.getppid() != int(sys.argv[1]):\n"
            "    os._exit(128 + int(sys.argv[2]))\n"
            "os.execv(sys.argv[3], sys.argv[3:])\n")
    return [sys.executable, "-S", "-c", code, str(os.getpid()), str(int(signum)), *cmd]


def _stop_torchrun(proc: subprocess.Popen, signum: int, wait_s: float, ranks: bool = False):
    """Send ``signum`` to torchrun (``ranks``: to its ranks, its children, instead) and wait up to
    ``wait_s`` seconds for it; then SIGKILL torchrun and every process under it (its ranks are in
    sessions of their own: torchrun's ``killpg`` alone reaches them). Returns torchrun's exit code."""
    if proc.poll() is None:  # not yet reaped: its pid is still torchrun's
        for pid in children(proc.pid) if ranks else [proc.pid]:
            try:
                os.kill(pid, signum)
            except OSError:
                pass
    try:
        return proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:  # listed before any dies (orphans leave the tree)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return proc.wait()


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
    exec_torchrun(module, args.nproc, args.config, overrides, resume=args.resume, launch=launch,
                  checkpoint_signal=cfg.train.checkpoint_signal)
    return 0  # not reached: torchrun replaced this process
