// Every op of the Device seam on the CUDA device against the cpu device (the reference whose
// kernels test_cpu_kernels checks against float64 finite differences and PyTorch): the same
// inputs, including the same pre-filled outputs (so accumulation and "untouched" entries are
// compared too), judged by the normalised error max|gpu - cpu| / max|cpu| with a tolerance per
// op. The fused Adam and SGD must match the CPU scalar reference bit for bit (same element
// function, no fused multiply-adds on either side). Label gpu: skipped without a CUDA device.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "zp/error.hpp"
#include "zp/runtime/cpu_adam.hpp"
#include "zp/runtime/cuda.hpp"
#include "zp/runtime/device.hpp"

using namespace zp::runtime;
using zp::planner::Category;
using zp::planner::Tier;

namespace {

// Tolerances, normalised by the largest reference value. Exact ops (copies, the same fp32
// additions in the same order) get 0; libm-based ones (tanhf, expf: a few ulp apart between
// glibc and CUDA) 1e-6; reductions whose order differs (warp trees vs sequential loops,
// cuBLAS vs OpenBLAS blocking, atomics) 1e-5, about 100 fp32 ulps of the largest value.
constexpr double kExact = 0.0;
constexpr double kUlps = 1e-6;
constexpr double kReorder = 1e-5;

template <class T>
struct Pair {  // one logical tensor, on both devices
  T* c;
  T* g;
  std::size_t n;
};

struct Both {
  std::unique_ptr<Device> cpu, gpu;
  std::mt19937 rng{1234};
  Both() {
    DeviceConfig dc;
    dc.gpu_bytes = 256ULL << 20;
    dc.cpu_bytes = 16ULL << 20;
    dc.n_threads = 1;
    cpu = make_cpu_device(dc);
    gpu = make_cuda_device(dc);
  }

  template <class T>
  Pair<T> put(const std::vector<T>& host) {
    const uint64_t bytes = std::max<uint64_t>(1, host.size()) * sizeof(T);
    auto* c = static_cast<T*>(cpu->arena(Tier::gpu).alloc(bytes, Category::activations, "c"));
    auto* g = static_cast<T*>(gpu->arena(Tier::gpu).alloc(bytes, Category::activations, "g"));
    cpu->copy(c, host.data(), host.size() * sizeof(T));
    gpu->copy(g, host.data(), host.size() * sizeof(T));
    return {c, g, host.size()};
  }
  std::vector<float> normal(std::size_t n, float sd = 1.0f) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng);
    return v;
  }
  Pair<float> rand(std::size_t n, float sd = 1.0f) { return put(normal(n, sd)); }
  Pair<int32_t> ints(std::size_t n, int32_t hi) {
    std::uniform_int_distribution<int32_t> d(0, hi - 1);
    std::vector<int32_t> v(n);
    for (auto& x : v) x = d(rng);
    return put(v);
  }
  Pair<uint16_t> half(std::size_t n, DType t, float sd = 1.0f) {
    std::vector<uint16_t> v(n);
    const std::vector<float> f = normal(n, sd);
    for (std::size_t i = 0; i < n; ++i) store_from_f32(v.data(), i, t, f[i]);
    return put(v);
  }
  template <class T>
  std::vector<T> get(Device& d, const T* p, std::size_t n) {
    std::vector<T> h(n);
    d.copy(h.data(), p, n * sizeof(T));
    return h;
  }
  double err(const Pair<float>& p) {
    const std::vector<float> c = get(*cpu, p.c, p.n), g = get(*gpu, p.g, p.n);
    double diff = 0, ref = 0;
    for (std::size_t i = 0; i < p.n; ++i) {
      if (std::isnan(c[i]) != std::isnan(g[i])) return std::numeric_limits<double>::infinity();
      diff = std::max(diff, std::fabs(static_cast<double>(g[i]) - c[i]));
      ref = std::max(ref, std::fabs(static_cast<double>(c[i])));
    }
    return ref > 0 ? diff / ref : diff;
  }
  // Zero above the diagonal of (rows, T, T) score matrices, on both devices: what a causal
  // score matrix holds there (softmax's output, its backward's), or where only the entries on
  // and below the diagonal are defined (see Device::attention_scores).
  template <class U>
  void zero_upper(const Pair<U>& p, int64_t t_len) {
    for (Device* d : {cpu.get(), gpu.get()}) {
      U* dev = d == cpu.get() ? p.c : p.g;
      std::vector<U> h = get(*d, dev, p.n);
      for (std::size_t i = 0; i < p.n; ++i) {
        const auto k = static_cast<int64_t>(i);
        if (k % t_len > k / t_len % t_len) h[i] = U{};
      }
      d->copy(dev, h.data(), p.n * sizeof(U));
    }
  }
  // Zero what lies outside each row's keys first_key(t)..t of (rows, T, T) score matrices
  // (cpu::AttnShape::first_key with a sliding window; window 0 is zero_upper).
  template <class U>
  void zero_outside(const Pair<U>& p, int64_t t_len, int64_t window) {
    for (Device* d : {cpu.get(), gpu.get()}) {
      U* dev = d == cpu.get() ? p.c : p.g;
      std::vector<U> h = get(*d, dev, p.n);
      for (std::size_t i = 0; i < p.n; ++i) {
        const auto k = static_cast<int64_t>(i);
        const int64_t t2 = k % t_len, t = k / t_len % t_len;
        const int64_t lo = window > 0 && t >= window ? t - window + 1 : 0;
        if (t2 > t || t2 < lo) h[i] = U{};
      }
      d->copy(dev, h.data(), p.n * sizeof(U));
    }
  }
  template <class T>
  bool identical(const Pair<T>& p) {
    const std::vector<T> c = get(*cpu, p.c, p.n), g = get(*gpu, p.g, p.n);
    return std::memcmp(c.data(), g.data(), p.n * sizeof(T)) == 0;
  }
};

// The measured error is printed (MESSAGE) as well as judged: the tolerances are estimates
// until a GPU run shows the numbers.
#define CHECK_CLOSE(both, pair, tol)                                  \
  do {                                                                \
    const double e_ = (both).err(pair);                               \
    MESSAGE(#pair " error " << e_ << " (tolerance " << (tol) << ")"); \
    CHECK(e_ <= (tol));                                               \
  } while (0)

// Small GPT-2 shapes with awkward sizes: C not a multiple of 32, V odd, T not a power of 2.
constexpr int64_t B = 2, T = 13, C = 48, NH = 4, V = 101, OC = 3 * C, N = B * T;

}  // namespace

TEST_CASE("cuda embedding and layernorm equal the cpu backend") {
  Both b;
  const auto tokens = b.ints(N, V);
  const auto wte = b.rand(V * C), wpe = b.rand(T * C);
  auto out = b.rand(N * C);
  b.cpu->embedding_forward(out.c, tokens.c, wte.c, wpe.c, DType::fp32, B, T, C);
  b.gpu->embedding_forward(out.g, tokens.g, wte.g, wpe.g, DType::fp32, B, T, C);
  CHECK_CLOSE(b, out, kExact);
  auto dwte = b.rand(V * C), dwpe = b.rand(T * C);
  const auto dout = b.rand(N * C);
  b.cpu->embedding_backward(dwte.c, dwpe.c, dout.c, tokens.c, DType::fp32, B, T, C);
  b.gpu->embedding_backward(dwte.g, dwpe.g, dout.g, tokens.g, DType::fp32, B, T, C);
  // Repeated tokens: the first position of a token adds every position's row in ascending order
  // onto the old value, as the cpu loop does (no atomics): the same bits.
  CHECK_CLOSE(b, dwte, kExact);
  CHECK_CLOSE(b, dwpe, kExact);

  // A mean far from zero exercises the two-pass variance.
  std::vector<float> x = b.normal(N * C);
  for (float& v : x) v += 30.0f;
  const auto inp = b.put(x), w = b.rand(C), bias = b.rand(C);
  auto y = b.rand(N * C), stats = b.rand(2 * N);
  b.cpu->layernorm_forward(y.c, stats.c, inp.c, w.c, bias.c, DType::fp32, N, C);
  b.gpu->layernorm_forward(y.g, stats.g, inp.g, w.g, bias.g, DType::fp32, N, C);
  CHECK_CLOSE(b, y, kReorder);
  CHECK_CLOSE(b, stats, kReorder);
  auto dinp = b.rand(N * C), dw = b.rand(C), db = b.rand(C);
  const auto dy = b.rand(N * C);
  b.cpu->layernorm_backward(dinp.c, dw.c, db.c, dy.c, inp.c, w.c, stats.c, DType::fp32, N, C);
  b.gpu->layernorm_backward(dinp.g, dw.g, db.g, dy.g, inp.g, w.g, stats.g, DType::fp32, N, C);
  CHECK_CLOSE(b, dinp, kReorder);
  CHECK_CLOSE(b, dw, kReorder);
  CHECK_CLOSE(b, db, kReorder);
}

