// dali_nerf ray sampler, CPU backend: the split's global stream (see global.h).
#include "global.h"

#include <algorithm>
#include <vector>

namespace dali_nerf {
namespace cpu {

namespace {

/// Per image: its bijection of the current epoch (built on first use in this chunk).
struct ImagePerm {
  uint64_t epoch = ~uint64_t(0);
  detail::EpochPerm perm;
};

/// pix[i] = offs[i] + perm_i(pix[i]) for i < n (perm_i = *which[i]: EpochPerm's cycle-walk, the same
/// values), kLanes walks at a time: each pass runs one Feistel evaluation of every walk in flight
/// (independent chains, so the core overlaps them) and a walk that lands inside its image leaves
/// its lane to the next ray. Evaluated one ray at a time, the walk's data-dependent exit (about 40%
/// of the evaluations of a 160,000-pixel image go round again) serialises the chains.
void epoch_pixels(uint64_t *pix, const uint64_t *offs, const detail::EpochPerm *const *which,
                  int n) {
  constexpr int kLanes = 8;
  int lane_ray[kLanes];
  uint64_t x[kLanes];
  int live = 0, next = 0;
  while (live < kLanes && next < n) {
    lane_ray[live] = next;
    x[live++] = pix[next++];
  }
  while (live > 0) {
    for (int l = 0; l < live; l++) x[l] = which[lane_ray[l]]->feistel(x[l]);
    for (int l = 0; l < live;) {
      const int r = lane_ray[l];
      if (x[l] >= which[r]->P) { l++; continue; }  // goes round again
      pix[r] = offs[r] + x[l];
      if (next < n) {  // the lane takes the next ray
        lane_ray[l] = next;
        x[l] = pix[next++];
        l++;
      } else {  // the last lane in flight moves here
        --live;
        lane_ray[l] = lane_ray[live];
        x[l] = x[live];
      }
    }
  }
}

}  // namespace

Returns global_jumps(const detail::GlobalStream &gs) {
  if (gs.n > gs.P / 4) return Returns{};
  return first_returns(gs.a, gs.P, gs.n, uint64_t(1) << 24);
}

int64_t run_global_chunk(const Cache &c, const Outputs &out, int64_t *positions, const detail::GlobalStream &gs,
                         uint64_t g0, uint64_t len, int64_t slot, int64_t limit, bool simd, const Returns *jumps,
                         uint64_t step_begin, uint64_t G, int64_t *tally) {
  uint64_t step_end = step_begin + G;  // the end of the step the next kept position is counted in
  constexpr int kCap = 1024;  // kept positions per batch: level 2, then one write_pixels call
  uint32_t js[kCap + 4];
  uint64_t qs[kCap + 4], pix[kCap + 4], offs[kCap + 4];
  const detail::EpochPerm *which[kCap + 4];
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
      if (jumps && jumps->ok) walked += walk_jump(q, gs.a, P, gs.lo, hi, seg - walked, js, qs, kCap, m, *jumps);
      else if (avx2) walked += walk_avx2(q, gs.a, P, gs.lo, hi, seg - walked, js, qs, kCap, m);
      else walked += walk_scalar(q, gs.a, P, gs.lo, hi, seg - walked, js, qs, kCap, m);
      for (int i = 0; i < m; i++) {  // the steps' tallies (positions increase)
        uint64_t pos = base + js[i];
        while (pos >= step_end) { step_end += G; tally++; }
        ++*tally;
      }
      int w = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(m, limit - kept)));
      // level 2: the slot's image, then the pixel inside it (random: a keyed hash; epoch: the
      // image's bijection, walked for several rays at a time by epoch_pixels)
      for (int i = 0; i < w; i++) {
        uint64_t ql = qs[i] - gs.lo, pos = base + js[i];
        size_t img = c.image_of(ql);
        const Image &im = c.imgs[img];
        uint64_t t = ql - im.off, n = im.W * im.H;
        if (gs.mode == kEpoch) {  // t now, its pixel by epoch_pixels
          ImagePerm &ip = perms[img];
          if (ip.epoch != e) {
            ip.perm.init(detail::image_key(gs.key, gs.lo + im.off), e, n);
            ip.epoch = e;
          }
          pix[i] = t;
          offs[i] = im.off;
          which[i] = &ip.perm;
        } else {
          pix[i] = im.off + detail::random_pixel(gs.key, pos, n);
        }
        positions[slot + kept + i] = static_cast<int64_t>(pos);
      }
      if (gs.mode == kEpoch) epoch_pixels(pix, offs, which, w);
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
