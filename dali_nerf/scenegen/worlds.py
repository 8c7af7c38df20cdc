"""The scenes of each kind, built from a seed: what the tracer renders, and the analytic first hit
of any ray (:func:`render_scene_rays`).

``objects``: 4-6 textured solids on a checkered floor disc, world up +z (Blender's).
``city``: 30-45 box buildings with window grids on a road grid, z up, ground at z = 0.
``forward``: 8-11 textured solids at 2.5-6 units in front of the cameras (+y), on a checkered
floor (z = -1), before a textured back wall at y = 7.3 (the environment: unlit).
``unbounded``: 7-9 textured solids on a ring (radius 1.3-2.5) around the origin on a checkered
floor disc (z = -0.5), inside a textured environment sphere of radius 10 (unlit).

>>> render_scene_rays("objects", [[0, 0, 4.0]], [[0, 0, -1.0]])["alpha"]
array([1.])
"""

from __future__ import annotations

import functools
import math

import numpy as np

from dali_nerf.errors import ConfigError
from dali_nerf.scenegen.tracer import CHUNK, Box, BoxSet, Cylinder, Floor, Sphere, World, trace

__all__ = ["render_scene_rays", "scene_world", "stream_rng", "OBJECTS_AABB", "CITY_GROUND", "CITY_AABB",
           "FORWARD_FLOOR_Z", "UNBOUNDED_FLOOR_Z", "UNBOUNDED_ENV_RADIUS"]

OBJECTS_AABB = ((-1.5, -1.5, -1.5), (1.5, 1.5, 1.5))
CITY_GROUND = 1.6            # ground square [-1.6, 1.6]^2 at z = 0
CITY_AABB = ((-CITY_GROUND, -CITY_GROUND, -0.05), (CITY_GROUND, CITY_GROUND, 0.55))
FORWARD_FLOOR_Z = -1.0
UNBOUNDED_FLOOR_Z = -0.5
UNBOUNDED_ENV_RADIUS = 10.0


def _hsv(h, s, v):
    """Scalar HSV in [0,1] -> (3,) RGB."""
    i = int(h * 6.0) % 6
    f = h * 6.0 - math.floor(h * 6.0)
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    return np.array([(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i])


def stream_rng(seed: int, stream: str) -> np.random.Generator:
    """An independent generator per (seed, named stream), e.g. ``stream_rng(0, "objects/world")``."""
    key = [int(b) for b in stream.encode()]
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(seed) >> 32 & 0xFFFFFFFF] + key))


def _solid_colors(rng, hue):
    """(2, 3) colours of a solid: a saturated one near ``hue`` and a contrasting darker one."""
    ca = _hsv(hue, rng.uniform(0.55, 0.85), rng.uniform(0.8, 0.95))
    cb = _hsv((hue + rng.uniform(0.35, 0.65)) % 1.0, rng.uniform(0.3, 0.7), rng.uniform(0.35, 0.6))
    return np.stack([ca, cb])


def _solid(rng, kind, x, y, floor_z, size, colors):
    """A textured sphere | box | cylinder of footprint ~``size`` standing on the floor at (x, y)."""
    if kind == "sphere":
        z = floor_z + size + (float(rng.uniform(0.0, 0.35)) if rng.random() < 0.3 else 0.0)
        return Sphere(np.array([x, y, z]), size, colors, (int(rng.integers(2, 4)) * 2, int(rng.integers(3, 6))),
                      str(rng.choice(["checker", "stripes"])))
    if kind == "box":
        half = np.array([size * rng.uniform(0.7, 1.0), size * rng.uniform(0.7, 1.0), size * rng.uniform(0.6, 1.3)])
        return Box(np.array([x, y, floor_z + half[2]]), half, float(rng.uniform(0, np.pi / 2)), colors,
                   float(size * rng.uniform(0.45, 0.7)))
    h = size * float(rng.uniform(1.6, 2.6))
    return Cylinder(np.array([x, y]), floor_z, floor_z + h, size * 0.8, colors,
                    (int(rng.integers(2, 5)) * 2, int(rng.integers(3, 6))))


