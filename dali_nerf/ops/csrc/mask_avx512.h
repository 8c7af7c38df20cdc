// dali_nerf ray sampler: the valid-pixel index's select, 8 at a time with AVX-512 (host only).
//
// ValidIndex::select (mask.h) for 8 valid-pixel numbers per step, the same pixel ids bit for bit
// (select_in_word's broadword steps, lane by lane): the sample's two words and the line's three by
// gathers, the sample's 4 counts compared as 16-bit lanes and counted by vpsadbw, the in-byte
// select broadword too (the byte's bits spread one per byte, their prefix sums: kSelectInByte's
// values, 8 when none, without a table). Lanes whose sample is flagged sparse (a long masked
// stretch follows it, or few scattered valid pixels) search the compact counts as
// ValidIndex::line_of does, all such lanes at once. Like select, it never reads outside the index
// and always returns a pixel id < P, whatever the index holds (tests/test_op_masks.py compares the
// two on the host).
//
// Two builds of the in-line step: in_lines8 needs AVX-512 F, DQ, VL and BW (Skylake-SP, Cascade
// Lake); in_lines8_icl also BITALG, VPOPCNTDQ and VBMI (Ice Lake, Sapphire Rapids, Zen 4 and
// later), with fewer instructions (20-24% faster in a host harness, docs/MASKS.md): the line's
// 9-bit word counts spread into 16-bit lanes by vpmultishiftqb and compared at once, the word's
// byte counts by vpopcntb, the byte holding the bit by a byte compare counted with vpopcntq. The
// caller checks the features.
//
// select_batch_avx512 / _icl run it as a software pipeline over a batch: the samples of the
// selects 2 kAheadGroups groups ahead and the lines of those kAheadGroups groups ahead are
// prefetched, so a step finds both in cache (a batch's numbers are at random places of the index).
#ifndef DALI_NERF_OPS_MASK_AVX512_H_
#define DALI_NERF_OPS_MASK_AVX512_H_

#include <immintrin.h>

#include <cstdint>

#include "mask.h"

