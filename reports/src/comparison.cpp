// comparison.cpp: predicted-vs-measured reports of a run (text, markdown, csv, json, junit).
// The HTML report is html.cpp.
#include "zp/reports/comparison.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/reports/junit.hpp"
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
  if (!has_measured) return e;
  for (const RankMemory& r : ranks)
    for (Tier t : planner::kTiers) e = std::max(e, error_pct(r.predicted.peak(t), r.measured.peak(t)));
  return e;
}

Comparison comparison_from_estimate(const planner::Estimate& e) {
  Comparison c;
  c.model = e.model.name;
  c.n_params = e.params.total;
  c.n_expert_params = e.params.experts;
  c.strategy = e.strategy;
  c.device = std::string(planner::to_string(e.options.backend));
  c.has_measured = false;
  c.ranks.push_back({0, e.per_device, {}, std::nullopt});
  c.predicted_timeline = e.memory.timeline;
  c.op_names = e.schedule.op_names;
  return c;
}

namespace {
// {"pos":p,"gpu":[bytes per category],...}: a tier only where it holds bytes.
nlohmann::json timeline_json(const std::vector<planner::TimelineSample>& tl) {
  nlohmann::json out = nlohmann::json::array();
  for (const planner::TimelineSample& s : tl) {
    nlohmann::json j = {{"pos", s.pos}};
    for (Tier t : planner::kTiers) {
      const auto& b = s.bytes[static_cast<std::size_t>(t)];
      bool any = false;
      for (uint64_t v : b) any = any || v > 0;
      if (any) j[std::string(to_string(t))] = b;
    }
    out.push_back(std::move(j));
  }
  return out;
}
}  // namespace

nlohmann::json to_json(const Comparison& c) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankMemory& r : c.ranks) {
    nlohmann::json j = {{"rank", r.rank}, {"predicted", planner::to_json(r.predicted)}};
    if (c.has_measured) j["measured"] = planner::to_json(r.measured);
    if (const auto& o = r.outside_arena) {
      nlohmann::json oj = {{"gpu_total", o->gpu_total_bytes},
                           {"context", o->context_bytes},
                           {"libraries", o->libraries_bytes},
                           {"measured", o->measured_bytes()}};
      if (o->predicted_at_most_bytes > 0) {
        oj["predicted_at_most"] = o->predicted_at_most_bytes;
        oj["within_bound"] = o->within_bound();
      }
      j["outside_arena"] = std::move(oj);
    }
    ranks.push_back(std::move(j));
  }
  nlohmann::json steps = nlohmann::json::array();
  for (const StepRecord& s : c.steps)
    steps.push_back({{"step", s.step},
                     {"loss", s.loss},
                     {"seconds", s.seconds},
                     {"grad_norm", s.grad_norm},
                     {"loss_scale", s.loss_scale},
                     {"skipped", s.skipped}});
  nlohmann::json out = {{"schema", "zero-run/report/v1"},
                        {"model", {{"name", c.model}, {"params", c.n_params}}},
                        {"strategy", planner::to_json(c.strategy)},
                        {"device", c.device},
                        {"ranks", ranks},
                        {"steps", steps}};
  if (c.has_measured)
    out["verdict"] = {{"max_error_pct", c.max_error_pct()},
                      {"tolerance_pct", c.tolerance_pct},
                      {"within_tolerance", c.within_tolerance()}};
  if (!c.predicted_timeline.empty() || !c.measured_timeline.empty()) {
    nlohmann::json cats = nlohmann::json::array();
    for (Category cat : planner::kCategories) cats.push_back(to_string(cat));
    out["timeline"] = {{"categories", cats},
                       {"ops", c.op_names},
                       {"predicted", timeline_json(c.predicted_timeline)},
                       {"measured", timeline_json(c.measured_timeline)}};
  }
  return out;
}

