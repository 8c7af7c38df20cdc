"""Scene parsers against independent references.

For each format we write a tiny scene in tmp_path with cameras in THAT format's own convention
(OpenGL for Blender / nerfstudio, [down, right, back] for LLFF, DRB for Mega-NeRF), project known
3-D points with the format's own camera model, parse with ``load_scene`` and check that the ray
of the parsed camera through the projected pixel passes through the point mapped by
``world_from_source``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from dali_nerf.errors import SceneError
from dali_nerf.data.rays import rays_from_indices
from dali_nerf.scenes import detect_format, load_scene

RNG = np.random.default_rng(0)
POINTS = np.array([[0.3, -0.2, 0.1], [-0.25, 0.15, -0.1], [0.0, 0.0, 0.0]])


# ---------------------------------------------------------------- helpers ------------------------
def write_png(path: Path, w: int, h: int, channels: int = 3):
    path.parent.mkdir(parents=True, exist_ok=True)
    img = RNG.integers(0, 255, (h, w, channels), dtype=np.uint8)
    assert cv2.imwrite(str(path), img)


def look_at_gl(pos, target, up) -> np.ndarray:
    """OpenGL c2w (3, 4): columns right, up, back, position."""
    pos, target, up = (np.asarray(v, np.float64) for v in (pos, target, up))
    back = pos - target
    back /= np.linalg.norm(back)
    right = np.cross(up, back)
    right /= np.linalg.norm(right)
    cam_up = np.cross(back, right)
    return np.stack([right, cam_up, back, pos], axis=1)


def project_gl(c2w, k, x):
    """Pixel coordinates (u, v) of world point x in an OpenGL camera (continuous, +0.5 centres)."""
    xc = c2w[:, :3].T @ (x - c2w[:, 3])
    assert xc[2] < 0, "point behind the camera"
    return k[2] + k[0] * xc[0] / -xc[2], k[3] - k[1] * xc[1] / -xc[2]


def project_drb(c2w, k, x):
    """(u, v) in a camera whose c2w columns are [down, right, back] (LLFF / Mega-NeRF)."""
    xc = c2w[:, :3].T @ (x - c2w[:, 3])  # (down, right, back)
    assert xc[2] < 0
    return k[2] + k[0] * xc[1] / -xc[2], k[3] + k[1] * xc[0] / -xc[2]


def ray_miss(scene, i, u, v, x_world) -> float:
    """Distance from x_world to the parsed camera i's ray through continuous pixel (u, v), relative
    to the distance of the point from the camera. Uses rays_from_indices on the pixel containing
    (u, v), with the principal point shifted by the sub-pixel offset so the pixel centre is (u, v)."""
    col, row = int(math.floor(u)), int(math.floor(v))
    assert 0 <= col < scene.width[i] and 0 <= row < scene.height[i], (u, v)
    k = torch.tensor(scene.intrinsics, dtype=torch.float64)
    k[i, 2] += col + 0.5 - u
    k[i, 3] += row + 0.5 - v
    o, d = rays_from_indices(torch.tensor(scene.c2w, dtype=torch.float64), k, torch.tensor([[i, row, col]]))
    o, d = o[0].numpy(), d[0].numpy()
    p = x_world - o
    return float(np.linalg.norm(p - (p @ d) * d) / np.linalg.norm(p))


def to_world(scene, x_source):
    return (scene.world_from_source @ np.append(x_source, 1.0))[:3]


def assert_one_line(err, *needles):
    msg = str(err.value)
    assert "\n" not in msg
    for n in needles:
        assert str(n) in msg, (n, msg)


# ---------------------------------------------------------------- Blender ------------------------
BW, BH, BANGLE = 25, 18, 0.9


def blender_cams(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for j in range(n):
        az, el = 2 * np.pi * j / n + rng.uniform(0, 0.3), rng.uniform(0.2, 0.8)
        pos = 4.0 * np.array([np.cos(az) * np.cos(el), np.sin(az) * np.cos(el), np.sin(el)])
        out.append(look_at_gl(pos, rng.uniform(-0.05, 0.05, 3), [0, 0, 1]))
    return out


def make_blender(root: Path, n_train=4, n_test=2, extra=None, ext=""):
    cams = {"train": blender_cams(n_train, 1), "val": blender_cams(2, 2), "test": blender_cams(n_test, 3)}
    for split, cs in cams.items():
        frames = []
        for j, c in enumerate(cs):
            write_png(root / split / f"r_{j}.png", BW, BH, 4)
            m = np.eye(4)
            m[:3] = c
            frames.append({"file_path": f"./{split}/r_{j}{ext}", "rotation": 0.0, "transform_matrix": m.tolist()})
        meta = {"camera_angle_x": BANGLE, "frames": frames, **(extra or {})}
        (root / f"transforms_{split}.json").write_text(json.dumps(meta, indent=2))
    return cams


@pytest.mark.parametrize("downscale", [1, 2])
def test_blender_rays_hit_points(tmp_path, downscale):
    cams = make_blender(tmp_path)
    assert detect_format(tmp_path) == "blender"
    scene = load_scene(tmp_path, "train", downscale=downscale)
    assert scene.format == "blender" and scene.num_images == 4
    w2, h2 = BW // downscale, BH // downscale
    assert (scene.width == w2).all() and (scene.height == h2).all()
    assert (scene.file_wh == [BW, BH]).all()
    f = 0.5 * BW / math.tan(0.5 * BANGLE)
    k_src = np.array([f, f, BW / 2, BH / 2])
    np.testing.assert_allclose(scene.near, 2.0)
    np.testing.assert_allclose(scene.far, 6.0)
    np.testing.assert_allclose(scene.up, [0, 0, 1])
    np.testing.assert_allclose(scene.aabb, [[-1.5] * 3, [1.5] * 3])
    for i, c in enumerate(cams["train"]):
        for x in POINTS:
            u, v = project_gl(c, k_src, x)
            u, v = u * w2 / BW, v * h2 / BH  # the image is resized to w2 x h2
            assert ray_miss(scene, i, u, v, to_world(scene, x)) < 1e-4


def test_blender_splits_keys_and_extensions(tmp_path):
    make_blender(tmp_path, extra={"near": 0.5, "far": 3.0, "aabb": [[-1, -2, -3], [1, 2, 3]]}, ext=".png")
    s = load_scene(tmp_path, "test")
    assert s.num_images == 2 and s.split == "test"
    assert s.image_paths[1].endswith("test/r_1.png")
    np.testing.assert_allclose(s.near, 0.5)
    np.testing.assert_allclose(s.far, 3.0)
    np.testing.assert_allclose(s.aabb, [[-1, -2, -3], [1, 2, 3]])
    sub = s.subset([1])
    assert sub.num_images == 1 and sub.file_wh.shape == (1, 2)


def _edit_json(path: Path, fn):
    meta = json.loads(path.read_text())
    fn(meta)
    path.write_text(json.dumps(meta))


def test_blender_errors(tmp_path):
    make_blender(tmp_path)
    tj = tmp_path / "transforms_train.json"
    good = tj.read_text()

    def expect(fn, *needles):
        tj.write_text(good)
        _edit_json(tj, fn)
        with pytest.raises(SceneError) as e:
            load_scene(tmp_path, "train")
        assert_one_line(e, *needles)

    expect(lambda m: m.pop("camera_angle_x"), "camera_angle_x", "transforms_train.json")
    expect(lambda m: m["frames"][1].pop("transform_matrix"), "transform_matrix", "frames[1]")
    expect(lambda m: m["frames"][2]["transform_matrix"][0].__setitem__(0, float("nan")), "non-finite", "r_2")

    def scale(m):
        for r in range(3):  # column 0 scaled by 1.01: |R^T R - I| ~ 0.02
            m["frames"][0]["transform_matrix"][r][0] *= 1.01
    expect(scale, "non-orthonormal", "r_0")
    expect(lambda m: m.__setitem__("frames", []), "no images")
    expect(lambda m: m["frames"][3].__setitem__("file_path", "./train/nope"), "missing", "nope.png")
    expect(lambda m: m.__setitem__("camera_angle_x", -1.0), "camera_angle_x")
    # malformed JSON: file and line
    tj.write_text('{\n  "camera_angle_x": 0.5,\n  "frames": [\n    {"file_path": "a",}\n  ]\n}')
    with pytest.raises(SceneError) as e:
        load_scene(tmp_path, "train")
    assert_one_line(e, "transforms_train.json:4", "malformed JSON")
    # a split that does not exist, an unknown folder
    tj.write_text(good)
    (tmp_path / "transforms_val.json").unlink()
    with pytest.raises(SceneError) as e:
        load_scene(tmp_path, "val")
    assert_one_line(e, "transforms_val.json")
    with pytest.raises(SceneError) as e:
        load_scene(tmp_path / "nothing", "train")
    assert_one_line(e, "nothing")


# ---------------------------------------------------------------- nerfstudio ---------------------
NS_K = (20.0, 21.0, 11.3, 9.4)  # fl_x, fl_y, cx, cy for 24x18 images


def make_nerfstudio(root: Path, n=12, prescaled=False, extra=None, frame_extra=None):
    """transforms.json with shared intrinsics for 24x18 images; frame 5 overrides them (26x20)."""
    cams = blender_cams(n, 7)
    frames = []
    for j, c in enumerate(cams):
        w, h = (26, 20) if j == 5 else (24, 18)
        write_png(root / "images" / f"frame_{j:05d}.png", w, h)
        if prescaled:
            write_png(root / "images_2" / f"frame_{j:05d}.png", (w + 1) // 2, (h + 1) // 2)  # ceil: 12x9, 13x10
        m = np.eye(4)
        m[:3] = c
        fr = {"file_path": f"images/frame_{j:05d}.png", "transform_matrix": m.tolist()}
        if j == 5:
            fr.update({"w": 26, "h": 20, "fl_x": 22.0, "cx": 13.1})
        fr.update((frame_extra or {}).get(j, {}))
        frames.append(fr)
    frames = frames[::-1]  # nerfstudio sorts frames by file name
    meta = {"camera_model": "OPENCV", "fl_x": NS_K[0], "fl_y": NS_K[1], "cx": NS_K[2], "cy": NS_K[3],
            "w": 24, "h": 18, "k1": 0.0, "k2": 0.0, "p1": 0.0, "p2": 0.0, "frames": frames, **(extra or {})}
    (root / "transforms.json").write_text(json.dumps(meta, indent=1))
    return cams


def ns_source_camera(j):
    if j == 5:
        return np.array([22.0, 21.0, 13.1, 9.4]), (26, 20)
    return np.array(NS_K), (24, 18)


@pytest.mark.parametrize("downscale,prescaled", [(1, False), (2, False), (2, True)])
def test_nerfstudio_rays_hit_points(tmp_path, downscale, prescaled):
    cams = make_nerfstudio(tmp_path, prescaled=prescaled)
    assert detect_format(tmp_path) == "nerfstudio"
    scene = load_scene(tmp_path, "train", downscale=downscale)
    # nerfstudio's fraction rule: ceil(0.9 * 12) = 11 train at linspace(0, 11, 11).astype(int)
    train = np.linspace(0, 11, 11, dtype=int)
    assert scene.num_images == 11
    assert [Path(p).name for p in scene.image_paths] == [f"frame_{j:05d}.png" for j in train]
    assert scene.near is None and scene.aabb is None
    for i, j in enumerate(train):
        k_src, (w, h) = ns_source_camera(j)
        if downscale == 1:
            w2, h2 = w, h
        elif prescaled:
            w2, h2 = (w + 1) // 2, (h + 1) // 2
        else:
            w2, h2 = w // 2, h // 2
        assert (scene.width[i], scene.height[i]) == (w2, h2)
        assert tuple(scene.file_wh[i]) == ((w2, h2) if prescaled or downscale == 1 else (w, h))
        assert ("images_2" in scene.image_paths[i]) == prescaled
        for x in POINTS:
            u, v = project_gl(cams[j], k_src, x)
            assert ray_miss(scene, i, u * w2 / w, v * h2 / h, to_world(scene, x)) < 1e-4
    ev = load_scene(tmp_path, "test")
    assert ev.num_images == 1 and ev.image_paths[0].endswith("frame_00010.png")
    assert load_scene(tmp_path, "val").image_paths == ev.image_paths


def test_nerfstudio_split_files_bounds_aabb(tmp_path):
    extra = {"train_filenames": [f"images/frame_{j:05d}.png" for j in (0, 1, 2)],
             "test_filenames": ["./images/frame_00003.png"], "near": 0.1, "far": 9.0,
             "aabb": [[-2, -2, -1], [2, 2, 1]], "up": [0, 0, 2]}
    make_nerfstudio(tmp_path, extra=extra, frame_extra={1: {"near": 0.2}})
    tr = load_scene(tmp_path, "train")
    assert tr.num_images == 3
    np.testing.assert_allclose(tr.near, [0.1, 0.2, 0.1], rtol=1e-6)
    np.testing.assert_allclose(tr.far, 9.0)
    np.testing.assert_allclose(tr.up, [0, 0, 1])
    np.testing.assert_allclose(tr.aabb, [[-2, -2, -1], [2, 2, 1]])
    assert load_scene(tmp_path, "val").image_paths[0].endswith("frame_00003.png")  # val -> test list


def test_nerfstudio_ngp_aabb_scale_and_angle(tmp_path):
    make_nerfstudio(tmp_path)
    tj = tmp_path / "transforms.json"

    def ngp(m):
        for k in ("fl_x", "fl_y", "camera_model"):
            m.pop(k)
        m["camera_angle_x"] = 1.0
        m["aabb_scale"] = 4
        for fr in m["frames"]:
            fr.pop("fl_x", None)
    _edit_json(tj, ngp)
    s = load_scene(tmp_path, "train")
    f = 0.5 * 24 / math.tan(0.5)
    np.testing.assert_allclose(s.intrinsics[0], [f, f, 11.3, 9.4], rtol=1e-6)
    np.testing.assert_allclose(s.aabb, [[-2 / 0.33] * 3, [2 / 0.33] * 3], rtol=1e-6)


def test_nerfstudio_distortion_parsed_and_bad_models_refused(tmp_path):
    make_nerfstudio(tmp_path)
    tj = tmp_path / "transforms.json"
    good = tj.read_text()
    plain = load_scene(tmp_path, "train")
    assert plain.distortion is None and not plain.distorted.any()  # all-zero distortion: a pinhole scene

    _edit_json(tj, lambda m: m.update({"k1": -0.1, "k2": 0.02, "p1": 0.001, "p2": -0.002, "k3": 0.003}))
    s = load_scene(tmp_path, "train")
    assert s.distorted.all() and not s.fisheye.any()
    np.testing.assert_allclose(s.distortion[0], [-0.1, 0.02, 0.001, -0.002, 0.003, 0, 0, 0])  # OpenCV order
    np.testing.assert_allclose(s.file_intrinsics[0], NS_K)  # the distorted camera, kept for decode
    assert not np.allclose(s.intrinsics[0], NS_K)  # the undistorted image's (alpha = 0)
    sub = s.subset([2, 0])
    np.testing.assert_array_equal(sub.distortion, s.distortion[[2, 0]])
    np.testing.assert_array_equal(sub.file_intrinsics, s.file_intrinsics[[2, 0]])

    tj.write_text(good)
    _edit_json(tj, lambda m: m.update({"camera_model": "OPENCV_FISHEYE", "k1": 0.05, "k4": -0.001}))
    s = load_scene(tmp_path, "train", downscale=2)
    assert s.fisheye.all()
    np.testing.assert_allclose(s.distortion[0], [0.05, 0, 0, -0.001, 0, 0, 0, 0])
    # the file camera stays at the file's size; the scene's is the undistorted one scaled by 1/2
    np.testing.assert_allclose(s.file_intrinsics[0], NS_K)
    assert tuple(s.file_wh[0]) == (24, 18) and (s.width[0], s.height[0]) == (12, 9)

    for edit, needles in [
        (lambda m: m.update({"k4": 0.01}), ("k4", "FULL_OPENCV", "transforms.json")),  # ambiguous under OPENCV
        (lambda m: m.update({"camera_model": "OPENCV_FISHEYE", "p1": 0.01}), ("p1", "OPENCV_FISHEYE")),
        (lambda m: m.update({"camera_model": "PINHOLE"}) or m["frames"][2].update({"k1": 0.01}), ("k1", "PINHOLE")),
        (lambda m: m.update({"camera_model": "EQUIRECTANGULAR"}), ("EQUIRECTANGULAR", "undistort", "transforms.json")),
        (lambda m: m.update({"k2": "x"}), ("k2", "number")),
    ]:
        tj.write_text(good)
        _edit_json(tj, edit)
        with pytest.raises(SceneError) as e:
            load_scene(tmp_path, "train")
        assert_one_line(e, *needles)


def test_nerfstudio_errors(tmp_path):
    make_nerfstudio(tmp_path)
    tj = tmp_path / "transforms.json"
    good = tj.read_text()

    def expect(fn, *needles, split="train"):
        tj.write_text(good)
        _edit_json(tj, fn)
        with pytest.raises(SceneError) as e:
            load_scene(tmp_path, split)
        assert_one_line(e, *needles)

    def no_focal(m):
        m.pop("fl_x")
        m["frames"][0].pop("fl_x", None)
    expect(no_focal, "fl_x", "transforms.json")
    expect(lambda m: m.__setitem__("fl_y", 0.0), "fy=0", "focal")
    expect(lambda m: m["frames"][0].pop("transform_matrix"), "transform_matrix", "frame_00011")
    expect(lambda m: m["frames"][0]["transform_matrix"][1].__setitem__(2, float("inf")), "non-finite", "frame_00011")
    expect(lambda m: m["frames"][3].__setitem__("file_path", "images/gone.png"), "missing", "gone.png")
    expect(lambda m: m.__setitem__("train_filenames", ["images/frame_00000.png"]), "test_filenames", split="test")
    expect(lambda m: m.__setitem__("train_filenames", ["images/what.png"]), "what.png")
    expect(lambda m: m.__setitem__("train_filenames", []), "no images")


# ---------------------------------------------------------------- LLFF ---------------------------
def make_llff(root: Path, n=10, w=24, h=18, f=20.0, prescaled=None):
    """Forward-facing cameras written as LLFF [down, right, back, t | H, W, f] rows."""
    rng = np.random.default_rng(3)
    rows, cams = [], []
    for j in range(n):
        pos = np.array([rng.uniform(-0.6, 0.6), rng.uniform(-0.4, 0.4), 5.0 + rng.uniform(-0.3, 0.3)])
        gl = look_at_gl(pos, rng.uniform(-0.1, 0.1, 3), [0, 1, 0])
        right, up, back = gl[:, 0], gl[:, 1], gl[:, 2]
        drb = np.stack([-up, right, back, pos], axis=1)  # LLFF's own convention
        cams.append(drb)
        m = np.concatenate([drb, np.array([[h], [w], [f]], np.float64)], axis=1)
        rows.append(np.concatenate([m.ravel(), [3.0 + 0.1 * j, 9.0 + 0.2 * j]]))
        write_png(root / "images" / f"IMG_{j:04d}.JPG.png", w, h)
        if prescaled:
            write_png(root / f"images_{prescaled}" / f"image{j:03d}.png", -(-w // prescaled), -(-h // prescaled))
    np.save(root / "poses_bounds.npy", np.array(rows))
    return cams


@pytest.mark.parametrize("downscale,prescaled,w", [(1, None, 24), (2, None, 25), (2, 2, 25)])
def test_llff_rays_hit_points(tmp_path, downscale, prescaled, w):
    h, f = 18, 20.0
    cams = make_llff(tmp_path, w=w, prescaled=prescaled)
    assert detect_format(tmp_path) == "llff"
    tr = load_scene(tmp_path, "train", downscale=downscale)
    te = load_scene(tmp_path, "test", downscale=downscale)
    assert te.num_images == 2 and tr.num_images == 8  # i % 8 == 0 -> test: 0, 8
    assert load_scene(tmp_path, "val").image_paths == load_scene(tmp_path, "test").image_paths
    if prescaled:
        w2, h2 = -(-w // 2), -(-h // 2)
        assert "images_2" in tr.image_paths[0] and tuple(tr.file_wh[0]) == (w2, h2)
    else:
        w2, h2 = w // downscale, h // downscale
        assert tuple(tr.file_wh[0]) == (w, h)
    assert (tr.width == w2).all() and (tr.height == h2).all()
    k_src = np.array([f, f, w / 2, h / 2])
    # NeRF's normalisation: min near -> 1 / 0.75, mean camera position -> origin
    sc = 1 / (3.0 * 0.75)
    np.testing.assert_allclose(min(tr.near.min(), te.near.min()), 1 / 0.75, rtol=1e-6)
    np.testing.assert_allclose(te.near, np.array([3.0, 3.8]) * sc, rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([tr.c2w, te.c2w])[:, :, 3].mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(te.world_from_source[:3, :3] @ te.world_from_source[:3, :3].T, np.eye(3) * sc**2, atol=1e-9)
    assert tr.up[1] > 0.99
    for scene, js in ((tr, [j for j in range(10) if j % 8]), (te, [0, 8])):
        for i, j in enumerate(js):
            for x in POINTS:
                u, v = project_drb(cams[j], k_src, x)
                assert ray_miss(scene, i, u * w2 / w, v * h2 / h, to_world(scene, x)) < 1e-4


def test_llff_errors(tmp_path):
    make_llff(tmp_path)
    pb = tmp_path / "poses_bounds.npy"
    good = np.load(pb)

    def expect(arr, *needles):
        np.save(pb, arr)
        with pytest.raises(SceneError) as e:
            load_scene(tmp_path, "train")
        assert_one_line(e, *needles)

    expect(good[:, :15], "(10, 15)", "(N, 17)", "poses_bounds.npy")
    expect(good[:9], "9 poses", "10 images")
    bad = good.copy()
    bad[4, 0] = np.nan
    expect(bad, "non-finite", "IMG_0004")
    bad = good.copy()
    bad[2, [0, 5, 10]] *= 1.1
    expect(bad, "non-orthonormal", "IMG_0002")
    bad = good.copy()
    bad[1, 14] = -3
    expect(bad, "invalid intrinsics", "IMG_0001")
    bad = good.copy()
    bad[3, 16] = 1.0
    expect(bad, "invalid bounds", "IMG_0003")
    pb.write_bytes(b"not numpy")
    with pytest.raises(SceneError) as e:
        load_scene(tmp_path, "train", format="llff")
    assert_one_line(e, "poses_bounds.npy")
    np.save(pb, good)
    (tmp_path / "images_4").mkdir()
    with pytest.raises(SceneError) as e:
        load_scene(tmp_path, "train", downscale=4)
    assert_one_line(e, "images_4", "0 images")


# ---------------------------------------------------------------- Mega-NeRF ----------------------
MN_ORIGIN, MN_PSF = np.array([100.0, -50.0, 20.0]), 50.0


class NotATensorDict:  # torch.load(weights_only=True) must refuse this
    def __init__(self):
        self.x = 1


def make_mega_nerf(root: Path, n_train=5, n_val=2, w=25, h=18, coords_extra=None, meta_extra=None):
    """Aerial cameras in Mega-NeRF's DRB world (x down), stored normalised and with the column
    transformation Mega-NeRF's README prescribes; projected in the tests with the DRB camera."""
    rng = np.random.default_rng(5)
    k = np.array([21.0, 20.0, 12.2, 8.7])
    torch.save({"origin_drb": torch.tensor(MN_ORIGIN), "pose_scale_factor": MN_PSF, **(coords_extra or {})},
               root / "coordinates.pt")
    cams = {}
    for split, n in (("train", n_train), ("val", n_val)):
        cams[split] = []
        for j in range(n):
            # metric DRB: altitude 60 m above the origin (x = -60), looking down at it
            pos = MN_ORIGIN + np.array([-60.0, rng.uniform(-30, 30), rng.uniform(-30, 30)])
            gl = look_at_gl(pos, MN_ORIGIN + rng.uniform(-2, 2, 3), [0.0, 0.0, 1.0])
            drb = np.stack([-gl[:, 1], gl[:, 0], gl[:, 2], (pos - MN_ORIGIN) / MN_PSF], axis=1)  # camera_in_drb
            cams[split].append(drb)
            # Mega-NeRF README: c2w = torch.cat([camera_in_drb[:, 1:2], -camera_in_drb[:, :1], camera_in_drb[:, 2:4]], -1)
            stored = torch.cat([torch.tensor(drb)[:, 1:2], -torch.tensor(drb)[:, :1], torch.tensor(drb)[:, 2:4]], -1)
            name = f"{j:06d}"
            write_png(root / split / "rgbs" / f"{name}.png", w, h)
            md = {"W": w, "H": h, "intrinsics": torch.tensor(k), "c2w": stored.to(torch.float32),
                  **(meta_extra or {})}
            (root / split / "metadata").mkdir(parents=True, exist_ok=True)
            torch.save(md, root / split / "metadata" / f"{name}.pt")
    return cams, k


