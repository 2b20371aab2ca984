// cpu_flash.cpp: flash attention on the CPU backend (cpu_kernels.hpp states the contract).
// FlashAttention-2 (Dao 2023, algorithms 1 and 2) as blocked loops: a block of kBq queries of
// one head against the key blocks it can see, with an online softmax (Milakov & Gimelshein
// 2018), so nothing T x T is ever held; the backward recomputes each block's probabilities
// from the saved log-sum-exp. The blocks' scores live in two small stack tiles per thread:
// the only memory beyond the tensors the planner gives the op (out, lse; dq_acc and dsum).
// 16-bit storage (fp16, bf16) runs the same fp32 arithmetic on rows converted block by block
// into per-thread fp32 tiles (q, k, v, dout; the running output; the block's dk and dv), each
// output stored once: kernel scratch of a few blocks of rows, as the score tiles are.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "cpu_vec.hpp"
#include "zp/error.hpp"
#include "zp/runtime/cpu_kernels.hpp"
#include "zp/runtime/kernel_math.hpp"

namespace zp::runtime::cpu {

namespace {

// Queries and keys per block: a key block's k and v rows (64 x HS floats each, 16 KiB at
// HS = 64) stay in L1/L2 while the query block's 64 rows pass over them.
constexpr int64_t kBq = 64;
constexpr int64_t kBk = 64;

using vec::add_st;
using vec::axpy;
using vec::dot;
using vec::ld;
using vec::st;

template <class Q>  // Qkv or QkvT
void check(const AttnShape& s, float p, const Q& in, std::string_view what) {
  if (s.B <= 0 || s.T <= 0 || s.NH <= 0 || s.KVH <= 0 || s.HS <= 0 || s.NH % s.KVH != 0 ||
      s.window < 0 || in.q == nullptr || in.k == nullptr || in.v == nullptr ||
      in.q_row < s.NH * s.HS || in.k_row < s.KVH * s.HS || in.v_row < s.KVH * s.HS)
    throw Error(
        fmt::format("cpu::{}: B {} T {}, {} query heads, {} key/value heads of {}, window {}, "
                    "q, k, v rows of {}, {}, {}",
                    what, s.B, s.T, s.NH, s.KVH, s.HS, s.window, in.q_row, in.k_row, in.v_row),
        "the query heads must be a positive multiple of the key/value heads, and each row "
        "must hold all of its heads");
  if (!(p >= 0.0f && p < 1.0f))
    throw Error(fmt::format("cpu::{}: dropout probability {} is outside [0, 1)", what, p),
                "attention dropout is a probability below 1");
}

// The keys query t sees: [first_key(t), t]. A key block [j0, j1) meets the query block
// [i0, i1) when some query t there sees some key here: t >= j0 and first_key(t) < j1, and
// first_key never decreases, so the first candidate, t = max(i0, j0), decides.
bool meets(const AttnShape& s, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
  const int64_t t = std::max(i0, j0);
  return t < i1 && s.first_key(t) < j1;
}

// The dropout factor of probability (b, h, t, t2): the three-step attention's mask element
// ((b NH + h) T + t) T + t2 (dropout_forward over the (B, NH, T, T) probabilities).
struct Drop {
  float p = 0.0f;
  uint64_t key = 0;
  uint32_t threshold = 0;
  float scale = 1.0f;
  Drop(float p_, uint64_t key_) : p(p_), key(key_) {
    if (p > 0.0f) {
      threshold = dropout_threshold(p);
      scale = dropout_scale(p);
    }
  }
  float factor(int64_t row, int64_t t2) const {
    return p == 0.0f ? 1.0f : dropout_keep(key, row + t2, threshold) ? scale : 0.0f;
  }
};

// n rows of HS values, from column col of rows first.. of a buffer stored as D (rows `row`
// elements apart), as fp32: fp32 storage read in place, 16-bit storage converted into `tile`
// (n x HS).
struct Rows {
  const float* p;
  int64_t stride;
  const float* operator[](int64_t i) const { return p + i * stride; }
};
template <DType D>
Rows rows_f32(const void* base, int64_t row, int64_t first, int64_t n, int64_t col, int64_t HS,
              float* tile) {
  if constexpr (D == DType::fp32) {
    return {static_cast<const float*>(base) + first * row + col, row};
  } else {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < HS; ++d) tile[i * HS + d] = ld<D>(base, (first + i) * row + col + d);
    return {tile, HS};
  }
}

template <DType D>
void flash_forward_t(void* out, float* lse, const QkvT& in, const AttnShape& s, float p,
                     uint64_t key) {
  check(s, p, in, "flash_attention_forward");
  const int64_t B = s.B, T = s.T, NH = s.NH, HS = s.HS, O = s.out_row(), G = s.group();
  const int64_t nq = (T + kBq - 1) / kBq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const float ninf = -std::numeric_limits<float>::infinity();
  const Drop drop(p, key);
#pragma omp parallel if (B * NH * T * T * HS > (1 << 15))
  {
    // 16-bit: the query block's q rows and running outputs, the key block's k and v rows.
    std::vector<float> tiles(D == DType::fp32 ? 0 : static_cast<std::size_t>(2 * (kBq + kBk) * HS));
    float* const q_tile = tiles.data();
    float* const o_tile = q_tile + (D == DType::fp32 ? 0 : kBq * HS);
    float* const k_tile = o_tile + (D == DType::fp32 ? 0 : kBq * HS);
    float* const v_tile = k_tile + (D == DType::fp32 ? 0 : kBk * HS);
#pragma omp for collapse(3) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t qb = 0; qb < nq; ++qb) {
          const int64_t i0 = qb * kBq, i1 = std::min(T, i0 + kBq), kv = h / G;
          float S[kBq * kBk];
          float m[kBq], l[kBq];
          std::fill(m, m + kBq, ninf);
          std::fill(l, l + kBq, 0.0f);
          const Rows Q = rows_f32<D>(in.q, in.q_row, b * T + i0, i1 - i0, h * HS, HS, q_tile);
          // The running output of query t: out's row (fp32), or the tile's.
          auto out_row = [&](int64_t t) {
            if constexpr (D == DType::fp32) return static_cast<float*>(out) + (b * T + t) * O + h * HS;
            else return o_tile + (t - i0) * HS;
          };
          for (int64_t t = i0; t < i1; ++t) std::fill_n(out_row(t), HS, 0.0f);
          for (int64_t j0 = s.first_key(i0) / kBk * kBk; j0 < i1; j0 += kBk) {
            const int64_t j1 = std::min(T, j0 + kBk);
            if (!meets(s, i0, i1, j0, j1)) continue;
            const Rows K = rows_f32<D>(in.k, in.k_row, b * T + j0, j1 - j0, kv * HS, HS, k_tile);
            const Rows V = rows_f32<D>(in.v, in.v_row, b * T + j0, j1 - j0, kv * HS, HS, v_tile);
            for (int64_t t = i0; t < i1; ++t) {
              float* srow = S + (t - i0) * kBk;
              const float* q = Q[t - i0];
              const int64_t lo = std::max(j0, s.first_key(t)), hi = std::min(j1, t + 1);
              if (lo >= hi) continue;
              // Scores, the row's new running max, and the rescaling of what came before.
              float mx = m[t - i0];
              for (int64_t t2 = lo; t2 < hi; ++t2) {
                srow[t2 - j0] = dot(q, K[t2 - j0], HS) * scale;
                mx = std::max(mx, srow[t2 - j0]);
              }
              const float corr = std::exp(m[t - i0] - mx);  // 0 on the row's first block
              float* o = out_row(t);
              if (corr != 1.0f)
                for (int64_t d = 0; d < HS; ++d) o[d] *= corr;
              float sum = 0.0f;
              const int64_t row = ((b * NH + h) * T + t) * T;
              for (int64_t t2 = lo; t2 < hi; ++t2) {
                const float e = std::exp(srow[t2 - j0] - mx);
                sum += e;
                const float pe = e * drop.factor(row, t2);
                if (pe != 0.0f) axpy(o, pe, V[t2 - j0], HS);
              }
              l[t - i0] = l[t - i0] * corr + sum;
              m[t - i0] = mx;
            }
          }
          for (int64_t t = i0; t < i1; ++t) {
            const float* o = out_row(t);
            const float inv = 1.0f / l[t - i0];
            for (int64_t d = 0; d < HS; ++d) st<D>(out, (b * T + t) * O + h * HS + d, o[d] * inv);
            lse[(b * NH + h) * T + t] = m[t - i0] + std::log(l[t - i0]);
          }
        }
  }
}

