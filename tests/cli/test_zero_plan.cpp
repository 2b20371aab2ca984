// zero-plan as a user meets it: outputs, the JSON contract, and one clear error with exit 2
// for every kind of bad input (never a crash, never output on stdout).
#include <doctest/doctest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "process.hpp"

using zp::test::Result;

namespace {
const std::string kBin = std::string(ZP_BIN_DIR) + "/zero-plan";

Result zero_plan(std::vector<std::string> args) {
  args.insert(args.begin(), kBin);
  return zp::test::run(args);
}

// Exit 2, nothing on stdout, a first stderr line starting "error: " containing `needle`, and
// a "hint: " line.
void check_bad_input(const Result& r, const std::string& needle) {
  CAPTURE(r.err);
  CHECK(r.rc == 2);
  CHECK(r.out.empty());
  CHECK(r.err.rfind("error: ", 0) == 0);
  CHECK(r.err.find(needle) != std::string::npos);
  CHECK(r.err.find("\nhint: ") != std::string::npos);
}
}  // namespace

TEST_CASE("table: json contract with exact bytes, stage 0 added") {
  const Result r = zero_plan({"table", "--format", "json"});
  REQUIRE(r.rc == 0);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j["schema"] == "zero-plan/table/v1");
  CHECK(j["rows"].size() == 3 * 6 * 4);
  bool found = false;
  for (const auto& row : j["rows"])
    if (row["params"] == 7'500'000'000ULL && row["dp"] == 4 && row["stage"] == 1) {
      CHECK(row["bytes_per_device"] == 52'500'000'000ULL);  // DESIGN.md's example row
      found = true;
    }
  CHECK(found);
}

TEST_CASE("table: text prints the paper's numbers") {
  const Result r = zero_plan({"table"});
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("  4  ") != std::string::npos);
  for (const char* v : {"52.5", "41.3", "1.88", "0.47", "4187", "2218", "62.5", "15.6"})
    CHECK(r.out.find(v) != std::string::npos);
}

