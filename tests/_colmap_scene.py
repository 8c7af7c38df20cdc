"""Small COLMAP scenes written by the tests themselves (cv2 images, our model writer): any camera
model, several cameras, data-factor folders.

>>> root = colmap_scene(tmp_path, n=10, width=48, height=32, model="OPENCV", params=[...])
"""

from __future__ import annotations

import cv2
import numpy as np

from dali_nerf.scenes.colmap_io import ColmapCamera, ColmapImage, ColmapModel, quaternion_from_rotation, write_model

__all__ = ["colmap_scene", "random_rotation", "smooth_image"]


def random_rotation(rng) -> np.ndarray:
    q = rng.normal(size=4)
    q /= np.linalg.norm(q)
    w, x, y, z = q
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])


def smooth_image(rng, w: int, h: int) -> np.ndarray:
    """(h, w, 3) uint8: a few random sinusoids per channel plus noise (interpolation has work to do)."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    out = np.zeros((h, w, 3))
    for c in range(3):
        for _ in range(3):
            fx, fy, ph = rng.uniform(0.05, 0.4), rng.uniform(0.05, 0.4), rng.uniform(0, 6.3)
            out[:, :, c] += np.sin(fx * xx + fy * yy + ph)
    out = 127.5 + 40.0 * out + rng.normal(0, 6, out.shape)
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


def colmap_scene(root, n=10, width=48, height=32, model="PINHOLE", params=None, cameras=1, factors=(2, 4),
                 fmt="bin", seed=0, ext=".png", factor_ext=".png", points=50, shuffle=True):
    """Write ``root/sparse/0`` (``fmt`` bin | txt), ``root/images/img_<i><ext>`` and
    ``images_<f>/`` area-averaged copies (``factor_ext``); images listed in a shuffled file order
    (the parser sorts by name). ``cameras`` > 1: image i uses camera ``i % cameras + 1``, of sizes
    that grow by 8 pixels per camera. Returns ``root``."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    cams = {}
    for c in range(cameras):
        w, h = width + 8 * c, height + 8 * c
        p = params if params is not None else {"PINHOLE": [0.9 * w, 0.95 * w, w / 2 + 0.3, h / 2 - 0.2],
                                               "SIMPLE_PINHOLE": [0.9 * w, w / 2 + 0.3, h / 2 - 0.2]}[model]
        cams[c + 1] = ColmapCamera(c + 1, model, w, h, np.array(p, np.float64))
    images = []
    for i in range(n):
        cam = cams[i % cameras + 1]
        img = smooth_image(rng, cam.width, cam.height)
        name = f"img_{i:03d}{ext}"
        cv2.imwrite(str(root / "images" / name), cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
        for f in factors:
            (root / f"images_{f}").mkdir(exist_ok=True)
            small = cv2.resize(img, (cam.width // f, cam.height // f), interpolation=cv2.INTER_AREA)
            cv2.imwrite(str(root / f"images_{f}" / f"img_{i:03d}{factor_ext}"), cv2.cvtColor(small, cv2.COLOR_RGB2BGR))
        r = random_rotation(rng)
        images.append(ColmapImage(i + 1, quaternion_from_rotation(r), rng.normal(0, 2, 3), cam.id, name))
    order = rng.permutation(n) if shuffle else np.arange(n)
    model = ColmapModel(cameras=cams, images=[images[i] for i in order], point_ids=np.arange(points) * 3 + 7,
                        xyz=rng.normal(size=(points, 3)), rgb=rng.integers(0, 256, (points, 3)).astype(np.uint8),
                        error=rng.random(points))
    write_model(root / "sparse" / "0", model, fmt)
    return root
