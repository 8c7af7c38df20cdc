"""Property: the op's rays follow ARCHITECTURE.md's formula for any camera.

Pixel (row, col) of camera i (pixel centres at +0.5, OpenGL axes)::

    d_cam = ((col + 0.5 - cx) / fx, -(row + 0.5 - cy) / fy, -1)
    origin = c2w[i, :, 3];  direction = normalize(c2w[i, :, :3] @ d_cam)

The reference below evaluates it in float64 numpy from the float32 values the Scene stores. The
op (through ``pipelines/rays.py::ray_pipeline`` over a cache whose camera rows are packed by
``pipelines/decode.py::pack_cameras``) runs one epoch of P rays, so every pixel of every image is
compared: origins, near and far exactly (copied), rgb exactly ``pixel / 255`` in float32, indices
exactly (camera index in the split, row, col), and directions within

    |d_op - d_ref|_inf <= TOL_ULPS * eps32 * cond,
    cond = (|col + 0.5| / fx + |cx| / fx + |row + 0.5| / fy + |cy| / fy + 1) / |d_cam|

``cond`` bounds how much float32 rounding of the formula's terms can move the unit direction: the
op computes ``A col + B row + C`` in float32 with A, B, C folded in double (ARCHITECTURE.md, "One
formula"), torch's ``rays_from_indices`` (the baselines' and trainers' formula, also checked here)
computes ``col + 0.5 - cx`` in float32; each term is rounded once or twice, then normalised.
Measured (8000 op runs over 19902 random cameras drawn as here, focal lengths log-uniform): the
worst error was 1.35 eps32 * cond for the op and 1.23 for torch; TOL_ULPS = 4 leaves a margin of
3x. The test also asserts its own power: for every ray the tolerance is below the change of the
reference direction when the pixel moves by half a pixel along its row or its column, so a
pixel-centre error (a missing +0.5, a row/col swap, a sign) cannot pass on any camera drawn.

Cameras: rotations from hypothesis-drawn quaternions, positions up to 1000 units, fx, fy from
0.5 to 2000 px, the principal point anywhere from far left/above the image to far right/below it,
non-square sizes from 1 px, cameras of a split in any order in the cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

pytest.importorskip("nvidia.dali")

from dali_nerf.ops import load_plugin  # noqa: E402
from dali_nerf.data.imagecache import ImageCache, pack_cameras  # noqa: E402
from dali_nerf.pipelines.rays import RAY_OUTPUTS, RayGraph, ray_pipeline, release_pipeline  # noqa: E402
from dali_nerf.data.rays import rays_from_indices  # noqa: E402
from dali_nerf.scenes.base import Scene  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
TOL_ULPS = 4.0


@pytest.fixture(scope="module", autouse=True)
def plugin():
    return load_plugin(cuda=False)


finite = dict(allow_nan=False, allow_infinity=False)


@st.composite
def cameras(draw, max_images=4):
    """A Scene of 1..max_images random cameras (image files never read) and the split indices
    the cache holds, in the cache's order."""
    n = draw(st.integers(1, max_images))
    c2w, K, wh, near, far = [], [], [], [], []
    for _ in range(n):
        q = np.array(draw(st.lists(st.floats(-1, 1, **finite), min_size=4, max_size=4)))
        assume(np.linalg.norm(q) > 0.1)
        w, x, y, z = q / np.linalg.norm(q)
        rot = np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])
        t = draw(st.lists(st.floats(-1000, 1000, **finite), min_size=3, max_size=3))
        width, height = draw(st.integers(1, 40)), draw(st.integers(1, 40))
        fx, fy = draw(st.floats(0.5, 2000, **finite)), draw(st.floats(0.5, 2000, **finite))
        cx = draw(st.floats(-3 * width - 50, 4 * width + 50, **finite))
        cy = draw(st.floats(-3 * height - 50, 4 * height + 50, **finite))
        lo = draw(st.floats(0, 100, **finite))
        c2w.append(np.concatenate([rot, np.array(t)[:, None]], axis=1))
        K.append((fx, fy, cx, cy))
        wh.append((width, height))
        near.append(lo)
        far.append(lo + draw(st.floats(1e-3, 1e4, **finite)))
    wh = np.array(wh)
    scene = Scene(image_paths=[f"/nonexistent/{i}.png" for i in range(n)], c2w=np.array(c2w), intrinsics=np.array(K),
                  width=wh[:, 0], height=wh[:, 1], split="train", format="blender", root="/nonexistent",
                  near=np.array(near), far=np.array(far))
    held = draw(st.permutations(range(n)))[:draw(st.integers(1, n))]
    return scene, np.array(held, np.int64)


def make_cache(scene, held, rng) -> ImageCache:
    """pixels (P, 3) random, cameras packed by pack_cameras, layout (offset, w, h, split index)."""
    w, h = scene.width[held], scene.height[held]
    offsets = np.concatenate([[0], np.cumsum(w * h)[:-1]])
    layout = np.stack([offsets, w, h, held], axis=1).astype(np.int64)
    pixels = rng.integers(0, 256, size=(int((w * h).sum()), 3), dtype=np.uint8)
    return ImageCache(pixels=pixels, cameras=pack_cameras(scene, held), layout=layout)


