// schedule.cpp: the step's memory schedule (model states, ZeRO buffers, graph tensors by
// liveness) and its replay through the allocator models.
#include "zp/planner/schedule.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/checked.hpp"
#include "zp/error.hpp"
#include "zp/planner/allocator.hpp"
#include "zp/planner/model_states.hpp"

namespace zp::planner {

using models::Op;
using models::Phase;
using models::Tensor;
using models::TensorId;
using models::TensorKind;
using models::TrainingGraph;

std::string_view to_string(Profile p) {
  switch (p) {
    case Profile::zeroplan: return "zeroplan";
    case Profile::deepspeed: return "deepspeed";
    case Profile::fsdp: return "fsdp";
    case Profile::pytorch: return "pytorch";
  }
  return "zeroplan";
}
std::string_view to_string(Backend b) { return b == Backend::cpu ? "cpu" : "cuda"; }
std::optional<Profile> profile_from_string(std::string_view s) {
  if (s == "zeroplan") return Profile::zeroplan;
  if (s == "deepspeed") return Profile::deepspeed;
  if (s == "fsdp") return Profile::fsdp;
  if (s == "pytorch") return Profile::pytorch;
  return std::nullopt;
}
std::string_view to_string(ModelCode c) { return c == ModelCode::fused ? "fused" : "transformers"; }
std::optional<ModelCode> model_code_from_string(std::string_view s) {
  if (s == "fused") return ModelCode::fused;
  if (s == "transformers") return ModelCode::transformers;
  return std::nullopt;
}
std::optional<Backend> backend_from_string(std::string_view s) {
  if (s == "cpu") return Backend::cpu;
  if (s == "cuda") return Backend::cuda;
  return std::nullopt;
}

models::GraphOptions graph_options(const models::ModelSpec& m, const Strategy& s,
                                   const PlanOptions& o) {
  models::GraphOptions g;
  g.batch = s.micro_batch;
  g.seq = s.seq > 0 ? s.seq : m.n_positions;
  // The CPU backend computes and stores activations in fp32; on GPUs activations are in the
  // training precision.
  g.act_bytes = (o.backend == Backend::cpu || s.precision == Precision::fp32) ? 4 : 2;
  // zero-run's CPU kernels have no dropout; plans for the CPU backend leave it out.
  g.dropout = o.backend == Backend::cuda;
  switch (s.checkpointing) {
    case Checkpointing::none: g.recompute = models::Recompute::none; break;
    case Checkpointing::full: g.recompute = models::Recompute::full; break;
    case Checkpointing::selective: g.recompute = models::Recompute::selective; break;
    case Checkpointing::selective_op: g.recompute = models::Recompute::selective_op; break;
  }
  g.flash_attention = s.flash_attention;
  g.tp = s.mp;
  g.pp = s.pp;  // the stage: pp_stage, 0 here; estimate() builds each stage's graph
  g.pp_chunks = s.vp;
  g.sp = s.sp;
  g.cp = s.cp;
  g.cp_ulysses = s.cp_kind == CpKind::ulysses;
  // Mixture of experts: E/ep routed experts per rank, the routed rows sized for the routing
  // the strategy asks for; encoder-decoder models: the decoder's length.
  g.ep = s.ep;
  g.moe_worst_case = s.moe_routing == MoeRouting::worst;
  g.moe_capacity_factor = s.moe_capacity_factor;
  g.seq_target = s.target_seq;
  g.partition_checkpoints = s.partition_activations;
  g.param_bytes = s.precision == Precision::fp32 ? 4 : 2;
  // zero-run's CPU kernels compute in fp32: 16-bit weights are converted per op (OpenBLAS
  // SGEMM has no 16-bit inputs); cuBLAS takes 16-bit inputs directly.
  g.f32_weight_scratch = o.backend == Backend::cpu;
  g.hf_modeling = o.model_code == ModelCode::transformers;
  // Plain PyTorch in 16 bits on fp32 weights is autocast (the Trainer's --fp16/--bf16): the
  // weights stay fp32 (model_states.hpp: master 4, grads 4, moments 8 bytes) and each op
  // computes in the dtype autocast gives it.
  g.autocast = o.profile == Profile::pytorch && o.backend == Backend::cuda &&
               s.precision != Precision::fp32 && !weights_in_compute_dtype(s);
  // PyTorch before 1.11 (strategy.hpp torch_version); zero-run's kernels keep what they keep.
  g.softmax_keeps_input = o.profile != Profile::zeroplan && s.torch_version != 0 &&
                          s.torch_version < 111;
  return g;
}

std::string describe_compute(const models::ModelSpec& m, const Strategy& s, const PlanOptions& o) {
  const models::GraphOptions g = graph_options(m, s, o);
  const bool dropout = g.dropout && (m.embd_dropout > 0 || m.attn_dropout > 0 || m.resid_dropout > 0);
  return fmt::format("{} activations{}{}", g.act_bytes == 4 ? "fp32" : to_string(s.precision),
                     g.autocast ? " (autocast on fp32 weights)" : "", dropout ? ", dropout" : "");
}

uint64_t partition_elems(const std::vector<uint64_t>& group_elems, int stage, uint64_t dp) {
  if (stage == 0) return 0;
  uint64_t n = 0;
  if (stage < 3) {
    for (uint64_t e : group_elems) n = checked_add(n, e, "parameters");
    return zp::partition_elems(n, dp);
  }
  for (uint64_t e : group_elems) n = checked_add(n, zp::partition_elems(e, dp), "partition");
  return n;
}

uint64_t partition_elems(const std::vector<uint64_t>& group_elems,
                         const std::vector<uint64_t>& expert_elems, int stage, uint64_t dp,
                         uint64_t edp) {
  if (stage == 0) return 0;
  if (expert_elems.size() != group_elems.size())
    throw Error("partition_elems: one expert count per group expected");
  uint64_t dense = 0, expert = 0, n = 0;
  for (std::size_t i = 0; i < group_elems.size(); ++i) {
    if (expert_elems[i] > group_elems[i])
      throw Error("partition_elems: a group has more expert elements than elements");
    const uint64_t d = group_elems[i] - expert_elems[i];
    if (stage < 3) {
      dense = checked_add(dense, d, "parameters");
      expert = checked_add(expert, expert_elems[i], "parameters");
    } else {
      n = checked_add(n, zp::partition_elems(d, dp), "partition");
      n = checked_add(n, zp::partition_elems(expert_elems[i], edp), "partition");
    }
  }
  if (stage < 3)
    n = checked_add(zp::partition_elems(dense, dp), zp::partition_elems(expert, edp), "partition");
  return n;
}

bool is_expert_tensor(const models::Tensor& t) {
  return t.name.find(".moe.experts.") != std::string::npos;
}

uint64_t swap_file_bytes(uint64_t bytes) {
  return checked_mul((bytes + kSwapBlockBytes - 1) / kSwapBlockBytes, kSwapBlockBytes,
                     "swap file bytes");
}

uint64_t optimizer_swap_chunk_elems(const Strategy& s, uint64_t partition_elems) {
  const uint64_t block_elems = kSwapBlockBytes / 4;
  const uint64_t whole = (partition_elems + block_elems - 1) / block_elems * block_elems;
  return std::max(block_elems, std::min(s.buffers.optimizer_swap_chunk_size, whole));
}

uint64_t optimizer_swap_files(const Strategy& s) {
  switch (s.optimizer) {
    case OptimizerKind::adam:
    case OptimizerKind::adamw:
    case OptimizerKind::adam8bit: return 3;  // master, exp_avg, exp_avg_sq
    case OptimizerKind::sgd:
    case OptimizerKind::lion:
    case OptimizerKind::adafactor: return 2;  // master and one moment buffer
    case OptimizerKind::sgd_plain: return 1;  // master
  }
  return 3;
}

uint64_t optimizer_swap_buffer_bytes(const Strategy& s, uint64_t partition_elems) {
  const uint64_t chunk = checked_mul(optimizer_swap_chunk_elems(s, partition_elems), 4, "swap chunk");
  const uint64_t sets = checked_mul(s.buffers.optimizer_swap_buffer_count, optimizer_swap_files(s),
                                    "swap buffers");
  return checked_add(checked_mul(sets, chunk, "swap buffer bytes"), kSwapBlockBytes - kArenaAlignment,
                     "swap buffer bytes");
}

uint64_t param_swap_buffer_elems(const Strategy& s, uint64_t partition_elems,
                                 uint32_t param_bytes) {
  const uint64_t block_elems = kSwapBlockBytes / param_bytes;
  const uint64_t whole = (partition_elems + block_elems - 1) / block_elems * block_elems;
  return std::max<uint64_t>(1, std::min(s.buffers.param_swap_buffer_size, whole));
}

uint64_t param_swap_buffer_capacity(const Strategy& s, uint64_t partition_elems,
                                    uint32_t param_bytes) {
  const uint64_t bytes = checked_mul(param_swap_buffer_elems(s, partition_elems, param_bytes),
                                     param_bytes, "param swap buffer bytes");
  return checked_add(swap_file_bytes(bytes), kSwapBlockBytes, "param swap buffer bytes");
}

uint64_t param_swap_buffer_bytes(const Strategy& s, uint64_t partition_elems,
                                 uint32_t param_bytes) {
  return checked_add(checked_mul(s.buffers.param_swap_buffer_count,
                                 param_swap_buffer_capacity(s, partition_elems, param_bytes),
                                 "param swap buffer bytes"),
                     kSwapBlockBytes - kArenaAlignment, "param swap buffer bytes");
}

uint64_t checkpoint_chunk_elems(uint64_t held_elems) {
  const uint64_t block = kSwapBlockBytes;  // elements: a block of any state's swap file
  const uint64_t whole = checked_mul((std::max<uint64_t>(held_elems, 1) + block - 1) / block, block,
                                     "checkpoint chunk elements");
  return std::min(kCheckpointChunkElems, whole);
}

uint64_t checkpoint_staging_bytes(uint64_t held_elems) {
  return checked_add(checked_mul(checkpoint_chunk_elems(held_elems), 4, "checkpoint staging bytes"),
                     kSwapBlockBytes - kArenaAlignment, "checkpoint staging bytes");
}

CheckpointCost checkpoint_cost(const Strategy& s, uint64_t n_params, uint64_t partition_elems,
                               uint32_t param_bytes) {
  const bool mixed = s.precision != Precision::fp32;
  const bool offload = s.offload_optimizer != Offload::none;
  CheckpointCost c;
  c.bytes_per_element = param_bytes;                       // the parameters
  if (mixed || offload) c.bytes_per_element += 4;          // fp32 master weights
  c.bytes_per_element += 4 * (optimizer_swap_files(s) - 1);  // the moments (fp32)
  if (s.dpu && offload && (mixed || s.offload_optimizer == Offload::nvme))
    c.bytes_per_element += param_bytes;  // the delayed update's parameters, when in flight
  const uint64_t held = s.stage == 0 ? n_params : partition_elems;
  c.writers = s.stage == 0 ? 1 : static_cast<int>(zero_dp(s));
  c.rank_bytes = checked_mul(held, c.bytes_per_element, "checkpoint bytes per rank");
  c.total_bytes = checked_mul(n_params, c.bytes_per_element, "checkpoint bytes");
  c.staging_bytes = checkpoint_staging_bytes(held);
  return c;
}

namespace {

Category category_of(TensorKind k) {
  switch (k) {
    case TensorKind::workspace: return Category::workspace;
    case TensorKind::logits:
    case TensorKind::input: return Category::buffers;
    default: return Category::activations;
  }
}

using models::is_dynamic;

}  // namespace

// A parameter tensor's shape on this rank: split by tensor parallelism, E/ep of fused experts.
static std::vector<int64_t> rank_shape(const models::ParamTensor& p, const models::GraphOptions& go) {
  std::vector<int64_t> shape = p.shape;  // as torch stores it: (out, in) for a Linear
  if (shape.empty()) return shape;
  const int64_t tp = go.tp;
  const std::size_t nd = shape.size();
  switch (p.split) {  // tensor parallelism (graph.cpp rank_numel)
    case models::Split::replicated: break;
    case models::Split::column: shape[nd >= 2 ? nd - 2 : 0] /= tp; break;
    case models::Split::row:
      if (nd >= 2) shape[nd - 1] /= tp;
      break;
    case models::Split::vocab: shape[0] = (shape[0] + tp - 1) / tp; break;
  }
  // Routed experts, E/ep on this rank: fused tensors ("moe.experts.*", dim 0 is E) lose rows;
  // per-expert ones ("moe.expert.*") are listed for all E experts (callers divide by ep).
  if (p.expert && p.slot.starts_with("moe.experts.")) shape[0] /= go.ep;
  return shape;
}

std::string fsdp_unit_of(const std::string& group, const Strategy& s) {
  if (s.fsdp_version == 1 && (group == "embed" || group == "head")) return "root";
  return group;
}

std::map<std::string, FsdpUnit> fsdp_units(const TrainingGraph& g, const Strategy& s) {
  const uint64_t w = static_cast<uint64_t>(fsdp_shard_world(s));
  // FSDP1's alignment (use_orig_params): 16 bytes of the unsharded (compute) dtype.
  const uint64_t align = s.fsdp_version == 1 && s.fsdp_use_orig_params ? 16 / g.options.param_bytes : 0;
  const int L = static_cast<int>(g.model.n_blocks());
  std::map<std::string, uint64_t> group_elems;  // the graph's, to check the inventory against
  for (const Tensor& t : g.tensors)
    if (t.kind == TensorKind::param)
      group_elems[t.group] = checked_add(group_elems[t.group], t.bytes / t.elem_bytes, "parameters");
  std::map<std::string, uint64_t> listed;
  std::map<std::string, FsdpUnit> units;
  for (const models::ParamTensor& p : models::count_params(g.model).tensors) {
    std::vector<int64_t> shape = rank_shape(p, g.options);
    uint64_t n = 1;
    for (int64_t d : shape) n = checked_mul(n, static_cast<uint64_t>(d), "parameter elements");
    const std::string grp = p.layer < 0 ? "embed" : p.layer >= L ? "head" : fmt::format("h.{}", p.layer);
    listed[grp] = checked_add(listed[grp], n, "parameters");
    FsdpUnit& u = units[fsdp_unit_of(grp, s)];
    u.elems = checked_add(u.elems, n, "parameters");
    if (s.fsdp_version == 2) {
      // torch.chunk(param, W, dim=0), every rank padded to chunk 0: ceil(d0/W) rows.
      const uint64_t d0 = shape.empty() ? 1 : static_cast<uint64_t>(shape[0]);
      const uint64_t rows = (d0 + w - 1) / w;
      const uint64_t sp = checked_mul(rows, d0 == 0 ? 0 : n / d0, "shard elements");
      u.shard = checked_add(u.shard, sp, "shard elements");
      u.largest = std::max(u.largest, sp);
    } else {
      // The parameter starts at a multiple of `align` elements of the flat parameter.
      if (align > 0) u.flat = (u.flat + align - 1) / align * align;
      u.flat = checked_add(u.flat, n, "flat parameter elements");
    }
  }
  for (const auto& [grp, n] : listed)
    if (!group_elems.contains(grp) && n > 0)
      throw Error(fmt::format("fsdp: the parameter inventory lists {} elements for unit {}, which "
                              "the graph lacks (an internal error)", n, grp));
  for (const auto& [grp, n] : group_elems)
    if (listed[grp] != n)
      throw Error(fmt::format("fsdp: the parameter inventory lists {} elements for unit {}, the "
                              "graph {} (an internal error)", listed[grp], grp, n));
  for (auto& [name, u] : units) {
    if (s.fsdp_version == 2) {
      u.flat = checked_mul(u.shard, w, "unsharded elements");
      continue;
    }
    // Aligned, the flat parameter is padded to a multiple of W (_init_flat_param_and_metadata);
    // otherwise its shards are (_get_shard's F.pad): ceil(N/W) elements either way.
    if (align > 0) u.flat = (u.flat + w - 1) / w * w;
    u.shard = (u.flat + w - 1) / w;
    u.largest = u.shard;
  }
  return units;
}

std::optional<uint64_t> per_tensor_optimizer_bytes(const TrainingGraph& g, const Strategy& s,
                                                   const PlanOptions& o) {
  const bool fsdp = o.profile == Profile::fsdp;
  // Plain PyTorch: the optimizer sees the model's tensors whole, their moments in their dtype.
  const bool whole_tensors = o.profile == Profile::pytorch;
  const bool shaped = s.optimizer == OptimizerKind::adafactor || s.optimizer == OptimizerKind::adam8bit;
  if (!shaped || (!fsdp && s.stage >= 1)) return std::nullopt;
  if (fsdp && s.optimizer == OptimizerKind::adam8bit && s.fsdp_version == 2)
    throw Error("--optimizer adam8bit: bitsandbytes' 8-bit optimizers do not run on FSDP2's "
                "sharded (DTensor) parameters (bitsandbytes issue #1633)",
                "plan 8-bit Adam with --profile deepspeed (ZeRO hands it flat partitions), or "
                "FSDP with --optimizer adamw");
  if (fsdp && s.optimizer == OptimizerKind::adam8bit && s.fsdp_use_orig_params)
    throw Error("--optimizer adam8bit with FSDP1's use_orig_params: the optimizer is handed each "
                "rank's pieces of the parameters, which differ from rank to rank",
                "plan it without --fsdp-use-orig-params (one flat shard per unit)");
  // The moments' dtype: fp32 or --optimizer-states bf16; under fsdp the sharded parameters'.
  const bool pure = weights_in_compute_dtype(s);
  const uint64_t m = fsdp || whole_tensors ? (pure ? g.options.param_bytes : 4)
                                           : (s.optimizer_precision == Precision::bf16 ? 2 : 4);
  // FSDP1: the optimizer is handed one 1-D flat shard per unit (use_orig_params=False; with
  // it, 1-D views of the parameters' pieces in that shard, as many elements less padding).
  if (fsdp && s.fsdp_version == 1) {
    uint64_t b = 0;
    for (const auto& [name, u] : fsdp_units(g, s)) {
      const int64_t shape[] = {static_cast<int64_t>(u.shard)};
      b = checked_add(b, optimizer_state_bytes(s.optimizer, shape, m), "optimizer state bytes");
    }
    return b;
  }
  const int64_t ep = g.options.ep, w = fsdp ? fsdp_shard_world(s) : zero_dp(s);
  uint64_t whole = 0, per_expert = 0;  // per_expert: every routed expert's own tensors
  for (const models::ParamTensor& p : models::count_params(g.model).tensors) {
    std::vector<int64_t> shape = rank_shape(p, g.options);
    if (shape.empty()) continue;
    const bool fused = p.slot.starts_with("moe.experts.");
    if (fsdp) shape[0] = (shape[0] + w - 1) / w;  // FSDP2's dim-0 shard, padded
    const uint64_t b = optimizer_state_bytes(s.optimizer, shape, m);
    if (p.expert && !fused) per_expert = checked_add(per_expert, b, "optimizer state bytes");
    else whole = checked_add(whole, b, "optimizer state bytes");
  }
  return checked_add(whole, per_expert / static_cast<uint64_t>(ep), "optimizer state bytes");
}

// Persistent model states, allocated before the first op, in the order the runtime
// allocates them: params, grads, master, optimizer moments; per tier.
void append_model_states(MemorySchedule& out, uint64_t n_params, uint64_t part,
                         const Strategy& s, uint32_t param_bytes, StateLayout layout,
                         std::optional<uint64_t> optimizer_bytes, uint64_t gpu_step_elems) {
  auto alloc = [&](int32_t pos, uint32_t b) { out.events.push_back({pos, true, b}); };
  auto add_buffer = [&](std::string name, Tier t, Category c, uint64_t bytes) {
    out.buffers.push_back({std::move(name), t, c, bytes, -1});
    return static_cast<uint32_t>(out.buffers.size() - 1);
  };
  const PerDevice d = model_state_bytes(n_params, part, s, layout, optimizer_bytes, gpu_step_elems);
  for (Tier t : kTiers) {
    // On the nvme tier every state is one swap file, padded to whole O_DIRECT blocks.
    auto state = [&](const char* name, Category c, uint64_t bytes) {
      if (bytes > 0)
        alloc(-1, add_buffer(name, t, c, t == Tier::nvme ? swap_file_bytes(bytes) : bytes));
    };
    state("params", Category::params, d[t][Category::params]);
    state("grads", Category::grads, d[t][Category::grads]);
    state("master", Category::master, d[t][Category::master]);
    const uint64_t opt = d[t][Category::optimizer];
    switch (s.optimizer) {
      case OptimizerKind::adam:
      case OptimizerKind::adamw:
      case OptimizerKind::adam8bit:  // state1 + absmax1, state2 + absmax2: equal halves
        state("exp_avg", Category::optimizer, opt / 2);
        state("exp_avg_sq", Category::optimizer, opt - opt / 2);
        break;
      case OptimizerKind::sgd: state("momentum", Category::optimizer, opt); break;
      case OptimizerKind::lion: state("exp_avg", Category::optimizer, opt); break;
      case OptimizerKind::adafactor: state("exp_avg_sq", Category::optimizer, opt); break;
      case OptimizerKind::sgd_plain: break;  // no state
    }
  }
  // The delayed parameter update (ZeRO-Offload paper sec. 5.2): the CPU step of step i reads
  // its fp32 gradient partition while step i+1's backward fills a second one, and writes the
  // new 16-bit parameters into a host copy of the partition that is copied to the device
  // once step i+1's backward is done (zeroplan's double buffering; the paper's schedule).
  // With the optimizer on NVMe the copy is kept in fp32 training too (the master weights it
  // would otherwise be copied from are in the swap file), and the CPU step's swap buffers
  // (optimizer_swap_buffer_bytes) are held for the run: the step runs on its own thread,
  // which never calls the allocator.
  if (s.dpu && s.offload_optimizer != Offload::none) {
    alloc(-1, add_buffer("grads.dpu", Tier::cpu, Category::grads,
                         checked_mul(4, part, "bytes of the second fp32 gradient partition")));
    if (s.precision != Precision::fp32 || s.offload_optimizer == Offload::nvme)
      alloc(-1, add_buffer("params.dpu", Tier::cpu, Category::params,
                           checked_mul(param_bytes, part, "bytes of the host parameter copy")));
    if (s.offload_optimizer == Offload::nvme)
      alloc(-1, add_buffer("swap_buffers", Tier::cpu, Category::buffers,
                           optimizer_swap_buffer_bytes(s, part)));
  }
  // ZeRO-Infinity's parameter swapper holds its host buffers for the whole run (DeepSpeed's
  // AsyncPartitionedParameterSwapper allocates buffer_count x buffer_size at start).
  if (s.offload_param == Offload::nvme && s.stage == 3)
    alloc(-1, add_buffer("param_swap_buffers", Tier::cpu, Category::buffers,
                         param_swap_buffer_bytes(s, part, param_bytes)));
}

void append_offload_buffers(MemorySchedule& out, int32_t pos, const Strategy& s,
                            uint64_t partition_elems, uint32_t param_bytes) {
  auto add = [&](const char* name, uint64_t bytes) {
    out.buffers.push_back({name, Tier::cpu, Category::buffers, bytes, -1});
    const auto b = static_cast<uint32_t>(out.buffers.size() - 1);
    out.events.push_back({pos, true, b});
    return b;
  };
  auto free = [&](uint32_t b) { out.events.push_back({pos, false, b}); };
  uint32_t swap = UINT32_MAX;
  if (s.offload_optimizer == Offload::nvme && !s.dpu)
    swap = add("swap_buffers", optimizer_swap_buffer_bytes(s, partition_elems));
  if (const uint64_t tile = offload_tile_bytes(s, partition_elems, param_bytes); tile > 0) {
    const uint32_t a = add("param_tile.0", tile);
    const uint32_t b = add("param_tile.1", tile);
    free(a);
    free(b);
  }
  if (swap != UINT32_MAX) free(swap);
}

uint64_t offload_tile_bytes(const Strategy& s, uint64_t partition_elems, uint32_t param_bytes) {
  if (s.offload_optimizer == Offload::none || s.dpu || s.precision == Precision::fp32) return 0;
  // On NVMe the tiles hold one swap chunk each (the pipeline updates a chunk at a time).
  const uint64_t elems = s.offload_optimizer == Offload::nvme
                             ? optimizer_swap_chunk_elems(s, partition_elems)
                             : s.buffers.offload_tile_size;
  return checked_mul(std::min(elems, partition_elems), param_bytes, "bytes of a parameter tile");
}

namespace {

class ScheduleBuilder {
 public:
  ScheduleBuilder(const TrainingGraph& g, const Strategy& s, const PlanOptions& o, MemorySchedule& out)
      : g_(g), s_(s), o_(o), out_(out) {
    p_bytes_ = g.options.param_bytes;
    dp_ = static_cast<uint64_t>(zero_dp(s));  // with context parallelism, dp x cp
    edp_ = static_cast<uint64_t>(expert_dp(s));
  }

