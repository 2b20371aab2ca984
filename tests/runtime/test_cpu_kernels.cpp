// The CPU kernels against an independent float64 reference written here (naive loops straight
// from the formulas): forwards element by element, every backward against central finite
// differences of that reference. Not a speed test and not the whole model (test_gpt2_reference).
//
// Tolerances, |got - want| <= tol * scale with scale = the largest |want| in the tensor:
// - forward, kFwdTol = 1e-5: fp32 rounds each of the <= ~30 operations behind an element with
//   unit roundoff 6e-8, so the worst case is ~2e-6 of the tensor's scale; 1e-5 leaves margin.
// - backward, kBwdTol = 3e-5: the analytic gradient is fp32 over sums of up to ~60 products
//   (~4e-6 relative worst case) and its inputs (att, probs, stats) are fp32 forward outputs
//   (another ~2e-6), while the float64 central difference with h = 1e-5 carries a truncation
//   error ~h^2 = 1e-10 and a cancellation error ~1e-16/h = 1e-11 (relative).
// Observed errors are ~1e-7 of the scale everywhere. A wrong formula (a missed term, a
// transposed index, a lost factor) is off by O(1) of the scale, far above either tolerance.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "kernel_check.hpp"
#include "zp/error.hpp"
#include "zp/runtime/cpu_kernels.hpp"
#include "zp/runtime/dtype.hpp"

namespace cpu = zp::runtime::cpu;
using zp::runtime::DType;

namespace {

using namespace zp::test::kernel;

// ---- The float64 reference forwards, naive loops from the formulas --------------------------
// Shapes come in a Dims (the small one by default); the tests below use the letters directly.

struct Dims {
  int64_t B, T, C, NH, V, OC;
};
constexpr Dims kSmall{2, 5, 8, 2, 11, 7};  // odd sizes: B*T = 10 rows, HS = 4

DVec ref_embedding(const std::vector<int32_t>& tok, const DVec& wte, const DVec* wpe,
                   const Dims& d = kSmall) {
  DVec out(d.B * d.T * d.C);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t c = 0; c < d.C; ++c)
        out[(b * d.T + t) * d.C + c] =
            wte[tok[b * d.T + t] * d.C + c] + (wpe ? (*wpe)[t * d.C + c] : 0.0);
  return out;
}

// y = (x - mean) / sqrt(var + 1e-5) * w + b over each row of C, var the biased variance.
DVec ref_layernorm(const DVec& x, const DVec& w, const DVec& bias, DVec* mean = nullptr,
                   DVec* rstd = nullptr, const Dims& d = kSmall) {
  const int64_t rows = d.B * d.T, C = d.C;
  const double inv_c = 1.0 / static_cast<double>(C);
  DVec y(rows * C);
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0.0, var = 0.0;
    for (int64_t c = 0; c < C; ++c) m += x[r * C + c] * inv_c;
    for (int64_t c = 0; c < C; ++c) var += (x[r * C + c] - m) * (x[r * C + c] - m) * inv_c;
    const double s = 1.0 / std::sqrt(var + 1e-5);
    for (int64_t c = 0; c < C; ++c) y[r * C + c] = (x[r * C + c] - m) * s * w[c] + bias[c];
    if (mean) (*mean)[r] = m;
    if (rstd) (*rstd)[r] = s;
  }
  return y;
}

// out[n][o] = sum_c x[n][c] w[o][c] + bias[o] (PyTorch nn.Linear).
DVec ref_matmul(const DVec& x, const DVec& w, const DVec* bias, const Dims& d = kSmall) {
  const int64_t rows = d.B * d.T, C = d.C, OC = d.OC;
  DVec out(rows * OC);
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double s = bias ? (*bias)[o] : 0.0;
      for (int64_t c = 0; c < C; ++c) s += x[n * C + c] * w[o * C + c];
      out[n * OC + o] = s;
    }
  return out;
}

// Index helpers for qkv (B,T,3C), which = 0 q, 1 k, 2 v, and for att (B,NH,T,T).
int64_t qkv_at(const Dims& d, int64_t b, int64_t t, int64_t which, int64_t h, int64_t i) {
  return (b * d.T + t) * 3 * d.C + which * d.C + h * (d.C / d.NH) + i;
}
int64_t att_at(const Dims& d, int64_t b, int64_t h, int64_t t, int64_t t2) {
  return ((b * d.NH + h) * d.T + t) * d.T + t2;
}

// preatt[b,h,t,t2] = q_t . k_t2 / sqrt(HS) for t2 <= t, 0 above the diagonal.
DVec ref_scores(const DVec& qkv, const Dims& d = kSmall) {
  const int64_t HS = d.C / d.NH;
  DVec out(d.B * d.NH * d.T * d.T, 0.0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.NH; ++h)
      for (int64_t t = 0; t < d.T; ++t)
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          double s = 0.0;
          for (int64_t i = 0; i < HS; ++i)
            s += qkv[qkv_at(d, b, t, 0, h, i)] * qkv[qkv_at(d, b, t2, 1, h, i)];
          out[att_at(d, b, h, t, t2)] = s / std::sqrt(static_cast<double>(HS));
        }
  return out;
}

// Causal softmax: att[t, t2] = exp(p[t,t2]) / sum_{u<=t} exp(p[t,u]) for t2 <= t, else 0.
DVec ref_softmax(const DVec& preatt, const Dims& d = kSmall) {
  const int64_t T = d.T;
  DVec out(preatt.size(), 0.0);
  for (int64_t r = 0; r < d.B * d.NH * T; ++r) {
    const int64_t t = r % T;
    double z = 0.0;
    for (int64_t u = 0; u <= t; ++u) z += std::exp(preatt[r * T + u]);
    for (int64_t u = 0; u <= t; ++u) out[r * T + u] = std::exp(preatt[r * T + u]) / z;
  }
  return out;
}

// out[b,t,h*HS+i] = sum_{t2<=t} att[b,h,t,t2] v[b,t2,h,i].
DVec ref_values(const DVec& att, const DVec& qkv, const Dims& d = kSmall) {
  const int64_t HS = d.C / d.NH;
  DVec out(d.B * d.T * d.C, 0.0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.NH; ++h)
      for (int64_t t = 0; t < d.T; ++t)
        for (int64_t i = 0; i < HS; ++i) {
          double s = 0.0;
          for (int64_t t2 = 0; t2 <= t; ++t2)
            s += att[att_at(d, b, h, t, t2)] * qkv[qkv_at(d, b, t2, 2, h, i)];
          out[(b * d.T + t) * d.C + h * HS + i] = s;
        }
  return out;
}

double ref_gelu(double x) {
  const double pi = 3.14159265358979323846;
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / pi) * (x + 0.044715 * x * x * x)));
}

// losses[n] = -log(exp(x[n][target]) / sum_v exp(x[n][v])).
DVec ref_crossentropy(const DVec& logits, const std::vector<int32_t>& targets,
                      const Dims& d = kSmall) {
  const int64_t rows = d.B * d.T, V = d.V;
  DVec losses(rows);
  for (int64_t n = 0; n < rows; ++n) {
    double z = 0.0;
    for (int64_t v = 0; v < V; ++v) z += std::exp(logits[n * V + v]);
    losses[n] = std::log(z) - logits[n * V + targets[n]];
  }
  return losses;
}

