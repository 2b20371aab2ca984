// kernels.cu: the CUDA kernels of a GPT-2 step that are not GEMMs (embedding, LayerNorm,
// attention's softmax and its backward, GELU, residual, dropout, cross-entropy, 16-bit casts,
// sums, Adam and SGD), each with its host launcher. The step's kernels are templates over the
// storage type (fp32, fp16, bf16): they load as fp32, compute in fp32 and store each output
// element once, every output owned by one thread (no atomics but the bad-target flag's
// compare-and-swap; sums run in two passes of fixed order). Elementwise math comes from
// kernel_math.hpp, dtype.hpp and cpu_adam_kernels.hpp (the ZP_HD functions the CPU backend
// runs), and summation orders follow cpu_kernels.cpp wherever one thread owns a sum. Built with
// --fmad=false so that no multiply-add is fused behind the code's back (the CPU build fuses none
// either). The GEMMs, attention's products among them, are cuBLAS's (device_cuda.cpp);
// attention materialises its T x T scores (not flash).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "cuda_check.hpp"
#include "kernel_common.cuh"
#include "kernels.hpp"
#include "zp/error.hpp"
#include "zp/runtime/kernel_math.hpp"

namespace zp::runtime::cuda {

using namespace common;

namespace {

// ---- Embedding ------------------------------------------------------------------------------

template <DType D>
__global__ void embedding_forward_k(void* out, const int32_t* tokens, const void* wte,
                                    const void* wpe, int64_t T, int64_t C, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const int64_t bt = i / C, c = i % C;
    const float e = ld<D>(wte, static_cast<int64_t>(tokens[bt]) * C + c);
    st<D>(out, i, wpe ? e + ld<D>(wpe, (bt % T) * C + c) : e);
  }
}

// dwte, one block per position bt (blockDim.x == kThreads). A token may repeat: the first
// position holding it owns its row, summing dout over every position holding it in ascending
// order (cpu_kernels.cpp's order) and adding once; a later position of the same token leaves
// at once. The positions are found kThreads at a time and compacted, in order, into shared
// memory (warp ballots, then the warps' counts in warp order).
template <DType D>
__global__ void embedding_backward_wte_k(void* dwte, const void* dout, const int32_t* tokens,
                                         int64_t BT, int64_t C) {
  __shared__ int32_t found[kThreads];
  __shared__ int warp_count[kWarpsPerBlock];
  const int64_t bt = blockIdx.x;
  const int32_t tok = tokens[bt];
  int earlier = 0;
  for (int64_t j = threadIdx.x; j < bt; j += blockDim.x) earlier |= tokens[j] == tok ? 1 : 0;
  if (__syncthreads_or(earlier)) return;  // the whole block leaves together
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int64_t c0 = 0; c0 < C; c0 += blockDim.x) {
    const int64_t c = c0 + threadIdx.x;
    Acc<D> acc(dwte, c < C ? static_cast<int64_t>(tok) * C + c : 0);
    for (int64_t j0 = bt; j0 < BT; j0 += blockDim.x) {
      const int64_t j = j0 + threadIdx.x;
      const bool match = j < BT && tokens[j] == tok;
      const unsigned ballot = __ballot_sync(kFullMask, match);
      if (lane == 0) warp_count[warp] = __popc(ballot);
      __syncthreads();
      int offset = 0, total = 0;
      for (int w = 0; w < kWarpsPerBlock; ++w) {
        offset += w < warp ? warp_count[w] : 0;
        total += warp_count[w];
      }
      if (match) found[offset + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int32_t>(j - j0);
      __syncthreads();
      if (c < C)
        for (int k = 0; k < total; ++k) acc.add(ld<D>(dout, (j0 + found[k]) * C + c));
      __syncthreads();  // found and warp_count are the next chunk's
    }
    if (c < C) acc.store(dwte, static_cast<int64_t>(tok) * C + c);
  }
}

// dwpe[t, c] += dout[b, t, c] over b in ascending order.
template <DType D>
__global__ void embedding_backward_wpe_k(void* dwpe, const void* dout, int64_t B, int64_t T,
                                         int64_t C) {
  for (int64_t i = global_index(); i < T * C; i += grid_stride()) {
    Acc<D> acc(dwpe, i);
    for (int64_t b = 0; b < B; ++b) acc.add(ld<D>(dout, b * T * C + i));
    acc.store(dwpe, i);
  }
}

// ---- LayerNorm: one warp per row -------------------------------------------------------------

template <DType D>
__global__ void layernorm_forward_k(void* out, float* stats, const void* inp, const void* w,
                                    const void* b, int64_t N, int64_t C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= N) return;  // whole warps leave together
  const int64_t x0 = row * C;
  float s = 0.0f;
  for (int64_t i = lane; i < C; i += kWarp) s += ld<D>(inp, x0 + i);
  const float mean = warp_sum(s) / static_cast<float>(C);
  float sq = 0.0f;
  for (int64_t i = lane; i < C; i += kWarp) {
    const float d = ld<D>(inp, x0 + i) - mean;
    sq += d * d;
  }
  // layernorm_row_stats' formula: rstd = 1 / sqrt(biased variance + eps), two passes.
  const float rstd = 1.0f / sqrtf(warp_sum(sq) / static_cast<float>(C) + kLayerNormEps);
  for (int64_t i = lane; i < C; i += kWarp)
    st<D>(out, x0 + i, layernorm_apply(ld<D>(inp, x0 + i), mean, rstd, ld<D>(w, i), ld<D>(b, i)));
  if (lane == 0) {
    stats[2 * row] = mean;
    stats[2 * row + 1] = rstd;
  }
}

