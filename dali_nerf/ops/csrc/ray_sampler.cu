// GPU backend of the dali_nerf ray sampler (same semantics and the same bits as the CPU backend;
// see ray_sampler.h and ray_math.h).
//
// All work is issued on ws.stream(). `pixels` is a device input; `cameras`, `layout` and
// `centroids` may be device or CPU inputs (schema: MatchBackendOrCPU); `start` is a CPU argument
// input. Per run and sample, on the host: the cameras/layout (copied to the host first when they
// are device inputs: one small copy and one stream synchronisation) get the CPU backend's content
// checks (detail::check_cache) before any kernel reads a pixel; the writers' table (fill_row), the
// layout and, routed, the routing constants and table (route_consts, route_row) are built there
// and uploaded in one copy. The kernels evaluate the shared formula (row_ray, route_decide),
// compiled with -fmad=false, so rays and routing decisions are the CPU's bits.
//   * masked caches (a `valid` input, always on the host): the index is uploaded once per run
//     (about P / 5 bytes) and the streams draw valid-pixel numbers that detail::ValidIndex::select
//     maps to pixels (mask.h, the CPU's code); the per-image valid counts come from the host copy.
//   * unrouted: one thread per output ray; `consumed` (= rays) is written by thread 0.
//   * global stream (`global_pixels` > 0): the kept counts come from host floor sums; one
//     thread per chunk of 64 positions walks their slots (detail::walk_kept), a count pass +
//     cub::DeviceScan::ExclusiveSum give each chunk its first output slot, a write pass walks
//     again and writes the kept rays (level 2: detail::image_pixel, per ray) and their positions;
//     step_counts and consumed are uploaded with the tables. No stream synchronisation.
//   * routed: rounds of K candidates. Pass 1 (one thread per candidate) evaluates the routing
//     decision and stores a 0/1 flag and the pixel id; cub::DeviceScan::InclusiveSum turns the
//     flags into output slots; pass 2 writes each accepted ray to slot (accepted so far + scan - 1)
//     while that is < rays, and the thread that fills the last slot writes `consumed`. The running
//     accepted count lives on the device; after each round it is copied to pinned host memory and
//     the stream is synchronised once to decide whether another round is needed (K is sized from
//     the previous acceptance rate, so one round is the common case). Temporary buffers come from
//     DALI's DynamicScratchpad, ordered on ws.stream().
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cub/cub.cuh>
#include <string>
#include <tuple>
#include <vector>

#include "dali/core/cuda_error.h"
#include "dali/kernels/dynamic_scratchpad.h"
#include "ray_sampler.h"

namespace dali_nerf {
namespace {

using detail::kRouteStride;
using detail::kRow;

struct GpuCache {
  const uint8_t *pixels;
  const int64_t *lay;  // (N, 4): offset, width, height, camera index
  const float *tab;    // (N, kRow): detail::fill_row of each camera
  int N;
  uint64_t P;
  uint64_t n = 0;                     // stream ids: P, or the valid pixels V (masked)
  bool masked = false;
  detail::ValidIndex vi;              // masked: the index, in device memory
  const uint64_t *doffs = nullptr;    // global stream: per image its first stream id and count
  const uint64_t *dsizes = nullptr;

  /// The pixel id of stream id k: itself, or the k-th valid pixel.
  __device__ __forceinline__ uint64_t pixel_of(uint64_t k) const { return masked ? vi.select(k) : k; }
};

struct GpuOut {
  float *o, *d, *rgb, *nr, *fr;
  int64_t *idx;
};

__device__ __forceinline__ int find_image(const GpuCache &g, uint64_t pix) {
  int lo = 0, hi = g.N;  // first image whose offset is > pix, minus one
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if (static_cast<uint64_t>(g.lay[4 * mid]) <= pix) lo = mid + 1;
    else hi = mid;
  }
  return lo - 1;
}

/// The image holding stream id `id` of the global stream's domain (the last whose first id is <= id).
__device__ __forceinline__ int find_domain(const GpuCache &g, uint64_t id) {
  int lo = 0, hi = g.N;
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if (g.doffs[mid] <= id) lo = mid + 1;
    else hi = mid;
  }
  return lo - 1;
}

__device__ __forceinline__ void locate(const GpuCache &g, uint64_t pix, int &img, int64_t &row,
                                       int64_t &col) {
  img = find_image(g, pix);
  uint64_t rem = pix - static_cast<uint64_t>(g.lay[4 * img]);
  uint64_t W = static_cast<uint64_t>(g.lay[4 * img + 1]);
  row = static_cast<int64_t>(rem / W);
  col = static_cast<int64_t>(rem - row * W);
}

