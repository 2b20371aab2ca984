// Mixture of experts in the planner: expert parallelism (--ep), DeepSpeed-MoE's ZeRO grouping
// (expert parameters partitioned over the dp/ep expert-data-parallel ranks, the rest over dp),
// the routed rows (--moe-routing), the all-to-all buffers and times, the fit search over ep,
// and the strategy's new fields. Every expected value is worked out here by hand from a small
// Mixtral config written below (its tensors counted from the Mixtral architecture, not from
// the inventory), never read back from the program.
#include <doctest/doctest.h>

#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "error_of.hpp"
#include "zp/error.hpp"
#include "zp/models/graph.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/allocator.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/fit.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/simulate.hpp"

using namespace zp::planner;

namespace {

// Mixtral, 2 layers of C=64, 4 heads (HS=16) with 2 key/value heads, 4 routed experts of
// width F=128, top-2, V=100, untied head, no biases.
constexpr const char* kConfig =
    R"({"model_type":"mixtral","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,)"
    R"("num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"num_local_experts":4,)"
    R"("num_experts_per_tok":2,"max_position_embeddings":64,"tie_word_embeddings":false})";

constexpr uint64_t C = 64, F = 128, V = 100, L = 2, E = 4, K = 2, KV = 2 * 16;
constexpr uint64_t kEmbed = V * C;                                  // embed_tokens
constexpr uint64_t kAttn = C * C + KV * C + KV * C + C * C;         // q, k, v, o
constexpr uint64_t kDenseBlock = kAttn + 2 * C + E * C;             // + 2 RMSNorms + router
constexpr uint64_t kExpert = 3 * F * C;                             // w1, w3 (F x C), w2 (C x F)
constexpr uint64_t kHead = V * C + C;                               // lm_head + final norm
constexpr uint64_t kDense = kEmbed + L * kDenseBlock + kHead;       // 38208
constexpr uint64_t kTotal = kDense + L * E * kExpert;               // 234816

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

zp::models::ModelSpec moe_model() { return zp::models::parse_hf_config(kConfig, "moe-tiny"); }

Strategy moe_strategy(int stage, int64_t dp, int64_t ep, int64_t B = 1, int64_t T = 16) {
  Strategy s;
  s.stage = stage;
  s.dp = dp;
  s.ep = ep;
  s.micro_batch = B;
  s.seq = T;
  return s;
}

struct Built {
  zp::models::TrainingGraph graph;
  MemorySchedule sched;
};
Built build(const Strategy& s) {
  const auto m = moe_model();
  Built b;
  b.graph = zp::models::build_training_graph(m, graph_options(m, s, {}));
  b.sched = build_schedule(b.graph, s, {});
  return b;
}

const zp::models::Tensor* find_tensor(const zp::models::TrainingGraph& g, const std::string& name) {
  for (const auto& t : g.tensors)
    if (t.name == name) return &t;
  return nullptr;
}

using zp::test::error_of;

}  // namespace

TEST_CASE("moe: the hand count of the small Mixtral matches the model's inventory") {
  const auto inv = zp::models::count_params(moe_model());
  CHECK(kDense == 38208);
  CHECK(inv.total == static_cast<int64_t>(kTotal));
  CHECK(inv.experts == static_cast<int64_t>(L * E * kExpert));
  // A token passes K of the E experts of each layer.
  CHECK(inv.active == static_cast<int64_t>(kDense + L * K * kExpert));
}

