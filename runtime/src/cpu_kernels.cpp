// cpu_kernels.cpp: the CPU backend's GPT-2 kernels: OpenBLAS SGEMM for the linear layers,
// OpenMP loops over rows and heads for the rest, the row math from kernel_math.hpp. Not the
// engine and not tuned SIMD code: the loops are written so the compiler can vectorise them.
#include "zp/runtime/cpu_kernels.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cmath>
#include <string_view>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "zp/error.hpp"
#include "zp/runtime/kernel_math.hpp"
#include "cpu_vec.hpp"

namespace zp::runtime::cpu {

namespace {

// Elementwise loops shorter than this run on one thread (a parallel region costs a few us).
constexpr int64_t kParallelElems = 1 << 15;

// BLAS takes int dimensions: refuse what does not fit rather than wrap.
int blas_dim(int64_t n, std::string_view what) {
  if (n < 0 || n > INT_MAX)
    throw Error(fmt::format("cpu::{}: dimension {} does not fit OpenBLAS's 32-bit int", what, n),
                "split the matrix (e.g. fewer tokens per micro-batch)");
  return static_cast<int>(n);
}

template <class Q>  // Qkv or QkvT
void check_head_norm(const Q& in, int64_t NH, int64_t KVH, int64_t HS, std::string_view what) {
  if (NH <= 0 || KVH <= 0 || HS <= 0 || in.q == nullptr || in.k == nullptr || in.q_row < NH * HS ||
      in.k_row < KVH * HS)
    throw Error(fmt::format("cpu::{}: {} query and {} key heads of {} in rows of {} and {}", what, NH,
                            KVH, HS, in.q_row, in.k_row),
                "the q and k heads must fit their rows");
}

void check_grad_row(int64_t grad_row, int64_t H, int64_t HS) {
  if (grad_row < H * HS)
    throw Error(fmt::format("cpu::head_rmsnorm_backward: gradient rows of {} for {} heads of {}",
                            grad_row, H, HS),
                "the q and k heads must fit the fused gradient row");
}

// Head j of token r among the NH query heads, then the key heads.
inline const float* head_of(const Qkv& in, int64_t r, int64_t j, int64_t NH, int64_t HS) {
  return j < NH ? in.q + r * in.q_row + j * HS : in.k + r * in.k_row + (j - NH) * HS;
}

int64_t head_size(int64_t C, int64_t NH, std::string_view what) {
  if (NH <= 0 || C % NH != 0)
    throw Error(fmt::format("cpu::{}: C = {} is not a multiple of NH = {}", what, C, NH),
                "the model's n_embd must divide evenly into n_head heads");
  return C / NH;
}

void check_targets(const int32_t* targets, int64_t N, int64_t V, std::string_view what) {
  for (int64_t i = 0; i < N; ++i)
    if (targets[i] < 0 || targets[i] >= V)
      throw Error(fmt::format("cpu::{}: target {} at row {} is outside the vocabulary [0, {})",
                              what, targets[i], i, V),
                  "targets must be token ids below the vocabulary size");
}

using vec::add_st;
using vec::axpy;
using vec::dot;
using vec::elem;
using vec::ld;
using vec::st;

// a[ia..ia+n) . b[ib..ib+n): fp32 storage vectorised (dot above), 16-bit storage sequential
// (the CUDA kernels' order).
template <DType D>
inline float dot_t(const void* a, int64_t ia, const void* b, int64_t ib, int64_t n) {
  if constexpr (D == DType::fp32) {
    return dot(static_cast<const float*>(a) + ia, static_cast<const float*>(b) + ib, n);
  } else {
    float s = 0.0f;
    for (int64_t j = 0; j < n; ++j) s += ld<D>(a, ia + j) * ld<D>(b, ib + j);
    return s;
  }
}

AttnShape gpt2_shape(int64_t B, int64_t T, int64_t C, int64_t NH, std::string_view what) {
  return {B, T, NH, NH, head_size(C, NH, what)};
}

void check_shape(const AttnShape& s, std::string_view what) {
  if (s.NH <= 0 || s.KVH <= 0 || s.HS <= 0 || s.NH % s.KVH != 0)
    throw Error(fmt::format("cpu::{}: {} query heads, {} key/value heads of {}", what, s.NH, s.KVH, s.HS),
                "the query heads must be a positive multiple of the key/value heads");
}

// preatt (B,NH,T,T) = q.k / sqrt(HS) for key <= query, stored as D. Query head h of token
// (b, t) at element q0 + (b T + t) q_row + h HS of q, key head j at k0 + (b T + t) k_row + j HS
// of k (Qkv's layout, in elements of D).
template <DType D>
void attention_scores_t(void* preatt, const void* q, int64_t q0, int64_t q_row, const void* k,
                        int64_t k0, int64_t k_row, const AttnShape& s) {
  check_shape(s, "attention_scores");
  const int64_t B = s.B, T = s.T, NH = s.NH, HS = s.HS, G = s.group();
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
#pragma omp parallel for collapse(2) if (B * NH * T * T * HS > kParallelElems)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = ((b * NH + h) * T + t) * T;
        for (int64_t t2 = s.first_key(t); t2 <= t; ++t2)
          st<D>(preatt, row + t2,
                dot_t<D>(q, q0 + (b * T + t) * q_row + h * HS, k, k0 + (b * T + t2) * k_row + h / G * HS,
                         HS) * scale);
      }
}
template <DType D>
void attention_scores_t(void* preatt, const void* qkv, const AttnShape& s) {
  attention_scores_t<D>(preatt, qkv, 0, s.row(), qkv, s.k_off(), s.row(), s);
}

}  // namespace

void set_threads(int n_threads) {
  if (n_threads < 1)
    throw Error(fmt::format("cpu::set_threads: n_threads must be >= 1, got {}", n_threads),
                "pass the number of cores this rank may use");
  openblas_set_num_threads(n_threads);
  omp_set_num_threads(n_threads);
}

// ---- Embedding ------------------------------------------------------------------------------

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                       int64_t B, int64_t T, int64_t C) {
#pragma omp parallel for if (B * T * C > kParallelElems)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    float* o = out + bt * C;
    const float* e = wte + static_cast<int64_t>(tokens[bt]) * C;
    if (wpe) {
      const float* p = wpe + (bt % T) * C;
      for (int64_t i = 0; i < C; ++i) o[i] = e[i] + p[i];
    } else {
      std::copy(e, e + C, o);
    }
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        int64_t B, int64_t T, int64_t C) {
  // A token may repeat, so rows of dwte race: split the channels instead (each thread owns a
  // column block of every row). dwpe rows are distinct per t, so split over t.
  constexpr int64_t kBlock = 64;
  const int64_t n_blocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for if (B * T * C > kParallelElems)
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const int64_t c0 = blk * kBlock, c1 = std::min(C, c0 + kBlock);
    for (int64_t bt = 0; bt < B * T; ++bt) {
      float* d = dwte + static_cast<int64_t>(tokens[bt]) * C;
      const float* g = dout + bt * C;
      for (int64_t i = c0; i < c1; ++i) d[i] += g[i];
    }
  }
  if (!dwpe) return;
#pragma omp parallel for if (B * T * C > kParallelElems)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < B; ++b) axpy(dwpe + t * C, 1.0f, dout + (b * T + t) * C, C);
}

// ---- LayerNorm ------------------------------------------------------------------------------

void layernorm_forward(float* out, float* stats, const float* inp, const float* weight,
                       const float* bias, int64_t N, int64_t C) {
#pragma omp parallel for if (N * C > kParallelElems)
  for (int64_t r = 0; r < N; ++r) {
    const float* x = inp + r * C;
    float* y = out + r * C;
    float mean, rstd;
    layernorm_row_stats(x, C, &mean, &rstd);
    for (int64_t i = 0; i < C; ++i) y[i] = layernorm_apply(x[i], mean, rstd, weight[i], bias[i]);
    stats[2 * r] = mean;
    stats[2 * r + 1] = rstd;
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* stats, int64_t N,
                        int64_t C) {
  // Pass 1, rows in parallel: dinp.
#pragma omp parallel for if (N * C > kParallelElems)
  for (int64_t r = 0; r < N; ++r) {
    const float* g = dout + r * C;
    const float* x = inp + r * C;
    float* dx = dinp + r * C;
    const float mean = stats[2 * r], rstd = stats[2 * r + 1];
    float g_mean, gxhat_mean;
    layernorm_row_grad_means(g, x, weight, mean, rstd, C, &g_mean, &gxhat_mean);
    for (int64_t i = 0; i < C; ++i)
      dx[i] += layernorm_dinp(g[i], x[i], weight[i], mean, rstd, g_mean, gxhat_mean);
  }
  // Pass 2, channel blocks in parallel (sums over rows would race if split by row):
  // dweight += sum_r dout * xhat, dbias += sum_r dout.
  constexpr int64_t kBlock = 64;
  const int64_t n_blocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for if (N * C > kParallelElems)
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const int64_t c0 = blk * kBlock, c1 = std::min(C, c0 + kBlock);
    for (int64_t r = 0; r < N; ++r) {
      const float* g = dout + r * C;
      const float* x = inp + r * C;
      const float mean = stats[2 * r], rstd = stats[2 * r + 1];
      for (int64_t i = c0; i < c1; ++i) {
        dweight[i] += g[i] * (x[i] - mean) * rstd;
        dbias[i] += g[i];
      }
    }
  }
}


