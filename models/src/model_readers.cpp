// model_readers.cpp: one short reader per Hugging Face model_type, from its config.json fields
// onto the recipe (ModelSpec), and the config-level entry points (parse, write back, load).
// Field names and defaults are those of transformers' configuration_<type>.py (and, where Hub
// files were written by a model repo's own code, that code's); hf_fields.cpp lists every field
// each class writes. Not the parameter inventory (param_inventory.cpp) nor the graph.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <functional>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "hf_fields.hpp"
#include "zp/checked.hpp"
#include "zp/error.hpp"
#include "zp/json_fields.hpp"
#include "zp/models/model_spec.hpp"

namespace zp::models {
namespace {

using nlohmann::json;

// ---- reading fields, remembering which were read -----------------------------------------

class Cfg {
 public:
  Cfg(const json& j, std::string origin, std::string type)
      : j_(j), f_(j, origin), origin_(std::move(origin)), type_(std::move(type)) {}

  const std::string& origin() const { return origin_; }
  const std::string& type() const { return type_; }
  bool has(std::string_view k) { return mark(k), f_.has(k); }
  int64_t pos(std::string_view k) { return mark(k), f_.positive_int(k); }
  int64_t pos(std::string_view k, int64_t d) { return mark(k), f_.positive_int(k, d); }
  std::optional<int64_t> opt(std::string_view k) { return mark(k), f_.optional_positive_int(k); }
  int64_t nonneg(std::string_view k, int64_t d) { return mark(k), f_.nonneg_int(k, d); }
  bool flag(std::string_view k, bool d) { return mark(k), f_.boolean(k, d); }
  double prob(std::string_view k, double d) { return mark(k), f_.probability(k, d); }
  std::string str(std::string_view k, std::string d) { return mark(k), f_.string(k, std::move(d)); }
  double number(std::string_view k, double d) {
    mark(k);
    if (!f_.has(k)) return d;
    const json& v = j_.at(std::string(k));
    if (!v.is_number()) f_.fail(k, "a number");
    return v.get<double>();
  }
  // The first of several names that is present (renamed fields), else the fallback.
  int64_t pos_any(std::initializer_list<std::string_view> ks, int64_t d) {
    for (auto k : ks)
      if (has(k)) return pos(k);
    return d;
  }
  int64_t pos_any(std::initializer_list<std::string_view> ks) {
    for (auto k : ks)
      if (has(k)) return pos(k);
    return pos(*ks.begin());  // the error names the canonical field
  }
  const json* raw(std::string_view k) {
    mark(k);
    return f_.has(k) ? &j_.at(std::string(k)) : nullptr;
  }
  std::vector<int64_t> int_list(std::string_view k) {
    std::vector<int64_t> out;
    const json* v = raw(k);
    if (v == nullptr) return out;
    if (!v->is_array()) f_.fail(k, "a list of layer indices");
    for (const json& x : *v) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0) f_.fail(k, "a list of layer indices");
      out.push_back(x.get<int64_t>());
    }
    return out;
  }
  [[noreturn]] void fail(std::string_view what, std::string_view hint = {}) const {
    throw Error(fmt::format("{}: {}", origin_, what), std::string(hint));
  }
  const std::set<std::string, std::less<>>& read() const { return read_; }

 private:
  void mark(std::string_view k) { read_.emplace(k); }
  const json& j_;
  Fields f_;
  std::string origin_, type_;
  std::set<std::string, std::less<>> read_;
};

// ---- shared pieces of the readers --------------------------------------------------------

// Heads, key/value heads and the head size, with the checks every attention needs.
void read_heads(Cfg& c, ModelSpec& m, std::string_view heads_key, std::string_view kv_key,
                std::string_view hidden_key) {
  m.n_head = c.pos(heads_key);
  m.n_kv_head = kv_key.empty() ? m.n_head : c.opt(kv_key).value_or(m.n_head);
  if (m.n_kv_head > m.n_head || m.n_head % m.n_kv_head != 0)
    c.fail(fmt::format("{} {} is not divisible by {} {}", heads_key, m.n_head, kv_key,
                       m.n_kv_head),
           "grouped-query attention shares each key/value head among a whole number of query "
           "heads");
  if (auto hd = c.opt("head_dim")) {
    m.head_dim = *hd;
  } else {
    if (m.n_embd % m.n_head != 0)
      c.fail(fmt::format("{} {} is not divisible by {} {}", hidden_key, m.n_embd, heads_key,
                         m.n_head),
             "the hidden size must split evenly into attention heads (or set head_dim)");
    m.head_dim = m.n_embd / m.n_head;
  }
}

// The sizes every decoder config has, under the names its family uses.
struct SizeKeys {
  std::string_view layers = "num_hidden_layers", hidden = "hidden_size",
                   heads = "num_attention_heads", kv = "num_key_value_heads",
                   inner = "intermediate_size";
  int64_t positions = 2048, vocab = 32000;
};
void read_sizes(Cfg& c, ModelSpec& m, const SizeKeys& k) {
  m.n_layer = c.pos(k.layers);
  m.n_embd = c.pos(k.hidden);
  read_heads(c, m, k.heads, k.kv, k.hidden);
  m.n_inner = c.pos(k.inner);
  m.n_positions = c.pos("max_position_embeddings", k.positions);
  m.vocab_size = c.pos("vocab_size", k.vocab);
}

// Partial rotary embeddings: the fraction of each head's dimensions that rotates.
void read_rotary_fraction(Cfg& c, ModelSpec& m, std::string_view key, double fallback) {
  const double frac = c.number(key, fallback);
  if (!(frac > 0 && frac <= 1)) c.fail(fmt::format("field '{}' must be in (0, 1]", key));
  m.positions = Positions::rotary;
  m.rotary_dim = static_cast<int64_t>(static_cast<double>(m.head_dim) * frac);
}