TEST_CASE("moe: expert parameters are ZeRO-partitioned over dp/ep, the rest over dp") {
  for (int64_t dp : {4, 6, 8}) {
    for (int64_t ep : {1, 2, 4}) {
      if (dp % ep != 0) continue;
      for (int stage : {1, 2, 3}) {
        CAPTURE(dp);
        CAPTURE(ep);
        CAPTURE(stage);
        const Strategy s = moe_strategy(stage, dp, ep);
        const Built b = build(s);
        const uint64_t d = static_cast<uint64_t>(dp), edp = d / static_cast<uint64_t>(ep);
        // Each rank holds E/ep experts of each layer.
        const uint64_t local = E / static_cast<uint64_t>(ep) * kExpert;  // per layer
        CHECK(b.sched.n_params == kDense + L * local);
        CHECK(b.sched.n_expert_params == L * local);
        // Stages 1-2: two flat buffers (DeepSpeed's dense and expert param groups), each
        // padded to its own group; stage 3: each gather group's dense and expert parts.
        const uint64_t part =
            stage < 3 ? ceil_div(kDense, d) + ceil_div(L * local, edp)
                      : ceil_div(kEmbed, d) + L * (ceil_div(kDenseBlock, d) + ceil_div(local, edp)) +
                            ceil_div(kHead, d);
        CHECK(b.sched.partition_elems == part);
        CHECK(b.sched.expert_partition_elems == part - (stage < 3 ? ceil_div(kDense, d)
                                                                  : ceil_div(kEmbed, d) +
                                                                        L * ceil_div(kDenseBlock, d) +
                                                                        ceil_div(kHead, d)));
        // Written a second way where everything divides: a rank owns 1/dp of the dense states
        // and E/dp experts' worth of expert states, whatever ep is (DeepSpeed-MoE sec. 4:
        // ep x edp = dp ranks share each expert's states).
        if (stage < 3 && kDense % d == 0 && (L * E * kExpert) % d == 0)
          CHECK(b.sched.partition_elems == kDense / d + L * E * kExpert / d);
        // The bytes per state on the gpu (bf16 + Adam; arena blocks of 256 bytes).
        const auto r = replay(b.sched, {});
        const auto& gpu = r.per_device[Tier::gpu];
        const uint64_t held_p = stage >= 3 ? part : b.sched.n_params;
        const uint64_t held_g = stage >= 2 ? part : b.sched.n_params;
        CHECK(gpu[Category::params] == round_up(2 * held_p, 256));
        CHECK(gpu[Category::grads] == round_up(2 * held_g, 256));
        CHECK(gpu[Category::master] == round_up(4 * part, 256));
        CHECK(gpu[Category::optimizer] == 2 * round_up(4 * part, 256));
      }
    }
  }
  // The ZeRO-3 gathered buffer of a block: its dense part from dp shards, its experts from
  // dp/ep shards (dp 6, ep 2: dense ceil(12672/6) x 6, experts 2 x 24576 / 3 x 3).
  const Built b = build(moe_strategy(3, 6, 2));
  uint64_t gathered = 0;
  for (const auto& buf : b.sched.buffers)
    if (buf.name == "gathered.h.0") gathered = buf.bytes;
  CHECK(gathered == 2 * (ceil_div(kDenseBlock, 6) * 6 + ceil_div(2 * kExpert, 3) * 3));
}

TEST_CASE("moe: partition_elems with expert groups, worked by hand") {
  // Groups of 10 and 7 elements, 4 and 0 of them expert; dp 4, edp 2.
  CHECK(partition_elems({10, 7}, {4, 0}, 2, 4, 2) == ceil_div(6 + 7, 4) + ceil_div(4, 2));
  CHECK(partition_elems({10, 7}, {4, 0}, 3, 4, 2) == ceil_div(6, 4) + ceil_div(4, 2) + ceil_div(7, 4));
  CHECK(partition_elems({10, 7}, {4, 0}, 0, 4, 2) == 0);
  // No experts: the dense formula.
  CHECK(partition_elems({10, 7}, {0, 0}, 3, 4, 4) == partition_elems({10, 7}, 3, 4));
  CHECK(partition_elems({10, 7}, {0, 0}, 1, 4, 4) == partition_elems({10, 7}, 1, 4));
}