def _objects_world(seed: int) -> World:
    rng = stream_rng(seed, "objects/world")
    floor_z = -0.45
    prims = [Floor(floor_z, 1.25, "disc", np.array([[0.82, 0.80, 0.74], [0.42, 0.40, 0.38]]), 0.3, "checker")]
    n_obj = int(rng.integers(4, 7))
    kinds = ["sphere", "box", "cylinder"] + list(rng.choice(["sphere", "box", "cylinder"], n_obj - 3))
    rng.shuffle(kinds)
    placed = []  # (x, y, footprint radius)
    hue0 = rng.random()
    for i, kind in enumerate(kinds):
        size = float(rng.uniform(0.22, 0.36))
        for _ in range(200):  # rejection sampling of non-overlapping footprints inside the disc
            rad = float(np.sqrt(rng.uniform(0.0, 1.0))) * (1.05 - size)
            ang = float(rng.uniform(0, 2 * np.pi))
            x, y = rad * math.cos(ang), rad * math.sin(ang)
            if all(math.hypot(x - px, y - py) > size * 1.45 + pr + 0.05 for px, py, pr in placed):
                break
        placed.append((x, y, size * 1.45))
        hue = (hue0 + i / len(kinds) + rng.uniform(-0.05, 0.05)) % 1.0
        prims.append(_solid(rng, kind, x, y, floor_z, size, _solid_colors(rng, hue)))
    return World(tuple(prims))


