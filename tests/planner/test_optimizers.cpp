// The optimizers people pick to save memory (--optimizer sgd-plain, lion, adafactor,
// adam8bit): their spellings, their state bytes per tensor and per rank, how ZeRO's flat
// partitions and stage 0's whole tensors change them, and DeepSpeed's optimizer.type names.
// Expected bytes are the sources' formulas written out here, never read back from the code:
//   bitsandbytes (bitsandbytes/optim/optimizer.py, Optimizer2State.init_state, 0.44.0 and
//     later): a tensor of n < min_8bit_size = 4096 elements keeps two fp32 states (8n bytes);
//     a larger one two uint8 states and two fp32 absmax per 256-element block,
//     2n + 2*4*ceil(n/256);
//   transformers' Adafactor (src/transformers/optimization.py, beta1=None): exp_avg_sq_row
//     (shape[:-1]) and exp_avg_sq_col (shape[:-2] + shape[-1:]) in fp32 for 2+ dims, a full
//     fp32 exp_avg_sq for one, and state["RMS"], a 0-d fp32 tensor (4 bytes);
//   Lion (lion-pytorch, DeepSpeed's FusedLion): one exp_avg zeros_like the parameter;
//   torch.optim.SGD: momentum_buffer only with momentum != 0 (default 0).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "error_of.hpp"
#include "zp/models/graph.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/fit.hpp"
#include "zp/planner/model_states.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/simulate.hpp"
#include "zp/planner/hardware.hpp"
#include "zp/planner/strategy.hpp"

using namespace zp::planner;
using zp::models::load_model;
using zp::test::error_of;

namespace {

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// bitsandbytes' Adam8bit/AdamW8bit, one tensor of n elements.
uint64_t bnb8(uint64_t n) { return n < 4096 ? 2 * 4 * n : 2 * n + 2 * 4 * ceil_div(n, 256); }
// transformers' Adafactor, fp32 states (m = 4 bytes) unless given: a (r, c) matrix, a vector.
uint64_t adafactor2d(uint64_t r, uint64_t c, uint64_t m = 4) { return m * (r + c) + 4; }
uint64_t adafactor1d(uint64_t n, uint64_t m = 4) { return m * n + 4; }

uint64_t opt_bytes(OptimizerKind o, std::vector<int64_t> shape, uint64_t moment_bytes = 4) {
  return optimizer_state_bytes(o, shape, moment_bytes);
}

// The schedule's persistent optimizer buffers (position -1) on a tier, by name.
uint64_t state_bytes(const MemorySchedule& m, Tier t, const std::string& name = "") {
  uint64_t sum = 0;
  for (const MemEvent& e : m.events) {
    const MemBuffer& b = m.buffers[e.buffer];
    if (e.pos == -1 && e.alloc && b.tier == t && b.category == Category::optimizer &&
        (name.empty() || b.name == name))
      sum += b.bytes;
  }
  return sum;
}

MemorySchedule schedule(const std::string& model, Strategy s, Profile p = Profile::zeroplan) {
  const auto m = load_model(model);
  s.seq = 16;
  const PlanOptions o{p, Backend::cuda, ModelCode::fused};
  const auto g = zp::models::build_training_graph(m, graph_options(m, s, o));
  return build_schedule(g, s, o);
}

Strategy with(OptimizerKind o, int stage = 0, int64_t dp = 1) {
  Strategy s;
  s.optimizer = o;
  s.stage = stage;
  s.dp = dp;
  return s;
}

// gpt2-tiny as Hugging Face's GPT2LMHeadModel holds it (V=256, P=64, C=64, L=2, tied head;
// Conv1D weights stored (in, out)): shapes per tensor.
constexpr uint64_t C = 64, V = 256, P = 64, L = 2;
const std::vector<std::vector<uint64_t>> kGpt2TinyBlock = {
    {C}, {C},              // ln_1.weight, ln_1.bias
    {C, 3 * C}, {3 * C},   // attn.c_attn
    {C, C}, {C},           // attn.c_proj
    {C}, {C},              // ln_2
    {C, 4 * C}, {4 * C},   // mlp.c_fc
    {4 * C, C}, {C}};      // mlp.c_proj
std::vector<std::vector<uint64_t>> gpt2_tiny_tensors() {
  std::vector<std::vector<uint64_t>> t = {{V, C}, {P, C}};  // wte, wpe
  for (uint64_t l = 0; l < L; ++l) t.insert(t.end(), kGpt2TinyBlock.begin(), kGpt2TinyBlock.end());
  t.push_back({C});  // ln_f.weight
  t.push_back({C});  // ln_f.bias
  return t;
}
constexpr uint64_t kGpt2TinyParams = V * C + P * C + L * (12 * C * C + 13 * C) + 2 * C;

}  // namespace

