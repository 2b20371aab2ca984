// Model-state bytes against the ZeRO paper: its table 1 (seed 004) as printed, its formulas
// recomputed here independently, and the offload placements of ZeRO-Offload and Infinity.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include "zp/error.hpp"
#include "zp/planner/model_states.hpp"

using namespace zp::planner;

namespace {
// ZeRO paper (Rajbhandari et al. 2020), table 1, per-device memory in GB, as printed.
// Rows: DP 1, 4, 16, 64, 256, 1024. Columns: 7.5B {P_os, P_os+g, P_os+g+p}, 128B {...}, 1T {...}.
constexpr std::array<uint64_t, 6> kDp = {1, 4, 16, 64, 256, 1024};
constexpr std::array<uint64_t, 3> kParams = {7'500'000'000, 128'000'000'000, 1'000'000'000'000};
const char* kPaper[6][9] = {
    {"120", "120", "120", "2048", "2048", "2048", "16000", "16000", "16000"},
    {"52.5", "41.3", "30", "896", "704", "512", "7000", "5500", "4000"},
    {"35.6", "21.6", "7.5", "608", "368", "128", "4750", "2875", "1000"},
    {"31.4", "16.6", "1.88", "536", "284", "32", "4187", "2218", "250"},
    {"30.4", "15.4", "0.47", "518", "263", "8", "4046", "2054", "62.5"},
    {"30.1", "15.1", "0.12", "513", "257", "2", "4011", "2013", "15.6"},
};

// The paper's fig. 1 formulas, in real numbers: Psi params, K = 12, Nd = dp.
double paper_formula(double psi, double nd, int stage) {
  const double k = 12;
  switch (stage) {
    case 0: return (2 + 2 + k) * psi;
    case 1: return 2 * psi + 2 * psi + k * psi / nd;
    case 2: return 2 * psi + (2 + k) * psi / nd;
    default: return (2 + 2 + k) * psi / nd;
  }
}
}  // namespace

TEST_CASE("zero-plan table reproduces all 54 values of the ZeRO paper's table") {
  const auto rows = zero_table({kParams.begin(), kParams.end()}, {kDp.begin(), kDp.end()}, 12);
  REQUIRE(rows.size() == 3 * 6 * 4);
  int checked = 0;
  for (const auto& r : rows) {
    const std::size_t m = std::find(kParams.begin(), kParams.end(), r.params) - kParams.begin();
    const std::size_t d = std::find(kDp.begin(), kDp.end(), r.dp) - kDp.begin();
    CAPTURE(r.params);
    CAPTURE(r.dp);
    CAPTURE(r.stage);
    // Bytes equal the formula up to the padding of each partition to whole elements: at most
    // (2 + 2 + 12) bytes of one element.
    const double formula = paper_formula(static_cast<double>(r.params), static_cast<double>(r.dp), r.stage);
    CHECK(static_cast<double>(r.bytes_per_device) >= formula);
    CHECK(static_cast<double>(r.bytes_per_device) - formula < 16.0);
    if (r.stage == 0) {
      CHECK(r.bytes_per_device == 16 * r.params);
      continue;
    }
    CHECK(paper_gb(r.bytes_per_device) == kPaper[d][m * 3 + static_cast<std::size_t>(r.stage - 1)]);
    ++checked;
  }
  CHECK(checked == 54);
}

