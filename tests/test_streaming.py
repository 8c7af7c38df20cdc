"""RayLoader streaming mode: a shard larger than max_bytes is sampled through two decoded windows.

References are independent of the streaming code: pixels come from a whole-shard decode_cache,
ray geometry from a float64 numpy formula, window membership from the sets of cameras seen.
"""

import threading
import time
import weakref

import numpy as np
import pytest
import torch

from _tiny_scene import assert_batch_contract, ref_rays as _ref_rays, tiny_scene
from dali_nerf.errors import ConfigError, DataError
from dali_nerf.sources import RayLoader, plan_window_images, window_plan
from dali_nerf.data import imagecache as decode_mod
from dali_nerf.sources import streaming as stream_mod
from dali_nerf.data.imagecache import decode_cache

W_PX, H_PX, N_IMG = 24, 16, 8
PER_IMAGE = W_PX * H_PX * 3 + 104  # decoded bytes + camera/layout rows of one window image
MAX_BYTES = 2 * 3 * PER_IMAGE  # two windows of 3 images: W = 3, windows of 3, 3, 2 images


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    return tiny_scene(tmp_path_factory.mktemp("st"), n=N_IMG, width=W_PX, height=H_PX,
                      kinds=("png_rgba", "jpg", "png_rgb"))


@pytest.fixture(scope="module")
def full(scene):
    return decode_cache(scene, 0, 1)  # whole split, decoded once: the pixel reference


def _loader(scene, **kw):
    kw = {"rays_per_batch": 100, "rays_per_run": 300, "max_bytes": MAX_BYTES, "seed": 5, **kw}
    return RayLoader(scene, **kw)


def _take(loader, n):
    return [{k: v.clone() for k, v in next(loader).items()} for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def _pid(cache, idx):
    cam, row, col = idx.numpy().T
    pos = {int(c): k for k, c in enumerate(cache.layout[:, 3])}
    k = np.array([pos[int(c)] for c in cam])
    return cache.layout[k, 0] + row * cache.layout[k, 1] + col


def test_streams_with_bounded_memory(scene, monkeypatch):
    assert scene.num_pixels * 3 > MAX_BYTES
    alive = []  # weak references to every window's pixel buffer (spy on the real decoder)
    real = decode_mod.decode_cache

    started = []  # one entry per decode begun (the successor's runs on the engine's thread)

    def spy(*a, **kw):
        started.append(1)
        c = real(*a, **kw)
        alive.append((weakref.ref(c.pixels), c.nbytes))
        return c

    monkeypatch.setattr(decode_mod, "decode_cache", spy)  # what the engine's window_cache calls
    with _loader(scene, mode="epoch", prefetch=2) as L:
        assert L.streaming and L.window_images == 3 and L.cache is None
        assert "streaming" in repr(L)
        max_live = 0
        for _ in range(2 * len(L)):
            next(L)
            # let a background successor decode finish before looking (on a loaded machine it may
            # otherwise still run when the consumer reaches the window's end: double buffering not seen)
            t0 = time.monotonic()
            while len(alive) < len(started) and time.monotonic() - t0 < 30:
                time.sleep(0.002)
            live = [(r, nb) for r, nb in alive if r() is not None]
            max_live = max(max_live, len(live))
            assert len(live) <= 2 and sum(nb for _, nb in live) <= MAX_BYTES
        s = L.stats()
    assert s["streaming"] and s["windows_per_cycle"] == 3
    # 62 steps = 6200 positions: 2 cycles of 3 windows + window 0 of cycle 2 (7 windows), + its
    # successor, which the background decode may or may not have reached when the loader closes
    assert 7 <= s["windows_decoded"] <= len(alive) <= 8
    assert s["peak_bytes"] <= MAX_BYTES and max_live == 2  # double buffered, never more
    assert all(r() is None for r, _ in alive)  # close() frees every window


def test_plan_window_images_and_errors(scene):
    px = [W_PX * H_PX] * 4 + [W_PX * H_PX * 2]
    assert plan_window_images(px, 2 * (2 * PER_IMAGE + W_PX * H_PX * 3)) == 2  # sized by the largest images
    assert plan_window_images(px, 10 ** 9) == 5
    with pytest.raises(ConfigError, match="cache.max_bytes") as e:
        _loader(scene, max_bytes=PER_IMAGE)  # not even two one-image windows
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="cache.window_images"):
        _loader(scene, window_images=4)
    with pytest.raises(ConfigError, match="rays_per_window"):
        _loader(scene, rays_per_window=-1)
    # a window plan is a partition of the shard, sizes differ by at most one, per-cycle shuffle
    ws = window_plan(np.arange(10, 18), 3, seed=1, rank=0, cycle=0)
    assert [len(w) for w in ws] == [3, 3, 2] and sorted(np.concatenate(ws).tolist()) == list(range(10, 18))
    other = window_plan(np.arange(10, 18), 3, seed=1, rank=0, cycle=1)
    assert not all(np.array_equal(a, b) for a, b in zip(ws, other))


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_batch_contract_and_pixels(scene, full, mode):
    B = 100
    with _loader(scene, mode=mode, rays_per_batch=B) as L:
        for _ in range(14):  # crosses window boundaries (windows of 1152 / 768 positions)
            b = next(L)
            assert_batch_contract(b, B)
            np.testing.assert_array_equal(b["rgb"].numpy(), full.pixels[_pid(full, b["indices"])] / np.float32(255))
            o, d = _ref_rays(scene, b["indices"])
            np.testing.assert_allclose(b["origins"].numpy(), o, atol=1e-5)
            np.testing.assert_allclose(b["directions"].numpy(), d, atol=1e-5)
            cam = b["indices"][:, 0].numpy()
            np.testing.assert_array_equal(b["near"].numpy()[:, 0], scene.near[cam])