// ---- RMSNorm ---------------------------------------------------------------------------------

void rmsnorm_forward(float* out, float* stats, const float* inp, const float* weight,
                     float w_offset, float eps, int64_t N, int64_t C) {
#pragma omp parallel for if (N * C > kParallelElems)
  for (int64_t r = 0; r < N; ++r) {
    const float* x = inp + r * C;
    float* y = out + r * C;
    const float rstd = rmsnorm_row_rstd(x, C, eps);
    stats[r] = rstd;
    for (int64_t i = 0; i < C; ++i) y[i] = x[i] * rstd * (weight[i] + w_offset);
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, float w_offset, const float* stats, int64_t N,
                      int64_t C) {
#pragma omp parallel for if (N * C > kParallelElems)
  for (int64_t r = 0; r < N; ++r) {
    const float* g = dout + r * C;
    const float* x = inp + r * C;
    float* dx = dinp + r * C;
    const float rstd = stats[r];
    const float m = rmsnorm_row_gxhat_mean(g, x, weight, w_offset, rstd, C);
    for (int64_t i = 0; i < C; ++i) dx[i] += rmsnorm_dinp(g[i], x[i], weight[i] + w_offset, rstd, m);
  }
  // dweight += sum_r dout xhat, channel blocks in parallel (a split by row would race).
  constexpr int64_t kBlock = 64;
  const int64_t n_blocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for if (N * C > kParallelElems)
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const int64_t c0 = blk * kBlock, c1 = std::min(C, c0 + kBlock);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t i = c0; i < c1; ++i) dweight[i] += dout[r * C + i] * inp[r * C + i] * stats[r];
  }
}

void head_rmsnorm_forward(float* out, float* stats, const Qkv& in, const float* weight, float eps,
                          int64_t N, int64_t NH, int64_t KVH, int64_t HS) {
  check_head_norm(in, NH, KVH, HS, "head_rmsnorm_forward");
  const int64_t H = NH + KVH;
#pragma omp parallel for if (N * H * HS > kParallelElems)
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < H; ++j) {
      const float* x = head_of(in, r, j, NH, HS);
      const float* w = weight + (j < NH ? 0 : HS);
      float* y = out + (r * H + j) * HS;
      const float rstd = rmsnorm_row_rstd(x, HS, eps);
      stats[r * H + j] = rstd;
      for (int64_t i = 0; i < HS; ++i) y[i] = x[i] * rstd * w[i];
    }
}

void head_rmsnorm_backward(float* dqkv, int64_t grad_row, float* dweight, const Qkv& in,
                           const float* weight, const float* stats, int64_t N, int64_t NH,
                           int64_t KVH, int64_t HS) {
  check_head_norm(in, NH, KVH, HS, "head_rmsnorm_backward");
  const int64_t H = NH + KVH;
  check_grad_row(grad_row, H, HS);
  // dweight first (it reads the output's gradient, which the next loop overwrites): each of
  // the 2 HS channels sums over rows and its heads in order, so the bits do not depend on the
  // threads.
#pragma omp parallel for if (N * H * HS > kParallelElems)
  for (int64_t c = 0; c < 2 * HS; ++c) {
    const int64_t i = c % HS, j0 = c < HS ? 0 : NH, j1 = c < HS ? NH : H;
    float acc = 0.0f;
    for (int64_t r = 0; r < N; ++r)
      for (int64_t j = j0; j < j1; ++j)
        acc += dqkv[r * grad_row + j * HS + i] * head_of(in, r, j, NH, HS)[i] * stats[r * H + j];
    dweight[c] += acc;
  }
#pragma omp parallel for if (N * H * HS > kParallelElems)
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < H; ++j) {
      float* g = dqkv + r * grad_row + j * HS;
      const float* x = head_of(in, r, j, NH, HS);
      const float* w = weight + (j < NH ? 0 : HS);
      const float rstd = stats[r * H + j];
      const float m = rmsnorm_row_gxhat_mean(g, x, w, 0.0f, rstd, HS);
      for (int64_t i = 0; i < HS; ++i) g[i] = rmsnorm_dinp(g[i], x[i], w[i], rstd, m);
    }
}

// ---- Rotary embeddings -----------------------------------------------------------------------

namespace {

void check_rope(int64_t HS, int64_t rot, int64_t row, int64_t n_heads) {
  if (rot <= 0 || rot % 2 != 0 || rot > HS || n_heads * HS > row)
    throw Error(fmt::format("rope: rotary dims {} for heads of {} ({} heads in rows of {})", rot, HS,
                            n_heads, row),
                "rot must be even, at most the head size, and the heads must fit the row");
}

// cos and sin of the fp32 angle t inv_freq[i], each rounded once, times mscale; x stored as D
// (each pair loaded, turned in fp32 and stored once).
template <DType D, bool kForward>
void rope_apply(void* x, const float* inv_freq, float mscale, int64_t B, int64_t T, int64_t row,
                int64_t n_heads, int64_t HS, int64_t rot) {
  check_rope(HS, rot, row, n_heads);
  const int64_t half = rot / 2;
#pragma omp parallel for if (B * T * n_heads * rot > kParallelElems)
  for (int64_t r = 0; r < B * T; ++r) {
    const auto t = static_cast<float>(r % T);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = t * inv_freq[i];
      const float c = static_cast<float>(std::cos(static_cast<double>(angle))) * mscale;
      const float s = static_cast<float>(std::sin(static_cast<double>(angle))) * mscale;
      for (int64_t h = 0; h < n_heads; ++h) {
        const int64_t e = r * row + h * HS + i;
        float a = ld<D>(x, e), b = ld<D>(x, e + half);
        rope_pair(&a, &b, c, kForward ? s : -s);
        st<D>(x, e, a);
        st<D>(x, e + half, b);
      }
    }
  }
}

}  // namespace

void rope_forward(float* x, const float* inv_freq, float mscale, int64_t B, int64_t T,
                  int64_t row, int64_t n_heads, int64_t HS, int64_t rot) {
  rope_apply<DType::fp32, true>(x, inv_freq, mscale, B, T, row, n_heads, HS, rot);
}

void rope_backward(float* dx, const float* inv_freq, float mscale, int64_t B, int64_t T,
                   int64_t row, int64_t n_heads, int64_t HS, int64_t rot) {
  rope_apply<DType::fp32, false>(dx, inv_freq, mscale, B, T, row, n_heads, HS, rot);
}

// transformers' _compute_default_rope_parameters: 1 / base^(arange(0, dim, 2) / dim) in fp32
// (the int64 arange made float, the power in fp32).
std::vector<float> rope_default_inv_freq(double theta, int64_t rot) {
  std::vector<float> f(static_cast<std::size_t>(rot / 2));
  const auto base = static_cast<float>(theta);
  for (int64_t i = 0; i < rot / 2; ++i)
    f[static_cast<std::size_t>(i)] =
        1.0f / std::pow(base, static_cast<float>(2 * i) / static_cast<float>(rot));
  return f;
}

// ---- SwiGLU ----------------------------------------------------------------------------------

namespace {

// Stored as D (the fp32 instance: the fp32 kernels).
template <DType D>
void swiglu_forward_t(void* out, const void* gate, const void* up, int64_t n) {
#pragma omp parallel for if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) st<D>(out, i, swiglu(ld<D>(gate, i), ld<D>(up, i)));
}

template <DType D>
void swiglu_backward_t(void* dgate_up, const void* dout, const void* gate, const void* up,
                       int64_t N, int64_t F) {
#pragma omp parallel for if (N * F > kParallelElems)
  for (int64_t r = 0; r < N; ++r)
    for (int64_t i = 0; i < F; ++i) {
      const int64_t k = r * F + i;
      float dg, du;
      swiglu_grad(ld<D>(gate, k), ld<D>(up, k), ld<D>(dout, k), &dg, &du);
      st<D>(dgate_up, r * 2 * F + i, dg);
      st<D>(dgate_up, r * 2 * F + F + i, du);
    }
}

}  // namespace

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
  swiglu_forward_t<DType::fp32>(out, gate, up, n);
}

void swiglu_backward(float* dgate_up, const float* dout, const float* gate, const float* up,
                     int64_t N, int64_t F) {
  swiglu_backward_t<DType::fp32>(dgate_up, dout, gate, up, N, F);
}

// ---- Linear layers (OpenBLAS) ---------------------------------------------------------------

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N,
                    int64_t C, int64_t OC) {
  const int n = blas_dim(N, "matmul_forward N"), c = blas_dim(C, "matmul_forward C"),
            oc = blas_dim(OC, "matmul_forward OC");
  // out = bias (broadcast over rows), then out = 1 * inp @ W^T + beta * out.
  float beta = 0.0f;
  if (bias) {
    beta = 1.0f;
#pragma omp parallel for if (N * OC > kParallelElems)
    for (int64_t r = 0; r < N; ++r) std::copy(bias, bias + OC, out + r * OC);
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, oc, c, 1.0f, inp, c, weight, c, beta, out,
              oc);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC) {
  const int n = blas_dim(N, "matmul_backward N"), c = blas_dim(C, "matmul_backward C"),
            oc = blas_dim(OC, "matmul_backward OC");
  // dinp (N,C) += dout (N,OC) @ W (OC,C)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, c, oc, 1.0f, dout, oc, weight, c, 1.0f,
              dinp, c);
  // dweight (OC,C) += dout^T (OC,N) @ inp (N,C)
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, oc, c, n, 1.0f, dout, oc, inp, c, 1.0f,
              dweight, c);
  if (!dbias) return;
  constexpr int64_t kBlock = 256;
  const int64_t n_blocks = (OC + kBlock - 1) / kBlock;
