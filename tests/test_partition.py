"""Spatial-segmentation partitions: construction, exact routing vs brute force, weights, I/O."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import dali_nerf.partition
from dali_nerf.config import PartitionConfig
from dali_nerf.errors import ConfigError, SceneError
from dali_nerf.models.fused import point_weights
from dali_nerf.partition import (
    Partition, assign_rank, cell_fraction, export_mega_nerf, import_mega_nerf, load_masks,
    plane_axes, ray_cells, ray_cells_dense, scene_ray_bounds,
)
from dali_nerf.partition.routing import scene_rays
from dali_nerf.data.rays import image_rays
from dali_nerf.scenes.base import Scene


def lawnmower_scene(nx=6, nz=4, up="y", w=16, h=12, near=0.5, far=4.0):
    """Cameras on an nx x nz lawnmower grid over x in [-2, 2], z in [-1, 1] at altitude 2, looking
    straight down (OpenGL y up). ``up="-x"`` rotates the world into Mega-NeRF's DRB frame."""
    xs, zs = np.meshgrid(np.linspace(-2, 2, nx), np.linspace(-1, 1, nz), indexing="ij")
    pos = np.stack([xs.ravel(), np.full(xs.size, 2.0), zs.ravel()], 1)
    rot = np.stack([[1, 0, 0], [0, 0, -1], [0, 1, 0]], 1).astype(float)  # columns: cam x, y, z
    c2w = np.concatenate([np.repeat(rot[None], len(pos), 0), pos[:, :, None]], 2)
    upv = np.array([0.0, 1.0, 0.0])
    if up == "-x":  # world_drb = Q world_gl: down = -y_gl -> x, right = x_gl -> y, back = z_gl -> z
        Q = np.array([[0, -1, 0], [1, 0, 0], [0, 0, 1]], float)
        c2w = np.einsum("ij,njk->nik", Q, c2w)
        upv = Q @ upv
    n = len(pos)
    return Scene(
        image_paths=[f"/nowhere/img_{i:03d}.png" for i in range(n)], c2w=c2w,
        intrinsics=np.tile([w * 0.8, w * 0.8, w / 2, h / 2], (n, 1)), width=np.full(n, w),
        height=np.full(n, h), split="train", format="blender", root="/nowhere",
        near=np.full(n, near), far=np.full(n, far), up=upv,
    )


def random_rays(n, seed, box=3.0):
    rng = np.random.default_rng(seed)
    o = rng.uniform(-box, box, (n, 3))
    d = rng.normal(size=(n, 3))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    near = rng.uniform(0, 1, n)
    far = near + rng.uniform(1e-3, 5, n)
    return o, d, near, far


def point_condition(part, p, j):
    """Independent check of the point rule at points p (n, 3) for cells j (n,)."""
    P = np.eye(3) if part.dims == 3 else np.eye(3) - np.outer(part.up, part.up)
    dist = np.linalg.norm((p[:, None, :] - part.centroids[None].astype(np.float64)) @ P, axis=-1)
    return dist[np.arange(len(p)), j] <= part.margin * dist.min(1)


# ---- construction ---------------------------------------------------------------------------


def test_grid_2x2_over_lawnmower():
    scene = lawnmower_scene()
    part = Partition.from_config(PartitionConfig(kind="grid", grid=[2, 2]), scene)
    assert part.num_cells == 4 and part.dims == 2 and part.grid == (2, 2)
    # grid cell centres of the extent x in [-2, 2], z in [-1, 1]; altitude = the cameras' (2)
    expect = [[-1, 2, -0.5], [-1, 2, 0.5], [1, 2, -0.5], [1, 2, 0.5]]
    np.testing.assert_allclose(part.centroids, expect, atol=1e-6)
    # the same layout in Mega-NeRF's DRB frame: grid along y (right) then z (back)
    drb = lawnmower_scene(up="-x")
    pd = Partition.from_config(PartitionConfig(grid=[2, 2]), drb)
    np.testing.assert_allclose(pd.up, [-1, 0, 0])
    np.testing.assert_allclose(plane_axes(pd.up), [[0, 1, 0], [0, 0, 1]], atol=1e-12)
    np.testing.assert_allclose(pd.centroids, [[-2, -1, -0.5], [-2, -1, 0.5], [-2, 1, -0.5], [-2, 1, 0.5]], atol=1e-6)


