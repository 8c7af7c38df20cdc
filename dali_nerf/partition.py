"""Spatial-segmentation cells (Mega-NeRF style): centroids, exact ray membership, blending weights,
Mega-NeRF import/export.

A scene is cut into ``C`` cells around centroids ``c_j``. With margin ``m >= 1``:

* a **point** ``p`` is in cell ``j`` iff ``dist(p, c_j) <= m * min_k dist(p, c_k)``;
* a **ray** (origin ``o``, direction ``d``, segment ``[near, far]``) is in cell ``j`` iff some
  ``t`` in ``[near, far]`` puts ``p(t) = o + t d`` in cell ``j``.

Distances are 3-D (``dims == 3``) or taken in the plane perpendicular to the scene's ``up`` vector
(``dims == 2``, Mega-NeRF's default ``cluster_2d``: altitude is ignored).

Exact routing (what :func:`ray_cells` computes, and what the C++ op implements): for cell ``j`` and
each ``k != j`` let ``u = P(o - c_j)``, ``v = P(o - c_k)``, ``w = P d`` (``P`` removes the ``up``
component when ``dims == 2``, identity otherwise). The condition
``|u + t w|^2 <= m^2 |v + t w|^2`` is ``a t^2 + b t + c <= 0`` with::

    a = (1 - m^2) |w|^2            (<= 0 since m >= 1)
    b = 2 (u.w - m^2 v.w)
    c = |u|^2 - m^2 |v|^2

so the *forbidden* set ``{t : a t^2 + b t + c > 0}`` is always one open interval: ``(r1, r2)``
between the roots when ``a < 0`` and the discriminant is > 0 (empty otherwise); a half-line when
``a == 0`` (``m == 1`` or ``w == 0``) and ``b != 0``; everything or nothing when ``a == b == 0``
(a ray along ``up`` in 2-D: ``p - c`` is constant in the plane). Roots use the cancellation-free
form ``q = -(b + sign(b) sqrt(D)) / 2``, ``{q / a, c / q}``. The ray is in cell ``j`` iff the
``C - 1`` open forbidden intervals do not cover ``[near, far]``: sort them by left end, let
``M_i = max(near, max_{l < i} hi_l)``; some ``i`` with ``lo_i >= M_i`` and ``M_i <= far`` (or
``M_C <= far``) exhibits a feasible ``t = M_i``. The nearest cell of ``p(near)`` and ``p(far)``
is always included (exact, and robust to rounding at ties), so every ray belongs to >= 1 cell.

Mega-NeRF (``scripts/create_cluster_masks.py``) instead samples 1000 points per ray and tests
``min_t dist_j / (min_k dist_k + 1e-8) <= margin``; :func:`ray_cells_dense` is that brute force.

>>> part = Partition.from_config(cfg.partition, scene)
>>> part.centroids.shape
(4, 3)
>>> ray_cells(part, origins, directions, near, far).shape   # (B, C) bool
(4096, 4)
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import ConfigError, SceneError

__all__ = [
    "Partition", "assign_rank", "ray_cells", "ray_cells_dense", "point_weights", "scene_ray_bounds",
    "cell_fraction", "export_megannerf", "import_megannerf", "load_masks", "plane_axes", "clip_to_bounds",
]

_FORMAT = "dali_nerf.partition"
_VERSION = 1


def _ro(a, dtype, shape) -> np.ndarray:
    a = np.array(a, dtype=dtype, copy=True)
    if shape is not None and a.shape != shape:
        raise ValueError(f"expected shape {shape}, got {a.shape}")
    a.setflags(write=False)
    return a


def plane_axes(up) -> np.ndarray:
    """Two orthonormal axes spanning the plane perpendicular to ``up``.

    The world axes other than the one most aligned with ``up`` are taken in increasing index order
    and Gram-Schmidt orthonormalised against ``up``; so for Mega-NeRF's DRB frame
    (``up = (-1, 0, 0)``) the axes are y (right) and z (back), like their grid, and for OpenGL
    y-up scenes they are x and z.

    Args:
        up: (3,) unit vector.
    Returns:
        (2, 3) float64.
    """
    up = np.asarray(up, np.float64)
    up = up / np.linalg.norm(up)
    skip = int(np.argmax(np.abs(up)))
    axes = []
    for i in range(3):
        if i == skip:
            continue
        e = np.eye(3)[i] - up[i] * up
        for a in axes:
            e = e - (e @ a) * a
        axes.append(e / np.linalg.norm(e))
    return np.stack(axes)


@dataclass(frozen=True, eq=False)
class Partition:
    """Spatial-segmentation cells. Arrays are read-only.

    Attributes:
        centroids: (C, 3) float32 cell centres, world frame.
        margin: boundary margin m >= 1 (1.0: Voronoi cells, disjoint up to boundaries).
        dims: 2 (distances in the plane perpendicular to ``up``) or 3.
        up: (3,) float32 unit world up (the scene's).
        kind: "grid" | "kmeans" | "imported" (how the centroids were made).
        axes: (2, 3) float32 orthonormal in-plane axes (see :func:`plane_axes`); grid rows run
            along axes[0], columns along axes[1].
        grid: (gx, gy) for the grid kind (cell index = i * gy + j, i along axes[0]), else None.
        bounds: (2, 3) float32 routing box or None: only the part of a ray's [near, far] inside it
            decides its cells (the role of Mega-NeRF's ``ray_altitude_range``: without it an
            oblique aerial ray starting at the camera crosses every cell in the plane); a ray
            that misses the box keeps its whole segment. ``from_config`` uses the scene's aabb.

    Example:
        >>> part = Partition.from_config(PartitionConfig(grid=[2, 2]), scene)
        >>> part.num_cells, part.dims
        (4, 2)
    """

    centroids: np.ndarray
    margin: float = 1.15
    dims: int = 2
    up: np.ndarray = field(default_factory=lambda: np.array([0.0, 1.0, 0.0], np.float32))
    kind: str = "grid"
    axes: Optional[np.ndarray] = None
    grid: Optional[Tuple[int, int]] = None
    bounds: Optional[np.ndarray] = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        c = np.asarray(self.centroids, np.float32)
        if c.ndim != 2 or c.shape[1] != 3 or c.shape[0] < 1:
            raise ValueError(f"Partition.centroids must have shape (C, 3), got {c.shape}")
        set_("centroids", _ro(c, np.float32, c.shape))
        up = np.asarray(self.up, np.float64)
        set_("up", _ro(up / np.linalg.norm(up), np.float32, (3,)))
        set_("axes", _ro(plane_axes(self.up) if self.axes is None else self.axes, np.float32, (2, 3)))
        set_("margin", float(self.margin))
        set_("dims", int(self.dims))
        if self.grid is not None:
            set_("grid", (int(self.grid[0]), int(self.grid[1])))
        if self.bounds is not None:
            set_("bounds", _ro(self.bounds, np.float32, (2, 3)))
        if not self.margin >= 1.0:
            raise ValueError(f"Partition.margin must be >= 1, got {self.margin}")
        if self.dims not in (2, 3):
            raise ValueError(f"Partition.dims must be 2 or 3, got {self.dims}")

    @property
    def num_cells(self) -> int:
        return int(self.centroids.shape[0])

    def projector(self) -> np.ndarray:
        """(3, 3) float64 P: identity for dims 3, ``I - up up^T`` for dims 2."""
        if self.dims == 3:
            return np.eye(3)
        u = self.up.astype(np.float64)
        return np.eye(3) - np.outer(u, u)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Partition):
            return NotImplemented
        return (self.margin == other.margin and self.dims == other.dims and self.kind == other.kind
                and self.grid == other.grid and np.array_equal(self.centroids, other.centroids)
                and np.array_equal(self.up, other.up) and np.array_equal(self.axes, other.axes)
                and (self.bounds is None) == (other.bounds is None)
                and (self.bounds is None or np.array_equal(self.bounds, other.bounds)))

    __hash__ = None

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg, scene, seed: int = 0, iterations: int = 25) -> "Partition":
        """Cells from a :class:`~dali_nerf.config.PartitionConfig` over the scene's camera positions.

        * ``grid``: a gx x gy grid spanning the extent of the camera positions projected on the
          plane perpendicular to ``up`` (Mega-NeRF's rule: centroids at the centres of the grid's
          cells, ``min + (i + 0.5) * extent / g``). Their altitude (component along ``up``) is the
          mean camera altitude (Mega-NeRF puts it at 0 of its camera-centred frame, i.e. about the
          same; it only matters when ``dims == 3``).
        * ``kmeans``: Lloyd's k-means (k-means++ init, numpy, fixed ``seed``) on the camera
          positions, in the plane (``dims == 2``; altitude then set to the mean) or in 3-D.

        Args:
            cfg: PartitionConfig (kind, grid, cells, margin, dims).
            scene: Scene (c2w (N, 3, 4), up (3,)).
        Raises:
            ConfigError: the grid or cell count cannot be built from these cameras.
        """
        cfg.validate("partition")
        up = np.asarray(scene.up, np.float64)
        up = up / np.linalg.norm(up)
        axes = plane_axes(up)
        pos = np.asarray(scene.c2w, np.float64)[:, :, 3]  # (N, 3)
        plane = pos @ axes.T  # (N, 2)
        alt = float(np.mean(pos @ up))
        if cfg.kind == "grid":
            gx, gy = int(cfg.grid[0]), int(cfg.grid[1])
            lo, hi = plane.min(0), plane.max(0)
            ext = hi - lo
            tol = 1e-6 * max(1.0, float(np.abs(plane).max()))
            for g, e, name in ((gx, ext[0], "first"), (gy, ext[1], "second")):
                if g > 1 and e <= tol:
                    raise ConfigError(
                        f"partition.grid: {g} cells along the {name} horizontal axis but the cameras "
                        f"span no distance along it; use 1 there or partition.kind=kmeans")
            si = lo[0] + (np.arange(gx) + 0.5) * ext[0] / gx
            sj = lo[1] + (np.arange(gy) + 0.5) * ext[1] / gy
            ii, jj = np.meshgrid(si, sj, indexing="ij")
            cents = alt * up + ii.reshape(-1, 1) * axes[0] + jj.reshape(-1, 1) * axes[1]
            return cls(cents, cfg.margin, cfg.dims, up, "grid", axes, (gx, gy), scene.aabb)
        k = int(cfg.cells)
        data = plane if cfg.dims == 2 else pos
        n_distinct = len(np.unique(np.round(data, 9), axis=0))
        if k > n_distinct:
            raise ConfigError(
                f"partition.cells: {k} cells but the scene has only {n_distinct} distinct camera "
                f"positions; use at most {n_distinct}")
        centers = _kmeans(data, k, seed, iterations)
        if cfg.dims == 2:
            cents = alt * up + centers[:, :1] * axes[0] + centers[:, 1:2] * axes[1]
        else:
            cents = centers
        return cls(cents, cfg.margin, cfg.dims, up, "kmeans", axes, None, scene.aabb)

    # ---- persistence -----------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain-number dict (JSON-able)."""
        return {
            "format": _FORMAT, "version": _VERSION, "kind": self.kind, "margin": self.margin,
            "dims": self.dims, "up": self.up.tolist(), "axes": self.axes.tolist(),
            "grid": list(self.grid) if self.grid is not None else None,
            "centroids": self.centroids.tolist(),
            "bounds": self.bounds.tolist() if self.bounds is not None else None,
        }

    @classmethod
    def from_dict(cls, d: dict, where: str = "partition") -> "Partition":
        try:
            if d.get("format") != _FORMAT:
                raise ValueError(f"not a {_FORMAT} file")
            return cls(np.asarray(d["centroids"], np.float32), float(d["margin"]), int(d["dims"]),
                       np.asarray(d["up"], np.float32), str(d["kind"]),
                       np.asarray(d["axes"], np.float32), None if d.get("grid") is None else tuple(d["grid"]),
                       None if d.get("bounds") is None else np.asarray(d["bounds"], np.float32))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: not a valid partition file ({e}); write it with Partition.save") from None

    def save(self, path) -> None:
        """Write JSON (plain numbers; float32 values round-trip exactly), atomically."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path) -> "Partition":
        """Read a file written by :meth:`save`. Raises ConfigError naming the file."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: partition file not found; write one with Partition.save")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(f"{path}: not valid JSON; write the partition with Partition.save") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: not a valid partition file; write it with Partition.save")
        return cls.from_dict(d, str(path))

    def cells_for_rank(self, rank: int, world_size: int) -> List[int]:
        """The cells rank ``rank`` trains (see :func:`assign_rank`)."""
        return assign_rank(self.num_cells, world_size)[rank]


