// graph.cpp: builds the training graph of a GPT-2 or LLaMA decoder: forward ops per block,
// the head and loss, the backward of each in reverse, recomputation ops for activation
// checkpointing, and the optimizer step; then orders it with Boost's topological sort.
// What is saved for backward follows Korthikanti et al. 2022 (arXiv 2205.05198) sec. 4.1.
#include "zp/models/graph.hpp"

#include <algorithm>
#include <iterator>

#include <boost/graph/topological_sort.hpp>
#include <fmt/format.h>

#include "zp/checked.hpp"
#include "zp/error.hpp"

namespace zp::models {

std::string_view to_string(TensorKind k) {
  switch (k) {
    case TensorKind::param: return "param";
    case TensorKind::grad: return "grad";
    case TensorKind::input: return "input";
    case TensorKind::activation: return "activation";
    case TensorKind::saved: return "saved";
    case TensorKind::act_grad: return "act_grad";
    case TensorKind::logits: return "logits";
    case TensorKind::workspace: return "workspace";
  }
  return "?";
}

std::string_view to_string(Phase p) {
  switch (p) {
    case Phase::forward: return "forward";
    case Phase::backward: return "backward";
    case Phase::recompute: return "recompute";
    case Phase::optimizer: return "optimizer";
  }
  return "?";
}

std::string_view to_string(OpKind k) {
  static constexpr std::string_view kNames[] = {
      "embedding", "layernorm", "rmsnorm", "matmul", "rope", "attn_scores", "softmax",
      "dropout", "attn_values", "flash_attention", "residual", "gelu", "swiglu",
      "cross_entropy", "embedding_bwd", "layernorm_bwd", "rmsnorm_bwd", "matmul_bwd",
      "rope_bwd", "attn_scores_bwd", "softmax_bwd", "dropout_bwd", "attn_values_bwd",
      "flash_attention_bwd", "gelu_bwd", "swiglu_bwd", "cross_entropy_bwd", "checkpoint_partition", "checkpoint_gather", "optimizer_step"};
  return kNames[static_cast<std::size_t>(k)];
}

namespace {

using Shape = std::vector<int64_t>;
constexpr TensorId kNone = -1;

// The ids of one block's forward tensors; what its backward reads.
struct BlockActs {
  TensorId x = kNone;          // block input (LN1 input)
  TensorId n1 = kNone, n1_stats = kNone;
  TensorId qkv = kNone;
  TensorId att = kNone, att_mask = kNone, att_drop = kNone, lse = kNone;
  TensorId atty = kNone;
  TensorId proj_mask = kNone;
  TensorId res2 = kNone;       // LN2 input
  TensorId n2 = kNone, n2_stats = kNone;
  TensorId fch = kNone, up = kNone, act = kNone;  // GPT-2: fch, gelu(fch); LLaMA: gate, up, h
  TensorId mlp_mask = kNone;
  TensorId out = kNone;        // block output
  TensorKind atty_kind = TensorKind::saved;
};

// Which kind a forward tensor gets: saved for backward, or only a forward activation when the
// backward will recompute it.
struct Kinds {
  TensorKind block = TensorKind::saved;    // everything the backward needs
  TensorKind core = TensorKind::saved;     // attention core (selective recomputation)
};

class Builder {
 public:
  Builder(const ModelSpec& m, const GraphOptions& o, TrainingGraph& g) : m_(m), o_(o), g_(g) {
    B = o.batch;
    T = o.seq;
    C = m.n_embd;
    HS = m.head_dim;
    const int64_t t = o.tp;
    auto divide = [&](int64_t v, const char* what) {
      if (v % t != 0)
        throw Error(fmt::format("--mp {}: {} {} is not divisible by the model-parallel degree",
                                t, what, v),
                    "tensor parallelism splits heads and MLP columns evenly across ranks");
      return v / t;
    };
    NH = divide(m.n_head, "attention heads");
    KVH = divide(m.n_kv_head, "key/value heads");
    F = divide(m.n_inner, "MLP width");
    V = (m.vocab_size + t - 1) / t;  // vocab-parallel head; Megatron pads V to a multiple
    Q = checked_mul(NH, HS, "attention width");
    QKV = checked_add(Q, checked_mul(2 * KVH, HS, "key/value width"), "qkv width");
    ab = o.act_bytes;
  }

