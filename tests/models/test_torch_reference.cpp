// The models layer against an independent PyTorch implementation of every family
// (tests/models/torch_reference.py, written from transformers' modeling code; fixture
// tests/data/models/torch_reference.json): exact parameter inventories (names, shapes, totals)
// and the activation bytes autograd saves for backward in one fp32 forward (B=2, T=16; T5's
// decoder T=8).
//
// zeroplan's graph counts what fused kernels save (the runtime's, FlashAttention's, Liger's);
// the reference follows Hugging Face's eager code, which saves more in known places. Two
// independent statements hold the two together, to the byte, for every family:
//   - the graph built with GraphOptions::hf_modeling, which adds those places as tensors and
//     ops of its own, saves exactly what autograd saves;
//   - the fused graph plus a formula per place (below, named and explained, each derived from
//     the op that saves the tensor; nothing is fitted) saves it too. So the hf graph's
//     additions are the formulas, and the test says so directly as well.
// The fixture is fp32, where the loss's upcast is no copy; its loss_path runs (the LM head and
// the loss alone, fp32 and bf16) and byte counts derived by hand hold the 16-bit loss path.
#include <doctest/doctest.h>

#include <fstream>
#include <map>
#include <optional>
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

// The position of the last forward op in the execution order.
int32_t end_of_forward(const TrainingGraph& g) {
  int32_t end_fwd = -1;
  for (int32_t i = 0; i < static_cast<int32_t>(g.order.size()); ++i)
    if (g.op(g.order[static_cast<std::size_t>(i)]).phase == Phase::forward) end_fwd = i;
  return end_fwd;
}

// Whether tensor t is alive at the end of the forward pass and read by the backward: produced
// by then and used after (what autograd's saved tensors hold).
bool kept_for_backward(const Liveness& lv, int32_t end_fwd, std::size_t t) {
  return lv.first[t] >= 0 && lv.first[t] <= end_fwd && lv.last[t] > end_fwd;
}

// Bytes kept for backward, inputs and model states excluded.
uint64_t saved_bytes(const TrainingGraph& g) {
  const Liveness lv = liveness(g);
  const int32_t end_fwd = end_of_forward(g);
  uint64_t saved = 0;
  for (std::size_t t = 0; t < g.tensors.size(); ++t) {
    const Tensor& x = g.tensors[t];
    if (!is_dynamic(x.kind) || x.kind == TensorKind::input) continue;
    if (kept_for_backward(lv, end_fwd, t)) saved += x.bytes;
  }
  return saved;
}

// The fixture's pass: B=2, T=16 (T5's decoder 8), fp32, eager attention.
GraphOptions fixture_options(bool hf_modeling) {
  GraphOptions o;
  o.batch = kB;
  o.seq = kT;
  o.seq_target = kTdec;
  o.act_bytes = 4;
  o.param_bytes = 4;
  o.hf_modeling = hf_modeling;
  return o;
}

uint64_t graph_saved_bytes(const ModelSpec& m, bool hf_modeling = false) {
  return saved_bytes(build_training_graph(m, fixture_options(hf_modeling)));
}

std::optional<Tensor> find_tensor(const TrainingGraph& g, const std::string& name) {
  for (const Tensor& t : g.tensors)
    if (t.name == name) return t;
  return std::nullopt;
}