#pragma omp parallel for if (N * OC > kParallelElems)
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const int64_t o0 = blk * kBlock, o1 = std::min(OC, o0 + kBlock);
    for (int64_t r = 0; r < N; ++r) {
      const float* g = dout + r * OC;
#pragma omp simd
      for (int64_t o = o0; o < o1; ++o) dbias[o] += g[o];
    }
  }
}

// ---- Attention: scores, softmax, values -----------------------------------------------------
// qkv row of token (b,t): q at [0,C), k at [C,2C), v at [2C,3C); head h is [h*HS, (h+1)*HS) of
// each. preatt/att (B,NH,T,T): row t holds keys 0..t. Every (b,h) pair touches only its own
// slices of every buffer, so the loops split over (b,h) without races.

void attention_scores(float* preatt, const Qkv& in, const AttnShape& s) {
  attention_scores_t<DType::fp32>(preatt, in.q, 0, in.q_row, in.k, 0, in.k_row, s);
}
void attention_scores(float* preatt, const float* qkv, const AttnShape& s) {
  attention_scores(preatt, Qkv::fused(qkv, s), s);
}
void attention_scores(float* preatt, const float* qkv, int64_t B, int64_t T, int64_t C,
                      int64_t NH) {
  attention_scores(preatt, qkv, gpt2_shape(B, T, C, NH, "attention_scores"));
}

void attention_softmax(float* att, const float* preatt, const AttnShape& s) {
  const int64_t T = s.T, n_rows = s.B * s.NH * T;
#pragma omp parallel for if (n_rows * T > kParallelElems)
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t t = r % T, lo = s.first_key(t);
    float* out = att + r * T;
    softmax_row(out + lo, preatt + r * T + lo, t - lo + 1);
    std::fill(out, out + lo, 0.0f);
    std::fill(out + t + 1, out + T, 0.0f);
  }
}
void attention_softmax(float* att, const float* preatt, int64_t B, int64_t NH, int64_t T) {
  attention_softmax(att, preatt, AttnShape{B, T, NH, NH, 1});
}

void attention_values(float* out, const float* att, const float* qkv, const AttnShape& s) {
  attention_values(out, att, Qkv::fused(qkv, s), s);
}
void attention_values(float* out, const float* att, const Qkv& in, const AttnShape& s) {
  check_shape(s, "attention_values");
  const int64_t B = s.B, T = s.T, NH = s.NH, HS = s.HS, O = s.out_row(), G = s.group();
#pragma omp parallel for collapse(2) if (B * NH * T * T * HS > kParallelElems)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        float* o = out + (b * T + t) * O + h * HS;
        const float* a = att + ((b * NH + h) * T + t) * T;
        std::fill(o, o + HS, 0.0f);
        for (int64_t t2 = s.first_key(t); t2 <= t; ++t2)
          axpy(o, a[t2], in.v + (b * T + t2) * in.v_row + h / G * HS, HS);
      }
}
void attention_values(float* out, const float* att, const float* qkv, int64_t B, int64_t T,
                      int64_t C, int64_t NH) {
  attention_values(out, att, qkv, gpt2_shape(B, T, C, NH, "attention_values"));
}

// Over (b, key/value head): the group's query heads add into the shared dv in head order.
void attention_values_backward(float* datt, float* dqkv, const float* dout, const float* att,
                               const float* qkv, const AttnShape& s) {
  attention_values_backward(datt, dqkv, dout, att, Qkv::fused(qkv, s), s);
}
void attention_values_backward(float* datt, float* dqkv, const float* dout, const float* att,
                               const Qkv& in, const AttnShape& s) {
  check_shape(s, "attention_values_backward");
  const int64_t B = s.B, T = s.T, NH = s.NH, HS = s.HS, R = s.row(), O = s.out_row(), G = s.group();
#pragma omp parallel for collapse(2) if (B * NH * T * T * HS > kParallelElems)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kv = 0; kv < s.KVH; ++kv)
      for (int64_t h = kv * G; h < (kv + 1) * G; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const float* g = dout + (b * T + t) * O + h * HS;
          const float* a = att + ((b * NH + h) * T + t) * T;
          float* da = datt + ((b * NH + h) * T + t) * T;
          for (int64_t t2 = s.first_key(t); t2 <= t; ++t2) {
            da[t2] += dot(g, in.v + (b * T + t2) * in.v_row + kv * HS, HS);  // datt[t,t2] += dout[t] . v[t2]
            axpy(dqkv + (b * T + t2) * R + s.v_off() + kv * HS, a[t2], g, HS);  // dv[t2] += att[t,t2] dout[t]
          }
        }
}
void attention_values_backward(float* datt, float* dqkv, const float* dout, const float* att,
                               const float* qkv, int64_t B, int64_t T, int64_t C, int64_t NH) {
  attention_values_backward(datt, dqkv, dout, att, qkv,
                            gpt2_shape(B, T, C, NH, "attention_values_backward"));
}

void attention_softmax_backward(float* dpreatt, const float* datt, const float* att,
                                const AttnShape& s) {
  const int64_t T = s.T, n_rows = s.B * s.NH * T;
#pragma omp parallel for if (n_rows * T > kParallelElems)
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t t = r % T, lo = s.first_key(t);
    float* dx = dpreatt + r * T;
    softmax_row_backward(dx + lo, datt + r * T + lo, att + r * T + lo, t - lo + 1);
    std::fill(dx, dx + lo, 0.0f);  // masked keys have no gradient
    std::fill(dx + t + 1, dx + T, 0.0f);
  }
}
void attention_softmax_backward(float* dpreatt, const float* datt, const float* att, int64_t B,
                                int64_t NH, int64_t T) {
  attention_softmax_backward(dpreatt, datt, att, AttnShape{B, T, NH, NH, 1});
}

// Over (b, key/value head), as attention_values_backward: dq of each query head is its own,
// dk is the group's.
void attention_scores_backward(float* dqkv, const float* dpreatt, const float* qkv,
                               const AttnShape& s) {
  attention_scores_backward(dqkv, dpreatt, Qkv::fused(qkv, s), s);
}
void attention_scores_backward(float* dqkv, const float* dpreatt, const Qkv& in,
                               const AttnShape& s) {
  check_shape(s, "attention_scores_backward");
  // q and k read where `in` has them, dq and dk written in the fused gradient's rows of R.
  const int64_t B = s.B, T = s.T, NH = s.NH, HS = s.HS, R = s.row(), G = s.group();
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
#pragma omp parallel for collapse(2) if (B * NH * T * T * HS > kParallelElems)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kv = 0; kv < s.KVH; ++kv)
      for (int64_t h = kv * G; h < (kv + 1) * G; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t q_off = (b * T + t) * R + h * HS;
          const float* q = in.q + (b * T + t) * in.q_row + h * HS;
          const float* dp = dpreatt + ((b * NH + h) * T + t) * T;
          for (int64_t t2 = s.first_key(t); t2 <= t; ++t2) {
            const int64_t k_off = (b * T + t2) * R + s.k_off() + kv * HS;
            const float g = dp[t2] * scale;
            axpy(dqkv + q_off, g, in.k + (b * T + t2) * in.k_row + kv * HS, HS);  // dq[t] += g k[t2]
            axpy(dqkv + k_off, g, q, HS);  // dk[t2] += g q[t]
          }
        }
}
void attention_scores_backward(float* dqkv, const float* dpreatt, const float* qkv, int64_t B,
                               int64_t T, int64_t C, int64_t NH) {
  attention_scores_backward(dqkv, dpreatt, qkv, gpt2_shape(B, T, C, NH, "attention_scores_backward"));
}

// ---- GELU, residual ------------------------------------------------------------------------

void gelu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) out[i] = gelu(inp[i]);
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
#pragma omp parallel for if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) dinp[i] = dout[i] * gelu_grad(inp[i]);
}

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// ---- Cross-entropy --------------------------------------------------------------------------

void crossentropy_forward(float* logits, float* losses, const int32_t* targets, int64_t N,
                          int64_t V) {
  check_targets(targets, N, V, "crossentropy_forward");
#pragma omp parallel for if (N * V > kParallelElems)
  for (int64_t r = 0; r < N; ++r) {
    float* row = logits + r * V;
    const float target_logit = row[targets[r]];
    const float lse = softmax_row(row, row, V);
    losses[r] = lse - target_logit;  // -log softmax[target], without log(0) when p underflows
  }
}

