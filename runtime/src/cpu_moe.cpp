// cpu_moe.cpp: the Mixture-of-Experts routing kernels of the CPU backend (cpu_kernels.hpp
// states the contract): the router's softmax and top-k, the dispatch of each token's k copies
// to rows grouped by expert, the weighted combine, and their backwards.
//
// The dispatched rows are ordered by expert, then token, then slot (a stable counting sort of
// the (token, slot) pairs by expert), so each expert's rows are one block for its GEMMs. No
// kernel stores that permutation: each walks the pairs in order with a cursor per expert (a
// stack array of E counters, E <= kMaxExperts), and the row-wide copies are split over the
// threads by columns, so every thread walks the same order and nothing is shared.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "cpu_vec.hpp"
#include "zp/error.hpp"
#include "zp/runtime/cpu_kernels.hpp"
#include "zp/runtime/kernel_math.hpp"

namespace zp::runtime::cpu {

namespace {

void check_moe(int64_t N, int64_t E, int64_t K, std::string_view what) {
  if (N < 0 || E <= 0 || E > kMaxExperts || K <= 0 || K > E)
    throw Error(
        fmt::format("cpu::{}: {} tokens, {} experts, top {}", what, N, E, K),
        fmt::format("the experts must number 1 to {} and top-k at most their number", kMaxExperts));
}

// offsets[e] = the first dispatched row of expert e (an exclusive prefix sum of the counts);
// throws on an index outside [0, E).
void expert_offsets(ExpertIdx idx, int64_t N, int64_t K, int64_t E, int64_t* offsets,
                    std::string_view what) {
  std::fill(offsets, offsets + E + 1, int64_t{0});
  for (int64_t i = 0; i < N * K; ++i) {
    if (idx[i] < 0 || idx[i] >= E)
      throw Error(fmt::format("cpu::{}: expert index {} at (token {}, slot {}) is outside [0, {})",
                              what, idx[i], i / K, i % K, E),
                  "the top-k indices come from moe_route_forward");
    ++offsets[idx[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
}

// Calls f(n, k, row) for every (token, slot) pair in token order, row its dispatched row.
template <class F>
void walk_rows(ExpertIdx idx, int64_t N, int64_t K, int64_t E, std::string_view what, F&& f) {
  int64_t cursor[kMaxExperts + 1];
  expert_offsets(idx, N, K, E, cursor, what);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) f(n, k, cursor[idx[n * K + k]]++);
}

// The columns [c0, c1) of C this thread copies.
std::pair<int64_t, int64_t> my_columns(int64_t C) {
  const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
  return {C * t / nt, C * (t + 1) / nt};
}

}  // namespace

void moe_expert_counts(ExpertIdx idx, int64_t N, int64_t K, int64_t E, int64_t* offsets) {
  check_moe(N, E, K, "moe_expert_counts");
  expert_offsets(idx, N, K, E, offsets, "moe_expert_counts");
}

namespace {

using vec::add_st;
using vec::ld;
using vec::st;

// The kernels over logits, rows and gradients stored as D (their fp32 instances: the fp32
// kernels below). Accumulating outputs add the fp32 sum of their contributions once.

template <DType D>
void moe_route_forward_t(float* probs, ExpertIdx idx, float* weights, const void* logits, int64_t N,
                         int64_t E, int64_t K, bool renormalize) {
  check_moe(N, E, K, "moe_route_forward");
  const bool top_k = idx.p != nullptr && weights != nullptr;
#pragma omp parallel for if (N * E > (1 << 15))
  for (int64_t n = 0; n < N; ++n) {
    float* p = probs + n * E;
    // The logits as fp32: read in place, or loaded into the probabilities' row (softmax_row
    // may run in place).
    const float* x = p;
    if constexpr (D == DType::fp32) x = static_cast<const float*>(logits) + n * E;
    else
      for (int64_t e = 0; e < E; ++e) p[e] = ld<D>(logits, n * E + e);
    softmax_row(p, x, E);
    if (!top_k) continue;
    // Top k by probability, the lower index first among equals (a stable selection).
    int64_t ix[kMaxExperts];
    float* w = weights + n * K;
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t j = 0; j < k; ++j) taken = taken || ix[j] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      ix[k] = best;
      idx.set(n * K + k, best);
      w[k] = p[best];
      sum += p[best];
    }
    if (renormalize)
      for (int64_t k = 0; k < K; ++k) w[k] /= sum;
  }
}

template <DType D>
void moe_route_backward_t(void* dlogits, const float* dweights, const float* probs, ExpertIdx idx,
                          const float* dprob_all, int64_t N, int64_t E, int64_t K, bool renormalize) {
  check_moe(N, E, K, "moe_route_backward");
#pragma omp parallel for if (N * E > (1 << 15))
  for (int64_t n = 0; n < N; ++n) {
    const float* p = probs + n * E;
    int64_t ix[kMaxExperts];
    for (int64_t k = 0; k < K; ++k) ix[k] = idx[n * K + k];
    const float* dw = dweights + n * K;
    // The row's gradient in fp32: dlogits' row itself, or a local row stored once at the end.
    float local[D == DType::fp32 ? 1 : kMaxExperts];
    float* dl = local;
    if constexpr (D == DType::fp32) dl = static_cast<float*>(dlogits) + n * E;
    // dL/dp: the top-k weights' gradient (through the renormalisation w_k = p_k / S, S the sum
    // of the chosen p: dp_k = (dw_k - sum_j dw_j w_j) / S), plus the load-balancing term.
    for (int64_t e = 0; e < E; ++e) dl[e] = dprob_all ? dprob_all[e] : 0.0f;
    if (renormalize) {
      float S = 0.0f, dot = 0.0f;
      for (int64_t k = 0; k < K; ++k) S += p[ix[k]];
      for (int64_t k = 0; k < K; ++k) dot += dw[k] * (p[ix[k]] / S);
      for (int64_t k = 0; k < K; ++k) dl[ix[k]] += (dw[k] - dot) / S;
    } else {
      for (int64_t k = 0; k < K; ++k) dl[ix[k]] += dw[k];
    }
    // Through the softmax: dlogit = p (dp - sum_e p_e dp_e).
    float s = 0.0f;
    for (int64_t e = 0; e < E; ++e) s += p[e] * dl[e];
    for (int64_t e = 0; e < E; ++e) dl[e] = p[e] * (dl[e] - s);
    if constexpr (D != DType::fp32)
      for (int64_t e = 0; e < E; ++e) st<D>(dlogits, n * E + e, dl[e]);
  }
}

template <DType D>
void moe_dispatch_t(void* xe, const void* in, ExpertIdx idx, int64_t N, int64_t K, int64_t E,
                    int64_t C) {
  check_moe(N, E, K, "moe_dispatch");
  int64_t probe[kMaxExperts + 1];
  expert_offsets(idx, N, K, E, probe, "moe_dispatch");  // indices checked before the threads
  constexpr auto eb = static_cast<int64_t>(dtype_bytes(D));
#pragma omp parallel if (N * K * C > (1 << 15))
  {
    const auto [c0, c1] = my_columns(C);
    walk_rows(idx, N, K, E, "moe_dispatch", [&](int64_t n, int64_t, int64_t r) {
      std::memcpy(static_cast<std::byte*>(xe) + (r * C + c0) * eb,
                  static_cast<const std::byte*>(in) + (n * C + c0) * eb,
                  static_cast<std::size_t>((c1 - c0) * eb));
    });
  }
}

// A token's K rows come one after another in walk_rows: fp32 adds each into din (as ever);
// 16-bit sums them in fp32, kCols columns at a time, and adds the sum once.
constexpr int64_t kCols = 64;

template <DType D>
void moe_dispatch_backward_t(void* din, const void* dxe, ExpertIdx idx, int64_t N, int64_t K,
                             int64_t E, int64_t C) {
  check_moe(N, E, K, "moe_dispatch_backward");
  int64_t probe[kMaxExperts + 1];
  expert_offsets(idx, N, K, E, probe, "moe_dispatch_backward");
#pragma omp parallel if (N * K * C > (1 << 15))
  {
    const auto [c0, c1] = my_columns(C);
    if constexpr (D == DType::fp32) {
      walk_rows(idx, N, K, E, "moe_dispatch_backward", [&](int64_t n, int64_t, int64_t r) {
        float* d = static_cast<float*>(din) + n * C;
        const float* g = static_cast<const float*>(dxe) + r * C;
        for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
      });
    } else {
      for (int64_t b0 = c0; b0 < c1; b0 += kCols) {
        const int64_t nc = std::min(kCols, c1 - b0);
        float acc[kCols] = {};
        walk_rows(idx, N, K, E, "moe_dispatch_backward", [&](int64_t n, int64_t k, int64_t r) {
          for (int64_t c = 0; c < nc; ++c) acc[c] += ld<D>(dxe, r * C + b0 + c);
          if (k < K - 1) return;
          for (int64_t c = 0; c < nc; ++c) {
            add_st<D>(din, n * C + b0 + c, acc[c]);
            acc[c] = 0.0f;
          }
        });
      }
    }
  }
}

// out[n] = w_0 ye[row(n, 0)] + w_1 ye[row(n, 1)] + ... in fp32, slot by slot, stored once.
template <DType D>
void moe_combine_t(void* out, const void* ye, const float* weights, ExpertIdx idx, int64_t N,
                   int64_t K, int64_t E, int64_t C) {
  check_moe(N, E, K, "moe_combine");
  int64_t probe[kMaxExperts + 1];
  expert_offsets(idx, N, K, E, probe, "moe_combine");
#pragma omp parallel if (N * K * C > (1 << 15))
  {
    const auto [c0, c1] = my_columns(C);
    if constexpr (D == DType::fp32) {
      walk_rows(idx, N, K, E, "moe_combine", [&](int64_t n, int64_t k, int64_t r) {
        float* o = static_cast<float*>(out) + n * C;
        const float* y = static_cast<const float*>(ye) + r * C;
        const float w = weights[n * K + k];
        if (k == 0)
          for (int64_t c = c0; c < c1; ++c) o[c] = w * y[c];
        else
          for (int64_t c = c0; c < c1; ++c) o[c] += w * y[c];
      });
    } else {
      for (int64_t b0 = c0; b0 < c1; b0 += kCols) {
        const int64_t nc = std::min(kCols, c1 - b0);
        float acc[kCols];
        walk_rows(idx, N, K, E, "moe_combine", [&](int64_t n, int64_t k, int64_t r) {
          const float w = weights[n * K + k];
          if (k == 0)
            for (int64_t c = 0; c < nc; ++c) acc[c] = w * ld<D>(ye, r * C + b0 + c);
          else
            for (int64_t c = 0; c < nc; ++c) acc[c] += w * ld<D>(ye, r * C + b0 + c);
          if (k == K - 1)
            for (int64_t c = 0; c < nc; ++c) st<D>(out, n * C + b0 + c, acc[c]);
        });
      }
    }
  }
}

template <DType D>
void moe_combine_backward_t(void* dye, float* dweights, const void* dout, const void* ye,
                            const float* weights, ExpertIdx idx, int64_t N, int64_t K, int64_t E,
                            int64_t C) {
  check_moe(N, E, K, "moe_combine_backward");
  int64_t probe[kMaxExperts + 1];
  expert_offsets(idx, N, K, E, probe, "moe_combine_backward");
#pragma omp parallel if (N * K * C > (1 << 15))
  {
    const auto [c0, c1] = my_columns(C);
    walk_rows(idx, N, K, E, "moe_combine_backward", [&](int64_t n, int64_t k, int64_t r) {
      const float w = weights[n * K + k];
      for (int64_t c = c0; c < c1; ++c) st<D>(dye, r * C + c, w * ld<D>(dout, n * C + c));
    });
  }
  // dw[n, k] = dout[n] . ye[row]: whole rows, one pass in order (16-bit: a sequential sum).
  walk_rows(idx, N, K, E, "moe_combine_backward", [&](int64_t n, int64_t k, int64_t r) {
    if constexpr (D == DType::fp32) {
      dweights[n * K + k] =
          vec::dot(static_cast<const float*>(dout) + n * C, static_cast<const float*>(ye) + r * C, C);
    } else {
      float s = 0.0f;
      for (int64_t c = 0; c < C; ++c) s += ld<D>(dout, n * C + c) * ld<D>(ye, r * C + c);
      dweights[n * K + k] = s;
    }
  });
}

// Qwen2-MoE's gated shared expert, stored as D.
template <DType D>
void gate_mul_forward_t(void* out, const void* x, const void* g, int64_t N, int64_t C) {
#pragma omp parallel for if (N * C > (1 << 15))
  for (int64_t n = 0; n < N; ++n) {
    const float s = 1.0f / (1.0f + std::exp(-ld<D>(g, n)));
    for (int64_t c = 0; c < C; ++c) st<D>(out, n * C + c, s * ld<D>(x, n * C + c));
  }
}

template <DType D>
void gate_mul_backward_t(void* dx, void* dg, const void* dout, const void* x, const void* g,
                         int64_t N, int64_t C) {
#pragma omp parallel for if (N * C > (1 << 15))
  for (int64_t n = 0; n < N; ++n) {
    const float s = 1.0f / (1.0f + std::exp(-ld<D>(g, n)));
    float dot = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      const float go = ld<D>(dout, n * C + c);
      dot += go * ld<D>(x, n * C + c);
      st<D>(dx, n * C + c, s * go);
    }
    st<D>(dg, n, dot * s * (1.0f - s));
  }
}

}  // namespace

