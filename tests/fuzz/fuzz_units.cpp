// libFuzzer: the unit parsers on one line of text: sizes ("16 GiB", "5e8"), counts, and a
// budget's limit ("90% of device", "64 GiB", as a JSON string or number).
#include "fuzz_target.hpp"
#include "zp/reports/budgets.hpp"
#include "zp/units.hpp"

#include <nlohmann/json.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  zp::fuzz::refuse_or_accept(data, size, [](std::string_view s) { (void)zp::parse_bytes(s, "--size"); });
  zp::fuzz::refuse_or_accept(data, size, [](std::string_view s) { (void)zp::parse_count(s, "--count"); });
  zp::fuzz::refuse_or_accept(data, size, [&](std::string_view s) {
    (void)zp::reports::parse_limit(nlohmann::json(std::string(s)), "budget.gpu");
  });
  return 0;
}
