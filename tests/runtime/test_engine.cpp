// The ZeRO engine in one process (one MPI rank): its gradients against central finite
// differences of an independent float64 GPT-2 (tests/support/gpt2_f64.hpp) for every
// parameter tensor, under every stage; its memory against the plan; its refusals.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>

#include "gpt2_f64.hpp"
#include "engine_fixture.hpp"
#include "process.hpp"
#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/plan.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/runtime/comm.hpp"
#include "zp/runtime/device.hpp"
#include "zp/runtime/engine.hpp"
#include "zp/runtime/kernel_math.hpp"

using namespace zp;
using namespace zp::runtime;
using zp::test::comm;
using zp::test::device_for;
using zp::test::tiny_plan;

namespace {

using zp::test::read_floats;
using zp::test::rel_l2;





// Flat offsets of gpt2-tiny's parameter tensors, from GPT-2's shapes (V=256, P=64, C=64, L=2).
struct TensorRange {
  std::string name;
  std::size_t off, n;
};
std::vector<TensorRange> tiny_tensors() {
  const std::size_t V = 256, P = 64, C = 64, F = 4 * C;
  std::vector<TensorRange> r;
  std::size_t at = 0;
  auto add = [&](std::string name, std::size_t n) {
    r.push_back({std::move(name), at, n});
    at += n;
  };
  add("wte", V * C);
  add("wpe", P * C);
  for (int l = 0; l < 2; ++l) {
    const std::string h = "h." + std::to_string(l);
    add(h + ".ln1", 2 * C);
    add(h + ".qkv", 3 * C * C + 3 * C);
    add(h + ".proj", C * C + C);
    add(h + ".ln2", 2 * C);
    add(h + ".fc", F * C + F);
    add(h + ".fc2", C * F + C);
  }
  add("ln_f", 2 * C);
  return r;
}

// Trains one SGD step with lr = 1 (so the gradient is w0 - w1 exactly) and checks, for every
// parameter tensor, the element with the largest gradient and four random ones against central
// finite differences of the float64 GPT-2 under the same dropout factors (none if empty).
// tol: the allowed error as a fraction of the tensor's largest gradient (1e-3 for fp32
// activations: fp32 sums over a few thousand terms lose ~1e-5 relative). The float64 loss is
// taken at the weights the forward read: the 16-bit parameters where they are 16-bit.
void check_gradients_against_f64(const planner::Plan& plan, const test::DropoutFactor& dropout,
                                 unsigned rng_seed, double tol = 1e-3) {
  const int64_t B = plan.strategy.micro_batch, T = plan.strategy.seq;
  auto dev = device_for(plan);
  EngineOptions opt;
  opt.lr = 1.0f;  // the first SGD step is w -= lr * g exactly: g = w0 - w1
  Engine engine(plan, *dev, comm(), TokenData::load(""), opt);
  test::TempDir dir;
  engine.save_weights(dir.file("w0.bin"));
  engine.step();
  engine.save_weights(dir.file("w1.bin"));
  const std::vector<float> w0 = read_floats(dir.file("w0.bin")), w1 = read_floats(dir.file("w1.bin"));
  REQUIRE(w0.size() == 120576);
  REQUIRE(w1.size() == w0.size());

  std::vector<int32_t> tokens(B * T), targets(B * T);
  TokenData::load("").fill(tokens.data(), targets.data(), B, T, plan.seed, 0, 0, 0);
  std::vector<double> w(w0.begin(), w0.end());
  const DType pdt = plan.strategy.precision == planner::Precision::fp16   ? DType::fp16
                    : plan.strategy.precision == planner::Precision::bf16 ? DType::bf16
                                                                          : DType::fp32;
  for (double& x : w) {
    uint16_t h[2];
    store_from_f32(h, 0, pdt, static_cast<float>(x));
    x = pdt == DType::fp32 ? x : load_as_f32(h, 0, pdt);
  }
  double worst = 0;  // the largest error seen, as a fraction of its tensor's largest gradient
  const test::Gpt2Shape shape;
  std::mt19937 rng(rng_seed);
  for (const TensorRange& tr : tiny_tensors()) {
    CAPTURE(tr.name);
    double gmax = 0;
    std::size_t imax = tr.off;
    for (std::size_t i = tr.off; i < tr.off + tr.n; ++i) {
      const double g = static_cast<double>(w0[i]) - w1[i];
      if (std::fabs(g) > gmax) gmax = std::fabs(g), imax = i;
    }
    REQUIRE(gmax > 0);  // every tensor takes part in the loss
    std::vector<std::size_t> picks = {imax};
    std::uniform_int_distribution<std::size_t> pick(tr.off, tr.off + tr.n - 1);
    for (int k = 0; k < 4; ++k) picks.push_back(pick(rng));
    for (std::size_t i : picks) {
      const double h = 1e-5;
      const double keep = w[i];
      w[i] = keep + h;
      const double lp = test::gpt2_mean_loss(w, shape, tokens, targets, B, T, dropout);
      w[i] = keep - h;
      const double lm = test::gpt2_mean_loss(w, shape, tokens, targets, B, T, dropout);
      w[i] = keep;
      const double fd = (lp - lm) / (2 * h);
      const double an = static_cast<double>(w0[i]) - w1[i];
      CAPTURE(i);
      CHECK(std::fabs(an - fd) <= tol * gmax + 1e-7);
      worst = std::max(worst, std::fabs(an - fd) / gmax);
    }
  }
  MESSAGE("largest error " << worst << " of the tensor's largest gradient (allowed " << tol << ")");
}

planner::Strategy fd_strategy(int stage) {
  planner::Strategy s;
  s.stage = stage;
  s.precision = planner::Precision::fp32;
  s.optimizer = planner::OptimizerKind::sgd;
  s.micro_batch = 2;
  s.seq = 8;
  s.buffers.reduce_bucket_size = 10'000;  // several buckets
  return s;
}

}  // namespace

