// The CPU Adam against independent references: PyTorch's AdamW/Adam (a fixture written by
// tools/fixtures/gen_torch_adam.py), the paper's formula in double, long-double sums; and
// every vector ISA this CPU has against the scalar reference, bit for bit.
// Not a speed test (tools/bench/bench_cpu_adam.cpp measures speed).
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "bf16_avx2.hpp"    // runtime/src: the vector kernels' bf16 roundings, checked exhaustively
#include "bf16_avx512.hpp"
#include "zp/error.hpp"
#include "zp/runtime/cpu_adam.hpp"
#include "zp/runtime/dtype.hpp"

using namespace zp::runtime;

namespace {

// ---- small pieces -------------------------------------------------------------------------

std::vector<CpuIsa> supported_isas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::scalar, CpuIsa::avx2, CpuIsa::avx512, CpuIsa::avx512bf16})
    if (cpu_supports(isa)) out.push_back(isa);
  return out;
}

// Elements per vector block (width x unroll, see cpu_adam_avx2.cpp / _avx512.cpp: 32 on both,
// whole 64-byte lines of every array).
std::size_t block_elems(CpuIsa isa) {
  return isa == CpuIsa::scalar ? 1 : 32;
}

// Distance in units in the last place between two finite 16-bit floats (fp16 or bf16).
int64_t ulp_distance16(uint16_t a, uint16_t b) {
  auto key = [](uint16_t h) { return (h & 0x8000) ? -int64_t(h & 0x7fff) : int64_t(h); };
  return std::llabs(key(a) - key(b));
}
float ulp_of(float x) {
  const float ax = std::fabs(x);
  return std::nextafter(ax, INFINITY) - ax;
}

// A buffer of n elements of a storage type, filled from fp32 values (exact conversions).
struct Buffer {
  DType dtype = DType::fp32;
  std::vector<uint8_t> bytes;
  Buffer() = default;
  Buffer(DType t, const std::vector<float>& values) : dtype(t), bytes(values.size() * dtype_bytes(t)) {
    for (std::size_t i = 0; i < values.size(); ++i) store_from_f32(bytes.data(), i, t, values[i]);
  }
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  float at(std::size_t i) const { return load_as_f32(bytes.data(), i, dtype); }
  uint16_t bits16(std::size_t i) const {
    uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    return h;
  }
};

// ---- the PyTorch fixture (safetensors) ----------------------------------------------------

struct StTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  float f32(std::size_t i) const {
    if (dtype == "F32") return load_as_f32(bytes.data(), i, DType::fp32);
    return load_as_f32(bytes.data(), i, dtype == "F16" ? DType::fp16 : DType::bf16);
  }
};

struct SafeTensors {
  nlohmann::json metadata;
  std::map<std::string, StTensor> tensors;
  const StTensor& at(const std::string& name) const {
    const auto it = tensors.find(name);
    REQUIRE_MESSAGE(it != tensors.end(), "fixture has no tensor " << name);
    return it->second;
  }
};

// safetensors: u64 little-endian header size, JSON header, then the data block.
SafeTensors load_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE_MESSAGE(f.good(), "cannot open " << path);
  uint64_t header_bytes = 0;
  f.read(reinterpret_cast<char*>(&header_bytes), 8);
  std::string header(header_bytes, '\0');
  f.read(header.data(), static_cast<std::streamsize>(header_bytes));
  const std::vector<char> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  SafeTensors st;
  const nlohmann::json index = nlohmann::json::parse(header);
  for (const auto& [name, e] : index.items()) {
    if (name == "__metadata__") {
      st.metadata = e;
      continue;
    }
    StTensor t{e.at("dtype").get<std::string>(), e.at("shape").get<std::vector<int64_t>>(), {}};
    const auto begin = e.at("data_offsets")[0].get<std::size_t>();
    const auto end = e.at("data_offsets")[1].get<std::size_t>();
    REQUIRE(end <= data.size());
    t.bytes.assign(data.begin() + static_cast<std::ptrdiff_t>(begin),
                   data.begin() + static_cast<std::ptrdiff_t>(end));
    st.tensors.emplace(name, std::move(t));
  }
  return st;
}

DType dtype_named(const std::string& s) {
  return s == "fp32" ? DType::fp32 : (s == "fp16" ? DType::fp16 : DType::bf16);
}

// ---- random state for the vector-vs-scalar tests ------------------------------------------

struct State {
  std::vector<float> master, m, v, grads;
};

// Masters of every scale (including ones that overflow fp16 or land in its subnormals),
// small moments, heavy-tailed gradients with some zeros; seeded, so failures reproduce.
State random_state(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  State s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  for (std::size_t i = 0; i < n; ++i) {
    float p = 0.5f * normal(rng);
    if (i % 97 == 3) p *= 2e5f;   // |p| > 65504: fp16 copy overflows to inf
    if (i % 89 == 5) p *= 1e-5f;  // fp16 subnormal range
    s.master[i] = p;
    s.m[i] = 1e-3f * normal(rng);
    s.v[i] = 1e-6f * std::fabs(normal(rng));
    const float g = normal(rng) * std::exp(normal(rng));
    s.grads[i] = (i % 53 == 7) ? 0.0f : 100.0f * g;  // loss-scaled
  }
  return s;
}

// ---- the tests ----------------------------------------------------------------------------

