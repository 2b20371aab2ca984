// tiny_configs.hpp: the tiny LLaMA-family configs (config.json text, as transformers writes it)
// the engine tests train: a LLaMA 3 (grouped-query attention, the llama3 rotary table) and a
// Qwen2 (q/k/v biases), a Mistral (sliding window), a Qwen3 (q/k norms), and the MoE models of
// the PyTorch fixtures (tools/fixtures/llama_fixture.py).
#pragma once

#include <string>

namespace zp::test {

// V = 256: zero-run's data is byte-level. A Mistral: the LLaMA's shape with a sliding window
// of 5 keys and the default rotary table.
inline std::string tiny_mistral() {
  return R"({"model_type": "mistral", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "sliding_window": 5, "tie_word_embeddings": false})";
}

// Mixture of experts, as the PyTorch fixtures' (tools/fixtures/llama_fixture.py): Mixtral (4
// experts of 24, top 2 renormalised, the load-balancing loss at 0.02); Qwen2-MoE (layer 0 dense,
// a gated shared expert of 40, top 2 as routed, q/k/v biases, loss 0.001); Qwen3-MoE (q/k
// norms, top 2 renormalised).
inline std::string tiny_moe(const std::string& type) {
  const std::string common = R"("vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
    "rope_theta": 1000000.0, "tie_word_embeddings": false, "output_router_logits": true)";
  if (type == "mixtral")
    return R"({"model_type": "mixtral", )" + common + R"(, "intermediate_size": 24, "rms_norm_eps": 1e-05,
      "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "sliding_window": null})";
  if (type == "qwen2_moe")
    return R"({"model_type": "qwen2_moe", )" + common + R"(, "intermediate_size": 48, "rms_norm_eps": 1e-06,
      "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
      "shared_expert_intermediate_size": 40, "decoder_sparse_step": 1, "mlp_only_layers": [0],
      "norm_topk_prob": false, "router_aux_loss_coef": 0.001, "use_sliding_window": false})";
  return R"({"model_type": "qwen3_moe", )" + common + R"(, "intermediate_size": 48, "rms_norm_eps": 1e-06,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": true, "router_aux_loss_coef": 0.001,
    "attention_bias": false, "use_sliding_window": false})";
}

// Qwen3: the LLaMA's shape with per-head q/k norms (head_dim 8, so the norms' weights are 8).
inline std::string tiny_qwen3() {
  return R"({"model_type": "qwen3", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "attention_bias": false, "use_sliding_window": false, "sliding_window": null,
    "tie_word_embeddings": false})";
}

inline std::string tiny_config(bool qkv_bias) {
  return std::string(R"({"model_type": ")") + (qkv_bias ? "qwen2" : "llama") +
         R"(", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "tie_word_embeddings": false)" +
         (qkv_bias ? std::string(R"(, "sliding_window": null, "use_sliding_window": false})")
                   : std::string(R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}})"));
}

}  // namespace zp::test
