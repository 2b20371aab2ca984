// zp/runtime/cpu_kernels.hpp: the CPU backend's compute kernels for a GPT-2 step, in fp32
// arithmetic on caller-owned buffers (llm.c's layout and names), stored as fp32 or (the typed
// overloads) fp16/bf16. They never allocate: the engine hands them arena memory. Not the
// engine (which op runs when) and not the optimizer.
//
// Conventions: B batch, T sequence, C channels, NH heads, HS = C/NH, V vocab, N = B*T rows.
// Linear weights are (OC, C) row-major with out = inp @ W^T + bias (PyTorch nn.Linear, llm.c);
// a module's parameters are stored weight first, then bias. Every backward kernel ACCUMULATES
// (+=) into the gradients it writes, input gradients included; the engine zero-fills a
// gradient buffer when it allocates it. In-place use is allowed where a comment says so.
//
// Example usage (one linear layer):
//   zp::runtime::cpu::matmul_forward(out, inp, w, bias, N, C, OC);
//   zp::runtime::cpu::matmul_backward(dinp, dw, dbias, dout, inp, w, N, C, OC);
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "zp/runtime/dtype.hpp"

namespace zp::runtime::cpu {

// The number of threads OpenBLAS and the OpenMP loops use (1 when several ranks share the
// cores). Call once per process before the first kernel. n_threads < 1 throws zp::Error.
void set_threads(int n_threads);

// out (B,T,C) = wte[tokens] + wpe[t]; wpe may be null (no learned positions). Tokens must be
// in [0, V): not checked here (V is not an argument).
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                       int64_t B, int64_t T, int64_t C);
// dwte[tokens] += dout, dwpe[t] += dout (dwpe may be null).
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        int64_t B, int64_t T, int64_t C);

// LayerNorm over C with eps 1e-5; stats (N,2) holds mean and rstd per row, interleaved.
void layernorm_forward(float* out, float* stats, const float* inp, const float* weight,
                       const float* bias, int64_t N, int64_t C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* stats, int64_t N,
                        int64_t C);

// RMSNorm over C (LLaMA-family blocks): out = inp rstd (weight + w_offset), rstd =
// 1/sqrt(mean(inp^2) + eps); stats (N) holds rstd per row. w_offset: 1 for Gemma's (1 + w).
void rmsnorm_forward(float* out, float* stats, const float* inp, const float* weight,
                     float w_offset, float eps, int64_t N, int64_t C);
// dinp += the input gradient; dweight += sum_r dout xhat.
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, float w_offset, const float* stats, int64_t N,
                      int64_t C);

// ---- Mixture of experts (cpu_moe.cpp) ---------------------------------------------------------
// N tokens choose K of E experts. The dispatched rows (N K of them, dropless) are ordered by
// expert, then token, then slot: expert e's rows are [offsets[e], offsets[e + 1]). Every kernel
// checks the indices (zp::Error naming the first outside [0, E)) and E <= kMaxExperts.
inline constexpr int64_t kMaxExperts = 1024;
// offsets (E + 1): where each expert's rows start, and N K at the end.
void moe_expert_counts(ExpertIdx idx, int64_t N, int64_t K, int64_t E, int64_t* offsets);
// probs (N, E) = softmax(logits) in fp32; idx (N, K) the top K by probability (the lower index
// first among equals), weights (N, K) their probabilities, renormalised to sum 1 if asked
// (Mixtral; Qwen-MoE's norm_topk_prob). With idx.p and weights null, the probabilities alone
// (a recomputation that reads the top-k back from where the forward left it).
void moe_route_forward(float* probs, ExpertIdx idx, float* weights, const float* logits, int64_t N,
                       int64_t E, int64_t K, bool renormalize);
// dlogits (N, E), overwritten, from dweights (N, K) and, if not null, dprob_all (E): a gradient
// added to every token's probability of expert e (the load-balancing loss's).
void moe_route_backward(float* dlogits, const float* dweights, const float* probs, ExpertIdx idx,
                        const float* dprob_all, int64_t N, int64_t E, int64_t K, bool renormalize);