TEST_CASE("cuda matmul (cuBLAS SGEMM, TF32 off) equals the cpu backend, with and without bias") {
  Both b;
  for (bool with_bias : {true, false}) {
    CAPTURE(with_bias);
    const auto inp = b.rand(N * C), w = b.rand(OC * C), bias = b.rand(OC);
    auto out = b.rand(N * OC);
    b.cpu->matmul_forward(out.c, DType::fp32, inp.c, w.c, with_bias ? bias.c : nullptr, DType::fp32, N, C, OC);
    b.gpu->matmul_forward(out.g, DType::fp32, inp.g, w.g, with_bias ? bias.g : nullptr, DType::fp32, N, C, OC);
    CHECK_CLOSE(b, out, kReorder);
    auto dinp = b.rand(N * C), dw = b.rand(OC * C), db = b.rand(OC);
    const auto dout = b.rand(N * OC);
    b.cpu->matmul_backward(dinp.c, dw.c, with_bias ? db.c : nullptr, dout.c, inp.c, w.c, DType::fp32, N, C, OC);
    b.gpu->matmul_backward(dinp.g, dw.g, with_bias ? db.g : nullptr, dout.g, inp.g, w.g, DType::fp32, N, C, OC);
    CHECK_CLOSE(b, dinp, kReorder);
    CHECK_CLOSE(b, dw, kReorder);
    CHECK_CLOSE(b, db, with_bias ? kReorder : kExact);  // untouched without bias
  }
}

TEST_CASE("cuda attention, three steps forward and backward, equals the cpu backend") {
  Both b;
  const auto qkv = b.rand(N * 3 * C);
  // Outputs start as the same noise on both sides: entries above the diagonal that a kernel
  // leaves alone must stay equal, and the accumulating kernels add to what is there.
  auto preatt = b.rand(B * NH * T * T);
  b.cpu->attention_scores(preatt.c, qkv.c, DType::fp32, B, T, C, NH);
  b.gpu->attention_scores(preatt.g, qkv.g, DType::fp32, B, T, C, NH);
  b.zero_upper(preatt, T);  // defined on and below the diagonal only
  CHECK_CLOSE(b, preatt, kReorder);
  auto att = b.rand(B * NH * T * T);
  b.cpu->attention_softmax(att.c, preatt.c, DType::fp32, B, NH, T);
  b.gpu->attention_softmax(att.g, preatt.g, DType::fp32, B, NH, T);
  CHECK_CLOSE(b, att, kReorder);
  auto out = b.rand(N * C);
  b.cpu->attention_values(out.c, att.c, qkv.c, DType::fp32, B, T, C, NH);
  b.gpu->attention_values(out.g, att.g, qkv.g, DType::fp32, B, T, C, NH);
  CHECK_CLOSE(b, out, kReorder);

  const auto dout = b.rand(N * C);
  auto datt = b.rand(B * NH * T * T), dqkv = b.rand(N * 3 * C);
  b.cpu->attention_values_backward(datt.c, dqkv.c, dout.c, att.c, qkv.c, DType::fp32, B, T, C, NH);
  b.gpu->attention_values_backward(datt.g, dqkv.g, dout.g, att.g, qkv.g, DType::fp32, B, T, C, NH);
  b.zero_upper(datt, T);
  CHECK_CLOSE(b, datt, kReorder);
  CHECK_CLOSE(b, dqkv, kReorder);
  // In place, as the engine may use it.
  b.cpu->attention_softmax_backward(datt.c, datt.c, att.c, DType::fp32, B, NH, T);
  b.gpu->attention_softmax_backward(datt.g, datt.g, att.g, DType::fp32, B, NH, T);
  CHECK_CLOSE(b, datt, kReorder);
  b.cpu->attention_scores_backward(dqkv.c, datt.c, qkv.c, DType::fp32, B, T, C, NH);
  b.gpu->attention_scores_backward(dqkv.g, datt.g, qkv.g, DType::fp32, B, T, C, NH);
  CHECK_CLOSE(b, dqkv, kReorder);
}

// ---- LLaMA-family blocks (fp32) -------------------------------------------------------------
// Grouped-query shapes: 6 query heads over 2 key/value heads of 40 (a head crosses a warp's 32
// lanes), fused q|k|v rows and separate tensors, sliding windows of 5 and none.
namespace {
constexpr int64_t LNH = 6, LKVH = 2, LHS = 40, LR = (LNH + 2 * LKVH) * LHS;
}  // namespace

TEST_CASE("cuda RMSNorm, q/k head norms, RoPE, SwiGLU and the sigmoid gate equal the cpu backend") {
  Both b;
  const int64_t Cl = 72;
  const auto x = b.rand(N * Cl, 2.0f), w = b.rand(Cl);
  auto y = b.rand(N * Cl), stats = b.rand(N);
  b.cpu->rmsnorm_forward(y.c, stats.c, x.c, w.c, 1e-6f, DType::fp32, N, Cl);
  b.gpu->rmsnorm_forward(y.g, stats.g, x.g, w.g, 1e-6f, DType::fp32, N, Cl);
  CHECK_CLOSE(b, y, kReorder);
  CHECK_CLOSE(b, stats, kReorder);
  auto dx = b.rand(N * Cl), dw = b.rand(Cl);  // accumulated into
  const auto dy = b.rand(N * Cl);
  const auto rs = b.put(b.get(*b.cpu, stats.c, stats.n));  // both read the cpu's stats
  b.cpu->rmsnorm_backward(dx.c, dw.c, dy.c, x.c, w.c, rs.c, DType::fp32, N, Cl);
  b.gpu->rmsnorm_backward(dx.g, dw.g, dy.g, x.g, w.g, rs.g, DType::fp32, N, Cl);
  CHECK_CLOSE(b, dx, kReorder);
  CHECK_CLOSE(b, dw, kReorder);

  // Qwen3's per-head norms over the q and k heads of fused rows, then in place backward.
  const auto qkv = b.rand(N * LR);
  const Device::Heads h{LNH, LKVH, LHS, 0};
  const Device::QkvIn fc{qkv.c, qkv.c + LNH * LHS, qkv.c + (LNH + LKVH) * LHS, LR, LR, LR};
  const Device::QkvIn fg{qkv.g, qkv.g + LNH * LHS, qkv.g + (LNH + LKVH) * LHS, LR, LR, LR};
  const auto hw = b.rand(2 * LHS);
  auto qk = b.rand(N * (LNH + LKVH) * LHS), hstats = b.rand(N * (LNH + LKVH));
  b.cpu->head_rmsnorm_forward(qk.c, hstats.c, fc, hw.c, 1e-6f, DType::fp32, N, h);
  b.gpu->head_rmsnorm_forward(qk.g, hstats.g, fg, hw.g, 1e-6f, DType::fp32, N, h);
  CHECK_CLOSE(b, qk, kReorder);
  CHECK_CLOSE(b, hstats, kReorder);
  auto dqkv = b.rand(N * LR), dhw = b.rand(2 * LHS);
  const auto same = b.put(b.get(*b.cpu, hstats.c, hstats.n));  // both read the cpu's stats
  b.cpu->head_rmsnorm_backward(dqkv.c, dhw.c, fc, hw.c, same.c, DType::fp32, N, h);
  b.gpu->head_rmsnorm_backward(dqkv.g, dhw.g, fg, hw.g, same.g, DType::fp32, N, h);
  CHECK_CLOSE(b, dqkv, kReorder);  // v heads untouched, q and k rewritten
  CHECK_CLOSE(b, dhw, kReorder);

  // RoPE in place over the q and k heads of fused rows, partial rotation (24 of 40 dims), a
  // YaRN-like mscale; the same fp32 angles, cos and sin rounded once from double on both.
  const int64_t rot = 24;
  std::vector<float> inv_freq(rot / 2);
  for (int64_t i = 0; i < rot / 2; ++i)
    inv_freq[static_cast<std::size_t>(i)] = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / rot);
  auto r = b.rand(N * LR);
  b.cpu->rope_forward(r.c, inv_freq.data(), 1.1f, DType::fp32, B, T, LR, LNH + LKVH, LHS, rot);
  b.gpu->rope_forward(r.g, inv_freq.data(), 1.1f, DType::fp32, B, T, LR, LNH + LKVH, LHS, rot);
  CHECK_CLOSE(b, r, kUlps);
  b.cpu->rope_backward(r.c, inv_freq.data(), 1.1f, DType::fp32, B, T, LR, LNH + LKVH, LHS, rot);
  b.gpu->rope_backward(r.g, inv_freq.data(), 1.1f, DType::fp32, B, T, LR, LNH + LKVH, LHS, rot);
  CHECK_CLOSE(b, r, kUlps);

  const int64_t F = 37;
  const auto gate = b.rand(N * F, 3.0f), up = b.rand(N * F), go = b.rand(N * F);
  auto act = b.rand(N * F), dgu = b.rand(N * 2 * F);
  b.cpu->swiglu_forward(act.c, gate.c, up.c, DType::fp32, N * F);
  b.gpu->swiglu_forward(act.g, gate.g, up.g, DType::fp32, N * F);
  CHECK_CLOSE(b, act, kUlps);
  b.cpu->swiglu_backward(dgu.c, go.c, gate.c, up.c, DType::fp32, N, F);
  b.gpu->swiglu_backward(dgu.g, go.g, gate.g, up.g, DType::fp32, N, F);
  CHECK_CLOSE(b, dgu, kUlps);

  const auto gl = b.rand(N, 2.0f);
  auto gm = b.rand(N * F), gdx = b.rand(N * F), gdg = b.rand(N);
  b.cpu->gate_mul_forward(gm.c, up.c, gl.c, DType::fp32, N, F);
  b.gpu->gate_mul_forward(gm.g, up.g, gl.g, DType::fp32, N, F);
  CHECK_CLOSE(b, gm, kUlps);
  b.cpu->gate_mul_backward(gdx.c, gdg.c, go.c, up.c, gl.c, DType::fp32, N, F);
  b.gpu->gate_mul_backward(gdx.g, gdg.g, go.g, up.g, gl.g, DType::fp32, N, F);
  CHECK_CLOSE(b, gdx, kUlps);
  CHECK_CLOSE(b, gdg, kReorder);
}