TEST_CASE("engine gradients equal float64 finite differences for every parameter tensor") {
  for (int stage : {0, 2, 3}) {
    CAPTURE(stage);
    check_gradients_against_f64(tiny_plan(fd_strategy(stage)), {}, static_cast<unsigned>(stage + 1));
  }
}

TEST_CASE("engine with dropout: gradients equal float64 finite differences under the same masks") {
  // The planner's cuda graph in fp32: activations as the weights, no scratch copies, dropout
  // where GPT-2 has it. Each kind of site gets its own probability, so a mask applied at the
  // wrong site, with the wrong probability or scale, or not redrawn identically by the
  // recomputed forward (checkpointing full), moves the gradients far beyond the tolerance.
  // With flash attention (cpu_flash.cpp) the attention's dropout is drawn inside the fused
  // kernel: the float64 GPT-2 applies the three-step attention's masks (site h.L.attn.drop.mask)
  // there too, so a flash kernel drawing other masks, or a backward that does not redraw the
  // forward's, fails here as well.
  const double p_embd = 0.1, p_attn = 0.2, p_resid = 0.15;
  const models::ModelSpec m = test::tiny_model_with_dropout(p_embd, p_attn, p_resid);
  const uint64_t seed = 1234;
  // The engine's masks of step 0, micro-step 0, rank 0 (kernel_math.hpp, Engine::dropout_key).
  const test::DropoutFactor factor = [&](const std::string& site, int64_t i) {
    const double p = site.starts_with("embed") ? p_embd
                     : site.ends_with(".attn.drop.mask") ? p_attn
                                                         : p_resid;
    const uint64_t key = Engine::dropout_key(seed, site, 0, 0);
    return dropout_keep(key, i, dropout_threshold(static_cast<float>(p))) ? 1.0 / (1.0 - p) : 0.0;
  };
  for (bool flash : {false, true})
    for (int stage : {0, 3})
      for (auto ck : {planner::Checkpointing::none, planner::Checkpointing::full}) {
        CAPTURE(flash);
        CAPTURE(stage);
        CAPTURE(static_cast<int>(ck));
        planner::Strategy s = fd_strategy(stage);
        s.checkpointing = ck;
        s.flash_attention = flash;
        const planner::Plan plan = planner::make_plan(m, s, {planner::Profile::zeroplan, planner::Backend::cuda}, seed);
        const auto g = models::build_training_graph(plan.model, planner::graph_options(plan.model, s, plan.options));
        int n_dropout = 0, n_flash = 0;
        for (const models::Op& op : g.ops) {
          n_dropout += op.kind == models::OpKind::dropout ? 1 : 0;
          n_flash += op.kind == models::OpKind::flash_attention ? 1 : 0;
        }
        // Per block and forward pass (twice under full recomputation): the attention's
        // dropout (inside the flash op), the two residual dropouts; and the embedding's.
        const int passes = ck == planner::Checkpointing::full ? 2 : 1;
        REQUIRE(n_dropout == 1 + passes * 2 * (flash ? 2 : 3));
        REQUIRE(n_flash == (flash ? passes * 2 : 0));
        check_gradients_against_f64(plan, factor, static_cast<unsigned>(10 + stage + (flash ? 20 : 0)));
      }
}

