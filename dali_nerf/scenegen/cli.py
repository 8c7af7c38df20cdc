"""``dali-nerf make-scene KIND``: the command line of the scene generator."""

from __future__ import annotations

import time

from .cameras import resolve
from .writers import make_scene

__all__ = ["main"]


def main(args) -> int:
    """``dali-nerf make-scene KIND --out DIR [--resolution R] [--images N] [--seed S] [--jpeg]
    [--force]``. ``--resolution`` is the image width (objects: square; city: height = 3/4 of
    it); ``--images`` the number of training images."""
    t0 = time.perf_counter()
    width = args.resolution
    out = make_scene(args.kind, args.out, width=width, n_train=args.images, seed=args.seed,
                     image_format="jpeg" if args.jpeg else "png", force=args.force)
    w, h, ntr, nva, nte = resolve(args.kind, width, None, args.images, None, None)
    splits = f"{ntr} train, {nva} val" + (f", {nte} test" if nte else "")
    layout = "Blender" if args.kind == "objects" else "Mega-NeRF + nerfstudio transforms.json"
    print(f"wrote {out} ({args.kind}, {layout}, {w}x{h}, {splits}) in {time.perf_counter() - t0:.1f} s")
    return 0