TEST_CASE("cuda grouped-query attention (cuBLAS, shared key/value heads) equals the cpu backend") {
  Both b;
  const int64_t A = B * LNH * T * T, O = LNH * LHS;
  for (int64_t window : {int64_t{0}, int64_t{5}})
    for (bool fused : {true, false}) {
      CAPTURE(window);
      CAPTURE(fused);
      const Device::Heads h{LNH, LKVH, LHS, window};
      const auto qkv = b.rand(N * LR);
      const auto q = b.rand(N * LNH * LHS), k = b.rand(N * LKVH * LHS), v = b.rand(N * LKVH * LHS);
      const Device::QkvIn ic = fused ? Device::QkvIn{qkv.c, qkv.c + LNH * LHS, qkv.c + (LNH + LKVH) * LHS, LR, LR, LR}
                                     : Device::QkvIn{q.c, k.c, v.c, LNH * LHS, LKVH * LHS, LKVH * LHS};
      const Device::QkvIn ig = fused ? Device::QkvIn{qkv.g, qkv.g + LNH * LHS, qkv.g + (LNH + LKVH) * LHS, LR, LR, LR}
                                     : Device::QkvIn{q.g, k.g, v.g, LNH * LHS, LKVH * LHS, LKVH * LHS};
      auto preatt = b.rand(A);
      b.cpu->gqa_scores(preatt.c, ic, DType::fp32, B, T, h);
      b.gpu->gqa_scores(preatt.g, ig, DType::fp32, B, T, h);
      b.zero_outside(preatt, T, window);  // defined on each row's keys only
      CHECK_CLOSE(b, preatt, kReorder);
      auto att = b.rand(A);
      b.cpu->gqa_softmax(att.c, preatt.c, DType::fp32, B, T, h);
      b.gpu->gqa_softmax(att.g, preatt.g, DType::fp32, B, T, h);
      CHECK_CLOSE(b, att, kReorder);
      auto out = b.rand(N * O);
      b.cpu->gqa_values(out.c, att.c, ic, DType::fp32, B, T, h);
      b.gpu->gqa_values(out.g, att.g, ig, DType::fp32, B, T, h);
      CHECK_CLOSE(b, out, kReorder);
      const auto dout = b.rand(N * O);
      auto datt = b.rand(A), dqkv = b.rand(N * LR);
      b.cpu->gqa_values_backward(datt.c, dqkv.c, dout.c, att.c, ic, DType::fp32, B, T, h);
      b.gpu->gqa_values_backward(datt.g, dqkv.g, dout.g, att.g, ig, DType::fp32, B, T, h);
      b.zero_outside(datt, T, window);
      CHECK_CLOSE(b, datt, kReorder);
      CHECK_CLOSE(b, dqkv, kReorder);
      b.cpu->gqa_softmax_backward(datt.c, datt.c, att.c, DType::fp32, B, T, h);  // in place
      b.gpu->gqa_softmax_backward(datt.g, datt.g, att.g, DType::fp32, B, T, h);
      CHECK_CLOSE(b, datt, kReorder);
      b.cpu->gqa_scores_backward(dqkv.c, datt.c, ic, DType::fp32, B, T, h);
      b.gpu->gqa_scores_backward(dqkv.g, datt.g, ig, DType::fp32, B, T, h);
      CHECK_CLOSE(b, dqkv, kReorder);
    }
}

TEST_CASE("cuda flash attention forward and backward equal the cpu backend's, with dropout") {
  Both b;
  // 70 queries: tiles of 16 queries and 32 keys, the last ones partial; windows of 5 and 40 and
  // none; heads of 40 (crossing a warp's 32 lanes), and of 128 and 256, whose tiles need more
  // than the default 48 KiB of shared memory (the opt-in path).
  const int64_t Tf = 70, Nf = B * Tf;
  struct Case {
    int64_t hs, window;
    float p;
  };
  std::vector<Case> cases;
  for (int64_t window : {int64_t{0}, int64_t{5}, int64_t{40}})
    for (float p : {0.0f, 0.1f}) cases.push_back({LHS, window, p});
  cases.push_back({128, 0, 0.1f});
  cases.push_back({256, 40, 0.0f});
  for (const Case& c : cases) {
    CAPTURE(c.hs);
    CAPTURE(c.window);
    CAPTURE(c.p);
    const int64_t HS = c.hs, R = (LNH + 2 * LKVH) * HS, O = LNH * HS;
    const Device::Heads h{LNH, LKVH, HS, c.window};
    const auto qkv = b.rand(Nf * R);
    const Device::QkvIn ic{qkv.c, qkv.c + LNH * HS, qkv.c + (LNH + LKVH) * HS, R, R, R};
    const Device::QkvIn ig{qkv.g, qkv.g + LNH * HS, qkv.g + (LNH + LKVH) * HS, R, R, R};
    auto out = b.rand(Nf * O), lse = b.rand(B * LNH * Tf);
    b.cpu->flash_attention_forward(out.c, lse.c, ic, DType::fp32, B, Tf, h, c.p, 777);
    b.gpu->flash_attention_forward(out.g, lse.g, ig, DType::fp32, B, Tf, h, c.p, 777);
    CHECK_CLOSE(b, out, kReorder);
    CHECK_CLOSE(b, lse, kReorder);
    // The backward from the cpu's forward on both (one op's differences do not feed the next).
    const auto same_out = b.put(b.get(*b.cpu, out.c, out.n));
    const auto same_lse = b.put(b.get(*b.cpu, lse.c, lse.n));
    const auto dout = b.rand(Nf * O);
    auto dqkv = b.rand(Nf * R), dq_acc = b.rand(Nf * O), dsum = b.rand(B * LNH * Tf);
    b.cpu->flash_attention_backward(dqkv.c, dq_acc.c, dsum.c, dout.c, ic, same_out.c, same_lse.c,
                                    DType::fp32, B, Tf, h, c.p, 777);
    b.gpu->flash_attention_backward(dqkv.g, dq_acc.g, dsum.g, dout.g, ig, same_out.g, same_lse.g,
                                    DType::fp32, B, Tf, h, c.p, 777);
    CHECK_CLOSE(b, dqkv, kReorder);
    CHECK_CLOSE(b, dsum, kReorder);
  }
}

