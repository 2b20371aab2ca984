// accelerate_config.cpp: accelerate's config file (YAML or JSON) for FSDP runs, into a Strategy.
#include "zp/planner/accelerate_config.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "zp/error.hpp"
#include "zp/json_fields.hpp"

namespace zp::planner {

using nlohmann::json;

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

json scalar(const YAML::Node& n) {
  const std::string v = n.Scalar();
  if (n.Tag() == "!") return v;  // quoted: a string whatever it spells
  const std::string l = lower(v);
  if (l == "true") return true;
  if (l == "false") return false;
  if (l.empty() || l == "null" || l == "~") return nullptr;
  int64_t i = 0;
  const char* end = v.data() + v.size();
  if (auto [p, ec] = std::from_chars(v.data(), end, i); ec == std::errc() && p == end) return i;
  double d = 0;
  if (auto [p, ec] = std::from_chars(v.data(), end, d); ec == std::errc() && p == end) return d;
  return v;
}

json to_json(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Map: {
      json o = json::object();
      for (const auto& kv : n) o[kv.first.Scalar()] = to_json(kv.second);
      return o;
    }
    case YAML::NodeType::Sequence: {
      json a = json::array();
      for (const auto& v : n) a.push_back(to_json(v));
      return a;
    }
    case YAML::NodeType::Scalar: return scalar(n);
    default: return nullptr;
  }
}

// A boolean written as YAML's true/false or as accelerate's string "true"/"false" (its CLI
// defaults are strings).
bool flag(const Fields& f, const json& obj, std::string_view key, bool fallback) {
  if (!f.has(key)) return fallback;
  const json& v = obj.at(std::string(key));
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_string()) {
    const std::string l = lower(v.get<std::string>());
    if (l == "true") return true;
    if (l == "false") return false;
  }
  f.fail(key, "true or false");
}

}  // namespace

json parse_yaml_text(std::string_view text, const std::string& origin) {
  try {
    return to_json(YAML::Load(std::string(text)));
  } catch (const YAML::Exception& e) {
    throw Error(fmt::format("{}: not valid YAML at line {}, column {}: {}", origin, e.mark.line + 1,
                            e.mark.column + 1, e.msg),
                "an accelerate config is the YAML `accelerate config` writes, or the same keys "
                "as JSON");
  }
}

