// llama_step.hpp: the forward and backward of a whole LLaMA-family decoder (LLaMA, Qwen2 with
// q/k/v biases, Qwen3 with per-head q/k norms; Mixtral-style Mixture-of-Experts layers with
// Qwen2-MoE's gated shared expert and the load-balancing loss) as a plain sequence of CPU kernel calls in transformers' modeling_llama
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
#include <string>
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
  // Mixture of experts: E routed experts of Fe (0: every layer dense), top K, renormalised
  // top-k weights or not; a shared expert of Fs (0: none), scaled by sigmoid(x W_g) if gated;
  // layer l dense where bit l of dense_layers is set; the load-balancing loss's coefficient.
  int64_t E = 0, K = 0, Fe = 0, Fs = 0;
  bool shared_gate = false, renorm = false;
  int64_t dense_layers = 0;
  float aux_coef = 0.0f;
  bool is_moe(int64_t l) const { return E > 0 && ((dense_layers >> l) & 1) == 0; }
  int64_t n_moe() const {
    int64_t n = 0;
    for (int64_t l = 0; l < L; ++l) n += is_moe(l) ? 1 : 0;
    return n;
  }
  int64_t R() const { return (NH + 2 * KVH) * HS; }  // fused q|k|v row
  int64_t A() const { return NH * HS; }              // attention output row
  int64_t QK() const { return (NH + KVH) * HS; }     // q|k row (their own tensor with q/k norms)
};

// The parameters in one flat buffer, in the fixture's order.
struct LlamaTensors {
  struct Layer {
    int64_t attn_norm, wqkv, bqkv = -1, qk_norm = -1, wo, mlp_norm, w_gate_up = -1, w_down = -1;
    // A MoE layer's: experts' blocks are expert after expert ((2Fe, C) gate|up, (C, Fe) down).
    int64_t router = -1, e_gate_up = -1, e_down = -1, s_gate_up = -1, s_down = -1, s_gate = -1;
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
      if (!d.is_moe(l)) {
        y.w_gate_up = take(2 * d.F * d.C);
        y.w_down = take(d.C * d.F);
      } else {
        y.router = take(d.E * d.C);
        y.e_gate_up = take(d.E * 2 * d.Fe * d.C);
        y.e_down = take(d.E * d.C * d.Fe);
        if (d.Fs > 0) {
          y.s_gate_up = take(2 * d.Fs * d.C);
          y.s_down = take(d.C * d.Fs);
        }
        if (d.shared_gate) y.s_gate = take(d.C);
      }
      layers.push_back(y);
    }
    final_norm = take(d.C);
    lm_head = take(d.V * d.C);
  }
};

