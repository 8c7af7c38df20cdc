// dali_nerf ray sampler: the streams, stream position -> pixel id, for both backends.
//   random: a counter-based hash of (key, s), uniform over [0, P);
//   epoch:  a keyed Feistel bijection of [0, P) per block of P positions (cycle-walking, no
//           permutation table).
// The key of a stream (stream_key) mixes every argument that must give a different stream.
// The split's global stream (`global_pixels` > 0; ARCHITECTURE.md "The operator", "Global
// stream"): global position g -> a slot of a Weyl sequence (level 1, stratified over the split's
// images) -> a pixel of the slot's image (level 2); a cache keeps the positions whose slot lies in
// its pixel range. The per-position formula is DN_HD (GPU kernels, CPU level 2); the counts of kept
// positions (floor sums) and the Weyl multiplier are host-only.
#ifndef DALI_NERF_OPS_STREAMS_H_
#define DALI_NERF_OPS_STREAMS_H_

#include <algorithm>
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

// ------------------------------------------------------------------ the split's global stream
// Split of P pixels (images i in split order, pixel ids = row-major concatenation, image i at
// offset off_i with n_i pixels). Global position g >= 0: epoch e = g / P, h = g % P;
//   slot   q = (a h + b_e) mod P,  a = weyl_multiplier(P) (~0.618 P, bounded partial quotients),
//                                  b_e = epoch_shift(key, e, P);
//   image  i with off_i <= q < off_i + n_i, t = q - off_i;
//   epoch  pixel = off_i + EpochPerm(image_key(key, off_i), e, n_i)(t);
//   random pixel = off_i + random_pixel(key, g, n_i).
// h -> q is a bijection of [0, P) per epoch and so is t -> pixel per image: every pixel once per
// epoch. A cache holding the split's pixels [lo, lo + n) keeps the positions whose slot is there.

constexpr uint64_t kGlobalSalt = 0x1F83D9ABFB41BD6Bull;
constexpr uint64_t kShiftSalt = 0x5BE0CD19137E2179ull;
constexpr uint64_t kImageSalt = 0x510E527FADE682D1ull;
constexpr uint64_t kMaxGlobalPixels = uint64_t(1) << 62;  // q + a < 2^63: signed 64-bit lanes

/// Key of the global stream: the seed and the mode alone (no rank, no world size).
DN_HD uint64_t global_key(int64_t seed, int mode) { return mix64(stream_key(seed, 0, 1, mode) + kGlobalSalt); }

/// x * y mod m for x, y < m <= 2^62 by double-and-add (every sum stays below 2m <= 2^63): the
/// device's mulmod64 (no 128-bit division there); tested against the host's on the host.
DN_HD uint64_t mulmod64_add(uint64_t x, uint64_t y, uint64_t m) {
  uint64_t r = 0;
  while (y) {
    if (y & 1) { r += x; if (r >= m) r -= m; }
    x += x; if (x >= m) x -= m;
    y >>= 1;
  }
  return r;
}

/// x * y mod m for x, y < m <= 2^62 (exact on both sides).
DN_HD uint64_t mulmod64(uint64_t x, uint64_t y, uint64_t m) {
#ifdef __CUDA_ARCH__
  return mulmod64_add(x, y, m);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(x) * y) % m);
#endif
}

/// b_e: the slot of position e * P (the epoch's shift of the Weyl sequence), uniform in [0, P).
DN_HD uint64_t epoch_shift(uint64_t key, uint64_t e, uint64_t P) {
  return mulhi64(mix64(key ^ mix64(e + kShiftSalt)), P);
}

/// Key of the per-image bijections of the image at global pixel offset `off`.
DN_HD uint64_t image_key(uint64_t key, uint64_t off) { return mix64(key ^ mix64(off + kImageSalt)); }

/// What a cache's global stream needs: the key, the split's P and Weyl multiplier a, the cache's
/// slot range [lo, lo + n) (its global pixel range) and the mode.
struct GlobalStream {
  uint64_t key, P, a, lo, n;
  int mode;
};

/// Slot of global position g.
DN_HD uint64_t global_slot(const GlobalStream &gs, uint64_t g) {
  uint64_t q = mulmod64(gs.a, g % gs.P, gs.P) + epoch_shift(gs.key, g / gs.P, gs.P);
  return q >= gs.P ? q - gs.P : q;
}

/// Level 2: the pixel offset inside the image (global offset `off`, n pixels) of slot offset t at
/// global position g of epoch e.
DN_HD uint64_t image_pixel(const GlobalStream &gs, uint64_t g, uint64_t e, uint64_t off, uint64_t n,
                           uint64_t t) {
  if (gs.mode == kEpoch) {
    EpochPerm perm;
    perm.init(image_key(gs.key, off), e, n);
    return perm(t);
  }
  return random_pixel(gs.key, g, n);
}

/// Slots of positions g, g + 1, ... in order: one add and compare per position (q += a mod P),
/// a new shift at each epoch boundary.
struct SlotCursor {
  uint64_t key, P, a, e, h, q;

