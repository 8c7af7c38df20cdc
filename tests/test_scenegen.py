"""Scene generator: determinism, atomic writes, errors, and the round trip generator -> files ->
parser -> rays -> the analytic hit the renderer saw (Blender, Mega-NeRF, nerfstudio)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from dali_nerf import scenegen as sg
from dali_nerf.cli.main import main
from dali_nerf.errors import ConfigError, DaliNerfError
from dali_nerf.data.rays import rays_from_indices
from dali_nerf.scenegen import tracer, worlds, writers
from dali_nerf.scenes import load_scene


def _digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _ref_rays(c2w, k, rows, cols):
    """Independent numpy float64 reference of the ARCHITECTURE.md pixel-ray formula."""
    x = (cols + 0.5 - k[:, 2]) / k[:, 0]
    y = -(rows + 0.5 - k[:, 3]) / k[:, 1]
    d_cam = np.stack([x, y, -np.ones_like(x)], axis=1)
    d = np.einsum("bij,bj->bi", c2w[:, :, :3], d_cam)
    return c2w[:, :, 3].copy(), d / np.linalg.norm(d, axis=1, keepdims=True)


def _scene_from_world(scene, fmt):
    """(4, 4) map from the parser's world to the generator's SCENE frame."""
    src_from_world = np.linalg.inv(np.asarray(scene.world_from_source, np.float64))
    scene_from_src = np.eye(4)
    if fmt == "mega_nerf":  # source = metric DRB: p_drb = m * R p_scene + offset
        r = sg.DRB_FROM_SCENE
        scene_from_src[:3, :3] = r.T / sg.CITY_METRES_PER_UNIT
        scene_from_src[:3, 3] = -r.T @ sg.CITY_DRB_OFFSET / sg.CITY_METRES_PER_UNIT
    return scene_from_src @ src_from_world


def _decode_over_white(path: Path) -> np.ndarray:
    img = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    assert img is not None, path
    if img.ndim == 3 and img.shape[2] == 4:
        rgb = cv2.cvtColor(img, cv2.COLOR_BGRA2RGBA).astype(np.float64)
        a = rgb[..., 3:] / 255.0
        return rgb[..., :3] * a + 255.0 * (1.0 - a)
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB).astype(np.float64)


def _gen_cameras(kind, split, gen_kwargs):
    """The generator's cameras the parser's ``split`` holds (LLFF: every 8th view is test/val)."""
    if kind == "forward":
        cams = sg.scene_cameras(kind, **gen_kwargs)["train"]
        keep = np.arange(len(cams["c2w"]))
        keep = keep[keep % 8 == 0] if split in ("val", "test") else keep[keep % 8 != 0]
        return dict(cams, c2w=cams["c2w"][keep], intrinsics=cams["intrinsics"][keep])
    return sg.scene_cameras(kind, **gen_kwargs)[split if not (kind in ("city", "unbounded") and split == "test") else "val"]


def _round_trip(out, kind, fmt, split, gen_kwargs, n_pix=200, exact_colour=True):
    scene = load_scene(out, split, format=fmt)
    cams = _gen_cameras(kind, split, gen_kwargs)
    n = len(cams["c2w"])
    assert scene.num_images == n
    w, h = cams["width"], cams["height"]
    assert (scene.width == w).all() and (scene.height == h).all()

    rng = np.random.default_rng(123)
    cam = rng.integers(0, n, n_pix)
    row, col = rng.integers(0, h, n_pix), rng.integers(0, w, n_pix)
    idx = torch.from_numpy(np.stack([cam, row, col], 1))
    o_w, d_w = rays_from_indices(torch.from_numpy(scene.c2w.copy()), torch.from_numpy(scene.intrinsics.copy()), idx)
    a = _scene_from_world(scene, fmt)
    o_p = o_w.double().numpy() @ a[:3, :3].T + a[:3, 3]
    d_p = d_w.double().numpy() @ a[:3, :3].T
    d_p /= np.linalg.norm(d_p, axis=1, keepdims=True)  # the map may scale (Mega-NeRF)

    o_g, d_g = _ref_rays(cams["c2w"][cam], cams["intrinsics"][cam], row.astype(np.float64), col.astype(np.float64))
    seed = gen_kwargs.get("seed", 0)
    gen = sg.render_scene_rays(kind, o_g, d_g, seed)
    par = sg.render_scene_rays(kind, o_p, d_p, seed)

    # keep pixels away from silhouette / shadow edges (float32 pose error must not flip the hit):
    stable = np.ones(n_pix, bool)
    for dr, dc in ((0.005, 0.0), (-0.005, 0.0), (0.0, 0.005), (0.0, -0.005)):
        oj, dj = _ref_rays(cams["c2w"][cam], cams["intrinsics"][cam], row + dr, col + dc)
        jit = sg.render_scene_rays(kind, oj, dj, seed)
        stable &= (jit["prim"] == gen["prim"]) & (np.abs(jit["rgb"] - gen["rgb"]).max(1) < 0.03)
    assert stable.sum() >= 0.9 * n_pix
    hit = stable & (gen["alpha"] > 0)
    assert hit.sum() >= 20, "too few pixels hit anything"

    np.testing.assert_array_equal(par["alpha"][stable], gen["alpha"][stable])
    np.testing.assert_array_equal(par["prim"][stable], gen["prim"][stable])
    rel = np.abs(par["depth"][hit] - gen["depth"][hit]) / gen["depth"][hit]
    assert rel.max() < 1e-4, rel.max()
    # the parsed ray passes through the 3-D point the renderer saw
    miss = np.linalg.norm(o_p[hit] + gen["depth"][hit, None] * d_p[hit] - gen["points"][hit], axis=1)
    assert (miss / gen["depth"][hit]).max() < 1e-4

    # decoded pixel colour == the renderer's colour at that pixel (over white)
    want = 255.0 * (gen["rgb"] * gen["alpha"][:, None] + (1.0 - gen["alpha"][:, None]))
    got = np.stack([_decode_over_white(Path(scene.image_paths[c]))[r, q] for c, r, q in zip(cam, row, col)])
    err = np.abs(got[stable] - want[stable])
    if exact_colour:
        assert err.max() <= 0.5 + 1e-6, err.max()
    else:  # JPEG: lossy
        assert err.mean() < 6.0, err.mean()
    return scene


def _generate(factory, kind, **kw):
    """(folder, generator kwargs) of a scene made once per module."""
    return sg.make_scene(kind, factory.mktemp("gen") / kind, **kw), kw


@pytest.fixture(scope="module")
def objects_scene(tmp_path_factory):
    return _generate(tmp_path_factory, "objects", width=40, height=30, n_train=4, n_val=2, n_test=3, seed=3)


@pytest.fixture(scope="module")
def city_scene(tmp_path_factory):
    return _generate(tmp_path_factory, "city", width=48, height=36, n_train=6, n_val=2, seed=5)


def test_objects_layout(objects_scene):
    out, _ = objects_scene
    for split, n in (("train", 4), ("val", 2), ("test", 3)):
        meta = json.loads((out / f"transforms_{split}.json").read_text())
        assert meta["camera_angle_x"] == pytest.approx(sg.BLENDER_CAMERA_ANGLE_X)
        assert (meta["near"], meta["far"]) == (2.0, 6.0)
        assert meta["aabb"] == [[-1.5] * 3, [1.5] * 3]
        assert [f["file_path"] for f in meta["frames"]] == [f"./{split}/r_{i}" for i in range(n)]
        for f in meta["frames"]:
            m = np.array(f["transform_matrix"])
            assert m.shape == (4, 4)
            np.testing.assert_allclose(m[:3, :3].T @ m[:3, :3], np.eye(3), atol=1e-12)
            assert np.linalg.norm(m[:3, 3]) == pytest.approx(4.0)
            # camera looks at the origin: -z axis points from the eye to (0, 0, 0)
            np.testing.assert_allclose(-m[:3, 2], -m[:3, 3] / 4.0, atol=1e-12)
    img = cv2.imread(str(out / "train" / "r_0.png"), cv2.IMREAD_UNCHANGED)
    assert img.shape == (30, 40, 4) and img.dtype == np.uint8
    assert set(np.unique(img[..., 3])) == {0, 255}  # background transparent, objects opaque
    assert img[0, 0, 3] == 0


def test_city_layout(city_scene):
    out, _ = city_scene
    coords = torch.load(out / "coordinates.pt", map_location="cpu", weights_only=True)
    assert coords["origin_drb"].dtype == torch.float32 and coords["origin_drb"].shape == (3,)
    assert isinstance(coords["pose_scale_factor"], float)
    metas = sorted((out / "train" / "metadata").glob("*.pt")) + sorted((out / "val" / "metadata").glob("*.pt"))
    assert [p.stem for p in metas] == [f"{i:06d}" for i in range(8)]  # names unique across splits
    pos = []
    for p in metas:
        m = torch.load(p, map_location="cpu", weights_only=True)
        assert (m["W"], m["H"]) == (48, 36) and isinstance(m["W"], int)
        assert m["c2w"].shape == (3, 4) and m["c2w"].dtype == torch.float32
        assert m["intrinsics"].shape == (4,)
        pos.append(m["c2w"][:, 3].numpy())
        assert (out / p.parent.parent.name / "rgbs" / f"{p.stem}.png").exists()
    pos = np.array(pos)
    assert np.abs(pos).max() <= 1.0 + 1e-5  # normalised as Mega-NeRF stores them
    assert np.all(pos[:, 0] < coords["aabb"][0, 0].item())  # cameras above (DRB: x is down) the box
    ns = json.loads((out / "transforms.json").read_text())
    assert ns["camera_model"] == "PINHOLE" and (ns["w"], ns["h"]) == (48, 36)
    assert ns["train_filenames"] == [f"train/rgbs/{i:06d}.png" for i in range(6)]
    assert ns["test_filenames"] == ns["val_filenames"] == [f"val/rgbs/{i:06d}.png" for i in (6, 7)]
    assert [f["file_path"] for f in ns["frames"]] == ns["train_filenames"] + ns["val_filenames"]
    assert 0 < ns["near"] < ns["far"]


@pytest.mark.parametrize("split", ["train", "test"])
def test_round_trip_blender(objects_scene, split):
    out, kw = objects_scene
    _round_trip(out, "objects", "blender", split, kw)


@pytest.mark.parametrize("split", ["train", "val"])
def test_round_trip_mega_nerf(city_scene, split):
    out, kw = city_scene
    _round_trip(out, "city", "mega_nerf", split, kw)


@pytest.mark.parametrize("split", ["train", "test"])
def test_round_trip_nerfstudio(city_scene, split):
    out, kw = city_scene
    _round_trip(out, "city", "nerfstudio", split, kw)


def test_round_trip_jpeg(tmp_path):
    kw = dict(width=32, height=32, n_train=2, n_val=1, n_test=1, seed=1)
    out = sg.make_scene("objects", tmp_path / "o", image_format="jpeg", **kw)
    assert (out / "train" / "r_0.jpg").exists() and not list(out.rglob("*.png"))
    _round_trip(out, "objects", "blender", "train", kw, exact_colour=False)


@pytest.fixture(scope="module")
def forward_scene(tmp_path_factory):
    return _generate(tmp_path_factory, "forward", width=64, height=48, n_train=10, seed=2)


@pytest.fixture(scope="module")
def unbounded_scene(tmp_path_factory):
    return _generate(tmp_path_factory, "unbounded", width=48, height=36, n_train=12, n_val=2, seed=4)


def test_forward_layout(forward_scene):
    out, _ = forward_scene
    pb = np.load(out / "poses_bounds.npy")
    assert pb.shape == (10, 17)
    np.testing.assert_array_equal(pb[:, [4, 9]], np.tile([48.0, 64.0], (10, 1)))  # H, W of the full images
    assert (pb[:, 15] > 0).all() and (pb[:, 16] > pb[:, 15]).all()
    for folder, (h, w) in (("images", (48, 64)), ("images_4", (12, 16)), ("images_8", (6, 8))):
        files = sorted((out / folder).iterdir())
        assert [f.name for f in files] == [f"image_{i:03d}.jpg" for i in range(10)]
        img = cv2.imread(str(files[3]), cv2.IMREAD_UNCHANGED)
        assert img.shape == (h, w, 3)  # JPEG, no alpha
    # images_8 is the area average of the full image (up to JPEG)
    full = cv2.imread(str(out / "images" / "image_003.jpg")).astype(np.float64)
    small = cv2.imread(str(out / "images_8" / "image_003.jpg")).astype(np.float64)
    assert np.abs(full.reshape(6, 8, 8, 8, 3).mean((1, 3)) - small).mean() < 4.0


def test_unbounded_layout(unbounded_scene):
    out, _ = unbounded_scene
    ns = json.loads((out / "transforms.json").read_text())
    assert ns["camera_model"] == "PINHOLE" and (ns["w"], ns["h"]) == (48, 36)
    for key in ("near", "far", "aabb", "up"):  # as COLMAP-made captures come
        assert key not in ns
    assert ns["train_filenames"] == [f"images/frame_{i:05d}.jpg" for i in range(12)]
    assert ns["test_filenames"] == ns["val_filenames"] == [f"images/frame_{i:05d}.jpg" for i in (12, 13)]
    assert cv2.imread(str(out / "images" / "frame_00000.jpg"), cv2.IMREAD_UNCHANGED).shape == (36, 48, 3)
    pos = np.array([np.array(f["transform_matrix"])[:3, 3] for f in ns["frames"]])
    fwd = np.array([-np.array(f["transform_matrix"])[:3, 2] for f in ns["frames"]])
    np.testing.assert_allclose(np.linalg.norm(pos[:, :2], axis=1), 0.35, atol=0.01)
    assert (np.einsum("ni,ni->n", pos[:, :2], fwd[:, :2]) > 0).all()  # looking outward
    everything = cv2.imread(str(out / "images" / "frame_00003.jpg"))
    assert everything.std() > 10  # textured, not a flat background


@pytest.mark.parametrize("split", ["train", "test"])
def test_round_trip_llff(forward_scene, split):
    out, kw = forward_scene
    scene = _round_trip(out, "forward", "llff", split, kw, exact_colour=False)
    assert scene.aabb is None and scene.has_bounds


@pytest.mark.parametrize("split", ["train", "test"])
def test_round_trip_unbounded_nerfstudio(unbounded_scene, split):
    out, kw = unbounded_scene
    scene = _round_trip(out, "unbounded", "nerfstudio", split, kw, exact_colour=False)
    assert scene.aabb is None and not scene.has_bounds


def _project(scene, i, p):
    """Pixel coordinates (P, 2) (u, v) of world points p (P, 3) in camera i of a parsed scene."""
    c2w = np.asarray(scene.c2w[i], np.float64)
    fx, fy, cx, cy = np.asarray(scene.intrinsics[i], np.float64)
    q = (p - c2w[:, 3]) @ c2w[:, :3]  # camera axes (OpenGL)
    return np.stack([fx * q[:, 0] / -q[:, 2] + cx, -fy * q[:, 1] / -q[:, 2] + cy], 1)


@pytest.mark.parametrize("kind, fmt, downscale", [("forward", "llff", 1), ("forward", "llff", 4),
                                                  ("forward", "llff", 8), ("unbounded", "nerfstudio", 1)])
def test_parsed_poses_project_known_points(forward_scene, unbounded_scene, kind, fmt, downscale):
    """A surface point the generator saw through pixel (row, col) of a view projects, with the
    parsed pose and intrinsics, to that pixel's centre in the (downscaled) image."""

    out, kw = forward_scene if kind == "forward" else unbounded_scene
    scene = load_scene(out, "train", format=fmt, downscale=downscale)
    cams = _gen_cameras(kind, "train", kw)
    w, h = cams["width"], cams["height"]
    assert (scene.width == w // downscale).all() and (scene.height == h // downscale).all()
    rng = np.random.default_rng(7)
    cam = rng.integers(0, scene.num_images, 300)
    row, col = rng.integers(0, h, 300).astype(np.float64), rng.integers(0, w, 300).astype(np.float64)
    o, d = _ref_rays(cams["c2w"][cam], cams["intrinsics"][cam], row, col)
    hit = sg.render_scene_rays(kind, o, d, kw["seed"])
    assert (hit["alpha"] == 1).all()  # every pixel sees a surface: nothing to composite
    m = np.asarray(scene.world_from_source, np.float64)
    p_world = hit["points"] @ m[:3, :3].T + m[:3, 3]
    for i in np.unique(cam):
        sel = cam == i
        uv = _project(scene, i, p_world[sel])
        want = np.stack([col[sel] + 0.5, row[sel] + 0.5], 1) * np.array([scene.width[i] / w, scene.height[i] / h])
        np.testing.assert_allclose(uv, want, atol=2e-3)


def test_deterministic_bytes(tmp_path):
    for kind in ("objects", "city", "forward", "unbounded"):
        kw = dict(width=24, n_train=3, n_val=1, n_test=1 if kind == "objects" else 0)
        if kind == "forward":
            kw.update(width=32, n_train=9, n_val=0)
        a = _digest(sg.make_scene(kind, tmp_path / f"{kind}_a", seed=7, **kw))
        b = _digest(sg.make_scene(kind, tmp_path / f"{kind}_b", seed=7, **kw))
        c = _digest(sg.make_scene(kind, tmp_path / f"{kind}_c", seed=8, **kw))
        assert a == b
        assert a.keys() == c.keys() and a != c
        images = [k for k in a if k.endswith((".png", ".jpg"))]
        assert sum(a[k] != c[k] for k in images) >= len(images) // 2  # the layout changed, not one file


def test_render_scene_rays_analytic():
    # straight down onto the objects' floor disc near its rim (outside the objects' footprint)
    o = np.array([[1.18, 0.0, 3.0], [0.0, 1.18, 3.0]])
    d = np.array([[0.0, 0.0, -1.0], [0.0, 0.0, -2.0]])  # not unit: normalised inside
    r = sg.render_scene_rays("objects", o, d, seed=0)
    np.testing.assert_allclose(r["depth"], 3.45, rtol=1e-12)  # floor at z = -0.45
    np.testing.assert_allclose(r["points"][:, 2], -0.45, atol=1e-12)
    up = sg.render_scene_rays("objects", [[0, 0, 4.0]], [[0, 0, 1.0]])
    assert up["alpha"][0] == 0 and np.isinf(up["depth"][0]) and np.isnan(up["points"][0]).all()
    # city: a vertical ray over the ground outside the lots hits z = 0 from altitude 1
    c = sg.render_scene_rays("city", torch.tensor([[1.45, -1.45, 1.0]]), torch.tensor([[0.0, 0.0, -1.0]]))
    assert c["depth"][0] == pytest.approx(1.0) and c["alpha"][0] == 1
    assert ((c["rgb"] >= 0) & (c["rgb"] <= 1)).all()
    # rays from one camera through a building roof: depth = altitude - roof height
    world = worlds.scene_world("city", 0)
    boxes = [p for p in world.prims if isinstance(p, tracer.BoxSet)][0]
    centre = 0.5 * (boxes.lo + boxes.hi)
    hits = sg.render_scene_rays("city", np.c_[centre[:, :2], np.full(len(centre), 2.0)], np.tile([0, 0, -1.0], (len(centre), 1)))
    np.testing.assert_allclose(hits["depth"], 2.0 - boxes.hi[:, 2], rtol=1e-12)


def test_refuses_to_overwrite_and_force(tmp_path):
    out = tmp_path / "s"
    kw = dict(width=16, n_train=1, n_val=1, n_test=1)
    sg.make_scene("objects", out, **kw)
    with pytest.raises(DaliNerfError) as e:
        sg.make_scene("objects", out, **kw)
    msg = str(e.value)
    assert str(out) in msg and "--force" in msg and "\n" not in msg
    (out / "stale.txt").write_text("x")
    sg.make_scene("objects", out, force=True, **kw)
    assert not (out / "stale.txt").exists() and (out / "transforms_train.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no temp or old folders left
    empty = tmp_path / "empty"
    empty.mkdir()
    sg.make_scene("objects", empty, **kw)  # an empty folder is fine without force


def test_crash_leaves_nothing(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = writers._write_image

    def failing(path, rgba, fmt):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        real(path, rgba, fmt)

    monkeypatch.setattr(writers, "_write_image", failing)
    with pytest.raises(OSError):
        sg.make_scene("city", tmp_path / "c", width=16, n_train=4, n_val=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kw, key", [
    (dict(width=4), "width"), (dict(n_train=0), "n_train"), (dict(n_test=0), "n_test"),
    (dict(image_format="tiff"), "image_format"), (dict(seed=-1), "seed"), (dict(width=16.5), "width"),
])
def test_bad_values(tmp_path, kw, key):
    with pytest.raises(ConfigError) as e:
        sg.make_scene("objects", tmp_path / "x", **kw)
    assert key in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match="kind"):
        sg.make_scene("forest", tmp_path / "x")


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["make-scene", "city", "--out", str(out), "--resolution", "32", "--images", "4", "--seed", "2"]) == 0
    assert "4 train" in capsys.readouterr().out
    m = torch.load(out / "train" / "metadata" / "000000.pt", weights_only=True)
    assert (m["W"], m["H"]) == (32, 24)
    assert main(["make-scene", "city", "--out", str(out), "--resolution", "32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "--force" in err and len(err.splitlines()) == 1
    assert main(["make-scene", "objects", "--out", str(tmp_path / "j"), "--resolution", "16", "--images", "2", "--jpeg"]) == 0
    assert (tmp_path / "j" / "train" / "r_1.jpg").exists()


@pytest.mark.parametrize("kw, key", [
    (dict(width=36), "width"), (dict(width=32, height=20), "height"), (dict(width=32, n_val=1), "n_val"),
    (dict(width=32, n_train=1), "n_train"),
])
def test_forward_bad_values(tmp_path, kw, key):
    with pytest.raises(ConfigError) as e:
        sg.make_scene("forward", tmp_path / "x", **kw)
    assert key in str(e.value) and "forward" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()


def test_cli_new_kinds(tmp_path, capsys):
    assert main(["make-scene", "forward", "--out", str(tmp_path / "f"), "--resolution", "32", "--images", "9"]) == 0
    assert "LLFF" in capsys.readouterr().out
    assert (tmp_path / "f" / "images_8" / "image_008.jpg").exists()
    assert main(["make-scene", "forward", "--out", str(tmp_path / "g"), "--resolution", "36"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "multiple of 8" in err and len(err.splitlines()) == 1
    assert main(["make-scene", "unbounded", "--out", str(tmp_path / "u"), "--resolution", "16", "--images", "3"]) == 0
    assert "3 train" in capsys.readouterr().out
    assert (tmp_path / "u" / "images" / "frame_00003.jpg").exists()


@pytest.mark.parametrize("kind", ["objects", "forward"])
def test_parallel_rendering_writes_the_same_bytes(tmp_path, monkeypatch, kind):
    """Scenes of PARALLEL_PIXELS or more (on PARALLEL_CORES or more) render in spawned processes, one group of cameras each,
    in camera order: the same files, byte for byte, as one process (forward also writes depth-
    derived bounds)."""
    from dali_nerf.scenegen import writers

    kw = dict(width=32, n_train=5, seed=4) if kind == "forward" else dict(width=24, n_train=3, n_val=1, n_test=1, seed=4)
    serial = sg.make_scene(kind, tmp_path / "serial", **kw)
    monkeypatch.setattr(writers, "PARALLEL_PIXELS", 0)
    monkeypatch.setattr(writers, "CHUNK", 64)  # one camera per group: several groups, several processes
    monkeypatch.setattr(writers, "PARALLEL_CORES", 2)
    monkeypatch.setattr(writers.os, "cpu_count", lambda: 2)
    parallel = sg.make_scene(kind, tmp_path / "parallel", **kw)
    files = sorted(p.relative_to(serial) for p in serial.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(parallel) for p in parallel.rglob("*") if p.is_file())
    for f in files:
        assert (serial / f).read_bytes() == (parallel / f).read_bytes(), f
