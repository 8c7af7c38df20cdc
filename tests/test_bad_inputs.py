"""The bad-input catalogue (docs/RELIABILITY.md): every user mistake is ONE line naming the file or
field and what to do, exit code 2 from the CLI and the trainers, no traceback, raised before
training starts, and nothing already written is damaged.

Most cases go through the real trainer entry point in-process (``dali_nerf.trainers.ddp.main``,
world size 1: it fails before any DALI pipeline is built, so each case costs milliseconds); a few
go through the real CLIs in a subprocess (exit code, stderr, no "Traceback"). Scenes are generated
with ``dali_nerf.scenegen`` into tmp_path and then damaged the way users damage them.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from dali_nerf.train.checkpoint import commit_checkpoint, latest_checkpoint, load_rank_state, save_rank_state
from dali_nerf.config import load_config
from dali_nerf.errors import ConfigError, DaliNerfError, DataError, SceneError
from dali_nerf.scenegen import make_scene
from dali_nerf.scenes import load_scene
from dali_nerf.trainers.ddp import main as ddp_main

W = H = 24  # generated image size


# ------------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    """Pristine generated scenes (copied per test): Blender PNG (RGBA) and Blender JPEG."""
    root = tmp_path_factory.mktemp("pristine")
    png = make_scene("objects", root / "png", width=W, height=H, n_train=6, n_val=1, n_test=2)
    jpg = make_scene("objects", root / "jpg", width=W, height=H, n_train=6, n_val=1, n_test=2, image_format="jpeg")
    return {"png": Path(png), "jpg": Path(jpg)}


def scene_copy(scenes, tmp_path, kind="png") -> Path:
    dst = tmp_path / f"scene_{kind}"
    shutil.copytree(scenes[kind], dst)
    return dst


def write_config(tmp_path, scene, extra: str = "", name="c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(
        f"name: run\nmethod: ddp\nscene:\n  path: {scene}\n"
        f"pipeline:\n  rays_per_batch: 64\n  rays_per_run: 256\n"
        f"model:\n  resolution: 8\n  samples_per_ray: 8\n  occupancy_resolution: 0\n"
        f"train:\n  steps: 2\n  checkpoint_every: 0\n  eval_images: 1\n  device: cpu\n  runs_dir: {tmp_path / 'runs'}\n"
        + extra)
    return p


def previous_run(tmp_path) -> dict:
    """Files of an earlier run in runs/run/ that a failing rerun must leave byte-identical."""
    run = tmp_path / "runs" / "run"
    (run / "checkpoints" / "step_0000004").mkdir(parents=True)
    files = {run / "config.yaml": b"name: run # earlier run\n", run / "metrics.jsonl": b'{"step": 1, "loss": 0.5}\n',
             run / "checkpoints" / "latest": b"step_0000004\n",
             run / "checkpoints" / "step_0000004" / "rank0.pt": b"earlier checkpoint bytes"}
    for p, b in files.items():
        p.write_bytes(b)
    return files


def assert_untouched(files: dict):
    for p, b in files.items():
        assert p.read_bytes() == b, f"{p} was changed by a failing run"
    run = next(iter(files)).parent
    assert sorted(q.name for q in run.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl"]


def trainer_error(capsys, cfg: Path, *overrides, files=None) -> str:
    """Run the DDP trainer entry point; it must return 2 and print exactly one ``error:`` line."""
    capsys.readouterr()
    rc = ddp_main(["--config", str(cfg), *overrides])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    if files is not None:
        assert_untouched(files)
    return lines[0]


def needles(msg: str, *words):
    for w in words:
        assert str(w) in msg, (w, msg)


def png_bytes(w, h, colour=6, depth=8) -> bytes:
    """A valid PNG written by hand (signature, IHDR, one IDAT, IEND) — independent of OpenCV."""
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    ch = {0: 1, 2: 3, 4: 2, 6: 4}[colour]
    raw = b"".join(b"\x00" + bytes(w * ch * depth // 8) for _ in range(min(h, 4)))
    ihdr = struct.pack(">IIBBBBB", w, h, depth, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def edit_json(path: Path, fn):
    meta = json.loads(path.read_text())
    fn(meta)
    path.write_text(json.dumps(meta))


# ------------------------------------------------------------------------------- scene folder / files

def test_missing_scene_folder(tmp_path, capsys):
    files = previous_run(tmp_path)
    msg = trainer_error(capsys, write_config(tmp_path, tmp_path / "nope"), files=files)
    needles(msg, "scene.path", "nope", "does not exist", "make-scene")
    with pytest.raises(SceneError, match="scene folder not found"):
        load_scene(tmp_path / "nope")


def test_unknown_format(tmp_path, capsys):
    d = tmp_path / "junk"
    d.mkdir()
    (d / "notes.txt").write_text("not a scene")
    msg = trainer_error(capsys, write_config(tmp_path, d))
    needles(msg, str(d), "unknown scene format", "transforms_train.json", "format=")
    msg = trainer_error(capsys, write_config(tmp_path, d), "scene.format=bundler")
    needles(msg, "scene.format", "bundler", "blender", "colmap")
    msg = trainer_error(capsys, write_config(tmp_path, d), "scene.format=colmap")  # a format the folder is not
    needles(msg, str(d / "sparse" / "0"), "not a COLMAP sparse model", "model_converter")


def test_malformed_json(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path)
    p = s / "transforms_train.json"
    p.write_text(p.read_text()[:-40])  # cut off: unterminated
    files = previous_run(tmp_path)
    msg = trainer_error(capsys, write_config(tmp_path, s), files=files)
    needles(msg, "transforms_train.json:", "malformed JSON", "fix the file")


def test_missing_keys(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path)
    p = s / "transforms_train.json"
    good = p.read_text()
    edit_json(p, lambda m: m.pop("camera_angle_x"))
    needles(trainer_error(capsys, write_config(tmp_path, s)), "transforms_train.json", "missing key 'camera_angle_x'")
    p.write_text(good)
    edit_json(p, lambda m: m["frames"][3].pop("transform_matrix"))
    needles(trainer_error(capsys, write_config(tmp_path, s)), "missing key 'transform_matrix'", "frames[3]")


def test_frame_image_missing(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path)
    (s / "train" / "r_4.png").unlink()
    msg = trainer_error(capsys, write_config(tmp_path, s), files=previous_run(tmp_path))
    needles(msg, "transforms_train.json", "1 of 6 images missing", "r_4.png", "restore them")


def test_empty_split(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path)
    edit_json(s / "transforms_train.json", lambda m: m.update(frames=[]))
    needles(trainer_error(capsys, write_config(tmp_path, s)), "transforms_train.json", "'frames' is empty")
    s2 = scene_copy(scenes, tmp_path / "b")
    (s2 / "transforms_test.json").unlink()  # the eval split: found before training too
    needles(trainer_error(capsys, write_config(tmp_path, s2)), "transforms_test.json", "file not found", "'test' split")


# ------------------------------------------------------------------------------- images (found by the up-front scan)

def test_corrupt_png_deep_in_list_found_before_training(scenes, tmp_path, capsys):
    """Only the last training image is bad (IHDR bit flip): the parser reads just the first header,
    so this is the trainer's up-front header scan, before any decoding or training."""
    s = scene_copy(scenes, tmp_path)
    p = s / "train" / "r_5.png"
    b = bytearray(p.read_bytes())
    b[20] ^= 0x01  # IHDR height byte: CRC mismatch
    p.write_bytes(bytes(b))
    files = previous_run(tmp_path)
    msg = trainer_error(capsys, write_config(tmp_path, s), files=files)
    needles(msg, "r_5.png", "corrupt PNG header", "checksum")