void moe_route_forward(float* probs, ExpertIdx idx, float* weights, const float* logits, int64_t N,
                       int64_t E, int64_t K, bool renormalize) {
  moe_route_forward_t<DType::fp32>(probs, idx, weights, logits, N, E, K, renormalize);
}
void moe_route_forward(float* probs, ExpertIdx idx, float* weights, const void* logits, DType t,
                       int64_t N, int64_t E, int64_t K, bool renormalize) {
  dispatch_dtype(t, [&](auto d) {
    moe_route_forward_t<decltype(d)::value>(probs, idx, weights, logits, N, E, K, renormalize);
  });
}

void moe_route_backward(float* dlogits, const float* dweights, const float* probs, ExpertIdx idx,
                        const float* dprob_all, int64_t N, int64_t E, int64_t K, bool renormalize) {
  moe_route_backward_t<DType::fp32>(dlogits, dweights, probs, idx, dprob_all, N, E, K, renormalize);
}
void moe_route_backward(void* dlogits, DType t, const float* dweights, const float* probs,
                        ExpertIdx idx, const float* dprob_all, int64_t N, int64_t E, int64_t K,
                        bool renormalize) {
  dispatch_dtype(t, [&](auto d) {
    moe_route_backward_t<decltype(d)::value>(dlogits, dweights, probs, idx, dprob_all, N, E, K,
                                             renormalize);
  });
}

