// zp/planner/hardware.hpp: the machine a plan targets: one GPU's node type (memory of the GPU,
// the host and the NVMe drives, GPUs per node), from a preset name or a JSON file. Counting
// GPUs and nodes is the strategy's job (--gpus, --nodes), not this file's.
//
// Example usage:
//   zp::planner::Hardware hw = zp::planner::load_hardware("a100-80g");   // or "hw.json"
//   bool gpu_fits = predicted_gpu_peak <= hw.gpu_memory_bytes;
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace zp::planner {

struct Hardware {
  std::string name;
  std::string description;
  uint64_t gpu_memory_bytes = 0;   // one GPU, as nvidia-smi reports memory.total
  int64_t gpus_per_node = 0;
  uint64_t host_memory_bytes = 0;  // one node, shared by its GPUs' ranks
  uint64_t nvme_bytes = 0;         // one node
  std::map<std::string, std::string> sources;  // field -> where its value comes from
};

std::vector<std::string> hardware_preset_names();
Hardware parse_hardware(const nlohmann::json& j, const std::string& origin);
// A preset name or the path of a hardware JSON file.
Hardware load_hardware(const std::string& name_or_path);
nlohmann::json to_json(const Hardware& hw);

}  // namespace zp::planner
