"""Scene folders as users hand them over: an image path that is a folder, a file given where a
scene folder is expected: one line saying what the path is.

Scenes are written here by hand (numpy + OpenCV, seed 39), in each format's documented layout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

from dali_nerf.cli.main import main as cli_main
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.errors import DataError, SceneError
from dali_nerf.scenes import load_scene

SEED = 39
W, H = 12, 8


def _image(path: Path, rng) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), rng.integers(0, 256, (H, W, 3), dtype=np.uint8))
    return path


def write_blender(root: Path, n: int = 3) -> None:
    rng = np.random.default_rng(SEED)
    for split in ("train", "val", "test"):
        frames = []
        for i in range(n):
            _image(root / split / f"r_{i}.png", rng)
            m = np.eye(4)
            m[2, 3] = 3.0 + i
            frames.append({"file_path": f"./{split}/r_{i}", "transform_matrix": m.tolist()})
        (root / f"transforms_{split}.json").write_text(json.dumps({"camera_angle_x": 0.7, "frames": frames}))


def test_an_image_path_that_is_a_folder_is_named_as_one(tmp_path):
    write_blender(tmp_path)
    img = tmp_path / "train" / "r_1.png"
    img.unlink()
    img.mkdir()  # an unzip gone wrong, a renamed folder
    with pytest.raises(SceneError) as e:
        load_scene(tmp_path, "train")
    msg = str(e.value)
    assert msg.startswith(str(tmp_path / "transforms_train.json")) and "1 of 3 images is a folder, not an image file" in msg \
        and str(img) in msg and "missing" not in msg and "\n" not in msg, msg
    # a parsed scene whose file became a folder since: the cache's check names it too
    shutil.rmtree(img)
    _image(img, np.random.default_rng(SEED))
    scene = load_scene(tmp_path, "train")
    img.unlink()
    img.mkdir()
    with pytest.raises(DataError) as e:
        decode_cache(scene)
    msg = str(e.value)
    assert msg.startswith(str(img)) and "is a folder, not an image file" in msg and "not found" not in msg, msg


def test_validate_on_a_file_says_it_is_a_file_and_what_to_pass(tmp_path, capsys):
    """``dali-nerf validate`` (and load_scene, so the trainers) given a file: the scene's own
    file, an archive, anything else; one line, exit 2."""
    write_blender(tmp_path / "lego")
    archive = tmp_path / "lego.zip"
    archive.write_bytes(b"PK\x05\x06" + bytes(18))
    other = tmp_path / "notes.txt"
    other.write_text("my scene\n")
    cases = {tmp_path / "lego" / "transforms_train.json": f"pass the folder that holds it: {tmp_path / 'lego'}",
             archive: "is an archive file, not a scene folder; unpack it",
             other: "is a file, not a scene folder; pass the scene's folder"}
    for path, words in cases.items():
        with pytest.raises(SceneError) as e:
            load_scene(path, "train")
        assert str(e.value).startswith(str(path)) and words in str(e.value), str(e.value)
    capsys.readouterr()
    rc = cli_main(["validate", str(tmp_path / "lego" / "transforms_train.json")])  # the command, in-process
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert "is a file, not a scene folder" in lines[0] and "scene folder not found" not in lines[0], lines
