"""The launcher's variables (dali_nerf/launch_env.py): one reader, every bad value one line naming
the variable (exit 2 from the trainers, before any rendezvous), and no other module reading them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dali_nerf.errors import LaunchError
from dali_nerf.launch_env import VARIABLES, children_env, group_env, launch_env

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_what_torchrun_sets_and_the_defaults_without_it():
    env = group_env(TORCHRUN)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.master_addr, env.master_port,
            env.run_id, env.restart_count, env.agent_store, env.elastic) == (1, 4, 1, 2, "node0", 29500, "job", 2, True,
                                                                             True)
    alone = launch_env({})
    assert (alone.rank, alone.world_size, alone.local_rank, alone.local_world_size, alone.elastic) == (0, 1, 0, 1, False)
    assert group_env({}) == alone  # one process forms no group: nothing more is needed
    one_host = launch_env({"RANK": "3", "WORLD_SIZE": "4"})
    assert (one_host.local_rank, one_host.local_world_size) == (3, 4)  # the ranks share this host
    # a library user telling the host budget how many ranks share the host, without a launcher
    assert launch_env({"LOCAL_WORLD_SIZE": "16"}).local_world_size == 16


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": ""}, "WORLD_SIZE='': must be an integer >= 1 (the number of ranks); fix the launcher's variables"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0': must be an integer >= 1"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two': must be an integer >= 1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1': must be an integer >= 0"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2: must be less than the number of ranks, WORLD_SIZE=2 (ranks 0 to 1)"),
    ({"RANK": "1"}, "RANK=1: must be less than the number of ranks, WORLD_SIZE unset (one process)"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4: more ranks on this host than WORLD_SIZE=2"),
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2: must be less than LOCAL_WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, "LOCAL_RANK=1: larger than RANK=0"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000': must be an integer 1-65535 (the port of rank 0's store)"),
    ({"MASTER_PORT": ""}, "MASTER_PORT='': must be an integer 1-65535"),
    ({"MASTER_ADDR": "node 0"}, "MASTER_ADDR='node 0': must be the host name or address of rank 0"),
    ({"TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT='x': must be an integer >= 0"),
    ({"WORLD_SIZE": "9" * 5000}, "WORLD_SIZE='99999999999999999999"),
])
def test_a_bad_variable_is_one_line_naming_it(env, message):
    with pytest.raises(LaunchError) as e:
        launch_env(env)
    msg = str(e.value)
    assert msg.startswith(message) and "\n" not in msg and len(msg) < 400, msg


@pytest.mark.parametrize("missing", ["RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_forming_a_group_needs_the_rendezvous_variables(missing):
    env = {k: v for k, v in TORCHRUN.items() if k != missing}
    launch_env(env)  # the sizes alone are fine (the host budget reads them)
    with pytest.raises(LaunchError, match=f"^{missing}: not set, but WORLD_SIZE=4 needs it to form the process group"):
        group_env(env)


@pytest.mark.parametrize("env", [{"WORLD_SIZE": ""}, {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                                      "MASTER_PORT": "29999"}])
def test_the_trainer_exits_2_before_any_rendezvous(env, tmp_path, monkeypatch, capsys):
    """``WORLD_SIZE=`` was a traceback from ``int('')``; ``RANK=2 WORLD_SIZE=2`` waited for torch's
    30-minute store timeout. Both: one ``error:`` line naming the variable, exit 2, nothing written
    (the trainer in this process: a rendezvous would hang the test, not pass it)."""
    from dali_nerf.trainers.ddp import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"scene:\n  path: {tmp_path}\ntrain:\n  runs_dir: {tmp_path / 'runs'}\n  device: cpu\n")
    capsys.readouterr()
    assert main(["--config", str(cfg)]) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    name = "WORLD_SIZE" if env["WORLD_SIZE"] == "" else "RANK"
    assert len(lines) == 1 and lines[0].startswith(f"error: {name}="), lines
    assert not (tmp_path / "runs").exists()


def test_the_host_budget_and_the_collective_device_go_through_the_reader(monkeypatch):
    from dali_nerf.data.hostbudget import local_world_size
    from dali_nerf.sources.sync import collective_device

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(LaunchError, match="LOCAL_WORLD_SIZE=3: more ranks on this host than WORLD_SIZE=2"):
        local_world_size()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_world_size() == 2 and str(collective_device("nccl")) == "cuda:1"
    monkeypatch.setenv("LOCAL_RANK", "")
    with pytest.raises(LaunchError, match="^LOCAL_RANK='': must be an integer >= 0"):
        collective_device("nccl")


def test_children_env_sets_the_local_world_size_and_puts_it_back(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with children_env(local_world_size=4):
        assert launch_env().local_world_size == 4
    assert launch_env().local_world_size == 1


# ------------------------------------------------------------------------------------ one reader

def _readers(path: Path) -> list:
    """Where ``path`` names a launcher variable: a string equal to one (``os.environ["RANK"]``,
    ``os.environ.get("WORLD_SIZE")``, ``"RANK" in os.environ``) or a keyword of that name
    (``dict(os.environ, RANK=...)``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in VARIABLES:
            out.append(f"{path.name}:{node.lineno} {node.value}")
        elif isinstance(node, ast.keyword) and node.arg in VARIABLES:
            out.append(f"{path.name}:{node.value.lineno} {node.arg}=")
    return out


def test_no_module_but_the_reader_reads_the_launchers_variables():
    """Every package module (pipelines/ and trainers/ included) reads them through
    dali_nerf.launch_env; a module that reads ``os.environ`` itself fails this test."""
    roots = [REPO / "dali_nerf", REPO / "pipelines", REPO / "trainers"]
    files = [f for r in roots for f in sorted(r.rglob("*.py")) if f != REPO / "dali_nerf" / "launch_env.py"]
    assert len(files) > 100
    found = [hit for f in files for hit in _readers(f)]
    assert not found, f"read them with dali_nerf.launch_env.launch_env(): {found}"


def test_the_reader_check_sees_each_way_of_reading(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('import os\nw = os.environ.get("WORLD_SIZE")\nr = "RANK" in os.environ\n'
                 'e = dict(os.environ, LOCAL_RANK="0")\np = os.environ["MASTER_PORT"]\n'
                 'doc = "WORLD_SIZE is read elsewhere"\n')
    assert _readers(f) == ["m.py:2 WORLD_SIZE", "m.py:3 RANK", "m.py:4 LOCAL_RANK=", "m.py:5 MASTER_PORT"]
