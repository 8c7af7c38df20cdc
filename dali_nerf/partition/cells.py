"""Spatial-segmentation cells (Mega-NeRF style): centroids from a grid or k-means over the camera
positions, the rank assignment, and the partition file.

A scene is cut into ``C`` cells around centroids ``c_j``. With margin ``m >= 1`` a **point** ``p``
is in cell ``j`` iff ``dist(p, c_j) <= m * min_k dist(p, c_k)``. Distances are 3-D
(``dims == 3``) or taken in the plane perpendicular to the scene's ``up`` vector (``dims == 2``,
Mega-NeRF's default ``cluster_2d``: altitude is ignored). Which *rays* belong to a cell is
:mod:`dali_nerf.partition.routing`.

>>> part = Partition.from_config(cfg.partition, scene)
>>> part.centroids.shape
(4, 3)
>>> assign_rank(part.num_cells, 2)
[[0, 2], [1, 3]]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from dali_nerf.errors import ConfigError

__all__ = ["Partition", "assign_rank", "plane_axes"]

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
