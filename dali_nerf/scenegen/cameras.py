"""Cameras of the generated scenes, in each kind's SCENE frame (OpenGL c2w, +0.5 pixel centres),
the size/count defaults and their validation.

``objects``: cameras at radius 4 looking at the origin; train on a jittered golden-angle spiral
over the upper hemisphere (elevation 15-75 deg), val random, test an orbit at 30 deg elevation.
``city``: an oblique lawnmower grid (rows along x, heading alternating +x / -x, 30 deg off nadir),
val cameras between the rows.
``forward``: a small forward-facing array (rows x columns over 0.7 x 0.4 units in the x-z plane,
all looking at about (0, 5, -0.5): +y, slightly down); every view is in "train" (the LLFF parser
holds out every 8th).
``unbounded``: cameras on a ring of radius 0.35 around the origin, 0.5 above the floor, each
looking outward (yaw within +-20 deg of its radial direction, 6-14 deg down).

>>> scene_cameras("objects", width=64)["train"]["c2w"].shape
(60, 3, 4)
"""

from __future__ import annotations

import math

import numpy as np

from dali_nerf.errors import ConfigError
from dali_nerf.scenegen.worlds import stream_rng

__all__ = ["scene_cameras", "resolve", "intrinsics", "pixel_rays", "KINDS", "DEFAULTS",
           "BLENDER_CAMERA_ANGLE_X", "OBJECTS_RADIUS", "OBJECTS_NEAR", "OBJECTS_FAR",
           "CITY_ALTITUDE", "CITY_TILT_DEG", "HFOV_DEG"]

KINDS = ("objects", "city", "forward", "unbounded")

# kind -> (width, height, n_train, n_val, n_test); forward: n_train = all views (LLFF holds out 1/8)
DEFAULTS = {
    "objects": (160, 160, 60, 5, 10),
    "city": (128, 96, 48, 6, 0),
    "forward": (480, 360, 20, 0, 0),
    "unbounded": (160, 120, 48, 6, 0),
}

BLENDER_CAMERA_ANGLE_X = 0.6911112070083618  # the Blender synthetic scenes' horizontal FOV
OBJECTS_RADIUS = 4.0
OBJECTS_NEAR, OBJECTS_FAR = 2.0, 6.0
CITY_ALTITUDE = 1.0
CITY_TILT_DEG = 30.0         # off nadir, towards the heading
HFOV_DEG = {"city": 60.0, "forward": 55.0, "unbounded": 70.0}  # horizontal field of view per kind


def _look_at(eye, target, up=(0.0, 0.0, 1.0)):
    """eye, target (3,) -> (3, 4) OpenGL c2w (x right, y up, looks down -z)."""
    eye = np.asarray(eye, np.float64)
    f = np.asarray(target, np.float64) - eye
    f /= np.linalg.norm(f)
    r = np.cross(f, up)
    r /= np.linalg.norm(r)
    u = np.cross(r, f)
    return np.stack([r, u, -f, eye], axis=1)


def _pose_from_heading(eye, heading, tilt_deg):
    """Aerial camera at eye, flying along unit heading (horizontal), pitched tilt_deg off nadir
    towards it -> (3, 4) OpenGL c2w."""
    t = math.radians(tilt_deg)
    h = np.array([heading[0], heading[1], 0.0])
    h /= np.linalg.norm(h)
    fwd = math.sin(t) * h + math.cos(t) * np.array([0.0, 0.0, -1.0])
    return _look_at(eye, np.asarray(eye) + fwd, up=tuple(h))


def _objects_cameras(seed, n_train, n_val, n_test):
    out = {}
    lo, hi = math.sin(math.radians(15.0)), math.sin(math.radians(75.0))
    golden = math.pi * (3.0 - math.sqrt(5.0))
    rng = stream_rng(seed, "objects/cameras")
    az0 = rng.uniform(0, 2 * np.pi)
    poses = []
    for i in range(n_train):  # golden-angle spiral, uniform in area over the elevation band
        s = lo + (hi - lo) * (i + rng.uniform(0.25, 0.75)) / n_train
        el, az = math.asin(s), az0 + i * golden + rng.uniform(-0.1, 0.1)
        poses.append(_sph(el, az))
    out["train"] = poses
    out["val"] = [_sph(math.asin(rng.uniform(lo, hi)), rng.uniform(0, 2 * np.pi)) for _ in range(n_val)]
    off = rng.uniform(0, 2 * np.pi)
    out["test"] = [_sph(math.radians(30.0), off + 2 * np.pi * (i + 0.5) / max(n_test, 1)) for i in range(n_test)]
    return {k: np.stack(v) if v else np.zeros((0, 3, 4)) for k, v in out.items()}


