// Compiled CPU kernels of megaserve.kernels.cpu (loaded by kernels/cpu_ext.py through ctypes).
//
// Batch invariance and machine independence come from the arithmetic order, fixed in this
// source and nowhere else:
//   * compiled with -ffp-contract=off and without -ffast-math: every `a * b + c` is a
//     rounded multiply then a rounded add, never a fused multiply-add, and the compiler may
//     not reassociate. The vector width the ISA flags pick (SSE2, AVX2, AVX-512) only
//     changes how many independent lanes run at once, never an element's sequence of
//     operations, so every build gives the same bits.
//   * GEMMs (linear, experts) accumulate each output element over k sequentially,
//     k = 0, 1, ..., K-1 (outer-product micro-kernels: the vector lanes are output
//     columns, never parts of one sum), so an element's bits depend only on its row, the
//     weights and K: not on M, on the micro-kernel height a row lands in, or on threads.
//   * Row sums (RMSNorm, log-softmax, attention denominators) use SUM_LANES partial sums
//     (element j goes to lane j % SUM_LANES, in order) folded by the halving tree
//     lane[i] += lane[i + w] for w = 8, 4, 2, 1.
//   * exp and log are polynomials in this file (libm picks FMA / non-FMA code paths by
//     CPU), evaluated with + * / only.
//   * Threads split work by rows / (expert, row block) / tokens; a unit's arithmetic is
//     the same whichever thread runs it.
//
// Shape legend: M = rows, K = reduction, N = output features, D = hidden, I = expert
// intermediate, E = experts, T = query tokens, S = sequences, Hq / Hkv = heads, Dh = head dim.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#include <unistd.h>

namespace {

constexpr int NR = 64;         // output columns per packed weight panel (four 16-lane vectors)
constexpr int MR = 6;          // rows per GEMM micro-kernel call (fewer for the last rows)
constexpr int SUM_LANES = 16;  // partial sums of every row sum

typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// ---------------------------------------------------------------------------------------
// A fixed thread pool: run(num_tasks, fn) calls fn(task) for every task, spread over up
// to `threads` threads (this one included), each task once; which thread runs a task never
// changes its bits. One pool per process (see pool()).

class Pool {
 public:
  void run(int threads, int64_t num_tasks, const std::function<void(int64_t)>& fn) {
    if (threads <= 1 || num_tasks <= 1) {
      for (int64_t t = 0; t < num_tasks; ++t) fn(t);
      return;
    }
    std::lock_guard<std::mutex> call(call_mutex_);  // one parallel call at a time
    while (static_cast<int>(threads_.size()) < threads - 1) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { loop(index); });
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      num_tasks_ = num_tasks;
      next_.store(0);
      active_ = std::min<int64_t>(threads - 1, num_tasks - 1);
      pending_ = active_;
      ++generation_;
    }
    wake_.notify_all();
    work();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void work() {
    for (int64_t t = next_.fetch_add(1); t < num_tasks_; t = next_.fetch_add(1)) (*fn_)(t);
  }

  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= active_) continue;
      }
      work();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex call_mutex_, mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int64_t active_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
};

// This process's pool. HAZARD: a forked child inherits the parent's pool object but not
// its threads, and its mutexes and condition variables may record waiters that do not
// exist there; the child gets a fresh pool and the inherited one is leaked, never touched.
// Pools are never destroyed: helper threads block in them until the process exits.
Pool& pool() {
  static Pool* current = nullptr;
  static pid_t owner = -1;
  if (owner != getpid()) {
    current = new Pool();
    owner = getpid();
  }
  return *current;
}

// ---------------------------------------------------------------------------------------
// exp / log with a fixed evaluation order (+ * / only), ~1-2 ulp.

typedef int32_t v16i __attribute__((vector_size(64)));

