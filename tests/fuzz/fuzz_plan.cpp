// libFuzzer: a plan file (planner::plan_from_json); an accepted plan written back reads the same.
#include "fuzz_target.hpp"
#include "zp/json_fields.hpp"
#include "zp/planner/plan.hpp"

#include <nlohmann/json.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return zp::fuzz::refuse_or_accept(data, size, [](std::string_view t) {
    const zp::planner::Plan p = zp::planner::plan_from_json(zp::parse_json_text(t, "plan.json"), "plan.json");
    const nlohmann::json back = zp::planner::to_json(p);
    if (zp::planner::to_json(zp::planner::plan_from_json(back, "back.json")) != back) __builtin_trap();
  });
}
