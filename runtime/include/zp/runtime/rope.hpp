// zp/runtime/rope.hpp: the frequency table of rotary position embeddings for a model's
// RopeSpec (rope_theta and rope_scaling of its config), as transformers computes it
// (modeling_rope_utils.py at ef46806: ROPE_INIT_FUNCTIONS), in the same fp32 arithmetic, so
// that cpu::rope_forward turns q and k by the angles transformers' modules use.
//
// Example usage:
//   const RopeTable tab = rope_table(model.rope, model.rotary_dim, model.n_positions);
//   cpu::rope_forward(qkv, tab.inv_freq.data(), tab.attention_factor, B, T, row, NH + KVH, HS, rot);
#pragma once

#include <cstdint>
#include <vector>

#include "zp/models/model_spec.hpp"

namespace zp::runtime {

struct RopeTable {
  std::vector<float> inv_freq;   // rot / 2 values: the angle of pair i at position t is t inv_freq[i]
  float attention_factor = 1.0f; // cos and sin are scaled by it (YaRN's; 1 for the others)
};

// For `rot` rotated dims per head of a model of `max_positions` positions (its
// max_position_embeddings):
//   - default: inv_freq_i = 1 / theta^(2i/rot);
//   - linear: default / factor (Kaiokendev's position interpolation);
//   - dynamic (NTK-aware): theta scaled for sequences longer than max_positions; training
//     sequences are at most max_positions long, where it is the default table;
//   - llama3: low frequencies (wavelength > original / low_freq_factor) divided by factor, high
//     ones (< original / high_freq_factor) kept, the band between interpolated smoothly;
//   - yarn (Peng et al. 2023): a ramp between interpolated and extrapolated frequencies over
//     the dims whose rotation counts lie between beta_slow and beta_fast; attention factor
//     0.1 ln(factor) + 1 unless given.
// zp::Error for another type (longrope, ...), naming it, and for rot odd or < 2.
RopeTable rope_table(const models::RopeSpec& r, int64_t rot, int64_t max_positions);

}  // namespace zp::runtime
