// engine_fixture.hpp (tests): what the one-process engine tests share: the MPI session of a
// single rank, plans for gpt2-tiny, and a cpu device with room for a plan. Not a reference:
// expected values never come from here.
#pragma once

#include <memory>
#include <vector>

#include <doctest/doctest.h>

#include "process.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/plan.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/runtime/comm.hpp"
#include "zp/runtime/device.hpp"

namespace zp::test {

// One rank (MPI singleton), started on first use and kept for the process.
inline runtime::Comm& comm() {
  static runtime::MpiSession session(nullptr, nullptr);
  static std::unique_ptr<runtime::Comm> c = runtime::make_mpi_comm();
  return *c;
}

// A small step: micro-batch 2, sequence 32.
inline planner::Strategy tiny_strategy(int stage, planner::Precision prec) {
  planner::Strategy s;
  s.stage = stage;
  s.precision = prec;
  s.micro_batch = 2;
  s.seq = 32;
  return s;
}

// gpt2-tiny with dropout after the embedding, on the attention probabilities and after the
// blocks' output projections (gpt2-tiny itself has none).
inline models::ModelSpec tiny_model_with_dropout(double embd, double attn, double resid) {
  models::ModelSpec m = models::load_model("gpt2-tiny");
  m.embd_dropout = embd;
  m.attn_dropout = attn;
  m.resid_dropout = resid;
  return m;
}

// A directory every rank agrees on: rank 0 makes it and broadcasts its path.
struct SharedDir {
  std::unique_ptr<TempDir> dir;
  std::string path;
  SharedDir() {
    char buf[64] = {};
    if (comm().rank() == 0) {
      dir = std::make_unique<TempDir>();
      dir->path.copy(buf, sizeof(buf) - 1);
    }
    comm().broadcast(buf, sizeof(buf), 0);
    path = buf;
  }
  ~SharedDir() { comm().barrier(); }  // every rank done with it before rank 0 removes it
};

inline planner::Plan tiny_plan(const planner::Strategy& s) {
  return planner::make_plan(models::load_model("gpt2-tiny"), s,
                            {planner::Profile::zeroplan, planner::Backend::cpu}, 1234);
}

// Twice the plan's peak per tier plus 16 MiB, one compute thread (results independent of the
// machine's cores). async_copy_delay_us: DeviceConfig's test hook that holds back each
// asynchronous copy, so a caller reusing a buffer before wait_copy sends the wrong bytes.
inline std::unique_ptr<runtime::Device> device_for(const planner::Plan& p,
                                                   uint32_t async_copy_delay_us = 0) {
  runtime::DeviceConfig dc;
  dc.async_copy_delay_us = async_copy_delay_us;
  dc.gpu_bytes = p.predicted.peak(planner::Tier::gpu) * 2 + (16 << 20);
  dc.cpu_bytes = p.predicted.peak(planner::Tier::cpu) * 2 + (16 << 20);
  dc.nvme_bytes = p.predicted.peak(planner::Tier::nvme) * 2 + (16 << 20);
  dc.n_threads = 1;
  return runtime::make_cpu_device(dc);
}

// After an engine ran `plan` on `dev` and went away: its measured timeline of the first
// micro-step equals the planner's op by op, every tier's category high-water marks and peak
// equal the prediction, and every arena is empty again.
inline void check_memory_matches_plan(const planner::Plan& plan, const runtime::Device& dev,
                                      const std::vector<planner::TimelineSample>& timeline) {
  const auto g = models::build_training_graph(
      plan.model, planner::graph_options(plan.model, plan.strategy, plan.options));
  const auto rep =
      planner::replay(planner::build_schedule(g, plan.strategy, plan.options), plan.options);
  REQUIRE(timeline.size() == rep.timeline.size());
  for (std::size_t k = 0; k < timeline.size(); ++k) {
    CHECK(timeline[k].pos == rep.timeline[k].pos);
    CHECK(timeline[k].bytes == rep.timeline[k].bytes);
  }
  const planner::PerDevice m = dev.measured();
  for (auto tier : planner::kTiers) {
    CHECK(m.peak(tier) == plan.predicted.peak(tier));
    for (auto c : planner::kCategories) CHECK(m[tier][c] == plan.predicted[tier][c]);
    CHECK(dev.arena(tier).in_use() == 0);
  }
}

}  // namespace zp::test
