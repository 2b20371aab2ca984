// zp/models/graph.hpp: the training computation graph of one micro-step of a decoder
// transformer (or an encoder-decoder, or BERT's encoder with its heads) built from its recipe, plus the optimizer step, as a Boost.Graph: ops are
// vertices, tensors flow along edges. Shapes, dtypes, bytes, kinds and FLOPs; no memory
// policy (the planner decides lifetimes, placement and ZeRO buffers) and no arithmetic.
//
// Example usage:
//   GraphOptions o; o.batch = 1; o.seq = 1024; o.act_bytes = 2;
//   TrainingGraph g = build_training_graph(load_model("gpt2"), o);
//   for (OpId op : g.order) fmt::print("{} {}\n", g.ops[op].name, g.ops[op].flops);
//
// Dimension letters: B batch, T sequence, C hidden, NH heads, KVH key/value heads, HS head
// size, F MLP width, V vocabulary, L layers; with tensor parallelism t, each rank holds NH/t
// heads and F/t MLP columns (Megatron's column/row split).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <boost/graph/adjacency_list.hpp>

#include "zp/models/model_spec.hpp"

namespace zp::models {

using TensorId = int32_t;
using OpId = int32_t;

enum class TensorKind : uint8_t {
  param,      // a weight, 16-bit working copy (model state, placed by ZeRO)
  grad,       // a weight's gradient (model state, placed by ZeRO)
  input,      // token ids and targets
  activation, // forward output used only during the forward pass (freed after last use)
  saved,      // forward output kept for the backward pass
  act_grad,   // gradient of an activation, during the backward pass
  logits,     // the (B, T, V) fp32 logits / probabilities (and their gradient: in place in
              // fp32 graphs, "logits.d" in the activation type in 16-bit ones)
  workspace,  // scratch inside one op
};
std::string_view to_string(TensorKind k);

enum class Phase : uint8_t { forward, backward, recompute, optimizer };
std::string_view to_string(Phase p);

enum class OpKind : uint8_t {
  embedding, layernorm, rmsnorm, matmul, rope, attn_scores, softmax, dropout, attn_values,
  flash_attention, residual, gelu, swiglu, cross_entropy,
  embedding_bwd, layernorm_bwd, rmsnorm_bwd, matmul_bwd, rope_bwd, attn_scores_bwd,
  softmax_bwd, dropout_bwd, attn_values_bwd, flash_attention_bwd, gelu_bwd, swiglu_bwd,
  cross_entropy_bwd,
  checkpoint_partition, checkpoint_gather,  // ZeRO-R P_a: slice / all-gather a block input
  optimizer_step,
  // Mixture of experts: softmax/top-k routing, dispatch of the routed rows to the experts
  // (an all-to-all under expert parallelism), their weighted combine; and the backwards.
  moe_route, moe_dispatch, moe_combine, moe_route_bwd, moe_dispatch_bwd, moe_combine_bwd,
  position_bias, position_bias_bwd,  // T5's relative position bias from its bucket table
  concat, concat_bwd,                // MLA: q, k (with the shared rotary key), v assembled
  gate_mul, gate_mul_bwd,            // Qwen2-MoE: sigmoid gate on the shared expert
  relu, relu_bwd,                    // OPT, T5: the backward needs only the output
  softcap, softcap_bwd,              // Gemma 2: cap * tanh(x / cap); the backward reads tanh
  tanh, tanh_bwd,                    // BERT's pooler; the backward reads the output
  // Recompute::selective_op: the recomputation takes an op's outputs from SAC's storage
  // instead of running it (torch.utils.checkpoint's _CachedTorchDispatchMode pops them). It
  // reads them (they live until then) and costs nothing.
  sac_reuse,
  // Pipeline parallelism: a stage receives its input activation from the previous stage (and
  // its output's gradient from the next) and sends its output (and its input's gradient).
  pp_recv, pp_send,
  // Megatron's sequence parallelism: the all-gather of a sequence-sharded tensor over the
  // tensor-parallel ranks before a column-parallel linear, the reduce-scatter after a row-
  // parallel one (and their mirror images in backward).
  sp_all_gather, sp_reduce_scatter,
  // DeepSpeed-Ulysses: the all-to-all between T/cp tokens x all heads and T tokens x heads/cp.
  cp_all_to_all,
};
std::string_view to_string(OpKind k);

// Activation checkpointing per block:
//   - full: only the block input is kept (Hugging Face gradient_checkpointing, torchtitan's
//     full AC); the backward recomputes the whole block.
//   - selective: Megatron's (Korthikanti et al. 2022 sec. 5): the attention core (scores,
//     softmax, dropout) is recomputed, everything else kept; nothing with flash attention.
//   - selective_op: torchtitan's per-op selective AC (torchtitan/distributed/
//     activation_checkpoint.py SelectiveAC at b5bcd76c, applied per transformer block with
//     torch.utils.checkpoint's create_selective_checkpoint_contexts): the block input and the
//     outputs of the ops in its save list are kept, every other op of the block is recomputed
//     (graph.cpp sac_policy has the list and the every-second-mm rule). Dropless MoE without
//     expert parallelism or a capacity factor.
enum class Recompute : uint8_t { none, full, selective, selective_op };

struct GraphOptions {
  int64_t batch = 1;          // B
  int64_t seq = 0;            // T (0: the model's n_positions)
  uint32_t act_bytes = 2;     // bytes per activation element: 2 (16-bit) or 4 (fp32)
  bool dropout = true;        // dropout ops where the model's probabilities are > 0
  Recompute recompute = Recompute::none;
  bool flash_attention = false;  // fused attention: saves output + log-sum-exp, no T x T
  int64_t seq_target = 0;     // encoder-decoder models: the decoder's length (0: seq)
  int64_t tp = 1;             // tensor-parallel degree t
  // Megatron's sequence parallelism over the t ranks (Korthikanti et al. 2022 sec. 4.2.2): the
  // tensors between the tensor-parallel regions (the residual stream, the norms' inputs,
  // outputs and statistics, the residual dropouts' masks and outputs, the embedding's output)
  // hold T/t tokens per rank. A column-parallel linear all-gathers its sequence-sharded input
  // into a transient (B, T, C) (and again in backward: only the shard is kept), a row-parallel
  // one reduce-scatters its (B, T, C) partial sums; the backward mirrors both. Decoder-only
  // pre-norm dense blocks; T divisible by t.
  bool sp = false;
  // Context parallelism (Megatron-LM's, ring attention through TransformerEngine): each of cp
  // ranks holds T/cp tokens of every sequence, every per-token tensor with them; attention
  // is blockwise (flash attention required), its queries against all T keys, the keys and
  // values passed around the ring: TransformerEngine's AttnFuncWithCPAndKVP2P forward keeps
  // one packed key|value block per step, cp of them until it returns, its backward two
  // blocks of keys|values with their gradients (comm_bytes of the attention ops). Decoder-
  // only models; T divisible by 2 cp (Megatron's load-balanced halves).
  int64_t cp = 1;
  // cp_ulysses: DeepSpeed-Ulysses instead of the ring (Jacobs et al. 2023; deepspeed/sequence/
  // layer.py DistributedAttention): an all-to-all turns this rank's T/cp tokens of q, k and v
  // (every head) into all T tokens of heads/cp, the attention (eager or flash) runs whole on
  // those heads and keeps them for its backward, and a second all-to-all turns its output
  // back into T/cp tokens for the output projection; the backward mirrors both. Heads and
  // key/value heads (per tensor-parallel rank) divisible by cp; T divisible by cp.
  bool cp_ulysses = false;
  // Pipeline parallelism: this graph is stage pp_stage of pp, the blocks
  // [pp_stage * L/pp, (pp_stage + 1) * L/pp) (L divisible by pp). The first stage has the
  // embedding, the last the final norm, the head and the loss; a stage after the first
  // receives its input (B, T, C) and sends its input's gradient back, a stage before the last
  // sends its output and receives that output's gradient (Megatron-LM's p2p communication).
  // With tied embeddings the last stage holds a copy of the word embeddings as its output
  // layer (Megatron's shared embedding group keeps the two copies equal).
  // With pp_chunks > 1 (Megatron's virtual pipeline stages, the interleaved schedule) the
  // stage holds pp_chunks model chunks of L/(pp pp_chunks) blocks, chunk c being virtual
  // stage c pp + pp_stage; the graph runs one micro-batch through them in order.
  int64_t pp = 1;
  int64_t pp_stage = 0;
  int64_t pp_chunks = 1;
  // Expert parallelism: each rank holds E/ep of every MoE layer's routed experts and runs the
  // rows routed to them. Balanced routing gives a rank as many rows as it sends (k*B*T);
  // moe_worst_case sizes them for every token of the ep group choosing this rank's experts.
  int64_t ep = 1;
  bool moe_worst_case = false;
  // DeepSpeed-MoE's token dropping (deepspeed/moe/sharded_moe.py): with a capacity factor
  // cf > 0 every expert takes capacity = max(min_capacity, ceil(k * B*T * cf / E)) rows, the
  // dispatched tensor is (E, capacity, C) on every rank whatever the routing, and the einsum
  // gating saves a (B*T, E, capacity) dispatch mask and combine weights. 0: dropless.
  double moe_capacity_factor = 0;
  int64_t moe_min_capacity = 4;
  // ZeRO-R P_a (DeepSpeed's partition_activations): activation checkpoints (block inputs
  // under full recompute) partitioned over the t model-parallel ranks (a clone of the whole
  // input when t = 1), all-gathered before the block is recomputed, held until its backward
  // ends.
  bool partition_checkpoints = false;
  uint32_t param_bytes = 2;   // bytes per parameter and gradient element in the graph
  // Kernels that compute in fp32 on 16-bit weights (zero-run's CPU backend): every op converts
  // each weight it reads into an fp32 scratch copy, and computes each weight gradient in an
  // fp32 scratch buffer before adding it to the 16-bit gradient. No effect when param_bytes
  // is 4.
  bool f32_weight_scratch = false;
  // What Hugging Face transformers' modeling code saves for backward where it differs from
  // the fused kernels this graph counts otherwise (zero-run's, FlashAttention's), added as
  // tensors and ops of their own (graph.cpp names each one's source; test_torch_reference.cpp
  // holds the result to PyTorch's autograd, to the byte, for every family):
  //   - the loss (loss_utils.py ForCausalLMLoss): logits in the activation type, an fp32 copy
  //     (logits.float(), 16-bit runs only), log_softmax's fp32 output kept for backward, nll;
  //     backward: the log-probabilities' and the logits' fp32 gradients, then the cast back
  //     (T5 and BERT compute their losses on the logits as they are: no copy, no cast). All
  //     logits-shaped tensors ((B, T, V); BERT's classifier's (B, n_labels)) are
  //     TensorKind::logits, as the fused path's are;
  //   - repeat_kv's copies of the key and value heads: eager attention always; with
  //     flash_attention (transformers' SDPA) only where a mask is materialized, i.e. in
  //     sliding-window layers the sequence reaches (use_gqa_in_sdpa; batches without padding);
  //   - act(gate) of unfused gated MLPs; gelu_new's and gpt-oss's clamped-GLU intermediates;
  //   - the MoE loop: int64 top-k indices, (token, slot) index pairs, index_add_'s source,
  //     renormalized top-k weights and their sum; gpt-oss's k-wide router softmax;
  //   - gpt-oss's sink column and max indices (eager), Falcon's q|k|v split indices, learned
  //     position ids (GPT-2, OPT).
  // Not modeled: transformers' unfused RMSNorm (LlamaRMSNorm keeps its input upcast to fp32
  // and its normalized output before the weight; the PyTorch reference fuses it by
  // convention), DeepSeek's router on an fp32 copy of its input (16-bit runs).
  // The deepspeed and fsdp profiles predict runs of transformers models.
  bool hf_modeling = false;
  // CUDA autocast on fp32 weights (torch.autocast("cuda", fp16|bf16): the Hugging Face
  // Trainer's --fp16/--bf16 and accelerate's mixed_precision without DeepSpeed or FSDP).
  // param_bytes stays the weights' 4, act_bytes is the autocast dtype's 2, and each op takes
  // the dtype autocast gives it (aten/src/ATen/autocast_mode.cpp and autocast_mode.h, the
  // CUDA lists; cached_cast):
  //   - matmuls (linear, addmm, matmul, bmm: lower_precision_fp) run in 16 bits: a 16-bit
  //     copy of each fp32 weight, cached for the autocast region (fp32 leaves that require
  //     grad), which the op keeps for backward ("<weight>.autocast"); and a 16-bit copy of an
  //     fp32 activation input, made anew by every call (not cached: not a leaf), which the op
  //     keeps instead of its input (".in16"): one per nn.Linear reading it, so three for
  //     separate q, k and v projections, one for a fused q|k|v;
  //   - layer_norm, softmax and log_softmax are in the fp32 lists: their outputs are fp32;
  //     transformers' RMSNorm computes in fp32 and multiplies by its fp32 weight (fp32);
  //     embedding lookups read fp32 weights (fp32);
  //   - every other op keeps its input's dtype, and binary ops promote (torch's type
  //     promotion): the residual stream (fp32 embeddings + 16-bit sublayer outputs) is fp32;
  //     gelu, dropout and the gated product of 16-bit matmul outputs are 16-bit;
  //   - eager attention: the softmax's fp32 output is kept, and the values matmul keeps a
  //     16-bit copy of the probabilities (the dropout's output where there is dropout, BERT's
  //     fp32 dropout output cast by the matmul, GPT-2's 16-bit cast then dropout alike);
  //   - the loss's log_softmax is fp32 (on a transient fp32 copy of the 16-bit logits);
  //   - lifetimes: a weight's cast lives until its matmul's backward; under full
  //     recomputation the forward's casts (made under no_grad, still cached) live until the
  //     autocast region ends with the forward's last op, and each recomputed block casts its
  //     weights again for its own backward (torch.utils.checkpoint re-enters autocast).
  // Activation gradients take their tensors' dtypes: fp32 along the residual stream.
  // Not modelled (refused by the planner): Mixture-of-Experts, MLA, q/k norms and
  // encoder-decoder stacks, whose casts this does not follow.
  bool autocast = false;
  // PyTorch before 1.11: softmax and log_softmax keep their input for backward beside their
  // output (pytorch issue #64000; PR #65242 passes only its dtype since): eager attention's
  // scores and the loss's logits stay alive until their backward.
  bool softmax_keeps_input = false;
};

struct Tensor {
  std::string name;               // "h.3.attn.qkv"
  std::vector<int64_t> shape;     // (B, T, 3*C/t)
  uint32_t elem_bytes = 0;
  uint64_t bytes = 0;             // product of shape x elem_bytes (overflow-checked)
  TensorKind kind = TensorKind::activation;
  int32_t layer = -1;             // block index; -1 embedding; L for the final norm and head
  // Per-token statistics (layernorm mean/rstd, attention log-sum-exp) that Korthikanti et al.
  // 2022 sec. 4.1 neglect ("2sb << sbh"); counted in every total here, listed apart.
  bool stats = false;
  // For params and grads: the module group ZeRO-3 gathers together ("embed", "h.3", "head").
  std::string group;
  // For fp32 scratch copies of a weight or its gradient (GraphOptions::f32_weight_scratch),
  // and autocast's 16-bit casts of a weight (GraphOptions::autocast): the param or grad
  // tensor it stands for; -1 otherwise.
  TensorId source = -1;
};

struct Op {
  std::string name;               // "h.3.attn.qkv.fwd"
  OpKind kind = OpKind::matmul;
  Phase phase = Phase::forward;
  int32_t layer = -1;
  std::vector<TensorId> inputs;   // read (activations, inputs, saved, act_grads)
  std::vector<TensorId> outputs;  // written; a tensor written before is updated in place
  std::vector<TensorId> scratch;  // workspace living only during this op
  std::vector<TensorId> params;   // weights read (param tensors)
  std::vector<TensorId> grads;    // weight gradients accumulated
  double flops = 0;               // floating-point operations (multiply-add = 2)
  double dropout_p = 0;           // dropout and dropout_bwd: the probability of dropping
  // A communication buffer held while the op runs (category buffers): ring attention's key
  // and value blocks passed between the context-parallel ranks.
  uint64_t comm_bytes = 0;
};

// Vertex = op index; edge = a tensor (data dependency) or -1 (stream order: ops issue in
// program order on one stream, as on a GPU).
struct EdgeTensor {
  TensorId tensor = -1;
};
using OpGraph = boost::adjacency_list<boost::vecS, boost::vecS, boost::directedS,
                                      boost::no_property, EdgeTensor>;

struct TrainingGraph {
  ModelSpec model;
  GraphOptions options;     // with seq resolved
  std::vector<Tensor> tensors;
  std::vector<Op> ops;
  OpGraph graph;
  std::vector<OpId> order;  // execution order: topological order of `graph`
  std::vector<std::string> groups;  // ZeRO-3 module groups in forward order
  // A parameter's gradient tensor -> the elements on this rank of each recipe tensor it sums,
  // in module order (a block's "attn.qkv" is q, k and v with their biases): the torch
  // parameters DeepSpeed hooks and buckets one by one.
  std::map<TensorId, std::vector<uint64_t>> param_parts;
  double flops_forward = 0, flops_backward = 0, flops_recompute = 0;

