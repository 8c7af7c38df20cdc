"""COLMAP scenes: our sparse-model reader against pycolmap (the test extra's oracle), the parser's
conversion (poses, split, camera index, data factors, lenses, a ``masks/`` folder), one-line
refusals, and RayLoader sampling a COLMAP scene."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dali_nerf.errors import SceneError
from dali_nerf.scenes import load_scene
from dali_nerf.scenes.colmap_io import (MODELS, ColmapCamera, ColmapImage, ColmapModel, read_model,
                                        rotation_from_quaternion, write_model)

from _colmap_scene import colmap_scene, random_rotation

SEED = 4101


def _random_model(rng, n_images=12, n_points=30) -> ColmapModel:
    cams = {}
    for cid, name in enumerate(sorted(MODELS), start=3):  # every model COLMAP knows, ids not from 1
        cams[cid] = ColmapCamera(cid, name, int(rng.integers(8, 900)), int(rng.integers(8, 900)),
                                 rng.normal(0, 50, MODELS[name][1]))
    from dali_nerf.scenes.colmap_io import quaternion_from_rotation
    images = [ColmapImage(int(i) * 5 + 2, quaternion_from_rotation(random_rotation(rng)), rng.normal(0, 3, 3),
                          int(rng.choice(list(cams))), f"sub_dir/im_{i}.jpg") for i in rng.permutation(n_images)]
    return ColmapModel(cams, images, rng.permutation(n_points).astype(np.int64) * 11 + 1, rng.normal(0, 4, (n_points, 3)),
                       rng.integers(0, 256, (n_points, 3)).astype(np.uint8), rng.random(n_points))


def _same(a: ColmapModel, b: ColmapModel) -> None:
    assert a.cameras.keys() == b.cameras.keys()
    for k in a.cameras:
        x, y = a.cameras[k], b.cameras[k]
        assert (x.model, x.width, x.height) == (y.model, y.width, y.height) and np.array_equal(x.params, y.params)
    assert [(i.id, i.name, i.camera_id) for i in a.images] == [(i.id, i.name, i.camera_id) for i in b.images]
    assert all(np.array_equal(i.qvec, j.qvec) and np.array_equal(i.tvec, j.tvec) for i, j in zip(a.images, b.images))
    order_a, order_b = np.argsort(a.point_ids), np.argsort(b.point_ids)
    assert np.array_equal(a.point_ids[order_a], b.point_ids[order_b])
    for f in ("xyz", "rgb", "error"):
        assert np.array_equal(getattr(a, f)[order_a], getattr(b, f)[order_b]), f


@pytest.mark.parametrize("fmt", ["bin", "txt"])
def test_reader_agrees_with_pycolmap_both_ways(tmp_path, fmt):
    pycolmap = pytest.importorskip("pycolmap")
    print("seed", SEED)
    rng = np.random.default_rng(SEED)
    model = _random_model(rng)
    write_model(tmp_path / "ours", model, fmt)
    rec = pycolmap.Reconstruction(str(tmp_path / "ours"))
    for cid, cam in model.cameras.items():
        pc = rec.cameras[cid]
        assert (pc.model.name, pc.width, pc.height) == (cam.model, cam.width, cam.height)
        assert np.array_equal(np.asarray(pc.params), cam.params)
    for im in model.images:
        m = rec.images[im.id].cam_from_world().matrix()
        assert rec.images[im.id].name == im.name and rec.images[im.id].camera_id == im.camera_id
        assert np.array_equal(m[:, :3], rotation_from_quaternion(im.qvec)), "rotation not bit-equal to COLMAP's"
        assert np.array_equal(m[:, 3], im.tvec)
    for pid, xyz, rgb, err in zip(model.point_ids, model.xyz, model.rgb, model.error):
        p = rec.points3D[int(pid)]
        assert np.array_equal(p.xyz, xyz) and np.array_equal(p.color, rgb) and p.error == err
    _same(read_model(tmp_path / "ours"), model)
    (tmp_path / "theirs").mkdir()  # what pycolmap writes, our reader reads
    (rec.write_binary if fmt == "bin" else rec.write_text)(str(tmp_path / "theirs"))
    back = read_model(tmp_path / "theirs")
    back.images.sort(key=lambda i: i.id)
    model.images.sort(key=lambda i: i.id)
    _same(back, model)


def test_the_parser_converts_poses_split_and_camera_index(tmp_path):
    print("seed", SEED)
    root = colmap_scene(tmp_path / "s", n=17, width=40, height=24, cameras=2, seed=SEED, fmt="txt")
    model = read_model(root / "sparse" / "0")
    by_name = sorted(model.images, key=lambda i: i.name)
    train, test = load_scene(root, "train"), load_scene(root, "test")
    assert train.format == "colmap" and [p.rsplit("/", 1)[1] for p in test.image_paths] == [by_name[i].name for i in (0, 8, 16)]
    assert train.num_images == 14 and load_scene(root, "val").image_paths == test.image_paths
    held = [i for i in range(17) if i % 8]
    for k, i in enumerate(held):
        im = by_name[i]
        r = rotation_from_quaternion(im.qvec)
        c2w_cv = np.linalg.inv(np.block([[r, im.tvec[:, None]], [np.zeros((1, 3)), np.ones((1, 1))]]))
        assert np.allclose(train.c2w[k][:, :3], c2w_cv[:3, :3] * [1, -1, -1], atol=1e-6)  # OpenGL axes
        assert np.allclose(train.c2w[k][:, 3], c2w_cv[:3, 3], atol=1e-5)
        cam = model.cameras[im.camera_id]
        assert train.camera_idx[k] == im.camera_id - 1 and (train.width[k], train.height[k]) == (cam.width, cam.height)
        assert np.array_equal(train.intrinsics[k], cam.params.astype(np.float32))
    assert np.array_equal(np.sort(train.points, axis=0), np.sort(model.xyz.astype(np.float32), axis=0))
    assert train.points_rgb.shape == train.points.shape and np.array_equal(train.subset([0, 1]).points, train.points)


def test_data_factors_use_images_n_else_downscale_at_decode(tmp_path):
    root = colmap_scene(tmp_path / "s", n=9, width=48, height=32, factors=(2,), seed=SEED, ext=".jpg", factor_ext=".png")
    two = load_scene(root, "train", downscale=2)
    assert all("/images_2/" in p and p.endswith(".png") for p in two.image_paths)  # same stem, other extension
    assert (two.width == 24).all() and (two.file_wh == [24, 16]).all()
    full = load_scene(root, "train")
    assert np.allclose(two.intrinsics, full.intrinsics * np.float32(0.5))
    four = load_scene(root, "train", downscale=4)  # no images_4/: the full files, area-averaged at decode
    assert four.image_paths == full.image_paths and (four.width == 12).all() and (four.file_wh == [48, 32]).all()


@pytest.mark.parametrize("model,params,dist,fisheye", [
    ("SIMPLE_RADIAL", [40, 24, 16, 0.05], [0.05, 0, 0, 0, 0, 0, 0, 0], False),
    ("RADIAL", [40, 24, 16, 0.05, -0.01], [0.05, -0.01, 0, 0, 0, 0, 0, 0], False),
    ("OPENCV", [40, 41, 24, 16, 0.05, -0.01, 0.001, 0.002], [0.05, -0.01, 0.001, 0.002, 0, 0, 0, 0], False),
    ("OPENCV_FISHEYE", [40, 41, 24, 16, 0.05, -0.01, 0.003, 0.001], [0.05, -0.01, 0.003, 0.001, 0, 0, 0, 0], True),
    ("FULL_OPENCV", [40, 41, 24, 16, 0.05, -0.01, 0.001, 0.002, 0.003, 0.01, 0.02, 0.03],
     [0.05, -0.01, 0.001, 0.002, 0.003, 0.01, 0.02, 0.03], False),
])
def test_distorted_models_become_opencv_lenses(tmp_path, model, params, dist, fisheye):
    root = colmap_scene(tmp_path / "s", n=9, width=48, height=32, model=model, params=params, factors=(), seed=SEED)
    s = load_scene(root, "train")
    assert s.distorted.all() and (s.fisheye == fisheye).all()
    assert np.array_equal(s.distortion[0], np.array(dist, np.float64))
    two = model in ("OPENCV", "OPENCV_FISHEYE", "FULL_OPENCV")  # fx, fy; else one f
    k = (params[:2] if two else [params[0]] * 2) + params[2 if two else 1:][:2]
    assert np.array_equal(s.file_intrinsics[0], k)


def test_unsupported_models_and_damaged_files_are_one_line_errors(tmp_path):
    root = colmap_scene(tmp_path / "fov", n=9, factors=(), seed=SEED)
    model = read_model(root / "sparse" / "0")
    model.cameras[1] = ColmapCamera(1, "FOV", 48, 32, np.array([40.0, 40, 24, 16, 0.1]))
    write_model(root / "sparse" / "0", model)
    with pytest.raises(SceneError, match=r"cameras\.bin: camera 1 has model FOV, which is not supported") as e:
        load_scene(root, "train")
    assert "\n" not in str(e.value)
    data = (root / "sparse" / "0" / "images.bin").read_bytes()
    (root / "sparse" / "0" / "images.bin").write_bytes(data[:-30])
    with pytest.raises(SceneError, match=r"images\.bin: truncated at byte \d+"):
        load_scene(root, "train")
    bad = colmap_scene(tmp_path / "missing", n=9, factors=(), seed=SEED)
    (bad / "images" / "img_003.png").unlink()
    with pytest.raises(SceneError, match=r"1 of 7 images missing: .*img_003\.png"):
        load_scene(bad, "train")
    (bad / "sparse" / "0" / "points3D.bin").unlink()
    with pytest.raises(SceneError, match="unknown scene format"):
        load_scene(bad, "train")


def test_generated_colmap_scene_keeps_the_generators_cameras(tmp_path):
    from dali_nerf.scenegen import make_scene, scene_cameras

    out = make_scene("objects", tmp_path / "o", width=32, n_train=9, n_val=2, n_test=2, seed=3, layout="colmap",
                     camera_model="SIMPLE_PINHOLE")
    cams = scene_cameras("objects", width=32, n_train=9, n_val=2, n_test=2, seed=3)
    views = np.concatenate([cams[s]["c2w"] for s in ("train", "val", "test")])
    train, test = load_scene(out, "train"), load_scene(out, "test")
    assert train.num_images + test.num_images == 13
    assert np.allclose(test.c2w, views[::8], atol=1e-5)
    assert np.allclose(train.c2w, views[[i for i in range(13) if i % 8]], atol=1e-5)
    assert (train.width == 32).all() and train.points.shape[1] == 3 and len(train.points) > 100
    assert load_scene(out, "train", downscale=4).image_paths[0].endswith("images_4/frame_00001.png")


def test_the_colmap_layout_refuses_occluders_in_one_line(tmp_path):
    """The COLMAP writer writes no masks: ``--occluders`` with ``--format colmap`` is refused before
    anything is rendered or written."""
    from dali_nerf.errors import ConfigError
    from dali_nerf.scenegen import make_scene

    with pytest.raises(ConfigError, match=r"occluders: the colmap layout writes no masks") as e:
        make_scene("city", tmp_path / "c", width=16, n_train=2, seed=1, layout="colmap", occluders=True)
    assert "\n" not in str(e.value) and not (tmp_path / "c").exists()


def test_rayloader_samples_a_colmap_scene(tmp_path):
    import cv2
    from dali_nerf import RayLoader

    root = colmap_scene(tmp_path / "s", n=9, width=40, height=24, factors=(), seed=SEED)
    scene = load_scene(root, "train")
    with RayLoader(scene, rays_per_batch=64, seed=1, prefetch=1, num_threads=1, rays_per_run=256) as ld:
        b = next(ld)
    imgs = [cv2.cvtColor(cv2.imread(p), cv2.COLOR_BGR2RGB) for p in scene.image_paths]
    idx = b["indices"].numpy()
    want = np.stack([imgs[c][r, q] for c, r, q in idx]).astype(np.float32) / 255.0
    assert np.allclose(b["rgb"].numpy(), want, atol=1e-6)


def test_a_masks_folder_gives_every_image_its_mask(tmp_path):
    """``masks/`` beside ``images/``: COLMAP's ``<name>.png`` or nerfstudio's ``<stem>.png``; the
    image loader's batches and the ray loader's rays honour them; ``images_2/`` without
    ``masks_2/`` takes the full-size masks; an image without a mask is one line naming it."""
    import cv2

    from dali_nerf import RayLoader
    from dali_nerf.sources.images import ImageLoader

    seed = 4111
    print("seed", seed)
    rng = np.random.default_rng(seed)
    root = colmap_scene(tmp_path / "s", n=9, width=40, height=24, factors=(2,), seed=seed, ext=".jpg")
    (root / "masks").mkdir()
    want = {}
    for i, img in enumerate(sorted((root / "images").iterdir())):
        m = (rng.random((24, 40)) > 0.3).astype(np.uint8) * 255
        name = img.name + ".png" if i % 2 else img.stem + ".png"  # COLMAP's, nerfstudio's
        cv2.imwrite(str(root / "masks" / name), m)
        want[img.name] = (str(root / "masks" / name), m != 0)
    scene = load_scene(root, "train")
    names = [os.path.basename(p) for p in scene.image_paths]
    assert list(scene.mask_paths) == [want[n][0] for n in names] and (scene.mask_wh == [40, 24]).all()
    with ImageLoader(scene, seed=seed, num_threads=1) as ld:
        for _ in range(scene.num_images):
            b = next(ld)
            j = int(b["image_id"][0])
            assert np.array_equal(b["mask"][0].numpy(), want[names[j]][1]), (seed, j)
    with RayLoader(scene, rays_per_batch=256, seed=seed, prefetch=1, num_threads=1, rays_per_run=256) as ld:
        idx = next(ld)["indices"].numpy()
    assert all(want[names[c]][1][r, q] for c, r, q in idx), seed
    two = load_scene(root, "train", downscale=2)  # images_2/ without masks_2/: the full masks, resized at decode
    assert all("/images_2/" in p for p in two.image_paths) and list(two.mask_paths) == list(scene.mask_paths)
    os.remove(want[names[3]][0])
    with pytest.raises(SceneError, match=r"masks/img_\S+\.jpg\.png: mask not found") as e:
        load_scene(root, "train")
    assert "\n" not in str(e.value)
