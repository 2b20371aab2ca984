// cpu_adam_avx2.cpp: the AVX2+FMA+F16C kernels of the CPU Adam (8 floats per vector, blocks
// of 4 vectors) and of the gradient sum of squares, with the scalar tail of
// cpu_adam_kernels.hpp. Not dispatch or threading (cpu_adam.cpp). Built with the baseline
// flags: only these functions carry target("avx2,fma,f16c"), so no AVX2 code can leak into
// inline functions the rest of the library shares (which per-file -mavx2 would risk).
#include <immintrin.h>

#include <algorithm>
#include <utility>

#include "bf16_avx2.hpp"
#include "cpu_adam_kernels.hpp"
#include "cpu_adam_prefetch.hpp"

#define ZP_AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define ZP_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

namespace zp::runtime::detail {
namespace {

constexpr std::size_t kWidth = 8;   // floats per __m256
constexpr std::size_t kUnroll = 4;  // vectors per block: 32 elements, whole 64-byte lines
static_assert(kUnroll % 2 == 0, "bf16 stores pair the block's vectors");
constexpr std::size_t kBlock = kWidth * kUnroll;

// Eight elements of any storage type, widened to fp32 exactly.
template <DType T>
ZP_AVX2_INLINE __m256 load8(const void* base, std::size_t i) {
  if constexpr (T == DType::fp32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (T == DType::fp16) return _mm256_cvtph_ps(h);  // exact
    return bf16_widen8(h);
  }
}

// Eight fp32 values stored as T, rounded to nearest even exactly as dtype.hpp does; kStream:
// a non-temporal store (base + i on a vector boundary), else an unaligned one.
template <DType T, bool kStream>
ZP_AVX2_INLINE void store8(void* base, std::size_t i, __m256 x) {
  if constexpr (T == DType::fp32) {
    float* dst = static_cast<float*>(base) + i;
    if constexpr (kStream)
      _mm256_stream_ps(dst, x);
    else
      _mm256_storeu_ps(dst, x);
  } else {
    __m128i h;
    if constexpr (T == DType::fp16) {
      // F16C rounds to nearest even, overflow to inf, subnormals correctly (= fp32_to_fp16;
      // NaNs stay NaN but keep their top payload bits where the scalar writes 0x7e00).
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    } else {
      const __m256i r = bf16_quiet_nans8(x, bf16_round8(x));
      // Each 32-bit lane holds a value <= 0xffff, so unsigned saturation packs it unchanged.
      h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    }
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i);
    if constexpr (kStream) _mm_stream_si128(dst, h);
    else _mm_storeu_si128(dst, h);
  }
}

// Sixteen bf16 values (h: x0's eight, then x1's) stored from element i on, one 32-byte store.
template <bool kStream>
ZP_AVX2_INLINE void store16_bf16(void* base, std::size_t i, __m256i h) {
  uint16_t* dst = static_cast<uint16_t*>(base) + i;
  if constexpr (kStream) {  // streaming_aligned promises 16 bytes: two halves
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(h));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 8), _mm256_extracti128_si256(h, 1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
  }
}

// A block's kUnroll vectors stored as T from element i on, bit for bit as store8 would; bf16
// two vectors at a time (bf16_avx2.hpp), rounded on packed halves: kNoNan, the caller knows no
// lane is NaN (bf16_round16), else bf16_pack16 looks for NaNs itself.
template <DType T, bool kStream, bool kNoNan>
ZP_AVX2_INLINE void store_block(void* base, std::size_t i, const __m256 (&x)[kUnroll]) {
  if constexpr (T == DType::bf16) {
    for (std::size_t u = 0; u < kUnroll; u += 2)
      store16_bf16<kStream>(base, i + u * kWidth,
                            kNoNan ? bf16_round16(x[u], x[u + 1]) : bf16_pack16(x[u], x[u + 1]));
  } else {
    for (std::size_t u = 0; u < kUnroll; ++u) store8<T, kStream>(base, i + u * kWidth, x[u]);
  }
}

// True if no lane of the vectors is NaN: one unordered compare per two vectors (true where
// either is NaN), the results OR-ed, one movemask.
template <std::size_t N>
ZP_AVX2_INLINE bool none_nan(const __m256 (&x)[N]) {
  static_assert(N % 2 == 0);
  __m256 nan = _mm256_cmp_ps(x[0], x[1], _CMP_UNORD_Q);
  for (std::size_t k = 2; k < N; k += 2) nan = _mm256_or_ps(nan, _mm256_cmp_ps(x[k], x[k + 1], _CMP_UNORD_Q));
  return _mm256_movemask_ps(nan) == 0;
}