TEST_CASE("engine with 16-bit activations: gradients within 16-bit rounding of float64 differences") {
  // The planner's cuda graph: every activation, weight and gradient stored in the training
  // precision, each kernel rounding its outputs once. A rounding to nearest has relative
  // error at most u = 2^-8 (bf16, 8 significant bits) or 2^-11 (fp16); a gradient here passes
  // through about two dozen stored tensors (forward and backward through two blocks and the
  // head), whose errors add up roughly as a random walk: sqrt(24) u ~ 5u. The allowed error,
  // 8u of the tensor's largest gradient (3% bf16, 0.4% fp16), leaves room for that and stays
  // far below what a kernel that drops or doubles a term gives (test_cpu_kernels16 holds each
  // kernel to one rounding). Observed: about 1.3u for both types. Flash attention (16-bit
  // q, k, v and output, fp32 running sums) is held to the same.
  for (bool flash : {false, true})
  for (auto prec : {planner::Precision::bf16, planner::Precision::fp16})
    for (int stage : {0, 3}) {
      CAPTURE(flash);
      CAPTURE(static_cast<int>(prec));
      CAPTURE(stage);
      planner::Strategy s = fd_strategy(stage);
      s.precision = prec;
      s.flash_attention = flash;
      const planner::Plan plan = planner::make_plan(models::load_model("gpt2-tiny"), s,
                                                    {planner::Profile::zeroplan, planner::Backend::cuda}, 1234);
      const double u = prec == planner::Precision::bf16 ? 0x1.0p-8 : 0x1.0p-11;
      check_gradients_against_f64(plan, {}, static_cast<unsigned>(20 + stage), 8 * u);
    }
}

TEST_CASE("engine memory: measured per category equals the plan, bf16 and fp32") {
  // Both graphs the planner predicts for zeroplan: its cpu graph (fp32 activations, fp32
  // scratch copies of 16-bit weights) and its cuda graph (activations in the training
  // precision, dropout masks, the LM head's 16-bit logits gradient), here with dropout on.
  const models::ModelSpec dropout_model = test::tiny_model_with_dropout(0.1, 0.1, 0.1);
  // Flash attention (either graph; the cuda graph's in 16 bits too): its output and
  // log-sum-exp saved, its backward's fp32 workspaces, no T x T.
  for (auto backend : {planner::Backend::cpu, planner::Backend::cuda})
  for (bool flash : {false, true})
  for (auto prec : {planner::Precision::bf16, planner::Precision::fp32, planner::Precision::fp16}) {
    for (int stage : {0, 1, 2, 3}) {
      for (auto ck : {planner::Checkpointing::none, planner::Checkpointing::full,
                      planner::Checkpointing::selective}) {
        planner::Strategy s;
        s.stage = stage;
        s.precision = prec;
        s.checkpointing = ck;
        s.flash_attention = flash;
        s.micro_batch = 2;
        s.seq = 32;
        s.grad_accum = 2;
        const planner::Plan plan =
            backend == planner::Backend::cpu
                ? tiny_plan(s)
                : planner::make_plan(dropout_model, s, {planner::Profile::zeroplan, backend}, 1234);
        auto dev = device_for(plan);
        std::vector<planner::TimelineSample> timeline;
        CAPTURE(planner::to_string(backend));
        CAPTURE(flash);
        CAPTURE(stage);
        CAPTURE(static_cast<int>(prec));
        CAPTURE(static_cast<int>(ck));
        {
          Engine engine(plan, *dev, comm(), TokenData::load(""), {});
          const double l1 = engine.step().loss;
          engine.step();
          const double l3 = engine.step().loss;
          CHECK(l3 < l1);
          timeline = engine.timeline();
        }
        // Timeline op by op, every tier and category, and everything back in the arenas.
        zp::test::check_memory_matches_plan(plan, *dev, timeline);
      }
    }
  }
}