// The letters of the small shape, for the tests (after the references, which take a Dims).
constexpr int64_t B = kSmall.B, T = kSmall.T, C = kSmall.C, NH = kSmall.NH, V = kSmall.V,
                  OC = kSmall.OC;
constexpr int64_t N = B * T;

// A (B,NH,T,T) tensor with random values below and on the diagonal and `above` over it.
Vec causal_randn(float stddev, float above, std::mt19937& rng) {
  Vec v = randn(B * NH * T * T, stddev, rng);
  for (int64_t r = 0; r < B * NH * T; ++r)
    for (int64_t u = r % T + 1; u < T; ++u) v[r * T + u] = above;
  return v;
}

// A causal attention pattern: rows of random positive weights summing to 1, 0 above the diagonal.
Vec causal_probs(std::mt19937& rng) {
  std::uniform_real_distribution<float> d(0.1f, 1.0f);
  Vec v(B * NH * T * T, 0.0f);
  for (int64_t r = 0; r < B * NH * T; ++r) {
    float s = 0.0f;
    for (int64_t u = 0; u <= r % T; ++u) s += (v[r * T + u] = d(rng));
    for (int64_t u = 0; u <= r % T; ++u) v[r * T + u] /= s;
  }
  return v;
}

}  // namespace

TEST_CASE("embedding: forward, backward (repeated tokens accumulate), optional positions") {
  std::mt19937 rng(11);
  auto tok = rand_tokens(N, static_cast<int32_t>(V), rng);
  tok[7] = tok[1];  // a repeated token, in both sequences
  tok[8] = tok[1];
  const Vec wte = randn(V * C, 1.0f, rng), wpe = randn(T * C, 1.0f, rng);
  const DVec wte_d = to_d(wte), wpe_d = to_d(wpe);

  Vec out(N * C);
  cpu::embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
  check_close(out, ref_embedding(tok, wte_d, &wpe_d), kFwdTol, "embedding out");
  cpu::embedding_forward(out.data(), tok.data(), wte.data(), nullptr, B, T, C);
  check_close(out, ref_embedding(tok, wte_d, nullptr), kFwdTol, "embedding out (no wpe)");

  const Vec dout = randn(N * C, 1.0f, rng);
  const Vec dwte0 = randn(V * C, 0.1f, rng), dwpe0 = randn(T * C, 0.1f, rng);
  Vec dwte = dwte0, dwpe = dwpe0;
  cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C);
  check_delta(
      dwte, dwte0,
      fd_grad([&](const DVec& x) { return weighted_sum(ref_embedding(tok, x, &wpe_d), dout); },
              wte_d),
      kBwdTol, "dwte");
  check_delta(
      dwpe, dwpe0,
      fd_grad([&](const DVec& x) { return weighted_sum(ref_embedding(tok, wte_d, &x), dout); },
              wpe_d),
      kBwdTol, "dwpe");

  Vec dwte_only = dwte0;
  cpu::embedding_backward(dwte_only.data(), nullptr, dout.data(), tok.data(), B, T, C);
  CHECK(dwte_only == dwte);
}

TEST_CASE("layernorm: forward (out and stats) and backward against finite differences") {
  std::mt19937 rng(12);
  Vec x = randn(N * C, 1.0f, rng);
  for (int64_t c = 0; c < C; ++c) x[3 * C + c] += 5.0f;  // a row whose mean dwarfs its spread
  const Vec w = randn(C, 1.0f, rng), bias = randn(C, 1.0f, rng);
  const DVec xd = to_d(x), wd = to_d(w), bd = to_d(bias);

  Vec out(N * C), stats(2 * N);
  cpu::layernorm_forward(out.data(), stats.data(), x.data(), w.data(), bias.data(), N, C);
  DVec mean(N), rstd(N);
  check_close(out, ref_layernorm(xd, wd, bd, &mean, &rstd), kFwdTol, "layernorm out");
  Vec got_mean(N), got_rstd(N);
  for (int64_t r = 0; r < N; ++r) got_mean[r] = stats[2 * r], got_rstd[r] = stats[2 * r + 1];
  check_close(got_mean, mean, kFwdTol, "layernorm mean");
  check_close(got_rstd, rstd, kFwdTol, "layernorm rstd");

  const Vec dout = randn(N * C, 1.0f, rng);
  const Vec dx0 = randn(N * C, 0.1f, rng), dw0 = randn(C, 0.1f, rng), db0 = randn(C, 0.1f, rng);
  Vec dx = dx0, dw = dw0, db = db0;
  cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                          stats.data(), N, C);
  check_delta(
      dx, dx0,
      fd_grad([&](const DVec& v) { return weighted_sum(ref_layernorm(v, wd, bd), dout); }, xd),
      kBwdTol, "layernorm dinp");
  check_delta(
      dw, dw0,
      fd_grad([&](const DVec& v) { return weighted_sum(ref_layernorm(xd, v, bd), dout); }, wd),
      kBwdTol, "layernorm dweight");
  check_delta(
      db, db0,
      fd_grad([&](const DVec& v) { return weighted_sum(ref_layernorm(xd, wd, v), dout); }, bd),
      kBwdTol, "layernorm dbias");
}

TEST_CASE("matmul: forward with and without bias, backward against finite differences") {
  std::mt19937 rng(13);
  const Vec x = randn(N * C, 1.0f, rng), w = randn(OC * C, 1.0f, rng), bias = randn(OC, 1.0f, rng);
  const DVec xd = to_d(x), wd = to_d(w), bd = to_d(bias);

  Vec out(N * OC, 1e30f);  // garbage: forward overwrites
  cpu::matmul_forward(out.data(), x.data(), w.data(), bias.data(), N, C, OC);
  check_close(out, ref_matmul(xd, wd, &bd), kFwdTol, "matmul out");
  std::fill(out.begin(), out.end(), 1e30f);
  cpu::matmul_forward(out.data(), x.data(), w.data(), nullptr, N, C, OC);
  check_close(out, ref_matmul(xd, wd, nullptr), kFwdTol, "matmul out (no bias)");

  const Vec dout = randn(N * OC, 1.0f, rng);
  const Vec dx0 = randn(N * C, 0.1f, rng), dw0 = randn(OC * C, 0.1f, rng),
            db0 = randn(OC, 0.1f, rng);
  Vec dx = dx0, dw = dw0, db = db0;
  cpu::matmul_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), N, C, OC);
  check_delta(
      dx, dx0,
      fd_grad([&](const DVec& v) { return weighted_sum(ref_matmul(v, wd, &bd), dout); }, xd),
      kBwdTol, "matmul dinp");
  check_delta(
      dw, dw0,
      fd_grad([&](const DVec& v) { return weighted_sum(ref_matmul(xd, v, &bd), dout); }, wd),
      kBwdTol, "matmul dweight");
  check_delta(
      db, db0,
      fd_grad([&](const DVec& v) { return weighted_sum(ref_matmul(xd, wd, &v), dout); }, bd),
      kBwdTol, "matmul dbias");

  Vec dx2 = dx0, dw2 = dw0;
  cpu::matmul_backward(dx2.data(), dw2.data(), nullptr, dout.data(), x.data(), w.data(), N, C, OC);
  check_delta(
      dx2, dx0,
      fd_grad([&](const DVec& v) { return weighted_sum(ref_matmul(v, wd, nullptr), dout); }, xd),
      kBwdTol, "matmul dinp (no bias)");
  check_delta(
      dw2, dw0,
      fd_grad([&](const DVec& v) { return weighted_sum(ref_matmul(xd, v, nullptr), dout); }, wd),
      kBwdTol, "matmul dweight (no bias)");
}

