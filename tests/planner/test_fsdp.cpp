// The fsdp profile: PyTorch FSDP's fully_shard as torchtitan runs it, and FSDP1
// (FullyShardedDataParallel) as accelerate runs it. Expected sizes come from gpt2-tiny's
// tensors written out here as Hugging Face's GPT2LMHeadModel holds them (Conv1D weights
// stored (in, out); 12C^2 + 13C per block, as in test_schedule.cpp) and FSDP's rules
// (torch/distributed/fsdp, summarized with line numbers in planner/notes/
// fsdp-and-optimizers-memory.md sec. 1-2): FSDP2 shards every parameter along dim 0,
// ceil(d0/W) rows each (_fsdp_param.py _init_sharded_param); FSDP1 flattens a unit into one
// FlatParameter split into W equal shards (_flat_param.py _get_shard); sharded parameters in
// the model's dtype, an all-gather output and the unsharded parameters per unit (W x shard
// each), the reduce-scatter input in the reduce dtype.
#include <doctest/doctest.h>

#include <fstream>
#include <map>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "error_of.hpp"
#include "zp/models/graph.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/accelerate_config.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/hardware.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/simulate.hpp"

// Failed comparisons of buffer sizes print the sizes.
namespace doctest {
template <>
struct StringMaker<std::multiset<uint64_t>> {
  static String convert(const std::multiset<uint64_t>& v) {
    std::string out = "{";
    for (uint64_t x : v) out += (out.size() > 1 ? ", " : "") + std::to_string(x);
    return (out + "}").c_str();
  }
};
}  // namespace doctest

using namespace zp::planner;
using zp::models::load_model;
using zp::test::error_of;

namespace {

// gpt2-tiny: V=256, P=64, C=64, L=2, tied head.
constexpr uint64_t C = 64, V = 256, P = 64, L = 2;
constexpr uint64_t kEmbed = V * C + P * C;        // wte + wpe
constexpr uint64_t kBlock = 12 * C * C + 13 * C;  // one block
constexpr uint64_t kHead = 2 * C;                 // final layernorm; the head is tied

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// Shapes per tensor, in named_parameters() order.
using Shapes = std::vector<std::vector<uint64_t>>;
Shapes gpt2_block(uint64_t c) {
  return {{c}, {c},                  // ln_1.weight, ln_1.bias
          {c, 3 * c}, {3 * c},       // attn.c_attn (in, out)
          {c, c}, {c},               // attn.c_proj
          {c}, {c},                  // ln_2
          {c, 4 * c}, {4 * c},       // mlp.c_fc
          {4 * c, c}, {c}};          // mlp.c_proj
}
// FSDP1's root unit of GPT2LMHeadModel: wte, wpe, ln_f (the tied head adds nothing).
Shapes gpt2_root(uint64_t v, uint64_t p, uint64_t c) { return {{v, c}, {p, c}, {c}, {c}}; }
uint64_t numel(const std::vector<uint64_t>& t) {
  uint64_t n = 1;
  for (uint64_t d : t) n *= d;
  return n;
}
// FSDP2: each tensor's rank-0 chunk along dim 0, ceil(d0/W) rows of numel/d0 elements.
uint64_t fsdp2_shard(const Shapes& unit, uint64_t w) {
  uint64_t n = 0;
  for (const auto& t : unit) n += ceil_div(t[0], w) * (numel(t) / t[0]);
  return n;
}
// FSDP1: the flat parameter, each tensor starting at a multiple of `align` elements (0: none;
// use_orig_params: 16 bytes of the compute dtype), then padded to a multiple of W when
// aligned; the shard is a W-th of it, rounded up.
uint64_t fsdp1_shard(const Shapes& unit, uint64_t w, uint64_t align) {
  uint64_t flat = 0;
  for (const auto& t : unit) {
    if (align > 0 && flat % align != 0) flat += align - flat % align;
    flat += numel(t);
  }
  if (align > 0) flat = ceil_div(flat, w) * w;
  return ceil_div(flat, w);
}

struct Run {
  MemorySchedule sched;
  MemoryReport rep;
};
Run run(Strategy s, const zp::models::ModelSpec& m = load_model("gpt2-tiny")) {
  s.seq = std::min<int64_t>(64, m.n_positions);
  const PlanOptions o{Profile::fsdp, Backend::cuda, ModelCode::fused};
  const auto g = zp::models::build_training_graph(m, graph_options(m, s, o));
  Run r;
  r.sched = build_schedule(g, s, o);
  r.rep = replay(r.sched, o);
  return r;
}
Strategy fsdp(uint64_t w) {
  Strategy s;
  s.stage = 3;
  s.dp = static_cast<int64_t>(w);
  return s;
}
// Sizes of the buffers named `prefix + group` (each allocated once per use).
std::multiset<uint64_t> sizes(const MemorySchedule& m, const std::string& name) {
  std::multiset<uint64_t> out;
  for (const MemBuffer& b : m.buffers)
    if (b.name == name) out.insert(b.bytes);
  return out;
}
// The buffers alive after position `pos`'s events.
std::set<std::string> live_after(const MemorySchedule& m, int32_t pos) {
  std::map<uint32_t, int> count;
  for (const MemEvent& e : m.events) {
    if (e.pos > pos) break;
    count[e.buffer] += e.alloc ? 1 : -1;
  }
  std::set<std::string> out;
  for (const auto& [b, c] : count)
    if (c > 0) out.insert(m.buffers[b].name);
  return out;
}
// The position of the first allocation of the buffer named `name`.
int32_t first_alloc(const MemorySchedule& m, const std::string& name) {
  for (const MemEvent& e : m.events)
    if (e.alloc && m.buffers[e.buffer].name == name) return e.pos;
  return -2;
}
// Bytes of a tier and category at the replay's high-water mark.
uint64_t at(const Run& r, Tier t, Category c) { return r.rep.per_device[t][c]; }
int32_t last_forward(const MemorySchedule& m) {
  int32_t last = -1;
  for (int32_t i = 0; i < static_cast<int32_t>(m.op_names.size()); ++i)
    if (m.op_names[static_cast<std::size_t>(i)].rfind("cross_entropy", 0) == 0 &&
        m.op_names[static_cast<std::size_t>(i)].find(".bwd") == std::string::npos)
      last = i;
  return last;
}

}  // namespace

