// cpu_adam.cpp: the CPU Adam entry points: argument checks, per-step constants, the ISA
// choice (cpuid, logged once, or forced), OpenMP over per-thread ranges, and the scalar
// kernels that are the reference. Not the vector bodies (cpu_adam_avx2.cpp, _avx512.cpp).
#include "zp/runtime/cpu_adam.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>

#include "cpu_adam_kernels.hpp"
#include "zp/checked.hpp"
#include "zp/error.hpp"

namespace zp::runtime {
namespace detail {
namespace {

// The reference stores element by element through the cache whatever the store kind.
template <DType G, DType M, ParamOut P>
void adam_scalar(const AdamCoeffs& c, const AdamTensors& t, std::size_t begin, std::size_t end,
                 Stores, Prefetch) {
  adam_scalar_range<G, M, P>(c, t, begin, end);
}

template <DType G>
double sum_squares_scalar(const void* g, std::size_t begin, std::size_t end) {
  return sum_squares_scalar_range<G>(g, begin, end);
}

}  // namespace

const KernelTable kScalarTable = ZP_KERNEL_TABLE(adam_scalar, sum_squares_scalar, 1);

}  // namespace detail

namespace {

using detail::AdamCoeffs;
using detail::KernelTable;

// Below this many elements a step runs on the calling thread (an OpenMP fork costs a few
// microseconds; 32K elements of an fp16 offload step move ~1 MB, tens of microseconds).
constexpr std::size_t kParallelMinElems = std::size_t{1} << 15;
// Thread ranges start on multiples of 64 elements: whole cache lines of fp32 and 16-bit
// arrays (no false sharing on the outputs) and whole vector blocks (32 elements).
constexpr std::size_t kRangeAlignElems = 64;

struct Range {
  std::size_t begin, end;
};

// Thread t's contiguous share of n elements: ceil(n / n_threads) rounded up to the alignment.
Range thread_range(std::size_t n, int n_threads, int t) {
  std::size_t per = partition_elems(n, static_cast<std::size_t>(n_threads));
  per = partition_elems(per, kRangeAlignElems) * kRangeAlignElems;
  const std::size_t begin = std::min(n, per * static_cast<std::size_t>(t));
  return {begin, std::min(n, begin + per)};
}

bool detect(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::scalar: return true;
    case CpuIsa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case CpuIsa::avx512:
      return detect(CpuIsa::avx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw");
    case CpuIsa::avx512bf16:
      return detect(CpuIsa::avx512) && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512bf16");
  }
  return false;
}

bool on_amd() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

// The automatic prefetch (CpuAdamPrefetch::automatic): on AMD CPUs the fp32-moment steps, and
// the bf16-moment steps of the AVX-512 BF16 kernels, leave every array to the hardware
// prefetchers; every other step, and every step elsewhere, prefetches master and the moments
// itself (kPrefetchToL2 and kPrefetchElems in cpu_adam_kernels.hpp: where to and how far).
// Measured on the Zen 4 VM (AVX-512 BF16 kernels, old and new in one process, per-round ratios
// of 9 interleaved rounds, 2^25 elements, arrays in separate 2 MiB-page mappings as
// bench_cpu_adam allocates them): without the prefetches, one thread (memory at ~50 GB/s a
// core) 1.22-1.30x faster for fp32 AdamW, 1.13x and 1.07-1.12x for the fp16 and bf16 offload
// steps, the step then at 98-101% of the best stream against 79-89% with them; two threads at
// ~55 GB/s 1.01-1.05x, at 93-102 GB/s 1.10-1.26x (bench_cpu_adam's paired rounds). AVX-512F and
// AVX2 alike (1.28x and 1.24x for fp32 at one thread). With bf16 moments, without them AVX2 ran
// 0.89x (one thread) and 0.97x (two) and AVX-512F 0.97-0.98x and 1.00-1.01x, so those keep
// theirs; AVX-512 BF16 ran 1.04-1.06x and 1.01-1.05x in the harness and 1.01-1.04x in all seven
// of bench_cpu_adam's paired runs that timed it (the step nearest its compute floor keeps
// needing them; the AVX-512 BF16 one, with a single instruction for its bf16 stores, does not).
// On a Xeon the fp32-moment prefetch into L2 gained 1.02-1.11x at 2-16 threads (kPrefetchToL2's
// comment), so other CPUs keep it. README, Benchmarks, item 15.
CpuAdamPrefetch automatic_prefetch(CpuIsa isa, DType moments) {
  const bool hw = on_amd() && (moments == DType::fp32 || isa == CpuIsa::avx512bf16);
  return hw ? CpuAdamPrefetch::hardware : CpuAdamPrefetch::software;
}

// The automatic stores (CpuAdamStores::automatic): on AMD CPUs, for fp32 moments, non-temporal
// ones for the 16-bit copy and ordinary ones for everything else; otherwise ordinary ones
// throughout. Non-temporal stores for every array ran the fused step 1.4-3.0x slower at 2^26
// elements on a quiet 16-core Xeon (its non-temporal streams at 26-86% of the best cached one;
// bench_cpu_adam), and on the Zen 4 VM either kind won some runs. For the copy alone, which the
// step writes without reading, they spare the read for ownership of its lines: on the Zen 4 VM
// (2^25, arrays in separate 2 MiB-page mappings, per-round ratios of 3-9 interleaved rounds,
// the runtime's AVX-512 BF16 kernels with either kind in one process) one thread ran the fp16
// and bf16 offload steps 1.03-1.13x faster, two threads 1.02-1.04x at ~55 GB/s and 1.03-1.14x
// at 93-102 GB/s, and the engine's step (fp32 gradients, fp16 copy) 1.09x at one thread and
// 1.10x at two. With bf16 moments they won 1.10-1.16x in some layouts and lost up to 0.67x in
// others (the copy's offset modulo 4 KiB from the bf16 gradients' and moments': 64 or 96 bytes
// lost, 32 or 160 won), so bf16 moments keep ordinary stores; for the offload steps only a copy
// not on the gradients' offset within a 64-byte line lost (0.81x, body_start then keeps
// ordinary stores). Not measured on a Xeon, so other CPUs keep ordinary stores. README,
// Benchmarks, item 15.
CpuAdamStores automatic_stores(DType moments) {
  return on_amd() && moments == DType::fp32 ? CpuAdamStores::streaming_copy : CpuAdamStores::cached;
}

std::atomic<int> g_forced_isa{-1};  // -1: automatic, else a CpuIsa
std::atomic<CpuAdamStores> g_stores{CpuAdamStores::automatic};
std::atomic<CpuAdamPrefetch> g_prefetch{CpuAdamPrefetch::automatic};

// The forced kind, or the automatic one.
CpuAdamPrefetch prefetch_for(CpuIsa isa, DType moments) {
  const CpuAdamPrefetch forced = g_prefetch.load(std::memory_order_relaxed);
  return forced != CpuAdamPrefetch::automatic ? forced : automatic_prefetch(isa, moments);
}
CpuAdamStores stores_for(DType moments) {
  const CpuAdamStores forced = g_stores.load(std::memory_order_relaxed);
  return forced != CpuAdamStores::automatic ? forced : automatic_stores(moments);
}

CpuIsa best_isa_logged() {
  static const CpuIsa best = [] {
    const CpuIsa isa = detect(CpuIsa::avx512bf16) ? CpuIsa::avx512bf16
                       : detect(CpuIsa::avx512)   ? CpuIsa::avx512
                       : detect(CpuIsa::avx2)     ? CpuIsa::avx2
                                                  : CpuIsa::scalar;
    fmt::print(stderr,
               "zp::runtime: CPU Adam uses {} kernels ({} OpenMP threads; fp32 moments "
               "prefetched by {}, bf16 moments by {}; {} stores for the 16-bit copy "
               "with fp32 moments{})\n",
               to_string(isa), omp_get_max_threads(),
               to_string(automatic_prefetch(isa, DType::fp32)),
               to_string(automatic_prefetch(isa, DType::bf16)),
               automatic_stores(DType::fp32) == CpuAdamStores::streaming_copy ? "non-temporal"
                                                                              : "ordinary",
               on_amd() ? ": an AMD CPU" : "");
    return isa;
  }();
  return best;
}

const KernelTable& table(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::avx512bf16: return detail::kAvx512Bf16Table;
    case CpuIsa::avx512: return detail::kAvx512Table;
    case CpuIsa::avx2: return detail::kAvx2Table;
    default: return detail::kScalarTable;
  }
}

void require_supported(CpuIsa isa) {
  if (!cpu_supports(isa))
    throw Error(fmt::format("CPU Adam: this CPU cannot run the {} kernels", to_string(isa)),
                fmt::format("use cpu_adam_isa() (here: {}) or force a lower ISA",
                            to_string(best_isa_logged())));
}

void require(bool ok, std::string_view what, std::string_view hint) {
  if (!ok) throw Error(fmt::format("CPU Adam: {}", what), std::string(hint));
}

void check_args(const AdamConfig& cfg, const AdamStepArgs& s, const AdamTensors& t) {
  require(std::isfinite(cfg.lr) && cfg.lr >= 0, fmt::format("lr must be finite and >= 0, got {}", cfg.lr),
          "pass a learning rate such as 1e-3");
  require(cfg.beta1 >= 0 && cfg.beta1 < 1, fmt::format("beta1 must be in [0, 1), got {}", cfg.beta1),
          "the usual value is 0.9");
  require(cfg.beta2 >= 0 && cfg.beta2 < 1, fmt::format("beta2 must be in [0, 1), got {}", cfg.beta2),
          "the usual value is 0.999");
  require(std::isfinite(cfg.eps) && cfg.eps >= 0, fmt::format("eps must be finite and >= 0, got {}", cfg.eps),
          "the usual value is 1e-8");
  require(std::isfinite(cfg.weight_decay) && cfg.weight_decay >= 0,
          fmt::format("weight_decay must be finite and >= 0, got {}", cfg.weight_decay),
          "pass 0 for no decay, e.g. 0.01 for AdamW");
  require(s.step >= 1, fmt::format("step must be >= 1 (1-based), got {}", s.step),
          "the first update of a parameter is step 1");
  require(std::isfinite(s.inv_loss_scale) && s.inv_loss_scale > 0,
          fmt::format("inv_loss_scale must be finite and > 0, got {}", s.inv_loss_scale),
          "pass 1 / loss_scale, or 1 without loss scaling");
  require(std::isfinite(s.clip_coef) && s.clip_coef > 0,
          fmt::format("clip_coef must be finite and > 0, got {}", s.clip_coef),
          "use clip_coefficient(); a non-finite gradient norm means: skip the step");
  if (t.n == 0) return;
  require(t.master && t.exp_avg && t.exp_avg_sq && t.grads,
          "master, exp_avg, exp_avg_sq and grads must all be non-null when n > 0",
          "pass the caller-owned buffers of the partition");
  require(t.moment_dtype != DType::fp16, "moments cannot be fp16 (v = g^2 underflows)",
          "use fp32 moments, or bf16 to halve their memory");
  require(!t.param_out || t.param_out_dtype != DType::fp32,
          "param_out must be a 16-bit type (fp16 or bf16)",
          "the fp32 copy is the master itself; pass param_out = nullptr for none");
}

// Per-step constants in double (as PyTorch computes them in Python), rounded to fp32 once.
AdamCoeffs coeffs(const AdamConfig& cfg, const AdamStepArgs& s) {
  const double t = static_cast<double>(s.step);
  const double bc1 = cfg.bias_correction ? 1.0 - std::pow(cfg.beta1, t) : 1.0;
  const double bc2 = cfg.bias_correction ? 1.0 - std::pow(cfg.beta2, t) : 1.0;
  AdamCoeffs c{};
  c.grad_scale = static_cast<float>(s.inv_loss_scale * s.clip_coef);
  c.l2 = cfg.adamw ? 0.0f : static_cast<float>(cfg.weight_decay);
  c.beta1 = static_cast<float>(cfg.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - cfg.beta1);
  c.beta2 = static_cast<float>(cfg.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - cfg.beta2);
  c.neg_step_size = static_cast<float>(-cfg.lr / bc1);
  // bc2 > 0 for t >= 1 and beta2 < 1, unless beta2^t rounds to 1 (beta2 within 1e-16 of 1).
  require(bc2 > 0, fmt::format("1 - beta2^t is 0 (beta2 = {}, t = {})", cfg.beta2, s.step),
          "beta2 is too close to 1 for bias correction");
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = static_cast<float>(cfg.eps);
  c.decay = cfg.adamw ? static_cast<float>(1.0 - cfg.lr * cfg.weight_decay) : 1.0f;
  // The decoupled form's coefficients (adam_element with l2 = 0), the gradient scale folded in
  // in double. (1 - beta2) * scale^2 is a normal fp32 while scale > 1.1e-19 / sqrt(1 - beta2):
  // 3.4e-18 at beta2 = 0.999, i.e. a loss scale up to 2^54 with clip_coef >= 0.1 (DeepSpeed's
  // dynamic loss scale stays at or below 2^32); below that it keeps fewer bits.
  const double scale = s.inv_loss_scale * s.clip_coef;
  c.m_scale = static_cast<float>((1.0 - cfg.beta1) * scale);
  c.v_scale = static_cast<float>((1.0 - cfg.beta2) * scale * scale);
  return c;
}

std::size_t moment_index(DType t) { return t == DType::bf16 ? 1 : 0; }
std::size_t param_out_index(const AdamTensors& t) {
  return !t.param_out ? 0 : (t.param_out_dtype == DType::fp16 ? 1 : 2);
}

}  // namespace

