"""Compatibility module: the DALI ray loader now lives in :mod:`dali_nerf.sources`.

``from dali_nerf.loader import RayLoader`` keeps working for users; code inside the package
imports from :mod:`dali_nerf.sources` (the base in :mod:`dali_nerf.sources.base`, the loader in
:mod:`dali_nerf.sources.rays`, streaming in :mod:`dali_nerf.sources.streaming`).
"""

from dali_nerf.sources.base import (BATCH_KEYS, BatchSource, BatchStats, check_common, dali_to_torch,
                                    resolve_device, scene_from_config)
from dali_nerf.sources.rays import RayLoader
from dali_nerf.sources.streaming import plan_window_images, window_plan

__all__ = ["RayLoader", "BatchStats", "BATCH_KEYS", "resolve_device", "dali_to_torch", "window_plan",
           "plan_window_images", "BatchSource", "check_common", "scene_from_config"]
