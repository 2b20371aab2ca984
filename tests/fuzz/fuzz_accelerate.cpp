// libFuzzer: accelerate's config file, YAML or JSON (planner::apply_accelerate_config).
#include "fuzz_target.hpp"
#include "zp/planner/accelerate_config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return zp::fuzz::refuse_or_accept(data, size, [](std::string_view t) {
    std::vector<std::string> assumed;
    (void)zp::planner::apply_accelerate_config(zp::planner::Strategy{}, t, "accelerate.yaml", &assumed);
  });
}
