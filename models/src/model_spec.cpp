// model_spec.cpp: reading Hugging Face configs (GPT-2 and LLaMA families), the exact
// parameter inventory, and the catalog lookup. Not the graph builder (graph.cpp).
#include "zp/models/model_spec.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "zp/checked.hpp"
#include "zp/error.hpp"
#include "zp/json_fields.hpp"

namespace zp::models {
namespace {

using nlohmann::json;

// ---- config fields -------------------------------------------------------------------------

// Fields every PretrainedConfig may carry that do not change the shape or the memory.
const std::set<std::string, std::less<>> kCommonFields = {
    "_name_or_path", "architectures", "model_type", "torch_dtype", "dtype",
    "transformers_version", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "use_bfloat16", "tie_encoder_decoder", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "chunk_size_feed_forward", "pruned_heads", "id2label", "label2id",
    "problem_type", "tokenizer_class", "prefix", "pad_token_id", "bos_token_id", "eos_token_id",
    "sep_token_id", "decoder_start_token_id", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature",
    "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "finetuning_task", "task_specific_params",
    "initializer_range", "use_cache", "tie_word_embeddings", "gradient_checkpointing"};

const std::set<std::string, std::less<>> kGpt2Fields = {
    "vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "n_inner",
    "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn"};

const std::set<std::string, std::less<>> kLlamaFields = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "pretraining_tp", "rope_theta", "rope_scaling", "attention_bias",
    "attention_dropout", "mlp_bias", "head_dim"};

void reject_unknown_fields(const json& j, const std::set<std::string, std::less<>>& family,
                           const std::string& origin, std::string_view model_type) {
  for (const auto& [key, value] : j.items()) {
    if (key == "quantization_config")
      throw Error(fmt::format("{}: field 'quantization_config': quantized models are not "
                              "supported", origin),
                  "zeroplan plans 16/32-bit training; remove the field to plan the "
                  "unquantized model");
    if (!kCommonFields.contains(key) && !family.contains(key))
      throw Error(fmt::format("{}: unknown field '{}' for model_type '{}'", origin, key,
                              model_type),
                  "zeroplan reads the Hugging Face GPT-2 and LLaMA config fields; a field it "
                  "does not know could change the model's size, so it refuses to guess");
  }
}

ModelSpec parse_gpt2(const json& j, const std::string& origin) {
  reject_unknown_fields(j, kGpt2Fields, origin, "gpt2");
  Fields f(j, origin);
  ModelSpec m;
  m.family = Family::gpt2;
  m.n_layer = f.positive_int("n_layer");
  m.n_embd = f.positive_int("n_embd");
  m.n_head = f.positive_int("n_head");
  m.n_kv_head = m.n_head;
  m.n_positions = f.positive_int("n_positions", 1024);
  m.vocab_size = f.positive_int("vocab_size", 50257);
  if (m.n_embd % m.n_head != 0)
    throw Error(fmt::format("{}: n_embd {} is not divisible by n_head {}", origin, m.n_embd,
                            m.n_head),
                "the hidden size must split evenly into attention heads");
  m.head_dim = m.n_embd / m.n_head;
  m.n_inner = f.optional_positive_int("n_inner").value_or(
      checked_mul(int64_t{4}, m.n_embd, "n_inner = 4 * n_embd"));
  m.tied_embeddings = f.boolean("tie_word_embeddings", true);
  m.learned_positions = true;
  m.attention_bias = true;
  m.mlp_bias = true;
  m.norm = Norm::layernorm;
  m.mlp = Mlp::gelu;
  m.activation = f.string("activation_function", "gelu_new");
  m.attn_dropout = f.probability("attn_pdrop", 0.1);
  m.resid_dropout = f.probability("resid_pdrop", 0.1);
  m.embd_dropout = f.probability("embd_pdrop", 0.1);
  return m;
}

ModelSpec parse_llama(const json& j, const std::string& origin) {
  reject_unknown_fields(j, kLlamaFields, origin, "llama");
  Fields f(j, origin);
  ModelSpec m;
  m.family = Family::llama;
  m.n_layer = f.positive_int("num_hidden_layers");
  m.n_embd = f.positive_int("hidden_size");
  m.n_head = f.positive_int("num_attention_heads");
  m.n_kv_head = f.optional_positive_int("num_key_value_heads").value_or(m.n_head);
  m.n_inner = f.positive_int("intermediate_size");
  m.n_positions = f.positive_int("max_position_embeddings", 2048);
  m.vocab_size = f.positive_int("vocab_size", 32000);
  if (m.n_head % m.n_kv_head != 0)
    throw Error(fmt::format("{}: num_attention_heads {} is not divisible by "
                            "num_key_value_heads {}", origin, m.n_head, m.n_kv_head),
                "grouped-query attention shares each key/value head among a whole number of "
                "query heads");
  if (auto hd = f.optional_positive_int("head_dim")) {
    m.head_dim = *hd;
  } else {
    if (m.n_embd % m.n_head != 0)
      throw Error(fmt::format("{}: hidden_size {} is not divisible by num_attention_heads {}",
                              origin, m.n_embd, m.n_head),
                  "the hidden size must split evenly into attention heads (or set head_dim)");
    m.head_dim = m.n_embd / m.n_head;
  }
  m.tied_embeddings = f.boolean("tie_word_embeddings", false);
  m.learned_positions = false;
  m.attention_bias = f.boolean("attention_bias", false);
  m.mlp_bias = f.boolean("mlp_bias", false);
  m.norm = Norm::rmsnorm;
  m.mlp = Mlp::swiglu;
  m.activation = f.string("hidden_act", "silu");
  m.attn_dropout = f.probability("attention_dropout", 0.0);
  m.resid_dropout = 0.0;
  m.embd_dropout = 0.0;
  (void)f.positive_int("pretraining_tp", 1);  // type-checked; it changes no shape or memory
  return m;
}

// ---- parameter inventory -------------------------------------------------------------------

struct InventoryBuilder {
  ParamInventory inv;
  void add(std::string module, std::string leaf, std::vector<int64_t> shape, int layer) {
    int64_t n = 1;
    for (int64_t d : shape) n = checked_mul(n, d, fmt::format("elements of {}.{}", module, leaf));
    inv.tensors.push_back({module + "." + leaf, module, std::move(shape), n, layer});
    inv.total = checked_add(inv.total, n, "total parameters");
  }
  void linear(const std::string& module, int64_t out, int64_t in, bool bias, int layer) {
    add(module, "weight", {out, in}, layer);
    if (bias) add(module, "bias", {out}, layer);
  }
  // GPT-2 stores its projections as Conv1D with weight (in, out).
  void conv1d(const std::string& module, int64_t in, int64_t out, int layer) {
    add(module, "weight", {in, out}, layer);
    add(module, "bias", {out}, layer);
  }
  void norm(const std::string& module, int64_t c, Norm kind, int layer) {
    add(module, "weight", {c}, layer);
    if (kind == Norm::layernorm) add(module, "bias", {c}, layer);
  }
};

}  // namespace

