// The engine on a LLaMA-family decoder (a tiny LLaMA 3-style config: grouped-query attention of
// 4 query heads over 2 key/value heads, the llama3 rotary table, RMSNorm, SwiGLU, an untied head;
// and the same with Qwen2's q/k/v biases): the gradient of its first step equals the CPU-kernel
// reference (tests/support/llama_step.hpp, itself checked against PyTorch in
// test_llama_reference) tensor by tensor; stages 0-3 and full recomputation train the same
// weights; memory equals the plan op by op; and what the engine cannot run yet is refused.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine_fixture.hpp"
#include "llama_step.hpp"
#include "tiny_configs.hpp"
#include "process.hpp"
#include "zp/models/graph.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/plan.hpp"
#include "zp/runtime/data.hpp"
#include "zp/runtime/engine.hpp"
#include "zp/runtime/rope.hpp"

using namespace zp;
using namespace zp::runtime;
using zp::test::comm;
using zp::test::device_for;
using zp::test::tiny_config;
using zp::test::tiny_mistral;
using zp::test::tiny_moe;
using zp::test::tiny_qwen3;

namespace {


planner::Plan plan_for(const models::ModelSpec& m, int stage, planner::Checkpointing ck,
                       bool flash = false) {
  planner::Strategy s;
  s.flash_attention = flash;
  s.stage = stage;
  s.precision = planner::Precision::fp32;
  s.micro_batch = 2;
  s.seq = 16;
  s.optimizer = planner::OptimizerKind::sgd;
  s.checkpointing = ck;
  s.buffers.reduce_bucket_size = 5'000;  // several buckets
  return planner::make_plan(m, s, {planner::Profile::zeroplan, planner::Backend::cpu}, 1234);
}

struct Run {
  std::vector<float> w0, w1;
  std::vector<double> losses;
};

Run train(const planner::Plan& plan, int steps, float lr) {
  test::TempDir dir;
  auto dev = device_for(plan);
  Run r;
  std::vector<planner::TimelineSample> timeline;
  {
    EngineOptions opt;
    opt.lr = lr;
    Engine engine(plan, *dev, comm(), TokenData::load(""), opt);
    engine.save_weights(dir.file("w0.bin"));
    for (int i = 0; i < steps; ++i) r.losses.push_back(engine.step().loss);
    engine.save_weights(dir.file("w1.bin"));
    timeline = engine.timeline();
  }
  test::check_memory_matches_plan(plan, *dev, timeline);
  r.w0 = test::read_floats(dir.file("w0.bin"));
  r.w1 = test::read_floats(dir.file("w1.bin"));
  return r;
}

// Stage 0 with `base_ck`, then every stage (from `first`) with each recomputation in `cks`,
// and with the optimizer offloaded to the host (`offload`: stages 1-3, and the parameters too
// at stage 3), all train the bits of stage 0 (fp32: the same arithmetic). Returns stage 0's run.
Run check_same_bits(const models::ModelSpec& m, int steps, bool flash, int first,
                    std::initializer_list<planner::Checkpointing> cks, bool offload,
                    planner::Checkpointing base_ck = planner::Checkpointing::none) {
  const Run base = train(plan_for(m, 0, base_ck, flash), steps, 0.1f);
  auto same = [&](const planner::Plan& plan) {
    const Run r = train(plan, steps, 0.1f);
    CHECK(r.losses == base.losses);
    CHECK(std::memcmp(r.w1.data(), base.w1.data(), base.w1.size() * 4) == 0);
  };
  for (int stage = first; stage <= 3; ++stage)
    for (auto ck : cks) {
      CAPTURE(stage);
      CAPTURE(planner::to_string(ck));
      same(plan_for(m, stage, ck, flash));
    }
  for (int stage = 1; offload && stage <= 3; ++stage)
    for (bool params_too : {false, true}) {
      if (params_too && stage != 3) continue;
      CAPTURE(stage);
      CAPTURE(params_too);
      planner::Plan p = plan_for(m, stage, planner::Checkpointing::none, flash);
      p.strategy.offload_optimizer = planner::Offload::cpu;
      if (params_too) p.strategy.offload_param = planner::Offload::cpu;
      same(planner::make_plan(p.model, p.strategy, p.options, 1234));
    }
  return base;
}
constexpr std::initializer_list<planner::Checkpointing> kAllRecompute = {
    planner::Checkpointing::none, planner::Checkpointing::full, planner::Checkpointing::selective};

// torchtitan's per-op recomputation (dense models so far) computes q, k and v as three GEMMs
// where the others compute one over the fused weight: OpenBLAS may round a product of another
// shape differently, so it trains its own bits at every stage (selective-op at stage 0 is the
// base), within fp32 rounding of the fused runs' (max |difference| <= 1e-5 of the largest
// change; observed 1.5e-8 to 3e-8 against changes of 0.09 to 0.22).
void check_selective_op(const models::ModelSpec& m, int steps, bool flash, const Run& fused) {
  const Run sop = check_same_bits(m, steps, flash, 1, {planner::Checkpointing::selective_op}, false,
                                  planner::Checkpointing::selective_op);
  double worst = 0, moved = 0;
  for (std::size_t i = 0; i < fused.w1.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(sop.w1[i]) - fused.w1[i]));
    moved = std::max(moved, std::fabs(static_cast<double>(fused.w1[i]) - fused.w0[i]));
  }
  CHECK(moved > 1e-3);
  CHECK(worst <= 1e-5 * moved);
  MESSAGE("selective-op vs the fused projections: " << worst << " (largest change " << moved << ")");
}

