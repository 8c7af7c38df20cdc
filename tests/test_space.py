"""NDC rays (NeRF's closed form) and the mip-NeRF 360 contraction."""

import math

import numpy as np
import pytest
import torch

from dali_nerf import scenegen as sg
from dali_nerf.models.render import render_rays
from dali_nerf.models.space import (contract, lin_disp_samples, ndc_rays, ndc_to_world, normalize_to_box,
                                    to_camera_frame, uncontract, world_to_ndc)
from dali_nerf.data.rays import rays_from_indices
from dali_nerf.scenes import load_scene


def _ndc_ref(p, fx, fy, w, h, n):
    """Independent numpy closed form of the NDC projection (NeRF, appendix C)."""
    x, y, z = p[:, 0], p[:, 1], p[:, 2]
    return np.stack([-(2 * fx / w) * x / z, -(2 * fy / h) * y / z, 1 + 2 * n / z], 1)


def test_world_point_and_its_ndc_image_agree_with_the_closed_form():
    rng = np.random.default_rng(0)
    fx, fy, w, h, n = 410.0, 400.0, 504, 378, 1.0
    p = np.c_[rng.uniform(-3, 3, (500, 2)), -rng.uniform(1.0, 50.0, 500)]
    got = world_to_ndc(torch.from_numpy(p), (fx, fy), w, h, n).numpy()
    np.testing.assert_allclose(got, _ndc_ref(p, fx, fy, w, h, n), rtol=1e-12)
    np.testing.assert_allclose(ndc_to_world(torch.from_numpy(got), (fx, fy), w, h, n).numpy(), p, rtol=1e-9)
    # rays: the NDC ray passes through the NDC image of every point of the world ray beyond z = -n,
    # at s = 1 - o_z / z (o moved onto the near plane), with s in [0, 1)
    o = np.c_[rng.uniform(-0.3, 0.3, (200, 2)), rng.uniform(-0.2, 0.2, 200)]
    d = np.c_[rng.uniform(-0.5, 0.5, (200, 2)), -np.ones(200)] * rng.uniform(0.5, 2.0, (200, 1))
    o_n, d_n = ndc_rays(torch.from_numpy(o), torch.from_numpy(d), (fx, fy), w, h, n)
    o_n, d_n = o_n.numpy(), d_n.numpy()
    np.testing.assert_allclose(o_n[:, 2], -1.0, atol=1e-12)
    t_plane = -(n + o[:, 2]) / d[:, 2]
    oz = o[:, 2] + t_plane * d[:, 2]
    for t in (0.0, 1.0, 7.0, 300.0):
        q = o + (t_plane + t)[:, None] * d  # a world point on the ray, at or beyond the near plane
        s = 1.0 - oz / q[:, 2]
        assert ((s >= 0) & (s < 1)).all()
        np.testing.assert_allclose(o_n + s[:, None] * d_n, _ndc_ref(q, fx, fy, w, h, n), rtol=1e-9, atol=1e-12)


@pytest.fixture(scope="module")
def forward(tmp_path_factory):
    out = sg.make_scene("forward", tmp_path_factory.mktemp("s") / "fw", width=64, n_train=9, seed=3)
    return load_scene(out, "train", format="llff"), 3


