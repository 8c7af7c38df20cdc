"""Property: the scene parsers read any valid variation of their format, and refuse a corrupt
file with one line naming it, never a traceback.

Valid files: for each format (Blender, nerfstudio, LLFF, Mega-NeRF) a writer here draws a scene
the format allows — image counts and sizes, poses (any rotation, any position), intrinsics in
the format's different spellings (nerfstudio: shared or per-frame keys, ``fl_x`` or
``camera_angle_x``, ``w``/``h`` given or read from the image; Blender: ``file_path`` with or
without extension), optional keys (near/far shared or per image, aabb, up, split lists), frames in
any order, unknown extra keys — and the parsed Scene is checked against what was written: image
files, sizes, c2w converted to OpenGL (LLFF: through ``world_from_source``, which must map the
file's camera centres and axes to the parsed ones), intrinsics, bounds, box, splits.

Corruptions: one of the scene's metadata files (JSON, ``poses_bounds.npy`` or a ``.pt``) is
truncated, has bytes flipped, loses a key, or has a value replaced by one of another type (a
string, a list, a mapping, null, a boolean, a number of the wrong size: an integer beyond the
float range, or one of more digits than Python converts). Parsing must then either succeed with a
sane Scene (some corruptions are harmless: a dropped optional key, a flipped digit) or raise a
DaliNerfError whose message is one line and names the file (its path, or its folder and name).
Parsers run in-process; a few corrupt scenes also go through ``dali-nerf validate`` (exit 2, one
``error:`` line on stderr, no traceback).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dali_nerf.errors import DaliNerfError
from dali_nerf.scenes import load_scene

FORMATS = ("blender", "nerfstudio", "llff", "mega_nerf")


# ------------------------------------------------------------------------------ drawing poses

def rotation(rng) -> np.ndarray:
    q = rng.normal(size=4)
    w, x, y, z = q / np.linalg.norm(q)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])


def c2w4(rng, scale=10.0) -> np.ndarray:
    m = np.eye(4)
    m[:3, :3] = rotation(rng)
    m[:3, 3] = rng.uniform(-scale, scale, 3)
    return m


def write_image(path: Path, w: int, h: int, rng, ext=".png"):
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path.with_suffix(ext)), rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    return path.with_suffix(ext)


def dump_json(path: Path, obj, rng):
    path.write_text(json.dumps(obj, indent=int(rng.integers(0, 3)) or None))


# ------------------------------------------------------------------------------ valid writers
# each returns (the file a corruption targets, [other metadata files], a check(scene) of the train split)

def write_blender(root: Path, draw, rng):
    n = draw(st.integers(1, 4))
    w, h = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    angle = draw(st.floats(0.05, 3.0))
    with_ext = draw(st.booleans())
    meta = {"camera_angle_x": angle, "frames": []}
    if draw(st.booleans()):
        near = draw(st.floats(0, 5))
        meta.update(near=near, far=near + draw(st.floats(0.01, 100)))
    if draw(st.booleans()):
        lo = rng.uniform(-5, 0, 3)
        meta["aabb"] = [lo.tolist(), (lo + rng.uniform(0.1, 5, 3)).tolist()]
    if draw(st.booleans()):
        meta["comment"] = "an unknown key"
    poses, files = [], []
    for i in range(n):
        files.append(write_image(root / "train" / f"r_{i}", w, h, rng))
        m = c2w4(rng)
        poses.append(m)
        meta["frames"].append({"file_path": f"./train/r_{i}" + (".png" if with_ext else ""),
                               "rotation": 0.0, "transform_matrix": m.tolist()})
    dump_json(root / "transforms_train.json", meta, rng)

    def check(scene):
        assert scene.format == "blender" and scene.num_images == n
        assert [Path(p) for p in scene.image_paths] == [f.resolve() for f in files]
        np.testing.assert_array_equal(scene.c2w, np.array(poses, np.float32)[:, :3])
        f = 0.5 * w / math.tan(0.5 * angle)
        np.testing.assert_allclose(scene.intrinsics, np.tile([f, f, w / 2, h / 2], (n, 1)), rtol=1e-6)
        assert (scene.width == w).all() and (scene.height == h).all()
        assert np.allclose(scene.near, meta.get("near", 2.0)) and np.allclose(scene.far, meta.get("far", 6.0))
        if "aabb" in meta:
            np.testing.assert_allclose(scene.aabb, meta["aabb"], rtol=1e-6)
    return root / "transforms_train.json", [], check


def write_nerfstudio(root: Path, draw, rng):
    n = draw(st.integers(1, 6))
    shared = {"fl_x": draw(st.floats(1, 100))}
    spelled_angle = draw(st.booleans())
    W, H = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    if spelled_angle:
        shared = {"camera_angle_x": draw(st.floats(0.1, 3.0))}
    if draw(st.booleans()):
        shared["fl_y"] = draw(st.floats(1, 100))
    if draw(st.booleans()):
        shared.update(cx=draw(st.floats(-20, 40)), cy=draw(st.floats(-20, 40)))
    declare_wh = draw(st.booleans())
    if declare_wh:
        shared.update(w=W, h=H)
    model = draw(st.sampled_from([None, "PINHOLE", "OPENCV", "SIMPLE_PINHOLE"]))
    if model:
        shared["camera_model"] = model
    if model == "OPENCV":
        shared.update(k1=0.0, k2=0.0, p1=0.0, p2=0.0)
    frames, expect = [], {}
    bounds = draw(st.sampled_from(["none", "shared", "per_frame"]))
    for i in range(n):
        rel = f"images/frame_{i:05d}.png"
        per = {}
        w, h = W, H
        if draw(st.booleans()):  # this frame overrides some shared keys
            w, h = draw(st.integers(1, 12)), draw(st.integers(1, 12))
            per = {"w": w, "h": h, "fl_x": draw(st.floats(1, 100))}
        write_image(root / rel, w, h, rng)
        m = c2w4(rng)
        fr = {"file_path": rel, "transform_matrix": m.tolist(), **per}
        if bounds == "per_frame":
            fr["near"] = draw(st.floats(0, 1))
            fr["far"] = fr["near"] + draw(st.floats(0.01, 50))
        frames.append(fr)
        g = {**shared, **per}
        fx = g["fl_x"] if "fl_x" in g else 0.5 * w / math.tan(0.5 * g["camera_angle_x"])
        fy = g.get("fl_y", fx)
        expect[rel] = (m, (fx, fy, g.get("cx", w / 2), g.get("cy", h / 2)), (w, h), fr.get("near"), fr.get("far"))
    meta = {**shared, "frames": [frames[i] for i in rng.permutation(n)]}
    if bounds == "shared":
        meta["near"] = draw(st.floats(0, 1))
        meta["far"] = meta["near"] + draw(st.floats(0.01, 50))
    names = sorted(expect)
    if draw(st.booleans()):  # explicit split lists (train non-empty), else nerfstudio's fraction rule
        k = draw(st.integers(1, n))
        meta["train_filenames"] = names[:k]
        meta["test_filenames"] = names[k:] or names[:1]
        train = names[:k]
    else:
        n_train = math.ceil(0.9 * n)
        train = [names[i] for i in np.linspace(0, n - 1, n_train, dtype=int)]
    if draw(st.booleans()):
        lo = rng.uniform(-5, 0, 3)
        meta["aabb"] = [lo.tolist(), (lo + rng.uniform(0.1, 5, 3)).tolist()]
    if draw(st.booleans()):
        meta["up"] = rng.normal(size=3).tolist()
    dump_json(root / "transforms.json", meta, rng)

    def check(scene):
        assert scene.format == "nerfstudio" and scene.num_images == len(train)
        assert [Path(p) for p in scene.image_paths] == [(root / r).resolve() for r in train]
        for i, rel in enumerate(train):
            m, k, wh, near, far = expect[rel]
            np.testing.assert_array_equal(scene.c2w[i], m[:3].astype(np.float32))
            np.testing.assert_allclose(scene.intrinsics[i], k, rtol=1e-6, atol=1e-6)  # float32
            assert (scene.width[i], scene.height[i]) == wh
            if bounds == "per_frame":
                assert np.isclose(scene.near[i], near) and np.isclose(scene.far[i], far)
        if bounds == "none":
            assert scene.near is None and scene.far is None
        if bounds == "shared":
            assert np.allclose(scene.near, meta["near"]) and np.allclose(scene.far, meta["far"])
        assert (scene.aabb is None) == ("aabb" not in meta)
        if "up" in meta:
            np.testing.assert_allclose(scene.up, np.array(meta["up"]) / np.linalg.norm(meta["up"]), atol=1e-6)
    return root / "transforms.json", [], check


def write_llff(root: Path, draw, rng):
    n = draw(st.integers(2, 10))
    W, H = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    rows, gl = [], []
    for i in range(n):
        m = c2w4(rng)
        r = m[:3, :3]  # OpenGL [right, up, back] -> LLFF [down, right, back]
        drb = np.stack([-r[:, 1], r[:, 0], r[:, 2]], axis=1)
        focal = draw(st.floats(1, 100))
        near = draw(st.floats(0.05, 5))
        pose = np.concatenate([drb, m[:3, 3:], np.array([[H], [W], [focal]])], axis=1)
        rows.append(np.concatenate([pose.ravel(), [near, near + draw(st.floats(0.1, 50))]]))
        gl.append(m)
        write_image(root / "images" / f"image_{i:03d}", W, H, rng, draw(st.sampled_from([".png", ".jpg"])))
    arr = np.array(rows)
    np.save(root / "poses_bounds.npy", arr)
    train = [i for i in range(n) if i % 8]

    def check(scene):
        assert scene.format == "llff" and scene.num_images == len(train)
        wfs = scene.world_from_source
        sc = np.linalg.norm(wfs[:3, 0])
        for j, i in enumerate(train):
            # world_from_source maps the file's camera to the parsed one: centre and axes
            np.testing.assert_allclose(scene.c2w[j, :, 3], (wfs @ np.append(gl[i][:3, 3], 1))[:3], atol=1e-4 * (1 + sc * 10))
            np.testing.assert_allclose(scene.c2w[j, :, :3], wfs[:3, :3] / sc @ gl[i][:3, :3], atol=1e-5)
            np.testing.assert_allclose(scene.intrinsics[j], [arr[i, 14], arr[i, 14], W / 2, H / 2], rtol=1e-6)
            np.testing.assert_allclose([scene.near[j], scene.far[j]], arr[i, 15:17] * sc, rtol=1e-5)
        r = scene.c2w[:, :, :3].astype(np.float64)
        np.testing.assert_allclose(np.einsum("nji,njk->nik", r, r), np.broadcast_to(np.eye(3), r.shape), atol=1e-5)
        assert (scene.width == W).all() and (scene.height == H).all()
    return root / "poses_bounds.npy", [], check


def write_mega_nerf(root: Path, draw, rng):
    coords = {"origin_drb": torch.tensor(rng.uniform(-100, 100, 3)), "pose_scale_factor": draw(st.floats(0.1, 100))}
    coord_bounds = draw(st.booleans())
    if coord_bounds:
        coords["near"] = draw(st.floats(0.001, 1))
        coords["far"] = coords["near"] + draw(st.floats(0.1, 10))
    if draw(st.booleans()):
        lo = rng.uniform(-5, 0, 3)
        coords["aabb"] = torch.tensor(np.stack([lo, lo + rng.uniform(0.1, 5, 3)]), dtype=torch.float32)
    torch.save(coords, root / "coordinates.pt")
    per_file_bounds = draw(st.booleans())
    metas, expect = [], []
    for split in ("train", "val"):
        for j in range(draw(st.integers(1, 4))):
            name = f"{split}_{j:04d}"
            w, h = draw(st.integers(1, 12)), draw(st.integers(1, 12))
            write_image(root / split / "rgbs" / name, w, h, rng, draw(st.sampled_from([".png", ".jpg"])))
            md = {"W": w, "H": h, "intrinsics": torch.tensor([draw(st.floats(1, 100)), draw(st.floats(1, 100)),
                                                              w / 2, h / 2], dtype=torch.float32),
                  "c2w": torch.tensor(c2w4(rng, 1.0)[:3], dtype=torch.float32)}
            if per_file_bounds:
                md["near"] = draw(st.floats(0.001, 1))
                md["far"] = md["near"] + draw(st.floats(0.1, 10))
            (root / split / "metadata").mkdir(parents=True, exist_ok=True)
            torch.save(md, root / split / "metadata" / f"{name}.pt")
            metas.append(root / split / "metadata" / f"{name}.pt")
            if split == "train":
                expect.append(md)

    def check(scene):
        assert scene.format == "mega_nerf" and scene.num_images == len(expect)
        for i, md in enumerate(expect):
            np.testing.assert_array_equal(scene.c2w[i], md["c2w"].numpy())
            np.testing.assert_array_equal(scene.intrinsics[i], md["intrinsics"].numpy())
            assert (scene.width[i], scene.height[i]) == (md["W"], md["H"])
            if per_file_bounds:
                assert np.isclose(scene.near[i], md["near"]) and np.isclose(scene.far[i], md["far"])
            elif coord_bounds:
                assert np.isclose(scene.near[i], coords["near"]) and np.isclose(scene.far[i], coords["far"])
        psf = coords["pose_scale_factor"]
        np.testing.assert_allclose(scene.world_from_source[:3, 3], -coords["origin_drb"].numpy() / psf, rtol=1e-9)
        np.testing.assert_allclose(scene.up, [-1, 0, 0])
    targets = [root / "coordinates.pt"] + [m for m in metas if m.parent.parent.name == "train"]
    return targets[int(rng.integers(0, len(targets)))], targets, check


WRITERS = {"blender": write_blender, "nerfstudio": write_nerfstudio, "llff": write_llff, "mega_nerf": write_mega_nerf}


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(fmt=st.sampled_from(FORMATS), data=st.data(), seed=st.integers(0, 2 ** 32 - 1))
def test_valid_variations_parse_to_what_was_written(fmt, data, seed):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _, _, check = WRITERS[fmt](root, data.draw, np.random.default_rng(seed))
        check(load_scene(root, "train"))  # format detected
        check(load_scene(root, "train", format=fmt))


# ------------------------------------------------------------------------------ corruptions

# values of "another type": a string, a list, a mapping, null, a boolean, and numbers JSON allows
# but no parser can use: an integer beyond the float range, one of more digits than Python converts
HUGE = "__an_integer_of_4401_digits__"  # json.dumps cannot write one (Python's digit limit): spliced in
WRONG = [lambda r: "x" * int(r.integers(0, 4)), lambda r: [1, "a"], lambda r: {"k": 1}, lambda r: None,
         lambda r: bool(r.integers(0, 2)), lambda r: 10 ** 400, lambda r: -(10 ** 400), lambda r: HUGE,
         lambda r: float("nan"), lambda r: float(r.normal() * 1e300)]


def _paths(obj, prefix=()):
    """Every (path) of keys / indices in a JSON value."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


