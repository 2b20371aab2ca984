// A whole tiny GPT-2 (gpt2-tiny's shape, B=2 T=16) run forward and backward through the CPU
// kernels in llm.c's order (tests/support/gpt2_step.hpp) and compared with the PyTorch fixture
// written by tools/fixtures/gpt2_fixture.py (float64 forward and backward of the same fp32
// parameters): logits, loss and every parameter gradient, element by element. Not a training
// test and not the engine.
//
// Tolerances, |got - want| <= tol * scale, scale = the largest |want| in the tensor:
// - logits and loss, 1e-5: the fp32 forward is ~40 dependent kernels deep (2 blocks), each
//   adding a few ulps (6e-8) of relative error; ~1e-6 is expected, 1e-5 leaves margin.
// - gradients, 1e-4: the backward chains another ~40 kernels on top of the forward's values,
//   through softmaxes and LayerNorms that amplify relative errors where their outputs cancel.
// A wrong kernel or a wrong call order is off by O(1) of the scale. (llm.c's own reference
// test allows 1e-2 absolute on gradients; these bounds are two orders tighter.)
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gpt2_step.hpp"
#include "reference_check.hpp"

namespace {

constexpr double kLogitTol = 1e-5;
constexpr double kGradTol = 1e-4;
constexpr int32_t kMagic = 20261122;

struct Fixture : zp::test::StepArrays {
  zp::testing::Gpt2Dims d{};
};


// Layout: see tools/fixtures/gpt2_fixture.py.
Fixture load_fixture() {
  const std::string path = std::string(ZP_TEST_DATA) + "/gpt2_tiny_fixture.bin";
  std::ifstream f(path, std::ios::binary);
  REQUIRE_MESSAGE(f.good(), "cannot open " << path);
  std::vector<int32_t> h;
  zp::test::read_array(f, h, 256);
  REQUIRE(h[0] == kMagic);
  REQUIRE(h[1] == 1);
  Fixture x;
  x.d = {h[2], h[3], h[4], h[5], h[6], h[7], h[8]};
  const int64_t n_params = h[9], N = x.d.B * x.d.T;
  zp::test::read_step_arrays(f, path, n_params, N, x.d.V, x);
  return x;
}


}  // namespace

TEST_CASE("gpt2-tiny forward and backward through the CPU kernels match PyTorch") {
  const Fixture fx = load_fixture();
  const auto& d = fx.d;
  // gpt2-tiny (models/configs/gpt2-tiny.json) at B=2, T=16.
  REQUIRE(d.C == 64);
  REQUIRE(d.NH == 4);
  REQUIRE(d.L == 2);
  REQUIRE(d.V == 256);
  zp::runtime::cpu::set_threads(1);
  zp::testing::Gpt2Step step(d);
  REQUIRE(step.n_params() == static_cast<int64_t>(fx.params.size()));

  const float loss = step.forward(fx.params.data(), fx.tokens.data(), fx.targets.data(), true);
  double worst =
      zp::test::check_tensor(step.logits().data(), fx.logits.data(), d.B * d.T * d.V, kLogitTol, "logits");
  CHECK(std::abs(loss - fx.loss) <= kLogitTol * std::abs(fx.loss));
  MESSAGE("loss " << loss << " (PyTorch " << fx.loss << "), logits worst error/scale " << worst);

  std::vector<float> grads(fx.params.size(), 0.0f);
  step.backward(fx.params.data(), grads.data());

  // Walk the parameter tensors in the fixture's order, with their names.
  const zp::testing::Gpt2Tensors<const float> want(fx.grads.data(), d), got(grads.data(), d);
  const int64_t C = d.C;
  auto cmp = [&](const float* g, const float* w, int64_t n, const std::string& name) {
    worst = std::max(worst, zp::test::check_tensor(g, w, n, kGradTol, fmt::format("d{}", name)));
  };
  worst = 0.0;
  cmp(got.wte, want.wte, d.V * C, "wte");
  cmp(got.wpe, want.wpe, d.P * C, "wpe");  // rows t >= T have zero gradient in both
  for (int64_t l = 0; l < d.L; ++l) {
    const auto &g = got.blocks[l], &w = want.blocks[l];
    const std::string p = fmt::format("h{}.", l);
    cmp(g.ln1w, w.ln1w, C, p + "ln1.w");
    cmp(g.ln1b, w.ln1b, C, p + "ln1.b");
    cmp(g.qkvw, w.qkvw, 3 * C * C, p + "attn.qkv.w");
    cmp(g.qkvb, w.qkvb, 3 * C, p + "attn.qkv.b");
    cmp(g.projw, w.projw, C * C, p + "attn.proj.w");
    cmp(g.projb, w.projb, C, p + "attn.proj.b");
    cmp(g.ln2w, w.ln2w, C, p + "ln2.w");
    cmp(g.ln2b, w.ln2b, C, p + "ln2.b");
    cmp(g.fcw, w.fcw, 4 * C * C, p + "mlp.fc.w");
    cmp(g.fcb, w.fcb, 4 * C, p + "mlp.fc.b");
    cmp(g.fcprojw, w.fcprojw, C * 4 * C, p + "mlp.proj.w");
    cmp(g.fcprojb, w.fcprojb, C, p + "mlp.proj.b");
  }
  cmp(got.lnfw, want.lnfw, C, "lnf.w");
  cmp(got.lnfb, want.lnfb, C, "lnf.b");
  MESSAGE("gradients worst error/scale " << worst);
}