// flash: the engine's attention is the fused kernel (cpu_flash.cpp); the reference stays the
// three steps.
void check_against_reference(const std::string& config, bool flash) {
  CAPTURE(flash);
  const models::ModelSpec m = models::parse_hf_config(config, "tiny.json");
  const planner::Plan plan = plan_for(m, 0, planner::Checkpointing::none, flash);
  // One SGD step from a zero momentum buffer: w1 = w0 - lr g. lr = 1024, a power of two, so
  // lr g is exact and g = (w0 - w1) / lr carries only w1's rounding divided by lr (with lr = 1
  // the RMSNorm weights, near 1, would lose 1.2e-7 absolute to it, 1e-4 of their gradients).
  constexpr float kLr = 1024.0f;
  const Run r = train(plan, 1, kLr);
  zp::testing::LlamaDims d{2, 16, m.n_embd, m.n_head, m.n_kv_head, m.head_dim, m.n_inner,
                           m.n_layer, m.vocab_size, m.qkv_bias, static_cast<float>(m.norm_eps),
                           m.window.size, m.qk_norm == models::QkNorm::head};
  if (m.is_moe()) {
    d.E = m.moe.n_experts;
    d.K = m.moe.top_k;
    d.Fe = m.moe.expert_inner;
    d.Fs = m.moe.shared_inner;
    d.shared_gate = m.moe.shared_gate;
    d.renorm = models::hf_topk_renorm(m);
    for (int64_t l = 0; l < m.n_layer; ++l) d.dense_layers |= m.moe.is_moe_layer(l) ? 0 : int64_t{1} << l;
    d.aux_coef = static_cast<float>(models::moe_aux_loss_coef(m));
  }
  const RopeTable tab = rope_table(m.rope, m.rotary_dim, m.n_positions);
  zp::testing::LlamaStep step(d, tab.inv_freq, tab.attention_factor);
  REQUIRE(step.n_params() == static_cast<int64_t>(r.w0.size()));
  // The engine's first micro-batch: rank 0, step 0, micro-step 0.
  std::vector<int32_t> tokens(32), targets(32);
  TokenData::load("").fill(tokens.data(), targets.data(), 2, 16, plan.seed, 0, 0, 0);
  const float loss = step.forward(r.w0.data(), tokens, targets);
  CHECK(std::fabs(loss - r.losses[0]) <= 1e-5 * loss);
  std::vector<float> want(r.w0.size(), 0.0f);
  step.backward(r.w0.data(), want.data());
  zp::testing::for_each_tensor(d, [&](int64_t off, int64_t n, const std::string& name) {
    double scale = 0, worst = 0;
    for (int64_t i = off; i < off + n; ++i) scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
    REQUIRE_MESSAGE(scale > 0, name << ": the reference gradient is zero");
    for (int64_t i = off; i < off + n; ++i)
      worst = std::max(worst, std::fabs((static_cast<double>(r.w0[i]) - r.w1[i]) / kLr - want[i]) / scale);
    CHECK_MESSAGE(worst <= 1e-4, name << ": worst error " << worst << " of the largest gradient");
    MESSAGE(name << ": worst error " << worst);
  });
}

}  // namespace

