// dali_nerf ray sampler, CPU backend: the cache view and the ray writers (scalar and AVX2).
//
// Cache: one sample's inputs, pixel id -> (image, row, col) -> its writers' table row
// (ray_math.h fill_row). Outputs::write is the scalar writer (ray_math.h row_ray); write8_avx2 is
// its 8-lane twin (the same IEEE operations in the same order, so the same bits; tested).
#ifndef DALI_NERF_OPS_WRITER_H_
#define DALI_NERF_OPS_WRITER_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "mask.h"
#include "ray_math.h"
#include "streams.h"

namespace dali_nerf {
namespace cpu {

constexpr int64_t kChunk = 16384;  // rays per thread-pool task

/// Quotient n / d for n < 2^52 using a precomputed reciprocal inv = 1.0 / d (exact after the fix).
/// The conversions are signed (one instruction each on x86-64; n < 2^52 fits).
inline uint64_t fast_div(uint64_t n, uint64_t d, double inv) {
  int64_t sn = static_cast<int64_t>(n), sd = static_cast<int64_t>(d);
  int64_t q = static_cast<int64_t>(static_cast<double>(sn) * inv);
  if (q * sd > sn) q--;
  else if (sn - q * sd >= sd) q++;
  return static_cast<uint64_t>(q);
}

struct Image {
  uint64_t off, W, H;
  double invW;
  const float *cam;
  int64_t index;   // camera index in the split (layout[:, 3])
  const float *t;  // its row of Cache::tab
};

/// What the streams draw from, image by image: the cache's pixels (unmasked), or its valid pixels
/// (masked: image i's valid pixels are ids [offs[i], offs[i] + sizes[i]) of [0, n), in pixel order;
/// an image may have none). A stream picks an id; Cache::pixel_of maps it to its pixel.
struct Domain {
  uint64_t n = 0;
  std::vector<uint64_t> offs, sizes;  // offs: N + 1 entries (offs[N] = n)
  bool uniform = false;  // all images of one size > 0: the image by one division
  uint64_t WH = 0;
  double invWH = 0;
  // masked, images of several sizes: bucket[id >> bshift] = the image holding id bshift-aligned ids
  // (about 4 buckets an image), the search then a step or two forward (unmasked: empty)
  std::vector<uint32_t> bucket;
  int bshift = 0;
  uint64_t max_size = 0;

  /// Index of the image holding id `id` < n (with empty images: the last image whose offset is
  /// <= id, the one that holds it).
  inline size_t image_of(uint64_t id) const {
    if (uniform) return fast_div(id, WH, invWH);
    if (!bucket.empty()) {
      size_t img = bucket[id >> bshift];
      while (offs[img + 1] <= id) img++;  // offs[N] = n > id ends it
      return img;
    }
    return std::upper_bound(offs.begin(), offs.end() - 1, id) - offs.begin() - 1;
  }

  /// The per-image rows (offs, sizes from offs) and, masked, the image of each bucket.
  void finish(bool with_buckets);
};

/// One sample's cache: pixel id -> (image, row, col) -> ray, and the outputs it writes.
struct Cache {
  const uint8_t *pixels = nullptr;
  uint64_t P = 0;
  std::vector<Image> imgs;
  std::vector<uint64_t> offs;  // offs[i] = imgs[i].off
  bool uniform = false;        // all images the same size: no binary search
  uint64_t WH = 0;
  double invWH = 0;
  std::vector<float> tab;  // detail::kRow floats per image (fill_row), read by both ray writers
  bool simd = false;       // every camera index and size fits the AVX2 writer's int32 lanes
  bool masked = false;     // the sample has a `valid` input: the streams draw valid pixels only
  detail::ValidIndex vi;   // masked: its valid-pixel index
  Domain dom;              // what the streams draw from (the pixels, or the valid pixels)

  /// Checks the inputs (detail::check_cache, and the `valid` index's shape when given: valid /
  /// L words; a DALI error when invalid) and builds the view.
  void init(const uint8_t *px, int64_t P_, const float *cams, const int64_t *lay, int64_t N,
            const uint64_t *valid = nullptr, int64_t L = 0);

  /// The pixel id of stream id k (k < dom.n): itself, or the k-th valid pixel.
  inline uint64_t pixel_of(uint64_t k) const { return masked ? vi.select(k) : k; }

  /// Index of the image holding pixel id `pix`.
  inline size_t image_of(uint64_t pix) const {
    if (uniform) return fast_div(pix, WH, invWH);
    return std::upper_bound(offs.begin(), offs.end(), pix) - offs.begin() - 1;
  }

  inline const Image &locate(uint64_t pix, uint64_t &row, uint64_t &col) const {
    const Image &im = imgs[image_of(pix)];
    uint64_t rem = pix - im.off;
    row = fast_div(rem, im.W, im.invW);
    col = rem - row * im.W;
    return im;
  }
};

extern const bool kHasAvx2;
/// AVX-512 F/DQ/VL on this CPU, unless DALI_NERF_NO_AVX512 is set to anything but "" or "0" (the
/// AVX2 and scalar code give the same bits: for checks, and for CPUs that lower their clock under
/// AVX-512): the global stream's level 2 and (with BW too) the masked select, 8 lanes at a time.
extern const bool kHasAvx512;

struct Outputs {
  float *o, *d, *rgb, *nr, *fr;
  int64_t *idx;

  /// Ray i from pixel `pix` (the same ray whether or not the run is routed).
  void write(const Cache &c, int64_t i, uint64_t pix) const;
};

/// locate for a cache of equal-size images (c.uniform), 4 candidates at a time with AVX2, over
/// bpix[0..m). Returns how many it did (a multiple of 4); the caller does the rest with
/// Cache::locate (the same results).
int locate_avx2(const Cache &c, const uint64_t *bpix, int m, int32_t *img, int32_t *row, int32_t *col);

/// Writes rays i0 .. i0 + n - 1 of the unrouted stream starting at stream position s0.
template <int Mode>
void run_chunk(const Cache &c, const Outputs &out, uint64_t key, uint64_t s0, int64_t i0, int64_t n,
               bool simd);

/// out[i] = the pixel of valid-pixel number in[i] (c.vi.select) for i < n, with the index lines
/// prefetched a few selects ahead (in may be out). With AVX-512 F/DQ/VL/BW (kHasAvx512 and BW) 8
/// selects at a time (mask_avx512.h; its shorter build where BITALG, VPOPCNTDQ and VBMI are there
/// too); else one by one, the in-word select by BMI2's pdep where it is fast (not AMD families
/// 15h/17h, which microcode it); the same pixels every way.
void select_batch(const Cache &c, const uint64_t *in, uint64_t *out, int64_t n, bool simd);

/// Writes the rays of the pixel ids pix[0, n) to output slots [slot, slot + n).
void write_pixels(const Cache &c, const Outputs &out, const uint64_t *pix, int64_t slot, int64_t n, bool simd);

}  // namespace cpu
}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_WRITER_H_