TEST_CASE("cuda MoE routing, dispatch and combine equal the cpu backend (the same order: exact copies and sums)") {
  Both b;
  struct Shape {
    int64_t n, e, k;
  };
  for (const Shape sh : {Shape{N, 5, 2}, Shape{300, 40, 3}})
    for (bool renorm : {true, false}) {
      CAPTURE(sh.n);
      CAPTURE(sh.e);
      CAPTURE(renorm);
      const int64_t Nm = sh.n, E = sh.e, K = sh.k, Cm = 24;
      const auto logits = b.rand(Nm * E, 2.0f);
      auto probs = b.rand(Nm * E), w = b.rand(Nm * K);
      std::vector<int32_t> zero_idx(static_cast<std::size_t>(Nm * K), 0);
      auto idx = b.put(zero_idx);
      b.cpu->moe_route_forward(probs.c, ExpertIdx(idx.c), w.c, logits.c, DType::fp32, Nm, E, K, renorm);
      b.gpu->moe_route_forward(probs.g, ExpertIdx(idx.g), w.g, logits.g, DType::fp32, Nm, E, K, renorm);
      CHECK_CLOSE(b, probs, kReorder);
      CHECK(b.identical(idx));  // random logits: no ties within fp32 reordering
      CHECK_CLOSE(b, w, kReorder);

      // The rest reads the cpu's routing on both devices.
      const auto pr = b.put(b.get(*b.cpu, probs.c, probs.n));
      const auto ix = b.put(b.get(*b.cpu, idx.c, idx.n));
      const auto wt = b.put(b.get(*b.cpu, w.c, w.n));
      std::vector<int64_t> off_c(static_cast<std::size_t>(E + 1)), off_g(off_c.size());
      std::vector<double> ps_c(static_cast<std::size_t>(E)), ps_g(ps_c.size());
      b.cpu->moe_route_stats(ExpertIdx(ix.c), pr.c, Nm, E, K, off_c.data(), ps_c.data());
      b.gpu->moe_route_stats(ExpertIdx(ix.g), pr.g, Nm, E, K, off_g.data(), ps_g.data());
      CHECK(off_g == off_c);
      for (int64_t e = 0; e < E; ++e)
        CHECK(std::fabs(ps_g[e] - ps_c[e]) <= 1e-12 * static_cast<double>(Nm));

      const auto dw = b.rand(Nm * K);
      std::vector<float> dprob = b.normal(static_cast<std::size_t>(E), 0.1f);
      auto dl = b.rand(Nm * E);
      b.cpu->moe_route_backward(dl.c, DType::fp32, dw.c, pr.c, ExpertIdx(ix.c), dprob.data(), Nm, E, K, renorm);
      b.gpu->moe_route_backward(dl.g, DType::fp32, dw.g, pr.g, ExpertIdx(ix.g), dprob.data(), Nm, E, K, renorm);
      CHECK_CLOSE(b, dl, kReorder);

      const auto in = b.rand(Nm * Cm);
      auto xe = b.rand(Nm * K * Cm);
      b.cpu->moe_dispatch(xe.c, in.c, ExpertIdx(ix.c), DType::fp32, Nm, K, E, Cm);
      b.gpu->moe_dispatch(xe.g, in.g, ExpertIdx(ix.g), DType::fp32, Nm, K, E, Cm);
      CHECK(b.identical(xe));
      const auto ye = b.rand(Nm * K * Cm);
      auto out = b.rand(Nm * Cm);
      b.cpu->moe_combine(out.c, ye.c, wt.c, ExpertIdx(ix.c), DType::fp32, Nm, K, E, Cm);
      b.gpu->moe_combine(out.g, ye.g, wt.g, ExpertIdx(ix.g), DType::fp32, Nm, K, E, Cm);
      CHECK(b.identical(out));  // w0 y0 + w1 y1 + ..., in slot order on both
      const auto dout = b.rand(Nm * Cm);
      auto dye = b.rand(Nm * K * Cm), dwts = b.rand(Nm * K);
      b.cpu->moe_combine_backward(dye.c, dwts.c, dout.c, ye.c, wt.c, ExpertIdx(ix.c), DType::fp32, Nm, K, E, Cm);
      b.gpu->moe_combine_backward(dye.g, dwts.g, dout.g, ye.g, wt.g, ExpertIdx(ix.g), DType::fp32, Nm, K, E, Cm);
      CHECK(b.identical(dye));
      CHECK_CLOSE(b, dwts, kReorder);
      auto din = b.rand(Nm * Cm);  // accumulated into
      b.cpu->moe_dispatch_backward(din.c, xe.c, ExpertIdx(ix.c), DType::fp32, Nm, K, E, Cm);
      b.gpu->moe_dispatch_backward(din.g, xe.g, ExpertIdx(ix.g), DType::fp32, Nm, K, E, Cm);
      CHECK(b.identical(din));  // slot by slot, as the cpu's loop
    }
  // An index outside [0, E) is reported when the offsets are read back.
  std::vector<int32_t> bad(static_cast<std::size_t>(N * 2), 1);
  bad[7] = 5;
  const auto bi = b.put(bad);
  const auto pr = b.rand(N * 5);
  std::vector<int64_t> off(6);
  CHECK_THROWS_WITH_AS(b.gpu->moe_route_stats(ExpertIdx(bi.g), pr.g, N, 5, 2, off.data(), nullptr),
                       doctest::Contains("outside [0, 5)"), zp::Error);
}

TEST_CASE("cuda gelu, residual and cross-entropy equal the cpu backend") {
  Both b;
  for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{100003}}) {
    CAPTURE(n);
    const auto x = b.rand(n, 3.0f), y = b.rand(n);
    auto out = b.rand(n);
    b.cpu->gelu_forward(out.c, x.c, DType::fp32, static_cast<int64_t>(n));
    b.gpu->gelu_forward(out.g, x.g, DType::fp32, static_cast<int64_t>(n));
    CHECK_CLOSE(b, out, kUlps);
    auto dx = b.rand(n);
    b.cpu->gelu_backward(dx.c, x.c, y.c, DType::fp32, static_cast<int64_t>(n));
    b.gpu->gelu_backward(dx.g, x.g, y.g, DType::fp32, static_cast<int64_t>(n));
    CHECK_CLOSE(b, dx, kUlps);
    b.cpu->residual_forward(out.c, x.c, y.c, DType::fp32, static_cast<int64_t>(n));
    b.gpu->residual_forward(out.g, x.g, y.g, DType::fp32, static_cast<int64_t>(n));
    CHECK_CLOSE(b, out, kExact);
  }
  // Large logits: the max subtraction and logsumexp keep the loss finite.
  auto logits = b.rand(N * V, 20.0f), losses = b.rand(N);
  const auto targets = b.ints(N, V);
  b.cpu->crossentropy_forward(logits.c, losses.c, targets.c, N, V);
  b.gpu->crossentropy_forward(logits.g, losses.g, targets.g, N, V);
  CHECK_CLOSE(b, logits, kReorder);
  CHECK_CLOSE(b, losses, kReorder);
  // Device::sum: the device's own values, summed in double on the host as the reference.
  double host_sum = 0;
  for (float l : b.get(*b.gpu, losses.g, N)) host_sum += l;
  CHECK(std::fabs(b.gpu->sum(losses.g, N) - host_sum) <= 1e-12 * std::fabs(host_sum));
  b.cpu->crossentropy_backward(logits.c, DType::fp32, logits.c, targets.c, 0.25f, N, V);
  b.gpu->crossentropy_backward(logits.g, DType::fp32, logits.g, targets.g, 0.25f, N, V);
  CHECK_CLOSE(b, logits, kReorder);
}

TEST_CASE("cuda cross-entropy reports a target outside the vocabulary as zp::Error") {
  Both b;
  auto logits = b.rand(N * V), losses = b.rand(N);
  std::vector<int32_t> t(N, 3);
  t[5] = static_cast<int32_t>(V);  // one past the end
  const auto targets = b.put(t);
  b.gpu->crossentropy_forward(logits.g, losses.g, targets.g, N, V);
  CHECK_THROWS_AS(b.gpu->sum(losses.g, N), zp::Error);
  // The flag is cleared once reported: the device stays usable.
  const auto ok = b.rand(N);
  CHECK(std::isfinite(b.gpu->sum(ok.g, N)));
}

TEST_CASE("cuda casts, accumulate and add equal the cpu backend bit for bit") {
  Both b;
  for (DType t : {DType::fp32, DType::fp16, DType::bf16}) {
    CAPTURE(to_string(t));
    const std::size_t n = 4099;
    const auto src = b.half(n, t == DType::fp32 ? DType::bf16 : t);  // raw 16-bit patterns
    const auto f = b.rand(n);
    auto dst32 = b.rand(n);
    if (t != DType::fp32) {
      b.cpu->to_f32(dst32.c, src.c, t, static_cast<int64_t>(n));
      b.gpu->to_f32(dst32.g, src.g, t, static_cast<int64_t>(n));
      CHECK(b.identical(dst32));
      auto acc = b.half(n, t);
      b.cpu->accumulate_to(acc.c, f.c, t, static_cast<int64_t>(n));
      b.gpu->accumulate_to(acc.g, f.g, t, static_cast<int64_t>(n));
      CHECK(b.identical(acc));
      const auto other = b.half(n, t);
      b.cpu->add(acc.c, other.c, t, static_cast<int64_t>(n));
      b.gpu->add(acc.g, other.g, t, static_cast<int64_t>(n));
      CHECK(b.identical(acc));
    } else {
      auto acc = b.rand(n);
      b.cpu->accumulate_to(acc.c, f.c, t, static_cast<int64_t>(n));
      b.gpu->accumulate_to(acc.g, f.g, t, static_cast<int64_t>(n));
      CHECK(b.identical(acc));
    }
  }
}

TEST_CASE("cuda grad_sum_squares: the same double sum as the CPU pass, and overflow detected") {
  Both b;
  for (DType t : {DType::fp32, DType::fp16, DType::bf16}) {
    CAPTURE(to_string(t));
    const std::size_t n = 70001;
    const void* gc;
    const void* gg;
    Pair<float> p32{};
    Pair<uint16_t> p16{};
    if (t == DType::fp32) {
      p32 = b.rand(n);
      gc = p32.c, gg = p32.g;
    } else {
      p16 = b.half(n, t);
      gc = p16.c, gg = p16.g;
    }
    const GradSumSquares c = b.cpu->grad_sum_squares(gc, t, n), g = b.gpu->grad_sum_squares(gg, t, n);
    CHECK(g.finite);
    // Every square is exact in double; only the order of the double additions differs.
    CHECK(std::fabs(g.sum_sq - c.sum_sq) <= 1e-12 * c.sum_sq);
  }
  std::vector<float> v(1000, 1.0f);
  v[777] = std::numeric_limits<float>::infinity();
  const auto bad = b.put(v);
  CHECK_FALSE(b.gpu->grad_sum_squares(bad.g, DType::fp32, v.size()).finite);
}

