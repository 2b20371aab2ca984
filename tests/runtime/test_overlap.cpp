// test_overlap.cpp (run by ctest under mpirun -np 2, and alone as one rank): overlap_comm,
// the gradient buckets reduced while backward goes on and the stage-3 all-gathers waited for
// when their run starts. Weights after a few steps equal those of blocking collectives bit
// for bit; every byte is where the plan put it, op by op; and through a Comm whose requests
// only do their work at wait(), an engine that read a bucket or a gathered group before
// waiting would train on unreduced or ungathered values and end with other weights.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine_fixture.hpp"
#include "process.hpp"
#include "zp/runtime/engine.hpp"

using namespace zp;
using runtime::CommRequest;
using runtime::DType;
using runtime::Engine;
using runtime::TokenData;

namespace {

// The collectives of `base`, with ireduce_sum and iall_gather done at one of two extremes.
// Deferred: nothing happens when they are issued; the blocking collective runs at the
// request's wait(), writing the result only then. Eager: the blocking collective runs when
// issued, so the result is there before wait() (the reference: what an engine reads is
// right whenever it reads it). Counts the requests issued and the most in flight at once.
class DeferredComm final : public runtime::Comm {
 public:
  DeferredComm(runtime::Comm& base, bool eager) : base_(base), eager_(eager) {}
  int rank() const override { return base_.rank(); }
  int size() const override { return base_.size(); }
  int local_size() const override { return base_.local_size(); }
  int local_rank() const override { return base_.local_rank(); }
  void all_reduce_sum(void* buf, uint64_t n, DType t) override { base_.all_reduce_sum(buf, n, t); }
  CommRequest ireduce_sum(void* buf, uint64_t n, DType t, int root) override {
    issued_one();
    if (eager_) base_.reduce_sum(buf, n, t, root);
    return CommRequest([this, buf, n, t, root] {
      if (!eager_) base_.reduce_sum(buf, n, t, root);
      --in_flight;
    });
  }
  CommRequest iall_gather(const void* send, void* recv, uint64_t n, DType t) override {
    issued_one();
    if (eager_) base_.all_gather(send, recv, n, t);
    return CommRequest([this, send, recv, n, t] {
      if (!eager_) base_.all_gather(send, recv, n, t);
      --in_flight;
    });
  }
  void all_gather_in_place(void* buf, const std::vector<uint64_t>& counts, DType t) override {
    base_.all_gather_in_place(buf, counts, t);
  }
  void broadcast(void* buf, uint64_t bytes, int root) override { base_.broadcast(buf, bytes, root); }
  void gather_u64(const uint64_t* send, uint64_t* recv, int n) override { base_.gather_u64(send, recv, n); }
  double all_reduce_sum(double v) override { return base_.all_reduce_sum(v); }
  void barrier() override { base_.barrier(); }
  [[noreturn]] void abort(int code) override {
    base_.abort(code);
    std::_Exit(code);  // not reached
  }

  int64_t issued = 0;
  int in_flight = 0, max_in_flight = 0;

 private:
  runtime::Comm& base_;
  bool eager_;
  void issued_one() {
    ++issued;
    max_in_flight = std::max(max_in_flight, ++in_flight);
  }
};

using test::SharedDir;

// Small buckets (several per backward pass) and, at stage 3, a prefetch of a bit more than one
// layer, so buckets and gathers really are in flight across ops.
planner::Strategy overlap_strategy(int stage, planner::Precision prec, bool overlap,
                                   planner::Offload params = planner::Offload::none) {
  planner::Strategy s = test::tiny_strategy(stage, prec);
  if (params != planner::Offload::none) {  // stage 3: the shards staged from the host or NVMe
    s.offload_optimizer = planner::Offload::cpu;
    s.offload_param = params;
    s.buffers.param_swap_buffer_size = 4096;
  }
  s.dp = test::comm().size();
  s.grad_accum = 2;
  s.buffers.reduce_bucket_size = 20'000;
  s.buffers.prefetch_bucket_size = 60'000;
  s.overlap_comm = overlap;
  return s;
}

struct Trained {
  std::string weights;  // the saved fp32 weights, all ranks' parts
  std::vector<planner::TimelineSample> timeline;
};

// Three steps of `plan` over `comm` on a fresh device (swap files, if any, in `dir`); checks
// the memory against the plan.
Trained train(const planner::Plan& plan, runtime::Comm& comm, const std::string& dir,
              const std::string& name) {
  auto dev = test::device_for(plan);
  const std::string path = dir + "/" + name;
  Trained out;
  {
    runtime::EngineOptions opt;
    opt.nvme_path = dir;
    Engine engine(plan, *dev, comm, TokenData::load(""), opt);
    for (int i = 0; i < 3; ++i) engine.step();
    out.timeline = engine.timeline();
    engine.save_weights(path);
  }
  test::check_memory_matches_plan(plan, *dev, out.timeline);
  out.weights = test::slurp(path);
  return out;
}

// Trains the same strategy without and with overlap_comm (train() checks each against its
// plan op by op): the weights are equal bit for bit, and with overlap no op holds fewer device
// buffer bytes. `more`: some op holds more; `weights`: the saved weights.
struct OffOn {
  bool more = false;
  std::string weights;
};
OffOn off_on(const planner::Strategy& off, const planner::Strategy& on, const std::string& dir) {
  const Trained a = train(test::tiny_plan(off), test::comm(), dir, "off.bin");
  const Trained b = train(test::tiny_plan(on), test::comm(), dir, "on.bin");
  REQUIRE(!a.weights.empty());
  CHECK(a.weights == b.weights);
  REQUIRE(a.timeline.size() == b.timeline.size());
  OffOn r{false, a.weights};
  for (std::size_t k = 0; k < a.timeline.size(); ++k) {
    const auto buffers = [&](const Trained& t) {
      return t.timeline[k].bytes[static_cast<std::size_t>(planner::Tier::gpu)]
                                [static_cast<std::size_t>(planner::Category::buffers)];
    };
    CHECK(buffers(b) >= buffers(a));
    r.more = r.more || buffers(b) > buffers(a);
  }
  return r;
}

}  // namespace

