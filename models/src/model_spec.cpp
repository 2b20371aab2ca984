// model_spec.cpp: catalog name suggestions. The readers are in model_readers.cpp, the
// parameter inventory in param_inventory.cpp.
#include <algorithm>
#include <cctype>

#include "zp/models/model_spec.hpp"

namespace zp::models {

std::size_t edit_distance(std::string_view a, std::string_view b, bool ignore_case) {
  auto same = [&](char x, char y) {
    return ignore_case ? std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y))
                       : x == y;
  };
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (same(a[i - 1], b[j - 1]) ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::vector<std::string> closest_catalog_names(std::string_view name, std::size_t n) {
  std::vector<std::pair<std::size_t, std::string>> scored;
  name = name.substr(0, kSuggestChars);  // a longer name is no typo of one (and stays linear)
  for (const auto& e : catalog()) scored.emplace_back(edit_distance(name, e.name, true), e.name);
  std::stable_sort(scored.begin(), scored.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<std::string> out;
  for (std::size_t i = 0; i < scored.size() && i < n; ++i) out.push_back(scored[i].second);
  return out;
}

}  // namespace zp::models
