// DeepSpeed options that move memory, as the deepspeed profile models them: contiguous
// gradients (the engine's ipg buffers), each against a hand count written out here from
// gpt2-tiny's torch tensors and from what DeepSpeed's code allocates (the source of each term
// next to it; planner/notes/deepspeed-memory.md has the line numbers).
#include <doctest/doctest.h>

#include <map>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/models/graph.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/hardware.hpp"
#include "zp/planner/schedule.hpp"

using namespace zp::planner;
using zp::models::load_model;

namespace {

// gpt2-tiny: V=256, P=64, C=64, L=2, tied head. Its torch tensors, in module order:
// wte (V x C) 16384, wpe (P x C) 4096; per block ln_1 (C, C), c_attn (C x 3C = 12288, 3C = 192),
// attn.c_proj (C x C = 4096, C), ln_2 (C, C), c_fc (C x 4C = 16384, 4C = 256), mlp.c_proj
// (4C x C = 16384, C); ln_f (C, C).
constexpr uint64_t C = 64, V = 256, P = 64, L = 2;
constexpr uint64_t kPsi = V * C + P * C + L * (12 * C * C + 13 * C) + 2 * C;

struct Run {
  zp::models::TrainingGraph graph;
  MemorySchedule sched;
  MemoryReport rep;
};
Run run(Strategy s) {
  const PlanOptions o{Profile::deepspeed, Backend::cuda};
  const auto m = load_model("gpt2-tiny");
  if (s.seq == 0) s.seq = 64;
  Run r;
  r.graph = zp::models::build_training_graph(m, graph_options(m, s, o));
  r.sched = build_schedule(r.graph, s, o);
  r.rep = replay(r.sched, o);
  return r;
}

// Every buffer of that name: bytes each, and the positions of its allocations and frees.
struct Seen {
  std::vector<uint64_t> bytes;
  std::vector<int32_t> alloc_at, free_at;
};
Seen seen(const Run& r, const std::string& name) {
  Seen out;
  for (const MemEvent& e : r.sched.events) {
    const MemBuffer& b = r.sched.buffers[e.buffer];
    if (b.name != name) continue;
    if (e.alloc) {
      out.bytes.push_back(b.bytes);
      out.alloc_at.push_back(e.pos);
    } else {
      out.free_at.push_back(e.pos);
    }
  }
  return out;
}
uint64_t total(const Seen& s) {
  uint64_t n = 0;
  for (uint64_t b : s.bytes) n += b;
  return n;
}
int32_t last_backward(const Run& r) {
  int32_t last = -1;
  for (std::size_t i = 0; i < r.graph.order.size(); ++i)
    if (r.graph.op(r.graph.order[i]).phase == zp::models::Phase::backward) last = static_cast<int32_t>(i);
  return last;
}

}  // namespace

