// cpu_adam_prefetch.hpp (internal): the software prefetch of the CPU Adam's vector bodies
// (cpu_adam_avx2.cpp, cpu_adam_avx512.inc), apart from cpu_adam_kernels.hpp because the CUDA
// Adam includes that one. Where to and how far ahead, per variant: kPrefetchToL2 and
// kPrefetchElems there, with what was measured.
#pragma once

#include <xmmintrin.h>

#include <cstddef>

#include "cpu_adam_kernels.hpp"

namespace zp::runtime::detail {

// Every line of master and both moments that the block of kBlock elements at i + ahead reads
// and writes, and with bf16 moments the gradient's and the copy's lines too (a prefetch never
// faults, also past the end of an array).
template <DType G, DType M, ParamOut P, std::size_t kBlock>
__attribute__((always_inline)) inline void prefetch_block_ahead(const AdamTensors& t,
                                                                std::size_t i) {
  constexpr auto hint = kPrefetchToL2<G, M> ? _MM_HINT_T2 : _MM_HINT_T0;
  constexpr std::size_t mb = dtype_bytes(M);
  const std::size_t ahead = i + kPrefetchElems<G, M>;
  for (std::size_t off = 0; off < kBlock * sizeof(float); off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(t.master + ahead) + off, hint);
  for (std::size_t off = 0; off < kBlock * mb; off += 64) {
    _mm_prefetch(static_cast<const char*>(t.exp_avg) + ahead * mb + off, hint);
    _mm_prefetch(static_cast<const char*>(t.exp_avg_sq) + ahead * mb + off, hint);
  }
  if constexpr (M == DType::bf16) {
    constexpr std::size_t gb = dtype_bytes(G);
    for (std::size_t off = 0; off < kBlock * gb; off += 64)
      _mm_prefetch(static_cast<const char*>(t.grads) + ahead * gb + off, hint);
    if constexpr (P != ParamOut::none) {
      constexpr std::size_t pb = dtype_bytes(param_out_dtype(P));
      for (std::size_t off = 0; off < kBlock * pb; off += 64)
        _mm_prefetch(static_cast<const char*>(t.param_out) + ahead * pb + off, hint);
    }
  }
}

}  // namespace zp::runtime::detail
