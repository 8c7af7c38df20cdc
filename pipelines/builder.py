"""The one place that maps ``cfg.pipeline.name`` to a batch source.

========== ===============================================================
name       source
========== ===============================================================
rays       :class:`dali_nerf.loader.RayLoader` (our DALI pipeline + operator)
sync_local :class:`dali_nerf.baseline.SyncLocalSampler`
sync_global :class:`dali_nerf.baseline.SyncGlobalSampler`
torch_workers :class:`dali_nerf.baseline.TorchWorkersSampler`
========== ===============================================================

>>> src = build_batch_source(cfg, scene, rank=0, world_size=2)
>>> batch = next(src)          # origins/directions/rgb (B, 3), indices (B, 3), near/far (B, 1)
"""

from __future__ import annotations

from dali_nerf.errors import ConfigError

__all__ = ["build_batch_source", "SOURCES"]

SOURCES = ("rays", "sync_global", "sync_local", "torch_workers")


def build_batch_source(cfg, scene, rank: int, world_size: int):
    """Batch source named by ``cfg.pipeline.name`` for this rank (same interface for all)."""
    name = cfg.pipeline.name
    if name == "rays":
        from dali_nerf.loader import RayLoader

        return RayLoader.from_config(cfg, rank, world_size, scene=scene)
    from dali_nerf import baseline

    classes = {"sync_global": baseline.SyncGlobalSampler, "sync_local": baseline.SyncLocalSampler,
               "torch_workers": baseline.TorchWorkersSampler}
    if name not in classes:
        raise ConfigError(f"pipeline.name: must be one of {', '.join(SOURCES)}, got {name!r}")
    return classes[name].from_config(cfg, rank, world_size, scene=scene)