TEST_CASE("moe: balanced and worst-case routed rows") {
  const auto m = moe_model();
  const int64_t B = 2, T = 16, tokens = B * T;
  for (int64_t ep : {1, 2, 4}) {
    for (MoeRouting routing : {MoeRouting::balanced, MoeRouting::worst}) {
      CAPTURE(ep);
      Strategy s = moe_strategy(2, 4, ep, B, T);
      s.moe_routing = routing;
      const auto go = graph_options(m, s, {});
      CHECK(go.ep == ep);
      CHECK(go.moe_worst_case == (routing == MoeRouting::worst));
      const auto g = zp::models::build_training_graph(m, go);
      const auto* xe = find_tensor(g, "h.0.moe.dispatch");
      REQUIRE(xe != nullptr);
      // Balanced: the k copies of this rank's tokens. Worst (ep > 1): every token of the ep
      // ranks sends this rank as many of its k choices as it has experts (E/ep).
      const int64_t local = static_cast<int64_t>(E) / ep;
      const int64_t rows = routing == MoeRouting::worst && ep > 1
                               ? ep * tokens * std::min<int64_t>(K, local)
                               : static_cast<int64_t>(K) * tokens;
      CHECK(xe->shape == std::vector<int64_t>{rows, static_cast<int64_t>(C)});
    }
  }
  // The numbers: 64 rows balanced; 128 at worst with ep 2 (2 x 32 tokens x 2) and ep 4
  // (4 x 32 x 1).
  Strategy s = moe_strategy(2, 4, 2, B, T);
  s.moe_routing = MoeRouting::worst;
  auto g = zp::models::build_training_graph(m, graph_options(m, s, {}));
  CHECK(find_tensor(g, "h.1.moe.dispatch")->shape.front() == 128);
  s.moe_routing = MoeRouting::balanced;
  g = zp::models::build_training_graph(m, graph_options(m, s, {}));
  CHECK(find_tensor(g, "h.1.moe.dispatch")->shape.front() == 64);
  // Worst-case routing holds more activations.
  Strategy w = moe_strategy(2, 4, 2, B, T);
  w.moe_routing = MoeRouting::worst;
  CHECK(estimate(m, w, nullptr).per_device[Tier::gpu][Category::activations] >
        estimate(m, s, nullptr).per_device[Tier::gpu][Category::activations]);
}

TEST_CASE("moe: DeepSpeed's capacity factor fixes the dispatched rows and adds its gating") {
  const auto m = moe_model();
  const int64_t B = 2, T = 16, tokens = B * T;
  // capacity = max(4, ceil(k * tokens * cf / E)) rows per expert (sharded_moe.py _capacity with
  // capacity_factor * k): 2 * 32 * 1.25 / 4 = 20; with cf 0.1: ceil(1.6) = 2, raised to 4.
  for (const auto& c : {std::pair{1.25, int64_t{20}}, std::pair{0.1, int64_t{4}}}) {
    const auto& [cf, cap] = c;
    CAPTURE(c.first);
    for (int64_t ep : {1, 2}) {
      Strategy s = moe_strategy(2, 4, ep, B, T);
      s.moe_capacity_factor = cf;
      s.moe_routing = MoeRouting::worst;  // no effect: the capacity bounds every expert
      const auto go = graph_options(m, s, {});
      CHECK(zp::models::moe_capacity(m, go, tokens) == cap);
      const auto g = zp::models::build_training_graph(m, go);
      // Each rank's experts take E/ep experts x (ep ranks x capacity) rows = E x capacity.
      CHECK(find_tensor(g, "h.0.moe.dispatch")->shape ==
            std::vector<int64_t>{static_cast<int64_t>(E) * cap, static_cast<int64_t>(C)});
      // The einsum gating's (S, E, capacity) mask and weights, in the activation type.
      const auto* mask = find_tensor(g, "h.1.moe.dispatch_mask");
      REQUIRE(mask != nullptr);
      CHECK(mask->shape == std::vector<int64_t>{tokens, static_cast<int64_t>(E), cap});
      CHECK(mask->bytes == uint64_t(tokens) * E * uint64_t(cap) * 2);
      CHECK(find_tensor(g, "h.1.moe.combine_weights")->bytes == mask->bytes);
      // The all-to-all exchanges that dispatched tensor: E x capacity rows of C.
      const Built b = build(s);
      for (const auto& buf : b.sched.buffers)
        if (buf.name.rfind("a2a.", 0) == 0) CHECK(buf.bytes == E * uint64_t(cap) * C * 2);
    }
  }
  // Dropless models hold neither gating tensor.
  const auto g = zp::models::build_training_graph(m, graph_options(m, moe_strategy(2, 4, 1), {}));
  CHECK(find_tensor(g, "h.0.moe.dispatch_mask") == nullptr);
  // A negative or non-finite factor, or one on a dense model, is refused naming the flag.
  Strategy bad = moe_strategy(2, 4, 1);
  bad.moe_capacity_factor = -1;
  CHECK(error_of([&] { validate(bad); }).find("--moe-capacity-factor") != std::string::npos);
  Strategy dense;
  dense.moe_capacity_factor = 1;
  CHECK(error_of([&] { (void)estimate(zp::models::load_model("gpt2"), dense, nullptr); })
            .find("--moe-capacity-factor: gpt2 is a dense model") != std::string::npos);
  // fit's evaluator keys its shapes by the factor too: one evaluator, both factors, each equal
  // to its own estimate.
  FitEvaluator ev(m, PlanOptions{});
  for (double cf : {0.0, 1.25, 0.0}) {
    Strategy c = moe_strategy(2, 4, 2, B, T);
    c.moe_capacity_factor = cf;
    CAPTURE(cf);
    CHECK(ev.memory(resolve_for_model(c, m)) == estimate(m, c, nullptr).per_device);
  }
  // It survives the plan file's JSON.
  Strategy j = moe_strategy(3, 8, 2);
  j.moe_capacity_factor = 1.25;
  CHECK(strategy_from_json(to_json(j), "plan.json") == j);
}

