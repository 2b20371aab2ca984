// zero-run under mpirun, judged through its exit code and its report, as a user runs it:
// measured memory against the plan for stages 0-3 on 1, 2 and 4 ranks; the same weights
// whatever the stage and the number of ranks; refusals and faults that end every rank
// without a hang.
#include <dirent.h>
#include <sys/stat.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "process.hpp"

using zp::test::Result;

namespace {

using zp::test::read_floats;
using zp::test::rel_l2;

const std::string kRun = std::string(ZP_BIN_DIR) + "/zero-run";
const std::string kPlan = std::string(ZP_BIN_DIR) + "/zero-plan";
// Open MPI refuses root and more ranks than cores unless told.
const std::vector<std::string> kEnv = {"OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
                                       "OMPI_MCA_rmaps_base_oversubscribe=1"};

Result mpirun(int np, std::vector<std::string> args, int timeout_s = 120) {
  std::vector<std::string> argv = {ZP_MPIEXEC, "-np", std::to_string(np), kRun};
  argv.insert(argv.end(), args.begin(), args.end());
  return zp::test::run(argv, kEnv, timeout_s);
}



}  // namespace

TEST_CASE("measured peaks within 2% of the plan: stages 0-3, dp 1/2/4, checkpointing none/full") {
  zp::test::TempDir dir;
  for (const char* ck : {"none", "full"}) {
    for (int stage = 0; stage <= 3; ++stage) {
      for (int np : {1, 2, 4}) {
        const std::string report = dir.file("r.json");
        const Result r = mpirun(np, {"--model", "gpt2-tiny", "--stage", std::to_string(stage),
                                     "--checkpointing", ck, "--micro-batch", "2", "--seq", "32",
                                     "--steps", "2", "--report", report});
        CAPTURE(stage);
        CAPTURE(np);
        CAPTURE(ck);
        CAPTURE(r.err);
        REQUIRE(r.rc == 0);
        const auto j = nlohmann::json::parse(zp::test::slurp(report));
        CHECK(j["schema"] == "zero-run/report/v1");
        REQUIRE(j["ranks"].size() == static_cast<std::size_t>(np));
        // The verdict is recomputed here from the numbers, not taken from the report.
        for (const auto& rank : j["ranks"])
          for (const char* tier : {"gpu", "cpu", "nvme"}) {
            const double p = rank["predicted"][tier]["total"].get<double>();
            const double m = rank["measured"][tier]["total"].get<double>();
            if (p == 0) CHECK(m == 0);
            else CHECK(std::fabs(m - p) / p <= 0.02);
          }
        CHECK(j["verdict"]["within_tolerance"] == true);
        CHECK(j["steps"].size() == 2);
      }
    }
  }
}

TEST_CASE("stages 0-3 on 1, 2 and 4 ranks reach the same weights (fp32), and the loss falls") {
  zp::test::TempDir dir;
  // The same global batch of 4 sequences: micro-batch 4 on one rank, 2 on two, 1 on four.
  const std::string init = dir.file("init.bin");
  REQUIRE(mpirun(1, {"--model", "gpt2-tiny", "--precision", "fp32", "--micro-batch", "4",
                     "--seq", "32", "--steps", "0", "--save-weights", init}).rc == 0);
  std::vector<float> ref;
  for (int stage = 0; stage <= 3; ++stage) {
    for (int np : {1, 2, 4}) {
      const std::string w = dir.file("w.bin"), report = dir.file("r.json");
      const Result r = mpirun(np, {"--model", "gpt2-tiny", "--stage", std::to_string(stage),
                                   "--precision", "fp32", "--micro-batch", std::to_string(4 / np),
                                   "--seq", "32", "--steps", "5", "--save-weights", w, "--report",
                                   report});
      CAPTURE(stage);
      CAPTURE(np);
      CAPTURE(r.err);
      REQUIRE(r.rc == 0);
      const std::vector<float> weights = read_floats(w);
      REQUIRE(weights.size() == 120576);
      if (ref.empty()) {
        ref = weights;
        // Training moved the weights, and the loss fell over the five steps.
        CHECK(rel_l2(weights, read_floats(init)) > 1e-3);
        const auto steps = nlohmann::json::parse(zp::test::slurp(report))["steps"];
        CHECK(steps.back()["loss"].get<double>() < steps.front()["loss"].get<double>() - 0.1);
      }
      CHECK(rel_l2(weights, ref) < 1e-5);
    }
  }
}

