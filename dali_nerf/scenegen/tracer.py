"""The analytic ray tracer of the generated scenes: exact first-hit intersection with spheres, yawed
boxes, sets of axis-aligned boxes, vertical cylinders and floor planes, smooth procedural
textures, Lambertian shading with one directional light + ambient and hard shadows (one shadow ray
per hit). numpy, float64, vectorised over rays (no per-pixel Python). Colour is view-independent.

Every primitive has ``intersect(o (B, 3), d (B, 3) unit) -> t (B,) (inf = miss), n (B, 3) unit
outward`` (a :class:`BoxSet` also returns the index of the box hit) and ``albedo(p (B, 3), n (B, 3))
-> (B, 3)`` in [0, 1].

>>> world = World((Sphere(np.zeros(3), 1.0, np.eye(3)[:2], (4, 3), "checker"),))
>>> rgb, alpha, depth, prim = trace(world, np.array([[0, 0, 4.0]]), np.array([[0, 0, -1.0]]))
>>> depth
array([3.])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Sphere", "Box", "BoxSet", "Cylinder", "Floor", "World", "trace", "CHUNK"]

_EPS = 1e-9
_LIGHT = np.array([0.45, 0.3, 1.0]) / np.linalg.norm([0.45, 0.3, 1.0])
_AMBIENT = 0.32
CHUNK = 1 << 17  # rays traced per numpy pass


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
class Sphere:
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
class Box:
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
class BoxSet:
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
class Cylinder:
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
class Floor:
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
class World:
    """A scene: primitives (shaded, casting shadows) and an optional ``environment``: a primitive
    seen only where no other primitive is hit, unlit (its albedo is its colour, like a far
    environment map) and casting no shadow (e.g. a large sphere around everything, seen from
    inside)."""

    prims: tuple
    shadows: bool = True
    environment: object = None


def _count(prim) -> int:
    return getattr(prim, "count", 1)


def _first_hit(world: World, o, d):
    """o, d (B,3) -> t (B,) (inf = miss), global primitive id (B,) int64 (-1 = miss), n (B,3),
    primitive index (B,) (-1 = miss), sub-primitive index (B,) (boxes of a BoxSet, else 0)."""
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


def trace(world: World, o, d):
    """o (B,3), d (B,3) unit float64 -> rgb (B,3) surface colour (0 on misses), alpha (B,),
    depth (B,) (inf on misses), global primitive id (B,) (-1 on misses; the environment, when
    hit, has the id after every primitive's)."""
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
    if world.environment is not None and not hit.all():
        miss = np.flatnonzero(~hit)
        te, ne = world.environment.intersect(o[miss], d[miss])[:2]
        ok = np.isfinite(te)
        idx, te, ne = miss[ok], te[ok], ne[ok]
        rgb[idx] = np.clip(world.environment.albedo(o[idx] + te[:, None] * d[idx], ne), 0.0, 1.0)
        t[idx] = te
        gid[idx] = sum(_count(p) for p in world.prims)  # the environment's id: after every primitive
        hit[idx] = True
    return rgb, hit.astype(np.float64), t, gid

