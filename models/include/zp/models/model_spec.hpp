// zp/models/model_spec.hpp: a transformer's architecture as data (a recipe: the sizes, and
// which variant fills each slot of a block), read from a Hugging Face config.json or the
// built-in catalog, and its exact parameter inventory with Hugging Face's tensor names.
// Not the training graph (graph.hpp) and not a tokenizer or weights loader.
//
// Example usage:
//   zp::models::ModelSpec m = zp::models::load_model("llama-2-7b");   // or a config.json path
//   zp::models::ParamInventory inv = zp::models::count_params(m);
//   fmt::print("{} params, largest module {} ({})\n", inv.total, inv.largest_module,
//              inv.largest_module_params);                             // 6738415616 ...
//
// How to add a family: write its reader in model_readers.cpp (config fields -> recipe) and its
// row of tensor names in param_names.cpp; the inventory and the graph need nothing new unless
// the family brings a slot variant that no recipe has yet.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace zp::models {

enum class Norm { layernorm, rmsnorm };  // layernorm: weight + bias; rmsnorm: weight only
enum class Mlp { gelu, swiglu };         // plain (up, act, down) or gated (gate, up, act(gate)*up, down)
enum class Positions { learned, rotary, alibi, relative };  // relative: T5's bucketed bias
enum class Attention { standard, mla };  // standard: MHA, GQA, MQA by n_kv_head; mla: DeepSeek
enum class QkNorm { none, head, full };  // RMSNorm of q and k per head (Qwen3, Gemma 3) or
                                         // over the whole projection (OLMo 2)
// Where a block's norms sit. pre: x + f(norm(x)) (GPT-2, LLaMA); sandwich: x + norm(f(norm(x)))
// (Gemma 2/3); post_sublayer: x + norm(f(x)) (OLMo 2); post_residual: norm(x + f(x)) (the
// original transformer; OPT with do_layer_norm_before=false).
enum class NormPlace { pre, sandwich, post_sublayer, post_residual };
// sequential: x + attn, then + mlp; parallel: x + attn(norm(x)) + mlp(norm'(x)) (GPT-NeoX,
// GPT-J, Phi, Falcon), with one shared norm or two.
enum class Residual { sequential, parallel };
// What the last hidden state is trained to predict. lm: the next token through the LM head
// (every decoder, T5); mlm: BERT's masked-LM head (a dense + activation + LayerNorm transform,
// then a decoder tied to the token embedding, with a bias of its own), on every token;
// seq_cls: one class per sequence, through BERT's pooler (dense + tanh on the first token),
// a dropout and a classifier of n_labels outputs.
enum class Head { lm, mlm, seq_cls };

// DeepSeek's multi-head latent attention (DeepSeek-V2 paper sec. 2.1): queries through an
// optional low-rank q_a/q_b pair, keys and values through one compressed latent kv_a (plus one
// rotary key shared by all heads), expanded per head by kv_b.
struct MlaSpec {
  int64_t q_lora_rank = 0;       // 0: q_proj directly
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;  // per head, without rotation
  int64_t qk_rope_head_dim = 0;  // per head, rotated (the key's part is shared by the heads)
  int64_t v_head_dim = 0;
  bool operator==(const MlaSpec&) const = default;
};

// Mixture-of-Experts MLPs: which layers are MoE, the routed and shared experts.
struct MoeSpec {
  int64_t n_experts = 0;        // E routed experts; 0: every MLP is dense
  int64_t top_k = 0;            // k experts per token
  int64_t expert_inner = 0;     // F_e, each routed expert's MLP width
  int64_t shared_inner = 0;     // width of the shared expert MLP (all shared experts), 0: none
  bool shared_gate = false;     // Qwen2-MoE: sigmoid(linear(x)) scales the shared expert
  bool router_bias = false;     // gpt-oss: the router linear has a bias
  bool expert_bias = false;     // gpt-oss: expert projections have biases
  bool score_bias = false;      // DeepSeek-V3: e_score_correction_bias, one per expert
  // Layer l is MoE when l >= first_dense, l % step == phase and l is not in dense_layers
  // (DeepSeek: first_k_dense_replace and moe_layer_freq; Qwen2-MoE: decoder_sparse_step with
  // phase step-1 and mlp_only_layers).
  int64_t first_dense = 0;
  int64_t step = 1;
  int64_t phase = 0;
  std::vector<int64_t> dense_layers;
  bool is_moe_layer(int64_t l) const;
  bool operator==(const MoeSpec&) const = default;
};

