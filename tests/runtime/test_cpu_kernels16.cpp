// The fp16 and bf16 CPU kernels (cpu_kernels.hpp's typed overloads) against the fp32 kernels,
// which test_cpu_kernels.cpp checks against float64: the same inputs, rounded to the 16-bit
// type first so both sides read the same values, and the same prefilled outputs (so the
// accumulating kernels' "+=" and the entries a kernel leaves alone are compared too). Not the
// engine (test_engine runs the 16-bit graph) and not the CUDA kernels (test_cuda_ops).
//
// The contract: each output element is the fp32 result rounded once.
// - "exact" where the 16-bit kernel forms its fp32 sums in the fp32 kernel's order: the output
//   must equal store_from_f32(fp32 result) bit for bit.
// - "once" where the order differs (GEMM panels against one SGEMM; owner loops against
//   repeated in-place updates): |got - want| <= u |want| + 1e-5 max|want|, u the unit roundoff
//   of the type (2^-8 bf16, 8 significant bits; 2^-11 fp16, 11) for the one rounding to nearest
//   (at most half a spacing, u |x|), 1e-5 of the tensor's scale for
//   fp32 sums in another order (~100 fp32 ulps). A second rounding (up to 2u), a dropped or
//   doubled contribution (O(1) of an element) fails.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "zp/error.hpp"
#include "zp/runtime/cpu_kernels.hpp"
#include "zp/runtime/dtype.hpp"
#include "zp/runtime/kernel_math.hpp"

namespace cpu = zp::runtime::cpu;
using zp::runtime::DType;
using zp::runtime::load_as_f32;
using zp::runtime::store_from_f32;

namespace {

using Vec = std::vector<float>;
using Bits = std::vector<uint16_t>;

constexpr DType kTypes[] = {DType::fp16, DType::bf16};
constexpr double kReorder = 1e-5;

double unit_roundoff(DType t) { return t == DType::bf16 ? 0x1.0p-8 : 0x1.0p-11; }

// One logical tensor: its 16-bit storage and the exact fp32 values of it.
struct Half {
  Bits h;
  Vec f;
};

Half half(std::size_t n, float sd, DType t, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, sd);
  Half x{Bits(n), Vec(n)};
  for (std::size_t i = 0; i < n; ++i) {
    store_from_f32(x.h.data(), i, t, d(rng));
    x.f[i] = load_as_f32(x.h.data(), i, t);
  }
  return x;
}

std::vector<int32_t> tokens(std::size_t n, int32_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// got (16-bit) is want (fp32) rounded once, bit for bit.
void check_exact(const Bits& got, const Vec& want, DType t) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    uint16_t r[2];  // room for any type's store
    store_from_f32(r, 0, t, want[i]);
    if (r[0] != got[i]) ++bad;
  }
  CAPTURE(to_string(t));
  CHECK(bad == 0);
}

// got within one rounding of want, plus fp32 reordering of the tensor's scale.
void check_once(const Bits& got, const Vec& want, DType t) {
  REQUIRE(got.size() == want.size());
  double scale = 0;
  for (float w : want) scale = std::max(scale, std::fabs(static_cast<double>(w)));
  const double u = unit_roundoff(t);
  std::size_t bad = 0;
  double worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = load_as_f32(got.data(), i, t), w = want[i];
    const double err = std::fabs(g - w), allowed = u * std::fabs(w) + kReorder * scale;
    worst = std::max(worst, err / (u * std::fabs(w) + kReorder * scale + 1e-30));
    if (err > allowed) ++bad;
  }
  CAPTURE(to_string(t));
  CAPTURE(worst);  // the largest error as a fraction of its allowance
  CHECK(bad == 0);
}

// fp32 out (the LM head's logits): only the order of the fp32 sums differs.
void check_reordered(const Vec& got, const Vec& want) {
  double scale = 0, diff = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
    diff = std::max(diff, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  CHECK(diff <= kReorder * scale);
}

}  // namespace

