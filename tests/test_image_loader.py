"""ImageLoader: gsplat's batch contract on COLMAP scenes (PINHOLE / SIMPLE_PINHOLE, PNG, data
factors 1/2/4, whole images and patches) against gsplat's Dataset re-derived in
tests/_gsplat_reference.py; distorted cameras against a cv2 projection; the epoch's coverage
through the loader (windows, resume on another world size); masks (each image's mask file, cropped
with its patch; none with ``scene.masks: ignore``); refusals. (The node's shared memory:
tests/test_nodeshare.py; two ranks of a node sharing a loader's images: the splat trainer's test.)"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from dali_nerf.errors import ConfigError
from dali_nerf.scenes import load_scene
from dali_nerf.sources.images import IMAGE_KEYS, MASKED_KEYS, ImageLoader

from _colmap_scene import colmap_scene
from _gsplat_reference import GsplatReference

SEED = 4103
REPO = Path(__file__).resolve().parent.parent


def _loader(scene, **kw):
    kw.setdefault("num_threads", 1)
    return ImageLoader(scene, **kw)


@pytest.mark.parametrize("model", ["PINHOLE", "SIMPLE_PINHOLE"])
def test_batches_equal_gsplats_dataset(tmp_path, model):
    print("seed", SEED)
    root = colmap_scene(tmp_path / "s", n=17, width=48, height=32, model=model, factors=(2, 4), seed=SEED)
    for factor, batch, patch in ((1, 2, None), (2, 1, None), (4, 2, None), (1, 2, 9), (2, 1, 5), (4, 1, 4)):
        ref = GsplatReference(root, factor)
        scene = load_scene(root, "train", format="colmap", downscale=factor)
        seen = []
        with _loader(scene, images_per_batch=batch, seed=SEED + factor, patch_size=patch) as ld:
            for _ in range(-(-len(ref) // batch)):
                b = next(ld)
                assert tuple(b) == IMAGE_KEYS, tuple(b)
                h = patch or 32 // factor
                w = patch or 48 // factor
                assert b["image"].shape == (batch, h, w, 3) and b["image"].dtype == torch.uint8
                assert b["K"].shape == (batch, 3, 3) and b["camtoworld"].shape == (batch, 4, 4)
                assert b["K"].dtype == b["camtoworld"].dtype == torch.float32
                assert b["image_id"].dtype == b["camera_idx"].dtype == torch.int64
                for i in range(batch):
                    item = int(b["image_id"][i])
                    seen.append(item)
                    corner = None
                    if patch:  # the loader's corner, read back from its principal point
                        full = ref.ks[ref.camera_ids[ref.indices[item]]]
                        corner = (int(round(full[0, 2] - float(b["K"][i, 0, 2]))), int(round(full[1, 2] - float(b["K"][i, 1, 2]))))
                    want = ref.item(item, corner, patch)
                    got = {k: v[i].numpy() for k, v in b.items()}
                    assert np.array_equal(got["image"].astype(np.float32), want["image"]), (factor, patch, item)
                    assert np.array_equal(got["camtoworld"], want["camtoworld"]), (factor, item)
                    # K: gsplat subtracts the corner in float64 before the cast, we in float32 (1 ulp at most)
                    assert np.allclose(got["K"], want["K"], rtol=0, atol=np.spacing(np.float32(64.0))), (factor, patch)
                    if not patch:
                        assert np.array_equal(got["K"], want["K"])
                    assert got["camera_idx"] == want["camera_idx"]
        assert sorted(seen) == list(range(len(ref))), (factor, patch)  # one epoch: every image once


def test_several_cameras_keep_gsplats_camera_index(tmp_path):
    root = colmap_scene(tmp_path / "s", n=12, width=40, height=24, cameras=3, factors=(), seed=SEED)
    ref = GsplatReference(root, 1)
    with _loader(load_scene(root, "train", format="colmap"), seed=1) as ld:
        for _ in range(len(ref)):
            b = next(ld)
            item = int(b["image_id"][0])
            want = ref.item(item)
            assert int(b["camera_idx"][0]) == want["camera_idx"] and b["image"].shape[1:3] == want["image"].shape[:2]
            assert np.array_equal(b["K"][0].numpy(), want["K"])
    with pytest.raises(ConfigError, match="images_per_batch=2: the split's images differ in size"):
        _loader(load_scene(root, "train", format="colmap"), images_per_batch=2)


def _blobs(size, points, sigma=1.2):
    """(h, w, 3) uint8: a white Gaussian dot at each (x, y) (OpenCV pixel coordinates)."""
    w, h = size
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.zeros((h, w))
    for x, y in points:
        img += np.exp(-((xs - x) ** 2 + (ys - y) ** 2) / (2 * sigma ** 2))
    return np.repeat(np.clip(img * 255, 0, 255).round().astype(np.uint8)[..., None], 3, 2)


@pytest.mark.parametrize("model,params", [
    ("OPENCV", [70.0, 72.0, 48.3, 36.2, -0.12, 0.03, 0.002, -0.001]),
    ("SIMPLE_RADIAL", [70.0, 48.3, 36.2, -0.1]),
    ("OPENCV_FISHEYE", [60.0, 61.0, 48.3, 36.2, 0.05, -0.02, 0.004, 0.0]),
])
def test_distorted_cameras_against_a_cv2_projection(tmp_path, model, params):
    """Dots projected with the distortion model (cv2.projectPoints / cv2.fisheye.projectPoints)
    land, after the loader's undistortion, where the batch's pinhole K puts them: within 0.1 px
    (centroids of the dots; bilinear resampling)."""
    root = colmap_scene(tmp_path / "s", n=9, width=96, height=72, model=model, params=params, factors=(), seed=SEED)
    rng = np.random.default_rng(SEED)
    grid = np.stack(np.meshgrid(np.linspace(-0.45, 0.45, 5), np.linspace(-0.32, 0.32, 4)), -1).reshape(-1, 2)
    pts = np.concatenate([grid + rng.uniform(-0.02, 0.02, grid.shape), np.ones((len(grid), 1))], 1)  # z = 1
    simple = model == "SIMPLE_RADIAL"
    fx, fy = (params[0], params[0]) if simple else params[:2]
    cx, cy = params[1:3] if simple else params[2:4]
    kcv = np.array([[fx, 0, cx - 0.5], [0, fy, cy - 0.5], [0, 0, 1.0]])  # OpenCV's centres at integers
    dist = np.zeros(5)
    extra = params[3:] if simple else params[4:]
    dist[:len(extra)] = extra
    if model == "OPENCV_FISHEYE":
        uv = cv2.fisheye.projectPoints(pts[None], np.zeros(3), np.zeros(3), kcv, np.array(extra))[0].reshape(-1, 2)
    else:
        uv = cv2.projectPoints(pts, np.zeros(3), np.zeros(3), kcv, dist)[0].reshape(-1, 2)
    for p in sorted((root / "images").iterdir()):
        cv2.imwrite(str(p), _blobs((96, 72), uv))
    scene = load_scene(root, "train", format="colmap")
    assert scene.distorted.all()
    with _loader(scene, seed=2) as ld:
        b = next(ld)
    img = b["image"][0, :, :, 0].numpy().astype(np.float64)
    k = b["K"][0].numpy().astype(np.float64)
    want = (k @ pts.T).T[:, :2]  # our convention: centres at +0.5
    found = 0
    for x, y in want:
        x0, y0 = int(round(x - 0.5)), int(round(y - 0.5))
        if not (4 <= x0 < 92 and 4 <= y0 < 68):
            continue  # the alpha = 0 crop dropped it
        win = img[y0 - 3:y0 + 4, x0 - 3:x0 + 4]
        ys, xs = np.mgrid[y0 - 3:y0 + 4, x0 - 3:x0 + 4] + 0.5
        cxy = np.array([(win * xs).sum(), (win * ys).sum()]) / win.sum()
        assert np.abs(cxy - [x, y]).max() < 0.1, (model, cxy, (x, y))
        found += 1
    assert found >= 8


def _epoch_check(ids, n):
    for e in range(len(ids) // n):
        assert sorted(ids[e * n:(e + 1) * n]) == list(range(n)), e


def test_coverage_through_the_loader_with_windows_and_an_elastic_resume(tmp_path):
    """Two ranks (B = 2) for 5 steps, then the state continued by three ranks (B = 1) through
    windows of 3 images: every image exactly once in each epoch of the global stream."""
    root = colmap_scene(tmp_path / "s", n=14, width=24, height=16, factors=(), seed=SEED)
    scene = load_scene(root, "train", format="colmap")
    n, px = scene.num_images, 24 * 16 * 3
    stream = []
    loaders = [_loader(scene, images_per_batch=2, rank=r, world_size=2, seed=7) for r in range(2)]
    for _ in range(5):
        for ld in loaders:
            stream += next(ld)["image_id"].tolist()
    state = loaders[0].state_dict()
    assert state["position"] == 20 and state["window"] == 0
    for ld in loaders:
        ld.close()
    loaders = [_loader(scene, images_per_batch=1, rank=r, world_size=3, seed=7, max_bytes=6 * px) for r in range(3)]
    for ld in loaders:
        ld.load_state_dict(state)
    for _ in range(12):
        for ld in loaders:
            stream += next(ld)["image_id"].tolist()
    s = loaders[0].stats()
    assert s["window"] == 3 and s["peak_bytes"] <= 6 * px
    for ld in loaders:
        ld.close()
    assert len(stream) == 56
    _epoch_check(stream, n)


def test_set_step_places_the_stream_at_a_global_step(tmp_path):
    """set_step(s): the next batch is this rank's part of global step s of the seed's stream, on any
    number of ranks (how a trainer that keeps only its step count resumes, e.g. nerfstudio's)."""
    root = colmap_scene(tmp_path / "s", n=10, width=24, height=16, factors=(), seed=SEED)
    scene = load_scene(root, "train", format="colmap")
    with _loader(scene, seed=7) as a:  # one rank, B = 1: global step p is stream position p
        ids = [int(next(a)["image_id"][0]) for _ in range(14)]
    _epoch_check(ids, scene.num_images)
    with _loader(scene, seed=7) as b:
        b.set_step(9)
        assert b.step == 9
        assert [int(next(b)["image_id"][0]) for _ in range(5)] == ids[9:14]
        assert b.step == 14
        b.set_step(2)  # back again, past batches already built
        assert int(next(b)["image_id"][0]) == ids[2]
        with pytest.raises(ConfigError, match="set_step: step"):
            b.set_step(-1)
    two = [_loader(scene, seed=7, rank=r, world_size=2) for r in range(2)]
    for ld in two:
        ld.set_step(3)  # G = 2: positions 6 and 7
    assert [int(next(ld)["image_id"][0]) for ld in two] == ids[6:8]
    for ld in two:
        ld.close()


def test_refusals_are_one_line(tmp_path):
    root = colmap_scene(tmp_path / "s", n=9, width=24, height=16, factors=(), seed=SEED)
    scene = load_scene(root, "train", format="colmap")
    with pytest.raises(ConfigError, match="patch_size=20: .* is 24x16, smaller than a patch"):
        _loader(scene, patch_size=20)
    with pytest.raises(ConfigError, match="max_bytes=100: two windows of one step's 2 images need 4608 bytes"):
        _loader(scene, images_per_batch=2, max_bytes=100)
    with pytest.raises(ConfigError, match="2 local ranks share the decoded images but no share_key"):
        _loader(scene, local_rank=0, local_world_size=2)
    with _loader(scene, seed=1) as a:
        next(a)
        st = a.state_dict()
    with pytest.raises(ConfigError, match="the state has seed=1, this loader 2"):
        _loader(scene, seed=2).load_state_dict(st)
    other = load_scene(colmap_scene(tmp_path / "o", n=10, width=24, height=16, factors=(), seed=1), "train")
    with pytest.raises(ConfigError, match="saved from another scene"):
        _loader(other, seed=1).load_state_dict(st)


def _mask_file(path) -> np.ndarray:
    """(H, W) bool of a mask file read independently of the loader (nonzero = keep)."""
    return cv2.imread(str(path), cv2.IMREAD_UNCHANGED) != 0


def test_masked_batches_carry_each_images_mask(tmp_path):
    """A masked scene's batches add ``mask`` (B, H, W) bool, equal to the image's mask file for every
    image of two epochs: two ranks through windows whose budget counts the mask byte, then resumed on
    one rank with patches (the mask cropped where the image is, the corner read from K)."""
    from dali_nerf.scenegen import make_scene

    seed = 4113
    print("seed", seed)
    root = make_scene("city", tmp_path / "m", width=32, n_train=7, n_val=1, n_test=0, seed=seed, occluders=True)
    scene = load_scene(root, "train")
    n, per = scene.num_images, 32 * 24 * 4  # a pixel: 3 bytes and its mask's
    masks = [_mask_file(p) for p in scene.mask_paths]
    assert scene.width[0] == 32 and all(m.shape == (24, 32) for m in masks) and not all(m.all() for m in masks)
    pix = [cv2.imread(p, cv2.IMREAD_COLOR)[:, :, ::-1] for p in scene.image_paths]  # opaque PNGs: RGB as stored
    ids = []
    loaders = [_loader(scene, rank=r, world_size=2, seed=seed, max_bytes=6 * per) for r in range(2)]
    for _ in range(4):
        for ld in loaders:
            b = next(ld)
            assert tuple(b) == MASKED_KEYS and b["mask"].dtype == torch.bool and b["mask"].shape == (1, 24, 32)
            for i, j in enumerate(b["image_id"].tolist()):
                assert np.array_equal(b["mask"][i].numpy(), masks[j]), (seed, j)
                assert np.array_equal(b["image"][i].numpy(), pix[j]), (seed, j)
                ids.append(j)
    st = loaders[0].state_dict()
    s = loaders[0].stats()
    assert loaders[0].window == 3 and s["peak_bytes"] <= 6 * per  # two windows of 3 (without the masks: all 7 kept)
    for ld in loaders:
        ld.close()
    with _loader(scene, images_per_batch=1, seed=seed, patch_size=9) as ld:
        ld.load_state_dict(st)
        for _ in range(n + 1):
            b = next(ld)
            j = int(b["image_id"][0])
            x, y = (int(round(float(scene.intrinsics[j, 2 + c]) - float(b["K"][0, c, 2]))) for c in (0, 1))
            assert b["mask"].shape == (1, 9, 9), b["mask"].shape
            assert np.array_equal(b["mask"][0].numpy(), masks[j][y:y + 9, x:x + 9]), (seed, j, x, y)
            assert np.array_equal(b["image"][0].numpy(), pix[j][y:y + 9, x:x + 9]), (seed, j, x, y)
            ids.append(j)
    _epoch_check(ids, n)


def test_masks_ignore_gives_batches_without_a_mask(tmp_path):
    from dali_nerf.config import load_config
    from dali_nerf.scenegen import make_scene
    from dali_nerf.scenes import scene_from_config

    root = make_scene("city", tmp_path / "m", width=16, n_train=2, n_val=1, n_test=0, seed=SEED, occluders=True)
    for mode, keys in (("ignore", IMAGE_KEYS), ("use", MASKED_KEYS)):
        cfg = load_config("splat_objects", [f"scene.path={root}", "scene.format=auto", f"scene.masks={mode}"])
        with _loader(scene_from_config(cfg)) as ld:
            assert tuple(next(ld)) == keys, mode


def _batches(ld, steps):
    return [{k: v.clone() for k, v in next(ld).items()} for _ in range(steps)]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert tuple(x) == tuple(y) and all(torch.equal(x[k], y[k]) for k in x)


def _wait_closed(ld, limit_s=120.0):
    import time

    deadline = time.monotonic() + limit_s
    while not ld.stats()["decode_closed"]:
        assert time.monotonic() < deadline, "the loader never reported its decode closed"
        time.sleep(0.01)


def test_the_decode_is_released_once_the_split_is_held(tmp_path, monkeypatch):
    """Kept whole, the split is decoded in DALI runs cut by bytes (two images a run here, of
    decode batches of 8): every image bit for bit gsplat's; once every image is held the loader
    reports its decode closed (the store's thread gone, its memory given back), and a resume or
    ``set_epoch`` after that gives the batches the loader gave before it from the same store, with
    nothing decoded again. Through windows the decode goes on (never closed), with the same pixels,
    and a seek builds a store there."""
    import threading

    from dali_nerf.data import imagestore

    print("seed", SEED)
    monkeypatch.setattr(imagestore, "DECODE_RUN_BYTES", 2 * 48 * 32 * 3)
    root = colmap_scene(tmp_path / "s", n=16, width=48, height=32, factors=(), seed=SEED)
    scene, ref = load_scene(root, "train", format="colmap"), GsplatReference(root, 1)
    n = scene.num_images
    assert imagestore.decode_run_images(scene, threads=1, batch=8) == 2
    with _loader(scene, seed=SEED, decode_batch=4) as ld:
        first = _batches(ld, 3)
        state = ld.state_dict()  # saved while the split is still being decoded
        rest = _batches(ld, 2 * n - 3)  # through epoch 0 and all of epoch 1
        assert ld.epoch == 2
        _wait_closed(ld)  # the store's thread releases right after its last image: a moment later
        store = ld.producer._live
        assert store.run_images == 2  # the DALI runs the store decoded with, cut by bytes
        assert store.released["malloc_trim"] or not hasattr(__import__("ctypes").CDLL(None), "malloc_trim")
        store._thread.join(10.0)  # complete is the thread's last step: it ends right after
        assert not any(t.name == "dali_nerf-image-windows" and t.is_alive() for t in threading.enumerate())
        for b in first + rest:
            item = int(b["image_id"][0])
            assert np.array_equal(b["image"][0].numpy().astype(np.float32), ref.item(item)["image"]), item
        decoded = ld.stats()["decode_s"]
        assert ld.producer.builds == 1
        ld.load_state_dict(state)  # a seek goes on with the held split: nothing decoded again
        _same(_batches(ld, 2 * n - 3), rest)
        ld.set_epoch(1)
        _same(_batches(ld, n), rest[n - 3:])
        s = ld.stats()
        assert ld.producer.builds == 1 and ld.producer._live is store and s["decode_closed"], s
        assert s["decode_s"] == decoded, (s["decode_s"], decoded)
    assert ld.producer._live is None and not store._chunks  # closed with the loader: its blocks released
    pixels = {int(b["image_id"][0]): b["image"] for b in first + rest}
    with _loader(scene, seed=SEED, max_bytes=6 * 48 * 32 * 3) as ld:  # windows of 3 images
        for b in _batches(ld, 2 * n):
            assert torch.equal(b["image"], pixels[int(b["image_id"][0])])
        s = ld.stats()
        assert s["window"] == 3 and not s["decode_closed"]
        ld.set_epoch(1)  # through windows a seek builds a store there
        for b in _batches(ld, n):
            assert torch.equal(b["image"], pixels[int(b["image_id"][0])])
        assert ld.producer.builds == 2


def test_a_seek_while_the_split_is_still_decoding_keeps_the_store(tmp_path, monkeypatch):
    """Kept whole, a seek while the store still decodes (its second chunk held back here until the
    seek has begun) goes on with the same store: no second build, and the batches after it are
    gsplat's images at the new positions, served as the decode reaches them."""
    import threading

    from dali_nerf.data import imagestore

    print("seed", SEED)
    root = colmap_scene(tmp_path / "s", n=16, width=48, height=32, factors=(), seed=SEED)
    scene, ref = load_scene(root, "train", format="colmap"), GsplatReference(root, 1)
    n = scene.num_images
    go, decode = threading.Event(), imagestore.ImageStore._decode

    def held(self, chunk):
        if not chunk.name.endswith("all0"):  # every chunk after the first waits for the test
            assert go.wait(120), "the test never let the decode go on"
        return decode(self, chunk)

    monkeypatch.setattr(imagestore.ImageStore, "_decode", held)
    with _loader(scene, seed=SEED, decode_batch=2, prefetch=1) as ld:
        _batches(ld, 1)
        assert not ld.stats()["decode_closed"] and ld.producer.builds == 1
        # the run-ahead thread waits for the held chunk: let the decode go on a moment into the seek
        # (the seek stops that thread first, which waits for its images)
        threading.Timer(0.2, go.set).start()
        ld.set_epoch(1)
        after = _batches(ld, n)
        assert ld.producer.builds == 1
    for b in after:
        item = int(b["image_id"][0])
        assert np.array_equal(b["image"][0].numpy().astype(np.float32), ref.item(item)["image"]), item
    assert sorted(int(b["image_id"][0]) for b in after) == list(range(n))  # epoch 1, each image once


def test_the_first_chunk_is_the_first_runs_images(tmp_path):
    """Kept whole, the first chunk the store decodes is the first run's images alone (G = B x W
    images a step, ``prefetch`` steps a run: the first batch is handed over with its run, and waits
    for those images, not for the next chunk of decode_batch x local ranks), then chunks of the
    window; every image once; the batches as gsplat's, from a start at 0 and mid-epoch."""
    print("seed", SEED)
    root = colmap_scene(tmp_path / "s", n=16, width=48, height=32, factors=(), seed=SEED)
    scene, ref = load_scene(root, "train", format="colmap"), GsplatReference(root, 1)
    n = scene.num_images
    for start_step in (0, 2, 3):  # 3: the step across the end of the epoch (positions 12-15 of 14)
        with _loader(scene, seed=SEED, images_per_batch=2, world_size=2, rank=1, decode_batch=10, prefetch=2) as ld:
            if start_step:
                ld.load_state_dict({**ld.state_dict(), "position": 2 * 2 * start_step})
            b = _batches(ld, 1)[0]
            store = ld.producer._live
            chunks = store._keep_all_chunks(2 * 2 * start_step)
            with store._cv:  # the chunk the store decoded first is that one
                assert np.array_equal(store._chunks[0].ids, chunks[0])
            assert store.window == 10 and [len(c) for c in chunks] == [8, n - 8], (store.window, n)
            run = ld.producer.stream.images(np.arange(4 * start_step, 4 * start_step + 8))
            # the run's images (a run across the epoch's end may hold an image twice: the first
            # chunk is the first 8 distinct images from the start, so it holds them all)
            assert set(run.tolist()) <= set(chunks[0].tolist())
            assert sorted(np.concatenate(chunks).tolist()) == list(range(n))
            for i in range(2):
                item = int(b["image_id"][i])
                assert np.array_equal(b["image"][i].numpy().astype(np.float32), ref.item(item)["image"]), item
