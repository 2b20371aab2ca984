// io_check.cpp: the error ZP_IO_CHECK throws. Formatting only; the macro does the checking.
#include "zp/runtime/io_check.hpp"

#include <string>
#include <system_error>

#include <fmt/format.h>

namespace zp::runtime::detail {

void throw_io_error(int code, std::string_view what, std::string_view hint, const char* call,
                    const char* file, int line) {
  std::string_view base(file);
  if (const auto slash = base.rfind('/'); slash != std::string_view::npos)
    base.remove_prefix(slash + 1);
  throw IoError(fmt::format("{}: {} [{} at {}:{}]", what, std::generic_category().message(code),
                            call, base, line),
                std::string(hint), code);
}

}  // namespace zp::runtime::detail
