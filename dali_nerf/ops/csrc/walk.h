// dali_nerf ray sampler, CPU backend: the global stream's slot walks, position by position or
// from one kept position to the next.
//
// Inside one epoch the slots of consecutive positions are q, q + a, q + 2a, ... (mod P); a cache
// keeps the positions whose slot lies in its pixel range [lo, hi). walk_scalar and walk_avx2 test
// every position (one add and compare each; 4 a step with AVX2); walk_jump goes from a kept
// position straight to the next (O(1) per kept position, whatever P / (hi - lo)): in a rotation
// of Z_P by a, the first return to an arc of n points takes one of three values g1, g2, g1 + g2
// (first_returns: g1 the least j >= 1 with a j mod P in [1, n), displacement +e1; g2 the least
// with P - (a j mod P) in [1, n), displacement -e2; the proof is in walk_jump's comments). All
// three record the same positions (tested against each other and the definition).
// No DALI dependency: tests/test_op_global.py compiles this file alone.
#ifndef DALI_NERF_OPS_WALK_H_
#define DALI_NERF_OPS_WALK_H_

#include <cstdint>

namespace dali_nerf {
namespace cpu {

/// Walks at most `len` positions from slot `q` (updated to the slot of the first position not
/// walked), recording the kept ones (slot in [lo, hi)) as (offset from the first, slot) in js/qs
/// from index m (updated) until m == cap. Returns how many positions it walked. js, qs: cap + 4
/// entries; m < cap on entry.
uint64_t walk_scalar(uint64_t &q, uint64_t a, uint64_t P, uint64_t lo, uint64_t hi, uint64_t len, uint32_t *js,
                     uint64_t *qs, int cap, int &m);

/// walk_scalar, 4 positions per step with AVX2 (the same results; needs the CPU's AVX2).
uint64_t walk_avx2(uint64_t &q, uint64_t a, uint64_t P, uint64_t lo, uint64_t hi, uint64_t len, uint32_t *js,
                   uint64_t *qs, int cap, int &m);

/// The first-return times of the arc of n points under q -> q + a (mod P): g1 (displacement
/// +e1 < n) and g2 (displacement -e2, e2 < n). ok = false when 2 <= n <= P / 2 does not hold or
/// they are not found within `limit` positions (then walk every position).
struct Returns {
  uint64_t g1 = 0, e1 = 0, g2 = 0, e2 = 0;
  bool ok = false;
};

Returns first_returns(uint64_t a, uint64_t P, uint64_t n, uint64_t limit);

/// walk_scalar's results, jumping from kept position to kept position with `r`
/// (= first_returns(a, P, hi - lo, ...), r.ok).
uint64_t walk_jump(uint64_t &q, uint64_t a, uint64_t P, uint64_t lo, uint64_t hi, uint64_t len, uint32_t *js,
                   uint64_t *qs, int cap, int &m, const Returns &r);

}  // namespace cpu
}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_WALK_H_
