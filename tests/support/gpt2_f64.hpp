// gpt2_f64.hpp (tests): a deliberately naive float64 GPT-2 forward pass and mean loss, written
// from the GPT-2 definition (Radford et al. 2019; layernorm eps 1e-5, tanh-GELU, causal
// attention, tied head), independent of the runtime's kernels. Finite differences of this
// function are the reference for the runtime's gradients. Optionally with dropout where
// Hugging Face's GPT2Model applies it (after the embedding sum, on the attention probabilities,
// after each block's two output projections), each element multiplied by what a caller's
// function says (0, or 1 / (1 - p) where kept). Slow on purpose: clarity only.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace zp::test {

struct Gpt2Shape {
  int64_t V = 256, P = 64, C = 64, NH = 4, L = 2;
};

// Weights in zeroplan's flat order: wte (V,C), wpe (P,C), then per block norm1 [w,b],
// attn.qkv [W (3C,C), b], attn.proj [W (C,C), b], norm2 [w,b], mlp.fc [W (4C,C), b],
// mlp.proj [W (C,4C), b]; then norm_f [w,b].
// dropout(site, i): the factor for element i (row-major) of a dropout site, named as the
// runtime's mask tensors are: "embed.drop.mask" (B,T,C), "h.<l>.attn.drop.mask" (B,NH,T,T),
// "h.<l>.attn.proj.drop.mask" and "h.<l>.mlp.drop.mask" (B,T,C). Empty: no dropout.
using DropoutFactor = std::function<double(const std::string& site, int64_t i)>;

inline double gpt2_mean_loss(const std::vector<double>& w, const Gpt2Shape& s,
                             const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
                             int64_t B, int64_t T, const DropoutFactor& dropout = {}) {
  auto drop = [&](std::vector<double>& x, const std::string& site) {
    if (!dropout) return;
    for (std::size_t i = 0; i < x.size(); ++i) x[i] *= dropout(site, static_cast<int64_t>(i));
  };
  const int64_t C = s.C, F = 4 * C, HS = C / s.NH;
  std::size_t at = 0;
  auto take = [&](int64_t n) {
    const double* p = w.data() + at;
    at += static_cast<std::size_t>(n);
    return p;
  };
  const double* wte = take(s.V * C);
  const double* wpe = take(s.P * C);
  using Mat = std::vector<double>;
  auto layernorm = [&](const Mat& x, const double* g, const double* b) {
    Mat y(x.size());
    for (int64_t r = 0; r < B * T; ++r) {
      double mean = 0, var = 0;
      for (int64_t c = 0; c < C; ++c) mean += x[static_cast<std::size_t>(r * C + c)];
      mean /= static_cast<double>(C);
      for (int64_t c = 0; c < C; ++c) {
        const double d = x[static_cast<std::size_t>(r * C + c)] - mean;
        var += d * d;
      }
      var /= static_cast<double>(C);
      const double rstd = 1.0 / std::sqrt(var + 1e-5);
      for (int64_t c = 0; c < C; ++c)
        y[static_cast<std::size_t>(r * C + c)] = (x[static_cast<std::size_t>(r * C + c)] - mean) * rstd * g[c] + b[c];
    }
    return y;
  };
  // y (rows, out) = x (rows, in) W^T + b, W (out, in).
  auto linear = [&](const Mat& x, int64_t in, int64_t out, const double* W, const double* b) {
    const int64_t rows = static_cast<int64_t>(x.size()) / in;
    Mat y(static_cast<std::size_t>(rows * out));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double acc = b != nullptr ? b[o] : 0.0;
        for (int64_t i = 0; i < in; ++i) acc += x[static_cast<std::size_t>(r * in + i)] * W[o * in + i];
        y[static_cast<std::size_t>(r * out + o)] = acc;
      }
    return y;
  };

  Mat x(static_cast<std::size_t>(B * T * C));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c)
        x[static_cast<std::size_t>((b * T + t) * C + c)] =
            wte[tokens[static_cast<std::size_t>(b * T + t)] * C + c] + wpe[t * C + c];
  drop(x, "embed.drop.mask");

  for (int64_t l = 0; l < s.L; ++l) {
    const std::string site = "h." + std::to_string(l);
    const double* ln1w = take(C);
    const double* ln1b = take(C);
    const double* qkvw = take(3 * C * C);
    const double* qkvb = take(3 * C);
    const double* projw = take(C * C);
    const double* projb = take(C);
    const double* ln2w = take(C);
    const double* ln2b = take(C);
    const double* fcw = take(F * C);
    const double* fcb = take(F);
    const double* fc2w = take(C * F);
    const double* fc2b = take(C);

    const Mat qkv = linear(layernorm(x, ln1w, ln1b), C, 3 * C, qkvw, qkvb);
    Mat att(static_cast<std::size_t>(B * T * C), 0.0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < s.NH; ++h)
        for (int64_t t = 0; t < T; ++t) {
          auto q = [&](int64_t tt, int64_t part, int64_t i) {
            return qkv[static_cast<std::size_t>((b * T + tt) * 3 * C + part * C + h * HS + i)];
          };
          std::vector<double> sc(static_cast<std::size_t>(t + 1));
          double mx = -1e300;
          for (int64_t u = 0; u <= t; ++u) {
            double d = 0;
            for (int64_t i = 0; i < HS; ++i) d += q(t, 0, i) * q(u, 1, i);
            sc[static_cast<std::size_t>(u)] = d / std::sqrt(static_cast<double>(HS));
            mx = std::max(mx, sc[static_cast<std::size_t>(u)]);
          }
          double z = 0;
          for (double& v : sc) z += (v = std::exp(v - mx));
          for (int64_t u = 0; u <= t; ++u) {  // probabilities, then their dropout
            double& prob = sc[static_cast<std::size_t>(u)];
            prob /= z;
            if (dropout) prob *= dropout(site + ".attn.drop.mask", ((b * s.NH + h) * T + t) * T + u);
          }
          for (int64_t i = 0; i < HS; ++i) {
            double acc = 0;
            for (int64_t u = 0; u <= t; ++u) acc += sc[static_cast<std::size_t>(u)] * q(u, 2, i);
            att[static_cast<std::size_t>((b * T + t) * C + h * HS + i)] = acc;
          }
        }
    Mat proj = linear(att, C, C, projw, projb);
    drop(proj, site + ".attn.proj.drop.mask");
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += proj[i];
    Mat hid = linear(layernorm(x, ln2w, ln2b), C, F, fcw, fcb);
    for (double& v : hid)
      v = 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
    Mat mlp = linear(hid, F, C, fc2w, fc2b);
    drop(mlp, site + ".mlp.drop.mask");
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += mlp[i];
  }
  const double* lnfw = take(C);
  const double* lnfb = take(C);
  const Mat logits = linear(layernorm(x, lnfw, lnfb), C, s.V, wte, nullptr);
  double loss = 0;
  for (int64_t r = 0; r < B * T; ++r) {
    double mx = -1e300;
    for (int64_t v = 0; v < s.V; ++v) mx = std::max(mx, logits[static_cast<std::size_t>(r * s.V + v)]);
    double z = 0;
    for (int64_t v = 0; v < s.V; ++v) z += std::exp(logits[static_cast<std::size_t>(r * s.V + v)] - mx);
    loss += std::log(z) + mx - logits[static_cast<std::size_t>(r * s.V + targets[static_cast<std::size_t>(r)])];
  }
  return loss / static_cast<double>(B * T);
}

}  // namespace zp::test
