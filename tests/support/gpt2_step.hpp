// gpt2_step.hpp: the forward and backward of a whole GPT-2 as a plain sequence of CPU kernel
// calls in llm.c's order, on std::vector buffers. Shared by test_gpt2_reference (against the
// PyTorch fixture) and bench_gpt2_cpu. Not the engine: no arena, no ZeRO, no optimizer, no
// recomputation; every activation is kept.
//
// Example usage:
//   zp::testing::Gpt2Step step({B, T, C, NH, L, P, V});
//   std::vector<float> params(step.n_params()), grads(step.n_params(), 0.0f);
//   float loss = step.forward(params.data(), tokens, targets);
//   step.backward(params.data(), grads.data());  // grads += d mean loss / d params
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "zp/runtime/cpu_kernels.hpp"

namespace zp::testing {

struct Gpt2Dims {
  int64_t B, T, C, NH, L, P, V;  // batch, sequence, channels, heads, layers, positions, vocab
};

// The parameter tensors inside one flat buffer, in the fixture's order (gpt2_fixture.py):
// wte, wpe, per block the twelve below, then lnf.
template <typename F>
struct Gpt2Tensors {
  struct Block {
    F* ln1w;     // (C)
    F* ln1b;     // (C)
    F* qkvw;     // (3C, C)
    F* qkvb;     // (3C)
    F* projw;    // (C, C)
    F* projb;    // (C)
    F* ln2w;     // (C)
    F* ln2b;     // (C)
    F* fcw;      // (4C, C)
    F* fcb;      // (4C)
    F* fcprojw;  // (C, 4C)
    F* fcprojb;  // (C)
  };
  F* wte;  // (V, C)
  F* wpe;  // (P, C)
  std::vector<Block> blocks;
  F* lnfw;  // (C)
  F* lnfb;  // (C)
  int64_t n_params = 0;

  Gpt2Tensors(F* flat, const Gpt2Dims& d) {
    const int64_t C = d.C;
    auto take = [&](int64_t n) {
      F* p = flat ? flat + n_params : nullptr;
      n_params += n;
      return p;
    };
    wte = take(d.V * C);
    wpe = take(d.P * C);
    for (int64_t l = 0; l < d.L; ++l) {
      Block b;
      b.ln1w = take(C), b.ln1b = take(C);
      b.qkvw = take(3 * C * C), b.qkvb = take(3 * C);
      b.projw = take(C * C), b.projb = take(C);
      b.ln2w = take(C), b.ln2b = take(C);
      b.fcw = take(4 * C * C), b.fcb = take(4 * C);
      b.fcprojw = take(C * 4 * C), b.fcprojb = take(C);
      blocks.push_back(b);
    }
    lnfw = take(C);
    lnfb = take(C);
  }
};

class Gpt2Step {
 public:
  explicit Gpt2Step(const Gpt2Dims& d) : d_(d) {
    const int64_t N = d.B * d.T, C = d.C, A = d.B * d.NH * d.T * d.T;
    layers_.resize(d.L);
    for (auto& a : layers_) {
      a.ln1.resize(N * C), a.ln1_stats.resize(2 * N), a.qkv.resize(N * 3 * C);
      a.preatt.resize(A), a.att.resize(A), a.atty.resize(N * C), a.residual2.resize(N * C);
      a.ln2.resize(N * C), a.ln2_stats.resize(2 * N), a.fch.resize(N * 4 * C);
      a.fch_gelu.resize(N * 4 * C), a.residual3.resize(N * C);
    }
    encoded_.resize(N * C), lnf_.resize(N * C), lnf_stats_.resize(2 * N);
    probs_.resize(N * d.V), losses_.resize(N);
    dresidual_.resize(N * C), dln_.resize(N * C), datty_.resize(N * C), dqkv_.resize(N * 3 * C);
    datt_.resize(A), dfch_.resize(N * 4 * C);
  }

  int64_t n_params() const { return Gpt2Tensors<const float>(nullptr, d_).n_params; }

  // The logits (B,T,V) of the last forward, copied before cross-entropy turns them into
  // probabilities (only when keep_logits).
  const std::vector<float>& logits() const { return logits_; }

