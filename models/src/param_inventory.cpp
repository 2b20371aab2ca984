// param_inventory.cpp: the recipe's parameter tensors (walk_params) and their Hugging Face
// names (one table per naming scheme), summed into the exact inventory. Shapes follow each
// family's modeling_<type>.py in transformers; the tests compare them with a PyTorch
// implementation (tests/models/torch_reference.py) and the authors' published totals.
#include <limits>
#include <map>
#include <string>

#include <fmt/format.h>

#include "recipe_walk.hpp"
#include "zp/checked.hpp"
#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"

namespace zp::models {

bool MoeSpec::is_moe_layer(int64_t l) const {
  if (n_experts == 0 || l < first_dense || step < 1 || l % step != phase) return false;
  return std::find(dense_layers.begin(), dense_layers.end(), l) == dense_layers.end();
}

int64_t WindowSpec::window_of(int64_t l) const {
  if (size == 0 || l < from_layer) return 0;
  if (pattern.empty()) return size;
  return pattern[static_cast<std::size_t>(l) % pattern.size()] ? size : 0;
}

bool ModelSpec::is_gpt2_block() const {
  return norm == Norm::layernorm && norm_place == NormPlace::pre &&
         residual == Residual::sequential && mlp == Mlp::gelu &&
         positions == Positions::learned && position_offset == 0 &&
         attention == Attention::standard && qk_norm == QkNorm::none && !attn_sinks &&
         qkv_bias && out_bias && mlp_bias && !is_moe() && n_kv_head == n_head &&
         head_dim * n_head == n_embd && !embed_norm && embed_proj_dim == 0 && !head_bias &&
         !encoder_decoder();
}

int64_t ModelSpec::qk_head_dim() const {
  return attention == Attention::mla ? mla.qk_nope_head_dim + mla.qk_rope_head_dim : head_dim;
}
int64_t ModelSpec::v_head_dim() const {
  return attention == Attention::mla ? mla.v_head_dim : head_dim;
}

namespace detail {
namespace {

class Walker {
 public:
  Walker(const ModelSpec& m, const std::function<void(const SlotTensor&)>& f, bool norms_first)
      : m_(m), f_(f), norms_first_(norms_first) {}

  void run() {
    const int64_t C = m_.n_embd, V = m_.vocab_size;
    const int64_t E = m_.embed_proj_dim > 0 ? m_.embed_proj_dim : C;
    emit("embed.weight", {V, E}, -1, Split::vocab);
    if (m_.positions == Positions::learned)
      emit("pos.weight", {m_.n_positions + m_.position_offset, C}, -1);
    if (m_.type_vocab_size > 0) emit("type.weight", {m_.type_vocab_size, C}, -1);
    if (m_.embed_proj_dim > 0) emit("embed_proj.weight", {C, E}, -1);
    if (m_.embed_norm) norm("embed_norm", C, -1);
    for (int64_t l = 0; l < m_.n_layer; ++l) block(l, false);
    if (m_.encoder_decoder()) {
      norm("enc_final_norm", C, m_.n_layer - 1);  // belongs with the encoder's last block
      for (int64_t l = 0; l < m_.n_decoder_layer; ++l) block(m_.n_layer + l, true);
    }
    const int64_t head = m_.n_blocks();
    if (m_.final_norm) norm("final_norm", C, head);
    if (m_.embed_proj_dim > 0) emit("head_proj.weight", {E, C}, head);
    // BERT's heads, in BertFor*'s module order: the pooler (part of BertModel), the MLM head's
    // own bias and transform, its decoder where untied, the classifier on the pooled output.
    if (m_.pooler)
      linear("head.pooler.weight", "head.pooler.bias", C, C, true, head, Split::replicated);
    if (m_.head == Head::mlm) {
      emit("head.mlm.bias", {V}, head, Split::vocab);
      linear("head.mlm.dense.weight", "head.mlm.dense.bias", C, C, true, head, Split::replicated);
      norm("head.mlm_norm", C, head);
    }
    if (m_.head != Head::seq_cls && !m_.tied_embeddings) {
      emit("head.weight", {V, E}, head, Split::vocab);
      if (m_.head_bias) emit("head.bias", {V}, head, Split::vocab);
    }
    if (m_.n_labels > 0)
      linear("head.cls.weight", "head.cls.bias", m_.n_labels, C, true, head, Split::replicated);
  }

