// Shared definitions of the compiled CPU kernels of megaserve.kernels.cpu (built from
// kernels/cpu_src/*.cpp into one library by kernels/cpu_ext.py, called through ctypes).
//
// Batch invariance and machine independence come from the arithmetic order, fixed in these
// sources and nowhere else:
//   * compiled with -ffp-contract=off and without -ffast-math: the compiler never fuses a
//     multiply and an add nor reassociates; `a * b + c` is a rounded multiply then a
//     rounded add. The only fused multiply-adds are the explicit fmadd() calls of the dot
//     products (GEMMs, attention scores and value sums): one rounding, as IEEE 754 defines
//     it, in every build (the FMA instruction of AVX2 / AVX-512, libm's correctly rounded
//     fmaf in the baseline build). The vector width the ISA flags pick (SSE2, AVX2,
//     AVX-512) only changes how many independent lanes run at once, never an element's
//     sequence of operations, so every build gives the same bits.
//   * GEMMs (linear, experts) accumulate each output element over k sequentially,
//     acc = fma(a[k], w[k], acc) for k = 0, 1, ..., K-1 (outer-product micro-kernels: the vector lanes are output
//     columns, never parts of one sum), so an element's bits depend only on its row, the
//     weights and K: not on M, on the micro-kernel height a row lands in, or on threads.
//   * Row sums (RMSNorm, log-softmax, routing, attention denominators) use SUM_LANES sums
//     (element j goes to lane j % SUM_LANES, in order) folded by the halving tree
//     lane[i] += lane[i + w] for w = 8, 4, 2, 1.
//   * exp and log are polynomials in this file (libm picks FMA / non-FMA code paths by
//     CPU), evaluated with + * / only.
//   * Threads split work by rows / (expert, row block) / tokens; a unit's arithmetic is
//     the same whichever thread runs it.
//
// Shape legend: M = rows, K = reduction, N = output features, D = hidden, I = expert
// intermediate, E = experts, T = query tokens, S = sequences, Hq / Hkv = heads, Dh = head dim.

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ms {

constexpr int MR = 6;          // rows per GEMM micro-kernel call (fewer for the last rows)
constexpr int SUM_LANES = 16;  // partial sums of every row sum

// The native vector: VW floats, the widest register the build's ISA flags allow (AVX-512:
// 16, AVX2: 8, SSE2: 4). Every kernel is written in `vec` (never in vectors wider than a
// register: GCC splits those through memory, ~100x slower) and its lanes are always
// independent elements (output columns, keys, ...), so VW changes how many elements run
// at once, never an element's operations: every build gives the same bits.
#if defined(__AVX512F__)
constexpr int VW = 16;
constexpr int NUM_VREGS = 32;
#elif defined(__AVX2__)
constexpr int VW = 8;
constexpr int NUM_VREGS = 16;
#else
constexpr int VW = 4;
constexpr int NUM_VREGS = 16;
#endif
// Output columns per packed weight panel (the packed layout, ms_panel_width()): the width
// of the MR-row micro-kernel, so that it reads a panel front to back, one contiguous stream
// (AVX-512: 4 vectors; AVX2 and SSE2: 16 columns).
constexpr int NR = VW == 16 ? 64 : 16;
static_assert(NR % VW == 0 && SUM_LANES % VW == 0, "vector width must divide the tiles");

typedef float vec __attribute__((vector_size(VW * sizeof(float))));
typedef int32_t veci __attribute__((vector_size(VW * sizeof(int32_t))));

inline vec loadv(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

// a * b + c rounded once, every lane. The AVX2 and AVX-512 builds use the FMA instruction
// (torch reports those capabilities only on CPUs with FMA3); the baseline build calls
// libm's fmaf, correctly rounded with or without FMA hardware: the same bits.
inline vec fmadd(vec a, vec b, vec c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__AVX2__)
  return _mm256_fmadd_ps(a, b, c);
#else
  vec out;
  for (int l = 0; l < VW; ++l) out[l] = std::fma(a[l], b[l], c[l]);
  return out;
#endif
}

// One lane of fmadd (a tail or a scalar loop that must match the vector lanes' bits).
inline float fmadd1(float a, float b, float c) { return std::fma(a, b, c); }

// a in every lane (a broadcast, no arithmetic: -0.0 stays -0.0).
inline vec splat(float a) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(a);
#elif defined(__AVX2__)
  return _mm256_set1_ps(a);
#elif defined(__SSE2__)
  return _mm_set1_ps(a);
#else
  vec v;
  for (int l = 0; l < VW; ++l) v[l] = a;
  return v;
#endif
}

