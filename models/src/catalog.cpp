// catalog.cpp: the built-in model catalog. Each entry's config.json is embedded at build time
// from models/configs/; the descriptions name where each shape comes from.
#include <array>
#include <string_view>
#include <utility>

#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"

namespace zp::models {
namespace {

struct EmbeddedConfig {
  std::string_view name;
  std::string_view text;
};

constexpr EmbeddedConfig kConfigs[] = {
#include "catalog_configs.inc"
};

struct Describe {
  std::string_view name;
  std::string_view description;
  int64_t published_params;  // exact count published for the checkpoint; 0 when none is
};

// Published counts: the Hugging Face checkpoints' parameter counts (model cards and
// `sum(p.numel() for p in model.parameters())`), which the tests compare against.
constexpr Describe kDescriptions[] = {
    {"gpt2-tiny", "GPT-2 shape, 2 layers, C=64, byte vocabulary (256): for tests and the CPU "
                  "runtime", 0},
    {"llama-tiny", "Llama 3 shape, 2 layers, C=32, 4 query heads over 2 KV heads, the llama3 "
                   "rotary table, byte vocabulary (256): for tests and the CPU runtime", 0},
    {"mixtral-tiny", "Mixtral shape, 2 layers, C=32, 4 experts of 24, top 2, the load-balancing "
                     "loss at 0.02, byte vocabulary (256): for tests and the CPU runtime", 0},
    {"gpt2", "GPT-2 small (Radford et al. 2019; HF openai-community/gpt2)", 124439808},
    {"gpt2-medium", "GPT-2 medium (HF openai-community/gpt2-medium)", 354823168},
    {"gpt2-large", "GPT-2 large (HF openai-community/gpt2-large)", 774030080},
    {"gpt2-xl", "GPT-2 XL 1.5B (HF openai-community/gpt2-xl)", 1557611200},
    {"megatron-8.3b", "Megatron-LM GPT-2 8.3B (Shoeybi et al. 2019, table 1: 72 layers, "
                      "hidden 3072, 32 heads, vocab padded to 51200)", 0},
    {"turing-nlg-17b", "Turing-NLG 17.2B (Microsoft 2020: 78 layers, hidden 4256, 28 heads)",
     0},
    {"gpt3-175b", "GPT-3 175B (Brown et al. 2020, table 2.1: 96 layers, d_model 12288, "
                  "96 heads, context 2048)", 0},
    {"llama-2-7b", "LLaMA 2 7B (Touvron et al. 2023; HF meta-llama/Llama-2-7b-hf)",
     6738415616},
    {"llama-2-13b", "LLaMA 2 13B (HF meta-llama/Llama-2-13b-hf)", 13015864320},
    {"llama-2-70b", "LLaMA 2 70B, grouped-query attention with 8 KV heads "
                    "(HF meta-llama/Llama-2-70b-hf)", 68976648192},
    // Shapes: each checkpoint's config.json on the Hugging Face Hub (the repo named). Counts:
    // Meta's model card (8B); the Hub's safetensors metadata total (70B, 405B); llama.cpp's
    // GGUF general.parameter_count, which sums the checkpoint's tensors (Mistral 7B, Qwen3-30B-
    // A3B, gpt-oss-20b, unpacked from MXFP4); keras-hub's preset tables, converted from the
    // same checkpoints (Mixtral, Qwen2.5, Gemma 2, Phi-3); T5-11B: a published table of HF
    // checkpoint sizes (one source). DeepSeek-V3 publishes "671B + 14B MTP", rounded.
    {"llama-3.1-8b", "Llama 3.1 8B, GQA 8 KV heads, 128K context (HF meta-llama/Llama-3.1-8B)",
     8030261248},
    {"llama-3.1-70b", "Llama 3.1 70B (HF meta-llama/Llama-3.1-70B)", 70553706496},
    {"llama-3.1-405b", "Llama 3.1 405B, 126 layers (HF meta-llama/Llama-3.1-405B)", 405853388800},
    {"mistral-7b", "Mistral 7B v0.1, sliding window 4096 (HF mistralai/Mistral-7B-v0.1)",
     7241732096},
    {"mixtral-8x7b", "Mixtral 8x7B, MoE: 8 experts, top-2 (HF mistralai/Mixtral-8x7B-v0.1)",
     46702792704},
    {"qwen2.5-7b", "Qwen2.5 7B, q/k/v biases (HF Qwen/Qwen2.5-7B)", 7615616512},
    {"qwen2.5-72b", "Qwen2.5 72B (HF Qwen/Qwen2.5-72B)", 72706203648},
    {"qwen3-30b-a3b", "Qwen3 30B-A3B, MoE: 128 experts, top-8, q/k norms (HF Qwen/Qwen3-30B-A3B)",
     30532122624},
    {"gemma-2-9b", "Gemma 2 9B, sandwich norms, logit softcaps, alternating sliding window "
                   "(HF google/gemma-2-9b)", 9241705984},
    {"phi-3-mini", "Phi-3 mini 4K, fused qkv and gate/up (HF microsoft/Phi-3-mini-4k-instruct)",
     3821079552},
    {"deepseek-v3", "DeepSeek-V3 671B, MLA, 256 routed + 1 shared expert, top-8, 3 dense layers; "
                    "the MTP module is counted apart (HF deepseek-ai/DeepSeek-V3)", 0},
    {"gpt-oss-20b", "gpt-oss 20B, MoE: 32 experts, top-4, attention sinks, sliding/full layers "
                    "(HF openai/gpt-oss-20b)", 20914757184},
    {"t5-11b", "T5 11B encoder-decoder, 24 + 24 layers, d_ff 65536 (Raffel et al. 2020; HF "
               "google-t5/t5-11b)", 11307321344},
};

std::vector<CatalogEntry> build() {
  static_assert(std::size(kConfigs) == std::size(kDescriptions),
                "every embedded config needs a description (models/src/catalog.cpp)");
  std::vector<CatalogEntry> out;
  for (const auto& c : kConfigs) {
    const Describe* d = nullptr;
    for (const auto& x : kDescriptions)
      if (x.name == c.name) d = &x;
    if (d == nullptr) throw Error("catalog: embedded config without a description");
    out.push_back({std::string(c.name), std::string(d->description), d->published_params,
                   c.text});
  }
  return out;
}

}  // namespace

const std::vector<CatalogEntry>& catalog() {
  static const std::vector<CatalogEntry> entries = build();
  return entries;
}

}  // namespace zp::models
