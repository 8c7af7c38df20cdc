// dali_nerf ray sampler, CPU backend: the ray writers (see writer.h).
#include "writer.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include <immintrin.h>

#include "dali/core/error_handling.h"
#include "mask_avx512.h"

namespace dali_nerf {
namespace cpu {

using detail::kRow;

namespace {

// float(u8) / 255.f, exactly as numpy computes it (detail::rgb_of, tabulated)
struct RgbTable {
  float v[256];
  RgbTable() { for (int i = 0; i < 256; i++) v[i] = detail::rgb_of(static_cast<uint8_t>(i)); }
};
const RgbTable kRgb;

}  // namespace

const bool kHasAvx2 = __builtin_cpu_supports("avx2");

namespace {
bool avx512_wanted() {
  const char *v = std::getenv("DALI_NERF_NO_AVX512");
  return v == nullptr || v[0] == '\0' || (v[0] == '0' && v[1] == '\0');
}
}  // namespace

const bool kHasAvx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("avx512vl") && avx512_wanted();

void Cache::init(const uint8_t *px, int64_t P_, const float *cams, const int64_t *lay, int64_t N,
                 const uint64_t *valid, int64_t L) {
  std::string err = detail::check_cache(cams, lay, N, P_);
  DALI_ENFORCE(err.empty(), err);
  masked = valid != nullptr;
  if (masked) {
    err = vi.init(valid, static_cast<uint64_t>(L), static_cast<uint64_t>(P_));
    DALI_ENFORCE(err.empty(), err);
  }
  pixels = px;
  P = static_cast<uint64_t>(P_);
  imgs.resize(N);
  offs.resize(N);
  tab.assign(kRow * N, 0.f);
  simd = true;
  uint64_t expect = 0;
  uniform = true;
  for (int64_t i = 0; i < N; i++) {
    const int64_t *l = lay + 4 * i;
    const float *c = cams + 18 * i;
    float *row = tab.data() + kRow * i;
    detail::fill_row(row, c, l[3]);
    imgs[i] = {expect, static_cast<uint64_t>(l[1]), static_cast<uint64_t>(l[2]), 1.0 / static_cast<double>(l[1]), c,
               l[3], row};
    simd = simd && l[3] >= 0 && l[3] <= INT32_MAX && l[1] <= INT32_MAX && l[2] <= INT32_MAX;
    offs[i] = expect;
    expect += static_cast<uint64_t>(l[1]) * static_cast<uint64_t>(l[2]);
    if (l[1] != lay[1] || l[2] != lay[2]) uniform = false;
  }
  WH = static_cast<uint64_t>(lay[1]) * static_cast<uint64_t>(lay[2]);
  invWH = 1.0 / static_cast<double>(WH);
  // the streams' domain: the pixels, or per image its valid pixels (ranks at the image offsets)
  dom.n = masked ? vi.V : P;
  dom.offs.resize(N + 1);
  for (int64_t i = 0; i < N; i++) dom.offs[i] = masked ? vi.rank(imgs[i].off) : imgs[i].off;
  dom.offs[N] = dom.n;
  dom.finish(masked);
  if (!masked) dom.uniform = uniform;
}

void Domain::finish(bool with_buckets) {
  const size_t N = offs.size() - 1;
  sizes.resize(N);
  max_size = 0;
  for (size_t i = 0; i < N; i++) {
    sizes[i] = offs[i + 1] - offs[i];
    max_size = std::max(max_size, sizes[i]);
  }
  uniform = sizes[0] > 0;
  for (size_t i = 1; i < N && uniform; i++) uniform = sizes[i] == sizes[0];
  WH = sizes[0];
  invWH = WH ? 1.0 / static_cast<double>(WH) : 0.0;
  bucket.clear();
  if (!with_buckets || uniform || n == 0) return;
  bshift = 0;
  while ((n >> bshift) > 4 * N + 4) bshift++;  // about 4 buckets an image
  bucket.resize((n >> bshift) + 1);
  size_t img = 0;
  for (size_t b = 0; b < bucket.size(); b++) {  // the image holding id b << bshift (the last one for ids past n)
    const uint64_t id = std::min<uint64_t>(uint64_t(b) << bshift, n - 1);
    while (offs[img + 1] <= id) img++;
    bucket[b] = static_cast<uint32_t>(img);
  }
}

void Outputs::write(const Cache &c, int64_t i, uint64_t pix) const {
  uint64_t row, col;
  const Image &im = c.locate(pix, row, col);
  detail::row_ray(im.t, static_cast<int64_t>(row), static_cast<int64_t>(col), o + 3 * i, d + 3 * i);
  const uint8_t *p = c.pixels + 3 * pix;
  rgb[3 * i] = kRgb.v[p[0]]; rgb[3 * i + 1] = kRgb.v[p[1]]; rgb[3 * i + 2] = kRgb.v[p[2]];
  idx[3 * i] = im.index; idx[3 * i + 1] = row; idx[3 * i + 2] = col;
  nr[i] = im.t[12]; fr[i] = im.t[13];
}

/// Quotient q and remainder of integer-valued doubles n / d (n, d < 2^52; inv = 1 / d).
__attribute__((target("avx2"), always_inline)) inline __m256d divmod4(__m256d n, __m256d d, __m256d inv,
                                                                     __m256d &q) {
  const __m256d one = _mm256_set1_pd(1.0), zero = _mm256_setzero_pd();
  q = _mm256_floor_pd(_mm256_mul_pd(n, inv));
  __m256d r = _mm256_sub_pd(n, _mm256_mul_pd(q, d));  // exact: integers below 2^53
  __m256d lt = _mm256_cmp_pd(r, zero, _CMP_LT_OQ);     // the estimate is off by at most one
  q = _mm256_sub_pd(q, _mm256_and_pd(lt, one));
  r = _mm256_add_pd(r, _mm256_and_pd(lt, d));
  __m256d ge = _mm256_cmp_pd(r, d, _CMP_GE_OQ);
  q = _mm256_add_pd(q, _mm256_and_pd(ge, one));
  return _mm256_sub_pd(r, _mm256_and_pd(ge, d));
}

/// Pixel ids pix[0..3] of a cache of equal-size images -> image, row, col, in exact double
/// arithmetic (ids < 2^52; the quotient estimates are fixed up by one, as in fast_div).
__attribute__((target("avx2"), always_inline)) inline void locate4(const Cache &c, const uint64_t *pix, __m128i &img,
                                                                    __m128i &row, __m128i &col) {
  const __m256d two52 = _mm256_set1_pd(4503599627370496.0);
  const __m256d WH = _mm256_set1_pd(static_cast<double>(static_cast<int64_t>(c.WH))),
                iWH = _mm256_set1_pd(c.invWH);
  const __m256d W = _mm256_set1_pd(static_cast<double>(static_cast<int64_t>(c.imgs[0].W))),
                iW = _mm256_set1_pd(c.imgs[0].invW);
  __m256i pi = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(pix));
  __m256d pd = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(pi, _mm256_castpd_si256(two52))), two52);
  __m256d im, rw;
  __m256d rem = divmod4(pd, WH, iWH, im);
  __m256d cl = divmod4(rem, W, iW, rw);
  img = _mm256_cvttpd_epi32(im);
  row = _mm256_cvttpd_epi32(rw);
  col = _mm256_cvttpd_epi32(cl);
}

