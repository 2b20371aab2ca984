// bench_gpt2_cpu: tokens/s of one GPT-2 training step's forward + backward (no optimizer)
// through the CPU kernels (tests/support/gpt2_step.hpp), gpt2-small-sized by default. Not the
// engine's step and not a comparison by itself: tools/bench/compare_gpt2.sh runs this and
// bench_gpt2_torch.py on the same shape and prints the ratio.
//
// The shape comes from the environment: ZP_GPT2_MODEL (a catalog name, default gpt2, i.e.
// gpt2-small: C=768 NH=12 L=12 V=50257), ZP_GPT2_B (default 1), ZP_GPT2_T (default 256),
// ZP_GPT2_THREADS (default: every core). A smoke run (--benchmark_min_time below 0.1 s, as
// CTest's) uses gpt2-tiny at T=64 unless those variables say otherwise.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "gpt2_step.hpp"
#include "zp/models/model_spec.hpp"

namespace {

struct Config {
  std::string model = "gpt2";
  int64_t B = 1, T = 256;
  int n_threads = 1;
};

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::stoll(v) : fallback;
}

// splitmix64 (Steele et al. 2014): a fast deterministic stream for 124M initial weights.
struct SplitMix {
  uint64_t s;
  float uniform() {  // [-1, 1)
    uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }
};

void BM_Gpt2Step(benchmark::State& state, Config cfg) {
  const auto m = zp::models::load_model(cfg.model);
  const zp::testing::Gpt2Dims d{cfg.B,     cfg.T,         m.n_embd,    m.n_head,
                                m.n_layer, m.n_positions, m.vocab_size};
  zp::runtime::cpu::set_threads(cfg.n_threads);
  zp::testing::Gpt2Step step(d);
  // The layout of the flat parameter buffer must hold exactly the catalog's parameter count.
  if (step.n_params() != zp::models::count_params(m).total) {
    state.SkipWithError("the step's parameter layout disagrees with the catalog's count");
    return;
  }
  // GPT-2's init scale: weights uniform with std 0.02, LayerNorm weights 1, biases 0.
  std::vector<float> params(step.n_params()), grads(step.n_params(), 0.0f);
  SplitMix rng{42};
  for (auto& p : params) p = 0.02f * std::sqrt(3.0f) * rng.uniform();
  const zp::testing::Gpt2Tensors<float> t(params.data(), d);
  auto fill = [&](float* p, float v) { std::fill(p, p + d.C, v); };
  for (const auto& b : t.blocks)
    fill(b.ln1w, 1.f), fill(b.ln1b, 0.f), fill(b.ln2w, 1.f), fill(b.ln2b, 0.f);
  fill(t.lnfw, 1.f), fill(t.lnfb, 0.f);
  std::vector<int32_t> tokens(d.B * d.T), targets(d.B * d.T);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>((i * 7919) % static_cast<std::size_t>(d.V));
    targets[i] = static_cast<int32_t>((i * 104729 + 1) % static_cast<std::size_t>(d.V));
  }

  // The answer first: at this init the logits are small, so the loss is near ln V (uniform
  // prediction); the gradients are finite and not all zero.
  const float loss = step.forward(params.data(), tokens.data(), targets.data());
  step.backward(params.data(), grads.data());
  double grad_sq = 0.0;
  for (float g : grads) grad_sq += static_cast<double>(g) * g;
  const double ln_v = std::log(static_cast<double>(d.V));
  if (!(std::abs(loss - ln_v) < 0.5) || !std::isfinite(grad_sq) || grad_sq == 0.0) {
    state.SkipWithError(fmt::format("wrong answer: loss {} (want about ln V = {:.3f}), |grad|^2 {}",
                                    loss, ln_v, grad_sq)
                            .c_str());
    return;
  }

  for (auto _ : state) {
    std::fill(grads.begin(), grads.end(), 0.0f);  // a training step starts from zeroed gradients
    benchmark::DoNotOptimize(step.forward(params.data(), tokens.data(), targets.data()));
    step.backward(params.data(), grads.data());
    benchmark::ClobberMemory();
  }
  state.counters["tokens_per_s"] = benchmark::Counter(
      static_cast<double>(d.B * d.T), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = cfg.n_threads;
  state.counters["loss0"] = loss;
}

}  // namespace

int main(int argc, char** argv) {
  // A tiny time budget means a smoke run: pick the small model unless told otherwise.
  bool smoke = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const std::string_view flag = "--benchmark_min_time=";
    if (a.substr(0, flag.size()) == flag) smoke = std::atof(argv[i] + flag.size()) < 0.1;
  }
  Config cfg;
  const char* model = std::getenv("ZP_GPT2_MODEL");
  cfg.model = model && *model ? model : (smoke ? "gpt2-tiny" : "gpt2");
  cfg.B = env_int("ZP_GPT2_B", 1);
  cfg.T = env_int("ZP_GPT2_T", smoke ? 64 : 256);
  cfg.n_threads = static_cast<int>(env_int("ZP_GPT2_THREADS", omp_get_num_procs()));
  const std::string name =
      fmt::format("gpt2_step/{}/B{}/T{}/threads{}", cfg.model, cfg.B, cfg.T, cfg.n_threads);
  benchmark::RegisterBenchmark(name.c_str(), BM_Gpt2Step, cfg)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
