// The models layer against an independent PyTorch implementation of every family
// (tests/models/torch_reference.py, written from transformers' modeling code; fixture
// tests/data/models/torch_reference.json): exact parameter inventories (names, shapes, totals)
// and the activation bytes autograd saves for backward in one fp32 forward (B=2, T=16; T5's
// decoder T=8).
//
// zeroplan's graph counts what fused kernels save (the runtime's, FlashAttention's, Liger's);
// the reference follows Hugging Face's eager code, which saves more in known places. Each
// such place is a formula below, named and explained; with them the totals must be equal to
// the byte. Nothing is fitted: each formula is derived from the op that saves the tensor.
#include <doctest/doctest.h>

#include <fstream>
#include <map>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "zp/models/graph.hpp"
#include "zp/models/model_spec.hpp"

using namespace zp::models;
using nlohmann::json;

namespace {

const json& fixture() {
  static const json j = [] {
    std::ifstream f(std::string(ZP_TEST_DATA) + "/models/torch_reference.json");
    REQUIRE_MESSAGE(f.good(), "missing fixture tests/data/models/torch_reference.json");
    return json::parse(f);
  }();
  return j;
}

constexpr int64_t kB = 2, kT = 16, kTdec = 8;

// Bytes alive at the end of the forward pass that the backward reads: produced by then and
// used after (what autograd's saved tensors hold), inputs and model states excluded.
uint64_t graph_saved_bytes(const ModelSpec& m) {
  GraphOptions o;
  o.batch = kB;
  o.seq = kT;
  o.seq_target = kTdec;
  o.act_bytes = 4;
  o.param_bytes = 4;
  const TrainingGraph g = build_training_graph(m, o);
  const Liveness lv = liveness(g);
  int32_t end_fwd = -1;
  for (int32_t i = 0; i < static_cast<int32_t>(g.order.size()); ++i)
    if (g.op(g.order[static_cast<std::size_t>(i)]).phase == Phase::forward) end_fwd = i;
  uint64_t saved = 0;
  for (std::size_t t = 0; t < g.tensors.size(); ++t) {
    const Tensor& x = g.tensors[t];
    if (!is_dynamic(x.kind) || x.kind == TensorKind::input) continue;
    if (lv.first[t] < 0 || lv.first[t] > end_fwd || lv.last[t] <= end_fwd) continue;
    saved += x.bytes;
  }
  return saved;
}

// What the reference saved: every activation row with a shape (0-dim tensors are Python
// numbers autograd wraps, e.g. the attention scale, and NLL's total_weight: a few bytes, not
// activations), storages counted once, inputs and buffers excluded.
uint64_t reference_saved_bytes(const json& c) {
  uint64_t total = 0;
  for (const json& r : c["saved"]) {
    if (r[7] != "act" || r[2].empty()) continue;
    total += r[6].get<uint64_t>();
  }
  return total;
}

// ---- where Hugging Face's eager code saves more than zeroplan's graph, per block --------

// repeat_kv: eager attention copies the KVH key/value heads to all NH query heads before the
// matmuls, which save the copies (modeling_llama.py repeat_kv); fused attention reads the
// shared heads. Extra: 2 (K and V) x (NH - KVH) x HS per token.
uint64_t repeat_kv(const ModelSpec& m, int64_t tokens) {
  if (m.attention != Attention::standard || m.n_kv_head == m.n_head || m.encoder_decoder()) return 0;
  return uint64_t(2 * (m.n_head - m.n_kv_head) * m.head_dim * tokens * 4);
}

// A gated MLP written act(gate) * up: the multiplication saves act(gate) as well (a fused
// SwiGLU/GeGLU recomputes it from gate). gelu_new (NewGELUActivation) is a Python composition
// 0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x^3))) whose pow, tanh and two multiplications save
// three more tensors of the MLP's width than a fused GELU (which saves only its input).
// gpt-oss's clamped GLU, glu = gate*sigmoid(alpha*gate), (up + 1)*glu, saves sigmoid's result
// and three multiplication operands beyond gate|up and its output.
uint64_t mlp_extra(const ModelSpec& m, int64_t width, int64_t rows) {
  const uint64_t one = uint64_t(width * rows * 4);
  if (m.model_type == "gpt_oss") return 4 * one;
  const bool composite_gelu = m.activation == "gelu_new";
  if (m.mlp == Mlp::swiglu) return one + (composite_gelu ? 3 * one : 0);
  return composite_gelu ? 3 * one : 0;
}

// Transformers' MoE loop (modeling_mixtral.py and kin): per expert, torch.where's index pair
// (int64, two per routed row: 16 bytes), the expert output it scales and index_add_'s source
// (one more (rows, C) tensor than a combine that reads the scaled rows); top-k indices in int64
// (zeroplan keeps int32); with norm_topk_prob the top-k weights before the division and their
// sum. gpt-oss takes top-k of the logits and softmaxes those k, so it saves (B, T, k) where
// others save (B, T, E).
uint64_t moe_extra(const ModelSpec& m, const json& cfg, int64_t tokens) {
  const int64_t k = m.moe.top_k, E = m.moe.n_experts, R = k * tokens, C = m.n_embd;
  int64_t extra = R * C * 4 + 16 * R + 4 * tokens * k;
  const bool renorm = cfg.value("norm_topk_prob", m.model_type == "mixtral");
  if (renorm) extra += tokens * k * 4 + tokens * 4;
  if (m.model_type == "gpt_oss") extra -= (E - k) * tokens * 4;
  return uint64_t(extra) + mlp_extra(m, m.moe.expert_inner, R) +
         (m.moe.shared_inner > 0 ? mlp_extra(m, m.moe.shared_inner, tokens) : 0);
}

uint64_t eager_extra(const ModelSpec& m, const json& cfg) {
  uint64_t extra = 0;
  for (int64_t l = 0; l < m.n_blocks(); ++l) {
    const int64_t tokens = kB * (m.encoder_decoder() && l >= m.n_layer ? kTdec : kT);
    extra += repeat_kv(m, tokens);
    extra += m.moe.is_moe_layer(l) ? moe_extra(m, cfg, tokens) : mlp_extra(m, m.n_inner, tokens);
    // gpt-oss's sinks: the softmax runs over T + 1 columns (one sink logit per head) and the
    // max before it saves its int64 indices.
    if (m.attn_sinks) extra += uint64_t(tokens * m.n_head * (4 + 8));
    // Falcon splits its fused q|k|v with one-element index tensors (int64, two per block).
    if (m.model_type == "falcon") extra += 16;
  }
  // Learned position ids (int64): GPT-2's (1, T), OPT's (B, T) from the attention mask.
  if (m.model_type == "gpt2") extra += 8 * kT;
  if (m.model_type == "opt") extra += 8 * kB * kT;
  return extra;
}

}  // namespace