std::string render_comparison_junit(const Comparison& c) {
  JunitSuite suite{fmt::format("zero-run {} ({})", c.model, planner::describe(c.strategy)), {}};
  for (const RankMemory& r : c.ranks)
    for (Tier t : planner::kTiers) {
      const uint64_t p = r.predicted.peak(t), m = r.measured.peak(t);
      if (p == 0 && m == 0) continue;
      JunitCase jc;
      jc.name = fmt::format("rank {} {} peak", r.rank, to_string(t));
      jc.classname = c.model;
      const double e = c.has_measured ? error_pct(p, m) : 0.0;
      jc.system_out = c.has_measured
                          ? fmt::format("predicted {} ({} B), measured {} ({} B), error {:.2f}%",
                                        format_bytes(p), p, format_bytes(m), m, e)
                          : fmt::format("predicted {} ({} B), not measured", format_bytes(p), p);
      if (e > c.tolerance_pct)
        jc.failures.push_back(fmt::format(
            "rank {} {} peak: measured {} is {:.2f}% off the predicted {} (tolerance {:.2f}%)",
            r.rank, to_string(t), format_bytes(m), e, format_bytes(p), c.tolerance_pct));
      suite.cases.push_back(std::move(jc));
    }
  return render_junit({suite});
}

std::string render_comparison(const Comparison& c, Format f) {
  if (f == Format::json) return to_json(c).dump(2) + "\n";
  const bool csv = f == Format::csv;
  auto bytes = [&](uint64_t b) { return csv ? fmt::format("{}", b) : format_bytes(b); };
  auto pct = [&](double e) { return fmt::format("{:.2f}%", e); };
  // Without a measurement (a prediction alone) the measured and error cells stay empty.
  auto measured = [&](uint64_t b) { return c.has_measured ? bytes(b) : std::string(); };
  auto error = [&](uint64_t p, uint64_t m) { return c.has_measured ? pct(error_pct(p, m)) : std::string(); };
  if (csv) {
    Table t({"rank", "tier", "category", "predicted", "measured", "error"}, {});
    for (const RankMemory& r : c.ranks)
      for (Tier tier : planner::kTiers) {
        for (Category cat : planner::kCategories)
          t.add({fmt::format("{}", r.rank), std::string(to_string(tier)), std::string(to_string(cat)),
                 bytes(r.predicted[tier][cat]), measured(r.measured[tier][cat]),
                 error(r.predicted[tier][cat], r.measured[tier][cat])});
        t.add({fmt::format("{}", r.rank), std::string(to_string(tier)), "peak",
               bytes(r.predicted.peak(tier)), measured(r.measured.peak(tier)),
               error(r.predicted.peak(tier), r.measured.peak(tier))});
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
      if (!c.has_measured && what[0] != 'p') continue;
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
        if (!c.has_measured) continue;
        row.push_back(bytes(r.measured[tier][cat]));
        row.push_back(pct(error_pct(r.predicted[tier][cat], r.measured[tier][cat])));
      }
      t.add(row);
    }
    std::vector<std::string> row = {fmt::format("{}", r.rank), "peak"};
    for (Tier tier : tiers) {
      row.push_back(bytes(r.predicted.peak(tier)));
      if (!c.has_measured) continue;
      row.push_back(bytes(r.measured.peak(tier)));
      row.push_back(pct(error_pct(r.predicted.peak(tier), r.measured.peak(tier))));
    }
    t.add(row);
    t.add_rule();
  }
  out += t.render(f);
  if (!c.has_measured) return out;
  for (const RankMemory& r : c.ranks)
    if (const auto& o = r.outside_arena) {
      const std::string bound =
          o->predicted_at_most_bytes == 0
              ? std::string("not predicted")
              : fmt::format("predicted at most {}{}", format_bytes(o->predicted_at_most_bytes),
                            o->within_bound() ? "" : " (ABOVE the bound)");
      out += fmt::format("rank {}: outside the arena (cudaMemGetInfo): measured {} (CUDA context "
                         "{}, libraries {}), {}, of {} on the GPU\n",
                         r.rank, format_bytes(o->measured_bytes()), format_bytes(o->context_bytes),
                         format_bytes(o->libraries_bytes), bound, format_bytes(o->gpu_total_bytes));
    }
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
