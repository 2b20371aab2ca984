// --checkpointing selective-op: torchtitan's per-op selective activation checkpointing
// (torchtitan/distributed/activation_checkpoint.py, SelectiveAC at b5bcd76c, applied to each
// transformer block with torch.utils.checkpoint and create_selective_checkpoint_contexts).
// What it keeps per block, worked by hand here from that policy, op by op:
//   - the block's input (the checkpoint's argument);
//   - the output of every op in its save list: aten.mm (each nn.Linear without bias), addmm (a
//     linear with a bias: at::linear flattens a biased linear into addmm), bmm (eager
//     attention's two products), the SDPA kernels (output and log-sum-exp), topk (MoE routing:
//     values and int64 indices),
//   - except every second mm of the block (counted per block: the 1st, 3rd, 5th... kept) and
//     the MoE router's mm (force_recompute_mm_shapes_by_fqns, not counted);
//   - the routed experts (torch._grouped_mm, not in the list) and everything else recomputed.
// The sizes below come from the configs written here, never read back from the program.
#include <doctest/doctest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/models/graph.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/strategy.hpp"

using namespace zp::models;
using namespace zp::planner;

namespace {

constexpr int64_t B = 2, T = 32;
constexpr uint64_t BT = B * T;

// Llama: C=128, 8 heads of 16 with 2 key/value heads (GQA), gated MLP of 352, no biases.
constexpr uint64_t kC = 128, kNH = 8, kKVH = 2, kHS = 16, kF = 352;
constexpr const char* kLlama =
    R"({"model_type":"llama","hidden_size":128,"intermediate_size":352,"num_hidden_layers":3,)"
    R"("num_attention_heads":8,"num_key_value_heads":2,"vocab_size":100,)"
    R"("max_position_embeddings":64})";

GraphOptions opts(Recompute rc, bool flash, bool dropout = false) {
  GraphOptions o;
  o.batch = B;
  o.seq = T;
  o.act_bytes = 2;
  o.dropout = dropout;
  o.flash_attention = flash;
  o.recompute = rc;
  return o;
}

ModelSpec with_layers(std::string json, int layers) {
  nlohmann::json j = nlohmann::json::parse(json);
  j["num_hidden_layers"] = layers;
  j["n_layer"] = layers;
  if (j["model_type"] == "gpt2") j.erase("num_hidden_layers");
  else j.erase("n_layer");
  return parse_hf_config(j.dump(), "test");
}

double recompute_matmul_flops(const TrainingGraph& g, int layer) {
  double f = 0;
  for (const Op& op : g.ops)
    if (op.phase == Phase::recompute && op.layer == layer && op.kind == OpKind::matmul)
      f += op.flops;
  return f;
}

}  // namespace

TEST_CASE("selective-op, llama-style block: q, v, attention, gate and down kept") {
  const ModelSpec m = parse_hf_config(kLlama, "llama-tiny");
  // Per block, in forward order (mm count in brackets):
  //   q = x Wq [1] kept       BT x NH*HS          k = x Wk [2] recomputed
  //   v = x Wv [3] kept       BT x KVH*HS         SDPA kept: out BT x NH*HS, lse B x NH x T fp32
  //   o [4] recomputed        gate = x W1 [5] kept BT x F      up = x W3 [6] recomputed
  //   down [7] kept           BT x C              and the block output (next block's input)
  // RMSNorms, rotary, SiLU * up and the residual adds are recomputed. 16-bit activations.
  const uint64_t kept = 2 * BT * (kNH * kHS + kKVH * kHS + kNH * kHS + kF + kC + kC);
  const uint64_t lse = 4 * B * kNH * T;
  const auto sac = summarize_activations(build_training_graph(m, opts(Recompute::selective_op, true)));
  for (std::size_t l = 0; l < 3; ++l) {
    CAPTURE(l);
    CHECK(sac.saved_per_layer[l] == kept);
    CHECK(sac.stats_per_layer[l] == lse);
  }
  // Eager attention: the two bmm outputs, the (B, NH, T, T) scores and the values product,
  // replace SDPA's output and log-sum-exp; the softmax is recomputed from the scores.
  const auto eager = summarize_activations(build_training_graph(m, opts(Recompute::selective_op, false)));
  CHECK(eager.saved_per_layer[1] == kept + 2 * B * kNH * T * T);
  CHECK(eager.stats_per_layer[1] == 0);

  // What the recomputation runs: of the matmuls only k, o and up (twice the multiply-adds).
  const TrainingGraph g = build_training_graph(m, opts(Recompute::selective_op, true));
  const double k = 2.0 * BT * kC * kKVH * kHS, o = 2.0 * BT * kNH * kHS * kC, up = 2.0 * BT * kC * kF;
  for (int l = 0; l < 3; ++l) CHECK(recompute_matmul_flops(g, l) == k + o + up);
  int reused = 0, flash_recomputed = 0;
  for (const Op& op : g.ops) {
    if (op.layer != 1) continue;
    if (op.kind == OpKind::sac_reuse) ++reused;
    if (op.kind == OpKind::flash_attention && op.phase == Phase::recompute) ++flash_recomputed;
  }
  CHECK(reused == 5);  // q, v, the attention, gate, down come from storage
  CHECK(flash_recomputed == 0);
}

