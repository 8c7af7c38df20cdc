"""``dali-nerf bench images`` on a tiny scene: our path and the per-process cache path measured by
real rank processes (the spawned-worker path costs four interpreter starts a rank: its dataset
item is checked here against gsplat's, the path itself runs in the lead's benchmark), the node
sums, the trial spread and the report."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch

from dali_nerf.bench.images import _node, _ratios, _table, run_pair, summarise, synthetic_colmap
from dali_nerf.bench.imagepaths import GsplatStyleDataset, rank_main
from dali_nerf.scenes import load_scene

from _gsplat_reference import GsplatReference


def test_ours_and_the_cache_path_measure_a_node(tmp_path):
    scene = synthetic_colmap(tmp_path / "scene", 16, 48, 32, seed=3)
    n = load_scene(scene, "train", format="colmap").num_images
    assert n > 1 + 1 + 2 * 4  # the first phase's batches are not a whole epoch: the steady phase must run on
    args = argparse.Namespace(batches=4, warmup=1, step_ms=2.0, seed=0, timeout=600)
    (tmp_path / "sync").mkdir()
    rows = {}
    for path, ranks in (("ours", 1), ("cache", 1)):
        if path == "ours":  # in this process (one rank: no share to set up); the cache path as the command runs it
            threads = torch.get_num_threads()
            try:  # rank_main sets one torch thread, as for a rank process
                got = [rank_main(0, 1, "ours", str(scene), str(tmp_path / "ours.json"), str(tmp_path / "sync"), 4, 1, 2.0, 0)]
            finally:
                torch.set_num_threads(threads)
        else:
            got = run_pair(path, ranks, scene, tmp_path, args, f"{path}{ranks}")
        assert [r["rank"] for r in got] == list(range(ranks)) and all(r["path"] == path for r in got)
        for r in got:
            assert r["first_batch_s"] > 0 and r["images_per_s"] > 0 and 0 <= r["stall"] < 1
            assert r["steady_images_per_s"] > 0 and 0 <= r["steady_stall"] < 1
            assert r["pss_bytes"] > 10 << 20 and r["steady_pss_bytes"] > 10 << 20  # an interpreter with torch at least
            assert r["steady_served"] >= n  # the steady phase starts after a whole epoch
            maps = r["steady_pss_maps"]  # the steady PSS by mapping: the interpreter's heap at least
            assert maps and "[heap]" in maps and sum(maps.values()) <= r["steady_pss_bytes"] + (1 << 20)
        assert got[0]["steady_decode_closed"] is (True if path == "ours" else None)
        rows[path] = got
    # the node's numbers of each regime come from that regime's rank numbers
    two = [dict(rows["cache"][0], rank=0), dict(rows["cache"][0], rank=1, steady_images_per_s=7.0, steady_stall=0.5,
                                                   steady_pss_bytes=3 << 20)]
    node = _node(two)
    assert node["steady_images_per_s"] == rows["cache"][0]["steady_images_per_s"] + 7.0
    assert node["steady_stall"] == (rows["cache"][0]["steady_stall"] + 0.5) / 2
    assert node["steady_pss_bytes"] == rows["cache"][0]["steady_pss_bytes"] + (3 << 20)
    assert node["images_per_s"] == 2 * rows["cache"][0]["images_per_s"] and node["pss_bytes"] == 2 * rows["cache"][0]["pss_bytes"]
    one = {f"{p}/1": _node(rows[p]) for p in rows}
    s = summarise([one, {k: dict(v, first_batch_s=v["first_batch_s"] + 2.0, steady_stall=0.25) for k, v in one.items()}])
    o = s["ours/1"]
    assert o["first_batch_s"]["max"] - o["first_batch_s"]["min"] == pytest.approx(2.0) and o["first_batch_s"]["trials"] == 2
    assert o["steady_stall"]["max"] == 0.25 and o["steady_stall"]["min"] == rows["ours"][0]["steady_stall"]
    table = _table(s, [1, 2])
    head = table.splitlines()[0]
    assert "images/s, steady" in head and "stall, steady" in head and "PSS, steady (MiB)" in head
    line = next(l for l in table.splitlines() if l.startswith("| ours | 1 |"))
    steady_mib = o["steady_pss_bytes"]["mean"] / 2**20
    assert line.rstrip(" |").endswith(f"{steady_mib:.0f} ({steady_mib:.0f}-{steady_mib:.0f})")
    assert "| cache | 1 |" in table and "| workers" not in table
    r = _ratios(s, [1, 2])
    assert set(r) == {"pss_ours_over_cache/1", "stall_ours/1", "steady_pss_ours_over_cache/1", "steady_stall_ours/1"}
    assert r["steady_pss_ours_over_cache/1"] == o["steady_pss_bytes"]["mean"] / s["cache/1"]["steady_pss_bytes"]["mean"]


def test_the_gsplat_style_item_is_gsplats(tmp_path):
    root = synthetic_colmap(tmp_path / "s", 9, 40, 24, seed=1)
    ref = GsplatReference(root, 1)
    ds = GsplatStyleDataset(load_scene(root, "train", format="colmap"))
    cached = GsplatStyleDataset(load_scene(root, "train", format="colmap"), cache=True)
    for i in range(len(ref)):
        want, got, c = ref.item(i), ds[i], cached[i]
        assert np.array_equal(got["image"].numpy(), want["image"]) and got["image"].numpy().dtype == want["image"].dtype
        assert np.array_equal(c["image"].numpy(), want["image"].astype(np.uint8))
        assert np.array_equal(got["K"].numpy(), want["K"]) and np.array_equal(got["camtoworld"].numpy(), want["camtoworld"])


def test_the_bench_compiles_dali_nerf_into_a_bytecode_cache_its_ranks_read(tmp_path, monkeypatch):
    """Every rank and worker of every path starts by importing dali_nerf: the bench lays it out
    outside the checkout as an install has it (the package and the folders a checkout keeps beside
    it: pipelines, trainers, configs) and compiles it there first, so that none compiles a module
    per start; a rank imports every dali_nerf module it uses from that copy, finds the shipped
    configs there, and runs with no pycache prefix (under one, torch's and DALI's own bytecode is
    not read either), even when the bench's own environment has one."""
    import importlib.util
    import subprocess
    import sys

    from dali_nerf.bench.images import bytecode_cached, rank_env

    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "prefix"))
    lib = tmp_path / "lib"
    assert bytecode_cached(lib)
    env = {**rank_env(lib), "PYTHONDONTWRITEBYTECODE": "1"}
    assert "PYTHONPYCACHEPREFIX" not in env
    code = ("import importlib.util, json, sys, torch, dali_nerf.bench.imagepaths, dali_nerf.sources.images, "
            "dali_nerf.pipelines.decode\n"
            "from dali_nerf.config import shipped_configs\n"
            "mods = {n: getattr(m, '__file__', None) for n, m in list(sys.modules.items()) if n.startswith('dali_nerf')}\n"
            "print(json.dumps({'mods': mods, 'prefix': sys.pycache_prefix, 'configs': [str(p) for p in shipped_configs().values()],"
            " 'torch': importlib.util.cache_from_source(torch.__file__)}))")
    out = __import__("json").loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                                  check=True, cwd=lib).stdout)  # as the ranks run (run_pair)
    assert out["prefix"] is None
    files = {n: Path(f) for n, f in out["mods"].items() if f}
    assert "dali_nerf.pipelines.decode" in files and len(files) > 20
    outside = {n: str(f) for n, f in files.items() if lib not in f.parents}
    assert not outside, outside  # every module from the copy
    for n, f in files.items():  # each with the bytecode the bench wrote (the rank could not write it)
        assert Path(importlib.util.cache_from_source(str(f))).is_file(), n
    assert out["configs"] and all(lib in Path(c).parents for c in out["configs"])
    torch_cached = Path(out["torch"])
    assert torch_cached.parent.name == "__pycache__" and lib not in torch_cached.parents