def test_corrupt_eval_image_found_before_training(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path)
    (s / "test" / "r_1.png").write_bytes(png_bytes(W, H)[:-12])  # no IEND: truncated
    files = previous_run(tmp_path)
    msg = trainer_error(capsys, write_config(tmp_path, s), files=files)
    needles(msg, "test/r_1.png", "truncated or corrupt PNG")


def test_truncated_jpeg(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path, "jpg")
    p = s / "train" / "r_3.jpg"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    msg = trainer_error(capsys, write_config(tmp_path, s), files=previous_run(tmp_path))
    needles(msg, "r_3.jpg", "truncated JPEG")


def test_image_size_differs_from_declared(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path)
    assert cv2.imwrite(str(s / "train" / "r_2.png"), np.zeros((H, W + 6, 4), np.uint8))
    msg = trainer_error(capsys, write_config(tmp_path, s))
    needles(msg, "r_2.png", f"image is {W + 6}x{H}", f"declares {W}x{H}", "resize")
    # nerfstudio declares w/h per frame: the parser's declaration is checked the same way
    from test_scenes import make_nerfstudio

    ns = tmp_path / "ns"
    make_nerfstudio(ns)
    edit_json(ns / "transforms.json", lambda m: m.update(w=30, h=20))  # shared w/h of frames without their own
    from dali_nerf.cli.validate import validate_scene

    with pytest.raises(DataError) as e:
        validate_scene(ns)
    needles(str(e.value), "images/frame_000", "image is 24x18", "declares 30x20")