TEST_CASE("engine refuses what it cannot run, naming why") {
  auto error_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  planner::Strategy s;
  s.seq = 16;
  {
    planner::Strategy two = s;
    two.dp = 2;
    const planner::Plan p = tiny_plan(two);
    auto dev = device_for(p);
    CHECK(error_of([&] { Engine(p, *dev, comm(), TokenData::load(""), {}); })
              .find("the plan is for --dp 2, but 1 rank is running") != std::string::npos);
  }
  {
    // DeepSeek-V3 (multi-head latent attention, a biased sigmoid router) is planned, not run
    // (Mixtral and Qwen-MoE are).
    const planner::Plan p = planner::make_plan(models::load_model("deepseek-v3"), s,
                                               {planner::Profile::zeroplan, planner::Backend::cpu});
    DeviceConfig dc;
    dc.gpu_bytes = 1 << 20;
    auto dev = make_cpu_device(dc);
    const std::string e = error_of([&] { Engine(p, *dev, comm(), TokenData::load(""), {}); });
    CHECK(e.find("trains GPT-2 and LLaMA-family models") != std::string::npos);
    CHECK(e.find("Mixture-of-Experts layers other than Mixtral's and Qwen-MoE's") != std::string::npos);
  }
  {
    // An arena smaller than the plan's peak runs out mid-step: the error names the tensor,
    // its category and the shortfall.
    const planner::Plan p = tiny_plan(s);
    DeviceConfig dc;
    dc.gpu_bytes = p.predicted.peak(planner::Tier::gpu) - 4096;
    dc.n_threads = 1;
    auto dev = make_cpu_device(dc);
    const std::string e = error_of([&] {
      Engine engine(p, *dev, comm(), TokenData::load(""), {});
      engine.step();
    });
    CHECK(e.find("out of gpu memory allocating") != std::string::npos);
    CHECK(e.find("short by") != std::string::npos);
  }
}

namespace {

// The collectives of `base`, counted by kind (a one-rank job: test_engine runs alone).
class CountingComm final : public Comm {
 public:
  explicit CountingComm(Comm& base) : base_(base) {}
  int reduces = 0, groups = 0, all_reduces = 0, gathers = 0, gathers_in_place = 0, double_sums = 0;
  int rank() const override { return base_.rank(); }
  int size() const override { return base_.size(); }
  int local_size() const override { return base_.local_size(); }
  int local_rank() const override { return base_.local_rank(); }
  void all_reduce_sum(void* buf, uint64_t n, DType t) override {
    ++all_reduces;
    base_.all_reduce_sum(buf, n, t);
  }
  CommRequest ireduce_sum(void* buf, uint64_t n, DType t, int root) override {
    ++reduces;
    return base_.ireduce_sum(buf, n, t, root);
  }
  CommRequest iall_gather(const void* send, void* recv, uint64_t n, DType t) override {
    ++gathers;
    return base_.iall_gather(send, recv, n, t);
  }
  CommRequest ireduce_sum_group(const std::vector<ReduceSegment>& segs, DType t) override {
    ++groups;
    return Comm::ireduce_sum_group(segs, t);  // one ireduce_sum per segment, counted above
  }
  void all_gather_in_place(void* buf, const std::vector<uint64_t>& counts, DType t) override {
    ++gathers_in_place;
    base_.all_gather_in_place(buf, counts, t);
  }
  void broadcast(void* buf, uint64_t bytes, int root) override { base_.broadcast(buf, bytes, root); }
  void gather_u64(const uint64_t* send, uint64_t* recv, int n) override { base_.gather_u64(send, recv, n); }
  double all_reduce_sum(double v) override {
    ++double_sums;
    return base_.all_reduce_sum(v);
  }
  void barrier() override { base_.barrier(); }
  [[noreturn]] void abort(int code) override {
    base_.abort(code);
    std::_Exit(code);  // not reached
  }

 private:
  Comm& base_;
};

}  // namespace

