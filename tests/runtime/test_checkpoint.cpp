// test_checkpoint.cpp (run by ctest alone as one rank, and under mpirun -np 2): training
// checkpoints in the engine. The reference is the same training never stopped: a run saved
// after `at` steps, destroyed, and resumed into a fresh engine and device must end with the
// same weights bit for bit and the same losses, for every stage, offload (host tier, NVMe for
// the optimizer and the parameters), the delayed parameter update saved with its update in
// flight, overlap_comm, fp16 with skipped steps and a changing loss scale, SGD, and dropout.
// The resumed run's memory matches its plan op by op (the staging buffer included). Damaged
// files, other models and precisions are refused. The data-parallel degree changed between
// save and resume, kills and ENOSPC are tests/cli/test_zero_run_checkpoint.cpp's.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <fstream>
#include <string>
#include <vector>

#include "engine_fixture.hpp"
#include "error_of.hpp"
#include "process.hpp"
#include "zp/json_fields.hpp"
#include <nlohmann/json.hpp>
#include "zp/models/model_spec.hpp"
#include "zp/planner/plan.hpp"
#include "zp/runtime/checkpoint.hpp"
#include "zp/runtime/engine.hpp"

using namespace zp;
using namespace zp::runtime;
using test::SharedDir;

namespace {

struct Outcome {
  std::vector<double> losses;   // of the steps after `at`
  std::vector<float> scales;    // their loss scales
  std::vector<bool> skipped;
  std::string weights;
};

planner::Plan plan_of(planner::Strategy s, const models::ModelSpec& m, planner::Backend b) {
  s.dp = test::comm().size();
  s.save_checkpoint = true;
  return planner::make_plan(m, s, {planner::Profile::zeroplan, b}, 1234);
}

// `steps` steps; with `at` >= 0 the engine saves after step `at` into dir/ckpt, goes away with
// its device, and a new one resumes from there. `check_memory`: the resumed engine's memory
// against the plan, op by op.
Outcome train(const planner::Plan& plan, const EngineOptions& opt, int steps, int at,
              const std::string& dir, bool check_memory = false) {
  Outcome out;
  const std::string ckpt = dir + "/ckpt", wpath = dir + "/w.bin";
  auto record = [&](const StepStats& st, int i) {
    if (i >= std::max(at, 0)) {
      out.losses.push_back(st.loss);
      out.scales.push_back(st.loss_scale);
      out.skipped.push_back(st.skipped);
    }
  };
  int i = 0;
  if (at >= 0) {
    auto dev = test::device_for(plan);
    Engine e(plan, *dev, test::comm(), TokenData::load(""), opt);
    for (; i < at; ++i) record(e.step(), i);
    e.save_checkpoint(ckpt, 0);
  }
  auto dev = test::device_for(plan);
  std::vector<planner::TimelineSample> timeline;
  {
    Engine e(plan, *dev, test::comm(), TokenData::load(""), opt);
    if (at >= 0) {
      const std::string step_dir = resolve_checkpoint(ckpt);
      e.load_checkpoint(step_dir, read_manifest(step_dir));
      CHECK(e.steps_done() == at);
    }
    for (; i < steps; ++i) record(e.step(), i);
    timeline = e.timeline();
    e.save_weights(wpath);
  }
  if (check_memory) test::check_memory_matches_plan(plan, *dev, timeline);
  out.weights = test::slurp(wpath);
  test::comm().barrier();  // every rank done with the checkpoint before rank 0 removes it
  if (test::comm().rank() == 0) std::filesystem::remove_all(ckpt);
  test::comm().barrier();
  return out;
}

// Never stopped vs stopped after `at` steps: the same weights and the same steps after.
void check_resume(const planner::Strategy& s, EngineOptions opt, int steps, int at,
                  const models::ModelSpec& m = models::load_model("gpt2-tiny"),
                  planner::Backend b = planner::Backend::cpu) {
  SharedDir dir;
  opt.nvme_path = dir.path;
  const planner::Plan plan = plan_of(s, m, b);
  const Outcome straight = train(plan, opt, steps, -1, dir.path);
  const Outcome resumed = train(plan, opt, steps, at, dir.path, true);
  REQUIRE(!straight.weights.empty());
  CHECK(straight.weights == resumed.weights);
  // The resumed run's own steps (after `at`) equal the straight run's same steps.
  REQUIRE(straight.losses.size() == static_cast<std::size_t>(steps));
  REQUIRE(resumed.losses.size() == static_cast<std::size_t>(steps - at));
  for (int k = at; k < steps; ++k) {
    CHECK(straight.losses[static_cast<std::size_t>(k)] == resumed.losses[static_cast<std::size_t>(k - at)]);
    CHECK(straight.scales[static_cast<std::size_t>(k)] == resumed.scales[static_cast<std::size_t>(k - at)]);
    CHECK(straight.skipped[static_cast<std::size_t>(k)] == resumed.skipped[static_cast<std::size_t>(k - at)]);
  }
}

planner::Strategy strategy(int stage, planner::Precision p = planner::Precision::bf16) {
  return test::tiny_strategy(stage, p);
}

}  // namespace