@pytest.mark.parametrize("downscale", [1, 2])
def test_mega_nerf_rays_hit_points(tmp_path, downscale):
    w, h = 25, 18
    cams, k_src = make_mega_nerf(tmp_path, w=w, h=h)
    assert detect_format(tmp_path) == "mega_nerf"
    w2, h2 = w // downscale, h // downscale
    for split, key in (("train", "train"), ("val", "val"), ("test", "val")):
        scene = load_scene(tmp_path, split, downscale=downscale)
        assert scene.num_images == len(cams[key]) and (scene.width == w2).all() and (scene.height == h2).all()
        assert (scene.file_wh == [w, h]).all()
        np.testing.assert_allclose(scene.up, [-1, 0, 0])
        assert scene.has_bounds and (scene.near > 0).all() and (scene.far > scene.near).all()
        for i, c in enumerate(cams[key]):
            for p in POINTS:
                x_src = MN_ORIGIN + MN_PSF * p  # metric DRB point
                # project in Mega-NeRF's own (normalised) frame with its DRB camera convention
                u, v = project_drb(c.astype(np.float32).astype(np.float64), k_src, p)
                assert ray_miss(scene, i, u * w2 / w, v * h2 / h, to_world(scene, x_src)) < 1e-4


def test_mega_nerf_bounds_and_aabb(tmp_path):
    make_mega_nerf(tmp_path, coords_extra={"near": 0.05, "far": 3.0, "aabb": torch.tensor([[-1.0] * 3, [1.0] * 3])})
    s = load_scene(tmp_path, "train")
    np.testing.assert_allclose(s.near, 0.05)
    np.testing.assert_allclose(s.far, 3.0)
    np.testing.assert_allclose(s.aabb, [[-1] * 3, [1] * 3])
    make_mega_nerf(tmp_path, meta_extra={"near": 0.1, "far": 2.5})
    s = load_scene(tmp_path, "val")
    np.testing.assert_allclose(s.far, 2.5)


