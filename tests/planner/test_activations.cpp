// Activation memory from the training graph against Korthikanti et al. 2022 (arXiv
// 2205.05198): sec. 4.1 eq. (1) s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit
// activations and dropout; sec. 5 selective recomputation 34*s*b*h; full recomputation
// 2*s*b*h per layer. These are the paper's counts, not fitted to the graph.
#include <doctest/doctest.h>

#include "gpt_shape.hpp"
#include "zp/error.hpp"
#include "zp/models/graph.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/schedule.hpp"

using namespace zp::models;
using namespace zp::planner;

namespace {
ModelSpec gpt(int64_t h, int64_t a, int64_t layers, int64_t s) { return zp::test::gpt_shape(h, a, layers, s); }
GraphOptions opts(int64_t b, Recompute rc = Recompute::none) {
  GraphOptions o;
  o.batch = b;
  o.act_bytes = 2;
  o.dropout = true;
  o.recompute = rc;
  return o;
}
uint64_t korthikanti(uint64_t s, uint64_t b, uint64_t h, uint64_t a) {
  return s * b * h * 34 + 5 * a * s * s * b;  // = s*b*h*(34 + 5*a*s/h), kept in integers
}
}  // namespace

TEST_CASE("saved activations per layer equal Korthikanti eq. (1) exactly") {
  struct Case {
    int64_t s, b, h, a;
  };
  for (Case c : {Case{128, 1, 64, 4}, Case{256, 3, 96, 6}, Case{512, 2, 128, 8},
                 Case{1024, 1, 768, 12}, Case{2048, 4, 1024, 16}}) {
    const auto g = build_training_graph(gpt(c.h, c.a, 3, c.s), opts(c.b));
    const auto act = summarize_activations(g);
    CAPTURE(c.s);
    CAPTURE(c.h);
    for (std::size_t l = 0; l < 3; ++l) {
      CHECK(act.saved_per_layer[l] == korthikanti(c.s, c.b, c.h, c.a));
      // The layernorm statistics the paper neglects: mean and rstd of two norms, fp32.
      CHECK(act.stats_per_layer[l] == 2 * 2 * 4 * c.s * c.b);
    }
  }
}

TEST_CASE("catalog GPT models match eq. (1) at their context length") {
  for (const char* name : {"gpt2", "gpt2-xl", "megatron-8.3b", "turing-nlg-17b", "gpt3-175b"}) {
    const auto m = load_model(name);
    const auto g = build_training_graph(m, opts(1));
    const auto act = summarize_activations(g);
    CAPTURE(name);
    const uint64_t s = static_cast<uint64_t>(m.n_positions);
    CHECK(act.saved_per_layer.front() ==
          korthikanti(s, 1, static_cast<uint64_t>(m.n_embd), static_cast<uint64_t>(m.n_head)));
    CHECK(act.saved_per_layer.back() == act.saved_per_layer.front());
  }
}

TEST_CASE("selective recomputation keeps 34*s*b*h; full keeps 2*s*b*h") {
  const int64_t s = 512, b = 2, h = 128, a = 8;
  auto sel = summarize_activations(build_training_graph(gpt(h, a, 4, s), opts(b, Recompute::selective)));
  auto full = summarize_activations(build_training_graph(gpt(h, a, 4, s), opts(b, Recompute::full)));
  for (std::size_t l = 0; l < 4; ++l) {
    CHECK(sel.saved_per_layer[l] == 34ULL * s * b * h);
    CHECK(full.saved_per_layer[l] == 2ULL * s * b * h);
    CHECK(full.stats_per_layer[l] == 0);
  }
}

