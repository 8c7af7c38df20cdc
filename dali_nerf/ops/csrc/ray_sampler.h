// dali_nerf ray sampler: a DALI operator that turns an in-memory image cache into training rays.
//
// Schema `dali_nerf__RaySampler` (Python: `fn.dali_nerf.ray_sampler`), CPU and GPU backends.
// The contract (inputs, arguments, outputs, stream semantics, routing) is in ARCHITECTURE.md,
// section "The operator". This header is the operator class, as in DALI's custom-operator
// example; RunImpl is specialised in ray_sampler.cc (CPU, with the schema) and ray_sampler.cu
// (GPU). What both backends compute lives in the host/device headers:
//   * streams.h   stream position -> pixel id (random hash, epoch Feistel bijection), stream_key;
//                 the split's global stream (`global_pixels` > 0): slot walk, level 2, counts;
//   * ray_math.h  pixel -> ray (the folded camera), the exact routing decision, the input checks;
//   * mask.h      a masked cache's valid-pixel index (the optional `valid` input): the streams draw
//                 valid-pixel numbers, and select maps them to pixel ids.
// The CPU backend's own parts: writer.h/.cc (cache view, scalar and AVX2 ray writers) and
// routing.h/.cc (routing tables, tile map, batched decision pass), global.h/.cc (the global
// stream's slot walk, scalar and AVX2, and its chunk runner).
#ifndef DALI_NERF_OPS_RAY_SAMPLER_H_
#define DALI_NERF_OPS_RAY_SAMPLER_H_

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dali/pipeline/operator/operator.h"
#include "mask.h"
#include "ray_math.h"
#include "streams.h"

namespace dali_nerf {
template <typename Backend>
class RaySampler : public ::dali::Operator<Backend> {
 public:
  explicit RaySampler(const ::dali::OpSpec &spec)
      : ::dali::Operator<Backend>(spec),
        rays_(spec.GetArgument<int>("rays")),
        seed_(spec.GetArgument<int64_t>("seed")),
        stream_(spec.GetArgument<int>("stream")),
        num_streams_(spec.GetArgument<int>("num_streams")),
        cell_(spec.GetArgument<int>("cell")),
        margin_(spec.GetArgument<float>("margin")),
        dims_(spec.GetArgument<int>("dims")),
        route_tile_(spec.GetArgument<int>("route_tile")),
        simd_(spec.GetArgument<bool>("simd")),
        continue_runs_(spec.GetArgument<bool>("continue_runs")),
        global_pixels_(spec.GetArgument<int64_t>("global_pixels")),
        shard_begin_(spec.GetArgument<int64_t>("shard_begin")),
        step_positions_(spec.GetArgument<int64_t>("step_positions")) {
    std::vector<float> bounds = spec.GetRepeatedArgument<float>("bounds");
    DALI_ENFORCE(bounds.empty() || bounds.size() == 6,
                 "dali_nerf ray_sampler: `bounds` must be empty or 6 values (min xyz, max xyz)");
    has_bounds_ = bounds.size() == 6;
    for (int i = 0; i < 6 && has_bounds_; i++) bounds_[i] = bounds[i];
    std::string mode = spec.GetArgument<std::string>("mode");
    DALI_ENFORCE(mode == "random" || mode == "epoch",
                 "dali_nerf ray_sampler: `mode` must be \"random\" or \"epoch\", got \"" + mode + "\"");
    mode_ = mode == "epoch" ? kEpoch : kRandom;
    DALI_ENFORCE(rays_ > 0, "dali_nerf ray_sampler: `rays` must be > 0");
    DALI_ENFORCE(num_streams_ > 0 && stream_ >= 0 && stream_ < num_streams_,
                 "dali_nerf ray_sampler: need 0 <= stream < num_streams (`rank` < `world_size`)");
    DALI_ENFORCE(dims_ == 2 || dims_ == 3, "dali_nerf ray_sampler: `dims` must be 2 or 3");
    DALI_ENFORCE(margin_ > 0.f, "dali_nerf ray_sampler: `margin` must be > 0");
    DALI_ENFORCE(route_tile_ >= 0 && route_tile_ <= 256 && (route_tile_ & (route_tile_ - 1)) == 0,
                 "dali_nerf ray_sampler: `route_tile` must be 0 or a power of two <= 256");
    std::vector<float> up = spec.GetRepeatedArgument<float>("up");
    DALI_ENFORCE(up.size() == 3, "dali_nerf ray_sampler: `up` must have 3 values");
    DALI_ENFORCE(detail::unit_up(up.data(), up_), "dali_nerf ray_sampler: `up` must be non-zero");
    key_ = detail::stream_key(seed_, stream_, num_streams_, mode_);
    check_global_args();
  }