TEST_CASE("optimizer spellings: --optimizer, strategy JSON, describe") {
  const std::vector<std::pair<std::string, OptimizerKind>> all = {
      {"adam", OptimizerKind::adam},           {"adamw", OptimizerKind::adamw},
      {"sgd", OptimizerKind::sgd},             {"sgd-plain", OptimizerKind::sgd_plain},
      {"lion", OptimizerKind::lion},           {"adafactor", OptimizerKind::adafactor},
      {"adam8bit", OptimizerKind::adam8bit}};
  for (const auto& entry : all) {
    const auto& [name, kind] = entry;
    CAPTURE(entry.first);
    CHECK(to_string(kind) == name);
    REQUIRE(optimizer_from_string(name).has_value());
    CHECK(*optimizer_from_string(name) == kind);
    const Strategy s = with(kind, 2, 4);
    CHECK(strategy_from_json(to_json(s), "plan.json") == s);
    CHECK(describe(s).find(", " + name + ",") != std::string::npos);
  }
  CHECK_FALSE(optimizer_from_string("adam8").has_value());
  CHECK_FALSE(optimizer_from_string("Lion").has_value());
  nlohmann::json j = to_json(Strategy{});
  j["optimizer"] = "adafactr";
  const std::string err = error_of([&] { strategy_from_json(j, "plan.json"); });
  CHECK(err.find("strategy.optimizer") != std::string::npos);
  CHECK(err.find("\"adam8bit\"") != std::string::npos);
}

TEST_CASE("optimizer_state_bytes: one tensor, from the sources' formulas") {
  // A (1024, 4096) weight.
  const uint64_t n = 1024 * 4096;
  CHECK(opt_bytes(OptimizerKind::adam8bit, {1024, 4096}) == 2 * n + 2 * 4 * ceil_div(n, 256));
  CHECK(opt_bytes(OptimizerKind::adam8bit, {1024, 4096}) == bnb8(n));
  CHECK(opt_bytes(OptimizerKind::adafactor, {1024, 4096}) == 4 * (1024 + 4096) + 4);
  CHECK(opt_bytes(OptimizerKind::lion, {1024, 4096}) == 4 * n);
  CHECK(opt_bytes(OptimizerKind::sgd, {1024, 4096}) == 4 * n);
  CHECK(opt_bytes(OptimizerKind::sgd_plain, {1024, 4096}) == 0);
  CHECK(opt_bytes(OptimizerKind::adam, {1024, 4096}) == 8 * n);
  CHECK(opt_bytes(OptimizerKind::adamw, {1024, 4096}) == 8 * n);
  // A 1000-element vector, under min_8bit_size: 8-bit keeps two fp32 states, 8 bytes each
  // element; Adafactor does not factor a vector.
  CHECK(opt_bytes(OptimizerKind::adam8bit, {1000}) == 8 * 1000);
  CHECK(opt_bytes(OptimizerKind::adafactor, {1000}) == 4 * 1000 + 4);
  // min_8bit_size's edge (p.numel() < 4096 is fp32) and a partial last block.
  CHECK(opt_bytes(OptimizerKind::adam8bit, {4095}) == 8 * 4095);
  CHECK(opt_bytes(OptimizerKind::adam8bit, {4096}) == 2 * 4096 + 8 * 16);
  CHECK(opt_bytes(OptimizerKind::adam8bit, {4097}) == 2 * 4097 + 8 * 17);
  CHECK(opt_bytes(OptimizerKind::adam8bit, {64, 64}) == 2 * 4096 + 8 * 16);  // shape-blind
  // Adafactor factors the last two dimensions of 3-D tensors: row (E, R), col (E, C).
  CHECK(opt_bytes(OptimizerKind::adafactor, {8, 28, 16}) == 4 * (8 * 28 + 8 * 16) + 4);
  // Moments in bf16 (--optimizer-states bf16): Lion's buffer, Adafactor's factors; 8-bit
  // Adam's uint8 states do not change.
  CHECK(opt_bytes(OptimizerKind::lion, {1024, 4096}, 2) == 2 * n);
  CHECK(opt_bytes(OptimizerKind::adafactor, {1024, 4096}, 2) == 2 * (1024 + 4096) + 4);
  CHECK(opt_bytes(OptimizerKind::adam8bit, {1024, 4096}, 2) == bnb8(n));
  CHECK(opt_bytes(OptimizerKind::adam8bit, {0}) == 0);
}

