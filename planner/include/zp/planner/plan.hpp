// zp/planner/plan.hpp: a plan file (schema zero-plan/plan/v1): everything zero-run needs to
// execute a step without the planner (the model's config, the strategy, the profile and
// backend, the seed) and the prediction it will be judged against.
//
// Example usage:
//   Plan p = make_plan(models::load_model("gpt2-tiny"), s, {Profile::zeroplan, Backend::cpu});
//   reports::write_file_atomic("plan.json", to_json(p).dump(2));
//   Plan back = plan_from_json(parse_json_text(text, "plan.json"), "plan.json");
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "zp/models/model_spec.hpp"
#include "zp/planner/memory.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/strategy.hpp"

namespace zp::planner {

struct Plan {
  models::ModelSpec model;
  Strategy strategy;        // seq resolved
  PlanOptions options;
  uint64_t seed = 1234;     // weights and data order
  PerDevice predicted;      // per rank (every rank holds the same padded partitions)
  uint64_t partition_elems = 0;
  uint64_t n_params = 0;
};

Plan make_plan(const models::ModelSpec& m, const Strategy& s, const PlanOptions& o,
               uint64_t seed = 1234);

nlohmann::json to_json(const Plan& p);
// zp::Error naming the field for anything missing, mistyped or unknown.
Plan plan_from_json(const nlohmann::json& j, const std::string& origin);

}  // namespace zp::planner