TEST_CASE("cuda Adam and SGD equal the CPU scalar reference bit for bit") {
  Both b;
  force_cpu_adam_isa(CpuIsa::scalar);
  for (DType gdt : {DType::fp32, DType::fp16, DType::bf16})
    for (DType mdt : {DType::fp32, DType::bf16})
      for (bool adamw : {true, false}) {
        CAPTURE(to_string(gdt));
        CAPTURE(to_string(mdt));
        CAPTURE(adamw);
        const std::size_t n = 1031;
        auto master = b.rand(n, 0.02f);
        std::vector<uint16_t> zeros16(n, 0);
        std::vector<float> zeros32(n, 0.0f);
        void* mc;
        void* mg;
        void* vc;
        void* vg;
        if (mdt == DType::fp32) {
          auto m = b.put(zeros32), v = b.put(zeros32);
          mc = m.c, mg = m.g, vc = v.c, vg = v.g;
        } else {
          auto m = b.put(zeros16), v = b.put(zeros16);
          mc = m.c, mg = m.g, vc = v.c, vg = v.g;
        }
        auto out = b.put(zeros16);
        const AdamConfig cfg{.lr = 1e-3, .weight_decay = 0.01, .adamw = adamw};
        for (int64_t step = 1; step <= 3; ++step) {
          Pair<float> g32{};
          Pair<uint16_t> g16{};
          const void* gc;
          const void* gg;
          if (gdt == DType::fp32) {
            g32 = b.rand(n, 1024.0f);
            gc = g32.c, gg = g32.g;
          } else {
            g16 = b.half(n, gdt, 1024.0f);
            gc = g16.c, gg = g16.g;
          }
          const AdamStepArgs args{.step = step, .inv_loss_scale = 1.0 / 1024, .clip_coef = 0.5};
          AdamTensors ts{.n = n, .master = master.c, .exp_avg = mc, .exp_avg_sq = vc, .moment_dtype = mdt,
                         .grads = gc, .grad_dtype = gdt, .param_out = out.c,
                         .param_out_dtype = DType::bf16};
          b.cpu->adam_step(cfg, args, ts);
          ts.master = master.g, ts.exp_avg = mg, ts.exp_avg_sq = vg, ts.grads = gg, ts.param_out = out.g;
          b.gpu->adam_step(cfg, args, ts);
        }
        CHECK(b.identical(master));
        CHECK(b.identical(out));
      }
  force_cpu_adam_isa(std::nullopt);

  const std::size_t n = 513;
  auto w = b.rand(n), mom = b.rand(n);
  std::vector<uint16_t> zeros16(n, 0);
  auto out = b.put(zeros16);
  for (int step = 0; step < 3; ++step) {
    const auto g = b.half(n, DType::fp16);
    b.cpu->sgd_step(w.c, mom.c, g.c, DType::fp16, out.c, DType::fp16, 0.1f, 0.9f, 0.01f, 0.5f, n);
    b.gpu->sgd_step(w.g, mom.g, g.g, DType::fp16, out.g, DType::fp16, 0.1f, 0.9f, 0.01f, 0.5f, n);
  }
  CHECK(b.identical(w));
  CHECK(b.identical(mom));
  CHECK(b.identical(out));
}

TEST_CASE("cuda arena: tagged high-water marks as on the cpu backend; copies across tiers") {
  DeviceConfig dc;
  dc.gpu_bytes = 1 << 20;
  dc.cpu_bytes = 1 << 20;
  auto dev = make_cuda_device(dc);
  Arena& gpu = dev->arena(Tier::gpu);
  Arena& cpu = dev->arena(Tier::cpu);
  void* a = gpu.alloc(1000, Category::params, "a");
  void* p = cpu.alloc(4096, Category::optimizer, "pinned");
  CHECK(gpu.in_use(Category::params) == 1024);  // rounded to the 256-byte arena alignment
  CHECK(dev->measured()[Tier::cpu][Category::optimizer] == 4096);
  // host -> device -> pinned host -> host, through Device::copy.
  std::vector<float> h(250), back(250, 0.0f);
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<float>(i) * 0.5f;
  dev->copy(a, h.data(), 1000);
  dev->copy(p, a, 1000);
  dev->copy(back.data(), p, 1000);
  CHECK(back == h);
  dev->zero(a, 1000);
  dev->copy(back.data(), a, 1000);
  CHECK(back == std::vector<float>(250, 0.0f));
  gpu.free(a);
  cpu.free(p);
  CHECK(gpu.in_use() == 0);
  CHECK(gpu.peak_in_use() == 1024);
  const CudaMemoryInfo m = cuda_memory_info(*dev);
  CHECK(m.arena_bytes == dc.gpu_bytes);
  CHECK(m.total_bytes > m.free_now_bytes);
}

// ---- fp16 and bf16 storage ----------------------------------------------------------------------
// Each op on the same 16-bit inputs and prefilled outputs on both devices (fresh inputs per op,
// so one op's differences do not feed the next). Both devices round each output once from an
// fp32 result. Where the fp32 results can differ (warp-tree sums against loops, tensor-core
// GEMMs against the cpu's SGEMM panels, libm's last bit in expf and tanhf) the stored values
// differ by at most one spacing of the type, 2u |x| with u = 2^-8 (bf16) or 2^-11 (fp16):
// max|gpu - cpu| <= 2u max|cpu| (kOneRounding). Masks, one-product and one-sum elementwise
// results, and the embedding's owner sums (the same order on both sides) are the same bits.
namespace {

constexpr DType kHalfTypes[] = {DType::fp16, DType::bf16};
constexpr double kOneRounding = 2.0;  // in units of u

double unit_roundoff(DType t) { return t == DType::bf16 ? 0x1.0p-8 : 0x1.0p-11; }

// max|gpu - cpu| / max|cpu| over a 16-bit tensor, in units of the type's u.
double half_err_u(Both& b, const Pair<uint16_t>& p, DType t) {
  const std::vector<uint16_t> c = b.get(*b.cpu, p.c, p.n), g = b.get(*b.gpu, p.g, p.n);
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < p.n; ++i) {
    const double x = load_as_f32(c.data(), i, t), y = load_as_f32(g.data(), i, t);
    if (std::isnan(x) != std::isnan(y)) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::fabs(y - x));
    ref = std::max(ref, std::fabs(x));
  }
  return (ref > 0 ? diff / ref : diff) / unit_roundoff(t);
}

#define CHECK_HALF(both, pair, t, tol_u)               \
  do {                                                 \
    const double e_ = half_err_u((both), (pair), (t)); \
    CAPTURE(e_);                                       \
    CHECK(e_ <= (tol_u));                              \
  } while (0)

}  // namespace

TEST_CASE("cuda 16-bit embedding, layernorm, gelu, residual, dropout: as the cpu backend") {
  Both b;
  for (DType t : kHalfTypes) {
    CAPTURE(to_string(t));
    const auto tokens = b.ints(N, 7);  // a small vocabulary: tokens repeat
    const int64_t V7 = 7;
    const auto wte = b.half(V7 * C, t), wpe = b.half(T * C, t);
    auto out = b.half(N * C, t);
    b.cpu->embedding_forward(out.c, tokens.c, wte.c, wpe.c, t, B, T, C);
    b.gpu->embedding_forward(out.g, tokens.g, wte.g, wpe.g, t, B, T, C);
    CHECK(b.identical(out));
    auto dwte = b.half(V7 * C, t), dwpe = b.half(T * C, t);
    const auto dout = b.half(N * C, t);
    b.cpu->embedding_backward(dwte.c, dwpe.c, dout.c, tokens.c, t, B, T, C);
    b.gpu->embedding_backward(dwte.g, dwpe.g, dout.g, tokens.g, t, B, T, C);
    CHECK(b.identical(dwte));  // each row summed by its first position, ascending, on both
    CHECK(b.identical(dwpe));

    const auto x = b.half(N * C, t, 3.0f), w = b.half(C, t), bias = b.half(C, t);
    auto y = b.half(N * C, t);
    auto stats = b.rand(2 * N);
    b.cpu->layernorm_forward(y.c, stats.c, x.c, w.c, bias.c, t, N, C);
    b.gpu->layernorm_forward(y.g, stats.g, x.g, w.g, bias.g, t, N, C);
    CHECK_HALF(b, y, t, kOneRounding);
    CHECK_CLOSE(b, stats, kReorder);
    auto dx = b.half(N * C, t), dw = b.half(C, t), db = b.half(C, t);
    const auto dy = b.half(N * C, t);
    const auto same_stats = b.put(b.get(*b.cpu, stats.c, stats.n));  // both read the cpu's
    b.cpu->layernorm_backward(dx.c, dw.c, db.c, dy.c, x.c, w.c, same_stats.c, t, N, C);
    b.gpu->layernorm_backward(dx.g, dw.g, db.g, dy.g, x.g, w.g, same_stats.g, t, N, C);
    CHECK_HALF(b, dx, t, kOneRounding);
    CHECK_HALF(b, dw, t, kOneRounding);
    CHECK_HALF(b, db, t, kOneRounding);

    for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{100003}}) {
      CAPTURE(n);
      const auto ni = static_cast<int64_t>(n);
      const auto a = b.half(n, t, 3.0f), c = b.half(n, t);
      auto o = b.half(n, t);
      b.cpu->gelu_forward(o.c, a.c, t, ni);
      b.gpu->gelu_forward(o.g, a.g, t, ni);
      CHECK_HALF(b, o, t, kOneRounding);  // tanhf's last bit
      b.cpu->gelu_backward(o.c, a.c, c.c, t, ni);
      b.gpu->gelu_backward(o.g, a.g, c.g, t, ni);
      CHECK_HALF(b, o, t, kOneRounding);
      b.cpu->residual_forward(o.c, a.c, c.c, t, ni);
      b.gpu->residual_forward(o.g, a.g, c.g, t, ni);
      CHECK(b.identical(o));
      // Dropout: kernel_math.hpp's counter-based masks, the same bits on both devices.
      std::vector<uint8_t> zeros(n, 0);
      auto mask = b.put(zeros);
      b.cpu->dropout_forward(o.c, mask.c, a.c, t, 0.1f, 12345, ni);
      b.gpu->dropout_forward(o.g, mask.g, a.g, t, 0.1f, 12345, ni);
      CHECK(b.identical(mask));
      CHECK(b.identical(o));
      b.cpu->dropout_backward(o.c, o.c, mask.c, t, 0.1f, ni);  // in place, as the engine
      b.gpu->dropout_backward(o.g, o.g, mask.g, t, 0.1f, ni);
      CHECK(b.identical(o));
    }
  }
}

