"""Spatial segmentation (Mega-NeRF style), one module per concern:

* :mod:`.cells` -- :class:`Partition` (centroids from a grid or k-means over the camera positions,
  margin, 2-D or 3-D distances, the partition file) and :func:`assign_rank`;
* :mod:`.routing` -- exact ray membership :func:`ray_cells` (the reference the C++ op implements),
  Mega-NeRF's brute force :func:`ray_cells_dense`, the scene's ray segments;
* :mod:`.mega_nerf` -- Mega-NeRF cluster-mask export / ``params.pt`` import.

* :mod:`.blend` -- the fusion weights of points, :func:`point_weights` (the fused field's blend).

>>> part = Partition.from_config(cfg.partition, scene)
>>> ray_cells(part, origins, directions, near, far).shape   # (B, C) bool
(4096, 4)
"""

from dali_nerf.partition.blend import point_weights
from dali_nerf.partition.cells import Partition, assign_rank, plane_axes
from dali_nerf.partition.mega_nerf import export_mega_nerf, export_megannerf, import_mega_nerf, import_megannerf, load_masks
from dali_nerf.partition.routing import cell_fraction, clip_to_bounds, ray_cells, ray_cells_dense, scene_ray_bounds

__all__ = [
    "Partition", "assign_rank", "ray_cells", "ray_cells_dense", "point_weights", "scene_ray_bounds",
    "cell_fraction", "export_mega_nerf", "import_mega_nerf", "export_megannerf", "import_megannerf",
    "load_masks", "plane_axes", "clip_to_bounds",
]