TEST_CASE("fsdp: sharded model states in the model's dtype, no 16-bit copy at rest") {
  // The schedule's state buffers, in bytes (the replay rounds them to the caching
  // allocator's 512-byte blocks).
  auto state = [](const Run& r, const char* name) {
    uint64_t n = 0;
    for (uint64_t b : sizes(r.sched, name)) n += b;
    return n;
  };
  for (uint64_t w : {1u, 2u, 3u, 4u}) {
    CAPTURE(w);
    // FSDP2's units: the embedding (wte, wpe), each block, the final norm (the head is tied).
    const uint64_t part = fsdp2_shard({{V, C}, {P, C}}, w) + L * fsdp2_shard(gpt2_block(C), w) +
                          fsdp2_shard({{C}, {C}}, w);
    // Mixed precision (bf16 compute, fp32 model): fp32 sharded params (the master), fp32
    // sharded gradients, fp32 moments.
    const Run mixed = run(fsdp(w));
    CHECK(mixed.sched.partition_elems == part);
    CHECK(state(mixed, "params") == 0);
    CHECK(state(mixed, "master") == 4 * part);
    CHECK(state(mixed, "grads") == 4 * part);
    CHECK(state(mixed, "exp_avg") + state(mixed, "exp_avg_sq") == 8 * part);
    // Pure bf16 (torchtune): the bf16 shard is the weight; gradients and moments in bf16.
    Strategy p = fsdp(w);
    p.master_precision = Precision::bf16;
    p.optimizer_precision = Precision::bf16;
    const Run pure = run(p);
    CHECK(state(pure, "params") == 2 * part);
    CHECK(state(pure, "master") == 0);
    CHECK(state(pure, "grads") == 2 * part);
    CHECK(state(pure, "exp_avg") + state(pure, "exp_avg_sq") == 4 * part);
  }
}

TEST_CASE("fsdp: per unit an all-gather output and unsharded params, a reduce-scatter input") {
  const uint64_t w = 3;
  // A block's dim-0 shards over 3 ranks: 22 rows of the 64-row tensors, 86 of the 256-row
  // ones: 22 + 22 + 22*192 + 64 + 22*64 + 22 + 22 + 22 + 22*256 + 86 + 86*64 + 22 = 17050
  // elements (ceil(49984 / 3) = 16662 unpadded: FSDP2 pads each parameter, not the unit).
  const uint64_t shard = fsdp2_shard(gpt2_block(C), w);
  CHECK(shard == 17050);
  Strategy s = fsdp(w);
  const Run r = run(s);
  // Each block is gathered for forward and again for backward (reshard_after_forward), in bf16:
  // W x shard elements, twice per step.
  CHECK(sizes(r.sched, "unsharded.h.0") == std::multiset<uint64_t>{2 * w * shard, 2 * w * shard});
  CHECK(sizes(r.sched, "ag_out.h.1") == std::multiset<uint64_t>{2 * w * shard, 2 * w * shard});
  CHECK(sizes(r.sched, "ag_copy_in.h.1") == std::multiset<uint64_t>{2 * shard, 2 * shard});
  // The gradients are reduce-scattered once per block, in fp32 (torchtitan's reduce_dtype):
  // the input is W x shard fp32; the output is the fp32 sharded gradient itself.
  CHECK(sizes(r.sched, "rs_input.h.0") == std::multiset<uint64_t>{4 * w * shard});
  CHECK(sizes(r.sched, "rs_output.h.0").empty());
  // Reducing in bf16 (accelerate's default) into fp32 gradients casts the bf16 output.
  s.reduce_precision = Precision::bf16;
  const Run b = run(s);
  CHECK(sizes(b.sched, "rs_input.h.0") == std::multiset<uint64_t>{2 * w * shard});
  CHECK(sizes(b.sched, "rs_output.h.0") == std::multiset<uint64_t>{2 * shard});
  // The tied embedding and the final norm are never resharded after forward: gathered once.
  CHECK(sizes(r.sched, "unsharded.embed").size() == 1);
  CHECK(sizes(r.sched, "unsharded.head").size() == 1);
  // PyTorch's foreach AdamW: sqrt(exp_avg_sq) the size of the fp32 shard; fused: nothing.
  const uint64_t part = fsdp2_shard({{V, C}, {P, C}}, w) + L * shard + fsdp2_shard({{C}, {C}}, w);
  CHECK(sizes(r.sched, "foreach_sqrt") == std::multiset<uint64_t>{4 * part});
  s.fused_optimizer = true;
  CHECK(sizes(run(s).sched, "foreach_sqrt").empty());
  // A bf16 model without a policy (param_dtype None): the bf16 shards are the all-gather
  // inputs themselves, no cast copy (_fsdp_collectives.py _get_param_all_gather_inputs takes
  // its foreach-copy path only with a param_dtype).
  Strategy p = fsdp(w);
  p.master_precision = p.optimizer_precision = Precision::bf16;
  const Run pure = run(p);
  CHECK(sizes(pure.sched, "ag_copy_in.h.1").empty());
  CHECK(sizes(pure.sched, "ag_out.h.1") == std::multiset<uint64_t>{2 * w * shard, 2 * w * shard});
}

TEST_CASE("fsdp: reshard_after_forward frees a block's parameters after its forward") {
  Strategy s = fsdp(2);
  const Run r = run(s);
  const int32_t fwd_end = last_forward(r.sched);
  REQUIRE(fwd_end > 0);
  std::set<std::string> live = live_after(r.sched, fwd_end);
  CHECK_FALSE(live.contains("unsharded.h.0"));
  CHECK(live.contains("unsharded.embed"));  // tied with the head: not resharded
  // SHARD_GRAD_OP (reshard_after_forward false): every block stays gathered until backward,
  // and the end of forward holds the whole unsharded model (2 bytes per parameter) more.
  s.reshard_after_forward = false;
  const Run k = run(s);
  live = live_after(k.sched, last_forward(k.sched));
  CHECK(live.contains("unsharded.h.0"));
  CHECK(live.contains("unsharded.h.1"));
  CHECK(k.rep.peak_allocated[0] > r.rep.peak_allocated[0]);
  // Nothing stays allocated after the step but the model states.
  for (const Run* x : {&r, &k}) {
    const std::set<std::string> end = live_after(x->sched, static_cast<int32_t>(x->sched.op_names.size()));
    for (const std::string& n : end) {
      CAPTURE(n);
      CHECK((n == "master" || n == "grads" || n == "exp_avg" || n == "exp_avg_sq"));
    }
  }
}