// The per-step constants, broadcast.
struct Coeffs8 {
  __m256 grad_scale, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_step_size,
      inv_sqrt_bc2, eps, decay, m_scale, v_scale;
};

ZP_AVX2_INLINE Coeffs8 broadcast(const AdamCoeffs& c) {
  return {_mm256_set1_ps(c.grad_scale),   _mm256_set1_ps(c.l2),
          _mm256_set1_ps(c.beta1),        _mm256_set1_ps(c.one_minus_beta1),
          _mm256_set1_ps(c.beta2),        _mm256_set1_ps(c.one_minus_beta2),
          _mm256_set1_ps(c.neg_step_size), _mm256_set1_ps(c.inv_sqrt_bc2),
          _mm256_set1_ps(c.eps),          _mm256_set1_ps(c.decay),
          _mm256_set1_ps(c.m_scale),      _mm256_set1_ps(c.v_scale)};
}

// adam_element() on a block of kUnroll vectors, operation for operation, in two halves:
// moments_block updates the block's moments, stores them and leaves the quotient m / denom in
// q; param_block applies q to the block's master and stores master and the copy. Within each
// half every load comes first, then the arithmetic, then the stores, one array after another
// (bf16 two vectors per store; with non-temporal stores the array-by-array order ran the
// bf16-moment step 1.9x faster than vector by vector on the Zen 4 VM, bench_cpu_adam A/B, 2^24
// parameters, six interleaved rounds). A block covers whole 64-byte lines of every array
// (kBlock elements: 2 lines of fp32, one of a 16-bit array) and each half loads and stores
// whole lines of its own arrays, so no load reads a line whose earlier part this thread just
// wrote: with non-temporal stores such a load finds the line half-gathered in a write-combining
// buffer and forces it out as a partial write (the AVX2 bf16-moment step, where four vectors
// share each 16-bit line, ran 6-11x slower that way on a Xeon; bench_cpu_adam). qmem: where
// the staggered body keeps the quotients (stored before the moments' stores), or nullptr.
template <DType G, DType M, Stores kS, bool kL2>
ZP_AVX2_INLINE void moments_block(const Coeffs8& c, const AdamTensors& t, std::size_t i,
                                  __m256 (&q)[kUnroll], float* qmem = nullptr) {
  __m256 m[kUnroll], v[kUnroll], g[kUnroll], p[kUnroll];
  for (std::size_t u = 0; u < kUnroll; ++u) {
    const std::size_t j = i + u * kWidth;
    if constexpr (kL2) p[u] = _mm256_loadu_ps(t.master + j);
    m[u] = load8<M>(t.exp_avg, j);
    v[u] = load8<M>(t.exp_avg_sq, j);
    g[u] = load8<G>(t.grads, j);
  }
  for (std::size_t u = 0; u < kUnroll; ++u) {
    if constexpr (kL2) {
      const __m256 gs = _mm256_fmadd_ps(c.l2, p[u], _mm256_mul_ps(g[u], c.grad_scale));
      m[u] = _mm256_fmadd_ps(c.beta1, m[u], _mm256_mul_ps(c.one_minus_beta1, gs));
      v[u] = _mm256_fmadd_ps(c.beta2, v[u], _mm256_mul_ps(_mm256_mul_ps(c.one_minus_beta2, gs), gs));
    } else {
      m[u] = _mm256_fmadd_ps(c.beta1, m[u], _mm256_mul_ps(c.m_scale, g[u]));
      v[u] = _mm256_fmadd_ps(c.beta2, v[u], _mm256_mul_ps(_mm256_mul_ps(c.v_scale, g[u]), g[u]));
    }
    q[u] = _mm256_div_ps(m[u], _mm256_fmadd_ps(_mm256_sqrt_ps(v[u]), c.inv_sqrt_bc2, c.eps));
  }
  if (qmem != nullptr)
    for (std::size_t u = 0; u < kUnroll; ++u) _mm256_store_ps(qmem + u * kWidth, q[u]);
  // bf16 moments: one NaN test for both arrays; without a NaN every value rounds as a number.
  if constexpr (M == DType::bf16) {
    __m256 mv[2 * kUnroll];  // both arrays for one test (copies the compiler drops)
    for (std::size_t u = 0; u < kUnroll; ++u) mv[u] = m[u], mv[kUnroll + u] = v[u];
    if (none_nan(mv)) [[likely]] {
      store_block<M, streams_state(kS), true>(t.exp_avg, i, m);
      return store_block<M, streams_state(kS), true>(t.exp_avg_sq, i, v);
    }
  }
  store_block<M, streams_state(kS), false>(t.exp_avg, i, m);
  store_block<M, streams_state(kS), false>(t.exp_avg_sq, i, v);
}

