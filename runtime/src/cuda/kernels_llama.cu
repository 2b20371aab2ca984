// kernels_llama.cu: the CUDA kernels of the LLaMA-family blocks that are not GEMMs: RMSNorm,
// Qwen3's per-head q/k norms, rotary embeddings, SwiGLU, Qwen2-MoE's sigmoid gate, and flash
// attention (forward and backward), each with its host launcher. The contracts are
// cpu_kernels.hpp's; as in kernels.cu, templates over the storage type load as fp32, compute
// in fp32 and store each output element once, every output owned by one thread (no atomics,
// fixed summation orders: the same bits on every run). Sums run over a warp's lanes where the
// CPU loops run sequentially, so results agree with the cpu backend within fp32 reordering.
// Grouped-query attention's three steps are cuBLAS products (device_cuda.cpp) around
// kernels.cu's softmax.
//
// Flash attention (Dao 2023, FlashAttention-2's algorithm): a block of 16 warps takes 16
// consecutive query rows of one sequence and head, one per warp; the block loads the keys and
// values they see 32 rows at a time into shared memory, once for all 16, and each warp scores
// its query against them (one key per lane), updates its online softmax (Milakov & Gimelshein
// 2018) and adds the weighted values (each lane owning HS / 32 output columns). Nothing T x T
// is stored. The backward recomputes the probabilities from the saved log-sum-exp twice, in
// blocks of query rows (dQ, summed over their keys) and in blocks of key rows (dK and dV,
// summed over the group's query heads in order and their queries, whose rows the block shares),
// so each gradient element has one owner and one addition into dqkv. SIMT fp32 arithmetic, no
// tensor cores: it saves the T x T memory, but cuBLAS's three steps on tensor cores are faster
// (README, "On GPUs").
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "kernel_common.cuh"
#include "kernels.hpp"

