// engine_fixture.hpp (tests): what the one-process engine tests share: the MPI session of a
// single rank, plans for gpt2-tiny, and a cpu device with room for a plan. Not a reference:
// expected values never come from here.
#pragma once

#include <memory>

#include "zp/models/model_spec.hpp"
#include "zp/planner/plan.hpp"
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

inline planner::Plan tiny_plan(const planner::Strategy& s) {
  return planner::make_plan(models::load_model("gpt2-tiny"), s,
                            {planner::Profile::zeroplan, planner::Backend::cpu}, 1234);
}

// Twice the plan's peak per tier plus 16 MiB, one compute thread (results independent of the
// machine's cores).
inline std::unique_ptr<runtime::Device> device_for(const planner::Plan& p) {
  runtime::DeviceConfig dc;
  dc.gpu_bytes = p.predicted.peak(planner::Tier::gpu) * 2 + (16 << 20);
  dc.cpu_bytes = p.predicted.peak(planner::Tier::cpu) * 2 + (16 << 20);
  dc.nvme_bytes = p.predicted.peak(planner::Tier::nvme) * 2 + (16 << 20);
  dc.n_threads = 1;
  return runtime::make_cpu_device(dc);
}

}  // namespace zp::test
