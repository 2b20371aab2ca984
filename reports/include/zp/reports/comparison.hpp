// zp/reports/comparison.hpp: predicted against measured memory for a run, per rank, tier and
// category, with the steps it took and the verdict; the one type every run report is rendered
// from (text side by side, markdown, csv, and the zero-run/report/v1 JSON contract). No
// numbers are made here: the planner predicts them and the runtime measures them.
//
// Example usage:
//   Comparison c;
//   c.ranks.push_back({0, plan.predicted, device->measured()});
//   c.tolerance_pct = 2;
//   if (!c.within_tolerance()) return 1;
//   write_file_atomic("run.json", to_json(c).dump(2));
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "zp/planner/estimate.hpp"
#include "zp/planner/memory.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/strategy.hpp"
#include "zp/reports/table.hpp"

namespace zp::reports {

// GPU memory outside the arenas (cudaMemGetInfo on the cuda backend): the CUDA context, and
// what the libraries (cuBLAS, NCCL, module images) hold beyond the arena; and the planner's
// bound on their sum (planner::cuda_outside_arena_bound). Not part of the verdict (a bound,
// not a prediction within 2%); reported beside the arena figures.
struct OutsideArena {
  uint64_t gpu_total_bytes = 0;
  uint64_t context_bytes = 0;
  uint64_t libraries_bytes = 0;
  uint64_t predicted_at_most_bytes = 0;  // 0: no bound given
  uint64_t measured_bytes() const { return context_bytes + libraries_bytes; }
  bool within_bound() const { return measured_bytes() <= predicted_at_most_bytes; }
};

struct RankMemory {
  int rank = 0;
  planner::PerDevice predicted, measured;
  std::optional<OutsideArena> outside_arena;  // cuda backend only
};

struct StepRecord {
  int64_t step = 0;
  double loss = 0, seconds = 0, grad_norm = 0;
  double loss_scale = 1;
  bool skipped = false;
};

struct Comparison {
  std::string model;            // name
  uint64_t n_params = 0;
  uint64_t n_expert_params = 0;  // of n_params, the routed experts' (MoE models; 0 otherwise)
  planner::Strategy strategy;
  std::string device = "cpu";   // backend
  std::vector<RankMemory> ranks;
  std::vector<StepRecord> steps;
  double tolerance_pct = 2.0;
  // false for a prediction alone (zero-plan estimate --report): no measured side, no verdict.
  bool has_measured = true;
  // Bytes in use per tier and category over one micro-step, one sample per op position (-1:
  // before the first op): the planner's replay and the runtime's first micro-step on rank 0.
  // op_names[pos] names the op at each position. Empty when not recorded.
  std::vector<planner::TimelineSample> predicted_timeline, measured_timeline;
  std::vector<std::string> op_names;

  // Largest |measured - predicted| / predicted over every rank's per-tier peak, in percent
  // (a tier predicted empty that is used counts as 100%).
  double max_error_pct() const;
  bool within_tolerance() const { return max_error_pct() <= tolerance_pct; }
};

// A prediction alone, as a Comparison (has_measured false, one rank): what zero-plan estimate
// renders as an HTML report, with the planner's timeline.
Comparison comparison_from_estimate(const planner::Estimate& e);

// |measured - predicted| / predicted in percent; 0 when both are 0.
double error_pct(uint64_t predicted, uint64_t measured);

// {"schema":"zero-run/report/v1","ranks":[{"rank":0,"predicted":{per_device},"measured":{...}}],
//  (a rank on the cuda backend adds "outside_arena":{"gpu_total":B,"context":B,"libraries":B,
//  "measured":context+libraries,"predicted_at_most":B,"within_bound":b}, the last two when a
//  bound was given)
//  "steps":[{"step":1,"loss":x,"seconds":t}],"verdict":{"max_error_pct":e,"within_tolerance":b},
//  "timeline":{"categories":[...],"ops":[...],"predicted":[{"pos":-1,"gpu":[8 bytes],...}],
//  "measured":[...]}}. Without a measurement: no "measured" per rank, no "verdict"; "timeline"
//  only when recorded, a tier only where it holds bytes.
nlohmann::json to_json(const Comparison& c);

// text/markdown: a side-by-side table per rank (tier, category, predicted, measured, error)
// and the verdict; csv: one row per rank, tier and category.
std::string render_comparison(const Comparison& c, Format f);

// JUnit XML: one testcase per rank and used tier ("rank 0 gpu peak"), failed when the measured
// peak is off by more than the tolerance.
std::string render_comparison_junit(const Comparison& c);

}  // namespace zp::reports