TEST_CASE("paper rounding") {
  CHECK(paper_gb(41'250'000'000) == "41.3");      // half-up, not half-even
  CHECK(paper_gb(4'187'500'000'000) == "4187");   // >= 100 GB truncates
  CHECK(paper_gb(468'750'000) == "0.47");
  CHECK(paper_gb(30'000'000'000) == "30");
  CHECK(paper_gb(7'500'000'000) == "7.5");
}

TEST_CASE("mixed-precision Adam: the 2 + 2 + 12 split by category") {
  Strategy s;
  s.precision = Precision::fp16;
  const uint64_t psi = 1'000'000;
  for (int stage = 0; stage <= 3; ++stage) {
    for (int64_t dp : {1, 3, 8}) {
      s.stage = stage;
      s.dp = dp;
      const PerDevice d = model_state_bytes(psi, s);
      const uint64_t part = (psi + dp - 1) / dp;
      CAPTURE(stage);
      CAPTURE(dp);
      CHECK(d[Tier::gpu][Category::params] == 2 * (stage >= 3 ? part : psi));
      CHECK(d[Tier::gpu][Category::grads] == 2 * (stage >= 2 ? part : psi));
      CHECK(d[Tier::gpu][Category::master] == 4 * (stage >= 1 ? part : psi));
      CHECK(d[Tier::gpu][Category::optimizer] == 8 * (stage >= 1 ? part : psi));
      CHECK(d[Tier::cpu].total() == 0);
      CHECK(d[Tier::nvme].total() == 0);
    }
  }
}

TEST_CASE("fp32 Adam and SGD") {
  Strategy s;
  s.precision = Precision::fp32;
  PerDevice d = model_state_bytes(1000, s);
  CHECK(d[Tier::gpu].total() == 16 * 1000);  // 4 + 4 + 8, the seed 002 count
  CHECK(d[Tier::gpu][Category::master] == 0);
  s.optimizer = OptimizerKind::sgd;
  s.precision = Precision::bf16;
  d = model_state_bytes(1000, s);
  CHECK(d[Tier::gpu].total() == (2 + 2 + 4 + 4) * 1000);
  CHECK(bytes_per_param(Precision::fp16, OptimizerKind::adamw).k() == 12);
}

TEST_CASE("ZeRO-Offload moves master, moments and the fp32 gradient partition to the host") {
  Strategy s;
  s.precision = Precision::fp16;
  s.stage = 2;
  s.dp = 4;
  s.offload_optimizer = Offload::cpu;
  const uint64_t psi = 1'000'000, part = psi / 4;
  PerDevice d = model_state_bytes(psi, s);
  // Seed 002 / ZeRO-Offload sec. 4.1: fp16 params stay on the GPU, everything else moves.
  CHECK(d[Tier::gpu][Category::params] == 2 * psi);
  CHECK(d[Tier::gpu][Category::grads] == 0);
  CHECK(d[Tier::gpu][Category::master] == 0);
  CHECK(d[Tier::gpu][Category::optimizer] == 0);
  CHECK(d[Tier::cpu][Category::master] == 4 * part);
  CHECK(d[Tier::cpu][Category::optimizer] == 8 * part);
  CHECK(d[Tier::cpu][Category::grads] == 4 * part);
  // Single GPU (seed 002): 2M on the GPU, the fp32 states 12M + fp32 grads 4M on the CPU.
  s.dp = 1;
  d = model_state_bytes(psi, s);
  CHECK(d[Tier::gpu].total() == 2 * psi);
  CHECK(d[Tier::cpu].total() == 16 * psi);

  s.dp = 4;
  s.stage = 1;  // stage 1 keeps whole 16-bit gradients on the GPU
  d = model_state_bytes(psi, s);
  CHECK(d[Tier::gpu][Category::grads] == 2 * psi);

  s.stage = 3;  // ZeRO-Infinity: parameters to NVMe, optimizer to NVMe
  s.offload_optimizer = Offload::nvme;
  s.offload_param = Offload::nvme;
  d = model_state_bytes(psi, s);
  CHECK(d[Tier::gpu].total() == 0);
  CHECK(d[Tier::nvme][Category::params] == 2 * part);
  CHECK(d[Tier::nvme][Category::master] == 4 * part);
  CHECK(d[Tier::nvme][Category::optimizer] == 8 * part);
  CHECK(d[Tier::cpu][Category::grads] == 4 * part);
  s.offload_param = Offload::cpu;
  d = model_state_bytes(psi, s);
  CHECK(d[Tier::cpu][Category::params] == 2 * part);
}

TEST_CASE("byte counts that overflow 64 bits are errors") {
  CHECK_THROWS_AS(zero_table({2'000'000'000'000'000'000ULL}, {1}, 12), zp::Error);
  Strategy s;
  CHECK_THROWS_AS(model_state_bytes(5'000'000'000'000'000'000ULL, s), zp::Error);
}
