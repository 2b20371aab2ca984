// libFuzzer: a budgets file of zero-plan check (reports::parse_budgets). Seeds: tests/budgets.
#include "fuzz_target.hpp"
#include "zp/json_fields.hpp"
#include "zp/reports/budgets.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return zp::fuzz::refuse_or_accept(data, size, [](std::string_view t) {
    (void)zp::reports::parse_budgets(zp::parse_json_text(t, "budgets.json"), "budgets.json");
  });
}
