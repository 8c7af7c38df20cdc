"""DaliFullImageDatamanager (``dali-splatfacto``) against nerfstudio's own FullImageDatamanager
(splatfacto's): on the same dataparser output, every training image once per epoch, each image
(uint8 and float32) and mask bit for bit the one nerfstudio caches, the same camera; distorted
cameras become the undistorted pinholes of our own nerfstudio parser, with its pixels; a first
``next_train`` at step s continues the order of a run from step 0.

Runs in the [nerfstudio] extra's environment (scripts/test_nerfstudio.sh); skipped elsewhere."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("nerfstudio", reason="nerfstudio not installed: the [nerfstudio] extra's tests run in its own "
                                         "environment (bash scripts/test_nerfstudio.sh)")

from nerfstudio.cameras.cameras import CameraType  # noqa: E402
from nerfstudio.data.datamanagers.full_images_datamanager import FullImageDatamanagerConfig  # noqa: E402
from nerfstudio.data.dataparsers.nerfstudio_dataparser import NerfstudioDataParserConfig  # noqa: E402

from dali_nerf import ImageLoader  # noqa: E402
from dali_nerf.errors import ConfigError  # noqa: E402
from dali_nerf.integrations.nerfstudio_splat import DaliFullImageDatamanagerConfig, dali_splatfacto  # noqa: E402
from dali_nerf.scenegen import make_scene  # noqa: E402
from dali_nerf.scenes import load_scene  # noqa: E402

SEED = 20261207


@pytest.fixture(scope="module")
def city(tmp_path_factory):
    """nerfstudio transforms.json, RGB JPEG, a mask on every frame (nerfstudio's dataparser re-orients,
    centres and scales the poses)."""
    return make_scene("city", tmp_path_factory.mktemp("ns") / "city", width=48, n_train=6, n_val=2, seed=4,
                      image_format="jpeg", occluders=True)


def _parser(root):
    return NerfstudioDataParserConfig(data=Path(root), downscale_factor=1)


def _ours(root, test_mode="val", **kw):
    print("seed", kw.setdefault("train_cameras_sampling_seed", SEED))
    return DaliFullImageDatamanagerConfig(dataparser=_parser(root), **kw).setup(device="cpu", test_mode=test_mode,
                                                                               world_size=1, local_rank=0)


@pytest.mark.parametrize("kind", ["uint8", "float32"])
def test_an_epoch_is_nerfstudios_images_masks_and_cameras(city, kind):
    # device "cpu" with cache_images "gpu": nerfstudio's cache without pinning (no CUDA here)
    ref = FullImageDatamanagerConfig(dataparser=_parser(city), cache_images="gpu",
                                     cache_images_type=kind).setup(device="cpu", test_mode="val", world_size=1,
                                                                   local_rank=0)
    dm = _ours(city, cache_images_type=kind)
    try:
        n = len(ref.train_dataset)
        assert dm.get_train_rays_per_batch() == ref.get_train_rays_per_batch() == 48 * 36
        seen = []
        for step in range(n):
            cam, data = dm.next_train(step)
            i = data["image_idx"]
            seen.append(i)
            want = ref.cached_train[i]
            assert data["image"].dtype == want["image"].dtype and torch.equal(data["image"], want["image"])
            assert data["mask"].shape == want["mask"].shape == (36, 48, 1) and torch.equal(data["mask"], want["mask"])
            assert 0 < int(data["mask"].sum()) < 36 * 48  # the occluder is masked
            rc = ref.train_cameras[i:i + 1]
            assert cam.shape == rc.shape == (1,) and cam.metadata["cam_idx"] == i
            for f in ("camera_to_worlds", "fx", "fy", "cx", "cy", "width", "height", "camera_type"):
                assert torch.equal(getattr(cam, f), getattr(rc, f)), f
        assert sorted(seen) == list(range(n))  # every training image once in the epoch
        assert dm.loader_stats()["steps"] == n
    finally:
        dm.close()


def test_a_first_step_past_zero_continues_the_order(city):
    """nerfstudio keeps no datamanager state: a resumed run's first next_train(s) is the order's step s."""
    a = _ours(city)
    try:
        full = [a.next_train(s)[1]["image_idx"] for s in range(14)]
    finally:
        a.close()
    assert sorted(full[:6]) == sorted(full[6:12]) == list(range(6))
    b = _ours(city)
    try:
        assert [b.next_train(s)[1]["image_idx"] for s in range(8, 14)] == full[8:]
    finally:
        b.close()


def _distorted(src: Path, dst: Path, model: str) -> Path:
    shutil.copytree(src, dst)
    meta = json.loads((dst / "transforms.json").read_text())
    meta["camera_model"] = model
    meta.update(dict(k1=-0.08, k2=0.01, k3=0.003, p1=0.002, p2=-0.001) if model == "OPENCV"
                else dict(k1=0.05, k2=-0.01, k3=0.002, k4=-0.0005))
    (dst / "transforms.json").write_text(json.dumps(meta))
    return dst


@pytest.mark.parametrize("model", ["OPENCV", "OPENCV_FISHEYE"])
def test_distorted_cameras_are_our_parsers_undistorted_pinholes(city, tmp_path, model):
    root = _distorted(Path(city), tmp_path / "scene", model)
    dm = _ours(root, cache_images_type="uint8")
    try:
        ns_type = dm.train_dataset.cameras.camera_type.reshape(-1)
        assert int(ns_type[0]) == (CameraType.PERSPECTIVE if model == "OPENCV" else CameraType.FISHEYE).value
        own = load_scene(root, "train", format="nerfstudio")  # our parser: its lens, tested against cv2 elsewhere
        sc = dm.train_scene
        assert sc.distortion is not None and bool(sc.fisheye[0]) == (model == "OPENCV_FISHEYE")
        np.testing.assert_allclose(sc.distortion, own.distortion, rtol=1e-6, atol=0)  # nerfstudio holds float32
        np.testing.assert_allclose(sc.intrinsics, own.intrinsics, rtol=1e-6)
        ids = []
        with ImageLoader(own, seed=SEED) as loader:  # the datamanager's seed: train_cameras_sampling_seed
            for step in range(3):
                cam, data = dm.next_train(step)
                ids.append(data["image_idx"])
                b = next(loader)
                assert int(b["image_id"][0]) == data["image_idx"]  # the same order: the stream is the seed's
                # the lens in float32 (nerfstudio's) against float64 (ours): the maps move by ~1e-7 pixel
                diff = (data["image"].int() - b["image"][0].int()).abs()
                print(model, "pixels off by one:", int(diff.gt(0).sum()), "max", int(diff.max()))
                assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01, (int(diff.max()), diff.gt(0).sum())
                assert float((data["mask"][..., 0] != b["mask"][0]).float().mean()) < 0.01
                k = b["K"][0]
                assert cam.camera_type.item() == CameraType.PERSPECTIVE.value
                assert cam.distortion_params is None or not cam.distortion_params.any()
                torch.testing.assert_close(torch.cat([cam.fx, cam.fy, cam.cx, cam.cy], -1)[0],
                                           torch.stack([k[0, 0], k[1, 1], k[0, 2], k[1, 2]]), rtol=1e-6, atol=0)
        assert len(set(ids)) == 3
        dm.fixed_indices_eval_dataloader  # nerfstudio caches the eval split, and resets its train_cameras doing so
        cam, data = dm.next_train(3)
        assert cam.camera_type.item() == CameraType.PERSPECTIVE.value
        assert float(cam.fx[0, 0]) == pytest.approx(float(sc.intrinsics[data["image_idx"], 0]), rel=1e-6)
    finally:
        dm.close()


def test_refusals_are_one_line(city, tmp_path):
    with pytest.raises(ConfigError, match="camera-res-scale-factor"):
        _ours(city, camera_res_scale_factor=0.5)
    with pytest.raises(ConfigError, match="train-cameras-sampling-strategy"):
        _ours(city, train_cameras_sampling_strategy="fps")
    with pytest.raises(ConfigError, match="pipeline.datamanager: prefetch") as e:
        _ours(city, prefetch=0)  # at set-up, before any model is built
    assert "\n" not in str(e.value)
    masked = DaliFullImageDatamanagerConfig(dataparser=NerfstudioDataParserConfig(data=Path(city), downscale_factor=1,
                                                                                  mask_color=(0.0, 0.0, 0.0)))
    with pytest.raises(ConfigError, match="mask_color"):
        masked.setup(device="cpu", test_mode="val", world_size=1, local_rank=0)
    root = _distorted(Path(city), tmp_path / "k4", "OPENCV")
    meta = json.loads((root / "transforms.json").read_text())
    meta["k4"] = 0.01  # nerfstudio's image undistortion refuses it too (an assert)
    (root / "transforms.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="k4") as e:
        _ours(root)
    assert "\n" not in str(e.value)


def test_inference_mode_reads_no_training_image(city, tmp_path):
    root = Path(shutil.copytree(city, tmp_path / "c"))
    shutil.rmtree(root / "train")  # ns-render / ns-export: the training images need not be there
    dm = _ours(root, test_mode="inference")
    assert dm.train_scene is None and dm.loader_stats() == {}


def test_the_method_is_splatfactos_with_our_datamanager():
    cfg = dali_splatfacto.config
    assert cfg.method_name == "dali-splatfacto"
    dmc = cfg.pipeline.datamanager
    assert isinstance(dmc, DaliFullImageDatamanagerConfig) and dmc.cache_images_type == "uint8"
    assert dmc.dataparser.load_3D_points  # splatfacto seeds its Gaussians from the sparse points
    from nerfstudio.models.splatfacto import SplatfactoModelConfig
    assert type(cfg.pipeline.model) is SplatfactoModelConfig


def _rank_main(rank: int, root: str, port: int, out: str) -> None:
    import torch.distributed as dist
    from nerfstudio.utils import comms
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comms.LOCAL_PROCESS_GROUP = dist.new_group([0, 1])  # as nerfstudio's launcher (scripts/train.py) sets it
    try:
        dm = DaliFullImageDatamanagerConfig(dataparser=_parser(root), cache_images_type="uint8",
                                            train_cameras_sampling_seed=SEED).setup(
            device="cpu", test_mode="val", world_size=2, local_rank=rank)
        try:
            ids = [dm.next_train(s)[1]["image_idx"] for s in range(6)]
            Path(out, f"{rank}.json").write_text(json.dumps({"ids": ids, "local_ranks": dm.loader_stats()["local_ranks"]}))
        finally:
            dm.close()
    finally:
        dist.destroy_process_group()


def test_two_ranks_of_nerfstudios_launcher_share_the_node_and_split_each_epoch(city, tmp_path):
    """nerfstudio's launcher sets no torchrun variables: the node's ranks are its per-machine process
    group (both here, so they decode into one shared store), and each epoch is split between them."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(str(city), port, str(tmp_path)), nprocs=2, start_method="spawn")
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [g["local_ranks"] for g in got] == [2, 2]
    for e in range(2):  # 6 images, 2 ranks: 3 steps an epoch, every image once across the ranks
        ep = got[0]["ids"][3 * e:3 * e + 3] + got[1]["ids"][3 * e:3 * e + 3]
        assert sorted(ep) == list(range(6))