// rope_theta and the rope_scaling object (transformers v5's rope_parameters, which may carry
// rope_theta too): the frequencies the runtime computes (runtime/rope.hpp). No variant adds
// parameters, so the planner reads none of it.
void read_rope(Cfg& c, ModelSpec& m) {
  RopeSpec& r = m.rope;
  r.theta = c.number("rope_theta", 10000.0);
  const json* params = c.raw("rope_parameters");
  const json* scaling = c.raw("rope_scaling");
  const bool use_params = params != nullptr && !params->is_null();
  const json* s = use_params ? params : scaling;
  const std::string field = use_params ? "rope_parameters" : "rope_scaling";
  if (s != nullptr && !s->is_null()) {
    if (!s->is_object()) c.fail(fmt::format("field '{}' must be an object or null", field));
    auto num = [&](const char* k, double d) {
      const auto it = s->find(k);
      if (it == s->end() || it->is_null()) return d;
      if (!it->is_number()) c.fail(fmt::format("field '{}.{}' must be a number", field, k));
      return it->get<double>();
    };
    for (const char* k : {"rope_type", "type"}) {
      const auto it = s->find(k);
      if (it == s->end()) continue;
      if (!it->is_string()) c.fail(fmt::format("field '{}.{}' must be a string", field, k));
      r.type = it->get<std::string>();
      break;
    }
    r.theta = num("rope_theta", r.theta);
    r.factor = num("factor", 1.0);
    r.low_freq_factor = num("low_freq_factor", 1.0);
    r.high_freq_factor = num("high_freq_factor", 4.0);
    r.original_max_positions = static_cast<int64_t>(num("original_max_position_embeddings", 0.0));
    r.attention_factor = num("attention_factor", 0.0);
    r.beta_fast = num("beta_fast", 32.0);
    r.beta_slow = num("beta_slow", 1.0);
    if (!(r.factor > 0))
      c.fail(fmt::format("field '{}.factor' must be positive, got {}", field, r.factor));
  }
  if (!(r.theta > 0)) c.fail(fmt::format("field 'rope_theta' must be positive, got {}", r.theta));
}

// transformers' LLaMA-style decoder fields (llama, mistral, mixtral, qwen*, olmo2, gemma*,
// deepseek*, gpt_oss share them).
void read_llama_core(Cfg& c, ModelSpec& m, int64_t default_positions, int64_t default_vocab) {
  read_sizes(c, m, SizeKeys{.positions = default_positions, .vocab = default_vocab});
  m.norm = Norm::rmsnorm;
  m.mlp = Mlp::swiglu;
  m.positions = Positions::rotary;
  m.rotary_dim = m.head_dim;
  m.activation = c.str("hidden_act", "silu");
  m.attn_dropout = c.prob("attention_dropout", 0.0);
  m.resid_dropout = 0.0;
  m.embd_dropout = 0.0;
  m.tied_embeddings = c.flag("tie_word_embeddings", false);
  const bool bias = c.flag("attention_bias", false);
  m.qkv_bias = m.out_bias = bias;
  m.mlp_bias = c.flag("mlp_bias", false);
  m.norm_eps = c.number("rms_norm_eps", 1e-6);
  read_rope(c, m);
}

// sliding_window with the ways configs say where it applies.
void read_window(Cfg& c, ModelSpec& m, bool all_layers_default) {
  const json* w = c.raw("sliding_window");
  if (w == nullptr) return;
  if (!w->is_number_integer() || w->get<int64_t>() < 0)
    c.fail("field 'sliding_window' must be a non-negative integer or null");
  m.window.size = w->get<int64_t>();
  if (m.window.size == 0) return;
  if (c.has("layer_types")) {
    const json* lt = c.raw("layer_types");
    if (!lt->is_array() || lt->empty())
      c.fail("field 'layer_types' must be a list of \"sliding_attention\" / \"full_attention\"");
    for (const json& x : *lt) {
      if (!x.is_string()) c.fail("field 'layer_types' must be a list of strings");
      const std::string s = x.get<std::string>();
      if (s != "sliding_attention" && s != "full_attention")
        c.fail(fmt::format("field 'layer_types': unknown layer type '{}'", s),
               "zeroplan reads \"sliding_attention\" and \"full_attention\"");
      m.window.pattern.push_back(s == "sliding_attention");
    }
    return;
  }
  if (!all_layers_default) m.window.size = 0;
}

void read_moe_router(Cfg& c) {
  (void)c.flag("norm_topk_prob", false);
  (void)c.flag("output_router_logits", false);
  (void)c.number("router_aux_loss_coef", 0.001);
  (void)c.number("router_jitter_noise", 0.0);
}

void check_top_k(Cfg& c, const ModelSpec& m, std::string_view k_key, std::string_view e_key) {
  if (m.moe.top_k > m.moe.n_experts)
    c.fail(fmt::format("{} {} is larger than {} {}", k_key, m.moe.top_k, e_key, m.moe.n_experts),
           "each token is routed to at most every expert once");
}

// ---- the readers -------------------------------------------------------------------------

ModelSpec read_gpt2(Cfg& c) {
  ModelSpec m;
  m.n_layer = c.pos("n_layer");
  m.n_embd = c.pos("n_embd");
  m.n_head = c.pos("n_head");
  m.n_kv_head = m.n_head;
  m.n_positions = c.pos("n_positions", 1024);
  (void)c.opt("n_ctx");  // an old alias of n_positions; no shape of its own
  m.vocab_size = c.pos("vocab_size", 50257);
  if (m.n_embd % m.n_head != 0)
    c.fail(fmt::format("n_embd {} is not divisible by n_head {}", m.n_embd, m.n_head),
           "the hidden size must split evenly into attention heads");
  m.head_dim = m.n_embd / m.n_head;
  m.norm_eps = c.number("layer_norm_epsilon", 1e-5);
  m.n_inner = c.opt("n_inner").value_or(checked_mul(int64_t{4}, m.n_embd, "n_inner = 4 * n_embd"));
  m.tied_embeddings = c.flag("tie_word_embeddings", true);
  m.activation = c.str("activation_function", "gelu_new");
  m.attn_dropout = c.prob("attn_pdrop", 0.1);
  m.resid_dropout = c.prob("resid_pdrop", 0.1);
  m.embd_dropout = c.prob("embd_pdrop", 0.1);
  m.fused_qkv = true;
  return m;
}