/// locate4 over bpix[0..m), 4 candidates at a time. Returns how many it did (a multiple of 4); the
/// caller does the rest with Cache::locate.
__attribute__((target("avx2"))) int locate_avx2(const Cache &c, const uint64_t *bpix, int m, int32_t *img,
                                                int32_t *row, int32_t *col) {
  int j = 0;
  for (; j + 4 <= m; j += 4) {
    __m128i im, rw, cl;
    locate4(c, bpix + j, im, rw, cl);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(img + j), im);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(row + j), rw);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(col + j), cl);
  }
  return j;
}

/// x, y, z of 8 rays (one per lane) -> 24 floats x0 y0 z0 x1 ... z7 at `dst` (unaligned).
__attribute__((target("avx2"), always_inline)) inline void store_xyz8(float *dst, __m256 x, __m256 y, __m256 z) {
  __m256 rxy = _mm256_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0));  // per lane: x0 x2 y0 y2
  __m256 ryz = _mm256_shuffle_ps(y, z, _MM_SHUFFLE(3, 1, 3, 1));  // y1 y3 z1 z3
  __m256 rzx = _mm256_shuffle_ps(z, x, _MM_SHUFFLE(3, 1, 2, 0));  // z0 z2 x1 x3
  __m256 r03 = _mm256_shuffle_ps(rxy, rzx, _MM_SHUFFLE(2, 0, 2, 0));  // x0 y0 z0 x1
  __m256 r14 = _mm256_shuffle_ps(ryz, rxy, _MM_SHUFFLE(3, 1, 2, 0));  // y1 z1 x2 y2
  __m256 r25 = _mm256_shuffle_ps(rzx, ryz, _MM_SHUFFLE(3, 1, 3, 1));  // z2 x3 y3 z3
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(r03, r14, 0x20));
  _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(r25, r03, 0x30));
  _mm256_storeu_ps(dst + 16, _mm256_permute2f128_ps(r14, r25, 0x31));
}

