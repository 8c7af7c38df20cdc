"""TensorBoard event files: written by TBWriter, read back with tensorboard's own EventAccumulator."""

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dali_nerf.train import tblog
from dali_nerf.config import TrainConfig
from dali_nerf.errors import ConfigError
from dali_nerf.scenegen import make_scene
from dali_nerf.train.tblog import TBWriter, resolve_mode, step_scalars

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard not installed (pip install -e '.[tensorboard]'); TBWriter is off without it")


def _read(log_dir):
    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0,
                                                                          event_accumulator.IMAGES: 0})
    acc.Reload()
    return acc


def test_scalars_and_images_read_back(tmp_path):
    run = tmp_path / "run"
    tb = TBWriter(run, mode="auto")
    assert tb.enabled and not run.exists()  # nothing written before the first event
    recs = [{"step": s, "loss": 1.0 / s, "psnr": 10.0 * s, "rays": 64, "wait_s": 0.01 * s, "h2d_s": 0.0,
             "forward_s": 0.1, "backward_s": 0.2, "sync_s": 0.0, "optimizer_s": 0.05, "step_s": 0.4} for s in range(1, 6)]
    for r in recs:
        tb.scalars(r["step"], step_scalars(r, stall_fraction=r["wait_s"] / r["step_s"], rays_per_s=64 / r["step_s"]))
    img = np.zeros((6, 8, 3), np.uint8)
    img[:, :4, 0] = 255
    tb.image(5, "test/0", img)
    tb.image(5, "test/1", np.full((6, 8, 3), 0.5, np.float32))
    tb.close()
    acc = _read(run / "tensorboard")
    tags = acc.Tags()
    for t in ("train/loss", "train/psnr", "loader/stall_fraction", "loader/rays_per_s", "phase/wait_s",
              "phase/forward_s", "phase/backward_s", "phase/sync_s", "phase/optimizer_s", "phase/step_s"):
        assert t in tags["scalars"], t
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    assert np.allclose([e.value for e in loss], [1.0 / s for s in range(1, 6)])
    assert np.allclose([e.value for e in acc.Scalars("phase/wait_s")], [0.01 * s for s in range(1, 6)])
    assert set(tags["images"]) == {"test/0", "test/1"}
    im = acc.Images("test/0")[0]
    assert (im.step, im.width, im.height) == (5, 8, 6)


def test_resume_purges_events_after_the_checkpoint(tmp_path):
    tb = TBWriter(tmp_path, mode="always")
    for s in range(1, 9):
        tb.scalars(s, {"train/loss": float(s)})
    tb.close()
    tb = TBWriter(tmp_path, mode="always", purge_step=5)  # resumed from the step-4 checkpoint
    for s in range(5, 7):
        tb.scalars(s, {"train/loss": 100.0 + s})
    tb.close()
    ev = _read(tmp_path / "tensorboard").Scalars("train/loss")
    assert [(e.step, e.value) for e in ev] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0)]


def test_resumed_writer_sorts_after_the_killed_runs_file_in_the_same_second(tmp_path, monkeypatch):
    """A resumed writer opened in the second of the killed run's file, with the per-process file
    counter crossing 9 -> 10 (their names then sort ``...10`` before ``...9``): TBWriter waits for
    the next second, so TensorBoard still reads the killed run's file first and the purge hides
    its later steps."""
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer._global_uid, "_value", 9)
    time.sleep(1.0 - time.time() % 1.0 + 0.01)  # both writers start early in one second
    tb = TBWriter(tmp_path, mode="always")
    for s in range(1, 5):
        tb.scalars(s, {"train/loss": float(s)})
    tb.close()
    tb = TBWriter(tmp_path, mode="always", purge_step=3)
    tb.scalars(3, {"train/loss": 103.0})
    tb.close()
    names = sorted(f.name for f in (tmp_path / "tensorboard").iterdir())
    assert [n.rsplit(".", 1)[1] for n in names] == ["9", "10"], names
    ev = _read(tmp_path / "tensorboard").Scalars("train/loss")
    assert [(e.step, e.value) for e in ev] == [(1, 1.0), (2, 2.0), (3, 103.0)]


def test_modes(tmp_path, monkeypatch):
    assert resolve_mode("auto") and resolve_mode("always") and not resolve_mode("never")
    tb = TBWriter(tmp_path, mode="never")
    tb.scalars(1, {"train/loss": 1.0})
    tb.close()
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(ConfigError, match=r"train.tensorboard: must be one of auto, always, never, got True"):
        resolve_mode(True)
    # without the package: auto is off, always names the fix
    monkeypatch.setattr(tblog, "tensorboard_available", lambda: False)
    assert not TBWriter(tmp_path, mode="auto").enabled
    with pytest.raises(ConfigError, match=r"train.tensorboard: 'always' needs the tensorboard package; pip install"):
        TBWriter(tmp_path, mode="always")


WIRED = any(f.name == "tensorboard" for f in dataclasses.fields(TrainConfig))


@pytest.mark.skipif(not WIRED, reason="train.tensorboard not wired into dali_nerf/train/loop.py yet")
def test_trainer_run_writes_tensorboard_events(tmp_path):
    """A real 1-rank DDP trainer run: its event file holds every step's scalars and the eval images."""

    repo = Path(__file__).resolve().parent.parent
    scene = make_scene("objects", tmp_path / "scene", width=24, height=24, n_train=4, n_val=1, n_test=1, seed=2)
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "dali_nerf.trainers.ddp", "--config", "configs/ddp_objects.yaml", f"scene.path={scene}",
           f"train.runs_dir={runs}", "name=tb", "train.steps=6", "train.log_every=3", "train.checkpoint_every=0",
           "train.eval_images=1", "pipeline.rays_per_batch=256", "pipeline.rays_per_run=1024", "model.resolution=16",
           "model.samples_per_ray=16", "model.hidden=16", "train.tensorboard=always"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=repo)
    assert r.returncode == 0, r.stderr[-4000:]
    acc = _read(runs / "tb" / "tensorboard")
    loss = acc.Scalars("train/loss")
    want = [json.loads(l)["loss"] for l in (runs / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in loss] == list(range(1, 7))
    assert np.allclose([e.value for e in loss], want, rtol=1e-6)
    for t in ("train/psnr", "loader/rays_per_s", "loader/warmup_s", "phase/wait_s", "phase/forward_s"):
        assert len(acc.Scalars(t)) == 6, t
    # the steady stall is defined from the run's second step on: the first step's wait is the warm-up
    assert [e.step for e in acc.Scalars("loader/stall_fraction")] == list(range(2, 7))
    assert acc.Tags()["images"], "no eval image in the event file"


def test_close_is_bounded_when_the_writer_thread_hangs(tmp_path, capsys):
    """TensorBoard's close joins its writer thread with no deadline; TBWriter.close gives up after
    its timeout with one warning line (a Ctrl-C's shutdown must stay bounded)."""
    import threading

    tb = TBWriter(tmp_path, mode="always")
    tb.scalars(1, {"train/loss": 1.0})
    release = threading.Event()
    real = tb._w

    class Stuck:
        def close(self):
            release.wait(30)
            real.close()

    tb._w = Stuck()
    t0 = time.monotonic()
    try:
        assert tb.close(timeout=0.3) is False
        took = time.monotonic() - t0
        assert took < 10.0, took  # far below the 30 s the stuck close would take: the bound, not a speed
        err = capsys.readouterr().err.strip()
        assert err.startswith("warning: ") and "did not close within 0.3 s" in err and "\n" not in err
        assert tb.close() is True  # already closed: nothing to do
    finally:
        release.set()