void crossentropy_backward(float* probs, const int32_t* targets, float dloss, int64_t N,
                           int64_t V) {
  check_targets(targets, N, V, "crossentropy_backward");
#pragma omp parallel for if (N * V > kParallelElems)
  for (int64_t r = 0; r < N; ++r) {
    float* row = probs + r * V;
    row[targets[r]] -= 1.0f;
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) row[i] *= dloss;
  }
}

// ---- Typed kernels (cpu_kernels.hpp): fp32 goes to the kernels above; fp16 and bf16 load as
// fp32, compute in fp32 and round each output element once. Elementwise kernels are one
// template over the storage type D (its fp32 instance the same loop as the fp32 kernel).

namespace {

void check_dropout_p(float p, std::string_view what) {
  if (!(p >= 0.0f && p < 1.0f))
    throw Error(fmt::format("cpu::{}: dropout probability {} is outside [0, 1)", what, p),
                "a model's *_pdrop values must be below 1");
}

template <DType D>
void gelu_forward_t(void* out, const void* inp, int64_t n) {
#pragma omp parallel for if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    store_from_f32(out, k, D, gelu(load_as_f32(inp, k, D)));
  }
}

template <DType D>
void gelu_backward_t(void* dinp, const void* inp, const void* dout, int64_t n) {
#pragma omp parallel for if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    store_from_f32(dinp, k, D, load_as_f32(dout, k, D) * gelu_grad(load_as_f32(inp, k, D)));
  }
}

template <DType D>
void residual_forward_t(void* out, const void* a, const void* b, int64_t n) {
#pragma omp parallel for if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    store_from_f32(out, k, D, load_as_f32(a, k, D) + load_as_f32(b, k, D));
  }
}

template <DType D>
void dropout_forward_t(void* out, uint8_t* mask, const void* inp, float p, uint64_t key,
                       int64_t n) {
  const uint32_t threshold = dropout_threshold(p);
  const float scale = dropout_scale(p);
#pragma omp parallel for if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const bool keep = dropout_keep(key, i, threshold);
    mask[i] = keep ? 1 : 0;
    store_from_f32(out, k, D, keep ? load_as_f32(inp, k, D) * scale : 0.0f);
  }
}

template <DType D>
void dropout_backward_t(void* dinp, const void* dout, const uint8_t* mask, float p, int64_t n) {
  const float scale = dropout_scale(p);
#pragma omp parallel for if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    store_from_f32(dinp, k, D, mask[i] != 0 ? load_as_f32(dout, k, D) * scale : 0.0f);
  }
}

template <DType D>
void crossentropy_backward_t(void* dlogits, const float* probs, const int32_t* targets,
                             float dloss, int64_t N, int64_t V) {
#pragma omp parallel for if (N * V > kParallelElems)
  for (int64_t r = 0; r < N; ++r)
    for (int64_t i = 0; i < V; ++i) {
      const int64_t k = r * V + i;
      const float p = i == targets[r] ? probs[k] - 1.0f : probs[k];
      store_from_f32(dlogits, static_cast<std::size_t>(k), D, p * dloss);
    }
}

// ---- fp16 / bf16 kernels. Each output element is owned by one loop iteration, which forms
// the fp32 sum of its contributions in locals (blocks of kCols values) and stores once: an
// accumulating kernel stores round(old + sum). Sums run in the order of the CUDA kernels
// (runtime/src/cuda/kernels.cu). fp32 storage never comes here (the kernels above).

// The two 16-bit types as compile-time constants (dispatch_dtype minus fp32).
template <typename F>
void dispatch16(DType t, F&& f) {
  if (t == DType::fp16) f(std::integral_constant<DType, DType::fp16>{});
  else f(std::integral_constant<DType, DType::bf16>{});
}

constexpr int64_t kCols = 64;  // fp32 accumulators per owner (a block of one row's outputs)

template <DType D>
void embedding_forward16(void* out, const int32_t* tokens, const void* wte, const void* wpe,
                         int64_t B, int64_t T, int64_t C) {
#pragma omp parallel for if (B * T * C > kParallelElems)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t e = static_cast<int64_t>(tokens[bt]) * C, p = (bt % T) * C;
    for (int64_t i = 0; i < C; ++i)
      st<D>(out, bt * C + i, wpe ? ld<D>(wte, e + i) + ld<D>(wpe, p + i) : ld<D>(wte, e + i));
  }
}

// dwte: a token may repeat. The first position holding a token owns its row: it sums dout
// over every position with that token, in ascending order, and adds once. dwpe[t] sums b.
template <DType D>
void embedding_backward16(void* dwte, void* dwpe, const void* dout, const int32_t* tokens,
                          int64_t B, int64_t T, int64_t C) {
  const int64_t BT = B * T;
#pragma omp parallel for if (BT * C > kParallelElems)
  for (int64_t bt = 0; bt < BT; ++bt) {
    const int32_t tok = tokens[bt];
    if (std::find(tokens, tokens + bt, tok) != tokens + bt) continue;  // not the first
    for (int64_t c0 = 0; c0 < C; c0 += kCols) {
      const int64_t n = std::min(kCols, C - c0);
      float acc[kCols] = {};
      for (int64_t j = bt; j < BT; ++j)
        if (tokens[j] == tok)
          for (int64_t i = 0; i < n; ++i) acc[i] += ld<D>(dout, j * C + c0 + i);
      for (int64_t i = 0; i < n; ++i) add_st<D>(dwte, static_cast<int64_t>(tok) * C + c0 + i, acc[i]);
    }
  }
  if (!dwpe) return;
#pragma omp parallel for if (BT * C > kParallelElems)
  for (int64_t tc = 0; tc < T * C; ++tc) {
    float acc = 0.0f;
    for (int64_t b = 0; b < B; ++b) acc += ld<D>(dout, b * T * C + tc);
    add_st<D>(dwpe, tc, acc);
  }
}

template <DType D>
void layernorm_forward16(void* out, float* stats, const void* inp, const void* weight,
                         const void* bias, int64_t N, int64_t C) {
#pragma omp parallel for if (N * C > kParallelElems)
  for (int64_t r = 0; r < N; ++r) {
    const std::byte* x = static_cast<const std::byte*>(inp) + r * C * static_cast<int64_t>(dtype_bytes(D));
    float mean, rstd;
    layernorm_row_stats<D>(x, C, &mean, &rstd);
    for (int64_t i = 0; i < C; ++i)
      st<D>(out, r * C + i,
            layernorm_apply(ld<D>(inp, r * C + i), mean, rstd, ld<D>(weight, i), ld<D>(bias, i)));
    stats[2 * r] = mean;
    stats[2 * r + 1] = rstd;
  }
}

template <DType D>
void layernorm_backward16(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                          const void* weight, const float* stats, int64_t N, int64_t C) {
#pragma omp parallel for if (N * C > kParallelElems)
  for (int64_t r = 0; r < N; ++r) {
    const auto* g = static_cast<const std::byte*>(dout) + r * C * static_cast<int64_t>(dtype_bytes(D));
    const auto* x = static_cast<const std::byte*>(inp) + r * C * static_cast<int64_t>(dtype_bytes(D));
    const float mean = stats[2 * r], rstd = stats[2 * r + 1];
    float g_mean, gxhat_mean;
    layernorm_row_grad_means<D>(g, x, weight, mean, rstd, C, &g_mean, &gxhat_mean);
    for (int64_t i = 0; i < C; ++i)
      add_st<D>(dinp, r * C + i,
                layernorm_dinp(ld<D>(dout, r * C + i), ld<D>(inp, r * C + i), ld<D>(weight, i),
                               mean, rstd, g_mean, gxhat_mean));
  }
  // dweight += sum_r dout * xhat, dbias += sum_r dout: a block of channels per owner.
  const int64_t n_blocks = (C + kCols - 1) / kCols;
#pragma omp parallel for if (N * C > kParallelElems)
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const int64_t c0 = blk * kCols, n = std::min(kCols, C - c0);
    float dw[kCols] = {}, db[kCols] = {};
    for (int64_t r = 0; r < N; ++r) {
      const float mean = stats[2 * r], rstd = stats[2 * r + 1];
      for (int64_t i = 0; i < n; ++i) {
        const float g = ld<D>(dout, r * C + c0 + i);
        dw[i] += g * (ld<D>(inp, r * C + c0 + i) - mean) * rstd;
        db[i] += g;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      add_st<D>(dweight, c0 + i, dw[i]);
      add_st<D>(dbias, c0 + i, db[i]);
    }
  }
}

// ---- 16-bit GEMMs through fp32 panels (cpu_kernels.hpp): C (M,N) (+)= op(A) (M,K) op(B) (K,N)
// for row-major operands read as D, computed panel by panel: each output panel is loaded as
// fp32 (or initialised), summed over all of K by SGEMM on converted A and B panels, and stored
// once. A and B are read through index functions so one driver serves the three products.
struct Panels {
  float* a;  // (kGemmPanel, kGemmPanel) of A, row-major (rows of C, K)
  float* b;  // of B, row-major (K, columns of C)
  float* c;  // of C
};

