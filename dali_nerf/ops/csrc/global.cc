// dali_nerf ray sampler, CPU backend: the split's global stream (see global.h).
#include "global.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include <immintrin.h>

namespace dali_nerf {
namespace cpu {

namespace {

constexpr int kFeistelRoundsCpu = detail::kFeistelRounds;

/// Per image: its bijection of the current epoch (built on first use in this chunk).
struct ImagePerm {
  uint64_t epoch = ~uint64_t(0);
  detail::EpochPerm perm;
};

/// pix[i] = offs[i] + perm_i(pix[i]) for i < n (perm_i = *which[i]: EpochPerm's cycle-walk, the same
/// values), kLanes walks at a time: each pass runs one Feistel evaluation of every walk in flight
/// (independent chains, so the core overlaps them) and a walk that lands inside its image leaves
/// its lane to the next ray. Evaluated one ray at a time, the walk's data-dependent exit (about 40%
/// of the evaluations of a 160,000-pixel image go round again) serialises the chains.
void epoch_pixels(uint64_t *pix, const uint64_t *offs, const detail::EpochPerm *const *which,
                  int n) {
  constexpr int kLanes = 8;
  int lane_ray[kLanes];
  uint64_t x[kLanes];
  int live = 0, next = 0;
  while (live < kLanes && next < n) {
    lane_ray[live] = next;
    x[live++] = pix[next++];
  }
  while (live > 0) {
    for (int l = 0; l < live; l++) x[l] = which[lane_ray[l]]->feistel(x[l]);
    for (int l = 0; l < live;) {
      const int r = lane_ray[l];
      if (x[l] >= which[r]->P) { l++; continue; }  // goes round again
      pix[r] = offs[r] + x[l];
      if (next < n) {  // the lane takes the next ray
        lane_ray[l] = next;
        x[l] = pix[next++];
        l++;
      } else {  // the last lane in flight moves here
        --live;
        lane_ray[l] = lane_ray[live];
        x[l] = x[live];
      }
    }
  }
}


// ---------------------------------------------------------------- AVX-512 level 2
// Where the CPU has AVX-512 F + DQ + VL (64-bit lane multiplies, `vpmullq`) and `simd`: level 2 eight
// positions at a time, the same integer operations lane by lane, so the same pixels (tested against
// the scalar code and the numpy reference). The epoch bijection's cycle-walk runs in passes: each
// pass evaluates one Feistel network per ray still walking, 8 lanes at a time, writes the rays
// that landed and packs the others (vpcompressq) for the next pass (about 1.6 evaluations a ray).

// kHasAvx512 (writer.h): DALI_NERF_NO_AVX512 turns these paths off at load.

#define DN_AVX512 __attribute__((target("avx512f,avx512dq,avx512vl")))

DN_AVX512 inline __m512i mix64x8(__m512i z) {
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 30));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<int64_t>(0xBF58476D1CE4E5B9ull)));
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 27));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<int64_t>(0x94D049BB133111EBull)));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

/// mulhi64(h, n) for n < 2^32, lane by lane: h n / 2^64 = (h_hi n + (h_lo n >> 32)) >> 32 exactly
/// (h_hi n <= 2^64 - 2^33 + 1 and the carry term < 2^32, so the sum fits in 64 bits).
DN_AVX512 inline __m512i mulhi32x8(__m512i h, __m512i n) {
  __m512i a = _mm512_mul_epu32(_mm512_srli_epi64(h, 32), n);
  __m512i b = _mm512_srli_epi64(_mm512_mul_epu32(h, n), 32);
  return _mm512_srli_epi64(_mm512_add_epi64(a, b), 32);
}

/// Rays still walking their image's bijection, one array per field (kBatch + 8 entries each).
struct Walks {
  std::vector<uint64_t> x, n, lb, off, idx, rk[kFeistelRoundsCpu];
  explicit Walks(size_t cap) : x(cap), n(cap), lb(cap), off(cap), idx(cap) {
    for (auto &r : rk) r.resize(cap);
  }
};

/// dst[o, o + popcount(keep)) = the lanes of v in `keep`, in order (8 entries are written).
DN_AVX512 inline void pack(std::vector<uint64_t> &dst, int o, __mmask8 keep, __m512i v) {
  _mm512_storeu_si512(dst.data() + o, _mm512_maskz_compress_epi64(keep, v));
}

