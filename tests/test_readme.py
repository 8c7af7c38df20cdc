"""README.md as a newcomer uses it: its drop-in snippet and its `dali-nerf train` line run as
written (in a folder holding a tiny `data/default` scene; the train line gets size overrides
appended, is stopped by SIGTERM and then resumed), its links resolve, and it stays short."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
TINY = ["train.steps=4", "train.log_every=2", "train.checkpoint_every=2", "train.eval_images=1",
        "pipeline.rays_per_batch=256", "pipeline.rays_per_run=1024", "model.resolution=16",
        "model.samples_per_ray=16", "model.occupancy_resolution=0"]


def _blocks(lang: str) -> list:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory):
    """A folder as README's commands expect it: the default scene in data/default (tiny here)."""
    from dali_nerf.scenegen import make_scene

    root = tmp_path_factory.mktemp("newcomer")
    make_scene("objects", root / "data" / "default", width=24, height=24, n_train=4, n_val=1, n_test=1, seed=1)
    return root


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def test_readme_is_short_and_its_links_resolve():
    assert len(README.splitlines()) < 120
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links, "README links no guide"
    missing = [l for l in links if not l.startswith("http") and not (REPO / l).exists()]
    assert not missing, missing


def test_readme_drop_in_snippet_runs_as_written(newcomer):
    [snippet] = [b for b in _blocks("python") if "RayLoader(" in b]
    r = subprocess.run([sys.executable, "-c", snippet], cwd=newcomer, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "'steps': 1000" in r.stdout and "stall_fraction" in r.stdout, r.stdout[-2000:]


def _steps(path: Path) -> list:
    try:
        return [json.loads(l)["step"] for l in path.read_text().splitlines() if l.strip().endswith("}")]
    except (OSError, ValueError, KeyError):
        return []


def test_readme_train_line_trains_two_ranks_stops_on_sigterm_and_resumes(newcomer):
    """README's `dali-nerf train` line, as written plus size overrides: 2 DDP ranks under torchrun
    from the shipped config by name. The command becomes torchrun (the same pid), so SIGTERM sent to
    it is torchrun's: the ranks stop after a step T they both completed, T's checkpoint is
    ``latest`` (tests/test_sigterm.py: T is the last common step and the resume is bitwise exact);
    then `--resume` finishes steps T+1..16."""
    lines = [l.split("#")[0].strip() for b in _blocks("bash") for l in b.splitlines()]
    [line] = [l for l in lines if l.startswith("dali-nerf train --config")]
    args = shlex.split(line)
    assert args[:2] == ["dali-nerf", "train"] and "--nproc" in args and args[args.index("--nproc") + 1] == "2", line
    cmd = [sys.executable, "-m", "dali_nerf", *args[1:], *TINY, "train.steps=16", "train.log_every=1",
           "train.checkpoint_every=0"]
    run = newcomer / "runs" / "ddp_objects"
    log = (newcomer / "train.log").open("w+")
    p = subprocess.Popen(cmd, cwd=newcomer, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not _steps(run / "metrics.rank1.jsonl"):
            assert p.poll() is None and time.time() < deadline, log.seek(0) or log.read()[-3000:]
            time.sleep(0.05)
        assert b"torch.distributed.run" in Path(f"/proc/{p.pid}/cmdline").read_bytes()  # the command is torchrun
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # torchrun and anything it left
        except ProcessLookupError:
            pass
    log.seek(0)
    out = log.read()
    stopped = [l for l in out.splitlines() if l.startswith("stopped by SIGTERM after step ")]
    assert len(stopped) == 1 and p.returncode != 0, out[-3000:]
    T = int(stopped[0].split("after step ")[1].split()[0])
    assert 1 <= T < 16 and (run / "checkpoints" / f"step_{T:07d}").is_dir(), out[-3000:]
    assert _steps(run / "metrics.jsonl") == list(range(1, T + 1)) and not (run / "summary.json").exists()
    r = subprocess.run(cmd + ["--resume"], cwd=newcomer, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["method"] == "ddp" and s["world_size"] == 2 and s["steps"] == 16 and s["resumed_from"] == T, s
    assert _steps(run / "metrics.jsonl") == list(range(1, 17))  # the resumed run appended T+1..16