  void build() {
    params();
    TensorId tokens = tensor("tokens", {B, T}, 4, TensorKind::input, -1);
    TensorId targets = tensor("targets", {B, T}, 4, TensorKind::input, static_cast<int>(m_.n_layer));

    // ---- forward ----
    const Recompute rc = o_.recompute;
    Kinds fwd;
    if (rc == Recompute::full) fwd = {TensorKind::activation, TensorKind::activation};
    if (rc == Recompute::selective) fwd.core = TensorKind::activation;

    TensorId x = embedding(tokens);
    std::vector<BlockActs> acts;
    std::vector<TensorId> checkpoints;  // block inputs as stored (maybe partitioned)
    for (int l = 0; l < m_.n_layer; ++l) {
      TensorId stored = x;
      if (rc == Recompute::full && o_.partition_checkpoints && o_.tp > 1)
        stored = partition_checkpoint(x, l);
      checkpoints.push_back(stored);
      acts.push_back(block(l, x, Phase::forward, fwd));
      x = acts.back().out;
    }
    // The last block's output is the final norm's input: saved whatever the recomputation.
    g_.tensors[static_cast<std::size_t>(x)].kind = TensorKind::saved;
    const int head_layer = static_cast<int>(m_.n_layer);
    TensorId nf_stats = kNone;
    TensorId nf = norm("lnf", x, "head", head_layer, Phase::forward, TensorKind::saved, nf_stats,
                       final_norm_);
    const TensorId logits = tensor("logits", {B, T, V}, 4, TensorKind::logits, head_layer);
    matmul("lm_head", nf, logits, lm_head_, head_layer, Phase::forward, C, V);
    const TensorId losses = tensor("losses", {B, T}, 4, TensorKind::activation, head_layer);
    op("cross_entropy", OpKind::cross_entropy, Phase::forward, head_layer, {logits, targets},
       {logits, losses}, {}, {}, {}, 5.0 * double(B * T * V));

    // ---- backward ----
    // The logits' gradient replaces the probabilities in place where activations are fp32. With
    // 16-bit activations it is a tensor of its own in the activation type: the LM head's
    // backward multiplies it with 16-bit weights and inputs, and a GEMM's two inputs share one
    // type (cublasGemmEx); PyTorch likewise hands the head a 16-bit gradient of the logits.
    const TensorId dlogits =
        ab == 4 ? logits : tensor("logits.d", {B, T, V}, ab, TensorKind::logits, head_layer);
    op("cross_entropy.bwd", OpKind::cross_entropy_bwd, Phase::backward, head_layer,
       {logits, targets}, {dlogits}, {}, {}, {}, 2.0 * double(B * T * V));
    const TensorId d_nf = tensor("lnf.d", {B, T, C}, ab, TensorKind::act_grad, head_layer);
    matmul_bwd("lm_head", dlogits, nf, d_nf, lm_head_, head_layer, C, V);
    TensorId dres = tensor("dresidual", {B, T, C}, ab, TensorKind::act_grad, head_layer);
    norm_bwd("lnf", d_nf, x, nf_stats, dres, final_norm_, head_layer);

    for (int l = static_cast<int>(m_.n_layer) - 1; l >= 0; --l) {
      BlockActs a = acts[static_cast<std::size_t>(l)];
      if (rc == Recompute::full) {
        TensorId in = checkpoints[static_cast<std::size_t>(l)];
        if (in != a.x) in = gather_checkpoint(in, l);
        a = block(l, in, Phase::recompute, Kinds{});
      } else if (rc == Recompute::selective) {
        recompute_core(l, a);
      }
      block_bwd(l, a, dres);
    }
    embedding_bwd(tokens, dres);

    // ---- optimizer ----
    std::vector<TensorId> all_params, all_grads;
    for (std::size_t i = 0; i < g_.tensors.size(); ++i) {
      if (g_.tensors[i].kind == TensorKind::param) all_params.push_back(static_cast<TensorId>(i));
      if (g_.tensors[i].kind == TensorKind::grad) all_grads.push_back(static_cast<TensorId>(i));
    }
    op("optimizer.step", OpKind::optimizer_step, Phase::optimizer, head_layer, {}, {}, {},
       all_params, all_grads, 0.0);
  }

 private:
  // A weight and its gradient, per module (weight and bias together).
  struct Param {
    TensorId w = kNone, g = kNone;
  };

  const ModelSpec& m_;
  const GraphOptions& o_;
  TrainingGraph& g_;
  int64_t B, T, C, HS, NH, KVH, F, V, Q, QKV;
  uint32_t ab;
  Param wte_, wpe_, lm_head_, final_norm_;
  struct BlockParams {
    Param n1, qkv, proj, n2, fc, fc2;
  };
  std::vector<BlockParams> blocks_;
  std::vector<TensorId> last_writer_;