def test_grid_degenerate_axis_is_a_config_error():
    scene = lawnmower_scene(nx=5, nz=1)  # all cameras on one line
    with pytest.raises(ConfigError, match="partition.grid"):
        Partition.from_config(PartitionConfig(grid=[2, 2]), scene)
    assert Partition.from_config(PartitionConfig(grid=[3, 1]), scene).num_cells == 3


def test_kmeans_deterministic_and_sensible():
    scene = lawnmower_scene()
    cfg = PartitionConfig(kind="kmeans", cells=4)
    a = Partition.from_config(cfg, scene)
    b = Partition.from_config(cfg, scene)
    assert a == b and a.kind == "kmeans"
    pos = scene.c2w[:, :, 3].astype(np.float64)
    # every centroid at camera altitude, inside the camera extent, and distinct
    np.testing.assert_allclose(a.centroids[:, 1], 2.0, atol=1e-6)
    assert np.all(a.centroids.min(0)[[0, 2]] >= pos.min(0)[[0, 2]] - 1e-6)
    assert np.all(a.centroids.max(0)[[0, 2]] <= pos.max(0)[[0, 2]] + 1e-6)
    assert len(np.unique(np.round(a.centroids, 5), axis=0)) == 4
    # it is a fixed point of Lloyd's iteration: each centroid is the mean of its cameras
    lab = np.argmin(((pos[:, None, [0, 2]] - a.centroids[None][:, :, [0, 2]]) ** 2).sum(-1), 1)
    for j in range(4):
        np.testing.assert_allclose(a.centroids[j, [0, 2]], pos[lab == j][:, [0, 2]].mean(0), atol=1e-5)
    a3 = Partition.from_config(PartitionConfig(kind="kmeans", cells=3, dims=3), scene)
    assert a3.dims == 3 and a3.num_cells == 3
    with pytest.raises(ConfigError, match="partition.cells"):
        Partition.from_config(PartitionConfig(kind="kmeans", cells=25), scene)


def test_save_load_round_trip(tmp_path):
    part = Partition.from_config(PartitionConfig(grid=[3, 2], margin=1.2), lawnmower_scene())
    f = tmp_path / "partition.json"
    part.save(f)
    json.loads(f.read_text())  # plain JSON
    back = Partition.load(f)
    assert back == part and back.margin == 1.2 and back.grid == (3, 2)
    f.write_text("{not json")
    with pytest.raises(ConfigError, match="partition.json"):
        Partition.load(f)
    f.write_text(json.dumps({"format": "dali_nerf.partition", "margin": 1.1}))
    with pytest.raises(ConfigError, match="partition.json"):
        Partition.load(f)
    with pytest.raises(ConfigError, match="not found"):
        Partition.load(tmp_path / "missing.json")



def test_save_load_keeps_bounds_axes_and_no_grid(tmp_path):
    """A k-means partition (no grid) with a routing box and its own plane axes comes back equal,
    float32, from its file; the file names its format and version; a file of another format or
    not a JSON object is refused in one line naming the file."""
    scene = lawnmower_scene()
    km = Partition.from_config(PartitionConfig(kind="kmeans", cells=3), scene)
    axes = np.array([[0.6, 0.0, 0.8], [0.8, 0.0, -0.6]], np.float32)  # not plane_axes(up)
    part = dataclasses.replace(km, axes=axes, bounds=np.array([[-2.5, -1, -1.5], [2.5, 1.0, 1.5]]))
    assert part.grid is None and not np.array_equal(part.axes, plane_axes(part.up))
    f = tmp_path / "kmeans.json"
    part.save(f)
    d = json.loads(f.read_text())
    assert d["format"] == "dali_nerf.partition" and d["version"] == 1 and d["grid"] is None
    back = Partition.load(f)
    assert back == part and back.bounds is not None and back.bounds.dtype == np.float32
    np.testing.assert_array_equal(back.bounds, [[-2.5, -1, -1.5], [2.5, 1.0, 1.5]])
    np.testing.assert_array_equal(back.axes, axes)
    assert Partition.load(f).cells_for_rank(1, 2) == assign_rank(3, 2)[1] == [1]
    f.write_text(json.dumps(dict(d, format="other")))
    with pytest.raises(ConfigError, match=r"kmeans.json: not a valid partition file \(not a dali_nerf.partition file\)"):
        Partition.load(f)
    f.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"kmeans.json: not a valid partition file; write it with Partition.save"):
        Partition.load(f)
    with pytest.raises(ConfigError, match=r"world size: must be >= 1, got 0"):
        assign_rank(3, 0)

