// Flash attention on the CPU (cpu_flash.cpp) against two independent references:
// - a float64 softmax(q k^T / sqrt(HS)) v written here from the formula (out, lse), with its
//   gradient by central finite differences (directional, as the sizes span several blocks);
// - the three-step fp32 attention of cpu_kernels.cpp (scores, softmax, dropout, values and their
//   backwards), itself checked against float64 in test_cpu_kernels.cpp: with attention dropout
//   both must drop the same probabilities, since they share the mask's counter-based key.
// Shapes cross the 64-query and 64-key blocks (T = 130: three blocks, the last of 2 rows), with
// multi-head, grouped-query (6 over 2) and multi-query heads, and sliding windows that end
// inside a block and cover several.
//
// Tolerances, relative to the tensor's largest |want|: the forward is fp32 over sums of <= 130
// terms with an online rescaling (a few more roundings per term than the three steps): 1e-5
// (the kernels' forward bound, kernel_check.hpp's kFwdTol); gradients 3e-5 (kBwdTol).
// Observed: ~1e-7 (worst 1.8e-7 of the scale). A wrong block boundary, a lost rescale or a missed
// mask term is off by O(1).
#include <doctest/doctest.h>

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernel_check.hpp"
#include "zp/error.hpp"
#include "zp/runtime/cpu_kernels.hpp"

namespace cpu = zp::runtime::cpu;

namespace {

using namespace zp::test::kernel;

// Float64 attention from the formula: out (B,T,NH*HS) and lse (B,NH,T).
struct Ref {
  DVec out, lse;
};
Ref reference(const DVec& qkv, const cpu::AttnShape& s) {
  const int64_t R = s.row(), O = s.out_row(), G = s.group();
  Ref r{DVec(static_cast<std::size_t>(s.B * s.T * O), 0.0),
        DVec(static_cast<std::size_t>(s.B * s.NH * s.T))};
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.NH; ++h)
      for (int64_t t = 0; t < s.T; ++t) {
        std::vector<double> sc;
        double mx = -1e300;
        for (int64_t t2 = s.first_key(t); t2 <= t; ++t2) {
          double d = 0.0;
          for (int64_t i = 0; i < s.HS; ++i)
            d += qkv[static_cast<std::size_t>((b * s.T + t) * R + h * s.HS + i)] *
                 qkv[static_cast<std::size_t>((b * s.T + t2) * R + s.k_off() + h / G * s.HS + i)];
          sc.push_back(d / std::sqrt(static_cast<double>(s.HS)));
          mx = std::max(mx, sc.back());
        }
        double z = 0.0;
        for (double x : sc) z += std::exp(x - mx);
        r.lse[static_cast<std::size_t>((b * s.NH + h) * s.T + t)] = mx + std::log(z);
        for (int64_t t2 = s.first_key(t), k = 0; t2 <= t; ++t2, ++k)
          for (int64_t i = 0; i < s.HS; ++i)
            r.out[static_cast<std::size_t>((b * s.T + t) * O + h * s.HS + i)] +=
                std::exp(sc[static_cast<std::size_t>(k)] - mx) / z *
                qkv[static_cast<std::size_t>((b * s.T + t2) * R + s.v_off() + h / G * s.HS + i)];
      }
  return r;
}

// The three-step fp32 attention (with dropout p under key), forward and backward.
struct ThreeStep {
  Vec out, dqkv;
};
ThreeStep three_step(const Vec& qkv, const Vec& dout, const Vec& dqkv0, const cpu::AttnShape& s,
                     float p, uint64_t key) {
  const std::size_t A = static_cast<std::size_t>(s.B * s.NH * s.T * s.T);
  Vec pre(A), att(A), drop(A), datt(A, 0.0f), dpre(A);
  std::vector<uint8_t> mask(A);
  ThreeStep r{Vec(static_cast<std::size_t>(s.B * s.T * s.out_row())), dqkv0};
  cpu::attention_scores(pre.data(), qkv.data(), s);
  cpu::attention_softmax(att.data(), pre.data(), s);
  const float* probs = att.data();
  if (p > 0.0f) {
    cpu::dropout_forward(drop.data(), mask.data(), att.data(), zp::runtime::DType::fp32, p, key,
                         static_cast<int64_t>(A));
    probs = drop.data();
  }
  cpu::attention_values(r.out.data(), probs, qkv.data(), s);
  cpu::attention_values_backward(datt.data(), r.dqkv.data(), dout.data(), probs, qkv.data(), s);
  if (p > 0.0f)
    cpu::dropout_backward(datt.data(), datt.data(), mask.data(), zp::runtime::DType::fp32, p,
                          static_cast<int64_t>(A));
  cpu::attention_softmax_backward(dpre.data(), datt.data(), att.data(), s);
  cpu::attention_scores_backward(r.dqkv.data(), dpre.data(), qkv.data(), s);
  return r;
}

struct Flash {
  Vec out, lse, dqkv;
};
Flash flash(const Vec& qkv, const Vec& dout, const Vec& dqkv0, const cpu::AttnShape& s, float p,
            uint64_t key) {
  Flash r{Vec(static_cast<std::size_t>(s.B * s.T * s.out_row()), 1e30f),
          Vec(static_cast<std::size_t>(s.B * s.NH * s.T), 1e30f), dqkv0};
  // Workspaces filled with garbage: the kernel must overwrite what it reads.
  Vec dq_acc(static_cast<std::size_t>(s.B * s.T * s.out_row()), 7.0f),
      dsum(static_cast<std::size_t>(s.B * s.NH * s.T), -3.0f);
  cpu::flash_attention_forward(r.out.data(), r.lse.data(), qkv.data(), s, p, key);
  cpu::flash_attention_backward(r.dqkv.data(), dq_acc.data(), dsum.data(), dout.data(), qkv.data(),
                                r.out.data(), r.lse.data(), s, p, key);
  return r;
}