template <DType D>
__global__ void layernorm_backward_dinp_k(void* dinp, const void* dout, const void* inp,
                                          const void* w, const float* stats, int64_t N, int64_t C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= N) return;
  const int64_t x0 = row * C;
  const float mean = stats[2 * row], rstd = stats[2 * row + 1];
  // layernorm_row_grad_means, reduced over the warp.
  float s1 = 0.0f, s2 = 0.0f;
  for (int64_t i = lane; i < C; i += kWarp) {
    const float gw = ld<D>(w, i) * ld<D>(dout, x0 + i);
    s1 += gw;
    s2 += gw * (ld<D>(inp, x0 + i) - mean) * rstd;
  }
  const float g_mean = warp_sum(s1) / static_cast<float>(C);
  const float gxhat_mean = warp_sum(s2) / static_cast<float>(C);
  for (int64_t i = lane; i < C; i += kWarp)
    st<D>(dinp, x0 + i,
          ld<D>(dinp, x0 + i) + layernorm_dinp(ld<D>(dout, x0 + i), ld<D>(inp, x0 + i), ld<D>(w, i),
                                               mean, rstd, g_mean, gxhat_mean));
}

// Column sums with one owner per column: a block owns kWarp columns (lane = column); its warps
// take rows warp, warp + kWarpsPerBlock, ...; the partial sums meet in shared memory and are
// added in warp order, and each column is written once. No atomics: deterministic, and one
// rounding of a 16-bit output. LayerNorm's weight gradients: dweight += sum_r dout xhat,
// dbias += sum_r dout; a linear layer's bias gradient: dbias += sum_r dout. Only ceil(C/32)
// blocks (24 for C = 768 on a 132-SM H100; review finding 12): 5.9 ms of a 562 ms profiled
// gpt2 step at B=8 (ncu, 2026-11-27), before attention's products moved to cuBLAS. Splitting
// the rows over a second grid dimension into fixed-order partials keeps the bits; not done yet
// for want of a GPU to measure it.
template <DType D, bool kLayerNorm>
__global__ void column_sums_k(void* dweight, void* dbias, const void* dout, const void* inp,
                              const float* stats, int64_t N, int64_t C) {
  __shared__ float pw[kWarpsPerBlock][kWarp], pb[kWarpsPerBlock][kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarp + lane;
  float dw = 0.0f, db = 0.0f;
  if (c < C)
    for (int64_t r = warp; r < N; r += kWarpsPerBlock) {
      const float g = ld<D>(dout, r * C + c);
      if (kLayerNorm) dw += g * (ld<D>(inp, r * C + c) - stats[2 * r]) * stats[2 * r + 1];
      db += g;
    }
  pw[warp][lane] = dw;
  pb[warp][lane] = db;
  __syncthreads();
  if (warp != 0 || c >= C) return;
  float sw = 0.0f, sb = 0.0f;
  for (int w = 0; w < kWarpsPerBlock; ++w) {
    sw += pw[w][lane];
    sb += pb[w][lane];
  }
  if (kLayerNorm) st<D>(dweight, c, ld<D>(dweight, c) + sw);
  st<D>(dbias, c, ld<D>(dbias, c) + sb);
}

// ---- Linear-layer helpers (the GEMMs are cuBLAS's) -------------------------------------------

// The output's and the bias's types are arguments: uniform across the grid, no divergence.
__global__ void broadcast_rows_k(void* out, DType out_t, const void* bias, DType t, int64_t OC,
                                 int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride())
    store_from_f32(out, static_cast<std::size_t>(i), out_t,
                   load_as_f32(bias, static_cast<std::size_t>(i % OC), t));
}

