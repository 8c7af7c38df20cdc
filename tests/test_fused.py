"""Fused inference over per-cell sub-fields: routing, blending, call counts, rendering."""

import numpy as np
import pytest
import torch
from torch import nn

from dali_nerf.models.fused import FusedField, point_weights
from dali_nerf.partition import Partition


class ConstField(nn.Module):
    """sigma = s everywhere, rgb = colour; counts the points it is asked about."""

    def __init__(self, sigma, rgb):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(float(sigma)))
        self.register_buffer("rgb", torch.tensor(rgb, dtype=torch.float32))
        self.seen = 0
        self.calls = 0

    def density(self, x):
        self.seen += x.shape[0]
        self.calls += 1
        return self.s.expand(x.shape[0])

    def forward(self, x, d):
        self.seen += x.shape[0]
        self.calls += 1
        return self.s.expand(x.shape[0]), self.rgb.expand(x.shape[0], 3)


def two_cells(margin):
    # cells split at x = 0, distances in the plane perpendicular to up = y
    return Partition(np.array([[-1, 0, 0], [1, 0, 0]], np.float32), margin, 2, [0, 1, 0])


def fields2():
    return [ConstField(2.0, [1, 0, 0]), ConstField(6.0, [0, 0, 1])]


def simple_render(field, o, d, near, far, n=256, bg=(1.0, 1.0, 1.0)):
    """Independent midpoint-rule volume renderer: (B, 3) rays -> (B, 3) colour."""
    t = near + (far - near) * (torch.arange(n, dtype=torch.float32) + 0.5) / n  # (S,)
    delta = (far - near) / n
    x = (o[:, None, :] + t[None, :, None] * d[:, None, :]).reshape(-1, 3)
    sigma, rgb = field(x, d.repeat_interleave(n, 0))
    sigma, rgb = sigma.reshape(-1, n), rgb.reshape(-1, n, 3)
    alpha = 1 - torch.exp(-sigma * delta)
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha[:, :-1]], 1), 1)
    w = alpha * trans
    return (w[..., None] * rgb).sum(1) + (1 - w.sum(1))[:, None] * torch.tensor(bg)


def test_deep_inside_gets_that_field_margin_one():
    f = fields2()
    fused = FusedField(f, two_cells(1.0))
    x = torch.tensor([[-0.8, 3.0, 0.2], [0.9, -2.0, 1.0]])
    d = torch.nn.functional.normalize(torch.ones(2, 3), dim=-1)
    sigma, rgb = fused(x, d)
    torch.testing.assert_close(sigma, torch.tensor([2.0, 6.0]))
    torch.testing.assert_close(rgb, torch.tensor([[1.0, 0, 0], [0, 0, 1.0]]))
    torch.testing.assert_close(fused.density(x), torch.tensor([2.0, 6.0]))
    # with margin 1 each field saw only its own point (twice: forward + density)
    assert f[0].seen == 2 and f[1].seen == 2


def test_margin_band_blends_by_inverse_distance():
    f = fields2()
    part = two_cells(1.15)
    fused = FusedField(f, part)
    x = torch.tensor([[0.05, 0.0, 0.0], [-0.5, 0.0, 0.0]])  # in the band; deep inside cell 0
    sigma, rgb = fused(x, torch.tensor([[0, 0, 1.0]] * 2))
    w0, w1 = 1 / 1.05, 1 / 0.95
    a = w0 / (w0 + w1)
    torch.testing.assert_close(sigma, torch.tensor([a * 2 + (1 - a) * 6, 2.0]))
    torch.testing.assert_close(rgb, torch.tensor([[a, 0, 1 - a], [1.0, 0, 0]]))
    assert 2.0 < sigma[0] < 6.0
    # the blend equals the partition's weights applied to both fields' outputs
    w = point_weights(part, x.double()).float()
    torch.testing.assert_close(rgb, w[:, :1] * f[0].rgb + w[:, 1:] * f[1].rgb)


