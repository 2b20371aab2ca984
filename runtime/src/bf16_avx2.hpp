// bf16_avx2.hpp (internal): fp32 -> bf16 in AVX2 integer arithmetic, bit for bit as dtype.hpp's
// fp32_to_bf16 (round to nearest even; NaNs quieted as (u >> 16) | 0x40), for the AVX2 CPU Adam
// (cpu_adam_avx2.cpp). test_cpu_adam checks bf16_pack16 against fp32_to_bf16 on every one of
// the 2^32 fp32 bit patterns. Only these functions carry target("avx2"); include it from code
// that runs them only where cpuid reports AVX2.
#pragma once

#include <immintrin.h>

#define ZP_BF16_AVX2_INLINE __attribute__((target("avx2"), always_inline)) inline

namespace zp::runtime::detail {

// Eight bf16 values (h) widened to fp32 exactly, in order: each into the upper half of its
// 32-bit lane. One byte shuffle of h in both 128-bit halves (a broadcast load, where h comes
// from memory, costs no shuffle), where a zero extension and a shift take two.
ZP_BF16_AVX2_INLINE __m256 bf16_widen8(__m128i h) {
  const __m256i place = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,  //
                                         -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
  return _mm256_castsi256_ps(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(h), place));
}

// Eight values in 32-bit lanes as fp32_to_bf16 rounds a non-NaN:
// (u + 0x7fff + ((u >> 16) & 1)) >> 16.
ZP_BF16_AVX2_INLINE __m256i bf16_round8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb),
                           16);
}

// The NaN lanes of x as fp32_to_bf16 writes them, (u >> 16) | 0x40, over `rounded`.
ZP_BF16_AVX2_INLINE __m256i bf16_quiet_nans8(__m256 x, __m256i rounded) {
  const __m256i quiet =
      _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

// Sixteen values (x0's eight, then x1's), none NaN, rounded as bf16_round8 does and packed in
// order, in 16-bit lanes: the rounding is done on the packed halves, 16 lanes an instruction.
// With hi and lo the upper and lower 16 bits of u, u + 0x7fff + (hi & 1) carries into hi iff
// lo + (hi & 1) > 0x8000, i.e. iff (lo ^ 0x8000) + (hi & 1) > 0 as signed 16-bit numbers (the
// saturating add keeps 0x7fff + 1 positive); hi never wraps (hi + 1 <= 0xff81 for a non-NaN).
// bf16_round8 twice and a pack take twelve instructions for sixteen values, this ten; the
// AVX2 bf16-moment step's in-cache floor measured 1.04-1.11x faster with it (harness beside
// bench_cpu_adam, one thread, 2^14-element slices).
ZP_BF16_AVX2_INLINE __m256i bf16_round16(__m256 x0, __m256 x1) {
  // Per 128-bit lane: the four upper halves, then the four lower halves.
  const __m256i split = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13,  //
                                         2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13);
  const __m256i a = _mm256_shuffle_epi8(_mm256_castps_si256(x0), split);
  const __m256i b = _mm256_shuffle_epi8(_mm256_castps_si256(x1), split);
  // Lane-interleaved as packus leaves them: [x0 0-3, x1 0-3 | x0 4-7, x1 4-7].
  const __m256i hi = _mm256_unpacklo_epi64(a, b), lo = _mm256_unpackhi_epi64(a, b);
  const __m256i up = _mm256_cmpgt_epi16(  // -1 where the value rounds up
      _mm256_adds_epi16(_mm256_xor_si256(lo, _mm256_set1_epi16(static_cast<short>(0x8000))),
                        _mm256_and_si256(hi, _mm256_set1_epi16(1))),
      _mm256_setzero_si256());
  return _mm256_permute4x64_epi64(_mm256_sub_epi16(hi, up), 0xD8);  // x0's eight, then x1's
}

// Sixteen values (x0's eight, then x1's) as fp32_to_bf16 writes them, NaNs included: the NaN
// fix only when a lane of either is NaN (one compare for both: unordered is true where x0 or
// x1 is NaN).
ZP_BF16_AVX2_INLINE __m256i bf16_pack16(__m256 x0, __m256 x1) {
  if (_mm256_movemask_ps(_mm256_cmp_ps(x0, x1, _CMP_UNORD_Q)) == 0) [[likely]]
    return bf16_round16(x0, x1);
  const __m256i r0 = bf16_quiet_nans8(x0, bf16_round8(x0)),
                r1 = bf16_quiet_nans8(x1, bf16_round8(x1));
  // packus packs within 128-bit halves ([r0 lo, r1 lo, r0 hi, r1 hi]; each lane <= 0xffff, so
  // unsigned saturation keeps it); the permute puts r0's eight values before r1's.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
}

}  // namespace zp::runtime::detail