ParamInventory count_params(const ModelSpec& m) {
  InventoryBuilder b;
  const int64_t C = m.n_embd, F = m.n_inner, V = m.vocab_size, P = m.n_positions;
  const int64_t q_out = checked_mul(m.n_head, m.head_dim, "attention width NH*HS");
  const int64_t kv_out = checked_mul(m.n_kv_head, m.head_dim, "key/value width KVH*HS");
  int64_t before = 0;
  if (m.family == Family::gpt2) {
    b.add("transformer.wte", "weight", {V, C}, -1);
    b.add("transformer.wpe", "weight", {P, C}, -1);
    b.inv.embedding = b.inv.total;
    for (int l = 0; l < m.n_layer; ++l) {
      before = b.inv.total;
      const std::string h = fmt::format("transformer.h.{}", l);
      b.norm(h + ".ln_1", C, m.norm, l);
      b.conv1d(h + ".attn.c_attn", C, checked_add(q_out, 2 * kv_out, "qkv width"), l);
      b.conv1d(h + ".attn.c_proj", q_out, C, l);
      b.norm(h + ".ln_2", C, m.norm, l);
      b.conv1d(h + ".mlp.c_fc", C, F, l);
      b.conv1d(h + ".mlp.c_proj", F, C, l);
      b.inv.per_layer = b.inv.total - before;
    }
    before = b.inv.total;
    b.norm("transformer.ln_f", C, m.norm, -1);
    b.inv.final_norm = b.inv.total - before;
    if (!m.tied_embeddings) {
      before = b.inv.total;
      b.linear("lm_head", V, C, false, -1);
      b.inv.head = b.inv.total - before;
    }
  } else {
    b.add("model.embed_tokens", "weight", {V, C}, -1);
    b.inv.embedding = b.inv.total;
    for (int l = 0; l < m.n_layer; ++l) {
      before = b.inv.total;
      const std::string h = fmt::format("model.layers.{}", l);
      b.linear(h + ".self_attn.q_proj", q_out, C, m.attention_bias, l);
      b.linear(h + ".self_attn.k_proj", kv_out, C, m.attention_bias, l);
      b.linear(h + ".self_attn.v_proj", kv_out, C, m.attention_bias, l);
      b.linear(h + ".self_attn.o_proj", C, q_out, m.attention_bias, l);
      b.linear(h + ".mlp.gate_proj", F, C, m.mlp_bias, l);
      b.linear(h + ".mlp.up_proj", F, C, m.mlp_bias, l);
      b.linear(h + ".mlp.down_proj", C, F, m.mlp_bias, l);
      b.norm(h + ".input_layernorm", C, m.norm, l);
      b.norm(h + ".post_attention_layernorm", C, m.norm, l);
      b.inv.per_layer = b.inv.total - before;
    }
    before = b.inv.total;
    b.norm("model.norm", C, m.norm, -1);
    b.inv.final_norm = b.inv.total - before;
    if (!m.tied_embeddings) {
      before = b.inv.total;
      b.linear("lm_head", V, C, false, -1);
      b.inv.head = b.inv.total - before;
    }
  }
  // Largest module by its own parameters (tensors are grouped by module, in order).
  ParamInventory& inv = b.inv;
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
  return std::move(b.inv);
}

