// CPU backend of the dali_nerf ray sampler, and the operator schema (see ray_sampler.h).
//
// Unrouted: the R rays of a sample are split into chunks of kChunk rays, run on the DALI thread
// pool. Routed: rounds of speculative candidate blocks are decided in parallel (each block records
// the pixel ids of its accepted candidates, in stream order, without reading a pixel), the blocks
// are concatenated in order until R rays are accepted, then the accepted rays are written into the
// output in parallel chunks. A per-cache tile map (TileMap) decides most candidates by a table
// lookup; the rest get the exact per-ray test.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "ray_sampler.h"

namespace dali_nerf {

namespace {

constexpr int64_t kChunk = 16384;  // rays per thread-pool task
constexpr int64_t kBlock = 16384;  // routed: candidates per speculative block

// float(u8) / 255.f, exactly as numpy computes it
struct RgbTable {
  float v[256];
  RgbTable() { for (int i = 0; i < 256; i++) v[i] = static_cast<float>(i) / 255.f; }
};
const RgbTable kRgb;

/// The camera formula of detail::pixel_ray, x = (col + 0.5 - cx) / fx, y = -(row + 0.5 - cy) / fy,
/// d = R0 x + R1 y - R2 (R0, R1, R2 the columns of the camera-to-world rotation), folded into
/// d = A col + B row + C (unnormalised): a ray then needs no division but its normalisation.
inline void fold_camera(const float *cam, double *A, double *B, double *C) {
  double ifx = 1.0 / cam[12], ify = 1.0 / cam[13];
  double x0 = (0.5 - cam[14]) * ifx, y0 = -(0.5 - cam[15]) * ify;
  for (int r = 0; r < 3; r++) {
    double r0 = cam[4 * r], r1 = cam[4 * r + 1], r2 = cam[4 * r + 2];
    A[r] = r0 * ifx;
    B[r] = -r1 * ify;
    C[r] = r0 * x0 + r1 * y0 - r2;
  }
}

/// An image's row of the writers' table, 16 floats: A (3), B (3), C (3) of fold_camera in float,
/// origin (3), near, far, the camera index as int32 bits (when it fits; see Cache::simd), 0.
constexpr int kRow = 16;

inline void fill_row(float *t, const float *cam, int64_t index) {
  double a[3], b[3], c[3];
  fold_camera(cam, a, b, c);
  for (int r = 0; r < 3; r++) {
    t[r] = static_cast<float>(a[r]); t[3 + r] = static_cast<float>(b[r]); t[6 + r] = static_cast<float>(c[r]);
    t[9 + r] = cam[4 * r + 3];
  }
  t[12] = cam[16]; t[13] = cam[17];
  int32_t i32 = static_cast<int32_t>(index);
  std::memcpy(t + 14, &i32, 4);
  t[15] = 0.f;
}

struct Image {
  uint64_t off, W, H;
  double invW;
  const float *cam;
  int64_t index;   // camera index in the split (layout[:, 3])
  const float *t;  // its row of Cache::tab
};

/// One sample's cache: pixel id -> (image, row, col) -> ray, and the outputs it writes.
struct Cache {
  const uint8_t *pixels = nullptr;
  uint64_t P = 0;
  std::vector<Image> imgs;
  std::vector<uint64_t> offs;  // offs[i] = imgs[i].off
  bool uniform = false;        // all images the same size: no binary search
  uint64_t WH = 0;
  double invWH = 0;
  std::vector<float> tab;  // kRow floats per image (fill_row), read by both ray writers
  bool simd = false;       // every camera index and size fits the AVX2 writer's int32 lanes

  void init(const uint8_t *px, int64_t P_, const float *cams, const int64_t *lay, int64_t N) {
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
      DALI_ENFORCE(l[1] > 0 && l[2] > 0, "dali_nerf ray_sampler: `layout` width/height must be > 0");
      DALI_ENFORCE(static_cast<uint64_t>(l[0]) == expect,
                   "dali_nerf ray_sampler: `layout` offsets must be contiguous from 0 "
                   "(offset[i+1] = offset[i] + width[i] * height[i])");
      const float *c = cams + 18 * i;
      DALI_ENFORCE(c[12] != 0.f && c[13] != 0.f, "dali_nerf ray_sampler: `cameras` fx/fy must be non-zero");
      float *row = tab.data() + kRow * i;
      fill_row(row, c, l[3]);
      imgs[i] = {expect, static_cast<uint64_t>(l[1]), static_cast<uint64_t>(l[2]), 1.0 / static_cast<double>(l[1]), c,
                 l[3], row};
      simd = simd && l[3] >= 0 && l[3] <= INT32_MAX && l[1] <= INT32_MAX && l[2] <= INT32_MAX;
      offs[i] = expect;
      expect += static_cast<uint64_t>(l[1]) * static_cast<uint64_t>(l[2]);
      if (l[1] != lay[1] || l[2] != lay[2]) uniform = false;
    }
    DALI_ENFORCE(expect == P, "dali_nerf ray_sampler: `layout` covers " + std::to_string(expect) +
                              " pixels but `pixels` has " + std::to_string(P));
    WH = static_cast<uint64_t>(lay[1]) * static_cast<uint64_t>(lay[2]);
    invWH = 1.0 / static_cast<double>(WH);
  }

  inline const Image &locate(uint64_t pix, uint64_t &row, uint64_t &col) const {
    size_t img;
    if (uniform) {
      img = detail::fast_div(pix, WH, invWH);
    } else {
      img = std::upper_bound(offs.begin(), offs.end(), pix) - offs.begin() - 1;
    }
    const Image &im = imgs[img];
    uint64_t rem = pix - im.off;
    row = detail::fast_div(rem, im.W, im.invW);
    col = rem - row * im.W;
    return im;
  }
};

const bool kHasAvx2 = __builtin_cpu_supports("avx2");

struct Outputs {
  float *o, *d, *rgb, *nr, *fr;
  int64_t *idx;