TEST_CASE("marginal memory of one more layer: the saved activations of that layer") {
  // Computed a second way: the peak of L+1 layers minus the peak of L layers is what one
  // extra layer keeps, because the peak sits at the start of the backward pass.
  const int64_t s = 256, b = 2, h = 64, a = 4;
  for (Recompute rc : {Recompute::none, Recompute::selective, Recompute::full}) {
    const auto p4 = summarize_activations(build_training_graph(gpt(h, a, 4, s), opts(b, rc))).peak;
    const auto p5 = summarize_activations(build_training_graph(gpt(h, a, 5, s), opts(b, rc))).peak;
    const uint64_t per_layer = rc == Recompute::none        ? korthikanti(s, b, h, a) + 16ULL * s * b
                               : rc == Recompute::selective ? 34ULL * s * b * h + 16ULL * s * b
                                                            : 2ULL * s * b * h;
    CAPTURE(static_cast<int>(rc));
    CHECK(p5 - p4 == per_layer);
  }
}

TEST_CASE("flash attention keeps no s^2 tensor; tensor parallelism splits eq. (2)") {
  const int64_t s = 1024, b = 1, h = 256, a = 8;
  GraphOptions o = opts(b);
  o.flash_attention = true;
  auto fl = summarize_activations(build_training_graph(gpt(h, a, 2, s), o));
  // Without the softmax output, its dropout mask and output (5as^2b): 34sbh, minus the
  // attention-dropout-free terms... the paper's 34sbh still counts Q, K, V and the output.
  CHECK(fl.saved_per_layer[0] == 34ULL * s * b * h);
  CHECK(fl.stats_per_layer[0] == 16ULL * s * b + 4ULL * a * s * b);  // + log-sum-exp (fp32)
  for (int64_t t : {2, 4}) {
    GraphOptions ot = opts(b);
    ot.tp = t;
    auto tp = summarize_activations(build_training_graph(gpt(h, a, 2, s), ot));
    // Korthikanti eq. (2): s*b*h*(10 + 24/t + 5*a*s/(h*t)).
    CHECK(tp.saved_per_layer[0] == 10ULL * s * b * h + 24ULL * s * b * h / t + 5ULL * a * s * s * b / t);
  }
  GraphOptions bad = opts(b);
  bad.tp = 3;
  CHECK_THROWS_AS(build_training_graph(gpt(h, a, 2, s), bad), zp::Error);
}

TEST_CASE("Korthikanti et al. 2022 table 2, every row, exactly") {
  // Activations memory per transformer layer (bytes, 16-bit activations with dropout), Table 2:
  //   no parallelism                               sbh (34 + 5as/h)
  //   tensor parallel (baseline)                   sbh (10 + 24/t + 5as/(ht))
  //   tensor + sequence parallel                   sbh (34/t + 5as/(ht))
  //   tensor parallel + selective recomputation    sbh (10 + 24/t)
  //   tensor + sequence + selective recomputation  sbh (34/t)
  //   full recomputation                           sbh (2)
  // Written as integers (every term divides for these shapes). The layernorms' fp32 mean and
  // rstd the paper neglects are counted apart (stats_per_layer): 16 s b, over t with sequence
  // parallelism. Full recomputation keeps the block input: 2sbh, or its shard 2sbh/t with
  // sequence parallelism (the paper's row assumes none).
  struct Case {
    int64_t s, b, h, a;
  };
  for (Case c : {Case{256, 2, 128, 8}, Case{512, 1, 256, 16}, Case{1024, 2, 768, 12}}) {
    const uint64_t s = c.s, b = c.b, h = c.h, a = c.a, sbh = s * b * h;
    for (int64_t ti : {1, 2, 4}) {
      const uint64_t t = static_cast<uint64_t>(ti);
      CAPTURE(c.s);
      CAPTURE(c.h);
      CAPTURE(t);
      auto layer = [&](bool sp, Recompute rc) {
        GraphOptions o = opts(c.b, rc);
        o.tp = ti;
        o.sp = sp;
        const auto act = summarize_activations(build_training_graph(gpt(c.h, c.a, 3, c.s), o));
        CHECK(act.saved_per_layer[0] == act.saved_per_layer[1]);
        if (rc != Recompute::full) CHECK(act.stats_per_layer[1] == 16 * s * b / (sp ? t : 1));
        return act.saved_per_layer[1];
      };
      CHECK(layer(false, Recompute::none) == 10 * sbh + 24 * sbh / t + 5 * a * s * s * b / t);
      CHECK(layer(true, Recompute::none) == 34 * sbh / t + 5 * a * s * s * b / t);
      CHECK(layer(false, Recompute::selective) == 10 * sbh + 24 * sbh / t);
      CHECK(layer(true, Recompute::selective) == 34 * sbh / t);
      CHECK(layer(false, Recompute::full) == 2 * sbh);
      CHECK(layer(true, Recompute::full) == 2 * sbh / t);
      if (t == 1) CHECK(layer(false, Recompute::none) == korthikanti(s, b, h, a));
    }
  }
}