TEST_CASE("model_state_bytes: ZeRO stages 1-3 hand the optimizer one flat partition") {
  const uint64_t psi = 7'000'000'001, dp = 8;  // a partition that does not divide evenly
  const uint64_t part = ceil_div(psi, dp);
  for (int stage = 1; stage <= 3; ++stage) {
    CAPTURE(stage);
    Strategy s = with(OptimizerKind::adam8bit, stage, static_cast<int64_t>(dp));
    PerDevice d = model_state_bytes(psi, s);
    CHECK(d[Tier::gpu][Category::optimizer] == 2 * part + 2 * 4 * ceil_div(part, 256));
    CHECK(d[Tier::gpu][Category::master] == 4 * part);  // the fp32 master is unchanged
    // Adafactor on a 1-D partition is not factored: a full fp32 second moment, one RMS.
    s.optimizer = OptimizerKind::adafactor;
    CHECK(model_state_bytes(psi, s)[Tier::gpu][Category::optimizer] == 4 * part + 4);
    s.optimizer = OptimizerKind::lion;
    CHECK(model_state_bytes(psi, s)[Tier::gpu][Category::optimizer] == 4 * part);
    s.optimizer = OptimizerKind::sgd_plain;
    CHECK(model_state_bytes(psi, s)[Tier::gpu][Category::optimizer] == 0);
    s.optimizer = OptimizerKind::adam;  // unchanged: K = 12
    CHECK(model_state_bytes(psi, s)[Tier::gpu][Category::optimizer] == 8 * part);
  }
  // bf16 master and moments (DeepSpeed's bf16_master_weights_and_grads and
  // bf16_optimizer_states): Lion and Adafactor keep 2-byte moments, 8-bit ignores them.
  Strategy s = with(OptimizerKind::lion, 2, static_cast<int64_t>(dp));
  s.master_precision = Precision::bf16;
  s.optimizer_precision = Precision::bf16;
  CHECK(model_state_bytes(psi, s)[Tier::gpu][Category::optimizer] == 2 * part);
  s.optimizer = OptimizerKind::adafactor;
  CHECK(model_state_bytes(psi, s)[Tier::gpu][Category::optimizer] == 2 * part + 4);
  s.optimizer = OptimizerKind::adam8bit;
  CHECK(model_state_bytes(psi, s)[Tier::gpu][Category::optimizer] ==
        2 * part + 2 * 4 * ceil_div(part, 256));
  // ZeRO-Offload moves them to the host with the master.
  s = with(OptimizerKind::adam8bit, 2, static_cast<int64_t>(dp));
  s.offload_optimizer = Offload::cpu;
  const PerDevice d = model_state_bytes(psi, s);
  CHECK(d[Tier::gpu][Category::optimizer] == 0);
  CHECK(d[Tier::cpu][Category::optimizer] == 2 * part + 2 * 4 * ceil_div(part, 256));
  // Given per-tensor bytes (stage 0), they are taken as they are.
  CHECK(model_state_bytes(psi, psi, with(OptimizerKind::adafactor), StateLayout::zero,
                          uint64_t{12345})[Tier::gpu][Category::optimizer] == 12345);
}

TEST_CASE("schedule: stage 0 sizes Adafactor and 8-bit Adam per tensor (gpt2-tiny)") {
  const auto tensors = gpt2_tiny_tensors();
  uint64_t n = 0, adafactor = 0, eight = 0;
  for (const auto& t : tensors) {
    const uint64_t e = t.size() == 2 ? t[0] * t[1] : t[0];
    n += e;
    adafactor += t.size() == 2 ? adafactor2d(t[0], t[1]) : adafactor1d(t[0]);
    eight += bnb8(e);
  }
  REQUIRE(n == kGpt2TinyParams);
  for (const Profile p : {Profile::zeroplan, Profile::deepspeed}) {
    CAPTURE(to_string(p));
    MemorySchedule m = schedule("gpt2-tiny", with(OptimizerKind::adafactor, 0, 4), p);
    REQUIRE(m.n_params == kGpt2TinyParams);
    CHECK(state_bytes(m, Tier::gpu, "exp_avg_sq") == adafactor);
    CHECK(state_bytes(m, Tier::gpu) == adafactor);
    m = schedule("gpt2-tiny", with(OptimizerKind::adam8bit, 0, 4), p);
    CHECK(state_bytes(m, Tier::gpu, "exp_avg") == eight / 2);
    CHECK(state_bytes(m, Tier::gpu, "exp_avg_sq") == eight / 2);
    // Stage 2: the flat partition, ceil(Psi/dp) elements.
    m = schedule("gpt2-tiny", with(OptimizerKind::adam8bit, 2, 4), p);
    const uint64_t part = ceil_div(kGpt2TinyParams, 4);
    REQUIRE(m.partition_elems == part);
    CHECK(state_bytes(m, Tier::gpu) == bnb8(part));
    m = schedule("gpt2-tiny", with(OptimizerKind::adafactor, 2, 4), p);
    CHECK(state_bytes(m, Tier::gpu, "exp_avg_sq") == 4 * part + 4);
  }
  // Lion, SGD and plain SGD: one buffer, one buffer, none.
  MemorySchedule m = schedule("gpt2-tiny", with(OptimizerKind::lion, 1, 2));
  CHECK(state_bytes(m, Tier::gpu, "exp_avg") == 4 * ceil_div(kGpt2TinyParams, 2));
  CHECK(state_bytes(m, Tier::gpu, "exp_avg_sq") == 0);
  m = schedule("gpt2-tiny", with(OptimizerKind::sgd_plain, 1, 2));
  CHECK(state_bytes(m, Tier::gpu) == 0);
}