TEST_CASE("selective-op: the peak sits in the last block's backward, one block's keep apart") {
  // At the end of the forward every block holds what it keeps; the backward of the last block
  // adds its recomputed tensors and gradients on top, and nothing earlier in the backward is
  // larger with a 100-token vocabulary. So one more block adds exactly its keep to the peak.
  const uint64_t kept = 2 * BT * (kNH * kHS + kKVH * kHS + kNH * kHS + kF + kC + kC) + 4 * B * kNH * T;
  for (int L : {2, 3, 4}) {
    CAPTURE(L);
    const TrainingGraph g = build_training_graph(with_layers(kLlama, L), opts(Recompute::selective_op, true));
    const auto a = summarize_activations(g);
    const auto b = summarize_activations(
        build_training_graph(with_layers(kLlama, L + 1), opts(Recompute::selective_op, true)));
    CHECK(b.peak - a.peak == kept);
    const Op& at = g.op(g.order[static_cast<std::size_t>(a.peak_pos)]);
    CAPTURE(at.name);
    CHECK(at.layer == L - 1);
    CHECK(at.phase == Phase::backward);
  }
}

TEST_CASE("selective-op, biased q/k/v (Qwen2): addmm is kept and does not count") {
  // Qwen2: q, k, v with biases (addmm: in the save list, outside the mm count), o, gate, up,
  // down without. Kept: q, k, v; SDPA; o [mm 1]; up [mm 3]; not gate [2] nor down [4].
  nlohmann::json j = nlohmann::json::parse(kLlama);
  j["model_type"] = "qwen2";
  const ModelSpec m = parse_hf_config(j.dump(), "qwen2-tiny");
  const uint64_t kept = 2 * BT * (kNH * kHS + 2 * kKVH * kHS + kNH * kHS + kC + kF + kC);
  const auto a = summarize_activations(build_training_graph(m, opts(Recompute::selective_op, true)));
  CHECK(a.saved_per_layer[0] == kept);
  CHECK(a.stats_per_layer[0] == 4 * B * kNH * T);
}

TEST_CASE("selective-op, GPT-style block: every biased linear kept, dropout recomputed") {
  // GPT-2: C=96, 4 heads, fused q|k|v (c_attn), MLP of 4C, every linear with a bias (HF's
  // Conv1D is torch.addmm), GELU, dropout 0.1. Kept: c_attn 3C, attention, c_proj C, c_fc 4C,
  // mlp c_proj C and the output C. The dropout masks and outputs are recomputed
  // (native_dropout is not in the list; checkpoint restores the RNG state).
  constexpr uint64_t C = 96, NH = 4;
  const ModelSpec m = parse_hf_config(
      R"({"model_type":"gpt2","n_embd":96,"n_head":4,"n_layer":2,"vocab_size":100,"n_positions":64})",
      "gpt2-tiny");
  const uint64_t kept = 2 * BT * (3 * C + C + C + 4 * C + C + C);
  const auto flash = summarize_activations(build_training_graph(m, opts(Recompute::selective_op, true, true)));
  CHECK(flash.saved_per_layer[0] == kept);
  CHECK(flash.stats_per_layer[0] == 4 * B * NH * T);
  // Eager: the scores' bmm (B, NH, T, T) kept instead of the log-sum-exp; the softmax, its
  // dropout mask and output recomputed. Without checkpointing the same block keeps
  // Korthikanti's 34sbh + 5as^2b (test_activations.cpp).
  const auto eager = summarize_activations(build_training_graph(m, opts(Recompute::selective_op, false, true)));
  CHECK(eager.saved_per_layer[0] == kept + 2 * B * NH * T * T);
  const auto none = summarize_activations(build_training_graph(m, opts(Recompute::none, false, true)));
  CHECK(none.saved_per_layer[0] == 34 * BT * C + 5 * NH * T * T * B);
  // Nothing of an addmm is recomputed: the recomputation runs no matmul at all.
  const TrainingGraph g = build_training_graph(m, opts(Recompute::selective_op, false, true));
  CHECK(recompute_matmul_flops(g, 0) == 0);
}

