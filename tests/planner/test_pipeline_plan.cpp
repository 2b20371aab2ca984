// Pipeline parallelism in the plan: each stage's graph holds its blocks' parameters (the
// stages add up to the model's published count, plus the last stage's copy of tied
// embeddings), the first stage holds its p micro-batches' activations as Megatron-LM's
// theoretical_memory_usage.py counts them (Korthikanti et al. 2022 eq. 1 per block), every
// stage the in-flight micro-batches of its schedule, and the estimate names the most loaded
// stage.
#include <doctest/doctest.h>

#include <numeric>

#include <nlohmann/json.hpp>

#include "gpt_shape.hpp"
#include "zp/error.hpp"
#include "zp/models/graph.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/schedule.hpp"

using namespace zp::models;
using namespace zp::planner;

namespace {

ModelSpec gpt(int64_t h, int64_t a, int64_t layers, int64_t s) { return zp::test::gpt_shape(h, a, layers, s); }

uint64_t params_of(const TrainingGraph& g) {
  uint64_t n = 0;
  for (const Tensor& t : g.tensors)
    if (t.kind == TensorKind::param) n += t.bytes / t.elem_bytes;
  return n;
}

uint64_t buffer_bytes(const MemorySchedule& s, const std::string& name) {
  for (const MemBuffer& b : s.buffers)
    if (b.name == name) return b.bytes;
  return 0;
}

}  // namespace

TEST_CASE("pipeline stages hold their blocks' parameters; the last adds a copy of tied embeddings") {
  // Untied (Llama-3.1-8B, 8,030,261,248 published): the stages add up to the model. Tied
  // (GPT-2, 124,439,808): the last stage's output layer is its own copy of the word
  // embeddings (vocab x hidden = 50257 x 768), Megatron's shared embedding group.
  struct Case {
    const char* name;
    int64_t pp;
    uint64_t extra;
  };
  for (Case c : {Case{"llama-3.1-8b", 4, 0}, Case{"llama-3.1-8b", 8, 0},
                 Case{"gpt2", 2, 50257ULL * 768}, Case{"gpt2", 4, 50257ULL * 768}}) {
    CAPTURE(c.name);
    CAPTURE(c.pp);
    const ModelSpec m = load_model(c.name);
    Strategy s;
    s.pp = c.pp;
    s.seq = 128;
    s.grad_accum = c.pp;
    GraphOptions go = graph_options(m, s, {});
    uint64_t total = 0;
    for (int64_t st = 0; st < c.pp; ++st) {
      go.pp_stage = st;
      const TrainingGraph g = build_training_graph(m, go);
      total += params_of(g);
      // Only the first stage embeds, only the last has the head.
      bool embeds = false, heads = false;
      for (const Op& op : g.ops) {
        embeds |= op.kind == OpKind::embedding;
        heads |= op.kind == OpKind::cross_entropy;
      }
      CHECK(embeds == (st == 0));
      CHECK(heads == (st == c.pp - 1));
    }
    CHECK(total == count_params(m).total + c.extra);
  }
}