  // ---- tensors and ops ----

  TensorId tensor(std::string name, Shape shape, uint32_t elem_bytes, TensorKind kind, int layer,
                  bool stats = false, std::string group = {}) {
    uint64_t bytes = elem_bytes;
    for (int64_t d : shape)
      bytes = checked_mul(bytes, static_cast<uint64_t>(d), fmt::format("bytes of {}", name));
    g_.tensors.push_back({std::move(name), std::move(shape), elem_bytes, bytes, kind,
                          static_cast<int32_t>(layer), stats, std::move(group)});
    return static_cast<TensorId>(g_.tensors.size() - 1);
  }

  void op(std::string name, OpKind kind, Phase phase, int layer, std::vector<TensorId> in,
          std::vector<TensorId> out, std::vector<TensorId> scratch, std::vector<TensorId> params,
          std::vector<TensorId> grads, double flops) {
    // fp32 scratch for 16-bit weights: one copy per weight read, then one fp32 gradient per
    // weight gradient written, in that order after the op's own scratch.
    if (o_.f32_weight_scratch && o_.param_bytes != 4 && phase != Phase::optimizer) {
      auto f32_copy = [&](TensorId src, const char* suffix) {
        const Tensor& x = g_.tensors[static_cast<std::size_t>(src)];
        const int64_t n = static_cast<int64_t>(x.bytes / x.elem_bytes);
        const TensorId t = tensor(fmt::format("{}.{}", name, suffix), {n}, 4,
                                  TensorKind::workspace, layer);
        g_.tensors[static_cast<std::size_t>(t)].source = src;
        scratch.push_back(t);
      };
      for (TensorId p : params) f32_copy(p, "w32");
      for (TensorId gr : grads) f32_copy(gr, "dw32");
    }
    g_.ops.push_back({std::move(name), kind, phase, static_cast<int32_t>(layer), std::move(in),
                      std::move(out), std::move(scratch), std::move(params), std::move(grads),
                      flops});
  }

  Param param(const std::string& name, uint64_t numel, const std::string& group, int layer) {
    Param p;
    p.w = tensor(name, {static_cast<int64_t>(numel)}, o_.param_bytes, TensorKind::param, layer, false, group);
    p.g = tensor(name + ".grad", {static_cast<int64_t>(numel)}, o_.param_bytes, TensorKind::grad, layer, false,
                 group);
    return p;
  }

  // Parameters per rank with tensor parallelism t: column-parallel weights (qkv, fc, gate/up)
  // and their biases split; row-parallel weights (proj, fc2/down) split, biases whole; norms
  // and position embeddings replicated; the token embedding vocab-parallel.
  void params() {
    const bool gpt2 = m_.family == Family::gpt2;
    const int64_t t = o_.tp;
    const uint64_t norm_n = static_cast<uint64_t>(m_.norm == Norm::layernorm ? 2 * C : C);
    g_.groups.push_back("embed");
    wte_ = param("wte", static_cast<uint64_t>(V * C), "embed", -1);
    if (m_.learned_positions) wpe_ = param("wpe", static_cast<uint64_t>(m_.n_positions * C), "embed", -1);
    for (int l = 0; l < m_.n_layer; ++l) {
      const std::string h = fmt::format("h.{}", l);
      g_.groups.push_back(h);
      BlockParams b;
      const uint64_t attn_bias = m_.attention_bias ? 1 : 0, mlp_bias = m_.mlp_bias ? 1 : 0;
      b.n1 = param(h + ".norm1", norm_n, h, l);
      b.qkv = param(h + ".attn.qkv", static_cast<uint64_t>(C * QKV + attn_bias * QKV), h, l);
      b.proj = param(h + ".attn.proj", static_cast<uint64_t>(Q * C + attn_bias * C), h, l);
      b.n2 = param(h + ".norm2", norm_n, h, l);
      const int64_t up_cols = gpt2 ? F : 2 * F;  // LLaMA: gate and up
      b.fc = param(h + ".mlp.fc", static_cast<uint64_t>(C * up_cols + mlp_bias * up_cols), h, l);
      b.fc2 = param(h + ".mlp.proj", static_cast<uint64_t>(F * C + mlp_bias * C), h, l);
      blocks_.push_back(b);
    }
    (void)t;
    g_.groups.push_back("head");
    final_norm_ = param("norm_f", norm_n, "head", static_cast<int>(m_.n_layer));
    lm_head_ = m_.tied_embeddings
                   ? wte_
                   : param("lm_head", static_cast<uint64_t>(V * C), "head", static_cast<int>(m_.n_layer));
  }

