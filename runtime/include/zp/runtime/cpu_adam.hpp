// zp/runtime/cpu_adam.hpp: the CPU Adam/AdamW step of ZeRO-Offload, fused into one pass per
// element (unscale, clip, moments, master weight, 16-bit copy out), plus the gradient
// sum-of-squares pass for the global norm. AVX-512 / AVX2 / scalar, chosen at run time.
// Not an optimizer object: no state, no allocation; the caller owns every buffer.
//
// Example usage (one offloaded step, fp16 gradients from the device, fp16 params back):
//
//   using namespace zp::runtime;
//   AdamConfig cfg{.lr = 1e-3, .weight_decay = 0.01};          // AdamW, bias correction on
//   const GradSumSquares ss = grad_sum_squares(grads16, DType::fp16, n);
//   if (!ss.finite) { /* fp16 overflow: skip the step, lower the loss scale */ }
//   const double inv_scale = 1.0 / loss_scale;
//   AdamStepArgs step{.step = t, .inv_loss_scale = inv_scale,
//                     .clip_coef = clip_coefficient(ss.sum_sq, inv_scale, max_norm)};
//   AdamTensors ts{.n = n, .master = master, .exp_avg = m, .exp_avg_sq = v,
//                  .grads = grads16, .grad_dtype = DType::fp16,
//                  .param_out = params16, .param_out_dtype = DType::fp16};
//   cpu_adam_step(cfg, step, ts);                              // logs the ISA once
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "zp/runtime/dtype.hpp"

namespace zp::runtime {

// Hyperparameters, as PyTorch and DeepSpeed spell them (doubles, as in their configs; the
// kernel rounds the derived per-step constants to fp32 once per step).
struct AdamConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw = true;            // true: decoupled decay p *= 1 - lr*wd (Loshchilov & Hutter)
                                // false: L2, g += wd*p (torch.optim.Adam's weight_decay)
  bool bias_correction = true;  // false: step size lr, no sqrt(1 - beta2^t) (DeepSpeed's flag)
};

// What changes from step to step.
struct AdamStepArgs {
  int64_t step = 1;             // t, 1-based: this is the t-th update of these moments
  double inv_loss_scale = 1.0;  // 1 / loss scale (fp16 loss scaling), applied to every grad
  double clip_coef = 1.0;       // global-norm clipping factor, see clip_coefficient()
};

// Caller-owned buffers of one contiguous partition (n elements each). Moments are updated in
// place; the master weights too; param_out (optional) receives the 16-bit copy for the device.
struct AdamTensors {
  std::size_t n = 0;
  float* master = nullptr;             // (n) fp32 master weights
  void* exp_avg = nullptr;             // (n) first moment m, moment_dtype
  void* exp_avg_sq = nullptr;          // (n) second moment v, moment_dtype
  DType moment_dtype = DType::fp32;    // fp32, or bf16 to halve optimizer memory
  const void* grads = nullptr;         // (n) gradients as they arrive, still loss-scaled
  DType grad_dtype = DType::fp32;      // fp32, fp16 or bf16
  void* param_out = nullptr;           // (n) 16-bit copy of the new master, or nullptr
  DType param_out_dtype = DType::fp16; // fp16 or bf16 (ignored when param_out is nullptr)
};

// One Adam/AdamW step over all n elements (OpenMP over chunks, vector ISA from
// cpu_adam_isa()). Per element, with g the loaded gradient:
//   g *= inv_loss_scale * clip_coef;  g += l2 * p                    (l2 = wd for Adam, else 0)
//   m = b1*m + (1-b1)*g;   v = b2*v + (1-b2)*g*g
//   p = p*decay - (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)           (decay = 1 - lr*wd for AdamW)
// with bc1 = 1 - b1^t, bc2 = 1 - b2^t (Kingma & Ba 2015, Algorithm 1; both 1 without bias
// correction); then param_out = round-to-nearest-even(p). Throws zp::Error on a bad argument.
void cpu_adam_step(const AdamConfig& cfg, const AdamStepArgs& step, const AdamTensors& ts);

