"""Ctrl-C always stops a run (dali_nerf/interrupt.py): promptly, exit 130 with one line, nothing left.

The trainer is a real subprocess in its own session; SIGINT goes to its whole process group, as a
terminal's Ctrl-C does (DataLoader workers included). It is sent in four states (while torch and
DALI load, as the first batch is fetched, mid-run, while checkpointing), with the machine's cores kept busy by other
processes. After the exit: no process of the group is left, no shared-memory entry or semaphore
of the trainer's processes is left in /dev/shm, and the last complete checkpoint loads. If the
trainer does not exit, the test asks it for its stacks (SIGUSR1, faulthandler) and fails with them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from dali_nerf.train.checkpoint import latest_checkpoint
from dali_nerf.train.resume import load_checkpoint
from dali_nerf.interrupt import EXIT_INTERRUPTED, descendants
from dali_nerf.scenegen import make_scene

# seconds from SIGINT to exit that count as prompt: the bounded path (sources closed with deadlines,
# then os._exit) takes 0.1-1.5 s here with both cores busy; the watchdog ends the process at 10 s
PROMPT_S = 6.0


@pytest.fixture(scope="module")
def scene_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupt")
    return Path(make_scene("objects", root / "scene", width=24, height=24, n_train=8, n_val=1, n_test=2))


@pytest.fixture
def busy_cores():
    """Every core kept busy by other processes at normal priority while the test runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    yield
    for h in hogs:
        h.kill()
        h.wait()


