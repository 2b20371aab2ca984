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

// ---- LLaMA-family and MoE kernels (the typed overloads of cpu_kernels.hpp's LLaMA section):
// the same comparison, fp32 kernels on the 16-bit inputs' exact values. Accumulating outputs
// start from noise, so the old value's one addition is compared too.

namespace {

// The exact fp32 values of a 16-bit buffer (both sides then read the same inputs).
Vec values(const Bits& h, DType t) {
  Vec f(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) f[i] = load_as_f32(h.data(), i, t);
  return f;
}
void reload(Half& x, DType t) { x.f = values(x.h, t); }

cpu::QkvT fused16(const Bits& qkv, const cpu::AttnShape& s) {
  const uint16_t* p = qkv.data();
  return {p, p + s.k_off(), p + s.v_off(), s.row(), s.row(), s.row()};
}

}  // namespace

TEST_CASE("16-bit RMSNorm: forward and input gradient exact, weight gradient rounded once") {
  std::mt19937 rng(21);
  const int64_t N = 37, C = 130;  // C > one 64-wide block of the weight gradient
  for (DType t : kTypes) {
    const Half x = half(N * C, 2.0f, t, rng), w = half(C, 1.0f, t, rng);
    Bits y16(N * C);
    Vec y32(N * C), s16(N), s32(N);
    cpu::rmsnorm_forward(y16.data(), s16.data(), x.h.data(), w.h.data(), 1e-5f, t, N, C);
    cpu::rmsnorm_forward(y32.data(), s32.data(), x.f.data(), w.f.data(), 0.0f, 1e-5f, N, C);
    check_exact(y16, y32, t);
    CHECK(s16 == s32);
    const Half dy = half(N * C, 1.0f, t, rng);
    Half dx = half(N * C, 1.0f, t, rng), dw = half(C, 1.0f, t, rng);
    cpu::rmsnorm_backward(dx.h.data(), dw.h.data(), dy.h.data(), x.h.data(), w.h.data(), s32.data(),
                          t, N, C);
    cpu::rmsnorm_backward(dx.f.data(), dw.f.data(), dy.f.data(), x.f.data(), w.f.data(), 0.0f,
                          s32.data(), N, C);
    check_exact(dx.h, dx.f, t);
    check_once(dw.h, dw.f, t);
  }
}

TEST_CASE("16-bit head RMSNorm (q/k norms): exact, over the fused rows and over q|k apart") {
  std::mt19937 rng(22);
  const int64_t N = 11, NH = 4, KVH = 2, HS = 8, R = (NH + 2 * KVH) * HS, H = NH + KVH;
  for (DType t : kTypes) {
    const Half qkv = half(N * R, 2.0f, t, rng), w = half(2 * HS, 1.0f, t, rng);
    const cpu::AttnShape s{1, N, NH, KVH, HS};
    const cpu::QkvT in16 = fused16(qkv.h, s);
    const cpu::Qkv in32 = cpu::Qkv::fused(qkv.f.data(), s);
    Bits y16(N * H * HS);
    Vec y32(N * H * HS), s16(N * H), s32(N * H);
    cpu::head_rmsnorm_forward(y16.data(), s16.data(), in16, w.h.data(), 1e-6f, t, N, NH, KVH, HS);
    cpu::head_rmsnorm_forward(y32.data(), s32.data(), in32, w.f.data(), 1e-6f, N, NH, KVH, HS);
    check_exact(y16, y32, t);
    CHECK(s16 == s32);
    // In place over the fused gradient: q and k heads overwritten, v heads untouched.
    Half dqkv = half(N * R, 1.0f, t, rng), dw = half(2 * HS, 1.0f, t, rng);
    cpu::head_rmsnorm_backward(dqkv.h.data(), R, dw.h.data(), in16, w.h.data(), s32.data(), t, N, NH,
                               KVH, HS);
    cpu::head_rmsnorm_backward(dqkv.f.data(), R, dw.f.data(), in32, w.f.data(), s32.data(), N, NH,
                               KVH, HS);
    check_exact(dqkv.h, dqkv.f, t);
    check_exact(dw.h, dw.f, t);  // the fp32 kernel also sums from 0 and adds once
  }
}

