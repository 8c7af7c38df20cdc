"""``dali-nerf bench loop`` (the training loop per source against a ready-batch floor) and
``dali-nerf bench decode`` on the CPU at tiny sizes: the outputs' schema, the rotation of the
sources, the device step the emulated study reads, and numbers kept when a run is cut short."""

from __future__ import annotations

import json

import pytest

from dali_nerf.bench import decode, loop
from dali_nerf.config import load_config
from dali_nerf.errors import ConfigError

TINY = ["model.resolution=12", "model.samples_per_ray=8", "model.occupancy_resolution=8", "model.hidden=8",
        "model.density_components=2", "model.color_components=4", "pipeline.rays_per_run=512", "pipeline.workers=1",
        "pipeline.num_threads=1"]
B = 128


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    from dali_nerf.scenegen import make_scene

    return make_scene("objects", tmp_path_factory.mktemp("loop") / "scene", width=24, height=24, n_train=6,
                      n_val=1, n_test=1, seed=2)


@pytest.fixture(scope="module")
def result(scene, tmp_path_factory):
    out = tmp_path_factory.mktemp("loop_out")
    cfg = load_config("configs/ddp_blender_gpu.yaml", [f"scene.path={scene}", *TINY])
    res = loop.run_loop(cfg, out, [B], list(loop.SAMPLERS), ["host", "device"], trials=2, steps=2, warmup=1,
                        pretrain=2, device="cpu", command="test", log=lambda *_: None)
    return out, res


def test_outputs_schema_and_rotation(result):
    out, res = result
    assert json.loads((out / "loop.json").read_text()) == json.loads(json.dumps(res))
    meta = res["meta"]
    assert meta["phase_timing"] == "host" and meta["trials"] == 2 and meta["grad_bytes"] > 0
    assert any("device placement" in s and "no GPU" in s for s in meta["skipped"])
    segs = res["segments"]
    assert {s["placement"] for s in segs} == {"host"}
    for t in (0, 1):
        order = [s["sampler"] for s in sorted((s for s in segs if s["trial"] == t), key=lambda s: s["order"])]
        assert sorted(set(order)) == sorted(loop.SAMPLERS) and order.count("ready") == 1, order
        for i, name in enumerate(order):  # every baseline runs next to a pipelined run
            if name not in ("rays", "ready"):
                assert "rays" in order[max(0, i - 1):i + 2], order
    orders = [[s["sampler"] for s in sorted(segs, key=lambda s: s["order"]) if s["trial"] == t and s["sampler"] != "ready"]
              for t in (0, 1)]
    assert orders[0] != orders[1]  # the sources' order rotates between trials (and the floor's place)
    for s in segs:
        assert s["rays"] == B and s["step_s"] > 0 and 0 <= s["wait_s"] <= s["step_s"]
        assert s["stall"] == pytest.approx(s["wait_s"] / s["step_s"])
        assert set(s["phases_s"]) == {"wait", "h2d", "forward", "backward", "sync", "optimizer"}
        assert s["compute_s"] == pytest.approx(sum(s["phases_s"][p] for p in ("forward", "backward", "optimizer")))
        if s["sampler"] == "rays_sync":  # whole DALI runs of 512 / 128 = 4 steps, from a run boundary
            assert s["steps"] % 4 == 0 and s["warmup"] % 4 == 0 and s["steps"] >= 2
        else:
            assert (s["steps"], s["warmup"]) == (2, 1)
    rows = {r["sampler"]: r for r in res["rows"]}
    assert set(rows) == set(loop.SAMPLERS)
    assert rows["ready"]["step_over_floor"] == 1.0 and "pipelined_speedup" not in rows["ready"]
    assert "pipelined_speedup" not in rows["rays"] and rows["sync_local"]["pipelined_speedup"] > 0
    for r in rows.values():
        assert r["trials"] == 2 and r["step_ms_ci"][0] <= r["step_ms"] <= r["step_ms_ci"][1]
    floors = [s for s in segs if s["sampler"] == "ready"]
    (d,) = res["device_steps"]
    assert d["rays"] == B and d["trials"] == 2
    assert d["compute_ms"] == pytest.approx(1e3 * sum(s["compute_s"] for s in floors) / 2)
    assert d["ms_per_4096"] == pytest.approx(d["compute_ms"] * 4096 / B)
    md = (out / "loop.md").read_text()
    assert md.count("| host | 128 |") == len(loop.SAMPLERS) and "per 4096 rays" in md