TEST_CASE("sequence parallelism: the gathered inputs and scattered outputs are transient, "
          "and the graph refuses what it does not model") {
  // Megatron stores a column-parallel linear's input as its shard and all-gathers it again in
  // backward (Korthikanti et al. 2022 sec. 4.2.2): every all-gathered tensor dies at its one
  // reader, so nothing whole is kept across the forward; per layer and pass, one all-gather
  // before each of qkv and fc, one reduce-scatter after each of proj and mlp.proj.
  GraphOptions o = opts(2);
  o.tp = 2;
  o.sp = true;
  const TrainingGraph g = build_training_graph(gpt(128, 8, 2, 256), o);
  int gathers = 0, scatters = 0;
  for (const Op& op : g.ops) {
    if (op.layer != 1) continue;
    if (op.kind == OpKind::sp_all_gather && op.phase == Phase::forward) ++gathers;
    if (op.kind == OpKind::sp_reduce_scatter && op.phase == Phase::forward) ++scatters;
  }
  CHECK(gathers == 2);
  CHECK(scatters == 2);
  const Liveness lv = liveness(g);
  for (const Op& op : g.ops)
    if (op.kind == OpKind::sp_all_gather)
      for (TensorId t : op.outputs) {
        CAPTURE(g.tensor(t).name);
        CHECK(lv.last[static_cast<std::size_t>(t)] - lv.first[static_cast<std::size_t>(t)] <= 1);
      }
  // t = 1: sequence parallelism is a no-op (Megatron turns it off); an odd split refused.
  GraphOptions one = opts(2);
  one.sp = true;
  CHECK(summarize_activations(build_training_graph(gpt(128, 8, 2, 256), one)).saved_total ==
        summarize_activations(build_training_graph(gpt(128, 8, 2, 256), opts(2))).saved_total);
  GraphOptions odd = opts(1);
  odd.tp = 4;
  odd.sp = true;
  odd.seq = 250;
  CHECK_THROWS_WITH_AS(build_training_graph(gpt(128, 8, 2, 256), odd),
                       doctest::Contains("--seq 250 is not divisible by --tp 4"), zp::Error);
  ModelSpec par = gpt(128, 8, 2, 256);
  par.residual = Residual::parallel;
  CHECK_THROWS_WITH_AS(build_training_graph(par, o), doctest::Contains("--sp"), zp::Error);
}

