// zp/runtime/kernel_math.hpp: the per-element and per-row math of the GPT-2 kernels (GELU,
// LayerNorm rows, softmax rows, the SGD element, dropout masks, 16-bit loads and stores), as small ZP_HD
// inline functions that the CPU loops and the CUDA kernels (runtime/src/cuda) both call. Not
// the kernels: no threading, no shapes beyond one row, no allocation.
//
// Example usage (one LayerNorm row, then one softmax row in place):
//   float mean, rstd;
//   zp::runtime::layernorm_row_stats(x, C, &mean, &rstd);
//   for (int64_t i = 0; i < C; ++i)
//     y[i] = zp::runtime::layernorm_apply(x[i], mean, rstd, w[i], b[i]);
//   float lse = zp::runtime::softmax_row(p, p, n);  // p = softmax(p); returns log-sum-exp
#pragma once

#include <cmath>
#include <cstdint>

#include "zp/runtime/dtype.hpp"
#include "zp/runtime/rng.hpp"

namespace zp::runtime {

// ---- GELU, tanh approximation (Hendrycks & Gimpel 2016, eq. for "gelu_new" in GPT-2):
// gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
inline constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
inline constexpr float kGeluCubic = 0.044715f;

ZP_HD inline float gelu(float x) {
  const float u = kGeluScale * (x + kGeluCubic * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}

// d gelu / dx = 0.5 (1 + tanh u) + 0.5 x sech^2(u) du/dx, du/dx = sqrt(2/pi) (1 + 3 0.044715 x^2).
ZP_HD inline float gelu_grad(float x) {
  const float u = kGeluScale * (x + kGeluCubic * x * x * x);
  const float th = tanhf(u);
  const float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
}

// ---- LayerNorm over one row of C values (Ba et al. 2016), biased variance, eps 1e-5 as GPT-2.
inline constexpr float kLayerNormEps = 1e-5f;

// mean and rstd = 1/sqrt(var + eps) of x[0..C) stored as D, two passes (the second on
// x - mean, which keeps the variance accurate when |mean| >> std). The float overload below is
// the fp32 instance.
template <DType D>
ZP_HD inline void layernorm_row_stats(const void* x, int64_t C, float* mean, float* rstd) {
  float sum = 0.0f;
  for (int64_t i = 0; i < C; ++i) sum += load_as_f32(x, static_cast<std::size_t>(i), D);
  const float m = sum / static_cast<float>(C);
  float sq = 0.0f;
  for (int64_t i = 0; i < C; ++i) {
    const float d = load_as_f32(x, static_cast<std::size_t>(i), D) - m;
    sq += d * d;
  }
  *mean = m;
  *rstd = 1.0f / sqrtf(sq / static_cast<float>(C) + kLayerNormEps);
}
ZP_HD inline void layernorm_row_stats(const float* x, int64_t C, float* mean, float* rstd) {
  layernorm_row_stats<DType::fp32>(x, C, mean, rstd);
}

ZP_HD inline float layernorm_apply(float x, float mean, float rstd, float w, float b) {
  return (x - mean) * rstd * w + b;
}

// Backward of one row, with xhat = (x - mean) rstd and g = w * dout:
//   dx_i = rstd (g_i - mean_j(g_j) - xhat_i mean_j(g_j xhat_j))
// (llm.c layernorm_backward). layernorm_row_grad_means returns the two means; dout, x and w
// stored as D (the float overload: the fp32 instance).
template <DType D>
ZP_HD inline void layernorm_row_grad_means(const void* dout, const void* x, const void* w,
                                           float mean, float rstd, int64_t C, float* g_mean,
                                           float* gxhat_mean) {
  float s1 = 0.0f, s2 = 0.0f;
  for (int64_t i = 0; i < C; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const float g = load_as_f32(w, k, D) * load_as_f32(dout, k, D);
    s1 += g;
    s2 += g * (load_as_f32(x, k, D) - mean) * rstd;
  }
  *g_mean = s1 / static_cast<float>(C);
  *gxhat_mean = s2 / static_cast<float>(C);
}
ZP_HD inline void layernorm_row_grad_means(const float* dout, const float* x, const float* w,
                                           float mean, float rstd, int64_t C, float* g_mean,
                                           float* gxhat_mean) {
  layernorm_row_grad_means<DType::fp32>(dout, x, w, mean, rstd, C, g_mean, gxhat_mean);
}

ZP_HD inline float layernorm_dinp(float dout, float x, float w, float mean, float rstd,
                                  float g_mean, float gxhat_mean) {
  const float xhat = (x - mean) * rstd;
  return rstd * (w * dout - g_mean - xhat * gxhat_mean);
}

// ---- RMSNorm over one row of C values (Zhang & Sennrich 2019; LLaMA's norm, transformers'
// LlamaRMSNorm): y = x rstd (w + offset), rstd = 1/sqrt(mean(x^2) + eps); offset 1 is Gemma's
// (1 + weight), 0 everyone else's.
// x[0..C) stored as D, the squares summed in ascending order (the float overload: the fp32
// instance).
template <DType D>
ZP_HD inline float rmsnorm_row_rstd(const void* x, int64_t C, float eps) {
  float sq = 0.0f;
  for (int64_t i = 0; i < C; ++i) {
    const float v = load_as_f32(x, static_cast<std::size_t>(i), D);
    sq += v * v;
  }
  return 1.0f / sqrtf(sq / static_cast<float>(C) + eps);
}
ZP_HD inline float rmsnorm_row_rstd(const float* x, int64_t C, float eps) {
  return rmsnorm_row_rstd<DType::fp32>(x, C, eps);
}
// Backward of one row, with xhat = x rstd and g = (w + offset) dout:
//   dx_i = rstd (g_i - xhat_i mean_j(g_j xhat_j)).
// The mean's sum in ascending order, each term ((w + offset) dout) x rstd; dout, x, w stored
// as D.
template <DType D>
ZP_HD inline float rmsnorm_row_gxhat_mean(const void* dout, const void* x, const void* w,
                                          float w_offset, float rstd, int64_t C) {
  float s = 0.0f;
  for (int64_t i = 0; i < C; ++i) {
    const auto k = static_cast<std::size_t>(i);
    s += (load_as_f32(w, k, D) + w_offset) * load_as_f32(dout, k, D) * load_as_f32(x, k, D) * rstd;
  }
  return s / static_cast<float>(C);
}
ZP_HD inline float rmsnorm_row_gxhat_mean(const float* dout, const float* x, const float* w,
                                          float w_offset, float rstd, int64_t C) {
  return rmsnorm_row_gxhat_mean<DType::fp32>(dout, x, w, w_offset, rstd, C);
}
ZP_HD inline float rmsnorm_dinp(float dout, float x, float w_eff, float rstd, float gxhat_mean) {
  return rstd * (w_eff * dout - x * rstd * gxhat_mean);
}

// ---- SwiGLU (Shazeer 2020; LLaMA's MLP): out = silu(g) u, silu(g) = g sigmoid(g).
ZP_HD inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
ZP_HD inline float swiglu(float g, float u) { return g * sigmoid(g) * u; }
// d out/d g = u sigmoid(g) (1 + g (1 - sigmoid(g))), d out/d u = silu(g).
ZP_HD inline void swiglu_grad(float g, float u, float dout, float* dg, float* du) {
  const float s = sigmoid(g);
  *dg = dout * u * s * (1.0f + g * (1.0f - s));
  *du = dout * g * s;
}

// ---- Rotary position embedding (Su et al. 2021) in transformers' rotate_half layout: the pair
// (x_i, x_{i+rot/2}) of a head turns by the angle t inv_freq_i, both scaled by mscale (YaRN's
// attention factor; 1 otherwise). The backward turns by the opposite angle (the transpose).
ZP_HD inline void rope_pair(float* a, float* b, float c, float s) {
  const float x1 = *a, x2 = *b;
  *a = x1 * c - x2 * s;
  *b = x2 * c + x1 * s;
}

// ---- Softmax over one row of n values, max-subtracted. out may equal in. Returns the
// log-sum-exp log(sum_j exp(in_j)), from which cross-entropy takes -log p_k = lse - in_k.
ZP_HD inline float softmax_row(float* out, const float* in, int64_t n) {
  float maxv = in[0];
  for (int64_t i = 1; i < n; ++i) maxv = in[i] > maxv ? in[i] : maxv;
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = expf(in[i] - maxv);
    sum += out[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) out[i] *= inv;
  return maxv + logf(sum);
}

// Backward of y = softmax(x) over one row: dx_i = y_i (dy_i - sum_j y_j dy_j). dx may equal
// dy (the sum is taken before any write).
ZP_HD inline void softmax_row_backward(float* dx, const float* dy, const float* y, int64_t n) {
  float dot = 0.0f;
  for (int64_t i = 0; i < n; ++i) dot += y[i] * dy[i];
  for (int64_t i = 0; i < n; ++i) dx[i] = y[i] * (dy[i] - dot);
}

// ---- SGD with momentum, one element (torch.optim.SGD, dampening 0, not Nesterov):
//   d = g * grad_scale + weight_decay * w;  buf = momentum * buf + d;  w -= lr * buf
ZP_HD inline void sgd_element(float g, float grad_scale, float lr, float momentum,
                              float weight_decay, float& w, float& buf) {
  const float d = g * grad_scale + weight_decay * w;
  buf = momentum * buf + d;
  w -= lr * buf;
}

// ---- Dropout (Srivastava et al. 2014, inverted as PyTorch's nn.Dropout): an element is kept
// with probability 1 - p and scaled by 1 / (1 - p), so the expectation is unchanged; dropped
// elements are 0. The mask is counter-based: element i of a dropout site keeps when the top 24
// bits of mix64(key + i) (the splitmix64 stream seeded with the site's key) are at least
// p 2^24, so the CPU and CUDA backends draw the same mask, and a recomputed forward (activation
// checkpointing) redraws the mask of the first forward from the same key. The engine derives
// the key from the seed, the site, the step and the micro-step (Engine::dropout_key).
ZP_HD inline uint32_t dropout_threshold(float p) {
  return static_cast<uint32_t>(p * 16777216.0f);  // p 2^24, truncated: P(drop) within 2^-24 of p
}
ZP_HD inline bool dropout_keep(uint64_t key, int64_t i, uint32_t threshold) {
  return static_cast<uint32_t>(mix64(key + static_cast<uint64_t>(i)) >> 40) >= threshold;
}
ZP_HD inline float dropout_scale(float p) { return 1.0f / (1.0f - p); }

// ---- 16-bit storage: add an fp32 value into an element of any storage type, rounding the sum
// to nearest even (the conversions themselves are load_as_f32 / store_from_f32 in dtype.hpp).
ZP_HD inline void accumulate_as(void* p, std::size_t i, DType t, float v) {
  store_from_f32(p, i, t, load_as_f32(p, i, t) + v);
}

}  // namespace zp::runtime
