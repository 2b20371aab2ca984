// zp/planner/memory.hpp: the memory vocabulary shared by planner, runtime and reports: tiers,
// categories, and per-device byte counts. Counting only; no allocation happens here.
//
// Example usage:
//   zp::planner::PerDevice d;
//   d[Tier::gpu][Category::params] = 2 * n_params;
//   uint64_t gpu_total = d[Tier::gpu].total();
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace zp::planner {

enum class Tier { gpu, cpu, nvme };
inline constexpr std::array kTiers = {Tier::gpu, Tier::cpu, Tier::nvme};

enum class Category { params, grads, master, optimizer, activations, buffers, workspace, overhead };
inline constexpr std::array kCategories = {
    Category::params,      Category::grads,   Category::master,    Category::optimizer,
    Category::activations, Category::buffers, Category::workspace, Category::overhead};

std::string_view to_string(Tier t);
std::string_view to_string(Category c);
std::optional<Tier> tier_from_string(std::string_view s);
std::optional<Category> category_from_string(std::string_view s);

// Bytes per category on one tier of one device (rank).
struct Breakdown {
  std::array<uint64_t, kCategories.size()> bytes{};

  uint64_t& operator[](Category c) { return bytes[static_cast<std::size_t>(c)]; }
  uint64_t operator[](Category c) const { return bytes[static_cast<std::size_t>(c)]; }
  uint64_t total() const;  // sum over categories, overflow-checked
  bool operator==(const Breakdown&) const = default;
};

// Everything one device (rank) holds, per tier. `peak` is the predicted or measured peak of
// the tier: the high-water mark of the sum over a step. It can be less than the sum of the
// per-category peaks, because categories peak at different moments.
struct PerDevice {
  std::array<Breakdown, kTiers.size()> tiers{};
  std::array<uint64_t, kTiers.size()> peaks{};  // 0 means "sum of the breakdown"

  Breakdown& operator[](Tier t) { return tiers[static_cast<std::size_t>(t)]; }
  const Breakdown& operator[](Tier t) const { return tiers[static_cast<std::size_t>(t)]; }
  uint64_t peak(Tier t) const;  // the recorded peak, or the breakdown's total when none is
  void set_peak(Tier t, uint64_t b) { peaks[static_cast<std::size_t>(t)] = b; }
  bool operator==(const PerDevice&) const = default;
};

// JSON shape of DESIGN.md: {"gpu":{"total":B,"breakdown":{"params":B,...}},"cpu":...,"nvme":...}
nlohmann::json to_json(const PerDevice& d);
PerDevice per_device_from_json(const nlohmann::json& j, const std::string& origin);

}  // namespace zp::planner