/// Ray i from pixel `pix`: the CPU's Outputs::write, through the same detail::row_ray.
__device__ __forceinline__ void write_ray(const GpuCache &g, const GpuOut &out, int64_t i,
                                          uint64_t pix) {
  int img;
  int64_t row, col;
  locate(g, pix, img, row, col);
  const float *t = g.tab + kRow * img;
  detail::row_ray(t, row, col, out.o + 3 * i, out.d + 3 * i);
  const uint8_t *p = g.pixels + 3 * pix;
  out.rgb[3 * i] = detail::rgb_of(p[0]);
  out.rgb[3 * i + 1] = detail::rgb_of(p[1]);
  out.rgb[3 * i + 2] = detail::rgb_of(p[2]);
  out.idx[3 * i] = g.lay[4 * img + 3];
  out.idx[3 * i + 1] = row;
  out.idx[3 * i + 2] = col;
  out.nr[i] = t[12];
  out.fr[i] = t[13];
}

__global__ void sample_kernel(GpuCache g, GpuOut out, int mode, uint64_t key, uint64_t s0,
                              int64_t R, int64_t *consumed) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i == 0) consumed[0] = R;
  if (i < R) write_ray(g, out, i, g.pixel_of(detail::stream_pixel(mode, key, s0 + i, g.n)));
}

// the split's global stream: one thread per chunk of kGlobalChunk consecutive positions walks its
// slots (detail::walk_kept, the CPU's scalar walk); the count pass and an exclusive scan give each
// chunk its first output slot, the write pass walks again and writes the kept rays there
constexpr int64_t kGlobalChunk = 64;

__global__ void global_count_kernel(detail::GlobalStream gs, uint64_t g0, uint64_t total, int64_t nchunks,
                                    uint32_t *counts) {
  int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= nchunks) return;
  uint64_t c0 = static_cast<uint64_t>(t) * kGlobalChunk;
  uint64_t n = total - c0 < kGlobalChunk ? total - c0 : kGlobalChunk;
  uint32_t k = 0;
  detail::walk_kept(gs, g0 + c0, n, [&](uint64_t, uint64_t, uint64_t) { k++; });
  counts[t] = k;
}

__global__ void global_write_kernel(GpuCache g, GpuOut out, int64_t *positions, detail::GlobalStream gs,
                                    uint64_t g0, uint64_t total, int64_t nchunks, const uint32_t *first,
                                    int64_t M) {
  int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= nchunks) return;
  uint64_t c0 = static_cast<uint64_t>(t) * kGlobalChunk;
  uint64_t n = total - c0 < kGlobalChunk ? total - c0 : kGlobalChunk;
  int64_t slot = first[t];
  detail::walk_kept(gs, g0 + c0, n, [&](uint64_t j, uint64_t q, uint64_t e) {
    if (slot < M) {  // (Setup's count of M and this walk agree; never write past the output)
      uint64_t ql = q - gs.lo;
      int img = find_domain(g, ql);
      uint64_t off = g.doffs[img], npix = g.dsizes[img];
      uint64_t pos = g0 + c0 + j;
      write_ray(g, out, slot, g.pixel_of(off + detail::image_pixel(gs, pos, e, gs.lo + off, npix, ql - off)));
      positions[slot] = static_cast<int64_t>(pos);
    }
    slot++;
  });
}

__global__ void flag_kernel(GpuCache g, const detail::RouteConsts *rc, const double *route, int mode,
                            uint64_t key, uint64_t s0, int64_t K, uint64_t *pix_out, uint32_t *flags) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= K) return;
  uint64_t pix = g.pixel_of(detail::stream_pixel(mode, key, s0 + i, g.n));
  int img;
  int64_t row, col;
  locate(g, pix, img, row, col);
  flags[i] = detail::route_decide(*rc, route + kRouteStride * img, row, col) ? 1u : 0u;
  pix_out[i] = pix;
}

__global__ void scatter_kernel(GpuCache g, GpuOut out, const uint64_t *pix, const uint32_t *flags,
                               const uint32_t *scan, int64_t K, int64_t R, const int64_t *accepted,
                               int64_t examined, int64_t *consumed) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= K || !flags[i]) return;
  int64_t slot = *accepted + static_cast<int64_t>(scan[i]) - 1;
  if (slot >= R) return;
  write_ray(g, out, slot, pix[i]);
  if (slot == R - 1) consumed[0] = examined + i + 1;
}

__global__ void advance_kernel(int64_t *accepted, const uint32_t *scan, int64_t K) {
  accepted[0] += scan[K - 1];
}