namespace detail {
AdamCoeffs adam_coeffs(const AdamConfig& cfg, const AdamStepArgs& step) { return coeffs(cfg, step); }
void check_adam_args(const AdamConfig& cfg, const AdamStepArgs& step, const AdamTensors& ts) {
  check_args(cfg, step, ts);
}
}  // namespace detail

std::string_view to_string(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::avx512: return "avx512";
    case CpuIsa::avx512bf16: return "avx512bf16";
    default: return "scalar";
  }
}

bool cpu_supports(CpuIsa isa) {
  static const bool has_avx2 = detect(CpuIsa::avx2), has_avx512 = detect(CpuIsa::avx512),
                    has_avx512bf16 = detect(CpuIsa::avx512bf16);
  return isa == CpuIsa::scalar || (isa == CpuIsa::avx2 && has_avx2) ||
         (isa == CpuIsa::avx512 && has_avx512) || (isa == CpuIsa::avx512bf16 && has_avx512bf16);
}

CpuIsa cpu_adam_isa() {
  const int forced = g_forced_isa.load(std::memory_order_relaxed);
  return forced >= 0 ? static_cast<CpuIsa>(forced) : best_isa_logged();
}

void force_cpu_adam_isa(std::optional<CpuIsa> isa) {
  if (isa) require_supported(*isa);
  g_forced_isa.store(isa ? static_cast<int>(*isa) : -1, std::memory_order_relaxed);
}

