// GPU backend of the dali_nerf ray sampler (same semantics as the CPU backend; see ray_sampler.h).
//
// All work is issued on ws.stream(). Inputs (pixels, cameras, layout, centroids) are device
// tensors; `start` is a CPU argument input.
//   * unrouted: one thread per output ray; `consumed` (= rays) is written by thread 0.
//   * routed: rounds of K candidates. Pass 1 (one thread per candidate) evaluates the routing
//     predicate and stores a 0/1 flag and the pixel id; cub::DeviceScan::InclusiveSum turns the
//     flags into output slots; pass 2 writes each accepted ray to slot (accepted so far + scan - 1)
//     while that is < rays, and the thread that fills the last slot writes `consumed`. The running
//     accepted count lives on the device; after each round it is copied to pinned host memory and
//     the stream is synchronised once to decide whether another round is needed (K is sized from
//     the previous acceptance rate, so one round is the common case). Temporary buffers come from
//     DALI's DynamicScratchpad, ordered on ws.stream().
#include <cuda_runtime.h>

#include <algorithm>
#include <cub/cub.cuh>

#include "dali/core/cuda_error.h"
#include "dali/kernels/dynamic_scratchpad.h"
#include <vector>

#include "ray_sampler.h"

namespace dali_nerf {
namespace {

using detail::EpochPerm;
using detail::RouteParams;

struct GpuCache {
  const uint8_t *pixels;
  const float *cams;    // (N, 18)
  const int64_t *lay;   // (N, 4)
  int N;
  uint64_t P;
};

struct GpuOut {
  float *o, *d, *rgb, *nr, *fr;
  int64_t *idx;
};

__device__ __forceinline__ uint64_t stream_pixel(int mode, uint64_t key, uint64_t s, uint64_t P) {
  if (mode == kEpoch) {
    EpochPerm perm;
    perm.init(key, s / P, P);
    return perm(s % P);
  }
  return detail::random_pixel(key, s, P);
}

__device__ __forceinline__ int find_image(const GpuCache &g, uint64_t pix) {
  int lo = 0, hi = g.N;  // first image whose offset is > pix, minus one
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if (static_cast<uint64_t>(g.lay[4 * mid]) <= pix) lo = mid + 1;
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

__device__ __forceinline__ void write_ray(const GpuCache &g, const GpuOut &out, int64_t i,
                                          uint64_t pix) {
  int img;
  int64_t row, col;
  locate(g, pix, img, row, col);
  const float *cam = g.cams + 18 * img;
  detail::pixel_ray(cam, row, col, out.o + 3 * i, out.d + 3 * i);
  const uint8_t *p = g.pixels + 3 * pix;
  out.rgb[3 * i] = static_cast<float>(p[0]) / 255.f;
  out.rgb[3 * i + 1] = static_cast<float>(p[1]) / 255.f;
  out.rgb[3 * i + 2] = static_cast<float>(p[2]) / 255.f;
  out.idx[3 * i] = g.lay[4 * img + 3];
  out.idx[3 * i + 1] = row;
  out.idx[3 * i + 2] = col;
  out.nr[i] = cam[16];
  out.fr[i] = cam[17];
}

__global__ void sample_kernel(GpuCache g, GpuOut out, int mode, uint64_t key, uint64_t s0,
                              int64_t R, int64_t *consumed) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i == 0) consumed[0] = R;
  if (i < R) write_ray(g, out, i, stream_pixel(mode, key, s0 + i, g.P));
}

__global__ void flag_kernel(GpuCache g, RouteParams rp, int mode, uint64_t key, uint64_t s0,
                            int64_t K, uint64_t *pix_out, uint32_t *flags) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= K) return;
  uint64_t pix = stream_pixel(mode, key, s0 + i, g.P);
  int img;
  int64_t row, col;
  locate(g, pix, img, row, col);
  const float *cam = g.cams + 18 * img;
  float o[3], d[3];
  detail::pixel_ray(cam, row, col, o, d);
  flags[i] = detail::route_accept(rp, o, d, cam[16], cam[17]) ? 1u : 0u;
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

inline unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace

template <>
void RaySampler<::dali::GPUBackend>::RunImpl(::dali::Workspace &ws) {
  using ::dali::GPUBackend;
  cudaStream_t stream = ws.stream();
  const auto &pix_in = ws.Input<GPUBackend>(0);
  const auto &cam_in = ws.Input<GPUBackend>(1);
  const auto &lay_in = ws.Input<GPUBackend>(2);
  int nsamples = pix_in.num_samples();
  const int64_t R = rays_;
  constexpr int kThreads = 256;
  for (int s = 0; s < nsamples; s++) {
    GpuCache g{pix_in.tensor<uint8_t>(s), cam_in.tensor<float>(s), lay_in.tensor<int64_t>(s),
               static_cast<int>(cam_in.tensor_shape(s)[0]),
               static_cast<uint64_t>(pix_in.tensor_shape(s)[0])};
    GpuOut out{ws.Output<GPUBackend>(0).mutable_tensor<float>(s),
               ws.Output<GPUBackend>(1).mutable_tensor<float>(s),
               ws.Output<GPUBackend>(2).mutable_tensor<float>(s),
               ws.Output<GPUBackend>(4).mutable_tensor<float>(s),
               ws.Output<GPUBackend>(5).mutable_tensor<float>(s),
               ws.Output<GPUBackend>(3).mutable_tensor<int64_t>(s)};
    int64_t *consumed = ws.Output<GPUBackend>(6).mutable_tensor<int64_t>(s);
    uint64_t s0 = static_cast<uint64_t>(starts_[s]);

    if (cell_ < 0) {
      sample_kernel<<<blocks_for(R, kThreads), kThreads, 0, stream>>>(g, out, mode_, key_, s0, R,
                                                                      consumed);
      CUDA_CALL(cudaGetLastError());
      next_start_[s] = starts_[s] + R;
      continue;
    }

    const auto &cen_in = ws.Input<GPUBackend>(3);
    // the few centroids are projected on the host into RouteParams (passed by value to kernels)
    const int C = static_cast<int>(cen_in.tensor_shape(s)[0]);
    std::vector<float> host_centroids(3 * static_cast<size_t>(C));
    CUDA_CALL(cudaMemcpyAsync(host_centroids.data(), cen_in.tensor<float>(s), host_centroids.size() * sizeof(float),
                              cudaMemcpyDeviceToHost, stream));
    CUDA_CALL(cudaStreamSynchronize(stream));
    RouteParams rp = route_params(host_centroids.data(), C);
    ::dali::kernels::DynamicScratchpad scratch{::dali::AccessOrder(stream)};
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
      flag_kernel<<<blocks_for(K, kThreads), kThreads, 0, stream>>>(g, rp, mode_, key_, s0 + examined,
                                                                    K, pix, flags);
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