TEST_CASE("selective-op, MoE: router recomputed and uncounted, top-k kept, experts recomputed") {
  SUBCASE("Mixtral: no shared expert") {
    // Attention as Llama's (q [1], v [3] and SDPA kept); router mm forced recomputed; topk kept:
    // its fp32 values and int64 indices, BT x k each; the routed experts (grouped GEMMs) and the
    // weighted combine recomputed; the output kept.
    nlohmann::json j = nlohmann::json::parse(kLlama);
    j["model_type"] = "mixtral";
    j["num_local_experts"] = 4;
    j["num_experts_per_tok"] = 2;
    const uint64_t K = 2;
    const ModelSpec m = parse_hf_config(j.dump(), "mixtral-tiny");
    const uint64_t kept = 2 * BT * (kNH * kHS + kKVH * kHS + kNH * kHS + kC) + BT * K * (4 + 8);
    const TrainingGraph g = build_training_graph(m, opts(Recompute::selective_op, true));
    const auto a = summarize_activations(g);
    CHECK(a.saved_per_layer[0] == kept);
    // Recomputed matmuls: k, o, the router (C x E) and the experts' k*BT rows (gate, up, down).
    const double E = 4, rows = double(K * BT);
    CHECK(recompute_matmul_flops(g, 0) == 2.0 * BT * kC * kKVH * kHS + 2.0 * BT * kNH * kHS * kC +
                                              2.0 * BT * kC * E + 2.0 * rows * kC * 2 * kF +
                                              2.0 * rows * kF * kC);
  }
  SUBCASE("Qwen2-MoE: shared expert and its sigmoid gate") {
    // q, k, v addmm kept; o [1] kept; router forced; topk kept; shared gate [2] recomputed,
    // shared up [3] kept (BT x Fs), shared down [4] recomputed, shared_expert_gate (C -> 1) [5]
    // kept (BT x 1); the output kept.
    nlohmann::json j = nlohmann::json::parse(kLlama);
    j["model_type"] = "qwen2_moe";
    j["num_experts"] = 4;
    j["num_experts_per_tok"] = 2;
    j["moe_intermediate_size"] = 64;
    j["shared_expert_intermediate_size"] = 192;
    const uint64_t K = 2, Fs = 192;
    const ModelSpec m = parse_hf_config(j.dump(), "qwen2-moe-tiny");
    const uint64_t kept = 2 * BT * (kNH * kHS + 2 * kKVH * kHS + kNH * kHS + kC + Fs + 1 + kC) +
                          BT * K * (4 + 8);
    const auto a = summarize_activations(build_training_graph(m, opts(Recompute::selective_op, true)));
    CHECK(a.saved_per_layer[0] == kept);
  }
}

TEST_CASE("selective-op keeps less than none and more than full; every catalog model builds") {
  const ModelSpec m = parse_hf_config(kLlama, "llama-tiny");
  const uint64_t none = summarize_activations(build_training_graph(m, opts(Recompute::none, true))).saved_total;
  const uint64_t sac = summarize_activations(build_training_graph(m, opts(Recompute::selective_op, true))).saved_total;
  const uint64_t full = summarize_activations(build_training_graph(m, opts(Recompute::full, true))).saved_total;
  CHECK(full < sac);
  CHECK(sac < none);
  // Every recipe of the catalog (T5's cross-attention, MLA, sandwich norms, fused q|k|v and
  // gate|up, sinks, q/k norms, MoE), with both attentions and transformers' extras: each
  // block's recomputation replays its forward (the graph refuses one that diverges) and keeps
  // less than the block without checkpointing.
  for (const char* name : {"gpt2", "llama-3.1-8b", "mixtral-8x7b", "qwen2.5-7b", "qwen3-30b-a3b",
                           "gemma-2-9b", "phi-3-mini", "deepseek-v3", "gpt-oss-20b", "t5-11b"})
    for (bool flash : {false, true})
      for (bool hf : {false, true}) {
        CAPTURE(name);
        CAPTURE(flash);
        CAPTURE(hf);
        GraphOptions o = opts(Recompute::selective_op, flash);
        o.seq = 16;
        o.hf_modeling = hf;
        const ModelSpec mm = load_model(name);
        const auto a = summarize_activations(build_training_graph(mm, o));
        o.recompute = Recompute::none;
        const auto n = summarize_activations(build_training_graph(mm, o));
        CHECK(a.saved_total < n.saved_total);
      }
}

TEST_CASE("selective-op is refused where the policy's keep is not modelled") {
  nlohmann::json j = nlohmann::json::parse(kLlama);
  j["model_type"] = "mixtral";
  j["num_local_experts"] = 4;
  const ModelSpec m = parse_hf_config(j.dump(), "mixtral-tiny");
  GraphOptions o = opts(Recompute::selective_op, true);
  o.ep = 2;
  CHECK_THROWS_AS(build_training_graph(m, o), zp::Error);
  o.ep = 1;
  o.moe_capacity_factor = 1.0;
  CHECK_THROWS_AS(build_training_graph(m, o), zp::Error);
  // Autocast's casts before each matmul are ops of their own in torch; the graph folds them.
  GraphOptions a = opts(Recompute::selective_op, true);
  a.autocast = true;
  a.param_bytes = 4;
  CHECK_THROWS_AS(build_training_graph(parse_hf_config(kLlama, "llama-tiny"), a), zp::Error);
  Strategy s;
  s.checkpointing = Checkpointing::selective_op;
  s.dp = 2;
  s.ep = 2;
  CHECK_THROWS_AS(validate(s), zp::Error);
}

TEST_CASE("selective-op in the strategy: names, JSON, describe") {
  CHECK(checkpointing_from_string("selective-op") == Checkpointing::selective_op);
  CHECK(to_string(Checkpointing::selective_op) == "selective-op");
  Strategy s;
  s.checkpointing = Checkpointing::selective_op;
  CHECK(strategy_from_json(to_json(s), "test") == s);
  CHECK(describe(s).find("checkpointing selective-op") != std::string::npos);
}
