// Megatron-LM's command line read into a Strategy and a model (planner/megatron_args.hpp):
// shell splitting, argparse's way of taking values, each flag's effect, every refusal by name,
// models built from the size flags against published parameter counts, and command lines from
// Megatron-LM's examples/ folder (commit d98e8a64ddf3, the one megatron_flags.inc names).
#include <doctest/doctest.h>

#include <algorithm>

#include <nlohmann/json.hpp>

#include "error_of.hpp"
#include "zp/json_fields.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/fit.hpp"
#include "zp/planner/megatron_args.hpp"

using namespace zp::planner;
using zp::test::error_of;

namespace {
Strategy mg(const std::string& text, int64_t n_layer = 0, const nlohmann::json* ds = nullptr) {
  return apply_megatron_args(Strategy{}, parse_megatron_args(text), n_layer, ds);
}
// The strategy with dp settled and the global batch read, as the CLI does.
Strategy mg_dp(const std::string& text, int64_t dp) {
  const MegatronArgs a = parse_megatron_args(text);
  Strategy s = apply_megatron_args(Strategy{}, a, 0);
  s.dp = dp;
  settle_megatron_batch(s, a);
  return s;
}
// The message of the error reading `text` (its strategy, then its model) throws.
std::string refusal(const std::string& text, int64_t n_layer = 0) {
  return error_of([&] { (void)mg(text, n_layer); });
}
std::string model_refusal(const std::string& text) {
  return error_of([&] { (void)megatron_model(parse_megatron_args(text)); });
}
bool has(const std::string& message, const std::string& needle) {
  CAPTURE(message);
  return message.find(needle) != std::string::npos;
}
int64_t params(const std::string& text) {
  return zp::models::count_params(megatron_model(parse_megatron_args(text))).total;
}

// examples/llama/train_llama3_8b_h100_fp8.sh: MODEL_ARGS, TRAINING_ARGS with DDP_ARGS,
// MODEL_PARALLEL_ARGS (TP_SIZE=1, CP_SIZE=1), the mock DATA_ARGS_LIST and
// EVAL_AND_LOGGING_ARGS with their comments, the script's variables substituted (NUM_LAYERS=32,
// SEQ_LENGTH=MAX_POSITION_EMBEDDINGS=8192, MICRO_BATCH_SIZE=1, GLOBAL_BATCH_SIZE=128); its
// DTYPE_ARGS (fp8) are kLlama3Fp8.
const std::string kLlama3 =
    "--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
    "--num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128 "
    "--seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope "
    "--rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused "
    "--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear "
    "--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 "
    "--lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 "
    "--decoupled-lr 5.0e-4      # Specific to decoupled AdamW, ensure optimizer is compatible\n"
    "--decoupled-min-lr 4.5e-5  # Specific to decoupled AdamW\n"
    "--lr-decay-style cosine --clip-grad 1.0 "
    "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 "
    "--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc "
    "--empty-unused-memory-level 1 --exit-duration-in-mins 235 "
    "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
    "--tensor-model-parallel-size 1 --context-parallel-size 1\n"
    "# --pipeline-model-parallel-size $PP_SIZE # Not explicitly set in llama script options, "
    "assume 1 if not multi-node PP\n"
    "--sequence-parallel  # Always enable sequence parallelism with TP_SIZE=2\n"
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 "
    "--data-cache-path \"${PWD}/benchmark_cache_llama3_8b_fp8\" --tiktoken-pattern v2 "
    "--split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files "
    "--num-workers 1 --log-interval 1 --eval-iters 32 --eval-interval 100 "
    "--save-interval 1000 --log-throughput --profile --profile-step-start 4 "
    "--profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60 "
    "--save \"checkpoints/llama3_8b_fp8\" --load \"checkpoints/llama3_8b_fp8\" "
    "--tensorboard-dir \"tensorboard_logs/llama3_8b_fp8\"";
const std::string kLlama3Fp8 =
    " --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather";

// examples/mixtral/train_mixtral_8x7b_distributed.sh: MODEL_ARGS, MOE_ARGS, DATA_ARGS,
// TRAINING_ARGS, MODEL_PARALLEL_ARGS and LOGGING_ARGS (its line continuations kept).
const std::string kMixtral =
    "--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 "
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
    "--init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--normalization RMSNorm --position-embedding-type rope --swiglu "
    "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 "
    "--no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000 "
    "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss "
    "--moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall "
    "--overlap-param-gather --overlap-grad-reduce "
    "--tokenizer-type Llama2Tokenizer --tokenizer-model /models/tokenizer.model "
    "--data-path /data/mixtral_text_document --split 99990,8,2 "
    "--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 "
    "--lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 "
    "--lr-warmup-iters 500 --clip-grad 1.0 --bf16 "
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 "
    "--expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel "
    "--log-interval 1 \\\n --save-interval 10000 \\\n --eval-interval 1000 \\\n --eval-iters 10 \\\n"
    " --save /ckpt \\\n --load /ckpt \\\n --tensorboard-dir \"/ckpt/tensorboard\" \\\n"
    " --no-load-optim \\\n --no-load-rng";

// examples/gpt3/train_gpt3_175b_distributed.sh: GPT_MODEL_ARGS, TRAINING_ARGS,
// MODEL_PARALLEL_ARGS, DATA_ARGS and EVAL_AND_LOGGING_ARGS as the script passes them.
const std::string kGpt3 =
    "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
    "--max-position-embeddings 2048 --attention-backend auto # Can use (flash/fused/unfused/local)\n"
    "--micro-batch-size 1 --global-batch-size 1536 "
    "--step-batch-size-schedule \"0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536\" "
    "--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 "
    "--init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine "
    "--min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000 "
    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 "
    "--data-path /data/gpt3_text_document --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt "
    "--split 949,50,1 --log-interval 100 --save-interval 10000 --eval-interval 1000 "
    "--save /ckpt --load /ckpt --eval-iters 10 --tensorboard-dir /tb";
}  // namespace

