// rope.cpp: see zp/runtime/rope.hpp. Every value is computed as transformers computes it in
// PyTorch: fp32 tensors, Python floats (doubles) for the scalars, then the scalar cast to
// fp32 where it meets a tensor; test_rope.cpp checks the tables against PyTorch's.
#include "zp/runtime/rope.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include <fmt/format.h>

#include "zp/error.hpp"
#include "zp/runtime/cpu_kernels.hpp"

namespace zp::runtime {

namespace {

// base^(2i/rot) in fp32, i < rot/2: the int64 arange made float, divided by rot.
std::vector<float> positional_powers(double base, int64_t rot) {
  std::vector<float> p(static_cast<std::size_t>(rot / 2));
  for (int64_t i = 0; i < rot / 2; ++i)
    p[static_cast<std::size_t>(i)] =
        std::pow(static_cast<float>(base), static_cast<float>(2 * i) / static_cast<float>(rot));
  return p;
}

}  // namespace

RopeTable rope_table(const models::RopeSpec& r, int64_t rot, int64_t max_positions) {
  if (rot < 2 || rot % 2 != 0)
    throw Error(fmt::format("rope: {} rotated dims per head (must be even and at least 2)", rot),
                "check head_dim and partial_rotary_factor in the config");
  RopeTable tab;
  const auto n = static_cast<std::size_t>(rot / 2);
  const double dim = static_cast<double>(rot);
  if (r.type == "default" || r.type == "linear") {
    tab.inv_freq = cpu::rope_default_inv_freq(r.theta, rot);
    if (r.type == "linear")
      for (float& f : tab.inv_freq) f /= static_cast<float>(r.factor);
    return tab;
  }
  if (r.type == "dynamic") {
    // base * ((factor * seq / max) - (factor - 1))^(dim / (dim - 2)) at seq = max_positions.
    const double seq = static_cast<double>(max_positions), maxp = seq;
    const double base = r.theta * std::pow((r.factor * seq / maxp) - (r.factor - 1.0), dim / (dim - 2.0));
    tab.inv_freq = cpu::rope_default_inv_freq(base, rot);
    return tab;
  }
  if (r.type == "llama3") {
    if (r.original_max_positions <= 0)
      throw Error("rope_scaling llama3 needs original_max_position_embeddings",
                  "the Llama 3.1 configs carry it (8192)");
    tab.inv_freq = cpu::rope_default_inv_freq(r.theta, rot);
    const double old_ctx = static_cast<double>(r.original_max_positions);
    const auto low_wl = static_cast<float>(old_ctx / r.low_freq_factor);
    const auto high_wl = static_cast<float>(old_ctx / r.high_freq_factor);
    const auto two_pi = static_cast<float>(2.0 * std::numbers::pi);
    const auto factor = static_cast<float>(r.factor);
    const auto band = static_cast<float>(r.high_freq_factor - r.low_freq_factor);
    for (float& f : tab.inv_freq) {
      const float wavelen = two_pi / f;
      const float scaled = wavelen > low_wl ? f / factor : f;
      const float smooth = (static_cast<float>(old_ctx) / wavelen - static_cast<float>(r.low_freq_factor)) / band;
      const float smoothed = (1.0f - smooth) * scaled / factor + smooth * scaled;
      const bool medium = !(wavelen < high_wl) && !(wavelen > low_wl);
      f = medium ? smoothed : scaled;
    }
    return tab;
  }
  if (r.type == "yarn") {
    const double af = r.attention_factor > 0 ? r.attention_factor : 0.1 * std::log(r.factor) + 1.0;
    tab.attention_factor = static_cast<float>(af);
    const double maxp = static_cast<double>(max_positions);
    auto corr_dim = [&](double rotations) {
      return (dim * std::log(maxp / (rotations * 2.0 * std::numbers::pi))) / (2.0 * std::log(r.theta));
    };
    const double low = std::max(std::floor(corr_dim(r.beta_fast)), 0.0);
    double high = std::min(std::ceil(corr_dim(r.beta_slow)), dim - 1.0);
    if (low == high) high += 0.001;
    const std::vector<float> pos = positional_powers(r.theta, rot);
    const auto factor = static_cast<float>(r.factor);
    tab.inv_freq.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const float ramp = std::clamp((static_cast<float>(i) - static_cast<float>(low)) /
                                        static_cast<float>(high - low),
                                    0.0f, 1.0f);
      const float ef = 1.0f - ramp;
      const float extra = 1.0f / pos[i];
      const float inter = 1.0f / (factor * pos[i]);
      tab.inv_freq[i] = inter * (1.0f - ef) + extra * ef;
    }
    return tab;
  }
  throw Error(fmt::format("rope_scaling type '{}' is planned but not executed by zero-run", r.type),
              "zero-run computes default, linear, dynamic, llama3 and yarn rotary frequencies");
}

}  // namespace zp::runtime