TEST_CASE("cpu_adam: names its ISA, forces a supported one, refuses an unsupported one") {
  const CpuIsa best = cpu_adam_isa();
  CHECK(cpu_supports(best));
  CHECK(to_string(CpuIsa::scalar) == "scalar");
  CHECK(to_string(CpuIsa::avx2) == "avx2");
  CHECK(to_string(CpuIsa::avx512) == "avx512");
  CHECK(to_string(CpuIsa::avx512bf16) == "avx512bf16");
  force_cpu_adam_isa(CpuIsa::scalar);
  CHECK(cpu_adam_isa() == CpuIsa::scalar);
  force_cpu_adam_isa(std::nullopt);
  CHECK(cpu_adam_isa() == best);
  for (CpuIsa isa : {CpuIsa::avx2, CpuIsa::avx512, CpuIsa::avx512bf16})
    if (!cpu_supports(isa)) {
      CHECK_THROWS_AS(force_cpu_adam_isa(isa), zp::Error);
      CHECK(cpu_adam_isa() == best);
    }
  MESSAGE("best ISA on this CPU: " << to_string(best));
}

TEST_CASE("cpu_adam: bad arguments are zp::Error, never a crash") {
  std::vector<float> p(4, 1.0f), m(4), v(4), g(4, 0.5f);
  std::vector<uint16_t> out(4);
  AdamTensors ts{.n = 4, .master = p.data(), .exp_avg = m.data(), .exp_avg_sq = v.data(),
                 .grads = g.data()};
  const AdamConfig ok;
  const AdamStepArgs step;
  CHECK_NOTHROW(cpu_adam_step(ok, step, ts));
  auto throws_with = [&](AdamConfig c, AdamStepArgs s, AdamTensors t) {
    CHECK_THROWS_AS(cpu_adam_step(c, s, t), zp::Error);
  };
  throws_with({.lr = -1}, step, ts);
  throws_with({.beta1 = 1.0}, step, ts);
  throws_with({.beta2 = -0.1}, step, ts);
  throws_with({.eps = NAN}, step, ts);
  throws_with({.weight_decay = -0.01}, step, ts);
  throws_with(ok, {.step = 0}, ts);
  throws_with(ok, {.inv_loss_scale = INFINITY}, ts);
  throws_with(ok, {.clip_coef = NAN}, ts);
  AdamTensors bad = ts;
  bad.grads = nullptr;
  throws_with(ok, step, bad);
  bad = ts;
  bad.moment_dtype = DType::fp16;
  throws_with(ok, step, bad);
  bad = ts;
  bad.param_out = out.data();
  bad.param_out_dtype = DType::fp32;
  throws_with(ok, step, bad);
  CHECK_NOTHROW(cpu_adam_step(ok, step, AdamTensors{}));  // n = 0: nothing to do
  CHECK_THROWS_AS(clip_coefficient(1.0, 1.0, 0.0), zp::Error);
  CHECK_THROWS_AS(clip_coefficient(INFINITY, 1.0, 1.0), zp::Error);
  CHECK_THROWS_AS(grad_sum_squares(nullptr, DType::fp16, 3), zp::Error);
}