def test_decompression_bomb_refused_from_header(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path)
    bomb = s / "train" / "r_5.png"
    bomb.write_bytes(png_bytes(100000, 100000))  # 10^10 pixels claimed, a few hundred bytes on disk
    assert bomb.stat().st_size < 4096
    msg = trainer_error(capsys, write_config(tmp_path, s))
    needles(msg, "r_5.png", "100000x100000", "decompression bomb")
    # JPEG: an SOF0 frame header claiming 65535 x 65535 (JPEG's maximum)
    from dali_nerf.data.imageio import check_image

    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, 65535, 65535, 3) + bytes(9)
    j = tmp_path / "bomb.jpg"
    j.write_bytes(b"\xff\xd8" + sof + b"\xff\xd9")
    with pytest.raises(DataError) as e:
        check_image(j)
    needles(str(e.value), "bomb.jpg", "65535x65535", "decompression bomb")


def test_grayscale_and_16bit_train(scenes, tmp_path, capsys):
    """Handled, not refused: 8-bit gray and 16-bit RGBA PNGs decode to the same pixels as an
    independent cv2 reference and the trainer runs on them."""
    s = scene_copy(scenes, tmp_path)
    rgba = {i: cv2.imread(str(s / "train" / f"r_{i}.png"), cv2.IMREAD_UNCHANGED) for i in (0, 2)}
    assert cv2.imwrite(str(s / "train" / "r_0.png"), cv2.cvtColor(rgba[0][:, :, :3], cv2.COLOR_BGR2GRAY))
    assert cv2.imwrite(str(s / "train" / "r_2.png"), rgba[2].astype(np.uint16) * 257 + 100)
    from dali_nerf.data.imageio import read_header
    from dali_nerf.data.imagecache import decode_cache

    assert read_header(s / "train" / "r_0.png").channels == 1
    assert read_header(s / "train" / "r_2.png").bit_depth == 16
    scene = load_scene(s, "train")
    cache = decode_cache(scene, 0, 1)
    # independent reference: cv2 decode, 16 -> 8 bit by round(v / 257), gray -> RGB, float composite over white
    for i in (0, 2):
        img = cv2.imread(str(s / "train" / f"r_{i}.png"), cv2.IMREAD_UNCHANGED)
        if img.dtype == np.uint16:
            img = np.round(img.astype(np.float64) / 257.0)
        img = img.astype(np.float64)
        if img.ndim == 2:
            ref = np.repeat(img[:, :, None], 3, axis=2)
        else:
            a = img[:, :, 3:4] / 255.0
            ref = img[:, :, 2::-1] * a + 255.0 * (1 - a)
        off = int(cache.layout[i, 0])
        got = np.asarray(cache.pixels[off:off + W * H]).reshape(H, W, 3).astype(np.float64)
        assert np.abs(got - np.floor(ref + 0.5)).max() <= 1, i
    capsys.readouterr()
    rc = ddp_main(["--config", str(write_config(tmp_path, s)), "train.steps=2"])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "runs" / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and np.isfinite(summary["final_train_loss"])


