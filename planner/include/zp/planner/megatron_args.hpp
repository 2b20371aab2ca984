// zp/planner/megatron_args.hpp: a Megatron-LM command line (pretrain_gpt.py's flags, as
// megatron/training/arguments.py defines them) read into a Strategy and, when no --model is
// given, into the GPT model its size flags describe. Every flag Megatron-LM accepts is known
// (megatron_flags.inc, generated from arguments.py); those that change no memory zeroplan
// models are accepted and ignored, those whose memory it does not model are refused by name.
// Not a Megatron-DeepSpeed reader: its DeepSpeed flags (--deepspeed, --zero-stage) are
// refused; its DeepSpeed config comes in through --ds-config.
//
// Example usage:
//   auto a = zp::planner::parse_megatron_args(
//       "--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 64 --bf16");
//   zp::planner::Strategy s = zp::planner::apply_megatron_args({}, a, 0);  // tp 2, B 1, bf16
//   s.dp = 4;                                                 // from --dp, or GPUs / (tp pp cp)
//   zp::planner::settle_megatron_batch(s, a);                 // grad_accum = 64 / (1 x 4) = 16
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "zp/models/model_spec.hpp"
#include "zp/planner/strategy.hpp"

namespace zp::planner {

// Splits `text` into words as a POSIX shell does before running a command (no expansions):
// blanks (space, tab, newline) separate words; '...' keeps every character; inside "..." a
// backslash escapes only $ ` " \ and newline; outside quotes a backslash escapes the next
// character, and backslash-newline joins two lines; a word starting with # begins a comment
// to the end of the line (as in Megatron's example scripts' argument arrays). An
// unterminated quote or a trailing
// backslash is a zp::Error naming `flag`.
std::vector<std::string> split_shell_words(std::string_view text, std::string_view flag);

// A Megatron-LM argument list, parsed as argparse parses it (allow_abbrev=False): each flag
// with the values it took; a flag given twice keeps its last values.
struct MegatronArgs {
  std::map<std::string, std::vector<std::string>, std::less<>> given;
  std::string origin;  // the zeroplan flag the text came from, for errors

  bool has(std::string_view flag) const { return given.find(flag) != given.end(); }
  // The flag's one value (nullopt when not given); an integer flag's was checked at parsing.
  std::optional<std::string> value(std::string_view flag) const;
  std::optional<int64_t> integer(std::string_view flag) const;
  std::optional<double> real(std::string_view flag) const;
};

// Words -> MegatronArgs. A word that is no Megatron-LM flag (a typo, a launcher's flag, a
// value after a flag that takes none), a missing value or one of the wrong type (an int or
// float flag) is a zp::Error naming it, with a hint. `origin`: "--megatron-args".
MegatronArgs parse_megatron_args(std::string_view text, std::string origin = "--megatron-args");

// The strategy fields Megatron's flags settle, over `base` (defaults, or a DeepSpeed
// config's). The flags left out take Megatron's defaults, not zeroplan's: fp32 without --bf16
// or --fp16, no ZeRO without --use-distributed-optimizer, no recomputation, TransformerEngine's
// flash or fused attention. n_layer: the model's layers (the flags' --num-layers, or the
// --model's), 0 when unknown; --num-layers-per-virtual-pipeline-stage and block
// recomputation need it. `ds`: the DeepSpeed config given beside (Megatron-DeepSpeed), whose
// fields must agree with the flags that say the same thing.
Strategy apply_megatron_args(Strategy base, const MegatronArgs& a, int64_t n_layer,
                             const nlohmann::json* ds = nullptr);

// grad_accum from --global-batch-size once s.dp is settled, as Megatron computes it
// (megatron/core/num_microbatches_calculator.py, ConstantNumMicroBatchesCalculator): global
// / (micro x dp), refused when it does not divide (rounded down with
// --decrease-batch-size-if-needed). Without a global batch Megatron takes micro x dp: 1.
void settle_megatron_batch(Strategy& s, const MegatronArgs& a);

// Whether any flag that describes the model's shape is given (--num-layers, --hidden-size...).
bool describes_model(const MegatronArgs& a);

// The model the size flags describe, named "megatron": a Hugging Face config.json written for
// the family that holds it (gpt2: LayerNorm, GELU, learned positions, biases, tied; llama:
// RMSNorm, SwiGLU, rotary, with or without biases; qwen2: the same with q/k/v biases only;
// mixtral: llama's with --num-experts) and read by models::parse_hf_config. Other
// combinations are refused naming the flag, with the hint to give --model.
models::ModelSpec megatron_model(const MegatronArgs& a);

// With --model: every size flag given must say what the model's config says; a contradiction
// is refused naming both values.
void check_megatron_model(const MegatronArgs& a, const models::ModelSpec& m);

// The other way: the Megatron-LM flags that run strategy `s` (what `zero-plan fit
// --emit-megatron` writes for its winner): parallel sizes, batch (global = micro x dp x
// grad_accum), sequence, precision and the gradients' dtype, the distributed optimizer
// (stage 1), recomputation, attention backend, optimizer, overlapped reduction. Reading it back
// with apply_megatron_args gives the same strategy (Adam is Megatron's AdamW). What Megatron-LM
// cannot run is a zp::Error naming it: ZeRO stages 2-3 and offloading (the DeepSpeed config,
// --emit-deepspeed, with Megatron-DeepSpeed), torchtitan's per-op recomputation, optimizers
// it lacks.
std::string megatron_command_line(const Strategy& s);

// Megatron-DeepSpeed's (microsoft/Megatron-DeepSpeed, megatron/arguments.py) flags for `s`,
// beside the DeepSpeed config at `deepspeed_config` (deepspeed_config(s), which holds ZeRO's
// stage, buckets and offloading): --deepspeed --deepspeed_config FILE --zero-stage N, the
// parallel sizes (--no-pipeline-parallel without a pipeline: its PipelineEngine takes ZeRO 0-1
// only; --num-layers-per-virtual-pipeline-stage for virtual stages, from the model's `n_layer`
// layers), DeepSpeed-Ulysses as --ds-sequence-parallel-size, batch, sequence, precision,
// recomputation (ZeRO-R's partitioned checkpoints through --deepspeed-activation-checkpointing),
// FlashAttention-2, the optimizer (DeepSpeed's CPU Adam with an offloaded one). What it cannot
// run is a zp::Error naming it: ring context parallelism (Megatron-LM's), expert parallelism
// (DeepSpeed-MoE's flags are not written), per-op recomputation, optimizers it lacks.
std::string megatron_deepspeed_command_line(const Strategy& s, int64_t n_layer,
                                            const std::string& deepspeed_config);

// The flags Megatron-LM's parser accepts (the generated table), sorted.
std::vector<std::string_view> megatron_flag_names();

}  // namespace zp::planner
