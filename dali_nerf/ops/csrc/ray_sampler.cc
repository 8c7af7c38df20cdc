// CPU backend of the dali_nerf ray sampler, and the operator schema (see ray_sampler.h).
//
// Unrouted: the R rays of a sample are split into chunks of kChunk rays, run on the DALI thread
// pool. Routed: rounds of speculative candidate blocks are evaluated in parallel (each block stages
// the outputs of its accepted candidates, in stream order), the blocks are concatenated in order
// until R rays are accepted, then the blocks copy their share into the output in parallel.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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

struct Image {
  uint64_t off, W;
  double invW;
  const float *cam;
  int64_t index;  // camera index in the split (layout[:, 3])
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

  void init(const uint8_t *px, int64_t P_, const float *cams, const int64_t *lay, int64_t N) {
    pixels = px;
    P = static_cast<uint64_t>(P_);
    imgs.resize(N);
    offs.resize(N);
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
      imgs[i] = {expect, static_cast<uint64_t>(l[1]), 1.0 / static_cast<double>(l[1]), c, l[3]};
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

struct Outputs {
  float *o, *d, *rgb, *nr, *fr;
  int64_t *idx;

  inline void write(const Cache &c, int64_t i, uint64_t pix) const {
    uint64_t row, col;
    const Image &im = c.locate(pix, row, col);
    detail::pixel_ray(im.cam, row, col, o + 3 * i, d + 3 * i);
    const uint8_t *p = c.pixels + 3 * pix;
    rgb[3 * i] = kRgb.v[p[0]]; rgb[3 * i + 1] = kRgb.v[p[1]]; rgb[3 * i + 2] = kRgb.v[p[2]];
    idx[3 * i] = im.index; idx[3 * i + 1] = row; idx[3 * i + 2] = col;
    nr[i] = im.cam[16]; fr[i] = im.cam[17];
  }
};

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
void run_chunk(const Cache &c, const Outputs &out, uint64_t key, uint64_t s0, int64_t i0, int64_t n) {
  // pixel ids of a small group first, prefetching their pixels (a large cache is random-access
  // DRAM-latency bound), then the rays of the group
  constexpr int kGroup = 64;
  uint64_t pix[kGroup];
  Stream<Mode> st(key, c.P, s0);
  for (int64_t g = i0; g < i0 + n; g += kGroup) {
    int m = static_cast<int>(std::min<int64_t>(kGroup, i0 + n - g));
    for (int k = 0; k < m; k++) {
      pix[k] = st.next();
      __builtin_prefetch(c.pixels + 3 * pix[k]);
    }
    for (int k = 0; k < m; k++) out.write(c, g + k, pix[k]);
  }
}

/// Routing terms that depend only on the camera origin, computed once per image and run with
/// exactly the arithmetic of detail::route_accept (so every decision is bit-identical to it):
/// the projected origin's q_j = o' - c_cell, and per other cell k (in increasing k) q_k = o' - c_k
/// and c_k = |q_j|^2 - m^2 |q_k|^2.
struct RouteTable {
  int n = 0;       // conditions per ray (C - 1)
  int stride = 0;  // doubles per image: 3 (q_j) + 4 n (q_k, c_k)
  std::vector<double> v;

  void init(const Cache &c, const detail::RouteParams &rp) {
    n = rp.C - 1;
    stride = 3 + 4 * n;
    v.assign(c.imgs.size() * stride, 0.0);
    for (size_t i = 0; i < c.imgs.size(); i++) {
      const float *cam = c.imgs[i].cam;
      double o[3] = {cam[3], cam[7], cam[11]};
      if (rp.dims == 2) {
        double od = o[0] * rp.up[0] + o[1] * rp.up[1] + o[2] * rp.up[2];
        for (int j = 0; j < 3; j++) o[j] -= od * rp.up[j];
      }
      const double *cj = rp.cproj + 3 * rp.cell;
      double *t = v.data() + i * stride;
      double qj[3] = {o[0] - cj[0], o[1] - cj[1], o[2] - cj[2]};
      double qqj = qj[0] * qj[0] + qj[1] * qj[1] + qj[2] * qj[2];
      t[0] = qj[0]; t[1] = qj[1]; t[2] = qj[2];
      double *q = t + 3;
      for (int k = 0; k < rp.C; k++) {
        if (k == rp.cell) continue;
        const double *ck = rp.cproj + 3 * k;
        double qk[3] = {o[0] - ck[0], o[1] - ck[1], o[2] - ck[2]};
        q[0] = qk[0]; q[1] = qk[1]; q[2] = qk[2];
        q[3] = qqj - rp.m2 * (qk[0] * qk[0] + qk[1] * qk[1] + qk[2] * qk[2]);
        q += 4;
      }
    }
  }
};

/// One speculative block's accepted rays, staged in the output layout (in stream order).
struct Accepted {
  int64_t count = 0;
  std::vector<uint32_t> pos;  // offsets of the accepted candidates inside the block
  std::vector<float> o, d, rgb, nr, fr;
  std::vector<int64_t> idx;

  void reserve(int64_t n) {
    if (static_cast<int64_t>(pos.size()) >= n) return;
    pos.resize(n); o.resize(3 * n); d.resize(3 * n); rgb.resize(3 * n);
    nr.resize(n); fr.resize(n); idx.resize(3 * n);
  }
  /// Copy the first n staged rays to output slots [slot, slot + n).
  void write(const Outputs &out, int64_t slot, int64_t n) const {
    std::memcpy(out.o + 3 * slot, o.data(), 3 * n * sizeof(float));
    std::memcpy(out.d + 3 * slot, d.data(), 3 * n * sizeof(float));
    std::memcpy(out.rgb + 3 * slot, rgb.data(), 3 * n * sizeof(float));
    std::memcpy(out.idx + 3 * slot, idx.data(), 3 * n * sizeof(int64_t));
    std::memcpy(out.nr + slot, nr.data(), n * sizeof(float));
    std::memcpy(out.fr + slot, fr.data(), n * sizeof(float));
  }
};

constexpr int kBatch = 64;  // routed: candidates per structure-of-arrays batch

/// One batch of candidates in structure-of-arrays form: the rays (staged in the output layout),
/// the projected directions and the per-candidate routing terms of detail::route_accept.
struct Batch {
  double dx[kBatch], dy[kBatch], dz[kBatch], lo[kBatch], hi[kBatch], a[kBatch], dqj[kBatch];
  const double *t[kBatch];  // per-image routing terms (RouteTable row)
  int32_t in[kBatch];       // end-point shortcut: lo or hi satisfies every condition
  float o[3 * kBatch], d[3 * kBatch];
};

/// The branch-free end-point shortcut of detail::route_accept for all m candidates of a batch, with
/// exactly its arithmetic (k outer, candidates inner: a vectorisable loop).
template <int Dummy>
__attribute__((always_inline)) inline void shortcut_body(const detail::RouteParams &rp, int n,
                                                         Batch &bt, int m) {
  const double m2 = rp.m2;
  int32_t inlo[kBatch], inhi[kBatch];
  for (int j = 0; j < m; j++) { inlo[j] = 1; inhi[j] = 1; }
  for (int k = 0; k < n; k++) {
    for (int j = 0; j < m; j++) {
      const double *q = bt.t[j] + 3 + 4 * k;
      double b = 2.0 * (bt.dqj[j] - m2 * (bt.dx[j] * q[0] + bt.dy[j] * q[1] + bt.dz[j] * q[2]));
      double c = q[3], a = bt.a[j], lo = bt.lo[j], hi = bt.hi[j];
      inlo[j] &= (a * lo + b) * lo + c <= 0.0;
      inhi[j] &= (a * hi + b) * hi + c <= 0.0;
    }
  }
  for (int j = 0; j < m; j++) bt.in[j] = inlo[j] | inhi[j];
}

// AVX2 without FMA: GCC contracts a * b + c in C++ when FMA is available, which would change
// the bits of the decisions; plain AVX2 keeps every operation exactly as in detail::route_accept
__attribute__((target("avx2"))) void shortcut_avx2(const detail::RouteParams &rp, int n, Batch &bt,
                                                   int m) {
  shortcut_body<1>(rp, n, bt, m);
}
void shortcut_base(const detail::RouteParams &rp, int n, Batch &bt, int m) {
  shortcut_body<0>(rp, n, bt, m);
}
const bool kHasAvx2 = __builtin_cpu_supports("avx2");

template <int Mode>
void eval_block(const Cache &c, const detail::RouteParams &rp, const RouteTable &rt, uint64_t key,
                uint64_t s0, int64_t n, Accepted &acc) {
  acc.reserve(n);
  // pixel ids run kAhead candidates ahead of the evaluation, each prefetched when generated
  // (a steady prefetch distance; a burst of 64 prefetches stalls on the fill buffers)
  constexpr int64_t kAhead = 32;
  uint64_t ring[kAhead];
  Stream<Mode> st(key, c.P, s0);
  for (int64_t k = 0; k < std::min(kAhead, n); k++) {
    ring[k] = st.next();
    __builtin_prefetch(c.pixels + 3 * ring[k]);
  }
  int64_t cnt = 0;
  uint32_t *pos = acc.pos.data();
  float *o = acc.o.data(), *d = acc.d.data(), *rgb = acc.rgb.data(), *nr = acc.nr.data(),
        *fr = acc.fr.data();
  int64_t *idx = acc.idx.data();
  const int nc = rt.n;
  Batch bt;
  uint64_t bpix[kBatch], brow[kBatch], bcol[kBatch];
  const Image *bim[kBatch];
  bool valid[kBatch];
  for (int64_t i0 = 0; i0 < n; i0 += kBatch) {
    const int m = static_cast<int>(std::min<int64_t>(kBatch, n - i0));
    // 1. rays and per-candidate routing terms (as detail::route_accept computes them)
    for (int j = 0; j < m; j++) {
      int64_t i = i0 + j;
      uint64_t pix = ring[i & (kAhead - 1)];
      if (i + kAhead < n) {
        uint64_t q = st.next();
        ring[i & (kAhead - 1)] = q;
        __builtin_prefetch(c.pixels + 3 * q);
      }
      const Image &im = c.locate(pix, brow[j], bcol[j]);
      bpix[j] = pix;
      bim[j] = &im;
      float *oc = bt.o + 3 * j, *dc = bt.d + 3 * j;
      detail::pixel_ray(im.cam, brow[j], bcol[j], oc, dc);
      double lo = im.cam[16], hi = im.cam[17];
      valid[j] = lo <= hi;
      if (rp.has_bounds && valid[j]) detail::clip_to_box(rp.bmin, rp.bmax, oc, dc, lo, hi);
      double dv[3] = {dc[0], dc[1], dc[2]};
      if (rp.dims == 2) {
        double dd = dv[0] * rp.up[0] + dv[1] * rp.up[1] + dv[2] * rp.up[2];
        for (int k = 0; k < 3; k++) dv[k] -= dd * rp.up[k];
      }
      const double *t = rt.v.data() + (&im - c.imgs.data()) * rt.stride;
      double dd = dv[0] * dv[0] + dv[1] * dv[1] + dv[2] * dv[2];
      bt.dqj[j] = dv[0] * t[0] + dv[1] * t[1] + dv[2] * t[2];
      bt.a[j] = dd * (1.0 - rp.m2);
      bt.dx[j] = dv[0]; bt.dy[j] = dv[1]; bt.dz[j] = dv[2];
      bt.lo[j] = lo; bt.hi[j] = hi; bt.t[j] = t;
    }
    // 2. the end-point shortcut over the whole batch
    if (kHasAvx2) shortcut_avx2(rp, nc, bt, m);
    else shortcut_base(rp, nc, bt, m);
    // 3. exact root-finding for the survivors, then stage the accepted rays in stream order
    for (int j = 0; j < m; j++) {
      bool ok = valid[j] && bt.in[j];
      if (valid[j] && !bt.in[j]) {
        double bs[detail::kMaxCells], cs[detail::kMaxCells];
        const double *q = bt.t[j] + 3;
        for (int k = 0; k < nc; k++, q += 4) {
          bs[k] = 2.0 * (bt.dqj[j] - rp.m2 * (bt.dx[j] * q[0] + bt.dy[j] * q[1] + bt.dz[j] * q[2]));
          cs[k] = q[3];
        }
        ok = detail::route_solve(bt.a[j], bs, cs, nc, bt.lo[j], bt.hi[j]);
      }
      const Image &im = *bim[j];
      const uint8_t *p = c.pixels + 3 * bpix[j];
      float *oc = o + 3 * cnt, *dc = d + 3 * cnt;
      oc[0] = bt.o[3 * j]; oc[1] = bt.o[3 * j + 1]; oc[2] = bt.o[3 * j + 2];
      dc[0] = bt.d[3 * j]; dc[1] = bt.d[3 * j + 1]; dc[2] = bt.d[3 * j + 2];
      rgb[3 * cnt] = kRgb.v[p[0]]; rgb[3 * cnt + 1] = kRgb.v[p[1]]; rgb[3 * cnt + 2] = kRgb.v[p[2]];
      idx[3 * cnt] = im.index; idx[3 * cnt + 1] = brow[j]; idx[3 * cnt + 2] = bcol[j];
      nr[cnt] = im.cam[16]; fr[cnt] = im.cam[17];
      pos[cnt] = static_cast<uint32_t>(i0 + j);
      cnt += ok;
    }
  }
  acc.count = cnt;
}

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
          if (mode_ == kEpoch) run_chunk<kEpoch>(caches[s], outs[s], key_, s0 + i0, i0, n);
          else run_chunk<kRandom>(caches[s], outs[s], key_, s0 + i0, i0, n);
        }, n);
      }
      consumed_out.mutable_tensor<int64_t>(s)[0] = R;
    }
    tp.RunAll();
    return;
  }

  // routed: speculative rounds of candidate blocks
  const auto &cen_in = ws.Input<CPUBackend>(3);
  // staged blocks live across runs: fresh ~1 MB buffers per block would page-fault every run
  if (!scratch_) scratch_ = std::make_shared<std::vector<Accepted>>();
  std::vector<Accepted> &blocks = *std::static_pointer_cast<std::vector<Accepted>>(scratch_);
  for (int s = 0; s < nsamples; s++) {
    const Cache &c = caches[s];
    detail::RouteParams rp = route_params(cen_in.tensor<float>(s),
                                          static_cast<int>(cen_in.tensor_shape(s)[0]));
    RouteTable rt;
    rt.init(c, rp);
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
          if (mode_ == kEpoch) eval_block<kEpoch>(c, rp, rt, key_, bs, bsz, blocks[b]);
          else eval_block<kRandom>(c, rp, rt, key_, bs, bsz, blocks[b]);
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
      // write this round's accepted rays (block b writes slots [slot, min(slot + n, R)))
      for (auto &w : round_writes) {
        int64_t b = w.first, slot = w.second;
        tp.AddWork([&, b, slot](int) {
          const Accepted &a = blocks[b];
          a.write(outs[s], slot, std::min<int64_t>(a.count, R - slot));
        }, blocks[b].count);
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
                             "(argument input allowed: one int64 per sample).", int64_t{0}, true)
    .AddOptionalArg("cell", "Cell to route to (index into `centroids`); -1: no routing.", -1)
    .AddOptionalArg("margin", "Routing margin m: keep a ray if some point p of its segment has "
                    "|p - c_cell| <= m |p - c_k| for all k.", 1.15f)
    .AddOptionalArg("up", "World up vector; with dims == 2 routing ignores this axis.",
                    std::vector<float>{0.f, 1.f, 0.f})
    .AddOptionalArg("dims", "Routing distances: 2 (perpendicular to `up`) or 3.", 2)
    .AddOptionalArg("bounds", "Routing box (min x, y, z, max x, y, z): only the part of a ray's "
                    "[near, far] segment inside it decides its cells (like Mega-NeRF's ray altitude "
                    "range); rays that miss the box keep their whole segment. Empty: no box.",
                    std::vector<float>{});
