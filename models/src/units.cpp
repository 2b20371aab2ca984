// units.cpp: human formatting and parsing of sizes and counts.
#include "zp/units.hpp"

#include <cctype>
#include <charconv>
#include <cmath>

#include <fmt/format.h>

#include "zp/error.hpp"

namespace zp {

std::string format_bytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return fmt::format("{} B", bytes);
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  return fmt::format("{:.{}f} {}", v, v >= 100 ? 1 : 2, kUnits[u]);
}

std::string format_count(uint64_t n) {
  const double v = static_cast<double>(n);
  if (n < 1000) return fmt::format("{}", n);
  if (v < 1e6) return fmt::format("{:.1f} K", v / 1e3);
  if (v < 1e9) return fmt::format("{:.1f} M", v / 1e6);
  if (v < 1e12) return fmt::format("{:.2f} B", v / 1e9);
  return fmt::format("{:.2f} T", v / 1e12);
}

namespace {
std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// A finite non-negative number in plain or scientific notation, the whole string.
bool parse_number(std::string_view s, double& out) {
  if (s.empty()) return false;
  for (char c : s)
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == 'e' || c == 'E' ||
          c == '+' || c == '-'))
      return false;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && ptr == s.data() + s.size() && std::isfinite(out);
}
}  // namespace

uint64_t parse_count(std::string_view text, std::string_view what) {
  const std::string_view s = trim(text);
  // Integers parse exactly (doubles lose precision above 2^53).
  uint64_t exact = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), exact);
  if (ec == std::errc() && ptr == s.data() + s.size() && !s.empty()) {
    if (exact == 0)
      throw Error(fmt::format("{}: must be >= 1, got 0", what), "pass a positive whole number");
    return exact;
  }
  if (ec == std::errc::result_out_of_range)
    throw Error(fmt::format("{}: '{}' does not fit in 64 bits", what, s),
                "the largest count is about 1.8e19");
  double v = 0;
  if (!parse_number(s, v))
    throw Error(fmt::format("{}: '{}' is not a number", what, text),
                "pass a positive whole number, e.g. 8 or 7.5e9");
  if (v < 1) throw Error(fmt::format("{}: must be >= 1, got {}", what, s), "pass a positive whole number");
  if (v != std::floor(v))
    throw Error(fmt::format("{}: must be a whole number, got {}", what, s), "e.g. 8 or 7.5e9");
  if (v >= 18446744073709551616.0)
    throw Error(fmt::format("{}: '{}' does not fit in 64 bits", what, s),
                "the largest count is about 1.8e19");
  return static_cast<uint64_t>(v);
}

uint64_t parse_bytes(std::string_view text, std::string_view what) {
  std::string_view s = trim(text);
  struct Unit {
    std::string_view suffix;
    double scale;
  };
  static constexpr Unit kUnits[] = {{"KiB", 0x1p10}, {"MiB", 0x1p20}, {"GiB", 0x1p30},
                                    {"TiB", 0x1p40}, {"KB", 1e3},     {"MB", 1e6},
                                    {"GB", 1e9},     {"TB", 1e12},    {"B", 1}};
  double scale = 1;
  for (const Unit& u : kUnits) {
    if (s.size() > u.suffix.size() && s.ends_with(u.suffix)) {
      scale = u.scale;
      s = trim(s.substr(0, s.size() - u.suffix.size()));
      break;
    }
  }
  double v = 0;
  if (!parse_number(s, v) || v < 0)
    throw Error(fmt::format("{}: '{}' is not a size", what, text),
                "write bytes as 85899345920, 5e8, 80GiB or 40GB");
  const double bytes = std::floor(v * scale + 0.5);
  if (bytes >= 18446744073709551616.0)
    throw Error(fmt::format("{}: '{}' does not fit in 64 bits", what, text));
  return static_cast<uint64_t>(bytes);
}

}  // namespace zp
