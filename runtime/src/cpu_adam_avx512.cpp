// cpu_adam_avx512.cpp: the AVX-512F kernels of the CPU Adam (16 floats per vector, blocks
// of 2 vectors) and of the gradient sum of squares; the line-for-line twin of
// cpu_adam_avx2.cpp. Not dispatch or threading (cpu_adam.cpp). Built with the baseline flags:
// only these functions carry target("avx512f,..."), so the file compiles on any x86-64 host;
// cpu_adam.cpp dispatches here only when cpuid reports AVX-512F. Two tables from one body
// (cpu_adam_avx512.inc): AVX-512F, and AVX-512F with the BF16 and DQ extensions (CpuIsa::
// avx512bf16: bf16 stores by VCVTNEPS2BF16, one instruction where the integer rounding takes
// eight, which made the bf16-moment step compute-bound; bench_cpu_adam).
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the unused merge source and then
// warn that it "may be used uninitialized" (GCC bug 105593, fixed in GCC 13): silence only that.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>

#include "cpu_adam_kernels.hpp"
#include "cpu_adam_prefetch.hpp"

namespace zp::runtime::detail {

namespace avx512f {
constexpr bool kHwBf16 = false;
#define ZP_AVX512_TARGET "avx512f,avx2,fma,f16c"
#include "cpu_adam_avx512.inc"
#undef ZP_AVX512_TARGET
}  // namespace avx512f

namespace avx512bf16 {
constexpr bool kHwBf16 = true;
#define ZP_AVX512_TARGET "avx512f,avx512dq,avx512bf16,avx2,fma,f16c"
#include "cpu_adam_avx512.inc"
#undef ZP_AVX512_TARGET
}  // namespace avx512bf16

const KernelTable kAvx512Table =
    ZP_KERNEL_TABLE(avx512f::adam_avx512, avx512f::sum_squares_avx512, avx512f::kBlock);
const KernelTable kAvx512Bf16Table =
    ZP_KERNEL_TABLE(avx512bf16::adam_avx512, avx512bf16::sum_squares_avx512, avx512bf16::kBlock);

}  // namespace zp::runtime::detail