TEST_CASE("models and estimate outputs") {
  Result r = zero_plan({"models", "--format", "json"});
  REQUIRE(r.rc == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j["models"].size() == 26);  // models/CMakeLists.txt ZP_CATALOG_CONFIGS
  r = zero_plan({"models", "gpt2", "--format", "csv"});
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("transformer.h.*.attn.c_attn.weight,\"(768, 2304)\",1769472,x 12") !=
        std::string::npos);
  // Rows of blocks that differ (DeepSeek's 3 dense and 58 MoE layers, T5's encoder, decoder
  // and first-layer bias) add up, params x repeats, to the published total.
  for (const auto& [name, total] : {std::pair<std::string, int64_t>{"deepseek-v3", 671'026'404'352},
                                    {"t5-11b", 11'307'321'344}}) {
    CAPTURE(name);
    r = zero_plan({"models", name, "--format", "csv"});
    REQUIRE(r.rc == 0);
    int64_t sum = 0;
    std::istringstream lines(r.out);
    std::string line;
    std::getline(lines, line);  // header
    while (std::getline(lines, line)) {
      const std::size_t rep = line.rfind(','), num = line.rfind(',', rep - 1);
      const int64_t params = std::stoll(line.substr(num + 1, rep - num - 1));
      const std::string times = line.substr(rep + 1);
      sum += params * (times.rfind("x ", 0) == 0 ? std::stoll(times.substr(2)) : 1);
    }
    CHECK(sum == total);
  }

  r = zero_plan({"estimate", "--model", "llama-2-7b", "--stage", "3", "--dp", "8",
                 "--hardware", "a100-80g", "--format", "json"});
  REQUIRE(r.rc == 0);
  j = nlohmann::json::parse(r.out);
  CHECK(j["schema"] == "zero-plan/estimate/v1");
  CHECK(j["model"]["params"] == 6'738'415'616LL);
  CHECK(j["strategy"]["stage"] == 3);
  CHECK(j["fits"] == true);
  const auto& gpu = j["per_device"]["gpu"];
  for (const char* c : {"params", "grads", "master", "optimizer", "activations", "buffers",
                        "workspace", "overhead"})
    CHECK(gpu["breakdown"].contains(c));
  // (2 + 2 + 12) x ceil(Psi / 8) bytes of model states.
  CHECK(gpu["breakdown"]["params"] == 2 * 842'301'952LL);
  CHECK(j["per_device"].contains("cpu"));
  CHECK(j["per_device"].contains("nvme"));

  // The three figures a user measures: allocated <= reserved <= the device total, whose
  // parts (the reservation, the context, cuBLAS's workspace, NCCL with 8 ranks) add up to the
  // deepspeed profile's peak; the text names each by what measures it.
  for (const char* profile : {"zeroplan", "deepspeed"}) {
    CAPTURE(profile);
    r = zero_plan({"estimate", "--model", "llama-2-7b", "--stage", "3", "--dp", "8",
                   "--profile", profile, "--format", "json"});
    REQUIRE(r.rc == 0);
    j = nlohmann::json::parse(r.out);
    const uint64_t alloc = j["peak_allocated"]["gpu"], reserved = j["peak_reserved"]["gpu"];
    const auto& dev = j["device_total"];
    CHECK(alloc <= reserved);
    CHECK(dev["reserved"] == reserved);
    CHECK(dev["nccl"].get<uint64_t>() > 0);
    CHECK(dev["bytes"] == reserved + dev["context"].get<uint64_t>() +
                              dev["cublas_workspace"].get<uint64_t>() + dev["nccl"].get<uint64_t>());
    CHECK(j["peak_reserved"]["cpu"] == j["peak_allocated"]["cpu"]);
    if (std::string(profile) == "deepspeed") {
      CHECK(dev["bound"] == false);
      CHECK(j["per_device"]["gpu"]["total"] == dev["bytes"]);
    } else {
      CHECK(dev["bound"] == true);
      CHECK(j["per_device"]["gpu"]["total"] == reserved);
    }
  }
  r = zero_plan({"estimate", "--model", "gpt2", "--profile", "deepspeed"});
  REQUIRE(r.rc == 0);
  for (const char* s : {"(max_memory_allocated)", "(max_memory_reserved)", "(nvidia-smi: + context"})
    CHECK(r.out.find(s) != std::string::npos);
  r = zero_plan({"estimate", "--model", "gpt2", "--device", "cpu", "--format", "json"});
  REQUIRE(r.rc == 0);
  CHECK(nlohmann::json::parse(r.out)["device_total"].is_null());

  r = zero_plan({"estimate", "--model", "gpt2"});
  CHECK(r.rc == 0);
  CHECK(j.contains("fits"));
  r = zero_plan({"estimate", "--model", "gpt2", "--format", "json"});
  CHECK(nlohmann::json::parse(r.out)["fits"].is_null());
}

TEST_CASE("defaults as users run: SDPA under the deepspeed profile, --seq at most 4096, all said") {
  // The published Llama-3.1-8B config with no flags: T = 4096 of its 131072, not T x T
  // attention over the whole context (34 TiB per GPU before).
  Result r = zero_plan({"estimate", "--model", "llama-3.1-8b", "--profile", "deepspeed",
                        "--format", "json"});
  REQUIRE(r.rc == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j["strategy"]["seq"] == 4096);
  CHECK(j["strategy"]["flash_attention"] == true);
  CHECK(j["per_device"]["gpu"]["total"].get<uint64_t>() < (uint64_t{1} << 40));
  std::string assumed;
  for (const auto& a : j["assumed"]) assumed += a.get<std::string>() + "\n";
  for (const char* s : {"--stage 0", "--dp 1", "--micro-batch 1", "--precision bf16",
                        "--attention sdpa", "--seq 4096 (the model's context is 131072"})
    CHECK(assumed.find(s) != std::string::npos);
  // The text headline names them too.
  r = zero_plan({"estimate", "--model", "llama-3.1-8b", "--profile", "deepspeed"});
  CHECK(r.out.find("assumed:   --stage 0, --dp 1") != std::string::npos);
  // Eager on request; the zeroplan profile predicts zero-run's eager kernels by default.
  r = zero_plan({"estimate", "--model", "gpt2", "--profile", "deepspeed", "--attention", "eager",
                 "--format", "json"});
  REQUIRE(r.rc == 0);
  CHECK(nlohmann::json::parse(r.out)["strategy"]["flash_attention"] == false);
  r = zero_plan({"estimate", "--model", "gpt2", "--format", "json"});
  REQUIRE(r.rc == 0);
  j = nlohmann::json::parse(r.out);
  CHECK(j["strategy"]["flash_attention"] == false);
  CHECK(j["assumed"][0].get<std::string>().find("--attention eager (zero-run's kernels)") !=
        std::string::npos);
  // Given flags are not assumed.
  r = zero_plan({"estimate", "--model", "gpt2", "--stage", "2", "--dp", "4", "--micro-batch", "2",
                 "--precision", "fp16", "--optimizer", "adamw", "--checkpointing", "full",
                 "--attention", "sdpa", "--seq", "512", "--format", "json"});
  REQUIRE(r.rc == 0);
  CHECK(nlohmann::json::parse(r.out)["assumed"].empty());
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--attention", "fast"}),
                  "--attention: unknown value 'fast'");
}

TEST_CASE("fsdp: --fsdp-config reads accelerate's YAML and implies --profile fsdp") {
  zp::test::TempDir dir;
  const std::string cfg = dir.write("fsdp.yaml",
                                    "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 8\n"
                                    "fsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n");
  Result r = zero_plan({"estimate", "--model", "llama-2-7b", "--fsdp-config", cfg, "--seq", "2048",
                        "--format", "json"});
  REQUIRE(r.rc == 0);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j["profile"] == "fsdp");
  CHECK(j["strategy"]["stage"] == 3);
  CHECK(j["strategy"]["dp"] == 8);
  CHECK(j["strategy"]["reduce_precision"] == "bf16");
  // fp32 sharded parameters as the master: 4 bytes per owned element, no 16-bit copy at rest.
  CHECK(j["per_device"]["gpu"]["breakdown"]["params"] == 0);
  CHECK(j["per_device"]["gpu"]["breakdown"]["master"].get<uint64_t>() >= 4 * (6'738'415'616ULL / 8));
  // Flags override the file; a contradicting profile and a stage FSDP has not are errors.
  r = zero_plan({"estimate", "--model", "gpt2", "--fsdp-config", cfg, "--dp", "2", "--format", "json"});
  REQUIRE(r.rc == 0);
  CHECK(nlohmann::json::parse(r.out)["strategy"]["dp"] == 2);
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--fsdp-config", cfg, "--profile", "deepspeed"}),
                  "--fsdp-config: an FSDP run, but --profile deepspeed");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--profile", "fsdp", "--stage", "2"}),
                  "--profile fsdp: --stage 2");
}

TEST_CASE("fsdp: hybrid sharding, CPU offload and FSDP1 from flags and accelerate's config") {
  // Hybrid sharding over 8 of 16 ranks: the states of FULL_SHARD over 8.
  auto estimate_json = [](std::vector<std::string> args) {
    args.insert(args.begin(), {"estimate", "--model", "gpt2", "--profile", "fsdp", "--stage", "3",
                               "--seq", "512", "--format", "json"});
    const Result r = zero_plan(args);
    REQUIRE(r.rc == 0);
    return nlohmann::json::parse(r.out);
  };
  const auto hybrid = estimate_json({"--dp", "16", "--fsdp-shard-size", "8"});
  CHECK(hybrid["strategy"]["fsdp_shard_size"] == 8);
  const auto full8 = estimate_json({"--dp", "8"});
  CHECK(hybrid["per_device"]["gpu"]["breakdown"]["master"] == full8["per_device"]["gpu"]["breakdown"]["master"]);
  // "node": the hardware's GPUs per node.
  const auto node = estimate_json({"--dp", "16", "--fsdp-shard-size", "node", "--hardware", "h100-80g"});
  CHECK(node["strategy"]["fsdp_shard_size"] == 8);
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--profile", "fsdp", "--stage", "3", "--dp",
                             "16", "--fsdp-shard-size", "node"}),
                  "--fsdp-shard-size node: hybrid sharding over a node needs the node's GPUs");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--profile", "fsdp", "--stage", "3", "--dp",
                             "16", "--fsdp-shard-size", "3"}),
                  "--fsdp-shard-size 3: must divide --dp 16");
  // CPU offload: the states on the host, none on the GPU.
  const auto off = estimate_json({"--dp", "8", "--offload-param", "cpu"});
  CHECK(off["per_device"]["gpu"]["breakdown"]["master"] == 0);
  CHECK(off["per_device"]["cpu"]["breakdown"]["master"] == 4 * off["partition_elems"].get<uint64_t>());
  CHECK(off["partition_elems"] == full8["partition_elems"]);
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--profile", "fsdp", "--stage", "3",
                             "--offload-optimizer", "cpu"}),
                  "--profile fsdp --offload-optimizer cpu: FSDP has no optimizer-only offload");
  // FSDP1.
  const auto v1 = estimate_json({"--dp", "8", "--fsdp-version", "1", "--fsdp-use-orig-params"});
  CHECK(v1["strategy"]["fsdp_version"] == 1);
  CHECK(v1["strategy"]["fsdp_use_orig_params"] == true);
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--profile", "fsdp", "--stage", "3",
                             "--fsdp-version", "3"}),
                  "--fsdp-version: must be 1 or 2, got '3'");
  // accelerate's HYBRID_SHARD through fit on two nodes: the rows say so.
  zp::test::TempDir dir;
  const std::string cfg = dir.write("hsdp.yaml",
                                    "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 16\n"
                                    "fsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n");
  const Result fit = zero_plan({"fit", "--model", "gpt2", "--hardware", "h100-80g", "--gpus", "16",
                                "--fsdp-config", cfg, "--seq", "512", "--micro-batch", "1"});
  REQUIRE(fit.rc == 0);
  CHECK(fit.out.find("HYBRID_SHARD 2x8 FSDP1") != std::string::npos);
}