  void build() {
    groups();
    model_states();
    const int32_t n = static_cast<int32_t>(g_.order.size());
    liveness();
    if (s_.stage == 3) gather_runs();
    int32_t last_bwd = -1;
    for (int32_t i = 0; i < n; ++i)
      if (op_at(i).phase == Phase::backward) last_bwd = i;
    // Pipeline parallelism: while this micro-batch runs its forward and backward through the
    // stage's vp chunks, the stage holds the saved activations of the other (micro-batch,
    // chunk) pairs in flight (pipeline_in_flight: k pairs in all, this micro-batch's vp
    // among them), each what one chunk's forward leaves for its backward: this stage's graph
    // (one micro-batch through its vp chunks) saves summarize_activations' saved_total, a
    // chunk's share 1/vp of it (the chunks hold equal blocks; the embedding's and the head's
    // few tensors are spread over them, Megatron's accounting does the same with its
    // interleaving penalty). One buffer for them, from before the first op to the end of the
    // backward: the stage's peak is then the in-flight pairs' activations beside this
    // micro-batch's own peak, as in 1F1B's steady state (Megatron's theoretical_memory_usage.py
    // compute_activation_memory multiplies one micro-batch's activations by the in-flight
    // count likewise).
    uint32_t in_flight = UINT32_MAX;
    if (s_.pp > 1) {
      const uint64_t k = static_cast<uint64_t>(pipeline_in_flight(s_, g_.options.pp_stage));
      const uint64_t v = static_cast<uint64_t>(s_.vp);
      const uint64_t saved = summarize_activations(g_).saved_total;
      if (k > v)
        in_flight = alloc(-1, add_buffer("pp.in_flight", Tier::gpu, Category::activations,
                                         checked_mul(saved / v, k - v, "in-flight activation bytes")));
    }

    // DeepSpeed stage 1 after earlier micro-steps: their first hook allocated the ipg buffers.
    if (deepspeed_grads() && s_.stage == 1 && s_.grad_accum > 1 && contiguous() && n > 0)
      deepspeed_setup_buckets(0);
    for (int32_t i = 0; i < n; ++i) {
      const Op& op = op_at(i);
      out_.op_names.push_back(op.name);
      if (s_.stage == 3 && run_at_[static_cast<std::size_t>(i)] >= 0 &&
          run_start_[static_cast<std::size_t>(run_at_[static_cast<std::size_t>(i)])] == i) {
        if (fsdp()) fsdp_start_run(i, run_at_[static_cast<std::size_t>(i)]);
        else start_run(i, run_at_[static_cast<std::size_t>(i)]);
      }
      // Allocate what this op creates: inputs seen for the first time, outputs not yet
      // written, scratch, and (stages 2-3) the unreduced gradients it accumulates into.
      for (TensorId t : op.inputs) touch(i, t);
      for (TensorId t : op.outputs) touch(i, t);
      std::vector<uint32_t> scratch;
      for (TensorId t : op.scratch) scratch.push_back(alloc_tensor(i, t));
      if (const uint64_t a2a = alltoall_buffer_bytes(op); a2a > 0)
        scratch.push_back(alloc(i, add_buffer("a2a." + op.name, Tier::gpu, Category::buffers, a2a,
                                              op.layer)));
      if (op.comm_bytes > 0)  // ring attention's key/value blocks (graph.hpp Op::comm_bytes)
        scratch.push_back(alloc(i, add_buffer("comm." + op.name, Tier::gpu, Category::buffers,
                                              op.comm_bytes, op.layer)));
      if (grads_per_tensor() && op.phase != Phase::optimizer)
        for (TensorId gt : op.grads) alloc_grad(i, gt);
      if (op.phase == Phase::optimizer) optimizer_buffers(i);
      // Free scratch, then tensors whose last use is this op.
      for (uint32_t b : scratch) free(i, b);
      for (uint32_t b : staged_) free(i, b);
      staged_.clear();
      for (TensorId t : dies_at_[static_cast<std::size_t>(i)]) free(i, buffer_of_[static_cast<std::size_t>(t)]);
      if (!contig_ckpts_.empty()) contiguous_checkpoints(i, op);
      if (!ckpt_last_fwd_.empty() || !ckpt_host_.empty()) offload_checkpoints(i, op);
      if (deepspeed_grads() && op.phase != Phase::optimizer) {
        for (TensorId gt : op.grads)
          if (last_grad_write_[static_cast<std::size_t>(gt)] == i) deepspeed_reduce_hook(i, gt);
        if (i == last_bwd) deepspeed_end_of_backward(i);
      } else if (s_.stage >= 2 && op.phase != Phase::optimizer) {
        for (TensorId gt : op.grads)
          if (last_grad_write_[static_cast<std::size_t>(gt)] == i) pending_.push_back(gt);
        if (!fsdp()) flush_if_full(i, i == last_bwd);
      }
      if (s_.stage == 3 && run_at_[static_cast<std::size_t>(i)] >= 0 &&
          run_end_[static_cast<std::size_t>(run_at_[static_cast<std::size_t>(i)])] == i) {
        if (fsdp()) fsdp_end_run(i, run_at_[static_cast<std::size_t>(i)]);
        else end_run(i, run_at_[static_cast<std::size_t>(i)]);
      }
      if (i == last_bwd && in_flight != UINT32_MAX) free(i, in_flight);
      if (fsdp() && i == last_bwd) {
        while (!pending_.empty())
          fsdp_reduce_scatter(i, fsdp_unit_of(g_.tensor(pending_.front()).group, s_));
        if (rs_input_ != UINT32_MAX) free(i, rs_input_);  // the root's final callback
        rs_input_ = UINT32_MAX;
        for (uint32_t b : all_reduce_held_) free(i, b);  // finalize_backward
        all_reduce_held_.clear();
      }
    }
    // A training checkpoint (checkpoint_cost): after the step (position n, past the last op:
    // between steps, no sample of the step's timeline), beside the model states and the
    // buffers held for the run.
    if (s_.save_checkpoint) {
      const uint64_t held = s_.stage == 0 ? out_.n_params : out_.partition_elems;
      const uint32_t b = add_buffer("checkpoint_staging", Tier::cpu, Category::buffers,
                                    checkpoint_staging_bytes(held));
      alloc(n, b);
      free(n, b);
    }
  }

