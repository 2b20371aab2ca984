// strategy.cpp: strategy names, validation, JSON, and reading DeepSpeed configs.
#include "zp/planner/strategy.hpp"

#include <cmath>

#include <algorithm>
#include <array>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/json_fields.hpp"

namespace zp::planner {

using nlohmann::json;

namespace {
template <typename E, std::size_t N>
std::optional<E> lookup(std::string_view s, const std::array<std::pair<std::string_view, E>, N>& t) {
  for (const auto& [name, value] : t)
    if (name == s) return value;
  return std::nullopt;
}
template <typename E, std::size_t N>
std::string_view name_of(E e, const std::array<std::pair<std::string_view, E>, N>& t) {
  for (const auto& [name, value] : t)
    if (value == e) return name;
  return "?";
}

constexpr std::array<std::pair<std::string_view, Precision>, 3> kPrecisions = {
    {{"fp32", Precision::fp32}, {"fp16", Precision::fp16}, {"bf16", Precision::bf16}}};
constexpr std::array<std::pair<std::string_view, OptimizerKind>, 7> kOptimizers = {
    {{"adam", OptimizerKind::adam},
     {"adamw", OptimizerKind::adamw},
     {"sgd", OptimizerKind::sgd},
     {"sgd-plain", OptimizerKind::sgd_plain},
     {"lion", OptimizerKind::lion},
     {"adafactor", OptimizerKind::adafactor},
     {"adam8bit", OptimizerKind::adam8bit}}};
constexpr std::array<std::pair<std::string_view, Checkpointing>, 4> kCheckpointing = {
    {{"none", Checkpointing::none},
     {"full", Checkpointing::full},
     {"selective", Checkpointing::selective},
     {"selective-op", Checkpointing::selective_op}}};
constexpr std::array<std::pair<std::string_view, Offload>, 3> kOffloads = {
    {{"none", Offload::none}, {"cpu", Offload::cpu}, {"nvme", Offload::nvme}}};
constexpr std::array<std::pair<std::string_view, MoeRouting>, 2> kMoeRoutings = {
    {{"balanced", MoeRouting::balanced}, {"worst", MoeRouting::worst}}};
constexpr std::array<std::pair<std::string_view, CpKind>, 2> kCpKinds = {
    {{"ring", CpKind::ring}, {"ulysses", CpKind::ulysses}}};
constexpr std::array<std::pair<std::string_view, OptimizerImpl>, 4> kOptimizerImpls = {
    {{"foreach", OptimizerImpl::foreach},
     {"fused", OptimizerImpl::fused},
     {"for-loop", OptimizerImpl::for_loop},
     {"transformers", OptimizerImpl::transformers}}};
}  // namespace

std::string_view to_string(Precision p) { return name_of(p, kPrecisions); }
std::string_view to_string(OptimizerKind o) { return name_of(o, kOptimizers); }
std::string_view to_string(Checkpointing c) { return name_of(c, kCheckpointing); }
std::string_view to_string(Offload o) { return name_of(o, kOffloads); }
std::string_view to_string(MoeRouting r) { return name_of(r, kMoeRoutings); }
std::string_view to_string(OptimizerImpl i) { return name_of(i, kOptimizerImpls); }
std::optional<OptimizerImpl> optimizer_impl_from_string(std::string_view s) {
  return lookup(s, kOptimizerImpls);
}
std::optional<MoeRouting> moe_routing_from_string(std::string_view s) {
  return lookup(s, kMoeRoutings);
}
std::string_view to_string(CpKind k) { return name_of(k, kCpKinds); }
std::optional<CpKind> cp_kind_from_string(std::string_view s) { return lookup(s, kCpKinds); }
std::optional<Precision> precision_from_string(std::string_view s) { return lookup(s, kPrecisions); }
std::optional<OptimizerKind> optimizer_from_string(std::string_view s) {
  return lookup(s, kOptimizers);
}
std::optional<Checkpointing> checkpointing_from_string(std::string_view s) {
  return lookup(s, kCheckpointing);
}
std::optional<Offload> offload_from_string(std::string_view s) { return lookup(s, kOffloads); }

// DeepSpeed's default for an unset overlap_comm: on for stage 3 only.
static bool default_overlap_comm(int stage) { return stage == 3; }

std::optional<uint32_t> deepspeed_version_from_string(std::string_view s) {
  if (s == "current") return 0;
  uint32_t part[3] = {0, 0, 0};
  int n = 0;
  std::size_t i = 0;
  while (i < s.size() && n < 3) {
    std::size_t j = i;
    uint32_t v = 0;
    while (j < s.size() && s[j] >= '0' && s[j] <= '9' && j - i < 3) v = v * 10 + static_cast<uint32_t>(s[j++] - '0');
    if (j == i) return std::nullopt;
    part[n++] = v;
    if (j == s.size()) break;
    if (s[j] != '.') return std::nullopt;
    i = j + 1;
    if (i == s.size()) return std::nullopt;
  }
  if (n < 2 || part[0] != 0 || part[1] > 99 || part[2] > 99) return std::nullopt;
  const uint32_t v = part[1] * 100 + part[2];
  return v == 0 ? std::nullopt : std::optional<uint32_t>(v);
}
std::string deepspeed_version_string(uint32_t v) {
  return v == 0 ? "current" : fmt::format("0.{}.{}", v / 100, v % 100);
}

std::optional<uint32_t> torch_version_from_string(std::string_view s) {
  if (s == "current") return 0;
  const std::size_t dot = s.find('.');
  if (dot == std::string_view::npos || dot == 0 || dot > 2) return std::nullopt;
  auto number = [](std::string_view d) -> std::optional<uint32_t> {
    if (d.empty() || d.size() > 2) return std::nullopt;
    uint32_t v = 0;
    for (char c : d) {
      if (c < '0' || c > '9') return std::nullopt;
      v = v * 10 + static_cast<uint32_t>(c - '0');
    }
    return v;
  };
  std::string_view minor = s.substr(dot + 1);
  if (const std::size_t patch = minor.find('.'); patch != std::string_view::npos) {
    if (!number(minor.substr(patch + 1))) return std::nullopt;  // 1.10.2: the patch is ignored
    minor = minor.substr(0, patch);
  }
  const auto ma = number(s.substr(0, dot)), mi = number(minor);
  if (!ma || !mi || *ma == 0) return std::nullopt;
  return *ma * 100 + *mi;
}
std::string torch_version_string(uint32_t v) {
  return v == 0 ? "current" : fmt::format("{}.{}", v / 100, v % 100);
}

bool overlaps_comm(const Strategy& s) { return s.overlap_comm.value_or(default_overlap_comm(s.stage)); }

bool holds_buckets_in_flight(const Strategy& s) {
  return s.stage >= 2 && zero_dp(s) > 1 && overlaps_comm(s);
}

void validate(const Strategy& s) {
  if (s.stage < 0 || s.stage > 3)
    throw Error(fmt::format("--stage: must be 0, 1, 2 or 3, got {}", s.stage),
                "ZeRO stage 1 partitions optimizer states, 2 adds gradients, 3 adds parameters");
  auto positive = [](int64_t v, std::string_view flag, std::string_view hint) {
    if (v < 1) throw Error(fmt::format("{}: must be >= 1, got {}", flag, v), std::string(hint));
  };
  positive(s.dp, "--dp", "the data-parallel degree is the number of ranks, e.g. --dp 8");
  positive(s.mp, "--tp", "the tensor-parallel degree, 1 without tensor parallelism");
  positive(s.pp, "--pp", "the pipeline-parallel degree (stages), 1 without pipelining");
  positive(s.vp, "--vp", "model chunks per pipeline stage (the interleaved schedule), 1 without");
  positive(s.cp, "--cp", "the context-parallel degree, 1 without context parallelism");
  if (s.grad_precision && *s.grad_precision != s.precision) {
    if (*s.grad_precision != Precision::fp32)
      throw Error(fmt::format("--grad-precision {}: gradients are kept in the training precision "
                              "({}) or in fp32", to_string(*s.grad_precision), to_string(s.precision)),
                  "give --grad-precision fp32 (Megatron's main_grad) or leave it out");
    if (s.stage >= 2 || s.offload_optimizer != Offload::none)
      throw Error(fmt::format("--grad-precision fp32 with --stage {}{}: planned at stages 0-1 with "
                              "the optimizer on the GPU", s.stage,
                              s.offload_optimizer != Offload::none ? " and an offloaded optimizer" : ""),
                  "fp32 gradients are Megatron's DDP grad buffer, beside its distributed optimizer "
                  "(stage 1)");
  }
  if (s.pp > 1 && s.stage >= 2)
    throw Error(fmt::format("--pp {} with --stage {}: ZeRO-2 and ZeRO-3 do not combine with "
                            "pipeline parallelism", s.pp, s.stage),
                "DeepSpeed's PipelineEngine asserts zero_optimization.stage < 2 (deepspeed/"
                "runtime/pipe/engine.py), and Megatron's distributed optimizer is stage 1: use "
                "--stage 0 or 1");
  if (s.vp > 1 && s.pp == 1)
    throw Error(fmt::format("--vp {}: needs --pp > 1", s.vp),
                "virtual pipeline stages interleave the chunks of a pipeline; give --pp too");
  if (s.pp > 1 || s.pp_schedule != PipelineSchedule::one_f_one_b)
    validate_pipeline(s.pp_schedule, s.pp, s.grad_accum, s.vp);
  positive(s.micro_batch, "--micro-batch", "sequences per rank per micro-step, e.g. 1");
  positive(s.grad_accum, "--grad-accum", "micro-steps per optimizer step, e.g. 1");
  if (s.seq < 0)
    throw Error(fmt::format("--seq: must be >= 1, got {}", s.seq),
                "tokens per sequence; leave it out to use the model's context length");
  positive(s.ep, "--ep", "the expert-parallel degree, 1 without expert parallelism");
  if (s.fused_optimizer && s.optimizer_impl != OptimizerImpl::foreach &&
      s.optimizer_impl != OptimizerImpl::fused)
    throw Error(fmt::format("--fused-optimizer with --optimizer-impl {}: one implementation runs",
                            to_string(s.optimizer_impl)),
                "--optimizer-impl fused is --fused-optimizer; leave out one of them");
  if (!(s.moe_capacity_factor >= 0) || !std::isfinite(s.moe_capacity_factor))
    throw Error(fmt::format("--moe-capacity-factor: must be >= 0, got {}", s.moe_capacity_factor),
                "0 routes every token (dropless); DeepSpeed's default capacity_factor is 1.0");
  if (s.dp % s.ep != 0)
    throw Error(fmt::format("--ep {}: must divide --dp {}", s.ep, s.dp),
                "the experts are split over ep ranks of the data-parallel group, so dp/ep "
                "expert-data-parallel groups hold each expert's ZeRO partitions");
  if (s.target_seq < 0)
    throw Error(fmt::format("--target-seq: must be >= 1, got {}", s.target_seq),
                "the decoder's tokens per sequence of an encoder-decoder model; leave it out "
                "to use --seq");
  if (s.offload_param != Offload::none && s.stage != 3)
    throw Error(fmt::format("--offload-param {}: needs --stage 3, got stage {}",
                            to_string(s.offload_param), s.stage),
                "parameter offload (ZeRO-Infinity) moves the partitioned parameters of stage 3");
  if (s.offload_optimizer != Offload::none && s.stage == 0)
    throw Error(fmt::format("--offload-optimizer {}: needs --stage 1, 2 or 3",
                            to_string(s.offload_optimizer)),
                "ZeRO-Offload moves each rank's optimizer partition; use --stage 2");
  if (s.dpu && s.offload_optimizer == Offload::none)
    throw Error("--dpu: the delayed parameter update needs --offload-optimizer cpu or nvme",
                "DPU overlaps the CPU optimizer step with the next forward/backward");
  if (!(s.offload_optimizer_ratio >= 0 && s.offload_optimizer_ratio <= 1))
    throw Error(fmt::format("--offload-optimizer-ratio: must be from 0 to 1, got {}",
                            s.offload_optimizer_ratio),
                "the fraction of the optimizer sub-groups stepped on the CPU; 1 (DeepSpeed's "
                "default) steps all of them there");
  if (s.offload_optimizer_ratio < 1) {
    if (s.offload_optimizer != Offload::cpu)
      throw Error(fmt::format("--offload-optimizer-ratio {}: needs --offload-optimizer cpu",
                              s.offload_optimizer_ratio),
                  "partial offload keeps some optimizer sub-groups on the GPU and steps the rest "
                  "with the CPU Adam (zeroplan does not model it with NVMe)");
    if (s.stage != 3)
      throw Error(fmt::format("--offload-optimizer-ratio {}: needs --stage 3, got stage {}",
                              s.offload_optimizer_ratio, s.stage),
                  "DeepSpeed reads offload_optimizer.ratio at stage 3 only");
    if (s.optimizer != OptimizerKind::adam && s.optimizer != OptimizerKind::adamw)
      throw Error(fmt::format("--offload-optimizer-ratio {}: needs --optimizer adam or adamw, got {}",
                              s.offload_optimizer_ratio, to_string(s.optimizer)),
                  "DeepSpeed's partial offload pairs its CPU Adam with a GPU AdamW (stage3.py: "
                  "'Hybrid Optimizer Only Supports DeepSpeedCPUAdam')");
  }
  if (s.quantized_weights && s.stage != 3)
    throw Error(fmt::format("--quantized-weights: needs --stage 3, got stage {}", s.stage),
                "ZeRO++ qwZ quantizes stage 3's parameter all-gathers");
  if (s.zero_init.value_or(false) && s.stage != 3)
    throw Error(fmt::format("--zero-init: needs --stage 3, got stage {}", s.stage),
                "zero.Init keeps parameters partitioned as they are created, which stage 3 "
                "alone trains; stages 0-2 build the model whole");
  if (s.load_on_gpu && s.precision == Precision::fp32 && *s.load_on_gpu != Precision::fp32)
    throw Error(fmt::format("--load-on-gpu {}: --precision fp32 would train the {} weights as "
                            "loaded", to_string(*s.load_on_gpu), to_string(*s.load_on_gpu)),
                "DeepSpeed casts the model only with fp16 or bf16 enabled (engine.py "
                "_cast_module_mixed_precision); load in fp32 or train in 16 bits");
  if (s.buffers.sub_group_size == 0)
    throw Error("sub_group_size 0: must be at least 1 element",
                "DeepSpeed's default is 1e9 elements of fp32 partition per optimizer sub-group");
  if (s.hpz_partition_size < 1 || s.dp % s.hpz_partition_size != 0)
    throw Error(fmt::format("--hpz-partition-size {}: must divide --dp {}", s.hpz_partition_size, s.dp),
                "ZeRO++'s secondary partition spans the GPUs of a node, e.g. 8");
  if (s.fsdp_version != 1 && s.fsdp_version != 2)
    throw Error(fmt::format("--fsdp-version: must be 1 or 2, got {}", s.fsdp_version),
                "1: FullyShardedDataParallel (FlatParameter), 2: fully_shard (per-parameter)");
  if (s.fsdp_shard_size < kFsdpShardNode ||
      (s.fsdp_shard_size > 0 && s.dp % s.fsdp_shard_size != 0))
    throw Error(fmt::format("--fsdp-shard-size {}: must divide --dp {}", s.fsdp_shard_size, s.dp),
                "hybrid sharding shards over groups of that many ranks (a node's GPUs, e.g. 8) "
                "and replicates over dp / that many groups");
  if (s.master_precision == Precision::fp16 || s.optimizer_precision == Precision::fp16)
    throw Error("--master-weights and --optimizer-states take fp32 or bf16",
                "fp16 master weights or moments lose too much range; train in bf16 to keep 16-bit states");
  if (s.master_precision == Precision::bf16 && s.precision != Precision::bf16)
    throw Error(fmt::format("--master-weights bf16: needs --precision bf16, got {}",
                            to_string(s.precision)),
                "bf16 master weights (DeepSpeed's bf16_master_weights_and_grads, pure-bf16 "
                "FSDP) update bf16 weights");
  if (s.optimizer_precision == Precision::bf16 && s.master_precision != Precision::bf16)
    throw Error("--optimizer-states bf16: needs --master-weights bf16",
                "DeepSpeed's bf16_optimizer_states requires bf16_master_weights_and_grads");
  if (s.cpu_checkpointing && !s.partition_activations)
    throw Error("--cpu-checkpointing: needs --partition-activations",
                "DeepSpeed offloads the partitioned checkpoints (activation_checkpointing."
                "partition_activations and cpu_checkpointing both true)");
  if (s.checkpointing == Checkpointing::selective_op && s.ep > 1)
    throw Error(fmt::format("--checkpointing selective-op with --ep {}: not modelled", s.ep),
                "torchtitan's policy keeps both all-to-alls' outputs under expert parallelism "
                "(the graph has only the dispatch's); use --ep 1 or --checkpointing full");
  if (s.checkpointing == Checkpointing::selective_op && s.moe_capacity_factor > 0)
    throw Error("--checkpointing selective-op with --moe-capacity-factor: not modelled",
                "torchtitan's MoE, whose policy this is, drops no tokens; leave out "
                "--moe-capacity-factor");
  if (s.number_checkpoints < 0)
    throw Error(fmt::format("--number-checkpoints: must be >= 1, got {}", s.number_checkpoints),
                "the activation checkpoints one forward makes: one per block");
  if (s.contiguous_memory_optimization && !s.partition_activations)
    throw Error("--contiguous-memory-optimization: needs --partition-activations",
                "DeepSpeed's checkpointing.configure asserts it: contiguous checkpointing is only "
                "available with partitioned activations (activation_checkpointing."
                "partition_activations true)");
  if (s.contiguous_memory_optimization && s.number_checkpoints == 0)
    throw Error("--contiguous-memory-optimization: needs --number-checkpoints",
                "DeepSpeed sizes its buffers by activation_checkpointing.number_checkpoints "
                "(checkpointing.configure asserts it is given): one per block");
  if (s.partition_activations && s.checkpointing != Checkpointing::full)
    throw Error("--partition-activations: needs --checkpointing full",
                "ZeRO-R P_a partitions the activation checkpoints that full recomputation keeps");
  // reduce and prefetch 0: "auto", the Hugging Face Trainer's sizes (resolve_for_model).
  if (s.buffers.allgather_bucket_size == 0 || s.buffers.max_live_parameters == 0)
    throw Error("bucket sizes must be at least 1 element",
                "DeepSpeed's defaults are reduce/allgather 5e8, prefetch 5e7, max live 1e9");
  if (s.buffers.optimizer_swap_chunk_size == 0 || s.buffers.optimizer_swap_chunk_size % 1024 != 0)
    throw Error(fmt::format("optimizer_swap_chunk_size {}: not a positive multiple of 1024 elements",
                            s.buffers.optimizer_swap_chunk_size),
                "a chunk is whole 4096-byte O_DIRECT blocks of fp32 values; the default is 1048576");
  if (s.buffers.offload_tile_size == 0 || s.buffers.offload_tile_size % 256 != 0)
    throw Error(fmt::format("offload_tile_size {}: not a positive multiple of 256 elements",
                            s.buffers.offload_tile_size),
                "a tile is whole 256-byte arena blocks for any parameter width; the default is "
                "DeepSpeed's CPU Adam tile, 134217728");
  if (s.buffers.optimizer_swap_buffer_count < 2 || s.buffers.optimizer_swap_buffer_count > 64)
    throw Error(fmt::format("optimizer_swap_buffer_count {}: must be 2 to 64",
                            s.buffers.optimizer_swap_buffer_count),
                "3 overlaps the read of chunk k+1, the update of chunk k and the write of chunk k-1");
  if (s.buffers.param_swap_buffer_count < 1 || s.buffers.param_swap_buffer_count > 64)
    throw Error(fmt::format("param_swap_buffer_count {}: must be 1 to 64",
                            s.buffers.param_swap_buffer_count),
                "host buffers for --offload-param nvme shard reads; DeepSpeed's offload_param."
                "buffer_count defaults to 5");
  if (s.buffers.param_swap_buffer_size == 0)
    throw Error("param_swap_buffer_size 0: must be at least 1 element",
                "elements per host buffer for --offload-param nvme; DeepSpeed's offload_param."
                "buffer_size defaults to 1e8");
  if (s.buffers.param_swap_prefetch_depth > 64)
    throw Error(
        fmt::format("param_swap_prefetch_depth {}: must be 0 to 64",
                    s.buffers.param_swap_prefetch_depth),
        "gathers ahead whose shard reads may be in flight; the free buffers limit it anyway");
}

namespace {

bool is_auto(const json& obj, std::string_view key) {
  auto it = obj.find(key);
  return it != obj.end() && it->is_string() && it->get<std::string>() == "auto";
}

void reject_unknown(const json& obj, const std::set<std::string_view>& known,
                    const std::string& origin, std::string_view prefix) {
  for (const auto& [key, value] : obj.items())
    if (!known.contains(key))
      throw Error(fmt::format("{}: unknown field '{}{}'", origin, prefix, key),
                  "zeroplan reads DeepSpeed's documented config fields; check the spelling");
}

// A field zeroplan does not model: accepted only at the value that leaves memory unchanged.
void require_neutral(const json& obj, std::string_view key, const json& neutral,
                     const std::string& origin, std::string_view prefix) {
  auto it = obj.find(key);
  if (it != obj.end() && !it->is_null() && *it != neutral)
    throw Error(fmt::format("{}: field '{}{}' = {} is not modelled by zeroplan", origin, prefix,
                            key, json_excerpt(*it)),
                fmt::format("remove it or set it to {} to plan without it", json_excerpt(neutral)));
}

// The section's device, and its buffer settings where zeroplan has them:
// offload_optimizer.buffer_count (DeepSpeed's default 4, zeroplan's 3 when absent) becomes
// the optimizer swap pipeline's buffer sets; offload_param.buffer_count and buffer_size the
// parameter swap buffers. offload_param.max_in_cpu (DeepSpeed keeps up to that many elements
// of its 16-bit sub-group partitions in host memory) is type-checked and not modelled:
// zeroplan keeps the whole 16-bit partition on NVMe.
Offload read_offload(const json& zo, std::string_view key, const std::string& origin,
                     BufferSizes& buffers) {
  Fields f(zo, origin, "zero_optimization.");
  const json* o = f.object(key);
  if (o == nullptr) return Offload::none;
  const std::string prefix = fmt::format("zero_optimization.{}.", key);
  reject_unknown(*o,
                 {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu",
                  "pin_memory", "pipeline", "pipeline_read", "pipeline_write", "fast_init",
                  "ratio"},
                 origin, prefix);
  Fields of(*o, origin, prefix);
  const std::string dev = of.string("device", "none");
  auto v = offload_from_string(dev);
  if (!v)
    throw Error(fmt::format("{}: field '{}device' must be \"none\", \"cpu\" or \"nvme\", got "
                            "\"{}\"", origin, prefix, dev));
  auto count = [&](std::string_view field, uint64_t& into, uint64_t lo, uint64_t hi) {
    if (is_auto(*o, field) || !of.has(field)) return;
    const uint64_t n = of.byte_count(field, into);
    if (n < lo || n > hi)
      of.fail(field, hi == UINT64_MAX ? fmt::format("at least {}", lo)
                                      : fmt::format("a count from {} to {}", lo, hi));
    into = n;
  };
  if (key == "offload_optimizer") {
    count("buffer_count", buffers.optimizer_swap_buffer_count, 2, 64);
  } else {
    count("buffer_count", buffers.param_swap_buffer_count, 1, 64);
    count("buffer_size", buffers.param_swap_buffer_size, 1, UINT64_MAX);
    uint64_t max_in_cpu = 0;
    count("max_in_cpu", max_in_cpu, 0, UINT64_MAX);
  }
  return *v;
}

}  // namespace

// The fields zeroplan reads no memory from, type-checked as DeepSpeed uses them, so a config
// DeepSpeed would refuse (or trip over at its first step) is not planned as if it were fine.
// The monitors and the communication logger are pydantic models that forbid unknown fields
// (deepspeed/monitor/config.py, deepspeed/comm/config.py: DeepSpeedConfigModel, extra=
// "forbid"); the flops profiler and the top-level scalars are read by get_scalar_param with
// the defaults' types (deepspeed/profiling/config.py, deepspeed/runtime/config.py);
// communication_data_type is one of fp16, bf16, fp32 (runtime/config.py
// get_communication_data_type raises otherwise). "auto" stands where the Hugging Face Trainer
// fills a value in.
static void check_unmodelled_fields(const json& ds, const std::string& origin) {
  Fields top(ds, origin);
  for (const char* k : {"prescale_gradients", "sparse_gradients", "zero_allow_untested_optimizer",
                        "zero_force_ds_cpu_optimizer", "wall_clock_breakdown", "dump_state",
                        "memory_breakdown", "disable_allgather", "dataloader_drop_last",
                        "load_universal_checkpoint"})
    (void)top.boolean(k, false);
  if (!is_auto(ds, "gradient_clipping")) (void)top.nonneg_number("gradient_clipping", 0);
  (void)top.positive_number("gradient_predivide_factor", 1);
  (void)top.positive_int("steps_per_print", 10);
  (void)top.nonneg_int("seed", 1234);
  if (top.has("communication_data_type")) {
    const std::string t = top.string("communication_data_type");
    if (t != "fp16" && t != "bf16" && t != "fp32")
      top.fail("communication_data_type", "\"fp16\", \"bf16\", \"fp32\" or null");
  }
  // A pydantic model's section: its fields, each a type.
  enum class T { boolean, string, opt_string, opt_boolean, integer, number, list };
  auto section = [&](const char* name, std::initializer_list<std::pair<std::string_view, T>> fields) {
    const json* o = top.object(name);
    if (o == nullptr) return;
    Fields f(*o, origin, std::string(name) + ".");
    std::vector<std::string_view> known;
    for (const auto& [k, t] : fields) known.push_back(k);
    for (const auto& [key, value] : o->items())
      if (std::find(known.begin(), known.end(), key) == known.end())
        throw Error(fmt::format("{}: unknown field '{}.{}'", origin, name, key),
                    fmt::format("DeepSpeed refuses it too (its {} section takes {})", name,
                                fmt::join(known, ", ")));
    for (const auto& [k, t] : fields) {
      if (!f.has(k)) continue;
      const json& v = o->at(std::string(k));
      switch (t) {
        case T::boolean: (void)f.boolean(k, false); break;
        case T::opt_boolean: (void)f.boolean(k, false); break;  // null counts as absent
        case T::string:
        case T::opt_string: (void)f.string(k, ""); break;
        case T::integer:
          if (!v.is_number_integer()) f.fail(k, "an integer");
          break;
        case T::number:
          if (!v.is_number() || !std::isfinite(v.get<double>())) f.fail(k, "a number");
          break;
        case T::list:
          if (!v.is_array()) f.fail(k, "a list");
          break;
      }
    }
  };
  section("tensorboard", {{"enabled", T::boolean}, {"output_path", T::string}, {"job_name", T::string}});
  section("csv_monitor", {{"enabled", T::boolean}, {"output_path", T::string}, {"job_name", T::string}});
  section("wandb", {{"enabled", T::boolean}, {"group", T::opt_string}, {"team", T::opt_string},
                    {"project", T::string}});
  section("comet", {{"enabled", T::boolean}, {"samples_log_interval", T::integer},
                    {"project", T::opt_string}, {"workspace", T::opt_string},
                    {"api_key", T::opt_string}, {"experiment_name", T::opt_string},
                    {"experiment_key", T::opt_string}, {"online", T::opt_boolean},
                    {"mode", T::opt_string}});
  section("comms_logger", {{"enabled", T::boolean}, {"prof_all", T::boolean}, {"prof_ops", T::list},
                           {"verbose", T::boolean}, {"debug", T::boolean}});
  section("flops_profiler", {{"enabled", T::boolean}, {"recompute_fwd_factor", T::number},
                             {"profile_step", T::integer}, {"module_depth", T::integer},
                             {"top_modules", T::integer}, {"detailed", T::boolean},
                             {"output_file", T::opt_string}});
}

Strategy apply_deepspeed_config(Strategy s, const json& ds, const std::string& origin,
                                std::vector<std::string>* assumed) {
  auto note = [&](std::string line) {
    if (assumed != nullptr) assumed->push_back(std::move(line));
  };
  if (!ds.is_object())
    throw Error(fmt::format("{}: a DeepSpeed config must be a JSON object", origin));
  reject_unknown(ds,
                 {"train_batch_size", "train_micro_batch_size_per_gpu",
                  "gradient_accumulation_steps", "optimizer", "scheduler", "fp16", "bf16", "amp",
                  "gradient_clipping", "prescale_gradients", "gradient_predivide_factor",
                  "sparse_gradients", "zero_optimization", "zero_allow_untested_optimizer",
                  "zero_force_ds_cpu_optimizer", "activation_checkpointing", "aio",
                  "steps_per_print", "wall_clock_breakdown", "dump_state", "flops_profiler",
                  "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
                  "communication_data_type", "elasticity", "autotuning", "checkpoint",
                  "data_types", "memory_breakdown", "load_universal_checkpoint",
                  "disable_allgather", "seed", "dataloader_drop_last", "sequence_parallel_size"},
                 origin, "");
  check_unmodelled_fields(ds, origin);
  Fields top(ds, origin);
  // DeepSpeed-Ulysses (ALST): the config's sequence_parallel_size, as DeepSpeed's own sequence-
  // parallel tests write it, is the Ulysses degree: context parallelism by all-to-all.
  if (top.has("sequence_parallel_size") && !is_auto(ds, "sequence_parallel_size")) {
    s.cp = top.positive_int("sequence_parallel_size", 1);
    if (s.cp > 1) s.cp_kind = CpKind::ulysses;
  }
  if (!is_auto(ds, "train_micro_batch_size_per_gpu"))
    s.micro_batch = top.positive_int("train_micro_batch_size_per_gpu", s.micro_batch);
  else
    note(fmt::format("train_micro_batch_size_per_gpu \"auto\" (the Trainer's "
                     "per_device_train_batch_size): B={}; --micro-batch settles it", s.micro_batch));
  if (!is_auto(ds, "gradient_accumulation_steps"))
    s.grad_accum = top.positive_int("gradient_accumulation_steps", s.grad_accum);
  else
    note(fmt::format("gradient_accumulation_steps \"auto\": {}; --grad-accum settles it",
                     s.grad_accum));
  // train_batch_size = micro * accum * dp is DeepSpeed's consistency rule; the data-parallel
  // degree comes from the launcher (--dp), so the field is type-checked and not used.
  if (!is_auto(ds, "train_batch_size")) (void)top.positive_int("train_batch_size", 1);

  bool fp16 = false, bf16 = false, fp16_auto = false, bf16_auto = false;
  if (const json* f = top.object("fp16")) {
    Fields ff(*f, origin, "fp16.");
    fp16_auto = is_auto(*f, "enabled");
    if (!fp16_auto) fp16 = ff.boolean("enabled", false);
  }
  if (const json* b = top.object("bf16")) {
    Fields bf(*b, origin, "bf16.");
    bf16_auto = is_auto(*b, "enabled");
    if (!bf16_auto) bf16 = bf.boolean("enabled", false);
    // Low-precision master weights and moments (DeepSpeed precision_config.py,
    // DeepSpeedBF16Config; validated in runtime/config.py: the moments need the master).
    if (bf.boolean("bf16_master_weights_and_grads", false)) s.master_precision = Precision::bf16;
    if (bf.boolean("bf16_optimizer_states", false)) s.optimizer_precision = Precision::bf16;
  }
  if (fp16 && bf16)
    throw Error(fmt::format("{}: fp16.enabled and bf16.enabled are both true", origin),
                "DeepSpeed trains in one 16-bit format; enable one of them");
  // DeepSpeed without fp16/bf16 sections trains in fp32. An "auto" the Trainer fills from its
  // --fp16/--bf16 arguments: a format enabled elsewhere in the file decides; otherwise the
  // plan keeps its precision (bf16 unless given) and says so.
  if (fp16 || bf16) {
    s.precision = fp16 ? Precision::fp16 : Precision::bf16;
  } else if (fp16_auto || bf16_auto) {
    note(fmt::format("{} \"auto\" (the Trainer fills it from --fp16/--bf16): {}; --precision "
                     "fp16|bf16|fp32 settles it",
                     fp16_auto && bf16_auto ? "fp16.enabled and bf16.enabled"
                     : fp16_auto            ? "fp16.enabled"
                                            : "bf16.enabled",
                     to_string(s.precision)));
  } else {
    s.precision = Precision::fp32;
  }

  if (const json* o = top.object("optimizer")) {
    Fields of(*o, origin, "optimizer.");
    const std::string type = of.string("type", "Adam");
    std::string lower;
    for (char c : type) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    // DeepSpeed builds its own optimizers by name (deepspeed/runtime/config.py
    // DEEPSPEED_OPTIMIZERS, engine.py _configure_basic_optimizer) and any other name as
    // getattr(torch.optim, type). What each keeps: Lion is FusedLion or DeepSpeedCPULion (one
    // exp_avg, zeros_like the fp32 partition; deepspeed/ops/lion); MuAdam, MuAdamW and MuSGD
    // are mup's wrappers of torch.optim.Adam, AdamW and SGD (per-group learning rates, the
    // same state); "SGD" is torch.optim.SGD, whose momentum defaults to 0 (no state);
    // "Adafactor" is torch.optim.Adafactor (no first moment, like transformers' default).
    // Lamb, OneBitAdam, ZeroOneAdam, OneBitLamb (error-feedback buffers beside the moments),
    // Adagrad and Muon are not modelled.
    auto sgd_kind = [&] {
      const json* params = of.object("params");
      if (params == nullptr) return OptimizerKind::sgd_plain;
      if (is_auto(*params, "momentum")) {
        note("optimizer.params.momentum \"auto\": SGD with momentum (one buffer); --optimizer "
             "sgd-plain settles it for momentum 0");
        return OptimizerKind::sgd;
      }
      Fields pf(*params, origin, "optimizer.params.");
      return pf.probability("momentum", 0) > 0 ? OptimizerKind::sgd : OptimizerKind::sgd_plain;
    };
    if (lower == "adam" || lower == "cpuadam" || lower == "fusedadam" || lower == "muadam")
      s.optimizer = OptimizerKind::adam;
    else if (lower == "adamw" || lower == "muadamw") s.optimizer = OptimizerKind::adamw;
    else if (lower == "sgd" || lower == "musgd") s.optimizer = sgd_kind();
    else if (lower == "lion") s.optimizer = OptimizerKind::lion;
    else if (lower == "adafactor") s.optimizer = OptimizerKind::adafactor;
    else
      throw Error(fmt::format("{}: optimizer.type '{}' is not modelled", origin, type),
                  "zeroplan models Adam, AdamW, SGD, Lion and Adafactor; for bitsandbytes' 8-bit "
                  "Adam (a client optimizer, no optimizer section) pass --optimizer adam8bit");
  }

  if (const json* ac = top.object("activation_checkpointing")) {
    reject_unknown(*ac,
                   {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                    "number_checkpoints", "synchronize_checkpoint_boundary", "profile"},
                   origin, "activation_checkpointing.");
    Fields af(*ac, origin, "activation_checkpointing.");
    // DeepSpeed's section configures checkpointing the model code asks for; it does not turn
    // it on. P_a is what it adds to the memory picture.
    s.partition_activations = af.boolean("partition_activations", s.partition_activations);
    s.cpu_checkpointing = af.boolean("cpu_checkpointing", s.cpu_checkpointing);
    s.contiguous_memory_optimization =
        af.boolean("contiguous_memory_optimization", s.contiguous_memory_optimization);
    // null is DeepSpeed's default (ACT_CHKPT_NUMBER_CHECKPOINTS_DEFAULT = None).
    if (af.has("number_checkpoints")) s.number_checkpoints = af.positive_int("number_checkpoints", 1);
    // synchronize_checkpoint_boundary (a device synchronize around each checkpoint) and
    // profile (timers) allocate nothing: type-checked only.
    (void)af.boolean("synchronize_checkpoint_boundary", false);
    (void)af.boolean("profile", false);
  }
  if (const json* zo = top.object("zero_optimization")) {
    reject_unknown(*zo,
                   {"stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
                    "allgather_partitions", "allgather_bucket_size", "overlap_comm",
                    "load_from_fp32_weights", "elastic_checkpoint", "offload_param",
                    "offload_optimizer", "sub_group_size", "stage3_max_live_parameters",
                    "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
                    "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
                    "stage3_gather_16bit_weights_on_model_save",
                    "stage3_gather_fp16_weights_on_model_save", "round_robin_gradients",
                    "zero_hpz_partition_size", "zero_quantized_weights",
                    "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
                    "zeropp_loco_param", "mics_shard_size",
                    "mics_hierarchical_params_gather", "memory_efficient_linear",
                    "ignore_unused_parameters", "legacy_stage1", "cpu_offload",
                    "cpu_offload_params", "cpu_offload_use_pin_memory",
                    "use_multi_rank_bucket_allreduce", "log_trace_cache_warnings"},
                   origin, "zero_optimization.");
    const std::string p = "zero_optimization.";
    // ZeRO++ qgZ's quantized all-to-all runs across nodes only and its int4 buffers follow
    // each gradient's shape (runtime/comm/coalesced_collectives.py all_to_all_quant_reduce):
    // not modelled, see the message.
    if (auto it = zo->find("zero_quantized_gradients");
        it != zo->end() && !it->is_null() && *it != json(false))
      throw Error(fmt::format("{}: field 'zero_optimization.zero_quantized_gradients' = {} is not "
                              "modelled by zeroplan", origin, json_excerpt(*it)),
                  "ZeRO++ qgZ replaces the reduce-scatter by an int4 all-to-all only across "
                  "nodes (stage3.py __avg_scatter_grads: num_nodes > 1, GPUs per node from "
                  "the launcher), with per-gradient buffers sized by its shape and node count; "
                  "set it to false to plan the plain reduce-scatter");

    require_neutral(*zo, "mics_shard_size", -1, origin, p);
    Fields z(*zo, origin, p);
    if (z.has("stage")) {
      const int64_t st = z.nonneg_int("stage", 0);
      if (st > 3)
        throw Error(fmt::format("{}: field 'zero_optimization.stage' must be 0, 1, 2 or 3, got "
                                "{}", origin, st),
                    "ZeRO stage 1 partitions optimizer states, 2 adds gradients, 3 adds "
                    "parameters");
      s.stage = static_cast<int>(st);
    }
    s.offload_optimizer = read_offload(*zo, "offload_optimizer", origin, s.buffers);
    // offload_optimizer.ratio: read at stage 3 only (offload_config.py: "Only valid with ZeRO
    // Stage 3"; engine.py hands it to the stage-3 optimizer alone).
    if (const json* oo = z.object("offload_optimizer"); oo != nullptr && oo->contains("ratio")) {
      Fields of(*oo, origin, "zero_optimization.offload_optimizer.");
      const double r = of.probability("ratio", 1.0);
      if (s.stage == 3 && s.offload_optimizer == Offload::cpu)
        s.offload_optimizer_ratio = r;
      else if (r < 1)
        note(fmt::format("zero_optimization.offload_optimizer.ratio {}: no effect here (DeepSpeed "
                         "reads it at stage 3 with the optimizer on the CPU)", r));
    }
    s.offload_param = read_offload(*zo, "offload_param", origin, s.buffers);
    if (z.boolean("cpu_offload", false)) s.offload_optimizer = Offload::cpu;  // legacy spelling
    if (z.boolean("cpu_offload_params", false)) s.offload_param = Offload::cpu;
    // The two sizes the Trainer derives from the hidden size become 0 ("auto", set by
    // resolve_for_model); the other "auto"s keep DeepSpeed's defaults.
    for (const auto& [key, into] : {std::pair<std::string_view, uint64_t*>{"reduce_bucket_size",
                                                                           &s.buffers.reduce_bucket_size},
                                    {"stage3_prefetch_bucket_size", &s.buffers.prefetch_bucket_size}})
      if (is_auto(*zo, key)) *into = 0;
    auto bucket = [&](std::string_view key, uint64_t& into) {
      if (!is_auto(*zo, key) && z.has(key)) {
        const uint64_t v = z.byte_count(key, into);
        if (v == 0) z.fail(key, "a positive number of elements");
        into = v;
      }
    };
    if (!is_auto(*zo, "overlap_comm") && z.has("overlap_comm"))
      s.overlap_comm = z.boolean("overlap_comm", false);
    if (is_auto(*zo, "contiguous_gradients"))
      note(fmt::format("zero_optimization.contiguous_gradients \"auto\": {} (DeepSpeed's default); "
                       "--contiguous-gradients or --no-contiguous-gradients settles it",
                       s.contiguous_gradients));
    else
      s.contiguous_gradients = z.boolean("contiguous_gradients", s.contiguous_gradients);
    bucket("reduce_bucket_size", s.buffers.reduce_bucket_size);
    bucket("allgather_bucket_size", s.buffers.allgather_bucket_size);
    bucket("stage3_prefetch_bucket_size", s.buffers.prefetch_bucket_size);
    bucket("stage3_max_live_parameters", s.buffers.max_live_parameters);
    bucket("sub_group_size", s.buffers.sub_group_size);
    if (is_auto(*zo, "stage3_param_persistence_threshold"))
      s.buffers.param_persistence_threshold = kPersistenceAuto;
    else if (z.has("stage3_param_persistence_threshold"))
      s.buffers.param_persistence_threshold =
          z.byte_count("stage3_param_persistence_threshold", s.buffers.param_persistence_threshold);
    if (z.has("zero_hpz_partition_size") && !is_auto(*zo, "zero_hpz_partition_size"))
      s.hpz_partition_size = z.positive_int("zero_hpz_partition_size", 1);
    s.quantized_weights = z.boolean("zero_quantized_weights", s.quantized_weights);
    // zero_quantized_nontrainable_weights stores frozen parameters in int8
    // (partition_parameters.py): every parameter of a plan is trained, so it changes nothing.
    (void)z.boolean("zero_quantized_nontrainable_weights", false);
  }
  return s;
}

json to_json(const Strategy& s) {
  return {{"stage", s.stage},
          {"dp", s.dp},
          {"mp", s.mp},
          {"tp", s.mp},
          {"sp", s.sp},
          {"pp", s.pp},
          {"vp", s.vp},
          {"pp_schedule", to_string(s.pp_schedule)},
          {"cp", s.cp},
          {"cp_kind", to_string(s.cp_kind)},
          {"micro_batch", s.micro_batch},
          {"seq", s.seq},
          {"grad_accum", s.grad_accum},
          {"precision", to_string(s.precision)},
          {"optimizer", to_string(s.optimizer)},
          {"checkpointing", to_string(s.checkpointing)},
          {"flash_attention", s.flash_attention},
          {"offload_optimizer", to_string(s.offload_optimizer)},
          {"offload_param", to_string(s.offload_param)},
          {"dpu", s.dpu},
          {"partition_activations", s.partition_activations},
          {"cpu_checkpointing", s.cpu_checkpointing},
          {"contiguous_memory_optimization", s.contiguous_memory_optimization},
          {"number_checkpoints", s.number_checkpoints},
          {"ep", s.ep},
          {"moe_routing", to_string(s.moe_routing)},
          {"moe_capacity_factor", s.moe_capacity_factor},
          {"target_seq", s.target_seq},
          {"master_precision", to_string(s.master_precision)},
          {"optimizer_precision", to_string(s.optimizer_precision)},
          // null: the training precision
          {"grad_precision", s.grad_precision ? json(to_string(*s.grad_precision)) : json(nullptr)},
          {"reshard_after_forward", s.reshard_after_forward},
          {"reduce_precision", to_string(s.reduce_precision)},
          {"fused_optimizer", s.fused_optimizer},
          {"optimizer_impl", to_string(s.optimizer_impl)},
          {"fsdp_version", s.fsdp_version},
          {"fsdp_use_orig_params", s.fsdp_use_orig_params},
          // 0: all dp ranks; "node": a node's GPUs, settled by the hardware
          {"fsdp_shard_size", s.fsdp_shard_size == kFsdpShardNode ? json("node")
                                                                  : json(s.fsdp_shard_size)},
          // null: DeepSpeed's default for the stage (overlaps_comm)
          {"overlap_comm", s.overlap_comm ? json(*s.overlap_comm) : json(nullptr)},
          {"contiguous_gradients", s.contiguous_gradients},
          {"offload_optimizer_ratio", s.offload_optimizer_ratio},
          // null: the default (zero.Init at stage 3; the model loaded on the host)
          {"zero_init", s.zero_init ? json(*s.zero_init) : json(nullptr)},
          {"load_on_gpu", s.load_on_gpu ? json(to_string(*s.load_on_gpu)) : json(nullptr)},
          {"buffers",
           {{"reduce_bucket_size", s.buffers.reduce_bucket_size},
            {"allgather_bucket_size", s.buffers.allgather_bucket_size},
            {"stage3_prefetch_bucket_size", s.buffers.prefetch_bucket_size},
            {"stage3_max_live_parameters", s.buffers.max_live_parameters},
            {"optimizer_swap_chunk_size", s.buffers.optimizer_swap_chunk_size},
            {"optimizer_swap_buffer_count", s.buffers.optimizer_swap_buffer_count},
            {"offload_tile_size", s.buffers.offload_tile_size},
            {"param_swap_buffer_count", s.buffers.param_swap_buffer_count},
            {"param_swap_buffer_size", s.buffers.param_swap_buffer_size},
            {"param_swap_prefetch_depth", s.buffers.param_swap_prefetch_depth},
            {"sub_group_size", s.buffers.sub_group_size},
            // null: "auto" (10 x hidden size, as the Trainer sets it)
            {"stage3_param_persistence_threshold",
             s.buffers.param_persistence_threshold == kPersistenceAuto
                 ? json(nullptr)
                 : json(s.buffers.param_persistence_threshold)}}},
          {"hpz_partition_size", s.hpz_partition_size},
          {"quantized_weights", s.quantized_weights},
          {"deepspeed_version", deepspeed_version_string(s.deepspeed_version)},
          {"torch_version", torch_version_string(s.torch_version)},
          {"save_checkpoint", s.save_checkpoint}};
}

Strategy strategy_from_json(const json& j, const std::string& origin) {
  if (!j.is_object()) throw Error(fmt::format("{}: 'strategy' must be an object", origin));
  reject_unknown(j,
                 {"stage", "dp", "mp", "tp", "sp", "pp", "vp", "pp_schedule", "cp", "cp_kind", "micro_batch", "seq", "grad_accum", "precision",
                  "optimizer", "checkpointing", "flash_attention", "offload_optimizer",
                  "offload_param", "dpu", "partition_activations", "cpu_checkpointing",
                  "contiguous_memory_optimization", "number_checkpoints", "overlap_comm",
                  "contiguous_gradients", "offload_optimizer_ratio", "zero_init", "load_on_gpu",
                  "buffers",
                  "ep", "moe_routing", "moe_capacity_factor", "target_seq", "master_precision",
                  "optimizer_precision", "grad_precision", "reshard_after_forward", "reduce_precision",
                  "fused_optimizer", "optimizer_impl", "hpz_partition_size", "quantized_weights",
                  "deepspeed_version", "torch_version", "fsdp_version", "fsdp_use_orig_params",
                  "fsdp_shard_size", "save_checkpoint"},
                 origin, "strategy.");
  Fields f(j, origin, "strategy.");
  Strategy s;
  s.stage = static_cast<int>(f.nonneg_int("stage", 0));
  s.dp = f.positive_int("dp", 1);
  s.mp = f.positive_int("mp", 1);
  if (f.has("tp")) {  // "tp" and its older name "mp" (written both ways since tp existed)
    const int64_t tp = f.positive_int("tp", 1);
    if (f.has("mp") && tp != s.mp) f.fail("tp", fmt::format("the same value as 'mp' ({})", s.mp));
    s.mp = tp;
  }
  s.sp = f.boolean("sp", false);
  s.pp = f.positive_int("pp", 1);
  s.vp = f.positive_int("vp", 1);
  s.cp = f.positive_int("cp", 1);
  s.micro_batch = f.positive_int("micro_batch", 1);
  s.seq = f.nonneg_int("seq", 0);
  s.grad_accum = f.positive_int("grad_accum", 1);
  s.ep = f.positive_int("ep", 1);
  s.target_seq = f.nonneg_int("target_seq", 0);
  auto enum_field = [&](std::string_view key, auto parse, auto fallback, std::string_view expected) {
    if (!f.has(key)) return fallback;
    auto v = parse(f.string(key));
    if (!v) f.fail(key, expected);
    return *v;
  };
  s.precision = enum_field("precision", precision_from_string, s.precision,
                           "\"fp32\", \"fp16\" or \"bf16\"");
  s.optimizer = enum_field("optimizer", optimizer_from_string, s.optimizer,
                           "\"adam\", \"adamw\", \"sgd\", \"sgd-plain\", \"lion\", "
                           "\"adafactor\" or \"adam8bit\"");
  s.checkpointing = enum_field("checkpointing", checkpointing_from_string, s.checkpointing,
                               "\"none\", \"full\", \"selective\" or \"selective-op\"");
  s.offload_optimizer = enum_field("offload_optimizer", offload_from_string, s.offload_optimizer,
                                   "\"none\", \"cpu\" or \"nvme\"");
  s.offload_param = enum_field("offload_param", offload_from_string, s.offload_param,
                               "\"none\", \"cpu\" or \"nvme\"");
  s.moe_routing = enum_field("moe_routing", moe_routing_from_string, s.moe_routing,
                             "\"balanced\" or \"worst\"");
  s.cp_kind = enum_field("cp_kind", cp_kind_from_string, s.cp_kind, "\"ring\" or \"ulysses\"");
  // Unsaid, the schedule is Megatron's choice: interleaved with virtual stages, else 1F1B.
  if (s.vp > 1) s.pp_schedule = PipelineSchedule::interleaved;
  s.pp_schedule = enum_field("pp_schedule", pipeline_schedule_from_string, s.pp_schedule,
                             "\"gpipe\", \"1f1b\" or \"interleaved\"");
  s.master_precision = enum_field("master_precision", precision_from_string, s.master_precision,
                                  "\"fp32\" or \"bf16\"");
  s.optimizer_precision = enum_field("optimizer_precision", precision_from_string,
                                     s.optimizer_precision, "\"fp32\" or \"bf16\"");
  if (f.has("grad_precision") && !j.at("grad_precision").is_null())
    s.grad_precision = enum_field("grad_precision", precision_from_string, s.precision,
                                  "null, \"fp32\", \"fp16\" or \"bf16\"");
  s.reduce_precision = enum_field("reduce_precision", precision_from_string, s.reduce_precision,
                                  "\"fp32\" or \"bf16\"");
  s.reshard_after_forward = f.boolean("reshard_after_forward", true);
  s.fused_optimizer = f.boolean("fused_optimizer", false);
  s.optimizer_impl = enum_field("optimizer_impl", optimizer_impl_from_string, s.optimizer_impl,
                                "\"foreach\", \"fused\", \"for-loop\" or \"transformers\"");
  if (s.optimizer_impl == OptimizerImpl::fused) s.fused_optimizer = true;
  s.fsdp_version = static_cast<int>(f.positive_int("fsdp_version", 2));
  s.fsdp_use_orig_params = f.boolean("fsdp_use_orig_params", false);
  if (f.has("fsdp_shard_size") && j.at("fsdp_shard_size") == "node")
    s.fsdp_shard_size = kFsdpShardNode;
  else
    s.fsdp_shard_size = f.nonneg_int("fsdp_shard_size", 0);
  if (f.has("moe_capacity_factor")) {
    const json& v = j.at("moe_capacity_factor");
    if (!v.is_number() || !(v.get<double>() >= 0) || !std::isfinite(v.get<double>()))
      f.fail("moe_capacity_factor", "a number >= 0 (0: dropless)");
    s.moe_capacity_factor = v.get<double>();
  }
  s.flash_attention = f.boolean("flash_attention", false);
  s.dpu = f.boolean("dpu", false);
  s.save_checkpoint = f.boolean("save_checkpoint", false);
  s.partition_activations = f.boolean("partition_activations", false);
  s.cpu_checkpointing = f.boolean("cpu_checkpointing", false);
  s.contiguous_memory_optimization = f.boolean("contiguous_memory_optimization", false);
  s.number_checkpoints = f.nonneg_int("number_checkpoints", 0);
  if (f.has("overlap_comm") && !j.at("overlap_comm").is_null())
    s.overlap_comm = f.boolean("overlap_comm", false);
  s.contiguous_gradients = f.boolean("contiguous_gradients", true);
  s.offload_optimizer_ratio = f.probability("offload_optimizer_ratio", 1.0);
  if (f.has("zero_init") && !j.at("zero_init").is_null()) s.zero_init = f.boolean("zero_init", true);
  if (f.has("load_on_gpu") && !j.at("load_on_gpu").is_null())
    s.load_on_gpu = enum_field("load_on_gpu", precision_from_string, Precision::fp32,
                               "\"fp32\", \"fp16\" or \"bf16\"");
  if (const json* b = f.object("buffers")) {
    reject_unknown(
        *b,
        {"reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
         "stage3_max_live_parameters", "optimizer_swap_chunk_size", "optimizer_swap_buffer_count",
         "offload_tile_size", "param_swap_buffer_count", "param_swap_buffer_size", "param_swap_prefetch_depth",
         "sub_group_size", "stage3_param_persistence_threshold"},
        origin, "strategy.buffers.");
    Fields bf(*b, origin, "strategy.buffers.");
    s.buffers.reduce_bucket_size = bf.byte_count("reduce_bucket_size", s.buffers.reduce_bucket_size);
    s.buffers.allgather_bucket_size =
        bf.byte_count("allgather_bucket_size", s.buffers.allgather_bucket_size);
    s.buffers.prefetch_bucket_size =
        bf.byte_count("stage3_prefetch_bucket_size", s.buffers.prefetch_bucket_size);
    s.buffers.max_live_parameters =
        bf.byte_count("stage3_max_live_parameters", s.buffers.max_live_parameters);
    s.buffers.optimizer_swap_chunk_size =
        bf.byte_count("optimizer_swap_chunk_size", s.buffers.optimizer_swap_chunk_size);
    s.buffers.optimizer_swap_buffer_count =
        bf.byte_count("optimizer_swap_buffer_count", s.buffers.optimizer_swap_buffer_count);
    s.buffers.offload_tile_size = bf.byte_count("offload_tile_size", s.buffers.offload_tile_size);
    s.buffers.param_swap_buffer_count =
        bf.byte_count("param_swap_buffer_count", s.buffers.param_swap_buffer_count);
    s.buffers.param_swap_buffer_size =
        bf.byte_count("param_swap_buffer_size", s.buffers.param_swap_buffer_size);
    s.buffers.param_swap_prefetch_depth =
        bf.byte_count("param_swap_prefetch_depth", s.buffers.param_swap_prefetch_depth);
    s.buffers.sub_group_size = bf.byte_count("sub_group_size", s.buffers.sub_group_size);
    if (bf.has("stage3_param_persistence_threshold"))
      s.buffers.param_persistence_threshold =
          bf.byte_count("stage3_param_persistence_threshold", s.buffers.param_persistence_threshold);
    else if (b->contains("stage3_param_persistence_threshold"))  // null: "auto"
      s.buffers.param_persistence_threshold = kPersistenceAuto;
  }
  s.hpz_partition_size = f.positive_int("hpz_partition_size", 1);
  s.quantized_weights = f.boolean("quantized_weights", false);
  if (f.has("deepspeed_version")) {
    const auto v = deepspeed_version_from_string(f.string("deepspeed_version"));
    if (!v) f.fail("deepspeed_version", "\"current\" or a release such as \"0.4.0\"");
    s.deepspeed_version = *v;
  }
  if (f.has("torch_version")) {
    const auto v = torch_version_from_string(f.string("torch_version"));
    if (!v) f.fail("torch_version", "\"current\" or a release such as \"1.10\"");
    s.torch_version = *v;
  }
  validate(s);
  return s;
}

std::string describe(const Strategy& s) {
  std::string out = fmt::format("stage {}, dp {}, {}, {}, B={}", s.stage, s.dp,
                                to_string(s.precision), to_string(s.optimizer), s.micro_batch);
  if (s.seq > 0) out += fmt::format(" T={}", s.seq);
  if (s.grad_accum > 1) out += fmt::format(", grad-accum {}", s.grad_accum);
  if (s.mp > 1) out += fmt::format(", tp {}", s.mp);
  if (s.sp && s.mp > 1) out += ", sp";
  if (s.pp > 1) out += fmt::format(", pp {}", s.pp);
  if (s.vp > 1) out += fmt::format(" x vp {}", s.vp);
  if (s.pp > 1) out += fmt::format(" ({})", to_string(s.pp_schedule));
  if (s.cp > 1) out += fmt::format(", cp {} ({})", s.cp, to_string(s.cp_kind));
  if (s.ep > 1) out += fmt::format(", ep {}", s.ep);
  if (s.moe_routing == MoeRouting::worst) out += ", worst-case routing";
  if (s.moe_capacity_factor > 0) out += fmt::format(", capacity factor {}", s.moe_capacity_factor);
  if (s.target_seq > 0 && s.target_seq != s.seq) out += fmt::format(", target T={}", s.target_seq);
  if (s.checkpointing != Checkpointing::none)
    out += fmt::format(", checkpointing {}", to_string(s.checkpointing));
  if (s.flash_attention) out += ", flash-attention";
  if (s.offload_optimizer != Offload::none)
    out += fmt::format(", offload optimizer={}", to_string(s.offload_optimizer));
  if (s.offload_optimizer_ratio < 1)
    out += fmt::format(" (ratio {})", s.offload_optimizer_ratio);
  if (s.offload_param != Offload::none)
    out += fmt::format(", offload params={}", to_string(s.offload_param));
  if (s.dpu) out += ", dpu";
  if (s.fsdp_version == 1) out += s.fsdp_use_orig_params ? ", FSDP1 use_orig_params" : ", FSDP1";
  if (s.fsdp_shard_size == kFsdpShardNode) out += ", hybrid shard over a node";
  else if (s.fsdp_shard_size > 0 && s.fsdp_shard_size < s.dp)
    out += fmt::format(", hybrid shard {} x {}", s.fsdp_shard_size, s.dp / s.fsdp_shard_size);
  if (s.master_precision != Precision::fp32) out += fmt::format(", {} master", to_string(s.master_precision));
  if (s.optimizer_precision != Precision::fp32)
    out += fmt::format(", {} moments", to_string(s.optimizer_precision));
  if (s.grad_precision && *s.grad_precision != s.precision)
    out += fmt::format(", {} grads", to_string(*s.grad_precision));
  if (s.partition_activations) out += s.cpu_checkpointing ? ", P_a+cpu" : ", P_a";
  if (s.contiguous_memory_optimization)
    out += fmt::format(", contiguous checkpoints ({})", s.number_checkpoints);
  if (s.optimizer_impl == OptimizerImpl::for_loop || s.optimizer_impl == OptimizerImpl::transformers)
    out += fmt::format(", {} optimizer", to_string(s.optimizer_impl));
  if (s.torch_version != 0) out += fmt::format(", torch {}", torch_version_string(s.torch_version));
  if (s.overlap_comm && *s.overlap_comm != default_overlap_comm(s.stage))  // only when not the default
    out += *s.overlap_comm ? ", overlap-comm" : ", no overlap-comm";
  if (!s.contiguous_gradients) out += ", no contiguous gradients";
  if (s.stage == 3 && !builds_partitioned(s)) out += ", no zero.Init";
  if (s.quantized_weights) out += ", qwZ";
  if (s.load_on_gpu) out += fmt::format(", loaded on the GPU in {}", to_string(*s.load_on_gpu));
  return out;
}

}  // namespace zp::planner
