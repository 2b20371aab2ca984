// bench_cpu_adam: the fused CPU Adam step at 2^26 parameters against, in the same run, (1) an
// "Adam-shaped" stream (same loads and stores, trivial arithmetic: the memory's limit) and
// (2) the same offload work done as separate passes (convert, unscale, clip, Adam, cast).
// Prints the ratios at the end. Not the PyTorch comparison (tools/bench/compare_adam.sh).
//
// Every benchmark checks its answer first (bit-exact against the scalar reference on ~4K
// sampled elements, including thread boundaries and the tail); a wrong answer is
// SkipWithError, not a fast time. Counters: params/s and bytes/s (bytes that variant must
// move per parameter, x params / time) and bytes_per_param. ZP_BENCH_ADAM_LOG2 sets the size
// (default 26; the CTest smoke run uses 20). For less noise on a shared machine:
//   build/bin/bench_cpu_adam --benchmark_repetitions=3 --benchmark_enable_random_interleaving=true
#include <benchmark/benchmark.h>
// GCC 12 bug 105593: its AVX-512 conversion intrinsics warn "may be used uninitialized" about
// their own undefined merge source (as in runtime/src/cpu_adam_avx512.cpp): silence only that.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ratio_reporter.hpp"
#include "zp/checked.hpp"
#include "zp/runtime/cpu_adam.hpp"

namespace {

using namespace zp::runtime;

// ---- buffers ------------------------------------------------------------------------------

std::size_t n_params() {
  const char* env = std::getenv("ZP_BENCH_ADAM_LOG2");
  const int log2 = env ? std::atoi(env) : 26;
  return std::size_t{1} << std::clamp(log2, 10, 32);
}

// n elements in 2 MiB-aligned anonymous memory with transparent huge pages requested (as the
// runtime's arena will be); pages are first touched by the OpenMP threads in fill().
template <typename T>
class Big {
 public:
  explicit Big(std::size_t n) : n_(n), bytes_(round_up(zp::checked_mul(n, sizeof(T), "buffer bytes"))) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw zp::Error(fmt::format("mmap of {} bytes failed", bytes_));
    madvise(p, bytes_, MADV_HUGEPAGE);
    p_ = static_cast<T*>(p);
  }
  ~Big() { munmap(p_, bytes_); }
  Big(const Big&) = delete;
  Big& operator=(const Big&) = delete;
  T* data() const { return p_; }
  T& operator[](std::size_t i) const { return p_[i]; }

 private:
  static std::size_t round_up(std::size_t b) { return (b + (2u << 20) - 1) / (2u << 20) * (2u << 20); }
  std::size_t n_, bytes_;
  T* p_ = nullptr;
};

// Every buffer of every benchmark, allocated once: n x (4 x 4 + 4 x 2) = 24 bytes per param.
struct Data {
  std::size_t n;
  Big<float> master, m, v, g32;          // fp32 master weights, moments; fp32 grads / scratch
  Big<uint16_t> g16, p16, m16, v16;      // fp16 grads, 16-bit params out, bf16 moments
  explicit Data(std::size_t n_)
      : n(n_), master(n), m(n), v(n), g32(n), g16(n), p16(n), m16(n), v16(n) {}
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
// by 1024 in fp16), none subnormal (no denormal slow paths in anyone's timing).
void fill(Data& d) {
  parallel_ranges(d.n, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) {
      const float g = 1e-3f * unit(i, 4);
      d.master[i] = unit(i, 1);
      d.m[i] = 1e-3f * unit(i, 2);
      d.v[i] = 1e-6f * (1.5f + unit(i, 3));
      d.g32[i] = g;
      d.g16[i] = fp32_to_fp16(1024.0f * g);
      d.p16[i] = 0;
      d.m16[i] = fp32_to_bf16(d.m[i]);
      d.v16[i] = fp32_to_bf16(d.v[i]);
    }
  });
}

Data& data() {
  static Data d(n_params());
  return d;
}

// ---- the step under test and its configurations -------------------------------------------

constexpr double kLossScale = 1024.0;  // a power of two, as fp16 loss scales are
constexpr double kClip = 0.8;
const AdamConfig kCfg{.lr = 1e-3, .weight_decay = 0.01};

