// zp/units.hpp: numbers with units for humans: bytes in binary units ("31.75 GiB"), counts
// with SI suffixes ("6.74 B"), and parsing sizes a user types ("80GiB", "5e8", "90%").
// Machine-readable output (JSON, CSV) always carries exact integers instead.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace zp {

// 0 B, 512 B, 1.50 KiB, 31.75 GiB, 2.00 TiB: three significant digits, binary units.
std::string format_bytes(uint64_t bytes);

// 124.4 M, 6.74 B, 1.00 T: parameter counts with decimal suffixes.
std::string format_count(uint64_t n);

// Parses "80GiB", "40 GB", "5e8", "1024" (bytes). `what` names the flag or field in errors.
uint64_t parse_bytes(std::string_view text, std::string_view what);

// Parses a positive integer count written as "8", "1e3" or "7.5e9" (integral value only).
uint64_t parse_count(std::string_view text, std::string_view what);

}  // namespace zp