  /// Ray i from pixel `pix` (the same ray whether or not the run is routed). write8_avx2 is its
  /// 8-lane twin: the same operations in the same order, so the same bits.
  inline void write(const Cache &c, int64_t i, uint64_t pix) const {
    uint64_t row, col;
    const Image &im = c.locate(pix, row, col);
    float x = static_cast<float>(static_cast<int64_t>(col)), y = static_cast<float>(static_cast<int64_t>(row));
    const float *t = im.t;  // A (0-2), B (3-5), C (6-8), origin (9-11), near, far
    float dx = t[0] * x + t[3] * y + t[6];
    float dy = t[1] * x + t[4] * y + t[7];
    float dz = t[2] * x + t[5] * y + t[8];
    float inv = 1.0f / __builtin_sqrtf(dx * dx + dy * dy + dz * dz);
    o[3 * i] = t[9]; o[3 * i + 1] = t[10]; o[3 * i + 2] = t[11];
    d[3 * i] = dx * inv; d[3 * i + 1] = dy * inv; d[3 * i + 2] = dz * inv;
    const uint8_t *p = c.pixels + 3 * pix;
    rgb[3 * i] = kRgb.v[p[0]]; rgb[3 * i + 1] = kRgb.v[p[1]]; rgb[3 * i + 2] = kRgb.v[p[2]];
    idx[3 * i] = im.index; idx[3 * i + 1] = row; idx[3 * i + 2] = col;
    nr[i] = t[12]; fr[i] = t[13];
  }
};

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
/// arithmetic (ids < 2^52; the quotient estimates are fixed up by one, as in detail::fast_div).
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
/// the same order as Outputs::write, so the rays are bit for bit the same (tested).
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

/// Pixel ids of stream positions s0, s0+1, ... in order; one division at construction only.
template <int Mode>
struct Stream;

template <>
struct Stream<kRandom> {
  uint64_t key, P, s;
  Stream(uint64_t key_, uint64_t P_, uint64_t s0) : key(key_), P(P_), s(s0) {}
  inline uint64_t next() { return detail::random_pixel(key, s++, P); }
};

template <>
struct Stream<kEpoch> {
  uint64_t key, P, e, j;
  detail::EpochPerm perm;
  Stream(uint64_t key_, uint64_t P_, uint64_t s0) : key(key_), P(P_), e(s0 / P_), j(s0 % P_) {
    perm.init(key, e, P);
  }
  inline uint64_t next() {
    if (j == P) { j = 0; e++; perm.init(key, e, P); }
    return perm(j++);
  }
};

template <int Mode>
void run_chunk(const Cache &c, const Outputs &out_, uint64_t key, uint64_t s0, int64_t i0, int64_t n,
               bool simd) {
  const Outputs out = out_;  // a local copy: its pointers stay in registers across the stores
  // pixel ids run kAhead rays ahead of the writes, each prefetched when generated: a large cache
  // is random-access DRAM-latency bound, and a steady prefetch distance keeps the misses in flight
  // (a burst of prefetches per group stalls on the fill buffers)
  constexpr int64_t kAhead = 32;
  uint64_t ring[kAhead];
  Stream<Mode> st(key, c.P, s0);
  for (int64_t k = 0; k < std::min(kAhead, n); k++) {
    ring[k] = st.next();
    __builtin_prefetch(c.pixels + 3 * ring[k]);
  }
  int64_t i = 0;
  if (simd && c.simd) {  // groups of 8 rays (AVX2), the tail one by one
    for (; i + 8 <= n; i += 8) {
      uint64_t pix[8];
      for (int j = 0; j < 8; j++) {
        int64_t k = i + j;
        pix[j] = ring[k & (kAhead - 1)];
        if (k + kAhead < n) {
          uint64_t q = st.next();
          ring[k & (kAhead - 1)] = q;
          __builtin_prefetch(c.pixels + 3 * q);
        }
      }
      write8_avx2(c, out, i0 + i, pix);
    }
  }
  for (; i < n; i++) {
    uint64_t pix = ring[i & (kAhead - 1)];
    if (i + kAhead < n) {
      uint64_t q = st.next();
      ring[i & (kAhead - 1)] = q;
      __builtin_prefetch(c.pixels + 3 * q);
    }
    out.write(c, i0 + i, pix);
  }
}

/// One speculative block's accepted candidates, in stream order: their offsets inside the block
/// and their pixel ids (the rest of the rays is written later, straight into the output).
struct Accepted {
  int64_t count = 0;
  std::vector<uint32_t> pos;
  std::vector<uint64_t> pix;

  void reserve(int64_t n) {
    if (static_cast<int64_t>(pos.size()) >= n) return;
    pos.resize(n); pix.resize(n);
  }
};

/// The CPU decision pass: the exact test of detail::route_accept, arranged so that a batch of
/// candidates from random images is evaluated with vertical SIMD over global per-cell constants.
/// With o the (projected) camera origin, D the (projected) unnormalised direction of the pixel,
/// u = t / |d| (t along the unit ray, d the unprojected unnormalised direction) and j = the cell:
///   f_k(u) = |o + u D - c_j|^2 - m^2 |o + u D - c_k|^2 = a u^2 + b_k u + c_k,
///   a = (1 - m^2) |D|^2,  b_k = B0 + 2 m^2 (D . c_k),  c_k = C0 + K_k + 2 m^2 (o . c_k),
///   B0 = 2 (1 - m^2) (D . o) - 2 (D . c_j),  C0 = |o - c_j|^2 - m^2 |o|^2,  K_k = -m^2 |c_k|^2,
/// on [near, far] / |d|. It is the same function as route_accept's, rounded differently, so a
/// decision can differ from it only for rays within rounding of a cell boundary.
struct RouteTable {
  int n = 0;  // conditions per ray (C - 1): the other cells, in increasing index
  // per image: A, B, C (9: the unnormalised direction of pixel (row, col) is A col + B row + C),
  // world origin (3), projected origin o (3), C0, near, far, 2 unused
  static constexpr int kStride = 20;
  std::vector<double> img;
  std::vector<double> ckx, cky, ckz, kk;  // per other cell: projected centroid, K_k
  double cj[3] = {0, 0, 0}, m2 = 1, two_m2 = 2, one_m2 = 0;