TEST_CASE("collectives_at_one_rank: every collective runs at one rank, the same bits and bytes") {
  // The test mode that lets a one-GPU machine execute NCCL's calls (test_cuda_engine): on the
  // cpu backend over MPI, the engine issues the collectives a multi-rank run would, and
  // nothing changes: weights, losses and memory, op by op, as without.
  REQUIRE(comm().size() == 1);
  for (auto prec : {planner::Precision::fp32, planner::Precision::bf16})
    for (int stage = 0; stage <= 3; ++stage) {
      CAPTURE(stage);
      CAPTURE(static_cast<int>(prec));
      planner::Strategy s = test::tiny_strategy(stage, prec);
      s.grad_accum = 2;
      s.buffers.reduce_bucket_size = 20'000;  // several buckets
      const planner::Plan plan = tiny_plan(s);
      std::vector<double> losses[2];
      std::vector<float> weights[2];
      CountingComm counted[2] = {CountingComm(comm()), CountingComm(comm())};
      for (int forced : {0, 1}) {
        auto dev = device_for(plan);
        EngineOptions opt;
        opt.collectives_at_one_rank = forced == 1;
        test::TempDir dir;
        std::vector<planner::TimelineSample> timeline;
        {
          Engine engine(plan, *dev, counted[forced], TokenData::load(""), opt);
          for (int i = 0; i < 2; ++i) losses[forced].push_back(engine.step().loss);
          engine.save_weights(dir.file("w.bin"));
          timeline = engine.timeline();
        }
        if (forced == 1) test::check_memory_matches_plan(plan, *dev, timeline);
        weights[forced] = read_floats(dir.file("w.bin"));
      }
      CHECK(losses[1] == losses[0]);
      REQUIRE(weights[1].size() == weights[0].size());
      CHECK(std::memcmp(weights[1].data(), weights[0].data(), weights[0].size() * 4) == 0);
      // Without the mode: no reduction at one rank (stage 3 gathers its groups either way).
      const CountingComm& off = counted[0];
      const CountingComm& on = counted[1];
      CHECK(off.reduces == 0);
      CHECK(off.all_reduces == 0);
      CHECK(off.gathers_in_place == 0);
      CHECK(on.gathers == off.gathers);
      CHECK((on.reduces > 0) == (stage >= 2));        // the bucket segments
      // ... issued one group per bucket (NCCL: one launch, one event), not one per tensor.
      CHECK((on.groups > 0) == (stage >= 2));
      if (stage >= 2) CHECK(on.groups < on.reduces);
      CHECK(off.groups == 0);
      CHECK(on.all_reduces == (stage <= 1 ? 2 : 0));  // one per step
      CHECK(on.gathers_in_place == (stage == 1 || stage == 2 ? 2 : 0));
      CHECK(on.double_sums > off.double_sums);        // the loss (and the norm from stage 1)
    }
}

TEST_CASE("selective recomputation (Megatron's and torchtitan's per-op) trains the bits of none, with dropout") {
  // Megatron's: the attention core (scores, softmax and the probabilities' dropout) is freed
  // after the forward and recomputed in the backward. torchtitan's per-op SAC (selective-op):
  // every op of a block is recomputed but those its policy saves (every second matmul, the
  // attention products), whose outputs the recomputation reads where the forward left them
  // (sac_reuse). The dropout masks are counter-based, so the recomputed ones are the first
  // ones and the weights equal those of a run that keeps everything.
  const models::ModelSpec m = test::tiny_model_with_dropout(0.1, 0.1, 0.1);
  for (auto mode : {planner::Checkpointing::selective, planner::Checkpointing::selective_op})
    for (auto backend : {planner::Backend::cpu, planner::Backend::cuda})
      for (int stage : {0, 2, 3}) {
        CAPTURE(planner::to_string(mode));
        CAPTURE(planner::to_string(backend));
        CAPTURE(stage);
        std::vector<float> w[2];
        uint64_t act[2] = {0, 0};
        for (int selective : {0, 1}) {
          planner::Strategy s;
          s.stage = stage;
          s.precision = planner::Precision::bf16;
          s.checkpointing = selective ? mode : planner::Checkpointing::none;
          s.micro_batch = 2;
          s.seq = 32;
          const planner::Plan plan = planner::make_plan(m, s, {planner::Profile::zeroplan, backend}, 1234);
          act[selective] = plan.predicted[planner::Tier::gpu][planner::Category::activations];
          auto dev = device_for(plan);
          test::TempDir dir;
          std::vector<planner::TimelineSample> timeline;
          {
            Engine engine(plan, *dev, comm(), TokenData::load(""), {});
            for (int i = 0; i < 3; ++i) engine.step();
            engine.save_weights(dir.file("w.bin"));
            timeline = engine.timeline();
          }
          zp::test::check_memory_matches_plan(plan, *dev, timeline);
          w[selective] = read_floats(dir.file("w.bin"));
        }
        REQUIRE(w[1].size() == w[0].size());
        CHECK(std::memcmp(w[1].data(), w[0].data(), w[0].size() * 4) == 0);
        CHECK(act[1] < act[0]);  // and it saves memory
      }
}

