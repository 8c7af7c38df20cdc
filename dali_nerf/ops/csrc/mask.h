// dali_nerf ray sampler: the valid-pixel index of a masked cache, for both backends.
//
// A cache whose images carry masks feeds the op one more input, `valid` (L,) uint64, built once
// at decode by dali_nerf.data.masks.valid_index; it is a bit per pixel plus a small directory, so
// the k-th valid pixel is found in O(1) (a sampled block, a binary search over the few blocks
// between two samples, a broadword select) without a table of 4-8 bytes per pixel. With P pixels,
// nb = ceil(P / 512) blocks of 512 pixels (8 words) and V valid pixels, ns = ceil(V / 256):
//   [0, 8 nb)                 bits: bit j of word w = pixel 64 w + j is valid (0 past P);
//   [8 nb, 10 nb + 2)         dir: per block b <= nb, dir[2 b] = valid pixels before block b
//                             (dir[2 nb] = V) and dir[2 b + 1] = the valid pixels of words 0..k-1
//                             of the block for k = 1..7, 9 bits each (field k at bit 9 (k - 1));
//   [10 nb + 2, 10 nb + ns + 3) sel: sel[j] = the block of valid pixel 256 j (j < ns), sel[ns] =
//                             the block of the last valid pixel.
// L = 10 nb + ns + 3 (about 1.3 bits a pixel). The streams draw a valid-pixel number k in [0, V)
// (the unmasked formulas with V for P) and select(k) gives its pixel id; unmasked caches skip
// this entirely (no input, the same streams and bits as before).
// select never reads outside the index and always returns a pixel id < P, whatever the index
// holds; an index that does not describe its bits (not built by valid_index) selects wrong pixels.
#ifndef DALI_NERF_OPS_MASK_H_
#define DALI_NERF_OPS_MASK_H_

#include <cstdint>
#include <string>

#include "hd.h"

namespace dali_nerf {
namespace detail {

constexpr int kValidBlockShift = 9;   // 512 pixels (8 words) a block
constexpr int kValidSampleShift = 8;  // a select sample every 256 valid pixels
constexpr uint64_t kOnesStep9 = 1ull << 0 | 1ull << 9 | 1ull << 18 | 1ull << 27 | 1ull << 36 | 1ull << 45 | 1ull << 54;
constexpr uint64_t kMsbsStep9 = kOnesStep9 << 8;
constexpr uint64_t kOnesStep8 = 0x0101010101010101ull;
constexpr uint64_t kMsbsStep8 = 0x8080808080808080ull;

/// Per 9-bit field (7 fields): 1 where field(x) <= field(y), at the field's lowest bit (Vigna's
/// ULEQ_STEP_9 of rank9/select9, exact for any 9-bit fields).
DN_HD uint64_t uleq_step9(uint64_t x, uint64_t y) {
  return ((((((y | kMsbsStep9) - (x & ~kMsbsStep9)) | (x ^ y)) ^ (x & ~y)) & kMsbsStep9) >> 8);
}

#ifndef __CUDA_ARCH__
/// kSelectInByte[r << 8 | v]: the position of the r-th (from 0) set bit of byte v; 8 if none.
struct SelectInByte {
  uint8_t v[8 * 256];
  constexpr SelectInByte() : v() {
    for (int r = 0; r < 8; r++)
      for (int b = 0; b < 256; b++) {
        int seen = 0, at = 8;
        for (int i = 0; i < 8; i++)
          if ((b >> i) & 1) {
            if (seen == r) { at = i; break; }
            seen++;
          }
        v[(r << 8) | b] = static_cast<uint8_t>(at);
      }
  }
};
inline constexpr SelectInByte kSelectInByte{};
#endif

/// Position (0..7) of the r-th (from 0) set bit of byte v, 8 if none: clearing the lowest set bit
/// r times (the device's way; the host reads kSelectInByte, the same values: tested).
DN_HD int select_in_byte_loop(uint64_t v, uint64_t r) {
  for (uint64_t i = 0; i < r; i++) v &= v - 1;
#ifdef __CUDA_ARCH__
  return v ? __ffsll(static_cast<long long>(v)) - 1 : 8;
#else
  return v ? __builtin_ffsll(static_cast<long long>(v)) - 1 : 8;
#endif
}

/// Position (0..63) of the r-th (from 0) set bit of x; r < popcount(x). Otherwise some value in
/// [0, 64] (never a read out of bounds). Broadword byte sums (no popcount instruction needed),
/// then the byte's table on the host, its bits one by one on the device.
DN_HD int select_in_word(uint64_t x, uint64_t r) {
  uint64_t s = x - ((x >> 1) & 0x5555555555555555ull);
  s = (s & 0x3333333333333333ull) + ((s >> 2) & 0x3333333333333333ull);
  const uint64_t sums = ((s + (s >> 4)) & 0x0F0F0F0F0F0F0F0Full) * kOnesStep8;  // byte i: bits of bytes 0..i
  const uint64_t geq = (((r & 63) * kOnesStep8 | kMsbsStep8) - sums) & kMsbsStep8;  // byte i: r >= its sum
  int place = static_cast<int>((((geq >> 7) * kOnesStep8) >> 56) * 8);
  place = place > 56 ? 56 : place;
  const uint64_t in_byte = (r - (((sums << 8) >> place) & 0xFF)) & 7;
  const uint64_t byte = (x >> place) & 0xFF;
#ifdef __CUDA_ARCH__
  return place + select_in_byte_loop(byte, in_byte);
#else
  return place + kSelectInByte.v[(in_byte << 8) | byte];
#endif
}

/// The valid-pixel index of one cache (a view of the `valid` input; see the top of this file).
struct ValidIndex {
  const uint64_t *bits = nullptr, *dir = nullptr, *sel = nullptr;
  uint64_t P = 0, V = 0, nb = 0, ns = 0;

