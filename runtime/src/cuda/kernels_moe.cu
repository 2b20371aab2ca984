// kernels_moe.cu: the CUDA kernels of Mixture-of-Experts layers (cpu_kernels.hpp's moe_*
// contracts): the router's softmax and top-k, the per-expert row offsets, the dispatch of each
// token's K copies to rows grouped by expert (then token, then slot: cpu_moe.cpp's order), the
// weighted combine, and their backwards.
//
// No kernel stores the permutation in memory of its own. The expert-major kernels (dispatch,
// the combine's backward, the dispatch's backward) give each expert one block, which walks the
// (token, slot) pairs in order 256 at a time, finds its own with warp ballots and numbers them
// in order (the dispatched row = the expert's offset + that number), so every row has one
// owner. The combine needs each token's K rows in one place (its output is a sum over them): a
// first expert-major pass writes each pair's row number into the token's own output row (K
// int32 at its start; the output is overwritten anyway), and a second pass, one warp per
// token, reads them before it writes the row. The dispatch's backward adds into din: one
// expert-major pass per slot k, in slot order, so each token row has one writer per pass and
// the sum runs in cpu_moe.cpp's order (bit for bit in fp32; a 16-bit din is rounded once per
// slot, K times, where the cpu rounds the slots' fp32 sum once).
#include <cmath>
#include <cstdint>
#include <string>

#include "kernel_common.cuh"
#include "kernels.hpp"

namespace zp::runtime::cuda {

using namespace common;

namespace {

template <DType D>
__host__ __device__ constexpr int64_t bytes_of() {
  return D == DType::fp32 ? 4 : 2;
}

// ---- Routing: one warp per token; lane l owns experts l, l + 32, ... ---------------------------

constexpr int kPerLane = static_cast<int>((kMoeMaxExperts + kWarp - 1) / kWarp);

// probs (N, E) fp32 = softmax(logits), softmax_row's steps (max, expf(x - max) summed, times
// 1 / sum); then the top K by probability, the lower index first among equals, their
// probabilities as weights, renormalised to sum 1 if asked (the sum in slot order).
template <DType D>
__global__ void moe_route_forward_k(float* probs, ExpertIdx idx, float* weights, const void* logits,
                                    int64_t N, int64_t E, int64_t K, bool renormalize) {
  const int64_t n = warp_row();
  const int lane = lane_id();
  if (n >= N) return;
  float maxv = -INFINITY;
  for (int64_t e = lane; e < E; e += kWarp) maxv = fmaxf(maxv, ld<D>(logits, n * E + e));
  maxv = warp_max(maxv);
  float sum = 0.0f;
  for (int64_t e = lane; e < E; e += kWarp) sum += expf(ld<D>(logits, n * E + e) - maxv);
  const float inv = 1.0f / warp_sum(sum);
  for (int64_t e = lane; e < E; e += kWarp) probs[n * E + e] = expf(ld<D>(logits, n * E + e) - maxv) * inv;
  if (idx.p == nullptr || weights == nullptr) return;
  __syncwarp();
  uint32_t taken = 0;  // bit j: expert lane + 32 j chosen
  float wsum = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    float best = -INFINITY;
    int64_t best_e = E;
    for (int64_t e = lane, j = 0; e < E; e += kWarp, ++j) {
      const float p = probs[n * E + e];
      if ((taken >> j & 1u) == 0 && (best_e == E || p > best)) {
        best = p;
        best_e = e;
      }
    }
    for (int o = kWarp / 2; o > 0; o >>= 1) {  // the larger, the lower index among equals
      const float ob = __shfl_xor_sync(kFullMask, best, o);
      const int64_t oe = __shfl_xor_sync(kFullMask, best_e, o);
      if (oe < E && (best_e == E || ob > best || (ob == best && oe < best_e))) {
        best = ob;
        best_e = oe;
      }
    }
    if (best_e % kWarp == lane) taken |= 1u << (best_e / kWarp);
    wsum += best;
    if (lane == 0) {
      idx.set(n * K + k, best_e);
      weights[n * K + k] = best;
    }
  }
  if (renormalize && lane == 0)
    for (int64_t k = 0; k < K; ++k) weights[n * K + k] /= wsum;
}

// dlogits (N, E), overwritten: dp = dprob_all (or 0) plus the top-k weights' gradient (through
// the renormalisation if any), then through the softmax, dlogit = p (dp - sum_e p_e dp_e).
template <DType D>
__global__ void moe_route_backward_k(void* dlogits, const float* dweights, const float* probs,
                                     ExpertIdx idx, const float* dprob_all, int64_t N, int64_t E,
                                     int64_t K, bool renormalize) {
  const int64_t n = warp_row();
  const int lane = lane_id();
  if (n >= N) return;
  const float* p = probs + n * E;
  const float* dw = dweights + n * K;
  float dl[kPerLane];
  for (int64_t e = lane, j = 0; j < kPerLane; e += kWarp, ++j)
    dl[j] = e < E && dprob_all != nullptr ? dprob_all[e] : 0.0f;
  float S = 0.0f, dot = 0.0f;
  if (renormalize) {  // every lane the same sums, in slot order
    for (int64_t k = 0; k < K; ++k) S += p[idx[n * K + k]];
    for (int64_t k = 0; k < K; ++k) dot += dw[k] * (p[idx[n * K + k]] / S);
  }
  for (int64_t k = 0; k < K; ++k) {
    const int64_t e = idx[n * K + k];
    if (e % kWarp != lane) continue;
    const float g = renormalize ? (dw[k] - dot) / S : dw[k];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (j == e / kWarp) dl[j] += g;
  }
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t e = lane + j * kWarp;
    if (e < E) s += p[e] * dl[j];
  }
  s = warp_sum(s);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t e = lane + j * kWarp;
    if (e < E) st<D>(dlogits, n * E + e, p[e] * (dl[j] - s));
  }
}

