// bench_planner: the ZeRO table, single estimates, and graph build + liveness + allocator
// replay, in process. The bars: the whole table (72 rows) well under a millisecond; graph +
// schedule + replay for gpt3-175b and a 1T model under 50 ms together; deepseek-v3 (MLA, 58
// MoE layers of 256 experts) and llama-3.1-405b under 50 ms each, printed at the end as
// ratios to gpt3-175b measured in the same run. Each benchmark checks its answer before timing.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/model_states.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/models/graph.hpp"

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

// The graph issue's bar: graph build + liveness schedule + allocator replay under 50 ms for
// gpt3-175b and a 1T-parameter GPT (128 layers), micro-batch 1, seq 2048, together.
zp::models::ModelSpec gpt_1t() {
  // 128 layers, hidden 25600, 160 heads: 12 * L * C^2 = 1.007e12 parameters in the blocks.
  zp::models::ModelSpec m = zp::models::load_model("gpt3-175b");
  m.name = "gpt-1t";
  m.n_layer = 128;
  m.n_embd = 25600;
  m.n_head = 160;
  m.n_kv_head = 160;
  m.head_dim = 160;
  m.n_inner = 4 * 25600;
  return m;
}

// Mean seconds per iteration of each model's graph + schedule + replay in this run.
std::map<std::string, double>& replay_seconds() {
  static std::map<std::string, double> s;
  return s;
}

void BM_GraphLivenessReplay(benchmark::State& state) {
  static const char* kModels[] = {"gpt3-175b", "gpt-1t", "deepseek-v3", "llama-3.1-405b"};
  const std::string name = kModels[state.range(0)];
  const zp::models::ModelSpec m = name == "gpt-1t" ? gpt_1t() : zp::models::load_model(name);
  Strategy s;
  s.stage = 3;
  s.dp = 1024;
  s.seq = 2048;
  const PlanOptions o;
  const auto g0 = zp::models::build_training_graph(m, graph_options(m, s, o));
  const auto sched0 = build_schedule(g0, s, o);
  const uint64_t psi = static_cast<uint64_t>(zp::models::count_params(m).total);
  if (sched0.n_params != psi || replay(sched0, o).per_device.peak(Tier::gpu) == 0) {
    state.SkipWithError("the schedule does not count the model's parameters");
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    const auto g = zp::models::build_training_graph(m, graph_options(m, s, o));
    const auto sched = build_schedule(g, s, o);
    benchmark::DoNotOptimize(replay(sched, o).per_device.peak(Tier::gpu));
  }
  replay_seconds()[name] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
      static_cast<double>(std::max<benchmark::IterationCount>(1, state.iterations()));
  state.SetLabel(m.name);
  state.counters["ops"] = static_cast<double>(g0.ops.size());
  state.counters["tensors"] = static_cast<double>(g0.tensors.size());
}
BENCHMARK(BM_GraphLivenessReplay)->DenseRange(0, 3)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  const auto& s = replay_seconds();
  const auto base = s.find("gpt3-175b");
  if (base != s.end() && base->second > 0) {
    std::printf("\ngraph + schedule + replay, against gpt3-175b in this run (%.1f ms):\n",
                base->second * 1e3);
    for (const auto& [name, sec] : s)
      std::printf("  %-16s %8.1f ms  %5.2fx  (bar: 50 ms)\n", name.c_str(), sec * 1e3,
                  sec / base->second);
  }
  return 0;
}
