"""Fused inference over spatial-segmentation sub-models (Mega-NeRF's ``MegaNeRF`` container).

Each sample point ``x`` is evaluated only by the sub-models of the cells whose weight
(:func:`dali_nerf.partition.point_weights`) is non-zero: the cells with
``dist(x, c_j) <= margin * min_k dist(x, c_k)``, weighted by ``1 / dist`` and normalised. Points
are grouped by cell, so each sub-model runs once per call on exactly its points.

Blending, as Mega-NeRF does it (``mega_nerf/models/mega_nerf.py``): the sub-models' outputs are
blended *linearly* by weight, ``sigma = sum_j w_j sigma_j`` and ``rgb = sum_j w_j rgb_j`` (they
blend the raw network outputs, rgb after its sigmoid, sigma before its activation; our fields
return sigma after its activation, so the blend stays >= 0 and rgb stays in [0, 1]). With
margin 1.0 every point has exactly one cell (ties aside), so the fused field is the
piecewise sub-model field with no overhead beyond routing.

>>> fused = FusedField([field0, field1, field2, field3], partition)
>>> sigma, rgb = fused(x, d)          # x, d (P, 3) -> (P,), (P, 3)
>>> out = render_rays(fused, origins, directions, near, far)
>>> fused.fusion_stats()["models_per_point"]
1.18
"""

from __future__ import annotations

from typing import Dict, Sequence

import numpy as np
import torch
from torch import nn

from dali_nerf.partition.blend import point_weights, point_weights_t
from dali_nerf.partition.cells import Partition

__all__ = ["FusedField", "point_weights", "point_weights_t"]


class FusedField(nn.Module):
    """One radiance field made of per-cell sub-fields.

    Args:
        fields: C sub-fields (``nn.Module``), one per cell, in cell order; each has
            ``forward(x (P, 3), d (P, 3)) -> (sigma (P,), rgb (P, 3))`` and ``density(x) -> (P,)``.
        partition: the cells (``partition.num_cells == len(fields)``).

    When every sub-field has an ``aabb`` (2, 3) buffer, the fused field's ``aabb`` is their union
    (the renderer clips rays to it).

    Example:
        >>> fused = FusedField(fields, part).eval()
        >>> sigma, rgb = fused(torch.rand(1024, 3), torch.nn.functional.normalize(torch.randn(1024, 3), dim=-1))
        >>> sigma.shape, rgb.shape
        (torch.Size([1024]), torch.Size([1024, 3]))
    """

    def __init__(self, fields: Sequence[nn.Module], partition: Partition):
        super().__init__()
        if len(fields) != partition.num_cells:
            raise ValueError(f"FusedField: {len(fields)} sub-fields for {partition.num_cells} cells")
        self.fields = nn.ModuleList(fields)
        self.partition = partition
        self.margin = float(partition.margin)
        self.register_buffer("centroids", torch.as_tensor(np.array(partition.centroids), dtype=torch.float32), persistent=False)
        self.register_buffer("projector", torch.as_tensor(partition.projector(), dtype=torch.float32), persistent=False)
        boxes = [getattr(f, "aabb", None) for f in fields]
        if boxes and all(isinstance(b, torch.Tensor) for b in boxes):  # the renderer's clip box
            box = torch.stack([b.detach().float().reshape(2, 3) for b in boxes])
            self.register_buffer("aabb", torch.stack([box[:, 0].amin(0), box[:, 1].amax(0)]), persistent=False)
        self.reset_stats()

    @property
    def background_logit(self):
        """Not None when every sub-field learned a background colour (then :meth:`background` works)."""
        logits = [getattr(f, "background_logit", None) for f in self.fields]
        return None if not logits or any(l is None for l in logits) else torch.stack(list(logits))

    def background(self) -> torch.Tensor:
        """(3,) the fused learned background: the mean of the sub-fields' learned colours (each
        sub-model learns the colour of the rays crossing its cell; a ray that hits nothing sees the
        sky of every cell it crosses)."""
        if self.background_logit is None:
            raise RuntimeError("FusedField.background: the sub-fields have no learned background")
        return torch.stack([f.background() for f in self.fields]).mean(0)

    # ---- statistics ------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero the counters of :meth:`fusion_stats`."""
        self._points = 0
        self._evals = [0] * len(self.fields)
        self._calls = 0

    def fusion_stats(self) -> Dict[str, object]:
        """Fusion overhead since the last :meth:`reset_stats`.

        Returns:
            {"points": points queried, "calls": forward/density calls,
             "evaluated_per_model": [C] points each sub-model evaluated,
             "models_per_point": average sub-models per point (1.0 = no overhead)}.
        """
        ev = list(self._evals)
        return {
            "points": self._points,
            "calls": self._calls,
            "evaluated_per_model": ev,
            "models_per_point": (sum(ev) / self._points) if self._points else 0.0,
        }

    # ---- evaluation ------------------------------------------------------------------------
    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """Blending weights, x (P, 3) -> (P, C), rows sum to 1 (see ``point_weights``)."""
        return point_weights_t(x, self.centroids.to(x.dtype), self.projector.to(x.dtype), self.margin)

    def _groups(self, x: torch.Tensor):
        """(cell, indices (n,), weights (n,)) for each cell with at least one point."""
        with torch.no_grad():
            w = self.weights(x.detach())  # weights are not differentiated (as Mega-NeRF)
        self._points += int(x.shape[0])
        self._calls += 1
        for j in range(len(self.fields)):
            idx = torch.nonzero(w[:, j] > 0, as_tuple=True)[0]
            if idx.numel():
                self._evals[j] += int(idx.numel())
                yield j, idx, w[idx, j]

    def forward(self, x: torch.Tensor, d: torch.Tensor):
        """Blended field.

        Args:
            x: (P, 3) world points; d: (P, 3) unit view directions.
        Returns:
            sigma (P,) >= 0, rgb (P, 3) in [0, 1] (weight-blended sub-field outputs).
        """
        sigma = x.new_zeros(x.shape[0])
        rgb = x.new_zeros(x.shape[0], 3)
        for j, idx, wj in self._groups(x):
            s, c = self.fields[j](x[idx], d[idx])
            sigma = sigma.index_add(0, idx, s.reshape(-1).to(sigma.dtype) * wj)
            rgb = rgb.index_add(0, idx, c.reshape(-1, 3).to(rgb.dtype) * wj[:, None])
        return sigma, rgb

    def density(self, x: torch.Tensor) -> torch.Tensor:
        """Blended density, x (P, 3) -> sigma (P,) (same weights as :meth:`forward`)."""
        sigma = x.new_zeros(x.shape[0])
        for j, idx, wj in self._groups(x):
            sigma = sigma.index_add(0, idx, self.fields[j].density(x[idx]).reshape(-1).to(sigma.dtype) * wj)
        return sigma