TEST_CASE("16-bit elementwise kernels are the fp32 ones rounded once: gelu, residual, dropout") {
  std::mt19937 rng(11);
  for (DType t : kTypes)
    for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{70001}}) {
      CAPTURE(n);
      const auto ni = static_cast<int64_t>(n);
      const Half x = half(n, 3.0f, t, rng), y = half(n, 1.0f, t, rng);
      Bits o16(n);
      Vec o32(n);
      cpu::gelu_forward(o16.data(), x.h.data(), t, ni);
      cpu::gelu_forward(o32.data(), x.f.data(), ni);
      check_exact(o16, o32, t);
      cpu::gelu_backward(o16.data(), x.h.data(), y.h.data(), t, ni);
      cpu::gelu_backward(o32.data(), x.f.data(), y.f.data(), ni);
      check_exact(o16, o32, t);
      cpu::residual_forward(o16.data(), x.h.data(), y.h.data(), t, ni);
      cpu::residual_forward(o32.data(), x.f.data(), y.f.data(), ni);
      check_exact(o16, o32, t);
      // Dropout: the same mask for either storage, out = x / (1 - p) where kept.
      std::vector<uint8_t> m16(n), m32(n);
      cpu::dropout_forward(o16.data(), m16.data(), x.h.data(), t, 0.1f, 42, ni);
      cpu::dropout_forward(o32.data(), m32.data(), x.f.data(), DType::fp32, 0.1f, 42, ni);
      CHECK(m16 == m32);
      check_exact(o16, o32, t);
      Bits d16 = y.h;  // in place, as the engine runs it
      Vec d32 = y.f;
      cpu::dropout_backward(d16.data(), d16.data(), m16.data(), t, 0.1f, ni);
      cpu::dropout_backward(d32.data(), d32.data(), m32.data(), DType::fp32, 0.1f, ni);
      check_exact(d16, d32, t);
    }
}

TEST_CASE("dropout: masks keep 1 - p of the elements, depend only on the key, scale by 1 / (1 - p)") {
  const int64_t n = 1 << 20;
  for (float p : {0.1f, 0.5f}) {
    CAPTURE(p);
    Vec x(n, 1.0f), out(n);
    std::vector<uint8_t> mask(n), again(n), other(n);
    cpu::dropout_forward(out.data(), mask.data(), x.data(), DType::fp32, p, 7, n);
    int64_t kept = 0, wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      kept += mask[i];
      wrong += out[i] != (mask[i] ? 1.0f / (1.0f - p) : 0.0f);
    }
    CHECK(wrong == 0);
    // Binomial(n, 1 - p): the count lies within 5 standard deviations of its mean.
    const double mean = static_cast<double>(n) * (1.0 - p), sd = std::sqrt(n * p * (1.0 - p));
    CHECK(std::fabs(static_cast<double>(kept) - mean) <= 5 * sd);
    cpu::dropout_forward(out.data(), again.data(), x.data(), DType::fp32, p, 7, n);
    CHECK(again == mask);
    cpu::dropout_forward(out.data(), other.data(), x.data(), DType::fp32, p, 8, n);
    int64_t same = 0;
    for (int64_t i = 0; i < n; ++i) same += other[i] == mask[i];
    // Another key: an independent mask agrees on p^2 + (1 - p)^2 of the elements.
    const double agree = static_cast<double>(n) * (p * p + (1 - p) * (1 - p));
    CHECK(std::fabs(static_cast<double>(same) - agree) <= 5 * std::sqrt(static_cast<double>(n)));
    // Element i's mask is that of mix64(key + i): a mask started at key + k is this one shifted.
    cpu::dropout_forward(out.data(), other.data(), x.data(), DType::fp32, p, 7 + 1000, n - 1000);
    CHECK(std::memcmp(other.data(), mask.data() + 1000, static_cast<std::size_t>(n - 1000)) == 0);
  }
  Vec x(4), out(4);
  std::vector<uint8_t> mask(4);
  CHECK_THROWS_AS(cpu::dropout_forward(out.data(), mask.data(), x.data(), DType::bf16, 1.0f, 1, 4),
                  zp::Error);
  CHECK_THROWS_AS(cpu::dropout_backward(out.data(), x.data(), mask.data(), DType::bf16, -0.1f, 4),
                  zp::Error);
}

TEST_CASE("16-bit embedding: forward exact; backward (repeated tokens) rounded once") {
  std::mt19937 rng(12);
  const int64_t B = 3, T = 11, C = 70, V = 7;  // V small: tokens repeat; C > one 64-wide block
  for (DType t : kTypes) {
    const auto tok = tokens(B * T, V, rng);
    const Half wte = half(V * C, 1.0f, t, rng), wpe = half(T * C, 1.0f, t, rng);
    for (bool positions : {true, false}) {
      CAPTURE(positions);
      Bits o16(B * T * C);
      Vec o32(B * T * C);
      cpu::embedding_forward(o16.data(), tok.data(), wte.h.data(), positions ? wpe.h.data() : nullptr,
                             t, B, T, C);
      cpu::embedding_forward(o32.data(), tok.data(), wte.f.data(), positions ? wpe.f.data() : nullptr,
                             B, T, C);
      check_exact(o16, o32, t);
      const Half dout = half(B * T * C, 1.0f, t, rng);
      Half dwte = half(V * C, 1.0f, t, rng), dwpe = half(T * C, 1.0f, t, rng);
      cpu::embedding_backward(dwte.h.data(), positions ? dwpe.h.data() : nullptr, dout.h.data(),
                              tok.data(), t, B, T, C);
      cpu::embedding_backward(dwte.f.data(), positions ? dwpe.f.data() : nullptr, dout.f.data(),
                              tok.data(), B, T, C);
      check_once(dwte.h, dwte.f, t);
      check_once(dwpe.h, dwpe.f, t);  // untouched without positions: still equal
    }
  }
}