def test_resume_with_a_checkpoint_that_does_not_fit(scenes, tmp_path, capsys):
    """--resume after a config change, with another program's checkpoint, or with none: one line,
    and the run's checkpoint is left as it was."""
    s = scene_copy(scenes, tmp_path)
    cfg = write_config(tmp_path, s)
    needles(trainer_error(capsys, cfg, "--resume"), "checkpoints", "no checkpoint to resume from", "without --resume")
    capsys.readouterr()
    assert ddp_main(["--config", str(cfg), "train.steps=2"]) == 0, capsys.readouterr().err
    ck = tmp_path / "runs" / "run" / "checkpoints"
    files = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    msg = trainer_error(capsys, cfg, "--resume", "train.steps=4", "model.resolution=12")
    needles(msg, "step_0000002", "does not match this run's config", "size mismatch", "saved with")
    assert {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()} == files
    torch.save({"weights": torch.ones(3)}, ck / "step_0000002" / "run.pt")  # someone else's file
    needles(trainer_error(capsys, cfg, "--resume", "train.steps=4"), "run.pt", "not a dali_nerf training checkpoint",
            "no step, world_size, method, ranks")
    (ck / "step_0000002" / "run.pt").write_bytes(b"PK\x03\x04 truncated zip")
    needles(trainer_error(capsys, cfg, "--resume", "train.steps=4"), "run.pt", "not a readable dali_nerf checkpoint")


# ------------------------------------------------------------------------------- poses, intrinsics, bounds

def test_nan_or_inf_in_pose(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path)
    p = s / "transforms_train.json"
    good = p.read_text()
    for v in (float("nan"), float("inf")):
        p.write_text(good)
        # json.dumps writes NaN / Infinity, which is what exporters emit and Python's json reads back
        edit_json(p, lambda m: m["frames"][2]["transform_matrix"][0].__setitem__(3, v))
        needles(trainer_error(capsys, write_config(tmp_path, s)), "transforms_train.json", "r_2", "non-finite pose")


def test_rotation_not_orthonormal(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path)
    def scale(m):
        t = np.asarray(m["frames"][1]["transform_matrix"])
        t[:3, :3] *= 1.05
        m["frames"][1]["transform_matrix"] = t.tolist()
    edit_json(s / "transforms_train.json", scale)
    needles(trainer_error(capsys, write_config(tmp_path, s)), "r_1", "non-orthonormal rotation", "without scale")
    s2 = scene_copy(scenes, tmp_path / "b")
    def mirror(m):
        t = np.asarray(m["frames"][0]["transform_matrix"])
        t[:3, 0] *= -1
        m["frames"][0]["transform_matrix"] = t.tolist()
    edit_json(s2 / "transforms_train.json", mirror)
    needles(trainer_error(capsys, write_config(tmp_path, s2)), "r_0", "left-handed")


def test_zero_or_negative_focal(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path)
    for v in (0.0, -0.7):
        edit_json(s / "transforms_train.json", lambda m: m.update(camera_angle_x=v))
        needles(trainer_error(capsys, write_config(tmp_path, s)), "transforms_train.json", "camera_angle_x", "(0, pi)")
    from test_scenes import make_nerfstudio

    ns = tmp_path / "ns"
    make_nerfstudio(ns)
    for v in (0.0, -20.0):
        edit_json(ns / "transforms.json", lambda m: m.update(fl_x=v))
        with pytest.raises(SceneError) as e:
            load_scene(ns, "train")
        needles(str(e.value), "transforms.json", f"fx={v:g}", "focal lengths must be > 0")


