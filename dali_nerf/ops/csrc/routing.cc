// dali_nerf ray sampler, CPU backend: the routing decision pass and the tile map (see routing.h).
#include "routing.h"

#include <algorithm>
#include <cmath>

namespace dali_nerf {
namespace cpu {

namespace {

constexpr int kBatch = 64;  // routed: candidates per structure-of-arrays batch
constexpr int kKeep = 8;    // conditions whose b_k, c_k a batch keeps for the exact solve

/// One batch of candidates in structure-of-arrays form (the per-candidate terms of
/// detail::RouteConsts).
struct Batch {
  double Dx[kBatch], Dy[kBatch], Dz[kBatch];  // direction (unnormalised; projected in stage 2c)
  double wx[kBatch], wy[kBatch], wz[kBatch];  // world origin (routing box only)
  double ox[kBatch], oy[kBatch], oz[kBatch], C0[kBatch];  // projected origin, C0
  double a[kBatch], B0[kBatch], lo[kBatch], hi[kBatch];
  double b[kKeep * kBatch], c[kKeep * kBatch];  // b_k, c_k of the first kKeep conditions
  int32_t in[kBatch];  // end points: 1 accept (lo or hi satisfies every condition), -1 reject
                       // (some condition fails at both ends and m >= 1), 0 undecided
};

/// Stages 2 and 3 of detail::route_decide over a batch of m candidates, each stage a loop over the
/// candidates (vectorisable) calling the same stage function: the u range, the routing box, the
/// projected direction with a and B0, then the end-point tests (k outer, candidates inner).
__attribute__((always_inline)) inline void batch_body(const RouteTable &rt, Batch &__restrict__ bt, int m) {
  const detail::RouteConsts &rc = rt;  // `bt` is restrict: its stores leave the constants alone
  for (int j = 0; j < m; j++) detail::route_span(bt.Dx[j], bt.Dy[j], bt.Dz[j], bt.lo[j], bt.hi[j]);
  if (rc.has_bounds) {
    for (int j = 0; j < m; j++)
      detail::route_clip(rc, bt.wx[j], bt.wy[j], bt.wz[j], bt.Dx[j], bt.Dy[j], bt.Dz[j], bt.lo[j], bt.hi[j]);
  }
  for (int j = 0; j < m; j++)
    detail::route_quad(rc, bt.Dx[j], bt.Dy[j], bt.Dz[j], bt.ox[j], bt.oy[j], bt.oz[j], bt.a[j], bt.B0[j]);
  const int32_t concave = rc.m2 >= 1.0;  // a <= 0: f_k > 0 at both ends means f_k > 0 on [lo, hi]
  int32_t inlo[kBatch], inhi[kBatch], out[kBatch];
  for (int j = 0; j < m; j++) { inlo[j] = 1; inhi[j] = 1; out[j] = 0; }
  for (int k = 0; k < rc.n; k++) {
    for (int j = 0; j < m; j++) {
      double b = detail::route_b(rc, k, bt.B0[j], bt.Dx[j], bt.Dy[j], bt.Dz[j]);
      double c = detail::route_c(rc, k, bt.C0[j], bt.ox[j], bt.oy[j], bt.oz[j]);
      if (k < kKeep) { bt.b[k * kBatch + j] = b; bt.c[k * kBatch + j] = c; }
      int32_t l = detail::route_le0(bt.a[j], b, c, bt.lo[j]), h = detail::route_le0(bt.a[j], b, c, bt.hi[j]);
      inlo[j] &= l;
      inhi[j] &= h;
      out[j] |= (l | h) ^ 1;
    }
  }
  for (int j = 0; j < m; j++) bt.in[j] = (inlo[j] | inhi[j]) ? 1 : -(out[j] & concave);
}

// AVX2 without FMA: GCC contracts a * b + c when FMA is available; plain AVX2 rounds every
// operation as the baseline build does, so decisions do not depend on the CPU the op runs on
__attribute__((target("avx2"))) void batch_avx2(const RouteTable &rt, Batch &__restrict__ bt, int m) {
  batch_body(rt, bt, m);
}
void batch_base(const RouteTable &rt, Batch &__restrict__ bt, int m) {
  batch_body(rt, bt, m);
}

enum TileClass : uint8_t { kMixed = 0, kAccept = 1, kReject = 2 };
constexpr int kTileSamples = 25;  // points along [near, far] at which a tile's rays are bounded
constexpr int kTileLevels = 3;    // classification starts on squares of 2^3 x 2^3 tiles

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
    detail::project(rt, x);
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
    const double *t = rt.img.data() + i * detail::kRouteStride;
    for (int64_t rA = 0; rA < H; rA += top)
      for (int64_t cA = 0; cA < W; cA += top)
        classify_square(rp, rt, t, cmax, W, H, tm.shift, cA, rA, top, tm.cls.data() + tm.first[i], tm.tx[i]);
  }
}

/// One candidate's per-ray routing terms into slot q of the batch (stage 1 of detail::route_decide).
inline void fill_candidate(const RouteTable &rt, Batch &bt, int q, int64_t img, int64_t row, int64_t col) {
  const double *t = rt.img.data() + img * detail::kRouteStride;
  detail::route_dir(t, static_cast<double>(col), static_cast<double>(row), bt.Dx[q], bt.Dy[q], bt.Dz[q]);
  if (rt.has_bounds) { bt.wx[q] = t[9]; bt.wy[q] = t[10]; bt.wz[q] = t[11]; }
  bt.ox[q] = t[12]; bt.oy[q] = t[13]; bt.oz[q] = t[14]; bt.C0[q] = t[15];
  bt.lo[q] = t[16]; bt.hi[q] = t[17];
}

}  // namespace

template <int Mode>
void decide_block(const Cache &c, const detail::RouteParams &rp, const RouteTable &rt, const TileMap *tm,
                  uint64_t key, uint64_t s0, int64_t n, Accepted &acc, bool avx2) {
  acc.reserve(n);
  detail::Stream<Mode> st(key, c.dom.n, s0);  // stream ids: pixels, or valid pixels (c.pixel_of)
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
    if (c.masked) select_batch(c, bpix, bpix, m, avx2);  // valid-pixel numbers -> their pixels
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
        fill_candidate(rt, bt, p, bimg[j], brow[j], bcol[j]);
      }
      if (avx2) batch_avx2(rt, bt, q);
      else batch_base(rt, bt, q);
      for (int p = 0; p < q; p++) {
        bool ok = bt.in[p] > 0;
        if (bt.in[p] == 0 && bt.lo[p] <= bt.hi[p]) {
          double bs[detail::kMaxCells], cs[detail::kMaxCells];
          for (int k = 0; k < std::min(nc, kKeep); k++) {
            bs[k] = bt.b[k * kBatch + p];
            cs[k] = bt.c[k * kBatch + p];
          }
          for (int k = kKeep; k < nc; k++) {  // the stage functions of batch_body
            bs[k] = detail::route_b(rt, k, bt.B0[p], bt.Dx[p], bt.Dy[p], bt.Dz[p]);
            cs[k] = detail::route_c(rt, k, bt.C0[p], bt.ox[p], bt.oy[p], bt.oz[p]);
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

template void decide_block<kRandom>(const Cache &, const detail::RouteParams &, const RouteTable &,
                                    const TileMap *, uint64_t, uint64_t, int64_t, Accepted &, bool);
template void decide_block<kEpoch>(const Cache &, const detail::RouteParams &, const RouteTable &,
                                   const TileMap *, uint64_t, uint64_t, int64_t, Accepted &, bool);

}  // namespace cpu
}  // namespace dali_nerf
