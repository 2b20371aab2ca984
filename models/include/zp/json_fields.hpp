// zp/json_fields.hpp: strict reading of JSON inputs (HF configs, DeepSpeed configs, hardware
// files, plan files). Every read names the file and the field in its error; JSON null counts
// as absent. Not a schema language: each parser lists its own fields.
//
// Example usage:
//   nlohmann::json j = zp::parse_json_text(text, "hw.json");
//   zp::Fields f(j, "hw.json");
//   int64_t gpus = f.positive_int("gpus_per_node", 8);   // error if "8", -1 or 1.5
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace zp {

// Whole file as text; zp::Error naming the path when it cannot be read.
std::string read_text_file(const std::string& path);

// Parses JSON; a syntax error or truncation becomes zp::Error with origin, line and column.
nlohmann::json parse_json_text(std::string_view text, const std::string& origin);

// A JSON value as one line for an error message: invalid UTF-8 (a YAML file's bytes) replaced,
// never thrown; longer than `max` characters cut with "...".
std::string json_excerpt(const nlohmann::json& v, std::size_t max = 40);

class Fields {
 public:
  // obj: the JSON object being read; origin: file name for errors; prefix: the path of obj
  // inside the file ("zero_optimization.") so errors name the full field.
  Fields(const nlohmann::json& obj, std::string origin, std::string prefix = {});

  bool has(std::string_view key) const;  // present and not null
  std::string path(std::string_view key) const { return prefix_ + std::string(key); }

  int64_t positive_int(std::string_view key) const;                  // required, >= 1
  int64_t positive_int(std::string_view key, int64_t fallback) const;
  std::optional<int64_t> optional_positive_int(std::string_view key) const;
  int64_t nonneg_int(std::string_view key, int64_t fallback) const;   // >= 0
  uint64_t byte_count(std::string_view key, uint64_t fallback) const; // >= 0, may be 5e8
  double positive_number(std::string_view key) const;                 // > 0, finite
  double positive_number(std::string_view key, double fallback) const;
  double probability(std::string_view key, double fallback) const;    // in [0, 1]
  bool boolean(std::string_view key, bool fallback) const;
  std::string string(std::string_view key) const;
  std::string string(std::string_view key, std::string fallback) const;
  // An object member (error if present but not an object); nullptr when absent.
  const nlohmann::json* object(std::string_view key) const;

  [[noreturn]] void fail(std::string_view key, std::string_view expected) const;
  // zp::Error naming the first member not in `known` ("unknown field 'prefix.key'"), with
  // `hint` (empty: the known fields listed).
  void only(std::initializer_list<std::string_view> known, std::string_view hint = {}) const;
  // A number >= 0 and finite (a learning rate, a weight decay).
  double nonneg_number(std::string_view key, double fallback) const;

 private:
  const nlohmann::json& obj_;
  std::string origin_;
  std::string prefix_;
};

}  // namespace zp
