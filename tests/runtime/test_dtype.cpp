// fp16/bf16 conversions against the compiler's own _Float16 and against bit arithmetic.
#include <doctest/doctest.h>

#include <cmath>
#include <random>

#include "zp/runtime/dtype.hpp"

using namespace zp::runtime;

TEST_CASE("fp16: every half round-trips through fp32, and matches _Float16") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_fp32(static_cast<uint16_t>(h));
    _Float16 ref;
    const uint16_t hh = static_cast<uint16_t>(h);
    std::memcpy(&ref, &hh, 2);
    if (std::isnan(f)) {
      CHECK(std::isnan(static_cast<float>(ref)));
      continue;
    }
    REQUIRE(f == static_cast<float>(ref));
    REQUIRE(fp32_to_fp16(f) == hh);
  }
}

TEST_CASE("fp16: rounding of arbitrary floats equals the compiler's conversion") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 2'000'000; ++i) {
    const float f = bits_f32(bits(rng));
    if (std::isnan(f)) continue;
    const _Float16 ref = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &ref, 2);
    CAPTURE(f);
    REQUIRE(fp32_to_fp16(f) == want);
  }
  // Ties to even, the overflow edge and the smallest subnormal.
  CHECK(fp32_to_fp16(65519.99f) == 0x7bff);
  CHECK(fp32_to_fp16(65520.0f) == 0x7c00);
  CHECK(fp32_to_fp16(5.9604644775390625e-8f) == 0x0001);
  CHECK(fp32_to_fp16(2.98023223876953125e-8f) == 0x0000);  // exactly half: ties to even (0)
}

TEST_CASE("bf16: round to nearest even on the dropped 16 bits") {
  CHECK(fp32_to_bf16(1.0f) == 0x3f80);
  CHECK(fp32_to_bf16(bits_f32(0x3f808000u)) == 0x3f80);  // tie, even stays
  CHECK(fp32_to_bf16(bits_f32(0x3f818000u)) == 0x3f82);  // tie, odd rounds up
  CHECK(fp32_to_bf16(bits_f32(0x3f808001u)) == 0x3f81);
  CHECK(std::isnan(bf16_to_fp32(fp32_to_bf16(std::nanf("")))));
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 1'000'000; ++i) {
    const float f = bits_f32(bits(rng));
    if (std::isnan(f) || std::isinf(f)) continue;
    const float back = bf16_to_fp32(fp32_to_bf16(f));
    // Nearest: no other bf16 value is closer (the neighbours are one ulp away).
    const uint16_t b = fp32_to_bf16(f);
    if (std::isinf(back)) continue;
    const float lo = bf16_to_fp32(static_cast<uint16_t>(b - 1)), hi = bf16_to_fp32(static_cast<uint16_t>(b + 1));
    // (Neighbours across the sign bit or into NaN encodings are not neighbours.)
    if (!std::isnan(lo)) REQUIRE(std::fabs(back - f) <= std::fabs(lo - f));
    if (!std::isnan(hi)) REQUIRE(std::fabs(back - f) <= std::fabs(hi - f));
  }
}