struct Variant {
  DType grads, moments;
  bool out16;
};
constexpr Variant kOffloadFp16{DType::fp16, DType::fp32, true};  // ZeRO-Offload with fp16
constexpr Variant kFp32{DType::fp32, DType::fp32, false};        // torch AdamW's work
constexpr Variant kBf16Moments{DType::bf16, DType::bf16, true};

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
          .grads = v.grads == DType::fp32 ? static_cast<const void*>(d.g32.data() + offset)
                                          : static_cast<const void*>(d.g16.data() + offset),
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
  std::vector<uint16_t> m16(k), v16(k), g16(k), out(k);
  for (std::size_t j = 0; j < k; ++j) {
    const std::size_t i = e.idx[j];
    master[j] = d.master[i], m[j] = d.m[i], v[j] = d.v[i], g32[j] = d.g32[i];
    m16[j] = d.m16[i], v16[j] = d.v16[i], g16[j] = d.g16[i];
  }
  const bool bf16m = var.moments == DType::bf16;
  void* m_ptr = bf16m ? static_cast<void*>(m16.data()) : m.data();
  void* v_ptr = bf16m ? static_cast<void*>(v16.data()) : v.data();
  AdamTensors ts = tensors(d, var, 0, k, master.data(), m_ptr, v_ptr, out.data());
  ts.grads = var.grads == DType::fp32 ? static_cast<const void*>(g32.data()) : g16.data();
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

// The fused step (one pass), on the ISA cpu_adam_isa() picks or a forced one.
void BM_Fused(benchmark::State& state, Variant var, std::optional<CpuIsa> isa) {
  Data& d = data();
  fill(d);
  const CpuIsa use = isa.value_or(cpu_adam_isa());
  if (!cpu_supports(use)) {
    state.SkipWithError("this CPU cannot run the requested ISA");
    return;
  }
  state.SetLabel(std::string(to_string(use)));
  const Expected want = scalar_reference(d, var, 1);
  cpu_adam_step(use, kCfg, step_args(var, 1), tensors(d, var, 0, d.n, nullptr, nullptr, nullptr, nullptr));
  if (const std::size_t wrong = count_wrong(d, var, want)) {
    state.SkipWithError(fmt::format("{} of {} sampled elements differ from the scalar reference",
                                    wrong, want.idx.size()).c_str());
    return;
  }
  int64_t t = 2;
  for (auto _ : state) {
    cpu_adam_step(use, kCfg, step_args(var, t++), tensors(d, var, 0, d.n, nullptr, nullptr, nullptr, nullptr));
    benchmark::ClobberMemory();
  }
  set_counters(state, d.n, bytes_per_param(var));
}

// ---- the physical limit: the same streams, trivial arithmetic -----------------------------

// p += g, m += g, v += g (fp32), and the 16-bit copy of p: every load and store of the fused
// step, with its conversions, in the same order (all loads of a vector, then all stores: with
// every array on the same 2 MiB alignment, a store followed by a load of another array at the
// same offset is a false store-to-load dependency that cost this kernel 3x on a Zen 4), and
// the same store kind the fused step uses at this size: from 2^20 elements non-temporal stores
// with the loads prefetched 1024 elements ahead (cpu_adam.cpp's kStreamMinElems,
// cpu_adam_kernels.hpp's kPrefetchElems). One add per stream instead of Adam's arithmetic.
constexpr std::size_t kStreamMinElems = std::size_t{1} << 20;
constexpr std::size_t kPrefetchElems = 1024;

template <bool kStream>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void store_f32(float* dst, __m256 x) {
  if constexpr (kStream) _mm256_stream_ps(dst, x);
  else _mm256_storeu_ps(dst, x);
}

