"""EXIF exposure (gsplat's ``load_exposure``): our reader on JPEGs whose EXIF this test writes byte by
byte (both byte orders, gsplat's fallbacks), cross-checked with Pillow where it is installed; a
COLMAP scene's ``exposure`` is each image's EV minus the capture's mean (every split), the image
batches carry it, and a split where only some images have one is refused in one line."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from dali_nerf.errors import ConfigError, SceneError
from dali_nerf.scenes import load_scene
from dali_nerf.scenes.exif import exposure_ev, read_exif, with_exposure
from dali_nerf.sources.images import ImageLoader

from _colmap_scene import colmap_scene

SEED = 1207


def _entry(order, tag, typ, value, data, data_at):
    """One 12-byte IFD entry; values over 4 bytes go to ``data`` (at offset ``data_at + len(data)``)."""
    if typ in (5, 10):
        raw = struct.pack(order + ("II" if typ == 5 else "ii"), *value)
        off = data_at + len(data)
        data += raw
        return struct.pack(order + "HHII", tag, typ, 1, off), data
    fmt = {3: "H", 4: "I"}[typ]
    raw = struct.pack(order + fmt, value).ljust(4, b"\0")
    return struct.pack(order + "HHI", tag, typ, 1) + raw, data


def exif_block(tags, order="<") -> bytes:
    """A TIFF block: IFD0 with the Exif IFD pointer, then the Exif IFD with ``tags`` [(tag, type, value)]."""
    head = (b"II" if order == "<" else b"MM") + struct.pack(order + "HI", 42, 8)
    ifd0 = struct.pack(order + "H", 1) + struct.pack(order + "HHII", 34665, 4, 1, 8 + 18) + struct.pack(order + "I", 0)
    sub_at = 8 + len(ifd0)
    data_at = sub_at + 2 + 12 * len(tags) + 4
    entries, data = b"", b""
    for tag, typ, value in tags:
        e, data = _entry(order, tag, typ, value, data, data_at)
        entries += e
    sub = struct.pack(order + "H", len(tags)) + entries + struct.pack(order + "I", 0)
    return head + ifd0 + sub + data


def jpeg_with_exif(path: Path, tags, order="<", seed=0) -> Path:
    img = np.random.default_rng(seed).integers(0, 256, (24, 32, 3), dtype=np.uint8)
    jpg = cv2.imencode(".jpg", img)[1].tobytes()
    app1 = b"Exif\x00\x00" + exif_block(tags, order)
    path.write_bytes(jpg[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + jpg[2:])
    return path


@pytest.mark.parametrize("order", ["<", ">"])
def test_exposure_from_exposure_time_fnumber_and_iso(tmp_path, order):
    p = jpeg_with_exif(tmp_path / "a.jpg", [(33434, 5, (1, 250)), (33437, 5, (28, 10)), (34855, 3, 400)], order)
    tags = read_exif(p)
    assert tags[33434] == pytest.approx(1 / 250) and tags[33437] == pytest.approx(2.8) and tags[34855] == 400
    assert exposure_ev(p) == pytest.approx(math.log2(1 / 250 / 2.8 ** 2 * 400), abs=1e-12)
    pil = pytest.importorskip("PIL.Image", reason="Pillow not installed: the cross-check with its EXIF reader skips")
    with pil.open(p) as im:
        sub = im.getexif().get_ifd(0x8769)
    assert float(sub[33434]) == pytest.approx(tags[33434]) and float(sub[33437]) == pytest.approx(tags[33437])
    assert int(sub[34855]) == tags[34855]


def test_gsplats_fallbacks_and_missing_values(tmp_path):
    # ShutterSpeedValue (APEX Tv) for the time, ApertureValue (Av) for the f-number, REI for the ISO
    p = jpeg_with_exif(tmp_path / "b.jpg", [(37377, 10, (8, 1)), (37378, 5, (3, 1)), (34858, 4, 200)])
    assert exposure_ev(p) == pytest.approx(math.log2(2.0 ** -8 / (2.0 ** 1.5) ** 2 * 200), abs=1e-12)
    only_iso = jpeg_with_exif(tmp_path / "c.jpg", [(34855, 3, 100)])  # missing ones count as 1
    assert exposure_ev(only_iso) == pytest.approx(math.log2(100))
    nothing = jpeg_with_exif(tmp_path / "d.jpg", [(41986, 3, 0)])  # EXIF without any of the three
    assert exposure_ev(nothing) is None
    zero = jpeg_with_exif(tmp_path / "e.jpg", [(33434, 5, (0, 1))])  # a zero time: no value
    assert exposure_ev(zero) is None
    png = tmp_path / "f.png"
    cv2.imwrite(str(png), np.zeros((4, 4, 3), np.uint8))
    plain = tmp_path / "g.jpg"
    cv2.imwrite(str(plain), np.zeros((4, 4, 3), np.uint8))
    assert read_exif(png) == {} and exposure_ev(png) is None and exposure_ev(plain) is None
    cut = tmp_path / "h.jpg"  # an EXIF block cut short: read as none, never an exception
    data = (tmp_path / "b.jpg").read_bytes()
    cut.write_bytes(data[:40])
    assert read_exif(cut) == {} and exposure_ev(cut) is None


def _scene_with_exif(root: Path, isos, missing=()):
    colmap_scene(root, n=len(isos), width=32, height=24, factors=(), seed=SEED, ext=".jpg")
    names = sorted(p.name for p in (root / "images").iterdir())
    for i, (name, iso) in enumerate(zip(names, isos)):
        tags = [] if i in missing else [(33434, 5, (1, 100)), (33437, 5, (4, 1)), (34855, 3, int(iso))]
        if tags:
            jpeg_with_exif(root / "images" / name, tags, seed=i)
    return names


def test_a_colmap_scenes_exposure_is_relative_to_the_captures_mean_and_batches_carry_it(tmp_path):
    rng = np.random.default_rng(SEED)
    print("seed", SEED)
    isos = rng.choice([100, 200, 400, 800, 1600], size=10)
    _scene_with_exif(tmp_path / "s", isos)
    ev = np.log2(1 / 100 / 16 * isos.astype(np.float64))
    rel = ev - ev.mean()  # over every image: the held-out ones (0 and 8) count too
    train = with_exposure(load_scene(tmp_path / "s", "train", format="colmap"))
    test = with_exposure(load_scene(tmp_path / "s", "test", format="colmap"))
    keep = [i for i in range(10) if i % 8]
    np.testing.assert_allclose(train.exposure, rel[keep], atol=1e-6)
    np.testing.assert_allclose(test.exposure, rel[[0, 8]], atol=1e-6)
    with ImageLoader(train, images_per_batch=2, seed=SEED, num_threads=1) as loader:
        for _ in range(4):
            b = next(loader)
            assert b["exposure"].dtype == torch.float32 and b["exposure"].shape == (2,)
            np.testing.assert_allclose(b["exposure"].numpy(), train.exposure[b["image_id"].numpy()], atol=0)
    plain = load_scene(tmp_path / "s", "train", format="colmap")  # not read: no key, as gsplat by default
    with ImageLoader(plain, seed=SEED, num_threads=1) as loader:
        assert "exposure" not in next(loader)


def test_a_split_with_and_without_exif_is_refused_in_one_line(tmp_path):
    _scene_with_exif(tmp_path / "s", [100] * 10, missing=(3,))
    scene = with_exposure(load_scene(tmp_path / "s", "train", format="colmap"))
    assert np.isnan(scene.exposure).sum() == 1
    with pytest.raises(ConfigError, match="no EXIF exposure") as e:
        ImageLoader(scene, seed=SEED)
    assert "\n" not in str(e.value) and "img_" in str(e.value)
    none = tmp_path / "t"
    _scene_with_exif(none, [100] * 10, missing=range(10))  # no image has one: no key (gsplat: none loaded)
    with ImageLoader(with_exposure(load_scene(none, "train", format="colmap")), seed=SEED, num_threads=1) as loader:
        assert "exposure" not in next(loader)


def test_exposure_is_read_for_colmap_scenes_only(tmp_path):
    from dali_nerf.scenegen import make_scene

    root = make_scene("objects", tmp_path / "o", width=16, n_train=2, n_val=1, n_test=1, seed=SEED)
    with pytest.raises(SceneError, match="COLMAP scenes") as e:
        with_exposure(load_scene(root, "train"))
    assert "\n" not in str(e.value)


def test_the_config_key_reads_it(tmp_path):
    from dali_nerf.config import load_config
    from dali_nerf.scenes import scene_from_config

    _scene_with_exif(tmp_path / "s", [100, 200] * 5)
    base = ["method=splat", f"scene.path={tmp_path / 's'}", "scene.format=colmap", "train.device=cpu"]
    assert scene_from_config(load_config(None, base)).exposure is None  # off by default, as gsplat's flag
    on = scene_from_config(load_config(None, base + ["scene.exposure=true"]))
    assert on.exposure is not None and np.isfinite(on.exposure).all()
    with pytest.raises(ConfigError, match="scene.exposure") as e:
        load_config(None, base + ["scene.exposure=3"])
    assert "\n" not in str(e.value)
