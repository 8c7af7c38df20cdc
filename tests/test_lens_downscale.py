"""Decode-time undistortion, area downscale and the background choice, against independent references.

* Lens: dots placed where ``cv2.projectPoints`` / ``cv2.fisheye.projectPoints`` put 3-D points
  through the distortion model are drawn into a nerfstudio scene's images; after ``decode_cache``
  each dot's centroid must sit where the *pinhole* projection with the Scene's (undistorted)
  intrinsics says.
* Downscale: an integer factor is the exact block mean of the full-resolution (composited) image,
  a non-integer one the exact area-weighted mean, within rounding.
* Background: ``scene.background`` names, per-format defaults and the decode's refusal of alpha
  under random / learned.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from _tiny_scene import reference_pixels, tiny_scene
from dali_nerf.config import load_config
from dali_nerf.errors import ConfigError, DataError, SceneError
from dali_nerf.data.finish import area_weights, background_u8, finish_image, finish_torch, undistort_maps
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.scenes import load_scene

W, H = 160, 120
K = (150.0, 148.0, 81.3, 58.7)  # fx, fy, cx, cy (pixel centres at +0.5)
# 3-D points in the OpenCV camera frame (x right, y down, z forward): a 6 x 5 grid across the view
_xs, _ys = np.meshgrid(np.linspace(-0.38, 0.38, 6), np.linspace(-0.27, 0.27, 5))
PTS = np.stack([_xs.ravel(), _ys.ravel(), np.ones(_xs.size)], 1) * 2.0


def _distorted_uv(model: str, coeffs: dict) -> np.ndarray:
    """(M, 2) positions of PTS in the distorted image, our convention (OpenCV's + 0.5)."""
    kcv = np.array([[K[0], 0, K[2] - 0.5], [0, K[1], K[3] - 0.5], [0, 0, 1]])
    if model == "OPENCV_FISHEYE":
        d = np.array([coeffs.get(k, 0.0) for k in ("k1", "k2", "k3", "k4")])
        uv, _ = cv2.fisheye.projectPoints(PTS[None], np.zeros(3), np.zeros(3), kcv, d)
    else:
        d = np.array([coeffs.get(k, 0.0) for k in ("k1", "k2", "p1", "p2", "k3", "k4", "k5", "k6")])
        uv, _ = cv2.projectPoints(PTS, np.zeros(3), np.zeros(3), kcv, d)
    return uv.reshape(-1, 2) + 0.5


def _dots(uv: np.ndarray, w: int, h: int, sigma: float = 1.2) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w] + 0.5
    img = np.zeros((h, w))
    for u, v in uv:
        img += np.exp(-((xx - u) ** 2 + (yy - v) ** 2) / (2 * sigma ** 2))
    return np.clip(np.round(img * 255), 0, 255).astype(np.uint8)


