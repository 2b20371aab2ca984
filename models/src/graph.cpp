// graph.cpp: builds the training graph of a model from its recipe (any decoder, T5's encoder
// and decoder): forward ops per block, the head and loss, the backward of each in reverse, recomputation ops for activation
// checkpointing, and the optimizer step; then orders it with Boost's topological sort.
// What is saved for backward follows Korthikanti et al. 2022 (arXiv 2205.05198) sec. 4.1: the
// tensors fused kernels keep. GraphOptions::hf_modeling adds what Hugging Face transformers'
// unfused modeling code keeps beyond them (the "hf_modeling" parts below, each with its source;
// tests/models/test_torch_reference.cpp holds them to PyTorch's autograd, to the byte).
#include "zp/models/graph.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include <boost/graph/topological_sort.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/checked.hpp"
#include "zp/error.hpp"
#include "recipe_walk.hpp"

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
      "flash_attention_bwd", "gelu_bwd", "swiglu_bwd", "cross_entropy_bwd", "checkpoint_partition", "checkpoint_gather", "optimizer_step",
      "moe_route", "moe_dispatch", "moe_combine", "moe_route_bwd", "moe_dispatch_bwd",
      "moe_combine_bwd", "position_bias", "position_bias_bwd", "concat", "concat_bwd",
      "gate_mul", "gate_mul_bwd", "relu", "relu_bwd", "softcap", "softcap_bwd", "tanh",
      "tanh_bwd", "sac_reuse", "pp_recv", "pp_send", "sp_all_gather", "sp_reduce_scatter",
      "cp_all_to_all"};
  return kNames[static_cast<std::size_t>(k)];
}

