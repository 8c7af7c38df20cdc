"""Decode stage: DALI sharding, compositing, gray/16-bit policy, size checks (vs cv2 references)."""

import numpy as np
import pytest

from _tiny_scene import reference_pixels, tiny_scene
from dali_nerf.errors import DataError, SceneError
from dali_nerf.data.imagecache import decode_cache, pack_cameras
from dali_nerf.pipelines.decode import shard_range, shard_sizes


KINDS = ("png_rgba", "jpg", "png_gray", "png16", "png_rgb")


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    return tiny_scene(tmp_path_factory.mktemp("dec"), n=5, width=24, height=16, kinds=KINDS,
                      background=(0.2, 0.5, 0.9))


def _check_cache_against_reference(scene, cache):
    assert cache.pixels.dtype == np.uint8 and cache.pixels.shape == (cache.num_pixels, 3)
    assert cache.cameras.dtype == np.float32 and cache.cameras.shape == (cache.num_images, 18)
    assert cache.layout.dtype == np.int64 and cache.layout.shape == (cache.num_images, 4)
    off = 0
    for k, (o, w, h, cam) in enumerate(cache.layout):
        assert o == off and (w, h) == (scene.width[cam], scene.height[cam])
        off += w * h
        ref = reference_pixels(scene, cam)
        got = cache.image(k)
        tol = 3 if scene.image_paths[cam].endswith(".jpg") else 0
        assert np.abs(got.astype(int) - ref.astype(int)).max() <= tol, scene.image_paths[cam]
    assert off == cache.num_pixels
    np.testing.assert_array_equal(cache.cameras[:, :12], scene.c2w[cache.layout[:, 3]].reshape(-1, 12))
    np.testing.assert_array_equal(cache.cameras[:, 12:16], scene.intrinsics[cache.layout[:, 3]])


def test_single_shard_matches_cv2_reference(scene):
    cache = decode_cache(scene, 0, 1)
    assert list(cache.layout[:, 3]) == list(range(5))
    _check_cache_against_reference(scene, cache)
    # alpha 0 -> background, alpha 255 -> the pixel itself
    bg8 = np.round(scene.background.astype(np.float64) * 255)
    np.testing.assert_array_equal(cache.image(0)[0, 0], bg8)
    assert not cache.pixels.flags.writeable


@pytest.mark.parametrize("world_size", [2, 3])
def test_shards_disjoint_complete_and_dalis_rule(scene, world_size):
    seen = []
    for r in range(world_size):
        cache = decode_cache(scene, r, world_size)
        lo, hi = shard_range(5, r, world_size)
        assert list(cache.layout[:, 3]) == list(range(lo, hi))
        assert cache.num_pixels == shard_sizes(scene, world_size)[r]
        _check_cache_against_reference(scene, cache)
        seen += list(cache.layout[:, 3])
    assert sorted(seen) == list(range(5))
    # DALI's documented rule, independently: floor(i * N / S)
    assert [shard_range(7, i, 3) for i in range(3)] == [(0, 2), (2, 4), (4, 7)]


def test_non_square_mixed_sizes(tmp_path):
    sc = tiny_scene(tmp_path, n=3, kinds=("png_rgba", "jpg"), sizes=[(30, 10), (8, 20), (17, 13)])
    cache = decode_cache(sc, 0, 1, batch=2)
    _check_cache_against_reference(sc, cache)


def test_world_size_larger_than_images_is_one_line_error(scene):
    with pytest.raises(SceneError) as e:
        decode_cache(scene, 0, 6)
    msg = str(e.value)
    assert "\n" not in msg and "world_size=6" in msg and "5 images" in msg


def test_wrong_declared_size_names_file(tmp_path):
    sc = tiny_scene(tmp_path, n=2, kinds=("png_rgb",))
    from dali_nerf.scenes.base import Scene
    bad = Scene(image_paths=sc.image_paths, c2w=sc.c2w, intrinsics=sc.intrinsics, width=[24, 25],
                height=[16, 16], split="train", format="blender", root=sc.root)
    with pytest.raises(DataError) as e:
        decode_cache(bad)
    assert sc.image_paths[1] in str(e.value) and "25x16" in str(e.value) and "\n" not in str(e.value)


def test_missing_and_corrupt_files(tmp_path):
    sc = tiny_scene(tmp_path, n=2, kinds=("png_rgb",))
    (tmp_path / "img_001.png").write_bytes(b"not an image at all")
    with pytest.raises(DataError) as e:
        decode_cache(sc)
    assert "\n" not in str(e.value)
    (tmp_path / "img_001.png").unlink()
    with pytest.raises(DataError, match="img_001.png: image file not found"):
        decode_cache(sc)


def test_pack_cameras_unknown_bounds(tmp_path):
    sc = tiny_scene(tmp_path, n=2, kinds=("png_rgb",), bounds=False)
    cams = pack_cameras(sc, [1, 0])
    assert cams.shape == (2, 18) and np.all(cams[:, 16] == 0) and np.all(cams[:, 17] == 1e10)
    np.testing.assert_array_equal(cams[0, :12], sc.c2w[1].reshape(-1))