// xe (N K, C): row of (token n, slot k) = in[n].
void moe_dispatch(float* xe, const float* in, ExpertIdx idx, int64_t N, int64_t K, int64_t E,
                  int64_t C);
// din[n] += the sum of its K rows of dxe.
void moe_dispatch_backward(float* din, const float* dxe, ExpertIdx idx, int64_t N, int64_t K,
                           int64_t E, int64_t C);
// out[n] = sum_k weights[n, k] ye[row(n, k)] (overwrites).
void moe_combine(float* out, const float* ye, const float* weights, ExpertIdx idx, int64_t N,
                 int64_t K, int64_t E, int64_t C);
// dye[row(n, k)] = weights[n, k] dout[n]; dweights[n, k] = dout[n] . ye[row(n, k)] (overwrite).
void moe_combine_backward(float* dye, float* dweights, const float* dout, const float* ye,
                          const float* weights, ExpertIdx idx, int64_t N, int64_t K, int64_t E,
                          int64_t C);
// Qwen2-MoE's gated shared expert: out (N, C) = sigmoid(g[n]) x[n] (g one logit per token);
// backward: dx = sigmoid(g) dout, dg = (dout . x) sigmoid'(g), both overwritten.
void gate_mul_forward(float* out, const float* x, const float* g, int64_t N, int64_t C);
void gate_mul_backward(float* dx, float* dg, const float* dout, const float* x, const float* g,
                       int64_t N, int64_t C);

// Rotary embeddings, in place: each of the B*T rows (row elements apart) holds n_heads heads
// of HS values from its start (q's heads then k's in a fused q|k|v row); in each head the
// first `rot` dims turn in pairs (i, i + rot/2) by t inv_freq[i] (t = row index mod T) and
// are scaled by mscale (1, or YaRN's attention factor). The angle is the fp32 product, as
// transformers computes it; cos and sin of it are rounded once. rot even, rot <= HS.
void rope_forward(float* x, const float* inv_freq, float mscale, int64_t B, int64_t T,
                  int64_t row, int64_t n_heads, int64_t HS, int64_t rot);
// The gradient through the rotation, in place (its transpose, times mscale).
void rope_backward(float* dx, const float* inv_freq, float mscale, int64_t B, int64_t T,
                   int64_t row, int64_t n_heads, int64_t HS, int64_t rot);
// inv_freq[i] = 1 / theta^(2i/rot) for i < rot/2 (RoPE's default; the scaled variants adjust
// these values before the kernels use them).
std::vector<float> rope_default_inv_freq(double theta, int64_t rot);

// SwiGLU: out = silu(gate) * up over n elements. The backward writes (overwrites) the gradient
// of the fused gate|up projection's output: row r of dgate_up (N, 2F) holds d gate then d up,
// what one GEMM of the fused (2F, C) weight takes back.
void swiglu_forward(float* out, const float* gate, const float* up, int64_t n);
void swiglu_backward(float* dgate_up, const float* dout, const float* gate, const float* up,
                     int64_t N, int64_t F);

// out (N,OC) = inp (N,C) @ weight(OC,C)^T + bias (bias may be null). OpenBLAS SGEMM.
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                    int64_t N, int64_t C, int64_t OC);
// dinp += dout @ W; dweight += dout^T @ inp; dbias += column sums of dout (dbias may be null).
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC);