TEST_CASE("16-bit rotary embeddings and SwiGLU: exact") {
  std::mt19937 rng(23);
  const int64_t B = 2, T = 9, NH = 4, KVH = 2, HS = 8, R = (NH + 2 * KVH) * HS;
  const std::vector<float> inv_freq = cpu::rope_default_inv_freq(10000.0, 6);  // partial: 6 of 8
  for (DType t : kTypes) {
    Half x = half(B * T * R, 1.0f, t, rng);
    cpu::rope_forward(x.h.data(), inv_freq.data(), 1.25f, t, B, T, R, NH + KVH, HS, 6);
    cpu::rope_forward(x.f.data(), inv_freq.data(), 1.25f, B, T, R, NH + KVH, HS, 6);
    check_exact(x.h, x.f, t);
    reload(x, t);
    cpu::rope_backward(x.h.data(), inv_freq.data(), 1.25f, t, B, T, R, NH + KVH, HS, 6);
    cpu::rope_backward(x.f.data(), inv_freq.data(), 1.25f, B, T, R, NH + KVH, HS, 6);
    check_exact(x.h, x.f, t);

    const int64_t N = 7, F = 70;
    const Half g = half(N * F, 2.0f, t, rng), u = half(N * F, 1.0f, t, rng), dy = half(N * F, 1.0f, t, rng);
    Bits o16(N * F), d16(N * 2 * F);
    Vec o32(N * F), d32(N * 2 * F);
    cpu::swiglu_forward(o16.data(), g.h.data(), u.h.data(), t, N * F);
    cpu::swiglu_forward(o32.data(), g.f.data(), u.f.data(), N * F);
    check_exact(o16, o32, t);
    cpu::swiglu_backward(d16.data(), dy.h.data(), g.h.data(), u.h.data(), t, N, F);
    cpu::swiglu_backward(d32.data(), dy.f.data(), g.f.data(), u.f.data(), N, F);
    check_exact(d16, d32, t);
  }
}

TEST_CASE("16-bit grouped-query attention with sliding windows: the three steps, rounded once") {
  std::mt19937 rng(24);
  const int64_t B = 2, T = 13, NH = 4, KVH = 2, HS = 70;  // HS > one 64-wide block
  for (int64_t window : {int64_t{0}, int64_t{5}})
    for (DType t : kTypes) {
      CAPTURE(window);
      const cpu::AttnShape s{B, T, NH, KVH, HS, window};
      const int64_t A = B * NH * T * T, R = s.row();
      const Half qkv = half(B * T * R, 0.3f, t, rng);
      const cpu::QkvT in16 = fused16(qkv.h, s);
      const cpu::Qkv in32 = cpu::Qkv::fused(qkv.f.data(), s);
      Half preatt = half(A, 1.0f, t, rng);  // noise: the entries the kernel leaves alone too
      cpu::attention_scores(preatt.h.data(), in16, t, s);
      cpu::attention_scores(preatt.f.data(), in32, s);
      check_once(preatt.h, preatt.f, t);
      reload(preatt, t);
      Half att = half(A, 1.0f, t, rng);
      cpu::attention_softmax(att.h.data(), preatt.h.data(), t, s);
      cpu::attention_softmax(att.f.data(), preatt.f.data(), s);
      check_exact(att.h, att.f, t);
      reload(att, t);
      Half out = half(B * T * NH * HS, 1.0f, t, rng);
      cpu::attention_values(out.h.data(), att.h.data(), in16, t, s);
      cpu::attention_values(out.f.data(), att.f.data(), in32, s);
      check_exact(out.h, out.f, t);

      const Half dout = half(B * T * NH * HS, 1.0f, t, rng);
      Half datt = half(A, 1.0f, t, rng), dqkv = half(B * T * R, 1.0f, t, rng);
      cpu::attention_values_backward(datt.h.data(), dqkv.h.data(), dout.h.data(), att.h.data(), in16, t, s);
      cpu::attention_values_backward(datt.f.data(), dqkv.f.data(), dout.f.data(), att.f.data(), in32, s);
      check_once(datt.h, datt.f, t);
      check_once(dqkv.h, dqkv.f, t);
      reload(datt, t);
      reload(dqkv, t);
      cpu::attention_softmax_backward(datt.h.data(), datt.h.data(), att.h.data(), t, s);  // in place
      cpu::attention_softmax_backward(datt.f.data(), datt.f.data(), att.f.data(), s);
      check_exact(datt.h, datt.f, t);
      reload(datt, t);
      cpu::attention_scores_backward(dqkv.h.data(), datt.h.data(), in16, t, s);
      cpu::attention_scores_backward(dqkv.f.data(), datt.f.data(), in32, s);
      check_once(dqkv.h, dqkv.f, t);
    }
}

TEST_CASE("16-bit flash attention (GQA, windows, dropout): out and dqkv rounded once") {
  std::mt19937 rng(25);
  const int64_t B = 2, T = 70, NH = 4, KVH = 2, HS = 8;  // T > one 64-query block
  for (int64_t window : {int64_t{0}, int64_t{20}})
    for (float p : {0.0f, 0.1f})
      for (DType t : kTypes) {
        CAPTURE(window);
        CAPTURE(p);
        const cpu::AttnShape s{B, T, NH, KVH, HS, window};
        const int64_t R = s.row(), O = B * T * NH * HS;
        const Half qkv = half(B * T * R, 0.5f, t, rng);
        const cpu::QkvT in16 = fused16(qkv.h, s);
        const cpu::Qkv in32 = cpu::Qkv::fused(qkv.f.data(), s);
        Bits o16(O);
        Vec o32(O), lse16(B * NH * T), lse32(B * NH * T);
        cpu::flash_attention_forward(o16.data(), lse16.data(), in16, t, s, p, 99);
        cpu::flash_attention_forward(o32.data(), lse32.data(), in32, s, p, 99);
        check_once(o16, o32, t);
        check_reordered(lse16, lse32);
        // The backward from the same stored output and log-sum-exp on both sides.
        const Vec out = values(o16, t);
        const Half dout = half(O, 1.0f, t, rng);
        Half dqkv = half(B * T * R, 1.0f, t, rng);
        Vec dq_acc(O), dsum(B * NH * T);
        cpu::flash_attention_backward(dqkv.h.data(), dq_acc.data(), dsum.data(), dout.h.data(), in16,
                                      o16.data(), lse32.data(), t, s, p, 99);
        cpu::flash_attention_backward(dqkv.f.data(), dq_acc.data(), dsum.data(), dout.f.data(), in32,
                                      out.data(), lse32.data(), s, p, 99);
        check_once(dqkv.h, dqkv.f, t);
      }
}

