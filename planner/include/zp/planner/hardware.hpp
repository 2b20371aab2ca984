// zp/planner/hardware.hpp: the machine a plan targets: one GPU's node type (memory of the GPU,
// the host and the NVMe drives, GPUs per node, and the speeds the step-time simulator needs),
// from a preset name or a JSON file. Counting GPUs and nodes is the strategy's job (--gpus,
// --nodes), not this file's; every value's source is kept in `sources`.
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
  // Speeds (decimal units: 1 GB/s = 1e9 bytes/s, 1 TFLOP/s = 1e12 FLOP/s). Every field is
  // required in a hardware file and must be > 0.
  double gpu_tflops = 0;           // achievable dense 16-bit matmul throughput, one GPU
  double hbm_gbps = 0;             // GPU memory bandwidth, one GPU
  double h2d_gbps = 0;             // host -> device, one GPU (its PCIe link), achievable
  double d2h_gbps = 0;             // device -> host, one GPU
  double nvlink_gbps = 0;          // intra-node collective bus bandwidth per GPU, one direction
  double internode_gbps = 0;       // network bandwidth per node (all its NICs), one direction
  double cpu_adam_gparams = 0;     // CPU Adam: 1e9 parameters updated per second, whole node
  double nvme_read_gbps = 0;       // all drives of one node together
  double nvme_write_gbps = 0;
  std::map<std::string, std::string> sources;  // field -> where its value comes from
};

std::vector<std::string> hardware_preset_names();
Hardware parse_hardware(const nlohmann::json& j, const std::string& origin);
// A preset name or the path of a hardware JSON file.
Hardware load_hardware(const std::string& name_or_path);
nlohmann::json to_json(const Hardware& hw);

}  // namespace zp::planner
