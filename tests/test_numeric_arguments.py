"""Every number that reaches the ray-sampler op is range-checked in Python first: one ConfigError
naming the argument (or config key) and its range, never DALI's multi-line C++ assert or an
integer overflow inside it. The op's schema is read from its source so that a new argument
without a Python check fails here."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from _tiny_scene import tiny_scene
from dali_nerf.errors import ConfigError
from dali_nerf.pipelines.rays import INT32_MAX, INT64_MAX, OP_ARGS, RayGraph, check_op_args, ray_pipeline

SCHEMA = Path(__file__).resolve().parents[1] / "dali_nerf" / "ops" / "csrc" / "ray_sampler.cc"


def schema_arguments() -> list:
    """The argument names of ``DALI_SCHEMA(dali_nerf__RaySampler)``, read from the C++ source."""
    text = SCHEMA.read_text()
    text = text[text.index("DALI_SCHEMA(dali_nerf__RaySampler)"):]
    return re.findall(r'\.Add(?:Optional)?Arg\(\s*"(\w+)"', text)


def bad_values(spec) -> list:
    """Values outside what ``spec`` accepts, derived from its kind and range."""
    if spec.kind == "int":
        return [spec.lo - 1, spec.hi + 1, True, 1.5, "3", None]
    if spec.kind == "float":
        return [0.0, -1.0, math.inf, math.nan, 1e39, True, "1"]
    if spec.kind == "bool":
        return [1, "true", None]
    if spec.kind == "choice":
        return ["nope", -7, True, None]
    if spec.kind == "floats":
        n = max(spec.choices)
        return [[1.0] * (n + 1), [math.nan] * n, [math.inf] * n, [1e39] * n, "abc", [True] * n]
    raise AssertionError(spec.kind)


def good_value(spec):
    if spec.kind == "floats":
        return [0.0, 1.0, 0.0] if 3 in spec.choices else []
    if spec.kind == "choice":
        return spec.choices[-1]
    return {"int": spec.hi, "float": 1.5, "bool": False}[spec.kind]


def test_every_schema_argument_has_a_python_check():
    names = schema_arguments()
    assert len(names) >= 14 and "rays" in names and "seed" in names
    assert set(names) == set(OP_ARGS), ("the op's schema and pipelines/rays.py OP_ARGS differ", set(names) ^ set(OP_ARGS))
    for name, spec in OP_ARGS.items():
        extra = {"num_streams": INT32_MAX} if name == "stream" else {}
        if name == "shard_begin":
            extra = {"global_pixels": 2**62}
        check_op_args({name: good_value(spec)} | extra)
        for v in bad_values(spec):
            with pytest.raises(ConfigError) as e:
                check_op_args({name: v})
            assert str(e.value).startswith(f"ray_sampler argument {name}=") and spec.text in str(e.value), (name, v)
    for args, word in (({"stream": 3, "num_streams": 3}, "stream=3"), ({"up": [0.0, 0.0, 0.0]}, "up="),
                       ({"start": INT64_MAX, "rays": 2}, "start="),
                       ({"global_pixels": 100, "shard_begin": 100}, "shard_begin=100")):
        with pytest.raises(ConfigError, match=re.escape(word)):
            check_op_args(args)


def test_ray_pipeline_checks_before_dali():
    """ray_pipeline refuses before it imports DALI or touches the cache (a placeholder here)."""
    for kw, word in ((dict(rays_per_run=2**31), "rays=2147483648"), (dict(seed=2**63), "seed=9223372036854775808"),
                     (dict(seed=-1), "seed=-1"), (dict(first_start=-2), "start=-2"), (dict(mode="sorted"), "mode=")):
        args = dict(rays_per_run=64, mode="random", seed=0, stream=0, num_streams=1) | kw
        with pytest.raises(ConfigError, match=re.escape(word)):
            ray_pipeline(object(), RayGraph(args.pop("rays_per_run"), **args))


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    return tiny_scene(tmp_path_factory.mktemp("num"), n=2, width=12, height=8, kinds=("png_rgb",))


def test_sources_name_the_argument(scene):
    """The library API (RayLoader, SpatialRayLoader, the baselines): one line naming the argument
    and its range, before decoding or building anything."""
    from dali_nerf.config import PartitionConfig
    from dali_nerf.partition import Partition
    from dali_nerf.sources import RayLoader, SpatialRayLoader, SyncLocalSampler
    from dali_nerf.sources.sync import RoutedSyncLocal

    cases = [(dict(rays_per_batch=2**31), "rays_per_batch=2147483648: must be an integer in [1, 2147483647]"),
             (dict(seed=2**63), "seed=9223372036854775808: must be an integer in [0, 9223372036854775807]"),
             (dict(seed=-3), "seed=-3: must be an integer in [0, "),
             (dict(world_size=2**31), "world_size=2147483648: must be an integer in [1, 2147483647]"),
             (dict(prefetch=10**6), "prefetch=1000000: must be an integer in [0, 1024]")]
    for kw, msg in cases:
        for cls in (RayLoader, SyncLocalSampler):
            with pytest.raises(ConfigError) as e:
                cls(scene, **dict(dict(rays_per_batch=64), **kw))
            assert msg in str(e.value) and "\n" not in str(e.value), (cls, kw, str(e.value))
    # K steps of B rays per op run must fit the op's int32 even when B alone does
    with pytest.raises(ConfigError, match=r"rays_per_run=2147483650 \(2 steps of rays_per_batch=1073741825\): over the op's limit"):
        RayLoader(scene, rays_per_batch=2**30 + 1, rays_per_run=2**30 + 2)
    # within the op's int32 but not within memory: refused with the numbers, not a bad_alloc in C++
    with pytest.raises(ConfigError, match=r"rays_per_batch=1073741824: 4 runs of 1073741824 rays in flight need 272\.0 GiB"):
        RayLoader(scene, rays_per_batch=2**30, prefetch=2)
    part = Partition.from_config(PartitionConfig(grid=[2, 1]), scene)
    for kw, msg in ((dict(rays_per_batch=0), "rays_per_batch=0: must be an integer in [1, "),
                    (dict(seed=2**64), "seed=18446744073709551616"), (dict(mode="iid"), "mode='iid'")):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            SpatialRayLoader(scene, part, 0, **kw)
    with pytest.raises(ConfigError, match=re.escape("seed=9223372036854775808")):
        RoutedSyncLocal(scene, part, 0, seed=2**63)


def test_the_largest_seed_samples(scene):
    """The top of the range works end to end: the op takes seed 2**63 - 1 (int64), and every seed
    derived from it fits where it is used (torch generators)."""
    import torch

    from dali_nerf.data.seeds import init_seed, step_seed
    from dali_nerf.sources import RayLoader

    top = INT64_MAX
    with RayLoader(scene, rays_per_batch=64, rays_per_run=128, seed=top, num_threads=1) as L:
        assert next(L)["rgb"].shape == (64, 3)
    for cell in (None, 0, 63):
        torch.manual_seed(init_seed(top, cell))  # an SS sub-model's seed above 2**64 is reduced, not refused
    torch.Generator().manual_seed(step_seed(top, 7, 10**9, 63))
    assert init_seed(5, 3) == 5 * 1009 + 3  # unchanged below 2**64


def test_the_op_limits_are_the_ops():
    """dali_nerf/ops/limits.py states the op's limits once (the config, the sources and the graphs
    read them there): the most cells is the C++ op's kMaxCells, the integers its argument types."""
    from dali_nerf.ops import limits

    header = (SCHEMA.parent / "ray_math.h").read_text()
    assert int(re.search(r"constexpr int kMaxCells = (\d+);", header).group(1)) == limits.MAX_CELLS
    assert (limits.INT32_MAX, limits.INT64_MAX) == (2**31 - 1, 2**63 - 1)
    assert OP_ARGS["cell"].hi == limits.MAX_CELLS - 1 and OP_ARGS["rays"].hi == limits.INT32_MAX

