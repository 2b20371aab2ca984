// memory.cpp: names and JSON of the tier/category vocabulary.
#include "zp/planner/memory.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/checked.hpp"
#include "zp/error.hpp"
#include "zp/json_fields.hpp"

namespace zp::planner {

std::string_view to_string(Tier t) {
  switch (t) {
    case Tier::gpu: return "gpu";
    case Tier::cpu: return "cpu";
    case Tier::nvme: return "nvme";
  }
  return "?";
}

std::string_view to_string(Category c) {
  switch (c) {
    case Category::params: return "params";
    case Category::grads: return "grads";
    case Category::master: return "master";
    case Category::optimizer: return "optimizer";
    case Category::activations: return "activations";
    case Category::buffers: return "buffers";
    case Category::workspace: return "workspace";
    case Category::overhead: return "overhead";
  }
  return "?";
}

std::optional<Tier> tier_from_string(std::string_view s) {
  for (Tier t : kTiers)
    if (to_string(t) == s) return t;
  return std::nullopt;
}

std::optional<Category> category_from_string(std::string_view s) {
  for (Category c : kCategories)
    if (to_string(c) == s) return c;
  return std::nullopt;
}

uint64_t Breakdown::total() const {
  uint64_t sum = 0;
  for (uint64_t b : bytes) sum = checked_add(sum, b, "bytes per device");
  return sum;
}

uint64_t PerDevice::peak(Tier t) const {
  const uint64_t p = peaks[static_cast<std::size_t>(t)];
  return p != 0 ? p : (*this)[t].total();
}

nlohmann::json to_json(const PerDevice& d) {
  nlohmann::json out = nlohmann::json::object();
  for (Tier t : kTiers) {
    nlohmann::json bd = nlohmann::json::object();
    for (Category c : kCategories) bd[std::string(to_string(c))] = d[t][c];
    out[std::string(to_string(t))] = {{"total", d.peak(t)}, {"breakdown", bd}};
  }
  return out;
}

PerDevice per_device_from_json(const nlohmann::json& j, const std::string& origin) {
  if (!j.is_object()) throw Error(fmt::format("{}: per-device memory must be an object", origin));
  PerDevice d;
  for (Tier t : kTiers) {
    const std::string tn(to_string(t));
    Fields f(j, origin);
    const nlohmann::json* tier = f.object(tn);
    if (tier == nullptr) throw Error(fmt::format("{}: missing field '{}'", origin, tn));
    Fields tf(*tier, origin, tn + ".");
    const nlohmann::json* bd = tf.object("breakdown");
    if (bd == nullptr) throw Error(fmt::format("{}: missing field '{}.breakdown'", origin, tn));
    Fields bf(*bd, origin, tn + ".breakdown.");
    for (Category c : kCategories) d[t][c] = bf.byte_count(to_string(c), 0);
    const uint64_t total = tf.byte_count("total", d[t].total());
    if (total != d[t].total()) d.set_peak(t, total);
  }
  return d;
}

}  // namespace zp::planner
