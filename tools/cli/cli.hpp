// cli.hpp: what zero-plan and zero-run share on the command line: the strategy flags (one
// parser for both tools), --format, and the error convention (exit 2 with "error:" and
// "hint:" lines). Thin by design: parsing and printing only, no planning.
#pragma once

#include <functional>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/strategy.hpp"
#include "zp/reports/table.hpp"

namespace zp::cli {

// Exit codes of DESIGN.md.
inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;
inline constexpr int kExitBadInput = 2;

// The strategy flags as typed; resolve() turns them into a validated Strategy. Values are
// read as strings so every bad value gets the same "--flag: ..." error.
struct StrategyFlags {
  std::string stage, dp, mp, micro_batch, seq, grad_accum, precision, optimizer, checkpointing,
      offload_optimizer, offload_param, ds_config, fsdp_config;
  std::string ep, moe_routing, moe_capacity_factor, target_seq, attention;
  std::string pp, vp, cp, cp_kind, pp_schedule, grad_precision;
  bool sp = false;
  std::string megatron_args;  // a Megatron-LM argument list (planner/megatron_args.hpp)
  int64_t n_layer = 0;        // the model's layers, set by load_model (Megatron flags count them)
  std::string master_weights, optimizer_states, reduce_dtype, optimizer_impl, fsdp_version,
      fsdp_shard_size;
  bool reshard_after_forward = true, fused_optimizer = false, fsdp_use_orig_params = false;
  std::string reduce_bucket_size, allgather_bucket_size, prefetch_bucket_size, max_live_parameters;
  std::string optimizer_swap_chunk_size, optimizer_swap_buffer_count, offload_tile_size;
  std::string param_swap_buffer_count, param_swap_buffer_size, param_swap_prefetch_depth;
  std::string sub_group_size, param_persistence_threshold, hpz_partition_size, deepspeed_version;
  std::string torch_version;
  std::string offload_optimizer_ratio;
  bool flash_attention = false, dpu = false, checkpoint = false, partition_activations = false, cpu_checkpointing = false;
  bool contiguous_memory_optimization = false;
  std::string number_checkpoints;
  bool overlap_comm = false;  // read only when --overlap-comm or --no-overlap-comm is given
  bool contiguous_gradients = true;  // likewise, --[no-]contiguous-gradients
  bool zero_init = true;             // likewise, --[no-]zero-init
  bool quantized_weights = false;
  std::string load_on_gpu;
  CLI::App* app = nullptr;  // to ask which flags were given

  // Defaults, then the DeepSpeed config (--ds-config), then the Megatron arguments
  // (--megatron-args; their global batch once dp is settled), then explicit flags. The profile
  // decides the attention left unsaid: eager (zero-run's kernels) for zeroplan, SDPA
  // (transformers' default, no T x T tensor kept) for deepspeed. With `assumed`, one line per
  // default taken (a flag left out and not in the DeepSpeed config, the config's "auto"s).
  planner::Strategy resolve(const planner::PlanOptions& o = {},
                            std::vector<std::string>* assumed = nullptr) const;
  // The same where the data-parallel degree defaults to gpus / (tp pp cp) (zero-plan fit, which
  // derives dp from --gpus) instead of 1, so --ep is checked against that dp.
  planner::Strategy resolve_for_gpus(int64_t gpus, const planner::PlanOptions& o = {},
                                     std::vector<std::string>* assumed = nullptr) const;
  bool given(const std::string& flag) const;

  // Inputs held in memory instead of files (the Python module's dicts): a DeepSpeed config in
  // place of --ds-config, a model config's JSON text in place of --model; `*_origin` names
  // them in errors.
  nlohmann::json ds_config_json;
  std::string ds_config_origin, model_json, model_json_origin;
  bool has_ds_config() const { return !ds_config.empty() || !ds_config_json.is_null(); }
};

void add_strategy_flags(CLI::App& app, StrategyFlags& flags);

// The model of --model (or of flags.model_json), or without it the one --megatron-args' size
// flags describe (with both, the flags must agree with the model); records its layer count in
// flags.n_layer.
models::ModelSpec load_model(const std::string& model, StrategyFlags& flags);

// --profile zeroplan|deepspeed and --device cpu|cuda: whose allocations are predicted.
struct TargetFlags {
  std::string profile, device, model_code;  // profile empty: zeroplan, or fsdp with --fsdp-config
  // `strategy`: the same command's strategy flags, whose --fsdp-config implies --profile fsdp.
  planner::PlanOptions resolve(planner::Backend default_backend,
                               const StrategyFlags* strategy = nullptr) const;
};
void add_target_flags(CLI::App& app, TargetFlags& flags, std::string_view default_device);

// --format text|markdown|json|csv on `app`, into `into` (default text).
void add_format_flag(CLI::App& app, std::string& into);
reports::Format parse_format(const std::string& s);

// "error: <where><what>" and, when the error has one, "hint: ..." on stderr, flushed; `where`
// is "" or a prefix such as "rank 3: ".
void say_error(const Error& e, const std::string& where = "");

// Runs `body` after parsing; turns zp::Error and CLI11 parse errors into exit code 2 with
// "error: ..." and "hint: ..." on stderr, and --help into exit 0.
int run(CLI::App& app, int argc, char** argv, const std::function<int()>& body);

// Writes to a file atomically, or to stdout when path is empty or "-".
void emit(const std::string& path, const std::string& content);

}  // namespace zp::cli
