"""The fingerprint of a scene split: what a checkpoint or a loader state was made from.

A resumed run, or a loader state loaded back, must see the same images with the same cameras;
otherwise the saved stream positions and fields silently mean other pixels. The fingerprint is a
small plain dict (strings, ints and lists only: it survives ``json.dumps`` and
``torch.load(weights_only=True)``) of the *whole split* (never one rank's shard, so it does not
depend on the rank or the world size):

=============== ==================================================================================
key             value
=============== ==================================================================================
``version``     :data:`FINGERPRINT_VERSION`
``split``       the split's name ("train")
``downscale``   the scene's integer downscale
``names``       (N,) image paths relative to the scene folder, POSIX separators, split order
``sizes``       (N,) ``[width, height]`` the images are sampled at (after ``downscale``)
``poses``       (N,) 8 hex digits: a hash of the image's camera-to-world matrix rounded to 1e-5
``cameras``     (N,) 8 hex digits: a hash of its intrinsics (rounded to 1e-3 pixel), near / far
                (1e-5) and lens distortion (1e-7)
``masks``       only for a masked split: (N,) mask paths relative to the scene folder (a split
                that gains or loses masks, or changes which file masks an image, differs)
``digest``      16 hex digits: a SHA-256 of everything above (equal digests: equal fingerprints)
=============== ==================================================================================

Parsing the same files again gives the same fingerprint (the same float32 values); the rounding
keeps float noise far below its grid (another numpy's last bits in a parser's recentring) from
changing it, except for a value that sits on a grid boundary. The image *contents* are not hashed
(reading every image at each checkpoint would cost as much as decoding them); a file replaced by
another of the same name and size is not seen. Moving the scene folder keeps the fingerprint.

:func:`describe_change` turns two fingerprints into a short phrase for one-line errors.

>>> fp = scene_fingerprint(scene)
>>> describe_change(fp, fp) is None
True
>>> describe_change(fp, scene_fingerprint(scene.subset([0, 1])))
'98 images removed (train/r_2.png, train/r_3.png, train/r_4.png, ...)'
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from typing import Optional

import numpy as np

__all__ = ["scene_fingerprint", "describe_change", "fingerprint_digest", "FINGERPRINT_VERSION"]

FINGERPRINT_VERSION = 1
"""Bumped when the fingerprint's definition changes; fingerprints of another version are not
compared (:func:`describe_change` returns None: nothing can be said)."""

_KEYS = ("version", "split", "downscale", "names", "sizes", "poses", "cameras")

# Scene -> its fingerprint (a Scene is immutable; loaders ask for it at every state_dict())
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _h8(a: np.ndarray) -> str:
    """8 hex digits of a rounded float64 row (``+ 0.0`` turns -0.0 into 0.0)."""
    return hashlib.sha256((np.ascontiguousarray(a, np.float64) + 0.0).tobytes()).hexdigest()[:8]


def fingerprint_digest(fp: dict) -> str:
    """16 hex digits: SHA-256 of the fingerprint's keys (without ``digest``)."""
    keys = _KEYS + (("masks",) if fp.get("masks") is not None else ())  # unmasked splits: as before masks
    body = json.dumps({k: fp.get(k) for k in keys}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def scene_fingerprint(scene) -> dict:
    """The fingerprint of a :class:`~dali_nerf.scenes.Scene` split (see the module doc).

    Args:
        scene: the whole split (N images).
    Returns:
        dict with ``version``, ``split``, ``downscale``, ``names`` (N,), ``sizes`` (N, 2),
        ``poses`` (N,), ``cameras`` (N,), ``digest``; plain Python values (a new dict each call).

    Example:
        >>> scene_fingerprint(scene)["names"][:2]
        ['train/r_0.png', 'train/r_1.png']
    """
    fp = _CACHE.get(scene)
    if fp is None:
        n = scene.num_images
        root = os.path.abspath(scene.root)
        names = [os.path.relpath(os.path.abspath(p), root).replace(os.sep, "/") for p in scene.image_paths]
        c2w = np.round(np.asarray(scene.c2w, np.float64).reshape(n, 12), 5)
        cam = [np.round(np.asarray(scene.intrinsics, np.float64), 3)]
        if scene.has_bounds:
            cam.append(np.round(np.stack([scene.near, scene.far], 1).astype(np.float64), 5))
        if scene.distortion is not None:
            cam.append(np.round(np.asarray(scene.distortion, np.float64), 7))
            cam.append(np.asarray(scene.fisheye, np.float64)[:, None])
        cam = np.concatenate(cam, 1)
        fp = {"version": FINGERPRINT_VERSION, "split": str(scene.split), "downscale": int(scene.downscale),
              "names": names, "sizes": [[int(w), int(h)] for w, h in zip(scene.width, scene.height)],
              "poses": [_h8(r) for r in c2w], "cameras": [_h8(r) for r in cam]}
        if getattr(scene, "mask_paths", None) is not None:
            fp["masks"] = [os.path.relpath(os.path.abspath(p), root).replace(os.sep, "/") for p in scene.mask_paths]
        fp["digest"] = fingerprint_digest(fp)
        _CACHE[scene] = fp
    return json.loads(json.dumps(fp))  # a copy: callers may keep or change it


def _some(items, k: int = 3) -> str:
    shown = ", ".join(str(x) for x in items[:k])
    return shown + (", ..." if len(items) > k else "")


def _images(n: int) -> str:
    return f"{n} image{'s' if n != 1 else ''}"


def describe_change(saved: Optional[dict], current: dict) -> Optional[str]:
    """What differs between two fingerprints, as a short phrase; None when they are equal.

    Args:
        saved: the fingerprint stored with a checkpoint / loader state (None or another
            :data:`FINGERPRINT_VERSION`: nothing to compare, None is returned).
        current: the fingerprint of the scene now.
    Returns:
        None, or phrases joined by "; ", e.g. ``"2 images added (r_12.png, r_13.png)"``,
        ``"image sizes changed (r_3.png 800x800 -> 400x400)"``, ``"camera poses changed (5
        images: r_0.png, r_1.png, r_2.png, ...)"``, ``"downscale 1 -> 2"``.
    """
    if not isinstance(saved, dict) or saved.get("version") != FINGERPRINT_VERSION:
        return None
    if current.get("version") != FINGERPRINT_VERSION:
        return None
    if fingerprint_digest(saved) == fingerprint_digest(current):
        return None
    if saved.get("downscale") != current["downscale"]:  # every size and intrinsic follows from it
        return f"downscale {saved.get('downscale')} -> {current['downscale']}"
    parts = []
    if saved.get("split") != current["split"]:
        parts.append(f"split {saved.get('split')!r} -> {current['split']!r}")
    old, new = list(saved.get("names") or []), current["names"]
    old_i = {n: i for i, n in enumerate(old)}
    new_i = {n: i for i, n in enumerate(new)}
    added = [n for n in new if n not in old_i]
    removed = [n for n in old if n not in new_i]
    if added:
        parts.append(f"{_images(len(added))} added ({_some(added)})")
    if removed:
        parts.append(f"{_images(len(removed))} removed ({_some(removed)})")
    common = [n for n in new if n in old_i]
    if not added and not removed and old != new:
        parts.append(f"image order changed ({_some([n for n in new if old_i[n] != new_i[n]])} moved)")

    def field(key):
        vals = saved.get(key) or []
        return lambda n: vals[old_i[n]] if old_i[n] < len(vals) else None

    s_old, s_new = field("sizes"), (lambda n: current["sizes"][new_i[n]])
    resized = [n for n in common if list(s_old(n) or []) != list(s_new(n))]
    if resized:
        n0 = resized[0]
        (w0, h0), (w1, h1) = (s_old(n0) or [0, 0]), s_new(n0)
        more = f", {len(resized) - 1} more" if len(resized) > 1 else ""
        parts.append(f"image sizes changed ({n0} {w0}x{h0} -> {w1}x{h1}{more})")
    for key, what in (("poses", "camera poses"), ("cameras", "camera intrinsics, bounds or distortion")):
        f_old = field(key)
        moved = [n for n in common if f_old(n) != current[key][new_i[n]]]
        if moved:
            parts.append(f"{what} changed ({_images(len(moved))}: {_some(moved)})")
    m_old, m_new = saved.get("masks"), current.get("masks")
    if (m_old is None) != (m_new is None):
        parts.append("masks added" if m_new is not None else "masks removed")
    elif m_new is not None:
        f_old = field("masks")
        moved = [n for n in common if f_old(n) != m_new[new_i[n]]]
        if moved:
            parts.append(f"mask files changed ({_images(len(moved))}: {_some(moved)})")
    return "; ".join(parts) if parts else "the scene's fingerprint differs"