TEST_CASE("the first stage holds p micro-batches of activations, as Megatron's theoretical memory counts") {
  // Megatron-LM megatron/training/theoretical_memory_usage.py compute_activation_memory: the
  // first pipeline stage holds p micro-batches in flight of its L/p layers, each layer's
  // activations Korthikanti et al. 2022 eq. (1), s b h (34 + 5 a s / h) bytes in 16 bits
  // with dropout, plus the embedding's dropout mask s b h per micro-batch ("Dropout in
  // embedding layer", x p). zeroplan adds what the paper neglects: the two layernorms' fp32
  // mean and rstd, 16 s b per layer (test_activations.cpp); and keeps the token ids (Megatron's
  // "input to embedding" 8 s b p) as inputs, not activations.
  const int64_t s = 256, b = 2, h = 128, a = 8, L = 8;
  const ModelSpec m = gpt(h, a, L, s);
  for (int64_t p : {2, 4}) {
    for (int64_t micro : {p, 2 * p}) {
      CAPTURE(p);
      CAPTURE(micro);
      Strategy st;
      st.pp = p;
      st.seq = s;
      st.micro_batch = b;
      st.grad_accum = micro;
      GraphOptions go = graph_options(m, st, {});
      go.dropout = true;
      go.act_bytes = 2;
      go.pp_stage = 0;
      const TrainingGraph g = build_training_graph(m, go);
      const uint64_t per_layer = s * b * h * 34 + 5 * a * s * s * b + 16 * s * b;
      const uint64_t one_micro_batch = (L / p) * per_layer + s * b * h;
      CHECK(summarize_activations(g).saved_total == one_micro_batch);
      const MemorySchedule sched = build_schedule(g, st, {});
      // p in flight on the first stage: this micro-batch's own, p - 1 others beside it.
      CHECK(buffer_bytes(sched, "pp.in_flight") == (p - 1) * one_micro_batch);
      CHECK(buffer_bytes(sched, "pp.in_flight") + one_micro_batch == static_cast<uint64_t>(p) * one_micro_batch);
    }
  }
}

TEST_CASE("each stage holds the micro-batches its schedule keeps in flight") {
  // 1F1B: stage i holds min(p - i, m) (Narayanan et al. 2021 sec. 2.2.1); GPipe: all m;
  // interleaved over v chunks: Megatron's warmup + 1 (pipeline.hpp), in chunk units of 1/v of
  // the stage's activations. Here computed by hand for p = 4, m = 8, v = 2:
  // 1F1B {4, 3, 2, 1}; GPipe {8, 8, 8, 8}; interleaved 2 (p - i - 1) + (v - 1) p + 1 =
  // {11, 9, 7, 5} chunks.
  const ModelSpec m = gpt(64, 4, 8, 64);
  struct Case {
    PipelineSchedule sched;
    int64_t vp;
    std::vector<uint64_t> pairs;  // (micro-batch, chunk) pairs in flight per stage
  };
  for (const Case& c : {Case{PipelineSchedule::one_f_one_b, 1, {4, 3, 2, 1}},
                        Case{PipelineSchedule::gpipe, 1, {8, 8, 8, 8}},
                        Case{PipelineSchedule::interleaved, 2, {11, 9, 7, 5}}}) {
    CAPTURE(to_string(c.sched));
    Strategy st;
    st.pp = 4;
    st.vp = c.vp;
    st.pp_schedule = c.sched;
    st.seq = 64;
    st.grad_accum = 8;
    validate(st);
    GraphOptions go = graph_options(m, st, {});
    for (int64_t i = 0; i < 4; ++i) {
      CAPTURE(i);
      go.pp_stage = i;
      const TrainingGraph g = build_training_graph(m, go);
      const uint64_t saved = summarize_activations(g).saved_total;
      const uint64_t k = c.pairs[static_cast<std::size_t>(i)];
      CHECK(static_cast<uint64_t>(pipeline_in_flight(st, i)) == k);
      CHECK(buffer_bytes(build_schedule(g, st, {}), "pp.in_flight") ==
            (saved / static_cast<uint64_t>(c.vp)) * (k - static_cast<uint64_t>(c.vp)));
    }
  }
}

