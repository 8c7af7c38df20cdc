"""Volume rendering over any field with ``forward(x, d) -> (sigma, rgb)`` and ``density(x)``.

Per ray: clip [near, far] to the field's aabb, take ``samples`` stratified points (jittered from
the caller's generator in training, midpoints in evaluation), drop points in empty occupancy
cells, then

1. a no-grad pre-pass of ``density`` on the occupied points gives transmittance; points behind an
   opaque surface (T < 1e-4) or with negligible alpha (< 1e-4) are dropped (early termination);
2. one differentiable ``field(x, d)`` call on the remaining points (one forward per step, so a
   DistributedDataParallel-wrapped field works);
3. alpha compositing in a padded (B, S) layout (exclusive cumsum of sigma * delta per ray, no
   Python loop over samples) and the background for the remaining transmittance.

Example:
    >>> out = render_rays(field, o, d, near, far, torch.ones(3), occupancy=occ, generator=g)
    >>> out["rgb"].shape, out["depth"].shape, out["acc"].shape
    (torch.Size([4096, 3]), torch.Size([4096]), torch.Size([4096]))
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from dali_nerf.data.rays import image_rays
from dali_nerf.models.keyed import keyed_uniform
from dali_nerf.models.space import lin_disp_samples

__all__ = ["render_rays", "render_image", "ray_aabb"]

T_EPS = 1e-4  # transmittance below which a ray is terminated
ALPHA_EPS = 1e-4  # alpha below which a sample is skipped
WARMUP_DIVISOR = 4  # samples per ray are divided by this until the occupancy grid is ready
TAU_EPS = -math.log1p(-ALPHA_EPS)


def _unwrap(field):
    return getattr(field, "module", field)  # DistributedDataParallel -> the module


def ray_aabb(origins: torch.Tensor, directions: torch.Tensor, aabb: torch.Tensor):
    """Slab test. origins, directions (B, 3); aabb (2, 3) -> t_enter (B,), t_exit (B,)
    (t_exit < t_enter when the ray misses the box)."""
    d = torch.where(directions.abs() < 1e-9, torch.full_like(directions, 1e-9), directions)
    inv = 1.0 / d
    t_lo = (aabb[0] - origins) * inv
    t_hi = (aabb[1] - origins) * inv
    t_enter = torch.minimum(t_lo, t_hi).amax(dim=-1)
    t_exit = torch.maximum(t_lo, t_hi).amin(dim=-1)
    return t_enter, t_exit


def _as_col(v, b: int, like: torch.Tensor, default: float) -> torch.Tensor:
    if v is None:
        return torch.full((b,), default, dtype=like.dtype, device=like.device)
    v = torch.as_tensor(v, dtype=like.dtype, device=like.device)
    return v.reshape(-1).expand(b) if v.numel() in (1, b) else v.reshape(b)


def _ray_samples(origins, directions, near, far, aabb, occupancy, samples: int, generator, train: bool, warp,
                 spacing: str, split: float, ray_keys=None):
    """The sample points of :func:`render_rays`: ``(t (B, S), delta (B, S), pos (B, S, 3), hit (B,), S)``:
    each ray's [near, far] clipped to ``aabb``, S stratified (jittered in training) depths, linear
    or lin_disp, and their positions (warped by ``warp``)."""
    b = origins.shape[0]
    dev, dt = origins.device, origins.dtype
    if spacing not in ("linear", "lin_disp"):
        raise ValueError(f"render_rays: spacing={spacing!r}: use linear or lin_disp")
    t0 = _as_col(near, b, origins, 0.0)
    t1 = _as_col(far, b, origins, float("inf"))
    if aabb is not None:
        te, tx = ray_aabb(origins, directions, torch.as_tensor(aabb, dtype=dt, device=dev))
        t0 = torch.maximum(t0, te)
        t1 = torch.minimum(t1, tx)
    elif not torch.isfinite(t1).all():
        raise ValueError("render_rays: rays need finite far bounds or an aabb")
    hit = t1 > t0
    span = torch.where(hit, t1 - t0, torch.zeros_like(t0))
    s = int(samples)
    if occupancy is not None and not getattr(occupancy, "ready", True):
        s = max(8, s // WARMUP_DIVISOR)  # everything occupied yet: coarse marching until the first update
    if train and ray_keys is not None:  # keyed by each ray's global position: the same on any rank
        u = keyed_uniform(ray_keys, s, dt)
    elif train and generator is not None:
        u = torch.rand((b, s), generator=generator, device=dev, dtype=dt)
    elif train:
        u = torch.rand((b, s), device=dev, dtype=dt)
    else:
        u = torch.full((b, s), 0.5, device=dev, dtype=dt)
    if spacing == "linear":
        delta = (span / s)[:, None].expand(b, s)  # (B, S)
        t = t0[:, None] + (torch.arange(s, device=dev, dtype=dt)[None] + u) * delta  # (B, S)
    else:
        if not torch.isfinite(t1[hit]).all():
            raise ValueError("render_rays: spacing lin_disp needs finite far bounds")
        t0h = torch.where(hit, t0, torch.zeros_like(t0)).clamp_min(torch.finfo(dt).tiny)
        t1h = torch.where(hit, t1, t0h + 1.0)
        edges = lin_disp_samples(t0h, t1h, torch.linspace(0.0, 1.0, s + 1, device=dev, dtype=dt)[None].expand(b, s + 1),
                                 split)  # (B, S + 1) bin edges
        delta = torch.where(hit[:, None], edges[:, 1:] - edges[:, :-1], torch.zeros_like(u))
        t = edges[:, :-1] + u * delta
    pos = origins[:, None, :] + t[..., None] * directions[:, None, :]  # (B, S, 3)
    if warp is not None:
        pos = warp(pos.reshape(-1, 3)).reshape(b, s, 3)
    return t, delta, pos, hit, s


def render_rays(field, origins: torch.Tensor, directions: torch.Tensor, near, far, background, *,
                occupancy=None, samples: int = 192, generator: Optional[torch.Generator] = None,
                train: bool = True, aabb: Optional[torch.Tensor] = None,
                viewdirs: Optional[torch.Tensor] = None, warp: Optional[Callable] = None,
                spacing: str = "linear", split: float = 1.0, ray_keys: Optional[torch.Tensor] = None) -> dict:
    """Composite ``field`` along rays over ``background``.

    Args:
        field: ``forward(x (P,3), d (P,3)) -> sigma (P,), rgb (P,3)``; ``density(x) -> (P,)``
            (used for the no-grad pre-pass when present); may be DDP-wrapped.
        origins, directions: (B, 3) float32, directions unit length.
        near, far: (B, 1), (B,), a float, or None (0 / +inf: then an aabb must bound the rays).
        background: (3,) RGB in [0, 1], or (B, 3) one colour per ray (random backgrounds; a
            learned colour may carry gradients).
        occupancy: optional :class:`OccupancyGrid` (anything with ``occupied(x (...,3)) -> bool``).
        samples: S stratified samples per ray inside [max(near, t_enter), min(far, t_exit)]
            (S / 4 while ``occupancy`` is given but not yet ``ready``: all cells occupied).
        generator: jitter source in training (the caller seeds it from (seed, step, rank)).
        ray_keys: (B,) int64 per-ray keys (:func:`~dali_nerf.models.keyed.ray_keys` of the rays'
            global stream positions); in training they replace ``generator``: sample j of ray i is
            jittered by ``keyed_uniform(ray_keys, S)[i, j]``, the same whichever rank renders it.
        train: jitter samples (else midpoints).
        aabb: (2, 3) clip box; default the occupancy grid's, else the field's ``aabb`` buffer
            (with ``warp``: only an explicit ``aabb`` clips, the field's box being in warped space).
        viewdirs: (B, 3) unit view directions the field sees (default ``directions``); for NDC
            rays (:func:`~dali_nerf.models.space.ndc_rays`, not unit) pass the world directions.
        warp: positions (P, 3) -> the field's and occupancy grid's coordinates (P, 3), e.g.
            ``lambda x: contract(normalize_to_box(x, box))`` (:mod:`dali_nerf.models.space`);
            depth stays in ``t`` along ``directions``.
        spacing: "linear" in t (default), or "lin_disp" (:func:`~dali_nerf.models.space.lin_disp_samples`:
            half the bins linear up to ``split``, half linear in disparity beyond; far must be finite).
        split: the distance where "lin_disp" switches from linear to disparity spacing.
    Returns:
        {"rgb": (B, 3), "depth": (B,) expected distance of the hit (0 where nothing is hit),
         "acc": (B,) opacity}; also "samples": number of points the field was evaluated on.
    """
    b = origins.shape[0]
    dev, dt = origins.device, origins.dtype
    bg = torch.as_tensor(background, dtype=dt, device=dev)
    bg = bg.reshape(3) if bg.numel() == 3 else bg.reshape(b, 3)  # one colour, or one per ray
    raw = _unwrap(field)
    if aabb is None and warp is None:
        aabb = getattr(occupancy, "aabb", None)
    if aabb is None and warp is None:
        aabb = getattr(raw, "aabb", None)
    t, delta, pos, hit, s = _ray_samples(origins, directions, near, far, aabb, occupancy, samples, generator, train,
                                         warp, spacing, split, ray_keys)
    mask = hit[:, None].expand(b, s)
    if occupancy is not None:
        mask = mask & occupancy.occupied(pos)

    # 1. no-grad pre-pass: early termination and alpha culling
    if hasattr(raw, "density"):
        with torch.no_grad():
            ray_i, smp_i = mask.nonzero(as_tuple=True)
            tau = torch.zeros((b, s), device=dev, dtype=dt)
            if ray_i.numel():
                tau[ray_i, smp_i] = raw.density(pos[ray_i, smp_i]).to(dt) * delta[ray_i, smp_i]
            trans = torch.exp(-(torch.cumsum(tau, dim=1) - tau))
            mask = mask & (trans > T_EPS) & (tau > TAU_EPS)

    # 2. one differentiable field evaluation on the surviving points
    ray_i, smp_i = mask.nonzero(as_tuple=True)
    x = pos[ray_i, smp_i]
    sigma, rgb = field(x, (directions if viewdirs is None else viewdirs)[ray_i])
    tau_k = sigma.to(dt) * delta[ray_i, smp_i]

    # 3. compositing in the padded layout
    tau = torch.zeros((b, s), device=dev, dtype=dt).index_put((ray_i, smp_i), tau_k)
    trans = torch.exp(-(torch.cumsum(tau, dim=1) - tau))
    w = trans * (1.0 - torch.exp(-tau))  # (B, S)
    w_k = w[ray_i, smp_i]
    color = torch.zeros((b, 3), device=dev, dtype=dt).index_add(0, ray_i, w_k[:, None] * rgb.to(dt))
    acc = w.sum(dim=1)
    depth = (w * t).sum(dim=1)
    color = color + (1.0 - acc)[:, None] * bg
    return {"rgb": color, "depth": depth, "acc": acc, "samples": int(ray_i.numel())}


@torch.no_grad()
def render_image(field, c2w: torch.Tensor, intrinsics: torch.Tensor, width: int, height: int, near, far,
                 background, *, occupancy=None, samples: int = 192, chunk: int = 8192, space=None) -> torch.Tensor:
    """Render one camera.

    Args:
        field: as in :func:`render_rays`.
        c2w: (3, 4) camera-to-world (OpenGL axes); intrinsics: (4,) fx, fy, cx, cy.
        width, height: image size; near, far: floats (or None, see render_rays).
        background: (3,); occupancy: optional grid; samples: per ray; chunk: rays per pass.
        space: the field's :class:`~dali_nerf.models.ray_space.RaySpace` (its ``render_args`` map
            the world rays; None: world space).
    Returns:
        (H, W, 3) float32 in [0, 1].

    Example:
        >>> img = render_image(field, c2w, K, 160, 160, 2.0, 6.0, torch.ones(3), occupancy=occ)
    """
    c2w = torch.as_tensor(c2w, dtype=torch.float32)
    intrinsics = torch.as_tensor(intrinsics, dtype=torch.float32)
    o, d = image_rays(c2w.cpu(), intrinsics.cpu(), int(width), int(height))
    dev = getattr(next(iter(_unwrap(field).parameters()), None), "device", c2w.device)
    o, d = o.to(dev), d.to(dev)
    out = []
    for i in range(0, o.shape[0], chunk):
        if space is None:
            r = render_rays(field, o[i:i + chunk], d[i:i + chunk], near, far, background,
                            occupancy=occupancy, samples=samples, train=False)
        else:
            kw = space.render_args(o[i:i + chunk], d[i:i + chunk], near, far)
            r = render_rays(field, kw.pop("origins"), kw.pop("directions"), kw.pop("near"), kw.pop("far"), background,
                            occupancy=occupancy, samples=samples, train=False, **kw)
        out.append(r["rgb"])
    return torch.cat(out).reshape(int(height), int(width), 3).clamp(0.0, 1.0)