def test_llff_bounds_wrong_shape(tmp_path):
    from test_scenes import make_llff

    make_llff(tmp_path)
    pb = tmp_path / "poses_bounds.npy"
    good = np.load(pb)
    swapped = good.copy()
    swapped[:, [15, 16]] = swapped[:, [16, 15]]  # far < near
    for bad, words in ((good[:, :16], ("(10, 16)", "(N, 17)")), (good.reshape(-1), ("(170,)", "(N, 17)")),
                       (swapped, ("invalid bounds", "near"))):
        np.save(pb, bad)
        with pytest.raises(SceneError) as e:
            load_scene(tmp_path, "train")
        needles(str(e.value), "poses_bounds.npy", *words)
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------- config

def test_config_unknown_key_wrong_type_negative_rays(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path)
    files = previous_run(tmp_path)
    cfg = write_config(tmp_path, s, "bogus_section:\n  x: 1\n")
    needles(trainer_error(capsys, cfg, files=files), "c.yaml", "bogus_section: unknown key", "valid keys")
    cfg = write_config(tmp_path, s)
    needles(trainer_error(capsys, cfg, "pipeline.rays_per_bach=64", files=files), "pipeline.rays_per_bach: unknown key", "rays_per_batch")
    needles(trainer_error(capsys, cfg, "train.steps=ten"), "train.steps: expected an integer", "'ten'")
    needles(trainer_error(capsys, cfg, "pipeline.rays_per_batch=-4096"), "pipeline.rays_per_batch: must be in [1, 2147483647], got -4096")
    needles(trainer_error(capsys, cfg, "train.lr=0"), "train.lr: must be > 0")
    needles(trainer_error(capsys, cfg, "scene.background=[1, 1]"), "scene.background", "3 numbers")
    needles(trainer_error(capsys, cfg, "train.steps"), "expected key=value")
    needles(trainer_error(capsys, write_config(tmp_path, s, "method: ss\n")), "method: is 'ss'", "trainers/spatial.py")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("train: [1, 2\n")
    needles(trainer_error(capsys, bad_yaml), "bad.yaml", "not valid YAML", "line")
    needles(trainer_error(capsys, tmp_path / "absent.yaml"), "absent.yaml", "config file not found")


def test_world_size_larger_than_images(scenes, tmp_path):
    from dali_nerf.sources import build_source

    s = scene_copy(scenes, tmp_path)
    scene = load_scene(s, "train")
    for name in ("rays", "sync_local", "torch_workers"):
        cfg = load_config(write_config(tmp_path, s), [f"pipeline.name={name}"])
        with pytest.raises(SceneError) as e:
            build_source(cfg, scene, 0, scene.num_images + 1)
        needles(str(e.value), "has 6 images but world_size=7", "use at most 6 ranks")


def test_more_ranks_than_cells(tmp_path):
    from dali_nerf.partition import Partition, assign_rank

    scene = load_scene(make_scene("city", tmp_path / "city", width=16, height=12, n_train=8, n_val=1), "train",
                       format="mega_nerf")
    cfg = load_config(write_config(tmp_path, tmp_path / "city", "partition:\n  grid: [2, 2]\n"))
    part = Partition.from_config(cfg.partition, scene)
    assert len(assign_rank(part.num_cells, 4)) == 4
    with pytest.raises(ConfigError) as e:
        assign_rank(part.num_cells, 5)
    needles(str(e.value), "partition.grid", "4 cells for world size 5", "fewer ranks")


# ------------------------------------------------------------------------------- outputs