def _sph(el, az):
    eye = OBJECTS_RADIUS * np.array([math.cos(el) * math.cos(az), math.cos(el) * math.sin(az), math.sin(el)])
    return _look_at(eye, np.zeros(3))


def _lawnmower(n, span, rng, jitter):
    """n aerial poses on rows along x over [-span, span]^2, heading alternating per row."""
    rows = max(1, int(round(math.sqrt(n * 0.75))))
    cols = int(math.ceil(n / rows))
    ys = np.linspace(-span, span, rows) if rows > 1 else np.zeros(1)
    xs = np.linspace(-span, span, cols) if cols > 1 else np.zeros(1)
    poses = []
    for r in range(rows):
        heading = (1.0, 0.0) if r % 2 == 0 else (-1.0, 0.0)
        order = xs if r % 2 == 0 else xs[::-1]
        for x in order:
            if len(poses) == n:
                break
            eye = np.array([x, ys[r], CITY_ALTITUDE]) + rng.uniform(-1, 1, 3) * jitter
            poses.append(_pose_from_heading(eye, heading, CITY_TILT_DEG + rng.uniform(-2.0, 2.0)))
    return poses


def _city_cameras(seed, n_train, n_val, n_test):
    rng = stream_rng(seed, "city/cameras")
    out = {"train": _lawnmower(n_train, 0.8, rng, np.array([0.02, 0.02, 0.03]))}
    for split, n in (("val", n_val), ("test", n_test)):
        poses = []
        for _ in range(n):  # between the rows, random heading
            eye = np.array([rng.uniform(-0.7, 0.7), rng.uniform(-0.7, 0.7), CITY_ALTITUDE + rng.uniform(-0.05, 0.05)])
            a = rng.uniform(0, 2 * np.pi)
            poses.append(_pose_from_heading(eye, (math.cos(a), math.sin(a)), CITY_TILT_DEG + rng.uniform(-3.0, 3.0)))
        out[split] = poses
    return {k: np.stack(v) if v else np.zeros((0, 3, 4)) for k, v in out.items()}


def _forward_cameras(seed, n_views, n_val, n_test):
    rng = stream_rng(seed, "forward/cameras")
    rows = max(1, int(round(math.sqrt(n_views * 0.6))))
    cols = int(math.ceil(n_views / rows))
    poses = []
    for i in range(n_views):  # row-major over the array; the LLFF hold-out (every 8th) spreads over it
        r, c = divmod(i, cols)
        x = -0.35 + 0.7 * (c / max(cols - 1, 1))
        z = 0.2 - 0.4 * (r / max(rows - 1, 1))
        eye = np.array([x, 0.0, z]) + rng.uniform(-1, 1, 3) * 0.02
        poses.append(_look_at(eye, np.array([0.0, 5.0, -0.5]) + rng.uniform(-1, 1, 3) * 0.1))
    empty = np.zeros((0, 3, 4))
    return {"train": np.stack(poses), "val": empty, "test": empty}


def _outward(rng, angle):
    """A camera on the unbounded kind's ring at ``angle``, looking outward (yaw and pitch jittered)."""
    eye = np.array([0.35 * math.cos(angle), 0.35 * math.sin(angle), rng.uniform(-0.05, 0.05)])
    yaw = angle + rng.uniform(-1, 1) * math.radians(20.0)
    pitch = -math.radians(rng.uniform(6.0, 14.0))
    fwd = np.array([math.cos(yaw) * math.cos(pitch), math.sin(yaw) * math.cos(pitch), math.sin(pitch)])
    return _look_at(eye, eye + fwd)


def _unbounded_cameras(seed, n_train, n_val, n_test):
    rng = stream_rng(seed, "unbounded/cameras")
    a0 = rng.uniform(0, 2 * np.pi)
    out = {"train": [_outward(rng, a0 + 2 * np.pi * (i + rng.uniform(-0.3, 0.3)) / n_train) for i in range(n_train)]}
    for split, n in (("val", n_val), ("test", n_test)):
        out[split] = [_outward(rng, rng.uniform(0, 2 * np.pi)) for _ in range(n)]
    return {k: np.stack(v) if v else np.zeros((0, 3, 4)) for k, v in out.items()}


