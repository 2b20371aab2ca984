// bench_cpu_adam: the fused CPU Adam step at 2^26 parameters against, in the same run, (1) the
// memory's roofline: the fastest of a family of plain streams that make exactly the step's
// loads and stores (adam_streams.hpp: two vector widths, loads-first or interleaved blocks,
// non-temporal or cached stores, prefetches into L1 or L2), and (2) the same offload work done
// as separate passes (convert, unscale, clip, Adam, cast). Four step variants: fp32 AdamW,
// the ZeRO-Offload step with fp16 or bf16 gradients in and a 16-bit copy out, and bf16 moments.
// Each fused kernel runs on every ISA this CPU has (avx2, avx512). Prints, at the end, each
// kernel's share of the best stream of its variant. Not the PyTorch comparison
// (tools/bench/compare_adam.sh).
//
// Every benchmark checks its answer first (fused: bit-exact against the scalar reference on
// ~4K sampled elements, including thread boundaries and the tail; streams: against their
// scalar meaning); a wrong answer is SkipWithError, not a fast time. Counters: params/s and
// bytes/s (bytes that variant must move per parameter, x params / time) and bytes_per_param.
// ZP_BENCH_ADAM_LOG2 sets the size (default 26; the CTest smoke run uses 20). For less noise
// on a shared machine:
//   build/bin/bench_cpu_adam --benchmark_repetitions=3 --benchmark_enable_random_interleaving=true
// One variant: --benchmark_filter=_fp32/ (or offload_fp16/, offload_bf16/, bf16_moments/).
// paired_<variant>/rounds measures every stream shape and fused kernel of a variant back to back
// in rounds (ZP_BENCH_ADAM_ROUNDS, default 9) and reports each kernel's share of its own round's
// best stream (the steadier figure where the memory's bandwidth drifts within minutes), and its
// arithmetic alone as a share of that roofline (near 100%: compute-bound on this machine), and
// the dispatch's kernel once more with each automatic choice changed (the other prefetch
// kind, CpuAdamPrefetch; for the variants with a 16-bit copy the other store kind for the
// copy, CpuAdamStores), so every run shows what the automatic choices gain here.
#include <benchmark/benchmark.h>
// GCC 12 bug 105593: its AVX-512 conversion intrinsics warn "may be used uninitialized" about
// their own undefined merge source (as in runtime/src/cpu_adam_avx512.cpp): silence only that.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "adam_streams.hpp"
#include "ratio_reporter.hpp"
#include "zp/checked.hpp"
#include "zp/runtime/cpu_adam.hpp"

namespace {

using namespace zp::runtime;
namespace streams = zp::bench::streams;

// ---- buffers ------------------------------------------------------------------------------

// An integer setting from the environment: its default when unset; a value that is not an
// integer in [lo, hi] ends the run with an error naming the variable.
int env_int(const char* name, int fallback, int lo, int hi) {
  const char* env = std::getenv(name);
  if (env == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(env, &end, 10);
  if (end == env || *end != '\0' || errno != 0 || v < lo || v > hi) {
    fmt::print(stderr, "error: {}='{}' is not an integer from {} to {}\n", name, env, lo, hi);
    std::exit(2);
  }
  return static_cast<int>(v);
}

std::size_t n_params() { return std::size_t{1} << env_int("ZP_BENCH_ADAM_LOG2", 26, 10, 32); }

// n elements in anonymous memory with transparent huge pages requested (as the runtime's arena
// will be), starting `skew` x 4160 bytes (65 lines) past a 2 MiB boundary; pages are first
// touched by the OpenMP threads in fill(). The skew: buffers of 2^25 or 2^26 elements are
// multiples of 128 MiB apart when each starts on a 2 MiB boundary, and on the Zen 4 VM loads and
// stores of lines that far apart collide (the fp32 step in cache 2.6x slower, in memory 1.33x
// slower than with the buffers 4 KiB apart; 2^24 elements, 64 MiB apart, unaffected: most
// likely the L1's way predictor, whose tags hash address bits below 2^27; a recheck the next
// day found at most ~1.1x here, and none with the runtime's kernels on arena-like layouts:
// README, Benchmarks, item 12). Each buffer its own skew keeps every array's base distinct in
// those bits, as arbitrary tensor sizes would, while every block stays line-aligned.
template <typename T>
class Big {
 public:
  Big(std::size_t n, std::size_t skew)
      : n_(n), bytes_(round_up(zp::checked_add(zp::checked_mul(n, sizeof(T), "buffer bytes"), skew * kSkewBytes,
                                               "buffer bytes"))) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw zp::Error(fmt::format("mmap of {} bytes failed", bytes_));
    madvise(p, bytes_, MADV_HUGEPAGE);
    base_ = p;
    p_ = reinterpret_cast<T*>(static_cast<char*>(p) + skew * kSkewBytes);
  }
  ~Big() { munmap(base_, bytes_); }
  Big(const Big&) = delete;
  Big& operator=(const Big&) = delete;
  T* data() const { return p_; }
  T& operator[](std::size_t i) const { return p_[i]; }

 private:
  static constexpr std::size_t kSkewBytes = 65 * 64;
  static std::size_t round_up(std::size_t b) { return (b + (2u << 20) - 1) / (2u << 20) * (2u << 20); }
  std::size_t n_, bytes_;
  void* base_ = nullptr;
  T* p_ = nullptr;
};

// Every buffer of every benchmark, allocated once: n x (4 x 4 + 5 x 2) = 26 bytes per param.
struct Data {
  std::size_t n;
  Big<float> master, m, v, g32;          // fp32 master weights, moments; fp32 grads / scratch
  Big<uint16_t> g16, gb16, p16, m16, v16;  // fp16 and bf16 grads, 16-bit params out, bf16 moments
  explicit Data(std::size_t n_)
      : n(n_), master(n, 0), m(n, 1), v(n, 2), g32(n, 3), g16(n, 4), gb16(n, 5), p16(n, 6), m16(n, 7),
        v16(n, 8) {}
};

// A deterministic pseudo-random value in [-1, 1) for element i (splitmix64 of i and a seed).
float unit(std::size_t i, uint64_t seed) {
  uint64_t z = i * 0x9e3779b97f4a7c15ull + seed;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 40) * 0x1p-23 - 1.0);
}

