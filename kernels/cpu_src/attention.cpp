// Causal paged attention over the KV cache: each query token over exactly its visible keys.

#include <type_traits>
#include <utility>

#include "common.h"

namespace ms {
namespace {


// In-place transpose of a VW x VW block held as VW row vectors (only moves values).
// Stage s swaps bit s of the row and column index of every element; after the log2(VW)
// stages element (r, c) holds the original (c, r). Stage s's masks: lo[i] = i with bit s
// clear, else (i - 2^s) + VW (from y); hi[i] = i + 2^s with bit s clear, else i + VW.
#if defined(__AVX512F__)
constexpr int TRANSPOSE_STAGES = 4;
static const veci TRANSPOSE_LO[4] = {
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}};
static const veci TRANSPOSE_HI[4] = {
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}};
#elif defined(__AVX2__)
constexpr int TRANSPOSE_STAGES = 3;
static const veci TRANSPOSE_LO[3] = {
    {0, 8, 2, 10, 4, 12, 6, 14}, {0, 1, 8, 9, 4, 5, 12, 13}, {0, 1, 2, 3, 8, 9, 10, 11}};
static const veci TRANSPOSE_HI[3] = {
    {1, 9, 3, 11, 5, 13, 7, 15}, {2, 3, 10, 11, 6, 7, 14, 15}, {4, 5, 6, 7, 12, 13, 14, 15}};
#else
constexpr int TRANSPOSE_STAGES = 2;
static const veci TRANSPOSE_LO[2] = {{0, 4, 2, 6}, {0, 1, 4, 5}};
static const veci TRANSPOSE_HI[2] = {{1, 5, 3, 7}, {2, 3, 6, 7}};
#endif
static_assert(1 << TRANSPOSE_STAGES == VW, "one transpose stage per bit of a lane index");