TEST_CASE("cpu_adam: 10 steps agree with torch.optim.AdamW / Adam element by element") {
  const SafeTensors fx = load_safetensors(std::string(ZP_TEST_DATA) + "/cpu_adam/torch_adam.safetensors");
  const auto cases = nlohmann::json::parse(fx.metadata.at("cases").get<std::string>());
  REQUIRE(cases.size() >= 4);
  for (CpuIsa isa : supported_isas()) {
    for (const auto& c : cases) {
      const std::string name = c.at("name");
      CAPTURE(name);
      CAPTURE(to_string(isa));
      const auto n = c.at("n").get<std::size_t>();
      const int steps = c.at("steps");
      const DType grad_dtype = dtype_named(c.at("grad_dtype"));
      const DType p16_dtype = dtype_named(c.at("param16_dtype"));
      const AdamConfig cfg{.lr = c.at("lr"), .beta1 = c.at("beta1"), .beta2 = c.at("beta2"),
                           .eps = c.at("eps"), .weight_decay = c.at("weight_decay"),
                           .adamw = c.at("optimizer") == "adamw", .bias_correction = true};
      const double inv_scale = 1.0 / c.at("loss_scale").get<double>();
      const double max_norm = c.at("max_norm");

      const StTensor& p0 = fx.at(name + "/param0");
      const StTensor& grads = fx.at(name + "/grads");
      REQUIRE(grads.shape == std::vector<int64_t>{steps, static_cast<int64_t>(n)});
      std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
      for (std::size_t i = 0; i < n; ++i) master[i] = p0.f32(i);
      std::vector<uint16_t> p16(n);
      // m is a signed sum that can cancel: its error is relative to the size of its terms,
      // m_terms = b1*m_terms + (1-b1)*|g| (tracked in double alongside).
      std::vector<double> m_terms(n, 0.0);

      for (int k = 1; k <= steps; ++k) {
        CAPTURE(k);
        const void* g = grads.bytes.data() + (k - 1) * n * dtype_bytes(grad_dtype);
        // The global norm and clipping factor, against clip_grad_norm_'s (fp32 accumulation
        // in torch, so agreement to ~1e-6 relative).
        const GradSumSquares ss = grad_sum_squares(isa, g, grad_dtype, n);
        REQUIRE(ss.finite);
        const double norm = std::sqrt(ss.sum_sq) * inv_scale;
        CHECK(norm == doctest::Approx(fx.at(name + "/grad_norm").f32(k - 1)).epsilon(1e-6));
        const double clip = clip_coefficient(ss.sum_sq, inv_scale, max_norm);
        CHECK(clip == doctest::Approx(fx.at(name + "/clip_coef").f32(k - 1)).epsilon(1e-6));
        for (std::size_t i = 0; i < n; ++i) {
          const double g_i = load_as_f32(g, i, grad_dtype) * inv_scale * clip +
                             (cfg.adamw ? 0.0 : cfg.weight_decay * master[i]);
          m_terms[i] = cfg.beta1 * m_terms[i] + (1 - cfg.beta1) * std::fabs(g_i);
        }

        cpu_adam_step(isa, cfg, {.step = k, .inv_loss_scale = inv_scale, .clip_coef = clip},
                      {.n = n, .master = master.data(), .exp_avg = m.data(),
                       .exp_avg_sq = v.data(), .grads = g, .grad_dtype = grad_dtype,
                       .param_out = p16.data(), .param_out_dtype = p16_dtype});

        const std::string pre = name + "/step" + std::to_string(k);
        if (!fx.tensors.contains(pre + "/param")) continue;
        const StTensor &tp = fx.at(pre + "/param"), &tm = fx.at(pre + "/exp_avg"),
                       &tv = fx.at(pre + "/exp_avg_sq"), &tp16 = fx.at(pre + "/param16");
        // Tolerances. Torch and we do the same fp32 arithmetic in a slightly different order
        // (torch unscales and clips in two multiplies, we in one; torch divides by
        // sqrt(bc2), we multiply by its inverse; torch's clip factor comes from an fp32
        // norm), so every quantity differs by a few fp32 roundings, relative to its terms:
        //   v (a sum of positive terms): 1e-6 of v (~16 ulps);
        //   m: 1e-6 of m_terms;
        //   master: per step, 2 ulps of |p| (each step rounds p once) plus 1e-6 of lr (the
        //   update is ~lr in size and accurate to a few fp32 roundings).
        // The measured headroom is printed below (max difference / tolerance, about 0.1-0.6).
        double worst_p = 0, worst_m = 0, worst_v = 0;  // max |difference| / tolerance
        int64_t worst_p16 = 0;
        for (std::size_t i = 0; i < n; ++i) {
          CAPTURE(i);
          const double tol_p = k * (2.0 * ulp_of(tp.f32(i)) + 1e-6 * cfg.lr);
          const double tol_m = 1e-6 * m_terms[i] + 1e-30;
          const double tol_v = 1e-6 * tv.f32(i) + 1e-30;
          const double dp = std::fabs(double(master[i]) - tp.f32(i));
          const double dm = std::fabs(double(m[i]) - tm.f32(i));
          const double dv = std::fabs(double(v[i]) - tv.f32(i));
          CHECK(dp <= tol_p);
          CHECK(dm <= tol_m);
          CHECK(dv <= tol_v);
          worst_p = std::max(worst_p, dp / tol_p);
          worst_m = std::max(worst_m, dm / tol_m);
          worst_v = std::max(worst_v, dv / tol_v);
          // The 16-bit copy is exactly our master rounded, and torch's within one 16-bit ulp
          // (a master a few fp32 ulps away can sit across a 16-bit rounding boundary).
          REQUIRE(p16[i] == (p16_dtype == DType::fp16 ? fp32_to_fp16(master[i])
                                                       : fp32_to_bf16(master[i])));
          uint16_t theirs;
          std::memcpy(&theirs, tp16.bytes.data() + 2 * i, 2);
          const int64_t d16 = ulp_distance16(p16[i], theirs);
          worst_p16 = std::max(worst_p16, d16);
          CHECK(d16 <= 1);
        }
        MESSAGE(to_string(isa) << " " << name << " step " << k
                               << ": max |ours - torch| / tolerance: param " << worst_p
                               << ", exp_avg " << worst_m << ", exp_avg_sq " << worst_v
                               << "; param16 max ulps " << worst_p16);
      }
    }
  }
}

// Adam written a second way, straight from the papers in double: Kingma & Ba (2015)
// Algorithm 1 (m_hat = m/bc1, v_hat = v/bc2, p -= lr*m_hat/(sqrt(v_hat)+eps)); decoupled
// decay p *= 1 - lr*wd for AdamW (Loshchilov & Hutter 2019), g += wd*p for Adam (L2).
void reference_step(const AdamConfig& c, int64_t t, double grad_scale, double g_raw, double& p,
                    double& m, double& v) {
  double g = g_raw * grad_scale;
  if (!c.adamw) g += c.weight_decay * p;
  m = c.beta1 * m + (1 - c.beta1) * g;
  v = c.beta2 * v + (1 - c.beta2) * g * g;
  const double bc1 = c.bias_correction ? 1 - std::pow(c.beta1, double(t)) : 1.0;
  const double bc2 = c.bias_correction ? 1 - std::pow(c.beta2, double(t)) : 1.0;
  if (c.adamw) p *= 1 - c.lr * c.weight_decay;
  p -= c.lr * (m / bc1) / (std::sqrt(v / bc2) + c.eps);
}