// Whether transformers' MoE router renormalizes its top-k weights to sum 1 (hf_modeling then
// saves them before the division and their sum; zero-run renormalizes as the model does): Mixtral always (modeling_mixtral.py
// MixtralSparseMoeBlock.forward), Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 as the config's
// norm_topk_prob says (their config classes default it to false, false, true), DeepSeek-V2
// (DeepseekV2MoEGate.forward scales by routed_scaling_factor only) and gpt-oss (a softmax over
// the k chosen logits) never. ModelSpec does not keep the flag: it is read back from the config
// the spec came from (a hand-built spec takes the defaults).
bool hf_topk_renorm(const ModelSpec& m) {
  if (!m.is_moe() || m.model_type == "deepseek_v2" || m.model_type == "gpt_oss") return false;
  if (m.model_type == "mixtral") return true;
  const bool fallback = m.model_type == "deepseek_v3";
  if (m.source_config.empty()) return fallback;
  const nlohmann::json j = nlohmann::json::parse(m.source_config, nullptr, false);
  if (!j.is_object()) return fallback;
  const auto it = j.find("norm_topk_prob");
  return it != j.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

// The load-balancing loss's coefficient transformers trains with (its ForCausalLM forward adds
// router_aux_loss_coef x load_balancing_loss_func(...) when output_router_logits is set; the
// config classes of Mixtral, Qwen2-MoE and Qwen3-MoE default the flag to false and the
// coefficient to 0.001); 0 when the loss is not added. Read from the source config, as above.
double moe_aux_loss_coef(const ModelSpec& m) {
  if (!m.is_moe() || m.source_config.empty()) return 0.0;
  const nlohmann::json j = nlohmann::json::parse(m.source_config, nullptr, false);
  if (!j.is_object()) return 0.0;
  const auto on = j.find("output_router_logits");
  if (on == j.end() || !on->is_boolean() || !on->get<bool>()) return 0.0;
  const auto c = j.find("router_aux_loss_coef");
  return c != j.end() && c->is_number() ? c->get<double>() : 0.001;
}

namespace {

using Shape = std::vector<int64_t>;
constexpr TensorId kNone = -1;

// The ids of one block's forward tensors; what its backward reads.
struct BlockActs {
  TensorId x = kNone;          // block input
  TensorId n1 = kNone, n1_stats = kNone;   // the attention's input norm (pre / sandwich / parallel)
  TensorId qkv = kNone;        // the attention core's q|k|v (MLA: assembled from its latents)
  TensorId qk = kNone, qk_stats = kNone;   // q/k after their norms (Qwen3, Gemma 3, OLMo 2)
  // MLA's low-rank path: q_a and its norm, kv_a (latent and rotary key) and its norm.
  TensorId q_a = kNone, q_an = kNone, q_a_stats = kNone, q_lat = kNone;
  TensorId kv_a = kNone, kv_an = kNone, kv_a_stats = kNone, kv_lat = kNone;
  TensorId att = kNone, att_mask = kNone, att_drop = kNone, lse = kNone, att_tanh = kNone;
  TensorId atty = kNone;
  // DeepSpeed-Ulysses: the core's q|k|v and output over all T tokens and heads/cp (atty is
  // then the output brought back to this rank's tokens, the projection's input).
  TensorId qkv_u = kNone, atty_u = kNone;
  TensorId probs16 = kNone;    // autocast: the values matmul's 16-bit copy of fp32 probabilities
  TensorId att_in = kNone;     // softmax_keeps_input: the scores the softmax read
  TensorId scores = kNone;     // the softmax's input (eager attention)
  TensorId attn_raw = kNone, attn_post_stats = kNone;  // sublayer output before its post norm
  TensorId proj_mask = kNone;
  TensorId res2 = kNone;       // after the attention's residual (LN2 input when pre-norm)
  TensorId res1 = kNone, res1_stats = kNone;           // post_residual: x + attn, pre-norm
  TensorId nx = kNone, nx_stats = kNone, cq = kNone, ckv = kNone, catt = kNone, catty = kNone;
  TensorId res3 = kNone;       // T5 decoder: after cross-attention
  TensorId n2 = kNone, n2_stats = kNone;
  TensorId fch = kNone, up = kNone, act = kNone;  // gelu: fc, act(fc); gated: gate, up, h
  TensorId mlp_raw = kNone, mlp_post_stats = kNone;
  TensorId mlp_mask = kNone;
  // MoE: router logits and probabilities, the k choices, the routed rows through the experts.
  TensorId r_mask = kNone, r_combine = kNone;  // capacity-factor gating (DeepSpeed's einsums)
  TensorId r_probs = kNone, r_idx = kNone, r_w = kNone, xe = kNone, e_gate = kNone,
           e_up = kNone, e_act = kNone, ye = kNone;
  TensorId s_gate = kNone, s_up = kNone, s_act = kNone, s_out = kNone, s_g = kNone;
  TensorId res_out = kNone, out_stats = kNone;           // post_residual: before the last norm
  TensorId out = kNone;        // block output
  TensorKind atty_kind = TensorKind::saved;
  // hf_modeling: what transformers' modeling code saves beyond the fused kernels. repeat_kv's
  // copies of the key and value heads, gpt-oss's sink-softmax max indices, Falcon's q|k|v
  // split indices; the unfused activations of the dense, routed and shared MLPs; the MoE
  // loop's renormalized top-k weights, (token, slot) index pairs and index_add_ source.
  TensorId k_rep = kNone, v_rep = kNone, sink_idx = kNone, qkv_split = kNone;
  std::vector<TensorId> act_hf, e_act_hf, s_act_hf;
  TensorId r_topk = kNone, r_sum = kNone, e_pairs = kNone, e_src = kNone;
  // Recompute::selective_op with separate q, k, v (and T5's cross k, v) projections: one
  // tensor per nn.Linear, since SAC keeps some and recomputes others; qkv (ckv) is then
  // kNone and every reader takes the parts (qkv_of, ckv_of).
  std::vector<TensorId> qkv_parts, ckv_parts;
};

std::vector<TensorId> qkv_of(const BlockActs& a) {
  return a.qkv_parts.empty() ? std::vector<TensorId>{a.qkv} : a.qkv_parts;
}
std::vector<TensorId> ckv_of(const BlockActs& a) {
  return a.ckv_parts.empty() ? std::vector<TensorId>{a.ckv} : a.ckv_parts;
}

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
    T_enc = o.seq;
    T_dec = m.encoder_decoder() ? (o.seq_target > 0 ? o.seq_target : o.seq) : o.seq;
    T = T_dec;
    C = m.n_embd;
    HS = m.qk_head_dim();
    VS = m.v_head_dim();
    const int64_t t = o.tp;
    if (o.cp > 1) {
      // Context parallelism: this rank's share of every sequence is what the graph holds.
      if (m.encoder_decoder())
        throw Error(fmt::format("--cp {}: {} is an encoder-decoder model; context parallelism is "
                                "planned for decoder-only models", o.cp, m.name),
                    "plan it without --cp");
      if (!o.flash_attention && !o.cp_ulysses)
        throw Error(fmt::format("--cp {}: ring attention is blockwise; plan it with --flash-attention",
                                o.cp),
                    "Megatron's context parallelism runs TransformerEngine's fused or flash "
                    "attention; add --flash-attention");
      if (m.attention == Attention::mla || o.hf_modeling || o.autocast)
        throw Error(fmt::format("--cp {}: not planned for {}", o.cp,
                                m.attention == Attention::mla ? "multi-head latent attention"
                                                              : "Hugging Face's modeling code"),
                    "plan context parallelism with --profile zeroplan or deepspeed on GQA/MHA models");
      if (o.cp_ulysses) {
        if (T % o.cp != 0)
          throw Error(fmt::format("--cp {}: --seq {} is not divisible by it", o.cp, T),
                      "DeepSpeed-Ulysses splits every sequence into cp equal parts");
        if (m.attn_sinks || o.recompute == Recompute::selective_op)
          throw Error(fmt::format("--cp {} --cp-kind ulysses: not planned with {}", o.cp,
                                  m.attn_sinks ? "attention sinks" : "per-op recomputation"),
                      "plan it with --cp-kind ring, or without --cp");
        ulysses_cp_ = o.cp;
      } else {
        if (T % (2 * o.cp) != 0)
          throw Error(fmt::format("--cp {}: --seq {} is not a multiple of 2 x {}", o.cp, T, o.cp),
                      "Megatron splits every sequence into 2 cp chunks (each rank takes two, for "
                      "balance under the causal mask)");
        cp_full_T_ = T;
      }
      T = T / o.cp;
      T_dec = T_enc = T;
    }
    auto divide = [&](int64_t v, const char* what) {
      if (v % t != 0)
        throw Error(fmt::format("--tp {}: {} {} is not divisible by the tensor-parallel degree",
                                t, what, v),
                    "tensor parallelism splits heads and MLP columns evenly across ranks");
      return v / t;
    };
    NH = divide(m.n_head, "attention heads");
    KVH = m.attention == Attention::mla ? NH : divide(m.n_kv_head, "key/value heads");
    if (ulysses_cp_ > 1 && (NH % ulysses_cp_ != 0 || KVH % ulysses_cp_ != 0))
      throw Error(fmt::format("--cp {} --cp-kind ulysses: {} heads and {} key/value heads per "
                              "tensor-parallel rank are not divisible by it", ulysses_cp_, NH, KVH),
                  "DeepSpeed-Ulysses gives each rank heads/cp whole heads; choose --cp dividing "
                  "both, or --cp-kind ring");
    F = divide(m.n_inner, "MLP width");
    if (m.is_moe()) {
      Fe = divide(m.moe.expert_inner, "expert MLP width");
      Fs = divide(m.moe.shared_inner, "shared expert MLP width");
      if (m.moe.n_experts % o.ep != 0)
        throw Error(fmt::format("--ep {}: {} experts are not divisible by the expert-parallel "
                                "degree", o.ep, m.moe.n_experts),
                    "expert parallelism places the same number of experts on every rank");
    }
    const int64_t L = m.n_blocks();
    if (o.pp > 1) {
      if (m.encoder_decoder())
        throw Error(fmt::format("--pp {}: {} is an encoder-decoder model; pipeline stages of "
                                "encoder-decoder stacks are not planned", o.pp, m.name),
                    "plan it without --pp");
      if (L % o.pp != 0)
        throw Error(fmt::format("--pp {}: {} layers are not divisible by the pipeline-parallel "
                                "degree", o.pp, L),
                    "each pipeline stage holds the same number of blocks; choose --pp dividing "
                    "the layer count");
    }
    chunks_ = stage_blocks(L, o.pp, o.pp_chunks, o.pp_stage);
    has_embed_ = o.pp_stage == 0;
    has_head_ = o.pp_stage == o.pp - 1;
    sp_ = o.sp && t > 1;
    if (sp_) {
      auto refuse = [&](const std::string& what) {
        throw Error(fmt::format("--sp: {} ({}): not planned with sequence parallelism", what, m.name),
                    "Megatron's sequence parallelism is planned for decoder-only pre-norm dense "
                    "blocks (GPT, LLaMA, Mistral, Qwen); leave out --sp");
      };
      if (m.encoder_decoder()) refuse("an encoder-decoder model");
      if (m.is_moe()) refuse("Mixture-of-Experts layers");
      if (m.attention == Attention::mla) refuse("multi-head latent attention");
      if (m.residual == Residual::parallel) refuse("parallel attention and MLP");
      if (m.norm_place != NormPlace::pre) refuse("norms after the sublayers");
      if (m.embed_proj_dim > 0 || m.head == Head::seq_cls || m.head == Head::mlm)
        refuse("an embedding projection or a BERT head");
      if (o.recompute == Recompute::selective_op) refuse("torchtitan's per-op recomputation");
      if (o.partition_checkpoints) refuse("ZeRO-R's partitioned checkpoints");
      if (o.hf_modeling || o.autocast) refuse("Hugging Face's modeling code");
      if (T % t != 0)
        throw Error(fmt::format("--sp: --seq {} is not divisible by --tp {}", T, t),
                    "sequence parallelism splits every sequence into tp equal parts");
    }
    V = (m.vocab_size + t - 1) / t;  // vocab-parallel head; Megatron pads V to a multiple
    Q = checked_mul(NH, HS, "attention width");
    QKV = checked_add(Q, checked_mul(2 * KVH, m.attention == Attention::mla ? 0 : HS, "key/value width"),
                      "qkv width");
    if (m.attention == Attention::mla)  // assembled q, k (with the shared rotary key) and v
      QKV = checked_add(2 * Q, checked_mul(NH, VS, "value width"), "MLA qkv width");
    QO = checked_mul(NH, VS, "attention output width");
    ab = o.act_bytes;
    aw = o.autocast ? 4 : ab;
    hf_renorm_ = o.hf_modeling && hf_topk_renorm(m);
  }

  void build() {
    params();
    const int head_layer = static_cast<int>(m_.n_blocks());
    const bool encdec = m_.encoder_decoder();
    TensorId enc_tokens = kNone;
    if (encdec) enc_tokens = tensor("enc.tokens", {B, T_enc}, 4, TensorKind::input, -1);
    // Tokens go to the first pipeline stage, targets to the last.
    TensorId tokens = has_embed_ ? tensor("tokens", {B, T_dec}, 4, TensorKind::input, -1) : kNone;
    // Targets: the next (or masked) token of every position; one class per sequence for BERT's
    // sequence classifier (BertForPreTraining's next-sentence labels come as well).
    TensorId targets = has_head_ ? tensor("targets", m_.head == Head::seq_cls ? Shape{B} : Shape{B, T_dec},
                                          4, TensorKind::input, head_layer)
                                 : kNone;
    TensorId cls_targets = m_.head == Head::seq_cls ? targets : kNone;
    if (m_.head == Head::mlm && m_.n_labels > 0)
      cls_targets = tensor("targets.cls", {B}, 4, TensorKind::input, head_layer);

    // ---- forward ----
    const Recompute rc = o_.recompute;
    const bool sac = rc == Recompute::selective_op;
    Kinds fwd;
    if (rc == Recompute::full || sac) fwd = {TensorKind::activation, TensorKind::activation};
    if (rc == Recompute::selective) fwd.core = TensorKind::activation;

    // Indexed by block (this pipeline stage's blocks filled in).
    std::vector<BlockActs> acts(static_cast<std::size_t>(m_.n_blocks()));
    std::vector<TensorId> checkpoints(static_cast<std::size_t>(m_.n_blocks()), kNone);  // block inputs as stored (maybe partitioned)
    auto run_blocks = [&](int64_t from, int64_t to, TensorId x) {
      for (int64_t l = from; l < to; ++l) {
        set_stack(l);
        TensorId stored = x;
        if (rc == Recompute::full && o_.partition_checkpoints)
          stored = partition_checkpoint(x, static_cast<int>(l));
        checkpoints[static_cast<std::size_t>(l)] = stored;
        if (sac) sac_begin(static_cast<int>(l), Sac::Mode::forward);
        acts[static_cast<std::size_t>(l)] = block(static_cast<int>(l), x, Phase::forward, fwd);
        if (sac) sac_end();
        x = acts[static_cast<std::size_t>(l)].out;
      }
      return x;
    };
    TensorId x;
    if (encdec) {
      T = T_enc;
      TensorId ex = embedding(enc_tokens, "enc.embed", -1, enc_embed_mask_);
      if (m_.positions == Positions::relative) position_bias(0, "enc");
      ex = run_blocks(0, m_.n_layer, ex);
      g_.tensors[static_cast<std::size_t>(ex)].kind = TensorKind::saved;
      const int el = static_cast<int>(m_.n_layer - 1);
      enc_out_ = norm("enc.norm_f", ex, el, Phase::forward, TensorKind::saved, enc_stats_,
                      enc_final_norm_);
      enc_in_ = ex;
      T = T_dec;
      x = embedding(tokens, "embed", -1, embed_mask_);
      if (m_.positions == Positions::relative) position_bias(m_.n_layer, "dec");
      x = run_blocks(m_.n_layer, m_.n_blocks(), x);
    } else {
      // This pipeline stage's chunks in order (one without interleaving). A chunk after the
      // pipeline's first receives its input from the previous stage (Megatron-LM's
      // recv_forward into a new tensor, which its first block keeps as its input); a chunk
      // before the pipeline's last sends its output on and frees it (deallocate_output_tensor
      // keeps only the autograd node).
      for (std::size_t c = 0; c < chunks_.size(); ++c) {
        const auto [a, b] = chunks_[c];
        if (c == 0 && has_embed_) {
          x = embedding(tokens, "embed", -1, embed_mask_);
        } else {
          const int l0 = static_cast<int>(a);
          x = outer_tensor(fmt::format("h.{}.pp.in", l0), C, ab, TensorKind::activation, l0);
          op(fmt::format("h.{}.pp.recv", l0), OpKind::pp_recv, Phase::forward, l0, {}, {x}, {},
             {}, {}, 0.0);
        }
        x = run_blocks(a, b, x);
        if (c + 1 < chunks_.size() || !has_head_) {
          const int le = static_cast<int>(b - 1);
          g_.tensors[static_cast<std::size_t>(x)].kind = TensorKind::activation;
          op(fmt::format("h.{}.pp.send", le), OpKind::pp_send, Phase::forward, le, {x}, {}, {},
             {}, {}, 0.0);
        }
      }
    }
    T = T_dec;
    TensorId dres = kNone;
    if (has_head_) {
      // The last block's output is the head's input: saved whatever the recomputation.
      g_.tensors[static_cast<std::size_t>(x)].kind = TensorKind::saved;
      dres = m_.head == Head::lm ? lm_head(x, targets, head_layer)
                                 : bert_heads(x, targets, cls_targets, head_layer);
    }

    auto backward_blocks = [&](int64_t from, int64_t to, TensorId d) {
      for (int64_t l = to - 1; l >= from; --l) {
        set_stack(l);
        BlockActs a = acts[static_cast<std::size_t>(l)];
        if (rc == Recompute::full || sac) {
          TensorId in = checkpoints[static_cast<std::size_t>(l)];
          if (in != a.x && o_.tp > 1) in = gather_checkpoint(in, static_cast<int>(l));
          if (sac) sac_begin(static_cast<int>(l), Sac::Mode::recompute);
          a = block(static_cast<int>(l), in, Phase::recompute, Kinds{});
          if (sac) sac_end();
        } else if (rc == Recompute::selective && !o_.flash_attention) {
          // Flash attention keeps no core to recompute: its backward recomputes the scores
          // from the saved log-sum-exp itself (Dao et al. 2022, sec. 3.1), so selective
          // recomputation (Korthikanti et al. 2022 sec. 5) has nothing left to redo.
          recompute_core(static_cast<int>(l), a);
        }
        block_bwd(static_cast<int>(l), a, d);
        // P_a: DeepSpeed's CheckpointFunction holds the partition (ctx.deepspeed_saved_tensors,
        // or on the host its copy back) until its backward returns (checkpointing.py
        // CheckpointFunction.backward), not only until the gather.
        const TensorId stored = checkpoints[static_cast<std::size_t>(l)];
        if (stored != acts[static_cast<std::size_t>(l)].x) g_.ops.back().inputs.push_back(stored);
      }
    };
    if (encdec) {
      // The decoder's cross-attentions accumulate the encoder output's gradient.
      T = T_enc;
      d_enc_ = tensor("enc.out.d", {B, T_enc, C}, ab, TensorKind::act_grad, head_layer);
      T = T_dec;
      backward_blocks(m_.n_layer, m_.n_blocks(), dres);
      if (m_.positions == Positions::relative) position_bias_bwd(m_.n_layer, "dec");
      embedding_bwd(tokens, dres, "embed", embed_mask_);
      T = T_enc;
      const int el = static_cast<int>(m_.n_layer - 1);
      TensorId denc = tensor("enc.dresidual", {B, T_enc, C}, ab, TensorKind::act_grad, el);
      norm_bwd("enc.norm_f", d_enc_, enc_in_, enc_stats_, denc, enc_final_norm_, el);
      backward_blocks(0, m_.n_layer, denc);
      if (m_.positions == Positions::relative) position_bias_bwd(0, "enc");
      embedding_bwd(enc_tokens, denc, "enc.embed", enc_embed_mask_);
      T = T_dec;
    } else {
      // The chunks in reverse: a chunk's backward starts from its output's gradient (the
      // head's, or received from the next stage) and ends by sending its input's gradient
      // back (or into the embedding's backward).
      for (std::size_t c = chunks_.size(); c-- > 0;) {
        const auto [a, b] = chunks_[c];
        TensorId d = dres;
        if (c + 1 < chunks_.size() || !has_head_) {
          const int le = static_cast<int>(b - 1);
          d = outer_tensor(fmt::format("h.{}.pp.out.d", le), C, ab, TensorKind::act_grad, le);
          op(fmt::format("h.{}.pp.recv_grad", le), OpKind::pp_recv, Phase::backward, le, {}, {d},
             {}, {}, {}, 0.0);
        }
        backward_blocks(a, b, d);
        if (c == 0 && has_embed_) {
          embedding_bwd(tokens, d, "embed", embed_mask_);
        } else {
          const int l0 = static_cast<int>(a);
          op(fmt::format("h.{}.pp.send_grad", l0), OpKind::pp_send, Phase::backward, l0, {d}, {},
             {}, {}, {}, 0.0);
        }
      }
    }

    // Autocast: the forward's weight casts that no backward reads (a fully recomputed block
    // casts its weights again) are dropped with the cast cache when the autocast region ends,
    // after the forward's last op (the loss: the Trainer's compute_loss runs in the region).
    if (o_.autocast) {
      std::size_t last_fwd = 0;
      for (std::size_t i = 0; i < g_.ops.size(); ++i)
        if (g_.ops[i].phase == Phase::forward) last_fwd = i;
      for (TensorId c : fwd_casts_)
        if (!casts_read_in_bwd_.contains(c)) g_.ops[last_fwd].inputs.push_back(c);
    }

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

  // ---- torchtitan's per-op selective activation checkpointing (Recompute::selective_op) ----
  // What torch dispatches for a graph matmul, as the SAC policy sees the op: an nn.Linear
  // without bias is aten.mm, one with a bias aten.addmm (at::linear turns a biased linear on a
  // contiguous input into addmm: aten/src/ATen/native/Linear.cpp, _flatten_nd_linear); the
  // MoE router's gate (torchtitan forces its mm to be recomputed) and the routed experts
  // (torch._grouped_mm in torchtitan's GroupedExperts). Set by matmul()'s caller, read by op().
  enum class Aten : uint8_t { unset, mm, addmm, router_mm, grouped_mm };
  static Aten linear_aten(bool bias) { return bias ? Aten::addmm : Aten::mm; }
  struct Sac {
    enum class Mode : uint8_t { off, forward, recompute };
    Mode mode = Mode::off;
    int layer = -1;
    int mm_count = 0;        // forward: aten.mm seen so far in this block
    std::size_t cursor = 0;  // recompute: the block's forward tensors replayed so far
  };
  Sac sac_;
  std::vector<std::vector<TensorId>> sac_created_;  // per block: its forward tensors in order
  std::set<TensorId> sac_cached_;                   // outputs SAC's storage keeps
  Aten pending_aten_ = Aten::unset;

  void sac_begin(int l, Sac::Mode mode) {
    if (sac_created_.size() <= static_cast<std::size_t>(l))
      sac_created_.resize(static_cast<std::size_t>(l) + 1);
    sac_ = Sac{mode, l, 0, 0};
  }
  void sac_end() {
    if (sac_.mode == Sac::Mode::recompute &&
        sac_.cursor != sac_created_[static_cast<std::size_t>(sac_.layer)].size())
      throw Error(fmt::format("internal: the recomputation of block {} creates fewer tensors "
                              "than its forward", sac_.layer));
    sac_ = Sac{};
  }

  // The outputs of one forward op of a block that SAC's storage keeps until the block is
  // recomputed, by torchtitan's SelectiveAC policy (torchtitan/distributed/
  // activation_checkpoint.py at b5bcd76c: _get_default_save_ops, and wrapped_policy in
  // SelectiveAC._wrap_block). Its save list is torch's compute-intensive ops
  // (torch/_functorch/partitioners.py get_default_op_list: mm, bmm, addmm, convolution,
  // _scaled_mm, the SDPA flash and efficient kernels), the other SDPA variants, flex
  // attention, aten.max.default (a whole-tensor max: fp8's amax; attention's row max is
  // max.dim, not in it), aten.linear, aten.topk, and the collectives reduce_scatter_tensor and
  // all_to_all_single. The policy saves every op in the list except every second mm/linear of
  // the block (a counter per checkpointed call: the 1st, 3rd, 5th... are saved, the 2nd, 4th...
  // recomputed), and never the mm of a weight shaped like the MoE router's gate
  // (force_recompute_mm_shapes_by_fqns, default ["moe.router.gate"]), which is not counted.
  // Everything else (norms, rotary, activations, residual adds, dropout, softmax, indexing) is
  // recomputed. Here: matmuls by their Aten; flash attention (SDPA) and eager attention's two
  // batched products (bmm) saved whole; the MoE route's top-k, its indices and values (the
  // graph's top-k weights, or with a renormalizing router the weights before the division).
  // torchtitan's llama3 configs set this mode; v0.2.2 spelled it mode = "selective",
  // selective_ac_option = "op", with a per-model save list of aten.mm, the SDPA variants,
  // reduce_scatter, max, flex attention (llama3/infra/parallelize.py _op_sac_save_list): the
  // same for unbiased linears and SDPA, but addmm, bmm and topk were recomputed there.
  std::vector<TensorId> sac_policy(OpKind kind, Aten aten, const std::vector<TensorId>& in,
                                   const std::vector<TensorId>& out) {
    std::vector<TensorId> made;  // outputs the op creates (not updated in place)
    for (TensorId t : out)
      if (std::find(in.begin(), in.end(), t) == in.end()) made.push_back(t);
    switch (kind) {
      case OpKind::matmul:
        switch (aten) {
          case Aten::mm: return ++sac_.mm_count % 2 == 1 ? made : std::vector<TensorId>{};
          case Aten::addmm: return made;
          case Aten::router_mm:
          case Aten::grouped_mm: return {};
          case Aten::unset: break;
        }
        throw Error("internal: a matmul in a block does not say which aten op it is");
      case OpKind::flash_attention:
      case OpKind::attn_scores:
      case OpKind::attn_values: return made;
      case OpKind::moe_route: return {out[1], out[hf_renorm_ && out.size() > 3 ? 3 : 2]};
      default: return {};
    }
  }

  const ModelSpec& m_;
  const GraphOptions& o_;
  TrainingGraph& g_;
  int64_t B, T, T_enc, T_dec, C, HS, VS, NH, KVH, F, Fe = 0, Fs = 0, V, Q, QKV, QO, E = 0;
  uint32_t ab;
  // The dtype of the residual stream, norms' and softmax's outputs and embedding lookups: the
  // activation type, or fp32 under autocast (GraphOptions::autocast).
  uint32_t aw;
  // Autocast's 16-bit copies (GraphOptions::autocast): each weight's cast per pass (the
  // forward's, and a recomputed block's), the forward's in creation order, and each matmul's
  // copy of its fp32 input by the matmul's name (a recomputation's replaces the forward's).
  // linears_: how many separate nn.Linear modules a graph module stands for (q, k, v).
  std::map<TensorId, TensorId> wcast_fwd_, wcast_re_;
  std::vector<TensorId> fwd_casts_;
  std::set<TensorId> casts_read_in_bwd_;
  std::map<std::string, TensorId> in16_;
  std::map<TensorId, int64_t> linears_;
  // softmax_keeps_input: each log_softmax's input, by its output.
  std::map<TensorId, TensorId> log_softmax_in_;
  bool hf_renorm_ = false;  // hf_modeling and the router renormalizes (hf_topk_renorm)
  // Pipeline parallelism (GraphOptions::pp): this stage's model chunks, each a range of
  // blocks [first, end), in order; whether it has the embedding (the first stage) and the
  // head (the last).
  std::vector<std::pair<int64_t, int64_t>> chunks_;
  bool has_embed_ = true, has_head_ = true;
  // Context parallelism: the whole sequence's length (T is this rank's T/cp) under the ring;
  // 0 without.
  int64_t cp_full_T_ = 0;
  // DeepSpeed-Ulysses' degree (1 without): while the attention core is built, the builder's
  // dimensions are the heads view's, all T tokens and heads/cp (HeadsView).
  int64_t ulysses_cp_ = 1;
  struct HeadsView {
    Builder& b;
    int64_t T, NH, KVH, Q, QKV, QO;
    explicit HeadsView(Builder& x)
        : b(x), T(x.T), NH(x.NH), KVH(x.KVH), Q(x.Q), QKV(x.QKV), QO(x.QO) {
      const int64_t c = x.ulysses_cp_;
      x.T *= c;
      x.NH /= c;
      x.KVH /= c;
      x.Q /= c;
      x.QKV /= c;
      x.QO /= c;
    }
    ~HeadsView() {
      b.T = T;
      b.NH = NH;
      b.KVH = KVH;
      b.Q = Q;
      b.QKV = QKV;
      b.QO = QO;
    }
    HeadsView(const HeadsView&) = delete;
    HeadsView& operator=(const HeadsView&) = delete;
  };
  // The all-to-all of one tensor between the token view (B, T/cp, w) and the heads view
  // (B, T, w/cp); `to` gives the new tensor's shape. Same bytes either side.
  TensorId ulysses_a2a(const std::string& name, std::vector<TensorId> in, const Shape& to,
                       TensorKind kind, int l, Phase ph) {
    const TensorId out = tensor(name, to, ab, kind, l);
    op(name, OpKind::cp_all_to_all, ph, l, std::move(in), {out}, {}, {}, {}, 0.0);
    return out;
  }
  // Ring attention's buffers (GraphOptions::cp): a packed key|value block of this rank's
  // tokens, cp of them held by the forward (and a recomputation), two with their gradients
  // by the backward.
  uint64_t cp_kv_block() const {
    return static_cast<uint64_t>(B) * static_cast<uint64_t>(T) * 2 * static_cast<uint64_t>(KVH) *
           static_cast<uint64_t>(HS) * ab;
  }
  // Sequence parallelism (GraphOptions::sp with t > 1): the tensors held with T/t tokens.
  bool sp_ = false;
  std::set<TensorId> sharded_;
  bool sharded(TensorId t) const { return sp_ && sharded_.contains(t); }
  // (B, T/t, w) under sequence parallelism, else (B, T, w): the shape of a tensor between
  // the tensor-parallel regions.
  Shape outer(int64_t w) const { return {B, sp_ ? T / o_.tp : T, w}; }
  TensorId outer_tensor(std::string name, int64_t w, uint32_t elem_bytes, TensorKind kind, int l) {
    const TensorId t = tensor(std::move(name), outer(w), elem_bytes, kind, l);
    if (sp_) sharded_.insert(t);
    return t;
  }
  int64_t tokens_of(TensorId t) const {
    const Shape& sh = g_.tensors[static_cast<std::size_t>(t)].shape;
    return sh.size() == 3 ? sh[0] * sh[1] : B * T;
  }
  // The all-gather of a sequence-sharded tensor into a transient whole one (Megatron's
  // gather_from_sequence_parallel_region), dying after its one reader.
  TensorId sp_gather(const std::string& name, TensorId x, int l, Phase ph) {
    const Tensor& t = g_.tensors[static_cast<std::size_t>(x)];
    const TensorId full = tensor(name, {B, T, t.shape.back()}, t.elem_bytes,
                                 t.kind == TensorKind::act_grad ? TensorKind::act_grad
                                                                : TensorKind::activation, l);
    op(name, OpKind::sp_all_gather, ph, l, {x}, {full}, {}, {}, {}, 0.0);
    return full;
  }
  // The reduce-scatter of whole partial sums into the sequence-sharded tensor (Megatron's
  // reduce_scatter_to_sequence_parallel_region); backward's accumulates into it.
  void sp_scatter(const std::string& name, TensorId full, TensorId x, int l, Phase ph) {
    op(name, OpKind::sp_reduce_scatter, ph, l, {full}, {x}, {}, {}, {}, double(B * T) *
       double(g_.tensors[static_cast<std::size_t>(full)].shape.back()));
  }
  bool stage_block(int64_t l) const {
    for (const auto& [a, b] : chunks_)
      if (l >= a && l < b) return true;
    return false;
  }
  Param wte_, wpe_, embed_norm_, embed_proj_, lm_head_, final_norm_, enc_final_norm_, head_proj_;
  Param wtt_;                                  // BERT's token-type embeddings
  Param pooler_, mlm_dense_, mlm_norm_, mlm_bias_, cls_;  // BERT's heads
  // One graph module per slot group of a block (zero-sized ones are left out).
  struct BlockParams {
    Param n1, n1_post, q_a, q_a_norm, q, kv_a, kv_a_norm, kv_b, qkv, qk_norm, sinks, rel_bias,
        proj, nx, cq, ckv, cproj, n2, n2_post, fc, fc2, router, e_fc, e_proj, s_fc, s_proj, s_gate;
  };
  std::vector<BlockParams> blocks_;
  TensorId embed_mask_ = kNone, enc_embed_mask_ = kNone;
  TensorId enc_out_ = kNone, enc_in_ = kNone, enc_stats_ = kNone, d_enc_ = kNone;
  TensorId pos_bias_[2] = {kNone, kNone};

  // A gradient tensor (B, T, C) created when first written, so tensors are numbered in the
  // order the backward creates them.
  struct Target {
    TensorId id = kNone;
    std::string name;
  };
  TensorId need(Target& t, int l) {
    if (t.id == kNone) t.id = outer_tensor(t.name, C, aw, TensorKind::act_grad, l);
    return t.id;
  }
  static Target target(TensorId existing) { return Target{existing, {}}; }
  static Target target(std::string name) { return Target{kNone, std::move(name)}; }

  bool decoder_block(int64_t l) const { return m_.encoder_decoder() && l >= m_.n_layer; }
  void set_stack(int64_t l) { T = m_.encoder_decoder() && l < m_.n_layer ? T_enc : T_dec; }

  // ---- tensors and ops ----

  TensorId tensor(std::string name, Shape shape, uint32_t elem_bytes, TensorKind kind, int layer,
                  bool stats = false, std::string group = {}) {
    const bool sac_tracked = sac_.mode != Sac::Mode::off && kind != TensorKind::workspace;
    if (sac_tracked && sac_.mode == Sac::Mode::recompute) {
      // The recomputation creates the block's tensors in the forward's order; an output SAC's
      // storage kept is the forward's tensor itself.
      const auto& created = sac_created_[static_cast<std::size_t>(sac_.layer)];
      if (sac_.cursor >= created.size() ||
          g_.tensors[static_cast<std::size_t>(created[sac_.cursor])].name != name ||
          g_.tensors[static_cast<std::size_t>(created[sac_.cursor])].shape != shape)
        throw Error(fmt::format("internal: the recomputation of block {} diverges from its "
                                "forward at {}", sac_.layer, name));
      const TensorId f = created[sac_.cursor++];
      if (sac_cached_.contains(f)) return f;
    }
    uint64_t bytes = elem_bytes;
    for (int64_t d : shape)
      bytes = checked_mul(bytes, static_cast<uint64_t>(d), fmt::format("bytes of {}", name));
    g_.tensors.push_back({std::move(name), std::move(shape), elem_bytes, bytes, kind,
                          static_cast<int32_t>(layer), stats, std::move(group)});
    const TensorId id = static_cast<TensorId>(g_.tensors.size() - 1);
    if (sac_tracked && sac_.mode == Sac::Mode::forward)
      sac_created_[static_cast<std::size_t>(sac_.layer)].push_back(id);
    return id;
  }

  void op(std::string name, OpKind kind, Phase phase, int layer, std::vector<TensorId> in,
          std::vector<TensorId> out, std::vector<TensorId> scratch, std::vector<TensorId> params,
          std::vector<TensorId> grads, double flops) {
    const Aten aten = std::exchange(pending_aten_, Aten::unset);
    if (sac_.mode == Sac::Mode::forward) {
      for (TensorId t : sac_policy(kind, aten, in, out)) {
        sac_cached_.insert(t);
        g_.tensors[static_cast<std::size_t>(t)].kind = TensorKind::saved;
      }
    } else if (sac_.mode == Sac::Mode::recompute) {
      // Outputs the forward's op left in SAC's storage are not computed again: the
      // recomputation reads them there (so they live until then). An op whose outputs all
      // come from storage is not run at all.
      std::vector<TensorId> reused, rest;
      for (TensorId t : out)
        (sac_cached_.contains(t) && std::find(in.begin(), in.end(), t) == in.end() ? reused : rest)
            .push_back(t);
      if (!reused.empty() && rest.empty()) {
        if (name.ends_with(".re")) name.resize(name.size() - 3);
        g_.ops.push_back({name + ".sac", OpKind::sac_reuse, phase, static_cast<int32_t>(layer),
                          std::move(reused), {}, {}, {}, {}, 0.0});
        return;
      }
      in.insert(in.end(), reused.begin(), reused.end());
      out = std::move(rest);
    }
    for (TensorId t : params)
      if (t == kNone) throw Error(fmt::format("internal: op {} reads a weight the recipe lacks", name));
    for (TensorId t : grads)
      if (t == kNone) throw Error(fmt::format("internal: op {} writes a gradient the recipe lacks", name));
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

  Param param(const std::string& name, uint64_t numel, const std::string& group, int layer,
              const std::vector<uint64_t>* parts) {
    Param p;
    if (numel == 0) return p;
    p.w = tensor(name, {static_cast<int64_t>(numel)}, o_.param_bytes, TensorKind::param, layer, false, group);
    p.g = tensor(name + ".grad", {static_cast<int64_t>(numel)}, o_.param_bytes, TensorKind::grad, layer, false,
                 group);
    if (parts != nullptr) g_.param_parts[p.g] = *parts;
    return p;
  }

  // Elements this rank holds of one tensor of the recipe: tensor parallelism splits column-
  // and row-parallel weights (and column biases) t ways, the vocabulary ceil(V/t) rows per
  // rank; expert parallelism keeps E/ep of the routed experts. Norms, routers, position
  // tables and row biases are whole on every rank.
  uint64_t rank_numel(const detail::SlotTensor& x) const {
    uint64_t n = 1;
    for (int64_t d : x.shape) n = checked_mul(n, static_cast<uint64_t>(d), "parameter elements");
    const uint64_t t = static_cast<uint64_t>(o_.tp);
    switch (x.split) {
      case Split::replicated: break;
      case Split::column:
      case Split::row: n /= t; break;
      case Split::vocab:
        n = n / static_cast<uint64_t>(x.shape[0]) * ((static_cast<uint64_t>(x.shape[0]) + t - 1) / t);
        break;
    }
    if (x.routed) n = n / static_cast<uint64_t>(o_.ep);
    return n;
  }

  // Parameters per rank, summed from the recipe's tensors into the graph's modules; the order
  // is the order in which ZeRO lays them out (GPT-2: wte, wpe, then per block norm1, qkv,
  // proj, norm2, fc, proj; norm_f and an untied head last).
  void params() {
    E = m_.embed_proj_dim > 0 ? m_.embed_proj_dim : C;
    const int64_t L = m_.n_blocks();
    std::map<std::string, uint64_t> top;
    std::vector<std::map<std::string, uint64_t>> per(static_cast<std::size_t>(L));
    std::vector<std::map<std::string, std::set<std::string>>> bases(static_cast<std::size_t>(L));
    // The same sums as lists of the recipe's tensors (TrainingGraph::param_parts).
    std::map<std::string, std::vector<uint64_t>> top_parts;
    std::vector<std::map<std::string, std::vector<uint64_t>>> per_parts(static_cast<std::size_t>(L));
    const bool mla = m_.attention == Attention::mla;
    detail::walk_params(m_, [&](const detail::SlotTensor& x) {
      std::string_view s = x.slot;
      const std::size_t dot = s.rfind('.');
      std::string_view base = s;
      if (dot != std::string_view::npos &&
          (s.substr(dot + 1) == "weight" || s.substr(dot + 1) == "bias"))
        base = s.substr(0, dot);
      const uint64_t n = rank_numel(x);
      // Pipeline parallelism: the blocks of this stage only; the embedding's tensors on the
      // first stage, the final norm's and the head's on the last (top_param skips the rest).
      if (x.layer >= 0 && x.layer < L && base != "enc_final_norm" && !stage_block(x.layer))
        return;
      if (x.layer < 0 || x.layer >= L || base == "enc_final_norm") {
        top[std::string(base)] += n;
        if (n > 0) top_parts[std::string(base)].push_back(n);
        return;
      }
      static const std::map<std::string_view, std::string_view> kModule = {
          {"norm_attn", "n1"}, {"norm_attn_post", "n1_post"}, {"norm_mlp", "n2"},
          {"norm_mlp_post", "n2_post"}, {"norm_cross", "nx"},
          {"attn.q", "qkv"}, {"attn.k", "qkv"}, {"attn.v", "qkv"}, {"attn.qkv", "qkv"},
          {"attn.o", "proj"}, {"attn.q_norm", "qk_norm"}, {"attn.k_norm", "qk_norm"},
          {"attn.sinks", "sinks"}, {"attn.rel_bias", "rel_bias"},
          {"attn.q_a", "q_a"}, {"attn.q_a_norm", "q_a_norm"}, {"attn.q_b", "q"},
          {"attn.kv_a", "kv_a"}, {"attn.kv_a_norm", "kv_a_norm"}, {"attn.kv_b", "kv_b"},
          {"cross.q", "cq"}, {"cross.k", "ckv"}, {"cross.v", "ckv"}, {"cross.o", "cproj"},
          {"mlp.gate", "fc"}, {"mlp.up", "fc"}, {"mlp.gate_up", "fc"}, {"mlp.down", "fc2"},
          {"moe.router", "router"}, {"moe.router.score_bias", "router"},
          {"moe.expert.gate", "e_fc"}, {"moe.expert.up", "e_fc"}, {"moe.expert.down", "e_proj"},
          {"moe.experts.gate_up", "e_fc"}, {"moe.experts.gate_up_bias", "e_fc"},
          {"moe.experts.down", "e_proj"}, {"moe.experts.down_bias", "e_proj"},
          {"moe.shared.gate", "s_fc"}, {"moe.shared.up", "s_fc"}, {"moe.shared.down", "s_proj"},
          {"moe.shared_gate", "s_gate"}};
      std::string_view module = kModule.at(base);
      if (mla && base == "attn.q") module = "q";
      per[static_cast<std::size_t>(x.layer)][std::string(module)] += n;
      if (!base.ends_with("bias"))
        bases[static_cast<std::size_t>(x.layer)][std::string(module)].insert(std::string(base));
      if (n > 0) per_parts[static_cast<std::size_t>(x.layer)][std::string(module)].push_back(n);
    });
    auto top_param = [&](const char* name, const char* key, const std::string& group, int layer) {
      const bool here = group == "embed" ? has_embed_ : group == "head" ? has_head_ : true;
      return here ? param(name, top[key], group, layer, &top_parts[key]) : Param{};
    };
    if (has_embed_) g_.groups.push_back("embed");
    wte_ = top_param("wte", "embed", "embed", -1);
    wpe_ = top_param("wpe", "pos", "embed", -1);
    wtt_ = top_param("wtt", "type", "embed", -1);
    embed_proj_ = top_param("embed.proj", "embed_proj", "embed", -1);
    embed_norm_ = top_param("embed.norm", "embed_norm", "embed", -1);
    for (int l = 0; l < L; ++l) {
      const std::string h = fmt::format("h.{}", l);
      if (!stage_block(l)) {  // another pipeline stage's block
        blocks_.push_back(BlockParams{});
        continue;
      }
      g_.groups.push_back(h);
      auto& s = per[static_cast<std::size_t>(l)];
      auto& sp = per_parts[static_cast<std::size_t>(l)];
      auto p = [&](const char* key, const char* name) {
        const Param r = param(h + "." + name, s[key], h, l, &sp[key]);
        const std::size_t n_lin = bases[static_cast<std::size_t>(l)][key].size();
        if (r.w != kNone) linears_[r.w] = n_lin > 0 ? static_cast<int64_t>(n_lin) : 1;
        return r;
      };
      BlockParams b;
      b.n1 = p("n1", "norm1");
      b.n1_post = p("n1_post", "norm1.post");
      b.q_a = p("q_a", "attn.q_a");
      b.q_a_norm = p("q_a_norm", "attn.q_a_norm");
      b.q = p("q", "attn.q");
      b.kv_a = p("kv_a", "attn.kv_a");
      b.kv_a_norm = p("kv_a_norm", "attn.kv_a_norm");
      b.kv_b = p("kv_b", "attn.kv_b");
      b.qkv = p("qkv", "attn.qkv");
      b.qk_norm = p("qk_norm", "attn.qk_norm");
      b.sinks = p("sinks", "attn.sinks");
      b.rel_bias = p("rel_bias", "attn.rel_bias");
      b.proj = p("proj", "attn.proj");
      b.nx = p("nx", "normx");
      b.cq = p("cq", "cross.q");
      b.ckv = p("ckv", "cross.kv");
      b.cproj = p("cproj", "cross.proj");
      b.n2 = p("n2", "norm2");
      b.n2_post = p("n2_post", "norm2.post");
      b.fc = p("fc", "mlp.fc");
      b.fc2 = p("fc2", "mlp.proj");
      b.router = p("router", "moe.router");
      b.e_fc = p("e_fc", "moe.experts.fc");
      b.e_proj = p("e_proj", "moe.experts.proj");
      b.s_fc = p("s_fc", "moe.shared.fc");
      b.s_proj = p("s_proj", "moe.shared.proj");
      b.s_gate = p("s_gate", "moe.shared.gate");
      if (l == m_.n_layer - 1 && m_.encoder_decoder())
        enc_final_norm_ = top_param("enc.norm_f", "enc_final_norm", h, l);
      blocks_.push_back(b);
    }
    if (has_head_) g_.groups.push_back("head");
    const int H = static_cast<int>(L);
    final_norm_ = top_param("norm_f", "final_norm", "head", H);
    head_proj_ = top_param("head.proj", "head_proj", "head", H);
    pooler_ = top_param("head.pooler", "head.pooler", "head", H);
    mlm_bias_ = top_param("head.mlm.bias", "head.mlm", "head", H);
    mlm_dense_ = top_param("head.mlm.dense", "head.mlm.dense", "head", H);
    mlm_norm_ = top_param("head.mlm.norm", "head.mlm_norm", "head", H);
    lm_head_ = m_.tied_embeddings ? wte_ : top_param("lm_head", "head", "head", H);
    // The last of several pipeline stages holds its own copy of tied word embeddings as the
    // output layer (Megatron-LM's LanguageModule.setup_embeddings_and_output_layer: the last
    // stage's output_layer.weight, initialized from and kept equal to the first stage's
    // word embeddings through the embedding group's gradient all-reduce).
    if (m_.tied_embeddings && has_head_ && !has_embed_)
      lm_head_ = param("lm_head", top["embed"], "head", H, &top_parts["embed"]);
    cls_ = top_param("head.cls", "head.cls", "head", H);
  }

  // ---- building blocks (forward, then backward in reverse with the same names) ----

  TensorId embedding(TensorId tokens, const std::string& name, int layer, TensorId& mask_out) {
    const bool drop = o_.dropout && m_.embd_dropout > 0;
    std::vector<TensorId> ps = {wte_.w};
    if (wpe_.w != kNone) ps.push_back(wpe_.w);
    if (wtt_.w != kNone) ps.push_back(wtt_.w);
    const bool more = embed_proj_.w != kNone || embed_norm_.w != kNone;
    const TensorId emb = tensor(name + ".out", {B, T, more ? E : C}, aw,
                                drop || more ? TensorKind::activation : TensorKind::saved, layer);
    op(name, OpKind::embedding, Phase::forward, layer, {tokens}, {emb}, {}, ps, {},
       double(B * T * C));
    if (o_.hf_modeling && wpe_.w != kNone && m_.model_type != "bert") {
      // hf_modeling: the learned positions' lookup keeps its int64 position ids for the table's
      // backward (EmbeddingBackward0.indices): GPT-2's (1, T) from cache_position
      // (modeling_gpt2.py GPT2Model.forward), OPT's (B, T) from the attention mask's cumulative
      // sum (modeling_opt.py OPTDecoder.forward). The fused lookup derives them from t. BERT's
      // (and its token-type ids, when not given) are slices of registered buffers
      // (BertEmbeddings.position_ids, token_type_ids): buffers, not activations.
      const TensorId ids = tensor(name + ".pos_ids", {m_.model_type == "opt" ? B : 1, T}, 8,
                                  TensorKind::saved, layer);
      g_.ops.back().outputs.push_back(ids);
      pos_ids_[name == "enc.embed" ? 0 : 1] = ids;
    }
    TensorId x = emb;
    if (sp_) {
      // Sequence parallelism: the vocabulary-parallel lookup's partial sums are reduce-
      // scattered into the sequence shards (Megatron's embedding with
      // reduce_scatter_embeddings), the embedding's dropout on the shard.
      g_.tensors[static_cast<std::size_t>(emb)].kind = TensorKind::activation;
      x = outer_tensor(name + ".rs.out", C, aw, drop ? TensorKind::activation : TensorKind::saved, layer);
      sp_scatter(name + ".rs", emb, x, layer, Phase::forward);
    }
    if (embed_proj_.w != kNone) {  // OPT's project_in: saved as its input for the backward
      g_.tensors[static_cast<std::size_t>(emb)].kind = TensorKind::saved;
      embed_raw_ = emb;
      x = tensor(name + ".proj", {B, T, C}, ab, drop ? TensorKind::activation : TensorKind::saved,
                 layer);
      matmul(name + ".proj", emb, x, embed_proj_, layer, Phase::forward, E, C);
    }
    if (embed_norm_.w != kNone) {  // BLOOM's word_embeddings_layernorm, BERT's embeddings.LayerNorm
      g_.tensors[static_cast<std::size_t>(x)].kind = TensorKind::saved;
      x = norm(name + ".norm", x, layer, Phase::forward, TensorKind::saved, embed_norm_stats_,
               embed_norm_);
      embed_norm_in_ = g_.ops.back().inputs.front();
      if (drop) g_.tensors[static_cast<std::size_t>(x)].kind = TensorKind::activation;
    }
    if (!drop) return x;
    const TensorId mask = outer_tensor(name + ".drop.mask", C, 1, TensorKind::saved, layer);
    const TensorId out = outer_tensor(name + ".drop.out", C, g_.tensors[static_cast<std::size_t>(x)].elem_bytes,
                                      TensorKind::saved, layer);
    op(name + ".drop", OpKind::dropout, Phase::forward, layer, {x}, {out, mask}, {}, {}, {},
       double(tokens_of(x) * C));
    g_.ops.back().dropout_p = m_.embd_dropout;
    mask_out = mask;
    return out;
  }
  TensorId embed_norm_stats_ = kNone, embed_norm_in_ = kNone;
  TensorId embed_raw_ = kNone;  // the lookup's output, project_in's input (OPT)
  TensorId pos_ids_[2] = {kNone, kNone};  // hf_modeling: learned positions' ids (enc, dec)

  void embedding_bwd(TensorId tokens, TensorId dres, const std::string& name, TensorId mask) {
    std::vector<TensorId> gs = {wte_.g};
    if (wpe_.g != kNone) gs.push_back(wpe_.g);
    if (wtt_.g != kNone) gs.push_back(wtt_.g);
    const int layer = -1;
    if (mask != kNone) {
      op(name + ".drop.bwd", OpKind::dropout_bwd, Phase::backward, layer, {dres, mask}, {dres},
         {}, {}, {}, double(tokens_of(dres) * C));
      g_.ops.back().dropout_p = m_.embd_dropout;
    }
    TensorId d = dres;
    if (embed_norm_.w != kNone) {
      const TensorId dn = tensor(name + ".norm.d", {B, T, C}, ab, TensorKind::act_grad, layer);
      norm_bwd(name + ".norm", d, embed_norm_in_, embed_norm_stats_, dn, embed_norm_, layer);
      d = dn;
    }
    if (embed_proj_.w != kNone) {
      const TensorId de = tensor(name + ".proj.d", {B, T, E}, ab, TensorKind::act_grad, layer);
      matmul_bwd(name + ".proj", d, embed_raw_, de, embed_proj_, layer, E, C);
      d = de;
    }
    if (sharded(d)) d = sp_gather(name + ".bwd.ag", d, layer, Phase::backward);
    std::vector<TensorId> in = {d, tokens};
    const TensorId ids = pos_ids_[name == "enc.embed" ? 0 : 1];
    if (ids != kNone) in.push_back(ids);
    op(name + ".bwd", OpKind::embedding_bwd, Phase::backward, layer, in, {}, {}, {}, gs,
       double(B * T * C));
  }

  // T5: the relative position bias (1, NH, T, T), computed once per stack from the buckets and
  // the stack's first layer's table, added to every layer's scores.
  void position_bias(int64_t l, const std::string& stack) {
    const Param& p = blocks_[static_cast<std::size_t>(l)].rel_bias;
    // The bias lives while the stack's layers read it; the (T, T) int64 bucket indices are
    // saved for the table's backward (an embedding lookup).
    const TensorId b = tensor(stack + ".pos_bias", {NH, T, T}, ab, TensorKind::activation,
                              static_cast<int>(l));
    const TensorId buckets = tensor(stack + ".pos_buckets", {T, T}, 8, TensorKind::saved,
                                    static_cast<int>(l));
    op(stack + ".pos_bias", OpKind::position_bias, Phase::forward, static_cast<int>(l), {},
       {b, buckets}, {}, {p.w}, {}, double(NH * T * T));
    pos_bias_[stack == "enc" ? 0 : 1] = b;
    pos_buckets_[stack == "enc" ? 0 : 1] = buckets;
  }
  void position_bias_bwd(int64_t l, const std::string& stack) {
    const Param& p = blocks_[static_cast<std::size_t>(l)].rel_bias;
    const TensorId d = pos_bias_d_[stack == "enc" ? 0 : 1];
    if (d == kNone) return;
    op(stack + ".pos_bias.bwd", OpKind::position_bias_bwd, Phase::backward, static_cast<int>(l),
       {d, pos_buckets_[stack == "enc" ? 0 : 1]}, {}, {}, {}, {p.g}, double(NH * T * T));
  }
  TensorId pos_bias_d_[2] = {kNone, kNone};
  TensorId pos_buckets_[2] = {kNone, kNone};
  TensorId pos_bias_of(int64_t l) const {
    if (m_.positions != Positions::relative) return kNone;
    return pos_bias_[decoder_block(l) ? 1 : 0];
  }
  TensorId pos_bias_grad(int64_t l) {
    if (m_.positions != Positions::relative) return kNone;
    TensorId& d = pos_bias_d_[decoder_block(l) ? 1 : 0];
    if (d == kNone)
      d = tensor(decoder_block(l) ? "dec.pos_bias.d" : "enc.pos_bias.d", {NH, T, T}, ab,
                 TensorKind::act_grad, static_cast<int>(l));
    return d;
  }

  // layernorm / rmsnorm: saves its input (the caller's tensor), output and fp32 statistics
  // (mean and rstd for layernorm, rstd for rmsnorm: (B, T) each).
  TensorId norm(const std::string& name, TensorId in, int layer, Phase ph, TensorKind kind,
                TensorId& stats, const Param& p, int64_t part = 0) {
    const bool ln = m_.norm == Norm::layernorm;
    const Tensor& x = g_.tensors[static_cast<std::size_t>(in)];
    Shape shape = x.shape;
    if (part > 0) shape.back() = part;  // normalizes the first `part` features (MLA's kv_a)
    const int64_t width = shape.back();
    // Sequence parallelism: a sharded input's norm is sharded, statistics and all.
    const int64_t rows = sharded(in) ? shape[1] : T;
    stats = tensor(name + ".stats", {B, rows, ln ? 2 : 1}, 4, kind, layer, true);
    const TensorId out = tensor(name + ".out", shape, aw, kind, layer);
    if (sharded(in)) sharded_.insert(out);
    op(fmt::format("{}{}", name, ph == Phase::recompute ? ".re" : ""),
       ln ? OpKind::layernorm : OpKind::rmsnorm, ph, layer, {in}, {out, stats}, {}, {p.w}, {},
       8.0 * double(B * rows * width));
    return out;
  }
  void norm_bwd(const std::string& name, TensorId d_out, TensorId in, TensorId stats,
                TensorId dres, const Param& p, int layer) {
    // dres receives the input gradient: written fresh for the final norm, accumulated for
    // the blocks' norms (the residual stream gradient).
    const int64_t width = g_.tensors[static_cast<std::size_t>(in)].shape.back();
    op(name + ".bwd", m_.norm == Norm::layernorm ? OpKind::layernorm_bwd : OpKind::rmsnorm_bwd,
       Phase::backward, layer, {d_out, in, stats}, {dres}, {}, {p.w}, {p.g},
       12.0 * double(tokens_of(in) * width));
  }

  // Autocast (GraphOptions::autocast): the casts a forward (or recomputed) matmul `name` on
  // input `in` and weight `p` adds to its outputs (made by it) and inputs (a cached weight
  // cast made by an earlier matmul of the same pass: a tied embedding).
  void autocast_matmul(const std::string& name, TensorId in, const Param& p, int layer, Phase ph,
                       int64_t n_in, int64_t rows, std::vector<TensorId>& ins,
                       std::vector<TensorId>& outs) {
    if (!o_.autocast) return;
    // Under full recomputation the forward runs without autograd (torch.utils.checkpoint):
    // nothing it makes is kept for backward.
    const bool kept = !(ph == Phase::forward && o_.recompute == Recompute::full && layer >= 0 &&
                        layer < static_cast<int>(m_.n_blocks()));
    const TensorKind kind = kept ? TensorKind::saved : TensorKind::activation;
    const Tensor& x = g_.tensors[static_cast<std::size_t>(in)];
    if (x.elem_bytes == 4) {
      auto it = linears_.find(p.w);
      const int64_t copies = it == linears_.end() ? 1 : it->second;
      Shape shp = rows > 0 ? Shape{rows, n_in} : x.shape;
      shp.insert(shp.begin(), copies);
      const TensorId c = tensor(name + ".in16", shp, ab, kind, layer);
      outs.push_back(c);
      in16_[name] = c;
    }
    auto& casts = ph == Phase::recompute ? wcast_re_ : wcast_fwd_;
    auto it = casts.find(p.w);
    if (it != casts.end()) {
      ins.push_back(it->second);
      return;
    }
    const Tensor& w = g_.tensors[static_cast<std::size_t>(p.w)];
    const TensorId c = tensor(w.name + ".autocast", {static_cast<int64_t>(w.bytes / w.elem_bytes)},
                              ab, kind, layer);
    g_.tensors[static_cast<std::size_t>(c)].source = p.w;
    casts[p.w] = c;
    if (ph == Phase::forward) fwd_casts_.push_back(c);
    outs.push_back(c);
  }
  // What a matmul's backward reads under autocast: its 16-bit input copy (where it made one)
  // instead of the input, and the weight's cast of the pass it recomputes or of the forward.
  void autocast_matmul_bwd(const std::string& name, const Param& p, std::vector<TensorId>& ins) {
    if (!o_.autocast) return;
    auto c = in16_.find(name);
    if (c != in16_.end()) ins[1] = c->second;
    auto it = wcast_re_.find(p.w);
    if (it == wcast_re_.end()) it = wcast_fwd_.find(p.w);
    if (it == wcast_fwd_.end()) return;
    ins.push_back(it->second);
    casts_read_in_bwd_.insert(it->second);
  }

  // `aten`: what torch runs for it (read by the selective_op policy; every matmul in a block
  // says it).
  void matmul(const std::string& name, TensorId in, TensorId out, const Param& p, int layer,
              Phase ph, int64_t n_in, int64_t n_out, int64_t rows = 0, Aten aten = Aten::unset) {
    pending_aten_ = aten;
    const double r = rows > 0 ? double(rows) : double(B * T);
    const std::string re = ph == Phase::recompute ? ".re" : "";
    // Sequence parallelism: a sharded input is all-gathered first; a sharded output receives
    // the reduce-scatter of the whole product.
    if (sharded(in)) in = sp_gather(name + ".ag" + re, in, layer, ph);
    const TensorId sharded_out = sharded(out) ? out : kNone;
    if (sharded_out != kNone)
      out = tensor(name + ".partial", {B, T, n_out}, g_.tensors[static_cast<std::size_t>(out)].elem_bytes,
                   TensorKind::activation, layer);
    std::vector<TensorId> ins = {in}, outs = {out};
    autocast_matmul(name, in, p, layer, ph, n_in, rows, ins, outs);
    pending_aten_ = aten;
    op(fmt::format("{}{}", name, re), OpKind::matmul, ph, layer,
       ins, outs, {}, {p.w}, {}, 2.0 * r * double(n_in) * double(n_out));
    if (sharded_out != kNone) sp_scatter(name + ".rs" + re, out, sharded_out, layer, ph);
  }
  // dX = dY W^T and dW += X^T dY: twice the forward FLOPs.
  void matmul_bwd(const std::string& name, TensorId d_out, TensorId in, TensorId d_in,
                  const Param& p, int layer, int64_t n_in, int64_t n_out, int64_t rows = 0) {
    const double r = rows > 0 ? double(rows) : double(B * T);
    // Sequence parallelism: a row-parallel linear's sharded output gradient and a column-
    // parallel one's sharded input are all-gathered (the input again: only its shard was
    // kept); a sharded input gradient receives the reduce-scatter of the whole one.
    if (sharded(d_out)) d_out = sp_gather(name + ".bwd.ag_d", d_out, layer, Phase::backward);
    if (sharded(in)) in = sp_gather(name + ".bwd.ag", in, layer, Phase::backward);
    const TensorId sharded_d_in = sharded(d_in) ? d_in : kNone;
    if (sharded_d_in != kNone)
      d_in = tensor(name + ".d.partial", {B, T, n_in}, g_.tensors[static_cast<std::size_t>(d_in)].elem_bytes,
                    TensorKind::act_grad, layer);
    std::vector<TensorId> ins = {d_out, in};
    autocast_matmul_bwd(name, p, ins);
    op(name + ".bwd", OpKind::matmul_bwd, Phase::backward, layer, ins, {d_in}, {}, {p.w},
       {p.g}, 4.0 * r * double(n_in) * double(n_out));
    if (sharded_d_in != kNone) sp_scatter(name + ".bwd.rs", d_in, sharded_d_in, layer, Phase::backward);
  }

  TensorId partition_checkpoint(TensorId x, int l) {
    // P_a: each of the t model-parallel ranks keeps 1/t of the block input: a clone of its
    // slice (checkpointing.py partition_activations, item...narrow(...).clone()), made before
    // the block's forward; the input's own storage goes after it (arg.data = torch.empty([])).
    // With t = 1 the clone is the whole input, which the recomputation reads as it is
    // (gather_partitioned_activations: item.view(size), nothing gathered).
    const int64_t part = (B * T * C + o_.tp - 1) / o_.tp;
    const TensorId p = tensor(fmt::format("h.{}.ckpt.part", l), o_.tp > 1 ? Shape{part} : Shape{B, T, C},
                              ab, TensorKind::saved, l);
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

  // Keys each query attends to: T, or the sliding window where flash attention skips the
  // masked blocks (the eager path computes the whole T x T and masks it).
  double keys(int l) const {
    const int64_t w = m_.window.window_of(l);
    const int64_t Tk = cp_full_T_ > 0 ? cp_full_T_ : T;  // ring attention: every key
    return o_.flash_attention && w > 0 && w < Tk ? double(w) : double(Tk);
  }

  // The attention core: scores, softmax, dropout, attention x V (or one fused flash op).
  // `q_src` holds the (normed, rotated) queries and keys when they are not in `a.qkv`.
  void attention_core(const std::string& h, int l, Phase ph, TensorKind kind, BlockActs& a,
                      bool values) {
    const std::string re = ph == Phase::recompute ? ".re" : "";
    const double s2 = double(B * NH) * double(T) * double(T);
    std::vector<TensorId> src = qkv_of(a);
    if (a.qk != kNone) src.insert(src.begin(), a.qk);
    const TensorId bias = pos_bias_of(l);
    std::vector<TensorId> sin = src;
    if (bias != kNone) sin.push_back(bias);
    if (a.k_rep != kNone) sin.push_back(a.k_rep);
    // Autocast: BERT and transformers' eager attention add an fp32 mask (in the embeddings'
    // dtype) to the 16-bit scores, which promotes them; GPT-2 masks with a 16-bit torch.where.
    const uint32_t sb = m_.model_type == "gpt2" ? ab : aw;
    const TensorId preatt = tensor(h + ".attn.preatt", {B, NH, T, T}, sb, TensorKind::activation, l);
    op(h + ".attn.scores" + re, OpKind::attn_scores, ph, l, sin, {preatt}, {}, {}, {},
       2.0 * s2 * double(HS));
    TensorId scores = preatt;
    if (m_.attn_softcap > 0) {
      // Gemma 2's eager attention: cap * tanh(scores / cap); tanh's backward reads its output.
      a.att_tanh = tensor(h + ".attn.softcap", {B, NH, T, T}, ab, kind, l);
      scores = tensor(h + ".attn.capped", {B, NH, T, T}, ab, TensorKind::activation, l);
      op(h + ".attn.softcap" + re, OpKind::softcap, ph, l, {preatt}, {scores, a.att_tanh}, {}, {},
         {}, 4.0 * s2);
    }
    // hf_modeling, gpt-oss's sinks (modeling_gpt_oss.py eager_attention_forward): one sink
    // logit per head joins each row as a column T + 1, the row's max is subtracted (MaxBackward0
    // keeps its int64 indices) and the softmax's output, kept for its backward, has T + 1
    // columns; the probabilities are a view of its first T. The fused kernel folds the sink
    // into the normalizer.
    a.scores = scores;
    if (o_.softmax_keeps_input) {  // PyTorch before 1.11 (GraphOptions::softmax_keeps_input)
      g_.tensors[static_cast<std::size_t>(scores)].kind = kind;
      a.att_in = scores;
    }
    const bool sink_col = o_.hf_modeling && m_.attn_sinks;
    a.att = tensor(h + ".attn.att", {B, NH, T, sink_col ? T + 1 : T}, aw, kind, l);
    std::vector<TensorId> sm_out = {a.att};
    if (sink_col) {
      a.sink_idx = tensor(h + ".attn.sink_max", {B, NH, T, 1}, 8, kind, l);
      sm_out.push_back(a.sink_idx);
    }
    op(h + ".attn.softmax" + re, OpKind::softmax, ph, l, {scores}, sm_out, {}, {}, {}, 5.0 * s2);
    TensorId probs = a.att;
    if (o_.dropout && m_.attn_dropout > 0) {
      a.att_mask = tensor(h + ".attn.drop.mask", {B, NH, T, T}, 1, kind, l);
      a.att_drop = tensor(h + ".attn.drop.out", {B, NH, T, T}, ab, kind, l);
      op(h + ".attn.drop" + re, OpKind::dropout, ph, l, {a.att}, {a.att_drop, a.att_mask}, {}, {},
         {}, s2);
      g_.ops.back().dropout_p = m_.attn_dropout;
      probs = a.att_drop;
    }
    // Autocast without dropout: the values matmul casts the fp32 probabilities to 16 bits and
    // keeps the copy (with dropout, its 16-bit output above plays that part).
    const bool cast_probs = o_.autocast && g_.tensors[static_cast<std::size_t>(probs)].elem_bytes == 4;
    if (cast_probs)
      a.probs16 = tensor(h + ".attn.att.in16", g_.tensors[static_cast<std::size_t>(a.att)].shape,
                         ab, kind, l);
    if (values) {
      a.atty = tensor(h + ".attn.y", {B, T, QO}, ab, a.atty_kind, l);
      std::vector<TensorId> vin = qkv_of(a);
      vin.insert(vin.begin(), probs);
      if (a.v_rep != kNone) vin.push_back(a.v_rep);
      std::vector<TensorId> vout = {a.atty};
      if (cast_probs) vout.push_back(a.probs16);
      op(h + ".attn.values" + re, OpKind::attn_values, ph, l, vin, vout, {}, {}, {},
         2.0 * s2 * double(VS));
    } else if (cast_probs) {
      // Selective recomputation: the values product is not redone (its output is saved), but
      // the probabilities are its backward's input, so the recomputed core ends at dropout
      // (and under autocast at their 16-bit copy).
      g_.ops.back().outputs.push_back(a.probs16);
    }
  }

  // q|k|v of one block into a.qkv: one projection (MHA/GQA/MQA), or MLA's low-rank path;
  // then q/k norms and rotary embeddings.
  void qkv_projection(const std::string& h, int l, Phase ph, const Kinds& k, TensorId in,
                      BlockActs& a) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    const std::string re = ph == Phase::recompute ? ".re" : "";
    if (m_.attention == Attention::mla) {
      // DeepSeek-V2 sec. 2.1: q = W_qb norm(W_qa x) (or W_q x); [c_kv, k_rope] = W_kva x;
      // [k_nope, v] = W_kvb norm(c_kv). The core's q|k|v is assembled from q, k_nope with the
      // shared rotated k_rope, and v (what an implementation without weight absorption holds).
      const MlaSpec& s = m_.mla;
      const int64_t qdim = NH * HS;
      TensorId q_in = in;
      if (p.q_a.w != kNone) {
        a.q_a = tensor(h + ".attn.q_a", {B, T, s.q_lora_rank}, ab, k.block, l);
        matmul(h + ".attn.q_a", in, a.q_a, p.q_a, l, ph, C, s.q_lora_rank, 0,
               linear_aten(m_.qkv_bias));
        a.q_an = norm(h + ".attn.q_a_norm", a.q_a, l, ph, k.block, a.q_a_stats, p.q_a_norm);
        q_in = a.q_an;
      }
      a.q_lat = tensor(h + ".attn.q", {B, T, qdim}, ab, TensorKind::activation, l);
      matmul(h + ".attn.q", q_in, a.q_lat, p.q, l, ph, p.q_a.w != kNone ? s.q_lora_rank : C, qdim,
             0, Aten::mm);
      a.kv_a = tensor(h + ".attn.kv_a", {B, T, s.kv_lora_rank + s.qk_rope_head_dim}, ab, k.block, l);
      matmul(h + ".attn.kv_a", in, a.kv_a, p.kv_a, l, ph, C, s.kv_lora_rank + s.qk_rope_head_dim,
             0, linear_aten(m_.qkv_bias));
      a.kv_an = norm(h + ".attn.kv_a_norm", a.kv_a, l, ph, k.block, a.kv_a_stats, p.kv_a_norm,
                     s.kv_lora_rank);
      const int64_t kvb = NH * (s.qk_nope_head_dim + s.v_head_dim);
      a.kv_lat = tensor(h + ".attn.kv_b", {B, T, kvb}, ab, TensorKind::activation, l);
      matmul(h + ".attn.kv_b", a.kv_an, a.kv_lat, p.kv_b, l, ph, s.kv_lora_rank, kvb, 0, Aten::mm);
      a.qkv = tensor(h + ".attn.qkv", {B, T, QKV}, ab, k.block, l);
      op(h + ".attn.mla_assemble" + re, OpKind::concat, ph, l, {a.q_lat, a.kv_lat, a.kv_a},
         {a.qkv}, {}, {}, {}, double(B * T * QKV));
    } else if (o_.recompute == Recompute::selective_op && !m_.fused_qkv) {
      // q, k and v from three nn.Linear: SAC counts three matmuls.
      const int64_t widths[3] = {Q, KVH * HS, KVH * HS};
      const char* names[3] = {".attn.q", ".attn.k", ".attn.v"};
      for (int i = 0; i < 3; ++i) {
        a.qkv_parts.push_back(tensor(h + names[i], {B, T, widths[i]}, ab, k.block, l));
        matmul(h + names[i], in, a.qkv_parts.back(), p.qkv, l, ph, C, widths[i], 0,
               linear_aten(m_.qkv_bias));
      }
    } else {
      a.qkv = tensor(h + ".attn.qkv", {B, T, QKV}, ab, k.block, l);
      matmul(h + ".attn.qkv", in, a.qkv, p.qkv, l, ph, C, QKV, 0, linear_aten(m_.qkv_bias));
      if (o_.hf_modeling && m_.model_type == "falcon" && m_.n_kv_head < m_.n_head) {
        // hf_modeling: Falcon's multi-query and grouped layouts split the fused q|k|v with list
        // indices (modeling_falcon.py FalconAttention._split_heads: qkv[..., [-2]] and [-1]),
        // whose one-element int64 index tensors IndexBackward0 keeps.
        a.qkv_split = tensor(h + ".attn.qkv.split_idx", {2}, 8, k.block, l);
        g_.ops.back().outputs.push_back(a.qkv_split);
      }
    }
    if (m_.qk_norm != QkNorm::none) {
      // RMSNorm of q and k (per head or over the projection) into a tensor of their own; the
      // projection stays saved for the norms' backward and for v.
      const int64_t qk = Q + KVH * HS;
      const int64_t rows = m_.qk_norm == QkNorm::head ? NH + KVH : 2;
      a.qk = tensor(h + ".attn.qk_norm.out", {B, T, qk}, ab, k.block, l);
      a.qk_stats = tensor(h + ".attn.qk_norm.stats", {B, T, rows}, 4, k.block, l, true);
      op(h + ".attn.qk_norm" + re, m_.norm == Norm::layernorm ? OpKind::layernorm : OpKind::rmsnorm,
         ph, l, qkv_of(a), {a.qk, a.qk_stats}, {}, {p.qk_norm.w}, {}, 8.0 * double(B * T * qk));
    }
    if (m_.positions == Positions::rotary) {  // rotates q and k in place: the backward needs only the angles
      // (with separate projections, q and k)
      std::vector<TensorId> r = {a.qk};
      if (a.qk == kNone)
        r = a.qkv_parts.empty() ? std::vector<TensorId>{a.qkv}
                                : std::vector<TensorId>{a.qkv_parts[0], a.qkv_parts[1]};
      const int64_t rot = m_.attention == Attention::mla ? NH * m_.rotary_dim * 2
                                                         : (NH + KVH) * m_.rotary_dim;
      op(h + ".attn.rope" + re, OpKind::rope, ph, l, r, r, {}, {}, {},
         6.0 * double(B * T) * double(rot));
    }
  }

  // hf_modeling: transformers' repeat_kv (modeling_llama.py and each GQA family's copy of it)
  // copies the KVH key and value heads to all NH query heads before the attention reads them,
  // and the attention keeps the copies for its backward (eager: its two matmuls; SDPA: its
  // inputs); fused kernels read the shared heads. qkv still holds the KVH heads, so the graph
  // adds the copies beyond them: NH - KVH heads each of K and V.
  //   - Eager attention (eager_attention_forward) always copies.
  //   - SDPA (integrations/sdpa_attention.py sdpa_attention_forward, read at commits e2feb59b
  //     and 00c238bd) passes enable_gqa=True instead when use_gqa_in_sdpa: torch >= 2.5 (CUDA)
  //     and no attention mask. transformers passes no mask where SDPA's is_causal does the
  //     masking (masking_utils.py _ignore_causal_mask_sdpa: no padding, and no sliding window
  //     or one longer than the sequence, kv_length < local_attention_size), so under
  //     flash_attention (SDPA here) the copies are made only in sliding-window layers whose
  //     window the sequence reaches. Batches are taken unpadded (padding would materialize a
  //     mask in every layer); releases before use_gqa_in_sdpa copied for SDPA too.
  //   - Falcon broadcasts its key and value heads and flattens them to NH heads whatever the
  //     attention (modeling_falcon.py FalconAttention._split_heads): always copies.
  bool hf_repeat_kv(int l) const {
    if (!o_.hf_modeling || m_.attention != Attention::standard || KVH == NH) return false;
    if (!o_.flash_attention || m_.model_type == "falcon") return true;
    const int64_t w = m_.window.window_of(l);
    return w > 0 && T >= w;
  }
  void repeat_kv(const std::string& h, int l, Phase ph, const Kinds& k, BlockActs& a) {
    const Shape rep = {B, NH - KVH, T, HS};
    a.k_rep = tensor(h + ".attn.repeat_kv.k", rep, ab, k.block, l);
    a.v_rep = tensor(h + ".attn.repeat_kv.v", rep, ab, k.block, l);
    std::vector<TensorId> src = qkv_of(a);
    if (a.qk != kNone) src.insert(src.begin(), a.qk);
    op(h + ".attn.repeat_kv" + (ph == Phase::recompute ? ".re" : ""), OpKind::concat, ph, l, src,
       {a.k_rep, a.v_rep}, {}, {}, {}, 2.0 * double(B * T) * double((NH - KVH) * HS));
  }

  // Attention sublayer: input `in` (already normed where the recipe norms first), output the
  // projection (after its dropout).
  TensorId attention(const std::string& h, int l, Phase ph, const Kinds& k, TensorId in,
                     BlockActs& a) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    const std::string re = ph == Phase::recompute ? ".re" : "";
    qkv_projection(h, l, ph, k, in, a);
    if (hf_repeat_kv(l)) repeat_kv(h, l, ph, k, a);
    // DeepSpeed-Ulysses: the core runs in the heads view on q|k|v brought there by an
    // all-to-all (the normed q, k with v, one tensor), its output brought back after.
    std::optional<HeadsView> heads;
    const TensorId qkv_local = a.qkv, qk_local = a.qk;
    if (ulysses_cp_ > 1) {
      std::vector<TensorId> src_local = qkv_of(a);
      if (a.qk != kNone) src_local.insert(src_local.begin(), a.qk);
      heads.emplace(*this);
      a.qkv_u = ulysses_a2a(h + ".attn.ulysses.qkv" + re, src_local, {B, T, QKV}, k.block, l, ph);
      a.qkv = a.qkv_u;
      a.qk = kNone;
    }
    if (o_.flash_attention) {
      a.atty = tensor(h + ".attn.y", {B, T, QO}, ab, k.block, l);
      a.lse = tensor(h + ".attn.lse", {B, NH, T}, 4, k.block, l, true);
      std::vector<TensorId> src = qkv_of(a);
      if (a.qk != kNone) src.insert(src.begin(), a.qk);
      if (pos_bias_of(l) != kNone) src.push_back(pos_bias_of(l));
      if (a.k_rep != kNone) src.insert(src.end(), {a.k_rep, a.v_rep});
      op(h + ".attn.flash" + re, OpKind::flash_attention, ph, l, src, {a.atty, a.lse}, {}, {},
         {}, 2.0 * double(B * NH) * double(T) * keys(l) * double(HS + VS));
      if (cp_full_T_ > 0) g_.ops.back().comm_bytes = cp_kv_block() * static_cast<uint64_t>(o_.cp);
    } else {
      a.atty_kind = k.block;
      attention_core(h, l, ph, k.core, a, true);
    }
    if (p.sinks.w != kNone) g_.ops.back().params.push_back(p.sinks.w);
    if (heads) {
      a.qkv = qkv_local;
      a.qk = qk_local;
      a.atty_u = a.atty;
      heads.reset();
      a.atty = ulysses_a2a(h + ".attn.ulysses.y" + re, {a.atty_u}, {B, T, QO}, k.block, l, ph);
    }
    const bool rdrop = o_.dropout && m_.resid_dropout > 0;
    TensorId proj = outer_tensor(h + ".attn.proj", C, ab, TensorKind::activation, l);
    matmul(h + ".attn.proj", a.atty, proj, p.proj, l, ph, QO, C, 0, linear_aten(m_.out_bias));
    if (rdrop) {
      a.proj_mask = outer_tensor(h + ".attn.proj.drop.mask", C, 1, k.block, l);
      const TensorId dropped = outer_tensor(h + ".attn.proj.drop.out", C, ab, TensorKind::activation, l);
      op(h + ".attn.proj.drop" + re, OpKind::dropout, ph, l, {proj}, {dropped, a.proj_mask}, {}, {},
         {}, double(tokens_of(proj) * C));
      g_.ops.back().dropout_p = m_.resid_dropout;
      proj = dropped;
    }
    return proj;
  }

  // T5's cross-attention: queries from the decoder, keys and values from the encoder output.
  TensorId cross_attention(const std::string& h, int l, Phase ph, const Kinds& k, TensorId in,
                           BlockActs& a) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    const std::string re = ph == Phase::recompute ? ".re" : "";
    const int64_t Tk = T_enc;
    // T5's cross-attention has no biases (param_inventory.cpp cross_attention).
    a.cq = tensor(h + ".cross.q", {B, T, Q}, ab, k.block, l);
    matmul(h + ".cross.q", in, a.cq, p.cq, l, ph, C, Q, 0, Aten::mm);
    if (o_.recompute == Recompute::selective_op) {
      // k and v from two nn.Linear: SAC counts two matmuls.
      for (const char* n : {".cross.k", ".cross.v"}) {
        a.ckv_parts.push_back(tensor(h + n, {B, Tk, Q}, ab, k.block, l));
        matmul(h + n, enc_out_, a.ckv_parts.back(), p.ckv, l, ph, C, Q, B * Tk, Aten::mm);
      }
    } else {
      a.ckv = tensor(h + ".cross.kv", {B, Tk, 2 * Q}, ab, k.block, l);
      matmul(h + ".cross.kv", enc_out_, a.ckv, p.ckv, l, ph, C, 2 * Q, B * Tk);
    }
    std::vector<TensorId> qkv = ckv_of(a);
    qkv.insert(qkv.begin(), a.cq);
    const double s2 = double(B * NH) * double(T) * double(Tk);
    if (o_.flash_attention) {
      a.catty = tensor(h + ".cross.y", {B, T, Q}, ab, k.block, l);
      a.catt = tensor(h + ".cross.lse", {B, NH, T}, 4, k.block, l, true);
      op(h + ".cross.flash" + re, OpKind::flash_attention, ph, l, qkv, {a.catty, a.catt},
         {}, {}, {}, 4.0 * s2 * double(HS));
    } else {
      const TensorId pre = tensor(h + ".cross.preatt", {B, NH, T, Tk}, ab, TensorKind::activation, l);
      op(h + ".cross.scores" + re, OpKind::attn_scores, ph, l, qkv, {pre}, {}, {}, {},
         2.0 * s2 * double(HS));
      a.catt = tensor(h + ".cross.att", {B, NH, T, Tk}, ab, k.core, l);
      op(h + ".cross.softmax" + re, OpKind::softmax, ph, l, {pre}, {a.catt}, {}, {}, {}, 5.0 * s2);
      a.catty = tensor(h + ".cross.y", {B, T, Q}, ab, k.block, l);
      std::vector<TensorId> vin = ckv_of(a);
      vin.insert(vin.begin(), a.catt);
      op(h + ".cross.values" + re, OpKind::attn_values, ph, l, vin, {a.catty}, {}, {}, {},
         2.0 * s2 * double(HS));
    }
    const TensorId out = tensor(h + ".cross.proj", {B, T, C}, ab, TensorKind::activation, l);
    matmul(h + ".cross.proj", a.catty, out, p.cproj, l, ph, Q, C, 0, Aten::mm);
    return out;
  }

  bool relu() const { return m_.activation == "relu"; }

  // hf_modeling: what transformers' unfused activations keep beyond a fused kernel's input
  // (and, gated, up): the extra saved tensors of one MLP, each of the MLP's hidden shape.
  //   - gelu_new (activations.py NewGELUActivation, GPT-2, Phi, T5's gated-gelu) is the
  //     composition 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3)))): tanh keeps
  //     its output and the last product both factors, 0.5 * x and 1 + tanh (pow keeps x, the
  //     MLP's own input). A fused GELU keeps only x. (gelu_pytorch_tanh is one native op.)
  //   - A gated MLP written down(act(gate) * up) (modeling_llama.py LlamaMLP and kin): the
  //     product keeps act(gate) as well; a fused SwiGLU/GeGLU recomputes it from gate. With
  //     gelu_new as act, the composition's three come with it.
  //   - gpt-oss's clamped GLU (modeling_gpt_oss.py GptOssExperts.forward): gate.clamp(max=limit),
  //     glu = gate * sigmoid(gate * alpha), (up.clamp(-limit, limit) + 1) * glu keeps the
  //     clamped gate, sigmoid's output, up + 1 and glu (the clamps keep gate|up, the MLP's own).
  // A plain erf GELU keeps nothing more; nor does ReLU, plain or gated (relu keeps its output,
  // the one the product keeps, and not gate: the same count as the fused kernel's).
  std::vector<TensorId> hf_mlp_extras(const std::string& name, const Shape& shp, int l,
                                      TensorKind kind) {
    std::vector<TensorId> x;
    if (!o_.hf_modeling || relu()) return x;
    auto add = [&](const char* n) { x.push_back(tensor(name + n, shp, ab, kind, l)); };
    if (m_.mlp == Mlp::swiglu && m_.model_type == "gpt_oss") {
      for (const char* n : {".glu.gate_clamped", ".glu.sigmoid", ".glu.up_plus_1", ".glu.glu"})
        add(n);
      return x;
    }
    if (m_.mlp == Mlp::swiglu) add(".act");
    if (m_.activation == "gelu_new")
      for (const char* n : {".gelu_new.tanh", ".gelu_new.half_x", ".gelu_new.one_plus_tanh"})
        add(n);
    return x;
  }

  // The nn.Linear of one MLP as torch runs them (the selective_op policy's view): with biases
  // (aten.addmm) or not, gate and up in one weight or two; routed experts are grouped GEMMs.
  struct MlpLinears {
    bool bias = false, fused_gate_up = false, routed = false;
  };
  // A dense MLP (plain or gated) of width `width` on `in`: saves its hidden tensors (and, with
  // hf_modeling, the activation's extras into `hf`).
  TensorId dense_mlp(const std::string& name, int l, Phase ph, const Kinds& k, TensorId in,
                     const Param& fc, const Param& fc2, int64_t width, TensorId& fch,
                     TensorId& up, TensorId& act, std::vector<TensorId>& hf, MlpLinears lin,
                     int64_t rows = 0) {
    const std::string re = ph == Phase::recompute ? ".re" : "";
    const Shape shp = rows > 0 ? Shape{rows, width} : Shape{B, T, width};
    const double n = rows > 0 ? double(rows) : double(B * T);
    const Aten aten = lin.routed ? Aten::grouped_mm : linear_aten(lin.bias);
    if (m_.mlp == Mlp::gelu && relu()) {
      // ReLU's backward needs only its output (the mask is out > 0): fc dies in the forward.
      fch = tensor(name + ".fc", shp, ab, TensorKind::activation, l);
      matmul(name + ".fc", in, fch, fc, l, ph, C, width, rows, aten);
      act = tensor(name + ".relu", shp, ab, k.block, l);
      op(name + ".relu" + re, OpKind::relu, ph, l, {fch}, {act}, {}, {}, {}, n * double(width));
    } else if (m_.mlp == Mlp::gelu) {
      fch = tensor(name + ".fc", shp, ab, k.block, l);
      matmul(name + ".fc", in, fch, fc, l, ph, C, width, rows, aten);
      act = tensor(name + ".gelu", shp, ab, k.block, l);
      hf = hf_mlp_extras(name, shp, l, k.block);
      std::vector<TensorId> out = {act};
      out.insert(out.end(), hf.begin(), hf.end());
      op(name + ".gelu" + re, OpKind::gelu, ph, l, {fch}, out, {}, {}, {}, 10.0 * n * double(width));
    } else if (o_.recompute == Recompute::selective_op && !lin.routed && !lin.fused_gate_up) {
      // gate and up from two nn.Linear (gate first: LlamaMLP's down(act(gate(x)) * up(x)),
      // torchtitan's w2(silu(w1(x)) * w3(x))): SAC counts two matmuls.
      fch = tensor(name + ".gate", shp, ab, k.block, l);
      matmul(name + ".gate", in, fch, fc, l, ph, C, width, rows, aten);
      up = tensor(name + ".up", shp, ab, k.block, l);
      matmul(name + ".up", in, up, fc, l, ph, C, width, rows, aten);
    } else {
      if (sharded(in)) in = sp_gather(name + ".gate_up.ag" + re, in, l, ph);
      fch = tensor(name + ".gate", shp, ab, k.block, l);
      up = tensor(name + ".up", shp, ab, k.block, l);
      pending_aten_ = lin.routed ? Aten::grouped_mm : Aten::mm;  // a fused gate_up has no bias
      std::vector<TensorId> ins = {in}, outs = {fch, up};
      autocast_matmul(name + ".gate_up", in, fc, l, ph, C, rows, ins, outs);
      op(name + ".gate_up" + re, OpKind::matmul, ph, l, ins, outs, {}, {fc.w}, {},
         2.0 * n * double(C) * double(2 * width));
    }
    if (m_.mlp == Mlp::swiglu) {
      act = tensor(name + ".swiglu", shp, ab, k.block, l);
      hf = hf_mlp_extras(name, shp, l, k.block);
      std::vector<TensorId> out = {act};
      out.insert(out.end(), hf.begin(), hf.end());
      op(name + ".swiglu" + re, OpKind::swiglu, ph, l, {fch, up}, out, {}, {}, {},
         6.0 * n * double(width));
    }
    const TensorId out = rows > 0 ? tensor(name + ".proj", Shape{rows, C}, ab, TensorKind::activation, l)
                                  : outer_tensor(name + ".proj", C, ab, TensorKind::activation, l);
    matmul(name + ".proj", act, out, fc2, l, ph, width, C, rows, aten);
    return out;
  }
  // Its backward: d_out in, the input gradient written to (or accumulated into) d_in.
  void dense_mlp_bwd(const std::string& name, int l, TensorId d_out, TensorId in, Target& d_in,
                     const Param& fc, const Param& fc2, int64_t width, TensorId fch, TensorId up,
                     TensorId act, const std::vector<TensorId>& hf, int64_t rows = 0) {
    const Shape shp = rows > 0 ? Shape{rows, width} : Shape{B, T, width};
    const double n = rows > 0 ? double(rows) : double(B * T);
    const bool gelu = m_.mlp == Mlp::gelu;
    const TensorId d_act = tensor(name + (gelu ? (relu() ? ".relu.d" : ".gelu.d") : ".swiglu.d"),
                                  shp, ab, TensorKind::act_grad, l);
    matmul_bwd(name + ".proj", d_out, act, d_act, fc2, l, width, C, rows);
    TensorId din = need(d_in, l);
    if (gelu && relu()) {
      op(name + ".relu.bwd", OpKind::relu_bwd, Phase::backward, l, {d_act, act}, {d_act}, {}, {},
         {}, n * double(width));
      matmul_bwd(name + ".fc", d_act, in, din, fc, l, C, width, rows);
    } else if (gelu) {
      std::vector<TensorId> in_g = {d_act, fch};
      in_g.insert(in_g.end(), hf.begin(), hf.end());
      op(name + ".gelu.bwd", OpKind::gelu_bwd, Phase::backward, l, in_g, {d_act}, {}, {}, {},
         12.0 * n * double(width));
      matmul_bwd(name + ".fc", d_act, in, din, fc, l, C, width, rows);
    } else {
      Shape gu = shp;
      gu.back() = 2 * width;
      const TensorId d_gu = tensor(name + ".gate_up.d", gu, ab, TensorKind::act_grad, l);
      std::vector<TensorId> in_g = {d_act, fch, up};
      in_g.insert(in_g.end(), hf.begin(), hf.end());
      op(name + ".swiglu.bwd", OpKind::swiglu_bwd, Phase::backward, l, in_g, {d_gu}, {}, {}, {},
         10.0 * n * double(width));
      const TensorId din_sharded = sharded(din) ? din : kNone;
      if (sharded(in)) in = sp_gather(name + ".gate_up.bwd.ag", in, l, Phase::backward);
      if (din_sharded != kNone)
        din = tensor(name + ".gate_up.d.partial", {B, T, C}, g_.tensors[static_cast<std::size_t>(din)].elem_bytes,
                     TensorKind::act_grad, l);
      std::vector<TensorId> ins = {d_gu, in};
      autocast_matmul_bwd(name + ".gate_up", fc, ins);
      op(name + ".gate_up.bwd", OpKind::matmul_bwd, Phase::backward, l, ins, {din}, {},
         {fc.w}, {fc.g}, 4.0 * n * double(C) * double(2 * width));
      if (din_sharded != kNone) sp_scatter(name + ".gate_up.bwd.rs", din, din_sharded, l, Phase::backward);
    }
  }

  // Routed rows each rank's experts process per micro-step: top-k copies of its B*T tokens,
  // and with expert parallelism the rows the all-to-all brings from the other ranks: as many
  // as it sends (balanced routing) or, at worst, every rank's tokens choosing its experts.
  int64_t routed_rows() const { return models::routed_rows(m_, o_, B * T); }

  // Mixture of experts: router, top-k, dispatch of the routed rows to the experts, the experts'
  // gated MLPs on those rows, the weighted combine; shared experts on every token.
  TensorId moe(const std::string& h, int l, Phase ph, const Kinds& k, TensorId in, BlockActs& a) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    const std::string re = ph == Phase::recompute ? ".re" : "";
    const int64_t Ex = m_.moe.n_experts, K = m_.moe.top_k, R = routed_rows();
    const TensorId logits = tensor(h + ".moe.router", {B, T, Ex}, ab, TensorKind::activation, l);
    matmul(h + ".moe.router", in, logits, p.router, l, ph, C, Ex, 0, Aten::router_mm);
    // hf_modeling: transformers' dropless MoE blocks (modeling_mixtral.py
    // MixtralSparseMoeBlock.forward, Qwen2-/Qwen3-MoE's copies, modeling_deepseek_v3.py
    // DeepseekV3MoE.moe, modeling_gpt_oss.py GptOssExperts.forward) route with torch.topk,
    // whose indices are int64, and loop over the experts: per expert, torch.where on the
    // one-hot mask gives the (token, slot) index pair of each of its rows (one int64 (rows, 2)
    // storage, kept by the gathers and index_add_), and index_add_ keeps its source, the
    // weighted expert output (IndexAddBackward0 keeps `source`), one (rows, C) tensor more than
    // a combine that reads the expert outputs and weights. DeepSeek accumulates in the fp32 of
    // its router's weights (zeros_like(..., dtype=topk_weights.dtype)). A renormalizing router
    // (hf_topk_renorm) keeps the top-k weights before the division and their sum, in fp32.
    // gpt-oss's router (GptOssTopKRouter.forward) takes top-k of the logits and softmaxes
    // those k in the logits' precision: it keeps (B, T, k) probabilities, not (B, T, E). With a
    // capacity factor DeepSpeed-MoE's gating replaces the loop: none of this applies.
    const bool hf_loop = o_.hf_modeling && o_.moe_capacity_factor <= 0;
    const bool oss = hf_loop && m_.model_type == "gpt_oss";
    a.r_probs = tensor(h + ".moe.probs", {B, T, oss ? K : Ex}, oss ? ab : 4, k.block, l);
    // The top-k indices: int32 in fused routers; torch.topk's are int64 (transformers' loop,
    // and torchtitan's router, whose per-op policy keeps them).
    const bool idx64 = hf_loop || o_.recompute == Recompute::selective_op;
    a.r_idx = tensor(h + ".moe.topk", {B, T, K}, idx64 ? 8 : 4, k.block, l);
    a.r_w = tensor(h + ".moe.weights", {B, T, K}, 4, k.block, l);
    std::vector<TensorId> route_out = {a.r_probs, a.r_idx, a.r_w};
    if (hf_loop && hf_renorm_) {
      a.r_topk = tensor(h + ".moe.topk_weights", {B, T, K}, 4, k.block, l);
      a.r_sum = tensor(h + ".moe.topk_sum", {B, T, 1}, 4, k.block, l);
      route_out.insert(route_out.end(), {a.r_topk, a.r_sum});
    }
    if (o_.moe_capacity_factor > 0) {
      // DeepSpeed's einsum gating: dispatch "sec,sm->ecm" and combine "sec,ecm->sm" save the
      // (S, E, capacity) mask and weights, cast to the activation type (type_as(input)).
      const int64_t cap = moe_capacity(m_, o_, B * T);
      a.r_mask = tensor(h + ".moe.dispatch_mask", {B * T, Ex, cap}, ab, k.block, l);
      a.r_combine = tensor(h + ".moe.combine_weights", {B * T, Ex, cap}, ab, k.block, l);
      route_out.push_back(a.r_mask);
      route_out.push_back(a.r_combine);
    }
    op(h + ".moe.route" + re, OpKind::moe_route, ph, l, {logits}, route_out, {}, {}, {},
       6.0 * double(B * T * Ex));
    a.xe = tensor(h + ".moe.dispatch", {R, C}, ab, k.block, l);
    std::vector<TensorId> dispatch_out = {a.xe};
    if (hf_loop) {
      a.e_pairs = tensor(h + ".moe.expert_idx", {R, 2}, 8, k.block, l);
      dispatch_out.push_back(a.e_pairs);
    }
    op(h + ".moe.dispatch" + re, OpKind::moe_dispatch, ph, l,
       {in, a.r_mask != kNone ? a.r_mask : a.r_idx}, dispatch_out, {}, {}, {}, double(R * C));
    a.ye = dense_mlp(h + ".moe.experts", l, ph, k, a.xe, p.e_fc, p.e_proj, Fe, a.e_gate, a.e_up,
                     a.e_act, a.e_act_hf, MlpLinears{m_.moe.expert_bias, m_.fused_gate_up, true}, R);
    g_.tensors[static_cast<std::size_t>(a.ye)].kind = k.block;  // the combine's backward reads it
    TensorId out = tensor(h + ".moe.out", {B, T, C}, ab, TensorKind::activation, l);
    std::vector<TensorId> combine_in = {a.ye, a.r_combine != kNone ? a.r_combine : a.r_w, a.r_idx};
    std::vector<TensorId> combine_out = {out};
    if (hf_loop) {
      const bool deepseek = m_.model_type == "deepseek_v2" || m_.model_type == "deepseek_v3";
      a.e_src = tensor(h + ".moe.combine.src", {R, C}, deepseek ? 4 : ab, k.block, l);
      combine_in.push_back(a.e_pairs);
      combine_out.push_back(a.e_src);
    }
    op(h + ".moe.combine" + re, OpKind::moe_combine, ph, l, combine_in, combine_out, {}, {}, {},
       2.0 * double(R * C));
    if (p.s_fc.w != kNone) {
      // Shared experts: unbiased, gate and up apart (param_inventory.cpp mlp).
      TensorId s_out = dense_mlp(h + ".moe.shared", l, ph, k, in, p.s_fc, p.s_proj, Fs, a.s_gate,
                                 a.s_up, a.s_act, a.s_act_hf, MlpLinears{});
      if (p.s_gate.w != kNone) {
        // Qwen2-MoE: sigmoid(x W_g) scales the shared expert's output; both are saved.
        g_.tensors[static_cast<std::size_t>(s_out)].kind = k.block;
        a.s_out = s_out;
        a.s_g = tensor(h + ".moe.shared.gate", {B, T, 1}, ab, k.block, l);
        matmul(h + ".moe.shared.gate", in, a.s_g, p.s_gate, l, ph, C, 1, 0, Aten::mm);
        const TensorId gated = tensor(h + ".moe.shared.gated", {B, T, C}, ab, TensorKind::activation, l);
        op(h + ".moe.shared.scale" + re, OpKind::gate_mul, ph, l, {s_out, a.s_g}, {gated}, {}, {},
           {}, 5.0 * double(B * T * C));
        s_out = gated;
      }
      const TensorId sum = tensor(h + ".moe.sum", {B, T, C}, ab, TensorKind::activation, l);
      op(h + ".moe.sum" + re, OpKind::residual, ph, l, {out, s_out}, {sum}, {}, {}, {},
         double(B * T * C));
      out = sum;
    }
    return out;
  }
  void moe_bwd(const std::string& h, int l, const BlockActs& a, TensorId d_out, TensorId in,
               Target& d_in) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    const int64_t Ex = m_.moe.n_experts, K = m_.moe.top_k, R = routed_rows();
    // Shared experts first (they were added last), writing d_in; the routed path accumulates.
    if (p.s_fc.w != kNone) {
      TensorId d_s = d_out;
      if (p.s_gate.w != kNone) {
        d_s = tensor(h + ".moe.shared.d", {B, T, C}, ab, TensorKind::act_grad, l);
        const TensorId d_g = tensor(h + ".moe.shared.gate.d", {B, T, 1}, ab, TensorKind::act_grad, l);
        op(h + ".moe.shared.scale.bwd", OpKind::gate_mul_bwd, Phase::backward, l,
           {d_out, a.s_out, a.s_g}, {d_s, d_g}, {}, {}, {}, 6.0 * double(B * T * C));
        matmul_bwd(h + ".moe.shared.gate", d_g, in, need(d_in, l), p.s_gate, l, C, 1);
      }
      dense_mlp_bwd(h + ".moe.shared", l, d_s, in, d_in, p.s_fc, p.s_proj, Fs, a.s_gate, a.s_up,
                    a.s_act, a.s_act_hf);
    }
    const TensorId d_ye = tensor(h + ".moe.experts.proj.d", {R, C}, ab, TensorKind::act_grad, l);
    const TensorId d_w = tensor(h + ".moe.weights.d", {B, T, K}, 4, TensorKind::act_grad, l);
    std::vector<TensorId> combine_in = {d_out, a.ye, a.r_combine != kNone ? a.r_combine : a.r_w,
                                        a.r_idx};
    if (a.e_src != kNone) combine_in.insert(combine_in.end(), {a.e_src, a.e_pairs});
    op(h + ".moe.combine.bwd", OpKind::moe_combine_bwd, Phase::backward, l, combine_in,
       {d_ye, d_w}, {}, {}, {}, 4.0 * double(R * C));
    Target d_xe = target(tensor(h + ".moe.dispatch.d", {R, C}, ab, TensorKind::act_grad, l));
    dense_mlp_bwd(h + ".moe.experts", l, d_ye, a.xe, d_xe, p.e_fc, p.e_proj, Fe, a.e_gate,
                  a.e_up, a.e_act, a.e_act_hf, R);
    std::vector<TensorId> dispatch_in = {d_xe.id, a.r_mask != kNone ? a.r_mask : a.r_idx};
    if (a.e_pairs != kNone) dispatch_in.push_back(a.e_pairs);
    op(h + ".moe.dispatch.bwd", OpKind::moe_dispatch_bwd, Phase::backward, l, dispatch_in,
       {need(d_in, l)}, {}, {}, {}, double(R * C));
    const TensorId d_logits = tensor(h + ".moe.router.d", {B, T, Ex}, ab, TensorKind::act_grad, l);
    std::vector<TensorId> route_in = {d_w, a.r_probs, a.r_idx};
    if (a.r_topk != kNone) route_in.insert(route_in.end(), {a.r_topk, a.r_sum});
    op(h + ".moe.route.bwd", OpKind::moe_route_bwd, Phase::backward, l, route_in, {d_logits}, {},
       {}, {}, 6.0 * double(B * T * Ex));
    matmul_bwd(h + ".moe.router", d_logits, in, need(d_in, l), p.router, l, C, Ex);
  }

  // The MLP sublayer: dense or MoE, then the residual dropout.
  TensorId mlp(const std::string& h, int l, Phase ph, const Kinds& k, TensorId in, BlockActs& a) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    const std::string re = ph == Phase::recompute ? ".re" : "";
    TensorId out = m_.moe.is_moe_layer(l)
                       ? moe(h, l, ph, k, in, a)
                       : dense_mlp(h + ".mlp", l, ph, k, in, p.fc, p.fc2, F, a.fch, a.up, a.act,
                                   a.act_hf, MlpLinears{m_.mlp_bias, m_.fused_gate_up, false});
    if (o_.dropout && m_.resid_dropout > 0) {
      a.mlp_mask = outer_tensor(h + ".mlp.drop.mask", C, 1, k.block, l);
      const TensorId dropped = outer_tensor(h + ".mlp.drop.out", C, ab, TensorKind::activation, l);
      op(h + ".mlp.drop" + re, OpKind::dropout, ph, l, {out}, {dropped, a.mlp_mask}, {}, {}, {},
         double(tokens_of(out) * C));
      g_.ops.back().dropout_p = m_.resid_dropout;
      out = dropped;
    }
    return out;
  }
  void mlp_bwd(const std::string& h, int l, const BlockActs& a, TensorId d_out, TensorId in,
               Target& d_in) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    TensorId d = d_out;
    if (a.mlp_mask != kNone) {
      d = outer_tensor(h + ".mlp.drop.d", C, ab, TensorKind::act_grad, l);
      op(h + ".mlp.drop.bwd", OpKind::dropout_bwd, Phase::backward, l, {d_out, a.mlp_mask}, {d},
         {}, {}, {}, double(tokens_of(d) * C));
      g_.ops.back().dropout_p = m_.resid_dropout;
    }
    if (m_.moe.is_moe_layer(l))
      moe_bwd(h, l, a, d, in, d_in);
    else
      dense_mlp_bwd(h + ".mlp", l, d, in, d_in, p.fc, p.fc2, F, a.fch, a.up, a.act, a.act_hf);
  }

  TensorId residual(const std::string& name, int l, Phase ph, std::vector<TensorId> in,
                    TensorKind kind) {
    const TensorId out = outer_tensor(name, C, aw, kind, l);
    op(name + (ph == Phase::recompute ? ".re" : ""), OpKind::residual, ph, l, std::move(in), {out},
       {}, {}, {}, double(tokens_of(out) * C));
    return out;
  }

  // A sublayer's post norm (sandwich, post_sublayer): the sublayer's output `raw` is kept for
  // the norm's backward; the normed output only feeds the residual.
  TensorId post_norm(const std::string& name, TensorId raw, int l, Phase ph, const Kinds& k,
                     TensorId& raw_out, TensorId& stats, const Param& p) {
    g_.tensors[static_cast<std::size_t>(raw)].kind = k.block;
    raw_out = raw;
    return norm(name, raw, l, ph, TensorKind::activation, stats, p);
  }

  BlockActs block(int l, TensorId x, Phase ph, Kinds k) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    const std::string h = fmt::format("h.{}", l);
    BlockActs a;
    a.x = x;
    // The block output is the next block's input: saved (a checkpoint under full
    // recomputation); a recomputed output is not needed and dies at once.
    const TensorKind out_kind = ph == Phase::recompute ? TensorKind::activation : TensorKind::saved;
    if (m_.residual == Residual::parallel) {
      a.n1 = norm(h + ".norm1", x, l, ph, k.block, a.n1_stats, p.n1);
      const TensorId att = attention(h, l, ph, k, a.n1, a);
      a.n2 = a.n1;
      if (p.n2.w != kNone) a.n2 = norm(h + ".norm2", x, l, ph, k.block, a.n2_stats, p.n2);
      const TensorId mo = mlp(h, l, ph, k, a.n2, a);
      a.out = residual(h + ".out", l, ph, {x, att, mo}, out_kind);
      return a;
    }
    switch (m_.norm_place) {
      case NormPlace::pre:
      case NormPlace::sandwich: {
        const bool sw = m_.norm_place == NormPlace::sandwich;
        a.n1 = norm(h + ".norm1", x, l, ph, k.block, a.n1_stats, p.n1);
        TensorId att = attention(h, l, ph, k, a.n1, a);
        if (sw) att = post_norm(h + ".norm1.post", att, l, ph, k, a.attn_raw, a.attn_post_stats, p.n1_post);
        a.res2 = residual(h + ".res2", l, ph, {x, att}, k.block);
        TensorId r = a.res2;
        if (decoder_block(l)) {
          a.nx = norm(h + ".normx", r, l, ph, k.block, a.nx_stats, p.nx);
          const TensorId c = cross_attention(h, l, ph, k, a.nx, a);
          a.res3 = residual(h + ".res3", l, ph, {r, c}, k.block);
          r = a.res3;
        }
        a.n2 = norm(h + ".norm2", r, l, ph, k.block, a.n2_stats, p.n2);
        TensorId mo = mlp(h, l, ph, k, a.n2, a);
        if (sw) mo = post_norm(h + ".norm2.post", mo, l, ph, k, a.mlp_raw, a.mlp_post_stats, p.n2_post);
        a.out = residual(h + ".out", l, ph, {r, mo}, out_kind);
        return a;
      }
      case NormPlace::post_sublayer: {
        const TensorId att = post_norm(h + ".norm1.post", attention(h, l, ph, k, x, a), l, ph, k,
                                       a.attn_raw, a.attn_post_stats, p.n1_post);
        a.res2 = residual(h + ".res2", l, ph, {x, att}, k.block);
        const TensorId mo = post_norm(h + ".norm2.post", mlp(h, l, ph, k, a.res2, a), l, ph, k,
                                      a.mlp_raw, a.mlp_post_stats, p.n2_post);
        a.out = residual(h + ".out", l, ph, {a.res2, mo}, out_kind);
        return a;
      }
      case NormPlace::post_residual: {
        const TensorId att = attention(h, l, ph, k, x, a);
        a.res1 = residual(h + ".res1", l, ph, {x, att}, k.block);
        a.res2 = norm(h + ".norm1", a.res1, l, ph, k.block, a.res1_stats, p.n1);
        const TensorId mo = mlp(h, l, ph, k, a.res2, a);
        a.res_out = residual(h + ".res_out", l, ph, {a.res2, mo}, k.block);
        a.out = norm(h + ".norm2", a.res_out, l, ph, out_kind, a.out_stats, p.n2);
        return a;
      }
    }
    return a;
  }

  // ---- the heads and the loss ----

  // The mean cross-entropy of `logits` (rows of classes: (B, T, V) or (B, n_labels)) against
  // `targets`. Fused: one op turns the fp32 logits into probabilities in place; returns kNone.
  // hf_modeling: transformers' loss (src/transformers/loss/loss_utils.py ForCausalLMLoss, which
  // LlamaForCausalLM.forward and its kin call as self.loss_function(logits=logits,
  // labels=labels, vocab_size=...); read at commits 0114da07 and d0fed636, the same in both):
  // `logits = logits.float()`, a new fp32 tensor where the model computes in 16 bits and the
  // same tensor in fp32, then nn.functional.cross_entropy, which is log_softmax (autograd keeps
  // its output for its own backward and nll_loss's) and nll_loss (the mean over the rows).
  // `lb` is the loss's precision: 4 where the logits are upcast, the model's (ab) where the
  // modeling code applies CrossEntropyLoss to its logits as they are (T5, BERT). Nothing keeps
  // the 16-bit logits for backward; the model's output still holds them, which a loop that
  // keeps only the loss (the Trainer's compute_loss) drops before backward. Returns the
  // log-probabilities.
  TensorId loss_forward(const std::string& p, TensorId logits, TensorId targets, uint32_t lb,
                        int layer) {
    const Shape shape = g_.tensors[static_cast<std::size_t>(logits)].shape;
    const Shape rows(shape.begin(), shape.end() - 1);
    int64_t n_rows = 1;
    for (int64_t d : rows) n_rows *= d;
    const double cells = double(n_rows * shape.back());
    if (!o_.hf_modeling) {
      const TensorId losses = tensor(p + "losses", rows, 4, TensorKind::activation, layer);
      op(p + "cross_entropy", OpKind::cross_entropy, Phase::forward, layer, {logits, targets},
         {logits, losses}, {}, {}, {}, 5.0 * cells);
      return kNone;
    }
    TensorId logits32 = logits;
    if (lb != ab) {
      logits32 = tensor(p + "logits.f32", shape, 4, TensorKind::logits, layer);
      op(p + "loss.upcast", OpKind::cross_entropy, Phase::forward, layer, {logits}, {logits32},
         {}, {}, {}, 0.0);
    }
    const TensorId logprobs = tensor(p + "logprobs", shape, lb, TensorKind::logits, layer);
    op(p + "loss.log_softmax", OpKind::cross_entropy, Phase::forward, layer, {logits32},
       {logprobs}, {}, {}, {}, 4.0 * cells);
    if (o_.softmax_keeps_input) log_softmax_in_[logprobs] = logits32;
    const TensorId loss = tensor(p + "loss", {1}, 4, TensorKind::activation, layer);
    op(p + "loss.nll", OpKind::cross_entropy, Phase::forward, layer, {logprobs, targets},
       {loss}, {}, {}, {}, double(n_rows));
    return logprobs;
  }
  // Its backward, to the logits' gradient. Fused: in place where activations are fp32; with
  // 16-bit activations a tensor of its own in the activation type: the head's backward
  // multiplies it with 16-bit weights and inputs, and a GEMM's two inputs share one type
  // (cublasGemmEx); PyTorch likewise hands the head a 16-bit gradient of the logits.
  // hf_modeling, in autograd's order: nll_loss's backward scatters -1/N into a new gradient of
  // the log-probabilities (NllLossBackward0, which keeps them for their shape); log_softmax's
  // backward writes the logits' gradient into another new tensor (grad - exp(logprobs) *
  // sum(grad)), both in the loss's precision; where the loss was upcast, .float()'s backward
  // (ToCopyBackward0) casts it to the model's precision for the head.
  TensorId loss_backward(const std::string& p, TensorId logits, TensorId logprobs,
                         TensorId targets, int layer) {
    const Shape shape = g_.tensors[static_cast<std::size_t>(logits)].shape;
    int64_t n_rows = 1;
    for (std::size_t i = 0; i + 1 < shape.size(); ++i) n_rows *= shape[i];
    const double cells = double(n_rows * shape.back());
    if (!o_.hf_modeling) {
      const TensorId d = ab == 4 ? logits : tensor(p + "logits.d", shape, ab, TensorKind::logits, layer);
      op(p + "cross_entropy.bwd", OpKind::cross_entropy_bwd, Phase::backward, layer,
         {logits, targets}, {d}, {}, {}, {}, 2.0 * cells);
      return d;
    }
    const uint32_t lb = g_.tensors[static_cast<std::size_t>(logprobs)].elem_bytes;
    const TensorId d_logprobs = tensor(p + "logprobs.d", shape, lb, TensorKind::logits, layer);
    op(p + "loss.nll.bwd", OpKind::cross_entropy_bwd, Phase::backward, layer,
       {logprobs, targets}, {d_logprobs}, {}, {}, {}, double(n_rows));
    TensorId d = tensor(p + (lb == ab ? "logits.d" : "logits.f32.d"), shape, lb,
                        TensorKind::logits, layer);
    std::vector<TensorId> in_lsm = {d_logprobs, logprobs};
    if (auto it = log_softmax_in_.find(logprobs); it != log_softmax_in_.end())
      in_lsm.push_back(it->second);
    op(p + "loss.log_softmax.bwd", OpKind::cross_entropy_bwd, Phase::backward, layer, in_lsm, {d},
       {}, {}, {}, 3.0 * cells);
    if (lb != ab) {
      const TensorId d32 = d;
      d = tensor(p + "logits.d", shape, ab, TensorKind::logits, layer);
      op(p + "loss.upcast.bwd", OpKind::cross_entropy_bwd, Phase::backward, layer, {d32}, {d},
         {}, {}, {}, 0.0);
    }
    return d;
  }

  // The LM head on the last block's output x: the final norm, OPT's project_out, the logits
  // (Gemma 2's softcap) and the loss, then their backward. Returns d(x).
  TensorId lm_head(TensorId x, TensorId targets, int head_layer) {
    TensorId nf_stats = kNone;
    TensorId nf = x;
    if (final_norm_.w != kNone)
      nf = norm("lnf", x, head_layer, Phase::forward, TensorKind::saved, nf_stats, final_norm_);
    TensorId head_in = nf;
    if (head_proj_.w != kNone) {
      head_in = tensor("head.proj", {B, T, E}, ab, TensorKind::saved, head_layer);
      matmul("head.proj", nf, head_in, head_proj_, head_layer, Phase::forward, C, E);
    }
    // The fused cross-entropy's logits are fp32 (the head's GEMM writes them so) and become its
    // probabilities in place; Hugging Face's LM head (an nn.Linear) returns them in the model's
    // precision.
    const double btv = double(B * T * V);
    const TensorId logits = tensor("logits", {B, T, V}, o_.hf_modeling ? ab : 4,
                                   TensorKind::logits, head_layer);
    matmul("lm_head", head_in, logits, lm_head_, head_layer, Phase::forward, E, V);
    TensorId logits_tanh = kNone;
    if (m_.final_softcap > 0) {
      // Gemma 2 caps the logits (in place here); tanh's output, in the model's precision, is
      // saved for its backward (HF: logits / cap, tanh, * cap before the loss).
      logits_tanh = tensor("logits.softcap", {B, T, V}, ab, TensorKind::saved, head_layer);
      op("logits.softcap", OpKind::softcap, Phase::forward, head_layer, {logits},
         {logits, logits_tanh}, {}, {}, {}, 4.0 * btv);
    }
    // T5 (modeling_t5.py T5ForConditionalGeneration.forward) applies CrossEntropyLoss to its
    // logits as they are: no upcast, the loss in the model's precision.
    const TensorId logprobs =
        loss_forward("", logits, targets, m_.encoder_decoder() && !o_.autocast ? ab : 4, head_layer);

    const TensorId dlogits = loss_backward("", logits, logprobs, targets, head_layer);
    if (logits_tanh != kNone)
      op("logits.softcap.bwd", OpKind::softcap_bwd, Phase::backward, head_layer,
         {dlogits, logits_tanh}, {dlogits}, {}, {}, {}, 3.0 * btv);
    TensorId d_head_in = outer_tensor(head_proj_.w != kNone ? "head.proj.d" : "lnf.d", E,
                                      g_.tensors[static_cast<std::size_t>(head_in)].elem_bytes,
                                      TensorKind::act_grad, head_layer);
    matmul_bwd("lm_head", dlogits, head_in, d_head_in, lm_head_, head_layer, E, V);
    TensorId d_nf = d_head_in;
    if (head_proj_.w != kNone) {
      d_nf = tensor("lnf.d", {B, T, C}, aw, TensorKind::act_grad, head_layer);
      matmul_bwd("head.proj", d_head_in, nf, d_nf, head_proj_, head_layer, C, E);
    }
    if (final_norm_.w == kNone) return d_nf;
    TensorId dres = outer_tensor("dresidual", C, aw, TensorKind::act_grad, head_layer);
    norm_bwd("lnf", d_nf, x, nf_stats, dres, final_norm_, head_layer);
    return dres;
  }

  // BERT's heads on the last block's output x (modeling_bert.py, read at commit 8ec58104),
  // then their backward; returns d(x).
  //   - BertPooler: dense and tanh (whose backward reads its output) on each sequence's first
  //     token. The slice is a view: the dense's backward keeps x whole, which is the last
  //     block's output and saved anyway.
  //   - BertForSequenceClassification: dropout (classifier_dropout, else hidden_dropout_prob)
  //     and the classifier, (B, n_labels) logits; BertForPreTraining's seq_relationship is the
  //     same on 2 classes, without the dropout.
  //   - BertLMPredictionHead: dense, the activation and a LayerNorm on every token, then the
  //     decoder (the word embedding, tied) with its own bias: (B, T, V) logits.
  // Each loss is CrossEntropyLoss on the logits as they are (logits.view(-1, num_labels) and
  // .view(-1, vocab_size)): no upcast, the model's precision under hf_modeling; two are added.
  // Backward in autograd's order: the classifier's (created last) and the pooler's, then the
  // MLM head's, accumulating into d(x).
  TensorId bert_heads(TensorId x, TensorId targets, TensorId cls_targets, int hl) {
    const bool hf = o_.hf_modeling;
    const double bc = double(B * C), btc = double(B * T * C);
    TensorId pooled = kNone, cls_in = kNone, cls_mask = kNone, cls_logits = kNone;
    TensorId cls_logprobs = kNone;
    const int64_t N = m_.n_labels;
    if (cls_.w != kNone) {
      const TensorId pre = tensor("head.pooler.dense", {B, C}, ab, TensorKind::activation, hl);
      matmul("head.pooler.dense", x, pre, pooler_, hl, Phase::forward, C, C, B);
      pooled = tensor("head.pooler.tanh", {B, C}, ab, TensorKind::saved, hl);
      op("head.pooler.tanh", OpKind::tanh, Phase::forward, hl, {pre}, {pooled}, {}, {}, {}, bc);
    }
    TensorId fc = kNone, act = kNone, mlm_out = kNone, mlm_stats = kNone, logits = kNone;
    TensorId logprobs = kNone;
    std::vector<TensorId> act_hf;
    const Shape btc_shape = {B, T, C};
    if (m_.head == Head::mlm) {
      fc = tensor("head.mlm.dense", btc_shape, ab, relu() ? TensorKind::activation : TensorKind::saved,
                  hl);
      matmul("head.mlm.dense", x, fc, mlm_dense_, hl, Phase::forward, C, C);
      act = tensor(relu() ? "head.mlm.relu" : "head.mlm.gelu", btc_shape, ab, TensorKind::saved, hl);
      act_hf = hf_mlp_extras("head.mlm", btc_shape, hl, TensorKind::saved);
      std::vector<TensorId> out = {act};
      out.insert(out.end(), act_hf.begin(), act_hf.end());
      op(relu() ? "head.mlm.relu" : "head.mlm.gelu", relu() ? OpKind::relu : OpKind::gelu,
         Phase::forward, hl, {fc}, out, {}, {}, {}, (relu() ? 1.0 : 10.0) * btc);
      mlm_out = norm("head.mlm.norm", act, hl, Phase::forward, TensorKind::saved, mlm_stats,
                     mlm_norm_);
      logits = tensor("logits", {B, T, V}, hf ? ab : 4, TensorKind::logits, hl);
      matmul("head.mlm.decoder", mlm_out, logits, lm_head_, hl, Phase::forward, C, V);
      g_.ops.back().params.push_back(mlm_bias_.w);
      logprobs = loss_forward("", logits, targets, aw, hl);
    }
    if (cls_.w != kNone) {
      cls_in = pooled;
      if (o_.dropout && m_.cls_dropout > 0) {
        cls_mask = tensor("head.cls.drop.mask", {B, C}, 1, TensorKind::saved, hl);
        cls_in = tensor("head.cls.drop.out", {B, C}, ab, TensorKind::saved, hl);
        op("head.cls.drop", OpKind::dropout, Phase::forward, hl, {pooled}, {cls_in, cls_mask}, {},
           {}, {}, bc);
        g_.ops.back().dropout_p = m_.cls_dropout;
      }
      cls_logits = tensor("cls.logits", {B, N}, hf ? ab : 4, TensorKind::logits, hl);
      matmul("head.cls", cls_in, cls_logits, cls_, hl, Phase::forward, C, N, B);
      cls_logprobs = loss_forward("cls.", cls_logits, cls_targets, aw, hl);
    }

    const TensorId dres = tensor("dresidual", btc_shape, aw, TensorKind::act_grad, hl);
    if (cls_.w != kNone) {
      const TensorId d_logits = loss_backward("cls.", cls_logits, cls_logprobs, cls_targets, hl);
      const TensorId d = tensor("head.pooler.d", {B, C}, ab, TensorKind::act_grad, hl);
      matmul_bwd("head.cls", d_logits, cls_in, d, cls_, hl, C, N, B);
      if (cls_mask != kNone) {
        op("head.cls.drop.bwd", OpKind::dropout_bwd, Phase::backward, hl, {d, cls_mask}, {d}, {},
           {}, {}, bc);
        g_.ops.back().dropout_p = m_.cls_dropout;
      }
      op("head.pooler.tanh.bwd", OpKind::tanh_bwd, Phase::backward, hl, {d, pooled}, {d}, {}, {},
         {}, 3.0 * bc);
      matmul_bwd("head.pooler.dense", d, x, dres, pooler_, hl, C, C, B);
    }
    if (m_.head == Head::mlm) {
      const TensorId d_logits = loss_backward("", logits, logprobs, targets, hl);
      const TensorId d_out = tensor("head.mlm.norm.d", btc_shape, aw, TensorKind::act_grad, hl);
      matmul_bwd("head.mlm.decoder", d_logits, mlm_out, d_out, lm_head_, hl, C, V);
      g_.ops.back().grads.push_back(mlm_bias_.g);
      const TensorId d_act = tensor(relu() ? "head.mlm.relu.d" : "head.mlm.gelu.d", btc_shape, ab,
                                    TensorKind::act_grad, hl);
      norm_bwd("head.mlm.norm", d_out, act, mlm_stats, d_act, mlm_norm_, hl);
      if (relu()) {
        op("head.mlm.relu.bwd", OpKind::relu_bwd, Phase::backward, hl, {d_act, act}, {d_act}, {},
           {}, {}, btc);
      } else {
        std::vector<TensorId> in_g = {d_act, fc};
        in_g.insert(in_g.end(), act_hf.begin(), act_hf.end());
        op("head.mlm.gelu.bwd", OpKind::gelu_bwd, Phase::backward, hl, in_g, {d_act}, {}, {}, {},
           12.0 * btc);
      }
      matmul_bwd("head.mlm.dense", d_act, x, dres, mlm_dense_, hl, C, C);
    }
    return dres;
  }

  void recompute_core(int l, BlockActs& a) {
    if (ulysses_cp_ > 1) {  // the core in the heads view, on the all-to-all's q|k|v
      const TensorId qkv_local = a.qkv, qk_local = a.qk, atty = a.atty;
      a.qkv = a.qkv_u;
      a.qk = kNone;
      a.atty = a.atty_u;
      {
        HeadsView heads(*this);
        attention_core(fmt::format("h.{}", l), l, Phase::recompute, TensorKind::saved, a, false);
      }
      a.qkv = qkv_local;
      a.qk = qk_local;
      a.atty = atty;
      return;
    }
    attention_core(fmt::format("h.{}", l), l, Phase::recompute, TensorKind::saved, a, false);
  }

  // Backward of the attention sublayer from d_out (the projection's output gradient) to the
  // gradient of its input, written to (or accumulated into) d_in.
  void attention_bwd(const std::string& h, int l, const BlockActs& a, TensorId d_out,
                     TensorId in, Target& d_in) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    TensorId d_proj = d_out;
    if (a.proj_mask != kNone) {
      d_proj = outer_tensor(h + ".attn.proj.drop.d", C, ab, TensorKind::act_grad, l);
      op(h + ".attn.proj.drop.bwd", OpKind::dropout_bwd, Phase::backward, l, {d_out, a.proj_mask},
         {d_proj}, {}, {}, {}, double(B * T * C));
      g_.ops.back().dropout_p = m_.resid_dropout;
    }
    const TensorId d_atty_local = tensor(h + ".attn.y.d", {B, T, QO}, ab, TensorKind::act_grad, l);
    matmul_bwd(h + ".attn.proj", d_proj, a.atty, d_atty_local, p.proj, l, QO, C);
    const TensorId d_qkv_local = tensor(h + ".attn.qkv.d", {B, T, QKV}, ab, TensorKind::act_grad, l);
    // DeepSpeed-Ulysses: the core's backward in the heads view (the output's gradient brought
    // there by an all-to-all, q|k|v's taken back by another), on the core's own tensors.
    TensorId d_atty = d_atty_local, d_qkv = d_qkv_local;
    BlockActs u = a;
    std::optional<HeadsView> heads;
    if (ulysses_cp_ > 1) {
      u.qkv = a.qkv_u;
      u.qk = kNone;
      u.atty = a.atty_u;
      heads.emplace(*this);
      d_atty = ulysses_a2a(h + ".attn.ulysses.y.d", {d_atty_local}, {B, T, QO}, TensorKind::act_grad, l,
                           Phase::backward);
      d_qkv = tensor(h + ".attn.ulysses.qkv.d", {B, T, QKV}, ab, TensorKind::act_grad, l);
    }
    const BlockActs& c = u;
    const double s2 = double(B * NH) * double(T) * double(T);
    std::vector<TensorId> src = qkv_of(c);
    if (c.qk != kNone) src.insert(src.begin(), c.qk);
    const TensorId bias = pos_bias_of(l);
    // hf_modeling: the copies' gradients, summed back into the shared heads (repeat_kv.bwd).
    const TensorId d_rep = c.k_rep == kNone ? kNone
                           : tensor(h + ".attn.repeat_kv.d", {B, 2 * (NH - KVH), T, HS}, ab,
                                    TensorKind::act_grad, l);
    if (o_.flash_attention) {
      // FlashAttention-2's backward keeps an fp32 dQ accumulator and per-row softmax sums.
      const TensorId dq_acc = tensor(h + ".attn.flash.dq_accum", {B, T, Q}, 4, TensorKind::workspace, l);
      const TensorId dsum = tensor(h + ".attn.flash.dsum", {B, NH, T}, 4, TensorKind::workspace, l);
      std::vector<TensorId> in_f = {d_atty};
      in_f.insert(in_f.end(), src.begin(), src.end());
      in_f.push_back(c.atty);
      in_f.push_back(c.lse);
      if (d_rep != kNone) in_f.insert(in_f.end(), {c.k_rep, c.v_rep});
      std::vector<TensorId> out_f = {d_qkv};
      if (bias != kNone) out_f.push_back(pos_bias_grad(l));
      if (d_rep != kNone) out_f.push_back(d_rep);
      op(h + ".attn.flash.bwd", OpKind::flash_attention_bwd, Phase::backward, l, in_f, out_f,
         {dq_acc, dsum}, {}, {}, 2.5 * 2.0 * double(B * NH) * double(T) * keys(l) * double(HS + VS));
      if (cp_full_T_ > 0) g_.ops.back().comm_bytes = cp_kv_block() * 2 * 2;  // two blocks of kv and dkv
    } else {
      const TensorId probs = c.probs16 != kNone ? c.probs16 : c.att_drop != kNone ? c.att_drop : c.att;
      const Tensor& att = g_.tensors[static_cast<std::size_t>(c.att)];
      const Shape att_shape = att.shape;
      // transformers' eager attention is autograd's ops: each backward writes a new gradient in
      // its tensor's dtype and the one it read dies after it (at most two (B, NH, T, T)
      // gradients at once); the fused core updates one in place. Under autocast the 16-bit
      // probabilities' gradient is cast back to fp32 (ToCopyBackward0) by the op reading it.
      const bool hf = o_.hf_modeling;
      auto grad_like = [&](const char* n, TensorId like) {
        return tensor(h + n, att_shape, g_.tensors[static_cast<std::size_t>(like)].elem_bytes,
                      TensorKind::act_grad, l);
      };
      TensorId d_att = hf ? grad_like(".attn.probs.d", probs)
                          : tensor(h + ".attn.att.d", att_shape, att.elem_bytes, TensorKind::act_grad, l);
      std::vector<TensorId> in_v = {d_atty, probs}, out_v = {d_att, d_qkv};
      for (TensorId t : qkv_of(c)) in_v.push_back(t);
      if (d_rep != kNone) {
        in_v.push_back(c.v_rep);
        out_v.push_back(d_rep);
      }
      op(h + ".attn.values.bwd", OpKind::attn_values_bwd, Phase::backward, l, in_v, out_v, {}, {},
         {}, 4.0 * s2 * double(VS));
      if (c.att_mask != kNone) {
        const TensorId d_drop = hf ? grad_like(".attn.drop.d", c.att) : d_att;
        op(h + ".attn.drop.bwd", OpKind::dropout_bwd, Phase::backward, l, {d_att, c.att_mask},
           {d_drop}, {}, {}, {}, s2);
        g_.ops.back().dropout_p = m_.attn_dropout;
        d_att = d_drop;
      }
      std::vector<TensorId> in_sm = {d_att, c.att};
      if (c.sink_idx != kNone) in_sm.push_back(c.sink_idx);
      if (c.att_in != kNone) in_sm.push_back(c.att_in);
      const TensorId d_scores = hf ? grad_like(".attn.scores.d", c.scores) : d_att;
      op(h + ".attn.softmax.bwd", OpKind::softmax_bwd, Phase::backward, l, in_sm, {d_scores}, {},
         {}, {}, 4.0 * s2);
      d_att = d_scores;
      if (c.att_tanh != kNone)
        op(h + ".attn.softcap.bwd", OpKind::softcap_bwd, Phase::backward, l, {d_att, c.att_tanh},
           {d_att}, {}, {}, {}, 3.0 * s2);
      std::vector<TensorId> in_s = {d_att};
      in_s.insert(in_s.end(), src.begin(), src.end());
      if (d_rep != kNone) in_s.push_back(c.k_rep);
      std::vector<TensorId> out_s = {d_qkv};
      if (bias != kNone) out_s.push_back(pos_bias_grad(l));
      if (d_rep != kNone) out_s.push_back(d_rep);
      op(h + ".attn.scores.bwd", OpKind::attn_scores_bwd, Phase::backward, l, in_s, out_s, {},
         {}, {}, 4.0 * s2 * double(HS));
    }
    if (p.sinks.g != kNone) g_.ops.back().grads.push_back(p.sinks.g);
    if (heads) {
      heads.reset();
      op(h + ".attn.ulysses.qkv.bwd", OpKind::cp_all_to_all, Phase::backward, l, {d_qkv},
         {d_qkv_local}, {}, {}, {}, 0.0);
      d_qkv = d_qkv_local;
    }
    if (d_rep != kNone)
      op(h + ".attn.repeat_kv.bwd", OpKind::concat_bwd, Phase::backward, l, {d_rep}, {d_qkv}, {},
         {}, {}, 2.0 * double(B * T) * double((NH - KVH) * HS));
    if (m_.positions == Positions::rotary) {
      const int64_t rot = m_.attention == Attention::mla ? NH * m_.rotary_dim * 2
                                                         : (NH + KVH) * m_.rotary_dim;
      op(h + ".attn.rope.bwd", OpKind::rope_bwd, Phase::backward, l, {d_qkv}, {d_qkv}, {}, {}, {},
         6.0 * double(B * T) * double(rot));
    }
    if (a.qk != kNone) {
      const int64_t qk = Q + KVH * HS;
      std::vector<TensorId> in_n = {d_qkv};
      for (TensorId t : qkv_of(a)) in_n.push_back(t);
      in_n.push_back(a.qk_stats);
      op(h + ".attn.qk_norm.bwd", m_.norm == Norm::layernorm ? OpKind::layernorm_bwd
                                                             : OpKind::rmsnorm_bwd,
         Phase::backward, l, in_n, {d_qkv}, {}, {p.qk_norm.w}, {p.qk_norm.g},
         12.0 * double(B * T * qk));
    }
    if (m_.attention == Attention::mla) {
      const MlaSpec& s = m_.mla;
      const int64_t kvb = NH * (s.qk_nope_head_dim + s.v_head_dim);
      const int64_t qdim = NH * HS;
      const TensorId d_q = tensor(h + ".attn.q.d", {B, T, qdim}, ab, TensorKind::act_grad, l);
      const TensorId d_kvb = tensor(h + ".attn.kv_b.d", {B, T, kvb}, ab, TensorKind::act_grad, l);
      const TensorId d_kva = tensor(h + ".attn.kv_a.d", {B, T, s.kv_lora_rank + s.qk_rope_head_dim},
                                    ab, TensorKind::act_grad, l);
      op(h + ".attn.mla_assemble.bwd", OpKind::concat_bwd, Phase::backward, l, {d_qkv},
         {d_q, d_kvb, d_kva}, {}, {}, {}, double(B * T * QKV));
      const TensorId d_kvan = tensor(h + ".attn.kv_a_norm.d", {B, T, s.kv_lora_rank}, ab,
                                     TensorKind::act_grad, l);
      matmul_bwd(h + ".attn.kv_b", d_kvb, a.kv_an, d_kvan, p.kv_b, l, s.kv_lora_rank, kvb);
      norm_bwd(h + ".attn.kv_a_norm", d_kvan, a.kv_a, a.kv_a_stats, d_kva, p.kv_a_norm, l);
      matmul_bwd(h + ".attn.kv_a", d_kva, in, need(d_in, l), p.kv_a, l, C,
                 s.kv_lora_rank + s.qk_rope_head_dim);
      if (p.q_a.w != kNone) {
        const TensorId d_qan = tensor(h + ".attn.q_a_norm.d", {B, T, s.q_lora_rank}, ab,
                                      TensorKind::act_grad, l);
        matmul_bwd(h + ".attn.q", d_q, a.q_an, d_qan, p.q, l, s.q_lora_rank, qdim);
        const TensorId d_qa = tensor(h + ".attn.q_a.d", {B, T, s.q_lora_rank}, ab,
                                     TensorKind::act_grad, l);
        norm_bwd(h + ".attn.q_a_norm", d_qan, a.q_a, a.q_a_stats, d_qa, p.q_a_norm, l);
        matmul_bwd(h + ".attn.q_a", d_qa, in, need(d_in, l), p.q_a, l, C, s.q_lora_rank);
      } else {
        matmul_bwd(h + ".attn.q", d_q, in, need(d_in, l), p.q, l, C, qdim);
      }
      return;
    }
    matmul_bwd(h + ".attn.qkv", d_qkv, in, need(d_in, l), p.qkv, l, C, QKV);
    if (a.qkv_split != kNone) g_.ops.back().inputs.push_back(a.qkv_split);
  }

  void cross_attention_bwd(const std::string& h, int l, const BlockActs& a, TensorId d_out,
                           Target& d_in) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    const int64_t Tk = T_enc;
    const double s2 = double(B * NH) * double(T) * double(Tk);
    const TensorId d_y = tensor(h + ".cross.y.d", {B, T, Q}, ab, TensorKind::act_grad, l);
    matmul_bwd(h + ".cross.proj", d_out, a.catty, d_y, p.cproj, l, Q, C);
    const TensorId d_q = tensor(h + ".cross.q.d", {B, T, Q}, ab, TensorKind::act_grad, l);
    const TensorId d_kv = tensor(h + ".cross.kv.d", {B, Tk, 2 * Q}, ab, TensorKind::act_grad, l);
    const std::vector<TensorId> kv = ckv_of(a);
    auto with_kv = [&](std::vector<TensorId> head, std::vector<TensorId> tail = {}) {
      head.insert(head.end(), kv.begin(), kv.end());
      head.insert(head.end(), tail.begin(), tail.end());
      return head;
    };
    if (o_.flash_attention) {
      op(h + ".cross.flash.bwd", OpKind::flash_attention_bwd, Phase::backward, l,
         with_kv({d_y, a.cq}, {a.catty, a.catt}), {d_q, d_kv}, {}, {}, {},
         2.5 * 4.0 * s2 * double(HS));
    } else {
      const TensorId d_att = tensor(h + ".cross.att.d", {B, NH, T, Tk}, ab, TensorKind::act_grad, l);
      op(h + ".cross.values.bwd", OpKind::attn_values_bwd, Phase::backward, l,
         with_kv({d_y, a.catt}), {d_att, d_kv}, {}, {}, {}, 4.0 * s2 * double(HS));
      op(h + ".cross.softmax.bwd", OpKind::softmax_bwd, Phase::backward, l, {d_att, a.catt},
         {d_att}, {}, {}, {}, 4.0 * s2);
      op(h + ".cross.scores.bwd", OpKind::attn_scores_bwd, Phase::backward, l,
         with_kv({d_att, a.cq}), {d_q, d_kv}, {}, {}, {}, 4.0 * s2 * double(HS));
    }
    matmul_bwd(h + ".cross.kv", d_kv, enc_out_, d_enc_, p.ckv, l, C, 2 * Q, B * Tk);
    matmul_bwd(h + ".cross.q", d_q, a.nx, need(d_in, l), p.cq, l, C, Q);
  }

  // A sublayer's post norm (sandwich, post_sublayer): from d(out) to d(sublayer output).
  TensorId post_norm_bwd(const std::string& name, TensorId d_out, TensorId raw, TensorId stats,
                         const Param& p, int l) {
    const TensorId d = tensor(name + ".d", {B, T, C}, ab, TensorKind::act_grad, l);
    norm_bwd(name, d_out, raw, stats, d, p, l);
    return d;
  }

  // Backward of one block, mirroring block() in reverse. dres holds d(block output) on entry
  // and d(block input) on exit.
  void block_bwd(int l, const BlockActs& a, TensorId dres) {
    const BlockParams& p = blocks_[static_cast<std::size_t>(l)];
    const std::string h = fmt::format("h.{}", l);
    Target into_dres = target(dres);
    if (m_.residual == Residual::parallel) {
      // out = x + attn(n1) + mlp(n2): both sublayers read d(out); their input gradients meet
      // in one norm gradient (shared norm) or two, which the norms add into dres.
      Target d_n2 = target(h + ".norm2.d");
      mlp_bwd(h, l, a, dres, a.n2, d_n2);
      if (p.n2.w != kNone) {
        Target d_n1 = target(h + ".norm1.d");
        attention_bwd(h, l, a, dres, a.n1, d_n1);
        norm_bwd(h + ".norm2", d_n2.id, a.x, a.n2_stats, dres, p.n2, l);
        norm_bwd(h + ".norm1", d_n1.id, a.x, a.n1_stats, dres, p.n1, l);
      } else {
        attention_bwd(h, l, a, dres, a.n1, d_n2);
        norm_bwd(h + ".norm1", d_n2.id, a.x, a.n1_stats, dres, p.n1, l);
      }
      return;
    }
    switch (m_.norm_place) {
      case NormPlace::pre:
      case NormPlace::sandwich: {
        const bool sw = m_.norm_place == NormPlace::sandwich;
        const TensorId d_mo =
            sw ? post_norm_bwd(h + ".norm2.post", dres, a.mlp_raw, a.mlp_post_stats, p.n2_post, l)
               : dres;
        Target d_n2 = target(h + ".norm2.d");
        mlp_bwd(h, l, a, d_mo, a.n2, d_n2);
        const TensorId r = decoder_block(l) ? a.res3 : a.res2;
        norm_bwd(h + ".norm2", d_n2.id, r, a.n2_stats, dres, p.n2, l);
        if (decoder_block(l)) {
          Target d_nx = target(h + ".normx.d");
          cross_attention_bwd(h, l, a, dres, d_nx);
          norm_bwd(h + ".normx", d_nx.id, a.res2, a.nx_stats, dres, p.nx, l);
        }
        const TensorId d_att =
            sw ? post_norm_bwd(h + ".norm1.post", dres, a.attn_raw, a.attn_post_stats, p.n1_post, l)
               : dres;
        Target d_n1 = target(h + ".norm1.d");
        attention_bwd(h, l, a, d_att, a.n1, d_n1);
        norm_bwd(h + ".norm1", d_n1.id, a.x, a.n1_stats, dres, p.n1, l);
        return;
      }
      case NormPlace::post_sublayer: {
        const TensorId d_mo =
            post_norm_bwd(h + ".norm2.post", dres, a.mlp_raw, a.mlp_post_stats, p.n2_post, l);
        mlp_bwd(h, l, a, d_mo, a.res2, into_dres);
        const TensorId d_att =
            post_norm_bwd(h + ".norm1.post", dres, a.attn_raw, a.attn_post_stats, p.n1_post, l);
        attention_bwd(h, l, a, d_att, a.x, into_dres);
        return;
      }
      case NormPlace::post_residual: {
        // In place on dres: through the output norm, the MLP (added back), the first norm and
        // the attention (added back).
        norm_bwd(h + ".norm2", dres, a.res_out, a.out_stats, dres, p.n2, l);
        mlp_bwd(h, l, a, dres, a.res2, into_dres);
        norm_bwd(h + ".norm1", dres, a.res1, a.res1_stats, dres, p.n1, l);
        attention_bwd(h, l, a, dres, a.x, into_dres);
        return;
      }
    }
  }
};

}  // namespace

