"""Tiny on-disk scenes for the loader/decode/baseline tests (written with cv2 into tmp_path).

>>> scene = tiny_scene(tmp_path, n=4, width=24, height=16, kinds=("png_rgba", "jpg"))
"""

from __future__ import annotations

import numpy as np
import cv2

from dali_nerf.scenes.base import Scene

__all__ = ["tiny_scene", "reference_pixels"]


def _look_at(eye, target=(0.0, 0.0, 0.0), up=(0.0, 1.0, 0.0)):
    eye = np.asarray(eye, np.float64)
    back = eye - np.asarray(target, np.float64)
    back /= np.linalg.norm(back)
    right = np.cross(up, back)
    right /= np.linalg.norm(right)
    true_up = np.cross(back, right)
    return np.stack([right, true_up, back, eye], axis=1)  # (3, 4) OpenGL


def write_masks(root, scene_sizes, seed=0, density=0.5, full=()) -> list:
    """Write one 8-bit single-channel PNG mask per image (0 = masked): a masked band (a sky or an
    occluder) plus iid pixels at ``density`` kept; images in ``full`` are masked entirely.
    Returns their paths."""
    rng = np.random.default_rng(seed + 1000)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    out = []
    for i, (w, h) in enumerate(scene_sizes):
        m = (rng.random((h, w)) < density).astype(np.uint8) * 255
        m[: max(1, h // 4)] = 0
        m[h // 2, :] = 200  # any nonzero value keeps the pixel
        if i in full:
            m[:] = 0
        p = root / "masks" / f"mask_{i:03d}.png"
        assert cv2.imwrite(str(p), m)
        out.append(str(p))
    return out


def tiny_scene(root, n=4, width=24, height=16, kinds=("png_rgba", "jpg"), seed=0, bounds=True,
               background=(1.0, 1.0, 1.0), sizes=None, masks=None) -> Scene:
    """Write ``n`` images (cycling through ``kinds``: png_rgba | png_rgb | png_gray | png16 | jpg)
    and return the Scene. ``sizes``: optional list of (w, h) per image. ``masks``: None, or a dict
    of :func:`write_masks` arguments (density, full) for a masked scene."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths, c2w, K, ws, hs = [], [], [], [], []
    for i in range(n):
        w, h = sizes[i] if sizes is not None else (width, height)
        kind = kinds[i % len(kinds)]
        yy, xx = np.mgrid[0:h, 0:w]
        smooth = np.stack([(xx * 255 // max(1, w - 1)), (yy * 255 // max(1, h - 1)),
                           np.full_like(xx, (40 * i) % 256)], -1).astype(np.uint8)
        if kind == "png_rgba":
            img = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
            img[0, 0, 3] = 0
            img[0, 1, 3] = 255
            p = root / f"img_{i:03d}.png"
        elif kind == "png_rgb":
            img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            p = root / f"img_{i:03d}.png"
        elif kind == "png_gray":
            img = rng.integers(0, 256, (h, w), dtype=np.uint8)
            p = root / f"img_{i:03d}.png"
        elif kind == "png16":
            img = rng.integers(0, 65536, (h, w, 3), dtype=np.uint16)
            p = root / f"img_{i:03d}.png"
        elif kind == "jpg":
            img = smooth[:, :, ::-1].copy()  # BGR for cv2; smooth so JPEG error stays small
            p = root / f"img_{i:03d}.jpg"
        else:
            raise ValueError(kind)
        assert cv2.imwrite(str(p), img, [cv2.IMWRITE_JPEG_QUALITY, 98] if kind == "jpg" else [])
        paths.append(str(p))
        ang = 2 * np.pi * i / n
        c2w.append(_look_at((3 * np.cos(ang), 0.5 + 0.1 * i, 3 * np.sin(ang))))
        f = 0.9 * w + 3 * i
        K.append((f, f * 1.01, w / 2 + 0.25, h / 2 - 0.25))
        ws.append(w)
        hs.append(h)
    extra = {}
    if masks is not None:
        extra = dict(mask_paths=write_masks(root, list(zip(ws, hs)), seed, **masks), mask_wh=np.stack([ws, hs], 1))
    return Scene(image_paths=paths, c2w=np.array(c2w), intrinsics=np.array(K), width=ws, height=hs,
                 split="train", format="blender", root=str(root),
                 near=np.full(n, 0.5) if bounds else None, far=np.full(n, 6.0) if bounds else None,
                 background=background, **extra)


def reference_mask(scene, i) -> np.ndarray:
    """(H, W) bool independent reference for image i's mask (no resize, no lens): cv2 read, != 0."""
    return cv2.imread(scene.mask_paths[i], cv2.IMREAD_UNCHANGED) != 0


def reference_pixels(scene, i) -> np.ndarray:
    """(H, W, 3) uint8 independent reference for image i: cv2 decode, composite in float64."""
    img = cv2.imread(scene.image_paths[i], cv2.IMREAD_UNCHANGED)
    if img.dtype == np.uint16:
        img = np.round(img.astype(np.float64) / 257.0).astype(np.uint8)
    if img.ndim == 2:
        img = img[:, :, None]
    if img.shape[2] == 1:
        return np.repeat(img, 3, axis=2)
    rgb = img[:, :, 2::-1].astype(np.float64) if img.shape[2] >= 3 else None
    if img.shape[2] == 3:
        return rgb.astype(np.uint8)
    a = img[:, :, 3:4].astype(np.float64) / 255.0
    bg = np.round(np.asarray(scene.background, np.float64) * 255.0)
    out = rgb * a + bg * (1.0 - a)
    return np.floor(out + 0.5).astype(np.uint8)


def ref_rays(scene, idx):
    """Independent numpy (float64) ray reference for (cam, row, col) rows of ``idx`` (B, 3)."""
    idx = idx.numpy() if hasattr(idx, "numpy") else np.asarray(idx)
    c2w = scene.c2w[idx[:, 0]].astype(np.float64)
    K = scene.intrinsics[idx[:, 0]].astype(np.float64)
    d_cam = np.stack([(idx[:, 2] + 0.5 - K[:, 2]) / K[:, 0], -(idx[:, 1] + 0.5 - K[:, 3]) / K[:, 1],
                      -np.ones(len(idx))], -1)
    d = np.einsum("bij,bj->bi", c2w[:, :, :3], d_cam)
    return c2w[:, :, 3], d / np.linalg.norm(d, axis=-1, keepdims=True)


def assert_batch_contract(b, B):
    """The batch dict contract of ARCHITECTURE.md for a scene with bounds."""
    import torch

    assert set(b) == {"origins", "directions", "rgb", "indices", "near", "far"}
    for k in ("origins", "directions", "rgb"):
        assert b[k].shape == (B, 3) and b[k].dtype == torch.float32
    assert b["indices"].shape == (B, 3) and b["indices"].dtype == torch.int64
    assert b["near"].shape == (B, 1) and b["far"].shape == (B, 1)
