"""DaliDataManager against nerfstudio itself: the same (camera, row, col) indices through
nerfstudio's own RayGenerator (cameras from nerfstudio's dataparser) and its InputDataset's images
give our rays and colours; ranks sample disjoint image shards; the eval side is nerfstudio's.

Runs in the [nerfstudio] extra's environment (scripts/test_nerfstudio.sh); skipped elsewhere."""

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("nerfstudio", reason="nerfstudio not installed: the [nerfstudio] extra's tests run in its own "
                                         "environment (bash scripts/test_nerfstudio.sh)")

from nerfstudio.data.datamanagers.base_datamanager import VanillaDataManagerConfig  # noqa: E402
from nerfstudio.data.dataparsers.blender_dataparser import BlenderDataParserConfig  # noqa: E402
from nerfstudio.data.dataparsers.nerfstudio_dataparser import NerfstudioDataParserConfig  # noqa: E402
from nerfstudio.model_components.ray_generators import RayGenerator  # noqa: E402

from dali_nerf.errors import ConfigError  # noqa: E402
from dali_nerf.integrations.nerfstudio import DaliDataManager, DaliDataManagerConfig  # noqa: E402
from dali_nerf.scenegen import make_scene  # noqa: E402


@pytest.fixture(scope="module")
def blender_scene(tmp_path_factory):
    """objects scene, Blender format, RGBA PNG (alpha 0/1) -> blender-data with alpha_color white."""
    return make_scene("objects", tmp_path_factory.mktemp("ns") / "objects", width=40, n_train=6, n_val=2, n_test=2, seed=3)


@pytest.fixture(scope="module")
def city_scene(tmp_path_factory):
    """city scene, nerfstudio transforms.json, RGB: nerfstudio-data re-orients, centres and scales the poses."""
    return make_scene("city", tmp_path_factory.mktemp("ns") / "city", width=48, n_train=6, n_val=2, seed=4,
                      image_format="jpeg")


def _parser(kind, root):
    if kind == "blender":
        return BlenderDataParserConfig(data=Path(root))
    return NerfstudioDataParserConfig(data=Path(root), downscale_factor=1)


def _dm(kind, root, rays=2048) -> DaliDataManager:
    cfg = DaliDataManagerConfig(dataparser=_parser(kind, root), train_num_rays_per_batch=rays)
    return cfg.setup(device="cpu", test_mode="val", world_size=1, local_rank=0)


@pytest.mark.parametrize("kind", ["blender", "nerfstudio"])
def test_rays_and_colours_equal_nerfstudio_raygenerator(kind, blender_scene, city_scene):
    root = blender_scene if kind == "blender" else city_scene
    dm = _dm(kind, root)
    try:
        assert dm.pinhole
        cams = dm.dataparser.get_dataparser_outputs(split="train").cameras   # nerfstudio's own dataparser run
        gen = RayGenerator(cams)
        images = [dm.train_dataset.get_image_float32(i) for i in range(len(dm.train_dataset))]
        if kind == "nerfstudio":  # the dataparser moved the cameras: our rays are in its frame, not the file's
            assert not np.allclose(dm.train_scene.world_from_source, np.eye(4))
        seen = set()
        for step in range(3):
            bundle, batch = dm.next_train(step)
            idx = batch["indices"]
            assert idx.shape == (2048, 3) and idx.dtype == torch.int64
            assert batch["image"].shape == (2048, 3) and batch["image"].dtype == torch.float32
            ref = gen(idx)
            torch.testing.assert_close(bundle.origins, ref.origins, atol=1e-6, rtol=0)
            torch.testing.assert_close(bundle.directions, ref.directions, atol=2e-6, rtol=0)
            torch.testing.assert_close(bundle.pixel_area, ref.pixel_area, rtol=1e-3, atol=1e-12)
            torch.testing.assert_close(bundle.metadata["directions_norm"], ref.metadata["directions_norm"], atol=2e-6, rtol=0)
            assert torch.equal(bundle.camera_indices, ref.camera_indices)
            assert bundle.nears is None and bundle.fars is None  # as RayGenerator: the model's collider sets them
            want = torch.stack([images[c][r, q, :3] for c, r, q in idx.tolist()])
            torch.testing.assert_close(batch["image"], want, atol=1e-6, rtol=0)
            seen |= set(idx[:, 0].tolist())
        assert seen == set(range(len(dm.train_dataset)))  # one rank samples every train image
    finally:
        dm.close()