def test_windows_hold_few_images_and_switch_after_rays_per_window(scene):
    rpw = 250
    with _loader(scene, mode="random", rays_per_window=rpw, rays_per_batch=50) as L:
        idx = torch.cat([next(L)["indices"] for _ in range(5 * 3 * 2)]).numpy()  # two cycles of 3 windows
    cams = [set(idx[w * rpw:(w + 1) * rpw, 0].tolist()) for w in range(6)]
    assert all(1 <= len(c) <= 3 for c in cams)  # each window: at most W images, rays from several
    assert max(len(c) for c in cams) > 1
    for cyc in range(2):  # the windows of one cycle are disjoint and cover the split
        part = cams[3 * cyc:3 * cyc + 3]
        assert sum(len(c) for c in part) == len(set().union(*part))
    for cyc in range(2):  # 250 iid rays over <= 3 images of 384 pixels: every image of the cycle is hit
        assert set().union(*cams[3 * cyc:3 * cyc + 3]) == set(range(N_IMG))


def test_epoch_mode_every_pixel_once(scene, full):
    P = full.num_pixels
    orders = []
    with _loader(scene, mode="epoch", rays_per_batch=128, rays_per_run=500) as L:
        assert len(L) == -(-P // 128) and L.num_pixels == P
        for e in (0, 1):
            L.set_epoch(e)
            idx = torch.cat([next(L)["indices"] for _ in range(len(L))])[:P]
            pid = _pid(full, idx)
            assert np.array_equal(np.sort(pid), np.arange(P))
            orders.append(pid)
    assert not np.array_equal(orders[0], orders[1])


def test_epoch_mode_two_ranks_cover_split_once(scene, full):
    seen = []
    for r in range(2):  # each shard (4 images) is larger than max_bytes = 2 windows of 1 image
        with _loader(scene, mode="epoch", rank=r, world_size=2, max_bytes=2 * PER_IMAGE + 10) as L:
            assert L.streaming and L.window_images == 1
            seen.append(torch.cat([next(L)["indices"] for _ in range(len(L))])[:L.num_pixels])
    pid = _pid(full, torch.cat(seen))
    assert np.array_equal(np.sort(pid), np.arange(full.num_pixels))


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_determinism_and_run_invariance(scene, mode):
    ref = _take(_loader(scene, mode=mode, prefetch=0, rays_per_run=100), 26)
    for prefetch, rpr in ((2, 300), (1, 10 ** 6)):
        assert _same(ref, _take(_loader(scene, mode=mode, prefetch=prefetch, rays_per_run=rpr), 26)), (prefetch, rpr)
    other = _take(_loader(scene, mode=mode, seed=6), 2)
    assert not torch.equal(ref[0]["indices"], other[0]["indices"])


@pytest.mark.parametrize("mode", ["random", "epoch"])
@pytest.mark.parametrize("stop", [11, 12, 20])  # 11: the next step straddles windows 0|1 (position 1152)
def test_resume_exactly_across_window_boundary(scene, mode, stop):
    ref = _take(_loader(scene, mode=mode), 30)
    part = _loader(scene, mode=mode)
    _take(part, stop)
    state = part.state_dict()
    part.close()
    assert state["position"] == stop * 100 and state["window_images"] == 3
    resumed = _loader(scene, mode=mode, rays_per_run=700)
    resumed.load_state_dict(state)
    assert _same(ref[stop:], _take(resumed, 30 - stop))
    resumed.close()
    with pytest.raises(ConfigError, match="window_images"):
        _loader(scene, mode=mode, max_bytes=None).load_state_dict(state)  # cached loader: another stream


def test_close_leaves_no_thread(scene, monkeypatch):
    real = decode_mod.decode_cache
    saw_stop = []

    def slow_background(*a, **kw):  # the real decoder, held back in the background thread until close()
        if threading.current_thread() is not threading.main_thread():
            saw_stop.append(kw["stop"].wait(30))
        return real(*a, **kw)

    monkeypatch.setattr(decode_mod, "decode_cache", slow_background)
    before = set(threading.enumerate())
    L = _loader(scene, mode="random")
    _take(L, 3)
    assert [t for t in set(threading.enumerate()) - before if t.name.startswith("dali_nerf-stream")]
    L.close()  # stops the in-flight window decode (DecodeCancelled) and joins its thread
    L.close()
    assert saw_stop == [True] and set(threading.enumerate()) <= before
    with pytest.raises(RuntimeError, match="closed"):
        next(L)


def test_from_config_streams(scene):
    from dali_nerf.config import load_config
    from dali_nerf.sources import build_source

    over = [f"cache.max_bytes={MAX_BYTES}", "cache.window_images=2", "pipeline.rays_per_batch=64", "train.device=cpu"]
    # the default global stream cannot stream a shard through windows: one line naming the fix
    with pytest.raises(ConfigError, match=r"^cache.max_bytes=\d+: .*, or set pipeline.stream=shard\b[^\n]*$"):
        build_source(load_config(None, over, check_paths=False), scene, 0, 1)
    src = build_source(load_config(None, over + ["pipeline.stream=shard"], check_paths=False), scene, 0, 1)
    try:
        assert src.streaming and src.window_images == 2
        assert next(src)["rgb"].shape == (64, 3)
    finally:
        src.close()


def test_corrupt_image_in_background_window_is_one_line_error(tmp_path):
    sc = tiny_scene(tmp_path, n=6, width=W_PX, height=H_PX, kinds=("png_rgb",))
    for p in sc.image_paths[3:]:
        with open(p, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n not an image")
    before = set(threading.enumerate())
    L = RayLoader(sc, rays_per_batch=100, rays_per_run=100, max_bytes=2 * PER_IMAGE, mode="epoch")
    with pytest.raises(DataError) as e:
        for _ in range(len(L)):
            next(L)
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)
    L.close()
    assert set(threading.enumerate()) <= before


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("stream", [True, False])
def test_held_batches_stay_valid(scene, prefetch, stream):
    """DALI's synchronous executor (prefetch 0) reuses output buffers on the next run and window
    pipelines are destroyed at each switch: held batches must survive both."""
    L = _loader(scene, mode="random", prefetch=prefetch, max_bytes=MAX_BYTES if stream else None)
    assert L.streaming == stream
    held = [next(L) for _ in range(14)]  # past two window switches when streaming
    copies = [{k: v.clone() for k, v in b.items()} for b in held]
    _take(L, 20)
    L.close()
    assert _same(held, copies)