TEST_CASE("contiguous_gradients, stages 1-2: the ipg buffers, each gradient copied at its hook") {
  // stage_1_and_2.py setup_buckets: the first gradient hook of a backward allocates one
  // buffer of reduce_bucket_size elements in the 16-bit dtype, a second with overlap_comm;
  // _release_ipg_buffers frees them at the end of backward.
  const uint64_t B = 10'000;
  Strategy s;
  s.stage = 2;
  s.dp = 2;
  s.buffers.reduce_bucket_size = B;
  Run r = run(s);
  const int32_t end = last_backward(r);
  const Seen ipg0 = seen(r, "ipg_buffer.0");
  CHECK(ipg0.bytes == std::vector<uint64_t>{2 * B});  // bf16: 20000 bytes
  CHECK(ipg0.free_at == std::vector<int32_t>{end});
  CHECK(seen(r, "ipg_buffer.1").bytes.empty());
  s.overlap_comm = true;
  CHECK(seen(run(s), "ipg_buffer.1").bytes == std::vector<uint64_t>{2 * B});
  s.overlap_comm.reset();

  // A gradient is copied into the buffer when autograd has finished it (its last write)
  // and its own tensor freed there; a torch tensor of more than B elements is not copied
  // (extra_large_param_to_reduce) and its gradient waits for the next reduction. Of
  // gpt2-tiny's, wte (16384), c_attn.weight (12288), c_fc.weight (16384) and mlp.c_proj.
  // weight (16384) pass 10000: the graph's wte, attn.qkv, mlp.fc and mlp.proj gradients.
  const zp::models::Liveness lv = zp::models::liveness(r.graph);
  const Seen flat = seen(r, "reduce_flat");
  const std::set<int32_t> reductions(flat.alloc_at.begin(), flat.alloc_at.end());
  const std::set<std::string> held = {"bucket.wte.grad",         "bucket.h.0.attn.qkv.grad",
                                      "bucket.h.0.mlp.fc.grad",  "bucket.h.0.mlp.proj.grad",
                                      "bucket.h.1.attn.qkv.grad", "bucket.h.1.mlp.fc.grad",
                                      "bucket.h.1.mlp.proj.grad"};
  int copied = 0, waited = 0;
  for (std::size_t t = 0; t < r.graph.tensors.size(); ++t) {
    const auto& x = r.graph.tensors[t];
    if (x.kind != zp::models::TensorKind::grad) continue;
    const Seen b = seen(r, "bucket." + x.name);
    if (b.free_at.empty()) continue;
    CAPTURE(x.name);
    REQUIRE(b.free_at.size() == 1);
    if (held.contains("bucket." + x.name)) {
      CHECK(b.free_at[0] >= lv.last_grad_write[t]);
      CHECK(reductions.contains(b.free_at[0]));
      ++waited;
    } else {
      CHECK(b.free_at[0] == lv.last_grad_write[t]);
      ++copied;
    }
  }
  CHECK(waited == 7);
  // wpe, and per block norm1, attn.proj, norm2; norm_f.
  CHECK(copied == 1 + 3 * L + 1);

  // Each reduction flattens its bucket into a new tensor (allreduce_bucket: self.flatten),
  // freed when it returns: every parameter passes once, 2 x kPsi bytes in all, and no
  // flat copy is larger than max(B, 16384) elements.
  CHECK(total(flat) == 2 * kPsi);
  for (std::size_t i = 0; i < flat.bytes.size(); ++i) {
    CHECK(flat.bytes[i] <= 2 * 16384);
    CHECK(flat.free_at[i] == flat.alloc_at[i]);
  }

  // The gradient partition (grads_in_partition, copy_grads_in_partition) comes with the
  // first reduction, not at init: after init the GPU holds no gradient.
  const Seen part = seen(r, "grads");
  REQUIRE(part.alloc_at.size() == 1);
  CHECK(part.alloc_at[0] == flat.alloc_at.front());
  CHECK(part.bytes[0] == 2 * ((kPsi + 1) / 2));

  // Without contiguous gradients: no ipg buffer, every gradient kept in its own tensor until
  // its bucket is reduced (freed where a reduction runs), the same flat copies.
  s.contiguous_gradients = false;
  r = run(s);
  CHECK(seen(r, "ipg_buffer.0").bytes.empty());
  const Seen flat2 = seen(r, "reduce_flat");
  CHECK(total(flat2) == 2 * kPsi);
  const std::set<int32_t> reductions2(flat2.alloc_at.begin(), flat2.alloc_at.end());
  for (const MemBuffer& b : r.sched.buffers)
    if (b.name.rfind("bucket.", 0) == 0) CHECK(reductions2.contains(seen(r, b.name).free_at.at(0)));
}

TEST_CASE("contiguous_gradients, stage 1 and earlier micro-steps: where the gradients live") {
  Strategy s;
  s.stage = 1;
  s.dp = 2;
  s.buffers.reduce_bucket_size = 10'000;
  // One micro-step: no gradient at init; each in its own tensor until the end of backward,
  // where stage 1 reduces (engine.py allreduce_gradients -> reduce_gradients) into
  // grads_in_partition, ceil(kPsi / 2) bf16 elements, and frees the rest
  // (_clear_param_grad_only).
  Run r = run(s);
  const int32_t end = last_backward(r);
  CHECK(seen(r, "grads").bytes.empty());
  const Seen part = seen(r, "grads_in_partition");
  CHECK(part.bytes == std::vector<uint64_t>{2 * ((kPsi + 1) / 2)});
  CHECK(part.alloc_at == std::vector<int32_t>{end});
  // After an earlier micro-step the accumulated full gradients (2 x kPsi bytes) are there
  // from the start and freed at the end of backward; the ipg buffer, allocated by the first
  // micro-step's first hook, is held through this one's forward (freed at the epilogue).
  s.grad_accum = 2;
  r = run(s);
  const Seen full = seen(r, "grads");
  CHECK(full.bytes == std::vector<uint64_t>{2 * kPsi});
  CHECK(full.alloc_at == std::vector<int32_t>{-1});
  CHECK(full.free_at == std::vector<int32_t>{end});
  CHECK(seen(r, "ipg_buffer.0").alloc_at == std::vector<int32_t>{0});

  // Stage 2 after an earlier micro-step: the accumulated partition from init, and this
  // micro-step's new grads_in_partition until the end of backward, where it is added in.
  s.stage = 2;
  r = run(s);
  CHECK(seen(r, "grads").alloc_at == std::vector<int32_t>{-1});
  const Seen micro = seen(r, "grads_in_partition.micro_step");
  CHECK(micro.bytes == std::vector<uint64_t>{2 * ((kPsi + 1) / 2)});
  CHECK(micro.free_at == std::vector<int32_t>{end});
}