def test_assign_rank():
    assert assign_rank(4, 4) == [[0], [1], [2], [3]]
    assert assign_rank(5, 2) == [[0, 2, 4], [1, 3]]
    assert assign_rank(6, 1) == [[0, 1, 2, 3, 4, 5]]
    with pytest.raises(ConfigError) as e:
        assign_rank(4, 8)
    msg = str(e.value)
    assert "partition.grid" in msg and "world size 8" in msg and "\n" not in msg


# ---- exact routing --------------------------------------------------------------------------


def test_exact_vs_dense_1e5_rays_2d():
    part = Partition.from_config(PartitionConfig(grid=[2, 2]), lawnmower_scene())
    o, d, near, far = random_rays(100_000, seed=0)
    exact, t = ray_cells(part, o, d, near, far, return_t=True)
    dense, ratio = ray_cells_dense(part, o, d, near, far, samples=200, return_ratio=True)
    agree = (exact == dense).all(1).mean()
    assert agree >= 0.999, agree
    # every ray is in >= 1 cell; exact has a witness t in [near, far] for every membership
    assert exact.sum(1).min() >= 1
    b, j = np.nonzero(exact)
    tw = t[b, j]
    assert np.all((tw >= near[b] - 1e-12) & (tw <= far[b] + 1e-12))
    assert np.all(point_condition(part, o[b] + tw[:, None] * d[b], j))
    assert np.isnan(t[~exact]).all()
    # dense may miss short stretches but never finds what exact rejects (except ties)
    fp = dense & ~exact
    assert np.all(np.abs(ratio[fp] - part.margin) < 1e-9)
    # a disagreement, explained: the exact witness satisfies the point rule, dense missed it
    miss = np.argwhere(exact & ~dense)
    assert len(miss) > 0, "expected dense sampling at 200 points to miss a short stretch"
    rb, rj = miss[0]
    p = o[rb] + t[rb, rj] * d[rb]
    assert point_condition(part, p[None], np.array([rj]))[0]
    assert ratio[rb, rj] > part.margin  # every dense sample was outside cell rj


def test_exact_vs_dense_3d_and_kmeans():
    part = Partition.from_config(PartitionConfig(kind="kmeans", cells=5, dims=3), lawnmower_scene())
    o, d, near, far = random_rays(20_000, seed=1)
    exact, t = ray_cells(part, o, d, near, far, return_t=True)
    dense = ray_cells_dense(part, o, d, near, far, samples=400)
    assert (exact == dense).all(1).mean() >= 0.999
    assert not (dense & ~exact).any()
    b, j = np.nonzero(exact)
    assert np.all(point_condition(part, o[b] + t[b, j][:, None] * d[b], j))



def test_exact_vs_dense_with_a_routing_box_scalar_bounds_and_margin_one():
    """Both routings clip rays to the partition's box the same way (the clipped segment's cells, a
    subset of the whole segment's; a ray that misses the box keeps its segment); a scalar near / far stands for
    every ray's; with margin 1 every ray that meets the box is in at least one cell (the nearest
    centroid's: ratio 1 <= margin); shapes are checked naming the argument."""
    part = dataclasses.replace(Partition.from_config(PartitionConfig(kind="kmeans", cells=4, dims=3), lawnmower_scene()),
                               bounds=np.array([[-1.5, -0.5, -1.0], [1.5, 1.5, 1.0]]))
    o, d, near, far = random_rays(4000, seed=2)
    exact = ray_cells(part, o, d, 0.1, 5.0)
    np.testing.assert_array_equal(exact, ray_cells(part, o, d, np.full(len(o), 0.1), np.full((len(o), 1), 5.0)))
    dense = ray_cells_dense(part, o, d, 0.1, 5.0, samples=400)
    assert not (dense & ~exact).any() and (exact == dense).all(1).mean() >= 0.995
    unbounded = ray_cells(dataclasses.replace(part, bounds=None), o, d, 0.1, 5.0)
    assert (unbounded & ~exact).any() and not (exact & ~unbounded).any()
    one = dataclasses.replace(part, margin=1.0, bounds=None)
    assert ray_cells_dense(one, o, d, near, far, samples=50).any(1).all()
    for fn in (ray_cells, ray_cells_dense):
        with pytest.raises(ValueError, match=r"^origins must have shape \(B, 3\), got \(4000, 2\)$"):
            fn(part, o[:, :2], d, near, far)
        with pytest.raises(ValueError, match=r"^near must have shape \(B,\) or \(B, 1\), got \(3\,\)$"):
            fn(part, o, d, near[:3], far)
        with pytest.raises(ValueError, match=r"^far must have shape \(B,\) or \(B, 1\), got \(3\,\)$"):
            fn(part, o, d, near, far[:3])