def make_distorted(root: Path, model: str, coeffs: dict, n: int = 3) -> np.ndarray:
    """A nerfstudio scene of ``n`` RGB PNG views of the dots; returns their distorted positions."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    uv = _distorted_uv(model, coeffs)
    img = np.repeat(_dots(uv, W, H)[:, :, None], 3, 2)
    frames = []
    for j in range(n):
        assert cv2.imwrite(str(root / "images" / f"f_{j}.png"), img)
        m = np.eye(4)
        m[:3, 3] = [0.1 * j, 0.0, 0.0]
        frames.append({"file_path": f"images/f_{j}.png", "transform_matrix": m.tolist()})
    meta = {"camera_model": model, "fl_x": K[0], "fl_y": K[1], "cx": K[2], "cy": K[3], "w": W, "h": H,
            "frames": frames, **coeffs, "train_filenames": [f["file_path"] for f in frames],
            "test_filenames": [frames[0]["file_path"]]}
    (root / "transforms.json").write_text(json.dumps(meta))
    return uv


def _centroids(img: np.ndarray, uv: np.ndarray, r: int = 4) -> np.ndarray:
    g = img[:, :, 0].astype(np.float64)
    out = []
    for u, v in uv:
        c0, r0 = int(u), int(v)
        win = g[r0 - r:r0 + r + 1, c0 - r:c0 + r + 1]
        yy, xx = np.mgrid[r0 - r:r0 + r + 1, c0 - r:c0 + r + 1] + 0.5
        out.append(((win * xx).sum() / win.sum(), (win * yy).sum() / win.sum()))
    return np.array(out)


LENSES = [
    ("OPENCV", {"k1": -0.18, "k2": 0.04, "p1": 0.002, "p2": -0.0015, "k3": 0.01}),  # barrel + tangential
    ("OPENCV", {"k1": 0.12, "k2": -0.02}),  # pincushion
    ("FULL_OPENCV", {"k1": -0.2, "k2": 0.05, "p1": 0.001, "k4": 0.05, "k5": 0.01}),  # rational model
    ("OPENCV_FISHEYE", {"k1": 0.08, "k2": -0.02, "k3": 0.01, "k4": -0.003}),
]


@pytest.mark.parametrize("model,coeffs", LENSES, ids=["opencv_barrel", "opencv_pincushion", "full_opencv", "fisheye"])
@pytest.mark.parametrize("downscale", [1, 2])
def test_undistorted_dots_land_on_the_pinhole_projection(tmp_path, model, coeffs, downscale):
    uv_dist = make_distorted(tmp_path, model, coeffs)
    scene = load_scene(tmp_path, "train", downscale=downscale)
    assert scene.distorted.all() and scene.fisheye.all() == (model == "OPENCV_FISHEYE")
    cache = decode_cache(scene, 0, 1)
    for i in range(scene.num_images):
        k = scene.intrinsics[i].astype(np.float64)
        uv = np.stack([k[0] * PTS[:, 0] / PTS[:, 2] + k[2], k[1] * PTS[:, 1] / PTS[:, 2] + k[3]], 1)
        w, h = int(scene.width[i]), int(scene.height[i])
        inside = (uv[:, 0] > 6) & (uv[:, 0] < w - 6) & (uv[:, 1] > 6) & (uv[:, 1] < h - 6)
        assert inside.sum() >= 20
        err = np.linalg.norm(_centroids(np.asarray(cache.image(i)), uv[inside]) - uv[inside], axis=1)
        assert err.max() < 0.25, (model, downscale, err.max())
        if downscale == 1:  # the test has teeth: the dots as drawn are far from where they must land
            assert np.linalg.norm(uv_dist[inside] - uv[inside], axis=1).max() > 1.0


@pytest.mark.parametrize("model,coeffs", LENSES[:1] + LENSES[3:], ids=["opencv", "fisheye"])
def test_undistortion_maps_stay_inside_the_image(tmp_path, model, coeffs):
    """alpha = 0 intrinsics: (almost) every undistorted pixel was seen by the distorted camera."""
    make_distorted(tmp_path, model, coeffs, n=1)
    scene = load_scene(tmp_path, "train")
    mx, my = undistort_maps(scene, 0)
    assert mx.shape == my.shape == (H, W)
    out = (mx < -0.5) | (mx > W - 0.5) | (my < -0.5) | (my > H - 0.5)
    # perspective: exact; fisheye's balance=0 rule is built from the edge midpoints: corners may graze
    assert out.mean() <= (0.0 if model == "OPENCV" else 0.01)


# ---------------------------------------------------------------- area downscale ---------------
def test_area_weights():
    np.testing.assert_allclose(area_weights(6, 2), [[1 / 3] * 3 + [0] * 3, [0] * 3 + [1 / 3] * 3])
    w = area_weights(5, 2)  # s = 2.5: the middle pixel is split half and half
    np.testing.assert_allclose(w, [[0.4, 0.4, 0.2, 0, 0], [0, 0, 0.2, 0.4, 0.4]])
    np.testing.assert_allclose(area_weights(801, 400).sum(1), 1.0)
    with pytest.raises(ValueError):
        area_weights(3, 4)


def _downscaled(scene, w, h):
    """The same images declared at (w, h): the decode resizes from the file size."""
    s = np.array([w, h, w, h], np.float64) / np.array([scene.width[0], scene.height[0]] * 2)
    return dataclasses.replace(scene, width=np.full(scene.num_images, w), height=np.full(scene.num_images, h),
                               intrinsics=scene.intrinsics * s, downscale=2)


@pytest.mark.parametrize("kinds", [("png_rgb",), ("png_rgba",), ("png_gray",)])
def test_integer_downscale_is_the_block_mean(tmp_path, kinds):
    full = tiny_scene(tmp_path, n=3, width=24, height=16, kinds=kinds, background=(0.2, 0.5, 0.9))
    for d in (2, 4):
        scene = _downscaled(full, 24 // d, 16 // d)
        cache = decode_cache(scene, 0, 1)
        for i in range(3):
            ref = reference_pixels(full, i).astype(np.float64)  # composited at full size, then averaged
            mean = ref.reshape(16 // d, d, 24 // d, d, 3).mean(axis=(1, 3))
            got = np.asarray(cache.image(i)).astype(np.float64)
            assert np.abs(got - mean).max() <= 0.5 + 1e-9, (kinds, d)


def test_non_integer_downscale_is_the_area_weighted_mean(tmp_path):
    full = tiny_scene(tmp_path, n=2, width=25, height=17, kinds=("png_rgb", "png_rgba"))
    scene = _downscaled(full, 12, 8)  # ratios 25/12 and 17/8
    cache = decode_cache(scene, 0, 1)
    wy, wx = area_weights(17, 8), area_weights(25, 12)
    for i in range(2):
        ref = np.einsum("ab,bcx,dc->adx", wy, reference_pixels(full, i).astype(np.float64), wx)
        got = np.asarray(cache.image(i)).astype(np.float64)
        assert np.abs(got - ref).max() <= 0.5 + 1e-3


def test_downscale_is_area_not_the_old_linear_filter(tmp_path):
    """A one-pixel checkerboard halves to flat grey (box); a tent filter wider than the box would
    not reproduce the block mean of a pattern with a period of 3 pixels."""
    full = tiny_scene(tmp_path, n=1, width=24, height=24, kinds=("png_rgb",))
    yy, xx = np.mgrid[0:24, 0:24]
    img = np.where(((xx % 3) == 0) & ((yy % 3) == 0), 255, 0).astype(np.uint8)
    cv2.imwrite(full.image_paths[0], np.repeat(img[:, :, None], 3, 2))
    cache = decode_cache(_downscaled(full, 8, 8), 0, 1)
    np.testing.assert_array_equal(np.asarray(cache.image(0))[..., 0], np.full((8, 8), 28))  # round(255 / 9)


# ---------------------------------------------------------------- background -------------------
def _ns_scene(root: Path, channels: int):
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    frames = []
    for j in range(3):
        img = rng.integers(0, 256, (8, 10, channels), dtype=np.uint8)
        if channels == 4:
            img[0, 0, 3] = 0
        assert cv2.imwrite(str(root / "images" / f"f_{j}.png"), img)
        m = np.eye(4)
        m[:3, 3] = [0.1 * j, 0.0, 0.0]
        frames.append({"file_path": f"images/f_{j}.png", "transform_matrix": m.tolist()})
    (root / "transforms.json").write_text(json.dumps({"fl_x": 10.0, "w": 10, "h": 8, "frames": frames}))


def test_background_names_and_per_format_default(tmp_path):
    rgb, rgba = tmp_path / "rgb", tmp_path / "rgba"
    _ns_scene(rgb, 3)
    _ns_scene(rgba, 4)
    s = load_scene(rgb, "train")  # an RGB capture: nothing to composite; learned by default
    assert s.background_mode == "learned"
    np.testing.assert_array_equal(s.background, [1, 1, 1])  # the learned colour's initial value
    s = load_scene(rgba, "train", background="auto")  # alpha: composited over white, as before
    assert s.background_mode == "color"
    np.testing.assert_array_equal(s.background, [1, 1, 1])
    s = load_scene(rgba, "train", background="black")
    assert s.background_mode == "color"
    np.testing.assert_array_equal(s.background, [0, 0, 0])
    assert np.asarray(decode_cache(s, 0, 1).image(0))[0, 0].tolist() == [0, 0, 0]  # alpha 0 -> black
    s = load_scene(rgba, "train", background=[0.2, 0.5, 0.9])
    assert s.background_mode == "color"
    np.testing.assert_allclose(s.background, [0.2, 0.5, 0.9])
    assert load_scene(rgb, "train", background="random").background_mode == "random"
    with pytest.raises(SceneError) as e:
        load_scene(rgb, "train", background="grey")
    assert "background" in str(e.value) and "learned" in str(e.value)
    with pytest.raises(SceneError):
        load_scene(rgb, "train", background=[1.0, 2.0, 0.0])


@pytest.mark.parametrize("mode", ["random", "learned"])
def test_random_and_learned_decode_rgb_as_is_and_refuse_alpha(tmp_path, mode):
    rgb, rgba = tmp_path / "rgb", tmp_path / "rgba"
    _ns_scene(rgb, 3)
    _ns_scene(rgba, 4)
    s = load_scene(rgb, "train", background=mode)
    cache = decode_cache(s, 0, 1)
    for i in range(s.num_images):
        np.testing.assert_array_equal(cache.image(i), cv2.imread(s.image_paths[i])[:, :, ::-1])
    s = load_scene(rgba, "train", background=mode)
    with pytest.raises(DataError) as e:
        decode_cache(s, 0, 1)
    msg = str(e.value)
    assert "\n" not in msg and "f_0.png" in msg and f"scene.background={mode}" in msg and "alpha" in msg


def test_config_background_values():
    assert load_config(None, check_paths=False).scene.background == "auto"
    for v in ("white", "black", "random", "learned", "auto"):
        assert load_config(None, [f"scene.background={v}"], check_paths=False).scene.background == v
    assert load_config(None, ["scene.background=[0, 0.5, 1]"], check_paths=False).scene.background == [0, 0.5, 1]
    for bad in ("grey", "[1, 1]", "[0, 0, 2]", "true", "[a, b, c]"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"scene.background={bad}"], check_paths=False)
        assert "scene.background" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- the GPU path's torch code ----
@pytest.mark.parametrize("kinds,size,lens", [
    (("png_rgba", "png_gray", "png_rgb"), (24, 16), False),  # composite only: identical bytes
    (("png_rgba", "png_rgb"), (12, 8), False),               # + integer area downscale
    (("png_rgba", "png_rgb"), (10, 7), False),               # + non-integer area downscale
    (("png_rgb",), (W, H), True),                            # undistortion
])
def test_torch_finish_matches_the_cpu_path(tmp_path, kinds, size, lens):
    """``finish_torch`` (what the GPU decode runs, on the GPU) against ``finish_image`` (cv2)."""

    if lens:
        make_distorted(tmp_path, *LENSES[0], n=1)
        scene = load_scene(tmp_path, "train")
        maps = undistort_maps(scene, 0)
        paths, bg = scene.image_paths, scene.background
    else:
        full = tiny_scene(tmp_path, n=len(kinds), width=24, height=16, kinds=kinds, background=(0.2, 0.5, 0.9))
        maps, paths, bg = None, full.image_paths, full.background
    w, h = size
    bg255 = torch.as_tensor(background_u8(bg).astype(np.int32))
    for p in paths:
        img = cv2.imread(p, cv2.IMREAD_UNCHANGED)  # gray stays 1 channel, as DALI's ANY_DATA decode
        img = img[:, :, None] if img.ndim == 2 else img[:, :, [2, 1, 0, 3][:img.shape[2]]]
        img = np.ascontiguousarray(img)
        ref = finish_image(img, bg, np.empty((h, w, 3), np.uint8), maps)
        got = finish_torch(torch.as_tensor(img), bg255, torch.empty((h, w, 3), dtype=torch.uint8), maps).numpy()
        tol = 0 if (w, h) == (24, 16) and not lens else 1
        assert np.abs(got.astype(int) - ref.astype(int)).max() <= tol, p
