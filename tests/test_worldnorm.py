"""``scene.normalize_world: true``: COLMAP scenes in gsplat's normalised world (its default
``normalize_world_space``), poses and points as gsplat's Parser has them, every split alike."""

from __future__ import annotations

import numpy as np
import pytest

from dali_nerf.config import load_config
from dali_nerf.errors import ConfigError, SceneError
from dali_nerf.scenes import load_scene, scene_from_config
from dali_nerf.scenes.worldnorm import with_gsplat_world
from dali_nerf.sources.images import ImageLoader, opencv_camtoworld

from _colmap_scene import colmap_scene
from _gsplat_reference import GsplatReference

SEED = 7311


def _cfg(root, *extra):
    return load_config("splat_objects", [f"scene.path={root}", "scene.format=colmap", *extra])


@pytest.mark.parametrize("seed, flipped", [(SEED, True), (7300, False)])
def test_poses_and_points_are_gsplats_normalised_parsers(tmp_path, seed, flipped):
    """Every batch's ``camtoworld`` (train and test splits) and the scene's sparse points equal
    gsplat's Parser with ``normalize=True`` (re-derived in tests/_gsplat_reference.py; one scene
    whose points the Parser turns upside down, one it does not), and the
    normalised world is what gsplat makes it: the points' covariance diagonal, with decreasing
    variances. A similarity moves cameras and points together, so every
    point projects to the same pixel as before."""
    print("seed", seed)
    root = colmap_scene(tmp_path / "s", n=17, width=48, height=32, factors=(), seed=seed, points=60)
    for split, ref_split in (("train", "train"), ("test", "val")):
        ref = GsplatReference(root, 1, split=ref_split, normalize=True)
        assert ref.flipped == flipped  # both branches of the Parser's upside-down fix covered
        raw = load_scene(root, split, format="colmap")
        scene = scene_from_config(_cfg(root, "scene.normalize_world=true"), split)
        np.testing.assert_allclose(scene.points, ref.points, rtol=0, atol=2e-5)
        with ImageLoader(scene, images_per_batch=1, seed=seed, prefetch=1) as ld:
            for _ in range(len(ref)):
                b = next(ld)
                i = int(b["image_id"][0])
                np.testing.assert_allclose(b["camtoworld"][0].numpy(), ref.item(i)["camtoworld"], rtol=0, atol=2e-5)
        # the same pixel for every point in front of every camera, before and after
        for c2w_a, c2w_b, k in zip(opencv_camtoworld(raw), opencv_camtoworld(scene), scene.intrinsics):
            for pts, c2w in ((raw.points, c2w_a), (scene.points, c2w_b)):
                cam = (pts.astype(np.float64) - c2w[:3, 3]) @ c2w[:3, :3]
                uv = cam[:, :2] / cam[:, 2:] * k[:2] + k[2:]
                if c2w is c2w_a:
                    # in front, not grazing the camera plane (float32 points: a pixel far off the image drifts)
                    before, front = uv, cam[:, 2] > 0.05 * np.median(np.abs(cam[:, 2]))
            np.testing.assert_allclose(uv[front], before[front], rtol=1e-5, atol=2e-3)  # float32 points
    p = scene.points.astype(np.float64)
    cov = np.cov(p, rowvar=False)
    assert np.all(np.abs(cov - np.diag(np.diag(cov))) < 1e-4 * cov.max()) and np.all(np.diff(np.diag(cov)) <= 0)
    t = scene.world_from_source
    np.testing.assert_allclose(t @ np.append(raw.points[0], 1.0), np.append(scene.points[0], 1.0), atol=1e-4)
    assert abs(np.linalg.norm(scene.up) - 1.0) < 1e-6
    assert np.median(p[:, 2]) <= np.mean(p[:, 2])  # most points low, as the Parser leaves them
    with pytest.raises(SceneError, match="already moved from its source world"):
        with_gsplat_world(scene)  # not twice


def test_off_by_default_and_refused_where_it_does_not_apply(tmp_path):
    """Off: COLMAP's own world, the scene as parsed. Another format, too few points or a non-bool
    value: one line naming the key and the fix."""
    root = colmap_scene(tmp_path / "s", n=9, width=32, height=24, factors=(), seed=SEED, points=60)
    raw, off = load_scene(root, "train", format="colmap"), scene_from_config(_cfg(root))
    assert np.array_equal(off.c2w, raw.c2w) and np.array_equal(off.points, raw.points)
    with pytest.raises(ConfigError, match=r"scene\.normalize_world: expected true or false, got 2"):
        _cfg(root, "scene.normalize_world=2")
    few = colmap_scene(tmp_path / "few", n=9, width=32, height=24, factors=(), seed=SEED, points=3)
    with pytest.raises(SceneError, match=r"3 sparse points.*set scene.normalize_world: false") as e:
        with_gsplat_world(load_scene(few, "train", format="colmap"))
    assert "\n" not in str(e.value)
    same = colmap_scene(tmp_path / "same", n=9, width=32, height=24, factors=(), seed=SEED, points=60)
    from dali_nerf.scenes.colmap_io import read_model, write_model

    model = read_model(same / "sparse" / "0")
    for im in model.images:  # every camera at the origin, looking the same way: no distance to scale by
        im.qvec[:], im.tvec[:] = (1.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0)
    write_model(same / "sparse" / "0", model)
    with pytest.raises(SceneError, match=r"normalisation is undefined for this capture.*normalize_world: false") as e:
        with_gsplat_world(load_scene(same, "train", format="colmap"))
    assert "\n" not in str(e.value)
    from dali_nerf.scenegen import make_scene

    blender = make_scene("objects", tmp_path / "b", width=16, height=16, n_train=2, n_val=1, n_test=1, seed=SEED)
    with pytest.raises(SceneError, match=r"COLMAP scenes, not 'blender'; set scene.normalize_world: false"):
        with_gsplat_world(load_scene(blender, "train"))


def test_the_capture_model_is_read_once_while_its_files_stay(tmp_path, monkeypatch):
    """Both splits, gsplat's normalisation and EXIF exposure read the sparse model once per process
    (the parser's, kept while its files' sizes and times stay); a rewritten model is read again."""
    import os

    from dali_nerf.scenes import colmap

    root = colmap_scene(tmp_path / "s", n=9, width=32, height=24, factors=(), seed=SEED, points=60)
    reads = []
    real = colmap.read_model
    monkeypatch.setattr(colmap, "read_model", lambda folder: reads.append(folder) or real(folder))
    for split in ("train", "test"):
        scene_from_config(_cfg(root, "scene.normalize_world=true"), split)
    assert len(reads) == 1
    pts = root / "sparse" / "0" / "points3D.bin"
    st = pts.stat()
    os.utime(pts, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the same bytes, a new time: read again
    load_scene(root, "train", format="colmap")
    assert len(reads) == 2