TEST_CASE("cpu_adam: bias correction off and bf16 moments follow the formula in double") {
  // Each step starts both sides from the same (stored) state, so the only differences are
  // the fp32 roundings of one step.
  const std::size_t n = 4099;
  const State s0 = random_state(n, 11);
  for (CpuIsa isa : supported_isas()) {
    for (DType moments : {DType::fp32, DType::bf16}) {
      for (bool bias_correction : {false, true}) {
        for (bool adamw : {true, false}) {
          CAPTURE(to_string(isa));
          CAPTURE(to_string(moments));
          CAPTURE(bias_correction);
          CAPTURE(adamw);
          const AdamConfig cfg{.lr = 3e-3, .beta1 = 0.85, .beta2 = 0.98, .eps = 1e-7,
                               .weight_decay = 0.02, .adamw = adamw,
                               .bias_correction = bias_correction};
          std::vector<float> master = s0.master;
          Buffer m(moments, s0.m), v(moments, s0.v);
          const Buffer g(DType::fp16, s0.grads);
          int64_t n_moment_mismatches = 0;
          for (int64_t t = 1; t <= 3; ++t) {
            const double inv_scale = 1.0 / 128, clip = 0.75;
            std::vector<double> rp(n), rm(n), rv(n), m_terms(n);
            for (std::size_t i = 0; i < n; ++i) {
              rp[i] = master[i], rm[i] = m.at(i), rv[i] = v.at(i);
              const double g_i = g.at(i) * inv_scale * clip + (adamw ? 0.0 : cfg.weight_decay * rp[i]);
              m_terms[i] = std::fabs(cfg.beta1 * rm[i]) + (1 - cfg.beta1) * std::fabs(g_i);
              reference_step(cfg, t, inv_scale * clip, g.at(i), rp[i], rm[i], rv[i]);
            }
            cpu_adam_step(isa, cfg, {.step = t, .inv_loss_scale = inv_scale, .clip_coef = clip},
                          {.n = n, .master = master.data(), .exp_avg = m.data(),
                           .exp_avg_sq = v.data(), .moment_dtype = moments, .grads = g.data(),
                           .grad_dtype = DType::fp16});
            const double step_size =
                cfg.lr / (bias_correction ? 1 - std::pow(cfg.beta1, double(t)) : 1.0);
            for (std::size_t i = 0; i < n; ++i) {
              CAPTURE(i);
              // Master: 2 ulps (rounded once) plus 1e-6 of the step size (the update is at
              // most a few step sizes, computed with a few fp32 roundings).
              CHECK(std::fabs(master[i] - rp[i]) <= 2 * ulp_of(float(rp[i])) + 1e-6 * step_size);
              if (moments == DType::fp32) {
                // m is a signed sum: its rounding error is relative to its terms.
                CHECK(std::fabs(m.at(i) - rm[i]) <= 1e-6 * m_terms[i]);
                CHECK(v.at(i) == doctest::Approx(rv[i]).epsilon(1e-6));
              } else {
                // The same value rounded to bf16, except where the fp32 and the double value
                // straddle a bf16 rounding boundary: then one bf16 ulp apart.
                const uint16_t want_m = fp32_to_bf16(static_cast<float>(rm[i]));
                const uint16_t want_v = fp32_to_bf16(static_cast<float>(rv[i]));
                CHECK(ulp_distance16(m.bits16(i), want_m) <= 1);
                CHECK(ulp_distance16(v.bits16(i), want_v) <= 1);
                n_moment_mismatches += (m.bits16(i) != want_m) + (v.bits16(i) != want_v);
              }
            }
          }
          // Straddling is rare (~1e-3 of values here); truncating instead of rounding to
          // nearest would be off in about half of them.
          CHECK(n_moment_mismatches <= static_cast<int64_t>(6 * n) / 200);
        }
      }
    }
  }
}

TEST_CASE("cpu_adam: every vector ISA equals the scalar reference bit for bit") {
  // Sizes: tiny, around one vector block (width x unroll), two and three blocks (the AVX2
  // bf16-moment body staggers its blocks: first, middle and last differ), and large enough to
  // be threaded; every (grad, moment, param-out) dtype combination, one step from a state with
  // nonzero moments, alternating AdamW with bias correction and Adam (L2) without (the same
  // kernel with other constants) so that each combination meets both at some sizes. Each
  // vector body with its software prefetches and without, with ordinary stores and with
  // non-temporal ones for the 16-bit copy (neither changes a value).
  for (CpuIsa isa : supported_isas())
    for (const auto& [prefetch, stores] :
         {std::pair{CpuAdamPrefetch::software, CpuAdamStores::cached},
          std::pair{CpuAdamPrefetch::software, CpuAdamStores::streaming_copy},
          std::pair{CpuAdamPrefetch::hardware, CpuAdamStores::cached},
          std::pair{CpuAdamPrefetch::hardware, CpuAdamStores::streaming_copy}}) {
      if (isa == CpuIsa::scalar) continue;
      force_cpu_adam_prefetch(prefetch);
      force_cpu_adam_stores(stores);
      const std::size_t b = block_elems(isa);
      for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{22}, b - 1, b, b + 1,
                            2 * b, 3 * b + 5, std::size_t{100'003}, std::size_t{1} << 20}) {
        const State s = random_state(n, static_cast<uint32_t>(n));
        for (DType gd : {DType::fp32, DType::fp16, DType::bf16}) {
          const Buffer g(gd, s.grads);
          for (DType md : {DType::fp32, DType::bf16}) {
            const Buffer m0(md, s.m), v0(md, s.v);
            for (int out = 0; out < 3; ++out) {  // none, fp16, bf16
              {
                const bool adamw = (n + static_cast<std::size_t>(gd) + static_cast<std::size_t>(md) + out) % 2 == 0;
                CAPTURE(to_string(isa));
                CAPTURE(to_string(prefetch));
                CAPTURE(to_string(stores));
                CAPTURE(n);
                CAPTURE(to_string(gd));
                CAPTURE(to_string(md));
                CAPTURE(out);
                CAPTURE(adamw);
                const AdamConfig cfg{.lr = 1e-2, .weight_decay = 0.1, .adamw = adamw,
                                     .bias_correction = adamw};
                const DType od = out == 1 ? DType::fp16 : DType::bf16;
                struct Run {
                  std::vector<float> master;
                  Buffer m, v, out;
                };
                Run runs[2];
                for (int r = 0; r < 2; ++r) {
                  Run& run = runs[r];
                  run = {s.master, m0, v0, Buffer(od, {})};
                  run.out.bytes.assign(n * 2, 0);
                  cpu_adam_step(r == 0 ? CpuIsa::scalar : isa, cfg,
                                {.step = 3, .inv_loss_scale = 1.0 / 100, .clip_coef = 0.6},
                                {.n = n, .master = run.master.data(), .exp_avg = run.m.data(),
                                 .exp_avg_sq = run.v.data(), .moment_dtype = md,
                                 .grads = g.data(), .grad_dtype = gd,
                                 .param_out = out ? run.out.data() : nullptr,
                                 .param_out_dtype = od});
                }
                const bool same_master =
                    std::memcmp(runs[0].master.data(), runs[1].master.data(), n * 4) == 0;
                CHECK(same_master);
                CHECK(runs[0].m.bytes == runs[1].m.bytes);
                CHECK(runs[0].v.bytes == runs[1].v.bytes);
                CHECK(runs[0].out.bytes == runs[1].out.bytes);
                if (!same_master)
                  for (std::size_t i = 0; i < n; ++i)
                    if (runs[0].master[i] != runs[1].master[i]) {
                      FAIL_CHECK("first difference at " << i << ": scalar " << runs[0].master[i]
                                                         << " vs " << runs[1].master[i]);
                      break;
                    }
                // The step did something: the master moved (no silent no-op passes this).
                CHECK(std::memcmp(runs[0].master.data(), s.master.data(), n * 4) != 0);
              }
            }
          }
        }
      }
    }
  force_cpu_adam_prefetch(CpuAdamPrefetch::automatic);
  force_cpu_adam_stores(CpuAdamStores::automatic);
}

