"""SamplingPlan (dali_nerf/data/plan.py): a rank's sampling resolved once, from a config or RayLoader's arguments."""

from __future__ import annotations

import pytest

from dali_nerf.config import load_config
from dali_nerf.errors import ConfigError
from dali_nerf.data.hostbudget import host_budget, run_size
from dali_nerf.data.plan import SamplingPlan, plan_from_config


def _cfg(*ov):
    return load_config(None, list(ov), check_paths=False)


def test_a_data_parallel_rank_gets_the_host_budget_unless_the_config_sets_it():
    cfg = _cfg("pipeline.rays_per_batch=4096", "train.device=cpu")
    p = plan_from_config(cfg, 1, 2, local_ranks=2, cores=16)
    b = host_budget(4096, local_ranks=2, cores=16)
    assert (p.threads, p.rays_per_run, p.decode_threads, p.budget) == (b.threads, b.rays_per_run, b.threads, b)
    assert (p.rank, p.world_size, p.stream(), p.device, p.priority) == (1, 2, (1, 2), "cpu", "normal")
    fixed = plan_from_config(_cfg("pipeline.num_threads=3", "pipeline.rays_per_run=10000", "pipeline.rays_per_batch=4096"))
    assert (fixed.threads, fixed.rays_per_run, fixed.steps_per_run, fixed.budget) == (3, 12288, 3, None)


def test_emulated_and_gpu_runs_sample_in_background_on_the_host():
    p = plan_from_config(_cfg("train.device=emulated"), 0, 4, local_ranks=4, cores=2)
    assert (p.device, p.priority) == ("cpu", "background")
    assert plan_from_config(_cfg("train.device=emulated", "pipeline.thread_priority=normal")).priority == "normal"


def test_an_ss_ranks_cells_share_its_threads():
    """Per rank, not per cell: 4 cells on a rank of a 16-core host with 1 rank share its 4 threads
    (1 each, runs of 1 thread's rays), where every cell used to get all 4 (16 sampler threads)."""
    cfg = _cfg("method=ss", "pipeline.rays_per_batch=2048", "train.device=cpu")
    rank = plan_from_config(cfg, 0, 1, local_ranks=1, cores=16)
    cells = plan_from_config(cfg, 0, 1, cells=(0, 1, 2, 3), num_cells=4, local_ranks=1, cores=16)
    assert rank.threads == 4 and (cells.threads, cells.decode_threads) == (1, 4)
    assert cells.rays_per_run == run_size(2048, 1) == 65536
    two = plan_from_config(cfg, 0, 2, cells=(0, 2), num_cells=4, local_ranks=2, cores=16)
    assert (two.threads, two.decode_threads, two.rays_per_run) == (2, 4, 131072)  # 8 cores a rank: 4 threads, 2 a cell
    assert two.stream(2) == (2, 4) and two.stream(0) == (0, 4)
    with pytest.raises(ConfigError, match="cell=4"):
        two.stream(4)
    explicit = plan_from_config(_cfg("method=ss", "pipeline.num_threads=2", "pipeline.rays_per_run=4096",
                                     "pipeline.rays_per_batch=2048"), 0, 1, cells=(0, 1, 2, 3), num_cells=4)
    assert (explicit.threads, explicit.decode_threads, explicit.rays_per_run) == (1, 2, 4096)


def test_the_loader_arguments_make_the_same_plan():
    p = SamplingPlan.for_loader(1000, rank=1, world_size=3, seed=7, mode="epoch", num_threads=2, rays_per_run=2500)
    assert (p.rays_per_batch, p.rays_per_run, p.steps_per_run, p.threads, p.stream()) == (1000, 3000, 3, 2, (1, 3))
    with pytest.raises(ConfigError, match="thread_priority"):
        SamplingPlan.for_loader(64, thread_priority="auto")  # a resolved value: auto belongs to configs
    with pytest.raises(ConfigError, match="rays_per_batch"):
        SamplingPlan.for_loader(0)


def test_rays_per_rank_spread_and_the_uneven_note():
    """The global stream's rays per rank follow the shards' pixels: the largest rank's share over
    the mean (DALI's shard rule), and rank 0's one-line note above 1.1x, only for the global stream
    on more than one rank."""
    from dali_nerf.data.plan import rays_per_rank_spread, uneven_rays_note

    eq = [160000] * 100
    assert [round(rays_per_rank_spread(eq, W), 2) for W in (1, 2, 4, 16, 24, 32, 48, 64)] == \
        [1.0, 1.0, 1.0, 1.12, 1.2, 1.28, 1.44, 1.28]
    assert rays_per_rank_spread([1, 1, 1, 97], 2) == pytest.approx(98 * 2 / 100)  # shards [1, 1] and [1, 97]
    assert rays_per_rank_spread([5, 5, 5], 3) == 1.0 and rays_per_rank_spread([], 4) == 1.0

    def plan(W, stream="global"):
        cfg = load_config(None, [f"pipeline.stream={stream}", "pipeline.rays_per_batch=1024"], check_paths=False)
        return plan_from_config(cfg, 0, W)

    note = uneven_rays_note(plan(48), eq)
    assert note == ("note: with the global stream each rank samples the rays of its image shard: 100 images over 48 "
                    "ranks give the largest rank 1.44x the mean of 1024 rays a step (step time and GPU memory follow "
                    "it); a number of ranks that divides the number of images evens it out")
    assert uneven_rays_note(plan(48, "shard"), eq) is None  # every rank samples exactly B
    assert uneven_rays_note(plan(4), eq) is None and uneven_rays_note(plan(1), [1, 99]) is None
    assert uneven_rays_note(plan(16), eq) is not None  # 1.12 > 1.1
