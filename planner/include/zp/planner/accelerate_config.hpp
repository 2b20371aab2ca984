// zp/planner/accelerate_config.hpp: Hugging Face accelerate's config file (what `accelerate
// config` writes, YAML, or the same keys as JSON) for a PyTorch FSDP run, read into a
// Strategy for the fsdp profile, as apply_deepspeed_config reads a DeepSpeed config.
//
// Example usage:
//   std::vector<std::string> assumed;
//   Strategy s = apply_accelerate_config(Strategy{}, read_text_file("fsdp.yaml"), "fsdp.yaml",
//                                        &assumed);
//   // s.stage == 3, s.dp == num_processes, s.precision from mixed_precision, ...
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "zp/planner/strategy.hpp"

namespace zp::planner {

// YAML text (a JSON text is YAML too) as JSON: mappings become objects, sequences arrays;
// plain scalars become booleans (true/false in any case, as PyYAML reads them), null (null,
// ~, empty), integers and numbers where they parse as such, and strings otherwise; quoted
// scalars stay strings ('no' is a string). A syntax error is zp::Error with the origin, line
// and column.
nlohmann::json parse_yaml_text(std::string_view text, const std::string& origin);

// The accelerate config's fields for an FSDP run (accelerate/commands/config/config_args.py
// and launch.py; planner/notes/fsdp-and-optimizers-memory.md sec. 3):
//   distributed_type: FSDP (DEEPSPEED, MULTI_GPU and NO are refused with the flags to use);
//   num_processes: the data-parallel degree (all processes of all machines);
//   mixed_precision: no (fp32), fp16 or bf16; fp8 is refused (not modelled). accelerate sets
//     the policy's reduce dtype to the same 16-bit type and upcasts the trainable parameters
//     to fp32 before sharding (fsdp_utils.py fsdp2_prepare_model; accelerator.py for FSDP1):
//     fp32 master shards, 16-bit reduce-scatter;
//   fsdp_config.fsdp_version 1 or 2 (Strategy::fsdp_version; absent: 1, accelerate's
//     default); fsdp_use_orig_params (FSDP1; absent: true, accelerate launch's default);
//     fsdp_reshard_after_forward (FSDP2: a boolean; FSDP1: a sharding strategy name),
//     fsdp_sharding_strategy (FSDP1: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD,
//     HYBRID_SHARD_ZERO2, or their numbers 1-5): FULL_SHARD is stage 3 resharding after
//     forward, SHARD_GRAD_OP stage 3 without, HYBRID_SHARD and HYBRID_SHARD_ZERO2 the same
//     sharded over a node's GPUs (Strategy::fsdp_shard_size kFsdpShardNode), NO_SHARD is
//     refused (plain data parallel); fsdp_offload_params true: --offload-param cpu (FSDP's
//     CPU offload of parameters, gradients and the optimizer step);
//     fsdp_activation_checkpointing: checkpointing full (per decoder layer);
//   parallelism_config (FSDP2 only, as accelerate): parallelism_config_dp_replicate_size R
//     and parallelism_config_dp_shard_size S with R x S = num_processes; R > 1 is HSDP over
//     shard groups of S ranks; tp, cp and sp sizes above 1 are refused (not modelled here).
// The other documented keys (wrapping policy, prefetch, state dict type, loading, TPU and
// launcher settings) do not move memory in the plan and are accepted; an unknown key is an
// error naming it. Each default taken adds a line to `assumed` when given.
Strategy apply_accelerate_config(Strategy base, std::string_view text, const std::string& origin,
                                 std::vector<std::string>* assumed = nullptr);

}  // namespace zp::planner