// ---- Attention: the softmax steps (the products are cuBLAS's, device_cuda.cpp) -------------
// preatt/att (B,NH,T,T) rows hold keys 0..t: softmax reads only those and writes zeros above
// the diagonal, as its backward does; one warp per row.


// One warp per row r of (B*NH*T): softmax over keys lo..t, zeros elsewhere (lo = first_key(t):
// 0, or t - window + 1 with a sliding window). softmax_row's arithmetic, each output stored
// once: expf(x - max) is summed, then written times 1 / sum.
template <DType D>
__global__ void attention_softmax_k(void* att, const void* preatt, int64_t n_rows, int64_t T,
                                    int64_t window) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= n_rows) return;
  const int64_t t = r % T, row = r * T, lo = first_key(t, window);
  float maxv = -INFINITY;
  for (int64_t i = lo + lane; i <= t; i += kWarp) maxv = fmaxf(maxv, ld<D>(preatt, row + i));
  maxv = warp_max(maxv);
  float sum = 0.0f;
  for (int64_t i = lo + lane; i <= t; i += kWarp) sum += expf(ld<D>(preatt, row + i) - maxv);
  const float inv = 1.0f / warp_sum(sum);
  for (int64_t i = lo + lane; i <= t; i += kWarp) st<D>(att, row + i, expf(ld<D>(preatt, row + i) - maxv) * inv);
  for (int64_t i = lane; i < lo; i += kWarp) st<D>(att, row + i, 0.0f);
  for (int64_t i = t + 1 + lane; i < T; i += kWarp) st<D>(att, row + i, 0.0f);
}

// One warp per row: dx = y (dy - sum y dy) on keys lo..t, zeros elsewhere. In place allowed:
// the dot is complete (warp_sum) before any write, and each lane writes only what it read.
template <DType D>
__global__ void attention_softmax_backward_k(void* dpreatt, const void* datt, const void* att,
                                             int64_t n_rows, int64_t T, int64_t window) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= n_rows) return;
  const int64_t t = r % T, row = r * T, lo = first_key(t, window);
  float dot = 0.0f;
  for (int64_t i = lo + lane; i <= t; i += kWarp) dot += ld<D>(att, row + i) * ld<D>(datt, row + i);
  dot = warp_sum(dot);
  for (int64_t i = lo + lane; i <= t; i += kWarp)
    st<D>(dpreatt, row + i, ld<D>(att, row + i) * (ld<D>(datt, row + i) - dot));
  for (int64_t i = lane; i < lo; i += kWarp) st<D>(dpreatt, row + i, 0.0f);
  for (int64_t i = t + 1 + lane; i < T; i += kWarp) st<D>(dpreatt, row + i, 0.0f);
}

// ---- GELU, residual, dropout -----------------------------------------------------------------

template <DType D>
__global__ void gelu_forward_k(void* out, const void* inp, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) st<D>(out, i, gelu(ld<D>(inp, i)));
}
template <DType D>
__global__ void gelu_backward_k(void* dinp, const void* inp, const void* dout, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride())
    st<D>(dinp, i, ld<D>(dout, i) * gelu_grad(ld<D>(inp, i)));
}
template <DType D>
__global__ void residual_forward_k(void* out, const void* a, const void* b, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) st<D>(out, i, ld<D>(a, i) + ld<D>(b, i));
}

template <DType D>
__global__ void dropout_forward_k(void* out, uint8_t* mask, const void* inp, float p, uint64_t key,
                                  int64_t n) {
  const uint32_t threshold = dropout_threshold(p);
  const float scale = dropout_scale(p);
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const bool keep = dropout_keep(key, i, threshold);
    mask[i] = keep ? 1 : 0;
    st<D>(out, i, keep ? ld<D>(inp, i) * scale : 0.0f);
  }
}
template <DType D>
__global__ void dropout_backward_k(void* dinp, const void* dout, const uint8_t* mask, float p,
                                   int64_t n) {
  const float scale = dropout_scale(p);
  for (int64_t i = global_index(); i < n; i += grid_stride())
    st<D>(dinp, i, mask[i] != 0 ? ld<D>(dout, i) * scale : 0.0f);
}

