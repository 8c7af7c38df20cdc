"""Typed configuration: dataclasses loaded from YAML with ``yaml.safe_load``.

Each field has a docstring (the string literal under it). Runtime values (rank, world size,
device) are not stored here; they are passed to ``from_config(cfg, rank, world_size)`` at setup.

An unknown key, a wrong type, an out-of-range value or a missing path raises :class:`ConfigError`
with a one-line message naming the key and the file::

    configs/ddp_objects.yaml: pipeline.rays_per_batch: must be in [1, 2147483647], got -4

>>> cfg = load_config("configs/ddp_objects.yaml", ["train.steps=200", "pipeline.mode=epoch"])
>>> cfg.pipeline.rays_per_batch
4096
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Sequence

import yaml

from dali_nerf.errors import ConfigError
from dali_nerf.config.bench import BenchConfig
from dali_nerf.config.checks import choice
from dali_nerf.config.sections import (CacheConfig, ModelConfig, PartitionConfig, PipelineConfig, SceneConfig,
                                       TrainConfig)

__all__ = ["Config", "load_config", "config_to_dict", "apply_overrides", "config_file"]


@dataclass
class Config:
    name: str = "default"
    """Run name: outputs go to <train.runs_dir>/<name>/."""
    method: str = "ddp"
    """ddp (data parallel) | ss (spatial segmentation)."""
    scene: SceneConfig = field(default_factory=SceneConfig)
    """Where the scene is and how to read it."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """Decoded image cache."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Ray batch source."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Radiance field."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation, logging, checkpoints."""
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    """Spatial segmentation cells (method: ss)."""
    bench: BenchConfig = field(default_factory=BenchConfig)
    """The characterization study (dali-nerf bench study)."""

    def validate(self, key: str = ""):
        choice("method", self.method, ("ddp", "ss"))
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"name: must be a plain folder name, got {self.name!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v):
                v.validate(f.name)

    @property
    def run_dir(self) -> Path:
        return Path(self.train.runs_dir) / self.name


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, value, args[0])
    if origin in (list, List, Sequence):
        (item,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {_type_name(tp)} fields, got {type(value).__name__}")
        return _build(tp, value, key)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        try:
            return float(value)
        except OverflowError:  # an int beyond the float range
            raise ConfigError(f"{key}: {len(str(abs(value)))}-digit integer is beyond the range of a number "
                              f"(about 1.8e308); give a smaller value") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp} for {key}")


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else str(k)
            raise ConfigError(f"{where}: unknown key; valid keys here: {', '.join(sorted(names))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _coerce(f"{prefix}.{f.name}" if prefix else f.name, data[f.name], hints[f.name])
    return cls(**kwargs)


def config_to_dict(cfg) -> dict:
    """Plain dict of a config (for YAML dumps and run folders)."""
    return dataclasses.asdict(cfg)


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply ``a.b=value`` strings (value parsed as YAML) to a nested dict, in place."""
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r}: expected key=value, e.g. train.steps=100")
        key, raw = ov.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except (yaml.YAMLError, ValueError):  # ValueError: an integer of more than 4300 digits
            value = raw
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            if not isinstance(node.setdefault(p, {}), dict):
                raise ConfigError(f"override {key}: {p} is not a section")
            node = node[p]
        node[parts[-1]] = value
    return data


def load_config(path=None, overrides: Sequence[str] = (), check_paths: bool = True) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None), apply overrides, validate.

    Args:
        path: YAML file, or None for the built-in defaults.
        overrides: ``key=value`` strings, e.g. ``["train.steps=100"]``.
        check_paths: also require ``scene.path`` to exist.
    Raises:
        ConfigError: one line naming the file and key.
    """
    where = str(path) if path is not None else "<defaults>"
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{where}: config file not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{where}: not valid YAML{at}; fix the syntax") from None
        except ValueError as e:  # the YAML is well formed but a value cannot be built (Python's int digit limit)
            raise ConfigError(f"{where}: a value cannot be read ({str(e).split(';')[0]}); fix it") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: top level must be a mapping of sections, got {type(data).__name__}")
    try:
        apply_overrides(data, overrides)
        cfg = _build(Config, data)
        cfg.validate()
        if check_paths and not Path(cfg.scene.path).exists():
            raise ConfigError(f"scene.path: {cfg.scene.path} does not exist; create it with `dali-nerf make-scene` or fix the path")
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return cfg


def config_file(name: str) -> Path:
    """One of the configs shipped with dali_nerf (``configs/<name>``): the copy installed inside the
    package (``dali_nerf/configs/``, setup.cfg), else this checkout's ``configs/`` folder.

    >>> config_file("ddp_objects.yaml").name
    'ddp_objects.yaml'
    """
    pkg = Path(__file__).resolve().parents[1]  # dali_nerf/
    installed, checkout = pkg / "configs" / name, pkg.parent / "configs" / name
    return installed if installed.is_file() or not checkout.is_file() else checkout