TEST_CASE("a --device cuda plan (dropout) on the cpu backend: the same weights on 1, 2 and 4 ranks") {
  zp::test::TempDir dir;
  // gpt2-tiny with GPT-2's dropout: the cuda graph then has masks after the embedding, on the
  // attention probabilities and after both output projections of every block.
  nlohmann::json cfg = nlohmann::json::parse(zp::test::slurp(std::string(ZP_SOURCE_DIR) +
                                                             "/models/configs/gpt2-tiny.json"));
  cfg["embd_pdrop"] = cfg["attn_pdrop"] = cfg["resid_pdrop"] = 0.1;
  const std::string model = dir.file("tiny-dropout.json");
  std::ofstream(model) << cfg.dump();
  // fp32, so that ranks and stages differ only in summation order (as the test above): each
  // rank draws its rows of the global batch's mask, so 1, 2 and 4 ranks drop the same elements.
  std::vector<float> ref;
  for (int stage : {0, 3}) {
    for (int np : {1, 2, 4}) {
      const std::string plan = dir.file("plan.json"), w = dir.file("w.bin"), report = dir.file("r.json");
      REQUIRE(zp::test::run({kPlan, "plan", "--model", model, "--device", "cuda", "--precision",
                             "fp32", "--stage", std::to_string(stage), "--dp", std::to_string(np),
                             "--micro-batch", std::to_string(4 / np), "--seq", "32", "-o", plan})
                  .rc == 0);
      const Result r = mpirun(np, {plan, "--steps", "3", "--save-weights", w, "--report", report});
      CAPTURE(stage);
      CAPTURE(np);
      CAPTURE(r.err);
      REQUIRE(r.rc == 0);
      CHECK(r.out.find("cpu backend, fp32 activations, dropout") != std::string::npos);
      const auto j = nlohmann::json::parse(zp::test::slurp(report));
      CHECK(j["verdict"]["within_tolerance"] == true);
      const std::vector<float> weights = read_floats(w);
      if (ref.empty()) ref = weights;
      CHECK(rel_l2(weights, ref) < 1e-5);
    }
  }
  // The same plan in bf16: the GPU's 16-bit graph run by the cpu backend, bytes as planned.
  const std::string plan = dir.file("bf16.json"), report = dir.file("bf16-r.json");
  REQUIRE(zp::test::run({kPlan, "plan", "--model", model, "--device", "cuda", "--stage", "2",
                         "--dp", "2", "--micro-batch", "2", "--seq", "32", "-o", plan}).rc == 0);
  const Result r = mpirun(2, {plan, "--steps", "4", "--report", report});
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("cpu backend, bf16 activations, dropout") != std::string::npos);
  const auto j = nlohmann::json::parse(zp::test::slurp(report));
  for (const auto& rank : j["ranks"])
    CHECK(rank["measured"]["gpu"]["breakdown"] == rank["predicted"]["gpu"]["breakdown"]);
  CHECK(j["steps"].back()["loss"].get<double>() < j["steps"].front()["loss"].get<double>());
}

TEST_CASE("ZeRO-Offload on 1 and 2 ranks: the weights of device training, memory within 2%") {
  zp::test::TempDir dir;
  for (int stage = 1; stage <= 3; ++stage) {
    for (int np : {1, 2}) {
      CAPTURE(stage);
      CAPTURE(np);
      std::vector<std::string> args = {"--model", "gpt2-tiny", "--stage", std::to_string(stage),
                                       "--precision", "fp32", "--micro-batch", "2", "--seq", "32",
                                       "--steps", "5", "--save-weights"};
      const std::string on_device = dir.file("dev.bin"), offloaded = dir.file("off.bin");
      std::vector<std::string> a = args, b = args;
      a.push_back(on_device);
      b.push_back(offloaded);
      b.insert(b.end(), {"--offload-optimizer", "cpu"});
      const Result ra = mpirun(np, a), rb = mpirun(np, b);
      CAPTURE(rb.err);
      REQUIRE(ra.rc == 0);
      REQUIRE(rb.rc == 0);  // exit 0: every measured peak within 2% of the plan
      CHECK(zp::test::slurp(on_device) == zp::test::slurp(offloaded));
    }
  }
  // The delayed update on two ranks, bf16, with the host tier checked against the plan.
  const std::string report = dir.file("dpu.json");
  const Result r = mpirun(2, {"--model", "gpt2-tiny", "--stage", "2", "--offload-optimizer", "cpu",
                              "--dpu", "--dpu-warmup", "1", "--steps", "4", "--report", report});
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  const auto ranks = nlohmann::json::parse(zp::test::slurp(report))["ranks"];  // a copy: the
  CHECK(ranks.size() == 2);  // temporary's member would dangle in the range-for (C++20)
  for (const auto& rank : ranks) {
    const double p = rank["predicted"]["cpu"]["total"].get<double>();
    CHECK(p > 0);
    CHECK(std::fabs(rank["measured"]["cpu"]["total"].get<double>() - p) <= 0.02 * p);
  }
}