template <DType G, bool kOut16, bool kStream>
__attribute__((target("avx2,fma,f16c"))) void stream_range(const Data& d, std::size_t b, std::size_t e) {
  float *p = d.master.data(), *m = d.m.data(), *v = d.v.data();
  uint16_t* out = d.p16.data();
  std::size_t i = b;
  for (; i + 16 <= e; i += 16) {
    if constexpr (kStream)
      for (const float* a : {p, m, v}) _mm_prefetch(reinterpret_cast<const char*>(a + i + kPrefetchElems), _MM_HINT_T0);
    for (std::size_t u = 0; u < 16; u += 8) {
      const std::size_t j = i + u;
      const __m256 p0 = _mm256_loadu_ps(p + j), m0 = _mm256_loadu_ps(m + j), v0 = _mm256_loadu_ps(v + j);
      __m256 g;
      if constexpr (G == DType::fp16)
        g = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d.g16.data() + j)));
      else
        g = _mm256_loadu_ps(d.g32.data() + j);
      const __m256 pn = _mm256_add_ps(p0, g);
      store_f32<kStream>(p + j, pn);
      store_f32<kStream>(m + j, _mm256_add_ps(m0, g));
      store_f32<kStream>(v + j, _mm256_add_ps(v0, g));
      if constexpr (kOut16) {
        __m128i* dst = reinterpret_cast<__m128i*>(out + j);
        const __m128i h = _mm256_cvtps_ph(pn, _MM_FROUND_TO_NEAREST_INT);
        if constexpr (kStream) _mm_stream_si128(dst, h);
        else _mm_storeu_si128(dst, h);
      }
    }
  }
  for (; i < e; ++i) {
    const float g = G == DType::fp16 ? fp16_to_fp32(d.g16[i]) : d.g32[i];
    p[i] += g, m[i] += g, v[i] += g;
    if constexpr (kOut16) out[i] = fp32_to_fp16(p[i]);
  }
  if constexpr (kStream) _mm_sfence();
}

// The same on 16 lanes, for CPUs where the fused step runs its AVX-512 kernel: its stores
// are the same width then (a 512-bit non-temporal store fills a whole 64-byte line; on a
// Zen 4 the AVX2 stream above ran 20-45% slower than this at 2^26).
template <bool kStream>
__attribute__((target("avx512f,avx2,fma,f16c"), always_inline)) inline void store_f32(float* dst, __m512 x) {
  if constexpr (kStream) _mm512_stream_ps(dst, x);
  else _mm512_storeu_ps(dst, x);
}

template <DType G, bool kOut16, bool kStream>
__attribute__((target("avx512f,avx2,fma,f16c"))) void stream_range_avx512(const Data& d, std::size_t b,
                                                                         std::size_t e) {
  float *p = d.master.data(), *m = d.m.data(), *v = d.v.data();
  uint16_t* out = d.p16.data();
  std::size_t i = b;
  for (; i + 32 <= e; i += 32) {
    for (std::size_t u = 0; u < 32; u += 16) {
      const std::size_t j = i + u;
      if constexpr (kStream)
        for (const float* a : {p, m, v}) _mm_prefetch(reinterpret_cast<const char*>(a + j + kPrefetchElems), _MM_HINT_T0);
      const __m512 p0 = _mm512_loadu_ps(p + j), m0 = _mm512_loadu_ps(m + j), v0 = _mm512_loadu_ps(v + j);
      __m512 g;
      if constexpr (G == DType::fp16)
        g = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d.g16.data() + j)));
      else
        g = _mm512_loadu_ps(d.g32.data() + j);
      const __m512 pn = _mm512_add_ps(p0, g);
      store_f32<kStream>(p + j, pn);
      store_f32<kStream>(m + j, _mm512_add_ps(m0, g));
      store_f32<kStream>(v + j, _mm512_add_ps(v0, g));
      if constexpr (kOut16) {
        __m256i* dst = reinterpret_cast<__m256i*>(out + j);
        const __m256i h = _mm512_cvtps_ph(pn, _MM_FROUND_TO_NEAREST_INT);
        if constexpr (kStream) _mm256_stream_si256(dst, h);
        else _mm256_storeu_si256(dst, h);
      }
    }
  }
  stream_range<G, kOut16, false>(d, i, e);  // the tail (fewer than 32 elements)
  if constexpr (kStream) _mm_sfence();
}

// Thread ranges start on multiples of 64 elements of 2 MiB-aligned buffers: every vector store
// is aligned, as the non-temporal ones need.
template <DType G, bool kOut16>
void stream_pass(const Data& d) {
  parallel_ranges(d.n, [&](std::size_t b, std::size_t e) {
    const bool stream = d.n >= kStreamMinElems;
    if (cpu_adam_isa() == CpuIsa::avx512)
      stream ? stream_range_avx512<G, kOut16, true>(d, b, e) : stream_range_avx512<G, kOut16, false>(d, b, e);
    else
      stream ? stream_range<G, kOut16, true>(d, b, e) : stream_range<G, kOut16, false>(d, b, e);
  });
}

