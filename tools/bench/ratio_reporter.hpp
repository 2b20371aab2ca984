// ratio_reporter.hpp: Google Benchmark's console display plus, at the end, ratios between
// benchmarks of the same run (the machine is shared and noisy: only ratios measured side by
// side mean anything). Collects each benchmark's real time per iteration by function name,
// once per repetition; the caller's `finish` reads the median over the repetitions through
// time() and prints its ratios. With --benchmark_repetitions=N
// --benchmark_enable_random_interleaving=true every benchmark's N runs are spread over the whole
// run, and a median ignores the runs a neighbour's burst slowed (a mean does not).
//
// Example:
//   zp::bench::RatioReporter reporter([](const zp::bench::RatioReporter& r) {
//     fmt::print("flash / three-step: {:.2f}x\n", r.time("flash") / r.time("three_step"));
//   });
//   benchmark::RunSpecifiedBenchmarks(&reporter);
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace zp::bench {

// The median of x (the mean of the middle two for an even count); NaN if x is empty.
inline double median(std::vector<double> x) {
  if (x.empty()) return NAN;
  std::sort(x.begin(), x.end());
  const std::size_t n = x.size();
  return n % 2 == 1 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2;
}

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  explicit RatioReporter(std::function<void(const RatioReporter&)> finish)
      : finish_(std::move(finish)) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs)
      if (r.run_type == Run::RT_Iteration && !r.error_occurred && r.iterations > 0)
        seconds_[r.run_name.function_name].push_back(r.real_accumulated_time /
                                                     static_cast<double>(r.iterations));
    ConsoleReporter::ReportRuns(runs);
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    finish_(*this);
  }
  // Median seconds per iteration of a benchmark over its repetitions (the mean of the middle
  // two for an even count); NaN if it did not run (filtered out, or it failed its own check).
  double time(const std::string& name) const {
    const auto it = seconds_.find(name);
    return it == seconds_.end() ? NAN : median(it->second);
  }
  // How many repetitions time() has for a benchmark.
  std::size_t repetitions(const std::string& name) const {
    const auto it = seconds_.find(name);
    return it == seconds_.end() ? 0 : it->second.size();
  }

 private:
  std::function<void(const RatioReporter&)> finish_;
  std::map<std::string, std::vector<double>> seconds_;
};

}  // namespace zp::bench