TEST_CASE("cpu_adam: the automatic prefetch and stores are AMD's only on AMD CPUs") {
  // What cpu_adam.cpp's dispatch promises (its comments have the measurements): on an AMD CPU
  // the fp32-moment steps leave the arrays to the hardware prefetchers and write the 16-bit
  // copy with non-temporal stores, and the avx512bf16 kernels' bf16-moment steps leave them to
  // the hardware too; the other bf16-moment steps, and every step on other CPUs, prefetch in
  // software, and they use ordinary stores; a forced kind applies to every step.
  force_cpu_adam_prefetch(CpuAdamPrefetch::automatic);
  force_cpu_adam_stores(CpuAdamStores::automatic);
  const bool amd = __builtin_cpu_is("amd");
  CHECK(cpu_adam_stores(DType::fp32) == (amd ? CpuAdamStores::streaming_copy : CpuAdamStores::cached));
  CHECK(cpu_adam_stores(DType::bf16) == CpuAdamStores::cached);
  force_cpu_adam_stores(CpuAdamStores::streaming);
  CHECK(cpu_adam_stores(DType::fp32) == CpuAdamStores::streaming);
  CHECK(cpu_adam_stores(DType::bf16) == CpuAdamStores::streaming);
  force_cpu_adam_stores(CpuAdamStores::automatic);
  CHECK(to_string(CpuAdamStores::streaming_copy) == "streaming_copy");
  const CpuAdamPrefetch on_amd = amd ? CpuAdamPrefetch::hardware : CpuAdamPrefetch::software;
  for (const CpuIsa isa : {CpuIsa::avx2, CpuIsa::avx512, CpuIsa::avx512bf16}) {
    CAPTURE(to_string(isa));
    CHECK(cpu_adam_prefetch(isa, DType::fp32) == on_amd);
    CHECK(cpu_adam_prefetch(isa, DType::bf16) ==
          (isa == CpuIsa::avx512bf16 ? on_amd : CpuAdamPrefetch::software));
  }
  for (const CpuAdamPrefetch forced : {CpuAdamPrefetch::software, CpuAdamPrefetch::hardware}) {
    force_cpu_adam_prefetch(forced);
    CHECK(cpu_adam_prefetch(CpuIsa::avx2, DType::fp32) == forced);
    CHECK(cpu_adam_prefetch(CpuIsa::avx512bf16, DType::bf16) == forced);
  }
  force_cpu_adam_prefetch(CpuAdamPrefetch::automatic);
  CHECK(to_string(CpuAdamPrefetch::hardware) == "hardware");
}

TEST_CASE("cpu_adam: AdamW's moments never see the parameter, as in torch (an inf or NaN one too)") {
  // torch.optim.AdamW decays p on its own (p *= 1 - lr*wd) and updates m and v from the
  // gradient alone, so an inf or NaN parameter leaves its moments what they would be for any
  // other value; Adam's L2 term (g += wd*p) carries it into them. Every ISA, two vector blocks
  // and a scalar tail.
  const std::size_t n = 67;
  for (CpuIsa isa : supported_isas())
    for (bool adamw : {true, false}) {
      const AdamConfig cfg{.lr = 1e-2, .weight_decay = 0.1, .adamw = adamw};
      std::vector<float> master(n), m(n, 1e-3f), v(n, 1e-6f), grads(n), m_ref(n, 1e-3f), v_ref(n, 1e-6f);
      std::vector<float> master_ref(n);
      for (std::size_t i = 0; i < n; ++i) {
        grads[i] = 1e-2f * std::cos(0.3f * static_cast<float>(i));
        master[i] = master_ref[i] = 0.25f;
        if (i % 3 == 1) master[i] = INFINITY;
        if (i % 3 == 2) master[i] = NAN;
      }
      AdamTensors ts{.n = n, .master = master.data(), .exp_avg = m.data(), .exp_avg_sq = v.data(),
                     .grads = grads.data()};
      AdamTensors ref{.n = n, .master = master_ref.data(), .exp_avg = m_ref.data(),
                      .exp_avg_sq = v_ref.data(), .grads = grads.data()};
      cpu_adam_step(isa, cfg, {.step = 1}, ts);
      cpu_adam_step(isa, cfg, {.step = 1}, ref);
      for (std::size_t i = 0; i < n; ++i) {
        CAPTURE(to_string(isa));
        CAPTURE(adamw);
        CAPTURE(i);
        if (adamw) {
          CHECK(std::bit_cast<uint32_t>(m[i]) == std::bit_cast<uint32_t>(m_ref[i]));
          CHECK(std::bit_cast<uint32_t>(v[i]) == std::bit_cast<uint32_t>(v_ref[i]));
        } else if (i % 3 != 0) {
          CHECK_FALSE(std::isfinite(m[i]));  // g + wd*p is inf or NaN, and so is m
        }
        if (adamw && i % 3 == 1) CHECK(master[i] == INFINITY);  // inf * (1 - lr*wd) - finite
        if (i % 3 == 2) CHECK(std::isnan(master[i]));
      }
    }
}