ModelSpec parse_hf_config(std::string_view json_text, const std::string& origin) {
  const json j = parse_json_text(json_text, origin);
  if (!j.is_object())
    throw Error(fmt::format("{}: expected a JSON object (a Hugging Face config.json)", origin));
  if (!j.contains("model_type"))
    throw Error(fmt::format("{}: missing field 'model_type'", origin),
                "a Hugging Face config.json names its family, e.g. \"model_type\": \"llama\"");
  if (!j["model_type"].is_string())
    throw Error(fmt::format("{}: field 'model_type' must be a string", origin));
  const std::string type = j["model_type"].get<std::string>();
  ModelSpec m;
  if (type == "gpt2") {
    m = parse_gpt2(j, origin);
  } else if (type == "llama") {
    m = parse_llama(j, origin);
  } else {
    throw Error(fmt::format("{}: unknown model_type '{}'", origin, type),
                "supported model_type values: gpt2, llama");
  }
  m.name = origin;
  (void)count_params(m);  // rejects shapes whose counts overflow, at the point of entry
  return m;
}

std::string to_hf_config(const ModelSpec& m) {
  json j;
  if (m.family == Family::gpt2) {
    j = {{"model_type", "gpt2"},
         {"n_layer", m.n_layer},
         {"n_embd", m.n_embd},
         {"n_head", m.n_head},
         {"n_inner", m.n_inner},
         {"n_positions", m.n_positions},
         {"vocab_size", m.vocab_size},
         {"tie_word_embeddings", m.tied_embeddings},
         {"activation_function", m.activation},
         {"attn_pdrop", m.attn_dropout},
         {"resid_pdrop", m.resid_dropout},
         {"embd_pdrop", m.embd_dropout}};
  } else {
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
         {"attention_bias", m.attention_bias},
         {"mlp_bias", m.mlp_bias},
         {"hidden_act", m.activation},
         {"attention_dropout", m.attn_dropout}};
  }
  return j.dump(2);
}

std::vector<std::string> closest_catalog_names(std::string_view name, std::size_t n) {
  auto distance = [](std::string_view a, std::string_view b) {
    std::vector<std::size_t> row(b.size() + 1);
    for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (std::size_t i = 1; i <= a.size(); ++i) {
      std::size_t diag = row[0];
      row[0] = i;
      for (std::size_t j = 1; j <= b.size(); ++j) {
        const std::size_t up = row[j];
        const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                          std::tolower(static_cast<unsigned char>(b[j - 1]));
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (same ? 0 : 1)});
        diag = up;
      }
    }
    return row[b.size()];
  };
  std::vector<std::pair<std::size_t, std::string>> scored;
  for (const auto& e : catalog()) scored.emplace_back(distance(name, e.name), e.name);
  std::stable_sort(scored.begin(), scored.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<std::string> out;
  for (std::size_t i = 0; i < scored.size() && i < n; ++i) out.push_back(scored[i].second);
  return out;
}

ModelSpec load_model(const std::string& name_or_path) {
  for (const auto& e : catalog())
    if (e.name == name_or_path) return parse_hf_config(e.config, e.name);
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(name_or_path, ec)) return parse_hf_config(read_text_file(name_or_path),
                                                                     name_or_path);
  const bool looks_like_path = name_or_path.find('/') != std::string::npos ||
                               name_or_path.ends_with(".json");
  if (looks_like_path)
    throw Error(fmt::format("--model: cannot read '{}': no such file", name_or_path),
                "pass a catalog name (zero-plan models) or the path of a config.json");
  throw Error(fmt::format("--model: unknown model '{}'", name_or_path),
              fmt::format("closest catalog names: {} (zero-plan models lists all)",
                          fmt::join(closest_catalog_names(name_or_path), ", ")));
}

}  // namespace zp::models