// exp of 16 lanes; the one exp of this file (scalars go through exp_array's padded tail).
inline v16 exp16(v16 x) {
  const v16 zero = v16{}, hi = zero + 88.72283f, lo = zero + -103.97208f;
  v16 xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;  // NaN stays NaN (comparisons with NaN are false)
  const v16 round = zero + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const v16 n = (xc * 1.44269504f + round) - round;
  // Cody-Waite: ln2 = C1 + C2, C1 with few mantissa bits so n * C1 is exact.
  v16 r = xc - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  v16 p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // Scale by 2^n in two steps (n >= -150 stays representable): halves of n are normal.
  const v16i ni = __builtin_convertvector(n, v16i);
  const v16i e1 = ni >> 1, e2 = ni - e1;
  const v16 s1 = (v16)((e1 + 127) << 23), s2 = (v16)((e2 + 127) << 23);
  v16 out = p * s1 * s2;
  out = x > hi ? zero + __builtin_inff() : out;
  return x < lo ? zero : out;
}

// out[j] = exp(in[j]) for j < n (in place allowed).
inline void exp_array(const float* in, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) store16(out + j, exp16(load16(in + j)));
  if (j < n) {
    float tmp[16] = {0};
    std::memcpy(tmp, in + j, sizeof(float) * (n - j));
    store16(tmp, exp16(load16(tmp)));
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

// ---------------------------------------------------------------------------------------
// GEMM: c[m, n] = sum_k a[m, k] * w[n, k], k ascending, for one packed panel of NR columns.
// Panel layout: [K][NR] (column n of the panel at offset n), zero-padded past N.

template <int ROWS>
inline void micro_kernel(const float* a, int64_t lda, const float* panel, int64_t k_len,
                         float* c, int64_t ldc, int cols) {
  v16 acc[ROWS][4];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = v16{};
  for (int64_t k = 0; k < k_len; ++k) {
    const v16 b0 = load16(panel + k * NR), b1 = load16(panel + k * NR + 16);
    const v16 b2 = load16(panel + k * NR + 32), b3 = load16(panel + k * NR + 48);
    for (int m = 0; m < ROWS; ++m) {
      const float av = a[m * lda + k];
      acc[m][0] = acc[m][0] + av * b0;
      acc[m][1] = acc[m][1] + av * b1;
      acc[m][2] = acc[m][2] + av * b2;
      acc[m][3] = acc[m][3] + av * b3;
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    float tmp[NR];
    for (int v = 0; v < 4; ++v) store16(tmp + 16 * v, acc[m][v]);
    std::memcpy(c + m * ldc, tmp, sizeof(float) * cols);
  }
}

// rows x [n_begin, n_end) of a @ W^T for panels n_begin / NR .. (n_end - 1) / NR.
void gemm_rows(const float* a, int64_t lda, int64_t rows, const float* packed, int64_t k_len,
               int64_t n_len, int64_t panel_begin, int64_t panel_end, float* c, int64_t ldc) {
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const float* panel = packed + p * k_len * NR;
    const int cols = static_cast<int>(std::min<int64_t>(NR, n_len - p * NR));
    float* cp = c + p * NR;
    int64_t m = 0;
    for (; m + MR <= rows; m += MR)
      micro_kernel<MR>(a + m * lda, lda, panel, k_len, cp + m * ldc, ldc, cols);
    const float* am = a + m * lda;
    float* cm = cp + m * ldc;
    switch (rows - m) {
                  case 5: micro_kernel<5>(am, lda, panel, k_len, cm, ldc, cols); break;
      case 4: micro_kernel<4>(am, lda, panel, k_len, cm, ldc, cols); break;
      case 3: micro_kernel<3>(am, lda, panel, k_len, cm, ldc, cols); break;
      case 2: micro_kernel<2>(am, lda, panel, k_len, cm, ldc, cols); break;
      case 1: micro_kernel<1>(am, lda, panel, k_len, cm, ldc, cols); break;
      default: break;
    }
  }
}

// out[j] = silu(gate[j]) * up[j] = gate[j] / (1 + exp(-gate[j])) * up[j], j < n.
inline void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  const v16 one = v16{} + 1.0f;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const v16 g = load16(gate + j);
    store16(out + j, g / (one + exp16(-g)) * load16(up + j));
  }
  if (j < n) {
    float g[16] = {0}, u[16] = {0};
    std::memcpy(g, gate + j, sizeof(float) * (n - j));
    std::memcpy(u, up + j, sizeof(float) * (n - j));
    silu_mul(g, u, g, 16);
    std::memcpy(out + j, g, sizeof(float) * (n - j));
  }
}

}  // namespace

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
  pool().run(threads, row_blocks * panel_groups, [&](int64_t task) {
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
  pool().run(threads, static_cast<int64_t>(tasks.size()), [&](int64_t t) {
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

// h = x (+ residual); y = h / sqrt(mean(h^2) + eps) (* weight when weight != null).
// x, residual, h_out, y: [M, D]; h_out may be null when residual is null.
void ms_rms_norm(const float* x, const float* residual, const float* weight, int64_t m_len,
                 int64_t d, float eps, float* y, float* h_out, int threads) {
  const int64_t block = 64;
  pool().run(threads, (m_len + block - 1) / block, [&](int64_t task) {
    thread_local std::vector<float> h, sq;
    h.resize(d);
    sq.resize(d);
    for (int64_t r = task * block; r < std::min(m_len, (task + 1) * block); ++r) {
      const float* xr = x + r * d;
      for (int64_t j = 0; j < d; ++j) h[j] = residual ? xr[j] + residual[r * d + j] : xr[j];
      if (h_out) std::memcpy(h_out + r * d, h.data(), sizeof(float) * d);
      for (int64_t j = 0; j < d; ++j) sq[j] = h[j] * h[j];
      const float inv = 1.0f / __builtin_sqrtf(lane_sum(sq.data(), d) / static_cast<float>(d) + eps);
      float* yr = y + r * d;
      if (weight)
        for (int64_t j = 0; j < d; ++j) yr[j] = weight[j] * (h[j] * inv);
      else
        for (int64_t j = 0; j < d; ++j) yr[j] = h[j] * inv;
    }
  });
}

// Softmax routing with a stable top-k. logits: [T, E]; ids: [T, k] int64; weights:
// [T, k]. p = exp(x - max) / lane_sum(exp(x - max)); the k largest p in descending order,
// ties to the lower expert id; with renormalize, weights / lane_sum(weights).
void ms_topk_route(const float* logits, int64_t t_len, int64_t e, int64_t k, int renormalize,
                   int64_t* ids, float* weights, int threads) {
  pool().run(threads, (t_len + 63) / 64, [&](int64_t task) {
    thread_local std::vector<float> p_buf;
    thread_local std::vector<char> taken_buf;
    p_buf.resize(e);
    taken_buf.resize(e);
    float* p = p_buf.data();
    char* taken = taken_buf.data();
    for (int64_t t = task * 64; t < std::min(t_len, (task + 1) * 64); ++t) {
      const float* x = logits + t * e;
      float mx = x[0];
      for (int64_t j = 1; j < e; ++j) mx = x[j] > mx ? x[j] : mx;
      for (int64_t j = 0; j < e; ++j) p[j] = x[j] - mx;
      exp_array(p, p, e);
      const float sum = lane_sum(p, e);
      for (int64_t j = 0; j < e; ++j) p[j] = p[j] / sum;
      std::fill(taken, taken + e, 0);
      float* w = weights + t * k;
      for (int64_t r = 0; r < k; ++r) {
        int64_t best = -1;
        for (int64_t j = 0; j < e; ++j)
          if (!taken[j] && (best < 0 || p[j] > p[best])) best = j;
        taken[best] = 1;
        ids[t * k + r] = best;
        w[r] = p[best];
      }
      if (renormalize) {
        const float total = lane_sum(w, k);
        for (int64_t r = 0; r < k; ++r) w[r] = w[r] / total;
      }
    }
  });
}

// out[t, :] = ((w[t, 0] * x[t, 0, :] + w[t, 1] * x[t, 1, :]) + ...), ranks ascending.
// x: [T, k, D]; w: [T, k]; out: [T, D].
void ms_combine(const float* x, const float* w, int64_t t_len, int64_t k, int64_t d, float* out,
                int threads) {
  pool().run(threads, (t_len + 63) / 64, [&](int64_t task) {
    for (int64_t t = task * 64; t < std::min(t_len, (task + 1) * 64); ++t) {
      float* o = out + t * d;
      const float* xt = x + t * k * d;
      for (int64_t j = 0; j < d; ++j) o[j] = w[t * k] * xt[j];
      for (int64_t r = 1; r < k; ++r)
        for (int64_t j = 0; j < d; ++j) o[j] = o[j] + w[t * k + r] * xt[r * d + j];
    }
  });
}

// out[b, :] = x[b, :] - max - log(sum(exp(x[b, :] - max))). x, out: [B, V].
void ms_log_softmax(const float* x, int64_t b_len, int64_t v, float* out, int threads) {
  pool().run(threads, b_len, [&](int64_t b) {
    thread_local std::vector<float> e;
    e.resize(v);
    const float* xr = x + b * v;
    float mx = -__builtin_inff();
    for (int64_t j = 0; j < v; ++j) mx = xr[j] > mx ? xr[j] : mx;
    for (int64_t j = 0; j < v; ++j) e[j] = xr[j] - mx;
    exp_array(e.data(), e.data(), v);
    const float log_sum = log_fixed(lane_sum(e.data(), v));
    for (int64_t j = 0; j < v; ++j) out[b * v + j] = (xr[j] - mx) - log_sum;
  });
}

}  // extern "C"

namespace {

// In-place transpose of a 16 x 16 block held as 16 row vectors (only moves values).
// Stage s swaps bit s of the row and column index of every element; after the four
// stages element (r, c) holds the original (c, r).
inline void transpose16(v16* rows) {
  static const v16i lo[4] = {
      {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
      {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
      {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
      {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}};
  static const v16i hi[4] = {
      {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
      {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
      {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
      {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}};
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) {
    const int s = 1 << b;
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      if (r & s) continue;
      const v16 x = rows[r], y = rows[r | s];
      rows[r] = __builtin_shuffle(x, y, lo[b]);
      rows[r | s] = __builtin_shuffle(x, y, hi[b]);
    }
  }
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {  // bfloat16 bits -> float (exact)
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// out_g[d] = sum_j p_g[j] * v_j[d], j ascending, for heads g < group; NV = dh / 16.
// Accumulators live in registers; two heads at a time give independent add chains.
template <int NV>
void attend_values(const float* const* vrows, const float* scores, int64_t padded,
                   int64_t len, int64_t group, float* acc) {
  int64_t g = 0;
  for (; g + 2 <= group; g += 2) {
    v16 a0[NV], a1[NV];
    for (int v = 0; v < NV; ++v) a0[v] = a1[v] = v16{};
    const float* p0 = scores + g * padded;
    const float* p1 = p0 + padded;
    for (int64_t j = 0; j < len; ++j) {
      const float* vr = vrows[j];
      for (int v = 0; v < NV; ++v) {
        const v16 x = load16(vr + 16 * v);
        a0[v] = a0[v] + p0[j] * x;
        a1[v] = a1[v] + p1[j] * x;
      }
    }
    for (int v = 0; v < NV; ++v) {
      store16(acc + g * NV * 16 + 16 * v, a0[v]);
      store16(acc + (g + 1) * NV * 16 + 16 * v, a1[v]);
    }
  }
  for (; g < group; ++g) {
    v16 a0[NV];
    for (int v = 0; v < NV; ++v) a0[v] = v16{};
    const float* p0 = scores + g * padded;
    for (int64_t j = 0; j < len; ++j)
      for (int v = 0; v < NV; ++v) a0[v] = a0[v] + p0[j] * load16(vrows[j] + 16 * v);
    for (int v = 0; v < NV; ++v) store16(acc + g * NV * 16 + 16 * v, a0[v]);
  }
}

// The same sums for any dh (one lane per element, same order as attend_values).
void attend_values_any(const float* const* vrows, const float* scores, int64_t padded,
                       int64_t len, int64_t group, int64_t dh, float* acc) {
  std::fill(acc, acc + group * dh, 0.0f);
  for (int64_t j = 0; j < len; ++j)
    for (int64_t g = 0; g < group; ++g)
      for (int64_t dd = 0; dd < dh; ++dd)
        acc[g * dh + dd] = acc[g * dh + dd] + scores[g * padded + j] * vrows[j][dd];
}

// s[j] = (sum_d q[d] * kt[d][j], d ascending) * scale for j < padded (multiple of 16);
// four 16-key blocks at a time for independent add chains (each lane's order unchanged).
void attend_scores(const float* q, const float* kt, int64_t padded, int64_t dh, float scale,
                   float* s) {
  int64_t j0 = 0;
  for (; j0 + 64 <= padded; j0 += 64) {
    v16 d0 = v16{}, d1 = v16{}, d2 = v16{}, d3 = v16{};
    for (int64_t dd = 0; dd < dh; ++dd) {
      const float qd = q[dd];
      const float* k = kt + dd * padded + j0;
      d0 = d0 + qd * load16(k);
      d1 = d1 + qd * load16(k + 16);
      d2 = d2 + qd * load16(k + 32);
      d3 = d3 + qd * load16(k + 48);
    }
    store16(s + j0, d0 * scale);
    store16(s + j0 + 16, d1 * scale);
    store16(s + j0 + 32, d2 * scale);
    store16(s + j0 + 48, d3 * scale);
  }
  for (; j0 < padded; j0 += 16) {
    v16 d0 = v16{};
    for (int64_t dd = 0; dd < dh; ++dd) d0 = d0 + q[dd] * load16(kt + dd * padded + j0);
    store16(s + j0, d0 * scale);
  }
}

// Scores -> exp(score - max) in place; keys past len get exactly 0.
void softmax_numerators(float* s, int64_t len, int64_t padded) {
  for (int64_t j = len; j < padded; ++j) s[j] = -__builtin_inff();
  v16 mx16 = load16(s);
  for (int64_t j0 = 16; j0 < padded; j0 += 16) {
    const v16 v = load16(s + j0);
    mx16 = v > mx16 ? v : mx16;
  }
  float mx = mx16[0];  // key 0 is always visible: finite unless q or k is not
  for (int l = 1; l < 16; ++l) mx = mx16[l] > mx ? mx16[l] : mx;
  for (int64_t j0 = 0; j0 < padded; j0 += 16) store16(s + j0, exp16(load16(s + j0) - mx));
}

// Causal paged attention, one query token per task.
// q, out: [T, Hq, Dh]; caches: [num_blocks, block_size, Hkv, Dh] (float or bfloat16);
// block_tables: [S, max_blocks] int32; context_lens: [S] int32; query_start_loc: [S + 1].
// Token t of sequence s sits at position context_lens[s] - (its row's distance from the
// end of s's rows); it sees keys 0..position and nothing else (unowned slots never read).
//   score_j = (sum_d q[d] * k_j[d], d ascending) * scale
//   p_j = exp(score_j - max_j score_j); denom = lane_sum(p)
//   out[d] = (sum_j p_j * v_j[d], j ascending) / denom
template <typename C>
void paged_attention(const float* q, const C* k_cache, const C* v_cache,
                     const int32_t* block_tables, int64_t max_blocks,
                     const int32_t* context_lens, const int32_t* query_start_loc,
                     int64_t num_seqs, int64_t num_tokens, int64_t hq, int64_t hkv,
                     int64_t dh, int64_t block_size, float scale, float* out, int threads) {
  std::vector<int64_t> seq_of(num_tokens), pos_of(num_tokens);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t begin = query_start_loc[s], end = query_start_loc[s + 1];
    for (int64_t t = begin; t < end; ++t) {
      seq_of[t] = s;
      pos_of[t] = context_lens[s] - (end - t);
    }
  }
  const int64_t group = hq / hkv, row = hkv * dh;
  pool().run(threads, num_tokens, [&](int64_t t) {
    const int64_t len = pos_of[t] + 1;
    const int64_t padded = (len + 15) / 16 * 16;  // keys past len: score -inf, p exactly 0
    const int32_t* table = block_tables + seq_of[t] * max_blocks;
    thread_local std::vector<float> kt_buf, scores_buf, acc_buf, kf_buf, vf_buf;
    thread_local std::vector<const float*> rows_buf;
    kt_buf.assign(dh * padded, 0.0f);
    scores_buf.resize(group * padded);
    acc_buf.resize(group * dh);
    rows_buf.resize(2 * len);
    if (!std::is_same<C, float>::value) {
      kf_buf.resize(len * dh);
      vf_buf.resize(len * dh);
    }
    // Raw pointers: a thread_local in a loop may cost a TLS lookup per access.
    float* __restrict kt = kt_buf.data();
    float* __restrict scores = scores_buf.data();
    float* __restrict acc = acc_buf.data();
    const float** krows = rows_buf.data();
    const float** vrows = krows + len;
    for (int64_t kv = 0; kv < hkv; ++kv) {
      // Float views of this kv head's key and value rows (bfloat16 converted).
      for (int64_t j = 0; j < len; ++j) {
        const int64_t slot = static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size;
        const C* krow = k_cache + slot * row + kv * dh;
        const C* vrow = v_cache + slot * row + kv * dh;
        if constexpr (std::is_same<C, float>::value) {
          krows[j] = krow;
          vrows[j] = vrow;
        } else {
          float* kf = &kf_buf[j * dh];
          float* vf = &vf_buf[j * dh];
          for (int64_t dd = 0; dd < dh; ++dd) kf[dd] = to_float(krow[dd]);
          for (int64_t dd = 0; dd < dh; ++dd) vf[dd] = to_float(vrow[dd]);
          krows[j] = kf;
          vrows[j] = vf;
        }
      }
      // Keys transposed: kt[d][j]; keys past len stay 0 (never read from the cache).
      if (dh % 16 == 0) {
        v16 block[16];
        for (int64_t j0 = 0; j0 < padded; j0 += 16)
          for (int64_t d0 = 0; d0 < dh; d0 += 16) {
            for (int64_t i = 0; i < 16; ++i)
              block[i] = j0 + i < len ? load16(krows[j0 + i] + d0) : v16{};
            transpose16(block);
            for (int64_t i = 0; i < 16; ++i) store16(&kt[(d0 + i) * padded + j0], block[i]);
          }
      } else {
        for (int64_t j = 0; j < len; ++j)
          for (int64_t dd = 0; dd < dh; ++dd) kt[dd * padded + j] = krows[j][dd];
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores + g * padded;
        attend_scores(q + (t * hq + kv * group + g) * dh, kt, padded, dh, scale, sg);
        softmax_numerators(sg, len, padded);
      }
      switch (dh) {
        case 16: attend_values<1>(vrows, scores, padded, len, group, acc); break;
        case 32: attend_values<2>(vrows, scores, padded, len, group, acc); break;
        case 64: attend_values<4>(vrows, scores, padded, len, group, acc); break;
        case 128: attend_values<8>(vrows, scores, padded, len, group, acc); break;
        default: attend_values_any(vrows, scores, padded, len, group, dh, acc); break;
      }
      for (int64_t g = 0; g < group; ++g) {
        const float denom = lane_sum(scores + g * padded, len);
        float* o = out + (t * hq + kv * group + g) * dh;
        for (int64_t dd = 0; dd < dh; ++dd) o[dd] = acc[g * dh + dd] / denom;
      }
    }
  });
}

}  // namespace

extern "C" {

#define MS_ATTENTION(NAME, C)                                                                  \
  void NAME(const float* q, const C* k_cache, const C* v_cache, const int32_t* block_tables,   \
            int64_t max_blocks, const int32_t* context_lens, const int32_t* query_start_loc,   \
            int64_t num_seqs, int64_t num_tokens, int64_t hq, int64_t hkv, int64_t dh,         \
            int64_t block_size, float scale, float* out, int threads) {                        \
    paged_attention<C>(q, k_cache, v_cache, block_tables, max_blocks, context_lens,            \
                       query_start_loc, num_seqs, num_tokens, hq, hkv, dh, block_size, scale,  \
                       out, threads);                                                          \
  }

MS_ATTENTION(ms_paged_attention_f32, float)
MS_ATTENTION(ms_paged_attention_bf16, uint16_t)

}  // extern "C"