/// EpochPerm::feistel of 8 lanes, each with its own widths (lb packs (hb << 32) | lb, lb = bits / 2)
/// and round keys.
DN_AVX512 inline __m512i feistel8(__m512i x, __m512i lb, const __m512i *rk) {
  const __m512i one = _mm512_set1_epi64(1);
  __m512i l = _mm512_and_si512(lb, _mm512_set1_epi64(0xFFFFFFFF)), h = _mm512_srli_epi64(lb, 32);
  for (int r = 0; r < kFeistelRoundsCpu; r++) {
    __m512i lmask = _mm512_sub_epi64(_mm512_sllv_epi64(one, l), one);
    __m512i hmask = _mm512_sub_epi64(_mm512_sllv_epi64(one, h), one);
    __m512i lo = _mm512_and_si512(x, lmask), hi = _mm512_srlv_epi64(x, l);
    __m512i f = mix64x8(_mm512_xor_si512(lo, rk[r]));
    x = _mm512_or_si512(_mm512_sllv_epi64(lo, h), _mm512_and_si512(_mm512_xor_si512(hi, f), hmask));
    __m512i t = l; l = h; h = t;  // the old low part is now the high part
  }
  return x;
}

/// Appends the lanes `again` of a walk (x after this evaluation) to `out` at o; returns the new o.
DN_AVX512 inline int pack_walks(Walks &out, int o, __mmask8 again, __m512i x, __m512i n, __m512i lb, __m512i off,
                                __m512i idx, const __m512i *rk) {
  pack(out.x, o, again, x); pack(out.n, o, again, n); pack(out.lb, o, again, lb);
  pack(out.off, o, again, off); pack(out.idx, o, again, idx);
  for (int r = 0; r < kFeistelRoundsCpu; r++) pack(out.rk[r], o, again, rk[r]);
  return o + __builtin_popcount(again);
}

/// One pass over the L walks of `in`: one Feistel evaluation each (EpochPerm::feistel lane by
/// lane); a walk that lands inside its image writes pix[idx] = off + x, the others go to `out`.
/// Returns how many went to `out`.
DN_AVX512 int feistel_pass(const Walks &in, int L, Walks &out, uint64_t *pix) {
  int o = 0;
  for (int i = 0; i < L; i += 8) {
    const __mmask8 live = L - i >= 8 ? 0xFF : static_cast<__mmask8>((1u << (L - i)) - 1);
    __m512i x = _mm512_maskz_loadu_epi64(live, in.x.data() + i);
    __m512i n = _mm512_maskz_loadu_epi64(live, in.n.data() + i);
    __m512i lb = _mm512_maskz_loadu_epi64(live, in.lb.data() + i);
    __m512i off = _mm512_maskz_loadu_epi64(live, in.off.data() + i);
    __m512i idx = _mm512_maskz_loadu_epi64(live, in.idx.data() + i);
    __m512i rk[kFeistelRoundsCpu];
    for (int r = 0; r < kFeistelRoundsCpu; r++) rk[r] = _mm512_maskz_loadu_epi64(live, in.rk[r].data() + i);
    x = feistel8(x, lb, rk);
    const __mmask8 done = _mm512_mask_cmplt_epu64_mask(live, x, n), again = live & ~done;
    _mm512_mask_i64scatter_epi64(pix, done, idx, _mm512_add_epi64(off, x), 8);
    if (again) o = pack_walks(out, o, again, x, n, lb, off, idx, rk);
  }
  return o;
}

/// Per image of the cache: its bijection's widths (packed as feistel8 takes them) and round keys
/// for the epoch `epoch` (~0: none yet), one array per field (for gathers).
struct PermTable {
  std::vector<uint64_t> epoch, lb, rk[kFeistelRoundsCpu];
  explicit PermTable(size_t n) : epoch(n, ~uint64_t(0)), lb(n) {
    for (auto &r : rk) r.resize(n);
  }
  void build(size_t img, uint64_t e, const Cache &c, const detail::GlobalStream &gs) {
    detail::EpochPerm p;
    p.init(detail::image_key(gs.key, gs.lo + c.dom.offs[img]), e, c.dom.sizes[img]);
    const int lb_ = p.bits / 2;
    lb[img] = (static_cast<uint64_t>(p.bits - lb_) << 32) | static_cast<uint64_t>(lb_);
    for (int r = 0; r < kFeistelRoundsCpu; r++) rk[r][img] = p.rk[r];
    epoch[img] = e;
  }
};