TEST_CASE("cpu_adam: denormals, zeros, infinities and NaNs round to bf16 as the scalar reference") {
  // The avx512bf16 kernels store bf16 with VCVTNEPS2BF16, which flushes denormal inputs to
  // zero; a vector with a denormal lane must take the integer rounding instead. The first half
  // holds the special values (denormal, -0, near FLT_MAX, inf, NaNs, and zero gradients that
  // keep denormals denormal through the update), the second half none, so both paths run.
  // Equal bits everywhere, except that a NaN only has to be a NaN (which operand's payload an
  // fma propagates depends on the instruction form the compiler picks).
  const std::size_t n = 4096;
  std::vector<float> master(n), m(n), v(n), grads(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = std::sin(0.37f * static_cast<float>(i));
    master[i] = 0.5f * x, m[i] = 1e-3f * x, v[i] = 1e-6f * (1.5f + x), grads[i] = 1e-2f * std::cos(0.11f * static_cast<float>(i));
    if (i >= n / 2) continue;
    if (i % 7 == 0) master[i] = 1e-39f * static_cast<float>(1 + i % 3), grads[i] = 0.0f, m[i] = 0.0f;
    if (i % 5 == 0) m[i] = -2e-39f, v[i] = 3e-39f;
    if (i % 11 == 0) master[i] = -0.0f;
    if (i % 13 == 0) master[i] = 3.3895e38f;  // rounds up to bf16 infinity
    if (i % 17 == 0) master[i] = INFINITY;
    if (i % 19 == 0) grads[i] = NAN;
    // NaNs whose every payload bit is set: rounding them as numbers carries out of the top
    // (0x7fffffff + 0x7fff -> 0x8000, -0), so the kernels' NaN path must run.
    if (i % 23 == 0) master[i] = std::bit_cast<float>(0x7fffffffu);
    if (i % 29 == 0) grads[i] = std::bit_cast<float>(0xffffffffu);
  }
  for (CpuIsa isa : supported_isas()) {
    if (isa == CpuIsa::scalar) continue;
    for (bool adamw : {true, false})  // Adam's L2 term brings master's NaNs into the moments
    for (DType gd : {DType::fp32, DType::bf16})
      for (DType md : {DType::fp32, DType::bf16}) {
        CAPTURE(to_string(isa));
        CAPTURE(adamw);
        CAPTURE(to_string(gd));
        CAPTURE(to_string(md));
        const Buffer g(gd, grads);
        std::vector<float> p[2] = {master, master};
        Buffer mm[2] = {Buffer(md, m), Buffer(md, m)}, vv[2] = {Buffer(md, v), Buffer(md, v)};
        Buffer out[2] = {Buffer(DType::bf16, master), Buffer(DType::bf16, master)};
        for (int r = 0; r < 2; ++r)
          cpu_adam_step(r == 0 ? CpuIsa::scalar : isa, {.lr = 1e-3, .weight_decay = 0.01, .adamw = adamw},
                        {.step = 2, .inv_loss_scale = 1.0, .clip_coef = 1.0},
                        {.n = n, .master = p[r].data(), .exp_avg = mm[r].data(), .exp_avg_sq = vv[r].data(),
                         .moment_dtype = md, .grads = g.data(), .grad_dtype = gd, .param_out = out[r].data(),
                         .param_out_dtype = DType::bf16});
        std::size_t denormal_outs = 0, differing = 0;
        auto same = [](float a, float b) {
          return std::isnan(a) ? std::isnan(b) : std::memcmp(&a, &b, 4) == 0;
        };
        for (std::size_t i = 0; i < n; ++i) {
          const float o = out[0].at(i);
          denormal_outs += std::fpclassify(o) == FP_SUBNORMAL;
          differing += !same(p[0][i], p[1][i]) || !same(mm[0].at(i), mm[1].at(i)) ||
                       !same(vv[0].at(i), vv[1].at(i)) || !same(o, out[1].at(i));
        }
        CHECK(differing == 0);
        CHECK(denormal_outs > 100);  // the case it exists for did occur
      }
  }
}