TEST_CASE("16-bit MoE routing, dispatch, combine and the shared expert's gate: rounded once") {
  std::mt19937 rng(26);
  const int64_t N = 11, E = 5, K = 2, C = 70;  // C > one 64-wide block
  for (DType t : kTypes) {
    const Half logits = half(N * E, 1.0f, t, rng);
    Vec p16(N * E), p32(N * E), w16(N * K), w32(N * K);
    std::vector<int32_t> i16(N * K), i32(N * K);
    cpu::moe_route_forward(p16.data(), i16.data(), w16.data(), logits.h.data(), t, N, E, K, true);
    cpu::moe_route_forward(p32.data(), i32.data(), w32.data(), logits.f.data(), N, E, K, true);
    CHECK(p16 == p32);
    CHECK(i16 == i32);
    CHECK(w16 == w32);
    const Vec dw = [&] {
      Vec v(N * K);
      std::normal_distribution<float> d;
      for (float& x : v) x = d(rng);
      return v;
    }();
    const Vec dprob(E, 0.25f);
    Bits dl16(N * E);
    Vec dl32(N * E);
    cpu::moe_route_backward(dl16.data(), t, dw.data(), p32.data(), i32.data(), dprob.data(), N, E, K, true);
    cpu::moe_route_backward(dl32.data(), dw.data(), p32.data(), i32.data(), dprob.data(), N, E, K, true);
    check_exact(dl16, dl32, t);

    const Half in = half(N * C, 1.0f, t, rng), ye = half(N * K * C, 1.0f, t, rng),
               dout = half(N * C, 1.0f, t, rng);
    Bits xe16(N * K * C);
    Vec xe32(N * K * C);
    cpu::moe_dispatch(xe16.data(), in.h.data(), i32.data(), t, N, K, E, C);
    cpu::moe_dispatch(xe32.data(), in.f.data(), i32.data(), N, K, E, C);
    check_exact(xe16, xe32, t);
    Half din = half(N * C, 1.0f, t, rng);
    cpu::moe_dispatch_backward(din.h.data(), ye.h.data(), i32.data(), t, N, K, E, C);
    cpu::moe_dispatch_backward(din.f.data(), ye.f.data(), i32.data(), N, K, E, C);
    check_once(din.h, din.f, t);
    Half out = half(N * C, 1.0f, t, rng);
    cpu::moe_combine(out.h.data(), ye.h.data(), w32.data(), i32.data(), t, N, K, E, C);
    cpu::moe_combine(out.f.data(), ye.f.data(), w32.data(), i32.data(), N, K, E, C);
    check_exact(out.h, out.f, t);
    Bits dye16(N * K * C);
    Vec dye32(N * K * C), dw16(N * K), dw32(N * K);
    cpu::moe_combine_backward(dye16.data(), dw16.data(), dout.h.data(), ye.h.data(), w32.data(),
                              i32.data(), t, N, K, E, C);
    cpu::moe_combine_backward(dye32.data(), dw32.data(), dout.f.data(), ye.f.data(), w32.data(),
                              i32.data(), N, K, E, C);
    check_exact(dye16, dye32, t);
    check_reordered(dw16, dw32);

    const Half x = half(N * C, 1.0f, t, rng), g = half(N, 2.0f, t, rng);
    Bits y16(N * C), dx16(N * C), dg16(N);
    Vec y32(N * C), dx32(N * C), dg32(N);
    cpu::gate_mul_forward(y16.data(), x.h.data(), g.h.data(), t, N, C);
    cpu::gate_mul_forward(y32.data(), x.f.data(), g.f.data(), N, C);
    check_exact(y16, y32, t);
    cpu::gate_mul_backward(dx16.data(), dg16.data(), dout.h.data(), x.h.data(), g.h.data(), t, N, C);
    cpu::gate_mul_backward(dx32.data(), dg32.data(), dout.f.data(), x.f.data(), g.f.data(), N, C);
    check_exact(dx16, dx32, t);
    check_exact(dg16, dg32, t);
  }
}