ModelSpec read_llama(Cfg& c) {
  ModelSpec m;
  read_llama_core(c, m, 2048, 32000);
  (void)c.pos("pretraining_tp", 1);  // type-checked; it changes no shape or memory
  return m;
}

ModelSpec read_mistral(Cfg& c) {
  ModelSpec m;
  read_llama_core(c, m, 4096 * 32, 32000);
  read_window(c, m, true);
  return m;
}

ModelSpec read_mixtral(Cfg& c) {
  ModelSpec m = read_mistral(c);
  m.moe.n_experts = c.pos("num_local_experts", 8);
  m.moe.top_k = c.pos("num_experts_per_tok", 2);
  m.moe.expert_inner = m.n_inner;
  read_moe_router(c);
  check_top_k(c, m, "num_experts_per_tok", "num_local_experts");
  return m;
}

// Qwen2 / Qwen3: q, k, v biases (Qwen2 always, Qwen3 by attention_bias), sliding window only
// with use_sliding_window, on layers from max_window_layers on.
ModelSpec read_qwen(Cfg& c, bool qwen3) {
  ModelSpec m;
  read_llama_core(c, m, 32768, 151936);
  if (!qwen3) {
    m.qkv_bias = true;  // Qwen2Attention: q/k/v with bias, o_proj without
    m.out_bias = false;
  } else {
    m.qk_norm = QkNorm::head;
  }
  const bool use_sw = c.flag("use_sliding_window", false);
  const int64_t from = c.nonneg("max_window_layers", 28);
  read_window(c, m, use_sw);
  if (use_sw && m.window.size > 0 && m.window.pattern.empty()) m.window.from_layer = from;
  return m;
}

ModelSpec read_qwen_moe(Cfg& c, bool qwen3) {
  ModelSpec m = read_qwen(c, qwen3);
  m.moe.n_experts = c.pos("num_experts", qwen3 ? 128 : 60);
  m.moe.top_k = c.pos("num_experts_per_tok", qwen3 ? 8 : 4);
  m.moe.expert_inner = c.pos("moe_intermediate_size", qwen3 ? 768 : 1408);
  m.moe.step = c.pos("decoder_sparse_step", 1);
  m.moe.phase = m.moe.step - 1;  // (layer_idx + 1) % decoder_sparse_step == 0
  m.moe.dense_layers = c.int_list("mlp_only_layers");
  if (!qwen3) {
    m.moe.shared_inner = c.nonneg("shared_expert_intermediate_size", 5632);
    m.moe.shared_gate = m.moe.shared_inner > 0;
  }
  read_moe_router(c);
  check_top_k(c, m, "num_experts_per_tok", "num_experts");
  return m;
}

ModelSpec read_olmo2(Cfg& c) {
  ModelSpec m;
  read_llama_core(c, m, 2048, 50304);
  m.norm_place = NormPlace::post_sublayer;
  m.qk_norm = QkNorm::full;
  return m;
}

// Gemma 1/2/3: tied head, head_dim given, GeGLU; 2 and 3 sandwich each sublayer in norms.
ModelSpec read_gemma(Cfg& c, int version) {
  ModelSpec m;
  read_llama_core(c, m, 8192, 256000);
  m.tied_embeddings = c.flag("tie_word_embeddings", true);
  const std::string act = c.str("hidden_activation", "");
  if (!act.empty()) m.activation = act;
  (void)c.number("query_pre_attn_scalar", 256);
  m.attn_softcap = c.number("attn_logit_softcapping", 0);
  m.final_softcap = c.number("final_logit_softcapping", 0);
  if (m.attn_softcap < 0 || m.final_softcap < 0)
    c.fail("fields 'attn_logit_softcapping' and 'final_logit_softcapping' must be >= 0 or null");
  (void)c.number("rope_local_base_freq", 10000.0);
  if (version >= 2) {
    m.norm_place = NormPlace::sandwich;
    const int64_t pattern = c.pos("sliding_window_pattern", version == 2 ? 2 : 6);
    read_window(c, m, true);
    if (m.window.size > 0 && m.window.pattern.empty()) {
      // Gemma 2: even layers slide; Gemma 3: every `pattern`-th layer is global.
      for (int64_t i = 0; i < pattern; ++i)
        m.window.pattern.push_back(version == 2 ? i % 2 == 0 : (i + 1) % pattern != 0);
    }
  }
  if (version >= 3) m.qk_norm = QkNorm::head;
  return m;
}

ModelSpec read_phi(Cfg& c) {
  ModelSpec m;
  read_sizes(c, m, SizeKeys{.vocab = 51200});
  m.residual = Residual::parallel;
  m.parallel_norms = 1;
  read_rotary_fraction(c, m, "partial_rotary_factor", 0.5);
  if (c.flag("qk_layernorm", false)) m.qk_norm = QkNorm::head;
  m.activation = c.str("hidden_act", "gelu_new");
  m.tied_embeddings = c.flag("tie_word_embeddings", false);
  m.head_bias = true;
  m.attn_dropout = c.prob("attention_dropout", 0.0);
  m.resid_dropout = c.prob("resid_pdrop", 0.0);
  m.embd_dropout = c.prob("embd_pdrop", 0.0);
  m.norm_eps = c.number("layer_norm_eps", 1e-5);
  read_rope(c, m);
  return m;
}

ModelSpec read_phi3(Cfg& c) {
  ModelSpec m;
  read_llama_core(c, m, 4096, 32064);
  m.qkv_bias = m.out_bias = m.mlp_bias = false;
  m.fused_qkv = true;
  m.fused_gate_up = true;
  read_rotary_fraction(c, m, "partial_rotary_factor", 1.0);
  m.resid_dropout = c.prob("resid_pdrop", 0.0);
  m.embd_dropout = c.prob("embd_pdrop", 0.0);
  (void)c.opt("original_max_position_embeddings");
  read_window(c, m, true);
  return m;
}