TEST_CASE("engine on a tiny LLaMA: the first step's gradient equals the kernel reference") {
  for (bool flash : {false, true}) check_against_reference(tiny_config(false), flash);
}

TEST_CASE("engine on a tiny Mistral (a sliding window): the first step's gradient equals the reference") {
  const models::ModelSpec m = models::parse_hf_config(tiny_mistral(), "tiny.json");
  REQUIRE(m.window.size == 5);
  for (bool flash : {false, true}) check_against_reference(tiny_mistral(), flash);
}

TEST_CASE("engine on a tiny Qwen2 (q/k/v biases): the first step's gradient equals the reference") {
  for (bool flash : {false, true}) check_against_reference(tiny_config(true), flash);
}

TEST_CASE("engine on a tiny Qwen3 (per-head q/k norms): the first step's gradient equals the reference") {
  const models::ModelSpec m = models::parse_hf_config(tiny_qwen3(), "tiny.json");
  REQUIRE(m.qk_norm == models::QkNorm::head);
  for (bool flash : {false, true}) check_against_reference(tiny_qwen3(), flash);
  // Stages and recomputation: the bits of stage 0; per-op recomputation (the norms read q and
  // k from their own projections) within fp32 rounding.
  const Run base = check_same_bits(m, 3, false, 1, {planner::Checkpointing::full,
                                                    planner::Checkpointing::selective}, false);
  check_selective_op(m, 3, false, base);
}

TEST_CASE("engine on tiny Mixtral, Qwen2-MoE and Qwen3-MoE: the first step's gradient equals the reference") {
  for (const char* type : {"mixtral", "qwen2_moe", "qwen3_moe"}) {
    CAPTURE(type);
    const models::ModelSpec m = models::parse_hf_config(tiny_moe(type), "tiny.json");
    REQUIRE(m.is_moe());
    CHECK(models::moe_aux_loss_coef(m) > 0);
    for (bool flash : {false, true}) check_against_reference(tiny_moe(type), flash);
  }
  // The shapes the fixtures have: Qwen2-MoE's dense first layer, gated shared expert, biases.
  const models::ModelSpec q = models::parse_hf_config(tiny_moe("qwen2_moe"), "tiny.json");
  CHECK(!q.moe.is_moe_layer(0));
  CHECK(q.moe.is_moe_layer(1));
  CHECK(q.moe.shared_gate);
  CHECK(q.moe.shared_inner == 40);
  CHECK(q.qkv_bias);
  CHECK(!models::hf_topk_renorm(q));
}

TEST_CASE("engine on a tiny Mixtral: stages 0-3, recomputation and offload train the same weights") {
  const models::ModelSpec m = models::parse_hf_config(tiny_moe("mixtral"), "tiny.json");
  const Run base = check_same_bits(m, 4, false, 0, kAllRecompute, true);
  CHECK(base.losses.back() < base.losses.front());  // it trains
  // Per-op recomputation: the router's int64 top-k indices and weights read back where the
  // forward left them, the probabilities recomputed.
  check_selective_op(m, 4, false, base);
}