def test_mega_nerf_errors(tmp_path):
    make_mega_nerf(tmp_path)
    md = tmp_path / "train" / "metadata" / "000002.pt"
    good = torch.load(md, weights_only=True)

    def expect(obj, *needles, path=md):
        torch.save(obj, path)
        with pytest.raises(SceneError) as e:
            load_scene(tmp_path, "train")
        assert_one_line(e, *needles)

    expect(NotATensorDict(), "refusing to unpickle", "000002.pt")
    expect({**good, "distortion": torch.tensor([0.1, 0, 0, 0])}, "distortion", "000002.pt")
    expect({k: v for k, v in good.items() if k != "c2w"}, "'c2w'", "000002.pt")
    expect({**good, "c2w": good["c2w"] * 1.1}, "non-orthonormal", "000002")
    expect({**good, "intrinsics": torch.tensor([0.0, 20, 12, 9])}, "invalid intrinsics", "000002")
    expect({**good, "W": 0}, "'W'", "000002.pt")
    torch.save(good, md)
    (tmp_path / "train" / "rgbs" / "000003.png").unlink()
    with pytest.raises(SceneError) as e:
        load_scene(tmp_path, "train")
    assert_one_line(e, "rgbs", "000003")
    md.write_bytes(b"garbage")
    with pytest.raises(SceneError) as e:
        load_scene(tmp_path, "train")
    assert_one_line(e, "000002.pt", "cannot read")
    torch.save({"origin_drb": torch.zeros(3)}, tmp_path / "coordinates.pt")
    with pytest.raises(SceneError) as e:
        load_scene(tmp_path, "train")
    assert_one_line(e, "pose_scale_factor", "coordinates.pt")