namespace zp::runtime::cuda {

using namespace common;

namespace {

constexpr int kFlashPerLane = static_cast<int>(kFlashMaxHead / kWarp);


// ---- RMSNorm: one warp per row ----------------------------------------------------------------

template <DType D>
__global__ void rmsnorm_forward_k(void* out, float* stats, const void* inp, const void* w,
                                  float eps, int64_t N, int64_t C) {
  const int64_t row = warp_row();
  const int lane = lane_id();
  if (row >= N) return;
  const int64_t x0 = row * C;
  float sq = 0.0f;
  for (int64_t i = lane; i < C; i += kWarp) {
    const float x = ld<D>(inp, x0 + i);
    sq += x * x;
  }
  // rmsnorm_row_rstd's formula.
  const float rstd = 1.0f / sqrtf(warp_sum(sq) / static_cast<float>(C) + eps);
  for (int64_t i = lane; i < C; i += kWarp)
    st<D>(out, x0 + i, ld<D>(inp, x0 + i) * rstd * ld<D>(w, i));
  if (lane == 0) stats[row] = rstd;
}

template <DType D>
__global__ void rmsnorm_backward_dinp_k(void* dinp, const void* dout, const void* inp,
                                        const void* w, const float* stats, int64_t N, int64_t C) {
  const int64_t row = warp_row();
  const int lane = lane_id();
  if (row >= N) return;
  const int64_t x0 = row * C;
  const float rstd = stats[row];
  float s = 0.0f;  // rmsnorm_row_gxhat_mean's products, reduced over the warp
  for (int64_t i = lane; i < C; i += kWarp)
    s += ld<D>(w, i) * ld<D>(dout, x0 + i) * ld<D>(inp, x0 + i) * rstd;
  const float m = warp_sum(s) / static_cast<float>(C);
  for (int64_t i = lane; i < C; i += kWarp)
    st<D>(dinp, x0 + i,
          ld<D>(dinp, x0 + i) + rmsnorm_dinp(ld<D>(dout, x0 + i), ld<D>(inp, x0 + i), ld<D>(w, i), rstd, m));
}

// dweight[c] += sum over rows of dout x rstd: a block owns kWarp columns (lane = column), its
// warps take every kWarpsPerBlock-th row, the partials meet in shared memory in warp order and
// the column is written once (kernels.cu's column_sums_k pattern).
template <DType D>
__global__ void rmsnorm_dweight_k(void* dweight, const void* dout, const void* inp,
                                  const float* stats, int64_t N, int64_t C) {
  __shared__ float part[kWarpsPerBlock][kWarp];
  const int lane = lane_id(), warp = static_cast<int>(threadIdx.x / kWarp);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarp + lane;
  float acc = 0.0f;
  if (c < C)
    for (int64_t r = warp; r < N; r += kWarpsPerBlock)
      acc += ld<D>(dout, r * C + c) * ld<D>(inp, r * C + c) * stats[r];
  part[warp][lane] = acc;
  __syncthreads();
  if (warp != 0 || c >= C) return;
  float sum = 0.0f;
  for (int w = 0; w < kWarpsPerBlock; ++w) sum += part[w][lane];
  st<D>(dweight, c, ld<D>(dweight, c) + sum);
}

// ---- Per-head RMSNorm of q and k (Qwen3): one warp per (token, head) ---------------------------

// Element i of token r's head j: query heads j < NH from in.q, key heads from in.k.
template <DType D>
__device__ inline float head_ld(const QkvRows& in, int64_t r, int64_t j, int64_t NH, int64_t HS,
                                int64_t i) {
  return j < NH ? ld<D>(in.q, r * in.q_row + j * HS + i) : ld<D>(in.k, r * in.k_row + (j - NH) * HS + i);
}

template <DType D>
__global__ void head_rmsnorm_forward_k(void* out, float* stats, QkvRows in, const void* w,
                                       float eps, int64_t N, int64_t NH, int64_t H, int64_t HS) {
  const int64_t row = warp_row();
  const int lane = lane_id();
  if (row >= N * H) return;
  const int64_t r = row / H, j = row % H, w0 = j < NH ? 0 : HS;
  float sq = 0.0f;
  for (int64_t i = lane; i < HS; i += kWarp) {
    const float x = head_ld<D>(in, r, j, NH, HS, i);
    sq += x * x;
  }
  const float rstd = 1.0f / sqrtf(warp_sum(sq) / static_cast<float>(HS) + eps);
  for (int64_t i = lane; i < HS; i += kWarp)
    st<D>(out, row * HS + i, head_ld<D>(in, r, j, NH, HS, i) * rstd * ld<D>(w, w0 + i));
  if (lane == 0) stats[row] = rstd;
}

// dweight (2 HS) += sum over rows, then the column's heads in order, of dout xhat: run before
// the in-place pass below overwrites dout.
template <DType D>
__global__ void head_rmsnorm_dweight_k(void* dweight, const void* dqkv, int64_t grad_row,
                                       QkvRows in, const float* stats, int64_t N, int64_t NH,
                                       int64_t H, int64_t HS) {
  __shared__ float part[kWarpsPerBlock][kWarp];
  const int lane = lane_id(), warp = static_cast<int>(threadIdx.x / kWarp);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarp + lane;
  float acc = 0.0f;
  if (c < 2 * HS) {
    const int64_t i = c % HS, j0 = c < HS ? 0 : NH, j1 = c < HS ? NH : H;
    for (int64_t r = warp; r < N; r += kWarpsPerBlock)
      for (int64_t j = j0; j < j1; ++j)
        acc += ld<D>(dqkv, r * grad_row + j * HS + i) * head_ld<D>(in, r, j, NH, HS, i) * stats[r * H + j];
  }
  part[warp][lane] = acc;
  __syncthreads();
  if (warp != 0 || c >= 2 * HS) return;
  float sum = 0.0f;
  for (int w = 0; w < kWarpsPerBlock; ++w) sum += part[w][lane];
  st<D>(dweight, c, ld<D>(dweight, c) + sum);
}

// In place: the q and k heads of dqkv (the gradient of the normed heads) become the gradient of
// the heads before the norm. Each lane reads its elements before the warp's sum completes and
// rewrites only those.
template <DType D>
__global__ void head_rmsnorm_backward_k(void* dqkv, int64_t grad_row, QkvRows in, const void* w,
                                        const float* stats, int64_t N, int64_t NH, int64_t H,
                                        int64_t HS) {
  const int64_t row = warp_row();
  const int lane = lane_id();
  if (row >= N * H) return;
  const int64_t r = row / H, j = row % H, w0 = j < NH ? 0 : HS, g0 = r * grad_row + j * HS;
  const float rstd = stats[row];
  float s = 0.0f;
  for (int64_t i = lane; i < HS; i += kWarp)
    s += ld<D>(w, w0 + i) * ld<D>(dqkv, g0 + i) * head_ld<D>(in, r, j, NH, HS, i) * rstd;
  const float m = warp_sum(s) / static_cast<float>(HS);
  for (int64_t i = lane; i < HS; i += kWarp)
    st<D>(dqkv, g0 + i,
          rmsnorm_dinp(ld<D>(dqkv, g0 + i), head_ld<D>(in, r, j, NH, HS, i), ld<D>(w, w0 + i), rstd, m));
}

// ---- Rotary embeddings, in place: one thread per rotated pair ----------------------------------

struct InvFreq {
  float v[kRopeMaxHalf];
};

// cpu_kernels.cpp's rope_apply: the fp32 angle t inv_freq[i], its cos and sin in double rounded
// once to fp32, times mscale; the backward turns by the opposite angle.
template <DType D, bool kForward>
__global__ void rope_k(void* x, InvFreq f, float mscale, int64_t T, int64_t row, int64_t n_heads,
                       int64_t HS, int64_t half, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const int64_t p = i % half, rh = i / half, h = rh % n_heads, r = rh / n_heads;
    const float angle = static_cast<float>(r % T) * f.v[p];
    double sd = 0.0, cd = 0.0;
    sincos(static_cast<double>(angle), &sd, &cd);
    const float c = static_cast<float>(cd) * mscale, s = static_cast<float>(sd) * mscale;
    const int64_t a = r * row + h * HS + p;
    float x1 = ld<D>(x, a), x2 = ld<D>(x, a + half);
    rope_pair(&x1, &x2, c, kForward ? s : -s);
    st<D>(x, a, x1);
    st<D>(x, a + half, x2);
  }
}

// ---- SwiGLU and the shared expert's gate: elementwise ---------------------------------------

template <DType D>
__global__ void swiglu_forward_k(void* out, const void* gate, const void* up, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride())
    st<D>(out, i, swiglu(ld<D>(gate, i), ld<D>(up, i)));
}