Strategy apply_accelerate_config(Strategy s, std::string_view text, const std::string& origin,
                                 std::vector<std::string>* assumed) {
  auto note = [&](std::string line) {
    if (assumed != nullptr) assumed->push_back(std::move(line));
  };
  const json cfg = parse_yaml_text(text, origin);
  if (!cfg.is_object())
    throw Error(fmt::format("{}: an accelerate config must be a mapping of keys", origin),
                "write it with `accelerate config`, or see accelerate's config_yaml_templates");
  // config_args.py: BaseConfig, ClusterConfig and SageMakerConfig fields.
  static const std::set<std::string> top_keys = {
      "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug",
      "num_processes", "machine_rank", "num_machines", "gpu_ids", "main_process_ip",
      "main_process_port", "rdzv_backend", "same_network", "main_training_function",
      "enable_cpu_affinity", "fp8_config", "deepspeed_config", "fsdp_config",
      "parallelism_config", "megatron_lm_config", "mpirun_config", "dynamo_config",
      "downcast_bf16", "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo",
      "command_file", "commands", "tpu_vm", "tpu_env", "iam_role_name", "image_uri",
      "profile", "region", "base_job_name", "pytorch_version", "transformers_version",
      "py_version", "sagemaker_inputs_file", "sagemaker_metrics_file", "additional_args",
      "fp16", "dynamo_backend"};
  for (const auto& [key, value] : cfg.items())
    if (!top_keys.contains(key))
      throw Error(fmt::format("{}: unknown field '{}'", origin, key),
                  "zeroplan reads accelerate's documented config fields; check the spelling");
  Fields top(cfg, origin);
  const std::string type = top.string("distributed_type");
  if (type == "DEEPSPEED")
    throw Error(fmt::format("{}: distributed_type DEEPSPEED is a DeepSpeed run", origin),
                "pass its DeepSpeed JSON (deepspeed_config_file) as --ds-config with --profile "
                "deepspeed");
  if (type == "MULTI_GPU" || type == "NO")
    throw Error(fmt::format("{}: distributed_type {} is plain data parallel, not FSDP", origin, type),
                "DDP holds the states of ZeRO stage 0: --profile deepspeed --stage 0 --dp N");
  if (type != "FSDP")
    throw Error(fmt::format("{}: distributed_type {} is not modelled", origin, type),
                "--fsdp-config reads distributed_type FSDP");
  s.stage = 3;
  if (top.has("num_processes")) s.dp = top.positive_int("num_processes");
  else note(fmt::format("num_processes absent: --dp {}", s.dp));

  const std::string mp = top.has("mixed_precision") ? lower(top.string("mixed_precision")) : "no";
  if (mp == "no") {
    s.precision = Precision::fp32;
  } else if (mp == "bf16" || mp == "fp16") {
    s.precision = mp == "bf16" ? Precision::bf16 : Precision::fp16;
    // set_mixed_precision: param_dtype = reduce_dtype = the 16-bit type; the trainable
    // parameters are upcast to fp32 before sharding.
    s.reduce_precision = s.precision;
    s.master_precision = Precision::fp32;
    s.optimizer_precision = Precision::fp32;
  } else if (mp == "fp8") {
    throw Error(fmt::format("{}: mixed_precision fp8 is not modelled", origin),
                "plan it as bf16 (FP8 linears keep bf16 weights; their activations differ)");
  } else {
    top.fail("mixed_precision", "no, fp16, bf16 or fp8");
  }

  const json* fc = top.object("fsdp_config");
  if (fc == nullptr) {
    note("fsdp_config absent: FSDP1 FULL_SHARD with use_orig_params, accelerate's defaults");
    s.fsdp_version = 1;
    s.fsdp_use_orig_params = true;
    if (const json* pc = top.object("parallelism_config"); pc != nullptr && !pc->empty())
      throw Error(fmt::format("{}: parallelism_config needs fsdp_version 2", origin),
                  "accelerate refuses --use_parallelism_config with FSDP1 (fsdp_config absent "
                  "is FSDP1); add fsdp_config with fsdp_version: 2");
    validate(s);
    return s;
  }
  static const std::set<std::string> fsdp_keys = {
      "fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward",
      "fsdp_offload_params", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
      "fsdp_min_num_params", "fsdp_backward_prefetch", "fsdp_forward_prefetch",
      "fsdp_state_dict_type", "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading",
      "fsdp_sync_module_states", "fsdp_activation_checkpointing", "fsdp_ignored_modules",
      // accelerate copies each key to args.fsdp_<key>, adding the prefix where it is missing
      // (launch.py), so the unprefixed spellings are the same settings.
      "version", "sharding_strategy", "reshard_after_forward", "offload_params",
      "auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params",
      "backward_prefetch", "forward_prefetch", "state_dict_type", "use_orig_params",
      "cpu_ram_efficient_loading", "sync_module_states", "activation_checkpointing",
      "ignored_modules"};
  json f = json::object();
  for (const auto& [key, value] : fc->items()) {
    if (!fsdp_keys.contains(key))
      throw Error(fmt::format("{}: unknown field 'fsdp_config.{}'", origin, key),
                  "zeroplan reads accelerate's documented fsdp_config fields; check the spelling");
    f[key.rfind("fsdp_", 0) == 0 ? key : "fsdp_" + key] = value;
  }
  Fields ff(f, origin, "fsdp_config.");
  int64_t version = 1;
  if (ff.has("fsdp_version")) {
    const json& v = f.at("fsdp_version");
    if (v.is_number_integer()) version = v.get<int64_t>();
    else if (v.is_string() && (v == "1" || v == "2")) version = v.get<std::string>()[0] - '0';
    else version = 0;
    if (version != 1 && version != 2) ff.fail("fsdp_version", "1 or 2");
  } else {
    note("fsdp_config.fsdp_version absent: 1 (accelerate's default)");
  }
  // FSDP1's sharding strategy, by name or by its number (ShardingStrategy enum order).
  auto strategy_name = [&](std::string_view key) {
    const json& v = f.at(std::string(key));
    static const char* const names[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                                        "HYBRID_SHARD_ZERO2"};
    if (v.is_number_integer() && v.get<int64_t>() >= 1 && v.get<int64_t>() <= 5)
      return std::string(names[v.get<int64_t>() - 1]);
    if (v.is_string())
      for (const char* n : names)
        if (v.get<std::string>() == n) return std::string(n);
    ff.fail(key, "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_ZERO2 (or 1-5)");
  };
  s.fsdp_version = static_cast<int>(version);
  std::string sharding = "FULL_SHARD";
  if (version == 2) {
    if (ff.has("fsdp_sharding_strategy"))
      ff.fail("fsdp_sharding_strategy", "absent with fsdp_version 2 (use fsdp_reshard_after_forward)");
    s.reshard_after_forward = flag(ff, f, "fsdp_reshard_after_forward", true);
    sharding = s.reshard_after_forward ? "FULL_SHARD" : "SHARD_GRAD_OP";
  } else {
    if (ff.has("fsdp_sharding_strategy")) sharding = strategy_name("fsdp_sharding_strategy");
    else if (ff.has("fsdp_reshard_after_forward")) sharding = strategy_name("fsdp_reshard_after_forward");
  }
  if (sharding == "NO_SHARD")
    throw Error(fmt::format("{}: fsdp_sharding_strategy NO_SHARD is plain data parallel", origin),
                "NO_SHARD holds the states of ZeRO stage 0: --profile deepspeed --stage 0");
  // FSDP1's hybrid strategies, which accelerate hands FullyShardedDataParallel without process
  // groups: sharded over each node's devices, replicated across nodes (_init_utils.py
  // _init_intra_and_inter_node_groups(device_count())); _HYBRID_SHARD_ZERO2 keeps the
  // parameters gathered from forward to backward as SHARD_GRAD_OP does.
  if (sharding.rfind("HYBRID", 0) == 0) {
    s.fsdp_shard_size = kFsdpShardNode;
    note(fmt::format("fsdp_sharding_strategy {}: sharded over a node's GPUs (--hardware), "
                     "--fsdp-shard-size N to say how many", sharding));
  }
  s.reshard_after_forward = sharding == "FULL_SHARD" || sharding == "HYBRID_SHARD";
  if (version == 1) {
    // accelerate launch passes --fsdp_use_orig_params, default "true" (commands/launch.py),
    // to the plugin (FSDP_USE_ORIG_PARAMS); FSDP2 ignores it.
    s.fsdp_use_orig_params = flag(ff, f, "fsdp_use_orig_params", true);
    if (!ff.has("fsdp_use_orig_params"))
      note("fsdp_config.fsdp_use_orig_params absent: true (accelerate launch's default)");
  }
  // CPUOffload(offload_params=True) for FSDP1, CPUOffloadPolicy() for FSDP2
  // (FullyShardedDataParallelPlugin.set_cpu_offload): parameters, gradients and the
  // optimizer step on the host.
  if (flag(ff, f, "fsdp_offload_params", false)) s.offload_param = Offload::cpu;
  if (flag(ff, f, "fsdp_activation_checkpointing", false)) s.checkpointing = Checkpointing::full;
  // FSDP2's hybrid sharding (HSDP) comes from parallelism_config (accelerate's
  // ParallelismConfig: a (dp_replicate, dp_shard) mesh; launch.py copies its keys as written,
  // `accelerate config` writes them with the parallelism_config_ prefix); FSDP1 refuses it
  // (launch.py _validate_launch_command).
  if (const json* pc = top.object("parallelism_config"); pc != nullptr && !pc->empty()) {
    static const std::set<std::string> pc_keys = {
        "parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size",
        "parallelism_config_tp_size", "parallelism_config_cp_size",
        "parallelism_config_cp_backend", "parallelism_config_cp_comm_strategy",
        "parallelism_config_sp_size", "parallelism_config_sp_backend",
        "parallelism_config_sp_seq_length", "parallelism_config_sp_seq_length_is_variable",
        "parallelism_config_sp_attn_implementation"};
    for (const auto& [key, value] : pc->items())
      if (!pc_keys.contains(key))
        throw Error(fmt::format("{}: unknown field 'parallelism_config.{}'", origin, key),
                    "accelerate's keys are parallelism_config_dp_replicate_size, "
                    "parallelism_config_dp_shard_size, parallelism_config_tp_size, ...");
    if (version != 2)
      throw Error(fmt::format("{}: parallelism_config needs fsdp_version 2", origin),
                  "accelerate refuses --use_parallelism_config with FSDP1; for FSDP1's hybrid "
                  "sharding set fsdp_sharding_strategy: HYBRID_SHARD");
    Fields pf(*pc, origin, "parallelism_config.");
    for (const char* k : {"parallelism_config_tp_size", "parallelism_config_cp_size",
                          "parallelism_config_sp_size"})
      if (pf.has(k) && pf.positive_int(k, 1) > 1)
        throw Error(fmt::format("{}: parallelism_config.{} > 1 is not modelled under --profile "
                                "fsdp", origin, k),
                    "plan the data-parallel part alone, or tensor parallelism with --profile "
                    "deepspeed --mp");
    const int64_t replicate = pf.has("parallelism_config_dp_replicate_size")
                                  ? pf.positive_int("parallelism_config_dp_replicate_size", 1) : 1;
    const int64_t shard = pf.has("parallelism_config_dp_shard_size")
                              ? pf.positive_int("parallelism_config_dp_shard_size", 1) : 1;
    if (replicate * shard != s.dp)
      throw Error(fmt::format("{}: parallelism_config dp_replicate_size {} x dp_shard_size {} is "
                              "not num_processes {}", origin, replicate, shard, s.dp),
                  "accelerate needs their product to be the number of processes");
    if (replicate > 1 && shard == 1)
      throw Error(fmt::format("{}: parallelism_config dp_replicate_size {} with dp_shard_size 1 "
                              "is plain data parallel", origin, replicate),
                  "DDP holds the states of ZeRO stage 0: --profile deepspeed --stage 0 --dp N");
    if (replicate > 1) s.fsdp_shard_size = shard;
  }
  validate(s);
  return s;
}

}  // namespace zp::planner
