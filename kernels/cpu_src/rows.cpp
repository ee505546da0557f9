// Row kernels: RMSNorm, routing (softmax + stable top-k), combine, log-softmax.

#include "common.h"

using namespace ms;

extern "C" {

// h = x (+ residual); y = h / sqrt(mean(h^2) + eps) (* weight when weight != null).
// x, residual, h_out, y: [M, D]; h_out may be null when residual is null.
void ms_rms_norm(const float* x, const float* residual, const float* weight, int64_t m_len,
                 int64_t d, float eps, float* y, float* h_out, int threads) {
  const int64_t block = 64;
  parallel_for(threads, (m_len + block - 1) / block, [&](int64_t task) {
    thread_local std::vector<float> h, sq;
    h.resize(d);
    sq.resize(d);
    for (int64_t r = task * block; r < std::min(m_len, (task + 1) * block); ++r) {
      const float* xr = x + r * d;
      for (int64_t j = 0; j < d; ++j) h[j] = residual ? xr[j] + residual[r * d + j] : xr[j];
      if (h_out) std::memcpy(h_out + r * d, h.data(), sizeof(float) * d);
      rms_norm_row(h.data(), weight, d, eps, y + r * d, sq.data());
    }
  });
}

// Between the QKV projection and attention, per token t: q and k heads (each optionally
// RMSNorm-ed with q_norm / k_norm) rotated, rot(x)[i] = x[i] * cos[i] + rotate_half(x)[i] *
// sin[i] (rotate_half: -x[i + dh/2] for i < dh/2, else x[i - dh/2]; each product and the
// sum rounded once), at position positions[t]; q into q_out, k and v into the caches at
// slot slots[t] (a negative slot: a padding token, nothing written).
// qkv: [T, (hq + 2 hkv) * dh] (q heads, then k, then v); cos, sin: [*, dh]; q_out:
// [T, hq, dh]; caches: [*, hkv, dh] rows of slots. A negative position counts from the end
// of the tables' num_positions rows, as a torch index does. Returns 0, or -1 (nothing
// written) when a position lies outside [-num_positions, num_positions).
int ms_rotary_and_cache(const float* qkv, const int64_t* positions, const float* cos,
                        const float* sin, int64_t num_positions, const float* q_norm,
                        const float* k_norm, float eps, float* k_cache, float* v_cache,
                        const int64_t* slots, int64_t t_len, int64_t hq, int64_t hkv,
                        int64_t dh, float* q_out, int threads) {
  for (int64_t t = 0; t < t_len; ++t)
    if (positions[t] < -num_positions || positions[t] >= num_positions) return -1;
  const int64_t width = (hq + 2 * hkv) * dh, half = dh / 2, row = hkv * dh;
  parallel_for(threads, (t_len + 15) / 16, [&](int64_t task) {
    thread_local std::vector<float> xn_buf, sq_buf;
    xn_buf.resize(dh);
    sq_buf.resize(dh);
    float* xn = xn_buf.data();
    for (int64_t t = task * 16; t < std::min(t_len, (task + 1) * 16); ++t) {
      const int64_t pos = positions[t] < 0 ? positions[t] + num_positions : positions[t];
      const float* c = cos + pos * dh;
      const float* s = sin + pos * dh;
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < hq + hkv; ++h) {
        const float* x = qkv + t * width + h * dh;
        const float* norm = h < hq ? q_norm : k_norm;
        if (norm) {
          rms_norm_row(x, norm, dh, eps, xn, sq_buf.data());
          x = xn;
        }
        if (h >= hq && slot < 0) continue;  // a padding token's k: not written
        float* y = h < hq ? q_out + (t * hq + h) * dh : k_cache + slot * row + (h - hq) * dh;
        for (int64_t i = 0; i < half; ++i) y[i] = x[i] * c[i] + (-x[i + half]) * s[i];
        for (int64_t i = half; i < dh; ++i) y[i] = x[i] * c[i] + x[i - half] * s[i];
      }
      if (slot >= 0)
        std::memcpy(v_cache + slot * row, qkv + t * width + (hq + hkv) * dh,
                    sizeof(float) * row);
    }
  });
  return 0;
}

// Softmax routing with a stable top-k. logits: [T, E]; ids: [T, k] int64; weights:
// [T, k]. p = exp(x - max) / lane_sum(exp(x - max)); the k largest p in descending order,
// ties to the lower expert id; with renormalize, weights / lane_sum(weights).
void ms_topk_route(const float* logits, int64_t t_len, int64_t e, int64_t k, int renormalize,
                   int64_t* ids, float* weights, int threads) {
  parallel_for(threads, (t_len + 63) / 64, [&](int64_t task) {
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
  parallel_for(threads, (t_len + 63) / 64, [&](int64_t task) {
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
  parallel_for(threads, b_len, [&](int64_t b) {
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
