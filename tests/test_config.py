"""Config loading: every failure class is one line naming the key and the file; CLI exit 2."""

import subprocess
import sys

import pytest

from dali_nerf.config import Config, load_config
from dali_nerf.errors import ConfigError


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def err(tmp_path, text, overrides=(), check_paths=False):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p, overrides, check_paths=check_paths)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(p) in msg
    return msg


def test_defaults_and_overrides(tmp_path):
    p = write(tmp_path, "pipeline:\n  rays_per_batch: 1024\ntrain:\n  lr: 1\n")
    cfg = load_config(p, ["train.steps=7", "pipeline.mode=epoch", "scene.background=[0,0,0]"], check_paths=False)
    assert isinstance(cfg, Config)
    assert cfg.pipeline.rays_per_batch == 1024 and cfg.train.steps == 7 and cfg.pipeline.mode == "epoch"
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.scene.background == [0.0, 0.0, 0.0]


def test_unknown_key(tmp_path):
    msg = err(tmp_path, "pipeline:\n  rays_per_bach: 4\n")
    assert "pipeline.rays_per_bach" in msg and "unknown key" in msg and "rays_per_batch" in msg


def test_unknown_section(tmp_path):
    assert "optimiser" in err(tmp_path, "optimiser: {}\n")


def test_wrong_type(tmp_path):
    msg = err(tmp_path, "train:\n  steps: many\n")
    assert "train.steps" in msg and "integer" in msg
    assert "train.lr" in err(tmp_path, "train:\n  lr: [1]\n")
    assert "pipeline.mode" in err(tmp_path, "pipeline:\n  mode: 3\n")


def test_out_of_range(tmp_path):
    msg = err(tmp_path, "pipeline:\n  rays_per_batch: -4096\n")
    assert "pipeline.rays_per_batch" in msg and "must be in [1, 2147483647], got -4096" in msg
    assert "partition.margin" in err(tmp_path, "partition:\n  margin: 0.5\n")
    assert "pipeline.name" in err(tmp_path, "pipeline:\n  name: magic\n")


def test_override_errors(tmp_path):
    assert "train.steps" in err(tmp_path, "{}\n", ["train.steps=-1"])
    assert "key=value" in err(tmp_path, "{}\n", ["train.steps"])


def test_missing_path(tmp_path):
    msg = err(tmp_path, f"scene:\n  path: {tmp_path}/nope\n", check_paths=True)
    assert "scene.path" in msg and "make-scene" in msg


def test_bad_yaml_and_missing_file(tmp_path):
    assert "not valid YAML" in err(tmp_path, "train: [\n")
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")


