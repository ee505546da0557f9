// GEMMs: linear layers and the SwiGLU expert FFN over packed weight panels.

#include "common.h"

namespace ms {
namespace {

// ---------------------------------------------------------------------------------------
// GEMM: c[m, n] = sum_k a[m, k] * w[n, k], k ascending (acc = fma(a, w, acc)), for one
// packed panel of NR columns.
// Panel layout: [K][NR] (column n of the panel at offset n), zero-padded past N.
//
// A micro-kernel computes ROWS rows x CV vectors (CV * VW columns) of a panel, every
// accumulator a register: ROWS * CV accumulators, CV weight vectors and one broadcast
// within the ISA's registers. The tile shape never changes a bit (each element is its own
// chain over k); it only decides how much of a weight load and of an `a` broadcast is
// reused.

// Accumulator registers a micro-kernel may take (the rest hold weights and a broadcast).
constexpr int MAX_ACC = NUM_VREGS - 4;

// Vectors per micro-kernel for `rows` rows: the widest power-of-two slice of the panel
// whose accumulators fit (more independent add chains for few rows).
constexpr int cv_for(int rows) {
  int cv = NR / VW;
  while (cv > 1 && rows * cv > MAX_ACC) cv /= 2;
  return cv;
}

template <int ROWS, int CV>
inline void micro_kernel(const float* a, int64_t lda, const float* panel, int64_t k_len,
                         float* c, int64_t ldc, int cols, const float* prefetch) {
  vec acc[ROWS][CV];
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < CV; ++v) acc[m][v] = vec{};
  for (int64_t k = 0; k < k_len; ++k) {
    if (prefetch != nullptr)  // the next panel's row k, into L2 (4 cache lines)
      for (int line = 0; line < NR; line += 16) __builtin_prefetch(prefetch + k * NR + line, 0, 2);
    vec b[CV];
    for (int v = 0; v < CV; ++v) b[v] = loadv(panel + k * NR + v * VW);
    for (int m = 0; m < ROWS; ++m) {
      const float av = a[m * lda + k];
      for (int v = 0; v < CV; ++v) acc[m][v] = fmadd(av, b[v], acc[m][v]);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    if (cols == CV * VW) {
      for (int v = 0; v < CV; ++v) storev(c + m * ldc + v * VW, acc[m][v]);
    } else {
      float tmp[CV * VW];
      for (int v = 0; v < CV; ++v) storev(tmp + v * VW, acc[m][v]);
      std::memcpy(c + m * ldc, tmp, sizeof(float) * cols);
    }
  }
}

// ROWS rows of one panel, CV * VW columns at a time; `cols` of the panel's NR are kept.
// Only the first column slice prefetches (the next panel's rows, once).
template <int ROWS>
inline void panel_rows(const float* a, int64_t lda, const float* panel, int64_t k_len, float* c,
                       int64_t ldc, int cols, const float* prefetch) {
  constexpr int CV = cv_for(ROWS), WIDTH = CV * VW;
  for (int c0 = 0; c0 < cols; c0 += WIDTH, prefetch = nullptr)
    micro_kernel<ROWS, CV>(a, lda, panel + c0, k_len, c + c0, ldc, std::min(WIDTH, cols - c0),
                           prefetch);
}

// rows x [n_begin, n_end) of a @ W^T for panels n_begin / NR .. (n_end - 1) / NR.
void gemm_rows(const float* a, int64_t lda, int64_t rows, const float* packed, int64_t k_len,
               int64_t n_len, int64_t panel_begin, int64_t panel_end, float* c, int64_t ldc) {
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const float* panel = packed + p * k_len * NR;
    const int cols = static_cast<int>(std::min<int64_t>(NR, n_len - p * NR));
    float* cp = c + p * NR;
    // With more rows than one pass takes, the first pass over this panel also fetches the
    // next panel into L2, so the other passes overlap its memory traffic (no effect on any
    // bit). A single pass streams the panels in order, which the hardware prefetches.
    const float* next = p + 1 < panel_end && rows > MR ? panel + k_len * NR : nullptr;
    int64_t m = 0;
    for (; m + MR <= rows; m += MR, next = nullptr)
      panel_rows<MR>(a + m * lda, lda, panel, k_len, cp + m * ldc, ldc, cols, next);
    const float* am = a + m * lda;
    float* cm = cp + m * ldc;
    switch (rows - m) {
      case 5: panel_rows<5>(am, lda, panel, k_len, cm, ldc, cols, next); break;
      case 4: panel_rows<4>(am, lda, panel, k_len, cm, ldc, cols, next); break;
      case 3: panel_rows<3>(am, lda, panel, k_len, cm, ldc, cols, next); break;
      case 2: panel_rows<2>(am, lda, panel, k_len, cm, ldc, cols, next); break;
      case 1: panel_rows<1>(am, lda, panel, k_len, cm, ldc, cols, next); break;
      default: break;
    }
  }
}

// out[j] = silu(gate[j]) * up[j] = gate[j] / (1 + exp(-gate[j])) * up[j], j < n.
inline void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  const vec one = vec{} + 1.0f;
  int64_t j = 0;
  for (; j + VW <= n; j += VW) {
    const vec g = loadv(gate + j);
    storev(out + j, g / (one + expv(-g)) * loadv(up + j));
  }
  if (j < n) {
    float g[VW] = {0}, u[VW] = {0};
    std::memcpy(g, gate + j, sizeof(float) * (n - j));
    std::memcpy(u, up + j, sizeof(float) * (n - j));
    silu_mul(g, u, g, VW);
    std::memcpy(out + j, g, sizeof(float) * (n - j));
  }
}

}  // namespace
}  // namespace ms