 private:
  void emit(std::string_view slot, std::vector<int64_t> shape, int64_t layer,
            Split split = Split::replicated, int64_t expert = -1, bool routed = false) {
    f_(SlotTensor{slot, std::move(shape), layer, expert, split, routed});
  }
  void norm(std::string_view base, int64_t n, int64_t layer) {
    static const std::map<std::string_view, std::pair<std::string, std::string>> kNames = [] {
      std::map<std::string_view, std::pair<std::string, std::string>> out;
      for (std::string_view b : {"embed_norm", "norm_attn", "norm_attn_post", "norm_mlp",
                                 "norm_mlp_post", "norm_cross", "enc_final_norm", "final_norm",
                                 "attn.q_norm", "attn.k_norm", "attn.q_a_norm", "attn.kv_a_norm",
                                 "head.mlm_norm"})
        out[b] = {std::string(b) + ".weight", std::string(b) + ".bias"};
      return out;
    }();
    const auto& names = kNames.at(base);
    emit(names.first, {n}, layer);
    if (m_.norm == Norm::layernorm) emit(names.second, {n}, layer);
  }
  void linear(std::string_view w, std::string_view b, int64_t out, int64_t in, bool bias,
              int64_t layer, Split split) {
    emit(w, {out, in}, layer, split);
    // A row-parallel layer's bias is added once, after the reduction: replicated.
    if (bias) emit(b, {out}, layer, split == Split::row ? Split::replicated : split);
  }

  void block(int64_t l, bool decoder) {
    if (m_.norm_place == NormPlace::post_residual && !norms_first_) {
      // Post-LN blocks that register each norm after its sublayer (BERT).
      attention(l);
      norm("norm_attn", m_.n_embd, l);
      mlp(l);
      norm("norm_mlp", m_.n_embd, l);
      return;
    }
    if (norms_first_) {
      block_norms(l);
      attention(l);
      if (decoder) cross_attention(l);
      mlp(l);
    } else {
      attention(l);
      if (decoder) cross_attention(l);
      mlp(l);
      block_norms(l);
    }
  }

  void block_norms(int64_t l) {
    const int64_t C = m_.n_embd;
    if (m_.residual == Residual::parallel) {
      norm("norm_attn", C, l);
      if (m_.parallel_norms == 2) norm("norm_mlp", C, l);
      return;
    }
    switch (m_.norm_place) {
      case NormPlace::pre:
      case NormPlace::post_residual:
        norm("norm_attn", C, l);
        if (m_.encoder_decoder() && l >= m_.n_layer) norm("norm_cross", C, l);
        norm("norm_mlp", C, l);
        break;
      case NormPlace::sandwich:
        norm("norm_attn", C, l);
        norm("norm_attn_post", C, l);
        norm("norm_mlp", C, l);
        norm("norm_mlp_post", C, l);
        break;
      case NormPlace::post_sublayer:
        norm("norm_attn_post", C, l);
        norm("norm_mlp_post", C, l);
        break;
    }
  }

