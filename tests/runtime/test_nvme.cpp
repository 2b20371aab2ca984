// ZeRO-Infinity's optimizer on NVMe in the engine (one MPI rank): the nvme and host tiers'
// bytes against the plan and against the O_DIRECT padding computed here, op by op; training
// with the states in swap files against training with them on the device (fp32: identical
// weights) and in the host tier (bf16: identical); the 16-bit parameter partition in the host
// tier (offload_param=cpu); a swap file truncated between steps; the refusals. The 2-rank
// runs are in tests/cli/test_zero_run.cpp.
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "engine_fixture.hpp"
#include "process.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/plan.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/runtime/comm.hpp"
#include "zp/runtime/device.hpp"
#include "zp/runtime/engine.hpp"

using namespace zp;
using namespace zp::runtime;
using zp::test::comm;
using zp::test::device_for;
using zp::test::tiny_plan;
using zp::test::tiny_strategy;

namespace {





std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().string());
  return out;
}

struct Run {
  std::vector<double> losses;
  std::string weights;  // fp32, flat order
};

Run train(const planner::Plan& plan, int steps, EngineOptions opt) {
  const test::TempDir out;
  auto dev = device_for(plan);
  Engine engine(plan, *dev, comm(), TokenData::load(""), opt);
  Run r;
  for (int i = 0; i < steps; ++i) r.losses.push_back(engine.step().loss);
  engine.save_weights(out.file("w.bin"));
  r.weights = test::slurp(out.file("w.bin"));
  return r;
}

uint64_t round_up_4096(uint64_t b) { return (b + 4095) / 4096 * 4096; }

}  // namespace

TEST_CASE("nvme memory: swap files and host buffers equal the plan per category and op by op") {
  const test::TempDir swap;
  for (auto prec : {planner::Precision::bf16, planner::Precision::fp32}) {
    for (int stage : {1, 2, 3}) {
      for (auto o : {planner::OptimizerKind::adam, planner::OptimizerKind::sgd}) {
        for (uint64_t chunk : {uint64_t{4096}, uint64_t{1} << 20}) {
          planner::Strategy s = tiny_strategy(stage, prec);
          s.optimizer = o;
          s.offload_optimizer = planner::Offload::nvme;
          s.grad_accum = 2;
          s.buffers.optimizer_swap_chunk_size = chunk;
          const planner::Plan plan = tiny_plan(s);
          CAPTURE(stage);
          CAPTURE(static_cast<int>(prec));
          CAPTURE(static_cast<int>(o));
          CAPTURE(chunk);
          // The plan: the fp32 gradient partition in the host tier, one swap file per state
          // of 4 * part bytes rounded up to whole 4096-byte blocks (O_DIRECT).
          const uint64_t part = plan.predicted[planner::Tier::cpu][planner::Category::grads] / 4;
          REQUIRE(part > 0);
          const uint64_t file = round_up_4096(4 * part);
          const uint64_t n_moments = o == planner::OptimizerKind::sgd ? 1 : 2;
          CHECK(plan.predicted[planner::Tier::nvme][planner::Category::master] == file);
          CHECK(plan.predicted[planner::Tier::nvme][planner::Category::optimizer] == n_moments * file);
          CHECK(plan.predicted[planner::Tier::cpu][planner::Category::master] == 0);
          CHECK(plan.predicted[planner::Tier::cpu][planner::Category::optimizer] == 0);
          // Host buffers: 3 sets of one chunk per file (+ the alignment slack), and two
          // 16-bit tiles of a chunk in mixed precision.
          const uint64_t chunk_elems = std::min(chunk, (part + 1023) / 1024 * 1024);
          uint64_t buffers = 3 * (1 + n_moments) * chunk_elems * 4 + 4096 - 256;
          if (prec != planner::Precision::fp32) buffers += 2 * ((std::min(chunk_elems, part) * 2 + 255) / 256 * 256);
          CHECK(plan.predicted[planner::Tier::cpu][planner::Category::buffers] == buffers);

          auto dev = device_for(plan);
          std::vector<planner::TimelineSample> timeline;
          {
            EngineOptions opt;
            opt.nvme_path = swap.path;
            Engine engine(plan, *dev, comm(), TokenData::load(""), opt);
            // The swap files, 0600, each holding its padded size on disk.
            const auto files = files_in(swap.path);
            CHECK(files.size() == 1 + n_moments);
            for (const std::string& f : files) {
              struct stat st {};
              REQUIRE(::stat(f.c_str(), &st) == 0);
              CHECK((st.st_mode & 0777) == 0600);
              CHECK(static_cast<uint64_t>(st.st_blocks) * 512 >= file);
            }
            for (int i = 0; i < 2; ++i) engine.step();
            timeline = engine.timeline();
          }
          CHECK(files_in(swap.path).empty());  // removed with the engine
          zp::test::check_memory_matches_plan(plan, *dev, timeline);
        }
      }
    }
  }
}

