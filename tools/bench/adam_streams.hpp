// adam_streams.hpp: the memory roofline of a CPU Adam step, for bench_cpu_adam. A family of
// plain stream kernels, each making exactly the loads and stores of one step variant (read the
// gradient; read and write the fp32 master and both moments; write the 16-bit copy) with a
// trivial operation in between (p += g, m += g, v += g, out = p as 16 bits), in several
// shapes: 256- or 512-bit vectors, all loads of a block before its stores or each vector's
// loads then its stores, non-temporal or ordinary stores, prefetch distances. The roofline is
// the fastest of them in the same run, so no shape of the fused kernel's can hide in it: a
// kernel that shares a slow shape with one stream still meets the faster streams.
//
// Nothing here is shared with runtime/src/cpu_adam_*.cpp (only the public dtype conversions):
// written from the memory traffic the step must make, not from the kernels.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "zp/runtime/dtype.hpp"

namespace zp::bench::streams {

using runtime::DType;

// The arrays of one step variant; out == nullptr: no 16-bit copy.
struct Arrays {
  float* p;
  void* m;
  void* v;
  const void* g;
  void* out;
};

// The dtypes of one variant (out_dtype ignored when there is no 16-bit copy).
struct Types {
  DType grads, moments, out;
  bool has_out;
};

enum class Order : uint8_t {
  loads_first,  // a block covering whole 64-byte lines of every array: every load, then every store
  interleaved,  // each vector: its loads, then its stores
};

// One shape of the family.
struct Shape {
  int width;     // floats per vector: 8 (AVX2) or 16 (AVX-512)
  Order order;
  bool nt;       // non-temporal stores
  int prefetch;  // elements ahead that master and the moments are prefetched (0: none)
  bool prefetch_l2 = false;  // into L2 (prefetcht2) rather than L1 (prefetcht0)
  bool nt_copy = false;      // with nt false: non-temporal stores for the 16-bit copy alone
};

inline std::string to_string(const Shape& s) {
  return fmt::format("{}/{}/{}/pf{}{}", s.width == 16 ? "avx512" : "avx2",
                     s.order == Order::loads_first ? "loads_first" : "interleaved",
                     s.nt ? "nt" : s.nt_copy ? "nt_copy" : "cached", s.prefetch, s.prefetch_l2 ? "l2" : "");
}

// The scalar meaning of a stream pass on one element (the check and every tail): fp16 stores
// round to nearest even (as F16C does), bf16 stores truncate (the cheapest exact rule).
inline float load_scalar(const void* base, std::size_t i, DType t) {
  if (t == DType::bf16) {
    const uint32_t u = uint32_t{static_cast<const uint16_t*>(base)[i]} << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
  }
  return runtime::load_as_f32(base, i, t);
}
inline void store_scalar(void* base, std::size_t i, DType t, float x) {
  if (t == DType::bf16) {
    uint32_t u;
    __builtin_memcpy(&u, &x, 4);
    static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(u >> 16);
    return;
  }
  runtime::store_from_f32(base, i, t, x);
}
inline void element(const Arrays& a, const Types& t, std::size_t i) {
  const float g = load_scalar(a.g, i, t.grads);
  const float p = a.p[i] + g;
  a.p[i] = p;
  store_scalar(a.m, i, t.moments, load_scalar(a.m, i, t.moments) + g);
  store_scalar(a.v, i, t.moments, load_scalar(a.v, i, t.moments) + g);
  if (t.has_out) store_scalar(a.out, i, t.out, p);
}

using RangeFn = void (*)(const Arrays&, std::size_t, std::size_t);

// Prefetch every 64-byte line of [i, i + n) of an array of elem_bytes elements, into L1
// (prefetcht0) or, kL2, into L2 (prefetcht2).
template <bool kL2>
inline __attribute__((always_inline)) void prefetch_lines(const void* base, std::size_t i, std::size_t n,
                                                          std::size_t elem_bytes) {
  const char* b = static_cast<const char*>(base) + i * elem_bytes;
  for (std::size_t off = 0; off < n * elem_bytes; off += 64) _mm_prefetch(b + off, kL2 ? _MM_HINT_T2 : _MM_HINT_T0);
}

// The kernels of each width: adam_streams_body.inc compiled twice, once for AVX2 and once for
// AVX-512 (a target pragma applies to every function of the region, so the body is written
// once and still inlines its vector operations).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace w256 {
struct V {
  using F = __m256;
  static constexpr std::size_t kWidth = 8;
  template <DType T>
  static F load(const void* base, std::size_t i) {
    if constexpr (T == DType::fp32) {
      return _mm256_loadu_ps(static_cast<const float*>(base) + i);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
      if constexpr (T == DType::fp16) return _mm256_cvtph_ps(h);
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
  template <DType T, bool kNT>
  static void store(void* base, std::size_t i, F x) {
    if constexpr (T == DType::fp32) {
      float* dst = static_cast<float*>(base) + i;
      if constexpr (kNT) _mm256_stream_ps(dst, x);
      else _mm256_storeu_ps(dst, x);
    } else {
      __m128i h;
      if constexpr (T == DType::fp16) {
        h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
      } else {
        const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
        h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      }
      __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i);
      if constexpr (kNT) _mm_stream_si128(dst, h);
      else _mm_storeu_si128(dst, h);
    }
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
};
#include "adam_streams_body.inc"
}  // namespace w256
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#endif
namespace w512 {
struct V {
  using F = __m512;
  static constexpr std::size_t kWidth = 16;
  template <DType T>
  static F load(const void* base, std::size_t i) {
    if constexpr (T == DType::fp32) {
      return _mm512_loadu_ps(static_cast<const float*>(base) + i);
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
      if constexpr (T == DType::fp16) return _mm512_cvtph_ps(h);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
  template <DType T, bool kNT>
  static void store(void* base, std::size_t i, F x) {
    if constexpr (T == DType::fp32) {
      float* dst = static_cast<float*>(base) + i;
      if constexpr (kNT) _mm512_stream_ps(dst, x);
      else _mm512_storeu_ps(dst, x);
    } else {
      __m256i h;
      if constexpr (T == DType::fp16) h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
      else h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
      __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i);
      if constexpr (kNT) _mm256_stream_si256(dst, h);
      else _mm256_storeu_si256(dst, h);
    }
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
};
#include "adam_streams_body.inc"
}  // namespace w512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif


// The prefetches measured (elements ahead; 0: only the hardware prefetchers): into L1 1024 and
// 4096 ahead, and into L2 2048 ahead (what the runtime's fp32 step does: without that shape
// here, that step ran at 110-114% of this family's best on the Zen 4 VM).
struct Prefetch {
  int elems;
  bool l2;
};
constexpr Prefetch kPrefetches[] = {{0, false}, {1024, false}, {4096, false}, {2048, true}};

template <DType G, DType M, DType O, bool kOut, Order kOrder, bool kNT, int kPF, bool kL2, bool kNTCopy = false>
RangeFn pick_width(int width) {
  return width == 16 ? w512::range<G, M, O, kOut, kOrder, kNT, kPF, kL2, kNTCopy>
                     : w256::range<G, M, O, kOut, kOrder, kNT, kPF, kL2, kNTCopy>;
}
template <DType G, DType M, DType O, bool kOut, Order kOrder, bool kNT>
RangeFn pick_prefetch(const Shape& s) {
  if (s.nt_copy)  // measured without prefetches only (the fastest streams here have none)
    return !kNT && s.prefetch == 0 && !s.prefetch_l2
               ? pick_width<G, M, O, kOut, kOrder, false, 0, false, true>(s.width)
               : nullptr;
  if (s.prefetch == 0 && !s.prefetch_l2) return pick_width<G, M, O, kOut, kOrder, kNT, 0, false>(s.width);
  if (s.prefetch == 1024 && !s.prefetch_l2) return pick_width<G, M, O, kOut, kOrder, kNT, 1024, false>(s.width);
  if (s.prefetch == 4096 && !s.prefetch_l2) return pick_width<G, M, O, kOut, kOrder, kNT, 4096, false>(s.width);
  if (s.prefetch == 2048 && s.prefetch_l2) return pick_width<G, M, O, kOut, kOrder, kNT, 2048, true>(s.width);
  return nullptr;
}
template <DType G, DType M, DType O, bool kOut>
RangeFn pick_shape(const Shape& s) {
  if (s.order == Order::loads_first)
    return s.nt ? pick_prefetch<G, M, O, kOut, Order::loads_first, true>(s)
                : pick_prefetch<G, M, O, kOut, Order::loads_first, false>(s);
  return s.nt ? pick_prefetch<G, M, O, kOut, Order::interleaved, true>(s)
              : pick_prefetch<G, M, O, kOut, Order::interleaved, false>(s);
}

// The kernel of one variant and shape, or nullptr for a combination not instantiated.
// Variants: fp32 AdamW (fp32 grads, no copy), the offload step with fp16 grads and an fp16
// copy or bf16 grads and a bf16 copy, and bf16 moments (bf16 grads, bf16 copy).
inline RangeFn kernel(const Types& t, const Shape& s) {
  using enum DType;
  if (s.nt_copy && (s.nt || !t.has_out)) return nullptr;  // a copy-only shape needs a copy
  if (t.grads == fp32 && t.moments == fp32 && !t.has_out) return pick_shape<fp32, fp32, fp16, false>(s);
  if (t.grads == fp16 && t.moments == fp32 && t.has_out && t.out == fp16) return pick_shape<fp16, fp32, fp16, true>(s);
  if (t.grads == bf16 && t.moments == fp32 && t.has_out && t.out == bf16) return pick_shape<bf16, fp32, bf16, true>(s);
  if (t.grads == bf16 && t.moments == bf16 && t.has_out && t.out == bf16) return pick_shape<bf16, bf16, bf16, true>(s);
  return nullptr;
}

}  // namespace zp::bench::streams
