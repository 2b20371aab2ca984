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
