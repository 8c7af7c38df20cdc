"""Scene bounds from the cameras: the frustum box holds every pixel's [near, far] segment; the
camera rule for scenes with neither bounds nor a box; the robust far."""

import numpy as np
import pytest
import torch

from dali_nerf import scenegen as sg
from dali_nerf.data.rays import rays_from_indices
from dali_nerf.scenes import load_scene
from dali_nerf.scenes.bounds import (FAR_MEDIAN_FACTOR, camera_aabb, focus_point, frustum_aabb, robust_far,
                                     scene_bounds)


@pytest.fixture(scope="module")
def forward(tmp_path_factory):
    return sg.make_scene("forward", tmp_path_factory.mktemp("b") / "fw", width=64, n_train=10, seed=1)


def _all_segments(scene):
    """Both ends (2 * P, 3) float64 of every pixel's [near, far] segment, by the project's ray formula."""
    ends = []
    for i in range(scene.num_images):
        w, h = int(scene.width[i]), int(scene.height[i])
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        idx = torch.from_numpy(np.stack([np.full(h * w, i), rows.ravel(), cols.ravel()], 1))
        o, d = rays_from_indices(torch.from_numpy(scene.c2w.copy()), torch.from_numpy(scene.intrinsics.copy()), idx)
        o, d = o.double().numpy(), d.double().numpy()
        ends += [o + scene.near[i] * d, o + scene.far[i] * d]
    return np.concatenate(ends)


@pytest.mark.parametrize("split, downscale", [("train", 1), ("test", 1), ("train", 8)])
def test_frustum_box_holds_every_pixel_segment(forward, split, downscale):
    scene = load_scene(forward, split, format="llff", downscale=downscale)
    assert scene.aabb is None and scene.has_bounds
    box = scene_bounds(scene)
    np.testing.assert_array_equal(box, frustum_aabb(scene.c2w, scene.intrinsics, scene.width, scene.height,
                                                    scene.near, scene.far))  # fars alike: the cap is idle
    pts = _all_segments(scene)
    tol = 1e-5 * np.abs(box).max()
    assert (pts >= box[0] - tol).all() and (pts <= box[1] + tol).all()
    # tight: the pixel-centre segments span nearly all of it (the box reaches the pixel edges)
    px = 1.0 / min(int(scene.width[0]), int(scene.height[0]))
    assert ((pts.max(0) - pts.min(0)) >= (1.0 - 2.0 * px) * (box[1] - box[0])).all()
    # the optical-axis box (what training used before) misses most of the frusta
    pos, fwd = scene.c2w[:, :, 3], -scene.c2w[:, :, 2]
    axis = np.concatenate([pos + fwd * scene.near[:, None], pos + fwd * scene.far[:, None]])
    outside = ((pts < axis.min(0)) | (pts > axis.max(0))).any(1)
    assert outside.mean() > 0.3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_frustum_box_is_the_exact_box_of_the_frusta(seed):
    """Against brute force: dense unit directions over the image (edges included) at near and far."""
    rng = np.random.default_rng(seed)
    n = 5
    c2w = np.zeros((n, 3, 4))
    for i in range(n):  # random orientations, some looking along world axes' diagonals
        q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
        c2w[i, :, :3] = q * np.sign(np.linalg.det(q))
        c2w[i, :, 3] = rng.normal(size=3)
    w, h = rng.integers(20, 200, n), rng.integers(20, 200, n)
    k = np.stack([rng.uniform(0.3, 1.5, n) * w, rng.uniform(0.3, 1.5, n) * w, rng.uniform(0.2, 0.8, n) * w,
                  rng.uniform(0.2, 0.8, n) * h], 1)
    near, far = rng.uniform(0.1, 1.0, n), rng.uniform(2.0, 9.0, n)
    box = frustum_aabb(c2w, k, w, h, near, far)
    pts = []
    for i in range(n):
        uu, vv = np.meshgrid(np.linspace(0, w[i], 301), np.linspace(0, h[i], 301))
        d = np.stack([(uu.ravel() - k[i, 2]) / k[i, 0], -(vv.ravel() - k[i, 3]) / k[i, 1], -np.ones(uu.size)], 1)
        d = d / np.linalg.norm(d, axis=1, keepdims=True) @ c2w[i, :, :3].T
        pts += [c2w[i, :, 3] + near[i] * d, c2w[i, :, 3] + far[i] * d]
    pts = np.concatenate(pts)
    assert (pts >= box[0] - 1e-9).all() and (pts <= box[1] + 1e-9).all()
    np.testing.assert_allclose(pts.min(0), box[0], atol=2e-3 * np.abs(box).max())
    np.testing.assert_allclose(pts.max(0), box[1], atol=2e-3 * np.abs(box).max())


def test_robust_far_caps_outliers():
    np.testing.assert_allclose(robust_far(np.array([4.0, 5.0, 6.0, 100.0])), [4.0, 5.0, 6.0, 16.5])
    np.testing.assert_array_equal(robust_far(np.array([4.0, 100.0]), None), [4.0, 100.0])
    assert FAR_MEDIAN_FACTOR == 3.0


def test_scene_aabb_wins(tmp_path):
    out = sg.make_scene("objects", tmp_path / "o", width=16, n_train=3, n_val=1, n_test=1)
    scene = load_scene(out, "train")
    np.testing.assert_array_equal(scene_bounds(scene), [[-1.5] * 3, [1.5] * 3])


def test_camera_rule_inward_cameras():
    cams = sg.scene_cameras("objects", width=16, n_train=40, n_val=1, n_test=1)["train"]["c2w"]
    focus, inward = focus_point(cams)
    assert inward and np.linalg.norm(focus) < 1e-6  # every camera looks at the origin
    box = camera_aabb(cams)
    pos = cams[:, :, 3]
    assert (pos >= box[0] - 1e-9).all() and (pos <= box[1] + 1e-9).all()
    np.testing.assert_allclose(box, [[-4.0] * 3, [4.0] * 3], atol=0.3)  # cube around the focus, half side ~ radius


def test_camera_rule_outward_cameras(tmp_path):
    out = sg.make_scene("unbounded", tmp_path / "u", width=16, n_train=12, n_val=1)
    scene = load_scene(out, "train")  # transforms.json without near/far/aabb: the camera rule
    assert scene.aabb is None and not scene.has_bounds
    _, inward = focus_point(scene.c2w)
    assert not inward  # outward-looking: the centre is the mean camera position
    box = scene_bounds(scene)
    pos = scene.c2w[:, :, 3]
    np.testing.assert_allclose(0.5 * (box[0] + box[1]), pos.mean(0), atol=1e-5)
    assert (pos >= box[0] - 1e-6).all() and (pos <= box[1] + 1e-6).all()
    assert (box[1] - box[0]).max() < 1.0  # around the ring of cameras (radius 0.35), not a Blender box
