"""The elastic resume rules of dali_nerf.train.resume in-process: which (method, stream) a checkpoint
records for a config (:func:`run_stream`) and which world sizes a format-2 checkpoint resumes on
(``_check_elastic``). The trainers' resumes on other world sizes run in tests/test_elastic_resume.py
(subprocesses); these cases pin the rules themselves, one line per refusal."""

from pathlib import Path

import pytest

from dali_nerf.config import load_config
from dali_nerf.errors import DaliNerfError
from dali_nerf.pipelines.rays import GLOBAL_STREAM, SHARD_STREAM
from dali_nerf.train.resume import ELASTIC, _check_elastic
from dali_nerf.sources.registry import run_stream
from dali_nerf.sources.registry import SOURCES, SS_SOURCES

FOLDER = Path("/runs/r/checkpoints/step_00000010")


def _cfg(method, name, stream="global"):
    return load_config(None, [f"method={method}", f"pipeline.name={name}", f"pipeline.stream={stream}"],
                       check_paths=False)


@pytest.mark.parametrize("method,name,stream,want", [
    ("ddp", "rays", "global", (GLOBAL_STREAM, 1)),
    ("ddp", "rays", "shard", (SHARD_STREAM, 0)),
    ("ddp", "sync_global", "global", ("sync_global-v1", 1)),
    ("ddp", "sync_local", "global", ("sync_local-v1", 0)),
    ("ddp", "torch_workers", "shard", ("torch_workers-v1", 0)),
    ("ss", "rays", "shard", ("cells-v1", 0)),  # SS cells ignore pipeline.stream
    ("ss", "sync_global", "global", ("ss-sync_global-v1", 0)),
])
def test_run_stream_names_the_stream_a_checkpoint_records(method, name, stream, want):
    assert run_stream(_cfg(method, name, stream)) == want


def test_the_elastic_streams_are_exactly_those_of_ddp_global_sync_global_and_ss_cells():
    """Every config's (method, stream) is elastic iff it is one of the three that continue on
    another world size; the others are per-rank streams."""
    elastic = set()
    for method, names in (("ddp", SOURCES), ("ss", SS_SOURCES)):
        for name in names:
            for stream in ("global", "shard"):
                s, _ = run_stream(_cfg(method, name, stream))
                if (method, s) in ELASTIC:
                    elastic.add((method, name, stream))
    # rays_sync is rays at prefetch 0: the same streams, so the same rules
    assert elastic == {("ddp", "rays", "global"), ("ddp", "rays_sync", "global"), ("ddp", "sync_global", "global"),
                       ("ddp", "sync_global", "shard"), ("ss", "rays", "global"), ("ss", "rays", "shard"),
                       ("ss", "rays_sync", "global"), ("ss", "rays_sync", "shard")}


def _run(method, stream, W, G=0, cells=0, pipeline="rays"):
    return {"world_size": W, "stream": stream, "method": method, "global_batch": G, "cells": cells,
            "pipeline": pipeline}


def _refusal(run, world) -> str:
    with pytest.raises(DaliNerfError) as e:
        _check_elastic(run, FOLDER, world)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{FOLDER}: "), msg
    return msg


@pytest.mark.parametrize("stream,pipeline", [(SHARD_STREAM, "rays"), ("sync_local-v1", "sync_local"),
                                             ("torch_workers-v1", "torch_workers")])
def test_per_rank_streams_resume_on_their_world_size_only(stream, pipeline):
    run = _run("ddp", stream, 2, pipeline=pipeline)
    _check_elastic(run, FOLDER, 2)  # the same world size: any stream resumes
    for world in (1, 3, 4):
        msg = _refusal(run, world)
        assert f"written by 2 ranks with " in msg and f"resumes on 2 ranks only, not {world}" in msg, msg
        what = "pipeline.stream=shard" if stream == SHARD_STREAM else f"pipeline.name={pipeline} (per-rank streams)"
        assert what in msg, msg
    # an SS baseline's per-rank streams likewise; an unknown method too
    _refusal(_run("ss", "ss-sync_local-v1", 2, cells=4, pipeline="sync_local"), 1)
    _refusal(_run("nerfacto", GLOBAL_STREAM, 2, G=8), 1)


