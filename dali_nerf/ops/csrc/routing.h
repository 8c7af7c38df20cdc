// dali_nerf ray sampler, CPU backend: routing tables, the tile map and the decision pass.
//
// The decision of every candidate is detail::route_decide's (ray_math.h): the decision pass runs
// the same stage functions over batches of candidates (structure of arrays, vertical SIMD), and
// the tile map decides a tile's rays only where it proves route_decide's answer (tested: the rays
// emitted with and without tiles, with and without AVX2, are the same).
#ifndef DALI_NERF_OPS_ROUTING_H_
#define DALI_NERF_OPS_ROUTING_H_

#include <cstdint>
#include <vector>

#include "dali/pipeline/util/thread_pool.h"
#include "ray_math.h"
#include "writer.h"

namespace dali_nerf {
namespace cpu {

constexpr int64_t kBlock = 16384;  // routed: candidates per speculative block

/// One speculative block's accepted candidates, in stream order: their offsets inside the block
/// and their pixel ids (the rest of the rays is written later, straight into the output).
struct Accepted {
  int64_t count = 0;
  std::vector<uint32_t> pos;
  std::vector<uint64_t> pix;

  void reserve(int64_t n) {
    if (static_cast<int64_t>(pos.size()) >= n) return;
    pos.resize(n); pix.resize(n);
  }
};

/// The per-call constants (detail::RouteConsts) and one detail::route_row per image of the cache.
struct RouteTable : detail::RouteConsts {
  std::vector<double> img;  // detail::kRouteStride doubles per image

  void init(const Cache &c, const detail::RouteParams &rp) {
    detail::route_consts(rp, *this);
    img.assign(c.imgs.size() * detail::kRouteStride, 0.0);
    for (size_t i = 0; i < c.imgs.size(); i++)
      detail::route_row(*this, c.imgs[i].cam, img.data() + i * detail::kRouteStride);
  }
};

/// Per-image tile classification for routing (CPU), built once per cache and routing setup. A
/// tile of S x S pixels is kAccept when every ray through it provably meets the cell, kReject
/// when every ray provably misses it, kMixed otherwise (those rays get the exact per-ray test).
/// Proof: the tile's unit directions lie in the cone spanned by its four corner pixels'
/// directions, so the point at distance t of any of its rays lies in a ball of radius
/// r = t * chord around the point at distance t of the tile's central direction (chord = the
/// largest distance from that direction to a corner's); over a ball B(x, r),
/// f_k = |p - c_j|^2 - m^2 |p - c_k|^2 lies in
/// [f_k(x) - |grad| r + min(0, 1 - m^2) r^2, f_k(x) + |grad| r + max(0, 1 - m^2) r^2].
/// At kTileSamples distances t_i from near to far: accept when at one t_i every f_k < 0 over the
/// ball; reject (m >= 1, so each f_k is concave along every ray) when every piece [t_i, t_i+1]
/// has one f_k > 0 over the balls at both of its ends. The bounds must hold with a margin eps far
/// above rounding, so a classified ray gets the decision the per-ray test gives it. With a
/// routing box, only tiles whose end-point balls lie inside the box are classified (their
/// segments are not clipped). Squares of 8 x 8 tiles are tried first and split while undecided.
struct TileMap {
  int shift = -1;               // log2 of the tile side; -1: not built
  std::vector<uint8_t> cls;     // TileClass per tile, images one after the other
  std::vector<uint64_t> first;  // per image: index of its first tile
  std::vector<uint32_t> tx;     // per image: tiles per row
  std::vector<double> key;      // the inputs it was built from (rebuilt when they change)

  static std::vector<double> make_key(const Cache &c, const detail::RouteParams &rp, int shift) {
    std::vector<double> k = {double(shift), double(rp.C), double(rp.cell), rp.m2, double(rp.dims),
                             rp.up[0], rp.up[1], rp.up[2], double(rp.has_bounds)};
    for (int i = 0; i < 3; i++) { k.push_back(rp.bmin[i]); k.push_back(rp.bmax[i]); }
    for (int i = 0; i < 3 * rp.C; i++) k.push_back(rp.cproj[i]);
    for (size_t i = 0; i < c.imgs.size(); i++) {
      const Image &im = c.imgs[i];
      k.push_back(double(im.W)); k.push_back(double(im.H));
      for (int f = 0; f < 18; f++) k.push_back(im.cam[f]);
    }
    return k;
  }
};

/// Routing decisions for the n candidates at stream positions s0, s0 + 1, ...: records the
/// accepted ones (offset and pixel id) in `acc`. tm: the cache's tile map, or null (every
/// candidate gets the exact test). avx2: the AVX2 builds of the batched stages (same bits).
template <int Mode>
void decide_block(const Cache &c, const detail::RouteParams &rp, const RouteTable &rt, const TileMap *tm,
                  uint64_t key, uint64_t s0, int64_t n, Accepted &acc, bool avx2);

/// Lays out and classifies the tile map of one cache (tiles of 2^shift pixels), images split over
/// the thread pool.
void build_tiles(const Cache &c, const detail::RouteParams &rp, const RouteTable &rt, int shift,
                 ::dali::ThreadPool &tp, TileMap &tm);

}  // namespace cpu
}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_ROUTING_H_