TEST_CASE("attention scores: forward on the causal triangle, backward ignores masked entries") {
  std::mt19937 rng(14);
  const Vec qkv = randn(N * 3 * C, 1.0f, rng);
  const DVec qkvd = to_d(qkv);
  Vec preatt(B * NH * T * T, 0.0f);
  cpu::attention_scores(preatt.data(), qkv.data(), B, T, C, NH);
  check_close(preatt, ref_scores(qkvd), kFwdTol, "preatt");  // upper triangle: 0 in both

  // Gradient of L = sum over the triangle of dpreatt * preatt; the masked entries of the
  // incoming gradient hold garbage that must not leak into dqkv.
  const Vec dpreatt = causal_randn(1.0f, 1e6f, rng);
  Vec dpre_tri = dpreatt;
  for (auto& v : dpre_tri) v = v == 1e6f ? 0.0f : v;
  const Vec dqkv0 = randn(N * 3 * C, 0.1f, rng);
  Vec dqkv = dqkv0;
  cpu::attention_scores_backward(dqkv.data(), dpreatt.data(), qkv.data(), B, T, C, NH);
  check_delta(dqkv, dqkv0,
              fd_grad([&](const DVec& v) { return weighted_sum(ref_scores(v), dpre_tri); }, qkvd),
              kBwdTol, "scores dqkv (q, k; v untouched)");
}

TEST_CASE("attention softmax: forward, backward out of place and in place") {
  std::mt19937 rng(15);
  const Vec preatt = causal_randn(2.0f, 1e30f, rng);  // masked entries must be ignored
  Vec pre_tri = preatt;
  for (auto& v : pre_tri) v = v == 1e30f ? 0.0f : v;
  const DVec pred = to_d(pre_tri);
  Vec att(B * NH * T * T, 1e30f);
  cpu::attention_softmax(att.data(), preatt.data(), B, NH, T);
  check_close(att, ref_softmax(pred), kFwdTol, "att");  // includes the zeros above the diagonal

  // L = sum of datt * att over all entries; the reference's att is 0 (constant) above the
  // diagonal, so the finite differences there are 0 and the kernel must write 0.
  const Vec datt = randn(B * NH * T * T, 1.0f, rng);
  const DVec want =
      fd_grad([&](const DVec& v) { return weighted_sum(ref_softmax(v), datt); }, pred);
  Vec dpre(B * NH * T * T, 1e30f);  // garbage: this backward overwrites
  cpu::attention_softmax_backward(dpre.data(), datt.data(), att.data(), B, NH, T);
  check_close(dpre, want, kBwdTol, "dpreatt");
  Vec inplace = datt;
  cpu::attention_softmax_backward(inplace.data(), inplace.data(), att.data(), B, NH, T);
  CHECK(inplace == dpre);
}

TEST_CASE("attention values: forward and backward (datt and the v part of dqkv)") {
  std::mt19937 rng(16);
  const Vec att = causal_probs(rng), qkv = randn(N * 3 * C, 1.0f, rng);
  const DVec attd = to_d(att), qkvd = to_d(qkv);
  Vec out(N * C, 1e30f);
  cpu::attention_values(out.data(), att.data(), qkv.data(), B, T, C, NH);
  check_close(out, ref_values(attd, qkvd), kFwdTol, "attention out");

  const Vec dout = randn(N * C, 1.0f, rng);
  const Vec datt0 = randn(B * NH * T * T, 0.1f, rng), dqkv0 = randn(N * 3 * C, 0.1f, rng);
  Vec datt = datt0, dqkv = dqkv0;
  cpu::attention_values_backward(datt.data(), dqkv.data(), dout.data(), att.data(), qkv.data(), B,
                                 T, C, NH);
  // The finite differences above the diagonal are 0 (out ignores them): datt stays untouched there.
  check_delta(datt, datt0,
              fd_grad([&](const DVec& v) { return weighted_sum(ref_values(v, qkvd), dout); }, attd),
              kBwdTol, "values datt");
  check_delta(dqkv, dqkv0,
              fd_grad([&](const DVec& v) { return weighted_sum(ref_values(attd, v), dout); }, qkvd),
              kBwdTol, "values dqkv (v; q, k untouched)");
}

TEST_CASE("attention, the three steps chained: backward through all of them") {
  std::mt19937 rng(17);
  const Vec qkv = randn(N * 3 * C, 1.0f, rng);
  const DVec qkvd = to_d(qkv);
  Vec preatt(B * NH * T * T), att(B * NH * T * T), out(N * C);
  cpu::attention_scores(preatt.data(), qkv.data(), B, T, C, NH);
  cpu::attention_softmax(att.data(), preatt.data(), B, NH, T);
  cpu::attention_values(out.data(), att.data(), qkv.data(), B, T, C, NH);
  auto ref = [](const DVec& v) { return ref_values(ref_softmax(ref_scores(v)), v); };
  check_close(out, ref(qkvd), kFwdTol, "attention(qkv)");

  const Vec dout = randn(N * C, 1.0f, rng);
  Vec datt(B * NH * T * T, 0.0f), dqkv(N * 3 * C, 0.0f);
  cpu::attention_values_backward(datt.data(), dqkv.data(), dout.data(), att.data(), qkv.data(), B,
                                 T, C, NH);
  cpu::attention_softmax_backward(datt.data(), datt.data(), att.data(), B, NH, T);
  cpu::attention_scores_backward(dqkv.data(), datt.data(), qkv.data(), B, T, C, NH);
  check_close(dqkv, fd_grad([&](const DVec& v) { return weighted_sum(ref(v), dout); }, qkvd),
              kBwdTol, "attention dqkv");
}

TEST_CASE("gelu: forward in place, backward out of place and in place") {
  std::mt19937 rng(18);
  const int64_t n = 37;
  Vec x = randn(n, 2.0f, rng);
  x[0] = 0.0f, x[1] = -6.0f, x[2] = 6.0f;
  const DVec xd = to_d(x);
  DVec want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = ref_gelu(xd[i]);
  Vec y = x;
  cpu::gelu_forward(y.data(), y.data(), n);
  check_close(y, want, kFwdTol, "gelu");

  const Vec dout = randn(n, 1.0f, rng);
  DVec g(n);
  for (int64_t i = 0; i < n; ++i)
    g[i] = dout[i] * (ref_gelu(xd[i] + kFdStep) - ref_gelu(xd[i] - kFdStep)) / (2 * kFdStep);
  Vec dx(n, 1e30f);
  cpu::gelu_backward(dx.data(), x.data(), dout.data(), n);
  check_close(dx, g, kBwdTol, "gelu dinp");
  Vec inplace = dout;
  cpu::gelu_backward(inplace.data(), x.data(), inplace.data(), n);
  CHECK(inplace == dx);
}

TEST_CASE("residual: out = a + b") {
  std::mt19937 rng(19);
  const Vec a = randn(23, 1.0f, rng), b = randn(23, 1.0f, rng);
  DVec want(23);
  for (int i = 0; i < 23; ++i) want[i] = static_cast<double>(a[i]) + b[i];
  Vec out(23);
  cpu::residual_forward(out.data(), a.data(), b.data(), 23);
  check_close(out, want, kFwdTol, "residual");
}