TEST_CASE("moe: the all-to-all send and receive buffers of each MoE layer") {
  const uint64_t B = 2, T = 16;
  // One buffer of this rank's k*B*T routed rows of C bf16 activations per exchange.
  const uint64_t bytes = K * B * T * C * 2;
  for (Checkpointing ck : {Checkpointing::none, Checkpointing::full}) {
    for (int64_t ep : {1, 2}) {
      CAPTURE(ep);
      Strategy s = moe_strategy(2, 4, ep, B, T);
      s.checkpointing = ck;
      const Built b = build(s);
      std::set<std::string> names;
      for (const auto& buf : b.sched.buffers)
        if (buf.name.rfind("a2a.", 0) == 0) {
          CHECK(buf.bytes == bytes);
          CHECK(buf.category == Category::buffers);
          names.insert(buf.name);
        }
      // Per MoE layer: dispatch and combine forward, again when recomputed, and their
      // backward ops; none without expert parallelism.
      const std::size_t per_layer = ck == Checkpointing::full ? 6 : 4;
      CHECK(names.size() == (ep > 1 ? L * per_layer : 0));
      if (ep > 1) {
        CHECK(names.contains("a2a.h.0.moe.dispatch"));
        CHECK(names.contains("a2a.h.1.moe.combine.bwd"));
      }
    }
  }
}

TEST_CASE("moe: all-to-all times and the expert gradients' reduction, worked by hand") {
  const Hardware hw = load_hardware("h100-80g");
  // Bandwidth: NVLink inside a node (ep x mp GPUs), else a GPU's share of the node's NICs.
  CHECK(alltoall_gbps(hw, 8, 1, Cluster{64, 8}) == hw.nvlink_gbps);
  CHECK(alltoall_gbps(hw, 16, 1, Cluster{64, 8}) == 400.0 / 8);
  CHECK(alltoall_gbps(hw, 4, 4, Cluster{64, 8}) == 400.0 / 8);
  CHECK(alltoall_gbps(hw, 16, 1, Cluster{16, 1}) == hw.nvlink_gbps);  // one node (made up)
  CHECK(alltoall_seconds(1e9, 4, 50) == doctest::Approx(0.75e9 / 50e9));
  CHECK(alltoall_seconds(1e9, 1, 50) == 0);

  const int64_t B = 2, T = 16, dp = 4, ep = 2;
  const Strategy s = moe_strategy(2, dp, ep, B, T);
  const Built b = build(s);
  const StepCosts c = step_costs(b.graph);
  // Forward: dispatch + combine, each moving the R = k*B*T routed rows of C bf16 values.
  const double rows_bytes = double(K) * B * T * C * 2;
  CHECK(c.a2a_fwd_bytes[1] == 2 * rows_bytes);  // group 1 = h.0
  CHECK(c.a2a_bwd_bytes[2] == 2 * rows_bytes);  // h.1, backward
  CHECK(c.a2a_fwd_bytes[0] == 0);               // embed
  CHECK(c.n_expert_params == L * (E / ep) * kExpert);

  const Cluster cl{dp, 1};
  const Timeline t = simulate(c, s, hw, cl);
  // Each all-to-all keeps 1/ep of the rows and sends the rest over NVLink.
  const double a2a = 2 * rows_bytes * double(ep - 1) / double(ep) / (hw.nvlink_gbps * 1e9);
  int n_a2a = 0;
  double rs = -1;
  for (const Task& k : t.tasks) {
    if (k.step != 1) continue;
    if (std::string(k.kind) == "all-to-all") {
      ++n_a2a;
      CHECK(k.seconds == doctest::Approx(a2a).epsilon(1e-12));
      CHECK(k.resource == Resource::gpu);
    }
    if (std::string(k.kind) == "reduce-scatter") rs = k.seconds;
  }
  CHECK(n_a2a == 2 * static_cast<int>(L));  // forward and backward of each MoE layer
  // Stage 2, one bucket (500M elements): the dense gradients reduce-scattered over dp ranks,
  // the experts' over dp/ep, both on NVLink (one node).
  const double dense_bytes = 2.0 * kDense, expert_bytes = 2.0 * L * (E / ep) * kExpert;
  const double expect_rs = dense_bytes * (dp - 1) / dp / (hw.nvlink_gbps * 1e9) +
                           expert_bytes * (dp / ep - 1) / (dp / ep) / (hw.nvlink_gbps * 1e9);
  CHECK(rs == doctest::Approx(expect_rs).epsilon(1e-12));
  // Without expert parallelism there is no all-to-all.
  const Strategy s1 = moe_strategy(2, dp, 1, B, T);
  const Timeline t1 = simulate(step_costs(build(s1).graph), s1, hw, cl);
  for (const Task& k : t1.tasks) CHECK(std::string(k.kind) != "all-to-all");
}