// Overwrites row r of dgate_up (N, 2F): d gate then d up.
template <DType D>
__global__ void swiglu_backward_k(void* dgate_up, const void* dout, const void* gate,
                                  const void* up, int64_t F, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const int64_t r = i / F, c = i % F;
    float dg = 0.0f, du = 0.0f;
    swiglu_grad(ld<D>(gate, i), ld<D>(up, i), ld<D>(dout, i), &dg, &du);
    st<D>(dgate_up, r * 2 * F + c, dg);
    st<D>(dgate_up, r * 2 * F + F + c, du);
  }
}

// out (N, C) = sigmoid(g[n]) x[n]: cpu_moe.cpp's gate_mul_forward.
template <DType D>
__global__ void gate_mul_forward_k(void* out, const void* x, const void* g, int64_t C, int64_t n) {
  for (int64_t i = global_index(); i < n; i += grid_stride()) {
    const float s = 1.0f / (1.0f + expf(-ld<D>(g, i / C)));
    st<D>(out, i, s * ld<D>(x, i));
  }
}

// One warp per token: dx = s dout (overwrites), dg = (dout . x) s (1 - s) (overwrites).
template <DType D>
__global__ void gate_mul_backward_k(void* dx, void* dg, const void* dout, const void* x,
                                    const void* g, int64_t N, int64_t C) {
  const int64_t row = warp_row();
  const int lane = lane_id();
  if (row >= N) return;
  const float s = 1.0f / (1.0f + expf(-ld<D>(g, row)));
  float dot = 0.0f;
  for (int64_t c = lane; c < C; c += kWarp) {
    const float go = ld<D>(dout, row * C + c);
    dot += go * ld<D>(x, row * C + c);
    st<D>(dx, row * C + c, s * go);
  }
  dot = warp_sum(dot);
  if (lane == 0) st<D>(dg, row, dot * s * (1.0f - s));
}

// ---- Flash attention -------------------------------------------------------------------------

// The dropout factor of probability (b, h, t, t2): element row + t2 of the three-step
// attention's mask (cpu_flash.cpp's Drop), so both paths and both devices drop the same entries.
struct FlashDrop {
  float p = 0.0f;
  uint64_t key = 0;
  uint32_t threshold = 0;
  float scale = 1.0f;
  __device__ float factor(int64_t row, int64_t t2) const {
    return p == 0.0f ? 1.0f : dropout_keep(key, row + t2, threshold) ? scale : 0.0f;
  }
};

FlashDrop make_drop(float p, uint64_t key) {
  FlashDrop d;
  d.p = p;
  d.key = key;
  if (p > 0.0f) {
    d.threshold = dropout_threshold(p);
    d.scale = dropout_scale(p);
  }
  return d;
}

// The row's HS elements of a q, k, v or dout row, copied into the warp's shared slice.
template <DType D>
__device__ inline void load_row(float* dst, const void* src, int64_t off, int64_t HS, int lane) {
  for (int64_t d = lane; d < HS; d += kWarp) dst[d] = ld<D>(src, off + d);
}

// The tiles: kFlashWarps warps per block, one query row (or, in dK/dV, one key row) each, of
// the same sequence and head; each step the block loads 32 key (or query) rows into shared
// memory once for all its warps (coalesced), rows padded to HS + 1 floats so that lane j
// reading row j meets no bank conflict.
constexpr int kFlashWarps = 16;
constexpr int kFlashThreads = kFlashWarps * kWarp;

// Dynamic shared memory beyond the default 48 KiB is opt-in per kernel (HS 128 and up).
template <class Kernel>
void allow_shared(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024)
    ZP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes)));
}

