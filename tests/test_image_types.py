"""Every PNG colour type and bit depth, and the odd files a new user meets, through the decode stage.

The PNGs are written here byte by byte (zlib + chunks, Adam7 interlacing too), independent of the
decoders under test; the expected pixels come from the arrays written, expanded to 8 bits and
composited over the scene's background in numpy (exact integer math: the decode stage's
``round((rgb * a + bg8 * (255 - a)) / 255)``), and PIL, a third decoder, checks that reference for
the 8-bit files. Every file is compared pixel for pixel, exactly. Odd files (lying extensions,
EXIF orientation, CMYK, empty, damaged) get the right colours or one line naming the file.
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from dali_nerf.errors import DataError
from dali_nerf.data.imageio import read_header
from dali_nerf.data.finish import background_u8
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.scenes.base import Scene

BG = (0.2, 0.6, 0.9)
W, H = 13, 7  # odd sizes: sub-byte rows end mid-byte, Adam7 passes are uneven

ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _rows(a: np.ndarray, depth: int) -> list:
    """(h, w, c) samples -> packed scanlines (big-endian 16-bit, MSB-first sub-byte)."""
    out = []
    for row in a:
        v = row.reshape(-1).astype(np.int64)
        if depth == 16:
            out.append(v.astype(">u2").tobytes())
        elif depth == 8:
            out.append(v.astype(np.uint8).tobytes())
        else:
            per = 8 // depth
            v = np.concatenate([v, np.zeros((-len(v)) % per, np.int64)]).reshape(-1, per)
            shifts = 8 - depth * np.arange(1, per + 1)
            out.append((v << shifts).sum(1).astype(np.uint8).tobytes())
    return out


def write_png(path: Path, a: np.ndarray, depth: int, colour: int, palette=None, trns: bytes = None,
              interlace: bool = False) -> Path:
    """A PNG of samples ``a`` (h, w[, c]) written from scratch (filter type 0 on every row)."""
    a = a[:, :, None] if a.ndim == 2 else a
    passes = [a[y0::dy, x0::dx] for x0, y0, dx, dy in ADAM7] if interlace else [a]
    raw = b"".join(b"\x00" + r for p in passes if p.size for r in _rows(p, depth))
    png = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", a.shape[1], a.shape[0], depth, colour, 0, 0,
                                                              int(interlace)))
    if palette is not None:
        png += _chunk(b"PLTE", np.asarray(palette, np.uint8).tobytes())
    if trns is not None:
        png += _chunk(b"tRNS", trns)
    path.write_bytes(png + _chunk(b"IDAT", zlib.compress(raw)) + _chunk(b"IEND", b""))
    return path


def to8(v: np.ndarray, depth: int) -> np.ndarray:
    """Samples of ``depth`` bits -> 8 bits: exact scaling below 8, round(v / 257) for 16."""
    v = np.asarray(v, np.float64)
    return np.floor(v * 255.0 / (2**depth - 1) + 0.5)


def over_bg(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """(h, w, 3) and (h, w) 8-bit values -> (h, w, 3) uint8 composited over BG, exactly."""
    bg8 = background_u8(np.float32(BG)).astype(np.float64)  # the Scene holds its background as float32
    return np.floor((rgb * alpha[:, :, None] + bg8 * (255.0 - alpha[:, :, None])) / 255.0 + 0.5).astype(np.uint8)


def cases(rng) -> dict:
    """name -> (png kwargs, expected (H, W, 3) uint8 over BG, has alpha). Every colour type and
    bit depth of the PNG standard, each with and without tRNS where the standard allows it."""
    out = {}
    opaque = np.full((H, W), 255.0)
    for depth in (1, 2, 4, 8, 16):
        g = rng.integers(0, 2**depth, (H, W))
        out[f"gray{depth}"] = (dict(a=g, depth=depth, colour=0), over_bg(np.repeat(to8(g, depth)[:, :, None], 3, 2), opaque), False)
        key = int(g[1, 2])  # a colour key some pixels have
        out[f"gray{depth}_trns"] = (dict(a=g, depth=depth, colour=0, trns=struct.pack(">H", key)),
                                    over_bg(np.repeat(to8(g, depth)[:, :, None], 3, 2), np.where(g == key, 0.0, 255.0)), True)
    for depth in (8, 16):
        ga = rng.integers(0, 2**depth, (H, W, 2))
        ga[0, :3, 1] = (0, 2**depth - 1, 2**(depth - 1))  # transparent, opaque, half
        out[f"gray_alpha{depth}"] = (dict(a=ga, depth=depth, colour=4),
                                     over_bg(np.repeat(to8(ga[:, :, :1], depth), 3, 2), to8(ga[:, :, 1], depth)), True)
        rgb = rng.integers(0, 2**depth, (H, W, 3))
        out[f"rgb{depth}"] = (dict(a=rgb, depth=depth, colour=2), over_bg(to8(rgb, depth), opaque), False)
        key = rgb[3, 4].copy()
        hit = np.all(rgb == key, axis=2)
        out[f"rgb{depth}_trns"] = (dict(a=rgb, depth=depth, colour=2, trns=struct.pack(">HHH", *map(int, key))),
                                   over_bg(to8(rgb, depth), np.where(hit, 0.0, 255.0)), True)
        rgba = rng.integers(0, 2**depth, (H, W, 4))
        rgba[0, :3, 3] = (0, 2**depth - 1, 2**(depth - 1))
        out[f"rgba{depth}"] = (dict(a=rgba, depth=depth, colour=6), over_bg(to8(rgba[:, :, :3], depth), to8(rgba[:, :, 3], depth)), True)
    for depth in (1, 2, 4, 8):
        n = min(2**depth, 40)
        pal = rng.integers(0, 256, (n, 3))
        pal[0] = 0  # the transparent entry is black, as PIL and image editors write it
        idx = rng.integers(0, n, (H, W))
        idx[0, :2] = (0, n - 1)
        rgb = pal[idx].astype(np.float64)
        out[f"palette{depth}"] = (dict(a=idx, depth=depth, colour=3, palette=pal), over_bg(rgb, opaque), False)
        alphas = rng.integers(0, 256, max(1, n // 2))  # entries past the chunk are opaque
        alphas[0] = 0
        full = np.concatenate([alphas, np.full(n - len(alphas), 255)]).astype(np.float64)
        out[f"palette{depth}_trns"] = (dict(a=idx, depth=depth, colour=3, palette=pal, trns=alphas.astype(np.uint8).tobytes()),
                                       over_bg(rgb, full[idx]), True)
    return out


def scene_of(root: Path, paths, sizes=None, background_mode="color") -> Scene:
    n = len(paths)
    c2w = np.tile(np.eye(4)[:3], (n, 1, 1))
    c2w[:, 2, 3] = 3.0 + np.arange(n)
    wh = np.array(sizes if sizes is not None else [(W, H)] * n)
    K = np.stack([wh[:, 0] * 1.0, wh[:, 0] * 1.0, wh[:, 0] / 2, wh[:, 1] / 2], 1)
    return Scene(image_paths=[str(p) for p in paths], c2w=c2w, intrinsics=K, width=wh[:, 0], height=wh[:, 1],
                 split="train", format="blender", root=str(root), near=np.full(n, 0.5), far=np.full(n, 6.0),
                 background=BG, background_mode=background_mode)


def cached(cache, i: int) -> np.ndarray:
    return np.asarray(cache.image(i))


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    """Every case, plain and Adam7-interlaced: (scene, names, expected images, has alpha)."""
    root = tmp_path_factory.mktemp("types")
    rng = np.random.default_rng(20240611)
    paths, names, expect, alpha = [], [], [], []
    for name, (kw, ref, has_alpha) in cases(rng).items():
        for interlace in (False, True):
            tag = f"{name}{'_adam7' if interlace else ''}"
            paths.append(write_png(root / f"{tag}.png", interlace=interlace, **kw))
            names.append(tag)
            expect.append(ref)
            alpha.append(has_alpha)
    return scene_of(root, paths), names, expect, alpha


def test_every_png_colour_type_and_depth_decodes_exactly(pngs):
    scene, names, expect, alpha = pngs
    cache = decode_cache(scene, 0, 1)
    wrong = [n for i, n in enumerate(names) if not np.array_equal(cached(cache, i), expect[i])]
    assert not wrong, f"pixels differ from the reference for {wrong}"
    for i, n in enumerate(names):
        h = read_header(scene.image_paths[i])
        assert (h.channels in (2, 4)) == alpha[i], (n, h)
        assert h.decoder == ("opencv" if "trns" in n or "gray_alpha" in n else "dali"), (n, h)


def test_shards_mixing_both_decoders_are_the_whole(pngs):
    """Shards where some files go to OpenCV and the rest to DALI: together exactly the whole."""
    scene, names, expect, _ = pngs
    for world in (2, 3):
        got = []
        for r in range(world):
            c = decode_cache(scene, r, world)
            got += [(int(c.layout[i, 3]), cached(c, i)) for i in range(c.num_images)]
        assert [g[0] for g in got] == list(range(scene.num_images))
        assert all(np.array_equal(img, expect[i]) for i, img in got)


def test_reference_agrees_with_pil(pngs):
    """PIL, a third decoder, composited the same way, agrees with the numpy reference on every
    8-bit-or-less file. Left out: 16-bit files (PIL reduces samples by truncation, not rounding)
    and the 1/2/4-bit gray colour keys (PIL compares the tRNS key with the samples scaled to 8
    bits; the PNG standard compares it at the file's bit depth)."""
    Image = pytest.importorskip("PIL.Image")
    scene, names, expect, _ = pngs
    checked = 0
    for i, n in enumerate(names):
        if "16" in n or n.split("_adam7")[0] in ("gray1_trns", "gray2_trns", "gray4_trns"):
            continue
        with Image.open(scene.image_paths[i]) as im:
            rgba = np.asarray(im.convert("RGBA"), np.float64)
        assert np.array_equal(over_bg(rgba[:, :, :3], rgba[:, :, 3]), expect[i]), n
        checked += 1
    assert checked >= 30


def test_alpha_from_trns_is_refused_where_nothing_composites(pngs, tmp_path):
    """background random / learned keep no alpha: a palette + tRNS PNG is now known to have one."""
    scene, names, _, _ = pngs
    i = names.index("palette8_trns")
    sc = scene_of(tmp_path, [scene.image_paths[i]], background_mode="random")
    with pytest.raises(DataError, match=r"palette8_trns\.png: has an alpha channel but scene.background=random"):
        decode_cache(sc)


def _jpeg(rgb: np.ndarray, **save) -> bytes:
    Image = pytest.importorskip("PIL.Image")
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buf, format="JPEG", quality=98, **save)
    return buf.getvalue()