using namespace ms;

extern "C" {


// Output columns per packed weight panel: the layout cpu.packed() writes.
int ms_panel_width() { return NR; }

// out[M, N] = x[M, K] @ W^T (+ bias[N]); W packed as [ceil(N / NR), K, NR].
void ms_linear(const float* x, int64_t m_len, int64_t k_len, const float* packed, int64_t n_len,
               const float* bias, float* out, int threads) {
  const int64_t panels = (n_len + NR - 1) / NR;
  const int64_t row_blocks = (m_len + 4 * MR - 1) / (4 * MR);
  // Tasks: (row block of 4 * MR rows, group of 4 panels); grid order is irrelevant to bits.
  const int64_t panel_groups = (panels + 3) / 4;
  parallel_for(threads, row_blocks * panel_groups, [&](int64_t task) {
    const int64_t rb = task / panel_groups, pg = task % panel_groups;
    const int64_t r0 = rb * 4 * MR, rows = std::min<int64_t>(4 * MR, m_len - r0);
    const int64_t p0 = pg * 4, p1 = std::min<int64_t>(panels, p0 + 4);
    gemm_rows(x + r0 * k_len, k_len, rows, packed, k_len, n_len, p0, p1, out + r0 * n_len, n_len);
    if (bias != nullptr)
      for (int64_t r = r0; r < r0 + rows; ++r)
        for (int64_t n = p0 * NR; n < std::min<int64_t>(n_len, p1 * NR); ++n)
          out[r * n_len + n] = out[r * n_len + n] + bias[n];
  });
}

// SwiGLU experts. x: [R, D]; ids: [R] in [0, E] (E = routed nowhere: row not computed);
// gate_up packed [E][ceil(2I / NR)][D][NR] (rows 0..I-1 gate, I..2I-1 up); down packed
// [E][ceil(D / NR)][I][NR]. out[r] = down_e(silu(gate_e x_r) * up_e x_r). Each task (one
// thread's unit of work) takes up to rows_per_task rows of one expert.
// Returns 0, or -1 (nothing computed) when an id is outside [0, E].
int ms_expert_ffn(const float* x, const int64_t* ids, int64_t r_len, int64_t d, int64_t inter,
                  int64_t num_experts, const float* gate_up, const float* down, float* out,
                  int64_t rows_per_task, int threads) {
  for (int64_t r = 0; r < r_len; ++r)
    if (ids[r] < 0 || ids[r] > num_experts) return -1;
  std::vector<int64_t> count(num_experts + 1, 0), order(r_len);
  for (int64_t r = 0; r < r_len; ++r) ++count[ids[r]];
  std::vector<int64_t> start(num_experts + 2, 0);
  for (int64_t e = 0; e <= num_experts; ++e) start[e + 1] = start[e] + count[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t r = 0; r < r_len; ++r) order[fill[ids[r]]++] = r;
  struct Task { int64_t expert, first, rows; };
  std::vector<Task> tasks;
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t s = start[e]; s < start[e + 1]; s += rows_per_task)
      tasks.push_back({e, s, std::min<int64_t>(rows_per_task, start[e + 1] - s)});
  const int64_t two_i = 2 * inter;
  const int64_t gu_panels = (two_i + NR - 1) / NR, d_panels = (d + NR - 1) / NR;
  parallel_for(threads, static_cast<int64_t>(tasks.size()), [&](int64_t t) {
    const Task task = tasks[t];
    thread_local std::vector<float> xs, gu, act, ys;
    xs.resize(rows_per_task * d);
    gu.resize(rows_per_task * two_i);
    act.resize(rows_per_task * inter);
    ys.resize(rows_per_task * d);
    for (int64_t i = 0; i < task.rows; ++i)
      std::memcpy(&xs[i * d], x + order[task.first + i] * d, sizeof(float) * d);
    const float* gu_w = gate_up + task.expert * gu_panels * d * NR;
    const float* d_w = down + task.expert * d_panels * inter * NR;
    gemm_rows(xs.data(), d, task.rows, gu_w, d, two_i, 0, gu_panels, gu.data(), two_i);
    for (int64_t i = 0; i < task.rows; ++i)
      silu_mul(&gu[i * two_i], &gu[i * two_i + inter], &act[i * inter], inter);
    gemm_rows(act.data(), inter, task.rows, d_w, inter, d, 0, d_panels, ys.data(), d);
    for (int64_t i = 0; i < task.rows; ++i)
      std::memcpy(out + order[task.first + i] * d, &ys[i * d], sizeof(float) * d);
  });
  return 0;
}

}  // extern "C"