def test_rays_through_ndc_hit_the_same_surface_points(forward):
    """Pixel rays of a generated forward-facing scene, taken to NDC and back (two NDC points of
    the ray mapped back to the world give the ray again), hit the same surface points as the world
    rays; and the surface point's NDC image lies on the NDC ray."""
    scene, seed = forward
    rng = np.random.default_rng(1)
    cam = rng.integers(0, scene.num_images, 400)
    idx = torch.from_numpy(np.stack([cam, rng.integers(0, 48, 400), rng.integers(0, 64, 400)], 1))
    o, d = rays_from_indices(torch.from_numpy(scene.c2w.copy()), torch.from_numpy(scene.intrinsics.copy()), idx)
    o, d = o.double(), d.double()
    # NDC of the reference camera: the parser's world is the recentred average pose (identity)
    fx, fy = float(scene.intrinsics[0, 0]), float(scene.intrinsics[0, 1])
    w, h = int(scene.width[0]), int(scene.height[0])
    ro, rd = to_camera_frame(o, d, torch.eye(4, dtype=torch.float64)[:3])
    np.testing.assert_array_equal(ro.numpy(), o.numpy())
    o_n, d_n = ndc_rays(ro, rd, (fx, fy), w, h, near=1.0)

    src = np.linalg.inv(np.asarray(scene.world_from_source, np.float64))  # parser world -> generator frame
    to_gen = lambda p: p @ src[:3, :3].T + src[:3, 3]  # noqa: E731
    world = sg.render_scene_rays("forward", to_gen(o.numpy()), d.numpy() @ src[:3, :3].T, seed)
    a = ndc_to_world(o_n + 0.0 * d_n, (fx, fy), w, h).numpy()
    b = ndc_to_world(o_n + 0.5 * d_n, (fx, fy), w, h).numpy()
    via_ndc = sg.render_scene_rays("forward", to_gen(a), (b - a) @ src[:3, :3].T, seed)
    assert (world["alpha"] == 1).all() and (via_ndc["alpha"] == 1).all()
    np.testing.assert_array_equal(via_ndc["prim"], world["prim"])
    np.testing.assert_allclose(via_ndc["points"], world["points"], atol=1e-6)

    p_hit = (world["points"] - src[:3, 3]) @ np.linalg.inv(src[:3, :3]).T  # back in the parser's world
    q = world_to_ndc(torch.from_numpy(p_hit), (fx, fy), w, h).numpy()
    oz = (ro[:, 2] + (-(1.0 + ro[:, 2]) / rd[:, 2]) * rd[:, 2]).numpy()
    s = 1.0 - oz / p_hit[:, 2]
    assert ((s > 0) & (s < 1)).all()
    np.testing.assert_allclose(o_n.numpy() + s[:, None] * d_n.numpy(), q, atol=1e-9)


@pytest.mark.parametrize("ord", [2, math.inf])
def test_contraction(ord):
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.normal(size=(4000, 3)) * np.exp(rng.uniform(-3, 12, (4000, 1))))
    y = contract(x, ord=ord)
    nx = torch.linalg.vector_norm(x, ord=ord, dim=-1)
    ny = torch.linalg.vector_norm(y, ord=ord, dim=-1)
    inside = nx <= 1
    assert inside.any() and (~inside).any()
    assert torch.equal(y[inside], x[inside])  # identity inside the unit ball
    assert (ny < 2).all() and (ny[~inside] > 1).all()  # outside -> the shell 1 < |y| < 2
    np.testing.assert_allclose(uncontract(y, ord=ord).numpy(), x.numpy(), rtol=1e-9)
    # continuous (1-Lipschitz in L2 for ord 2), across the unit sphere included
    a = torch.from_numpy(rng.normal(size=(4000, 3)))
    a = a / torch.linalg.vector_norm(a, ord=ord, dim=-1, keepdim=True)  # on the boundary
    for eps in (1e-3, 1e-6):
        b = a + eps * torch.from_numpy(rng.normal(size=(4000, 3)))
        jump = torch.linalg.norm(contract(b, ord=ord) - contract(a, ord=ord), dim=-1)
        step = torch.linalg.norm(b - a, dim=-1)
        assert (jump <= (1.0 + 1e-9 if ord == 2 else 3.0) * step).all()
    # far away: approaches radius 2 along the ray
    far = contract(torch.tensor([[1e9, 0.0, 0.0]], dtype=torch.float64), ord=ord)
    np.testing.assert_allclose(far.numpy(), [[2.0, 0.0, 0.0]], atol=1e-8)


def test_normalize_to_box_and_lin_disp_samples():
    aabb = torch.tensor([[-1.0, 0.0, 2.0], [3.0, 2.0, 6.0]], dtype=torch.float64)
    np.testing.assert_allclose(normalize_to_box(aabb, aabb).numpy(), [[-1.0] * 3, [1.0] * 3])
    u = torch.linspace(0.0, 1.0, 9, dtype=torch.float64)[None].expand(2, 9)
    near = torch.tensor([0.1, 0.5], dtype=torch.float64)
    far = torch.tensor([100.0, math.inf], dtype=torch.float64)
    t = lin_disp_samples(near, far, u, split=1.0)
    assert (t[:, 1:] >= t[:, :-1]).all()
    np.testing.assert_allclose(t[:, 0].numpy(), near.numpy())
    np.testing.assert_allclose(t[:, 4].numpy(), [1.0, 1.0])
    np.testing.assert_allclose(t[0, -1].item(), 100.0)
    assert math.isinf(t[1, -1].item())
    np.testing.assert_allclose(np.diff(t[0, :5].numpy()), 0.225)  # linear inside
    np.testing.assert_allclose(np.diff(1.0 / t[0, 4:].numpy()), -(1.0 - 0.01) / 4)  # linear in disparity beyond


