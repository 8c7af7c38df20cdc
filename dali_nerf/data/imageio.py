"""Image headers and safe image checks, without decoding.

:func:`read_header` reads only the first bytes of a PNG (signature + IHDR, CRC-checked) or a JPEG
(markers up to the first SOF segment, seeking over the others) and returns an
:class:`ImageHeader`. :func:`check_image` adds the checks that must happen *before* any decoder
touches the file: the pixel count limit (decompression bombs), the size the dataset declares, and
a cheap truncation check (a PNG must hold its ``IEND`` chunk, a JPEG its end-of-image marker ``FFD9``
after the frame header; one read of the file's last bytes finds them in almost every file, and a file with
bytes appended after them, which PIL, libpng and libjpeg ignore, is searched whole, once).

Decode policy (the image cache, ``dali_nerf/data/imagecache.py``, follows it; :func:`decode_image_cv2` is
the reference implementation):

* accepted: every PNG colour type and bit depth the PNG standard defines (gray 1/2/4/8/16-bit,
  gray+alpha 8/16, RGB 8/16, RGBA 8/16, palette 1/2/4/8), interlaced or not, with or without a
  ``tRNS`` chunk; 8-bit JPEG, gray (1 component) or 3 components (YCbCr, or RGB without a colour
  transform), baseline, extended or progressive, Huffman or arithmetic coded, lossless (SOF3), any
  chroma subsampling (4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1, 4:1:0, a factor per component) at any size;
  an animated PNG decodes to its default image (the first frame); bytes after a PNG's ``IEND`` or a
  JPEG's ``EOI`` are ignored. No colour management: ICC profiles and PNG ``gAMA`` / ``sRGB`` chunks
  are ignored, as PIL's and OpenCV's default decodes do. EXIF orientation is ignored: pixels are
  taken as stored, at the size the header (and the scene) states;
* 16-bit PNG is converted to 8-bit at decode, ``round(v * 255 / 65535)``;
* grayscale is expanded to RGB at decode (gray+alpha to RGBA); palette images decode to RGB(A);
* transparency from a ``tRNS`` chunk is alpha like an alpha channel's: a palette entry's alpha
  (entries past the chunk's end are opaque), or, for gray and RGB, alpha 0 where a pixel equals the
  chunk's colour key exactly (at the file's bit depth) and 255 elsewhere. Such files, and gray+alpha
  files, are decoded by OpenCV (:func:`decode_image_cv2`; :attr:`ImageHeader.decoder` says which)
  because DALI's decoder drops the ``tRNS`` alpha (transparent pixels would come out in the
  palette's colour, often black) and fails on gray+alpha; so are gray (1-component) JPEGs, which
  DALI 2.4's CPU decoder with ``output_type=ANY_DATA`` writes out of bounds (a stretched, enlarged
  crop of the picture, or a crash); every other file takes DALI's fast path, whose pixels equal
  PIL's and OpenCV's (the same libjpeg-turbo / libpng) bit for bit;
* RGBA is then composited over the scene background by the decode stage (not here), which
  then undistorts and area-downscales (``dali_nerf/data/finish.py``, ``finish_image``);
* refused, from the header: PNG bit depths below 8 with colour (invalid PNG), 12-bit (and 16-bit
  lossless) JPEG (DALI, PIL and OpenCV decode none), 4-component (CMYK/YCCK) JPEG, hierarchical JPEG
  (SOF5-7, 13-15: libjpeg has no decoder for it), images with more pixels than the limit (:func:`max_pixels_limit`:
  :data:`MAX_PIXELS` unless ``$DALI_NERF_MAX_PIXELS`` says otherwise), and sizes that do not match
  the dataset's declaration (the file's header never silently wins).

Every refusal is a :class:`dali_nerf.errors.DataError` with a one-line message naming the file.

>>> h = read_header("data/default/train/r_0.png")
>>> (h.width, h.height, h.channels, h.bit_depth, h.format)
(400, 400, 4, 8, 'png')
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import cv2
import numpy as np

from dali_nerf.errors import DataError

__all__ = ["ImageHeader", "read_header", "check_image", "decode_image_cv2", "MAX_PIXELS", "IMAGE_EXTENSIONS",
           "MAX_PIXELS_ENV", "max_pixels_limit", "check_pixel_limit"]

#: Default largest image accepted, in pixels (width * height): 16384 x 16384 = 2**28 (268 M
#: pixels, about 1 GiB as RGBA8). Anything larger is refused from its header (and from the size a
#: scene file declares) as a likely decompression bomb. Override with :data:`MAX_PIXELS_ENV`.
MAX_PIXELS = 16384 * 16384

#: Environment variable that sets the per-image pixel limit (a positive integer), read at each check.
MAX_PIXELS_ENV = "DALI_NERF_MAX_PIXELS"

#: File name extensions treated as images by the scene parsers (lower case).
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")

_PNG_SIG = b"\x89PNG\r\n\x1a\n"
_PNG_CHANNELS = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}  # colour type -> channels (palette decodes to RGB)
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
# SOF0..SOF15 except DHT (C4), JPG (C8), DAC (CC)
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_JPEG_HIERARCHICAL = {0xC5, 0xC6, 0xC7, 0xCD, 0xCE, 0xCF}  # differential SOFs: libjpeg decodes none
_JPEG_TAIL = 64 * 1024
_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the IEND chunk: no data, so a fixed length and CRC
_JPEG_EOI = b"\xff\xd9"


@dataclass(frozen=True)
class ImageHeader:
    """What an image header declares.

    Attributes:
        width, height: pixels.
        channels: what the image decodes to: 1 (gray), 2 (gray+alpha, or gray with a ``tRNS``
            colour key), 3 (RGB / YCbCr / palette), 4 (RGBA, palette or RGB with ``tRNS``; CMYK
            for JPEG).
        bit_depth: bits per channel sample (PNG 1..16, JPEG 8 or 12).
        format: "png" or "jpeg".
        colour_type: the PNG colour type (0 gray, 2 RGB, 3 palette, 4 gray+alpha, 6 RGBA); -1
            for JPEG.
        transparency: the PNG's ``tRNS`` chunk data (palette alphas, or a gray / RGB colour key
            as 16-bit big-endian samples), or None.
        sof: the JPEG's frame marker (0xC0 baseline, 0xC1 extended, 0xC2 progressive, 0xC3
            lossless, 0xC9-0xCB arithmetic, 0xC5-0xC7 / 0xCD-0xCF hierarchical); -1 for PNG.
        frame_end: byte offset where the header read ends (after the PNG's IHDR chunk, the JPEG's
            frame header): the image data, and so its end marker, lie beyond it.
    """

    width: int
    height: int
    channels: int
    bit_depth: int
    format: str
    colour_type: int = -1
    transparency: Optional[bytes] = None
    sof: int = -1
    frame_end: int = field(default=0, compare=False, repr=False)

    @property
    def decoder(self) -> str:
        """"dali" (the decode stage's fast path) or "opencv": the files DALI's decoder gets wrong
        (a PNG's ``tRNS`` chunk, whose alpha it drops; a gray JPEG, which it writes out of bounds)
        or refuses (gray+alpha PNG)."""
        if self.format == "png" and (self.colour_type == 4 or self.transparency is not None):
            return "opencv"
        if self.format == "jpeg" and self.channels == 1:
            return "opencv"
        return "dali"


def max_pixels_limit() -> int:
    """The per-image pixel limit in force: ``$DALI_NERF_MAX_PIXELS`` when set, else :data:`MAX_PIXELS`.

    Raises:
        DataError: the variable is set but is not a positive integer.
    """
    v = os.environ.get(MAX_PIXELS_ENV)
    if v is None or v.strip() == "":
        return MAX_PIXELS
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n <= 0:
        raise DataError(f"{MAX_PIXELS_ENV}={v!r}: must be a positive integer (pixels per image); unset it for the default {MAX_PIXELS}")
    return n


def check_pixel_limit(where, width: int, height: int, max_pixels: Optional[int] = None, what: str = "header declares") -> None:
    """Refuse an image of ``width`` x ``height`` above the pixel limit (decompression bombs).

    Args:
        where: the file (and frame) named in the message.
        width, height: the size the header or the scene file declares.
        max_pixels: the limit (None: :func:`max_pixels_limit`).
        what: the message's verb phrase ("header declares", "declares").
    Raises:
        DataError: one line naming ``where``, the size, the limit and how to raise it.
    """
    limit = max_pixels_limit() if max_pixels is None else int(max_pixels)
    n = int(width) * int(height)
    if n > limit:
        raise DataError(
            f"{where}: {what} {int(width)}x{int(height)} = {n} pixels, over the per-image limit of {limit} "
            f"(dali_nerf.data.imageio.MAX_PIXELS, or ${MAX_PIXELS_ENV}); refusing a possible decompression bomb; "
            f"downscale the image or raise the limit"
        )


def _bad(path, what: str) -> DataError:
    return DataError(f"{path}: {what}; replace or re-export the image")


def _png_header(path, f) -> ImageHeader:
    f.seek(8)
    chunk = f.read(25)
    if len(chunk) < 25:
        raise _bad(path, "truncated PNG header")
    length, ctype = struct.unpack(">I4s", chunk[:8])
    if ctype != b"IHDR" or length != 13:
        raise _bad(path, "corrupt PNG header (first chunk is not IHDR)")
    data, crc = chunk[8:21], struct.unpack(">I", chunk[21:25])[0]
    if zlib.crc32(b"IHDR" + data) & 0xFFFFFFFF != crc:
        raise _bad(path, "corrupt PNG header (IHDR checksum mismatch)")
    w, h, depth, colour, _comp, _filt, _interlace = struct.unpack(">IIBBBBB", data)
    if w == 0 or h == 0:
        raise _bad(path, f"PNG header declares an empty image {w}x{h}")
    if colour not in _PNG_DEPTHS or depth not in _PNG_DEPTHS[colour]:
        raise _bad(path, f"corrupt PNG header (colour type {colour} with bit depth {depth})")
    trns = _png_trns(f) if colour in (0, 2, 3) else None
    channels = _PNG_CHANNELS[colour] + (1 if trns is not None and colour != 3 else 0)
    if trns is not None and colour == 3:
        channels = 4
    return ImageHeader(int(w), int(h), channels, int(depth), "png", int(colour), trns, frame_end=8 + 25)


def _png_trns(f) -> Optional[bytes]:
    """The ``tRNS`` chunk's data, walking the chunks after IHDR (seeking over their data) up to the
    first ``IDAT`` (the standard puts ``tRNS`` before it); None without one. Damage met on the way
    (a length past the end, end of file) ends the walk: the tail check names truncation."""
    size = os.fstat(f.fileno()).st_size
    pos = 8 + 25
    for _ in range(4096):
        f.seek(pos)
        head = f.read(8)
        if len(head) < 8:
            return None
        length, ctype = struct.unpack(">I4s", head)
        if ctype in (b"IDAT", b"IEND") or pos + 12 + length > size:
            return None
        if ctype == b"tRNS":
            data = f.read(length)
            return data if len(data) == length and length > 0 else None
        pos += 12 + length
    return None


def _jpeg_header(path, f) -> ImageHeader:
    f.seek(2)
    while True:
        b = f.read(1)
        if not b:
            raise _bad(path, "truncated JPEG (no frame header before end of file)")
        if b != b"\xff":
            raise _bad(path, "corrupt JPEG (expected a marker)")
        m = f.read(1)
        while m == b"\xff":  # fill bytes
            m = f.read(1)
        if not m:
            raise _bad(path, "truncated JPEG header")
        marker = m[0]
        if marker == 0xD8 or 0xD0 <= marker <= 0xD7 or marker == 0x01:
            continue  # no length
        if marker in (0xD9, 0xDA):
            raise _bad(path, "corrupt JPEG (image data before any frame header)")
        lb = f.read(2)
        if len(lb) < 2:
            raise _bad(path, "truncated JPEG header")
        seg_len = struct.unpack(">H", lb)[0]
        if seg_len < 2:
            raise _bad(path, "corrupt JPEG (bad segment length)")
        if marker in _JPEG_SOF:
            frame_end = f.tell() - 2 + seg_len
            seg = f.read(6)
            if len(seg) < 6:
                raise _bad(path, "truncated JPEG frame header")
            precision, h, w, comps = struct.unpack(">BHHB", seg)
            if w == 0 or h == 0:
                raise _bad(path, f"JPEG frame header declares size {w}x{h} (unsupported or corrupt)")
            if comps not in (1, 3, 4):
                raise _bad(path, f"corrupt JPEG frame header ({comps} components)")
            return ImageHeader(int(w), int(h), int(comps), int(precision), "jpeg", sof=marker, frame_end=frame_end)
        f.seek(seg_len - 2, os.SEEK_CUR)


def read_header(path) -> ImageHeader:
    """Read the size, channels and bit depth of a PNG or JPEG from its header bytes only.

    Args:
        path: image file.
    Returns:
        :class:`ImageHeader`.
    Raises:
        DataError: missing file, unknown format, or a corrupt / truncated header (names the file).

    Example:
        >>> read_header("img.png")
        ImageHeader(width=24, height=18, channels=3, bit_depth=8, format='png')
    """
    try:
        with open(path, "rb") as f:
            sig = f.read(8)
            if sig == _PNG_SIG:
                return _png_header(path, f)
            if sig[:2] == b"\xff\xd8":
                return _jpeg_header(path, f)
    except FileNotFoundError:
        raise DataError(f"{path}: image file not found; check the scene's file list") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a folder, not an image file; fix the scene's file list") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(sig) == 0:
        raise _bad(path, "empty file")
    raise _bad(path, "not a PNG or JPEG file (unknown header)")


def _ends(fmt: str, buf, start: int) -> bool:
    """Whether ``buf`` (bytes or an mmap) holds the format's end at or after ``start``: the last
    ``IEND`` chunk of a PNG, or a JPEG's ``EOI`` marker (entropy-coded data cannot hold ``FFD9``:
    0xFF is stuffed there; starting past the frame header skips an EXIF thumbnail's own EOI)."""
    return (buf.rfind(_PNG_IEND, start) if fmt == "png" else buf.find(_JPEG_EOI, start)) >= 0


def _check_end(path, h: ImageHeader, tail: bytes, size: int, whole=None) -> None:
    """Refuse a truncated file: no end marker (see :func:`_ends`) past the header. ``tail``: the
    file's last bytes (a PNG's last 12, a JPEG's last 64 KiB), which hold the end of almost every file; the
    rest (``whole``: the file's bytes, else the file mapped) is searched only when they do not,
    so bytes appended after the end (a PNG's after ``IEND``, a motion photo's video after a JPEG's
    ``EOI``) are accepted as PIL, libpng and libjpeg accept them."""
    start = max(0, h.frame_end - (size - len(tail)))
    if _ends(h.format, tail, start):
        return
    if len(tail) < size - h.frame_end:
        if whole is not None:
            if _ends(h.format, whole, h.frame_end):
                return
        else:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if _ends(h.format, m, h.frame_end):
                    return
    if h.format == "png":
        raise _bad(path, f"truncated or corrupt PNG (no IEND chunk after its image data, {size} bytes in all)")
    raise _bad(path, f"truncated JPEG (no end-of-image marker after its frame header, {size} bytes in all)")


def _check_header(path, h: ImageHeader, expected_wh, max_pixels: Optional[int]) -> None:
    check_pixel_limit(path, h.width, h.height, max_pixels)
    if h.format == "jpeg" and h.bit_depth != 8:
        raise DataError(f"{path}: {h.bit_depth}-bit JPEG is not supported; re-export as 8-bit JPEG or PNG")
    if h.format == "jpeg" and h.channels == 4:
        raise DataError(f"{path}: CMYK/YCCK JPEG is not supported; re-export as RGB")
    if h.sof in _JPEG_HIERARCHICAL:
        raise DataError(f"{path}: hierarchical JPEG (SOF{h.sof - 0xC0}) is not supported; re-export as baseline JPEG or PNG")
    if expected_wh is not None:
        ew, eh = int(expected_wh[0]), int(expected_wh[1])
        if (h.width, h.height) != (ew, eh):
            raise DataError(
                f"{path}: image is {h.width}x{h.height} but the scene declares {ew}x{eh}; fix the "
                f"scene's w/h (or intrinsics) or resize the image"
            )


def check_image(path, expected_wh: Optional[Sequence[int]] = None, max_pixels: Optional[int] = None) -> ImageHeader:
    """Check an image from its header (and last bytes) before any decoding.

    Args:
        path: image file.
        expected_wh: (width, height) the dataset declares for this file, or None.
        max_pixels: refuse images with more pixels than this (None: :func:`max_pixels_limit`).
    Returns:
        The :class:`ImageHeader`.
    Raises:
        DataError: unreadable / corrupt / truncated file, too many pixels, size mismatch, or an
            unsupported variant (12-bit or CMYK JPEG); one line naming the file.

    Example:
        >>> check_image("train/r_0.png", expected_wh=(800, 800)).channels
        4
    """
    h = read_header(path)
    _check_header(path, h, expected_wh, max_pixels)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - (len(_PNG_IEND) if h.format == "png" else _JPEG_TAIL)))
        tail = f.read()
    _check_end(path, h, tail, size)
    return h