// Over (b, key/value head): the thread owns its key and value heads' gradients and its query
// heads' dq_acc rows, so nothing is shared and the sums' order is fixed (key blocks in
// order, the group's query heads in order, query blocks in order).
template <DType D>
void flash_backward_t(void* dqkv, float* dq_acc, float* dsum, const void* dout, const QkvT& in,
                      const void* out, const float* lse, const AttnShape& s, float p, uint64_t key) {
  check(s, p, in, "flash_attention_backward");
  // q, k and v read where `in` has them; dq, dk, dv written in the fused rows of R.
  const int64_t B = s.B, T = s.T, NH = s.NH, HS = s.HS, R = s.row(), O = s.out_row(), G = s.group();
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const Drop drop(p, key);
  constexpr bool k16 = D != DType::fp32;
  // D = rowsum(dO o O) per query (FlashAttention-2 alg. 2 line 4) and dq_acc = 0.
#pragma omp parallel if (B * T * NH * HS > (1 << 15))
  {
    std::vector<float> rows(k16 ? static_cast<std::size_t>(2 * HS) : 0);
#pragma omp for collapse(2)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < NH; ++h) {
          const int64_t r = (b * T + t) * O + h * HS;
          const Rows go = rows_f32<D>(dout, O, b * T + t, 1, h * HS, HS, rows.data());
          const Rows o = rows_f32<D>(out, O, b * T + t, 1, h * HS, HS, rows.data() + (k16 ? HS : 0));
          dsum[(b * NH + h) * T + t] = dot(go[0], o[0], HS);
          std::fill_n(dq_acc + r, HS, 0.0f);
        }
  }