TEST_CASE("cuda 16-bit matmul (cublasGemmEx, fp32 accumulation) equals the cpu backend's panels") {
  Both b;
  struct Shape {
    int64_t n, c, oc;
  };
  // Below a tile, and beyond the cpu's 256-wide panels in every dimension; none a multiple of 16.
  for (const Shape sh : {Shape{N, C, OC}, Shape{300, 513, 270}})
    for (DType t : kHalfTypes)
      for (bool with_bias : {true, false}) {
        CAPTURE(sh.n);
        CAPTURE(to_string(t));
        CAPTURE(with_bias);
        const auto inp = b.half(sh.n * sh.c, t), w = b.half(sh.oc * sh.c, t, 0.1f),
                   bias = b.half(sh.oc, t);
        auto out = b.half(sh.n * sh.oc, t);
        b.cpu->matmul_forward(out.c, t, inp.c, w.c, with_bias ? bias.c : nullptr, t, sh.n, sh.c, sh.oc);
        b.gpu->matmul_forward(out.g, t, inp.g, w.g, with_bias ? bias.g : nullptr, t, sh.n, sh.c, sh.oc);
        CHECK_HALF(b, out, t, kOneRounding);
        auto logits = b.rand(sh.n * sh.oc);  // the LM head: 16-bit inputs, fp32 logits
        b.cpu->matmul_forward(logits.c, DType::fp32, inp.c, w.c, with_bias ? bias.c : nullptr, t,
                              sh.n, sh.c, sh.oc);
        b.gpu->matmul_forward(logits.g, DType::fp32, inp.g, w.g, with_bias ? bias.g : nullptr, t,
                              sh.n, sh.c, sh.oc);
        CHECK_CLOSE(b, logits, kReorder);
        auto dinp = b.half(sh.n * sh.c, t), dw = b.half(sh.oc * sh.c, t), db = b.half(sh.oc, t);
        const auto dout = b.half(sh.n * sh.oc, t);
        b.cpu->matmul_backward(dinp.c, dw.c, with_bias ? db.c : nullptr, dout.c, inp.c, w.c, t,
                               sh.n, sh.c, sh.oc);
        b.gpu->matmul_backward(dinp.g, dw.g, with_bias ? db.g : nullptr, dout.g, inp.g, w.g, t,
                               sh.n, sh.c, sh.oc);
        CHECK_HALF(b, dinp, t, kOneRounding);
        CHECK_HALF(b, dw, t, kOneRounding);
        if (with_bias) CHECK_HALF(b, db, t, kOneRounding);
        else CHECK(b.identical(db));  // untouched
      }
}

TEST_CASE("cuda 16-bit attention steps and the 16-bit logits gradient equal the cpu backend") {
  Both b;
  const int64_t A = B * NH * T * T;
  for (DType t : kHalfTypes) {
    CAPTURE(to_string(t));
    const auto qkv = b.half(N * 3 * C, t);
    auto preatt = b.half(A, t);
    b.cpu->attention_scores(preatt.c, qkv.c, t, B, T, C, NH);
    b.gpu->attention_scores(preatt.g, qkv.g, t, B, T, C, NH);
    b.zero_upper(preatt, T);
    CHECK_HALF(b, preatt, t, kOneRounding);
    const auto scores = b.half(A, t, 2.0f);
    auto att = b.half(A, t);
    b.cpu->attention_softmax(att.c, scores.c, t, B, NH, T);
    b.gpu->attention_softmax(att.g, scores.g, t, B, NH, T);
    CHECK_HALF(b, att, t, kOneRounding);
    const auto probs = b.half(A, t, 0.1f);
    b.zero_upper(probs, T);  // causal, as softmax leaves it
    auto out = b.half(N * C, t);
    b.cpu->attention_values(out.c, probs.c, qkv.c, t, B, T, C, NH);
    b.gpu->attention_values(out.g, probs.g, qkv.g, t, B, T, C, NH);
    CHECK_HALF(b, out, t, kOneRounding);

    const auto dout = b.half(N * C, t);
    auto datt = b.half(A, t), dqkv = b.half(N * 3 * C, t);
    b.cpu->attention_values_backward(datt.c, dqkv.c, dout.c, probs.c, qkv.c, t, B, T, C, NH);
    b.gpu->attention_values_backward(datt.g, dqkv.g, dout.g, probs.g, qkv.g, t, B, T, C, NH);
    b.zero_upper(datt, T);
    CHECK_HALF(b, datt, t, kOneRounding);
    CHECK_HALF(b, dqkv, t, kOneRounding);
    auto dsm = b.half(A, t);  // in place, as the engine runs it
    b.cpu->attention_softmax_backward(dsm.c, dsm.c, probs.c, t, B, NH, T);
    b.gpu->attention_softmax_backward(dsm.g, dsm.g, probs.g, t, B, NH, T);
    CHECK_HALF(b, dsm, t, kOneRounding);
    const auto dpre = b.half(A, t);
    b.zero_upper(dpre, T);  // as softmax's backward leaves it
    auto dqkv2 = b.half(N * 3 * C, t);
    b.cpu->attention_scores_backward(dqkv2.c, dpre.c, qkv.c, t, B, T, C, NH);
    b.gpu->attention_scores_backward(dqkv2.g, dpre.g, qkv.g, t, B, T, C, NH);
    CHECK_HALF(b, dqkv2, t, kOneRounding);

    // fp32 probabilities (the same on both sides), a 16-bit gradient of the logits.
    std::vector<float> p(static_cast<std::size_t>(N * V));
    for (float& x : p) x = std::fabs(b.normal(1)[0]);
    const auto pr = b.put(p);
    const auto targets = b.ints(N, V);
    auto dlogits = b.half(N * V, t);
    b.cpu->crossentropy_backward(dlogits.c, t, pr.c, targets.c, 0.25f, N, V);
    b.gpu->crossentropy_backward(dlogits.g, t, pr.g, targets.g, 0.25f, N, V);
    CHECK(b.identical(dlogits));
  }
}

TEST_CASE("cuda add_f32 writes a device segment into the pinned host tier, as the cpu backend") {
  Both b;
  for (DType t : {DType::fp32, DType::bf16, DType::fp16}) {
    CAPTURE(static_cast<int>(t));
    const std::size_t n = 70'001;
    const std::vector<float> base = b.normal(n);
    // The destination in the host tier (an offloaded fp32 gradient partition), the source a
    // device buffer: the GPU's kernel writes host memory over PCIe.
    auto* hc = static_cast<float*>(b.cpu->arena(Tier::cpu).alloc(n * 4, Category::grads, "c"));
    auto* hg = static_cast<float*>(b.gpu->arena(Tier::cpu).alloc(n * 4, Category::grads, "g"));
    std::memcpy(hc, base.data(), n * 4);
    std::memcpy(hg, base.data(), n * 4);
    const std::vector<float> f = b.normal(n);
    std::vector<uint16_t> h16(n);
    if (t != DType::fp32)
      for (std::size_t i = 0; i < n; ++i) store_from_f32(h16.data(), i, t, f[i]);
    const void* src_c = nullptr;
    const void* src_g = nullptr;
    if (t == DType::fp32) {
      const Pair<float> p = b.put(f);
      src_c = p.c;
      src_g = p.g;
    } else {
      const Pair<uint16_t> p = b.put(h16);
      src_c = p.c;
      src_g = p.g;
    }
    b.cpu->add_f32(hc, src_c, t, static_cast<int64_t>(n));
    b.gpu->add_f32(hg, src_g, t, static_cast<int64_t>(n));
    b.gpu->synchronize();  // the host reads what the kernel wrote
    CHECK(std::memcmp(hc, hg, n * 4) == 0);  // one fp32 addition per element on both
    b.cpu->arena(Tier::cpu).free(hc);
    b.gpu->arena(Tier::cpu).free(hg);
  }
}