def test_output_folder_not_writable(scenes, tmp_path, capsys):
    s = scene_copy(scenes, tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("a file where the runs folder should be")
    cfg = write_config(tmp_path, s)
    msg = trainer_error(capsys, cfg, f"train.runs_dir={blocker / 'runs'}")
    needles(msg, "runs/run", "output folder is not writable", "train.runs_dir")
    assert blocker.read_text() == "a file where the runs folder should be"


DISK_FULL_CHILD = r"""
import resource, signal, sys, torch
from dali_nerf.train.checkpoint import save_rank_state
from dali_nerf.cli.command import run_cli
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # write() then fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # no file may grow past 1 MiB
state = {"step": 8, "tasks": {"ddp": {"field": {"w": torch.arange(1 << 20, dtype=torch.float32)}}}}
sys.exit(run_cli(save_rank_state, sys.argv[1], 8, 0, state))
"""


def test_disk_full_during_checkpoint(tmp_path):
    """The checkpoint write really fails (RLIMIT_FSIZE -> EFBIG in a child process): one line,
    exit 2, no partial file, and the previous checkpoint stays the latest and loads."""
    root = tmp_path / "checkpoints"
    prev = {"step": 4, "tasks": {"ddp": {"field": {"w": torch.linspace(0, 1, 1000)}}}}
    save_rank_state(root, 4, 0, prev)
    commit_checkpoint(root, 4)
    r = subprocess.run([sys.executable, "-c", DISK_FULL_CHILD, str(root)], capture_output=True, text=True, timeout=120)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    needles(lines[0], "step_0000008/rank0.pt", "cannot write", "File too large", "free disk space")
    assert not (root / "step_0000008" / "rank0.pt").exists()
    assert list((root / "step_0000008").iterdir()) == []  # the temp file was removed
    folder = latest_checkpoint(root)
    assert folder.name == "step_0000004"
    st = load_rank_state(folder, 0)
    assert st["step"] == 4 and torch.equal(st["tasks"]["ddp"]["field"]["w"], prev["tasks"]["ddp"]["field"]["w"])


# ------------------------------------------------------------------------------- through the real CLIs

def _cli(args, timeout=120):
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    return lines[0]


def test_validate_cli_one_line_exit_2(scenes, tmp_path):
    exe = shutil.which("dali-nerf")
    base = [exe] if exe else [sys.executable, "-m", "dali_nerf"]
    needles(_cli(base + ["validate", str(tmp_path / "absent")]), "absent", "scene folder not found")
    s = scene_copy(scenes, tmp_path)
    (s / "val" / "r_0.png").write_bytes(png_bytes(100000, 100000))
    needles(_cli(base + ["validate", str(s)]), "val/r_0.png", "decompression bomb")
    (s / "transforms_train.json").write_text("{\"frames\": [")
    needles(_cli(base + ["validate", str(s)]), "transforms_train.json:1:", "malformed JSON")


def test_trainer_cli_corrupt_image_one_line_exit_2(scenes, tmp_path):
    s = scene_copy(scenes, tmp_path, "jpg")
    p = s / "train" / "r_5.jpg"
    p.write_bytes(p.read_bytes()[:-300])
    files = previous_run(tmp_path)
    msg = _cli([sys.executable, "-m", "dali_nerf.trainers.ddp", "--config", str(write_config(tmp_path, s))])
    needles(msg, "r_5.jpg", "truncated JPEG")
    assert_untouched(files)


def test_resume_after_the_scene_changed(scenes, tmp_path, capsys):
    """--resume after images were added or removed, a pose moved, the images resized, or another
    downscale: one line naming the scene folder and what changed (never an internal field), and
    nothing written; a checkpoint saved before fingerprints existed still resumes."""
    s = scene_copy(scenes, tmp_path)
    cfg = write_config(tmp_path, s)
    assert ddp_main(["--config", str(cfg), "train.steps=2"]) == 0, capsys.readouterr().err
    run = tmp_path / "runs" / "run"
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    tj = s / "transforms_train.json"
    good = tj.read_text()

    def refused(*words, extra=()):
        msg = trainer_error(capsys, cfg, "--resume", "train.steps=4", *extra)
        needles(msg, str(s), "changed since the checkpoint", "step_0000002", *words, "start a new run")
        assert "num_pixels" not in msg
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files
        tj.write_text(good)

    shutil.copy(s / "train" / "r_0.png", s / "train" / "r_6.png")
    edit_json(tj, lambda m: m["frames"].append(dict(m["frames"][0], file_path="./train/r_6")))
    refused("1 image added (train/r_6.png)")
    edit_json(tj, lambda m: m["frames"].pop(3))
    refused("1 image removed (train/r_3.png)")
    edit_json(tj, lambda m: m["frames"][2]["transform_matrix"][1].__setitem__(3, m["frames"][2]["transform_matrix"][1][3] + 0.3))
    refused("camera poses changed (1 image: train/r_2.png)")
    refused("downscale 1 -> 2", extra=("scene.downscale=2",))
    originals = {p: p.read_bytes() for p in (s / "train").glob("*.png")}
    for p in originals:  # every image re-exported at half size (Blender: the first image's size for all)
        cv2.imwrite(str(p), cv2.resize(cv2.imread(str(p), cv2.IMREAD_UNCHANGED), (W // 2, H // 2)))
    refused(f"image sizes changed (train/r_0.png {W}x{H} -> {W // 2}x{H // 2}, 5 more)")
    for p, b in originals.items():
        p.write_bytes(b)
    # a checkpoint written before fingerprints were saved: nothing to compare, it resumes
    ck = run / "checkpoints" / "step_0000002" / "run.pt"
    st = torch.load(ck, weights_only=True)
    del st["scene"]
    torch.save(st, ck)
    edit_json(tj, lambda m: m["frames"][2]["transform_matrix"][1].__setitem__(3, m["frames"][2]["transform_matrix"][1][3] + 0.3))
    assert ddp_main(["--config", str(cfg), "--resume", "train.steps=3"]) == 0, capsys.readouterr().err
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 2


def test_numbers_beyond_what_the_op_holds(scenes, tmp_path, capsys):
    """Config numbers past the op's argument types (or the op's cell limit, or any float) are one
    line naming the key and its range, before anything runs (they used to reach DALI and fail
    there with a multi-line C++ assert)."""
    s = scene_copy(scenes, tmp_path)
    cfg = write_config(tmp_path, s)
    files = previous_run(tmp_path)
    for override, words in (
            ("pipeline.rays_per_batch=2147483648", ("pipeline.rays_per_batch: must be in [1, 2147483647], got 2147483648",)),
            ("pipeline.seed=9223372036854775808", ("pipeline.seed: must be in [0, 9223372036854775807]",)),
            ("pipeline.seed=-1", ("pipeline.seed: must be in [0, 9223372036854775807], got -1",)),
            ("pipeline.rays_per_run=2147483648", ("pipeline.rays_per_run: must be in [0, 2147483647]",)),
            ("pipeline.rays_per_batch=1073741825 pipeline.rays_per_run=1073741826",
             ("pipeline.rays_per_run: 1073741826 rounded up", "over the op's limit of 2147483647")),
            ("pipeline.rays_per_batch=1073741825", ("rays_per_batch=1073741825: 4 runs", "GiB", "lower rays_per_batch")),
            ("pipeline.num_threads=100000", ("pipeline.num_threads: must be in [0, 1024]",)),
            ("pipeline.prefetch=100000", ("pipeline.prefetch: must be in [0, 1024]",)),
            ("partition.grid=[9,9]", ("partition.grid: grid 9x9 = 81 cells", "at most 64")),
            ("partition.margin=.inf", ("partition.margin: must be a finite number >= 1.0, got inf",)),
            ("train.lr=1" + "0" * 400, ("train.lr:", "beyond the range of a number")),
            # a downscale that leaves 1x1 images: refused before training, not an SSIM traceback after it
            ("scene.downscale=1000000", ("scene.downscale=1000000: the test images become as small as 1x1 (r_0.png)",
                                         "11x11 window", "use a smaller scene.downscale"))):
        msg = trainer_error(capsys, cfg, *override.split(" "), files=files)
        needles(msg, *words)
        if override.startswith(("pipeline.", "partition.", "train.")) and "GiB" not in msg:
            assert "c.yaml" in msg, msg  # config keys name the file