TEST_CASE("crossentropy: forward and backward in place, targets checked") {
  std::mt19937 rng(20);
  Vec logits = randn(N * V, 3.0f, rng);
  logits[5] = 80.0f;  // a row where exp overflows without max subtraction
  const auto targets = rand_tokens(N, static_cast<int32_t>(V), rng);
  const DVec ld = to_d(logits);

  Vec probs = logits, losses(N);
  cpu::crossentropy_forward(probs.data(), losses.data(), targets.data(), N, V);
  check_close(losses, ref_crossentropy(ld, targets), kFwdTol, "losses");
  DVec want_probs(N * V);
  for (int64_t n = 0; n < N; ++n) {
    double z = 0.0;
    for (int64_t v = 0; v < V; ++v) z += std::exp(ld[n * V + v] - 80.0);
    for (int64_t v = 0; v < V; ++v) want_probs[n * V + v] = std::exp(ld[n * V + v] - 80.0) / z;
  }
  check_close(probs, want_probs, kFwdTol, "probs");

  // dloss: the mean over N tokens, times a loss scale of 4.
  const float dloss = 4.0f / static_cast<float>(N);
  cpu::crossentropy_backward(probs.data(), targets.data(), dloss, N, V);
  const DVec want = fd_grad(
      [&](const DVec& v) {
        double s = 0.0;
        for (double l : ref_crossentropy(v, targets)) s += l * dloss;
        return s;
      },
      ld);
  check_close(probs, want, kBwdTol, "dlogits");

  auto bad = targets;
  bad[3] = static_cast<int32_t>(V);
  Vec p2 = logits;
  CHECK_THROWS_AS(cpu::crossentropy_forward(p2.data(), losses.data(), bad.data(), N, V), zp::Error);
  CHECK_THROWS_AS(cpu::crossentropy_backward(p2.data(), bad.data(), dloss, N, V), zp::Error);
}

TEST_CASE("accumulating backwards: a second call adds the same gradient again") {
  std::mt19937 rng(21);
  // Each backward from zeroed gradients, called twice: the result is twice the first call's.
  auto twice = [](const Vec& once, const Vec& two, const char* what) {
    DVec want(once.size());
    for (std::size_t i = 0; i < once.size(); ++i) want[i] = 2.0 * once[i];
    check_close(two, want, kFwdTol, what);
  };
  const Vec x = randn(N * C, 1.0f, rng), w = randn(OC * C, 1.0f, rng),
            dout = randn(N * OC, 1.0f, rng);
  {
    Vec dx1(N * C, 0.f), dw1(OC * C, 0.f), db1(OC, 0.f);
    cpu::matmul_backward(dx1.data(), dw1.data(), db1.data(), dout.data(), x.data(), w.data(), N, C,
                         OC);
    Vec dx2 = dx1, dw2 = dw1, db2 = db1;
    cpu::matmul_backward(dx2.data(), dw2.data(), db2.data(), dout.data(), x.data(), w.data(), N, C,
                         OC);
    twice(dx1, dx2, "matmul dinp x2");
    twice(dw1, dw2, "matmul dweight x2");
    twice(db1, db2, "matmul dbias x2");
  }
  {
    const Vec lw = randn(C, 1.0f, rng), lb = randn(C, 1.0f, rng), g = randn(N * C, 1.0f, rng);
    Vec y(N * C), stats(2 * N);
    cpu::layernorm_forward(y.data(), stats.data(), x.data(), lw.data(), lb.data(), N, C);
    Vec dx1(N * C, 0.f), dw1(C, 0.f), db1(C, 0.f);
    cpu::layernorm_backward(dx1.data(), dw1.data(), db1.data(), g.data(), x.data(), lw.data(),
                            stats.data(), N, C);
    Vec dx2 = dx1, dw2 = dw1, db2 = db1;
    cpu::layernorm_backward(dx2.data(), dw2.data(), db2.data(), g.data(), x.data(), lw.data(),
                            stats.data(), N, C);
    twice(dx1, dx2, "layernorm dinp x2");
    twice(dw1, dw2, "layernorm dweight x2");
    twice(db1, db2, "layernorm dbias x2");
  }
  {
    const auto tok = rand_tokens(N, static_cast<int32_t>(V), rng);
    const Vec g = randn(N * C, 1.0f, rng);
    Vec dwte1(V * C, 0.f), dwpe1(T * C, 0.f);
    cpu::embedding_backward(dwte1.data(), dwpe1.data(), g.data(), tok.data(), B, T, C);
    Vec dwte2 = dwte1, dwpe2 = dwpe1;
    cpu::embedding_backward(dwte2.data(), dwpe2.data(), g.data(), tok.data(), B, T, C);
    twice(dwte1, dwte2, "dwte x2");
    twice(dwpe1, dwpe2, "dwpe x2");
  }
  {
    const Vec qkv = randn(N * 3 * C, 1.0f, rng), att = causal_probs(rng);
    const Vec g = randn(N * C, 1.0f, rng), dpre = causal_randn(1.0f, 0.0f, rng);
    Vec datt1(B * NH * T * T, 0.f), dqkv1(N * 3 * C, 0.f);
    cpu::attention_values_backward(datt1.data(), dqkv1.data(), g.data(), att.data(), qkv.data(), B,
                                   T, C, NH);
    cpu::attention_scores_backward(dqkv1.data(), dpre.data(), qkv.data(), B, T, C, NH);
    Vec datt2 = datt1, dqkv2 = dqkv1;
    cpu::attention_values_backward(datt2.data(), dqkv2.data(), g.data(), att.data(), qkv.data(), B,
                                   T, C, NH);
    cpu::attention_scores_backward(dqkv2.data(), dpre.data(), qkv.data(), B, T, C, NH);
    twice(datt1, datt2, "datt x2");
    twice(dqkv1, dqkv2, "dqkv x2");
  }
}

