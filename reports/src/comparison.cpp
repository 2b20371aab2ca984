// comparison.cpp: predicted-vs-measured reports of a run.
#include "zp/reports/comparison.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/units.hpp"

namespace zp::reports {

using planner::Category;
using planner::Tier;

double error_pct(uint64_t predicted, uint64_t measured) {
  if (predicted == 0) return measured == 0 ? 0.0 : 100.0;
  const double p = static_cast<double>(predicted), m = static_cast<double>(measured);
  return std::fabs(m - p) / p * 100.0;
}

double Comparison::max_error_pct() const {
  double e = 0;
  for (const RankMemory& r : ranks)
    for (Tier t : planner::kTiers) e = std::max(e, error_pct(r.predicted.peak(t), r.measured.peak(t)));
  return e;
}

nlohmann::json to_json(const Comparison& c) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankMemory& r : c.ranks) {
    ranks.push_back({{"rank", r.rank},
                     {"predicted", planner::to_json(r.predicted)},
                     {"measured", planner::to_json(r.measured)}});
    if (r.outside_arena)
      ranks.back()["outside_arena"] = {{"gpu_total", r.outside_arena->gpu_total_bytes},
                                       {"context", r.outside_arena->context_bytes},
                                       {"libraries", r.outside_arena->libraries_bytes}};
  }
  nlohmann::json steps = nlohmann::json::array();
  for (const StepRecord& s : c.steps)
    steps.push_back({{"step", s.step},
                     {"loss", s.loss},
                     {"seconds", s.seconds},
                     {"grad_norm", s.grad_norm},
                     {"loss_scale", s.loss_scale},
                     {"skipped", s.skipped}});
  return {{"schema", "zero-run/report/v1"},
          {"model", {{"name", c.model}, {"params", c.n_params}}},
          {"strategy", planner::to_json(c.strategy)},
          {"device", c.device},
          {"ranks", ranks},
          {"steps", steps},
          {"verdict",
           {{"max_error_pct", c.max_error_pct()},
            {"tolerance_pct", c.tolerance_pct},
            {"within_tolerance", c.within_tolerance()}}}};
}

std::string render_comparison(const Comparison& c, Format f) {
  if (f == Format::json) return to_json(c).dump(2) + "\n";
  const bool csv = f == Format::csv;
  auto bytes = [&](uint64_t b) { return csv ? fmt::format("{}", b) : format_bytes(b); };
  auto pct = [&](double e) { return fmt::format("{:.2f}%", e); };
  if (csv) {
    Table t({"rank", "tier", "category", "predicted", "measured", "error"}, {});
    for (const RankMemory& r : c.ranks)
      for (Tier tier : planner::kTiers) {
        for (Category cat : planner::kCategories)
          t.add({fmt::format("{}", r.rank), std::string(to_string(tier)), std::string(to_string(cat)),
                 bytes(r.predicted[tier][cat]), bytes(r.measured[tier][cat]),
                 pct(error_pct(r.predicted[tier][cat], r.measured[tier][cat]))});
        t.add({fmt::format("{}", r.rank), std::string(to_string(tier)), "peak",
               bytes(r.predicted.peak(tier)), bytes(r.measured.peak(tier)),
               pct(error_pct(r.predicted.peak(tier), r.measured.peak(tier)))});
      }
    return t.render(f);
  }
  std::string out;
  // One table: categories down, (predicted, measured) per used tier across, one block per rank.
  std::vector<Tier> tiers;
  for (Tier t : planner::kTiers)
    for (const RankMemory& r : c.ranks)
      if ((r.predicted.peak(t) > 0 || r.measured.peak(t) > 0) &&
          std::find(tiers.begin(), tiers.end(), t) == tiers.end())
        tiers.push_back(t);
  if (tiers.empty()) tiers.push_back(Tier::gpu);
  std::vector<std::string> header = {"rank", "category"};
  std::vector<Align> align = {Align::right, Align::left};
  for (Tier t : tiers) {
    for (const char* what : {"predicted", "measured", "error"}) {
      header.push_back(fmt::format("{} {}", to_string(t), what));
      align.push_back(Align::right);
    }
  }
  Table t(header, align);
  for (const RankMemory& r : c.ranks) {
    for (Category cat : planner::kCategories) {
      bool any = false;
      for (Tier tier : tiers) any = any || r.predicted[tier][cat] > 0 || r.measured[tier][cat] > 0;
      if (!any) continue;
      std::vector<std::string> row = {fmt::format("{}", r.rank), std::string(to_string(cat))};
      for (Tier tier : tiers) {
        row.push_back(bytes(r.predicted[tier][cat]));
        row.push_back(bytes(r.measured[tier][cat]));
        row.push_back(pct(error_pct(r.predicted[tier][cat], r.measured[tier][cat])));
      }
      t.add(row);
    }
    std::vector<std::string> row = {fmt::format("{}", r.rank), "peak"};
    for (Tier tier : tiers) {
      row.push_back(bytes(r.predicted.peak(tier)));
      row.push_back(bytes(r.measured.peak(tier)));
      row.push_back(pct(error_pct(r.predicted.peak(tier), r.measured.peak(tier))));
    }
    t.add(row);
    t.add_rule();
  }
  out += t.render(f);
  for (const RankMemory& r : c.ranks)
    if (r.outside_arena)
      out += fmt::format("rank {}: outside the arena (cudaMemGetInfo, not predicted): CUDA context "
                         "{}, libraries {}, of {} on the GPU\n",
                         r.rank, format_bytes(r.outside_arena->context_bytes),
                         format_bytes(r.outside_arena->libraries_bytes),
                         format_bytes(r.outside_arena->gpu_total_bytes));
  if (c.within_tolerance())
    out += fmt::format("\nok: every peak within {:.2f}% of the prediction (tolerance {:.2f}%)\n",
                       c.max_error_pct(), c.tolerance_pct);
  else
    out += fmt::format("\nMISMATCH: a peak is {:.2f}% off the prediction (tolerance {:.2f}%): the "
                       "planner or the runtime is wrong; see the rows above\n",
                       c.max_error_pct(), c.tolerance_pct);
  return out;
}

}  // namespace zp::reports
