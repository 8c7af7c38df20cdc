"""Masks against nerfstudio itself: on a generated capture with occluders (nerfstudio
transforms.json, ``mask_path`` on every frame), the pixels nerfstudio's own PixelSampler can draw
(the nonzero pixels of the masks its InputDataset loads: ``torch.nonzero`` in
``PixelSampler.sample_method``) are exactly the pixels our RayLoader draws over an epoch, at full
size and at half size (nerfstudio's ``scale_factor`` 0.5: its masks resized with PIL NEAREST;
ours: ``downscale=2`` without a ``masks_2`` folder).

Runs in the [nerfstudio] extra's environment (scripts/test_nerfstudio.sh); skipped elsewhere."""

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("nerfstudio", reason="nerfstudio not installed: the [nerfstudio] extra's tests run in its own "
                                         "environment (bash scripts/test_nerfstudio.sh)")

from nerfstudio.data.datasets.base_dataset import InputDataset  # noqa: E402
from nerfstudio.data.dataparsers.nerfstudio_dataparser import NerfstudioDataParserConfig  # noqa: E402
from nerfstudio.data.pixel_samplers import PixelSampler, PixelSamplerConfig  # noqa: E402

from dali_nerf.integrations.nerfstudio import DaliDataManagerConfig  # noqa: E402
from dali_nerf.scenegen import make_scene  # noqa: E402
from dali_nerf.scenes import load_scene  # noqa: E402
from dali_nerf.sources import RayLoader  # noqa: E402


@pytest.fixture(scope="module")
def occluded_city(tmp_path_factory):
    return make_scene("city", tmp_path_factory.mktemp("ns") / "city", width=48, n_train=6, n_val=2, seed=4,
                      image_format="png", occluders=True)


def _nerfstudio_drawable(root: Path, scale: float) -> set:
    """The (camera, row, col) nerfstudio's PixelSampler can draw from the train split's masks."""
    parser = NerfstudioDataParserConfig(data=Path(root), downscale_factor=1).setup()
    dataset = InputDataset(parser.get_dataparser_outputs(split="train"), scale_factor=scale)
    masks = torch.stack([dataset.get_data(i)["mask"] for i in range(len(dataset))])  # (N, H, W, 1) bool
    n, h, w = masks.shape[:3]
    cfg = PixelSamplerConfig(num_rays_per_batch=16)
    if hasattr(cfg, "rejection_sample_mask"):  # newer nerfstudio: draw from torch.nonzero, not by rejection
        cfg.rejection_sample_mask = False
    sampler = PixelSampler(cfg)
    k = int(masks.sum())
    idx = sampler.sample_method(k, n, h, w, mask=masks, device="cpu")  # all of them: random.sample of k of k
    return {tuple(r) for r in idx.tolist()}


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_the_pixels_each_can_draw_are_the_same(occluded_city, scale):
    ns = _nerfstudio_drawable(occluded_city, scale)
    scene = load_scene(occluded_city, "train", format="nerfstudio", downscale=int(round(1 / scale)))
    assert scene.masked
    V = len(ns)
    with RayLoader(scene, rays_per_batch=V, mode="epoch", seed=1, num_threads=1) as loader:
        assert loader.num_pixels == V  # the same count: an epoch of our stream is exactly V rays
        ours = {tuple(r) for r in next(loader)["indices"].tolist()}
    assert ours == ns
    assert 0 < V < int((scene.width * scene.height).sum())  # the occluders are masked out


def test_dali_datamanager_samples_the_unmasked_pixels(tmp_path):
    """DaliDataManager on a masked nerfstudio scene: the scene it builds from nerfstudio's dataparser
    carries the masks, and every training ray it hands out is on a pixel nerfstudio's mask keeps.
    (JPEG images: nerfstudio's own dataparser has no alpha colour, which RGBA PNGs would need.)"""
    city = make_scene("city", tmp_path / "city", width=48, n_train=6, n_val=2, seed=4, image_format="jpeg",
                      occluders=True)
    cfg = DaliDataManagerConfig(dataparser=NerfstudioDataParserConfig(data=Path(city), downscale_factor=1),
                                train_num_rays_per_batch=1024)
    dm = cfg.setup(device="cpu", test_mode="val", world_size=1, local_rank=0)
    try:
        assert dm.train_scene.masked
        masks = [dm.train_dataset.get_data(i)["mask"][..., 0] for i in range(len(dm.train_dataset))]
        for step in range(3):
            _, batch = dm.next_train(step)
            assert all(bool(masks[c][r, q]) for c, r, q in batch["indices"].tolist())
    finally:
        dm.close()
