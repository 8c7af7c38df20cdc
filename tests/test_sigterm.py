"""The checkpoint signal (SIGTERM: torchrun stopping or restarting its workers, SLURM before a
preemption): the run finishes its step, the ranks agree on a step they all complete, its
checkpoint is written, and the trainer exits 143; ``--resume`` continues it exactly. Also, on the
same torchrun run: a second trainer on its folder is refused, and a resume of a finished run keeps
its record (docs/RELIABILITY.md, "Signals and preemption")."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dali_nerf.errors import DaliNerfError
from dali_nerf.interrupt import Terminated, descendants, stop_signal
from dali_nerf.scenegen import make_scene
from dali_nerf.train.checkpoint import MODEL_FILE, latest_checkpoint, load_file
from dali_nerf.train.runlock import RunLock

REPO = Path(__file__).resolve().parent.parent


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    return dict(env, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **extra)


def _rows(path: Path) -> dict:
    """{step: row} of a metrics file's training rows (a torn last line skipped)."""
    out = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "loss" in row:
            out[row["step"]] = row
    return out


# ------------------------------------------------------------------------------------ the handler

def test_outside_the_loop_the_signal_raises_inside_it_is_recorded():
    """Inside ``deferred()`` the signal is recorded (a second one within a second absorbed), outside
    it raises Terminated (exit 128 + the signal); the block's end disarms the watchdog (this
    process lives on past its 0.5 s grace: in a test or a notebook the process is not the run)."""
    with stop_signal("TERM", grace_s=0.5) as stop:
        with stop.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # the handler runs between two bytecodes of the main thread
            assert stop.received and stop.signum == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)  # the same signal again within a second: absorbed
            time.sleep(0.01)
        with pytest.raises(Terminated) as e:
            stop.raise_if_received()
        assert e.value.exit_code == 143 and "terminated by SIGTERM" in str(e.value)
    with stop_signal("USR2", grace_s=60) as stop:
        with pytest.raises(Terminated) as e:
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(1.0)
        assert e.value.exit_code == 140 and stop.name == "SIGUSR2"
    with stop_signal("none") as stop:  # no handler: nothing to record
        assert not stop.received and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    time.sleep(1.0)  # past the first block's grace: its watchdog stood down


SAME_STOP = r"""
import os, signal, time
from dali_nerf.interrupt import Terminated, stop_signal
before = signal.getsignal(signal.SIGTERM)
with stop_signal("USR2", grace_s=60) as stop:
    assert signal.getsignal(signal.SIGTERM) is before  # untouched before the checkpoint signal
    with stop.deferred():
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.01)
        assert stop.signum == signal.SIGUSR2
        os.kill(os.getpid(), signal.SIGTERM)  # its default action would end this process here
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # again, later: still the same stop
        time.sleep(0.01)
    assert stop.signum == signal.SIGUSR2
    try:
        stop.raise_if_received()
    except Terminated as e:
        print("exit code", e.exit_code, flush=True)
assert signal.getsignal(signal.SIGTERM) is before
print("handler restored", flush=True)
"""


