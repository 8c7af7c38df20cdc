// dali_nerf ray sampler: the streams, stream position s -> pixel id, for both backends.
//   random: a counter-based hash of (key, s), uniform over [0, P);
//   epoch:  a keyed Feistel bijection of [0, P) per block of P positions (cycle-walking, no
//           permutation table).
// The key of a stream (stream_key) mixes every argument that must give a different stream.
#ifndef DALI_NERF_OPS_STREAMS_H_
#define DALI_NERF_OPS_STREAMS_H_

#include <cstdint>

#include "hd.h"

namespace dali_nerf {

enum SampleMode : int { kRandom = 0, kEpoch = 1 };

namespace detail {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr int kFeistelRounds = 4;

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

/// Pixel id of stream position s (one position at a time: the GPU's one thread per candidate).
DN_HD uint64_t stream_pixel(int mode, uint64_t key, uint64_t s, uint64_t P) {
  if (mode == kEpoch) {
    EpochPerm perm;
    perm.init(key, s / P, P);
    return perm(s % P);
  }
  return random_pixel(key, s, P);
}

/// Pixel ids of stream positions s0, s0+1, ... in order (the CPU's sequential walk: one
/// division at construction only); the same ids as stream_pixel.
template <int Mode>
struct Stream;

template <>
struct Stream<kRandom> {
  uint64_t key, P, s;
  Stream(uint64_t key_, uint64_t P_, uint64_t s0) : key(key_), P(P_), s(s0) {}
  inline uint64_t next() { return random_pixel(key, s++, P); }
};

template <>
struct Stream<kEpoch> {
  uint64_t key, P, e, j;
  EpochPerm perm;
  Stream(uint64_t key_, uint64_t P_, uint64_t s0) : key(key_), P(P_), e(s0 / P_), j(s0 % P_) {
    perm.init(key, e, P);
  }
  inline uint64_t next() {
    if (j == P) { j = 0; e++; perm.init(key, e, P); }
    return perm(j++);
  }
};

}  // namespace detail
}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_STREAMS_H_
