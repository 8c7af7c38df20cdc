"""Radiance field, occupancy grid, renderer and metrics (dali_nerf.models)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from dali_nerf.config import Config, ModelConfig, load_config
from dali_nerf.errors import ConfigError
from dali_nerf.models import (OccupancyGrid, build_field, build_occupancy, lr_lambda, make_optimizer, psnr,
                              ray_aabb, render_image, render_rays, ssim)

@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread (the trainer's setting; 2 threads only contend on a shared 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


AABB = torch.tensor([[-1.5] * 3, [1.5] * 3])
RED = torch.tensor([0.9, 0.1, 0.2])
BG = torch.tensor([1.0, 1.0, 1.0])


class SphereField(nn.Module):
    """Hand-made field: density ``sigma`` inside a ball of ``radius`` at the origin, colour RED."""

    def __init__(self, radius=0.5, sigma=200.0):
        super().__init__()
        self.radius, self.sigma = radius, sigma
        self.dummy = nn.Parameter(torch.zeros(()))
        self.register_buffer("aabb", AABB.clone())

    def density(self, x):
        return (x.norm(dim=-1) < self.radius).float() * self.sigma + 0.0 * self.dummy

    def forward(self, x, d):
        return self.density(x), RED.expand(x.shape[0], 3) + 0.0 * self.dummy


class EmptyField(SphereField):
    def density(self, x):
        return torch.zeros(x.shape[0]) + 0.0 * self.dummy


def _camera(dist=4.0, size=32, focal=40.0):
    """Camera on +z looking at the origin (OpenGL: looks down -z)."""
    c2w = torch.zeros(3, 4)
    c2w[:, :3] = torch.eye(3)
    c2w[2, 3] = dist
    k = torch.tensor([focal, focal, size / 2, size / 2])
    return c2w, k


def test_field_shapes_and_outside_aabb():
    field = build_field(ModelConfig(resolution=16, density_components=2, color_components=3, hidden=8), AABB)
    x = torch.randn(100, 3)
    d = nn.functional.normalize(torch.randn(100, 3), dim=-1)
    sigma, rgb = field(x, d)
    assert sigma.shape == (100,) and rgb.shape == (100, 3)
    assert sigma.dtype == torch.float32 and rgb.dtype == torch.float32
    torch.testing.assert_close(field.density(x), sigma)
    # the untrained field is the config's faint fog inside the box (sigma_init = 0.01 per unit; its
    # VM grids start at std 0.1: measured 0.86-1.15 x sigma_init over seeds 0-4, 2 and 8 components)
    inside = (x.abs() <= 1.5).all(-1)
    assert inside.any() and not inside.all()
    ratio = sigma[inside] / ModelConfig().sigma_init
    assert ((ratio > 0.7) & (ratio < 1.4)).all(), ratio
    assert (sigma[~inside] == 0).all()
    # Lambertian by default (view_dependent False): the colour ignores the direction; with it, not
    assert torch.equal(field(x, -d)[1], rgb)
    vd = build_field(ModelConfig(resolution=16, density_components=2, color_components=3, hidden=8, view_dependent=True),
                     AABB)
    assert (vd(x, d)[1] - vd(x, -d)[1]).abs().max() > 1e-4
    far_pts = torch.tensor([[3.0, 0.0, 0.0], [0.0, -2.0, 0.0]])
    assert (field.density(far_pts) == 0).all()
    # the sorted (large-batch) path equals the unsorted one
    xb = torch.rand(20000, 3) * 3 - 1.5
    db = nn.functional.normalize(torch.randn(20000, 3), dim=-1)
    s_big, c_big = field(xb, db)
    s_small = torch.cat([field.density(xb[i:i + 5000]) for i in range(0, 20000, 5000)])
    torch.testing.assert_close(s_big, s_small)
    # no samples at all
    s0, c0 = field(torch.zeros(0, 3), torch.zeros(0, 3))
    assert s0.shape == (0,) and c0.shape == (0, 3)


def test_ray_aabb_analytic():
    o = torch.tensor([[0.0, 0.0, 4.0], [0.0, 5.0, 4.0]])
    d = torch.tensor([[0.0, 0.0, -1.0], [0.0, 0.0, -1.0]])
    te, tx = ray_aabb(o, d, AABB)
    torch.testing.assert_close(te[0], torch.tensor(2.5))
    torch.testing.assert_close(tx[0], torch.tensor(5.5))
    assert tx[1] < te[1]  # misses


def test_empty_field_renders_background():
    c2w, k = _camera()
    bg = torch.tensor([0.2, 0.4, 0.6])
    img = render_image(EmptyField(), c2w, k, 32, 32, 2.0, 6.0, bg, samples=32)
    assert img.shape == (32, 32, 3)
    torch.testing.assert_close(img, bg.expand(32, 32, 3))


class TwoLayerField(nn.Module):
    """Air (z > 0, grey 0.5, density ``air``) over a surface layer (z <= 0, colour 0.2, density
    ``surf``): a transparent field seen from above, before it has learned where the surface is."""

    def __init__(self, sigma=0.01):
        super().__init__()
        self.air = nn.Parameter(torch.tensor(float(sigma)))
        self.surf = nn.Parameter(torch.tensor(float(sigma)))

    def density(self, x):
        return torch.where(x[:, 2] > 0, self.air, self.surf).expand(x.shape[0])

    def forward(self, x, d):
        rgb = torch.where((x[:, 2] > 0)[:, None], torch.full((1, 3), 0.5), torch.full((1, 3), 0.2))
        return self.density(x), rgb


@pytest.mark.parametrize("bg, air_grows", [(1.0, True), (0.5, False)])
def test_background_decides_where_an_empty_field_grows(bg, air_grows):
    """configs/ss_city.yaml's grey background: when every ray hits a surface (aerial views), a
    transparent field over white gains density in the air too (every sample is darker than white),
    over a grey like the air's colour only at the surface (whose colour beats the grey)."""
    field = TwoLayerField()
    o, d = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.0, 0.0, -1.0]])
    out = render_rays(field, o, d, 0.0, 2.0, torch.full((3,), bg), samples=32, train=False)
    ((out["rgb"] - 0.2) ** 2).sum().backward()
    assert field.surf.grad < 0  # gradient descent raises the surface's density either way
    assert (field.air.grad < -1e-3) == air_grows, float(field.air.grad)


