// Fields Hugging Face transformers configuration classes write into config.json, per model_type.
// Plain data: sorted std::string_view arrays and a lookup. See hf_fields.hpp.
#include "hf_fields.hpp"

#include <array>
#include <string_view>

namespace zp::models::hf {
namespace {

using namespace std::string_view_literals;

// Source: huggingface/transformers src/transformers/configuration_utils.py @ 008e574391258935f3ecc3035c882e73bbcac419 (v5 main)
// Source: vendored v4.4x copy of the same file (index id 29068239; _get_global_generation_defaults id 29068239/245946005)
// Source: huggingface/transformers src/transformers/configuration_utils.py @ bdf52342d8e725ea54973b3e3593be4717e9c1b0 (v3.x)
constexpr std::array<std::string_view, 76> kCommon{
    "_attn_implementation"sv, "_attn_implementation_autoset"sv, "_attn_implementation_internal"sv,
    "_commit_hash"sv, "_experts_implementation"sv, "_name_or_path"sv, "_pre_quantization_dtype"sv,
    "add_cross_attention"sv, "architectures"sv, "attn_implementation"sv, "auto_map"sv, "bad_words_ids"sv,
    "begin_suppress_tokens"sv, "bos_token_id"sv, "chunk_size_feed_forward"sv, "cross_attention_hidden_size"sv,
    "decoder_start_token_id"sv, "diversity_penalty"sv, "do_sample"sv, "dtype"sv, "early_stopping"sv,
    "encoder_no_repeat_ngram_size"sv, "eos_token_id"sv, "experts_implementation"sv,
    "exponential_decay_length_penalty"sv, "finetuning_task"sv, "forced_bos_token_id"sv,
    "forced_decoder_ids"sv, "forced_eos_token_id"sv, "gradient_checkpointing"sv, "id2label"sv, "is_decoder"sv,
    "is_encoder_decoder"sv, "label2id"sv, "length_penalty"sv, "max_length"sv, "max_new_tokens"sv,
    "min_length"sv, "min_new_tokens"sv, "model_type"sv, "name_or_path"sv, "no_repeat_ngram_size"sv,
    "num_beam_groups"sv, "num_beams"sv, "num_labels"sv, "num_return_sequences"sv, "output_attentions"sv,
    "output_hidden_states"sv, "output_past"sv, "output_scores"sv, "pad_token_id"sv, "prefix"sv,
    "problem_type"sv, "pruned_heads"sv, "quantization_config"sv, "remove_invalid_values"sv,
    "repetition_penalty"sv, "return_dict"sv, "return_dict_in_generate"sv, "sep_token_id"sv,
    "suppress_tokens"sv, "task_specific_params"sv, "temperature"sv, "tf_legacy_loss"sv,
    "tie_encoder_decoder"sv, "tokenizer_class"sv, "top_k"sv, "top_p"sv, "torch_dtype"sv, "torchscript"sv,
    "transformers_version"sv, "typical_p"sv, "use_bfloat16"sv, "use_cache"sv, "use_return_dict"sv,
    "xla_device"sv,
};

// Source: huggingface/transformers src/transformers/models/gpt2/configuration_gpt2.py @ 01ae98ae2414210efd0d9ac1ffe78ff21588f1f7
// Source: old fields (n_ctx, output_past, summary_*) as in published openai-community/gpt2* config.json
constexpr std::array<std::string_view, 33> k_gpt2{
    "activation_function"sv, "add_cross_attention"sv, "attn_pdrop"sv, "bos_token_id"sv, "embd_pdrop"sv,
    "eos_token_id"sv, "gradient_checkpointing"sv, "hidden_size"sv, "initializer_range"sv,
    "layer_norm_epsilon"sv, "max_position_embeddings"sv, "n_ctx"sv, "n_embd"sv, "n_head"sv, "n_inner"sv,
    "n_layer"sv, "n_positions"sv, "num_attention_heads"sv, "num_hidden_layers"sv, "output_past"sv,
    "pad_token_id"sv, "reorder_and_upcast_attn"sv, "resid_pdrop"sv, "scale_attn_by_inverse_layer_idx"sv,
    "scale_attn_weights"sv, "summary_activation"sv, "summary_first_dropout"sv, "summary_proj_to_labels"sv,
    "summary_type"sv, "summary_use_proj"sv, "tie_word_embeddings"sv, "use_cache"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/llama/configuration_llama.py @ 008e574391258935f3ecc3035c882e73bbcac419
constexpr std::array<std::string_view, 23> k_llama{
    "attention_bias"sv, "attention_dropout"sv, "bos_token_id"sv, "eos_token_id"sv, "head_dim"sv,
    "hidden_act"sv, "hidden_size"sv, "initializer_range"sv, "intermediate_size"sv,
    "max_position_embeddings"sv, "mlp_bias"sv, "num_attention_heads"sv, "num_hidden_layers"sv,
    "num_key_value_heads"sv, "pad_token_id"sv, "pretraining_tp"sv, "rms_norm_eps"sv, "rope_parameters"sv,
    "rope_scaling"sv, "rope_theta"sv, "tie_word_embeddings"sv, "use_cache"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/mistral/configuration_mistral.py @ 001f85b38fb432858ace93f18622f07cec46d874
constexpr std::array<std::string_view, 22> k_mistral{
    "attention_dropout"sv, "bos_token_id"sv, "eos_token_id"sv, "head_dim"sv, "hidden_act"sv, "hidden_size"sv,
    "initializer_range"sv, "intermediate_size"sv, "layer_types"sv, "max_position_embeddings"sv,
    "num_attention_heads"sv, "num_hidden_layers"sv, "num_key_value_heads"sv, "pad_token_id"sv,
    "rms_norm_eps"sv, "rope_parameters"sv, "rope_scaling"sv, "rope_theta"sv, "sliding_window"sv,
    "tie_word_embeddings"sv, "use_cache"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/mixtral/configuration_mixtral.py @ 008e574391258935f3ecc3035c882e73bbcac419
constexpr std::array<std::string_view, 27> k_mixtral{
    "attention_dropout"sv, "bos_token_id"sv, "eos_token_id"sv, "head_dim"sv, "hidden_act"sv, "hidden_size"sv,
    "initializer_range"sv, "intermediate_size"sv, "max_position_embeddings"sv, "num_attention_heads"sv,
    "num_experts"sv, "num_experts_per_tok"sv, "num_hidden_layers"sv, "num_key_value_heads"sv,
    "num_local_experts"sv, "output_router_logits"sv, "pad_token_id"sv, "rms_norm_eps"sv, "rope_parameters"sv,
    "rope_scaling"sv, "rope_theta"sv, "router_aux_loss_coef"sv, "router_jitter_noise"sv, "sliding_window"sv,
    "tie_word_embeddings"sv, "use_cache"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/qwen2/configuration_qwen2.py @ 008e574391258935f3ecc3035c882e73bbcac419
// Source: use_mrope: carried by published Qwen/Qwen2.5-* config.json (not in the transformers class)
constexpr std::array<std::string_view, 24> k_qwen2{
    "attention_dropout"sv, "bos_token_id"sv, "eos_token_id"sv, "hidden_act"sv, "hidden_size"sv,
    "initializer_range"sv, "intermediate_size"sv, "layer_types"sv, "max_position_embeddings"sv,
    "max_window_layers"sv, "num_attention_heads"sv, "num_hidden_layers"sv, "num_key_value_heads"sv,
    "pad_token_id"sv, "rms_norm_eps"sv, "rope_parameters"sv, "rope_scaling"sv, "rope_theta"sv,
    "sliding_window"sv, "tie_word_embeddings"sv, "use_cache"sv, "use_mrope"sv, "use_sliding_window"sv,
    "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/qwen2_moe/configuration_qwen2_moe.py @ 008e574391258935f3ecc3035c882e73bbcac419
constexpr std::array<std::string_view, 33> k_qwen2_moe{
    "attention_dropout"sv, "bos_token_id"sv, "decoder_sparse_step"sv, "eos_token_id"sv, "hidden_act"sv,
    "hidden_size"sv, "initializer_range"sv, "intermediate_size"sv, "layer_types"sv,
    "max_position_embeddings"sv, "max_window_layers"sv, "mlp_only_layers"sv, "moe_intermediate_size"sv,
    "norm_topk_prob"sv, "num_attention_heads"sv, "num_experts"sv, "num_experts_per_tok"sv,
    "num_hidden_layers"sv, "num_key_value_heads"sv, "output_router_logits"sv, "pad_token_id"sv, "qkv_bias"sv,
    "rms_norm_eps"sv, "rope_parameters"sv, "rope_scaling"sv, "rope_theta"sv, "router_aux_loss_coef"sv,
    "shared_expert_intermediate_size"sv, "sliding_window"sv, "tie_word_embeddings"sv, "use_cache"sv,
    "use_sliding_window"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/qwen3/configuration_qwen3.py @ 008e574391258935f3ecc3035c882e73bbcac419
constexpr std::array<std::string_view, 25> k_qwen3{
    "attention_bias"sv, "attention_dropout"sv, "bos_token_id"sv, "eos_token_id"sv, "head_dim"sv,
    "hidden_act"sv, "hidden_size"sv, "initializer_range"sv, "intermediate_size"sv, "layer_types"sv,
    "max_position_embeddings"sv, "max_window_layers"sv, "num_attention_heads"sv, "num_hidden_layers"sv,
    "num_key_value_heads"sv, "pad_token_id"sv, "rms_norm_eps"sv, "rope_parameters"sv, "rope_scaling"sv,
    "rope_theta"sv, "sliding_window"sv, "tie_word_embeddings"sv, "use_cache"sv, "use_sliding_window"sv,
    "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/qwen3_moe/configuration_qwen3_moe.py @ 008e574391258935f3ecc3035c882e73bbcac419
// Source: head_dim, max_window_layers: carried by published Qwen/Qwen3-*-A*B config.json
constexpr std::array<std::string_view, 33> k_qwen3_moe{
    "attention_bias"sv, "attention_dropout"sv, "bos_token_id"sv, "decoder_sparse_step"sv, "eos_token_id"sv,
    "head_dim"sv, "hidden_act"sv, "hidden_size"sv, "initializer_range"sv, "intermediate_size"sv,
    "max_position_embeddings"sv, "max_window_layers"sv, "mlp_only_layers"sv, "moe_intermediate_size"sv,
    "norm_topk_prob"sv, "num_attention_heads"sv, "num_experts"sv, "num_experts_per_tok"sv,
    "num_hidden_layers"sv, "num_key_value_heads"sv, "num_local_experts"sv, "output_router_logits"sv,
    "pad_token_id"sv, "rms_norm_eps"sv, "rope_parameters"sv, "rope_scaling"sv, "rope_theta"sv,
    "router_aux_loss_coef"sv, "sliding_window"sv, "tie_word_embeddings"sv, "use_cache"sv,
    "use_sliding_window"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/gemma/configuration_gemma.py @ 008e574391258935f3ecc3035c882e73bbcac419
// Source: hidden_activation: v4.38+ argument (published google/gemma-* carry hidden_act and/or hidden_activation)
constexpr std::array<std::string_view, 23> k_gemma{
    "attention_bias"sv, "attention_dropout"sv, "bos_token_id"sv, "eos_token_id"sv, "head_dim"sv,
    "hidden_act"sv, "hidden_activation"sv, "hidden_size"sv, "initializer_range"sv, "intermediate_size"sv,
    "max_position_embeddings"sv, "num_attention_heads"sv, "num_hidden_layers"sv, "num_key_value_heads"sv,
    "pad_token_id"sv, "rms_norm_eps"sv, "rope_parameters"sv, "rope_scaling"sv, "rope_theta"sv,
    "tie_word_embeddings"sv, "use_bidirectional_attention"sv, "use_cache"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/gemma2/configuration_gemma2.py @ 008e574391258935f3ecc3035c882e73bbcac419
// Source: cache_implementation (v4.42-v4.5x argument), sliding_window_size: carried by published google/gemma-2-* config.json
constexpr std::array<std::string_view, 30> k_gemma2{
    "attention_bias"sv, "attention_dropout"sv, "attn_logit_softcapping"sv, "bos_token_id"sv,
    "cache_implementation"sv, "eos_token_id"sv, "final_logit_softcapping"sv, "head_dim"sv, "hidden_act"sv,
    "hidden_activation"sv, "hidden_size"sv, "initializer_range"sv, "intermediate_size"sv, "layer_types"sv,
    "max_position_embeddings"sv, "num_attention_heads"sv, "num_hidden_layers"sv, "num_key_value_heads"sv,
    "pad_token_id"sv, "query_pre_attn_scalar"sv, "rms_norm_eps"sv, "rope_parameters"sv, "rope_scaling"sv,
    "rope_theta"sv, "sliding_window"sv, "sliding_window_size"sv, "tie_word_embeddings"sv,
    "use_bidirectional_attention"sv, "use_cache"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/gemma3/configuration_gemma3.py @ 008f5c8c29be84d4721dc6d1e0fcd72300580be4 (Gemma3TextConfig)
// Source: layer_types, use_bidirectional_attention, _sliding_window_pattern: later v4.5x releases / published google/gemma-3-* text configs
constexpr std::array<std::string_view, 32> k_gemma3_text{
    "_sliding_window_pattern"sv, "attention_bias"sv, "attention_dropout"sv, "attn_logit_softcapping"sv,
    "bos_token_id"sv, "cache_implementation"sv, "eos_token_id"sv, "final_logit_softcapping"sv, "head_dim"sv,
    "hidden_act"sv, "hidden_activation"sv, "hidden_size"sv, "initializer_range"sv, "intermediate_size"sv,
    "layer_types"sv, "max_position_embeddings"sv, "num_attention_heads"sv, "num_hidden_layers"sv,
    "num_key_value_heads"sv, "pad_token_id"sv, "query_pre_attn_scalar"sv, "rms_norm_eps"sv,
    "rope_local_base_freq"sv, "rope_parameters"sv, "rope_scaling"sv, "rope_theta"sv, "sliding_window"sv,
    "sliding_window_pattern"sv, "tie_word_embeddings"sv, "use_bidirectional_attention"sv, "use_cache"sv,
    "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/gemma3/configuration_gemma3.py @ 008f5c8c29be84d4721dc6d1e0fcd72300580be4 (Gemma3Config)
constexpr std::array<std::string_view, 14> k_gemma3{
    "boi_token_id"sv, "boi_token_index"sv, "bos_token_id"sv, "eoi_token_id"sv, "eoi_token_index"sv,
    "eos_token_id"sv, "image_token_id"sv, "image_token_index"sv, "initializer_range"sv,
    "mm_tokens_per_image"sv, "pad_token_id"sv, "text_config"sv, "tie_word_embeddings"sv, "vision_config"sv,
};

// Source: huggingface/transformers src/transformers/models/phi/configuration_phi.py @ 008e574391258935f3ecc3035c882e73bbcac419
// Source: microsoft/phi-1_5 / phi-2 old remote configuration_phi.py (model_type "phi" and "phi-msft"), vendored copies: index ids 3412700753, 5666255142
constexpr std::array<std::string_view, 38> k_phi{
    "activation_function"sv, "attention_dropout"sv, "attn_pdrop"sv, "bos_token_id"sv, "embd_pdrop"sv,
    "eos_token_id"sv, "flash_attn"sv, "flash_rotary"sv, "fused_dense"sv, "gradient_checkpointing"sv,
    "hidden_act"sv, "hidden_size"sv, "initializer_range"sv, "intermediate_size"sv, "layer_norm_eps"sv,
    "layer_norm_epsilon"sv, "max_position_embeddings"sv, "n_embd"sv, "n_head"sv, "n_head_kv"sv, "n_inner"sv,
    "n_layer"sv, "n_positions"sv, "num_attention_heads"sv, "num_hidden_layers"sv, "num_key_value_heads"sv,
    "pad_token_id"sv, "pad_vocab_size_multiple"sv, "partial_rotary_factor"sv, "qk_layernorm"sv,
    "resid_pdrop"sv, "rope_parameters"sv, "rope_scaling"sv, "rope_theta"sv, "rotary_dim"sv,
    "tie_word_embeddings"sv, "use_cache"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/phi3/configuration_phi3.py @ 008e574391258935f3ecc3035c882e73bbcac419
// Source: attention_bias, partial_rotary_factor: v4.4x arguments / published microsoft/Phi-3* and Phi-4-mini config.json
constexpr std::array<std::string_view, 25> k_phi3{
    "attention_bias"sv, "attention_dropout"sv, "bos_token_id"sv, "embd_pdrop"sv, "eos_token_id"sv,
    "hidden_act"sv, "hidden_size"sv, "initializer_range"sv, "intermediate_size"sv,
    "max_position_embeddings"sv, "num_attention_heads"sv, "num_hidden_layers"sv, "num_key_value_heads"sv,
    "original_max_position_embeddings"sv, "pad_token_id"sv, "partial_rotary_factor"sv, "resid_pdrop"sv,
    "rms_norm_eps"sv, "rope_parameters"sv, "rope_scaling"sv, "rope_theta"sv, "sliding_window"sv,
    "tie_word_embeddings"sv, "use_cache"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/gpt_neox/configuration_gpt_neox.py @ 008e574391258935f3ecc3035c882e73bbcac419
// Source: rotary_pct, rotary_emb_base (BC keys popped by convert_rope_params_to_dict), attention_probs_dropout_prob / hidden_dropout_prob: published EleutherAI/gpt-neox-20b config.json
constexpr std::array<std::string_view, 28> k_gpt_neox{
    "attention_bias"sv, "attention_dropout"sv, "attention_probs_dropout_prob"sv, "bos_token_id"sv,
    "classifier_dropout"sv, "eos_token_id"sv, "hidden_act"sv, "hidden_dropout"sv, "hidden_dropout_prob"sv,
    "hidden_size"sv, "initializer_range"sv, "intermediate_size"sv, "is_decoder"sv, "layer_norm_eps"sv,
    "max_position_embeddings"sv, "num_attention_heads"sv, "num_hidden_layers"sv, "pad_token_id"sv,
    "partial_rotary_factor"sv, "rope_parameters"sv, "rope_scaling"sv, "rope_theta"sv, "rotary_emb_base"sv,
    "rotary_pct"sv, "tie_word_embeddings"sv, "use_cache"sv, "use_parallel_residual"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/opt/configuration_opt.py @ 014674d38b61e5c7109e89d496bd699121a8aa4e
// Source: enable_bias, layer_norm_elementwise_affine, _remove_final_layer_norm: later v4 OPTConfig arguments (opt-30b config.json carries _remove_final_layer_norm)
constexpr std::array<std::string_view, 23> k_opt{
    "_remove_final_layer_norm"sv, "activation_dropout"sv, "activation_function"sv, "attention_dropout"sv,
    "bos_token_id"sv, "d_model"sv, "do_layer_norm_before"sv, "dropout"sv, "enable_bias"sv, "eos_token_id"sv,
    "ffn_dim"sv, "hidden_size"sv, "init_std"sv, "layer_norm_elementwise_affine"sv, "layerdrop"sv,
    "max_position_embeddings"sv, "num_attention_heads"sv, "num_hidden_layers"sv, "pad_token_id"sv,
    "tie_word_embeddings"sv, "use_cache"sv, "vocab_size"sv, "word_embed_proj_dim"sv,
};

// Source: huggingface/transformers src/transformers/models/falcon/configuration_falcon.py @ 055855363e97555535aa9d133f53d99ef75bfd9c
// Source: later v4 FalconConfig (num_kv_heads, num_ln_in_parallel_attn, ffn_hidden_size, activation, rope_*; vendored copies index ids 571889557, 20129618060)
// Source: tiiuae RW remote config keys (n_head, n_layer, n_head_kv, n_embed, multi_query, parallel_attn, bias, alibi, apply_residual_connection_post_layernorm)
constexpr std::array<std::string_view, 31> k_falcon{
    "activation"sv, "alibi"sv, "apply_residual_connection_post_layernorm"sv, "attention_dropout"sv, "bias"sv,
    "bos_token_id"sv, "eos_token_id"sv, "ffn_hidden_size"sv, "hidden_dropout"sv, "hidden_size"sv,
    "initializer_range"sv, "layer_norm_epsilon"sv, "max_position_embeddings"sv, "multi_query"sv, "n_embed"sv,
    "n_head"sv, "n_head_kv"sv, "n_layer"sv, "new_decoder_architecture"sv, "num_attention_heads"sv,
    "num_hidden_layers"sv, "num_kv_heads"sv, "num_ln_in_parallel_attn"sv, "pad_token_id"sv, "parallel_attn"sv,
    "rope_parameters"sv, "rope_scaling"sv, "rope_theta"sv, "tie_word_embeddings"sv, "use_cache"sv,
    "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/bert/configuration_bert.py @ 008f5c8c29be84d4721dc6d1e0fcd72300580be4
// Source: directionality, pooler_fc_size, pooler_num_attention_heads, pooler_num_fc_layers, pooler_size_per_head, pooler_type: Google's original bert_config.json keys, carried by published google-bert/bert-base-multilingual-* and bert-base-chinese config.json (transformers sets them as attributes; no module reads them)
constexpr std::array<std::string_view, 25> k_bert{
    "add_cross_attention"sv, "attention_probs_dropout_prob"sv, "classifier_dropout"sv, "directionality"sv,
    "hidden_act"sv, "hidden_dropout_prob"sv, "hidden_size"sv, "initializer_range"sv, "intermediate_size"sv,
    "is_decoder"sv, "layer_norm_eps"sv, "max_position_embeddings"sv, "num_attention_heads"sv,
    "num_hidden_layers"sv, "pad_token_id"sv, "pooler_fc_size"sv, "pooler_num_attention_heads"sv,
    "pooler_num_fc_layers"sv, "pooler_size_per_head"sv, "pooler_type"sv, "position_embedding_type"sv,
    "tie_word_embeddings"sv, "type_vocab_size"sv, "use_cache"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/bloom/configuration_bloom.py @ 04efa883e0ad40da203df78a0eee902b460ee3cd
// Source: later v4 BloomConfig (n_embed BC kwarg, attribute_map num_attention_heads->n_head) and published bigscience/bloom* config.json keys (offset_alibi, seq_length, skip_bias_add*, unk_token_id)
constexpr std::array<std::string_view, 30> k_bloom{
    "apply_residual_connection_post_layernorm"sv, "attention_dropout"sv, "attention_softmax_in_fp32"sv,
    "bias_dropout_fusion"sv, "bos_token_id"sv, "dtype"sv, "eos_token_id"sv, "gradient_checkpointing"sv,
    "hidden_dropout"sv, "hidden_size"sv, "initializer_range"sv, "layer_norm_epsilon"sv,
    "masked_softmax_fusion"sv, "n_embed"sv, "n_head"sv, "n_inner"sv, "n_layer"sv, "num_attention_heads"sv,
    "num_hidden_layers"sv, "offset_alibi"sv, "pad_token_id"sv, "pretraining_tp"sv, "seq_length"sv,
    "skip_bias_add"sv, "skip_bias_add_qkv"sv, "slow_but_exact"sv, "tie_word_embeddings"sv, "unk_token_id"sv,
    "use_cache"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/olmo2/configuration_olmo2.py @ 008e574391258935f3ecc3035c882e73bbcac419
constexpr std::array<std::string_view, 20> k_olmo2{
    "attention_bias"sv, "attention_dropout"sv, "bos_token_id"sv, "eos_token_id"sv, "hidden_act"sv,
    "hidden_size"sv, "initializer_range"sv, "intermediate_size"sv, "max_position_embeddings"sv,
    "num_attention_heads"sv, "num_hidden_layers"sv, "num_key_value_heads"sv, "pad_token_id"sv,
    "rms_norm_eps"sv, "rope_parameters"sv, "rope_scaling"sv, "rope_theta"sv, "tie_word_embeddings"sv,
    "use_cache"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/deepseek_v2/configuration_deepseek_v2.py @ 008e574391258935f3ecc3035c882e73bbcac419
// Source: dawson-chen/mla-fuse configuration_deepseek.py @ 7e6d3a945af16e23d2593597b7eee54012dfaf1c (copy of deepseek-ai DeepSeek-V2 remote DeepseekV2Config)
constexpr std::array<std::string_view, 44> k_deepseek_v2{
    "attention_bias"sv, "attention_dropout"sv, "aux_loss_alpha"sv, "bos_token_id"sv, "eos_token_id"sv,
    "ep_size"sv, "first_k_dense_replace"sv, "head_dim"sv, "hidden_act"sv, "hidden_size"sv,
    "initializer_range"sv, "intermediate_size"sv, "kv_lora_rank"sv, "max_position_embeddings"sv, "mlp_bias"sv,
    "moe_intermediate_size"sv, "moe_layer_freq"sv, "n_group"sv, "n_routed_experts"sv, "n_shared_experts"sv,
    "norm_topk_prob"sv, "num_attention_heads"sv, "num_experts"sv, "num_experts_per_tok"sv,
    "num_hidden_layers"sv, "num_key_value_heads"sv, "pad_token_id"sv, "pretraining_tp"sv, "q_lora_rank"sv,
    "qk_nope_head_dim"sv, "qk_rope_head_dim"sv, "rms_norm_eps"sv, "rope_parameters"sv, "rope_scaling"sv,
    "rope_theta"sv, "routed_scaling_factor"sv, "scoring_func"sv, "seq_aux"sv, "tie_word_embeddings"sv,
    "topk_group"sv, "topk_method"sv, "use_cache"sv, "v_head_dim"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/deepseek_v3/configuration_deepseek_v3.py @ 001f85b38fb432858ace93f18622f07cec46d874
// Source: itounagi0116/DeepSeek-R1 configuration_deepseek.py @ 945ea33cfeb2167d0d22bfa91f85f0e9b778adae (copy of deepseek-ai remote DeepseekV3Config)
constexpr std::array<std::string_view, 47> k_deepseek_v3{
    "attention_bias"sv, "attention_dropout"sv, "aux_loss_alpha"sv, "bos_token_id"sv, "eos_token_id"sv,
    "ep_size"sv, "first_k_dense_replace"sv, "head_dim"sv, "hidden_act"sv, "hidden_size"sv,
    "initializer_range"sv, "intermediate_size"sv, "kv_lora_rank"sv, "max_position_embeddings"sv, "mlp_bias"sv,
    "moe_intermediate_size"sv, "moe_layer_freq"sv, "n_group"sv, "n_routed_experts"sv, "n_shared_experts"sv,
    "norm_topk_prob"sv, "num_attention_heads"sv, "num_experts_per_tok"sv, "num_hidden_layers"sv,
    "num_key_value_heads"sv, "num_local_experts"sv, "num_nextn_predict_layers"sv, "pad_token_id"sv,
    "pretraining_tp"sv, "q_lora_rank"sv, "qk_head_dim"sv, "qk_nope_head_dim"sv, "qk_rope_head_dim"sv,
    "rms_norm_eps"sv, "rope_interleave"sv, "rope_parameters"sv, "rope_scaling"sv, "rope_theta"sv,
    "routed_scaling_factor"sv, "scoring_func"sv, "seq_aux"sv, "tie_word_embeddings"sv, "topk_group"sv,
    "topk_method"sv, "use_cache"sv, "v_head_dim"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/gpt_oss/configuration_gpt_oss.py @ 02b8f42b4240dddea1b27c45d2dc95fb2682f841
// Source: rope_theta/rope_scaling (v4.55 arguments), experts_per_token, initial_context_length: published openai/gpt-oss-* config.json
constexpr std::array<std::string_view, 32> k_gpt_oss{
    "attention_bias"sv, "attention_dropout"sv, "bos_token_id"sv, "eos_token_id"sv, "experts_per_token"sv,
    "head_dim"sv, "hidden_act"sv, "hidden_size"sv, "initial_context_length"sv, "initializer_range"sv,
    "intermediate_size"sv, "layer_types"sv, "max_position_embeddings"sv, "num_attention_heads"sv,
    "num_experts"sv, "num_experts_per_tok"sv, "num_hidden_layers"sv, "num_key_value_heads"sv,
    "num_local_experts"sv, "output_router_logits"sv, "pad_token_id"sv, "rms_norm_eps"sv, "rope_parameters"sv,
    "rope_scaling"sv, "rope_theta"sv, "router_aux_loss_coef"sv, "sliding_window"sv, "swiglu_alpha"sv,
    "swiglu_limit"sv, "tie_word_embeddings"sv, "use_cache"sv, "vocab_size"sv,
};

// Source: huggingface/transformers src/transformers/models/t5/configuration_t5.py @ 038869d4d54db478c18dbe58a02aefc67f62beb0
// Source: n_positions, output_past: published google-t5/t5-* config.json; head_dim: attribute_map key (->d_kv) in later releases
constexpr std::array<std::string_view, 29> k_t5{
    "bos_token_id"sv, "classifier_dropout"sv, "d_ff"sv, "d_kv"sv, "d_model"sv, "decoder_start_token_id"sv,
    "dense_act_fn"sv, "dropout_rate"sv, "eos_token_id"sv, "feed_forward_proj"sv, "head_dim"sv,
    "hidden_size"sv, "initializer_factor"sv, "is_encoder_decoder"sv, "is_gated_act"sv, "layer_norm_epsilon"sv,
    "n_positions"sv, "num_attention_heads"sv, "num_decoder_layers"sv, "num_heads"sv, "num_hidden_layers"sv,
    "num_layers"sv, "output_past"sv, "pad_token_id"sv, "relative_attention_max_distance"sv,
    "relative_attention_num_buckets"sv, "tie_word_embeddings"sv, "use_cache"sv, "vocab_size"sv,
};

struct TypeEntry {
    std::string_view model_type;
    std::span<const std::string_view> fields;
};

constexpr std::array<TypeEntry, 24> kTypes{{
    {"bert"sv, k_bert},
    {"bloom"sv, k_bloom},
    {"deepseek_v2"sv, k_deepseek_v2},
    {"deepseek_v3"sv, k_deepseek_v3},
    {"falcon"sv, k_falcon},
    {"gemma"sv, k_gemma},
    {"gemma2"sv, k_gemma2},
    {"gemma3"sv, k_gemma3},
    {"gemma3_text"sv, k_gemma3_text},
    {"gpt2"sv, k_gpt2},
    {"gpt_neox"sv, k_gpt_neox},
    {"gpt_oss"sv, k_gpt_oss},
    {"llama"sv, k_llama},
    {"mistral"sv, k_mistral},
    {"mixtral"sv, k_mixtral},
    {"olmo2"sv, k_olmo2},
    {"opt"sv, k_opt},
    {"phi"sv, k_phi},
    {"phi3"sv, k_phi3},
    {"qwen2"sv, k_qwen2},
    {"qwen2_moe"sv, k_qwen2_moe},
    {"qwen3"sv, k_qwen3},
    {"qwen3_moe"sv, k_qwen3_moe},
    {"t5"sv, k_t5},
}};

}  // namespace

std::span<const std::string_view> common_fields() { return kCommon; }

std::span<const std::string_view> type_fields(std::string_view model_type) {
    for (const TypeEntry& entry : kTypes) {
        if (entry.model_type == model_type) return entry.fields;
    }
    return {};
}

}  // namespace zp::models::hf