// The same thread split as cpu_adam.cpp (contiguous ranges, starts on 64-element multiples).
template <typename F>
void parallel_ranges(std::size_t n, F&& f) {
#pragma omp parallel
  {
    const std::size_t t = omp_get_num_threads(), me = omp_get_thread_num();
    std::size_t per = zp::partition_elems(n, t);
    per = zp::partition_elems(per, 64) * 64;
    const std::size_t b = std::min(n, per * me), e = std::min(n, b + per);
    if (b < e) f(b, e);
  }
}

// Fresh state: master in [-1, 1), moments as after some steps, gradients ~1e-3 (loss-scaled
// by 1024 in fp16 and bf16), none subnormal (no denormal slow paths in anyone's timing).
void fill(Data& d) {
  parallel_ranges(d.n, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) {
      const float g = 1e-3f * unit(i, 4);
      d.master[i] = unit(i, 1);
      d.m[i] = 1e-3f * unit(i, 2);
      d.v[i] = 1e-6f * (1.5f + unit(i, 3));
      d.g32[i] = g;
      d.g16[i] = fp32_to_fp16(1024.0f * g);
      d.gb16[i] = fp32_to_bf16(1024.0f * g);
      d.p16[i] = 0;
      d.m16[i] = fp32_to_bf16(d.m[i]);
      d.v16[i] = fp32_to_bf16(d.v[i]);
    }
  });
}

// One set of buffers per kWhich, allocated and filled on first use.
template <int kWhich>
Data& buffers() {
  static Data& d = [] () -> Data& {
    static Data fresh(n_params());
    fill(fresh);
    return fresh;
  }();
  return d;
}
Data& data() { return buffers<0>(); }
// The paired rounds' streams run on arrays of their own (allocated only if they run): a stream
// adds g to every array, which would hand the Adam step negative second moments.
Data& stream_data() { return buffers<1>(); }

// ---- the step under test and its configurations -------------------------------------------

constexpr double kLossScale = 1024.0;  // a power of two, as fp16 loss scales are
constexpr double kClip = 0.8;
const AdamConfig kCfg{.lr = 1e-3, .weight_decay = 0.01};

struct Variant {
  DType grads, moments;
  bool out16;  // a 16-bit copy of the parameters, in the gradients' dtype
  const char* name;
};
constexpr Variant kFp32{DType::fp32, DType::fp32, false, "fp32"};                 // torch AdamW's work
constexpr Variant kOffloadFp16{DType::fp16, DType::fp32, true, "offload_fp16"};   // ZeRO-Offload, fp16
constexpr Variant kOffloadBf16{DType::bf16, DType::fp32, true, "offload_bf16"};   // ZeRO-Offload, bf16
constexpr Variant kBf16Moments{DType::bf16, DType::bf16, true, "bf16_moments"};   // half the moments' bytes
constexpr Variant kVariants[] = {kFp32, kOffloadFp16, kOffloadBf16, kBf16Moments};

const void* grads_of(const Data& d, DType g) {
  return g == DType::fp32 ? static_cast<const void*>(d.g32.data())
                          : g == DType::fp16 ? static_cast<const void*>(d.g16.data()) : d.gb16.data();
}

// Bytes one step must move per parameter: read grad; read+write master and both moments;
// write the 16-bit copy. Offload fp16: 2 + 3*(4+4) + 2 = 28; fp32: 4 + 24 = 28;
// bf16 everything: 2 + (4+4) + 2*(2+2) + 2 = 20.
std::size_t bytes_per_param(const Variant& v) {
  return dtype_bytes(v.grads) + 8 + 4 * dtype_bytes(v.moments) + (v.out16 ? 2 : 0);
}

AdamTensors tensors(const Data& d, const Variant& v, std::size_t offset, std::size_t n,
                    float* master, void* m, void* vv, void* out) {
  const bool bf16m = v.moments == DType::bf16;
  return {.n = n,
          .master = master ? master : d.master.data() + offset,
          .exp_avg = m ? m : (bf16m ? static_cast<void*>(d.m16.data() + offset) : d.m.data() + offset),
          .exp_avg_sq = vv ? vv : (bf16m ? static_cast<void*>(d.v16.data() + offset) : d.v.data() + offset),
          .moment_dtype = v.moments,
          .grads = static_cast<const char*>(grads_of(d, v.grads)) + offset * dtype_bytes(v.grads),
          .grad_dtype = v.grads,
          .param_out = v.out16 ? (out ? out : d.p16.data() + offset) : nullptr,
          .param_out_dtype = v.grads == DType::bf16 ? DType::bf16 : DType::fp16};
}

AdamStepArgs step_args(const Variant& v, int64_t t) {
  return {.step = t, .inv_loss_scale = v.grads == DType::fp32 ? 1.0 : 1.0 / kLossScale,
          .clip_coef = kClip};
}

// Sampled indices: both ends, around every possible thread boundary, and a stride.
std::vector<std::size_t> sample_indices(std::size_t n) {
  std::vector<std::size_t> s;
  for (std::size_t i = 0; i < 64 && i < n; ++i) s.push_back(i), s.push_back(n - 1 - i);
  for (std::size_t k = 1; k < 16; ++k)
    for (std::size_t j = 0; j < 64; ++j) s.push_back(std::min(n - 1, n * k / 16 - 32 + j));
  for (std::size_t i = 7; i < n; i += n / 2048 + 1) s.push_back(i);
  return s;
}

// What the scalar reference says sampled elements become after one step of variant v.
struct Expected {
  std::vector<std::size_t> idx;
  std::vector<float> master;
  std::vector<uint32_t> m, v;  // raw bits (fp32 or bf16 widened)
  std::vector<uint16_t> out;
};