TEST_CASE("fsdp: what the profile cannot plan is a clear error") {
  const auto m = load_model("gpt2-tiny");
  const PlanOptions o{Profile::fsdp, Backend::cuda, ModelCode::fused};
  Strategy s = fsdp(2);
  s.stage = 2;
  CHECK(error_of([&] { estimate(m, s, nullptr, o); }).find("--profile fsdp: --stage 2") == 0);
  s.stage = 3;
  // FSDP offloads the parameters with their gradients and step, never the optimizer alone,
  // and only to the host.
  s.offload_optimizer = Offload::cpu;
  CHECK(error_of([&] { estimate(m, s, nullptr, o); }).find("FSDP has no optimizer-only offload") !=
        std::string::npos);
  s.offload_optimizer = Offload::none;
  s.offload_param = Offload::nvme;
  CHECK(error_of([&] { estimate(m, s, nullptr, o); }).find("FSDP offloads to the host only") !=
        std::string::npos);
  s.offload_param = Offload::none;
  // A shard group that does not divide dp; "a node" without the hardware that says how many
  // GPUs a node has; FSDP's settings under another profile.
  s.fsdp_shard_size = 3;
  CHECK(error_of([&] { estimate(m, s, nullptr, o); }).find("--fsdp-shard-size 3: must divide --dp 2") == 0);
  s.fsdp_shard_size = kFsdpShardNode;
  CHECK(error_of([&] { estimate(m, s, nullptr, o); }).find("needs the node's GPUs") != std::string::npos);
  s.fsdp_shard_size = 2;
  CHECK(error_of([&] { estimate(m, s, nullptr, PlanOptions{Profile::deepspeed}); })
            .find("PyTorch FSDP's, not deepspeed's") != std::string::npos);
  s.fsdp_shard_size = 0;
  s.fsdp_version = 1;
  CHECK(error_of([&] { estimate(m, s, nullptr, PlanOptions{Profile::zeroplan}); })
            .find("PyTorch FSDP's, not zeroplan's") != std::string::npos);
  s.fsdp_version = 3;
  CHECK(error_of([&] { estimate(m, s, nullptr, o); }).find("--fsdp-version: must be 1 or 2") == 0);
}

TEST_CASE("fsdp1: one flat parameter per unit, padded to the shard group, the root unit whole") {
  // gpt2-tiny over 3 ranks: FSDP1's units are each block and the root (wte, wpe, ln_f: the
  // embedding and head groups together). Every tensor has a multiple of 8 elements, so
  // use_orig_params's alignment adds nothing here (see the next case).
  const uint64_t w = 3;
  const uint64_t root = fsdp1_shard(gpt2_root(V, P, C), w, 0);  // ceil(20608 / 3) = 6870
  const uint64_t block = fsdp1_shard(gpt2_block(C), w, 0);      // ceil(49984 / 3) = 16662
  CHECK(root == 6870);
  CHECK(block == 16662);
  CHECK(fsdp1_shard(gpt2_block(C), w, 8) == block);
  Strategy s = fsdp(w);
  s.fsdp_version = 1;
  const Run r = run(s);
  CHECK(r.sched.partition_elems == root + L * block);
  CHECK(at(r, Tier::gpu, Category::master) >= 4 * (root + L * block));
  // The all-gather writes into the unsharded flat parameter itself (_full_param_padded,
  // W x shard in bf16): no flat output beside it. Its input is the bf16 _mp_shard.
  CHECK(sizes(r.sched, "unsharded.h.0") == std::multiset<uint64_t>{2 * w * block, 2 * w * block});
  CHECK(sizes(r.sched, "mp_shard.h.0") == std::multiset<uint64_t>{2 * block, 2 * block});
  CHECK(sizes(r.sched, "ag_out.h.0").empty());
  // The root is gathered once and held from the first forward op to its last backward
  // (FSDP1 does not reshard the root after forward).
  CHECK(sizes(r.sched, "unsharded.root") == std::multiset<uint64_t>{2 * w * root});
  CHECK(live_after(r.sched, last_forward(r.sched)).contains("unsharded.root"));
  // Gradients: autograd's flat gradient (49984 bf16 elements), cast to the fp32 reduce dtype,
  // padded to 3 x 16662 = 49986 for the reduce-scatter (a copy), whose fp32 output is the
  // sharded gradient.
  CHECK(sizes(r.sched, "flat_grad.h.0") == std::multiset<uint64_t>{2 * kBlock});
  CHECK(sizes(r.sched, "flat_grad_reduce_dtype.h.0") == std::multiset<uint64_t>{4 * kBlock});
  CHECK(sizes(r.sched, "rs_input.h.0") == std::multiset<uint64_t>{4 * w * block});
  CHECK(sizes(r.sched, "rs_output.h.0").empty());
  // accelerate's bf16 reduce: no cast of the flat gradient; the bf16 output is cast to fp32.
  s.reduce_precision = Precision::bf16;
  const Run b = run(s);
  CHECK(sizes(b.sched, "flat_grad_reduce_dtype.h.0").empty());
  CHECK(sizes(b.sched, "rs_input.h.0") == std::multiset<uint64_t>{2 * w * block});
  CHECK(sizes(b.sched, "rs_output.h.0") == std::multiset<uint64_t>{2 * block});
  // No forward prefetch (forward_prefetch=False): two blocks are never unsharded together in
  // forward; backward prefetches the next unit (BACKWARD_PRE), so they are there.
  bool fwd_both = false, bwd_both = false;
  const int32_t fwd_end = last_forward(r.sched);
  for (int32_t i = 0; i < static_cast<int32_t>(r.sched.op_names.size()); ++i) {
    const std::set<std::string> live = live_after(r.sched, i);
    const bool both = live.contains("unsharded.h.0") && live.contains("unsharded.h.1");
    (i <= fwd_end ? fwd_both : bwd_both) |= both;
  }
  CHECK_FALSE(fwd_both);
  CHECK(bwd_both);
}

