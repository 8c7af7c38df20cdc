"""``dali-nerf make-scene objects|city``: multi-view scenes with known cameras, rendered by us.

There is no internet and tests, the demo and the benchmarks need real, learnable, view-consistent
data, so we ray-cast ANALYTIC scenes (numpy, float64, vectorised over rays; no per-pixel Python):
exact first-hit intersection with spheres, yawed boxes, vertical cylinders and floor planes,
smooth procedural textures (soft checkers, stripes, window grids), Lambertian shading with one
directional light + ambient and hard shadows (one shadow ray per hit). Colour is view-independent.
One ray per pixel, through the pixel centre (+0.5), with the exact camera formula of
ARCHITECTURE.md -- so a perfect radiance field reproduces the images exactly (no anti-aliasing
blur to learn). Same seed -> same bytes (fixed PNG/JPEG encoder parameters, no timestamps).

Kinds:

``objects`` (the DDP workload) -- Blender synthetic format::

    out/transforms_{train,val,test}.json   camera_angle_x, near 2, far 6, aabb [-1.5,1.5]^3,
                                           frames: file_path "./train/r_0" (no extension for PNG,
                                           "./train/r_0.jpg" for JPEG), transform_matrix 4x4 c2w
    out/{train,val,test}/r_<i>.png         RGBA, alpha 0 where the ray hits nothing

  4-6 textured solids on a checkered floor disc, world up +z (like Blender), cameras at radius 4
  looking at the origin: train on a jittered golden-angle spiral over the upper hemisphere
  (elevation 15-75 deg), val random, test an orbit at 30 deg elevation. Defaults 160x160, 60/5/10.

``city`` (the spatial-segmentation workload) -- Mega-NeRF layout AND a nerfstudio transforms.json::

    out/coordinates.pt                     {'origin_drb': (3,) f32, 'pose_scale_factor': float,
                                            'near': float, 'far': float, 'aabb': (2,3) f32}
                                            (near/far/aabb in the normalised frame of the stored
                                            c2w; Mega-NeRF's own files have only the first two)
    out/{train,val}/rgbs/<global id>.png   RGBA (alpha 0 = sky; its RGB is white), ids unique
                                           across splits as Mega-NeRF expects
    out/{train,val}/metadata/<id>.pt       {'W': int, 'H': int, 'intrinsics': (4,) f32 fx fy cx cy,
                                            'c2w': (3,4) f32} -- plain tensors and ints only
                                            (torch.load(weights_only=True) works)
    out/transforms.json                    nerfstudio: shared fl_x fl_y cx cy w h, PINHOLE,
                                           frames (file_path -> the same rgbs), OpenGL c2w in
                                           the SCENE frame (below), train/val/test_filenames
                                           (test = val unless n_test > 0), near, far, aabb

  30-45 box buildings with window grids on a road grid, cameras on an oblique lawnmower grid
  (rows along x, heading alternating +x / -x, 30 deg off nadir), val cameras between the rows.
  Defaults 128x96, 48 train + 6 val.

Frames. ``render_scene_rays`` works in each kind's SCENE frame:

* objects: the Blender world (z up) -- identical to what the json files store;
* city: z up, ground at z = 0, the city in [-1, 1]^2, cameras at altitude ~1 -- identical to
  transforms.json. Mega-NeRF's files are in its DRB world ("down, right, back": x down, y right,
  z back) in metres, recentred and scaled as Mega-NeRF stores them::

      p_drb_metres = CITY_METRES_PER_UNIT * DRB_FROM_SCENE @ p_scene + CITY_DRB_OFFSET
      p_stored     = (p_drb_metres - origin_drb) / pose_scale_factor

  and the columns of the stored c2w rotation are the OpenGL camera axes (right, up, back) in that
  DRB world, as Mega-NeRF's own ray code uses them (``_MEGA_NERF_CAMERA_COLUMNS``).

>>> from dali_nerf.scenegen import make_scene
>>> make_scene("objects", "data/default")                       # doctest: +SKIP
PosixPath('data/default')
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .errors import ConfigError, DaliNerfError

__all__ = [
    "make_scene", "render_scene_rays", "scene_cameras", "main", "KINDS", "DEFAULTS",
    "DRB_FROM_SCENE", "CITY_METRES_PER_UNIT", "CITY_DRB_OFFSET", "BLENDER_CAMERA_ANGLE_X",
]

KINDS = ("objects", "city")

# kind -> (width, height, n_train, n_val, n_test)
DEFAULTS = {
    "objects": (160, 160, 60, 5, 10),
    "city": (128, 96, 48, 6, 0),
}

BLENDER_CAMERA_ANGLE_X = 0.6911112070083618  # the Blender synthetic scenes' horizontal FOV
OBJECTS_RADIUS = 4.0
OBJECTS_NEAR, OBJECTS_FAR = 2.0, 6.0
OBJECTS_AABB = ((-1.5, -1.5, -1.5), (1.5, 1.5, 1.5))

# city: scene frame (z up, units ~ 100 m) -> Mega-NeRF DRB world in metres
DRB_FROM_SCENE = np.array([[0.0, 0.0, -1.0],   # x_drb (down)  = -z_scene
                           [1.0, 0.0, 0.0],    # y_drb (right) =  x_scene
                           [0.0, -1.0, 0.0]])  # z_drb (back)  = -y_scene   (det = +1)
CITY_METRES_PER_UNIT = 100.0
CITY_DRB_OFFSET = np.array([-35.0, 420.0, -1250.0])  # a geo-like offset so origin_drb is non-trivial
CITY_GROUND = 1.6            # ground square [-1.6, 1.6]^2 at z = 0
CITY_ALTITUDE = 1.0
CITY_TILT_DEG = 30.0         # off nadir, towards the heading
CITY_HFOV_DEG = 60.0
CITY_AABB = ((-CITY_GROUND, -CITY_GROUND, -0.05), (CITY_GROUND, CITY_GROUND, 0.55))

# Mega-NeRF c2w camera columns written here: OpenGL (right, up, back) axes expressed in the DRB
# world -- what Mega-NeRF's own get_rays (mega_nerf/ray_utils.py: OpenGL-style directions times
# c2w[:, :3]) and its README's conversion (DRB camera pose, then cat([c1, -c0, c2, t])) produce,
# and what our mega_nerf parser reads (its CAMERA_COLUMNS).
_MEGA_NERF_CAMERA_COLUMNS = "right,up,back"

_EPS = 1e-9
_LIGHT = np.array([0.45, 0.3, 1.0]) / np.linalg.norm([0.45, 0.3, 1.0])
_AMBIENT = 0.32
_CHUNK = 1 << 17  # rays traced per numpy pass


# ------------------------------------------------------------------------------------------
# textures (smooth, analytic: continuous in the hit point, so tiny ray errors change little)
# ------------------------------------------------------------------------------------------
def _soft_checker(u, v, sharp=3.0):
    """(B,), (B,) in cells -> (B,) weight in [0, 1]: 1 on 'odd' cells, soft edges."""
    return 0.5 + 0.5 * np.tanh(sharp * np.sin(np.pi * u) * np.sin(np.pi * v))


def _soft_pulse(u, sharp=3.0):
    """(B,) in periods -> (B,) weight in [0, 1]: 1 in the middle half of each period."""
    return 0.5 + 0.5 * np.tanh(sharp * -np.cos(2.0 * np.pi * u))


def _mix(a, b, w):
    """a, b (3,) colours, w (B,) -> (B, 3)."""
    return a[None, :] * (1.0 - w[:, None]) + b[None, :] * w[:, None]


# ------------------------------------------------------------------------------------------
# primitives: intersect(o (B,3), d (B,3) unit) -> t (B,) (inf = miss), n (B,3) unit outward;
#             albedo(p (B,3), n (B,3)) -> (B,3) in [0,1]
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class _Sphere:
    center: np.ndarray
    radius: float
    colors: np.ndarray  # (2, 3)
    freq: tuple         # (longitude cells (int, even), latitude cells)
    pattern: str        # "checker" | "stripes"

    def intersect(self, o, d):
        oc = o - self.center
        b = np.einsum("ij,ij->i", oc, d)
        c = np.einsum("ij,ij->i", oc, oc) - self.radius ** 2
        disc = b * b - c
        sq = np.sqrt(np.maximum(disc, 0.0))
        t0, t1 = -b - sq, -b + sq
        t = np.where(t0 > _EPS, t0, np.where(t1 > _EPS, t1, np.inf))
        t = np.where(disc > 0.0, t, np.inf)
        p = o + np.where(np.isfinite(t), t, 0.0)[:, None] * d
        return t, (p - self.center) / self.radius

    def albedo(self, p, n):
        lon = np.arctan2(n[:, 1], n[:, 0]) / np.pi          # [-1, 1]
        lat = np.arccos(np.clip(n[:, 2], -1.0, 1.0)) / np.pi  # [0, 1]
        if self.pattern == "checker":
            w = _soft_checker(lon * self.freq[0] / 2.0, lat * self.freq[1])
        else:
            w = _soft_pulse(lat * self.freq[1] + 0.15 * np.sin(np.pi * lon * self.freq[0] / 2.0))
        return _mix(self.colors[0], self.colors[1], w)


@dataclass(frozen=True, eq=False)
class _Box:
    center: np.ndarray
    half: np.ndarray     # (3,) half extents in the box frame
    yaw: float           # rotation about +z
    colors: np.ndarray   # (2, 3)
    cell: float          # checker cell size

    def _rot(self):
        c, s = math.cos(self.yaw), math.sin(self.yaw)
        return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])

    def intersect(self, o, d):
        r = self._rot()
        ol = (o - self.center) @ r  # R^T (o - c), row vectors
        dl = d @ r
        dl = np.where(np.abs(dl) < 1e-15, np.copysign(1e-15, dl), dl)
        inv = 1.0 / dl
        t1 = (-self.half - ol) * inv
        t2 = (self.half - ol) * inv
        tmin3 = np.minimum(t1, t2)
        tmax3 = np.maximum(t1, t2)
        tn = np.maximum(np.maximum(tmin3[:, 0], tmin3[:, 1]), tmin3[:, 2])
        tf = np.minimum(np.minimum(tmax3[:, 0], tmax3[:, 1]), tmax3[:, 2])
        hit = (tf >= tn) & (tn > _EPS)
        t = np.where(hit, tn, np.inf)
        axis = np.where(tmin3[:, 0] == tn, 0, np.where(tmin3[:, 1] == tn, 1, 2))
        nl = np.zeros_like(ol)
        nl[np.arange(len(ol)), axis] = -np.sign(dl[np.arange(len(ol)), axis])
        return t, nl @ r.T

    def albedo(self, p, n):
        r = self._rot()
        pl = (p - self.center) @ r
        ax = np.abs(n @ r).argmax(axis=1)
        u = np.where(ax == 0, pl[:, 1], pl[:, 0])  # the two in-face coordinates
        v = np.where(ax == 2, pl[:, 1], pl[:, 2])
        return _mix(self.colors[0], self.colors[1], _soft_checker(u / self.cell + 0.5, v / self.cell + 0.5))


@dataclass(frozen=True, eq=False)
class _BoxSet:
    """Many axis-aligned boxes (the city's buildings), intersected together: (B, K) arrays per
    axis instead of K Python-level passes. Texture: window grid on the walls, plain roof."""

    lo: np.ndarray      # (K, 3)
    hi: np.ndarray      # (K, 3)
    wall: np.ndarray    # (K, 3)
    window: np.ndarray  # (K, 3)
    roof: np.ndarray    # (K, 3)
    cell: np.ndarray    # (K,) window period

    @property
    def count(self) -> int:
        return len(self.lo)

    def intersect(self, o, d):
        if len(o) > 8192:  # keep the (B, K) temporaries in cache
            parts = [self.intersect(o[s:s + 8192], d[s:s + 8192]) for s in range(0, len(o), 8192)]
            return tuple(np.concatenate(x) for x in zip(*parts))
        tn = np.full((len(o), self.count), -np.inf)
        tf = np.full((len(o), self.count), np.inf)
        face = np.zeros((len(o), self.count), np.int8)
        for a in range(3):
            da = d[:, a:a + 1]
            da = np.where(np.abs(da) < 1e-15, np.copysign(1e-15, da), da)
            inv = 1.0 / da
            t1 = (self.lo[None, :, a] - o[:, a:a + 1]) * inv
            t2 = (self.hi[None, :, a] - o[:, a:a + 1]) * inv
            near_a = np.minimum(t1, t2)
            upd = near_a > tn
            tn = np.where(upd, near_a, tn)
            face = np.where(upd, a, face)
            tf = np.minimum(tf, np.maximum(t1, t2))
        t_all = np.where((tf >= tn) & (tn > _EPS), tn, np.inf)
        sub = t_all.argmin(axis=1)
        rows = np.arange(len(o))
        t = t_all[rows, sub]
        ax = face[rows, sub].astype(np.int64)
        n = np.zeros_like(o)
        n[rows, ax] = -np.sign(d[rows, ax])
        return t, n, sub

    def albedo(self, p, n, sub):
        lo, hi, cell = self.lo[sub], self.hi[sub], self.cell[sub]
        ax = np.abs(n).argmax(axis=1)
        u = np.where(ax == 0, p[:, 1] - lo[:, 1], p[:, 0] - lo[:, 0])
        height = p[:, 2] - lo[:, 2]
        w = _soft_pulse(u / cell + 0.5) * _soft_pulse(height / (0.85 * cell) - 0.5)
        w = w * (height > 0.4 * cell) * (height < (hi[:, 2] - lo[:, 2]) - 0.3 * cell)
        wall = self.wall[sub] * (1.0 - w[:, None]) + self.window[sub] * w[:, None]
        return np.where((ax == 2)[:, None], self.roof[sub], wall)


@dataclass(frozen=True, eq=False)
class _Cylinder:
    center: np.ndarray  # (2,) x, y of the axis
    z0: float
    z1: float
    radius: float
    colors: np.ndarray  # (2, 3)
    freq: tuple         # (angular cells (even int), cells along height)

    def intersect(self, o, d):
        ox, oy = o[:, 0] - self.center[0], o[:, 1] - self.center[1]
        dx, dy = d[:, 0], d[:, 1]
        a = dx * dx + dy * dy
        b = ox * dx + oy * dy
        c = ox * ox + oy * oy - self.radius ** 2
        disc = b * b - a * c
        sq = np.sqrt(np.maximum(disc, 0.0))
        with np.errstate(divide="ignore", invalid="ignore"):
            ts = (-b - sq) / a
        zs = o[:, 2] + ts * d[:, 2]
        side_ok = (disc > 0) & (a > 1e-14) & (ts > _EPS) & (zs >= self.z0) & (zs <= self.z1)
        t_side = np.where(side_ok, ts, np.inf)
        best, kind = t_side, np.zeros(len(o), np.int8)
        for k, zc in ((1, self.z1), (2, self.z0)):
            with np.errstate(divide="ignore", invalid="ignore"):
                tc = (zc - o[:, 2]) / d[:, 2]
            px, py = ox + tc * dx, oy + tc * dy
            ok = np.isfinite(tc) & (tc > _EPS) & (px * px + py * py <= self.radius ** 2)
            tc = np.where(ok, tc, np.inf)
            better = tc < best
            best = np.where(better, tc, best)
            kind = np.where(better, k, kind)
        tt = np.where(np.isfinite(best), best, 0.0)
        n = np.zeros_like(o)
        n[:, 0] = (ox + tt * dx) / self.radius
        n[:, 1] = (oy + tt * dy) / self.radius
        n = np.where((kind == 0)[:, None], n, 0.0)
        n[:, 2] = np.where(kind == 1, 1.0, np.where(kind == 2, -1.0, 0.0))
        return best, n

    def albedo(self, p, n):
        ang = np.arctan2(p[:, 1] - self.center[1], p[:, 0] - self.center[0]) / np.pi
        h = (p[:, 2] - self.z0) / (self.z1 - self.z0)
        side = _soft_pulse(h * self.freq[1] + 0.2 * np.sin(np.pi * ang * self.freq[0] / 2.0))
        cap = _soft_checker((p[:, 0] - self.center[0]) / self.radius * 2.0 + 0.5,
                            (p[:, 1] - self.center[1]) / self.radius * 2.0 + 0.5)
        w = np.where(np.abs(n[:, 2]) > 0.5, cap, side)
        return _mix(self.colors[0], self.colors[1], w)


@dataclass(frozen=True, eq=False)
class _Floor:
    z: float
    extent: float       # disc radius (shape "disc") or square half side (shape "square")
    shape: str
    colors: np.ndarray  # (2, 3) ; city: (ground, road, marking)
    cell: float
    pattern: str        # "checker" | "roads"

    def intersect(self, o, d):
        with np.errstate(divide="ignore", invalid="ignore"):
            t = (self.z - o[:, 2]) / d[:, 2]
        x, y = o[:, 0] + t * d[:, 0], o[:, 1] + t * d[:, 1]
        inside = (x * x + y * y <= self.extent ** 2) if self.shape == "disc" else (
            (np.abs(x) <= self.extent) & (np.abs(y) <= self.extent))
        ok = np.isfinite(t) & (t > _EPS) & inside & (o[:, 2] > self.z)  # seen from above only
        n = np.zeros_like(o)
        n[:, 2] = 1.0
        return np.where(ok, t, np.inf), n

    def albedo(self, p, n):
        if self.pattern == "checker":
            return _mix(self.colors[0], self.colors[1], _soft_checker(p[:, 0] / self.cell, p[:, 1] / self.cell))
        # roads: dark bands between the lots (lot centres at multiples of cell)
        band = lambda x: 0.5 + 0.5 * np.tanh(5.0 * (np.cos(2.0 * np.pi * (x / self.cell + 0.5)) - 0.7))  # noqa: E731
        road = np.maximum(band(p[:, 0]), band(p[:, 1]))
        return _mix(self.colors[0], self.colors[1], road)


@dataclass(frozen=True, eq=False)
class _World:
    prims: tuple
    shadows: bool = True


def _hsv(h, s, v):
    """Scalar HSV in [0,1] -> (3,) RGB."""
    i = int(h * 6.0) % 6
    f = h * 6.0 - math.floor(h * 6.0)
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    return np.array([(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i])


def _rng(seed: int, stream: str) -> np.random.Generator:
    key = [int(b) for b in stream.encode()]
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(seed) >> 32 & 0xFFFFFFFF] + key))


def _objects_world(seed: int) -> _World:
    rng = _rng(seed, "objects/world")
    floor_z = -0.45
    prims = [_Floor(floor_z, 1.25, "disc", np.array([[0.82, 0.80, 0.74], [0.42, 0.40, 0.38]]), 0.3, "checker")]
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
        ca = _hsv(hue, rng.uniform(0.55, 0.85), rng.uniform(0.8, 0.95))
        cb = _hsv((hue + rng.uniform(0.35, 0.65)) % 1.0, rng.uniform(0.3, 0.7), rng.uniform(0.35, 0.6))
        colors = np.stack([ca, cb])
        if kind == "sphere":
            z = floor_z + size + (float(rng.uniform(0.0, 0.35)) if rng.random() < 0.3 else 0.0)
            prims.append(_Sphere(np.array([x, y, z]), size, colors, (int(rng.integers(2, 4)) * 2, int(rng.integers(3, 6))),
                                 str(rng.choice(["checker", "stripes"]))))
        elif kind == "box":
            half = np.array([size * rng.uniform(0.7, 1.0), size * rng.uniform(0.7, 1.0), size * rng.uniform(0.6, 1.3)])
            prims.append(_Box(np.array([x, y, floor_z + half[2]]), half, float(rng.uniform(0, np.pi / 2)), colors,
                              float(size * rng.uniform(0.45, 0.7))))
        else:
            h = size * float(rng.uniform(1.6, 2.6))
            prims.append(_Cylinder(np.array([x, y]), floor_z, floor_z + h, size * 0.8, colors,
                                   (int(rng.integers(2, 5)) * 2, int(rng.integers(3, 6)))))
    return _World(tuple(prims))


def _city_world(seed: int) -> _World:
    rng = _rng(seed, "city/world")
    lot, n_lot = 0.27, 7                                   # 7x7 lots over [-0.95, 0.95]^2
    centres = (np.arange(n_lot) - (n_lot - 1) / 2) * lot
    prims = [_Floor(0.0, CITY_GROUND, "square", np.array([[0.56, 0.60, 0.50], [0.24, 0.24, 0.26]]), lot, "roads")]
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
    prims.append(_BoxSet(*(np.array(v, np.float64) for v in (lo, hi, wall_c, win_c, roof_c, cells))))
    return _World(tuple(prims))


@functools.lru_cache(maxsize=8)
def _world(kind: str, seed: int) -> _World:
    if kind == "objects":
        return _objects_world(seed)
    if kind == "city":
        return _city_world(seed)
    raise ConfigError(f"kind={kind!r}: use one of {', '.join(KINDS)}")


def _count(prim) -> int:
    return getattr(prim, "count", 1)


def _first_hit(world: _World, o, d):
    """o, d (B,3) -> t (B,) (inf = miss), global primitive id (B,) int64 (-1 = miss), n (B,3),
    primitive index (B,) (-1 = miss), sub-primitive index (B,) (boxes of a _BoxSet, else 0)."""
    best = np.full(len(o), np.inf)
    which = np.full(len(o), -1, np.int64)
    sub = np.zeros(len(o), np.int64)
    gid = np.full(len(o), -1, np.int64)
    n = np.zeros_like(o)
    base = 0
    for k, prim in enumerate(world.prims):
        r = prim.intersect(o, d)
        t, nk = r[0], r[1]
        sk = r[2] if len(r) == 3 else 0
        better = t < best
        best = np.where(better, t, best)
        which = np.where(better, k, which)
        sub = np.where(better, sk, sub)
        gid = np.where(better, base + sk, gid)
        n = np.where(better[:, None], nk, n)
        base += _count(prim)
    return best, gid, n, which, sub


def _trace(world: _World, o, d):
    """o (B,3), d (B,3) unit float64 -> rgb (B,3) surface colour (0 on misses), alpha (B,),
    depth (B,) (inf on misses), global primitive id (B,) (-1 on misses)."""
    t, gid, n, which, sub = _first_hit(world, o, d)
    hit = which >= 0
    rgb = np.zeros_like(o)
    if hit.any():
        p = o[hit] + t[hit, None] * d[hit]
        nh, wh, sh = n[hit], which[hit], sub[hit]
        alb = np.zeros_like(p)
        for k, prim in enumerate(world.prims):
            m = wh == k
            if m.any():
                alb[m] = prim.albedo(p[m], nh[m], sh[m]) if hasattr(prim, "count") else prim.albedo(p[m], nh[m])
        ndl = nh @ _LIGHT
        lit = ndl > 0
        vis = np.zeros(len(p))
        if world.shadows and lit.any():
            so = p[lit] + nh[lit] * 1e-6
            ts = _first_hit(world, so, np.broadcast_to(_LIGHT, so.shape))[0]
            vis[lit] = np.isinf(ts)
        else:
            vis[lit] = 1.0
        shade = _AMBIENT + (1.0 - _AMBIENT) * np.maximum(ndl, 0.0) * vis
        rgb[hit] = np.clip(alb * shade[:, None], 0.0, 1.0)
    return rgb, hit.astype(np.float64), t, gid


def render_scene_rays(kind: str, origins, directions, seed: int = 0) -> dict:
    """Analytic first hit of rays in the SCENE frame of ``kind`` (see the module docstring).

    The same scene description (built from ``seed``) renders the images, so the pixel (row, col)
    of a generated camera is exactly ``render_scene_rays`` of that pixel's ray.

    Args:
        kind: "objects" | "city".
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
    world = _world(kind, int(seed))
    rgb, alpha, depth, prim = [], [], [], []
    for s in range(0, len(o), _CHUNK):
        r = _trace(world, o[s:s + _CHUNK], d[s:s + _CHUNK])
        for lst, v in zip((rgb, alpha, depth, prim), r):
            lst.append(v)
    cat = lambda lst, shape: np.concatenate(lst) if lst else np.zeros(shape)  # noqa: E731
    rgb, alpha, depth, prim = cat(rgb, (0, 3)), cat(alpha, (0,)), cat(depth, (0,)), cat(prim, (0,)).astype(np.int64)
    points = np.where((alpha > 0)[:, None], o + np.where(alpha > 0, depth, 0.0)[:, None] * d, np.nan)
    return {"rgb": rgb, "alpha": alpha, "depth": depth, "points": points, "prim": prim}


# ------------------------------------------------------------------------------------------
# cameras
# ------------------------------------------------------------------------------------------
def _look_at(eye, target, up=(0.0, 0.0, 1.0)):
    """eye, target (3,) -> (3, 4) OpenGL c2w (x right, y up, looks down -z)."""
    eye = np.asarray(eye, np.float64)
    f = np.asarray(target, np.float64) - eye
    f /= np.linalg.norm(f)
    r = np.cross(f, up)
    r /= np.linalg.norm(r)
    u = np.cross(r, f)
    return np.stack([r, u, -f, eye], axis=1)


def _pose_from_heading(eye, heading, tilt_deg):
    """Aerial camera at eye, flying along unit heading (horizontal), pitched tilt_deg off nadir
    towards it -> (3, 4) OpenGL c2w."""
    t = math.radians(tilt_deg)
    h = np.array([heading[0], heading[1], 0.0])
    h /= np.linalg.norm(h)
    fwd = math.sin(t) * h + math.cos(t) * np.array([0.0, 0.0, -1.0])
    return _look_at(eye, np.asarray(eye) + fwd, up=tuple(h))


def _objects_cameras(seed, n_train, n_val, n_test):
    out = {}
    lo, hi = math.sin(math.radians(15.0)), math.sin(math.radians(75.0))
    golden = math.pi * (3.0 - math.sqrt(5.0))
    rng = _rng(seed, "objects/cameras")
    az0 = rng.uniform(0, 2 * np.pi)
    poses = []
    for i in range(n_train):  # golden-angle spiral, uniform in area over the elevation band
        s = lo + (hi - lo) * (i + rng.uniform(0.25, 0.75)) / n_train
        el, az = math.asin(s), az0 + i * golden + rng.uniform(-0.1, 0.1)
        poses.append(_sph(el, az))
    out["train"] = poses
    out["val"] = [_sph(math.asin(rng.uniform(lo, hi)), rng.uniform(0, 2 * np.pi)) for _ in range(n_val)]
    off = rng.uniform(0, 2 * np.pi)
    out["test"] = [_sph(math.radians(30.0), off + 2 * np.pi * (i + 0.5) / max(n_test, 1)) for i in range(n_test)]
    return {k: np.stack(v) if v else np.zeros((0, 3, 4)) for k, v in out.items()}


def _sph(el, az):
    eye = OBJECTS_RADIUS * np.array([math.cos(el) * math.cos(az), math.cos(el) * math.sin(az), math.sin(el)])
    return _look_at(eye, np.zeros(3))


def _lawnmower(n, span, rng, jitter):
    """n aerial poses on rows along x over [-span, span]^2, heading alternating per row."""
    rows = max(1, int(round(math.sqrt(n * 0.75))))
    cols = int(math.ceil(n / rows))
    ys = np.linspace(-span, span, rows) if rows > 1 else np.zeros(1)
    xs = np.linspace(-span, span, cols) if cols > 1 else np.zeros(1)
    poses = []
    for r in range(rows):
        heading = (1.0, 0.0) if r % 2 == 0 else (-1.0, 0.0)
        order = xs if r % 2 == 0 else xs[::-1]
        for x in order:
            if len(poses) == n:
                break
            eye = np.array([x, ys[r], CITY_ALTITUDE]) + rng.uniform(-1, 1, 3) * jitter
            poses.append(_pose_from_heading(eye, heading, CITY_TILT_DEG + rng.uniform(-2.0, 2.0)))
    return poses


def _city_cameras(seed, n_train, n_val, n_test):
    rng = _rng(seed, "city/cameras")
    out = {"train": _lawnmower(n_train, 0.8, rng, np.array([0.02, 0.02, 0.03]))}
    for split, n in (("val", n_val), ("test", n_test)):
        poses = []
        for _ in range(n):  # between the rows, random heading
            eye = np.array([rng.uniform(-0.7, 0.7), rng.uniform(-0.7, 0.7), CITY_ALTITUDE + rng.uniform(-0.05, 0.05)])
            a = rng.uniform(0, 2 * np.pi)
            poses.append(_pose_from_heading(eye, (math.cos(a), math.sin(a)), CITY_TILT_DEG + rng.uniform(-3.0, 3.0)))
        out[split] = poses
    return {k: np.stack(v) if v else np.zeros((0, 3, 4)) for k, v in out.items()}


def _intrinsics(kind, width, height):
    if kind == "objects":
        f = 0.5 * width / math.tan(0.5 * BLENDER_CAMERA_ANGLE_X)
    else:
        f = 0.5 * width / math.tan(0.5 * math.radians(CITY_HFOV_DEG))
    return np.array([f, f, width / 2.0, height / 2.0])


def _resolve(kind, width, height, n_train, n_val, n_test):
    if kind not in KINDS:
        raise ConfigError(f"kind={kind!r}: use one of {', '.join(KINDS)}")
    dw, dh, dtr, dva, dte = DEFAULTS[kind]
    if width is None and height is None:
        width, height = dw, dh
    elif width is None:
        width = int(round(height * dw / dh))
    elif height is None:
        height = int(round(width * dh / dw))
    vals = {"width": width, "height": height,
            "n_train": dtr if n_train is None else n_train,
            "n_val": dva if n_val is None else n_val,
            "n_test": dte if n_test is None else n_test}
    for k, v in vals.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ConfigError(f"{k}={v!r}: must be an integer")
    for k in ("width", "height"):
        if not 8 <= vals[k] <= 8192:
            raise ConfigError(f"{k}={vals[k]}: image size must be in [8, 8192] pixels")
    if vals["n_train"] < 1 or vals["n_val"] < 1:
        raise ConfigError(f"n_train={vals['n_train']}, n_val={vals['n_val']}: need at least 1 train and 1 val image")
    min_test = 1 if kind == "objects" else 0
    if vals["n_test"] < min_test:
        raise ConfigError(f"n_test={vals['n_test']}: must be >= {min_test} for kind {kind!r}")
    if sum(vals[k] for k in ("n_train", "n_val", "n_test")) > 100000:
        raise ConfigError("n_train + n_val + n_test: at most 100000 images")
    return tuple(int(vals[k]) for k in ("width", "height", "n_train", "n_val", "n_test"))


def scene_cameras(kind: str, *, width=None, height=None, n_train=None, n_val=None, n_test=None, seed: int = 0) -> dict:
    """The cameras ``make_scene`` renders with the same arguments, in the SCENE frame.

    Returns:
        {split: {"c2w": (N, 3, 4) float64 OpenGL c2w, "intrinsics": (N, 4) float64 fx fy cx cy,
        "width": int, "height": int}} for "train", "val", "test" (city: "test" may have N = 0).
    """
    width, height, n_train, n_val, n_test = _resolve(kind, width, height, n_train, n_val, n_test)
    cams = (_objects_cameras if kind == "objects" else _city_cameras)(int(seed), n_train, n_val, n_test)
    k = _intrinsics(kind, width, height)
    return {s: {"c2w": c, "intrinsics": np.tile(k, (len(c), 1)), "width": width, "height": height} for s, c in cams.items()}


def _pixel_rays(c2w, k, width, height):
    """(3,4), (4,) -> origins, directions (H*W, 3) float64, row-major (ARCHITECTURE.md formula)."""
    rows, cols = np.meshgrid(np.arange(height, dtype=np.float64), np.arange(width, dtype=np.float64), indexing="ij")
    x = (cols.ravel() + 0.5 - k[2]) / k[0]
    y = -(rows.ravel() + 0.5 - k[3]) / k[1]
    d_cam = np.stack([x, y, -np.ones_like(x)], axis=1)
    d = d_cam @ c2w[:, :3].T
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return np.broadcast_to(c2w[:, 3], d.shape), d


# ------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------
def _render_images(kind, seed, c2ws, k, width, height):
    """Yields (H, W, 4) uint8 RGBA per camera (RGB of empty pixels = white)."""
    world = _world(kind, int(seed))
    per = max(1, _CHUNK // (width * height))
    for s in range(0, len(c2ws), per):
        group = c2ws[s:s + per]
        rays = [_pixel_rays(c, k, width, height) for c in group]
        o = np.concatenate([r[0] for r in rays])
        d = np.concatenate([r[1] for r in rays])
        rgb, alpha, _, _ = _trace(world, o, d)
        rgb = rgb * alpha[:, None] + (1.0 - alpha[:, None])  # over white
        rgba = np.concatenate([rgb, alpha[:, None]], axis=1)
        img = np.round(np.clip(rgba, 0.0, 1.0) * 255.0).astype(np.uint8).reshape(len(group), height, width, 4)
        yield from img


def _write_image(path: Path, rgba: np.ndarray, image_format: str) -> None:
    import cv2

    if image_format == "png":
        ok = cv2.imwrite(str(path), cv2.cvtColor(rgba, cv2.COLOR_RGBA2BGRA), [cv2.IMWRITE_PNG_COMPRESSION, 3])
    else:  # JPEG has no alpha: the RGB is already composited over white
        ok = cv2.imwrite(str(path), cv2.cvtColor(rgba[..., :3], cv2.COLOR_RGB2BGR),
                         [cv2.IMWRITE_JPEG_QUALITY, 95, cv2.IMWRITE_JPEG_OPTIMIZE, 0, cv2.IMWRITE_JPEG_PROGRESSIVE, 0])
    if not ok:
        raise DaliNerfError(f"{path}: could not write the image; check the disk and folder permissions")


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _mat_list(m):
    return [[float(v) for v in row] for row in m]


def _write_objects(tmp: Path, seed, width, height, cams, image_format):
    ext = ".png" if image_format == "png" else ".jpg"
    k = _intrinsics("objects", width, height)
    for split in ("train", "val", "test"):
        (tmp / split).mkdir()
        frames = []
        c2ws = cams[split]
        for i, img in enumerate(_render_images("objects", seed, c2ws, k, width, height)):
            _write_image(tmp / split / f"r_{i}{ext}", img, image_format)
            c2w4 = np.concatenate([c2ws[i], [[0.0, 0.0, 0.0, 1.0]]])
            frames.append({"file_path": f"./{split}/r_{i}" + ("" if ext == ".png" else ext),
                           "rotation": 0.0, "transform_matrix": _mat_list(c2w4)})
        _write_json(tmp / f"transforms_{split}.json", {
            "camera_angle_x": BLENDER_CAMERA_ANGLE_X, "near": OBJECTS_NEAR, "far": OBJECTS_FAR,
            "aabb": [list(OBJECTS_AABB[0]), list(OBJECTS_AABB[1])], "frames": frames})


def _drb_c2w(c2w_scene):
    """(3,4) OpenGL c2w in the scene frame -> (3,4) c2w in Mega-NeRF's DRB world (metres),
    camera columns per ``_MEGA_NERF_CAMERA_COLUMNS`` ("down,right,back" kept for experiments)."""
    r = DRB_FROM_SCENE @ c2w_scene[:, :3]        # OpenGL axes (right, up, back) in the DRB world
    if _MEGA_NERF_CAMERA_COLUMNS == "down,right,back":
        rot = np.stack([-r[:, 1], r[:, 0], r[:, 2]], axis=1)
    else:
        rot = r
    t = CITY_METRES_PER_UNIT * DRB_FROM_SCENE @ c2w_scene[:, 3] + CITY_DRB_OFFSET
    return np.concatenate([rot, t[:, None]], axis=1)


def _city_bounds(cams):
    eyes = np.concatenate([c[:, :, 3] for c in cams.values() if len(c)])
    lo, hi = np.array(CITY_AABB[0]), np.array(CITY_AABB[1])
    corners = np.array([[x, y, z] for x in (lo[0], hi[0]) for y in (lo[1], hi[1]) for z in (lo[2], hi[2])])
    far = float(np.linalg.norm(eyes[:, None, :] - corners[None], axis=-1).max()) * 1.05
    near = max(0.02, 0.5 * float((eyes[:, 2] - hi[2]).min()))
    return near, far


def _write_city(tmp: Path, seed, width, height, cams, image_format):
    import torch

    ext = ".png" if image_format == "png" else ".jpg"
    k = _intrinsics("city", width, height)
    near, far = _city_bounds(cams)
    drb = {s: np.stack([_drb_c2w(c) for c in cams[s]]) if len(cams[s]) else np.zeros((0, 3, 4)) for s in cams}
    pos = np.concatenate([drb[s][:, :, 3] for s in ("train", "val")])
    origin = 0.5 * (pos.max(0) + pos.min(0))                 # as Mega-NeRF's colmap converter
    scale = float(np.linalg.norm(pos - origin, axis=1).max())
    corners = np.array([[x, y, z] for x in (CITY_AABB[0][0], CITY_AABB[1][0]) for y in (CITY_AABB[0][1], CITY_AABB[1][1])
                        for z in (CITY_AABB[0][2], CITY_AABB[1][2])])
    c_drb = (CITY_METRES_PER_UNIT * corners @ DRB_FROM_SCENE.T + CITY_DRB_OFFSET - origin) / scale
    torch.save({"origin_drb": torch.tensor(origin, dtype=torch.float32), "pose_scale_factor": scale,
                "near": near * CITY_METRES_PER_UNIT / scale, "far": far * CITY_METRES_PER_UNIT / scale,
                "aabb": torch.tensor(np.stack([c_drb.min(0), c_drb.max(0)]), dtype=torch.float32)},
               tmp / "coordinates.pt")
    frames, names = [], {"train": [], "val": [], "test": []}
    gid = 0
    for split in ("train", "val", "test"):
        if len(cams[split]) == 0:
            continue
        (tmp / split / "rgbs").mkdir(parents=True)
        (tmp / split / "metadata").mkdir()
        for i, img in enumerate(_render_images("city", seed, cams[split], k, width, height)):
            name = f"{gid:06d}"
            gid += 1
            _write_image(tmp / split / "rgbs" / f"{name}{ext}", img, image_format)
            c2w = drb[split][i].copy()
            c2w[:, 3] = (c2w[:, 3] - origin) / scale
            torch.save({"W": int(width), "H": int(height),
                        "intrinsics": torch.tensor(k, dtype=torch.float32),
                        "c2w": torch.tensor(c2w, dtype=torch.float32)}, tmp / split / "metadata" / f"{name}.pt")
            rel = f"{split}/rgbs/{name}{ext}"
            names[split].append(rel)
            c2w4 = np.concatenate([cams[split][i], [[0.0, 0.0, 0.0, 1.0]]])
            frames.append({"file_path": rel, "transform_matrix": _mat_list(c2w4)})
    _write_json(tmp / "transforms.json", {
        "camera_model": "PINHOLE", "fl_x": float(k[0]), "fl_y": float(k[1]), "cx": float(k[2]), "cy": float(k[3]),
        "w": int(width), "h": int(height), "near": near, "far": far,
        "aabb": [list(CITY_AABB[0]), list(CITY_AABB[1])], "up": [0.0, 0.0, 1.0], "frames": frames,
        "train_filenames": names["train"], "val_filenames": names["val"],
        "test_filenames": names["test"] if names["test"] else names["val"]})


def make_scene(kind: str, out, *, width: Optional[int] = None, height: Optional[int] = None,
               n_train: Optional[int] = None, n_val: Optional[int] = None, n_test: Optional[int] = None,
               seed: int = 0, image_format: str = "png", force: bool = False) -> Path:
    """Render and write a scene folder (layouts in the module docstring); returns ``out``.

    Args:
        kind: "objects" (Blender format) | "city" (Mega-NeRF layout + nerfstudio transforms.json).
        out: output folder; must not exist or be empty unless ``force``.
        width, height: image size in pixels (defaults: objects 160x160, city 128x96; one given ->
            the other from the default aspect ratio).
        n_train, n_val, n_test: images per split (defaults: objects 60/5/10, city 48/6/0; city
            test = val when 0).
        seed: scene layout, colours and camera jitter; same seed -> identical bytes.
        image_format: "png" (RGBA) | "jpeg" (RGB composited over white: JPEG holds no alpha).
        force: replace an existing non-empty ``out``.
    Written atomically: into a temporary folder beside ``out``, renamed when complete.

    Example:
        >>> make_scene("city", "/tmp/city", width=64, n_train=8, n_val=2)   # doctest: +SKIP
    """
    fmt = str(image_format).lower()
    fmt = {"jpg": "jpeg"}.get(fmt, fmt)
    if fmt not in ("png", "jpeg"):
        raise ConfigError(f"image_format={image_format!r}: use png or jpeg")
    width, height, n_train, n_val, n_test = _resolve(kind, width, height, n_train, n_val, n_test)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2 ** 63:
        raise ConfigError(f"seed={seed!r}: must be an integer in [0, 2**63)")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DaliNerfError(f"{out}: exists and is not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DaliNerfError(f"{out}: folder exists and is not empty; pass --force (force=True) to overwrite it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    except OSError as e:
        raise DaliNerfError(f"{out.parent}: cannot create the output folder ({e.strerror}); choose a writable --out")
    try:
        cams = scene_cameras(kind, width=width, height=height, n_train=n_train, n_val=n_val, n_test=n_test, seed=seed)
        cams = {s: v["c2w"] for s, v in cams.items()}
        (_write_objects if kind == "objects" else _write_city)(tmp, int(seed), width, height, cams, fmt)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(args) -> int:
    """``dali-nerf make-scene KIND --out DIR [--resolution R] [--images N] [--seed S] [--jpeg]
    [--force]``. ``--resolution`` is the image width (objects: square; city: height = 3/4 of
    it); ``--images`` the number of training images."""
    import time

    t0 = time.perf_counter()
    width = args.resolution
    out = make_scene(args.kind, args.out, width=width, n_train=args.images, seed=args.seed,
                     image_format="jpeg" if args.jpeg else "png", force=args.force)
    w, h, ntr, nva, nte = _resolve(args.kind, width, None, args.images, None, None)
    splits = f"{ntr} train, {nva} val" + (f", {nte} test" if nte else "")
    layout = "Blender" if args.kind == "objects" else "Mega-NeRF + nerfstudio transforms.json"
    print(f"wrote {out} ({args.kind}, {layout}, {w}x{h}, {splits}) in {time.perf_counter() - t0:.1f} s")
    return 0
