"""Scene parsers: Blender, nerfstudio / instant-ngp, LLFF, Mega-NeRF, COLMAP -> one frozen :class:`Scene`.

>>> from dali_nerf.scenes import load_scene
>>> scene = load_scene("data/default", split="train")          # format detected
>>> scene = load_scene("data/fern", split="test", format="llff", downscale=4)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence, Union

from dali_nerf.errors import SceneError
from dali_nerf.scenes.base import FORMATS, Scene, register_format
from dali_nerf.scenes._util import resolve_background
from dali_nerf.scenes.fingerprint import describe_change, scene_fingerprint
from dali_nerf.scenes import blender, nerfstudio, llff, mega_nerf, colmap  # noqa: F401  (register themselves)

__all__ = ["Scene", "load_scene", "scene_from_config", "detect_format", "FORMATS", "register_format", "scene_fingerprint",
           "describe_change"]

SPLITS = ("train", "val", "test")


_MARKERS = ("transforms_train.json", "transforms.json", "poses_bounds.npy", "coordinates.pt")
_ARCHIVES = (".zip", ".tar", ".tgz", ".gz", ".bz2", ".xz", ".7z", ".rar")


def _check_root(root: Path) -> None:
    """A one-line SceneError unless ``root`` is a folder: not found, or a file (a scene's own
    file, an archive, anything else), each with what to pass instead."""
    if root.is_dir():
        return
    if not root.exists():
        raise SceneError(f"{root}: scene folder not found; pass an existing folder (make one with `dali-nerf make-scene`)")
    if root.name in _MARKERS or root.name.startswith("transforms_"):
        raise SceneError(f"{root}: is a file, not a scene folder; pass the folder that holds it: {root.parent}")
    if root.suffix.lower() in _ARCHIVES:
        raise SceneError(f"{root}: is an archive file, not a scene folder; unpack it and pass the folder it holds")
    raise SceneError(f"{root}: is a file, not a scene folder; pass the scene's folder (the one that holds "
                     f"{', '.join(_MARKERS[:-1])} or {_MARKERS[-1]})")


def detect_format(root) -> str:
    """Name of the format of the scene folder ``root`` (first registered parser that claims it)."""
    root = Path(root)
    _check_root(root)
    for name, (detect, _) in FORMATS.items():
        if detect(root):
            return name
    raise SceneError(
        f"{root}: unknown scene format (no transforms_train.json, transforms.json, poses_bounds.npy, "
        f"coordinates.pt or sparse/0/cameras.bin); pass format= one of {', '.join(FORMATS)} or convert the scene"
    )


def load_scene(
    root,
    split: str = "train",
    format: str = "auto",
    downscale: int = 1,
    background: Union[None, str, Sequence[float]] = None,
) -> Scene:
    """Parse one split of the scene folder ``root``.

    Args:
        root: scene folder.
        split: "train", "val" or "test".
        format: "auto" (detect) or one of ``FORMATS``.
        downscale: integer factor >= 1; intrinsics and sizes are scaled, images decoded smaller.
        background: None / "auto" (per format: Blender white; other formats white when the
            first image has alpha, else "learned"), "white", "black", "random", "learned", or
            RGB in [0, 1] (see :func:`dali_nerf.scenes._util.resolve_background`; sets
            ``Scene.background`` and ``Scene.background_mode``).
    Returns:
        The frozen Scene, in OpenGL camera convention (see :mod:`dali_nerf.scenes.base`).
    """
    root = Path(root)
    if split not in SPLITS:
        raise SceneError(f"split={split!r}: use one of {', '.join(SPLITS)}")
    if not isinstance(downscale, int) or downscale < 1:
        raise SceneError(f"downscale={downscale!r}: use an integer >= 1")
    name = detect_format(root) if format == "auto" else format
    if name not in FORMATS:
        raise SceneError(f"format={format!r}: unknown; use auto or one of {', '.join(FORMATS)}")
    _check_root(root)
    resolve_background(background, name)  # a bad value fails before parsing
    scene = FORMATS[name][1](root, split, downscale=downscale, background=(1.0, 1.0, 1.0))
    if scene.num_images == 0:
        raise SceneError(f"{root}: split {split!r} has no images; check the split's file list")
    bg, mode = resolve_background(background, name, scene.image_paths[0])
    return dataclasses.replace(scene, background=bg, background_mode=mode)


def scene_from_config(cfg, split: Optional[str] = None) -> Scene:
    """The split ``split`` (default ``cfg.scene.train_split``) of the scene a config names, with
    its format, downscale and background: the one config -> Scene. ``scene.masks: ignore`` drops
    the training split's masks (every pixel trains); other splits keep theirs. ``scene.exposure:
    true`` reads each image's EXIF exposure (:func:`dali_nerf.scenes.exif.with_exposure`);
    ``scene.normalize_world: true`` moves it into gsplat's normalised world
    (:func:`dali_nerf.scenes.worldnorm.with_gsplat_world`)."""
    s = cfg.scene
    split = s.train_split if split is None else split
    scene = load_scene(s.path, split=split, format=s.format, downscale=s.downscale, background=s.background)
    if getattr(s, "masks", "use") == "ignore" and split == s.train_split and scene.masked:
        scene = dataclasses.replace(scene, mask_paths=None, mask_wh=None)  # train on every pixel
    if getattr(s, "exposure", False):
        from dali_nerf.scenes.exif import with_exposure

        scene = with_exposure(scene)
    if getattr(s, "normalize_world", False):
        from dali_nerf.scenes.worldnorm import with_gsplat_world

        scene = with_gsplat_world(scene)
    return scene