// Sliding-window attention per layer: window tokens, and which layers use it. `pattern`
// repeats with its own length over the layers (gpt-oss: sliding, full; Gemma 3: five sliding,
// one full); empty means every layer from `from_layer` on (Mistral; Qwen2's max_window_layers).
struct WindowSpec {
  int64_t size = 0;              // 0: no sliding window anywhere
  std::vector<bool> pattern;
  int64_t from_layer = 0;
  int64_t window_of(int64_t l) const;  // 0 for a global layer
  bool operator==(const WindowSpec&) const = default;
};

// Dimension letters used across zeroplan: L layers, C hidden (channels), NH heads,
// KVH key/value heads, HS head size, F MLP width, P max positions, V vocab.
// Rotary embeddings' frequencies, as transformers' rope_scaling (or rope_parameters) object
// and rope_theta give them; the runtime computes the table (runtime/rope.hpp). Not a shape:
// the planner reads none of it.
struct RopeSpec {
  double theta = 10000.0;
  std::string type = "default";     // rope_type (or type): default, linear, dynamic, yarn, llama3, ...
  double factor = 1.0;              // linear, dynamic, yarn, llama3
  double low_freq_factor = 1.0;     // llama3
  double high_freq_factor = 4.0;    // llama3
  int64_t original_max_positions = 0;  // llama3: original_max_position_embeddings
  double attention_factor = 0.0;    // yarn: given, or 0 (derived: 0.1 ln(factor) + 1)
  double beta_fast = 32.0, beta_slow = 1.0;  // yarn
};

struct ModelSpec {
  std::string name;                // catalog name, or the path of the config it came from
  std::string model_type = "gpt2"; // the Hugging Face model_type that named the recipe
  int64_t n_layer = 0;      // L (the encoder's layers in an encoder-decoder model)
  int64_t n_decoder_layer = 0;  // T5's decoder layers; 0 in a decoder-only model
  int64_t n_embd = 0;       // C
  int64_t n_head = 0;       // NH
  int64_t n_kv_head = 0;    // KVH (== NH without grouped-query attention)
  int64_t head_dim = 0;     // HS (C / NH unless the config says otherwise)
  int64_t n_inner = 0;      // F (the dense MLP's width)
  int64_t n_positions = 0;  // P (maximum sequence length)
  int64_t vocab_size = 0;   // V

