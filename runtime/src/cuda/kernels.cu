// kernels.cu: the CUDA kernels of a GPT-2 step that are not GEMMs (embedding, LayerNorm,
// attention in three masked steps, GELU, residual, cross-entropy, 16-bit casts, sums, Adam and
// SGD), each with its host launcher. Elementwise math comes from kernel_math.hpp, dtype.hpp and
// cpu_adam_kernels.hpp (the ZP_HD functions the CPU backend runs), and summation orders follow
// cpu_kernels.cpp wherever one thread owns a sum. Built with --fmad=false so that no multiply-add
// is fused behind the code's back (the CPU build fuses none either). Not tuned: attention is
// direct loops, not tiled or flash; the GEMMs are cuBLAS's (device_cuda.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "cuda_check.hpp"
#include "kernels.hpp"
#include "zp/error.hpp"
#include "zp/runtime/kernel_math.hpp"

namespace zp::runtime::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr unsigned kFullMask = 0xffffffffu;
// Column sums split the rows into chunks of this many, one block row each, added atomically.
constexpr int64_t kRowsPerChunk = 256;

// Blocks for n independent items, one per thread; grid-stride loops cover the rest beyond
// the cap (the x dimension allows 2^31 - 1 blocks; 2^20 keeps every loop index in int64).
unsigned blocks_for(int64_t n, int64_t per_block = kThreads) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + per_block - 1) / per_block, 1, int64_t{1} << 20));
}

#define ZP_LAUNCH_CHECK() ZP_CUDA_CHECK(cudaGetLastError())

__device__ int64_t global_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

template <typename F>
__device__ F warp_sum(F v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
template <typename F>
__device__ F block_sum(F v) {
  __shared__ F partial[kWarp];
  v = warp_sum(v);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  __syncthreads();  // a previous call's readers are done with `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / kWarp) ? partial[lane] : F(0);
  return warp_sum(v);
}
__device__ float block_max(float v) {
  __shared__ float partial[kWarp];
  v = warp_max(v);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / kWarp) ? partial[lane] : -INFINITY;
  return warp_max(v);
}

// ---- Embedding ------------------------------------------------------------------------------

__global__ void embedding_forward_k(float* out, const int32_t* tokens, const float* wte,
                                    const float* wpe, int64_t T, int64_t C, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const int64_t bt = i / C, c = i % C;
    const float e = wte[static_cast<int64_t>(tokens[bt]) * C + c];
    out[i] = wpe ? e + wpe[(bt % T) * C + c] : e;
  }
}

// dwte rows repeat with repeated tokens: atomic adds.
__global__ void embedding_backward_wte_k(float* dwte, const float* dout, const int32_t* tokens,
                                         int64_t C, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride())
    atomicAdd(dwte + static_cast<int64_t>(tokens[i / C]) * C + i % C, dout[i]);
}

// dwpe[t, c] += dout[b, t, c] over b in order, as the CPU loop.
__global__ void embedding_backward_wpe_k(float* dwpe, const float* dout, int64_t B, int64_t T,
                                         int64_t C) {
  for (int64_t i = global_index(); i < T * C; i += grid_stride()) {
    float acc = dwpe[i];
    for (int64_t b = 0; b < B; ++b) acc += dout[b * T * C + i];
    dwpe[i] = acc;
  }
}

// ---- LayerNorm: one warp per row -------------------------------------------------------------

__global__ void layernorm_forward_k(float* out, float* stats, const float* inp, const float* w,
                                    const float* b, int64_t N, int64_t C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= N) return;  // whole warps leave together
  const float* x = inp + row * C;
  float s = 0.0f;
  for (int64_t i = lane; i < C; i += kWarp) s += x[i];
  const float mean = warp_sum(s) / static_cast<float>(C);
  float sq = 0.0f;
  for (int64_t i = lane; i < C; i += kWarp) {
    const float d = x[i] - mean;
    sq += d * d;
  }
  // layernorm_row_stats' formula: rstd = 1 / sqrt(biased variance + eps), two passes.
  const float rstd = 1.0f / sqrtf(warp_sum(sq) / static_cast<float>(C) + kLayerNormEps);
  for (int64_t i = lane; i < C; i += kWarp) out[row * C + i] = layernorm_apply(x[i], mean, rstd, w[i], b[i]);
  if (lane == 0) {
    stats[2 * row] = mean;
    stats[2 * row + 1] = rstd;
  }
}