def test_read_device_step(result, tmp_path):
    out, res = result
    d = loop.read_device_step(out / "loop.json", B)
    assert d["ms_per_4096"] == res["device_steps"][0]["ms_per_4096"] and d["grad_bytes"] == res["meta"]["grad_bytes"]
    assert "measured" in d["source"] and "a CPU, not a GPU" in d["source"] and str(out / "loop.json") in d["source"]
    with pytest.raises(ConfigError, match=r"no device step at 999 rays \(it has: 128\)"):
        loop.read_device_step(out / "loop.json", 999)
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ConfigError, match="x.json is not the loop.json"):
        loop.read_device_step(tmp_path / "x.json", B)
    with pytest.raises(ConfigError, match="not found; run dali-nerf bench loop"):
        loop.read_device_step(tmp_path / "none.json", B)


def test_a_run_cut_short_keeps_what_it_measured(scene, tmp_path):
    cfg = load_config("configs/ddp_blender_gpu.yaml", [f"scene.path={scene}", *TINY])
    seen = []

    def log(line):
        if "step" in line and "B=" in line:
            seen.append(line)
            if len(seen) == 2:
                raise KeyboardInterrupt  # the step's time limit: the process is stopped here
    with pytest.raises(KeyboardInterrupt):
        loop.run_loop(cfg, tmp_path, [B], ["sync_local", "rays"], ["host"], trials=3, steps=2, warmup=1, pretrain=0,
                      device="cpu", command="test", log=log)
    res = json.loads((tmp_path / "loop.json").read_text())
    assert len(res["segments"]) == 2 and len(res["rows"]) == 2
    assert (tmp_path / "loop.md").is_file()


def test_cli_errors_are_one_line(monkeypatch, capsys, scene):
    from dali_nerf.cli.main import main

    monkeypatch.setenv("OPENCV_LOG_LEVEL", "ERROR")
    for args, msg in ((["--batches", "12,x"], "--batches '12,x'"), (["--trials", "0"], "--trials 0: must be >= 1"),
                      (["--placements", "gpu"], "--placements: 'gpu'"), (["--samplers", "nope"], "unknown source 'nope'")):
        assert main(["bench", "loop", "--scene", str(scene), "--device", "cpu", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and msg in err and len(err.splitlines()) == 1, err


def test_decode_rates(tmp_path):
    import torch

    res = decode.measure(["jpg", "png", "jpg_gray"], n=3, size=32, threads=[1], reps=1, out=tmp_path,
                         log=lambda *_: None)
    rows = [(r["format"], r["decoder"], r["threads"]) for r in res["rows"]]
    if torch.cuda.is_available():
        assert rows == [("jpg", "cpu", 1), ("jpg", "mixed (nvJPEG)", 1), ("png", "cpu", 1), ("png", "mixed", 1),
                        ("jpg_gray", "OpenCV", 1), ("jpg_gray", "OpenCV, GPU finish", 1)]
        assert res["skipped"] == []
    else:
        assert rows == [("jpg", "cpu", 1), ("png", "cpu", 1), ("jpg_gray", "OpenCV", 1)]
        assert res["skipped"] == ["mixed (nvJPEG) decoder: no GPU visible to torch"]
    assert all(r["images_per_s"] > 0 for r in res["rows"])
    assert json.loads((tmp_path / "decode.json").read_text()) == res
    from dali_nerf.bench.sampler import synthetic_images
    from dali_nerf.data.imageio import read_header

    gray = synthetic_images(tmp_path, "jpg_gray", n=1, size=16)  # what jpg_gray measures: 1-component JPEGs
    h = read_header(gray.image_paths[0])
    assert (h.format, h.channels, h.decoder) == ("jpeg", 1, "opencv")
