// `zero-plan fit` as a user meets it: the JSON contract, the DeepSpeed config it writes (read
// back through --ds-config), the Perfetto trace, and one clear error for bad input.
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "process.hpp"

using zp::test::Result;

namespace {
const std::string kBin = std::string(ZP_BIN_DIR) + "/zero-plan";

Result zero_plan(std::vector<std::string> args) {
  args.insert(args.begin(), kBin);
  return zp::test::run(args);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string fmt_layers(int64_t n) { return "max-model: " + std::to_string(n) + " layers"; }

void check_bad_input(const Result& r, const std::string& needle) {
  CAPTURE(r.err);
  CHECK(r.rc == 2);
  CHECK(r.out.empty());
  CHECK(r.err.rfind("error: ", 0) == 0);
  CHECK(r.err.find(needle) != std::string::npos);
}

// A hardware file: the v100-32g preset's speeds with the given memory.
std::string hw_json(const std::string& extra_or_missing) {
  nlohmann::json j = {{"name", "tiny"},          {"gpu_memory_bytes", 4294967296LL},
                      {"gpus_per_node", 1},      {"host_memory_bytes", 8589934592LL},
                      {"nvme_bytes", 0},         {"gpu_tflops", 39.0},
                      {"hbm_gbps", 900.0},       {"h2d_gbps", 12.0},
                      {"d2h_gbps", 12.0},        {"nvlink_gbps", 150.0},
                      {"internode_gbps", 100.0}, {"cpu_adam_gparams", 3.89},
                      {"nvme_read_gbps", 25.0},  {"nvme_write_gbps", 10.0}};
  if (extra_or_missing == "no-tflops") j.erase("gpu_tflops");
  if (extra_or_missing == "negative-h2d") j["h2d_gbps"] = -1.0;
  return j.dump();
}
}  // namespace

TEST_CASE("fit: json contract, DeepSpeed config round trip, trace") {
  zp::test::TempDir dir;
  const std::string ds = dir.file("ds.json"), trace = dir.file("trace.json");
  Result r = zero_plan({"fit", "--model", "gpt2", "--hardware", "a100-80g", "--gpus", "8",
                        "--format", "json", "--emit-deepspeed", ds, "--trace", trace});
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j["schema"] == "zero-plan/fit/v1");
  REQUIRE(j["candidates"].size() == 5);
  const auto& best = j["candidates"][0];
  CHECK(best["why"].get<std::string>().find("fastest") != std::string::npos);
  CHECK(best["per_device"]["gpu"]["total"].get<uint64_t>() > 0);
  CHECK(best["step_seconds"].get<double>() > 0);
  CHECK(j["n_searched"].get<uint64_t>() >= j["n_fit"].get<uint64_t>());

  // The emitted config drives estimate to the winner's memory.
  const auto cfg = nlohmann::json::parse(slurp(ds));
  CHECK(cfg["zero_optimization"]["stage"] == best["strategy"]["stage"]);
  // (The delayed update has no DeepSpeed field; it is given as a flag, as the note says.)
  std::vector<std::string> est = {"estimate", "--model", "gpt2", "--ds-config", ds, "--dp",
                                  std::to_string(best["strategy"]["dp"].get<int64_t>()),
                                  "--checkpointing",
                                  best["strategy"]["checkpointing"].get<std::string>(), "--format",
                                  "json"};
  if (best["strategy"]["dpu"].get<bool>()) est.push_back("--dpu");
  Result e = zero_plan(est);
  REQUIRE(e.rc == 0);
  CHECK(nlohmann::json::parse(e.out)["per_device"] == best["per_device"]);

  const auto t = nlohmann::json::parse(slurp(trace));
  CHECK(t["traceEvents"].size() > 10);

  Result text = zero_plan({"fit", "--model", "gpt2", "--hardware", "v100-32g", "--profile",
                           "deepspeed", "--stage", "2"});
  REQUIRE(text.rc == 0);
  CHECK(text.out.find("estimate_zero2_model_states_mem_needs") != std::string::npos);
}