def reference(scene, idx):
    """float64 origins, unit directions and cond (see the module doc) of index rows (B, 3)."""
    cam, row, col = idx.T
    c2w = scene.c2w[cam].astype(np.float64)
    fx, fy, cx, cy = scene.intrinsics[cam].astype(np.float64).T
    d_cam = np.stack([(col + 0.5 - cx) / fx, -(row + 0.5 - cy) / fy, -np.ones(len(idx))], -1)
    d = np.einsum("bij,bj->bi", c2w[:, :, :3], d_cam)
    norm = np.linalg.norm(d, axis=1)
    cond = ((np.abs(col + 0.5) + np.abs(cx)) / fx + (np.abs(row + 0.5) + np.abs(cy)) / fy + 1) / np.linalg.norm(d_cam, axis=1)
    return c2w[:, :, 3], d / norm[:, None], cond


def run_epoch(cache, seed):
    """One op run of P rays in epoch mode (every pixel once): dict of numpy outputs."""
    pipe = ray_pipeline(cache, RayGraph(cache.num_pixels, "epoch", seed, num_threads=1, prefetch=0))
    try:
        out = {k: np.array(v[0]).copy() for k, v in zip(RAY_OUTPUTS, pipe.run())}
    finally:
        release_pipeline(pipe)
    return out


def half_pixel_change(scene, idx, d_ref):
    """(B,) the smaller inf-norm change of the reference direction when the pixel centre moves by
    half a pixel along the row or along the column."""
    moved = []
    for axis in (1, 2):
        cam, row, col = idx.T.astype(np.float64)
        c2w = scene.c2w[idx[:, 0]].astype(np.float64)
        fx, fy, cx, cy = scene.intrinsics[idx[:, 0]].astype(np.float64).T
        row, col = (row + 0.5, col) if axis == 1 else (row, col + 0.5)
        d = np.einsum("bij,bj->bi", c2w[:, :, :3], np.stack([(col + 0.5 - cx) / fx, -(row + 0.5 - cy) / fy,
                                                             -np.ones(len(idx))], -1))
        moved.append(np.abs(d / np.linalg.norm(d, axis=1, keepdims=True) - d_ref).max(axis=1))
    return np.minimum(*moved)


def check_directions(got, ref, cond, what):
    err = np.abs(got.astype(np.float64) - ref).max(axis=1)
    worst = int(np.argmax(err / cond))
    assert (err <= TOL_ULPS * EPS32 * cond).all(), (
        f"{what}: direction error {err[worst]:.3g} = {err[worst] / (EPS32 * cond[worst]):.2f} eps32 * cond "
        f"(cond {cond[worst]:.3g}) > {TOL_ULPS} eps32 * cond")


@settings(max_examples=150)
@given(cams=cameras(), seed=st.integers(0, 2 ** 63 - 1), data_seed=st.integers(0, 2 ** 32 - 1))
def test_op_rays_match_numpy_reference(cams, seed, data_seed):
    scene, held = cams
    cache = make_cache(scene, held, np.random.default_rng(data_seed))
    out = run_epoch(cache, seed)
    P = cache.num_pixels
    idx = out["indices"]
    assert idx.dtype == np.int64 and idx.shape == (P, 3) and int(out["consumed"][0]) == P
    # indices: a split camera the cache holds, a pixel inside it, every pixel once (epoch)
    slot = {int(c): i for i, c in enumerate(held)}
    assert set(idx[:, 0].tolist()) <= set(slot)
    img = np.array([slot[int(c)] for c in idx[:, 0]])
    lay = cache.layout
    assert ((idx[:, 1] >= 0) & (idx[:, 1] < lay[img, 2]) & (idx[:, 2] >= 0) & (idx[:, 2] < lay[img, 1])).all()
    pid = lay[img, 0] + idx[:, 1] * lay[img, 1] + idx[:, 2]
    assert np.array_equal(np.sort(pid), np.arange(P))
    # rgb: the pixel's bytes / 255 in float32; near, far: the camera's; origins: its position
    assert out["rgb"].dtype == np.float32
    assert np.array_equal(out["rgb"], cache.pixels[pid].astype(np.float32) / np.float32(255))
    assert np.array_equal(out["near"][:, 0], scene.near[idx[:, 0]])
    assert np.array_equal(out["far"][:, 0], scene.far[idx[:, 0]])
    o_ref, d_ref, cond = reference(scene, idx)
    assert np.array_equal(out["origins"].astype(np.float64), o_ref)
    tol = TOL_ULPS * EPS32 * cond
    assert (tol < half_pixel_change(scene, idx, d_ref)).all(), "the tolerance would let a half-pixel error pass"
    check_directions(out["directions"], d_ref, cond, "op")
    # the torch formula of the baselines and trainers, on the same pixels
    o_t, d_t = rays_from_indices(torch.from_numpy(np.array(scene.c2w)), torch.from_numpy(np.array(scene.intrinsics)),
                                 torch.from_numpy(idx))
    assert np.array_equal(o_t.numpy().astype(np.float64), o_ref)
    check_directions(d_t.numpy(), d_ref, cond, "rays_from_indices")