void moe_dispatch(float* xe, const float* in, ExpertIdx idx, int64_t N, int64_t K, int64_t E,
                  int64_t C) {
  moe_dispatch_t<DType::fp32>(xe, in, idx, N, K, E, C);
}
void moe_dispatch(void* xe, const void* in, ExpertIdx idx, DType t, int64_t N, int64_t K,
                  int64_t E, int64_t C) {
  dispatch_dtype(t, [&](auto d) { moe_dispatch_t<decltype(d)::value>(xe, in, idx, N, K, E, C); });
}

void moe_dispatch_backward(float* din, const float* dxe, ExpertIdx idx, int64_t N, int64_t K,
                           int64_t E, int64_t C) {
  moe_dispatch_backward_t<DType::fp32>(din, dxe, idx, N, K, E, C);
}
void moe_dispatch_backward(void* din, const void* dxe, ExpertIdx idx, DType t, int64_t N,
                           int64_t K, int64_t E, int64_t C) {
  dispatch_dtype(t, [&](auto d) { moe_dispatch_backward_t<decltype(d)::value>(din, dxe, idx, N, K, E, C); });
}

void moe_combine(float* out, const float* ye, const float* weights, ExpertIdx idx, int64_t N,
                 int64_t K, int64_t E, int64_t C) {
  moe_combine_t<DType::fp32>(out, ye, weights, idx, N, K, E, C);
}
void moe_combine(void* out, const void* ye, const float* weights, ExpertIdx idx, DType t,
                 int64_t N, int64_t K, int64_t E, int64_t C) {
  dispatch_dtype(t, [&](auto d) { moe_combine_t<decltype(d)::value>(out, ye, weights, idx, N, K, E, C); });
}

