"""Property: config overrides round-trip, and a value of the wrong type is one line naming the key.

The keys and their types come from the dataclasses themselves (``dali_nerf.config.Config`` and
its sections, via ``typing.get_type_hints``), so a field added later is covered without editing
this file. Values are written as the user writes them, ``section.key=<YAML>`` (``yaml.safe_dump``
of a Python value, which ``apply_overrides`` reads back with ``yaml.safe_load``), and also as a
YAML config file. For each drawn (key, value):

* a value of the field's type either loads, with the field equal to the value (ints accepted
  where floats are, as floats) and the whole config equal after a dump and reload of
  ``config_to_dict``, or is out of range and raises ConfigError: one line, naming the key and
  the file (``<defaults>`` for overrides alone);
* a value of another type always raises that one-line ConfigError naming the key;
* a numeric string (YAML 1.1 reads ``1e-3`` as one) in a numeric field is that number: a decimal
  integer for an int field, a decimal with an optional exponent for a float field; other strings
  there are of another type.

Values of a field with fixed choices (``must be one of ...``) are drawn from the choices the
validator itself states, found by probing it with a value outside them; free strings from text.
A few wrong-typed overrides also go through the DDP trainer's entry point (exit 2, one
``error:`` line, no traceback).
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import event, given, settings, strategies as st

from dali_nerf.config import Config, config_to_dict, load_config
from dali_nerf.errors import ConfigError
from dali_nerf.trainers.ddp import main as ddp_main

PROBE = "no_such_choice_zz"


def _leaves():
    """[(key, type, default)] of every leaf field: top-level scalars and section.field."""
    out = []
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            sub = typing.get_type_hints(tp)
            for g in dataclasses.fields(tp):
                d = g.default_factory() if g.default is dataclasses.MISSING else g.default
                out.append((f"{f.name}.{g.name}", sub[g.name], d))
        else:
            out.append((f.name, tp, f.default))
    return out


LEAVES = _leaves()
TYPES = {key: tp for key, tp, _ in LEAVES}


def dump(value) -> str:
    """The override text of a value: its YAML, one line, without the document-end marker."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True)
    return text[:-5] if text.endswith("\n...\n") else text.rstrip("\n")


def override(key, value) -> str:
    return f"{key}={dump(value)}"


def _item_type(tp):
    return typing.get_args(tp)[0] if typing.get_origin(tp) in (list, typing.List) else None


def _choices(key, tp):
    """The choices the validator states for ``key`` ("must be one of a, b"), or None."""
    item = _item_type(tp)
    base = item or tp
    probe = {str: PROBE, int: -987654321, float: -987654321.5}.get(base)
    if probe is None:
        return None
    try:
        load_config(None, [override(key, [probe] if item else probe)], check_paths=False)
    except ConfigError as e:
        m = re.search(r"must be one of (.*), got ", str(e))
        if m:
            return [base(c) for c in m.group(1).split(", ")]
    return None


CHOICES = {key: _choices(key, tp) for key, tp, _ in LEAVES}

text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=12)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)


def _scalar(tp, key):
    choices = CHOICES.get(key)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.sampled_from(choices) if choices else st.one_of(st.integers(-3, 3), st.integers(-10, 10 ** 9))
    if tp is float:
        # an int is a float of the config (accepted and converted), of any size (here up to 400 digits)
        return st.one_of(finite_floats, st.floats(-2, 10, allow_nan=False), st.integers(-10, 1000),
                         st.integers(-10 ** 400, 10 ** 400))
    if tp is str:
        return st.one_of(st.sampled_from(choices), text) if choices else text
    if tp is typing.Any:  # scene.background: a name, RGB in [0, 1], or something else
        return st.one_of(st.sampled_from(["auto", "white", "black", "random", "learned"]),
                         st.lists(st.floats(0, 1), min_size=3, max_size=3), st.lists(st.floats(-1, 2), max_size=4), text)
    raise AssertionError(f"{key}: no strategy for type {tp}")


def _record(cls, key):
    """A mapping of a dataclass item's fields (``bench.device_steps``' items), each of its own type:
    strings also from the words the validator takes (a device step's kind), number lists short."""
    hints = typing.get_type_hints(cls)
    fields = {}
    for f in dataclasses.fields(cls):
        tp, item = hints[f.name], _item_type(hints[f.name])
        if item is not None:
            fields[f.name] = st.lists(st.one_of(st.floats(0, 20), _scalar(item, f"{key}.{f.name}[]")), max_size=3)
        elif tp is str:
            fields[f.name] = st.one_of(st.sampled_from(["measured", "stated", "assumed", "a"]), text)
        else:
            fields[f.name] = _scalar(tp, f"{key}.{f.name}")
    return st.fixed_dictionaries({}, optional=fields)