TEST_CASE("overlap_comm: the weights of blocking collectives bit for bit, bytes as planned") {
  SharedDir dir;
  for (auto prec : {planner::Precision::bf16, planner::Precision::fp16, planner::Precision::fp32}) {
    for (int stage : {2, 3}) {
      CAPTURE(stage);
      CAPTURE(static_cast<int>(prec));
      // The buckets in flight: on one rank (nothing to reduce) no bucket is held longer.
      const OffOn r = off_on(overlap_strategy(stage, prec, false),
                             overlap_strategy(stage, prec, true), dir.path);
      CHECK(r.more == (test::comm().size() > 1));
    }
  }
}

TEST_CASE("overlap_comm: results are read only after wait (requests that work only at wait)") {
  // The same overlapped engine over eager and deferred requests: an engine that consumed a
  // bucket (or read a gathered group) between issue and wait would read reduced values in
  // the eager run and unreduced (ungathered) ones in the deferred run. On one rank no bucket
  // is reduced (stage 3 still gathers).
  SharedDir dir;
  for (int stage : {2, 3}) {
    CAPTURE(stage);
    const planner::Plan plan = test::tiny_plan(overlap_strategy(stage, planner::Precision::bf16, true));
    DeferredComm eager(test::comm(), true), deferred(test::comm(), false);
    const Trained ref = train(plan, eager, dir.path, "eager.bin");
    const Trained got = train(plan, deferred, dir.path, "deferred.bin");
    CHECK(got.weights == ref.weights);
    CHECK(deferred.in_flight == 0);  // everything issued was waited for
    CHECK(deferred.issued == eager.issued);
    if (test::comm().size() > 1 || stage == 3) {
      CHECK(deferred.issued > 0);
      CHECK(deferred.max_in_flight > 1);  // requests outlive the op that issued them
    }
  }
}

TEST_CASE("overlap_comm with offloaded parameters: each staging buffer lives until its gather's wait") {
  // Stage 3 with the 16-bit shards on the host (cpu) or read from NVMe: each gather copies the
  // rank's shard into a device staging buffer the all-gather sends from. In flight, that buffer
  // must outlive the op that issued the gather: with requests that read it only at wait(), a
  // staging buffer freed early (and reused by the activations allocated meanwhile) would send
  // other bytes and the weights would differ.
  SharedDir dir;
  for (auto params : {planner::Offload::cpu, planner::Offload::nvme}) {
    CAPTURE(planner::to_string(params));
    const auto bf16 = planner::Precision::bf16;
    // The prefetched groups' staging buffers are held longer, on one rank too.
    const OffOn r = off_on(overlap_strategy(3, bf16, false, params),
                           overlap_strategy(3, bf16, true, params), dir.path);
    CHECK(r.more);

    const planner::Plan on = test::tiny_plan(overlap_strategy(3, bf16, true, params));
    DeferredComm eager(test::comm(), true), deferred(test::comm(), false);
    const Trained ref = train(on, eager, dir.path, "eager.bin");
    const Trained got = train(on, deferred, dir.path, "deferred.bin");
    CHECK(got.weights == ref.weights);
    CHECK(got.weights == r.weights);
    CHECK(deferred.in_flight == 0);
    CHECK(deferred.max_in_flight > 1);
  }
}

TEST_CASE("local ranks: every rank of this one-node job has its own index on the node") {
  // Comm::local_rank, from MPI_Comm_split_type: which GPU a rank takes on its node, whatever the
  // launcher's variables say. Alone: 0 of 1; under mpirun -np 2 here: 0 and 1 of 2.
  runtime::Comm& c = test::comm();
  CHECK(c.local_size() == c.size());
  CHECK(c.local_rank() == c.rank());
  std::vector<uint64_t> all(static_cast<std::size_t>(c.size()));
  const uint64_t mine = static_cast<uint64_t>(c.local_rank());
  c.gather_u64(&mine, all.data(), 1);
  if (c.rank() == 0)
    for (std::size_t r = 0; r < all.size(); ++r) CHECK(all[r] == r);
}
