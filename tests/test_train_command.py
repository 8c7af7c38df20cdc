"""``dali-nerf train`` (dali_nerf/cli/train.py), the shipped configs and ``--config NAME``
(dali_nerf/config/shipped.py), and ``dali-nerf --help`` in plain text.

The 2-rank DDP run stopped by SIGTERM and resumed is README's own line (tests/test_readme.py); here
the 2-rank SS run, the in-process single rank, and the one-line errors."""

from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dali_nerf.cli.main import SUMMARIES, _COMMANDS, main
from dali_nerf.cli.train import TRAINERS, torchrun_command, trainer_module
from dali_nerf.config import load_config
from dali_nerf.config.shipped import describe_config, resolve_config, shipped_configs, shipped_dir
from dali_nerf.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
TINY = ["train.steps=4", "train.log_every=2", "train.checkpoint_every=2", "train.eval_images=1",
        "pipeline.rays_per_batch=256", "pipeline.rays_per_run=1024", "model.resolution=16",
        "model.samples_per_ray=16", "model.occupancy_resolution=0"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _cli(args, cwd, timeout=600):
    return subprocess.run([sys.executable, "-m", "dali_nerf", *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_help_is_plain_text_with_one_summary_line_per_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert set(SUMMARIES) == set(_COMMANDS)
    for name, summary in SUMMARIES.items():
        assert any(line.split() == [name, *summary.split()] for line in out.splitlines()), (name, out)
    for markup in ("``", ":func:", ":class:", ":data:", "**"):
        assert markup not in out, (markup, out)
    assert out.startswith("usage: dali-nerf [-h] COMMAND ...")
    for argv, usage in ((["train", "--help"], "usage: dali-nerf train [-h]"),
                        (["bench", "study", "--help"], "usage: dali-nerf bench study [-h]")):
        with pytest.raises(SystemExit):
            main(argv)
        assert capsys.readouterr().out.startswith(usage), argv


def test_shipped_configs_are_the_repository_configs_and_installed_as_package_data():
    assert shipped_dir().resolve() == (REPO / "configs").resolve()  # this checkout's editable install
    names = set(shipped_configs())
    assert names == {p.stem for p in (REPO / "configs").glob("*.yaml")}
    assert {"ddp_objects", "ss_city", "study"} <= names
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert "dali_nerf.configs = configs" in cfg["options"]["package_dir"]
    assert "dali_nerf.configs" in cfg["options"]["packages"].split()
    assert cfg["options.package_data"]["dali_nerf.configs"].strip() == "*.yaml"
    for name, path in shipped_configs().items():
        line = describe_config(path)
        assert 20 < len(line) <= 130, (name, line)  # a one-line description: the first comment line
        load_config(name, check_paths=False)  # each one loads by its name


def test_list_shows_every_shipped_config_with_its_description(capsys):
    assert main(["train", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    for name, path in shipped_configs().items():
        assert f"{name}  " in "\n".join(out) and any(line.split(None, 1) == [name, describe_config(path)] for line in out)


def test_config_name_resolution(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here: names come from the package
    shipped = shipped_configs()
    assert resolve_config("ddp_objects") == shipped["ddp_objects"] == resolve_config("ddp_objects.yaml")
    assert resolve_config(None) is None
    assert load_config("ss_city", check_paths=False).method == "ss"
    mine = tmp_path / "ddp_objects.yaml"  # a file that exists wins over the shipped name
    mine.write_text("name: mine\n")
    assert resolve_config("ddp_objects.yaml") == Path("ddp_objects.yaml")
    assert load_config("ddp_objects.yaml", check_paths=False).name == "mine"
    assert load_config("ddp_objects", check_paths=False).name == "ddp_objects"
    with pytest.raises(ConfigError) as e:
        resolve_config("ddp_objetcs")
    msg = str(e.value)
    assert msg.startswith("ddp_objetcs: config file not found") and all(n in msg for n in shipped), msg
    with pytest.raises(ConfigError, match="sub/ddp_objects.yaml: config file not found"):
        resolve_config("sub/ddp_objects.yaml")  # a path with a folder is never looked up by name


def test_every_method_has_one_trainer_module():
    """Every method the config accepts has its trainer module (installed, with ``main``), and
    TRAINERS names no method a config refuses; any other method is refused in one line."""
    import importlib

    for method, module in TRAINERS.items():
        assert load_config(None, [f"method={method}"], check_paths=False).method == method  # a method configs accept
        assert trainer_module(method) == module
        assert callable(importlib.import_module(module).main)
    assert set(TRAINERS) == {"ddp", "ss", "splat"}
    for path in shipped_configs().values():
        trainer_module(load_config(path, check_paths=False).method)  # every shipped config's method has one
    with pytest.raises(ConfigError, match="method: must be one of .*, got 'nerfacto'"):
        load_config(None, ["method=nerfacto"], check_paths=False)
    with pytest.raises(ConfigError, match=f"method 'nerfacto' has no trainer; use one of {', '.join(TRAINERS)}$"):
        trainer_module("nerfacto")


def test_bad_configs_are_one_line_exit_2_before_any_rank(tmp_path, capsys):
    runs = tmp_path / "runs"
    cases = [
        (["--config", "nope"], ["nope: config file not found", "ddp_objects", "ss_city"]),
        (["--config", "ddp_objects", f"train.runs_dir={runs}", "pipeline.rays_per_batch=-1"],
         ["ddp_objects: pipeline.rays_per_batch"]),
        (["--config", "ddp_objects", f"train.runs_dir={runs}", f"scene.path={tmp_path / 'absent'}"],
         ["scene.path", "absent", "make-scene"]),
        ([], ["--config: required", "dali-nerf train --list"]),
        (["--config", "ss_city", "--nproc", "0"], ["--nproc=0"]),
    ]
    for args, needles in cases:
        assert main(["train", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), (args, err)
        assert all(n in err for n in needles), (args, err)
    assert not runs.exists()  # nothing started, nothing written
    r = _cli(["train", "--config", "nope"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_rendezvous_options_go_to_torchrun_instead_of_standalone():
    """What `dali-nerf train` hands torchrun: --standalone alone on one node; the rendezvous and
    restart options, in torchrun's spelling, in its place (docs/MULTINODE.md's recipe)."""
    import argparse

    from dali_nerf.cli.train import add_arguments, launch_options

    p = argparse.ArgumentParser()
    add_arguments(p)
    one = p.parse_args(["--config", "ddp_objects", "--nproc", "2", "train.steps=9"])
    assert launch_options(one) == []
    cmd = torchrun_command("dali_nerf.trainers.ddp", one.nproc, one.config, one.overrides, launch=launch_options(one))
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                   "dali_nerf.trainers.ddp", "--config", "ddp_objects", "train.steps=9"]
    many = p.parse_args(["--config", "x.yaml", "--nproc", "4", "--nnodes", "2:4", "--node-rank", "1", "--rdzv-backend",
                         "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "job-1", "--rdzv-conf",
                         "last_call_timeout=30", "--max-restarts", "3", "--resume", "name=lego"])
    cmd = torchrun_command("dali_nerf.trainers.spatial", many.nproc, many.config, many.overrides, many.resume,
                           launch_options(many))
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nnodes", "2:4", "--node_rank", "1", "--rdzv_backend", "c10d",
                       "--rdzv_endpoint", "node0:29400", "--rdzv_id", "job-1", "--rdzv_conf", "last_call_timeout=30",
                       "--max_restarts", "3", "--nproc_per_node=4", "-m", "dali_nerf.trainers.spatial", "--config",
                       "x.yaml", "--resume", "name=lego"]
    # torchrun itself accepts them (its parser, no launch)
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(cmd[3:])
    assert (parsed.nnodes, parsed.node_rank, parsed.rdzv_endpoint, parsed.max_restarts) == ("2:4", 1, "node0:29400", 3)
    assert parsed.training_script == "dali_nerf.trainers.spatial" and parsed.module


@pytest.fixture(scope="module")
def city(tmp_path_factory):
    from dali_nerf.scenegen import make_scene

    root = tmp_path_factory.mktemp("city")
    make_scene("city", root / "data" / "city", width=32, height=24, n_train=8, n_val=1, seed=1)
    return root


def test_ss_config_by_name_trains_on_two_ranks_under_torchrun(city):
    """``dali-nerf train --config ss_city --nproc 2`` from a folder without configs/: the method
    (ss) picks trainers/spatial.py, torchrun starts 2 ranks, the 4 cells are split 2 + 2."""
    r = _cli(["train", "--config", "ss_city", "--nproc", "2", *TINY], cwd=city)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = city / "runs" / "ss_city"
    s = json.loads((run / "summary.json").read_text())
    assert s["method"] == "ss" and s["world_size"] == 2 and s["cells"] == 4 and s["steps"] == 4, s
    assert (run / "metrics.rank1.jsonl").is_file()  # a second rank ran
    assert (run / "checkpoints" / "torchelastic_run_id").is_file()  # under torchrun (the job id it records)


def test_one_rank_runs_in_process_without_torchrun(city):
    """``--nproc 1`` with no rendezvous option runs the trainer in the command's own process: the
    run has no torchrun job id (written by every run under torchrun, as the 2-rank test shows)."""
    r = _cli(["train", "--config", "ss_city", "--nproc", "1", "name=one", *TINY], cwd=city)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = city / "runs" / "one"
    s = json.loads((run / "summary.json").read_text())
    assert s["method"] == "ss" and s["world_size"] == 1 and s["steps"] == 4, s
    assert (run / "checkpoints" / "latest").is_file() and not (run / "checkpoints" / "torchelastic_run_id").exists()


def test_the_launching_process_outlasts_its_ranks_after_ctrl_c():
    """`dali-nerf demo` (torchrun its child) waits for torchrun after Ctrl-C under a watchdog longer
    than the ranks' own bound (dali_nerf.interrupt's grace), and puts the grace back after the launch."""
    import dali_nerf.interrupt as itr

    with itr.interrupt_guard(grace_s=2.0):
        with itr.grace_at_least(40.0):
            assert itr._state["grace_s"] == 40.0  # what a first SIGINT's watchdog waits
            with itr.grace_at_least(5.0):
                assert itr._state["grace_s"] == 40.0  # never shortened
        assert itr._state["grace_s"] == 2.0


def test_inside_a_launch_the_command_starts_no_second_torchrun(tmp_path, monkeypatch, capsys):
    """A rank of a launch (launch_env: WORLD_SIZE > 1 or torchrun's variables) is refused a torchrun
    of its own, in one line, before anything starts; a malformed launcher variable is one line too."""
    runs = tmp_path / "runs"
    base = ["train", "--config", "ddp_objects", f"train.runs_dir={runs}", "scene.path=."]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*base, "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already rank 1 of a launch (WORLD_SIZE=2)" in err and "--nproc 1" in err, err
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert main([*base, "--nnodes", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: WORLD_SIZE='two'"), err
    assert not runs.exists()