def test_grazing_ray_dense_misses():
    # 3 cells in the plane perpendicular to up = z; cell 2's region has a corner at (0, y_b)
    m = 1.15
    part = Partition(np.array([[-1, 0, 5], [1, 0, -3], [0, 1, 0]], np.float32), m, 2, [0, 0, 1])
    # bottom corner of cell 2 on x = 0: (1 - y)^2 = m^2 (1 + y^2), the root in (-1, 0)
    A, Bq, Cq = 1 - m * m, -2.0, 1 - m * m
    y_b = (-Bq - math.sqrt(Bq * Bq - 4 * A * Cq)) / (2 * A)
    assert -1 < y_b < 0
    eps = 1e-6
    o = np.array([[-2.0, y_b + eps, 0.3]])
    d = np.array([[1.0, 0.0, 0.7]]) / math.sqrt(1.49)  # the z part is ignored in 2-D
    near, far = np.array([0.0]), np.array([4.0 * math.sqrt(1.49)])
    exact, t = ray_cells(part, o, d, near, far, return_t=True)
    dense = ray_cells_dense(part, o, d, near, far, samples=1000)
    assert exact[0, 2] and not dense[0, 2]
    p = o[0] + t[0, 2] * d[0]
    assert abs(p[0]) < 1e-3 and point_condition(part, p[None], np.array([2]))[0]
    # just below the corner the ray never enters cell 2
    o2 = o.copy()
    o2[0, 1] = y_b - 1e-4
    assert not ray_cells(part, o2, d, near, far)[0, 2]


def test_degenerate_rays():
    part = Partition(np.array([[-1, 0, 0], [1, 0, 0], [0, 0, 3]], np.float32), 1.15, 2, [0, 1, 0])
    # a ray straight along up: in the plane it is a point -> same cells as that point
    o = np.array([[-0.9, -5, 0.0], [0.1, 3, 0.0], [5.0, 0, 5.0]])
    d = np.array([[0, 1.0, 0], [0, -1.0, 0], [0, 1.0, 0]])
    near, far = np.zeros(3), np.full(3, 10.0)
    got = ray_cells(part, o, d, near, far)
    want = point_weights(part, o) > 0
    np.testing.assert_array_equal(got, want)
    # zero-length segments: the cells of the point
    o, d, _, _ = random_rays(2000, seed=3)
    t0 = np.random.default_rng(4).uniform(0, 2, 2000)
    got = ray_cells(part, o, d, t0, t0)
    np.testing.assert_array_equal(got, point_weights(part, o + t0[:, None] * d) > 0)
    # unbounded rays (far = inf) are handled; far away every cell is within the margin
    o, d, near, _ = random_rays(500, seed=7)
    got, t = ray_cells(part, o, d, near, np.full(500, np.inf), return_t=True)
    assert got.all() and np.isfinite(t).all()
    # margin 1 and a ray parallel to a Voronoi boundary (linear coefficient b == 0 case)
    p1 = Partition(part.centroids, 1.0, 3, [0, 1, 0])
    o = np.array([[0.0, 0.0, -1.0], [0.2, 0, -1.0]])
    d = np.array([[0, 0, 1.0], [0, 0, 1.0]])
    got = ray_cells(p1, o, d, np.zeros(2), np.full(2, 1.5))
    np.testing.assert_array_equal(got, [[True, True, False], [False, True, False]])