/// The offsets (in the cache's domain) of the images holding cache slots ql, for equal-size images
/// (ql < 2^52: a cache in memory). Under round-to-nearest (the default) the estimate
/// trunc(fl(ql * fl(1 / WH))) is at most ql / WH (1 + 2^-53)^2, below the next integer for
/// ql < 2^52, and at least the true quotient minus one (1 / 49 rounds down: 49 k / 49 truncates to
/// k - 1), fixed up here. img: the image's index.
DN_AVX512 inline __m512i image_offsets(__m512i ql, __m512d iWH, __m512i vWH, __m512i &img) {
  img = _mm512_cvttpd_epu64(_mm512_mul_pd(_mm512_cvtepu64_pd(ql), iWH));
  __m512i off = _mm512_mullo_epi64(img, vWH);
  const __mmask8 under = _mm512_cmpge_epu64_mask(_mm512_sub_epi64(ql, off), vWH);
  img = _mm512_mask_add_epi64(img, under, img, _mm512_set1_epi64(1));
  return _mm512_mask_add_epi64(off, under, off, vWH);
}

/// Epoch-mode level 2 of a cache of equal-size images, 8 kept positions at a time: the images,
/// positions[i] = base + js[i], and the first Feistel evaluation of every ray (the rays that land
/// write their pixel; the others go to `out` for feistel_pass). Returns how many went to `out`.
DN_AVX512 int epoch_level2_uniform(const Cache &c, const detail::GlobalStream &gs, uint64_t base, uint64_t e,
                                   const uint32_t *js, const uint64_t *qs, int w, uint64_t *pix, int64_t *positions,
                                   PermTable &tab, Walks &out) {
  const __m512d iWH = _mm512_set1_pd(c.dom.invWH);
  const __m512i vWH = _mm512_set1_epi64(static_cast<int64_t>(c.dom.WH)), lo = _mm512_set1_epi64(static_cast<int64_t>(gs.lo));
  const __m512i vbase = _mm512_set1_epi64(static_cast<int64_t>(base)), ve = _mm512_set1_epi64(static_cast<int64_t>(e));
  const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  int o = 0;
  for (int i = 0; i < w; i += 8) {
    const __mmask8 live = w - i >= 8 ? 0xFF : static_cast<__mmask8>((1u << (w - i)) - 1);
    _mm512_mask_storeu_epi64(positions + i, live,
                             _mm512_add_epi64(vbase, _mm512_cvtepu32_epi64(_mm256_maskz_loadu_epi32(live, js + i))));
    __m512i img, ql = _mm512_maskz_sub_epi64(live, _mm512_maskz_loadu_epi64(live, qs + i), lo);
    const __m512i off = image_offsets(ql, iWH, vWH, img);
    __mmask8 stale = _mm512_mask_cmpneq_epu64_mask(
        live, _mm512_mask_i64gather_epi64(ve, live, img, reinterpret_cast<const long long *>(tab.epoch.data()), 8), ve);
    if (stale) {  // the first ray of this image in this epoch: its bijection (scalar, once per image)
      alignas(64) uint64_t im[8];
      _mm512_store_si512(im, img);
      for (; stale; stale &= stale - 1) {
        const size_t k = im[__builtin_ctz(stale)];
        if (tab.epoch[k] != e) tab.build(k, e, c, gs);
      }
    }
    const __m512i lb = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), live, img,
                                                   reinterpret_cast<const long long *>(tab.lb.data()), 8);
    __m512i rk[kFeistelRoundsCpu];
    for (int r = 0; r < kFeistelRoundsCpu; r++)
      rk[r] = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), live, img,
                                          reinterpret_cast<const long long *>(tab.rk[r].data()), 8);
    const __m512i x = feistel8(_mm512_sub_epi64(ql, off), lb, rk);
    const __mmask8 done = _mm512_mask_cmplt_epu64_mask(live, x, vWH), again = live & ~done;
    _mm512_mask_storeu_epi64(pix + i, done, _mm512_add_epi64(off, x));
    if (again)
      o = pack_walks(out, o, again, x, vWH, lb, off, _mm512_add_epi64(lane, _mm512_set1_epi64(i)), rk);
  }
  return o;
}