  DN_HD void init(const GlobalStream &gs, uint64_t g) {
    key = gs.key; P = gs.P; a = gs.a;
    e = g / P; h = g % P;
    q = global_slot(gs, g);
  }

  DN_HD void next() {
    if (++h == P) {
      h = 0; e++;
      q = epoch_shift(key, e, P);
    } else {
      q += a;
      if (q >= P) q -= P;
    }
  }
};

/// The kept positions of [g0, g0 + len) in order: emit(j, q, e) for position g0 + j, its slot q
/// and its epoch e (one GPU thread's chunk; the CPU's scalar walk is the same sequence).
template <class Emit>
DN_HD void walk_kept(const GlobalStream &gs, uint64_t g0, uint64_t len, Emit &&emit) {
  SlotCursor c;
  c.init(gs, g0);
  for (uint64_t j = 0; j < len; j++) {
    if (c.q - gs.lo < gs.n) emit(j, c.q, c.e);
    c.next();
  }
}

// host only: the multiplier and the counts of kept positions

/// a: near P (sqrt(5) - 1) / 2 (a0 = floor((isqrt(5 P^2) - P + 1) / 2), the nearest integer), coprime
/// with P and with every partial quotient of the continued fraction of P / a at most B: the first
/// such a of a0, a0 + 1, a0 - 1, a0 + 2, ... inside [1, P) and |a - a0| < min(P, 2^16), for
/// B = 5, 10, 20, ... (0 for P = 1). Bounded partial quotients bound the discrepancy of every
/// window of the Weyl sequence (a h mod P): the nearest coprime integer alone does not (P = 1016,
/// a = 629: P / a = [1; 1, 1, 1, 1, 2, 48], and windows of 185 positions missed a 35-pixel range).
inline uint64_t weyl_multiplier(uint64_t P) {
  if (P <= 1) return 0;
  using u128 = unsigned __int128;
  u128 x = u128(5) * P * P;
  u128 r = static_cast<u128>(__builtin_sqrtl(static_cast<long double>(x)));
  while (r * r > x) r--;
  while ((r + 1) * (r + 1) <= x) r++;
  const uint64_t a0 = static_cast<uint64_t>((r - P + 1) / 2);
  auto worst_quotient = [P](uint64_t a) {  // 0 when gcd(a, P) > 1
    uint64_t u = P, v = a, m = 0;
    while (v) {
      uint64_t q = u / v, t = u - q * v;
      m = std::max(m, q);
      u = v; v = t;
    }
    return u == 1 ? m : uint64_t(0);
  };
  const uint64_t radius = std::min<uint64_t>(P, uint64_t(1) << 16);
  for (uint64_t B = 5;; B *= 2) {
    for (uint64_t d = 0; d < radius; d++) {
      uint64_t m;
      if (a0 + d < P && (m = worst_quotient(a0 + d)) && m <= B) return a0 + d;
      if (d > 0 && a0 > d && (m = worst_quotient(a0 - d)) && m <= B) return a0 - d;
    }
  }
}

/// sum_{j < n} floor((a j + b) / m) (the Euclid-like floor sum; exact in 128 bits for the op's
/// ranges: n < 2^32, m, a <= 2^62, b < 2^64).
inline unsigned __int128 floor_sum(unsigned __int128 n, unsigned __int128 m, unsigned __int128 a,
                                   unsigned __int128 b) {
  unsigned __int128 ans = 0;
  while (true) {
    if (a >= m) { ans += n * (n - 1) / 2 * (a / m); a %= m; }
    if (b >= m) { ans += n * (b / m); b %= m; }
    unsigned __int128 y = a * n + b;
    if (y < m) break;
    n = y / m;
    b = y % m;
    unsigned __int128 t = m; m = a; a = t;
  }
  return ans;
}

/// How many positions of [g0, g0 + len) the cache keeps, in O(log P) per partial epoch: within an
/// epoch the slots are (q0 + a j) mod P, and [r < x] = floor(y / P) - floor((y + P - x) / P) + 1
/// for y = q0 + a j, r = y mod P, 0 <= x <= P; a whole epoch keeps exactly n.
inline uint64_t count_kept(const GlobalStream &gs, uint64_t g0, uint64_t len) {
  const uint64_t P = gs.P, hi = gs.lo + gs.n;
  uint64_t total = 0;
  while (len > 0) {
    uint64_t h = g0 % P;
    if (h == 0 && len >= P) {  // whole epochs
      uint64_t whole = len / P;
      total += whole * gs.n;
      g0 += whole * P;
      len -= whole * P;
      continue;
    }
    uint64_t seg = std::min<uint64_t>(len, P - h);
    uint64_t q0 = global_slot(gs, g0);
    total += static_cast<uint64_t>(floor_sum(seg, P, gs.a, q0 + P - gs.lo) - floor_sum(seg, P, gs.a, q0 + P - hi));
    g0 += seg;
    len -= seg;
  }
  return total;
}

}  // namespace detail
}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_STREAMS_H_