// Converts rows [r0, r0 + nr) and columns [c0, c0 + nc) of a matrix into `dst` (nr x nc
// row-major), element (i, j) read by at(r, c) -> flat index into src.
template <DType D, typename At>
void load_panel(float* dst, const void* src, int64_t r0, int64_t nr, int64_t c0, int64_t nc, At at) {
#pragma omp parallel for if (nr * nc > kParallelElems)
  for (int64_t i = 0; i < nr; ++i)
    for (int64_t j = 0; j < nc; ++j) dst[i * nc + j] = ld<D>(src, at(r0 + i, c0 + j));
}

// init(panel, m0, mr, n0, nc) fills the fp32 output panel before the sums; store(panel, ...)
// writes it back.
template <DType D, typename AAt, typename BAt, typename Init, typename Store>
void gemm16(int64_t M, int64_t N, int64_t K, const void* a, AAt a_at, const void* b, BAt b_at,
            Init init, Store store, const Panels& p, std::string_view what) {
  constexpr int64_t P = kGemmPanel;
  for (int64_t m0 = 0; m0 < M; m0 += P) {
    const int64_t mr = std::min(P, M - m0);
    for (int64_t n0 = 0; n0 < N; n0 += P) {
      const int64_t nc = std::min(P, N - n0);
      init(p.c, m0, mr, n0, nc);
      for (int64_t k0 = 0; k0 < K; k0 += P) {
        const int64_t kk = std::min(P, K - k0);
        load_panel<D>(p.a, a, m0, mr, k0, kk, a_at);
        load_panel<D>(p.b, b, k0, kk, n0, nc, b_at);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blas_dim(mr, what),
                    blas_dim(nc, what), blas_dim(kk, what), 1.0f, p.a, static_cast<int>(kk), p.b,
                    static_cast<int>(nc), 1.0f, p.c, static_cast<int>(nc));
      }
      store(p.c, m0, mr, n0, nc);
    }
  }
}

Panels panels_of(float* workspace, std::string_view what) {
  if (workspace == nullptr)
    throw Error(fmt::format("cpu::{}: a 16-bit GEMM needs a workspace of {} floats", what,
                            kGemmWorkspaceFloats),
                "pass the cpu device's GEMM panels");
  constexpr std::size_t P2 = static_cast<std::size_t>(kGemmPanel * kGemmPanel);
  return {workspace, workspace + P2, workspace + 2 * P2};
}

// out (N,OC) = inp (N,C) @ W^T + bias, out stored as out_t (D, or fp32 for logits).
template <DType D>
void matmul_forward16(void* out, DType out_t, const void* inp, const void* weight,
                      const void* bias, int64_t N, int64_t C, int64_t OC, float* workspace) {
  const Panels p = panels_of(workspace, "matmul_forward");
  auto init = [&](float* c, int64_t, int64_t mr, int64_t n0, int64_t nc) {
    for (int64_t i = 0; i < mr; ++i)
      for (int64_t j = 0; j < nc; ++j) c[i * nc + j] = bias ? ld<D>(bias, n0 + j) : 0.0f;
  };
  auto store = [&](const float* c, int64_t m0, int64_t mr, int64_t n0, int64_t nc) {
    for (int64_t i = 0; i < mr; ++i)
      for (int64_t j = 0; j < nc; ++j)
        store_from_f32(out, static_cast<std::size_t>((m0 + i) * OC + n0 + j), out_t, c[i * nc + j]);
  };
  gemm16<D>(N, OC, C, inp, [&](int64_t r, int64_t k) { return r * C + k; },  // inp (N,C)
            weight, [&](int64_t k, int64_t o) { return o * C + k; },          // W^T: W (OC,C)
            init, store, p, "matmul_forward");
}

template <DType D>
void matmul_backward16(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                       const void* weight, int64_t N, int64_t C, int64_t OC, float* workspace) {
  const Panels p = panels_of(workspace, "matmul_backward");
  // Accumulating outputs: the panel starts as the output's values, and goes back rounded once.
  auto accumulate_into = [&](void* dst, int64_t ld_dst) {
    auto init = [dst, ld_dst](float* c, int64_t m0, int64_t mr, int64_t n0, int64_t nc) {
      for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < nc; ++j) c[i * nc + j] = ld<D>(dst, (m0 + i) * ld_dst + n0 + j);
    };
    auto store = [dst, ld_dst](const float* c, int64_t m0, int64_t mr, int64_t n0, int64_t nc) {
      for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < nc; ++j) st<D>(dst, (m0 + i) * ld_dst + n0 + j, c[i * nc + j]);
    };
    return std::pair{init, store};
  };
  // dinp (N,C) += dout (N,OC) @ W (OC,C)
  const auto [init_x, store_x] = accumulate_into(dinp, C);
  gemm16<D>(N, C, OC, dout, [&](int64_t r, int64_t o) { return r * OC + o; }, weight,
            [&](int64_t o, int64_t c) { return o * C + c; }, init_x, store_x, p,
            "matmul_backward dinp");
  // dweight (OC,C) += dout^T (OC,N) @ inp (N,C)
  const auto [init_w, store_w] = accumulate_into(dweight, C);
  gemm16<D>(OC, C, N, dout, [&](int64_t o, int64_t r) { return r * OC + o; }, inp,
            [&](int64_t r, int64_t c) { return r * C + c; }, init_w, store_w, p,
            "matmul_backward dweight");
  if (!dbias) return;
  const int64_t n_blocks = (OC + kCols - 1) / kCols;
#pragma omp parallel for if (N * OC > kParallelElems)
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const int64_t o0 = blk * kCols, n = std::min(kCols, OC - o0);
    float acc[kCols] = {};
    for (int64_t r = 0; r < N; ++r)
      for (int64_t i = 0; i < n; ++i) acc[i] += ld<D>(dout, r * OC + o0 + i);
    for (int64_t i = 0; i < n; ++i) add_st<D>(dbias, o0 + i, acc[i]);
  }
}

// ---- 16-bit attention over any AttnShape (grouped-query heads, sliding windows), q, k and v
// where a QkvT has them. GPT-2's heads are the case {NH, NH, C / NH}, window 0, fused rows.
// Backward passes run over (b, key/value head), as the fp32 kernels: the group's query heads
// add into its shared key and value gradient in head order.

template <DType D>
QkvT fused16(const void* qkv, const AttnShape& s) {
  return {qkv, elem<D>(qkv, s.k_off()), elem<D>(qkv, s.v_off()), s.row(), s.row(), s.row()};
}

// softmax_row's arithmetic over keys first_key(t)..t (the max, then expf(x - max) summed in
// order, then each expf(x - max) * (1 / sum)), zeros elsewhere, every output stored once.
template <DType D>
void attention_softmax16(void* att, const void* preatt, const AttnShape& s) {
  const int64_t T = s.T, n_rows = s.B * s.NH * T;
#pragma omp parallel for if (n_rows * T > kParallelElems)
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t t = r % T, lo = s.first_key(t), row = r * T;
    float maxv = ld<D>(preatt, row + lo);
    for (int64_t i = lo + 1; i <= t; ++i) maxv = std::max(maxv, ld<D>(preatt, row + i));
    float sum = 0.0f;
    for (int64_t i = lo; i <= t; ++i) sum += expf(ld<D>(preatt, row + i) - maxv);
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < lo; ++i) st<D>(att, row + i, 0.0f);
    for (int64_t i = lo; i <= t; ++i) st<D>(att, row + i, expf(ld<D>(preatt, row + i) - maxv) * inv);
    for (int64_t i = t + 1; i < T; ++i) st<D>(att, row + i, 0.0f);
  }
}

// out[b,t,h] = sum over keys first_key(t)..t, ascending, of att[t,t2] v[t2] (as the fp32
// kernel's axpys).
template <DType D>
void attention_values16(void* out, const void* att, const QkvT& in, const AttnShape& s) {
  check_shape(s, "attention_values");
  const int64_t B = s.B, T = s.T, NH = s.NH, HS = s.HS, O = s.out_row(), G = s.group();
#pragma omp parallel for collapse(2) if (B * NH * T * T * HS > kParallelElems)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j0 = 0; j0 < HS; j0 += kCols) {
          const int64_t n = std::min(kCols, HS - j0);
          float acc[kCols] = {};
          for (int64_t t2 = s.first_key(t); t2 <= t; ++t2) {
            const float a = ld<D>(att, ((b * NH + h) * T + t) * T + t2);
            const int64_t v = (b * T + t2) * in.v_row + h / G * HS + j0;
            for (int64_t j = 0; j < n; ++j) acc[j] += a * ld<D>(in.v, v + j);
          }
          for (int64_t j = 0; j < n; ++j) st<D>(out, (b * T + t) * O + h * HS + j0 + j, acc[j]);
        }
}