void moe_combine_backward(float* dye, float* dweights, const float* dout, const float* ye,
                          const float* weights, ExpertIdx idx, int64_t N, int64_t K, int64_t E,
                          int64_t C) {
  moe_combine_backward_t<DType::fp32>(dye, dweights, dout, ye, weights, idx, N, K, E, C);
}
void moe_combine_backward(void* dye, float* dweights, const void* dout, const void* ye,
                          const float* weights, ExpertIdx idx, DType t, int64_t N, int64_t K,
                          int64_t E, int64_t C) {
  dispatch_dtype(t, [&](auto d) {
    moe_combine_backward_t<decltype(d)::value>(dye, dweights, dout, ye, weights, idx, N, K, E, C);
  });
}

void gate_mul_forward(float* out, const float* x, const float* g, int64_t N, int64_t C) {
  gate_mul_forward_t<DType::fp32>(out, x, g, N, C);
}
void gate_mul_forward(void* out, const void* x, const void* g, DType t, int64_t N, int64_t C) {
  dispatch_dtype(t, [&](auto d) { gate_mul_forward_t<decltype(d)::value>(out, x, g, N, C); });
}

void gate_mul_backward(float* dx, float* dg, const float* dout, const float* x, const float* g,
                       int64_t N, int64_t C) {
  gate_mul_backward_t<DType::fp32>(dx, dg, dout, x, g, N, C);
}
void gate_mul_backward(void* dx, void* dg, const void* dout, const void* x, const void* g,
                       DType t, int64_t N, int64_t C) {
  dispatch_dtype(t, [&](auto d) { gate_mul_backward_t<decltype(d)::value>(dx, dg, dout, x, g, N, C); });
}

}  // namespace zp::runtime::cpu
