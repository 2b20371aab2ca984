// reference_check.hpp (tests): reading the PyTorch fixtures' raw arrays and comparing a tensor
// with its reference, for test_gpt2_reference and test_llama_reference.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace zp::test {

// n values of X from a little-endian fixture file, into v.
template <typename X>
void read_array(std::ifstream& f, std::vector<X>& v, int64_t n) {
  v.resize(static_cast<std::size_t>(n));
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(X)));
}

// The arrays every step fixture ends with (tools/fixtures/gpt2_fixture.py, llama_fixture.py):
// float32 params[n_params], int32 tokens[N], targets[N], float32 logits[N*V], loss,
// grads[n_params], and then the end of the file.
struct StepArrays {
  std::vector<float> params, logits, grads;
  std::vector<int32_t> tokens, targets;
  float loss = 0.0f;
};
inline void read_step_arrays(std::ifstream& f, const std::string& path, int64_t n_params, int64_t N,
                             int64_t V, StepArrays& x) {
  read_array(f, x.params, n_params);
  read_array(f, x.tokens, N);
  read_array(f, x.targets, N);
  read_array(f, x.logits, N * V);
  f.read(reinterpret_cast<char*>(&x.loss), sizeof(float));
  read_array(f, x.grads, n_params);
  REQUIRE_MESSAGE(f.good(), path << " is truncated");
  f.peek();
  REQUIRE_MESSAGE(f.eof(), path << " is longer than its header says");
}

// Every element within tol * (the tensor's largest |want|), the first three misses reported;
// returns the worst error / scale.
inline double check_tensor(const float* got, const float* want, int64_t n, double tol,
                           const std::string& what) {
  double scale = 0.0, worst = 0.0;
  for (int64_t i = 0; i < n; ++i) scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  REQUIRE_MESSAGE(scale > 0.0, what << ": reference is all zero");
  int n_bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    worst = std::max(worst, err / scale);
    if (!(err <= tol * scale) && ++n_bad <= 3)
      FAIL_CHECK(what << "[" << i << "]: got " << got[i] << ", want " << want[i] << " (scale "
                      << scale << ")");
  }
  CHECK_MESSAGE(n_bad == 0, what << ": " << n_bad << " of " << n << " elements off");
  return worst;
}

}  // namespace zp::test