TEST_CASE("checkpoint: a resumed run ends where a run never stopped does, every stage") {
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    check_resume(strategy(stage), {}, 6, 3);
  }
  // fp32 AdamW (no master weights: the parameters are the weights) and SGD with momentum.
  planner::Strategy s = strategy(2, planner::Precision::fp32);
  s.optimizer = planner::OptimizerKind::adamw;
  EngineOptions wd;
  wd.weight_decay = 0.1f;
  wd.grad_clip = 0.5f;
  check_resume(s, wd, 5, 2);
  s = strategy(1);
  s.optimizer = planner::OptimizerKind::sgd;
  check_resume(s, {}, 5, 2);
}

TEST_CASE("checkpoint: fp16's loss scaler goes on (skipped steps, growth) across the stop") {
  // 2^40 overflows the first steps (skipped, the scale halving); a window of 2 doubles it
  // again every two good steps, so the scale and the count of good steps both matter.
  EngineOptions opt;
  opt.initial_loss_scale = 1099511627776.0f;
  opt.loss_scale_window = 2;
  for (int at : {2, 5}) {
    CAPTURE(at);
    check_resume(strategy(2, planner::Precision::fp16), opt, 9, at);
  }
}

TEST_CASE("checkpoint: offloaded states, on the host and on NVMe, and overlap_comm") {
  planner::Strategy s = strategy(2);
  s.offload_optimizer = planner::Offload::cpu;
  check_resume(s, {}, 5, 2);
  s = strategy(3);
  s.offload_optimizer = planner::Offload::cpu;
  s.offload_param = planner::Offload::cpu;
  check_resume(s, {}, 5, 2);
  s = strategy(2);
  s.offload_optimizer = planner::Offload::nvme;
  s.buffers.optimizer_swap_chunk_size = 8192;  // several chunks per swap file
  check_resume(s, {}, 5, 2);
  s = strategy(3);
  s.offload_optimizer = planner::Offload::nvme;
  s.offload_param = planner::Offload::nvme;
  s.buffers.param_swap_buffer_size = 4096;
  check_resume(s, {}, 5, 2);
  for (int stage : {2, 3}) {
    s = strategy(stage);
    s.overlap_comm = true;
    s.grad_accum = 2;
    s.buffers.reduce_bucket_size = 20'000;
    s.buffers.prefetch_bucket_size = 60'000;
    check_resume(s, {}, 4, 2);
  }
}

TEST_CASE("checkpoint: the delayed parameter update is saved in flight and applied after") {
  // Warmup 1: steps 2.. are delayed; a checkpoint after step 3 holds an update computed but
  // not applied, which the resumed run applies after its first backward, as the straight
  // run does.
  for (auto where : {planner::Offload::cpu, planner::Offload::nvme}) {
    for (auto prec : {planner::Precision::bf16, planner::Precision::fp32}) {
      CAPTURE(static_cast<int>(where));
      CAPTURE(static_cast<int>(prec));
      planner::Strategy s = strategy(2, prec);
      s.offload_optimizer = where;
      s.dpu = true;
      EngineOptions opt;
      opt.dpu_warmup_steps = 1;
      check_resume(s, opt, 6, 3);
      check_resume(s, opt, 3, 1);  // saved in the warmup, resumed into the delayed steps
    }
  }
}

TEST_CASE("checkpoint: dropout masks and data go on from the step (the GPU's graph)") {
  const models::ModelSpec m = test::tiny_model_with_dropout(0.1, 0.1, 0.1);
  check_resume(strategy(3), {}, 5, 2, m, planner::Backend::cuda);
}