TEST_CASE("ds-config with flags overriding it") {
  zp::test::TempDir dir;
  const std::string ds = dir.write("ds.json", R"({"zero_optimization": {"stage": 2},
      "bf16": {"enabled": true}, "train_micro_batch_size_per_gpu": 2})");
  const Result r = zero_plan({"estimate", "--model", "gpt2", "--ds-config", ds, "--stage", "1",
                              "--format", "json"});
  REQUIRE(r.rc == 0);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j["strategy"]["stage"] == 1);
  CHECK(j["strategy"]["micro_batch"] == 2);
  CHECK(j["strategy"]["precision"] == "bf16");
  // The offload sections' buffer counts and size; an explicit flag overrides the config's.
  const std::string nv = dir.write("nv.json", R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 6},
      "offload_param": {"device": "nvme", "nvme_path": "/x", "buffer_count": 7, "buffer_size": 5e5}}})");
  const Result n = zero_plan({"estimate", "--model", "gpt2", "--ds-config", nv,
                              "--optimizer-swap-buffer-count", "2", "--format", "json"});
  REQUIRE(n.rc == 0);
  const auto b = nlohmann::json::parse(n.out)["strategy"]["buffers"];
  CHECK(b["optimizer_swap_buffer_count"] == 2);
  CHECK(b["param_swap_buffer_count"] == 7);
  CHECK(b["param_swap_buffer_size"] == 500000);
  const Result c = zero_plan({"estimate", "--model", "gpt2", "--ds-config", nv, "--format", "json"});
  REQUIRE(c.rc == 0);
  CHECK(nlohmann::json::parse(c.out)["strategy"]["buffers"]["optimizer_swap_buffer_count"] == 6);
}