def _edit(obj, path, value=None, drop=False):
    node = obj
    for p in path[:-1]:
        node = node[p]
    if drop:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def corrupt(path: Path, kind: str, rng) -> None:
    raw = path.read_bytes()
    if kind == "truncate":
        path.write_bytes(raw[:int(rng.integers(0, len(raw)))])
    elif kind == "flip":
        b = bytearray(raw)
        for i in rng.integers(0, len(b), int(rng.integers(1, 4))):
            b[i] ^= int(rng.integers(1, 256))
        path.write_bytes(bytes(b))
    elif path.suffix == ".json":
        obj = json.loads(raw)
        paths = _paths(obj)
        p = paths[int(rng.integers(0, len(paths)))]
        if kind == "drop":
            _edit(obj, p, drop=True)
        else:
            _edit(obj, p, WRONG[int(rng.integers(0, len(WRONG)))](rng))
        path.write_text(json.dumps(obj).replace(f'"{HUGE}"', "7" + "0" * 4400))
    elif path.suffix == ".pt":
        obj = torch.load(path, weights_only=True)
        k = list(obj)[int(rng.integers(0, len(obj)))]
        if kind == "drop":
            del obj[k]
        else:
            choices = WRONG[:7] + [lambda r: 7 * 10 ** 4400, lambda r: torch.zeros(int(r.integers(0, 5))), lambda r: torch.tensor([float("inf")]),
                                   lambda r: torch.ones(2, 2, 2)]
            obj[k] = choices[int(rng.integers(0, len(choices)))](rng)
        torch.save(obj, path)
    else:  # .npy: a wrong shape, a non-finite entry, another dtype, a pickled object array
        arr = np.load(path)
        pick = int(rng.integers(0, 4))
        if kind == "drop" or pick == 0:
            arr = arr[:, : int(rng.integers(0, 17))] if rng.integers(0, 2) else arr.reshape(-1)
        elif pick == 1:
            arr = arr.copy()
            arr.flat[int(rng.integers(0, arr.size))] = rng.choice([np.nan, np.inf, -np.inf, 0.0, -1.0])
        elif pick == 2:
            arr = arr.astype(rng.choice(["<i4", "<f2", "|u1", "<c16"]))
        else:
            with open(path, "wb") as f:
                np.save(f, np.array([{"pose": 1}], dtype=object), allow_pickle=True)
            return
        np.save(path, arr)