// Rows [r0, r0 + 32) of a q, k, v or dout tensor (row stride `row`, head offset `col`) into a
// padded tile; rows at or beyond `end` as zeros.
template <DType D>
__device__ inline void load_tile(float* tile, int64_t P, const void* src, int64_t base, int64_t row,
                                 int64_t r0, int64_t end, int64_t HS) {
  for (int64_t i = threadIdx.x; i < kWarp * HS; i += blockDim.x) {
    const int64_t r = i / HS, d = i % HS;
    tile[r * P + d] = r0 + r < end ? ld<D>(src, base + (r0 + r) * row + d) : 0.0f;
  }
}
__device__ inline float dot_shared(const float* a, const float* b, int64_t HS) {
  float acc = 0.0f;
  for (int64_t d = 0; d < HS; ++d) acc += a[d] * b[d];
  return acc;
}

// One block per (b, h, tile of kFlashWarps queries); warp w owns query tile * kFlashWarps + w.
template <DType D>
__global__ void __launch_bounds__(kFlashThreads)
    flash_forward_k(void* out, float* lse, QkvRows in, AttnDims a, float scale, FlashDrop drop) {
  extern __shared__ float sm[];
  const int64_t T = a.T, HS = a.HS, P = HS + 1;
  float* sk = sm;
  float* sv = sk + kWarp * P;
  const int warp = static_cast<int>(threadIdx.x / kWarp), lane = lane_id();
  float* q = sv + kWarp * P + warp * HS;
  const int64_t tiles = (T + kFlashWarps - 1) / kFlashWarps;
  const int64_t tile = blockIdx.x % tiles, h = blockIdx.x / tiles % a.NH, b = blockIdx.x / tiles / a.NH;
  const int64_t kv = h / (a.NH / a.KVH), O = a.NH * HS;
  const int64_t t_first = tile * kFlashWarps, t_last = min(T - 1, t_first + kFlashWarps - 1);
  const int64_t t = t_first + warp;
  const bool active = t < T;
  if (active) load_row<D>(q, in.q, (b * T + t) * in.q_row + h * HS, HS, lane);
  float o[kFlashPerLane];
#pragma unroll
  for (int j = 0; j < kFlashPerLane; ++j) o[j] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const int64_t lo = active ? first_key(t, a.window) : 0;
  const int64_t drow = ((b * a.NH + h) * T + t) * T;
  for (int64_t c0 = first_key(t_first, a.window); c0 <= t_last; c0 += kWarp) {
    __syncthreads();  // the previous tile's readers are done
    load_tile<D>(sk, P, in.k, b * T * in.k_row + kv * HS, in.k_row, c0, t_last + 1, HS);
    load_tile<D>(sv, P, in.v, b * T * in.v_row + kv * HS, in.v_row, c0, t_last + 1, HS);
    __syncthreads();
    if (!active || c0 + kWarp <= lo || c0 > t) continue;  // a whole warp: no key of its query here
    const int64_t t2 = c0 + lane;
    const bool valid = t2 >= lo && t2 <= t;
    const float s = valid ? dot_shared(q, sk + lane * P, HS) * scale : -INFINITY;
    const float mx = fmaxf(m, warp_max(s));  // finite: some lane's key is valid
    const float corr = expf(m - mx);         // 0 on the row's first keys
    const float e = valid ? expf(s - mx) : 0.0f;
    l = l * corr + warp_sum(e);
    const float pe = valid ? e * drop.factor(drow, t2) : 0.0f;
#pragma unroll
    for (int j = 0; j < kFlashPerLane; ++j) o[j] *= corr;
    for (int src = 0; src < kWarp; ++src) {
      const float ps = __shfl_sync(kFullMask, pe, src);
      if (ps == 0.0f) continue;  // the same for every lane
#pragma unroll
      for (int j = 0; j < kFlashPerLane; ++j) {
        const int64_t d = lane + j * kWarp;
        if (d < HS) o[j] += ps * sv[src * P + d];
      }
    }
    m = mx;
  }
  if (!active) return;
  const float inv = 1.0f / l;
#pragma unroll
  for (int j = 0; j < kFlashPerLane; ++j) {
    const int64_t d = lane + j * kWarp;
    if (d < HS) st<D>(out, (b * T + t) * O + h * HS + d, o[j] * inv);
  }
  if (lane == 0) lse[(b * a.NH + h) * T + t] = m + logf(l);
}

// dsum (B, NH, T) = rowsum(dout o out) per query and head (FlashAttention-2 alg. 2 line 4); one
// warp per (b, t, h).
template <DType D>
__global__ void flash_dsum_k(float* dsum, const void* dout, const void* out, AttnDims a) {
  const int64_t w = warp_row();
  const int lane = lane_id();
  if (w >= a.B * a.T * a.NH) return;
  const int64_t h = w % a.NH, bt = w / a.NH, b = bt / a.T, t = bt % a.T;
  const int64_t off = bt * a.NH * a.HS + h * a.HS;
  float acc = 0.0f;
  for (int64_t d = lane; d < a.HS; d += kWarp) acc += ld<D>(dout, off + d) * ld<D>(out, off + d);
  acc = warp_sum(acc);
  if (lane == 0) dsum[(b * a.NH + h) * a.T + t] = acc;
}