TEST_CASE("moe: fit searches the expert-parallel degrees and names the winner's") {
  FitRequest r;
  r.model = moe_model();
  r.hw = load_hardware("h100-80g");
  r.gpus = 4;
  r.base.seq = 16;
  r.stages = {2};
  r.offload_optimizer = {Offload::none};
  r.offload_param = {Offload::none};
  r.micro_batches = {1};
  r.checkpointing = {Checkpointing::none};
  r.dpu = {false};
  r.overlap_comm = {false};
  r.mps = {1};
  r.top = 10;
  const FitResult f = fit(r);
  // Divisors of dp 4 that divide the 4 experts: 1, 2, 4.
  CHECK(f.n_searched == 3);
  std::set<int64_t> eps;
  for (const Candidate& c : f.candidates) eps.insert(c.strategy.ep);
  CHECK(eps == std::set<int64_t>{1, 2, 4});
  // Best first, and the winner's ep in its strategy JSON, its description and its notes.
  for (std::size_t i = 1; i < f.candidates.size(); ++i)
    CHECK(f.candidates[i - 1].tokens_per_second >= f.candidates[i].tokens_per_second * 0.999);
  const Strategy& win = f.candidates.front().strategy;
  CHECK(to_json(win)["ep"] == win.ep);
  const auto j = to_json(f, r);
  CHECK(j["candidates"][0]["strategy"]["ep"] == win.ep);
  CHECK(j["model"]["moe"]["experts"] == E);
  // The ep values cost differently (all-to-alls, expert reductions): the search is a choice.
  std::set<double> steps;
  for (const Candidate& c : f.candidates) steps.insert(c.step_seconds);
  CHECK(steps.size() == 3);
  // A pinned degree is the only one searched; a dense model searches ep 1 only.
  r.eps = {2};
  const FitResult p = fit(r);
  CHECK(p.n_searched == 1);
  CHECK(p.candidates.front().strategy.ep == 2);
  Strategy ep2 = win;
  ep2.ep = 2;
  bool named = false;
  for (const std::string& n : deepspeed_notes(ep2)) named = named || n.find("ep_size=2") != std::string::npos;
  CHECK(named);
  r.eps = {};
  r.model = zp::models::load_model("gpt2-tiny");
  const FitResult d = fit(r);
  CHECK(d.n_searched == 1);
  CHECK(d.candidates.front().strategy.ep == 1);
}