TEST_CASE("16-bit layernorm: forward and input gradient exact; weight gradients rounded once") {
  std::mt19937 rng(13);
  const int64_t N = 37, C = 130;
  for (DType t : kTypes) {
    Half x = half(N * C, 1.0f, t, rng);
    for (std::size_t i = 0; i < x.f.size(); ++i) {  // a mean far from 0: the two-pass variance
      store_from_f32(x.h.data(), i, t, x.f[i] + 30.0f);
      x.f[i] = load_as_f32(x.h.data(), i, t);
    }
    const Half w = half(C, 1.0f, t, rng), b = half(C, 1.0f, t, rng);
    Bits y16(N * C);
    Vec y32(N * C), s16(2 * N), s32(2 * N);
    cpu::layernorm_forward(y16.data(), s16.data(), x.h.data(), w.h.data(), b.h.data(), t, N, C);
    cpu::layernorm_forward(y32.data(), s32.data(), x.f.data(), w.f.data(), b.f.data(), N, C);
    check_exact(y16, y32, t);
    CHECK(s16 == s32);
    const Half dy = half(N * C, 1.0f, t, rng);
    Half dx = half(N * C, 1.0f, t, rng), dw = half(C, 1.0f, t, rng), db = half(C, 1.0f, t, rng);
    cpu::layernorm_backward(dx.h.data(), dw.h.data(), db.h.data(), dy.h.data(), x.h.data(),
                            w.h.data(), s32.data(), t, N, C);
    cpu::layernorm_backward(dx.f.data(), dw.f.data(), db.f.data(), dy.f.data(), x.f.data(),
                            w.f.data(), s32.data(), N, C);
    check_exact(dx.h, dx.f, t);
    check_once(dw.h, dw.f, t);
    check_once(db.h, db.f, t);
  }
}

TEST_CASE("16-bit matmul through fp32 panels: forward and backward rounded once, fp32 logits") {
  std::mt19937 rng(14);
  std::vector<float> panels(cpu::kGemmWorkspaceFloats);
  struct Shape {
    int64_t N, C, OC;
  };
  // One element; sizes below one panel; and more than one panel in every dimension.
  for (const Shape sh : {Shape{1, 1, 1}, Shape{7, 13, 5}, Shape{300, 513, 270}}) {
    const auto [N, C, OC] = sh;
    CAPTURE(N);
    CAPTURE(C);
    CAPTURE(OC);
    for (DType t : kTypes) {
      const Half inp = half(N * C, 1.0f, t, rng), w = half(OC * C, 0.1f, t, rng),
                 bias = half(OC, 1.0f, t, rng);
      for (bool with_bias : {true, false}) {
        CAPTURE(with_bias);
        const void* b16 = with_bias ? bias.h.data() : nullptr;
        const float* b32 = with_bias ? bias.f.data() : nullptr;
        Bits o16(N * OC);
        Vec o32(N * OC), logits(N * OC);
        cpu::matmul_forward(o16.data(), t, inp.h.data(), w.h.data(), b16, t, N, C, OC, panels.data());
        cpu::matmul_forward(o32.data(), inp.f.data(), w.f.data(), b32, N, C, OC);
        check_once(o16, o32, t);
        cpu::matmul_forward(logits.data(), DType::fp32, inp.h.data(), w.h.data(), b16, t, N, C, OC,
                            panels.data());
        check_reordered(logits, o32);

        const Half dout = half(N * OC, 1.0f, t, rng);
        Half dinp = half(N * C, 1.0f, t, rng), dw = half(OC * C, 1.0f, t, rng),
             db = half(OC, 1.0f, t, rng);
        cpu::matmul_backward(dinp.h.data(), dw.h.data(), with_bias ? db.h.data() : nullptr,
                             dout.h.data(), inp.h.data(), w.h.data(), t, N, C, OC, panels.data());
        cpu::matmul_backward(dinp.f.data(), dw.f.data(), with_bias ? db.f.data() : nullptr,
                             dout.f.data(), inp.f.data(), w.f.data(), N, C, OC);
        check_once(dinp.h, dinp.f, t);
        check_once(dw.h, dw.f, t);
        check_once(db.h, db.f, t);  // untouched without bias
      }
    }
  }
  Bits o(4), x(4);
  CHECK_THROWS_AS(cpu::matmul_forward(o.data(), DType::bf16, x.data(), x.data(), nullptr,
                                      DType::bf16, 2, 2, 2, nullptr),
                  zp::Error);
  CHECK_THROWS_AS(cpu::matmul_forward(o.data(), DType::fp16, x.data(), x.data(), nullptr,
                                      DType::bf16, 2, 2, 2, panels.data()),
                  zp::Error);
}