// The heads of a fused q|k|v row, one row per token (B*T rows): NH query heads, then KVH key
// heads, then KVH value heads, each HS wide; query head h reads key and value head
// h / (NH / KVH) (grouped-query attention, Ainslie et al. 2023: KVH = NH is multi-head, 1
// multi-query). Output rows hold the NH heads side by side. GPT-2's: {B, T, NH, NH, C / NH}.
struct AttnShape {
  int64_t B = 0, T = 0, NH = 0, KVH = 0, HS = 0;
  // Sliding-window attention (Mistral; transformers' sliding_window): query t sees keys
  // t - window < t2 <= t; 0 sees every earlier key.
  int64_t window = 0;
  int64_t first_key(int64_t t) const { return window > 0 && t >= window ? t - window + 1 : 0; }
  int64_t row() const { return (NH + 2 * KVH) * HS; }
  int64_t k_off() const { return NH * HS; }
  int64_t v_off() const { return (NH + KVH) * HS; }
  int64_t out_row() const { return NH * HS; }
  int64_t group() const { return NH / KVH; }
};
// Where an attention reads q, k and v: token (b, t)'s query head h at q + (b T + t) q_row +
// h HS, its key and value heads j at k + (b T + t) k_row + j HS and v + ... v_row + j HS. The
// fused q|k|v rows are one case; Qwen3's q/k norms (q and k in a tensor of their own) and
// torchtitan's per-op recomputation (three projections, three tensors) are others. Gradients
// always go to fused rows (dqkv, AttnShape::row()).
struct Qkv {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t q_row = 0, k_row = 0, v_row = 0;
  static Qkv fused(const float* qkv, const AttnShape& s) {
    return {qkv, qkv + s.k_off(), qkv + s.v_off(), s.row(), s.row(), s.row()};
  }
  // q and k normed into qk (rows of (NH + KVH) HS, q heads first), v still in the fused rows.
  static Qkv split_qk(const float* qk, const float* qkv, const AttnShape& s) {
    const int64_t qk_row = (s.NH + s.KVH) * s.HS;
    return {qk, qk + s.NH * s.HS, qkv + s.v_off(), qk_row, qk_row, s.row()};
  }
  // Three tensors of rows NH HS, KVH HS, KVH HS.
  static Qkv parts(const float* q, const float* k, const float* v, const AttnShape& s) {
    return {q, k, v, s.NH * s.HS, s.KVH * s.HS, s.KVH * s.HS};
  }
};

// Qkv for any storage type (the typed kernels below): q, k and v stored as the kernel's t, rows
// in elements of t (Device::QkvIn's layout).
struct QkvT {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_row = 0, k_row = 0, v_row = 0;
};

// Per-head RMSNorm of q and k (Qwen3's q_norm and k_norm, before the rotary embeddings): each
// of the N tokens' NH query heads (from in.q) and KVH key heads (from in.k), HS wide, is
// normalised over HS with weight[0, HS) (query heads) or weight[HS, 2 HS) (key heads), into
// out, rows of (NH + KVH) * HS (q heads first); stats (N, NH + KVH) holds each head's rstd.
void head_rmsnorm_forward(float* out, float* stats, const Qkv& in, const float* weight, float eps,
                          int64_t N, int64_t NH, int64_t KVH, int64_t HS);
// In place over the fused gradient rows (grad_row apart, q heads then k heads first): dqkv's q
// and k heads (the gradient of out) become the gradient of in's; its v heads are not touched.
// dweight (2 HS) += sum dout xhat.
void head_rmsnorm_backward(float* dqkv, int64_t grad_row, float* dweight, const Qkv& in,
                           const float* weight, const float* stats, int64_t N, int64_t NH,
                           int64_t KVH, int64_t HS);

// The fp32 attention steps on any AttnShape (zp::Error unless NH, KVH, HS > 0 and KVH divides
// NH). preatt/att (B,NH,T,T) as below. Backward passes parallelise over the key/value heads,
// so the query heads of a group add into its shared key and value gradient in head order.
void attention_scores(float* preatt, const Qkv& in, const AttnShape& s);
void attention_scores(float* preatt, const float* qkv, const AttnShape& s);  // Qkv::fused
// Softmax over each row's keys first_key(t)..t; zeros elsewhere (B*NH*T rows of T).
void attention_softmax(float* att, const float* preatt, const AttnShape& s);
// Its backward, in place allowed; zeros outside the row's keys.
void attention_softmax_backward(float* dpreatt, const float* datt, const float* att,
                                const AttnShape& s);