  // ---- building blocks (forward, then backward in reverse with the same names) ----

  TensorId embedding(TensorId tokens) {
    const bool drop = o_.dropout && m_.embd_dropout > 0;
    std::vector<TensorId> ps = {wte_.w};
    if (m_.learned_positions) ps.push_back(wpe_.w);
    const TensorId emb = tensor("embed.out", {B, T, C}, ab, drop ? TensorKind::activation
                                                                 : TensorKind::saved, -1);
    op("embed", OpKind::embedding, Phase::forward, -1, {tokens}, {emb}, {}, ps, {},
       double(B * T * C));
    if (!drop) return emb;
    const TensorId mask = tensor("embed.drop.mask", {B, T, C}, 1, TensorKind::saved, -1);
    const TensorId out = tensor("embed.drop.out", {B, T, C}, ab, TensorKind::saved, -1);
    op("embed.drop", OpKind::dropout, Phase::forward, -1, {emb}, {out, mask}, {}, {}, {},
       double(B * T * C));
    g_.ops.back().dropout_p = m_.embd_dropout;
    embed_mask_ = mask;
    return out;
  }
  TensorId embed_mask_ = kNone;

  void embedding_bwd(TensorId tokens, TensorId dres) {
    std::vector<TensorId> gs = {wte_.g};
    if (m_.learned_positions) gs.push_back(wpe_.g);
    if (embed_mask_ != kNone) {
      op("embed.drop.bwd", OpKind::dropout_bwd, Phase::backward, -1, {dres, embed_mask_}, {dres},
         {}, {}, {}, double(B * T * C));
      g_.ops.back().dropout_p = m_.embd_dropout;
    }
    op("embed.bwd", OpKind::embedding_bwd, Phase::backward, -1, {dres, tokens}, {}, {}, {}, gs,
       double(B * T * C));
  }

  // layernorm / rmsnorm: saves its input (the caller's tensor), output and fp32 statistics
  // (mean and rstd for layernorm, rstd for rmsnorm: (B, T) each).
  TensorId norm(const std::string& name, TensorId in, const std::string& /*group*/, int layer,
                Phase ph, TensorKind kind, TensorId& stats, const Param& p) {
    const bool ln = m_.norm == Norm::layernorm;
    stats = tensor(name + ".stats", {B, T, ln ? 2 : 1}, 4, kind, layer, true);
    const TensorId out = tensor(name + ".out", {B, T, C}, ab, kind, layer);
    op(fmt::format("{}{}", name, ph == Phase::recompute ? ".re" : ""),
       ln ? OpKind::layernorm : OpKind::rmsnorm, ph, layer, {in}, {out, stats}, {}, {p.w}, {},
       8.0 * double(B * T * C));
    return out;
  }
  void norm_bwd(const std::string& name, TensorId d_out, TensorId in, TensorId stats,
                TensorId dres, const Param& p, int layer) {
    // dres receives the input gradient: written fresh for the final norm, accumulated for
    // the blocks' norms (the residual stream gradient).
    op(name + ".bwd", m_.norm == Norm::layernorm ? OpKind::layernorm_bwd : OpKind::rmsnorm_bwd,
       Phase::backward, layer, {d_out, in, stats}, {dres}, {}, {p.w}, {p.g},
       12.0 * double(B * T * C));
  }

  void matmul(const std::string& name, TensorId in, TensorId out, const Param& p, int layer,
              Phase ph, int64_t n_in, int64_t n_out) {
    op(fmt::format("{}{}", name, ph == Phase::recompute ? ".re" : ""), OpKind::matmul, ph, layer,
       {in}, {out}, {}, {p.w}, {}, 2.0 * double(B * T) * double(n_in) * double(n_out));
  }
  // dX = dY W^T and dW += X^T dY: twice the forward FLOPs.
  void matmul_bwd(const std::string& name, TensorId d_out, TensorId in, TensorId d_in,
                  const Param& p, int layer, int64_t n_in, int64_t n_out) {
    op(name + ".bwd", OpKind::matmul_bwd, Phase::backward, layer, {d_out, in}, {d_in}, {}, {p.w},
       {p.g}, 4.0 * double(B * T) * double(n_in) * double(n_out));
  }