TEST_CASE("engine on a tiny LLaMA: stages 0-3, full recomputation and offload train the same weights") {
  // ZeRO-Offload too (the optimizer's states and step on the host, and the parameters at
  // stage 3): fp32, so the same step as on the device, bit for bit.
  const models::ModelSpec m = models::parse_hf_config(tiny_config(false), "tiny.json");
  const Run base = check_same_bits(m, 4, false, 0, kAllRecompute, true);
  CHECK(base.losses.back() < base.losses.front());  // it trains
  check_selective_op(m, 4, false, base);
  // Qwen2's q/k/v biases: per-op recomputation slices each projection's rows and bias.
  const models::ModelSpec q = models::parse_hf_config(tiny_config(true), "tiny.json");
  check_selective_op(q, 3, false, train(plan_for(q, 0, planner::Checkpointing::none), 3, 0.1f));
}

TEST_CASE("engine on a tiny LLaMA with flash attention: stages 0-3 and recomputation train the same weights") {
  // Flash attention keeps no T x T tensor, so selective recomputation has nothing to redo and
  // full recomputation reruns the fused kernel: every combination trains the bits of stage 0.
  // Against the three-step attention the weights agree to fp32 rounding (not bits: the sums
  // run in another order).
  const models::ModelSpec m = models::parse_hf_config(tiny_mistral(), "tiny.json");
  const Run three = train(plan_for(m, 0, planner::Checkpointing::none), 4, 0.1f);
  const Run base = check_same_bits(m, 4, true, 0, kAllRecompute, false);
  check_selective_op(m, 4, true, base);
  double worst = 0, moved = 0;
  for (std::size_t i = 0; i < base.w1.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(base.w1[i]) - three.w1[i]));
    moved = std::max(moved, std::fabs(static_cast<double>(three.w1[i]) - three.w0[i]));
  }
  CHECK(moved > 1e-3);              // the four steps changed the weights
  CHECK(worst <= 1e-5 * moved);     // and flash changed them the same way
  MESSAGE("flash vs three steps after 4 steps: " << worst << " (largest change " << moved << ")");
  for (std::size_t k = 0; k < base.losses.size(); ++k)
    CHECK(std::fabs(base.losses[k] - three.losses[k]) <= 1e-6 * three.losses[k]);
}

TEST_CASE("the engine refuses LLaMA-family models and settings it cannot run yet, naming why") {
  auto refuses = [](const std::string& config, planner::Backend backend, const std::string& why) {
    CAPTURE(why);
    const models::ModelSpec m = models::parse_hf_config(config, "x.json");
    planner::Strategy s;
    s.precision = planner::Precision::fp32;
    s.micro_batch = 1;
    s.seq = 16;
    const planner::Plan plan = planner::make_plan(m, s, {planner::Profile::zeroplan, backend}, 1234);
    auto dev = device_for(plan);
    try {
      Engine engine(plan, *dev, comm(), TokenData::load(""), {});
      FAIL("not refused");
    } catch (const Error& e) {
      CHECK_MESSAGE(std::string(e.what()).find(why) != std::string::npos, e.what());
    }
  };
  const std::string base = tiny_config(false);
  std::string dropout = base;
  dropout.insert(dropout.size() - 1, R"(, "attention_dropout": 0.1)");
  refuses(dropout, planner::Backend::cpu, "attention dropout");
  std::string longrope = base;
  longrope.replace(longrope.find("\"llama3\""), 8, "\"longrope\"");
  refuses(longrope, planner::Backend::cpu, "longrope");

  // Expert parallelism runs at stages 0-3 on the cpu backend so far (test_launcher runs it),
  // with the optimizer and the parameters offloaded to the host or NVMe.
  const models::ModelSpec moe = models::parse_hf_config(tiny_moe("mixtral"), "x.json");
  planner::Strategy s;
  s.dp = 2;
  s.ep = 2;
  s.seq = 16;
  s.moe_routing = planner::MoeRouting::worst;
  for (int stage : {0, 1, 2, 3}) {
    CAPTURE(stage);
    s.stage = stage;
    const planner::Plan plan = planner::make_plan(moe, s, {planner::Profile::zeroplan, planner::Backend::cpu}, 1);
    CHECK_NOTHROW(Engine::check(plan, "cpu", 2));
    CHECK_THROWS_WITH_AS(Engine::check(plan, "cuda", 2), doctest::Contains("NCCL's is not written yet"), Error);
  }
  s.offload_optimizer = planner::Offload::cpu;
  CHECK_NOTHROW(Engine::check(planner::make_plan(moe, s, {planner::Profile::zeroplan, planner::Backend::cpu}, 1), "cpu", 2));
  s.offload_param = planner::Offload::nvme;
  s.offload_optimizer = planner::Offload::nvme;
  CHECK_NOTHROW(Engine::check(planner::make_plan(moe, s, {planner::Profile::zeroplan, planner::Backend::cpu}, 1), "cpu", 2));
}

