// ZeRO-Infinity's optimizer on NVMe in the engine (one MPI rank): the nvme and host tiers'
// bytes against the plan and against the O_DIRECT padding computed here, op by op; training
// with the states in swap files against training with them on the device (fp32: identical
// weights) and in the host tier (bf16: identical); the 16-bit parameter partition in the host
// tier (offload_param=cpu) and in its own swap file (offload_param=nvme); a swap file
// truncated between steps; the refusals. The 2-rank runs are in tests/cli/test_zero_run.cpp.
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

// Truncates `victim` (a swap file) to one block, then steps the engine up to `max_steps` times
// until a step fails: the failure must be this rank's own, naming the file, the read and why.
void expect_short_read(Engine& engine, const std::string& victim, int max_steps) {
  REQUIRE(std::filesystem::exists(victim));
  REQUIRE(::truncate(victim.c_str(), 4096) == 0);
  std::string what;
  bool origin = false;
  try {
    for (int i = 0; i < max_steps; ++i) engine.step();
  } catch (const StepFailed& e) {
    what = e.what();
    origin = e.origin();
  }
  CAPTURE(what);
  CHECK(origin);
  CHECK(what.find("read " + victim) != std::string::npos);
  CHECK(what.find("short read") != std::string::npos);
}

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

TEST_CASE("parameters on NVMe (offload_param=nvme): same weights, bytes as planned") {
  // Stage 3 with the 16-bit partition in rank0.params.swp, read shard by shard through the
  // host buffers and staged to the device: the same training as with the partition in the
  // host tier (offload_param=cpu) and on the device (offload_param=none), bit for bit, in
  // fp32 and bf16, with the optimizer on the host or on NVMe; buffers smaller than a shard
  // (pieces), one buffer, no read-ahead, a buffer larger than the partition; grad-accum 2 and
  // the delayed update. Every byte where the plan puts it, op by op.
  const test::TempDir swap;
  struct Case {
    uint64_t size, count, depth;
  };
  const std::vector<Case> cases = {{4096, 5, 2}, {3000, 2, 0}, {1000, 1, 3}, {100'000'000, 5, 2}};
  for (auto prec : {planner::Precision::fp32, planner::Precision::bf16}) {
    for (auto oo : {planner::Offload::cpu, planner::Offload::nvme}) {
      for (bool dpu : {false, true}) {
        planner::Strategy s = tiny_strategy(3, prec);
        s.offload_optimizer = oo;
        s.dpu = dpu;
        s.grad_accum = dpu ? 1 : 2;
        s.buffers.optimizer_swap_chunk_size = 4096;
        CAPTURE(static_cast<int>(prec));
        CAPTURE(static_cast<int>(oo));
        CAPTURE(dpu);
        EngineOptions opt;
        opt.nvme_path = swap.path;
        opt.dpu_warmup_steps = 2;
        const Run on_device = train(tiny_plan(s), 5, opt);
        s.offload_param = planner::Offload::cpu;
        const Run host = train(tiny_plan(s), 5, opt);
        CHECK(host.weights == on_device.weights);
        s.offload_param = planner::Offload::nvme;
        for (const Case& c : cases) {
          s.buffers.param_swap_buffer_size = c.size;
          s.buffers.param_swap_buffer_count = c.count;
          s.buffers.param_swap_prefetch_depth = c.depth;
          CAPTURE(c.size);
          CAPTURE(c.count);
          CAPTURE(c.depth);
          const planner::Plan plan = tiny_plan(s);
          const Run nvme = train(plan, 5, opt);
          CHECK(nvme.losses == host.losses);
          CHECK(nvme.weights.size() == on_device.weights.size());
          CHECK(nvme.weights == host.weights);
          CHECK(nvme.weights == on_device.weights);

          // The plan, computed here: the partition's file on the nvme tier, nothing of it on
          // the device or the host (but the delayed update's host copy of the new parameters,
          // kept in fp32 training too with the optimizer on NVMe); the host buffers: count x
          // (the buffer's elements in whole 4096-byte blocks + one block for a piece's
          // offset) + the alignment slack, plus the optimizer step's two 16-bit tiles (bf16,
          // host optimizer, no delayed update).
          const uint64_t pbytes = prec == planner::Precision::fp32 ? 4 : 2;
          // (The host tier's fp32 gradient partition: two with the delayed update.)
          const uint64_t part =
              plan.predicted[planner::Tier::cpu][planner::Category::grads] / (dpu ? 8 : 4);
          REQUIRE(part > 0);
          CHECK(plan.predicted[planner::Tier::nvme][planner::Category::params] ==
                round_up_4096(pbytes * part));
          CHECK(plan.predicted[planner::Tier::gpu][planner::Category::params] == 0);
          CHECK(plan.predicted[planner::Tier::cpu][planner::Category::params] ==
                (dpu && (pbytes == 2 || oo == planner::Offload::nvme) ? pbytes * part : 0));
          const uint64_t block_elems = 4096 / pbytes;
          const uint64_t elems =
              std::min(c.size, (part + block_elems - 1) / block_elems * block_elems);
          uint64_t buffers = c.count * (round_up_4096(elems * pbytes) + 4096) + 4096 - 256;
          if (oo == planner::Offload::cpu && !dpu && pbytes == 2)  // the optimizer's tiles
            buffers += 2 * ((part * 2 + 255) / 256 * 256);
          if (oo == planner::Offload::cpu)
            CHECK(plan.predicted[planner::Tier::cpu][planner::Category::buffers] == buffers);

          auto dev = device_for(plan);
          std::vector<planner::TimelineSample> timeline;
          {
            Engine engine(plan, *dev, comm(), TokenData::load(""), opt);
            const std::string file = swap.file("rank0.params.swp");
            struct stat st {};
            REQUIRE(::stat(file.c_str(), &st) == 0);
            CHECK((st.st_mode & 0777) == 0600);
            CHECK(static_cast<uint64_t>(st.st_size) >= pbytes * part);
            for (int i = 0; i < 2; ++i) engine.step();
            timeline = engine.timeline();
          }
          CHECK(files_in(swap.path).empty());
          zp::test::check_memory_matches_plan(plan, *dev, timeline);
        }
      }
    }
  }
}