__global__ void layernorm_backward_dinp_k(float* dinp, const float* dout, const float* inp,
                                          const float* w, const float* stats, int64_t N, int64_t C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= N) return;
  const float* g = dout + row * C;
  const float* x = inp + row * C;
  const float mean = stats[2 * row], rstd = stats[2 * row + 1];
  // layernorm_row_grad_means, reduced over the warp.
  float s1 = 0.0f, s2 = 0.0f;
  for (int64_t i = lane; i < C; i += kWarp) {
    const float gw = w[i] * g[i];
    s1 += gw;
    s2 += gw * (x[i] - mean) * rstd;
  }
  const float g_mean = warp_sum(s1) / static_cast<float>(C);
  const float gxhat_mean = warp_sum(s2) / static_cast<float>(C);
  for (int64_t i = lane; i < C; i += kWarp)
    dinp[row * C + i] += layernorm_dinp(g[i], x[i], w[i], mean, rstd, g_mean, gxhat_mean);
}

// dweight += sum_r dout * xhat, dbias += sum_r dout: one thread per channel and row chunk.
__global__ void layernorm_backward_params_k(float* dweight, float* dbias, const float* dout,
                                            const float* inp, const float* stats, int64_t N,
                                            int64_t C) {
  const int64_t c = global_index();
  if (c >= C) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowsPerChunk;
  const int64_t r1 = r0 + kRowsPerChunk < N ? r0 + kRowsPerChunk : N;
  float dw = 0.0f, db = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float g = dout[r * C + c];
    dw += g * (inp[r * C + c] - stats[2 * r]) * stats[2 * r + 1];
    db += g;
  }
  atomicAdd(dweight + c, dw);
  atomicAdd(dbias + c, db);
}

// ---- Linear-layer helpers (the GEMMs are cuBLAS's) -------------------------------------------

__global__ void broadcast_rows_k(float* out, const float* bias, int64_t OC, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) out[i] = bias[i % OC];
}

__global__ void column_sums_add_k(float* dbias, const float* dout, int64_t N, int64_t OC) {
  const int64_t o = global_index();
  if (o >= OC) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowsPerChunk;
  const int64_t r1 = r0 + kRowsPerChunk < N ? r0 + kRowsPerChunk : N;
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r) s += dout[r * OC + o];
  atomicAdd(dbias + o, s);
}

// ---- Attention -------------------------------------------------------------------------------
// As cpu_kernels.cpp: qkv row of token (b,t) holds q, k, v at [0,C), [C,2C), [2C,3C), head h
// at [h*HS, (h+1)*HS) of each; preatt/att (B,NH,T,T) rows hold keys 0..t; entries above the
// diagonal are never read. One thread per output element; where a thread owns a sum it adds
// in the CPU loop's order.

struct AttnDims {
  int64_t B, T, C, NH, HS;
};

// preatt[b,h,t,t2] = q[b,t,h] . k[b,t2,h] * scale for t2 <= t.
__global__ void attention_scores_k(float* preatt, const float* qkv, AttnDims d, float scale) {
  const int64_t n = d.B * d.NH * d.T * d.T;
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const int64_t t2 = i % d.T, t = i / d.T % d.T, h = i / (d.T * d.T) % d.NH, b = i / (d.T * d.T * d.NH);
    if (t2 > t) continue;
    const float* q = qkv + (b * d.T + t) * 3 * d.C + h * d.HS;
    const float* k = qkv + (b * d.T + t2) * 3 * d.C + d.C + h * d.HS;
    float s = 0.0f;
    for (int64_t j = 0; j < d.HS; ++j) s += q[j] * k[j];
    preatt[i] = s * scale;
  }
}