def test_only_weighted_submodels_are_evaluated():
    part = Partition(np.array([[-2, 0, 0], [0, 0, 0], [2, 0, 0], [0, 0, 5]], np.float32), 1.15, 2, [0, 1, 0])
    f = [ConstField(1.0, [0.1 * i, 0, 0]) for i in range(4)]
    fused = FusedField(f, part)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(5000, 3, generator=g) * torch.tensor([6.0, 2.0, 1.0]) - torch.tensor([3.0, 1.0, 0.5])
    d = torch.nn.functional.normalize(torch.randn(5000, 3, generator=g), dim=-1)
    fused(x, d)
    w = point_weights(part, x)
    expect = (w > 0).sum(0).tolist()
    assert [fi.seen for fi in f] == expect
    assert expect[3] == 0 and f[3].calls == 0  # cell 3 is far from every point: never called
    assert all(fi.calls == 1 for fi in f[:3])  # one batched call per used sub-model
    st = fused.fusion_stats()
    assert st["points"] == 5000 and st["evaluated_per_model"] == expect
    assert st["models_per_point"] == pytest.approx(sum(expect) / 5000)
    assert 1.0 < st["models_per_point"] < 2.0
    fused.reset_stats()
    assert fused.fusion_stats()["points"] == 0


def test_gradients_reach_only_used_submodels():
    f = fields2()
    fused = FusedField(f, two_cells(1.0))
    sigma, rgb = fused(torch.tensor([[-0.5, 0.0, 0.0]]), torch.tensor([[0, 0, 1.0]]))
    sigma.sum().backward()
    assert f[0].s.grad is not None and f[0].s.grad.item() == pytest.approx(1.0)
    assert f[1].s.grad is None


def test_renders_with_simple_renderer():
    # two half-spaces of constant fog: a ray staying in cell 0 sees exactly field 0's analytic colour
    f = fields2()
    fused = FusedField(f, two_cells(1.0))
    o = torch.tensor([[-1.0, 2.0, 0.0], [1.0, 2.0, 0.0]])
    d = torch.tensor([[0, -1.0, 0], [0, -1.0, 0]])
    near, far = 0.0, 1.0
    got = simple_render(fused, o, d, near, far).detach()
    for i, (s, c) in enumerate([(2.0, [1, 0, 0]), (6.0, [0, 0, 1])]):
        a = 1 - np.exp(-s * (far - near))
        want = a * np.array(c) + (1 - a) * np.ones(3)
        np.testing.assert_allclose(got[i].numpy(), want, atol=1e-5)
    # a ray crossing x = 0 at its midpoint: first half fog 0, then fog 1
    o2, d2 = torch.tensor([[-0.5, 0.0, 0.0]]), torch.tensor([[1.0, 0, 0]])
    got2 = simple_render(fused, o2, d2, 0.0, 1.0, n=512)[0].detach().numpy()
    a0, a1 = 1 - np.exp(-2.0 * 0.5), 1 - np.exp(-6.0 * 0.5)
    want2 = a0 * np.array([1, 0, 0]) + (1 - a0) * (a1 * np.array([0, 0, 1]) + (1 - a1) * np.ones(3))
    np.testing.assert_allclose(got2, want2, atol=2e-3)


def test_renders_with_project_renderer():
    from dali_nerf.models import render_rays

    f = fields2()
    fused = FusedField(f, two_cells(1.0))
    o = torch.tensor([[-1.0, 2.0, 0.0], [1.0, 2.0, 0.0]])
    d = torch.tensor([[0, -1.0, 0], [0, -1.0, 0]])
    out = render_rays(fused, o, d, torch.zeros(2, 1), torch.ones(2, 1), torch.ones(3), samples=128, train=False)
    for i, (s, c) in enumerate([(2.0, [1, 0, 0]), (6.0, [0, 0, 1])]):
        a = 1 - np.exp(-s)
        np.testing.assert_allclose(out["rgb"][i].detach().numpy(), a * np.array(c) + (1 - a), atol=1e-4)
        assert out["acc"][i].item() == pytest.approx(a, abs=1e-4)
    assert fused.fusion_stats()["models_per_point"] == pytest.approx(1.0)


def test_aabb_is_union_and_size_mismatch():
    class Boxed(ConstField):
        def __init__(self, lo, hi):
            super().__init__(1.0, [0, 0, 0])
            self.register_buffer("aabb", torch.tensor([lo, hi], dtype=torch.float32))

    fused = FusedField([Boxed([-2, 0, -1], [0, 1, 1]), Boxed([0, -1, -1], [2, 1, 3])], two_cells(1.15))
    torch.testing.assert_close(fused.aabb, torch.tensor([[-2.0, -1, -1], [2, 1, 3]]))
    with pytest.raises(ValueError):
        FusedField(fields2()[:1], two_cells(1.15))