// The vector bf16 packings on consecutive bit patterns from `first` (wrapping), into out:
// AVX2's bf16_pack16 (16 values), AVX-512's bf16_pack32_avx512 and bf16_pack32_avx512bf16 (32),
// each function with exactly its ISA's target (the packing without BF16 is checked with nothing
// a CPU with AVX-512F and BW alone lacks).
__attribute__((target("avx2"))) void pack16_from(uint32_t first, uint16_t* out) {
  alignas(32) uint32_t in[16];
  for (uint32_t k = 0; k < 16; ++k) in[k] = first + k;
  const __m256 x0 = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(in)));
  const __m256 x1 = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(in + 8)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), zp::runtime::detail::bf16_pack16(x0, x1));
}
// GCC 12's AVX-512 intrinsics warn "may be used uninitialized" of their own undefined merge
// sources (GCC bug 105593; cpu_adam_avx512.cpp silences it too).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The 32 bit patterns from `first` on, as two vectors of fp32 lanes.
__attribute__((target("avx512f"), always_inline)) inline void patterns32(uint32_t first, __m512& x0,
                                                                         __m512& x1) {
  alignas(64) uint32_t in[32];
  for (uint32_t k = 0; k < 32; ++k) in[k] = first + k;
  x0 = _mm512_castsi512_ps(_mm512_load_si512(in));
  x1 = _mm512_castsi512_ps(_mm512_load_si512(in + 16));
}
__attribute__((target("avx512f,avx512bw"))) void pack32_from(uint32_t first, uint16_t* out) {
  __m512 x0, x1;
  patterns32(first, x0, x1);
  _mm512_storeu_si512(out, zp::runtime::detail::bf16_pack32_avx512(x0, x1));
}
__attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16"))) void pack32_bf16_from(uint32_t first,
                                                                                      uint16_t* out) {
  __m512 x0, x1;
  patterns32(first, x0, x1);
  _mm512_storeu_si512(out, zp::runtime::detail::bf16_pack32_avx512bf16(x0, x1));
}
#pragma GCC diagnostic pop

// Every fp32 bit pattern once, `width` at a time through pack (NaNs and denormals among them:
// a group with one takes the per-lane path, the others the packed one); the expected value is
// dtype.hpp's scalar. The number of patterns that differ, and the first.
template <uint32_t kWidth>
std::pair<uint64_t, uint32_t> bf16_exhaustive(void (*pack)(uint32_t, uint16_t*)) {
  uint64_t differ = 0;
  uint32_t first_bad = 0;
  uint16_t out[kWidth];
  for (uint64_t base = 0; base < (uint64_t{1} << 32); base += kWidth) {
    pack(static_cast<uint32_t>(base), out);
    for (uint32_t k = 0; k < kWidth; ++k) {
      const uint32_t u = static_cast<uint32_t>(base) + k;
      if (out[k] != fp32_to_bf16(std::bit_cast<float>(u)) && differ++ == 0) first_bad = u;
    }
  }
  return {differ, first_bad};
}

std::string hex32(uint32_t u) {
  char hex[16];
  std::snprintf(hex, sizeof hex, "0x%08x", u);
  return hex;
}

TEST_CASE("cpu_adam: the vector bf16 roundings equal fp32_to_bf16 on all 2^32 fp32 bit patterns") {
  // Each ISA's packing runs only where this CPU has its instructions (this VM has all three).
  if (cpu_supports(CpuIsa::avx2)) {
    const auto [differ, first_bad] = bf16_exhaustive<16>(pack16_from);
    INFO("AVX2: first differing pattern: " << hex32(first_bad));
    CHECK(differ == 0);
  }
  if (cpu_supports(CpuIsa::avx512)) {
    const auto [differ, first_bad] = bf16_exhaustive<32>(pack32_from);
    INFO("AVX-512BW: first differing pattern: " << hex32(first_bad));
    CHECK(differ == 0);
  }
  if (cpu_supports(CpuIsa::avx512bf16)) {
    const auto [differ, first_bad] = bf16_exhaustive<32>(pack32_bf16_from);
    INFO("AVX-512 BF16: first differing pattern: " << hex32(first_bad));
    CHECK(differ == 0);
  }
}