TEST_CASE("parameter inventories equal the PyTorch reference, tensor by tensor") {
  const json& fx = fixture();
  REQUIRE(fx["configs"].size() >= 20);
  std::set<std::string> families;
  for (const json& c : fx["configs"]) {
    const std::string name = c["name"];
    CAPTURE(name);
    const ModelSpec m = parse_hf_config(c["config"].dump(), name);
    families.insert(m.model_type);
    const ParamInventory inv = count_params(m);
    CHECK(inv.total == c["total"].get<int64_t>());
    std::map<std::string, std::vector<int64_t>> ours, ref;
    for (const ParamTensor& t : inv.tensors) ours[t.name] = t.shape;
    for (const json& t : c["params"]) ref[t["name"]] = t["shape"].get<std::vector<int64_t>>();
    for (const auto& [n, shape] : ref) {
      CAPTURE(n);
      REQUIRE(ours.contains(n));
      CHECK(ours[n] == shape);
    }
    CHECK(ours.size() == ref.size());
  }
  // Every family the readers know has a reference config.
  for (const std::string& t : supported_model_types()) {
    CAPTURE(t);
    CHECK(families.contains(t));
  }
}

TEST_CASE("saved activations equal what PyTorch's autograd saves, eager extras accounted") {
  for (const json& c : fixture()["configs"]) {
    const std::string name = c["name"];
    CAPTURE(name);
    const ModelSpec m = parse_hf_config(c["config"].dump(), name);
    const uint64_t ours = graph_saved_bytes(m);
    const uint64_t extra = eager_extra(m, c["config"]);
    CAPTURE(ours);
    CAPTURE(extra);
    CHECK(ours + extra == reference_saved_bytes(c));
  }
}

TEST_CASE("families without eager extras match autograd with no adjustment at all") {
  // GPT-NeoX (fused q|k|v, parallel residual, plain GELU), BLOOM (ALiBi, embedding LayerNorm)
  // and T5 with ReLU (encoder-decoder, cross-attention, relative buckets): the graph alone.
  for (const json& c : fixture()["configs"]) {
    const std::string name = c["name"];
    if (name != "gpt_neox_parallel" && name != "bloom_alibi" && name != "t5_relu_tied") continue;
    CAPTURE(name);
    const ModelSpec m = parse_hf_config(c["config"].dump(), name);
    CHECK(graph_saved_bytes(m) == reference_saved_bytes(c));
  }
}