class _WorldSphere(torch.nn.Module):
    """An opaque red sphere (centre (3,), radius r) of a world the renderer queries through a warp;
    ``unwarp`` maps the field's coordinates back to the world."""

    def __init__(self, centre, r, unwarp):
        super().__init__()
        self.c, self.r, self.unwarp = torch.tensor(centre, dtype=torch.float64), r, unwarp
        self.seen_dirs = None

    def density(self, y):
        x = self.unwarp(y)
        return torch.where(torch.linalg.norm(x - self.c, dim=-1) < self.r, 500.0, 0.0).to(y)

    def forward(self, y, d):
        self.seen_dirs = d
        return self.density(y), torch.tensor([1.0, 0.0, 0.0], dtype=y.dtype).expand(len(y), 3)


def _rays_towards(target, n, seed, spread=0.01):
    rng = np.random.default_rng(seed)
    d = np.asarray(target, np.float64)[None] + rng.normal(size=(n, 3)) * spread
    return torch.zeros(n, 3, dtype=torch.float64), torch.from_numpy(d / np.linalg.norm(d, axis=1, keepdims=True))


def test_render_defaults_unchanged_by_the_new_options():
    field = _WorldSphere((0.0, 0.0, -3.0), 0.5, lambda y: y)
    o, d = _rays_towards((0.0, 0.0, -1.0), 64, 0, spread=0.2)
    box = torch.tensor([[-2.0, -2.0, -5.0], [2.0, 2.0, 1.0]], dtype=torch.float64)
    a = render_rays(field, o, d, 0.1, 6.0, torch.ones(3), samples=64, train=False, aabb=box)
    b = render_rays(field, o, d, 0.1, 6.0, torch.ones(3), samples=64, train=False, aabb=box,
                    viewdirs=d, warp=lambda x: x, spacing="linear")
    for k in ("rgb", "depth", "acc"):
        assert torch.equal(a[k], b[k])
    assert 0.1 < a["acc"].mean() < 0.9  # some rays hit the sphere, some miss


def test_render_contracted_far_object_with_lin_disp_spacing():
    """A sphere 5 units away, outside the unit box, seen through the contraction: found at its
    distance, opaque, with disparity-spaced samples."""
    box = torch.tensor([[-1.0] * 3, [1.0] * 3], dtype=torch.float64)
    field = _WorldSphere((6.0, 0.0, 0.0), 1.0, uncontract)
    o, d = _rays_towards((1.0, 0.0, 0.0), 32, 1)
    out = render_rays(field, o, d, 0.05, 100.0, torch.zeros(3), samples=128, train=False,
                      warp=lambda x: contract(normalize_to_box(x, box)), spacing="lin_disp", split=1.0)
    np.testing.assert_allclose(out["acc"].numpy(), 1.0, atol=1e-6)
    np.testing.assert_allclose(out["rgb"].numpy(), np.tile([1.0, 0.0, 0.0], (32, 1)), atol=1e-6)
    np.testing.assert_allclose(out["depth"].numpy(), 5.0, atol=0.45)
    with pytest.raises(ValueError, match="finite"):
        render_rays(field, o, d, 0.05, math.inf, torch.zeros(3), samples=8, warp=lambda x: x, spacing="lin_disp")


def test_render_in_ndc_finds_the_world_surface():
    """A wall at z = -4 of the reference camera's frame, rendered along NDC rays (field queried in
    NDC, view directions in the world): the depth is the wall's NDC parameter s = 1 - o_z / z."""
    focal, w, h = 60.0, 64, 48
    to_world = lambda y: ndc_to_world(y, focal, w, h)  # noqa: E731

    class Wall(_WorldSphere):
        def density(self, y):
            return torch.where(to_world(y)[:, 2] < -4.0, 500.0, 0.0).to(y)

    field = Wall((0.0, 0.0, 0.0), 0.0, to_world)
    o, d = _rays_towards((0.0, 0.0, -1.0), 40, 2, spread=0.2)
    o_n, d_n = ndc_rays(o, d, focal, w, h)
    out = render_rays(field, o_n, d_n, 0.0, 1.0, torch.zeros(3), samples=256, train=False, viewdirs=d)
    # the field saw the world's unit view directions, not the NDC ones (|d_ndc| >= 2)
    np.testing.assert_allclose(torch.linalg.norm(field.seen_dirs, dim=-1).numpy(), 1.0, rtol=1e-12)
    np.testing.assert_allclose(out["acc"].numpy(), 1.0, atol=1e-4)  # early termination at T < 1e-4
    np.testing.assert_allclose(out["depth"].numpy(), 0.75, atol=2.0 / 256)
