"""Typed configuration: dataclasses loaded from YAML with ``yaml.safe_load``.

Each field has a docstring (the string literal under it). Runtime values (rank, world size,
device) are not stored here; they are passed to ``from_config(cfg, rank, world_size)`` at setup.

An unknown key, a wrong type, an out-of-range value or a missing path raises :class:`ConfigError`
with a one-line message naming the key and the file::

    configs/ddp_objects.yaml: pipeline.rays_per_batch: must be in [1, 2147483647], got -4

A value is formatted with :func:`~dali_nerf.errors.shown` (bounded whatever its size), and a file
whose YAML aliases expand to more than :data:`MAX_NODES` values, or that nests deeper than
:data:`MAX_DEPTH`, is refused before anything is built from it. YAML 1.1 reads ``1e-3`` (no dot)
as a string: a numeric string is accepted where the field is a number (:func:`_number`).

>>> cfg = load_config("configs/ddp_objects.yaml", ["train.steps=200", "pipeline.mode=epoch"])
>>> cfg.pipeline.rays_per_batch
4096
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Sequence

import yaml

from dali_nerf.errors import ConfigError, shown
from dali_nerf.config.bench import BenchConfig
from dali_nerf.config.checks import choice, path_value
from dali_nerf.config.shipped import resolve_config
from dali_nerf.config.sections import (CacheConfig, ModelConfig, PartitionConfig, PipelineConfig, SceneConfig,
                                       TrainConfig)
from dali_nerf.config.splat import ImagesConfig, SplatConfig

__all__ = ["Config", "load_config", "config_to_dict", "apply_overrides", "MAX_NODES", "MAX_DEPTH", "yaml_load"]

MAX_NODES = 100_000
"""Values (scalars, lists, mappings) a config may hold once its YAML aliases are expanded; ours
hold a few hundred. An alias repeats its anchor's whole value, so ten nested levels of ten aliases
each are 10^10 values in a file of a few hundred bytes (a "billion laughs")."""
MAX_DEPTH = 100
"""Levels of nested lists / mappings a config may have (PyYAML composes them recursively)."""

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
"""Numeric strings taken for numbers: decimal integers; decimals with an optional exponent
(``1e-3``, ``2.5E4``, ``.5``). Not ``nan``, ``inf``, hex or underscores."""


def _expansion(root, where: str) -> None:
    """Refuse a YAML node graph that expands to more than :data:`MAX_NODES` values, nests deeper
    than :data:`MAX_DEPTH`, or holds itself (a recursive alias); names the key where it happens.
    Counted on the composed nodes (an alias is the same node object again), memoised, without
    recursion: linear in the file, not in its expansion."""
    size, depth, active = {}, {}, set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        kids = _children(node)
        if done:
            active.discard(id(node))
            size[id(node)] = 1 + sum(size[id(k)] for k in kids)
            depth[id(node)] = 1 + max((depth[id(k)] for k in kids), default=0)
            continue
        if id(node) in size:
            continue
        if id(node) in active:
            raise ConfigError(f"{where}: a value contains itself (a recursive YAML alias{_anchor(node)}); write it out")
        active.add(id(node))
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)
    if size[id(root)] > MAX_NODES or depth[id(root)] > MAX_DEPTH:
        node, path = root, []
        while isinstance(node, yaml.MappingNode):  # down to the key that holds the excess
            big = [(k, v) for k, v in node.value if size[id(v)] > MAX_NODES or depth[id(v)] > MAX_DEPTH]
            if not big or not isinstance(big[0][0], yaml.ScalarNode):
                break
            path.append(str(big[0][0].value)[:80])
            node = big[0][1]
        key = ".".join(path) + ": " if path else ""
        if size[id(root)] > MAX_NODES:
            raise ConfigError(f"{where}: {key}expands to {size[id(node)]} values through YAML aliases (&anchor / "
                              f"*alias repeat a value), over the limit of {MAX_NODES}; a config holds a few hundred: "
                              f"write the value out")
        raise ConfigError(f"{where}: {key}nested {depth[id(node)]} levels deep, over the limit of {MAX_DEPTH}; "
                          f"a config nests 2 or 3")


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for kv in node.value for x in kv]
    return []


def _anchor(node) -> str:
    m = node.start_mark
    return f" at line {m.line + 1}" if m is not None else ""


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that checks the composed document with :func:`_expansion` before
    constructing any Python object from it."""

    where = "<yaml>"
    _depth = 0

    def compose_node(self, parent, index):
        # deeper nesting is refused as it is read: PyYAML's scanner is quadratic in the nesting
        # of flow collections ([[[...) and its composer recursive
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError(f"{self.where}: nested over {MAX_DEPTH} levels deep at line {mark.line + 1}; "
                                  f"a config nests 2 or 3")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node):
        _expansion(node, self.where)
        return super().construct_document(node)


