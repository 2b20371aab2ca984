// estimate.cpp: one model + one strategy -> per-device memory, and the fit check.
#include "zp/planner/estimate.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/checked.hpp"
#include "zp/error.hpp"
#include "zp/planner/model_states.hpp"
#include "zp/units.hpp"

namespace zp::planner {

Strategy resolve_for_model(Strategy s, const models::ModelSpec& m,
                           std::vector<std::string>* assumed) {
  auto note = [&](std::string line) {
    if (assumed != nullptr) assumed->push_back(std::move(line));
  };
  validate(s);
  // DeepSpeed's contiguous checkpoint buffers (checkpointing.py partition_activations): the
  // k-th checkpoint of a forward is copied into buffer k of number_checkpoints, all sized by
  // the first one; more checkpoints than buffers is an IndexError there, a larger one a
  // failing copy_.
  if (s.contiguous_memory_optimization && s.number_checkpoints < m.n_blocks())
    throw Error(fmt::format("--number-checkpoints {}: {} checkpoints {} blocks per forward",
                            s.number_checkpoints, m.name, m.n_blocks()),
                fmt::format("DeepSpeed's contiguous buffers run out at checkpoint {} (an "
                            "IndexError in partition_activations): --number-checkpoints {}",
                            s.number_checkpoints + 1, m.n_blocks()));
  if (s.seq == 0) {
    s.seq = std::min<int64_t>(m.n_positions, kDefaultSeq);
    note(s.seq < m.n_positions
             ? fmt::format("--seq {} (the model's context is {}; --seq sets the length you "
                           "train at)", s.seq, m.n_positions)
             : fmt::format("--seq {} (the model's context)", s.seq));
  }
  if (s.contiguous_memory_optimization && m.encoder_decoder() && s.target_seq > 0 &&
      s.target_seq != s.seq)
    throw Error("--contiguous-memory-optimization: the encoder's and the decoder's checkpoints "
                "differ in size",
                "DeepSpeed sizes every buffer by the first checkpoint (homogeneous checkpoints "
                "only); leave out --target-seq or --contiguous-memory-optimization");
  // "auto" bucket sizes of a Trainer's DeepSpeed config, from the hidden size as the Trainer
  // sets them (strategy.hpp BufferSizes).
  const uint64_t h = static_cast<uint64_t>(m.n_embd);
  if (s.buffers.reduce_bucket_size == 0) {
    s.buffers.reduce_bucket_size = checked_mul(h, h, "reduce_bucket_size");
    note(fmt::format("zero_optimization.reduce_bucket_size \"auto\": hidden_size^2 = {}, as "
                     "the Trainer sets it", s.buffers.reduce_bucket_size));
  }
  if (s.buffers.param_persistence_threshold == kPersistenceAuto) {
    s.buffers.param_persistence_threshold = checked_mul(10, h, "stage3_param_persistence_threshold");
    note(fmt::format("zero_optimization.stage3_param_persistence_threshold \"auto\": 10 x "
                     "hidden_size = {}, as the Trainer sets it", s.buffers.param_persistence_threshold));
  }
  if (s.buffers.prefetch_bucket_size == 0) {
    s.buffers.prefetch_bucket_size =
        checked_mul(checked_mul(h, h, "stage3_prefetch_bucket_size"), 9, "stage3_prefetch_bucket_size") / 10;
    note(fmt::format("zero_optimization.stage3_prefetch_bucket_size \"auto\": 0.9 x "
                     "hidden_size^2 = {}, as the Trainer sets it", s.buffers.prefetch_bucket_size));
  }
  // A learned position table has n_positions rows: no longer sequence has a position. Rotary,
  // ALiBi and relative positions have no table (estimate() notes the longer context).
  if (s.seq > m.n_positions && m.positions == models::Positions::learned)
    throw Error(fmt::format("--seq: {} is longer than {}'s {} positions", s.seq, m.name,
                            m.n_positions),
                fmt::format("use --seq {} or less", m.n_positions));
  if (s.ep > 1 && !m.is_moe())
    throw Error(fmt::format("--ep {}: {} is a dense model, it has no experts to place", s.ep,
                            m.name),
                "expert parallelism applies to Mixture-of-Experts models; leave out --ep");
  if (s.moe_capacity_factor > 0 && !m.is_moe())
    throw Error(fmt::format("--moe-capacity-factor: {} is a dense model, it has no experts",
                            m.name),
                "the capacity factor applies to Mixture-of-Experts models; leave it out");
  if (m.is_moe() && m.moe.n_experts % s.ep != 0)
    throw Error(fmt::format("--ep {}: must divide {}'s {} experts", s.ep, m.name,
                            m.moe.n_experts),
                "each rank of an expert-parallel group holds experts/ep whole experts");
  if (s.moe_routing != MoeRouting::balanced && !m.is_moe())
    throw Error(fmt::format("--moe-routing {}: {} is a dense model, nothing is routed",
                            to_string(s.moe_routing), m.name),
                "leave out --moe-routing");
  if (s.target_seq > 0 && !m.encoder_decoder())
    throw Error(fmt::format("--target-seq {}: {} is decoder-only, it has no decoder stack of "
                            "its own length", s.target_seq, m.name),
                "--target-seq sets the decoder length of encoder-decoder models (T5); use --seq");
  // T5's decoder length defaults to the encoder's (--seq).
  if (m.encoder_decoder() && s.target_seq == 0) s.target_seq = s.seq;
  return s;
}

Strategy resolve_for_hardware(Strategy s, const Hardware* hw, std::vector<std::string>* assumed) {
  if (s.fsdp_shard_size != kFsdpShardNode || hw == nullptr) return s;
  // FSDP1's HYBRID_SHARD without process groups shards over the node's devices
  // (torch/distributed/fsdp/_init_utils.py _init_process_group_state_for_hybrid_shard:
  // _init_intra_and_inter_node_groups(default_group, device_count())); fewer ranks than a
  // node's GPUs are one node of that many devices.
  const int64_t n = std::min<int64_t>(hw->gpus_per_node, s.dp);
  if (n < 1 || s.dp % n != 0)
    throw Error(fmt::format("hybrid sharding over a node: {}'s {} GPUs per node do not divide "
                            "--dp {}", hw->name, hw->gpus_per_node, s.dp),
                "give the shard group with --fsdp-shard-size N (N divides --dp)");
  s.fsdp_shard_size = n;
  if (assumed != nullptr)
    assumed->push_back(fmt::format("--fsdp-shard-size {} (hybrid sharding over a node's GPUs, "
                                   "{}'s gpus_per_node)", n, hw->name));
  validate(s);
  return s;
}

void check_profile(const Strategy& s, const PlanOptions& o, const models::ModelSpec* m) {
  if (s.quantized_weights && o.profile != Profile::deepspeed)
    throw Error(fmt::format("--quantized-weights: DeepSpeed's ZeRO++ qwZ, not {}'s",
                            to_string(o.profile)),
                "plan it with --profile deepspeed");
  if (s.offload_optimizer_ratio < 1 && o.profile != Profile::deepspeed)
    throw Error(fmt::format("--offload-optimizer-ratio: DeepSpeed's partial offload, not {}'s",
                            to_string(o.profile)),
                "plan it with --profile deepspeed");
  if (o.profile != Profile::fsdp && (s.fsdp_shard_size != 0 || s.fsdp_version != 2))
    throw Error(fmt::format("--fsdp-shard-size and --fsdp-version: PyTorch FSDP's, not {}'s",
                            to_string(o.profile)),
                "plan hybrid sharding and FSDP1 with --profile fsdp (DeepSpeed's counterpart "
                "of hybrid sharding is ZeRO++ hpZ, --hpz-partition-size)");
  if (s.cpu_checkpointing && o.profile != Profile::deepspeed)
    throw Error(fmt::format("--cpu-checkpointing: DeepSpeed's activation checkpointing, not "
                            "{}'s", to_string(o.profile)),
                "plan it with --profile deepspeed");
  if (s.contiguous_memory_optimization && o.profile != Profile::deepspeed)
    throw Error(fmt::format("--contiguous-memory-optimization: DeepSpeed's activation "
                            "checkpointing, not {}'s", to_string(o.profile)),
                "plan it with --profile deepspeed");
  // Pipeline, context and sequence parallelism are Megatron-LM's and DeepSpeed's (its
  // PipelineEngine, DeepSpeed-Ulysses); the PyTorch profiles model DDP and FSDP without them.
  if ((s.pp > 1 || s.cp > 1 || s.sp) &&
      (o.profile == Profile::pytorch || o.profile == Profile::fsdp))
    throw Error(fmt::format("--profile {}: {} is not modelled for it",
                            to_string(o.profile), s.pp > 1 ? "--pp" : s.cp > 1 ? "--cp" : "--sp"),
                "plan pipeline, context and sequence parallelism with --profile zeroplan or "
                "deepspeed");
  if (s.grad_precision && *s.grad_precision != s.precision && o.profile != Profile::zeroplan)
    throw Error(fmt::format("--grad-precision {}: Megatron-LM's main_grad, not {}'s",
                            to_string(*s.grad_precision), to_string(o.profile)),
                "plan Megatron-style fp32 gradients with --profile zeroplan");
  if (o.profile == Profile::pytorch) {
    if (s.stage != 0)
      throw Error(fmt::format("--profile pytorch: --stage {}: plain PyTorch does not partition", s.stage),
                  "--stage 0 (one GPU or DDP); ZeRO is --profile deepspeed, sharding --profile fsdp");
    // --precision fp16|bf16 on fp32 weights is autocast (models::GraphOptions::autocast),
    // whose casts the graph follows for dense decoder and encoder stacks.
    const bool autocast = s.precision != Precision::fp32 && s.master_precision != Precision::bf16;
    if (autocast && m != nullptr) {
      const char* what = m->is_moe()                              ? "Mixture-of-Experts layers"
                         : m->attention == models::Attention::mla ? "multi-head latent attention"
                         : m->qk_norm != models::QkNorm::none     ? "q/k norms"
                         : m->encoder_decoder()                   ? "encoder-decoder stacks"
                                                                  : nullptr;
      if (what != nullptr)
        throw Error(fmt::format("--profile pytorch --precision {}: autocast on fp32 weights is "
                                "not modelled for {}'s {} yet", to_string(s.precision), m->name, what),
                    "plan --precision fp32, or a 16-bit model with --master-weights bf16 "
                    "(--precision bf16)");
    }
    if (s.offload_optimizer != Offload::none || s.mp > 1 || s.ep > 1)
      throw Error("--profile pytorch: no offload, tensor or expert parallelism",
                  "plain PyTorch replicates the model on every rank");
    return;
  }
  if (o.profile != Profile::fsdp) return;
  if (s.stage != 3)
    throw Error(fmt::format("--profile fsdp: --stage {} has no FSDP sharding strategy", s.stage),
                "FSDP shards parameters, gradients and optimizer states together: --stage 3 "
                "(FULL_SHARD, fully_shard; --no-reshard-after-forward for SHARD_GRAD_OP); "
                "plain data parallel is --profile deepspeed --stage 0");
  // FSDP offloads the sharded parameters with their gradients and the optimizer step
  // (CPUOffload(offload_params=True), CPUOffloadPolicy), never the optimizer alone.
  if (s.offload_optimizer != Offload::none)
    throw Error(fmt::format("--profile fsdp --offload-optimizer {}: FSDP has no optimizer-only "
                            "offload", to_string(s.offload_optimizer)),
                "--offload-param cpu moves FSDP's sharded parameters, their gradients and the "
                "optimizer step to the host (accelerate's fsdp_offload_params: true); "
                "ZeRO-Offload is --profile deepspeed");
  if (s.offload_param == Offload::nvme)
    throw Error("--profile fsdp --offload-param nvme: FSDP offloads to the host only",
                "--offload-param cpu, or ZeRO-Infinity's NVMe offload with --profile deepspeed");
  if (s.fsdp_shard_size == kFsdpShardNode)
    throw Error("--fsdp-shard-size node: hybrid sharding over a node needs the node's GPUs",
                "give --hardware (its GPUs per node), or the shard group as --fsdp-shard-size N");
  if (s.ep > 1 || s.mp > 1)
    throw Error("--profile fsdp: expert and tensor parallelism are not modelled for FSDP yet",
                "leave out --ep and --mp, or use --profile deepspeed");
}

std::vector<std::string> shortfalls(const PerDevice& d, const Strategy& s, const Hardware& hw) {
  std::vector<std::string> out;
  const uint64_t ranks = static_cast<uint64_t>(
      std::min<int64_t>(checked_mul(s.dp, model_parallel_ranks(s), "ranks"), hw.gpus_per_node));
  auto check = [&](Tier t, uint64_t per_rank, uint64_t capacity, std::string_view what) {
    const uint64_t need = checked_mul(per_rank, ranks, "bytes per node");
    if (need > capacity)
      out.push_back(fmt::format("{}: needs {} of {}, has {}", to_string(t), format_bytes(need),
                                what, format_bytes(capacity)));
  };
  const uint64_t gpu = d.peak(Tier::gpu);
  if (gpu > hw.gpu_memory_bytes)
    out.push_back(fmt::format("gpu: needs {} per GPU, has {}", format_bytes(gpu),
                              format_bytes(hw.gpu_memory_bytes)));
  check(Tier::cpu, d.peak(Tier::cpu), hw.host_memory_bytes, "host memory per node");
  check(Tier::nvme, d.peak(Tier::nvme), hw.nvme_bytes, "NVMe per node");
  return out;
}

Estimate estimate(const models::ModelSpec& m, Strategy s, const Hardware* hw,
                  const PlanOptions& o, std::vector<std::string> assumed) {
  Estimate e;
  e.model = m;
  e.params = models::count_params(m);
  e.assumed = std::move(assumed);
  e.strategy = resolve_for_hardware(resolve_for_model(s, m, &e.assumed), hw, &e.assumed);
  check_profile(e.strategy, o, &m);
  e.options = o;
  if (hw != nullptr && e.options.gpu_capacity == 0) e.options.gpu_capacity = hw->gpu_memory_bytes;
  if (e.strategy.seq > m.n_positions)
    e.model.notes.push_back(fmt::format(
        "--seq {} is longer than the {} positions the config gives (max_position_embeddings "
        "or n_positions); {} positions have no table, so the plan takes it as written",
        e.strategy.seq, m.n_positions,
        m.positions == models::Positions::rotary ? "rotary"
        : m.positions == models::Positions::alibi ? "ALiBi" : "relative"));
  // One graph per pipeline stage (one without pipelining); the estimate is the most loaded
  // stage's, the others listed beside it.
  models::GraphOptions go = graph_options(m, e.strategy, o);
  for (int64_t st = 0; st < e.strategy.pp; ++st) {
    go.pp_stage = st;
    const models::TrainingGraph g = models::build_training_graph(m, go);
    ActivationSummary act = summarize_activations(g);
    MemorySchedule sched = build_schedule(g, e.strategy, e.options);
    MemoryReport mem = replay(sched, e.options);
    if (e.strategy.pp > 1) {
      PipelineStage ps;
      ps.stage = st;
      ps.blocks = models::stage_blocks(m.n_blocks(), e.strategy.pp, e.strategy.vp, st);
      ps.in_flight = pipeline_in_flight(e.strategy, st);
      ps.n_params = sched.n_params;
      for (const MemBuffer& b : sched.buffers)
        if (b.name == "pp.in_flight") ps.in_flight_bytes = b.bytes;
      ps.per_device = mem.per_device;
      e.stages.push_back(ps);
    }
    if (st == 0 || mem.per_device.peak(Tier::gpu) > e.per_device.peak(Tier::gpu)) {
      e.stage = st;
      e.activations = std::move(act);
      e.schedule = std::move(sched);
      e.memory = std::move(mem);
      e.per_device = e.memory.per_device;
    }
  }
  if (e.strategy.save_checkpoint)
    e.checkpoint = checkpoint_cost(e.strategy, e.schedule.n_params, e.schedule.partition_elems,
                                   go.param_bytes);
  // The device total of both profiles (zeroplan's outside-arena part is a bound).
  e.memory.device = outside_allocator(e.strategy, o);
  e.memory.device.reserved = e.memory.peak_reserved[0];
  if (hw != nullptr) {
    e.hardware = *hw;
    e.shortfalls = shortfalls(e.per_device, e.strategy, *hw);
    // Another stage may miss on a tier where the most loaded one (by gpu) does not.
    for (const PipelineStage& ps : e.stages)
      if (ps.stage != e.stage)
        for (const std::string& why : shortfalls(ps.per_device, e.strategy, *hw))
          e.shortfalls.push_back(fmt::format("pipeline stage {}: {}", ps.stage, why));
    e.fits = e.shortfalls.empty();
  }
  return e;
}

nlohmann::json model_json(const models::ModelSpec& m, const models::ParamInventory& inv) {
  nlohmann::json j = {{"name", m.name},
          {"family", m.family_name()},
          {"params", inv.total},
          {"total_params", inv.total},
          {"active_params", inv.active},
          {"n_layer", m.n_layer},
          {"n_embd", m.n_embd},
          {"n_head", m.n_head},
          {"n_kv_head", m.n_kv_head},
          {"n_inner", m.n_inner},
          {"n_positions", m.n_positions},
          {"vocab_size", m.vocab_size},
          {"tied_embeddings", m.tied_embeddings},
          {"params_per_layer", inv.per_layer},
          {"params_embedding", inv.embedding},
          {"largest_module", inv.largest_module},
          {"largest_module_params", inv.largest_module_params},
          {"n_decoder_layer", m.n_decoder_layer},
          {"notes", m.notes}};
  // Mixture of experts: a token passes top_k of the experts routed experts of each MoE layer.
  if (m.is_moe())
    j["moe"] = {{"experts", m.moe.n_experts},
                {"top_k", m.moe.top_k},
                {"active_params", inv.active},
                {"expert_params", inv.experts}};
  return j;
}

nlohmann::json to_json(const Estimate& e) {
  nlohmann::json j = {{"schema", "zero-plan/estimate/v1"},
                      {"model", model_json(e.model, e.params)},
                      {"strategy", to_json(e.strategy)},
                      {"profile", to_string(e.options.profile)},
                      {"backend", to_string(e.options.backend)},
                      {"per_device", to_json(e.per_device)}};
  j["activations"] = {{"saved_per_layer", e.activations.saved_per_layer},
                      {"stats_per_layer", e.activations.stats_per_layer},
                      {"saved_at_end_of_forward", e.activations.saved_total},
                      {"graph_peak", e.activations.peak}};
  nlohmann::json alloc = nlohmann::json::object();
  for (Tier t : kTiers)
    alloc[std::string(to_string(t))] = e.memory.peak_allocated[static_cast<std::size_t>(t)];
  j["peak_allocated"] = alloc;
  if (e.checkpoint)
    j["checkpoint"] = {{"bytes_per_element", e.checkpoint->bytes_per_element},
                       {"rank_bytes", e.checkpoint->rank_bytes},
                       {"total_bytes", e.checkpoint->total_bytes},
                       {"staging_bytes", e.checkpoint->staging_bytes},
                       {"writers", e.checkpoint->writers}};
  // Pipeline parallelism: per_device above is the most loaded stage's; every stage here.
  if (!e.stages.empty()) {
    nlohmann::json stages = nlohmann::json::array();
    for (const PipelineStage& ps : e.stages)
      stages.push_back({{"stage", ps.stage},
                        {"blocks", ps.blocks},
                        {"in_flight", ps.in_flight},
                        {"in_flight_activations", ps.in_flight_bytes},
                        {"params", ps.n_params},
                        {"per_device", to_json(ps.per_device)}});
    j["pipeline"] = {{"pp", e.strategy.pp},
                     {"vp", e.strategy.vp},
                     {"schedule", to_string(e.strategy.pp_schedule)},
                     {"micro_batches", e.strategy.grad_accum},
                     {"most_loaded_stage", e.stage},
                     {"stages", stages}};
  }
  // The three figures a user compares with: torch.cuda.max_memory_allocated (peak_allocated),
  // max_memory_reserved (peak_reserved; the cpu and nvme tiers reserve what they allocate),
  // and nvidia-smi's device total (the reservation plus the context, cuBLAS's workspace and
  // NCCL; null on the cpu backend, which has no device).
  nlohmann::json reserved = nlohmann::json::object();
  for (Tier t : kTiers)
    reserved[std::string(to_string(t))] = e.memory.peak_reserved[static_cast<std::size_t>(t)];
  j["peak_reserved"] = reserved;
  nlohmann::json init = nlohmann::json::object();
  for (Tier t : kTiers)
    init[std::string(to_string(t))] = e.memory.after_init[static_cast<std::size_t>(t)];
  j["after_init_allocated"] = init;
  // The high-water of bytes in use during initialization (a model built whole before
  // deepspeed.initialize partitions it), part of the peaks above.
  nlohmann::json init_peak = nlohmann::json::object();
  for (Tier t : kTiers)
    init_peak[std::string(to_string(t))] = e.memory.init_peak[static_cast<std::size_t>(t)];
  j["init_peak_allocated"] = init_peak;
  const DeviceTotal& d = e.memory.device;
  j["device_total"] = e.options.backend == Backend::cpu
                          ? nlohmann::json(nullptr)
                          : nlohmann::json{{"bytes", d.total()},
                                           {"reserved", d.reserved},
                                           {"context", d.context},
                                           {"cublas_workspace", d.cublas_workspace},
                                           {"nccl", d.nccl},
                                           {"bound", e.options.profile == Profile::zeroplan}};
  j["partition_elems"] = e.schedule.partition_elems;
  if (e.model.is_moe()) {
    // Of partition_elems, the routed experts' (partitioned over dp/ep ranks), and the rows
    // each MoE layer's experts process on this rank per micro-step (--moe-routing).
    j["expert_partition_elems"] = e.schedule.expert_partition_elems;
    j["moe_routing"] = to_string(e.strategy.moe_routing);
  }
  j["assumed"] = e.assumed;
  j["fits"] = e.fits ? nlohmann::json(*e.fits) : nlohmann::json(nullptr);
  if (e.hardware) j["hardware"] = to_json(*e.hardware);
  j["shortfalls"] = e.shortfalls;
  return j;
}

}  // namespace zp::planner
