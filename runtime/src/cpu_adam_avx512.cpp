// cpu_adam_avx512.cpp: the AVX-512F kernels of the CPU Adam (16 floats per vector, blocks
// of 2 vectors) and of the gradient sum of squares; the line-for-line twin of
// cpu_adam_avx2.cpp. Not dispatch or threading (cpu_adam.cpp). Built with the baseline flags:
// only these functions carry target("avx512f,..."), so the file compiles on any x86-64 host;
// cpu_adam.cpp dispatches here only when cpuid reports AVX-512F.
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the unused merge source and then
// warn that it "may be used uninitialized" (GCC bug 105593, fixed in GCC 13): silence only that.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>

#include "cpu_adam_kernels.hpp"

#define ZP_AVX512_FN __attribute__((target("avx512f,avx2,fma,f16c")))
#define ZP_AVX512_INLINE __attribute__((target("avx512f,avx2,fma,f16c"), always_inline)) inline

namespace zp::runtime::detail {
namespace {

constexpr std::size_t kWidth = 16;  // floats per __m512
constexpr std::size_t kUnroll = 2;  // vectors per block: 32 elements, whole 64-byte lines
constexpr std::size_t kBlock = kWidth * kUnroll;

template <DType T>
ZP_AVX512_INLINE __m512 load16(const void* base, std::size_t i) {
  if constexpr (T == DType::fp32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (T == DType::fp16) return _mm512_cvtph_ps(h);  // exact
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16: << 16
  }
}

// Rounded to nearest even exactly as dtype.hpp does (see cpu_adam_avx2.cpp's store8);
// kStream: a non-temporal store (base + i on a vector boundary), else an unaligned one.
template <DType T, bool kStream>
ZP_AVX512_INLINE void store16(void* base, std::size_t i, __m512 x) {
  if constexpr (T == DType::fp32) {
    float* dst = static_cast<float*>(base) + i;
    if constexpr (kStream) _mm512_stream_ps(dst, x);
    else _mm512_storeu_ps(dst, x);
  } else {
    __m256i h;
    if constexpr (T == DType::fp16) {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    } else {
      const __m512i u = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      const __m512i rounded = _mm512_srli_epi32(
          _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
      const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
      const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet));  // truncating
    }
    __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i);
    if constexpr (kStream) _mm256_stream_si256(dst, h);
    else _mm256_storeu_si256(dst, h);
  }
}

struct Coeffs16 {
  __m512 grad_scale, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_step_size,
      inv_sqrt_bc2, eps, decay;
};

ZP_AVX512_INLINE Coeffs16 broadcast(const AdamCoeffs& c) {
  return {_mm512_set1_ps(c.grad_scale),   _mm512_set1_ps(c.l2),
          _mm512_set1_ps(c.beta1),        _mm512_set1_ps(c.one_minus_beta1),
          _mm512_set1_ps(c.beta2),        _mm512_set1_ps(c.one_minus_beta2),
          _mm512_set1_ps(c.neg_step_size), _mm512_set1_ps(c.inv_sqrt_bc2),
          _mm512_set1_ps(c.eps),          _mm512_set1_ps(c.decay)};
}

// adam_element() on one block of kUnroll vectors, operation for operation: every load of the
// block first, then the arithmetic, then every store. A block covers whole 64-byte lines of
// every array (kBlock elements: 2 lines of fp32, one of a 16-bit array), so no load of a
// block reads a line whose earlier part this thread just wrote: with non-temporal stores such
// a load finds the line half-gathered in a write-combining buffer and forces it out as a
// partial write (bench_cpu_adam measured the interleaved order at 47-85% of the memory
// roofline with AVX2, and bf16 moments slowest: four vectors share each 16-bit line).
template <DType G, DType M, ParamOut P, bool kStream>
ZP_AVX512_INLINE void adam16_block(const Coeffs16& c, const AdamTensors& t, std::size_t i) {
  __m512 p[kUnroll], m[kUnroll], v[kUnroll], g[kUnroll];
  for (std::size_t u = 0; u < kUnroll; ++u) {
    const std::size_t j = i + u * kWidth;
    p[u] = _mm512_loadu_ps(t.master + j);
    m[u] = load16<M>(t.exp_avg, j);
    v[u] = load16<M>(t.exp_avg_sq, j);
    g[u] = load16<G>(t.grads, j);
  }
  for (std::size_t u = 0; u < kUnroll; ++u) {
    const __m512 gs = _mm512_fmadd_ps(c.l2, p[u], _mm512_mul_ps(g[u], c.grad_scale));
    m[u] = _mm512_fmadd_ps(c.beta1, m[u], _mm512_mul_ps(c.one_minus_beta1, gs));
    v[u] = _mm512_fmadd_ps(c.beta2, v[u], _mm512_mul_ps(_mm512_mul_ps(c.one_minus_beta2, gs), gs));
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v[u]), c.inv_sqrt_bc2, c.eps);
    p[u] = _mm512_fmadd_ps(c.neg_step_size, _mm512_div_ps(m[u], denom), _mm512_mul_ps(p[u], c.decay));
  }
  for (std::size_t u = 0; u < kUnroll; ++u) {
    const std::size_t j = i + u * kWidth;
    store16<DType::fp32, kStream>(t.master, j, p[u]);
    store16<M, kStream>(t.exp_avg, j, m[u]);
    store16<M, kStream>(t.exp_avg_sq, j, v[u]);
    if constexpr (P != ParamOut::none) store16<param_out_dtype(P), kStream>(t.param_out, j, p[u]);
  }
}