/// Fields 4h .. 4h+3 of the table rows of 8 images (rays 0-3 in the low lane, 4-7 in the high).
__attribute__((target("avx2"), always_inline)) inline void load_fields4(const float *tab, const int32_t *img, int h,
                                                                         __m256 &f0, __m256 &f1, __m256 &f2, __m256 &f3) {
  __m256 m[4];
  for (int j = 0; j < 4; j++)
    m[j] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(tab + kRow * img[j] + 4 * h)),
                                _mm_loadu_ps(tab + kRow * img[j + 4] + 4 * h), 1);
  __m256 t0 = _mm256_unpacklo_ps(m[0], m[1]), t1 = _mm256_unpacklo_ps(m[2], m[3]);
  __m256 t2 = _mm256_unpackhi_ps(m[0], m[1]), t3 = _mm256_unpackhi_ps(m[2], m[3]);
  f0 = _mm256_shuffle_ps(t0, t1, 0x44); f1 = _mm256_shuffle_ps(t0, t1, 0xEE);
  f2 = _mm256_shuffle_ps(t2, t3, 0x44); f3 = _mm256_shuffle_ps(t2, t3, 0xEE);
}

/// Rays i .. i+7 from pixels pix[0..7], 8 lanes of AVX2 without FMA: the same IEEE operations in
/// the same order as Outputs::write (detail::row_ray), so the rays are bit for bit the same (tested).
__attribute__((target("avx2"))) void write8_avx2(const Cache &c, const Outputs &out, int64_t i, const uint64_t *pix) {
  alignas(32) int32_t img[8];
  __m256i vrow, vcol;
  if (c.uniform) {
    __m128i q[3][2];
    for (int h = 0; h < 2; h++) locate4(c, pix + 4 * h, q[0][h], q[1][h], q[2][h]);
    _mm256_store_si256(reinterpret_cast<__m256i *>(img), _mm256_set_m128i(q[0][1], q[0][0]));
    vrow = _mm256_set_m128i(q[1][1], q[1][0]);
    vcol = _mm256_set_m128i(q[2][1], q[2][0]);
  } else {
    alignas(32) int32_t row[8], col[8];
    for (int j = 0; j < 8; j++) {
      uint64_t r, cc;
      const Image &im = c.locate(pix[j], r, cc);
      img[j] = static_cast<int32_t>(&im - c.imgs.data());
      row[j] = static_cast<int32_t>(r); col[j] = static_cast<int32_t>(cc);
    }
    vrow = _mm256_load_si256(reinterpret_cast<const __m256i *>(row));
    vcol = _mm256_load_si256(reinterpret_cast<const __m256i *>(col));
  }
  // colours: each pixel's 3 bytes as one int32 (a 4-byte load when a byte follows in the cache)
  int32_t px[8];
  for (int j = 0; j < 8; j++) {
    const uint8_t *p = c.pixels + 3 * pix[j];
    if (pix[j] + 1 < c.P) std::memcpy(&px[j], p, 4);
    else px[j] = p[0] | (p[1] << 8) | (p[2] << 16);
  }
  const float *T = c.tab.data();
  __m256 A0, A1, A2, B0, B1, B2, C0, C1, C2, ox, oy, oz, nr, fr, fidx, unused;
  load_fields4(T, img, 0, A0, A1, A2, B0);
  load_fields4(T, img, 1, B1, B2, C0, C1);
  load_fields4(T, img, 2, C2, ox, oy, oz);
  load_fields4(T, img, 3, nr, fr, fidx, unused);
  const __m256 x = _mm256_cvtepi32_ps(vcol), y = _mm256_cvtepi32_ps(vrow);
  __m256 dx = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(A0, x), _mm256_mul_ps(B0, y)), C0);
  __m256 dy = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(A1, x), _mm256_mul_ps(B1, y)), C1);
  __m256 dz = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(A2, x), _mm256_mul_ps(B2, y)), C2);
  __m256 ss = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(dx, dx), _mm256_mul_ps(dy, dy)), _mm256_mul_ps(dz, dz));
  __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sqrt_ps(ss));
  store_xyz8(out.d + 3 * i, _mm256_mul_ps(dx, inv), _mm256_mul_ps(dy, inv), _mm256_mul_ps(dz, inv));
  store_xyz8(out.o + 3 * i, ox, oy, oz);
  _mm256_storeu_ps(out.nr + i, nr);
  _mm256_storeu_ps(out.fr + i, fr);
  const __m256i vpx = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(px)), ff = _mm256_set1_epi32(0xFF);
  const __m256 k255 = _mm256_set1_ps(255.f);
  __m256 r = _mm256_div_ps(_mm256_cvtepi32_ps(_mm256_and_si256(vpx, ff)), k255);
  __m256 g = _mm256_div_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(vpx, 8), ff)), k255);
  __m256 b = _mm256_div_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(vpx, 16), ff)), k255);
  store_xyz8(out.rgb + 3 * i, r, g, b);
  // indices: (camera index, row, col) as int32 triples, then widened to int64
  alignas(32) int32_t tri[24];
  store_xyz8(reinterpret_cast<float *>(tri), fidx, _mm256_castsi256_ps(vrow), _mm256_castsi256_ps(vcol));
  int64_t *dst = out.idx + 3 * i;
  for (int k = 0; k < 6; k++)
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + 4 * k),
                        _mm256_cvtepi32_epi64(_mm_load_si128(reinterpret_cast<const __m128i *>(tri + 4 * k))));
}

