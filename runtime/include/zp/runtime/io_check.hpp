// zp/runtime/io_check.hpp: the one check macro for the runtime's I/O calls (syscalls and
// liburing), and the error it throws: the failing call stringified, file:line, errno.
// Not for asynchronous completions, which carry no call: the swapper words those itself.
#pragma once

#include <cerrno>
#include <string>
#include <string_view>
#include <utility>

#include "zp/error.hpp"

namespace zp::runtime {

// A failed I/O operation. what(): "<operation> <file>...: <strerror> [<call> at <file>:<line>]";
// code(): the errno value, or 0 where nothing failed but the transfer came up short.
class IoError : public zp::Error {
 public:
  IoError(std::string message, std::string hint, int code)
      : zp::Error(std::move(message), std::move(hint)), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

namespace detail {

// Syscalls return -1 and set errno; liburing returns -errno and leaves errno alone (its
// syscalls are raw). errno is cleared before the call, so a -1 with errno still 0 is -EPERM.
inline int io_error_code(long long result, int saved_errno) {
  return (result == -1 && saved_errno != 0) ? saved_errno : static_cast<int>(-result);
}

[[noreturn]] void throw_io_error(int code, std::string_view what, std::string_view hint,
                                 const char* call, const char* file, int line);

}  // namespace detail
}  // namespace zp::runtime

// ZP_IO_CHECK(call, what, hint): evaluates `call`, a syscall (-1 and errno on failure) or a
// liburing function (-errno on failure), and yields its result. On failure throws IoError
// "<what>: <strerror> [<call> at <file>:<line>]" with `hint`. `what` and `hint` are evaluated
// only on failure, with errno set to the failure's code, so a hint may depend on errno:
//   const int fd = ZP_IO_CHECK(::open(p, O_RDONLY), fmt::format("open {}", p), open_hint(errno));
#define ZP_IO_CHECK(call, what, hint)                                                            \
  [&]() {                                                                                        \
    errno = 0;                                                                                   \
    const auto zp_io_result = (call);                                                            \
    if (zp_io_result < 0) {                                                                      \
      const int zp_io_code = ::zp::runtime::detail::io_error_code(zp_io_result, errno);          \
      errno = zp_io_code;                                                                        \
      const std::string zp_io_hint = (hint);                                                     \
      errno = zp_io_code;                                                                        \
      const std::string zp_io_what = (what);                                                     \
      ::zp::runtime::detail::throw_io_error(zp_io_code, zp_io_what, zp_io_hint, #call, __FILE__, \
                                            __LINE__);                                           \
    }                                                                                            \
    return zp_io_result;                                                                         \
  }()