template <DType G, bool kOut16>
void BM_Stream(benchmark::State& state) {
  Data& d = data();
  fill(d);
  if (!cpu_supports(CpuIsa::avx2)) {
    state.SkipWithError("the stream kernel needs AVX2+F16C");
    return;
  }
  state.SetLabel(std::string(to_string(cpu_adam_isa() == CpuIsa::avx512 ? CpuIsa::avx512 : CpuIsa::avx2)));
  const std::vector<std::size_t> idx = sample_indices(d.n);
  std::vector<float> want(idx.size());
  for (std::size_t j = 0; j < idx.size(); ++j)
    want[j] = d.master[idx[j]] + (G == DType::fp16 ? fp16_to_fp32(d.g16[idx[j]]) : d.g32[idx[j]]);
  stream_pass<G, kOut16>(d);
  for (std::size_t j = 0; j < idx.size(); ++j)
    if (d.master[idx[j]] != want[j] || (kOut16 && d.p16[idx[j]] != fp32_to_fp16(want[j]))) {
      state.SkipWithError("the stream kernel gives a wrong answer");
      return;
    }
  for (auto _ : state) {
    stream_pass<G, kOut16>(d);
    benchmark::ClobberMemory();
  }
  set_counters(state, d.n, bytes_per_param({G, DType::fp32, kOut16}));
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

// The ratios the issue asks for (from the mean real time per iteration of each benchmark in
// this run).
void print_ratios(const zp::bench::RatioReporter& r) {
  auto time = [&](const std::string& name) { return r.time(name); };
  struct Line {
    std::string what;
    double value;
    std::string unit;
    double goal;
  };
  // Both variants of a pair move the same bytes, so the bandwidth ratio is a time ratio.
  const Line lines[] = {
      {"(1) fused offload step bandwidth / Adam-shaped stream (fp16 grads, fp16 out)",
       100 * time("stream_offload_fp16") / time("fused_offload_fp16"), "%", 90},
      {"(1) fused step bandwidth / Adam-shaped stream (fp32 grads, no 16-bit out)",
       100 * time("stream_fp32") / time("fused_fp32"), "%", 90},
      {"(2) separate passes time / fused offload step time",
       time("separate_offload_fp16") / time("fused_offload_fp16"), "x", 1.8},
      {"    fused offload step: vector / scalar speed-up",
       time("fused_offload_fp16_scalar") / time("fused_offload_fp16"), "x", 1.0}};
  bool header = false;
  for (const Line& l : lines) {
    if (std::isnan(l.value)) continue;  // a benchmark of the pair was filtered out or failed
    if (!header)
      fmt::print("\nratios from this run ({} params, {} threads, cpu_adam isa {}):\n",
                 n_params(), omp_get_max_threads(), to_string(cpu_adam_isa()));
    header = true;
    fmt::print("  {}: {:.2f}{} (goal >= {}{}: {})\n", l.what, l.value, l.unit, l.goal, l.unit,
               l.value >= l.goal ? "met" : "NOT met");
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  auto reg = [](const char* name, auto fn) {
    benchmark::RegisterBenchmark(name, fn)->Unit(benchmark::kMillisecond)->UseRealTime();
  };
  reg("stream_offload_fp16", BM_Stream<DType::fp16, true>);
  reg("fused_offload_fp16", [](benchmark::State& s) { BM_Fused(s, kOffloadFp16, std::nullopt); });
  reg("separate_offload_fp16", BM_Separate);
  reg("stream_fp32", BM_Stream<DType::fp32, false>);
  reg("fused_fp32", [](benchmark::State& s) { BM_Fused(s, kFp32, std::nullopt); });
  reg("fused_bf16_moments", [](benchmark::State& s) { BM_Fused(s, kBf16Moments, std::nullopt); });
  reg("fused_offload_fp16_scalar", [](benchmark::State& s) { BM_Fused(s, kOffloadFp16, CpuIsa::scalar); });
  reg("grad_sum_squares_fp16", BM_GradSumSquares);
  zp::bench::RatioReporter reporter(print_ratios);
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