def yaml_load(text: str, where: str):
    """``yaml.safe_load(text)`` bounded (:func:`_expansion`); ``where`` names the source in the
    ConfigError. YAML errors propagate (the caller words them)."""
    loader = _BoundedLoader(text)
    loader.where = where
    try:
        return loader.get_single_data()
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"{where}: nested too deeply for the YAML parser (over {MAX_DEPTH} levels is refused "
                          f"anyway); a config nests 2 or 3") from None
    finally:
        loader.dispose()


@dataclass
class Config:
    name: str = "default"
    """Run name: outputs go to <train.runs_dir>/<name>/."""
    method: str = "ddp"
    """ddp (data parallel) | ss (spatial segmentation) | splat (Gaussian splatting, data parallel
    over images: trainers/splat.py)."""
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
    images: ImagesConfig = field(default_factory=ImagesConfig)
    """Image batches (method: splat)."""
    splat: SplatConfig = field(default_factory=SplatConfig)
    """Gaussian splats (method: splat)."""

    def validate(self, key: str = ""):
        choice("method", self.method, ("ddp", "ss", "splat"))
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"name: must be a plain folder name, got {shown(self.name)}")
        path_value("name", self.name)
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
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {shown(value)}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {_type_name(tp)} fields, got {type(value).__name__}")
        return _build(tp, value, key)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {shown(value)}")
        return value
    if tp is int or tp is float:
        return _number(key, value, tp)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {shown(value)}")
        return value
    raise TypeError(f"unsupported config type {tp} for {key}")


def _number(key: str, value: Any, tp):
    """An int (``tp`` int) or a float (``tp`` float; ints accepted) from ``value``: a number, or a
    numeric string (YAML 1.1 reads ``1e-3`` as one): decimal digits for an int, a decimal with an
    optional exponent for a float. Anything else is refused naming the key."""
    what = "an integer" if tp is int else "a number"
    if isinstance(value, str) and (_INT if tp is int else _FLOAT).fullmatch(value.strip()):
        text = value.strip()
        try:
            value = int(text) if tp is int else float(text)
        except ValueError:  # over Python's 4300-digit limit for int()
            raise ConfigError(f"{key}: {len(text)}-digit integer is beyond what a config holds; give a smaller "
                              f"value") from None
        if tp is float and not math.isfinite(value):
            raise ConfigError(f"{key}: {shown(text)} is beyond the range of a number (about 1.8e308); give a smaller "
                              f"value")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float) if tp is float else int):
        hint = ""
        if tp is int and (isinstance(value, float) or isinstance(value, str) and _FLOAT.fullmatch(value.strip())):
            hint = "; write an integer without a decimal point or exponent (e.g. 1000, not 1e3)"
        raise ConfigError(f"{key}: expected {what}, got {type(value).__name__} {shown(value)}{hint}")
    if tp is int:
        return value
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range
        raise ConfigError(f"{key}: {value.bit_length() * 30103 // 100000 + 1}-digit integer is beyond the range of a "
                          f"number (about 1.8e308); give a smaller value") from None


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            name = k if isinstance(k, str) and len(k) <= 80 and k.isprintable() else shown(k)
            where = f"{prefix}.{name}" if prefix else name
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
            raise ConfigError(f"override {shown(ov)}: expected key=value, e.g. train.steps=100")
        key, raw = ov.split("=", 1)
        try:
            value = yaml_load(raw, f"override {shown(key)}") if raw != "" else ""
        except (yaml.YAMLError, ValueError):  # ValueError: an integer of more than 4300 digits
            value = raw
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            if not isinstance(node.setdefault(p, {}), dict):
                raise ConfigError(f"override {shown(key)}: {shown(p)} is not a section")
            node = node[p]
        node[parts[-1]] = value
    return data


def load_config(path=None, overrides: Sequence[str] = (), check_paths: bool = True) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None), apply overrides, validate.

    Args:
        path: YAML file, a shipped config's name (:func:`~dali_nerf.config.shipped.resolve_config`), or
            None for the built-in defaults.
        overrides: ``key=value`` strings, e.g. ``["train.steps=100"]``.
        check_paths: also require ``scene.path`` to exist.
    Raises:
        ConfigError: one line naming the file and key.
    """
    where = str(path) if path is not None else "<defaults>"
    data: dict = {}
    if path is not None:
        p = resolve_config(path)  # a file, or a shipped config by name; else one line listing the names
        try:
            data = yaml_load(p.read_text(), where) or {}
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

