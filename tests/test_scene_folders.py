"""Scene folders as users hand them over: hidden files beside the images (macOS's ``._IMG_4026.JPG``
AppleDouble files, ``.DS_Store``), an image path that is a folder, a file given where a scene
folder is expected. Hidden files are skipped wherever a folder is listed (one test per format that
lists: LLFF ``images/`` and ``images_N/``, Mega-NeRF ``rgbs/`` and ``metadata/``, Mega-NeRF
cluster masks, the scene generator's output folder); the rest are one line saying what the path is.

Scenes are written here by hand (numpy + OpenCV, seed 39), in each format's documented layout.
"""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from dali_nerf.cli.main import main as cli_main
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.errors import DaliNerfError, DataError, SceneError
from dali_nerf.partition.mega_nerf import load_masks
from dali_nerf.scenegen.writers import make_scene
from dali_nerf.scenes import load_scene

SEED = 39
W, H = 12, 8
# what macOS writes beside each file copied to a non-HFS volume: an AppleDouble header, not a JPEG
APPLEDOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(64)


def _image(path: Path, rng) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), rng.integers(0, 256, (H, W, 3), dtype=np.uint8))
    return path


def _hide_junk(folder: Path, name: str) -> None:
    (folder / f"._{name}").write_bytes(APPLEDOUBLE)
    (folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(32))


def write_llff(root: Path, n: int = 9, prescaled: bool = False) -> list:
    rng = np.random.default_rng(SEED)
    rows = []
    for i in range(n):
        ang = 0.1 * i
        drb = np.array([[0, 1, 0], [-1, 0, 0], [0, 0, 1]], np.float64)  # camera looking down -z, DRB columns
        pose = np.concatenate([drb, [[np.sin(ang)], [0.0], [4.0]], [[H], [W], [10.0]]], 1)
        rows.append(np.concatenate([pose.ravel(), [1.0, 8.0]]))
        _image(root / "images" / f"IMG_{4020 + i}.JPG", rng)
        if prescaled:
            _image(root / "images_2" / f"IMG_{4020 + i}.JPG", np.random.default_rng(i))
    np.save(root / "poses_bounds.npy", np.array(rows))
    return [f"IMG_{4020 + i}.JPG" for i in range(n)]


def test_llff_skips_hidden_files_in_images_and_images_n(tmp_path):
    names = write_llff(tmp_path, prescaled=True)
    _hide_junk(tmp_path / "images", names[6])
    _hide_junk(tmp_path / "images_2", names[6])
    train = load_scene(tmp_path, "train")
    test = load_scene(tmp_path, "test")
    assert [Path(p).name for p in test.image_paths] == [names[0], names[8]]
    assert [Path(p).name for p in train.image_paths] == names[1:8]
    small = load_scene(tmp_path, "train", downscale=2)
    assert all(Path(p).parent.name == "images_2" and not Path(p).name.startswith(".") for p in small.image_paths)
    assert decode_cache(train).num_images == 7
    # a real extra image is still a one-line error, which names the listed span
    _image(tmp_path / "images" / "IMG_9999.JPG", np.random.default_rng(SEED))
    with pytest.raises(SceneError) as e:
        load_scene(tmp_path, "train")
    msg = str(e.value)
    assert "9 poses" in msg and "10 images (IMG_4020.JPG .. IMG_9999.JPG)" in msg and "hidden" in msg, msg


def write_mega_nerf(root: Path, n: int = 3) -> list:
    rng = np.random.default_rng(SEED)
    torch.save({"origin_drb": torch.zeros(3, dtype=torch.float64), "pose_scale_factor": 1.0}, root / "coordinates.pt")
    stems = [f"{i:06d}" for i in range(n)]
    for split in ("train", "val"):
        (root / split / "metadata").mkdir(parents=True)
        for i, stem in enumerate(stems):
            c2w = np.eye(4)[:3]
            c2w[0, 3] = 0.2 * i
            torch.save({"W": W, "H": H, "intrinsics": torch.tensor([10.0, 10.0, W / 2, H / 2]),
                        "c2w": torch.tensor(c2w, dtype=torch.float32), "near": 0.1, "far": 5.0},
                       root / split / "metadata" / f"{stem}.pt")
            _image(root / split / "rgbs" / f"{stem}.jpg", rng)
    return stems


def test_mega_nerf_skips_hidden_files_in_rgbs_and_metadata(tmp_path):
    stems = write_mega_nerf(tmp_path)
    for sub in ("rgbs", "metadata"):
        _hide_junk(tmp_path / "train" / sub, f"{stems[1]}.{'jpg' if sub == 'rgbs' else 'pt'}")
    scene = load_scene(tmp_path, "train")
    assert [Path(p).name for p in scene.image_paths] == [f"{s}.jpg" for s in stems]
    assert decode_cache(scene).num_images == 3


def test_mega_nerf_masks_skip_hidden_files(tmp_path):
    """Cluster masks in Mega-NeRF's layout (``<cell>/<stem>.pt``: a zip holding ``<stem>.pt``)."""
    rng = np.random.default_rng(SEED)
    want = {}
    for stem in ("000000", "000001"):
        want[stem] = rng.random((2, H, W)) < 0.5
        for cell in (0, 1):
            (tmp_path / str(cell)).mkdir(exist_ok=True)
            buf = io.BytesIO()
            torch.save(torch.from_numpy(want[stem][cell]), buf)
            with zipfile.ZipFile(tmp_path / str(cell) / f"{stem}.pt", "w") as zf:
                zf.writestr(f"{stem}.pt", buf.getvalue())
    _hide_junk(tmp_path / "0", "000001.pt")
    got = load_masks(tmp_path)
    assert sorted(got) == ["000000", "000001"]
    assert all(np.array_equal(got[s], want[s]) for s in want)


def test_make_scene_names_what_a_non_empty_folder_holds(tmp_path):
    out = tmp_path / "scene"
    out.mkdir()
    (out / ".DS_Store").write_bytes(b"\x00")
    with pytest.raises(DaliNerfError) as e:
        make_scene("objects", out, width=16, height=16, n_train=1, n_val=1, n_test=1)
    msg = str(e.value)
    assert msg.startswith(str(out)) and "holds .DS_Store" in msg and "--force" in msg and "\n" not in msg, msg


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