TEST_CASE("training with the optimizer on NVMe equals training without it") {
  const test::TempDir swap;
  for (auto prec : {planner::Precision::fp32, planner::Precision::bf16}) {
    for (int stage : {1, 2, 3}) {
      for (auto o : {planner::OptimizerKind::adamw, planner::OptimizerKind::sgd}) {
        planner::Strategy s = tiny_strategy(stage, prec);
        s.optimizer = o;
        CAPTURE(stage);
        CAPTURE(static_cast<int>(prec));
        CAPTURE(static_cast<int>(o));
        EngineOptions opt;
        opt.lr = o == planner::OptimizerKind::sgd ? 0.05f : 1e-3f;
        opt.weight_decay = 0.01f;
        opt.nvme_path = swap.path;
        // fp32: the device's own optimizer; bf16: ZeRO-Offload's host states (the device
        // path keeps bf16 gradients, the offloaded paths fp32 ones).
        if (prec == planner::Precision::bf16) s.offload_optimizer = planner::Offload::cpu;
        const Run ref = train(tiny_plan(s), 5, opt);
        s.offload_optimizer = planner::Offload::nvme;
        // Many chunks (4096 elements; a stage-3 group boundary falls inside chunks), and 2
        // or 3 buffer sets; one chunk for the whole partition.
        for (auto [chunk, sets] : {std::pair<uint64_t, uint64_t>{4096, 3}, {4096, 2}, {1 << 20, 3}}) {
          s.buffers.optimizer_swap_chunk_size = chunk;
          s.buffers.optimizer_swap_buffer_count = sets;
          CAPTURE(chunk);
          CAPTURE(sets);
          const Run nvme = train(tiny_plan(s), 5, opt);
          CHECK(nvme.losses == ref.losses);
          CHECK(nvme.weights.size() == ref.weights.size());
          CHECK(nvme.weights == ref.weights);
        }
        CHECK(files_in(swap.path).empty());
      }
    }
  }
}

TEST_CASE("parameters in the host tier (offload_param=cpu): same weights, bytes as planned") {
  // Stage 3 with the 16-bit partition in the host tier and each gathered shard staged into
  // the device tier: the same training as with the partition on the device (fp32: identical
  // weights), every byte where the plan puts it, op by op.
  const test::TempDir swap;
  for (auto prec : {planner::Precision::fp32, planner::Precision::bf16}) {
    for (auto oo : {planner::Offload::cpu, planner::Offload::nvme}) {
      planner::Strategy s = tiny_strategy(3, prec);
      s.offload_optimizer = oo;
      s.buffers.optimizer_swap_chunk_size = 4096;
      CAPTURE(static_cast<int>(prec));
      CAPTURE(static_cast<int>(oo));
      EngineOptions opt;
      opt.nvme_path = swap.path;
      const Run ref = train(tiny_plan(s), 5, opt);
      s.offload_param = planner::Offload::cpu;
      const planner::Plan plan = tiny_plan(s);
      const Run host = train(plan, 5, opt);
      CHECK(host.losses == ref.losses);
      CHECK(host.weights == ref.weights);
      // The plan: the 16-bit partition in the host tier, none on the device.
      const uint64_t pbytes = prec == planner::Precision::fp32 ? 4 : 2;
      const uint64_t part = plan.predicted[planner::Tier::cpu][planner::Category::grads] / 4;
      CHECK(plan.predicted[planner::Tier::cpu][planner::Category::params] == pbytes * part);
      CHECK(plan.predicted[planner::Tier::gpu][planner::Category::params] == 0);

      auto dev = device_for(plan);
      std::vector<planner::TimelineSample> timeline;
      {
        Engine engine(plan, *dev, comm(), TokenData::load(""), opt);
        for (int i = 0; i < 2; ++i) engine.step();
        timeline = engine.timeline();
      }
      zp::test::check_memory_matches_plan(plan, *dev, timeline);
    }
  }
}