TEST_CASE("--overlap-comm: the weights of --no-overlap-comm bit for bit, stages 2-3 on 1 and 2 ranks") {
  zp::test::TempDir dir;
  for (int stage : {2, 3}) {
    for (int np : {1, 2}) {
      CAPTURE(stage);
      CAPTURE(np);
      // Small buckets and prefetch, so several buckets and gathers are in flight per step.
      const std::vector<std::string> args = {
          "--model", "gpt2-tiny", "--stage", std::to_string(stage), "--micro-batch", "2",
          "--seq", "32", "--grad-accum", "2", "--steps", "3", "--reduce-bucket-size", "20000",
          "--prefetch-bucket-size", "60000"};
      nlohmann::json reports[2];
      std::string weights[2];
      for (int on : {0, 1}) {
        std::vector<std::string> a = args;
        const std::string w = dir.file("w.bin"), report = dir.file("r.json");
        a.insert(a.end(), {on ? "--overlap-comm" : "--no-overlap-comm", "--save-weights", w,
                           "--report", report});
        const Result r = mpirun(np, a);
        CAPTURE(r.err);
        REQUIRE(r.rc == 0);
        weights[on] = zp::test::slurp(w);
        reports[on] = nlohmann::json::parse(zp::test::slurp(report));
        // Every category of every tier exactly as predicted, on every rank.
        for (const auto& rank : reports[on]["ranks"])
          for (const char* tier : {"gpu", "cpu", "nvme"})
            CHECK(rank["measured"][tier]["breakdown"] == rank["predicted"][tier]["breakdown"]);
      }
      CHECK(weights[0].size() == 4 * 120576);
      CHECK(weights[0] == weights[1]);
      // The flag reached the plan: the strategy says so, and at stage 2 on two ranks the
      // buckets in flight raise the predicted buffers' peak; on one rank nothing is reduced
      // and no bucket is held longer (at stage 3 the peak is where the prefetched groups are,
      // before backward; test_overlap checks the bucket lifetimes there op by op).
      CHECK(reports[0]["strategy"]["overlap_comm"] == false);
      CHECK(reports[1]["strategy"]["overlap_comm"] == true);
      const auto buffers = [&](int on) {
        return reports[on]["ranks"][0]["predicted"]["gpu"]["breakdown"]["buffers"].get<uint64_t>();
      };
      if (stage == 2 && np == 2) CHECK(buffers(1) > buffers(0));
      if (np == 1) CHECK(buffers(1) == buffers(0));
    }
  }
  const std::string ds = dir.write("ds.json", R"({"zero_optimization": {"stage": 2, "overlap_comm": "yes"}})");
  const Result bad = mpirun(1, {"--model", "gpt2-tiny", "--ds-config", ds, "--steps", "1"});
  CHECK(bad.rc == 2);
  CHECK(bad.err.find("'zero_optimization.overlap_comm' must be true or false") != std::string::npos);
}

