"""The pure-torch Gaussian rasteriser against independent references (a per-pixel Python loop of
gsplat's compositing rule, the analytic image of one Gaussian, cv2's projection), its gradients,
and the splat model's densification and checkpoint resizing."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
import torch

from dali_nerf.models.gaussians import Densifier, GaussianModel, knn_distance, splat_optimizer
from dali_nerf.models.raster import SH_C0, SH_C1, project_gaussians, rasterization, rasterize_torch

SEED = 4102


def _scene(gen, n=60, c=2):
    means = torch.randn(n, 3, generator=gen, dtype=torch.float64) * 0.5
    quats = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    scales = torch.rand(n, 3, generator=gen, dtype=torch.float64) * 0.12 + 0.02
    opac = torch.rand(n, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    view = torch.eye(4, dtype=torch.float64).repeat(c, 1, 1)
    view[:, 2, 3] = torch.linspace(2.5, 3.5, c, dtype=torch.float64)
    view[1:, 0, 3] = 0.2
    ks = torch.tensor([[40.0, 0, 17.3], [0, 42.0, 12.6], [0, 0, 1]], dtype=torch.float64).repeat(c, 1, 1)
    return means, quats, scales, opac, view, ks


def _reference(means, quats, scales, opac, colors, view, ks, w, h, bg, tile):
    """Per pixel, per Gaussian in depth order: gsplat's rule, in Python floats."""
    m2, con, dep, rad = (t.detach() for t in project_gaussians(means, quats, scales, view, ks, w, h))
    out = np.zeros((len(view), h, w, colors.shape[-1]))
    for c in range(len(view)):
        order = [i for i in torch.argsort(dep[c], stable=True).tolist() if rad[c, i].max() > 0]
        for y in range(h):
            for x in range(w):
                t, acc = 1.0, np.zeros(colors.shape[-1])
                for i in order:
                    mx, my = m2[c, i].tolist()
                    rx, ry = rad[c, i].tolist()
                    if not (math.floor((mx - rx) / tile) <= x // tile <= math.floor((mx + rx) / tile)
                            and math.floor((my - ry) / tile) <= y // tile <= math.floor((my + ry) / tile)):
                        continue  # the Gaussian's 3-sigma box misses this pixel's tile
                    dx, dy = mx - (x + 0.5), my - (y + 0.5)
                    a, b, cc = con[c, i].tolist()
                    s = 0.5 * (a * dx * dx + cc * dy * dy) + b * dx * dy
                    alpha = min(0.999, float(opac[i]) * math.exp(-s))
                    if s < 0 or alpha < 1 / 255:
                        continue
                    if t * (1 - alpha) <= 1e-4:
                        break
                    acc += alpha * t * colors[c, i].numpy()
                    t *= 1 - alpha
                out[c, y, x] = acc + t * bg[c].numpy()
    return out


@pytest.mark.parametrize("tile", [8, 16])
def test_compositing_matches_a_per_pixel_reference(tile):
    print("seed", SEED)
    gen = torch.Generator().manual_seed(SEED)
    means, quats, scales, opac, view, ks = _scene(gen, n=40)
    colors = torch.rand(40, 3, generator=gen, dtype=torch.float64)
    bg = torch.rand(2, 3, generator=gen, dtype=torch.float64)
    img, alpha, info = rasterize_torch(means, quats, scales, opac, colors, view, ks, 30, 22, backgrounds=bg, tile_size=tile)
    ref = _reference(means, quats, scales, opac, colors[None].expand(2, -1, -1), view, ks, 30, 22, bg, tile)
    assert img.shape == (2, 22, 30, 3) and alpha.shape == (2, 22, 30, 1)
    assert np.abs(img.numpy() - ref).max() < 1e-9


def test_one_gaussian_is_the_analytic_splat_at_the_cv2_projection():
    mean = torch.tensor([[0.3, -0.2, 0.1]], dtype=torch.float64)
    s, o = 0.05, 0.8
    view = torch.eye(4, dtype=torch.float64)[None].clone()
    rvec = np.array([0.1, -0.2, 0.05])
    view[0, :3, :3] = torch.from_numpy(cv2.Rodrigues(rvec)[0])
    view[0, :3, 3] = torch.tensor([0.1, 0.0, 4.0])
    k = torch.tensor([[[50.0, 0, 20.5], [0, 50.0, 15.25], [0, 0, 1]]], dtype=torch.float64)
    _, alpha, info = rasterize_torch(mean, torch.tensor([[1.0, 0, 0, 0]], dtype=torch.float64),
                                     torch.full((1, 3), s, dtype=torch.float64), torch.tensor([o], dtype=torch.float64),
                                     torch.ones(1, 3, dtype=torch.float64), view, k, 40, 30)
    # cv2 puts pixel centres at integers: its principal point is ours - 0.5
    kk = k[0].numpy().copy()
    kk[:2, 2] -= 0.5
    uv = cv2.projectPoints(mean.numpy(), rvec, view[0, :3, 3].numpy(), kk, None)[0].reshape(2) + 0.5
    assert np.allclose(info["means2d"][0, 0].numpy(), uv, atol=1e-9)
    z = float((view[0, :3, :3] @ mean[0] + view[0, :3, 3])[2])
    xc = (view[0, :3, :3] @ mean[0] + view[0, :3, 3]).numpy()
    jac = np.array([[50 / z, 0, -50 * xc[0] / z ** 2], [0, 50 / z, -50 * xc[1] / z ** 2]])
    cov = jac @ (s * s * np.eye(3)) @ jac.T + 0.3 * np.eye(2)  # isotropic: rotation-free in camera space
    ys, xs = np.mgrid[0:30, 0:40] + 0.5
    d = np.stack([xs - uv[0], ys - uv[1]], -1)
    want = o * np.exp(-0.5 * np.einsum("...i,ij,...j", d, np.linalg.inv(cov), d))
    want[want < 1 / 255] = 0
    got = alpha[0, :, :, 0].numpy()
    inside = np.abs(d[..., 0]) < 3 * np.sqrt(cov[0, 0]) - 1  # well inside the 3-sigma box
    assert np.abs(got - want)[inside].max() < 1e-9 and got.max() > 0.5


def test_sh_degree_one_colours_and_gradients():
    gen = torch.Generator().manual_seed(SEED)
    means, quats, scales, opac, view, ks = _scene(gen, n=12, c=1)
    sh = torch.randn(12, 4, 3, generator=gen, dtype=torch.float64) * 0.3
    img, _, _ = rasterize_torch(means, quats, scales, opac, sh, view, ks, 20, 16, sh_degree=1)
    assert img.std() > 0.05  # the Gaussians are in view
    campos = torch.linalg.inv(view)[0, :3, 3]
    d = torch.nn.functional.normalize(means - campos, dim=-1)
    rgb = (0.5 + SH_C0 * sh[:, 0] - SH_C1 * d[:, 1:2] * sh[:, 1] + SH_C1 * d[:, 2:3] * sh[:, 2]
           - SH_C1 * d[:, 0:1] * sh[:, 3]).clamp_min(0)
    same, _, _ = rasterize_torch(means, quats, scales, opac, rgb, view, ks, 20, 16)
    assert torch.allclose(img, same, atol=1e-12)
    args = [t[:5].clone().requires_grad_() for t in (means, scales, opac, rgb)]  # 5 Gaussians: 50 inputs

    def f(m, s, o, c):
        return rasterize_torch(m, quats[:5], s, o, c, view, ks, 20, 16)[0].sum()

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-5, fast_mode=True)