TEST_CASE("a swap file truncated between steps: one clear error, files removed") {
  const test::TempDir swap;
  planner::Strategy s = tiny_strategy(2, planner::Precision::bf16);
  s.offload_optimizer = planner::Offload::nvme;
  s.buffers.optimizer_swap_chunk_size = 4096;
  const planner::Plan plan = tiny_plan(s);
  auto dev = device_for(plan);
  {
    EngineOptions opt;
    opt.nvme_path = swap.path;
    Engine engine(plan, *dev, comm(), TokenData::load(""), opt);
    engine.step();
    const std::string victim = swap.file("rank0.exp_avg_sq.swp");
    REQUIRE(std::filesystem::exists(victim));
    REQUIRE(::truncate(victim.c_str(), 4096) == 0);
    std::string what;
    bool origin = false;
    try {
      engine.step();
    } catch (const StepFailed& e) {
      what = e.what();
      origin = e.origin();
    }
    CAPTURE(what);
    CHECK(origin);
    CHECK(what.find("read " + victim) != std::string::npos);
    CHECK(what.find("short read") != std::string::npos);
    // The step's host buffers went back to the arena.
    CHECK(dev->arena(planner::Tier::cpu).in_use(planner::Category::buffers) == 0);
  }
  CHECK(files_in(swap.path).empty());
}

TEST_CASE("NVMe offload refusals") {
  planner::Strategy s = tiny_strategy(2, planner::Precision::bf16);
  s.offload_optimizer = planner::Offload::nvme;
  const planner::Plan plan = tiny_plan(s);
  auto dev = device_for(plan);
  auto error_of = [&](const planner::Plan& p, EngineOptions opt) {
    try {
      Engine engine(p, *dev, comm(), TokenData::load(""), opt);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(error_of(plan, {}) ==
        "--offload-optimizer nvme needs --nvme-path DIR (a directory on the NVMe drive)");
  EngineOptions opt;
  opt.nvme_path = "/nonexistent-zp-dir";
  CHECK(error_of(plan, opt).find("/nonexistent-zp-dir") != std::string::npos);
  planner::Strategy d = s;
  d.dpu = true;
  const test::TempDir swap;
  opt.nvme_path = swap.path;
  CHECK(error_of(tiny_plan(d), opt).find("--dpu with --offload-optimizer nvme") != std::string::npos);
  planner::Strategy p = tiny_strategy(3, planner::Precision::bf16);
  p.offload_param = planner::Offload::nvme;
  p.offload_optimizer = planner::Offload::nvme;
  CHECK(error_of(tiny_plan(p), opt).find("parameters on NVMe are planned only") != std::string::npos);
  p.offload_param = planner::Offload::cpu;
  p.offload_optimizer = planner::Offload::none;
  CHECK(error_of(tiny_plan(p), opt).find("needs the optimizer offloaded too") != std::string::npos);
  planner::Strategy c = s;
  c.buffers.optimizer_swap_chunk_size = 1000;
  CHECK_THROWS_WITH_AS(tiny_plan(c), doctest::Contains("optimizer_swap_chunk_size 1000"), Error);
}