// Every line of the arrays read and written, kPrefetchElems ahead of block i (a prefetch never
// faults, also past the end).
template <DType M>
ZP_AVX512_INLINE void prefetch16(const AdamTensors& t, std::size_t i) {
  const std::size_t ahead = i + kPrefetchElems, mb = dtype_bytes(M);
  for (std::size_t off = 0; off < kBlock * 4; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(t.master + ahead) + off, _MM_HINT_T0);
  for (std::size_t off = 0; off < kBlock * mb; off += 64) {
    _mm_prefetch(static_cast<const char*>(t.exp_avg) + ahead * mb + off, _MM_HINT_T0);
    _mm_prefetch(static_cast<const char*>(t.exp_avg_sq) + ahead * mb + off, _MM_HINT_T0);
  }
}

// The vector body on [begin, end), its loads prefetched, then the scalar tail. kStream: begin
// is on a vector boundary of every written array (streaming_aligned); non-temporal stores and
// a store fence so that the stores are visible before the caller's OpenMP barrier.
template <DType G, DType M, ParamOut P, bool kStream>
ZP_AVX512_FN void adam_avx512_body(const AdamCoeffs& c, const AdamTensors& t, std::size_t begin,
                                   std::size_t end) {
  const Coeffs16 c16 = broadcast(c);
  const AdamTensors local = t;  // a copy the stores cannot alias: pointers stay in registers
  std::size_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    prefetch16<M>(local, i);
    adam16_block<G, M, P, kStream>(c16, local, i);
  }
  adam_scalar_range<G, M, P>(c, t, i, end);
  if constexpr (kStream) _mm_sfence();
}

// Streaming: a scalar head up to master's block boundary (128 bytes), then the streaming body
// if every written array is on its vector boundary there (else the cached body: still correct,
// not streamed).
template <DType G, DType M, ParamOut P>
ZP_AVX512_FN void adam_avx512(const AdamCoeffs& c, const AdamTensors& t, std::size_t begin,
                              std::size_t end, Stores stores) {
  if (stores == Stores::streaming) {
    const std::size_t head =
        std::min(end, begin + elems_to_alignment(t.master + begin, kBlock * sizeof(float)));
    adam_scalar_range<G, M, P>(c, t, begin, head);
    if (streaming_aligned<M, P>(t, head, kWidth))
      return adam_avx512_body<G, M, P, true>(c, t, head, end);
    begin = head;
  }
  adam_avx512_body<G, M, P, false>(c, t, begin, end);
}

template <DType G>
ZP_AVX512_FN double sum_squares_avx512(const void* g, std::size_t begin, std::size_t end) {
  __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                    _mm512_setzero_pd()};
  std::size_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    for (std::size_t u = 0; u < kUnroll; ++u) {
      const __m512 x = load16<G>(g, i + u * kWidth);
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
      const __m512d hi = _mm512_cvtps_pd(
          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
      acc[2 * u] = _mm512_fmadd_pd(lo, lo, acc[2 * u]);
      acc[2 * u + 1] = _mm512_fmadd_pd(hi, hi, acc[2 * u + 1]);
    }
  }
  const __m512d s = _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3]));
  alignas(64) double lanes[8];
  _mm512_store_pd(lanes, s);
  const double sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                     ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  return sum + sum_squares_scalar_range<G>(g, i, end);
}

}  // namespace

const KernelTable kAvx512Table = ZP_KERNEL_TABLE(adam_avx512, sum_squares_avx512, kBlock);

}  // namespace zp::runtime::detail
