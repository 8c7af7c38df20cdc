"""Writing a generated scene as a COLMAP folder (``make_scene(..., layout="colmap")``,
``dali-nerf make-scene KIND --format colmap``): what 3D Gaussian Splatting trainers read.

::

    out/sparse/0/cameras.bin       one camera, PINHOLE (fx fy cx cy) or SIMPLE_PINHOLE (f cx cy)
    out/sparse/0/images.bin        every view of every split, named frame_<i>.<ext> in view order
                                   (train, then val, then test), world-to-camera in OpenCV axes
    out/sparse/0/points3D.bin      sparse points: pixels of the views unprojected at their exact
                                   depth (the tracer's first hit), with the pixel's colour
    out/images/frame_<i>.<ext>     RGB (alpha composited over white), PNG unless JPEG is asked
    out/images_2/, out/images_4/   exact 1/2 and 1/4 copies, area-averaged (cv2.INTER_AREA), PNG
                                   (gsplat reads PNG images_N as they are), when the size divides

COLMAP has no splits: the parser holds out every 8th view in name order (gsplat's ``test_every``),
whatever split the generator drew the view for. The world is the kind's SCENE frame.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from dali_nerf.errors import ConfigError
from dali_nerf.scenegen.cameras import intrinsics, pixel_rays
from dali_nerf.scenes.colmap_io import ColmapCamera, ColmapImage, ColmapModel, quaternion_from_rotation, write_model

__all__ = ["write_colmap", "COLMAP_FACTORS", "POINTS_PER_VIEW", "CAMERA_MODELS"]

COLMAP_FACTORS = (2, 4)
"""Data factors written as ``images_<f>/`` (when the image size is divisible by f)."""
POINTS_PER_VIEW = 64
"""Sparse points drawn per view (pixels that see a surface)."""
CAMERA_MODELS = ("PINHOLE", "SIMPLE_PINHOLE")

_GL_TO_CV = np.diag([1.0, -1.0, -1.0])


def _camera(kind: str, width: int, height: int, model: str) -> ColmapCamera:
    k = intrinsics(kind, width, height)
    if model == "PINHOLE":
        return ColmapCamera(1, model, width, height, np.array(k, np.float64))
    if model == "SIMPLE_PINHOLE":
        return ColmapCamera(1, model, width, height, np.array([k[0], k[2], k[3]], np.float64))
    raise ConfigError(f"camera_model={model!r}: use one of {', '.join(CAMERA_MODELS)}")


def _w2c(c2w_gl: np.ndarray):
    """(qvec (4,), tvec (3,)) of the OpenCV world-to-camera of an OpenGL (3, 4) camera-to-world."""
    r = c2w_gl[:, :3] @ _GL_TO_CV
    r_w2c = r.T
    return quaternion_from_rotation(r_w2c), -r_w2c @ c2w_gl[:, 3]


def write_colmap(tmp: Path, kind: str, seed: int, width: int, height: int, cams: dict, image_format: str,
                 render_rgbd, write_image, camera_model: str = "PINHOLE") -> None:
    """Render every view of ``cams`` (split -> (N, 3, 4) OpenGL c2w) with ``render_rgbd(kind, seed,
    c2ws, k, width, height)`` (yields RGBA uint8 and depth per view) and write the COLMAP layout of
    the module doc into ``tmp``; ``write_image(path, rgb, image_format)`` writes a file."""
    ext = ".png" if image_format == "png" else ".jpg"
    camera = _camera(kind, width, height, camera_model)
    k = intrinsics(kind, width, height)
    c2ws = np.concatenate([cams[s] for s in ("train", "val", "test") if len(cams.get(s, ()))])
    factors = [f for f in COLMAP_FACTORS if width % f == 0 and height % f == 0]
    for folder in ["images"] + [f"images_{f}" for f in factors]:
        (tmp / folder).mkdir()
    rng = np.random.default_rng([int(seed), 0xC01])
    images, xyz, rgb = [], [], []
    for i, (img, depth) in enumerate(render_rgbd(kind, seed, c2ws, k, width, height)):
        name = f"frame_{i:05d}{ext}"
        color = np.ascontiguousarray(img[..., :3])  # the tracer's RGB is already over white
        write_image(tmp / "images" / name, color, image_format)
        for f in factors:
            small = cv2.resize(color, (width // f, height // f), interpolation=cv2.INTER_AREA)
            write_image(tmp / f"images_{f}" / f"frame_{i:05d}.png", small, "png")
        q, t = _w2c(c2ws[i])
        images.append(ColmapImage(i + 1, q, t, camera.id, name))
        seen = np.flatnonzero(np.isfinite(depth.ravel()))
        if len(seen):
            pick = rng.choice(seen, size=min(POINTS_PER_VIEW, len(seen)), replace=False)
            o, d = pixel_rays(c2ws[i], k, width, height)
            xyz.append(o[pick] + d[pick] * depth.ravel()[pick, None])
            rgb.append(color.reshape(-1, 3)[pick])
    xyz = np.concatenate(xyz) if xyz else np.zeros((0, 3))
    model = ColmapModel(cameras={camera.id: camera}, images=images, point_ids=np.arange(1, len(xyz) + 1),
                        xyz=xyz, rgb=np.concatenate(rgb) if rgb else np.zeros((0, 3), np.uint8),
                        error=np.zeros(len(xyz)))
    write_model(tmp / "sparse" / "0", model, "bin")