  void attention(int64_t l) {
    const int64_t C = m_.n_embd, NH = m_.n_head, HS = m_.head_dim;
    if (m_.attention == Attention::mla) {
      const MlaSpec& a = m_.mla;
      const int64_t q_out = checked_mul(NH, a.qk_nope_head_dim + a.qk_rope_head_dim, "MLA q width");
      if (a.q_lora_rank > 0) {
        linear("attn.q_a.weight", "attn.q_a.bias", a.q_lora_rank, C, m_.qkv_bias, l,
               Split::replicated);
        norm("attn.q_a_norm", a.q_lora_rank, l);
        linear("attn.q_b.weight", "", q_out, a.q_lora_rank, false, l, Split::column);
      } else {
        linear("attn.q.weight", "", q_out, C, false, l, Split::column);
      }
      linear("attn.kv_a.weight", "attn.kv_a.bias", a.kv_lora_rank + a.qk_rope_head_dim, C,
             m_.qkv_bias, l, Split::replicated);
      norm("attn.kv_a_norm", a.kv_lora_rank, l);
      linear("attn.kv_b.weight", "", checked_mul(NH, a.qk_nope_head_dim + a.v_head_dim,
                                                "MLA kv_b width"),
             a.kv_lora_rank, false, l, Split::column);
      linear("attn.o.weight", "attn.o.bias", C, checked_mul(NH, a.v_head_dim, "MLA o width"),
             m_.out_bias, l, Split::row);
      return;
    }
    const int64_t Q = checked_mul(NH, HS, "attention width NH*HS");
    const int64_t KV = checked_mul(m_.n_kv_head, HS, "key/value width KVH*HS");
    if (m_.fused_qkv) {
      linear("attn.qkv.weight", "attn.qkv.bias", checked_add(Q, 2 * KV, "qkv width"), C,
             m_.qkv_bias, l, Split::column);
    } else {
      linear("attn.q.weight", "attn.q.bias", Q, C, m_.qkv_bias, l, Split::column);
      linear("attn.k.weight", "attn.k.bias", KV, C, m_.qkv_bias, l, Split::column);
      linear("attn.v.weight", "attn.v.bias", KV, C, m_.qkv_bias, l, Split::column);
    }
    linear("attn.o.weight", "attn.o.bias", C, Q, m_.out_bias, l, Split::row);
    if (m_.positions == Positions::relative && (l == 0 || l == m_.n_layer))
      emit("attn.rel_bias.weight", {m_.relative_buckets, NH}, l, Split::column);
    if (m_.qk_norm == QkNorm::head) {
      norm("attn.q_norm", HS, l);
      norm("attn.k_norm", HS, l);
    } else if (m_.qk_norm == QkNorm::full) {
      norm("attn.q_norm", Q, l);
      norm("attn.k_norm", KV, l);
    }
    if (m_.attn_sinks) emit("attn.sinks", {NH}, l, Split::column);
  }

  void cross_attention(int64_t l) {
    const int64_t C = m_.n_embd, Q = checked_mul(m_.n_head, m_.head_dim, "attention width");
    linear("cross.q.weight", "", Q, C, false, l, Split::column);
    linear("cross.k.weight", "", Q, C, false, l, Split::column);
    linear("cross.v.weight", "", Q, C, false, l, Split::column);
    linear("cross.o.weight", "", C, Q, false, l, Split::row);
  }

  // A dense MLP of width F under `base` ("mlp" or "moe.shared").
  void dense(std::string_view gate, std::string_view up, std::string_view gate_up,
             std::string_view down, int64_t F, bool bias, int64_t l, bool fused) {
    const int64_t C = m_.n_embd;
    if (m_.mlp == Mlp::swiglu) {
      if (fused) {
        linear(gate_up, "mlp.gate_up.bias", checked_mul(int64_t{2}, F, "gate/up width"), C, false,
               l, Split::column);
      } else {
        linear(gate, bias_of(gate), F, C, bias, l, Split::column);
        linear(up, bias_of(up), F, C, bias, l, Split::column);
      }
    } else {
      linear(up, bias_of(up), F, C, bias, l, Split::column);
    }
    linear(down, bias_of(down), C, F, bias, l, Split::row);
  }
  static std::string_view bias_of(std::string_view w) {
    static const std::map<std::string_view, std::string_view> kBias = {
        {"mlp.gate.weight", "mlp.gate.bias"}, {"mlp.up.weight", "mlp.up.bias"},
        {"mlp.down.weight", "mlp.down.bias"}, {"moe.shared.gate.weight", ""},
        {"moe.shared.up.weight", ""}, {"moe.shared.down.weight", ""},
        {"moe.expert.gate.weight", "moe.expert.gate.bias"},
        {"moe.expert.up.weight", "moe.expert.up.bias"},
        {"moe.expert.down.weight", "moe.expert.down.bias"}};
    return kBias.at(w);
  }

