// llama_step.hpp: the forward and backward of a whole LLaMA-family decoder (LLaMA, Qwen2 with
// q/k/v biases, Qwen3 with per-head q/k norms) as a plain sequence of CPU kernel calls in transformers' modeling_llama
// order, on std::vector buffers: RMSNorm, the fused q|k|v projection, rotary embeddings,
// grouped-query attention, the output projection, RMSNorm, gate and up projections, SwiGLU,
// the down projection, a final RMSNorm and an untied LM head. Used by test_llama_reference
// against the PyTorch fixtures (tools/fixtures/llama_fixture.py). Not the engine: no arena, no
// ZeRO, no optimizer; every activation is kept.
//
// Example usage:
//   zp::testing::LlamaStep step(dims, inv_freq, attention_factor);
//   float loss = step.forward(params.data(), tokens, targets);
//   step.backward(params.data(), grads.data());  // grads += d mean loss / d params
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "zp/runtime/cpu_kernels.hpp"

namespace zp::testing {

struct LlamaDims {
  int64_t B, T, C, NH, KVH, HS, F, L, V;
  bool qkv_bias = false;
  float eps = 1e-5f;
  int64_t window = 0;  // Mistral's sliding window (every layer); 0: none
  bool qk_norm = false;  // Qwen3's RMSNorm of each q and k head, before the rotation
  int64_t R() const { return (NH + 2 * KVH) * HS; }  // fused q|k|v row
  int64_t A() const { return NH * HS; }              // attention output row
  int64_t QK() const { return (NH + KVH) * HS; }     // q|k row (their own tensor with q/k norms)
};

// The parameters in one flat buffer, in the fixture's order.
struct LlamaTensors {
  struct Layer {
    int64_t attn_norm, wqkv, bqkv = -1, qk_norm = -1, wo, mlp_norm, w_gate_up, w_down;
  };
  int64_t embed = 0, final_norm = 0, lm_head = 0, n_params = 0;
  std::vector<Layer> layers;
  explicit LlamaTensors(const LlamaDims& d) {
    auto take = [&](int64_t n) { return std::exchange(n_params, n_params + n); };
    embed = take(d.V * d.C);
    for (int64_t l = 0; l < d.L; ++l) {
      Layer y{};
      y.attn_norm = take(d.C);
      y.wqkv = take(d.R() * d.C);
      if (d.qkv_bias) y.bqkv = take(d.R());
      if (d.qk_norm) y.qk_norm = take(2 * d.HS);  // q_norm, then k_norm
      y.wo = take(d.C * d.A());
      y.mlp_norm = take(d.C);
      y.w_gate_up = take(2 * d.F * d.C);
      y.w_down = take(d.C * d.F);
      layers.push_back(y);
    }
    final_norm = take(d.C);
    lm_head = take(d.V * d.C);
  }
};

class LlamaStep {
 public:
  LlamaStep(const LlamaDims& d, std::vector<float> inv_freq, float attention_factor)
      : d_(d), t_(d), inv_freq_(std::move(inv_freq)), mscale_(attention_factor) {
    const int64_t N = d.B * d.T;
    for (int64_t l = 0; l <= d.L; ++l) x_.emplace_back(N * d.C);
    for (int64_t l = 0; l < d.L; ++l) {
      Acts a;
      a.ln1.resize(N * d.C); a.s1.resize(N); a.qkv.resize(N * d.R());
      if (d.qk_norm) a.qk.resize(N * d.QK()), a.sqk.resize(N * (d.NH + d.KVH));
      a.pre.resize(d.B * d.NH * d.T * d.T); a.att.resize(a.pre.size()); a.o.resize(N * d.A());
      a.h.resize(N * d.C); a.ln2.resize(N * d.C); a.s2.resize(N);
      a.gate.resize(N * d.F); a.up.resize(N * d.F); a.act.resize(N * d.F);
      acts_.push_back(std::move(a));
    }
    lnf_.resize(N * d.C); sf_.resize(N); logits_.resize(N * d.V); losses_.resize(N);
  }
  int64_t n_params() const { return t_.n_params; }
  const std::vector<float>& logits() const { return logits_; }  // before the softmax

