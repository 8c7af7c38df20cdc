"""Regenerate the JPEG fixtures of this folder (see README.md): the variants PIL cannot write.

Run from the repository root: ``python tests/data/jpeg/make.py`` (needs libjpeg-turbo's
``cjpeg`` on PATH, Debian's ``libjpeg-turbo-progs``, and the ``imagecodecs`` package, whose
libjpeg-turbo 3 writes 12-bit and lossless JPEG). ``source.png`` is the picture every fixture
encodes: 37 x 23 (odd, not a multiple of any MCU), smooth gradients plus a fine pattern.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
W, H = 37, 23

# name -> cjpeg arguments (quality 92), input: source.png as PPM, or its green channel as PGM
# (a 1-component JPEG) for the names in GRAY
CJPEG = {
    "arith_420.jpg": ["-arithmetic"],
    "arith_progressive_422.jpg": ["-arithmetic", "-progressive", "-sample", "2x1"],
    "arith_gray.jpg": ["-arithmetic"],
    "sample_440.jpg": ["-sample", "1x2"],
    "sample_411.jpg": ["-sample", "4x1"],
    "sample_410.jpg": ["-sample", "4x2"],
    "rgb_colourspace.jpg": ["-rgb"],
    "restart_444.jpg": ["-sample", "1x1", "-restart", "1B"],
    "sample_mixed.jpg": ["-sample", "2x1,1x2,1x1"],
    "sample_3x2.jpg": ["-sample", "3x2"],
}
GRAY = ("arith_gray.jpg",)


def source() -> np.ndarray:
    """(23, 37, 3) uint8: the picture, from a formula (no random numbers)."""
    y, x = np.mgrid[0:H, 0:W]
    r = x * 6 + (x * y) % 17
    g = y * 10 + (x * 7 + y * 3) % 13
    b = 40 + (x + y) * 3 + ((x // 3 + y // 3) % 2) * 40
    return np.clip(np.stack([r, g, b], -1), 0, 255).astype(np.uint8)


def main() -> int:
    import imagecodecs

    img = source()
    Image.fromarray(img).save(HERE / "source.png")
    with tempfile.TemporaryDirectory() as tmp:
        ppm = Path(tmp) / "source.ppm"
        ppm.write_bytes(f"P6\n{W} {H}\n255\n".encode() + img.tobytes())
        pgm = Path(tmp) / "source.pgm"
        pgm.write_bytes(f"P5\n{W} {H}\n255\n".encode() + np.ascontiguousarray(img[:, :, 1]).tobytes())
        for name, args in CJPEG.items():
            src = pgm if name in GRAY else ppm
            subprocess.run(["cjpeg", "-quality", "92", *args, "-outfile", str(HERE / name), str(src)], check=True)
        # hierarchical: no common encoder writes it; a baseline file with its SOF0 marker relabelled
        # SOF5 (a differential frame header), which is what a reader meets first
        base = bytearray(subprocess.run(["cjpeg", "-quality", "92", str(ppm)], check=True, capture_output=True).stdout)
    at = base.index(b"\xff\xc0")
    base[at + 1] = 0xC5
    (HERE / "hierarchical_sof5.jpg").write_bytes(bytes(base))
    gray = np.ascontiguousarray(img[:, :, 1])
    twelve = (img.astype(np.uint16) << 4) | 8
    (HERE / "lossless_rgb.jpg").write_bytes(imagecodecs.jpeg8_encode(img, lossless=True))
    (HERE / "lossless_gray.jpg").write_bytes(imagecodecs.jpeg8_encode(gray, lossless=True))
    (HERE / "bits12_rgb.jpg").write_bytes(imagecodecs.jpeg8_encode(twelve, 92, bitspersample=12))
    (HERE / "bits12_gray.jpg").write_bytes(
        imagecodecs.jpeg8_encode(np.ascontiguousarray(twelve[:, :, 1]), 92, bitspersample=12))
    return 0


if __name__ == "__main__":
    sys.exit(main())