inline void transpose_block(vec* rows) {
#pragma GCC unroll 4
  for (int b = 0; b < TRANSPOSE_STAGES; ++b) {
    const int s = 1 << b;
#pragma GCC unroll 16
    for (int r = 0; r < VW; ++r) {
      if (r & s) continue;
      const vec x = rows[r], y = rows[r | s];
      rows[r] = __builtin_shuffle(x, y, TRANSPOSE_LO[b]);
      rows[r | s] = __builtin_shuffle(x, y, TRANSPOSE_HI[b]);
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

// out_g[d] = sum_j p_g[j] * v_j[d], j ascending, for heads g0 <= g < g0 + G and the NV
// vectors of d starting at d0. The G heads share each value row's loads, and their G * NV
// sums are independent add chains (a lane's order is the same for any G, NV and d0).
template <int NV, int G>
inline void attend_values_heads(const float* const* vrows, const float* scores, int64_t padded,
                                int64_t len, int64_t g0, int64_t d0, int64_t dh, float* acc) {
  vec a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) a[g][v] = vec{};
  const float* p = scores + g0 * padded;
  for (int64_t j = 0; j < len; ++j) {
    const float* vr = vrows[j] + d0;
    vec x[NV];
    for (int v = 0; v < NV; ++v) x[v] = loadv(vr + VW * v);
    for (int g = 0; g < G; ++g) {
      const float pj = p[g * padded + j];
      for (int v = 0; v < NV; ++v) a[g][v] = fmadd(pj, x[v], a[g][v]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) storev(acc + (g0 + g) * dh + d0 + VW * v, a[g][v]);
}

// The sums above for heads g < group and DH = dh (a multiple of VW): slices of at most 8
// vectors of d, and as many heads at a time (up to four) as keep 8 accumulators.
template <int DH>
void attend_values(const float* const* vrows, const float* scores, int64_t padded,
                   int64_t len, int64_t group, float* acc) {
  constexpr int NV_ALL = DH / VW, NV = NV_ALL < 8 ? NV_ALL : 8;
  constexpr int WIDE = NV >= 8 ? 1 : 8 / NV < 4 ? 8 / NV : 4;
  static_assert(DH % VW == 0 && NV_ALL % NV == 0, "d slices of equal width");
  for (int64_t d0 = 0; d0 < DH; d0 += NV * VW) {
    int64_t g = 0;
    for (; g + WIDE <= group; g += WIDE)
      attend_values_heads<NV, WIDE>(vrows, scores, padded, len, g, d0, DH, acc);
    for (; g < group; ++g) attend_values_heads<NV, 1>(vrows, scores, padded, len, g, d0, DH, acc);
  }
}

// The same sums for any dh (one lane per element, same order as attend_values).
void attend_values_any(const float* const* vrows, const float* scores, int64_t padded,
                       int64_t len, int64_t group, int64_t dh, float* acc) {
  std::fill(acc, acc + group * dh, 0.0f);
  for (int64_t j = 0; j < len; ++j)
    for (int64_t g = 0; g < group; ++g)
      for (int64_t dd = 0; dd < dh; ++dd)
        acc[g * dh + dd] = fmadd1(scores[g * padded + j], vrows[j][dd], acc[g * dh + dd]);
}

// s_g[j] = (sum_d q_g[d] * kt[d][j], d ascending) * scale for j0 <= j < j0 + VW * B and
// heads g < G (q_g = q + g * dh, s_g = s + g * padded), kt rows `stride` apart. The G heads
// share each kt load; the G * B sums are independent add chains (a lane's order is the
// same for any G and B).
template <int G, int B>
inline void score_blocks(const float* q, const float* kt, int64_t stride, int64_t padded,
                         int64_t dh, float scale, int64_t j0, float* s) {
  vec d[G][B];
  for (int g = 0; g < G; ++g)
    for (int b = 0; b < B; ++b) d[g][b] = vec{};
  for (int64_t dd = 0; dd < dh; ++dd) {
    vec k[B];
    for (int b = 0; b < B; ++b) k[b] = loadv(kt + dd * stride + j0 + VW * b);
    for (int g = 0; g < G; ++g) {
      const float qd = q[g * dh + dd];
      for (int b = 0; b < B; ++b) d[g][b] = fmadd(qd, k[b], d[g][b]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int b = 0; b < B; ++b) storev(s + g * padded + j0 + VW * b, d[g][b] * scale);
}

// All j < padded (a multiple of SUM_LANES, so of VW) for heads g < G: 4 or 8 chains at a
// time, then single vectors.
template <int G>
inline void score_heads(const float* q, const float* kt, int64_t stride, int64_t padded,
                        int64_t dh, float scale, float* s) {
  constexpr int B = G >= 4 ? 2 : 4;
  int64_t j0 = 0;
  for (; j0 + VW * B <= padded; j0 += VW * B)
    score_blocks<G, B>(q, kt, stride, padded, dh, scale, j0, s);
  for (; j0 < padded; j0 += VW) score_blocks<G, 1>(q, kt, stride, padded, dh, scale, j0, s);
}

// The scores of `group` heads (q: [group, dh], s: [group, padded]), four heads at a time.
void attend_scores(const float* q, const float* kt, int64_t stride, int64_t padded, int64_t dh,
                   int64_t group, float scale, float* s) {
  int64_t g = 0;
  for (; g + 4 <= group; g += 4)
    score_heads<4>(q + g * dh, kt, stride, padded, dh, scale, s + g * padded);
  for (; g < group; ++g) score_heads<1>(q + g * dh, kt, stride, padded, dh, scale, s + g * padded);
}

// Scores -> exp(score - max) in place; keys past len get exactly 0. The max: key j into
// lane j % SUM_LANES (SUM_LANES / VW vectors), then the lanes in order.
void softmax_numerators(float* s, int64_t len, int64_t padded) {
  constexpr int PARTS = SUM_LANES / VW;
  for (int64_t j = len; j < padded; ++j) s[j] = -__builtin_inff();
  vec mx_lanes[PARTS];
  for (int i = 0; i < PARTS; ++i) mx_lanes[i] = loadv(s + i * VW);
  for (int64_t j0 = SUM_LANES; j0 < padded; j0 += SUM_LANES)
    for (int i = 0; i < PARTS; ++i) {
      const vec v = loadv(s + j0 + i * VW);
      mx_lanes[i] = v > mx_lanes[i] ? v : mx_lanes[i];
    }
  float mx = mx_lanes[0][0];  // key 0 is always visible: finite unless q or k is not
  for (int l = 1; l < SUM_LANES; ++l) {
    const float x = mx_lanes[l / VW][l % VW];
    mx = x > mx ? x : mx;
  }
  for (int64_t j0 = 0; j0 < padded; j0 += VW) storev(s + j0, expv(loadv(s + j0) - mx));
}

// Causal paged attention; each query token computed on its own (see the runs below).
// q, out: [T, Hq, Dh]; caches: [num_blocks, block_size, Hkv, Dh] (float or bfloat16);
// block_tables: [S, max_blocks] int32; context_lens: [S] int32; query_start_loc: [S + 1].
// Token t of sequence s sits at position context_lens[s] - (its row's distance from the
// end of s's rows); it sees keys 0..position and nothing else (unowned slots never read).
//   score_j = (sum_d q[d] * k_j[d], d ascending, fused multiply-adds) * scale
//   p_j = exp(score_j - max_j score_j); denom = lane_sum(p)
//   out[d] = (sum_j p_j * v_j[d], j ascending, fused multiply-adds) / denom
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
  // Tasks: runs of up to CHUNK consecutive tokens of one sequence (a prefill chunk shares
  // one gather and transposition of its keys; a decode token is a run of one). A token's
  // arithmetic is the same in any run: it reads only keys 0..its position.
  constexpr int64_t CHUNK = 16;
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first token, tokens)
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t t = query_start_loc[s]; t < query_start_loc[s + 1]; t += CHUNK)
      runs.emplace_back(t, std::min<int64_t>(CHUNK, query_start_loc[s + 1] - t));
  const int64_t group = hq / hkv, row = hkv * dh;
  parallel_for(threads, static_cast<int64_t>(runs.size()), [&](int64_t r) {
    const int64_t first = runs[r].first, count = runs[r].second;
    const int64_t len = pos_of[first + count - 1] + 1;  // the run's last token sees most
    const int64_t stride = (len + 15) / 16 * 16;
    const int32_t* table = block_tables + seq_of[first] * max_blocks;
    thread_local std::vector<float> kt_buf, scores_buf, acc_buf, kf_buf, vf_buf;
    thread_local std::vector<const float*> rows_buf;
    thread_local std::vector<int64_t> slots_buf;
    kt_buf.resize(dh * stride);
    slots_buf.resize(len);
    scores_buf.resize(group * stride);
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
    int64_t* slots = slots_buf.data();  // cache slot of key j (block by block: no division)
    for (int64_t j0 = 0, b = 0; j0 < len; j0 += block_size, ++b) {
      const int64_t base = static_cast<int64_t>(table[b]) * block_size;
      for (int64_t j = j0; j < std::min(len, j0 + block_size); ++j) slots[j] = base + (j - j0);
    }
    for (int64_t kv = 0; kv < hkv; ++kv) {
      // Float views of this kv head's key and value rows (bfloat16 converted).
      for (int64_t j = 0; j < len; ++j) {
        const C* krow = k_cache + slots[j] * row + kv * dh;
        const C* vrow = v_cache + slots[j] * row + kv * dh;
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
      if (dh % VW == 0) {
        vec block[VW];
        for (int64_t j0 = 0; j0 < stride; j0 += VW)
          for (int64_t d0 = 0; d0 < dh; d0 += VW) {
            for (int64_t i = 0; i < VW; ++i)
              block[i] = j0 + i < len ? loadv(krows[j0 + i] + d0) : vec{};
            transpose_block(block);
            for (int64_t i = 0; i < VW; ++i) storev(&kt[(d0 + i) * stride + j0], block[i]);
          }
      } else {
        std::fill(kt, kt + dh * stride, 0.0f);
        for (int64_t j = 0; j < len; ++j)
          for (int64_t dd = 0; dd < dh; ++dd) kt[dd * stride + j] = krows[j][dd];
      }
      for (int64_t t = first; t < first + count; ++t) {
        // Keys in [len_t, padded) get score -inf (their kt columns may hold later keys of
        // the run: the score is overwritten, never used).
        const int64_t len_t = pos_of[t] + 1, padded = (len_t + 15) / 16 * 16;
        attend_scores(q + (t * hq + kv * group) * dh, kt, stride, padded, dh, group, scale,
                      scores);
        for (int64_t g = 0; g < group; ++g) softmax_numerators(scores + g * padded, len_t, padded);
        switch (dh) {
          case 16: attend_values<16>(vrows, scores, padded, len_t, group, acc); break;
          case 32: attend_values<32>(vrows, scores, padded, len_t, group, acc); break;
          case 64: attend_values<64>(vrows, scores, padded, len_t, group, acc); break;
          case 128: attend_values<128>(vrows, scores, padded, len_t, group, acc); break;
          default: attend_values_any(vrows, scores, padded, len_t, group, dh, acc); break;
        }
        for (int64_t g = 0; g < group; ++g) {
          const float denom = lane_sum(scores + g * padded, len_t);
          float* o = out + (t * hq + kv * group + g) * dh;
          for (int64_t dd = 0; dd < dh; ++dd) o[dd] = acc[g * dh + dd] / denom;
        }
      }
    }
  });
}

}  // namespace
}  // namespace ms

using namespace ms;

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