Expected scalar_reference(const Data& d, const Variant& var, int64_t t) {
  Expected e;
  e.idx = sample_indices(d.n);
  const std::size_t k = e.idx.size();
  std::vector<float> master(k), m(k), v(k), g32(k);
  std::vector<uint16_t> m16(k), v16(k), g16(k), gb16(k), out(k);
  for (std::size_t j = 0; j < k; ++j) {
    const std::size_t i = e.idx[j];
    master[j] = d.master[i], m[j] = d.m[i], v[j] = d.v[i], g32[j] = d.g32[i];
    m16[j] = d.m16[i], v16[j] = d.v16[i], g16[j] = d.g16[i], gb16[j] = d.gb16[i];
  }
  const bool bf16m = var.moments == DType::bf16;
  void* m_ptr = bf16m ? static_cast<void*>(m16.data()) : m.data();
  void* v_ptr = bf16m ? static_cast<void*>(v16.data()) : v.data();
  AdamTensors ts = tensors(d, var, 0, k, master.data(), m_ptr, v_ptr, out.data());
  ts.grads = var.grads == DType::fp32 ? static_cast<const void*>(g32.data())
             : var.grads == DType::fp16 ? static_cast<const void*>(g16.data()) : gb16.data();
  cpu_adam_step(CpuIsa::scalar, kCfg, step_args(var, t), ts);
  e.master = master;
  for (std::size_t j = 0; j < k; ++j) {
    e.m.push_back(bf16m ? m16[j] : std::bit_cast<uint32_t>(m[j]));
    e.v.push_back(bf16m ? v16[j] : std::bit_cast<uint32_t>(v[j]));
  }
  e.out = out;
  return e;
}

// Number of sampled elements where the full-size run disagrees with the scalar reference.
std::size_t count_wrong(const Data& d, const Variant& var, const Expected& e) {
  const bool bf16m = var.moments == DType::bf16;
  std::size_t wrong = 0;
  for (std::size_t j = 0; j < e.idx.size(); ++j) {
    const std::size_t i = e.idx[j];
    const uint32_t m = bf16m ? d.m16[i] : std::bit_cast<uint32_t>(d.m[i]);
    const uint32_t v = bf16m ? d.v16[i] : std::bit_cast<uint32_t>(d.v[i]);
    wrong += std::bit_cast<uint32_t>(d.master[i]) != std::bit_cast<uint32_t>(e.master[j]) ||
             m != e.m[j] || v != e.v[j] || (var.out16 && d.p16[i] != e.out[j]);
  }
  return wrong;
}

void set_counters(benchmark::State& state, std::size_t n, std::size_t bytes_per) {
  const double iters = static_cast<double>(state.iterations());
  state.counters["params"] = benchmark::Counter(static_cast<double>(n) * iters, benchmark::Counter::kIsRate);
  state.counters["bytes"] =
      benchmark::Counter(static_cast<double>(n * bytes_per) * iters, benchmark::Counter::kIsRate);
  state.counters["bytes_per_param"] = static_cast<double>(bytes_per);
  state.counters["threads"] = omp_get_max_threads();
}

// How a fused benchmark runs the step: with the store kind cpu_adam_step picks (automatic:
// ordinary stores, cpu_adam.cpp), with non-temporal stores forced, or in cache: each thread steps one
// 16K-element slice of its own over and over (the data stays in its L2), as many elements in
// all as the full step, which times the arithmetic alone, the step's compute floor. Each of
// those calls has a fixed cost (the argument checks, the coefficients' pow(), a one-thread
// OpenMP region: a few microseconds, as much as the slice's arithmetic), so the floor is the
// time of those calls minus the time of as many calls on 32 elements (a manual time).
// The slices lie 32K elements apart (a 16K-element gap). Adjacent, each thread's prefetches
// (the kernel's own, up to 4 KiB ahead, and the hardware's) ran into the next thread's slice
// and pulled lines that thread was writing over to its own core, every pass: on the Zen 4 VM
// two threads' AVX2 bf16-moment floor took 11.3-11.5 ms where one thread took 7.7 ms for as
// many elements a thread, and the paired rounds read it as slower than the step from memory
// (139-157% of the roofline while the step ran at 80-84%). Apart: 7.68 ms against 7.64 ms. A
// probe with the runtime's AVX2 kernel: 39.5 TSC cycles a block on one or two threads with
// arrays of their own, 38.5 and 44.2 with adjacent slices of shared arrays.
enum class Mode : uint8_t { automatic, streaming, in_cache };
constexpr std::size_t kInCacheElems = std::size_t{1} << 14, kInCacheStride = 2 * kInCacheElems,
                      kCallCostElems = 32;

// Thread k steps len elements at k * 32K, n / (16K x threads) times.
void in_cache_step(CpuIsa use, const Data& d, const Variant& var, int64_t t, std::size_t len) {
#pragma omp parallel
  {
    const std::size_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const std::size_t reps = std::max<std::size_t>(1, d.n / (kInCacheElems * threads));
    const std::size_t slice = std::min(d.n, len);
    const std::size_t offset = std::min(d.n - slice, me * kInCacheStride);
    for (std::size_t r = 0; r < reps; ++r)
      cpu_adam_step(use, kCfg, step_args(var, t), tensors(d, var, offset, slice, nullptr, nullptr, nullptr, nullptr));
  }
}

using Clock = std::chrono::steady_clock;

// The arithmetic alone of one step on `use` (in_cache_step's time less as many calls on 32
// elements: their fixed cost), in seconds; t is the step counter, advanced.
double arithmetic_alone(CpuIsa use, const Data& d, const Variant& var, int64_t& t) {
  // Ordinary stores whatever the runtime would pick: non-temporal ones would send the slice's
  // copy to memory on every pass (the arithmetic is the same for every store kind).
  // Both callers run with the automatic kind, which this restores.
  force_cpu_adam_stores(CpuAdamStores::cached);
  struct Restore {
    ~Restore() { force_cpu_adam_stores(CpuAdamStores::automatic); }
  } restore;
  const Clock::time_point t0 = Clock::now();
  in_cache_step(use, d, var, t, kInCacheElems);
  const Clock::time_point t1 = Clock::now();
  in_cache_step(use, d, var, t++, kCallCostElems);
  const std::chrono::duration<double> work = t1 - t0, calls = Clock::now() - t1;
  return std::max(0.0, work.count() - calls.count());
}