void force_cpu_adam_stores(CpuAdamStores stores) { g_stores.store(stores, std::memory_order_relaxed); }

void force_cpu_adam_prefetch(CpuAdamPrefetch prefetch) {
  g_prefetch.store(prefetch, std::memory_order_relaxed);
}

CpuAdamPrefetch cpu_adam_prefetch(CpuIsa isa, DType moment_dtype) {
  return prefetch_for(isa, moment_dtype);
}

CpuAdamStores cpu_adam_stores(DType moment_dtype) { return stores_for(moment_dtype); }

std::string_view to_string(CpuAdamStores stores) {
  switch (stores) {
    case CpuAdamStores::cached: return "cached";
    case CpuAdamStores::streaming: return "streaming";
    case CpuAdamStores::streaming_copy: return "streaming_copy";
    default: return "automatic";
  }
}

std::string_view to_string(CpuAdamPrefetch prefetch) {
  switch (prefetch) {
    case CpuAdamPrefetch::software: return "software";
    case CpuAdamPrefetch::hardware: return "hardware";
    default: return "automatic";
  }
}

void cpu_adam_step(CpuIsa isa, const AdamConfig& cfg, const AdamStepArgs& step,
                   const AdamTensors& ts) {
  require_supported(isa);
  check_args(cfg, step, ts);
  if (ts.n == 0) return;
  const AdamCoeffs c = coeffs(cfg, step);
  const detail::AdamKernel kernel = table(isa).adam[static_cast<std::size_t>(ts.grad_dtype)]
                                                   [moment_index(ts.moment_dtype)]
                                                   [param_out_index(ts)];
  const CpuAdamStores kind = stores_for(ts.moment_dtype);
  using detail::Stores;
  const Stores stores = kind == CpuAdamStores::streaming        ? Stores::streaming
                        : kind == CpuAdamStores::streaming_copy ? Stores::streaming_copy
                                                                : Stores::cached;
  const detail::Prefetch prefetch = prefetch_for(isa, ts.moment_dtype) == CpuAdamPrefetch::hardware
                                        ? detail::Prefetch::hardware
                                        : detail::Prefetch::software;
  // One contiguous range per thread: the hardware prefetchers see long streams (chunks
  // interleaved between threads measured no faster).
#pragma omp parallel if (ts.n >= kParallelMinElems)
  {
    const Range r = thread_range(ts.n, omp_get_num_threads(), omp_get_thread_num());
    if (r.begin < r.end) kernel(c, ts, r.begin, r.end, stores, prefetch);
  }
}