namespace dali_nerf {
namespace detail {

#define DN_SELECT512 __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))
#define DN_SELECT512_ICL __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx512bitalg,avx512vpopcntdq,avx512vbmi")))

/// The lines holding valid pixels k (live lanes; others give 0): ValidIndex::line_of lane by lane.
DN_SELECT512 inline __m512i lines_of8(const ValidIndex &vi, __m512i k, __mmask8 live) {
  const __m512i zero = _mm512_setzero_si512(), top = _mm512_set1_epi64(static_cast<int64_t>(uint64_t(1) << 63));
  const __m512i last = _mm512_set1_epi64(static_cast<int64_t>(vi.nb - 1));
  const long long *S = reinterpret_cast<const long long *>(vi.samples);
  const __m512i j2 = _mm512_slli_epi64(_mm512_srli_epi64(k, kValidSampleShift), 1);  // 2 j
  const __m512i s0 = _mm512_mask_i64gather_epi64(zero, live, j2, S, 8);
  const __m512i s1 = _mm512_mask_i64gather_epi64(zero, live, j2, S + 1, 8);
  __m512i lo = _mm512_min_epu64(_mm512_andnot_si512(top, s0), last);
  // the counts of the next 4 lines (16-bit fields of s1) that are <= r = k - 256 j (r < 256: its
  // byte into the low byte of every field, vpshufb), counted by vpsadbw (a 1 in each such field)
  const __m512i r16 = _mm512_set_epi64(static_cast<int64_t>(0x8008800880088008ull), static_cast<int64_t>(0x8000800080008000ull),
                                       static_cast<int64_t>(0x8008800880088008ull), static_cast<int64_t>(0x8000800080008000ull),
                                       static_cast<int64_t>(0x8008800880088008ull), static_cast<int64_t>(0x8000800080008000ull),
                                       static_cast<int64_t>(0x8008800880088008ull), static_cast<int64_t>(0x8000800080008000ull));
  const __m512i r = _mm512_shuffle_epi8(k, r16);
  const __m512i ones = _mm512_maskz_set1_epi16(_mm512_cmple_epu16_mask(s1, r), 1);
  lo = _mm512_add_epi64(lo, _mm512_sad_epu8(ones, zero));
  const __mmask8 sparse = _mm512_mask_test_epi64_mask(live, s0, top);
  if (sparse) {  // lanes whose sample is sparse: line_of's search of the compact counts, 8 lanes
    const long long *B = reinterpret_cast<const long long *>(vi.before);
    const __m512i one = _mm512_set1_epi64(1), four = _mm512_set1_epi64(4);
    __m512i slo = _mm512_min_epu64(_mm512_andnot_si512(top, s0), last);
    const __m512i s2 = _mm512_mask_i64gather_epi64(zero, sparse, _mm512_add_epi64(j2, _mm512_set1_epi64(2)), S, 8);
    __m512i shi = _mm512_min_epu64(_mm512_andnot_si512(top, s2), last);
    for (__mmask8 m = _mm512_mask_cmpgt_epu64_mask(sparse, shi, _mm512_add_epi64(slo, four)); m;
         m = _mm512_mask_cmpgt_epu64_mask(m, shi, _mm512_add_epi64(slo, four))) {
      const __m512i mid = _mm512_srli_epi64(_mm512_add_epi64(_mm512_add_epi64(slo, shi), one), 1);
      const __mmask8 le = _mm512_mask_cmple_epu64_mask(m, _mm512_mask_i64gather_epi64(zero, m, mid, B, 8), k);
      slo = _mm512_mask_mov_epi64(slo, le, mid);
      shi = _mm512_mask_mov_epi64(shi, m & ~le, _mm512_sub_epi64(mid, one));
    }
    __m512i cnt = zero;  // before[slo + d] <= k, d = 1..4 (4 words of V follow before[nb])
    for (int d = 1; d <= 4; d++) {
      const __m512i c = _mm512_mask_i64gather_epi64(zero, sparse, _mm512_add_epi64(slo, _mm512_set1_epi64(d)), B, 8);
      cnt = _mm512_mask_add_epi64(cnt, _mm512_mask_cmple_epu64_mask(sparse, c, k), cnt, one);
    }
    lo = _mm512_mask_mov_epi64(lo, sparse, _mm512_add_epi64(slo, cnt));
  }
  return _mm512_maskz_min_epu64(live, lo, last);
}

/// The pixel ids b 384 + 64 w + place + (the in_byte-th set bit of byte place / 8 of x), below P:
/// the end of in_lines8 and in_lines8_icl.
DN_SELECT512 inline __m512i in_byte_pixel8(const ValidIndex &vi, __m512i x, __m512i b, __m512i w, __m512i place,
                                           __m512i in_byte) {
  const __m512i zero = _mm512_setzero_si512(), msbs8 = _mm512_set1_epi64(static_cast<int64_t>(kMsbsStep8));
  // byte i of every lane <- byte 0 (vpshufb within 128-bit lanes: control 0 or 8)
  const __m512i bcast0 = _mm512_set_epi64(0x0808080808080808ll, 0, 0x0808080808080808ll, 0, 0x0808080808080808ll, 0,
                                          0x0808080808080808ll, 0);
  // the in_byte-th set bit of the byte, as kSelectInByte (8 if none): byte k of the lane holds bit
  // k of the byte (0 or 1), their prefix sums; the bytes whose prefix sum is <= in_byte, counted
  const __m512i byte = _mm512_shuffle_epi8(_mm512_srlv_epi64(x, place), bcast0);
  const __m512i bits = _mm512_min_epu8(_mm512_and_si512(byte, _mm512_set1_epi64(static_cast<int64_t>(0x8040201008040201ull))),
                                       _mm512_set1_epi8(1));
  __m512i pre = _mm512_add_epi64(bits, _mm512_slli_epi64(bits, 8));
  pre = _mm512_add_epi64(pre, _mm512_slli_epi64(pre, 16));
  pre = _mm512_add_epi64(pre, _mm512_slli_epi64(pre, 32));
  const __m512i geq_b = _mm512_and_si512(_mm512_sub_epi64(_mm512_or_si512(_mm512_shuffle_epi8(in_byte, bcast0), msbs8), pre),
                                         msbs8);
  const __m512i inb = _mm512_sad_epu8(_mm512_srli_epi64(geq_b, 7), zero);
  // b 384 + 64 w + place + the bit in the byte, below P
  __m512i pix = _mm512_add_epi64(_mm512_slli_epi64(b, 8), _mm512_slli_epi64(b, 7));
  pix = _mm512_add_epi64(pix, _mm512_add_epi64(_mm512_slli_epi64(w, 6), place));
  pix = _mm512_add_epi64(pix, inb);
  return _mm512_min_epu64(pix, _mm512_set1_epi64(static_cast<int64_t>(vi.P - 1)));
}

/// The pixel ids of valid pixels k in lines b (= lines_of8(k)): ValidIndex::in_line with
/// select_in_word, lane by lane.
DN_SELECT512 inline __m512i in_lines8(const ValidIndex &vi, __m512i k, __m512i b, __mmask8 live) {
  const __m512i zero = _mm512_setzero_si512();
  const long long *L = reinterpret_cast<const long long *>(vi.lines);
  const __m512i at = _mm512_slli_epi64(b, 3);  // 8 b: the line's first word
  const __m512i ln0 = _mm512_mask_i64gather_epi64(zero, live, at, L, 8);
  const __m512i sub = _mm512_mask_i64gather_epi64(zero, live, at, L + 1, 8);
  const __m512i r = _mm512_sub_epi64(k, ln0);
  // the word holding k: the 9-bit fields of sub <= r (uleq_step9), counted, minus 1, at most 5
  const __m512i msbs9 = _mm512_set1_epi64(static_cast<int64_t>(kMsbsStep9));
  const __m512i ones9 = _mm512_set1_epi64(static_cast<int64_t>(kOnesStep9));
  // r's 9 bits in every field (bit 63, a piece of an 8th field, is masked off below): the
  // product (r & 511) kOnesStep9 by shifts, which measured faster than vpmullq
  __m512i y = _mm512_and_si512(r, _mm512_set1_epi64(511));
  y = _mm512_or_si512(y, _mm512_slli_epi64(y, 9));
  y = _mm512_or_si512(y, _mm512_slli_epi64(y, 18));
  y = _mm512_or_si512(y, _mm512_slli_epi64(y, 36));
  const __m512i t = _mm512_sub_epi64(_mm512_or_si512(y, msbs9), _mm512_andnot_si512(msbs9, sub));
  const __m512i le = _mm512_srli_epi64(
      _mm512_and_si512(_mm512_xor_si512(_mm512_or_si512(t, _mm512_xor_si512(sub, y)), _mm512_andnot_si512(y, sub)),
                       msbs9), 8);
  const __m512i seven = _mm512_set1_epi64(7);
  __m512i w = _mm512_and_si512(_mm512_srli_epi64(_mm512_mullo_epi64(le, ones9), 54), seven);
  w = _mm512_min_epu64(_mm512_sub_epi64(w, _mm512_set1_epi64(1)), _mm512_set1_epi64(5));
  const __m512i w9 = _mm512_add_epi64(_mm512_slli_epi64(w, 3), w);
  const __m512i before_w = _mm512_and_si512(_mm512_srlv_epi64(sub, w9), _mm512_set1_epi64(511));
  const __m512i x = _mm512_mask_i64gather_epi64(zero, live, _mm512_add_epi64(at, w), L + 2, 8);
  const __m512i rw = _mm512_sub_epi64(r, before_w);  // select_in_word(x, rw), broadword
  const __m512i msbs8 = _mm512_set1_epi64(static_cast<int64_t>(kMsbsStep8));
  __m512i s = _mm512_sub_epi64(x, _mm512_and_si512(_mm512_srli_epi64(x, 1), _mm512_set1_epi64(0x5555555555555555ll)));
  const __m512i m3 = _mm512_set1_epi64(0x3333333333333333ll);
  s = _mm512_add_epi64(_mm512_and_si512(s, m3), _mm512_and_si512(_mm512_srli_epi64(s, 2), m3));
  __m512i sums = _mm512_and_si512(_mm512_add_epi64(s, _mm512_srli_epi64(s, 4)), _mm512_set1_epi64(0x0F0F0F0F0F0F0F0Fll));
  sums = _mm512_add_epi64(sums, _mm512_slli_epi64(sums, 8));  // byte i: the bits of bytes 0..i (x kOnesStep8)
  sums = _mm512_add_epi64(sums, _mm512_slli_epi64(sums, 16));
  sums = _mm512_add_epi64(sums, _mm512_slli_epi64(sums, 32));
  // byte i of every lane <- byte 0 (vpshufb within 128-bit lanes: control 0 or 8)
  const __m512i bcast0 = _mm512_set_epi64(0x0808080808080808ll, 0, 0x0808080808080808ll, 0, 0x0808080808080808ll, 0,
                                          0x0808080808080808ll, 0);
  const __m512i r6 = _mm512_shuffle_epi8(_mm512_and_si512(rw, _mm512_set1_epi64(63)), bcast0);
  const __m512i geq = _mm512_and_si512(_mm512_sub_epi64(_mm512_or_si512(r6, msbs8), sums), msbs8);
  // the bytes whose sum is <= r (their msbs, summed by vpsadbw), 8 bits each
  __m512i place = _mm512_slli_epi64(_mm512_sad_epu8(_mm512_srli_epi64(geq, 7), zero), 3);
  place = _mm512_min_epu64(place, _mm512_set1_epi64(56));
  const __m512i ff = _mm512_set1_epi64(0xFF);
  const __m512i in_byte = _mm512_and_si512(
      _mm512_sub_epi64(rw, _mm512_and_si512(_mm512_srlv_epi64(_mm512_slli_epi64(sums, 8), place), ff)), seven);
  return in_byte_pixel8(vi, x, b, w, place, in_byte);
}

/// in_lines8 with BITALG, VPOPCNTDQ and VBMI: the same pixel ids, lane by lane, for any index.
DN_SELECT512_ICL inline __m512i in_lines8_icl(const ValidIndex &vi, __m512i k, __m512i b, __mmask8 live) {
  const __m512i zero = _mm512_setzero_si512(), ff = _mm512_set1_epi64(0xFF), seven = _mm512_set1_epi64(7);
  const long long *L = reinterpret_cast<const long long *>(vi.lines);
  const __m512i at = _mm512_slli_epi64(b, 3);  // 8 b: the line's first word
  const __m512i ln0 = _mm512_mask_i64gather_epi64(zero, live, at, L, 8);
  const __m512i sub = _mm512_mask_i64gather_epi64(zero, live, at, L + 1, 8);
  const __m512i r = _mm512_sub_epi64(k, ln0);
  // the word holding k: sub's 9-bit fields 0..3 and 4..6 as 16-bit lanes (vpmultishiftqb takes the
  // bytes at bits 9 i and 9 i + 8, then & 0x1FF), those <= r & 511 counted (as uleq_step9's count),
  // minus 1, at most 5
  const __m512i f03 = _mm512_and_si512(
      _mm512_multishift_epi64_epi8(_mm512_set1_epi64(static_cast<int64_t>(0x231B1A1211090800ull)), sub),
      _mm512_set1_epi16(0x1FF));
  const __m512i f46 = _mm512_and_si512(
      _mm512_multishift_epi64_epi8(_mm512_set1_epi64(static_cast<int64_t>(0x00003E36352D2C24ull)), sub),
      _mm512_set1_epi16(0x1FF));
  // r & 511 into every 16-bit lane of its 64-bit lane (vpshufb within 128-bit lanes)
  const __m512i bc16 = _mm512_set_epi64(0x0908090809080908ll, 0x0100010001000100ll, 0x0908090809080908ll,
                                        0x0100010001000100ll, 0x0908090809080908ll, 0x0100010001000100ll,
                                        0x0908090809080908ll, 0x0100010001000100ll);
  const __m512i r9 = _mm512_shuffle_epi8(_mm512_and_si512(r, _mm512_set1_epi64(511)), bc16);
  const __m512i one16 = _mm512_set1_epi16(1);
  __m512i cnt = _mm512_maskz_mov_epi16(_mm512_cmple_epu16_mask(f03, r9), one16);
  cnt = _mm512_mask_add_epi16(cnt, _mm512_mask_cmple_epu16_mask(0x77777777u, f46, r9), cnt, one16);
  const __m512i w = _mm512_min_epu64(_mm512_sub_epi64(_mm512_sad_epu8(cnt, zero), _mm512_set1_epi64(1)),
                                     _mm512_set1_epi64(5));
  const __m512i w9 = _mm512_add_epi64(_mm512_slli_epi64(w, 3), w);
  const __m512i before_w = _mm512_and_si512(_mm512_srlv_epi64(sub, w9), _mm512_set1_epi64(511));
  const __m512i x = _mm512_mask_i64gather_epi64(zero, live, _mm512_add_epi64(at, w), L + 2, 8);
  const __m512i rw = _mm512_sub_epi64(r, before_w);  // select_in_word(x, rw)
  // byte i: the bits of bytes 0..i (vpopcntb, then prefix sums); the byte holding bit rw & 63: the
  // bytes whose sum is <= it, counted 8 bits each by vpopcntq of their 0xFF bytes, at most 56
  const __m512i pc = _mm512_popcnt_epi8(x);
  __m512i sums = _mm512_add_epi64(pc, _mm512_slli_epi64(pc, 8));
  sums = _mm512_add_epi64(sums, _mm512_slli_epi64(sums, 16));
  sums = _mm512_add_epi64(sums, _mm512_slli_epi64(sums, 32));
  const __m512i bcast0 = _mm512_set_epi64(0x0808080808080808ll, 0, 0x0808080808080808ll, 0, 0x0808080808080808ll, 0,
                                          0x0808080808080808ll, 0);
  const __m512i r6 = _mm512_shuffle_epi8(_mm512_and_si512(rw, _mm512_set1_epi64(63)), bcast0);
  const __m512i place = _mm512_min_epu64(_mm512_popcnt_epi64(_mm512_movm_epi8(_mm512_cmple_epu8_mask(sums, r6))),
                                         _mm512_set1_epi64(56));
  const __m512i in_byte = _mm512_and_si512(
      _mm512_sub_epi64(rw, _mm512_and_si512(_mm512_srlv_epi64(_mm512_slli_epi64(sums, 8), place), ff)), seven);
  return in_byte_pixel8(vi, x, b, w, place, in_byte);
}

/// The live lanes of group g (selects 8 g .. 8 g + 7) of a batch of n.
inline __mmask8 live_of8(int64_t g, int64_t n) {
  const int64_t left = n - 8 * g;
  return left >= 8 ? __mmask8(0xFF) : static_cast<__mmask8>((1u << left) - 1);
}

/// Prefetches the samples of group g's selects.
inline void prefetch_samples8(const ValidIndex &vi, const uint64_t *in, int64_t g, int64_t n) {
  const int64_t e = n - 8 * g < 8 ? n - 8 * g : 8;
  for (int64_t i = 0; i < e; i++) __builtin_prefetch(vi.samples + 2 * (in[8 * g + i] >> kValidSampleShift));
}

/// Finds group g's lines into slot and prefetches them.
DN_SELECT512 inline void prefetch_lines8(const ValidIndex &vi, const uint64_t *in, int64_t g, int64_t n,
                                         uint64_t *slot) {
  const __mmask8 live = live_of8(g, n);
  _mm512_store_si512(slot, lines_of8(vi, _mm512_maskz_loadu_epi64(live, in + 8 * g), live));
  const int64_t e = n - 8 * g < 8 ? n - 8 * g : 8;
  for (int64_t i = 0; i < e; i++) __builtin_prefetch(vi.lines + 8 * slot[i]);
}

// out[i] = vi.select(in[i]) for i < n (in may be out; every in[i] < vi.V, as select needs), by
// IN_LINES, the lines kAheadGroups groups ahead and the samples twice that.
#define DN_SELECT_BATCH(NAME, ATTR, IN_LINES)                                                           \
  template <int64_t kAheadGroups>                                                                        \
  ATTR inline void NAME(const ValidIndex &vi, const uint64_t *in, uint64_t *out, int64_t n) {            \
    const int64_t G = (n + 7) / 8;                                                                       \
    alignas(64) uint64_t ring[kAheadGroups][8];                                                          \
    for (int64_t g = 0; g < 2 * kAheadGroups && g < G; g++) prefetch_samples8(vi, in, g, n);             \
    for (int64_t g = 0; g < kAheadGroups && g < G; g++) prefetch_lines8(vi, in, g, n, ring[g % kAheadGroups]); \
    for (int64_t g = 0; g < G; g++) {                                                                    \
      const __mmask8 live = live_of8(g, n);                                                              \
      const __m512i k = _mm512_maskz_loadu_epi64(live, in + 8 * g);                                     \
      const __m512i b = _mm512_load_si512(ring[g % kAheadGroups]);                                       \
      if (g + 2 * kAheadGroups < G) prefetch_samples8(vi, in, g + 2 * kAheadGroups, n);                  \
      if (g + kAheadGroups < G) prefetch_lines8(vi, in, g + kAheadGroups, n, ring[g % kAheadGroups]);    \
      _mm512_mask_storeu_epi64(out + 8 * g, live, IN_LINES(vi, k, b, live));                             \
    }                                                                                                    \
  }

DN_SELECT_BATCH(select_batch_avx512_t, DN_SELECT512, in_lines8)
DN_SELECT_BATCH(select_batch_avx512_icl_t, DN_SELECT512_ICL, in_lines8_icl)
#undef DN_SELECT_BATCH

/// The 8-lane select with AVX-512 F/DQ/VL/BW, the lines 16 selects ahead (2 groups) and the samples
/// 32: 1 and 4 groups ahead measured no faster (2026-12-07, a Xeon VM with AVX-512; docs/MASKS.md).
inline void select_batch_avx512(const ValidIndex &vi, const uint64_t *in, uint64_t *out, int64_t n) {
  select_batch_avx512_t<2>(vi, in, out, n);
}

/// The 8-lane select with BITALG, VPOPCNTDQ and VBMI too, the lines 32 selects ahead (4 groups):
/// its shorter step measured faster with the lines further ahead (2 groups: 5.2 ns a select, 4:
/// 4.4, on a 16-million-pixel index; 2026-12-07, docs/MASKS.md).
inline void select_batch_avx512_icl(const ValidIndex &vi, const uint64_t *in, uint64_t *out, int64_t n) {
  select_batch_avx512_icl_t<4>(vi, in, out, n);
}

#undef DN_SELECT512
#undef DN_SELECT512_ICL

}  // namespace detail
}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_MASK_AVX512_H_
