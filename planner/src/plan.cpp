// plan.cpp: making, writing and reading plan files.
#include "zp/planner/plan.hpp"

#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/json_fields.hpp"
#include "zp/planner/estimate.hpp"

namespace zp::planner {

using nlohmann::json;

Plan make_plan(const models::ModelSpec& m, const Strategy& s, const PlanOptions& o,
               uint64_t seed) {
  const Estimate e = estimate(m, s, nullptr, o);
  Plan p;
  p.model = m;
  p.strategy = e.strategy;
  p.options = o;
  p.seed = seed;
  p.predicted = e.per_device;
  p.partition_elems = e.schedule.partition_elems;
  p.n_params = e.schedule.n_params;
  return p;
}

json to_json(const Plan& p) {
  return {{"schema", "zero-plan/plan/v1"},
          {"model", {{"name", p.model.name}, {"config", json::parse(models::to_hf_config(p.model))}}},
          {"strategy", to_json(p.strategy)},
          {"profile", to_string(p.options.profile)},
          {"backend", to_string(p.options.backend)},
          {"model_code", to_string(p.options.model_code)},
          {"seed", p.seed},
          {"prediction",
           {{"per_device", to_json(p.predicted)},
            {"n_params", p.n_params},
            {"partition_elems", p.partition_elems}}}};
}

Plan plan_from_json(const json& j, const std::string& origin) {
  if (!j.is_object()) throw Error(fmt::format("{}: a plan must be a JSON object", origin));
  static const std::set<std::string> known = {"schema", "model", "strategy", "profile",
                                              "backend", "model_code", "seed", "prediction"};
  for (const auto& [key, value] : j.items())
    if (!known.contains(key))
      throw Error(fmt::format("{}: unknown field '{}'", origin, key),
                  "plan files are written by 'zero-plan plan -o'");
  Fields f(j, origin);
  const std::string schema = f.string("schema");
  if (schema != "zero-plan/plan/v1")
    throw Error(fmt::format("{}: schema '{}' is not zero-plan/plan/v1", origin, schema),
                "write the plan with this version's 'zero-plan plan -o'");
  Plan p;
  const json* model = f.object("model");
  if (model == nullptr) throw Error(fmt::format("{}: missing field 'model'", origin));
  Fields mf(*model, origin, "model.");
  const json* config = mf.object("config");
  if (config == nullptr) throw Error(fmt::format("{}: missing field 'model.config'", origin));
  p.model = models::parse_hf_config(config->dump(), origin + ": model.config");
  p.model.name = mf.string("name", p.model.name);
  const json* strategy = f.object("strategy");
  if (strategy == nullptr) throw Error(fmt::format("{}: missing field 'strategy'", origin));
  p.strategy = strategy_from_json(*strategy, origin);
  auto prof = profile_from_string(f.string("profile", "zeroplan"));
  if (!prof) f.fail("profile", "\"zeroplan\" or \"deepspeed\"");
  auto back = backend_from_string(f.string("backend", "cpu"));
  if (!back) f.fail("backend", "\"cpu\" or \"cuda\"");
  auto code = model_code_from_string(f.string("model_code", "fused"));
  if (!code) f.fail("model_code", "\"fused\" or \"transformers\"");
  p.options = {*prof, *back, *code};
  p.seed = f.byte_count("seed", 1234);
  if (const json* pred = f.object("prediction")) {
    Fields pf(*pred, origin, "prediction.");
    const json* pd = pf.object("per_device");
    if (pd == nullptr) throw Error(fmt::format("{}: missing field 'prediction.per_device'", origin));
    p.predicted = per_device_from_json(*pd, origin);
    p.n_params = pf.byte_count("n_params", 0);
    p.partition_elems = pf.byte_count("partition_elems", 0);
  } else {
    throw Error(fmt::format("{}: missing field 'prediction'", origin),
                "plan files are written by 'zero-plan plan -o'");
  }
  return p;
}

}  // namespace zp::planner