def test_after_another_checkpoint_signal_a_sigterm_is_the_same_stop():
    """With USR2 as the checkpoint signal, SIGTERM is left alone until USR2 arrives (torchrun
    stopping workers without a checkpoint still kills them); once it has, a SIGTERM (torchrun's
    agent shutting the workers down a second time, with its default SIGTERM) is recorded as the
    stop already under way, not fatal, so the checkpoint can finish; SIGTERM's handler comes back
    when the block ends. (In a process of its own: without this, SIGTERM ends it.)"""
    r = subprocess.run([sys.executable, "-c", SAME_STOP], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split("\n")[:2] == ["exit code 140", "handler restored"], (r.returncode,
                                                                                                     r.stdout, r.stderr)


STUCK = r"""
import sys, time
from dali_nerf.interrupt import stop_signal
with stop_signal("TERM", grace_s=float(sys.argv[1])) as stop, stop.deferred():
    print("ready", flush=True)
    while True:            # a loop that never reaches a step boundary
        time.sleep(0.01)
"""


@pytest.mark.parametrize("how", ["watchdog", "echo", "twice"])
def test_the_watchdog_and_a_second_signal_bound_the_exit(how):
    """A process that never gets to act on the signal leaves with the stacks after the grace
    (DALI_NERF_TERM_GRACE_S; watchdog), also when the same signal comes twice within a second
    (echo: absorbed); a second signal a second or more later leaves at once, without waiting for
    the grace (twice: 30 s here). Exit 143 each; which path ended it is read from what it printed."""
    grace = "30" if how == "twice" else "0.5"
    p = subprocess.Popen([sys.executable, "-c", STUCK, grace], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=REPO)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    if how != "watchdog":
        time.sleep(0.2 if how == "echo" else 1.2)
        p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=25)
    assert p.returncode == 143, err
    if how == "twice":
        assert err.strip().splitlines() == ["error: SIGTERM again; exiting without finishing the checkpoint (exit 143)"]
    else:
        assert "still running 0.5 s after SIGTERM" in err and "File " in err and "again" not in err, err  # the stacks


# ------------------------------------------------------------------------------------ the vote

VOTER = r"""
import datetime, sys, time, types, torch.distributed as dist
from dali_nerf.interrupt import stop_signal
from dali_nerf.train.stopping import StopVote
rank, store, lag, delay, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
vote = StopVote(types.SimpleNamespace(distributed=True), lag=lag)  # what it reads of the run's DistEnv
seen, last = None, 0
with stop_signal("TERM", grace_s=60) as stop, stop.deferred():
    for step in range(1, steps + 1):
        time.sleep(delay)
        print(f"step {step}", flush=True)
        if stop.received and seen is None:
            seen = step
        target = vote.after_step(step, stop.received)
        last = step
        if target is not None and step >= target:
            break
    any_rank = vote.finish(stop.received)
print(f"done {last} seen {seen} any {any_rank}", flush=True)
dist.destroy_process_group()
"""