TEST_CASE("moe: fit's cached memory equals estimate() for every ep and stage") {
  const auto m = moe_model();
  FitEvaluator ev(m, {});
  for (int stage : {0, 1, 2, 3})
    for (int64_t ep : {1, 2, 4})
      for (MoeRouting routing : {MoeRouting::balanced, MoeRouting::worst}) {
        CAPTURE(stage);
        CAPTURE(ep);
        Strategy s = moe_strategy(stage, 8, ep);
        s.moe_routing = routing;
        CHECK(ev.memory(s) == estimate(m, s, nullptr).per_device);
      }
}

TEST_CASE("moe: strategy fields, validation and JSON") {
  Strategy s = moe_strategy(3, 8, 4);
  s.moe_routing = MoeRouting::worst;
  const auto j = to_json(s);
  CHECK(j["ep"] == 4);
  CHECK(j["moe_routing"] == "worst");
  CHECK(j["target_seq"] == 0);
  CHECK(strategy_from_json(j, "t") == s);
  // Plan files written before these fields read as ep 1, balanced, the encoder's length.
  nlohmann::json old = j;
  old.erase("ep");
  old.erase("moe_routing");
  old.erase("target_seq");
  const Strategy o = strategy_from_json(old, "t");
  CHECK(o.ep == 1);
  CHECK(o.moe_routing == MoeRouting::balanced);
  CHECK(o.target_seq == 0);
  CHECK(describe(s).find("ep 4") != std::string::npos);
  CHECK(describe(s).find("worst-case routing") != std::string::npos);
  // Validation names the flag.
  CHECK(error_of([] { validate(moe_strategy(0, 8, 3)); }).find("--ep 3: must divide --dp 8") == 0);
  CHECK(error_of([] { validate(moe_strategy(0, 8, 0)); }).find("--ep") == 0);
  const auto m = moe_model();
  CHECK(error_of([&] { resolve_for_model(moe_strategy(0, 8, 8), m); }).find("--ep 8: must divide") == 0);
  CHECK(error_of([] { resolve_for_model(moe_strategy(0, 2, 2), zp::models::load_model("gpt2-tiny")); })
            .find("--ep 2") == 0);
  Strategy t;
  t.target_seq = 8;
  CHECK(error_of([&] { resolve_for_model(t, zp::models::load_model("gpt2-tiny")); })
            .find("--target-seq 8") == 0);
  Strategy w;
  w.moe_routing = MoeRouting::worst;
  CHECK(error_of([&] { resolve_for_model(w, zp::models::load_model("gpt2-tiny")); })
            .find("--moe-routing worst") == 0);
}

TEST_CASE("encoder-decoder: --target-seq sizes the decoder, default the encoder's length") {
  const auto m = zp::models::parse_hf_config(
      R"({"model_type":"t5","d_model":64,"d_ff":128,"d_kv":16,"num_layers":2,)"
      R"("num_decoder_layers":2,"num_heads":4,"vocab_size":100})",
      "t5-tiny");
  REQUIRE(m.encoder_decoder());
  Strategy s;
  s.seq = 32;
  const Strategy d = resolve_for_model(s, m);
  CHECK(d.target_seq == 32);
  s.target_seq = 8;
  const Strategy t = resolve_for_model(s, m);
  CHECK(graph_options(m, t, {}).seq_target == 8);
  // A shorter decoder holds fewer activations.
  CHECK(estimate(m, t, nullptr).activations.peak < estimate(m, d, nullptr).activations.peak);
}

TEST_CASE("moe: the estimate's model object and partitions in JSON") {
  const auto e = estimate(moe_model(), moe_strategy(2, 8, 2), nullptr);
  const auto j = to_json(e);
  CHECK(j["model"]["total_params"] == kTotal);
  CHECK(j["model"]["active_params"] == kDense + L * K * kExpert);
  CHECK(j["model"]["moe"]["experts"] == E);
  CHECK(j["model"]["moe"]["top_k"] == K);
  CHECK(j["model"]["moe"]["active_params"] == kDense + L * K * kExpert);
  CHECK(j["expert_partition_elems"] == L * (E / 2) * kExpert / (8 / 2));
  CHECK(j["strategy"]["ep"] == 2);
  // A dense model has no moe object; its active parameters are all of them.
  const auto g = to_json(estimate(zp::models::load_model("gpt2-tiny"), Strategy{}, nullptr));
  CHECK_FALSE(g["model"].contains("moe"));
  CHECK(g["model"]["active_params"] == g["model"]["total_params"]);
}
