"""``dali-nerf validate SCENE``: parse every split and check every image header before training.

For each split present: the parser's own checks (poses, intrinsics, files exist), then every image
through :func:`dali_nerf.data.imageio.check_image`: a readable PNG/JPEG header, not truncated, at most
:data:`dali_nerf.data.imageio.MAX_PIXELS` pixels, and the on-disk size equal to ``Scene.file_wh`` (the
size the dataset declares); a masked scene's masks the same way, and single-channel
(:func:`dali_nerf.data.masks.check_mask_file`). The first problem is raised as a one-line error
naming the file.
Image files outside the scene folder (absolute paths, ``..``) are allowed but reported, one
``warning:`` line per split naming them (:func:`paths_outside`).

>>> from dali_nerf.cli.validate import validate_scene
>>> [s.num_images for s in validate_scene("data/default")]
[100, 10, 20]
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from tqdm import tqdm

from dali_nerf.errors import SceneError
from dali_nerf.data.imageio import check_image
from dali_nerf.data.masks import check_mask_file
from dali_nerf.scenes import SPLITS, FORMATS, detect_format, load_scene
from dali_nerf.scenes._util import load_json

__all__ = ["validate_scene", "scan_images", "paths_outside", "outside_warning", "main", "PROGRESS_MIN_IMAGES"]

#: A progress bar is shown when a split has more images than this.
PROGRESS_MIN_IMAGES = 200


def _split_present(root: Path, name: str, split: str) -> bool:
    if name == "blender":
        return (root / f"transforms_{split}.json").is_file()
    if name == "mega_nerf":
        return split != "test" and (root / split / "metadata").is_dir()
    if name == "nerfstudio":  # with explicit lists, a split exists when its list (or val<->test) does
        meta = load_json(root / "transforms.json")
        keys = {k for k in ("train_filenames", "val_filenames", "test_filenames") if k in meta}
        if keys and split == "train":
            return "train_filenames" in keys
        if keys:
            return bool(keys & {"val_filenames", "test_filenames"})
    return True  # llff (and nerfstudio's fraction rule): every split derives from one file


def validate_scene(root, format: str = "auto", splits: Optional[Sequence[str]] = None, progress: bool = True,
                   max_pixels: Optional[int] = None) -> list:
    """Parse each split of ``root`` and check every image header.

    Args:
        root: scene folder.
        format: "auto" or a format name.
        splits: splits to check (default: every split the format has on disk; Mega-NeRF's
            ``test`` is its ``val`` and is not checked twice).
        progress: show a tqdm bar for splits of more than :data:`PROGRESS_MIN_IMAGES` images.
        max_pixels: decompression-bomb limit per image (None: :func:`dali_nerf.data.imageio.max_pixels_limit`).
    Returns:
        list of the parsed Scenes, one per checked split.
    Raises:
        SceneError / DataError: the first problem, one line naming the file.
    """
    root = Path(root)
    name = detect_format(root) if format == "auto" else format
    if name not in FORMATS:
        raise SceneError(f"format={format!r}: unknown; use auto or one of {', '.join(FORMATS)}")
    if splits is None:
        splits = [s for s in SPLITS if _split_present(root, name, s)]
        if not splits:
            raise SceneError(f"{root}: no split found for format {name}")
    scenes = []
    for split in splits:
        scene = load_scene(root, split, format=name)
        scan_images(scene, progress=progress, max_pixels=max_pixels)
        scenes.append(scene)
    return scenes


def scan_images(scene, progress: bool = True, max_pixels: Optional[int] = None) -> None:
    """Check every image of a parsed split from its header and last bytes (no decoding): readable
    PNG/JPEG, not truncated, at most ``max_pixels`` pixels, on-disk size equal to ``Scene.file_wh``
    (or width/height); masks likewise, and single-channel. About 50 us per image; the trainers call
    it before training starts.

    Args:
        scene: a :class:`~dali_nerf.scenes.Scene` (N images).
        progress: show a tqdm bar when N > :data:`PROGRESS_MIN_IMAGES`.
        max_pixels: decompression-bomb limit per image (None: :func:`dali_nerf.data.imageio.max_pixels_limit`).
    Raises:
        DataError: the first bad image, one line naming the file.
    """
    sizes = scene.file_wh if scene.file_wh is not None else list(zip(scene.width, scene.height))
    items = list(zip(scene.image_paths, sizes))
    if progress and len(items) > PROGRESS_MIN_IMAGES:
        items = tqdm(items, desc=f"check {scene.split} images", unit="img", leave=False)
    for path, wh in items:
        check_image(path, expected_wh=wh, max_pixels=max_pixels)
    for path, wh in zip(scene.mask_paths or (), scene.mask_wh if scene.masked else ()):
        check_mask_file(path, wh, max_pixels)  # present, readable, the declared size, single-channel


def paths_outside(scene) -> list:
    """Image paths of ``scene`` that lie outside its folder (absolute paths elsewhere, ``..``),
    symlinks resolved; in split order. Allowed (real datasets share image folders), but reported
    by ``dali-nerf validate``."""
    root = os.path.realpath(scene.root)
    return [p for p in scene.image_paths if os.path.commonpath([root, os.path.realpath(p)]) != root]


def outside_warning(scene) -> Optional[str]:
    """The one ``warning:`` line naming ``scene``'s images outside its folder, or None."""
    out = paths_outside(scene)
    if not out:
        return None
    shown = ", ".join(out[:3]) + (f" (+{len(out) - 3} more)" if len(out) > 3 else "")
    return (f"warning: {scene.split}: {len(out)} of {scene.num_images} images lie outside the scene folder "
            f"{scene.root}: {shown}; allowed, but copying the folder alone will not carry them")


def _summary(scene) -> str:
    res = Counter(f"{int(w)}x{int(h)}" for w, h in zip(scene.width, scene.height))
    res_s = ", ".join(f"{k} ({v})" if len(res) > 1 else k for k, v in res.most_common(3))
    bounds = f"near {scene.near.min():.3g}..{scene.near.max():.3g}, far {scene.far.min():.3g}..{scene.far.max():.3g}" \
        if scene.has_bounds else "no bounds"
    masks = "  masked" if scene.masked else ""
    return (f"  {scene.split:<5} {scene.num_images:6d} images  {res_s}  {scene.num_pixels / 1e6:.2f} Mpix  {bounds}{masks}"
            f"  up {tuple(round(float(u), 3) for u in scene.up)}")


def main(args) -> int:
    """``dali-nerf validate SCENE [--format F] [--split S]``: print a summary per split, return 0."""
    splits = [args.split] if getattr(args, "split", None) else None
    scenes = validate_scene(args.scene, format=getattr(args, "format", "auto") or "auto", splits=splits)
    print(f"{args.scene}: {scenes[0].format} scene, all image headers OK")
    for s in scenes:
        print(_summary(s))
    for s in scenes:
        w = outside_warning(s)
        if w is not None:
            print(w)
    return 0