TEST_CASE("threaded paths: large sizes against the reference, and 1 thread == 2 threads") {
  // The kernels split rows, heads or channel blocks over threads only above a size threshold,
  // so the small cases above run on one thread and within one channel block. Here the same
  // kernels at a shape that splits (C = 200: three full 64-wide blocks and a partial one;
  // OC = 320: a full and a partial 256-wide block): forwards element by element against the
  // reference, backwards by directional derivatives (per-element differences would be too
  // slow), and 1 against 2 threads: outside BLAS the results must agree to the bit.
  std::mt19937 rng(22);
  const Dims d{2, 96, 200, 4, 50, 320};
  const int64_t b = d.B, t = d.T, c = d.C, nh = d.NH, oc = d.OC, n = b * t;
  const Vec x = randn(n * c, 1.0f, rng), lw = randn(c, 1.0f, rng), lb = randn(c, 1.0f, rng);
  const Vec w = randn(oc * c, 0.1f, rng), bias = randn(oc, 1.0f, rng),
            g_oc = randn(n * oc, 1.0f, rng);
  const Vec qkv = randn(n * 3 * c, 0.3f, rng), g_c = randn(n * c, 1.0f, rng);
  const auto tok = rand_tokens(n, static_cast<int32_t>(d.V), rng);
  const Vec wte = randn(d.V * c, 1.0f, rng), wpe = randn(t * c, 1.0f, rng);
  const DVec xd = to_d(x), lwd = to_d(lw), lbd = to_d(lb), wd = to_d(w), bd = to_d(bias);
  const DVec qkvd = to_d(qkv), wted = to_d(wte), wped = to_d(wpe);

  struct Outputs {
    Vec emb, dwte, dwpe, ln, stats, dln_x, dln_w, dln_b, mm, dmm_x, dmm_w, dmm_b, preatt, att, y,
        datt, dqkv, gelu, dgelu;
  };
  auto run = [&](int n_threads) {
    cpu::set_threads(n_threads);
    Outputs o;
    o.emb.resize(n * c);
    cpu::embedding_forward(o.emb.data(), tok.data(), wte.data(), wpe.data(), b, t, c);
    o.dwte.assign(d.V * c, 0.f), o.dwpe.assign(t * c, 0.f);
    cpu::embedding_backward(o.dwte.data(), o.dwpe.data(), g_c.data(), tok.data(), b, t, c);
    o.ln.resize(n * c), o.stats.resize(2 * n);
    cpu::layernorm_forward(o.ln.data(), o.stats.data(), x.data(), lw.data(), lb.data(), n, c);
    o.dln_x.assign(n * c, 0.f), o.dln_w.assign(c, 0.f), o.dln_b.assign(c, 0.f);
    cpu::layernorm_backward(o.dln_x.data(), o.dln_w.data(), o.dln_b.data(), g_c.data(), x.data(),
                            lw.data(), o.stats.data(), n, c);
    o.mm.resize(n * oc);
    cpu::matmul_forward(o.mm.data(), x.data(), w.data(), bias.data(), n, c, oc);
    o.dmm_x.assign(n * c, 0.f), o.dmm_w.assign(oc * c, 0.f), o.dmm_b.assign(oc, 0.f);
    cpu::matmul_backward(o.dmm_x.data(), o.dmm_w.data(), o.dmm_b.data(), g_oc.data(), x.data(),
                         w.data(), n, c, oc);
    o.preatt.assign(b * nh * t * t, 0.f), o.att.resize(b * nh * t * t), o.y.resize(n * c);
    cpu::attention_scores(o.preatt.data(), qkv.data(), b, t, c, nh);
    cpu::attention_softmax(o.att.data(), o.preatt.data(), b, nh, t);
    cpu::attention_values(o.y.data(), o.att.data(), qkv.data(), b, t, c, nh);
    o.datt.assign(b * nh * t * t, 0.f), o.dqkv.assign(n * 3 * c, 0.f);
    cpu::attention_values_backward(o.datt.data(), o.dqkv.data(), g_c.data(), o.att.data(),
                                   qkv.data(), b, t, c, nh);
    cpu::attention_softmax_backward(o.datt.data(), o.datt.data(), o.att.data(), b, nh, t);
    cpu::attention_scores_backward(o.dqkv.data(), o.datt.data(), qkv.data(), b, t, c, nh);
    o.gelu.resize(n * oc), o.dgelu.resize(n * oc);
    cpu::gelu_forward(o.gelu.data(), g_oc.data(), n * oc);
    cpu::gelu_backward(o.dgelu.data(), g_oc.data(), o.gelu.data(), n * oc);
    return o;
  };
  const Outputs one = run(1), two = run(2);
  cpu::set_threads(1);

  check_close(two.emb, ref_embedding(tok, wted, &wped, d), kFwdTol, "embedding (large)");
  check_close(two.ln, ref_layernorm(xd, lwd, lbd, nullptr, nullptr, d), kFwdTol,
              "layernorm (large)");
  check_close(two.mm, ref_matmul(xd, wd, &bd, d), kFwdTol, "matmul (large)");
  const DVec ref_pre = ref_scores(qkvd, d), ref_att = ref_softmax(ref_pre, d);
  check_close(two.preatt, ref_pre, kFwdTol, "preatt (large)");
  check_close(two.att, ref_att, kFwdTol, "att (large)");
  check_close(two.y, ref_values(ref_att, qkvd, d), kFwdTol, "attention (large)");
  DVec ref_gelu_out(n * oc);
  for (int64_t i = 0; i < n * oc; ++i) ref_gelu_out[i] = ref_gelu(g_oc[i]);
  check_close(two.gelu, ref_gelu_out, kFwdTol, "gelu (large)");

  auto embed = [&](const DVec& te, const DVec& pe) {
    return weighted_sum(ref_embedding(tok, te, &pe, d), g_c);
  };
  check_directional([&](const DVec& v) { return embed(v, wped); }, wted, two.dwte, rng,
                    "dwte (large)");
  check_directional([&](const DVec& v) { return embed(wted, v); }, wped, two.dwpe, rng,
                    "dwpe (large)");
  auto ln = [&](const DVec& xv, const DVec& wv, const DVec& bv) {
    return weighted_sum(ref_layernorm(xv, wv, bv, nullptr, nullptr, d), g_c);
  };
  check_directional([&](const DVec& v) { return ln(v, lwd, lbd); }, xd, two.dln_x, rng,
                    "layernorm dinp (large)");
  check_directional([&](const DVec& v) { return ln(xd, v, lbd); }, lwd, two.dln_w, rng,
                    "layernorm dweight (large)");
  check_directional([&](const DVec& v) { return ln(xd, lwd, v); }, lbd, two.dln_b, rng,
                    "layernorm dbias (large)");
  auto mm = [&](const DVec& xv, const DVec& wv, const DVec& bv) {
    return weighted_sum(ref_matmul(xv, wv, &bv, d), g_oc);
  };
  check_directional([&](const DVec& v) { return mm(v, wd, bd); }, xd, two.dmm_x, rng,
                    "matmul dinp (large)");
  check_directional([&](const DVec& v) { return mm(xd, v, bd); }, wd, two.dmm_w, rng,
                    "matmul dweight (large)");
  check_directional([&](const DVec& v) { return mm(xd, wd, v); }, bd, two.dmm_b, rng,
                    "matmul dbias (large)");
  check_directional(
      [&](const DVec& v) {
        return weighted_sum(ref_values(ref_softmax(ref_scores(v, d), d), v, d), g_c);
      },
      qkvd, two.dqkv, rng, "attention dqkv (large)");

  CHECK(one.emb == two.emb);
  CHECK(one.dwte == two.dwte);
  CHECK(one.dwpe == two.dwpe);
  CHECK(one.ln == two.ln);
  CHECK(one.stats == two.stats);
  CHECK(one.dln_x == two.dln_x);
  CHECK(one.dln_w == two.dln_w);
  CHECK(one.dln_b == two.dln_b);
  CHECK(one.dmm_b == two.dmm_b);
  CHECK(one.preatt == two.preatt);
  CHECK(one.att == two.att);
  CHECK(one.y == two.y);
  CHECK(one.datt == two.datt);
  CHECK(one.dqkv == two.dqkv);
  CHECK(one.gelu == two.gelu);
  CHECK(one.dgelu == two.dgelu);
  CHECK_THROWS_AS(cpu::set_threads(0), zp::Error);
}

TEST_CASE("attention kernels refuse C not divisible by NH") {
  Vec qkv(3 * 9), pre(9);
  CHECK_THROWS_AS(cpu::attention_scores(pre.data(), qkv.data(), 1, 1, 9, 2), zp::Error);
}

// ---- 16-bit storage conversions against dtype.hpp's scalar functions -----------------------