TEST_CASE("schedule: stage 0 per tensor on llama-2-7b, below Adam's 8 bytes per parameter") {
  // LLaMA-2-7B (V=32000, C=4096, F=11008, 32 layers, untied head, RMSNorm without bias).
  constexpr uint64_t V7 = 32000, C7 = 4096, F7 = 11008, L7 = 32;
  constexpr uint64_t psi = 2 * V7 * C7 + L7 * (4 * C7 * C7 + 3 * C7 * F7 + 2 * C7) + C7;
  const uint64_t adafactor =
      2 * adafactor2d(V7, C7) +
      L7 * (4 * adafactor2d(C7, C7) + 2 * adafactor2d(F7, C7) + adafactor2d(C7, F7) +
            2 * adafactor1d(C7)) +
      adafactor1d(C7);
  const uint64_t eight =  // every tensor has 4096 elements or more: all 8-bit
      2 * bnb8(V7 * C7) + L7 * (4 * bnb8(C7 * C7) + 3 * bnb8(C7 * F7) + 2 * bnb8(C7)) + bnb8(C7);
  MemorySchedule m = schedule("llama-2-7b", with(OptimizerKind::adafactor));
  REQUIRE(m.n_params == psi);
  CHECK(state_bytes(m, Tier::gpu) == adafactor);
  CHECK(adafactor < psi / 100);  // sublinear: about 0.01 byte per parameter
  m = schedule("llama-2-7b", with(OptimizerKind::adam8bit));
  CHECK(state_bytes(m, Tier::gpu) == eight);
  CHECK(state_bytes(m, Tier::gpu) < 8 * psi);
  // bf16 moments halve Adafactor's factors (torch.optim.Adafactor keeps the gradient's dtype).
  Strategy s = with(OptimizerKind::adafactor);
  s.master_precision = Precision::bf16;
  s.optimizer_precision = Precision::bf16;
  m = schedule("llama-2-7b", s);
  const uint64_t rms = 4 * (2 + L7 * 9 + 1);  // one 4-byte RMS per tensor
  CHECK(state_bytes(m, Tier::gpu) == (adafactor - rms) / 2 + rms);
}

TEST_CASE("schedule: the fsdp profile sizes each parameter's dim-0 shard; 8-bit is refused") {
  // FSDP2 (fully_shard) shards every parameter along dim 0, ceil(d0/W) rows on each rank;
  // with torchtitan's mixed precision the sharded parameters, and their states, are fp32.
  const uint64_t w = 4;
  uint64_t expected = 0;
  for (const auto& t : gpt2_tiny_tensors())
    expected += t.size() == 2 ? adafactor2d(ceil_div(t[0], w), t[1])
                              : adafactor1d(ceil_div(t[0], w));
  const MemorySchedule m = schedule("gpt2-tiny", with(OptimizerKind::adafactor, 3, 4), Profile::fsdp);
  CHECK(state_bytes(m, Tier::gpu, "exp_avg_sq") == expected);
  CHECK(error_of([&] {
          schedule("gpt2-tiny", with(OptimizerKind::adam8bit, 3, 4), Profile::fsdp);
        }).find("--optimizer adam8bit") != std::string::npos);
  // Lion has no foreach temporary (only AdamW's foreach sqrt is modelled).
  const MemorySchedule lion = schedule("gpt2-tiny", with(OptimizerKind::lion, 3, 4), Profile::fsdp);
  for (const MemBuffer& b : lion.buffers) CHECK(b.name != "foreach_sqrt");
}