  ~RaySampler() override = default;
  RaySampler(const RaySampler &) = delete;
  RaySampler &operator=(const RaySampler &) = delete;

 protected:
  using ::dali::Operator<Backend>::RunImpl;

  bool SetupImpl(std::vector<::dali::OutputDesc> &output_desc,
                 const ::dali::Workspace &ws) override {
    // cameras, layout and centroids may be CPU inputs of the GPU backend (schema:
    // MatchBackendOrCPU): only their types and shapes are read here
    auto ps_all = ws.GetInputShape(0), cs_all = ws.GetInputShape(1), ls_all = ws.GetInputShape(2);
    int nsamples = ps_all.num_samples();
    DALI_ENFORCE(ws.GetInputDataType(0) == DALI_UINT8, "dali_nerf ray_sampler: `pixels` must be uint8");
    DALI_ENFORCE(ws.GetInputDataType(1) == DALI_FLOAT, "dali_nerf ray_sampler: `cameras` must be float32");
    DALI_ENFORCE(ws.GetInputDataType(2) == DALI_INT64, "dali_nerf ray_sampler: `layout` must be int64");
    bool routed = cell_ >= 0;
    DALI_ENFORCE(!routed || ws.NumInput() >= 4,
                 "dali_nerf ray_sampler: `cell` >= 0 needs the `centroids` input");
    const int vidx = valid_input(ws);
    if (vidx >= 0) {
      DALI_ENFORCE(ws.GetInputDataType(vidx) == DALI_UINT64,
                   "dali_nerf ray_sampler: input " + std::to_string(vidx) + " is `valid`, the cache's valid-pixel "
                   "index (uint64, dali_nerf.data.masks.valid_index)" +
                   (routed ? "" : "; `centroids` go with `cell` >= 0 only"));
      DALI_ENFORCE(ws.template InputIsType<::dali::CPUBackend>(vidx),
                   "dali_nerf ray_sampler: `valid` must be a CPU input (the op reads its counts on the host)");
    }
    for (int i = 0; i < nsamples; i++) {
      auto ps = ps_all[i], cs = cs_all[i], ls = ls_all[i];
      DALI_ENFORCE(ps.size() == 2 && ps[1] == 3 && ps[0] > 0,
                   "dali_nerf ray_sampler: `pixels` must be (P, 3) with P > 0");
      DALI_ENFORCE(cs.size() == 2 && cs[1] == 18 && cs[0] > 0,
                   "dali_nerf ray_sampler: `cameras` must be (N, 18)");
      DALI_ENFORCE(ls.size() == 2 && ls[1] == 4 && ls[0] == cs[0],
                   "dali_nerf ray_sampler: `layout` must be (N, 4), N as in `cameras`");
      if (routed) {
        auto s = ws.GetInputShape(3)[i];
        DALI_ENFORCE(ws.GetInputDataType(3) == DALI_FLOAT, "dali_nerf ray_sampler: `centroids` must be float32");
        DALI_ENFORCE(s.size() == 2 && s[1] == 3 && cell_ < s[0] && s[0] <= detail::kMaxCells,
                     "dali_nerf ray_sampler: `centroids` must be (C, 3), cell < C <= 64");
      }
    }
    starts_.resize(nsamples);
    for (int i = 0; i < nsamples; i++) {
      starts_[i] = this->spec_.template GetArgument<int64_t>("start", &ws, i);
      if (continue_runs_ && i < static_cast<int>(next_start_.size()) && next_start_[i] >= 0) {
        starts_[i] = next_start_[i];  // `start` placed the first run; every later one continues
      } else if (starts_[i] == -1) {  // continue: right where this operator's previous run of sample i ended
        DALI_ENFORCE(i < static_cast<int>(next_start_.size()) && next_start_[i] >= 0,
                     "dali_nerf ray_sampler: `start` = -1 (continue) needs an earlier run of this "
                     "operator for the same sample; give the first run's stream position");
        starts_[i] = next_start_[i];
      }
      DALI_ENFORCE(starts_[i] >= 0,
                   "dali_nerf ray_sampler: `start` must be >= 0, or -1 to continue after the previous run");
    }
    if (static_cast<int>(next_start_.size()) < nsamples) next_start_.resize(nsamples, -1);
    domain_.resize(nsamples);
    for (int i = 0; i < nsamples; i++) {
      domain_[i] = ps_all[i][0];
      if (vidx < 0) continue;
      const auto &vin = ws.template Input<::dali::CPUBackend>(vidx);
      auto vs = vin.tensor_shape(i);
      DALI_ENFORCE(vs.size() == 1, "dali_nerf ray_sampler: `valid` must be (L,) uint64");
      detail::ValidIndex vi;
      std::string err = vi.init(vin.template tensor<uint64_t>(i), static_cast<uint64_t>(vs[0]),
                                static_cast<uint64_t>(ps_all[i][0]));
      DALI_ENFORCE(err.empty(), err);
      DALI_ENFORCE(vi.V > 0 || global(), "dali_nerf ray_sampler: `valid` marks no pixel of the cache as valid "
                                         "(every pixel masked): nothing to sample");
      domain_[i] = static_cast<int64_t>(vi.V);
    }
    if (global()) return setup_global(output_desc, ws);
    output_desc.resize(7);
    auto vec3 = ::dali::uniform_list_shape(nsamples, ::dali::TensorShape<2>(rays_, 3));
    auto vec1 = ::dali::uniform_list_shape(nsamples, ::dali::TensorShape<2>(rays_, 1));
    output_desc[0] = {vec3, DALI_FLOAT};
    output_desc[1] = {vec3, DALI_FLOAT};
    output_desc[2] = {vec3, DALI_FLOAT};
    output_desc[3] = {vec3, DALI_INT64};
    output_desc[4] = {vec1, DALI_FLOAT};
    output_desc[5] = {vec1, DALI_FLOAT};
    output_desc[6] = {::dali::uniform_list_shape(nsamples, ::dali::TensorShape<1>(1)),
                      DALI_INT64};
    return true;
  }

