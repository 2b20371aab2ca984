// json_fields.cpp: strict JSON field reading with errors that name the file and field.
#include "zp/json_fields.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "zp/error.hpp"

namespace zp {

using nlohmann::json;

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw Error(fmt::format("cannot read '{}': no such file or not readable", path),
                "check the path");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error(fmt::format("cannot read '{}': I/O error", path));
  return ss.str();
}

json parse_json_text(std::string_view text, const std::string& origin) {
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    // A syntax error (parse_error) or a number beyond double's range (out_of_range 406,
    // "1e999"). e.what() reads "[json.exception.parse_error.101] parse error at line 3,
    // column 1: ..."; keep the part after the bracketed id.
    std::string what = e.what();
    if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    throw Error(fmt::format("{}: invalid JSON: {}", origin, what),
                "the file is malformed or truncated; check it with a JSON validator");
  }
}

std::string json_excerpt(const json& v, std::size_t max) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > max && max >= 3) s = s.substr(0, max - 3) + "...";
  return s;
}

Fields::Fields(const json& obj, std::string origin, std::string prefix)
    : obj_(obj), origin_(std::move(origin)), prefix_(std::move(prefix)) {}

bool Fields::has(std::string_view key) const {
  auto it = obj_.find(key);
  return it != obj_.end() && !it->is_null();
}

void Fields::fail(std::string_view key, std::string_view expected) const {
  const std::string got = has(key) ? json_excerpt(obj_.at(std::string(key))) : std::string("nothing");
  throw Error(fmt::format("{}: field '{}' must be {}, got {}", origin_, path(key), expected, got),
              fmt::format("fix '{}' in {}", path(key), origin_));
}

void Fields::only(std::initializer_list<std::string_view> known, std::string_view hint) const {
  for (const auto& [key, value] : obj_.items()) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string listed;
    for (std::string_view k : known) listed += (listed.empty() ? "" : ", ") + std::string(k);
    throw Error(fmt::format("{}: unknown field '{}'", origin_, path(key)),
                hint.empty() ? fmt::format("the fields of {}{} are: {}", origin_,
                                           prefix_.empty() ? "" : " " + prefix_, listed)
                             : std::string(hint));
  }
}

double Fields::nonneg_number(std::string_view key, double fallback) const {
  if (!has(key)) return fallback;
  const json& v = obj_.at(std::string(key));
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0)
    fail(key, "a number >= 0");
  return v.get<double>();
}

namespace {
// An integer, or a float with an integral value that fits (JSON writers emit 5e8 for sizes).
std::optional<int64_t> as_integer(const json& v) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) return std::nullopt;
    return v.get<int64_t>();
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.2e18)
      return static_cast<int64_t>(d);
  }
  return std::nullopt;
}
}  // namespace

std::optional<int64_t> Fields::optional_positive_int(std::string_view key) const {
  if (!has(key)) return std::nullopt;
  auto v = as_integer(obj_.at(std::string(key)));
  if (!v || *v < 1) fail(key, "a positive integer");
  return v;
}

int64_t Fields::positive_int(std::string_view key) const {
  if (!has(key))
    throw Error(fmt::format("{}: missing field '{}'", origin_, path(key)),
                "the field is required");
  return *optional_positive_int(key);
}

int64_t Fields::positive_int(std::string_view key, int64_t fallback) const {
  return optional_positive_int(key).value_or(fallback);
}

int64_t Fields::nonneg_int(std::string_view key, int64_t fallback) const {
  if (!has(key)) return fallback;
  auto v = as_integer(obj_.at(std::string(key)));
  if (!v || *v < 0) fail(key, "a non-negative integer");
  return *v;
}

uint64_t Fields::byte_count(std::string_view key, uint64_t fallback) const {
  return static_cast<uint64_t>(nonneg_int(key, static_cast<int64_t>(fallback)));
}

double Fields::positive_number(std::string_view key) const {
  if (!has(key))
    throw Error(fmt::format("{}: missing field '{}'", origin_, path(key)),
                "the field is required");
  return positive_number(key, 0.0);
}

double Fields::positive_number(std::string_view key, double fallback) const {
  if (!has(key)) return fallback;
  const json& v = obj_.at(std::string(key));
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() <= 0)
    fail(key, "a positive number");
  return v.get<double>();
}

double Fields::probability(std::string_view key, double fallback) const {
  if (!has(key)) return fallback;
  const json& v = obj_.at(std::string(key));
  if (!v.is_number() || !(v.get<double>() >= 0.0 && v.get<double>() <= 1.0))
    fail(key, "a number between 0 and 1");
  return v.get<double>();
}

bool Fields::boolean(std::string_view key, bool fallback) const {
  if (!has(key)) return fallback;
  const json& v = obj_.at(std::string(key));
  if (!v.is_boolean()) fail(key, "true or false");
  return v.get<bool>();
}

std::string Fields::string(std::string_view key) const {
  if (!has(key))
    throw Error(fmt::format("{}: missing field '{}'", origin_, path(key)),
                "the field is required");
  return string(key, {});
}

std::string Fields::string(std::string_view key, std::string fallback) const {
  if (!has(key)) return fallback;
  const json& v = obj_.at(std::string(key));
  if (!v.is_string()) fail(key, "a string");
  return v.get<std::string>();
}

const json* Fields::object(std::string_view key) const {
  if (!has(key)) return nullptr;
  const json& v = obj_.at(std::string(key));
  if (!v.is_object()) fail(key, "an object");
  return &v;
}

}  // namespace zp
