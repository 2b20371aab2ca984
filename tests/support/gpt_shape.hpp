// gpt_shape.hpp: the GPT layer of Korthikanti et al. 2022 (arXiv 2205.05198) as a ModelSpec:
// hidden h, a heads, an MLP of 4h, GELU, dropout 0.1 everywhere (the paper's setting), a
// 1000-token vocabulary; the activation and pipeline tests build graphs of it.
#pragma once

#include <cstdint>

#include "zp/models/model_spec.hpp"

namespace zp::test {

inline models::ModelSpec gpt_shape(int64_t h, int64_t a, int64_t layers, int64_t s) {
  models::ModelSpec m;
  m.name = "test";
  m.model_type = "gpt2";
  m.n_layer = layers;
  m.n_embd = h;
  m.n_head = a;
  m.n_kv_head = a;
  m.head_dim = h / a;
  m.n_inner = 4 * h;
  m.n_positions = s;
  m.vocab_size = 1000;
  m.attn_dropout = m.resid_dropout = m.embd_dropout = 0.1;
  m.fused_qkv = true;  // GPT-2's c_attn (the parameter inventory names it so)
  return m;
}

}  // namespace zp::test