TEST_CASE("to_f32 / from_f32 / accumulate_to for fp32, fp16, bf16 at awkward sizes") {
  using namespace zp::runtime;
  std::mt19937 rng(23);
  std::uniform_int_distribution<uint32_t> bits32;
  std::normal_distribution<float> normal(0.0f, 100.0f);
  auto same = [](float a, float b) {
    return (std::isnan(a) && std::isnan(b)) || f32_bits(a) == f32_bits(b);
  };
  for (int64_t n : {1, 7, 1000, 100003}) {
    CAPTURE(n);
    // Sources: random bit patterns (every class: NaN, inf, subnormal) and ordinary values.
    Vec f(n);
    for (int64_t i = 0; i < n; ++i) f[i] = i % 2 ? bits_f32(bits32(rng)) : normal(rng);
    std::vector<uint16_t> h(n);
    for (auto& v : h) v = static_cast<uint16_t>(bits32(rng));
    const Vec add = randn(n, 10.0f, rng);

    for (DType t : {DType::fp16, DType::bf16}) {
      CAPTURE(to_string(t));
      auto to32 = t == DType::fp16 ? fp16_to_fp32 : bf16_to_fp32;
      auto to16 = t == DType::fp16 ? fp32_to_fp16 : fp32_to_bf16;
      Vec out(n);
      cpu::to_f32(out.data(), h.data(), t, n);
      int n_bad = 0;
      for (int64_t i = 0; i < n; ++i) n_bad += !same(out[i], to32(h[i]));
      CHECK(n_bad == 0);
      std::vector<uint16_t> back(n);
      cpu::from_f32(back.data(), f.data(), t, n);
      n_bad = 0;
      for (int64_t i = 0; i < n; ++i) n_bad += back[i] != to16(f[i]);
      CHECK(n_bad == 0);
      std::vector<uint16_t> acc = h;
      cpu::accumulate_to(acc.data(), add.data(), t, n);
      n_bad = 0;
      for (int64_t i = 0; i < n; ++i) n_bad += acc[i] != to16(to32(h[i]) + add[i]);
      CHECK(n_bad == 0);
    }
    Vec out(n), back(n), acc = f;
    cpu::to_f32(out.data(), f.data(), DType::fp32, n);
    cpu::from_f32(back.data(), f.data(), DType::fp32, n);
    cpu::accumulate_to(acc.data(), add.data(), DType::fp32, n);
    int n_bad = 0;
    for (int64_t i = 0; i < n; ++i)
      n_bad += !same(out[i], f[i]) + !same(back[i], f[i]) + !same(acc[i], f[i] + add[i]);
    CHECK(n_bad == 0);
  }
}

// ---- LLaMA-family blocks: RMSNorm, rotary embeddings, SwiGLU ----------------------------------

namespace {

// y = x / sqrt(mean(x^2) + eps) * (w + offset) over each row of C.
DVec ref_rmsnorm(const DVec& x, const DVec& w, double offset, double eps, DVec* rstd = nullptr) {
  const int64_t rows = static_cast<int64_t>(x.size()) / C;
  DVec y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double sq = 0.0;
    for (int64_t c = 0; c < C; ++c) sq += x[r * C + c] * x[r * C + c];
    const double s = 1.0 / std::sqrt(sq / static_cast<double>(C) + eps);
    for (int64_t c = 0; c < C; ++c) y[r * C + c] = x[r * C + c] * s * (w[c] + offset);
    if (rstd) (*rstd)[r] = s;
  }
  return y;
}

// Rotary embedding in float64 from its definition: in rows of `row` holding n_heads heads of
// HS, pair (i, i + rot/2) of each head is the complex number x_i + j x_{i+rot/2} multiplied by
// mscale e^{j t theta^(-2i/rot)}.
DVec ref_rope(const DVec& x, double theta, double mscale, int64_t rows, int64_t t_len,
              int64_t row, int64_t n_heads, int64_t HS, int64_t rot) {
  DVec y = x;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < n_heads; ++h)
      for (int64_t i = 0; i < rot / 2; ++i) {
        const double a = static_cast<double>(r % t_len) *
                         std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rot));
        const int64_t p = r * row + h * HS + i, q = p + rot / 2;
        y[p] = mscale * (x[p] * std::cos(a) - x[q] * std::sin(a));
        y[q] = mscale * (x[q] * std::cos(a) + x[p] * std::sin(a));
      }
  return y;
}

DVec ref_swiglu(const DVec& g, const DVec& u) {
  DVec y(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) y[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
  return y;
}

}  // namespace

TEST_CASE("rmsnorm: forward (out and rstd) and backward against finite differences") {
  std::mt19937 rng(31);
  Vec x = randn(N * C, 1.0f, rng);
  for (int64_t c = 0; c < C; ++c) x[2 * C + c] *= 40.0f;  // a row far from unit scale
  const Vec w = randn(C, 1.0f, rng);
  const DVec xd = to_d(x), wd = to_d(w);
  for (float offset : {0.0f, 1.0f}) {  // LLaMA's w, Gemma's (1 + w)
    CAPTURE(offset);
    const float eps = 1e-6f;
    Vec out(N * C, 1e30f), stats(N, 1e30f);
    cpu::rmsnorm_forward(out.data(), stats.data(), x.data(), w.data(), offset, eps, N, C);
    DVec rstd(N);
    check_close(out, ref_rmsnorm(xd, wd, offset, eps, &rstd), kFwdTol, "rmsnorm out");
    check_close(stats, rstd, kFwdTol, "rmsnorm rstd");

    const Vec dout = randn(N * C, 1.0f, rng);
    const Vec dx0 = randn(N * C, 0.1f, rng), dw0 = randn(C, 0.1f, rng);
    Vec dx = dx0, dw = dw0;
    cpu::rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), offset,
                          stats.data(), N, C);
    check_delta(dx, dx0,
                fd_grad([&](const DVec& v) { return weighted_sum(ref_rmsnorm(v, wd, offset, eps), dout); }, xd),
                kBwdTol, "rmsnorm dinp");
    check_delta(dw, dw0,
                fd_grad([&](const DVec& v) { return weighted_sum(ref_rmsnorm(xd, v, offset, eps), dout); }, wd),
                kBwdTol, "rmsnorm dweight");
  }
}

