"""Typed configuration: dataclasses loaded from YAML with ``yaml.safe_load`` (``load``: the root
``Config``, typed building, ``key=value`` overrides; ``sections``: scene, cache, pipeline, model,
train, partition; ``splat``: images and splat (method splat); ``bench``: the study's grid; ``checks``: the value checks and value sets).

>>> cfg = load_config("configs/ddp_objects.yaml", ["train.steps=200", "pipeline.mode=epoch"])
>>> cfg.pipeline.rays_per_batch
4096
"""

from dali_nerf.errors import ConfigError  # noqa: F401  (dali_nerf.config.ConfigError, as before the package split)
from dali_nerf.config.bench import BenchConfig, DeviceStep
from dali_nerf.config.checks import MAX_THREADS, SOURCE_NAMES, STREAMS, STUDY_SAMPLERS
from dali_nerf.config.load import Config, apply_overrides, config_to_dict, load_config
from dali_nerf.config.shipped import describe_config, resolve_config, shipped_configs
from dali_nerf.config.load import _build  # noqa: F401  (tests build single sections)
from dali_nerf.config.sections import (CacheConfig, ModelConfig, PartitionConfig, PipelineConfig, SceneConfig,
                                       TrainConfig)
from dali_nerf.config.splat import ImagesConfig, SplatConfig

__all__ = [
    "Config", "SceneConfig", "CacheConfig", "PipelineConfig", "ModelConfig", "TrainConfig",
    "PartitionConfig", "BenchConfig", "DeviceStep", "ImagesConfig", "SplatConfig", "load_config", "config_to_dict",
    "apply_overrides", "resolve_config", "shipped_configs", "describe_config", "SOURCE_NAMES",
    "STUDY_SAMPLERS", "STREAMS", "MAX_THREADS",
]