TEST_CASE("the delayed update with the optimizer on NVMe equals it with the optimizer on the host") {
  // --dpu with offload_optimizer=nvme: the CPU step and its swap pipeline run on the update's
  // thread (and inline, the reference schedule) through swap buffers held for the run; the
  // same weights as the delayed update on host states, bit for bit, in fp32 and bf16, stages
  // 2 and 3 (3 also with the parameters on NVMe); every byte as planned, op by op.
  const test::TempDir swap;
  for (auto prec : {planner::Precision::fp32, planner::Precision::bf16}) {
    for (int stage : {2, 3}) {
      for (auto op : {planner::Offload::none, planner::Offload::nvme}) {
        if (op == planner::Offload::nvme && stage != 3) continue;
        planner::Strategy s = tiny_strategy(stage, prec);
        s.offload_optimizer = planner::Offload::cpu;
        s.offload_param = op;
        s.dpu = true;
        s.buffers.optimizer_swap_chunk_size = 4096;
        s.buffers.param_swap_buffer_size = 4096;
        CAPTURE(static_cast<int>(prec));
        CAPTURE(stage);
        CAPTURE(static_cast<int>(op));
        EngineOptions opt;
        opt.nvme_path = swap.path;
        opt.dpu_warmup_steps = 2;
        const Run host = train(tiny_plan(s), 6, opt);
        s.offload_optimizer = planner::Offload::nvme;
        const planner::Plan plan = tiny_plan(s);
        for (bool threaded : {true, false}) {
          CAPTURE(threaded);
          opt.dpu_threaded = threaded;
          const Run nvme = train(plan, 6, opt);
          CHECK(nvme.losses == host.losses);
          CHECK(nvme.weights.size() == host.weights.size());
          CHECK(nvme.weights == host.weights);
        }
        CHECK(files_in(swap.path).empty());
        // The plan, computed here: two fp32 gradient partitions, the host parameter copy (in
        // fp32 training too), the swap buffers for the run (3 sets of a chunk per file + the
        // alignment slack; no tiles), and with the parameters on NVMe their buffers.
        const uint64_t pbytes = prec == planner::Precision::fp32 ? 4 : 2;
        const uint64_t part = plan.predicted[planner::Tier::cpu][planner::Category::grads] / 8;
        REQUIRE(part > 0);
        CHECK(plan.predicted[planner::Tier::cpu][planner::Category::params] == pbytes * part);
        const uint64_t chunk = std::min<uint64_t>(4096, (part + 1023) / 1024 * 1024);
        uint64_t buffers = 3 * 3 * chunk * 4 + 4096 - 256;
        if (op == planner::Offload::nvme) {
          const uint64_t e = std::min<uint64_t>(4096, (part + 4096 / pbytes - 1) / (4096 / pbytes) * (4096 / pbytes));
          buffers += 5 * (round_up_4096(e * pbytes) + 4096) + 4096 - 256;
        }
        CHECK(plan.predicted[planner::Tier::cpu][planner::Category::buffers] == buffers);
        auto dev = device_for(plan);
        std::vector<planner::TimelineSample> timeline;
        {
          opt.dpu_threaded = true;
          Engine engine(plan, *dev, comm(), TokenData::load(""), opt);
          for (int i = 0; i < 4; ++i) engine.step();
          engine.flush();
          timeline = engine.timeline();
        }
        zp::test::check_memory_matches_plan(plan, *dev, timeline);
      }
    }
  }
}

