// zp/runtime/rng.hpp: counter-based random numbers: the value for element i depends only on
// (seed, i), so every rank can initialise exactly its own slice of the weights without the
// whole model in memory, and runs on 1 or N ranks start from identical weights. Not a
// general-purpose generator.
#pragma once

#include <cmath>
#include <cstdint>

#include "zp/runtime/dtype.hpp"  // ZP_HD: mix64 also runs in CUDA kernels (dropout masks)

namespace zp::runtime {

// splitmix64's finaliser: a bijective 64-bit mix. mix64(k + i) for i = 0, 1, ... is the
// splitmix64 stream seeded with k.
ZP_HD inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A standard normal for (seed, i): Box-Muller on two uniforms in (0, 1].
inline double normal_at(uint64_t seed, uint64_t i) {
  const uint64_t a = mix64(seed ^ mix64(2 * i));
  const uint64_t b = mix64(seed ^ mix64(2 * i + 1));
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace zp::runtime
