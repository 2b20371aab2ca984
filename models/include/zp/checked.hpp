// zp/checked.hpp: 64-bit byte and element arithmetic that refuses to overflow. Every size in
// zeroplan is a uint64_t/int64_t computed through these, so a 10^20-parameter typo becomes an
// error naming the quantity instead of a wrapped number. Not a bignum library.
#pragma once

#include <cstdint>
#include <string_view>

#include <fmt/format.h>

#include "zp/error.hpp"

namespace zp {

// what: the quantity being computed, for the error message ("bytes of params").
inline uint64_t checked_mul(uint64_t a, uint64_t b, std::string_view what) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw Error(fmt::format("{}: {} x {} overflows 64 bits", what, a, b),
                "the sizes are too large to count in bytes; check the model dimensions");
  return r;
}

inline uint64_t checked_add(uint64_t a, uint64_t b, std::string_view what) {
  uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    throw Error(fmt::format("{}: {} + {} overflows 64 bits", what, a, b),
                "the sizes are too large to count in bytes; check the model dimensions");
  return r;
}

inline int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw Error(fmt::format("{}: {} x {} overflows 64 bits", what, a, b),
                "the sizes are too large to count; check the model dimensions");
  return r;
}

inline int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    throw Error(fmt::format("{}: {} + {} overflows 64 bits", what, a, b),
                "the sizes are too large to count; check the model dimensions");
  return r;
}

// Elements of one rank's partition when n elements are split over dp ranks: ceil(n / dp).
// DeepSpeed pads each flat partitioned buffer to a multiple of dp, so every rank holds this many.
inline uint64_t partition_elems(uint64_t n, uint64_t dp) { return n / dp + (n % dp != 0); }

}  // namespace zp
