// cpu_vec.hpp: what the CPU kernels share (cpu_kernels.cpp, cpu_flash.cpp, cpu_moe.cpp): the
// two vector loops, written so the compiler vectorises them without -ffast-math, and the typed
// element loads and stores of the 16-bit kernels. Internal to runtime/src.
#pragma once

#include <cstddef>
#include <cstdint>

#include "zp/runtime/dtype.hpp"

namespace zp::runtime::cpu::vec {

// Element i of a buffer stored as D, as fp32 (the switch folds away: D is a constant).
template <DType D>
inline float ld(const void* p, int64_t i) {
  return load_as_f32(p, static_cast<std::size_t>(i), D);
}
template <DType D>
inline void st(void* p, int64_t i, float v) {
  store_from_f32(p, static_cast<std::size_t>(i), D, v);
}
// p[i] = round(p[i] + v): one accumulation, one rounding.
template <DType D>
inline void add_st(void* p, int64_t i, float v) {
  st<D>(p, i, ld<D>(p, i) + v);
}
// The address of element e of a buffer stored as D.
template <DType D>
inline const void* elem(const void* p, int64_t e) {
  return static_cast<const std::byte*>(p) + e * static_cast<int64_t>(dtype_bytes(D));
}

// Dot product of two contiguous vectors; `omp simd` lets the compiler vectorise the
// reduction (it may reassociate it: the order is the vector lanes', fixed for a build).
inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += alpha * x over contiguous vectors.
inline void axpy(float* y, float alpha, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace zp::runtime::cpu::vec