# ---------------------------------------------------------------- corrupt values -----------------
def test_corrupt_values_are_one_line_errors_naming_the_file(tmp_path):
    """Regressions found by tests/test_properties_scenes.py: each of these escaped as a traceback
    (UnicodeDecodeError, ValueError, OverflowError, numpy's SyntaxError / TokenError) or was
    accepted as an inf in the float32 Scene, or named only the folder."""
    def fails(root, path, *needles, split="train"):
        with pytest.raises(SceneError) as e:
            load_scene(root, split)
        assert_one_line(e, path, *needles)

    bl = tmp_path / "bl"
    make_blender(bl)
    tj = bl / "transforms_train.json"
    good = tj.read_text()
    tj.write_bytes(good.encode()[:40] + b"\xd9" + good.encode()[41:])
    fails(bl, tj, "not UTF-8")
    tj.write_text(good.replace('"camera_angle_x": 0.9', '"camera_angle_x": 1' + "0" * 4400))
    fails(bl, tj, "4300 digits")
    tj.write_text(good.replace('"camera_angle_x": 0.9', '"camera_angle_x": 1' + "0" * 400))
    fails(bl, tj, "camera_angle_x", "out of range")
    meta = json.loads(good)
    meta["frames"][1]["transform_matrix"][0][3] = 10 ** 400
    tj.write_text(json.dumps(meta))
    fails(bl, tj, "transform_matrix")
    meta["frames"][1]["transform_matrix"][0][3] = 1e300  # finite in float64, inf in the Scene's float32
    tj.write_text(json.dumps(meta))
    fails(bl, tj, "non-finite pose")
    tj.write_text(json.dumps({**json.loads(good), "far": 1e300}))
    fails(bl, tj, "'far'", "float32")

    ns = tmp_path / "ns"
    make_nerfstudio(ns)  # 12 frames: frame 10 is the test split's
    nj = ns / "transforms.json"
    meta = json.loads(nj.read_text())
    nj.write_text(json.dumps({**meta, "fl_x": 1e300}))
    fails(ns, nj, "fl_x", "float32")
    nj.write_text(json.dumps({**meta, "w": 1e20}))  # an int64 overflow
    fails(ns, nj, "w, h", "2^31")
    test_frame = next(f for f in meta["frames"] if f["file_path"].endswith("frame_00010.png"))
    test_frame["transform_matrix"][0][0] = 10 ** 400  # the train split's up vote falls back to its own cameras
    nj.write_text(json.dumps(meta))
    assert np.isfinite(load_scene(ns, "train").up).all()

    ll = tmp_path / "ll"
    make_llff(ll)
    npy = ll / "poses_bounds.npy"
    raw = npy.read_bytes()
    npy.write_bytes(raw.replace(b"'shape': (", b"'shape': ((", 1))  # numpy tokenizes the header: TokenError
    fails(ll, npy, "corrupt header")

    mn = tmp_path / "mn"
    mn.mkdir()
    make_mega_nerf(mn, meta_extra={"near": 0.1, "far": 2.5})
    md = mn / "train" / "metadata" / "000002.pt"
    good_md = torch.load(md, weights_only=True)
    torch.save({**good_md, "W": 10 ** 400}, md)
    fails(mn, md, "'W'")
    torch.save({k: v for k, v in good_md.items() if k not in ("near", "far")}, md)
    fails(mn, md, "no 'near'/'far'", "000000.pt has near")


