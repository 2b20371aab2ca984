// fuzz_target.hpp (tests/fuzz): what every libFuzzer target of the parsers shares. A parser may
// refuse any input with zp::Error (that is its job); anything else escaping it (a std::
// exception from nlohmann, yaml-cpp or the standard library, a crash, a sanitizer report, a
// hang) is a defect the fuzzer reports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "zp/error.hpp"

namespace zp::fuzz {

inline std::string_view text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Runs f(text), swallowing only the parsers' own refusals.
template <typename F>
int refuse_or_accept(const uint8_t* data, size_t size, F&& f) {
  try {
    f(text(data, size));
  } catch (const zp::Error&) {
  }
  return 0;
}

}  // namespace zp::fuzz