void attention_values(float* out, const float* att, const Qkv& in, const AttnShape& s);
void attention_values(float* out, const float* att, const float* qkv, const AttnShape& s);
void attention_values_backward(float* datt, float* dqkv, const float* dout, const float* att,
                               const Qkv& in, const AttnShape& s);
void attention_values_backward(float* datt, float* dqkv, const float* dout, const float* att,
                               const float* qkv, const AttnShape& s);
void attention_scores_backward(float* dqkv, const float* dpreatt, const Qkv& in,
                               const AttnShape& s);
void attention_scores_backward(float* dqkv, const float* dpreatt, const float* qkv,
                               const AttnShape& s);

// Flash attention (FlashAttention-2, Dao 2023): the same attention as the three steps above,
// computed in blocks with an online softmax, never holding a T x T tensor (cpu_flash.cpp).
// out (B,T,NH*HS) as attention_values writes it; lse (B,NH,T) the log-sum-exp of each query's
// scaled scores over its keys. Attention dropout p (0 <= p < 1) drops the normalised
// probabilities with the three steps' mask: element ((b NH + h) T + t) T + t2 of
// dropout_forward's counter-based mask under `key`, so both paths drop the same entries.
void flash_attention_forward(float* out, float* lse, const Qkv& in, const AttnShape& s, float p,
                             uint64_t key);
void flash_attention_forward(float* out, float* lse, const float* qkv, const AttnShape& s,
                             float p, uint64_t key);  // Qkv::fused
// dqkv += the gradient of every q, k and v element from dout (B,T,NH*HS), recomputing the
// probabilities from lse. Workspaces, overwritten: dq_acc (B,T,NH*HS), the fp32 dQ
// accumulator, and dsum (B,NH,T), rowsum(dout * out). Parallel over (b, key/value head):
// B * KVH units of work.
void flash_attention_backward(float* dqkv, float* dq_acc, float* dsum, const float* dout,
                              const Qkv& in, const float* out, const float* lse,
                              const AttnShape& s, float p, uint64_t key);
void flash_attention_backward(float* dqkv, float* dq_acc, float* dsum, const float* dout,
                              const float* qkv, const float* out, const float* lse,
                              const AttnShape& s, float p, uint64_t key);  // Qkv::fused

// Causal self-attention in three steps, as the training graph has them. qkv (B,T,3C) holds
// q, k, v side by side per token; heads are HS-wide slices of each.
// preatt (B,NH,T,T) = q.k / sqrt(HS) for key <= query (entries above the diagonal unused).
void attention_scores(float* preatt, const float* qkv, int64_t B, int64_t T, int64_t C,
                      int64_t NH);
// att = softmax over keys <= query of preatt; entries above the diagonal are set to 0.
void attention_softmax(float* att, const float* preatt, int64_t B, int64_t NH, int64_t T);
// out (B,T,C) = att @ v, heads side by side (reads att on and below the diagonal only).
void attention_values(float* out, const float* att, const float* qkv, int64_t B, int64_t T,
                      int64_t C, int64_t NH);
// datt += dout @ v^T; dqkv (v part) += att^T @ dout. datt above the diagonal is not touched.
void attention_values_backward(float* datt, float* dqkv, const float* dout, const float* att,
                               const float* qkv, int64_t B, int64_t T, int64_t C, int64_t NH);
// dpreatt = att * (datt - sum(att * datt)) per row; dpreatt may equal datt (in place). This
// one overwrites rather than accumulates, which is what in-place use needs; entries above the
// diagonal are set to 0 (datt's there are ignored).
void attention_softmax_backward(float* dpreatt, const float* datt, const float* att, int64_t B,
                                int64_t NH, int64_t T);
// dqkv (q and k parts) += the gradient of q.k/sqrt(HS) for key <= query (dpreatt above the
// diagonal is ignored). The attention kernels throw zp::Error unless NH divides C.
void attention_scores_backward(float* dqkv, const float* dpreatt, const float* qkv, int64_t B,
                               int64_t T, int64_t C, int64_t NH);