TEST_CASE("a plan file runs on the ranks it was made for") {
  zp::test::TempDir dir;
  const std::string plan = dir.file("plan.json");
  REQUIRE(zp::test::run({kPlan, "plan", "--model", "gpt2-tiny", "--stage", "3", "--dp", "2",
                         "--seq", "32", "-o", plan}).rc == 0);
  const Result ok = mpirun(2, {plan, "--steps", "2"});
  CAPTURE(ok.err);
  CHECK(ok.rc == 0);
  CHECK(ok.out.find("ok: every peak within") != std::string::npos);

  auto bad = [](const Result& r, const std::string& needle) {
    CAPTURE(r.err);
    CHECK(r.rc == 2);
    CHECK(r.err.find("error: ") != std::string::npos);
    CHECK(r.err.find(needle) != std::string::npos);
    CHECK(r.err.find("hint: ") != std::string::npos);
  };
  bad(mpirun(1, {plan}), "the plan is for --dp 2, but 1 rank is running");
  bad(mpirun(2, {plan, "--model", "gpt2"}), "is a plan for gpt2-tiny, not for --model gpt2");
  bad(mpirun(2, {plan, "--stage", "1"}), "strategy flags given with a plan file");
  bad(mpirun(2, {plan, "--device-memory", "1MiB"}), "the plan needs");
  bad(mpirun(1, {"--model", "gpt2-tiny", "--data", dir.file("missing.txt")}), "missing.txt");
  // Flash attention runs (cpu backend) and is measured equal to its plan.
  const Result flash = mpirun(1, {"--model", "gpt2-tiny", "--flash-attention", "--steps", "1"});
  CHECK(flash.rc == 0);
  CHECK(flash.out.find("flash-attention") != std::string::npos);
  CHECK(flash.out.find("ok: every peak within") != std::string::npos);
  bad(mpirun(1, {"--model", "gpt2-tiny", "--device", "tpu"}), "--device");
  // Expert parallelism runs (test_launcher) when --ep divides the data-parallel degree.
  bad(mpirun(2, {"--model", "mixtral-tiny", "--ep", "4", "--steps", "1"}), "--ep");
  // A family the engine does not execute is named before the memory it would need (9.8 TiB).
  bad(mpirun(1, {"--model", "deepseek-v3", "--steps", "1"}), "deepseek-v3 is deepseek_v3: ");
  bad(mpirun(1, {"--model", "gpt2-tiny", "--steps", "-3"}), "--steps");
  // Plans that predict another framework's allocations or Hugging Face's modeling code.
  for (const auto& [flags, needle] :
       {std::pair<std::vector<std::string>, std::string>{{"--profile", "fsdp", "--stage", "3", "--attention", "eager"},
                                                         "the plan predicts PyTorch FSDP"},
        {{"--model-code", "transformers", "--attention", "eager"}, "--model-code transformers"}}) {
    const std::string other = dir.file("other.json");
    std::vector<std::string> args = {kPlan, "plan", "--model", "gpt2-tiny", "--seq", "32", "-o", other};
    args.insert(args.end(), flags.begin(), flags.end());
    REQUIRE(zp::test::run(args).rc == 0);
    bad(mpirun(1, {other}), needle);
  }
}