TEST_CASE("context parallelism (ring): a rank holds the activations of T/cp tokens and the ring's key/value blocks") {
  // Each of cp ranks keeps, per layer, what a T/cp-token sequence keeps (flash attention: no
  // s^2 term), the attention's queries against all T keys: forward FLOPs 2 B NH (T/cp) T
  // (HS + VS). TransformerEngine's ring (AttnFuncWithCPAndKVP2P) holds cp packed key|value
  // blocks of T/cp tokens (2 KVH HS elements per token) while the forward runs, two blocks of
  // keys|values and two of their gradients in backward.
  const int64_t s = 1024, b = 2, h = 256, a = 8;
  for (int64_t cp : {2, 4}) {
    CAPTURE(cp);
    GraphOptions o = opts(b);
    o.flash_attention = true;
    o.cp = cp;
    const TrainingGraph g = build_training_graph(gpt(h, a, 2, s), o);
    GraphOptions shorter = opts(b);
    shorter.flash_attention = true;
    shorter.seq = s / cp;
    const auto ring = summarize_activations(g);
    const auto local = summarize_activations(build_training_graph(gpt(h, a, 2, s), shorter));
    CHECK(ring.saved_per_layer == local.saved_per_layer);
    CHECK(ring.stats_per_layer == local.stats_per_layer);
    CHECK(ring.saved_per_layer[0] == 34ULL * (s / cp) * b * h);
    const uint64_t block = static_cast<uint64_t>(b) * (s / cp) * 2 * a * (h / a) * 2;  // 16-bit
    int flash_ops = 0;
    for (const Op& op : g.ops) {
      if (op.kind == OpKind::flash_attention) {
        ++flash_ops;
        CHECK(op.comm_bytes == block * cp);
        CHECK(op.flops == doctest::Approx(2.0 * b * a * double(s / cp) * s * (2 * (h / a))));
      }
      if (op.kind == OpKind::flash_attention_bwd) CHECK(op.comm_bytes == 4 * block);
    }
    CHECK(flash_ops == 2);
    Strategy st;
    st.cp = cp;
    st.seq = s;
    st.micro_batch = b;
    const MemorySchedule sched = build_schedule(g, st, {});
    uint64_t fwd = 0, bwd = 0;
    for (const MemBuffer& x : sched.buffers) {
      if (x.name == "comm.h.1.attn.flash") fwd = x.bytes;
      if (x.name == "comm.h.1.attn.flash.bwd") bwd = x.bytes;
    }
    CHECK(fwd == block * cp);  // the whole sequence's keys and values, during each forward
    CHECK(bwd == 4 * block);
  }
  GraphOptions eager = opts(b);
  eager.cp = 2;
  CHECK_THROWS_WITH_AS(build_training_graph(gpt(h, a, 2, s), eager),
                       doctest::Contains("--flash-attention"), zp::Error);
  GraphOptions odd = opts(b);
  odd.flash_attention = true;
  odd.cp = 3;
  CHECK_THROWS_WITH_AS(build_training_graph(gpt(h, a, 2, s), odd),
                       doctest::Contains("not a multiple of 2 x 3"), zp::Error);
}

TEST_CASE("context parallelism (DeepSpeed-Ulysses): T/cp tokens, attention over all T tokens of heads/cp") {
  // Jacobs et al. 2023, deepspeed/sequence/layer.py DistributedAttention: q, k, v of this
  // rank's s/cp tokens go through an all-to-all to s tokens of a/cp heads, the local attention
  // keeps what it keeps there, and its output comes back through a second all-to-all as the
  // projection's input. Eager (eq. 1 terms): the linear parts of s/cp tokens, 34 (s/cp) b h,
  // and the attention core of a/cp heads over all s, 5 (a/cp) s^2 b; nothing else (the core's
  // output in the heads view dies at the all-to-all). Flash: the s/cp-token graph's 34 (s/cp) b
  // h, plus the core's output kept in the heads view for flash's backward, 2 b (s/cp) h.
  const int64_t s = 512, b = 2, h = 128, a = 8;
  for (int64_t cp : {2, 4}) {
    CAPTURE(cp);
    GraphOptions o = opts(b);
    o.cp = cp;
    o.cp_ulysses = true;
    const auto eager = summarize_activations(build_training_graph(gpt(h, a, 2, s), o));
    CHECK(eager.saved_per_layer[1] == 34ULL * (s / cp) * b * h + 5ULL * (a / cp) * s * s * b);
    o.flash_attention = true;
    const auto flash = summarize_activations(build_training_graph(gpt(h, a, 2, s), o));
    CHECK(flash.saved_per_layer[1] == 34ULL * (s / cp) * b * h + 2ULL * b * (s / cp) * h);
    // Selective recomputation of the eager core: the scores are recomputed in the heads view.
    o.flash_attention = false;
    o.recompute = Recompute::selective;
    const auto sel = summarize_activations(build_training_graph(gpt(h, a, 2, s), o));
    CHECK(sel.saved_per_layer[1] == 34ULL * (s / cp) * b * h);
  }
  // Four all-to-alls per layer and pass: q|k|v and the output forward, their gradients back.
  GraphOptions o = opts(b);
  o.cp = 2;
  o.cp_ulysses = true;
  const TrainingGraph g = build_training_graph(gpt(h, a, 2, s), o);
  int fwd = 0, bwd = 0;
  for (const Op& op : g.ops)
    if (op.kind == OpKind::cp_all_to_all && op.layer == 1) (op.phase == Phase::forward ? fwd : bwd)++;
  CHECK(fwd == 2);
  CHECK(bwd == 2);
  GraphOptions heads = opts(b);
  heads.cp = 16;
  heads.cp_ulysses = true;
  CHECK_THROWS_WITH_AS(build_training_graph(gpt(h, a, 2, s), heads),
                       doctest::Contains("not divisible by it"), zp::Error);
}