// Global norm support. sum_sq = sum of g_i^2 over the raw (still loss-scaled) gradients,
// accumulated in double: every square of an fp32/fp16/bf16 value is exact in double and the
// sum of 2^64 of them cannot overflow, so sum_sq is finite exactly when every g_i is.
// finite == false is fp16 overflow (an inf or NaN gradient): skip the step.
struct GradSumSquares {
  double sum_sq = 0.0;
  bool finite = true;
};
GradSumSquares grad_sum_squares(const void* grads, DType grad_dtype, std::size_t n);

// The clipping factor of torch.nn.utils.clip_grad_norm_: with the true (unscaled) norm
// norm = sqrt(sum_sq) * inv_loss_scale, clip_coef = min(1, max_norm / (norm + 1e-6)).
// sum_sq is the total over every partition (add the grad_sum_squares of each, all-reduce).
double clip_coefficient(double sum_sq, double inv_loss_scale, double max_norm);

// Instruction sets with a kernel. cpu_supports() asks the CPU (and OS) via cpuid.
// avx512bf16: the avx512 kernels with AVX-512 BF16 (and DQ) for their bf16 stores.
enum class CpuIsa : uint8_t { scalar, avx2, avx512, avx512bf16 };
std::string_view to_string(CpuIsa isa);
bool cpu_supports(CpuIsa isa);

// The ISA cpu_adam_step and grad_sum_squares use: the forced one if any, else the best the
// CPU supports (avx512bf16 > avx512 > avx2 > scalar; avx2 means AVX2+FMA+F16C, avx512 adds
// AVX-512F and AVX-512BW, avx512bf16 adds AVX512_BF16 and AVX512DQ).
// The first automatic choice is logged once to stderr.
CpuIsa cpu_adam_isa();
// Force an ISA (tests, benchmarks), or std::nullopt to go back to automatic. Throws
// zp::Error when this CPU cannot run it.
void force_cpu_adam_isa(std::optional<CpuIsa> isa);

// How the vector kernels write master, moments and the 16-bit copy: cached (ordinary stores),
// streaming (non-temporal ones for every array), streaming_copy (ordinary stores for master and
// the moments, non-temporal ones for the 16-bit copy, which the step writes without reading),
// or automatic: streaming_copy for fp32 moments on AMD CPUs, cached otherwise (cpu_adam.cpp
// says what was measured). Forced for tests and benchmarks; the results are the same bits.
enum class CpuAdamStores : uint8_t { automatic, cached, streaming, streaming_copy };
void force_cpu_adam_stores(CpuAdamStores stores);

// Whether the vector kernels prefetch ahead with instructions of their own (software) or leave
// every array to the CPU's hardware prefetchers (hardware). automatic: on AMD CPUs hardware for
// fp32 moments and for the avx512bf16 kernels' bf16 moments, software otherwise (cpu_adam.cpp
// says what was measured); forced either way for tests and benchmarks. The results are the
// same bits.
enum class CpuAdamPrefetch : uint8_t { automatic, software, hardware };
void force_cpu_adam_prefetch(CpuAdamPrefetch prefetch);
// What a step on these kernels with moments of this dtype uses now (the forced kind, or the
// automatic choice); never automatic.
CpuAdamPrefetch cpu_adam_prefetch(CpuIsa isa, DType moment_dtype);
std::string_view to_string(CpuAdamPrefetch prefetch);
// The stores a step with moments of this dtype uses now (the forced kind, or the automatic
// choice); never automatic.
CpuAdamStores cpu_adam_stores(DType moment_dtype);
std::string_view to_string(CpuAdamStores stores);

// The same two kernels on an explicit ISA, ignoring the forced one (throws if unsupported).
void cpu_adam_step(CpuIsa isa, const AdamConfig& cfg, const AdamStepArgs& step,
                   const AdamTensors& ts);
GradSumSquares grad_sum_squares(CpuIsa isa, const void* grads, DType grad_dtype,
                                std::size_t n);

}  // namespace zp::runtime