// datt[t,t2] += dout[t] . v[t2]; dv[t2] += the sum over the group's query heads in order, then
// over the queries t >= t2 that see key t2, ascending, of att[t,t2] dout[t].
template <DType D>
void attention_values_backward16(void* datt, void* dqkv, const void* dout, const void* att,
                                 const QkvT& in, const AttnShape& s) {
  check_shape(s, "attention_values_backward");
  const int64_t B = s.B, T = s.T, NH = s.NH, HS = s.HS, R = s.row(), O = s.out_row(), G = s.group();
#pragma omp parallel for collapse(2) if (B * NH * T * T * HS > kParallelElems)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kv = 0; kv < s.KVH; ++kv) {
      for (int64_t h = kv * G; h < (kv + 1) * G; ++h)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t t2 = s.first_key(t); t2 <= t; ++t2)
            add_st<D>(datt, ((b * NH + h) * T + t) * T + t2,
                      dot_t<D>(dout, (b * T + t) * O + h * HS, in.v, (b * T + t2) * in.v_row + kv * HS, HS));
      for (int64_t t2 = 0; t2 < T; ++t2)
        for (int64_t j0 = 0; j0 < HS; j0 += kCols) {
          const int64_t n = std::min(kCols, HS - j0);
          float acc[kCols] = {};
          for (int64_t h = kv * G; h < (kv + 1) * G; ++h)
            for (int64_t t = t2; t < T && s.first_key(t) <= t2; ++t) {
              const float a = ld<D>(att, ((b * NH + h) * T + t) * T + t2);
              for (int64_t j = 0; j < n; ++j) acc[j] += a * ld<D>(dout, (b * T + t) * O + h * HS + j0 + j);
            }
          for (int64_t j = 0; j < n; ++j) add_st<D>(dqkv, (b * T + t2) * R + s.v_off() + kv * HS + j0 + j, acc[j]);
        }
    }
}

// dx = y (dy - sum y dy) over keys first_key(t)..t, zeros elsewhere; overwrites; in place
// allowed (the sum comes first).
template <DType D>
void attention_softmax_backward16(void* dpreatt, const void* datt, const void* att, const AttnShape& s) {
  const int64_t T = s.T, n_rows = s.B * s.NH * T;
#pragma omp parallel for if (n_rows * T > kParallelElems)
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t t = r % T, lo = s.first_key(t), row = r * T;
    const float d = dot_t<D>(att, row + lo, datt, row + lo, t - lo + 1);
    for (int64_t i = lo; i <= t; ++i)
      st<D>(dpreatt, row + i, ld<D>(att, row + i) * (ld<D>(datt, row + i) - d));
    for (int64_t i = 0; i < lo; ++i) st<D>(dpreatt, row + i, 0.0f);
    for (int64_t i = t + 1; i < T; ++i) st<D>(dpreatt, row + i, 0.0f);
  }
}

// g = dpreatt * scale; dq[t] += the sum over keys t2 = first_key(t)..t ascending of g[t,t2]
// k[t2]; dk[t2] += the sum over the group's query heads in order, then the queries t >= t2
// that see key t2, ascending, of g[t,t2] q[t].
template <DType D>
void attention_scores_backward16(void* dqkv, const void* dpreatt, const QkvT& in, const AttnShape& s) {
  check_shape(s, "attention_scores_backward");
  const int64_t B = s.B, T = s.T, NH = s.NH, HS = s.HS, R = s.row(), G = s.group();
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
#pragma omp parallel for collapse(2) if (B * NH * T * T * HS > kParallelElems)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kv = 0; kv < s.KVH; ++kv)
      for (int64_t t0 = 0; t0 < T; ++t0)
        for (int64_t j0 = 0; j0 < HS; j0 += kCols) {
          const int64_t n = std::min(kCols, HS - j0);
          for (int64_t h = kv * G; h < (kv + 1) * G; ++h) {  // q of token t0, head h
            const int64_t grid = (b * NH + h) * T * T;
            float dq[kCols] = {};
            for (int64_t t2 = s.first_key(t0); t2 <= t0; ++t2) {
              const float g = ld<D>(dpreatt, grid + t0 * T + t2) * scale;
              const int64_t k = (b * T + t2) * in.k_row + kv * HS + j0;
              for (int64_t j = 0; j < n; ++j) dq[j] += g * ld<D>(in.k, k + j);
            }
            for (int64_t j = 0; j < n; ++j) add_st<D>(dqkv, (b * T + t0) * R + h * HS + j0 + j, dq[j]);
          }
          float dk[kCols] = {};  // k of token t0, the group's key head
          for (int64_t h = kv * G; h < (kv + 1) * G; ++h) {
            const int64_t grid = (b * NH + h) * T * T;
            for (int64_t t = t0; t < T && s.first_key(t) <= t0; ++t) {
              const float g = ld<D>(dpreatt, grid + t * T + t0) * scale;
              const int64_t q = (b * T + t) * in.q_row + h * HS + j0;
              for (int64_t j = 0; j < n; ++j) dk[j] += g * ld<D>(in.q, q + j);
            }
          }
          for (int64_t j = 0; j < n; ++j)
            add_st<D>(dqkv, (b * T + t0) * R + s.k_off() + kv * HS + j0 + j, dk[j]);
        }
}

// ---- 16-bit LLaMA-family kernels: RMSNorm (rows and heads), rotary (rope_apply above) and
// SwiGLU (swiglu_*_t above). cpu_kernels.hpp states their sums and roundings.

template <DType D>
void rmsnorm_forward16(void* out, float* stats, const void* inp, const void* weight, float eps,
                       int64_t N, int64_t C) {
#pragma omp parallel for if (N * C > kParallelElems)
  for (int64_t r = 0; r < N; ++r) {
    const float rstd = rmsnorm_row_rstd<D>(elem<D>(inp, r * C), C, eps);
    stats[r] = rstd;
    for (int64_t i = 0; i < C; ++i) st<D>(out, r * C + i, ld<D>(inp, r * C + i) * rstd * ld<D>(weight, i));
  }
}

template <DType D>
void rmsnorm_backward16(void* dinp, void* dweight, const void* dout, const void* inp,
                        const void* weight, const float* stats, int64_t N, int64_t C) {
#pragma omp parallel for if (N * C > kParallelElems)
  for (int64_t r = 0; r < N; ++r) {
    const float rstd = stats[r];
    const float m = rmsnorm_row_gxhat_mean<D>(elem<D>(dout, r * C), elem<D>(inp, r * C), weight, 0.0f, rstd, C);
    for (int64_t i = 0; i < C; ++i)
      add_st<D>(dinp, r * C + i, rmsnorm_dinp(ld<D>(dout, r * C + i), ld<D>(inp, r * C + i), ld<D>(weight, i), rstd, m));
  }
  // dweight += the fp32 sum over rows of dout xhat: a block of channels per owner.
  const int64_t n_blocks = (C + kCols - 1) / kCols;
#pragma omp parallel for if (N * C > kParallelElems)
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const int64_t c0 = blk * kCols, n = std::min(kCols, C - c0);
    float acc[kCols] = {};
    for (int64_t r = 0; r < N; ++r)
      for (int64_t i = 0; i < n; ++i) acc[i] += ld<D>(dout, r * C + c0 + i) * ld<D>(inp, r * C + c0 + i) * stats[r];
    for (int64_t i = 0; i < n; ++i) add_st<D>(dweight, c0 + i, acc[i]);
  }
}

// Head j of token r among the NH query heads, then the key heads: its buffer and first element.
inline std::pair<const void*, int64_t> head_at(const QkvT& in, int64_t r, int64_t j, int64_t NH, int64_t HS) {
  return j < NH ? std::pair{in.q, r * in.q_row + j * HS} : std::pair{in.k, r * in.k_row + (j - NH) * HS};
}

template <DType D>
void head_rmsnorm_forward16(void* out, float* stats, const QkvT& in, const void* weight, float eps,
                            int64_t N, int64_t NH, int64_t KVH, int64_t HS) {
  check_head_norm(in, NH, KVH, HS, "head_rmsnorm_forward");
  const int64_t H = NH + KVH;
#pragma omp parallel for if (N * H * HS > kParallelElems)
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < H; ++j) {
      const auto [x, x0] = head_at(in, r, j, NH, HS);
      const int64_t w0 = j < NH ? 0 : HS;
      const float rstd = rmsnorm_row_rstd<D>(elem<D>(x, x0), HS, eps);
      stats[r * H + j] = rstd;
      for (int64_t i = 0; i < HS; ++i)
        st<D>(out, (r * H + j) * HS + i, ld<D>(x, x0 + i) * rstd * ld<D>(weight, w0 + i));
    }
}

template <DType D>
void head_rmsnorm_backward16(void* dqkv, int64_t grad_row, void* dweight, const QkvT& in,
                             const void* weight, const float* stats, int64_t N, int64_t NH,
                             int64_t KVH, int64_t HS) {
  check_head_norm(in, NH, KVH, HS, "head_rmsnorm_backward");
  const int64_t H = NH + KVH;
  check_grad_row(grad_row, H, HS);
  // dweight first (as the fp32 kernel): rows, then each row's heads in order, added once.
#pragma omp parallel for if (N * H * HS > kParallelElems)
  for (int64_t c = 0; c < 2 * HS; ++c) {
    const int64_t i = c % HS, j0 = c < HS ? 0 : NH, j1 = c < HS ? NH : H;
    float acc = 0.0f;
    for (int64_t r = 0; r < N; ++r)
      for (int64_t j = j0; j < j1; ++j) {
        const auto [x, x0] = head_at(in, r, j, NH, HS);
        acc += ld<D>(dqkv, r * grad_row + j * HS + i) * ld<D>(x, x0 + i) * stats[r * H + j];
      }
    add_st<D>(dweight, c, acc);
  }
#pragma omp parallel for if (N * H * HS > kParallelElems)
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < H; ++j) {
      const int64_t g0 = r * grad_row + j * HS, w0 = j < NH ? 0 : HS;
      const auto [x, x0] = head_at(in, r, j, NH, HS);
      const float rstd = stats[r * H + j];
      const float m = rmsnorm_row_gxhat_mean<D>(elem<D>(dqkv, g0), elem<D>(x, x0), elem<D>(weight, w0), 0.0f,
                                                rstd, HS);
      for (int64_t i = 0; i < HS; ++i)
        st<D>(dqkv, g0 + i, rmsnorm_dinp(ld<D>(dqkv, g0 + i), ld<D>(x, x0 + i), ld<D>(weight, w0 + i), rstd, m));
    }
}

}  // namespace

