// The Mixture-of-Experts routing kernels (cpu_moe.cpp) against loops written here from their
// contract (cpu_kernels.hpp): the router's top-k, the dispatched rows grouped by expert, then
// token, then slot; the combine and the backwards; int32 and int64 indices alike; the
// refusals. Their gradients through whole models are held to PyTorch in test_llama_reference.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "kernel_check.hpp"
#include "zp/error.hpp"
#include "zp/runtime/cpu_kernels.hpp"

namespace cpu = zp::runtime::cpu;
using namespace zp::test::kernel;

TEST_CASE(
    "moe kernels: dispatch, combine and their backwards against the contract; int32 = int64 "
    "indices") {
  std::mt19937 rng(74);
  constexpr int64_t N = 37, E = 5, K = 2, C = 70;  // 70 columns: the column split is uneven
  const Vec logits = randn(N * E, 1.0f, rng), in = randn(N * C, 1.0f, rng);
  Vec probs(N * E), w(N * K);
  std::vector<int32_t> idx(N * K);
  cpu::moe_route_forward(probs.data(), idx.data(), w.data(), logits.data(), N, E, K, true);
  // The top 2 by probability, distinct, renormalised.
  for (int64_t n = 0; n < N; ++n) {
    const float* p = probs.data() + n * E;
    CHECK(idx[n * K] != idx[n * K + 1]);
    for (int64_t e = 0; e < E; ++e)
      if (e != idx[n * K] && e != idx[n * K + 1]) CHECK(p[e] <= p[idx[n * K + 1]]);
    CHECK(p[idx[n * K]] >= p[idx[n * K + 1]]);
    CHECK(std::abs(w[n * K] + w[n * K + 1] - 1.0f) < 1e-6f);
  }
  // The expected order of the dispatched rows.
  std::vector<std::pair<int64_t, int64_t>> order;  // (token, slot) per row
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        if (idx[n * K + k] == e) order.emplace_back(n, k);
  REQUIRE(order.size() == static_cast<std::size_t>(N * K));
  std::vector<int64_t> off(E + 1);
  cpu::moe_expert_counts(idx.data(), N, K, E, off.data());
  CHECK(off[E] == N * K);
  Vec xe(N * K * C, -9.0f);
  cpu::moe_dispatch(xe.data(), in.data(), idx.data(), N, K, E, C);
  for (std::size_t r = 0; r < order.size(); ++r)
    for (int64_t c = 0; c < C; ++c) CHECK(xe[r * C + c] == in[order[r].first * C + c]);
  const Vec ye = randn(N * K * C, 1.0f, rng), dout = randn(N * C, 1.0f, rng);
  Vec out(N * C, 7.0f), dye(N * K * C), dw(N * K), din(N * C, 0.5f);
  cpu::moe_combine(out.data(), ye.data(), w.data(), idx.data(), N, K, E, C);
  cpu::moe_combine_backward(dye.data(), dw.data(), dout.data(), ye.data(), w.data(), idx.data(), N,
                            K, E, C);
  cpu::moe_dispatch_backward(din.data(), ye.data(), idx.data(), N, K, E, C);
  DVec want_out(N * C, 0.0), want_din(N * C, 0.5), want_dw(N * K, 0.0);
  for (std::size_t r = 0; r < order.size(); ++r) {
    const auto [n, k] = order[r];
    for (int64_t c = 0; c < C; ++c) {
      want_out[n * C + c] += double(w[n * K + k]) * ye[r * C + c];
      want_din[n * C + c] += ye[r * C + c];
      want_dw[n * K + k] += double(dout[n * C + c]) * ye[r * C + c];
      CHECK(dye[r * C + c] == w[n * K + k] * dout[n * C + c]);
    }
  }
  check_close(out, want_out, kFwdTol, "moe combine");
  check_close(din, want_din, kFwdTol, "moe dispatch backward");
  check_close(dw, want_dw, kFwdTol, "moe combine backward dw");
  // int64 indices (torch.topk's) give the same bits.
  std::vector<int64_t> idx64(idx.begin(), idx.end());
  Vec xe64(N * K * C), out64(N * C);
  cpu::moe_dispatch(xe64.data(), in.data(), idx64.data(), N, K, E, C);
  cpu::moe_combine(out64.data(), ye.data(), w.data(), idx64.data(), N, K, E, C);
  CHECK(xe64 == xe);
  CHECK(out64 == out);
  // An index outside [0, E), too many experts, or k above E are refused before any thread runs.
  std::vector<int32_t> bad = idx;
  bad[3] = static_cast<int32_t>(E);
  CHECK_THROWS_AS(cpu::moe_dispatch(xe.data(), in.data(), bad.data(), N, K, E, C), zp::Error);
  CHECK_THROWS_AS(cpu::moe_expert_counts(idx.data(), N, K, cpu::kMaxExperts + 1, off.data()),
                  zp::Error);
  CHECK_THROWS_AS(cpu::moe_expert_counts(idx.data(), N, E + 1, E, off.data()), zp::Error);
}
