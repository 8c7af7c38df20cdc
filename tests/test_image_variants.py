"""Every JPEG variant and PNG colour type a capture may hold: decoded right through the real image
cache, or refused in one line naming the file; never silently wrong.

The reference is an independent decode: PIL (it links the same libjpeg-turbo and zlib family as
DALI's CPU decoder and OpenCV; the pixels of every JPEG variant here agree bit for bit, so the
tolerance is 0), composited over the scene background with the cache's integer formula; OpenCV
for 16-bit PNGs (PIL truncates 16-bit samples instead of rounding them). The variants PIL cannot
write (arithmetic coding, 4:4:0 / 4:1:1 / 4:1:0, RGB-coded, lossless, 12-bit, hierarchical) are
small committed files, ``tests/data/jpeg/`` (README.md there: how each was made).

The property test draws scenes of 1-4 images over colour type x chroma subsampling x progressive
x size (1-40 pixels a side, odd sizes included) x trailing bytes, seeded by the drawn seed
(hypothesis prints the falsifying example), and compares every cached pixel; one test follows a
gray-JPEG scene through ``RayLoader`` to the rays (gray JPEGs were the silent defect: DALI's
``ANY_DATA`` decode wrote them out of bounds, a stretched crop of the picture or a crash).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import cv2
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image

from dali_nerf.data.finish import background_u8
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.data.imageio import check_image, read_header
from dali_nerf.errors import DataError
from dali_nerf.scenes.base import Scene

FIXTURES = Path(__file__).parent / "data" / "jpeg"
BG = (0.2, 0.6, 0.9)
DECODED = ("arith_420.jpg", "arith_progressive_422.jpg", "arith_gray.jpg", "sample_440.jpg", "sample_411.jpg",
           "sample_410.jpg", "sample_mixed.jpg", "sample_3x2.jpg", "rgb_colourspace.jpg", "restart_444.jpg",
           "lossless_rgb.jpg", "lossless_gray.jpg")
REFUSED = {"bits12_rgb.jpg": "12-bit JPEG is not supported", "bits12_gray.jpg": "12-bit JPEG is not supported",
           "hierarchical_sof5.jpg": "hierarchical JPEG (SOF5) is not supported"}


def scene_of(root: Path, paths, sizes, background_mode: str = "color") -> Scene:
    n = len(paths)
    c2w = np.tile(np.eye(4)[:3], (n, 1, 1))
    c2w[:, 2, 3] = 3.0 + np.arange(n)
    wh = np.array(sizes, np.int64).reshape(n, 2)
    K = np.stack([wh[:, 0] * 1.0, wh[:, 0] * 1.0, wh[:, 0] / 2, wh[:, 1] / 2], 1)
    return Scene(image_paths=[str(p) for p in paths], c2w=c2w, intrinsics=K, width=wh[:, 0], height=wh[:, 1],
                 split="train", format="blender", root=str(root), near=np.full(n, 0.5), far=np.full(n, 6.0),
                 background=BG, background_mode=background_mode)


def over_bg(rgba: np.ndarray) -> np.ndarray:
    """(h, w, 4) 8-bit values -> (h, w, 3) uint8 over BG: round((rgb a + bg (255 - a)) / 255)."""
    bg8 = background_u8(np.float32(BG)).astype(np.int64)
    rgb, a = rgba[:, :, :3].astype(np.int64), rgba[:, :, 3:].astype(np.int64)
    return ((2 * (rgb * a + bg8 * (255 - a)) + 255) // 510).astype(np.uint8)


def reference(path) -> np.ndarray:
    """The independent decode of ``path``, over BG: PIL, or OpenCV for a 16-bit PNG."""
    data = Path(path).read_bytes()
    if not (data[:8] == b"\x89PNG\r\n\x1a\n" and data[24] == 16):  # IHDR's bit depth
        with Image.open(path) as im:
            return over_bg(np.asarray(im.convert("RGBA")))
    a = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    a = (a.astype(np.int64) * 255 + 32767) // 65535  # round(v / 257)
    a = a[:, :, None] if a.ndim == 2 else a
    if a.shape[2] in (3, 4):
        a = a[:, :, [2, 1, 0, 3][:a.shape[2]]]  # BGR(A) -> RGB(A)
    if a.shape[2] in (1, 3):
        a = np.concatenate([np.repeat(a, 3 // a.shape[2], 2), np.full(a.shape[:2] + (1,), 255)], 2)
    return over_bg(a)


def cached(cache, i) -> np.ndarray:
    return np.asarray(cache.image(i))


def test_jpeg_fixtures_decode_like_pil(tmp_path):
    """The committed variants PIL cannot write: every pixel of the cache equals PIL's decode, and
    PIL's decode is the picture (within the codec's loss of ``source.png``; exact when lossless)."""
    src = np.asarray(Image.open(FIXTURES / "source.png").convert("RGB"), np.int64)
    paths = [FIXTURES / n for n in DECODED]
    scene = scene_of(tmp_path, paths, [(37, 23)] * len(paths))
    cache = decode_cache(scene)
    for i, p in enumerate(paths):
        ref = reference(p)
        assert np.array_equal(cached(cache, i), ref), p.name
        with Image.open(p) as im:
            pil = np.asarray(im.convert("RGB"), np.int64)
        gray = im.mode == "L"
        want = np.repeat(src[:, :, 1:2], 3, 2) if gray else src
        err = np.abs(pil - want)
        psnr = 10 * np.log10(255**2 / max(float((err**2).mean()), 1e-12))
        assert psnr > (100 if p.name.startswith("lossless") else 25), (p.name, psnr)  # 26.5-40 dB lossy here
    assert [read_header(p).decoder for p in paths].count("opencv") == 2  # the two gray files


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_jpeg_fixtures_nothing_decodes_are_refused_in_one_line(name, tmp_path):
    p = FIXTURES / name
    for call in (lambda: check_image(p), lambda: decode_cache(scene_of(tmp_path, [p], [(37, 23)]))):
        with pytest.raises(DataError) as e:
            call()
        msg = str(e.value)
        assert msg.startswith(str(p)) and REFUSED[name] in msg and "\n" not in msg, msg


# ------------------------------------------------------------------------------ property test

def _picture(rng, w: int, h: int, channels: int, top: int = 255) -> np.ndarray:
    """Smooth gradients plus noise (JPEG-like content and hard edges), (h, w, channels)."""
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * top // max(1, w - 1), y * top // max(1, h - 1), (x + y) * top // max(1, w + h - 2)] * 2, -1)
    noise = rng.integers(0, top // 4 + 1, (h, w, 6))
    return np.clip(base + noise - top // 8, 0, top)[:, :, :channels].astype(np.uint16 if top > 255 else np.uint8)


JPEG_KINDS = ("jpeg_gray", "jpeg_rgb")
PNG_KINDS = ("png_L", "png_LA", "png_P", "png_P_trns", "png_RGB", "png_RGBA", "png_1bit", "png_gray16",
             "png_rgb16", "png_rgba16", "png_APNG")


def write_image(path: Path, kind: str, w: int, h: int, rng, draw) -> Path:
    """One image of ``kind`` with drawn encoder options; returns the path written."""
    if kind.startswith("jpeg"):
        path = path.with_suffix(".jpg")
        a = _picture(rng, w, h, 1 if kind == "jpeg_gray" else 3)
        opts = dict(quality=draw(st.integers(40, 100)), progressive=draw(st.booleans()), optimize=draw(st.booleans()))
        if kind == "jpeg_rgb":
            opts["subsampling"] = draw(st.sampled_from(["4:4:4", "4:2:2", "4:2:0"]))
        if draw(st.booleans()):
            opts["restart_marker_blocks"] = draw(st.integers(1, 4))
        Image.fromarray(a[:, :, 0] if a.shape[2] == 1 else a).save(path, "JPEG", **opts)
        return path
    path = path.with_suffix(".png")
    if kind in ("png_rgb16", "png_rgba16"):  # PIL writes no 16-bit colour PNG; OpenCV does (BGR order)
        a = _picture(rng, w, h, 3 if kind == "png_rgb16" else 4, top=65535)
        if kind == "png_rgba16":
            a[0, 0, 3] = 0
        assert cv2.imwrite(str(path), np.ascontiguousarray(a[:, :, [2, 1, 0, 3][:a.shape[2]]]))
        return path
    if kind == "png_APNG":  # animated: every decoder here takes the default image, the first frame
        frames = [Image.fromarray(_picture(rng, w, h, 3)) for _ in range(draw(st.integers(2, 3)))]
        frames[0].save(path, "PNG", save_all=True, append_images=frames[1:], duration=100)
        return path
    if kind == "png_gray16":
        im = Image.fromarray(_picture(rng, w, h, 1, top=65535)[:, :, 0])  # mode I;16
    elif kind == "png_1bit":
        im = Image.fromarray(_picture(rng, w, h, 1)[:, :, 0] > 127)
    elif kind.startswith("png_P"):
        n = draw(st.sampled_from([2, 4, 16, 256]))
        im = Image.fromarray((_picture(rng, w, h, 1)[:, :, 0].astype(np.int64) % n).astype(np.uint8), "P")
        im.putpalette(rng.integers(0, 256, 3 * n).astype(np.uint8).tobytes())
        if kind == "png_P_trns":
            im.info["transparency"] = rng.integers(0, 256, max(1, n // 2)).astype(np.uint8).tobytes()
    else:
        mode = kind[4:]
        a = _picture(rng, w, h, len(mode))
        if "A" in mode:
            a[0, 0, -1] = 0
        im = Image.fromarray(a[:, :, 0] if a.shape[2] == 1 else a, mode)
    im.save(path, "PNG", transparency=im.info.get("transparency"), optimize=draw(st.booleans()))
    return path


@settings(max_examples=30)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_every_variant_through_the_cache_equals_an_independent_decode(data, seed):
    draw = data.draw
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="variants-") as tmp:
        root = Path(tmp)
        n = draw(st.integers(1, 4))
        paths, sizes = [], []
        for i in range(n):
            kind = draw(st.sampled_from(JPEG_KINDS + PNG_KINDS))
            w, h = draw(st.integers(1, 40)), draw(st.integers(1, 40))
            p = write_image(root / f"img_{i}", kind, w, h, rng, draw)
            if draw(st.booleans()):  # bytes after IEND / EOI: PIL, libpng and libjpeg ignore them
                with open(p, "ab") as f:
                    f.write(rng.integers(0, 256, draw(st.sampled_from([1, 100, 70_000])), dtype=np.uint8).tobytes())
            paths.append(p)
            sizes.append((w, h))
        world = draw(st.integers(1, n))
        got = {}
        for rank in range(world):
            cache = decode_cache(scene_of(root, paths, sizes), rank, world)
            got.update({int(cam): cached(cache, k) for k, cam in enumerate(cache.layout[:, 3])})
        assert sorted(got) == list(range(n))
        for i, p in enumerate(paths):
            ref = reference(p)
            assert got[i].shape == ref.shape and np.array_equal(got[i], ref), \
                (p.name, read_header(p), int(np.abs(got[i].astype(int) - ref).max()))


# ------------------------------------------------------------------------------ rays

def test_gray_jpeg_scene_rays_carry_the_pictures_colours(tmp_path):
    """A monochrome capture (gray JPEGs, odd sizes, mixed with RGB ones) through RayLoader: one
    epoch's rays visit every pixel once, and each ray's colour is its pixel's in PIL's decode."""
    from dali_nerf import RayLoader

    rng = np.random.default_rng(39)
    sizes = [(37, 23), (24, 17), (31, 31), (16, 9)]
    paths = []
    for i, (w, h) in enumerate(sizes):
        a = _picture(rng, w, h, 1 if i != 2 else 3)
        p = tmp_path / f"ir_{i}.jpg"
        Image.fromarray(a[:, :, 0] if a.shape[2] == 1 else a).save(p, "JPEG", quality=90, progressive=i == 1)
        paths.append(p)
    scene = scene_of(tmp_path, paths, sizes)
    P = int(sum(w * h for w, h in sizes))
    with RayLoader(scene, rays_per_batch=P, mode="epoch", seed=7, prefetch=0) as loader:
        batch = next(iter(loader))
    idx = batch["indices"].numpy()
    assert len(np.unique(idx[:, 0] * 10_000 + idx[:, 1] * 100 + idx[:, 2])) == P
    refs = [reference(p) for p in paths]
    want = np.stack([refs[c][r, col] for c, r, col in idx]).astype(np.float32) / 255
    wrong = np.abs(batch["rgb"].numpy() - want).max(axis=1) > 0.5 / 255
    assert not wrong.any(), f"{wrong.mean():.1%} of rays off, first at {idx[np.argmax(wrong)]}"


def test_bytes_after_the_end_are_accepted_and_truncation_still_refused(tmp_path):
    """PNG with bytes after IEND, JPEG with 200 KB after EOI (a motion photo's video): decoded.
    Cut files are refused, including a JPEG whose metadata (an EXIF thumbnail) holds an ``FFD9``
    before the frame header: the end marker counts only after it."""
    rng = np.random.default_rng(5)
    a = _picture(rng, 29, 19, 3)
    png, jpg = tmp_path / "trail.png", tmp_path / "trail.jpg"
    Image.fromarray(a).save(png)
    Image.fromarray(a).save(jpg, quality=90)
    full_png, full_jpg = png.read_bytes(), jpg.read_bytes()
    png.write_bytes(full_png + b"written by a tool after IEND" * 3)
    jpg.write_bytes(full_jpg + os.urandom(200_000))
    cache = decode_cache(scene_of(tmp_path, [png, jpg], [(29, 19)] * 2))
    assert np.array_equal(cached(cache, 0), reference(png)) and np.array_equal(cached(cache, 1), reference(jpg))

    thumb = b"Exif\x00\x00" + b"\xff\xd8 a thumbnail \xff\xd9"
    app1 = b"\xff\xe1" + (len(thumb) + 2).to_bytes(2, "big") + thumb
    with_thumb = full_jpg[:2] + app1 + full_jpg[2:]
    cut = {"cut.png": full_png[:-12] + b"\x00" * 40, "cut.jpg": full_jpg[: len(full_jpg) * 2 // 3],
           "cut_thumb.jpg": with_thumb[: len(with_thumb) * 2 // 3]}
    for name, data in cut.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError) as e:
            decode_cache(scene_of(tmp_path, [tmp_path / name], [(29, 19)]))
        msg = str(e.value)
        assert msg.startswith(str(tmp_path / name)) and "truncated" in msg and "\n" not in msg, msg
