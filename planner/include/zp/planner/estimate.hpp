// zp/planner/estimate.hpp: the per-device memory estimate for one model and strategy (what
// `zero-plan estimate` prints), and whether it fits a given machine. Not the search over
// strategies (fit.hpp) and not the step-time simulation.
//
// Example usage:
//   auto m = zp::models::load_model("gpt2-xl");
//   zp::planner::Strategy s; s.stage = 2; s.dp = 8;
//   auto hw = zp::planner::load_hardware("v100-32g");
//   zp::planner::Estimate e = zp::planner::estimate(m, s, &hw);
//   if (e.fits == false) for (auto& why : e.shortfalls) fmt::print("{}\n", why);
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "zp/models/model_spec.hpp"
#include "zp/planner/hardware.hpp"
#include "zp/planner/memory.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/strategy.hpp"

namespace zp::planner {

// Pipeline parallelism: one stage's ranks (each of its tp x cp x dp ranks holds the same).
struct PipelineStage {
  int64_t stage = 0;
  // Its model chunks' blocks, [first, end) each (one chunk without interleaving).
  std::vector<std::pair<int64_t, int64_t>> blocks;
  int64_t in_flight = 1;  // (micro-batch, chunk) pairs whose activations it holds at once
  uint64_t n_params = 0;                   // parameters per rank
  uint64_t in_flight_bytes = 0;            // the other micro-batches' saved activations
  PerDevice per_device;
};

struct Estimate {
  models::ModelSpec model;
  models::ParamInventory params;
  Strategy strategy;                  // with seq resolved to a length
  PlanOptions options;
  PerDevice per_device;               // one rank: high-water per category, peak per tier
  ActivationSummary activations;
  MemoryReport memory;                // peaks, allocated vs reserved, the timeline
  MemorySchedule schedule;
  std::optional<Hardware> hardware;
  std::optional<bool> fits;           // unknown without hardware
  std::vector<std::string> shortfalls;  // "gpu: needs 45.2 GiB, has 31.75 GiB"
  // Every default the plan took rather than the user: "--seq 4096 (...)", a DeepSpeed
  // config's "auto" values; the CLI adds the flags left out. Shown in the headline.
  std::vector<std::string> assumed;
  // Pipeline parallelism (strategy.pp > 1): every stage, and which one the fields above
  // describe: the most loaded (the largest gpu peak; the first of equals).
  std::vector<PipelineStage> stages;
  int64_t stage = 0;
  // A training checkpoint's cost (strategy.save_checkpoint; zero-plan --checkpoint).
  std::optional<CheckpointCost> checkpoint;
};

// Resolves defaults that depend on the model (seq 0 -> min(the model's context,
// kDefaultSeq); "auto" bucket sizes 0 -> the Hugging Face Trainer's h*h and 0.9*h*h) and
// checks the strategy against the model (seq within the model's positions). Each default it
// takes adds a line to `assumed` when given.
Strategy resolve_for_model(Strategy s, const models::ModelSpec& m,
                           std::vector<std::string>* assumed = nullptr);

// Settles what depends on the machine: hybrid sharding over "a node" (Strategy::
// fsdp_shard_size kFsdpShardNode) takes min(the hardware's GPUs per node, dp) ranks. Without
// hardware the strategy is returned as it is (check_profile refuses an unsettled node).
Strategy resolve_for_hardware(Strategy s, const Hardware* hw,
                              std::vector<std::string>* assumed = nullptr);

// What a profile cannot plan, as zp::Error naming the flag: the fsdp profile plans stage 3
// (FULL_SHARD; SHARD_GRAD_OP with reshard_after_forward false; hybrid sharding; CPU offload
// of the parameters, which takes their gradients and the optimizer step along, never the
// optimizer alone, never NVMe); FSDP's settings under another profile; the pytorch profile
// stage 0, in fp32, a 16-bit model, or autocast on fp32 weights (not for the model families
// whose casts the graph does not follow, when `m` is given).
void check_profile(const Strategy& s, const PlanOptions& o, const models::ModelSpec* m = nullptr);

// Builds the training graph, the step's memory schedule, and replays it through the
// allocator model of the profile.
Estimate estimate(const models::ModelSpec& m, Strategy s, const Hardware* hw,
                  const PlanOptions& o = {}, std::vector<std::string> assumed = {});

// Checks a per-device prediction against a machine: the gpu tier against one GPU, the cpu
// and nvme tiers times the ranks on a node against the node's memory and drives.
std::vector<std::string> shortfalls(const PerDevice& d, const Strategy& s, const Hardware& hw);

// {"schema":"zero-plan/estimate/v1","model":{...},"strategy":{...},"per_device":{...},
//  "fits":true|false|null, ...} (DESIGN.md).
nlohmann::json to_json(const Estimate& e);
nlohmann::json model_json(const models::ModelSpec& m, const models::ParamInventory& inv);

}  // namespace zp::planner
