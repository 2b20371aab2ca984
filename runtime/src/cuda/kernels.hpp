// kernels.hpp (internal): host-side launchers of the CUDA kernels in kernels.cu, one per Device
// op that is not a cuBLAS GEMM. Same names, shapes and semantics as cpu_kernels.hpp's typed
// kernels (backward kernels accumulate unless cpu_kernels.hpp says they overwrite; 16-bit
// outputs rounded once); each enqueues on `s` and returns at once, checking the launch. Not the
// device object (device_cuda.cpp) nor cuBLAS.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../cpu_adam_kernels.hpp"
#include "zp/runtime/dtype.hpp"

namespace zp::runtime::cuda {

// Buffers stored as t (void*) as in device.hpp: load as fp32, compute in fp32, store each
// output once; float* buffers are fp32 always.
void embedding_forward(cudaStream_t s, void* out, const int32_t* tokens, const void* wte,
                       const void* wpe, DType t, int64_t B, int64_t T, int64_t C);
void embedding_backward(cudaStream_t s, void* dwte, void* dwpe, const void* dout,
                        const int32_t* tokens, DType t, int64_t B, int64_t T, int64_t C);
void layernorm_forward(cudaStream_t s, void* out, float* stats, const void* inp,
                       const void* weight, const void* bias, DType t, int64_t N, int64_t C);
void layernorm_backward(cudaStream_t s, void* dinp, void* dweight, void* dbias,
                        const void* dout, const void* inp, const void* weight,
                        const float* stats, DType t, int64_t N, int64_t C);
// out (N,OC), stored as out_t, = bias (stored as t) broadcast over the rows (the GEMM then
// adds with beta = 1).
void broadcast_rows(cudaStream_t s, void* out, DType out_t, const void* bias, DType t, int64_t N,
                    int64_t OC);
// dbias (OC) += column sums of dout (N,OC), one owner per column.
void column_sums_add(cudaStream_t s, void* dbias, const void* dout, DType t, int64_t N, int64_t OC);
// Over keys first_key(t)..t of each row (window 0: keys 0..t; cpu::AttnShape::first_key),
// zeros elsewhere.
void attention_softmax(cudaStream_t s, void* att, const void* preatt, DType t, int64_t B,
                       int64_t NH, int64_t T, int64_t window = 0);
void attention_softmax_backward(cudaStream_t s, void* dpreatt, const void* datt,
                                const void* att, DType t, int64_t B, int64_t NH, int64_t T,
                                int64_t window = 0);
void gelu_forward(cudaStream_t s, void* out, const void* inp, DType t, int64_t n);
void gelu_backward(cudaStream_t s, void* dinp, const void* inp, const void* dout, DType t,
                   int64_t n);
void residual_forward(cudaStream_t s, void* out, const void* a, const void* b, DType t, int64_t n);
// kernel_math.hpp's masks and scale, as cpu_kernels.cpp: the same bits on either device.
void dropout_forward(cudaStream_t s, void* out, uint8_t* mask, const void* inp, DType t, float p,
                     uint64_t key, int64_t n);
void dropout_backward(cudaStream_t s, void* dinp, const void* dout, const uint8_t* mask, DType t,
                      float p, int64_t n);
// A target outside [0, V) sets *bad_target (device memory) to 1 + its row, and the row's loss
// and probabilities (or gradients) to NaN; the device checks the flag when it next reads
// results back.
void crossentropy_forward(cudaStream_t s, float* logits, float* losses, const int32_t* targets,
                          int64_t N, int64_t V, int64_t* bad_target);
// dlogits (t) = (probs - onehot) * dloss; in place when t is fp32 and dlogits == probs.
void crossentropy_backward(cudaStream_t s, void* dlogits, DType t, const float* probs,
                           const int32_t* targets, float dloss, int64_t N, int64_t V,
                           int64_t* bad_target);
void to_f32(cudaStream_t s, float* dst, const void* src, DType t, int64_t n);
void accumulate_to(cudaStream_t s, void* dst, const float* src, DType t, int64_t n);
void add(cudaStream_t s, void* dst, const void* src, DType t, int64_t n);
void add_f32(cudaStream_t s, float* dst, const void* src, DType t, int64_t n);
// *out (device, one double) = sum of p[0, n) (in double), or of its squares read as type t, in
// two passes through `partials` (device, kSumBlocks doubles): deterministic, no atomics.
inline constexpr int kSumBlocks = 1024;
// accumulate: *out += the sum instead (one double addition, in stream order).
void sum(cudaStream_t s, double* out, double* partials, const float* p, int64_t n,
         bool accumulate = false);
void sum_squares(cudaStream_t s, double* out, double* partials, const void* p, DType t, uint64_t n);
// The fused Adam of cpu_adam_kernels.hpp (adam_element, the same per-step coefficients), on
// device buffers; ts.grad_dtype, ts.moment_dtype and ts.param_out_dtype as there.
void adam_step(cudaStream_t s, const detail::AdamCoeffs& c, const AdamTensors& ts);
void sgd_step(cudaStream_t s, float* master, float* momentum_buf, const void* grads,
              DType grad_dtype, void* param_out, DType param_dtype, float lr, float momentum,
              float weight_decay, float grad_scale, uint64_t n);

// ---- LLaMA-family blocks (kernels_llama.cu), as cpu_kernels.hpp states them ------------------

// Where an attention reads q, k and v (cpu::Qkv's layout in elements of the storage type).
struct QkvRows {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_row = 0, k_row = 0, v_row = 0;
};
// cpu::AttnShape: NH query heads over KVH key/value heads of HS, an optional sliding window.
struct AttnDims {
  int64_t B = 0, T = 0, NH = 0, KVH = 0, HS = 0, window = 0;
};
// The heads the flash kernels hold per lane: HS at most 32 x kFlashPerLane.
inline constexpr int64_t kFlashMaxHead = 256;
// RoPE's inverse frequencies travel as a kernel argument: rot / 2 at most this.
inline constexpr int64_t kRopeMaxHalf = 256;

void rmsnorm_forward(cudaStream_t s, void* out, float* stats, const void* inp, const void* weight,
                     float eps, DType t, int64_t N, int64_t C);
void rmsnorm_backward(cudaStream_t s, void* dinp, void* dweight, const void* dout, const void* inp,
                      const void* weight, const float* stats, DType t, int64_t N, int64_t C);
void head_rmsnorm_forward(cudaStream_t s, void* out, float* stats, const QkvRows& in,
                          const void* weight, float eps, DType t, int64_t N, int64_t NH,
                          int64_t KVH, int64_t HS);
void head_rmsnorm_backward(cudaStream_t s, void* dqkv, int64_t grad_row, void* dweight,
                           const QkvRows& in, const void* weight, const float* stats, DType t,
                           int64_t N, int64_t NH, int64_t KVH, int64_t HS);
// inv_freq: rot / 2 values in host memory (copied into the launch's arguments).
void rope(cudaStream_t s, bool forward, void* x, const float* inv_freq, float mscale, DType t,
          int64_t B, int64_t T, int64_t row, int64_t n_heads, int64_t HS, int64_t rot);
void swiglu_forward(cudaStream_t s, void* out, const void* gate, const void* up, DType t, int64_t n);
void swiglu_backward(cudaStream_t s, void* dgate_up, const void* dout, const void* gate,
                     const void* up, DType t, int64_t N, int64_t F);
void gate_mul_forward(cudaStream_t s, void* out, const void* x, const void* g, DType t, int64_t N,
                      int64_t C);
void gate_mul_backward(cudaStream_t s, void* dx, void* dg, const void* dout, const void* x,
                       const void* g, DType t, int64_t N, int64_t C);
void flash_attention_forward(cudaStream_t s, void* out, float* lse, const QkvRows& in, DType t,
                             const AttnDims& a, float p, uint64_t key);
void flash_attention_backward(cudaStream_t s, void* dqkv, float* dq_acc, float* dsum,
                              const void* dout, const QkvRows& in, const void* out,
                              const float* lse, DType t, const AttnDims& a, float p, uint64_t key);

// ---- Mixture of experts (kernels_moe.cu), as cpu_kernels.hpp's moe_* ------------------------------
// offsets (E + 1), bad (one counter), dprob_all (E) and psum (E): device memory. The dispatched
// rows are ordered by expert, then token, then slot.
inline constexpr int64_t kMoeMaxExperts = 1024;  // cpu::kMaxExperts
inline constexpr int64_t kMoeMaxTopK = 16;

void moe_route_forward(cudaStream_t s, float* probs, ExpertIdx idx, float* weights,
                       const void* logits, DType t, int64_t N, int64_t E, int64_t K,
                       bool renormalize);
void moe_route_backward(cudaStream_t s, void* dlogits, DType t, const float* dweights,
                        const float* probs, ExpertIdx idx, const float* dprob_all, int64_t N,
                        int64_t E, int64_t K, bool renormalize);
// offsets[e] = the first row of expert e, offsets[E] = N K; *bad = the indices outside [0, E).
void moe_offsets(cudaStream_t s, int64_t* offsets, int64_t* bad, ExpertIdx idx, int64_t N,
                 int64_t K, int64_t E);
// psum[e] = the sum of probs[:, e] in double.
void moe_psum(cudaStream_t s, double* psum, const float* probs, int64_t N, int64_t E);
void moe_dispatch(cudaStream_t s, void* xe, const void* in, ExpertIdx idx, const int64_t* offsets,
                  DType t, int64_t N, int64_t K, int64_t E, int64_t C);
void moe_dispatch_backward(cudaStream_t s, void* din, const void* dxe, ExpertIdx idx,
                           const int64_t* offsets, DType t, int64_t N, int64_t K, int64_t E,
                           int64_t C);
void moe_combine(cudaStream_t s, void* out, const void* ye, const float* weights, ExpertIdx idx,
                 const int64_t* offsets, DType t, int64_t N, int64_t K, int64_t E, int64_t C);
void moe_combine_backward(cudaStream_t s, void* dye, float* dweights, const void* dout,
                          const void* ye, const float* weights, ExpertIdx idx,
                          const int64_t* offsets, DType t, int64_t N, int64_t K, int64_t E,
                          int64_t C);

}  // namespace zp::runtime::cuda