TEST_CASE("cuda copy_to_device_async: wait_copy delivers the bytes of the issue, into either tier") {
  Both b;
  const std::size_t n = 1 << 20;  // 4 MiB: long enough that a late copy would show
  std::vector<float> first(n), second(n);
  for (std::size_t i = 0; i < n; ++i) {
    first[i] = static_cast<float>(i);
    second[i] = -1.0f;
  }
  auto* tile = static_cast<float*>(b.gpu->arena(Tier::cpu).alloc(n * 4, Category::buffers, "tile"));
  for (Tier dst_tier : {Tier::gpu, Tier::cpu}) {  // cpu: the parameters of offload_param cpu
    CAPTURE(zp::planner::to_string(dst_tier));
    auto* dst = static_cast<float*>(b.gpu->arena(dst_tier).alloc(n * 4, Category::params, "dst"));
    for (int slot = 0; slot < Device::kCopySlots; ++slot) {
      CAPTURE(slot);
      b.gpu->zero(dst, n * 4);
      std::memcpy(tile, first.data(), n * 4);
      b.gpu->copy_to_device_async(dst, tile, n * 4, slot);
      b.gpu->wait_copy(slot);
      std::memcpy(tile, second.data(), n * 4);  // the tile is free again once waited for
      std::vector<float> got(n);
      b.gpu->copy(got.data(), dst, n * 4);
      CHECK(std::memcmp(got.data(), first.data(), n * 4) == 0);
    }
    b.gpu->arena(dst_tier).free(dst);
  }
  b.gpu->arena(Tier::cpu).free(tile);
}

TEST_CASE("cuda sums are deterministic (two passes, no atomics) and equal the double sum") {
  Both b;
  const std::size_t n = 3'000'017;  // more blocks than the first pass's 1024
  const std::vector<float> v = b.normal(n);
  const Pair<float> p = b.put(v);
  double want = 0, want_sq = 0, sum_abs = 0;
  for (float x : v) {
    want += x;
    want_sq += static_cast<double>(x) * x;
    sum_abs += std::fabs(x);
  }
  const double s1 = b.gpu->sum(p.g, static_cast<int64_t>(n));
  const double s2 = b.gpu->sum(p.g, static_cast<int64_t>(n));
  CHECK(std::memcmp(&s1, &s2, sizeof(double)) == 0);
  CHECK(std::fabs(s1 - want) <= 1e-12 * sum_abs);  // double sums of 3e6 floats, reordered
  const GradSumSquares q1 = b.gpu->grad_sum_squares(p.g, DType::fp32, n);
  const GradSumSquares q2 = b.gpu->grad_sum_squares(p.g, DType::fp32, n);
  CHECK(std::memcmp(&q1.sum_sq, &q2.sum_sq, sizeof(double)) == 0);
  CHECK(std::fabs(q1.sum_sq - want_sq) <= 1e-12 * want_sq);
  CHECK(q1.finite);
  CHECK(b.gpu->sum(p.g, 0) == 0.0);
}

