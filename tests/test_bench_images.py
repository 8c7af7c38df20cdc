"""``dali-nerf bench images`` on a tiny scene: our path and the per-process cache path measured by
real rank processes (the spawned-worker path costs four interpreter starts a rank: its dataset
item is checked here against gsplat's, the path itself runs in the lead's benchmark), the node
sums, the trial spread and the report."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from dali_nerf.bench.images import _ratios, _table, run_pair, summarise, synthetic_colmap
from dali_nerf.bench.imagepaths import GsplatStyleDataset, rank_main
from dali_nerf.scenes import load_scene

from _gsplat_reference import GsplatReference


def test_ours_and_the_cache_path_measure_a_node(tmp_path):
    scene = synthetic_colmap(tmp_path / "scene", 10, 48, 32, seed=3)
    args = argparse.Namespace(batches=12, warmup=1, step_ms=2.0, seed=0, timeout=600)
    (tmp_path / "sync").mkdir()
    node = {}
    for path, ranks in (("ours", 1), ("cache", 1)):
        if path == "ours":  # in this process (one rank: no share to set up); the cache path as the command runs it
            threads = torch.get_num_threads()
            try:  # rank_main sets one torch thread, as for a rank process
                rows = [rank_main(0, 1, "ours", str(scene), str(tmp_path / "ours.json"), str(tmp_path / "sync"), 12, 1, 2.0, 0)]
            finally:
                torch.set_num_threads(threads)
        else:
            rows = run_pair(path, ranks, scene, tmp_path, args, f"{path}{ranks}")
        assert [r["rank"] for r in rows] == list(range(ranks)) and all(r["path"] == path for r in rows)
        assert all(r["first_batch_s"] > 0 and r["images_per_s"] > 0 and 0 <= r["stall"] < 1 for r in rows)
        assert all(r["pss_bytes"] > 10 << 20 for r in rows)  # an interpreter with torch at least
        node[f"{path}/{ranks}"] = {"first_batch_s": 1.0, "images_per_s": sum(r["images_per_s"] for r in rows),
                                   "stall": 0.01, "pss_bytes": sum(r["pss_bytes"] for r in rows)}
    s = summarise([node, {k: dict(v, first_batch_s=3.0) for k, v in node.items()}])
    assert s["ours/1"]["first_batch_s"] == {"mean": 2.0, "min": 1.0, "max": 3.0, "trials": 2}
    table = _table(s, [1, 2])
    assert "| ours | 1 | 2.00 (1.00-3.00) |" in table and "| cache | 1 |" in table and "| workers" not in table
    r = _ratios(s, [1, 2])
    assert set(r) == {"pss_ours_over_cache/1", "stall_ours/1"} and r["stall_ours/1"] == 0.01


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