TEST_CASE("checkpoint: the files are whole; damaged ones and other models are refused") {
  SharedDir dir;
  const planner::Plan plan = plan_of(strategy(2), models::load_model("gpt2-tiny"), planner::Backend::cpu);
  const std::string root = dir.path + "/ckpt";
  {
    auto dev = test::device_for(plan);
    Engine e(plan, *dev, test::comm(), TokenData::load(""), {});
    e.step();
    e.save_checkpoint(root, 2);
    e.step();
    e.save_checkpoint(root, 2);
    e.step();
    e.save_checkpoint(root, 2);
  }
  test::comm().barrier();
  // keep 2: steps 2 and 3 remain, latest names step 3, nothing temporary is left.
  std::vector<std::string> names;
  for (const auto& f : std::filesystem::directory_iterator(root)) names.push_back(f.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"latest", "step-00000002", "step-00000003"});
  CHECK(test::slurp(root + "/latest") == "step-00000003\n");
  const std::string step_dir = resolve_checkpoint(root);
  CHECK(step_dir == root + "/step-00000003");
  const CheckpointManifest m = read_manifest(step_dir);
  CHECK(m.step == 3);
  CHECK(m.dp == test::comm().size());
  CHECK(static_cast<int>(m.shards.size()) == test::comm().size());
  // Each file's entries cover its bytes exactly; every state's elements are covered once.
  std::map<std::string, uint64_t> elems;
  for (const CheckpointShard& sh : m.shards) {
    uint64_t end = 0;
    for (const CheckpointEntry& e : sh.entries) {
      CHECK(e.offset == end);
      end += e.n * dtype_bytes(e.dtype);
      elems[e.state] += e.n;
    }
    CHECK(end == sh.bytes);
    CHECK(std::filesystem::file_size(step_dir + "/" + sh.file) == sh.bytes);
  }
  CHECK(elems == std::map<std::string, uint64_t>{{"params", m.n_params}, {"master", m.n_params},
                                                 {"exp_avg", m.n_params}, {"exp_avg_sq", m.n_params}});

  auto load_error = [&](const planner::Plan& p) {
    auto dev = test::device_for(p);
    Engine e(p, *dev, test::comm(), TokenData::load(""), {});
    return test::error_of([&] { e.load_checkpoint(step_dir, read_manifest(step_dir)); });
  };
  // Another precision, another optimizer, another model: refused, naming what differs.
  CHECK(load_error(plan_of(strategy(2, planner::Precision::fp16), models::load_model("gpt2-tiny"),
                           planner::Backend::cpu))
            .find("saved in bf16, this run trains in fp16") != std::string::npos);
  planner::Strategy sgd = strategy(2);
  sgd.optimizer = planner::OptimizerKind::sgd;
  CHECK(load_error(plan_of(sgd, models::load_model("gpt2-tiny"), planner::Backend::cpu))
            .find("holds adam states, this run's optimizer is sgd") != std::string::npos);
  nlohmann::json deeper = nlohmann::json::parse(models::to_hf_config(models::load_model("gpt2-tiny")));
  deeper["n_layer"] = 3;
  CHECK(load_error(plan_of(strategy(2), models::parse_hf_config(deeper.dump(), "deeper.json"), planner::Backend::cpu))
            .find("is a checkpoint of gpt2-tiny (120576 parameters), this run trains") != std::string::npos);

  // A flipped byte (the CRC-32), a truncated file, a missing one: refused naming the file, on
  // every rank.
  const std::string victim = step_dir + "/rank0.bin";
  const std::string good = test::slurp(victim);
  auto damage = [&](const std::string& bytes) {
    test::comm().barrier();
    if (test::comm().rank() == 0) std::ofstream(victim, std::ios::binary | std::ios::trunc) << bytes;
    test::comm().barrier();
  };
  std::string flipped = good;
  flipped[flipped.size() / 2] = static_cast<char>(flipped[flipped.size() / 2] ^ 0x10);
  damage(flipped);
  const std::string e1 = load_error(plan);
  CHECK((e1.find("rank0.bin is corrupted: CRC-32") != std::string::npos ||
         e1.find("failed on 1 other rank") != std::string::npos));
  damage(good.substr(0, good.size() - 100));
  const std::string e2 = load_error(plan);
  CHECK((e2.find("rank0.bin has " + std::to_string(good.size() - 100) + " bytes, its manifest says") != std::string::npos ||
         e2.find("failed on 1 other rank") != std::string::npos));
  damage(good);
  CHECK(load_error(plan).empty());  // whole again: it loads
}

TEST_CASE("checkpoint: the manifest is read strictly") {
  const std::string ok = R"({"schema": "zero-run/checkpoint/v1", "model": "m", "model_config": {},
    "precision": "bf16", "optimizer": "adam", "n_params": 10, "stage": 2, "dp": 1, "step": 3,
    "loss_scale": 1, "shards": [{"file": "rank0.bin", "rank": 0, "bytes": 20, "crc32": 7,
    "entries": [{"state": "params", "dtype": "bf16", "flat": 0, "n": 10, "offset": 0}]}]})";
  auto parse = [](const std::string& text) {
    return manifest_from_json(parse_json_text(text, "manifest.json"), "manifest.json");
  };
  const CheckpointManifest m = parse(ok);
  CHECK(m.shards.at(0).entries.at(0).n == 10);
  auto with = [&](const std::string& from, const std::string& to) {
    std::string t = ok;
    t.replace(t.find(from), from.size(), to);
    return test::error_of([&] { parse(t); });
  };
  CHECK(with("\"step\": 3", "\"step\": -3").find("field 'step'") != std::string::npos);
  CHECK(with("\"step\": 3", "\"stepp\": 3").find("unknown field 'stepp'") != std::string::npos);
  CHECK(with("\"n\": 10", "\"n\": 11").find("field 'shards[0].entries[0].n'") != std::string::npos);
  CHECK(with("\"offset\": 0", "\"offset\": 2").find("field 'shards[0].entries[0].offset'") != std::string::npos);
  CHECK(with("\"rank0.bin\"", "\"../x.bin\"").find("field 'shards[0].file'") != std::string::npos);
  CHECK(with("\"crc32\": 7", "\"crc32\": 4294967296").find("field 'shards[0].crc32'") != std::string::npos);
  CHECK(with("\"bf16\", \"flat\"", "\"int8\", \"flat\"").find("field 'shards[0].entries[0].dtype'") != std::string::npos);
  CHECK(with("zero-run/checkpoint/v1", "zero-run/checkpoint/v9").find("field 'schema'") != std::string::npos);
}