 private:
  const TrainingGraph& g_;
  const Strategy& s_;
  const PlanOptions& o_;
  MemorySchedule& out_;
  uint32_t p_bytes_ = 2;
  uint64_t dp_ = 1;
  uint64_t edp_ = 1;                             // dp/ep: expert parameters' ZeRO group
  std::vector<uint32_t> buffer_of_;              // tensor -> buffer (UINT32_MAX: none)
  std::vector<std::vector<TensorId>> dies_at_;   // position -> tensors freed after it
  std::vector<int32_t> last_grad_write_;         // grad tensor -> position
  std::vector<uint32_t> grad_buffer_;            // grad tensor -> buffer
  std::vector<TensorId> pending_;                // final, unreduced gradients
  std::vector<TensorId> in_flight_;              // overlap_comm: the bucket being reduced
  std::map<std::string, uint64_t> group_elems_;
  std::map<std::string, uint64_t> group_expert_elems_;  // of group_elems_, routed experts'
  std::map<std::string, std::size_t> group_index_;
  // ZeRO-3 gather runs: consecutive ops that read the same group's weights.
  std::vector<int32_t> run_at_, run_start_, run_end_;
  std::vector<std::string> run_group_;
  std::map<std::string, int32_t> holder_;        // live group -> last run it is held for
  std::map<std::string, uint32_t> gathered_;     // live group -> buffer
  std::map<std::string, uint32_t> stage_in_flight_;  // overlap_comm: group -> staging buffer
  std::vector<uint32_t> staged_;                 // offload_param: this op's staging buffers
  uint64_t live_gathered_elems_ = 0;
  // FSDP (fsdp_start_run / fsdp_end_run): the flat all-gather outputs issued and not yet
  // copied out, the unsharded parameters per unit, forward's kept flat buffer, whether each
  // run is backward, and the reduce-scatter input kept for reuse.
  std::map<std::string, uint32_t> ag_out_;
  std::map<std::string, uint32_t> unsharded_;
  uint32_t fwd_ag_kept_ = UINT32_MAX;
  uint32_t rs_input_ = UINT32_MAX;
  std::vector<bool> run_bwd_;
  // FSDP's units (fsdp_units), the last forward and backward run of each, and (hybrid
  // sharding, FSDP2) the reduce-scatter outputs the all-reduce state keeps to the end of
  // backward.
  std::map<std::string, FsdpUnit> fsdp_units_;
  std::map<std::string, int32_t> last_fwd_run_, last_bwd_run_;
  std::vector<uint32_t> all_reduce_held_;
  // DeepSpeed stage 3 (deepspeed_stage3_tensors): persistent parameters' elements per group
  // and in all, the largest optimizer sub-group's partition elements.
  std::map<std::string, uint64_t> persistent_elems_;
  uint64_t persistent_total_ = 0, max_sub_group_ = 0;
  // Its optimizer sub-groups' partition elements in order, and of them (partial offload) the
  // ones stepped on the GPU: in all and the largest.
  std::vector<uint64_t> sub_groups_;
  uint64_t gpu_sub_group_elems_ = 0, max_gpu_sub_group_ = 0;
  // DeepSpeed's gradient reduction (deepspeed_reduce_hook): the ipg buffers, the elements and
  // tensors of the bucket being filled, the gradients whose own tensors wait for a reduction
  // (held) or, with overlap_comm at stage 2 without contiguous gradients, for the next one
  // (ds_in_flight_), the gradient partition the reductions fill and, at stage 1, the full
  // gradients held since the first micro-step.
  std::vector<uint32_t> ipg_;
  uint64_t ds_bucket_elems_ = 0;
  std::vector<uint64_t> ds_bucket_;                 // the bucket's parameters' elements
  std::vector<TensorId> ds_held_, ds_in_flight_;
  bool ds_bucket_expert_ = false;
  uint32_t ds_grad_partition_ = UINT32_MAX;       // allocated at the first reduction
  uint32_t ds_partition_state_ = UINT32_MAX;      // the "grads" state taken off init (stage 2)
  uint32_t ds_full_grads_ = UINT32_MAX;           // stage 1: the "grads" state, freed after backward
  bool ds_grad_partition_live_ = false;

  bool fsdp() const { return o_.profile == Profile::fsdp; }
  // The deepspeed profile's stages 1-3 reduce gradients as DeepSpeed's ZeRO optimizers do
  // (deepspeed_reduce_hook); every other profile and stage 0 as before.
  bool deepspeed_grads() const { return o_.profile == Profile::deepspeed && s_.stage >= 1; }
  // Whether each gradient lives in its own buffer ("bucket." + name) from its first write:
  // stages 2-3, and DeepSpeed's stage 1 in a step without earlier micro-steps (their
  // gradients would be accumulated in place, the "grads" state) and without offload.
  bool grads_per_tensor() const {
    return s_.stage >= 2 || (deepspeed_grads() && s_.grad_accum == 1 &&
                             s_.offload_optimizer == Offload::none);
  }
  // PyTorch's own optimizer on the model's tensors (fsdp and pytorch profiles): states in the
  // weights' dtype, foreach temporaries.
  bool torch_native() const { return o_.profile == Profile::fsdp || o_.profile == Profile::pytorch; }

  const Op& op_at(int32_t i) const { return g_.op(g_.order[static_cast<std::size_t>(i)]); }

  uint32_t add_buffer(std::string name, Tier t, Category c, uint64_t bytes, int32_t layer = -1) {
    out_.buffers.push_back({std::move(name), t, c, bytes, layer});
    return static_cast<uint32_t>(out_.buffers.size() - 1);
  }
  uint32_t alloc(int32_t pos, uint32_t b) {
    out_.events.push_back({pos, true, b});
    return b;
  }
  void free(int32_t pos, uint32_t b) { out_.events.push_back({pos, false, b}); }

  void groups() {
    for (const std::string& name : g_.groups) {
      group_index_[name] = group_elems_.size();
      group_elems_[name] = 0;
    }
    for (const Tensor& t : g_.tensors) {
      if (t.kind != TensorKind::param) continue;
      const uint64_t n = t.bytes / t.elem_bytes;
      group_elems_[t.group] = checked_add(group_elems_[t.group], n, "parameters");
      out_.n_params = checked_add(out_.n_params, n, "parameters");
      if (is_expert_tensor(t)) {
        group_expert_elems_[t.group] = checked_add(group_expert_elems_[t.group], n, "parameters");
        out_.n_expert_params = checked_add(out_.n_expert_params, n, "parameters");
      }
    }
    std::vector<uint64_t> elems, expert;
    for (const std::string& name : g_.groups) {
      elems.push_back(group_elems_[name]);
      expert.push_back(group_expert_elems_[name]);
      out_.groups.emplace_back(name, group_elems_[name]);
    }
    // Expert parameters partition over dp/ep ranks, the rest over dp (partition_elems in
    // schedule.hpp: DeepSpeed-MoE's expert-data-parallel groups).
    out_.partition_elems = partition_elems(elems, expert, s_.stage, dp_, edp_);
    out_.expert_partition_elems = partition_elems(expert, expert, s_.stage, dp_, edp_);
    // FSDP: each unit's shard as FSDP1 or FSDP2 lays it out (fsdp_units).
    if (fsdp()) {
      fsdp_units_ = fsdp_units(g_, s_);
      uint64_t part = 0;
      for (const auto& [name, u] : fsdp_units_) part = checked_add(part, u.shard, "partition");
      out_.partition_elems = part;
    }
    if (o_.profile == Profile::deepspeed && s_.stage == 3) deepspeed_stage3_tensors();
  }

  // DeepSpeed's stage 3 works per parameter (torch tensor), which the graph's modules merge
  // (a Linear's weight and bias are one graph tensor); the inventory lists them apart:
  // - persistence (parameter_offload.py, partition_parameters.py): a parameter of at most
  //   stage3_param_persistence_threshold elements is never released after its first gather,
  //   so it is held whole on every GPU (its partition and states stay as they are) and is not
  //   part of later gathers;
  // - sub-groups (stage3.py _create_fp16_sub_groups): parameters in order are cut into
  //   optimizer sub-groups, each closed at the first parameter that brings its partition to
  //   sub_group_size elements; the step upcasts one sub-group's gradient at a time.
  void deepspeed_stage3_tensors() {
    const models::GraphOptions& go = g_.options;
    // Up to 0.4.0 DeepSpeed's sub_group_size defaulted to 1e12 (zero/constants.py of v0.4.0).
    const uint32_t v = s_.deepspeed_version;
    const uint64_t sub_group_size =
        v > 0 && v <= 400 && s_.buffers.sub_group_size == BufferSizes{}.sub_group_size
            ? uint64_t{1'000'000'000'000}
            : s_.buffers.sub_group_size;
    const int L = static_cast<int>(g_.model.n_blocks());
    uint64_t sub = 0;
    for (const models::ParamTensor& p : models::count_params(g_.model).tensors) {
      const std::vector<int64_t> shape = rank_shape(p, go);
      if (shape.empty()) continue;
      uint64_t n = 1;
      for (int64_t d : shape) n = checked_mul(n, static_cast<uint64_t>(d), "parameter elements");
      // Per-expert tensors are listed for all E experts, E/ep of which are this rank's: each
      // adds 1/ep of its partition to the sub-groups.
      const bool per_expert = p.expert && !p.slot.starts_with("moe.experts.");
      uint64_t part = zp::partition_elems(n, p.expert ? edp_ : dp_);
      if (per_expert) part = zp::partition_elems(part, static_cast<uint64_t>(go.ep));
      sub = checked_add(sub, part, "sub-group elements");
      if (sub >= sub_group_size) {
        max_sub_group_ = std::max(max_sub_group_, sub);
        sub_groups_.push_back(sub);
        sub = 0;
      }
      if (n > s_.buffers.param_persistence_threshold) continue;
      const std::string grp = p.layer < 0 ? "embed" : p.layer >= L ? "head" : fmt::format("h.{}", p.layer);
      if (!group_elems_.contains(grp)) continue;
      persistent_elems_[grp] = checked_add(persistent_elems_[grp], n, "persistent elements");
      persistent_total_ = checked_add(persistent_total_, n, "persistent elements");
    }
    max_sub_group_ = std::max(max_sub_group_, sub);
    if (sub > 0) sub_groups_.push_back(sub);
    // Partial offload (offload_optimizer.ratio): stage3.py _create_fp32_partitions puts
    // sub-group i on the GPU when i < int((1 - ratio) * n), n sub-groups (Python's int() of a
    // double, truncated toward zero: C++'s conversion of the same IEEE product).
    if (s_.offload_optimizer == Offload::cpu && s_.offload_optimizer_ratio < 1) {
      const auto n = static_cast<double>(sub_groups_.size());
      const auto on_gpu = static_cast<std::size_t>((1.0 - s_.offload_optimizer_ratio) * n);
      for (std::size_t i = 0; i < on_gpu && i < sub_groups_.size(); ++i) {
        gpu_sub_group_elems_ = checked_add(gpu_sub_group_elems_, sub_groups_[i], "GPU sub-groups");
        max_gpu_sub_group_ = std::max(max_gpu_sub_group_, sub_groups_[i]);
      }
    }
  }

  void model_states() {
    const uint64_t part = s_.stage >= 1 ? out_.partition_elems
                                        : zp::partition_elems(out_.n_params, dp_);
    deepspeed_model_arrives();
    const std::size_t states_begin = out_.events.size();
    append_model_states(out_, out_.n_params, part, s_, p_bytes_,
                        torch_native() ? StateLayout::fsdp : StateLayout::zero,
                        per_tensor_optimizer_bytes(g_, s_, o_), gpu_sub_group_elems_);
    // DeepSpeed stage 3: the persistent parameters, whole on the GPU (their partition is
    // allocated on the device even with offload_param, partition_parameters.py), and ZeRO++
    // hpZ's secondary partition of the 16-bit parameters over hpz_partition_size ranks (on the
    // host with offload_param): ceil(group / H) elements per gather group.
    if (o_.profile == Profile::deepspeed && s_.stage == 3) {
      if (persistent_total_ > 0)
        alloc(-1, add_buffer("persistent_params", Tier::gpu, Category::params,
                             checked_mul(persistent_total_, p_bytes_, "persistent parameters")));
      // DeepSpeed up to 0.4.0 with the optimizer offloaded (strategy.hpp deepspeed_version):
      // two 16-bit buffers of the largest sub-group's partition, allocated at init.
      const uint32_t v = s_.deepspeed_version;
      if (v > 0 && v <= 400 && s_.offload_optimizer != Offload::none)
        for (const char* name : {"temp_grad_buffer_for_gpu_offload", "temp_grad_gpu_buffer"})
          alloc(-1, add_buffer(name, Tier::gpu, Category::buffers,
                               checked_mul(std::min(max_sub_group_, out_.partition_elems), p_bytes_,
                                           "legacy offload buffer")));
      if (s_.hpz_partition_size > 1) {
        uint64_t sec = 0;
        for (const auto& [grp, n] : group_elems_)
          sec = checked_add(sec, zp::partition_elems(n, static_cast<uint64_t>(s_.hpz_partition_size)),
                            "hpZ secondary partition");
        alloc(-1, add_buffer("hpz_secondary", s_.offload_param == Offload::none ? Tier::gpu : Tier::cpu,
                             Category::params, checked_mul(sec, p_bytes_, "hpZ secondary partition")));
      }
    }
    if (o_.profile == Profile::deepspeed) {
      deepspeed_model_placed(states_begin);
      deepspeed_optimizer_init(states_begin);
    }
    if (deepspeed_grads()) deepspeed_gradient_states();

    // DDP's flat gradient buckets (schedule.hpp), a second copy of the gradients.
    if (o_.profile == Profile::pytorch && dp_ > 1) {
      const bool pure = weights_in_compute_dtype(s_);
      alloc(-1, add_buffer("ddp_buckets", Tier::gpu, Category::buffers,
                           checked_mul(pure ? p_bytes_ : 4, out_.n_params, "DDP bucket bytes")));
    }
  }