void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe,
                       DType t, int64_t B, int64_t T, int64_t C) {
  if (t == DType::fp32)
    return embedding_forward(static_cast<float*>(out), tokens, static_cast<const float*>(wte),
                             static_cast<const float*>(wpe), B, T, C);
  dispatch16(t, [&](auto d) { embedding_forward16<decltype(d)::value>(out, tokens, wte, wpe, B, T, C); });
}

void embedding_backward(void* dwte, void* dwpe, const void* dout, const int32_t* tokens, DType t,
                        int64_t B, int64_t T, int64_t C) {
  if (t == DType::fp32)
    return embedding_backward(static_cast<float*>(dwte), static_cast<float*>(dwpe),
                              static_cast<const float*>(dout), tokens, B, T, C);
  dispatch16(t, [&](auto d) {
    embedding_backward16<decltype(d)::value>(dwte, dwpe, dout, tokens, B, T, C);
  });
}

void layernorm_forward(void* out, float* stats, const void* inp, const void* weight,
                       const void* bias, DType t, int64_t N, int64_t C) {
  if (t == DType::fp32)
    return layernorm_forward(static_cast<float*>(out), stats, static_cast<const float*>(inp),
                             static_cast<const float*>(weight), static_cast<const float*>(bias),
                             N, C);
  dispatch16(t, [&](auto d) {
    layernorm_forward16<decltype(d)::value>(out, stats, inp, weight, bias, N, C);
  });
}

void layernorm_backward(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                        const void* weight, const float* stats, DType t, int64_t N, int64_t C) {
  if (t == DType::fp32)
    return layernorm_backward(static_cast<float*>(dinp), static_cast<float*>(dweight),
                              static_cast<float*>(dbias), static_cast<const float*>(dout),
                              static_cast<const float*>(inp), static_cast<const float*>(weight),
                              stats, N, C);
  dispatch16(t, [&](auto d) {
    layernorm_backward16<decltype(d)::value>(dinp, dweight, dbias, dout, inp, weight, stats, N, C);
  });
}

void matmul_forward(void* out, DType out_t, const void* inp, const void* weight, const void* bias,
                    DType t, int64_t N, int64_t C, int64_t OC, float* workspace) {
  if (t == DType::fp32 && out_t == DType::fp32)
    return matmul_forward(static_cast<float*>(out), static_cast<const float*>(inp),
                          static_cast<const float*>(weight), static_cast<const float*>(bias), N, C,
                          OC);
  if (t == DType::fp32)
    throw Error(fmt::format("cpu::matmul_forward: fp32 inputs with a {} output", to_string(out_t)),
                "a 16-bit output needs 16-bit inputs of the same type");
  if (out_t != t && out_t != DType::fp32)
    throw Error(fmt::format("cpu::matmul_forward: {} inputs with a {} output", to_string(t),
                            to_string(out_t)),
                "the output is stored as the inputs, or as fp32");
  dispatch16(t, [&](auto d) {
    matmul_forward16<decltype(d)::value>(out, out_t, inp, weight, bias, N, C, OC, workspace);
  });
}

void matmul_backward(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                     const void* weight, DType t, int64_t N, int64_t C, int64_t OC,
                     float* workspace) {
  if (t == DType::fp32)
    return matmul_backward(static_cast<float*>(dinp), static_cast<float*>(dweight),
                           static_cast<float*>(dbias), static_cast<const float*>(dout),
                           static_cast<const float*>(inp), static_cast<const float*>(weight), N, C,
                           OC);
  dispatch16(t, [&](auto d) {
    matmul_backward16<decltype(d)::value>(dinp, dweight, dbias, dout, inp, weight, N, C, OC, workspace);
  });
}

void attention_scores(void* preatt, const void* qkv, DType t, int64_t B, int64_t T, int64_t C,
                      int64_t NH) {
  const AttnShape shape = gpt2_shape(B, T, C, NH, "attention_scores");
  dispatch_dtype(t, [&](auto d) { attention_scores_t<decltype(d)::value>(preatt, qkv, shape); });
}

void attention_softmax(void* att, const void* preatt, DType t, int64_t B, int64_t NH, int64_t T) {
  if (t == DType::fp32)
    return attention_softmax(static_cast<float*>(att), static_cast<const float*>(preatt), B, NH, T);
  dispatch16(t, [&](auto d) { attention_softmax16<decltype(d)::value>(att, preatt, AttnShape{B, T, NH, NH, 1}); });
}

void attention_values(void* out, const void* att, const void* qkv, DType t, int64_t B, int64_t T,
                      int64_t C, int64_t NH) {
  if (t == DType::fp32)
    return attention_values(static_cast<float*>(out), static_cast<const float*>(att),
                            static_cast<const float*>(qkv), B, T, C, NH);
  const AttnShape s = gpt2_shape(B, T, C, NH, "attention_values");
  dispatch16(t, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    attention_values16<D>(out, att, fused16<D>(qkv, s), s);
  });
}

void attention_values_backward(void* datt, void* dqkv, const void* dout, const void* att,
                               const void* qkv, DType t, int64_t B, int64_t T, int64_t C,
                               int64_t NH) {
  if (t == DType::fp32)
    return attention_values_backward(static_cast<float*>(datt), static_cast<float*>(dqkv),
                                     static_cast<const float*>(dout), static_cast<const float*>(att),
                                     static_cast<const float*>(qkv), B, T, C, NH);
  const AttnShape s = gpt2_shape(B, T, C, NH, "attention_values_backward");
  dispatch16(t, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    attention_values_backward16<D>(datt, dqkv, dout, att, fused16<D>(qkv, s), s);
  });
}

void attention_softmax_backward(void* dpreatt, const void* datt, const void* att, DType t,
                                int64_t B, int64_t NH, int64_t T) {
  if (t == DType::fp32)
    return attention_softmax_backward(static_cast<float*>(dpreatt), static_cast<const float*>(datt),
                                      static_cast<const float*>(att), B, NH, T);
  dispatch16(t, [&](auto d) {
    attention_softmax_backward16<decltype(d)::value>(dpreatt, datt, att, AttnShape{B, T, NH, NH, 1});
  });
}

void attention_scores_backward(void* dqkv, const void* dpreatt, const void* qkv, DType t,
                               int64_t B, int64_t T, int64_t C, int64_t NH) {
  if (t == DType::fp32)
    return attention_scores_backward(static_cast<float*>(dqkv), static_cast<const float*>(dpreatt),
                                     static_cast<const float*>(qkv), B, T, C, NH);
  const AttnShape s = gpt2_shape(B, T, C, NH, "attention_scores_backward");
  dispatch16(t, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    attention_scores_backward16<D>(dqkv, dpreatt, fused16<D>(qkv, s), s);
  });
}

// ---- LLaMA-family typed kernels: fp32 goes to the fp32 kernels (Qkv for QkvT: the same
// pointers), fp16 and bf16 to the kernels above.

namespace {
Qkv f32_qkv(const QkvT& in) {
  return {static_cast<const float*>(in.q), static_cast<const float*>(in.k), static_cast<const float*>(in.v),
          in.q_row, in.k_row, in.v_row};
}
}  // namespace

void rmsnorm_forward(void* out, float* stats, const void* inp, const void* weight, float eps,
                     DType t, int64_t N, int64_t C) {
  if (t == DType::fp32)
    return rmsnorm_forward(static_cast<float*>(out), stats, static_cast<const float*>(inp),
                           static_cast<const float*>(weight), 0.0f, eps, N, C);
  dispatch16(t, [&](auto d) { rmsnorm_forward16<decltype(d)::value>(out, stats, inp, weight, eps, N, C); });
}

void rmsnorm_backward(void* dinp, void* dweight, const void* dout, const void* inp,
                      const void* weight, const float* stats, DType t, int64_t N, int64_t C) {
  if (t == DType::fp32)
    return rmsnorm_backward(static_cast<float*>(dinp), static_cast<float*>(dweight),
                            static_cast<const float*>(dout), static_cast<const float*>(inp),
                            static_cast<const float*>(weight), 0.0f, stats, N, C);
  dispatch16(t, [&](auto d) {
    rmsnorm_backward16<decltype(d)::value>(dinp, dweight, dout, inp, weight, stats, N, C);
  });
}