TEST_CASE("engine on the planner's cuda graph in 16 bits (LLaMA, Mistral + flash, Qwen3, MoE): "
          "memory equals the plan, losses within 16-bit rounding of fp32") {
  // The graph made for GPUs (Backend::cuda): activations, weights and gradients stored in
  // bf16 or fp16, every kernel rounding its outputs once (test_cpu_kernels16 holds each to
  // that), the LM head's logits fp32. Against the cpu graph in fp32 from the same seed, three
  // SGD steps: the loss (near ln 256 = 5.5) is a mean over 32 tokens of terms each computed
  // through ~two dozen rounded tensors, whose independent errors of at most u (2^-8 bf16,
  // 2^-11 fp16) mostly cancel in the mean; it must stay within u of fp32's, relative (0.4%
  // bf16, 0.05% fp16; observed at most 0.02 u bf16, 0.07 u fp16). The three steps lower the
  // loss by ~4% (10 u bf16), and a kernel that drops or doubles a term moves it by O(1).
  struct Case {
    const char* name;
    std::string config;
    bool flash;
  };
  const Case cases[] = {{"llama", tiny_config(false), false},
                        {"llama flash", tiny_config(false), true},
                        {"mistral flash", tiny_mistral(), true},
                        {"qwen3", tiny_qwen3(), false},
                        {"mixtral", tiny_moe("mixtral"), false},
                        {"qwen2_moe flash", tiny_moe("qwen2_moe"), true},
                        {"qwen3_moe", tiny_moe("qwen3_moe"), false}};
  for (const Case& c : cases)
    for (auto prec : {planner::Precision::bf16, planner::Precision::fp16}) {
      CAPTURE(c.name);
      CAPTURE(planner::to_string(prec));
      const models::ModelSpec m = models::parse_hf_config(c.config, "tiny.json");
      const planner::Plan fp32 = plan_for(m, 0, planner::Checkpointing::none, c.flash);
      planner::Strategy s = fp32.strategy;
      s.precision = prec;
      for (int stage : {0, 3}) {
        CAPTURE(stage);
        s.stage = stage;
        const planner::Plan p16 =
            planner::make_plan(m, s, {planner::Profile::zeroplan, planner::Backend::cuda}, 1234);
        const Run a = train(fp32, 3, 0.1f), b = train(p16, 3, 0.1f);  // train() checks memory
        const double u = prec == planner::Precision::bf16 ? 0x1.0p-8 : 0x1.0p-11;
        double worst = 0;
        for (std::size_t k = 0; k < a.losses.size(); ++k) {
          const double rel = std::fabs(b.losses[k] - a.losses[k]) / a.losses[k];
          worst = std::max(worst, rel);
          CHECK(rel <= u);
        }
        CHECK(b.losses.back() < b.losses.front());
        MESSAGE(std::string(c.name) << " " << planner::to_string(prec) << " stage " << stage
                       << ": loss within " << worst / u << " u of fp32's (" << a.losses.back()
                       << " vs " << b.losses.back() << ")");
      }
    }
}