def test_the_dispatcher_uses_torch_without_gsplat_on_cuda():
    gen = torch.Generator().manual_seed(SEED)
    means, quats, scales, opac, view, ks = _scene(gen, n=8, c=1)
    _, _, info = rasterization(means, quats, scales, opac, torch.rand(8, 3, dtype=torch.float64), view, ks, 16, 12)
    assert info["backend"] == "torch"


def test_densify_clone_split_prune_keep_the_optimizer_consistent_and_checkpoints_resize():
    torch.manual_seed(SEED)
    pts = torch.randn(40, 3) * 0.4
    model = GaussianModel.from_points(pts, torch.randint(0, 256, (40, 3), dtype=torch.uint8), sh_degree=1)
    assert torch.allclose(torch.exp(model.scales[:, 0]), knn_distance(pts))
    opt, sched = splat_optimizer(model, scene_scale=1.0, total_steps=10)
    view = torch.eye(4)[None].clone()
    view[0, 2, 3] = 3.0
    k = torch.tensor([[[30.0, 0, 12], [0, 30.0, 12], [0, 0, 1]]])
    out, _, info = model.render(view, k, 24, 24)
    info["means2d"].retain_grad()
    out.mean().backward()
    dens = Densifier(scene_scale=1.0, grad_threshold=0.0, small_scale=0.02)
    dens.observe(model, info)
    seen = int((model.seen > 0).sum())
    opt.step()
    with torch.no_grad():
        model.opacities[:3] = -10.0  # pruned
    r = dens.refine(model, opt, step=100, seed=1)
    assert r["cloned"] + r["split"] == seen and r["n"] == 40 - r["split"] + r["cloned"] + 2 * r["split"] - r["pruned"]
    assert r["pruned"] >= 3
    for p in opt.param_groups:
        (q,) = p["params"]
        assert q is getattr(model, p["name"]) and opt.state[q]["exp_avg"].shape == q.shape
    out, _, _ = model.render(view, k, 24, 24)
    out.mean().backward()
    opt.step()  # the resized parameters train
    fresh = GaussianModel(3, sh_degree=1)
    fresh.load_state_dict(model.state_dict())
    assert fresh.num_gaussians == model.num_gaussians and torch.equal(fresh.means, model.means)