TEST_CASE("Megatron args: split as a shell splits them") {
  // Expected words as `sh` prints them (printf '[%s]' ...), the quoting rules of POSIX XCU
  // 2.2: '...' literal, "..." with \ escaping only $ ` " \ and newline, \ outside quotes
  // escaping any character, backslash-newline joining lines.
  using V = std::vector<std::string>;
  CHECK(split_shell_words("a  b\t c\n", "--x") == V{"a", "b", "c"});
  CHECK(split_shell_words(R"('a b' 'a\b' "x \"q\" \$v \\ \z" a\ b '' --p="a b"c)", "--x") ==
        V{"a b", "a\\b", "x \"q\" $v \\ \\z", "a b", "", "--p=a bc"});
  CHECK(split_shell_words("ab\\\ncd --bf16 \\\n--fp16", "--x") == V{"abcd", "--bf16", "--fp16"});
  CHECK(split_shell_words("", "--x").empty());
  // A word starting with # comments out the rest of its line; inside a word it is a character.
  CHECK(split_shell_words("--bf16 # --fp16 'x\n--seed 1#2 \\#3 '#4'", "--x") ==
        V{"--bf16", "--seed", "1#2", "#3", "#4"});
  CHECK(split_shell_words("   ", "--x").empty());
  // Refusals name the flag.
  CHECK(has(error_of([] { (void)split_shell_words("--data-path 'a b", "--megatron-args"); }),
            "--megatron-args: unterminated single quote"));
  CHECK(has(error_of([] { (void)split_shell_words("--split \"99,1", "--megatron-args"); }),
            "--megatron-args: unterminated double quote"));
  CHECK(has(error_of([] { (void)split_shell_words("--bf16 \\", "--megatron-args"); }),
            "--megatron-args: ends in a backslash"));
  CHECK(has(error_of([] { (void)parse_megatron_args("--tensor-model-parallel-size '2"); }),
            "--megatron-args: unterminated single quote"));
}

TEST_CASE("Megatron args: values taken as argparse takes them") {
  MegatronArgs a = parse_megatron_args(
      "--tensor-model-parallel-size=4 --data-path a b c --seed -1 --lr 1e-4 --bf16 "
      "--cp-comm-type a2a a2a --micro-batch-size 2 --micro-batch-size 3");
  CHECK(a.integer("--tensor-model-parallel-size") == 4);               // --flag=value
  CHECK(a.given.at("--data-path") == std::vector<std::string>{"a", "b", "c"});  // nargs='*'
  CHECK(a.integer("--seed") == -1);                          // a negative number is a value
  CHECK(a.real("--lr") == doctest::Approx(1e-4));
  CHECK(a.given.at("--bf16").empty());
  CHECK(a.given.at("--cp-comm-type") == std::vector<std::string>{"a2a", "a2a"});  // nargs='+'
  CHECK(a.integer("--micro-batch-size") == 3);                           // the last one wins
  CHECK(parse_megatron_args("--hidden-size 1_024").integer("--hidden-size") == 1024);  // int()

  // Missing or mistyped values name the flag.
  CHECK(has(refusal("--micro-batch-size"), "--micro-batch-size is missing its value"));
  CHECK(has(refusal("--micro-batch-size --bf16"), "--micro-batch-size is missing its value"));
  CHECK(has(refusal("--cp-comm-type --bf16"), "--cp-comm-type is missing its value"));
  CHECK(has(refusal("--rampup-batch-size 16 8"), "--rampup-batch-size is missing its values"));
  CHECK(has(refusal("--micro-batch-size two"), "--micro-batch-size expects an integer, got 'two'"));
  CHECK(has(refusal("--micro-batch-size 1.5"), "--micro-batch-size expects an integer"));
  CHECK(has(refusal("--lr fast"), "--lr expects a number, got 'fast'"));
  CHECK(has(refusal("--lr 0x10"), "--lr expects a number"));
  // '-1e-8' is not argparse's negative number: it reads as a flag, the value is missing.
  CHECK(has(refusal("--adam-eps -1e-8"), "--adam-eps is missing its value"));
  CHECK(has(refusal("--bf16 true"), "'true' is not a flag"));
  CHECK(has(error_of([] { (void)parse_megatron_args("--bf16 true"); }), "'true' is not a flag"));
  CHECK(has(refusal("--bf16=1"), "--bf16 takes no value, got '1'"));
  CHECK(has(refusal("pretrain_gpt.py --bf16"), "'pretrain_gpt.py' is not a flag"));
  CHECK(has(refusal("--bf16 -- x"), "'--' is not a flag"));
}

