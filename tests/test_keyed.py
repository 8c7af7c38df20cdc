"""Per-ray draws keyed by the global stream position (dali_nerf/models/keyed.py): uniform,
independent across neighbouring positions and samples, no int64 overflow at any position, and
the same jitter for a ray whichever batch (rank) renders it."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from dali_nerf.config import ModelConfig
from dali_nerf.models import build_field, render_rays
from dali_nerf.models.keyed import M32, keyed_uniform, mix32, ray_keys
from dali_nerf.data.seeds import ray_key


def test_uniforms_are_uniform_and_independent():
    """4096 rays x 64 samples: each of 64 bins holds 1/64 of the values (chi-square below the
    0.999 quantile of 63 degrees of freedom, 103.4); mean and variance of U(0, 1); correlations
    between neighbouring samples, neighbouring positions and the two purposes' keys near 0."""
    pos = torch.arange(10**9, 10**9 + 4096)
    u = keyed_uniform(ray_keys(ray_key(7, "jitter"), pos), 64).double()
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u, bins=64, min=0.0, max=1.0)
    e = u.numel() / 64
    assert float(((counts - e) ** 2 / e).sum()) < 103.4
    assert abs(float(u.mean()) - 0.5) < 0.003 and abs(float(u.var()) - 1 / 12) < 0.002
    x = u - 0.5
    for a, b in ((x[:, 1:], x[:, :-1]), (x[1:], x[:-1])):  # samples j, j+1 and positions g, g+1
        assert abs(float((a * b).mean() / (x * x).mean())) < 0.01
    v = keyed_uniform(ray_keys(ray_key(7, "background"), pos), 64).double() - 0.5
    assert abs(float((x * v).mean() / (x * x).mean())) < 0.01


@settings(max_examples=50)
@given(key=st.integers(0, 2**64 - 1), start=st.integers(0, 2**62))
def test_any_position_stays_in_32_bit_lanes(key, start):
    """Positions up to 2^62 (across a 2^32 boundary too): keys in [0, 2^32), distinct within a
    block of 2^32 positions (mix32 is a bijection of 32-bit values), uniforms in [0, 1)."""
    pos = torch.arange(start, start + 257, dtype=torch.int64)
    k = ray_keys(key, pos)
    assert k.dtype == torch.int64 and int(k.min()) >= 0 and int(k.max()) <= M32
    same_block = (pos >> 32) == (pos[0] >> 32)
    assert len(torch.unique(k[same_block])) == int(same_block.sum())
    u = keyed_uniform(k, 5)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0


def test_mix32_is_a_bijection_of_16_bit_blocks():
    x = torch.arange(0, 1 << 16, dtype=torch.int64) * 65537 % (1 << 32)
    assert len(torch.unique(mix32(x))) == len(x)
    assert int(mix32(torch.tensor([M32])).max()) <= M32


def _rays(n, seed):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(n, 3, generator=g) * 0.2 + torch.tensor([0.0, 0.0, 3.0])
    d = torch.nn.functional.normalize(torch.randn(n, 3, generator=g) * 0.2 + torch.tensor([0.0, 0.0, -1.0]), dim=-1)
    return o, d


def test_a_ray_gets_the_same_jitter_in_any_batch():
    """Rays rendered as one batch, or split in two batches in another order (two ranks' parts of
    a step), get the same samples when jitter is keyed by their positions (depth equal to 1e-6),
    and not with a per-batch generator (the control)."""
    torch.manual_seed(0)
    field = build_field(ModelConfig(resolution=16, samples_per_ray=24, occupancy_resolution=0, hidden=16,
                                    density_components=4, color_components=4, sigma_init=0.5),
                        torch.tensor([[-1.5] * 3, [1.5] * 3]))
    o, d = _rays(64, 1)
    pos = torch.arange(500, 564)
    keys = ray_keys(ray_key(3, "jitter"), pos)

    def render(idx, keyed, gen_seed):
        g = torch.Generator().manual_seed(gen_seed)
        with torch.no_grad():
            out = render_rays(field, o[idx], d[idx], 0.5, 6.0, torch.ones(3), samples=24, generator=g,
                              ray_keys=keys[idx] if keyed else None)
        return out["depth"]

    whole = torch.arange(64)
    a, b = torch.arange(40, 64).flip(0), torch.arange(0, 40)  # another order, another split
    for keyed, close in ((True, True), (False, False)):
        one = render(whole, keyed, 11)
        two = torch.empty(64)
        two[a], two[b] = render(a, keyed, 12), render(b, keyed, 13)
        assert torch.allclose(one, two, atol=1e-6) == close, (keyed, float((one - two).abs().max()))
    assert float(one.abs().max()) > 0  # the control compared real depths


def test_ray_key_is_a_function_of_seed_and_purpose():
    assert ray_key(0, "jitter") != ray_key(0, "background") != ray_key(1, "background")
    assert ray_key(5, "jitter") == ray_key(5, "jitter") < 2**64
    assert np.array_equal(ray_keys(ray_key(5, "jitter"), torch.arange(9)).numpy(),
                          ray_keys(ray_key(5, "jitter"), torch.arange(9)).numpy())