  // ---- deepspeed.initialize, before the first step (the deepspeed profile) ---------------------
  // DeepSpeed 0.19.6 (commit edaa722), engine.py _configure_distributed_model: a model not
  // built under zero.Init has its parameters cast one by one to the fp16/bf16 dtype where
  // they are (_cast_module_mixed_precision: p.data = p.data.to(param_dtype)) and is then
  // moved to the GPU whole (self.module.to(self.device)); the Trainer leaves it on the host
  // until then. What follows depends on the stage:
  // - stages 1-2 (stage_1_and_2.py __init__): the parameters are flattened into one new
  //   buffer (bit16_groups_flat, the "params" state) while they are alive, and then point
  //   into it (_update_model_bit16_weights): twice the 16-bit model for a moment. DeepSpeed
  //   does that on the GPU only when its free memory holds the copy
  //   (flatten_on_accelerator: available_memory() >= flat_buffer_bytes), else it moves the
  //   parameters to the host first and the copy is made there;
  // - stage 3 (parameter_offload.py _convert_to_zero_parameters -> partition_parameters.py
  //   Init(module=...)): each whole parameter is partitioned and freed in turn;
  // - stage 0: the parameters are the model's tensors, as moved.
  // A model already on the GPU (load_on_gpu) is cast there, one tensor at a time: the new
  // 16-bit tensor beside the loaded ones, the loaded one freed. Under zero.Init (stage 3's
  // default) each parameter is partitioned as its module is built, and loading the weights
  // gathers one module at a time (transformers' _load_state_dict_into_zero3_model), less than
  // the gathers of a step: nothing is added.
  std::vector<uint32_t> init_params_;
  void deepspeed_model_arrives() {
    if (o_.profile != Profile::deepspeed || builds_partitioned(s_)) return;
    const uint32_t load = s_.load_on_gpu ? (*s_.load_on_gpu == Precision::fp32 ? 4u : 2u) : 0u;
    if (load == 0 && s_.stage == 0) return;  // the "params" state is the model as moved
    const models::GraphOptions& go = g_.options;
    std::vector<std::pair<std::string, uint64_t>> tensors;
    for (const models::ParamTensor& p : models::count_params(g_.model).tensors) {
      const std::vector<int64_t> shape = rank_shape(p, go);
      if (shape.empty()) continue;
      uint64_t n = 1;
      for (int64_t d : shape) n = checked_mul(n, static_cast<uint64_t>(d), "parameter elements");
      // Per-expert tensors are listed for all E experts, E/ep of which are this rank's.
      if (p.expert && !p.slot.starts_with("moe.experts."))
        n = zp::partition_elems(n, static_cast<uint64_t>(go.ep));
      tensors.emplace_back(p.name, n);
    }
    // At stage 0 the 16-bit tensors become the parameters; elsewhere, and loaded in another
    // dtype, they are a transient copy of the model.
    const Category c = s_.stage == 0 ? Category::params : Category::workspace;
    std::vector<uint32_t> loaded;
    if (load > 0)
      for (const auto& [name, n] : tensors)
        loaded.push_back(alloc(-1, add_buffer("init.loaded." + name, Tier::gpu,
                                              load == p_bytes_ ? c : Category::workspace,
                                              checked_mul(n, load, "loaded model bytes"))));
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (load == p_bytes_) {
        init_params_.push_back(loaded[i]);
        continue;
      }
      init_params_.push_back(alloc(-1, add_buffer("init.param." + tensors[i].first, Tier::gpu, c,
                                                  checked_mul(tensors[i].second, p_bytes_,
                                                              "model bytes"))));
      if (load > 0) free(-1, loaded[i]);
    }
  }
  // The model's tensors after the states are allocated (states_begin: the first event of
  // append_model_states): stage 0 keeps them as its parameters (in place of the "params"
  // state); stages 1-2 free them after the flat buffer, or before it when DeepSpeed would
  // flatten on the host; stage 3 frees them before its partitions.
  void deepspeed_model_placed(std::size_t states_begin) {
    if (init_params_.empty()) return;
    auto params = std::find_if(out_.events.begin() + static_cast<std::ptrdiff_t>(states_begin),
                               out_.events.end(), [&](const MemEvent& e) {
                                 const MemBuffer& b = out_.buffers[e.buffer];
                                 return e.alloc && b.tier == Tier::gpu && b.name == "params";
                               });
    std::size_t at = states_begin;
    if (s_.stage == 0) {
      if (params != out_.events.end()) out_.events.erase(params);
      return;
    }
    std::vector<MemEvent> frees;
    for (uint32_t b : init_params_) frees.push_back({-1, false, b});
    if (s_.stage < 3 && params != out_.events.end()) {
      uint64_t model = 0;
      for (uint32_t b : init_params_) model = checked_add(model, out_.buffers[b].bytes, "model bytes");
      // nvidia-smi's free memory: the capacity less the model, the context and NCCL's buffers.
      const DeviceTotal outside = outside_allocator(s_, o_);
      const uint64_t used = checked_add(checked_add(model, outside.context, "used"), outside.nccl, "used");
      const uint64_t flat = out_.buffers[params->buffer].bytes;
      const bool on_gpu = o_.gpu_capacity == 0 || checked_add(used, flat, "flatten") <= o_.gpu_capacity;
      // empty_cache() before deciding (stage_1_and_2.py __init__), and again after the
      // tensors went to the host.
      const uint32_t marker = add_buffer("empty_cache", Tier::gpu, Category::overhead, 0);
      const MemEvent empty{-1, false, marker, true};
      at = static_cast<std::size_t>(params - out_.events.begin());
      if (on_gpu) {
        frees.insert(frees.begin(), out_.events[at]);  // the flat buffer, then the frees
        frees.insert(frees.begin(), empty);
        out_.events.erase(out_.events.begin() + static_cast<std::ptrdiff_t>(at));
      } else {
        frees.insert(frees.begin(), empty);
        frees.push_back(empty);
        frees.push_back(out_.events[at]);
        out_.events.erase(out_.events.begin() + static_cast<std::ptrdiff_t>(at));
      }
    }
    out_.events.insert(out_.events.begin() + static_cast<std::ptrdiff_t>(at), frees.begin(), frees.end());
  }
  // The optimizer's transients at init, beside its master weights (16-bit training):
  // - stages 1-2: the master partition is a clone of the 16-bit partition converted to the
  //   master dtype (stage_1_and_2.py: weights_partition = ...detach().clone().to(...)), and
  //   initialize_optimizer_states makes a zero gradient partition in the master dtype on the
  //   optimizer's device and drops it again (set to None without offload);
  // - stage 3: each sub-group's master is converted on its device and cloned
  //   (_create_fp32_partitions: converted.clone()), and initialize_optimizer_states assigns a
  //   gradient buffer of the largest sub-group on the optimizer's device and drops it; with the
  //   optimizer offloaded only partial offload's GPU sub-groups are converted on the GPU.
  void deepspeed_optimizer_init(std::size_t states_begin) {
    if (s_.precision == Precision::fp32 || s_.stage == 0) return;
    const uint64_t m = s_.master_precision == Precision::bf16 ? 2 : 4;
    const bool offload = s_.offload_optimizer != Offload::none;
    auto master = std::find_if(out_.events.begin() + static_cast<std::ptrdiff_t>(states_begin),
                               out_.events.end(), [&](const MemEvent& e) {
                                 return e.alloc && out_.buffers[e.buffer].name == "master";
                               });
    if (master == out_.events.end()) return;
    // The master's allocation at mi; later transients go after it, at next.
    std::size_t mi = static_cast<std::size_t>(master - out_.events.begin()), next = mi + 1;
    auto insert = [&](std::size_t i, MemEvent e) {
      out_.events.insert(out_.events.begin() + static_cast<std::ptrdiff_t>(i), e);
    };
    auto transient = [&](const char* name, uint64_t bytes, bool around_master) {
      if (bytes == 0) return;
      const uint32_t b = add_buffer(name, Tier::gpu, Category::workspace, bytes);
      if (around_master) {  // allocated before the master, freed after it
        insert(mi++, {-1, true, b});
        ++next;
      } else {
        insert(next++, {-1, true, b});
      }
      insert(next++, {-1, false, b});
    };
    const uint64_t part = out_.partition_elems;
    if (s_.stage < 3) {
      transient("init.partition_clone", checked_mul(part, p_bytes_, "partition clone"), true);
      if (!offload) transient("init.fp32_grad_partition", checked_mul(part, m, "zero gradient"), false);
      return;
    }
    const uint64_t sub = offload ? max_gpu_sub_group_ : std::min(max_sub_group_, part);
    transient("init.master_convert", checked_mul(sub, m, "converted master"), false);
    if (!offload) transient("init.sub_group_grad", checked_mul(sub, m, "sub-group gradient"), false);
  }

  // ---- DeepSpeed's gradient reduction, the deepspeed profile at stages 1-3 --------------------
  // Read in deepspeed/runtime/zero/stage_1_and_2.py and stage3.py (DeepSpeed 0.19.6, commit
  // edaa722; planner/notes/deepspeed-memory.md sec. 1-2). B = reduce_bucket_size elements.
  //
  // The gradient states. Stages 1-2 hold no gradient at init: a backward allocates each
  // gradient as autograd produces it, and the reductions copy this rank's part into
  // grads_in_partition, a buffer of the 16-bit dtype allocated at the first reduction that
  // reaches it (copy_grads_in_partition; without contiguous gradients the same elements stay
  // in the parameters' own .grad tensors, all_grad_tensors), which the step reads and frees.
  // The end of backward frees every other gradient (independent_gradient_partition_epilogue:
  // _clear_param_grad_only; zero_grad(set_to_none) before #7780). So:
  // - stage 1, one micro-step: no "grads" state; each gradient in its own buffer until the
  //   end of backward, where the reduction runs (engine.py allreduce_gradients ->
  //   reduce_gradients after backward; with overlap_comm in the hooks, as stage 2);
  // - stage 1 with earlier micro-steps (or an offloaded optimizer): the full "grads" state
  //   accumulated since the first micro-step, freed at the end of backward;
  // - stage 2, one micro-step: the "grads" state (the partition) allocated at the first
  //   reduction instead of at init;
  // - stage 2 with earlier micro-steps: the accumulated partition held from init, and this
  //   micro-step's new grads_in_partition from its first reduction to the end of backward,
  //   when it is added into the old one (epilogue: accumulated_grad.add_(new_avg_grad));
  // - stage 3: grad_partitions_flat_buffer, allocated at init (stage3.py __init__:
  //   torch.zeros of the partition's elements), as before; and
  //   with contiguous gradients the ipg buffer, torch.empty(reduce_bucket_size) in the
  //   communication dtype (the 16-bit dtype unless communication_data_type says otherwise),
  //   allocated at init and never freed.
  void deepspeed_gradient_states() {
    auto init_alloc = [&](const char* name) -> std::vector<MemEvent>::iterator {
      return std::find_if(out_.events.begin(), out_.events.end(), [&](const MemEvent& e) {
        const MemBuffer& b = out_.buffers[e.buffer];
        return e.alloc && e.pos < 0 && b.tier == Tier::gpu && b.name == name;
      });
    };
    const bool offload = s_.offload_optimizer != Offload::none;
    if (s_.stage == 3) {
      if (s_.contiguous_gradients && !ds_stage3_ipg_per_backward())
        ipg_.push_back(alloc(-1, add_buffer("ipg_buffer", Tier::gpu, Category::buffers,
                                            checked_mul(s_.buffers.reduce_bucket_size, p_bytes_,
                                                        "ipg buffer bytes"))));
      return;
    }
    auto grads = init_alloc("grads");
    if (grads == out_.events.end()) return;
    if (s_.stage == 1) {
      if (grads_per_tensor()) out_.events.erase(grads);
      else ds_full_grads_ = grads->buffer;
      if (!offload)
        ds_grad_partition_ = add_buffer("grads_in_partition", Tier::gpu, Category::grads,
                                        checked_mul(out_.partition_elems, p_bytes_, "gradient partition"));
      return;
    }
    if (offload) return;  // stage 2 offload: the partition goes to the host (model_states.cpp)
    if (s_.grad_accum == 1) {
      ds_grad_partition_ = grads->buffer;
      out_.events.erase(grads);
    } else {
      ds_partition_state_ = grads->buffer;
      ds_grad_partition_ = add_buffer("grads_in_partition.micro_step", Tier::gpu, Category::grads,
                                      checked_mul(out_.partition_elems, p_bytes_, "gradient partition"));
    }
  }

  // Stages 1-2 with the optimizer offloaded always copy into the ipg buffer
  // (stage_1_and_2.py: self.contiguous_gradients = contiguous_gradients or self.cpu_offload).
  bool contiguous() const {
    return s_.contiguous_gradients || (s_.stage < 3 && s_.offload_optimizer != Offload::none);
  }
  uint64_t grad_elems(TensorId gt) const { return g_.tensor(gt).bytes / g_.tensor(gt).elem_bytes; }

  // DeepSpeed before 0.6.0 allocated stage 3's ipg buffers as stages 1-2 do, per backward
  // (stage3.py of v0.4.0, backward(): buf_0, and buf_1 with overlap_comm; freed by
  // _release_ipg_buffers); PR #1453 (first in v0.6.0) made it one buffer held from init.
  bool ds_stage3_ipg_per_backward() const {
    return s_.deepspeed_version > 0 && s_.deepspeed_version < 600;
  }
  // Whether the reductions run in the gradient hooks: stages 2-3, and stage 1 with
  // overlap_comm (stage_1_and_2.py process_gradients); stage 1 otherwise reduces after
  // backward.
  bool deepspeed_reduces_in_hooks() const { return s_.stage >= 2 || overlaps_comm(s_); }