// ---- Cross-entropy ---------------------------------------------------------------------------

__device__ void flag_bad_target(int64_t* bad_target, int64_t row) {
  atomicCAS(reinterpret_cast<unsigned long long*>(bad_target), 0ULL,
            static_cast<unsigned long long>(row + 1));
}

// One block per row of fp32 logits: probabilities in place, loss = logsumexp - logit[target].
__global__ void crossentropy_forward_k(float* logits, float* losses, const int32_t* targets,
                                       int64_t V, int64_t* bad_target) {
  const int64_t r = blockIdx.x;
  float* row = logits + r * V;
  const int32_t tgt = targets[r];
  if (tgt < 0 || tgt >= V) {
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) row[i] = NAN;
    if (threadIdx.x == 0) {
      losses[r] = NAN;
      flag_bad_target(bad_target, r);
    }
    return;
  }
  const float target_logit = row[tgt];  // every thread reads it before block_max's barrier
  float maxv = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) maxv = fmaxf(maxv, row[i]);
  maxv = block_max(maxv);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float e = expf(row[i] - maxv);
    row[i] = e;
    sum += e;
  }
  sum = block_sum(sum);
  const float inv = 1.0f / sum;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) row[i] *= inv;
  if (threadIdx.x == 0) losses[r] = maxv + logf(sum) - target_logit;
}

// dlogits (D) = (probs - onehot) * dloss; in place when D is fp32 and dlogits == probs (each
// thread reads its element before writing it).
template <DType D>
__global__ void crossentropy_backward_k(void* dlogits, const float* probs, const int32_t* targets,
                                        float dloss, int64_t V, int64_t n, int64_t* bad_target) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const int64_t r = i / V, k = i % V;
    const int32_t tgt = targets[r];
    if (tgt < 0 || tgt >= V) {
      st<D>(dlogits, i, NAN);
      if (k == 0) flag_bad_target(bad_target, r);
      continue;
    }
    st<D>(dlogits, i, (k == tgt ? probs[i] - 1.0f : probs[i]) * dloss);
  }
}

// ---- 16-bit storage, sums, optimizers --------------------------------------------------------
// The storage type is a kernel argument: uniform across the grid, so the switch inside
// load_as_f32 / store_from_f32 never diverges, and one kernel serves all three types.

__global__ void to_f32_k(float* dst, const void* src, DType t, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride())
    dst[i] = load_as_f32(src, static_cast<std::size_t>(i), t);
}
__global__ void accumulate_to_k(void* dst, const float* src, DType t, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride())
    accumulate_as(dst, static_cast<std::size_t>(i), t, src[i]);
}
__global__ void add_k(void* dst, const void* src, DType t, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const auto k = static_cast<std::size_t>(i);
    store_from_f32(dst, k, t, load_as_f32(dst, k, t) + load_as_f32(src, k, t));
  }
}

// dst (fp32) += src as fp32; dst may be pinned host memory (mapped into the device's address
// space under unified addressing), so an offloaded gradient partition is written over PCIe:
// each element read and written back across the link (review finding 10). A copy of the
// 16-bit segment to pinned staging and an add on the host would move a third of the bytes;
// kept until a GPU run measures the offloaded step (1 rank: 163-171 ms for gpt2 at B=1).
__global__ void add_f32_k(float* dst, const void* src, DType t, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride())
    dst[i] += load_as_f32(src, static_cast<std::size_t>(i), t);
}

