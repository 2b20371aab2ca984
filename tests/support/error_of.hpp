// error_of.hpp: the message (and hint) of the zp::Error a callable throws, for tests of bad input.
// Not a matcher: tests search the message for the words the user must see.
#pragma once

#include <string>

#include "zp/error.hpp"

namespace zp::test {

// The zp::Error's what() ("" when f throws none; other exceptions pass through).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const zp::Error& e) {
    return e.what();
  }
  return "";
}

// The zp::Error's hint ("" when f throws none).
template <typename F>
std::string hint_of(F&& f) {
  try {
    f();
  } catch (const zp::Error& e) {
    return e.hint();
  }
  return "";
}

}  // namespace zp::test
