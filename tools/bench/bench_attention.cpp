// bench_attention: one causal attention's forward + backward on the CPU, flash
// (cpu_flash.cpp) against the three-step attention the training graph otherwise runs (scores,
// softmax, values and their backwards, cpu_kernels.cpp), in the same run; prints the time
// ratio and the memory each needs beyond q|k|v, the output and their gradients.
//
// The shape is the LLaMA-style 125M model's attention (12 query heads over 4
// key/value heads of 64) at B = 1, T = 2048; ZP_ATTN_T and ZP_ATTN_B change them. A smoke run
// (--benchmark_min_time below 0.1 s, as CTest's) uses T = 256. Before timing, both paths run
// once and must agree (out and dqkv within 1e-4 of their scale): a wrong answer is
// SkipWithError, not a fast time.
//   build/bin/bench_attention --benchmark_repetitions=3 --benchmark_enable_random_interleaving=true
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "ratio_reporter.hpp"
#include "zp/runtime/cpu_kernels.hpp"

namespace {

namespace cpu = zp::runtime::cpu;

cpu::AttnShape g_shape{1, 2048, 12, 4, 64, 0};

std::size_t sq(const cpu::AttnShape& s) {  // one (B, NH, T, T) tensor's elements
  return static_cast<std::size_t>(s.B * s.NH * s.T * s.T);
}
std::size_t rows(const cpu::AttnShape& s) {
  return static_cast<std::size_t>(s.B * s.T);
}

// Bytes beyond q|k|v, out, dout and dqkv: the three steps keep preatt and att (B,NH,T,T) from
// the forward and one more for datt (dpreatt is written in place); flash keeps lse (B,NH,T)
// and its backward's dq_acc (B,T,NH*HS) and dsum (B,NH,T) (the planner's graph.cpp counts the
// same).
double three_step_bytes(const cpu::AttnShape& s) {
  return 3.0 * 4.0 * static_cast<double>(sq(s));
}
double flash_bytes(const cpu::AttnShape& s) {
  return 4.0 *
         (2.0 * static_cast<double>(s.B * s.NH * s.T) + static_cast<double>(rows(s) * s.out_row()));
}

struct Inputs {
  std::vector<float> qkv, dout;
  explicit Inputs(const cpu::AttnShape& s) {
    std::mt19937 rng(5);
    std::normal_distribution<float> n(0.0f, 1.0f);
    qkv.resize(rows(s) * static_cast<std::size_t>(s.row()));
    dout.resize(rows(s) * static_cast<std::size_t>(s.out_row()));
    for (float& x : qkv) x = n(rng);
    for (float& x : dout) x = n(rng);
  }
};

struct ThreeStep {
  std::vector<float> pre, att, datt, out, dqkv;
  explicit ThreeStep(const cpu::AttnShape& s)
      : pre(sq(s)), att(sq(s)), datt(sq(s)), out(rows(s) * s.out_row()), dqkv(rows(s) * s.row()) {}
  void run(const Inputs& in, const cpu::AttnShape& s) {
    cpu::attention_scores(pre.data(), in.qkv.data(), s);
    cpu::attention_softmax(att.data(), pre.data(), s);
    cpu::attention_values(out.data(), att.data(), in.qkv.data(), s);
    std::fill(datt.begin(), datt.end(), 0.0f);
    std::fill(dqkv.begin(), dqkv.end(), 0.0f);
    cpu::attention_values_backward(datt.data(), dqkv.data(), in.dout.data(), att.data(),
                                   in.qkv.data(), s);
    cpu::attention_softmax_backward(datt.data(), datt.data(), att.data(), s);
    cpu::attention_scores_backward(dqkv.data(), datt.data(), in.qkv.data(), s);
  }
};

struct Flash {
  std::vector<float> out, lse, dq_acc, dsum, dqkv;
  explicit Flash(const cpu::AttnShape& s)
      : out(rows(s) * s.out_row()),
        lse(static_cast<std::size_t>(s.B * s.NH * s.T)),
        dq_acc(rows(s) * s.out_row()),
        dsum(lse.size()),
        dqkv(rows(s) * s.row()) {}
  void run(const Inputs& in, const cpu::AttnShape& s) {
    cpu::flash_attention_forward(out.data(), lse.data(), in.qkv.data(), s, 0.0f, 0);
    std::fill(dqkv.begin(), dqkv.end(), 0.0f);
    cpu::flash_attention_backward(dqkv.data(), dq_acc.data(), dsum.data(), in.dout.data(),
                                  in.qkv.data(), out.data(), lse.data(), s, 0.0f, 0);
  }
};

// The largest |a - b| over the largest |b|.
double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return scale > 0 ? err / scale : INFINITY;
}

