"""benchmarks/op_throughput.py runs end to end (a smoke test: tiny cache, short rounds; the
numbers it prints are benchmarks, never asserted on)."""

import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "op_throughput.py"


def test_op_throughput_interleaved_modes(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--images", "4", "--res", "32", "--rays", "512",
                                      "--seconds", "0.08", "--threads", "1"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"random", "epoch", "routed 2x2 (cell 0)", "routed / random"} <= set(rows)
    acc = float(rows["routed 2x2 (cell 0)"].split("|")[5])
    assert 0.0 < acc < 1.0  # routing rejected some candidates and accepted others


def test_op_throughput_route_tile_sweep(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--images", "4", "--res", "32", "--rays", "512",
                                      "--seconds", "0.08", "--threads", "1", "--modes", "random,routed",
                                      "--route-tile", "0,8"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for t in (0, 8):
        assert {f"routed 2x2 (cell 0, route_tile {t})", f"routed / random, route_tile {t}"} <= set(rows)
    for t in (0, 8):
        assert 0.0 < float(rows[f"routed 2x2 (cell 0, route_tile {t})"].split("|")[5]) < 1.0


def test_op_throughput_per_rank_vs_global_stream(capsys, monkeypatch):
    """``--worlds``: one row per (mode, W) comparing the per-rank stream with the global stream on
    the same cache; the global stream's runs keep about ``rays`` rays of W x ``rays`` positions."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--images", "4", "--res", "32", "--rays", "512",
                                      "--seconds", "0.08", "--threads", "1", "--modes", "random,epoch",
                                      "--worlds", "1,3"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert sorted((r[0].strip(), int(r[1])) for r in rows) == [("epoch", 1), ("epoch", 3), ("random", 1), ("random", 3)]
    for r in rows:
        assert all(float(v) > 0 for v in r[3:7]) and r[7].strip().endswith("%")


def test_op_throughput_counts_the_rays_a_global_run_keeps():
    """The comparison's global runner counts the rays its runs emit (about 1/W of the positions
    it walks), not the positions: its acceptance is about 1/W, the per-rank one's 1."""
    bench = runpy.run_path(str(SCRIPT))
    from dali_nerf.ops import load_plugin

    load_plugin(cuda=False)
    cache = bench["make_cache"](4, 32)
    res = bench["compare_streams"](cache, 2048, ["epoch"], [4], 0.05, 1, False, rounds=2)
    per_rank, glob = res[("epoch", 4)]
    assert per_rank[1] == 1.0
    assert abs(glob[1] - 0.25) < 0.01  # kept / walked: the shard is a quarter of the split