def test_margin_one_cells_disjoint():
    scene = lawnmower_scene()
    part = Partition.from_config(PartitionConfig(grid=[2, 2], margin=1.0), scene)
    o, d, near, far = random_rays(20_000, seed=5)
    got = ray_cells(part, o, d, near, far)
    # a ray is entirely inside one Voronoi region iff both ends are (the regions are convex)
    a = point_weights(part, o + near[:, None] * d)
    b = point_weights(part, o + far[:, None] * d)
    one = ((a > 0).sum(1) == 1) & ((b > 0).sum(1) == 1) & (np.argmax(a, 1) == np.argmax(b, 1))
    assert one.mean() > 0.2
    np.testing.assert_array_equal(got[one].sum(1), 1)
    assert np.all(got[one, np.argmax(a[one], 1)])
    # rays that cross a boundary are in both sides' cells
    crossing = ~one & ((a > 0).sum(1) == 1) & ((b > 0).sum(1) == 1)
    assert np.all(got[crossing, np.argmax(a[crossing], 1)]) and np.all(got[crossing, np.argmax(b[crossing], 1)])


# ---- point weights --------------------------------------------------------------------------


def test_point_weights_margin_one_and_blend():
    part = Partition(np.array([[-1, 0, 0], [1, 0, 0], [0, 0, 2]], np.float32), 1.0, 2, [0, 1, 0])
    x = np.random.default_rng(6).uniform(-3, 3, (5000, 3))
    w = point_weights(part, x)
    np.testing.assert_allclose(w.sum(1), 1)
    assert np.all((w > 0).sum(1) == 1)  # random points are not on boundaries
    # exactly on the x = 0 boundary (equidistant from cells 0 and 1, farther from cell 2)
    wb = point_weights(part, np.array([[0.0, 7.0, -1.0]]))
    np.testing.assert_allclose(wb, [[0.5, 0.5, 0.0]])
    # margin band: inverse-distance weights, checked by hand
    pm = Partition(part.centroids, 1.15, 2, [0, 1, 0])
    xq = np.array([[0.05, 3.0, 0.0]])  # dist 1.05 to c0, 0.95 to c1, sqrt(0.05^2+4) to c2
    wq = point_weights(pm, xq)[0]
    expect = np.array([1 / 1.05, 1 / 0.95, 0.0])
    np.testing.assert_allclose(wq, expect / expect.sum(), rtol=1e-12)
    # torch in, torch out; at a centroid all weight goes there
    wt = point_weights(pm, torch.tensor([[1.0, 5.0, 0.0]]))
    assert isinstance(wt, torch.Tensor)
    torch.testing.assert_close(wt, torch.tensor([[0.0, 1.0, 0.0]]))


# ---- scenes, Mega-NeRF interop --------------------------------------------------------------


def test_cell_fraction():
    scene = lawnmower_scene()
    part = Partition.from_config(PartitionConfig(grid=[2, 2]), scene)
    f = cell_fraction(part, scene, samples=4000)
    assert f.shape == (4,) and f.sum() >= 1.0 and np.all(f > 0.15)
    np.testing.assert_allclose(f, f[::-1], atol=0.06)  # the layout is symmetric
    f1 = cell_fraction(Partition(part.centroids, 1.0, 2, part.up), scene, samples=4000)
    assert np.all(f1 <= f + 1e-12)



def _all_pixels_fraction(part, scene):
    """(C,) exact fraction of the scene's rays in each cell: every pixel once."""
    cams = np.concatenate([np.full(int(w * h), i) for i, (w, h) in enumerate(zip(scene.width, scene.height))])
    local = np.concatenate([np.arange(int(w * h)) for w, h in zip(scene.width, scene.height)])
    rows, cols = local // scene.width[cams], local % scene.width[cams]
    o, d = scene_rays(scene, cams, rows, cols)
    near, far = scene_ray_bounds(scene, cams, o, d)
    return ray_cells(part, o, d, near, far).mean(0)


