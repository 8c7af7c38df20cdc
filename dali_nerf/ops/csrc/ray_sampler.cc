// CPU backend of the dali_nerf ray sampler (RunImpl), and the operator schema (see ray_sampler.h).
//
// Unrouted: the R rays of a sample are split into chunks of kChunk rays, run on the DALI thread
// pool (writer.h). Routed: rounds of speculative candidate blocks are decided in parallel (each
// block records the pixel ids of its accepted candidates, in stream order, without reading a
// pixel; routing.h), the blocks are concatenated in order until R rays are accepted, then the
// accepted rays are written into the output in parallel chunks. A per-cache tile map (TileMap)
// decides most candidates by a table lookup; the rest get the exact per-ray test.
#include <algorithm>
#include <cmath>
#include <vector>

#include "global.h"
#include "ray_sampler.h"
#include "routing.h"
#include "writer.h"

namespace dali_nerf {

namespace {

using cpu::Accepted;
using cpu::Cache;
using cpu::kChunk;
using cpu::Outputs;
using cpu::RouteTable;
using cpu::TileMap;

/// What a global-stream CPU run keeps across runs: the cache's first-return times (for its size n).
struct GlobalScratch {
  uint64_t n = 0;
  cpu::Returns jumps;
};

/// What a routed CPU run keeps across runs.
struct RoutedScratch {
  std::vector<Accepted> blocks;
  std::vector<TileMap> tiles;  // per sample of the batch
};

}  // namespace

template <>
void RaySampler<::dali::CPUBackend>::RunImpl(::dali::Workspace &ws) {
  using ::dali::CPUBackend;
  const auto &pix_in = ws.Input<CPUBackend>(0);
  const auto &cam_in = ws.Input<CPUBackend>(1);
  const auto &lay_in = ws.Input<CPUBackend>(2);
  auto &tp = ws.GetThreadPool();
  int nsamples = pix_in.num_samples();
  int nthreads = tp.NumThreads();
  const int64_t R = rays_;
  // AVX2 where the CPU has it (`simd`): the ray writer and the routed decision pass, both
  // bit for bit the scalar code
  const bool simd = simd_ && cpu::kHasAvx2;
  std::vector<Cache> caches(nsamples);
  std::vector<Outputs> outs(nsamples);
  const int vidx = valid_input(ws);  // a masked cache: the streams draw its valid pixels only
  for (int s = 0; s < nsamples; s++) {
    const uint64_t *valid = vidx < 0 ? nullptr : ws.Input<CPUBackend>(vidx).tensor<uint64_t>(s);
    const int64_t L = vidx < 0 ? 0 : ws.Input<CPUBackend>(vidx).tensor_shape(s)[0];
    caches[s].init(pix_in.tensor<uint8_t>(s), pix_in.tensor_shape(s)[0], cam_in.tensor<float>(s),
                   lay_in.tensor<int64_t>(s), cam_in.tensor_shape(s)[0], valid, L);
    outs[s] = {ws.Output<CPUBackend>(0).mutable_tensor<float>(s),
               ws.Output<CPUBackend>(1).mutable_tensor<float>(s),
               ws.Output<CPUBackend>(2).mutable_tensor<float>(s),
               ws.Output<CPUBackend>(4).mutable_tensor<float>(s),
               ws.Output<CPUBackend>(5).mutable_tensor<float>(s),
               ws.Output<CPUBackend>(3).mutable_tensor<int64_t>(s)};
  }
  auto &consumed_out = ws.Output<CPUBackend>(6);

  if (global()) {  // the split's global stream: chunks of positions, each knowing its output slot
    auto &counts_out = ws.Output<CPUBackend>(7);
    auto &pos_out = ws.Output<CPUBackend>(8);
    // the first-return times of a cache (walk_jump), kept across runs: the cache's size rarely changes
    if (!scratch_) scratch_ = std::make_shared<GlobalScratch>();
    GlobalScratch &gscratch = *std::static_pointer_cast<GlobalScratch>(scratch_);
    for (int s = 0; s < nsamples; s++) {
      detail::GlobalStream gs = global_stream(static_cast<int64_t>(caches[s].dom.n));
      if (gscratch.n != gs.n) {
        gscratch.jumps = cpu::global_jumps(gs);
        gscratch.n = gs.n;
      }
      const uint64_t g0 = static_cast<uint64_t>(starts_[s]), total = static_cast<uint64_t>(R);
      const uint64_t G = static_cast<uint64_t>(step_positions_);
      const int64_t M = kept_[s];
      // chunks of about kChunk kept rays (and at least one per thread where there is work for
      // them); each task finds its first output slot (the count kept before its chunk, floor
      // sums) and tallies the kept rays of the steps its chunk overlaps
      uint64_t per = std::max<uint64_t>(1, gs.P / std::max<uint64_t>(1, gs.n));
      uint64_t len = std::min<uint64_t>(static_cast<uint64_t>(kChunk) * per,
                                        (total + nthreads - 1) / nthreads);
      len = std::max<uint64_t>(len, 4096);
      const int64_t nchunks = static_cast<int64_t>((total + len - 1) / len);
      std::vector<int64_t> first(nchunks), got(nchunks);
      std::vector<std::vector<int64_t>> tally(nchunks);
      int64_t *positions = pos_out.mutable_tensor<int64_t>(s);
      for (int64_t b = 0; b < nchunks; b++) {
        uint64_t c0 = b * len, n = std::min<uint64_t>(len, total - c0);
        tp.AddWork([&, s, b, c0, n](int) {
          first[b] = static_cast<int64_t>(detail::count_kept(gs, g0, c0));
          tally[b].assign((c0 + n - 1) / G - c0 / G + 1, 0);
          got[b] = cpu::run_global_chunk(caches[s], outs[s], positions, gs, g0 + c0, n, first[b],
                                         std::max<int64_t>(0, M - first[b]), simd, &gscratch.jumps,
                                         g0 + (c0 / G) * G, G, tally[b].data());
        }, static_cast<int64_t>(n / per) + 1);
      }
      tp.RunAll();
      int64_t *counts = counts_out.mutable_tensor<int64_t>(s);
      std::fill(counts, counts + R / G, int64_t{0});
      for (int64_t b = 0; b < nchunks; b++) {
        int64_t next = b + 1 < nchunks ? first[b + 1] : M;
        DALI_ENFORCE(got[b] == next - first[b],
                     "dali_nerf ray_sampler: internal error: the slot walk kept " + std::to_string(got[b]) +
                     " positions where the count says " + std::to_string(next - first[b]));
        uint64_t step0 = (b * len) / G;
        for (size_t k = 0; k < tally[b].size(); k++) counts[step0 + k] += tally[b][k];
      }
      consumed_out.mutable_tensor<int64_t>(s)[0] = R;
      next_start_[s] = starts_[s] + R;
    }
    return;
  }

  if (cell_ < 0) {
    for (int s = 0; s < nsamples; s++) {
      uint64_t s0 = static_cast<uint64_t>(starts_[s]);
      for (int64_t i0 = 0; i0 < R; i0 += kChunk) {
        int64_t n = std::min(kChunk, R - i0);
        tp.AddWork([&, s, s0, i0, n](int) {
          if (mode_ == kEpoch) cpu::run_chunk<kEpoch>(caches[s], outs[s], key_, s0 + i0, i0, n, simd);
          else cpu::run_chunk<kRandom>(caches[s], outs[s], key_, s0 + i0, i0, n, simd);
        }, n);
      }
      consumed_out.mutable_tensor<int64_t>(s)[0] = R;
      next_start_[s] = starts_[s] + R;
    }
    tp.RunAll();
    return;
  }

  // routed: speculative rounds of candidate blocks
  const auto &cen_in = ws.Input<CPUBackend>(3);
  // the accepted-candidate buffers live across runs (fresh ~1 MB buffers per block would
  // page-fault every run), and so do the tile maps (rebuilt only when the inputs change)
  if (!scratch_) scratch_ = std::make_shared<RoutedScratch>();
  RoutedScratch &scratch = *std::static_pointer_cast<RoutedScratch>(scratch_);
  std::vector<Accepted> &blocks = scratch.blocks;
  if (static_cast<int>(scratch.tiles.size()) < nsamples) scratch.tiles.resize(nsamples);
  for (int s = 0; s < nsamples; s++) {
    const Cache &c = caches[s];
    detail::RouteParams rp = route_params(cen_in.tensor<float>(s),
                                          static_cast<int>(cen_in.tensor_shape(s)[0]));
    RouteTable rt;
    rt.init(c, rp);
    const TileMap *tm = nullptr;
    if (route_tile_ > 0) {
      TileMap &t = scratch.tiles[s];
      int shift = __builtin_ctz(static_cast<unsigned>(route_tile_));
      std::vector<double> key = TileMap::make_key(c, rp, shift);
      if (t.shift != shift || t.key != key) cpu::build_tiles(c, rp, rt, shift, tp, t);
      t.key.swap(key);
      tm = &t;
    }
    uint64_t s0 = static_cast<uint64_t>(starts_[s]);
    int64_t accepted = 0;
    uint64_t examined = 0;  // candidates evaluated so far = next round's offset from s0
    int64_t consumed = -1;
    while (consumed < 0) {
      int64_t need = R - accepted;
      double est = std::max(accept_estimate_, 1e-3);
      // expected need / est candidates plus 6 binomial standard deviations (and 1% for the
      // estimate's own error): a second, small round is rare, and few candidates are wasted
      int64_t cand = static_cast<int64_t>(need / est * 1.01 +
                                          6.0 * std::sqrt(need * (1.0 - est)) / est) + 256;
      // blocks of at most kBlock candidates, at least one per thread, at least 1024 each, sized
      // so that nb * bsz is just over cand (no partly-needed whole block at the end)
      int64_t bsz = std::min<int64_t>(cpu::kBlock, std::max<int64_t>(1024, (cand + nthreads - 1) / nthreads));
      int64_t nb = std::min<int64_t>((cand + bsz - 1) / bsz, 4096);
      bsz = std::max<int64_t>(1024, std::min<int64_t>(bsz, (cand + nb - 1) / nb));
      if (static_cast<int64_t>(blocks.size()) < nb) blocks.resize(nb);
      for (int64_t b = 0; b < nb; b++) {
        uint64_t bs = s0 + examined + b * bsz;
        tp.AddWork([&, b, bs, bsz](int) {
          if (mode_ == kEpoch) cpu::decide_block<kEpoch>(c, rp, rt, tm, key_, bs, bsz, blocks[b], simd);
          else cpu::decide_block<kRandom>(c, rp, rt, tm, key_, bs, bsz, blocks[b], simd);
        }, bsz);
      }
      tp.RunAll();
      int64_t round_acc = 0;
      std::vector<std::pair<int64_t, int64_t>> round_writes;  // (block, slot) this round
      for (int64_t b = 0; b < nb; b++) round_acc += blocks[b].count;
      for (int64_t b = 0; b < nb && consumed < 0; b++) {
        int64_t n = blocks[b].count;
        if (n == 0) continue;
        round_writes.push_back({b, accepted});
        if (accepted + n >= R) {
          consumed = static_cast<int64_t>(examined + b * bsz + blocks[b].pos[R - accepted - 1]) + 1;
        }
        accepted += n;
      }
      // write this round's accepted rays straight into the output, in chunks of about kChunk
      // rays (block b's accepted candidates go to slots [slot, min(slot + count, R)))
      for (auto &w : round_writes) {
        int64_t b = w.first, slot = w.second;
        int64_t n = std::min<int64_t>(blocks[b].count, R - slot);
        for (int64_t k0 = 0; k0 < n; k0 += kChunk) {
          int64_t k1 = std::min(n, k0 + kChunk);
          tp.AddWork([&, b, slot, k0, k1](int) {
            cpu::write_pixels(c, outs[s], blocks[b].pix.data() + k0, slot + k0, k1 - k0, simd);
          }, k1 - k0);
        }
      }
      tp.RunAll();
      uint64_t round_cand = static_cast<uint64_t>(nb) * bsz;
      accept_estimate_ = std::max(1e-4, static_cast<double>(round_acc) / round_cand);
      examined += round_cand;
      if (consumed < 0 && accepted == 0 && examined >= (uint64_t(1) << 26) + 64ull * R) {
        DALI_FAIL("dali_nerf ray_sampler: cell " + std::to_string(cell_) + " accepted no ray in " +
                  std::to_string(examined) + " candidates: check `centroids`, `margin` and near/far");
      }
    }
    consumed_out.mutable_tensor<int64_t>(s)[0] = consumed;
    next_start_[s] = starts_[s] + consumed;
  }
}

}  // namespace dali_nerf