TEST_CASE("fit --max-model: the largest of the family, with its config") {
  Result r = zero_plan({"fit", "--model", "gpt2-xl", "--hardware", "v100-32g", "--max-model",
                        "--stage", "2", "--offload-optimizer", "cpu", "--micro-batch", "1",
                        "--checkpointing", "full", "--format", "json"});
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j["max_model"]["params"].get<int64_t>() > 1'557'611'200);  // more than gpt2-xl itself
  CHECK(j["max_model"]["config"]["n_embd"] == 1600);
  // stderr is not a terminal here: no progress lines unless asked for.
  CHECK(r.err.find("max-model:") == std::string::npos);

  // --progress: one line per probed depth on stderr; stdout the same JSON, nothing else.
  Result p = zero_plan({"fit", "--model", "gpt2-xl", "--hardware", "v100-32g", "--max-model",
                        "--stage", "2", "--offload-optimizer", "cpu", "--micro-batch", "1",
                        "--checkpointing", "full", "--format", "json", "--progress"});
  CAPTURE(p.err);
  REQUIRE(p.rc == 0);
  const auto jp = nlohmann::json::parse(p.out);
  CHECK(jp["max_model"] == j["max_model"]);
  const int64_t L = j["max_model"]["n_layer"].get<int64_t>();
  std::istringstream lines(p.err);
  std::string line;
  int n_lines = 0;
  bool fits_at_L = false, not_at_L1 = false;
  while (std::getline(lines, line)) {
    CAPTURE(line);
    REQUIRE(line.rfind("max-model: ", 0) == 0);
    ++n_lines;
    if (line.rfind(fmt_layers(L) + " (", 0) == 0) fits_at_L |= line.find("): fits, ") != std::string::npos;
    if (line.rfind(fmt_layers(L + 1) + " (", 0) == 0)
      not_at_L1 |= line.find("): does not fit, ") != std::string::npos;
  }
  CHECK(n_lines >= 2);
  CHECK(fits_at_L);
  CHECK(not_at_L1);
}

TEST_CASE("fit: bad input and models that fit nowhere") {
  zp::test::TempDir dir;
  check_bad_input(zero_plan({"fit", "--model", "gpt2", "--hardware", "v100-32g", "--gpus", "0"}),
                  "--gpus");
  check_bad_input(zero_plan({"fit", "--model", "gpt2", "--hardware", "v100-32g", "--gpus", "2",
                             "--nodes", "4"}),
                  "--nodes 4 is more than --gpus 2");
  check_bad_input(zero_plan({"fit", "--model", "gpt2", "--hardware", "v100-32g", "--gpus", "8",
                             "--dp", "4"}),
                  "--gpus is 8");
  check_bad_input(zero_plan({"fit", "--model", "gpt2", "--hardware", "v100-32g", "--stage", "2",
                             "--offload-param", "cpu"}),
                  "--offload-param cpu: needs --stage 3");
  check_bad_input(zero_plan({"fit", "--model", "gpt2", "--hardware", "v100-32g", "--gpus", "64",
                             "--nodes", "2"}),
                  "do not fit on 2 node(s)");
  check_bad_input(zero_plan({"fit", "--model", "gpt2", "--hardware",
                             dir.write("a.json", hw_json("no-tflops"))}),
                  "gpu_tflops");
  check_bad_input(zero_plan({"fit", "--model", "gpt2", "--hardware",
                             dir.write("b.json", hw_json("negative-h2d"))}),
                  "'h2d_gbps' must be a positive number");
  // Fits nowhere: exit 1, and the closest miss says what it lacks.
  Result r = zero_plan({"fit", "--model", "gpt2-xl", "--hardware", dir.write("c.json", hw_json("")),
                        "--micro-batch", "1"});
  CHECK(r.rc == 1);
  CHECK(r.out.find("nothing fits") != std::string::npos);
  CHECK(r.out.find("needs") != std::string::npos);
  CHECK(r.out.find(", has ") != std::string::npos);
}