TEST_CASE("head rmsnorm (Qwen3's q/k norms): forward and in-place backward against finite differences") {
  // 3 query and 1 key heads of 4 in fused rows of (3 + 2 * 1) * 4 = 20 (q, k, then v): the
  // query heads take w[0, 4), the key head w[4, 8); the v head is neither read nor written.
  constexpr int64_t NH = 3, KVH = 1, HS = 4, R = (NH + 2 * KVH) * HS, QK = (NH + KVH) * HS, rows = 5;
  std::mt19937 rng(36);
  const Vec x = randn(rows * R, 1.0f, rng), w = randn(2 * HS, 1.0f, rng);
  const DVec xd = to_d(x), wd = to_d(w);
  const double eps = 1e-6;
  auto ref = [&](const DVec& xv, const DVec& wv) {  // float64, (rows, QK)
    DVec y(rows * QK);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < NH + KVH; ++j) {
        double sq = 0;
        for (int64_t i = 0; i < HS; ++i) sq += xv[r * R + j * HS + i] * xv[r * R + j * HS + i];
        const double s = 1.0 / std::sqrt(sq / HS + eps);
        for (int64_t i = 0; i < HS; ++i)
          y[r * QK + j * HS + i] = xv[r * R + j * HS + i] * s * wv[(j < NH ? 0 : HS) + i];
      }
    return y;
  };
  Vec out(rows * QK, 1e30f), stats(rows * (NH + KVH), 1e30f);
  // The fused rows of 3 + 1 + 1 heads of 4 (AttnShape's layout for these heads).
  const cpu::AttnShape shape{1, rows, NH, KVH, HS};
  const cpu::Qkv in = cpu::Qkv::fused(x.data(), shape);
  cpu::head_rmsnorm_forward(out.data(), stats.data(), in, w.data(), static_cast<float>(eps), rows, NH, KVH,
                            HS);
  check_close(out, ref(xd, wd), kFwdTol, "head rmsnorm out");
  // Backward, in place in rows of R: the q and k heads hold the output's gradient on entry.
  const Vec dout = randn(rows * QK, 1.0f, rng);
  Vec g = randn(rows * R, 1.0f, rng);
  const Vec g0 = g;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < QK; ++i) g[r * R + i] = dout[r * QK + i];
  const Vec dw0 = randn(2 * HS, 0.1f, rng);
  Vec dw = dw0;
  cpu::head_rmsnorm_backward(g.data(), R, dw.data(), in, w.data(), stats.data(), rows, NH, KVH, HS);
  const DVec want_dx = fd_grad([&](const DVec& v) { return weighted_sum(ref(v, wd), dout); }, xd);
  Vec dx_qk, v_part, v_part0;
  DVec want_qk;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < R; ++i) {
      if (i < QK) {
        dx_qk.push_back(g[r * R + i]);
        want_qk.push_back(want_dx[r * R + i]);
      } else {
        v_part.push_back(g[r * R + i]);
        v_part0.push_back(g0[r * R + i]);
        CHECK(want_dx[r * R + i] == 0.0);  // the reference does not read v
      }
    }
  check_close(dx_qk, want_qk, kBwdTol, "head rmsnorm dinp");
  CHECK(v_part == v_part0);
  check_delta(dw, dw0, fd_grad([&](const DVec& v) { return weighted_sum(ref(xd, v), dout); }, wd), kBwdTol,
              "head rmsnorm dweight");
  cpu::Qkv narrow = in;  // rows too short for the query heads
  narrow.q_row = 8;
  CHECK_THROWS_AS(cpu::head_rmsnorm_forward(out.data(), stats.data(), narrow, w.data(), 1e-6f, rows, NH, KVH, HS),
                  zp::Error);
  // The same heads read from q and k tensors of their own give the same result.
  Vec q(rows * NH * HS), k(rows * KVH * HS);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(x.data() + r * R, NH * HS, q.data() + r * NH * HS);
    std::copy_n(x.data() + r * R + NH * HS, KVH * HS, k.data() + r * KVH * HS);
  }
  Vec out2(rows * QK), stats2(rows * (NH + KVH));
  cpu::head_rmsnorm_forward(out2.data(), stats2.data(), cpu::Qkv::parts(q.data(), k.data(), k.data(), shape),
                            w.data(), static_cast<float>(eps), rows, NH, KVH, HS);
  CHECK(out2 == out);
  CHECK(stats2 == stats);
}

TEST_CASE("rope: forward against the complex rotation, backward against finite differences") {
  std::mt19937 rng(32);
  // A fused q|k|v row of GQA: 4 query heads and 2 key heads of HS = 8 rotate, 2 value heads do
  // not; full (rot = HS) and partial (rot = 4, Phi's partial_rotary_factor) rotation.
  const int64_t HS = 8, n_rot_heads = 4 + 2, row = (4 + 2 + 2) * HS, rows = B * T;
  for (int64_t rot : {HS, int64_t{4}})
    for (float mscale : {1.0f, 1.25f}) {
      CAPTURE(rot);
      CAPTURE(mscale);
      const double theta = 10000.0;
      const std::vector<float> inv_freq = cpu::rope_default_inv_freq(theta, rot);
      REQUIRE(inv_freq.size() == static_cast<std::size_t>(rot / 2));
      for (int64_t i = 0; i < rot / 2; ++i) {  // fp32 powers, as transformers computes them
        const double want = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rot));
        CHECK(std::fabs(inv_freq[static_cast<std::size_t>(i)] - want) <= 2e-7 * want);
      }
      const Vec x = randn(rows * row, 1.0f, rng);
      const DVec xd = to_d(x);
      Vec y = x;
      cpu::rope_forward(y.data(), inv_freq.data(), mscale, B, T, row, n_rot_heads, HS, rot);
      const DVec want = ref_rope(xd, theta, mscale, rows, T, row, n_rot_heads, HS, rot);
      check_close(y, want, kFwdTol, "rope out");
      for (int64_t r = 0; r < rows; ++r)  // the value heads and the unrotated dims untouched
        for (int64_t c = 0; c < row; ++c) {
          const int64_t in_head = c % HS;
          if (c >= n_rot_heads * HS || in_head >= rot) CHECK(y[r * row + c] == x[r * row + c]);
        }

      const Vec dout = randn(rows * row, 1.0f, rng);
      Vec dx = dout;  // in place
      cpu::rope_backward(dx.data(), inv_freq.data(), mscale, B, T, row, n_rot_heads, HS, rot);
      // The rotation is linear: its gradient is the exact derivative of sum(dout * rope(x)).
      check_close(dx,
                  fd_grad([&](const DVec& v) {
                    return weighted_sum(ref_rope(v, theta, mscale, rows, T, row, n_rot_heads, HS, rot), dout);
                  }, xd),
                  kBwdTol, "rope dx");
    }
  // Bad geometry is an error, not a silent partial rotation.
  Vec x(64);
  const std::vector<float> f = cpu::rope_default_inv_freq(10000.0, 8);
  CHECK_THROWS_AS(cpu::rope_forward(x.data(), f.data(), 1.0f, 1, 1, 64, 1, 8, 7), zp::Error);
  CHECK_THROWS_AS(cpu::rope_forward(x.data(), f.data(), 1.0f, 1, 1, 64, 1, 8, 10), zp::Error);
  CHECK_THROWS_AS(cpu::rope_forward(x.data(), f.data(), 1.0f, 1, 1, 64, 9, 8, 8), zp::Error);
}

TEST_CASE("swiglu: forward and backward against finite differences") {
  std::mt19937 rng(33);
  const int64_t n = N * OC;
  Vec g = randn(n, 2.0f, rng);
  g[0] = 30.0f;   // saturated: silu(g) -> g
  g[1] = -30.0f;  // silu(g) -> 0
  const Vec u = randn(n, 1.0f, rng);
  const DVec gd = to_d(g), ud = to_d(u);
  Vec out(n, 1e30f);
  cpu::swiglu_forward(out.data(), g.data(), u.data(), n);
  check_close(out, ref_swiglu(gd, ud), kFwdTol, "swiglu out");
  const Vec dout = randn(n, 1.0f, rng);
  Vec dgu(2 * n, 1e30f);  // overwritten: rows of (d gate | d up), N rows of OC each
  cpu::swiglu_backward(dgu.data(), dout.data(), g.data(), u.data(), N, OC);
  Vec dg(n), du(n);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t i = 0; i < OC; ++i) {
      dg[r * OC + i] = dgu[r * 2 * OC + i];
      du[r * OC + i] = dgu[r * 2 * OC + OC + i];
    }
  check_close(dg, fd_grad([&](const DVec& v) { return weighted_sum(ref_swiglu(v, ud), dout); }, gd),
              kBwdTol, "swiglu dgate");
  check_close(du, fd_grad([&](const DVec& v) { return weighted_sum(ref_swiglu(gd, v), dout); }, ud),
              kBwdTol, "swiglu dup");
}