// ---- Offsets: counts per expert (one block each), then an exclusive prefix sum ----------------

// counts[e] (offsets + 1) = the pairs routed to expert e; block E counts indices outside
// [0, E) into *bad.
__global__ void moe_count_k(int64_t* offsets, int64_t* bad, ExpertIdx idx, int64_t NK, int64_t E) {
  const int64_t e = blockIdx.x;
  int64_t c = 0;
  for (int64_t i = threadIdx.x; i < NK; i += blockDim.x) {
    const int64_t x = idx[i];
    c += e < E ? (x == e) : (x < 0 || x >= E);
  }
  c = block_sum(c);
  if (threadIdx.x != 0) return;
  if (e < E) offsets[e + 1] = c;
  else *bad = c;
}
__global__ void moe_prefix_k(int64_t* offsets, int64_t E) {
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
}

// psum[e] = sum over tokens of probs[n, e], in double: one block per expert.
__global__ void moe_psum_k(double* psum, const float* probs, int64_t N, int64_t E) {
  const int64_t e = blockIdx.x;
  double s = 0.0;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) s += probs[n * E + e];
  s = block_sum(s);
  if (threadIdx.x == 0) psum[e] = s;
}

// ---- The expert-major walk ----------------------------------------------------------------------

// Calls f(n, k, row, j) for this block's expert's pairs, in (token, slot) order, kThreads pairs
// at a time: f runs once per found pair with j its rank within the chunk, on every thread of the
// block (so a row's C columns can be split over the threads); __syncthreads between chunks.
template <class F>
__device__ void walk_expert(ExpertIdx idx, int64_t NK, int64_t K, int64_t e, int64_t first_row,
                            F&& f) {
  __shared__ int32_t found[kThreads];
  __shared__ int warp_count[kWarpsPerBlock];
  const int lane = lane_id(), warp = static_cast<int>(threadIdx.x / kWarp);
  int64_t row = first_row;
  for (int64_t i0 = 0; i0 < NK; i0 += kThreads) {
    const int64_t i = i0 + threadIdx.x;
    const bool match = i < NK && idx[i] == e;
    const unsigned ballot = __ballot_sync(kFullMask, match);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    int offset = 0, total = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w) {
      offset += w < warp ? warp_count[w] : 0;
      total += warp_count[w];
    }
    if (match) found[offset + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int32_t>(threadIdx.x);
    __syncthreads();
    for (int j = 0; j < total; ++j) {
      const int64_t p = i0 + found[j];
      f(p / K, p % K, row + j, j);
    }
    row += total;
    __syncthreads();  // found and warp_count are the next chunk's
  }
}

// xe[row(n, k)] = in[n].
template <DType D>
__global__ void moe_dispatch_k(void* xe, const void* in, ExpertIdx idx, const int64_t* offsets,
                               int64_t NK, int64_t K, int64_t C) {
  const int64_t e = blockIdx.x;
  walk_expert(idx, NK, K, e, offsets[e], [&](int64_t n, int64_t, int64_t r, int) {
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) st<D>(xe, r * C + c, ld<D>(in, n * C + c));
  });
}

