// dali_nerf ray sampler, CPU backend: the split's global stream (`global_pixels` > 0).
//
// A chunk of global positions is walked slot by slot (streams.h SlotCursor's sequence: q += a mod
// P, one add and compare per position; walk_avx2 does 4 positions per step, the same kept
// positions as walk_scalar, tested), the kept ones (slot inside the cache's pixel range) get their
// pixel (level 2: the slot's image, then its per-(image, epoch) bijection or the random hash) and
// their rays are written by writer.h's write_pixels, in position order, to consecutive output slots.
#ifndef DALI_NERF_OPS_GLOBAL_H_
#define DALI_NERF_OPS_GLOBAL_H_

#include <cstdint>

#include "streams.h"
#include "writer.h"

namespace dali_nerf {
namespace cpu {

/// Walks at most `len` positions from slot `q` (updated to the slot after the last one walked),
/// recording the kept ones (slot in [lo, hi)) as (offset from the first, slot) in js/qs from
/// index m (updated) until m == cap. Returns how many positions it walked. js, qs: cap + 4 entries.
uint64_t walk_scalar(uint64_t &q, uint64_t a, uint64_t P, uint64_t lo, uint64_t hi, uint64_t len, uint32_t *js,
                     uint64_t *qs, int cap, int &m);

/// walk_scalar, 4 positions per step with AVX2 (the same results; needs the CPU's AVX2).
uint64_t walk_avx2(uint64_t &q, uint64_t a, uint64_t P, uint64_t lo, uint64_t hi, uint64_t len, uint32_t *js,
                   uint64_t *qs, int cap, int &m);

/// Writes the rays of the kept positions of [g0, g0 + len), in order, to output slots
/// [slot, slot + limit) and their global positions to `positions`; returns how many positions it
/// kept (== limit unless the counts disagree, which the caller reports; nothing is written past
/// slot + limit).
int64_t run_global_chunk(const Cache &c, const Outputs &out, int64_t *positions, const detail::GlobalStream &gs,
                         uint64_t g0, uint64_t len, int64_t slot, int64_t limit, bool simd);

}  // namespace cpu
}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_GLOBAL_H_
