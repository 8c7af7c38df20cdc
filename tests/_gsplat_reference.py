"""What gsplat's ``examples/datasets/colmap.py`` (Parser + Dataset, read at commit 0714fc6) yields
for a COLMAP scene, re-derived from its definitions with numpy and cv2 (not its code): the contract the image
loader is tested against. pycolmap reads the model as gsplat does when it is installed (the test
extra); else our reader (itself tested against pycolmap in tests/test_colmap.py).

Parser(data_dir, factor, normalize=False, test_every=8) (``normalize=True``: gsplat's
``normalize_world_space``, ``datasets/normalize.py`` read at 11909fc, re-derived below in
:func:`_normalised`):
* every registered image: world-to-camera ``[R | t]`` (4x4), its camera's calibration matrix with
  rows 0 and 1 divided by ``factor``; camera-to-world = ``np.linalg.inv`` of the stack (float64);
* images sorted by name; ``camera_idx`` = index of the camera id among the sorted distinct ids;
* image folder ``images_<factor>`` (factor > 1; PNG files taken as they are, matched to the
  COLMAP names by position in the two sorted file lists), else ``images``;
* K rescaled by the first image's actual size over ``camera size // factor`` (x and y apart).
Dataset(split, patch_size): train = indices with ``i % test_every != 0`` (else val); item ->
``K`` (a copy, principal point minus the patch corner), ``camtoworld``, ``image`` (RGB, the crop
``[y:y+p, x:x+p]`` with ``x`` in ``[0, max(w - p, 1))``), ``image_id`` = item, ``camera_idx``.
"""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np

__all__ = ["GsplatReference"]


def _read(folder: Path):
    """[(name, w2c 4x4, camera id)], {camera id: (K 3x3, w, h)} via pycolmap, else our reader."""
    try:
        import pycolmap
    except ImportError:
        pycolmap = None
    images, cams = [], {}
    if pycolmap is not None:
        rec = pycolmap.Reconstruction(str(folder))
        for im in rec.images.values():
            images.append((im.name, np.vstack([im.cam_from_world().matrix(), [0, 0, 0, 1]]), im.camera_id))
        for cid, cam in rec.cameras.items():
            cams[cid] = (np.asarray(cam.calibration_matrix(), np.float64), cam.width, cam.height)
        return images, cams, "pycolmap"
    from dali_nerf.scenes.colmap_io import read_model, rotation_from_quaternion

    model = read_model(folder)
    for im in model.images:
        w2c = np.eye(4)
        w2c[:3, :3], w2c[:3, 3] = rotation_from_quaternion(im.qvec), im.tvec
        images.append((im.name, w2c, im.camera_id))
    for cid, c in model.cameras.items():
        p = c.params
        f = (p[0], p[0], p[1], p[2]) if c.model == "SIMPLE_PINHOLE" else (p[0], p[1], p[2], p[3])
        cams[cid] = (np.array([[f[0], 0, f[2]], [0, f[1], f[3]], [0, 0, 1.0]]), c.width, c.height)
    return images, cams, "dali_nerf reader"


def _points(folder: Path) -> np.ndarray:
    """(M, 3) float64 the sparse points, as the Parser reads them (pycolmap, else our reader)."""
    try:
        import pycolmap
    except ImportError:
        from dali_nerf.scenes.colmap_io import read_model

        return np.asarray(read_model(folder).xyz, np.float32).reshape(-1, 3).astype(np.float64)
    rec = pycolmap.Reconstruction(str(folder))  # the Parser holds them as float32
    return np.array([p.xyz for _, p in sorted(rec.points3D.items())], np.float32).reshape(-1, 3).astype(np.float64)


