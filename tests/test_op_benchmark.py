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