int64_t moe_capacity(const ModelSpec& m, const GraphOptions& o, int64_t tokens) {
  if (!m.is_moe() || o.moe_capacity_factor <= 0) return 0;
  // sharded_moe.py _capacity with capacity_factor * k (topkgating):
  // ceil(tokens / E * cf * k), at least min_capacity.
  const double cap = std::ceil(double(tokens) * double(m.moe.top_k) * o.moe_capacity_factor /
                               double(m.moe.n_experts));
  if (!(cap < 9e18)) throw Error("--moe-capacity-factor: the expert capacity overflows");
  return std::max<int64_t>(o.moe_min_capacity, static_cast<int64_t>(cap));
}

int64_t routed_rows(const ModelSpec& m, const GraphOptions& o, int64_t tokens) {
  if (!m.is_moe()) return 0;
  const int64_t k = m.moe.top_k;
  if (o.moe_capacity_factor > 0)
    return checked_mul(m.moe.n_experts, moe_capacity(m, o, tokens), "routed rows");
  if (o.ep > 1 && o.moe_worst_case) {
    // Every token of every rank of the expert-parallel group sends this rank as many of its
    // k choices as it has experts.
    const int64_t local = m.moe.n_experts / o.ep;
    return checked_mul(checked_mul(o.ep, tokens, "routed rows"), std::min(k, local),
                       "routed rows");
  }
  return checked_mul(k, tokens, "routed rows");
}

