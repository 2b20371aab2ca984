// cpu_adam_kernels.hpp (internal): what every ISA's CPU Adam kernel shares: the per-step
// constants, the one-element update that is the scalar reference (and every vector tail), and
// the kernel tables keyed by (grad dtype, moment dtype, param-out dtype), as DeepSpeed's.
// Not public API and not a place for threading: kernels run on [begin, end) of one thread.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "zp/runtime/cpu_adam.hpp"
#include "zp/runtime/dtype.hpp"

namespace zp::runtime::detail {

// Per-step constants, derived in double from AdamConfig/AdamStepArgs, rounded to fp32 once.
struct AdamCoeffs {
  float grad_scale;     // inv_loss_scale * clip_coef
  float l2;             // Adam: weight_decay (g += wd*p); AdamW: 0
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float neg_step_size;  // -lr / (1 - beta1^t)      (-lr without bias correction)
  float inv_sqrt_bc2;   // 1 / sqrt(1 - beta2^t)    (1 without bias correction)
  float eps;
  float decay;          // AdamW: 1 - lr*wd; Adam: 1
  float m_scale;        // l2 = 0: (1 - beta1) * grad_scale
  float v_scale;        // l2 = 0: (1 - beta2) * grad_scale^2
};

// The fused update of one element, in fp32. Every vector body performs exactly these
// operations in this order (same fmas, IEEE sqrt and division), so vector and scalar results
// are bit-identical; the sources are built with -ffp-contract=off so that the compiler adds
// no fma of its own. With l2 = 0 (AdamW, or Adam without weight decay) the gradient does not
// see p, as in torch's AdamW (where an inf or NaN parameter leaves the moments finite), and
// its scale sits in the moments' coefficients: one multiply and one fma fewer per element than
// the coupled form, whose Adam L2 term needs the scaled gradient (bench_cpu_adam's compute
// floors 1.02-1.31x lower with it, 1.12-1.31x on AVX2: old/new medians of three interleaved
// rounds at 2^24 on the Zen 4 VM; the memory-bound steps the same within noise).
// ZP_HD: the CUDA Adam (runtime/src/cuda/kernels.cu, built with --fmad=false) runs this too.
ZP_HD inline void adam_element(const AdamCoeffs& c, float g, float& p, float& m, float& v) {
  if (c.l2 == 0.0f) {
    m = std::fma(c.beta1, m, c.m_scale * g);
    v = std::fma(c.beta2, v, (c.v_scale * g) * g);
  } else {
    g = g * c.grad_scale;
    g = std::fma(c.l2, p, g);
    m = std::fma(c.beta1, m, c.one_minus_beta1 * g);
    v = std::fma(c.beta2, v, (c.one_minus_beta2 * g) * g);
  }
  const float denom = std::fma(std::sqrt(v), c.inv_sqrt_bc2, c.eps);
  p = std::fma(c.neg_step_size, m / denom, p * c.decay);
}

// The per-step constants of a step and the argument checks (zp::Error), as cpu_adam_step
// applies them; the CUDA Adam shares them.
AdamCoeffs adam_coeffs(const AdamConfig& cfg, const AdamStepArgs& step);
void check_adam_args(const AdamConfig& cfg, const AdamStepArgs& step, const AdamTensors& ts);

// Typed element access for the kernels (dtype.hpp's exact conversions).
template <DType T>
inline float load_elem(const void* base, std::size_t i) {
  return load_as_f32(base, i, T);
}
template <DType T>
inline void store_elem(void* base, std::size_t i, float x) {
  store_from_f32(base, i, T, x);
}

// The 16-bit output, or none.
enum class ParamOut : uint8_t { none, fp16, bf16 };
constexpr DType param_out_dtype(ParamOut p) { return p == ParamOut::bf16 ? DType::bf16 : DType::fp16; }

// The scalar tail every vector kernel ends with: the scalar reference, element by element.
template <DType G, DType M, ParamOut P>
inline void adam_scalar_range(const AdamCoeffs& c, const AdamTensors& t, std::size_t begin,
                              std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) {
    float p = t.master[i];
    float m = load_elem<M>(t.exp_avg, i);
    float v = load_elem<M>(t.exp_avg_sq, i);
    adam_element(c, load_elem<G>(t.grads, i), p, m, v);
    t.master[i] = p;
    store_elem<M>(t.exp_avg, i, m);
    store_elem<M>(t.exp_avg_sq, i, v);
    if constexpr (P != ParamOut::none) store_elem<param_out_dtype(P)>(t.param_out, i, p);
  }
}

// Sum of squares in double, element by element (the scalar reference and the vector tails).
template <DType G>
inline double sum_squares_scalar_range(const void* g, std::size_t begin, std::size_t end) {
  double acc = 0.0;
  for (std::size_t i = begin; i < end; ++i) {
    const double x = load_elem<G>(g, i);
    acc += x * x;  // exact: a float squared has at most 48 significant bits
  }
  return acc;
}