  // The mean cross-entropy over the B*T tokens.
  float forward(const float* p, const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets) {
    namespace cpu = zp::runtime::cpu;
    const LlamaDims& d = d_;
    const int64_t N = d.B * d.T;
    const cpu::AttnShape shape = attn_shape();
    tokens_ = tokens;
    targets_ = targets;
    cpu::embedding_forward(x_[0].data(), tokens.data(), p + t_.embed, nullptr, d.B, d.T, d.C);
    for (int64_t l = 0; l < d.L; ++l) {
      const auto& w = t_.layers[static_cast<std::size_t>(l)];
      Acts& a = acts_[static_cast<std::size_t>(l)];
      cpu::rmsnorm_forward(a.ln1.data(), a.s1.data(), x_[l].data(), p + w.attn_norm, 0.0f, d.eps, N, d.C);
      cpu::matmul_forward(a.qkv.data(), a.ln1.data(), p + w.wqkv, w.bqkv >= 0 ? p + w.bqkv : nullptr, N,
                          d.C, d.R());
      // q and k: in the fused row, or (q/k norms) normed into a tensor of their own.
      float* qk = a.qkv.data();
      if (d.qk_norm) {
        cpu::head_rmsnorm_forward(a.qk.data(), a.sqk.data(), a.qkv.data(), p + w.qk_norm, d.eps, N, d.R(),
                                  d.NH, d.KVH, d.HS);
        qk = a.qk.data();
      }
      cpu::rope_forward(qk, inv_freq_.data(), mscale_, d.B, d.T, d.qk_norm ? d.QK() : d.R(), d.NH + d.KVH,
                        d.HS, 2 * static_cast<int64_t>(inv_freq_.size()));
      cpu::attention_scores(a.pre.data(), qk, shape);
      cpu::attention_softmax(a.att.data(), a.pre.data(), shape);
      cpu::attention_values(a.o.data(), a.att.data(), a.qkv.data(), shape);
      std::vector<float> proj(N * d.C);
      cpu::matmul_forward(proj.data(), a.o.data(), p + w.wo, nullptr, N, d.A(), d.C);
      cpu::residual_forward(a.h.data(), x_[l].data(), proj.data(), N * d.C);
      cpu::rmsnorm_forward(a.ln2.data(), a.s2.data(), a.h.data(), p + w.mlp_norm, 0.0f, d.eps, N, d.C);
      cpu::matmul_forward(a.gate.data(), a.ln2.data(), p + w.w_gate_up, nullptr, N, d.C, d.F);
      cpu::matmul_forward(a.up.data(), a.ln2.data(), p + w.w_gate_up + d.F * d.C, nullptr, N, d.C, d.F);
      cpu::swiglu_forward(a.act.data(), a.gate.data(), a.up.data(), N * d.F);
      cpu::matmul_forward(proj.data(), a.act.data(), p + w.w_down, nullptr, N, d.F, d.C);
      cpu::residual_forward(x_[l + 1].data(), a.h.data(), proj.data(), N * d.C);
    }
    cpu::rmsnorm_forward(lnf_.data(), sf_.data(), x_[d.L].data(), p + t_.final_norm, 0.0f, d.eps, N, d.C);
    cpu::matmul_forward(logits_.data(), lnf_.data(), p + t_.lm_head, nullptr, N, d.C, d.V);
    probs_ = logits_;
    cpu::crossentropy_forward(probs_.data(), losses_.data(), targets.data(), N, d.V);
    double s = 0;
    for (float x : losses_) s += x;
    return static_cast<float>(s / static_cast<double>(N));
  }