def typed_values(key):
    """Values of the field's own type (valid or out of range)."""
    tp = TYPES[key]
    item = _item_type(tp)
    if item is not None:
        choices = CHOICES.get(key)
        if dataclasses.is_dataclass(item):
            return st.lists(_record(item, key + "[]"), max_size=3)
        elem = st.sampled_from(choices) if choices else _scalar(item, key + "[]")
        return st.lists(elem, max_size=5)
    return _scalar(tp, key)


NUMERIC = {int: re.compile(r"\s*[+-]?[0-9]+\s*"),
           float: re.compile(r"\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*")}
"""The strings a numeric field takes for numbers (the rule as documented in dali_nerf/config/load.py)."""


def _not_numeric_for(tp):
    pattern = NUMERIC.get(_item_type(tp) or tp)
    return (lambda s: s != "" and not pattern.fullmatch(s)) if pattern is not None else (lambda s: s != "")


def wrong_values(key):
    """Values of another type than the field's (none for Any)."""
    tp = TYPES[key]
    scalars = {bool: st.booleans(), int: st.integers(-5, 10 ** 6), float: st.floats(-1e6, 1e6).filter(lambda v: v != int(v)),
               str: text.filter(_not_numeric_for(tp)), type(None): st.none()}
    mapping = st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 3), min_size=1, max_size=2)
    item = _item_type(tp)
    if item is not None:  # a scalar or mapping instead of a list, or a list with an item of another type
        bad_items = [s for t, s in scalars.items() if t is not item and not (item is float and t is int)]
        return st.one_of(*[s for t, s in scalars.items() if t is not type(None)], mapping,
                         st.lists(st.one_of(*bad_items), min_size=1, max_size=3))
    if tp is typing.Any:
        return st.nothing()
    allowed = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}[tp]
    others = [s for t, s in scalars.items() if t not in allowed]
    if tp is int:  # floats are wrong for an int field (even 2.0): the filter above keeps non-integral ones
        others.append(st.floats(-1e6, 1e6).map(lambda v: float(int(v))))
    return st.one_of(*others, mapping, st.lists(st.integers(0, 3), max_size=2))


def get(cfg, key):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def expected(key, value):
    """What the config holds after loading ``value`` (ints become floats in float fields)."""
    tp = TYPES[key]
    item = _item_type(tp)
    if item is float:
        return [float(v) for v in value]
    if dataclasses.is_dataclass(item):  # a list of mappings: the dataclasses, floats where the field's are
        hints = typing.get_type_hints(item)
        return [item(**{k: [float(x) for x in v] if _item_type(hints[k]) is float else v for k, v in d.items()})
                for d in value]
    if tp is float:
        return float(value)
    return value


def assert_one_line(e: ConfigError, key: str, where: str):
    msg = str(e)
    assert "\n" not in msg and "\r" not in msg, msg
    assert msg.startswith(f"{where}: "), msg
    assert key in msg, f"the message does not name {key}: {msg}"


def as_file(folder: Path, key, value) -> Path:
    data, node = {}, None
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return path


keys = st.sampled_from(sorted(TYPES))


def test_every_leaf_is_covered_and_defaults_round_trip():
    """The enumeration sees every section's fields, and each default, written as an override,
    loads back unchanged (the serialisation the property tests rely on)."""
    assert len(LEAVES) >= 70 and {"pipeline.mode", "train.lr", "partition.grid", "scene.background", "name"} <= set(TYPES)
    assert CHOICES["pipeline.mode"] == ["random", "epoch"] and CHOICES["partition.dims"] == [2, 3]
    for key, tp, default in LEAVES:
        cfg = load_config(None, [override(key, default)], check_paths=False)
        assert get(cfg, key) == default, key