TEST_CASE("fsdp1: use_orig_params aligns each parameter to 16 bytes of the compute dtype") {
  // A GPT-2 of width 36 (vocabulary 250, 32 positions, one block): tensors of 36 and 108
  // elements are not multiples of 8. With bf16 compute each parameter starts at a multiple
  // of 16 / 2 = 8 elements (_flat_param.py _get_aligned_numel), and the flat parameter is
  // padded to a multiple of W (_init_flat_param_and_metadata):
  //   block: 36, +4 pad, 36, +4, 3888, 108, +4, 1296, 36, +4, 36, +4, 36, +4, 5184, 144, 5184,
  //     36 = 16044 elements (16020 unpadded), a multiple of 3: 5348 each (5340 without);
  //   root: wte 9000, wpe 1152, ln_f 36, +4, 36 = 10228, padded to 10230: 3410 each (3408).
  const auto m = zp::models::parse_hf_config(
      R"({"model_type": "gpt2", "vocab_size": 250, "n_positions": 32, "n_embd": 36,
          "n_layer": 1, "n_head": 4})", "gpt2-36");
  const uint64_t w = 3, c = 36;
  CHECK(fsdp1_shard(gpt2_block(c), w, 8) == 5348);
  CHECK(fsdp1_shard(gpt2_block(c), w, 0) == 5340);
  CHECK(fsdp1_shard(gpt2_root(250, 32, c), w, 8) == 3410);
  CHECK(fsdp1_shard(gpt2_root(250, 32, c), w, 0) == 3408);
  Strategy s = fsdp(w);
  s.fsdp_version = 1;
  CHECK(run(s, m).sched.partition_elems == 3408 + 5340);
  s.fsdp_use_orig_params = true;
  const Run aligned = run(s, m);
  CHECK(aligned.sched.partition_elems == 3410 + 5348);
  // The flat gradient is the padded flat parameter (16044 = 3 x 5348): no padding copy.
  CHECK(sizes(aligned.sched, "flat_grad.h.0") == std::multiset<uint64_t>{2 * 16044});
  CHECK(sizes(aligned.sched, "rs_input.h.0").empty());
  // fp32 compute aligns to 4 elements, which every tensor here is a multiple of.
  s.precision = Precision::fp32;
  CHECK(fsdp1_shard(gpt2_block(c), w, 4) == 5340);
  CHECK(run(s, m).sched.partition_elems == fsdp1_shard(gpt2_root(250, 32, c), w, 4) + 5340);
  // FSDP2 pads each parameter's dim 0 instead: 12 rows of 36, 36 of 108, 48 of 144.
  Strategy v2 = fsdp(w);
  CHECK(run(v2, m).sched.partition_elems ==
        fsdp2_shard({{250, c}, {32, c}}, w) + fsdp2_shard(gpt2_block(c), w) + fsdp2_shard({{c}, {c}}, w));
}

TEST_CASE("hybrid sharding: states sharded over the shard group, gradients all-reduced over replicas") {
  // dp 4 as 2 replicas of a shard group of 2 ranks (FSDP2's HSDP on a (2, 2) mesh; FSDP1's
  // HYBRID_SHARD with 2 GPUs per node): each rank holds a 2-way shard, as FULL_SHARD over 2.
  const uint64_t n = 2;
  const uint64_t block = fsdp2_shard(gpt2_block(C), n);
  const uint64_t part = fsdp2_shard({{V, C}, {P, C}}, n) + L * block + fsdp2_shard({{C}, {C}}, n);
  Strategy h = fsdp(4);
  h.fsdp_shard_size = static_cast<int64_t>(n);
  const Run hr = run(h);
  CHECK(hr.sched.partition_elems == part);
  CHECK(at(hr, Tier::gpu, Category::master) >= 4 * part);
  CHECK(sizes(hr.sched, "unsharded.h.0") == std::multiset<uint64_t>{2 * n * block, 2 * n * block});
  CHECK(sizes(hr.sched, "rs_input.h.0") == std::multiset<uint64_t>{4 * n * block});
  // torchtitan's fp32 reduce into fp32 gradients: the all-reduce runs in place on the
  // sharded gradient, so the step holds exactly what FULL_SHARD over 2 ranks holds.
  const Run full2 = run(fsdp(n));
  CHECK(hr.rep.peak_allocated[0] == full2.rep.peak_allocated[0]);
  CHECK(hr.sched.buffers.size() == full2.sched.buffers.size());
  // A bf16 reduce into fp32 gradients: each unit's bf16 reduce-scatter output is all-reduced
  // and then kept by its _all_reduce_state until the end of backward (finalize_backward): when
  // h.0's is allocated, h.1's and the head's are still there.
  h.reduce_precision = Precision::bf16;
  const Run hb = run(h);
  CHECK(sizes(hb.sched, "rs_output.h.0") == std::multiset<uint64_t>{2 * block});
  const int32_t h0 = first_alloc(hb.sched, "rs_output.h.0");
  REQUIRE(h0 >= 0);
  const std::set<std::string> live = live_after(hb.sched, h0);
  CHECK(live.contains("rs_output.h.1"));
  CHECK(live.contains("rs_output.head"));
  CHECK(live.contains("rs_output.h.0"));
  // Without hybrid sharding the output is cast and dropped at once.
  Strategy f = fsdp(4);
  f.reduce_precision = Precision::bf16;
  const Run fb = run(f);
  const int32_t f0 = first_alloc(fb.sched, "rs_output.h.0");
  REQUIRE(f0 >= 0);
  CHECK_FALSE(live_after(fb.sched, f0).contains("rs_output.h.1"));
  // FSDP1's hybrid reduce (_reduce_grad) all-reduces its new sharded gradient in place and
  // keeps nothing.
  h.fsdp_version = 1;
  const Run h1 = run(h);
  const int32_t g0 = first_alloc(h1.sched, "rs_output.h.0");
  REQUIRE(g0 >= 0);
  CHECK_FALSE(live_after(h1.sched, g0).contains("rs_output.h.1"));
}