def test_every_parser_error_starts_with_the_file_it_is_about(tmp_path):
    """A user fixes the file the message names first: for the Blender, nerfstudio and Mega-NeRF
    parsers each refusal starts with that file's path (the JSON, coordinates.pt, a metadata file)."""
    from dali_nerf.scenes._util import load_json

    def refused(root, split="train", fmt=None) -> str:
        with pytest.raises(SceneError) as e:
            load_scene(root, split, **({"format": fmt} if fmt else {}))
        assert "\n" not in str(e.value)
        return str(e.value)

    bl = tmp_path / "bl"
    make_blender(bl)
    tj = bl / "transforms_train.json"
    good = tj.read_text()
    for edit, rest in ((lambda m: m.pop("frames"), "missing key 'frames'"),
                       (lambda m: m.update(near=5.0, far=3.0), "frame '(scene)' has invalid bounds near=5 far=3"),
                       (lambda m: m.update(near=0.0, far=3.0), None)):  # near 0 is a valid bound
        tj.write_text(good)
        _edit_json(tj, edit)
        if rest is None:
            assert load_scene(bl, "train").near[0] == 0.0
        else:
            msg = refused(bl)
            assert msg.startswith(f"{tj}: ") and rest in msg, msg
    ns = tmp_path / "ns"
    make_nerfstudio(ns)
    tj = ns / "transforms.json"
    good = tj.read_text()

    def no_fl_y(m):
        m.pop("fl_y")
        m["camera_angle_y"] = "wide"
    for edit, key in ((lambda m: m.update(h="tall"), "key 'h'"), (lambda m: m.update(cy="mid"), "key 'cy'"),
                      (no_fl_y, "key 'camera_angle_y'"), (lambda m: m.update(aabb=[[1, 1, 1], [0, 0, 0]]), "key 'aabb'"),
                      (lambda m: m.update(train_filenames="images", test_filenames=[]), "train_filenames must be a list")):
        tj.write_text(good)
        _edit_json(tj, edit)
        msg = refused(ns)
        assert msg.startswith(f"{tj}: ") and key in msg, msg
    mn, mn2 = tmp_path / "mn", tmp_path / "mn2"
    mn.mkdir()
    mn2.mkdir()
    make_mega_nerf(mn, coords_extra={"origin_drb": torch.tensor([1.0, 2.0])})
    assert refused(mn, fmt="mega_nerf").startswith(f"{mn / 'coordinates.pt'}: ")
    make_mega_nerf(mn2, meta_extra={"c2w": torch.zeros(4, 4)})
    msg = refused(mn2, fmt="mega_nerf")
    assert msg.startswith(f"{mn2 / 'train' / 'metadata'}") and "c2w" in msg, msg
    with pytest.raises(SceneError, match=rf"^{tmp_path / 'absent.json'}: file not found$"):
        load_json(tmp_path / "absent.json")


