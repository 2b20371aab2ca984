// bf16_avx512.hpp (internal): fp32 -> bf16 with AVX-512, bit for bit as dtype.hpp's
// fp32_to_bf16 (round to nearest even; NaNs quieted as (u >> 16) | 0x40), for the AVX-512 CPU
// Adam (cpu_adam_avx512.inc). test_cpu_adam checks bf16_pack32_avx512 and
// bf16_pack32_avx512bf16 against fp32_to_bf16 on every one of the 2^32 fp32 bit patterns. Only
// these functions carry their targets; include it from code that runs them only where cpuid
// reports those extensions (CpuIsa::avx512: F and BW; avx512bf16: also DQ and BF16).
#pragma once

#include <immintrin.h>

#define ZP_BF16_AVX512_INLINE __attribute__((target("avx512f,avx512bw"), always_inline)) inline
#define ZP_BF16_AVX512BF16_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16"), always_inline)) inline

namespace zp::runtime::detail {

// Sixteen values, none NaN, rounded in 32-bit lanes: u + 0x7fff + ((u >> 16) & 1), whose
// upper half is the bf16 (bf16_avx2.hpp's bf16_round8 before its shift).
ZP_BF16_AVX512_INLINE __m512i bf16_round_lanes16_avx512(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
}

// Sixteen values, NaNs included, as fp32_to_bf16 writes them: the rounded upper halves, or
// (u >> 16) | 0x40 for a NaN, truncated to 16 bits each.
ZP_BF16_AVX512_INLINE __m256i bf16_lanes16_avx512(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i rounded = _mm512_srli_epi32(bf16_round_lanes16_avx512(x), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet));
}

// Thirty-two values (x0's sixteen, then x1's), none NaN: rounded in 32-bit lanes, and the 32
// upper halves gathered in order by one two-source word permute (AVX-512BW): nine
// instructions for 32 values where two bf16_lanes16_avx512 take twenty. Rounding on packed
// 16-bit halves instead (bf16_avx2.hpp's bf16_round16) needs two of these permutes, which are
// slow on Zen 4: that form ran the bf16-moment step's arithmetic 1.10x slower than this one
// (a harness beside the kernels, one thread in cache, Zen 4 VM).
ZP_BF16_AVX512_INLINE __m512i bf16_round32_avx512(__m512 x0, __m512 x1) {
  // Word k: value k's upper half, word 2k + 1 of x0:x1 (an index >= 32 selects from x1).
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35,
                                       33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(bf16_round_lanes16_avx512(x0), odd, bf16_round_lanes16_avx512(x1));
}

// Thirty-two values (x0's sixteen, then x1's) as fp32_to_bf16 writes them, NaNs included: the
// lanes' path only when a lane of either is NaN (one compare for both: unordered is true
// where x0 or x1 is NaN).
ZP_BF16_AVX512_INLINE __m512i bf16_pack32_avx512(__m512 x0, __m512 x1) {
  if (_mm512_cmp_ps_mask(x0, x1, _CMP_UNORD_Q) == 0) [[likely]]
    return bf16_round32_avx512(x0, x1);
  return _mm512_inserti64x4(_mm512_castsi256_si512(bf16_lanes16_avx512(x0)),
                            bf16_lanes16_avx512(x1), 1);
}

// The same with AVX-512 BF16's two-source VCVTNE2PS2BF16 (Intel SDM: convert_fp32_to_bfloat16:
// nearest even, NaNs quieted as (u >> 16) | 0x40, exactly as dtype.hpp), one instruction for
// 32 values; it flushes denormal inputs to zero, so a pair with a denormal lane (fpclass 0x20)
// takes the lanes' path.
ZP_BF16_AVX512BF16_INLINE __m512i bf16_pack32_avx512bf16(__m512 x0, __m512 x1) {
  if ((_mm512_fpclass_ps_mask(x0, 0x20) | _mm512_fpclass_ps_mask(x1, 0x20)) == 0) [[likely]]
    return (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  // the second source fills the lower half
  return _mm512_inserti64x4(_mm512_castsi256_si512(bf16_lanes16_avx512(x0)),
                            bf16_lanes16_avx512(x1), 1);
}

}  // namespace zp::runtime::detail