TEST_CASE("hybrid sharding over a node: the hardware's GPUs per node") {
  const auto m = load_model("gpt2-tiny");
  const auto hw = load_hardware("h100-80g");
  REQUIRE(hw.gpus_per_node == 8);
  const PlanOptions o{Profile::fsdp, Backend::cuda, ModelCode::fused};
  Strategy s = fsdp(16);
  s.seq = 64;
  s.fsdp_shard_size = kFsdpShardNode;
  const Estimate e = estimate(m, s, &hw, o);
  CHECK(e.strategy.fsdp_shard_size == 8);
  Strategy eight = fsdp(16);
  eight.seq = 64;
  eight.fsdp_shard_size = 8;
  CHECK(e.per_device == estimate(m, eight, &hw, o).per_device);
  // Fewer ranks than a node's GPUs: one shard group of them all.
  s.dp = 4;
  CHECK(estimate(m, s, &hw, o).strategy.fsdp_shard_size == 4);
  // Ranks that do not fill whole nodes cannot be split into node groups.
  s.dp = 12;
  CHECK(error_of([&] { estimate(m, s, &hw, o); }).find("do not divide --dp 12") != std::string::npos);
}

TEST_CASE("hybrid sharding in the step simulation: per-unit all-gathers within the node, all-reduces across") {
  // 2 nodes of 8 H100s, dp 16 as 2 replicas of 8-rank shard groups. Each unit's gradient
  // shard (its parameters / 8, in fp32, torchtitan's reduce dtype) is all-reduced over the 2
  // replicas at each GPU's share of the node's network (internode_gbps / 8: every GPU of the
  // node all-reduces at once); all-gathers and reduce-scatters stay on NVLink.
  const auto m = load_model("gpt2");
  const auto hw = load_hardware("h100-80g");
  Strategy s = fsdp(16);
  s.seq = 1024;
  s.fsdp_shard_size = 8;
  const PlanOptions o{Profile::fsdp, Backend::cuda, ModelCode::fused};
  const auto g = zp::models::build_training_graph(m, graph_options(m, s, o));
  const StepCosts c = step_costs(g);
  const Timeline t = simulate(c, s, hw, Cluster{16, 2}, Profile::fsdp);
  const double gbps = std::min(hw.nvlink_gbps, hw.internode_gbps / 8);
  int all_reduces = 0;
  for (const Task& k : t.tasks) {
    if (k.step != 1) continue;
    const std::size_t i = static_cast<std::size_t>(c.n_layer + 1 - k.index);  // backward order
    if (std::string_view(k.kind) == "all-reduce") {
      ++all_reduces;
      const double bytes = static_cast<double>(c.group_params[i]) / 8 * 4;
      CHECK(k.seconds == doctest::Approx(bytes * 2 * (2 - 1) / 2 / (gbps * 1e9)));
    }
    if (std::string_view(k.kind) == "all-gather") {
      const double bytes = static_cast<double>(c.group_params[static_cast<std::size_t>(k.index)]) * 2;
      CHECK(k.seconds == doctest::Approx(bytes * 7 / 8 / (hw.nvlink_gbps * 1e9)));
    }
  }
  CHECK(all_reduces == static_cast<int>(c.group_params.size()));  // one per unit
  // Without hybrid sharding no all-reduce, and the collectives span both nodes.
  Strategy full = s;
  full.fsdp_shard_size = 0;
  int n_full = 0;
  for (const Task& k : simulate(c, full, hw, Cluster{16, 2}, Profile::fsdp).tasks)
    n_full += std::string_view(k.kind) == "all-reduce";
  CHECK(n_full == 0);
}

TEST_CASE("CPU offload: sharded parameters, gradients and optimizer states on the host") {
  // FSDP2's CPUOffloadPolicy (FSDP1's CPUOffload(offload_params=True) alike): the fp32
  // sharded parameters, their gradients and AdamW's moments are pinned host memory; the GPU
  // holds none of them.
  const uint64_t w = 3;
  const uint64_t block = fsdp2_shard(gpt2_block(C), w);  // 17050, as above
  const uint64_t part = fsdp2_shard({{V, C}, {P, C}}, w) + L * block + fsdp2_shard({{C}, {C}}, w);
  Strategy s = fsdp(w);
  s.offload_param = Offload::cpu;
  const Run r = run(s);
  CHECK(at(r, Tier::cpu, Category::master) == 4 * part);
  CHECK(at(r, Tier::cpu, Category::grads) == 4 * part);
  CHECK(at(r, Tier::cpu, Category::optimizer) == 8 * part);
  for (Category c : {Category::params, Category::master, Category::grads, Category::optimizer})
    CHECK(at(r, Tier::gpu, c) == 0);
  // Before each all-gather the unit's shards cross to the GPU one parameter at a time
  // (FSDPParam.all_gather_inputs: .to(device)), each cast to bf16 into the all-gather input:
  // the largest fp32 copy is c_fc's (22 rows x 256 = 5632 elements), the cast the shard.
  CHECK(sizes(r.sched, "h2d_shard.h.0") == std::multiset<uint64_t>{4 * 22 * 256, 4 * 22 * 256});
  CHECK(sizes(r.sched, "ag_copy_in.h.0") == std::multiset<uint64_t>{2 * block, 2 * block});
  // The reduce-scatter output goes to the host (fp32 reduce into fp32 gradients: no cast)
  // and is dropped; a bf16 reduce adds the fp32 cast that crosses.
  CHECK(sizes(r.sched, "rs_output.h.0") == std::multiset<uint64_t>{4 * block});
  CHECK(sizes(r.sched, "grad_to_host.h.0").empty());
  // The step runs on the host: no foreach temporary on the GPU; torch.optim's for-loop AdamW
  // takes sqrt(exp_avg_sq) and its quotient, two temporaries of the largest tensor (5632).
  CHECK(sizes(r.sched, "foreach_sqrt").empty());
  CHECK(sizes(r.sched, "adam_sqrt") == std::multiset<uint64_t>{4 * 22 * 256});
  CHECK(sizes(r.sched, "adam_denom") == std::multiset<uint64_t>{4 * 22 * 256});
  for (const MemBuffer& b : r.sched.buffers)
    if (b.name == "adam_sqrt" || b.name == "adam_denom") CHECK(b.tier == Tier::cpu);
  Strategy b = s;
  b.reduce_precision = Precision::bf16;
  const Run rb = run(b);
  CHECK(sizes(rb.sched, "rs_output.h.0") == std::multiset<uint64_t>{2 * block});
  CHECK(sizes(rb.sched, "grad_to_host.h.0") == std::multiset<uint64_t>{4 * block});
  // torchtune's pure bf16 with CPUOffloadPolicy: the bf16 copies are the all-gather inputs.
  Strategy p = s;
  p.master_precision = p.optimizer_precision = Precision::bf16;
  const Run rp = run(p);
  CHECK(at(rp, Tier::cpu, Category::params) == 2 * part);
  CHECK(sizes(rp.sched, "h2d_shard.h.0") == std::multiset<uint64_t>{2 * block, 2 * block});
  CHECK(sizes(rp.sched, "ag_copy_in.h.0").empty());
  // FSDP1 (_flat_param.py pre_unshard, _use_low_precision_shard): the whole fp32 flat shard
  // is copied to the GPU and cast into the bf16 _mp_shard.
  Strategy f1 = s;
  f1.fsdp_version = 1;
  const uint64_t flat_block = fsdp1_shard(gpt2_block(C), w, 0);
  const Run r1 = run(f1);
  CHECK(sizes(r1.sched, "h2d_shard.h.0") == std::multiset<uint64_t>{4 * flat_block, 4 * flat_block});
  CHECK(sizes(r1.sched, "mp_shard.h.0") == std::multiset<uint64_t>{2 * flat_block, 2 * flat_block});
  CHECK(at(r1, Tier::cpu, Category::master) ==
        4 * (fsdp1_shard(gpt2_root(V, P, C), w, 0) + L * flat_block));
  // Offloaded, the GPU peak is lower by at least the states it no longer holds.
  const Run on_gpu = run(fsdp(w));
  CHECK(r.rep.peak_allocated[0] + 16 * part <= on_gpu.rep.peak_allocated[0] + 4 * 22 * 256 + 4 * block);
}

