// error_of.hpp: the message (and hint) of the zp::Error a callable throws, for tests of bad input.
// Not a matcher: tests search the message for the words the user must see.
#pragma once

#include <string>
#include <utility>

#include "zp/error.hpp"

namespace zp::test {

// What a zp::Error thrown by f said: its what() and hint(), both "" when f throws none (other
// exceptions pass through).
struct Thrown {
  std::string what, hint;
};
template <typename F>
Thrown thrown(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (const zp::Error& e) {
    return {e.what(), e.hint()};
  }
  return {};
}

template <typename F>
std::string error_of(F&& f) {
  return thrown(std::forward<F>(f)).what;
}

template <typename F>
std::string hint_of(F&& f) {
  return thrown(std::forward<F>(f)).hint;
}

}  // namespace zp::test