TEST_CASE("16-bit attention: the three steps forward and backward, rounded once") {
  std::mt19937 rng(15);
  const int64_t B = 2, T = 13, C = 48, NH = 4, A = B * NH * T * T;
  for (DType t : kTypes) {
    const Half qkv = half(B * T * 3 * C, 1.0f, t, rng);
    // Outputs start as noise: entries above the diagonal and accumulations compared too.
    Half preatt = half(A, 1.0f, t, rng);
    cpu::attention_scores(preatt.h.data(), qkv.h.data(), t, B, T, C, NH);
    cpu::attention_scores(preatt.f.data(), qkv.f.data(), B, T, C, NH);
    check_once(preatt.h, preatt.f, t);
    // From here both sides read the same (16-bit) pre-attention scores.
    for (std::size_t i = 0; i < preatt.h.size(); ++i) preatt.f[i] = load_as_f32(preatt.h.data(), i, t);
    Half att = half(A, 1.0f, t, rng);
    cpu::attention_softmax(att.h.data(), preatt.h.data(), t, B, NH, T);
    cpu::attention_softmax(att.f.data(), preatt.f.data(), B, NH, T);
    check_exact(att.h, att.f, t);
    for (std::size_t i = 0; i < att.h.size(); ++i) att.f[i] = load_as_f32(att.h.data(), i, t);
    Half out = half(B * T * C, 1.0f, t, rng);
    cpu::attention_values(out.h.data(), att.h.data(), qkv.h.data(), t, B, T, C, NH);
    cpu::attention_values(out.f.data(), att.f.data(), qkv.f.data(), B, T, C, NH);
    check_exact(out.h, out.f, t);

    const Half dout = half(B * T * C, 1.0f, t, rng);
    Half datt = half(A, 1.0f, t, rng), dqkv = half(B * T * 3 * C, 1.0f, t, rng);
    cpu::attention_values_backward(datt.h.data(), dqkv.h.data(), dout.h.data(), att.h.data(),
                                   qkv.h.data(), t, B, T, C, NH);
    cpu::attention_values_backward(datt.f.data(), dqkv.f.data(), dout.f.data(), att.f.data(),
                                   qkv.f.data(), B, T, C, NH);
    check_once(datt.h, datt.f, t);
    check_once(dqkv.h, dqkv.f, t);
    for (std::size_t i = 0; i < datt.h.size(); ++i) datt.f[i] = load_as_f32(datt.h.data(), i, t);
    for (std::size_t i = 0; i < dqkv.h.size(); ++i) dqkv.f[i] = load_as_f32(dqkv.h.data(), i, t);
    // In place, as the engine runs it.
    cpu::attention_softmax_backward(datt.h.data(), datt.h.data(), att.h.data(), t, B, NH, T);
    cpu::attention_softmax_backward(datt.f.data(), datt.f.data(), att.f.data(), B, NH, T);
    check_exact(datt.h, datt.f, t);
    for (std::size_t i = 0; i < datt.h.size(); ++i) datt.f[i] = load_as_f32(datt.h.data(), i, t);
    cpu::attention_scores_backward(dqkv.h.data(), datt.h.data(), qkv.h.data(), t, B, T, C, NH);
    cpu::attention_scores_backward(dqkv.f.data(), datt.f.data(), qkv.f.data(), B, T, C, NH);
    check_once(dqkv.h, dqkv.f, t);
  }
  Bits o(16), x(48);
  CHECK_THROWS_AS(cpu::attention_scores(o.data(), x.data(), DType::bf16, 1, 2, 5, 2), zp::Error);
}

TEST_CASE("16-bit logits gradient: (probs - onehot) * dloss of the fp32 probabilities, rounded once") {
  std::mt19937 rng(16);
  const int64_t N = 9, V = 101;
  for (DType t : kTypes) {
    Vec logits(N * V), losses(N);
    std::normal_distribution<float> d(0.0f, 3.0f);
    for (float& x : logits) x = d(rng);
    const auto targets = tokens(N, static_cast<int32_t>(V), rng);
    cpu::crossentropy_forward(logits.data(), losses.data(), targets.data(), N, V);
    Bits g16(N * V);
    cpu::crossentropy_backward(g16.data(), t, logits.data(), targets.data(), 0.25f, N, V);
    cpu::crossentropy_backward(logits.data(), targets.data(), 0.25f, N, V);  // fp32, in place
    check_exact(g16, logits, t);
  }
}