def _kmeans(x: np.ndarray, k: int, seed: int, iterations: int) -> np.ndarray:
    """Lloyd's k-means with k-means++ init. x (N, D) float64 -> (k, D) centres (deterministic)."""
    rng = np.random.default_rng(seed)
    n = len(x)
    centers = [x[rng.integers(n)]]
    d2 = np.sum((x - centers[0]) ** 2, 1)
    for _ in range(1, k):
        if d2.sum() <= 0:
            break
        centers.append(x[rng.choice(n, p=d2 / d2.sum())])
        d2 = np.minimum(d2, np.sum((x - centers[-1]) ** 2, 1))
    c = np.stack(centers)
    for _ in range(iterations):
        dist = np.sum((x[:, None, :] - c[None]) ** 2, -1)  # (N, k)
        lab = np.argmin(dist, 1)
        new = c.copy()
        for j in range(k):
            sel = lab == j
            if sel.any():
                new[j] = x[sel].mean(0)
            else:  # empty cluster: take the point farthest from its centre
                far = int(np.argmax(dist[np.arange(n), lab]))
                new[j] = x[far]
                lab[far] = j
        if np.allclose(new, c):
            c = new
            break
        c = new
    return c


def assign_rank(num_cells: int, world_size: int) -> List[List[int]]:
    """Cells per rank, round-robin: rank r trains cells r, r + W, r + 2W, ...

    Args:
        num_cells: C >= 1; world_size: W >= 1.
    Returns:
        list of W lists of cell indices.
    Raises:
        ConfigError: more ranks than cells (a rank would have nothing to train).

    Example:
        >>> assign_rank(5, 2)
        [[0, 2, 4], [1, 3]]
    """
    if world_size < 1:
        raise ConfigError(f"world size: must be >= 1, got {world_size}")
    if world_size > num_cells:
        raise ConfigError(
            f"partition.grid: {num_cells} cells for world size {world_size}; use at least as many "
            f"cells as ranks (raise partition.grid / partition.cells) or run fewer ranks")
    return [list(range(r, num_cells, world_size)) for r in range(world_size)]