// Empty if one step of var on `use` (with the store kind in force), from fresh data, gives the
// scalar reference's answer on every sampled element; else what is wrong.
std::string fused_check(Data& d, const Variant& var, CpuIsa use) {
  fill(d);
  const Expected want = scalar_reference(d, var, 1);
  cpu_adam_step(use, kCfg, step_args(var, 1), tensors(d, var, 0, d.n, nullptr, nullptr, nullptr, nullptr));
  if (const std::size_t wrong = count_wrong(d, var, want))
    return fmt::format("{} of {} sampled elements differ from the scalar reference", wrong, want.idx.size());
  return {};
}

// The fused step (one pass) on one ISA.
void BM_Fused(benchmark::State& state, Variant var, CpuIsa use, Mode mode) {
  Data& d = data();
  if (!cpu_supports(use)) {
    state.SkipWithError("this CPU cannot run the requested ISA");
    return;
  }
  state.SetLabel(std::string(to_string(use)));
  force_cpu_adam_stores(mode == Mode::streaming ? CpuAdamStores::streaming : CpuAdamStores::automatic);
  struct Reset {
    ~Reset() { force_cpu_adam_stores(CpuAdamStores::automatic); }
  } reset;
  if (const std::string wrong = fused_check(d, var, use); !wrong.empty()) {
    state.SkipWithError(wrong.c_str());
    return;
  }
  int64_t t = 2;
  for (auto _ : state) {
    if (mode == Mode::in_cache) {
      state.SetIterationTime(arithmetic_alone(use, d, var, t));
    } else {
      cpu_adam_step(use, kCfg, step_args(var, t++), tensors(d, var, 0, d.n, nullptr, nullptr, nullptr, nullptr));
    }
    benchmark::ClobberMemory();
  }
  set_counters(state, d.n, bytes_per_param(var));
}

// ---- the roofline: the best of the plain streams with the step's loads and stores ----------

streams::Arrays stream_arrays(const Data& d, const Variant& v) {
  const bool bf16m = v.moments == DType::bf16;
  return {.p = d.master.data(),
          .m = bf16m ? static_cast<void*>(d.m16.data()) : d.m.data(),
          .v = bf16m ? static_cast<void*>(d.v16.data()) : d.v.data(),
          .g = grads_of(d, v.grads),
          .out = v.out16 ? d.p16.data() : nullptr};
}

streams::Types stream_types(const Variant& v) {
  return {v.grads, v.moments, v.grads == DType::bf16 ? DType::bf16 : DType::fp16, v.out16};
}

// Every shape this CPU can run (AVX2 always measured; AVX-512 where cpuid has it).
std::vector<streams::Shape> stream_shapes() {
  std::vector<streams::Shape> shapes;
  for (const int width : {8, 16}) {
    if (width == 16 && !cpu_supports(CpuIsa::avx512)) continue;
    for (const streams::Order order : {streams::Order::loads_first, streams::Order::interleaved}) {
      for (const bool nt : {true, false})
        for (const streams::Prefetch pf : streams::kPrefetches)
          shapes.push_back({width, order, nt, pf.elems, pf.l2});
      // Non-temporal stores for the 16-bit copy alone, as the runtime's kernels write it on
      // AMD CPUs (CpuAdamStores::streaming_copy): without this shape those ran at 102-108% of
      // the family's best on the Zen 4 VM.
      shapes.push_back({width, order, false, 0, false, true});
    }
  }
  return shapes;
}

// Empty if one pass of a stream kernel over d gives, on every sampled element of every array,
// what its scalar meaning gives; else what is wrong (the elements are copied aside and passed
// through the scalar meaning first, then the full pass runs, then all are compared bit for bit).
std::string stream_check(const Data& d, const Variant& var, streams::RangeFn kernel) {
  const streams::Arrays a = stream_arrays(d, var);
  const streams::Types types = stream_types(var);
  const std::vector<std::size_t> idx = sample_indices(d.n);
  const std::size_t k = idx.size(), gb = dtype_bytes(var.grads), mb = dtype_bytes(var.moments);
  std::vector<float> p(k);
  std::vector<unsigned char> m(k * mb), v(k * mb), g(k * gb), out(k * 2);
  for (std::size_t j = 0; j < k; ++j) {
    p[j] = d.master[idx[j]];
    std::memcpy(&m[j * mb], static_cast<const char*>(a.m) + idx[j] * mb, mb);
    std::memcpy(&v[j * mb], static_cast<const char*>(a.v) + idx[j] * mb, mb);
    std::memcpy(&g[j * gb], static_cast<const char*>(a.g) + idx[j] * gb, gb);
  }
  const streams::Arrays want{p.data(), m.data(), v.data(), g.data(), var.out16 ? out.data() : nullptr};
  for (std::size_t j = 0; j < k; ++j) streams::element(want, types, j);
  parallel_ranges(d.n, [&](std::size_t b, std::size_t e) { kernel(a, b, e); });
  for (std::size_t j = 0; j < k; ++j) {
    const std::size_t i = idx[j];
    const bool same = std::memcmp(&p[j], d.master.data() + i, 4) == 0 &&
                      std::memcmp(&m[j * mb], static_cast<const char*>(a.m) + i * mb, mb) == 0 &&
                      std::memcmp(&v[j * mb], static_cast<const char*>(a.v) + i * mb, mb) == 0 &&
                      (!var.out16 || std::memcmp(&out[j * 2], d.p16.data() + i, 2) == 0);
    if (!same) return fmt::format("the stream kernel gives a wrong answer at element {}", i);
  }
  return {};
}