TEST_CASE("selective recomputation with flash attention recomputes no T x T scores") {
  // The planner bug of issue 18: llama-3.1-8b at seq 8192, B=2 with --flash-attention
  // --checkpointing selective peaked at h.31.attn.softmax.re, a (B, NH, T, T) softmax that
  // flash attention never materializes. With flash there is no core left to recompute, so
  // the graph keeps exactly what flash without recomputation keeps and has no T x T tensor.
  const ModelSpec m = load_model("llama-3.1-8b");
  GraphOptions o = opts(2);
  o.seq = 8192;
  o.flash_attention = true;
  o.recompute = Recompute::selective;
  const TrainingGraph g = build_training_graph(m, o);
  for (const Tensor& t : g.tensors) {  // no (.., T, T) tensor at all
    CAPTURE(t.name);
    const auto& sh = t.shape;
    CHECK_FALSE((sh.size() >= 2 && sh[sh.size() - 1] == 8192 && sh[sh.size() - 2] == 8192));
  }
  for (const Op& op : g.ops) CHECK(op.phase != Phase::recompute);
  o.recompute = Recompute::none;
  const auto none = summarize_activations(build_training_graph(m, o));
  const auto sel = summarize_activations(g);
  CHECK(sel.peak == none.peak);
  CHECK(sel.saved_total == none.saved_total);
}

TEST_CASE("P_a partitions the checkpoints over the model-parallel ranks") {
  const int64_t s = 256, b = 2, h = 128, a = 8, t = 4;
  GraphOptions o = opts(b, Recompute::full);
  o.tp = t;
  o.partition_checkpoints = true;
  auto pa = summarize_activations(build_training_graph(gpt(h, a, 3, s), o));
  // Each layer keeps 1/t of its input (the checkpoint); the last layer also keeps its output
  // whole, because it is the final norm's input.
  CHECK(pa.saved_per_layer[0] == 2ULL * s * b * h / t);
  CHECK(pa.saved_per_layer[1] == 2ULL * s * b * h / t);
  CHECK(pa.saved_per_layer[2] == 2ULL * s * b * h / t + 2ULL * s * b * h);
}