  // ---- the recipe ----
  Norm norm = Norm::layernorm;
  NormPlace norm_place = NormPlace::pre;
  Residual residual = Residual::sequential;
  int parallel_norms = 1;          // with Residual::parallel: one shared norm or two
  Mlp mlp = Mlp::gelu;
  std::string activation;          // as written in the config ("gelu_new", "silu")
  Positions positions = Positions::learned;
  int64_t position_offset = 0;     // OPT's learned positions have 2 extra rows
  int64_t rotary_dim = 0;          // rotated dimensions per head (partial rotary); 0: none
  int64_t relative_buckets = 0;    // T5: relative_attention_num_buckets
  Attention attention = Attention::standard;
  MlaSpec mla;
  QkNorm qk_norm = QkNorm::none;
  bool attn_sinks = false;         // gpt-oss: one learned sink logit per head
  bool qkv_bias = true;            // biases on the q, k, v projections
  bool out_bias = true;            // bias on the attention output projection
  bool mlp_bias = true;            // biases on the dense MLP projections
  WindowSpec window;
  MoeSpec moe;
  bool tied_embeddings = true;     // LM head (or BERT's MLM decoder) shares the token embedding
  bool head_bias = false;          // Phi: the LM head has a bias
  bool embed_norm = false;         // BLOOM: a LayerNorm right after the token embedding
  int64_t embed_proj_dim = 0;      // OPT: word_embed_proj_dim != hidden (project_in/out)
  int64_t type_vocab_size = 0;     // BERT: token-type (segment) embedding rows; 0: none
  bool final_norm = true;          // a norm after the last block (none in BERT's post-LN encoder)
  Head head = Head::lm;
  bool pooler = false;             // BERT's pooler (dense + tanh on the first token)
  int64_t n_labels = 0;            // classes of the classifier on the pooled output (seq_cls;
                                   // BertForPreTraining's next-sentence head: 2); 0: none
  bool fused_qkv = false;          // one q|k|v matrix in the checkpoint (names only)
  bool fused_gate_up = false;      // one gate|up matrix in the checkpoint (names only)
  double attn_softcap = 0;         // Gemma 2: scores = cap * tanh(scores / cap); 0: none
  double final_softcap = 0;        // Gemma 2: the same on the logits
  int64_t mtp_layers = 0;          // DeepSeek-V3's multi-token-prediction modules: counted
                                   // apart (ParamInventory::mtp), not trained in the graph
  double norm_eps = 1e-5;          // LayerNorm / RMSNorm epsilon (layer_norm_epsilon, rms_norm_eps)
  RopeSpec rope;                   // with Positions::rotary: the frequencies
  double attn_dropout = 0.0;       // attention-probability dropout
  double resid_dropout = 0.0;      // dropout after the attention and MLP output projections
  double embd_dropout = 0.0;       // dropout after the embedding
  double cls_dropout = 0.0;        // dropout on the pooled output before the classifier
  // The config.json this spec was read from (its JSON text; empty for a hand-built spec), so a
  // plan file can carry it; the layer-count field is rewritten from n_layer (fit --max-model).
  std::string source_config;
  std::vector<std::string> notes;  // what the reader accepted but does not model, for reports

  std::string family_name() const { return model_type; }
  bool is_moe() const { return moe.n_experts > 0; }
  bool encoder_decoder() const { return n_decoder_layer > 0; }
  int64_t n_blocks() const { return n_layer + n_decoder_layer; }
  // Whether this is the GPT-2 block the runtime's kernels execute (pre-LayerNorm, fused
  // learned positions, GELU MLP, biases, tied head, MHA).
  bool is_gpt2_block() const;
  // Key/query widths: q_width = NH * (query/key head size), v_width = NH * value head size.
  int64_t qk_head_dim() const;
  int64_t v_head_dim() const;
};

// How a rank holds a tensor under tensor parallelism (Megatron's column/row split).
enum class Split : uint8_t {
  replicated,  // norms, routers, biases of row-parallel projections, positions
  column,      // split along the output features: q, k, v, gate, up, their biases
  row,         // split along the input features: attention output, MLP down
  vocab,       // the token embedding and the LM head, split along the vocabulary
};

// One parameter tensor, named as Hugging Face names it.
struct ParamTensor {
  std::string name;             // "transformer.h.0.attn.c_attn.weight"
  std::string module;           // "transformer.h.0.attn.c_attn"
  std::vector<int64_t> shape;   // (3*C, C) for c_attn.weight, as torch stores it
  int64_t numel = 0;
  int layer = -1;               // block index, or -1 outside the blocks (n_blocks() for the head)
  std::string slot;             // the recipe's role: "attn.q", "mlp.gate", "moe.experts.up"...
  Split split = Split::replicated;
  bool expert = false;          // a routed expert's tensor (partitioned by expert parallelism)
};

