// zp/planner/strategy.hpp: how a model is trained (ZeRO stage, data-parallel degree, batch,
// precision, optimizer, recomputation, offload), with validation and DeepSpeed-config reading.
// Shared by zero-plan and zero-run; command-line parsing lives in tools/cli.
//
// Example usage:
//   zp::planner::Strategy s;                       // stage 0, dp 1, bf16 + Adam
//   s = zp::planner::apply_deepspeed_config(s, zp::parse_json_text(text, "ds.json"), "ds.json");
//   s.dp = 8;                                      // explicit flags override the config
//   zp::planner::validate(s);                      // zp::Error on contradictions
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "zp/planner/pipeline.hpp"

namespace zp::planner {

enum class Precision { fp32, fp16, bf16 };
// The optimizer, by what it keeps per parameter (model_states.hpp optimizer_state_bytes has
// each one's bytes and sources). Spellings (--optimizer, strategy JSON): adam, adamw; sgd (with
// momentum: one buffer); sgd-plain (torch.optim.SGD's default momentum=0: no state); lion (one
// momentum buffer); adafactor (transformers' defaults: no first moment, a factored second
// moment); adam8bit (bitsandbytes' Adam8bit/AdamW8bit: two uint8 states with fp32 absmax per
// 256-element block).
enum class OptimizerKind { adam, adamw, sgd, sgd_plain, lion, adafactor, adam8bit };
// Activation checkpointing, spelled none, full, selective, selective-op (models::Recompute has
// what each keeps): full is Hugging Face's gradient_checkpointing and torchtitan's full AC,
// selective Megatron's attention-core recomputation, selective-op torchtitan's per-op
// selective AC (every second matmul saved).
enum class Checkpointing { none, full, selective, selective_op };
enum class Offload { none, cpu, nvme };
// Which routed-token activations a Mixture-of-Experts plan sizes (--moe-routing): balanced,
// each rank's experts receive as many rows as it sends (k*B*T); worst, every token of the
// expert-parallel group chooses this rank's experts.
enum class MoeRouting { balanced, worst };
// Context parallelism (--cp-kind): how attention sees a sequence split over cp ranks.
//   ring: Megatron-LM's context parallelism (ring attention through TransformerEngine: each
//     rank keeps its T/cp queries, the keys and values travel around the ring in blocks,
//     attention runs blockwise with an online softmax; Liu et al. 2023, "Ring Attention with
//     Blockwise Transformers");
//   ulysses: DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all turns the T/cp tokens x
//     all heads of q, k and v into all T tokens x heads/cp, attention runs whole on those
//     heads, and a second all-to-all turns the output back.
enum class CpKind { ring, ulysses };
// PyTorch's own optimizer implementation, where the framework runs one (the fsdp and pytorch
// profiles; --optimizer-impl), by the temporaries its Adam step allocates:
//   foreach: torch.optim's default on CUDA since torch 2.0 (_multi_tensor_adam): torch.
//     _foreach_sqrt(exp_avg_sq) as a new list, one temporary the size of all the moments;
//   fused: AdamW(fused=True) (torchtitan's default; --fused-optimizer): none;
//   for-loop: foreach=False, torch 1.x's default (_single_tensor_adam): per tensor
//     (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps), the sqrt and its quotient alive
//     together: twice the largest tensor;
//   transformers: transformers' own AdamW (optimization.py AdamW, the Trainer's "adamw_hf",
//     its default before v4.39's "adamw_torch"): exp_avg_sq.sqrt().add_(eps) per tensor, the
//     largest tensor once.
enum class OptimizerImpl { foreach, fused, for_loop, transformers };

std::string_view to_string(Precision p);
// "0.4.0" <-> 400 (Strategy::deepspeed_version); "current" for 0. nullopt when unparsable.
std::optional<uint32_t> deepspeed_version_from_string(std::string_view s);
std::string deepspeed_version_string(uint32_t v);
// "1.10" <-> 110 (Strategy::torch_version, major * 100 + minor); "current" for 0.
std::optional<uint32_t> torch_version_from_string(std::string_view s);
std::string torch_version_string(uint32_t v);
std::string_view to_string(OptimizerKind o);
std::string_view to_string(Checkpointing c);
std::string_view to_string(Offload o);
std::string_view to_string(MoeRouting r);
std::string_view to_string(CpKind k);
std::optional<CpKind> cp_kind_from_string(std::string_view s);
std::string_view to_string(OptimizerImpl i);
std::optional<OptimizerImpl> optimizer_impl_from_string(std::string_view s);
std::optional<Precision> precision_from_string(std::string_view s);
std::optional<OptimizerKind> optimizer_from_string(std::string_view s);
std::optional<Checkpointing> checkpointing_from_string(std::string_view s);
std::optional<Offload> offload_from_string(std::string_view s);
std::optional<MoeRouting> moe_routing_from_string(std::string_view s);

// Sizes of the communication and prefetch buffers, in elements, with DeepSpeed's names and
// defaults (deepspeed/runtime/zero/config.py).
// reduce_bucket_size and prefetch_bucket_size 0 mean "auto" (a DeepSpeed config written for
// the Hugging Face Trainer): resolve_for_model sets them as the Trainer does from the model's
// hidden size h (transformers integrations/deepspeed.py, HfTrainerDeepSpeedConfig.
// trainer_config_finalize): h*h and 0.9*h*h.
struct BufferSizes {
  uint64_t reduce_bucket_size = 500'000'000;          // zero_optimization.reduce_bucket_size
  uint64_t allgather_bucket_size = 500'000'000;       // zero_optimization.allgather_bucket_size
  uint64_t prefetch_bucket_size = 50'000'000;         // stage3_prefetch_bucket_size
  uint64_t max_live_parameters = 1'000'000'000;       // stage3_max_live_parameters
  // --offload-optimizer nvme (zeroplan's pipelined optimizer swapper, no DeepSpeed name):
  // fp32 elements per chunk of each swapped state (a multiple of 1024, so a chunk is whole
  // 4096-byte O_DIRECT blocks; 1 Mi elements = 4 MiB = 4 of DeepSpeed's 1 MiB aio blocks per
  // file, so one chunk of three files keeps more than aio queue_depth 8 requests in flight),
  // and the host buffer sets it streams through (3: read k+1 || update k || write k-1;
  // DeepSpeed's offload_optimizer.buffer_count plays this role, default 4).
  uint64_t optimizer_swap_chunk_size = uint64_t{1} << 20;
  uint64_t optimizer_swap_buffer_count = 3;
  // --offload-optimizer cpu (no DeepSpeed config name: its CPU Adam's compile-time TILE,
  // 128 Mi elements): 16-bit parameters per pinned host tile through which the updated
  // parameters return to the device, two tiles alternating (planner::kOffloadTileElems).
  // A multiple of 256 elements: whole 256-byte arena blocks (planner::kArenaAlignment), so
  // the arena's rounding adds nothing the plan does not count.
  uint64_t offload_tile_size = uint64_t{128} * 1024 * 1024;
  // --offload-param nvme, DeepSpeed's offload_param.buffer_count and buffer_size with their
  // defaults (deepspeed/runtime/zero/offload_config.py: 5 and 1e8): the host buffers that
  // shards of the 16-bit partition are read into from the swap file (and written back from
  // after the optimizer step), and the elements each holds (at most the partition). A shard
  // larger than a buffer is read as several pieces. Prefetch depth (zeroplan's, no DeepSpeed
  // name): how many gathers ahead of the one being served shard reads may be issued, as far
  // as free buffers allow (0: a shard is read when its gather needs it).
  uint64_t param_swap_buffer_count = 5;
  uint64_t param_swap_buffer_size = 100'000'000;
  uint64_t param_swap_prefetch_depth = 2;
  // DeepSpeed stage 3 (the deepspeed profile), deepspeed/runtime/zero/config.py defaults:
  // sub_group_size, the elements of fp32 partition one optimizer sub-group steps at once (its
  // fp32 gradient is the step's only one on the GPU: stage3.py _prepare_fp32_grad_for_sub_group);
  // stage3_param_persistence_threshold, parameters of at most this many elements stay whole
  // on every GPU after their first gather (parameter_offload.py; kPersistenceAuto: the
  // Trainer's "auto", 10 x hidden size, set by resolve_for_model).
  uint64_t sub_group_size = 1'000'000'000;
  uint64_t param_persistence_threshold = 100'000;
  bool operator==(const BufferSizes&) const = default;
};

// The tokens per sequence a plan takes when --seq is left out: the model's context, but at
// most kDefaultSeq. 4096 is the context Llama 2 was pretrained at (Touvron et al. 2023,
// sec. 2.2) and as long as the common fine-tuning lengths (2048-4096); models with 32k-128k
// contexts are rarely trained at their full length, and at 131072 tokens the T x T scores
// of eager attention alone need terabytes. The headline says what was assumed.
inline constexpr int64_t kDefaultSeq = 4096;

inline constexpr uint64_t kPersistenceAuto = UINT64_MAX;

// Strategy::fsdp_shard_size: a node's GPUs (resolve_for_hardware takes the hardware's).
inline constexpr int64_t kFsdpShardNode = -1;

struct Strategy {
  int stage = 0;                  // 0 plain data parallel, 1 P_os, 2 P_os+g, 3 P_os+g+p
  int64_t dp = 1;                 // data-parallel degree Nd (ranks holding one replica each)
  // Tensor (model) parallel degree t (--tp, alias --mp; "mp" in the strategy JSON, "tp" too):
  // Megatron's column- and row-parallel linears split heads and MLP columns t ways.
  int64_t mp = 1;
  // Megatron's sequence parallelism (Korthikanti et al. 2022 sec. 4.2.2): the norms, dropouts
  // and residual stream between the tensor-parallel regions are split along the sequence
  // over the t ranks (all-gather before a column-parallel linear, reduce-scatter after a
  // row-parallel one, instead of the all-reduce). No effect with t = 1 (Megatron turns it off).
  bool sp = false;
  // Pipeline parallelism: the blocks split into pp stages of L/pp consecutive blocks (the
  // first holds the embedding, the last the final norm, head and loss), each stage on its own
  // ranks; vp model chunks per stage (Megatron's virtual pipeline stages, the interleaved
  // schedule) when > 1. Micro-batches per step: grad_accum.
  int64_t pp = 1;
  int64_t vp = 1;
  // The pipeline's schedule (pipeline.hpp): 1f1b by default, interleaved with vp > 1 (as
  // Megatron-LM picks it), or gpipe (all forwards, then all backwards).
  PipelineSchedule pp_schedule = PipelineSchedule::one_f_one_b;
  // Context parallelism: every sequence split into cp parts of T/cp tokens on cp ranks.
  int64_t cp = 1;
  CpKind cp_kind = CpKind::ring;
  int64_t micro_batch = 1;        // B, sequences per rank per micro-step
  int64_t seq = 0;                // T, tokens per sequence; 0 means the model's maximum
  int64_t grad_accum = 1;         // micro-steps per optimizer step
  Precision precision = Precision::bf16;
  OptimizerKind optimizer = OptimizerKind::adam;
  Checkpointing checkpointing = Checkpointing::none;
  bool flash_attention = false;
  Offload offload_optimizer = Offload::none;
  Offload offload_param = Offload::none;
  bool dpu = false;               // one-step delayed parameter update (ZeRO-Offload sec. 5.2)
  bool partition_activations = false;  // ZeRO-R P_a: checkpoints split over the mp ranks
  // ZeRO-R's Pa+cpu (DeepSpeed's activation_checkpointing.cpu_checkpointing, which needs
  // partition_activations): each activation checkpoint is copied to the host after its
  // block's forward and back before the block is recomputed (deepspeed/runtime/
  // activation_checkpointing/checkpointing.py, CPU_CHECKPOINT).
  bool cpu_checkpointing = false;
  // DeepSpeed's activation_checkpointing.contiguous_memory_optimization, with
  // number_checkpoints (checkpointing.py partition_activations; it needs
  // partition_activations, and number_checkpoints >= the checkpoints of one forward): the
  // first checkpoint of a forward allocates number_checkpoints buffers of one partition each,
  // on the device (on the host with cpu_checkpointing), and each checkpoint's partition is
  // copied into the next one instead of being kept. The deepspeed profile. 0: not given.
  // (synchronize_checkpoint_boundary and profile are read and move no memory.)
  bool contiguous_memory_optimization = false;
  int64_t number_checkpoints = 0;
  // Expert parallelism (Mixture-of-Experts models; DeepSpeed-MoE, Rajbhandari et al. 2022
  // sec. 4): each MoE layer's routed experts are split over ep ranks (E/ep each), and the
  // expert parameters' ZeRO partitions span the expert-data-parallel group of dp/ep ranks
  // instead of dp. Divides dp and the expert count; 1 for a dense model.
  int64_t ep = 1;
  MoeRouting moe_routing = MoeRouting::balanced;
  // DeepSpeed-MoE's capacity_factor (MoE(..., capacity_factor=, drop_tokens=True)): each expert
  // takes at most ceil(k*B*T*cf/E) rows (at least 4), the rest are dropped; 0: dropless.
  double moe_capacity_factor = 0;
  // Encoder-decoder models (T5): the decoder's tokens per sequence; 0 means seq.
  int64_t target_seq = 0;
  // zero_optimization.overlap_comm: stages 2-3 reduce a gradient bucket while backward goes
  // on (the bucket stays alive until the next one is issued, so two can be alive at once),
  // and stage 3 waits for a prefetched all-gather only when its run starts. Unset: DeepSpeed's
  // default, false for stages 0-2 and true for stage 3 (deepspeed/runtime/zero/config.py: an
  // unset overlap_comm becomes stage == 3). See overlaps_comm().
  std::optional<bool> overlap_comm;
  // zero_optimization.contiguous_gradients (the deepspeed profile, stages 1-3; DeepSpeed's
  // default true, deepspeed/runtime/zero/config.py): each gradient is copied into the
  // engine's reduce_bucket_size-element ipg buffer when autograd has finished it and its own
  // tensor is freed at once; false keeps every gradient in its own tensor until its bucket is
  // reduced. Stages 1-2 with the optimizer offloaded always copy (stage_1_and_2.py:
  // contiguous_gradients or cpu_offload). schedule.cpp deepspeed_reduce_hook has the buffers.
  bool contiguous_gradients = true;
  // zero_optimization.offload_optimizer.ratio (the deepspeed profile, stage 3 with the
  // optimizer on the CPU; DeepSpeed's default 1.0, offload_config.py): the fraction of the
  // optimizer sub-groups stepped by the CPU Adam. stage3.py _create_fp32_partitions keeps the
  // first int((1 - ratio) x n) of the n sub-groups on the GPU, fp32 master, fp32 gradient and
  // the moments of a torch AdamW (its backup_optimizer) with them; schedule.cpp
  // deepspeed_stage3_tensors sizes them.
  double offload_optimizer_ratio = 1.0;
  // How the model reaches deepspeed.initialize (the deepspeed profile; schedule.cpp
  // deepspeed_model_arrives). zero_init: built partitioned, each parameter split over the
  // ranks as its module is created (deepspeed.zero.Init, which transformers' from_pretrained
  // enters under an active stage-3 DeepSpeed config: modeling_utils.py, is_deepspeed_zero3_
  // enabled); unset: on at stage 3 (builds_partitioned). Otherwise the model is built whole
  // and deepspeed.initialize casts it to the 16-bit dtype, moves it to the GPU and then
  // flattens (stages 1-2) or partitions (stage 3) it: a transient before the first step.
  // load_on_gpu: the dtype the script's model is in on the GPU before deepspeed.initialize
  // (model.to("cuda"), from_pretrained(device_map="cuda", torch_dtype=...)); unset: on the
  // host, where the Trainer and accelerate leave it (trainer.py: place_model_on_device is
  // false with DeepSpeed).
  std::optional<bool> zero_init;
  std::optional<Precision> load_on_gpu;
  // The dtype of the weights the optimizer updates and of the gradient it reads: fp32 (mixed
  // precision's master weights), or bf16 with --precision bf16 (DeepSpeed's
  // bf16.bf16_master_weights_and_grads, a bf16 master partition; under the fsdp profile a bf16
  // model without a mixed-precision policy, as torchtune trains: the bf16 sharded parameters
  // are the weights, no second copy). Adam's moments: fp32, or bf16 (DeepSpeed's
  // bf16.bf16_optimizer_states; torch's AdamW on bf16 parameters keeps bf16 moments), which
  // needs a bf16 master.
  Precision master_precision = Precision::fp32;
  Precision optimizer_precision = Precision::fp32;
  // The gradients' dtype (--grad-precision): unset, the training precision; fp32 with 16-bit
  // training is Megatron-LM's main_grad, the DDP grad buffer that accumulates and reduces in
  // fp32 (megatron/training/arguments.py validate_args: on with --bf16 unless
  // --grad-reduce-in-bf16, off with --fp16 unless --accumulate-allreduce-grads-in-fp32):
  // 4 bytes of gradient per parameter. Planned at stages 0-1 (the distributed optimizer is
  // stage 1) with the optimizer on the GPU.
  std::optional<Precision> grad_precision;
  // PyTorch FSDP (the fsdp profile; stage 3 is FULL_SHARD / fully_shard): whether a
  // transformer block's parameters are freed after its forward and all-gathered again for
  // backward (FSDP2's reshard_after_forward, torchtitan's default; false is FSDP1's
  // SHARD_GRAD_OP); the dtype gradients are reduce-scattered in (MixedPrecisionPolicy.
  // reduce_dtype: torchtitan fp32, accelerate the parameter dtype); and whether AdamW runs
  // fused (one kernel, no temporaries; torchtitan's default) or foreach (PyTorch's default on
  // CUDA, whose sqrt of exp_avg_sq is a temporary the size of the shard).
  // ZeRO++ hpZ (zero_optimization.zero_hpz_partition_size, the deepspeed profile, stage 3): a
  // secondary copy of the 16-bit parameters partitioned over this many ranks (a node), which
  // backward gathers from: ceil(P/H) more elements per rank (partition_parameters.py
  // _partition_param_sec). 1: none.
  int64_t hpz_partition_size = 1;
  // ZeRO++ qwZ (zero_optimization.zero_quantized_weights, the deepspeed profile, stage 3):
  // parameters are all-gathered as int8 with an fp32 scale per group of about 8000 elements
  // and dequantized on arrival (schedule.cpp deepspeed_quantized_gather).
  bool quantized_weights = false;
  // The DeepSpeed release the deepspeed profile predicts, major * 10000 + minor * 100 + patch
  // (0: the current one). Releases whose allocations differ from today's:
  // - up to 0.4.0, stage 3 with the optimizer offloaded allocated at init two 16-bit GPU
  //   buffers the size of the largest optimizer sub-group's partition (its then default
  //   sub_group_size 1e12 made that the whole partition); backward wrote the gradient
  //   partition into one (stage3.py of v0.4.0, temp_grad_buffer_for_gpu_offload and
  //   temp_grad_gpu_buffer; fixed by PR #1150 in 0.4.1, removed by PR #1453 in 0.6.0);
  // - from 0.14.1 to 0.16.x, stage 1-2 ZeRO-Offload copied the updated fp32 partition to the
  //   GPU before casting it (PR #5301, April 2024, until PR #7309, May 2025, in 0.17.0): a
  //   transient 4 x partition bytes on the GPU at the step.
  // planner/notes/deepspeed-memory.md sec. 5 and 6 have the commits.
  uint32_t deepspeed_version = 0;
  // The PyTorch release the PyTorch-run profiles predict (deepspeed, fsdp, pytorch), major *
  // 100 + minor (0: the current one). Releases whose allocations differ from today's:
  // - before 1.11, softmax and log_softmax kept their input for backward beside their output
  //   (derivatives.yaml passed `self` to _softmax_backward_data only for its dtype; pytorch
  //   issue #64000, fixed for 1.11 by "Avoid saving self for softmax and log_softmax",
  //   PR #65242): eager attention keeps a second T x T tensor per layer.
  uint32_t torch_version = 0;
  bool reshard_after_forward = true;
  Precision reduce_precision = Precision::fp32;
  bool fused_optimizer = false;
  // Which of PyTorch's Adam implementations runs when not fused (OptimizerImpl).
  OptimizerImpl optimizer_impl = OptimizerImpl::foreach;
  // PyTorch FSDP (the fsdp profile), which of its two implementations runs:
  // - 2: fully_shard (torch/distributed/fsdp/_fully_shard, torchtitan's and torchtune's; the
  //   default): every parameter sharded along dim 0, ceil(d0/W) rows per rank;
  // - 1: FullyShardedDataParallel (torch/distributed/fsdp/fully_sharded_data_parallel.py,
  //   accelerate's default fsdp_version): one FlatParameter per wrapped unit, padded to a
  //   multiple of W and split into W equal shards; with use_orig_params (accelerate's
  //   launcher default) each parameter also starts 16-byte aligned in it (_flat_param.py
  //   _get_aligned_numel).
  int fsdp_version = 2;
  bool fsdp_use_orig_params = false;  // FSDP1's use_orig_params (PyTorch's default False)
  // Hybrid sharding (FSDP1's HYBRID_SHARD and _HYBRID_SHARD_ZERO2, FSDP2's fully_shard on a
  // 2-D (replicate, shard) DeviceMesh, HSDP): parameters, gradients and optimizer states
  // sharded over groups of fsdp_shard_size ranks, replicated over dp / fsdp_shard_size such
  // groups, whose sharded gradients are all-reduced. 0: no hybrid (the shard group is all dp
  // ranks); kFsdpShardNode: a node's GPUs (FSDP1's default groups, _init_utils.py
  // _init_intra_and_inter_node_groups(device_count())), settled from the hardware.
  int64_t fsdp_shard_size = 0;
  BufferSizes buffers;
  // A training checkpoint is saved (zero-run --save-checkpoint; zero-plan --checkpoint): each
  // rank's states go to disk through a host staging buffer (checkpoint_staging_bytes) once
  // the step is over, which the plan then counts in the host tier.
  bool save_checkpoint = false;
  bool operator==(const Strategy&) const = default;
};

// Whether the model is built partitioned (deepspeed.zero.Init): Strategy::zero_init, on by
// default at stage 3, never at stages 0-2.
inline bool builds_partitioned(const Strategy& s) { return s.stage == 3 && s.zero_init.value_or(true); }

// Whether the collectives of s overlap compute: s.overlap_comm, or DeepSpeed's default for
// its stage (true for stage 3 only). Stages 0-1 reduce once per step, after backward, so the
// answer changes nothing there.
bool overlaps_comm(const Strategy& s);

// Whether a flushed gradient bucket stays alive while its reductions are in flight (the
// engine's and schedule.cpp's flush_if_full): overlap_comm at stages 2-3 with more than one
// data-parallel rank. With one there is nothing to reduce, so holding the bucket would only
// cost memory (DeepSpeed's stage 1-2 keeps its two ipg buffers even then; the deepspeed
// profile's replay models DeepSpeed's allocator, not this engine's buckets).
bool holds_buckets_in_flight(const Strategy& s);

// Contradictions and out-of-range values as zp::Error naming the flag. Checks that need the
// model (--ep against the expert count, --target-seq against a decoder-only model) are
// resolve_for_model's (estimate.hpp).
void validate(const Strategy& s);

// The expert-data-parallel degree dp/ep: the ranks over which expert parameters (and their
// gradients, master weights and optimizer states) are ZeRO-partitioned.
// Bytes of one gradient element: the training dtype's, or Strategy::grad_precision's.
inline uint64_t grad_bytes(const Strategy& s) {
  const Precision p = s.grad_precision.value_or(s.precision);
  return p == Precision::fp32 ? 4 : 2;
}

// ZeRO's partition group: the data-parallel ranks times the context-parallel ones, which hold
// the same parameters and reduce the same gradients (Megatron's distributed optimizer shards
// over intra_dp_cp_group, megatron/core/optimizer/__init__.py; finalize_model_grads.py reduces
// over get_data_parallel_group(with_context_parallel=True); DeepSpeed-Ulysses partitions over
// its sequence-data-parallel group).
inline int64_t zero_dp(const Strategy& s) { return s.dp * (s.cp > 0 ? s.cp : 1); }
inline int64_t expert_dp(const Strategy& s) { return zero_dp(s) / (s.ep > 0 ? s.ep : 1); }

// The GPUs one replica of the model spans (tp x pp x cp) and the job's world (times dp).
inline int64_t model_parallel_ranks(const Strategy& s) { return s.mp * s.pp * s.cp; }
inline int64_t world_size(const Strategy& s) { return s.dp * model_parallel_ranks(s); }

// PyTorch FSDP's shard group (the fsdp profile): fsdp_shard_size ranks under hybrid sharding,
// else every data-parallel rank; and the replicas of each shard, dp / that, whose sharded
// gradients are all-reduced (1 without hybrid sharding).
inline int64_t fsdp_shard_world(const Strategy& s) {
  return s.fsdp_shard_size > 0 ? s.fsdp_shard_size : s.dp;
}
inline int64_t fsdp_replicas(const Strategy& s) { return s.dp / fsdp_shard_world(s); }

// Fills a strategy from a DeepSpeed config (its JSON object). Fields it reads:
// zero_optimization.{stage, offload_optimizer.{device, buffer_count},
// offload_param.{device, buffer_count, buffer_size},
// reduce_bucket_size, allgather_bucket_size, stage3_prefetch_bucket_size,
// stage3_max_live_parameters, overlap_comm}, fp16.enabled, bf16.enabled, train_micro_batch_size_per_gpu,
// gradient_accumulation_steps, optimizer.type, activation_checkpointing. DeepSpeed fields
// that do not change memory are accepted and ignored; unknown fields are an error. "auto"
// (which the Hugging Face Trainer replaces with its own values) leaves the field as it was,
// except the two bucket sizes the Trainer derives from the model (BufferSizes: 0, set by
// resolve_for_model); each "auto" adds a line to `assumed` (when given) saying what the plan
// takes for it and which flag settles it.
Strategy apply_deepspeed_config(Strategy base, const nlohmann::json& ds, const std::string& origin,
                                std::vector<std::string>* assumed = nullptr);

nlohmann::json to_json(const Strategy& s);
Strategy strategy_from_json(const nlohmann::json& j, const std::string& origin);

// One line for humans: "stage 2, dp 8, bf16, adam, B=1 T=1024, offload optimizer=cpu"
// (", ep 4" and ", worst-case routing" for expert parallelism).
std::string describe(const Strategy& s);

}  // namespace zp::planner