TEST_CASE("Megatron args: an unknown flag is refused by name, a known one that moves no memory is not") {
  const std::string typo = refusal("--tensor-model-paralel-size 2");
  CHECK(has(typo, "--megatron-args: unknown flag --tensor-model-paralel-size"));
  CHECK(has(zp::test::hint_of([] { (void)parse_megatron_args("--tensor-model-paralel-size 2"); }),
            "--tensor-model-parallel-size"));
  // Far from every flag: no "closest" list of noise.
  CHECK(zp::test::hint_of([] { (void)parse_megatron_args("--qqqqqqqqqqqqqqqqqqqqqqqqqqqqqqq 2"); }) ==
        "not a Megatron-LM flag (megatron/training/arguments.py), nor close to one");
  CHECK(has(refusal("--nproc_per_node 8"), "unknown flag --nproc_per_node"));  // torchrun's
  CHECK(has(refusal("--virtual-pipeline-model-parallel-size 2"),
            "unknown flag --virtual-pipeline-model-parallel-size"));
  CHECK(has(refusal("--deepspeed --zero-stage 1"), "unknown flag --deepspeed"));
  CHECK(has(refusal("--tp 2"), "unknown flag --tp"));  // allow_abbrev=False: no prefixes either
  CHECK(has(refusal("--tensor-model-parallel"), "unknown flag --tensor-model-parallel"));
  // Flags that change nothing zeroplan models leave the strategy as Megatron's defaults.
  const Strategy quiet = mg(
      "--lr 1e-4 --train-iters 10 --data-path a b --save /x --load /x --log-interval 5 --seed 3 "
      "--tokenizer-type GPT2BPETokenizer --vocab-file v.json --merge-file m.txt --split 949,50,1 "
      "--init-method-std 0.02 --clip-grad 1.0 --weight-decay 0.1 --eval-iters 10 --no-load-optim");
  CHECK(quiet == mg(""));
  // The table: sorted, every flag once, and the flags this reader reads among them.
  const auto names = megatron_flag_names();
  CHECK(names.size() > 800);
  CHECK(std::adjacent_find(names.begin(), names.end(), std::greater_equal<>()) == names.end());
  for (const char* f : {"--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                        "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                        "--sequence-parallel", "--context-parallel-size", "--cp-comm-type",
                        "--expert-model-parallel-size", "--micro-batch-size", "--global-batch-size",
                        "--seq-length", "--bf16", "--fp16", "--use-distributed-optimizer",
                        "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                        "--use-flash-attn", "--attention-backend", "--optimizer", "--overlap-grad-reduce",
                        "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                        "--group-query-attention", "--num-query-groups", "--kv-channels",
                        "--max-position-embeddings", "--padded-vocab-size", "--vocab-size", "--swiglu",
                        "--normalization", "--untie-embeddings-and-output-weights",
                        "--position-embedding-type", "--num-experts", "--moe-router-topk",
                        "--moe-ffn-hidden-size", "--disable-bias-linear", "--add-qkv-bias"})
    CHECK_MESSAGE(std::binary_search(names.begin(), names.end(), std::string_view(f)), f);
}

TEST_CASE("Megatron args: parallelism") {
  // Megatron's defaults: no parallelism but data, fp32, no ZeRO, TE's flash/fused attention.
  const Strategy d = mg("");
  CHECK(d.mp == 1);
  CHECK(d.pp == 1);
  CHECK(d.vp == 1);
  CHECK(d.cp == 1);
  CHECK(d.ep == 1);
  CHECK(!d.sp);
  CHECK(d.stage == 0);
  CHECK(d.precision == Precision::fp32);
  CHECK(d.optimizer == OptimizerKind::adamw);
  CHECK(d.checkpointing == Checkpointing::none);
  CHECK(d.flash_attention);

  Strategy s = mg("--tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 2 "
                  "--context-parallel-size 2 --expert-model-parallel-size 8");
  CHECK(s.mp == 4);
  CHECK(s.sp);
  CHECK(s.pp == 2);
  CHECK(s.cp == 2);
  CHECK(s.ep == 8);
  CHECK(!mg("--sequence-parallel").sp);  // validate_args turns it off at tp 1
  CHECK(mg("--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 3").vp == 3);
  CHECK(mg("--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 3").pp_schedule ==
        PipelineSchedule::interleaved);
  CHECK(mg("--pipeline-model-parallel-size 4").pp_schedule == PipelineSchedule::one_f_one_b);
  // 32 layers over pp 4: 8 per stage, 2 per virtual stage: 4 model chunks per rank.
  CHECK(mg("--num-layers 32 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2").vp == 4);
  CHECK(mg("--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2", 32).vp == 4);
  CHECK(has(refusal("--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2"),
            "--num-layers-per-virtual-pipeline-stage needs the layer count"));
  CHECK(has(refusal("--num-layers 32 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 3"),
            "--num-layers-per-virtual-pipeline-stage 3 does not divide the 8 layers"));
  CHECK(has(refusal("--num-layers 30 --pipeline-model-parallel-size 4"),
            "30 layers do not split into --pipeline-model-parallel-size 4"));
  CHECK(has(refusal("--num-layers 32 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2 "
                    "--num-virtual-stages-per-pipeline-rank 4"),
            "--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage"));
  CHECK(has(refusal("--tensor-model-parallel-size 0"), "--tensor-model-parallel-size must be >= 1, got 0"));

  // Context parallelism's communication: p2p is ring attention, a2a DeepSpeed-Ulysses.
  CHECK(mg("--context-parallel-size 2 --cp-comm-type p2p").cp_kind == CpKind::ring);
  CHECK(mg("--context-parallel-size 2 --cp-comm-type a2a").cp_kind == CpKind::ulysses);
  CHECK(mg("--context-parallel-size 2 --cp-comm-type a2a a2a a2a").cp_kind == CpKind::ulysses);
  CHECK(has(refusal("--cp-comm-type allgather"), "--cp-comm-type allgather: not modelled"));
  CHECK(has(refusal("--cp-comm-type a2a+p2p"), "--cp-comm-type a2a+p2p: not modelled"));
  CHECK(has(refusal("--cp-comm-type p2p a2a"), "--cp-comm-type p2p a2a: a different kind per layer"));
  CHECK(has(refusal("--context-parallel-size 4 --seq-length 4100"),
            "--seq-length 4100 is not a multiple of 2 x --context-parallel-size 4"));
  // Expert tensor parallelism other than tp, and weight shards beyond tp.
  CHECK(mg("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 2").mp == 2);
  CHECK(has(refusal("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1"),
            "--expert-tensor-parallel-size 1 differs from --tensor-model-parallel-size 2"));
  CHECK(has(refusal("--tensor-model-parallel-size 2 --tensor-parallel-num-weight-shards 4"),
            "--tensor-parallel-num-weight-shards 4"));
}

