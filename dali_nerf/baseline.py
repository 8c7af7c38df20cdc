"""Compatibility module: the study's baselines now live in :mod:`dali_nerf.sources.sync`.

``from dali_nerf.baseline import SyncLocalSampler`` keeps working for users; code inside the
package imports from :mod:`dali_nerf.sources`.
"""

from dali_nerf.sources.sync import PixelSampler, SyncGlobalSampler, SyncLocalSampler, TorchWorkersSampler

__all__ = ["SyncLocalSampler", "SyncGlobalSampler", "TorchWorkersSampler", "PixelSampler"]