// dQ: the forward's blocks and tiles (keys and values shared), each warp's query and dout row
// in shared memory; dq_acc (fp32) gets the row, dqkv's q part the row added once.
template <DType D>
__global__ void __launch_bounds__(kFlashThreads)
    flash_dq_k(void* dqkv, float* dq_acc, const float* dsum, const void* dout, QkvRows in,
               const float* lse, AttnDims a, float scale, FlashDrop drop) {
  extern __shared__ float sm[];
  const int64_t T = a.T, HS = a.HS, P = HS + 1;
  float* sk = sm;
  float* sv = sk + kWarp * P;
  const int warp = static_cast<int>(threadIdx.x / kWarp), lane = lane_id();
  float* q = sv + kWarp * P + warp * 2 * HS;
  float* g = q + HS;
  const int64_t tiles = (T + kFlashWarps - 1) / kFlashWarps;
  const int64_t tile = blockIdx.x % tiles, h = blockIdx.x / tiles % a.NH, b = blockIdx.x / tiles / a.NH;
  const int64_t kv = h / (a.NH / a.KVH), O = a.NH * HS, R = (a.NH + 2 * a.KVH) * HS;
  const int64_t t_first = tile * kFlashWarps, t_last = min(T - 1, t_first + kFlashWarps - 1);
  const int64_t t = t_first + warp;
  const bool active = t < T;
  float L = 0.0f, Dt = 0.0f;
  if (active) {
    load_row<D>(q, in.q, (b * T + t) * in.q_row + h * HS, HS, lane);
    load_row<D>(g, dout, (b * T + t) * O + h * HS, HS, lane);
    L = lse[(b * a.NH + h) * T + t];
    Dt = dsum[(b * a.NH + h) * T + t];
  }
  const int64_t lo = active ? first_key(t, a.window) : 0;
  const int64_t drow = ((b * a.NH + h) * T + t) * T;
  float dq[kFlashPerLane];
#pragma unroll
  for (int j = 0; j < kFlashPerLane; ++j) dq[j] = 0.0f;
  for (int64_t c0 = first_key(t_first, a.window); c0 <= t_last; c0 += kWarp) {
    __syncthreads();
    load_tile<D>(sk, P, in.k, b * T * in.k_row + kv * HS, in.k_row, c0, t_last + 1, HS);
    load_tile<D>(sv, P, in.v, b * T * in.v_row + kv * HS, in.v_row, c0, t_last + 1, HS);
    __syncthreads();
    if (!active || c0 + kWarp <= lo || c0 > t) continue;
    const int64_t t2 = c0 + lane;
    float ds = 0.0f;
    if (t2 >= lo && t2 <= t) {
      const float pr = expf(dot_shared(q, sk + lane * P, HS) * scale - L);
      const float z = drop.factor(drow, t2);
      ds = pr * (dot_shared(g, sv + lane * P, HS) * z - Dt) * scale;
    }
    for (int src = 0; src < kWarp; ++src) {
      const float d_s = __shfl_sync(kFullMask, ds, src);
      if (d_s == 0.0f) continue;
#pragma unroll
      for (int j = 0; j < kFlashPerLane; ++j) {
        const int64_t d = lane + j * kWarp;
        if (d < HS) dq[j] += d_s * sk[src * P + d];
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (int j = 0; j < kFlashPerLane; ++j) {
    const int64_t d = lane + j * kWarp;
    if (d >= HS) continue;
    dq_acc[(b * T + t) * O + h * HS + d] = dq[j];
    const int64_t i = (b * T + t) * R + h * HS + d;
    st<D>(dqkv, i, ld<D>(dqkv, i) + dq[j]);
  }
}

// dK and dV: one block per (b, kv head, tile of kFlashWarps keys), warp w owning key
// tile * kFlashWarps + w (its k and v rows in shared memory); the block walks the group's query
// heads in order and, for each, the queries that see its keys, 32 at a time (q and dout rows
// shared, with their lse and dsum). Each key's gradients are added into dqkv once.
template <DType D>
__global__ void __launch_bounds__(kFlashThreads)
    flash_dkv_k(void* dqkv, const float* dsum, const void* dout, QkvRows in, const float* lse,
                AttnDims a, float scale, FlashDrop drop) {
  extern __shared__ float sm[];
  const int64_t T = a.T, HS = a.HS, P = HS + 1;
  float* sq = sm;
  float* sg = sq + kWarp * P;
  float* sl = sg + kWarp * P;  // lse of the tile's queries
  float* sd = sl + kWarp;      // dsum of the tile's queries
  const int warp = static_cast<int>(threadIdx.x / kWarp), lane = lane_id();
  float* k = sd + kWarp + warp * 2 * HS;
  float* v = k + HS;
  const int64_t tiles = (T + kFlashWarps - 1) / kFlashWarps;
  const int64_t tile = blockIdx.x % tiles, kv = blockIdx.x / tiles % a.KVH, b = blockIdx.x / tiles / a.KVH;
  const int64_t G = a.NH / a.KVH, O = a.NH * HS, R = (a.NH + 2 * a.KVH) * HS;
  const int64_t k_first = tile * kFlashWarps, k_last = min(T - 1, k_first + kFlashWarps - 1);
  const int64_t t2 = k_first + warp;
  const bool active = t2 < T;
  // The queries that see key x: x <= t < x + window (or T).
  auto end_of = [&](int64_t x) { return a.window > 0 && x + a.window < T ? x + a.window : T; };
  const int64_t t_end = active ? end_of(t2) : 0, blk_end = end_of(k_last);
  if (active) {
    load_row<D>(k, in.k, (b * T + t2) * in.k_row + kv * HS, HS, lane);
    load_row<D>(v, in.v, (b * T + t2) * in.v_row + kv * HS, HS, lane);
  }
  float dk[kFlashPerLane], dv[kFlashPerLane];
#pragma unroll
  for (int j = 0; j < kFlashPerLane; ++j) dk[j] = dv[j] = 0.0f;
  for (int64_t h = kv * G; h < (kv + 1) * G; ++h)
    for (int64_t c0 = k_first; c0 < blk_end; c0 += kWarp) {
      __syncthreads();
      load_tile<D>(sq, P, in.q, b * T * in.q_row + h * HS, in.q_row, c0, blk_end, HS);
      load_tile<D>(sg, P, dout, b * T * O + h * HS, O, c0, blk_end, HS);
      if (threadIdx.x < kWarp) {
        const int64_t t = c0 + threadIdx.x;
        sl[threadIdx.x] = t < blk_end ? lse[(b * a.NH + h) * T + t] : 0.0f;
        sd[threadIdx.x] = t < blk_end ? dsum[(b * a.NH + h) * T + t] : 0.0f;
      }
      __syncthreads();
      if (!active || c0 + kWarp <= t2 || c0 >= t_end) continue;
      const int64_t t = c0 + lane;
      float pz = 0.0f, ds = 0.0f;
      if (t >= t2 && t < t_end) {
        const float pr = expf(dot_shared(sq + lane * P, k, HS) * scale - sl[lane]);
        const float z = drop.factor(((b * a.NH + h) * T + t) * T, t2);
        pz = pr * z;
        ds = pr * (dot_shared(sg + lane * P, v, HS) * z - sd[lane]) * scale;
      }
      for (int src = 0; src < kWarp; ++src) {
        const float p_s = __shfl_sync(kFullMask, pz, src), d_s = __shfl_sync(kFullMask, ds, src);
#pragma unroll
        for (int j = 0; j < kFlashPerLane; ++j) {
          const int64_t d = lane + j * kWarp;
          if (d >= HS) continue;
          if (p_s != 0.0f) dv[j] += p_s * sg[src * P + d];
          if (d_s != 0.0f) dk[j] += d_s * sq[src * P + d];
        }
      }
    }
  if (!active) return;
#pragma unroll
  for (int j = 0; j < kFlashPerLane; ++j) {
    const int64_t d = lane + j * kWarp;
    if (d >= HS) continue;
    const int64_t ik = (b * T + t2) * R + a.NH * HS + kv * HS + d;
    const int64_t iv = (b * T + t2) * R + (a.NH + a.KVH) * HS + kv * HS + d;
    st<D>(dqkv, ik, ld<D>(dqkv, ik) + dk[j]);
    st<D>(dqkv, iv, ld<D>(dqkv, iv) + dv[j]);
  }
}

void check_heads(const AttnDims& a, const QkvRows& in, float p, const char* what) {
  if (a.B <= 0 || a.T <= 0 || a.NH <= 0 || a.KVH <= 0 || a.HS <= 0 || a.NH % a.KVH != 0 ||
      a.window < 0 || in.q == nullptr || in.k == nullptr || in.v == nullptr ||
      in.q_row < a.NH * a.HS || in.k_row < a.KVH * a.HS || in.v_row < a.KVH * a.HS)
    throw Error(std::string("cuda ") + what + ": B " + std::to_string(a.B) + " T " +
                    std::to_string(a.T) + ", " + std::to_string(a.NH) + " query heads, " +
                    std::to_string(a.KVH) + " key/value heads of " + std::to_string(a.HS),
                "the query heads must be a positive multiple of the key/value heads, and each row "
                "must hold all of its heads");
  if (a.HS > kFlashMaxHead)
    throw Error(std::string("cuda ") + what + ": heads of " + std::to_string(a.HS) +
                    " exceed the kernel's " + std::to_string(kFlashMaxHead),
                "run this model's attention in three steps (drop --flash-attention)");
  if (!(p >= 0.0f && p < 1.0f))
    throw Error(std::string("cuda ") + what + ": dropout probability " + std::to_string(p) +
                    " is outside [0, 1)",
                "attention dropout is a probability below 1");
}

// One launch's blocks along x.
void check_blocks(int64_t blocks, const char* what) {
  if (blocks > INT32_MAX)
    throw Error(std::string("cuda ") + what + ": " + std::to_string(blocks) + " blocks exceed one launch",
                "use fewer tokens per micro-batch");
}

}  // namespace

// ---- launchers ---------------------------------------------------------------------------------

void rmsnorm_forward(cudaStream_t s, void* out, float* stats, const void* inp, const void* weight,
                     float eps, DType t, int64_t N, int64_t C) {
  if (N == 0) return;
  check_rows(N, "rmsnorm_forward");
  ZP_TYPED(t, rmsnorm_forward_k<D><<<rows_blocks(N), kThreads, 0, s>>>(out, stats, inp, weight, eps, N, C));
  ZP_LAUNCH_CHECK();
}

void rmsnorm_backward(cudaStream_t s, void* dinp, void* dweight, const void* dout, const void* inp,
                      const void* weight, const float* stats, DType t, int64_t N, int64_t C) {
  if (N == 0) return;
  check_rows(N, "rmsnorm_backward");
  ZP_TYPED(t, rmsnorm_backward_dinp_k<D><<<rows_blocks(N), kThreads, 0, s>>>(dinp, dout, inp, weight, stats, N, C));
  ZP_LAUNCH_CHECK();
  ZP_TYPED(t, rmsnorm_dweight_k<D><<<blocks_for(C, kWarp), kThreads, 0, s>>>(dweight, dout, inp, stats, N, C));
  ZP_LAUNCH_CHECK();
}

void head_rmsnorm_forward(cudaStream_t s, void* out, float* stats, const QkvRows& in,
                          const void* weight, float eps, DType t, int64_t N, int64_t NH,
                          int64_t KVH, int64_t HS) {
  const int64_t rows = N * (NH + KVH);
  if (rows == 0) return;
  check_rows(rows, "head_rmsnorm_forward");
  ZP_TYPED(t, head_rmsnorm_forward_k<D><<<rows_blocks(rows), kThreads, 0, s>>>(out, stats, in, weight, eps, N, NH, NH + KVH, HS));
  ZP_LAUNCH_CHECK();
}

void head_rmsnorm_backward(cudaStream_t s, void* dqkv, int64_t grad_row, void* dweight,
                           const QkvRows& in, const void* weight, const float* stats, DType t,
                           int64_t N, int64_t NH, int64_t KVH, int64_t HS) {
  const int64_t H = NH + KVH, rows = N * H;
  if (rows == 0) return;
  if (grad_row < H * HS)
    throw Error("cuda head_rmsnorm_backward: gradient rows of " + std::to_string(grad_row) + " for " +
                    std::to_string(H) + " heads of " + std::to_string(HS),
                "the q and k heads must fit the fused gradient row");
  check_rows(rows, "head_rmsnorm_backward");
  ZP_TYPED(t, head_rmsnorm_dweight_k<D><<<blocks_for(2 * HS, kWarp), kThreads, 0, s>>>(dweight, dqkv, grad_row, in, stats, N, NH, H, HS));
  ZP_LAUNCH_CHECK();
  ZP_TYPED(t, head_rmsnorm_backward_k<D><<<rows_blocks(rows), kThreads, 0, s>>>(dqkv, grad_row, in, weight, stats, N, NH, H, HS));
  ZP_LAUNCH_CHECK();
}

void rope(cudaStream_t s, bool forward, void* x, const float* inv_freq, float mscale, DType t,
          int64_t B, int64_t T, int64_t row, int64_t n_heads, int64_t HS, int64_t rot) {
  if (rot <= 0 || rot % 2 != 0 || rot > HS || n_heads * HS > row)
    throw Error("cuda rope: rotary dims " + std::to_string(rot) + " for heads of " + std::to_string(HS) +
                    " (" + std::to_string(n_heads) + " heads in rows of " + std::to_string(row) + ")",
                "rot must be even, at most the head size, and the heads must fit the row");
  const int64_t half = rot / 2;
  if (half > kRopeMaxHalf)
    throw Error("cuda rope: " + std::to_string(rot) + " rotary dims exceed the kernel's " +
                    std::to_string(2 * kRopeMaxHalf),
                "a head of more than 512 rotated dims is not supported on the GPU yet");
  const int64_t n = B * T * n_heads * half;
  if (n == 0) return;
  InvFreq f{};
  std::memcpy(f.v, inv_freq, static_cast<std::size_t>(half) * sizeof(float));
  if (forward)
    ZP_TYPED(t, rope_k<D, true><<<blocks_for(n), kThreads, 0, s>>>(x, f, mscale, T, row, n_heads, HS, half, n));
  else
    ZP_TYPED(t, rope_k<D, false><<<blocks_for(n), kThreads, 0, s>>>(x, f, mscale, T, row, n_heads, HS, half, n));
  ZP_LAUNCH_CHECK();
}

void swiglu_forward(cudaStream_t s, void* out, const void* gate, const void* up, DType t, int64_t n) {
  if (n == 0) return;
  ZP_TYPED(t, swiglu_forward_k<D><<<blocks_for(n), kThreads, 0, s>>>(out, gate, up, n));
  ZP_LAUNCH_CHECK();
}

void swiglu_backward(cudaStream_t s, void* dgate_up, const void* dout, const void* gate,
                     const void* up, DType t, int64_t N, int64_t F) {
  if (N * F == 0) return;
  ZP_TYPED(t, swiglu_backward_k<D><<<blocks_for(N * F), kThreads, 0, s>>>(dgate_up, dout, gate, up, F, N * F));
  ZP_LAUNCH_CHECK();
}

void gate_mul_forward(cudaStream_t s, void* out, const void* x, const void* g, DType t, int64_t N,
                      int64_t C) {
  if (N * C == 0) return;
  ZP_TYPED(t, gate_mul_forward_k<D><<<blocks_for(N * C), kThreads, 0, s>>>(out, x, g, C, N * C));
  ZP_LAUNCH_CHECK();
}

void gate_mul_backward(cudaStream_t s, void* dx, void* dg, const void* dout, const void* x,
                       const void* g, DType t, int64_t N, int64_t C) {
  if (N == 0) return;
  check_rows(N, "gate_mul_backward");
  ZP_TYPED(t, gate_mul_backward_k<D><<<rows_blocks(N), kThreads, 0, s>>>(dx, dg, dout, x, g, N, C));
  ZP_LAUNCH_CHECK();
}

void flash_attention_forward(cudaStream_t s, void* out, float* lse, const QkvRows& in, DType t,
                             const AttnDims& a, float p, uint64_t key) {
  check_heads(a, in, p, "flash_attention_forward");
  const int64_t blocks = a.B * a.NH * ((a.T + kFlashWarps - 1) / kFlashWarps);
  check_blocks(blocks, "flash_attention_forward");
  const float scale = 1.0f / std::sqrt(static_cast<float>(a.HS));
  const std::size_t shared =
      static_cast<std::size_t>(2 * kWarp * (a.HS + 1) + kFlashWarps * a.HS) * sizeof(float);
  const FlashDrop drop = make_drop(p, key);
  ZP_TYPED(t, allow_shared(flash_forward_k<D>, shared));
  ZP_TYPED(t, flash_forward_k<D><<<static_cast<unsigned>(blocks), kFlashThreads, shared, s>>>(out, lse, in, a, scale, drop));
  ZP_LAUNCH_CHECK();
}

void flash_attention_backward(cudaStream_t s, void* dqkv, float* dq_acc, float* dsum,
                              const void* dout, const QkvRows& in, const void* out,
                              const float* lse, DType t, const AttnDims& a, float p, uint64_t key) {
  check_heads(a, in, p, "flash_attention_backward");
  const int64_t tiles = (a.T + kFlashWarps - 1) / kFlashWarps;
  const int64_t rows = a.B * a.NH * a.T, q_blocks = a.B * a.NH * tiles, k_blocks = a.B * a.KVH * tiles;
  check_rows(rows, "flash_attention_backward");
  check_blocks(q_blocks, "flash_attention_backward");
  const float scale = 1.0f / std::sqrt(static_cast<float>(a.HS));
  const std::size_t dq_shared =
      static_cast<std::size_t>(2 * kWarp * (a.HS + 1) + kFlashWarps * 2 * a.HS) * sizeof(float);
  const std::size_t dkv_shared =
      static_cast<std::size_t>(2 * kWarp * (a.HS + 1) + 2 * kWarp + kFlashWarps * 2 * a.HS) * sizeof(float);
  const FlashDrop drop = make_drop(p, key);
  ZP_TYPED(t, flash_dsum_k<D><<<rows_blocks(rows), kThreads, 0, s>>>(dsum, dout, out, a));
  ZP_LAUNCH_CHECK();
  ZP_TYPED(t, allow_shared(flash_dq_k<D>, dq_shared));
  ZP_TYPED(t, flash_dq_k<D><<<static_cast<unsigned>(q_blocks), kFlashThreads, dq_shared, s>>>(dqkv, dq_acc, dsum, dout, in, lse, a, scale, drop));
  ZP_LAUNCH_CHECK();
  ZP_TYPED(t, allow_shared(flash_dkv_k<D>, dkv_shared));
  ZP_TYPED(t, flash_dkv_k<D><<<static_cast<unsigned>(k_blocks), kFlashThreads, dkv_shared, s>>>(dqkv, dsum, dout, in, lse, a, scale, drop));
  ZP_LAUNCH_CHECK();
}

}  // namespace zp::runtime::cuda