  TensorId partition_checkpoint(TensorId x, int l) {
    // P_a: each of the t model-parallel ranks keeps 1/t of the block input.
    const int64_t part = (B * T * C + o_.tp - 1) / o_.tp;
    const TensorId p = tensor(fmt::format("h.{}.ckpt.part", l), {part}, ab, TensorKind::saved, l);
    op(fmt::format("h.{}.ckpt.partition", l), OpKind::checkpoint_partition, Phase::forward, l,
       {x}, {p}, {}, {}, {}, 0.0);
    g_.tensors[static_cast<std::size_t>(x)].kind = TensorKind::activation;
    return p;
  }
  TensorId gather_checkpoint(TensorId part, int l) {
    const TensorId x = tensor(fmt::format("h.{}.ckpt.full", l), {B, T, C}, ab, TensorKind::saved, l);
    op(fmt::format("h.{}.ckpt.gather", l), OpKind::checkpoint_gather, Phase::recompute, l, {part},
       {x}, {}, {}, {}, 0.0);
    return x;
  }

  // The attention core: scores, softmax, dropout, attention x V (or one fused flash op).
  void attention_core(const std::string& h, int l, Phase ph, TensorKind kind, BlockActs& a,
                      bool values) {
    const std::string re = ph == Phase::recompute ? ".re" : "";
    const double s2 = double(B * NH) * double(T) * double(T);
    const TensorId preatt = tensor(h + ".attn.preatt", {B, NH, T, T}, ab, TensorKind::activation, l);
    op(h + ".attn.scores" + re, OpKind::attn_scores, ph, l, {a.qkv}, {preatt}, {}, {}, {},
       2.0 * s2 * double(HS));
    a.att = tensor(h + ".attn.att", {B, NH, T, T}, ab, kind, l);
    op(h + ".attn.softmax" + re, OpKind::softmax, ph, l, {preatt}, {a.att}, {}, {}, {}, 5.0 * s2);
    TensorId probs = a.att;
    if (o_.dropout && m_.attn_dropout > 0) {
      a.att_mask = tensor(h + ".attn.drop.mask", {B, NH, T, T}, 1, kind, l);
      a.att_drop = tensor(h + ".attn.drop.out", {B, NH, T, T}, ab, kind, l);
      op(h + ".attn.drop" + re, OpKind::dropout, ph, l, {a.att}, {a.att_drop, a.att_mask}, {}, {},
         {}, s2);
      g_.ops.back().dropout_p = m_.attn_dropout;
      probs = a.att_drop;
    }
    if (values) {
      a.atty = tensor(h + ".attn.y", {B, T, Q}, ab, a.atty_kind, l);
      op(h + ".attn.values" + re, OpKind::attn_values, ph, l, {probs, a.qkv}, {a.atty}, {}, {}, {},
         2.0 * s2 * double(HS));
    } else {
      // Selective recomputation: the values product is not redone (its output is saved), but
      // the probabilities are its backward's input, so the recomputed core ends at dropout.
    }
  }