TEST_CASE("the delayed update's swap file truncated: the step fails on the main thread, files removed") {
  const test::TempDir swap;
  planner::Strategy s = tiny_strategy(2, planner::Precision::bf16);
  s.offload_optimizer = planner::Offload::nvme;
  s.dpu = true;
  s.buffers.optimizer_swap_chunk_size = 4096;
  const planner::Plan plan = tiny_plan(s);
  auto dev = device_for(plan);
  {
    EngineOptions opt;
    opt.nvme_path = swap.path;
    opt.dpu_warmup_steps = 1;
    Engine engine(plan, *dev, comm(), TokenData::load(""), opt);
    engine.step();  // plain
    engine.flush();
    // The next step launches the delayed step, which fails on its thread; the one after
    // applies it, and the failure surfaces there.
    expect_short_read(engine, swap.file("rank0.exp_avg.swp"), 2);
  }
  CHECK(files_in(swap.path).empty());
}

TEST_CASE("the parameter swap file truncated between steps: one clear error, files removed") {
  const test::TempDir swap;
  planner::Strategy s = tiny_strategy(3, planner::Precision::bf16);
  s.offload_optimizer = planner::Offload::cpu;
  s.offload_param = planner::Offload::nvme;
  s.buffers.param_swap_buffer_size = 4096;
  const planner::Plan plan = tiny_plan(s);
  auto dev = device_for(plan);
  {
    EngineOptions opt;
    opt.nvme_path = swap.path;
    Engine engine(plan, *dev, comm(), TokenData::load(""), opt);
    engine.step();
    expect_short_read(engine, swap.file("rank0.params.swp"), 1);
    // The step's device buffers (gathers, staging) went back; the host tier holds the
    // states and the parameter swap buffers only, as before the step.
    CHECK(dev->arena(planner::Tier::gpu).in_use(planner::Category::buffers) == 0);
    CHECK(dev->arena(planner::Tier::cpu).in_use(planner::Category::buffers) ==
          plan.predicted[planner::Tier::cpu][planner::Category::buffers] -
              2 * ((plan.predicted[planner::Tier::cpu][planner::Category::grads] / 4 * 2 + 255) /
                   256 * 256));
  }
  CHECK(files_in(swap.path).empty());
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
    expect_short_read(engine, swap.file("rank0.exp_avg_sq.swp"), 1);
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
  const test::TempDir swap;
  opt.nvme_path = swap.path;
  planner::Strategy p = tiny_strategy(3, planner::Precision::bf16);
  p.offload_param = planner::Offload::nvme;
  p.offload_optimizer = planner::Offload::cpu;
  CHECK(error_of(tiny_plan(p), {}) ==
        "--offload-param nvme needs --nvme-path DIR (a directory on the NVMe drive)");
  p.offload_optimizer = planner::Offload::none;
  CHECK(error_of(tiny_plan(p), opt) ==
        "--offload-param nvme: zero-run needs the optimizer offloaded too");
  p.offload_param = planner::Offload::cpu;
  CHECK(error_of(tiny_plan(p), opt).find("needs the optimizer offloaded too") != std::string::npos);
  planner::Strategy q = tiny_strategy(2, planner::Precision::bf16);
  q.offload_optimizer = planner::Offload::cpu;
  q.offload_param = planner::Offload::nvme;
  CHECK_THROWS_WITH_AS(
      tiny_plan(q), doctest::Contains("--offload-param nvme: needs --stage 3, got stage 2"), Error);
  q.stage = 3;
  q.buffers.param_swap_buffer_count = 0;
  CHECK_THROWS_WITH_AS(tiny_plan(q),
                       doctest::Contains("param_swap_buffer_count 0: must be 1 to 64"), Error);
  q.buffers.param_swap_buffer_count = 5;
  q.buffers.param_swap_buffer_size = 0;
  CHECK_THROWS_WITH_AS(tiny_plan(q), doctest::Contains("param_swap_buffer_size 0"), Error);
  planner::Strategy c = s;
  c.buffers.optimizer_swap_chunk_size = 1000;
  CHECK_THROWS_WITH_AS(tiny_plan(c), doctest::Contains("optimizer_swap_chunk_size 1000"), Error);
}