TEST_CASE("cpu_adam: streaming and cached stores equal the scalar reference on any alignment") {
  // The vector kernels write with ordinary stores, non-temporal ones for every array
  // (streaming), or for the 16-bit copy alone (streaming_copy; automatic on AMD CPUs); forced
  // by force_cpu_adam_stores. Streaming runs a scalar head up to master's block boundary (128
  // bytes), and falls back to ordinary stores when another written array is not on its vector
  // boundary there; streaming_copy runs a head up to the copy's 64-byte line boundary. Each
  // kind at 2^20 + 37 and at 4,133 elements;
  // each array at its own element offset inside a 64-byte-aligned allocation: all aligned (no
  // head), all shifted alike (a head, then streamed), and param_out or the moments shifted
  // apart (not streamable: the fallback).
  struct Offsets {
    std::size_t master, moments, out;
  };
  for (const std::size_t n : {(std::size_t{1} << 20) + 37, std::size_t{4133}})
    for (const CpuAdamStores stores :
         {CpuAdamStores::automatic, CpuAdamStores::cached, CpuAdamStores::streaming,
          CpuAdamStores::streaming_copy}) {
      force_cpu_adam_stores(stores);
      const State s = random_state(n, 2024);
      // n elements of `bytes` each, starting `offset` elements past a 64-byte boundary.
      struct Aligned {
        std::vector<uint8_t> storage;
        uint8_t* p = nullptr;
        Aligned(std::size_t n_elems, std::size_t bytes, std::size_t offset)
            : storage(n_elems * bytes + 64 + offset * bytes) {
          const auto base = reinterpret_cast<uintptr_t>(storage.data());
          p = storage.data() + (64 - base % 64) % 64 + offset * bytes;
        }
      };
      for (CpuIsa isa : supported_isas()) {
        if (isa == CpuIsa::scalar) continue;
        for (const Offsets o :
             {Offsets{0, 0, 0}, Offsets{3, 3, 3}, Offsets{0, 0, 1}, Offsets{5, 2, 5}})
          for (DType md : {DType::fp32, DType::bf16}) {
            CAPTURE(to_string(isa));
            CAPTURE(n);
            CAPTURE(static_cast<int>(stores));
            CAPTURE(o.master);
            CAPTURE(o.moments);
            CAPTURE(o.out);
            CAPTURE(to_string(md));
            const Buffer g(DType::fp16, s.grads);
            const Buffer m0(md, s.m), v0(md, s.v);
            std::vector<uint8_t> want[4], got[4];  // master, m, v, out
            for (int r = 0; r < 2; ++r) {
              Aligned master(n, 4, o.master), m(n, dtype_bytes(md), o.moments),
                  v(n, dtype_bytes(md), o.moments), out(n, 2, o.out);
              std::memcpy(master.p, s.master.data(), n * 4);
              std::memcpy(m.p, m0.bytes.data(), m0.bytes.size());
              std::memcpy(v.p, v0.bytes.data(), v0.bytes.size());
              cpu_adam_step(r == 0 ? CpuIsa::scalar : isa, {.lr = 1e-2, .weight_decay = 0.1},
                            {.step = 5, .inv_loss_scale = 1.0 / 100, .clip_coef = 0.7},
                            {.n = n,
                             .master = reinterpret_cast<float*>(master.p),
                             .exp_avg = m.p,
                             .exp_avg_sq = v.p,
                             .moment_dtype = md,
                             .grads = g.data(),
                             .grad_dtype = DType::fp16,
                             .param_out = out.p,
                             .param_out_dtype = DType::fp16});
              std::vector<uint8_t>* dst = r == 0 ? want : got;
              dst[0].assign(master.p, master.p + n * 4);
              dst[1].assign(m.p, m.p + m0.bytes.size());
              dst[2].assign(v.p, v.p + v0.bytes.size());
              dst[3].assign(out.p, out.p + n * 2);
            }
            CHECK(want[0] == got[0]);
            CHECK(want[1] == got[1]);
            CHECK(want[2] == got[2]);
            CHECK(want[3] == got[3]);
            CHECK(std::memcmp(want[0].data(), s.master.data(), n * 4) != 0);  // the step moved
          }
      }
    }
  force_cpu_adam_stores(CpuAdamStores::automatic);
}

TEST_CASE("grad_sum_squares: equals a long-double sum on every ISA; flags inf and NaN") {
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{15},
                        std::size_t{17}, std::size_t{22}, std::size_t{31}, std::size_t{33},
                        std::size_t{100'003}, std::size_t{1} << 20}) {
    const State s = random_state(n, 5 + static_cast<uint32_t>(n));
    for (DType gd : {DType::fp32, DType::fp16, DType::bf16}) {
      const Buffer g(gd, s.grads);
      long double want = 0;
      for (std::size_t i = 0; i < n; ++i) want += static_cast<long double>(g.at(i)) * g.at(i);
      for (CpuIsa isa : supported_isas()) {
        CAPTURE(to_string(isa));
        CAPTURE(to_string(gd));
        CAPTURE(n);
        const GradSumSquares got = grad_sum_squares(isa, g.data(), gd, n);
        CHECK(got.finite);
        // Positive terms: relative error of any summation order <= (n - 1) * 2^-53.
        const double tol = static_cast<double>(n) * 0x1p-53 * static_cast<double>(want);
        CHECK(std::fabs(got.sum_sq - static_cast<double>(want)) <= tol);
      }
    }
  }
  for (CpuIsa isa : supported_isas()) {
    for (DType gd : {DType::fp32, DType::fp16, DType::bf16}) {
      CAPTURE(to_string(isa));
      CAPTURE(to_string(gd));
      // The largest finite values are not "overflow" (fp32 squares would overflow fp32).
      const float big = gd == DType::fp32 ? FLT_MAX : (gd == DType::fp16 ? 65504.0f : 3.3895314e38f);
      const Buffer g_big(gd, std::vector<float>(1000, big));
      const GradSumSquares ss_big = grad_sum_squares(isa, g_big.data(), gd, 1000);
      CHECK(ss_big.finite);
      CHECK(ss_big.sum_sq == doctest::Approx(1000.0 * double(big) * double(big)));
      // One inf or NaN anywhere (head, vector body, tail, another thread's range) is reported.
      for (std::size_t n : {std::size_t{1000}, std::size_t{100'003}}) {
        for (std::size_t pos : {std::size_t{0}, std::size_t{5}, std::size_t{40}, n / 2, n - 1}) {
          for (float bad : {INFINITY, -INFINITY, NAN}) {
            CAPTURE(pos);
            CAPTURE(bad);
            std::vector<float> values(n, 0.25f);
            values[pos] = bad;
            const Buffer g(gd, values);
            CHECK_FALSE(grad_sum_squares(isa, g.data(), gd, n).finite);
          }
        }
      }
    }
  }
}

TEST_CASE("clip_coefficient: torch's clip_grad_norm_ factor, clamped to 1") {
  // 3-4-12: sqrt(9 + 16 + 144) = 13; with loss scale 2, the true norm is 6.5.
  CHECK(clip_coefficient(169.0, 0.5, 1.0) == doctest::Approx(1.0 / (6.5 + 1e-6)));
  CHECK(clip_coefficient(169.0, 0.5, 100.0) == 1.0);
  CHECK(clip_coefficient(0.0, 1.0, 1.0) == 1.0);
}

}  // namespace