const json& fixture_config(const std::string& name) {
  for (const json& c : fixture()["configs"])
    if (c["name"] == name) return c;
  FAIL("no fixture config " << name);
  return fixture();
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
    for (const auto& entry : ref) {
      const auto& [n, shape] = entry;
      CAPTURE(entry.first);
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

TEST_CASE("with hf_modeling the graph saves exactly what PyTorch's autograd saves, every family") {
  std::set<std::string> families;
  for (const json& c : fixture()["configs"]) {
    const std::string name = c["name"];
    CAPTURE(name);
    const ModelSpec m = parse_hf_config(c["config"].dump(), name);
    families.insert(m.model_type);
    CHECK(graph_saved_bytes(m, true) == reference_saved_bytes(c));
  }
  for (const std::string& t : supported_model_types()) {
    CAPTURE(t);
    CHECK(families.contains(t));
  }
}

TEST_CASE("saved activations equal what PyTorch's autograd saves, eager extras accounted") {
  // The independent statement: the fused graph and the formulas. Then the hf graph's additions
  // are the formulas, family by family.
  for (const json& c : fixture()["configs"]) {
    const std::string name = c["name"];
    CAPTURE(name);
    const ModelSpec m = parse_hf_config(c["config"].dump(), name);
    const uint64_t ours = graph_saved_bytes(m);
    const uint64_t hf = graph_saved_bytes(m, true);
    const uint64_t extra = eager_extra(m, c["config"]);
    CAPTURE(ours);
    CAPTURE(hf);
    CAPTURE(extra);
    CHECK(ours + extra == reference_saved_bytes(c));
    CHECK(hf - ours == extra);
  }
}

TEST_CASE("families without eager extras match autograd with no adjustment at all") {
  // GPT-NeoX (fused q|k|v, parallel residual, plain GELU), BLOOM (ALiBi, embedding LayerNorm),
  // T5 with ReLU (encoder-decoder, cross-attention, relative buckets) and BERT with each head
  // (post-LN, token types, erf GELU; pooler and classifier, MLM head, both): the graph alone,
  // which hf_modeling leaves as it is.
  const std::set<std::string> names = {"gpt_neox_parallel", "bloom_alibi", "t5_relu_tied",
                                       "bert_seqcls_3labels", "bert_seqcls_dropout",
                                       "bert_mlm_tied", "bert_pretraining"};
  for (const json& c : fixture()["configs"]) {
    const std::string name = c["name"];
    if (!names.contains(name)) continue;
    CAPTURE(name);
    const ModelSpec m = parse_hf_config(c["config"].dump(), name);
    CHECK(graph_saved_bytes(m) == reference_saved_bytes(c));
    CHECK(graph_saved_bytes(m, true) == graph_saved_bytes(m));
  }
}

TEST_CASE("hf_modeling adds named tensors that the backward reads; without it none of them") {
  // llama_gqa: repeat_kv's copies (B, NH - KVH, T, HS) of K and V and act(gate); gpt2_tied:
  // gelu_new's three and the position ids; mixtral_moe: the MoE loop's.
  const std::map<std::string, std::vector<std::pair<std::string, uint64_t>>> expected = {
      {"llama_gqa", {{"h.0.attn.repeat_kv.k", 2 * 6 * 16 * 8 * 4}, {"h.0.attn.repeat_kv.v", 2 * 6 * 16 * 8 * 4},
                     {"h.1.mlp.act", 2 * 16 * 160 * 4}}},
      {"gpt2_tied", {{"h.0.mlp.gelu_new.tanh", 2 * 16 * 256 * 4}, {"h.0.mlp.gelu_new.half_x", 2 * 16 * 256 * 4},
                     {"h.0.mlp.gelu_new.one_plus_tanh", 2 * 16 * 256 * 4}, {"embed.pos_ids", 16 * 8}}},
      {"mixtral_moe", {{"h.1.moe.expert_idx", 2 * 32 * 2 * 8}, {"h.1.moe.combine.src", 2 * 32 * 64 * 4},
                       {"h.1.moe.topk_weights", 32 * 2 * 4}, {"h.1.moe.topk_sum", 32 * 4},
                       {"h.1.moe.experts.act", 2 * 32 * 96 * 4}}},
  };
  for (const auto& entry : expected) {
    const auto& [name, tensors] = entry;
    CAPTURE(entry.first);
    const ModelSpec m = parse_hf_config(fixture_config(name)["config"].dump(), name);
    const TrainingGraph hf = build_training_graph(m, fixture_options(true));
    const TrainingGraph fused = build_training_graph(m, fixture_options(false));
    const Liveness lv = liveness(hf);
    const int32_t end_fwd = end_of_forward(hf);
    for (const auto& tensor : tensors) {
      const auto& [tname, bytes] = tensor;
      CAPTURE(tensor.first);
      const std::optional<Tensor> t = find_tensor(hf, tname);
      REQUIRE(t.has_value());
      CHECK(t->bytes == bytes);
      CHECK(t->kind == TensorKind::saved);
      std::size_t id = 0;
      while (hf.tensors[id].name != tname) ++id;
      CHECK(kept_for_backward(lv, end_fwd, id));
      CHECK_FALSE(find_tensor(fused, tname).has_value());
    }
  }
}

TEST_CASE("hf_modeling under SDPA: repeat_kv copies only where transformers materializes a mask") {
  // sdpa_attention.py: enable_gqa (no copies) when use_gqa_in_sdpa, i.e. no attention mask;
  // masking_utils.py _ignore_causal_mask_sdpa drops the mask unless a sliding window is reached.
  auto copies = [](const std::string& name, int64_t seq, int layer) {
    const ModelSpec m = parse_hf_config(fixture_config(name)["config"].dump(), name);
    GraphOptions o = fixture_options(true);
    o.seq = seq;
    o.flash_attention = true;
    return find_tensor(build_training_graph(m, o), "h." + std::to_string(layer) + ".attn.repeat_kv.k").has_value();
  };
  CHECK_FALSE(copies("llama_gqa", 16, 0));     // no window: SDPA reads the shared heads
  CHECK(copies("mistral_swa", 16, 0));         // window 8 reached by 16 tokens: a mask, copies
  CHECK_FALSE(copies("mistral_swa", 4, 0));    // 4 tokens inside the window: no mask
  CHECK(copies("gpt_oss_sinks", 16, 0));       // sliding layer
  CHECK_FALSE(copies("gpt_oss_sinks", 16, 1)); // full layer
  CHECK(copies("falcon_new_arch_gqa", 16, 0)); // Falcon broadcasts its heads whatever the attention
}

TEST_CASE("hf_modeling's loss path: the tensors and gradients PyTorch makes, fp32 and bf16") {
  // The fixture's loss_path runs: the LM head and causal_lm_loss alone. Forward: the head's
  // logits in the model's precision, logits.float() a copy only in 16 bits; kept: the fp32
  // log-probabilities (and Gemma 2's tanh, in the model's precision). Backward: nll_loss's and
  // log_softmax's fp32 gradients, then the cast back (ToCopyBackward0) in 16 bits. Gemma 2's
  // softcap backward is in place in the graph (PyTorch makes a new tensor per op: not compared).
  const json& runs = fixture()["loss_path"]["runs"];
  REQUIRE(runs.size() == 4);
  for (const json& r : runs) {
    const std::string name = r["config"], dtype = r["dtype"];
    CAPTURE(name);
    CAPTURE(dtype);
    const ModelSpec m = parse_hf_config(fixture_config(name)["config"].dump(), name);
    GraphOptions o = fixture_options(true);
    o.batch = r["B"].get<int64_t>();
    o.seq = r["T"].get<int64_t>();
    o.act_bytes = dtype == "f32" ? 4 : 2;
    o.param_bytes = o.act_bytes;
    const TrainingGraph g = build_training_graph(m, o);
    const Liveness lv = liveness(g);
    const int32_t end_fwd = end_of_forward(g);
    auto id_of = [&](const std::string& n) -> std::optional<std::size_t> {
      for (std::size_t t = 0; t < g.tensors.size(); ++t)
        if (g.tensors[t].name == n) return t;
      return std::nullopt;
    };
    auto bytes_of = [&](const std::string& n) -> uint64_t {
      const auto t = id_of(n);
      return t ? g.tensors[*t].bytes : 0;
    };
    // forward: [logits, logits.float()] with the bytes of a new storage (0: none)
    CHECK(bytes_of("logits") == r["forward"][0][3].get<uint64_t>());
    CHECK(bytes_of("logits.f32") == r["forward"][1][3].get<uint64_t>());
    // kept for backward: the fixture's act rows with a shape (total_weight is 0-dim)
    uint64_t ref_saved = 0;
    for (const json& row : r["saved"])
      if (row[6] == "act" && !row[1].empty()) ref_saved += row[5].get<uint64_t>();
    uint64_t ours_saved = 0;
    for (const char* n : {"logits", "logits.f32", "logprobs", "logits.softcap"})
      if (const auto t = id_of(n); t && kept_for_backward(lv, end_fwd, *t)) ours_saved += g.tensors[*t].bytes;
    CHECK(ours_saved == ref_saved);
    // gradients, in autograd's order: nll_loss's, log_softmax's, and the cast's
    std::vector<uint64_t> ref_grads, ours_grads;
    for (const json& row : r["grads"]) {
      const std::string node = row[0];
      if (node == "NllLossBackward0" || node == "LogSoftmaxBackward0" || node == "ToCopyBackward0")
        ref_grads.push_back(row[3].get<uint64_t>());
    }
    ours_grads.push_back(bytes_of("logprobs.d"));
    ours_grads.push_back(bytes_of(o.act_bytes == 4 ? "logits.d" : "logits.f32.d"));
    if (o.act_bytes != 4) ours_grads.push_back(bytes_of("logits.d"));
    CHECK(ours_grads == ref_grads);
  }
}

TEST_CASE("hf_modeling's loss tensors by hand, and the fused path as it was") {
  // llama-2-7b, B=2, T=4096, V=32000. Per (B, T, V) element: 16-bit logits 2, logits.float()
  // 4, log-probabilities 4 (kept), their gradient 4, the logits' fp32 gradient 4, cast back 2.
  const ModelSpec m = load_model("llama-2-7b");
  const uint64_t btv = uint64_t(2) * 4096 * 32000;
  GraphOptions o;
  o.batch = 2;
  o.seq = 4096;
  o.act_bytes = 2;
  o.flash_attention = true;
  o.hf_modeling = true;
  const TrainingGraph g16 = build_training_graph(m, o);
  CHECK(find_tensor(g16, "logits")->bytes == btv * 2);
  CHECK(find_tensor(g16, "logits.f32")->bytes == btv * 4);
  CHECK(find_tensor(g16, "logprobs")->bytes == btv * 4);
  CHECK(find_tensor(g16, "logprobs.d")->bytes == btv * 4);
  CHECK(find_tensor(g16, "logits.f32.d")->bytes == btv * 4);
  CHECK(find_tensor(g16, "logits.d")->bytes == btv * 2);
  // fp32: no copy, the log_softmax backward's output is the head's gradient.
  o.act_bytes = 4;
  const TrainingGraph g32 = build_training_graph(m, o);
  CHECK(find_tensor(g32, "logits")->bytes == btv * 4);
  CHECK_FALSE(find_tensor(g32, "logits.f32").has_value());
  CHECK_FALSE(find_tensor(g32, "logits.f32.d").has_value());
  CHECK(find_tensor(g32, "logits.d")->bytes == btv * 4);
  // Tensor parallelism: each rank holds ceil(V/t) columns of every vocabulary tensor.
  o.act_bytes = 2;
  o.tp = 2;
  CHECK(find_tensor(build_training_graph(m, o), "logprobs")->bytes == btv / 2 * 4);
  // T5 (T5ForConditionalGeneration.forward) applies CrossEntropyLoss to its 16-bit logits:
  // no copy, log-probabilities and gradients in 16 bits.
  const ModelSpec t5 = parse_hf_config(fixture_config("t5_relu_tied")["config"].dump(), "t5");
  GraphOptions o5 = o;
  o5.tp = 1;
  o5.seq_target = 4096;
  const TrainingGraph g5 = build_training_graph(t5, o5);
  const uint64_t bt5v = uint64_t(2) * 4096 * 256;
  CHECK_FALSE(find_tensor(g5, "logits.f32").has_value());
  CHECK(find_tensor(g5, "logprobs")->bytes == bt5v * 2);
  CHECK(find_tensor(g5, "logprobs.d")->bytes == bt5v * 2);
  CHECK(find_tensor(g5, "logits.d")->bytes == bt5v * 2);
  // Without hf_modeling: one fp32 logits tensor the fused cross-entropy overwrites, and its
  // 16-bit gradient; none of the hf loss tensors.
  o.tp = 1;
  o.hf_modeling = false;
  const TrainingGraph fused = build_training_graph(m, o);
  CHECK(find_tensor(fused, "logits")->bytes == btv * 4);
  CHECK(find_tensor(fused, "logits.d")->bytes == btv * 2);
  for (const char* n : {"logits.f32", "logprobs", "logprobs.d", "logits.f32.d"}) {
    CAPTURE(n);
    CHECK_FALSE(find_tensor(fused, n).has_value());
  }
}

TEST_CASE("BERT's heads: the tensors the backward reads, and the loss in the model's precision") {
  // modeling_bert.py: the pooler's tanh output (its backward's and the classifier's input), the
  // classifier dropout's mask and output; the MLM transform's dense output (GELU's input), GELU's
  // output and LayerNorm's (the decoder's input); (B, n_labels) and (B, T, V) logits. No final
  // norm after the post-LN blocks; position and token-type ids are buffers, not activations.
  struct Want {
    std::string config, tensor;
    std::vector<int64_t> shape;
  };
  const std::vector<Want> want = {
      {"bert_seqcls_dropout", "head.pooler.tanh", {kB, 64}},
      {"bert_seqcls_dropout", "head.cls.drop.mask", {kB, 64}},
      {"bert_seqcls_dropout", "head.cls.drop.out", {kB, 64}},
      {"bert_seqcls_dropout", "h.1.norm2.stats", {kB, kT, 2}},
      {"bert_mlm_tied", "head.mlm.dense", {kB, kT, 64}},
      {"bert_mlm_tied", "head.mlm.gelu", {kB, kT, 64}},
      {"bert_mlm_tied", "head.mlm.norm.out", {kB, kT, 64}},
      {"bert_pretraining", "head.pooler.tanh", {kB, 64}},
      {"bert_pretraining", "head.mlm.norm.out", {kB, kT, 64}},
  };
  for (const Want& w : want) {
    CAPTURE(w.config);
    CAPTURE(w.tensor);
    const ModelSpec m = parse_hf_config(fixture_config(w.config)["config"].dump(), w.config);
    for (bool hf : {false, true}) {
      const TrainingGraph g = build_training_graph(m, fixture_options(hf));
      const Liveness lv = liveness(g);
      const int32_t end_fwd = end_of_forward(g);
      std::size_t id = 0;
      while (id < g.tensors.size() &&
             (g.tensors[id].name != w.tensor || !is_dynamic(g.tensors[id].kind)))
        ++id;  // activations only: a module's weight may bear its output's name
      REQUIRE(id < g.tensors.size());
      CHECK(g.tensors[id].shape == w.shape);
      CHECK(kept_for_backward(lv, end_fwd, id));
      CHECK_FALSE(find_tensor(g, "lnf.out").has_value());
      CHECK_FALSE(find_tensor(g, "embed.pos_ids").has_value());
    }
  }
  // bf16 with hf_modeling: CrossEntropyLoss on the logits as they are (no .float() copy), so
  // the log-probabilities and their gradients are 16-bit; the classifier's logits are
  // TensorKind::logits like the vocabulary's.
  const ModelSpec pre = parse_hf_config(fixture_config("bert_pretraining")["config"].dump(), "pre");
  GraphOptions o = fixture_options(true);
  o.act_bytes = o.param_bytes = 2;
  const TrainingGraph g = build_training_graph(pre, o);
  const uint64_t btv = uint64_t(kB * kT * 256);
  CHECK(find_tensor(g, "logits")->bytes == btv * 2);
  CHECK(find_tensor(g, "logprobs")->bytes == btv * 2);
  CHECK(find_tensor(g, "logprobs.d")->bytes == btv * 2);
  CHECK_FALSE(find_tensor(g, "logits.f32").has_value());
  CHECK(find_tensor(g, "cls.logits")->shape == std::vector<int64_t>{kB, 2});
  CHECK(find_tensor(g, "cls.logits")->kind == TensorKind::logits);
  CHECK(find_tensor(g, "cls.logprobs")->bytes == uint64_t(kB * 2 * 2));
  CHECK_FALSE(find_tensor(g, "cls.logits.f32").has_value());
  // The fused path: fp32 logits the cross-entropy overwrites, for both heads.
  o.hf_modeling = false;
  const TrainingGraph fused = build_training_graph(pre, o);
  CHECK(find_tensor(fused, "logits")->bytes == btv * 4);
  CHECK(find_tensor(fused, "cls.logits")->bytes == uint64_t(kB * 2 * 4));
  CHECK_FALSE(find_tensor(fused, "cls.logprobs").has_value());
}

TEST_CASE("bert-large-uncased at the published measurement's shape: saved bytes by hand") {
  // The Hugging Face docs' "Model training anatomy" run: BertForSequenceClassification, 2
  // labels, B=4, T=512, fp32, eager attention, dropout 0.1. What one post-LN block keeps, from
  // the ops (each checked against autograd on the small configs above), per token in units of
  // C: q|k|v 12, attention output 4, its dropout mask 1, x + attn 4 (LayerNorm's input), its
  // output 4 (the MLP's input), the MLP dropout mask 1, the second sum 4, the block output 4:
  // 34 C; the MLP's fc and GELU output 2 x 4 F; per head and query the T x T softmax 4,
  // dropout mask 1 and dropped probabilities 4; two LayerNorms' mean and rstd 16 bytes.
  const ModelSpec m = load_model(std::string(ZP_SOURCE_DIR) +
                                 "/tests/data/published/bert-large-uncased-seqcls.json");
  const uint64_t B = 4, T = 512, C = 1024, F = 4096, NH = 16;
  const uint64_t block = 34 * B * T * C + 8 * B * T * F + 9 * B * NH * T * T + 16 * B * T;
  // Embeddings: the sum (LayerNorm's input) 4, the dropout mask 1 and output 4, stats 8 per
  // token; the head: the pooler's tanh 4, the classifier dropout's mask 1 and output 4 per
  // sequence and channel, the 2 classes' fp32 log-probabilities (or fused: logits).
  const uint64_t total = 24 * block + 9 * B * T * C + 8 * B * T + 9 * B * C + 4 * B * 2;
  for (bool hf : {false, true}) {
    CAPTURE(hf);
    GraphOptions o;
    o.batch = 4;
    o.seq = 512;
    o.act_bytes = o.param_bytes = 4;
    o.hf_modeling = hf;
    CHECK(saved_bytes(build_training_graph(m, o)) == total);
  }
  CHECK(block == 289'439'744);  // 276.0 MiB
}