TEST_CASE("contiguous_gradients, stage 3: one ipg buffer from init, reduce-scatter's padded copy") {
  // stage3.py __init__: with contiguous gradients, torch.empty(reduce_bucket_size) in the
  // communication dtype, allocated at init and kept (no second buffer with overlap_comm).
  Strategy s;
  s.stage = 3;
  s.dp = 3;
  s.buffers.reduce_bucket_size = 1;  // every torch tensor its own bucket
  Run r = run(s);
  const Seen ipg = seen(r, "ipg_buffer");
  CHECK(ipg.bytes == std::vector<uint64_t>{2});
  CHECK(ipg.alloc_at == std::vector<int32_t>{-1});
  CHECK(ipg.free_at.empty());
  // reduce_scatter_coalesced (runtime/comm/coalesced_collectives.py) copies a bucket's
  // tensors, each padded to ceil(n/3) x 3 elements, into a new flat buffer, except a single
  // tensor that 3 divides. One tensor per bucket here; the ones 3 does not divide:
  //   wte 16384 -> 16386, wpe 4096 -> 4098;
  //   per block: ln_1 64 + 64 -> 66 + 66, c_attn 12288 and 192 divide, attn.c_proj 4096 + 64
  //   -> 4098 + 66, ln_2 -> 66 + 66, c_fc 16384 + 256 -> 16386 + 258, mlp.c_proj 16384 + 64
  //   -> 16386 + 66: 37524 per block;
  //   ln_f 64 + 64 -> 66 + 66.
  const uint64_t flat_elems = 16386 + 4098 + L * 37524 + 132;
  CHECK(total(seen(r, "reduce_flat")) == 2 * flat_elems);  // bf16: 191328 bytes
  // Without contiguous gradients: no ipg buffer; the same copies.
  s.contiguous_gradients = false;
  r = run(s);
  CHECK(seen(r, "ipg_buffer").bytes.empty());
  CHECK(total(seen(r, "reduce_flat")) == 2 * flat_elems);
  // DeepSpeed before 0.6.0 allocated stage 3's buffers per backward, as stages 1-2 do.
  s.contiguous_gradients = true;
  s.deepspeed_version = 400;
  s.buffers.reduce_bucket_size = 10'000;
  r = run(s);
  CHECK(seen(r, "ipg_buffer").bytes.empty());
  CHECK(seen(r, "ipg_buffer.0").bytes == std::vector<uint64_t>{20'000});
  CHECK(seen(r, "ipg_buffer.1").bytes == std::vector<uint64_t>{20'000});  // overlap_comm, stage 3's default
}

TEST_CASE("contiguous_gradients buckets torch parameters, not the graph's merged tensors") {
  // Llama-2-7B with the Trainer's "auto" bucket, h^2 = 4096^2 = 16777216 elements: q, k and
  // v are 4096 x 4096 each (q_proj, k_proj, v_proj), exactly a bucket, so they are copied and
  // the graph's attn.qkv gradient (their sum) is freed at its hook; gate_proj and up_proj are
  // 11008 x 4096 = 45088768 each, more than a bucket, so mlp.fc waits for a reduction.
  const zp::models::ModelSpec m = load_model("llama-2-7b");
  Strategy s;
  s.stage = 2;
  s.dp = 8;
  s.seq = 128;
  s.buffers.reduce_bucket_size = 4096ull * 4096;
  const PlanOptions o{Profile::deepspeed, Backend::cuda, ModelCode::transformers};
  const auto g = zp::models::build_training_graph(m, graph_options(m, s, o));
  const MemorySchedule sch = build_schedule(g, s, o);
  const zp::models::Liveness lv = zp::models::liveness(g);
  std::map<std::string, int32_t> last_write;
  for (std::size_t t = 0; t < g.tensors.size(); ++t) last_write[g.tensors[t].name] = lv.last_grad_write[t];
  std::map<std::string, int32_t> freed;
  uint64_t ipg = 0;
  for (const MemEvent& e : sch.events) {
    const MemBuffer& b = sch.buffers[e.buffer];
    if (!e.alloc) freed[b.name] = e.pos;
    else if (b.name == "ipg_buffer.0") ipg = b.bytes;
  }
  CHECK(ipg == 2 * 4096ull * 4096);  // 33554432 bytes of bf16
  CHECK(freed.at("bucket.h.5.attn.qkv.grad") == last_write.at("h.5.attn.qkv.grad"));
  CHECK(freed.at("bucket.h.5.mlp.fc.grad") > last_write.at("h.5.mlp.fc.grad"));
}

TEST_CASE("contiguous_gradients is read from the DeepSpeed config and round-trips") {
  const nlohmann::json ds = {{"zero_optimization", {{"stage", 2}, {"contiguous_gradients", false}}}};
  Strategy s = apply_deepspeed_config(Strategy{}, ds, "ds.json");
  CHECK(s.contiguous_gradients == false);
  CHECK(strategy_from_json(to_json(s), "plan").contiguous_gradients == false);
  CHECK(describe(s).find("no contiguous gradients") != std::string::npos);
  std::vector<std::string> assumed;
  s = apply_deepspeed_config(
      Strategy{}, nlohmann::json{{"zero_optimization", {{"stage", 2}, {"contiguous_gradients", "auto"}}}},
      "ds.json", &assumed);
  CHECK(s.contiguous_gradients == true);
  REQUIRE(assumed.size() == 1);
  CHECK(assumed[0].rfind("zero_optimization.contiguous_gradients", 0) == 0);
  CHECK_THROWS_AS(apply_deepspeed_config(Strategy{},
                                         nlohmann::json{{"zero_optimization", {{"contiguous_gradients", 3}}}},
                                         "ds.json"),
                  zp::Error);
}

TEST_CASE("offload_optimizer.ratio: the first int((1 - ratio) x n) sub-groups stepped on the GPU") {
  // stage3.py _create_fp32_partitions: with the optimizer offloaded, sub-group i goes to the
  // GPU when i < int((1 - ratio) * n) of n; there its master is converted on the GPU, its
  // fp32 gradient buffer moved there (initialize_optimizer_states) and a torch AdamW
  // (backup_optimizer) keeps its moments; the others stay with the CPU Adam.
  // sub_group_size 1 closes a sub-group at every torch tensor (_create_fp16_sub_groups), so
  // over 2 ranks gpt2-tiny has 28 sub-groups of ceil(n/2) elements, in module order:
  // wte 8192, wpe 2048; per block ln_1 32 + 32, c_attn 6144 + 96, attn.c_proj 2048 + 32, ln_2
  // 32 + 32, c_fc 8192 + 128, mlp.c_proj 8192 + 32 (24992); ln_f 32 + 32.
  const uint64_t part = kPsi / 2;  // every tensor has an even size: 60288
  auto on_tier = [](const Run& r, const std::string& name, Tier t) {
    uint64_t n = 0;
    for (const MemBuffer& b : r.sched.buffers)
      if (b.name == name && b.tier == t) n += b.bytes;
    return n;
  };
  Strategy s;
  s.stage = 3;
  s.dp = 2;
  s.offload_optimizer = Offload::cpu;
  s.buffers.sub_group_size = 1;
  struct Case {
    double ratio;
    uint64_t gpu_elems, largest;
  };
  // 0.5: int(0.5 * 28) = 14, wte, wpe and block 0: 8192 + 2048 + 24992.
  // 0.07: int(0.93 * 28) = int(26.04) = 26: all but ln_f, 10240 + 2 x 24992.
  // 0.9: (1 - 0.9) * 28 is 2.7999999999999994 in doubles, so int() gives 2: wte and wpe.
  // (The cuts fall between blocks: within one the planner takes the inventory's order,
  // ln_1 and ln_2 first, where GPT2Block registers ln_1, attn, ln_2, mlp.)
  for (const Case c : {Case{0.5, 35232, 8192}, Case{0.07, 60224, 8192}, Case{0.9, 10240, 8192},
                       Case{1.0, 0, 0}}) {
    CAPTURE(c.ratio);
    s.offload_optimizer_ratio = c.ratio;
    const Run r = run(s);
    CHECK(on_tier(r, "master", Tier::gpu) == 4 * c.gpu_elems);
    CHECK(on_tier(r, "exp_avg", Tier::gpu) == 4 * c.gpu_elems);
    CHECK(on_tier(r, "exp_avg_sq", Tier::gpu) == 4 * c.gpu_elems);
    CHECK(on_tier(r, "grads", Tier::gpu) == 4 * c.gpu_elems);  // fp32; the 16-bit ones are on the host
    CHECK(on_tier(r, "master", Tier::cpu) == 4 * (part - c.gpu_elems));
    CHECK(on_tier(r, "exp_avg", Tier::cpu) + on_tier(r, "exp_avg_sq", Tier::cpu) ==
          8 * (part - c.gpu_elems));
    CHECK(on_tier(r, "grads", Tier::cpu) == 4 * (part - c.gpu_elems));
    // The GPU AdamW steps one sub-group at a time with PyTorch's foreach implementation:
    // torch._foreach_sqrt(exp_avg_sq) is a temporary of the sub-group in fp32.
    CHECK(on_tier(r, "foreach_sqrt.gpu_sub_group", Tier::gpu) == 4 * c.largest);
    CHECK(on_tier(r, "init.master_convert", Tier::gpu) == 4 * c.largest);
  }
  // Read at stage 3 with the optimizer on the CPU only; the CPU Adam's GPU partner is AdamW.
  s.offload_optimizer_ratio = 0.5;
  Strategy bad = s;
  bad.stage = 2;
  CHECK_THROWS_AS(validate(bad), zp::Error);
  bad = s;
  bad.offload_optimizer = Offload::nvme;
  CHECK_THROWS_AS(validate(bad), zp::Error);
  bad = s;
  bad.optimizer = OptimizerKind::sgd;
  CHECK_THROWS_AS(validate(bad), zp::Error);
  bad = s;
  bad.offload_optimizer_ratio = 1.5;
  CHECK_THROWS_AS(validate(bad), zp::Error);
  s.seq = 64;
  CHECK_THROWS_AS(estimate(load_model("gpt2-tiny"), s, nullptr, PlanOptions{}), zp::Error);
  // The config: zero_optimization.offload_optimizer.ratio, read at stage 3; elsewhere said.
  const nlohmann::json ds = {
      {"zero_optimization",
       {{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.3}}}}}};
  CHECK(apply_deepspeed_config(Strategy{}, ds, "ds.json").offload_optimizer_ratio == 0.3);
  nlohmann::json ds2 = ds;
  ds2["zero_optimization"]["stage"] = 2;
  std::vector<std::string> assumed;
  CHECK(apply_deepspeed_config(Strategy{}, ds2, "ds.json", &assumed).offload_optimizer_ratio == 1.0);
  REQUIRE(assumed.size() == 1);
  CHECK(assumed[0].find("offload_optimizer.ratio") != std::string::npos);
  CHECK(strategy_from_json(to_json(apply_deepspeed_config(Strategy{}, ds, "ds.json")), "plan")
            .offload_optimizer_ratio == 0.3);
}

TEST_CASE("a model built whole before deepspeed.initialize: the init transient in the peaks") {
  // Llama-2-7B: P = 6,738,415,616 parameters (its published count), bf16, stage 2 over 64
  // GPUs, short sequences: the step needs less than the initialization.
  const zp::models::ModelSpec m = load_model("llama-2-7b");
  const uint64_t psi = 6'738'415'616;
  REQUIRE(static_cast<uint64_t>(zp::models::count_params(m).total) == psi);
  const PlanOptions o{Profile::deepspeed, Backend::cuda, ModelCode::transformers};
  Strategy s;
  s.stage = 2;
  s.dp = 64;
  s.seq = 128;
  // The Trainer leaves the model on the host; deepspeed.initialize casts it there and moves
  // it to the GPU whole, 2 x P bytes (engine.py _configure_distributed_model), and the stage
  // 1-2 optimizer flattens it into a new buffer while the tensors are alive, another 2 x P
  // (stage_1_and_2.py, bit16_groups_flat), before they point into it: 4 x P bytes in use
  // at once, every tensor a multiple of 512 bytes (the caching allocator's rounding).
  Estimate e = estimate(m, s, nullptr, o);
  CHECK(e.memory.init_peak[0] == 4 * psi);  // 26,953,662,464 bytes
  // More than the step: the peak is there, before the first op.
  CHECK(e.memory.peak_allocated[0] == 4 * psi);
  CHECK(e.memory.peak_pos == -1);
  // After it only the flat copy is left of the model (the states as before).
  CHECK(e.memory.after_init[0] < 4 * psi);
  // DeepSpeed flattens on the GPU only when its free memory holds the copy
  // (flatten_on_accelerator: available_memory() >= flat_buffer_bytes); on a 24 GiB card
  // (25,769,803,776 bytes) 4 x P does not fit, so the tensors go to the host first and the
  // GPU sees one copy, 2 x P, with the states after it: the initialization holds no more
  // than what stays after it, and the flatten never runs a GPU out of memory.
  const Hardware small = load_hardware(std::string(ZP_TEST_DATA) + "/published/rtx3090-x8.json");
  e = estimate(m, s, &small, o);
  CHECK(e.memory.init_peak[0] == e.memory.after_init[0]);
  CHECK(e.memory.peak_allocated[0] < 4 * psi);
  CHECK(e.fits == true);

  // A script that loaded the model on the GPU in fp32 (4 x P bytes): DeepSpeed casts it
  // there one tensor at a time (_cast_module_mixed_precision), so the first cast, of
  // embed_tokens (32000 x 4096 = 131,072,000 elements, the inventory's first tensor), adds
  // its bf16 copy beside the whole fp32 model: 4 x P + 2 x 131,072,000 bytes; then the
  // flatten's 4 x P.
  s.load_on_gpu = Precision::fp32;
  e = estimate(m, s, nullptr, o);
  CHECK(e.memory.init_peak[0] == 4 * psi + 2 * 131'072'000);  // 27,215,806,464 bytes
  s.load_on_gpu.reset();

  // Stage 3 builds it partitioned under zero.Init by default (as from_pretrained under a
  // stage-3 config): no whole model at init. Without zero.Init it arrives whole, 2 x P, and
  // is partitioned tensor by tensor (partition_parameters.py Init(module=...)).
  s.stage = 3;
  e = estimate(m, s, nullptr, o);
  CHECK(e.memory.init_peak[0] < 2 * psi);
  s.zero_init = false;
  e = estimate(m, s, nullptr, o);
  CHECK(e.memory.init_peak[0] == 2 * psi);
  CHECK(describe(e.strategy).find("no zero.Init") != std::string::npos);

  // Stage 0 keeps the model's tensors as its parameters: cast on the GPU, the bf16 tensors
  // are the 2 x P bytes of parameters after init, as when they arrive from the host.
  s = Strategy{};
  s.seq = 128;
  e = estimate(m, s, nullptr, o);
  CHECK(e.memory.init_peak[0] == e.memory.after_init[0]);
  s.load_on_gpu = Precision::fp32;
  const Estimate cast = estimate(m, s, nullptr, o);
  CHECK(cast.memory.after_init[0] == e.memory.after_init[0]);
  CHECK(cast.per_device[Tier::gpu][Category::params] == 2 * psi);

  // zero.Init is stage 3's; 16-bit weights are not cast to fp32 by DeepSpeed.
  Strategy bad;
  bad.stage = 2;
  bad.zero_init = true;
  CHECK_THROWS_AS(validate(bad), zp::Error);
  bad = Strategy{};
  bad.precision = Precision::fp32;
  bad.load_on_gpu = Precision::bf16;
  CHECK_THROWS_AS(validate(bad), zp::Error);
  Strategy rt;
  rt.stage = 3;
  rt.zero_init = false;
  rt.load_on_gpu = Precision::fp16;
  const Strategy back = strategy_from_json(to_json(rt), "plan");
  CHECK(back.zero_init == std::optional<bool>(false));
  CHECK(back.load_on_gpu == std::optional<Precision>(Precision::fp16));
  CHECK(!strategy_from_json(to_json(Strategy{}), "plan").zero_init.has_value());
}

TEST_CASE("ZeRO++ qwZ: the int8 all-gather's buffers, and qgZ refused with the reason") {
  // gpt2-tiny at stage 3 over 2 ranks in bf16, every tensor gathered (persistence threshold
  // 0) and no prefetch: each block's all-gather (partition_parameters.py
  // _all_gather_coalesced with quantize=True) of a shard of s = ceil(49984 / 2) = 24992
  // elements of the gathered 49984 (kBlock = 12C^2 + 13C):
  //   the shard concatenated, s x 2 = 49984 bytes, and converted to fp16 (the kernel reads
  //   __half), another 49984;
  //   quantized to int8, s = 24992 bytes, with CUDAQuantizer's groups: from ceil(s / 8000) = 4
  //   up to the first g with 8g dividing s: 24992 = 8 x 3124 and 4 divides 3124, so 4; not
  //   doubled (64 does not divide 24992): 4 fp32 scales, 16 bytes; 25008 in all;
  //   received: 2 x 24992 int8 and 2 x 4 scales: 49984 + 32 = 50016 bytes;
  //   dequantized into fp16 at the wait: 49984 x 2 = 99968 bytes.
  Strategy s;
  s.stage = 3;
  s.dp = 2;
  s.buffers.param_persistence_threshold = 0;
  s.buffers.prefetch_bucket_size = 1;
  s.quantized_weights = true;
  const Run r = run(s);
  const Seen shard = seen(r, "qwz.shard.h.0"), fp16 = seen(r, "qwz.fp16.h.0"),
             in = seen(r, "qwz.int8_shard.h.0"), out = seen(r, "qwz.int8_gathered.h.0"),
             deq = seen(r, "qwz.dequantized.h.0");
  // Gathered twice, for forward and for backward.
  CHECK(shard.bytes == std::vector<uint64_t>{49984, 49984});
  CHECK(fp16.bytes == std::vector<uint64_t>{49984, 49984});
  CHECK(in.bytes == std::vector<uint64_t>{25008, 25008});
  CHECK(out.bytes == std::vector<uint64_t>{50016, 50016});
  CHECK(deq.bytes == std::vector<uint64_t>{99968, 99968});
  // Without prefetch each gather is waited for by the op that issued it: all of it goes
  // with that op.
  CHECK(deq.alloc_at == deq.free_at);
  CHECK(out.alloc_at == out.free_at);
  // The embedding group: s = 20480 / 2 = 10240, ceil(10240 / 8000) = 2 groups (8 x 2 divides
  // 10240; 10240 / 2 = 5120 is not above 8000, so not doubled): 10240 + 8 bytes sent.
  CHECK(seen(r, "qwz.int8_shard.embed").bytes.at(0) == 10248);
  // Without qwZ none of it.
  s.quantized_weights = false;
  CHECK(seen(run(s), "qwz.int8_gathered.h.0").bytes.empty());
  // Read from the config; stage 3 and DeepSpeed only.
  const nlohmann::json ds = {{"zero_optimization", {{"stage", 3}, {"zero_quantized_weights", true}}}};
  CHECK(apply_deepspeed_config(Strategy{}, ds, "ds.json").quantized_weights);
  Strategy bad;
  bad.stage = 2;
  bad.quantized_weights = true;
  CHECK_THROWS_AS(validate(bad), zp::Error);
  // qgZ stays refused, naming the field and why (the all-to-all runs across nodes only).
  try {
    apply_deepspeed_config(Strategy{},
                           nlohmann::json{{"zero_optimization", {{"stage", 3}, {"zero_quantized_gradients", true}}}},
                           "ds.json");
    FAIL("qgZ accepted");
  } catch (const zp::Error& e) {
    CHECK(std::string(e.what()).find("zero_quantized_gradients") != std::string::npos);
    CHECK(e.hint().find("nodes") != std::string::npos);
  }
  CHECK_NOTHROW(apply_deepspeed_config(
      Strategy{}, nlohmann::json{{"zero_optimization", {{"stage", 3}, {"zero_quantized_gradients", false}}}},
      "ds.json"));
}
