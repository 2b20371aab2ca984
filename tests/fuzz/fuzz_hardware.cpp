// libFuzzer: a hardware description (planner::parse_hardware). Seeds: planner/hardware.
#include "fuzz_target.hpp"
#include "zp/json_fields.hpp"
#include "zp/planner/hardware.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return zp::fuzz::refuse_or_accept(data, size, [](std::string_view t) {
    (void)zp::planner::parse_hardware(zp::parse_json_text(t, "hw.json"), "hw.json");
  });
}
