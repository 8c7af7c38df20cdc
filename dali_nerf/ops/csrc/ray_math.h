// dali_nerf ray sampler: the one formula for rays and routing, shared by both backends.
//
// Every function here is DN_HD (host and device) and is the only place its arithmetic is
// written: the CPU's scalar writer and decision pass and the GPU's kernels call these, and the
// build keeps both sides from contracting a * b + c into an FMA (g++ without -mfma, nvcc with
// -fmad=false), so a ray and a routing decision are the same bits on both backends. The CPU's
// AVX2 paths (writer.cc, routing.cc) are the same operations in the same order, 4 or 8 lanes at
// a time, tested bit for bit against the scalar code.
//   * camera:  pixel (row, col) -> unnormalised direction d = A col + B row + C (the camera folded
//              once in double, ARCHITECTURE.md "Conventions"), one normalisation in float;
//   * routing: exact membership of a ray's [near, far] segment in a margin-extended Voronoi cell;
//   * checks:  the content checks of the cameras/layout inputs (host only).
#ifndef DALI_NERF_OPS_RAY_MATH_H_
#define DALI_NERF_OPS_RAY_MATH_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "hd.h"

namespace dali_nerf {
namespace detail {

constexpr int kMaxCells = 64;  // centroids per routing call (per-ray condition storage)

// ------------------------------------------------------------------------------------- camera

/// The camera formula x = (col + 0.5 - cx) / fx, y = -(row + 0.5 - cy) / fy,
/// d = R0 x + R1 y - R2 (R0, R1, R2 the columns of the camera-to-world rotation), folded into
/// d = A col + B row + C (unnormalised): a ray then needs no division but its normalisation.
/// cam: 18 floats (c2w row-major 12, fx, fy, cx, cy, near, far).
DN_HD void fold_camera(const float *cam, double *A, double *B, double *C) {
  double ifx = 1.0 / cam[12], ify = 1.0 / cam[13];
  double x0 = (0.5 - cam[14]) * ifx, y0 = -(0.5 - cam[15]) * ify;
  for (int r = 0; r < 3; r++) {
    double r0 = cam[4 * r], r1 = cam[4 * r + 1], r2 = cam[4 * r + 2];
    A[r] = r0 * ifx;
    B[r] = -r1 * ify;
    C[r] = r0 * x0 + r1 * y0 - r2;
  }
}

/// An image's row of the ray writers' table, 16 floats: A (3), B (3), C (3) of fold_camera in
/// float, origin (3), near, far, the camera index as int32 bits (when it fits), 0.
constexpr int kRow = 16;

DN_HD void fill_row(float *t, const float *cam, int64_t index) {
  double a[3], b[3], c[3];
  fold_camera(cam, a, b, c);
  for (int r = 0; r < 3; r++) {
    t[r] = static_cast<float>(a[r]); t[3 + r] = static_cast<float>(b[r]); t[6 + r] = static_cast<float>(c[r]);
    t[9 + r] = cam[4 * r + 3];
  }
  t[12] = cam[16]; t[13] = cam[17];
  int32_t i32 = static_cast<int32_t>(index);
  memcpy(t + 14, &i32, 4);
  t[15] = 0.f;
}

/// The ray of pixel (row, col) of the image whose table row is t: origin o (3), unit direction d (3).
DN_HD void row_ray(const float *t, int64_t row, int64_t col, float *o, float *d) {
  float x = static_cast<float>(col), y = static_cast<float>(row);
  float dx = t[0] * x + t[3] * y + t[6];
  float dy = t[1] * x + t[4] * y + t[7];
  float dz = t[2] * x + t[5] * y + t[8];
  float inv = 1.0f / dn_sqrtf(dx * dx + dy * dy + dz * dz);
  o[0] = t[9]; o[1] = t[10]; o[2] = t[11];
  d[0] = dx * inv; d[1] = dy * inv; d[2] = dz * inv;
}

/// A pixel value as the op's rgb: exactly float(v) / 255 (as numpy computes it).
DN_HD float rgb_of(uint8_t v) { return static_cast<float>(v) / 255.f; }

// ------------------------------------------------------------------------------------ routing

/// The operator's routing arguments with the centroids (projected like the rays when dims == 2).
struct RouteParams {
  int C;
  int cell;
  double m2;               // margin^2
  double up[3];            // unit
  int dims;                // 2: ignore the component along `up`; 3: full 3-D distances
  double cproj[3 * kMaxCells];  // centroids, projected like the rays (dims == 2), in double
  bool has_bounds = false; // clip the segment to this box before routing (Mega-NeRF's altitude band)
  double bmin[3], bmax[3];
};

/// The `up` argument as a unit vector in double; false when it is zero.
inline bool unit_up(const float *up, double *unit) {
  double n = dn_sqrt(double(up[0]) * up[0] + double(up[1]) * up[1] + double(up[2]) * up[2]);
  if (!(n > 0)) return false;
  for (int i = 0; i < 3; i++) unit[i] = up[i] / n;
  return true;
}

/// The routing arguments (up: unit; bounds: min xyz, max xyz when has_bounds) with the C
/// centroids (C x 3, host memory) projected like the rays.
inline RouteParams route_params(const float *centroids, int C, int cell, float margin, const double *up,
                                int dims, bool has_bounds, const double *bounds) {
  RouteParams rp;
  rp.C = C;
  rp.cell = cell;
  rp.m2 = double(margin) * double(margin);
  for (int i = 0; i < 3; i++) rp.up[i] = up[i];
  rp.dims = dims;
  for (int k = 0; k < C && k < kMaxCells; k++) {
    double cc[3] = {centroids[3 * k], centroids[3 * k + 1], centroids[3 * k + 2]};
    if (dims == 2) {
      double cu = cc[0] * up[0] + cc[1] * up[1] + cc[2] * up[2];
      for (int i = 0; i < 3; i++) cc[i] -= cu * up[i];
    }
    for (int i = 0; i < 3; i++) rp.cproj[3 * k + i] = cc[i];
  }
  rp.has_bounds = has_bounds;
  for (int i = 0; i < 3; i++) { rp.bmin[i] = bounds[i]; rp.bmax[i] = bounds[3 + i]; }
  return rp;
}

/// Per-call constants of the exact test. With o the (projected) camera origin, D the (projected)
/// unnormalised direction of the pixel, u = t / |d| (t along the unit ray, d the unprojected
/// unnormalised direction) and j = the cell, ray membership is: some u in [near, far] / |d|
/// (clipped to the routing box) has f_k(u) <= 0 for every other cell k, where
///   f_k(u) = |o + u D - c_j|^2 - m^2 |o + u D - c_k|^2 = a u^2 + b_k u + c_k,
///   a = (1 - m^2) |D|^2,  b_k = B0 + 2 m^2 (D . c_k),  c_k = C0 + K_k + 2 m^2 (o . c_k),
///   B0 = 2 (1 - m^2) (D . o) - 2 (D . c_j),  C0 = |o - c_j|^2 - m^2 |o|^2,  K_k = -m^2 |c_k|^2.
struct RouteConsts {
  int n = 0;  // conditions per ray (C - 1): the other cells, in increasing index
  double ckx[kMaxCells], cky[kMaxCells], ckz[kMaxCells], kk[kMaxCells];  // projected c_k, K_k
  double cj[3] = {0, 0, 0}, m2 = 1, two_m2 = 2, one_m2 = 0;
  double up[3] = {0, 1, 0};
  int dims = 2;
  bool has_bounds = false;
  double bmin[3] = {0, 0, 0}, bmax[3] = {0, 0, 0};
};

/// Projects v on the plane perpendicular to `up` (dims == 2); dims == 3: unchanged.
DN_HD void project(const RouteConsts &rc, double *v) {
  if (rc.dims != 2) return;
  double vu = v[0] * rc.up[0] + v[1] * rc.up[1] + v[2] * rc.up[2];
  for (int i = 0; i < 3; i++) v[i] -= vu * rc.up[i];
}

DN_HD void route_consts(const RouteParams &rp, RouteConsts &rc) {
  rc.n = 0;
  rc.m2 = rp.m2; rc.two_m2 = 2.0 * rp.m2; rc.one_m2 = 1.0 - rp.m2;
  for (int i = 0; i < 3; i++) rc.cj[i] = rp.cproj[3 * rp.cell + i];
  for (int k = 0; k < rp.C; k++) {
    if (k == rp.cell) continue;
    const double *ck = rp.cproj + 3 * k;
    rc.ckx[rc.n] = ck[0]; rc.cky[rc.n] = ck[1]; rc.ckz[rc.n] = ck[2];
    rc.kk[rc.n] = -rp.m2 * (ck[0] * ck[0] + ck[1] * ck[1] + ck[2] * ck[2]);
    rc.n++;
  }
  for (int i = 0; i < 3; i++) {
    rc.up[i] = rp.up[i]; rc.bmin[i] = rp.bmin[i]; rc.bmax[i] = rp.bmax[i];
  }
  rc.dims = rp.dims;
  rc.has_bounds = rp.has_bounds;
}

/// An image's row of the routing table, kRouteStride doubles: A, B, C (9, fold_camera), world
/// origin (3), projected origin o (3), C0, near, far, 2 unused.
constexpr int kRouteStride = 20;

DN_HD void route_row(const RouteConsts &rc, const float *cam, double *t) {
  fold_camera(cam, t, t + 3, t + 6);
  for (int r = 0; r < 3; r++) t[9 + r] = cam[4 * r + 3];
  double o[3] = {t[9], t[10], t[11]};
  project(rc, o);
  t[12] = o[0]; t[13] = o[1]; t[14] = o[2];
  double q[3] = {o[0] - rc.cj[0], o[1] - rc.cj[1], o[2] - rc.cj[2]};
  t[15] = (q[0] * q[0] + q[1] * q[1] + q[2] * q[2]) - rc.m2 * (o[0] * o[0] + o[1] * o[1] + o[2] * o[2]);
  t[16] = cam[16]; t[17] = cam[17];
  t[18] = 0.0; t[19] = 0.0;
}

// The stages of the exact test of one candidate. The CPU's decision pass (routing.cc) runs each
// stage over a batch of candidates; route_decide runs them on one. Same functions, same bits.

/// Stage 1: the unprojected unnormalised direction D of pixel (row y, col x) of route row t.
DN_HD void route_dir(const double *t, double x, double y, double &Dx, double &Dy, double &Dz) {
  Dx = t[0] * x + t[3] * y + t[6];
  Dy = t[1] * x + t[4] * y + t[7];
  Dz = t[2] * x + t[5] * y + t[8];
}

/// Stage 2: [near, far] -> the u range [lo, hi] / |D|; an empty segment becomes NaN (never accepted).
DN_HD void route_span(double Dx, double Dy, double Dz, double &lo, double &hi) {
  double inv = 1.0 / dn_sqrt(Dx * Dx + Dy * Dy + Dz * Dz);
  bool ok = lo <= hi;
  double nan = dn_nan();
  lo = ok ? lo * inv : nan;
  hi = ok ? hi * inv : nan;
}

/// Stage 2b (routing box only): slab test on the unprojected ray w + u D; a ray that misses the
/// box keeps its segment (D_i == 0: 1 / D_i = +-inf makes that axis's slab all or nothing).
DN_HD void route_clip(const RouteConsts &rc, double wx, double wy, double wz, double Dx, double Dy,
                      double Dz, double &lo_io, double &hi_io) {
  double lo = lo_io, hi = hi_io;
  double w[3] = {wx, wy, wz}, d[3] = {Dx, Dy, Dz};
  for (int i = 0; i < 3; i++) {
    double inv = 1.0 / d[i];
    double t0 = (rc.bmin[i] - w[i]) * inv, t1 = (rc.bmax[i] - w[i]) * inv;
    double tn = t0 < t1 ? t0 : t1, tf = t0 < t1 ? t1 : t0;
    lo = tn > lo ? tn : lo;
    hi = tf < hi ? tf : hi;
  }
  bool hit = lo <= hi;
  lo_io = hit ? lo : lo_io;
  hi_io = hit ? hi : hi_io;
}

/// Stage 2c: projects D (dims == 2; in place) and gives a and B0 (o: the projected origin).
DN_HD void route_quad(const RouteConsts &rc, double &Dx, double &Dy, double &Dz, double ox, double oy,
                      double oz, double &a, double &B0) {
  const double proj = rc.dims == 2 ? 1.0 : 0.0;
  double du = proj * (Dx * rc.up[0] + Dy * rc.up[1] + Dz * rc.up[2]);
  double dx = Dx - du * rc.up[0], dy = Dy - du * rc.up[1], dz = Dz - du * rc.up[2];
  Dx = dx; Dy = dy; Dz = dz;
  a = rc.one_m2 * (dx * dx + dy * dy + dz * dz);
  B0 = 2.0 * rc.one_m2 * (dx * ox + dy * oy + dz * oz) - 2.0 * (dx * rc.cj[0] + dy * rc.cj[1] + dz * rc.cj[2]);
}

/// Stage 3: b_k and c_k of the k-th other cell (D projected).
DN_HD double route_b(const RouteConsts &rc, int k, double B0, double Dx, double Dy, double Dz) {
  return B0 + rc.two_m2 * (Dx * rc.ckx[k] + Dy * rc.cky[k] + Dz * rc.ckz[k]);
}

DN_HD double route_c(const RouteConsts &rc, int k, double C0, double ox, double oy, double oz) {
  return (C0 + rc.kk[k]) + rc.two_m2 * (ox * rc.ckx[k] + oy * rc.cky[k] + oz * rc.ckz[k]);
}

/// f(u) = a u^2 + b u + c <= 0 (false for a NaN u).
DN_HD bool route_le0(double a, double b, double c, double u) { return (a * u + b) * u + c <= 0.0; }

/// The exact part of the test once the end-point shortcut failed: the n conditions
/// a t^2 + bs[k] t + cs[k] <= 0 (shared a) on [lo, hi]; true iff some t satisfies all of them.
/// For m > 1 (a < 0) a condition's feasible set is the outside of its roots (a forbidden open
/// interval), for m < 1 the inside, for a == 0 a half-line. The allowed set is [lo, hi] minus the
/// union of forbidden intervals; it is non-empty iff lo or one forbidden interval's right end
/// (inside [lo, hi]) is outside all.
DN_HD bool route_solve(double a, const double *bs, const double *cs, int n, double lo, double hi) {
  double fs[kMaxCells], fe[kMaxCells];
  int nf = 0;
  for (int k = 0; k < n; k++) {
    double b = bs[k], c = cs[k];
    if (a == 0.0) {
      if (b == 0.0) {
        if (c > 0.0) return false;
        continue;
      }
      double r = -c / b;
      if (b > 0.0) hi = r < hi ? r : hi;
      else lo = r > lo ? r : lo;
    } else {
      double disc = b * b - 4.0 * a * c;
      if (a > 0.0) {
        if (disc < 0.0) return false;
      } else if (disc <= 0.0) {
        continue;  // a < 0: the quadratic is <= 0 everywhere
      }
      double sq = dn_sqrt(disc);
      double q = -0.5 * (b + (b >= 0.0 ? sq : -sq));
      double r1 = q / a, r2 = q != 0.0 ? c / q : r1;
      if (r1 > r2) { double t = r1; r1 = r2; r2 = t; }
      if (a > 0.0) {
        lo = r1 > lo ? r1 : lo;
        hi = r2 < hi ? r2 : hi;
      } else {
        fs[nf] = r1; fe[nf] = r2; nf++;
      }
    }
    if (!(lo <= hi)) return false;
  }
  // candidates: lo, and every forbidden interval's right end inside [lo, hi]
  for (int cand = -1; cand < nf; cand++) {
    double x = cand < 0 ? lo : fe[cand];
    if (x < lo || x > hi) continue;
    bool ok = true;
    for (int k = 0; k < nf; k++)
      if (fs[k] < x && x < fe[k]) { ok = false; break; }
    if (ok) return true;
  }
  return false;
}

/// The routing decision of pixel (row, col) of the image whose route row is t: true iff some
/// point of its [near, far] segment (clipped to the routing box; a ray that misses the box keeps
/// its whole segment) is in the margin-extended cell. End points first: accept if an end point
/// satisfies every condition; reject (m >= 1: every f_k concave or linear) if some f_k > 0 at
/// both ends; else route_solve.
DN_HD bool route_decide(const RouteConsts &rc, const double *t, int64_t row, int64_t col) {
  double Dx, Dy, Dz;
  route_dir(t, static_cast<double>(col), static_cast<double>(row), Dx, Dy, Dz);
  double lo = t[16], hi = t[17];
  route_span(Dx, Dy, Dz, lo, hi);
  if (rc.has_bounds) route_clip(rc, t[9], t[10], t[11], Dx, Dy, Dz, lo, hi);
  const double ox = t[12], oy = t[13], oz = t[14], C0 = t[15];
  double a, B0;
  route_quad(rc, Dx, Dy, Dz, ox, oy, oz, a, B0);
  double bs[kMaxCells], cs[kMaxCells];
  bool in_lo = true, in_hi = true, out = false;
  for (int k = 0; k < rc.n; k++) {
    double b = route_b(rc, k, B0, Dx, Dy, Dz), c = route_c(rc, k, C0, ox, oy, oz);
    bool l = route_le0(a, b, c, lo), h = route_le0(a, b, c, hi);
    in_lo = in_lo && l;
    in_hi = in_hi && h;
    out = out || !(l || h);
    bs[k] = b; cs[k] = c;
  }
  if (in_lo || in_hi) return true;
  if (out && rc.m2 >= 1.0) return false;
  if (!(lo <= hi)) return false;
  return route_solve(a, bs, cs, rc.n, lo, hi);
}

// ------------------------------------------------------------------------------------- checks

/// The content checks of one sample's cache inputs (host only: both backends run them on host
/// copies of the small cameras/layout tensors before touching a pixel). cams (N, 18), lay (N, 4),
/// P pixels. Returns "" when valid, else the one-line error.
inline std::string check_cache(const float *cams, const int64_t *lay, int64_t N, int64_t P) {
  uint64_t expect = 0;
  for (int64_t i = 0; i < N; i++) {
    const int64_t *l = lay + 4 * i;
    if (!(l[1] > 0 && l[2] > 0)) return "dali_nerf ray_sampler: `layout` width/height must be > 0";
    if (static_cast<uint64_t>(l[0]) != expect)
      return "dali_nerf ray_sampler: `layout` offsets must be contiguous from 0 "
             "(offset[i+1] = offset[i] + width[i] * height[i])";
    const float *c = cams + 18 * i;
    if (!(c[12] != 0.f && c[13] != 0.f)) return "dali_nerf ray_sampler: `cameras` fx/fy must be non-zero";
    expect += static_cast<uint64_t>(l[1]) * static_cast<uint64_t>(l[2]);
  }
  if (expect != static_cast<uint64_t>(P))
    return "dali_nerf ray_sampler: `layout` covers " + std::to_string(expect) + " pixels but `pixels` has " +
           std::to_string(P);
  return "";
}

}  // namespace detail
}  // namespace dali_nerf

#endif  // DALI_NERF_OPS_RAY_MATH_H_