TEST_CASE("CPU offload in the step simulation: shards in over PCIe, gradients out, the step on the host") {
  const auto m = load_model("gpt2");
  const auto hw = load_hardware("h100-80g");
  Strategy s = fsdp(8);
  s.seq = 1024;
  s.offload_param = Offload::cpu;
  const PlanOptions o{Profile::fsdp, Backend::cuda, ModelCode::fused};
  const StepCosts c = step_costs(zp::models::build_training_graph(m, graph_options(m, s, o)));
  const Timeline t = simulate(c, s, hw, Cluster{8, 1}, Profile::fsdp);
  int h2d = 0, d2h = 0, cpu = 0, gpu_adam = 0;
  for (const Task& k : t.tasks) {
    if (k.step != 1) continue;
    const std::string_view kind = k.kind;
    if (kind == "h2d params") {  // the unit's fp32 shard, before each of its two gathers
      ++h2d;
      const double bytes = static_cast<double>(c.group_params[static_cast<std::size_t>(k.index)]) / 8 * 4;
      CHECK(k.seconds == doctest::Approx(bytes / (hw.h2d_gbps * 1e9)));
    }
    if (kind == "d2h grads") {  // the reduced fp32 gradient shard
      ++d2h;
      const std::size_t i = static_cast<std::size_t>(c.n_layer + 1 - k.index);
      CHECK(k.seconds == doctest::Approx(static_cast<double>(c.group_params[i]) / 8 * 4 / (hw.d2h_gbps * 1e9)));
    }
    cpu += kind == "cpu adam";
    gpu_adam += kind == "gpu adam";
  }
  const int units = static_cast<int>(c.group_params.size());
  CHECK(h2d == 2 * units);
  CHECK(d2h == units);
  CHECK(cpu >= 1);
  CHECK(gpu_adam == 0);
}

TEST_CASE("accelerate's FSDP config: the YAML `accelerate config` writes, and its JSON twin") {
  // What `accelerate config` writes for FSDP2 (accelerate commands/config/cluster.py), with
  // the launcher's keys around it.
  const char* yaml = R"(compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 16
rdzv_backend: static
same_network: true
tpu_env: []
use_cpu: false
)";
  const Strategy s = apply_accelerate_config(Strategy{}, yaml, "fsdp.yaml");
  CHECK(s.stage == 3);
  CHECK(s.dp == 16);
  CHECK(s.precision == Precision::bf16);
  CHECK(s.reduce_precision == Precision::bf16);  // accelerate reduces in the param dtype
  CHECK(s.master_precision == Precision::fp32);  // and upcasts the parameters it shards
  CHECK(s.reshard_after_forward == false);
  CHECK(s.checkpointing == Checkpointing::full);
  CHECK(s.fsdp_version == 2);
  CHECK(s.fsdp_shard_size == 0);
  CHECK(s.offload_param == Offload::none);
  // The same keys as JSON (YAML's superset), FSDP1 with the strategy as a number.
  const Strategy j = apply_accelerate_config(
      Strategy{}, R"({"distributed_type": "FSDP", "mixed_precision": "no", "num_processes": 4,
                      "fsdp_config": {"fsdp_sharding_strategy": 1, "fsdp_offload_params": "false"}})",
      "fsdp.json");
  CHECK(j.dp == 4);
  CHECK(j.precision == Precision::fp32);
  CHECK(j.reshard_after_forward == true);
  CHECK(j.checkpointing == Checkpointing::none);
  // fsdp_version absent: FSDP1, accelerate's default, with accelerate launch's
  // use_orig_params true.
  CHECK(j.fsdp_version == 1);
  CHECK(j.fsdp_use_orig_params == true);
  // FSDP1's SHARD_GRAD_OP by name, under the key without the fsdp_ prefix accelerate also takes.
  CHECK(apply_accelerate_config(Strategy{},
                                "distributed_type: FSDP\nfsdp_config:\n  sharding_strategy: SHARD_GRAD_OP\n",
                                "a.yaml")
            .reshard_after_forward == false);
  // Refusals name the field and say what to use.
  auto err = [](const char* text) {
    return error_of([&] { apply_accelerate_config(Strategy{}, text, "x.yaml"); });
  };
  CHECK(err("distributed_type: DEEPSPEED\n").find("DeepSpeed run") != std::string::npos);
  CHECK(err("distributed_type: MULTI_GPU\n").find("plain data parallel") != std::string::npos);
  CHECK(err("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: NO_SHARD\n")
            .find("NO_SHARD is plain data parallel") != std::string::npos);
  CHECK(err("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\nparallelism_config:\n"
            "  parallelism_config_dp_replicate_size: 2\n")
            .find("parallelism_config needs fsdp_version 2") != std::string::npos);
  CHECK(err("distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n"
            "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
            "  parallelism_config_dp_shard_size: 4\n  parallelism_config_tp_size: 2\n")
            .find("parallelism_config.parallelism_config_tp_size > 1 is not modelled") != std::string::npos);
  CHECK(err("distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n"
            "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
            "  parallelism_config_dp_shard_size: 2\n")
            .find("is not num_processes 8") != std::string::npos);
  CHECK(err("distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n"
            "parallelism_config:\n  parallelism_config_dp_replicas: 2\n")
            .find("unknown field 'parallelism_config.parallelism_config_dp_replicas'") != std::string::npos);
  CHECK(err("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SOMETIMES\n")
            .find("'fsdp_config.fsdp_sharding_strategy' must be") != std::string::npos);
  CHECK(err("distributed_type: FSDP\nmixed_precision: fp8\n").find("fp8 is not modelled") !=
        std::string::npos);
  CHECK(err("distributed_type: FSDP\nnum_procs: 8\n").find("unknown field 'num_procs'") !=
        std::string::npos);
  CHECK(err("distributed_type: FSDP\nfsdp_config: [1, 2\n").find("not valid YAML at line") !=
        std::string::npos);
}