// Calls f(offset, elements, name) for every parameter tensor in the buffer's order, routed
// experts one by one (names "embed", "0.wqkv", "1.expert3.down", ...).
template <class F>
void for_each_tensor(const LlamaDims& d, F&& f) {
  const LlamaTensors t(d);
  f(t.embed, d.V * d.C, std::string("embed"));
  for (int64_t l = 0; l < d.L; ++l) {
    const auto& y = t.layers[static_cast<std::size_t>(l)];
    const std::string p = std::to_string(l) + ".";
    f(y.attn_norm, d.C, p + "attn_norm");
    f(y.wqkv, d.R() * d.C, p + "wqkv");
    if (d.qkv_bias) f(y.bqkv, d.R(), p + "bqkv");
    if (d.qk_norm) f(y.qk_norm, 2 * d.HS, p + "q_norm|k_norm");
    f(y.wo, d.C * d.A(), p + "wo");
    f(y.mlp_norm, d.C, p + "mlp_norm");
    if (!d.is_moe(l)) {
      f(y.w_gate_up, 2 * d.F * d.C, p + "w_gate_up");
      f(y.w_down, d.C * d.F, p + "w_down");
      continue;
    }
    f(y.router, d.E * d.C, p + "router");
    for (int64_t e = 0; e < d.E; ++e) {
      const std::string ex = p + "expert" + std::to_string(e) + ".";
      f(y.e_gate_up + e * 2 * d.Fe * d.C, 2 * d.Fe * d.C, ex + "gate_up");
      f(y.e_down + e * d.C * d.Fe, d.C * d.Fe, ex + "down");
    }
    if (d.Fs > 0) {
      f(y.s_gate_up, 2 * d.Fs * d.C, p + "shared_gate_up");
      f(y.s_down, d.C * d.Fs, p + "shared_down");
    }
    if (d.shared_gate) f(y.s_gate, d.C, p + "shared_gate");
  }
  f(t.final_norm, d.C, std::string("final_norm"));
  f(t.lm_head, d.V * d.C, std::string("lm_head"));
}

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
      const int64_t rows = d.is_moe(l) ? N * d.K : N, width = d.is_moe(l) ? d.Fe : d.F;
      a.gate.resize(rows * width); a.up.resize(rows * width); a.act.resize(rows * width);
      if (d.is_moe(l)) {
        a.logits.resize(N * d.E); a.probs.resize(N * d.E); a.idx.resize(N * d.K); a.w.resize(N * d.K);
        a.xe.resize(rows * d.C); a.ye.resize(rows * d.C); a.off.resize(d.E + 1);
        if (d.Fs > 0) {
          a.s_gate.resize(N * d.Fs); a.s_up.resize(N * d.Fs); a.s_act.resize(N * d.Fs);
          a.s_out.resize(N * d.C);
        }
        if (d.shared_gate) a.g.resize(N);
      }
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
        cpu::head_rmsnorm_forward(a.qk.data(), a.sqk.data(), cpu::Qkv::fused(a.qkv.data(), shape),
                                  p + w.qk_norm, d.eps, N, d.NH, d.KVH, d.HS);
        qk = a.qk.data();
      }
      cpu::rope_forward(qk, inv_freq_.data(), mscale_, d.B, d.T, d.qk_norm ? d.QK() : d.R(), d.NH + d.KVH,
                        d.HS, 2 * static_cast<int64_t>(inv_freq_.size()));
      cpu::attention_scores(a.pre.data(), qkv_in(a), shape);
      cpu::attention_softmax(a.att.data(), a.pre.data(), shape);
      cpu::attention_values(a.o.data(), a.att.data(), a.qkv.data(), shape);
      std::vector<float> proj(N * d.C);
      cpu::matmul_forward(proj.data(), a.o.data(), p + w.wo, nullptr, N, d.A(), d.C);
      cpu::residual_forward(a.h.data(), x_[l].data(), proj.data(), N * d.C);
      cpu::rmsnorm_forward(a.ln2.data(), a.s2.data(), a.h.data(), p + w.mlp_norm, 0.0f, d.eps, N, d.C);
      if (d.is_moe(l))
        moe_forward(p, w, a, proj.data());
      else
        swiglu_mlp(a.ln2.data(), p + w.w_gate_up, p + w.w_down, N, d.F, a.gate.data(), a.up.data(),
                   a.act.data(), proj.data());
      cpu::residual_forward(x_[l + 1].data(), a.h.data(), proj.data(), N * d.C);
    }
    cpu::rmsnorm_forward(lnf_.data(), sf_.data(), x_[d.L].data(), p + t_.final_norm, 0.0f, d.eps, N, d.C);
    cpu::matmul_forward(logits_.data(), lnf_.data(), p + t_.lm_head, nullptr, N, d.C, d.V);
    probs_ = logits_;
    cpu::crossentropy_forward(probs_.data(), losses_.data(), targets.data(), N, d.V);
    double s = 0;
    for (float x : losses_) s += x;
    // The load-balancing loss (transformers' load_balancing_loss_func, every MoE layer's router
    // at once): E sum_e f_e P_e over Ntot = N x (MoE layers) rows, f_e = c_e / Ntot with c_e
    // the top-k choices of expert e (its per-slot fractions summed), P_e its mean probability.
    aux_ = 0.0;
    if (d.E > 0 && d.aux_coef > 0) {
      const double ntot = static_cast<double>(N * d.n_moe());
      counts_.assign(static_cast<std::size_t>(d.E), 0.0);
      std::vector<double> psum(static_cast<std::size_t>(d.E), 0.0);
      for (int64_t l = 0; l < d.L; ++l) {
        if (!d.is_moe(l)) continue;
        const Acts& a = acts_[static_cast<std::size_t>(l)];
        for (int32_t e : a.idx) counts_[static_cast<std::size_t>(e)] += 1.0;
        for (int64_t i = 0; i < N * d.E; ++i) psum[static_cast<std::size_t>(i % d.E)] += a.probs[i];
      }
      for (int64_t e = 0; e < d.E; ++e) aux_ += counts_[e] / ntot * (psum[e] / ntot);
      aux_ *= static_cast<double>(d.E);
    }
    return static_cast<float>(s / static_cast<double>(N) + d.aux_coef * aux_);
  }
  double aux_loss() const { return aux_; }  // without the coefficient

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
      // The MLP: dx is the gradient of x_{l+1} = h + mlp(ln2).
      std::vector<float> dln2(N * d.C, 0.0f);
      if (d.is_moe(l))
        moe_backward(p, g, w, a, dx.data(), dln2.data());
      else
        swiglu_mlp_backward(dx.data(), a.ln2.data(), p + w.w_gate_up, p + w.w_down, g + w.w_gate_up,
                            g + w.w_down, N, d.F, a.gate.data(), a.up.data(), a.act.data(), dln2.data());
      std::vector<float> dh = dx;  // the residual
      cpu::rmsnorm_backward(dh.data(), g + w.mlp_norm, dln2.data(), a.h.data(), p + w.mlp_norm, 0.0f,
                            a.s2.data(), N, d.C);
      // The attention: dh is the gradient of h = x_l + wo(o).
      std::vector<float> d_o(N * d.A(), 0.0f), datt(a.att.size(), 0.0f), dqkv(N * d.R(), 0.0f);
      cpu::matmul_backward(d_o.data(), g + w.wo, nullptr, dh.data(), a.o.data(), p + w.wo, N, d.A(), d.C);
      cpu::attention_values_backward(datt.data(), dqkv.data(), d_o.data(), a.att.data(), a.qkv.data(), shape);
      cpu::attention_softmax_backward(datt.data(), datt.data(), a.att.data(), shape);
      cpu::attention_scores_backward(dqkv.data(), datt.data(), qkv_in(a), shape);
      cpu::rope_backward(dqkv.data(), inv_freq_.data(), mscale_, d.B, d.T, d.R(), d.NH + d.KVH, d.HS, rot);
      if (d.qk_norm)
        cpu::head_rmsnorm_backward(dqkv.data(), d.R(), g + w.qk_norm, cpu::Qkv::fused(a.qkv.data(), shape),
                                   p + w.qk_norm, a.sqk.data(), N, d.NH, d.KVH, d.HS);
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
    // MoE: router logits, probabilities, top-k and weights, expert offsets, dispatched rows and
    // the experts' outputs; the shared expert's hidden tensors and output, its gate's logit.
    std::vector<float> logits, probs, w, xe, ye, s_gate, s_up, s_act, s_out, g;
    std::vector<int32_t> idx;
    std::vector<int64_t> off;
  };

  // down(silu(x W_gate) * (x W_up)) over `rows` rows, the fused gate|up weight (2 width, C).
  void swiglu_mlp(const float* x, const float* w_gate_up, const float* w_down, int64_t rows,
                  int64_t width, float* gate, float* up, float* act, float* out) const {
    namespace cpu = zp::runtime::cpu;
    if (rows == 0) return;
    cpu::matmul_forward(gate, x, w_gate_up, nullptr, rows, d_.C, width);
    cpu::matmul_forward(up, x, w_gate_up + width * d_.C, nullptr, rows, d_.C, width);
    cpu::swiglu_forward(act, gate, up, rows * width);
    cpu::matmul_forward(out, act, w_down, nullptr, rows, width, d_.C);
  }
  // Its backward: dx += the input's gradient, the weights' gradients accumulated.
  void swiglu_mlp_backward(const float* dout, const float* x, const float* w_gate_up, const float* w_down,
                           float* g_gate_up, float* g_down, int64_t rows, int64_t width, const float* gate,
                           const float* up, const float* act, float* dx) const {
    namespace cpu = zp::runtime::cpu;
    if (rows == 0) return;
    std::vector<float> dact(rows * width, 0.0f), dgu(rows * 2 * width);
    cpu::matmul_backward(dact.data(), g_down, nullptr, dout, act, w_down, rows, width, d_.C);
    cpu::swiglu_backward(dgu.data(), dact.data(), gate, up, rows, width);
    // The fused gate|up weight (2F, C) takes back rows of (d gate | d up) in one GEMM.
    cpu::matmul_backward(dx, g_gate_up, nullptr, dgu.data(), x, w_gate_up, rows, d_.C, 2 * width);
  }

  void moe_forward(const float* p, const LlamaTensors::Layer& w, Acts& a, float* out) const {
    namespace cpu = zp::runtime::cpu;
    const LlamaDims& d = d_;
    const int64_t N = d.B * d.T;
    cpu::matmul_forward(a.logits.data(), a.ln2.data(), p + w.router, nullptr, N, d.C, d.E);
    cpu::moe_route_forward(a.probs.data(), a.idx.data(), a.w.data(), a.logits.data(), N, d.E, d.K, d.renorm);
    cpu::moe_expert_counts(a.idx.data(), N, d.K, d.E, a.off.data());
    cpu::moe_dispatch(a.xe.data(), a.ln2.data(), a.idx.data(), N, d.K, d.E, d.C);
    for (int64_t e = 0; e < d.E; ++e) {  // each expert on its block of rows
      const int64_t r0 = a.off[e], rows = a.off[e + 1] - r0;
      swiglu_mlp(a.xe.data() + r0 * d.C, p + w.e_gate_up + e * 2 * d.Fe * d.C, p + w.e_down + e * d.C * d.Fe,
                 rows, d.Fe, a.gate.data() + r0 * d.Fe, a.up.data() + r0 * d.Fe, a.act.data() + r0 * d.Fe,
                 a.ye.data() + r0 * d.C);
    }
    cpu::moe_combine(out, a.ye.data(), a.w.data(), a.idx.data(), N, d.K, d.E, d.C);
    if (d.Fs > 0) {
      std::vector<float> s(N * d.C);
      swiglu_mlp(a.ln2.data(), p + w.s_gate_up, p + w.s_down, N, d.Fs, a.s_gate.data(), a.s_up.data(),
                 a.s_act.data(), a.s_out.data());
      const float* add = a.s_out.data();
      if (d.shared_gate) {
        cpu::matmul_forward(a.g.data(), a.ln2.data(), p + w.s_gate, nullptr, N, d.C, 1);
        cpu::gate_mul_forward(s.data(), a.s_out.data(), a.g.data(), N, d.C);
        add = s.data();
      }
      for (int64_t i = 0; i < N * d.C; ++i) out[i] += add[i];
    }
  }

  void moe_backward(const float* p, float* g, const LlamaTensors::Layer& w, const Acts& a, const float* dout,
                    float* dln2) const {
    namespace cpu = zp::runtime::cpu;
    const LlamaDims& d = d_;
    const int64_t N = d.B * d.T, R = N * d.K;
    if (d.Fs > 0) {
      const float* ds = dout;
      std::vector<float> dsv(N * d.C), dg(N);
      if (d.shared_gate) {
        cpu::gate_mul_backward(dsv.data(), dg.data(), dout, a.s_out.data(), a.g.data(), N, d.C);
        cpu::matmul_backward(dln2, g + w.s_gate, nullptr, dg.data(), a.ln2.data(), p + w.s_gate, N, d.C, 1);
        ds = dsv.data();
      }
      swiglu_mlp_backward(ds, a.ln2.data(), p + w.s_gate_up, p + w.s_down, g + w.s_gate_up, g + w.s_down, N,
                          d.Fs, a.s_gate.data(), a.s_up.data(), a.s_act.data(), dln2);
    }
    std::vector<float> dye(R * d.C), dw(N * d.K), dxe(R * d.C, 0.0f), dlogits(N * d.E);
    cpu::moe_combine_backward(dye.data(), dw.data(), dout, a.ye.data(), a.w.data(), a.idx.data(), N, d.K,
                              d.E, d.C);
    for (int64_t e = 0; e < d.E; ++e) {
      const int64_t r0 = a.off[e], rows = a.off[e + 1] - r0;
      swiglu_mlp_backward(dye.data() + r0 * d.C, a.xe.data() + r0 * d.C, p + w.e_gate_up + e * 2 * d.Fe * d.C,
                          p + w.e_down + e * d.C * d.Fe, g + w.e_gate_up + e * 2 * d.Fe * d.C,
                          g + w.e_down + e * d.C * d.Fe, rows, d.Fe, a.gate.data() + r0 * d.Fe,
                          a.up.data() + r0 * d.Fe, a.act.data() + r0 * d.Fe, dxe.data() + r0 * d.C);
    }
    cpu::moe_dispatch_backward(dln2, dxe.data(), a.idx.data(), N, d.K, d.E, d.C);
    // The load-balancing loss's gradient on each probability: coef E c_e / Ntot^2.
    std::vector<float> dprob(static_cast<std::size_t>(d.E), 0.0f);
    if (d.aux_coef > 0) {
      const double ntot = static_cast<double>(N * d.n_moe());
      for (int64_t e = 0; e < d.E; ++e)
        dprob[e] = static_cast<float>(d.aux_coef * static_cast<double>(d.E) * counts_[e] / (ntot * ntot));
    }
    cpu::moe_route_backward(dlogits.data(), dw.data(), a.probs.data(), a.idx.data(),
                            d.aux_coef > 0 ? dprob.data() : nullptr, N, d.E, d.K, d.renorm);
    cpu::matmul_backward(dln2, g + w.router, nullptr, dlogits.data(), a.ln2.data(), p + w.router, N, d.C, d.E);
  }
  double aux_ = 0.0;
  std::vector<double> counts_;  // top-k choices per expert over every MoE layer
  zp::runtime::cpu::AttnShape attn_shape() const {
    return {d_.B, d_.T, d_.NH, d_.KVH, d_.HS, d_.window};
  }
  // Where the attention reads q, k and v: the fused rows, or q and k normed apart.
  zp::runtime::cpu::Qkv qkv_in(const Acts& a) const {
    using zp::runtime::cpu::Qkv;
    return d_.qk_norm ? Qkv::split_qk(a.qk.data(), a.qkv.data(), attn_shape())
                      : Qkv::fused(a.qkv.data(), attn_shape());
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
