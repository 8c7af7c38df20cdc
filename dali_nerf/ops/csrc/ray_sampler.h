// dali_nerf ray sampler: a DALI operator that turns an in-memory image cache into training rays.
//
// Schema `dali_nerf__RaySampler` (Python: `fn.dali_nerf.ray_sampler`), CPU and GPU backends.
// The contract (inputs, arguments, outputs, stream semantics, routing) is in ARCHITECTURE.md,
// section "The operator". This header holds everything both backends share:
//   * the stream: position s -> pixel id (random: counter-based hash; epoch: keyed Feistel
//     bijection with cycle-walking, no permutation table),
//   * pixel id -> ray (the one camera formula of ARCHITECTURE.md "Conventions"),
//   * exact spatial routing of a ray segment [near, far] to a cell (closed-form quadratics),
//   * the operator class template; RunImpl is specialised in ray_sampler.cc (CPU) and
//     ray_sampler.cu (GPU).
#ifndef DALI_NERF_OPS_RAY_SAMPLER_H_
#define DALI_NERF_OPS_RAY_SAMPLER_H_

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#ifdef __CUDACC__
#define DN_HD __host__ __device__ __forceinline__
#else
#define DN_HD inline
#endif

namespace dali_nerf {
namespace detail {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr int kFeistelRounds = 4;
constexpr int kMaxCells = 64;  // centroids per routing call (per-ray interval storage)

/// splitmix64 / murmur3-style 64-bit finaliser: a bijection on uint64 with full avalanche.
DN_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// High 64 bits of a * b: maps a uniform 64-bit hash h to [0, n) as mulhi(h, n) (Lemire).
/// The bias is at most n / 2^64 per value (< 1e-12 for any cache that fits in memory).
DN_HD uint64_t mulhi64(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

/// Key of one stream: every argument that must give a different stream goes in here.
DN_HD uint64_t stream_key(int64_t seed, int64_t rank, int64_t world_size, int mode) {
  uint64_t k = mix64(static_cast<uint64_t>(seed) ^ 0x6A09E667F3BCC908ull);
  k = mix64(k + kGolden * (static_cast<uint64_t>(rank) + 1));
  k = mix64(k ^ (0xBB67AE8584CAA73Bull * (static_cast<uint64_t>(world_size) + 1)));
  return mix64(k + static_cast<uint64_t>(mode) * 0x3C6EF372FE94F82Bull);
}

/// random mode: pixel id of stream position s, uniform over [0, P) (splitmix64 at counter s).
DN_HD uint64_t random_pixel(uint64_t key, uint64_t s, uint64_t P) {
  return mulhi64(mix64(key + (s + 1) * kGolden), P);
}

/// Keyed bijection on [0, P) for one epoch: an alternating (unbalanced) Feistel network on
/// b-bit words, 2^b the next power of two >= max(P, 4), with cycle-walking (expected < 2 passes).
struct EpochPerm {
  uint64_t P;
  int bits;
  uint64_t rk[kFeistelRounds];

  DN_HD void init(uint64_t key, uint64_t epoch, uint64_t P_) {
    P = P_;
    bits = 2;
    while (bits < 63 && (uint64_t(1) << bits) < P) bits++;
    uint64_t ek = mix64(key ^ mix64(epoch + 0xA54FF53A5F1D36F1ull));
    for (int r = 0; r < kFeistelRounds; r++) rk[r] = mix64(ek + kGolden * (r + 1));
  }

  DN_HD uint64_t feistel(uint64_t x) const {
    int lb = bits / 2, hb = bits - lb;  // widths of the low and high parts
    for (int r = 0; r < kFeistelRounds; r++) {
      uint64_t lmask = (uint64_t(1) << lb) - 1, hmask = (uint64_t(1) << hb) - 1;
      uint64_t lo = x & lmask, hi = x >> lb;
      x = (lo << hb) | ((hi ^ mix64(lo ^ rk[r])) & hmask);
      int t = lb; lb = hb; hb = t;  // the old low part is now the high part
    }
    return x;
  }

  DN_HD uint64_t operator()(uint64_t j) const {
    uint64_t x = feistel(j);
    while (x >= P) x = feistel(x);
    return x;
  }
};

/// Quotient n / d for n < 2^52 using a precomputed reciprocal inv = 1.0 / d (exact after the fix).
/// The conversions are signed (one instruction each on x86-64; n < 2^52 fits).
DN_HD uint64_t fast_div(uint64_t n, uint64_t d, double inv) {
  int64_t sn = static_cast<int64_t>(n), sd = static_cast<int64_t>(d);
  int64_t q = static_cast<int64_t>(static_cast<double>(sn) * inv);
  if (q * sd > sn) q--;
  else if (sn - q * sd >= sd) q++;
  return static_cast<uint64_t>(q);
}

/// Ray of pixel (row, col) of camera `cam` (18 floats: c2w row-major 12, fx, fy, cx, cy, near, far).
DN_HD void pixel_ray(const float *cam, int64_t row, int64_t col, float *o, float *d) {
  float x = (static_cast<float>(col) + 0.5f - cam[14]) / cam[12];
  float y = -(static_cast<float>(row) + 0.5f - cam[15]) / cam[13];
  float dx = cam[0] * x + cam[1] * y - cam[2];
  float dy = cam[4] * x + cam[5] * y - cam[6];
  float dz = cam[8] * x + cam[9] * y - cam[10];
  float inv = 1.0f / sqrtf(dx * dx + dy * dy + dz * dz);
  d[0] = dx * inv; d[1] = dy * inv; d[2] = dz * inv;
  o[0] = cam[3]; o[1] = cam[7]; o[2] = cam[11];
}

/// Routing parameters shared by both backends.
struct RouteParams {
  int C;
  int cell;
  double m2;               // margin^2
  double up[3];            // unit
  int dims;                // 2: ignore the component along `up`; 3: full 3-D distances
  double cproj[3 * kMaxCells];  // centroids, projected like the rays (dims == 2), in double
  bool has_bounds = false; // clip the segment to this box before routing (Mega-NeRF's altitude band)
  double bmin[3], bmax[3];
};

/// Clip [lo, hi] of the ray o + t d to the box (slab test). Returns false if the ray misses it.
DN_HD bool clip_to_box(const double *bmin, const double *bmax, const float *o, const float *d,
                       double &lo, double &hi) {
  double a = lo, b = hi;
  for (int i = 0; i < 3; i++) {
    double di = d[i], oi = o[i];
    if (di == 0.0) {
      if (oi < bmin[i] || oi > bmax[i]) return false;
      continue;
    }
    double t0 = (bmin[i] - oi) / di, t1 = (bmax[i] - oi) / di;
    if (t0 > t1) { double t = t0; t0 = t1; t1 = t; }
    a = t0 > a ? t0 : a;
    b = t1 < b ? t1 : b;
  }
  if (!(a <= b)) return false;
  lo = a; hi = b;
  return true;
}

/// The exact part of route_accept once the end-point shortcut failed: the n conditions
/// a t^2 + bs[k] t + cs[k] <= 0 (shared a) on [lo, hi]; true iff some t satisfies all of them.
DN_HD bool route_solve(double a, const double *bs, const double *cs, int n, double lo, double hi) {
  double fs[kMaxCells], fe[kMaxCells];
  int nf = 0;
  for (int k = 0; k < n; k++) {
    double b = bs[k], c = cs[k];
    if (a == 0.0) {
      if (b == 0.0) {
        if (c > 0.0) return false;
        continue;
      }
      double r = -c / b;
      if (b > 0.0) hi = r < hi ? r : hi;
      else lo = r > lo ? r : lo;
    } else {
      double disc = b * b - 4.0 * a * c;
      if (a > 0.0) {
        if (disc < 0.0) return false;
      } else if (disc <= 0.0) {
        continue;  // a < 0: the quadratic is <= 0 everywhere
      }
      double sq = sqrt(disc);
      double q = -0.5 * (b + (b >= 0.0 ? sq : -sq));
      double r1 = q / a, r2 = q != 0.0 ? c / q : r1;
      if (r1 > r2) { double t = r1; r1 = r2; r2 = t; }
      if (a > 0.0) {
        lo = r1 > lo ? r1 : lo;
        hi = r2 < hi ? r2 : hi;
      } else {
        fs[nf] = r1; fe[nf] = r2; nf++;
      }
    }
    if (!(lo <= hi)) return false;
  }
  // candidates: lo, and every forbidden interval's right end inside [lo, hi]
  for (int cand = -1; cand < nf; cand++) {
    double x = cand < 0 ? lo : fe[cand];
    if (x < lo || x > hi) continue;
    bool ok = true;
    for (int k = 0; k < nf; k++)
      if (fs[k] < x && x < fe[k]) { ok = false; break; }
    if (ok) return true;
  }
  return false;
}

/// Exact membership of the segment o + t d, t in [near, far], in cell `rp.cell`:
/// true iff some t satisfies |p - c_cell|^2 <= m^2 |p - c_k|^2 for every k != cell.
/// Each condition is a t^2 + b t + c <= 0 with a = |d'|^2 (1 - m^2); for m > 1 (a < 0) its
/// feasible set is the outside of the roots (a forbidden open interval), for m < 1 the inside,
/// for a == 0 a half-line. The allowed set is [lo, hi] minus the union of forbidden intervals; it
/// is non-empty iff lo or one forbidden interval's right end (inside [lo, hi]) is outside all.
DN_HD bool route_accept(const RouteParams &rp, const float *of, const float *df,
                        double lo, double hi) {
  if (!(lo <= hi)) return false;
  // With bounds, only the part of the segment inside the box decides; a ray that misses the box
  // (sky, background) keeps its whole [near, far] so that it still belongs to some cell.
  if (rp.has_bounds) clip_to_box(rp.bmin, rp.bmax, of, df, lo, hi);
  double o[3] = {of[0], of[1], of[2]}, d[3] = {df[0], df[1], df[2]};
  if (rp.dims == 2) {  // project on the plane perpendicular to `up` (centroids already are)
    double od = o[0] * rp.up[0] + o[1] * rp.up[1] + o[2] * rp.up[2];
    double dd = d[0] * rp.up[0] + d[1] * rp.up[1] + d[2] * rp.up[2];
    for (int i = 0; i < 3; i++) { o[i] -= od * rp.up[i]; d[i] -= dd * rp.up[i]; }
  }
  // f_k(t) = |q_j + t d|^2 - m^2 |q_k + t d|^2 = a t^2 + b_k t + c_k, with q_k = o - c_k
  const double *cj = rp.cproj + 3 * rp.cell;
  double qj[3] = {o[0] - cj[0], o[1] - cj[1], o[2] - cj[2]};
  double dd = d[0] * d[0] + d[1] * d[1] + d[2] * d[2];
  double dqj = d[0] * qj[0] + d[1] * qj[1] + d[2] * qj[2];
  double qqj = qj[0] * qj[0] + qj[1] * qj[1] + qj[2] * qj[2];
  double a = dd * (1.0 - rp.m2);
  double bs[kMaxCells], cs[kMaxCells];
  int n = 0;
  // exact end-point tests: accept if an end point satisfies every condition; reject (m >= 1, so
  // a <= 0 and each f_k is concave or linear) if some f_k is > 0 at both ends, hence on [lo, hi]
  bool in_lo = true, in_hi = true, out = false;
  for (int k = 0; k < rp.C; k++) {
    if (k == rp.cell) continue;
    const double *ck = rp.cproj + 3 * k;
    double qk[3] = {o[0] - ck[0], o[1] - ck[1], o[2] - ck[2]};
    double b = 2.0 * (dqj - rp.m2 * (d[0] * qk[0] + d[1] * qk[1] + d[2] * qk[2]));
    double c = qqj - rp.m2 * (qk[0] * qk[0] + qk[1] * qk[1] + qk[2] * qk[2]);
    bool l = (a * lo + b) * lo + c <= 0.0, h = (a * hi + b) * hi + c <= 0.0;
    in_lo = in_lo && l;
    in_hi = in_hi && h;
    out = out || !(l || h);
    bs[n] = b; cs[n] = c; n++;
  }
  if (in_lo || in_hi) return true;
  if (out && rp.m2 >= 1.0) return false;
  return route_solve(a, bs, cs, n, lo, hi);
}

}  // namespace detail
}  // namespace dali_nerf

#ifndef DALI_NERF_NO_DALI  // the math above is usable without DALI (e.g. by a C++ unit test)
#include "dali/pipeline/operator/operator.h"

namespace dali_nerf {

enum SampleMode : int { kRandom = 0, kEpoch = 1 };

template <typename Backend>
class RaySampler : public ::dali::Operator<Backend> {
 public:
  explicit RaySampler(const ::dali::OpSpec &spec)
      : ::dali::Operator<Backend>(spec),
        rays_(spec.GetArgument<int>("rays")),
        seed_(spec.GetArgument<int64_t>("seed")),
        rank_(spec.GetArgument<int>("rank")),
        world_size_(spec.GetArgument<int>("world_size")),
        cell_(spec.GetArgument<int>("cell")),
        margin_(spec.GetArgument<float>("margin")),
        dims_(spec.GetArgument<int>("dims")),
        route_tile_(spec.GetArgument<int>("route_tile")),
        simd_(spec.GetArgument<bool>("simd")) {
    std::vector<float> bounds = spec.GetRepeatedArgument<float>("bounds");
    DALI_ENFORCE(bounds.empty() || bounds.size() == 6,
                 "dali_nerf ray_sampler: `bounds` must be empty or 6 values (min xyz, max xyz)");
    has_bounds_ = bounds.size() == 6;
    for (int i = 0; i < 6 && has_bounds_; i++) bounds_[i] = bounds[i];
    std::string mode = spec.GetArgument<std::string>("mode");
    DALI_ENFORCE(mode == "random" || mode == "epoch",
                 "dali_nerf ray_sampler: `mode` must be \"random\" or \"epoch\", got \"" + mode + "\"");
    mode_ = mode == "epoch" ? kEpoch : kRandom;
    DALI_ENFORCE(rays_ > 0, "dali_nerf ray_sampler: `rays` must be > 0");
    DALI_ENFORCE(world_size_ > 0 && rank_ >= 0 && rank_ < world_size_,
                 "dali_nerf ray_sampler: need 0 <= rank < world_size");
    DALI_ENFORCE(dims_ == 2 || dims_ == 3, "dali_nerf ray_sampler: `dims` must be 2 or 3");
    DALI_ENFORCE(margin_ > 0.f, "dali_nerf ray_sampler: `margin` must be > 0");
    DALI_ENFORCE(route_tile_ >= 0 && route_tile_ <= 256 && (route_tile_ & (route_tile_ - 1)) == 0,
                 "dali_nerf ray_sampler: `route_tile` must be 0 or a power of two <= 256");
    std::vector<float> up = spec.GetRepeatedArgument<float>("up");
    DALI_ENFORCE(up.size() == 3, "dali_nerf ray_sampler: `up` must have 3 values");
    double n = std::sqrt(double(up[0]) * up[0] + double(up[1]) * up[1] + double(up[2]) * up[2]);
    DALI_ENFORCE(n > 0, "dali_nerf ray_sampler: `up` must be non-zero");
    for (int i = 0; i < 3; i++) up_[i] = up[i] / n;
    key_ = detail::stream_key(seed_, rank_, world_size_, mode_);
  }

