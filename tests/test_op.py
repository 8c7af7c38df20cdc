"""The C++ ray-sampler operator (CPU backend) against an independent numpy reference.

The reference re-implements, in plain numpy, the stream (splitmix64 hash, Feistel bijection),
the pixel-id -> (image, row, col) mapping, the camera formula of ARCHITECTURE.md and the routing
rule (by dense sampling along each ray, and by an exact critical-point check where they differ).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("nvidia.dali")

from nvidia.dali import fn, pipeline_def  # noqa: E402

from dali_nerf.ops import load_plugin  # noqa: E402
from dali_nerf.data.seeds import op_stream_key, splitmix_finalise  # noqa: E402
from _cxx import compile_harness  # noqa: E402

U64 = np.uint64
M64 = (1 << 64) - 1


@pytest.fixture(scope="module", autouse=True)
def plugin():
    return load_plugin(cuda=False)


# ------------------------------------------------------------------------------ tiny caches

def random_rotation(rng):
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def make_cache(rng, sizes=((7, 5), (16, 9), (33, 20)), radius=0.0, near=(0.05, 0.5), far=(2.0, 6.0)):
    """pixels (P,3) u8, cameras (N,18) f32, layout (N,4) i64; camera indices are shuffled."""
    n = len(sizes)
    cam_index = rng.permutation(np.arange(10, 10 + 3 * n, 3))
    cams, lay, off = [], [], 0
    for i, (w, h) in enumerate(sizes):
        rot = random_rotation(rng)
        t = rng.normal(size=3) * 0.3 if radius == 0 else rot @ np.array([0, 0, radius])
        c = np.zeros(18, np.float32)
        c[:12] = np.concatenate([rot, t[:, None]], axis=1).ravel()
        c[12], c[13] = rng.uniform(4, 20), rng.uniform(4, 20)
        c[14], c[15] = w / 2 + rng.uniform(-1, 1), h / 2 + rng.uniform(-1, 1)
        c[16], c[17] = rng.uniform(*near), rng.uniform(*far)
        cams.append(c)
        lay.append([off, w, h, cam_index[i]])
        off += w * h
    pixels = rng.integers(0, 256, size=(off, 3), dtype=np.uint8)
    return pixels, np.stack(cams).astype(np.float32), np.array(lay, np.int64)


def run_op(cache, rays, starts, centroids=None, **kw):
    """Run the op once per start; returns a list of dicts of numpy outputs."""
    pixels, cams, lay = cache
    starts = list(starts)
    feed = iter(starts)

    @pipeline_def(batch_size=1, num_threads=2, device_id=None, prefetch_queue_depth=1)
    def pipe():
        p = fn.external_source(source=lambda: [pixels], batch=True, no_copy=True)
        c = fn.external_source(source=lambda: [cams], batch=True, no_copy=True)
        l = fn.external_source(source=lambda: [lay], batch=True, no_copy=True)
        s = fn.external_source(source=lambda: [np.array(next(feed), np.int64)], batch=True)
        inputs = [p, c, l]
        if centroids is not None:
            inputs.append(fn.external_source(source=lambda: [centroids], batch=True, no_copy=True))
        return tuple(fn.dali_nerf.ray_sampler(*inputs, rays=rays, start=s, **kw))

    pp = pipe()
    pp.build()
    names = ["origins", "directions", "rgb", "indices", "near", "far", "consumed"]
    res = []
    for _ in starts:
        out = pp.run()
        res.append({k: np.array(o[0]).copy() for k, o in zip(names, out)})
    del pp
    return res


# ------------------------------------------------------------------------------ numpy reference

def mix64(z):
    z = np.asarray(z, U64).copy()
    z ^= z >> U64(30)
    z *= U64(0xBF58476D1CE4E5B9)
    z ^= z >> U64(27)
    z *= U64(0x94D049BB133111EB)
    z ^= z >> U64(31)
    return z


def mulhi(a, b):
    a, b = np.asarray(a, U64), U64(b)
    m = U64(0xFFFFFFFF)
    al, ah, bl, bh = a & m, a >> U64(32), b & m, b >> U64(32)
    ll, hl, lh, hh = al * bl, ah * bl, al * bh, ah * bh
    cross = (ll >> U64(32)) + (hl & m) + lh
    return hh + (hl >> U64(32)) + (cross >> U64(32))


# the op's stream key, mirrored in dali_nerf.data.seeds: every reference stream below is built from the
# mirror, so these tests check it against the C++ operator's output
py_mix = splitmix_finalise
stream_key = op_stream_key


def ref_random_pixels(seed, rank, ws, s0, n, P):
    key = stream_key(seed, rank, ws, 0)
    s = np.arange(s0, s0 + n, dtype=U64)
    with np.errstate(over="ignore"):
        h = mix64(U64(key) + (s + U64(1)) * U64(0x9E3779B97F4A7C15))
    return mulhi(h, P).astype(np.int64)


def ref_epoch_pixels(seed, rank, ws, s0, n, P):
    key = stream_key(seed, rank, ws, 1)
    bits = 2
    while (1 << bits) < P:
        bits += 1
    out = np.empty(n, np.int64)
    pos = np.arange(s0, s0 + n)
    for e in np.unique(pos // P):
        ek = py_mix(key ^ py_mix(int(e) + 0xA54FF53A5F1D36F1))
        rk = [py_mix(ek + 0x9E3779B97F4A7C15 * (r + 1)) for r in range(4)]

        def feistel(x):
            lb, hb = bits // 2, bits - bits // 2
            for r in range(4):
                lo, hi = x & U64((1 << lb) - 1), x >> U64(lb)
                x = (lo << U64(hb)) | ((hi ^ mix64(lo ^ U64(rk[r]))) & U64((1 << hb) - 1))
                lb, hb = hb, lb
            return x

        sel = pos // P == e
        x = feistel((pos[sel] % P).astype(U64))
        while (x >= U64(P)).any():
            bad = x >= U64(P)
            x[bad] = feistel(x[bad])
        out[sel] = x.astype(np.int64)
    return out


def ref_rays(cache, pid):
    """Independent reference: pixel ids -> rays, rgb, indices, near, far."""
    pixels, cams, lay = cache
    img = np.searchsorted(lay[:, 0], pid, side="right") - 1
    rem = pid - lay[img, 0]
    row, col = rem // lay[img, 1], rem % lay[img, 1]
    c = cams[img].astype(np.float64)
    d_cam = np.stack([(col + 0.5 - c[:, 14]) / c[:, 12], -(row + 0.5 - c[:, 15]) / c[:, 13],
                      -np.ones(len(pid))], -1)
    rot = c[:, :12].reshape(-1, 3, 4)
    d = np.einsum("bij,bj->bi", rot[:, :, :3], d_cam)
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    return {
        "origins": rot[:, :, 3], "directions": d,
        "rgb": pixels[pid].astype(np.float32) / np.float32(255),
        "indices": np.stack([lay[img, 3], row, col], -1),
        "near": cams[img, 16:17], "far": cams[img, 17:18],
    }


def pixel_ids(cache, indices):
    """(cam index in split, row, col) -> pixel id, checking ranges."""
    _, _, lay = cache
    img = np.array([np.flatnonzero(lay[:, 3] == c)[0] for c in indices[:, 0]])
    assert (indices[:, 1] >= 0).all() and (indices[:, 1] < lay[img, 2]).all()
    assert (indices[:, 2] >= 0).all() and (indices[:, 2] < lay[img, 1]).all()
    return lay[img, 0] + indices[:, 1] * lay[img, 1] + indices[:, 2]


def check_against_reference(cache, out):
    pid = pixel_ids(cache, out["indices"])
    ref = ref_rays(cache, pid)
    np.testing.assert_allclose(out["origins"], ref["origins"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out["directions"], ref["directions"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(out["directions"], axis=1), 1, atol=1e-5)
    assert np.array_equal(out["rgb"], ref["rgb"])  # exactly pixel / 255
    assert np.array_equal(out["indices"], ref["indices"])
    assert np.array_equal(out["near"], ref["near"]) and np.array_equal(out["far"], ref["far"])
    assert out["origins"].dtype == np.float32 and out["indices"].dtype == np.int64
    return pid


# ------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_rays_match_reference(mode):
    cache = make_cache(np.random.default_rng(0))
    P = len(cache[0])
    outs = run_op(cache, 700, [123, 123 + 700, 5 * P + 17], mode=mode, seed=7, rank=1, world_size=3)
    ref_pixels = ref_random_pixels if mode == "random" else ref_epoch_pixels
    for out, s0 in zip(outs, [123, 823, 5 * P + 17]):
        pid = check_against_reference(cache, out)
        assert out["consumed"].tolist() == [700]
        # the stream itself: position -> pixel id exactly as ARCHITECTURE.md specifies
        assert np.array_equal(pid, ref_pixels(7, 1, 3, s0, 700, P))


def test_uniform_size_fast_path():
    cache = make_cache(np.random.default_rng(1), sizes=[(12, 8)] * 5)
    for mode in ("random", "epoch"):
        out = run_op(cache, 3000, [99], mode=mode, seed=3)[0]
        pid = check_against_reference(cache, out)
        ref = (ref_random_pixels if mode == "random" else ref_epoch_pixels)(3, 0, 1, 99, 3000, len(cache[0]))
        assert np.array_equal(pid, ref)


def test_epoch_visits_every_pixel_once():
    cache = make_cache(np.random.default_rng(2))
    P = len(cache[0])  # 35 + 144 + 660 = 839
    whole = pixel_ids(cache, run_op(cache, P, [0], mode="epoch", seed=5)[0]["indices"])
    assert np.array_equal(np.sort(whole), np.arange(P))
    # the same epoch split across three runs fed through `start`
    parts = run_op(cache, 300, [0, 300, 600], mode="epoch", seed=5)
    split = np.concatenate([pixel_ids(cache, o["indices"]) for o in parts])
    assert np.array_equal(split[:P], whole)
    # later epochs: again a permutation, and a different one
    e2 = pixel_ids(cache, run_op(cache, P, [2 * P], mode="epoch", seed=5)[0]["indices"])
    assert np.array_equal(np.sort(e2), np.arange(P)) and not np.array_equal(e2, whole)
    # a block that straddles two epochs: its two pieces are parts of the two permutations
    mid = pixel_ids(cache, run_op(cache, P, [2 * P - 100], mode="epoch", seed=5)[0]["indices"])
    assert np.array_equal(mid[100:], e2[: P - 100])
    # disjoint ranks see different orders
    r1 = pixel_ids(cache, run_op(cache, P, [0], mode="epoch", seed=5, rank=1, world_size=2)[0]["indices"])
    assert np.array_equal(np.sort(r1), np.arange(P)) and not np.array_equal(r1, whole)


def test_determinism_and_stream_keys():
    cache = make_cache(np.random.default_rng(3))
    base = dict(mode="random", seed=11, rank=0, world_size=2)
    a = run_op(cache, 512, [1000], **base)[0]
    b = run_op(cache, 512, [1000], **base)[0]
    for k in a:
        assert np.array_equal(a[k], b[k])
    for change in (dict(seed=12), dict(rank=1), dict(world_size=4), dict(mode="epoch")):
        c = run_op(cache, 512, [1000], **{**base, **change})[0]
        assert (c["indices"] != a["indices"]).any(axis=1).mean() > 0.9, change
    shifted = run_op(cache, 512, [1256], **base)[0]  # stream positions are absolute
    assert np.array_equal(shifted["indices"][:256], a["indices"][256:])


def chi2_critical(df, alpha=0.01):
    """Wilson-Hilferty approximation of the chi-square upper quantile (z for alpha = 0.01)."""
    z = {0.01: 2.3263478740}[alpha]
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def chi2(counts, expected):
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_uniformity_chi_square(mode):
    cache = make_cache(np.random.default_rng(4))
    _, _, lay = cache
    P = len(cache[0])
    n = 200_000 if mode == "random" else P // 2  # epoch: half an epoch (sampling w/o replacement)
    out = run_op(cache, n, [31], mode=mode, seed=2)[0]
    idx = out["indices"]
    img = np.array([np.flatnonzero(lay[:, 3] == c)[0] for c in idx[:, 0]])
    frac = lay[:, 1] * lay[:, 2] / P
    cam_counts = np.bincount(img, minlength=len(lay))
    assert chi2(cam_counts, n * frac) < chi2_critical(len(lay) - 1)
    rows = np.concatenate([np.full(h, i) for i, h in enumerate(lay[:, 2])])
    row_bins = np.concatenate([[0], np.cumsum(lay[:, 2])])[img] + idx[:, 1]
    exp_rows = n * (lay[rows, 1] / P)
    assert chi2(np.bincount(row_bins, minlength=len(rows)), exp_rows) < chi2_critical(len(rows) - 1)
    cols = np.concatenate([np.full(w, i) for i, w in enumerate(lay[:, 1])])
    col_bins = np.concatenate([[0], np.cumsum(lay[:, 1])])[img] + idx[:, 2]
    exp_cols = n * (lay[cols, 2] / P)
    assert chi2(np.bincount(col_bins, minlength=len(cols)), exp_cols) < chi2_critical(len(cols) - 1)


# ------------------------------------------------------------------------------ routing

CENTROIDS = np.array([[-1, 0.3, -1], [1, -0.2, -1], [-1, 0.1, 1], [1, 0, 1]], np.float32)
UP = np.array([0.0, 1.0, 0.0])


def _flat(v, dims, up):
    return v - (v @ up)[..., None] * up if dims == 2 else v


def brute_force_membership(o, d, near, far, cell, margin, dims, up=UP, n_t=2000):
    """Dense sampling of n_t points along [near, far] per ray."""
    keep = np.zeros(len(o), bool)
    c = _flat(CENTROIDS.astype(np.float64), dims, up)
    for i in range(0, len(o), 500):
        t = np.linspace(near[i:i + 500, 0], far[i:i + 500, 0], n_t, axis=1)  # (b, n_t)
        p = o[i:i + 500, None, :] + t[..., None] * d[i:i + 500, None, :]
        p = _flat(p, dims, up)
        d2 = ((p[:, :, None, :] - c[None, None]) ** 2).sum(-1)  # (b, n_t, C)
        ok = (d2[..., cell:cell + 1] <= margin ** 2 * d2).all(-1)
        keep[i:i + 500] = ok.any(1)
    return keep


def exact_membership(o, d, near, far, cell, margin, dims, up=UP):
    """Exact: the allowed set's boundary points are roots of the per-k quadratics; test every
    critical point and every midpoint between consecutive ones."""
    c = _flat(CENTROIDS.astype(np.float64), dims, up)
    o, d = _flat(o, dims, up), _flat(d, dims, up)
    crit = [near, far]
    for k in range(len(c)):
        if k == cell:
            continue
        qj, qk, m2 = o - c[cell], o - c[k], margin ** 2
        coef = [(d @ d) * (1 - m2), 2 * (d @ qj - m2 * (d @ qk)), qj @ qj - m2 * (qk @ qk)]
        for r in np.roots(coef) if abs(coef[0]) > 0 else ([-coef[2] / coef[1]] if coef[1] else []):
            if abs(np.imag(r)) < 1e-12 and near <= np.real(r) <= far:
                crit.append(float(np.real(r)))
    crit = np.unique(crit)
    ts = np.concatenate([crit, (crit[1:] + crit[:-1]) / 2])
    p = o + ts[:, None] * d
    d2 = ((p[:, None, :] - c[None]) ** 2).sum(-1)
    return bool((d2[:, cell:cell + 1] <= margin ** 2 * d2 * (1 + 1e-9) + 1e-12).all(-1).any())


def routed_mask(candidates, routed):
    """Positions of the candidate stream that the routed run emitted (in-order greedy match,
    exact because equal pixels give equal rays and so equal decisions)."""
    cand_ids = candidates["indices"]
    mask = np.zeros(len(cand_ids), bool)
    j = 0
    for row in routed["indices"]:
        while not (cand_ids[j] == row).all():
            j += 1
        mask[j] = True
        j += 1
    return mask


def routing_cache(uniform: bool = False):
    """Four cameras on a sphere of radius 3; images of different sizes, or (``uniform``) all of
    one size, which the CPU op routes with its 4-wide AVX2 stage (scalar otherwise)."""
    rng = np.random.default_rng(5)
    sizes = [(40, 30)] * 4 if uniform else [(40, 30), (31, 23), (50, 20), (16, 16)]
    return make_cache(rng, sizes=sizes, radius=3.0, near=(0.1, 1.0), far=(3.0, 7.0))


@pytest.mark.parametrize("mode,dims,cell,uniform", [("random", 2, 0, False), ("epoch", 3, 3, False),
                                                    ("random", 2, 1, True), ("epoch", 2, 2, True)])
def test_routing_matches_brute_force(mode, dims, cell, uniform):
    cache = routing_cache(uniform)
    n_cand, s0 = 12_000, 500
    kw = dict(mode=mode, seed=9, margin=1.15, dims=dims, up=UP.tolist())
    cand = run_op(cache, n_cand, [s0], mode=mode, seed=9)[0]
    routed = run_op(cache, 2500, [s0], centroids=CENTROIDS, cell=cell, **kw)[0]
    consumed = int(routed["consumed"][0])
    assert 2500 <= consumed <= n_cand
    check_against_reference(cache, routed)
    mask = routed_mask(cand, routed)
    assert mask.sum() == 2500 and mask[consumed - 1] and not mask[consumed:].any()
    for k in ("origins", "directions", "rgb", "near", "far"):  # a routed ray is the pixel's ray
        assert np.array_equal(routed[k], cand[k][mask]), k
    o, d = cand["origins"][:consumed].astype(np.float64), cand["directions"][:consumed].astype(np.float64)
    nr, fr = cand["near"][:consumed], cand["far"][:consumed]
    brute = brute_force_membership(o, d, nr, fr, cell, 1.15, dims)
    op = mask[:consumed]
    assert (brute == op).mean() >= 0.999
    for i in np.flatnonzero(brute != op):
        assert exact_membership(o[i], d[i], nr[i, 0], fr[i, 0], cell, 1.15, dims) == op[i], i
    # the next run continues at start + consumed
    nxt = run_op(cache, 100, [s0 + consumed], centroids=CENTROIDS, cell=cell, **kw)[0]
    longer = run_op(cache, 2600, [s0], centroids=CENTROIDS, cell=cell, **kw)[0]
    assert np.array_equal(longer["indices"][2500:], nxt["indices"])


def test_margin_one_covers_every_ray():
    cache = routing_cache()
    cand = run_op(cache, 12_000, [0], mode="random", seed=4)[0]
    covered = np.zeros(12_000, bool)
    limit = 12_000
    for cell in range(len(CENTROIDS)):
        routed = run_op(cache, 1500, [0], centroids=CENTROIDS, cell=cell, margin=1.0, seed=4)[0]
        limit = min(limit, int(routed["consumed"][0]))
        covered |= routed_mask(cand, routed)
    assert limit >= 1500
    assert covered[:limit].all()


def test_batch_of_two_samples_independent():
    """Batch size 2: each sample uses its own inputs and its own `start`."""
    c1, c2 = make_cache(np.random.default_rng(6)), make_cache(np.random.default_rng(7), sizes=[(9, 4), (5, 5)])
    starts = iter([np.array(10, np.int64), np.array(999, np.int64)])

    @pipeline_def(batch_size=2, num_threads=2, device_id=None)
    def pipe():
        p = fn.external_source(source=lambda: [c1[0], c2[0]], batch=True)
        c = fn.external_source(source=lambda: [c1[1], c2[1]], batch=True)
        l = fn.external_source(source=lambda: [c1[2], c2[2]], batch=True)
        s = fn.external_source(source=lambda: [next(starts), next(starts)], batch=True)
        return tuple(fn.dali_nerf.ray_sampler(p, c, l, rays=64, start=s, seed=1))

    pp = pipe()
    pp.build()
    out = pp.run()
    for k, (cache, s0) in enumerate([(c1, 10), (c2, 999)]):
        res = {n: np.array(o[k]) for n, o in zip(["origins", "directions", "rgb", "indices", "near", "far"], out)}
        pid = check_against_reference(cache, res)
        assert np.array_equal(pid, ref_random_pixels(1, 0, 1, s0, 64, len(cache[0])))


def test_bad_inputs_raise():
    cache = make_cache(np.random.default_rng(8))
    bad_layout = (cache[0], cache[1], cache[2] + np.array([[1, 0, 0, 0]] * 3))
    with pytest.raises(RuntimeError, match="layout"):
        run_op(bad_layout, 10, [0])
    with pytest.raises(RuntimeError, match="centroids"):
        run_op(cache, 10, [0], cell=0)


@pytest.mark.parametrize("centroids, cell", [
    (np.zeros((4, 4), np.float32), 0),           # not 3 coordinates
    (np.zeros((12,), np.float32), 0),             # not 2-D
    (CENTROIDS, 4),                               # the cell is not one of them
    (np.zeros((65, 3), np.float32), 0),           # over kMaxCells
], ids=["4-coords", "1-D", "cell-past-end", "65-cells"])
def test_bad_centroids_are_refused(centroids, cell):
    """Each clause of the op's `centroids` check refuses on its own (one accepted bad shape reads
    past the routing table)."""
    cache = make_cache(np.random.default_rng(8))
    with pytest.raises(RuntimeError, match="centroids"):
        run_op(cache, 10, [0], centroids=centroids, cell=cell)


def test_defaults_without_start():
    """`start` defaults to 0. (`seed` is always passed: when it is omitted DALI fills it from the
    pipeline's seed, like for its own random operators.)"""
    cache = make_cache(np.random.default_rng(9))
    pixels, cams, lay = cache

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def pipe():
        p = fn.external_source(source=lambda: [pixels], batch=True)
        c = fn.external_source(source=lambda: [cams], batch=True)
        l = fn.external_source(source=lambda: [lay], batch=True)
        return fn.dali_nerf.ray_sampler(p, c, l, rays=50, seed=0)[3]

    pp = pipe()
    pp.build()
    idx = np.array(pp.run()[0][0])
    assert np.array_equal(pixel_ids(cache, idx), ref_random_pixels(0, 0, 1, 0, 50, len(pixels)))


def test_continue_runs_places_only_the_first_run():
    """``continue_runs=True`` with a constant ``start`` = ``start`` fed per run as (s0, -1, -1, ...):
    run j samples positions [s0 + j R, s0 + (j + 1) R); without it every run restarts at s0."""
    cache = make_cache(np.random.default_rng(10))
    pixels, cams, lay = cache
    R, s0 = 40, 123

    def build(cont):
        @pipeline_def(batch_size=1, num_threads=1, device_id=None)
        def pipe():
            p = fn.external_source(source=lambda: [pixels], batch=True)
            c = fn.external_source(source=lambda: [cams], batch=True)
            l = fn.external_source(source=lambda: [lay], batch=True)
            return fn.dali_nerf.ray_sampler(p, c, l, rays=R, seed=3, start=s0, continue_runs=cont)[3]
        pp = pipe()
        pp.build()
        return pp

    cont, plain = build(True), build(False)
    for j in range(3):
        got = pixel_ids(cache, np.array(cont.run()[0][0]))
        assert np.array_equal(got, ref_random_pixels(3, 0, 1, s0 + j * R, R, len(pixels)))
        again = pixel_ids(cache, np.array(plain.run()[0][0]))
        assert np.array_equal(again, ref_random_pixels(3, 0, 1, s0, R, len(pixels)))


@pytest.mark.parametrize("uniform", [False, True])
def test_routing_with_bounds_matches_partition_reference(uniform):
    """With a routing box, only the part of the segment inside it decides (rays missing the box
    keep their whole segment); the op agrees with dali_nerf.partition.ray_cells (float64 numpy)."""
    from dali_nerf.partition import Partition, clip_to_bounds, ray_cells

    cache = routing_cache(uniform)
    bounds = np.array([[-1.0, -0.4, -1.0], [1.0, 0.4, 1.0]], np.float32)
    part = Partition(CENTROIDS, margin=1.15, dims=2, up=UP, kind="grid", bounds=bounds)
    n_cand, cell = 8000, 1
    cand = run_op(cache, n_cand, [0], mode="random", seed=2)[0]
    routed = run_op(cache, 1500, [0], centroids=CENTROIDS, cell=cell, mode="random", seed=2, margin=1.15, dims=2,
                    up=UP.tolist(), bounds=bounds.ravel().tolist())[0]
    consumed = int(routed["consumed"][0])
    op = routed_mask(cand, routed)[:consumed]
    o, d = cand["origins"][:consumed].astype(np.float64), cand["directions"][:consumed].astype(np.float64)
    nr, fr = cand["near"][:consumed, 0], cand["far"][:consumed, 0]
    ref = ray_cells(part, o, d, nr, fr)[:, cell]
    # every disagreement is a tie the exact critical-point check (on the clipped segment) sides with the op on
    wrong = np.flatnonzero(ref != op)
    assert len(wrong) <= 0.001 * consumed, (len(wrong), consumed)
    cn, cf = clip_to_bounds(bounds, o, d, nr, fr)
    for i in wrong:
        assert exact_membership(o[i], d[i], cn[i], cf[i], cell, 1.15, 2) == op[i], i
    unclipped = run_op(cache, 1500, [0], centroids=CENTROIDS, cell=cell, mode="random", seed=2, margin=1.15, dims=2,
                       up=UP.tolist())[0]
    assert int(unclipped["consumed"][0]) != consumed  # the box changes which rays are routed here


@pytest.mark.parametrize("uniform", [False, True])
def test_routing_tiles_match_per_ray(uniform):
    """The CPU op decides most candidates from its per-cache tile map (``route_tile``); the rays
    it emits are exactly those of the per-ray test (``route_tile=0``), for tile sizes, margins
    below, at and above 1, 2-D and 3-D distances, and a routing box."""
    rng = np.random.default_rng(21)
    sizes = [(96, 80)] * 5 if uniform else [(96, 80), (70, 51), (120, 33), (16, 16), (64, 90)]
    cache = make_cache(rng, sizes=sizes, radius=3.0, near=(0.1, 1.0), far=(3.0, 7.0))
    cache[1][:, 12:14] *= 4  # narrower fields of view than make_cache's: more tiles decided
    box = [-1.0, -0.4, -1.0, 1.0, 0.4, 1.0]
    cases = [dict(cell=0, margin=1.15), dict(cell=1, margin=1.0), dict(cell=2, margin=0.9),
             dict(cell=3, margin=1.3, dims=3), dict(cell=1, margin=1.15, bounds=box),
             dict(cell=2, margin=1.15, bounds=[-2.0, -0.5, -2.0, 2.0, 0.5, 2.0])]
    decided = 0
    for kw in cases:
        kw = dict(kw, seed=3, up=UP.tolist(), centroids=CENTROIDS)
        ref = run_op(cache, 6000, [0, 77_777], route_tile=0, **kw)
        for tile in (4, 8, 64):
            got = run_op(cache, 6000, [0, 77_777], route_tile=tile, **kw)
            for r, g in zip(ref, got):
                for k in r:
                    assert np.array_equal(r[k], g[k]), (k, tile, kw)
        decided += int(ref[0]["consumed"][0]) > 6000  # the cell does not take every ray
    assert decided == len(cases)


@pytest.mark.parametrize("uniform", [False, True])
def test_avx2_paths_match_scalar_code(uniform):
    """``simd=True`` (the default: 8 rays at a time in the ray writer, batched routing decisions,
    where the CPU has AVX2) gives bit for bit the outputs of the scalar code (``simd=False``), for
    plain and routed runs; ray counts that are not multiples of 8 and chunks of 16384 rays check
    the group/tail boundaries, and the last pixel of the cache (no byte after it) is sampled."""
    rng = np.random.default_rng(33)
    sizes = [(64, 48)] * 6 if uniform else [(64, 48), (31, 23), (50, 20), (16, 16), (7, 5), (45, 40)]
    cache = make_cache(rng, sizes=sizes, radius=3.0, near=(0.1, 1.0), far=(3.0, 7.0))
    P = len(cache[0])
    cases = [dict(mode="random", rays=16384 + 13), dict(mode="epoch", rays=3 * P + 5),
             dict(mode="random", rays=2501, cell=1, centroids=CENTROIDS, margin=1.15, up=UP.tolist()),
             dict(mode="epoch", rays=1203, cell=2, centroids=CENTROIDS, margin=1.0, up=UP.tolist(), dims=3)]
    for kw in cases:
        kw = dict(kw, seed=9)
        rays = kw.pop("rays")
        ref = run_op(cache, rays, [0, 40_001], simd=False, **kw)
        got = run_op(cache, rays, [0, 40_001], **kw)
        for r, g in zip(ref, got):
            for k in r:
                assert r[k].tobytes() == g[k].tobytes(), (k, kw)
        if kw["mode"] == "epoch" and "cell" not in kw:  # every pixel, the last one included
            ids = pixel_ids(cache, got[0]["indices"])
            assert np.isin(P - 1, ids)
            check_against_reference(cache, got[0])


# ------------------------------------------------------------------------------ the shared formula
# ray_math.h is what the GPU kernels evaluate (compiled with -fmad=false: the same rounding as
# here). Compiled for the host with the plugin's own compiler and flags, its row_ray and
# route_decide must give the CPU op's rays and routing decisions bit for bit, so these CPU tests
# check the GPU's arithmetic too (tests/test_plugin_build.py checks the device code has no FMA).

HARNESS = r"""
#include <cstdint>
#include "ray_math.h"
using namespace dali_nerf::detail;
static void locate(const int64_t *lay, int64_t N, int64_t pid, int64_t &img, int64_t &row, int64_t &col) {
  img = N - 1;
  while (lay[4 * img] > pid) img--;
  int64_t rem = pid - lay[4 * img];
  row = rem / lay[4 * img + 1];
  col = rem % lay[4 * img + 1];
}
extern "C" void dn_rays(const float *cams, const int64_t *lay, int64_t N, const int64_t *pid, int64_t n,
                        float *o, float *d) {
  for (int64_t i = 0; i < n; i++) {
    int64_t img, row, col;
    locate(lay, N, pid[i], img, row, col);
    float t[kRow];
    fill_row(t, cams + 18 * img, lay[4 * img + 3]);
    row_ray(t, row, col, o + 3 * i, d + 3 * i);
  }
}
extern "C" int dn_decide(const float *cams, const int64_t *lay, int64_t N, const float *cen, int C, int cell,
                         float margin, const float *up, int dims, int has_bounds, const double *bounds,
                         const int64_t *pid, int64_t n, uint8_t *out) {
  double u[3];
  if (!unit_up(up, u)) return 1;
  RouteParams rp = route_params(cen, C, cell, margin, u, dims, has_bounds != 0, bounds);
  RouteConsts rc;
  route_consts(rp, rc);
  for (int64_t i = 0; i < n; i++) {
    int64_t img, row, col;
    locate(lay, N, pid[i], img, row, col);
    double t[kRouteStride];
    route_row(rc, cams + 18 * img, t);
    out[i] = route_decide(rc, t, row, col) ? 1 : 0;
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def formula(tmp_path_factory):
    """ray_math.h compiled for the host by the plugin's compiler with the plugin's code flags."""
    return compile_harness(tmp_path_factory.mktemp("ray_math"), HARNESS)


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def formula_rays(formula, cache, pid):
    _, cams, lay = cache
    pid = np.ascontiguousarray(pid, np.int64)
    o, d = np.empty((len(pid), 3), np.float32), np.empty((len(pid), 3), np.float32)
    formula.dn_rays(_ptr(cams), _ptr(lay), ctypes_i64(len(lay)), _ptr(pid), ctypes_i64(len(pid)), _ptr(o), _ptr(d))
    return o, d


def formula_decide(formula, cache, pid, cell, margin, dims=2, bounds=None):
    _, cams, lay = cache
    pid = np.ascontiguousarray(pid, np.int64)
    cen = np.ascontiguousarray(CENTROIDS, np.float32)
    up = np.ascontiguousarray(UP, np.float32)
    b = np.zeros(6) if bounds is None else np.asarray(bounds, np.float32).astype(np.float64)
    out = np.empty(len(pid), np.uint8)
    rc = formula.dn_decide(_ptr(cams), _ptr(lay), ctypes_i64(len(lay)), _ptr(cen), len(cen), cell,
                           ctypes.c_float(margin), _ptr(up), dims, int(bounds is not None), _ptr(b), _ptr(pid),
                           ctypes_i64(len(pid)), _ptr(out))
    assert rc == 0
    return out.astype(bool)


def ctypes_i64(v):
    return ctypes.c_int64(int(v))


@pytest.mark.parametrize("uniform", [False, True])
def test_shared_formula_gives_the_op_rays(formula, uniform):
    """detail::row_ray (the GPU's ray formula) gives the CPU op's rays bit for bit, with the AVX2
    writer and with the scalar one."""
    rng = np.random.default_rng(44)
    sizes = [(64, 48)] * 4 if uniform else [(64, 48), (31, 23), (50, 20), (7, 5)]
    cache = make_cache(rng, sizes=sizes, radius=3.0)
    for simd in (True, False):
        out = run_op(cache, 5003, [123], mode="random", seed=5, simd=simd)[0]
        o, d = formula_rays(formula, cache, pixel_ids(cache, out["indices"]))
        assert o.tobytes() == out["origins"].tobytes() and d.tobytes() == out["directions"].tobytes(), simd


@pytest.mark.parametrize("uniform", [False, True])
def test_route_decide_gives_the_op_decisions(formula, uniform):
    """detail::route_decide (the GPU's routing decision, one candidate at a time) accepts exactly
    the stream positions the CPU op accepts with its batched, AVX2 and tile-map paths: margins
    below, at and above 1, 2-D and 3-D distances, a routing box, both stream modes."""
    rng = np.random.default_rng(21)
    sizes = [(96, 80)] * 5 if uniform else [(96, 80), (70, 51), (120, 33), (16, 16), (64, 90)]
    cache = make_cache(rng, sizes=sizes, radius=3.0, near=(0.1, 1.0), far=(3.0, 7.0))
    cache[1][:, 12:14] *= 4
    box = [-1.0, -0.4, -1.0, 1.0, 0.4, 1.0]
    cases = [dict(cell=0, margin=1.15, mode="random"), dict(cell=1, margin=1.0, mode="epoch"),
             dict(cell=2, margin=0.9, mode="random"), dict(cell=3, margin=1.3, dims=3, mode="epoch"),
             dict(cell=1, margin=1.15, bounds=box, mode="random")]
    P, rays, s0 = len(cache[0]), 1500, 1000
    for kw in cases:
        ref_ids = ref_epoch_pixels if kw["mode"] == "epoch" else ref_random_pixels
        for extra in (dict(route_tile=0), dict(route_tile=8), dict(route_tile=0, simd=False)):
            out = run_op(cache, rays, [s0], centroids=CENTROIDS, seed=3, up=UP.tolist(), **kw, **extra)[0]
            consumed = int(out["consumed"][0])
            stream = ref_ids(3, 0, 1, s0, consumed, P)
            dec = formula_decide(formula, cache, stream, kw["cell"], kw["margin"], kw.get("dims", 2), kw.get("bounds"))
            assert dec.sum() == rays and dec[-1], (kw, extra)
            assert np.array_equal(stream[dec], pixel_ids(cache, out["indices"])), (kw, extra)
