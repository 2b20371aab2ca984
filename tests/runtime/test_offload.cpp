// ZeRO-Offload in the engine (one MPI rank): the host tier's bytes against the plan, category
// by category and op by op; offloaded training against the same training on the device
// (fp32: identical weights); the double-buffered parameter tiles, whose asynchronous copies
// are held back so that reusing a tile before its copy is done would send wrong weights; and
// the delayed parameter update against its definition: a threaded run equals the same
// schedule run inline bit for bit, its forward passes see parameters exactly one update old,
// and it still trains.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
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

const test::TempDir& tmp() {
  static test::TempDir d;
  return d;
}





struct Run {
  std::vector<double> losses;
  std::vector<float> weights;  // fp32, flat order, after the last step (pending update applied)
};

Run train(const planner::Plan& plan, int steps, EngineOptions opt = {},
          const std::string& data = "", uint32_t async_copy_delay_us = 0) {
  auto dev = device_for(plan, async_copy_delay_us);
  Engine engine(plan, *dev, comm(), TokenData::load(data), opt);
  Run r;
  for (int i = 0; i < steps; ++i) r.losses.push_back(engine.step().loss);
  const std::string path = tmp().file("offload_weights.bin");
  engine.save_weights(path);
  const std::string bytes = test::slurp(path);
  std::remove(path.c_str());
  r.weights.resize(bytes.size() / 4);
  std::memcpy(r.weights.data(), bytes.data(), r.weights.size() * 4);
  return r;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// A text of exactly one sequence plus its next token: every step trains on the same batch,
// so a loss depends only on the parameters it was computed with.
std::string one_batch_file(int64_t seq) {
  const std::string path = tmp().file("one_batch.txt");
  std::ofstream f(path, std::ios::binary);
  for (int64_t i = 0; i <= seq; ++i) f.put(static_cast<char>('a' + (i * 7) % 26));
  return path;
}

}  // namespace

TEST_CASE("offload memory: host and device bytes equal the plan per category and op by op") {
  for (auto prec : {planner::Precision::bf16, planner::Precision::fp32, planner::Precision::fp16}) {
    for (int stage : {1, 2, 3}) {
      for (bool dpu : {false, true}) {
        planner::Strategy s = tiny_strategy(stage, prec);
        s.offload_optimizer = planner::Offload::cpu;
        s.dpu = dpu;
        s.grad_accum = 2;
        const planner::Plan plan = tiny_plan(s);
        CAPTURE(stage);
        CAPTURE(static_cast<int>(prec));
        CAPTURE(dpu);
        // The plan itself: fp32 grads, master and moments on the host (ZeRO-Offload sec. 4.1).
        const uint64_t part = plan.predicted[planner::Tier::cpu][planner::Category::master] / 4;
        CHECK(part > 0);
        CHECK(plan.predicted[planner::Tier::cpu][planner::Category::optimizer] == 8 * part);
        CHECK(plan.predicted[planner::Tier::gpu][planner::Category::master] == 0);
        CHECK(plan.predicted[planner::Tier::gpu][planner::Category::optimizer] == 0);

        auto dev = device_for(plan);
        std::vector<planner::TimelineSample> timeline;
        {
          EngineOptions opt;
          opt.dpu_warmup_steps = 1;  // one plain step, then delayed ones
          Engine engine(plan, *dev, comm(), TokenData::load(""), opt);
          for (int i = 0; i < 3; ++i) engine.step();
          engine.flush();
          timeline = engine.timeline();
        }
        zp::test::check_memory_matches_plan(plan, *dev, timeline);
      }
    }
  }
}

TEST_CASE("offloaded training equals training on the device") {
  // fp32: the CPU Adam on host states computes exactly what the device Adam computes; bf16
  // without accumulation too (the bf16 gradients reach the host fp32 partition exactly).
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
        const Run device = train(tiny_plan(s), 5, opt);
        s.offload_optimizer = planner::Offload::cpu;
        const Run host = train(tiny_plan(s), 5, opt);
        CHECK(device.losses == host.losses);
        CHECK(bitwise_equal(device.weights, host.weights));
      }
    }
  }
}

TEST_CASE("the cpu device's asynchronous copies: in order per slot, done after wait_copy") {
  planner::Strategy s = tiny_strategy(1, planner::Precision::bf16);
  auto dev = device_for(tiny_plan(s), 2000);  // each copy held back 2 ms
  constexpr uint64_t n = 4096;
  auto* src = static_cast<uint8_t*>(dev->arena(planner::Tier::cpu).alloc(2 * n, planner::Category::buffers, "src"));
  auto* dst = static_cast<uint8_t*>(dev->arena(planner::Tier::gpu).alloc(3 * n, planner::Category::params, "dst"));
  std::memset(dst, 0, 3 * n);
  for (uint64_t i = 0; i < 2 * n; ++i) src[i] = static_cast<uint8_t>(i % 251 + 1);
  dev->copy_to_device_async(dst, src, n, 0);
  dev->copy_to_device_async(dst + n, src + n, n, 1);
  dev->wait_copy(0);
  CHECK(std::memcmp(dst, src, n) == 0);
  dev->wait_copy(1);
  CHECK(std::memcmp(dst + n, src + n, n) == 0);
  // Slot 0 again, after its wait: the new bytes arrive; synchronize() waits for every slot.
  std::memset(src, 7, n);
  dev->copy_to_device_async(dst + 2 * n, src, n, 0);
  dev->synchronize();
  CHECK(std::all_of(dst + 2 * n, dst + 3 * n, [](uint8_t b) { return b == 7; }));
  dev->wait_copy(1);  // nothing pending: returns at once
  CHECK_THROWS_WITH_AS(dev->wait_copy(2), doctest::Contains("slot 2"), Error);
  CHECK_THROWS_WITH_AS(dev->copy_to_device_async(dst, src, 1, -1), doctest::Contains("slot -1"), Error);
  dev->arena(planner::Tier::cpu).free(src);
  dev->arena(planner::Tier::gpu).free(dst);
}