def test_opaque_sphere_centre_and_outside():
    c2w, k = _camera()
    img = render_image(SphereField(), c2w, k, 32, 32, 2.0, 6.0, BG, samples=128)
    torch.testing.assert_close(img[16, 16], RED, atol=1e-3, rtol=0)
    torch.testing.assert_close(img[0, 0], BG)
    # expected depth at the centre ray: the sphere's front at 4 - 0.5
    o = c2w[:, 3][None]
    out = render_rays(SphereField(), o, torch.tensor([[0.0, 0.0, -1.0]]), 2.0, 6.0, BG, samples=256, train=False)
    assert abs(float(out["depth"][0].detach()) - 3.5) < 0.03 and float(out["acc"][0].detach()) > 0.999


def test_occupancy_culling_preserves_render():
    field = SphereField(radius=0.6)
    occ = OccupancyGrid(AABB, 32, step_size=3.0 * math.sqrt(3) / 96, warmup=0, every=1)
    assert occ.update(field, 1, force=True)
    assert 0.0 < occ.occupied_fraction < 0.2
    c2w, k = _camera(size=24, focal=30.0)
    ref = render_image(field, c2w, k, 24, 24, 2.0, 6.0, BG, samples=96)
    culled = render_image(field, c2w, k, 24, 24, 2.0, 6.0, BG, samples=96, occupancy=occ)
    torch.testing.assert_close(culled, ref, atol=1e-4, rtol=0)
    # and it actually culls: far fewer samples evaluated
    o, d = c2w[:, 3].expand(64, 3), nn.functional.normalize(torch.randn(64, 3) * 0.1 + torch.tensor([0, 0, -1.0]), dim=-1)
    n_all = render_rays(field, o, d, 2.0, 6.0, BG, samples=96, train=False, aabb=AABB)["samples"]
    n_occ = render_rays(field, o, d, 2.0, 6.0, BG, samples=96, train=False, occupancy=occ)["samples"]
    assert n_occ <= n_all
    # the grid is a buffer: it round-trips through state_dict
    occ2 = OccupancyGrid(AABB, 32, step_size=occ.step_size)
    occ2.load_state_dict(occ.state_dict())
    assert torch.equal(occ2.bits, occ.bits) and occ2.ready