  // The hook DeepSpeed registers on every parameter (stage_1_and_2.py
  // create_gradient_handling_hooks -> process_gradients; stage3.py
  // reduce_independent_p_g_buckets_and_remove_grads), run when autograd has finished the
  // gradient:
  // - stages 1-2, the first hook of a backward allocates the ipg buffers (setup_buckets):
  //   with contiguous gradients one of B elements in the 16-bit dtype (self.dtype, "not the
  //   dtype for autocast"), and a second one with overlap_comm, so one bucket is reduced
  //   while the other fills; both are freed at the end of backward (_release_ipg_buffers).
  //   At stage 1 with earlier micro-steps they were allocated by the first one and are held
  //   through this one's forward (the epilogue that frees them runs at the boundary only).
  // - a gradient that does not fit the bucket's remaining room reduces the bucket first
  //   (stage 3: if the bucket holds anything, and the bucket also changes at a change of
  //   partition group, experts' to the others');
  // - with contiguous gradients a gradient of at most B elements is copied into the bucket
  //   and its own tensor freed (param.grad.data re-pointed into the buffer); a larger one
  //   (extra_large_param_to_reduce) and, without contiguous gradients, every one keeps its
  //   own tensor until the bucket is reduced.
  void deepspeed_setup_buckets(int32_t pos) {
    const int n_buffers = overlaps_comm(s_) ? 2 : 1;
    for (int k = 0; k < n_buffers; ++k)
      ipg_.push_back(alloc(pos, add_buffer(fmt::format("ipg_buffer.{}", k), Tier::gpu,
                                           Category::buffers,
                                           checked_mul(s_.buffers.reduce_bucket_size, p_bytes_,
                                                       "ipg buffer bytes"))));
  }
  void deepspeed_reduce_hook(int32_t pos, TensorId gt) {
    if ((s_.stage < 3 || ds_stage3_ipg_per_backward()) && contiguous() && ipg_.empty())
      deepspeed_setup_buckets(pos);
    const bool own = grad_buffer_[static_cast<std::size_t>(gt)] != UINT32_MAX;
    if (!deepspeed_reduces_in_hooks()) {
      if (own) ds_held_.push_back(gt);
      return;
    }
    deepspeed_add_to_bucket(pos, gt);
  }
  // DeepSpeed hooks and buckets each torch parameter; a graph tensor may sum several (q, k
  // and v): its parts are bucketed one by one, and its buffer is freed at its hook when every
  // part was copied, else kept with the gradients that wait for the next reduction.
  void deepspeed_add_to_bucket(int32_t pos, TensorId gt) {
    const uint64_t b = s_.buffers.reduce_bucket_size;
    const bool expert = is_expert_tensor(g_.tensor(gt));
    auto it = g_.param_parts.find(gt);
    const std::vector<uint64_t> whole = {grad_elems(gt)};
    const std::vector<uint64_t>& parts = it != g_.param_parts.end() && !it->second.empty() ? it->second : whole;
    bool copied = contiguous();
    for (uint64_t n : parts) {
      if (s_.stage == 3 && !ds_bucket_.empty() && expert != ds_bucket_expert_) deepspeed_reduce(pos);
      if (ds_bucket_elems_ + n > b && (s_.stage < 3 || ds_bucket_elems_ > 0)) deepspeed_reduce(pos);
      ds_bucket_expert_ = expert;
      if (n > b) copied = false;
      ds_bucket_.push_back(n);
      ds_bucket_elems_ = checked_add(ds_bucket_elems_, n, "bucket elements");
    }
    if (grad_buffer_[static_cast<std::size_t>(gt)] == UINT32_MAX) return;
    if (copied) free(pos, grad_buffer_[static_cast<std::size_t>(gt)]);
    else ds_held_.push_back(gt);
  }
  // Reducing a bucket. Stages 1-2 all-reduce it (average_tensor -> allreduce_and_scatter,
  // or without contiguous gradients buffered_reduce_fallback -> allreduce_no_retain), and
  // either way allreduce_bucket first flattens the bucket's tensors into a new tensor of
  // their elements in the 16-bit dtype (self.flatten: torch.cat), freed when the reduction
  // returns; a gradient larger than B is reduced from its slices per partition, at most its
  // own elements. Stage 3 reduce-scatters (__avg_scatter_grads -> reduce_scatter_coalesced,
  // runtime/comm/coalesced_collectives.py), which concatenates every tensor's W chunks of
  // ceil(n/W) elements, padded, into a new flat buffer of sum ceil(n/W) x W elements, except
  // for a single tensor that W divides; this rank's chunk of it is copied into the gradient
  // partition (partition_grads), and the flat buffer freed.
  // Then this rank's part goes to the gradient partition (its buffer allocated at the first
  // reduction); the gradients that kept their own tensors are freed, except at stage 1,
  // which clears nothing before the end of backward, and at stages 2-3 with overlap_comm and
  // without contiguous gradients, whose tensors are freed at the next reduction (stage 2's
  // previous_reduced_grads; stage 3's are freed to the reduce stream, reusable once the
  // reduction in flight is done).
  void deepspeed_reduce(int32_t pos) {
    if (ds_bucket_.empty()) return;
    uint64_t flat = 0;
    if (s_.stage < 3) {
      flat = ds_bucket_elems_;
    } else {
      const uint64_t w = ds_bucket_expert_ ? edp_ : dp_;
      if (!(ds_bucket_.size() == 1 && ds_bucket_.front() % w == 0))
        for (uint64_t n : ds_bucket_)
          flat = checked_add(flat, checked_mul(zp::partition_elems(n, w), w, "flat"),
                             "reduce-scatter flat buffer");
    }
    if (flat > 0) {
      const uint32_t b = alloc(pos, add_buffer("reduce_flat", Tier::gpu, Category::buffers,
                                               checked_mul(flat, p_bytes_, "reduce flat bytes")));
      free(pos, b);
    }
    if (ds_grad_partition_ != UINT32_MAX && !ds_grad_partition_live_) {
      alloc(pos, ds_grad_partition_);
      ds_grad_partition_live_ = true;
    }
    ds_bucket_.clear();
    ds_bucket_elems_ = 0;
    if (s_.stage == 1) return;  // stage 1 clears gradients at the end of backward only
    for (TensorId gt : ds_in_flight_) free(pos, grad_buffer_[static_cast<std::size_t>(gt)]);
    ds_in_flight_.clear();
    if (overlaps_comm(s_) && !s_.contiguous_gradients) ds_in_flight_ = std::move(ds_held_);
    else
      for (TensorId gt : ds_held_) free(pos, grad_buffer_[static_cast<std::size_t>(gt)]);
    ds_held_.clear();
  }
  // The end of backward (the epilogue): stage 1 without overlap_comm reduces every gradient
  // now, bucket by bucket in the same way; then the last bucket is reduced, every gradient
  // left is freed (stage 1's full "grads" state too), stages 1-2 free their ipg buffers and,
  // after earlier micro-steps at stage 2, this micro-step's partition (added into the old).
  void deepspeed_end_of_backward(int32_t pos) {
    if (!deepspeed_reduces_in_hooks()) {
      std::vector<TensorId> all = std::move(ds_held_);
      ds_held_.clear();
      if (all.empty() && ds_full_grads_ != UINT32_MAX) {
        // Gradients accumulated in the "grads" state: the largest bucket is min(B, P).
        const uint32_t b = alloc(pos, add_buffer("reduce_flat", Tier::gpu, Category::buffers,
                                                 checked_mul(std::min(s_.buffers.reduce_bucket_size,
                                                                      out_.n_params),
                                                             p_bytes_, "reduce flat bytes")));
        free(pos, b);
        if (ds_grad_partition_ != UINT32_MAX && !ds_grad_partition_live_) {
          alloc(pos, ds_grad_partition_);
          ds_grad_partition_live_ = true;
        }
      }
      for (TensorId gt : all) deepspeed_add_to_bucket(pos, gt);
    }
    deepspeed_reduce(pos);
    for (TensorId gt : ds_in_flight_) free(pos, grad_buffer_[static_cast<std::size_t>(gt)]);
    for (TensorId gt : ds_held_) free(pos, grad_buffer_[static_cast<std::size_t>(gt)]);
    ds_in_flight_.clear();
    ds_held_.clear();
    if (ds_full_grads_ != UINT32_MAX) free(pos, ds_full_grads_);
    if (s_.stage < 3 || ds_stage3_ipg_per_backward()) for (uint32_t b : ipg_) free(pos, b);
    if (ds_partition_state_ != UINT32_MAX && ds_grad_partition_live_) free(pos, ds_grad_partition_);
  }

  // ZeRO-R Pa+cpu (Strategy::cpu_checkpointing): a checkpoint is a tensor the forward pass
  // writes and a recomputation reads (a block input, or its P_a partition). After its last
  // forward use its device buffer is freed and a host copy kept; the first recomputation
  // reading it brings it back into a new device buffer (allocated by touch(), freed at its
  // last use) and frees the host copy.
  std::map<TensorId, int32_t> ckpt_last_fwd_;       // checkpoint -> its last forward use
  std::map<TensorId, uint32_t> ckpt_host_;          // checkpoint -> its host copy
  void find_checkpoints(const models::Liveness& lv) {
    const int32_t n = static_cast<int32_t>(g_.order.size());
    std::map<TensorId, int32_t> last_fwd;
    std::set<TensorId> recomputed;
    for (int32_t i = 0; i < n; ++i) {
      const Op& op = op_at(i);
      for (TensorId t : op.inputs) {
        if (op.phase == Phase::forward) last_fwd[t] = i;
        if (op.phase == Phase::recompute && last_fwd.contains(t)) recomputed.insert(t);
      }
      if (op.phase == Phase::forward)
        for (TensorId t : op.outputs) last_fwd[t] = std::max(last_fwd[t], i);
    }
    for (TensorId t : recomputed)
      if (is_dynamic(g_.tensor(t).kind) && g_.tensor(t).kind != TensorKind::input &&
          lv.last[static_cast<std::size_t>(t)] > last_fwd.at(t))
        ckpt_last_fwd_[t] = last_fwd.at(t);
  }
  void offload_checkpoints(int32_t pos, const Op& op) {
    for (const auto& [t, last] : ckpt_last_fwd_)
      if (last == pos && buffer_of_[static_cast<std::size_t>(t)] != UINT32_MAX &&
          !ckpt_host_.contains(t)) {
        const Tensor& x = g_.tensor(t);
        ckpt_host_[t] = alloc(pos, add_buffer("ckpt_cpu." + x.name, Tier::cpu, Category::activations,
                                              x.bytes, x.layer));
        free(pos, buffer_of_[static_cast<std::size_t>(t)]);
        buffer_of_[static_cast<std::size_t>(t)] = UINT32_MAX;
      }
    if (op.phase != Phase::recompute) return;
    for (TensorId t : op.inputs) {
      auto it = ckpt_host_.find(t);
      if (it == ckpt_host_.end()) continue;
      free(pos, it->second);
      ckpt_host_.erase(it);
    }
  }

  // DeepSpeed's contiguous_memory_optimization (Strategy::contiguous_memory_optimization;
  // deepspeed/runtime/activation_checkpointing/checkpointing.py, partition_activations and
  // CheckpointFunction, the same since 2020): the first checkpoint of a forward allocates
  // number_checkpoints buffers of one partition each (contiguous_data_buffers: a list of
  // new_empty([partition_size]) tensors, on the host with cpu_checkpointing), and checkpoint k
  // copies its partition, a clone it then drops, into buffer k. The first backward drops the
  // list (contiguous_data_buffers = []): a buffer no checkpoint filled goes then; buffer k
  // stays while checkpoint k's CheckpointFunction holds it, to the end of its backward on the
  // device; on the host, until its backward copies it back (t.data = saved_data.to(device);
  // saved_data = None), the copy then living to the end of its backward as with
  // cpu_checkpointing alone. Not counted: the int64 shape buffers of 3 x number_checkpoints
  // elements on the host (contiguous_size_buffers), 24 bytes per checkpoint.
  std::vector<TensorId> contig_ckpts_;           // the P_a partitions, in forward order
  std::map<TensorId, std::size_t> contig_index_;  // partition -> its buffer
  std::vector<uint32_t> contig_bufs_;
  bool contig_unused_freed_ = false;
  void find_contiguous() {
    for (models::OpId id : g_.order)
      if (g_.op(id).kind == models::OpKind::checkpoint_partition) {
        const TensorId t = g_.op(id).outputs.front();
        contig_index_[t] = contig_ckpts_.size();
        contig_ckpts_.push_back(t);
      }
    if (contig_ckpts_.size() > static_cast<std::size_t>(s_.number_checkpoints))
      throw Error(fmt::format("--number-checkpoints {}: the plan makes {} checkpoints per forward",
                              s_.number_checkpoints, contig_ckpts_.size()),
                  fmt::format("--number-checkpoints {}", contig_ckpts_.size()));
    for (TensorId t : contig_ckpts_) {
      if (g_.tensor(t).bytes != g_.tensor(contig_ckpts_.front()).bytes)
        throw Error("--contiguous-memory-optimization: checkpoints of different sizes",
                    "DeepSpeed sizes every buffer by the first checkpoint");
      ckpt_last_fwd_.erase(t);  // not offloaded one by one: the buffers are where they go
    }
  }
  void contiguous_checkpoints(int32_t pos, const Op& op) {
    if (op.kind == models::OpKind::checkpoint_partition) {
      const TensorId t = op.outputs.front();
      const std::size_t k = contig_index_.at(t);
      if (k == 0) {
        const Tier tier = s_.cpu_checkpointing ? Tier::cpu : Tier::gpu;
        for (int64_t b = 0; b < s_.number_checkpoints; ++b)
          contig_bufs_.push_back(alloc(pos, add_buffer(fmt::format("ckpt_contiguous.{}", b), tier,
                                                       Category::activations, g_.tensor(t).bytes,
                                                       op.layer)));
      }
      // The clone is copied into buffer k and dropped; the partition now is buffer k.
      free(pos, buffer_of_[static_cast<std::size_t>(t)]);
      if (s_.cpu_checkpointing) {
        buffer_of_[static_cast<std::size_t>(t)] = UINT32_MAX;  // touch() brings it back
        ckpt_host_[t] = contig_bufs_[k];
      } else {
        buffer_of_[static_cast<std::size_t>(t)] = contig_bufs_[k];  // freed where it dies
      }
      return;
    }
    if (op.phase == Phase::recompute && !contig_unused_freed_) {
      for (std::size_t b = contig_ckpts_.size(); b < contig_bufs_.size(); ++b) free(pos, contig_bufs_[b]);
      contig_unused_freed_ = true;
    }
  }

  void liveness() {
    models::Liveness lv = models::liveness(g_);
    if (s_.cpu_checkpointing && s_.checkpointing == Checkpointing::full) find_checkpoints(lv);
    if (s_.contiguous_memory_optimization && s_.partition_activations &&
        s_.checkpointing == Checkpointing::full)
      find_contiguous();
    dies_at_ = std::move(lv.dies_at);
    last_grad_write_ = std::move(lv.last_grad_write);
    buffer_of_.assign(g_.tensors.size(), UINT32_MAX);
    grad_buffer_.assign(g_.tensors.size(), UINT32_MAX);
  }

