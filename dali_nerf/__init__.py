"""dali_nerf: NeRF training with the rays sampled ahead of the training loop (DALI decode, a C++
ray sampler operator, a prefetching loader; DDP and spatial-segmentation trainers).

``import dali_nerf`` needs no compiler and no GPU: the C++ operator is built and loaded lazily by
:func:`dali_nerf.ops.load_plugin`, the first time a pipeline needs it.

>>> from dali_nerf import RayLoader, load_scene
>>> scene = load_scene("data/default", split="train")
>>> loader = RayLoader(scene, rays_per_batch=4096, rank=0, world_size=1, seed=0, prefetch=2)
>>> images = ImageLoader(load_scene("data/garden", format="colmap"), images_per_batch=1)   # splatting trainers
>>> src = source_from_config("ddp_objects", rank=0, world_size=2)   # what a trainer's rank gets (a shipped config)
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

__all__ = [
    "RayLoader", "ImageLoader", "source_from_config", "SamplingPlan", "Scene", "load_scene", "Config", "load_config", "load_plugin",
    "DaliNerfError", "ConfigError", "SceneError", "__version__",
]

_LAZY = {
    "RayLoader": "dali_nerf.sources",
    "ImageLoader": "dali_nerf.sources",
    "source_from_config": "dali_nerf.sources",
    "SamplingPlan": "dali_nerf.data.plan",
    "Scene": "dali_nerf.scenes",
    "load_scene": "dali_nerf.scenes",
    "Config": "dali_nerf.config",
    "load_config": "dali_nerf.config",
    "load_plugin": "dali_nerf.ops",
    "DaliNerfError": "dali_nerf.errors",
    "ConfigError": "dali_nerf.errors",
    "SceneError": "dali_nerf.errors",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dali_nerf' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