namespace {

// the masked select 8 lanes at a time (mask_avx512.h: its 16-bit compares and byte ops need BW;
// its shorter build BITALG, VPOPCNTDQ and VBMI too)
const bool kHasAvx512Bw = kHasAvx512 && __builtin_cpu_supports("avx512bw");
const bool kHasAvx512Icl = kHasAvx512Bw && __builtin_cpu_supports("avx512bitalg") &&
                           __builtin_cpu_supports("avx512vpopcntdq") && __builtin_cpu_supports("avx512vbmi");

// BMI2's pdep is a 3-cycle instruction on Intel and AMD Zen 3+, microcoded (hundreds of cycles) on
// AMD families 15h and 17h (Zen 1/2): there the broadword select_in_word is faster
const bool kFastPdep = __builtin_cpu_supports("bmi2") && !__builtin_cpu_is("amdfam15h") &&
                       !__builtin_cpu_is("amdfam17h");

/// The r-th set bit of x by pdep (inline assembly: no BMI2 code outside the path that checked for it).
inline int pdep_select(uint64_t x, uint64_t r) {
  uint64_t m;
  asm("pdep %1, %2, %0" : "=r"(m) : "r"(x), "r"(uint64_t(1) << (r & 63)));
  return m ? __builtin_ctzll(m) : 64;
}

template <bool Pdep>
void select_batch_in(const detail::ValidIndex &vi, const uint64_t *in, uint64_t *out, int64_t n) {
  // two prefetch stages kD selects apart: the sample (16 bytes: its line and the next lines'
  // counts), then the line it gives; a select then finds both in cache
  constexpr int64_t kD = 16;
  uint64_t ring[kD];
  auto at_sample = [&](int64_t i) { __builtin_prefetch(vi.samples + 2 * (in[i] >> detail::kValidSampleShift)); };
  auto at_line = [&](int64_t i) {
    const uint64_t b = vi.line_of(in[i]);
    ring[i & (kD - 1)] = b;
    __builtin_prefetch(vi.lines + 8 * b);
  };
  for (int64_t i = 0; i < std::min(2 * kD, n); i++) at_sample(i);
  for (int64_t i = 0; i < std::min(kD, n); i++) at_line(i);
  for (int64_t i = 0; i < n; i++) {
    const uint64_t k = in[i], b = ring[i & (kD - 1)];
    if (i + 2 * kD < n) at_sample(i + 2 * kD);
    if (i + kD < n) at_line(i + kD);
    if constexpr (Pdep) out[i] = vi.in_line(k, b, pdep_select);
    else out[i] = vi.in_line(k, b, [](uint64_t x, uint64_t r) { return detail::select_in_word(x, r); });
  }
}

}  // namespace