// One warp per row r of (B*NH*T): softmax over keys 0..t, zeros above.
__global__ void attention_softmax_k(float* att, const float* preatt, int64_t n_rows, int64_t T) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= n_rows) return;
  const int64_t t = r % T;
  const float* in = preatt + r * T;
  float* out = att + r * T;
  float maxv = -INFINITY;
  for (int64_t i = lane; i <= t; i += kWarp) maxv = fmaxf(maxv, in[i]);
  maxv = warp_max(maxv);
  float sum = 0.0f;
  for (int64_t i = lane; i <= t; i += kWarp) {
    const float e = expf(in[i] - maxv);
    out[i] = e;
    sum += e;
  }
  const float inv = 1.0f / warp_sum(sum);
  for (int64_t i = lane; i <= t; i += kWarp) out[i] *= inv;
  for (int64_t i = t + 1 + lane; i < T; i += kWarp) out[i] = 0.0f;
}

// out[b,t,h*HS+j] = sum_{t2<=t} att[b,h,t,t2] v[b,t2,h*HS+j].
__global__ void attention_values_k(float* out, const float* att, const float* qkv, AttnDims d) {
  const int64_t n = d.B * d.T * d.C;
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const int64_t c = i % d.C, bt = i / d.C, t = bt % d.T, b = bt / d.T, h = c / d.HS;
    const float* a = att + ((b * d.NH + h) * d.T + t) * d.T;
    const float* v = qkv + b * d.T * 3 * d.C + 2 * d.C + c;
    float s = 0.0f;
    for (int64_t t2 = 0; t2 <= t; ++t2) s += a[t2] * v[t2 * 3 * d.C];
    out[i] = s;
  }
}

// datt[b,h,t,t2] += dout[b,t,h] . v[b,t2,h] for t2 <= t.
__global__ void attention_values_backward_datt_k(float* datt, const float* dout, const float* qkv,
                                                 AttnDims d) {
  const int64_t n = d.B * d.NH * d.T * d.T;
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const int64_t t2 = i % d.T, t = i / d.T % d.T, h = i / (d.T * d.T) % d.NH, b = i / (d.T * d.T * d.NH);
    if (t2 > t) continue;
    const float* g = dout + (b * d.T + t) * d.C + h * d.HS;
    const float* v = qkv + (b * d.T + t2) * 3 * d.C + 2 * d.C + h * d.HS;
    float s = 0.0f;
    for (int64_t j = 0; j < d.HS; ++j) s += g[j] * v[j];
    datt[i] += s;
  }
}

// dv[b,t2,h*HS+j] += sum_{t>=t2} att[b,h,t,t2] dout[b,t,h*HS+j], t ascending as the CPU loop.
__global__ void attention_values_backward_dv_k(float* dqkv, const float* dout, const float* att,
                                               AttnDims d) {
  const int64_t n = d.B * d.T * d.C;
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const int64_t c = i % d.C, bt = i / d.C, t2 = bt % d.T, b = bt / d.T, h = c / d.HS;
    float* dv = dqkv + bt * 3 * d.C + 2 * d.C + c;
    float s = *dv;
    for (int64_t t = t2; t < d.T; ++t)
      s += att[((b * d.NH + h) * d.T + t) * d.T + t2] * dout[(b * d.T + t) * d.C + c];
    *dv = s;
  }
}

// One warp per row: dx = y (dy - sum y dy) on keys 0..t, zeros above. In place allowed: the
// dot is complete (warp_sum) before any write.
__global__ void attention_softmax_backward_k(float* dpreatt, const float* datt, const float* att,
                                             int64_t n_rows, int64_t T) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= n_rows) return;
  const int64_t t = r % T;
  const float* dy = datt + r * T;
  const float* y = att + r * T;
  float* dx = dpreatt + r * T;
  float dot = 0.0f;
  for (int64_t i = lane; i <= t; i += kWarp) dot += y[i] * dy[i];
  dot = warp_sum(dot);
  for (int64_t i = lane; i <= t; i += kWarp) dx[i] = y[i] * (dy[i] - dot);
  for (int64_t i = t + 1 + lane; i < T; i += kWarp) dx[i] = 0.0f;
}