  ~RaySampler() override = default;
  RaySampler(const RaySampler &) = delete;
  RaySampler &operator=(const RaySampler &) = delete;

 protected:
  using ::dali::Operator<Backend>::RunImpl;

  bool SetupImpl(std::vector<::dali::OutputDesc> &output_desc,
                 const ::dali::Workspace &ws) override {
    const auto &pix = ws.Input<Backend>(0);
    const auto &cams = ws.Input<Backend>(1);
    const auto &lay = ws.Input<Backend>(2);
    int nsamples = pix.num_samples();
    DALI_ENFORCE(pix.type() == DALI_UINT8, "dali_nerf ray_sampler: `pixels` must be uint8");
    DALI_ENFORCE(cams.type() == DALI_FLOAT, "dali_nerf ray_sampler: `cameras` must be float32");
    DALI_ENFORCE(lay.type() == DALI_INT64, "dali_nerf ray_sampler: `layout` must be int64");
    bool routed = cell_ >= 0;
    DALI_ENFORCE(!routed || ws.NumInput() == 4,
                 "dali_nerf ray_sampler: `cell` >= 0 needs the `centroids` input");
    for (int i = 0; i < nsamples; i++) {
      auto ps = pix.tensor_shape(i), cs = cams.tensor_shape(i), ls = lay.tensor_shape(i);
      DALI_ENFORCE(ps.size() == 2 && ps[1] == 3 && ps[0] > 0,
                   "dali_nerf ray_sampler: `pixels` must be (P, 3) with P > 0");
      DALI_ENFORCE(cs.size() == 2 && cs[1] == 18 && cs[0] > 0,
                   "dali_nerf ray_sampler: `cameras` must be (N, 18)");
      DALI_ENFORCE(ls.size() == 2 && ls[1] == 4 && ls[0] == cs[0],
                   "dali_nerf ray_sampler: `layout` must be (N, 4), N as in `cameras`");
      if (routed) {
        const auto &cen = ws.Input<Backend>(3);
        auto s = cen.tensor_shape(i);
        DALI_ENFORCE(cen.type() == DALI_FLOAT, "dali_nerf ray_sampler: `centroids` must be float32");
        DALI_ENFORCE(s.size() == 2 && s[1] == 3 && cell_ < s[0] && s[0] <= detail::kMaxCells,
                     "dali_nerf ray_sampler: `centroids` must be (C, 3), cell < C <= 64");
      }
    }
    starts_.resize(nsamples);
    for (int i = 0; i < nsamples; i++) {
      starts_[i] = this->spec_.template GetArgument<int64_t>("start", &ws, i);
      if (starts_[i] == -1) {  // continue: right where this operator's previous run of sample i ended
        DALI_ENFORCE(i < static_cast<int>(next_start_.size()) && next_start_[i] >= 0,
                     "dali_nerf ray_sampler: `start` = -1 (continue) needs an earlier run of this "
                     "operator for the same sample; give the first run's stream position");
        starts_[i] = next_start_[i];
      }
      DALI_ENFORCE(starts_[i] >= 0,
                   "dali_nerf ray_sampler: `start` must be >= 0, or -1 to continue after the previous run");
    }
    if (static_cast<int>(next_start_.size()) < nsamples) next_start_.resize(nsamples, -1);
    output_desc.resize(7);
    auto vec3 = ::dali::uniform_list_shape(nsamples, ::dali::TensorShape<2>(rays_, 3));
    auto vec1 = ::dali::uniform_list_shape(nsamples, ::dali::TensorShape<2>(rays_, 1));
    output_desc[0] = {vec3, DALI_FLOAT};
    output_desc[1] = {vec3, DALI_FLOAT};
    output_desc[2] = {vec3, DALI_FLOAT};
    output_desc[3] = {vec3, DALI_INT64};
    output_desc[4] = {vec1, DALI_FLOAT};
    output_desc[5] = {vec1, DALI_FLOAT};
    output_desc[6] = {::dali::uniform_list_shape(nsamples, ::dali::TensorShape<1>(1)),
                      DALI_INT64};
    return true;
  }