  /// Words the index of a cache of P pixels and V valid ones has.
  DN_HD static uint64_t length(uint64_t P, uint64_t V) {
    uint64_t nb = (P + 511) >> kValidBlockShift, ns = (V + 255) >> kValidSampleShift;
    return 10 * nb + ns + 3;
  }

  /// The view of `data` (L words) for a cache of P pixels; "" or a one-line error when the shape is
  /// not an index's (V read from the directory: 0 <= V <= P, L = length(P, V)).
  std::string init(const uint64_t *data, uint64_t L, uint64_t P_) {
    P = P_;
    nb = (P + 511) >> kValidBlockShift;
    if (L < 10 * nb + 3)
      return "dali_nerf ray_sampler: `valid` has " + std::to_string(L) + " words, too few for the valid-pixel "
             "index of " + std::to_string(P) + " pixels: build it with dali_nerf.data.masks.valid_index";
    bits = data;
    dir = data + 8 * nb;
    V = dir[2 * nb];
    if (V > P || dir[0] != 0)
      return "dali_nerf ray_sampler: `valid` is not a valid-pixel index (it counts " + std::to_string(V) +
             " valid pixels of " + std::to_string(P) + "): build it with dali_nerf.data.masks.valid_index";
    ns = (V + 255) >> kValidSampleShift;
    if (L != length(P, V))
      return "dali_nerf ray_sampler: `valid` has " + std::to_string(L) + " words but an index of " +
             std::to_string(V) + " valid pixels of " + std::to_string(P) + " has " + std::to_string(length(P, V)) +
             ": build it with dali_nerf.data.masks.valid_index";
    sel = dir + 2 * nb + 2;
    return "";
  }

  /// The pixel id of valid pixel k (k < V), in increasing order of k.
  DN_HD uint64_t select(uint64_t k) const {
    const uint64_t j = k >> kValidSampleShift, last = nb - 1;
    uint64_t lo = sel[j], hi = sel[j + 1];
    lo = lo > last ? last : lo;
    hi = hi > last ? last : hi;
    while (lo < hi) {  // the last block b in [lo, hi] with dir[2 b] <= k: the one holding k
      const uint64_t mid = (lo + hi + 1) >> 1;
      if (dir[2 * mid] <= k) lo = mid;
      else hi = mid - 1;
    }
    const uint64_t r = k - dir[2 * lo], sub = dir[2 * lo + 1];
    const uint64_t w = ((uleq_step9(sub, (r & 511) * kOnesStep9) * kOnesStep9) >> 54) & 7;  // the word
    const uint64_t before = w ? (sub >> (9 * (w - 1))) & 511 : 0;
    const uint64_t pix = (lo << kValidBlockShift) + (w << 6) +
                         static_cast<uint64_t>(select_in_word(bits[8 * lo + w], r - before));
    return pix < P ? pix : P - 1;
  }

  /// Valid pixels before pixel id p (p <= P); host only (the per-image counts, once per run).
  uint64_t rank(uint64_t p) const {
    if (p >= P) return V;
    const uint64_t b = p >> kValidBlockShift, w = (p >> 6) & 7;
    const uint64_t before = w ? (dir[2 * b + 1] >> (9 * (w - 1))) & 511 : 0;
    const uint64_t part = bits[p >> 6] & ((uint64_t(1) << (p & 63)) - 1);
    return dir[2 * b] + before + static_cast<uint64_t>(__builtin_popcountll(part));
  }

  /// Is pixel p valid (p < P).
  DN_HD bool valid(uint64_t p) const { return (bits[p >> 6] >> (p & 63)) & 1; }
};

}  // namespace detail
}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_MASK_H_
