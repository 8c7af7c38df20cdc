"""Ray generation from the ``(camera, row, col)`` index tensor — the whole interface between
sampling and ray generation. One implementation, in torch, used by the baselines, the renderer
and the trainers (the C++ operator implements the same formula; tests check them against an
independent numpy reference).
"""

from __future__ import annotations

import torch

__all__ = ["rays_from_indices", "image_rays"]


def rays_from_indices(c2w: torch.Tensor, intrinsics: torch.Tensor, indices: torch.Tensor):
    """Rays of pixels given by indices.

    Args:
        c2w: (N, 3, 4) float32 camera-to-world, OpenGL axes.
        intrinsics: (N, 4) float32 fx, fy, cx, cy.
        indices: (B, 3) int64 (camera, row, col).
    Returns:
        origins (B, 3) float32, directions (B, 3) float32 unit length.

    Example:
        >>> o, d = rays_from_indices(c2w, K, torch.tensor([[0, 10, 20]]))
    """
    cam, row, col = indices[:, 0], indices[:, 1], indices[:, 2]
    k = intrinsics[cam]
    x = (col.to(torch.float32) + 0.5 - k[:, 2]) / k[:, 0]
    y = -(row.to(torch.float32) + 0.5 - k[:, 3]) / k[:, 1]
    d_cam = torch.stack([x, y, -torch.ones_like(x)], dim=-1)  # (B, 3)
    pose = c2w[cam]  # (B, 3, 4)
    d = torch.einsum("bij,bj->bi", pose[:, :, :3], d_cam)
    d = d / torch.linalg.norm(d, dim=-1, keepdim=True)
    return pose[:, :, 3].contiguous(), d


def image_rays(c2w: torch.Tensor, intrinsics: torch.Tensor, width: int, height: int):
    """All rays of one camera, row-major.

    Args:
        c2w: (3, 4); intrinsics: (4,); width, height: image size.
    Returns:
        origins (H*W, 3), directions (H*W, 3).
    """
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    idx = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return rays_from_indices(c2w[None], intrinsics[None], idx)