TEST_CASE("graph structure: topological order, backward mirrors forward") {
  const auto g = build_training_graph(gpt(64, 4, 2, 32), opts(1));
  REQUIRE(g.order.size() == g.ops.size());
  // Every op comes after the latest writer of every tensor it reads.
  std::vector<int> pos(g.ops.size());
  for (std::size_t i = 0; i < g.order.size(); ++i) pos[static_cast<std::size_t>(g.order[i])] = static_cast<int>(i);
  std::vector<int> written(g.tensors.size(), -1);
  for (OpId o : g.order) {
    for (TensorId t : g.op(o).inputs) {
      const auto kind = g.tensor(t).kind;
      if (kind != TensorKind::input) CHECK(written[static_cast<std::size_t>(t)] >= 0);
    }
    for (TensorId t : g.op(o).outputs) written[static_cast<std::size_t>(t)] = pos[static_cast<std::size_t>(o)];
  }
  // Forward FLOPs of the matmuls: 2 * tokens * (params in weight matrices) + attention.
  CHECK(g.flops_backward > 1.9 * g.flops_forward);
  CHECK(g.ops.back().kind == OpKind::optimizer_step);
}

TEST_CASE("autocast on fp32 weights: a BERT layer's saved tensors, counted by hand from autocast's rules") {
  // models::GraphOptions::autocast; the rules are PyTorch's CUDA autocast lists
  // (aten/src/ATen/autocast_mode.cpp): nn.Linear runs in 16 bits and keeps a 16-bit copy of
  // an fp32 input, one per Linear (BERT's query, key and value are three); layer_norm and
  // softmax run in fp32; dropout, gelu and matmul outputs keep their input's dtype; the
  // residual add of the fp32 stream and a 16-bit sublayer output promotes to fp32. Per
  // BertLayer (modeling_bert.py), with N = B*T*C and S = B*NH*T*T elements:
  //   query/key/value copies of the fp32 layer input   3 x 2N
  //   q, k, v (16-bit Linear outputs the matmuls keep) 3 x 2N
  //   softmax output (fp32)                             4S
  //   attention dropout mask (bool)                     1S
  //   dropout output, 16 bits (the values matmul's)     2S
  //   context (16-bit, kept by the output dense)        2N
  //   hidden dropout mask                               1N
  //   LayerNorm input: x + attention (fp32)             4N
  //   the intermediate dense's copy of LN's fp32 output 2N
  //   its output, gelu's input (16-bit, 4C wide)        8N
  //   gelu's output (the output dense's input)          8N
  //   hidden dropout mask                               1N
  //   LayerNorm input: attention output + MLP (fp32)    4N
  // = 42N + 7S, against 66N + 9S in fp32 (the same list with every tensor 4 bytes and x kept
  // once). The layer's fp32 input is no longer kept (its Linears keep their copies), nor is
  // LN1's fp32 output. The weight casts: every Linear's weight and bias, 2 bytes each.
  const ModelSpec m = load_model(std::string(ZP_TEST_DATA) + "/published/bert-large-uncased-seqcls.json");
  const uint64_t B = 2, T = 64, C = 1024, NH = 16, L = 24;
  GraphOptions o;
  o.batch = B;
  o.seq = T;
  o.act_bytes = 2;
  o.param_bytes = 4;
  o.dropout = true;
  o.hf_modeling = true;
  o.autocast = true;
  const uint64_t N = B * T * C, S = B * NH * T * T;
  const ActivationSummary a = summarize_activations(build_training_graph(m, o));
  for (uint64_t l = 0; l < L; ++l) {
    CAPTURE(l);
    CHECK(a.saved_per_layer[l] == 42 * N + 7 * S);
  }
  const uint64_t linears_per_layer = (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) +
                                     (4 * C * C + C);
  const uint64_t heads = (C * C + C) + (2 * C + 2);  // pooler dense, classifier (2 labels)
  CHECK(a.weight_casts == 2 * (L * linears_per_layer + heads));
  // fp32, the same graph without autocast: 66N + 9S.
  o.autocast = false;
  o.act_bytes = 4;
  const ActivationSummary f = summarize_activations(build_training_graph(m, o));
  CHECK(f.saved_per_layer[0] == 66 * N + 9 * S);
  CHECK(f.weight_casts == 0);
}