@pytest.mark.parametrize("bounds", ["per_image", "aabb"])
def test_cell_fraction_estimates_the_fraction_of_every_pixel(bounds):
    """cell_fraction's uniform pixel sample matches the exact fraction over every pixel within
    sampling error, over every image (2 cameras, each over its own cell) and with per-image
    bounds or an aabb; the default seed is 0 (the same sample every call)."""
    scene = lawnmower_scene(nx=2, nz=1, w=12, h=8)
    # tilted rays (a 3-D k-means partition) so that each ray's segment decides its cells
    c2w = scene.c2w.copy()
    c2w[:, :3, :3] = c2w[:, :3, :3] @ np.array([[1, 0, 0], [0, 0.8, -0.6], [0, 0.6, 0.8]])
    scene = dataclasses.replace(scene, c2w=c2w)
    if bounds == "aabb":
        scene = dataclasses.replace(scene, near=None, far=None, aabb=np.array([[-3, -0.5, -2], [3, 1.5, 2]]))
    part = Partition(np.array([[-2, 0.5, 0.0], [2, 0.5, 0.0], [0, 0.5, 1.5]]), 1.1, 3, [0, 1, 0], "kmeans")
    exact = _all_pixels_fraction(part, scene)
    assert exact.max() > 0.3 and exact.min() < 0.7  # each cell holds some rays, not all
    f = cell_fraction(part, scene, samples=20000)
    np.testing.assert_allclose(f, exact, atol=0.025)
    np.testing.assert_array_equal(f, cell_fraction(part, scene, 20000, seed=0))
    assert not np.array_equal(f, cell_fraction(part, scene, 20000, seed=1))


def test_scene_ray_bounds_are_the_segment_in_the_aabb():
    """Without per-image bounds a ray's [near, far] is its segment inside the aabb (from the
    origin when it starts inside; 0, 0 when it misses, also for a ray parallel to a face outside
    the box), checked against points sampled along the ray; with bounds they are the image's;
    with neither the scene is refused in one line."""
    rng = np.random.default_rng(np.random.randint(2**31))
    scene = lawnmower_scene(nx=2, nz=2)
    box = np.array([[-1.0, -0.5, -2.0], [1.5, 1.0, 0.5]])
    no_bounds = dataclasses.replace(scene, near=None, far=None, aabb=box)
    n = 400
    o = rng.uniform(-3, 3, (n, 3))
    d = rng.normal(size=(n, 3))
    d[np.arange(40), rng.integers(0, 3, 40)] = 0.0  # some rays parallel to a face
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    o[:10] = [0.0, 0.0, 0.0]  # inside the box
    o[10:20], d[10:20] = [0.0, 2.0, 0.0], [1.0, 0.0, 0.0]  # parallel to the top face, above it
    aim = rng.uniform(box[0], box[1], (100, 3)) - o[200:300]  # aimed into the box
    d[200:300] = aim / np.linalg.norm(aim, axis=1, keepdims=True)
    cams = rng.integers(0, scene.num_images, n)
    near, far = scene_ray_bounds(no_bounds, cams, o, d)
    assert near.dtype == far.dtype == np.float64 and near.shape == far.shape == (n,)
    t = np.linspace(0.0, 12.0, 6001)  # the box lies within 12 of every origin
    pts = o[:, None, :] + t[None, :, None] * d[:, None, :]
    inside = np.all((pts >= box[0].astype(np.float32)) & (pts <= box[1].astype(np.float32)), -1)
    hit = inside.any(1)
    assert hit[:10].all() and not hit[10:20].any() and hit[200:300].all() and (~hit).sum() > 50
    assert np.all(far[~hit] - near[~hit] <= t[1])  # missed (0, 0), or grazing between two samples
    np.testing.assert_array_equal(near[10:20], 0.0)
    np.testing.assert_array_equal(far[10:20], 0.0)
    np.testing.assert_array_equal(near[:10], 0.0)
    first = t[np.argmax(inside, 1)]
    last = t[t.size - 1 - np.argmax(inside[:, ::-1], 1)]
    assert np.all(np.abs(near - first)[hit] <= t[1] + 1e-9) and np.all(far[hit] >= last[hit] - 1e-9)
    assert np.all(far[hit] - last[hit] <= t[1] + 1e-9)
    bn, bf = scene_ray_bounds(scene, cams, o, d)
    assert bn.dtype == np.float64
    np.testing.assert_array_equal(bn, scene.near[cams]) and np.testing.assert_array_equal(bf, scene.far[cams])
    with pytest.raises(SceneError, match=r"^/nowhere: the scene has no near/far bounds and no aabb; .*[^\n]$"):
        scene_ray_bounds(dataclasses.replace(scene, near=None, far=None), cams, o, d)

