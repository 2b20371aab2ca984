// bench_engine: tokens/s of whole training steps of the ZeRO engine (forward, backward,
// gradient handling and the AdamW update, every byte through the tagged arena) on one rank,
// gpt2-small-sized by default. Not a comparison by itself: tools/bench/compare_gpt2.sh --train
// runs this and bench_gpt2_torch.py --optimizer adamw on the same shape and prints the ratio.
//
// Environment: ZP_ENGINE_MODEL (catalog name, default gpt2), ZP_ENGINE_B (1), ZP_ENGINE_T
// (256), ZP_ENGINE_PRECISION (fp32: the same arithmetic as PyTorch's fp32 model; bf16 adds
// the 16-bit storage of zeroplan's default). A smoke run (--benchmark_min_time below 0.1 s, as
// CTest's) uses gpt2-tiny at T=64.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "zp/models/model_spec.hpp"
#include "zp/planner/plan.hpp"
#include "zp/runtime/comm.hpp"
#include "zp/runtime/device.hpp"
#include "zp/runtime/engine.hpp"

namespace {

using namespace zp;

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

bool smoke = false;

void engine_step(benchmark::State& state) {
  static runtime::MpiSession session(nullptr, nullptr);
  auto comm = runtime::make_mpi_comm();
  planner::Strategy s;
  s.stage = 0;
  s.optimizer = planner::OptimizerKind::adamw;
  const std::string prec = env_or("ZP_ENGINE_PRECISION", "fp32");
  s.precision = prec == "bf16" ? planner::Precision::bf16 : planner::Precision::fp32;
  s.micro_batch = std::stoll(env_or("ZP_ENGINE_B", "1"));
  s.seq = std::stoll(env_or("ZP_ENGINE_T", smoke ? "64" : "256"));
  const std::string model = env_or("ZP_ENGINE_MODEL", smoke ? "gpt2-tiny" : "gpt2");
  const planner::Plan plan = planner::make_plan(
      models::load_model(model), s, {planner::Profile::zeroplan, planner::Backend::cpu}, 1234);
  runtime::DeviceConfig dc;
  dc.gpu_bytes = plan.predicted.peak(planner::Tier::gpu) + (64 << 20);
  dc.cpu_bytes = plan.predicted.peak(planner::Tier::cpu) + (64 << 20);
  auto dev = runtime::make_cpu_device(dc);
  runtime::EngineOptions opt;
  opt.lr = 1e-4f;
  opt.weight_decay = 0.01f;
  runtime::Engine engine(plan, *dev, *comm, runtime::TokenData::load(""), opt);
  double loss = engine.step().loss;  // warm-up (first-touch of the arenas)
  for (auto _ : state) loss = engine.step().loss;
  const double tokens = static_cast<double>(s.micro_batch * s.seq);
  state.counters["tokens_per_s"] =
      benchmark::Counter(tokens * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["loss"] = loss;
  state.SetLabel(model + " " + prec);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--benchmark_min_time=", 0) == 0 && std::stod(a.substr(21)) < 0.1) smoke = true;
  }
  benchmark::RegisterBenchmark("engine_step", engine_step)->Unit(benchmark::kMillisecond)->UseRealTime();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
