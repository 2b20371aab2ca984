// libFuzzer: zero-run's checkpoint manifest (runtime::manifest_from_json).
#include "fuzz_target.hpp"
#include "zp/json_fields.hpp"
#include "zp/runtime/checkpoint.hpp"

#include <nlohmann/json.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return zp::fuzz::refuse_or_accept(data, size, [](std::string_view t) {
    const auto m = zp::runtime::manifest_from_json(zp::parse_json_text(t, "manifest.json"), "manifest.json");
    const nlohmann::json back = zp::runtime::to_json(m);
    if (zp::runtime::to_json(zp::runtime::manifest_from_json(back, "back.json")) != back) __builtin_trap();
  });
}