def _normalised(c2w: np.ndarray, pts: np.ndarray):
    """gsplat's normalisation of every camera (OpenCV axes, sorted by name) and the points: the
    world turned so the cameras' mean up (their -y) becomes -y by the shortest rotation (here an
    axis-angle through cv2.Rodrigues), recentred on the median of the points closest to the origin
    on the optical axes, scaled so the median camera distance is 1; then rotated about the points'
    median onto their principal axes (descending variance, made right-handed by flipping the
    first); then, as the Parser does (``examples/datasets/colmap.py``), y and z negated when the
    points' median height is above their mean; the cameras' rotations divided by the scale."""
    up = -c2w[:, :3, 1].mean(axis=0)
    up /= np.linalg.norm(up)
    target = np.array([0.0, -1.0, 0.0])
    axis = np.cross(up, target)
    angle = np.arctan2(np.linalg.norm(axis), up @ target)
    rot = cv2.Rodrigues(axis / max(np.linalg.norm(axis), 1e-300) * angle)[0]
    cam = np.einsum("ij,njk->nik", rot, c2w[:, :3, :4])
    t, fwd = cam[:, :, 3], cam[:, :, 2]
    foot = t - (fwd * t).sum(1)[:, None] * fwd
    centre = np.median(foot, axis=0)
    s = 1.0 / np.median(np.linalg.norm(t - centre, axis=1))
    sim = np.eye(4)
    sim[:3, :3], sim[:3, 3] = s * rot, -s * centre
    p1 = (pts @ sim[:3, :3].T) + sim[:3, 3]
    med = np.median(p1, axis=0)
    w, v = np.linalg.eigh(np.cov(p1 - med, rowvar=False))
    v = v[:, np.argsort(w)[::-1]]
    if np.linalg.det(v) < 0:
        v[:, 0] *= -1
    pa = np.eye(4)
    pa[:3, :3], pa[:3, 3] = v.T, -v.T @ med
    T = pa @ sim
    height = (pts @ T[:3, :3].T + T[:3, 3])[:, 2]
    flipped = bool(np.median(height) > height.mean())
    if flipped:  # colmap.py's upside-down fix: y and z negated
        T = np.diag([1.0, -1.0, -1.0, 1.0]) @ T
    out = np.einsum("ki,nij->nkj", T, c2w)
    out[:, :3, :3] /= np.linalg.norm(out[:, 0, :3], axis=1)[:, None, None]
    return out, pts @ T[:3, :3].T + T[:3, 3], flipped


class GsplatReference:
    """The Parser + Dataset of the module doc for ``root`` at ``factor``, ``split`` train | val."""

    def __init__(self, root, factor: int = 1, split: str = "train", test_every: int = 8, normalize: bool = False):
        root = Path(root)
        images, cams, self.reader = _read(root / "sparse" / "0")
        self.points = _points(root / "sparse" / "0")
        ks = {}
        for cid, (k, w, h) in cams.items():
            k = k.copy()
            k[:2, :] /= factor
            ks[cid] = [k, (w // factor, h // factor)]
        c2w = np.linalg.inv(np.stack([m for _, m, _ in images]))
        names = [n for n, _, _ in images]
        order = np.argsort(names)
        self.names = [names[i] for i in order]
        self.c2w = c2w[order]
        if normalize:
            self.c2w, self.points, self.flipped = _normalised(self.c2w, self.points)
        self.camera_ids = [images[i][2] for i in order]
        ids = sorted(set(self.camera_ids))
        self.camera_idx = [ids.index(c) for c in self.camera_ids]
        folder = root / ("images" if factor == 1 else f"images_{factor}")
        colmap_files = sorted(os.listdir(root / "images"))
        files = sorted(os.listdir(folder))
        assert factor == 1 or files[0].lower().endswith(".png"), "the reference covers PNG images_N only"
        mapping = dict(zip(colmap_files, files))
        self.paths = [str(folder / mapping[n]) for n in self.names]
        first = cv2.imread(self.paths[0])
        sx = first.shape[1] / ks[self.camera_ids[0]][1][0]
        sy = first.shape[0] / ks[self.camera_ids[0]][1][1]
        for k, _ in ks.values():
            k[0, :] *= sx
            k[1, :] *= sy
        self.ks = {cid: k for cid, (k, _) in ks.items()}
        idx = np.arange(len(self.names))
        self.indices = idx[idx % test_every != 0] if split == "train" else idx[idx % test_every == 0]

    def __len__(self) -> int:
        return len(self.indices)

    def item(self, item: int, patch_corner=None, patch_size=None) -> dict:
        """Dataset[item] with the patch corner given (gsplat draws it; the loader's draw is
        checked to lie in gsplat's range)."""
        index = self.indices[item]
        image = cv2.cvtColor(cv2.imread(self.paths[index]), cv2.COLOR_BGR2RGB)
        k = self.ks[self.camera_ids[index]].copy()
        if patch_size is not None:
            h, w = image.shape[:2]
            x, y = patch_corner
            assert 0 <= x < max(w - patch_size, 1) and 0 <= y < max(h - patch_size, 1), (x, y, w, h)
            image = image[y:y + patch_size, x:x + patch_size]
            k[0, 2] -= x
            k[1, 2] -= y
        return {"K": k.astype(np.float32), "camtoworld": self.c2w[index].astype(np.float32),
                "image": image.astype(np.float32), "image_id": item, "camera_idx": self.camera_idx[index]}