  void RunImpl(::dali::Workspace &ws) override;

  bool global() const { return global_pixels_ > 0; }

  /// Index of the optional `valid` input (after `centroids` when routed), -1 when absent.
  int valid_input(const ::dali::Workspace &ws) const {
    const int idx = cell_ >= 0 ? 4 : 3;
    return ws.NumInput() > idx ? idx : -1;
  }

  /// The constructor's checks of the global stream's arguments (one-line errors).
  void check_global_args() {
    if (!global()) {
      DALI_ENFORCE(global_pixels_ == 0, "dali_nerf ray_sampler: `global_pixels` must be >= 0 (0: the "
                                        "cache's own stream)");
      DALI_ENFORCE(shard_begin_ == 0 && step_positions_ == 0,
                   "dali_nerf ray_sampler: `shard_begin` and `step_positions` need `global_pixels` > 0");
      return;
    }
    DALI_ENFORCE(static_cast<uint64_t>(global_pixels_) <= detail::kMaxGlobalPixels,
                 "dali_nerf ray_sampler: `global_pixels` must be <= 2^62");
    DALI_ENFORCE(cell_ < 0, "dali_nerf ray_sampler: `global_pixels` > 0 (the split's global stream) cannot "
                            "be routed: give `cell` = -1 (spatial cells keep their own streams)");
    DALI_ENFORCE(stream_ == 0 && num_streams_ == 1,
                 "dali_nerf ray_sampler: with `global_pixels` > 0 the stream is the split's, keyed by the "
                 "seed alone: leave `stream`/`num_streams` (`rank`/`world_size`) unset; the cache's "
                 "`shard_begin` selects the rank's part");
    DALI_ENFORCE(step_positions_ >= 0, "dali_nerf ray_sampler: `step_positions` must be >= 0");
    if (step_positions_ == 0) step_positions_ = rays_;  // one step per run
    DALI_ENFORCE(rays_ % step_positions_ == 0,
                 "dali_nerf ray_sampler: with `global_pixels` > 0, `rays` (global positions per run) must "
                 "be a multiple of `step_positions`, got " + std::to_string(rays_) + " and " +
                 std::to_string(step_positions_));
    DALI_ENFORCE(shard_begin_ >= 0 && shard_begin_ < global_pixels_,
                 "dali_nerf ray_sampler: `shard_begin` must be in [0, global_pixels), got " +
                 std::to_string(shard_begin_));
    gkey_ = detail::global_key(seed_, mode_);
    weyl_ = detail::weyl_multiplier(static_cast<uint64_t>(global_pixels_));
  }

  /// The global stream of a cache of P_local stream ids (its pixels, or its valid pixels; its slot
  /// range [shard_begin, + P_local)).
  detail::GlobalStream global_stream(int64_t P_local) const {
    return {gkey_, static_cast<uint64_t>(global_pixels_), weyl_, static_cast<uint64_t>(shard_begin_),
            static_cast<uint64_t>(P_local), mode_};
  }