  void init(const Cache &c, const detail::RouteParams &rp) {
    n = rp.C - 1;
    m2 = rp.m2; two_m2 = 2.0 * rp.m2; one_m2 = 1.0 - rp.m2;
    for (int i = 0; i < 3; i++) cj[i] = rp.cproj[3 * rp.cell + i];
    ckx.clear(); cky.clear(); ckz.clear(); kk.clear();
    for (int k = 0; k < rp.C; k++) {
      if (k == rp.cell) continue;
      const double *ck = rp.cproj + 3 * k;
      ckx.push_back(ck[0]); cky.push_back(ck[1]); ckz.push_back(ck[2]);
      kk.push_back(-rp.m2 * (ck[0] * ck[0] + ck[1] * ck[1] + ck[2] * ck[2]));
    }
    img.assign(c.imgs.size() * kStride, 0.0);
    for (size_t i = 0; i < c.imgs.size(); i++) {
      const float *cam = c.imgs[i].cam;
      double *t = img.data() + i * kStride;
      fold_camera(cam, t, t + 3, t + 6);
      for (int r = 0; r < 3; r++) t[9 + r] = cam[4 * r + 3];
      double o[3] = {t[9], t[10], t[11]};
      project(rp, o);
      t[12] = o[0]; t[13] = o[1]; t[14] = o[2];
      double q[3] = {o[0] - cj[0], o[1] - cj[1], o[2] - cj[2]};
      t[15] = (q[0] * q[0] + q[1] * q[1] + q[2] * q[2]) - rp.m2 * (o[0] * o[0] + o[1] * o[1] + o[2] * o[2]);
      t[16] = cam[16]; t[17] = cam[17];
    }
  }

  static inline void project(const detail::RouteParams &rp, double *v) {
    if (rp.dims != 2) return;
    double vu = v[0] * rp.up[0] + v[1] * rp.up[1] + v[2] * rp.up[2];
    for (int i = 0; i < 3; i++) v[i] -= vu * rp.up[i];
  }
};

constexpr int kBatch = 64;  // routed: candidates per structure-of-arrays batch
constexpr int kKeep = 8;    // conditions whose b_k, c_k a batch keeps for the exact solve

/// One batch of candidates in structure-of-arrays form (the per-candidate terms above).
struct Batch {
  double Dx[kBatch], Dy[kBatch], Dz[kBatch];  // direction (unnormalised; projected in stage 2)
  double wx[kBatch], wy[kBatch], wz[kBatch];  // world origin (routing box only)
  double ox[kBatch], oy[kBatch], oz[kBatch], C0[kBatch];  // projected origin, C0
  double a[kBatch], B0[kBatch], lo[kBatch], hi[kBatch];
  double b[kKeep * kBatch], c[kKeep * kBatch];  // b_k, c_k of the first kKeep conditions
  int32_t in[kBatch];  // end points: 1 accept (lo or hi satisfies every condition), -1 reject
                       // (some condition fails at both ends and m >= 1), 0 undecided
};

/// Stages 2 and 3 of a batch, branch-free over its m candidates (vectorisable loops): the u range
/// (near/far over |d|, clipped to the routing box), the projected direction, a and B0, then the
/// end-point tests (k outer, candidates inner).
__attribute__((always_inline)) inline void batch_body(const detail::RouteParams &rp,
                                                      const RouteTable &rt, Batch &bt, int m) {
  const double nan = __builtin_nan("");
  double invs[kBatch];
  for (int j = 0; j < m; j++)
    invs[j] = 1.0 / __builtin_sqrt(bt.Dx[j] * bt.Dx[j] + bt.Dy[j] * bt.Dy[j] + bt.Dz[j] * bt.Dz[j]);
  for (int j = 0; j < m; j++) {
    double lo = bt.lo[j], hi = bt.hi[j];
    bool ok = lo <= hi;
    bt.lo[j] = ok ? lo * invs[j] : nan;  // an empty segment is never accepted: NaN fails
    bt.hi[j] = ok ? hi * invs[j] : nan;  // every test
  }
  if (rp.has_bounds) {
    // slab test on the unprojected ray w + u D; a ray that misses the box keeps its segment
    // (d == 0: 1 / d = +-inf makes that axis's slab all or nothing, as it should)
    const double *bmin = rp.bmin, *bmax = rp.bmax;
    for (int j = 0; j < m; j++) {
      double lo = bt.lo[j], hi = bt.hi[j];
      double w[3] = {bt.wx[j], bt.wy[j], bt.wz[j]}, d[3] = {bt.Dx[j], bt.Dy[j], bt.Dz[j]};
      for (int i = 0; i < 3; i++) {
        double inv = 1.0 / d[i];
        double t0 = (bmin[i] - w[i]) * inv, t1 = (bmax[i] - w[i]) * inv;
        double tn = t0 < t1 ? t0 : t1, tf = t0 < t1 ? t1 : t0;
        lo = tn > lo ? tn : lo;
        hi = tf < hi ? tf : hi;
      }
      bool hit = lo <= hi;
      bt.lo[j] = hit ? lo : bt.lo[j];
      bt.hi[j] = hit ? hi : bt.hi[j];
    }
  }
  const double u0 = rp.up[0], u1 = rp.up[1], u2 = rp.up[2], proj = rp.dims == 2 ? 1.0 : 0.0;
  const double one_m2 = rt.one_m2, cj0 = rt.cj[0], cj1 = rt.cj[1], cj2 = rt.cj[2];
  for (int j = 0; j < m; j++) {
    double du = proj * (bt.Dx[j] * u0 + bt.Dy[j] * u1 + bt.Dz[j] * u2);
    double dx = bt.Dx[j] - du * u0, dy = bt.Dy[j] - du * u1, dz = bt.Dz[j] - du * u2;
    bt.Dx[j] = dx; bt.Dy[j] = dy; bt.Dz[j] = dz;
    bt.a[j] = one_m2 * (dx * dx + dy * dy + dz * dz);
    bt.B0[j] = 2.0 * one_m2 * (dx * bt.ox[j] + dy * bt.oy[j] + dz * bt.oz[j]) -
               2.0 * (dx * cj0 + dy * cj1 + dz * cj2);
  }
  const int32_t concave = rt.m2 >= 1.0;  // a <= 0: f_k > 0 at both ends means f_k > 0 on [lo, hi]
  const double two_m2 = rt.two_m2;
  int32_t inlo[kBatch], inhi[kBatch], out[kBatch];
  for (int j = 0; j < m; j++) { inlo[j] = 1; inhi[j] = 1; out[j] = 0; }
  for (int k = 0; k < rt.n; k++) {
    const double cx = rt.ckx[k], cy = rt.cky[k], cz = rt.ckz[k], K = rt.kk[k];
    for (int j = 0; j < m; j++) {
      double b = bt.B0[j] + two_m2 * (bt.Dx[j] * cx + bt.Dy[j] * cy + bt.Dz[j] * cz);
      double c = (bt.C0[j] + K) + two_m2 * (bt.ox[j] * cx + bt.oy[j] * cy + bt.oz[j] * cz);
      if (k < kKeep) { bt.b[k * kBatch + j] = b; bt.c[k * kBatch + j] = c; }
      double a = bt.a[j], lo = bt.lo[j], hi = bt.hi[j];
      int32_t l = (a * lo + b) * lo + c <= 0.0, h = (a * hi + b) * hi + c <= 0.0;
      inlo[j] &= l;
      inhi[j] &= h;
      out[j] |= (l | h) ^ 1;
    }
  }
  for (int j = 0; j < m; j++) bt.in[j] = (inlo[j] | inhi[j]) ? 1 : -(out[j] & concave);
}

// AVX2 without FMA: GCC contracts a * b + c when FMA is available; plain AVX2 rounds every
// operation as the baseline build does, so decisions do not depend on the CPU the op runs on
__attribute__((target("avx2"))) void batch_avx2(const detail::RouteParams &rp, const RouteTable &rt,
                                                Batch &bt, int m) {
  batch_body(rp, rt, bt, m);
}
void batch_base(const detail::RouteParams &rp, const RouteTable &rt, Batch &bt, int m) {
  batch_body(rp, rt, bt, m);
}


enum TileClass : uint8_t { kMixed = 0, kAccept = 1, kReject = 2 };
constexpr int kTileSamples = 25;  // points along [near, far] at which a tile's rays are bounded
constexpr int kTileLevels = 3;    // classification starts on squares of 2^3 x 2^3 tiles

/// Per-image tile classification for routing (CPU), built once per cache and routing setup. A
/// tile of S x S pixels is kAccept when every ray through it provably meets the cell, kReject
/// when every ray provably misses it, kMixed otherwise (those rays get the exact per-ray test).
/// Proof: the tile's unit directions lie in the cone spanned by its four corner pixels'
/// directions, so the point at distance t of any of its rays lies in a ball of radius
/// r = t * chord around the point at distance t of the tile's central direction (chord = the
/// largest distance from that direction to a corner's); over a ball B(x, r),
/// f_k = |p - c_j|^2 - m^2 |p - c_k|^2 lies in
/// [f_k(x) - |grad| r + min(0, 1 - m^2) r^2, f_k(x) + |grad| r + max(0, 1 - m^2) r^2].
/// At kTileSamples distances t_i from near to far: accept when at one t_i every f_k < 0 over the
/// ball; reject (m >= 1, so each f_k is concave along every ray) when every piece [t_i, t_i+1]
/// has one f_k > 0 over the balls at both of its ends. The bounds must hold with a margin eps far
/// above rounding, so a classified ray gets the decision the per-ray test gives it. With a
/// routing box, only tiles whose end-point balls lie inside the box are classified (their
/// segments are not clipped). Squares of 8 x 8 tiles are tried first and split while undecided.
struct TileMap {
  int shift = -1;               // log2 of the tile side; -1: not built
  std::vector<uint8_t> cls;     // TileClass per tile, images one after the other
  std::vector<uint64_t> first;  // per image: index of its first tile
  std::vector<uint32_t> tx;     // per image: tiles per row
  std::vector<double> key;      // the inputs it was built from (rebuilt when they change)