ModelSpec read_gpt_neox(Cfg& c) {
  ModelSpec m;
  read_sizes(c, m, SizeKeys{.kv = "", .vocab = 50432});
  read_rotary_fraction(c, m, c.has("rotary_pct") ? "rotary_pct" : "partial_rotary_factor", 0.25);
  (void)c.number("rotary_emb_base", 10000);
  read_rope(c, m);
  if (c.flag("use_parallel_residual", true)) {
    m.residual = Residual::parallel;
    m.parallel_norms = 2;
  }
  m.qkv_bias = m.out_bias = c.flag("attention_bias", true);
  m.fused_qkv = true;
  m.activation = c.str("hidden_act", "gelu");
  m.tied_embeddings = c.flag("tie_word_embeddings", false);
  m.attn_dropout = c.prob("attention_dropout", 0.0);
  m.resid_dropout = c.prob("hidden_dropout", 0.0);
  m.norm_eps = c.number("layer_norm_eps", 1e-5);
  return m;
}

ModelSpec read_opt(Cfg& c) {
  ModelSpec m;
  read_sizes(c, m, SizeKeys{.kv = "", .inner = "ffn_dim", .vocab = 50272});
  m.position_offset = 2;  // OPTLearnedPositionalEmbedding: num_embeddings + 2
  const int64_t proj = c.pos("word_embed_proj_dim", m.n_embd);
  if (proj != m.n_embd) m.embed_proj_dim = proj;
  // Post-LN OPT (opt-350m) has no final LayerNorm: modeling_opt.py OPTDecoder makes
  // final_layer_norm only when do_layer_norm_before (and not _remove_final_layer_norm).
  if (!c.flag("do_layer_norm_before", true)) {
    m.norm_place = NormPlace::post_residual;
    m.final_norm = false;
  }
  const bool bias = c.flag("enable_bias", true);
  m.qkv_bias = m.out_bias = m.mlp_bias = bias;
  if (!c.flag("layer_norm_elementwise_affine", true))
    c.fail("field 'layer_norm_elementwise_affine': false (LayerNorms without weights) is not "
           "supported", "zeroplan's OPT recipe has affine LayerNorms");
  if (c.flag("_remove_final_layer_norm", false))
    c.fail("field '_remove_final_layer_norm': true is not supported",
           "only the OPT-350m checkpoint's old conversion sets it");
  m.activation = c.str("activation_function", "relu");
  m.tied_embeddings = c.flag("tie_word_embeddings", true);
  m.attn_dropout = c.prob("attention_dropout", 0.0);
  m.resid_dropout = c.prob("dropout", 0.1);
  m.embd_dropout = m.resid_dropout;  // OPTDecoder drops the embedded input with config.dropout
  (void)c.prob("layerdrop", 0.0);
  return m;
}

ModelSpec read_falcon(Cfg& c) {
  ModelSpec m;
  m.n_layer = c.pos_any({"num_hidden_layers", "n_layer"});
  m.n_embd = c.pos_any({"hidden_size", "n_embed"});
  m.n_head = c.pos_any({"num_attention_heads", "n_head"});
  if (m.n_embd % m.n_head != 0)
    c.fail(fmt::format("hidden_size {} is not divisible by num_attention_heads {}", m.n_embd,
                       m.n_head));
  m.head_dim = m.n_embd / m.n_head;
  const bool new_arch = c.flag("new_decoder_architecture", false);
  const bool multi_query = c.flag("multi_query", true);
  if (new_arch) {
    m.n_kv_head = c.pos_any({"num_kv_heads", "n_head_kv"}, m.n_head);
  } else {
    m.n_kv_head = multi_query ? 1 : m.n_head;
    (void)c.opt("num_kv_heads");
  }
  if (m.n_head % m.n_kv_head != 0)
    c.fail(fmt::format("num_attention_heads {} is not divisible by num_kv_heads {}", m.n_head,
                       m.n_kv_head));
  m.n_inner = c.pos("ffn_hidden_size", checked_mul(int64_t{4}, m.n_embd, "4 * hidden_size"));
  m.n_positions = c.pos("max_position_embeddings", 2048);
  m.vocab_size = c.pos("vocab_size", 65024);
  m.fused_qkv = true;
  const bool bias = c.flag("bias", false);
  m.qkv_bias = m.out_bias = m.mlp_bias = bias;
  m.positions = c.flag("alibi", false) ? Positions::alibi : Positions::rotary;
  if (m.positions == Positions::rotary) m.rotary_dim = m.head_dim;
  read_rope(c, m);
  const bool parallel = c.flag("parallel_attn", true);
  if (new_arch || parallel) {
    m.residual = Residual::parallel;
    m.parallel_norms = new_arch ? static_cast<int>(c.pos("num_ln_in_parallel_attn", 2)) : 1;
    if (m.parallel_norms != 1 && m.parallel_norms != 2)
      c.fail("field 'num_ln_in_parallel_attn' must be 1 or 2");
  }
  m.activation = c.str("activation", "gelu");
  m.tied_embeddings = c.flag("tie_word_embeddings", true);
  m.attn_dropout = c.prob("attention_dropout", 0.0);
  m.resid_dropout = c.prob("hidden_dropout", 0.0);
  m.norm_eps = c.number("layer_norm_epsilon", 1e-5);
  return m;
}