/// Random-mode level 2 of a cache of equal-size images of n < 2^32 pixels, 8 kept positions at a
/// time: pix = image offset + random_pixel(key, g, n), positions[i] = g = base + js[i].
DN_AVX512 void random_level2_uniform(const Cache &c, const detail::GlobalStream &gs, uint64_t base,
                                     const uint32_t *js, const uint64_t *qs, int w, uint64_t *pix,
                                     int64_t *positions) {
  const __m512d iWH = _mm512_set1_pd(c.dom.invWH);
  const __m512i vWH = _mm512_set1_epi64(static_cast<int64_t>(c.dom.WH)), lo = _mm512_set1_epi64(static_cast<int64_t>(gs.lo));
  const __m512i vbase = _mm512_set1_epi64(static_cast<int64_t>(base + 1));  // + 1: random_pixel's (s + 1)
  const __m512i golden = _mm512_set1_epi64(static_cast<int64_t>(detail::kGolden));
  const __m512i key = _mm512_set1_epi64(static_cast<int64_t>(gs.key)), one = _mm512_set1_epi64(1);
  for (int i = 0; i < w; i += 8) {
    const __mmask8 live = w - i >= 8 ? 0xFF : static_cast<__mmask8>((1u << (w - i)) - 1);
    __m512i g1 = _mm512_add_epi64(vbase, _mm512_cvtepu32_epi64(_mm256_maskz_loadu_epi32(live, js + i)));
    _mm512_mask_storeu_epi64(positions + i, live, _mm512_sub_epi64(g1, one));
    __m512i ql = _mm512_maskz_sub_epi64(live, _mm512_maskz_loadu_epi64(live, qs + i), lo);
    __m512i img;
    const __m512i off = image_offsets(ql, iWH, vWH, img);
    __m512i h = mix64x8(_mm512_add_epi64(key, _mm512_mullo_epi64(g1, golden)));
    _mm512_mask_storeu_epi64(pix + i, live, _mm512_add_epi64(off, mulhi32x8(h, vWH)));
  }
}

/// Random-mode level 2 of a masked cache (images of several valid counts, each < 2^32), 8 kept
/// positions at a time: the image from the domain's bucket table and a step or two forward (the
/// lanes that still pass the next image's offset, again), then the random_pixel hash as
/// random_level2_uniform; the same values as by_table.
DN_AVX512 void random_level2_buckets(const Cache &c, const detail::GlobalStream &gs, uint64_t base,
                                     const uint32_t *js, const uint64_t *qs, int w, uint64_t *pix,
                                     int64_t *positions) {
  const Domain &d = c.dom;
  const long long *offs = reinterpret_cast<const long long *>(d.offs.data());
  const long long *sizes = reinterpret_cast<const long long *>(d.sizes.data());
  const int *bucket = reinterpret_cast<const int *>(d.bucket.data());
  const __m512i lo = _mm512_set1_epi64(static_cast<int64_t>(gs.lo));
  const __m512i vbase = _mm512_set1_epi64(static_cast<int64_t>(base + 1));  // + 1: random_pixel's (s + 1)
  const __m512i golden = _mm512_set1_epi64(static_cast<int64_t>(detail::kGolden));
  const __m512i key = _mm512_set1_epi64(static_cast<int64_t>(gs.key)), one = _mm512_set1_epi64(1);
  for (int i = 0; i < w; i += 8) {
    const __mmask8 live = w - i >= 8 ? 0xFF : static_cast<__mmask8>((1u << (w - i)) - 1);
    __m512i g1 = _mm512_add_epi64(vbase, _mm512_cvtepu32_epi64(_mm256_maskz_loadu_epi32(live, js + i)));
    _mm512_mask_storeu_epi64(positions + i, live, _mm512_sub_epi64(g1, one));
    const __m512i ql = _mm512_maskz_sub_epi64(live, _mm512_maskz_loadu_epi64(live, qs + i), lo);
    __m512i img = _mm512_cvtepu32_epi64(_mm512_mask_i64gather_epi32(_mm256_setzero_si256(), live,
                                                                     _mm512_srli_epi64(ql, d.bshift), bucket, 4));
    for (__mmask8 step = live; step;) {  // forward while the next image starts at or before ql
      const __m512i nxt = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), step, _mm512_add_epi64(img, one),
                                                      offs, 8);
      step = _mm512_mask_cmple_epu64_mask(step, nxt, ql);
      img = _mm512_mask_add_epi64(img, step, img, one);
    }
    const __m512i off = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), live, img, offs, 8);
    const __m512i n = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), live, img, sizes, 8);
    const __m512i h = mix64x8(_mm512_add_epi64(key, _mm512_mullo_epi64(g1, golden)));
    _mm512_mask_storeu_epi64(pix + i, live, _mm512_add_epi64(off, mulhi32x8(h, n)));
  }
}

