// model_spec.cpp: catalog name suggestions. The readers are in model_readers.cpp, the
// parameter inventory in param_inventory.cpp.
#include <algorithm>
#include <array>
#include <cctype>

#include "zp/models/model_spec.hpp"

namespace zp::models {

#if defined(__clang__)
#define ZP_NO_COVERAGE __attribute__((no_sanitize("coverage")))
#else
#define ZP_NO_COVERAGE
#endif

namespace {

// The edit distance of a and b if it is at most `bound`, else bound + 1 (Ukkonen's cut-off):
// only the cells within `bound` of the table's diagonal can lie on a path of cost <= bound,
// and a row whose minimum is past the bound ends the computation (row minima never decrease).
// Under libFuzzer its comparisons are not traced for coverage (ZP_NO_COVERAGE): a table of
// integers guides no mutation, and tracing every cell made the Megatron fuzzer crawl.
ZP_NO_COVERAGE std::size_t distance_within(std::string_view a, std::string_view b, bool ignore_case,
                                           std::size_t bound) {
  auto same = [&](char x, char y) {
    return ignore_case ? std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y))
                       : x == y;
  };
  const std::size_t far = bound + 1;  // "more than bound"
  const std::size_t diff = a.size() > b.size() ? a.size() - b.size() : b.size() - a.size();
  if (diff > bound) return far;
  const std::size_t m = b.size();
  std::vector<std::size_t> prev(m + 2, far), cur(m + 2, far);
  for (std::size_t j = 0; j <= std::min(m, bound); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    const std::size_t lo = i > bound ? i - bound : 1, hi = std::min(m, i + bound);
    cur[lo - 1] = i <= bound ? i : far;  // column 0, or the cell left of the band
    std::size_t low = cur[lo - 1];
    for (std::size_t j = lo; j <= hi; ++j) {
      std::size_t v = std::min(prev[j], cur[j - 1]) + 1;
      v = std::min(v, prev[j - 1] + (same(a[i - 1], b[j - 1]) ? 0 : 1));
      cur[j] = std::min(v, far);
      low = std::min(low, cur[j]);
    }
    cur[hi + 1] = far;  // right of the band: read as the next row's prev
    if (low > bound) return far;
    std::swap(prev, cur);
  }
  return std::min(prev[m], far);
}

}  // namespace

std::size_t edit_distance(std::string_view a, std::string_view b, bool ignore_case) {
  return distance_within(a, b, ignore_case, std::max(a.size(), b.size()));
}

std::vector<std::string_view> closest_names(std::string_view name,
                                            const std::vector<std::string_view>& candidates,
                                            std::size_t n, bool ignore_case,
                                            std::size_t max_distance) {
  name = name.substr(0, kSuggestChars);  // a longer name is no typo of one (and stays linear)
  std::vector<std::pair<std::size_t, std::string_view>> best;  // sorted by distance, then order
  if (n == 0) return {};
  auto key = [&](char ch) {
    const auto u = static_cast<unsigned char>(ch);
    return ignore_case ? static_cast<unsigned char>(std::tolower(u)) : u;
  };
  std::array<int, 256> mine{};
  for (char ch : name) ++mine[key(ch)];
  for (std::string_view c : candidates) {
    // A candidate enters only below the n-th best distance: on a tie the earlier one stays.
    if (best.size() == n && best.back().first == 0) break;
    const std::size_t bound = std::min(
        max_distance, best.size() < n ? std::max(name.size(), c.size()) : best.back().first - 1);
    // The bag distance, a lower bound in O(length): each edit changes at most one character
    // count up and one down, so the larger of the surplus and the shortfall needs that many.
    std::size_t more = name.size(), fewer = 0;  // the name's characters c lacks, c's extra ones
    for (char ch : c) {
      int& k = mine[key(ch)];
      if (k > 0) --more;
      else ++fewer;
      --k;
    }
    for (char ch : c) ++mine[key(ch)];  // the name's counts again
    if (std::max(more, fewer) > bound) continue;
    const std::size_t d = distance_within(name, c, ignore_case, bound);
    if (d > bound) continue;
    auto at = std::upper_bound(best.begin(), best.end(), d,
                               [](std::size_t x, const auto& e) { return x < e.first; });
    best.insert(at, {d, c});
    if (best.size() > n) best.pop_back();
  }
  std::vector<std::string_view> out;
  for (const auto& [d, c] : best) out.push_back(c);
  return out;
}

std::vector<std::string> closest_catalog_names(std::string_view name, std::size_t n) {
  std::vector<std::string_view> names;
  for (const auto& e : catalog()) names.emplace_back(e.name);
  std::vector<std::string> out;
  for (std::string_view c : closest_names(name, names, n, true)) out.emplace_back(c);
  return out;
}

}  // namespace zp::models