TEST_CASE("bad input: one error line, a hint, exit 2") {
  zp::test::TempDir dir;
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--dp", "0"}), "--dp: must be >= 1");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--dp", "-4"}), "--dp");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--dp", "2.5"}), "whole number");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--stage", "4"}),
                  "--stage: must be 0, 1, 2 or 3");
  Result r = zero_plan({"estimate", "--model", "gtp2-xl"});
  check_bad_input(r, "unknown model 'gtp2-xl'");
  CHECK(r.err.find("gpt2-xl") != std::string::npos);  // the closest name is suggested
  check_bad_input(zero_plan({"estimate", "--model", dir.file("none.json")}), "no such file");
  check_bad_input(zero_plan({"estimate", "--model", dir.write("trunc.json", R"({"model_type": "gpt2", "n_emb)")}),
                  "invalid JSON");
  check_bad_input(zero_plan({"estimate", "--model", dir.write("type.json",
                  R"({"model_type":"gpt2","n_embd":768.5,"n_layer":1,"n_head":1})")}),
                  "field 'n_embd' must be a positive integer");
  check_bad_input(zero_plan({"estimate", "--model", dir.write("fam.json", R"({"model_type":"mamba"})")}),
                  "unknown model_type 'mamba'");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--ds-config",
                             dir.write("ds.json", R"({"zero_optimization": {"stage": 7}})")}),
                  "zero_optimization.stage");
  check_bad_input(zero_plan({"table", "--params", "2e18"}), "overflows 64 bits");
  check_bad_input(zero_plan({"table", "--dp", "1,0"}), "--dp: must be >= 1");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--precision", "fp8"}),
                  "--precision: unknown value 'fp8'");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--offload-param", "cpu"}),
                  "needs --stage 3");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--seq", "4096"}), "--seq");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--hardware", "tpu"}), "unknown hardware");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--format", "yaml"}), "--format");
  // DeepSpeed's activation_checkpointing section: what checkpointing.configure asserts, and
  // what its contiguous buffers cannot hold (gpt2 checkpoints 12 blocks per forward).
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--profile", "deepspeed", "--checkpointing",
                             "full", "--contiguous-memory-optimization", "--number-checkpoints", "12"}),
                  "needs --partition-activations");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--profile", "deepspeed", "--checkpointing",
                             "full", "--partition-activations", "--contiguous-memory-optimization",
                             "--number-checkpoints", "8"}),
                  "--number-checkpoints 8");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--ds-config",
                             dir.write("ac.json", R"({"activation_checkpointing": {"partition_activations": true,
                               "contiguous_memory_optimization": true, "number_checkpoints": "12"}})")}),
                  "activation_checkpointing.number_checkpoints");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--checkpointing", "selective-op", "--dp",
                             "2", "--ep", "2"}),
                  "selective-op");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--no-such-flag"}), "no-such-flag");
  // Shapes that do not divide, batch and model-parallel degree (graph issue).
  check_bad_input(zero_plan({"estimate", "--model", dir.write("heads.json",
                  R"({"model_type":"gpt2","n_embd":100,"n_layer":2,"n_head":3,"n_positions":64,"vocab_size":256})")}),
                  "not divisible by n_head");
  check_bad_input(zero_plan({"estimate", "--model", dir.write("kv.json",
                  R"({"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,)"
                  R"("num_attention_heads":4,"num_key_value_heads":3,"max_position_embeddings":64,"vocab_size":256})")}),
                  "num_key_value_heads");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--micro-batch", "0"}),
                  "--micro-batch: must be >= 1");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--micro-batch", "-2"}), "--micro-batch");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--mp", "5"}),
                  "--tp 5: attention heads 12 is not divisible by the tensor-parallel degree");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--partition-activations"}),
                  "needs --checkpointing full");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--profile", "megatron"}), "--profile");
  check_bad_input(zero_plan({"estimate"}), "--model");
  check_bad_input(zero_plan({}), "subcommand");
}

TEST_CASE("-o writes whole files or nothing") {
  zp::test::TempDir dir;
  const std::string out = dir.file("e.json");
  Result r = zero_plan({"estimate", "--model", "gpt2", "--format", "json", "-o", out});
  REQUIRE(r.rc == 0);
  CHECK(nlohmann::json::parse(zp::test::slurp(out))["schema"] == "zero-plan/estimate/v1");
  r = zero_plan({"estimate", "--model", "gpt2", "-o", dir.file("no/such/dir/e.txt")});
  check_bad_input(r, "cannot write");
}