TEST_CASE("double-buffered parameter tiles: bit for bit with device training, bytes as planned") {
  // Tiles of 1024 elements, so each rank's partition takes many tiles through the two slots,
  // and every asynchronous copy held back 300 us: if the engine wrote a tile again before its
  // previous copy was done, the device would receive the newer tile's values in the older
  // tile's place and the weights would differ from the device-trained ones.
  constexpr uint64_t kTile = 1024;
  constexpr uint32_t kDelayUs = 300;
  for (auto prec : {planner::Precision::bf16, planner::Precision::fp16}) {
    for (int stage : {1, 2, 3}) {
      planner::Strategy s = tiny_strategy(stage, prec);
      s.optimizer = planner::OptimizerKind::adamw;
      s.buffers.offload_tile_size = kTile;
      CAPTURE(stage);
      CAPTURE(static_cast<int>(prec));
      EngineOptions opt;
      opt.weight_decay = 0.01f;
      const Run device = train(tiny_plan(s), 3, opt);
      s.offload_optimizer = planner::Offload::cpu;
      const planner::Plan plan = tiny_plan(s);
      const uint64_t part = plan.predicted[planner::Tier::cpu][planner::Category::master] / 4;
      REQUIRE(part >= 4 * kTile);  // each slot is reused at least once per step
      // The two tiles, 2 bytes per 16-bit parameter, are the host tier's only buffers.
      CHECK(plan.predicted[planner::Tier::cpu][planner::Category::buffers] == 2 * kTile * 2);
      if (prec == planner::Precision::bf16) {
        // bf16 gradients reach the host fp32 partition exactly: the same bits as the device.
        const Run host = train(plan, 3, opt, "", kDelayUs);
        CHECK(device.losses == host.losses);
        CHECK(bitwise_equal(device.weights, host.weights));
      }
      // Measured bytes equal the plan's, tiles included, op by op.
      auto dev = device_for(plan, kDelayUs);
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

TEST_CASE("delayed parameter update: threaded equals inline, one step stale, still trains") {
  planner::Strategy s = tiny_strategy(2, planner::Precision::bf16);
  s.offload_optimizer = planner::Offload::cpu;
  s.dpu = true;
  const planner::Plan plan = tiny_plan(s);

  SUBCASE("the CPU step on its own thread gives the inline schedule's bits") {
    for (int64_t warmup : {0, 2}) {
      EngineOptions threaded, inline_ref;
      threaded.dpu_warmup_steps = inline_ref.dpu_warmup_steps = warmup;
      inline_ref.dpu_threaded = false;
      const Run a = train(plan, 6, threaded);
      const Run b = train(plan, 6, inline_ref);
      CAPTURE(warmup);
      CHECK(a.losses == b.losses);
      CHECK(bitwise_equal(a.weights, b.weights));
    }
  }

  SUBCASE("forward passes see the parameters one update old") {
    // One batch every step: L(w) depends on the parameters only. Without the delay the
    // losses are L(w0), L(w1), L(w2), ...; with it (no warm-up) step 2 still sees w0 and
    // step 3 sees w1, computed from the same first gradient g(w0).
    const std::string data = one_batch_file(s.seq);
    planner::Strategy plain = s;
    plain.dpu = false;
    EngineOptions opt;
    opt.dpu_warmup_steps = 0;
    const Run sync = train(tiny_plan(plain), 3, opt, data);
    const Run delayed = train(plan, 3, opt, data);
    CHECK(delayed.losses[0] == sync.losses[0]);
    CHECK(delayed.losses[1] == sync.losses[0]);
    CHECK(delayed.losses[2] == sync.losses[1]);
    CHECK(sync.losses[1] < sync.losses[0]);  // the update did change the parameters
    // With a warm-up of 2 plain steps, the first 3 losses are the plain ones, and step 4
    // sees w2 again.
    opt.dpu_warmup_steps = 2;
    const Run warm = train(plan, 4, opt, data);
    const Run sync4 = train(tiny_plan(plain), 4, opt, data);
    for (int i = 0; i < 3; ++i) CHECK(warm.losses[static_cast<std::size_t>(i)] == sync4.losses[static_cast<std::size_t>(i)]);
    CHECK(warm.losses[3] == sync4.losses[2]);
    std::remove(data.c_str());
  }

  SUBCASE("training with the delay still converges") {
    EngineOptions opt;
    opt.dpu_warmup_steps = 2;
    opt.lr = 3e-3f;
    const Run r = train(plan, 40, opt);
    double tail = 0;
    for (std::size_t i = r.losses.size() - 5; i < r.losses.size(); ++i) tail += r.losses[i] / 5;
    // Byte-level text starts at ln(256) = 5.55 nats; the delayed run must get well below.
    CHECK(r.losses.front() > 5.0);
    CHECK(tail < r.losses.front() - 1.0);
  }
}