// din[n] += dxe[row(n, slot)] for the pairs of one slot.
template <DType D>
__global__ void moe_dispatch_backward_k(void* din, const void* dxe, ExpertIdx idx,
                                        const int64_t* offsets, int64_t NK, int64_t K, int64_t C,
                                        int64_t slot) {
  const int64_t e = blockIdx.x;
  walk_expert(idx, NK, K, e, offsets[e], [&](int64_t n, int64_t k, int64_t r, int) {
    if (k != slot) return;  // the same for every thread
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
      st<D>(din, n * C + c, ld<D>(din, n * C + c) + ld<D>(dxe, r * C + c));
  });
}

// The combine's first pass: the row of pair (n, k) as int32 number k of out's row n.
template <DType D>
__global__ void moe_rows_into_k(void* out, ExpertIdx idx, const int64_t* offsets, int64_t NK,
                                int64_t K, int64_t C) {
  const int64_t e = blockIdx.x;
  walk_expert(idx, NK, K, e, offsets[e], [&](int64_t n, int64_t k, int64_t r, int j) {
    if (static_cast<int>(threadIdx.x) == j % static_cast<int>(blockDim.x))
      reinterpret_cast<int32_t*>(static_cast<char*>(out) + n * C * bytes_of<D>())[k] =
          static_cast<int32_t>(r);
  });
}

// The second pass, one warp per token: out[n] = sum over k in slot order of w[n, k] ye[row],
// one store per element.
template <DType D>
__global__ void moe_combine_k(void* out, const void* ye, const float* weights, int64_t N, int64_t K,
                              int64_t C) {
  const int64_t n = warp_row();
  const int lane = lane_id();
  if (n >= N) return;
  int32_t rows[kMoeMaxTopK];
  const auto* parked = reinterpret_cast<const int32_t*>(static_cast<const char*>(out) +
                                                        n * C * bytes_of<D>());
  for (int64_t k = 0; k < K; ++k) rows[k] = parked[k];
  __syncwarp();  // every lane has read them before any lane writes the row
  for (int64_t c = lane; c < C; c += kWarp) {
    float acc = weights[n * K] * ld<D>(ye, rows[0] * C + c);
    for (int64_t k = 1; k < K; ++k) acc += weights[n * K + k] * ld<D>(ye, rows[k] * C + c);
    st<D>(out, n * C + c, acc);
  }
}

// dye[row(n, k)] = w[n, k] dout[n] (overwrites); dweights[n, k] = dout[n] . ye[row(n, k)].
template <DType D>
__global__ void moe_combine_backward_k(void* dye, float* dweights, const void* dout, const void* ye,
                                       const float* weights, ExpertIdx idx, const int64_t* offsets,
                                       int64_t NK, int64_t K, int64_t C) {
  const int64_t e = blockIdx.x;
  walk_expert(idx, NK, K, e, offsets[e], [&](int64_t n, int64_t k, int64_t r, int) {
    const float w = weights[n * K + k];
    float dot = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float g = ld<D>(dout, n * C + c);
      st<D>(dye, r * C + c, w * g);
      dot += g * ld<D>(ye, r * C + c);
    }
    dot = block_sum(dot);
    if (threadIdx.x == 0) dweights[n * K + k] = dot;
  });
}

void check_moe(int64_t N, int64_t E, int64_t K, const char* what) {
  if (N < 0 || E <= 0 || E > kMoeMaxExperts || K <= 0 || K > E || K > kMoeMaxTopK)
    throw Error(std::string("cuda ") + what + ": " + std::to_string(N) + " tokens, " +
                    std::to_string(E) + " experts, top " + std::to_string(K),
                "the GPU kernels take 1 to " + std::to_string(kMoeMaxExperts) +
                    " experts and a top-k of at most " + std::to_string(kMoeMaxTopK));
}

}  // namespace

// ---- launchers ---------------------------------------------------------------------------------

void moe_route_forward(cudaStream_t s, float* probs, ExpertIdx idx, float* weights,
                       const void* logits, DType t, int64_t N, int64_t E, int64_t K,
                       bool renormalize) {
  check_moe(N, E, K, "moe_route_forward");
  if (N == 0) return;
  check_rows(N, "moe_route_forward");
  ZP_TYPED(t, moe_route_forward_k<D><<<rows_blocks(N), kThreads, 0, s>>>(probs, idx, weights, logits, N, E, K, renormalize));
  ZP_LAUNCH_CHECK();
}

