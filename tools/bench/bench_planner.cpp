// bench_planner: the ZeRO table and single estimates, in process. The bar: the whole
// table (72 rows) well under a millisecond. Each benchmark checks its answer before timing.
#include <benchmark/benchmark.h>

#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/model_states.hpp"

namespace {

using namespace zp::planner;

void BM_ZeroTable(benchmark::State& state) {
  const std::vector<uint64_t> params = {7'500'000'000, 128'000'000'000, 1'000'000'000'000};
  const std::vector<uint64_t> dps = {1, 4, 16, 64, 256, 1024};
  const auto check = zero_table(params, dps, 12);
  if (check.size() != 72 || check[5].bytes_per_device != 52'500'000'000ULL) {
    state.SkipWithError("zero_table gives a wrong answer");
    return;
  }
  for (auto _ : state) {
    auto rows = zero_table(params, dps, 12);
    benchmark::DoNotOptimize(rows.data());
  }
  state.counters["rows"] = 72;
}
BENCHMARK(BM_ZeroTable)->Unit(benchmark::kMicrosecond);

// Estimate from an already parsed spec (what `fit` will do thousands of times).
void BM_Estimate(benchmark::State& state) {
  const auto m = zp::models::load_model("llama-2-70b");
  Strategy s;
  s.stage = 3;
  s.dp = 64;
  if (estimate(m, s, nullptr).params.total != 68'976'648'192LL) {
    state.SkipWithError("wrong parameter count");
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(estimate(m, s, nullptr).per_device.peak(Tier::gpu));
}
BENCHMARK(BM_Estimate)->Unit(benchmark::kMicrosecond);

// Estimate including reading the catalog config (what one `zero-plan estimate` does).
void BM_EstimateFromCatalog(benchmark::State& state) {
  Strategy s;
  s.stage = 2;
  s.dp = 8;
  for (auto _ : state) {
    const auto m = zp::models::load_model("llama-2-7b");
    benchmark::DoNotOptimize(estimate(m, s, nullptr).per_device.peak(Tier::gpu));
  }
}
BENCHMARK(BM_EstimateFromCatalog)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