@pytest.mark.parametrize("stream", [GLOBAL_STREAM, "sync_global-v1"])
def test_global_batch_streams_resume_on_any_world_size_dividing_G(stream):
    run = _run("ddp", stream, 2, G=12)
    for world in (1, 2, 3, 4, 6, 12):
        _check_elastic(run, FOLDER, world)
    for world, nearest in ((5, "4 or 6"), (7, "6 or 12"), (8, "6 or 12"), (24, "12")):
        msg = _refusal(run, world)
        assert (f"global batch of 12 rays (6 per rank x 2 ranks) does not divide among {world} ranks" in msg
                and msg.endswith(f"that divides 12: {nearest}")), msg
    # a world size stored as a string, a missing or zero G (nothing to divide) resume anywhere
    _check_elastic(dict(run, world_size="2", global_batch=0), FOLDER, 5)
    _check_elastic({k: v for k, v in run.items() if k != "global_batch"}, FOLDER, 5)
    # the rank counts named are the divisors nearest W' (below and above), not the smallest ones
    assert _refusal(_run("ddp", stream, 1, G=5040), 11).endswith("that divides 5040: 10 or 12")


def test_ss_cells_resume_on_at_most_their_number_of_ranks():
    run = _run("ss", "cells-v1", 1, cells=4)
    for world in (1, 2, 3, 4):
        _check_elastic(run, FOLDER, world)
    for world in (5, 8):
        msg = _refusal(run, world)
        assert "the run's 4 cells cannot be shared among" in msg and f"among {world} ranks" in msg, msg
        assert "resume on at most 4 ranks" in msg, msg
    assert "cells cannot be shared" in _refusal({k: v for k, v in run.items() if k != "cells"}, 2)
    # a DDP run records no cells: its world size is not bounded by them
    _check_elastic(_run("ddp", GLOBAL_STREAM, 1, G=8, cells=0), FOLDER, 8)


def _env(world):
    import torch

    from dali_nerf.train.runtime import DistEnv
    return DistEnv(rank=0, world_size=world, local_rank=0, device=torch.device("cpu"))


def test_global_batch_sets_the_rays_per_rank_of_a_new_run_or_is_refused_in_one_line():
    """pipeline.global_batch G: a new run on W ranks trains G / W rays per rank (the plan's); a W
    that does not divide G, or a run without a global batch, is refused naming the key and the fix."""
    from dali_nerf.errors import ConfigError
    from dali_nerf.data.plan import plan_from_config
    from dali_nerf.train.resume import resumed_config

    cfg = load_config(None, ["pipeline.global_batch=1536", "train.device=cpu"], check_paths=False)
    for world, b in ((1, 1536), (2, 768), (3, 512), (4, 384), (12, 128)):
        plan = plan_from_config(resumed_config(cfg, None, _env(world)), 0, world)
        assert (plan.rays_per_batch, plan.global_batch, plan.run_global_batch) == (b, 1536, 1536)
    unset = load_config(None, ["pipeline.rays_per_batch=100", "train.device=cpu"], check_paths=False)
    assert plan_from_config(unset, 0, 7).rays_per_batch == 100  # 0: rays_per_batch as given, G = B x W
    with pytest.raises(ConfigError) as e:
        plan_from_config(cfg, 0, 5)
    assert str(e.value) == ("pipeline.global_batch=1536 does not divide among 5 ranks; use a number of ranks that "
                            "divides it (4 or 6) or change it")
    for overrides, what in ((["method=ss"], "method ss"), (["pipeline.stream=shard"], "pipeline.stream=shard"),
                            (["pipeline.name=sync_local"], "pipeline.name=sync_local")):
        bad = load_config(None, ["pipeline.global_batch=1536", "train.device=cpu", *overrides], check_paths=False)
        with pytest.raises(ConfigError) as e:
            plan_from_config(bad, 0, 2)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("pipeline.global_batch=1536: this run has no global batch") \
            and what in msg and msg.endswith("or leave it 0"), msg
    sync = load_config(None, ["pipeline.global_batch=1536", "pipeline.name=sync_global", "train.device=cpu"],
                       check_paths=False)
    assert plan_from_config(sync, 0, 3).rays_per_batch == 512