ModelSpec read_bloom(Cfg& c) {
  ModelSpec m;
  m.n_layer = c.pos_any({"n_layer", "num_hidden_layers"});
  m.n_embd = c.pos_any({"hidden_size", "n_embed"}, 64);
  m.n_head = c.pos_any({"n_head", "num_attention_heads"}, 8);
  if (m.n_embd % m.n_head != 0)
    c.fail(fmt::format("hidden_size {} is not divisible by n_head {}", m.n_embd, m.n_head));
  m.n_kv_head = m.n_head;
  m.head_dim = m.n_embd / m.n_head;
  m.n_inner = checked_mul(int64_t{4}, m.n_embd, "4 * hidden_size");  // BloomMLP: 4h, fixed
  m.n_positions = c.pos("seq_length", 2048);  // ALiBi: no table; a default context to plan
  m.vocab_size = c.pos("vocab_size", 250880);
  m.positions = Positions::alibi;
  m.embed_norm = true;
  m.fused_qkv = true;
  m.activation = "gelu";
  m.tied_embeddings = c.flag("tie_word_embeddings", true);
  m.attn_dropout = c.prob("attention_dropout", 0.0);
  m.resid_dropout = c.prob("hidden_dropout", 0.0);
  (void)c.flag("apply_residual_connection_post_layernorm", false);  // which tensor is added
  (void)c.pos("pretraining_tp", 1);
  m.norm_eps = c.number("layer_norm_epsilon", 1e-5);
  return m;
}

// DeepSeek V2 / V3 (transformers' classes and deepseek-ai's remote code write the same names).
ModelSpec read_deepseek(Cfg& c, bool v3) {
  ModelSpec m;
  m.n_layer = c.pos("num_hidden_layers");
  m.n_embd = c.pos("hidden_size");
  m.n_head = c.pos("num_attention_heads");
  m.n_kv_head = c.opt("num_key_value_heads").value_or(m.n_head);  // unused by MLA
  m.n_inner = c.pos("intermediate_size");
  m.n_positions = c.pos("max_position_embeddings", v3 ? 4096 : 2048);
  m.vocab_size = c.pos("vocab_size", v3 ? 129280 : 102400);
  m.norm = Norm::rmsnorm;
  m.mlp = Mlp::swiglu;
  m.positions = Positions::rotary;
  m.attention = Attention::mla;
  const json* ql = c.raw("q_lora_rank");
  m.mla.q_lora_rank = ql == nullptr ? 0 : c.pos("q_lora_rank");
  m.mla.kv_lora_rank = c.pos("kv_lora_rank", 512);
  m.mla.qk_nope_head_dim = c.pos("qk_nope_head_dim", 128);
  m.mla.qk_rope_head_dim = c.pos("qk_rope_head_dim", 64);
  m.mla.v_head_dim = c.pos("v_head_dim", 128);
  m.head_dim = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim;
  m.rotary_dim = m.mla.qk_rope_head_dim;
  m.qkv_bias = m.out_bias = c.flag("attention_bias", false);
  m.mlp_bias = false;
  m.activation = c.str("hidden_act", "silu");
  m.tied_embeddings = c.flag("tie_word_embeddings", false);
  m.attn_dropout = c.prob("attention_dropout", 0.0);
  (void)c.opt("head_dim");
  read_rope(c, m);
  m.norm_eps = c.number("rms_norm_eps", 1e-6);
  const json* routed = c.raw("n_routed_experts");
  if (routed != nullptr) {
    m.moe.n_experts = c.pos("n_routed_experts");
    m.moe.top_k = c.pos("num_experts_per_tok");
    m.moe.expert_inner = c.pos("moe_intermediate_size");
    m.moe.shared_inner = checked_mul(c.nonneg("n_shared_experts", 0), m.moe.expert_inner,
                                     "n_shared_experts * moe_intermediate_size");
    m.moe.first_dense = c.nonneg("first_k_dense_replace", 0);
    m.moe.step = c.pos("moe_layer_freq", 1);
    m.moe.score_bias = v3 && c.str("topk_method", "noaux_tc") == "noaux_tc";
    check_top_k(c, m, "num_experts_per_tok", "n_routed_experts");
  }
  for (auto k : {"ep_size", "n_group", "topk_group"}) (void)c.opt(k);
  for (auto k : {"routed_scaling_factor", "aux_loss_alpha"}) (void)c.number(k, 1.0);
  for (auto k : {"norm_topk_prob", "seq_aux"}) (void)c.flag(k, false);
  for (auto k : {"scoring_func", "topk_method"}) (void)c.str(k, "");
  m.mtp_layers = c.nonneg("num_nextn_predict_layers", 0);
  return m;
}

ModelSpec read_gpt_oss(Cfg& c) {
  ModelSpec m;
  read_llama_core(c, m, 131072, 201088);
  m.qkv_bias = m.out_bias = c.flag("attention_bias", true);
  m.attn_sinks = true;
  m.moe.n_experts = c.pos("num_local_experts", 128);
  m.moe.top_k = c.pos_any({"num_experts_per_tok", "experts_per_token"}, 4);
  (void)c.opt("experts_per_token");
  m.moe.expert_inner = m.n_inner;
  m.moe.router_bias = true;
  m.moe.expert_bias = true;
  m.fused_gate_up = true;
  (void)c.number("swiglu_limit", 7.0);
  (void)c.opt("initial_context_length");
  read_window(c, m, true);
  read_moe_router(c);
  check_top_k(c, m, "num_experts_per_tok", "num_local_experts");
  return m;
}