struct ParamInventory {
  std::vector<ParamTensor> tensors;   // every tensor, in module order
  int64_t n_tensors = 0;              // how many (also when count_param_totals lists none)
  int64_t total = 0;                  // all parameters (a tied head counted once)
  int64_t per_layer = 0;              // the last transformer block
  int64_t embedding = 0;              // token (+ position, + token-type) embeddings
  int64_t head = 0;                   // the head's own parameters: an untied LM head; BERT's
                                      // pooler, MLM transform and bias, classifier (not a tied
                                      // decoder: 0 for a tied LM head)
  int64_t final_norm = 0;
  int64_t experts = 0;                // routed experts' parameters (all layers)
  int64_t active = 0;                 // parameters a token passes through: total minus the
                                      // routed experts it is not routed to (k of E)
  int64_t mtp = 0;                    // DeepSeek-V3 multi-token prediction, not in `total`
  // The largest module by its own (non-recursive) parameters: what DeepSpeed's ZeRO-3
  // estimator calls largest_layer_params; for most families it is the token embedding.
  std::string largest_module;
  int64_t largest_module_params = 0;
};

// Exact parameter inventory; throws zp::Error if a count overflows 64 bits.
ParamInventory count_params(const ModelSpec& m);

// The most parameter tensors in a config parse_hf_config accepts: 16x the largest published
// models (~70,000 in Kimi-K2's 61 layers of 384 experts). Each is listed by name in the
// inventory, so an absurd num_hidden_layers or expert count would otherwise take minutes and
// gigabytes (2,000 layers of 1,000 experts: 6 M tensors, 30 s, 2.4 GiB) or never end.
inline constexpr int64_t kMaxParamTensors = int64_t{1} << 20;

// count_params's sums and n_tensors without the tensors' list and the largest module (no
// names: cheap for any size); more than `max_tensors` tensors is a zp::Error naming `origin`,
// raised before walking more.
ParamInventory count_param_totals(const ModelSpec& m, int64_t max_tensors, const std::string& origin);

// Parses a Hugging Face config.json (text). `origin` names the source in errors and becomes
// ModelSpec::name. Unknown model_type, wrong types, shapes that do not divide and unknown
// fields that could change the size are zp::Error naming the field.
ModelSpec parse_hf_config(std::string_view json_text, const std::string& origin);

// The spec written back as a Hugging Face config.json (the source config with the layer count
// of the spec), so a plan file can carry its model; parse_hf_config(to_hf_config(m)) gives
// the same spec.
std::string to_hf_config(const ModelSpec& m);

// The model_type values parse_hf_config reads.
std::vector<std::string> supported_model_types();

struct CatalogEntry {
  std::string name;         // "gpt2-xl"
  std::string description;  // one line, with the source of the shape
  int64_t published_params; // the count its authors publish (0 when none is published exactly)
  std::string_view config;  // the embedded config.json text
};

const std::vector<CatalogEntry>& catalog();

// A catalog name, a path to a config.json, or a directory holding one (what
// save_pretrained writes). An unknown name that is not a file is an error that suggests the
// closest catalog names.
ModelSpec load_model(const std::string& name_or_path);

// Up to `n` catalog names closest to `name` (edit distance), best first.
std::vector<std::string> closest_catalog_names(std::string_view name, std::size_t n = 3);

// Levenshtein distance (insertions, deletions, substitutions of one character each), for
// "did you mean" hints; letters compared without case when ignore_case.
std::size_t edit_distance(std::string_view a, std::string_view b, bool ignore_case = false);
// Suggestions ("closest: ...") compare the first kSuggestChars characters of a misspelt name:
// no catalog name or flag is longer, and a pasted megabyte costs no quadratic time.
inline constexpr std::size_t kSuggestChars = 64;

// Up to `n` of `candidates` closest to `name` (its first kSuggestChars characters) by
// edit_distance, at most `max_distance` away, best first, ties in the candidates' order: what
// a stable sort by distance gives, without computing the distances that cannot enter the n
// best (a length difference already too large, a row of the table past the n-th best).
std::vector<std::string_view> closest_names(std::string_view name,
                                            const std::vector<std::string_view>& candidates,
                                            std::size_t n, bool ignore_case = false,
                                            std::size_t max_distance = SIZE_MAX);

}  // namespace zp::models