def test_occupancy_update_is_deterministic():
    torch.manual_seed(0)
    field = build_field(ModelConfig(resolution=16, density_components=2, color_components=2, hidden=8), AABB)
    a = build_occupancy(ModelConfig(occupancy_resolution=16, occupancy_warmup=0, occupancy_every=4), AABB)
    b = build_occupancy(ModelConfig(occupancy_resolution=16, occupancy_warmup=0, occupancy_every=4), AABB)
    assert not a.update(field, 3) and a.update(field, 4) and b.update(field, 4)
    assert torch.equal(a.density, b.density) and torch.equal(a.bits, b.bits)


def _fit(steps, seed, cfg=None, n_rays=256):
    """Fit a small field to rays rendered from SphereField; returns (losses, field)."""
    cfg = cfg or ModelConfig(resolution=24, density_components=4, color_components=4, hidden=16,
                             samples_per_ray=24, occupancy_resolution=16, occupancy_warmup=20, occupancy_every=10,
                             sigma_init=0.1)
    g = torch.Generator().manual_seed(123)
    eye = nn.functional.normalize(torch.randn(n_rays, 3, generator=g), dim=-1) * 4.0
    target = nn.functional.normalize(torch.randn(n_rays, 3, generator=g), dim=-1) * 0.4 * torch.rand(n_rays, 1, generator=g)
    d = nn.functional.normalize(target - eye, dim=-1)
    with torch.no_grad():
        gt = render_rays(SphereField(), eye, d, 2.0, 6.0, BG, samples=128, train=False)["rgb"]
    torch.manual_seed(seed)
    field = build_field(cfg, AABB)
    occ = build_occupancy(cfg, AABB)
    full = Config()
    full.model = cfg
    full.train.lr = 0.02
    opt, sched = make_optimizer(field, full, total_steps=steps)
    losses = []
    for step in range(1, steps + 1):
        gen = torch.Generator().manual_seed(seed * 1000 + step)
        out = render_rays(field, eye, d, 2.0, 6.0, BG, occupancy=occ, samples=cfg.samples_per_ray, generator=gen)
        loss = torch.mean((out["rgb"] - gt) ** 2)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        occ.update(field, step)
        losses.append(float(loss.detach()))
    return losses, field, occ


def test_fit_reduces_loss():
    losses, _, occ = _fit(100, seed=0)
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])
    assert occ.ready


def test_same_seed_same_params():
    _, f1, o1 = _fit(25, seed=7)
    _, f2, o2 = _fit(25, seed=7)
    for (n, p1), p2 in zip(f1.state_dict().items(), f2.state_dict().values()):
        assert torch.equal(p1, p2), n
    assert torch.equal(o1.bits, o2.bits)
    _, f3, _ = _fit(3, seed=8)
    assert not torch.equal(f1.density_vm.planes, f3.density_vm.planes)


def test_lr_schedule():
    assert lr_lambda(0, 100) == 1.0
    assert abs(lr_lambda(100, 100) - 0.1) < 1e-12
    assert abs(lr_lambda(50, 100) - math.sqrt(0.1)) < 1e-12


def test_psnr_known_values():
    a = torch.rand(8, 8, 3)
    assert psnr(a, a) == float("inf")
    assert abs(psnr(torch.zeros(4, 4, 3), torch.full((4, 4, 3), 0.1)) - 20.0) < 1e-5
    assert abs(psnr(np.zeros((4, 4)), np.full((4, 4), 0.01)) - 40.0) < 1e-9


def test_ssim_known_values():
    rng = np.random.default_rng(0)
    a = rng.random((32, 32, 3))
    assert abs(ssim(a, a) - 1.0) < 1e-12
    # constant images: variances 0, so SSIM = (2 m1 m2 + C1) / (m1^2 + m2^2 + C1)
    c1 = 0.01 ** 2
    m1, m2 = 0.3, 0.6
    want = (2 * m1 * m2 + c1) / (m1 ** 2 + m2 ** 2 + c1)
    assert abs(ssim(np.full((16, 16), m1), np.full((16, 16), m2)) - want) < 1e-9
    noisy = np.clip(a + rng.normal(0, 0.1, a.shape), 0, 1)
    s = ssim(noisy, a)
    assert 0.0 < s < 0.99 and abs(s - ssim(a, noisy)) < 1e-12


def test_model_config_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  resolution: 1\n")
    with pytest.raises(ConfigError, match="model.resolution"):
        load_config(p, check_paths=False)
    with pytest.raises(ConfigError, match="model.occupancy_threshold"):
        load_config(None, ["model.occupancy_threshold=2"], check_paths=False)