TEST_CASE("Megatron args: batch, sequence, precision, optimizer") {
  Strategy s = mg("--micro-batch-size 4 --seq-length 2048 --bf16");
  CHECK(s.micro_batch == 4);
  CHECK(s.seq == 2048);
  CHECK(s.precision == Precision::bf16);
  CHECK(mg("--fp16").precision == Precision::fp16);
  CHECK(mg("--encoder-seq-length 1024").seq == 1024);
  CHECK(has(refusal("--fp16 --bf16"), "--fp16 and --bf16 together"));
  CHECK(has(refusal("--micro-batch-size 0"), "--micro-batch-size must be >= 1"));

  // grad_accum = global / (micro x dp): 64 / (2 x 4) = 8 micro-batches per step.
  CHECK(mg_dp("--micro-batch-size 2 --global-batch-size 64", 4).grad_accum == 8);
  CHECK(mg_dp("--micro-batch-size 2", 4).grad_accum == 1);  // global = micro x dp
  CHECK(has(error_of([] { (void)mg_dp("--micro-batch-size 2 --global-batch-size 60", 4); }),
            "global batch 60 is not divisible by micro-batch 2 x data-parallel degree 4 = 8"));
  // --decrease-batch-size-if-needed rounds down: 60 -> 56 = 7 x 8.
  CHECK(mg_dp("--micro-batch-size 2 --global-batch-size 60 --decrease-batch-size-if-needed", 4).grad_accum == 7);
  CHECK(has(error_of([] { (void)mg_dp("--micro-batch-size 4 --global-batch-size 8", 4); }),
            "not divisible"));
  // The step schedule's largest batch: 1536 / (1 x 16) = 96.
  CHECK(mg_dp("--micro-batch-size 1 --step-batch-size-schedule \"0:16 2.4B:320 12B:1536\"", 16).grad_accum == 96);
  CHECK(has(error_of([] { (void)mg_dp("--global-batch-size 64 --step-batch-size-schedule 0:16", 1); }),
            "--global-batch-size and --step-batch-size-schedule together"));

  CHECK(mg("--optimizer adam").optimizer == OptimizerKind::adamw);  // FusedAdam, adam_w_mode
  CHECK(mg("--optimizer sgd").optimizer == OptimizerKind::sgd);     // --sgd-momentum 0.9
  CHECK(mg("--optimizer sgd --sgd-momentum 0").optimizer == OptimizerKind::sgd_plain);
  CHECK(mg("--optimizer lion").optimizer == OptimizerKind::lion);
  CHECK(has(refusal("--optimizer muon"), "--optimizer muon: not modelled"));
  CHECK(has(refusal("--optimizer adamw"), "--optimizer: invalid choice 'adamw'"));

  CHECK(mg("--use-distributed-optimizer").stage == 1);
  CHECK(mg("--overlap-grad-reduce").overlap_comm == true);
  CHECK(!mg("").overlap_comm.has_value());
}