// ---------------------------------------------------------------- AVX2 random level 2
// Without AVX-512: random_level2_uniform 4 positions at a time, its 64-bit multiplies by constants
// from three vpmuludq each, the image estimate in doubles as the writer's locate4 (ids < 2^52).

#define DN_AVX2 __attribute__((target("avx2")))

/// Low 64 bits of a * C, lane by lane (clo, chi: the low and high 32 bits of C in every lane).
DN_AVX2 inline __m256i mul_const4(__m256i a, __m256i clo, __m256i chi) {
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), clo), _mm256_mul_epu32(a, chi));
  return _mm256_add_epi64(_mm256_mul_epu32(a, clo), _mm256_slli_epi64(cross, 32));
}

DN_AVX2 inline __m256i set_lo4(uint64_t c) { return _mm256_set1_epi64x(static_cast<int64_t>(c & 0xFFFFFFFFull)); }
DN_AVX2 inline __m256i set_hi4(uint64_t c) { return _mm256_set1_epi64x(static_cast<int64_t>(c >> 32)); }

/// random_level2_uniform with AVX2 for w rounded down to 4; returns how many it did.
DN_AVX2 int random_level2_uniform_avx2(const Cache &c, const detail::GlobalStream &gs, uint64_t base,
                                        const uint32_t *js, const uint64_t *qs, int w, uint64_t *pix,
                                        int64_t *positions) {
  const __m256i m1lo = set_lo4(0xBF58476D1CE4E5B9ull), m1hi = set_hi4(0xBF58476D1CE4E5B9ull);
  const __m256i m2lo = set_lo4(0x94D049BB133111EBull), m2hi = set_hi4(0x94D049BB133111EBull);
  const __m256i glo = set_lo4(detail::kGolden), ghi = set_hi4(detail::kGolden);
  const __m256i key = _mm256_set1_epi64x(static_cast<int64_t>(gs.key)), lo = _mm256_set1_epi64x(static_cast<int64_t>(gs.lo));
  const __m256i vbase = _mm256_set1_epi64x(static_cast<int64_t>(base)), one = _mm256_set1_epi64x(1);
  const __m256i vWH = _mm256_set1_epi64x(static_cast<int64_t>(c.dom.WH)),
                WHm1 = _mm256_set1_epi64x(static_cast<int64_t>(c.dom.WH) - 1);
  const __m256d two52 = _mm256_set1_pd(4503599627370496.0), iWH = _mm256_set1_pd(c.dom.invWH);
  int i = 0;
  for (; i + 4 <= w; i += 4) {
    const __m256i pos = _mm256_add_epi64(vbase, _mm256_cvtepu32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i *>(js + i))));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(positions + i), pos);
    const __m256i ql = _mm256_sub_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + i)), lo);
    // the image: floor(ql * fl(1 / WH)), exact integers in doubles (ql < 2^52), then image_offsets'
    // fix-up (the estimate is never above the quotient); img * WH by one vpmuludq (img < 2^32: a
    // cache of fewer than 2^32 images, WH < 2^32)
    const __m256d qd = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(ql, _mm256_castpd_si256(two52))), two52);
    const __m256d img = _mm256_add_pd(_mm256_floor_pd(_mm256_mul_pd(qd, iWH)), two52);
    __m256i off = _mm256_mul_epu32(_mm256_xor_si256(_mm256_castpd_si256(img), _mm256_castpd_si256(two52)), vWH);
    off = _mm256_add_epi64(off, _mm256_and_si256(_mm256_cmpgt_epi64(_mm256_sub_epi64(ql, off), WHm1), vWH));
    __m256i z = _mm256_add_epi64(key, mul_const4(_mm256_add_epi64(pos, one), glo, ghi));
    z = mul_const4(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), m1lo, m1hi);
    z = mul_const4(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), m2lo, m2hi);
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
    // mulhi64(z, WH) for WH < 2^32, as mulhi32x8
    const __m256i a = _mm256_mul_epu32(_mm256_srli_epi64(z, 32), vWH), b = _mm256_srli_epi64(_mm256_mul_epu32(z, vWH), 32);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(pix + i), _mm256_add_epi64(off, _mm256_srli_epi64(_mm256_add_epi64(a, b), 32)));
  }
  return i;
}