def test_scene_record_is_frozen_and_normalises_its_arrays(tmp_path):
    """A parsed Scene's arrays are read-only (the record and its cached fingerprint cannot drift);
    the optional lens arrays given as lists become typed arrays of the checked shape; the mean up
    of cameras whose ups cancel is +y; nerfstudio's camera_angle_y gives fy = h / 2 / tan(angle / 2)."""
    from dali_nerf.scenes._util import mean_up

    make_nerfstudio(tmp_path)
    s = load_scene(tmp_path, "train")
    for name in ("c2w", "intrinsics", "width", "height"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(s, name)[0] = 0
    n = s.num_images
    lens = dataclasses.replace(s, file_wh=[[24, 18]] * n, distortion=[[0.1, 0, 0, 0, 0, 0, 0, 0]] * n,
                               fisheye=[False] * n, file_intrinsics=[[20.0, 21.0, 11.3, 9.4]] * n)
    assert lens.fisheye.dtype == bool and lens.fisheye.shape == (n,) and not lens.fisheye.flags.writeable
    assert lens.file_intrinsics.dtype == np.float64 and lens.file_intrinsics.shape == (n, 4)
    assert lens.file_wh.dtype == np.int64
    with pytest.raises(ValueError, match=rf"^Scene.file_wh must have shape \(N, 2\), got \({n}, 3\)$"):
        dataclasses.replace(lens, file_wh=[[24, 18, 1]] * n)
    c2w = np.zeros((2, 3, 4))
    c2w[0, :, 1], c2w[1, :, 1] = [0, 0, 1], [0, 0, -1]
    np.testing.assert_array_equal(mean_up(c2w), [0.0, 1.0, 0.0])
    tj = tmp_path / "transforms.json"
    _edit_json(tj, lambda m: (m.pop("fl_y"), m.update(camera_angle_y=0.8)))
    k = load_scene(tmp_path, "train").intrinsics
    np.testing.assert_allclose(k[k[:, 0] == NS_K[0], 1], 0.5 * 18 / np.tan(0.4), rtol=1e-6)


def test_llff_non_integer_image_size_names_the_row_and_scene_repr(tmp_path):
    """An LLFF row whose H or W is not an integer is refused naming that row's image (the first
    such row, also when a later focal is not an integer: f need not be); a Scene's repr lists up
    to three image sizes; the mean up of cameras sharing +z is +z."""
    from dali_nerf.scenes._util import mean_up

    make_llff(tmp_path, n=6)
    pb = np.load(tmp_path / "poses_bounds.npy")
    pb[:, 14] = 20.25  # every focal: not an image size
    pb[4, 4] = 18.5  # H of row 4
    np.save(tmp_path / "poses_bounds.npy", pb)
    with pytest.raises(SceneError, match=r"poses_bounds.npy: row 4 \(IMG_0004.JPG.png\) has image size H=18.5 W=24; "
                                         r"must be integers$"):
        load_scene(tmp_path, "train")
    make_nerfstudio(tmp_path / "ns")
    r = repr(load_scene(tmp_path / "ns", "train"))
    assert "24x18, 26x20" in r and " ..." not in r, r
    s = load_scene(tmp_path / "ns", "train")
    w, h = s.width.copy(), s.height.copy()
    w[:4], h[:4] = [8, 9, 10, 11], [6, 7, 8, 9]
    assert "8x6, 9x7, 10x8 ..." in repr(dataclasses.replace(s, width=w, height=h))
    c2w = np.zeros((3, 3, 4))
    c2w[:, :, 1] = [[0, 0, 1], [0, 0.1, 1], [0, -0.1, 1]]
    np.testing.assert_allclose(mean_up(c2w), [0.0, 0.0, 1.0])


def test_nerfstudio_malformed_frame_of_another_split(tmp_path):
    """A frame of the test split whose transform_matrix is a number (found by the corruption property
    test): the train split still loads, its up voted by its own cameras (it was an IndexError from the
    all-frames vote), and loading the test split is one line naming the file and the key."""
    make_nerfstudio(tmp_path, frame_extra={10: {"transform_matrix": 5.0}})  # frame 10: the one test frame
    tr = load_scene(tmp_path, "train")
    assert len(tr.image_paths) == 11 and np.isfinite(tr.up).all() and np.linalg.norm(tr.up) > 0
    with pytest.raises(SceneError, match=r"^\S*transforms.json: .*transform_matrix[^\n]*$"):
        load_scene(tmp_path, "test")


def test_only_the_images_with_lens_distortion_are_undistorted(tmp_path):
    """Scene.distorted is per image: a capture where one camera has distortion coefficients (or is
    fisheye) undistorts that image alone, not every image of the split."""
    make_llff(tmp_path, n=4)
    s = load_scene(tmp_path, "train")
    n = s.num_images
    dist = np.zeros((n, 8))
    dist[1, 0] = -0.05  # k1 of the second image only
    fish = np.zeros(n, bool)
    fish[n - 1] = True
    lensed = dataclasses.replace(s, distortion=dist, fisheye=fish, file_intrinsics=np.asarray(s.intrinsics, np.float64),
                                 file_wh=np.stack([s.width, s.height], axis=1))
    want = np.zeros(n, bool)
    want[[1, n - 1]] = True
    assert lensed.distorted.tolist() == want.tolist()
    assert not s.distorted.any()


def test_llff_keeps_the_background_it_is_given(tmp_path):
    """The LLFF parser, like every format's, returns the background it is given (load_scene
    passes white and sets the resolved one after parsing; a direct parse keeps its own)."""
    from dali_nerf.scenes import llff

    make_llff(tmp_path, n=4)
    for bg in ((0.0, 0.0, 0.0), (0.2, 0.5, 0.9)):
        np.testing.assert_allclose(llff.parse(tmp_path, "train", background=bg).background, bg)
    np.testing.assert_allclose(load_scene(tmp_path, "train", background=[0.2, 0.5, 0.9]).background, [0.2, 0.5, 0.9])
