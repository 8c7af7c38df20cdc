"""Fusion weights of points over the cells (Mega-NeRF's fused-inference rule): the blending the
fused field (:class:`dali_nerf.models.fused.FusedField`) and the routing checks use.

>>> point_weights(part, np.zeros((1, 3))).sum(1)
array([1.])
"""

from __future__ import annotations

import numpy as np
import torch

from dali_nerf.partition.cells import Partition

__all__ = ["point_weights", "point_weights_t"]


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
    is_np = not isinstance(x, torch.Tensor)
    xt = torch.as_tensor(np.asarray(x, np.float64)) if is_np else x
    c = torch.as_tensor(np.array(partition.centroids), dtype=xt.dtype, device=xt.device)
    P = torch.as_tensor(partition.projector(), dtype=xt.dtype, device=xt.device)
    w = point_weights_t(xt, c, P, partition.margin)
    return w.numpy() if is_np else w


def point_weights_t(x, centroids, P, margin: float):
    """torch core of :func:`point_weights` (any dtype and device).

    Args:
        x: (P, 3) points; centroids: (C, 3); P: (3, 3) projector (``Partition.projector()``);
        margin: the partition's margin m >= 1.
    Returns:
        (P, C) weights, rows sum to 1.
    """
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