  void mlp(int64_t l) {
    const int64_t C = m_.n_embd;
    if (!m_.moe.is_moe_layer(l)) {
      dense("mlp.gate.weight", "mlp.up.weight", "mlp.gate_up.weight", "mlp.down.weight",
            m_.n_inner, m_.mlp_bias, l, m_.fused_gate_up);
      return;
    }
    const MoeSpec& e = m_.moe;
    const int64_t E = e.n_experts, Fe = e.expert_inner;
    emit("moe.router.weight", {E, C}, l);
    if (e.router_bias) emit("moe.router.bias", {E}, l);
    // DeepSeek-V3's e_score_correction_bias (score_bias) is a buffer, not a parameter: the
    // aux-loss-free balancing moves it by a fixed step, no gradient or optimizer state
    // (V3 report sec. 2.1.2; HF registers it with register_buffer). Checkpoints store it.
    if (m_.fused_gate_up) {
      // gpt-oss stores all experts of a layer as stacked tensors.
      emit("moe.experts.gate_up", {E, C, 2 * Fe}, l, Split::column, -1, true);
      if (e.expert_bias) emit("moe.experts.gate_up_bias", {E, 2 * Fe}, l, Split::column, -1, true);
      emit("moe.experts.down", {E, Fe, C}, l, Split::row, -1, true);
      if (e.expert_bias) emit("moe.experts.down_bias", {E, C}, l, Split::replicated, -1, true);
    } else {
      for (int64_t x = 0; x < E; ++x) {
        emit("moe.expert.gate.weight", {Fe, C}, l, Split::column, x, true);
        if (e.expert_bias) emit("moe.expert.gate.bias", {Fe}, l, Split::column, x, true);
        emit("moe.expert.up.weight", {Fe, C}, l, Split::column, x, true);
        if (e.expert_bias) emit("moe.expert.up.bias", {Fe}, l, Split::column, x, true);
        emit("moe.expert.down.weight", {C, Fe}, l, Split::row, x, true);
        if (e.expert_bias) emit("moe.expert.down.bias", {C}, l, Split::replicated, x, true);
      }
    }
    if (e.shared_inner > 0) {
      dense("moe.shared.gate.weight", "moe.shared.up.weight", "", "moe.shared.down.weight",
            e.shared_inner, false, l, false);
      if (e.shared_gate) emit("moe.shared_gate.weight", {1, C}, l);
    }
  }

