"""Mega-NeRF interop: export our cells as Mega-NeRF cluster masks (``params.pt`` + per-cell
masks, the layout of their ``scripts/create_cluster_masks.py``), import their ``params.pt``, read
masks back.

>>> export_mega_nerf(part, scene, "masks/")            # doctest: +SKIP
>>> import_mega_nerf("masks/").num_cells               # doctest: +SKIP
4
"""

from __future__ import annotations

import io
import warnings
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from dali_nerf.errors import SceneError
from dali_nerf.partition.cells import Partition
from dali_nerf.partition.routing import ray_cells, scene_ray_bounds, scene_rays

__all__ = ["export_mega_nerf", "import_mega_nerf", "load_masks", "export_megannerf", "import_megannerf"]


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


def export_mega_nerf(partition: Partition, scene, out_dir, chunk: int = 1 << 16) -> Path:
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
            o, d = scene_rays(scene, cams, pix // W, pix % W)
            near, far = scene_ray_bounds(scene, cams, o, d)
            masks[s:s + len(pix)] = ray_cells(partition, o, d, near, far)
        masks = masks.reshape(H, W, C)
        for j in range(C):
            buf = io.BytesIO()
            torch.save(torch.from_numpy(np.ascontiguousarray(masks[:, :, j])), buf)
            with zipfile.ZipFile(out / str(j) / f"{stem}.pt", "w", compression=zipfile.ZIP_DEFLATED) as zf:
                zf.writestr(f"{stem}.pt", buf.getvalue())
    return out


def import_mega_nerf(path, margin: Optional[float] = None, up=None) -> Partition:
    """A Partition from Mega-NeRF's ``params.pt`` (or the folder holding it).

    Their file stores no margin (it is the ``--boundary_margin`` hyper-parameter, default 1.15):
    ``margin`` overrides, else ``boundary_margin`` when present (files we wrote), else 1.15.
    Centroids come back to our world through ``dali_nerf_world_from_params`` when present, else
    they are taken as Mega-NeRF's DRB world frame (up = (-1, 0, 0), what our Mega-NeRF parser
    keeps); ``up`` overrides that frame's up.

    Raises:
        SceneError: the file is missing or is not a Mega-NeRF params file.
    """
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
    out = Path(out_dir)
    cells = sorted((int(q.name) for q in out.iterdir() if q.is_dir() and q.name.isdigit()), key=int) if out.is_dir() else []
    if not cells:
        raise SceneError(f"{out}: no cluster-mask folders (0/, 1/, ...); export them with export_mega_nerf")
    if stems is None:
        stems = sorted(q.stem for q in (out / "0").glob("*.pt") if not q.name.startswith("."))  # not ._000001.pt
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


def export_megannerf(*args, **kwargs) -> Path:
    """Deprecated misspelling of :func:`export_mega_nerf` (same arguments); warns
    ``DeprecationWarning``."""
    warnings.warn("export_megannerf is deprecated; use export_mega_nerf", DeprecationWarning, stacklevel=2)
    return export_mega_nerf(*args, **kwargs)


def import_megannerf(*args, **kwargs) -> Partition:
    """Deprecated misspelling of :func:`import_mega_nerf` (same arguments); warns
    ``DeprecationWarning``."""
    warnings.warn("import_megannerf is deprecated; use import_mega_nerf", DeprecationWarning, stacklevel=2)
    return import_mega_nerf(*args, **kwargs)