namespace {

// Grouped-query attention in float64: fused rows (NH + 2 KVH) * HS wide, query head h reading
// key/value head h / (NH / KVH).
struct Gqa {
  int64_t B, T, NH, KVH, HS, window = 0;
  bool sees(int64_t t, int64_t t2) const { return t2 <= t && (window == 0 || t - t2 < window); }
  int64_t row() const { return (NH + 2 * KVH) * HS; }
  int64_t q(int64_t b, int64_t t, int64_t h, int64_t i) const { return (b * T + t) * row() + h * HS + i; }
  int64_t k(int64_t b, int64_t t, int64_t h, int64_t i) const {
    return (b * T + t) * row() + NH * HS + h / (NH / KVH) * HS + i;
  }
  int64_t v(int64_t b, int64_t t, int64_t h, int64_t i) const { return k(b, t, h, i) + KVH * HS; }
  int64_t a(int64_t b, int64_t h, int64_t t, int64_t t2) const { return ((b * NH + h) * T + t) * T + t2; }
};

DVec ref_gqa_scores(const DVec& qkv, const Gqa& g) {
  DVec out(g.B * g.NH * g.T * g.T, 0.0);
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t h = 0; h < g.NH; ++h)
      for (int64_t t = 0; t < g.T; ++t)
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          if (!g.sees(t, t2)) continue;
          double s = 0.0;
          for (int64_t i = 0; i < g.HS; ++i) s += qkv[g.q(b, t, h, i)] * qkv[g.k(b, t2, h, i)];
          out[g.a(b, h, t, t2)] = s / std::sqrt(static_cast<double>(g.HS));
        }
  return out;
}

DVec ref_gqa_values(const DVec& att, const DVec& qkv, const Gqa& g) {
  DVec out(g.B * g.T * g.NH * g.HS, 0.0);
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t h = 0; h < g.NH; ++h)
      for (int64_t t = 0; t < g.T; ++t)
        for (int64_t i = 0; i < g.HS; ++i) {
          double s = 0.0;
          for (int64_t t2 = 0; t2 <= t; ++t2)
            if (g.sees(t, t2)) s += att[g.a(b, h, t, t2)] * qkv[g.v(b, t2, h, i)];
          out[(b * g.T + t) * g.NH * g.HS + h * g.HS + i] = s;
        }
  return out;
}

}  // namespace

TEST_CASE("grouped-query attention: scores and values against float64, backwards by finite differences") {
  std::mt19937 rng(34);
  // 6 query heads over 2 key/value heads (groups of 3), HS = 3 (NH * HS != any C of GPT-2's
  // layout), and the multi-query extreme (KVH = 1); B = 2, T = 5.
  // With a sliding window of 3 (Mistral's): each query sees itself and the 2 keys before it.
  for (int64_t window : {int64_t{0}, int64_t{3}})
  for (int64_t kvh : {int64_t{2}, int64_t{1}}) {
    CAPTURE(kvh);
    CAPTURE(window);
    const Gqa g{2, 5, 6, kvh, 3, window};
    const cpu::AttnShape s{g.B, g.T, g.NH, g.KVH, g.HS, window};
    REQUIRE(s.row() == g.row());
    const int64_t rows = g.B * g.T, A = g.B * g.NH * g.T * g.T;
    const Vec qkv = randn(rows * g.row(), 1.0f, rng);
    const DVec qd = to_d(qkv);
    Vec pre(A, 0.0f);
    cpu::attention_scores(pre.data(), qkv.data(), s);
    check_close(pre, ref_gqa_scores(qd, g), kFwdTol, "gqa scores");
    Vec att(A, 0.0f);
    cpu::attention_softmax(att.data(), pre.data(), s);
    for (int64_t b = 0; b < g.B; ++b)  // a probability distribution over exactly the keys seen
      for (int64_t h = 0; h < g.NH; ++h)
        for (int64_t t = 0; t < g.T; ++t) {
          double sum = 0;
          for (int64_t t2 = 0; t2 < g.T; ++t2) {
            const float p = att[static_cast<std::size_t>(g.a(b, h, t, t2))];
            if (!g.sees(t, t2)) CHECK(p == 0.0f);
            sum += p;
          }
          CHECK(std::fabs(sum - 1.0) < 1e-6);
        }
    const DVec ad = to_d(att);
    Vec out(rows * g.NH * g.HS, 1e30f);
    cpu::attention_values(out.data(), att.data(), qkv.data(), s);
    check_close(out, ref_gqa_values(ad, qd, g), kFwdTol, "gqa values");

    // Backward of the values step: datt and dv (accumulated), against the linear map's FD.
    const Vec dout = randn(rows * g.NH * g.HS, 1.0f, rng);
    const Vec datt0 = randn(A, 0.1f, rng), dqkv0 = randn(rows * g.row(), 0.1f, rng);
    Vec datt = datt0, dqkv = dqkv0;
    cpu::attention_values_backward(datt.data(), dqkv.data(), dout.data(), att.data(), qkv.data(), s);
    DVec want_datt = fd_grad([&](const DVec& v) { return weighted_sum(ref_gqa_values(v, qd, g), dout); }, ad);
    for (int64_t b = 0; b < g.B; ++b)  // entries of keys not seen are not touched
      for (int64_t h = 0; h < g.NH; ++h)
        for (int64_t t = 0; t < g.T; ++t)
          for (int64_t t2 = 0; t2 < g.T; ++t2)
            if (!g.sees(t, t2)) want_datt[g.a(b, h, t, t2)] = 0.0;
    check_delta(datt, datt0, want_datt, kBwdTol, "gqa datt");
    check_delta(dqkv, dqkv0,
                fd_grad([&](const DVec& v) { return weighted_sum(ref_gqa_values(ad, v, g), dout); }, qd),
                kBwdTol, "gqa dv");

    // Backward of the scores: dq and the group's shared dk.
    const Vec dpre = randn(A, 1.0f, rng);
    Vec dqkv2 = dqkv0;
    cpu::attention_scores_backward(dqkv2.data(), dpre.data(), qkv.data(), s);
    DVec dpre_causal = to_d(dpre);
    for (int64_t b = 0; b < g.B; ++b)
      for (int64_t h = 0; h < g.NH; ++h)
        for (int64_t t = 0; t < g.T; ++t)
          for (int64_t t2 = 0; t2 < g.T; ++t2)
            if (!g.sees(t, t2)) dpre_causal[g.a(b, h, t, t2)] = 0.0;
    Vec dpre_c(dpre_causal.begin(), dpre_causal.end());
    check_delta(dqkv2, dqkv0,
                fd_grad([&](const DVec& v) { return weighted_sum(ref_gqa_scores(v, g), dpre_c); }, qd),
                kBwdTol, "gqa dq dk");
  }
  const cpu::AttnShape bad{1, 2, 4, 3, 2};  // 3 does not divide 4
  Vec x(64), y(64);
  CHECK_THROWS_AS(cpu::attention_scores(x.data(), y.data(), bad), zp::Error);
}