TEST_CASE("interleaved stages hold chunks c p + i of the blocks; the estimate names the most loaded stage") {
  // 8 blocks, p = 2, v = 2: chunks of 2 blocks; stage 0 holds virtual stages 0 and 2 (blocks
  // 0-1, 4-5), stage 1 virtual stages 1 and 3 (blocks 2-3, 6-7) (Megatron-LM's interleaved
  // layout).
  const ModelSpec m = gpt(64, 4, 8, 64);
  Strategy st;
  st.pp = 2;
  st.vp = 2;
  st.pp_schedule = PipelineSchedule::interleaved;
  st.seq = 64;
  st.grad_accum = 4;
  const Estimate e = estimate(m, st, nullptr);
  REQUIRE(e.stages.size() == 2);
  using R = std::vector<std::pair<int64_t, int64_t>>;
  CHECK(e.stages[0].blocks == R{{0, 2}, {4, 6}});
  CHECK(e.stages[1].blocks == R{{2, 4}, {6, 8}});
  // The estimate's own figures are its most loaded stage's.
  uint64_t most = 0;
  for (const PipelineStage& ps : e.stages) most = std::max(most, ps.per_device.peak(Tier::gpu));
  CHECK(e.per_device.peak(Tier::gpu) == most);
  CHECK(e.stages[static_cast<std::size_t>(e.stage)].per_device.peak(Tier::gpu) == most);
  GraphOptions go = graph_options(m, st, {});
  go.pp_stage = 1;
  const TrainingGraph g1 = build_training_graph(m, go);
  for (const Tensor& t : g1.tensors)
    if (t.kind == TensorKind::param && t.layer >= 0 && t.layer < 8) {
      CAPTURE(t.name);
      CHECK(((t.layer >= 2 && t.layer < 4) || (t.layer >= 6 && t.layer < 8)));
    }
}

TEST_CASE("pipeline parallelism refuses what it cannot plan") {
  Strategy st;
  st.pp = 2;
  st.stage = 2;
  CHECK_THROWS_WITH_AS(validate(st), doctest::Contains("ZeRO-2 and ZeRO-3 do not combine"), zp::Error);
  st.stage = 1;
  st.vp = 2;  // interleaving needs its schedule and m a multiple of p
  CHECK_THROWS_AS(validate(st), zp::Error);
  st.pp_schedule = PipelineSchedule::interleaved;
  st.grad_accum = 4;
  CHECK_NOTHROW(validate(st));
  Strategy three;
  three.pp = 3;
  three.grad_accum = 3;
  three.seq = 64;
  CHECK_THROWS_WITH_AS(estimate(gpt(64, 4, 8, 64), three, nullptr),
                       doctest::Contains("8 layers are not divisible"), zp::Error);
  Strategy fsdp;
  fsdp.pp = 2;
  fsdp.stage = 0;
  fsdp.seq = 64;
  CHECK_THROWS_WITH_AS(estimate(gpt(64, 4, 8, 64), fsdp, nullptr, {Profile::pytorch}),
                       doctest::Contains("--pp is not modelled"), zp::Error);
}