/// A masked sample's valid-pixel index (hv: its host view, checked) uploaded (queued on `stream`);
/// g.vi then points at the device copy and g.n counts the valid pixels.
void upload_valid(GpuCache &g, const uint64_t *host, uint64_t L, const detail::ValidIndex &hv,
                  ::dali::kernels::DynamicScratchpad &scratch, cudaStream_t stream) {
  uint64_t *dev = scratch.AllocateGPU<uint64_t>(L);
  CUDA_CALL(cudaMemcpyAsync(dev, host, L * sizeof(uint64_t), cudaMemcpyHostToDevice, stream));
  g.masked = true;
  g.vi = hv;  // the same layout, at the device copy
  g.vi.lines = dev;
  g.vi.before = dev + (hv.before - hv.lines);
  g.vi.samples = dev + (hv.samples - hv.lines);
  g.n = hv.V;
}

/// Per image of the cache: its first stream id and count (its pixels, or its valid pixels).
void domain_rows(const int64_t *lay, int64_t N, const detail::ValidIndex *hv, std::vector<uint64_t> &offs,
                 std::vector<uint64_t> &sizes) {
  offs.resize(N);
  sizes.resize(N);
  for (int64_t i = 0; i < N; i++) {
    uint64_t off = static_cast<uint64_t>(lay[4 * i]);
    uint64_t end = off + static_cast<uint64_t>(lay[4 * i + 1]) * static_cast<uint64_t>(lay[4 * i + 2]);
    offs[i] = hv ? hv->rank(off) : off;
    sizes[i] = (hv ? hv->rank(end) : end) - offs[i];
  }
}

inline unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

/// Host view of input `idx`'s sample s: the CPU input itself, or a host copy of the device input
/// (queued on `stream`; valid after the caller synchronises it).
template <typename T>
const T *host_view(const ::dali::Workspace &ws, int idx, int s, std::vector<T> &copy, cudaStream_t stream) {
  if (ws.InputIsType<::dali::CPUBackend>(idx)) return ws.Input<::dali::CPUBackend>(idx).tensor<T>(s);
  const auto &in = ws.Input<::dali::GPUBackend>(idx);
  copy.resize(::dali::volume(in.tensor_shape(s)));
  CUDA_CALL(cudaMemcpyAsync(copy.data(), in.tensor<T>(s), copy.size() * sizeof(T), cudaMemcpyDeviceToHost,
                            stream));
  return copy.data();
}

}  // namespace