TEST_CASE("accelerate's FSDP config: hybrid sharding, CPU offload, FSDP1's flat parameter") {
  auto read = [](const std::string& text) {
    std::vector<std::string> assumed;
    const Strategy s = apply_accelerate_config(Strategy{}, text, "fsdp.yaml", &assumed);
    return std::pair{s, assumed};
  };
  // FSDP1's HYBRID_SHARD (by name or as 4) and _HYBRID_SHARD_ZERO2: sharded over a node's GPUs,
  // resharding after forward or not.
  for (const char* name : {"HYBRID_SHARD", "4"}) {
    const auto [s, assumed] = read(std::string("distributed_type: FSDP\nnum_processes: 16\n"
                                               "fsdp_config:\n  fsdp_sharding_strategy: ") + name + "\n");
    CHECK(s.fsdp_shard_size == kFsdpShardNode);
    CHECK(s.reshard_after_forward);
    CHECK(s.fsdp_version == 1);
    bool said = false;
    for (const std::string& a : assumed) said |= a.find("sharded over a node's GPUs") != std::string::npos;
    CHECK(said);
  }
  const Strategy zero2 = read("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: "
                              "HYBRID_SHARD_ZERO2\n  fsdp_use_orig_params: false\n").first;
  CHECK(zero2.fsdp_shard_size == kFsdpShardNode);
  CHECK_FALSE(zero2.reshard_after_forward);
  CHECK_FALSE(zero2.fsdp_use_orig_params);
  // FSDP2's HSDP: accelerate's parallelism_config, as `accelerate config` writes it
  // (commands/config/cluster.py: the parallelism_config_ prefix).
  const Strategy hsdp = read(R"(distributed_type: FSDP
mixed_precision: bf16
num_processes: 16
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
  fsdp_offload_params: false
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 8
  parallelism_config_tp_size: 1
  parallelism_config_cp_size: 1
)").first;
  CHECK(hsdp.fsdp_shard_size == 8);
  CHECK(hsdp.dp == 16);
  CHECK(hsdp.fsdp_version == 2);
  // Only sharding (replicate size 1): FULL_SHARD over all processes.
  CHECK(read("distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_version: 2\n"
             "parallelism_config:\n  parallelism_config_dp_replicate_size: 1\n"
             "  parallelism_config_dp_shard_size: 4\n").first.fsdp_shard_size == 0);
  // fsdp_offload_params: FSDP's CPU offload, FSDP1 and FSDP2 alike.
  for (const char* v : {"1", "2"}) {
    const Strategy off = read(std::string("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: ") + v +
                              "\n  fsdp_offload_params: true\n").first;
    CHECK(off.offload_param == Offload::cpu);
    CHECK(off.offload_optimizer == Offload::none);
  }
}

TEST_CASE("pytorch profile: one GPU or DDP, the model's tensors whole, DDP's bucket copy") {
  const auto m = load_model("gpt2-tiny");
  const uint64_t psi = kEmbed + L * kBlock + kHead;
  auto sched = [&](Strategy s) {
    s.seq = 64;
    const PlanOptions o{Profile::pytorch, Backend::cuda, ModelCode::fused};
    check_profile(s, o);
    return build_schedule(zp::models::build_training_graph(m, graph_options(m, s, o)), s, o);
  };
  auto total = [](const MemorySchedule& ms, const char* name) {
    uint64_t n = 0;
    for (uint64_t b : sizes(ms, name)) n += b;
    return n;
  };
  Strategy s;
  s.precision = Precision::fp32;
  // fp32 weights, gradients and AdamW's moments (torch.optim: zeros_like the parameters),
  // and the foreach step's sqrt(exp_avg_sq): 4 + 4 + 8 (+ 4 during the step) bytes each.
  MemorySchedule one = sched(s);
  CHECK(total(one, "params") == 4 * psi);
  CHECK(total(one, "grads") == 4 * psi);
  CHECK(total(one, "exp_avg") + total(one, "exp_avg_sq") == 8 * psi);
  CHECK(total(one, "foreach_sqrt") == 4 * psi);
  CHECK(total(one, "ddp_buckets") == 0);
  // DDP over 2 ranks: the reducer's flat buckets copy every gradient.
  s.dp = 2;
  CHECK(total(sched(s), "ddp_buckets") == 4 * psi);
  // A bf16 model (no autocast): everything in bf16.
  s.precision = Precision::bf16;
  s.master_precision = s.optimizer_precision = Precision::bf16;
  const MemorySchedule b = sched(s);
  CHECK(total(b, "params") == 2 * psi);
  CHECK(total(b, "exp_avg") + total(b, "exp_avg_sq") == 4 * psi);
  CHECK(total(b, "ddp_buckets") == 2 * psi);
  // What plain PyTorch does not do.
  Strategy z;
  z.stage = 2;
  CHECK(error_of([&] { sched(z); }).find("--profile pytorch: --stage 2") == 0);
  // Autocast on fp32 weights (the Trainer's --fp16): the weights stay fp32 (the optimizer's
  // own, category master), with fp32 gradients and moments; the forward casts each matmul's
  // weight to 16 bits (category params, models::GraphOptions::autocast), and the for-loop
  // AdamW of transformers holds one temporary the size of the largest tensor (the word
  // embedding, V x C) where foreach holds one of every moment.
  Strategy amp;
  amp.precision = Precision::fp16;
  const MemorySchedule a = sched(amp);
  CHECK(total(a, "master") == 4 * psi);
  CHECK(total(a, "grads") == 4 * psi);
  CHECK(total(a, "exp_avg") + total(a, "exp_avg_sq") == 8 * psi);
  uint64_t casts = 0;
  for (const MemBuffer& buf : a.buffers)
    if (buf.name.ends_with(".autocast")) {
      CHECK(buf.category == Category::params);
      casts += buf.bytes;
    }
  CHECK(casts > 0);
  CHECK(casts < 2 * psi);  // norms and embeddings are not cast
  amp.optimizer_impl = OptimizerImpl::transformers;
  CHECK(total(sched(amp), "adam_denom") == 4 * uint64_t(m.vocab_size) * uint64_t(m.n_embd));
  // Families whose casts the graph does not follow are refused by name.
  const auto moe = load_model("mixtral-8x7b");
  CHECK(error_of([&] { check_profile(amp, PlanOptions{Profile::pytorch, Backend::cuda}, &moe); })
            .find("Mixture-of-Experts") != std::string::npos);
}

