"""One trainer per run folder (dali_nerf/train/runlock.py): a second trainer is refused in one line
naming the holder (pid, host); the lock of a process that died is taken over."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dali_nerf.errors import DaliNerfError
from dali_nerf.train.runlock import LOCK_FILE, RunLock

HOLD = ("import sys, time\nfrom dali_nerf.train.runlock import RunLock\nlock = RunLock(sys.argv[1]).acquire()\n"
        "print('held', flush=True)\ntime.sleep(600)\n")


def _holder(run: Path) -> subprocess.Popen:
    """Another process holding the run folder's lock (as a running trainer's rank 0 does)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_trainer_is_refused_naming_the_first_then_a_dead_ones_lock_is_taken_over(tmp_path, capsys):
    from dali_nerf.trainers.ddp import main

    run = tmp_path / "runs" / "run"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = _holder(run)
    try:
        with pytest.raises(DaliNerfError) as e:
            RunLock(run).acquire()
        msg = str(e.value)
        assert msg.startswith(f"{run}: in use by another trainer (pid {holder.pid} on host {socket.gethostname()}, since ")
        assert msg.endswith("wait for it to end or stop it, or train under another name=")
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"name: run\nscene:\n  path: {tmp_path}\ntrain:\n  runs_dir: {tmp_path / 'runs'}\n  device: cpu\n")
        before = {p: p.read_bytes() for p in run.rglob("*")}
        capsys.readouterr()
        assert main(["--config", str(cfg)]) == 2  # the trainer: one line, nothing of the run touched
        lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0] == f"error: {msg}", lines
        assert {p: p.read_bytes() for p in run.rglob("*")} == before
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the file stays, the kernel drops the lock
        holder.wait()
    assert f"pid {holder.pid} " in (run / LOCK_FILE).read_text()
    with RunLock(run) as lock:
        assert (run / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on host ")
        with pytest.raises(DaliNerfError, match=f"in use by another trainer \\(pid {os.getpid()} "):
            RunLock(run).acquire()  # even from this process: one lock per run folder
        lock.release()
        lock.release()  # idempotent
    assert not (run / LOCK_FILE).exists()