  // Mean cross-entropy over the B*T tokens.
  float forward(const float* params, const int32_t* tokens, const int32_t* targets,
                bool keep_logits = false) {
    namespace cpu = zp::runtime::cpu;
    const Gpt2Tensors<const float> p(params, d_);
    const int64_t B = d_.B, T = d_.T, C = d_.C, NH = d_.NH, V = d_.V, N = B * T;
    tokens_ = tokens, targets_ = targets;
    cpu::embedding_forward(encoded_.data(), tokens, p.wte, p.wpe, B, T, C);
    const float* residual = encoded_.data();
    for (int64_t l = 0; l < d_.L; ++l) {
      const auto& w = p.blocks[l];
      auto& a = layers_[l];
      cpu::layernorm_forward(a.ln1.data(), a.ln1_stats.data(), residual, w.ln1w, w.ln1b, N, C);
      cpu::matmul_forward(a.qkv.data(), a.ln1.data(), w.qkvw, w.qkvb, N, C, 3 * C);
      cpu::attention_scores(a.preatt.data(), a.qkv.data(), B, T, C, NH);
      cpu::attention_softmax(a.att.data(), a.preatt.data(), B, NH, T);
      cpu::attention_values(a.atty.data(), a.att.data(), a.qkv.data(), B, T, C, NH);
      // attproj, into dln_ as scratch (dln_ is backward's, zeroed before each use there)
      cpu::matmul_forward(dln_.data(), a.atty.data(), w.projw, w.projb, N, C, C);
      cpu::residual_forward(a.residual2.data(), residual, dln_.data(), N * C);
      cpu::layernorm_forward(a.ln2.data(), a.ln2_stats.data(), a.residual2.data(), w.ln2w, w.ln2b,
                             N, C);
      cpu::matmul_forward(a.fch.data(), a.ln2.data(), w.fcw, w.fcb, N, C, 4 * C);
      cpu::gelu_forward(a.fch_gelu.data(), a.fch.data(), N * 4 * C);
      // fcproj, into dln_ as scratch
      cpu::matmul_forward(dln_.data(), a.fch_gelu.data(), w.fcprojw, w.fcprojb, N, 4 * C, C);
      cpu::residual_forward(a.residual3.data(), a.residual2.data(), dln_.data(), N * C);
      residual = a.residual3.data();
    }
    cpu::layernorm_forward(lnf_.data(), lnf_stats_.data(), residual, p.lnfw, p.lnfb, N, C);
    cpu::matmul_forward(probs_.data(), lnf_.data(), p.wte, nullptr, N, C, V);  // tied LM head
    if (keep_logits) logits_ = probs_;
    cpu::crossentropy_forward(probs_.data(), losses_.data(), targets, N, V);
    double sum = 0.0;
    for (float x : losses_) sum += x;
    return static_cast<float>(sum / static_cast<double>(N));
  }

  // grads += d mean loss / d params, for the last forward. Mirrors forward in reverse.
  void backward(const float* params, float* grads) {
    namespace cpu = zp::runtime::cpu;
    const Gpt2Tensors<const float> p(params, d_);
    const Gpt2Tensors<float> g(grads, d_);
    const int64_t B = d_.B, T = d_.T, C = d_.C, NH = d_.NH, V = d_.V, N = B * T;
    auto zero = [](std::vector<float>& v) { std::fill(v.begin(), v.end(), 0.0f); };
    // The mean over N tokens: d mean / d loss_i = 1/N.
    cpu::crossentropy_backward(probs_.data(), targets_, 1.0f / static_cast<float>(N), N, V);
    zero(dln_);
    cpu::matmul_backward(dln_.data(), g.wte, nullptr, probs_.data(), lnf_.data(), p.wte, N, C, V);
    const float* residual = d_.L > 0 ? layers_.back().residual3.data() : encoded_.data();
    zero(dresidual_);
    cpu::layernorm_backward(dresidual_.data(), g.lnfw, g.lnfb, dln_.data(), residual, p.lnfw,
                            lnf_stats_.data(), N, C);
    // dresidual_ holds d loss / d (this block's output); the residual adds pass it through
    // unchanged to both branches, and each branch's input gradient accumulates into it.
    for (int64_t l = d_.L - 1; l >= 0; --l) {
      const auto& w = p.blocks[l];
      const auto& gw = g.blocks[l];
      auto& a = layers_[l];
      residual = l > 0 ? layers_[l - 1].residual3.data() : encoded_.data();
      zero(dfch_);
      cpu::matmul_backward(dfch_.data(), gw.fcprojw, gw.fcprojb, dresidual_.data(),
                           a.fch_gelu.data(), w.fcprojw, N, 4 * C, C);
      cpu::gelu_backward(dfch_.data(), a.fch.data(), dfch_.data(), N * 4 * C);
      zero(dln_);
      cpu::matmul_backward(dln_.data(), gw.fcw, gw.fcb, dfch_.data(), a.ln2.data(), w.fcw, N, C,
                           4 * C);
      cpu::layernorm_backward(dresidual_.data(), gw.ln2w, gw.ln2b, dln_.data(), a.residual2.data(),
                              w.ln2w, a.ln2_stats.data(), N, C);
      zero(datty_);
      cpu::matmul_backward(datty_.data(), gw.projw, gw.projb, dresidual_.data(), a.atty.data(),
                           w.projw, N, C, C);
      zero(datt_), zero(dqkv_);
      cpu::attention_values_backward(datt_.data(), dqkv_.data(), datty_.data(), a.att.data(),
                                     a.qkv.data(), B, T, C, NH);
      cpu::attention_softmax_backward(datt_.data(), datt_.data(), a.att.data(), B, NH, T);
      cpu::attention_scores_backward(dqkv_.data(), datt_.data(), a.qkv.data(), B, T, C, NH);
      zero(dln_);
      cpu::matmul_backward(dln_.data(), gw.qkvw, gw.qkvb, dqkv_.data(), a.ln1.data(), w.qkvw, N, C,
                           3 * C);
      cpu::layernorm_backward(dresidual_.data(), gw.ln1w, gw.ln1b, dln_.data(), residual, w.ln1w,
                              a.ln1_stats.data(), N, C);
    }
    cpu::embedding_backward(g.wte, g.wpe, dresidual_.data(), tokens_, B, T, C);
  }

 private:
  struct Layer {  // saved activations of one block
    std::vector<float> ln1, ln1_stats, qkv, preatt, att, atty, residual2, ln2, ln2_stats, fch,
        fch_gelu, residual3;
  };
  Gpt2Dims d_;
  std::vector<Layer> layers_;
  std::vector<float> encoded_, lnf_, lnf_stats_, probs_, losses_, logits_;
  std::vector<float> dresidual_, dln_, datty_, dqkv_, datt_, dfch_;  // backward scratch
  const int32_t* tokens_ = nullptr;
  const int32_t* targets_ = nullptr;
};

}  // namespace zp::testing