// GELU, tanh approximation (GPT-2's gelu_new). In place allowed.
void gelu_forward(float* out, const float* inp, int64_t n);
// dinp = dout * gelu'(inp); dinp may equal dout (in place). Overwrites.
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);

void residual_forward(float* out, const float* a, const float* b, int64_t n);

// logits (N,V) are replaced by their softmax probabilities in place; losses (N) = -log p[target]
// (computed as logsumexp - logit, finite even where p underflows). Both cross-entropy kernels
// throw zp::Error if a target is outside [0, V).
void crossentropy_forward(float* logits, float* losses, const int32_t* targets, int64_t N,
                          int64_t V);
// In place: probs (N,V) become dlogits = (probs - onehot(target)) * dloss, where dloss is the
// gradient of the mean loss the engine optimises with respect to each row's loss (1/N for
// the mean over N tokens, times the loss scale and divided by gradient accumulation steps).
void crossentropy_backward(float* probs, const int32_t* targets, float dloss, int64_t N,
                           int64_t V);

// ---- Typed kernels: the Device seam's signatures (device.hpp). Every 16-bit-or-fp32 buffer is
// stored as t (float-typed ones are fp32 always); t = fp32 runs the fp32 kernels above. For
// fp16 and bf16 each kernel loads as fp32, computes in fp32 and rounds each output element
// once, accumulations included (out = round(out + fp32 sum)); loops that the fp32 kernels
// run as repeated in-place updates (axpy into an output row) are written per output element
// there, in the order of the CUDA kernels. Same in-place rules and overwrite/accumulate
// semantics as the fp32 kernels.

void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe,
                       DType t, int64_t B, int64_t T, int64_t C);
void embedding_backward(void* dwte, void* dwpe, const void* dout, const int32_t* tokens, DType t,
                        int64_t B, int64_t T, int64_t C);
void layernorm_forward(void* out, float* stats, const void* inp, const void* weight,
                       const void* bias, DType t, int64_t N, int64_t C);
void layernorm_backward(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                        const void* weight, const float* stats, DType t, int64_t N, int64_t C);

// 16-bit GEMMs: OpenBLAS has no fp16/bf16 GEMM, so the operands are converted to fp32 in
// panels of at most kGemmPanel x kGemmPanel and SGEMM runs per panel triple, each output
// panel summed over the whole inner dimension in fp32 before its one rounding (cuBLAS's
// fp32-accumulating 16-bit GEMM, as far as results go). The panels live in a caller-owned
// workspace of kGemmWorkspaceFloats floats: the cpu device holds one, outside its arenas, as
// OpenBLAS keeps its own packing buffers (the emulated device's on-chip tiles, not tensors).
// t = fp32 ignores the workspace (may be null). out_t: t, or fp32 (fp32 logits).
inline constexpr int64_t kGemmPanel = 256;
inline constexpr std::size_t kGemmWorkspaceFloats = 3 * kGemmPanel * kGemmPanel;
void matmul_forward(void* out, DType out_t, const void* inp, const void* weight, const void* bias,
                    DType t, int64_t N, int64_t C, int64_t OC, float* workspace);
void matmul_backward(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                     const void* weight, DType t, int64_t N, int64_t C, int64_t OC,
                     float* workspace);

void attention_scores(void* preatt, const void* qkv, DType t, int64_t B, int64_t T, int64_t C,
                      int64_t NH);
void attention_softmax(void* att, const void* preatt, DType t, int64_t B, int64_t NH, int64_t T);
void attention_values(void* out, const void* att, const void* qkv, DType t, int64_t B, int64_t T,
                      int64_t C, int64_t NH);
void attention_values_backward(void* datt, void* dqkv, const void* dout, const void* att,
                               const void* qkv, DType t, int64_t B, int64_t T, int64_t C,
                               int64_t NH);
void attention_softmax_backward(void* dpreatt, const void* datt, const void* att, DType t,
                                int64_t B, int64_t NH, int64_t T);