// How a vector body writes master, moments and param_out. cached: ordinary stores (the line is
// read for ownership first, if it is not already cached, and stays in cache for whoever reads
// it next). streaming: non-temporal stores, whole lines written to memory through the
// write-combining buffers, bypassing the cache (only when forced: force_cpu_adam_stores).
// streaming_copy: ordinary stores for master and the moments, which the step has just read,
// and non-temporal ones for the 16-bit copy, which it only writes: no read for ownership of
// the copy's lines (2 of the step's 28 bytes a parameter would be 4). cpu_adam.cpp picks
// (with what was measured). Only the store instruction differs, never the value: every kind
// gives bit-identical results.
enum class Stores : uint8_t { cached, streaming, streaming_copy };
constexpr bool streams_state(Stores s) { return s == Stores::streaming; }  // master, moments
constexpr bool streams_copy(Stores s) { return s != Stores::cached; }      // param_out

// Whether a vector body issues its own prefetches (software: prefetch_block_ahead, below) or
// leaves every array to the hardware prefetchers (hardware). Only the prefetch instructions
// differ, never the value. cpu_adam_step picks per CPU and moment dtype (prefetch_for there).
enum class Prefetch : uint8_t { software, hardware };

// With Prefetch::software the vector bodies prefetch every line of master and both moments
// ahead of the block they step, and with bf16 moments the gradient's and the 16-bit copy's
// lines too (cpu_adam_prefetch.hpp; otherwise the gradient and the copy are left to the
// hardware prefetchers); with Prefetch::hardware none (cpu_adam.cpp picks: on AMD CPUs the
// fp32-moment steps, and the AVX-512 BF16 bf16-moment ones, run without, up to 1.30x faster on
// the Zen 4 VM; its fp32-moment figures below came from a harness whose arrays sat (128 MiB +
// 4,160 bytes) x k apart, a layout that held one thread's streams at ~28 GB/s against ~52 in
// separate mappings: README, Benchmarks, item 15). Where to and how far, per variant:
// - bf16 moments: into L1 (prefetcht0), 1024 elements ahead: 1.04-1.22x over the hardware
//   prefetchers alone on a Zen 4 VM (bench_cpu_adam, cached stores, same-run A/B), and on a
//   16-core Xeon with AVX-512 BF16 and FP16 1.14-1.35x at 2-16 threads (a harness timing the
//   AVX-512 bodies alone at 2^25, 9 interleaved rounds); into L2 2048 ahead instead ran the
//   Zen 4 VM's bf16-moment step 0.86x (AVX-512F) and 0.96x (AVX-512 BF16). The gradient's and
//   the copy's lines as well (the step nearest its compute floor; a likely reason, not
//   measured: the hardware's prefetchers fall behind there): 1.01-1.08x with AVX2 (ten runs of
//   11 rounds, median 1.04x), 1.00-1.03x with AVX-512F, 1.00-1.02x with AVX-512 BF16 on the
//   Zen 4 VM (old and new in one process, 2^25, two threads, per-round ratios); in cache (one
//   thread, 16K elements) 0.996x, 0.976x, 1.02x. With all five streams 512 ahead the AVX2 step
//   ran as at 1024 (0.99-1.01x), 2048 ahead 0.93x, 2048 ahead into L2 0.90-0.95x (README,
//   Benchmarks, item 14).
// - fp32 moments, whatever the gradient: into L2 (prefetcht2), 2048 elements ahead. For fp32
//   gradients, into L1 1024 ahead cost our fp32 AdamW 1.14x on the Zen 4 VM (0.876x, that
//   harness at 2 threads; found as 0.59-0.81x DeepSpeed's Step_8 speed beside it) while the
//   Xeon gained 1.07-1.15x at 2-8 threads; into L2 2048 ahead: Zen 4 1.01x, Xeon 1.09x, 1.15x,
//   1.09x at 2, 4, 8 threads (the same runs). The runtime's kernels with and without it, in one
//   process: Xeon 1.02-1.11x at 2-16 threads on every ISA, Zen 4 0.93-0.99x (README,
//   Benchmarks, item 7). For 16-bit gradients (the offload steps), L2 2048 ahead against L1
//   1024 ahead on the Zen 4 VM, both in one process, 2^25, 2 threads, per-round ratios of 15
//   interleaved rounds, two runs: fp16 gradients 1.06x/1.10x (AVX2), 1.05x/1.04x (AVX-512F),
//   1.14x/1.09x (AVX-512 BF16); bf16 gradients 1.11x/1.09x, 1.08x/1.06x, 1.02x/1.11x (README,
//   Benchmarks, item 11). A likely reason, not measured: three fp32 streams fetched 4 KiB ahead
//   into an L1 of 32-48 KiB evict lines before they are used; L2 (1-2 MiB a core) holds them.
template <DType G, DType M>
inline constexpr bool kPrefetchToL2 = M == DType::fp32;
template <DType G, DType M>
inline constexpr std::size_t kPrefetchElems = kPrefetchToL2<G, M> ? 2048 : 1024;