ModelSpec read_t5(Cfg& c) {
  ModelSpec m;
  m.n_embd = c.pos("d_model", 512);
  m.head_dim = c.pos("d_kv", 64);
  m.n_inner = c.pos("d_ff", 2048);
  m.n_layer = c.pos("num_layers", 6);
  m.n_decoder_layer = c.pos("num_decoder_layers", m.n_layer);
  m.n_head = c.pos("num_heads", 8);
  m.n_kv_head = m.n_head;
  m.vocab_size = c.pos("vocab_size", 32128);
  m.n_positions = c.pos("n_positions", 512);  // no table (relative buckets): a default context
  m.relative_buckets = c.pos("relative_attention_num_buckets", 32);
  (void)c.pos("relative_attention_max_distance", 128);
  m.positions = Positions::relative;
  m.norm = Norm::rmsnorm;
  m.qkv_bias = m.out_bias = m.mlp_bias = false;
  const std::string ff = c.str("feed_forward_proj", "relu");
  const bool gated = ff.starts_with("gated-");
  m.activation = gated ? ff.substr(6) : ff;
  if (m.activation != "relu" && m.activation != "gelu" && m.activation != "gelu_new" &&
      m.activation != "silu")
    c.fail(fmt::format("field 'feed_forward_proj': '{}' is not a T5 feed-forward", ff),
           "T5 reads \"relu\", \"gelu\" or \"gated-<act>\" (e.g. \"gated-gelu\")");
  m.mlp = gated ? Mlp::swiglu : Mlp::gelu;
  // T5Config: "gated-gelu" means gelu_new (kept for the original T5 v1.1 checkpoints).
  if (ff == "gated-gelu") m.activation = "gelu_new";
  (void)c.flag("is_gated_act", gated);
  (void)c.str("dense_act_fn", "");
  m.tied_embeddings = c.flag("tie_word_embeddings", true);
  m.attn_dropout = m.resid_dropout = m.embd_dropout = c.prob("dropout_rate", 0.1);
  m.norm_eps = c.number("layer_norm_epsilon", 1e-6);
  (void)c.number("initializer_factor", 1.0);
  return m;
}

// The classes of a classifier, as PretrainedConfig resolves them (configuration_utils.py
// __init__): id2label, when present, decides (num_labels is then ignored); else num_labels,
// default 2. label2id decides nothing.
int64_t read_num_labels(Cfg& c) {
  (void)c.raw("label2id");
  if (const json* id2label = c.raw("id2label")) {
    if (!id2label->is_object() || id2label->empty())
      c.fail("field 'id2label' must be a non-empty object of class names",
             "PretrainedConfig takes the number of labels from id2label");
    (void)c.raw("num_labels");
    return static_cast<int64_t>(id2label->size());
  }
  return c.pos("num_labels", 2);
}

// BERT (configuration_bert.py BertConfig; modeling_bert.py): a post-LN encoder with learned
// absolute and token-type embeddings and an embedding LayerNorm, biases everywhere, a plain
// MLP; the head from `architectures`.
ModelSpec read_bert(Cfg& c) {
  ModelSpec m;
  read_sizes(c, m, SizeKeys{.kv = "", .positions = 512, .vocab = 30522});
  m.norm_place = NormPlace::post_residual;
  m.final_norm = false;
  m.embed_norm = true;
  m.type_vocab_size = c.pos("type_vocab_size", 2);
  m.activation = c.str("hidden_act", "gelu");
  // ACT2FN names the docstring lists ("gelu", "relu", "silu", "gelu_new"), swish (silu's
  // alias) and gelu_pytorch_tanh (one native op); gelu is the erf GELU.
  static constexpr std::string_view kActs[] = {"gelu", "gelu_new", "gelu_pytorch_tanh", "relu",
                                               "silu", "swish"};
  if (std::find(std::begin(kActs), std::end(kActs), m.activation) == std::end(kActs))
    c.fail(fmt::format("field 'hidden_act': '{}' is not an activation zeroplan plans for BERT",
                       m.activation),
           "zeroplan reads \"gelu\", \"gelu_new\", \"gelu_pytorch_tanh\", \"relu\", \"silu\" "
           "or \"swish\"");
  const std::string pos = c.str("position_embedding_type", "absolute");
  if (pos != "absolute")
    c.fail(fmt::format("field 'position_embedding_type': '{}' is not supported", pos),
           "zeroplan plans BERT's absolute positions; relative_key and relative_key_query add "
           "a distance embedding and T x T score terms it does not model");
  if (c.flag("is_decoder", false))
    c.fail("field 'is_decoder': true (BERT as a causal decoder) is not supported",
           "zeroplan plans BERT as the bidirectional encoder it is pretrained as");
  m.resid_dropout = c.prob("hidden_dropout_prob", 0.1);
  m.embd_dropout = m.resid_dropout;  // BertEmbeddings.dropout is hidden_dropout_prob
  m.attn_dropout = c.prob("attention_probs_dropout_prob", 0.1);
  m.norm_eps = c.number("layer_norm_eps", 1e-12);
  (void)c.number("initializer_range", 0.02);
  (void)c.flag("use_cache", true);
  (void)c.raw("pad_token_id");
  // The head: the first architecture the config names (what save_pretrained wrote), else
  // BertForMaskedLM, which every google-bert checkpoint names.
  std::string arch = "BertForMaskedLM";
  if (const json* a = c.raw("architectures")) {
    if (!a->is_array() || a->empty() || !a->front().is_string())
      c.fail("field 'architectures' must be a list of class names");
    arch = a->front().get<std::string>();
  } else {
    m.notes.push_back("no 'architectures': planned as BertForMaskedLM (the masked-LM head)");
  }
  const std::string problem = c.str("problem_type", "");
  if (arch == "BertForSequenceClassification") {
    m.head = Head::seq_cls;
    m.pooler = true;
    m.n_labels = read_num_labels(c);
    m.tied_embeddings = false;  // no decoder to tie
    // classifier_dropout, else hidden_dropout_prob (BertForSequenceClassification.__init__).
    m.cls_dropout = c.prob("classifier_dropout", m.resid_dropout);
    (void)c.flag("tie_word_embeddings", true);  // nothing to tie
    // The loss (forward: problem_type, or regression for one label): every one of them reads
    // (B, num_labels) logits; the graph counts cross-entropy's tensors of that shape.
    if (m.n_labels == 1 || (!problem.empty() && problem != "single_label_classification"))
      m.notes.push_back(fmt::format(
          "{} loss planned as cross-entropy over (B, {}) logits: a few bytes apart",
          m.n_labels == 1 && problem.empty() ? "regression (num_labels 1)" : problem,
          m.n_labels));
  } else if (arch == "BertForMaskedLM" || arch == "BertForPreTraining") {
    m.head = Head::mlm;
    m.tied_embeddings = c.flag("tie_word_embeddings", true);
    (void)c.raw("classifier_dropout");
    if (arch == "BertForPreTraining") {  // BertPreTrainingHeads: + seq_relationship, 2 classes
      m.pooler = true;
      m.n_labels = 2;
    }
  } else {
    c.fail(fmt::format("field 'architectures': '{}' is not a BERT head zeroplan plans", arch),
           "zeroplan plans BertForSequenceClassification, BertForMaskedLM and "
           "BertForPreTraining; name the one you train first in 'architectures'");
  }
  return m;
}

