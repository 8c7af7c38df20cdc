// dali_nerf ray sampler: the valid-pixel index of a masked cache, for both backends.
//
// A cache whose images carry masks feeds the op one more input, `valid` (L,) uint64, built once
// at decode by dali_nerf.data.masks.valid_index: a bit per pixel in 64-byte lines that also carry
// their rank directory, a compact copy of the lines' counts and select samples, so the k-th valid
// pixel is found in O(1) without a table of 4-8 bytes per pixel: one 16-byte sample gives the
// line (it holds the counts of the next 4 lines), then one 64-byte line gives the pixel.
// With P pixels, nb = ceil(P / 384) lines of 384 pixels (6 words) and V valid pixels,
// ns = ceil(V / 256):
//   [0, 8 (nb + 1))               lines, 8 words each: [0] the valid pixels before the line, [1]
//                                 the valid pixels of its words 0..k-1 for k = 0..5 (9-bit fields,
//                                 field k at bit 9 k: field 0 is 0; field 6 holds 511), [2..7] the
//                                 bits (bit j of word w: pixel 384 b + 64 w + j is valid; 0 past
//                                 P); then one sentinel line whose [0] is V;
//   [8 (nb + 1), 9 nb + 13)       before: each line's [0] again (before[nb] = V), contiguous, then
//                                 4 more words of V (a count past the last line never counts);
//   [9 nb + 13, + 2 (ns + 1))     samples, 2 words each: sample j < ns: [0] the line lo of valid
//                                 pixel 256 j, bit 63 set when the next sample's line is more than
//                                 4 lines further (sparse valid pixels); [1] for d = 1..4 the valid
//                                 pixels before line lo + d minus 256 j, at most 65535, 16 bits each
//                                 (field d at bit 16 (d - 1)); sample ns: [0] the line of the last
//                                 valid pixel (0 when V = 0), [1] 0.
// L = 9 nb + 13 + 2 (ns + 1) (about 1.5 bits a pixel + 0.5 a valid pixel). The streams draw a
// valid-pixel number k in [0, V) (the unmasked formulas with V for P) and select(k) gives its
// pixel id; unmasked caches skip all of this (no input, the same streams and bits as before).
// select never reads outside the index and always returns a pixel id < P, whatever the index
// holds; an index that does not describe its bits (not built by valid_index) selects wrong pixels.
// The CPU selects a batch at a time, each line found and prefetched a few selects ahead
// (select_batch): 8 lanes at a time with AVX-512 (mask_avx512.h), else one by one with BMI2's pdep
// for the in-word select where it is fast.
#ifndef DALI_NERF_OPS_MASK_H_
#define DALI_NERF_OPS_MASK_H_

#include <cstdint>
#include <string>

#include "hd.h"

namespace dali_nerf {
namespace detail {

constexpr uint64_t kLinePixels = 384;  // pixels per index line (6 words of bits)
constexpr int kValidSampleShift = 8;    // a select sample every 256 valid pixels
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
  const uint64_t *lines = nullptr, *before = nullptr, *samples = nullptr;
  uint64_t P = 0, V = 0, nb = 0, ns = 0;

  /// Words the index of a cache of P pixels and V valid ones has.
  DN_HD static uint64_t length(uint64_t P, uint64_t V) {
    uint64_t nb = (P + kLinePixels - 1) / kLinePixels, ns = (V + 255) >> kValidSampleShift;
    return 9 * nb + 13 + 2 * (ns + 1);
  }

  /// The view of `data` (L words) for a cache of P pixels; "" or a one-line error when the shape is
  /// not an index's (V read from the sentinel line: 0 <= V <= P, L = length(P, V)).
  std::string init(const uint64_t *data, uint64_t L, uint64_t P_) {
    P = P_;
    nb = (P + kLinePixels - 1) / kLinePixels;
    if (L < 9 * nb + 14)
      return "dali_nerf ray_sampler: `valid` has " + std::to_string(L) + " words, too few for the valid-pixel "
             "index of " + std::to_string(P) + " pixels: build it with dali_nerf.data.masks.valid_index";
    lines = data;
    V = lines[8 * nb];
    if (V > P || lines[0] != 0 || data[9 * nb + 8] != V || data[9 * nb + 12] != V)
      return "dali_nerf ray_sampler: `valid` is not a valid-pixel index (it counts " + std::to_string(V) +
             " valid pixels of " + std::to_string(P) + "): build it with dali_nerf.data.masks.valid_index";
    ns = (V + 255) >> kValidSampleShift;
    if (L != length(P, V))
      return "dali_nerf ray_sampler: `valid` has " + std::to_string(L) + " words but an index of " +
             std::to_string(V) + " valid pixels of " + std::to_string(P) + " has " + std::to_string(length(P, V)) +
             ": build it with dali_nerf.data.masks.valid_index";
    before = lines + 8 * (nb + 1);
    samples = before + nb + 5;
    return "";
  }