TEST_CASE("faults end every rank with an error, never a hang") {
  zp::test::TempDir dir;
  // A plan that claims less than the run needs, and an arena of exactly that size: it passes
  // the up-front check, then runs out mid-step on every rank.
  const std::string plan = dir.file("plan.json");
  REQUIRE(zp::test::run({kPlan, "plan", "--model", "gpt2-tiny", "--stage", "2", "--dp", "2",
                         "--seq", "32", "-o", plan}).rc == 0);
  auto j = nlohmann::json::parse(zp::test::slurp(plan));
  const uint64_t claimed = j["prediction"]["per_device"]["gpu"]["total"].get<uint64_t>() / 2;
  j["prediction"]["per_device"]["gpu"]["total"] = claimed;
  std::ofstream(dir.file("small.json")) << j.dump();
  const Result oom = mpirun(2, {dir.file("small.json"), "--device-memory", std::to_string(claimed)}, 60);
  CAPTURE(oom.err);
  CHECK(oom.rc != 0);
  CHECK(oom.rc != -1);  // not hung
  CHECK(oom.err.find("out of gpu memory allocating") != std::string::npos);
  CHECK(oom.err.find("short by") != std::string::npos);

  // A bad input, the same on every rank, is said once (rank 0 speaks for all of them).
  const Result bad = mpirun(4, {"--model", "gpt2-tiny", "--stage", "1", "--nvme-path", dir.path}, 60);
  CAPTURE(bad.err);
  CHECK(bad.rc != 0);
  CHECK(bad.rc != -1);
  const auto count = [&](const std::string& needle) {
    std::size_t n = 0;
    for (std::size_t at = bad.err.find(needle); at != std::string::npos; at = bad.err.find(needle, at + 1)) ++n;
    return n;
  };
  CHECK(count("error: --nvme-path: the plan offloads nothing to NVMe") == 1);
  CHECK(count("hint: ") == 1);

  // A rank killed mid-run: mpirun ends the others and fails.
  const std::string out = dir.file("out"), err = dir.file("err");
  const pid_t pid = zp::test::spawn({ZP_MPIEXEC, "-np", "2", kRun, "--model", "gpt2-tiny",
                                     "--seq", "32", "--steps", "100000000"},
                                    out, err, kEnv);
  // Wait until a rank is training, then kill it.
  pid_t victim = -1;
  for (int i = 0; i < 200 && victim < 0; ++i) {
    ::usleep(50'000);
    if (zp::test::slurp(out).find("step 3/") == std::string::npos) continue;
    DIR* d = ::opendir("/proc");
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      const std::string cmd = zp::test::slurp("/proc/" + name + "/cmdline");
      const std::string stat = zp::test::slurp("/proc/" + name + "/stat");
      // A zero-run whose parent is our mpirun.
      const auto close = stat.rfind(')');
      if (cmd.rfind(kRun, 0) == 0 && close != std::string::npos &&
          std::stoi(stat.substr(close + 4, stat.find(' ', close + 4) - close - 4)) == pid)
        victim = std::stoi(name);
    }
    ::closedir(d);
  }
  REQUIRE(victim > 0);
  ::kill(victim, SIGKILL);
  const int rc = zp::test::wait_for(pid, 60);
  CHECK(rc != 0);
  CHECK(rc != -1);  // not hung
}