TEST_CASE("cuda loss_accumulate / loss_take: the host's sum of sum()s, bit for bit, one wait") {
  Both b;
  const std::vector<Pair<float>> parts = {b.rand(4097), b.rand(70'000), b.rand(1)};
  double want = 0;
  for (const auto& p : parts) want += b.gpu->sum(p.g, static_cast<int64_t>(p.n));
  for (const auto& p : parts) b.gpu->loss_accumulate(p.g, static_cast<int64_t>(p.n));
  const double got = b.gpu->loss_take();
  CHECK(std::memcmp(&got, &want, sizeof(double)) == 0);
  CHECK(b.gpu->loss_take() == 0.0);  // a new total
}

TEST_CASE("cuda upload: lands after the kernels queued before it, the source free at once") {
  Both b;
  const std::size_t n = 1 << 20;
  const Pair<float> x = b.rand(n), y = b.rand(n), out = b.rand(n);
  std::vector<float> host = b.normal(n);
  const std::vector<float> sent = host;
  for (int round = 0; round < 6; ++round) {  // more rounds than staging blocks
    CAPTURE(round);
    b.gpu->residual_forward(out.g, x.g, y.g, DType::fp32, static_cast<int64_t>(n));  // queued
    b.gpu->upload(out.g, host.data(), n * 4);
    std::fill(host.begin(), host.end(), -7.0f);  // reused before the copy could have run
    const std::vector<float> got = b.get(*b.gpu, out.g, n);
    CHECK(std::memcmp(got.data(), sent.data(), n * 4) == 0);
    host = sent;
  }
}

TEST_CASE("cuda 16-bit LLaMA-family blocks, flash attention and MoE equal the cpu backend's 16-bit kernels") {
  // The cpu's 16-bit kernels (test_cpu_kernels16 holds each to its fp32 kernel rounded once)
  // against the GPU's, within one rounding of the type. Two documented differences: a shared
  // key/value head's gradient in the three-step attention is added by G GEMMs (one per query
  // head of its group), each rounding, and the dispatch's backward adds slot by slot (K
  // roundings), where the cpu sums in fp32 and rounds once: bounds of G and K roundings.
  Both b;
  const int64_t Cl = 72, F = 37, G = LNH / LKVH, O = LNH * LHS;
  for (DType t : kHalfTypes) {
    CAPTURE(to_string(t));
    const auto x = b.half(N * Cl, t, 2.0f), w = b.half(Cl, t);
    auto y = b.half(N * Cl, t);
    auto stats = b.rand(N);
    b.cpu->rmsnorm_forward(y.c, stats.c, x.c, w.c, 1e-6f, t, N, Cl);
    b.gpu->rmsnorm_forward(y.g, stats.g, x.g, w.g, 1e-6f, t, N, Cl);
    CHECK_HALF(b, y, t, kOneRounding);
    CHECK_CLOSE(b, stats, kReorder);
    const auto rs = b.put(b.get(*b.cpu, stats.c, stats.n));
    auto dx = b.half(N * Cl, t), dw = b.half(Cl, t);
    const auto dy = b.half(N * Cl, t);
    b.cpu->rmsnorm_backward(dx.c, dw.c, dy.c, x.c, w.c, rs.c, t, N, Cl);
    b.gpu->rmsnorm_backward(dx.g, dw.g, dy.g, x.g, w.g, rs.g, t, N, Cl);
    CHECK_HALF(b, dx, t, kOneRounding);
    CHECK_HALF(b, dw, t, kOneRounding);

    const auto qkv = b.half(N * LR, t);
    const int64_t eb = 2;
    auto fused = [&](const Pair<uint16_t>& p, bool gpu) {
      const auto* base = reinterpret_cast<const std::byte*>(gpu ? p.g : p.c);
      return Device::QkvIn{base, base + LNH * LHS * eb, base + (LNH + LKVH) * LHS * eb, LR, LR, LR};
    };
    const Device::Heads h{LNH, LKVH, LHS, 0};
    const auto hw = b.half(2 * LHS, t);
    auto qk = b.half(N * (LNH + LKVH) * LHS, t);
    auto hstats = b.rand(N * (LNH + LKVH));
    b.cpu->head_rmsnorm_forward(qk.c, hstats.c, fused(qkv, false), hw.c, 1e-6f, t, N, h);
    b.gpu->head_rmsnorm_forward(qk.g, hstats.g, fused(qkv, true), hw.g, 1e-6f, t, N, h);
    CHECK_HALF(b, qk, t, kOneRounding);
    const auto hs = b.put(b.get(*b.cpu, hstats.c, hstats.n));
    auto dqkv = b.half(N * LR, t), dhw = b.half(2 * LHS, t);
    b.cpu->head_rmsnorm_backward(dqkv.c, dhw.c, fused(qkv, false), hw.c, hs.c, t, N, h);
    b.gpu->head_rmsnorm_backward(dqkv.g, dhw.g, fused(qkv, true), hw.g, hs.g, t, N, h);
    CHECK_HALF(b, dqkv, t, kOneRounding);
    CHECK_HALF(b, dhw, t, kOneRounding);

    const int64_t rot = 24;
    std::vector<float> inv_freq(rot / 2);
    for (int64_t i = 0; i < rot / 2; ++i)
      inv_freq[static_cast<std::size_t>(i)] = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / rot);
    auto r = b.half(N * LR, t);
    b.cpu->rope_forward(r.c, inv_freq.data(), 1.1f, t, B, T, LR, LNH + LKVH, LHS, rot);
    b.gpu->rope_forward(r.g, inv_freq.data(), 1.1f, t, B, T, LR, LNH + LKVH, LHS, rot);
    CHECK_HALF(b, r, t, kOneRounding);
    b.cpu->rope_backward(r.c, inv_freq.data(), 1.1f, t, B, T, LR, LNH + LKVH, LHS, rot);
    b.gpu->rope_backward(r.g, inv_freq.data(), 1.1f, t, B, T, LR, LNH + LKVH, LHS, rot);
    CHECK_HALF(b, r, t, kOneRounding);

    const auto gate = b.half(N * F, t, 3.0f), up = b.half(N * F, t), go = b.half(N * F, t);
    auto act = b.half(N * F, t), dgu = b.half(N * 2 * F, t);
    b.cpu->swiglu_forward(act.c, gate.c, up.c, t, N * F);
    b.gpu->swiglu_forward(act.g, gate.g, up.g, t, N * F);
    CHECK_HALF(b, act, t, kOneRounding);
    b.cpu->swiglu_backward(dgu.c, go.c, gate.c, up.c, t, N, F);
    b.gpu->swiglu_backward(dgu.g, go.g, gate.g, up.g, t, N, F);
    CHECK_HALF(b, dgu, t, kOneRounding);
    const auto gl = b.half(N, t, 2.0f);
    auto gm = b.half(N * F, t), gdx = b.half(N * F, t), gdg = b.half(N, t);
    b.cpu->gate_mul_forward(gm.c, up.c, gl.c, t, N, F);
    b.gpu->gate_mul_forward(gm.g, up.g, gl.g, t, N, F);
    CHECK_HALF(b, gm, t, kOneRounding);
    b.cpu->gate_mul_backward(gdx.c, gdg.c, go.c, up.c, gl.c, t, N, F);
    b.gpu->gate_mul_backward(gdx.g, gdg.g, go.g, up.g, gl.g, t, N, F);
    CHECK_HALF(b, gdx, t, kOneRounding);
    CHECK_HALF(b, gdg, t, kOneRounding);

    // Grouped-query attention, window 5; each op on fresh inputs.
    const int64_t A = B * LNH * T * T;
    for (int64_t window : {int64_t{0}, int64_t{5}}) {
      CAPTURE(window);
      const Device::Heads hw5{LNH, LKVH, LHS, window};
      auto preatt = b.half(A, t);
      b.cpu->gqa_scores(preatt.c, fused(qkv, false), t, B, T, hw5);
      b.gpu->gqa_scores(preatt.g, fused(qkv, true), t, B, T, hw5);
      b.zero_outside(preatt, T, window);
      CHECK_HALF(b, preatt, t, kOneRounding);
      const auto scores = b.half(A, t, 2.0f);
      auto att = b.half(A, t);
      b.cpu->gqa_softmax(att.c, scores.c, t, B, T, hw5);
      b.gpu->gqa_softmax(att.g, scores.g, t, B, T, hw5);
      CHECK_HALF(b, att, t, kOneRounding);
      const auto probs = b.half(A, t, 0.1f);
      b.zero_outside(probs, T, window);  // as the softmax leaves it
      auto out = b.half(N * O, t);
      b.cpu->gqa_values(out.c, probs.c, fused(qkv, false), t, B, T, hw5);
      b.gpu->gqa_values(out.g, probs.g, fused(qkv, true), t, B, T, hw5);
      CHECK_HALF(b, out, t, kOneRounding);
      const auto dout = b.half(N * O, t);
      auto datt = b.half(A, t), dq = b.half(N * LR, t);
      b.cpu->gqa_values_backward(datt.c, dq.c, dout.c, probs.c, fused(qkv, false), t, B, T, hw5);
      b.gpu->gqa_values_backward(datt.g, dq.g, dout.g, probs.g, fused(qkv, true), t, B, T, hw5);
      b.zero_outside(datt, T, window);
      CHECK_HALF(b, datt, t, kOneRounding);
      CHECK_HALF(b, dq, t, G * kOneRounding);  // dv: G roundings on the GPU
      auto dsm = b.half(A, t);
      b.cpu->gqa_softmax_backward(dsm.c, dsm.c, probs.c, t, B, T, hw5);
      b.gpu->gqa_softmax_backward(dsm.g, dsm.g, probs.g, t, B, T, hw5);
      CHECK_HALF(b, dsm, t, kOneRounding);
      const auto dpre = b.half(A, t);
      b.zero_outside(dpre, T, window);
      auto dq2 = b.half(N * LR, t);
      b.cpu->gqa_scores_backward(dq2.c, dpre.c, fused(qkv, false), t, B, T, hw5);
      b.gpu->gqa_scores_backward(dq2.g, dpre.g, fused(qkv, true), t, B, T, hw5);
      CHECK_HALF(b, dq2, t, G * kOneRounding);  // dk: G roundings on the GPU
    }

    // Flash attention, 70 queries, window 20, dropout 0.1.
    const int64_t Tf = 70, Nf = B * Tf;
    const Device::Heads hf{LNH, LKVH, LHS, 20};
    const auto fq = b.half(Nf * LR, t);
    auto fo = b.half(Nf * O, t);
    auto lse = b.rand(B * LNH * Tf);
    b.cpu->flash_attention_forward(fo.c, lse.c, fused(fq, false), t, B, Tf, hf, 0.1f, 99);
    b.gpu->flash_attention_forward(fo.g, lse.g, fused(fq, true), t, B, Tf, hf, 0.1f, 99);
    CHECK_HALF(b, fo, t, kOneRounding);
    CHECK_CLOSE(b, lse, kReorder);
    const auto same_o = b.put(b.get(*b.cpu, fo.c, fo.n));
    const auto same_l = b.put(b.get(*b.cpu, lse.c, lse.n));
    const auto fdo = b.half(Nf * O, t);
    auto fdq = b.half(Nf * LR, t);
    auto acc = b.rand(Nf * O), dsum = b.rand(B * LNH * Tf);
    b.cpu->flash_attention_backward(fdq.c, acc.c, dsum.c, fdo.c, fused(fq, false), same_o.c, same_l.c,
                                    t, B, Tf, hf, 0.1f, 99);
    b.gpu->flash_attention_backward(fdq.g, acc.g, dsum.g, fdo.g, fused(fq, true), same_o.g, same_l.g,
                                    t, B, Tf, hf, 0.1f, 99);
    CHECK_HALF(b, fdq, t, kOneRounding);

    // MoE: 300 tokens, 40 experts, top 3.
    const int64_t Nm = 300, E = 40, K = 3, Cm = 24;
    const auto logits = b.half(Nm * E, t, 2.0f);
    auto probs = b.rand(Nm * E), wts = b.rand(Nm * K);
    std::vector<int32_t> zero_idx(static_cast<std::size_t>(Nm * K), 0);
    auto idx = b.put(zero_idx);
    b.cpu->moe_route_forward(probs.c, ExpertIdx(idx.c), wts.c, logits.c, t, Nm, E, K, true);
    b.gpu->moe_route_forward(probs.g, ExpertIdx(idx.g), wts.g, logits.g, t, Nm, E, K, true);
    CHECK_CLOSE(b, probs, kReorder);
    CHECK(b.identical(idx));
    CHECK_CLOSE(b, wts, kReorder);
    const auto pr = b.put(b.get(*b.cpu, probs.c, probs.n));
    const auto ix = b.put(b.get(*b.cpu, idx.c, idx.n));
    const auto wt = b.put(b.get(*b.cpu, wts.c, wts.n));
    const auto dwr = b.rand(Nm * K);
    auto dl = b.half(Nm * E, t);
    b.cpu->moe_route_backward(dl.c, t, dwr.c, pr.c, ExpertIdx(ix.c), nullptr, Nm, E, K, true);
    b.gpu->moe_route_backward(dl.g, t, dwr.g, pr.g, ExpertIdx(ix.g), nullptr, Nm, E, K, true);
    CHECK_HALF(b, dl, t, kOneRounding);
    const auto in = b.half(Nm * Cm, t);
    auto xe = b.half(Nm * K * Cm, t);
    b.cpu->moe_dispatch(xe.c, in.c, ExpertIdx(ix.c), t, Nm, K, E, Cm);
    b.gpu->moe_dispatch(xe.g, in.g, ExpertIdx(ix.g), t, Nm, K, E, Cm);
    CHECK(b.identical(xe));
    const auto ye = b.half(Nm * K * Cm, t);
    auto mo = b.half(Nm * Cm, t);
    b.cpu->moe_combine(mo.c, ye.c, wt.c, ExpertIdx(ix.c), t, Nm, K, E, Cm);
    b.gpu->moe_combine(mo.g, ye.g, wt.g, ExpertIdx(ix.g), t, Nm, K, E, Cm);
    CHECK(b.identical(mo));  // the same fp32 sum in slot order, rounded once on both
    const auto mdo = b.half(Nm * Cm, t);
    auto dye = b.half(Nm * K * Cm, t);
    auto dwts = b.rand(Nm * K);
    b.cpu->moe_combine_backward(dye.c, dwts.c, mdo.c, ye.c, wt.c, ExpertIdx(ix.c), t, Nm, K, E, Cm);
    b.gpu->moe_combine_backward(dye.g, dwts.g, mdo.g, ye.g, wt.g, ExpertIdx(ix.g), t, Nm, K, E, Cm);
    CHECK(b.identical(dye));
    CHECK_CLOSE(b, dwts, kReorder);
    auto din = b.half(Nm * Cm, t);
    b.cpu->moe_dispatch_backward(din.c, xe.c, ExpertIdx(ix.c), t, Nm, K, E, Cm);
    b.gpu->moe_dispatch_backward(din.g, xe.g, ExpertIdx(ix.g), t, Nm, K, E, Cm);
    CHECK_HALF(b, din, t, K * kOneRounding);  // K roundings on the GPU
  }
}