DALI_REGISTER_OPERATOR(dali_nerf__RaySampler, ::dali_nerf::RaySampler<::dali::CPUBackend>, ::dali::CPU);

DALI_SCHEMA(dali_nerf__RaySampler)
    .DocStr(R"(Samples training rays from an in-memory image cache (dali_nerf).

Each output sample holds ``rays`` rays taken from a deterministic stream of pixel ids that starts
at stream position ``start``: ``random`` mode hashes (seed, stream, num_streams, position),
``epoch`` mode visits every pixel of the cache exactly once per block of P positions (keyed
Feistel bijection). With ``cell >= 0`` only rays whose [near, far] segment meets the
(margin-extended) Voronoi cell ``cell`` of ``centroids`` are emitted, in stream order;
``consumed`` tells how many stream positions were used, so the next run starts at
``start + consumed``.

With ``global_pixels`` > 0 the stream is the split's global stream instead, defined by the seed
and the global position alone (any world size gives the same global batches; every pixel of the
split once per epoch in ``epoch`` mode): the run walks the ``rays`` global positions
``[start, start + rays)`` (``rays / step_positions`` steps; ``start`` a multiple of
``step_positions``) and emits, in position order, the rays of the positions whose slot lies in
the cache's pixel range ``[shard_begin, shard_begin + P)`` of the split. ``consumed`` = ``rays``.

Masks: a cache whose images carry masks gives one more input, ``valid`` (its valid-pixel index,
``dali_nerf.data.masks.valid_index``: a bit per pixel and a small rank/select directory). Every
stream then draws among the V valid pixels alone, with the formulas above over V for P (random:
uniform over the valid pixels; epoch: each valid pixel once per V positions; the global stream:
``global_pixels`` and ``shard_begin`` count the split's valid pixels), and the k-th valid pixel
is the ray's pixel: no masked pixel is ever sampled. Without ``valid`` nothing changes.

Outputs: origins (R,3) f32, directions (R,3) f32 unit, rgb (R,3) f32 = pixel / 255,
indices (R,3) int64 (camera index in split, row, col), near (R,1) f32, far (R,1) f32,
consumed (1,) int64; with ``global_pixels`` > 0, R is the number of kept positions and two more
outputs follow: step_counts (K,) int64 (kept rays of each of the run's K steps, in order) and
positions (R,) int64 (the global position of each ray).)")
    .NumInput(3, 5)
    // cameras, layout, centroids, valid: CPU inputs allowed for the GPU backend too (its host-side
    // checks and tables then need no device-to-host copy; ARCHITECTURE.md "The operator"); `valid`
    // must be a CPU input (its counts are read on the host; the GPU backend uploads it)
    .InputDevice(1, 5, ::dali::InputDevice::MatchBackendOrCPU)
    .NumOutput(7)
    .OutputFn([](const ::dali::OpSpec &spec) {
      return spec.GetArgument<int64_t>("global_pixels") > 0 ? 9 : 7;
    })
    .InputDox(0, "pixels", "TensorList (P, 3) uint8", "All images of the cache, row-major, concatenated.")
    .InputDox(1, "cameras", "TensorList (N, 18) float32",
              "Per image: camera-to-world 3x4 row-major (12), fx, fy, cx, cy, near, far.")
    .InputDox(2, "layout", "TensorList (N, 4) int64",
              "Per image: pixel offset into `pixels`, width, height, camera index in the split.")
    .InputDox(3, "centroids", "TensorList (C, 3) float32",
              "Optional: cell centroids for spatial routing (needs `cell` >= 0). Without routing, "
              "input 3 is `valid` when given.")
    .InputDox(4, "valid", "TensorList (L,) uint64",
              "Optional (input 3 without routing, 4 with it): the cache's valid-pixel index "
              "(dali_nerf.data.masks.valid_index), a CPU input; the streams then draw valid pixels only.")
    .AddArg("rays", "Rays per output sample; with `global_pixels` > 0, global positions walked per run "
            "(K * `step_positions`).", DALI_INT32)
    .AddOptionalArg("mode", "\"random\" (iid hash of the position) or \"epoch\" (a permutation "
                    "of all P pixels per block of P positions).", std::string("random"))
    .AddOptionalArg("seed", "Stream seed.", int64_t{0})
    .AddOptionalArg("stream", "Which of `num_streams` per-cache streams (part of the stream key: a "
                    "rank, or a spatial cell). Leave unset with `global_pixels` > 0.", 0)
    .AddOptionalArg("num_streams", "Number of per-cache streams (part of the stream key: the world "
                    "size, or the number of cells). Leave unset with `global_pixels` > 0.", 1)
    .DeprecateArgInFavorOf("rank", "stream", "dali_nerf 0.2",
                           "`rank` is now `stream` (the same stream key)")
    .DeprecateArgInFavorOf("world_size", "num_streams", "dali_nerf 0.2",
                           "`world_size` is now `num_streams` (the same stream key)")
    .AddOptionalArg("global_pixels", "P of the split's global stream: its pixels in all (the images "
                    "in split order, row-major, concatenated). 0: the cache's own stream (the "
                    "arguments above). The cache must hold a contiguous image range of the split.",
                    int64_t{0})
    .AddOptionalArg("shard_begin", "With `global_pixels` > 0: the split's pixel id of the cache's first "
                    "pixel (a DDP shard's first image's offset in the split).", int64_t{0})
    .AddOptionalArg("step_positions", "With `global_pixels` > 0: G, global positions per step (the "
                    "global batch); `rays` and `start` are multiples of it. 0: `rays` (one step per "
                    "run).", int64_t{0})
    .AddOptionalArg("start", "Stream position of the first candidate ray (the global position with "
                             "`global_pixels` > 0) "
                             "(argument input allowed: one int64 per sample). -1: continue right "
                             "where this operator's previous run of the same sample ended (start + "
                             "consumed), so that a pipeline running ahead (prefetch) continues a "
                             "routed stream whose `consumed` it does not know yet.", int64_t{0}, true)
    .AddOptionalArg("continue_runs", "If true, `start` places only the first run of each sample; "
                    "every later run continues right where the previous one ended (as `start` = -1 "
                    "would), so a constant `start` needs no per-run input.", false)
    .AddOptionalArg("cell", "Cell to route to (index into `centroids`); -1: no routing.", -1)
    .AddOptionalArg("margin", "Routing margin m: keep a ray if some point p of its segment has "
                    "|p - c_cell| <= m |p - c_k| for all k.", 1.15f)
    .AddOptionalArg("up", "World up vector; with dims == 2 routing ignores this axis.",
                    std::vector<float>{0.f, 1.f, 0.f})
    .AddOptionalArg("dims", "Routing distances: 2 (perpendicular to `up`) or 3.", 2)
    .AddOptionalArg("simd", "CPU: use the SIMD code paths where the CPU has them (AVX2: 8 rays at a "
                    "time in the ray writer, batched routing decisions, the global stream's walks; "
                    "AVX-512 F/DQ/VL: the global stream's level 2, 8 positions at a time). They give bit for bit the "
                    "results of the scalar code; false forces the scalar code (for checks and "
                    "debugging). Ignored by the GPU backend.", true)
    .AddOptionalArg("route_tile", "CPU routing: side (a power of two, <= 256) of the pixel tiles that "
                    "are classified once per cache (every ray of the tile provably accepted or "
                    "rejected, or mixed: tested ray by ray); the decisions are those of the per-ray "
                    "test. 0: test every ray. The GPU backend tests every ray.", 8)
    .AddOptionalArg("bounds", "Routing box (min x, y, z, max x, y, z): only the part of a ray's "
                    "[near, far] segment inside it decides its cells (like Mega-NeRF's ray altitude "
                    "range); rays that miss the box keep their whole segment. Empty: no box.",
                    std::vector<float>{});
