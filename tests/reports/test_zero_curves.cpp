// The HTML report's ZeRO curves (model states per GPU against dp, per stage): the ZeRO paper's
// formula for a dense model, and DeepSpeed-MoE's grouping for a Mixture-of-Experts model, each
// worked by hand here.
#include <doctest/doctest.h>

#include "zp/reports/html.hpp"

using namespace zp::reports;

TEST_CASE("ZeRO curves: dense, the paper's (2 + 2 + 12) bytes per parameter") {
  Comparison c;
  c.n_params = 7'500'000'000;
  c.strategy.precision = zp::planner::Precision::fp16;
  const auto curves = zero_curves(c);
  REQUIRE(curves.size() == 4);
  // dp 64 (index 6): 120 GB, 31.4 GB, 16.6 GB, 1.88 GB (ZeRO paper table 1).
  CHECK(curves[0].dp[6] == 64);
  CHECK(curves[0].bytes_per_device[6] == 16 * 7'500'000'000ULL);
  CHECK(curves[1].bytes_per_device[6] == 4 * 7'500'000'000ULL + 12 * (7'500'000'000ULL / 64));
  CHECK(curves[3].bytes_per_device[6] == 16 * (7'500'000'000ULL / 64));  // 64 divides 7.5e9
}

TEST_CASE("ZeRO curves: experts over ep ranks, their states over dp/ep") {
  // 1000 dense and 8000 expert parameters, ep 4: a rank holds 1000 + 2000; stage 1 at dp 8
  // partitions the dense over 8 ranks (125) and its 2000 expert ones over 8/4 = 2 (1000).
  Comparison c;
  c.n_params = 9000;
  c.n_expert_params = 8000;
  c.strategy.ep = 4;
  c.strategy.precision = zp::planner::Precision::bf16;
  const auto curves = zero_curves(c);
  const std::size_t i8 = 3;  // dp 1, 2, 4, 8
  REQUIRE(curves[1].dp[i8] == 8);
  CHECK(curves[1].bytes_per_device[i8] == (2 + 2) * 3000 + 12 * (125 + 1000));
  CHECK(curves[3].bytes_per_device[i8] == 16 * (125 + 1000));
  // dp 2: only ep 2 fits (gcd(2, 4)); a rank holds 1000 + 4000, expert states over 1 rank.
  CHECK(curves[3].bytes_per_device[1] == 16 * (500 + 4000));
  // Stage 0 replicates what a rank holds: dense plus its experts, not all of them.
  CHECK(curves[0].bytes_per_device[i8] == 16 * 3000);
}
