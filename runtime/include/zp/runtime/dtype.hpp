// zp/runtime/dtype.hpp: the element types the runtime stores (fp32, fp16, bf16) and exact
// scalar conversions between them, round-to-nearest-even. Bit-level and branch-light so the
// same functions serve CPU kernels, SIMD scalar tails and (marked ZP_HD) CUDA kernels.
// Not a half-precision arithmetic library: all arithmetic happens in fp32.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#if defined(__CUDACC__)
#define ZP_HD __host__ __device__
#else
#define ZP_HD
#endif

namespace zp::runtime {

enum class DType : uint8_t { fp32, fp16, bf16 };

constexpr std::size_t dtype_bytes(DType t) { return t == DType::fp32 ? 4 : 2; }
constexpr std::string_view to_string(DType t) {
  return t == DType::fp32 ? "fp32" : (t == DType::fp16 ? "fp16" : "bf16");
}

ZP_HD inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
ZP_HD inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16: the top 16 bits of an fp32, rounded to nearest even; NaN stays NaN (quiet).
ZP_HD inline uint16_t fp32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}
ZP_HD inline float bf16_to_fp32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// IEEE binary16 from fp32, round to nearest even; overflow gives infinity, tiny values give
// (correctly rounded) subnormals or zero.
ZP_HD inline uint16_t fp32_to_fp16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (abs < 0x38800000u) {
    // Subnormal half (or zero): value = abs_float * 2^24 rounded to an integer.
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to 0
    const uint32_t mant = (abs & 0x007fffffu) | 0x00800000u;
    const uint32_t shift = 126u - (abs >> 23);  // 14..24 for exponents -25..-15
    const uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t mid = 1u << (shift - 1u);
    const uint32_t up = (rem > mid) || (rem == mid && (half & 1u));
    return static_cast<uint16_t>(sign | (half + up));
  }
  // Normal: rebias the exponent (127 -> 15) and round the mantissa from 23 to 10 bits.
  const uint32_t rebased = abs - 0x38000000u;
  const uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rebased + rounding) >> 13));
}

ZP_HD inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  // Subnormal or zero: mant * 2^-24, exact in fp32.
  const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
  return sign ? -v : v;
}

// Load and store one element of any storage type as fp32.
ZP_HD inline float load_as_f32(const void* p, std::size_t i, DType t) {
  switch (t) {
    case DType::fp32: return static_cast<const float*>(p)[i];
    case DType::fp16: return fp16_to_fp32(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_fp32(static_cast<const uint16_t*>(p)[i]);
  }
}
ZP_HD inline void store_from_f32(void* p, std::size_t i, DType t, float v) {
  switch (t) {
    case DType::fp32: static_cast<float*>(p)[i] = v; break;
    case DType::fp16: static_cast<uint16_t*>(p)[i] = fp32_to_fp16(v); break;
    default: static_cast<uint16_t*>(p)[i] = fp32_to_bf16(v); break;
  }
}

// Calls f(std::integral_constant<DType, t>{}) with the runtime type t made a compile-time one,
// so a kernel written once as template <DType D> runs for every storage type with its loads
// and stores folded (load_as_f32(p, i, D) with D a constant compiles to the one conversion).
//   dispatch_dtype(t, [&](auto d) { my_kernel<decltype(d)::value>(args...); });
template <typename F>
decltype(auto) dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::fp32: return f(std::integral_constant<DType, DType::fp32>{});
    case DType::fp16: return f(std::integral_constant<DType, DType::fp16>{});
    default: return f(std::integral_constant<DType, DType::bf16>{});
  }
}

// A MoE router's top-k expert indices: int32 (zeroplan's fused router) or int64 (torch.topk's,
// which torchtitan's per-op recomputation keeps). Built from either pointer type.
struct ExpertIdx {
  void* p = nullptr;
  bool wide = false;  // int64
  ExpertIdx() = default;
  ZP_HD ExpertIdx(int32_t* q) : p(q) {}
  ZP_HD ExpertIdx(const int32_t* q) : p(const_cast<int32_t*>(q)) {}
  ZP_HD ExpertIdx(int64_t* q) : p(q), wide(true) {}
  ZP_HD ExpertIdx(const int64_t* q) : p(const_cast<int64_t*>(q)), wide(true) {}
  ZP_HD int64_t operator[](int64_t i) const {
    return wide ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
  }
  ZP_HD void set(int64_t i, int64_t e) const {
    if (wide) static_cast<int64_t*>(p)[i] = e;
    else static_cast<int32_t*>(p)[i] = static_cast<int32_t>(e);
  }
};

}  // namespace zp::runtime
