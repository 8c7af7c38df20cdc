"""Bad inputs through the public library API (``load_scene`` + ``RayLoader`` / ``decode_cache``),
not only through the trainers (docs/RELIABILITY.md, "Library API").

Each test asserts the one-line message names the file or field. Scenes are tiny, written into
``tmp_path``; the oversized ones are PNG *headers* claiming a large size, a few hundred bytes on disk.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from dali_nerf.atomic import atomic_write, atomic_write_json
from dali_nerf.train.checkpoint import commit_checkpoint, latest_checkpoint, save_rank_state
from dali_nerf.cli.demo import write_report
from dali_nerf.errors import DaliNerfError, DataError
from dali_nerf.data.imageio import MAX_PIXELS, MAX_PIXELS_ENV
from dali_nerf.sources import RayLoader
from dali_nerf.data.imagecache import _find_culprit, available_memory, decode_cache
from dali_nerf.scenegen import make_scene
from dali_nerf.scenes import load_scene
from dali_nerf.cli.validate import main as validate_main

W = H = 24


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


def needles(msg: str, *words):
    for w in words:
        assert str(w) in msg, (w, msg)


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose IHDR (valid CRC) claims w x h, with one tiny IDAT and IEND: passes every
    header check, a few hundred bytes on disk."""
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def blender(tmp_path_factory):
    return Path(make_scene("objects", tmp_path_factory.mktemp("b") / "s", width=W, height=H, n_train=12,
                           n_val=1, n_test=1))


def blender_copy(blender, tmp_path) -> Path:
    import shutil

    dst = tmp_path / "scene"
    shutil.copytree(blender, dst)
    return dst


def nerfstudio(root: Path, n: int = 4, w: int = W, h: int = H, declared=None, rels=None, files=True) -> Path:
    """transforms.json over ``n`` real w x h PNGs (``declared``: the w/h the file states)."""
    import cv2

    root.mkdir(parents=True, exist_ok=True)
    frames = []
    for j in range(n):
        rel = rels[j] if rels is not None else f"images/frame_{j:05d}.png"
        p = Path(rel) if os.path.isabs(rel) else root / rel
        if files:
            p.parent.mkdir(parents=True, exist_ok=True)
            assert cv2.imwrite(str(p), np.full((h, w, 3), 40 * j, np.uint8))
        m = np.eye(4)
        m[:3, 3] = (np.cos(j), 0.2 * j, 3.0 + np.sin(j))
        frames.append({"file_path": rel, "transform_matrix": m.tolist()})
    dw, dh = declared or (w, h)
    meta = {"fl_x": 20.0, "fl_y": 20.0, "w": dw, "h": dh, "frames": frames,
            "train_filenames": [f["file_path"] for f in frames], "test_filenames": [frames[0]["file_path"]]}
    (root / "transforms.json").write_text(json.dumps(meta))
    return root


# ------------------------------------------------------------------------------- every decode failure names the file

def test_text_saved_as_png_named_by_rayloader(blender, tmp_path):
    s = blender_copy(blender, tmp_path)
    (s / "train" / "r_9.png").write_text("this is not an image\n")
    scene = load_scene(s, "train")  # the parser reads the first header only
    with pytest.raises(DataError) as e:
        RayLoader(scene, rays_per_batch=64, rays_per_run=256)
    needles(one_line(e), "train/r_9.png", "not a PNG or JPEG")


def test_truncated_png_named_by_decode_cache(blender, tmp_path):
    s = blender_copy(blender, tmp_path)
    p = s / "train" / "r_10.png"
    p.write_bytes(p.read_bytes()[:-40])
    scene = load_scene(s, "train")
    with pytest.raises(DataError) as e:
        decode_cache(scene, rank=1, world_size=2)  # r_10 is in shard 1 of 2
    needles(one_line(e), "train/r_10.png", "truncated")
    decode_cache(scene, rank=0, world_size=2)  # the other shard does not touch it


