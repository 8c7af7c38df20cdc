// dali_nerf ray sampler, CPU backend: the global stream's slot walks (see walk.h).
#include "walk.h"

#include <immintrin.h>

#include "streams.h"

namespace dali_nerf {
namespace cpu {

uint64_t walk_scalar(uint64_t &q, uint64_t a, uint64_t P, uint64_t lo, uint64_t hi, uint64_t len, uint32_t *js,
                     uint64_t *qs, int cap, int &m) {
  const uint64_t n = hi - lo;
  uint64_t j = 0, s = q;
  int k = m;
  for (; j < len && k < cap; j++) {  // branch-free: the slot is recorded, then kept or overwritten
    js[k] = static_cast<uint32_t>(j);
    qs[k] = s;
    k += (s - lo < n);
    s += a;
    s -= s >= P ? P : 0;
  }
  q = s;
  m = k;
  return j;
}

__attribute__((target("avx2"))) uint64_t walk_avx2(uint64_t &q, uint64_t a, uint64_t P, uint64_t lo, uint64_t hi,
                                                   uint64_t len, uint32_t *js, uint64_t *qs, int cap, int &m) {
  uint64_t j = 0;
  int k = m;
  if (len >= 8 && k + 4 <= cap) {
    // lane l holds the slot of position j + l; 4 positions on is + (4 a mod P) mod P. Every value
    // is below 2 P <= 2^63, so the signed 64-bit compares are exact.
    uint64_t s[4] = {q, 0, 0, 0};
    for (int l = 1; l < 4; l++) s[l] = s[l - 1] + a >= P ? s[l - 1] + a - P : s[l - 1] + a;
    const uint64_t a4 = (4 * a) % P;  // a < 2^62
    __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(s));
    const __m256i step = _mm256_set1_epi64x(static_cast<int64_t>(a4));
    const __m256i pv = _mm256_set1_epi64x(static_cast<int64_t>(P));
    const __m256i pm1 = _mm256_set1_epi64x(static_cast<int64_t>(P) - 1);
    const __m256i lom1 = _mm256_set1_epi64x(static_cast<int64_t>(lo) - 1);
    const __m256i hiv = _mm256_set1_epi64x(static_cast<int64_t>(hi));
    for (; j + 4 <= len && k + 4 <= cap; j += 4) {
      __m256i in = _mm256_and_si256(_mm256_cmpgt_epi64(qv, lom1), _mm256_cmpgt_epi64(hiv, qv));
      int mask = _mm256_movemask_pd(_mm256_castsi256_pd(in));
      if (mask) {
        alignas(32) uint64_t t[4];
        _mm256_store_si256(reinterpret_cast<__m256i *>(t), qv);
        do {
          int l = __builtin_ctz(static_cast<unsigned>(mask));
          js[k] = static_cast<uint32_t>(j + l);
          qs[k] = t[l];
          k++;
          mask &= mask - 1;
        } while (mask);
      }
      qv = _mm256_add_epi64(qv, step);
      qv = _mm256_sub_epi64(qv, _mm256_and_si256(_mm256_cmpgt_epi64(qv, pm1), pv));
    }
    q = static_cast<uint64_t>(_mm256_extract_epi64(qv, 0));
  }
  int k0 = k;
  uint64_t done = walk_scalar(q, a, P, lo, hi, len - j, js, qs, cap, k);
  for (int i = k0; i < k; i++) js[i] += static_cast<uint32_t>(j);
  m = k;
  return j + done;
}

Returns first_returns(uint64_t a, uint64_t P, uint64_t n, uint64_t limit) {
  Returns r;
  if (n < 2 || n > P / 2) return r;  // (n <= P / 2: the two displacements come from different j)
  bool f1 = false, f2 = false;
  uint64_t d = 0;
  for (uint64_t j = 1; j <= limit && j < P && !(f1 && f2); j++) {
    d += a;
    if (d >= P) d -= P;
    if (!f1 && d < n) { r.g1 = j; r.e1 = d; f1 = true; }
    if (!f2 && P - d < n) { r.g2 = j; r.e2 = P - d; f2 = true; }
  }
  r.ok = f1 && f2;
  return r;
}

uint64_t walk_jump(uint64_t &q, uint64_t a, uint64_t P, uint64_t lo, uint64_t hi, uint64_t len, uint32_t *js,
                   uint64_t *qs, int cap, int &m, const Returns &r) {
  const uint64_t n = hi - lo;
  uint64_t j = 0, s = q;
  int k = m;
  while (j < len && s - lo >= n) {  // to the first kept position (at most one return time away)
    s += a;
    s -= s >= P ? P : 0;
    j++;
  }
  if (j == len || k >= cap) {
    q = s;
    m = k;
    return j;
  }
  uint64_t x = s - lo;  // the kept slot's offset in [lo, hi)
  while (true) {
    js[k] = static_cast<uint32_t>(j);
    qs[k] = lo + x;
    k++;
    // The next kept position. A return j has |displacement| < n, so j >= g1 (forward) or j >= g2
    // (backward). g1 on (+e1) if that stays below hi; else g2 on (-e2) if that stays at or above
    // lo (never both: e1 + e2 >= n, or g2 - g1 or g1 - g2 would be an earlier return); else
    // g1 + g2 on (+e1 - e2), which lands in [lo, hi), and nothing earlier does: a forward j in
    // (g1, g1 + g2) moves by >= e1 (else j - g1 < g2 moves back by < n), a backward j in
    // (g2, g1 + g2) by >= e2 (symmetrically).
    const bool up = x + r.e1 < n, down = x >= r.e2;
    uint64_t step, nx;
    if (up) {
      step = r.g1; nx = x + r.e1;
    } else if (down) {
      step = r.g2; nx = x - r.e2;
    } else {
      step = r.g1 + r.g2; nx = x + r.e1 - r.e2;
    }
    if (k == cap || j + step >= len) {  // stop after position j (full), or at the end
      uint64_t stop = k == cap && j + 1 < len ? j + 1 : len;
      uint64_t t = detail::mulmod64(a, (stop - j) % P, P) + lo + x;
      q = t >= P ? t - P : t;
      m = k;
      return stop;
    }
    j += step;
    x = nx;
  }
}

}  // namespace cpu
}  // namespace dali_nerf