// dq[t] += sum_{t2<=t} g[t,t2] k[t2] and dk[t2] += sum_{t>=t2} g[t,t2] q[t], g = dpreatt*scale:
// threads [0, B*T*C) own a q element, [B*T*C, 2*B*T*C) a k element.
__global__ void attention_scores_backward_k(float* dqkv, const float* dpreatt, const float* qkv,
                                            AttnDims d, float scale) {
  const int64_t half = d.B * d.T * d.C;
  for (int64_t i = global_index(); i < 2 * half; i += grid_stride()) {
    const bool is_k = i >= half;
    const int64_t e = is_k ? i - half : i;
    const int64_t c = e % d.C, bt = e / d.C, t0 = bt % d.T, b = bt / d.T, h = c / d.HS;
    const float* row0 = dpreatt + (b * d.NH + h) * d.T * d.T;
    const float* base = qkv + b * d.T * 3 * d.C + c;  // q of token 0; k is + C
    float* out = dqkv + bt * 3 * d.C + (is_k ? d.C : 0) + c;
    float s = *out;
    if (!is_k) {
      for (int64_t t2 = 0; t2 <= t0; ++t2) s += row0[t0 * d.T + t2] * scale * base[t2 * 3 * d.C + d.C];
    } else {
      for (int64_t t = t0; t < d.T; ++t) s += row0[t * d.T + t0] * scale * base[t * 3 * d.C];
    }
    *out = s;
  }
}

// ---- GELU, residual --------------------------------------------------------------------------

__global__ void gelu_forward_k(float* out, const float* inp, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) out[i] = gelu(inp[i]);
}
__global__ void gelu_backward_k(float* dinp, const float* inp, const float* dout, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) dinp[i] = dout[i] * gelu_grad(inp[i]);
}
__global__ void residual_forward_k(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) out[i] = a[i] + b[i];
}

// ---- Cross-entropy ---------------------------------------------------------------------------

__device__ void flag_bad_target(int64_t* bad_target, int64_t row) {
  atomicCAS(reinterpret_cast<unsigned long long*>(bad_target), 0ULL,
            static_cast<unsigned long long>(row + 1));
}

// One block per row: probabilities in place, loss = logsumexp - logit[target].
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

__global__ void crossentropy_backward_k(float* probs, const int32_t* targets, float dloss,
                                        int64_t V, int64_t n, int64_t* bad_target) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const int64_t r = i / V, k = i % V;
    const int32_t tgt = targets[r];
    if (tgt < 0 || tgt >= V) {
      probs[i] = NAN;
      if (k == 0) flag_bad_target(bad_target, r);
      continue;
    }
    probs[i] = (k == tgt ? probs[i] - 1.0f : probs[i]) * dloss;
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
// space under unified addressing), so an offloaded gradient partition is written over PCIe.
__global__ void add_f32_k(float* dst, const void* src, DType t, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride())
    dst[i] += load_as_f32(src, static_cast<std::size_t>(i), t);
}

// *out += sum of p (squares: of x^2, exact in double), per block then one atomic add.
__global__ void sum_k(double* out, const float* p, int64_t n) {
  double acc = 0.0;
  for (int64_t i = global_index(); i < n; i += grid_stride()) acc += p[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) atomicAdd(out, acc);
}
__global__ void sum_squares_k(double* out, const void* p, DType t, int64_t n) {
  double acc = 0.0;
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const double x = load_as_f32(p, static_cast<std::size_t>(i), t);
    acc += x * x;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) atomicAdd(out, acc);
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

AttnDims attn_dims(int64_t B, int64_t T, int64_t C, int64_t NH) {
  if (NH <= 0 || C % NH != 0)
    throw Error("cuda attention: C = " + std::to_string(C) + " is not a multiple of NH = " +
                    std::to_string(NH),
                "the model's n_embd must divide evenly into n_head heads");
  return {B, T, C, NH, C / NH};
}

unsigned rows_blocks(int64_t n_rows) { return blocks_for(n_rows, kWarpsPerBlock); }