template <ParamOut P, Stores kS>
ZP_AVX2_INLINE void param_block(const Coeffs8& c, const AdamTensors& t, std::size_t i,
                                const __m256 (&q)[kUnroll]) {
  __m256 p[kUnroll];
  for (std::size_t u = 0; u < kUnroll; ++u) p[u] = _mm256_loadu_ps(t.master + i + u * kWidth);
  for (std::size_t u = 0; u < kUnroll; ++u)
    p[u] = _mm256_fmadd_ps(c.neg_step_size, q[u], _mm256_mul_ps(p[u], c.decay));
  store_block<DType::fp32, streams_state(kS), false>(t.master, i, p);
  if constexpr (P == ParamOut::bf16) {  // one NaN test for the block's bf16 copy
    if (none_nan(p)) [[likely]]
      return store_block<DType::bf16, streams_copy(kS), true>(t.param_out, i, p);
  }
  if constexpr (P != ParamOut::none)
    store_block<param_out_dtype(P), streams_copy(kS), false>(t.param_out, i, p);
}

// Whether the body staggers the two halves by a block (software pipelining: block b's moments,
// then block b - 1's parameters): for bf16 moments, whose block is the longest (six bf16
// roundings besides the four sqrt and four divisions, which alone take the divider ~32 cycles
// a block on Zen 4). In the plain order everything after the division waits on it, and the
// next block's loads and moments, which would feed the divider, queue behind that; staggered,
// the quotients a block uses are a block old. They wait in a small buffer, stored before the
// moments' roundings (in registers they pushed the loop past the 16 ymm registers and GCC
// copied them through the stack; stored after the roundings the gain was gone). Measured on the
// Zen 4 VM, old and new kernels in one process, per-round ratios of 11-15 interleaved rounds:
// one thread in L1 (1K elements) 1.07-1.09x faster, in L2 (16K) 1.11-1.15x; two threads on
// 2^19-2^20 elements (in L3) 1.09-1.12x, on 2^25 1.04-1.06x (README, bench_cpu_adam item 13).
// Staggering the other variants too lost 8-14% in L1 (fp32 AdamW stores 12 vectors a block,
// and the quotients' 4 more share the one store port) and gained nothing in L2, so they keep
// the plain order.
template <DType M>
constexpr bool kStagger = M == DType::bf16;

// The two halves with the quotients in memory (the staggered body).
template <DType G, DType M, Stores kS, bool kL2>
ZP_AVX2_INLINE void moments_to(const Coeffs8& c, const AdamTensors& t, std::size_t i, float* out) {
  __m256 q[kUnroll];
  moments_block<G, M, kS, kL2>(c, t, i, q, out);
}
template <ParamOut P, Stores kS>
ZP_AVX2_INLINE void params_from(const Coeffs8& c, const AdamTensors& t, std::size_t i,
                                const float* in) {
  __m256 q[kUnroll];
  for (std::size_t u = 0; u < kUnroll; ++u) q[u] = _mm256_load_ps(in + u * kWidth);
  param_block<P, kS>(c, t, i, q);
}