// One stream kernel over all n elements: the same thread split as the fused step.
void BM_Stream(benchmark::State& state, Variant var, streams::Shape shape) {
  Data& d = data();
  const streams::RangeFn kernel = streams::kernel(stream_types(var), shape);
  if (!cpu_supports(CpuIsa::avx2) || kernel == nullptr) {
    state.SkipWithError(kernel == nullptr ? "no such stream shape for this variant" : "the stream kernels need AVX2+F16C");
    return;
  }
  state.SetLabel(shape.width == 16 ? "avx512" : "avx2");
  if (const std::string wrong = stream_check(d, var, kernel); !wrong.empty()) {
    state.SkipWithError(wrong.c_str());
    return;
  }
  const streams::Arrays a = stream_arrays(d, var);
  for (auto _ : state) {
    parallel_ranges(d.n, [&](std::size_t b, std::size_t e) { kernel(a, b, e); });
    benchmark::ClobberMemory();
  }
  set_counters(state, d.n, bytes_per_param(var));
}

// The ISAs the fused step is measured on here (the dispatch picks the last one).
std::vector<CpuIsa> fused_isas() {
  std::vector<CpuIsa> isas;
  for (const CpuIsa isa : {CpuIsa::avx2, CpuIsa::avx512, CpuIsa::avx512bf16})
    if (cpu_supports(isa)) isas.push_back(isa);
  return isas;
}

// ---- paired rounds: a variant's streams and fused kernels back to back ----------------------

// The shares from separate benchmarks pair medians taken minutes apart; where the memory's
// bandwidth drifts within minutes (the Zen 4 VM: one stream shape at 9.0, 16.2 and 16.6 ms in
// three runs minutes apart), the best of 32 such medians is a lucky draw and every share reads
// low. A paired round runs every stream shape and every fused kernel (the runtime's stores)
// once, best of two calls each, within a second or two, in an order rotated from round to
// round. The roofline's shape is the one with the lowest median over the rounds (not each
// round's fastest: the least of 32 noisy times is itself a lucky draw, ~15% below the typical
// one here), and a kernel's share in a round is that shape's time in the round over the
// kernel's; the median and range over the rounds are reported (as compare_adam.sh pairs ours
// with torch's). Each round also times each kernel's arithmetic alone (arithmetic_alone, best
// of two), reported as a share of the same round's roofline: where it nears 100%, no order of
// loads and stores can bring that kernel to the roofline on this machine (compute-bound).
std::size_t paired_rounds() { return static_cast<std::size_t>(env_int("ZP_BENCH_ADAM_ROUNDS", 9, 1, 1000)); }

struct Paired {
  std::vector<CpuIsa> isas;
  std::vector<streams::Shape> shapes;
  std::vector<std::vector<double>> stream_secs;  // [shape][round]
  std::vector<std::vector<double>> fused_secs;   // [isa][round]
  std::vector<std::vector<double>> alone_secs;   // [isa][round]: the arithmetic alone
  CpuIsa top = CpuIsa::scalar;                    // the dispatch's ISA
  // The dispatch's kernel with one automatic choice changed: the other prefetch kind, and
  // (variants with a 16-bit copy) the other store kind for the copy.
  struct Alternative {
    std::string what;              // "software prefetch instead of hardware"
    CpuAdamPrefetch prefetch;      // forced for the alternative's runs
    CpuAdamStores stores;
    std::vector<double> secs;      // [round]
  };
  std::vector<Alternative> alternatives;
};
// The runtime's own choices again, or an alternative's forced.
void automatic_choices() {
  force_cpu_adam_prefetch(CpuAdamPrefetch::automatic);
  force_cpu_adam_stores(CpuAdamStores::automatic);
}
void force_choices(const Paired::Alternative& alt) {
  force_cpu_adam_prefetch(alt.prefetch);
  force_cpu_adam_stores(alt.stores);
}

std::map<std::string, Paired>& paired_results() {
  static std::map<std::string, Paired> results;
  return results;
}