TEST_CASE("--help teaches and exits 0") {
  const Result r = zero_plan({"estimate", "--help"});
  CHECK(r.rc == 0);
  CHECK(r.out.find("Examples:") != std::string::npos);
  CHECK(r.out.find("--offload-optimizer") != std::string::npos);
}

// A small Mixtral (2 layers, C=64, 4 experts of width 128, top-2, V=100, untied): 38208 dense
// parameters (embedding 6400, per block q/k/v/o 12288 + norms 128 + router 256, head 6400 +
// norm 64) and 4 x 3 x 128 x 64 = 98304 expert parameters per layer.
constexpr const char* kMoeConfig =
    R"({"model_type":"mixtral","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,)"
    R"("num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"num_local_experts":4,)"
    R"("num_experts_per_tok":2,"max_position_embeddings":64,"tie_word_embeddings":false})";

TEST_CASE("moe: --ep, --moe-routing and --target-seq, in the text and the JSON") {
  zp::test::TempDir dir;
  const std::string moe = dir.write("moe.json", kMoeConfig);
  Result r = zero_plan({"estimate", "--model", moe, "--stage", "2", "--dp", "8", "--ep", "2",
                        "--seq", "16"});
  REQUIRE(r.rc == 0);
  // 38208 + 2 x 98304 = 234816 parameters, 38208 + 2 x 2/4 x 98304 = 136512 active.
  CHECK(r.out.find("234.8 K params (136.5 K active)") != std::string::npos);
  CHECK(r.out.find("ep 2") != std::string::npos);
  CHECK(r.out.find("balanced routing: 32 rows per rank") != std::string::npos);  // 2 x 16
  r = zero_plan({"estimate", "--model", moe, "--stage", "2", "--dp", "8", "--ep", "2", "--seq",
                 "16", "--moe-routing", "worst", "--format", "json"});
  REQUIRE(r.rc == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j["strategy"]["ep"] == 2);
  CHECK(j["strategy"]["moe_routing"] == "worst");
  CHECK(j["model"]["total_params"] == 234816);
  CHECK(j["model"]["active_params"] == 136512);
  CHECK(j["model"]["moe"] == nlohmann::json{{"experts", 4}, {"top_k", 2}, {"active_params", 136512},
                                            {"expert_params", 196608}});
  // Stage 2: dense 38208 / 8 plus this rank's 2 x 2 experts (98304) over dp/ep = 4 ranks.
  CHECK(j["partition_elems"] == 38208 / 8 + 98304 / 4);
  // A dense model reports no moe object and all its parameters active.
  r = zero_plan({"estimate", "--model", "gpt2", "--format", "json"});
  REQUIRE(r.rc == 0);
  j = nlohmann::json::parse(r.out);
  CHECK_FALSE(j["model"].contains("moe"));
  CHECK(j["model"]["active_params"] == j["model"]["params"]);
  CHECK(j["strategy"]["ep"] == 1);
  // T5's decoder length.
  const std::string t5 = dir.write("t5.json",
      R"({"model_type":"t5","d_model":64,"d_ff":128,"d_kv":16,"num_layers":2,"num_decoder_layers":2,)"
      R"("num_heads":4,"vocab_size":100})");
  r = zero_plan({"estimate", "--model", t5, "--seq", "32", "--target-seq", "8", "--format", "json"});
  REQUIRE(r.rc == 0);
  CHECK(nlohmann::json::parse(r.out)["strategy"]["target_seq"] == 8);
}

TEST_CASE("moe: bad expert-parallel flags exit 2 naming the flag") {
  zp::test::TempDir dir;
  const std::string moe = dir.write("moe.json", kMoeConfig);
  check_bad_input(zero_plan({"estimate", "--model", moe, "--dp", "8", "--ep", "3"}),
                  "--ep 3: must divide --dp 8");
  check_bad_input(zero_plan({"estimate", "--model", moe, "--dp", "8", "--ep", "8"}),
                  "--ep 8: must divide");  // 4 experts
  check_bad_input(zero_plan({"estimate", "--model", moe, "--ep", "0"}), "--ep: must be >= 1");
  check_bad_input(zero_plan({"estimate", "--model", moe, "--ep", "two"}), "--ep");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--dp", "2", "--ep", "2"}),
                  "--ep 2: gpt2 is a dense model");
  check_bad_input(zero_plan({"estimate", "--model", moe, "--moe-capacity-factor", "1.2x"}),
                  "--moe-capacity-factor: expected a number >= 0, got '1.2x'");
  check_bad_input(zero_plan({"estimate", "--model", moe, "--moe-routing", "random"}),
                  "--moe-routing: unknown value 'random'");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--moe-routing", "worst"}),
                  "--moe-routing worst");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--target-seq", "8"}),
                  "--target-seq 8: gpt2 is decoder-only");
  check_bad_input(zero_plan({"plan", "--model", moe, "--dp", "4", "--ep", "3", "-o",
                             dir.file("p.json")}),
                  "--ep 3");
  check_bad_input(zero_plan({"fit", "--model", moe, "--hardware", "h100-80g", "--gpus", "4",
                             "--ep", "3"}),
                  "--ep 3: must divide --dp 4");
  check_bad_input(zero_plan({"fit", "--model", "gpt2", "--hardware", "h100-80g", "--gpus", "4",
                             "--ep", "2"}),
                  "--ep 2: gpt2 is a dense model");
}