@settings(max_examples=300)
@given(data=st.data(), key=keys, as_yaml_file=st.booleans())
def test_typed_values_round_trip_or_fail_in_one_line_naming_the_key(data, key, as_yaml_file):
    value = data.draw(typed_values(key), label="value")
    with tempfile.TemporaryDirectory() as tmp:
        if as_yaml_file:
            path = as_file(Path(tmp), key, value)
            where, load = str(path), lambda: load_config(path, check_paths=False)
        else:
            where, load = "<defaults>", lambda: load_config(None, [override(key, value)], check_paths=False)
        try:
            cfg = load()
        except ConfigError as e:  # out of range: one line naming the key
            assert_one_line(e, key, where)
            event("refused (out of range)")
            return
        event("loaded")
        got = get(cfg, key)
        assert got == expected(key, value) and type(got) is type(expected(key, value)), (got, value)
        # the whole config survives a dump and a reload
        again = Path(tmp) / "again.yaml"
        again.write_text(yaml.safe_dump(config_to_dict(cfg), allow_unicode=True))
        assert load_config(again, check_paths=False) == cfg


@settings(max_examples=300)
@given(data=st.data(), key=keys.filter(lambda k: TYPES[k] is not typing.Any), as_yaml_file=st.booleans())
def test_wrong_types_fail_in_one_line_naming_the_key(data, key, as_yaml_file):
    value = data.draw(wrong_values(key), label="value")
    with tempfile.TemporaryDirectory() as tmp:
        with pytest.raises(ConfigError) as e:
            if as_yaml_file:
                where = str(as_file(Path(tmp), key, value))
                load_config(where, check_paths=False)
            else:
                where = "<defaults>"
                load_config(None, [override(key, value)], check_paths=False)
    assert_one_line(e.value, key, where)


@settings(max_examples=8)
@given(data=st.data(), key=keys.filter(lambda k: TYPES[k] is not typing.Any))
def test_trainer_wrong_type_exits_2_with_one_line(data, key, capsys, monkeypatch):
    monkeypatch.setenv("OPENCV_LOG_LEVEL", "ERROR")  # the trainer's own default, restored after the test
    value = data.draw(wrong_values(key), label="value")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "c.yaml"
        cfg.write_text(f"train:\n  runs_dir: {tmp}/runs\n")
        capsys.readouterr()
        rc = ddp_main(["--config", str(cfg), override(key, value)])
        err = capsys.readouterr().err
        assert not (Path(tmp) / "runs").exists()  # nothing written
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], err
    assert "Traceback" not in err


def numeric_strings(tp):
    """(text, number): a number of the field's type written as a string, in the ways configs
    write them (``1e-3``, ``+2.5E4``, ``.5``, ``  7 ``), and the number it is."""
    if tp is int:
        return st.integers(-10, 10 ** 12).flatmap(
            lambda v: st.sampled_from([str(v), f"+{v}" if v >= 0 else str(v), f" {v} "]).map(lambda t: (t, v)))
    floats = st.floats(-1e30, 1e30, allow_nan=False, allow_infinity=False)
    return floats.flatmap(lambda v: st.sampled_from([repr(v), f"{v:e}", f"{v:.3E}", f"{v:.6g}", f"{v:f}"]).map(
        lambda t: (t, float(t)))).filter(lambda tv: NUMERIC[float].fullmatch(tv[0]))


NUMERIC_KEYS = sorted(k for k, tp in TYPES.items() if (_item_type(tp) or tp) in (int, float) and not CHOICES.get(k))


@settings(max_examples=200)
@given(data=st.data(), key=st.sampled_from(NUMERIC_KEYS), as_yaml_file=st.booleans())
def test_numeric_strings_are_numbers_in_numeric_fields(data, key, as_yaml_file):
    """A numeric field given its number as a (quoted) string loads as that number (or is out of
    range, one line naming the key), as a YAML file and as an override."""
    tp = TYPES[key]
    item = _item_type(tp)
    text, number = data.draw(numeric_strings(item or tp), label="text")
    value = [text] if item else text
    want = [float(number)] if item is float else [number] if item else float(number) if tp is float else number
    with tempfile.TemporaryDirectory() as tmp:
        if as_yaml_file:
            path = as_file(Path(tmp), key, value)
            where, load = str(path), lambda: load_config(path, check_paths=False)
        else:  # quoted, so that YAML keeps it a string whatever it looks like
            where = "<defaults>"
            quoted = f"['{text}']" if item else f"'{text}'"
            load = lambda: load_config(None, [f"{key}={quoted}"], check_paths=False)
        try:
            cfg = load()
        except ConfigError as e:
            assert_one_line(e, key, where)
            assert "expected" not in str(e), str(e)  # refused by its range, not by its type
            event("refused (out of range)")
            return
    event("loaded")
    got = get(cfg, key)
    assert got == want and type(got) is type(want), (got, want, text)
