"""Transient occluders for generated captures (``dali-nerf make-scene city|unbounded --occluders``).

Real captures hold things that are not the scene: a person walking past, a car, the rig's
shadow. Each generated image gets one such occluder, drawn over the rendered view in image space
(so it is somewhere else in every view: nothing a static field can explain): a striped ellipse
of a random colour covering about 8-28% of the image (17% on average), at a place drawn per image from (seed,
image id). Its mask (``masks/<image name>.png``, 8-bit single-channel: 0 on the occluder, 255
elsewhere) is written beside it and named by the frame's ``mask_path`` (nerfstudio), so a trainer
that honours masks never samples it.

>>> rgba, mask = occlude(np.zeros((96, 128, 4), np.uint8), seed=0, image_id=3)
>>> mask.dtype, 0.08 < (mask == 0).mean() < 0.28
(dtype('uint8'), True)
"""

from __future__ import annotations

import numpy as np

__all__ = ["occlude", "OCCLUDER_SALT"]

OCCLUDER_SALT = 0x0CC1
"""Mixed into each image's occluder generator: (seed, image id, salt)."""


def occlude(img: np.ndarray, seed: int, image_id: int):
    """Draw image ``image_id``'s occluder into a copy of ``img`` (H, W, 3 | 4) uint8 (opaque:
    alpha 255 on it) and return ``(image, mask)``, mask (H, W) uint8: 0 on the occluder, 255
    elsewhere."""
    h, w = img.shape[:2]
    rng = np.random.default_rng([int(seed), int(image_id), OCCLUDER_SALT])
    ry, rx = rng.uniform(0.22, 0.4) * h, rng.uniform(0.12, 0.22) * w  # a standing figure: taller than wide
    cy, cx = rng.uniform(ry * 0.5, h - ry * 0.5), rng.uniform(rx * 0.5, w - rx * 0.5)
    yy, xx = np.mgrid[0:h, 0:w] + 0.5
    inside = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1.0
    colour = rng.integers(30, 226, 3)
    stripes = (((yy - cy) / max(2.0, ry / 4)).astype(np.int64) % 2).astype(bool)
    out = img.copy()
    paint = np.where(stripes[..., None], colour, 255 - colour).astype(np.uint8)
    out[..., :3][inside] = paint[inside]
    if out.shape[-1] == 4:
        out[..., 3][inside] = 255
    mask = np.where(inside, 0, 255).astype(np.uint8)
    return out, mask
