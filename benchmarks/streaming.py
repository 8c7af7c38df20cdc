"""Delivered rays/s of RayLoader: whole-shard cache vs streaming windows, same scene, same batch.

    python benchmarks/streaming.py [--images 40] [--res 400] [--steps 200] [--windows 8]

Writes ``--images`` JPEGs of ``--res`` x ``--res`` to a temp folder, then times ``--steps``
steps of B = 4096 rays (after a 5-step warm-up) for: cached (max_bytes unlimited) and
streaming with max_bytes sized for ``--windows`` windows per cycle, in random and epoch mode.
Streaming decodes each window again every cycle, so its rate includes that decode (background
thread) plus the per-window pipeline build; the printed line says how many windows were decoded.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import cv2
import numpy as np


def _scene(root, n, res):
    from dali_nerf.scenes.base import Scene

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:res, 0:res]
    paths, c2w = [], []
    for i in range(n):
        img = np.stack([xx * 255 // res, yy * 255 // res, np.full_like(xx, 7 * i % 256)], -1).astype(np.uint8)
        img = np.clip(img.astype(np.int16) + rng.integers(-8, 9, img.shape), 0, 255).astype(np.uint8)
        p = os.path.join(root, f"img_{i:03d}.jpg")
        cv2.imwrite(p, img, [cv2.IMWRITE_JPEG_QUALITY, 95])
        paths.append(p)
        a = 2 * np.pi * i / n
        eye = np.array([3 * np.cos(a), 0.5, 3 * np.sin(a)])
        back = eye / np.linalg.norm(eye)
        right = np.cross([0.0, 1.0, 0.0], back)
        right /= np.linalg.norm(right)
        c2w.append(np.stack([right, np.cross(back, right), back, eye], 1))
    f = 1.1 * res
    return Scene(image_paths=paths, c2w=np.array(c2w), intrinsics=np.tile([f, f, res / 2, res / 2], (n, 1)),
                 width=[res] * n, height=[res] * n, split="train", format="blender", root=root,
                 near=np.full(n, 0.5), far=np.full(n, 6.0))


def _time(scene, steps, **kw):
    from dali_nerf.sources import RayLoader

    with RayLoader(scene, rays_per_batch=4096, prefetch=2, **kw) as L:
        for _ in range(5):
            next(L)
        t = time.perf_counter()
        for _ in range(steps):
            next(L)
        dt = time.perf_counter() - t
        return steps * 4096 / dt, L.stats()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=40)
    ap.add_argument("--res", type=int, default=400)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--windows", type=int, default=8)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        scene = _scene(root, a.images, a.res)
        per = a.res * a.res * 3 + 104
        max_bytes = 2 * per * (a.images // a.windows)
        print(f"scene: {a.images} x {a.res}x{a.res} JPEG ({scene.num_pixels * 3 / 1e6:.1f} MB decoded); streaming "
              f"max_bytes={max_bytes} ({a.images // a.windows} images/window); B=4096, {a.steps} steps, "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
        for mode in ("random", "epoch"):
            for name, mb in (("cached", None), ("streaming", max_bytes)):
                rate, s = _time(scene, a.steps, mode=mode, max_bytes=mb)
                extra = (f"  windows decoded {s['windows_decoded']}, peak {s['peak_bytes'] / 1e6:.2f} MB, "
                         f"decode wait {s['decode_wait_s']:.2f} s") if s.get("streaming") else ""
                print(f"{mode:6s} {name:9s} {rate / 1e6:6.2f} M rays/s  stall {100 * s['stall_fraction']:.0f}%{extra}",
                      flush=True)


if __name__ == "__main__":
    main()