void moe_route_backward(cudaStream_t s, void* dlogits, DType t, const float* dweights,
                        const float* probs, ExpertIdx idx, const float* dprob_all, int64_t N,
                        int64_t E, int64_t K, bool renormalize) {
  check_moe(N, E, K, "moe_route_backward");
  if (N == 0) return;
  check_rows(N, "moe_route_backward");
  ZP_TYPED(t, moe_route_backward_k<D><<<rows_blocks(N), kThreads, 0, s>>>(dlogits, dweights, probs, idx, dprob_all, N, E, K, renormalize));
  ZP_LAUNCH_CHECK();
}

void moe_offsets(cudaStream_t s, int64_t* offsets, int64_t* bad, ExpertIdx idx, int64_t N,
                 int64_t K, int64_t E) {
  check_moe(N, E, K, "moe_offsets");
  moe_count_k<<<static_cast<unsigned>(E + 1), kThreads, 0, s>>>(offsets, bad, idx, N * K, E);
  ZP_LAUNCH_CHECK();
  moe_prefix_k<<<1, 1, 0, s>>>(offsets, E);
  ZP_LAUNCH_CHECK();
}

void moe_psum(cudaStream_t s, double* psum, const float* probs, int64_t N, int64_t E) {
  if (E <= 0) return;
  moe_psum_k<<<static_cast<unsigned>(E), kThreads, 0, s>>>(psum, probs, N, E);
  ZP_LAUNCH_CHECK();
}

void moe_dispatch(cudaStream_t s, void* xe, const void* in, ExpertIdx idx, const int64_t* offsets,
                  DType t, int64_t N, int64_t K, int64_t E, int64_t C) {
  check_moe(N, E, K, "moe_dispatch");
  if (N * C == 0) return;
  ZP_TYPED(t, moe_dispatch_k<D><<<static_cast<unsigned>(E), kThreads, 0, s>>>(xe, in, idx, offsets, N * K, K, C));
  ZP_LAUNCH_CHECK();
}

void moe_dispatch_backward(cudaStream_t s, void* din, const void* dxe, ExpertIdx idx,
                           const int64_t* offsets, DType t, int64_t N, int64_t K, int64_t E,
                           int64_t C) {
  check_moe(N, E, K, "moe_dispatch_backward");
  if (N * C == 0) return;
  for (int64_t slot = 0; slot < K; ++slot) {
    ZP_TYPED(t, moe_dispatch_backward_k<D><<<static_cast<unsigned>(E), kThreads, 0, s>>>(din, dxe, idx, offsets, N * K, K, C, slot));
    ZP_LAUNCH_CHECK();
  }
}

void moe_combine(cudaStream_t s, void* out, const void* ye, const float* weights, ExpertIdx idx,
                 const int64_t* offsets, DType t, int64_t N, int64_t K, int64_t E, int64_t C) {
  check_moe(N, E, K, "moe_combine");
  if (N * C == 0) return;
  if (C * static_cast<int64_t>(dtype_bytes(t)) < 4 * K)
    throw Error("cuda moe_combine: rows of " + std::to_string(C) + " cannot hold " +
                    std::to_string(K) + " row numbers",
                "the hidden size must be at least 2 K (16-bit) or K (fp32)");
  check_rows(N, "moe_combine");
  ZP_TYPED(t, moe_rows_into_k<D><<<static_cast<unsigned>(E), kThreads, 0, s>>>(out, idx, offsets, N * K, K, C));
  ZP_LAUNCH_CHECK();
  ZP_TYPED(t, moe_combine_k<D><<<rows_blocks(N), kThreads, 0, s>>>(out, ye, weights, N, K, C));
  ZP_LAUNCH_CHECK();
}

void moe_combine_backward(cudaStream_t s, void* dye, float* dweights, const void* dout,
                          const void* ye, const float* weights, ExpertIdx idx,
                          const int64_t* offsets, DType t, int64_t N, int64_t K, int64_t E,
                          int64_t C) {
  check_moe(N, E, K, "moe_combine_backward");
  if (N == 0) return;
  ZP_TYPED(t, moe_combine_backward_k<D><<<static_cast<unsigned>(E), kThreads, 0, s>>>(dye, dweights, dout, ye, weights, idx, offsets, N * K, K, C));
  ZP_LAUNCH_CHECK();
}

}  // namespace zp::runtime::cuda
