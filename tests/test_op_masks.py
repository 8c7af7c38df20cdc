"""The operator on masked caches (its ``valid`` input, dali_nerf/ops/csrc/mask.h): no ray ever
lands on a masked pixel, in every mode and stream (random, epoch, the global stream, SS routing),
and each stream is the unmasked formula over the valid pixels (the numpy references of
tests/test_op.py and dali_nerf/ops/reference.py over V, mapped through the k-th valid pixel).

The valid-pixel index's select (the k-th valid pixel, broadword, host and device code) is checked
against a table over masks of every density and layout; an all-valid mask gives the unmasked
op's bytes (so the unmasked streams, which pass no index, are the same formulas)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("nvidia.dali")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from nvidia.dali import fn, pipeline_def  # noqa: E402

from dali_nerf.data.masks import index_length, select_reference, unpack_valid, valid_index  # noqa: E402
from dali_nerf.ops import load_plugin  # noqa: E402
from dali_nerf.ops import reference as ref  # noqa: E402
from _cxx import compile_harness  # noqa: E402
from test_op import CENTROIDS, make_cache, pixel_ids, ref_epoch_pixels, ref_random_pixels  # noqa: E402
from test_op_global import shard_cache  # noqa: E402
from dali_nerf.pipelines.decode import shard_range  # noqa: E402

NAMES = ("origins", "directions", "rgb", "indices", "near", "far", "consumed", "step_counts", "positions")
REFS = {"random": ref_random_pixels, "epoch": ref_epoch_pixels}


@pytest.fixture(scope="module", autouse=True)
def plugin():
    return load_plugin(cuda=False)


def feed(a):
    """An external source's callback returning the one-sample batch [a] (no argument: DALI would
    pass the iteration to a callback that takes one)."""
    return lambda: [a]


def run(cache, rays, start, valid=None, centroids=None, **kw):
    """One run of the op on ``cache`` (with the index of ``valid`` (P,) bool when given): its outputs."""
    pixels, cams, lay = cache
    index = None if valid is None else valid_index(valid)

    @pipeline_def(batch_size=1, num_threads=2, device_id=None, prefetch_queue_depth=1)
    def pipe():
        ins = [fn.external_source(source=feed(a), batch=True, no_copy=True) for a in (pixels, cams, lay)]
        if centroids is not None:
            ins.append(fn.external_source(source=lambda: [centroids], batch=True, no_copy=True))
        if index is not None:
            ins.append(fn.external_source(source=lambda: [index], batch=True, no_copy=True))
        return tuple(fn.dali_nerf.ray_sampler(*ins, rays=rays, start=start, **kw))

    pp = pipe()
    pp.build()
    out = {k: np.array(o[0]).copy() for k, o in zip(NAMES, pp.run())}
    del pp
    return out


def random_mask(rng, P: int, kind: str) -> np.ndarray:
    """A mask of P pixels: iid at a drawn density, or runs (long masked and kept stretches: a sky,
    an occluder), or nearly all masked / all kept."""
    if kind == "iid":
        return rng.random(P) < rng.uniform(0.05, 0.95)
    if kind == "runs":
        out, v = np.zeros(P, bool), bool(rng.integers(2))
        i = 0
        while i < P:
            n = int(rng.integers(1, max(2, P // 3)))
            out[i:i + n] = v
            v = not v
            i += n
        return out
    if kind == "sparse":
        out = np.zeros(P, bool)
        out[rng.choice(P, size=min(P, 3), replace=False)] = True
        return out
    return np.ones(P, bool)


# ------------------------------------------------------------------------------ select, on the host

HARNESS = r"""
#include <cstdint>
#include <vector>
#include "mask.h"
#include "mask_avx512.h"
#include "streams.h"
using namespace dali_nerf::detail;
// -2: this CPU lacks AVX-512 F/DQ/VL/BW (icl: BITALG, VPOPCNTDQ and VBMI too); -1: a bad index; else
// 0 with out[i] = the pixel of k[i] by select_batch_avx512 (icl: select_batch_avx512_icl; the op's
// CPU select is the latter where the CPU has its features, else the former), `in place` in k's own
// buffer
extern "C" int dn_select_avx512(const uint64_t *data, uint64_t L, uint64_t P, uint64_t *k, int64_t n, uint64_t *out,
                                int in_place, int icl) {
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))) return -2;
  if (icl && !(__builtin_cpu_supports("avx512bitalg") && __builtin_cpu_supports("avx512vpopcntdq") &&
               __builtin_cpu_supports("avx512vbmi"))) return -2;
  ValidIndex vi;
  if (!vi.init(data, L, P).empty()) return -1;
  if (icl) select_batch_avx512_icl(vi, k, in_place ? k : out, n);
  else select_batch_avx512(vi, k, in_place ? k : out, n);
  return 0;
}
// -1: a bad index; else 0 with out[i] = select(k[i]), ranks[p] = rank(p) for p <= P
extern "C" int dn_select(const uint64_t *data, uint64_t L, uint64_t P, const uint64_t *k, int64_t n, uint64_t *out,
                         uint64_t *ranks) {
  ValidIndex vi;
  if (!vi.init(data, L, P).empty()) return -1;
  for (int64_t i = 0; i < n; i++) out[i] = vi.select(k[i]);
  for (uint64_t p = 0; p <= P; p++) ranks[p] = vi.rank(p);
  return 0;
}
// the device's in-byte select against the host's table, every byte and rank: mismatches
extern "C" int dn_bytes() {
  int bad = 0;
  for (uint64_t r = 0; r < 8; r++)
    for (uint64_t v = 0; v < 256; v++) bad += select_in_byte_loop(v, r) != kSelectInByte.v[(r << 8) | v];
  return bad;
}
// the GPU's masked global stream, one "thread" (chunk of 64 positions) at a time: the domain rows
// (domain_rows: ranks at the image offsets), walk_kept, find_domain, image_pixel, then select
extern "C" int64_t dn_gpu_masked(uint64_t key, int mode, uint64_t Vsplit, uint64_t vlo, const uint64_t *data,
                                 uint64_t L, uint64_t P, const int64_t *offs, int N, uint64_t g0, uint64_t total,
                                 int64_t *pix, int64_t *pos) {
  ValidIndex vi;
  if (!vi.init(data, L, P).empty()) return -1;
  std::vector<uint64_t> doffs(N), dsizes(N);
  for (int i = 0; i < N; i++) {
    uint64_t end = i + 1 < N ? uint64_t(offs[i + 1]) : P;
    doffs[i] = vi.rank(uint64_t(offs[i]));
    dsizes[i] = vi.rank(end) - doffs[i];
  }
  dali_nerf::detail::GlobalStream gs{key, Vsplit, weyl_multiplier(Vsplit), vlo, vi.V, mode};
  int64_t slot = 0;
  for (uint64_t c0 = 0; c0 < total; c0 += 64) {
    uint64_t n = total - c0 < 64 ? total - c0 : 64;
    walk_kept(gs, g0 + c0, n, [&](uint64_t j, uint64_t q, uint64_t e) {
      uint64_t ql = q - gs.lo;
      int a = 0, b = N;  // find_domain
      while (a < b) { int mid = (a + b) >> 1; if (doffs[mid] <= ql) a = mid + 1; else b = mid; }
      int img = a - 1;
      uint64_t off = doffs[img];
      pix[slot] = int64_t(vi.select(off + image_pixel(gs, g0 + c0 + j, e, gs.lo + off, dsizes[img], ql - off)));
      pos[slot++] = int64_t(g0 + c0 + j);
    });
  }
  return slot;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    h = compile_harness(tmp_path_factory.mktemp("mask"), HARNESS)
    h.dn_select.restype = ctypes.c_int
    h.dn_select_avx512.restype = ctypes.c_int
    h.dn_select_avx512.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    h.dn_select.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int64,
                            ctypes.c_void_p, ctypes.c_void_p]
    u64, vp = ctypes.c_uint64, ctypes.c_void_p
    h.dn_gpu_masked.restype = ctypes.c_int64
    h.dn_gpu_masked.argtypes = [u64, ctypes.c_int, u64, u64, vp, u64, u64, vp, ctypes.c_int, u64, u64, vp, vp]
    return h