TEST_CASE("fit --parallel: tensor, sequence, pipeline and context parallelism searched, screened") {
  // Llama-3.1-8B on 64 H100s at 8192 tokens, a global batch of 256 sequences: every dimension
  // in one round; the candidates are exact (each as `estimate` plans it).
  zp::test::TempDir dir;
  const std::string args_file = dir.file("args.txt");
  Result r = zero_plan({"fit", "--model", "llama-3.1-8b", "--hardware", "h100-80g", "--gpus", "64",
                        "--seq", "8192", "--flash-attention", "--parallel", "--global-batch", "256",
                        "--stage", "1", "--top", "3", "--format", "json"});
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  const nlohmann::json j = nlohmann::json::parse(r.out);
  CHECK(j["screened"] == true);
  CHECK(j["n_exact"].get<uint64_t>() < j["n_searched"].get<uint64_t>());
  CHECK(j["n_searched"].get<uint64_t>() > 1000);
  REQUIRE(j["candidates"].size() == 3);
  for (const auto& c : j["candidates"]) {
    const auto& s = c["strategy"];
    CHECK(s["dp"].get<int64_t>() * s["tp"].get<int64_t>() * s["pp"].get<int64_t>() * s["cp"].get<int64_t>() == 64);
    CHECK(s["micro_batch"].get<int64_t>() * s["grad_accum"].get<int64_t>() * s["dp"].get<int64_t>() == 256);
  }
  // The winner, pinned dimension by dimension, is planned by `estimate` to the byte.
  const auto& w = j["candidates"][0]["strategy"];
  std::vector<std::string> est = {"estimate", "--model", "llama-3.1-8b", "--hardware", "h100-80g",
                                  "--seq", "8192", "--flash-attention", "--format", "json",
                                  "--stage", "1",
                                  "--dp", std::to_string(w["dp"].get<int64_t>()),
                                  "--tp", std::to_string(w["tp"].get<int64_t>()),
                                  "--pp", std::to_string(w["pp"].get<int64_t>()),
                                  "--vp", std::to_string(w["vp"].get<int64_t>()),
                                  "--cp", std::to_string(w["cp"].get<int64_t>()),
                                  "--micro-batch", std::to_string(w["micro_batch"].get<int64_t>()),
                                  "--grad-accum", std::to_string(w["grad_accum"].get<int64_t>()),
                                  "--checkpointing", w["checkpointing"].get<std::string>(),
                                  "--offload-optimizer", w["offload_optimizer"].get<std::string>()};
  if (w["sp"].get<bool>()) est.push_back("--sp");
  if (w["dpu"].get<bool>()) est.push_back("--dpu");
  const Result e = zero_plan(est);
  CAPTURE(e.err);
  REQUIRE(e.rc == 0);
  CHECK(nlohmann::json::parse(e.out)["per_device"] == j["candidates"][0]["per_device"]);
  // The text names the screening.
  const Result t = zero_plan({"fit", "--model", "llama-3.1-8b", "--hardware", "h100-80g", "--gpus", "64",
                              "--seq", "8192", "--flash-attention", "--parallel", "--global-batch", "256",
                              "--stage", "1", "--top", "1"});
  CHECK(t.rc == 0);
  CHECK(t.out.find("screened: ") != std::string::npos);
  // Both files: Megatron-DeepSpeed's arguments beside the DeepSpeed config, every ZeRO stage
  // searched; the two say the same stage.
  const std::string ds = dir.file("ds.json");
  const Result both = zero_plan({"fit", "--model", "llama-3.1-8b", "--hardware", "h100-80g", "--gpus", "64",
                                 "--seq", "8192", "--flash-attention", "--parallel", "--global-batch", "256",
                                 "--top", "1", "--emit-megatron", args_file, "--emit-deepspeed", ds});
  CAPTURE(both.err);
  REQUIRE(both.rc == 0);
  const nlohmann::json dsj = nlohmann::json::parse(slurp(ds));
  const std::string line = slurp(args_file);
  CHECK(line.find("--deepspeed --deepspeed_config " + ds + " --zero-stage " +
                  std::to_string(dsj["zero_optimization"]["stage"].get<int>())) == 0);
  CHECK(line.find("--context-parallel-size") == std::string::npos);  // Megatron-LM's only
  check_bad_input(zero_plan({"fit", "--model", "gpt2", "--hardware", "h100-80g", "--gpus", "8",
                             "--parallel", "--max-model"}),
                  "--max-model with --parallel");
  check_bad_input(zero_plan({"fit", "--model", "gpt2", "--hardware", "h100-80g", "--gpus", "8",
                             "--global-batch", "64", "--grad-accum", "2"}),
                  "give one of them");
  check_bad_input(zero_plan({"fit", "--model", "gpt2", "--hardware", "h100-80g", "--gpus", "8",
                             "--global-batch", "0"}),
                  "--global-batch");
}

TEST_CASE("fit --emit-megatron: the winner as Megatron-LM arguments plans as the same run") {
  // The arguments written for the winner, read back by `estimate --megatron-args` on the same
  // GPUs, give the winner's own per-device bytes: the line says the whole strategy.
  zp::test::TempDir dir;
  const std::string args = dir.file("args.txt");
  const Result fit = zero_plan({"fit", "--model", "llama-2-7b", "--hardware", "a100-80g", "--gpus", "8",
                                "--stage", "1", "--emit-megatron", args, "--format", "json"});
  CAPTURE(fit.err);
  REQUIRE(fit.rc == 0);
  std::string line = slurp(args);
  REQUIRE(!line.empty());
  CHECK(line.back() == '\n');
  line.pop_back();
  CHECK(line.find("--use-distributed-optimizer") != std::string::npos);
  const auto winner = nlohmann::json::parse(fit.out)["candidates"][0];
  const Result est = zero_plan({"estimate", "--model", "llama-2-7b", "--hardware", "a100-80g",
                                "--dp", std::to_string(winner["strategy"]["dp"].get<int64_t>()),
                                "--megatron-args", line, "--format", "json"});
  CAPTURE(est.err);
  REQUIRE(est.rc == 0);
  CHECK(nlohmann::json::parse(est.out)["per_device"] == winner["per_device"]);
  // A ZeRO-2 winner has no Megatron-LM arguments: refused, nothing written.
  const std::string none = dir.file("none.txt");
  check_bad_input(zero_plan({"fit", "--model", "llama-2-7b", "--hardware", "a100-80g", "--gpus", "8",
                             "--stage", "2", "--emit-megatron", none}),
                  "ZeRO stage 2 has no Megatron-LM flag");
  CHECK_FALSE(std::ifstream(none).good());
}
