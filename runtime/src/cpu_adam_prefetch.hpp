// cpu_adam_prefetch.hpp (internal): the software prefetch of the CPU Adam's vector bodies
// (cpu_adam_avx2.cpp, cpu_adam_avx512.inc), apart from cpu_adam_kernels.hpp because the CUDA
// Adam includes that one. Where to and how far ahead, per variant: kPrefetchToL2 and
// kPrefetchElems there, with what was measured.
#pragma once

#include <xmmintrin.h>

#include <cstddef>

#include "cpu_adam_kernels.hpp"

namespace zp::runtime::detail {

// Every line of kBlock elements of kBytes bytes each, from element `at` of base on.
template <std::size_t kBytes, std::size_t kBlock, auto kHint>
__attribute__((always_inline)) inline void prefetch_lines(const void* base, std::size_t at) {
  const char* first = static_cast<const char*>(base) + at * kBytes;
  for (std::size_t off = 0; off < kBlock * kBytes; off += 64) _mm_prefetch(first + off, kHint);
}

// Every line of master and both moments that the block of kBlock elements at i + ahead reads
// and writes, and with bf16 moments the gradient's and, unless stores of kind kS write it
// non-temporally (a prefetched line that a non-temporal store then takes out of the cache
// again), the copy's lines too (a prefetch never faults, also past the end of an array).
template <DType G, DType M, ParamOut P, Stores kS, std::size_t kBlock>
__attribute__((always_inline)) inline void prefetch_block_ahead(const AdamTensors& t,
                                                                std::size_t i) {
  constexpr auto hint = kPrefetchToL2<G, M> ? _MM_HINT_T2 : _MM_HINT_T0;
  constexpr std::size_t mb = dtype_bytes(M);
  const std::size_t ahead = i + kPrefetchElems<G, M>;
  prefetch_lines<sizeof(float), kBlock, hint>(t.master, ahead);
  prefetch_lines<mb, kBlock, hint>(t.exp_avg, ahead);
  prefetch_lines<mb, kBlock, hint>(t.exp_avg_sq, ahead);
  if constexpr (M == DType::bf16) {
    prefetch_lines<dtype_bytes(G), kBlock, hint>(t.grads, ahead);
    if constexpr (P != ParamOut::none && !streams_copy(kS))
      prefetch_lines<dtype_bytes(param_out_dtype(P)), kBlock, hint>(t.param_out, ahead);
  }
}

}  // namespace zp::runtime::detail