template <typename F>
double best_of_two(F&& run) {
  double best = INFINITY;
  for (int c = 0; c < 2; ++c) {
    const Clock::time_point t0 = Clock::now();
    run();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

// Each iteration is one round (its own time, the step's arrays refilled first, is not a figure).
void BM_Paired(benchmark::State& state, Variant var) {
  if (!cpu_supports(CpuIsa::avx2)) {
    state.SkipWithError("the stream kernels need AVX2+F16C");
    return;
  }
  Data& d = data();
  const Data& sd = stream_data();
  const std::vector<CpuIsa> isas = fused_isas();
  for (const CpuIsa isa : isas)
    if (const std::string wrong = fused_check(d, var, isa); !wrong.empty()) {
      state.SkipWithError(wrong.c_str());
      return;
    }
  std::vector<streams::RangeFn> kernels;
  std::vector<streams::Shape> shapes;
  for (const streams::Shape& shape : stream_shapes()) {
    const streams::RangeFn k = streams::kernel(stream_types(var), shape);
    if (k == nullptr) continue;
    if (const std::string wrong = stream_check(sd, var, k); !wrong.empty()) {
      state.SkipWithError(wrong.c_str());
      return;
    }
    kernels.push_back(k);
    shapes.push_back(shape);
  }
  const streams::Arrays a = stream_arrays(sd, var);
  Paired& out = paired_results()[var.name];  // repetitions add rounds
  out.isas = isas;
  out.shapes = shapes;
  out.stream_secs.resize(shapes.size());
  out.fused_secs.resize(isas.size());
  out.alone_secs.resize(isas.size());
  out.top = cpu_adam_isa();
  if (out.alternatives.empty()) {
    const CpuAdamPrefetch pf = cpu_adam_prefetch(out.top, var.moments);
    const CpuAdamStores st = cpu_adam_stores(var.moments);
    const CpuAdamPrefetch other_pf = pf == CpuAdamPrefetch::hardware ? CpuAdamPrefetch::software : CpuAdamPrefetch::hardware;
    out.alternatives.push_back({fmt::format("{} prefetch instead of {}", to_string(other_pf), to_string(pf)), other_pf, st, {}});
    if (var.out16 && (st == CpuAdamStores::cached || st == CpuAdamStores::streaming_copy)) {
      const bool nt = st == CpuAdamStores::streaming_copy;
      out.alternatives.push_back({fmt::format("{} stores for the copy instead of {}", nt ? "ordinary" : "non-temporal",
                                              nt ? "non-temporal" : "ordinary"),
                                  pf, nt ? CpuAdamStores::cached : CpuAdamStores::streaming_copy, {}});
    }
  }
  struct Reset {
    ~Reset() { automatic_choices(); }
  } reset;
  for (const Paired::Alternative& alt : out.alternatives) {  // checked like every kernel here
    force_choices(alt);
    if (const std::string wrong = fused_check(d, var, out.top); !wrong.empty()) {
      state.SkipWithError(fmt::format("with {}: {}", alt.what, wrong).c_str());
      return;
    }
  }
  automatic_choices();
  const std::size_t fixed = kernels.size() + 2 * isas.size();  // then the alternatives
  const std::size_t items = fixed + out.alternatives.size();
  std::vector<double> secs(items);
  int64_t t = 2;
  std::size_t round = 0;
  for (auto _ : state) {
    fill(d);
    for (std::size_t j = 0; j < items; ++j) {
      const std::size_t item = (j + round) % items;
      if (item < kernels.size())
        secs[item] = best_of_two([&] { parallel_ranges(sd.n, [&](std::size_t b, std::size_t e) { kernels[item](a, b, e); }); });
      else if (item < kernels.size() + isas.size())
        secs[item] = best_of_two([&] {
          cpu_adam_step(isas[item - kernels.size()], kCfg, step_args(var, t++),
                        tensors(d, var, 0, d.n, nullptr, nullptr, nullptr, nullptr));
        });
      else if (item < kernels.size() + 2 * isas.size()) {
        const CpuIsa isa = isas[item - kernels.size() - isas.size()];
        secs[item] = std::min(arithmetic_alone(isa, d, var, t), arithmetic_alone(isa, d, var, t));
      } else {
        force_choices(out.alternatives[item - fixed]);
        secs[item] = best_of_two([&] {
          cpu_adam_step(out.top, kCfg, step_args(var, t++),
                        tensors(d, var, 0, d.n, nullptr, nullptr, nullptr, nullptr));
        });
        automatic_choices();
      }
    }
    for (std::size_t k = 0; k < out.alternatives.size(); ++k) out.alternatives[k].secs.push_back(secs[fixed + k]);
    for (std::size_t k = 0; k < kernels.size(); ++k) out.stream_secs[k].push_back(secs[k]);
    for (std::size_t i = 0; i < isas.size(); ++i) {
      out.fused_secs[i].push_back(secs[kernels.size() + i]);
      out.alone_secs[i].push_back(secs[kernels.size() + isas.size() + i]);
    }
    ++round;
  }
  state.SetLabel(fmt::format("{} rounds", round));
}

// ---- the same offload work as separate passes ---------------------------------------------

__attribute__((target("avx2,f16c"))) void convert_range(const Data& d, std::size_t b, std::size_t e) {
  std::size_t i = b;
  for (; i + 8 <= e; i += 8)
    _mm256_storeu_ps(d.g32.data() + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d.g16.data() + i))));
  for (; i < e; ++i) d.g32[i] = fp16_to_fp32(d.g16[i]);
}

__attribute__((target("avx2"))) void scale_range(const Data& d, float s, std::size_t b, std::size_t e) {
  const __m256 s8 = _mm256_set1_ps(s);
  std::size_t i = b;
  for (; i + 8 <= e; i += 8) _mm256_storeu_ps(d.g32.data() + i, _mm256_mul_ps(_mm256_loadu_ps(d.g32.data() + i), s8));
  for (; i < e; ++i) d.g32[i] *= s;
}