def test_damaged_png_data_named(blender, tmp_path):
    """Damage inside the compressed data passes the header checks; DALI's failure is traced to
    the file: by DALI's own message, and, when DALI does not name it, by a per-file decode."""
    s = blender_copy(blender, tmp_path)
    p = s / "train" / "r_7.png"
    b = bytearray(p.read_bytes())
    i = b.index(b"IDAT")
    n = int.from_bytes(b[i - 4:i], "big")
    for k in range(i + 4 + n // 3, i + 4 + n // 3 + 8):
        b[k] ^= 0xFF
    p.write_bytes(bytes(b))
    scene = load_scene(s, "train")
    with pytest.raises(DataError) as e:
        RayLoader(scene, rays_per_batch=64, rays_per_run=256)
    needles(one_line(e), "train/r_7.png", "cannot be decoded")
    # DALI's "Critical error in pipeline:" without a file name: the batch's files are decoded one by one
    msg = _find_culprit(scene, list(range(4, 12)), RuntimeError("Critical error in pipeline:\nError in thread 0"))
    needles(msg, "train/r_7.png", "cannot be decoded")
    assert "r_4.png" not in msg and "\n" not in msg


# ------------------------------------------------------------------------------- sizes, before any allocation

def test_declared_size_differs_from_header_refused(tmp_path):
    """Policy: the declaration must match the header; the file is named with both sizes (the
    header never silently wins)."""
    scene = load_scene(nerfstudio(tmp_path / "ns", declared=(30, 20)), "train")
    with pytest.raises(DataError) as e:
        RayLoader(scene, rays_per_batch=64, rays_per_run=256)
    needles(one_line(e), "images/frame_00000.png", f"image is {W}x{H}", "declares 30x20")


def test_declared_447_gib_refused_in_one_line(tmp_path, monkeypatch):
    """A header's w/h of 200000 over ordinary PNGs would size a 447 GiB cache."""
    root = nerfstudio(tmp_path / "ns", declared=(200000, 200000))
    with pytest.raises(DataError) as e:
        load_scene(root, "train")
    needles(one_line(e), "transforms.json", "frame 'images/frame_00000.png'", "200000x200000",
            f"per-image limit of {MAX_PIXELS}", MAX_PIXELS_ENV)
    # the limit is configurable; above it the header comparison still refuses before allocating
    monkeypatch.setenv(MAX_PIXELS_ENV, str(10**11))
    scene = load_scene(root, "train")
    with pytest.raises(DataError) as e:
        RayLoader(scene, rays_per_batch=64, rays_per_run=256)
    needles(one_line(e), "images/frame_00000.png", f"image is {W}x{H}", "declares 200000x200000")
    # and lowering it refuses ordinary images, from the headers
    monkeypatch.setenv(MAX_PIXELS_ENV, str(W * H - 1))
    with pytest.raises(DataError) as e:
        load_scene(nerfstudio(tmp_path / "ok"), "train")
    needles(one_line(e), "transforms.json", f"{W}x{H}", f"per-image limit of {W * H - 1}")
    monkeypatch.setenv(MAX_PIXELS_ENV, "lots")
    with pytest.raises(DataError) as e:
        load_scene(tmp_path / "ok", "train")
    needles(one_line(e), MAX_PIXELS_ENV, "positive integer")


def test_oversized_header_refused_by_decode_cache(blender, tmp_path, monkeypatch):
    """A file whose header claims more pixels than the limit is refused by the library API
    before any decoding (not only by the trainers' scan)."""
    s = blender_copy(blender, tmp_path)
    (s / "train" / "r_5.png").write_bytes(png_header_only(100000, 100000))
    with pytest.raises(DataError) as e:
        RayLoader(load_scene(s, "train"), rays_per_batch=64, rays_per_run=256)
    needles(one_line(e), "train/r_5.png", "100000x100000", "decompression bomb")


def test_split_larger_than_memory_refused_with_numbers(tmp_path):
    """Every image within the per-image limit and of its declared size, but the split's decoded
    pixels exceed the memory available: refused before allocating, with the numbers."""
    side = 16000  # 256 M pixels, under MAX_PIXELS; 768 MB decoded each
    per = side * side * 3
    n = 2 * available_memory("cpu") // per + 2
    root = nerfstudio(tmp_path / "big", n=int(n), declared=(side, side), files=False)
    for j in range(int(n)):
        p = root / "images" / f"frame_{j:05d}.png"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(png_header_only(side, side))
    scene = load_scene(root, "train")
    with pytest.raises(DataError) as e:
        RayLoader(scene, rays_per_batch=64, rays_per_run=256)
    msg = one_line(e)
    needles(msg, str(root), "split 'train'", f"{int(n)} images", f"({int(n) * per} bytes)",
            "memory is available", "cache.max_bytes")


# ------------------------------------------------------------------------------- files outside the scene folder

def test_validate_reports_files_outside_the_scene_folder(tmp_path, capsys):
    import cv2

    shared = tmp_path / "shared"
    shared.mkdir()
    absolute = shared / "abs.png"
    assert cv2.imwrite(str(absolute), np.zeros((H, W, 3), np.uint8))
    rels = ["images/frame_00000.png", "../shared/up.png", str(absolute), "images/frame_00003.png"]
    root = tmp_path / "scene"
    nerfstudio(root, rels=rels)
    scene = load_scene(root, "train")  # allowed
    assert decode_cache(scene).num_images == 4

    class Args:
        scene, format, split = str(root), "auto", "train"

    assert validate_main(Args()) == 0
    out = [l for l in capsys.readouterr().out.splitlines() if l.startswith("warning:")]
    assert len(out) == 1, out
    needles(out[0], "train", "2 of 4 images lie outside the scene folder", "shared/up.png", "shared/abs.png")
    assert "frame_00000" not in out[0]


# ------------------------------------------------------------------------------- atomic writes, the checkpoint pointer

def test_latest_pointer_must_stay_inside_checkpoints(tmp_path):
    ck = tmp_path / "run" / "checkpoints"
    save_rank_state(ck, 4, 0, {"step": 4})
    commit_checkpoint(ck, 4)
    assert latest_checkpoint(ck) == ck / "step_0000004"
    (tmp_path / "etc").mkdir()
    outside = tmp_path / "run" / "elsewhere"
    outside.mkdir()
    (ck / "step_link").symlink_to(tmp_path / "etc")
    for bad in ("../../etc", str(tmp_path / "etc"), "..", "../elsewhere", "step_link", "step_0000004/../../elsewhere"):
        (ck / "latest").write_text(bad + "\n")
        with pytest.raises(DaliNerfError) as e:
            latest_checkpoint(ck)
        needles(one_line(e), str(ck / "latest"), repr(bad), "not a checkpoint folder inside")
    (ck / "latest").write_text("step_0000009\n")  # a folder that is gone: nothing to resume
    assert latest_checkpoint(ck) is None


def test_atomic_write_failure_keeps_the_previous_file(tmp_path):
    p = tmp_path / "report.md"
    p.write_text("previous report\n")

    def half_then_disk_full(f):
        f.write(b"# new rep")
        raise OSError(28, "No space left on device")

    with pytest.raises(DaliNerfError) as e:
        atomic_write(p, half_then_disk_full, hint="free disk space")
    needles(one_line(e), str(p), "No space left on device", "free disk space")
    assert p.read_text() == "previous report\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["report.md"]
    atomic_write_json(tmp_path / "derived.json", {"a": [1, 2], "x": np.float32(0.5)}, default=float)
    assert json.loads((tmp_path / "derived.json").read_text()) == {"a": [1, 2], "x": 0.5}


# ------------------------------------------------------------------------------- honest first-run stall

def test_demo_report_separates_warmup_from_steady_stall(tmp_path):
    """First step waited 1.5 s (plugin + pipeline build) of 2.0 s; 99 later steps of 0.25 s
    waited 0.15 ms each: overall (1.5 + 0.01485) / 26.75 = 5.66%, steady 0.06%."""
    steps, warm, warm_step, wait, step_s = 100, 1.5, 2.0, 1.5e-4, 0.25
    tot_wait, tot_step = warm + 99 * wait, warm_step + 99 * step_s
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": 1, "wait_s": warm, "step_s": warm_step}] + \
        [{"step": k, "wait_s": wait, "step_s": step_s} for k in range(2, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ph = {"wait": tot_wait, "h2d": 0.1, "forward": 3.0, "backward": 5.0, "sync": 0.0, "optimizer": 1.0, "step": tot_step}
    summary = {"name": "r", "method": "ddp", "world_size": 1, "device": "cpu", "test_psnr": 30.0, "test_ssim": 0.9,
               "eval_images": 2, "eval_split": "test", "steps": steps, "rays_per_batch": 64, "wall_s": 20.0,
               "rays_per_s": 1e6, "pipeline": "rays", "phase_totals_s": ph, "renders": ["a.png"], "resumed_from": 0,
               "stall_fraction": tot_wait / tot_step,
               "stall_fraction_after_first_step": (tot_wait - warm) / (tot_step - warm_step)}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "report.md").write_text("old")
    text = write_report(run)
    assert (run / "report.md").read_text() == text
    line = next(l for l in text.splitlines() if "data stall" in l)
    needles(line, "steady 0.06% of step time after the first step", "warm-up 1.50 s waiting for the first batch",
            "overall 5.66% including warm-up")
    # a resumed run: warm-up is the first step of this run (resumed_from + 1)
    summary["resumed_from"] = 50
    (run / "summary.json").write_text(json.dumps(summary))
    recs[50]["wait_s"] = 0.75
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    needles(write_report(run), "warm-up 0.75 s", "100 steps x 64 rays/rank", "1.00 Mrays/s trained")
    # a splatting run takes image batches: images per rank and pixels, no rays per batch
    summary.update(method="splat", pipeline="images", rays_per_batch=None, images_per_batch=2, patch_size=0)
    (run / "summary.json").write_text(json.dumps(summary))
    text = write_report(run)
    needles(text, "100 steps x 2 images/rank", "1.00 Mpixels/s trained", "pipeline: images")
    assert "None" not in text and "rays" not in text