void attention_scores_backward(void* dqkv, const void* dpreatt, const void* qkv, DType t,
                               int64_t B, int64_t T, int64_t C, int64_t NH);
void gelu_forward(void* out, const void* inp, DType t, int64_t n);
void gelu_backward(void* dinp, const void* inp, const void* dout, DType t, int64_t n);
void residual_forward(void* out, const void* a, const void* b, DType t, int64_t n);

// Inverted dropout (kernel_math.hpp's counter-based mask): mask[i] = dropout_keep(key, i,
// dropout_threshold(p)), out = inp * mask * dropout_scale(p); out may equal inp. Throws
// zp::Error unless 0 <= p < 1.
void dropout_forward(void* out, uint8_t* mask, const void* inp, DType t, float p, uint64_t key,
                     int64_t n);
// dinp = dout * mask * dropout_scale(p); overwrites; dinp may equal dout.
void dropout_backward(void* dinp, const void* dout, const uint8_t* mask, DType t, float p,
                      int64_t n);
// dlogits (t) = (probs - onehot(target)) * dloss, overwriting; dlogits may equal probs when t
// is fp32 (then it is the in-place kernel above).
void crossentropy_backward(void* dlogits, DType t, const float* probs, const int32_t* targets,
                           float dloss, int64_t N, int64_t V);

// LLaMA-family and Mixture-of-Experts kernels, typed the same way (the fp32 kernels above for
// t = fp32, bit for bit). For fp16 and bf16:
// - RMSNorm (whole rows, and per head): rstd = 1/sqrtf(sum x^2 / C + eps) in fp32 (the sum in
//   ascending order, stats fp32), out = round(x rstd w). Backward: dinp = round(dinp + dx),
//   dx from rmsnorm_row_gxhat_mean's mean; dweight = round(dweight + the fp32 sum over rows
//   in ascending order) (per head: rows, then the rows' heads in order; the per-head input
//   gradient overwrites the q and k heads of dqkv).
// - Rotary embeddings: each pair rotated in fp32 by the fp32 kernel's cos and sin, stored once.
// - SwiGLU, gate_mul: elementwise in fp32, each output stored once (the backwards overwrite).
// - Attention over AttnShape (GQA, sliding windows): scores stored once; softmax as the fp32
//   softmax_row over keys first_key(t)..t, zeros elsewhere; values: out = the fp32 sum over keys
//   ascending. values_backward: datt = round(datt + dot), dv = round(dv + the fp32 sum over the
//   group's query heads in order, then queries ascending). scores_backward: dq = round(dq +
//   the sum over keys ascending), dk = round(dk + the sum over the group's heads in order,
//   then queries ascending). Dots and sums sequential (16-bit) in fp32.
// - Flash attention: the fp32 algorithm on q, k, v, dout and out converted to fp32 block by
//   block; the running output in an fp32 tile, stored once; lse, dq_acc and dsum fp32; dk and
//   dv summed in fp32 over the whole backward and added into dqkv once, as is dq_acc.
// - MoE: probabilities, top-k weights and their gradients fp32; dispatch copies rows; combine
//   stores the fp32 sum over a token's slots once; dispatch_backward adds the fp32 sum over a
//   token's slots once; combine_backward's dweights are sequential fp32 dots.
void rmsnorm_forward(void* out, float* stats, const void* inp, const void* weight, float eps,
                     DType t, int64_t N, int64_t C);
void rmsnorm_backward(void* dinp, void* dweight, const void* dout, const void* inp,
                      const void* weight, const float* stats, DType t, int64_t N, int64_t C);
void head_rmsnorm_forward(void* out, float* stats, const QkvT& in, const void* weight, float eps,
                          DType t, int64_t N, int64_t NH, int64_t KVH, int64_t HS);
void head_rmsnorm_backward(void* dqkv, int64_t grad_row, void* dweight, const QkvT& in,
                           const void* weight, const float* stats, DType t, int64_t N, int64_t NH,
                           int64_t KVH, int64_t HS);