// Rows per launch of the one-warp-per-row kernels: rows_blocks caps the grid at 2^20 blocks.
void check_rows(int64_t n_rows, const char* what) {
  if (n_rows > (int64_t{1} << 20) * kWarpsPerBlock)
    throw Error(std::string("cuda ") + what + ": " + std::to_string(n_rows) + " rows exceed one launch",
                "use fewer tokens per micro-batch");
}

}  // namespace

// ---- launchers ---------------------------------------------------------------------------------

void embedding_forward(cudaStream_t s, float* out, const int32_t* tokens, const float* wte,
                       const float* wpe, int64_t B, int64_t T, int64_t C) {
  const int64_t n = B * T * C;
  if (n == 0) return;
  embedding_forward_k<<<blocks_for(n), kThreads, 0, s>>>(out, tokens, wte, wpe, T, C, n);
  ZP_LAUNCH_CHECK();
}

void embedding_backward(cudaStream_t s, float* dwte, float* dwpe, const float* dout,
                        const int32_t* tokens, int64_t B, int64_t T, int64_t C) {
  const int64_t n = B * T * C;
  if (n == 0) return;
  embedding_backward_wte_k<<<blocks_for(n), kThreads, 0, s>>>(dwte, dout, tokens, C, n);
  ZP_LAUNCH_CHECK();
  if (!dwpe) return;
  embedding_backward_wpe_k<<<blocks_for(T * C), kThreads, 0, s>>>(dwpe, dout, B, T, C);
  ZP_LAUNCH_CHECK();
}

void layernorm_forward(cudaStream_t s, float* out, float* stats, const float* inp,
                       const float* weight, const float* bias, int64_t N, int64_t C) {
  if (N == 0) return;
  check_rows(N, "layernorm_forward");
  layernorm_forward_k<<<rows_blocks(N), kThreads, 0, s>>>(out, stats, inp, weight, bias, N, C);
  ZP_LAUNCH_CHECK();
}

void layernorm_backward(cudaStream_t s, float* dinp, float* dweight, float* dbias,
                        const float* dout, const float* inp, const float* weight,
                        const float* stats, int64_t N, int64_t C) {
  if (N == 0) return;
  check_rows(N, "layernorm_backward");
  layernorm_backward_dinp_k<<<rows_blocks(N), kThreads, 0, s>>>(dinp, dout, inp, weight, stats, N, C);
  ZP_LAUNCH_CHECK();
  const dim3 grid(blocks_for(C), static_cast<unsigned>((N + kRowsPerChunk - 1) / kRowsPerChunk));
  layernorm_backward_params_k<<<grid, kThreads, 0, s>>>(dweight, dbias, dout, inp, stats, N, C);
  ZP_LAUNCH_CHECK();
}

void broadcast_rows(cudaStream_t s, float* out, const float* bias, int64_t N, int64_t OC) {
  if (N * OC == 0) return;
  broadcast_rows_k<<<blocks_for(N * OC), kThreads, 0, s>>>(out, bias, OC, N * OC);
  ZP_LAUNCH_CHECK();
}

void column_sums_add(cudaStream_t s, float* dbias, const float* dout, int64_t N, int64_t OC) {
  if (N * OC == 0) return;
  const dim3 grid(blocks_for(OC), static_cast<unsigned>((N + kRowsPerChunk - 1) / kRowsPerChunk));
  column_sums_add_k<<<grid, kThreads, 0, s>>>(dbias, dout, N, OC);
  ZP_LAUNCH_CHECK();
}

void attention_scores(cudaStream_t s, float* preatt, const float* qkv, int64_t B, int64_t T,
                      int64_t C, int64_t NH) {
  const AttnDims d = attn_dims(B, T, C, NH);
  const int64_t n = B * NH * T * T;
  if (n == 0) return;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.HS));
  attention_scores_k<<<blocks_for(n), kThreads, 0, s>>>(preatt, qkv, d, scale);
  ZP_LAUNCH_CHECK();
}