def test_cli_exit_code_two_no_traceback(tmp_path):
    p = write(tmp_path, "name: x\nmethod: ddp\ntrain:\n  stepz: 3\n")
    r = subprocess.run([sys.executable, "-m", "dali_nerf.trainers.ddp", "--config", str(p)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "train.stepz" in lines[0]
    assert "Traceback" not in r.stderr


def test_numbers_too_large_are_one_line_errors(tmp_path):
    """An integer beyond the float range in a float key (found by tests/test_properties_config.py:
    OverflowError escaped), and an integer literal over Python's 4300-digit str->int limit in a
    YAML file (ValueError escaped from yaml.safe_load) or an override (kept as text: a numeric
    string, refused by its size), each give one line naming the key or the file."""
    msg = err(tmp_path, "{}\n", ["train.lr=1" + "0" * 400])
    assert "train.lr" in msg and "401-digit integer" in msg
    msg = err(tmp_path, "train:\n  lr: 1" + "0" * 400 + "\n")
    assert "train.lr" in msg
    msg = err(tmp_path, "train:\n  steps: " + "9" * 5000 + "\n")
    assert "a value cannot be read" in msg and "4300 digits" in msg
    msg = err(tmp_path, "{}\n", ["train.steps=" + "9" * 5000])
    assert msg.endswith("train.steps: 5000-digit integer is beyond what a config holds; give a smaller value")


@pytest.mark.parametrize("override,message", [
    ("bench.steps=0", "bench.steps: must be > 0, got 0"),
    ("bench.warmup=-1", "bench.warmup: must be >= 0, got -1"),
    ("bench.scene_kind=forest", "bench.scene_kind: must be one of objects, city, got 'forest'"),
    ("bench.scene_images=0", "bench.scene_images: must be > 0, got 0"),
    ("bench.sampling_sizes=[1024,0]", "bench.sampling_sizes[1]: must be > 0, got 0"),
    ("bench.allreduce_latency_s=-1", "bench.allreduce_latency_s: must be >= 0, got -1.0"),
    ("bench.sampler_seconds=-1", "bench.sampler_seconds: must be >= 0, got -1.0"),
    ("bench.ranks=[0]", "bench.ranks: must be a list of integers >= 1 ([] = no CPU rows), got [0]"),
    ("bench.methods=[ddp,mp]", "bench.methods: must be one of ddp, ss, got 'mp'"),
    ("bench.samplers=[ready]", "bench.samplers: must be one of sync_global, sync_local, torch_workers, rays_sync, "
                               "rays, got 'ready'"),
    ("bench.emulated_samplers=[ready]", "bench.emulated_samplers: must be one of sync_global, sync_local, "
                                        "torch_workers, rays_sync, rays, got 'ready'"),
    ("bench.trials=0", "bench.trials: must be > 0, got 0"),
    ("bench.emulated_steps=0", "bench.emulated_steps: must be > 0, got 0"),
    ("bench.emulated_warmup=-1", "bench.emulated_warmup: must be >= 0, got -1"),
    ("bench.emulated_grad_bytes=-1", "bench.emulated_grad_bytes: must be >= 0, got -1"),
    ("bench.emulated_ranks_ss=[1,0]", "bench.emulated_ranks_ss[1]: must be > 0, got 0"),
    ("bench.fit_ranks=[0]", "bench.fit_ranks[0]: must be > 0, got 0"),
    ("bench.emulated_step_ms=[1.0,0]", "bench.emulated_step_ms[1]: must be > 0 ms, got 0.0"),
    ("bench.check_step_ms=0", "bench.check_step_ms: must be > 0 ms, got 0.0"),
    ("bench.rays=[4096,0]", "bench.rays[1]: must be > 0, got 0"),
    ("bench.small_rays=[-1]", "bench.small_rays[0]: must be > 0, got -1"),
    ("bench.small_ranks=0", "bench.small_ranks: must be > 0, got 0"),
    ("bench.small_resolution=0", "bench.small_resolution: must be > 0, got 0"),
    ("bench.device_steps=[{name: a, ms: [1]}, {name: a, ms: [2]}]",
     "bench.device_steps[1].name: give each device step its own non-empty name, got 'a'"),
    ("bench.device_steps=[{name: '', ms: [1]}]", "bench.device_steps[0].name: give each device step its own non-empty "
                                                 "name, got ''"),
    ("bench.device_steps=[{name: a, kind: guessed, ms: [1]}]",
     "bench.device_steps[0].kind: must be one of measured, stated, assumed, got 'guessed'"),
    ("bench.device_steps=[{name: a, ms: [1, 2]}]",
     "bench.device_steps[0].ms: one value per bench.rays (1: pipeline.rays_per_batch), got 2: [1.0, 2.0]"),
    ("bench.device_steps=[{name: a, ms: [-1]}]", "bench.device_steps[0].ms[0]: must be >= 0, got -1.0"),
    ("bench.device_steps=[{name: a, ms: [0]}]",
     "bench.device_steps[0].ms: every value is 0 (no batch would run); give the step's ms at one at least"),
    ("bench.only_steps=[nope]", "bench.only_steps[0]: 'nope' names no device step; the named ones: none (and loop, with "
                                "bench.device_step_file)"),
    ("bench.device_steps=[{name: a, ms: [1], size: 2}]",
     "bench.device_steps[0].size: unknown key; valid keys here: kind, ms, name, source"),
])
def test_bench_values_out_of_range_are_one_line_naming_the_key(override, message):
    """Every check of the bench section names its key (and the list index) and the value in one
    line (the CLI prints it and exits 2)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override], check_paths=False)
    assert str(e.value) == f"<defaults>: {message}"


def test_bench_values_at_the_edges_are_accepted(tmp_path):
    """What the checks let through: the city scene, every sampler, an empty ranks list, a device step
    not run at some batch (0 ms) beside one at every batch; a section given a non-mapping is refused
    naming its type."""
    cfg = load_config(None, ["bench.scene_kind=city", "bench.samplers=[rays,sync_global,sync_local,torch_workers]",
                             "bench.emulated_samplers=[torch_workers]", "bench.ranks=[]", "bench.warmup=0",
                             "bench.rays=[4096,65536]", "bench.device_steps=[{name: m, kind: measured, ms: [9.3, 0]}, "
                             "{name: s, ms: [13.2, 13.2], source: a paper}]"],
                      check_paths=False)
    b = cfg.bench
    assert (b.scene_kind, b.ranks, b.rays) == ("city", [], [4096, 65536])
    assert [(d.name, d.kind, d.ms, d.source) for d in b.device_steps] == [("m", "measured", [9.3, 0.0], ""),
                                                                         ("s", "stated", [13.2, 13.2], "a paper")]
    assert b.samplers[-1] == b.emulated_samplers[0] == "torch_workers"
    f = tmp_path / "c.yaml"
    f.write_text("bench: 5\n")
    with pytest.raises(ConfigError, match=r"c.yaml: bench: expected a mapping of BenchConfig fields, got int$"):
        load_config(f, check_paths=False)


@pytest.mark.parametrize("overrides,message", [
    (["train.steps=0"], "train.steps: must be > 0, got 0"),
    (["name=a/b"], "name: must be a plain folder name, got 'a/b'"),
    (["name=.hidden"], "name: must be a plain folder name, got '.hidden'"),
    (["model.occupancy_threshold=1.0"], "model.occupancy_threshold: must be in (0, 1), got 1.0"),
    (["model.contract_inner=0"], "model.contract_inner: must be > 0, got 0.0"),
    (["scene.background=[1.5,0,0]"], "scene.background: must be one of auto, white, black, random, learned or 3 "
                                     "numbers in [0, 1], got [1.5, 0, 0]"),
    (["partition.kind=kmeans", "partition.cells=65"], "partition.cells: 65 cells; the op routes among at most 64"),
    (["partition.grid=[8,9]"], "partition.grid: grid 8x9 = 72 cells; the op routes among at most 64"),
])
def test_values_at_the_edge_of_a_check_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides, check_paths=False)
    assert str(e.value) == f"<defaults>: {message}"


@pytest.mark.parametrize("override,key,value", [
    ("scene.path=data/a=b", "scene.path", "data/a=b"),  # only the first '=' splits an override
    ("model.space=ndc", "model.space", "ndc"),
    ("model.occupancy_threshold=0.99", "model.occupancy_threshold", 0.99),
    ("pipeline.name=sync_global", "pipeline.name", "sync_global"),
    ("pipeline.name=ready", "pipeline.name", "ready"),
    ("scene.background=white", "scene.background", "white"),
    ("scene.background=learned", "scene.background", "learned"),
    ("scene.background=[1,0,0.5]", "scene.background", [1, 0, 0.5]),
    ("train.device=cuda", "train.device", "cuda"),
    ("partition.grid=[8,8]", "partition.grid", [8, 8]),
])
def test_every_valid_choice_is_accepted(override, key, value):
    section, leaf = key.split(".")
    assert getattr(getattr(load_config(None, [override], check_paths=False), section), leaf) == value


def _alias_bomb(levels: int) -> str:
    """``scene.background`` whose last item is 10 aliases of 10 aliases ... (``levels`` deep) of a
    list of 10 scalars: 10^(levels+1) values once expanded, in a few hundred bytes."""
    items = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "scene:\n  background: [" + ", ".join(items) + "]\n"


@pytest.mark.parametrize("levels", [4, 9])
def test_an_alias_bomb_is_refused_before_it_is_built(tmp_path, levels):
    """A YAML alias bomb (the issue's: 39 MB of message at 7 levels, no answer at 9) is refused from
    its node graph, before any Python value is built: one short line naming the key and the count,
    in well under a second whatever the level (timing is not asserted: the bound is the message's
    size and the node count)."""
    msg = err(tmp_path, _alias_bomb(levels))
    assert "scene.background: expands to" in msg and "over the limit of 100000" in msg, msg
    assert len(msg) < 400
    # within the limit, aliases are fine (the refusal is of the value, bounded in the message)
    msg = err(tmp_path, _alias_bomb(2))
    assert "scene.background: must be one of" in msg and len(msg) < 500, msg


def test_recursive_and_too_deep_yaml_is_one_line(tmp_path):
    """A recursive alias, nesting past 100 levels as written (refused as it is read: PyYAML's
    scanner is quadratic in it, its composer recursive), and past 100 through an alias."""
    assert "a value contains itself (a recursive YAML alias at line 2)" in err(tmp_path, "scene:\n  background: &a [1, *a]\n")
    for levels in (101, 3000):
        deep = "scene:\n  background: " + "[" * levels + "]" * levels + "\n"
        assert "nested over 100 levels deep at line 2; a config nests 2 or 3" in err(tmp_path, deep)
    through_alias = "scene:\n  background: [&x " + "[" * 60 + "]" * 60 + ", " + "[" * 50 + "*x" + "]" * 50 + "]\n"
    assert "scene.background: nested 111 levels deep, over the limit of 100" in err(tmp_path, through_alias)
    with pytest.raises(ConfigError, match="override 'scene.background': a value contains itself"):
        load_config(None, ["scene.background=&a [1, *a]"], check_paths=False)


def test_messages_are_bounded_whatever_the_value(tmp_path):
    """Every value a message shows is cut (reprlib): a long string, a long list, a deep list; and
    a message is cut at 2000 characters whatever built it."""
    from dali_nerf.errors import MAX_MESSAGE, DaliNerfError

    for text in ("pipeline:\n  mode: " + "x" * 20000 + "\n",
                 "scene:\n  background: [" + ", ".join(["2"] * 2000) + "]\n",
                 "pipeline:\n  rays_per_batch: [" + ", ".join(["1"] * 2000) + "]\n",
                 "partition:\n  grid: [" + ", ".join(["1"] * 2000) + "]\n"):
        msg = err(tmp_path, text)
        assert len(msg) < 400, msg[:500]
    long = str(DaliNerfError("x" * 10 ** 6))
    assert len(long) < MAX_MESSAGE + 40 and long.endswith(f"... ({10 ** 6 - MAX_MESSAGE} more characters)")


@pytest.mark.parametrize("key,value,message", [
    ("name", "a\x00b", r"name: 'a\x00b' holds a NUL byte, which no path can; remove it"),
    ("name", "n" * 256, "has a name of 256 bytes, over the 255 a file system holds; shorten it"),
    ("train.runs_dir", "runs/\x00", r"train.runs_dir: 'runs/\x00' holds a NUL byte"),
    ("scene.path", "data\x00", r"scene.path: 'data\x00' holds a NUL byte"),
    ("bench.out", "d/" * 2100, "bench.out: 'd/d/d/"),
], ids=["nul-name", "long-name", "nul-runs_dir", "nul-scene.path", "long-path"])
def test_a_path_no_file_system_holds_is_one_line(tmp_path, key, value, message):
    """A NUL byte in ``name`` was a 28-line traceback from mkdir (exit 1); now one line naming the
    key, and the trainer exits 2 with nothing written."""
    import yaml

    section, _, field = key.rpartition(".")
    p = write(tmp_path, yaml.safe_dump({section: {field: value}} if section else {field: value}))
    with pytest.raises(ConfigError) as e:
        load_config(p, check_paths=False)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_nul_byte_in_the_name_exits_2_from_the_trainer(tmp_path, capsys):
    from dali_nerf.trainers.ddp import main

    cfg = write(tmp_path, f"name: \"a\\0b\"\ntrain:\n  runs_dir: {tmp_path / 'runs'}\n")
    assert main(["--config", str(cfg)]) == 2
    err_lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err_lines) == 1 and err_lines[0].startswith("error: ") and "NUL byte" in err_lines[0], err_lines
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("key,text,value", [
    ("train.lr", "1e-3", 1e-3), ("train.lr", "'2.5E-2'", 0.025), ("train.lr", ".5", 0.5), ("train.steps", "'12'", 12),
    ("train.max_seconds", "+1e2", 100.0), ("partition.margin", "'1.2'", 1.2),
])
def test_numeric_strings_are_numbers_where_the_field_is_a_number(tmp_path, key, text, value):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; most ML configs write the learning rate so."""
    section, field = key.split(".")
    cfg = load_config(write(tmp_path, f"{section}:\n  {field}: {text}\n"), check_paths=False)
    got = getattr(getattr(cfg, section), field)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("key,text,message", [
    ("train.steps", "1e3", "train.steps: expected an integer, got str '1e3'; write an integer without a decimal point"),
    ("train.lr", "nan", "train.lr: expected a number, got str 'nan'"),
    ("train.lr", "'0x10'", "train.lr: expected a number, got str '0x10'"),
    ("train.lr", "'1_000'", "train.lr: expected a number, got str '1_000'"),
    ("train.lr", "1e999", "train.lr: '1e999' is beyond the range of a number"),
    ("train.lr", "'-1e-3'", "train.lr: must be > 0, got -0.001"),
    ("pipeline.mode", "1e-3", "pipeline.mode: must be one of random, epoch, got '1e-3'"),
])
def test_other_strings_in_numeric_fields_are_refused_as_before(tmp_path, key, text, message):
    section, field = key.split(".")
    assert message in err(tmp_path, f"{section}:\n  {field}: {text}\n")
