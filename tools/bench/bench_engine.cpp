// bench_engine: tokens/s of whole training steps of the ZeRO engine (forward, backward,
// gradient handling and the AdamW update, every byte through the tagged arena) on one rank,
// gpt2-small-sized by default. Not a comparison by itself: tools/bench/compare_gpt2.sh --train
// runs this and bench_gpt2_torch.py --optimizer adamw on the same shape and prints the ratio.
//
// Environment: ZP_ENGINE_MODEL (catalog name, default gpt2), ZP_ENGINE_B (1), ZP_ENGINE_T
// (256), ZP_ENGINE_PRECISION (fp32: the same arithmetic as PyTorch's fp32 model; bf16 adds
// the 16-bit storage of zeroplan's default), ZP_ENGINE_FLASH (1: --flash-attention, the
// engine's fused attention instead of the three steps). A smoke run (--benchmark_min_time below 0.1 s, as
// CTest's) uses gpt2-tiny at T=64.
// engine_step runs the planner's cpu graph (fp32 activations), what zero-run --device cpu
// plans; engine_step_gpu_graph runs its cuda graph on the same cpu device (activations in the
// precision, the 16-bit kernels and GEMM panels; no dropout: the same model), as CI tests the
// GPU's graph, and reports its speed relative to engine_step's, measured just before in the
// same run (x_cpu_graph: above 1 is faster).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>

#include "zp/error.hpp"
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
double cpu_graph_step_s = 0;  // engine_step's mean step, for engine_step_gpu_graph's ratio

void engine_step_or_throw(benchmark::State& state, planner::Backend graph);

// A setting the planner or the engine refuses (a --seq longer than the model's positions, say)
// is reported as this benchmark's error, not an abort.
void engine_step(benchmark::State& state, planner::Backend graph) {
  try {
    engine_step_or_throw(state, graph);
  } catch (const Error& e) {
    state.SkipWithError((std::string(e.what()) + (e.hint().empty() ? "" : "; hint: " + e.hint())).c_str());
  }
}

void engine_step_or_throw(benchmark::State& state, planner::Backend graph) {
  static runtime::MpiSession session(nullptr, nullptr);
  auto comm = runtime::make_mpi_comm();
  planner::Strategy s;
  s.stage = 0;
  s.optimizer = planner::OptimizerKind::adamw;
  const std::string prec = env_or("ZP_ENGINE_PRECISION", "fp32");
  s.precision = prec == "bf16" ? planner::Precision::bf16 : planner::Precision::fp32;
  s.micro_batch = std::stoll(env_or("ZP_ENGINE_B", "1"));
  s.seq = std::stoll(env_or("ZP_ENGINE_T", smoke ? "64" : "256"));
  s.flash_attention = env_or("ZP_ENGINE_FLASH", "0") == "1";
  const std::string model = env_or("ZP_ENGINE_MODEL", smoke ? "gpt2-tiny" : "gpt2");
  models::ModelSpec m = models::load_model(model);
  m.embd_dropout = m.attn_dropout = m.resid_dropout = 0;  // the same model in both graphs
  const planner::Plan plan =
      planner::make_plan(m, s, {planner::Profile::zeroplan, graph}, 1234);
  runtime::DeviceConfig dc;
  dc.gpu_bytes = plan.predicted.peak(planner::Tier::gpu) + (64 << 20);
  dc.cpu_bytes = plan.predicted.peak(planner::Tier::cpu) + (64 << 20);
  auto dev = runtime::make_cpu_device(dc);
  runtime::EngineOptions opt;
  opt.lr = 1e-4f;
  opt.weight_decay = 0.01f;
  runtime::Engine engine(plan, *dev, *comm, runtime::TokenData::load(""), opt);
  double loss = engine.step().loss;  // warm-up (first-touch of the arenas)
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) loss = engine.step().loss;
  const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
                        static_cast<double>(std::max<benchmark::IterationCount>(1, state.iterations()));
  // A step that produced no finite loss is a broken engine, not a fast one.
  if (!std::isfinite(loss) || loss <= 0) state.SkipWithError("the loss is not a positive finite number");
  const double tokens = static_cast<double>(s.micro_batch * s.seq);
  state.counters["tokens_per_s"] =
      benchmark::Counter(tokens * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["loss"] = loss;
  if (graph == planner::Backend::cpu) cpu_graph_step_s = step_s;
  else if (cpu_graph_step_s > 0) state.counters["x_cpu_graph"] = cpu_graph_step_s / step_s;
  state.SetLabel(model + " " + prec + (graph == planner::Backend::cpu ? "" : ", gpu graph"));
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--benchmark_min_time=", 0) == 0 && std::stod(a.substr(21)) < 0.1) smoke = true;
  }
  benchmark::RegisterBenchmark("engine_step", engine_step, planner::Backend::cpu)
      ->Unit(benchmark::kMillisecond)->UseRealTime();
  benchmark::RegisterBenchmark("engine_step_gpu_graph", engine_step, planner::Backend::cuda)
      ->Unit(benchmark::kMillisecond)->UseRealTime();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