constexpr int kBatch = 1024;  // kept positions per batch: level 2, then one write_pixels call

/// Level 2 of a chunk's batches of kept positions: their ids in the cache's domain (its pixels, or
/// its valid pixels: Cache::dom) and positions, by the fastest of the paths the CPU and the cache
/// allow (every path gives the same values).
class Level2 {
 public:
  Level2(const Cache &c, const detail::GlobalStream &gs, bool simd)
      : c_(c), gs_(gs), avx2_(simd && kHasAvx2), avx512_(simd && kHasAvx512),
        uniform_(c.dom.uniform && c.dom.WH < (uint64_t(1) << 32)) {
    if (gs.mode != kEpoch) return;
    if (!avx512_) {
      perms_.resize(c.imgs.size());
    } else {
      tab_ = std::make_unique<PermTable>(c.imgs.size());
      w1_ = std::make_unique<Walks>(kBatch + 8);
      w2_ = std::make_unique<Walks>(kBatch + 8);
    }
  }

  /// pix[i] and positions[i] of the w kept positions base + js[i] (slots qs[i]) of epoch e.
  void run(uint64_t base, uint64_t e, const uint32_t *js, const uint64_t *qs, int w, uint64_t *pix,
           int64_t *positions) {
    if (gs_.mode == kRandom && uniform_) {  // equal-size images: the image by one division
      int i = 0;
      if (avx512_) {
        random_level2_uniform(c_, gs_, base, js, qs, w, pix, positions);
        i = w;
      } else if (avx2_) {
        i = random_level2_uniform_avx2(c_, gs_, base, js, qs, w, pix, positions);
      }
      for (; i < w; i++) {
        const uint64_t ql = qs[i] - gs_.lo, pos = base + js[i];
        const uint64_t WH = c_.dom.WH;
        pix[i] = fast_div(ql, WH, c_.dom.invWH) * WH + detail::random_pixel(gs_.key, pos, WH);
        positions[i] = static_cast<int64_t>(pos);
      }
    } else if (gs_.mode == kRandom && avx512_ && !c_.dom.bucket.empty() &&
               c_.dom.max_size < (uint64_t(1) << 32)) {  // masked: the images from the bucket table
      random_level2_buckets(c_, gs_, base, js, qs, w, pix, positions);
    } else if (tab_ && uniform_) {  // epoch, equal-size images, AVX-512: the first evaluations with the images
      Walks *a = w2_.get(), *b = w1_.get();
      for (int L = epoch_level2_uniform(c_, gs_, base, e, js, qs, w, pix, positions, *tab_, *a); L > 0;
           std::swap(a, b))
        L = feistel_pass(*a, L, *b, pix);
    } else {
      by_table(base, e, js, qs, w, pix, positions);
    }
  }

