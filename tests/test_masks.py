"""Masks through the data path: a scene's masks decoded once into the cache, and every source
(RayLoader: shard and global streams, streaming windows; SpatialRayLoader; the synchronous
baselines) never hands out a masked pixel; epochs visit every valid pixel exactly once across
ranks, also across a resume on another world size.

Scenes are tiny PNG scenes with single-channel masks written per test (tests/_tiny_scene.py: a
masked band, iid pixels, a nonzero value that is not 255)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from _stream_checks import pixel_ids
from _tiny_scene import reference_mask, tiny_scene
from dali_nerf.config import PartitionConfig
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.data.masks import unpack_valid, valid_counts
from dali_nerf.errors import ConfigError, DataError
from dali_nerf.ops import reference as ref
from dali_nerf.partition import Partition
from dali_nerf.sources import RayLoader, SpatialRayLoader, SyncGlobalSampler, SyncLocalSampler, TorchWorkersSampler
from dali_nerf.sources.sync import RoutedSyncLocal

SIZES = [(12, 9), (9, 7), (13, 5), (6, 10), (11, 8)]


def _scene(tmp_path, seed=0, **masks):
    return tiny_scene(tmp_path, n=len(SIZES), sizes=SIZES, kinds=("png_rgb",), seed=seed, masks=masks or {})


def _valid(scene) -> np.ndarray:
    """(P,) bool: the split's valid pixels from an independent read of the mask files."""
    return np.concatenate([reference_mask(scene, i).reshape(-1) for i in range(scene.num_images)])


def _all_valid(scene, batches) -> np.ndarray:
    """The split pixel ids of the batches' rays, asserting each is valid."""
    idx = torch.cat([b["indices"] for b in batches]).numpy()
    ids = pixel_ids(scene.width, scene.height, idx)
    valid = _valid(scene)
    assert valid[ids].all(), f"{int((~valid[ids]).sum())} of {len(ids)} rays on masked pixels"
    return ids


def test_the_cache_holds_the_masks_decoded_once(tmp_path):
    scene = _scene(tmp_path)
    valid = _valid(scene)
    assert 0.2 < valid.mean() < 0.8
    counts = valid_counts(scene)
    offs = np.concatenate([[0], np.cumsum(scene.width * scene.height)])
    assert counts.tolist() == [int(valid[offs[i]:offs[i + 1]].sum()) for i in range(scene.num_images)]
    for r in range(2):
        cache = decode_cache(scene, r, 2)
        lo, hi = int(offs[cache.layout[0, 3]]), int(offs[cache.layout[-1, 3] + 1])
        assert np.array_equal(unpack_valid(cache.valid, cache.num_pixels), valid[lo:hi])
        assert cache.valid_counts.tolist() == counts[cache.layout[:, 3]].tolist()
        assert cache.num_valid == int(valid[lo:hi].sum())
        assert np.array_equal(cache.image_mask(0), reference_mask(scene, int(cache.layout[0, 3])))


def test_bad_masks_are_one_line_errors(tmp_path):
    import cv2

    scene = _scene(tmp_path)
    cv2.imwrite(scene.mask_paths[1], np.zeros((7, 9, 3), np.uint8))  # three channels
    with pytest.raises(DataError, match=r"mask_001.png: a mask must be single-channel.*grayscale PNG"):
        decode_cache(scene)
    cv2.imwrite(scene.mask_paths[1], np.zeros((8, 9), np.uint8))  # another size
    with pytest.raises(DataError, match=r"mask_001.png: .*9x8"):
        decode_cache(scene)
    import os

    os.remove(scene.mask_paths[1])
    with pytest.raises(DataError, match=r"mask_001.png: mask file not found"):
        decode_cache(scene)


def test_all_masked_splits_and_shards_are_refused(tmp_path):
    scene = _scene(tmp_path, full=(3, 4))  # rank 2 of 3 holds images 3 and 4, fully masked
    with pytest.raises(ConfigError, match=r"rank 2's shard \(images 3..4 of split 'train'\) is fully masked"):
        RayLoader(scene, rays_per_batch=8, rank=2, world_size=3, num_threads=1)
    dead = _scene(tmp_path / "dead", full=tuple(range(len(SIZES))))
    with pytest.raises(ConfigError, match="every pixel of split 'train' is masked"):
        RayLoader(dead, rays_per_batch=8, num_threads=1, stream="global")


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_shard_stream_epoch_and_rays_stay_on_valid_pixels(tmp_path, mode):
    """Each rank's shard stream (cached, and streamed through windows) draws valid pixels only;
    in epoch mode the first P_r rays after set_epoch cover its shard's valid pixels exactly once."""
    scene = _scene(tmp_path, full=(2,))
    valid = _valid(scene)
    W = 2
    parts = []
    for r in range(W):
        for max_bytes in (None, 2 * (13 * 5 * 3 + 200)):  # cached; windows of one image
            with RayLoader(scene, rays_per_batch=16, rank=r, world_size=W, seed=4, mode=mode, num_threads=1,
                           rays_per_run=32, max_bytes=max_bytes) as L:
                if mode == "epoch":
                    L.set_epoch(1)
                    steps = math.ceil(L.num_pixels / 16)
                    got = [next(L) for _ in range(steps)]
                    ids = _all_valid(scene, got)[:L.num_pixels]
                    if max_bytes is None:
                        parts.append(ids)
                    assert len(np.unique(ids)) == L.num_pixels == len(ids)
                else:
                    _all_valid(scene, [next(L) for _ in range(6)])
    if mode == "epoch":
        assert np.array_equal(np.sort(np.concatenate(parts)), np.flatnonzero(valid))