TEST_CASE("moe: fit searches ep and names the winner's") {
  zp::test::TempDir dir;
  const std::string moe = dir.write("moe.json", kMoeConfig);
  const std::string ds = dir.file("ds.json");
  Result r = zero_plan({"fit", "--model", moe, "--hardware", "h100-80g", "--gpus", "4", "--seq",
                        "16", "--stage", "2", "--micro-batch", "1", "--checkpointing", "none",
                        "--no-overlap-comm", "--offload-optimizer", "none", "--top", "10",
                        "--format", "json"});
  REQUIRE(r.rc == 0);
  auto j = nlohmann::json::parse(r.out);
  // ep 1, 2 and 4 (the divisors of dp 4 that divide 4 experts), one configuration each.
  CHECK(j["n_searched"] == 3);
  std::set<int64_t> eps;
  for (const auto& c : j["candidates"]) eps.insert(c["strategy"]["ep"].get<int64_t>());
  CHECK(eps == std::set<int64_t>{1, 2, 4});
  // Pinned: only that degree; the text names it and the DeepSpeed notes say where it goes.
  r = zero_plan({"fit", "--model", moe, "--hardware", "h100-80g", "--gpus", "4", "--seq", "16",
                 "--stage", "2", "--ep", "4", "--emit-deepspeed", ds});
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("dp 4 ep 4") != std::string::npos);
  CHECK(r.err.find("ep_size=4") != std::string::npos);
}

TEST_CASE("--optimizer: the memory-saving optimizers plan fewer optimizer bytes than adam") {
  auto optimizer_bytes = [](const std::string& o) {
    const Result r = zero_plan({"estimate", "--model", "llama-2-7b", "--seq", "128", "--optimizer",
                                o, "--format", "json"});
    REQUIRE(r.rc == 0);
    const auto j = nlohmann::json::parse(r.out);
    CHECK(j["strategy"]["optimizer"] == o);
    return j["per_device"]["gpu"]["breakdown"]["optimizer"].get<uint64_t>();
  };
  const uint64_t adam = optimizer_bytes("adam");  // 8 bytes per parameter
  CHECK(optimizer_bytes("adam8bit") < adam / 3);  // about 2 bytes per parameter
  CHECK(optimizer_bytes("lion") == adam / 2);     // one fp32 buffer
  CHECK(optimizer_bytes("adafactor") < adam / 100);
  CHECK(optimizer_bytes("sgd-plain") == 0);
  // The text names the optimizer; a bad value exits 2 naming the flag and the values.
  const Result r = zero_plan({"estimate", "--model", "llama-2-7b", "--optimizer", "adam8bit"});
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("adam8bit") != std::string::npos);
  check_bad_input(zero_plan({"estimate", "--model", "llama-2-7b", "--optimizer", "adam9bit"}),
                  "--optimizer: unknown value 'adam9bit'");
}