  /// Setup of a global-stream run: checks, the run's kept count M (floor sums, no walk) and the
  /// output shapes (M kept rays; step_counts (K,); positions (M,)).
  bool setup_global(std::vector<::dali::OutputDesc> &output_desc, const ::dali::Workspace &ws) {
    auto ps_all = ws.GetInputShape(0);
    int nsamples = ps_all.num_samples();
    const int64_t G = step_positions_, K = rays_ / step_positions_;
    kept_.resize(nsamples);
    ::dali::TensorListShape<2> vec3(nsamples), vec1(nsamples);
    ::dali::TensorListShape<1> pos(nsamples), counts(nsamples);
    for (int i = 0; i < nsamples; i++) {
      int64_t P_local = domain_[i];  // with `valid`: the split's and the cache's valid pixels
      DALI_ENFORCE(shard_begin_ + P_local <= global_pixels_,
                   "dali_nerf ray_sampler: the cache's pixels [shard_begin, shard_begin + " + std::to_string(P_local) +
                   ") = [" + std::to_string(shard_begin_) + ", " + std::to_string(shard_begin_ + P_local) +
                   ") must lie inside the split's [0, global_pixels = " + std::to_string(global_pixels_) + ")");
      DALI_ENFORCE(starts_[i] % G == 0,
                   "dali_nerf ray_sampler: with `global_pixels` > 0, `start` must be a multiple of "
                   "`step_positions` (" + std::to_string(G) + "), got " + std::to_string(starts_[i]));
      int64_t total = static_cast<int64_t>(detail::count_kept(global_stream(P_local), static_cast<uint64_t>(starts_[i]),
                                                              static_cast<uint64_t>(rays_)));
      kept_[i] = total;
      vec3.set_tensor_shape(i, ::dali::TensorShape<2>(total, 3));
      vec1.set_tensor_shape(i, ::dali::TensorShape<2>(total, 1));
      pos.set_tensor_shape(i, ::dali::TensorShape<1>(total));
      counts.set_tensor_shape(i, ::dali::TensorShape<1>(K));
    }
    output_desc.resize(9);
    output_desc[0] = {vec3, DALI_FLOAT};
    output_desc[1] = {vec3, DALI_FLOAT};
    output_desc[2] = {vec3, DALI_FLOAT};
    output_desc[3] = {vec3, DALI_INT64};
    output_desc[4] = {vec1, DALI_FLOAT};
    output_desc[5] = {vec1, DALI_FLOAT};
    output_desc[6] = {::dali::uniform_list_shape(nsamples, ::dali::TensorShape<1>(1)), DALI_INT64};
    output_desc[7] = {counts, DALI_INT64};
    output_desc[8] = {pos, DALI_INT64};
    return true;
  }

  detail::RouteParams route_params(const float *centroids, int C) const {
    return detail::route_params(centroids, C, cell_, margin_, up_, dims_, has_bounds_, bounds_);
  }

  int rays_;
  int64_t seed_;
  int stream_, num_streams_, cell_;
  float margin_;
  int dims_;
  int route_tile_;  // CPU routing: tile side of the per-image tile classification (0: per ray)
  bool simd_;       // CPU: AVX2 paths where the CPU has them (the same results as the scalar code)
  bool continue_runs_;  // `start` applies to the first run of a sample only; later runs continue
  // the split's global stream (global_pixels_ > 0): P of the split, the cache's first global pixel,
  // positions per step (G); its key and Weyl multiplier; per sample of the current run, the kept
  // count M (from Setup)
  int64_t global_pixels_, shard_begin_, step_positions_;
  uint64_t gkey_ = 0, weyl_ = 0;
  std::vector<int64_t> kept_;
  std::vector<int64_t> domain_;  // per sample of the current run: stream ids (pixels or valid pixels)
  int mode_;
  double up_[3];
  bool has_bounds_ = false;
  double bounds_[6] = {0, 0, 0, 0, 0, 0};
  uint64_t key_;
  std::vector<int64_t> starts_;
  // per sample: the stream position right after this operator's last run (start + consumed), the
  // start of a run fed `start` = -1; -1 before the first run. Runs execute in iteration order, so
  // a pipeline that runs ahead (prefetch) continues a routed stream without knowing `consumed`.
  std::vector<int64_t> next_start_;
  double accept_estimate_ = 0.5;  // routed runs: running acceptance rate, sizes speculative rounds
  std::shared_ptr<void> scratch_;  // backend-specific state kept across runs (CPU: blocks, tile maps)
};

}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_RAY_SAMPLER_H_