  BlockActs block(int l, TensorId x, Phase ph, Kinds k) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    const std::string h = fmt::format("h.{}", l);
    const std::string re = ph == Phase::recompute ? ".re" : "";
    const bool gpt2 = m_.family == Family::gpt2;
    BlockActs a;
    a.x = x;
    a.n1 = norm(h + ".norm1", x, h, l, ph, k.block, a.n1_stats, p.n1);
    a.qkv = tensor(h + ".attn.qkv", {B, T, QKV}, ab, k.block, l);
    matmul(h + ".attn.qkv", a.n1, a.qkv, p.qkv, l, ph, C, QKV);
    if (!gpt2)  // RoPE rotates q and k in place: its backward needs only the angles
      op(h + ".attn.rope" + re, OpKind::rope, ph, l, {a.qkv}, {a.qkv}, {}, {}, {},
         6.0 * double(B * T) * double(Q + KVH * HS));
    if (o_.flash_attention) {
      a.atty = tensor(h + ".attn.y", {B, T, Q}, ab, k.block, l);
      a.lse = tensor(h + ".attn.lse", {B, NH, T}, 4, k.block, l, true);
      op(h + ".attn.flash" + re, OpKind::flash_attention, ph, l, {a.qkv}, {a.atty, a.lse}, {}, {},
         {}, 4.0 * double(B * NH) * double(T) * double(T) * double(HS));
    } else {
      a.atty_kind = k.block;
      attention_core(h, l, ph, k.core, a, true);
    }
    const bool rdrop = o_.dropout && m_.resid_dropout > 0;
    TensorId proj = tensor(h + ".attn.proj", {B, T, C}, ab, TensorKind::activation, l);
    matmul(h + ".attn.proj", a.atty, proj, p.proj, l, ph, Q, C);
    if (rdrop) {
      a.proj_mask = tensor(h + ".attn.proj.drop.mask", {B, T, C}, 1, k.block, l);
      const TensorId dropped = tensor(h + ".attn.proj.drop.out", {B, T, C}, ab, TensorKind::activation, l);
      op(h + ".attn.proj.drop" + re, OpKind::dropout, ph, l, {proj}, {dropped, a.proj_mask}, {}, {},
         {}, double(B * T * C));
      g_.ops.back().dropout_p = m_.resid_dropout;
      proj = dropped;
    }
    a.res2 = tensor(h + ".res2", {B, T, C}, ab, k.block, l);
    op(h + ".res2" + re, OpKind::residual, ph, l, {x, proj}, {a.res2}, {}, {}, {}, double(B * T * C));
    a.n2 = norm(h + ".norm2", a.res2, h, l, ph, k.block, a.n2_stats, p.n2);
    TensorId mlp_out;
    if (gpt2) {
      a.fch = tensor(h + ".mlp.fc", {B, T, F}, ab, k.block, l);
      matmul(h + ".mlp.fc", a.n2, a.fch, p.fc, l, ph, C, F);
      a.act = tensor(h + ".mlp.gelu", {B, T, F}, ab, k.block, l);
      op(h + ".mlp.gelu" + re, OpKind::gelu, ph, l, {a.fch}, {a.act}, {}, {}, {}, 10.0 * double(B * T * F));
    } else {
      a.fch = tensor(h + ".mlp.gate", {B, T, F}, ab, k.block, l);
      a.up = tensor(h + ".mlp.up", {B, T, F}, ab, k.block, l);
      op(h + ".mlp.gate_up" + re, OpKind::matmul, ph, l, {a.n2}, {a.fch, a.up}, {}, {p.fc.w}, {},
         2.0 * double(B * T) * double(C) * double(2 * F));
      a.act = tensor(h + ".mlp.swiglu", {B, T, F}, ab, k.block, l);
      op(h + ".mlp.swiglu" + re, OpKind::swiglu, ph, l, {a.fch, a.up}, {a.act}, {}, {}, {},
         6.0 * double(B * T * F));
    }
    mlp_out = tensor(h + ".mlp.proj", {B, T, C}, ab, TensorKind::activation, l);
    matmul(h + ".mlp.proj", a.act, mlp_out, p.fc2, l, ph, F, C);
    if (rdrop) {
      a.mlp_mask = tensor(h + ".mlp.drop.mask", {B, T, C}, 1, k.block, l);
      const TensorId dropped = tensor(h + ".mlp.drop.out", {B, T, C}, ab, TensorKind::activation, l);
      op(h + ".mlp.drop" + re, OpKind::dropout, ph, l, {mlp_out}, {dropped, a.mlp_mask}, {}, {}, {},
         double(B * T * C));
      g_.ops.back().dropout_p = m_.resid_dropout;
      mlp_out = dropped;
    }
    // The block output is the next block's input: saved (a checkpoint under full
    // recomputation); a recomputed output is not needed and dies at once.
    a.out = tensor(h + ".out", {B, T, C}, ab,
                   ph == Phase::recompute ? TensorKind::activation : TensorKind::saved, l);
    op(h + ".out" + re, OpKind::residual, ph, l, {a.res2, mlp_out}, {a.out}, {}, {}, {},
       double(B * T * C));
    return a;
  }

  void recompute_core(int l, BlockActs& a) {
    attention_core(fmt::format("h.{}", l), l, Phase::recompute, TensorKind::saved, a, false);
  }

