// GEMMs: linear layers and the SwiGLU expert FFN over packed weight panels.

#include "common.h"

namespace ms {
namespace {

// ---------------------------------------------------------------------------------------
// GEMM: c[m, n] = sum_k a[m, k] * w[n, k], k ascending (acc = fma(a, w, acc)).
// Packed weights: panels of NR columns, each [K][NR] (column n of a panel at offset n),
// zero-padded past N, one after the other (`pstride` = K * NR floats apart).
//
// A micro-kernel computes ROWS rows x CV vectors (CV * VW columns, at most one column block
// of BLOCK_COLS) of consecutive panels, every accumulator a register: ROWS * CV accumulators,
// the weight vectors and one broadcast within the ISA's registers. Vector v reads panel
// v / VPP, so a kernel wider than a panel reads several panels, each front to back. The
// tile shape never changes a bit (each element is its own chain over k); it only decides
// how much of a weight load and of an `a` broadcast is reused.

constexpr int VPP = NR / VW;                          // vectors per panel
constexpr int BLOCK_COLS = 64;                        // columns a micro-kernel may span
constexpr int BLOCK_PANELS = BLOCK_COLS / NR;         // panels of one column block
static_assert(BLOCK_COLS % NR == 0, "a column block holds whole panels");
// Accumulator registers a micro-kernel may take (the rest hold weights and a broadcast).
constexpr int MAX_ACC = NUM_VREGS - 4;

// Vectors per micro-kernel for `rows` rows: the widest power-of-two slice of a column block
// whose accumulators fit (more independent add chains for few rows).
constexpr int cv_for(int rows) {
  int cv = BLOCK_COLS / VW;
  while (cv > 1 && rows * cv > MAX_ACC) cv /= 2;
  return cv;
}

// ROWS x (CV * VW) of c from `a` (rows lda apart) and the panels at b (b: the first
// column's place in its panel; vector v at b + (v / VPP) * pstride + (v % VPP) * VW).
// Keeps `cols` <= CV * VW columns. `prefetch` (or null): at every prefetch_every-th k, the
// NR floats at prefetch + k * NR are fetched into L2 (a hint: never faults, never a bit).
template <int ROWS, int CV>
inline void micro_kernel(const float* a, int64_t lda, const float* b, int64_t pstride,
                         int64_t k_len, float* c, int64_t ldc, int cols, const float* prefetch,
                         int64_t prefetch_every = 1) {
  vec acc[ROWS][CV];
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < CV; ++v) acc[m][v] = vec{};
  int64_t prefetch_k = prefetch != nullptr ? 0 : k_len;
  for (int64_t k = 0; k < k_len; ++k) {
    if (k == prefetch_k) {  // k-row k of the prefetch panel, every prefetch_every-th k
      for (int line = 0; line < NR; line += 16) __builtin_prefetch(prefetch + k * NR + line, 0, 2);
      prefetch_k += prefetch_every;
    }
    vec w[CV];
    for (int v = 0; v < CV; ++v) w[v] = loadv(b + (v / VPP) * pstride + k * NR + (v % VPP) * VW);
    for (int m = 0; m < ROWS; ++m) {
      const float av = a[m * lda + k];
      for (int v = 0; v < CV; ++v) acc[m][v] = fmadd(av, w[v], acc[m][v]);
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

// ROWS rows (at most MR) of one column block, in a single pass: `cols` columns of the
// panels at `block`. A kernel narrower than a panel walks each panel in slices; a wider
// one takes whole panels, and one panel at a time where fewer than it spans are left.
template <int ROWS>
inline void block_rows(const float* a, int64_t lda, const float* block, int64_t pstride,
                       int64_t k_len, float* c, int64_t ldc, int cols) {
  constexpr int CV = cv_for(ROWS), WIDTH = CV * VW;
  const int panels = (cols + NR - 1) / NR;
  if constexpr (WIDTH <= NR) {
    for (int p = 0; p < panels; ++p) {
      const int panel_cols = std::min(NR, cols - p * NR);
      for (int c0 = 0; c0 < panel_cols; c0 += WIDTH)
        micro_kernel<ROWS, CV>(a, lda, block + p * pstride + c0, pstride, k_len, c + p * NR + c0,
                               ldc, std::min(WIDTH, panel_cols - c0), nullptr);
    }
  } else {
    constexpr int SPAN = WIDTH / NR;  // panels a kernel reads
    int p = 0;
    for (; p + SPAN <= panels; p += SPAN)
      micro_kernel<ROWS, CV>(a, lda, block + p * pstride, pstride, k_len, c + p * NR, ldc,
                             std::min(WIDTH, cols - p * NR), nullptr);
    for (; p < panels; ++p)
      micro_kernel<ROWS, VPP>(a, lda, block + p * pstride, pstride, k_len, c + p * NR, ldc,
                              std::min(NR, cols - p * NR), nullptr);
  }
}

// ROWS rows of one panel (`cols` of its NR columns) in kernels no wider than the panel;
// the first slice fetches k-rows pass, pass + passes, ... of the panel at `prefetch` (or
// null: nothing) into L2, so the passes over a panel spread the next one's traffic evenly.
template <int ROWS>
inline void panel_rows(const float* a, int64_t lda, const float* panel, int64_t k_len, float* c,
                       int64_t ldc, int cols, const float* prefetch, int64_t pass,
                       int64_t passes) {
  constexpr int CV = cv_for(ROWS) < VPP ? cv_for(ROWS) : VPP, WIDTH = CV * VW;
  for (int c0 = 0; c0 < cols; c0 += WIDTH, prefetch = nullptr)
    micro_kernel<ROWS, CV>(a, lda, panel + c0, 0, k_len, c + c0, ldc, std::min(WIDTH, cols - c0),
                           prefetch != nullptr && pass < k_len ? prefetch + pass * NR : nullptr,
                           passes);
}

// rows x the columns of panels [panel_begin, panel_end) of a @ W^T.
//   * rows <= MR: one pass, column blocks of BLOCK_PANELS panels (few rows take kernels
//     wider than a panel: enough independent accumulators);
//   * more rows: panel by panel, the rows in ceil(rows / MR) passes of near-equal height
//     (3..MR rows, never a thin last pass), so a panel is read from memory once and from
//     L1 by the later passes, which together fetch the next panel into L2.
// Neither order nor height changes a bit.
void gemm_rows(const float* a, int64_t lda, int64_t rows, const float* packed, int64_t k_len,
               int64_t n_len, int64_t panel_begin, int64_t panel_end, float* c, int64_t ldc) {
  const int64_t pstride = k_len * NR;
  if (rows <= MR) {
    for (int64_t p = panel_begin; p < panel_end; p += BLOCK_PANELS) {
      const int64_t block_end = std::min(panel_end, p + BLOCK_PANELS);
      const int cols = static_cast<int>(std::min<int64_t>(n_len, block_end * NR) - p * NR);
      const float* block = packed + p * pstride;
      float* cp = c + p * NR;
      switch (rows) {
        case 6: block_rows<6>(a, lda, block, pstride, k_len, cp, ldc, cols); break;
        case 5: block_rows<5>(a, lda, block, pstride, k_len, cp, ldc, cols); break;
        case 4: block_rows<4>(a, lda, block, pstride, k_len, cp, ldc, cols); break;
        case 3: block_rows<3>(a, lda, block, pstride, k_len, cp, ldc, cols); break;
        case 2: block_rows<2>(a, lda, block, pstride, k_len, cp, ldc, cols); break;
        case 1: block_rows<1>(a, lda, block, pstride, k_len, cp, ldc, cols); break;
        default: break;
      }
    }
    return;
  }
  const int64_t passes = (rows + MR - 1) / MR, base = rows / passes, taller = rows % passes;
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const float* panel = packed + p * pstride;
    const int cols = static_cast<int>(std::min<int64_t>(NR, n_len - p * NR));
    const float* next = p + 1 < panel_end ? panel + pstride : nullptr;
    int64_t m = 0;
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int64_t h = base + (pass < taller);
      const float* am = a + m * lda;
      float* cm = c + m * ldc + p * NR;
      switch (h) {
        case 6: panel_rows<6>(am, lda, panel, k_len, cm, ldc, cols, next, pass, passes); break;
        case 5: panel_rows<5>(am, lda, panel, k_len, cm, ldc, cols, next, pass, passes); break;
        case 4: panel_rows<4>(am, lda, panel, k_len, cm, ldc, cols, next, pass, passes); break;
        default: panel_rows<3>(am, lda, panel, k_len, cm, ldc, cols, next, pass, passes); break;
      }
      m += h;
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

// A scratch buffer of at least n floats, grown (never shrunk) per thread and slot; its
// contents are not kept between uses.
template <int SLOT>
float* scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
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
  // Tasks: (row block of 4 * MR rows, group of 256 columns); grid order is irrelevant to
  // bits.
  constexpr int64_t GROUP_PANELS = 4 * BLOCK_PANELS;
  const int64_t panel_groups = (panels + GROUP_PANELS - 1) / GROUP_PANELS;
  parallel_for(threads, row_blocks * panel_groups, [&](int64_t task) {
    const int64_t rb = task / panel_groups, pg = task % panel_groups;
    const int64_t r0 = rb * 4 * MR, rows = std::min<int64_t>(4 * MR, m_len - r0);
    const int64_t p0 = pg * GROUP_PANELS, p1 = std::min<int64_t>(panels, p0 + GROUP_PANELS);
    gemm_rows(x + r0 * k_len, k_len, rows, packed, k_len, n_len, p0, p1, out + r0 * n_len, n_len);
    if (bias != nullptr)
      for (int64_t r = r0; r < r0 + rows; ++r)
        for (int64_t n = p0 * NR; n < std::min<int64_t>(n_len, p1 * NR); ++n)
          out[r * n_len + n] = out[r * n_len + n] + bias[n];
  });
}

// SwiGLU experts. x: [R, D]; ids: [R] in [0, E] (E = routed nowhere: row not computed);
// gate_up packed as gate/up panel pairs [E][2 * ceil(I / NR)][D][NR] (panel 2j: gate rows
// j * NR.., panel 2j + 1: up rows I + j * NR..; cpu.packed_gate_up()); down packed
// [E][ceil(D / NR)][I][NR]. out[r] = down_e(silu(gate_e x_r) * up_e x_r).
// The rows of an expert are taken in blocks of up to rows_per_block rows; each block reads
// its expert's weights once: threads split (block, 256 gate and 256 up columns) tasks,
// then (block, 128 output columns) tasks, so a block's weights stream through one core
// once whatever its number of rows (tasks long enough that few restart a stream, enough
// of them for two threads at decode: 8 experts x 2).
// Returns 0, or -1 (nothing computed) when an id is outside [0, E] or rows_per_block < 1.
int ms_expert_ffn(const float* x, const int64_t* ids, int64_t r_len, int64_t d, int64_t inter,
                  int64_t num_experts, const float* gate_up, const float* down, float* out,
                  int64_t rows_per_block, int threads) {
  if (rows_per_block < 1) return -1;
  for (int64_t r = 0; r < r_len; ++r)
    if (ids[r] < 0 || ids[r] > num_experts) return -1;
  // Rows in expert order (stable): sorted slot s holds row order[s].
  std::vector<int64_t> count(num_experts + 1, 0), order(r_len);
  for (int64_t r = 0; r < r_len; ++r) ++count[ids[r]];
  std::vector<int64_t> start(num_experts + 2, 0);
  for (int64_t e = 0; e <= num_experts; ++e) start[e + 1] = start[e] + count[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t r = 0; r < r_len; ++r) order[fill[ids[r]]++] = r;
  const int64_t routed = start[num_experts];
  struct Block { int64_t expert, first, rows; };
  std::vector<Block> blocks;
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t s = start[e]; s < start[e + 1]; s += rows_per_block)
      blocks.push_back({e, s, std::min<int64_t>(rows_per_block, start[e + 1] - s)});
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  if (num_blocks == 0) return 0;

  // xs / act / ys: [routed, D] / [routed, I] / [routed, D] in sorted order.
  float* xs = scratch<0>(routed * d);
  float* act = scratch<1>(routed * inter);
  float* ys = scratch<2>(routed * d);
  for (int64_t s = 0; s < routed; ++s) std::memcpy(xs + s * d, x + order[s] * d, sizeof(float) * d);

  // Gate and up: a task is (block, PAIRS pairs of gate and up panels: 256 columns each).
  const int64_t pairs = (inter + NR - 1) / NR, d_panels = (d + NR - 1) / NR;
  constexpr int64_t PAIRS = 4 * BLOCK_PANELS;
  const int64_t pair_groups = (pairs + PAIRS - 1) / PAIRS;
  parallel_for(threads, num_blocks * pair_groups, [&](int64_t task) {
    const Block b = blocks[task / pair_groups];
    const int64_t j0 = task % pair_groups * PAIRS, j1 = std::min(pairs, j0 + PAIRS);
    const int64_t width = 2 * (j1 - j0) * NR;  // gate and up columns of the task
    float* gu = scratch<3>(b.rows * width);  // [rows, width]: gate j0, up j0, gate j0 + 1, ...
    const float* w = gate_up + b.expert * 2 * pairs * d * NR;
    gemm_rows(xs + b.first * d, d, b.rows, w + 2 * j0 * d * NR, d, width, 0, 2 * (j1 - j0),
              gu, width);
    for (int64_t i = 0; i < b.rows; ++i)
      for (int64_t j = j0; j < j1; ++j) {
        const float* g = gu + i * width + 2 * (j - j0) * NR;
        silu_mul(g, g + NR, act + (b.first + i) * inter + j * NR, std::min<int64_t>(NR, inter - j * NR));
      }
  });
  // Down: a task is (block, DOWN_PANELS output panels: 128 columns).
  constexpr int64_t DOWN_PANELS = 2 * BLOCK_PANELS;
  const int64_t down_groups = (d_panels + DOWN_PANELS - 1) / DOWN_PANELS;
  parallel_for(threads, num_blocks * down_groups, [&](int64_t task) {
    const Block b = blocks[task / down_groups];
    const int64_t p0 = task % down_groups * DOWN_PANELS;
    const int64_t p1 = std::min<int64_t>(d_panels, p0 + DOWN_PANELS);
    gemm_rows(act + b.first * inter, inter, b.rows, down + b.expert * d_panels * inter * NR,
              inter, d, p0, p1, ys + b.first * d, d);
  });
  for (int64_t s = 0; s < routed; ++s) std::memcpy(out + order[s] * d, ys + s * d, sizeof(float) * d);
  return 0;
}

}  // extern "C"
