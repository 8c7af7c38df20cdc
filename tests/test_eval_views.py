"""A run decodes its evaluated views once, with the config's decode settings: the periodic
evaluations (``train.eval_every``), the final one and the SS method's per-cell renders share them."""

from __future__ import annotations

import pytest

from dali_nerf.data import imagecache
from dali_nerf.config import load_config
from dali_nerf.scenegen import make_scene


@pytest.fixture(scope="module")
def city(tmp_path_factory):
    return make_scene("city", tmp_path_factory.mktemp("ev") / "city", width=32, height=24, n_train=8, n_val=2, seed=1)


@pytest.mark.parametrize("method", ["ddp", "ss"])
def test_the_eval_split_is_decoded_once_per_run(city, tmp_path, monkeypatch, method):
    from dali_nerf.cli.trainer import run_training
    from dali_nerf.trainers.ddp import DDPMethod
    from dali_nerf.trainers.spatial import SpatialMethod

    calls = []
    real = imagecache.decode_cache

    def counting(scene, *a, **kw):
        calls.append((scene.split, kw.get("batch"), kw.get("num_threads")))
        return real(scene, *a, **kw)

    monkeypatch.setattr(imagecache, "decode_cache", counting)
    cfg = load_config("configs/ss_city.yaml", [
        f"scene.path={city}", f"train.runs_dir={tmp_path}", f"method={method}", "name=ev", "train.steps=6",
        "train.eval_every=2", "train.eval_images=2", "train.checkpoint_every=0", "train.device=cpu",
        "model.resolution=16", "model.samples_per_ray=8", "model.occupancy_resolution=0",
        "pipeline.rays_per_batch=64", "pipeline.rays_per_run=256", "cache.decode_batch=3"])
    summary = run_training(cfg, DDPMethod() if method == "ddp" else SpatialMethod())
    evals = [c for c in calls if c[0] == "val"]
    assert len(evals) == 1, calls  # before: the periodic evaluation, the final one and (SS) the cells' renders each decoded
    assert evals[0][1] == 3, evals  # the config's cache.decode_batch
    assert summary["eval_images"] == 2 and ("fused_psnr" in summary) == (method == "ss")