__attribute__((target("avx2,f16c"))) void cast_range(const Data& d, std::size_t b, std::size_t e) {
  std::size_t i = b;
  for (; i + 8 <= e; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d.p16.data() + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(d.master.data() + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < e; ++i) d.p16[i] = fp32_to_fp16(d.master[i]);
}

// fp16 grads -> fp32 (6 B/param), unscale (8), clip (8), Adam on fp32 grads (28), cast (6):
// 56 bytes per parameter where the fused step moves 28. Each pass is vectorized and threaded.
void separate_passes(const Data& d, int64_t t) {
  parallel_ranges(d.n, [&](std::size_t b, std::size_t e) { convert_range(d, b, e); });
  parallel_ranges(d.n, [&](std::size_t b, std::size_t e) { scale_range(d, static_cast<float>(1.0 / kLossScale), b, e); });
  parallel_ranges(d.n, [&](std::size_t b, std::size_t e) { scale_range(d, static_cast<float>(kClip), b, e); });
  cpu_adam_step(kCfg, {.step = t}, tensors(d, kFp32, 0, d.n, nullptr, nullptr, nullptr, nullptr));
  parallel_ranges(d.n, [&](std::size_t b, std::size_t e) { cast_range(d, b, e); });
}

void BM_Separate(benchmark::State& state) {
  Data& d = data();
  fill(d);
  if (!cpu_supports(CpuIsa::avx2)) {
    state.SkipWithError("the separate passes need AVX2+F16C");
    return;
  }
  state.SetLabel(std::string(to_string(cpu_adam_isa())));
  // With a power-of-two loss scale, unscaling then clipping rounds exactly like the fused
  // step's single multiply by inv_scale * clip, so the result must be bit-identical.
  const Expected want = scalar_reference(d, kOffloadFp16, 1);
  separate_passes(d, 1);
  if (const std::size_t wrong = count_wrong(d, kOffloadFp16, want)) {
    state.SkipWithError(fmt::format("{} of {} sampled elements differ from the scalar reference",
                                    wrong, want.idx.size()).c_str());
    return;
  }
  int64_t t = 2;
  for (auto _ : state) {
    separate_passes(d, t++);
    benchmark::ClobberMemory();
  }
  set_counters(state, d.n, 6 + 8 + 8 + 28 + 6);
}

// The global-norm pass over fp16 gradients (2 bytes per parameter), checked against a
// long-double sum of all elements.
void BM_GradSumSquares(benchmark::State& state) {
  Data& d = data();
  fill(d);
  long double want = 0;
  for (std::size_t i = 0; i < d.n; ++i) {
    const long double x = fp16_to_fp32(d.g16[i]);
    want += x * x;
  }
  const GradSumSquares got = grad_sum_squares(d.g16.data(), DType::fp16, d.n);
  if (!got.finite || std::fabs(got.sum_sq - static_cast<double>(want)) >
                         static_cast<double>(d.n) * 0x1p-53 * static_cast<double>(want)) {
    state.SkipWithError("grad_sum_squares gives a wrong answer");
    return;
  }
  state.SetLabel(std::string(to_string(cpu_adam_isa())));
  for (auto _ : state) benchmark::DoNotOptimize(grad_sum_squares(d.g16.data(), DType::fp16, d.n));
  set_counters(state, d.n, 2);
}

// ---- ratios from this run -----------------------------------------------------------------

std::string stream_name(const Variant& v, const streams::Shape& s) {
  return fmt::format("stream_{}/{}", v.name, streams::to_string(s));
}
std::string fused_name(const Variant& v, CpuIsa isa, Mode mode = Mode::automatic) {
  const char* suffix[] = {"", "/nt", "/in_cache"};
  return fmt::format("fused_{}/{}{}", v.name, to_string(isa), suffix[static_cast<int>(mode)]);
}

// The paired rounds (BM_Paired): per variant, the roofline's shape (the lowest median over the
// rounds) and each fused kernel's share of it, that shape's time over the kernel's in each
// round, median and range over the rounds.
void print_paired() {
  bool any = false;
  for (const Variant& v : kVariants) {
    const auto it = paired_results().find(v.name);
    if (it == paired_results().end() || it->second.stream_secs.empty() || it->second.stream_secs[0].empty())
      continue;
    const Paired& p = it->second;
    if (!any)
      fmt::print("\npaired rounds ({} params, {} threads; each round: every stream shape and fused kernel "
                 "once, best of 2 calls, back to back; the roofline is the shape with the lowest median, "
                 "a kernel's share its time over the kernel's in the same round, median and range):\n",
                 n_params(), omp_get_max_threads());
    any = true;
    std::size_t b = 0;
    for (std::size_t k = 1; k < p.shapes.size(); ++k)
      if (zp::bench::median(p.stream_secs[k]) < zp::bench::median(p.stream_secs[b])) b = k;
    const double best = zp::bench::median(p.stream_secs[b]);
    fmt::print("  {:<13} {} rounds, roofline {:.2f} ms ({:.1f} GB/s at {} B/param): stream {}\n", v.name,
               p.stream_secs[b].size(), best * 1e3,
               static_cast<double>(n_params() * bytes_per_param(v)) / best / 1e9, bytes_per_param(v),
               streams::to_string(p.shapes[b]));
    for (std::size_t i = 0; i < p.isas.size(); ++i) {
      std::vector<double> shares(p.fused_secs[i].size());
      for (std::size_t r = 0; r < shares.size(); ++r) shares[r] = p.stream_secs[b][r] / p.fused_secs[i][r];
      const double share = 100 * zp::bench::median(shares);
      const auto [lo, hi] = std::minmax_element(shares.begin(), shares.end());
      std::vector<double> alone(p.alone_secs[i].size());
      for (std::size_t r = 0; r < alone.size(); ++r) alone[r] = p.alone_secs[i][r] / p.stream_secs[b][r];
      const double alone_share = 100 * zp::bench::median(alone);
      fmt::print("  {:<13}   fused {:<10} {:.1f}% ({:.1f}-{:.1f}%) (goal >= 90%: {}); arithmetic alone "
                 "{:.0f}% of the roofline{}\n",
                 "", to_string(p.isas[i]), share, 100 * *lo, 100 * *hi,
                 std::round(share * 10) >= 900 ? "met" : "NOT met",  // as printed
                 alone_share, alone_share >= 90 ? " (compute-bound here)" : "");
    }
    // The dispatch's kernel with one automatic choice changed: its share, and per round how
    // much faster the automatic choice ran (the alternative's time over the kernel's own).
    const auto top = std::find(p.isas.begin(), p.isas.end(), p.top);
    for (const Paired::Alternative& alt : p.alternatives) {
      if (top == p.isas.end() || alt.secs.size() != p.stream_secs[b].size()) continue;
      const std::size_t i = static_cast<std::size_t>(top - p.isas.begin());
      std::vector<double> shares(alt.secs.size()), gain(alt.secs.size());
      for (std::size_t r = 0; r < shares.size(); ++r) {
        shares[r] = p.stream_secs[b][r] / alt.secs[r];
        gain[r] = alt.secs[r] / p.fused_secs[i][r];
      }
      const auto [lo, hi] = std::minmax_element(gain.begin(), gain.end());
      fmt::print("  {:<13}   {} with {}: {:.1f}% of the roofline; the automatic choice ran {:.2f}x as "
                 "fast ({:.2f}-{:.2f}x)\n",
                 "", to_string(p.top), alt.what, 100 * zp::bench::median(shares), zp::bench::median(gain), *lo,
                 *hi);
    }
  }
}

// From the median real time per iteration of each benchmark over its repetitions in this run
// (both sides of a share move the same bytes, so a bandwidth share is a time ratio): per
// variant, the roofline (the fastest stream's median), each fused kernel's share of it (goal
// >= 90%), then every stream's share. One repetition each, the roofline is the luckiest of
// 32 single runs and the shares read low on a noisy machine; the header's interleaved
// repetitions steady both sides.
void print_ratios(const zp::bench::RatioReporter& r) {
  const std::vector<streams::Shape> shapes = stream_shapes();
  bool any = false;
  std::vector<double> best(std::size(kVariants), NAN);
  for (std::size_t k = 0; k < std::size(kVariants); ++k) {
    const Variant& v = kVariants[k];
    std::string best_shape;
    for (const streams::Shape& s : shapes) {
      const double t = r.time(stream_name(v, s));
      if (!std::isnan(t) && !(t >= best[k])) best[k] = t, best_shape = streams::to_string(s);
    }
    if (std::isnan(best[k])) continue;
    if (!any)
      fmt::print("\nshares of the roofline from this run ({} params, {} threads, medians of {} "
                 "repetition(s); the dispatch picks {}):\n",
                 n_params(), omp_get_max_threads(), r.repetitions(stream_name(v, shapes.front())),
                 to_string(cpu_adam_isa()));
    any = true;
    const double gbs = static_cast<double>(n_params() * bytes_per_param(v)) / best[k] / 1e9;
    fmt::print("  {:<13} roofline {:.2f} ms ({:.1f} GB/s at {} B/param): stream {}\n", v.name,
               best[k] * 1e3, gbs, bytes_per_param(v), best_shape);
    for (const CpuIsa isa : fused_isas()) {
      const double t = r.time(fused_name(v, isa));
      if (std::isnan(t)) continue;
      const double share = 100 * best[k] / t;
      const double t_nt = r.time(fused_name(v, isa, Mode::streaming)), floor = r.time(fused_name(v, isa, Mode::in_cache));
      fmt::print("  {:<13}   fused {:<7} {:.2f} ms: {:.1f}% of the roofline (goal >= 90%: {})", "",
                 to_string(isa), t * 1e3, share, share >= 90 ? "met" : "NOT met");
      if (!std::isnan(t_nt)) fmt::print("; with nt stores {:.1f}%", 100 * best[k] / t_nt);
      // The arithmetic alone, in cache: at or above the memory's time the step is compute-bound
      // here, and no order of its loads and stores can reach the memory roofline.
      if (!std::isnan(floor))
        fmt::print("; compute floor {:.2f} ms = {:.0f}% of the roofline{}", floor * 1e3, 100 * floor / best[k],
                   floor >= 0.9 * best[k] ? " (compute-bound)" : "");
      fmt::print("\n");
    }
  }
  if (any) {
    fmt::print("\n  each stream's share of its variant's roofline:\n  {:<34}", "");
    for (const Variant& v : kVariants) fmt::print(" {:>13}", v.name);
    fmt::print("\n");
    for (const streams::Shape& s : shapes) {
      fmt::print("  {:<34}", streams::to_string(s));
      for (std::size_t k = 0; k < std::size(kVariants); ++k) {
        const double t = r.time(stream_name(kVariants[k], s));
        if (std::isnan(t) || std::isnan(best[k])) fmt::print(" {:>13}", "-");
        else fmt::print(" {:>12.1f}%", 100 * best[k] / t);
      }
      fmt::print("\n");
    }
  }
  print_paired();
  const std::string fused = fused_name(kOffloadFp16, cpu_adam_isa());
  const double separate = r.time("separate_offload_fp16") / r.time(fused);
  const double scalar = r.time("fused_offload_fp16/scalar") / r.time(fused);
  if (!std::isnan(separate))
    fmt::print("\n  separate passes time / fused offload step time ({}): {:.2f}x (goal >= 1.8x: {})\n",
               to_string(cpu_adam_isa()), separate, separate >= 1.8 ? "met" : "NOT met");
  if (!std::isnan(scalar))
    fmt::print("  fused offload step, vector / scalar speed-up: {:.2f}x\n", scalar);
}

}  // namespace

