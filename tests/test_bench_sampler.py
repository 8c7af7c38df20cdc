"""`dali-nerf bench sampler` end to end on a tiny generated scene (a smoke test of the table: the
rates themselves are benchmarks, never asserted on)."""

import subprocess
import sys

from dali_nerf.scenegen import make_scene


def test_bench_sampler_table_with_ss_row(tmp_path):
    make_scene("objects", tmp_path / "s", width=32, height=24, n_train=6, n_val=1, n_test=1, seed=0)
    out = tmp_path / "table.md"
    r = subprocess.run([sys.executable, "-m", "dali_nerf", "bench", "sampler", "--scene", str(tmp_path / "s"),
                        "--batches", "256", "--seconds", "0.05", "--rounds", "2", "--decode-images", "3", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    table = out.read_text()
    assert "| 256 | " in table and "torch_gather" in table and "JPEG" in table
    assert "SS at 256 rays/step: SpatialRayLoader" in table and "of RayLoader" in table
    assert "the best of 2 interleaved rounds" in table


def test_bench_sampler_bad_flag_is_one_line():
    r = subprocess.run([sys.executable, "-m", "dali_nerf", "bench", "sampler", "--decode-images", "0",
                        "--batches", "64"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "--decode-images" in r.stderr and "Traceback" not in r.stderr


def test_bench_sampler_bad_rounds_is_one_line():
    r = subprocess.run([sys.executable, "-m", "dali_nerf", "bench", "sampler", "--rounds", "0", "--batches", "64"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "--rounds" in r.stderr and "Traceback" not in r.stderr


def test_bench_sampler_mask_comparison_runs(tmp_path):
    """``--mask 0.5``: the masked-vs-unmasked table of RayLoader (run in-process: the rates are never
    asserted on); a fraction outside (0, 1) is one line."""
    from types import SimpleNamespace

    import pytest

    from dali_nerf.bench import sampler
    from dali_nerf.errors import ConfigError

    make_scene("objects", tmp_path / "s", width=32, height=24, n_train=6, n_val=1, n_test=1, seed=0)
    out = tmp_path / "mask.md"
    args = SimpleNamespace(scene=str(tmp_path / "s"), batches="256", seconds=0.05, rounds=2, decode_images=3,
                           stream="global", mask=0.5, mask_kind="iid", out=str(out))
    assert sampler.main(args) == 0
    table = out.read_text()
    assert "| 256 | " in table and "masked cost per ray" in table and "masks iid" in table
    assert "per round: median (min-max)" in table
    with pytest.raises(ConfigError, match=r"--mask 1.5: the masked fraction must be in \(0, 1\)"):
        sampler.main(SimpleNamespace(**{**vars(args), "mask": 1.5}))


def test_mask_cost_row_pairs_each_rounds_runs():
    """The per-round cost pairs round r's unmasked and masked rates (not the best of each): rounds
    (10, 5) and (6, 6) give 2.00x and 1.00x, median 1.50x; the best rates give 10/6 = 1.67x."""
    import pytest

    from dali_nerf.bench.masked import cost_row

    assert cost_row(4096, [10e6, 6e6], [5e6, 6e6]) == "| 4096 | 10.0 | 6.0 | 1.67x | 1.50x (1.00-2.00) |"
    with pytest.raises(ValueError, match="one pair per round"):
        cost_row(4096, [1.0], [])