def _p(a):
    return a.ctypes.data_as(ctypes.c_void_p)


@settings(max_examples=60)
@given(P=st.one_of(st.integers(1, 600), st.integers(600, 20000)), kind=st.sampled_from(["iid", "runs", "sparse", "all"]),
       seed=st.integers(0, 2**32 - 1))
def test_select_is_the_kth_valid_pixel(harness, P, kind, seed):
    rng = np.random.default_rng(seed)
    valid = random_mask(rng, P, kind)
    idx = valid_index(valid)
    V = int(valid.sum())
    assert len(idx) == index_length(P, V) and np.array_equal(unpack_valid(idx, P), valid)
    k = np.arange(V, dtype=np.uint64)
    out, ranks = np.empty(V, np.uint64), np.empty(P + 1, np.uint64)
    data = np.ascontiguousarray(idx)
    assert harness.dn_select(_p(data), len(data), P, _p(k), V, _p(out), _p(ranks)) == 0
    assert np.array_equal(out.astype(np.int64), np.flatnonzero(valid)), (P, kind, seed)
    assert np.array_equal(ranks.astype(np.int64), np.concatenate([[0], np.cumsum(valid)]))


@settings(max_examples=40)
@given(P=st.one_of(st.integers(1, 600), st.integers(600, 40000)), kind=st.sampled_from(["iid", "runs", "sparse", "all"]),
       seed=st.integers(0, 2**32 - 1))