// Sums in two passes, the same bits on every run: each of at most kSumBlocks blocks adds its
// grid-stride share and writes one partial (a fixed tree: warp shuffles, then the warps in
// order), then one block adds the partials in index order and writes *out. The grid depends
// only on n, so no order depends on which block finishes first (atomics would).
__global__ void sum_partials_k(double* partials, const float* p, int64_t n) {
  double acc = 0.0;
  for (int64_t i = global_index(); i < n; i += grid_stride()) acc += p[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}
// Squares of values read as type t (x^2 of an fp32 is exact in double).
__global__ void sum_squares_partials_k(double* partials, const void* p, DType t, int64_t n) {
  double acc = 0.0;
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const double x = load_as_f32(p, static_cast<std::size_t>(i), t);
    acc += x * x;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}
// accumulate: *out += the sum (one double addition, in stream order), else *out = the sum.
__global__ void sum_finish_k(double* out, const double* partials, int n_partials, bool accumulate) {
  double acc = 0.0;
  for (int i = static_cast<int>(threadIdx.x); i < n_partials; i += static_cast<int>(blockDim.x))
    acc += partials[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = accumulate ? *out + acc : acc;
}

__global__ void adam_k(detail::AdamCoeffs c, AdamTensors ts) {
  for (int64_t s = global_index(); s < static_cast<int64_t>(ts.n); s += grid_stride()) {
    const auto i = static_cast<std::size_t>(s);
    float p = ts.master[i];
    float m = load_as_f32(ts.exp_avg, i, ts.moment_dtype);
    float v = load_as_f32(ts.exp_avg_sq, i, ts.moment_dtype);
    detail::adam_element(c, load_as_f32(ts.grads, i, ts.grad_dtype), p, m, v);
    ts.master[i] = p;
    store_from_f32(ts.exp_avg, i, ts.moment_dtype, m);
    store_from_f32(ts.exp_avg_sq, i, ts.moment_dtype, v);
    if (ts.param_out != nullptr) store_from_f32(ts.param_out, i, ts.param_out_dtype, p);
  }
}

__global__ void sgd_k(float* master, float* momentum_buf, const void* grads, DType grad_dtype,
                      void* param_out, DType param_dtype, float lr, float momentum,
                      float weight_decay, float grad_scale, int64_t n) {
  for (int64_t s = global_index(); s < n; s += grid_stride()) {
    const auto i = static_cast<std::size_t>(s);
    float w = master[i], buf = momentum_buf[i];
    sgd_element(load_as_f32(grads, i, grad_dtype), grad_scale, lr, momentum, weight_decay, w, buf);
    momentum_buf[i] = buf;
    master[i] = w;
    if (param_out != nullptr) store_from_f32(param_out, i, param_dtype, w);
  }
}


}  // namespace

// ---- launchers ---------------------------------------------------------------------------------


void embedding_forward(cudaStream_t s, void* out, const int32_t* tokens, const void* wte,
                       const void* wpe, DType t, int64_t B, int64_t T, int64_t C) {
  const int64_t n = B * T * C;
  if (n == 0) return;
  ZP_TYPED(t, embedding_forward_k<D><<<blocks_for(n), kThreads, 0, s>>>(out, tokens, wte, wpe, T, C, n));
  ZP_LAUNCH_CHECK();
}

void embedding_backward(cudaStream_t s, void* dwte, void* dwpe, const void* dout,
                        const int32_t* tokens, DType t, int64_t B, int64_t T, int64_t C) {
  const int64_t BT = B * T;
  if (BT * C == 0) return;
  if (BT > INT32_MAX)
    throw Error("cuda embedding_backward: " + std::to_string(BT) + " tokens exceed one launch",
                "use fewer tokens per micro-batch");
  ZP_TYPED(t, embedding_backward_wte_k<D><<<static_cast<unsigned>(BT), kThreads, 0, s>>>(dwte, dout, tokens, BT, C));
  ZP_LAUNCH_CHECK();
  if (!dwpe) return;
  ZP_TYPED(t, embedding_backward_wpe_k<D><<<blocks_for(T * C), kThreads, 0, s>>>(dwpe, dout, B, T, C));
  ZP_LAUNCH_CHECK();
}

void layernorm_forward(cudaStream_t s, void* out, float* stats, const void* inp,
                       const void* weight, const void* bias, DType t, int64_t N, int64_t C) {
  if (N == 0) return;
  check_rows(N, "layernorm_forward");
  ZP_TYPED(t, layernorm_forward_k<D><<<rows_blocks(N), kThreads, 0, s>>>(out, stats, inp, weight, bias, N, C));
  ZP_LAUNCH_CHECK();
}

void layernorm_backward(cudaStream_t s, void* dinp, void* dweight, void* dbias,
                        const void* dout, const void* inp, const void* weight,
                        const float* stats, DType t, int64_t N, int64_t C) {
  if (N == 0) return;
  check_rows(N, "layernorm_backward");
  ZP_TYPED(t, layernorm_backward_dinp_k<D><<<rows_blocks(N), kThreads, 0, s>>>(dinp, dout, inp, weight, stats, N, C));
  ZP_LAUNCH_CHECK();
  ZP_TYPED(t, column_sums_k<D, true><<<blocks_for(C, kWarp), kThreads, 0, s>>>(dweight, dbias, dout, inp, stats, N, C));
  ZP_LAUNCH_CHECK();
}

void broadcast_rows(cudaStream_t s, void* out, DType out_t, const void* bias, DType t, int64_t N,
                    int64_t OC) {
  if (N * OC == 0) return;
  broadcast_rows_k<<<blocks_for(N * OC), kThreads, 0, s>>>(out, out_t, bias, t, OC, N * OC);
  ZP_LAUNCH_CHECK();
}

void column_sums_add(cudaStream_t s, void* dbias, const void* dout, DType t, int64_t N, int64_t OC) {
  if (N * OC == 0) return;
  ZP_TYPED(t, column_sums_k<D, false><<<blocks_for(OC, kWarp), kThreads, 0, s>>>(nullptr, dbias, dout, nullptr, nullptr, N, OC));
  ZP_LAUNCH_CHECK();
}


void attention_softmax(cudaStream_t s, void* att, const void* preatt, DType t, int64_t B,
                       int64_t NH, int64_t T, int64_t window) {
  const int64_t rows = B * NH * T;
  if (rows == 0) return;
  check_rows(rows, "attention_softmax");
  ZP_TYPED(t, attention_softmax_k<D><<<rows_blocks(rows), kThreads, 0, s>>>(att, preatt, rows, T, window));
  ZP_LAUNCH_CHECK();
}



void attention_softmax_backward(cudaStream_t s, void* dpreatt, const void* datt,
                                const void* att, DType t, int64_t B, int64_t NH, int64_t T,
                                int64_t window) {
  const int64_t rows = B * NH * T;
  if (rows == 0) return;
  check_rows(rows, "attention_softmax_backward");
  ZP_TYPED(t, attention_softmax_backward_k<D><<<rows_blocks(rows), kThreads, 0, s>>>(dpreatt, datt, att, rows, T, window));
  ZP_LAUNCH_CHECK();
}


void gelu_forward(cudaStream_t s, void* out, const void* inp, DType t, int64_t n) {
  if (n == 0) return;
  ZP_TYPED(t, gelu_forward_k<D><<<blocks_for(n), kThreads, 0, s>>>(out, inp, n));
  ZP_LAUNCH_CHECK();
}

void gelu_backward(cudaStream_t s, void* dinp, const void* inp, const void* dout, DType t,
                   int64_t n) {
  if (n == 0) return;
  ZP_TYPED(t, gelu_backward_k<D><<<blocks_for(n), kThreads, 0, s>>>(dinp, inp, dout, n));
  ZP_LAUNCH_CHECK();
}

void residual_forward(cudaStream_t s, void* out, const void* a, const void* b, DType t, int64_t n) {
  if (n == 0) return;
  ZP_TYPED(t, residual_forward_k<D><<<blocks_for(n), kThreads, 0, s>>>(out, a, b, n));
  ZP_LAUNCH_CHECK();
}

namespace {
void check_dropout_p(float p, const char* what) {
  if (!(p >= 0.0f && p < 1.0f))
    throw Error(std::string("cuda ") + what + ": dropout probability " + std::to_string(p) +
                    " is outside [0, 1)",
                "a model's *_pdrop values must be below 1");
}
}  // namespace

void dropout_forward(cudaStream_t s, void* out, uint8_t* mask, const void* inp, DType t, float p,
                     uint64_t key, int64_t n) {
  check_dropout_p(p, "dropout_forward");
  if (n == 0) return;
  ZP_TYPED(t, dropout_forward_k<D><<<blocks_for(n), kThreads, 0, s>>>(out, mask, inp, p, key, n));
  ZP_LAUNCH_CHECK();
}

void dropout_backward(cudaStream_t s, void* dinp, const void* dout, const uint8_t* mask, DType t,
                      float p, int64_t n) {
  check_dropout_p(p, "dropout_backward");
  if (n == 0) return;
  ZP_TYPED(t, dropout_backward_k<D><<<blocks_for(n), kThreads, 0, s>>>(dinp, dout, mask, p, n));
  ZP_LAUNCH_CHECK();
}

void crossentropy_forward(cudaStream_t s, float* logits, float* losses, const int32_t* targets,
                          int64_t N, int64_t V, int64_t* bad_target) {
  if (N == 0) return;
  if (N > INT32_MAX)
    throw Error("cuda crossentropy_forward: " + std::to_string(N) + " rows exceed one launch",
                "use fewer tokens per micro-batch");
  crossentropy_forward_k<<<static_cast<unsigned>(N), kThreads, 0, s>>>(logits, losses, targets, V, bad_target);
  ZP_LAUNCH_CHECK();
}

void crossentropy_backward(cudaStream_t s, void* dlogits, DType t, const float* probs,
                           const int32_t* targets, float dloss, int64_t N, int64_t V,
                           int64_t* bad_target) {
  if (N * V == 0) return;
  ZP_TYPED(t, crossentropy_backward_k<D><<<blocks_for(N * V), kThreads, 0, s>>>(dlogits, probs, targets, dloss, V, N * V, bad_target));
  ZP_LAUNCH_CHECK();
}

#undef ZP_TYPED

void to_f32(cudaStream_t s, float* dst, const void* src, DType t, int64_t n) {
  if (n == 0) return;
  to_f32_k<<<blocks_for(n), kThreads, 0, s>>>(dst, src, t, n);
  ZP_LAUNCH_CHECK();
}

void accumulate_to(cudaStream_t s, void* dst, const float* src, DType t, int64_t n) {
  if (n == 0) return;
  accumulate_to_k<<<blocks_for(n), kThreads, 0, s>>>(dst, src, t, n);
  ZP_LAUNCH_CHECK();
}

void add(cudaStream_t s, void* dst, const void* src, DType t, int64_t n) {
  if (n == 0) return;
  add_k<<<blocks_for(n), kThreads, 0, s>>>(dst, src, t, n);
  ZP_LAUNCH_CHECK();
}

void add_f32(cudaStream_t s, float* dst, const void* src, DType t, int64_t n) {
  if (n == 0) return;
  add_f32_k<<<blocks_for(n), kThreads, 0, s>>>(dst, src, t, n);
  ZP_LAUNCH_CHECK();
}

void sum(cudaStream_t s, double* out, double* partials, const float* p, int64_t n, bool accumulate) {
  const unsigned blocks = std::min<unsigned>(blocks_for(n), kSumBlocks);
  if (n > 0) {
    sum_partials_k<<<blocks, kThreads, 0, s>>>(partials, p, n);
    ZP_LAUNCH_CHECK();
  }
  sum_finish_k<<<1, kThreads, 0, s>>>(out, partials, n > 0 ? static_cast<int>(blocks) : 0, accumulate);
  ZP_LAUNCH_CHECK();
}

void sum_squares(cudaStream_t s, double* out, double* partials, const void* p, DType t, uint64_t n) {
  const auto m = static_cast<int64_t>(n);
  const unsigned blocks = std::min<unsigned>(blocks_for(m), kSumBlocks);
  if (m > 0) {
    sum_squares_partials_k<<<blocks, kThreads, 0, s>>>(partials, p, t, m);
    ZP_LAUNCH_CHECK();
  }
  sum_finish_k<<<1, kThreads, 0, s>>>(out, partials, m > 0 ? static_cast<int>(blocks) : 0, false);
  ZP_LAUNCH_CHECK();
}

void adam_step(cudaStream_t s, const detail::AdamCoeffs& c, const AdamTensors& ts) {
  if (ts.n == 0) return;
  adam_k<<<blocks_for(static_cast<int64_t>(ts.n)), kThreads, 0, s>>>(c, ts);
  ZP_LAUNCH_CHECK();
}

void sgd_step(cudaStream_t s, float* master, float* momentum_buf, const void* grads,
              DType grad_dtype, void* param_out, DType param_dtype, float lr, float momentum,
              float weight_decay, float grad_scale, uint64_t n) {
  if (n == 0) return;
  const auto m = static_cast<int64_t>(n);
  sgd_k<<<blocks_for(m), kThreads, 0, s>>>(master, momentum_buf, grads, grad_dtype, param_out,
                                           param_dtype, lr, momentum, weight_decay, grad_scale, m);
  ZP_LAUNCH_CHECK();
}

}  // namespace zp::runtime::cuda
