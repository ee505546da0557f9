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