  const Tensor& tensor(TensorId t) const { return tensors[static_cast<std::size_t>(t)]; }
  const Op& op(OpId o) const { return ops[static_cast<std::size_t>(o)]; }
};

// Rows the routed experts of one rank process per MoE layer and micro-step (B*T tokens each
// choosing k experts): dropless, k*B*T (balanced) or, with moe_worst_case and ep > 1, every
// token of the ep group sending this rank min(k, E/ep) of its choices; with a capacity factor,
// E * capacity (DeepSpeed's dispatched tensor). 0 for a dense model.
int64_t routed_rows(const ModelSpec& m, const GraphOptions& o, int64_t tokens);

// Pipeline parallelism: the blocks [first, end) of each model chunk of stage `stage` of `pp`
// with `chunks` chunks per stage: chunk c is virtual stage c pp + stage of pp chunks, each
// n_blocks / (pp chunks) blocks (Megatron-LM's interleaved layout, get_transformer_layer_
// offset; one chunk without interleaving). zp::Error when the blocks do not divide.
std::vector<std::pair<int64_t, int64_t>> stage_blocks(int64_t n_blocks, int64_t pp, int64_t chunks,
                                                      int64_t stage);
int64_t moe_capacity(const ModelSpec& m, const GraphOptions& o, int64_t tokens);

// Whether the model's router renormalizes its top-k weights to sum 1 (Mixtral; Qwen2-/Qwen3-MoE
// and DeepSeek-V3 as norm_topk_prob says), and the load-balancing loss's coefficient when its
// config trains with it (output_router_logits), else 0; both as transformers reads the config.
bool hf_topk_renorm(const ModelSpec& m);
double moe_aux_loss_coef(const ModelSpec& m);

// Builds the graph; zp::Error for shapes that do not divide (heads by t, MLP width by t) and
// sizes that overflow.
TrainingGraph build_training_graph(const ModelSpec& m, const GraphOptions& o);

// Model states (params, grads) live for the whole run; every other tensor is allocated and
// freed within the step.
inline bool is_dynamic(TensorKind k) { return k != TensorKind::param && k != TensorKind::grad; }

// Where each tensor is used, as positions in `order`, as ggml-alloc counts it: a tensor lives
// from the first op that reads or writes it to the last; a saved activation therefore lives
// until its backward op. Scratch lives within its one op. -1 where never used.
struct Liveness {
  std::vector<int32_t> first, last;      // by tensor (scratch included)
  std::vector<int32_t> last_grad_write;  // by grad tensor: the last op accumulating into it
                                         // (the optimizer step, which reads them all, excluded)
  std::vector<std::vector<TensorId>> dies_at;  // by position: dynamic, non-scratch tensors
                                               // whose last use it is
};
Liveness liveness(const TrainingGraph& g);

}  // namespace zp::models