@pytest.mark.parametrize("up", ["y", "-x"])
def test_mega_nerf_export_import(tmp_path, up):
    scene = lawnmower_scene(nx=3, nz=2, up=up, w=20, h=10)
    part = Partition.from_config(PartitionConfig(grid=[2, 2], margin=1.15), scene)
    out = export_mega_nerf(part, scene, tmp_path / "masks")
    assert (out / "params.pt").is_file() and (out / "3" / "img_005.pt").is_file()
    params = torch.load(out / "params.pt", weights_only=True)
    for k in ("origin_drb", "pose_scale_factor", "ray_altitude_range", "near", "far", "centroids",
              "grid_dim", "min_position", "max_position", "cluster_2d"):
        assert k in params
    assert params["cluster_2d"] is True and params["centroids"].shape == (4, 3)
    if up == "-x":  # Mega-NeRF's own frame: written as is
        np.testing.assert_array_equal(params["centroids"].numpy(), part.centroids)
    back = import_mega_nerf(out)
    assert back == part
    masks = load_masks(out)
    assert sorted(masks) == [f"img_{i:03d}" for i in range(6)]
    for i, stem in enumerate(sorted(masks)):
        m = masks[stem]
        assert m.shape == (4, 10, 20) and m.dtype == bool
        o, d = image_rays(torch.tensor(scene.c2w[i]), torch.tensor(scene.intrinsics[i]), 20, 10)
        want = ray_cells(back, o.numpy(), d.numpy(), np.full(200, 0.5), np.full(200, 4.0))
        np.testing.assert_array_equal(m.reshape(4, -1).T, want)
        assert m.any(0).all()
    with pytest.raises(SceneError, match="params.pt"):
        import_mega_nerf(tmp_path / "nothing")


def test_misspelt_mega_nerf_names_are_deprecated_aliases(tmp_path):
    """export_megannerf / import_megannerf (the old spellings) still work, with a DeprecationWarning."""
    scene = lawnmower_scene(nx=2, nz=1, w=8, h=6)
    part = Partition.from_config(PartitionConfig(grid=[2, 1]), scene)
    with pytest.warns(DeprecationWarning, match="export_mega_nerf"):
        out = dali_nerf.partition.export_megannerf(part, scene, tmp_path / "masks")
    with pytest.warns(DeprecationWarning, match="import_mega_nerf"):
        back = dali_nerf.partition.import_megannerf(out)
    assert back == part == import_mega_nerf(out)
    with pytest.raises(SceneError, match="params.pt"), pytest.warns(DeprecationWarning):
        dali_nerf.partition.import_megannerf(tmp_path / "nothing")


def test_partition_package_keeps_its_public_names():
    """The module split keeps ``from dali_nerf.partition import X`` working for every old name."""
    for name in ("Partition", "assign_rank", "ray_cells", "ray_cells_dense", "point_weights",
                 "scene_ray_bounds", "cell_fraction", "export_megannerf", "import_megannerf",
                 "load_masks", "plane_axes", "clip_to_bounds"):
        assert name in dali_nerf.partition.__all__ and hasattr(dali_nerf.partition, name), name
    assert dali_nerf.partition.point_weights is point_weights


def test_grid_partition_routes_within_the_scene_aabb_and_equality_sees_every_field():
    """A grid partition of a scene with an aabb takes the box as its routing bounds; partitions
    that differ in one field only are not equal; one cell is a valid partition."""
    scene = dataclasses.replace(lawnmower_scene(), aabb=np.array([[-2.5, 0.0, -1.5], [2.5, 2.0, 1.5]]))
    part = Partition.from_config(PartitionConfig(grid=[2, 2]), scene)
    np.testing.assert_array_equal(part.bounds, scene.aabb)
    assert Partition.from_config(PartitionConfig(grid=[2, 2]), lawnmower_scene()).bounds is None
    for other in (dataclasses.replace(part, margin=1.3), dataclasses.replace(part, dims=3),
                  dataclasses.replace(part, bounds=None), dataclasses.replace(part, grid=(4, 1)),
                  dataclasses.replace(part, centroids=part.centroids + 0.5)):
        assert other != part and part != other
    assert dataclasses.replace(part) == part
    one = Partition(np.zeros((1, 3)), 1.0, 2, [0, 1, 0])
    assert one.num_cells == 1 and one.cells_for_rank(0, 1) == [0]
