// kernel_check.hpp: what the CPU kernel tests (test_cpu_kernels.cpp, test_flash.cpp) check
// with: random inputs, float64 copies, element-wise closeness within a fraction of the
// tensor's largest value, accumulated gradients against a reference, central finite
// differences. The tolerances and why they hold are stated in test_cpu_kernels.cpp.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

namespace zp::test::kernel {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

constexpr double kFwdTol = 1e-5;
constexpr double kBwdTol = 3e-5;
constexpr double kFdStep = 1e-5;

inline Vec randn(std::size_t n, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, stddev);
  Vec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

inline DVec to_d(const Vec& v) {
  return DVec(v.begin(), v.end());
}

inline std::vector<int32_t> rand_tokens(std::size_t n, int32_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

inline double max_abs(const DVec& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// Every element within tol * (the tensor's largest |want|); reports the first few misses.
inline void check_close(const float* got, const DVec& want, double tol, const char* what) {
  const double scale = max_abs(want);
  int n_bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= tol * scale)) {
      if (++n_bad <= 5)
        FAIL_CHECK(what << "[" << i << "]: got " << got[i] << ", want " << want[i] << " (scale "
                        << scale << ")");
    }
  }
  CHECK_MESSAGE(n_bad == 0, what << ": " << n_bad << " of " << want.size() << " elements off");
  CHECK_MESSAGE(scale > 0.0, what << ": reference is all zero, the check would be vacuous");
}
inline void check_close(const Vec& got, const DVec& want, double tol, const char* what) {
  REQUIRE(got.size() == want.size());
  check_close(got.data(), want, tol, what);
}

// Gradient accumulated by a kernel: (after - before) against the reference gradient.
inline void check_delta(const Vec& after, const Vec& before, const DVec& want, double tol,
                 const char* what) {
  REQUIRE(after.size() == want.size());
  Vec delta(after.size());
  // The subtraction is exact-ish in double; rounding `before + grad` to fp32 costs 6e-8 * |before|.
  DVec d(after.size());
  for (std::size_t i = 0; i < after.size(); ++i)
    d[i] = static_cast<double>(after[i]) - static_cast<double>(before[i]);
  const double scale = max_abs(want);
  int n_bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (!(std::abs(d[i] - want[i]) <= tol * scale)) {
      if (++n_bad <= 5)
        FAIL_CHECK(what << "[" << i << "]: got " << d[i] << ", want " << want[i] << " (scale "
                        << scale << ")");
    }
  }
  CHECK_MESSAGE(n_bad == 0, what << ": " << n_bad << " of " << want.size() << " elements off");
  CHECK_MESSAGE(scale > 0.0, what << ": reference is all zero, the check would be vacuous");
}

// Central finite differences of a scalar function of x, in float64.
inline DVec fd_grad(const std::function<double(const DVec&)>& f, DVec x) {
  DVec g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + kFdStep;
    const double fp = f(x);
    x[i] = x0 - kFdStep;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2.0 * kFdStep);
  }
  return g;
}

// At sizes too large for per-element differences: for a random direction u,
// (f(x + h u) - f(x - h u)) / 2h must equal sum_i grad_i u_i, within tol * sum_i |grad_i u_i|.
inline void check_directional(const std::function<double(const DVec&)>& f, const DVec& x, const Vec& grad,
                       std::mt19937& rng, const char* what) {
  REQUIRE(grad.size() == x.size());
  std::normal_distribution<double> normal;
  DVec u(x.size()), xp(x), xm(x);
  double analytic = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    u[i] = normal(rng);
    xp[i] += kFdStep * u[i];
    xm[i] -= kFdStep * u[i];
    analytic += grad[i] * u[i];
    scale += std::abs(grad[i] * u[i]);
  }
  const double fd = (f(xp) - f(xm)) / (2.0 * kFdStep);
  CHECK_MESSAGE(std::abs(fd - analytic) <= kBwdTol * scale,
                what << ": directional derivative " << analytic << ", finite differences " << fd
                     << " (scale " << scale << ")");
  CHECK_MESSAGE(scale > 0.0, what << ": gradient is all zero, the check would be vacuous");
}

// The scalar whose gradient a backward computes: L = sum_i dout_i * y_i.
inline double weighted_sum(const DVec& y, const Vec& dout) {
  double s = 0.0;
  for (std::size_t i = 0; i < y.size(); ++i) s += y[i] * static_cast<double>(dout[i]);
  return s;
}

}  // namespace zp::test::kernel
