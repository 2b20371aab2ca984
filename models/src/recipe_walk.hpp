// recipe_walk.hpp (internal to zp::models): every parameter tensor a recipe has, by role
// ("slot"), in Hugging Face's module order. The inventory names them (param_inventory.cpp) and
// the graph sums them into its modules (graph.cpp): one walk, so the two cannot disagree.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "zp/models/model_spec.hpp"

namespace zp::models::detail {

struct SlotTensor {
  std::string_view slot;        // "attn.q.weight", "moe.expert.down.bias", "embed.weight"
  std::vector<int64_t> shape;   // as torch stores it
  int64_t layer = -1;           // block index; -1 before the blocks; n_blocks() after
  int64_t expert = -1;          // routed expert index (per-expert tensors), else -1
  Split split = Split::replicated;
  bool routed = false;          // belongs to the routed experts
};

// Calls `f` for every tensor of `m`, tied ones once. Sizes are overflow-checked by the caller.
// norms_first: a block's norms before its attention and MLP (the module order of GPT-2, OPT,
// Falcon, BLOOM, GPT-NeoX and T5; LLaMA-style modules register them last). Only the order of
// the calls changes.
void walk_params(const ModelSpec& m, const std::function<void(const SlotTensor&)>& f,
                 bool norms_first = false);

}  // namespace zp::models::detail