def test_global_stream_epoch_across_a_resume_on_another_world_size(tmp_path):
    """The global stream over valid pixels: W = 2 ranks run part of an epoch, W' = 3 continue from
    one rank's state; the epoch's rays visit every valid pixel exactly once, and the merged
    batches are the reference's (dali_nerf/ops/reference.py masked_pixels)."""
    seed = 11
    print("seed", seed)
    scene = _scene(tmp_path, full=(4,))
    valid = _valid(scene)
    V = int(valid.sum())
    G = 12
    steps = -(-V // G)
    rows, state = [], None
    for W, first, n in ((2, 0, steps // 2), (3, steps // 2, steps - steps // 2)):
        for r in range(W):
            with RayLoader(scene, rays_per_batch=G // W, rank=r, world_size=W, seed=seed, mode="epoch",
                           stream="global", rays_per_run=2 * G // W, num_threads=1) as L:
                if state is not None:
                    L.load_state_dict(state)
                assert L.step == first and L.split_pixels == V
                rows += [next(L) for _ in range(n)]
                if W == 2 and r == 1:
                    state = L.state_dict()
    pos = torch.cat([b["positions"] for b in rows]).numpy()
    ids = _all_valid(scene, rows)
    order = np.argsort(pos)
    assert np.array_equal(pos[order], np.arange(steps * G))
    sizes = (scene.width * scene.height).astype(np.int64)
    assert np.array_equal(ids[order], ref.masked_pixels(seed, "epoch", valid, sizes, np.arange(steps * G)))
    assert np.array_equal(np.sort(ids[order][:V]), np.flatnonzero(valid))


def test_spatial_loader_and_baselines_draw_valid_pixels(tmp_path):
    scene = _scene(tmp_path)
    valid = _valid(scene)
    part = Partition.from_config(PartitionConfig(grid=[2, 1]), scene)
    with SpatialRayLoader(scene, part, 1, rays_per_batch=32, rays_per_run=64, num_threads=1) as L:
        _all_valid(scene, [next(L) for _ in range(3)])
    cache = decode_cache(scene)
    routed = RoutedSyncLocal(scene, part, 0, rays_per_batch=32, cache=cache)
    _all_valid(scene, [next(routed) for _ in range(3)])
    for cls, kw in ((SyncLocalSampler, {}), (SyncGlobalSampler, {}), (TorchWorkersSampler, dict(workers=0))):
        with cls(scene, rays_per_batch=40, mode="random", seed=2, cache=cache, **kw) as src:
            _all_valid(scene, [next(src) for _ in range(3)])
    V = int(valid.sum())
    with SyncLocalSampler(scene, rays_per_batch=V, mode="epoch", seed=3, cache=cache) as src:  # one epoch
        assert len(src) == 1
        assert np.array_equal(np.sort(_all_valid(scene, [next(src)])), np.flatnonzero(valid))


# ------------------------------------------------------------------------------ nerfstudio's mask_path

def _ns_masks(root, n, prescaled_masks=False):
    """Full-size masks (and masks_2/ copies) for make_nerfstudio's frames: values 0, 1, 255."""
    import cv2

    rng = np.random.default_rng(5)
    for j in range(n):
        w, h = (26, 20) if j == 5 else (24, 18)
        m = (rng.integers(0, 3, (h, w)) * [0, 1, 255][1]).astype(np.uint8)
        m[rng.random((h, w)) < 0.3] = 255
        (root / "masks").mkdir(exist_ok=True)
        cv2.imwrite(str(root / "masks" / f"frame_{j:05d}.png"), m)
        if prescaled_masks:
            (root / "masks_2").mkdir(exist_ok=True)
            cv2.imwrite(str(root / "masks_2" / f"frame_{j:05d}.png"), m[::2, ::2])


def test_nerfstudio_mask_path_resized_like_nerfstudio_and_checked(tmp_path):
    """mask_path on every frame: the scene carries the masks; with pre-downscaled images but no
    masks_2/ the full-size masks are resized with PIL's NEAREST (nerfstudio's reading), with
    masks_2/ those are read as they are; a missing mask or a frame without one is one line."""
    import json

    from PIL import Image

    from dali_nerf.errors import SceneError
    from dali_nerf.scenes import load_scene
    from test_scenes import make_nerfstudio

    n = 12
    make_nerfstudio(tmp_path, n=n, prescaled=True,
                    frame_extra={j: {"mask_path": f"masks/frame_{j:05d}.png"} for j in range(n)})
    _ns_masks(tmp_path, n)
    full = load_scene(tmp_path, "train")
    assert full.masked and full.mask_wh[5].tolist() == [26, 20]
    half = load_scene(tmp_path, "train", downscale=2)
    assert half.mask_paths == full.mask_paths and half.file_wh[5].tolist() == [13, 10]
    cache = decode_cache(half)
    for i in range(half.num_images):
        pil = Image.open(half.mask_paths[i])
        want = np.array(pil.resize((int(half.width[i]), int(half.height[i])), resample=Image.NEAREST)) != 0
        assert np.array_equal(cache.image_mask(i), want), i
    _ns_masks(tmp_path, n, prescaled_masks=True)
    half = load_scene(tmp_path, "train", downscale=2)
    assert "masks_2" in half.mask_paths[0] and half.mask_wh[5].tolist() == [13, 10]
    assert np.array_equal(decode_cache(half).image_mask(0), reference_mask(half, 0))
    (tmp_path / "masks" / "frame_00003.png").unlink()
    with pytest.raises(SceneError, match=r"1 of 11 masks missing: .*frame_00003.png"):
        load_scene(tmp_path, "train")
    meta = json.loads((tmp_path / "transforms.json").read_text())
    del meta["frames"][2]["mask_path"]
    (tmp_path / "transforms.json").write_text(json.dumps(meta))
    with pytest.raises(SceneError, match=r"transforms.json: frame 'images/frame_00009.png' has no mask_path"):
        load_scene(tmp_path, "train")


@pytest.mark.parametrize("model", ["OPENCV", "OPENCV_FISHEYE"])
def test_masks_are_undistorted_with_their_images(tmp_path, model):
    """A distorted capture's masks are remapped with the image's maps (nearest): masked dots drawn
    at the distorted positions land on the pinhole projection (within the half pixel nearest
    costs), and a pixel whose source lies outside the file (fisheye's corners) is masked."""
    import json

    import cv2

    from dali_nerf.data.finish import undistort_maps
    from dali_nerf.scenes import load_scene
    from test_lens_downscale import LENSES, PTS, H, W, _centroids, _dots, make_distorted

    coeffs = dict(LENSES)[model] if model == "OPENCV_FISHEYE" else LENSES[0][1]
    uv_dist = make_distorted(tmp_path, model, coeffs, n=2)
    (tmp_path / "masks").mkdir()
    keep = (_dots(uv_dist, W, H, sigma=2.5) > 60).astype(np.uint8) * 255  # blobs of radius ~4 px
    keep[:2, :] = keep[:, :2] = 255  # the file's border rows and columns kept: only outside is masked
    meta = json.loads((tmp_path / "transforms.json").read_text())
    for j, fr in enumerate(meta["frames"]):
        cv2.imwrite(str(tmp_path / "masks" / f"m_{j}.png"), keep)
        fr["mask_path"] = f"masks/m_{j}.png"
    (tmp_path / "transforms.json").write_text(json.dumps(meta))
    scene = load_scene(tmp_path, "train")
    cache = decode_cache(scene)
    k = scene.intrinsics[0].astype(np.float64)
    uv = np.stack([k[0] * PTS[:, 0] / PTS[:, 2] + k[2], k[1] * PTS[:, 1] / PTS[:, 2] + k[3]], 1)
    inside = (uv[:, 0] > 6) & (uv[:, 0] < W - 6) & (uv[:, 1] > 6) & (uv[:, 1] < H - 6)
    m = cache.image_mask(0)
    blobs = np.repeat(m[:, :, None].astype(np.float64), 3, 2)
    err = np.linalg.norm(_centroids(blobs, uv[inside], r=7) - uv[inside], axis=1)
    moved = np.linalg.norm(uv_dist[inside] - uv[inside], axis=1)  # where the dots were drawn: far off
    print(model, "error", err.mean(), err.max(), "distortion", moved.mean(), moved.max())
    assert err.max() < 0.8 and err.mean() < 0.4 and moved.mean() > 2.5 * err.mean(), (err, moved)
    mx, my = undistort_maps(scene, 0)
    outside = (mx < -0.5) | (mx > W - 0.5) | (my < -0.5) | (my > H - 0.5)
    assert not m[outside].any()
    if model == "OPENCV_FISHEYE":
        assert outside.any()


def test_the_fingerprint_names_the_masks(tmp_path):
    """A resume on a split that gained, lost or swapped masks is refused naming it; an unmasked
    split's fingerprint is the one it always had (no masks key)."""
    import dataclasses

    from dali_nerf.scenes import describe_change, scene_fingerprint

    scene = _scene(tmp_path)
    plain = dataclasses.replace(scene, mask_paths=None, mask_wh=None)
    assert "masks" not in scene_fingerprint(plain)
    assert describe_change(scene_fingerprint(plain), scene_fingerprint(scene)) == "masks added"
    swapped = dataclasses.replace(scene, mask_paths=scene.mask_paths[::-1])
    assert describe_change(scene_fingerprint(scene), scene_fingerprint(swapped)).startswith("mask files changed (4 images")


@pytest.mark.parametrize("kind", ["city", "unbounded"])
def test_generated_occluders_are_exactly_their_masks(tmp_path, kind):
    """make-scene --occluders: each image differs from the scene without occluders only where its
    mask is 0 (and there it does differ), and the nerfstudio scene loads with those masks."""
    import cv2

    from dali_nerf.scenegen import make_scene
    from dali_nerf.scenes import load_scene

    kw = dict(width=32, n_train=4, n_val=1, seed=5, image_format="png")
    make_scene(kind, tmp_path / "clean", **kw)
    make_scene(kind, tmp_path / "occl", occluders=True, **kw)
    scene = load_scene(tmp_path / "occl", "train", format="nerfstudio")
    clean = load_scene(tmp_path / "clean", "train", format="nerfstudio")
    assert scene.masked and not clean.masked
    for i in range(scene.num_images):
        a = cv2.imread(scene.image_paths[i], cv2.IMREAD_UNCHANGED)
        b = cv2.imread(clean.image_paths[i], cv2.IMREAD_UNCHANGED)
        keep = reference_mask(scene, i)
        assert (a[keep] == b[keep]).all() and (a[~keep] != b[~keep]).any(axis=-1).mean() > 0.9
        assert 0.05 < (~keep).mean() < 0.35
    with pytest.raises(ConfigError, match="occluders: objects scenes have no mask convention"):
        make_scene("objects", tmp_path / "o", occluders=True, width=16, n_train=2)


def test_validate_checks_the_masks(tmp_path):
    """``dali-nerf validate`` (and the trainers' scan before training) check every mask's header:
    a mask of another size is one line naming it."""
    import cv2

    from dali_nerf.cli.validate import scan_images

    scene = _scene(tmp_path)
    scan_images(scene)
    cv2.imwrite(scene.mask_paths[3], np.zeros((3, 3), np.uint8))
    with pytest.raises(DataError, match=r"mask_003.png: .*3x3"):
        scan_images(scene)


def test_the_ddp_trainer_reports_the_unmasked_psnr(tmp_path):
    """A masked city trained 6 steps by the DDP trainer (1 rank, tiny model): its summary leads with
    the PSNR of the evaluation views' unmasked pixels and keeps the full-image one."""
    import json

    from dali_nerf.scenegen import make_scene
    from test_trainers import TINY_MODEL, run_trainer

    root = make_scene("city", tmp_path / "city", width=32, n_train=6, n_val=2, seed=2, occluders=True)
    common = ["--config", "configs/ss_city.yaml", "method=ddp", f"scene.path={root}", "scene.format=nerfstudio",
              f"train.runs_dir={tmp_path / 'runs'}", "train.steps=6", "train.checkpoint_every=0", "train.eval_images=1",
              "pipeline.rays_per_batch=256", "pipeline.rays_per_run=512", *TINY_MODEL]
    run_trainer("dali_nerf.trainers.ddp", 1, common + ["name=use"])
    s = json.loads((tmp_path / "runs" / "use" / "summary.json").read_text())
    assert s["psnr_lead"] == "unmasked" and s["test_psnr_unmasked"] > 0 and s["test_psnr"] > 0
    assert s["test_psnr_unmasked"] != s["test_psnr"]  # the occluders are in the views, not in the unmasked pixels


def test_scene_masks_ignore_drops_the_training_masks_only(tmp_path):
    from dali_nerf.config import load_config
    from dali_nerf.scenegen import make_scene
    from dali_nerf.scenes import scene_from_config

    root = make_scene("unbounded", tmp_path / "u", width=24, n_train=3, n_val=1, seed=1, occluders=True)
    config = Path(__file__).resolve().parent.parent / "configs" / "ddp_unbounded.yaml"
    cfg = load_config(config, [f"scene.path={root}", "scene.masks=ignore", "scene.eval_split=val"])
    assert not scene_from_config(cfg).masked and scene_from_config(cfg, "val").masked
