"""The frozen :class:`Scene` record and the format registry.

Conventions (one, everywhere; parsers convert at parse time):

* camera-to-world ``c2w`` is 3x4, OpenGL axes: x right, y up, the camera looks down -z;
* pixel centres at +0.5: pixel (row, col) is the ray through image point (col + 0.5, row + 0.5);
* intrinsics per image: fx, fy, cx, cy (pixels, at the scene's resolution after ``downscale``);
* RGBA images are composited over ``background`` when ``background_mode`` is "color" (see
  :func:`dali_nerf.scenes._util.resolve_background` for the per-format default);
* lens distortion (``distortion`` set) is removed at decode: the Scene's intrinsics are those of the
  undistorted pinhole image, so the ray formula below holds for every scene.

Ray of pixel (row, col) of camera i, in world space::

    d_cam = ((col + 0.5 - cx) / fx, -(row + 0.5 - cy) / fy, -1)
    origin = c2w[i, :, 3];  direction = normalize(c2w[i, :, :3] @ d_cam)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

__all__ = ["Scene", "register_format", "FORMATS", "BACKGROUND_MODES"]

#: ``Scene.background_mode`` values (see :class:`Scene`).
BACKGROUND_MODES = ("color", "random", "learned")


def _frozen_array(a, dtype, shape_tail=None, name="array") -> np.ndarray:
    a = np.array(a, dtype=dtype, copy=True)
    if shape_tail is not None and tuple(a.shape[1:]) != tuple(shape_tail):
        raise ValueError(f"Scene.{name} must have shape (N, {', '.join(map(str, shape_tail))}), got {a.shape}")
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class Scene:
    """One split of a scene, in the conventions above. Arrays are read-only.

    Attributes:
        image_paths: (N,) absolute paths of the images, in split order (camera index = position).
        c2w: (N, 3, 4) float32 camera-to-world, OpenGL axes.
        intrinsics: (N, 4) float32 fx, fy, cx, cy in pixels.
        width, height: (N,) int64 image size in pixels (after ``downscale``).
        near, far: (N,) float32 per-image ray bounds, or None when the format defines none.
        background: (3,) float32 RGB in [0, 1]. ``background_mode`` "color": the colour images
            with alpha are composited over at decode and the renderer's background. "random" /
            "learned": the colour a trainer uses where it needs a fixed one (the learned colour's
            initial value; random's colour for evaluation renders); white unless given.
        background_mode: "color" | "random" | "learned". random / learned: images must have no
            alpha (the decode refuses one; the cache stores RGB only), the targets are the pixels
            as stored and the trainer supplies the background per ray (ARCHITECTURE.md, "Decode
            compositing").
        split: "train" | "val" | "test".
        format: the parser that produced it ("blender", "nerfstudio", "llff", "mega_nerf", "colmap").
        root: the scene folder.
        downscale: integer factor the images are decoded at (1 = full resolution).
        world_from_source: (4, 4) float64: x_world = world_from_source @ x_source, the
            normalisation the parser applied (recentring, scaling, axis change) so results can be
            mapped back to the dataset's own frame.
        up: (3,) float32 unit world "up" (gravity opposite); spatial partitions ignore this axis.
        aabb: (2, 3) float32 min/max corner of the region the model represents, or None.
        file_wh: (N, 2) int64 width, height the image *files* have on disk as the dataset
            declares them (before the decode-time resize to ``width``/``height``), or None when
            unknown. Equal to (width, height) unless ``downscale`` > 1 without a pre-downscaled
            folder; ``dali-nerf validate`` checks every file's header against it.
        distortion: (N, 8) float64 lens distortion of the image *files*, OpenCV's coefficient
            order: perspective k1, k2, p1, p2, k3, k4, k5, k6 (k4..k6: OpenCV's rational model);
            fisheye (``fisheye`` True) k1, k2, k3, k4, 0, 0, 0, 0 (``cv2.fisheye``). None when no
            image is distorted (a zero row: that image is not). The decode stage undistorts once
            (``dali_nerf/data/finish.py``); ``intrinsics`` are the undistorted image's.
        fisheye: (N,) bool, the ``cv2.fisheye`` (equidistant) model per image; None iff
            ``distortion`` is None.
        file_intrinsics: (N, 4) float64 fx, fy, cx, cy of the distorted files as stored (at
            ``file_wh``); None iff ``distortion`` is None. Requires ``file_wh``.
        mask_paths: (N,) absolute paths of per-image masks (single-channel images: 0 = never
            sample the pixel, else keep it; nerfstudio's ``mask_path``), or None (no masks: every
            pixel is sampled). The decode finishes each with its image (nearest-neighbour to the
            file size, undistorted with it, nearest-neighbour to ``width`` x ``height``:
            :mod:`dali_nerf.data.masks`); the ray streams draw valid pixels only.
        mask_wh: (N, 2) int64 width, height of each mask file as declared (the image file's size,
            or the full-resolution size when the scene's downscaled images have no downscaled
            masks); given iff ``mask_paths`` is.
        camera_idx: (N,) int64 the physical camera (intrinsics group) of each image, 0-based and
            contiguous over the whole capture (COLMAP: its camera ids in increasing order, gsplat's
            ``camera_idx``), or None when the format has no such notion.
        points: (M, 3) float32 sparse points of the capture in the Scene's world (COLMAP's
            points3D, for initialising Gaussian splats), the same for every split; or None.
        points_rgb: (M, 3) uint8 their colours; None iff ``points`` is None.
        exposure: (N,) float32 each image's exposure in EV from its EXIF, relative to the
            capture's mean (gsplat's ``load_exposure``: :func:`dali_nerf.scenes.exif.with_exposure`),
            NaN where an image has none; None when not read (the default).

    Example:
        >>> scene = load_scene("data/default", split="train")
        >>> scene.c2w.shape, scene.num_pixels
        ((100, 3, 4), 4000000)
    """

    image_paths: tuple
    c2w: np.ndarray
    intrinsics: np.ndarray
    width: np.ndarray
    height: np.ndarray
    split: str
    format: str
    root: str
    near: Optional[np.ndarray] = None
    far: Optional[np.ndarray] = None
    background: np.ndarray = field(default_factory=lambda: np.ones(3, np.float32))
    downscale: int = 1
    world_from_source: np.ndarray = field(default_factory=lambda: np.eye(4))
    up: np.ndarray = field(default_factory=lambda: np.array([0.0, 1.0, 0.0], np.float32))
    aabb: Optional[np.ndarray] = None
    file_wh: Optional[np.ndarray] = None
    background_mode: str = "color"
    distortion: Optional[np.ndarray] = None
    fisheye: Optional[np.ndarray] = None
    file_intrinsics: Optional[np.ndarray] = None
    mask_paths: Optional[tuple] = None
    mask_wh: Optional[np.ndarray] = None
    camera_idx: Optional[np.ndarray] = None
    points: Optional[np.ndarray] = None
    points_rgb: Optional[np.ndarray] = None
    exposure: Optional[np.ndarray] = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        set_("image_paths", tuple(str(p) for p in self.image_paths))
        n = len(self.image_paths)
        set_("c2w", _frozen_array(self.c2w, np.float32, (3, 4), "c2w"))
        set_("intrinsics", _frozen_array(self.intrinsics, np.float32, (4,), "intrinsics"))
        set_("width", _frozen_array(self.width, np.int64, (), "width"))
        set_("height", _frozen_array(self.height, np.int64, (), "height"))
        for k in ("near", "far"):
            v = getattr(self, k)
            if v is not None:
                v = np.broadcast_to(np.asarray(v, np.float32), (n,))
                set_(k, _frozen_array(v, np.float32, (), k))
        set_("background", _frozen_array(np.broadcast_to(np.asarray(self.background, np.float32), (3,)), np.float32, None, "background"))
        set_("world_from_source", _frozen_array(self.world_from_source, np.float64, (4,), "world_from_source"))
        up = np.asarray(self.up, np.float64)
        set_("up", _frozen_array(up / np.linalg.norm(up), np.float32, None, "up"))
        if self.aabb is not None:
            set_("aabb", _frozen_array(self.aabb, np.float32, (3,), "aabb"))
        if self.file_wh is not None:
            set_("file_wh", _frozen_array(self.file_wh, np.int64, (2,), "file_wh"))
        if self.background_mode not in BACKGROUND_MODES:
            raise ValueError(f"Scene.background_mode={self.background_mode!r}: use one of {', '.join(BACKGROUND_MODES)}")
        lens = ("distortion", "fisheye", "file_intrinsics")
        if any(getattr(self, k) is not None for k in lens):
            if any(getattr(self, k) is None for k in lens) or self.file_wh is None:
                raise ValueError("Scene.distortion, fisheye, file_intrinsics and file_wh must be given together")
            set_("distortion", _frozen_array(self.distortion, np.float64, (8,), "distortion"))
            set_("fisheye", _frozen_array(self.fisheye, bool, (), "fisheye"))
            set_("file_intrinsics", _frozen_array(self.file_intrinsics, np.float64, (4,), "file_intrinsics"))
        if (self.mask_paths is None) != (self.mask_wh is None):
            raise ValueError("Scene.mask_paths and mask_wh must be given together")
        if self.mask_paths is not None:
            set_("mask_paths", tuple(str(p) for p in self.mask_paths))
            set_("mask_wh", _frozen_array(self.mask_wh, np.int64, (2,), "mask_wh"))
        if self.camera_idx is not None:
            set_("camera_idx", _frozen_array(self.camera_idx, np.int64, (), "camera_idx"))
        if (self.points is None) != (self.points_rgb is None):
            raise ValueError("Scene.points and points_rgb must be given together")
        if self.points is not None:
            set_("points", _frozen_array(np.reshape(self.points, (-1, 3)), np.float32, (3,), "points"))
            set_("points_rgb", _frozen_array(np.reshape(self.points_rgb, (-1, 3)), np.uint8, (3,), "points_rgb"))
            if len(self.points) != len(self.points_rgb):
                raise ValueError(f"Scene.points_rgb has {len(self.points_rgb)} rows for {len(self.points)} points")
        if self.exposure is not None:
            set_("exposure", _frozen_array(self.exposure, np.float32, (), "exposure"))
        for k in ("c2w", "intrinsics", "width", "height", "mask_paths", "mask_wh", "camera_idx", "exposure") + lens:
            if getattr(self, k) is not None and len(getattr(self, k)) != n:
                raise ValueError(f"Scene.{k} has {len(getattr(self, k))} entries for {n} images")

    # ---- derived, never stored -------------------------------------------------------------
    @property
    def num_images(self) -> int:
        return len(self.image_paths)

    @property
    def num_pixels(self) -> int:
        return int(np.sum(self.width * self.height))

    @property
    def distorted(self) -> np.ndarray:
        """(N,) bool: the image is undistorted at decode (non-zero ``distortion`` or fisheye)."""
        if self.distortion is None:
            return np.zeros(self.num_images, bool)
        return np.any(self.distortion != 0, axis=1) | self.fisheye

    @property
    def masked(self) -> bool:
        """True when the images carry masks (``mask_paths``)."""
        return self.mask_paths is not None

    @property
    def has_bounds(self) -> bool:
        return self.near is not None and self.far is not None

    def subset(self, indices) -> "Scene":
        """A Scene of the images at ``indices`` (e.g. one rank's shard), same conventions."""
        idx = np.asarray(indices, np.int64)
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        kw["image_paths"] = [self.image_paths[i] for i in idx]
        for k in ("c2w", "intrinsics", "width", "height"):
            kw[k] = getattr(self, k)[idx]
        for k in ("near", "far", "file_wh", "distortion", "fisheye", "file_intrinsics", "mask_wh", "camera_idx"):
            if kw[k] is not None:
                kw[k] = kw[k][idx]
        if kw["mask_paths"] is not None:
            kw["mask_paths"] = [self.mask_paths[i] for i in idx]
        return Scene(**kw)

    def __repr__(self) -> str:
        res = sorted({(int(w), int(h)) for w, h in zip(self.width, self.height)})
        res_s = ", ".join(f"{w}x{h}" for w, h in res[:3]) + (" ..." if len(res) > 3 else "")
        masks = ", masked" if self.masked else ""
        return f"Scene({self.format}, split={self.split!r}, {self.num_images} images {res_s}{masks}, root={self.root!r})"


# name -> (detect(root) -> bool, parse(root, split, downscale, background) -> Scene)
FORMATS: dict[str, tuple[Callable, Callable]] = {}


def register_format(name: str, detect: Callable, parse: Callable) -> None:
    """Register a scene parser. ``detect(root: Path) -> bool``; ``parse(root, split, *, downscale,
    background) -> Scene``. Detection is tried in registration order."""
    FORMATS[name] = (detect, parse)
