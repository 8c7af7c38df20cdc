"""The scene fingerprint (``dali_nerf.scenes.fingerprint``) and the batch sources' states that carry
it: a state saved from another scene is refused in one line naming what changed; a state saved
before fingerprints existed still loads."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil

import pytest
import torch

from dali_nerf.config import PartitionConfig, load_config
from dali_nerf.errors import ConfigError
from dali_nerf.partition import Partition, assign_rank
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.scenegen import make_scene
from dali_nerf.scenes import describe_change, load_scene, scene_fingerprint
from dali_nerf.sources import build_source
from dali_nerf.sources.registry import SOURCES, SS_SOURCES


@pytest.fixture(scope="module")
def city(tmp_path_factory):
    """A Mega-NeRF scene (near/far bounds: every source, SS included, can sample it)."""
    root = make_scene("city", tmp_path_factory.mktemp("fp") / "city", width=24, height=16, n_train=8, n_val=1)
    return root, load_scene(root, "train", format="mega_nerf")


def test_fingerprint_is_a_property_of_the_files(city, tmp_path):
    """Parsing the same files again, or the folder after a move, gives the same fingerprint; it
    survives JSON and torch.load(weights_only=True); it does not depend on a shard."""
    root, scene = city
    fp = scene_fingerprint(scene)
    assert fp == scene_fingerprint(load_scene(root, "train", format="mega_nerf"))
    moved = shutil.copytree(root, tmp_path / "elsewhere")
    assert scene_fingerprint(load_scene(moved, "train", format="mega_nerf")) == fp
    assert json.loads(json.dumps(fp)) == fp
    buf = io.BytesIO()
    torch.save({"scene": fp}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["scene"] == fp
    assert fp["names"] == [p[len(str(root)) + 1:] for p in scene.image_paths] and len(fp["digest"]) == 16
    assert describe_change(fp, scene_fingerprint(scene)) is None
    fp["names"].append("changed by the caller")  # a copy each call: the cached one is untouched
    assert scene_fingerprint(scene)["names"] == fp["names"][:-1]


def test_describe_change_names_what_changed(city):
    _, scene = city
    fp = scene_fingerprint(scene)
    n = scene.num_images
    names = fp["names"]
    assert describe_change(fp, scene_fingerprint(scene.subset(range(n - 2)))) == \
        f"2 images removed ({names[-2]}, {names[-1]})"
    assert describe_change(scene_fingerprint(scene.subset(range(n - 1))), fp) == f"1 image added ({names[-1]})"
    order = [1, 0] + list(range(2, n))
    assert describe_change(fp, scene_fingerprint(scene.subset(order))) == f"image order changed ({names[1]}, {names[0]} moved)"
    c2w = scene.c2w.copy()
    c2w[[2, 5], 0, 3] += 0.01
    assert describe_change(fp, scene_fingerprint(dataclasses.replace(scene, c2w=c2w))) == \
        f"camera poses changed (2 images: {names[2]}, {names[5]})"
    k = scene.intrinsics.copy()
    k[4, 0] *= 1.01
    assert describe_change(fp, scene_fingerprint(dataclasses.replace(scene, intrinsics=k))) == \
        f"camera intrinsics, bounds or distortion changed (1 image: {names[4]})"
    w, h = scene.width.copy(), scene.height.copy()
    w[3], h[3] = 12, 8
    assert describe_change(fp, scene_fingerprint(dataclasses.replace(scene, width=w, height=h))) == \
        f"image sizes changed ({names[3]} 24x16 -> 12x8)"
    assert describe_change(fp, scene_fingerprint(dataclasses.replace(scene, downscale=2))) == "downscale 1 -> 2"
    assert describe_change(fp, scene_fingerprint(dataclasses.replace(scene, split="val"))) == "split 'train' -> 'val'"
    assert describe_change(None, fp) is None  # nothing saved: nothing to compare
    assert describe_change(dict(fp, version=0), fp) is None  # another definition: not compared


def _config(name: str, **pipe):
    over = [f"pipeline.name={name}", "pipeline.rays_per_batch=64", "pipeline.rays_per_run=128", "pipeline.prefetch=1",
            "pipeline.num_threads=1", "pipeline.workers=0", "train.device=cpu"]
    return load_config(None, over + [f"pipeline.{k}={v}" for k, v in pipe.items()], check_paths=False)


def _sources(cfg, scene, ss: bool, cache):
    if not ss:
        return [build_source(cfg, scene, 0, 1)]
    part = Partition.from_config(PartitionConfig(grid=[2, 2]), scene)
    return build_source(cfg, scene, 0, 1, cells=assign_rank(4, 1), partition=part, cache=cache)


@pytest.mark.parametrize("ss", [False, True], ids=["ddp", "ss"])
def test_every_source_refuses_a_state_from_another_scene(city, ss):
    """Every source of the registry (DDP and SS) carries the fingerprint in its state and refuses
    a state of another scene of the same pixel count (poses moved) in one line; a state without
    one (saved before fingerprints) still loads."""
    _, scene = city
    c2w = scene.c2w.copy()
    c2w[1, 1, 3] += 0.5
    other = dataclasses.replace(scene, c2w=c2w)  # same images and pixel count, another camera
    cache = decode_cache(scene, 0, 1, num_threads=1) if ss else None
    names = [n for n in (SS_SOURCES if ss else SOURCES) if n != "ready"]  # ready repeats one batch: no stream
    for name in names:
        cfg = _config(name)
        states = []
        for src in _sources(cfg, scene, ss, cache):
            states.append(src.state_dict())
            assert states[-1]["scene"] == scene_fingerprint(scene), name
            src.load_state_dict(states[-1])  # the same scene: accepted
            src.close()
        for src, state in zip(_sources(cfg, other, ss, cache), states):
            with pytest.raises(ConfigError) as e:
                src.load_state_dict(state)
            msg = str(e.value)
            assert "\n" not in msg and msg.startswith(f"{type(src).__name__}.load_state_dict: ") and scene.root in msg, \
                (name, msg)
            assert f"camera poses changed (1 image: {scene_fingerprint(scene)['names'][1]})" in msg, (name, msg)
            src.load_state_dict({k: v for k, v in state.items() if k != "scene"})  # an old state: no check possible
            src.close()


def test_rayloader_refuses_another_scene_of_the_same_pixel_count(city):
    """The case that slipped through before: the same number of pixels (so ``num_pixels`` matched),
    other images."""
    from dali_nerf.sources import RayLoader

    _, scene = city
    a = scene.subset([0, 1, 2, 3])
    b = scene.subset([4, 5, 6, 7])
    assert a.num_pixels == b.num_pixels
    with RayLoader(a, rays_per_batch=64, rays_per_run=128, num_threads=1) as la, \
            RayLoader(b, rays_per_batch=64, rays_per_run=128, num_threads=1) as lb:
        next(la)
        with pytest.raises(ConfigError, match=r"4 images added .*; 4 images removed"):
            lb.load_state_dict(la.state_dict())
        with pytest.raises(ConfigError, match=r"position=-5: must be an integer in \[0, "):
            la.load_state_dict(dict(la.state_dict(), position=-5))
