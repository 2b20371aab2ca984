// libFuzzer: a DeepSpeed config (planner::apply_deepspeed_config over parse_json_text).
#include "fuzz_target.hpp"
#include "zp/json_fields.hpp"
#include "zp/planner/strategy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return zp::fuzz::refuse_or_accept(data, size, [](std::string_view t) {
    std::vector<std::string> assumed;
    (void)zp::planner::apply_deepspeed_config(zp::planner::Strategy{},
                                              zp::parse_json_text(t, "ds.json"), "ds.json", &assumed);
  });
}