  const ModelSpec& m_;
  const std::function<void(const SlotTensor&)>& f_;
  bool norms_first_ = false;
};

}  // namespace

void walk_params(const ModelSpec& m, const std::function<void(const SlotTensor&)>& f,
                 bool norms_first) {
  Walker(m, f, norms_first).run();
}

}  // namespace detail

// ---- Hugging Face names --------------------------------------------------------------------
namespace {

// Module names per slot for one naming scheme. "{}" is the layer's prefix; a slot's leaf
// (weight, bias) is appended unless the pattern already ends with a leaf (after '|').
struct Scheme {
  std::string embed, pos, layer_prefix, final_norm, head;
  std::map<std::string, std::string, std::less<>> slots;  // slot base -> module (or module|leaf)
  bool conv1d = false;       // GPT-2's Conv1D stores linear weights (in, out)
  bool norms_first = false;  // a block registers its norms before attention and MLP
};

using SlotMap = std::map<std::string, std::string, std::less<>>;

SlotMap llama_slots(const ModelSpec& m) {
  SlotMap s = {
      {"norm_attn", "input_layernorm"},
      {"norm_mlp", m.norm_place == NormPlace::sandwich ? "pre_feedforward_layernorm"
                                                        : "post_attention_layernorm"},
      {"norm_attn_post", "post_attention_layernorm"},
      {"norm_mlp_post", "post_feedforward_layernorm"},
      {"attn.q", "self_attn.q_proj"}, {"attn.k", "self_attn.k_proj"},
      {"attn.v", "self_attn.v_proj"}, {"attn.o", "self_attn.o_proj"},
      {"attn.qkv", "self_attn.qkv_proj"},
      {"attn.q_norm", "self_attn.q_norm"}, {"attn.k_norm", "self_attn.k_norm"},
      {"attn.sinks", "self_attn|sinks"},
      {"attn.q_a", "self_attn.q_a_proj"}, {"attn.q_a_norm", "self_attn.q_a_layernorm"},
      {"attn.q_b", "self_attn.q_b_proj"}, {"attn.kv_a", "self_attn.kv_a_proj_with_mqa"},
      {"attn.kv_a_norm", "self_attn.kv_a_layernorm"}, {"attn.kv_b", "self_attn.kv_b_proj"},
      {"mlp.gate", "mlp.gate_proj"}, {"mlp.up", "mlp.up_proj"}, {"mlp.down", "mlp.down_proj"},
      {"mlp.gate_up", "mlp.gate_up_proj"},
      {"moe.router", "mlp.gate"}, {"moe.router.score_bias", "mlp.gate|e_score_correction_bias"},
      {"moe.expert.gate", "mlp.experts.{e}.gate_proj"},
      {"moe.expert.up", "mlp.experts.{e}.up_proj"},
      {"moe.expert.down", "mlp.experts.{e}.down_proj"},
      {"moe.shared.gate", "mlp.shared_experts.gate_proj"},
      {"moe.shared.up", "mlp.shared_experts.up_proj"},
      {"moe.shared.down", "mlp.shared_experts.down_proj"},
  };
  if (m.model_type == "mixtral") {
    s["moe.router"] = "block_sparse_moe.gate";
    s["moe.expert.gate"] = "block_sparse_moe.experts.{e}.w1";
    s["moe.expert.down"] = "block_sparse_moe.experts.{e}.w2";
    s["moe.expert.up"] = "block_sparse_moe.experts.{e}.w3";
  }
  if (m.model_type == "qwen2_moe") {
    s["moe.shared.gate"] = "mlp.shared_expert.gate_proj";
    s["moe.shared.up"] = "mlp.shared_expert.up_proj";
    s["moe.shared.down"] = "mlp.shared_expert.down_proj";
    s["moe.shared_gate"] = "mlp.shared_expert_gate";
  }
  if (m.model_type == "gpt_oss") {
    s["moe.router"] = "mlp.router";
    s["moe.experts.gate_up"] = "mlp.experts|gate_up_proj";
    s["moe.experts.gate_up_bias"] = "mlp.experts|gate_up_proj_bias";
    s["moe.experts.down"] = "mlp.experts|down_proj";
    s["moe.experts.down_bias"] = "mlp.experts|down_proj_bias";
  }
  if (m.model_type == "phi") {
    s["attn.o"] = "self_attn.dense";
    s["attn.q_norm"] = "self_attn.q_layernorm";
    s["attn.k_norm"] = "self_attn.k_layernorm";
    s["mlp.up"] = "mlp.fc1";
    s["mlp.down"] = "mlp.fc2";
  }
  return s;
}

Scheme scheme_of(const ModelSpec& m) {
  const std::string& t = m.model_type;
  if (t == "gpt2")
    return {"transformer.wte", "transformer.wpe", "transformer.h.{}", "transformer.ln_f", "lm_head",
            {{"norm_attn", "ln_1"}, {"norm_mlp", "ln_2"}, {"attn.qkv", "attn.c_attn"},
             {"attn.o", "attn.c_proj"}, {"mlp.up", "mlp.c_fc"}, {"mlp.down", "mlp.c_proj"}},
            true, true};
  if (t == "gpt_neox")
    return {"gpt_neox.embed_in", "", "gpt_neox.layers.{}", "gpt_neox.final_layer_norm",
            "embed_out",
            {{"norm_attn", "input_layernorm"}, {"norm_mlp", "post_attention_layernorm"},
             {"attn.qkv", "attention.query_key_value"}, {"attn.o", "attention.dense"},
             {"mlp.up", "mlp.dense_h_to_4h"}, {"mlp.down", "mlp.dense_4h_to_h"}},
            false, true};
  if (t == "opt")
    return {"model.decoder.embed_tokens", "model.decoder.embed_positions",
            "model.decoder.layers.{}", "model.decoder.final_layer_norm", "lm_head",
            {{"norm_attn", "self_attn_layer_norm"}, {"norm_mlp", "final_layer_norm"},
             {"attn.q", "self_attn.q_proj"}, {"attn.k", "self_attn.k_proj"},
             {"attn.v", "self_attn.v_proj"}, {"attn.o", "self_attn.out_proj"},
             {"mlp.up", "fc1"}, {"mlp.down", "fc2"},
             {"embed_proj", "model.decoder.project_in"}, {"head_proj", "model.decoder.project_out"}},
            false, true};
  if (t == "falcon" || t == "bloom") {
    Scheme s{"transformer.word_embeddings", "", "transformer.h.{}", "transformer.ln_f", "lm_head",
             {{"attn.qkv", "self_attention.query_key_value"}, {"attn.o", "self_attention.dense"},
              {"mlp.up", "mlp.dense_h_to_4h"}, {"mlp.down", "mlp.dense_4h_to_h"},
              {"embed_norm", "transformer.word_embeddings_layernorm"}},
             false, true};
    const bool two = m.residual == Residual::parallel && m.parallel_norms == 2;
    s.slots["norm_attn"] = two ? "ln_attn" : "input_layernorm";
    s.slots["norm_mlp"] = two ? "ln_mlp" : "post_attention_layernorm";
    return s;
  }
  if (t == "bert") {
    // modeling_bert.py: BertModel under "bert."; BertForMaskedLM's and BertForPreTraining's
    // heads under "cls." (predictions, seq_relationship), BertForSequenceClassification's
    // "classifier". The MLM decoder's weight is the word embedding (tied) and its bias
    // cls.predictions.bias: neither is listed twice.
    Scheme s{"bert.embeddings.word_embeddings", "bert.embeddings.position_embeddings",
             "bert.encoder.layer.{}", "", "cls.predictions.decoder",
             {{"type", "bert.embeddings.token_type_embeddings"},
              {"embed_norm", "bert.embeddings.LayerNorm"},
              {"attn.q", "attention.self.query"}, {"attn.k", "attention.self.key"},
              {"attn.v", "attention.self.value"}, {"attn.o", "attention.output.dense"},
              {"norm_attn", "attention.output.LayerNorm"},
              {"mlp.up", "intermediate.dense"}, {"mlp.down", "output.dense"},
              {"norm_mlp", "output.LayerNorm"},
              {"head.pooler", "bert.pooler.dense"},
              {"head.mlm", "cls.predictions"},
              {"head.mlm.dense", "cls.predictions.transform.dense"},
              {"head.mlm_norm", "cls.predictions.transform.LayerNorm"},
              {"head.cls", m.head == Head::seq_cls ? "classifier" : "cls.seq_relationship"}},
             false, false};
    return s;
  }
  if (t == "t5") {
    const std::string ff = m.mlp == Mlp::swiglu ? "wi_0" : "wi";
    return {"shared", "", "{}", "decoder.final_layer_norm", "lm_head",
            {{"norm_attn", "layer.0.layer_norm"}, {"attn.q", "layer.0.SelfAttention.q"},
             {"attn.k", "layer.0.SelfAttention.k"}, {"attn.v", "layer.0.SelfAttention.v"},
             {"attn.o", "layer.0.SelfAttention.o"},
             {"attn.rel_bias", "layer.0.SelfAttention.relative_attention_bias"},
             {"norm_cross", "layer.1.layer_norm"}, {"cross.q", "layer.1.EncDecAttention.q"},
             {"cross.k", "layer.1.EncDecAttention.k"}, {"cross.v", "layer.1.EncDecAttention.v"},
             {"cross.o", "layer.1.EncDecAttention.o"},
             {"norm_mlp", "layer.{ff}.layer_norm"}, {"mlp.gate", "layer.{ff}.DenseReluDense.wi_0"},
             {"mlp.up", m.mlp == Mlp::swiglu ? "layer.{ff}.DenseReluDense.wi_1"
                                              : "layer.{ff}.DenseReluDense.wi"},
             {"mlp.down", "layer.{ff}.DenseReluDense.wo"},
             {"enc_final_norm", "encoder.final_layer_norm"}},
            false, true};
  }
  Scheme s{"model.embed_tokens", "", "model.layers.{}",
           t == "phi" ? "model.final_layernorm" : "model.norm", "lm_head", llama_slots(m)};
  return s;
}

std::string replace_all(std::string s, std::string_view from, std::string_view to) {
  for (std::size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size()))
    s.replace(p, from.size(), to);
  return s;
}

// Module and leaf of one slot tensor.
std::pair<std::string, std::string> hf_name(const ModelSpec& m, const Scheme& s,
                                            const detail::SlotTensor& x) {
  std::string_view slot = x.slot;
  std::string base, leaf;
  const std::size_t dot = slot.rfind('.');
  // Slots "a.b.weight" / "a.b.bias" split into base and leaf; stacked expert tensors and
  // sinks have no leaf of their own.
  if (dot != std::string_view::npos &&
      (slot.substr(dot + 1) == "weight" || slot.substr(dot + 1) == "bias")) {
    base = std::string(slot.substr(0, dot));
    leaf = std::string(slot.substr(dot + 1));
  } else {
    base = std::string(slot);
  }
  std::string module;
  if (base == "embed") {
    module = s.embed;
  } else if (base == "pos") {
    module = s.pos;
  } else if (base == "final_norm") {
    module = s.final_norm;
  } else if (base == "head") {
    module = s.head;
  } else {
    const auto it = s.slots.find(base);
    if (it == s.slots.end())
      throw Error(fmt::format("internal: no {} name for slot '{}'", m.model_type, base));
    module = it->second;
    const bool top = base == "embed_norm" || base == "embed_proj" || base == "head_proj" ||
                     base == "enc_final_norm" || base == "type" || base.starts_with("head.");
    if (!top) {
      std::string prefix;
      if (m.model_type == "t5") {
        const bool dec = x.layer >= m.n_layer;
        prefix = fmt::format("{}.block.{}", dec ? "decoder" : "encoder",
                             dec ? x.layer - m.n_layer : x.layer);
        module = replace_all(module, "{ff}", dec ? "2" : "1");
      } else {
        prefix = fmt::format(fmt::runtime(s.layer_prefix), x.layer);
      }
      module = prefix + "." + module;
    }
  }
  if (x.expert >= 0) module = replace_all(module, "{e}", std::to_string(x.expert));
  const std::size_t bar = module.find('|');
  if (bar != std::string::npos) {
    leaf = module.substr(bar + 1);
    module = module.substr(0, bar);
  }
  return {module, leaf};
}

}  // namespace

