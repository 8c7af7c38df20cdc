// dali_nerf ray sampler: the one macro that makes a function callable from both backends.
// nvcc compiles the shared headers (streams.h, ray_math.h) for the host and the device; g++ sees
// plain inline functions. Built with `-fmad=false` (nvcc) and without -mfma (g++), so no a * b + c
// is contracted into a fused multiply-add: the host and the device round every operation alike
// and give the same bits (ARCHITECTURE.md, "The operator").
#ifndef DALI_NERF_OPS_HD_H_
#define DALI_NERF_OPS_HD_H_

#include <cstdint>

#ifdef __CUDACC__
#define DN_HD __host__ __device__ __forceinline__
#else
#define DN_HD inline __attribute__((always_inline))
#endif

namespace dali_nerf {
namespace detail {

/// IEEE square roots (correctly rounded on both sides: nvcc's default -prec-sqrt=true).
DN_HD double dn_sqrt(double x) {
#ifdef __CUDA_ARCH__
  return sqrt(x);
#else
  return __builtin_sqrt(x);
#endif
}

DN_HD float dn_sqrtf(float x) {
#ifdef __CUDA_ARCH__
  return sqrtf(x);
#else
  return __builtin_sqrtf(x);
#endif
}

/// A quiet NaN (marks an empty ray segment: every comparison with it is false).
DN_HD double dn_nan() {
#ifdef __CUDA_ARCH__
  return __longlong_as_double(0x7FF8000000000000LL);
#else
  return __builtin_nan("");
#endif
}

}  // namespace detail
}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_HD_H_