TEST_CASE("the optimizer on NVMe (and parameters on the host or NVMe): the same weights on 2 ranks, bytes as planned, faults") {
  zp::test::TempDir dir;
  const std::string swap = dir.file("swap");
  REQUIRE(::mkdir(swap.c_str(), 0700) == 0);
  auto swap_files = [&] {
    int n = 0;
    DIR* d = ::opendir(swap.c_str());
    while (const dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
    return n;
  };
  // One rank is in tests/runtime/test_nvme.cpp (stages 1-3, bf16 and fp32, adamw and sgd).
  for (int stage : {2, 3}) {
    for (int np : {2}) {
      CAPTURE(stage);
      CAPTURE(np);
      std::vector<std::string> args = {"--model", "gpt2-tiny", "--stage", std::to_string(stage),
                                       "--precision", "fp32", "--micro-batch", "2", "--seq", "32",
                                       "--steps", "5", "--save-weights"};
      const std::string on_device = dir.file("dev.bin"), swapped = dir.file("nvme.bin");
      const std::string report = dir.file("nvme.json");
      std::vector<std::string> a = args, b = args;
      a.push_back(on_device);
      b.push_back(swapped);
      // Many chunks of 4096 elements through 3 buffer sets.
      b.insert(b.end(), {"--offload-optimizer", "nvme", "--nvme-path", swap, "--optimizer-swap-chunk-size",
                         "4096", "--report", report});
      const Result ra = mpirun(np, a), rb = mpirun(np, b);
      CAPTURE(rb.err);
      REQUIRE(ra.rc == 0);
      REQUIRE(rb.rc == 0);
      CHECK(zp::test::slurp(on_device) == zp::test::slurp(swapped));
      CHECK(swap_files() == 0);  // removed at the end of the run
      // Measured nvme (swap files) and host bytes are the plan's, exactly.
      const auto ranks = nlohmann::json::parse(zp::test::slurp(report))["ranks"];
      CHECK(ranks.size() == static_cast<std::size_t>(np));
      for (const auto& rank : ranks) {
        for (const char* tier : {"cpu", "nvme"}) {
          CHECK(rank["predicted"][tier]["total"].get<uint64_t>() > 0);
          CHECK(rank["measured"][tier] == rank["predicted"][tier]);
        }
      }
    }
  }

  {  // Stage 3 with the parameter partition in the host tier too: same weights (the loop's
     // last run, stage 3 on 2 ranks, left the device's in dev.bin), bytes as planned.
    const std::string report = dir.file("param.json");
    const Result r = mpirun(2, {"--model", "gpt2-tiny", "--stage", "3", "--precision", "fp32",
                                "--micro-batch", "2", "--seq", "32", "--steps", "5",
                                "--offload-param", "cpu", "--offload-optimizer", "nvme",
                                "--nvme-path", swap, "--report", report, "--save-weights",
                                dir.file("param.bin")});
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    CHECK(zp::test::slurp(dir.file("param.bin")) == zp::test::slurp(dir.file("dev.bin")));
    const auto ranks = nlohmann::json::parse(zp::test::slurp(report))["ranks"];  // a copy: a
    CHECK(ranks.size() == 2);  // range-for over a temporary's member would dangle (C++20)
    for (const auto& rank : ranks)
      for (const char* tier : {"gpu", "cpu", "nvme"}) CHECK(rank["measured"][tier] == rank["predicted"][tier]);
  }

  // The parameter partition on NVMe (offload_param=nvme), the optimizer on NVMe or on the
  // host: the same weights as with everything on the device (dev.bin, the loop's stage-3
  // run), every tier's bytes as planned; shards larger than a buffer (3000 elements), 3
  // buffers. Then the same from a DeepSpeed config's offload_param section.
  for (const char* oo : {"nvme", "cpu"}) {
    CAPTURE(oo);
    const std::string report = dir.file("pnvme.json"), weights = dir.file("pnvme.bin");
    const Result r = mpirun(2, {"--model", "gpt2-tiny", "--stage", "3", "--precision", "fp32",
                                "--micro-batch", "2", "--seq", "32", "--steps", "5",
                                "--offload-param", "nvme", "--offload-optimizer", oo,
                                "--nvme-path", swap, "--param-swap-buffer-size", "3000",
                                "--param-swap-buffer-count", "3", "--optimizer-swap-chunk-size",
                                "4096", "--report", report, "--save-weights", weights});
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("offload params=nvme") != std::string::npos);
    CHECK(zp::test::slurp(weights) == zp::test::slurp(dir.file("dev.bin")));
    CHECK(swap_files() == 0);
    const auto ranks = nlohmann::json::parse(zp::test::slurp(report))["ranks"];
    CHECK(ranks.size() == 2);
    for (const auto& rank : ranks) {
      CHECK(rank["predicted"]["nvme"]["breakdown"]["params"].get<uint64_t>() > 0);
      CHECK(rank["predicted"]["gpu"]["breakdown"]["params"].get<uint64_t>() == 0);
      for (const char* tier : {"gpu", "cpu", "nvme"}) CHECK(rank["measured"][tier] == rank["predicted"][tier]);
    }
  }
  {
    const std::string pds = dir.write("pds.json", R"({"zero_optimization": {"stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"(", "buffer_count": 2,
                          "buffer_size": 4096, "max_in_cpu": 1e9}}})");
    const Result r = mpirun(2, {"--model", "gpt2-tiny", "--ds-config", pds, "--seq", "32", "--steps", "2"});
    CAPTURE(r.err);
    CHECK(r.rc == 0);
    CHECK(r.out.find("offload params=nvme") != std::string::npos);
    CHECK(swap_files() == 0);
  }

  auto bad = [](const Result& r, const std::string& needle) {
    CAPTURE(r.err);
    CHECK(r.rc == 2);
    CHECK(r.err.find("error: " + needle) != std::string::npos);
    CHECK(r.err.find("hint: ") != std::string::npos);
  };
  bad(mpirun(2, {"--model", "gpt2-tiny", "--stage", "2", "--offload-optimizer", "nvme"}),
      "--offload-optimizer nvme needs --nvme-path DIR (a directory on the NVMe drive)");
  // The delayed update with the optimizer on NVMe, on 2 ranks: the weights of the delayed
  // update on host states, bytes as planned.
  {
    std::vector<std::string> args = {"--model", "gpt2-tiny", "--stage", "2", "--precision", "fp32",
                                     "--micro-batch", "2", "--seq", "32", "--steps", "5", "--dpu",
                                     "--dpu-warmup", "2", "--optimizer-swap-chunk-size", "4096"};
    std::vector<std::string> a = args, b = args;
    a.insert(a.end(), {"--offload-optimizer", "cpu", "--save-weights", dir.file("dpu_cpu.bin")});
    b.insert(b.end(), {"--offload-optimizer", "nvme", "--nvme-path", swap, "--save-weights",
                       dir.file("dpu_nvme.bin"), "--report", dir.file("dpu.json")});
    const Result ra = mpirun(2, a), rb = mpirun(2, b);
    CAPTURE(rb.err);
    REQUIRE(ra.rc == 0);
    REQUIRE(rb.rc == 0);
    CHECK(zp::test::slurp(dir.file("dpu_cpu.bin")) == zp::test::slurp(dir.file("dpu_nvme.bin")));
    const auto ranks = nlohmann::json::parse(zp::test::slurp(dir.file("dpu.json")))["ranks"];
    CHECK(ranks.size() == 2);
    for (const auto& rank : ranks)
      for (const char* tier : {"gpu", "cpu", "nvme"}) CHECK(rank["measured"][tier] == rank["predicted"][tier]);
    CHECK(swap_files() == 0);
  }
  // Parameters on NVMe: no directory, below stage 3, nonsense buffer settings.
  bad(mpirun(2, {"--model", "gpt2-tiny", "--stage", "3", "--offload-optimizer", "cpu",
                 "--offload-param", "nvme"}),
      "--offload-param nvme needs --nvme-path DIR (a directory on the NVMe drive)");
  bad(mpirun(1, {"--model", "gpt2-tiny", "--stage", "2", "--offload-optimizer", "cpu",
                 "--offload-param", "nvme", "--nvme-path", swap}),
      "--offload-param nvme: needs --stage 3, got stage 2");
  bad(mpirun(1, {"--model", "gpt2-tiny", "--stage", "3", "--offload-optimizer", "cpu",
                 "--offload-param", "nvme", "--nvme-path", swap, "--param-swap-buffer-count", "0"}),
      "--param-swap-buffer-count: must be >= 1");
  bad(mpirun(1, {"--model", "gpt2-tiny", "--stage", "3", "--offload-optimizer", "cpu",
                 "--offload-param", "nvme", "--nvme-path", swap, "--param-swap-buffer-count", "100"}),
      "param_swap_buffer_count 100: must be 1 to 64");
  bad(mpirun(1, {"--model", "gpt2-tiny", "--stage", "3", "--offload-optimizer", "cpu",
                 "--offload-param", "nvme", "--nvme-path", swap, "--param-swap-buffer-size", "lots"}),
      "--param-swap-buffer-size: 'lots' is not a number");
  bad(mpirun(1, {"--model", "gpt2-tiny", "--stage", "3", "--offload-optimizer", "cpu",
                 "--offload-param", "nvme", "--nvme-path", swap, "--param-swap-prefetch-depth", "99"}),
      "param_swap_prefetch_depth 99: must be 0 to 64");
  CHECK(swap_files() == 0);
  // nvme_path from a DeepSpeed config.
  const std::string ds = dir.write("ds.json", R"({"zero_optimization": {"stage": 2,
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("}}})");
  const Result viads = mpirun(1, {"--model", "gpt2-tiny", "--ds-config", ds, "--seq", "32", "--steps", "1"});
  CAPTURE(viads.err);
  CHECK(viads.rc == 0);
  CHECK(viads.out.find("offload optimizer=nvme") != std::string::npos);

  // A full drive, as a file-size limit of 64 MiB on both ranks (smaller ones starve Open
  // MPI's own shared-memory files): GPT-2's 249 MB swap files cannot be reserved; every rank
  // exits 2, rank 0 names its file and the operation, none hangs, no file stays.
  const std::string cmd = "ulimit -f 65536; exec " + std::string(ZP_MPIEXEC) + " -np 2 " + kRun +
                          " --model gpt2 --stage 2 --seq 32 --steps 1 --offload-optimizer nvme"
                          " --nvme-path " + swap;
  const Result full = zp::test::run({"/bin/sh", "-c", cmd}, kEnv, 120);
  CAPTURE(full.err);
  CHECK(full.rc == 2);
  CHECK(full.err.find("error: fallocate " + swap + "/rank0.master.swp (248881152 bytes): File too large") !=
        std::string::npos);
  CHECK(full.err.find("hint: ") != std::string::npos);
  CHECK(swap_files() == 0);

  // One rank only cannot create its file (another owns the name): that rank says so, every
  // rank exits 2, rank 0 removes its files, the other owner's file is left alone.
  const std::string foreign = swap + "/rank1.master.swp";
  std::ofstream(foreign) << "not ours";
  const Result taken = mpirun(2, {"--model", "gpt2-tiny", "--stage", "2", "--seq", "32",
                                  "--offload-optimizer", "nvme", "--nvme-path", swap}, 60);
  CAPTURE(taken.err);
  CHECK(taken.rc == 2);
  CHECK(taken.err.find("error: rank 1: open " + foreign) != std::string::npos);
  CHECK(swap_files() == 1);
  CHECK(zp::test::slurp(foreign) == "not ours");
  std::remove(foreign.c_str());

  // A swap file truncated underneath rank 1 while both train: its next read comes up short;
  // rank 1 names the file and the operation, both ranks exit 1 (no abort, no hang), and
  // both remove their files.
  const std::string out = dir.file("out"), err = dir.file("err");
  const pid_t pid = zp::test::spawn({ZP_MPIEXEC, "-np", "2", kRun, "--model", "gpt2-tiny", "--stage", "2",
                                     "--seq", "32", "--steps", "100000000", "--offload-optimizer",
                                     "nvme", "--nvme-path", swap},
                                    out, err, kEnv);
  for (int i = 0; i < 400 && zp::test::slurp(out).find("step 2/") == std::string::npos; ++i)
    ::usleep(50'000);
  const std::string victim = swap + "/rank1.exp_avg_sq.swp";
  REQUIRE(::truncate(victim.c_str(), 4096) == 0);
  // Again a few times: a truncation between a chunk's read and its write-back is undone by
  // the write; the next one lands before a read.
  for (int i = 0; i < 20; ++i) {
    ::usleep(50'000);
    if (::truncate(victim.c_str(), 4096) != 0) break;  // ENOENT: the ranks have ended
  }
  const int rc = zp::test::wait_for(pid, 60);
  const std::string errors = zp::test::slurp(err);
  CAPTURE(errors);
  CHECK(rc == 1);
  CHECK(errors.find("error: rank 1: read " + victim) != std::string::npos);
  CHECK(errors.find("short read") != std::string::npos);
  CHECK(errors.find("error: rank 0") == std::string::npos);  // one voice
  CHECK(swap_files() == 0);

  // The same with the parameter swap file: rank 1's shard reads come up short in a forward
  // or backward; its gathers go on with zeros so no collective is left waiting, the step
  // fails on both ranks before any update, rank 1 names the file and the operation.
  const std::string pout = dir.file("pout"), perr = dir.file("perr");
  const pid_t ppid = zp::test::spawn({ZP_MPIEXEC, "-np", "2", kRun, "--model", "gpt2-tiny", "--stage", "3",
                                      "--seq", "32", "--steps", "100000000", "--offload-optimizer",
                                      "cpu", "--offload-param", "nvme", "--nvme-path", swap},
                                     pout, perr, kEnv);
  for (int i = 0; i < 400 && zp::test::slurp(pout).find("step 2/") == std::string::npos; ++i)
    ::usleep(50'000);
  const std::string pvictim = swap + "/rank1.params.swp";
  REQUIRE(::truncate(pvictim.c_str(), 4096) == 0);
  for (int i = 0; i < 20; ++i) {  // again: the write-back after each step extends the file
    ::usleep(50'000);
    if (::truncate(pvictim.c_str(), 4096) != 0) break;
  }
  const int prc = zp::test::wait_for(ppid, 60);
  const std::string perrors = zp::test::slurp(perr);
  CAPTURE(perrors);
  CHECK(prc == 1);
  CHECK(perrors.find("error: rank 1: read " + pvictim) != std::string::npos);
  CHECK(perrors.find("short read") != std::string::npos);
  CHECK(perrors.find("error: rank 0") == std::string::npos);
  CHECK(swap_files() == 0);
}
