// zp/error.hpp: the one error type every zeroplan library throws for bad input or a failed
// operation. It carries the offending field and a hint; the CLIs print both and exit 2.
// Not for programming errors (those are asserts) and never caught inside a library.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace zp {

class Error : public std::runtime_error {
 public:
  // message: what went wrong, naming the field or file ("--dp: must be >= 1, got 0").
  // hint: what to do about it ("pass the data-parallel degree, e.g. --dp 8"); may be empty.
  explicit Error(std::string message, std::string hint = {})
      : std::runtime_error(std::move(message)), hint_(std::move(hint)) {}
  const std::string& hint() const noexcept { return hint_; }

 private:
  std::string hint_;
};

}  // namespace zp
