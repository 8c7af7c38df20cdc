"""``dali-nerf make-scene KIND``: the command line of the scene generator."""

from __future__ import annotations

import time

from dali_nerf.scenegen.cameras import resolve
from dali_nerf.scenegen.writers import make_scene

__all__ = ["main"]

_LAYOUTS = {"objects": "Blender", "city": "Mega-NeRF + nerfstudio transforms.json", "forward": "LLFF",
            "unbounded": "nerfstudio transforms.json"}


def main(args) -> int:
    """``dali-nerf make-scene KIND --out DIR [--resolution R] [--images N] [--seed S] [--jpeg]
    [--format native|colmap] [--force] [--occluders]``. ``--resolution`` is the image width (objects: square; city, forward, unbounded:
    height = 3/4 of it); ``--images`` the number of training images (forward: of views). Images
    are PNG for objects and city unless ``--jpeg``, JPEG for forward and unbounded. ``--occluders``
    (city, unbounded): a transient occluder in every image and its mask (``masks/``, nerfstudio
    ``mask_path``)."""
    t0 = time.perf_counter()
    width = args.resolution
    layout = getattr(args, "format", None) or "native"
    out = make_scene(args.kind, args.out, width=width, n_train=args.images, seed=args.seed,
                     image_format="jpeg" if args.jpeg else None, force=args.force, layout=layout,
                     occluders=bool(getattr(args, "occluders", False)))
    w, h, ntr, nva, nte = resolve(args.kind, width, None, args.images, None, None)
    if args.kind == "forward":
        splits = f"{ntr} views, every 8th held out"
    else:
        splits = f"{ntr} train, {nva} val" + (f", {nte} test" if nte else "")
    layout = "COLMAP sparse/0 + images/, images_2/, images_4/" if layout == "colmap" else _LAYOUTS[args.kind]
    masks = ", occluders + masks" if getattr(args, "occluders", False) else ""
    print(f"wrote {out} ({args.kind}, {layout}, {w}x{h}, {splits}{masks}) in {time.perf_counter() - t0:.1f} s")
    return 0