# ---------------------------------------------------------------------------------------------
# membership


def _as2d(a, name) -> np.ndarray:
    a = np.asarray(a, np.float64)
    if a.ndim != 2 or a.shape[1] != 3:
        raise ValueError(f"{name} must have shape (B, 3), got {a.shape}")
    return a


def _as1d(a, n, name) -> np.ndarray:
    a = np.asarray(a, np.float64).reshape(-1)
    if a.size == 1 and n != 1:
        a = np.full(n, float(a[0]))
    if a.shape != (n,):
        raise ValueError(f"{name} must have shape (B,) or (B, 1), got {a.shape}")
    return a


def _nearest(proj_pts: np.ndarray, proj_c: np.ndarray) -> np.ndarray:
    """(B, 3) projected points, (C, 3) projected centroids -> (B,) index of the nearest."""
    d2 = np.sum((proj_pts[:, None, :] - proj_c[None]) ** 2, -1)
    return np.argmin(d2, 1)


def _ray_cells_chunk(o, d, near, far, cp, m2, P):
    """Exact membership for one chunk. o, d (B, 3) f64; near, far (B,); cp (C, 3) f64 centroids."""
    B, C = o.shape[0], cp.shape[0]
    w = d @ P  # (B, 3) (P symmetric)
    r = (o[:, None, :] - cp[None]) @ P  # (B, C, 3): P(o - c)
    rr = np.sum(r * r, -1)  # (B, C)
    rw = np.einsum("bci,bi->bc", r, w)  # (B, C)
    ww = np.sum(w * w, -1)  # (B,)
    # pairwise (j, k): a, b, c of  |u + t w|^2 - m^2 |v + t w|^2 <= 0, u = r[:, j], v = r[:, k]
    a = np.broadcast_to(((1.0 - m2) * ww)[:, None, None], (B, C, C))
    b = 2.0 * (rw[:, :, None] - m2 * rw[:, None, :])
    c = rr[:, :, None] - m2 * rr[:, None, :]
    lo = np.full((B, C, C), np.inf)
    hi = np.full((B, C, C), -np.inf)
    quad = a < 0
    disc = b * b - 4.0 * a * c
    qm = quad & (disc > 0)
    if qm.any():
        bq, dq, aq, cq = b[qm], disc[qm], a[qm], c[qm]
        q = -0.5 * (bq + np.where(bq >= 0, 1.0, -1.0) * np.sqrt(dq))
        with np.errstate(divide="ignore", invalid="ignore"):
            r1, r2 = q / aq, cq / q
        lo[qm] = np.minimum(r1, r2)
        hi[qm] = np.maximum(r1, r2)
    lin = ~quad & (b != 0)
    if lin.any():
        t0 = -c[lin] / b[lin]
        pos = b[lin] > 0  # b t + c > 0  <=>  t > t0
        lo[lin] = np.where(pos, t0, -np.inf)
        hi[lin] = np.where(pos, np.inf, t0)
    const = ~quad & (b == 0) & (c > 0)
    lo[const], hi[const] = -np.inf, np.inf
    idx = np.arange(C)
    lo[:, idx, idx], hi[:, idx, idx] = np.inf, -np.inf  # k == j imposes nothing
    # do the open intervals (lo, hi) over k cover [near, far]?
    order = np.argsort(lo, axis=-1)
    lo_s = np.take_along_axis(lo, order, -1)
    hi_s = np.take_along_axis(hi, order, -1)
    nb = near[:, None, None]
    reach = np.maximum.accumulate(np.concatenate([np.broadcast_to(nb, (B, C, 1)), hi_s], -1), -1)
    start = np.maximum(reach, nb)  # (B, C, C+1): M_i, the first point not yet known covered
    end = np.concatenate([lo_s, np.broadcast_to(np.inf, (B, C, 1))], -1)  # next forbidden start
    end = np.minimum(end, far[:, None, None])
    with np.errstate(invalid="ignore"):
        width = np.where((end >= start) & np.isfinite(start), end - start, -1.0)  # [start, end] feasible
    best = np.argmax(width, -1)[..., None]  # widest gap (robust witness)
    bw = np.take_along_axis(width, best, -1)[..., 0]
    inside = bw >= 0
    bs = np.take_along_axis(start, best, -1)[..., 0]
    half = np.where(np.isfinite(bw), 0.5 * np.maximum(bw, 0), 1.0 + np.abs(bs))  # far = inf: any t >= start
    t = np.where(inside, bs + half, np.nan)
    # exact anchors: the nearest cell of each (finite) end point satisfies its own condition
    for tt in (far, near):
        ok = np.isfinite(tt)
        if not ok.any():
            continue
        rows = np.nonzero(ok)[0]
        j = _nearest(((o[rows] + tt[rows, None] * d[rows]) @ P), cp @ P)
        t[rows, j] = np.where(inside[rows, j], t[rows, j], tt[rows])
        inside[rows, j] = True
    return inside, t