  void backward(const float* p, float* g) {
    namespace cpu = zp::runtime::cpu;
    const LlamaDims& d = d_;
    const int64_t N = d.B * d.T;
    const cpu::AttnShape shape = attn_shape();
    const int64_t rot = 2 * static_cast<int64_t>(inv_freq_.size());
    std::vector<float> dlogits = probs_;
    cpu::crossentropy_backward(dlogits.data(), targets_.data(), 1.0f / static_cast<float>(N), N, d.V);
    std::vector<float> dlnf(N * d.C, 0.0f), dx(N * d.C, 0.0f);
    cpu::matmul_backward(dlnf.data(), g + t_.lm_head, nullptr, dlogits.data(), lnf_.data(),
                         p + t_.lm_head, N, d.C, d.V);
    cpu::rmsnorm_backward(dx.data(), g + t_.final_norm, dlnf.data(), x_[d.L].data(), p + t_.final_norm,
                          0.0f, sf_.data(), N, d.C);
    for (int64_t l = d.L - 1; l >= 0; --l) {
      const auto& w = t_.layers[static_cast<std::size_t>(l)];
      const Acts& a = acts_[static_cast<std::size_t>(l)];
      // The MLP: dx is the gradient of x_{l+1} = h + down(swiglu(gate, up)).
      std::vector<float> dact(N * d.F, 0.0f), dgu(N * 2 * d.F), dln2(N * d.C, 0.0f);
      cpu::matmul_backward(dact.data(), g + w.w_down, nullptr, dx.data(), a.act.data(), p + w.w_down, N,
                           d.F, d.C);
      cpu::swiglu_backward(dgu.data(), dact.data(), a.gate.data(), a.up.data(), N, d.F);
      // The fused gate|up weight (2F, C) takes back rows of (d gate | d up) in one GEMM.
      cpu::matmul_backward(dln2.data(), g + w.w_gate_up, nullptr, dgu.data(), a.ln2.data(),
                           p + w.w_gate_up, N, d.C, 2 * d.F);
      std::vector<float> dh = dx;  // the residual
      cpu::rmsnorm_backward(dh.data(), g + w.mlp_norm, dln2.data(), a.h.data(), p + w.mlp_norm, 0.0f,
                            a.s2.data(), N, d.C);
      // The attention: dh is the gradient of h = x_l + wo(o).
      std::vector<float> d_o(N * d.A(), 0.0f), datt(a.att.size(), 0.0f), dqkv(N * d.R(), 0.0f);
      cpu::matmul_backward(d_o.data(), g + w.wo, nullptr, dh.data(), a.o.data(), p + w.wo, N, d.A(), d.C);
      cpu::attention_values_backward(datt.data(), dqkv.data(), d_o.data(), a.att.data(), a.qkv.data(), shape);
      cpu::attention_softmax_backward(datt.data(), datt.data(), a.att.data(), shape);
      cpu::attention_scores_backward(dqkv.data(), datt.data(), d.qk_norm ? a.qk.data() : a.qkv.data(),
                                     shape);
      cpu::rope_backward(dqkv.data(), inv_freq_.data(), mscale_, d.B, d.T, d.R(), d.NH + d.KVH, d.HS, rot);
      if (d.qk_norm)
        cpu::head_rmsnorm_backward(dqkv.data(), g + w.qk_norm, a.qkv.data(), p + w.qk_norm, a.sqk.data(), N,
                                   d.R(), d.NH, d.KVH, d.HS);
      std::vector<float> dln1(N * d.C, 0.0f);
      cpu::matmul_backward(dln1.data(), g + w.wqkv, w.bqkv >= 0 ? g + w.bqkv : nullptr, dqkv.data(),
                           a.ln1.data(), p + w.wqkv, N, d.C, d.R());
      dx = dh;  // the residual
      cpu::rmsnorm_backward(dx.data(), g + w.attn_norm, dln1.data(), x_[l].data(), p + w.attn_norm, 0.0f,
                            a.s1.data(), N, d.C);
    }
    cpu::embedding_backward(g + t_.embed, nullptr, dx.data(), tokens_.data(), d.B, d.T, d.C);
  }

 private:
  struct Acts {
    std::vector<float> ln1, s1, qkv, qk, sqk, pre, att, o, h, ln2, s2, gate, up, act;
  };
  zp::runtime::cpu::AttnShape attn_shape() const {
    zp::runtime::cpu::AttnShape s{d_.B, d_.T, d_.NH, d_.KVH, d_.HS, d_.window};
    if (d_.qk_norm) s.qk_row = d_.QK();
    return s;
  }
  LlamaDims d_;
  LlamaTensors t_;
  std::vector<float> inv_freq_;
  float mscale_;
  std::vector<std::vector<float>> x_;  // x_[l]: the input of layer l; x_[L]: of the final norm
  std::vector<Acts> acts_;
  std::vector<float> lnf_, sf_, logits_, probs_, losses_;
  std::vector<int32_t> tokens_, targets_;
};

}  // namespace zp::testing