namespace {

// Every model the planner reads: the catalog, and the PyTorch reference fixture's configs
// (tests/data/models/torch_reference.json, one per family variant).
std::vector<zp::models::ModelSpec> every_model() {
  std::vector<zp::models::ModelSpec> out;
  for (const auto& c : zp::models::catalog()) out.push_back(load_model(c.name));
  std::ifstream f(std::string(ZP_TEST_DATA) + "/models/torch_reference.json");
  REQUIRE(f.good());
  const nlohmann::json fixture = nlohmann::json::parse(f);
  REQUIRE(fixture["configs"].size() >= 30);
  for (const auto& c : fixture["configs"])
    out.push_back(zp::models::parse_hf_config(c["config"].dump(), c["name"].get<std::string>()));
  return out;
}

}  // namespace

TEST_CASE("estimate --profile fsdp works for every model the planner reads") {
  // For each model, from its inventory (models::count_params: every tensor with its shape and
  // its block, -1 before the blocks, n_blocks() after them), the rank's shard over W = 8:
  //   FSDP2: sum over tensors of ceil(d0 / 8) * numel / d0 (every tensor's dim-0 chunk);
  //   FSDP1: per unit (each block; the rest together as the root), the flat parameter with
  //     each tensor 16-byte aligned (use_orig_params, bf16: 8 elements) padded to a multiple
  //     of 8, divided by 8;
  // and with torchtitan's mixed precision the states are 4 (fp32 sharded parameters) + 4
  // (fp32 gradients) + 8 (AdamW's fp32 moments) bytes per shard element. The estimate must
  // hold exactly those states, decide whether it fits an H100, and end its step holding
  // nothing else.
  const uint64_t w = 8;
  const auto hw = load_hardware("h100-80g");
  const PlanOptions o{Profile::fsdp, Backend::cuda, ModelCode::transformers};
  int n_models = 0;
  for (const zp::models::ModelSpec& m : every_model()) {
    CAPTURE(m.name);
    ++n_models;
    const zp::models::ParamInventory inv = zp::models::count_params(m);
    uint64_t v2 = 0, n = 0;
    std::map<int, uint64_t> flat;  // unit (block, or -1 for the root) -> aligned elements
    for (const zp::models::ParamTensor& t : inv.tensors) {
      const uint64_t e = static_cast<uint64_t>(t.numel);
      const uint64_t d0 = t.shape.empty() ? 1 : static_cast<uint64_t>(t.shape[0]);
      v2 += ceil_div(d0, w) * (e / d0);
      n += e;
      const int unit = t.layer >= 0 && t.layer < static_cast<int>(m.n_blocks()) ? t.layer : -1;
      flat[unit] = ceil_div(flat[unit], 8) * 8 + e;
    }
    REQUIRE(n == static_cast<uint64_t>(inv.total));
    uint64_t v1 = 0;
    for (const auto& [unit, elems] : flat) v1 += ceil_div(elems, w);  // ceil(ceil(x/8)*8 / 8)
    for (int version : {2, 1}) {
      CAPTURE(version);
      Strategy s = fsdp(w);
      s.fsdp_version = version;
      s.fsdp_use_orig_params = version == 1;
      s.seq = std::min<int64_t>(m.n_positions, 1024);
      if (m.encoder_decoder()) s.target_seq = std::min<int64_t>(m.n_positions, 256);
      s.checkpointing = Checkpointing::full;
      const Estimate e = estimate(m, s, &hw, o);
      const uint64_t part = version == 2 ? v2 : v1;
      CHECK(e.schedule.partition_elems == part);
      uint64_t master = 0, grads = 0, moments = 0, params = 0;
      for (const MemEvent& ev : e.schedule.events) {
        if (!ev.alloc || ev.pos != -1) continue;
        const MemBuffer& b = e.schedule.buffers[ev.buffer];
        if (b.name == "master") master += b.bytes;
        if (b.name == "grads") grads += b.bytes;
        if (b.name == "exp_avg" || b.name == "exp_avg_sq") moments += b.bytes;
        if (b.name == "params") params += b.bytes;
      }
      CHECK(master == 4 * part);
      CHECK(grads == 4 * part);
      CHECK(moments == 8 * part);
      CHECK(params == 0);
      // The GPU peak holds at least the states and the largest unit gathered; fits is
      // decided, and decided by that peak.
      CHECK(e.memory.peak_allocated[0] >= 16 * part);
      REQUIRE(e.fits.has_value());
      CHECK(*e.fits == (e.per_device.peak(Tier::gpu) <= hw.gpu_memory_bytes &&
                        e.per_device.peak(Tier::cpu) * std::min<uint64_t>(w, hw.gpus_per_node) <=
                            hw.host_memory_bytes));
      const std::set<std::string> end =
          live_after(e.schedule, static_cast<int32_t>(e.schedule.op_names.size()));
      for (const std::string& b : end) {
        CAPTURE(b);
        CHECK((b == "master" || b == "grads" || b == "exp_avg" || b == "exp_avg_sq"));
      }
    }
  }
  CHECK(n_models >= static_cast<int>(zp::models::catalog().size()) + 30);
}