struct Reader {
  std::string_view type;
  std::function<ModelSpec(Cfg&)> read;
  std::string_view layers_field;  // where the layer count lives (to write a depth back)
};

const std::vector<Reader>& readers() {
  static const std::vector<Reader> r = {
      {"gpt2", read_gpt2, "n_layer"},
      {"llama", read_llama, "num_hidden_layers"},
      {"mistral", read_mistral, "num_hidden_layers"},
      {"mixtral", read_mixtral, "num_hidden_layers"},
      {"qwen2", [](Cfg& c) { return read_qwen(c, false); }, "num_hidden_layers"},
      {"qwen2_moe", [](Cfg& c) { return read_qwen_moe(c, false); }, "num_hidden_layers"},
      {"qwen3", [](Cfg& c) { return read_qwen(c, true); }, "num_hidden_layers"},
      {"qwen3_moe", [](Cfg& c) { return read_qwen_moe(c, true); }, "num_hidden_layers"},
      {"gemma", [](Cfg& c) { return read_gemma(c, 1); }, "num_hidden_layers"},
      {"gemma2", [](Cfg& c) { return read_gemma(c, 2); }, "num_hidden_layers"},
      {"gemma3_text", [](Cfg& c) { return read_gemma(c, 3); }, "num_hidden_layers"},
      {"phi", read_phi, "num_hidden_layers"},
      {"phi3", read_phi3, "num_hidden_layers"},
      {"gpt_neox", read_gpt_neox, "num_hidden_layers"},
      {"opt", read_opt, "num_hidden_layers"},
      {"falcon", read_falcon, "num_hidden_layers"},
      {"bloom", read_bloom, "n_layer"},
      {"olmo2", read_olmo2, "num_hidden_layers"},
      {"deepseek_v2", [](Cfg& c) { return read_deepseek(c, false); }, "num_hidden_layers"},
      {"deepseek_v3", [](Cfg& c) { return read_deepseek(c, true); }, "num_hidden_layers"},
      {"gpt_oss", read_gpt_oss, "num_hidden_layers"},
      {"t5", read_t5, "num_layers"},
      {"bert", read_bert, "num_hidden_layers"},
  };
  return r;
}

// An unknown field could change the model's size when its name speaks of sizes or counts.
bool could_change_size(std::string_view key) {
  static constexpr std::string_view kWords[] = {
      "size", "dim", "num_", "n_", "layer", "head", "hidden", "inner", "intermediate",
      "expert", "vocab", "width", "rank", "embed", "position", "ffn", "d_", "bias", "proj",
      "moe", "kv", "lora", "shared", "block", "group", "window"};
  std::string k(key);
  std::transform(k.begin(), k.end(), k.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return std::any_of(std::begin(kWords), std::end(kWords),
                     [&](std::string_view w) { return k.find(w) != std::string::npos; });
}

bool in(std::span<const std::string_view> list, std::string_view key) {
  return std::find(list.begin(), list.end(), key) != list.end();
}

// After a reader: fields neither read nor known to its configuration class. Those that could
// change the size are refused, the rest noted.
void check_fields(const json& j, const Cfg& c, ModelSpec& m) {
  const auto common = hf::common_fields();
  const auto known = hf::type_fields(c.type());
  std::vector<std::string> ignored;
  for (const auto& [key, value] : j.items()) {
    if (c.read().contains(key) || in(common, key) || in(known, key)) continue;
    if (could_change_size(key))
      throw Error(fmt::format("{}: unknown field '{}' for model_type '{}'", c.origin(), key,
                              c.type()),
                  "a field zeroplan does not know could change the model's size, so it refuses "
                  "to guess; remove it if it does not");
    ignored.push_back(key);
  }
  if (!ignored.empty())
    m.notes.push_back(fmt::format("ignored field{} {} (unknown to zeroplan's {} reader; not a "
                                  "size)", ignored.size() > 1 ? "s" : "",
                                  fmt::join(ignored, ", "), c.type()));
}

std::string quantization_note(const json& q) {
  std::string method = "quantized";
  if (q.is_object() && q.contains("quant_method") && q["quant_method"].is_string())
    method = q["quant_method"].get<std::string>();
  return fmt::format("quantization_config ({}) ignored: planned as training in the chosen "
                     "precision from full-precision weights", method);
}

ModelSpec parse_object(const json& j, const std::string& origin) {
  if (!j.is_object())
    throw Error(fmt::format("{}: expected a JSON object (a Hugging Face config.json)", origin));
  if (!j.contains("model_type"))
    throw Error(fmt::format("{}: missing field 'model_type'", origin),
                "a Hugging Face config.json names its family, e.g. \"model_type\": \"llama\"");
  if (!j["model_type"].is_string())
    throw Error(fmt::format("{}: field 'model_type' must be a string", origin));
  std::string type = j["model_type"].get<std::string>();
  // Multimodal wrappers: the language model's own config sits under text_config.
  if (j.contains("vision_config") || j.contains("audio_config")) {
    if (j.contains("text_config") && j["text_config"].is_object())
      throw Error(fmt::format("{}: model_type '{}' is multimodal (vision_config): zeroplan plans "
                              "the language model alone", origin, type),
                  "save the text_config object as its own config.json (with its model_type) "
                  "and plan that");
    throw Error(fmt::format("{}: model_type '{}' has a vision tower, which zeroplan does not "
                            "plan", origin, type));
  }
  const auto& rs = readers();
  const auto it = std::find_if(rs.begin(), rs.end(), [&](const Reader& r) { return r.type == type; });
  if (it == rs.end())
    throw Error(fmt::format("{}: unknown model_type '{}'", origin, type),
                fmt::format("supported model_type values: {}",
                            fmt::join(supported_model_types(), ", ")));
  // PretrainedConfig fields that change a model's shape and that no recipe has.
  if (j.contains("pruned_heads") && !j["pruned_heads"].is_null() && !j["pruned_heads"].empty())
    throw Error(fmt::format("{}: field 'pruned_heads': pruned attention heads are not supported",
                            origin),
                "zeroplan plans whole heads in every layer; remove the field to plan the unpruned "
                "model");
  if (type != "t5" && j.contains("add_cross_attention") && j["add_cross_attention"] == true)
    throw Error(fmt::format("{}: field 'add_cross_attention': cross-attention in a {} decoder is "
                            "not supported", origin, type),
                "zeroplan plans cross-attention in T5 only");
  Cfg c(j, origin, type);
  ModelSpec m = it->read(c);
  m.model_type = type;
  m.name = origin;
  if (const json* q = c.raw("quantization_config")) m.notes.push_back(quantization_note(*q));
  check_fields(j, c, m);
  m.source_config = j.dump();
  // Counting rejects shapes whose counts overflow, and more tensors than anyone publishes, at
  // the point of entry (the sums only: listing every tensor by name is the planner's work).
  const ParamInventory inv = count_param_totals(m, kMaxParamTensors, origin);
  if (m.mtp_layers > 0)
    m.notes.push_back(fmt::format(
        "{} multi-token-prediction module{} (num_nextn_predict_layers): {} parameters, not in "
        "the total and not planned (its embedding and head are the main model's)",
        m.mtp_layers, m.mtp_layers > 1 ? "s" : "", inv.mtp));
  return m;
}

}  // namespace

