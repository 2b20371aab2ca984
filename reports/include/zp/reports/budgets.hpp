// zp/reports/budgets.hpp: memory budgets for CI (`zero-plan check`): a budgets file lists cases
// (a model, a strategy, a machine) with a limit per tier and the last accepted prediction; the
// check predicts each case, holds it against its budget and the accepted value, and renders
// the verdict as a table, JSON, CSV or JUnit. Not the planner: predictions come from
// planner::estimate; this file only reads budgets, compares and reports.
//
// Example usage:
//   Budgets b = load_budgets("tests/budgets/catalog.json");
//   CheckReport r = check_budgets(b);
//   fmt::print("{}", render_check(r, Format::text));
//   write_file_atomic("check.xml", render_check_junit(r));
//   if (update) write_file_atomic(b.path, with_accepted(read_text_file(b.path), r, b.path));
//   return r.passed() ? 0 : 1;
//
// The file (schema zero-plan/budgets/v1):
//   {"schema": "zero-plan/budgets/v1",
//    "max_growth_pct": 1,                        // allowed growth over the accepted value [1]
//    "cases": [{"name": "gpt2-xl on V100",        // optional, unique [model stage S dp N, hw]
//               "model": "gpt2-xl",              // catalog name, or a HF config.json path
//               "strategy": {"stage": 2, "dp": 8},   // plan-file strategy fields [defaults]
//               "ds_config": "ds.json",          // optional DeepSpeed config; strategy overrides it
//               "hardware": "v100-32g",          // preset or hardware JSON path; optional
//               "profile": "zeroplan", "device": "cuda",   // whose allocations [zeroplan, cuda]
//               "budget": {"gpu": "90% of device", "cpu": "64 GiB"},
//               "accepted": {"gpu": 15183375360},    // bytes; written by --update
//               "max_growth_pct": 0.5}]}         // per case override
// Paths are relative to the budgets file's directory.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "zp/models/model_spec.hpp"
#include "zp/planner/hardware.hpp"
#include "zp/planner/memory.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/strategy.hpp"
#include "zp/reports/table.hpp"

namespace zp::reports {

// A limit as written: bytes ("30 GiB", "5e10", or a JSON integer) or a share of the device
// ("90% of device").
struct TierLimit {
  std::string text;
  uint64_t bytes = 0;        // the absolute limit; 0 when relative
  double pct_of_device = 0;  // > 0 when relative
};
// zp::Error naming `where` ("budgets.json: cases[0].budget.gpu") when it is neither.
TierLimit parse_limit(const nlohmann::json& v, const std::string& where);

// What one rank has on a tier of `hw`, for "% of device": the gpu tier is one GPU's memory;
// cpu and nvme are the node's host memory and drives shared by the ranks on the node,
// min(dp * mp, gpus_per_node), as planner::shortfalls counts them.
uint64_t device_capacity(const planner::Hardware& hw, const planner::Strategy& s, planner::Tier t);

struct BudgetCase {
  std::string name;
  std::string model;                   // as written in the file
  models::ModelSpec spec;
  planner::Strategy strategy;
  planner::PlanOptions options;
  std::optional<planner::Hardware> hardware;
  std::array<std::optional<TierLimit>, planner::kTiers.size()> budget;
  std::array<std::optional<uint64_t>, planner::kTiers.size()> accepted;
  double max_growth_pct = 1;
};

struct Budgets {
  std::string path;
  std::vector<BudgetCase> cases;
};

// Strict: unknown fields, wrong types, unknown models or hardware are zp::Error naming the
// file and the field ("budgets.json: cases[2].budget.gpu: ...") with a hint.
Budgets parse_budgets(const nlohmann::json& j, const std::string& path);
Budgets load_budgets(const std::string& path);

// One tier of one case: checked where the case has a budget or an accepted value.
struct TierCheck {
  planner::Tier tier = planner::Tier::gpu;
  uint64_t predicted = 0;
  std::optional<uint64_t> limit;     // resolved bytes
  std::string limit_text;            // as written ("90% of device")
  std::optional<uint64_t> accepted;
  bool over_budget = false;          // predicted > limit
  bool grew = false;                 // predicted > accepted by more than max_growth_pct
  std::optional<int64_t> headroom_bytes() const;  // limit - predicted, negative when over
  std::optional<double> change_pct() const;       // (predicted - accepted) / accepted * 100
};

struct CaseCheck {
  std::string name, model, hardware;
  planner::Strategy strategy;
  double max_growth_pct = 1;
  std::vector<TierCheck> tiers;
  std::vector<std::string> failures;  // one readable sentence per failed tier check
  double seconds = 0;                 // time to predict
  bool passed() const { return failures.empty(); }
};

struct CheckReport {
  std::string path;
  std::vector<CaseCheck> cases;
  bool passed() const;
  bool over_budget() const;  // any tier of any case over its budget
};

// Predicts every case (planner::estimate) and checks it.
CheckReport check_budgets(const Budgets& b);

// text/markdown: one row per case and tier (predicted, budget, headroom, accepted, change,
// status), then each failure; csv: the same rows in bytes; json: schema zero-plan/check/v1.
std::string render_check(const CheckReport& r, Format f);

// JUnit XML: one testcase per case, a <failure> per failed tier check.
std::string render_check_junit(const CheckReport& r);

// The budgets file's text with each case's "accepted" set to its current predictions (every
// checked tier), everything else kept in its order. For --update.
std::string with_accepted(std::string_view original_text, const CheckReport& r,
                          const std::string& origin);

}  // namespace zp::reports