void rope_forward(void* x, const float* inv_freq, float mscale, DType t, int64_t B, int64_t T,
                  int64_t row, int64_t n_heads, int64_t HS, int64_t rot);
void rope_backward(void* dx, const float* inv_freq, float mscale, DType t, int64_t B, int64_t T,
                   int64_t row, int64_t n_heads, int64_t HS, int64_t rot);
void swiglu_forward(void* out, const void* gate, const void* up, DType t, int64_t n);
void swiglu_backward(void* dgate_up, const void* dout, const void* gate, const void* up, DType t,
                     int64_t N, int64_t F);
void attention_scores(void* preatt, const QkvT& in, DType t, const AttnShape& s);
void attention_softmax(void* att, const void* preatt, DType t, const AttnShape& s);
void attention_softmax_backward(void* dpreatt, const void* datt, const void* att, DType t,
                                const AttnShape& s);
void attention_values(void* out, const void* att, const QkvT& in, DType t, const AttnShape& s);
void attention_values_backward(void* datt, void* dqkv, const void* dout, const void* att,
                               const QkvT& in, DType t, const AttnShape& s);
void attention_scores_backward(void* dqkv, const void* dpreatt, const QkvT& in, DType t,
                               const AttnShape& s);
void flash_attention_forward(void* out, float* lse, const QkvT& in, DType t, const AttnShape& s,
                             float p, uint64_t key);
void flash_attention_backward(void* dqkv, float* dq_acc, float* dsum, const void* dout,
                              const QkvT& in, const void* out, const float* lse, DType t,
                              const AttnShape& s, float p, uint64_t key);
void moe_route_forward(float* probs, ExpertIdx idx, float* weights, const void* logits, DType t,
                       int64_t N, int64_t E, int64_t K, bool renormalize);
void moe_route_backward(void* dlogits, DType t, const float* dweights, const float* probs,
                        ExpertIdx idx, const float* dprob_all, int64_t N, int64_t E, int64_t K,
                        bool renormalize);
void moe_dispatch(void* xe, const void* in, ExpertIdx idx, DType t, int64_t N, int64_t K,
                  int64_t E, int64_t C);
void moe_dispatch_backward(void* din, const void* dxe, ExpertIdx idx, DType t, int64_t N,
                           int64_t K, int64_t E, int64_t C);
void moe_combine(void* out, const void* ye, const float* weights, ExpertIdx idx, DType t,
                 int64_t N, int64_t K, int64_t E, int64_t C);
void moe_combine_backward(void* dye, float* dweights, const void* dout, const void* ye,
                          const float* weights, ExpertIdx idx, DType t, int64_t N, int64_t K,
                          int64_t E, int64_t C);
void gate_mul_forward(void* out, const void* x, const void* g, DType t, int64_t N, int64_t C);
void gate_mul_backward(void* dx, void* dg, const void* dout, const void* x, const void* g,
                       DType t, int64_t N, int64_t C);

// Conversions for 16-bit storage: dst[i] = src[i] as fp32, and back with rounding to nearest
// even; accumulate_to adds fp32 values into a 16-bit or fp32 buffer (dst += src).
void to_f32(float* dst, const void* src, DType t, int64_t n);
void from_f32(void* dst, const float* src, DType t, int64_t n);
void accumulate_to(void* dst, const float* src, DType t, int64_t n);

// SGD with momentum over one partition (torch.optim.SGD, dampening 0, not Nesterov; its
// first-step buf = d equals momentum*0 + d with a zeroed buffer):
//   g = grad * grad_scale;  d = g + weight_decay*w;  buf = momentum*buf + d;  w -= lr*buf
// w is master (fp32); param_out (optional) receives w rounded to param_dtype.
void sgd_step(float* master, float* momentum_buf, const void* grads, DType grad_dtype,
              void* param_out, DType param_dtype, float lr, float momentum, float weight_decay,
              float grad_scale, int64_t n);

}  // namespace zp::runtime::cpu