void cpu_adam_step(const AdamConfig& cfg, const AdamStepArgs& step, const AdamTensors& ts) {
  cpu_adam_step(cpu_adam_isa(), cfg, step, ts);
}

GradSumSquares grad_sum_squares(CpuIsa isa, const void* grads, DType grad_dtype, std::size_t n) {
  require_supported(isa);
  if (n == 0) return {};
  require(grads != nullptr, "grad_sum_squares: grads is null with n > 0",
          "pass the gradient buffer of the partition");
  const detail::SumSquaresKernel kernel =
      table(isa).sum_squares[static_cast<std::size_t>(grad_dtype)];
  double total = 0.0;
  // Each thread sums its range; the partial sums are added in thread order (ordered loop,
  // iteration k runs on thread k), so the result does not depend on scheduling.
#pragma omp parallel if (n >= kParallelMinElems)
  {
    const int n_threads = omp_get_num_threads(), me = omp_get_thread_num();
    const Range r = thread_range(n, n_threads, me);
    const double partial = r.begin < r.end ? kernel(grads, r.begin, r.end) : 0.0;
#pragma omp for ordered schedule(static, 1)
    for (int k = 0; k < n_threads; ++k) {
#pragma omp ordered
      total += partial;
    }
  }
  return {total, std::isfinite(total)};
}

GradSumSquares grad_sum_squares(const void* grads, DType grad_dtype, std::size_t n) {
  return grad_sum_squares(cpu_adam_isa(), grads, grad_dtype, n);
}

double clip_coefficient(double sum_sq, double inv_loss_scale, double max_norm) {
  require(max_norm > 0, fmt::format("clip_coefficient: max_norm must be > 0, got {}", max_norm),
          "gradient clipping needs a positive maximum norm, e.g. 1.0");
  require(std::isfinite(sum_sq), "clip_coefficient: the gradient norm is not finite",
          "a non-finite norm means an inf/NaN gradient: skip this step instead");
  // torch.nn.utils.clip_grad_norm_: clip_coef = max_norm / (total_norm + 1e-6), clamped to 1.
  const double norm = std::sqrt(sum_sq) * inv_loss_scale;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

}  // namespace zp::runtime
