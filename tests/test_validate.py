"""Image header checks (dali_nerf.data.imageio) and `dali-nerf validate` on tiny scenes in tmp_path."""

from __future__ import annotations

import struct
import zlib

import cv2
import numpy as np
import pytest

from dali_nerf.cli.main import main as cli_main
from dali_nerf.errors import DataError, SceneError
from dali_nerf.data.imageio import MAX_PIXELS, check_image, decode_image_cv2, read_header
from dali_nerf.cli.validate import validate_scene

from test_scenes import assert_one_line, make_blender, make_llff, make_mega_nerf, make_nerfstudio


def png_bytes(w, h, colour=2, depth=8, rows=None) -> bytes:
    """A PNG written by hand (independent of OpenCV): rows = raw scanline bytes without filter."""
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    if rows is None:
        rows = [bytes(w * {0: 1, 2: 3, 4: 2, 6: 4}[colour] * depth // 8)] * h
    raw = b"".join(b"\x00" + r for r in rows)
    ihdr = struct.pack(">IIBBBBB", w, h, depth, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def test_header_matches_decoded(tmp_path):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (18, 24, 3), dtype=np.uint8)
    for name, params in (("a.png", []), ("a.jpg", [cv2.IMWRITE_JPEG_QUALITY, 95]), ("p.jpg", [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])):
        cv2.imwrite(str(tmp_path / name), img, params)
        h = check_image(tmp_path / name, expected_wh=(24, 18))
        assert (h.width, h.height, h.channels, h.bit_depth) == (24, 18, 3, 8)
        assert h.format == ("png" if name.endswith("png") else "jpeg")
        out = decode_image_cv2(tmp_path / name)
        assert out.shape == (18, 24, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(decode_image_cv2(tmp_path / "a.png"), img[:, :, ::-1])  # BGR on disk -> RGB
    # JPEG with a big APP segment before the frame header: the reader seeks over it
    data = (tmp_path / "a.jpg").read_bytes()
    app = b"\xff\xe1" + struct.pack(">H", 40002) + bytes(40000)
    (tmp_path / "exif.jpg").write_bytes(data[:2] + app + data[2:])
    assert read_header(tmp_path / "exif.jpg").width == 24


def test_corrupt_png_refused(tmp_path):
    good = png_bytes(24, 18)
    p = tmp_path / "bad.png"
    p.write_bytes(good[:23] + bytes([good[23] ^ 0x40]) + good[24:])  # flip a bit of IHDR's height: CRC mismatch
    with pytest.raises(DataError) as e:
        check_image(p)
    assert_one_line(e, "bad.png", "corrupt PNG")
    p.write_bytes(b"GIF89a" + bytes(40))
    with pytest.raises(DataError) as e:
        read_header(p)
    assert_one_line(e, "bad.png", "not a PNG or JPEG")
    p.write_bytes(good[:-12])  # no IEND
    with pytest.raises(DataError) as e:
        check_image(p)
    assert_one_line(e, "bad.png", "truncated")
    with pytest.raises(DataError) as e:
        check_image(tmp_path / "absent.png")
    assert_one_line(e, "absent.png", "not found")


def test_truncated_jpeg_refused(tmp_path):
    img = np.random.default_rng(1).integers(0, 255, (18, 24, 3), dtype=np.uint8)
    cv2.imwrite(str(tmp_path / "a.jpg"), img)
    data = (tmp_path / "a.jpg").read_bytes()
    t = tmp_path / "trunc.jpg"
    t.write_bytes(data[: len(data) // 2])  # header intact, scan data cut
    with pytest.raises(DataError) as e:
        check_image(t)
    assert_one_line(e, "trunc.jpg", "truncated JPEG")
    with pytest.raises(DataError) as e:
        decode_image_cv2(t)  # OpenCV alone would return a half-grey image here
    assert_one_line(e, "trunc.jpg", "truncated")
    t.write_bytes(data[:30])  # cut inside the header segments
    with pytest.raises(DataError) as e:
        read_header(t)
    assert_one_line(e, "trunc.jpg", "truncated")


def test_size_mismatch_and_bomb_refused_from_header(tmp_path):
    p = tmp_path / "a.png"
    p.write_bytes(png_bytes(24, 18))
    with pytest.raises(DataError) as e:
        check_image(p, expected_wh=(18, 24))
    assert_one_line(e, "a.png", "24x18", "18x24")
    # a header claiming 100000 x 100000 with (almost) no data: refused before any decoding
    bomb = tmp_path / "bomb.png"
    full = png_bytes(1, 1)
    ihdr = struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr) & 0xFFFFFFFF)
    bomb.write_bytes(full[:8] + chunk + full[33:])
    assert read_header(bomb).width == 100000
    assert 100000 * 100000 > MAX_PIXELS
    for fn in (check_image, decode_image_cv2):
        with pytest.raises(DataError) as e:
            fn(bomb)
        assert_one_line(e, "bomb.png", "decompression bomb", "100000x100000")
    assert check_image(p, max_pixels=24 * 18).width == 24
    with pytest.raises(DataError):
        check_image(p, max_pixels=24 * 18 - 1)


def test_16bit_and_gray_handled(tmp_path):
    g16 = np.array([[0, 257, 65535, 32896]], np.uint16).repeat(3, 0)  # 4x3 gray, 16-bit
    cv2.imwrite(str(tmp_path / "g16.png"), g16)
    h = check_image(tmp_path / "g16.png", expected_wh=(4, 3))
    assert (h.channels, h.bit_depth) == (1, 16)
    out = decode_image_cv2(tmp_path / "g16.png")
    assert out.shape == (3, 4, 3) and out.dtype == np.uint8  # gray -> RGB, 16 -> 8 bit
    np.testing.assert_array_equal(out[0, :, 0], [0, 1, 255, 128])  # round(v * 255 / 65535)
    assert (out[..., 0] == out[..., 2]).all()
    rgba16 = np.zeros((2, 2, 4), np.uint16)
    rgba16[..., 2] = 65535  # red in BGRA
    rgba16[..., 3] = 32768
    cv2.imwrite(str(tmp_path / "rgba16.png"), rgba16)
    out = decode_image_cv2(tmp_path / "rgba16.png")
    assert out.shape == (2, 2, 4)
    np.testing.assert_array_equal(out[0, 0], [255, 0, 0, 128])
    ga = tmp_path / "ga.png"  # gray + alpha, written by hand
    ga.write_bytes(png_bytes(2, 1, colour=4, rows=[bytes([10, 200, 30, 40])]))
    assert read_header(ga).channels == 2
    np.testing.assert_array_equal(decode_image_cv2(ga)[0], [[10, 10, 10, 200], [30, 30, 30, 40]])
    gj = tmp_path / "g.jpg"
    cv2.imwrite(str(gj), np.full((8, 8), 77, np.uint8))
    assert read_header(gj).channels == 1
    assert decode_image_cv2(gj).shape == (8, 8, 3)


# ---------------------------------------------------------------- validate_scene -----------------
def test_validate_all_formats(tmp_path, capsys):
    makers = {"blender": make_blender, "nerfstudio": make_nerfstudio, "llff": make_llff, "mega_nerf": make_mega_nerf}
    for name, make in makers.items():
        root = tmp_path / name
        root.mkdir()
        make(root)
        scenes = validate_scene(root, progress=False)
        assert all(s.format == name for s in scenes)
        expected = {"blender": ["train", "val", "test"], "mega_nerf": ["train", "val"]}.get(name, ["train", "val", "test"])
        assert [s.split for s in scenes] == expected
        assert cli_main(["validate", str(root)]) == 0
        out = capsys.readouterr().out
        assert "all image headers OK" in out and "train" in out
    assert cli_main(["validate", str(tmp_path / "llff"), "--split", "test", "--format", "llff"]) == 0


def test_validate_catches_every_image(tmp_path, capsys):
    make_blender(tmp_path)
    # a Blender frame with a different size than the first (parse reads only the first header)
    cv2.imwrite(str(tmp_path / "train" / "r_2.png"), np.zeros((18, 26, 3), np.uint8))
    assert load_ok(tmp_path)
    with pytest.raises(DataError) as e:
        validate_scene(tmp_path, progress=False)
    assert_one_line(e, "r_2.png", "26x18", "25x18")
    assert cli_main(["validate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "r_2.png" in err and err.count("\n") == 1
    cv2.imwrite(str(tmp_path / "train" / "r_2.png"), np.zeros((18, 25, 3), np.uint8))
    data = (tmp_path / "test" / "r_1.png").read_bytes()
    (tmp_path / "test" / "r_1.png").write_bytes(data[: len(data) - 30])
    with pytest.raises(DataError) as e:
        validate_scene(tmp_path, progress=False)
    assert_one_line(e, "test/r_1.png", "truncated")


def test_validate_downscaled_compares_on_disk_size(tmp_path):
    make_nerfstudio(tmp_path)
    s = validate_scene(tmp_path, splits=["train"], progress=False)[0]
    assert s.width[0] == 24
    cv2.imwrite(str(tmp_path / "images" / "frame_00003.png"), np.zeros((18, 23, 3), np.uint8))
    with pytest.raises(DataError) as e:
        validate_scene(tmp_path, splits=["train"], progress=False)
    assert_one_line(e, "frame_00003.png", "23x18", "24x18")


def test_validate_bad_args(tmp_path):
    with pytest.raises(SceneError) as e:
        validate_scene(tmp_path)
    assert_one_line(e, "unknown scene format")
    with pytest.raises(SceneError):
        validate_scene(tmp_path, format="nope")


def load_ok(root) -> bool:
    from dali_nerf.scenes import load_scene

    return load_scene(root, "train").num_images == 4
