// cpu_adam_avx512.cpp: the AVX-512 kernels of the CPU Adam (16 floats per vector, blocks
// of 2 vectors) and of the gradient sum of squares; the twin of cpu_adam_avx2.cpp, whose
// blocks alone come in two halves (staggered for bf16 moments). Not dispatch or threading
// (cpu_adam.cpp). Built with the baseline flags: only these functions carry
// target("avx512f,..."), so the file compiles on any x86-64 host;
// cpu_adam.cpp dispatches here only when cpuid reports AVX-512F and BW (every AVX-512 CPU but
// the Xeon Phi, which takes the AVX2 kernels). Two tables from one body
// (cpu_adam_avx512.inc): AVX-512F+BW (bf16 rounded in integer arithmetic, bf16_avx512.hpp),
// and the same with the BF16 and DQ extensions (CpuIsa::avx512bf16: bf16 stores by
// VCVTNE2PS2BF16, one instruction for 32 values, which made the bf16-moment step
// compute-bound; bench_cpu_adam).
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the unused merge source and then
// warn that it "may be used uninitialized" (GCC bug 105593, fixed in GCC 13): silence only that.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>

#include "bf16_avx512.hpp"
#include "cpu_adam_kernels.hpp"
#include "cpu_adam_prefetch.hpp"

namespace zp::runtime::detail {

namespace avx512f {
constexpr bool kHwBf16 = false;
#define ZP_AVX512_TARGET "avx512f,avx512bw,avx2,fma,f16c"
#include "cpu_adam_avx512.inc"
#undef ZP_AVX512_TARGET
}  // namespace avx512f

namespace avx512bf16 {
constexpr bool kHwBf16 = true;
#define ZP_AVX512_TARGET "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c"
#include "cpu_adam_avx512.inc"
#undef ZP_AVX512_TARGET
}  // namespace avx512bf16

const KernelTable kAvx512Table =
    ZP_KERNEL_TABLE(avx512f::adam_avx512, avx512f::sum_squares_avx512, avx512f::kBlock);
const KernelTable kAvx512Bf16Table =
    ZP_KERNEL_TABLE(avx512bf16::adam_avx512, avx512bf16::sum_squares_avx512, avx512bf16::kBlock);

}  // namespace zp::runtime::detail