def _config(tmp_path: Path, scene: Path, checkpoint_every: int) -> Path:
    p = tmp_path / "sigint.yaml"
    p.write_text(textwrap.dedent(f"""\
        name: sigint
        method: ddp
        scene: {{path: {scene}}}
        pipeline: {{rays_per_batch: 64, rays_per_run: 1024, workers: 2}}
        model: {{resolution: 16, samples_per_ray: 16, occupancy_resolution: 0}}
        train: {{steps: 100000, checkpoint_every: {checkpoint_every}, log_every: 1, eval_images: 1, device: cpu,
                 runs_dir: {tmp_path / 'runs'}}}
        """))
    return p


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    return env


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _shm_of(pids) -> list:
    """/dev/shm entries that name one of ``pids`` (torch's ``torch_<pid>_...``) or are POSIX
    semaphores / blocks made by multiprocessing for them (``sem.mp-*``, ``psm_*``: listed by the
    caller's before/after difference)."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    keys = {f"_{p}_" for p in pids}
    return sorted(n for n in names if any(k in f"_{n}_" for k in keys))


def _mapped_shm(pids=None) -> set:
    """/dev/shm names some live process (of ``pids``, default any) has mapped (POSIX semaphores and
    shared blocks in use)."""
    names = set()
    for d in (os.listdir("/proc") if pids is None else map(str, pids)):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/maps") as f:
                    names.update(line.rsplit("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line)
            except (OSError, IndexError):
                continue
    return names


def _leaked(before: set) -> list:
    """New /dev/shm entries that no live process maps: left behind by a process that is gone (an
    entry another program on the machine is using is not the trainer's leak)."""
    new = set(os.listdir("/dev/shm")) - before
    return sorted(new - _mapped_shm()) if new else []


def _wait_for(pred, proc, seconds=120.0):
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        if pred():
            return True
        time.sleep(0.02)
    return False


def _stacks_and_kill(proc) -> str:
    """A trainer that did not exit: its stacks (SIGUSR1 -> faulthandler), then SIGKILL to its group."""
    for p in [proc.pid] + descendants(proc.pid):
        try:
            os.kill(p, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    return err[-6000:]


STATES = {
    # SIGINT while the trainer imports torch and DALI (nothing to clean up yet)
    "startup": lambda run: True,
    # SIGINT as soon as the run folder has its config (tasks built): the first batch is being fetched
    "first_batch": lambda run: (run / "config.yaml").is_file(),
    "mid_run": lambda run: (run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3,
    # checkpoint_every=1: most of a step is the checkpoint write; SIGINT right after one completed
    "checkpointing": lambda run: (run / "checkpoints" / "latest").is_file(),
}


@pytest.mark.parametrize("state", sorted(STATES))
@pytest.mark.parametrize("pipeline", ["rays", "torch_workers"])
def test_ctrl_c_stops_the_trainer_promptly_leaving_nothing(scene_dir, tmp_path, pipeline, state, busy_cores):
    cfg = _config(tmp_path, scene_dir, checkpoint_every=1 if state == "checkpointing" else 0)
    run = tmp_path / "runs" / "sigint"
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    proc = subprocess.Popen([sys.executable, "-m", "dali_nerf.trainers.ddp", "--config", str(cfg),
                             f"pipeline.name={pipeline}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    seen = {proc.pid}
    try:
        reached = _wait_for(lambda: STATES[state](run), proc)
        if state == "startup":
            time.sleep(0.3)  # inside the imports (they take seconds)
        elif state != "first_batch":
            time.sleep(0.05)
        assert proc.poll() is None, f"trainer ended before SIGINT: {proc.communicate()[1][-3000:]}"
        assert reached, "the trainer did not reach the state in 120 s"
        kids = descendants(proc.pid)
        seen |= set(kids)
        if pipeline == "torch_workers" and state not in ("first_batch", "startup"):
            assert len(kids) >= 2, f"expected the DataLoader workers as children, got {kids}"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
        t0 = time.monotonic()
        try:
            out, err = proc.communicate(timeout=PROMPT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit {PROMPT_S} s after SIGINT ({pipeline}, {state}); stacks:\n{_stacks_and_kill(proc)}")
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [l for l in err.splitlines() if l.strip()]
    assert proc.returncode == EXIT_INTERRUPTED, (proc.returncode, err[-3000:])
    assert "Traceback" not in err and "still shutting down" not in err, err[-3000:]
    assert lines and lines[-1] == "interrupted", err[-3000:]
    print(f"{pipeline}/{state}: exit {proc.returncode} {took:.2f} s after SIGINT")
    deadline = time.time() + 5
    while time.time() < deadline and _group_alive(proc.pid):
        time.sleep(0.05)
    assert not _group_alive(proc.pid), f"processes of the trainer's group left: {descendants(proc.pid)}"
    left = sorted(set(_leaked(shm_before)) | set(_shm_of(seen)))
    assert not left, f"/dev/shm entries left: {left}"
    if state == "checkpointing":
        folder = latest_checkpoint(run / "checkpoints")
        assert folder is not None
        st = load_checkpoint(folder, 0)  # the pointer names a complete, loadable checkpoint
        assert st["step"] >= 1 and "tasks" in st
        assert not list((run / "checkpoints").rglob(".*.tmp-*")), "a temporary checkpoint file was left"


# --------------------------------------------------------------------------------------------- the mechanism

_HANG = textwrap.dedent("""\
    import sys, threading, time
    from dali_nerf.cli.command import run_cli
    from dali_nerf.interrupt import exit_process

    def work():
        try:
            print("ready", flush=True)
            time.sleep(60)
        finally:
            if sys.argv[1] == "hang":
                threading.Event().wait()  # a cleanup that never ends (an unbounded join)

    exit_process(run_cli(work))
    """)


@pytest.mark.parametrize("how", ["clean", "hang", "twice", "echo"])
def test_interrupt_path_is_bounded(tmp_path, how):
    """clean: KeyboardInterrupt -> 'interrupted', exit 130 at once. hang: the cleanup blocks forever;
    the watchdog prints the stacks and one error line and exits 130 after the grace time. twice: a
    second SIGINT during a hung cleanup exits at once."""
    script = tmp_path / "hang.py"
    script.write_text(_HANG)
    env = dict(os.environ, DALI_NERF_INTERRUPT_GRACE_S="2")
    proc = subprocess.Popen([sys.executable, str(script), "clean" if how == "clean" else "hang"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        if how in ("twice", "echo"):  # a user's second Ctrl-C / torchrun forwarding the same one
            time.sleep(1.3 if how == "twice" else 0.1)
            os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=15)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # which path ended the process is read from what it printed, not from how long it took (a busy
    # host delays any exit): the watchdog, and only it, prints "still shutting down"; the bound is
    # communicate's timeout, the grace's lower bound the watchdog's own sleep
    assert proc.returncode == EXIT_INTERRUPTED, err
    if how == "clean":
        assert err.strip() == "interrupted", (took, err)  # at once: no watchdog line
    elif how in ("hang", "echo"):
        assert took >= 1.9, took
        assert "still shutting down 2 s after the interrupt" in err and "in work" in err, err  # the stacks name the frame
        assert "interrupted again" not in err, err
    else:
        assert err.strip().splitlines()[-1].startswith("error: interrupted again during shutdown"), err
        assert "still shutting down" not in err, err  # the second Ctrl-C, not the watchdog, ended it
        assert "Thread 0x" not in err and "Current thread" not in err, err  # no stacks for a user's second Ctrl-C


def test_run_ahead_close_has_a_deadline():
    """A run that never finishes does not hang close(): it returns False after the timeout and
    warns; a thread that ends in time returns True."""
    import threading

    from dali_nerf.sources.runner import RunAhead

    gate = threading.Event()

    def produce(pipe):
        gate.wait()  # a DALI run in flight that does not return
        return 1

    ahead = RunAhead(object(), produce, name="test-stuck")
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert ahead.close(timeout=0.3) is False
    assert 0.25 <= time.monotonic() - t0 < 30.0  # the deadline, not a speed: without it close() never returns
    assert any(issubclass(x.category, ResourceWarning) and "test-stuck" in str(x.message) for x in w)
    gate.set()
    ok = RunAhead(object(), lambda pipe: 1, name="test-ok")
    assert ok.get() == 1
    assert ok.close(timeout=2.0) is True


def test_dataloader_workers_ignore_sigint(scene_dir):
    """A SIGINT that reaches a worker first (a busy main process) does not kill it: the main
    process decides, and its close() shuts the workers down. The same for SIGTERM (torchrun
    signals each worker's whole process group: the main process finishes its step and
    checkpoints, its workers must live until it closes them)."""
    from dali_nerf.scenes import load_scene
    from dali_nerf.sources.sync import TorchWorkersSampler

    scene = load_scene(scene_dir, split="train")
    src = TorchWorkersSampler(scene, rays_per_batch=64, workers=2, seed=0)
    try:
        a = next(src)
        workers = [w.pid for w in src._it._workers]  # the DataLoader iterator's worker processes
        assert len(workers) == 2 and set(workers) <= set(descendants())
        for p in workers:
            os.kill(p, signal.SIGINT)
            os.kill(p, signal.SIGTERM)
        time.sleep(0.5)
        for _ in range(5):
            b = next(src)  # would raise "DataLoader worker ... exited unexpectedly" had they died
        assert b["rgb"].shape == a["rgb"].shape
        assert all(Path(f"/proc/{p}").exists() for p in workers)
    finally:
        src.close()
    assert not set(workers) & set(descendants()), "close() left DataLoader workers running"


def test_ctrl_c_under_torchrun_frees_the_emulated_modes_shared_memory(scene_dir, tmp_path):
    """Two emulated ranks under torchrun share named semaphores and a shared-memory block
    (sync_global's scatter). Ctrl-C to the group (torchrun forwards it to its workers too): every
    rank prints ``interrupted``, the group is gone within seconds, and nothing of theirs is left in
    /dev/shm."""
    cfg = _config(tmp_path, scene_dir, checkpoint_every=0)
    run = tmp_path / "runs" / "sigint"
    shm_before = set(os.listdir("/dev/shm"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "dali_nerf.trainers.ddp", "--config", str(cfg), "train.device=emulated", "train.emulated_step_ms=2",
           "pipeline.name=sync_global", "pipeline.rays_per_batch=256"]
    env = _env()
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        # the block and the semaphores exist once the ranks time their steps (config.yaml is not
        # written by this mode: wait for the scatter block to appear)
        assert _wait_for(lambda: any(n.startswith("psm_") for n in set(os.listdir("/dev/shm")) - shm_before), proc), \
            f"no shared block appeared: {proc.poll()} {run}"
        time.sleep(1.0)
        # the run's entries: new ones its processes map (not another job's, on a shared machine)
        made = sorted((set(os.listdir("/dev/shm")) - shm_before) & _mapped_shm([proc.pid, *descendants(proc.pid)]))
        assert any(n.startswith("sem.") for n in made), made
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        try:
            out, err = proc.communicate(timeout=PROMPT_S + 10)  # torchrun's own shutdown comes on top
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun did not exit after SIGINT; stacks:\n{_stacks_and_kill(proc)}")
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"torchrun emulated sync_global: exit {proc.returncode} {took:.2f} s after SIGINT")
    assert err.splitlines().count("interrupted") == 2, err[-3000:]  # each rank, one line
    assert "still shutting down" not in err and "leaked" not in err, err[-3000:]
    deadline = time.time() + 5
    while time.time() < deadline and _group_alive(proc.pid):
        time.sleep(0.05)
    assert not _group_alive(proc.pid)
    left = [n for n in _leaked(shm_before) if n in made]
    assert not left, f"/dev/shm entries left: {left}"


def test_interrupts_deferred_holds_sigint_to_the_end_of_the_block():
    """A worker start is never cut in half: SIGINT inside the block is raised when it ends."""
    from dali_nerf.interrupt import interrupts_deferred

    done = []
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # a handler would have run by now
                done.append(1)
        assert done == [1]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with interrupts_deferred():  # nothing held: nothing raised
            pass
    finally:
        signal.signal(signal.SIGINT, prev)


def test_stderr_lines_are_one_write_each(monkeypatch):
    """Ranks share their launcher's stderr pipe: the `interrupted` and `error:` lines go out in one
    write with their newline (print writes them apart; under python -u two ranks' lines interleaved
    as 'interruptedinterrupted' in a full-suite run)."""
    from dali_nerf.errors import stderr_line

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, s):
            self.writes.append(s)

        def flush(self):
            self.writes.append(None)

    rec = Recorder()
    monkeypatch.setattr(sys, "stderr", rec)
    stderr_line("interrupted")
    assert rec.writes == ["interrupted\n", None]