  // Expert parallelism (ep > 1): each MoE layer's dispatch and combine exchange the routed
  // rows through an all-to-all over the ep group, forward (and recomputed) and backward. The
  // graph already holds one side of each exchange: moe.dispatch (R rows) is what the
  // dispatch's all-to-all receives, the experts' output (R rows) what the combine's sends,
  // and in backward moe.experts.proj.d and moe.dispatch.d are their mirror images. What it
  // lacks is the other side, this rank's own k*B*T routed rows of C activations:
  //   - dispatch: the send buffer, the tokens' k copies permuted by destination (DeepSpeed's
  //     dispatched_input, sharded_moe.py MOELayer.forward, which _AllToAll sends);
  //   - combine: the receive buffer, the experts' outputs back before the weighted sum;
  //   - combine.bwd: the send buffer of those rows' gradients;
  //   - dispatch.bwd: the receive buffer of the gradients of the dispatched rows.
  // Each lives for its one op (allocated with it, freed after it, like scratch), category
  // buffers. DeepSpeed's einsum after the combine keeps its received rows for backward (the
  // combine weights' gradient reads them); the graph keeps the experts' output for that
  // (R = k*B*T rows with balanced routing), so they are not counted twice. ep == 1: the
  // dispatch is a local permutation, already the graph's moe.dispatch; nothing is added.
  uint64_t alltoall_buffer_bytes(const Op& op) const {
    if (s_.ep <= 1) return 0;
    TensorId tokens = -1;  // the op's (B, T, C) side
    switch (op.kind) {
      case models::OpKind::moe_dispatch: tokens = op.inputs.front(); break;
      case models::OpKind::moe_combine: tokens = op.outputs.front(); break;
      case models::OpKind::moe_combine_bwd: tokens = op.inputs.front(); break;
      case models::OpKind::moe_dispatch_bwd: tokens = op.outputs.front(); break;
      default: return 0;
    }
    // The routed rows of this rank's tokens: k per token dropless; with a capacity factor,
    // DeepSpeed's (E, capacity, C) dispatched tensor, however the tokens route.
    const models::Tensor& x = g_.tensor(tokens);
    const int64_t n_tokens = x.shape[0] * x.shape[1];
    const uint64_t rows = g_.options.moe_capacity_factor > 0
                              ? static_cast<uint64_t>(models::routed_rows(g_.model, g_.options, n_tokens))
                              : static_cast<uint64_t>(g_.model.moe.top_k * n_tokens);
    return checked_mul(x.bytes / static_cast<uint64_t>(n_tokens), rows, "all-to-all buffer bytes");
  }

  uint32_t alloc_tensor(int32_t pos, TensorId t) {
    const Tensor& x = g_.tensor(t);
    // Autocast's cached 16-bit weight casts are the step's 16-bit working copies: params.
    const Category c = x.source >= 0 && x.kind != TensorKind::workspace ? Category::params
                                                                        : category_of(x.kind);
    const uint32_t b = add_buffer(x.name, Tier::gpu, c, x.bytes, x.layer);
    buffer_of_[static_cast<std::size_t>(t)] = b;
    return alloc(pos, b);
  }
  void touch(int32_t pos, TensorId t) {
    if (buffer_of_[static_cast<std::size_t>(t)] != UINT32_MAX) return;
    if (!is_dynamic(g_.tensor(t).kind)) return;
    alloc_tensor(pos, t);
  }

  // Stages 2-3: a weight's gradient lives in its own buffer from its first accumulation until
  // its bucket is reduced into the owner's partition (DeepSpeed's "ipg" buckets).
  void alloc_grad(int32_t pos, TensorId gt) {
    if (grad_buffer_[static_cast<std::size_t>(gt)] != UINT32_MAX) return;
    const Tensor& x = g_.tensor(gt);
    grad_buffer_[static_cast<std::size_t>(gt)] =
        alloc(pos, add_buffer("bucket." + x.name, Tier::gpu, Category::buffers, x.bytes, x.layer));
  }
  // Final gradients are reduced together once they reach reduce_bucket_size elements, and
  // whatever remains at the end of the backward pass. With overlap_comm (the engine's
  // flush_if_full) a flushed bucket stays alive while its reductions are in flight: it is
  // freed when the next bucket is flushed (previous bucket first), and at the end of the
  // backward pass with the last one, so at most two buckets' buffers are alive at once
  // (DeepSpeed's overlap_comm keeps two ipg buffers for the same reason).
  void flush_if_full(int32_t pos, bool end_of_backward) {
    uint64_t elems = 0;
    for (TensorId gt : pending_) elems += g_.tensor(gt).bytes / g_.tensor(gt).elem_bytes;
    const bool full = !pending_.empty() && (elems >= s_.buffers.reduce_bucket_size || end_of_backward);
    auto complete_in_flight = [&] {  // the engine's: the bucket in flight goes back
      for (TensorId gt : in_flight_) free(pos, grad_buffer_[static_cast<std::size_t>(gt)]);
      in_flight_.clear();
    };
    if (full) {
      complete_in_flight();  // the previous bucket, if any
      in_flight_ = std::move(pending_);
      pending_.clear();
    }
    if (!holds_buckets_in_flight(s_) || end_of_backward) complete_in_flight();
  }

  void gather_runs() {
    const int32_t n = static_cast<int32_t>(g_.order.size());
    run_at_.assign(static_cast<std::size_t>(n), -1);
    std::string current;
    for (int32_t i = 0; i < n; ++i) {
      const Op& op = op_at(i);
      if (op.phase == Phase::optimizer || op.params.empty()) continue;
      const std::string& grp = g_.tensor(op.params.front()).group;
      if (run_group_.empty() || grp != current) {
        run_group_.push_back(grp);
        run_start_.push_back(i);
        run_end_.push_back(i);
        run_bwd_.push_back(false);
        current = grp;
      }
      run_end_.back() = i;
      if (op.phase == Phase::backward) run_bwd_.back() = true;
    }
    for (std::size_t r = 0; r < run_group_.size(); ++r)
      for (int32_t i = run_start_[r]; i <= run_end_[r]; ++i) run_at_[static_cast<std::size_t>(i)] = static_cast<int32_t>(r);
    if (fsdp())
      for (std::size_t r = 0; r < run_group_.size(); ++r)
        (run_bwd_[r] ? last_bwd_run_ : last_fwd_run_)[fsdp_unit_of(run_group_[r], s_)] =
            static_cast<int32_t>(r);
  }

  // ZeRO-3 all-gathers a group's dense parameters from the dp ranks' equal shards and its
  // expert parameters from the dp/ep ranks of the expert-data-parallel group (schedule.hpp's
  // partition_elems): gathered = ceil(dense/dp)*dp + ceil(expert/edp)*edp elements, of which
  // this rank's shard is ceil(dense/dp) + ceil(expert/edp).
  uint64_t expert_elems(const std::string& grp) const {
    auto it = group_expert_elems_.find(grp);
    return it == group_expert_elems_.end() ? 0 : it->second;
  }
  uint64_t persistent_of(const std::string& grp) const {
    auto it = persistent_elems_.find(grp);
    return it == persistent_elems_.end() ? 0 : it->second;
  }
  // (Persistent parameters, DeepSpeed's, are held whole and never gathered.)
  uint64_t gathered_bytes(const std::string& grp) const {
    const uint64_t x = expert_elems(grp), d = group_elems_.at(grp) - x - persistent_of(grp);
    const uint64_t elems =
        checked_add(checked_mul(zp::partition_elems(d, dp_), dp_, "gathered elements"),
                    checked_mul(zp::partition_elems(x, edp_), edp_, "gathered elements"),
                    "gathered elements");
    return checked_mul(elems, p_bytes_, "gathered bytes");
  }
  uint64_t shard_bytes(const std::string& grp) const {
    const uint64_t x = expert_elems(grp), d = group_elems_.at(grp) - x - persistent_of(grp);
    return checked_mul(zp::partition_elems(d, dp_) + zp::partition_elems(x, edp_), p_bytes_,
                       "shard bytes");
  }
  void gather(int32_t pos, const std::string& grp, int32_t hold_until) {
    auto it = holder_.find(grp);
    if (it != holder_.end()) {
      it->second = std::max(it->second, hold_until);
      return;
    }
    holder_[grp] = hold_until;
    gathered_[grp] = alloc(pos, add_buffer("gathered." + grp, Tier::gpu, Category::buffers,
                                           gathered_bytes(grp)));
    // Parameters offloaded to the host (offload_param=cpu) or read from NVMe through the host
    // buffers (nvme): the rank's shard is copied into a device staging buffer that the
    // all-gather sends from. It lives until the op's frees, or with overlap_comm (the
    // all-gather in flight) until the frees of the op whose run waits for it (wait_gathered).
    if (s_.offload_param != Offload::none) {
      const uint32_t b = alloc(pos, add_buffer("param_stage." + grp, Tier::gpu, Category::buffers,
                                               shard_bytes(grp)));
      if (overlaps_comm(s_)) stage_in_flight_[grp] = b;
      else staged_.push_back(b);
    }
    if (o_.profile == Profile::deepspeed && s_.quantized_weights) deepspeed_quantized_gather(pos, grp);
    live_gathered_elems_ += group_elems_.at(grp);
  }
  // The engine's wait for an all-gather in flight: its staging buffer goes back with the
  // op's frees; a quantized one (qwZ) is dequantized first.
  void wait_gathered(int32_t pos, const std::string& grp) {
    if (auto q = qwz_in_flight_.find(grp); q != qwz_in_flight_.end()) {
      staged_.push_back(alloc(pos, add_buffer("qwz.dequantized." + grp, Tier::gpu, Category::buffers,
                                              checked_mul(gathered_bytes(grp) / p_bytes_, 2,
                                                          "dequantized bytes"))));
      for (uint32_t b : q->second) staged_.push_back(b);
      qwz_in_flight_.erase(q);
    }
    auto it = stage_in_flight_.find(grp);
    if (it == stage_in_flight_.end()) return;
    staged_.push_back(it->second);
    stage_in_flight_.erase(it);
  }