void select_batch(const Cache &c, const uint64_t *in, uint64_t *out, int64_t n, bool simd) {
  if (simd && kHasAvx512Icl) detail::select_batch_avx512_icl(c.vi, in, out, n);
  else if (simd && kHasAvx512Bw) detail::select_batch_avx512(c.vi, in, out, n);
  else if (simd && kFastPdep) select_batch_in<true>(c.vi, in, out, n);
  else select_batch_in<false>(c.vi, in, out, n);
}

/// The stream's pixel ids (masked: valid-pixel numbers, then selected) kSub at a time, then their
/// rays by write_pixels (pixels prefetched ahead). Batches measured 1.1-1.35x faster on the
/// unmasked per-rank stream (epoch, random mode) than generating each id beside its write, kAhead
/// ahead (2026-12-07: docs/BENCHMARKS.md); the global stream's chunks are batched the same way.
template <int Mode>
void run_chunk(const Cache &c, const Outputs &out, uint64_t key, uint64_t s0, int64_t i0, int64_t n, bool simd) {
  constexpr int64_t kSub = 512;
  uint64_t pix[kSub];
  detail::Stream<Mode> st(key, c.dom.n, s0);  // stream ids: pixels, or valid pixels
  for (int64_t done = 0; done < n; done += kSub) {
    const int64_t m = std::min(kSub, n - done);
    for (int64_t j = 0; j < m; j++) pix[j] = st.next();
    if (c.masked) select_batch(c, pix, pix, m, simd);
    write_pixels(c, out, pix, i0 + done, m, simd);
  }
}

/// Writes the rays of the pixel ids pix[0, n) to output slots [slot, slot + n).
void write_pixels(const Cache &c, const Outputs &out_, const uint64_t *pix, int64_t slot, int64_t n, bool simd) {
  // pixels prefetched kAhead rays ahead into every cache level, masked caches too: prefetchnta
  // (which the masked path used, to keep the valid-pixel index cached) measured slower with both
  // the one-by-one pdep select and the 8-lane one (2026-12-07, a Xeon VM: docs/MASKS.md)
  const Outputs out = out_;
  constexpr int64_t kAhead = 32;
  for (int64_t k = 0; k < std::min(kAhead, n); k++) __builtin_prefetch(c.pixels + 3 * pix[k]);
  int64_t k = 0;
  if (simd && c.simd) {
    for (; k + 8 <= n; k += 8) {
      for (int j = 0; j < 8; j++)
        if (k + j + kAhead < n) __builtin_prefetch(c.pixels + 3 * pix[k + j + kAhead]);
      write8_avx2(c, out, slot + k, pix + k);
    }
  }
  for (; k < n; k++) {
    if (k + kAhead < n) __builtin_prefetch(c.pixels + 3 * pix[k + kAhead]);
    out.write(c, slot + k, pix[k]);
  }
}

template void run_chunk<kRandom>(const Cache &, const Outputs &, uint64_t, uint64_t, int64_t, int64_t, bool);
template void run_chunk<kEpoch>(const Cache &, const Outputs &, uint64_t, uint64_t, int64_t, int64_t, bool);

}  // namespace cpu
}  // namespace dali_nerf