 private:
  /// Any image sizes: each position's image by the cache's offsets, then its pixel (random: the
  /// hash; epoch: the image's bijection, by feistel_pass with AVX-512, else epoch_pixels).
  void by_table(uint64_t base, uint64_t e, const uint32_t *js, const uint64_t *qs, int w, uint64_t *pix,
                int64_t *positions) {
    Walks *v = w1_.get();
    for (int i = 0; i < w; i++) {
      uint64_t ql = qs[i] - gs_.lo, pos = base + js[i];
      const size_t img = c_.dom.image_of(ql);
      const uint64_t off = c_.dom.offs[img], t = ql - off, n = c_.dom.sizes[img];
      positions[i] = static_cast<int64_t>(pos);
      if (gs_.mode != kEpoch) {
        pix[i] = off + detail::random_pixel(gs_.key, pos, n);
        continue;
      }
      if (v) {  // t now, its pixel by feistel_pass
        if (tab_->epoch[img] != e) tab_->build(img, e, c_, gs_);
        v->x[i] = t; v->n[i] = n; v->off[i] = off; v->idx[i] = static_cast<uint64_t>(i);
        v->lb[i] = tab_->lb[img];
        for (int r = 0; r < kFeistelRoundsCpu; r++) v->rk[r][i] = tab_->rk[r][img];
      } else {  // t now, its pixel by epoch_pixels
        ImagePerm &ip = perms_[img];
        if (ip.epoch != e) {
          ip.perm.init(detail::image_key(gs_.key, gs_.lo + off), e, n);
          ip.epoch = e;
        }
        pix[i] = t;
        offs_[i] = off;
        which_[i] = &ip.perm;
      }
    }
    if (gs_.mode != kEpoch) return;
    if (v) {
      Walks *a = v, *b = w2_.get();
      for (int L = w; L > 0; std::swap(a, b)) L = feistel_pass(*a, L, *b, pix);
    } else {
      epoch_pixels(pix, offs_, which_, w);
    }
  }

  const Cache &c_;
  const detail::GlobalStream &gs_;
  const bool avx2_, avx512_, uniform_;  // uniform_: equal-size images of < 2^32 pixels
  std::vector<ImagePerm> perms_;        // epoch without AVX-512: each image's bijection
  std::unique_ptr<PermTable> tab_;      // epoch with AVX-512: their widths and round keys, per field
  std::unique_ptr<Walks> w1_, w2_;      // epoch, AVX-512: the walks of the passes
  uint64_t offs_[kBatch + 4];
  const detail::EpochPerm *which_[kBatch + 4];
};

}  // namespace

Returns global_jumps(const detail::GlobalStream &gs) {
  if (gs.n > gs.P / 4) return Returns{};
  return first_returns(gs.a, gs.P, gs.n, uint64_t(1) << 24);
}

int64_t run_global_chunk(const Cache &c, const Outputs &out, int64_t *positions, const detail::GlobalStream &gs,
                         uint64_t g0, uint64_t len, int64_t slot, int64_t limit, bool simd, const Returns *jumps,
                         uint64_t step_begin, uint64_t G, int64_t *tally) {
  uint64_t step_end = step_begin + G;  // the end of the step the next kept position is counted in
  uint32_t js[kBatch + 4];
  uint64_t qs[kBatch + 4], pix[kBatch + 4];
  const bool avx2 = simd && kHasAvx2;
  auto level2 = std::make_unique<Level2>(c, gs, simd);  // on the heap: its batch arrays are 16 KB
  // (its per-image tables are built per chunk: O(images of the cache) against ~16K kept rays)
  const uint64_t P = gs.P, hi = gs.lo + gs.n;
  int64_t kept = 0;
  uint64_t g = g0, left = len;
  while (left > 0) {  // one epoch at a time
    const uint64_t e = g / P, seg = std::min<uint64_t>(left, P - g % P);
    uint64_t q = detail::global_slot(gs, g), walked = 0;
    while (walked < seg) {
      int m = 0;
      uint64_t base = g + walked;
      if (jumps && jumps->ok) walked += walk_jump(q, gs.a, P, gs.lo, hi, seg - walked, js, qs, kBatch, m, *jumps);
      else if (avx2) walked += walk_avx2(q, gs.a, P, gs.lo, hi, seg - walked, js, qs, kBatch, m);
      else walked += walk_scalar(q, gs.a, P, gs.lo, hi, seg - walked, js, qs, kBatch, m);
      if (m > 0 && base + js[m - 1] < step_end) {  // the steps' tallies (positions increase)
        *tally += m;  // all in the current step
      } else {
        for (int i = 0; i < m; i++) {
          uint64_t pos = base + js[i];
          while (pos >= step_end) { step_end += G; tally++; }
          ++*tally;
        }
      }
      const int w = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(m, limit - kept)));
      level2->run(base, e, js, qs, w, pix, positions + slot + kept);
      if (c.masked) select_batch(c, pix, pix, w, simd);  // the domain's ids are valid-pixel numbers: their pixels
      write_pixels(c, out, pix, slot + kept, w, simd);
      kept += m;
    }
    g += seg;
    left -= seg;
  }
  return kept;
}

}  // namespace cpu
}  // namespace dali_nerf