std::vector<std::string> supported_model_types() {
  std::vector<std::string> out;
  for (const auto& r : readers()) out.emplace_back(r.type);
  return out;
}

ModelSpec parse_hf_config(std::string_view json_text, const std::string& origin) {
  return parse_object(parse_json_text(json_text, origin), origin);
}

std::string to_hf_config(const ModelSpec& m) {
  json j;
  if (!m.source_config.empty()) {
    j = json::parse(m.source_config);
    const auto& rs = readers();
    const auto it = std::find_if(rs.begin(), rs.end(),
                                 [&](const Reader& r) { return r.type == m.model_type; });
    if (it != rs.end()) {
      // fit --max-model changes the depth: write it where this type keeps it (and drop an
      // alias that would contradict it).
      for (auto alias : {"n_layer", "num_hidden_layers", "num_layers"}) j.erase(alias);
      j[std::string(it->layers_field)] = m.n_layer;
      if (m.model_type == "t5") j["num_decoder_layers"] = m.n_decoder_layer;
      if (j.contains("layer_types") && j["layer_types"].is_array() &&
          static_cast<int64_t>(j["layer_types"].size()) != m.n_layer) {
        json lt = json::array();
        for (int64_t l = 0; l < m.n_layer; ++l)
          lt.push_back(m.window.window_of(l) > 0 ? "sliding_attention" : "full_attention");
        j["layer_types"] = lt;
      }
    }
    return j.dump(2);
  }
  // A spec built in code: the GPT-2 or LLaMA fields it has.
  if (m.model_type == "gpt2") {
    j = {{"model_type", "gpt2"},
         {"n_layer", m.n_layer},
         {"n_embd", m.n_embd},
         {"n_head", m.n_head},
         {"n_inner", m.n_inner},
         {"n_positions", m.n_positions},
         {"vocab_size", m.vocab_size},
         {"tie_word_embeddings", m.tied_embeddings},
         {"activation_function", m.activation.empty() ? "gelu_new" : m.activation},
         {"attn_pdrop", m.attn_dropout},
         {"resid_pdrop", m.resid_dropout},
         {"embd_pdrop", m.embd_dropout}};
  } else if (m.model_type == "llama") {
    j = {{"model_type", "llama"},
         {"num_hidden_layers", m.n_layer},
         {"hidden_size", m.n_embd},
         {"num_attention_heads", m.n_head},
         {"num_key_value_heads", m.n_kv_head},
         {"head_dim", m.head_dim},
         {"intermediate_size", m.n_inner},
         {"max_position_embeddings", m.n_positions},
         {"vocab_size", m.vocab_size},
         {"tie_word_embeddings", m.tied_embeddings},
         {"attention_bias", m.qkv_bias},
         {"mlp_bias", m.mlp_bias},
         {"hidden_act", m.activation.empty() ? "silu" : m.activation},
         {"attention_dropout", m.attn_dropout}};
  } else {
    throw Error(fmt::format("{}: a built {} spec has no config to write", m.name, m.model_type));
  }
  return j.dump(2);
}

ModelSpec load_model(const std::string& name_or_path) {
  for (const auto& e : catalog())
    if (e.name == name_or_path) return parse_hf_config(e.config, e.name);
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(name_or_path, ec)) {
    const std::string cfg = (fs::path(name_or_path) / "config.json").string();
    if (!fs::is_regular_file(cfg, ec))
      throw Error(fmt::format("--model: directory '{}' holds no config.json", name_or_path),
                  "pass the directory save_pretrained wrote, or the config.json itself");
    return parse_hf_config(read_text_file(cfg), cfg);
  }
  if (fs::is_regular_file(name_or_path, ec))
    return parse_hf_config(read_text_file(name_or_path), name_or_path);
  const bool looks_like_path = name_or_path.find('/') != std::string::npos ||
                               name_or_path.ends_with(".json");
  if (looks_like_path)
    throw Error(fmt::format("--model: cannot read '{}': no such file", name_or_path),
                "pass a catalog name (zero-plan models), a config.json or the directory holding it");
  throw Error(fmt::format("--model: unknown model '{}'", name_or_path),
              fmt::format("closest catalog names: {} (zero-plan models lists all)",
                          fmt::join(closest_catalog_names(name_or_path), ", ")));
}

}  // namespace zp::models
