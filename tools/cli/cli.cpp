// cli.cpp: the shared strategy flags and the error convention of zero-plan and zero-run.
#include "cli.hpp"

#include <cmath>

#include <cstdio>
#include <iostream>

#include <fmt/format.h>

#include "zp/error.hpp"
#include "zp/json_fields.hpp"
#include "zp/units.hpp"
#include "zp/planner/accelerate_config.hpp"
#include "zp/planner/megatron_args.hpp"
#include "zp/planner/model_states.hpp"

#include <nlohmann/json.hpp>

namespace zp::cli {

using planner::Strategy;

void add_strategy_flags(CLI::App& app, StrategyFlags& f) {
  f.app = &app;
  auto* g = "Strategy";
  app.add_option("--stage", f.stage, "ZeRO stage: 0 plain data parallel, 1 optimizer states "
                 "partitioned (P_os), 2 + gradients (P_os+g), 3 + parameters (P_os+g+p) [0]")
      ->group(g);
  app.add_option("--dp", f.dp, "data-parallel degree: ranks sharing the ZeRO partitions [1]")->group(g);
  app.add_option("--tp,--mp", f.mp,
                 "tensor-parallel degree (Megatron's column/row-parallel linears: heads, MLP "
                 "columns and the vocabulary split tp ways); --mp is its older name [1]")
      ->group(g);
  app.add_flag("--sp", f.sp,
               "Megatron's sequence parallelism: norms, dropouts and the residual stream split "
               "along the sequence over the --tp ranks (all-gather / reduce-scatter instead of "
               "all-reduce)")
      ->group(g);
  app.add_option("--pp", f.pp,
                 "pipeline-parallel degree: the blocks split into pp stages of L/pp blocks, "
                 "first stage with the embedding, last with the head and loss; --grad-accum "
                 "is the micro-batches per step [1]")
      ->group(g);
  app.add_option("--vp", f.vp,
                 "model chunks per pipeline stage (Megatron's virtual pipeline stages, the "
                 "interleaved 1F1B schedule); needs --pp [1]")
      ->group(g);
  app.add_option("--grad-precision", f.grad_precision,
                 "the gradients' dtype: fp32 with 16-bit training is Megatron's main_grad (its "
                 "DDP buffer accumulates and reduces in fp32; on with --bf16), 4 bytes per "
                 "parameter; stages 0-1 [the training precision]")
      ->group(g);
  app.add_option("--pp-schedule", f.pp_schedule,
                 "gpipe (all forwards, then all backwards: every micro-batch in flight), 1f1b "
                 "(PipeDream-Flush, Megatron's default: stage i holds min(pp - i, micro-batches)) "
                 "or interleaved (1F1B over --vp model chunks per stage) [1f1b; interleaved "
                 "with --vp]")
      ->group(g);
  app.add_option("--cp", f.cp,
                 "context-parallel degree: every sequence split into cp parts of T/cp tokens "
                 "on cp ranks [1]")
      ->group(g);
  app.add_option("--cp-kind", f.cp_kind,
                 "ring (Megatron's context parallelism: keys and values passed around a ring, "
                 "blockwise attention) or ulysses (DeepSpeed-Ulysses: all-to-all to all tokens "
                 "x heads/cp and back) [ring]")
      ->group(g);
  app.add_option("--micro-batch", f.micro_batch, "sequences per rank per micro-step [1]")->group(g);
  app.add_option("--seq", f.seq, "tokens per sequence [the model's context, at most 4096]")->group(g);
  app.add_option("--grad-accum", f.grad_accum, "micro-steps per optimizer step [1]")->group(g);
  app.add_option("--precision", f.precision, "fp32, fp16 or bf16 (16-bit: fp32 master weights) [bf16]")
      ->group(g);
  app.add_option("--optimizer", f.optimizer,
                 "adam, adamw; sgd (with momentum) or sgd-plain (momentum 0: no state); lion (one "
                 "momentum buffer); adafactor (transformers' defaults: no first moment, factored "
                 "second moment; flat, unfactored partitions under ZeRO stages 1-3); adam8bit "
                 "(bitsandbytes: uint8 moments, an fp32 absmax per 256 elements, fp32 below "
                 "4096 elements) [adam]")
      ->group(g);
  app.add_option("--checkpointing", f.checkpointing,
                 "activation recomputation: none, full (per layer), selective (Megatron: the "
                 "attention core) or selective-op (torchtitan's per-op policy: every second "
                 "matmul, attention and top-k outputs kept) [none]")
      ->group(g);
  app.add_option("--attention", f.attention,
                 "eager (softmax of T x T scores kept for backward, transformers' "
                 "attn_implementation=\"eager\"), sdpa (PyTorch's fused scaled_dot_product_"
                 "attention, transformers' default: no T x T tensor kept) or flash (the same "
                 "memory; zero-run runs it on the cpu backend) [sdpa with --profile deepspeed, "
                 "eager with zeroplan: zero-run's three-step kernels, which its CUDA backend runs too]")
      ->group(g);
  app.add_flag("--flash-attention", f.flash_attention, "the same as --attention flash")->group(g);
  app.add_option("--offload-optimizer", f.offload_optimizer,
                 "none, cpu (ZeRO-Offload) or nvme (ZeRO-Infinity) [none]")->group(g);
  app.add_flag("--zero-init,!--no-zero-init", f.zero_init,
               "--profile deepspeed, stage 3: the model is built partitioned under "
               "deepspeed.zero.Init, as transformers' from_pretrained does under a stage-3 "
               "config; --no-zero-init: built whole, then moved to the GPU and partitioned by "
               "deepspeed.initialize (stages 0-2 always are) [on at stage 3]")
      ->group(g);
  app.add_flag("--quantized-weights", f.quantized_weights,
               "--profile deepspeed, stage 3: ZeRO++ qwZ, parameters all-gathered in int8 with "
               "fp32 scales and dequantized on arrival (zero_optimization.zero_quantized_weights)")
      ->group(g);
  app.add_option("--load-on-gpu", f.load_on_gpu,
                 "--profile deepspeed: the script has the model on the GPU in this dtype (fp32, "
                 "fp16 or bf16) before deepspeed.initialize, which casts it there one tensor "
                 "at a time [on the host, as the Trainer leaves it]")
      ->group(g);
  app.add_option("--offload-optimizer-ratio", f.offload_optimizer_ratio,
                 "--profile deepspeed, stage 3 with --offload-optimizer cpu: the fraction of "
                 "optimizer sub-groups stepped on the CPU; the others keep fp32 master, "
                 "gradient and moments on the GPU (offload_optimizer.ratio, ZeRO-Offload++) [1]")
      ->group(g);
  app.add_option("--offload-param", f.offload_param, "none, cpu or nvme; needs --stage 3 [none]")
      ->group(g);
  app.add_flag("--dpu", f.dpu, "one-step delayed parameter update (needs an offloaded optimizer)")
      ->group(g);
  app.add_flag("--checkpoint", f.checkpoint,
               "a training checkpoint is saved (zero-run --save-checkpoint): its bytes on disk per "
               "rank, and its host staging buffer in the cpu peak")
      ->group(g);
  app.add_flag("--partition-activations", f.partition_activations,
               "ZeRO-R P_a: split activation checkpoints over the --mp ranks (needs "
               "--checkpointing full)")
      ->group(g);
  app.add_flag("--cpu-checkpointing", f.cpu_checkpointing,
               "ZeRO-R Pa+cpu: activation checkpoints held on the host between forward and "
               "recomputation (DeepSpeed's activation_checkpointing.cpu_checkpointing; needs "
               "--partition-activations)")
      ->group(g);
  app.add_flag("--contiguous-memory-optimization", f.contiguous_memory_optimization,
               "DeepSpeed's activation_checkpointing.contiguous_memory_optimization: the first "
               "checkpoint of a forward allocates --number-checkpoints buffers of one "
               "partition each, which the checkpoints are copied into (needs "
               "--partition-activations)")
      ->group(g);
  app.add_option("--number-checkpoints", f.number_checkpoints,
                 "activation_checkpointing.number_checkpoints: the buffers "
                 "--contiguous-memory-optimization allocates, one per checkpointed block")
      ->group(g);
  app.add_flag("--overlap-comm,!--no-overlap-comm", f.overlap_comm,
               "stages 2-3: reduce gradient buckets and wait for prefetched all-gathers while "
               "compute goes on (zero_optimization.overlap_comm) [off for stages 0-2, on for 3]")
      ->group(g);
  app.add_flag("--contiguous-gradients,!--no-contiguous-gradients", f.contiguous_gradients,
               "--profile deepspeed, stages 1-3: copy each finished gradient into the engine's "
               "reduce-bucket-size buffer and free its own tensor (zero_optimization."
               "contiguous_gradients); without, gradients stay in their own tensors until "
               "reduced [on]")
      ->group(g);
  app.add_option("--ep", f.ep,
                 "expert-parallel degree (Mixture-of-Experts models): each MoE layer's experts "
                 "split over ep ranks; expert parameters ZeRO-partitioned over dp/ep; divides "
                 "--dp and the expert count [1]")
      ->group(g);
  app.add_option("--moe-routing", f.moe_routing,
                 "routed-token activations to size (MoE): balanced (k*B*T rows per rank) or "
                 "worst (every token of the ep group choosing this rank's experts) [balanced]")
      ->group(g);
  app.add_option("--moe-capacity-factor", f.moe_capacity_factor,
                 "DeepSpeed-MoE's token dropping: each expert takes at most "
                 "ceil(k*B*T*factor/E) rows (at least 4); 0 routes every token (dropless) [0]")
      ->group(g);
  app.add_option("--target-seq", f.target_seq,
                 "decoder tokens per sequence of an encoder-decoder model (T5) [--seq]")
      ->group(g);
  app.add_option("--master-weights", f.master_weights,
                 "dtype of the weights the optimizer updates and of their gradients: fp32 "
                 "(mixed precision), or bf16 with --precision bf16 (DeepSpeed's "
                 "bf16_master_weights_and_grads; under --profile fsdp a bf16 model without a "
                 "mixed-precision policy, as torchtune trains) [fp32]")
      ->group(g);
  app.add_option("--optimizer-states", f.optimizer_states,
                 "dtype of Adam's moments: fp32, or bf16 (DeepSpeed's bf16_optimizer_states; "
                 "needs --master-weights bf16) [fp32; bf16 under --profile fsdp with "
                 "--master-weights bf16]")
      ->group(g);
  auto* fs = "PyTorch FSDP (--profile fsdp)";
  app.add_flag("--reshard-after-forward,!--no-reshard-after-forward", f.reshard_after_forward,
               "free each block's all-gathered parameters after its forward and gather them "
               "again for backward (FSDP2's reshard_after_forward; off is FSDP1's "
               "SHARD_GRAD_OP) [on]")
      ->group(fs);
  app.add_option("--reduce-dtype", f.reduce_dtype,
                 "dtype gradients are reduce-scattered in (MixedPrecisionPolicy.reduce_dtype): "
                 "fp32 (torchtitan) or bf16 (accelerate's default) [fp32]")
      ->group(fs);
  app.add_flag("--fused-optimizer", f.fused_optimizer,
               "AdamW(fused=True), torchtitan's default: no temporaries; without it PyTorch's "
               "foreach AdamW holds a sqrt(exp_avg_sq) the size of the shard")
      ->group(fs);
  app.add_option("--optimizer-impl", f.optimizer_impl,
                 "which PyTorch Adam runs (--profile fsdp|pytorch), by its temporaries: foreach "
                 "(torch >= 2.0's default: a sqrt of all the moments), fused (none), for-loop "
                 "(foreach=False, torch 1.x's default: twice the largest tensor), transformers "
                 "(the Trainer's adamw_hf before v4.39: the largest tensor) [foreach]")
      ->group(fs);
  app.add_option("--fsdp-version", f.fsdp_version,
                 "2: fully_shard, each parameter sharded along dim 0 (torchtitan, torchtune); 1: "
                 "FullyShardedDataParallel, one flat parameter per wrapped unit padded to a "
                 "multiple of the shard group (accelerate's default fsdp_version) [2]")
      ->group(fs);
  app.add_flag("--fsdp-use-orig-params", f.fsdp_use_orig_params,
               "FSDP1's use_orig_params: each parameter 16-byte aligned in the flat parameter "
               "(accelerate's launcher sets it) [off, PyTorch's default]")
      ->group(fs);
  app.add_option("--fsdp-shard-size", f.fsdp_shard_size,
                 "hybrid sharding (FSDP1's HYBRID_SHARD, FSDP2's HSDP on a 2-D mesh): shard over "
                 "groups of N ranks, replicate over dp/N groups whose gradients are all-reduced; "
                 "N divides --dp, or `node` for a node's GPUs (--hardware) [all dp ranks]")
      ->group(fs);
  app.add_option("--ds-config", f.ds_config,
                 "DeepSpeed JSON config; fills the fields above, explicit flags override it")
      ->group(g);
  app.add_option("--megatron-args", f.megatron_args,
                 "a Megatron-LM argument list in one string (\"--tensor-model-parallel-size 8 "
                 "--bf16 ...\"): fills the fields above (Megatron's defaults for its flags left "
                 "out; explicit flags override), and without --model describes the model")
      ->group(g);
  app.add_option("--fsdp-config", f.fsdp_config,
                 "accelerate config file (YAML from `accelerate config`, or JSON) of an FSDP run: "
                 "fills the fields above and implies --profile fsdp; explicit flags override it")
      ->group(g);
  auto* b = "Buffers (elements, DeepSpeed's names and defaults)";
  app.add_option("--reduce-bucket-size", f.reduce_bucket_size, "gradient reduce bucket [5e8]")->group(b);
  app.add_option("--allgather-bucket-size", f.allgather_bucket_size, "parameter all-gather bucket [5e8]")
      ->group(b);
  app.add_option("--prefetch-bucket-size", f.prefetch_bucket_size, "stage 3 prefetch [5e7]")->group(b);
  app.add_option("--max-live-parameters", f.max_live_parameters, "stage 3 gathered at once [1e9]")
      ->group(b);
  app.add_option("--optimizer-swap-chunk-size", f.optimizer_swap_chunk_size,
                 "--offload-optimizer nvme: fp32 elements per swapped chunk, a multiple of 1024 [1048576]")
      ->group(b);
  app.add_option("--optimizer-swap-buffer-count", f.optimizer_swap_buffer_count,
                 "--offload-optimizer nvme: host buffer sets the chunks stream through [3]")
      ->group(b);
  app.add_option("--offload-tile-size", f.offload_tile_size,
                 "--offload-optimizer cpu: 16-bit parameters per pinned host tile returning to "
                 "the device, two alternating [134217728]")
      ->group(b);
  app.add_option("--param-swap-buffer-count", f.param_swap_buffer_count,
                 "--offload-param nvme: host buffers shard reads go through (offload_param."
                 "buffer_count) [5]")
      ->group(b);
  app.add_option(
         "--param-swap-buffer-size", f.param_swap_buffer_size,
         "--offload-param nvme: 16-bit elements per host buffer (offload_param.buffer_size) [1e8]")
      ->group(b);
  app.add_option("--sub-group-size", f.sub_group_size,
                 "DeepSpeed stage 3: fp32 partition elements one optimizer sub-group steps at "
                 "once (zero_optimization.sub_group_size) [1e9]")
      ->group(b);
  app.add_option("--param-persistence-threshold", f.param_persistence_threshold,
                 "DeepSpeed stage 3: parameters of at most this many elements stay whole on "
                 "every GPU (stage3_param_persistence_threshold) [1e5]")
      ->group(b);
  app.add_option("--hpz-partition-size", f.hpz_partition_size,
                 "DeepSpeed stage 3, ZeRO++ hpZ: a secondary copy of the 16-bit parameters "
                 "partitioned over this many ranks, a node (zero_hpz_partition_size) [1]")
      ->group(b);
  app.add_option("--torch-version", f.torch_version,
                 "the PyTorch release the run uses, e.g. 1.10 (before 1.11 softmax and "
                 "log_softmax kept their input for backward too: eager attention holds a second "
                 "T x T tensor per layer) [current]")
      ->group(g);
  app.add_option("--deepspeed-version", f.deepspeed_version,
                 "the DeepSpeed release to predict, e.g. 0.4.0 (up to 0.4.0 stage 3 with an "
                 "offloaded optimizer held two partition-sized buffers; 0.14.1-0.16.x copied "
                 "the fp32 partition to the GPU in ZeRO-Offload's step) [current]")
      ->group(b);
  app.add_option("--param-swap-prefetch-depth", f.param_swap_prefetch_depth,
                 "--offload-param nvme: gathers ahead whose shard reads may be in flight [2]")
      ->group(b);
}

bool StrategyFlags::given(const std::string& flag) const {
  return app != nullptr && app->get_option(flag)->count() > 0;
}

namespace {
template <typename T, typename Parse>
T parse_enum(const std::string& flag, const std::string& value, Parse parse, const char* expected) {
  auto v = parse(value);
  if (!v)
    throw Error(fmt::format("{}: unknown value '{}'", flag, value), fmt::format("expected {}", expected));
  return *v;
}
int64_t parse_int(const std::string& flag, const std::string& value) {
  const uint64_t v = parse_count(value, flag);
  if (v > static_cast<uint64_t>(INT64_MAX))
    throw Error(fmt::format("{}: '{}' is too large", flag, value));
  return static_cast<int64_t>(v);
}
}  // namespace

Strategy StrategyFlags::resolve(const planner::PlanOptions& o,
                                std::vector<std::string>* assumed) const {
  return resolve_for_gpus(0, o, assumed);
}

Strategy StrategyFlags::resolve_for_gpus(int64_t gpus, const planner::PlanOptions& o,
                                         std::vector<std::string>* assumed) const {
  Strategy s;
  nlohmann::json ds;
  if (has_ds_config() && !fsdp_config.empty())
    throw Error("--ds-config and --fsdp-config describe two different runs",
                "give the DeepSpeed config for --profile deepspeed, the accelerate FSDP config "
                "for --profile fsdp");
  if (!ds_config.empty() && !ds_config_json.is_null())
    throw Error("--ds-config and a DeepSpeed config given in memory", "give one of them");
  if (has_ds_config()) {
    const std::string& origin = ds_config.empty() ? ds_config_origin : ds_config;
    ds = ds_config.empty() ? ds_config_json : parse_json_text(read_text_file(ds_config), ds_config);
    s = planner::apply_deepspeed_config(s, ds, origin, assumed);
  }
  if (!fsdp_config.empty()) {
    if (o.profile != planner::Profile::fsdp)
      throw Error(fmt::format("--fsdp-config: an FSDP run, but --profile {}", planner::to_string(o.profile)),
                  "leave out --profile (--fsdp-config implies fsdp) or give --profile fsdp");
    s = planner::apply_accelerate_config(s, read_text_file(fsdp_config), fsdp_config, assumed);
  }
  const bool mg_given = given("--megatron-args");
  planner::MegatronArgs mg;
  if (mg_given) {
    if (!fsdp_config.empty())
      throw Error("--megatron-args and --fsdp-config describe two different runs",
                  "Megatron's data parallelism is its own (or DeepSpeed's, with --ds-config)");
    mg = planner::parse_megatron_args(megatron_args);
    s = planner::apply_megatron_args(s, mg, n_layer, has_ds_config() ? &ds : nullptr);
  }
  if (given("--stage")) {
    // Accept only 0..3 written as an integer; "4" and "two" get the same one-line error.
    if (stage.size() != 1 || stage[0] < '0' || stage[0] > '3')
      throw Error(fmt::format("--stage: must be 0, 1, 2 or 3, got '{}'", stage),
                  "ZeRO stage 1 partitions optimizer states, 2 adds gradients, 3 adds parameters");
    s.stage = stage[0] - '0';
  }
  if (given("--dp")) s.dp = parse_int("--dp", dp);
  if (given("--tp")) s.mp = parse_int("--tp", mp);
  if (sp) s.sp = true;
  if (given("--pp")) s.pp = parse_int("--pp", pp);
  if (given("--vp")) s.vp = parse_int("--vp", vp);
  if (given("--cp")) s.cp = parse_int("--cp", cp);
  // An explicit --precision overrides the gradient dtype a Megatron command line implied.
  if (given("--precision") && !given("--grad-precision")) s.grad_precision.reset();
  if (given("--grad-precision"))
    s.grad_precision = parse_enum<planner::Precision>("--grad-precision", grad_precision,
                                                      planner::precision_from_string, "fp32, fp16 or bf16");
  if (given("--pp-schedule"))
    s.pp_schedule = parse_enum<planner::PipelineSchedule>("--pp-schedule", pp_schedule,
                                                          planner::pipeline_schedule_from_string,
                                                          "gpipe, 1f1b or interleaved");
  else if (s.vp > 1)
    s.pp_schedule = planner::PipelineSchedule::interleaved;
  if (given("--cp-kind"))
    s.cp_kind = parse_enum<planner::CpKind>("--cp-kind", cp_kind, planner::cp_kind_from_string,
                                            "ring or ulysses");
  if (const int64_t mpr = planner::model_parallel_ranks(s); !given("--dp") && gpus > 0 && mpr >= 1 && gpus % mpr == 0)
    s.dp = gpus / mpr;
  if (given("--ep")) s.ep = parse_int("--ep", ep);
  if (given("--moe-routing"))
    s.moe_routing = parse_enum<planner::MoeRouting>("--moe-routing", moe_routing,
                                                    planner::moe_routing_from_string,
                                                    "balanced or worst");
  if (given("--target-seq")) s.target_seq = parse_int("--target-seq", target_seq);
  if (given("--moe-capacity-factor")) {
    double v = -1;
    try {
      std::size_t used = 0;
      v = std::stod(moe_capacity_factor, &used);
      if (used != moe_capacity_factor.size()) v = -1;
    } catch (const std::exception&) {
      v = -1;
    }
    if (!(v >= 0) || !std::isfinite(v))
      throw Error(fmt::format("--moe-capacity-factor: expected a number >= 0, got '{}'",
                              moe_capacity_factor),
                  "e.g. 1.25 (DeepSpeed's capacity_factor), or 0 for dropless routing");
    s.moe_capacity_factor = v;
  }
  if (given("--micro-batch")) s.micro_batch = parse_int("--micro-batch", micro_batch);
  if (given("--seq")) s.seq = parse_int("--seq", seq);
  if (given("--grad-accum")) s.grad_accum = parse_int("--grad-accum", grad_accum);
  if (given("--precision"))
    s.precision = parse_enum<planner::Precision>("--precision", precision,
                                                 planner::precision_from_string, "fp32, fp16 or bf16");
  if (given("--optimizer"))
    s.optimizer = parse_enum<planner::OptimizerKind>("--optimizer", optimizer,
                                                     planner::optimizer_from_string,
                                                     "adam, adamw, sgd, sgd-plain, lion, adafactor or adam8bit");
  if (given("--checkpointing"))
    s.checkpointing = parse_enum<planner::Checkpointing>(
        "--checkpointing", checkpointing, planner::checkpointing_from_string,
        "none, full, selective or selective-op");
  if (given("--attention")) {
    if (attention == "eager") s.flash_attention = false;
    else if (attention == "sdpa" || attention == "flash") s.flash_attention = true;
    else
      throw Error(fmt::format("--attention: unknown value '{}'", attention),
                  "expected eager, sdpa or flash");
    if (flash_attention && attention == "eager")
      throw Error("--flash-attention contradicts --attention eager", "give one of them");
  } else if (flash_attention) {
    s.flash_attention = true;
  } else if (o.profile != planner::Profile::zeroplan && !mg_given) {
    s.flash_attention = true;  // transformers' default attention keeps no T x T tensor
  }
  if (given("--offload-optimizer"))
    s.offload_optimizer = parse_enum<planner::Offload>(
        "--offload-optimizer", offload_optimizer, planner::offload_from_string, "none, cpu or nvme");
  if (given("--offload-param"))
    s.offload_param = parse_enum<planner::Offload>("--offload-param", offload_param,
                                                   planner::offload_from_string, "none, cpu or nvme");
  if (given("--offload-optimizer-ratio")) {
    double v = -1;
    try {
      std::size_t used = 0;
      v = std::stod(offload_optimizer_ratio, &used);
      if (used != offload_optimizer_ratio.size()) v = -1;
    } catch (const std::exception&) {
      v = -1;
    }
    if (!(v >= 0 && v <= 1))
      throw Error(fmt::format("--offload-optimizer-ratio: expected a number from 0 to 1, got '{}'",
                              offload_optimizer_ratio),
                  "e.g. 0.3 steps 30% of the optimizer sub-groups on the CPU, 70% on the GPU");
    s.offload_optimizer_ratio = v;
  }
  if (dpu) s.dpu = true;
  if (checkpoint) s.save_checkpoint = true;
  auto fp32_or_bf16 = [&](const char* flag, const std::string& v) {
    const auto p = parse_enum<planner::Precision>(flag, v, planner::precision_from_string, "fp32 or bf16");
    if (p == planner::Precision::fp16)
      throw Error(fmt::format("{}: fp16 is not supported, got '{}'", flag, v), "expected fp32 or bf16");
    return p;
  };
  if (given("--master-weights")) s.master_precision = fp32_or_bf16("--master-weights", master_weights);
  // FSDP's moments are zeros_like the (bf16) sharded parameters.
  if ((o.profile == planner::Profile::fsdp || o.profile == planner::Profile::pytorch) &&
      s.master_precision == planner::Precision::bf16)
    s.optimizer_precision = planner::Precision::bf16;
  if (given("--optimizer-states"))
    s.optimizer_precision = fp32_or_bf16("--optimizer-states", optimizer_states);
  if (given("--reduce-dtype")) s.reduce_precision = fp32_or_bf16("--reduce-dtype", reduce_dtype);
  if (given("--reshard-after-forward")) s.reshard_after_forward = reshard_after_forward;
  if (fused_optimizer) s.fused_optimizer = true;
  if (given("--optimizer-impl")) {
    s.optimizer_impl = parse_enum<planner::OptimizerImpl>(
        "--optimizer-impl", optimizer_impl, planner::optimizer_impl_from_string,
        "foreach, fused, for-loop or transformers");
    if (s.optimizer_impl == planner::OptimizerImpl::fused) s.fused_optimizer = true;
  }
  if (given("--fsdp-version")) {
    if (fsdp_version != "1" && fsdp_version != "2")
      throw Error(fmt::format("--fsdp-version: must be 1 or 2, got '{}'", fsdp_version),
                  "1: FullyShardedDataParallel (FlatParameter), 2: fully_shard (per-parameter)");
    s.fsdp_version = fsdp_version[0] - '0';
  }
  if (fsdp_use_orig_params) s.fsdp_use_orig_params = true;
  if (given("--fsdp-shard-size"))
    s.fsdp_shard_size = fsdp_shard_size == "node" ? planner::kFsdpShardNode
                                                  : parse_int("--fsdp-shard-size", fsdp_shard_size);
  if (partition_activations) s.partition_activations = true;
  if (cpu_checkpointing) s.cpu_checkpointing = true;
  if (contiguous_memory_optimization) s.contiguous_memory_optimization = true;
  if (given("--number-checkpoints"))
    s.number_checkpoints = parse_int("--number-checkpoints", number_checkpoints);
  if (given("--overlap-comm")) s.overlap_comm = overlap_comm;
  if (given("--contiguous-gradients")) s.contiguous_gradients = contiguous_gradients;
  if (given("--zero-init")) s.zero_init = zero_init;
  if (quantized_weights) s.quantized_weights = true;
  if (given("--load-on-gpu"))
    s.load_on_gpu = parse_enum<planner::Precision>("--load-on-gpu", load_on_gpu,
                                                   planner::precision_from_string, "fp32, fp16 or bf16");
  if (given("--reduce-bucket-size"))
    s.buffers.reduce_bucket_size = parse_count(reduce_bucket_size, "--reduce-bucket-size");
  if (given("--allgather-bucket-size"))
    s.buffers.allgather_bucket_size = parse_count(allgather_bucket_size, "--allgather-bucket-size");
  if (given("--prefetch-bucket-size"))
    s.buffers.prefetch_bucket_size = parse_count(prefetch_bucket_size, "--prefetch-bucket-size");
  if (given("--max-live-parameters"))
    s.buffers.max_live_parameters = parse_count(max_live_parameters, "--max-live-parameters");
  if (given("--optimizer-swap-chunk-size"))
    s.buffers.optimizer_swap_chunk_size = parse_count(optimizer_swap_chunk_size, "--optimizer-swap-chunk-size");
  if (given("--offload-tile-size"))
    s.buffers.offload_tile_size = parse_count(offload_tile_size, "--offload-tile-size");
  if (given("--optimizer-swap-buffer-count"))
    s.buffers.optimizer_swap_buffer_count =
        parse_count(optimizer_swap_buffer_count, "--optimizer-swap-buffer-count");
  if (given("--param-swap-buffer-count"))
    s.buffers.param_swap_buffer_count =
        parse_count(param_swap_buffer_count, "--param-swap-buffer-count");
  if (given("--param-swap-buffer-size"))
    s.buffers.param_swap_buffer_size =
        parse_count(param_swap_buffer_size, "--param-swap-buffer-size");
  if (given("--torch-version")) {
    const auto v = planner::torch_version_from_string(torch_version);
    if (!v)
      throw Error(fmt::format("--torch-version: '{}' is not a release", torch_version),
                  "e.g. 1.10, 2.4, or current");
    s.torch_version = *v;
  }
  if (given("--deepspeed-version")) {
    const auto v = planner::deepspeed_version_from_string(deepspeed_version);
    if (!v)
      throw Error(fmt::format("--deepspeed-version: '{}' is not a release", deepspeed_version),
                  "e.g. 0.4.0, 0.16.3, or current");
    s.deepspeed_version = *v;
  }
  if (given("--sub-group-size")) s.buffers.sub_group_size = parse_count(sub_group_size, "--sub-group-size");
  if (given("--param-persistence-threshold"))  // 0 is allowed: nothing persists
    s.buffers.param_persistence_threshold =
        param_persistence_threshold == "0"
            ? 0
            : parse_count(param_persistence_threshold, "--param-persistence-threshold");
  if (given("--hpz-partition-size")) s.hpz_partition_size = parse_int("--hpz-partition-size", hpz_partition_size);
  if (given("--param-swap-prefetch-depth"))
    s.buffers.param_swap_prefetch_depth =  // 0 is allowed: no read ahead
        param_swap_prefetch_depth == "0"
            ? 0
            : parse_count(param_swap_prefetch_depth, "--param-swap-prefetch-depth");
  if (mg_given && !given("--grad-accum")) planner::settle_megatron_batch(s, mg);
  planner::validate(s);
  if (assumed != nullptr) {
    // A flag given settles the DeepSpeed config's "auto" for its field.
    for (const auto& [flag, field] : {std::pair<const char*, const char*>{"--precision", "fp16.enabled"},
                                      {"--precision", "bf16.enabled"},
                                      {"--micro-batch", "train_micro_batch_size_per_gpu"},
                                      {"--grad-accum", "gradient_accumulation_steps"},
                                      {"--contiguous-gradients",
                                       "zero_optimization.contiguous_gradients"}})
      if (given(flag))
        std::erase_if(*assumed, [&](const std::string& l) { return l.rfind(field, 0) == 0; });
    // The flags left out whose value the plan took anyway (the DeepSpeed config's fields
    // count as given; its "auto"s were noted by apply_deepspeed_config).
    auto in_ds = [&](std::initializer_list<const char*> path) {
      const nlohmann::json* j = &ds;
      for (const char* k : path) {
        if (!j->is_object() || !j->contains(k)) return false;
        j = &(*j)[k];
      }
      return true;
    };
    std::vector<std::string> left;
    const bool acc = !fsdp_config.empty();  // stage, dp and precision come from it
    if (!given("--stage") && !in_ds({"zero_optimization", "stage"}) && !acc && !mg_given)
      left.push_back(fmt::format("--stage {}", s.stage));
    if (!given("--dp") && !acc) left.push_back(fmt::format("--dp {}", s.dp));
    if (!given("--micro-batch") && !in_ds({"train_micro_batch_size_per_gpu"}) && !mg.has("--micro-batch-size"))
      left.push_back(fmt::format("--micro-batch {}", s.micro_batch));
    if (!given("--precision") && !has_ds_config() && !acc && !mg_given)
      left.push_back(fmt::format("--precision {}", planner::to_string(s.precision)));
    // Plain PyTorch in 16 bits on fp32 weights is autocast (models::GraphOptions::autocast).
    if (o.profile == planner::Profile::pytorch && s.precision != planner::Precision::fp32 &&
        !planner::weights_in_compute_dtype(s))
      left.push_back(fmt::format("autocast to {} on fp32 weights (the Trainer's --{}; a bf16 "
                                 "model is --master-weights bf16)",
                                 planner::to_string(s.precision), planner::to_string(s.precision)));
    if (!given("--optimizer") && !in_ds({"optimizer"}) && !mg_given)
      left.push_back(fmt::format("--optimizer {}", planner::to_string(s.optimizer)));
    if (!given("--checkpointing") && !acc && !mg_given)
      left.push_back(fmt::format("--checkpointing {}", planner::to_string(s.checkpointing)));
    // How the model reaches deepspeed.initialize (schedule.cpp deepspeed_model_arrives).
    if (o.profile == planner::Profile::deepspeed && s.stage == 3 && !given("--zero-init"))
      left.push_back("--zero-init (the Trainer's from_pretrained builds the model partitioned "
                     "under a stage-3 config)");
    if (o.profile == planner::Profile::deepspeed && s.stage >= 1 && !planner::builds_partitioned(s) &&
        !given("--load-on-gpu"))
      left.push_back("the model loaded on the host (deepspeed.initialize moves it to the GPU "
                     "whole; --load-on-gpu if the script put it there)");
    if (!given("--attention") && !flash_attention && !mg_given)
      left.push_back(o.profile == planner::Profile::zeroplan
                         ? std::string("--attention eager (zero-run's kernels)")
                         : std::string("--attention sdpa (transformers' default)"));
    if (!left.empty()) {
      std::string line;
      for (const std::string& l : left) line += (line.empty() ? "" : ", ") + l;
      assumed->insert(assumed->begin(), line);
    }
  }
  return s;
}

models::ModelSpec load_model(const std::string& model, StrategyFlags& flags) {
  const bool mg = flags.given("--megatron-args");
  const bool in_memory = !flags.model_json.empty();
  if (in_memory && !model.empty())
    throw Error("--model and a model config given in memory", "give one of them");
  if (model.empty() && !mg && !in_memory)
    throw Error("--model is required", "a catalog name (zero-plan models), a config.json, or "
                "--megatron-args with the model's --num-layers, --hidden-size, ...");
  const models::ModelSpec m =
      in_memory       ? models::parse_hf_config(flags.model_json, flags.model_json_origin)
      : model.empty() ? planner::megatron_model(planner::parse_megatron_args(flags.megatron_args))
                      : models::load_model(model);
  if (mg && (!model.empty() || in_memory))
    planner::check_megatron_model(planner::parse_megatron_args(flags.megatron_args), m);
  flags.n_layer = m.n_layer;
  return m;
}

void add_target_flags(CLI::App& app, TargetFlags& f, std::string_view default_device) {
  app.add_option("--profile", f.profile,
                 "whose allocations to predict: zeroplan (zero-run's arena and buffers), "
                 "deepspeed (DeepSpeed on PyTorch's caching allocator), fsdp (PyTorch FSDP's "
                 "fully_shard as torchtitan runs it; --stage 3) or pytorch (one GPU or DDP "
                 "without DeepSpeed or FSDP, as the Hugging Face Trainer runs it; --stage 0) "
                 "[zeroplan]");
  app.add_option("--model-code", f.model_code,
                 "whose modeling code runs the model: fused (zero-run's kernels; Megatron's and "
                 "torchtitan's fused paths keep the same tensors) or transformers (Hugging "
                 "Face's modeling code: loss on fp32 logits, repeat_kv copies, unfused gated "
                 "MLPs) [transformers with --profile deepspeed, fused with zeroplan]");
  app.add_option("--device", f.device,
                 fmt::format("the graph to predict: cpu (fp32 activations, no dropout: zero-run's "
                             "fast CPU graph) or cuda (activations in the training precision, "
                             "dropout: training on GPUs). zero-run executes either graph on "
                             "either device [{}]", default_device));
}

planner::PlanOptions TargetFlags::resolve(planner::Backend default_backend,
                                          const StrategyFlags* strategy) const {
  planner::PlanOptions o;
  const bool fsdp_file = strategy != nullptr && !strategy->fsdp_config.empty();
  auto p = planner::profile_from_string(profile.empty() ? (fsdp_file ? "fsdp" : "zeroplan") : profile);
  if (!p) throw Error(fmt::format("--profile: unknown value '{}'", profile), "expected zeroplan, deepspeed, fsdp or pytorch");
  o.profile = *p;
  o.backend = default_backend;
  o.model_code = o.profile == planner::Profile::zeroplan ? planner::ModelCode::fused
                                                         : planner::ModelCode::transformers;
  if (!model_code.empty()) {
    auto c = planner::model_code_from_string(model_code);
    if (!c)
      throw Error(fmt::format("--model-code: unknown value '{}'", model_code),
                  "expected fused or transformers");
    o.model_code = *c;
  }
  if (!device.empty()) {
    auto b = planner::backend_from_string(device);
    if (!b) throw Error(fmt::format("--device: unknown value '{}'", device), "expected cpu or cuda");
    o.backend = *b;
  }
  return o;
}

void add_format_flag(CLI::App& app, std::string& into) {
  into = "text";
  app.add_option("--format", into, "output format: text, markdown, json (the stable contract) or csv [text]");
}

reports::Format parse_format(const std::string& s) {
  auto f = reports::format_from_string(s);
  if (!f) throw Error(fmt::format("--format: unknown value '{}'", s), "expected text, markdown, json or csv");
  return *f;
}

void say_error(const Error& e, const std::string& where) {
  std::cerr << "error: " << where << e.what() << "\n";
  if (!e.hint().empty()) std::cerr << "hint: " << e.hint() << "\n";
  std::cerr.flush();
}

int run(CLI::App& app, int argc, char** argv, const std::function<int()>& body) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    std::cerr << "error: " << what << "\n";
    std::string sub;
    for (const CLI::App* s : app.get_subcommands()) sub = " " + s->get_name();
    std::cerr << fmt::format("hint: run '{}{} --help' for the flags and examples\n", app.get_name(), sub);
    return kExitBadInput;
  }
  try {
    return body();
  } catch (const Error& e) {
    say_error(e);
    return kExitBadInput;
  } catch (const std::bad_alloc&) {
    std::cerr << "error: out of host memory\n";
    return kExitBadInput;
  }
}

void emit(const std::string& path, const std::string& content) {
  if (path.empty() || path == "-") {
    std::fwrite(content.data(), 1, content.size(), stdout);
    std::fflush(stdout);
    return;
  }
  reports::write_file_atomic(path, content);
}

}  // namespace zp::cli