void attention_softmax(cudaStream_t s, float* att, const float* preatt, int64_t B, int64_t NH,
                       int64_t T) {
  const int64_t rows = B * NH * T;
  if (rows == 0) return;
  check_rows(rows, "attention_softmax");
  attention_softmax_k<<<rows_blocks(rows), kThreads, 0, s>>>(att, preatt, rows, T);
  ZP_LAUNCH_CHECK();
}

void attention_values(cudaStream_t s, float* out, const float* att, const float* qkv, int64_t B,
                      int64_t T, int64_t C, int64_t NH) {
  const AttnDims d = attn_dims(B, T, C, NH);
  if (B * T * C == 0) return;
  attention_values_k<<<blocks_for(B * T * C), kThreads, 0, s>>>(out, att, qkv, d);
  ZP_LAUNCH_CHECK();
}

void attention_values_backward(cudaStream_t s, float* datt, float* dqkv, const float* dout,
                               const float* att, const float* qkv, int64_t B, int64_t T,
                               int64_t C, int64_t NH) {
  const AttnDims d = attn_dims(B, T, C, NH);
  if (B * T * C == 0) return;
  attention_values_backward_datt_k<<<blocks_for(B * NH * T * T), kThreads, 0, s>>>(datt, dout, qkv, d);
  ZP_LAUNCH_CHECK();
  attention_values_backward_dv_k<<<blocks_for(B * T * C), kThreads, 0, s>>>(dqkv, dout, att, d);
  ZP_LAUNCH_CHECK();
}

void attention_softmax_backward(cudaStream_t s, float* dpreatt, const float* datt,
                                const float* att, int64_t B, int64_t NH, int64_t T) {
  const int64_t rows = B * NH * T;
  if (rows == 0) return;
  check_rows(rows, "attention_softmax_backward");
  attention_softmax_backward_k<<<rows_blocks(rows), kThreads, 0, s>>>(dpreatt, datt, att, rows, T);
  ZP_LAUNCH_CHECK();
}

void attention_scores_backward(cudaStream_t s, float* dqkv, const float* dpreatt,
                               const float* qkv, int64_t B, int64_t T, int64_t C, int64_t NH) {
  const AttnDims d = attn_dims(B, T, C, NH);
  if (B * T * C == 0) return;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.HS));
  attention_scores_backward_k<<<blocks_for(2 * B * T * C), kThreads, 0, s>>>(dqkv, dpreatt, qkv, d, scale);
  ZP_LAUNCH_CHECK();
}

void gelu_forward(cudaStream_t s, float* out, const float* inp, int64_t n) {
  if (n == 0) return;
  gelu_forward_k<<<blocks_for(n), kThreads, 0, s>>>(out, inp, n);
  ZP_LAUNCH_CHECK();
}

void gelu_backward(cudaStream_t s, float* dinp, const float* inp, const float* dout, int64_t n) {
  if (n == 0) return;
  gelu_backward_k<<<blocks_for(n), kThreads, 0, s>>>(dinp, inp, dout, n);
  ZP_LAUNCH_CHECK();
}

void residual_forward(cudaStream_t s, float* out, const float* a, const float* b, int64_t n) {
  if (n == 0) return;
  residual_forward_k<<<blocks_for(n), kThreads, 0, s>>>(out, a, b, n);
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

void crossentropy_backward(cudaStream_t s, float* probs, const int32_t* targets, float dloss,
                           int64_t N, int64_t V, int64_t* bad_target) {
  if (N * V == 0) return;
  crossentropy_backward_k<<<blocks_for(N * V), kThreads, 0, s>>>(probs, targets, dloss, V, N * V, bad_target);
  ZP_LAUNCH_CHECK();
}

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

void sum_add(cudaStream_t s, double* out, const float* p, int64_t n) {
  if (n == 0) return;
  sum_k<<<blocks_for(n), kThreads, 0, s>>>(out, p, n);
  ZP_LAUNCH_CHECK();
}

void sum_squares_add(cudaStream_t s, double* out, const void* p, DType t, uint64_t n) {
  if (n == 0) return;
  const auto m = static_cast<int64_t>(n);
  sum_squares_k<<<blocks_for(m), kThreads, 0, s>>>(out, p, t, m);
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