// Elements from p to the next multiple of align_bytes (p must be element-aligned).
template <typename T>
inline std::size_t elems_to_alignment(const T* p, std::size_t align_bytes) {
  const std::size_t mis = reinterpret_cast<uintptr_t>(p) % align_bytes;
  return mis == 0 ? 0 : (align_bytes - mis) / sizeof(T);
}

// Whether every array a streaming body of width floats writes at element i (master, moments,
// param_out) sits on a vector boundary: non-temporal vector stores need aligned addresses.
template <DType M, ParamOut P>
inline bool streaming_aligned(const AdamTensors& t, std::size_t i, std::size_t width) {
  auto on = [](const void* base, std::size_t byte_offset, std::size_t align) {
    return (reinterpret_cast<uintptr_t>(base) + byte_offset) % align == 0;
  };
  const std::size_t mb = dtype_bytes(M);
  return on(t.master, i * 4, width * 4) && on(t.exp_avg, i * mb, width * mb) &&
         on(t.exp_avg_sq, i * mb, width * mb) &&
         (P == ParamOut::none || on(t.param_out, i * 2, width * 2));
}

// Where a vector body of kBlock-element blocks and width-float vectors starts for stores of
// kind `stores` on [begin, end), after a scalar head [begin, start), and the kind it can use
// there. streaming: the head runs up to master's block boundary and the body streams if every
// written array is on its vector boundary there; streaming_copy: up to the copy's 64-byte line
// boundary (a block writes 64 bytes of it: whole lines), given a copy at all on 2-byte
// alignment and, for 16-bit gradients, the copy at the gradients' offset within a 64-byte line
// (else each block's gradient loads straddle a line whose low 12 address bits match the line
// the block before streamed out: the offload steps ran 0.81x on the Zen 4 VM with the copy 2
// bytes past the gradients modulo 4 KiB; cpu_adam.cpp). Otherwise, or where alignment cannot be
// had: cached stores (still correct, not streamed).
struct BodyStart {
  std::size_t start;
  Stores stores;
};
template <DType M, ParamOut P>
inline BodyStart body_start(const AdamTensors& t, std::size_t begin, std::size_t end,
                            Stores stores, std::size_t block, std::size_t width) {
  if (stores == Stores::streaming) {
    const std::size_t head =
        std::min(end, begin + elems_to_alignment(t.master + begin, block * sizeof(float)));
    return {head, streaming_aligned<M, P>(t, head, width) ? Stores::streaming : Stores::cached};
  }
  const auto copy = reinterpret_cast<uintptr_t>(t.param_out);
  if (stores == Stores::streaming_copy && P != ParamOut::none && copy % 2 == 0 &&
      (t.grad_dtype == DType::fp32 || (copy - reinterpret_cast<uintptr_t>(t.grads)) % 64 == 0)) {
    const auto* out = static_cast<const uint16_t*>(t.param_out);
    return {std::min(end, begin + elems_to_alignment(out + begin, 64)), Stores::streaming_copy};
  }
  return {begin, Stores::cached};
}

using AdamKernel = void (*)(const AdamCoeffs&, const AdamTensors&, std::size_t, std::size_t,
                            Stores, Prefetch);
using SumSquaresKernel = double (*)(const void*, std::size_t, std::size_t);

// Index order: [grad dtype: fp32, fp16, bf16][moments: fp32, bf16][param out: none, fp16, bf16].
struct KernelTable {
  AdamKernel adam[3][2][3];
  SumSquaresKernel sum_squares[3];
  std::size_t block_elems;  // width * unroll of the vector body (1 for scalar)
};

// Fill a KernelTable from kernel templates K<G, M, P> and S<G>.
#define ZP_ADAM_ROW(K, G)                                                                    \
  {{K<G, DType::fp32, ParamOut::none>, K<G, DType::fp32, ParamOut::fp16>,                    \
    K<G, DType::fp32, ParamOut::bf16>},                                                      \
   {K<G, DType::bf16, ParamOut::none>, K<G, DType::bf16, ParamOut::fp16>,                    \
    K<G, DType::bf16, ParamOut::bf16>}}
#define ZP_KERNEL_TABLE(K, S, BLOCK)                                                         \
  KernelTable {                                                                              \
    {ZP_ADAM_ROW(K, DType::fp32), ZP_ADAM_ROW(K, DType::fp16), ZP_ADAM_ROW(K, DType::bf16)}, \
        {S<DType::fp32>, S<DType::fp16>, S<DType::bf16>}, BLOCK                              \
  }

// One table per ISA (defined in cpu_adam.cpp, cpu_adam_avx2.cpp, cpu_adam_avx512.cpp: the
// last holds both AVX-512 tables).
extern const KernelTable kScalarTable;
extern const KernelTable kAvx2Table;
extern const KernelTable kAvx512Table;
extern const KernelTable kAvx512Bf16Table;

}  // namespace zp::runtime::detail
