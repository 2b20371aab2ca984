// cpu_vec.hpp: the two vector loops the CPU kernels share (cpu_kernels.cpp, cpu_flash.cpp),
// written so the compiler vectorises them without -ffast-math. Internal to runtime/src.
#pragma once

#include <cstdint>

namespace zp::runtime::cpu::vec {

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