def names_file(msg: str, path: Path) -> bool:
    """The message names ``path``: the path itself, or its folder and its name's stem."""
    p = path.resolve()
    return str(p) in msg or str(path) in msg or (str(p.parent) in msg and p.stem in msg)


def sane(scene) -> None:
    """What any accepted scene must satisfy, whatever file it came from."""
    assert scene.num_images >= 1
    assert np.isfinite(scene.c2w).all() and np.isfinite(scene.intrinsics).all()
    assert (scene.intrinsics[:, :2] > 0).all() and (scene.width > 0).all() and (scene.height > 0).all()
    r = scene.c2w[:, :, :3].astype(np.float64)
    assert np.abs(np.einsum("nji,njk->nik", r, r) - np.eye(3)).max() < 1e-2
    if scene.near is not None:
        assert np.isfinite(scene.near).all() and np.isfinite(scene.far).all() and (scene.far > scene.near).all()
    if scene.aabb is not None:
        assert np.isfinite(scene.aabb).all() and (scene.aabb[0] < scene.aabb[1]).all()


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(fmt=st.sampled_from(FORMATS), kind=st.sampled_from(["truncate", "flip", "drop", "wrong_type"]),
       data=st.data(), seed=st.integers(0, 2 ** 32 - 1))
def test_corrupt_files_fail_in_one_line_naming_the_file(fmt, kind, data, seed):
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target, _, _ = WRITERS[fmt](root, data.draw, rng)
        corrupt(target, kind, rng)
        try:
            scene = load_scene(root, "train", format=fmt)
        except DaliNerfError as e:
            msg = str(e)
            assert "\n" not in msg, msg
            assert names_file(msg, target), f"the message does not name {target}: {msg}"
            return
        sane(scene)


@settings(max_examples=3, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(fmt=st.sampled_from(FORMATS), data=st.data(), seed=st.integers(0, 2 ** 32 - 1))
def test_validate_cli_on_a_truncated_file_exits_2_with_one_line(fmt, data, seed):
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target, _, _ = WRITERS[fmt](root, data.draw, rng)
        raw = target.read_bytes()
        target.write_bytes(raw[:int(rng.integers(0, len(raw) // 2))])  # at most half: never a valid file
        r = subprocess.run([sys.executable, "-m", "dali_nerf", "validate", str(root)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert names_file(lines[0], target), lines[0]