TEST_CASE("model states per rank equal Megatron's distributed-optimizer accounting, 6 + 12/dp bytes per parameter") {
  // Megatron-LM megatron/training/theoretical_memory_usage.py compute_weight_and_optimizer_
  // memory: bf16 parameters (2 bytes), fp32 main gradients (4) and, with
  // --use-distributed-optimizer, fp32 main parameters and Adam's two moments (12) sharded over
  // the data-parallel ranks: 6 + 12/dp bytes per parameter of a rank's model shard. Its shard
  // sizes, per transformer layer of Llama-3.1-8B (h 4096, ffn 14336, 32 heads, 8 query groups,
  // RMSNorm, SwiGLU, untied, vocabulary 128256 = 501 x 256, already padded for tp 2):
  //   attention 2 h^2 (1 + g/a) = 41,943,040 and MLP 2 h ffn 3/2 = 176,160,768, split over tp;
  //   layernorms 2 h = 8,192, replicated; embedding h V = 525,336,576, split over tp.
  // The first stage holds the embedding and L/pp layers; the last its layers, the output layer
  // (h V) and the final norm (h), which the formula spreads as h/pp over every stage (its
  // replicated_params_in_transformer_block / pp) where the model holds it on the last.
  const ModelSpec m = load_model("llama-3.1-8b");
  const uint64_t h = 4096, ffn = 14336, a = 32, g = 8, V = 128256, L = 32;
  const uint64_t attention = 2 * h * h * (a + g) / a, mlp = 2 * h * ffn * 3 / 2, norms = 2 * h;
  REQUIRE(attention == 41'943'040);
  REQUIRE(mlp == 176'160'768);
  for (const auto& degrees : {std::tuple<uint64_t, uint64_t, uint64_t>{2, 4, 8},
                              std::tuple<uint64_t, uint64_t, uint64_t>{1, 2, 4},
                              std::tuple<uint64_t, uint64_t, uint64_t>{4, 8, 2}}) {
    // Named copies, not bindings: clang 14 lets no lambda (CAPTURE) refer to a binding.
    const uint64_t tp = std::get<0>(degrees), pp = std::get<1>(degrees), dp = std::get<2>(degrees);
    CAPTURE(tp);
    CAPTURE(pp);
    CAPTURE(dp);
    const uint64_t layers = L / pp;
    const uint64_t first = (layers * (attention + mlp) + h * V) / tp + layers * norms;
    const uint64_t last = first + h;  // the output layer in place of the embedding, and the final norm
    Strategy s;
    s.mp = static_cast<int64_t>(tp);
    s.pp = static_cast<int64_t>(pp);
    s.dp = static_cast<int64_t>(dp);
    s.stage = 1;
    s.precision = Precision::bf16;
    s.grad_precision = Precision::fp32;
    s.seq = 512;
    s.grad_accum = static_cast<int64_t>(pp);
    s.flash_attention = true;
    const Estimate e = estimate(m, s, nullptr);
    REQUIRE(e.stages.size() == pp);
    auto states = [](const PerDevice& d) {
      return d[Tier::gpu][Category::params] + d[Tier::gpu][Category::grads] +
             d[Tier::gpu][Category::master] + d[Tier::gpu][Category::optimizer];
    };
    REQUIRE(first % dp == 0);  // the partitions divide evenly: no padding to compare
    CHECK(e.stages.front().n_params == first);
    CHECK(e.stages.back().n_params == last);
    CHECK(states(e.stages.front().per_device) == 6 * first + 12 * first / dp);
    CHECK(states(e.stages.back().per_device) == 6 * last + 12 * ((last + dp - 1) / dp));
    // The middle stages: Megatron's "other shards", its layers only.
    if (pp > 2) CHECK(e.stages[1].n_params == layers * (attention + mlp) / tp + layers * norms);
  }
}

TEST_CASE("with context parallelism ZeRO partitions over dp x cp; DeepSpeed's sequence_parallel_size is Ulysses") {
  // Megatron's distributed optimizer shards over the data-parallel group with context
  // parallel (megatron/core/optimizer/__init__.py intra_dp_cp_group): 6 + 12/(dp cp) bytes
  // per parameter of the shard. Llama-3.1-8B at tp 2, pp 2, cp 2, dp 2: the first stage holds
  // 16 layers' (41,943,040 + 176,160,768) / 2 + the embedding's 525,336,576 / 2 + 16 x 8,192.
  const ModelSpec m = load_model("llama-3.1-8b");
  const uint64_t first = (16ULL * (41'943'040 + 176'160'768) + 525'336'576) / 2 + 16ULL * 8'192;
  Strategy s;
  s.mp = 2;
  s.pp = 2;
  s.cp = 2;
  s.dp = 2;
  s.stage = 1;
  s.grad_precision = Precision::fp32;
  s.seq = 1024;
  s.grad_accum = 2;
  s.flash_attention = true;
  const Estimate e = estimate(m, s, nullptr);
  const PerDevice& d = e.stages.front().per_device;
  REQUIRE(first % 4 == 0);
  CHECK(d[Tier::gpu][Category::params] + d[Tier::gpu][Category::grads] == 6 * first);
  CHECK(d[Tier::gpu][Category::master] + d[Tier::gpu][Category::optimizer] == 12 * first / 4);
  const Strategy u = apply_deepspeed_config(Strategy{}, nlohmann::json::parse(R"({"sequence_parallel_size": 4})"),
                                            "ds.json");
  CHECK(u.cp == 4);
  CHECK(u.cp_kind == CpKind::ulysses);
}