def test_avx512_select_is_select(harness, P, kind, seed):
    """select_batch_avx512 and select_batch_avx512_icl (8 lanes, the op's CPU select with AVX-512
    F/DQ/VL/BW, and with BITALG/VPOPCNTDQ/VBMI too; each where this CPU has it) give select's pixel
    for every valid-pixel number: all of them in order (batch lengths not a multiple of 8 leave a
    tail group), at random (the lines prefetched ahead in another order), in place; and on an index
    whose lines and samples are random words, no pixel id at or past P (as select)."""
    print("seed", seed)
    rng = np.random.default_rng(seed)
    valid = random_mask(rng, P, kind)
    data = np.ascontiguousarray(valid_index(valid))
    V = int(valid.sum())
    want = np.flatnonzero(valid).astype(np.uint64)
    k = np.arange(V, dtype=np.uint64)
    builds = [icl for icl in (0, 1) if harness.dn_select_avx512(_p(data), len(data), P, _p(k), 0, _p(k), 1, icl) == 0]
    if not builds:
        pytest.skip("this CPU has no AVX-512 F/DQ/VL/BW: the op selects one by one (test_select_is_the_kth_valid_pixel)")
    junk = data.copy()  # random words for every line, the compact counts and every sample (the
    nb = -(-P // 384)   # counts V and the sentinels kept): wrong pixels, never >= P, select's own
    body = np.r_[0:8 * nb, 8 * nb + 8:9 * nb + 8, 9 * nb + 13:len(junk) - 2]
    junk[body] = rng.integers(0, 2**64, len(body), dtype=np.uint64)
    junk[0] = 0
    ns = [1, 7, 9, int(rng.integers(1, 3 * V + 2))]
    picks = [rng.integers(0, V, n).astype(np.uint64) for n in ns] if V else []
    junk_ks = rng.integers(0, V, 4 * V + 5).astype(np.uint64) if V else None
    for icl in builds:
        out = np.zeros(V, np.uint64)
        assert harness.dn_select_avx512(_p(data), len(data), P, _p(k), V, _p(out), 0, icl) == 0
        assert np.array_equal(out, want), (P, kind, seed, icl)
        if V == 0:
            continue  # no valid-pixel number to select
        for ks in picks:
            got = ks.copy()
            assert harness.dn_select_avx512(_p(data), len(data), P, _p(got), len(ks), _p(got), 1, icl) == 0
            assert np.array_equal(got, want[ks.astype(np.int64)]), (P, kind, seed, len(ks), icl)
        bad, scalar, ranks = np.zeros_like(junk_ks), np.zeros_like(junk_ks), np.zeros(P + 1, np.uint64)
        assert harness.dn_select_avx512(_p(junk), len(junk), P, _p(junk_ks), len(junk_ks), _p(bad), 0, icl) == 0
        assert harness.dn_select(_p(junk), len(junk), P, _p(junk_ks), len(junk_ks), _p(scalar), _p(ranks)) == 0
        assert int(bad.max()) < P and np.array_equal(bad, scalar), (P, kind, seed, icl)


@pytest.mark.parametrize("density", [0.01, 0.05, 0.12])
def test_avx512_select_searches_sparse_samples(harness, density):
    """Few scattered valid pixels put the samples more than 4 lines apart (flagged sparse): the
    8-lane select searches the compact counts for those lanes as line_of does, the same pixels."""
    seed = 4100 + int(density * 100)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    P = 60000
    valid = rng.random(P) < density
    valid[20000:45000] = False  # and a long masked stretch
    data = np.ascontiguousarray(valid_index(valid))
    V = int(valid.sum())
    nb, ns = -(-P // 384), -(-V // 256)
    flags = data[9 * nb + 13:].reshape(-1, 2)[:ns, 0] >> np.uint64(63)
    assert int(flags.sum()) >= 2, "the mask should give sparse samples"
    k = rng.permutation(V).astype(np.uint64)
    ran = 0
    for icl in (0, 1):  # the F/DQ/VL/BW build and the BITALG/VPOPCNTDQ/VBMI one, where this CPU has it
        out = np.zeros(V, np.uint64)
        rc = harness.dn_select_avx512(_p(data), len(data), P, _p(k), V, _p(out), 0, icl)
        if rc == -2:
            continue
        ran += 1
        assert rc == 0 and np.array_equal(out, np.flatnonzero(valid)[k.astype(np.int64)]), icl
    if not ran:
        pytest.skip("this CPU has no AVX-512 F/DQ/VL/BW")


def test_device_in_byte_select_matches_the_table_and_bad_indexes_are_refused(harness):
    assert harness.dn_bytes() == 0
    idx = np.ascontiguousarray(valid_index(np.ones(700, bool)))
    k, out, ranks = np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.zeros(800, np.uint64)
    assert harness.dn_select(_p(idx), len(idx) - 1, 700, _p(k), 1, _p(out), _p(ranks)) == -1  # short
    assert harness.dn_select(_p(idx), len(idx), 600, _p(k), 1, _p(out), _p(ranks)) == -1  # counts > P


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_gpu_per_thread_masked_global_stream_matches_the_reference(harness, mode):
    """ray_sampler.cu's masked global stream, per-thread code compiled for the host: every rank's
    kept positions and pixels (valid ones, the split's ids) are the reference's, world sizes 1-4."""
    rng = np.random.default_rng(29)
    sizes = np.array([35, 144, 660, 96, 81, 1, 7, 700])
    offs = np.concatenate([[0], np.cumsum(sizes)])
    valid = random_mask(rng, int(offs[-1]), "runs")
    valid[offs[5]:offs[7]] = False  # two images with nothing valid
    V = int(valid.sum())
    seed, g0, total = int(rng.integers(0, 2**40)), int(rng.integers(0, 3 * V)), 3000
    g = np.arange(g0, g0 + total)
    want = ref.masked_pixels(seed, mode, valid, sizes, g)
    for W in range(1, 5):
        pix_all, pos_all = [], []
        for r in range(W):
            a, b = shard_range(len(sizes), r, W)
            lo, hi = int(offs[a]), int(offs[b])
            data = np.ascontiguousarray(valid_index(valid[lo:hi]))
            lay_offs = np.ascontiguousarray(offs[a:b] - lo, np.int64)
            pix, pos = np.empty(total, np.int64), np.empty(total, np.int64)
            m = harness.dn_gpu_masked(ref.global_key(seed, mode), ref.MODES[mode], V, min(int(valid[:lo].sum()), V - 1),
                                      _p(data), len(data), hi - lo, _p(lay_offs), b - a, g0, total, _p(pix), _p(pos))
            assert m >= 0
            pix_all.append(pix[:m] + lo)
            pos_all.append(pos[:m])
        pix, pos = np.concatenate(pix_all), np.concatenate(pos_all)
        order = np.argsort(pos)
        assert np.array_equal(pos[order], g) and np.array_equal(pix[order], want), (mode, W)


# ------------------------------------------------------------------------------ the per-cache streams

@pytest.mark.parametrize("mode", ["random", "epoch"])
@pytest.mark.parametrize("sizes", [((7, 5), (16, 9), (33, 20), (40, 30)), ((12, 8),) * 5], ids=["mixed", "uniform"])
def test_masked_streams_are_the_formula_over_valid_pixels(mode, sizes):
    """Random and epoch streams (AVX2 and scalar writers) draw only valid pixels: the unmasked
    formula over V positions, each the k-th valid pixel; epoch = each valid pixel once per V."""
    seed = 41
    print("seed", seed)
    rng = np.random.default_rng(seed)
    cache = make_cache(rng, sizes=sizes)
    P = len(cache[0])
    valid = random_mask(rng, P, "runs")
    valid[rng.choice(P, P // 3, replace=False)] = False
    V = int(valid.sum())
    for simd in (True, False):
        out = run(cache, 2000, 3 * V + 11, valid, mode=mode, seed=5, stream=1, num_streams=3, simd=simd)
        pid = pixel_ids(cache, out["indices"])
        assert valid[pid].all()
        assert np.array_equal(pid, select_reference(valid, REFS[mode](5, 1, 3, 3 * V + 11, 2000, V)))
    if mode == "epoch":
        one = pixel_ids(cache, run(cache, V, 2 * V, valid, mode="epoch", seed=9)["indices"])
        assert np.array_equal(np.sort(one), np.flatnonzero(valid))


def test_all_valid_mask_gives_the_unmasked_bytes():
    """V = P and select = identity: a full mask changes nothing (random, epoch, routed, global)."""
    cache = make_cache(np.random.default_rng(3), radius=2.0)
    P = len(cache[0])
    full = np.ones(P, bool)
    cases = [dict(mode="random", seed=3), dict(mode="epoch", seed=4),
             dict(mode="random", seed=5, cell=1, centroids=CENTROIDS),
             dict(mode="epoch", seed=6, global_pixels=P, step_positions=100)]
    for kw in cases:
        a = run(cache, 500 if "global_pixels" not in kw else 1000, 200 if "global_pixels" not in kw else 300,
                **{**kw, "centroids": kw.get("centroids")})
        b = run(cache, 500 if "global_pixels" not in kw else 1000, 200 if "global_pixels" not in kw else 300, full,
                **{**kw, "centroids": kw.get("centroids")})
        for k in a:
            assert a[k].tobytes() == b[k].tobytes(), (kw, k)


def test_routed_masked_stream_is_the_masked_stream_filtered():
    """SS routing is unchanged: a routed masked run keeps a subsequence of the masked candidate
    stream (each ray the stream's own, bit for bit), ends on its last candidate, and every ray is valid."""
    rng = np.random.default_rng(8)
    cache = make_cache(rng, radius=2.0)
    P = len(cache[0])
    valid = random_mask(rng, P, "iid")
    routed = run(cache, 300, 50, valid, centroids=CENTROIDS, cell=2, seed=7)
    n = int(routed["consumed"][0])
    plain = run(cache, n, 50, valid, seed=7)
    assert valid[pixel_ids(cache, routed["indices"])].all()
    rows = lambda o: [r.tobytes() for r in np.concatenate([o["indices"], o["directions"].view(np.int32)], 1)]  # noqa: E731
    cand, kept = rows(plain), rows(routed)
    j = -1
    for row in kept:  # a subsequence, greedily (a random stream may repeat a pixel)
        j = cand.index(row, j + 1)
    assert j == n - 1


# ------------------------------------------------------------------------------ the global stream

def shard_valid(cache, valid, rank, W):
    """Rank ``rank``'s shard of ``cache`` under world size W: (its cache, its mask, the split's
    pixel id of its first pixel, the split's valid pixels before it)."""
    sub, lo = shard_cache(cache, rank, W)
    return sub, valid[lo:lo + len(sub[0])], lo, int(valid[:lo].sum())


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(["random", "epoch"]), W=st.integers(1, 4),
       W2=st.integers(1, 4), G=st.integers(1, 60), kind=st.sampled_from(["iid", "runs", "sparse"]), simd=st.booleans())
def test_global_stream_over_valid_pixels_across_world_sizes(seed, mode, W, W2, G, kind, simd):
    """Each rank keeps the positions whose slot is in its shard's valid range: the union over the
    ranks of any world size is the reference's masked global batch, position for position; an
    epoch of V positions run on W ranks then resumed on W2 covers every valid pixel exactly once.
    With and without the SIMD paths (AVX-512 level 2 over the bucket table, the 8-lane AVX-512
    select where the CPU has F/DQ/VL/BW, else the pdep select)."""
    rng = np.random.default_rng(seed)
    sizes = [tuple(int(v) for v in rng.integers(1, 9, 2)) for _ in range(6)]
    cache = make_cache(rng, sizes=sizes)
    P = len(cache[0])
    valid = random_mask(rng, P, kind)
    valid[int(rng.integers(P))] = True
    V = int(valid.sum())
    px = cache[2][:, 1] * cache[2][:, 2]
    steps = -(-V // G)
    cut = int(rng.integers(0, steps + 1))
    got_pix, got_pos = [], []
    for world, s0, n in ((W, 0, cut), (W2, cut, steps - cut)):
        for r in range(world):
            if n == 0:
                continue
            sub, v, lo, vlo = shard_valid(cache, valid, r, world)
            begin = min(vlo, V - 1)  # an all-masked last shard keeps nothing wherever it starts
            out = run(sub, n * G, s0 * G, v, mode=mode, seed=seed, global_pixels=V, shard_begin=begin,
                      step_positions=G, simd=simd)
            local = pixel_ids(sub, out["indices"]) if len(out["indices"]) else np.zeros(0, np.int64)
            assert v[local].all()
            got_pix.append(local + lo)
            got_pos.append(out["positions"])
            assert int(out["step_counts"].sum()) == len(local)
    pix, pos = np.concatenate(got_pix), np.concatenate(got_pos)
    order = np.argsort(pos, kind="stable")
    assert np.array_equal(pos[order], np.arange(steps * G))
    want = ref.masked_pixels(seed, mode, valid, px, np.arange(steps * G))
    assert np.array_equal(pix[order], want)
    if mode == "epoch":
        assert np.array_equal(np.sort(pix[order][:V]), np.flatnonzero(valid))


# ------------------------------------------------------------------------------ bad inputs

NO_AVX512_MASKED_CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, {tests!r})
import test_op_masks as t
t.load_plugin(cuda=False)
np.savez({path!r}, **t.masked_cases())
"""


def masked_cases() -> dict:
    """The op's outputs on masked caches (iid at 50% and 6%, runs; random and epoch mode; two
    starts), by name: what test_masked_select_paths_give_the_same_bits compares across processes."""
    out = {}
    for kind, density in (("iid", 0.5), ("iid", 0.06), ("runs", 0.0)):
        rng = np.random.default_rng(77)
        cache = make_cache(rng, sizes=((96, 64), (120, 80), (31, 17), (200, 90)))
        P = len(cache[0])
        valid = rng.random(P) < density if kind == "iid" else random_mask(rng, P, "runs")
        for mode in ("random", "epoch"):
            for start in (0, 12345):
                o = run(cache, 5000, start, valid=valid, mode=mode, seed=5)
                for k in ("indices", "rgb", "origins", "directions"):
                    out[f"{kind}{density}/{mode}/{start}/{k}"] = o[k]
    return out


def test_masked_select_paths_give_the_same_bits(tmp_path):
    """``DALI_NERF_NO_AVX512=1`` (a fresh process: read when the plugin loads) makes the op select
    one by one (pdep where it is fast) instead of 8 lanes with AVX-512: the same rays, bit for bit,
    on masks dense, sparse (sparse samples) and in runs, both modes."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), []) if Path("/proc/cpuinfo").exists() else []
    if not {"avx512f", "avx512dq", "avx512vl", "avx512bw"} <= set(flags):
        pytest.skip("this CPU has no AVX-512 F/DQ/VL/BW: both processes would select one by one")
    path = tmp_path / "no_avx512_masked.npz"
    code = NO_AVX512_MASKED_CHILD.format(tests=str(Path(__file__).parent), path=str(path))
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DALI_NERF_NO_AVX512": "1"},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    child, here = np.load(path), masked_cases()
    assert sorted(child.files) == sorted(here)
    for k, v in here.items():
        assert child[k].tobytes() == v.tobytes(), k


def test_bad_valid_inputs_are_one_line_errors():
    cache = make_cache(np.random.default_rng(5))
    P = len(cache[0])
    pixels, cams, lay = cache

    def fails(extra, message, **kw):
        @pipeline_def(batch_size=1, num_threads=1, device_id=None, prefetch_queue_depth=1)
        def pipe():
            ins = [fn.external_source(source=feed(a), batch=True, no_copy=True) for a in (pixels, cams, lay, extra)]
            return tuple(fn.dali_nerf.ray_sampler(*ins, rays=10, **kw))

        with pytest.raises(RuntimeError) as err:
            pp = pipe()
            pp.build()
            pp.run()
        line = next(ln for ln in str(err.value).splitlines() if message in ln)
        assert "dali_nerf ray_sampler:" in line

    fails(CENTROIDS, "input 3 is `valid`")  # centroids without cell
    fails(np.ascontiguousarray(valid_index(np.ones(P, bool))[:-1]), "build it with dali_nerf.data.masks.valid_index")
    fails(np.ascontiguousarray(valid_index(np.ones(P + 600, bool))), "build it with dali_nerf.data.masks.valid_index")
    fails(np.ascontiguousarray(valid_index(np.zeros(P, bool))), "marks no pixel of the cache as valid")
