// dali_nerf ray sampler, CPU backend: the split's global stream (see global.h).
#include "global.h"

#include <algorithm>
#include <vector>

#include <immintrin.h>

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

namespace {

/// Per image: its bijection of the current epoch (built on first use in this chunk).
struct ImagePerm {
  uint64_t epoch = ~uint64_t(0);
  detail::EpochPerm perm;
};

}  // namespace

int64_t run_global_chunk(const Cache &c, const Outputs &out, int64_t *positions, const detail::GlobalStream &gs,
                         uint64_t g0, uint64_t len, int64_t slot, int64_t limit, bool simd) {
  constexpr int kCap = 1024;  // kept positions per batch: level 2, then one write_pixels call
  uint32_t js[kCap + 4];
  uint64_t qs[kCap + 4], pix[kCap + 4];
  std::vector<ImagePerm> perms(gs.mode == kEpoch ? c.imgs.size() : 0);
  const bool avx2 = simd && kHasAvx2;
  const uint64_t P = gs.P, hi = gs.lo + gs.n;
  int64_t kept = 0;
  uint64_t g = g0, left = len;
  while (left > 0) {  // one epoch at a time
    const uint64_t e = g / P, seg = std::min<uint64_t>(left, P - g % P);
    uint64_t q = detail::global_slot(gs, g), walked = 0;
    while (walked < seg) {
      int m = 0;
      uint64_t base = g + walked;
      walked += avx2 ? walk_avx2(q, gs.a, P, gs.lo, hi, seg - walked, js, qs, kCap, m)
                     : walk_scalar(q, gs.a, P, gs.lo, hi, seg - walked, js, qs, kCap, m);
      int w = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(m, limit - kept)));
      for (int i = 0; i < w; i++) {  // level 2: the slot's image, then the pixel inside it
        uint64_t ql = qs[i] - gs.lo, pos = base + js[i];
        size_t img = c.image_of(ql);
        const Image &im = c.imgs[img];
        uint64_t t = ql - im.off, n = im.W * im.H;
        if (gs.mode == kEpoch) {
          ImagePerm &ip = perms[img];
          if (ip.epoch != e) {
            ip.perm.init(detail::image_key(gs.key, gs.lo + im.off), e, n);
            ip.epoch = e;
          }
          pix[i] = im.off + ip.perm(t);
        } else {
          pix[i] = im.off + detail::random_pixel(gs.key, pos, n);
        }
        positions[slot + kept + i] = static_cast<int64_t>(pos);
      }
      write_pixels(c, out, pix, slot + kept, w, simd);
      kept += m;
    }
    g += seg;
    left -= seg;
  }
  return kept;
}

}  // namespace cpu
}  // namespace dali_nerf