  void RunImpl(::dali::Workspace &ws) override;

  detail::RouteParams route_params(const float *centroids, int C) const {
    detail::RouteParams rp;
    rp.C = C;
    rp.cell = cell_;
    rp.m2 = double(margin_) * double(margin_);
    for (int i = 0; i < 3; i++) rp.up[i] = up_[i];
    rp.dims = dims_;
    for (int k = 0; k < C && k < detail::kMaxCells; k++) {
      double cc[3] = {centroids[3 * k], centroids[3 * k + 1], centroids[3 * k + 2]};
      if (dims_ == 2) {
        double cu = cc[0] * up_[0] + cc[1] * up_[1] + cc[2] * up_[2];
        for (int i = 0; i < 3; i++) cc[i] -= cu * up_[i];
      }
      for (int i = 0; i < 3; i++) rp.cproj[3 * k + i] = cc[i];
    }
    rp.has_bounds = has_bounds_;
    for (int i = 0; i < 3; i++) { rp.bmin[i] = bounds_[i]; rp.bmax[i] = bounds_[3 + i]; }
    return rp;
  }

  int rays_;
  int64_t seed_;
  int rank_, world_size_, cell_;
  float margin_;
  int dims_;
  int route_tile_;  // CPU routing: tile side of the per-image tile classification (0: per ray)
  bool simd_;       // CPU: AVX2 paths where the CPU has them (the same results as the scalar code)
  int mode_;
  double up_[3];
  bool has_bounds_ = false;
  double bounds_[6] = {0, 0, 0, 0, 0, 0};
  uint64_t key_;
  std::vector<int64_t> starts_;
  // per sample: the stream position right after this operator's last run (start + consumed), the
  // start of a run fed `start` = -1; -1 before the first run. Runs execute in iteration order, so
  // a pipeline that runs ahead (prefetch) continues a routed stream without knowing `consumed`.
  std::vector<int64_t> next_start_;
  double accept_estimate_ = 0.5;  // routed runs: running acceptance rate, sizes speculative rounds
  std::shared_ptr<void> scratch_;  // backend-specific state kept across runs (CPU: blocks, tile maps)
};

}  // namespace dali_nerf

#endif  // DALI_NERF_NO_DALI
#endif  // DALI_NERF_OPS_RAY_SAMPLER_H_
