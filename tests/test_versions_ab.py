"""benchmarks/versions_ab.py runs its pairs: with one Python as both versions, each row's pairs
alternate, every measurement is a fresh process of that Python's dali_nerf, ratios are new / old."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

from dali_nerf.scenegen import make_scene

REPO = Path(__file__).resolve().parents[1]


def _harness():
    spec = importlib.util.spec_from_file_location("versions_ab", REPO / "benchmarks" / "versions_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    return ab


def _scene(tmp_path) -> str:
    return str(make_scene("objects", tmp_path / "scene", width=24, height=24, n_train=4, n_val=1, n_test=1, seed=3))


def test_the_harness_pairs_two_pythons(tmp_path, capsys):
    ab = _harness()
    out = tmp_path / "ab.json"
    assert ab.main(["--old-python", sys.executable, "--scene", _scene(tmp_path), "--pairs", "2", "--seconds", "0.2",
                    "--rows", "global:256", "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert r["stream"] == "global" and r["rays"] == 256 and len(r["ratios"]) == 2
    assert all(x > 0 for x in r["ratios"]) and r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"]
    assert len(r["modules"]) == 1 and r["modules"][0].endswith("dali_nerf/__init__.py")  # one version, both sides
    printed = capsys.readouterr().out
    assert "global 256 pair 1:" in printed and "| global | 256 |" in printed


def test_the_masked_harness_reports_both_rates_and_the_cost(tmp_path, capsys):
    ab = _harness()
    out = tmp_path / "ab.json"
    assert ab.main(["--old-python", sys.executable, "--scene", _scene(tmp_path), "--pairs", "2", "--seconds", "0.2",
                    "--rows", "shard:256", "--mask", "0.5", "--rounds", "2", "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert len(r["ratios"]) == len(r["none_ratios"]) == len(r["new_cost"]) == len(r["old_cost"]) == 2
    for pair in r["processes"]:
        for p in pair.values():
            rounds = p["rounds"]
            assert len(rounds["none"]) == len(rounds["masked"]) == 2
            assert 0.35 < p["valid_share"] < 0.65  # the masked side really drew from half the pixels
            # the reported rates are the best rounds of each side, the cost unmasked / masked per round
            assert p["rays_per_s"] == max(rounds["masked"]) and p["none_per_s"] == max(rounds["none"])
            assert p["cost"] == statistics.median(a / b for a, b in zip(rounds["none"], rounds["masked"]))
    for i, pair in enumerate(r["processes"]):
        assert r["ratios"][i] == pair["new"]["rays_per_s"] / pair["old"]["rays_per_s"]
        assert r["none_ratios"][i] == pair["new"]["none_per_s"] / pair["old"]["none_per_s"]
    printed = capsys.readouterr().out
    assert "unmasked ratio" in printed and "| shard | 256 |" in printed and "masks: iid, 50%" in printed


def test_mask_options_go_together(tmp_path, capsys):
    ab = _harness()
    for argv in (["--mask-kind", "sky"], ["--rounds", "2"], ["--mask", "0.5", "--yield-gil"], ["--mask", "1.5"]):
        try:
            ab.main(["--old-python", sys.executable, *argv])
        except SystemExit as e:
            assert e.code == 2, argv
        else:
            raise AssertionError(f"{argv} was accepted")
        assert "error:" in capsys.readouterr().err