// fmadd for a broadcast scalar a.
inline vec fmadd(float a, vec b, vec c) { return fmadd(splat(a), b, c); }

// Runs fn(task) for task in [0, num_tasks) on up to `threads` threads (the caller
// included), each task once; which thread runs a task never changes its bits.
void parallel_for(int threads, int64_t num_tasks, const std::function<void(int64_t)>& fn);

// ---------------------------------------------------------------------------------------
// exp / log with a fixed evaluation order (+ * / only), ~1-2 ulp.


// exp of each lane; the one exp of these kernels (scalars go through exp_array's padded
// tail).
inline vec expv(vec x) {
  const vec zero = vec{}, hi = zero + 88.72283f, lo = zero + -103.97208f;
  vec xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;  // NaN stays NaN (comparisons with NaN are false)
  const vec round = zero + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vec n = (xc * 1.44269504f + round) - round;
  // Cody-Waite: ln2 = C1 + C2, C1 with few mantissa bits so n * C1 is exact.
  vec r = xc - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  vec p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // Scale by 2^n in two steps (n >= -150 stays representable): halves of n are normal.
  const veci ni = __builtin_convertvector(n, veci);
  const veci e1 = ni >> 1, e2 = ni - e1;
  const vec s1 = (vec)((e1 + 127) << 23), s2 = (vec)((e2 + 127) << 23);
  vec out = p * s1 * s2;
  out = x > hi ? zero + __builtin_inff() : out;
  return x < lo ? zero : out;
}

// out[j] = exp(in[j]) for j < n (in place allowed).
inline void exp_array(const float* in, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + VW <= n; j += VW) storev(out + j, expv(loadv(in + j)));
  if (j < n) {
    float tmp[VW] = {0};
    std::memcpy(tmp, in + j, sizeof(float) * (n - j));
    storev(tmp, expv(loadv(tmp)));
    std::memcpy(out + j, tmp, sizeof(float) * (n - j));
  }
}

inline float log_fixed(float x) {
  if (!(x > 0.0f)) return x == 0.0f ? -__builtin_inff() : __builtin_nanf("");
  if (x == __builtin_inff()) return x;
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  int e = 0;
  if (bits < 0x00800000u) {  // subnormal: scale into the normal range
    x = x * 8388608.0f;
    std::memcpy(&bits, &x, 4);
    e = -23;
  }
  e += static_cast<int>(bits >> 23) - 127;
  uint32_t mbits = (bits & 0x007FFFFFu) | 0x3F800000u;
  float m;
  std::memcpy(&m, &mbits, 4);  // [1, 2)
  if (m > 1.41421356f) {
    m = m * 0.5f;
    e += 1;
  }
  // log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  float p = 0.1111111111f;
  p = p * s2 + 0.1428571429f;
  p = p * s2 + 0.2f;
  p = p * s2 + 0.3333333333f;
  const float log_m = 2.0f * s + 2.0f * s * s2 * p;
  const float ef = static_cast<float>(e);
  return ef * 0.693145751953125f + (ef * 1.428606765330187e-06f + log_m);
}

// Sum of n floats: element j into lane j % SUM_LANES, in order; then the halving tree.
inline float lane_sum(const float* x, int64_t n) {
  float lane[SUM_LANES] = {0};
  int64_t j = 0;
  for (; j + SUM_LANES <= n; j += SUM_LANES)
    for (int l = 0; l < SUM_LANES; ++l) lane[l] = lane[l] + x[j + l];
  for (int l = 0; j + l < n; ++l) lane[l] = lane[l] + x[j + l];
  for (int w = SUM_LANES / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] = lane[l] + lane[l + w];
  return lane[0];
}

// y = h / sqrt(mean(h^2) + eps) (* weight when weight != null), one row of d; sq: d floats
// of scratch. The one RMSNorm arithmetic of these kernels (y may alias h).
inline void rms_norm_row(const float* h, const float* weight, int64_t d, float eps, float* y,
                         float* sq) {
  for (int64_t j = 0; j < d; ++j) sq[j] = h[j] * h[j];
  const float inv = 1.0f / __builtin_sqrtf(lane_sum(sq, d) / static_cast<float>(d) + eps);
  if (weight)
    for (int64_t j = 0; j < d; ++j) y[j] = weight[j] * (h[j] * inv);
  else
    for (int64_t j = 0; j < d; ++j) y[j] = h[j] * inv;
}

}  // namespace ms