TEST_CASE("Megatron args: recomputation and attention") {
  CHECK(mg("--recompute-granularity selective").checkpointing == Checkpointing::selective);
  CHECK(mg("--recompute-activations").checkpointing == Checkpointing::selective);
  CHECK(mg("--recompute-granularity selective --recompute-modules core_attn").checkpointing ==
        Checkpointing::selective);
  CHECK(mg("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
            .checkpointing == Checkpointing::full);
  // block covering all 16 layers of a stage (32 layers, pp 2) is every layer recomputed.
  CHECK(mg("--num-layers 32 --pipeline-model-parallel-size 2 --recompute-granularity full "
           "--recompute-method block --recompute-num-layers 16").checkpointing == Checkpointing::full);
  // With 4 model chunks per rank a chunk has 4 layers: 4 covers it.
  CHECK(mg("--num-layers 32 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 4 "
           "--recompute-granularity full --recompute-method block --recompute-num-layers 4")
            .checkpointing == Checkpointing::full);
  const Strategy dist = mg("--tensor-model-parallel-size 2 --recompute-granularity full "
                           "--recompute-method uniform --recompute-num-layers 1 --distribute-saved-activations");
  CHECK(dist.partition_activations);
  CHECK(has(refusal("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2"),
            "--recompute-num-layers 2 with --recompute-method uniform"));
  CHECK(has(refusal("--num-layers 32 --pipeline-model-parallel-size 2 --recompute-granularity full "
                    "--recompute-method block --recompute-num-layers 8"),
            "--recompute-num-layers 8 with --recompute-method block: 8 of the 16 layers"));
  CHECK(has(refusal("--recompute-granularity full --recompute-method block --recompute-num-layers 8"),
            "--recompute-method block needs the layer count"));
  CHECK(has(refusal("--recompute-granularity full"), "--recompute-granularity full needs --recompute-method"));
  CHECK(has(refusal("--recompute-granularity full --recompute-method uniform"),
            "--recompute-granularity full needs --recompute-num-layers"));
  CHECK(has(refusal("--recompute-granularity selective --recompute-method uniform"),
            "--recompute-method uniform with selective recomputation"));
  CHECK(has(refusal("--recompute-granularity selective --recompute-num-layers 2"),
            "--recompute-num-layers with selective recomputation"));
  CHECK(has(refusal("--recompute-granularity selective --recompute-modules core_attn mlp"),
            "--recompute-modules core_attn mlp"));
  CHECK(has(refusal("--recompute-granularity partial"), "--recompute-granularity: invalid choice 'partial'"));
  CHECK(has(refusal("--distribute-saved-activations"), "--distribute-saved-activations needs"));

  CHECK(mg("--attention-backend flash").flash_attention);
  CHECK(mg("--attention-backend fused").flash_attention);
  CHECK(mg("--attention-backend auto").flash_attention);
  CHECK(!mg("--attention-backend unfused").flash_attention);
  CHECK(!mg("--attention-backend local").flash_attention);
  CHECK(!mg("--transformer-impl local").flash_attention);
  CHECK(mg("--transformer-impl local --use-flash-attn").flash_attention);
  CHECK(has(refusal("--attention-backend sdpa"), "--attention-backend: invalid choice 'sdpa'"));
}

TEST_CASE("Megatron args: flags whose memory zeroplan does not model are refused by name") {
  for (const char* f : {"--fp8-format hybrid", "--fp4-format nvfp4", "--fp8-param-gather",
                        "--optimizer-cpu-offload", "--use-torch-fsdp2", "--use-megatron-fsdp",
                        "--num-distributed-optimizer-instances 2",
                        "--decoder-first-pipeline-num-layers 3", "--decoder-last-pipeline-num-layers 3",
                        "--pipeline-model-parallel-layout E|t|t|L",
                        "--account-for-embedding-in-pipeline-split", "--cpu-offloading-num-layers 2",
                        "--hierarchical-context-parallel-sizes 2 2", "--exp-avg-dtype bf16",
                        "--main-params-dtype fp16", "--mtp-num-layers 1", "--yaml-cfg c.yaml",
                        "--model-parallel-size 2", "--batch-size 4", "--checkpoint-activations"}) {
    const std::string flag = std::string(f).substr(0, std::string(f).find(' '));
    const std::string e = refusal(f);
    CHECK(has(e, "--megatron-args: " + flag));
  }
  // At their neutral values they change nothing.
  CHECK(mg("--num-distributed-optimizer-instances 1 --exp-avg-dtype fp32 --cpu-offloading-num-layers 0") == mg(""));
}

TEST_CASE("Megatron args with a DeepSpeed config (Megatron-DeepSpeed takes both)") {
  const nlohmann::json ds = zp::parse_json_text(
      R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
          "zero_optimization": {"stage": 2}})", "ds.json");
  const Strategy base = apply_deepspeed_config(Strategy{}, ds, "ds.json");
  const Strategy s = apply_megatron_args(base, parse_megatron_args("--micro-batch-size 2 --bf16 --tensor-model-parallel-size 2"), 0, &ds);
  CHECK(s.stage == 2);  // DeepSpeed's ZeRO
  CHECK(s.mp == 2);
  CHECK(s.precision == Precision::bf16);
  auto with_ds = [&](const char* text) {
    return error_of([&] { (void)apply_megatron_args(base, parse_megatron_args(text), 0, &ds); });
  };
  CHECK(has(with_ds("--bf16 --use-distributed-optimizer"), "--use-distributed-optimizer with the DeepSpeed config"));
  CHECK(has(with_ds("--bf16 --micro-batch-size 1"), "--micro-batch-size 1 contradicts the DeepSpeed config's "
                                                     "train_micro_batch_size_per_gpu 2"));
  CHECK(has(with_ds("--fp16"), "--fp16 contradicts the DeepSpeed config's bf16"));
  CHECK(has(with_ds(""), "neither --bf16 nor --fp16 (fp32) contradicts the DeepSpeed config's bf16"));
}