namespace {

// Abandons a walk past its tensor limit.
struct TooManyTensors {};

// The inventory's sums, and with `list` its named tensors. Names cost a formatted string or
// two per tensor, which a model of many layers and experts has hundreds of thousands of: the
// sums alone (parse_hf_config's check) name a tensor only when its count overflows. More than
// `max_tensors` tensors: TooManyTensors, before any more are walked.
ParamInventory tally(const ModelSpec& m, bool list, int64_t max_tensors) {
  ParamInventory inv;
  const Scheme s = scheme_of(m);
  const int64_t head_layer = m.n_blocks();
  int64_t last_block = 0;
  std::map<int64_t, int64_t> routed_by_layer;
  detail::walk_params(m, [&](const detail::SlotTensor& x) {
    if (++inv.n_tensors > max_tensors) throw TooManyTensors{};
    int64_t n = 1;
    for (int64_t d : x.shape) {
      if (__builtin_mul_overflow(n, d, &n)) {
        auto [module, leaf] = hf_name(m, s, x);
        n = 1;
        for (int64_t e : x.shape) n = checked_mul(n, e, fmt::format("elements of {}.{}", module, leaf));
      }
    }
    inv.total = checked_add(inv.total, n, "total parameters");
    const std::string_view sl = x.slot;
    if (sl.starts_with("embed") || sl.starts_with("pos") || sl.starts_with("type.")) {
      if (!sl.starts_with("embed_norm") && !sl.starts_with("embed_proj")) inv.embedding += n;
    } else if (sl.starts_with("final_norm")) {
      inv.final_norm += n;
    } else if (sl.starts_with("head.")) {
      inv.head += n;
    }
    if (x.routed) {
      inv.experts += n;
      routed_by_layer[x.layer] += n;
    }
    if (x.layer >= 0 && x.layer < head_layer) {
      if (x.layer != last_block) {
        last_block = x.layer;
        inv.per_layer = 0;
      }
      inv.per_layer += n;
    }
    if (!list) return;
    auto [module, leaf] = hf_name(m, s, x);
    std::vector<int64_t> shape = x.shape;
    const bool block_linear = x.layer >= 0 && x.layer < head_layer && shape.size() == 2 &&
                              leaf == "weight" && !x.slot.starts_with("attn.rel_bias");
    if (s.conv1d && block_linear) std::swap(shape[0], shape[1]);
    const int layer = static_cast<int>(x.layer);
    inv.tensors.push_back({leaf.empty() ? module : module + "." + leaf, module, std::move(shape),
                           n, layer, std::string(x.slot), x.split, x.routed});
  }, s.norms_first);
  // Active parameters: a token passes k of the E routed experts of each MoE layer.
  int64_t inactive = 0;
  for (const auto& [l, n] : routed_by_layer)
    inactive += n / m.moe.n_experts * (m.moe.n_experts - m.moe.top_k);
  inv.active = inv.total - inactive;
  if (m.mtp_layers > 0) {
    // DeepSeek-V3's MTP module (V3 report sec. 2.2): a full MoE block, two RMSNorms of C
    // (enorm, hnorm), the projection eh_proj (C, 2C) and the shared head's norm; its embedding
    // and output head are the main model's (shared, not counted again).
    ModelSpec one = m;
    one.n_layer = m.moe.first_dense + 1;  // one MoE block is the last
    one.mtp_layers = 0;
    int64_t block = 0;
    detail::walk_params(one, [&](const detail::SlotTensor& x) {
      if (x.layer != one.n_layer - 1) return;
      int64_t n = 1;
      for (int64_t d : x.shape) n = checked_mul(n, d, "MTP block");
      block = checked_add(block, n, "MTP block");
    });
    const int64_t C = m.n_embd;
    const int64_t per = block + 3 * C + 2 * C * C;
    inv.mtp = checked_mul(per, m.mtp_layers, "MTP parameters");
  }
  // Largest module by its own parameters (tensors are grouped by module, in order).
  for (std::size_t i = 0; i < inv.tensors.size();) {
    int64_t sum = 0;
    std::size_t j = i;
    for (; j < inv.tensors.size() && inv.tensors[j].module == inv.tensors[i].module; ++j)
      sum += inv.tensors[j].numel;
    if (sum > inv.largest_module_params) {
      inv.largest_module_params = sum;
      inv.largest_module = inv.tensors[i].module;
    }
    i = j;
  }
  return inv;
}

}  // namespace

ParamInventory count_params(const ModelSpec& m) {
  return tally(m, true, std::numeric_limits<int64_t>::max());
}

ParamInventory count_param_totals(const ModelSpec& m, int64_t max_tensors, const std::string& origin) {
  try {
    return tally(m, false, max_tensors);
  } catch (const TooManyTensors&) {
    const bool moe = m.moe.n_experts > 0;
    throw Error(fmt::format("{}: {} layers{} make more than {} parameter tensors, which is "
                            "more than zeroplan lists",
                            origin, m.n_blocks(),
                            moe ? fmt::format(" of {} experts", m.moe.n_experts) : "", max_tensors),
                fmt::format("check {}: published models have under 100000 (DeepSeek-V3: 45337)",
                            moe ? "the layer count (num_hidden_layers) and the expert count"
                                : "the layer count (num_hidden_layers, n_layer)"));
  }
}

}  // namespace zp::models
