"""Where the field lives: world space, NDC (forward-facing captures) or a contracted space
(unbounded captures), and the mapping of the loader's world rays into it.

The loader's batch contract stays world-space (``origins``, ``directions`` (B, 3) unit, ``near``,
``far`` (B, 1)); the trainer and the evaluation call :meth:`RaySpace.render_args` right before
``render_rays`` and pass what it returns:

* ``world``: the rays as they are; the field and occupancy box is the scene box
  (:func:`dali_nerf.scenes.bounds.scene_bounds`). No extra argument reaches ``render_rays``, so the
  default path's arithmetic is the one it always was.
* ``ndc``: rays in the reference camera's frame (``ref_c2w`` (3, 4): identity for LLFF, whose
  parser's world already is the recentred average pose; else the average pose) mapped by
  :func:`~dali_nerf.models.space.ndc_rays` with near plane ``ndc_near`` (1 for LLFF after its
  bound scaling): origins (B, 3) on the NDC plane z = -1, directions (B, 3) not unit, t in [0, 1]
  (t = 1 is infinitely far), sampled linearly in t (= linearly in disparity in the world). The
  field sees the world unit directions as view directions. Field and occupancy box: the NDC image
  of every training camera's frustum (x, y from the four image corners, at least [-1, 1]; z in
  [-1, 1]).
* ``contract``: positions warped by ``contract(normalize_to_box(x, inner), ord=inf)`` (inner =
  the scene box scaled by ``model.contract_inner`` about its centre becomes [-1, 1]^3, the rest of
  space is squeezed into [-2, 2]^3, nerfacto's L-inf contraction); the field and occupancy box is
  [-2, 2]^3; samples linear up to ``split`` (the inner box's half side) then linear in disparity
  up to a finite ``far`` (``CONTRACT_FAR_FACTOR`` x split, or the batch's far when smaller).

:func:`resolve_space` gives the ``auto`` rule: a scene with its own ``aabb`` (Blender, our
generated objects/city scenes) -> world; an LLFF scene -> ndc; anything else (nerfstudio / COLMAP
captures without a box, outward-looking or not) -> contract. The resolved space is saved in every
checkpoint (``RaySpace.state()``) so ``dali-nerf render`` rebuilds the same one.

>>> space = build_space("auto", scene)          # scene: the training split
>>> kw = space.render_args(origins, directions, near, far)
>>> out = render_rays(field, kw.pop("origins"), kw.pop("directions"), kw.pop("near"), kw.pop("far"), bg, **kw)
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from dali_nerf.scenes.bounds import scene_bounds
from dali_nerf.models.space import contract, ndc_rays, normalize_to_box, to_camera_frame

__all__ = ["RaySpace", "SPACES", "resolve_space", "build_space", "CONTRACT_FAR_FACTOR", "NDC_MARGIN"]

SPACES = ("auto", "world", "ndc", "contract")
CONTRACT_FAR_FACTOR = 1000.0  # contract: far bound = this x the inner box's half side
NDC_MARGIN = 0.02  # ndc: the x, y box is widened by this fraction of its half size


def resolve_space(space: str, scene) -> str:
    """``model.space`` -> "world" | "ndc" | "contract" (``auto``: the rule of the module docstring)."""
    if space != "auto":
        return space
    if scene.aabb is not None:
        return "world"
    if scene.format == "llff":
        return "ndc"
    return "contract"


def _average_pose(c2w: np.ndarray) -> np.ndarray:
    """(N, 3, 4) -> (3, 4): mean position, summed back axis and up axis orthonormalised (LLFF's)."""
    c2w = np.asarray(c2w, np.float64)
    z = c2w[:, :, 2].sum(0)
    z /= np.linalg.norm(z)
    y = c2w[:, :, 1].sum(0)
    x = np.cross(y, z)
    x /= np.linalg.norm(x)
    y = np.cross(z, x)
    return np.stack([x, y, z, c2w[:, :, 3].mean(0)], 1)


class RaySpace:
    """One scene's field space (see the module docstring).

    Attributes:
        kind: "world" | "ndc" | "contract".
        aabb: (2, 3) float32 box of the field and occupancy grid, in the field's coordinates.
        ref_c2w: (3, 4) float32 reference camera (ndc); ndc: (fx, fy, width, height, near).
        inner: (2, 3) float32 inner box (contract); split, far: floats (contract).
    """

    def __init__(self, kind: str, aabb, *, ref_c2w=None, ndc=None, inner=None, split: float = 1.0,
                 far: float = math.inf):
        if kind not in SPACES[1:]:
            raise ValueError(f"RaySpace kind={kind!r}: use world, ndc or contract")
        self.kind = kind
        self.aabb = torch.as_tensor(np.asarray(aabb, np.float32)).reshape(2, 3)
        self.ref_c2w = None if ref_c2w is None else torch.as_tensor(np.asarray(ref_c2w, np.float32)).reshape(3, 4)
        self.ndc = None if ndc is None else tuple(float(v) for v in ndc)
        self.inner = None if inner is None else torch.as_tensor(np.asarray(inner, np.float32)).reshape(2, 3)
        self.split = float(split)
        self.far = float(far)

    def state(self) -> dict:
        """Plain, ``weights_only``-loadable description (saved in checkpoints)."""
        return {"kind": self.kind, "aabb": self.aabb.clone(),
                "ref_c2w": None if self.ref_c2w is None else self.ref_c2w.clone(),
                "ndc": None if self.ndc is None else list(self.ndc),
                "inner": None if self.inner is None else self.inner.clone(),
                "split": self.split, "far": self.far}

    @classmethod
    def from_state(cls, st: dict) -> "RaySpace":
        return cls(st["kind"], st["aabb"], ref_c2w=st.get("ref_c2w"), ndc=st.get("ndc"), inner=st.get("inner"),
                   split=st.get("split", 1.0), far=st.get("far", math.inf))

    def warp(self, x: torch.Tensor) -> torch.Tensor:
        """contract: world points (P, 3) -> contracted (P, 3) in [-2, 2]^3."""
        return contract(normalize_to_box(x, self.inner.to(x.device)), ord=math.inf)

    def render_args(self, origins: torch.Tensor, directions: torch.Tensor, near, far) -> dict:
        """World rays (B, 3) unit directions, near/far (B, 1) or floats -> the keyword arguments of
        ``render_rays``: ``origins``, ``directions``, ``near``, ``far`` and, outside world space,
        ``viewdirs`` / ``warp`` / ``spacing`` / ``split`` / ``aabb``."""
        if self.kind == "world":
            return {"origins": origins, "directions": directions, "near": near, "far": far}
        if self.kind == "ndc":
            fx, fy, w, h, n = self.ndc
            o, d = to_camera_frame(origins, directions, self.ref_c2w.to(origins.device))
            d = torch.cat([d[:, :2], d[:, 2:].clamp(max=-1e-6)], 1)  # NDC needs forward-looking rays
            o_ndc, d_ndc = ndc_rays(o, d, (fx, fy), w, h, n)
            return {"origins": o_ndc, "directions": d_ndc, "near": 0.0, "far": 1.0, "viewdirs": directions}
        b = origins.shape[0]
        far_t = torch.full((b,), self.far, dtype=origins.dtype, device=origins.device)
        if far is not None and not isinstance(far, (int, float)):
            far_t = torch.minimum(far_t, torch.as_tensor(far, dtype=origins.dtype, device=origins.device).reshape(b))
        elif isinstance(far, (int, float)):
            far_t = far_t.clamp(max=float(far))
        return {"origins": origins, "directions": directions, "near": near, "far": far_t, "warp": self.warp,
                "spacing": "lin_disp", "split": self.split, "aabb": None}


def _ndc_box(c2w_ref: np.ndarray, scene, ndc) -> np.ndarray:
    """(2, 3) NDC box holding every training camera's frustum (corner rays at t = 0 and t = 1)."""
    fx, fy, w, h, n = ndc
    k = np.asarray(scene.intrinsics, np.float64)
    ws, hs = np.asarray(scene.width, np.float64), np.asarray(scene.height, np.float64)
    u = np.stack([np.zeros_like(ws), ws, ws, np.zeros_like(ws)], 1)
    v = np.stack([np.zeros_like(hs), np.zeros_like(hs), hs, hs], 1)
    dc = np.stack([(u - k[:, 2:3]) / k[:, 0:1], -(v - k[:, 3:4]) / k[:, 1:2], -np.ones_like(u)], -1)  # (N, 4, 3)
    c2w = np.asarray(scene.c2w, np.float64)
    dw = np.einsum("nij,nkj->nki", c2w[:, :, :3], dc).reshape(-1, 3)
    ow = np.repeat(c2w[:, :, 3], 4, axis=0)
    o, d = to_camera_frame(torch.from_numpy(ow), torch.from_numpy(dw), torch.from_numpy(c2w_ref))
    d = torch.cat([d[:, :2], d[:, 2:].clamp(max=-1e-6)], 1)
    o2, d2 = ndc_rays(o, d, (fx, fy), w, h, n)
    pts = torch.cat([o2, o2 + d2]).numpy()
    half = np.maximum(np.abs(pts[:, :2]).max(0), 1.0) * (1.0 + NDC_MARGIN)
    return np.array([[-half[0], -half[1], -1.0], [half[0], half[1], 1.0]], np.float32)


def build_space(space: str, scene, box: Optional[np.ndarray] = None, contract_inner: float = 1.0) -> RaySpace:
    """The :class:`RaySpace` of ``scene`` (the training split) for ``model.space``.

    Args:
        space: "auto" | "world" | "ndc" | "contract".
        scene: the training Scene (cameras, intrinsics, sizes, format, aabb, near/far).
        box: (2, 3) world box of the scene (default :func:`dali_nerf.scenes.bounds.scene_bounds`):
            world: the field box; contract: the inner box (before ``contract_inner``).
        contract_inner: contract: the inner box is ``box`` scaled by this about its centre.
    """
    kind = resolve_space(space, scene)
    if box is None:
        box = scene_bounds(scene)
    box = np.asarray(box, np.float64).reshape(2, 3)
    if kind == "world":
        return RaySpace("world", box)
    if kind == "ndc":
        ref = np.eye(4)[:3] if scene.format == "llff" else _average_pose(scene.c2w)
        n = 1.0 if scene.format == "llff" or scene.near is None else float(np.min(scene.near))
        k = np.asarray(scene.intrinsics[0], np.float64)
        ndc = (k[0], k[1], float(scene.width[0]), float(scene.height[0]), n)
        return RaySpace("ndc", _ndc_box(ref, scene, ndc), ref_c2w=ref, ndc=ndc)
    centre, half = 0.5 * (box[0] + box[1]), 0.5 * (box[1] - box[0]) * float(contract_inner)
    inner = np.stack([centre - half, centre + half])
    split = float(half.max())
    return RaySpace("contract", [[-2.0] * 3, [2.0] * 3], inner=inner, split=split, far=CONTRACT_FAR_FACTOR * split)