def _resumed_plan(cfg, st, world):
    """The plan a rank trains with after resuming ``st`` on ``world`` ranks."""
    from dali_nerf.data.plan import plan_from_config
    from dali_nerf.train.resume import resumed_config

    out = resumed_config(cfg, st, _env(world))
    return out, plan_from_config(out, 0, world)


def test_a_resumed_run_keeps_its_checkpoints_global_batch_over_the_configs(capsys):
    """The checkpoint's G wins: a config naming the same G resumes without a note; another G or
    none is noted once (rank 0), and a W that divides the checkpoint's G but not the config's is
    not refused (the config's G is not used)."""
    st = {"format": 2, "method": "ddp", "pipeline": "rays", "stream": GLOBAL_STREAM, "global_batch": 1536,
          "step": 20, "world_size": 4}
    same, plan = _resumed_plan(load_config(None, ["pipeline.global_batch=1536", "train.device=cpu"],
                                           check_paths=False), st, 3)
    assert (plan.rays_per_batch, same.pipeline.global_batch) == (512, 1536)
    assert capsys.readouterr().err == ""
    other, plan = _resumed_plan(load_config(None, ["pipeline.global_batch=1000", "train.device=cpu"],
                                            check_paths=False), st, 3)
    assert (plan.rays_per_batch, other.pipeline.global_batch) == (512, 1536)
    assert capsys.readouterr().err == ("note: resuming step 20 (written by 4 rank(s)): its global batch of 1536 rays "
                                       "is kept: pipeline.global_batch=1536 (was 1000), pipeline.rays_per_batch=512 on 3 ranks\n")
    none, plan = _resumed_plan(load_config(None, ["train.device=cpu"], check_paths=False), st, 2)
    assert (plan.rays_per_batch, plan.run_global_batch) == (768, 1536)
    assert "is kept on 2 ranks: pipeline.rays_per_batch=768 (was 4096)" in capsys.readouterr().err


def test_a_checkpoint_without_a_global_batch_refuses_the_configs(capsys):
    """A shard-stream checkpoint resumed with pipeline.global_batch set (and the default stream
    global): the run continues the shard stream, which has no global batch, so the key is refused
    in one line (by the rank's plan) rather than changing rays_per_batch silently."""
    from dali_nerf.errors import ConfigError

    st = {"format": 2, "method": "ddp", "pipeline": "rays", "stream": SHARD_STREAM, "global_batch": 0,
          "step": 20, "world_size": 2}
    with pytest.raises(ConfigError, match=r"^pipeline.global_batch=1536: this run has no global batch \(method ddp, "
                                          r"pipeline.name=rays, pipeline.stream=shard\)"):
        _resumed_plan(load_config(None, ["pipeline.global_batch=1536", "train.device=cpu"], check_paths=False), st, 2)
    kept, plan = _resumed_plan(load_config(None, ["pipeline.rays_per_batch=100", "train.device=cpu"],
                                           check_paths=False), st, 2)
    assert (kept.pipeline.stream, plan.rays_per_batch, plan.stream_version) == ("shard", 100, SHARD_STREAM)


def test_sources_built_from_a_config_take_the_global_batch(tmp_path):
    """build_source (the trainers', the emulated mode's and source_from_config's door) resolves
    pipeline.global_batch: a RayLoader of rank 1 of 3 samples the global batch G, B = G / 3 a rank."""
    from dali_nerf.scenegen import make_scene
    from dali_nerf.sources.registry import build_source
    from dali_nerf.scenes import scene_from_config

    root = make_scene("objects", tmp_path / "s", width=16, n_train=3, n_val=1, seed=0)
    cfg = load_config(None, [f"scene.path={root}", "pipeline.global_batch=96", "pipeline.prefetch=0"])
    src = build_source(cfg, scene_from_config(cfg), 1, 3)
    try:
        assert (src.global_batch, src.rays_per_batch) == (96, 32)
        assert len(next(src)["rgb"]) > 0
    finally:
        src.close()