std::vector<std::pair<int64_t, int64_t>> stage_blocks(int64_t n_blocks, int64_t pp, int64_t chunks,
                                                      int64_t stage) {
  if (pp < 1 || chunks < 1 || n_blocks % (pp * chunks) != 0)
    throw Error(fmt::format("--pp {} --vp {}: {} layers are not divisible into {} model chunks", pp,
                            chunks, n_blocks, pp * chunks),
                "each model chunk holds the same number of blocks; choose --pp x --vp dividing "
                "the layer count");
  const int64_t per_chunk = n_blocks / (pp * chunks);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t first = (c * pp + stage) * per_chunk;
    out.push_back({first, first + per_chunk});
  }
  return out;
}

TrainingGraph build_training_graph(const ModelSpec& m, const GraphOptions& o_in) {
  GraphOptions o = o_in;
  if (o.seq == 0) o.seq = m.n_positions;
  if (o.batch < 1) throw Error(fmt::format("--micro-batch: must be >= 1, got {}", o.batch));
  if (o.seq < 1) throw Error(fmt::format("--seq: must be >= 1, got {}", o.seq));
  if (o.tp < 1) throw Error(fmt::format("--tp: must be >= 1, got {}", o.tp));
  if (o.ep < 1) throw Error(fmt::format("--ep: must be >= 1, got {}", o.ep));
  if (o.pp < 1) throw Error(fmt::format("--pp: must be >= 1, got {}", o.pp));
  if (o.pp_chunks < 1) throw Error(fmt::format("--vp: must be >= 1, got {}", o.pp_chunks));
  if (o.pp_stage < 0 || o.pp_stage >= o.pp)
    throw Error(fmt::format("pipeline stage {} of --pp {}: out of range", o.pp_stage, o.pp));
  if (o.ep > 1 && !m.is_moe())
    throw Error(fmt::format("--ep {}: {} has no experts to place", o.ep, m.name),
                "expert parallelism applies to Mixture-of-Experts models; leave out --ep");
  if (!(o.moe_capacity_factor >= 0) || !std::isfinite(o.moe_capacity_factor))
    throw Error(fmt::format("--moe-capacity-factor: must be >= 0, got {}", o.moe_capacity_factor),
                "0 routes every token (dropless); DeepSpeed's default capacity_factor is 1.0");
  if (o.seq_target < 0) throw Error(fmt::format("--target-seq: must be >= 1, got {}", o.seq_target));
  // torchtitan's MoE (torchtitan/models/moe/moe.py) is dropless; with expert parallelism its
  // policy also keeps the all-to-alls' outputs, of which the graph holds only the dispatch's.
  if (o.recompute == Recompute::selective_op && o.ep > 1)
    throw Error(fmt::format("--checkpointing selective-op with --ep {}: not modelled", o.ep),
                "torchtitan's policy keeps both all-to-alls' outputs under expert parallelism; "
                "use --ep 1 or --checkpointing full");
  // Under autocast the casts before each matmul are ops of their own, recomputed where the
  // product is kept; the graph folds them into the matmul.
  if (o.recompute == Recompute::selective_op && o.autocast)
    throw Error("--checkpointing selective-op with autocast on fp32 weights: not modelled",
                "plan it with 16-bit weights (--master-weights bf16, or --profile fsdp), or "
                "with --checkpointing full");
  if (o.recompute == Recompute::selective_op && o.moe_capacity_factor > 0)
    throw Error("--checkpointing selective-op with --moe-capacity-factor: not modelled",
                "torchtitan's MoE, whose policy this is, drops no tokens; leave out "
                "--moe-capacity-factor");
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