template <>
void RaySampler<::dali::GPUBackend>::RunImpl(::dali::Workspace &ws) {
  using ::dali::GPUBackend;
  cudaStream_t stream = ws.stream();
  const auto &pix_in = ws.Input<GPUBackend>(0);
  int nsamples = pix_in.num_samples();
  const int64_t R = rays_;
  const bool routed = cell_ >= 0;
  constexpr int kThreads = 256;
  auto cam_shape = ws.GetInputShape(1);

  // host views of the small inputs: CPU inputs as they are, device inputs copied (one sync)
  std::vector<std::vector<float>> cam_copy(nsamples), cen_copy(nsamples);
  std::vector<std::vector<int64_t>> lay_copy(nsamples);
  std::vector<const float *> cams(nsamples), cens(nsamples, nullptr);
  std::vector<const int64_t *> lays(nsamples);
  bool copied = false;
  for (int s = 0; s < nsamples; s++) {
    cams[s] = host_view<float>(ws, 1, s, cam_copy[s], stream);
    lays[s] = host_view<int64_t>(ws, 2, s, lay_copy[s], stream);
    if (routed) cens[s] = host_view<float>(ws, 3, s, cen_copy[s], stream);
    copied = copied || !cam_copy[s].empty() || !lay_copy[s].empty() || !cen_copy[s].empty();
  }
  if (copied) CUDA_CALL(cudaStreamSynchronize(stream));

  for (int s = 0; s < nsamples; s++) {
    const int64_t N = cam_shape[s][0];
    const int64_t P = pix_in.tensor_shape(s)[0];
    std::string err = detail::check_cache(cams[s], lays[s], N, P);  // before any kernel reads a pixel
    DALI_ENFORCE(err.empty(), err);
    std::vector<float> tab(kRow * N);
    for (int64_t i = 0; i < N; i++) detail::fill_row(tab.data() + kRow * i, cams[s] + 18 * i, lays[s][4 * i + 3]);
    std::vector<int64_t> lay(lays[s], lays[s] + 4 * N);

    ::dali::kernels::DynamicScratchpad scratch{::dali::AccessOrder(stream)};
    GpuOut out{ws.Output<GPUBackend>(0).mutable_tensor<float>(s),
               ws.Output<GPUBackend>(1).mutable_tensor<float>(s),
               ws.Output<GPUBackend>(2).mutable_tensor<float>(s),
               ws.Output<GPUBackend>(4).mutable_tensor<float>(s),
               ws.Output<GPUBackend>(5).mutable_tensor<float>(s),
               ws.Output<GPUBackend>(3).mutable_tensor<int64_t>(s)};
    int64_t *consumed = ws.Output<GPUBackend>(6).mutable_tensor<int64_t>(s);
    uint64_t s0 = static_cast<uint64_t>(starts_[s]);
    // a masked cache: its index read on the host (checks, per-image counts), uploaded per run
    const int vidx = valid_input(ws);
    const uint64_t *vhost = vidx < 0 ? nullptr : ws.Input<::dali::CPUBackend>(vidx).tensor<uint64_t>(s);
    const uint64_t vlen = vidx < 0 ? 0 : ws.Input<::dali::CPUBackend>(vidx).tensor_shape(s)[0];
    detail::ValidIndex hv;
    if (vhost) {
      err = hv.init(vhost, vlen, static_cast<uint64_t>(P));
      DALI_ENFORCE(err.empty(), err);
    }
    auto with_mask = [&](GpuCache &g) {
      g.n = static_cast<uint64_t>(P);
      if (vhost) upload_valid(g, vhost, vlen, hv, scratch, stream);
    };

    if (global()) {
      detail::GlobalStream gs = global_stream(domain_[s]);
      const uint64_t g0 = s0, total = static_cast<uint64_t>(R);
      const int64_t M = kept_[s];
      std::array<int64_t, 1> consumed_host = {R};
      const int64_t G = step_positions_;
      std::vector<int64_t> step_counts(R / G);  // host floor sums, uploaded with the tables
      for (size_t k = 0; k < step_counts.size(); k++)
        step_counts[k] = static_cast<int64_t>(detail::count_kept(gs, g0 + k * G, static_cast<uint64_t>(G)));
      std::vector<uint64_t> doffs, dsizes;  // the stream's domain, image by image
      domain_rows(lays[s], N, vhost ? &hv : nullptr, doffs, dsizes);
      auto dev = scratch.ToContiguousGPU(stream, tab, lay, step_counts, consumed_host, doffs, dsizes);
      GpuCache g{pix_in.tensor<uint8_t>(s), std::get<1>(dev), std::get<0>(dev), static_cast<int>(N),
                 static_cast<uint64_t>(P)};
      with_mask(g);
      g.doffs = std::get<4>(dev);
      g.dsizes = std::get<5>(dev);
      const int64_t nchunks = static_cast<int64_t>((total + kGlobalChunk - 1) / kGlobalChunk);
      uint32_t *counts = scratch.AllocateGPU<uint32_t>(nchunks);
      uint32_t *first = scratch.AllocateGPU<uint32_t>(nchunks);
      size_t temp_bytes = 0;
      CUDA_CALL(cub::DeviceScan::ExclusiveSum(nullptr, temp_bytes, counts, first, static_cast<int>(nchunks), stream));
      void *temp = scratch.AllocateGPU<uint8_t>(std::max<size_t>(temp_bytes, 1), 256);
      global_count_kernel<<<blocks_for(nchunks, kThreads), kThreads, 0, stream>>>(gs, g0, total, nchunks, counts);
      CUDA_CALL(cudaGetLastError());
      CUDA_CALL(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, first, static_cast<int>(nchunks), stream));
      int64_t *positions = ws.Output<GPUBackend>(8).mutable_tensor<int64_t>(s);
      global_write_kernel<<<blocks_for(nchunks, kThreads), kThreads, 0, stream>>>(g, out, positions, gs, g0, total,
                                                                                  nchunks, first, M);
      CUDA_CALL(cudaGetLastError());
      const auto &counts_shape = ws.Output<GPUBackend>(7).tensor_shape(s);
      CUDA_CALL(cudaMemcpyAsync(ws.Output<GPUBackend>(7).mutable_tensor<int64_t>(s), std::get<2>(dev),
                                ::dali::volume(counts_shape) * sizeof(int64_t), cudaMemcpyDeviceToDevice, stream));
      CUDA_CALL(cudaMemcpyAsync(consumed, std::get<3>(dev), sizeof(int64_t), cudaMemcpyDeviceToDevice, stream));
      next_start_[s] = starts_[s] + R;
      continue;
    }

    if (!routed) {
      auto dev = scratch.ToContiguousGPU(stream, tab, lay);
      GpuCache g{pix_in.tensor<uint8_t>(s), std::get<1>(dev), std::get<0>(dev), static_cast<int>(N),
                 static_cast<uint64_t>(P)};
      with_mask(g);
      sample_kernel<<<blocks_for(R, kThreads), kThreads, 0, stream>>>(g, out, mode_, key_, s0, R, consumed);
      CUDA_CALL(cudaGetLastError());
      next_start_[s] = starts_[s] + R;
      continue;
    }

    const int C = static_cast<int>(ws.GetInputShape(3)[s][0]);
    detail::RouteParams rp = route_params(cens[s], C);
    std::array<detail::RouteConsts, 1> rc;
    detail::route_consts(rp, rc[0]);
    std::vector<double> route(kRouteStride * N);
    for (int64_t i = 0; i < N; i++) detail::route_row(rc[0], cams[s] + 18 * i, route.data() + kRouteStride * i);
    auto dev = scratch.ToContiguousGPU(stream, tab, lay, route, rc);
    GpuCache g{pix_in.tensor<uint8_t>(s), std::get<1>(dev), std::get<0>(dev), static_cast<int>(N),
               static_cast<uint64_t>(P)};
    with_mask(g);
    const double *d_route = std::get<2>(dev);
    const detail::RouteConsts *d_rc = std::get<3>(dev);

    int64_t *accepted = scratch.AllocateGPU<int64_t>(1);
    int64_t *host_accepted = scratch.AllocatePinned<int64_t>(1);
    CUDA_CALL(cudaMemsetAsync(accepted, 0, sizeof(int64_t), stream));
    int64_t cap = 0;
    uint64_t *pix = nullptr;
    uint32_t *flags = nullptr, *scan = nullptr;
    void *temp = nullptr;
    size_t temp_bytes = 0;
    int64_t examined = 0, have = 0;
    while (have < R) {
      double est = std::max(accept_estimate_, 1e-3);
      int64_t K = static_cast<int64_t>((R - have) / est * 1.1) + 1024;
      K = std::min<int64_t>(K, int64_t(1) << 26);
      if (K > cap) {  // grow the round buffers (the scratchpad frees them all at the end)
        cap = K;
        pix = scratch.AllocateGPU<uint64_t>(cap);
        flags = scratch.AllocateGPU<uint32_t>(cap);
        scan = scratch.AllocateGPU<uint32_t>(cap);
        size_t need = 0;
        CUDA_CALL(cub::DeviceScan::InclusiveSum(nullptr, need, flags, scan, static_cast<int>(cap), stream));
        if (need > temp_bytes) {
          temp_bytes = need;
          temp = scratch.AllocateGPU<uint8_t>(temp_bytes, 256);
        }
      }
      flag_kernel<<<blocks_for(K, kThreads), kThreads, 0, stream>>>(g, d_rc, d_route, mode_, key_,
                                                                    s0 + examined, K, pix, flags);
      CUDA_CALL(cudaGetLastError());
      size_t tb = temp_bytes;
      CUDA_CALL(cub::DeviceScan::InclusiveSum(temp, tb, flags, scan, static_cast<int>(K), stream));
      scatter_kernel<<<blocks_for(K, kThreads), kThreads, 0, stream>>>(g, out, pix, flags, scan, K, R,
                                                                       accepted, examined, consumed);
      CUDA_CALL(cudaGetLastError());
      advance_kernel<<<1, 1, 0, stream>>>(accepted, scan, K);
      CUDA_CALL(cudaGetLastError());
      CUDA_CALL(cudaMemcpyAsync(host_accepted, accepted, sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
      CUDA_CALL(cudaStreamSynchronize(stream));
      int64_t round = *host_accepted - have;
      have = *host_accepted;
      examined += K;
      accept_estimate_ = std::max(1e-4, static_cast<double>(round) / static_cast<double>(K));
      if (have == 0 && examined >= (int64_t(1) << 26) + 64 * R) {
        DALI_FAIL("dali_nerf ray_sampler: cell " + std::to_string(cell_) + " accepted no ray in " +
                  std::to_string(examined) + " candidates: check `centroids`, `margin` and near/far");
      }
    }
    // the host keeps where this run ended, for a next run fed `start` = -1 (continue)
    CUDA_CALL(cudaMemcpyAsync(host_accepted, consumed, sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    CUDA_CALL(cudaStreamSynchronize(stream));
    next_start_[s] = starts_[s] + *host_accepted;
  }
}

}  // namespace dali_nerf

DALI_REGISTER_OPERATOR(dali_nerf__RaySampler, ::dali_nerf::RaySampler<::dali::GPUBackend>, ::dali::GPU);