void head_rmsnorm_forward(void* out, float* stats, const QkvT& in, const void* weight, float eps,
                          DType t, int64_t N, int64_t NH, int64_t KVH, int64_t HS) {
  if (t == DType::fp32)
    return head_rmsnorm_forward(static_cast<float*>(out), stats, f32_qkv(in),
                                static_cast<const float*>(weight), eps, N, NH, KVH, HS);
  dispatch16(t, [&](auto d) {
    head_rmsnorm_forward16<decltype(d)::value>(out, stats, in, weight, eps, N, NH, KVH, HS);
  });
}

void head_rmsnorm_backward(void* dqkv, int64_t grad_row, void* dweight, const QkvT& in,
                           const void* weight, const float* stats, DType t, int64_t N, int64_t NH,
                           int64_t KVH, int64_t HS) {
  if (t == DType::fp32)
    return head_rmsnorm_backward(static_cast<float*>(dqkv), grad_row, static_cast<float*>(dweight),
                                 f32_qkv(in), static_cast<const float*>(weight), stats, N, NH, KVH, HS);
  dispatch16(t, [&](auto d) {
    head_rmsnorm_backward16<decltype(d)::value>(dqkv, grad_row, dweight, in, weight, stats, N, NH, KVH, HS);
  });
}

void rope_forward(void* x, const float* inv_freq, float mscale, DType t, int64_t B, int64_t T,
                  int64_t row, int64_t n_heads, int64_t HS, int64_t rot) {
  dispatch_dtype(t, [&](auto d) {
    rope_apply<decltype(d)::value, true>(x, inv_freq, mscale, B, T, row, n_heads, HS, rot);
  });
}

void rope_backward(void* dx, const float* inv_freq, float mscale, DType t, int64_t B, int64_t T,
                   int64_t row, int64_t n_heads, int64_t HS, int64_t rot) {
  dispatch_dtype(t, [&](auto d) {
    rope_apply<decltype(d)::value, false>(dx, inv_freq, mscale, B, T, row, n_heads, HS, rot);
  });
}

void swiglu_forward(void* out, const void* gate, const void* up, DType t, int64_t n) {
  dispatch_dtype(t, [&](auto d) { swiglu_forward_t<decltype(d)::value>(out, gate, up, n); });
}

void swiglu_backward(void* dgate_up, const void* dout, const void* gate, const void* up, DType t,
                     int64_t N, int64_t F) {
  dispatch_dtype(t, [&](auto d) { swiglu_backward_t<decltype(d)::value>(dgate_up, dout, gate, up, N, F); });
}

void attention_scores(void* preatt, const QkvT& in, DType t, const AttnShape& s) {
  dispatch_dtype(t, [&](auto d) {
    attention_scores_t<decltype(d)::value>(preatt, in.q, 0, in.q_row, in.k, 0, in.k_row, s);
  });
}

void attention_softmax(void* att, const void* preatt, DType t, const AttnShape& s) {
  if (t == DType::fp32)
    return attention_softmax(static_cast<float*>(att), static_cast<const float*>(preatt), s);
  dispatch16(t, [&](auto d) { attention_softmax16<decltype(d)::value>(att, preatt, s); });
}

void attention_softmax_backward(void* dpreatt, const void* datt, const void* att, DType t,
                                const AttnShape& s) {
  if (t == DType::fp32)
    return attention_softmax_backward(static_cast<float*>(dpreatt), static_cast<const float*>(datt),
                                      static_cast<const float*>(att), s);
  dispatch16(t, [&](auto d) { attention_softmax_backward16<decltype(d)::value>(dpreatt, datt, att, s); });
}

void attention_values(void* out, const void* att, const QkvT& in, DType t, const AttnShape& s) {
  if (t == DType::fp32)
    return attention_values(static_cast<float*>(out), static_cast<const float*>(att), f32_qkv(in), s);
  dispatch16(t, [&](auto d) { attention_values16<decltype(d)::value>(out, att, in, s); });
}

void attention_values_backward(void* datt, void* dqkv, const void* dout, const void* att,
                               const QkvT& in, DType t, const AttnShape& s) {
  if (t == DType::fp32)
    return attention_values_backward(static_cast<float*>(datt), static_cast<float*>(dqkv),
                                     static_cast<const float*>(dout), static_cast<const float*>(att),
                                     f32_qkv(in), s);
  dispatch16(t, [&](auto d) { attention_values_backward16<decltype(d)::value>(datt, dqkv, dout, att, in, s); });
}

void attention_scores_backward(void* dqkv, const void* dpreatt, const QkvT& in, DType t,
                               const AttnShape& s) {
  if (t == DType::fp32)
    return attention_scores_backward(static_cast<float*>(dqkv), static_cast<const float*>(dpreatt),
                                     f32_qkv(in), s);
  dispatch16(t, [&](auto d) { attention_scores_backward16<decltype(d)::value>(dqkv, dpreatt, in, s); });
}

void gelu_forward(void* out, const void* inp, DType t, int64_t n) {
  dispatch_dtype(t, [&](auto d) { gelu_forward_t<decltype(d)::value>(out, inp, n); });
}

void gelu_backward(void* dinp, const void* inp, const void* dout, DType t, int64_t n) {
  dispatch_dtype(t, [&](auto d) { gelu_backward_t<decltype(d)::value>(dinp, inp, dout, n); });
}

void residual_forward(void* out, const void* a, const void* b, DType t, int64_t n) {
  dispatch_dtype(t, [&](auto d) { residual_forward_t<decltype(d)::value>(out, a, b, n); });
}

void dropout_forward(void* out, uint8_t* mask, const void* inp, DType t, float p, uint64_t key,
                     int64_t n) {
  check_dropout_p(p, "dropout_forward");
  dispatch_dtype(t, [&](auto d) { dropout_forward_t<decltype(d)::value>(out, mask, inp, p, key, n); });
}

void dropout_backward(void* dinp, const void* dout, const uint8_t* mask, DType t, float p,
                      int64_t n) {
  check_dropout_p(p, "dropout_backward");
  dispatch_dtype(t, [&](auto d) { dropout_backward_t<decltype(d)::value>(dinp, dout, mask, p, n); });
}

void crossentropy_backward(void* dlogits, DType t, const float* probs, const int32_t* targets,
                           float dloss, int64_t N, int64_t V) {
  if (t == DType::fp32 && dlogits == probs)
    return crossentropy_backward(static_cast<float*>(dlogits), targets, dloss, N, V);
  check_targets(targets, N, V, "crossentropy_backward");
  dispatch_dtype(t, [&](auto d) {
    crossentropy_backward_t<decltype(d)::value>(dlogits, probs, targets, dloss, N, V);
  });
}

// ---- 16-bit storage -------------------------------------------------------------------------
// One loop per storage type (the type test hoisted out of the loop), each element through
// dtype.hpp's scalar conversions.

namespace {
template <typename Op>
void for_each_elem(int64_t n, Op op) {
#pragma omp parallel for if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) op(static_cast<std::size_t>(i));
}
}  // namespace

void to_f32(float* dst, const void* src, DType t, int64_t n) {
  const auto* h = static_cast<const uint16_t*>(src);
  switch (t) {
    case DType::fp32:
      for_each_elem(n, [&](std::size_t i) { dst[i] = static_cast<const float*>(src)[i]; });
      break;
    case DType::fp16:
      for_each_elem(n, [&](std::size_t i) { dst[i] = fp16_to_fp32(h[i]); });
      break;
    case DType::bf16:
      for_each_elem(n, [&](std::size_t i) { dst[i] = bf16_to_fp32(h[i]); });
      break;
  }
}

void from_f32(void* dst, const float* src, DType t, int64_t n) {
  auto* h = static_cast<uint16_t*>(dst);
  switch (t) {
    case DType::fp32:
      for_each_elem(n, [&](std::size_t i) { static_cast<float*>(dst)[i] = src[i]; });
      break;
    case DType::fp16:
      for_each_elem(n, [&](std::size_t i) { h[i] = fp32_to_fp16(src[i]); });
      break;
    case DType::bf16:
      for_each_elem(n, [&](std::size_t i) { h[i] = fp32_to_bf16(src[i]); });
      break;
  }
}

// accumulate_as with a literal type: the compiler folds its switch away.
void accumulate_to(void* dst, const float* src, DType t, int64_t n) {
  switch (t) {
    case DType::fp32:
      for_each_elem(n, [&](std::size_t i) { accumulate_as(dst, i, DType::fp32, src[i]); });
      break;
    case DType::fp16:
      for_each_elem(n, [&](std::size_t i) { accumulate_as(dst, i, DType::fp16, src[i]); });
      break;
    case DType::bf16:
      for_each_elem(n, [&](std::size_t i) { accumulate_as(dst, i, DType::bf16, src[i]); });
      break;
  }
}

void sgd_step(float* master, float* momentum_buf, const void* grads, DType grad_dtype,
              void* param_out, DType param_dtype, float lr, float momentum, float weight_decay,
              float grad_scale, int64_t n) {
  for_each_elem(n, [&](std::size_t i) {
    float w = master[i], buf = momentum_buf[i];
    sgd_element(load_as_f32(grads, i, grad_dtype), grad_scale, lr, momentum, weight_decay, w, buf);
    momentum_buf[i] = buf;
    master[i] = w;
    if (param_out != nullptr) store_from_f32(param_out, i, param_dtype, w);
  });
}

}  // namespace zp::runtime::cpu
