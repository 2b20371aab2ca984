// zp/models/model_spec.hpp: a decoder-only transformer's shape (GPT-2 or LLaMA family), read
// from a Hugging Face config.json or the built-in catalog, and its exact parameter inventory.
// Not the training graph (that is graph.hpp) and not a tokenizer or weights loader.
//
// Example usage:
//   zp::models::ModelSpec m = zp::models::load_model("llama-2-7b");   // or a config.json path
//   zp::models::ParamInventory inv = zp::models::count_params(m);
//   fmt::print("{} params, largest module {} ({})\n", inv.total, inv.largest_module,
//              inv.largest_module_params);                             // 6738415616 ...
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace zp::models {

enum class Family { gpt2, llama };
enum class Norm { layernorm, rmsnorm };  // layernorm has weight+bias, rmsnorm weight only
enum class Mlp { gelu, swiglu };         // gelu: up, down; swiglu: gate, up, down

// Dimension letters used across zeroplan: L layers, C hidden (channels), NH heads,
// KVH key/value heads, HS head size, F MLP width, P max positions, V vocab.
struct ModelSpec {
  std::string name;         // catalog name, or the path of the config it came from
  Family family = Family::gpt2;
  int64_t n_layer = 0;      // L
  int64_t n_embd = 0;       // C
  int64_t n_head = 0;       // NH
  int64_t n_kv_head = 0;    // KVH (== NH without grouped-query attention)
  int64_t head_dim = 0;     // HS (C / NH unless the config says otherwise)
  int64_t n_inner = 0;      // F
  int64_t n_positions = 0;  // P (maximum sequence length)
  int64_t vocab_size = 0;   // V
  bool tied_embeddings = true;     // LM head shares the token embedding
  bool learned_positions = true;   // GPT-2 wpe; LLaMA uses RoPE (no parameters)
  bool attention_bias = true;      // biases on QKV and the attention output projection
  bool mlp_bias = true;            // biases on the MLP projections
  Norm norm = Norm::layernorm;
  Mlp mlp = Mlp::gelu;
  double attn_dropout = 0.0;       // attention-probability dropout
  double resid_dropout = 0.0;      // dropout after the attention and MLP output projections
  double embd_dropout = 0.0;       // dropout after the embedding
  std::string activation;          // as written in the config ("gelu_new", "silu")

  std::string family_name() const { return family == Family::gpt2 ? "gpt2" : "llama"; }
};

// One parameter tensor, named as Hugging Face names it.
struct ParamTensor {
  std::string name;             // "transformer.h.0.attn.c_attn.weight"
  std::string module;           // "transformer.h.0.attn.c_attn"
  std::vector<int64_t> shape;   // (3*C, C) for c_attn.weight, as torch stores it
  int64_t numel = 0;
  int layer = -1;               // block index, or -1 outside the blocks
};

struct ParamInventory {
  std::vector<ParamTensor> tensors;   // every tensor, in module order
  int64_t total = 0;                  // all parameters (a tied head counted once)
  int64_t per_layer = 0;              // one transformer block
  int64_t embedding = 0;              // token (+ position) embeddings
  int64_t head = 0;                   // untied LM head, 0 when tied
  int64_t final_norm = 0;
  // The largest module by its own (non-recursive) parameters: what DeepSpeed's ZeRO-3
  // estimator calls largest_layer_params; for these families it is the token embedding.
  std::string largest_module;
  int64_t largest_module_params = 0;
};

// Exact parameter inventory; throws zp::Error if a count overflows 64 bits.
ParamInventory count_params(const ModelSpec& m);

// Parses a Hugging Face config.json (text). `origin` names the source in errors and becomes
// ModelSpec::name. Unknown model_type, unknown fields, wrong types and shapes that do not
// divide are zp::Error naming the field.
ModelSpec parse_hf_config(std::string_view json_text, const std::string& origin);

// The spec written back as a Hugging Face config.json (the fields this reader uses), so a plan
// file can carry its model; parse_hf_config(to_hf_config(m)) gives the same spec.
std::string to_hf_config(const ModelSpec& m);

struct CatalogEntry {
  std::string name;         // "gpt2-xl"
  std::string description;  // one line, with the source of the shape
  int64_t published_params; // the count its authors publish (0 when none is published exactly)
  std::string_view config;  // the embedded config.json text
};

const std::vector<CatalogEntry>& catalog();

// A catalog name or a path to a config.json. An unknown name that is not a file is an error
// that suggests the closest catalog names.
ModelSpec load_model(const std::string& name_or_path);

// Up to `n` catalog names closest to `name` (edit distance), best first.
std::vector<std::string> closest_catalog_names(std::string_view name, std::size_t n = 3);

}  // namespace zp::models