  // ZeRO++ qwZ (Strategy::quantized_weights), DeepSpeed's coalesced all-gather with
  // quantize=True (partition_parameters.py all_gather_coalesced -> _all_gather_coalesced, the
  // CUDAQuantizer): this rank's shard of s elements is concatenated (torch.cat, s in the
  // parameters' dtype), converted to fp16 unless it is (the kernel reads __half), and
  // quantized to int8, s bytes, with an fp32 scale per group (CUDAQuantizer.quantize:
  // quantization_groups); those are sent from, and the gathered W x s int8 elements and
  // W x groups fp32 scales received into new buffers, all held until the wait; the wait
  // (AllGatherCoalescedHandle.wait) dequantizes the whole gathered buffer into fp16, W x s x
  // 2 bytes (the binding's dequantize<__half>), from which each parameter is copied out (the
  // gathered parameters, as without qwZ), and then drops them.
  std::map<std::string, std::vector<uint32_t>> qwz_in_flight_;
  void deepspeed_quantized_gather(int32_t pos, const std::string& grp) {
    const uint64_t s = shard_bytes(grp) / p_bytes_, gathered = gathered_bytes(grp) / p_bytes_;
    if (s == 0) return;
    const uint64_t w = gathered / s, scales = checked_mul(quantization_groups(s), 4, "scale bytes");
    const uint32_t cat = alloc(pos, add_buffer("qwz.shard." + grp, Tier::gpu, Category::buffers,
                                               checked_mul(s, p_bytes_, "shard bytes")));
    uint32_t half = UINT32_MAX;
    if (s_.precision != Precision::fp16)
      half = alloc(pos, add_buffer("qwz.fp16." + grp, Tier::gpu, Category::buffers,
                                   checked_mul(s, 2, "fp16 shard bytes")));
    std::vector<uint32_t> held;
    held.push_back(alloc(pos, add_buffer("qwz.int8_shard." + grp, Tier::gpu, Category::buffers,
                                         checked_add(s, scales, "int8 shard bytes"))));
    free(pos, cat);
    if (half != UINT32_MAX) free(pos, half);
    held.push_back(alloc(pos, add_buffer("qwz.int8_gathered." + grp, Tier::gpu, Category::buffers,
                                         checked_add(gathered, checked_mul(w, scales, "scales"),
                                                     "int8 gathered bytes"))));
    qwz_in_flight_[grp] = std::move(held);
  }
  // CUDAQuantizer.quantize's groups for n elements (partition_parameters.py): from
  // ceil(n / 8000) up to the first count g with n divisible by 8g, then doubled while n is
  // divisible by 16g and groups stay above 8000 elements. DeepSpeed asserts n % 8 == 0; the
  // first count is taken otherwise.
  static uint64_t quantization_groups(uint64_t n) {
    const uint64_t g0 = (n + 7999) / 8000;
    if (n % 8 != 0) return g0;
    // The smallest divisor of n / 8 at least g0 (n / 8 itself always is one).
    const uint64_t m = n / 8;
    uint64_t g = m;
    for (uint64_t d = 1; d * d <= m; ++d)
      if (m % d == 0) {
        if (d >= g0) g = std::min(g, d);
        if (m / d >= g0) g = std::min(g, m / d);
      }
    while (n % (16 * g) == 0 && n / g > 8000) g *= 2;
    return g;
  }
  // ZeRO-3: gather the run's group, then prefetch the groups of the following runs while the
  // newly gathered elements stay within stage3_prefetch_bucket_size and everything gathered
  // within stage3_max_live_parameters.
  void start_run(int32_t pos, int32_t r) {
    gather(pos, run_group_[static_cast<std::size_t>(r)], r);
    uint64_t prefetched = 0;
    for (std::size_t j = static_cast<std::size_t>(r) + 1; j < run_group_.size(); ++j) {
      const std::string& grp = run_group_[j];
      if (holder_.contains(grp)) {
        holder_[grp] = std::max(holder_[grp], static_cast<int32_t>(j));
        continue;
      }
      const uint64_t e = group_elems_.at(grp);
      if (prefetched + e > s_.buffers.prefetch_bucket_size) break;
      if (live_gathered_elems_ + e > s_.buffers.max_live_parameters) break;
      prefetched += e;
      gather(pos, grp, static_cast<int32_t>(j));
    }
    wait_gathered(pos, run_group_[static_cast<std::size_t>(r)]);
  }
  void end_run(int32_t pos, int32_t r) {
    for (auto it = holder_.begin(); it != holder_.end();) {
      if (it->second <= r) {
        wait_gathered(pos, it->first);  // never in flight here (its run has started)
        free(pos, gathered_[it->first]);
        live_gathered_elems_ -= group_elems_.at(it->first);
        gathered_.erase(it->first);
        it = holder_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // ---- PyTorch FSDP, the fsdp profile -------------------------------------------------------
  // Each gather group is one FSDP unit (torchtitan's apply_fsdp wraps every transformer block,
  // the token embedding, and [final norm, output] together; accelerate wraps each decoder
  // layer); FSDP1 keeps the embedding and the head in its root unit (fsdp_unit_of). Per unit,
  // with W = the shard group's ranks (fsdp_shard_world: dp, or the hybrid shard size), S = its
  // shard (fsdp_units: FSDP2's dim-0 shards, FSDP1's padded flat parameter), in the compute
  // dtype p; torch/distributed/fsdp/, pytorch main read at commit 010ae4a8 (FSDP2
  // _fully_shard/_fsdp_param.py, _fsdp_collectives.py, _fsdp_param_group.py; FSDP1
  // _flat_param.py, _runtime_utils.py, _init_utils.py); planner/notes/
  // fsdp-and-optimizers-memory.md has the line numbers of torch 2.14:
  // - FSDP2 all-gather (foreach_all_gather): the all-gather inputs, then a flat output of W*S*p
  //   issued one unit ahead (implicit prefetch on the all-gather stream, forward and backward),
  //   copied out into the unit's unsharded parameters, another W*S*p, when the unit's run
  //   starts. The inputs: under mixed precision (param_dtype set) the shard cast to p by one
  //   foreach copy, S*p (_get_param_all_gather_inputs' fast path); without it the sharded
  //   parameters themselves (nothing new); offloaded (CPUOffloadPolicy), each parameter's
  //   pinned host shard copied to the GPU (FSDPParam.all_gather_inputs: .to(device)), S in the
  //   weights' dtype, or under mixed precision one parameter's copy at a time cast into S*p.
  //   In forward the flat buffer of a unit stays until the next unit's copy-out
  //   (all_gather_state), in backward it is freed right after its own.
  // - FSDP1 unshard (FlatParamHandle.pre_unshard, unshard, post_unshard): the all-gather writes
  //   straight into _full_param_padded, W*S*p, which holds the unsharded parameters; its input
  //   is the low-precision _mp_shard, S*p, under mixed precision (freed after the all-gather),
  //   and offloaded the pinned _local_shard's copy on the GPU, S in the weights' dtype (cast
  //   into _mp_shard under mixed precision, then dropped). No forward prefetch
  //   (forward_prefetch=False); backward prefetches the next unit (BACKWARD_PRE).
  // - reshard: after its forward a unit frees its unsharded parameters (reshard_after_forward;
  //   FULL_SHARD and HYBRID_SHARD) except FSDP2's [norm, output] unit and a tied embedding's,
  //   which torchtitan never reshards after forward, and FSDP1's root (_post_forward_reshard);
  //   after its last backward every unit frees them.
  // - gradients, FSDP2 (foreach_reduce): autograd writes the unit's unsharded gradients in p;
  //   after the unit's backward they are copied into the reduce-scatter input, W*S in the
  //   reduce dtype, and freed; the output, S in the reduce dtype, is the sharded gradient (or
  //   cast to the sharded parameters' dtype when that differs: a new S). One reduce-scatter
  //   input is kept for reuse until the next unit's (reduce_scatter_max_input_buffers = 1),
  //   the last until the end of backward. Hybrid (HSDP): the output is all-reduced in place
  //   over the replicas and, where it is a buffer of its own, kept by the unit's
  //   _all_reduce_state until the end of backward (FSDPParamGroup._wait_for_post_backward in
  //   finalize_backward). Offloaded: the sharded gradient is copied to the host and dropped.
  // - gradients, FSDP1 (_post_backward_hook, _reduce_grad): autograd's flat gradient of the
  //   unit, flat*p (the split's backward gathers the per-parameter gradients into it), cast to
  //   the reduce dtype (a new flat tensor) when that differs, padded to W*S (F.pad, a copy)
  //   when flat is not a multiple of W, reduce-scattered into a new S in the reduce dtype
  //   (hybrid: all-reduced in place over the replicas), cast to the weights' dtype
  //   (_cast_grad_to_param_dtype: the sharded gradient), offloaded copied into the pinned
  //   _cpu_grad and dropped. Nothing is kept for the next unit.
  uint64_t fsdp_reduce_bytes() const {
    return s_.precision == Precision::fp32 ? 4 : (s_.reduce_precision == Precision::bf16 ? 2 : 4);
  }
  // The sharded parameters' (and gradients') bytes: fp32 under mixed precision, else p.
  uint64_t fsdp_weight_bytes() const { return weights_in_compute_dtype(s_) ? p_bytes_ : 4; }
  bool fsdp_mixed() const { return !weights_in_compute_dtype(s_); }
  bool fsdp_offload() const { return s_.offload_param == Offload::cpu; }
  bool fsdp1() const { return s_.fsdp_version == 1; }
  uint64_t fsdp_w() const { return static_cast<uint64_t>(fsdp_shard_world(s_)); }
  const FsdpUnit& fsdp_unit(const std::string& u) const { return fsdp_units_.at(u); }
  uint64_t fsdp_bytes(uint64_t elems, uint64_t b, const char* what) const {
    return checked_mul(elems, b, what);
  }
  // W x shard in the compute dtype: FSDP2's all-gather output and unsharded parameters, FSDP1's
  // padded unsharded flat parameter.
  uint64_t fsdp_gathered_bytes(const std::string& u) const {
    return fsdp_bytes(checked_mul(fsdp_unit(u).shard, fsdp_w(), "unsharded elements"), p_bytes_,
                      "unsharded parameters");
  }
  bool fsdp_reshards_after_forward(const std::string& u) const {
    if (u == "head" || u == "root") return false;
    if (u == "embed" && g_.model.tied_embeddings) return false;
    return s_.reshard_after_forward;
  }
  void fsdp_issue(int32_t pos, const std::string& u) {
    if (unsharded_.contains(u) || ag_out_.contains(u)) return;
    const FsdpUnit& fu = fsdp_unit(u);
    const uint64_t wb = fsdp_weight_bytes();
    auto temp = [&](const char* name, uint64_t elems, uint64_t b) {
      return alloc(pos, add_buffer(name + u, Tier::gpu, Category::buffers,
                                   fsdp_bytes(elems, b, "all-gather input")));
    };
    const uint64_t gathered = fsdp_gathered_bytes(u);
    if (fsdp1()) {
      std::vector<uint32_t> inputs;
      if (fsdp_mixed()) inputs.push_back(temp("mp_shard.", fu.shard, p_bytes_));
      if (fsdp_offload()) {
        const uint32_t h2d = temp("h2d_shard.", fu.shard, wb);
        if (fsdp_mixed()) free(pos, h2d);  // copied into _mp_shard
        else inputs.push_back(h2d);
      }
      unsharded_[u] = alloc(pos, add_buffer("unsharded." + u, Tier::gpu, Category::buffers, gathered));
      for (uint32_t b : inputs) free(pos, b);
      return;
    }
    std::vector<uint32_t> inputs;
    if (fsdp_offload()) {
      if (fsdp_mixed()) {
        const uint32_t one = temp("h2d_shard.", fu.largest, wb);  // one parameter's at a time
        inputs.push_back(temp("ag_copy_in.", fu.shard, p_bytes_));
        free(pos, one);
      } else {
        inputs.push_back(temp("h2d_shard.", fu.shard, wb));
      }
    } else if (fsdp_mixed()) {
      inputs.push_back(temp("ag_copy_in.", fu.shard, p_bytes_));
    }
    ag_out_[u] = alloc(pos, add_buffer("ag_out." + u, Tier::gpu, Category::buffers, gathered));
    for (uint32_t b : inputs) free(pos, b);
  }
  void fsdp_start_run(int32_t pos, int32_t r) {
    const std::size_t ru = static_cast<std::size_t>(r);
    const std::string u = fsdp_unit_of(run_group_[ru], s_);
    const bool bwd = run_bwd_[ru];
    if (bwd && fwd_ag_kept_ != UINT32_MAX) {  // the end of the root's forward frees it
      free(pos, fwd_ag_kept_);
      fwd_ag_kept_ = UINT32_MAX;
    }
    if (!unsharded_.contains(u)) {
      fsdp_issue(pos, u);
      if (!fsdp1()) {
        unsharded_[u] = alloc(pos, add_buffer("unsharded." + u, Tier::gpu, Category::buffers,
                                              fsdp_gathered_bytes(u)));
        const uint32_t flat = ag_out_.at(u);
        ag_out_.erase(u);
        if (bwd) {
          free(pos, flat);
        } else {
          if (fwd_ag_kept_ != UINT32_MAX) free(pos, fwd_ag_kept_);
          fwd_ag_kept_ = flat;
        }
      }
    }
    if (ru + 1 < run_group_.size() && (!fsdp1() || bwd))
      fsdp_issue(pos, fsdp_unit_of(run_group_[ru + 1], s_));
  }
  void fsdp_end_run(int32_t pos, int32_t r) {
    const std::size_t ru = static_cast<std::size_t>(r);
    const std::string u = fsdp_unit_of(run_group_[ru], s_);
    const bool bwd = run_bwd_[ru];
    if (fsdp1()) {  // a unit (the root) may span several runs: its last one decides
      if (bwd ? r != last_bwd_run_.at(u) : (r != last_fwd_run_.at(u) || !fsdp_reshards_after_forward(u)))
        return;
    } else if (!bwd && !fsdp_reshards_after_forward(u)) {
      return;
    }
    free(pos, unsharded_.at(u));
    unsharded_.erase(u);
    if (bwd) fsdp_reduce_scatter(pos, u);
  }
  // Reduce-scatter a unit's gradients once its backward is done (at the end of backward for
  // gradients written by ops that read no weight, such as the embedding's).
  void fsdp_reduce_scatter(int32_t pos, const std::string& u) {
    std::vector<TensorId> mine;
    std::erase_if(pending_, [&](TensorId gt) {
      if (fsdp_unit_of(g_.tensor(gt).group, s_) != u) return false;
      mine.push_back(gt);
      return true;
    });
    if (mine.empty()) return;
    const FsdpUnit& fu = fsdp_unit(u);
    const uint64_t w = fsdp_w(), rb = fsdp_reduce_bytes(), wb = fsdp_weight_bytes();
    auto buffer = [&](const char* name, uint64_t elems, uint64_t b) {
      return alloc(pos, add_buffer(name + u, Tier::gpu, Category::buffers,
                                   fsdp_bytes(elems, b, "reduce-scatter buffer")));
    };
    // The sharded gradient is the persistent state (model_states) unless it is cast from the
    // reduce dtype or goes to the host: then the reduce-scatter output is a buffer of its own.
    const bool own_output = rb != wb || fsdp_offload();
    if (fsdp1()) {
      std::vector<uint32_t> held;
      held.push_back(buffer("flat_grad.", fu.flat, p_bytes_));
      for (TensorId gt : mine) free(pos, grad_buffer_[static_cast<std::size_t>(gt)]);
      if (rb != p_bytes_) {
        const uint32_t cast = buffer("flat_grad_reduce_dtype.", fu.flat, rb);
        free(pos, held.back());
        held.back() = cast;
      }
      const uint64_t padded = checked_mul(fu.shard, w, "padded gradient");
      if (fu.flat != padded) held.push_back(buffer("rs_input.", padded, rb));
      if (own_output) {
        held.push_back(buffer("rs_output.", fu.shard, rb));
        if (fsdp_offload() && rb != wb) free(pos, buffer("grad_to_host.", fu.shard, wb));
      }
      for (uint32_t b : held) free(pos, b);
      return;
    }
    const uint32_t in = buffer("rs_input.", checked_mul(fu.shard, w, "reduce-scatter input"), rb);
    for (TensorId gt : mine) free(pos, grad_buffer_[static_cast<std::size_t>(gt)]);
    if (own_output) {
      const uint32_t out = buffer("rs_output.", fu.shard, rb);
      if (fsdp_offload() && rb != wb) free(pos, buffer("grad_to_host.", fu.shard, wb));
      if (fsdp_replicas(s_) > 1) all_reduce_held_.push_back(out);
      else free(pos, out);
    }
    if (rs_input_ != UINT32_MAX) free(pos, rs_input_);
    rs_input_ = in;
  }

  // DeepSpeed (stages 1-3, no offload) upcasts the 16-bit gradient partition to fp32 for
  // its optimizer step (single_partition_of_fp32_groups[i].grad), freed after the step.
  // zeroplan's CPU Adam reads 16-bit gradients directly and needs no such buffer.
  //
  // With the optimizer offloaded (and no delayed update), the CPU Adam writes the new 16-bit
  // parameters into two pinned host tiles of min(kOffloadTileElems, partition) elements,
  // alternating, and each full tile is copied to the device while the next one is computed
  // (DeepSpeed's cpu_adam double buffer of TILE elements); in fp32 training the master
  // weights are copied directly.
  //
  // With the optimizer on NVMe (no delayed update), the swap buffers come first (see
  // optimizer_swap_buffer_bytes), and the tiles hold one chunk each.
  //
  // FSDP's AdamW (the fsdp profile): PyTorch's default foreach implementation takes
  // torch._foreach_sqrt(exp_avg_sq) as a new list, one temporary the size of the shard in the
  // moments' dtype (torch/optim/adam.py _multi_tensor_adam; planner/notes/
  // fsdp-and-optimizers-memory.md sec. 4); the fused kernel (torchtitan's default) none.
  // The for-loop implementations (Strategy::optimizer_impl) instead take one tensor at a
  // time: their temporaries are sized by the largest tensor the optimizer is handed (under
  // fsdp its shard: FSDP2 a parameter's, FSDP1 a unit's), twice for torch's (the sqrt and its
  // quotient), once for transformers' AdamW (sqrt, then add_ in place).
  uint64_t largest_tensor_elems() const {
    uint64_t most = 0;
    // FSDP: the largest tensor its optimizer is handed, FSDP2's largest dim-0 shard or FSDP1's
    // largest flat shard (fsdp_units).
    if (fsdp()) {
      for (const auto& [name, u] : fsdp_units_) most = std::max(most, u.largest);
      return most;
    }
    for (const models::ParamTensor& p : models::count_params(g_.model).tensors) {
      std::vector<int64_t> shape = rank_shape(p, g_.options);
      if (shape.empty()) continue;
      uint64_t n = 1;
      for (int64_t d : shape) n = checked_mul(n, static_cast<uint64_t>(d), "tensor elements");
      most = std::max(most, n);
    }
    return most;
  }
  void optimizer_buffers(int32_t pos) {
    if (torch_native()) {
      const bool adam = s_.optimizer == OptimizerKind::adam || s_.optimizer == OptimizerKind::adamw;
      const bool pure = weights_in_compute_dtype(s_);
      // FSDP's CPU offload: the sharded parameters are on the host, so is the step and its
      // temporaries; torch.optim defaults to its for-loop there (foreach is for CUDA tensors,
      // optimizer.py _default_to_fused_or_foreach).
      const bool host = fsdp() && fsdp_offload();
      const Tier tier = host ? Tier::cpu : Tier::gpu;
      const OptimizerImpl impl = host && s_.optimizer_impl == OptimizerImpl::foreach
                                     ? OptimizerImpl::for_loop
                                     : s_.optimizer_impl;
      if (s_.optimizer == OptimizerKind::adafactor) {
        // transformers' Adafactor (optimization.py Adafactor.step) updates one tensor at a
        // time through full-size fp32 temporaries, two alive at once three times: grad**2
        // and + eps; the old update while _approx_sq_grad's product is made; update and
        // -update at the end. Twice the largest tensor.
        const uint64_t n = largest_tensor_elems();
        const uint32_t a = add_buffer("adafactor_update", tier, Category::workspace,
                                      checked_mul(4, n, "Adafactor temporary"));
        const uint32_t b = add_buffer("adafactor_update2", tier, Category::workspace,
                                      checked_mul(4, n, "Adafactor temporary"));
        alloc(pos, a);
        alloc(pos, b);
        free(pos, a);
        free(pos, b);
        return;
      }
      if (s_.fused_optimizer || impl == OptimizerImpl::fused || !adam) return;
      const uint64_t held = s_.stage >= 3 ? out_.partition_elems : out_.n_params;
      const uint64_t w = pure ? p_bytes_ : 4;
      std::vector<uint32_t> temps;
      switch (impl) {
        case OptimizerImpl::foreach:
          temps.push_back(add_buffer("foreach_sqrt", tier, Category::workspace,
                                     checked_mul(w, held, "foreach temporary")));
          break;
        case OptimizerImpl::for_loop:
          temps.push_back(add_buffer("adam_sqrt", tier, Category::workspace,
                                     checked_mul(w, largest_tensor_elems(), "Adam temporary")));
          temps.push_back(add_buffer("adam_denom", tier, Category::workspace,
                                     checked_mul(w, largest_tensor_elems(), "Adam temporary")));
          break;
        case OptimizerImpl::transformers:
          temps.push_back(add_buffer("adam_denom", tier, Category::workspace,
                                     checked_mul(w, largest_tensor_elems(), "Adam temporary")));
          break;
        case OptimizerImpl::fused: break;
      }
      for (uint32_t b : temps) alloc(pos, b);
      for (uint32_t b : temps) free(pos, b);
      return;
    }
    append_offload_buffers(out_, pos, s_, out_.partition_elems, p_bytes_);
    // DeepSpeed 0.14.1 to 0.16.x, stages 1-2 with the optimizer offloaded (strategy.hpp
    // deepspeed_version): the updated fp32 partition is copied to the GPU before its cast.
    const uint32_t v = s_.deepspeed_version;
    if (o_.profile == Profile::deepspeed && s_.offload_optimizer != Offload::none &&
        (s_.stage == 1 || s_.stage == 2) && v >= 1401 && v < 1700 && s_.precision != Precision::fp32) {
      const uint32_t b = add_buffer("fp32_partition_on_gpu", Tier::gpu, Category::workspace,
                                    checked_mul(4, out_.partition_elems, "fp32 partition"));
      alloc(pos, b);
      free(pos, b);
    }
    // Partial offload: the GPU's sub-groups are stepped one at a time by a torch.optim.AdamW
    // with default arguments (stage3.py backup_optimizer, _optimizer_step), which on CUDA
    // runs the foreach implementation: torch._foreach_sqrt(exp_avg_sqs) is a temporary of
    // the sub-group in the moments' dtype (planner/notes/fsdp-and-optimizers-memory.md sec. 4).
    if (o_.profile == Profile::deepspeed && max_gpu_sub_group_ > 0) {
      const uint64_t m = s_.master_precision == Precision::bf16 ? 2 : 4;
      const uint32_t b = add_buffer("foreach_sqrt.gpu_sub_group", Tier::gpu, Category::workspace,
                                    checked_mul(m, max_gpu_sub_group_, "foreach temporary"));
      alloc(pos, b);
      free(pos, b);
    }
    if (o_.profile != Profile::deepspeed || s_.offload_optimizer != Offload::none) return;
    if (s_.precision == Precision::fp32 || s_.stage == 0) return;
    // The step flattens the 16-bit gradient partition into a new buffer and converts that to
    // the master's dtype (fp32, or bf16 with bf16_master_weights_and_grads), then drops the
    // flat copy (stage_1_and_2.py step: flatten(averaged_gradients) then .to(); stage3.py
    // _prepare_fp32_grad_for_sub_group): at stage 3 one optimizer sub-group at a time.
    const uint64_t n = s_.stage == 3 && max_sub_group_ > 0 ? std::min(max_sub_group_, out_.partition_elems)
                                                           : out_.partition_elems;
    const uint64_t gb = s_.master_precision == Precision::bf16 ? 2 : 4;
    const uint32_t flat = add_buffer("grad_partition_flat", Tier::gpu, Category::workspace,
                                     checked_mul(p_bytes_, n, "flat gradient partition"));
    const uint32_t b = add_buffer("fp32_grad_partition", Tier::gpu, Category::workspace,
                                  checked_mul(gb, n, "fp32 gradient partition"));
    alloc(pos, flat);
    alloc(pos, b);
    free(pos, flat);
    free(pos, b);
  }
};

}  // namespace

DeviceTotal outside_allocator(const Strategy& s, const PlanOptions& o) {
  if (o.backend == Backend::cpu) return {};
  if (o.profile == Profile::zeroplan) {
    const CudaOutsideArenaBound b = cuda_outside_arena_bound(s);
    return {.context = b.context, .cublas_workspace = b.cublas_workspace,
            .nccl = b.nccl_buffers + b.nccl_nvls};
  }
  return {.context = kCudaContextBytes, .cublas_workspace = kCublasWorkspaceBytes,
          .nccl = s.dp > 1 ? kTorchNcclBytes : 0};
}

// (Micro-batch, model chunk) pairs whose activations a pipeline stage holds at once
// (pipeline.hpp in_flight_closed_form, with the sources: GPipe m; 1F1B min(p - i, m);
// interleaved Megatron's warmup + 1 chunks).
int64_t pipeline_in_flight(const Strategy& s, int64_t stage) {
  if (s.pp <= 1) return 1;
  return in_flight_closed_form(s.pp_schedule, s.pp, s.grad_accum, s.vp, stage);
}

MemorySchedule build_schedule(const TrainingGraph& g, const Strategy& s, const PlanOptions& o) {
  MemorySchedule out;
  ScheduleBuilder(g, s, o, out).build();
  // The deepspeed profile's peak is the device total; zeroplan's stays its arena.
  if (o.profile != Profile::zeroplan) out.outside = outside_allocator(s, o);
  return out;
}

MemoryReport replay(const MemorySchedule& s, const PlanOptions& o) {
  MemoryReport r;
  ArenaModel arena(kArenaAlignment);
  // With the GPU's capacity known, PyTorch's allocator releases its cached segments when a
  // new one would not fit (c10 CUDACachingAllocator: release_cached_blocks and retry): the
  // model does the same at the capacity less what the process holds outside it.
  const uint64_t outside_bytes = s.outside.outside();
  CachingAllocatorModel caching(o.gpu_capacity > outside_bytes ? o.gpu_capacity - outside_bytes
                                                               : UINT64_MAX);
  caching.allow_over_capacity(true);
  std::vector<BlockId> block(s.buffers.size(), 0);
  std::array<std::array<uint64_t, kCategories.size()>, kTiers.size()> cur{};
  std::array<uint64_t, kTiers.size()> cur_total{}, peak_total{}, peak_reserved{};
  const bool use_caching = o.profile != Profile::zeroplan;  // PyTorch's caching allocator

  auto gpu_reserved = [&] { return use_caching ? caching.reserved() : arena.reserved(); };
  // One sample per position, at its high point: within a position the schedule allocates
  // first and frees after, so the sample is taken before the position's first free (or when
  // the next position starts, for a position that only allocates).
  int32_t last_pos = -2, sampled_pos = -2;
  const auto n_ops = static_cast<int32_t>(s.op_names.size());
  auto sample = [&](int32_t pos) {
    if (sampled_pos == pos || pos >= n_ops) return;  // past the last op: between steps
    sampled_pos = pos;
    TimelineSample t;
    t.pos = pos;
    t.bytes = cur;
    r.timeline.push_back(t);
  };
  // Positions without events (an in-place op) repeat the state before them.
  auto sample_through = [&](int32_t pos) {
    for (int32_t q = last_pos; q <= pos; ++q) sample(q);
  };
  bool init_done = false;
  for (const MemEvent& e : s.events) {
    if (!init_done && e.pos >= 0) {  // everything allocated before the first op: after init
      r.after_init = cur_total;
      init_done = true;
    }
    if (e.empty_cache) {
      if (use_caching) caching.empty_cache();
      continue;
    }
    if (e.pos != last_pos && last_pos != -2) sample_through(e.pos - 1);
    last_pos = e.pos;
    if (!e.alloc) sample(e.pos);
    const MemBuffer& b = s.buffers[e.buffer];
    const std::size_t t = static_cast<std::size_t>(b.tier);
    const std::size_t c = static_cast<std::size_t>(b.category);
    uint64_t bytes = b.bytes;
    if (b.tier == Tier::gpu) {
      if (e.alloc) {
        block[e.buffer] = use_caching ? caching.alloc(b.bytes) : arena.alloc(b.bytes);
      }
      bytes = use_caching ? caching.block_size(block[e.buffer]) : arena.size(block[e.buffer]);
      if (!e.alloc) {
        if (use_caching) caching.free(block[e.buffer]);
        else arena.free(block[e.buffer]);
      }
    } else if (!use_caching) {
      // zeroplan's runtime keeps the host tier (and the nvme tier's address space) in arenas
      // of the same alignment: each block takes whole units of it (0 bytes one unit).
      bytes = round_up(std::max<uint64_t>(bytes, 1), kArenaAlignment);
    }
    if (e.alloc) {
      cur[t][c] += bytes;
      cur_total[t] += bytes;
      if (!init_done) r.init_peak[t] = std::max(r.init_peak[t], cur_total[t]);
      r.per_device[b.tier][b.category] = std::max(r.per_device[b.tier][b.category], cur[t][c]);
      if (cur_total[t] > peak_total[t]) {
        peak_total[t] = cur_total[t];
        if (b.tier == Tier::gpu) r.peak_pos = e.pos;
      }
      if (b.tier == Tier::gpu) peak_reserved[t] = std::max(peak_reserved[t], gpu_reserved());
    } else {
      cur[t][c] -= bytes;
      cur_total[t] -= bytes;
    }
  }
  if (!init_done) r.after_init = cur_total;
  if (last_pos != -2) sample_through(static_cast<int32_t>(s.op_names.size()) - 1);
  for (Tier t : kTiers) {
    const std::size_t i = static_cast<std::size_t>(t);
    r.peak_allocated[i] = peak_total[i];
    const uint64_t reserved = t == Tier::gpu ? peak_reserved[i] : peak_total[i];
    r.peak_reserved[i] = reserved;
    // Allocator overhead: what the allocator reserves beyond the bytes in use at the peak;
    // on PyTorch, also what the process holds outside it (the CUDA context, cuBLAS's
    // workspace, NCCL), held all along.
    const uint64_t outside = t == Tier::gpu ? s.outside.outside() : 0;
    r.per_device[t][Category::overhead] = reserved - peak_total[i] + outside;
    r.per_device.set_peak(t, reserved + outside);
  }
  r.device = s.outside;
  r.device.reserved = r.peak_reserved[0];
  return r;
}

nlohmann::json timeline_trace(const MemorySchedule& s, const MemoryReport& r) {
  using nlohmann::json;
  json events = json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 1},
                    {"args", {{"name", "zeroplan memory timeline"}}}});
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 1}, {"tid", 1},
                    {"args", {{"name", "ops"}}}});
  // One microsecond per op: positions, not time (the step-time simulator gives real time).
  for (const TimelineSample& t : r.timeline) {
    const int64_t ts = t.pos + 1;
    for (Tier tier : kTiers) {
      json args = json::object();
      uint64_t total = 0;
      for (Category c : kCategories) {
        const uint64_t v = t.bytes[static_cast<std::size_t>(tier)][static_cast<std::size_t>(c)];
        args[std::string(to_string(c))] = v;
        total += v;
      }
      if (total == 0 && tier != Tier::gpu) continue;
      events.push_back({{"name", fmt::format("{} memory (bytes)", to_string(tier))},
                        {"ph", "C"}, {"ts", ts}, {"pid", 1}, {"args", args}});
    }
    if (t.pos >= 0 && static_cast<std::size_t>(t.pos) < s.op_names.size())
      events.push_back({{"name", s.op_names[static_cast<std::size_t>(t.pos)]}, {"ph", "X"},
                        {"ts", ts}, {"dur", 1}, {"pid", 1}, {"tid", 1}});
  }
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

