"""Writing generated scenes: ``objects`` as a Blender synthetic folder, ``city`` as a Mega-NeRF
folder plus a nerfstudio transforms.json, ``forward`` as an LLFF folder, ``unbounded`` as a
nerfstudio transforms.json (layouts in :mod:`dali_nerf.scenegen`); every folder written atomically.
``occluders`` (city, unbounded): a transient occluder drawn into every image and a mask naming it
(``masks/``, each frame's ``mask_path``; :mod:`dali_nerf.scenegen.occluders`).

>>> make_scene("objects", "data/default")                       # doctest: +SKIP
PosixPath('data/default')
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import uuid
from pathlib import Path
from typing import Optional

import cv2
import numpy as np
import torch

from dali_nerf.errors import ConfigError, DaliNerfError
from dali_nerf.scenegen.colmap_writer import write_colmap
from dali_nerf.scenegen.cameras import BLENDER_CAMERA_ANGLE_X, OBJECTS_FAR, OBJECTS_NEAR, intrinsics, pixel_rays, resolve, scene_cameras
from dali_nerf.scenegen.occluders import occlude
from dali_nerf.scenegen.tracer import CHUNK, trace
from dali_nerf.scenegen.worlds import CITY_AABB, OBJECTS_AABB, scene_world

__all__ = ["make_scene", "DRB_FROM_SCENE", "CITY_METRES_PER_UNIT", "CITY_DRB_OFFSET", "DEFAULT_FORMAT", "PARALLEL_PIXELS",
           "PARALLEL_CORES"]

# city: scene frame (z up, units ~ 100 m) -> Mega-NeRF DRB world in metres
DRB_FROM_SCENE = np.array([[0.0, 0.0, -1.0],   # x_drb (down)  = -z_scene
                           [1.0, 0.0, 0.0],    # y_drb (right) =  x_scene
                           [0.0, -1.0, 0.0]])  # z_drb (back)  = -y_scene   (det = +1)
CITY_METRES_PER_UNIT = 100.0
CITY_DRB_OFFSET = np.array([-35.0, 420.0, -1250.0])  # a geo-like offset so origin_drb is non-trivial


PARALLEL_PIXELS = 16_000_000
"""A scene with at least this many pixels to render (100 images of 400x400) is rendered by one
process per core on a host of :data:`PARALLEL_CORES` or more (spawned, results in camera order:
the same bytes as one process; 115 images of 800x800 take ~3.5 min in one process)."""
PARALLEL_CORES = 4
"""Fewer cores render in one process (a spawned pool costs more than it gains on two)."""


def _render_group(job):
    """(N, H, W, 4) uint8 RGBA (RGB of empty pixels = white) and (N, H, W) float64 depth of one
    group of cameras: ``job`` = (kind, seed, c2ws (N, 3, 4), k, width, height)."""
    kind, seed, group, k, width, height = job
    world = scene_world(kind, int(seed))
    rays = [pixel_rays(c, k, width, height) for c in group]
    o = np.concatenate([r[0] for r in rays])
    d = np.concatenate([r[1] for r in rays])
    rgb, alpha, depth, _ = trace(world, o, d)
    rgb = rgb * alpha[:, None] + (1.0 - alpha[:, None])  # over white
    rgba = np.concatenate([rgb, alpha[:, None]], axis=1)
    img = np.round(np.clip(rgba, 0.0, 1.0) * 255.0).astype(np.uint8).reshape(len(group), height, width, 4)
    return img, depth.reshape(len(group), height, width)


def _render_rgbd(kind, seed, c2ws, k, width, height):
    """Yields, per camera, (H, W, 4) uint8 RGBA (RGB of empty pixels = white) and (H, W) float64
    depth (distance along the unit ray; inf where nothing is hit). Groups of cameras of up to
    ``CHUNK`` rays each; in a process per core when the scene has :data:`PARALLEL_PIXELS` or more."""
    per = max(1, CHUNK // (width * height))
    jobs = [(kind, int(seed), c2ws[s:s + per], k, width, height) for s in range(0, len(c2ws), per)]
    cores = os.cpu_count() or 1
    workers = min(cores, len(jobs))
    if cores >= PARALLEL_CORES and workers > 1 and len(c2ws) * width * height >= PARALLEL_PIXELS:
        # spawned, not forked: the caller may hold threads (DALI, torch) that a fork would copy mid-state
        with mp.get_context("spawn").Pool(workers) as pool:
            for img, depth in pool.imap(_render_group, jobs):
                yield from zip(img, depth)
    else:
        for job in jobs:
            yield from zip(*_render_group(job))


def _render_images(kind, seed, c2ws, k, width, height):
    """Yields (H, W, 4) uint8 RGBA per camera (RGB of empty pixels = white)."""
    for img, _ in _render_rgbd(kind, seed, c2ws, k, width, height):
        yield img


def _write_image(path: Path, rgba: np.ndarray, image_format: str) -> None:
    """Write (H, W, 4) RGBA or (H, W, 3) RGB uint8 as PNG (as given) or JPEG (RGB)."""
    if image_format == "png" and rgba.shape[-1] == 3:
        ok = cv2.imwrite(str(path), cv2.cvtColor(rgba, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_PNG_COMPRESSION, 3])
    elif image_format == "png":
        ok = cv2.imwrite(str(path), cv2.cvtColor(rgba, cv2.COLOR_RGBA2BGRA), [cv2.IMWRITE_PNG_COMPRESSION, 3])
    else:  # JPEG has no alpha: the RGB is already composited over white
        ok = cv2.imwrite(str(path), cv2.cvtColor(rgba[..., :3], cv2.COLOR_RGB2BGR),
                         [cv2.IMWRITE_JPEG_QUALITY, 95, cv2.IMWRITE_JPEG_OPTIMIZE, 0, cv2.IMWRITE_JPEG_PROGRESSIVE, 0])
    if not ok:
        raise DaliNerfError(f"{path}: could not write the image; check the disk and folder permissions")


def _occluded(tmp: Path, img: np.ndarray, rel: str, frame: dict, seed: int, gid: int) -> np.ndarray:
    """With occluders: image ``gid``'s occluder drawn into ``img``, its mask written to
    ``masks/<name>.png`` and named by ``frame["mask_path"]``; returns the image to write."""
    img, mask = occlude(img, seed, gid)
    (tmp / "masks").mkdir(exist_ok=True)
    mrel = f"masks/{Path(rel).stem}.png"
    if not cv2.imwrite(str(tmp / mrel), mask):
        raise DaliNerfError(f"{tmp / mrel}: could not write the mask; check the disk and folder permissions")
    frame["mask_path"] = mrel
    return img


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _mat_list(m):
    return [[float(v) for v in row] for row in m]


def _write_objects(tmp: Path, seed, width, height, cams, image_format):
    ext = ".png" if image_format == "png" else ".jpg"
    k = intrinsics("objects", width, height)
    for split in ("train", "val", "test"):
        (tmp / split).mkdir()
        frames = []
        c2ws = cams[split]
        for i, img in enumerate(_render_images("objects", seed, c2ws, k, width, height)):
            _write_image(tmp / split / f"r_{i}{ext}", img, image_format)
            c2w4 = np.concatenate([c2ws[i], [[0.0, 0.0, 0.0, 1.0]]])
            frames.append({"file_path": f"./{split}/r_{i}" + ("" if ext == ".png" else ext),
                           "rotation": 0.0, "transform_matrix": _mat_list(c2w4)})
        _write_json(tmp / f"transforms_{split}.json", {
            "camera_angle_x": BLENDER_CAMERA_ANGLE_X, "near": OBJECTS_NEAR, "far": OBJECTS_FAR,
            "aabb": [list(OBJECTS_AABB[0]), list(OBJECTS_AABB[1])], "frames": frames})


def _drb_c2w(c2w_scene):
    """(3,4) OpenGL c2w in the scene frame -> (3,4) c2w in Mega-NeRF's DRB world (metres). The
    rotation columns are the OpenGL camera axes (right, up, back) in the DRB world: what
    Mega-NeRF's own get_rays (mega_nerf/ray_utils.py: OpenGL-style directions times c2w[:, :3])
    and its README's conversion (DRB camera pose, then cat([c1, -c0, c2, t])) produce, and what
    our mega_nerf parser reads (:data:`dali_nerf.scenes.mega_nerf.CAMERA_COLUMNS`)."""
    rot = DRB_FROM_SCENE @ c2w_scene[:, :3]
    t = CITY_METRES_PER_UNIT * DRB_FROM_SCENE @ c2w_scene[:, 3] + CITY_DRB_OFFSET
    return np.concatenate([rot, t[:, None]], axis=1)


def _city_bounds(cams):
    eyes = np.concatenate([c[:, :, 3] for c in cams.values() if len(c)])
    lo, hi = np.array(CITY_AABB[0]), np.array(CITY_AABB[1])
    corners = np.array([[x, y, z] for x in (lo[0], hi[0]) for y in (lo[1], hi[1]) for z in (lo[2], hi[2])])
    far = float(np.linalg.norm(eyes[:, None, :] - corners[None], axis=-1).max()) * 1.05
    near = max(0.02, 0.5 * float((eyes[:, 2] - hi[2]).min()))
    return near, far


def _write_city(tmp: Path, seed, width, height, cams, image_format, occluders=False):
    ext = ".png" if image_format == "png" else ".jpg"
    k = intrinsics("city", width, height)
    near, far = _city_bounds(cams)
    drb = {s: np.stack([_drb_c2w(c) for c in cams[s]]) if len(cams[s]) else np.zeros((0, 3, 4)) for s in cams}
    pos = np.concatenate([drb[s][:, :, 3] for s in ("train", "val")])
    origin = 0.5 * (pos.max(0) + pos.min(0))                 # as Mega-NeRF's colmap converter
    scale = float(np.linalg.norm(pos - origin, axis=1).max())
    corners = np.array([[x, y, z] for x in (CITY_AABB[0][0], CITY_AABB[1][0]) for y in (CITY_AABB[0][1], CITY_AABB[1][1])
                        for z in (CITY_AABB[0][2], CITY_AABB[1][2])])
    c_drb = (CITY_METRES_PER_UNIT * corners @ DRB_FROM_SCENE.T + CITY_DRB_OFFSET - origin) / scale
    torch.save({"origin_drb": torch.tensor(origin, dtype=torch.float32), "pose_scale_factor": scale,
                "near": near * CITY_METRES_PER_UNIT / scale, "far": far * CITY_METRES_PER_UNIT / scale,
                "aabb": torch.tensor(np.stack([c_drb.min(0), c_drb.max(0)]), dtype=torch.float32)},
               tmp / "coordinates.pt")
    frames, names = [], {"train": [], "val": [], "test": []}
    gid = 0
    for split in ("train", "val", "test"):
        if len(cams[split]) == 0:
            continue
        (tmp / split / "rgbs").mkdir(parents=True)
        (tmp / split / "metadata").mkdir()
        for i, img in enumerate(_render_images("city", seed, cams[split], k, width, height)):
            name = f"{gid:06d}"
            rel = f"{split}/rgbs/{name}{ext}"
            frame = {"file_path": rel}
            if occluders:
                img = _occluded(tmp, img, rel, frame, seed, gid)
            gid += 1
            _write_image(tmp / split / "rgbs" / f"{name}{ext}", img, image_format)
            c2w = drb[split][i].copy()
            c2w[:, 3] = (c2w[:, 3] - origin) / scale
            torch.save({"W": int(width), "H": int(height),
                        "intrinsics": torch.tensor(k, dtype=torch.float32),
                        "c2w": torch.tensor(c2w, dtype=torch.float32)}, tmp / split / "metadata" / f"{name}.pt")
            names[split].append(rel)
            c2w4 = np.concatenate([cams[split][i], [[0.0, 0.0, 0.0, 1.0]]])
            frames.append({**frame, "transform_matrix": _mat_list(c2w4)})
    _write_json(tmp / "transforms.json", {
        "camera_model": "PINHOLE", "fl_x": float(k[0]), "fl_y": float(k[1]), "cx": float(k[2]), "cy": float(k[3]),
        "w": int(width), "h": int(height), "near": near, "far": far,
        "aabb": [list(CITY_AABB[0]), list(CITY_AABB[1])], "up": [0.0, 0.0, 1.0], "frames": frames,
        "train_filenames": names["train"], "val_filenames": names["val"],
        "test_filenames": names["test"] if names["test"] else names["val"]})


def _write_forward(tmp: Path, seed, width, height, cams, image_format):
    """LLFF: poses_bounds.npy, images/ (full size), images_4/ and images_8/ (area-averaged exact
    1/4 and 1/8 copies: cv2.INTER_AREA), RGB without alpha."""
    ext = ".png" if image_format == "png" else ".jpg"
    k = intrinsics("forward", width, height)
    c2ws = cams["train"]
    for folder in ("images", "images_4", "images_8"):
        (tmp / folder).mkdir()
    rows = []
    for i, (img, depth) in enumerate(_render_rgbd("forward", seed, c2ws, k, width, height)):
        name = f"image_{i:03d}{ext}"
        rgb = np.ascontiguousarray(img[..., :3])
        _write_image(tmp / "images" / name, rgb, image_format)
        for f in (4, 8):
            _write_image(tmp / f"images_{f}" / name,
                         cv2.resize(rgb, (width // f, height // f), interpolation=cv2.INTER_AREA), image_format)
        hit = depth[np.isfinite(depth)]
        if hit.size == 0:
            raise DaliNerfError(f"view {i}: sees nothing; this seed makes an empty forward scene, try another --seed")
        c = c2ws[i]  # OpenGL (right, up, back) -> LLFF columns (down, right, back), then position, hwf
        pose = np.stack([-c[:, 1], c[:, 0], c[:, 2], c[:, 3], np.array([height, width, k[0]], np.float64)], axis=1)
        rows.append(np.concatenate([pose.ravel(), [0.9 * hit.min(), 1.1 * hit.max()]]))
    np.save(tmp / "poses_bounds.npy", np.stack(rows))


def _write_unbounded(tmp: Path, seed, width, height, cams, image_format, occluders=False):
    """nerfstudio transforms.json (PINHOLE, no near/far, no aabb, no up: as COLMAP-made captures
    come) + images/frame_<id>, RGB without alpha."""
    ext = ".png" if image_format == "png" else ".jpg"
    k = intrinsics("unbounded", width, height)
    (tmp / "images").mkdir()
    frames, names = [], {"train": [], "val": [], "test": []}
    gid = 0
    for split in ("train", "val", "test"):
        for i, img in enumerate(_render_images("unbounded", seed, cams[split], k, width, height)):
            rel = f"images/frame_{gid:05d}{ext}"
            frame = {"file_path": rel}
            if occluders:
                img = _occluded(tmp, img, rel, frame, seed, gid)
            gid += 1
            _write_image(tmp / rel, np.ascontiguousarray(img[..., :3]), image_format)
            names[split].append(rel)
            c2w4 = np.concatenate([cams[split][i], [[0.0, 0.0, 0.0, 1.0]]])
            frames.append({**frame, "transform_matrix": _mat_list(c2w4)})
    _write_json(tmp / "transforms.json", {
        "camera_model": "PINHOLE", "fl_x": float(k[0]), "fl_y": float(k[1]), "cx": float(k[2]), "cy": float(k[3]),
        "w": int(width), "h": int(height), "frames": frames,
        "train_filenames": names["train"], "val_filenames": names["val"],
        "test_filenames": names["test"] if names["test"] else names["val"]})


_WRITERS = {"objects": _write_objects, "city": _write_city, "forward": _write_forward, "unbounded": _write_unbounded}
DEFAULT_FORMAT = {"objects": "png", "city": "png", "forward": "jpeg", "unbounded": "jpeg"}


def make_scene(kind: str, out, *, width: Optional[int] = None, height: Optional[int] = None,
               n_train: Optional[int] = None, n_val: Optional[int] = None, n_test: Optional[int] = None,
               seed: int = 0, image_format: Optional[str] = None, force: bool = False,
               occluders: bool = False, layout: str = "native", camera_model: str = "PINHOLE") -> Path:
    """Render and write a scene folder (layouts in the module docstring); returns ``out``.

    Args:
        kind: "objects" (Blender format) | "city" (Mega-NeRF layout + nerfstudio transforms.json) |
            "forward" (LLFF) | "unbounded" (nerfstudio transforms.json).
        out: output folder; must not exist or be empty unless ``force``.
        width, height: image size in pixels (defaults: objects 160x160, city 128x96, forward
            480x360 (multiples of 8), unbounded 160x120; one given -> the other from the default
            aspect ratio).
        n_train, n_val, n_test: images per split (defaults: objects 60/5/10, city 48/6/0,
            unbounded 48/6/0; city and unbounded: test = val when 0; forward: n_train = all
            views, 20, and n_val = n_test = 0: the LLFF parser holds out every 8th).
        seed: scene layout, colours and camera jitter; same seed -> identical bytes.
        image_format: "png" | "jpeg"; default png for objects and city (RGBA), jpeg for forward and
            unbounded (RGB: every pixel sees a surface). JPEG holds no alpha: objects and city
            JPEGs are composited over white.
        force: replace an existing non-empty ``out``.
        occluders: city and unbounded: a transient occluder in every image and its mask
            (``masks/``, nerfstudio ``mask_path``; :mod:`dali_nerf.scenegen.occluders`).
        layout: "native" (the kind's format above) | "colmap": every view as a COLMAP sparse model
            + images/ + images_2/, images_4/ + sparse points (:mod:`.colmap_writer`; RGB, PNG
            unless ``image_format`` says jpeg); ``camera_model`` PINHOLE | SIMPLE_PINHOLE.
    Written atomically: into a temporary folder beside ``out``, renamed when complete.

    Example:
        >>> make_scene("city", "/tmp/city", width=64, n_train=8, n_val=2)   # doctest: +SKIP
    """
    fmt = str(DEFAULT_FORMAT.get(kind, "png") if image_format is None else image_format).lower()
    fmt = {"jpg": "jpeg"}.get(fmt, fmt)
    if layout not in ("native", "colmap"):
        raise ConfigError(f"layout={layout!r}: use native or colmap")
    if layout == "colmap" and image_format is None:
        fmt = "png"
    if fmt not in ("png", "jpeg"):
        raise ConfigError(f"image_format={image_format!r}: use png or jpeg")
    width, height, n_train, n_val, n_test = resolve(kind, width, height, n_train, n_val, n_test)
    if occluders and kind not in ("city", "unbounded"):
        raise ConfigError(f"occluders: {kind} scenes have no mask convention (Blender, LLFF); use city or unbounded "
                          f"(nerfstudio transforms.json with mask_path)")
    if occluders and layout == "colmap":
        raise ConfigError("occluders: the colmap layout writes no masks; use the native layout (--format native)")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2 ** 63:
        raise ConfigError(f"seed={seed!r}: must be an integer in [0, 2**63)")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DaliNerfError(f"{out}: exists and is not a folder; choose another --out")
    held = sorted(q.name for q in out.iterdir()) if out.is_dir() and not force else []
    if held:  # named: a folder holding only .DS_Store looks empty in a file browser
        shown = ", ".join(held[:3]) + (f" (+{len(held) - 3} more)" if len(held) > 3 else "")
        raise DaliNerfError(f"{out}: folder exists and is not empty (holds {shown}); pass --force (force=True) to "
                            f"overwrite it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    except OSError as e:
        raise DaliNerfError(f"{out.parent}: cannot create the output folder ({e.strerror}); choose a writable --out")
    try:
        cams = scene_cameras(kind, width=width, height=height, n_train=n_train, n_val=n_val, n_test=n_test, seed=seed)
        cams = {s: v["c2w"] for s, v in cams.items()}
        if layout == "colmap":
            write_colmap(tmp, kind, int(seed), width, height, cams, fmt, _render_rgbd, _write_image, camera_model)
        else:
            _WRITERS[kind](tmp, int(seed), width, height, cams, fmt, **({"occluders": True} if occluders else {}))
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