  // Backward of one block, mirroring block() in reverse. dres holds d(block output) on entry
  // and d(block input) on exit.
  void block_bwd(int l, const BlockActs& a, TensorId dres) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    const std::string h = fmt::format("h.{}", l);
    const bool gpt2 = m_.family == Family::gpt2;
    // MLP
    TensorId d_mlp = dres;
    if (a.mlp_mask != kNone) {
      d_mlp = tensor(h + ".mlp.drop.d", {B, T, C}, ab, TensorKind::act_grad, l);
      op(h + ".mlp.drop.bwd", OpKind::dropout_bwd, Phase::backward, l, {dres, a.mlp_mask}, {d_mlp},
         {}, {}, {}, double(B * T * C));
      g_.ops.back().dropout_p = m_.resid_dropout;
    }
    const TensorId d_act = tensor(h + (gpt2 ? ".mlp.gelu.d" : ".mlp.swiglu.d"), {B, T, F}, ab,
                                  TensorKind::act_grad, l);
    matmul_bwd(h + ".mlp.proj", d_mlp, a.act, d_act, p.fc2, l, F, C);
    TensorId d_n2 = tensor(h + ".norm2.d", {B, T, C}, ab, TensorKind::act_grad, l);
    if (gpt2) {
      op(h + ".mlp.gelu.bwd", OpKind::gelu_bwd, Phase::backward, l, {d_act, a.fch}, {d_act}, {}, {},
         {}, 12.0 * double(B * T * F));
      matmul_bwd(h + ".mlp.fc", d_act, a.n2, d_n2, p.fc, l, C, F);
    } else {
      const TensorId d_gu = tensor(h + ".mlp.gate_up.d", {B, T, 2 * F}, ab, TensorKind::act_grad, l);
      op(h + ".mlp.swiglu.bwd", OpKind::swiglu_bwd, Phase::backward, l, {d_act, a.fch, a.up},
         {d_gu}, {}, {}, {}, 10.0 * double(B * T * F));
      op(h + ".mlp.gate_up.bwd", OpKind::matmul_bwd, Phase::backward, l, {d_gu, a.n2}, {d_n2}, {},
         {p.fc.w}, {p.fc.g}, 4.0 * double(B * T) * double(C) * double(2 * F));
    }
    norm_bwd(h + ".norm2", d_n2, a.res2, a.n2_stats, dres, p.n2, l);
    // Attention
    TensorId d_proj = dres;
    if (a.proj_mask != kNone) {
      d_proj = tensor(h + ".attn.proj.drop.d", {B, T, C}, ab, TensorKind::act_grad, l);
      op(h + ".attn.proj.drop.bwd", OpKind::dropout_bwd, Phase::backward, l, {dres, a.proj_mask},
         {d_proj}, {}, {}, {}, double(B * T * C));
      g_.ops.back().dropout_p = m_.resid_dropout;
    }
    const TensorId d_atty = tensor(h + ".attn.y.d", {B, T, Q}, ab, TensorKind::act_grad, l);
    matmul_bwd(h + ".attn.proj", d_proj, a.atty, d_atty, p.proj, l, Q, C);
    const TensorId d_qkv = tensor(h + ".attn.qkv.d", {B, T, QKV}, ab, TensorKind::act_grad, l);
    const double s2 = double(B * NH) * double(T) * double(T);
    if (o_.flash_attention) {
      // FlashAttention-2's backward keeps an fp32 dQ accumulator and per-row softmax sums.
      const TensorId dq_acc = tensor(h + ".attn.flash.dq_accum", {B, T, Q}, 4, TensorKind::workspace, l);
      const TensorId dsum = tensor(h + ".attn.flash.dsum", {B, NH, T}, 4, TensorKind::workspace, l);
      op(h + ".attn.flash.bwd", OpKind::flash_attention_bwd, Phase::backward, l,
         {d_atty, a.qkv, a.atty, a.lse}, {d_qkv}, {dq_acc, dsum}, {}, {},
         2.5 * 4.0 * s2 * double(HS));
    } else {
      const TensorId probs = a.att_drop != kNone ? a.att_drop : a.att;
      const TensorId d_att = tensor(h + ".attn.att.d", {B, NH, T, T}, ab, TensorKind::act_grad, l);
      op(h + ".attn.values.bwd", OpKind::attn_values_bwd, Phase::backward, l, {d_atty, probs, a.qkv},
         {d_att, d_qkv}, {}, {}, {}, 4.0 * s2 * double(HS));
      if (a.att_mask != kNone) {
        op(h + ".attn.drop.bwd", OpKind::dropout_bwd, Phase::backward, l, {d_att, a.att_mask},
           {d_att}, {}, {}, {}, s2);
        g_.ops.back().dropout_p = m_.attn_dropout;
      }
      op(h + ".attn.softmax.bwd", OpKind::softmax_bwd, Phase::backward, l, {d_att, a.att}, {d_att},
         {}, {}, {}, 4.0 * s2);
      op(h + ".attn.scores.bwd", OpKind::attn_scores_bwd, Phase::backward, l, {d_att, a.qkv},
         {d_qkv}, {}, {}, {}, 4.0 * s2 * double(HS));
    }
    if (!gpt2)
      op(h + ".attn.rope.bwd", OpKind::rope_bwd, Phase::backward, l, {d_qkv}, {d_qkv}, {}, {}, {},
         6.0 * double(B * T) * double(Q + KVH * HS));
    const TensorId d_n1 = tensor(h + ".norm1.d", {B, T, C}, ab, TensorKind::act_grad, l);
    matmul_bwd(h + ".attn.qkv", d_qkv, a.n1, d_n1, p.qkv, l, C, QKV);
    norm_bwd(h + ".norm1", d_n1, a.x, a.n1_stats, dres, p.n1, l);
  }

};

}  // namespace

