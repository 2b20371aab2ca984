// hardware.cpp: hardware presets (embedded from planner/hardware/*.json) and the JSON format.
#include "zp/planner/hardware.hpp"

#include <filesystem>
#include <set>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/json_fields.hpp"

namespace zp::planner {
namespace {

struct EmbeddedPreset {
  std::string_view name;
  std::string_view text;
};

constexpr EmbeddedPreset kPresets[] = {
#include "hardware_presets.inc"
};

}  // namespace

std::vector<std::string> hardware_preset_names() {
  std::vector<std::string> out;
  for (const auto& p : kPresets) out.emplace_back(p.name);
  return out;
}

Hardware parse_hardware(const nlohmann::json& j, const std::string& origin) {
  if (!j.is_object()) throw Error(fmt::format("{}: a hardware file must be a JSON object", origin));
  static const std::set<std::string_view> known = {
      "name", "description", "gpu_memory_bytes", "gpus_per_node", "host_memory_bytes",
      "nvme_bytes", "gpu_tflops", "hbm_gbps", "h2d_gbps", "d2h_gbps", "nvlink_gbps",
      "internode_gbps", "cpu_adam_gparams", "nvme_read_gbps", "nvme_write_gbps", "sources"};
  for (const auto& [key, value] : j.items())
    if (!known.contains(key))
      throw Error(fmt::format("{}: unknown field '{}'", origin, key),
                  fmt::format("hardware fields: {}", fmt::join(known, ", ")));
  Fields f(j, origin);
  Hardware hw;
  hw.name = f.string("name", origin);
  hw.description = f.string("description", "");
  hw.gpu_memory_bytes = static_cast<uint64_t>(f.positive_int("gpu_memory_bytes"));
  hw.gpus_per_node = f.positive_int("gpus_per_node");
  hw.host_memory_bytes = static_cast<uint64_t>(f.positive_int("host_memory_bytes"));
  hw.nvme_bytes = f.byte_count("nvme_bytes", 0);
  // Speeds: required and > 0 (a missing or negative one is an error naming it).
  hw.gpu_tflops = f.positive_number("gpu_tflops");
  hw.hbm_gbps = f.positive_number("hbm_gbps");
  hw.h2d_gbps = f.positive_number("h2d_gbps");
  hw.d2h_gbps = f.positive_number("d2h_gbps");
  hw.nvlink_gbps = f.positive_number("nvlink_gbps");
  hw.internode_gbps = f.positive_number("internode_gbps");
  hw.cpu_adam_gparams = f.positive_number("cpu_adam_gparams");
  hw.nvme_read_gbps = f.positive_number("nvme_read_gbps");
  hw.nvme_write_gbps = f.positive_number("nvme_write_gbps");
  if (const nlohmann::json* s = f.object("sources")) {
    for (const auto& [key, value] : s->items()) {
      if (!value.is_string())
        throw Error(fmt::format("{}: field 'sources.{}' must be a string", origin, key));
      hw.sources[key] = value.get<std::string>();
    }
  }
  return hw;
}

Hardware load_hardware(const std::string& name_or_path) {
  for (const auto& p : kPresets)
    if (p.name == name_or_path) return parse_hardware(parse_json_text(p.text, std::string(p.name)), std::string(p.name));
  std::error_code ec;
  if (std::filesystem::is_regular_file(name_or_path, ec))
    return parse_hardware(parse_json_text(read_text_file(name_or_path), name_or_path),
                          name_or_path);
  throw Error(fmt::format("--hardware: unknown hardware '{}'", name_or_path),
              fmt::format("presets: {}; or pass the path of a hardware JSON file",
                          fmt::join(hardware_preset_names(), ", ")));
}

nlohmann::json to_json(const Hardware& hw) {
  return {{"name", hw.name},
          {"description", hw.description},
          {"gpu_memory_bytes", hw.gpu_memory_bytes},
          {"gpus_per_node", hw.gpus_per_node},
          {"host_memory_bytes", hw.host_memory_bytes},
          {"nvme_bytes", hw.nvme_bytes},
          {"gpu_tflops", hw.gpu_tflops},
          {"hbm_gbps", hw.hbm_gbps},
          {"h2d_gbps", hw.h2d_gbps},
          {"d2h_gbps", hw.d2h_gbps},
          {"nvlink_gbps", hw.nvlink_gbps},
          {"internode_gbps", hw.internode_gbps},
          {"cpu_adam_gparams", hw.cpu_adam_gparams},
          {"nvme_read_gbps", hw.nvme_read_gbps},
          {"nvme_write_gbps", hw.nvme_write_gbps},
          {"sources", hw.sources}};
}

}  // namespace zp::planner