def _city_world(seed: int) -> World:
    rng = stream_rng(seed, "city/world")
    lot, n_lot = 0.27, 7                                   # 7x7 lots over [-0.95, 0.95]^2
    centres = (np.arange(n_lot) - (n_lot - 1) / 2) * lot
    prims = [Floor(0.0, CITY_GROUND, "square", np.array([[0.56, 0.60, 0.50], [0.24, 0.24, 0.26]]), lot, "roads")]
    n_bld = int(rng.integers(30, 46))
    lots = rng.permutation(n_lot * n_lot)[:n_bld]
    palette = [(0.08, 0.25), (0.58, 0.12), (0.0, 0.0), (0.1, 0.45), (0.55, 0.3), (0.03, 0.55)]
    lo, hi, wall_c, win_c, roof_c, cells = [], [], [], [], [], []
    for k in sorted(lots.tolist()):
        cx, cy = centres[k // n_lot], centres[k % n_lot]
        hx, hy = rng.uniform(0.05, 0.10), rng.uniform(0.05, 0.10)
        tall = rng.random() < 0.2
        hz = rng.uniform(0.25, 0.5) if tall else rng.uniform(0.06, 0.22)
        jx, jy = rng.uniform(-1, 1) * (0.115 - hx) * 0.8, rng.uniform(-1, 1) * (0.115 - hy) * 0.8
        hue, sat = palette[int(rng.integers(len(palette)))]
        wall = _hsv((hue + rng.uniform(-0.03, 0.03)) % 1.0, sat, rng.uniform(0.62, 0.9))
        lo.append([cx + jx - hx, cy + jy - hy, 0.0])
        hi.append([cx + jx + hx, cy + jy + hy, hz])
        wall_c.append(wall)
        win_c.append(_hsv(0.6, 0.35, rng.uniform(0.2, 0.35)))
        roof_c.append(wall * rng.uniform(0.55, 0.75))
        cells.append(rng.uniform(0.045, 0.06))
    prims.append(BoxSet(*(np.array(v, np.float64) for v in (lo, hi, wall_c, win_c, roof_c, cells))))
    return World(tuple(prims))


def _forward_world(seed: int) -> World:
    rng = stream_rng(seed, "forward/world")
    floor_z = FORWARD_FLOOR_Z
    prims = [Floor(floor_z, 9.0, "square", np.array([[0.80, 0.76, 0.68], [0.38, 0.35, 0.33]]), 0.5, "checker")]
    n_obj = int(rng.integers(8, 12))
    hue0 = rng.random()
    placed = []  # (x, y, footprint radius)
    for i in range(n_obj):
        kind = str(rng.choice(["sphere", "box", "cylinder"]))
        size = float(rng.uniform(0.3, 0.55))
        for _ in range(200):  # non-overlapping footprints inside the cameras' ~50 deg view
            y = float(rng.uniform(2.5, 6.0))
            x = float(rng.uniform(-0.42, 0.42)) * y
            if all(math.hypot(x - px, y - py) > size * 1.45 + pr + 0.05 for px, py, pr in placed):
                break
        placed.append((x, y, size * 1.45))
        hue = (hue0 + i * 0.38 + rng.uniform(-0.05, 0.05)) % 1.0
        prims.append(_solid(rng, kind, x, y, floor_z, size, _solid_colors(rng, hue)))
    wall = Box(np.array([0.0, 7.5, 1.5]), np.array([7.0, 0.2, 4.0]), 0.0,
               np.array([[0.86, 0.82, 0.70], [0.27, 0.33, 0.48]]), 0.7)
    return World(tuple(prims), environment=wall)


def _unbounded_world(seed: int) -> World:
    rng = stream_rng(seed, "unbounded/world")
    floor_z = UNBOUNDED_FLOOR_Z
    prims = [Floor(floor_z, 9.0, "disc", np.array([[0.72, 0.78, 0.62], [0.36, 0.40, 0.30]]), 0.6, "checker")]
    n_obj = int(rng.integers(7, 10))
    a0, hue0 = rng.uniform(0, 2 * np.pi), rng.random()
    for i in range(n_obj):
        kind = str(rng.choice(["sphere", "box", "cylinder"]))
        size = float(rng.uniform(0.3, 0.5))
        ang = a0 + 2 * np.pi * i / n_obj + rng.uniform(-0.15, 0.15)
        rad = float(rng.uniform(1.3, 2.5))
        hue = (hue0 + i * 0.38 + rng.uniform(-0.05, 0.05)) % 1.0
        prims.append(_solid(rng, kind, rad * math.cos(ang), rad * math.sin(ang), floor_z, size, _solid_colors(rng, hue)))
    sky = Sphere(np.zeros(3), UNBOUNDED_ENV_RADIUS, np.array([[0.55, 0.70, 0.92], [0.95, 0.86, 0.62]]), (24, 10), "checker")
    return World(tuple(prims), environment=sky)


_BUILDERS = {"objects": _objects_world, "city": _city_world, "forward": _forward_world, "unbounded": _unbounded_world}


@functools.lru_cache(maxsize=8)
def scene_world(kind: str, seed: int) -> World:
    """The scene of ``kind`` for ``seed`` (cached: the same object for the same arguments)."""
    if kind not in _BUILDERS:
        raise ConfigError(f"kind={kind!r}: use one of {', '.join(_BUILDERS)}")
    return _BUILDERS[kind](seed)


def render_scene_rays(kind: str, origins, directions, seed: int = 0) -> dict:
    """Analytic first hit of rays in the SCENE frame of ``kind`` (see the module docstring).

    The same scene description (built from ``seed``) renders the images, so the pixel (row, col)
    of a generated camera is exactly ``render_scene_rays`` of that pixel's ray.

    Args:
        kind: "objects" | "city" | "forward" | "unbounded".
        origins: (B, 3) ray origins (numpy or torch; computed in float64).
        directions: (B, 3) ray directions (normalised here; depth is along the unit direction).
        seed: the scene's seed.
    Returns:
        dict of numpy arrays: ``rgb`` (B, 3) float64 shaded surface colour in [0, 1] (0 where
        nothing is hit; images store it composited over white), ``alpha`` (B,) 1 hit / 0 miss,
        ``depth`` (B,) distance to the hit (inf on a miss), ``points`` (B, 3) the hit point (nan
        on a miss), ``prim`` (B,) int64 index of the primitive hit (-1 on a miss).

    Example:
        >>> out = render_scene_rays("objects", [[0, 0, 4.0]], [[0, 0, -1.0]])
        >>> out["depth"].shape, out["alpha"][0]
        ((1,), 1.0)
    """
    o = np.asarray(origins.detach().cpu().numpy() if hasattr(origins, "detach") else origins, np.float64).reshape(-1, 3)
    d = np.asarray(directions.detach().cpu().numpy() if hasattr(directions, "detach") else directions, np.float64).reshape(-1, 3)
    if o.shape != d.shape:
        raise ValueError(f"origins {o.shape} and directions {d.shape} must both be (B, 3)")
    d = d / np.linalg.norm(d, axis=1, keepdims=True)
    world = scene_world(kind, int(seed))
    rgb, alpha, depth, prim = [], [], [], []
    for s in range(0, len(o), CHUNK):
        r = trace(world, o[s:s + CHUNK], d[s:s + CHUNK])
        for lst, v in zip((rgb, alpha, depth, prim), r):
            lst.append(v)
    cat = lambda lst, shape: np.concatenate(lst) if lst else np.zeros(shape)  # noqa: E731
    rgb, alpha, depth, prim = cat(rgb, (0, 3)), cat(alpha, (0,)), cat(depth, (0,)), cat(prim, (0,)).astype(np.int64)
    points = np.where((alpha > 0)[:, None], o + np.where(alpha > 0, depth, 0.0)[:, None] * d, np.nan)
    return {"rgb": rgb, "alpha": alpha, "depth": depth, "points": points, "prim": prim}