_CAMERAS = {"objects": _objects_cameras, "city": _city_cameras, "forward": _forward_cameras,
            "unbounded": _unbounded_cameras}


def intrinsics(kind, width, height):
    """(4,) float64 fx, fy, cx, cy of ``kind``'s cameras at this size (square pixels, centred)."""
    if kind == "objects":
        f = 0.5 * width / math.tan(0.5 * BLENDER_CAMERA_ANGLE_X)
    else:
        f = 0.5 * width / math.tan(0.5 * math.radians(HFOV_DEG[kind]))
    return np.array([f, f, width / 2.0, height / 2.0])


def resolve(kind, width, height, n_train, n_val, n_test):
    if kind not in KINDS:
        raise ConfigError(f"kind={kind!r}: use one of {', '.join(KINDS)}")
    dw, dh, dtr, dva, dte = DEFAULTS[kind]
    if width is None and height is None:
        width, height = dw, dh
    elif width is None:
        width = int(round(height * dw / dh))
    elif height is None:
        height = int(round(width * dh / dw))
    vals = {"width": width, "height": height,
            "n_train": dtr if n_train is None else n_train,
            "n_val": dva if n_val is None else n_val,
            "n_test": dte if n_test is None else n_test}
    for k, v in vals.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ConfigError(f"{k}={v!r}: must be an integer")
    for k in ("width", "height"):
        if not 8 <= vals[k] <= 8192:
            raise ConfigError(f"{k}={vals[k]}: image size must be in [8, 8192] pixels")
    if kind == "forward":
        if vals["n_val"] or vals["n_test"]:
            raise ConfigError(f"n_val={vals['n_val']}, n_test={vals['n_test']}: kind 'forward' writes one LLFF image "
                              f"list (the parser holds out every 8th view); give only n_train, the number of views")
        if vals["n_train"] < 2:
            raise ConfigError(f"n_train={vals['n_train']}: kind 'forward' needs at least 2 views (view 0 is held out)")
        for k in ("width", "height"):
            if vals[k] % 8:
                raise ConfigError(f"{k}={vals[k]}: kind 'forward' needs a multiple of 8 (images_4/ and images_8/ "
                                  f"hold exact 1/4 and 1/8 copies)")
    elif vals["n_train"] < 1 or vals["n_val"] < 1:
        raise ConfigError(f"n_train={vals['n_train']}, n_val={vals['n_val']}: need at least 1 train and 1 val image")
    min_test = 1 if kind == "objects" else 0
    if vals["n_test"] < min_test:
        raise ConfigError(f"n_test={vals['n_test']}: must be >= {min_test} for kind {kind!r}")
    if sum(vals[k] for k in ("n_train", "n_val", "n_test")) > 100000:
        raise ConfigError("n_train + n_val + n_test: at most 100000 images")
    return tuple(int(vals[k]) for k in ("width", "height", "n_train", "n_val", "n_test"))


def scene_cameras(kind: str, *, width=None, height=None, n_train=None, n_val=None, n_test=None, seed: int = 0) -> dict:
    """The cameras ``make_scene`` renders with the same arguments, in the SCENE frame.

    Returns:
        {split: {"c2w": (N, 3, 4) float64 OpenGL c2w, "intrinsics": (N, 4) float64 fx fy cx cy,
        "width": int, "height": int}} for "train", "val", "test" (city, unbounded: "test" may
        have N = 0; forward: every view is in "train", "val" and "test" have N = 0).
    """
    width, height, n_train, n_val, n_test = resolve(kind, width, height, n_train, n_val, n_test)
    cams = _CAMERAS[kind](int(seed), n_train, n_val, n_test)
    k = intrinsics(kind, width, height)
    return {s: {"c2w": c, "intrinsics": np.tile(k, (len(c), 1)), "width": width, "height": height} for s, c in cams.items()}


def pixel_rays(c2w, k, width, height):
    """(3,4), (4,) -> origins, directions (H*W, 3) float64, row-major (ARCHITECTURE.md formula)."""
    rows, cols = np.meshgrid(np.arange(height, dtype=np.float64), np.arange(width, dtype=np.float64), indexing="ij")
    x = (cols.ravel() + 0.5 - k[2]) / k[0]
    y = -(rows.ravel() + 0.5 - k[3]) / k[1]
    d_cam = np.stack([x, y, -np.ones_like(x)], axis=1)
    d = d_cam @ c2w[:, :3].T
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return np.broadcast_to(c2w[:, 3], d.shape), d

