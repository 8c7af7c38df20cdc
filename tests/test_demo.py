"""Smoke test of the README's main command (`dali-nerf demo`) on a tiny scene, and of
`dali-nerf render --orbit` on its run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_on_tiny_scene_then_render_orbit(tmp_path):
    from dali_nerf.scenegen import make_scene

    data = tmp_path / "scene"
    make_scene("objects", data, width=24, height=24, n_train=6, n_val=1, n_test=2, seed=1)
    runs = tmp_path / "runs"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "dali_nerf", "demo", "--data", str(data), "--nproc", "2",
           f"train.runs_dir={runs}", "train.steps=12", "train.log_every=4", "train.checkpoint_every=0",
           "train.eval_images=1", "pipeline.rays_per_batch=256", "pipeline.rays_per_run=2048",
           "model.resolution=16", "model.samples_per_ray=16", "model.occupancy_resolution=0"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = runs / "ddp_objects"
    assert "[4/4] report" in r.stdout and "test PSNR" in r.stdout
    for f in ("summary.json", "metrics.jsonl", "report.md", "config.yaml", "checkpoints/latest"):
        assert (run / f).is_file(), f
    s = json.loads((run / "summary.json").read_text())
    assert s["world_size"] == 2 and s["steps"] == 12
    assert all((run / "renders" / n).is_file() for n in s["renders"])

    out = tmp_path / "orbit"
    r = subprocess.run([sys.executable, "-m", "dali_nerf", "render", "--checkpoint", str(run), "--out", str(out),
                        "--orbit", "3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in out.glob("*.png")) == ["orbit_000.png", "orbit_001.png", "orbit_002.png"]


def test_demo_bad_config_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dali_nerf", "demo", "--data", str(tmp_path / "absent"),
                        "pipeline.rays_per_batch=-1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert not (tmp_path / "absent").exists()  # nothing generated for a bad config
    assert r.stderr.strip().count("\n") == 0 and "pipeline.rays_per_batch" in r.stderr and "Traceback" not in r.stderr