TEST_CASE("megatron-args: a Megatron-LM command line plans as the same run in zeroplan's flags") {
  auto json_of = [](std::vector<std::string> args) {
    const Result r = zero_plan(std::move(args));
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    return nlohmann::json::parse(r.out);
  };
  // Megatron's --tensor-model-parallel-size 2 ... with --use-distributed-optimizer on 8 GPUs
  // (dp = 8 / tp 2 = 4), and the same run written the second way: tp 2, ZeRO stage 1, bf16,
  // Megatron's Adam (AdamW) and TransformerEngine's flash/fused attention.
  const auto mg = json_of({"estimate", "--model", "llama-3.1-8b", "--megatron-args",
                           "--tensor-model-parallel-size 2 --micro-batch-size 1 --seq-length 4096 "
                           "--bf16 --use-distributed-optimizer", "--dp", "4", "--format", "json"});
  const auto zp_flags = json_of({"estimate", "--model", "llama-3.1-8b", "--tp", "2", "--micro-batch", "1",
                                 "--seq", "4096", "--precision", "bf16", "--stage", "1", "--optimizer",
                                 "adamw", "--attention", "flash", "--dp", "4", "--grad-precision",
                                 "fp32", "--format", "json"});
  CHECK(mg["per_device"] == zp_flags["per_device"]);
  CHECK(mg["strategy"] == zp_flags["strategy"]);
  CHECK(mg["assumed"].empty());  // Megatron's defaults are what its command line says
  // Expert parallelism the same way.
  const auto ep = json_of({"estimate", "--model", "mixtral-8x7b", "--megatron-args",
                           "--expert-model-parallel-size 2 --micro-batch-size 1 --seq-length 2048 --bf16 "
                           "--use-distributed-optimizer", "--dp", "4", "--format", "json"});
  const auto ep_flags = json_of({"estimate", "--model", "mixtral-8x7b", "--ep", "2", "--micro-batch", "1",
                                 "--seq", "2048", "--precision", "bf16", "--stage", "1", "--optimizer",
                                 "adamw", "--attention", "flash", "--dp", "4", "--grad-precision",
                                 "fp32", "--format", "json"});
  CHECK(ep["per_device"] == ep_flags["per_device"]);
  CHECK(ep["strategy"]["ep"] == 2);

  // The global batch over micro-batch x dp: 64 / (2 x 4) = 8; explicit flags override.
  auto s = json_of({"estimate", "--model", "gpt2", "--megatron-args",
                    "--micro-batch-size 2 --global-batch-size 64 --tensor-model-parallel-size 2",
                    "--dp", "4", "--format", "json"})["strategy"];
  CHECK(s["grad_accum"] == 8);
  CHECK(s["tp"] == 2);
  CHECK(s["precision"] == "fp32");  // neither --bf16 nor --fp16
  s = json_of({"estimate", "--model", "gpt2", "--megatron-args",
               "--micro-batch-size 2 --global-batch-size 64 --tensor-model-parallel-size 2 --bf16",
               "--dp", "4", "--tp", "4", "--grad-accum", "3", "--precision", "fp16", "--format", "json"})["strategy"];
  CHECK(s["tp"] == 4);
  CHECK(s["grad_accum"] == 3);
  CHECK(s["precision"] == "fp16");
  // Megatron-DeepSpeed: the DeepSpeed config's ZeRO stage with Megatron's tensor parallelism.
  zp::test::TempDir dir;
  const std::string ds = dir.write("ds.json", R"({"zero_optimization": {"stage": 2},
      "bf16": {"enabled": true}, "train_micro_batch_size_per_gpu": 2})");
  s = json_of({"estimate", "--model", "gpt2", "--ds-config", ds, "--megatron-args",
               "--tensor-model-parallel-size 2 --micro-batch-size 2 --bf16", "--format", "json"})["strategy"];
  CHECK(s["stage"] == 2);
  CHECK(s["tp"] == 2);

  // Without --model the size flags are the model (examples/llama's Llama 3 8B shape):
  // 8,030,261,248 parameters, as HF meta-llama/Llama-3.1-8B.
  const std::string llama3 =
      "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
      "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 "
      "--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 "
      "--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm "
      "--untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128256 "
      "--micro-batch-size 1 --bf16 --use-distributed-optimizer";
  const auto own = json_of({"estimate", "--megatron-args", llama3, "--dp", "8", "--format", "json"});
  CHECK(own["model"]["name"] == "megatron");
  CHECK(own["model"]["params"] == 8'030'261'248);
  const auto cat = json_of({"estimate", "--model", "llama-3.1-8b", "--megatron-args", llama3, "--dp", "8",
                            "--format", "json"});
  CHECK(own["per_device"] == cat["per_device"]);
  const Result text = zero_plan({"estimate", "--megatron-args", llama3, "--dp", "8"});
  CHECK(text.out.rfind("model:     megatron (llama)", 0) == 0);
  const std::string plan = dir.file("plan.json");
  REQUIRE(zero_plan({"plan", "--megatron-args",
                     "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 "
                     "--vocab-size 96 --seq-length 32", "-o", plan}).rc == 0);
  std::ifstream plan_file(plan);
  CHECK(nlohmann::json::parse(plan_file)["model"]["name"] == "megatron");

  // Bad input: one error naming the flag, a hint, exit 2.
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--megatron-args", "--tensor-model-paralel-size 2"}),
                  "--megatron-args: unknown flag --tensor-model-paralel-size");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--megatron-args", "--data-path 'a b"}),
                  "--megatron-args: unterminated single quote");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--megatron-args", "--micro-batch-size two"}),
                  "--micro-batch-size expects an integer, got 'two'");
  check_bad_input(zero_plan({"estimate", "--model", "llama-3.1-8b", "--megatron-args", "--hidden-size 5120"}),
                  "--hidden-size 5120 contradicts --model llama-3.1-8b (hidden size 4096)");
  check_bad_input(zero_plan({"estimate", "--model", "gpt2", "--megatron-args",
                             "--micro-batch-size 2 --global-batch-size 60", "--dp", "4"}),
                  "global batch 60 is not divisible by micro-batch 2 x data-parallel degree 4");
  check_bad_input(zero_plan({"estimate", "--megatron-args", "--tensor-model-parallel-size 2"}),
                  "--num-layers is missing");
  check_bad_input(zero_plan({"estimate", "--stage", "1"}), "--model is required");
}

