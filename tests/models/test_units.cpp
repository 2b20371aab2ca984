// Parsing and formatting of sizes and counts.
#include <doctest/doctest.h>

#include "zp/error.hpp"
#include "zp/units.hpp"

TEST_CASE("parse_count accepts whole numbers in plain and scientific notation") {
  CHECK(zp::parse_count("8", "--dp") == 8);
  CHECK(zp::parse_count("7.5e9", "--params") == 7'500'000'000ULL);
  CHECK(zp::parse_count("1e12", "--params") == 1'000'000'000'000ULL);
  CHECK(zp::parse_count("18446744073709551615", "--x") == 18446744073709551615ULL);
  CHECK_THROWS_AS(zp::parse_count("0", "--dp"), zp::Error);
  CHECK_THROWS_AS(zp::parse_count("-1", "--dp"), zp::Error);
  CHECK_THROWS_AS(zp::parse_count("2.5", "--dp"), zp::Error);
  CHECK_THROWS_AS(zp::parse_count("eight", "--dp"), zp::Error);
  CHECK_THROWS_AS(zp::parse_count("", "--dp"), zp::Error);
  CHECK_THROWS_AS(zp::parse_count("18446744073709551616", "--x"), zp::Error);
  CHECK_THROWS_AS(zp::parse_count("1e20", "--x"), zp::Error);
  try {
    zp::parse_count("2.5", "--dp");
  } catch (const zp::Error& e) {
    CHECK(std::string(e.what()) == "--dp: must be a whole number, got 2.5");
  }
}

TEST_CASE("parse_bytes takes units") {
  CHECK(zp::parse_bytes("80GiB", "--x") == 80ULL << 30);
  CHECK(zp::parse_bytes("40 GB", "--x") == 40'000'000'000ULL);
  CHECK(zp::parse_bytes("5e8", "--x") == 500'000'000ULL);
  CHECK(zp::parse_bytes("1.5KiB", "--x") == 1536);
  CHECK_THROWS_AS(zp::parse_bytes("80 GiBs", "--x"), zp::Error);
  CHECK_THROWS_AS(zp::parse_bytes("-1", "--x"), zp::Error);
}

TEST_CASE("format_bytes uses binary units with 3-4 significant digits") {
  CHECK(zp::format_bytes(0) == "0 B");
  CHECK(zp::format_bytes(1023) == "1023 B");
  CHECK(zp::format_bytes(1536) == "1.50 KiB");
  CHECK(zp::format_bytes(80ULL << 30) == "80.00 GiB");
  CHECK(zp::format_bytes(237ULL << 20) == "237.0 MiB");
  CHECK(zp::format_count(124'439'808) == "124.4 M");
  CHECK(zp::format_count(6'738'415'616) == "6.74 B");
}
