// dali_nerf ray sampler, CPU backend: the split's global stream (`global_pixels` > 0).
//
// A chunk of global positions is walked (walk.h: every position, scalar or AVX2, where the cache
// holds more than a quarter of the split's pixels; else from kept position to kept position), the
// kept ones (slot inside the cache's pixel range) get their pixel (level 2: the slot's image, then
// its per-(image, epoch) bijection or the random hash) and their rays are written by writer.h's
// write_pixels, in position order, to consecutive output slots.
#ifndef DALI_NERF_OPS_GLOBAL_H_
#define DALI_NERF_OPS_GLOBAL_H_

#include <cstdint>

#include "streams.h"
#include "walk.h"
#include "writer.h"

namespace dali_nerf {
namespace cpu {

/// Writes the rays of the kept positions of [g0, g0 + len), in order, to output slots
/// [slot, slot + limit) and their global positions to `positions`; returns how many positions it
/// kept (== limit unless the counts disagree, which the caller reports; nothing is written past
/// slot + limit). jumps: the cache's first-return times (walk_jump), or null (walk every position).
/// Adds the kept positions of each step (G positions from step_begin, the first step the chunk
/// overlaps) to tally[0], tally[1], ...
int64_t run_global_chunk(const Cache &c, const Outputs &out, int64_t *positions, const detail::GlobalStream &gs,
                         uint64_t g0, uint64_t len, int64_t slot, int64_t limit, bool simd, const Returns *jumps,
                         uint64_t step_begin, uint64_t G, int64_t *tally);

/// The first-return times run_global_chunk walks with for a cache of n of the split's P pixels:
/// found when the cache holds at most a quarter of them (below that, testing every position with
/// AVX2 costs about what a jump does), else ok = false.
Returns global_jumps(const detail::GlobalStream &gs);

}  // namespace cpu
}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_GLOBAL_H_