  /// The line holding valid pixel k (k < V): from its sample j = k / 256 (the line lo of valid
  /// pixel 256 j), lo + the number of the next 4 lines that start at or before k (their counts are
  /// in the sample: one 16-byte read, no branch); a sample flagged sparse (the next sample's line
  /// more than 4 lines further) searches the compact counts instead (`before` is nondecreasing and
  /// every line after the next sample's starts past k).
  DN_HD uint64_t line_of(uint64_t k) const {
    const uint64_t j = k >> kValidSampleShift, last = nb - 1;
    const uint64_t s0 = samples[2 * j], s1 = samples[2 * j + 1];
    uint64_t lo = s0 & ~(uint64_t(1) << 63);
    lo = lo > last ? last : lo;
    if (s0 >> 63) {  // sparse valid pixels between the samples
      uint64_t hi = samples[2 * j + 2] & ~(uint64_t(1) << 63);
      hi = hi > last ? last : hi;
      while (hi > lo + 4) {
        const uint64_t mid = (lo + hi + 1) >> 1;
        if (before[mid] <= k) lo = mid;
        else hi = mid - 1;
      }
      const uint64_t *c = before + lo;  // before[lo + 4] exists: 4 words of V follow before[nb]
      lo += (c[1] <= k) + (c[2] <= k) + (c[3] <= k) + (c[4] <= k);
    } else {
      const uint64_t r = k & ((uint64_t(1) << kValidSampleShift) - 1);  // k - 256 j
      lo += ((s1 & 0xFFFF) <= r) + (((s1 >> 16) & 0xFFFF) <= r) + (((s1 >> 32) & 0xFFFF) <= r) + ((s1 >> 48) <= r);
    }
    return lo > last ? last : lo;  // a no-op on an index valid_index built; keeps any other in bounds
  }

  /// The pixel id of valid pixel k in line b (= line_of(k)); `sw` selects in a word
  /// (select_in_word, or the host's pdep).
  template <class SelectWord>
  DN_HD uint64_t in_line(uint64_t k, uint64_t b, SelectWord sw) const {
    const uint64_t *ln = lines + 8 * b;
    const uint64_t r = k - ln[0], sub = ln[1];
    // the fields <= r (field 0 always): the word holding k is their count - 1
    uint64_t w = (((uleq_step9(sub, (r & 511) * kOnesStep9) * kOnesStep9) >> 54) & 7) - 1;
    w = w > 5 ? 5 : w;
    const uint64_t before_w = (sub >> (9 * w)) & 511;
    const uint64_t pix = b * kLinePixels + (w << 6) + static_cast<uint64_t>(sw(ln[2 + w], r - before_w));
    return pix < P ? pix : P - 1;
  }

  /// The pixel id of valid pixel k (k < V), in increasing order of k.
  DN_HD uint64_t select(uint64_t k) const {
    return in_line(k, line_of(k), [](uint64_t x, uint64_t r) { return select_in_word(x, r); });
  }

  /// Valid pixels before pixel id p (p <= P); host only (the per-image counts, once per run).
  uint64_t rank(uint64_t p) const {
    if (p >= P) return V;
    const uint64_t b = p / kLinePixels, w = (p % kLinePixels) >> 6;
    const uint64_t *ln = lines + 8 * b;
    const uint64_t before_w = (ln[1] >> (9 * w)) & 511;
    const uint64_t part = ln[2 + w] & ((uint64_t(1) << (p & 63)) - 1);
    return ln[0] + before_w + static_cast<uint64_t>(__builtin_popcountll(part));
  }

  /// Is pixel p valid (p < P).
  DN_HD bool valid(uint64_t p) const {
    return (lines[8 * (p / kLinePixels) + 2 + ((p % kLinePixels) >> 6)] >> (p & 63)) & 1;
  }
};

}  // namespace detail
}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_MASK_H_