def test_ranks_sample_disjoint_shards(blender_scene):
    dms = [DaliDataManagerConfig(dataparser=_parser("blender", blender_scene), train_num_rays_per_batch=1024)
           .setup(device="cpu", test_mode="val", world_size=2, local_rank=r) for r in range(2)]
    try:
        cams = [set() for _ in dms]
        for step in range(3):
            for r, dm in enumerate(dms):
                _, batch = dm.next_train(step)
                cams[r] |= set(batch["indices"][:, 0].tolist())
        assert cams[0] and cams[1] and not cams[0] & cams[1]
        assert cams[0] | cams[1] == set(range(6))
    finally:
        for dm in dms:
            dm.close()


def test_eval_side_is_nerfstudios(blender_scene):
    ours = _dm("blender", blender_scene)
    theirs = VanillaDataManagerConfig(dataparser=_parser("blender", blender_scene)).setup(device="cpu", test_mode="val")
    try:
        assert len(ours.eval_dataset) == len(theirs.eval_dataset) == 2
        cam_a, batch_a = next(iter(ours.fixed_indices_eval_dataloader))
        cam_b, batch_b = next(iter(theirs.fixed_indices_eval_dataloader))
        assert torch.equal(batch_a["image"], batch_b["image"])
        assert torch.equal(cam_a.camera_to_worlds, cam_b.camera_to_worlds)
        rb, b = ours.next_eval(0)
        assert b["image"].shape[0] == ours.get_eval_rays_per_batch()
    finally:
        ours.close()


@pytest.mark.parametrize("field_value,match", [
    ({"patch_size": 4}, r"patch-size: DaliDataManager samples single pixels"),
    ({"train_num_images_to_sample_from": 2}, r"train-num-images-to-sample-from"),
    ({"camera_res_scale_factor": 0.5}, r"camera-res-scale-factor: must be 1.0"),
])
def test_unsupported_settings_are_one_line_errors(blender_scene, field_value, match):
    cfg = DaliDataManagerConfig(dataparser=_parser("blender", blender_scene), **field_value)
    with pytest.raises(ConfigError, match=match):
        cfg.setup(device="cpu", test_mode="val")


def test_rgba_without_alpha_colour_is_refused(blender_scene):
    cfg = DaliDataManagerConfig(dataparser=BlenderDataParserConfig(data=Path(blender_scene), alpha_color=None))
    with pytest.raises(ConfigError, match=r"RGBA image and the dataparser has no alpha_color"):
        cfg.setup(device="cpu", test_mode="val")


def test_global_batch_gives_the_same_global_batches_on_any_device_count(blender_scene):
    """stream global with global_batch G: one device and two devices (G / 2 each) started at the
    same step (a restart at nerfstudio's step) sample the same global batch (the union of the
    ranks' rays); a device count that does not divide G is refused in one line, as is global_batch
    with stream shard."""
    def dm(world, rank, **kw):
        return DaliDataManagerConfig(dataparser=_parser("blender", blender_scene), stream="global", **kw) \
            .setup(device="cpu", test_mode="val", world_size=world, local_rank=rank)

    def batch(world, rank, step):
        d = dm(world, rank, global_batch=2048)
        try:
            return d.get_train_rays_per_batch(), d.next_train(step)[1]["indices"]
        finally:
            d.close()

    for step in (0, 1, 7):
        b1, want = batch(1, 0, step)
        (b2, got0), (_, got1) = batch(2, 0, step), batch(2, 1, step)
        assert (b1, b2) == (2048, 1024) and len(want) == len(got0) + len(got1) == 2048 and len(got0) and len(got1)
        key = lambda t: sorted(map(tuple, t.tolist()))
        assert key(torch.cat([got0, got1])) == key(want), step
    assert key(batch(1, 0, 1)[1]) != key(batch(1, 0, 0)[1])  # the step chooses the batch
    with pytest.raises(ConfigError, match=r"^pipeline.datamanager.global-batch=2048 does not divide among 3 "
                                          r"devices; use a number of devices that divides it \(2 or 4\) or change it$"):
        dm(3, 0, global_batch=2048)
    with pytest.raises(ConfigError, match=r"global-batch=2048: fixes the global stream's batch; add "
                                          r"--pipeline.datamanager.stream global"):
        DaliDataManagerConfig(dataparser=_parser("blender", blender_scene), global_batch=2048) \
            .setup(device="cpu", test_mode="val")