TrainingGraph build_training_graph(const ModelSpec& m, const GraphOptions& o_in) {
  GraphOptions o = o_in;
  if (o.seq == 0) o.seq = m.n_positions;
  if (o.batch < 1) throw Error(fmt::format("--micro-batch: must be >= 1, got {}", o.batch));
  if (o.seq < 1) throw Error(fmt::format("--seq: must be >= 1, got {}", o.seq));
  if (o.tp < 1) throw Error(fmt::format("--mp: must be >= 1, got {}", o.tp));
  if (o.act_bytes != 2 && o.act_bytes != 4)
    throw Error(fmt::format("activation bytes must be 2 or 4, got {}", o.act_bytes));
  TrainingGraph g;
  g.model = m;
  g.options = o;
  Builder b(m, o, g);
  b.build();

  // Edges: each op depends on the latest writer of every tensor it reads or updates in place,
  // and on the op issued before it (stream order).
  const std::size_t n_ops = g.ops.size();
  g.graph = OpGraph(n_ops);
  std::vector<OpId> writer(g.tensors.size(), -1);
  for (std::size_t i = 0; i < n_ops; ++i) {
    const Op& op = g.ops[i];
    auto depend = [&](TensorId t) {
      const OpId w = writer[static_cast<std::size_t>(t)];
      if (w >= 0 && static_cast<std::size_t>(w) != i)
        boost::add_edge(static_cast<std::size_t>(w), i, EdgeTensor{t}, g.graph);
    };
    for (TensorId t : op.inputs) depend(t);
    for (TensorId t : op.outputs) depend(t);
    if (i > 0) boost::add_edge(i - 1, i, EdgeTensor{-1}, g.graph);
    for (TensorId t : op.outputs) writer[static_cast<std::size_t>(t)] = static_cast<OpId>(i);
  }
  // boost::topological_sort writes vertices in reverse topological order.
  std::vector<std::size_t> reversed;
  reversed.reserve(n_ops);
  boost::topological_sort(g.graph, std::back_inserter(reversed));
  g.order.assign(reversed.rbegin(), reversed.rend());

  for (const Op& op : g.ops) {
    if (op.phase == Phase::forward) g.flops_forward += op.flops;
    if (op.phase == Phase::backward) g.flops_backward += op.flops;
    if (op.phase == Phase::recompute) g.flops_recompute += op.flops;
  }
  return g;
}

Liveness liveness(const TrainingGraph& g) {
  const std::size_t n_t = g.tensors.size();
  Liveness lv;
  lv.first.assign(n_t, -1);
  lv.last.assign(n_t, -1);
  lv.last_grad_write.assign(n_t, -1);
  lv.dies_at.assign(g.order.size(), {});
  for (int32_t i = 0; i < static_cast<int32_t>(g.order.size()); ++i) {
    const Op& op = g.op(g.order[static_cast<std::size_t>(i)]);
    auto see = [&](TensorId t) {
      const std::size_t k = static_cast<std::size_t>(t);
      if (lv.first[k] < 0) lv.first[k] = i;
      lv.last[k] = i;
    };
    for (TensorId t : op.inputs) see(t);
    for (TensorId t : op.outputs) see(t);
    for (TensorId t : op.scratch) see(t);
    if (op.phase != Phase::optimizer)
      for (TensorId t : op.grads) lv.last_grad_write[static_cast<std::size_t>(t)] = i;
  }
  for (std::size_t t = 0; t < n_t; ++t) {
    const Tensor& x = g.tensors[t];
    if (lv.last[t] >= 0 && is_dynamic(x.kind) && x.kind != TensorKind::workspace)
      lv.dies_at[static_cast<std::size_t>(lv.last[t])].push_back(static_cast<TensorId>(t));
  }
  return lv;
}

}  // namespace zp::models