TEST_CASE("parallelism: --pp lists every stage and names the most loaded; --sp, --cp, bad values") {
  // Llama-3.1-8B on 4 pipeline stages of 8 blocks, 1F1B with 8 micro-batches: stage i holds
  // min(4 - i, 8) micro-batches (Narayanan et al. 2021 sec. 2.2.1), so the first is the most
  // loaded; the JSON lists the stages with their blocks and per-device bytes.
  const Result r = zero_plan({"estimate", "--model", "llama-3.1-8b", "--pp", "4", "--grad-accum", "8",
                              "--seq", "2048", "--stage", "1", "--dp", "2", "--flash-attention",
                              "--format", "json"});
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  const auto j = nlohmann::json::parse(r.out);
  const auto& pl = j["pipeline"];
  CHECK(pl["pp"] == 4);
  CHECK(pl["schedule"] == "1f1b");
  REQUIRE(pl["stages"].size() == 4);
  for (int i = 0; i < 4; ++i) {
    CAPTURE(i);
    CHECK(pl["stages"][i]["in_flight"] == 4 - i);
    CHECK(pl["stages"][i]["blocks"][0][0] == 8 * i);
    CHECK(pl["stages"][i]["blocks"][0][1] == 8 * i + 8);
  }
  CHECK(pl["most_loaded_stage"] == 0);
  CHECK(j["per_device"] == pl["stages"][0]["per_device"]);
  CHECK(j["strategy"]["pp"] == 4);
  const Result text = zero_plan({"estimate", "--model", "llama-3.1-8b", "--pp", "4", "--vp", "2",
                                 "--grad-accum", "8", "--seq", "2048", "--stage", "1", "--dp", "2",
                                 "--flash-attention"});
  CHECK(text.rc == 0);
  CHECK(text.out.find("pipeline: 4 stages x 2 chunks, interleaved") != std::string::npos);
  // Sequence and context parallelism shrink the activations of the same run.
  auto acts = [](std::vector<std::string> extra) {
    std::vector<std::string> a = {"estimate", "--model", "llama-3.1-8b", "--tp", "4", "--seq", "8192",
                                  "--flash-attention", "--format", "json"};
    a.insert(a.end(), extra.begin(), extra.end());
    const Result x = zero_plan(a);
    CAPTURE(x.err);
    REQUIRE(x.rc == 0);
    return nlohmann::json::parse(x.out)["per_device"]["gpu"]["breakdown"]["activations"].get<uint64_t>();
  };
  const uint64_t tp = acts({}), sp = acts({"--sp"}), cp = acts({"--cp", "2"});
  CHECK(sp < tp);
  CHECK(cp < tp);
  check_bad_input(zero_plan({"estimate", "--model", "llama-3.1-8b", "--pp", "3"}),
                  "--pp 3: 32 layers are not divisible");
  check_bad_input(zero_plan({"estimate", "--model", "llama-3.1-8b", "--pp", "2", "--stage", "2"}),
                  "ZeRO-2 and ZeRO-3 do not combine with pipeline parallelism");
  check_bad_input(zero_plan({"estimate", "--model", "llama-3.1-8b", "--pp-schedule", "zigzag"}),
                  "--pp-schedule: unknown value 'zigzag'");
  check_bad_input(zero_plan({"estimate", "--model", "llama-3.1-8b", "--cp", "2"}),
                  "--flash-attention");
  check_bad_input(zero_plan({"estimate", "--model", "llama-3.1-8b", "--cp", "3", "--cp-kind", "ulysses",
                             "--seq", "3072"}),
                  "not divisible by it");
  check_bad_input(zero_plan({"estimate", "--model", "llama-3.1-8b", "--pp", "2", "--profile", "fsdp",
                             "--stage", "1"}),
                  "--pp is not modelled");
  // fit pins what is given: every candidate a 2-stage pipeline (ZeRO stages 0-1).
  const Result f = zero_plan({"fit", "--model", "gpt2", "--hardware", "h100-80g", "--gpus", "8",
                              "--pp", "2", "--grad-accum", "4", "--format", "json"});
  CAPTURE(f.err);
  REQUIRE(f.rc == 0);
  const nlohmann::json fj = nlohmann::json::parse(f.out);
  REQUIRE_FALSE(fj["candidates"].empty());
  for (const auto& c : fj["candidates"]) {
    CHECK(c["strategy"]["pp"] == 2);
    CHECK(c["strategy"]["stage"].get<int>() <= 1);
    CHECK(c["strategy"]["dp"].get<int>() * c["strategy"]["tp"].get<int>() * 2 == 8);
  }
}

TEST_CASE("estimate --checkpoint: the bytes on disk and the staging buffer") {
  // Llama 2 7B at stage 3 over 64 ranks: 6,738,415,616 parameters x (2 + 12) bytes in all.
  const Result r = zero_plan({"estimate", "--model", "llama-2-7b", "--stage", "3", "--dp", "64",
                              "--micro-batch", "1", "--seq", "4096", "--checkpoint"});
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("(14 B per element owned), 87.86 GiB in all from 64 ranks; a 16.00 MiB host "
                   "staging buffer, in the cpu peak") != std::string::npos);
  const Result j = zero_plan({"estimate", "--model", "llama-2-7b", "--stage", "3", "--dp", "64",
                              "--micro-batch", "1", "--seq", "4096", "--checkpoint", "--format", "json"});
  REQUIRE(j.rc == 0);
  const auto js = nlohmann::json::parse(j.out);
  CHECK(js["checkpoint"]["total_bytes"] == uint64_t{6'738'415'616} * 14);
  CHECK(js["per_device"]["cpu"]["total"] == js["checkpoint"]["staging_bytes"]);
}
