// bench_fit: the `zero-plan fit` search. The bars: >= 10,000 configurations of llama-2-7b
// searched in under a second, and of mixtral-8x7b (the search adds expert-parallel degrees) in
// under two seconds on two cores, against a baseline that runs the full estimate (graph + schedule + replay) per
// configuration, measured in the same run. The search runs on one thread and on all of the
// machine's (threads:0), and each benchmark checks its answer before timing (the threaded
// search must give the one-thread result, candidate for candidate).
#include <benchmark/benchmark.h>

#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/fit.hpp"

namespace {

using namespace zp::planner;

// llama-2-7b on 64 A100-80GB (8 nodes): stage x offloads x DPU x 9 micro-batches x 3
// checkpointing x 4 model-parallel degrees x 4 gradient-accumulation counts. mixtral-8x7b on
// 64 H100s: 6 micro-batches and 2 gradient-accumulation counts, times the expert-parallel
// degrees 1, 2, 4, 8 (those dividing dp and the 8 experts).
FitRequest request(int model = 0) {
  FitRequest r;
  r.model = zp::models::load_model(model == 0 ? "llama-2-7b" : "mixtral-8x7b");
  r.hw = load_hardware(model == 0 ? "a100-80g" : "h100-80g");
  r.gpus = 64;
  r.micro_batches = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  r.mps = {1, 2, 4, 8};
  r.grad_accums = {1, 2, 4, 8};
  if (model == 1) {  // four ep degrees: 288 graph shapes, ~26,000 configurations
    r.micro_batches = {1, 2, 4, 8, 16, 32};
    r.grad_accums = {1, 2};
  }
  return r;
}

bool same(const FitResult& a, const FitResult& b) {
  if (a.n_searched != b.n_searched || a.n_fit != b.n_fit ||
      a.candidates.size() != b.candidates.size())
    return false;
  for (std::size_t i = 0; i < a.candidates.size(); ++i) {
    const Candidate& x = a.candidates[i];
    const Candidate& y = b.candidates[i];
    if (describe(x.strategy) != describe(y.strategy) || !(x.per_device == y.per_device) ||
        x.step_seconds != y.step_seconds || x.why != y.why)
      return false;
  }
  return true;
}

void BM_FitSearch(benchmark::State& state) {
  FitRequest r = request(static_cast<int>(state.range(1)));
  r.threads = static_cast<unsigned>(state.range(0));
  const FitResult check = fit(r);
  if (check.n_searched < 10'000 || check.candidates.empty() ||
      check.candidates.front().tokens_per_second <= 0) {
    state.SkipWithError("fit searched too little or found nothing");
    return;
  }
  FitRequest one = r;
  one.threads = 1;
  if (r.threads != 1 && !same(check, fit(one))) {
    state.SkipWithError("the threaded search differs from the one-thread search");
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(fit(r).n_fit);
  state.SetLabel(r.model.name);
  state.counters["configs"] = static_cast<double>(check.n_searched);
  state.counters["graphs"] = static_cast<double>(check.n_shapes);
  state.counters["configs_per_s"] = benchmark::Counter(
      static_cast<double>(check.n_searched), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_FitSearch)
    ->ArgNames({"threads", "model"})
    ->Args({1, 0})
    ->Args({0, 0})
    ->Args({0, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Baseline: the full estimate per configuration (what the search would cost without the
// per-shape cache), over a slice of the same space.
void BM_EstimatePerConfig(benchmark::State& state) {
  const FitRequest r = request();
  std::vector<Strategy> slice;
  for (int stage : {0, 1, 2, 3})
    for (int64_t mb : {1, 4}) {
      Strategy s;
      s.stage = stage;
      s.dp = 64;
      s.micro_batch = mb;
      slice.push_back(resolve_for_model(s, r.model));
    }
  FitEvaluator ev(r.model, {});
  for (const Strategy& s : slice)
    if (!(ev.memory(s) == estimate(r.model, s, nullptr).per_device)) {
      state.SkipWithError("cached memory differs from estimate()");
      return;
    }
  for (auto _ : state)
    for (const Strategy& s : slice)
      benchmark::DoNotOptimize(estimate(r.model, s, nullptr).per_device.peak(Tier::gpu));
  state.counters["configs_per_s"] = benchmark::Counter(
      static_cast<double>(slice.size()), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_EstimatePerConfig)->Unit(benchmark::kMillisecond);

// The parallel search (FitRequest::parallel, screened): llama-3.1-405b on 1024 H100s (128
// nodes) at 8192 tokens with flash attention, tensor (1-8, with and without sequence
// parallelism) x pipeline (1, 2: the divisors of 126 layers that divide 1024 GPUs; vp 1, 3) x
// context parallelism (1-16) x ZeRO stage x offloads x DPU x overlap_comm x 6 micro-batches x
// 3 checkpointings x 4 gradient-accumulation counts: over 10^5 configurations. The bar: under
// 5 s on two cores. The baseline is the same search without screening (every configuration
// exactly), over a slice of it (one micro-batch and one gradient-accumulation count), per
// configuration.
FitRequest parallel_request() {
  FitRequest r;
  r.model = zp::models::load_model("llama-3.1-405b");
  r.hw = load_hardware("h100-80g");
  r.gpus = 1024;
  r.base.seq = 8192;
  r.base.flash_attention = true;
  r.parallel = true;
  r.vps = {1, 3};
  r.cps = {1, 2, 4, 8, 16};
  r.grad_accums = {1, 2, 4, 8};
  return r;
}

void BM_FitParallel(benchmark::State& state) {
  FitRequest r = parallel_request();
  r.threads = static_cast<unsigned>(state.range(0));
  const FitResult check = fit(r);
  if (check.n_searched < 100'000 || check.candidates.empty() || !check.screened) {
    state.SkipWithError("the parallel search searched too little, found nothing or was not screened");
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(fit(r).n_fit);
  state.counters["configs"] = static_cast<double>(check.n_searched);
  state.counters["exact"] = static_cast<double>(check.n_exact);
  state.counters["simulated"] = static_cast<double>(check.n_simulated);
  state.counters["configs_per_s"] = benchmark::Counter(
      static_cast<double>(check.n_searched), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_FitParallel)->ArgNames({"threads"})->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);

void BM_FitParallelExhaustive(benchmark::State& state) {
  FitRequest r = parallel_request();
  r.micro_batches = {1};
  r.grad_accums = {8};
  r.exhaustive = true;
  uint64_t n = 0;
  for (auto _ : state) n = fit(r).n_searched;
  state.counters["configs"] = static_cast<double>(n);
  state.counters["configs_per_s"] =
      benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_FitParallelExhaustive)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);

// One simulated step of llama-3.1-405b (126 blocks) per strategy: what the search pays per
// configuration that fits, beside the graph work shared by a shape. Stage 1 and 3 at
// tp 8 on 1024 H100s, grad_accum 8.
void BM_SimulateStep(benchmark::State& state) {
  const auto model = zp::models::load_model("llama-3.1-405b");
  const Hardware hw = load_hardware("h100-80g");
  Strategy s;
  s.stage = static_cast<int>(state.range(0));
  s.mp = 8;
  s.dp = 128;
  s.grad_accum = 8;
  s.flash_attention = true;
  s.checkpointing = Checkpointing::full;
  s = resolve_for_model(s, model);
  FitEvaluator ev(model, {});
  const StepCosts& c = ev.costs(s);
  for (auto _ : state) benchmark::DoNotOptimize(simulate(c, s, hw, Cluster{1024, 128}).step_seconds);
}
BENCHMARK(BM_SimulateStep)->Arg(1)->Arg(3)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
