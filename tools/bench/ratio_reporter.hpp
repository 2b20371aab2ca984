// ratio_reporter.hpp: Google Benchmark's console display plus, at the end, ratios between
// benchmarks of the same run (the machine is shared and noisy: only ratios measured side by
// side mean anything). Collects each benchmark's mean real time per iteration by function
// name; the caller's `finish` reads them through time() and prints its ratios.
//
// Example:
//   zp::bench::RatioReporter reporter([](const zp::bench::RatioReporter& r) {
//     fmt::print("flash / three-step: {:.2f}x\n", r.time("flash") / r.time("three_step"));
//   });
//   benchmark::RunSpecifiedBenchmarks(&reporter);
#pragma once

#include <benchmark/benchmark.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace zp::bench {

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  explicit RatioReporter(std::function<void(const RatioReporter&)> finish)
      : finish_(std::move(finish)) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs)
      if (r.run_type == Run::RT_Iteration && !r.error_occurred && r.iterations > 0) {
        Acc& a = seconds_[r.run_name.function_name];
        a.seconds += r.real_accumulated_time / static_cast<double>(r.iterations);
        a.count += 1;
      }
    ConsoleReporter::ReportRuns(runs);
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    finish_(*this);
  }
  // Mean seconds per iteration of a benchmark over its repetitions; NaN if it did not run
  // (filtered out, or it failed its own check).
  double time(const std::string& name) const {
    const auto it = seconds_.find(name);
    return it == seconds_.end() ? NAN : it->second.seconds / it->second.count;
  }

 private:
  struct Acc {
    double seconds = 0;
    int count = 0;
  };
  std::function<void(const RatioReporter&)> finish_;
  std::map<std::string, Acc> seconds_;
};

}  // namespace zp::bench