// The vector body on [begin, end), its loads prefetched ahead (kSoftwarePrefetch) or left to
// the hardware, then the scalar tail. kS: the stores, which body_start found usable from begin
// (every array they stream on its boundary there); with non-temporal ones a store fence at the
// end, so that the stores are visible before the caller's OpenMP barrier.
template <DType G, DType M, ParamOut P, Stores kS, bool kL2, bool kSoftwarePrefetch>
ZP_AVX2_FN void adam_avx2_body(const AdamCoeffs& c, const AdamTensors& t, std::size_t begin,
                               std::size_t end) {
  const Coeffs8 c8 = broadcast(c);
  const AdamTensors local = t;  // a copy the stores cannot alias: pointers stay in registers
  std::size_t i = begin;
  if constexpr (kStagger<M>) {
    alignas(32) float quot[2][kBlock];  // two blocks' quotients, taking turns
    float* cur = quot[0];    // block i's quotients
    float* ahead = quot[1];  // block i + 1's
    if (i + kBlock <= end) {
      if constexpr (kSoftwarePrefetch) prefetch_block_ahead<G, M, P, kS, kBlock>(local, i);
      moments_to<G, M, kS, kL2>(c8, local, i, cur);
      for (; i + 2 * kBlock <= end; i += kBlock) {
        if constexpr (kSoftwarePrefetch) prefetch_block_ahead<G, M, P, kS, kBlock>(local, i + kBlock);
        moments_to<G, M, kS, kL2>(c8, local, i + kBlock, ahead);
        params_from<P, kS>(c8, local, i, cur);
        std::swap(cur, ahead);
      }
      params_from<P, kS>(c8, local, i, cur);
      i += kBlock;
    }
  } else {
    for (; i + kBlock <= end; i += kBlock) {
      __m256 q[kUnroll];
      if constexpr (kSoftwarePrefetch) prefetch_block_ahead<G, M, P, kS, kBlock>(local, i);
      moments_block<G, M, kS, kL2>(c8, local, i, q);
      param_block<P, kS>(c8, local, i, q);
    }
  }
  adam_scalar_range<G, M, P>(c, t, i, end);
  if constexpr (kS != Stores::cached) _mm_sfence();
}

// The body for this step's form, decoupled (l2 = 0) or with Adam's L2 term (adam_element),
// and prefetch.
template <DType G, DType M, ParamOut P, Stores kS>
ZP_AVX2_FN void adam_avx2_run(const AdamCoeffs& c, const AdamTensors& t, std::size_t begin,
                              std::size_t end, Prefetch pf) {
  const bool sw = pf == Prefetch::software;
  if (c.l2 == 0.0f)
    sw ? adam_avx2_body<G, M, P, kS, false, true>(c, t, begin, end)
       : adam_avx2_body<G, M, P, kS, false, false>(c, t, begin, end);
  else
    sw ? adam_avx2_body<G, M, P, kS, true, true>(c, t, begin, end)
       : adam_avx2_body<G, M, P, kS, true, false>(c, t, begin, end);
}

// The scalar head and the body for the kind of stores asked for (body_start: where the body
// starts and which kind it can use there).
template <DType G, DType M, ParamOut P>
ZP_AVX2_FN void adam_avx2(const AdamCoeffs& c, const AdamTensors& t, std::size_t begin,
                          std::size_t end, Stores stores, Prefetch pf) {
  const BodyStart b = body_start<M, P>(t, begin, end, stores, kBlock, kWidth);
  adam_scalar_range<G, M, P>(c, t, begin, b.start);
  switch (b.stores) {
    case Stores::streaming: return adam_avx2_run<G, M, P, Stores::streaming>(c, t, b.start, end, pf);
    case Stores::streaming_copy:
      return adam_avx2_run<G, M, P, Stores::streaming_copy>(c, t, b.start, end, pf);
    default: return adam_avx2_run<G, M, P, Stores::cached>(c, t, b.start, end, pf);
  }
}

// Sum of squares: each fp32 lane widened to double (exact), squared and accumulated with an
// fma (x*x is exact in double, so fma(x, x, acc) rounds once, like acc + x*x in the tail).
template <DType G>
ZP_AVX2_FN double sum_squares_avx2(const void* g, std::size_t begin, std::size_t end) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  constexpr std::size_t kSumUnroll = 2;  // four accumulators of four doubles
  std::size_t i = begin;
  for (; i + kWidth * kSumUnroll <= end; i += kWidth * kSumUnroll) {
    for (std::size_t u = 0; u < kSumUnroll; ++u) {
      const __m256 x = load8<G>(g, i + u * kWidth);
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
      acc[2 * u] = _mm256_fmadd_pd(lo, lo, acc[2 * u]);
      acc[2 * u + 1] = _mm256_fmadd_pd(hi, hi, acc[2 * u + 1]);
    }
  }
  const __m256d s = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, s);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + sum_squares_scalar_range<G>(g, i, end);
}

}  // namespace

const KernelTable kAvx2Table = ZP_KERNEL_TABLE(adam_avx2, sum_squares_avx2, kBlock);

}  // namespace zp::runtime::detail