TEST_CASE("Megatron args describe a model: parameter counts against published ones") {
  // GPT-3 175B (examples/gpt3): 96 layers of h = 12288, vocabulary 50257 padded to a multiple
  // of 128 x tp 8 = 1024: 51200 (vocab_size_with_padding), 2048 learned positions.
  // Narayanan et al. 2021 (Megatron-LM at scale), sec. 5.1, count a GPT model's parameters as
  // 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)) = 12 l h^2 + 13 l h + (V + s) h; the final
  // LayerNorm's 2h, which that formula leaves out, is added.
  const int64_t l = 96, h = 12288, V = 51200, s = 2048;
  const std::string gpt3_model =
      "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
      "--max-position-embeddings 2048 --vocab-size 50257 --tensor-model-parallel-size 8";
  CHECK(params(gpt3_model) == 12 * l * h * h + 13 * l * h + (V + s) * h + 2 * h);
  const auto gpt3 = megatron_model(parse_megatron_args(gpt3_model));
  CHECK(gpt3.name == "megatron");
  CHECK(gpt3.model_type == "gpt2");
  CHECK(gpt3.vocab_size == 51200);
  CHECK(gpt3.attn_dropout == doctest::Approx(0.1));  // Megatron's default dropouts
  CHECK(gpt3.resid_dropout == doctest::Approx(0.1));
  // GPT-2's vocabulary padded to a multiple of 128: 50304 (tp 1).
  CHECK(megatron_model(parse_megatron_args("--num-layers 12 --hidden-size 768 --num-attention-heads 12 "
                                           "--max-position-embeddings 1024 --vocab-size 50257"))
            .vocab_size == 50304);
  CHECK(megatron_model(parse_megatron_args("--num-layers 12 --hidden-size 768 --num-attention-heads 12 "
                                           "--max-position-embeddings 1024 --padded-vocab-size 50257"))
            .vocab_size == 50257);
  // ffn_hidden_size's defaults: 4h, and with --swiglu int(4h x 2/3 / 64) x 64 (h = 4096: 10880).
  CHECK(megatron_model(parse_megatron_args(gpt3_model)).n_inner == 4 * 12288);

  // Llama 3 8B (examples/llama): 8,030,261,248 parameters (HF meta-llama/Llama-3.1-8B).
  const auto llama = megatron_model(parse_megatron_args(kLlama3));
  CHECK(zp::models::count_params(llama).total == 8'030'261'248);
  CHECK(llama.model_type == "llama");
  CHECK(llama.n_kv_head == 8);
  CHECK(!llama.tied_embeddings);
  CHECK(!llama.qkv_bias);
  // Mixtral 8x7B (examples/mixtral, whose tokenizer has 32000 tokens): 46,702,792,704 (HF
  // mistralai/Mixtral-8x7B-v0.1).
  const auto mixtral = megatron_model(parse_megatron_args(kMixtral + " --vocab-size 32000"));
  CHECK(mixtral.model_type == "mixtral");
  CHECK(zp::models::count_params(mixtral).total == 46'702'792'704);
  // Qwen2.5 7B: q, k, v biases only (--disable-bias-linear --add-qkv-bias): 7,615,616,512 (HF
  // Qwen/Qwen2.5-7B).
  const std::string qwen =
      "--num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28 "
      "--group-query-attention --num-query-groups 4 --max-position-embeddings 32768 "
      "--vocab-size 152064 --swiglu --normalization RMSNorm --position-embedding-type rope "
      "--untie-embeddings-and-output-weights --disable-bias-linear --add-qkv-bias "
      "--hidden-dropout 0.0 --rotary-base 1000000";
  CHECK(megatron_model(parse_megatron_args(qwen)).model_type == "qwen2");
  CHECK(params(qwen) == 7'615'616'512);
  // The same without --disable-bias-linear: biases on q, k, v, o and the three MLP projections:
  // per layer 3584 (q) + 2 x 4 x 128 (k, v) + 3584 (o) + 2 x 18944 (gate, up) + 3584 (down).
  const std::string qwen_all_bias = qwen.substr(0, qwen.find(" --disable-bias-linear")) + " --hidden-dropout 0.0";
  CHECK(params(qwen_all_bias) == 7'615'616'512 - 28 * (3584 + 2 * 4 * 128) +
                                     28 * (3584 + 2 * 4 * 128 + 3584 + 2 * 18944 + 3584));

  // Refusals name the flag.
  CHECK(has(model_refusal("--hidden-size 1024 --num-attention-heads 16"), "--num-layers is missing"));
  CHECK(has(model_refusal("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64"),
            "--vocab-size is missing"));
  CHECK(has(model_refusal(qwen.substr(0, qwen.find(" --hidden-dropout"))),
            "--hidden-dropout 0.1 with RMSNorm, --swiglu and rope"));
  CHECK(has(model_refusal(gpt3_model + " --swiglu"),
            "--normalization LayerNorm with --swiglu, --position-embedding-type learned_absolute"));
  CHECK(has(model_refusal(gpt3_model + " --disable-bias-linear"), "--disable-bias-linear with LayerNorm"));
  CHECK(has(model_refusal(gpt3_model + " --qk-layernorm"), "--qk-layernorm: an architecture"));
  CHECK(has(model_refusal(kMixtral + " --vocab-size 32000 --moe-layer-freq 2"), "--moe-layer-freq 2"));
  CHECK(has(model_refusal(gpt3_model + " --normalization LayerNorm2"), "--normalization: invalid choice"));
  CHECK(has(model_refusal("--num-layers 2 --hidden-size 64 --num-attention-heads 6 --max-position-embeddings 64 "
                          "--vocab-size 100"),
            "--hidden-size 64 is not divisible by --num-attention-heads 6"));
  CHECK(describes_model(parse_megatron_args("--num-layers 2")));
  CHECK(!describes_model(parse_megatron_args("--tensor-model-parallel-size 2 --bf16")));
}

TEST_CASE("Megatron args against --model: agreeing flags pass, a contradiction names both values") {
  const auto llama = zp::models::load_model("llama-3.1-8b");
  check_megatron_model(parse_megatron_args(kLlama3), llama);  // examples/llama's shape
  check_megatron_model(parse_megatron_args("--tensor-model-parallel-size 2 --bf16"), llama);
  check_megatron_model(parse_megatron_args(kMixtral), zp::models::load_model("mixtral-8x7b"));
  auto against = [](const std::string& text, const std::string& model) {
    return error_of([&] { check_megatron_model(parse_megatron_args(text), zp::models::load_model(model)); });
  };
  CHECK(has(against("--hidden-size 5120", "llama-3.1-8b"),
            "--hidden-size 5120 contradicts --model llama-3.1-8b (hidden size 4096)"));
  CHECK(has(against("--num-layers 40", "llama-3.1-8b"), "--num-layers 40 contradicts --model llama-3.1-8b (layers 32)"));
  CHECK(has(against("--num-attention-heads 32", "llama-3.1-8b"),
            "--num-attention-heads 32 without --group-query-attention contradicts --model llama-3.1-8b "
            "(8 key/value heads)"));
  CHECK(has(against("--group-query-attention --num-query-groups 4", "llama-3.1-8b"),
            "--num-query-groups 4 contradicts"));
  CHECK(has(against("--ffn-hidden-size 11008", "llama-3.1-8b"), "(MLP width 14336)"));
  CHECK(has(against("--vocab-size 32000", "llama-3.1-8b"), "(vocabulary 128256)"));
  CHECK(has(against("--normalization LayerNorm", "llama-3.1-8b"), "--normalization LayerNorm contradicts"));
  CHECK(has(against("--position-embedding-type learned_absolute", "llama-3.1-8b"), "rotary positions"));
  CHECK(has(against("--num-experts 8", "llama-3.1-8b"), "--num-experts 8 contradicts --model llama-3.1-8b (0 experts)"));
  CHECK(has(against("--moe-router-topk 1", "mixtral-8x7b"), "(experts per token 2)"));
  CHECK(against("--max-position-embeddings 1024", "gpt2").empty());
  CHECK(has(against("--max-position-embeddings 2048", "gpt2"), "(learned positions 1024)"));
  CHECK(has(against("--disable-bias-linear", "gpt2"), "--disable-bias-linear contradicts --model gpt2"));
  CHECK(has(against("--swiglu", "gpt2"), "--swiglu contradicts --model gpt2 (a GELU MLP)"));
  CHECK(has(against("--untie-embeddings-and-output-weights", "gpt2"), "a head tied to the embedding"));
}

TEST_CASE("Megatron-LM's example command lines") {
  // examples/llama: Llama 3 8B on 8 GPUs: dp 8, 128 / (1 x 8) = 16 micro-batches.
  Strategy s = mg(kLlama3);
  CHECK(s.mp == 1);
  CHECK(!s.sp);  // --sequence-parallel at tp 1: off
  CHECK(s.stage == 1);
  CHECK(s.precision == Precision::bf16);
  CHECK(s.seq == 8192);
  CHECK(s.flash_attention);  // --attention-backend fused
  CHECK(s.overlap_comm == true);
  CHECK(mg_dp(kLlama3, 8).grad_accum == 16);
  // Its FP8 arguments (DTYPE=fp8) are refused by name.
  CHECK(has(refusal(kLlama3 + kLlama3Fp8), "--fp8-format hybrid: FP8 training"));

  // examples/mixtral on 32 GPUs: pp 4, dp 8, ep 8; 256 / (1 x 8) = 32 micro-batches.
  s = mg(kMixtral);
  CHECK(s.pp == 4);
  CHECK(s.ep == 8);
  CHECK(!s.sp);
  CHECK(s.stage == 1);
  CHECK(mg_dp(kMixtral, 8).grad_accum == 32);

  // examples/gpt3 passes --global-batch-size and --step-batch-size-schedule, which
  // validate_args refuses ("Cannot specify both"); so does this reader.
  s = mg(kGpt3);  // the strategy reads; the batch does not settle
  CHECK(s.mp == 8);
  CHECK(s.pp == 16);
  CHECK(s.precision == Precision::fp16);
  CHECK(s.stage == 0);
  CHECK(has(error_of([] { (void)mg_dp(kGpt3, 1); }),
            "--global-batch-size and --step-batch-size-schedule together"));
}

TEST_CASE("a strategy written as Megatron-LM flags reads back as the same strategy") {
  // megatron_command_line is the reader's inverse: what `zero-plan fit --emit-megatron` writes
  // must plan, read back, as the run it was written for (Adam becomes Megatron's AdamW).
  auto with = [](auto f) {
    Strategy s;
    s.dp = 4;
    s.seq = 4096;
    f(s);
    return s;
  };
  const std::vector<Strategy> cases = {
      with([](Strategy& s) {
        s.mp = 4;
        s.sp = true;
        s.pp = 2;
        s.grad_accum = 8;
        s.stage = 1;
        s.precision = Precision::bf16;
        s.grad_precision = Precision::fp32;
        s.flash_attention = true;
        s.checkpointing = Checkpointing::selective;
        s.optimizer = OptimizerKind::adamw;
      }),
      with([](Strategy& s) {
        s.pp = 4;
        s.vp = 2;
        s.pp_schedule = PipelineSchedule::interleaved;
        s.grad_accum = 8;
        s.cp = 2;
        s.cp_kind = CpKind::ulysses;
        s.precision = Precision::bf16;  // bf16 gradients: --grad-reduce-in-bf16
        s.checkpointing = Checkpointing::full;
        s.micro_batch = 2;
        s.optimizer = OptimizerKind::sgd;
      }),
      with([](Strategy& s) {
        s.precision = Precision::fp16;
        s.grad_precision = Precision::fp32;
        s.ep = 2;
        s.cp = 2;
        s.flash_attention = true;
        s.overlap_comm = true;
        s.optimizer = OptimizerKind::adamw;
      }),
  };
  for (const Strategy& s : cases) {
    const std::string line = megatron_command_line(s);
    CAPTURE(line);
    Strategy back = apply_megatron_args(Strategy{}, parse_megatron_args(line), 32);
    back.dp = s.dp;
    settle_megatron_batch(back, parse_megatron_args(line));
    CHECK(back.mp == s.mp);
    CHECK(back.sp == s.sp);
    CHECK(back.pp == s.pp);
    CHECK(back.vp == s.vp);
    CHECK(back.pp_schedule == s.pp_schedule);
    CHECK(back.cp == s.cp);
    CHECK(back.cp_kind == s.cp_kind);
    CHECK(back.ep == s.ep);
    CHECK(back.micro_batch == s.micro_batch);
    CHECK(back.grad_accum == s.grad_accum);
    CHECK(back.seq == s.seq);
    CHECK(back.precision == s.precision);
    CHECK(grad_bytes(back) == grad_bytes(s));
    CHECK(back.stage == s.stage);
    CHECK(back.checkpointing == s.checkpointing);
    CHECK(back.flash_attention == s.flash_attention);
    CHECK(back.optimizer == s.optimizer);
    CHECK(overlaps_comm(back) == overlaps_comm(s));
  }
  Strategy z2;
  z2.stage = 2;
  CHECK_THROWS_WITH_AS(megatron_command_line(z2), doctest::Contains("ZeRO stage 2"), zp::Error);
  Strategy sac;
  sac.checkpointing = Checkpointing::selective_op;
  CHECK_THROWS_WITH_AS(megatron_command_line(sac), doctest::Contains("selective-op"), zp::Error);
}

TEST_CASE("Megatron-DeepSpeed arguments beside the DeepSpeed config: ZeRO 2-3, offloading, Ulysses") {
  // What `zero-plan fit --emit-megatron args.txt --emit-deepspeed ds.json` writes for a winner
  // Megatron-LM cannot run. Flags from microsoft/Megatron-DeepSpeed megatron/arguments.py
  // (--zero-stage, --no-pipeline-parallel, --ds-sequence-parallel-size, --cpu-optimizer,
  // --use-flash-attn-v2, --deepspeed-activation-checkpointing, --partition-activations,
  // --checkpoint-in-cpu) and DeepSpeed's add_config_arguments (--deepspeed, --deepspeed_config).
  Strategy s;
  s.stage = 3;
  s.mp = 4;
  s.sp = true;
  s.cp = 2;
  s.cp_kind = CpKind::ulysses;
  s.dp = 8;
  s.micro_batch = 2;
  s.grad_accum = 4;
  s.seq = 8192;
  s.precision = Precision::bf16;
  s.checkpointing = Checkpointing::full;
  s.flash_attention = true;
  s.offload_optimizer = Offload::cpu;
  CHECK(megatron_deepspeed_command_line(s, 32, "ds.json") ==
        "--deepspeed --deepspeed_config ds.json --zero-stage 3 --tensor-model-parallel-size 4 "
        "--sequence-parallel --no-pipeline-parallel --ds-sequence-parallel-size 2 "
        "--micro-batch-size 2 --global-batch-size 64 --seq-length 8192 --bf16 "
        "--recompute-granularity full --recompute-method uniform --use-flash-attn-v2 "
        "--optimizer adam --cpu-optimizer");
  // The DeepSpeed config beside it carries ZeRO's side, Ulysses' degree included.
  Strategy back = apply_deepspeed_config(Strategy{}, deepspeed_config(s), "ds.json");
  CHECK(back.stage == 3);
  CHECK(back.offload_optimizer == Offload::cpu);
  CHECK(back.cp == 2);
  CHECK(back.cp_kind == CpKind::ulysses);
  // A pipeline of 2 stages x 2 virtual stages of 32 layers: 8 layers a virtual stage; ZeRO-R's
  // partitioned checkpoints on the host through DeepSpeed's checkpointing.
  Strategy p = s;
  p.stage = 1;
  p.cp = 1;
  p.pp = 2;
  p.vp = 2;
  p.pp_schedule = PipelineSchedule::interleaved;
  p.partition_activations = p.cpu_checkpointing = true;
  const std::string line = megatron_deepspeed_command_line(p, 32, "ds.json");
  CHECK(line.find("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 8") != std::string::npos);
  CHECK(line.find("--deepspeed-activation-checkpointing --recompute-granularity full --recompute-method uniform "
                  "--partition-activations --checkpoint-in-cpu") != std::string::npos);
  CHECK(line.find("--no-pipeline-parallel") == std::string::npos);
  // What it cannot run, by name.
  Strategy ring = s;
  ring.cp_kind = CpKind::ring;
  CHECK_THROWS_WITH_AS(megatron_deepspeed_command_line(ring, 32, "ds.json"), doctest::Contains("ring context parallelism"), zp::Error);
  Strategy moe = s;
  moe.cp = 1;
  moe.ep = 2;
  CHECK_THROWS_WITH_AS(megatron_deepspeed_command_line(moe, 32, "ds.json"), doctest::Contains("expert parallelism"), zp::Error);
  Strategy sgd = s;
  sgd.optimizer = OptimizerKind::sgd;
  CHECK_THROWS_WITH_AS(megatron_deepspeed_command_line(sgd, 32, "ds.json"), doctest::Contains("an offloaded --optimizer sgd"), zp::Error);
}