int main(int argc, char** argv) {
  n_params();  // the settings checked before anything runs
  paired_rounds();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  auto reg = [](const char* name, auto fn) {
    benchmark::RegisterBenchmark(name, fn)->Unit(benchmark::kMillisecond)->UseRealTime();
  };
  // Per variant: its streams, then its fused kernels (a filter on the variant's name keeps a
  // roofline and its kernels together).
  for (const Variant& v : kVariants) {
    for (const streams::Shape& s : stream_shapes())
      if (streams::kernel(stream_types(v), s) != nullptr)  // copy-only shapes: variants with a copy
        reg(stream_name(v, s).c_str(), [v, s](benchmark::State& st) { BM_Stream(st, v, s); });
    for (const CpuIsa isa : fused_isas()) {
      // The store kind the runtime picks, non-temporal stores, the compute floor.
      reg(fused_name(v, isa).c_str(), [v, isa](benchmark::State& st) { BM_Fused(st, v, isa, Mode::automatic); });
      reg(fused_name(v, isa, Mode::streaming).c_str(),
          [v, isa](benchmark::State& st) { BM_Fused(st, v, isa, Mode::streaming); });
      benchmark::RegisterBenchmark(fused_name(v, isa, Mode::in_cache).c_str(),
                                   [v, isa](benchmark::State& st) { BM_Fused(st, v, isa, Mode::in_cache); })
          ->Unit(benchmark::kMillisecond)
          ->UseManualTime();
    }
  }
  for (const Variant& v : kVariants)
    benchmark::RegisterBenchmark(fmt::format("paired_{}/rounds", v.name).c_str(),
                                 [v](benchmark::State& st) { BM_Paired(st, v); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->Iterations(static_cast<benchmark::IterationCount>(paired_rounds()));
  reg("separate_offload_fp16", BM_Separate);
  reg("fused_offload_fp16/scalar",
      [](benchmark::State& s) { BM_Fused(s, kOffloadFp16, CpuIsa::scalar, Mode::automatic); });
  reg("grad_sum_squares_fp16", BM_GradSumSquares);
  zp::bench::RatioReporter reporter(print_ratios);
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