def _voters(tmp_path, lag, delays, steps, signal_rank=None, after_step=3):
    store = tmp_path / f"store{lag}{signal_rank}"
    procs = [subprocess.Popen([sys.executable, "-c", VOTER, str(r), str(store), str(lag), str(delays[r]), str(steps)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) for r in (0, 1)]
    try:
        if signal_rank is not None:
            p = procs[signal_rank]
            while p.stdout.readline().strip() != f"step {after_step}":
                assert p.poll() is None, p.stderr.read()
            p.send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    return [out.strip().splitlines()[-1] for out, _ in outs]


def test_ranks_that_drift_apart_stop_after_the_same_step(tmp_path):
    """Two gloo ranks with the spatial-segmentation lag (8): rank 0 at full speed, rank 1 slower,
    so rank 0 runs ahead (up to 8 steps). SIGTERM to one rank only (the slow one; then the fast
    one): both stop after the same step, which neither had passed when it learned of the signal,
    and agree that a rank had it (the run without a signal: the torchrun test's reference)."""
    for victim in (1, 0):
        ends = _voters(tmp_path, 8, (0.0, 0.05), 40, signal_rank=victim)
        steps = {int(e.split()[1]) for e in ends}
        assert len(steps) == 1 and all(e.endswith("any True") for e in ends), ends
        seen = int(ends[victim].split()[3])
        assert seen <= steps.pop() < 40, ends


# ------------------------------------------------------------------------------------ torchrun

DDP_STEPS = 32  # room for a late signal on a busy host: it may land several steps after it was sent
TINY = ["model.resolution=12", "model.samples_per_ray=12", "model.occupancy_resolution=0", "model.hidden=16",
        "pipeline.rays_per_batch=256", "pipeline.rays_per_run=1024", f"train.steps={DDP_STEPS}", "train.checkpoint_every=0",
        "train.log_every=1", "train.eval_images=1", "train.device=cpu"]


def _sigterm_and_stop_step(cut, run, at: int, steps: int) -> tuple:
    """SIGTERM to torchrun ``cut``; its exit code, stderr and the step T rank 0 says the ranks
    stopped after (one line), checked against both ranks' metrics (both end at T, at <= T < steps)."""
    cut.send_signal(signal.SIGTERM)
    code, _, err = _finish(cut)
    line = [l for l in err.splitlines() if l.startswith("stopped by SIGTERM after step ")]
    assert len(line) == 1, err[-3000:]
    T = int(line[0].split("after step ")[1].split()[0])
    ends = [max(_rows(run / f)) for f in ("metrics.jsonl", "metrics.rank1.jsonl")]
    assert ends == [T, T] and at <= T < steps, (ends, T, err[-2000:])
    return code, err, T


def _torchrun(scene, runs, name, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "dali_nerf.trainers.ddp", "--config", "configs/ddp_objects.yaml", f"scene.path={scene}",
           f"train.runs_dir={runs}", f"name={name}", *TINY, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO,
                            start_new_session=True)


def _finish(p: subprocess.Popen, timeout=400):
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # torchrun and anything it left
        except ProcessLookupError:
            pass
    return p.returncode, out, err


def _worker(agent: int, rank: str) -> int:
    """The pid of the worker of torchrun ``agent`` whose RANK is ``rank`` (/proc)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            env = Path(f"/proc/{d}/environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if int(stat[1]) == agent and f"RANK={rank}" in env:
            return int(d)
    raise AssertionError(f"no worker with RANK={rank} under {agent}")


def _model(run: Path) -> dict:
    return load_file(latest_checkpoint(run / "checkpoints"), MODEL_FILE)["tasks"]["ddp"]


@pytest.mark.slow  # 3 torchrun launches of 2 CPU ranks (2 at once) and one resume in this process
def test_sigterm_to_torchrun_checkpoints_the_last_common_step_and_resume_continues_it(tmp_path, capsys):
    """SIGTERM to the torchrun agent at a random step (it signals both workers): rank 0 prints
    that it stopped after step T, the last step both ranks completed (both metrics files end at
    T), and T's checkpoint is ``latest``; ``--resume`` then runs T+1..DDP_STEPS and ends with every
    step's loss and the final model (field and Adam state) bitwise equal to an uninterrupted run's.
    While the run trains, the folder's lock is refused to another trainer, naming rank 0's pid and
    host (the trainer's own refusal of it: tests/test_runlock.py).
    A resume of the finished uninterrupted run trains nothing and changes no file but
    summary.json, whose figures stay, the resume noted beside them; one of a run without a summary
    of its last step evaluates it (the same test PSNR), its timing figures null."""
    import random

    from dali_nerf.trainers.ddp import main as ddp_main

    scene = make_scene("objects", tmp_path / "scene", width=24, height=24, n_train=8, n_val=1, n_test=2, seed=5)
    runs = tmp_path / "runs"
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    at = random.Random(seed).randint(2, 5)
    print(f"SIGTERM after rank 1 logged step {at}")
    ref = _torchrun(scene, runs, "whole")
    cut = _torchrun(scene, runs, "cut")
    metrics1 = runs / "cut" / "metrics.rank1.jsonl"
    deadline = time.time() + 300
    while max(_rows(metrics1), default=0) < at:
        assert cut.poll() is None and time.time() < deadline, _finish(cut)[2][-3000:]
        time.sleep(0.02)
    # another trainer on the folder the run holds is refused, naming the holder: rank 0's worker,
    # paused meanwhile (SIGSTOP), so the run cannot end and release it first on a busy host
    rank0 = _worker(cut.pid, "0")
    os.kill(rank0, signal.SIGSTOP)
    try:
        with pytest.raises(DaliNerfError) as e:
            RunLock(runs / "cut").acquire()
    finally:
        os.kill(rank0, signal.SIGCONT)
    assert str(e.value).startswith(f"{runs / 'cut'}: in use by another trainer (pid {rank0} on host "
                                   f"{socket.gethostname()}, since "), str(e.value)
    _, err, T = _sigterm_and_stop_step(cut, runs / "cut", at, DDP_STEPS)
    assert latest_checkpoint(runs / "cut" / "checkpoints").name == f"step_{T:07d}"
    assert not (runs / "cut" / "summary.json").exists() and not (runs / "cut" / ".lock").exists()

    code, _, err = _finish(_torchrun(scene, runs, "cut", "--resume"))
    assert code == 0, err[-3000:]
    code, _, err = _finish(ref)
    assert code == 0, err[-3000:]
    a, b = _rows(runs / "cut" / "metrics.jsonl"), _rows(runs / "whole" / "metrics.jsonl")
    assert sorted(a) == list(range(1, DDP_STEPS + 1)) and {s: r["loss"] for s, r in a.items()} == {s: r["loss"] for s, r in b.items()}
    ma, mb = _model(runs / "cut"), _model(runs / "whole")
    for k, v in mb["field"].items():
        assert torch.equal(ma["field"][k], v), k
    for p, st in mb["optimizer"]["state"].items():
        assert all(torch.equal(torch.as_tensor(ma["optimizer"]["state"][p][k]), torch.as_tensor(x)) for k, x in st.items())
    summary = json.loads((runs / "cut" / "summary.json").read_text())
    assert summary["resumed_from"] == T and summary["steps"] == DDP_STEPS

    # the finished run resumed at its last step (on 1 rank: the global stream resumes on any)
    whole = runs / "whole"
    files = {p: p.read_bytes() for p in whole.rglob("*") if p.is_file()}
    before = json.loads(files[whole / "summary.json"])
    assert ddp_main(["--config", "configs/ddp_objects.yaml", f"scene.path={scene}", f"train.runs_dir={runs}",
                     "name=whole", *TINY, "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"note: {whole} is at step {DDP_STEPS}, its last ({DDP_STEPS}): nothing to train; its summary of record is kept" in err
    after = {p: p.read_bytes() for p in whole.rglob("*") if p.is_file()}
    assert {p for p in after if after[p] != files.get(p)} == {whole / "summary.json"}
    now = json.loads(after[whole / "summary.json"])
    notes = now.pop("resumed_at_end")
    assert now == before and len(notes) == 1 and notes[0]["step"] == DDP_STEPS and notes[0]["world_size"] == 1
    assert notes[0]["trained_steps"] == 0 and notes[0]["summary"] == "of record, kept"

    # a run that ended after its last checkpoint and before its summary: the resume evaluates it
    cut = runs / "cut"
    (cut / "summary.json").unlink()
    metrics = (cut / "metrics.jsonl").read_bytes()
    assert ddp_main(["--config", "configs/ddp_objects.yaml", f"scene.path={scene}", f"train.runs_dir={runs}",
                     "name=cut", *TINY, "--resume"]) == 0
    assert "it has no summary of that step: evaluating it" in capsys.readouterr().err
    new = json.loads((cut / "summary.json").read_text())
    assert new["test_psnr"] == summary["test_psnr"] and new["steps"] == DDP_STEPS and (cut / "metrics.jsonl").read_bytes() == metrics
    assert new["final_train_loss"] == a[DDP_STEPS]["loss"] and new["rays_per_s"] is None and new["phase_totals_s"] is None
    assert new["resumed_at_end"][0]["summary"] == "written by this resume: the run had none at its last step"


# ------------------------------------------------------------------------------ torchrun, SS

SS_TINY = ["model.resolution=20", "model.samples_per_ray=16", "model.occupancy_resolution=16",
           "model.occupancy_warmup=4", "model.occupancy_every=4", "model.hidden=16", "model.sigma_init=0.1",
           "model.density_components=8", "model.color_components=12", "partition.grid=[2,2]",
           "pipeline.rays_per_batch=128", "pipeline.rays_per_run=1024", "train.steps=32", "train.checkpoint_every=0",
           "train.log_every=1", "train.eval_images=1", "train.lr=0.02", "train.device=cpu"]


# the SS trainer's __main__ that also records the code each rank's main() returned (torchrun does
# not report the exit codes of workers it stopped)
SS_MAIN = """
import os, sys
from pathlib import Path
from dali_nerf.interrupt import exit_process
from dali_nerf.trainers.spatial import main
rc = main(sys.argv[1:])
Path(os.environ["SS_EXIT_CODES"], "rank" + os.environ["RANK"]).write_text(str(rc))
exit_process(rc)
"""


def _ss_torchrun(scene, runs, name, *extra, codes: Path = None):
    if codes is not None:
        codes.mkdir()
        (codes.parent / "ss_main.py").write_text(SS_MAIN)
    entry = [str(codes.parent / "ss_main.py")] if codes is not None else ["-m", "dali_nerf.trainers.spatial"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *entry, "--config", "configs/ss_city.yaml", f"scene.path={scene}",
           f"train.runs_dir={runs}", f"name={name}", *SS_TINY, *extra]
    env = _env(SS_EXIT_CODES=str(codes)) if codes is not None else _env()
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)


@pytest.mark.slow  # 3 torchrun launches of 2 CPU ranks (2 at once)
def test_sigterm_to_torchrun_of_the_spatial_trainer_checkpoints_every_cell_at_one_step(tmp_path):
    """The spatial-segmentation trainer (4 cells, 2 per rank, no collective per step: the ranks
    may drift up to 8 steps apart) under torchrun, SIGTERM to the agent once rank 1 logged a
    random step (2-5 of 32): every rank stops after the same step T (both metrics files end at T,
    rank 0 prints it), T's checkpoint holds all 4 cells (each rank's own), no summary, exit 143;
    ``--resume`` on 2 ranks runs T+1..32 and every step's loss on both ranks and every cell's
    field and Adam state end bitwise equal to an uninterrupted run's (launched beside it): a
    cell's stream, jitter and background draws are its own, restored from its checkpoint, and
    its arithmetic runs on the same rank in the same order."""
    import random

    from dali_nerf.train.checkpoint import RUN_FILE, cell_file

    scene = make_scene("city", tmp_path / "city", width=32, height=24, n_train=12, n_val=1, seed=1)
    runs = tmp_path / "runs"
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    at = random.Random(seed).randint(2, 5)
    print(f"SIGTERM after rank 1 logged step {at}")
    ref = _ss_torchrun(scene, runs, "whole")
    codes = tmp_path / "codes"
    cut = _ss_torchrun(scene, runs, "cut", codes=codes)
    metrics1 = runs / "cut" / "metrics.rank1.jsonl"
    deadline = time.time() + 300
    while max(_rows(metrics1), default=0) < at:
        assert cut.poll() is None and time.time() < deadline, _finish(cut)[2][-3000:]
        time.sleep(0.02)
    code, err, T = _sigterm_and_stop_step(cut, runs / "cut", at, 32)
    ck = latest_checkpoint(runs / "cut" / "checkpoints")
    assert ck.name == f"step_{T:07d}"
    assert sorted(p.name for p in ck.iterdir()) == sorted([*(cell_file(c) for c in range(4)), RUN_FILE])
    assert load_file(ck, RUN_FILE)["step"] == T
    assert not (runs / "cut" / "summary.json").exists() and not (runs / "cut" / ".lock").exists()
    # every rank's trainer returned 128 + SIGTERM (torchrun's own exit code is its agent's: torch
    # re-raises the signal there as an exception, exit 1)
    assert {f.name: f.read_text() for f in codes.iterdir()} == {"rank0": "143", "rank1": "143"}, err[-3000:]
    print(f"stopped after step {T}; torchrun exit {code}")

    code, _, err = _finish(_ss_torchrun(scene, runs, "cut", "--resume"))
    assert code == 0, err[-3000:]
    code, _, err = _finish(ref)
    assert code == 0, err[-3000:]
    for f in ("metrics.jsonl", "metrics.rank1.jsonl"):
        a, b = _rows(runs / "cut" / f), _rows(runs / "whole" / f)
        assert sorted(a) == list(range(1, 33)), (f, sorted(a))
        assert {s: r["loss"] for s, r in a.items()} == {s: r["loss"] for s, r in b.items()}, f
    ca, cb = (latest_checkpoint(runs / n / "checkpoints") for n in ("cut", "whole"))
    for c in range(4):
        ta, tb = (load_file(ck, cell_file(c))["task"] for ck in (ca, cb))
        for k, v in tb["field"].items():
            assert torch.equal(ta["field"][k], v), (c, k)
        for p, st in tb["optimizer"]["state"].items():
            assert all(torch.equal(torch.as_tensor(ta["optimizer"]["state"][p][k]), torch.as_tensor(x))
                       for k, x in st.items()), (c, p)
    summary = json.loads((runs / "cut" / "summary.json").read_text())
    assert summary["resumed_from"] == T and summary["steps"] == 32 and summary["cells"] == 4


# ------------------------------------------------------------------------------ dali-nerf demo

def _marked(mark: str) -> list:
    """Pids of the live processes whose environment holds ``mark`` (/proc; zombies have none)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and mark.encode() in Path(f"/proc/{d}/environ").read_bytes().split(b"\0"):
                out.append(int(d))
        except OSError:
            continue
    return out


def test_torchrun_is_told_to_pass_on_a_checkpoint_signal_it_would_die_of():
    """torchrun passes TERM and HUP on to its ranks by itself; USR2 or XCPU would kill it (the
    default action), so the command adds ``--signals-to-handle`` with it, which torchrun's own
    parser accepts (torch >= 2.9; an older torchrun gets nothing and ``dali-nerf demo`` signals
    its ranks itself)."""
    from torch.distributed.run import get_args_parser

    from dali_nerf.cli.train import torchrun_command

    base = torchrun_command("dali_nerf.trainers.ddp", 2, "ddp_objects", ["train.steps=9"])
    for name in ("TERM", "HUP", "none"):
        assert torchrun_command("dali_nerf.trainers.ddp", 2, "ddp_objects", ["train.steps=9"], checkpoint_signal=name) == base
    cmd = torchrun_command("dali_nerf.trainers.ddp", 2, "ddp_objects", ["train.steps=9"], checkpoint_signal="USR2")
    if "--signals-to-handle" not in get_args_parser()._option_string_actions:
        assert cmd == base
        return
    assert cmd == [*base[:4], "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2", *base[4:]]
    assert get_args_parser().parse_args(cmd[3:]).signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"


def test_the_parent_death_signal_is_the_checkpoint_signal_torchrun_passes_on():
    """If the demo dies, torchrun gets the run's checkpoint signal where torchrun passes it on to
    the ranks (they checkpoint on it), else SIGTERM."""
    from dali_nerf.cli.train import death_signal

    term, hup, usr2 = signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2
    assert death_signal("TERM", {term, hup}) == term and death_signal("HUP", {term, hup}) == hup
    assert death_signal("USR2", {term, hup, usr2}) == usr2  # torchrun told --signals-to-handle
    assert death_signal("USR2", {term, hup}) == term and death_signal("none", {term, hup}) == term


@pytest.mark.parametrize("name", ["TERM", "USR2"])
def test_a_tied_child_gets_its_signal_when_its_parent_is_killed(tmp_path, name):
    """A command run through ``tied_to_this_process`` (how the demo starts torchrun) gets the
    signal it was tied with when the process that started it dies of SIGKILL (no handler of the
    parent runs), and runs on undisturbed while the parent lives."""
    import textwrap

    flag = tmp_path / "flag"
    child = (f"import os, signal, sys, time\n"
             f"def say(text):  # whole or not at all: the test reads it meanwhile\n"
             f"    open({str(flag)!r} + '.tmp', 'w').write(text)\n"
             f"    os.replace({str(flag)!r} + '.tmp', {str(flag)!r})\n"
             f"for s in (signal.SIGTERM, signal.SIGUSR2):\n"
             f"    signal.signal(s, lambda n, f: (say(signal.Signals(n).name), sys.exit(0)))\n"
             f"say('ready')\n"
             f"time.sleep(120)\n")
    parent = textwrap.dedent(f"""
        import signal, subprocess, sys, time
        from dali_nerf.cli.train import tied_to_this_process
        p = subprocess.Popen(tied_to_this_process([sys.executable, "-c", {child!r}], signal.SIG{name}),
                             start_new_session=True)
        print(p.pid, flush=True)
        p.wait()
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, env=_env())
    pid = int(proc.stdout.readline())
    try:
        deadline = time.time() + 60
        while not (flag.is_file() and flag.read_text() == "ready"):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.02)
        time.sleep(0.3)
        assert flag.read_text() == "ready" and os.path.exists(f"/proc/{pid}")  # the parent lives: nothing sent
        proc.kill()
        proc.wait()
        while flag.read_text() == "ready":
            assert time.time() < deadline, f"the child never got SIG{name} after its parent was killed"
            time.sleep(0.02)
        assert flag.read_text() == f"SIG{name}"
    finally:
        proc.stdout.close()
        if flag.read_text() == "ready":  # still running: stop it (it has not exited, so its pid is its own)
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # one demo each: a torchrun launch of 2 CPU ranks
@pytest.mark.parametrize("how", ["TERM to its pid", "TERM to every process", "INT to its group", "KILL to its pid"])
def test_a_signal_to_the_demo_stops_its_torchrun_and_ranks(tmp_path, how):
    """``dali-nerf demo`` keeps torchrun as its child (in a session of its own). SIGTERM to the
    demo's pid alone (``kill <pid>``: a job script, a scheduler signalling the top process) once
    rank 1 logged a random step (2-5 of 30) is passed on to torchrun and its ranks: rank 0 prints
    that they stopped after step T, both ranks' metrics end at T, ``latest`` is T's checkpoint;
    the demo exits 143 with its one line (the checkpoint folder and the resume command). The same
    when every process of the run gets SIGTERM at once (torchrun then has it twice, from the demo
    too, and passes it on twice within milliseconds: the ranks take the second for the same
    signal). Ctrl-C
    (SIGINT to the demo's process group, as a terminal sends it) still stops the ranks without a
    checkpoint: ``interrupted``, exit 130. SIGKILL to the demo (the OOM killer, ``kill -9``: no
    handler runs) reaches torchrun as SIGTERM (its parent-death signal), so the ranks stop and
    checkpoint as with TERM, and nobody trains on as an orphan. Either way no summary, no report,
    the scene and what the run wrote stay, and no process of the run is left (every process that
    inherited the test's marker variable, /proc)."""
    import random
    import uuid

    scene = make_scene("objects", tmp_path / "scene", width=24, height=24, n_train=8, n_val=1, n_test=2, seed=5)
    before = {p: p.read_bytes() for p in scene.rglob("*") if p.is_file()}
    runs = tmp_path / "runs"
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    at = random.Random(seed).randint(2, 5)
    print(f"{how} after rank 1 logged step {at}")
    mark = f"DALI_NERF_TEST_RUN={uuid.uuid4().hex}"
    cmd = [sys.executable, "-m", "dali_nerf", "demo", "--data", str(scene), "--nproc", "2", f"train.runs_dir={runs}",
           "name=demo", *TINY, "train.steps=30"]
    demo = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=_env(**dict([mark.split("=")])), start_new_session=True)
    try:
        metrics1 = runs / "demo" / "metrics.rank1.jsonl"
        deadline = time.time() + 300
        while max(_rows(metrics1), default=0) < at:
            assert demo.poll() is None and time.time() < deadline, demo.communicate()[1][-3000:]
            time.sleep(0.02)
        if how == "TERM to its pid":
            demo.send_signal(signal.SIGTERM)
        elif how == "TERM to every process":  # a scheduler that signals the job's every process (SLURM, systemd)
            for p in [demo.pid, *descendants(demo.pid)]:
                os.kill(p, signal.SIGTERM)
        elif how == "KILL to its pid":
            demo.kill()
        else:
            os.killpg(demo.pid, signal.SIGINT)
        out, err = demo.communicate(timeout=120)  # the pipes close when torchrun and its ranks have ended too
        left = [p for p in _marked(mark) if p != demo.pid]
        time.sleep(0.5)
        left = [p for p in left if p in _marked(mark)]  # still there half a second later: not a zombie's last moment
    finally:
        for p in [demo.pid, *_marked(mark)]:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        demo.wait()
    assert left == [], (left, err[-3000:])
    last = err.strip().splitlines()[-1]
    assert "[3/4] training" in out and "[4/4] report" not in out
    assert not (runs / "demo" / "summary.json").exists() and not (runs / "demo" / "report.md").exists()
    assert (runs / "demo" / "config.yaml").is_file() and not (runs / "demo" / ".lock").exists()
    assert {p: p.read_bytes() for p in scene.rglob("*") if p.is_file()} == before
    if how == "KILL to its pid":  # no line of the demo's own: it died at once
        assert demo.returncode == -signal.SIGKILL, err[-3000:]
        line = [l for l in err.splitlines() if l.startswith("stopped by SIGTERM after step ")]
        assert len(line) == 1, err[-3000:]
        T = int(line[0].split("after step ")[1].split()[0])
        ends = [max(_rows(runs / "demo" / f)) for f in ("metrics.jsonl", "metrics.rank1.jsonl")]
        assert ends == [T, T] and at <= T < 30, (ends, T, err[-2000:])
        assert latest_checkpoint(runs / "demo" / "checkpoints").name == f"step_{T:07d}"
        return
    if how == "INT to its group":
        assert demo.returncode == 130 and last == "interrupted", err[-3000:]
        # Ctrl-C writes no checkpoint (checkpoint_every=0: the only one is the last step's, if the
        # ranks got that far before the signal reached them)
        assert latest_checkpoint(runs / "demo" / "checkpoints") in (None, runs / "demo" / "checkpoints" / "step_0000030")
        return
    assert demo.returncode == 143, err[-3000:]
    line = [l for l in err.splitlines() if l.startswith("stopped by SIGTERM after step ")]
    assert len(line) == 1, err[-3000:]
    T = int(line[0].split("after step ")[1].split()[0])
    assert last.startswith("terminated by SIGTERM: passed on to torchrun, which stopped its ranks (exit code "), last
    assert f"; no report written; the last checkpoint is in {runs / 'demo' / 'checkpoints'} (`dali-nerf train " in last
    assert last.endswith(" --resume` continues it)"), last
    ends = [max(_rows(runs / "demo" / f)) for f in ("metrics.jsonl", "metrics.rank1.jsonl")]
    assert ends == [T, T] and at <= T < 30, (ends, T, err[-2000:])
    assert latest_checkpoint(runs / "demo" / "checkpoints").name == f"step_{T:07d}"
