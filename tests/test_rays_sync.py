"""``rays_sync``, the study's same-sampler control: the registry's ``rays`` sampler (the DALI graph
and our op, the same threads, run size and stream) run synchronously in the training thread —
prefetch 0, no hand-over thread, normal priority, each run copied out of DALI's reused buffers —
for DDP and SS, from the config as the trainers build it."""

from __future__ import annotations

import threading

import pytest
import torch

from dali_nerf.config import SOURCE_NAMES, STUDY_SAMPLERS, PartitionConfig, load_config
from dali_nerf.errors import ConfigError
from dali_nerf.partition import Partition, assign_rank
from dali_nerf.scenegen import make_scene
from dali_nerf.scenes import load_scene
from dali_nerf.sources import build_source
from dali_nerf.sources.registry import RAY_GRAPH_SOURCES, SOURCES, SS_SOURCES

B, RUN = 64, 192  # 3 steps a run


@pytest.fixture(scope="module")
def city(tmp_path_factory):
    root = make_scene("city", tmp_path_factory.mktemp("sync") / "city", width=24, height=16, n_train=8, n_val=1)
    return load_scene(root, "train", format="mega_nerf")


def _config(name: str, *extra):
    # train.device=emulated: pipeline.thread_priority auto resolves to background for the pipelined loader
    over = [f"pipeline.name={name}", f"pipeline.rays_per_batch={B}", f"pipeline.rays_per_run={RUN}",
            "pipeline.prefetch=2", "pipeline.num_threads=1", "train.device=emulated", *extra]
    return load_config(None, over, check_paths=False)


def _loader_threads():
    return {t.name for t in threading.enumerate() if t.name.startswith("dali_nerf-")}


@pytest.mark.parametrize("stream", ["global", "shard"])
def test_ddp_rays_sync_is_rays_without_overlap(city, stream):
    """The same batches as rays, bit for bit, across runs, on either stream; batches held across
    runs keep their values (each run is copied out of the synchronous executor's buffers, which it
    reuses); no hand-over thread, prefetch 0, normal priority whatever the config resolves for rays."""
    before = _loader_threads()
    sync = build_source(_config("rays_sync", f"pipeline.stream={stream}"), city, 0, 2)
    try:
        held = [next(sync) for _ in range(4 * RUN // B)]
        assert _loader_threads() == before  # nothing samples ahead
        assert (sync.prefetch, sync.thread_priority, sync.steps_per_run) == (0, "normal", RUN // B)
        assert sync.plan.rays_per_run == RUN and sync.num_threads == 1 and sync.plan.ray_stream == stream
    finally:
        sync.close()
    ahead = build_source(_config("rays", f"pipeline.stream={stream}"), city, 0, 2)
    try:
        assert (ahead.prefetch, ahead.thread_priority) == (2, "background")
        for i, h in enumerate(held):
            b = next(ahead)
            assert set(b) == set(h) and all(torch.equal(b[k], h[k]) for k in b), i
    finally:
        ahead.close()


def test_ss_rays_sync_is_the_spatial_loader_without_overlap(city):
    part = Partition.from_config(PartitionConfig(grid=[2, 2]), city)
    cells = assign_rank(part.num_cells, 2)
    srcs = {}
    for name in ("rays_sync", "rays"):
        srcs[name] = build_source(_config(name, "method=ss", "pipeline.mode=epoch"), city, 1, 2, cells=cells,
                                  partition=part)
    try:
        assert [s.cell for s in srcs["rays_sync"]] == cells[1]
        assert all(s.prefetch == 0 and s._ahead is None for s in srcs["rays_sync"])  # epoch mode: accepted, as rays
        for a, b in zip(srcs["rays_sync"], srcs["rays"]):
            for _ in range(2 * RUN // B + 1):
                x, y = next(a), next(b)
                assert all(torch.equal(x[k], y[k]) for k in x)
    finally:
        for s in srcs["rays_sync"] + srcs["rays"]:
            s.close()


def test_config_names_the_registrys_sources():
    assert SOURCE_NAMES == SOURCES and set(SS_SOURCES) == set(SOURCES)
    assert set(RAY_GRAPH_SOURCES) == {"rays", "rays_sync"} and set(STUDY_SAMPLERS) == set(SOURCES) - {"ready"}
    cfg = load_config(None, ["pipeline.name=rays_sync", "bench.samplers=[rays_sync,rays]",
                             "bench.emulated_cores=[0,1]"], check_paths=False)
    assert cfg.pipeline.name == "rays_sync" and cfg.bench.emulated_cores == [0, 1]
    for bad, key in (("bench.emulated_cores=[1,-2]", "bench.emulated_cores[1]"),
                     ("bench.samplers=[ready]", "bench.samplers"), ("pipeline.name=rays_async", "pipeline.name")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [bad], check_paths=False)
        assert key in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("stream", ["global", "shard"])
def test_checkpoints_record_rays_sync_as_the_rays_stream(stream):
    """A checkpoint of a rays_sync run records the stream of rays (global: G = B x W kept on a resume
    at another world size), as its batches are those of rays."""
    from dali_nerf.data.plan import plan_from_config
    from dali_nerf.train.resume import resumed_config
    from dali_nerf.sources.registry import run_stream
    from dali_nerf.train.runtime import DistEnv

    for method in ("ddp", "ss"):
        want = run_stream(_config("rays", f"pipeline.stream={stream}", f"method={method}"))
        assert run_stream(_config("rays_sync", f"pipeline.stream={stream}", f"method={method}")) == want
    cfg = _config("rays_sync", f"pipeline.stream={stream}")
    st = {"format": 2, "method": "ddp", "pipeline": "rays_sync", "stream": run_stream(cfg)[0], "step": 4,
          "world_size": 2, "global_batch": run_stream(cfg)[1] * B * 2}
    got = resumed_config(cfg, st, DistEnv(rank=1, world_size=4, local_rank=1, device=torch.device("cpu")))
    plan = plan_from_config(got, 1, 4)  # the rank's plan resolves the kept global batch
    assert (got.pipeline.stream, plan.rays_per_batch) == (stream, B // 2 if stream == "global" else B)
    assert (plan.stream_version, plan.run_global_batch) == (st["stream"], st["global_batch"])
    other = _config("rays_sync", "pipeline.stream=" + ("shard" if stream == "global" else "global"))
    assert resumed_config(other, st, DistEnv(1, 2, 1, torch.device("cpu"))).pipeline.stream == stream