ActivationSummary summarize_activations(const TrainingGraph& g) {
  ActivationSummary a;
  const int32_t L = static_cast<int32_t>(g.model.n_layer);
  a.saved_per_layer.assign(static_cast<std::size_t>(L), 0);
  a.stats_per_layer.assign(static_cast<std::size_t>(L), 0);
  // Positions: first and last access per tensor, and where the forward pass ends.
  const std::size_t n_t = g.tensors.size();
  const models::Liveness lv = models::liveness(g);
  const std::vector<int32_t>& first = lv.first;
  const std::vector<int32_t>& last = lv.last;
  int32_t end_fwd = -1;
  for (int32_t i = 0; i < static_cast<int32_t>(g.order.size()); ++i)
    if (g.op(g.order[static_cast<std::size_t>(i)]).phase == Phase::forward) end_fwd = i;
  // Saved at the end of the forward pass: produced by then, used after.
  for (std::size_t t = 0; t < n_t; ++t) {
    const models::Tensor& x = g.tensors[t];
    if (!is_dynamic(x.kind) || x.kind == TensorKind::input) continue;
    if (first[t] < 0 || first[t] > end_fwd || last[t] <= end_fwd) continue;
    if (x.source >= 0) {
      a.weight_casts += x.bytes;
      continue;
    }
    a.saved_total += x.bytes;
    if (x.layer >= 0 && x.layer < L) {
      if (x.stats) a.stats_per_layer[static_cast<std::size_t>(x.layer)] += x.bytes;
      else a.saved_per_layer[static_cast<std::size_t>(x.layer)] += x.bytes;
    }
  }
  // Peak of the graph's own tensors (no model states, no ZeRO buffers): allocate at first
  // access, free after the last, sample in between.
  std::vector<uint8_t> state(n_t, 0);  // 0 not yet, 1 live, 2 freed
  uint64_t cur = 0;
  for (int32_t i = 0; i < static_cast<int32_t>(g.order.size()); ++i) {
    const models::Op& op = g.op(g.order[static_cast<std::size_t>(i)]);
    auto each = [&](auto&& f) {
      for (TensorId t : op.inputs) f(static_cast<std::size_t>(t));
      for (TensorId t : op.outputs) f(static_cast<std::size_t>(t));
      for (TensorId t : op.scratch) f(static_cast<std::size_t>(t));
    };
    each([&](std::size_t t) {
      if (state[t] == 0 && is_dynamic(g.tensors[t].kind)) {
        state[t] = 1;
        cur += g.tensors[t].bytes;
      }
    });
    if (cur > a.peak) {
      a.peak = cur;
      a.peak_pos = i;
    }
    each([&](std::size_t t) {
      if (state[t] == 1 && last[t] == i) {
        state[t] = 2;
        cur -= g.tensors[t].bytes;
      }
    });
  }
  return a;
}

}  // namespace zp::planner