#pragma omp parallel if (B * NH * T * T * HS > (1 << 15))
  {
    // 16-bit: the key block's k and v rows and its dk and dv sums, the query block's q and
    // dout rows.
    std::vector<float> tiles(k16 ? static_cast<std::size_t>((4 * kBk + 2 * kBq) * HS) : 0);
    const int64_t kt = k16 ? kBk * HS : 0, qt = k16 ? kBq * HS : 0;
    float* const k_tile = tiles.data();
    float* const v_tile = k_tile + kt;
    float* const dk_tile = v_tile + kt;
    float* const dv_tile = dk_tile + kt;
    float* const q_tile = dv_tile + kt;
    float* const g_tile = q_tile + qt;
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t kv = 0; kv < s.KVH; ++kv) {
        float P[kBq * kBk], dS[kBq * kBk];
        for (int64_t j0 = 0; j0 < T; j0 += kBk) {
          const int64_t j1 = std::min(T, j0 + kBk);
          const Rows K = rows_f32<D>(in.k, in.k_row, b * T + j0, j1 - j0, kv * HS, HS, k_tile);
          const Rows V = rows_f32<D>(in.v, in.v_row, b * T + j0, j1 - j0, kv * HS, HS, v_tile);
          // Key t2's dk and dv: dqkv's rows (fp32), or the tiles, added into dqkv after the block.
          auto dk_row = [&](int64_t t2) {
            if constexpr (k16) return dk_tile + (t2 - j0) * HS;
            else return static_cast<float*>(dqkv) + (b * T + t2) * R + s.k_off() + kv * HS;
          };
          auto dv_row = [&](int64_t t2) {
            if constexpr (k16) return dv_tile + (t2 - j0) * HS;
            else return static_cast<float*>(dqkv) + (b * T + t2) * R + s.v_off() + kv * HS;
          };
          if constexpr (k16) {
            std::fill_n(dk_tile, (j1 - j0) * HS, 0.0f);
            std::fill_n(dv_tile, (j1 - j0) * HS, 0.0f);
          }
          for (int64_t h = kv * G; h < (kv + 1) * G; ++h)
            for (int64_t i0 = j0 / kBq * kBq; i0 < T; i0 += kBq) {
              const int64_t i1 = std::min(T, i0 + kBq);
              if (!meets(s, i0, i1, j0, j1)) {
                if (s.first_key(i0) > j1 - 1) break;  // later query blocks see even later keys
                continue;
              }
              const Rows Q = rows_f32<D>(in.q, in.q_row, b * T + i0, i1 - i0, h * HS, HS, q_tile);
              const Rows GO = rows_f32<D>(dout, O, b * T + i0, i1 - i0, h * HS, HS, g_tile);
              for (int64_t t = i0; t < i1; ++t) {
                const int64_t lo = std::max(j0, s.first_key(t)), hi = std::min(j1, t + 1);
                if (lo >= hi) continue;
                const float* q = Q[t - i0];
                const float* go = GO[t - i0];
                const float L = lse[(b * NH + h) * T + t], Dt = dsum[(b * NH + h) * T + t];
                const int64_t row = ((b * NH + h) * T + t) * T;
                float* pt = P + (t - i0) * kBk;
                float* ds = dS + (t - i0) * kBk;
                for (int64_t t2 = lo; t2 < hi; ++t2) {
                  const float pr = std::exp(dot(q, K[t2 - j0], HS) * scale - L);
                  const float z = drop.factor(row, t2);
                  pt[t2 - j0] = pr * z;                                         // dV's weight
                  ds[t2 - j0] = pr * (dot(go, V[t2 - j0], HS) * z - Dt) * scale;  // dS, scaled
                }
                float* dq = dq_acc + (b * T + t) * O + h * HS;
                for (int64_t t2 = lo; t2 < hi; ++t2) axpy(dq, ds[t2 - j0], K[t2 - j0], HS);
              }
              // dV_j += P^T dO and dK_j += dS^T Q, key by key over the block's queries in order.
              for (int64_t t2 = j0; t2 < j1; ++t2) {
                float* dk = dk_row(t2);
                float* dv = dv_row(t2);
                for (int64_t t = std::max(i0, t2); t < i1; ++t) {
                  if (s.first_key(t) > t2) break;
                  const float pr = P[(t - i0) * kBk + (t2 - j0)];
                  const float d = dS[(t - i0) * kBk + (t2 - j0)];
                  if (pr != 0.0f) axpy(dv, pr, GO[t - i0], HS);
                  if (d != 0.0f) axpy(dk, d, Q[t - i0], HS);
                }
              }
            }
          if constexpr (k16)
            for (int64_t t2 = j0; t2 < j1; ++t2)
              for (int64_t d = 0; d < HS; ++d) {
                add_st<D>(dqkv, (b * T + t2) * R + s.k_off() + kv * HS + d, dk_tile[(t2 - j0) * HS + d]);
                add_st<D>(dqkv, (b * T + t2) * R + s.v_off() + kv * HS + d, dv_tile[(t2 - j0) * HS + d]);
              }
        }
      }
  }
  // dq (the q part of dqkv) += dq_acc.