  static std::vector<double> make_key(const Cache &c, const detail::RouteParams &rp, int shift) {
    std::vector<double> k = {double(shift), double(rp.C), double(rp.cell), rp.m2, double(rp.dims),
                             rp.up[0], rp.up[1], rp.up[2], double(rp.has_bounds)};
    for (int i = 0; i < 3; i++) { k.push_back(rp.bmin[i]); k.push_back(rp.bmax[i]); }
    for (int i = 0; i < 3 * rp.C; i++) k.push_back(rp.cproj[i]);
    for (size_t i = 0; i < c.imgs.size(); i++) {
      const Image &im = c.imgs[i];
      k.push_back(double(im.W)); k.push_back(double(im.H));
      for (int f = 0; f < 18; f++) k.push_back(im.cam[f]);
    }
    return k;
  }
};

uint8_t classify_tile(const detail::RouteParams &rp, const RouteTable &rt, const double *t, double cmax,
                      double c0, double c1, double r0, double r1) {
  const double nr = t[16], fr = t[17];
  if (!(nr <= fr) || !std::isfinite(nr) || !std::isfinite(fr)) return kMixed;
  const double xs[4] = {c0, c1, c0, c1}, ys[4] = {r0, r0, r1, r1};
  double n[4][3], mc[3] = {0, 0, 0};
  for (int q = 0; q < 4; q++) {
    double v[3];
    for (int i = 0; i < 3; i++) v[i] = t[i] * xs[q] + t[3 + i] * ys[q] + t[6 + i];
    double len = std::sqrt(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
    if (!(len > 0) || !std::isfinite(len)) return kMixed;
    for (int i = 0; i < 3; i++) { n[q][i] = v[i] / len; mc[i] += n[q][i]; }
  }
  double ml = std::sqrt(mc[0] * mc[0] + mc[1] * mc[1] + mc[2] * mc[2]);
  if (!(ml > 0)) return kMixed;
  for (int i = 0; i < 3; i++) mc[i] /= ml;
  double chord = 0;
  for (int q = 0; q < 4; q++) {
    double e[3] = {n[q][0] - mc[0], n[q][1] - mc[1], n[q][2] - mc[2]};
    chord = std::max(chord, std::sqrt(e[0] * e[0] + e[1] * e[1] + e[2] * e[2]));
  }
  if (!(chord < 0.5)) return kMixed;  // a wide tile (over ~29 degrees): its cone bound is loose
  chord = chord * (1.0 + 1e-6) + 1e-12;
  const double *o = t + 9;
  double olen = std::sqrt(o[0] * o[0] + o[1] * o[1] + o[2] * o[2]);
  double S = olen + std::max(std::fabs(nr), std::fabs(fr)) + cmax + 1.0;
  const double eps = 1e-9 * S * S, epsx = 1e-9 * S;  // far above double rounding of the terms
  const double m2 = rt.m2, one_m2 = 1.0 - m2;
  // the segment of every ray of the tile lies in [loL, hiU] and contains [loU, hiL]
  double loL = nr, loU = nr, hiL = fr, hiU = fr;
  if (rp.has_bounds) {
    // slab test in interval arithmetic: each unit direction component lies in mc_i +- chord; a
    // tile whose rays all hit the box gets the bounds of the clipped segments, a tile whose rays
    // all miss it keeps [near, far]; a tile with a component that may be 0 stays mixed
    double enL = -INFINITY, enU = -INFINITY, exL = INFINITY, exU = INFINITY;
    for (int i = 0; i < 3; i++) {
      double dl = mc[i] - chord, dh = mc[i] + chord;
      if (!(dl > 1e-9 || dh < -1e-9)) return kMixed;
      double pn = dl > 0 ? rp.bmin[i] : rp.bmax[i], pf = dl > 0 ? rp.bmax[i] : rp.bmin[i];
      double n0 = (pn - o[i]) / dl, n1 = (pn - o[i]) / dh, f0 = (pf - o[i]) / dl, f1 = (pf - o[i]) / dh;
      enL = std::max(enL, std::min(n0, n1)); enU = std::max(enU, std::max(n0, n1));
      exL = std::min(exL, std::min(f0, f1)); exU = std::min(exU, std::max(f0, f1));
    }
    double aL = std::max(nr, enL), aU = std::max(nr, enU), bL = std::min(fr, exL), bU = std::min(fr, exU);
    if (bL > aU + epsx) {
      loL = aL - epsx; loU = aU + epsx; hiL = bL - epsx; hiU = bU + epsx;
    } else if (!(aL > bU + epsx)) {
      return kMixed;
    }
  }
  // kTileSamples points t_i from loL to hiU: accept if all conditions hold over the ball at one
  // of them inside [loU, hiL]; reject (m >= 1: each f_k is concave along every ray) if every
  // piece [t_i, t_i+1] has a condition that fails over the balls at both of its ends
  bool chain = m2 >= 1.0;
  bool prev[detail::kMaxCells], cur[detail::kMaxCells];
  for (int i = 0; i < kTileSamples; i++) {
    double tt = i == kTileSamples - 1 ? hiU : loL + (hiU - loL) * (double(i) / (kTileSamples - 1));
    double r = std::fabs(tt) * chord;
    double x[3] = {o[0] + tt * mc[0], o[1] + tt * mc[1], o[2] + tt * mc[2]};
    RouteTable::project(rp, x);
    double qj[3] = {x[0] - rt.cj[0], x[1] - rt.cj[1], x[2] - rt.cj[2]};
    double qqj = qj[0] * qj[0] + qj[1] * qj[1] + qj[2] * qj[2];
    bool all_in = true, covered = false;
    for (int k = 0; k < rt.n; k++) {
      double qk[3] = {x[0] - rt.ckx[k], x[1] - rt.cky[k], x[2] - rt.ckz[k]};
      double g = qqj - m2 * (qk[0] * qk[0] + qk[1] * qk[1] + qk[2] * qk[2]);
      double gr[3] = {2 * (qj[0] - m2 * qk[0]), 2 * (qj[1] - m2 * qk[1]), 2 * (qj[2] - m2 * qk[2])};
      double G = std::sqrt(gr[0] * gr[0] + gr[1] * gr[1] + gr[2] * gr[2]);
      all_in = all_in && g + G * r + std::max(0.0, one_m2) * r * r < -eps;
      cur[k] = g - G * r + std::min(0.0, one_m2) * r * r > eps;
      covered = covered || (i > 0 && prev[k] && cur[k]);
    }
    if (all_in && tt >= loU && tt <= hiL) return kAccept;
    chain = chain && (i == 0 || covered);
    for (int k = 0; k < rt.n; k++) prev[k] = cur[k];
  }
  return chain ? kReject : kMixed;
}

/// Classifies the pixels [cA, cA + side) x [rA, rA + side) of an image (side: S times a power of
/// two): the whole square when it is decided, else its four quarters, down to S x S tiles. A
/// decided square proves the decision for every tile inside it.
void classify_square(const detail::RouteParams &rp, const RouteTable &rt, const double *t, double cmax,
                     int64_t W, int64_t H, int shift, int64_t cA, int64_t rA, int64_t side, uint8_t *cls,
                     uint32_t tx) {
  if (cA >= W || rA >= H) return;
  int64_t cB = std::min(W, cA + side) - 1, rB = std::min(H, rA + side) - 1;
  uint8_t k = classify_tile(rp, rt, t, cmax, double(cA), double(cB), double(rA), double(rB));
  if (k == kMixed && side > (int64_t(1) << shift)) {
    int64_t h = side / 2;
    for (int q = 0; q < 4; q++)
      classify_square(rp, rt, t, cmax, W, H, shift, cA + (q & 1) * h, rA + (q >> 1) * h, h, cls, tx);
    return;
  }
  for (int64_t ty = rA >> shift; ty <= (rB >> shift); ty++)
    for (int64_t tc = cA >> shift; tc <= (cB >> shift); tc++) cls[ty * tx + tc] = k;
}

/// Classifies the tiles of images [i0, i1) of `tm` (laid out by the caller), coarse to fine.
void classify_images(const Cache &c, const detail::RouteParams &rp, const RouteTable &rt, TileMap &tm,
                     size_t i0, size_t i1) {
  double cmax = 0;
  for (int k = 0; k < rp.C; k++) {
    const double *ck = rp.cproj + 3 * k;
    cmax = std::max(cmax, std::sqrt(ck[0] * ck[0] + ck[1] * ck[1] + ck[2] * ck[2]));
  }
  const int64_t top = int64_t(1) << (tm.shift + kTileLevels);
  for (size_t i = i0; i < i1; i++) {
    const Image &im = c.imgs[i];
    const int64_t W = static_cast<int64_t>(im.W);
    const int64_t H = static_cast<int64_t>(im.H);
    const double *t = rt.img.data() + i * RouteTable::kStride;
    for (int64_t rA = 0; rA < H; rA += top)
      for (int64_t cA = 0; cA < W; cA += top)
        classify_square(rp, rt, t, cmax, W, H, tm.shift, cA, rA, top, tm.cls.data() + tm.first[i], tm.tx[i]);
  }
}

/// One candidate's per-ray routing terms into slot q of the batch (stage 1 of the exact test).
inline void fill_candidate(const detail::RouteParams &rp, const RouteTable &rt, Batch &bt, int q, int64_t img,
                           int64_t row, int64_t col) {
  const double *t = rt.img.data() + img * RouteTable::kStride;
  double x = static_cast<double>(col), y = static_cast<double>(row);
  bt.Dx[q] = t[0] * x + t[3] * y + t[6];
  bt.Dy[q] = t[1] * x + t[4] * y + t[7];
  bt.Dz[q] = t[2] * x + t[5] * y + t[8];
  if (rp.has_bounds) { bt.wx[q] = t[9]; bt.wy[q] = t[10]; bt.wz[q] = t[11]; }
  bt.ox[q] = t[12]; bt.oy[q] = t[13]; bt.oz[q] = t[14]; bt.C0[q] = t[15];
  bt.lo[q] = t[16]; bt.hi[q] = t[17];
}

/// Routing decisions for the n candidates at stream positions s0, s0 + 1, ...: records the
/// accepted ones (offset and pixel id) in `acc`. Touches no pixel: the colours are read only for
/// accepted rays, when they are written. Per batch of candidates: 1. pixel id -> (image, row,
/// col); 2. the tile class (no tile map: every candidate is mixed); 3. the exact per-ray test of
/// the mixed ones, batched (batch_body, then route_solve for those the end points leave open);
/// 4. the accepted, recorded in stream order.
template <int Mode>
void decide_block(const Cache &c, const detail::RouteParams &rp, const RouteTable &rt, const TileMap *tm,
                  uint64_t key, uint64_t s0, int64_t n, Accepted &acc, bool avx2) {
  acc.reserve(n);
  Stream<Mode> st(key, c.P, s0);
  int64_t cnt = 0;
  uint32_t *pos = acc.pos.data();
  uint64_t *apix = acc.pix.data();
  const int nc = rt.n;
  const bool simd = avx2 && c.uniform;  // equal-size images: 4 candidates at a time
  Batch bt;
  uint64_t bpix[kBatch];
  int32_t bimg[kBatch], brow[kBatch], bcol[kBatch], mixed[kBatch];
  uint8_t dec[kBatch];
  for (int64_t i0 = 0; i0 < n; i0 += kBatch) {
    const int m = static_cast<int>(std::min<int64_t>(kBatch, n - i0));
    for (int j = 0; j < m; j++) bpix[j] = st.next();
    int j0 = simd ? locate_avx2(c, bpix, m, bimg, brow, bcol) : 0;
    for (int j = j0; j < m; j++) {
      uint64_t row, col;
      bimg[j] = static_cast<int32_t>(&c.locate(bpix[j], row, col) - c.imgs.data());
      brow[j] = static_cast<int32_t>(row);
      bcol[j] = static_cast<int32_t>(col);
    }
    int q = 0;
    if (tm) {
      const uint8_t *cls = tm->cls.data();
      const int sh = tm->shift;
      for (int j = 0; j < m; j++) {
        uint8_t k = cls[tm->first[bimg[j]] + (brow[j] >> sh) * tm->tx[bimg[j]] + (bcol[j] >> sh)];
        dec[j] = k == kAccept;
        mixed[q] = j;
        q += k == kMixed;
      }
    } else {
      for (int j = 0; j < m; j++) mixed[j] = j;
      q = m;
    }
    if (q > 0) {
      for (int p = 0; p < q; p++) {
        int j = mixed[p];
        fill_candidate(rp, rt, bt, p, bimg[j], brow[j], bcol[j]);
      }
      if (avx2) batch_avx2(rp, rt, bt, q);
      else batch_base(rp, rt, bt, q);
      for (int p = 0; p < q; p++) {
        bool ok = bt.in[p] > 0;
        if (bt.in[p] == 0 && bt.lo[p] <= bt.hi[p]) {
          double bs[detail::kMaxCells], cs[detail::kMaxCells];
          for (int k = 0; k < std::min(nc, kKeep); k++) {
            bs[k] = bt.b[k * kBatch + p];
            cs[k] = bt.c[k * kBatch + p];
          }
          for (int k = kKeep; k < nc; k++) {  // the same expressions as in batch_body
            const double cx = rt.ckx[k], cy = rt.cky[k], cz = rt.ckz[k];
            bs[k] = bt.B0[p] + rt.two_m2 * (bt.Dx[p] * cx + bt.Dy[p] * cy + bt.Dz[p] * cz);
            cs[k] = (bt.C0[p] + rt.kk[k]) + rt.two_m2 * (bt.ox[p] * cx + bt.oy[p] * cy + bt.oz[p] * cz);
          }
          ok = detail::route_solve(bt.a[p], bs, cs, nc, bt.lo[p], bt.hi[p]);
        }
        dec[mixed[p]] = ok;
      }
    }
    for (int j = 0; j < m; j++) {
      pos[cnt] = static_cast<uint32_t>(i0 + j);
      apix[cnt] = bpix[j];
      cnt += dec[j];
    }
  }
  acc.count = cnt;
}

/// Writes the rays of the pixel ids pix[0, n) to output slots [slot, slot + n).
void write_pixels(const Cache &c, const Outputs &out_, const uint64_t *pix, int64_t slot, int64_t n,
                  bool simd) {
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

/// Lays out and classifies the tile map of one cache, images split over the thread pool.
void build_tiles(const Cache &c, const detail::RouteParams &rp, const RouteTable &rt, int shift,
                 ::dali::ThreadPool &tp, TileMap &tm) {
  const uint64_t S = uint64_t(1) << shift;
  size_t N = c.imgs.size();
  tm.shift = shift;
  tm.first.resize(N);
  tm.tx.resize(N);
  uint64_t total = 0;
  for (size_t i = 0; i < N; i++) {
    const Image &im = c.imgs[i];
    tm.first[i] = total;
    tm.tx[i] = static_cast<uint32_t>((im.W + S - 1) / S);
    total += tm.tx[i] * ((im.H + S - 1) / S);
  }
  tm.cls.assign(total, kMixed);
  int parts = static_cast<int>(std::min<size_t>(N, 4 * static_cast<size_t>(tp.NumThreads())));
  for (int p = 0; p < parts; p++) {
    size_t i0 = N * p / parts, i1 = N * (p + 1) / parts;
    tp.AddWork([&, i0, i1](int) { classify_images(c, rp, rt, tm, i0, i1); },
               static_cast<int64_t>(i1 - i0));
  }
  tp.RunAll();
}

/// What a routed CPU run keeps across runs.
struct RoutedScratch {
  std::vector<Accepted> blocks;
  std::vector<TileMap> tiles;  // per sample of the batch
};

}  // namespace

template <>
void RaySampler<::dali::CPUBackend>::RunImpl(::dali::Workspace &ws) {
  using ::dali::CPUBackend;
  const auto &pix_in = ws.Input<CPUBackend>(0);
  const auto &cam_in = ws.Input<CPUBackend>(1);
  const auto &lay_in = ws.Input<CPUBackend>(2);
  auto &tp = ws.GetThreadPool();
  int nsamples = pix_in.num_samples();
  int nthreads = tp.NumThreads();
  const int64_t R = rays_;
  // AVX2 where the CPU has it (`simd`): the ray writer and the routed decision pass, both
  // bit for bit the scalar code
  const bool simd = simd_ && kHasAvx2;
  std::vector<Cache> caches(nsamples);
  std::vector<Outputs> outs(nsamples);
  for (int s = 0; s < nsamples; s++) {
    caches[s].init(pix_in.tensor<uint8_t>(s), pix_in.tensor_shape(s)[0], cam_in.tensor<float>(s),
                   lay_in.tensor<int64_t>(s), cam_in.tensor_shape(s)[0]);
    outs[s] = {ws.Output<CPUBackend>(0).mutable_tensor<float>(s),
               ws.Output<CPUBackend>(1).mutable_tensor<float>(s),
               ws.Output<CPUBackend>(2).mutable_tensor<float>(s),
               ws.Output<CPUBackend>(4).mutable_tensor<float>(s),
               ws.Output<CPUBackend>(5).mutable_tensor<float>(s),
               ws.Output<CPUBackend>(3).mutable_tensor<int64_t>(s)};
  }
  auto &consumed_out = ws.Output<CPUBackend>(6);

  if (cell_ < 0) {
    for (int s = 0; s < nsamples; s++) {
      uint64_t s0 = static_cast<uint64_t>(starts_[s]);
      for (int64_t i0 = 0; i0 < R; i0 += kChunk) {
        int64_t n = std::min(kChunk, R - i0);
        tp.AddWork([&, s, s0, i0, n](int) {
          if (mode_ == kEpoch) run_chunk<kEpoch>(caches[s], outs[s], key_, s0 + i0, i0, n, simd);
          else run_chunk<kRandom>(caches[s], outs[s], key_, s0 + i0, i0, n, simd);
        }, n);
      }
      consumed_out.mutable_tensor<int64_t>(s)[0] = R;
      next_start_[s] = starts_[s] + R;
    }
    tp.RunAll();
    return;
  }

  // routed: speculative rounds of candidate blocks
  const auto &cen_in = ws.Input<CPUBackend>(3);
  // the accepted-candidate buffers live across runs (fresh ~1 MB buffers per block would
  // page-fault every run), and so do the tile maps (rebuilt only when the inputs change)
  if (!scratch_) scratch_ = std::make_shared<RoutedScratch>();
  RoutedScratch &scratch = *std::static_pointer_cast<RoutedScratch>(scratch_);
  std::vector<Accepted> &blocks = scratch.blocks;
  if (static_cast<int>(scratch.tiles.size()) < nsamples) scratch.tiles.resize(nsamples);
  for (int s = 0; s < nsamples; s++) {
    const Cache &c = caches[s];
    detail::RouteParams rp = route_params(cen_in.tensor<float>(s),
                                          static_cast<int>(cen_in.tensor_shape(s)[0]));
    RouteTable rt;
    rt.init(c, rp);
    const TileMap *tm = nullptr;
    if (route_tile_ > 0) {
      TileMap &t = scratch.tiles[s];
      int shift = __builtin_ctz(static_cast<unsigned>(route_tile_));
      std::vector<double> key = TileMap::make_key(c, rp, shift);
      if (t.shift != shift || t.key != key) build_tiles(c, rp, rt, shift, tp, t);
      t.key.swap(key);
      tm = &t;
    }
    uint64_t s0 = static_cast<uint64_t>(starts_[s]);
    int64_t accepted = 0;
    uint64_t examined = 0;  // candidates evaluated so far = next round's offset from s0
    int64_t consumed = -1;
    while (consumed < 0) {
      int64_t need = R - accepted;
      double est = std::max(accept_estimate_, 1e-3);
      // expected need / est candidates plus 6 binomial standard deviations (and 1% for the
      // estimate's own error): a second, small round is rare, and few candidates are wasted
      int64_t cand = static_cast<int64_t>(need / est * 1.01 +
                                          6.0 * std::sqrt(need * (1.0 - est)) / est) + 256;
      // blocks of at most kBlock candidates, at least one per thread, at least 1024 each, sized
      // so that nb * bsz is just over cand (no partly-needed whole block at the end)
      int64_t bsz = std::min<int64_t>(kBlock, std::max<int64_t>(1024, (cand + nthreads - 1) / nthreads));
      int64_t nb = std::min<int64_t>((cand + bsz - 1) / bsz, 4096);
      bsz = std::max<int64_t>(1024, std::min<int64_t>(bsz, (cand + nb - 1) / nb));
      if (static_cast<int64_t>(blocks.size()) < nb) blocks.resize(nb);
      for (int64_t b = 0; b < nb; b++) {
        uint64_t bs = s0 + examined + b * bsz;
        tp.AddWork([&, b, bs, bsz](int) {
          if (mode_ == kEpoch) decide_block<kEpoch>(c, rp, rt, tm, key_, bs, bsz, blocks[b], simd);
          else decide_block<kRandom>(c, rp, rt, tm, key_, bs, bsz, blocks[b], simd);
        }, bsz);
      }
      tp.RunAll();
      int64_t round_acc = 0;
      std::vector<std::pair<int64_t, int64_t>> round_writes;  // (block, slot) this round
      for (int64_t b = 0; b < nb; b++) round_acc += blocks[b].count;
      for (int64_t b = 0; b < nb && consumed < 0; b++) {
        int64_t n = blocks[b].count;
        if (n == 0) continue;
        round_writes.push_back({b, accepted});
        if (accepted + n >= R) {
          consumed = static_cast<int64_t>(examined + b * bsz + blocks[b].pos[R - accepted - 1]) + 1;
        }
        accepted += n;
      }
      // write this round's accepted rays straight into the output, in chunks of about kChunk
      // rays (block b's accepted candidates go to slots [slot, min(slot + count, R)))
      for (auto &w : round_writes) {
        int64_t b = w.first, slot = w.second;
        int64_t n = std::min<int64_t>(blocks[b].count, R - slot);
        for (int64_t k0 = 0; k0 < n; k0 += kChunk) {
          int64_t k1 = std::min(n, k0 + kChunk);
          tp.AddWork([&, b, slot, k0, k1](int) {
            write_pixels(c, outs[s], blocks[b].pix.data() + k0, slot + k0, k1 - k0, simd);
          }, k1 - k0);
        }
      }
      tp.RunAll();
      uint64_t round_cand = static_cast<uint64_t>(nb) * bsz;
      accept_estimate_ = std::max(1e-4, static_cast<double>(round_acc) / round_cand);
      examined += round_cand;
      if (consumed < 0 && accepted == 0 && examined >= (uint64_t(1) << 26) + 64ull * R) {
        DALI_FAIL("dali_nerf ray_sampler: cell " + std::to_string(cell_) + " accepted no ray in " +
                  std::to_string(examined) + " candidates: check `centroids`, `margin` and near/far");
      }
    }
    consumed_out.mutable_tensor<int64_t>(s)[0] = consumed;
    next_start_[s] = starts_[s] + consumed;
  }
}

}  // namespace dali_nerf

DALI_REGISTER_OPERATOR(dali_nerf__RaySampler, ::dali_nerf::RaySampler<::dali::CPUBackend>, ::dali::CPU);

DALI_SCHEMA(dali_nerf__RaySampler)
    .DocStr(R"(Samples training rays from an in-memory image cache (dali_nerf).

Each output sample holds ``rays`` rays taken from a deterministic stream of pixel ids that starts
at stream position ``start``: ``random`` mode hashes (seed, rank, world_size, position), ``epoch``
mode visits every pixel of the cache exactly once per block of P positions (keyed Feistel
bijection). With ``cell >= 0`` only rays whose [near, far] segment meets the (margin-extended)
Voronoi cell ``cell`` of ``centroids`` are emitted, in stream order; ``consumed`` tells how many
stream positions were used, so the next run starts at ``start + consumed``.

Outputs: origins (R,3) f32, directions (R,3) f32 unit, rgb (R,3) f32 = pixel / 255,
indices (R,3) int64 (camera index in split, row, col), near (R,1) f32, far (R,1) f32,
consumed (1,) int64.)")
    .NumInput(3, 4)
    .NumOutput(7)
    .InputDox(0, "pixels", "TensorList (P, 3) uint8", "All images of the cache, row-major, concatenated.")
    .InputDox(1, "cameras", "TensorList (N, 18) float32",
              "Per image: camera-to-world 3x4 row-major (12), fx, fy, cx, cy, near, far.")
    .InputDox(2, "layout", "TensorList (N, 4) int64",
              "Per image: pixel offset into `pixels`, width, height, camera index in the split.")
    .InputDox(3, "centroids", "TensorList (C, 3) float32",
              "Optional: cell centroids for spatial routing (needs `cell` >= 0).")
    .AddArg("rays", "Rays per output sample.", DALI_INT32)
    .AddOptionalArg("mode", "\"random\" (iid hash of the position) or \"epoch\" (a permutation "
                    "of all P pixels per block of P positions).", std::string("random"))
    .AddOptionalArg("seed", "Stream seed.", int64_t{0})
    .AddOptionalArg("rank", "Rank of this process (part of the stream key).", 0)
    .AddOptionalArg("world_size", "Number of ranks (part of the stream key).", 1)
    .AddOptionalArg("start", "Stream position of the first candidate ray "
                             "(argument input allowed: one int64 per sample). -1: continue right "
                             "where this operator's previous run of the same sample ended (start + "
                             "consumed), so that a pipeline running ahead (prefetch) continues a "
                             "routed stream whose `consumed` it does not know yet.", int64_t{0}, true)
    .AddOptionalArg("cell", "Cell to route to (index into `centroids`); -1: no routing.", -1)
    .AddOptionalArg("margin", "Routing margin m: keep a ray if some point p of its segment has "
                    "|p - c_cell| <= m |p - c_k| for all k.", 1.15f)
    .AddOptionalArg("up", "World up vector; with dims == 2 routing ignores this axis.",
                    std::vector<float>{0.f, 1.f, 0.f})
    .AddOptionalArg("dims", "Routing distances: 2 (perpendicular to `up`) or 3.", 2)
    .AddOptionalArg("simd", "CPU: use the AVX2 code paths (8 rays at a time in the ray writer, "
                    "batched routing decisions) where the CPU has AVX2. They give bit for bit the "
                    "results of the scalar code; false forces the scalar code (for checks and "
                    "debugging). Ignored by the GPU backend.", true)
    .AddOptionalArg("route_tile", "CPU routing: side (a power of two, <= 256) of the pixel tiles that "
                    "are classified once per cache (every ray of the tile provably accepted or "
                    "rejected, or mixed: tested ray by ray); the decisions are those of the per-ray "
                    "test. 0: test every ray. The GPU backend tests every ray.", 8)
    .AddOptionalArg("bounds", "Routing box (min x, y, z, max x, y, z): only the part of a ray's "
                    "[near, far] segment inside it decides its cells (like Mega-NeRF's ray altitude "
                    "range); rays that miss the box keep their whole segment. Empty: no box.",
                    std::vector<float>{});