// Both paths once, compared; "" when they agree.
std::string check_answers(const cpu::AttnShape& s) {
  static std::string verdict = [&] {
    const Inputs in(s);
    ThreeStep a(s);
    Flash f(s);
    a.run(in, s);
    f.run(in, s);
    const double eo = rel_error(f.out, a.out), eg = rel_error(f.dqkv, a.dqkv);
    return eo <= 1e-4 && eg <= 1e-4
               ? std::string()
               : fmt::format("flash disagrees with the three steps: out {:.2e}, dqkv {:.2e}", eo,
                             eg);
  }();
  return verdict;
}

template <class Path>
void BM_Attention(benchmark::State& state, double bytes) {
  const cpu::AttnShape s = g_shape;
  if (const std::string e = check_answers(s); !e.empty()) {
    state.SkipWithError(e.c_str());
    return;
  }
  const Inputs in(s);
  Path p(s);
  for (auto _ : state) {
    p.run(in, s);
    benchmark::DoNotOptimize(p.dqkv.data());
    benchmark::ClobberMemory();
  }
  state.counters["T"] = static_cast<double>(s.T);
  state.counters["attn_MiB"] = bytes / (1024.0 * 1024.0);
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(rows(s)) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}

void print_ratios(const zp::bench::RatioReporter& r) {
  const double t3 = r.time("three_step"), tf = r.time("flash");
  if (std::isnan(t3) || std::isnan(tf)) return;
  const cpu::AttnShape& s = g_shape;
  const double ratio = tf / t3;
  fmt::print("\nratios from this run (B={} T={}, {} heads over {} kv heads of {}, {} threads):\n",
             s.B, s.T, s.NH, s.KVH, s.HS, omp_get_max_threads());
  fmt::print("  flash time / three-step time (forward + backward): {:.2f}x (goal <= 1.5x: {})\n",
             ratio, ratio <= 1.5 ? "met" : "NOT met");
  fmt::print(
      "  attention memory: flash {:.2f} MiB (O(T)), three steps {:.1f} MiB (O(T^2)): {:.0f}x "
      "less\n",
      flash_bytes(s) / 1048576.0, three_step_bytes(s) / 1048576.0,
      three_step_bytes(s) / flash_bytes(s));
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::stoll(v) : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i], flag = "--benchmark_min_time=";
    if (a.substr(0, flag.size()) == flag) smoke = std::atof(argv[i] + flag.size()) < 0.1;
  }
  g_shape.T = env_int("ZP_ATTN_T", smoke ? 256 : 2048);
  g_shape.B = env_int("ZP_ATTN_B", 1);
  if (g_shape.T < 1 || g_shape.B < 1) {
    fmt::print(stderr, "error: ZP_ATTN_T and ZP_ATTN_B must be positive\n");
    return 1;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RegisterBenchmark("three_step", BM_Attention<ThreeStep>, three_step_bytes(g_shape))
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  benchmark::RegisterBenchmark("flash", BM_Attention<Flash>, flash_bytes(g_shape))
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  zp::bench::RatioReporter reporter(print_ratios);
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