def test_odd_files_a_new_user_meets(tmp_path):
    """Right colours, or one line naming the file."""
    Image = pytest.importorskip("PIL.Image")
    yy, xx = np.mgrid[0:16, 0:24]
    smooth = np.stack([xx * 10, yy * 15, np.full_like(xx, 90)], -1)
    # a JPEG saved as .png and a PNG saved as .jpg: decoded by their content
    jpeg_as_png = tmp_path / "photo.png"
    jpeg_as_png.write_bytes(_jpeg(smooth))
    png_as_jpg = write_png(tmp_path / "render.jpg", smooth.astype(np.uint8), 8, 2)
    # EXIF orientation 6 (rotate 90 on display): pixels as stored, at the size the header states
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = tmp_path / "rotated.jpg"
    rotated.write_bytes(_jpeg(smooth, exif=exif))
    sc = scene_of(tmp_path, [jpeg_as_png, png_as_jpg, rotated], sizes=[(24, 16)] * 3)
    cache = decode_cache(sc)
    assert np.array_equal(cached(cache, 1), smooth.astype(np.uint8))
    for i in (0, 2):  # JPEG: within the codec's rounding of an independent decode (PIL, no transpose)
        with Image.open(sc.image_paths[i]) as im:
            ref = np.asarray(im.convert("RGB"), np.int64)
        assert cached(cache, i).shape == (16, 24, 3)
        assert np.abs(cached(cache, i).astype(np.int64) - ref).max() <= 2, sc.image_paths[i]
        assert np.abs(cached(cache, i).astype(np.int64) - smooth).mean() < 2.0

    # refused in one line naming the file
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    cmyk = tmp_path / "cmyk.jpg"
    buf = io.BytesIO()
    Image.fromarray(smooth.astype(np.uint8)).convert("CMYK").save(buf, format="JPEG")
    cmyk.write_bytes(buf.getvalue())
    damaged = write_png(tmp_path / "damaged_trns.png", np.arange(16 * 24).reshape(16, 24) % 4, 8, 3,
                        palette=np.arange(12).reshape(4, 3) * 20, trns=b"\x00\x80")
    raw = bytearray(damaged.read_bytes())
    at = raw.index(b"IDAT") + 8
    raw[at:at + 6] = b"\xff" * 6  # broken zlib data, header and tail intact
    damaged.write_bytes(bytes(raw))
    text = tmp_path / "notes.png"
    text.write_text("these are my notes, not an image\n")
    for path, words in ((empty, "empty file"), (cmyk, "CMYK/YCCK JPEG is not supported"),
                        (damaged, "cannot be decoded"), (text, "not a PNG or JPEG file")):
        with pytest.raises(DataError) as e:
            decode_cache(scene_of(tmp_path, [path], sizes=[(24, 16)]))
        msg = str(e.value)
        assert msg.startswith(str(path)) and words in msg and "\n" not in msg, msg
