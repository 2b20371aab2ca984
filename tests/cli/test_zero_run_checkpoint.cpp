// zero-run's checkpoints under mpirun, as a user runs them: a checkpoint saved at dp 4 resumed
// at dp 2 and 8 and at another stage (its states re-cut exactly, the weights those of a run
// that never stopped at the old degree... and at the new one, the same from a re-saved copy);
// --steps counting from the start; ranks SIGKILLed at seeded random points of their
// checkpoint I/O always leaving the previous checkpoint loadable and the next resume exact;
// ENOSPC injected and a real file-size limit failing the step on every rank with the file
// named and the last checkpoint intact; damaged files and mismatched runs refused.
// ZP_FAULT_TRIALS sets the kill trials (8 by default; the "long" label's test runs 60).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "process.hpp"

using zp::test::Result;

namespace {

namespace fs = std::filesystem;

const std::string kRun = std::string(ZP_BIN_DIR) + "/zero-run";
const std::vector<std::string> kEnv = {"OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
                                       "OMPI_MCA_rmaps_base_oversubscribe=1"};

Result mpirun(int np, std::vector<std::string> args, std::vector<std::string> env = {},
              int timeout_s = 180) {
  std::vector<std::string> argv = {ZP_MPIEXEC, "-np", std::to_string(np), kRun};
  argv.insert(argv.end(), args.begin(), args.end());
  env.insert(env.end(), kEnv.begin(), kEnv.end());
  return zp::test::run(argv, env, timeout_s);
}

// gpt2-tiny, micro-batch 1, sequence 32: a global batch of dp sequences.
std::vector<std::string> model(int stage, std::vector<std::string> more = {}) {
  std::vector<std::string> a = {"--model", "gpt2-tiny", "--stage", std::to_string(stage),
                                "--micro-batch", "1", "--seq", "32"};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

// Every state of a checkpoint put together in flat order, read from its manifest and files
// here (not through the runtime): state -> bytes.
std::map<std::string, std::string> consolidate(const std::string& step_dir) {
  const auto m = nlohmann::json::parse(zp::test::slurp(step_dir + "/manifest.json"));
  const uint64_t n = m["n_params"].get<uint64_t>();
  std::map<std::string, std::string> out;
  for (const auto& sh : m["shards"]) {
    const std::string bytes = zp::test::slurp(step_dir + "/" + sh["file"].get<std::string>());
    for (const auto& e : sh["entries"]) {
      const uint64_t eb = e["dtype"] == "fp32" ? 4 : 2;
      std::string& s = out[e["state"].get<std::string>()];
      s.resize(n * eb);
      const uint64_t len = e["n"].get<uint64_t>() * eb, off = e["offset"].get<uint64_t>();
      REQUIRE(off + len <= bytes.size());
      std::copy_n(bytes.data() + off, len, s.data() + e["flat"].get<uint64_t>() * eb);
    }
  }
  return out;
}

std::string latest(const std::string& root) {
  std::string s = zp::test::slurp(root + "/latest");
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

}  // namespace

TEST_CASE("universal resume: saved at dp 4, resumed at dp 2 and 8 and at another stage") {
  zp::test::TempDir dir;
  const std::string c4 = dir.file("c4");
  REQUIRE(mpirun(4, model(2, {"--steps", "3", "--save-checkpoint", c4})).rc == 0);
  const auto states4 = consolidate(c4 + "/step-00000003");
  CHECK(states4.size() == 4);  // params, master, exp_avg, exp_avg_sq
  for (int np : {2, 8}) {
    for (int stage : {1, 3}) {
      CAPTURE(np);
      CAPTURE(stage);
      // Re-cut: resumed with nothing left to run and saved again, the same values everywhere.
      const std::string again = dir.file("again");
      fs::remove_all(again);
      const Result r = mpirun(np, model(stage, {"--steps", "3", "--resume", c4, "--save-checkpoint", again}));
      CAPTURE(r.err);
      REQUIRE(r.rc == 0);
      CHECK(r.out.find("resumed from " + c4 + "/step-00000003 at step 3 (saved at dp 4, stage 2); "
                       "--steps 3 already reached, nothing to run") != std::string::npos);
      const auto m = nlohmann::json::parse(zp::test::slurp(again + "/step-00000003/manifest.json"));
      CHECK(m["dp"] == np);
      CHECK(m["shards"].size() == static_cast<std::size_t>(np));
      CHECK(consolidate(again + "/step-00000003") == states4);
      // Going on at the new degree: from the dp-4 checkpoint and from its re-cut copy, the
      // same weights; --steps 5 ends at step 5.
      const std::string wa = dir.file("wa.bin"), wb = dir.file("wb.bin");
      const Result a = mpirun(np, model(stage, {"--steps", "5", "--resume", c4, "--save-weights", wa}));
      const Result b = mpirun(np, model(stage, {"--steps", "5", "--resume", again, "--save-weights", wb}));
      REQUIRE(a.rc == 0);
      REQUIRE(b.rc == 0);
      CHECK(a.out.find("step 5/5") != std::string::npos);
      CHECK(a.out.find("step 3/5") == std::string::npos);  // steps 1-3 are not run again
      CHECK(zp::test::slurp(wa) == zp::test::slurp(wb));
      CHECK(zp::test::slurp(wa).size() == 120576 * 4);
    }
  }
  // At the same degree: stopped at 3 and resumed to 6 = never stopped.
  const std::string w1 = dir.file("w1.bin"), w2 = dir.file("w2.bin");
  REQUIRE(mpirun(4, model(2, {"--steps", "6", "--save-weights", w1})).rc == 0);
  REQUIRE(mpirun(4, model(2, {"--steps", "6", "--resume", c4, "--save-weights", w2})).rc == 0);
  CHECK(zp::test::slurp(w1) == zp::test::slurp(w2));
}

TEST_CASE("kills at random points of checkpoint I/O leave the previous checkpoint whole") {
  zp::test::TempDir dir;
  const int trials = std::getenv("ZP_FAULT_TRIALS") ? std::atoi(std::getenv("ZP_FAULT_TRIALS")) : 8;
  // The reference: 6 steps never stopped; a clean checkpoint at step 2 to start from.
  const std::string ref = dir.file("ref.bin"), base = dir.file("base");
  REQUIRE(mpirun(2, model(3, {"--steps", "6", "--save-weights", ref})).rc == 0);
  REQUIRE(mpirun(2, model(3, {"--steps", "2", "--save-checkpoint", base})).rc == 0);
  // How many I/O points a rank passes while the run saves at steps 3 and 4.
  const Result counted = mpirun(2, model(3, {"--steps", "4", "--resume", base, "--save-checkpoint",
                                             dir.file("counted"), "--checkpoint-every", "1"}),
                                {"ZP_CHECKPOINT_FAULT=count", "ZP_CHECKPOINT_FAULT_RANK=0"});
  REQUIRE(counted.rc == 0);
  const auto at = counted.err.rfind("checkpoint I/O points so far: ");
  REQUIRE(at != std::string::npos);
  const int points = std::atoi(counted.err.c_str() + at + 30);
  MESSAGE("rank 0 passes " << points << " checkpoint I/O points in two saves");
  REQUIRE(points > 10);
  std::mt19937 rng(20261127);
  int killed = 0;
  for (int t = 0; t < trials; ++t) {
    const int rank = static_cast<int>(rng() % 2);
    const int point = 1 + static_cast<int>(rng() % static_cast<unsigned>(points + 2));
    CAPTURE(rank);
    CAPTURE(point);
    std::string trial = "trial";
    trial += std::to_string(t);
    const std::string root = dir.file(trial);
    fs::copy(base, root, fs::copy_options::recursive);
    const Result k = mpirun(2, model(3, {"--steps", "4", "--resume", root, "--save-checkpoint", root,
                                         "--checkpoint-every", "1"}),
                            {"ZP_CHECKPOINT_FAULT=kill@" + std::to_string(point),
                             "ZP_CHECKPOINT_FAULT_RANK=" + std::to_string(rank)});
    if (k.rc != 0) {
      ++killed;
      CHECK(k.err.find("killed at checkpoint I/O point " + std::to_string(point)) != std::string::npos);
    }
    // Whatever survived is a whole checkpoint (step 2, 3 or 4), and resuming from it to step 6
    // gives the weights of the run never stopped.
    const std::string w = dir.file("w.bin");
    fs::remove(w);
    const Result r = mpirun(2, model(3, {"--steps", "6", "--resume", root, "--save-weights", w}));
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    CHECK(zp::test::slurp(w) == zp::test::slurp(ref));
    for (const auto& e : fs::directory_iterator(root)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("step-", 0) == 0) CHECK(fs::exists(e.path() / "manifest.json"));
    }
    fs::remove_all(root);
  }
  MESSAGE(killed << " of " << trials << " trials killed a rank mid-checkpoint");
  CHECK(killed > 0);
}

TEST_CASE("ENOSPC and a file-size limit fail the step on every rank, the last checkpoint intact") {
  zp::test::TempDir dir;
  const std::string root = dir.file("c");
  REQUIRE(mpirun(2, model(2, {"--steps", "2", "--save-checkpoint", root})).rc == 0);
  // Rank 1's third I/O point of the next save is a write of its file: ENOSPC.
  const Result r = mpirun(2, model(2, {"--steps", "3", "--resume", root, "--save-checkpoint", root}),
                          {"ZP_CHECKPOINT_FAULT=enospc@3", "ZP_CHECKPOINT_FAULT_RANK=1"});
  CAPTURE(r.err);
  CHECK(r.rc == 1);
  CHECK(r.err.find("error: rank 1: write " + root + "/.step-00000003.tmp/rank1.bin.tmp: No space left on device") !=
        std::string::npos);
  CHECK(r.err.find("rank 0: writing the checkpoint failed on 1 other rank") == std::string::npos);  // said once
  CHECK(latest(root) == "step-00000002");
  CHECK(!fs::exists(root + "/.step-00000003.tmp"));
  CHECK(!fs::exists(root + "/step-00000003"));
  // A real limit: files of at most 400 KiB (ulimit -f on the ranks; shared-memory transport
  // off, its segments are files too): each rank's ~820 KiB file fails with EFBIG.
  const Result big = zp::test::run(
      {ZP_MPIEXEC, "-np", "2", "--mca", "btl", "self,tcp", "/bin/bash", "-c",
       "ulimit -f 400 && exec " + kRun + " --model gpt2-tiny --stage 2 --micro-batch 1 --seq 32 "
       "--steps 3 --resume " + root + " --save-checkpoint " + root},
      kEnv, 180);
  CAPTURE(big.err);
  CHECK(big.rc == 1);
  CHECK(big.err.find("rank1.bin.tmp: File too large") != std::string::npos);
  CHECK(latest(root) == "step-00000002");
  CHECK(!fs::exists(root + "/.step-00000003.tmp"));
  // And it still resumes.
  CHECK(mpirun(2, model(2, {"--steps", "3", "--resume", root})).rc == 0);
}

TEST_CASE("damaged checkpoints and mismatched runs are refused with one line and a hint") {
  zp::test::TempDir dir;
  const std::string root = dir.file("c");
  REQUIRE(mpirun(2, model(2, {"--steps", "2", "--save-checkpoint", root, "--dpu", "--offload-optimizer",
                              "cpu", "--dpu-warmup", "1"})).rc == 0);
  const std::string shard = root + "/step-00000002/rank1.bin";
  const std::string good = zp::test::slurp(shard);
  auto expect = [&](std::vector<std::string> args, const std::string& words, int rc = 2) {
    const Result r = mpirun(2, args);
    CAPTURE(r.err);
    CHECK(r.rc == rc);
    CHECK(r.err.find(words) != std::string::npos);
    CHECK(r.err.find("hint: ") != std::string::npos);
  };
  const std::vector<std::string> dpu = {"--dpu", "--offload-optimizer", "cpu", "--steps", "3", "--resume", root};
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << good.substr(0, 1000);
  expect(model(2, dpu), "rank1.bin has 1000 bytes, its manifest says");
  std::string flipped = good;
  flipped[500] = static_cast<char>(flipped[500] ^ 1);
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << flipped;
  expect(model(2, dpu), "rank1.bin is corrupted: CRC-32");
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << good;
  CHECK(mpirun(2, model(2, dpu)).rc == 0);
  // The update in flight needs --dpu; another model names the field; another precision.
  expect(model(2, {"--offload-optimizer", "cpu", "--steps", "3", "--resume", root}),
         "a delayed parameter update is in flight in it, this run has no --dpu");
  expect({"--model", "gpt2", "--stage", "2", "--steps", "3", "--resume", root},
         "a checkpoint of another model (");
  expect(model(2, {"--precision", "fp16", "--dpu", "--offload-optimizer", "cpu", "--resume", root}),
         "saved in bf16, this run trains in fp16");
  expect(model(2, {"--seed", "7", "--dpu", "--offload-optimizer", "cpu", "--resume", root}),
         "--seed 7 differs from the checkpoint's seed 1234");
  expect(model(2, {"--resume", dir.file("nothing")}), "is not a directory");
  fs::create_directory(dir.file("empty"));
  expect(model(2, {"--resume", dir.file("empty")}), "no complete checkpoint in");
  expect(model(2, {"--checkpoint-every", "2"}), "--checkpoint-every needs --save-checkpoint DIR");
  expect({"--model", "mixtral-tiny", "--ep", "2", "--save-checkpoint", dir.file("moe")},
         "--save-checkpoint: checkpoints of expert-parallel runs (--ep 2) are not supported yet");
  std::ofstream(dir.file("afile")) << "x";
  expect(model(2, {"--save-checkpoint", dir.file("afile") + "/sub"}), "cannot create the directory");
}
