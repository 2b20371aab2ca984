#pragma once
#include <span>
#include <string_view>
namespace zp::models::hf {
// Fields every transformers PretrainedConfig may write into config.json (configuration_utils.py,
// current release AND older releases: e.g. "output_past", "xla_device", "use_return_dict",
// "gradient_checkpointing", "torchscript", "use_bfloat16", "pruned_heads", "_commit_hash",
// "_attn_implementation_autoset", "tf_legacy_loss", "cross_attention_hidden_size",
// "transformers_version", generation fields that older releases stored in the model config
// such as "max_length", "num_beams", ...). None of them changes the model's size.
std::span<const std::string_view> common_fields();
// Every field the configuration class of `model_type` writes: the __init__ arguments, the
// attributes it sets, and the keys of its attribute_map; plus fields that published Hub
// config.json files of that type carry because older transformers versions or the model
// repo's own remote-code configuration class (auto_map) wrote them. Empty span for a type
// not listed.
std::span<const std::string_view> type_fields(std::string_view model_type);
}