const cpu::AttnShape kShapes[] = {
    {2, 130, 4, 4, 16, 0},   // multi-head (GPT-2's layout), three query and key blocks
    {2, 130, 6, 2, 8, 0},    // grouped-query, groups of 3
    {1, 130, 6, 1, 8, 0},    // multi-query
    {2, 130, 6, 2, 8, 3},    // a window of 3 keys: most key blocks skipped
    {1, 130, 4, 2, 16, 70},  // a window ending inside the second block
    {1, 5, 2, 1, 3, 0},      // smaller than one block
    {1, 129, 4, 2, 8, 2},    // a last block of one row; a window of 2 reaching one key back
};

}  // namespace

TEST_CASE(
    "flash attention: out and lse against float64 attention, gradients by finite differences") {
  std::mt19937 rng(71);
  for (const cpu::AttnShape& s : kShapes) {
    CAPTURE(s.T);
    CAPTURE(s.NH);
    CAPTURE(s.KVH);
    CAPTURE(s.window);
    const Vec qkv = randn(static_cast<std::size_t>(s.B * s.T * s.row()), 1.0f, rng);
    const DVec qd(qkv.begin(), qkv.end());
    const Vec dout = randn(static_cast<std::size_t>(s.B * s.T * s.out_row()), 1.0f, rng);
    const Vec dqkv0 = randn(qkv.size(), 0.1f, rng);
    const Flash f = flash(qkv, dout, dqkv0, s, 0.0f, 0);
    const Ref want = reference(qd, s);
    check_close(f.out, want.out, kFwdTol, "flash out");
    check_close(f.lse, want.lse, kFwdTol, "flash lse");

    // The gradient added into dqkv, against the float64 reference's directional derivative
    // of L = sum(dout * out) along two random directions (kernel_check.hpp).
    Vec grad(qkv.size());
    for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = f.dqkv[i] - dqkv0[i];
    const auto loss = [&](const DVec& x) { return weighted_sum(reference(x, s).out, dout); };
    for (int dir = 0; dir < 2; ++dir) check_directional(loss, qd, grad, rng, "flash dqkv");
  }
}

TEST_CASE("flash attention equals the three-step attention, with and without attention dropout") {
  std::mt19937 rng(72);
  for (const cpu::AttnShape& s : kShapes)
    for (float p : {0.0f, 0.1f}) {
      CAPTURE(s.T);
      CAPTURE(s.KVH);
      CAPTURE(s.window);
      CAPTURE(p);
      const Vec qkv = randn(static_cast<std::size_t>(s.B * s.T * s.row()), 1.0f, rng);
      const Vec dout = randn(static_cast<std::size_t>(s.B * s.T * s.out_row()), 1.0f, rng);
      const Vec dqkv0 = randn(qkv.size(), 0.1f, rng);
      const uint64_t key = 0x5eed0000u + static_cast<uint64_t>(s.T * 7 + s.window);
      const ThreeStep a = three_step(qkv, dout, dqkv0, s, p, key);
      const Flash f = flash(qkv, dout, dqkv0, s, p, key);
      check_close(f.out, to_d(a.out), kFwdTol, "flash out vs three steps");
      check_close(f.dqkv, to_d(a.dqkv), kBwdTol, "flash dqkv vs three steps");
      if (p > 0.0f) {  // the dropout is real: another key gives another output
        const Flash g = flash(qkv, dout, dqkv0, s, p, key + 1);
        double diff = 0.0;
        for (std::size_t i = 0; i < g.out.size(); ++i)
          diff = std::max(diff, double(std::abs(g.out[i] - f.out[i])));
        CHECK(diff > 1e-3);
      }
    }
}

TEST_CASE(
    "flash attention: the same bits on 1 and 2 threads; bad shapes and probabilities refused") {
  std::mt19937 rng(73);
  const cpu::AttnShape s{2, 200, 6, 2, 16, 0};
  const Vec qkv = randn(static_cast<std::size_t>(s.B * s.T * s.row()), 1.0f, rng);
  const Vec dout = randn(static_cast<std::size_t>(s.B * s.T * s.out_row()), 1.0f, rng);
  const Vec dqkv0(qkv.size(), 0.0f);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Flash one = flash(qkv, dout, dqkv0, s, 0.1f, 9);
  omp_set_num_threads(2);
  const Flash two = flash(qkv, dout, dqkv0, s, 0.1f, 9);
  omp_set_num_threads(threads);
  CHECK(one.out == two.out);
  CHECK(one.lse == two.lse);
  CHECK(one.dqkv == two.dqkv);

  Vec x(4096), y(4096), z(4096);
  CHECK_THROWS_AS(
      cpu::flash_attention_forward(x.data(), y.data(), z.data(), {1, 4, 4, 3, 2, 0}, 0.0f, 0),
      zp::Error);
  CHECK_THROWS_AS(
      cpu::flash_attention_forward(x.data(), y.data(), z.data(), {1, 4, 4, 2, 2, 0}, 1.0f, 0),
      zp::Error);
  CHECK_THROWS_AS(cpu::flash_attention_backward(x.data(), y.data(), z.data(), x.data(), y.data(),
                                                z.data(), x.data(), {1, 4, 4, 2, 2, -1}, 0.0f, 0),
                  zp::Error);
}