TEST_CASE("NVMe: one swap file per state buffer") {
  Strategy s = with(OptimizerKind::adam8bit, 2, 2);
  CHECK(optimizer_swap_files(s) == 3);
  s.optimizer = OptimizerKind::adafactor;
  CHECK(optimizer_swap_files(s) == 2);
  s.optimizer = OptimizerKind::lion;
  CHECK(optimizer_swap_files(s) == 2);
  s.optimizer = OptimizerKind::sgd_plain;
  CHECK(optimizer_swap_files(s) == 1);
}

TEST_CASE("DeepSpeed optimizer.type: the types modelled, an error naming the rest") {
  auto type_of = [](const char* text) {
    return apply_deepspeed_config(Strategy{}, nlohmann::json::parse(text), "ds.json").optimizer;
  };
  CHECK(type_of(R"({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}})") == OptimizerKind::lion);
  CHECK(type_of(R"({"optimizer": {"type": "Adafactor"}})") == OptimizerKind::adafactor);
  CHECK(type_of(R"({"optimizer": {"type": "MuAdamW"}})") == OptimizerKind::adamw);
  // torch.optim.SGD's momentum defaults to 0: no state.
  CHECK(type_of(R"({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})") ==
        OptimizerKind::sgd_plain);
  CHECK(type_of(R"({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}})") ==
        OptimizerKind::sgd);
  for (const char* t : {"OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lamb", "Adagrad", "Muon"}) {
    CAPTURE(t);
    const std::string err = error_of([&] {
      apply_deepspeed_config(Strategy{}, nlohmann::json::parse(fmt::format(R"({{"optimizer": {{"type": "{}"}}}})", t)), "ds.json");
    });
    CHECK(err.find(fmt::format("optimizer.type '{}' is not modelled", t)) != std::string::npos);
  }
  // fit's --emit-deepspeed reads back to the same optimizer; 8-bit Adam is a client
  // optimizer (no optimizer section), and ZeRO needs zero_allow_untested_optimizer for it.
  for (OptimizerKind o : {OptimizerKind::adam, OptimizerKind::adamw, OptimizerKind::sgd,
                          OptimizerKind::sgd_plain, OptimizerKind::lion, OptimizerKind::adafactor}) {
    CAPTURE(to_string(o));
    const Strategy s = with(o, 2, 4);
    CHECK(apply_deepspeed_config(Strategy{}, deepspeed_config(s), "ds.json").optimizer == o);
  }
  const nlohmann::json ds = deepspeed_config(with(OptimizerKind::adam8bit, 2, 4));
  CHECK_FALSE(ds.contains("optimizer"));
  CHECK(ds["zero_allow_untested_optimizer"] == true);
  CHECK_FALSE(deepspeed_config(with(OptimizerKind::lion, 2, 4)).contains("zero_allow_untested_optimizer"));
}

TEST_CASE("the simulated GPU step streams each optimizer's own state bytes") {
  // simulate.cpp: the step on the GPU reads the 16-bit gradient, the master weights and the
  // states, and writes the master, the states and the 16-bit weights: (2 + 2) + 2 x (4 +
  // state) bytes per element in bf16 training, state = 8 for Adam (two fp32 moments), 0 for
  // plain SGD, 2 for 8-bit Adam's two uint8 states (the absmax blocks are below a byte per
  // element and left out), 4 for Lion's one moment. Its time is bytes over HBM bandwidth, so
  // the ratios of the step's seconds are the ratios of those bytes.
  const auto m = zp::models::load_model("gpt2-tiny");
  const Hardware hw = load_hardware("a100-80g");
  auto step_seconds = [&](OptimizerKind o) {
    Strategy s;
    s.seq = 64;
    s.optimizer = o;
    const auto g = zp::models::build_training_graph(m, graph_options(m, s, PlanOptions{}));
    const Timeline t = simulate(step_costs(g), s, hw, Cluster{1, 1});
    for (const Task& k : t.tasks)
      if (std::string(k.kind) == "gpu adam") return k.seconds;
    FAIL("no GPU optimizer step");
    return 0.0;
  };
  const double adam = step_seconds(OptimizerKind::adam);
  CHECK(step_seconds(OptimizerKind::sgd_plain) / adam == doctest::Approx((4.0 + 2 * 4) / (4 + 2 * 12)));
  CHECK(step_seconds(OptimizerKind::adam8bit) / adam == doctest::Approx((4.0 + 2 * 6) / (4 + 2 * 12)));
  CHECK(step_seconds(OptimizerKind::lion) / adam == doctest::Approx((4.0 + 2 * 8) / (4 + 2 * 12)));
}
