// A whole tiny LLaMA, a tiny Qwen2, a tiny Mistral and a tiny Qwen3 (grouped-query attention,
// rotary embeddings with the llama3 and the default table, RMSNorm, SwiGLU, an untied head;
// Qwen2's q/k/v biases; Mistral's sliding window; Qwen3's per-head q/k norms) run
// forward and backward through the CPU kernels in transformers' order
// (tests/support/llama_step.hpp) and compared with the PyTorch fixtures written by
// tools/fixtures/llama_fixture.py (float64 forward and backward of the same fp32 parameters):
// the rotary table, logits, loss and every parameter tensor's gradient. Not the engine.
// Tolerances as test_gpt2_reference's, and for the same reasons: logits and loss 1e-5 of the
// tensor's largest value, gradients 1e-4.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "llama_step.hpp"
#include "reference_check.hpp"
#include "zp/runtime/rope.hpp"

namespace {

constexpr double kLogitTol = 1e-5;
constexpr double kGradTol = 1e-4;
constexpr int32_t kMagic = 20261127;

struct Fixture : zp::test::StepArrays {
  zp::testing::LlamaDims d{};
  std::vector<float> inv_freq;
};


// Layout: see tools/fixtures/llama_fixture.py.
Fixture load(const std::string& variant) {
  const std::string path = std::string(ZP_TEST_DATA) + "/" + variant + "_tiny_fixture.bin";
  std::ifstream f(path, std::ios::binary);
  REQUIRE_MESSAGE(f.good(), "cannot open " << path);
  std::vector<int32_t> h;
  zp::test::read_array(f, h, 64);
  REQUIRE(h[0] == kMagic);
  REQUIRE(h[1] == 1);
  std::vector<double> hf;
  zp::test::read_array(f, hf, 8);
  Fixture x;
  x.d = {h[2], h[3], h[4], h[5], h[6], h[7], h[8], h[9], h[10], h[11] != 0, static_cast<float>(hf[0]),
         h[14], h[15] != 0};
  x.d.E = h[16];
  x.d.K = h[17];
  x.d.Fe = h[18];
  x.d.Fs = h[19];
  x.d.shared_gate = h[20] != 0;
  x.d.renorm = h[21] != 0;
  x.d.dense_layers = h[22];
  x.d.aux_coef = static_cast<float>(hf[2]);
  const int64_t n_params = h[12], N = x.d.B * x.d.T;
  zp::test::read_array(f, x.inv_freq, h[13]);
  zp::test::read_step_arrays(f, path, n_params, N, x.d.V, x);
  return x;
}

void check_tensor(const float* got, const float* want, int64_t n, double tol, const std::string& what) {
  const double worst = zp::test::check_tensor(got, want, n, tol, what);
  MESSAGE(what << ": worst error " << worst << " of the largest value");
}

void run(const std::string& variant, const zp::models::RopeSpec& rope) {
  const Fixture x = load(variant);
  const zp::testing::LlamaDims& d = x.d;
  // The rotary table is computed here, from the config's numbers, and must be transformers'.
  const zp::runtime::RopeTable tab = zp::runtime::rope_table(rope, d.HS, 128);
  REQUIRE(tab.inv_freq.size() == x.inv_freq.size());
  for (std::size_t i = 0; i < x.inv_freq.size(); ++i) {
    int32_t a = 0, b = 0;
    std::memcpy(&a, &tab.inv_freq[i], 4);
    std::memcpy(&b, &x.inv_freq[i], 4);
    CHECK(std::abs(a - b) <= 1);
  }
  zp::testing::LlamaStep step(d, tab.inv_freq, tab.attention_factor);
  REQUIRE(step.n_params() == static_cast<int64_t>(x.params.size()));
  const float loss = step.forward(x.params.data(), x.tokens, x.targets);
  check_tensor(step.logits().data(), x.logits.data(), static_cast<int64_t>(x.logits.size()), kLogitTol,
               variant + " logits");
  CHECK(std::abs(loss - x.loss) <= kLogitTol * x.loss);
  std::vector<float> grads(x.params.size(), 0.0f);
  step.backward(x.params.data(), grads.data());
  // Tensor by tensor, in the fixture's order.
  zp::testing::for_each_tensor(d, [&](int64_t off, int64_t n, const std::string& name) {
    check_tensor(grads.data() + off, x.grads.data() + off, n, kGradTol, variant + " d" + name);
  });
}

// transformers' default rotary table (rope_type "default") of base theta.
zp::models::RopeSpec default_rope(double theta) {
  zp::models::RopeSpec r;
  r.theta = theta;
  return r;
}

}  // namespace

TEST_CASE("a tiny LLaMA (GQA, llama3 rotary table, RMSNorm, SwiGLU, untied head) matches PyTorch") {
  zp::models::RopeSpec r;
  r.type = "llama3";
  r.theta = 500000.0;
  r.factor = 8.0;
  r.low_freq_factor = 1.0;
  r.high_freq_factor = 4.0;
  r.original_max_positions = 32;
  run("llama", r);
}

TEST_CASE("a tiny Mistral (a sliding window of 5 keys) matches PyTorch") {
  run("mistral", default_rope(1000000.0));
}

TEST_CASE("a tiny Qwen2 (q/k/v biases, default rotary table) matches PyTorch") {
  run("qwen2", default_rope(1000000.0));
}

TEST_CASE("a tiny Qwen3 (per-head q/k norms before the rotation) matches PyTorch") {
  run("qwen3", default_rope(1000000.0));
}

TEST_CASE("a tiny Mixtral (4 experts, top 2 renormalised, load-balancing loss) matches PyTorch") {
  run("mixtral", default_rope(1000000.0));
}

TEST_CASE("a tiny Qwen2-MoE (a dense layer, a gated shared expert, top 2 as routed) matches PyTorch") {
  run("qwen2_moe", default_rope(1000000.0));
}

TEST_CASE("a tiny Qwen3-MoE (q/k norms, top 2 renormalised) matches PyTorch") {
  run("qwen3_moe", default_rope(1000000.0));
}