#pragma omp parallel for collapse(2) if (B * T * NH * HS > (1 << 15))
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      if constexpr (k16)
        for (int64_t i = 0; i < NH * HS; ++i) add_st<D>(dqkv, (b * T + t) * R + i, dq_acc[(b * T + t) * O + i]);
      else
        axpy(static_cast<float*>(dqkv) + (b * T + t) * R, 1.0f, dq_acc + (b * T + t) * O, NH * HS);
    }
}

QkvT typed(const Qkv& in) { return {in.q, in.k, in.v, in.q_row, in.k_row, in.v_row}; }

}  // namespace

void flash_attention_forward(float* out, float* lse, const float* qkv, const AttnShape& s, float p,
                             uint64_t key) {
  flash_attention_forward(out, lse, Qkv::fused(qkv, s), s, p, key);
}
void flash_attention_forward(float* out, float* lse, const Qkv& in, const AttnShape& s, float p,
                             uint64_t key) {
  flash_forward_t<DType::fp32>(out, lse, typed(in), s, p, key);
}
void flash_attention_forward(void* out, float* lse, const QkvT& in, DType t, const AttnShape& s,
                             float p, uint64_t key) {
  dispatch_dtype(t, [&](auto d) { flash_forward_t<decltype(d)::value>(out, lse, in, s, p, key); });
}

void flash_attention_backward(float* dqkv, float* dq_acc, float* dsum, const float* dout,
                              const float* qkv, const float* out, const float* lse,
                              const AttnShape& s, float p, uint64_t key) {
  flash_attention_backward(dqkv, dq_acc, dsum, dout, Qkv::fused(qkv, s), out, lse, s, p, key);
}
void flash_attention_backward(float* dqkv, float* dq_acc, float* dsum, const float* dout,
                              const Qkv& in, const float* out, const float* lse, const AttnShape& s,
                              float p, uint64_t key) {
  flash_backward_t<DType::fp32>(dqkv, dq_acc, dsum, dout, typed(in), out, lse, s, p, key);
}
void flash_attention_backward(void* dqkv, float* dq_acc, float* dsum, const void* dout,
                              const QkvT& in, const void* out, const float* lse, DType t,
                              const AttnShape& s, float p, uint64_t key) {
  dispatch_dtype(t, [&](auto d) {
    flash_backward_t<decltype(d)::value>(dqkv, dq_acc, dsum, dout, in, out, lse, s, p, key);
  });
}

}  // namespace zp::runtime::cpu