def clip_to_bounds(bounds, o, d, near, far):
    """Clip segments [near, far] of rays o + t d (B, 3) to the box ``bounds`` (2, 3) (slab
    test); rays that miss the box keep their segment. Returns (near, far) (B,) float64."""
    o = np.asarray(o, np.float64); d = np.asarray(d, np.float64)
    lo_b, hi_b = np.asarray(bounds, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t0, t1 = (lo_b - o) / d, (hi_b - o) / d
    tmin, tmax = np.minimum(t0, t1), np.maximum(t0, t1)
    par = d == 0  # parallel to a slab: inside it or missing the box
    outside = par & ((o < lo_b) | (o > hi_b))
    tmin = np.where(par, -np.inf, tmin); tmax = np.where(par, np.inf, tmax)
    a = np.maximum(np.asarray(near, np.float64), tmin.max(1))
    b = np.minimum(np.asarray(far, np.float64), tmax.min(1))
    hit = (a <= b) & ~outside.any(1)
    return np.where(hit, a, near), np.where(hit, b, far)


def ray_cells(partition: Partition, origins, directions, near, far, chunk: int = 0,
              return_t: bool = False):
    """Exact cell membership of rays (closed form, see the module docstring).

    Args:
        partition: the cells (C of them).
        origins: (B, 3) world; directions: (B, 3) (any length; t is in its units).
        near, far: (B,) or (B, 1) segment bounds, near <= far.
        chunk: rays per vectorised chunk (0 = about 2^19 / C^2).
        return_t: also return a witness.
    Returns:
        (B, C) bool: ray b is in cell j; with ``return_t``, also (B, C) float64 witness: a t in
        [near, far] where the point condition holds (the middle of the widest feasible stretch),
        NaN where the ray is not in the cell.

    Example:
        >>> ray_cells(part, o, d, np.full(len(o), 0.1), np.full(len(o), 6.0)).sum(1).min() >= 1
        True
    """
    o = _as2d(origins, "origins")
    d = _as2d(directions, "directions")
    n = o.shape[0]
    nr, fr = _as1d(near, n, "near"), _as1d(far, n, "far")
    if partition.bounds is not None:
        nr, fr = clip_to_bounds(partition.bounds, o, d, nr, fr)
    cp = partition.centroids.astype(np.float64)
    C = cp.shape[0]
    P = partition.projector()
    m2 = partition.margin ** 2
    chunk = chunk or max(256, (1 << 19) // max(1, C * C))
    out = np.empty((n, C), bool)
    wit = np.empty((n, C)) if return_t else None
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        ins, t = _ray_cells_chunk(o[s:e], d[s:e], nr[s:e], fr[s:e], cp, m2, P)
        out[s:e] = ins
        if return_t:
            wit[s:e] = t
    return (out, wit) if return_t else out


def ray_cells_dense(partition: Partition, origins, directions, near, far, samples: int = 1000,
                    chunk: int = 0, return_ratio: bool = False):
    """Brute-force membership by point sampling (Mega-NeRF's ``create_cluster_masks.py`` way).

    ``samples`` points evenly spaced on ``[near, far]`` (both ends included); ray b is in cell j
    iff some sample has ``dist_j <= margin * min_k dist_k``.

    Args:
        partition: the cells; origins, directions (B, 3); near, far (B,) or (B, 1).
        samples: points per ray.
        return_ratio: also return (B, C) float64 ``min_t dist_j / min_k dist_k``.
    Returns:
        (B, C) bool (and the ratio when asked).
    """
    import torch

    o = torch.as_tensor(_as2d(origins, "origins"))
    d = torch.as_tensor(_as2d(directions, "directions"))
    n = o.shape[0]
    nr, fr = _as1d(near, n, "near"), _as1d(far, n, "far")
    if partition.bounds is not None:
        nr, fr = clip_to_bounds(partition.bounds, np.asarray(origins), np.asarray(directions), nr, fr)
    nr = torch.as_tensor(nr)
    fr = torch.as_tensor(fr)
    P = torch.as_tensor(partition.projector())
    cp = torch.as_tensor(partition.centroids.astype(np.float64)) @ P
    C = cp.shape[0]
    s = torch.linspace(0.0, 1.0, samples, dtype=torch.float64)
    chunk = chunk or max(1, (1 << 21) // samples)
    ratio = torch.empty((n, C), dtype=torch.float64)
    po, pd = o @ P, d @ P  # P (o + t d) = P o + t P d
    for a in range(0, n, chunk):
        e = min(n, a + chunk)
        t = nr[a:e, None] * (1 - s) + fr[a:e, None] * s  # (b, S)
        p = po[a:e, None, :] + t[..., None] * pd[a:e, None, :]  # (b, S, 3) projected samples
        dist = torch.cdist(p.reshape(-1, 3), cp, compute_mode="donot_use_mm_for_euclid_dist")
        dist = dist.reshape(e - a, samples, C)
        dmin = dist.min(-1, keepdim=True).values
        rat = dist / dmin
        if bool((dmin == 0).any()):  # a sample on a centroid: ratio 1 there, inf elsewhere
            rat = torch.where(dmin > 0, rat, torch.where(dist > 0, torch.inf, 1.0).to(dist.dtype))
        ratio[a:e] = rat.min(1).values
    ratio = ratio.numpy()
    inside = ratio <= partition.margin
    return (inside, ratio) if return_ratio else inside


def point_weights(partition: Partition, x):
    """Inverse-distance blending weights of points (Mega-NeRF's fused-inference rule).

    Cells with ``dist(x, c_j) <= margin * min_k dist(x, c_k)`` get weight ``1 / dist``, normalised
    to sum 1; the nearest cell is always included. A point at a centroid (dist 0) gets weight 1
    there (shared equally among coincident centroids). Distances as ``partition.dims``.

    Args:
        partition: the cells (C).
        x: (P, 3) numpy array or torch tensor.
    Returns:
        (P, C) weights, same library (and for torch, dtype/device) as ``x``; rows sum to 1.

    Example:
        >>> point_weights(part, torch.zeros(1, 3)).sum(1)
        tensor([1.])
    """
    import torch

    is_np = not isinstance(x, torch.Tensor)
    xt = torch.as_tensor(np.asarray(x, np.float64)) if is_np else x
    c = torch.as_tensor(np.array(partition.centroids), dtype=xt.dtype, device=xt.device)
    P = torch.as_tensor(partition.projector(), dtype=xt.dtype, device=xt.device)
    w = _point_weights_t(xt, c, P, partition.margin)
    return w.numpy() if is_np else w


def _point_weights_t(x, centroids, P, margin: float):
    """torch core of :func:`point_weights`: x (P, 3), centroids (C, 3), P (3, 3) -> (P, C)."""
    import torch

    diff = (x[:, None, :] - centroids[None]) @ P  # (P, C, 3)
    dist = torch.linalg.norm(diff, dim=-1)  # (P, C)
    dmin = dist.min(dim=1, keepdim=True).values
    keep = dist <= margin * dmin
    tiny = torch.finfo(dist.dtype).tiny
    zero = dmin <= 0
    inv = torch.where(keep, 1.0 / dist.clamp_min(tiny), torch.zeros_like(dist))
    # at a centroid: weight only on the coincident centroid(s)
    inv = torch.where(zero, (dist <= 0).to(dist.dtype), inv)
    return inv / inv.sum(dim=1, keepdim=True)


# ---------------------------------------------------------------------------------------------
# scenes


def scene_ray_bounds(scene, cams, origins, directions) -> Tuple[np.ndarray, np.ndarray]:
    """near, far (B,) for rays of cameras ``cams`` (B,): the scene's per-image bounds, else the
    ray's segment inside ``scene.aabb`` (rays that miss it get near = far = 0).

    Raises:
        SceneError: the scene has neither bounds nor an aabb.
    """
    cams = np.asarray(cams, np.int64)
    if scene.has_bounds:
        return scene.near[cams].astype(np.float64), scene.far[cams].astype(np.float64)
    if scene.aabb is None:
        raise SceneError(f"{scene.root}: the scene has no near/far bounds and no aabb; spatial "
                         f"partitions need ray bounds (add them to the scene or use method ddp)")
    o = np.asarray(origins, np.float64)
    d = np.asarray(directions, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = 1.0 / d
        t1 = (scene.aabb[0].astype(np.float64) - o) * inv
        t2 = (scene.aabb[1].astype(np.float64) - o) * inv
    t1, t2 = np.nan_to_num(t1, nan=-np.inf), np.nan_to_num(t2, nan=np.inf)
    tn = np.max(np.minimum(t1, t2), 1).clip(min=0.0)
    tf = np.min(np.maximum(t1, t2), 1)
    miss = ~(tf > tn)
    tn[miss], tf[miss] = 0.0, 0.0
    return tn, tf


def _scene_rays(scene, cams, rows, cols):
    """origins, directions (B, 3) float64 of pixels (the project's one ray formula)."""
    import torch

    from .rays import rays_from_indices

    idx = torch.as_tensor(np.stack([cams, rows, cols], -1).astype(np.int64))
    o, d = rays_from_indices(torch.as_tensor(np.array(scene.c2w)), torch.as_tensor(np.array(scene.intrinsics)), idx)
    return o.numpy().astype(np.float64), d.numpy().astype(np.float64)


def cell_fraction(partition: Partition, scene, samples: int = 100_000, seed: int = 0) -> np.ndarray:
    """Fraction of the scene's rays in each cell, from ``samples`` uniformly drawn pixels.

    Rays in a margin band count for every cell they touch, so the fractions sum to >= 1 (the
    excess is the SS method's duplicated work).

    Returns:
        (C,) float64.
    Example:
        >>> cell_fraction(part, scene, 20000)
        array([0.29, 0.27, 0.28, 0.3 ])
    """
    rng = np.random.default_rng(seed)
    sizes = (scene.width * scene.height).astype(np.int64)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    pix = rng.integers(0, int(offs[-1]), size=int(samples))
    cams = np.searchsorted(offs, pix, side="right") - 1
    local = pix - offs[cams]
    rows, cols = local // scene.width[cams], local % scene.width[cams]
    o, d = _scene_rays(scene, cams, rows, cols)
    near, far = scene_ray_bounds(scene, cams, o, d)
    return ray_cells(partition, o, d, near, far).mean(0)


# ---------------------------------------------------------------------------------------------
# Mega-NeRF interop


def _params_frame(partition: Partition) -> np.ndarray:
    """(3, 3) rotation R: x_params = R @ x_world, with R @ up = (-1, 0, 0) (Mega-NeRF's DRB:
    x = down) and the in-plane axes on y, z; the identity for Mega-NeRF scenes (up = -x)."""
    R = np.stack([-partition.up.astype(np.float64), partition.axes[0].astype(np.float64),
                  partition.axes[1].astype(np.float64)])
    if np.linalg.det(R) < 0:
        R[2] = -R[2]
    return R


def _stems(scene) -> List[str]:
    stems = [Path(p).stem for p in scene.image_paths]
    if len(set(stems)) != len(stems):
        dup = next(s for s in stems if stems.count(s) > 1)
        raise SceneError(f"{scene.root}: two images share the name {dup!r}; Mega-NeRF masks are "
                         f"keyed by image name, rename one")
    return stems


def export_megannerf(partition: Partition, scene, out_dir, chunk: int = 1 << 16) -> Path:
    """Write Mega-NeRF cluster masks for every pixel of every image of ``scene``.

    Layout, as Mega-NeRF's ``scripts/create_cluster_masks.py`` writes it:

    * ``<out>/params.pt``: ``torch.save`` of a dict with their keys ``origin_drb``,
      ``pose_scale_factor`` (from the dataset's ``coordinates.pt`` when there is one, else 0 / 1),
      ``ray_altitude_range`` (None: we clip no altitude), ``near``, ``far`` (scene-wide
      min / max), ``centroids`` (C, 3) float32 tensor, ``grid_dim``, ``min_position``,
      ``max_position`` (camera extent), ``cluster_2d`` (dims == 2); plus ``boundary_margin`` and
      ``dali_nerf_world_from_params`` (3, 3) (the rotation back to our world; identity for
      Mega-NeRF scenes), which Mega-NeRF ignores. Vectors are in Mega-NeRF's frame (x = down =
      -up), so ``cluster_2d`` (which ignores x) matches ``dims == 2``.
    * ``<out>/<cell>/<image stem>.pt``: a deflated zip holding one entry ``<image stem>.pt``, a
      ``torch.save`` of an (H, W) bool tensor: pixel (row, col) is in the cell. Computed exactly
      with :func:`ray_cells` (Mega-NeRF samples 1000 points per ray).

    Args:
        partition: the cells; scene: the split whose images get masks; out_dir: folder (created).
    Returns:
        out_dir as a Path.
    """
    import torch

    out = Path(out_dir)
    stems = _stems(scene)
    out.mkdir(parents=True, exist_ok=True)
    R = _params_frame(partition)
    pos = np.asarray(scene.c2w, np.float64)[:, :, 3] @ R.T
    origin_drb, scale = torch.zeros(3), 1.0
    coord = Path(scene.root) / "coordinates.pt"
    if scene.format == "mega_nerf" and coord.is_file():
        info = torch.load(coord, map_location="cpu", weights_only=True)
        origin_drb, scale = info["origin_drb"], float(info["pose_scale_factor"])
    C = partition.num_cells
    params = {
        "origin_drb": origin_drb,
        "pose_scale_factor": scale,
        "ray_altitude_range": None,
        "near": float(scene.near.min()) if scene.has_bounds else 0.0,
        "far": float(scene.far.max()) if scene.has_bounds else 2.0,
        "centroids": torch.as_tensor((partition.centroids.astype(np.float64) @ R.T).astype(np.float32)),
        "grid_dim": tuple(partition.grid) if partition.grid is not None else (C, 1),
        "min_position": torch.as_tensor(pos.min(0).astype(np.float32)),
        "max_position": torch.as_tensor(pos.max(0).astype(np.float32)),
        "cluster_2d": partition.dims == 2,
        "boundary_margin": partition.margin,
        "dali_nerf_world_from_params": torch.as_tensor(R.T.copy()),
        "dali_nerf_kind": partition.kind,
    }
    torch.save(params, out / "params.pt")
    for j in range(C):
        (out / str(j)).mkdir(exist_ok=True)
    for i, stem in enumerate(stems):
        W, H = int(scene.width[i]), int(scene.height[i])
        masks = np.empty((H * W, C), bool)
        for s in range(0, H * W, chunk):
            pix = np.arange(s, min(H * W, s + chunk))
            cams = np.full(len(pix), i)
            o, d = _scene_rays(scene, cams, pix // W, pix % W)
            near, far = scene_ray_bounds(scene, cams, o, d)
            masks[s:s + len(pix)] = ray_cells(partition, o, d, near, far)
        masks = masks.reshape(H, W, C)
        for j in range(C):
            buf = io.BytesIO()
            torch.save(torch.from_numpy(np.ascontiguousarray(masks[:, :, j])), buf)
            with zipfile.ZipFile(out / str(j) / f"{stem}.pt", "w", compression=zipfile.ZIP_DEFLATED) as zf:
                zf.writestr(f"{stem}.pt", buf.getvalue())
    return out


def import_megannerf(path, margin: Optional[float] = None, up=None) -> Partition:
    """A Partition from Mega-NeRF's ``params.pt`` (or the folder holding it).

    Their file stores no margin (it is the ``--boundary_margin`` hyper-parameter, default 1.15):
    ``margin`` overrides, else ``boundary_margin`` when present (files we wrote), else 1.15.
    Centroids come back to our world through ``dali_nerf_world_from_params`` when present, else
    they are taken as Mega-NeRF's DRB world frame (up = (-1, 0, 0), what our Mega-NeRF parser
    keeps); ``up`` overrides that frame's up.

    Raises:
        SceneError: the file is missing or is not a Mega-NeRF params file.
    """
    import torch

    p = Path(path)
    if p.is_dir():
        p = p / "params.pt"
    if not p.is_file():
        raise SceneError(f"{p}: Mega-NeRF params.pt not found; pass the folder written by create_cluster_masks.py")
    try:
        d = torch.load(p, map_location="cpu", weights_only=True)
        cents = np.asarray(torch.as_tensor(d["centroids"]).double().numpy())
        two_d = bool(d.get("cluster_2d", True))
    except Exception as e:  # noqa: BLE001  (any unpickling problem is the user's file)
        raise SceneError(f"{p}: not a Mega-NeRF params.pt ({type(e).__name__}); regenerate it with create_cluster_masks.py") from None
    M = d.get("dali_nerf_world_from_params")
    M = np.eye(3) if M is None else np.asarray(torch.as_tensor(M).double().numpy())
    world_up = M @ np.array([-1.0, 0.0, 0.0]) if up is None else np.asarray(up, np.float64)
    world_up = world_up / np.linalg.norm(world_up)
    m = margin if margin is not None else float(d.get("boundary_margin", 1.15))
    kind = str(d.get("dali_nerf_kind", "imported"))
    grid = d.get("grid_dim")
    grid = tuple(int(g) for g in grid) if grid is not None and len(grid) == 2 and kind == "grid" else None
    c = (cents @ M.T).astype(np.float32)
    # recover the exact float32 centroids we exported (the rotation is a signed permutation for
    # axis-aligned up, so this is exact there; otherwise to float32 rounding)
    return Partition(c, m, 2 if two_d else 3, world_up.astype(np.float32), kind, None, grid)


def load_masks(out_dir, stems: Optional[Sequence[str]] = None) -> Dict[str, np.ndarray]:
    """Read Mega-NeRF cluster masks.

    Args:
        out_dir: folder with ``params.pt`` and ``<cell>/<stem>.pt``.
        stems: image stems to read (default: every stem in cell 0).
    Returns:
        {stem: (C, H, W) bool}.
    Raises:
        SceneError: a mask is missing or unreadable.
    """
    import torch

    out = Path(out_dir)
    cells = sorted((int(q.name) for q in out.iterdir() if q.is_dir() and q.name.isdigit()), key=int) if out.is_dir() else []
    if not cells:
        raise SceneError(f"{out}: no cluster-mask folders (0/, 1/, ...); export them with export_megannerf")
    if stems is None:
        stems = sorted(q.stem for q in (out / "0").glob("*.pt"))
    result = {}
    for stem in stems:
        ms = []
        for j in cells:
            f = out / str(j) / f"{stem}.pt"
            try:
                with zipfile.ZipFile(f) as zf, zf.open(f"{stem}.pt") as fh:
                    ms.append(torch.load(io.BytesIO(fh.read()), map_location="cpu", weights_only=True).numpy().astype(bool))
            except (OSError, KeyError, zipfile.BadZipFile, RuntimeError) as e:
                raise SceneError(f"{f}: unreadable cluster mask ({type(e).__name__}); re-export the masks") from None
        result[stem] = np.stack(ms)
    return result