def _gray_colour_key(img: np.ndarray, h: ImageHeader) -> np.ndarray:
    """(H, W) gray as OpenCV decodes it (1/2/4-bit samples scaled to 8 bits, 16-bit kept) ->
    (H, W, 2) gray + alpha: alpha 0 where the sample equals the ``tRNS`` key, else the maximum."""
    if len(h.transparency) < 2:
        return img
    key = struct.unpack(">H", h.transparency[:2])[0]
    if h.bit_depth < 8:
        key = (key & ((1 << h.bit_depth) - 1)) * (255 // ((1 << h.bit_depth) - 1))
    top = np.iinfo(img.dtype).max
    alpha = np.where(img == key, 0, top).astype(img.dtype)
    return np.stack([img, alpha], axis=2)


def decode_image_cv2(path, max_pixels: Optional[int] = None) -> np.ndarray:
    """Decode a PNG/JPEG with OpenCV following the module's decode policy.

    Args:
        path: image file.
        max_pixels: pixel limit checked from the header before decoding (None: :func:`max_pixels_limit`).
    Returns:
        (H, W, 3) uint8 RGB, or (H, W, 4) uint8 RGBA when the file has alpha (not composited).
    Raises:
        DataError: corrupt, truncated, unsupported or oversized file (names the file).

    Example:
        >>> decode_image_cv2("train/r_0.png").shape
        (800, 800, 4)
    """
    h = read_header(path)
    _check_header(path, h, None, max_pixels)
    with open(path, "rb") as f:
        data = f.read()
    _check_end(path, h, data[-_JPEG_TAIL:], len(data), whole=data)
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)  # EXIF orientation ignored
    if img is None:
        raise _bad(path, "cannot be decoded (corrupt image data)")
    if h.colour_type == 0 and h.transparency is not None and img.ndim == 2:
        img = _gray_colour_key(img, h)  # OpenCV ignores a gray image's tRNS; RGB and palette it applies
    if img.dtype == np.uint16:
        img = ((img.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
    elif img.dtype != np.uint8:
        raise _bad(path, f"decodes to unsupported sample type {img.dtype}")
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    elif img.shape[2] == 1:
        img = np.repeat(img, 3, axis=2)
    elif img.shape[2] == 2:  # gray + alpha
        img = np.concatenate([np.repeat(img[:, :, :1], 3, axis=2), img[:, :, 1:]], axis=2)
    elif img.shape[2] == 3:
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    elif img.shape[2] == 4:
        img = cv2.cvtColor(img, cv2.COLOR_BGRA2RGBA)
    if img.shape[:2] != (h.height, h.width):
        raise _bad(path, f"decoded size {img.shape[1]}x{img.shape[0]} differs from its header {h.width}x{h.height}")
    return np.ascontiguousarray(img)
