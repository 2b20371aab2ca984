// Placement (min cut), the step-time simulator, the fit search and DeepSpeed's estimators,
// against independent sources: the ZeRO-Offload paper's placement and headline results
// (seed 002), the ring formulas worked by hand, DeepSpeed's estimator formulas evaluated by
// hand, and estimate() for the search's cached memory.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "error_of.hpp"
#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/fit.hpp"
#include "zp/planner/placement.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/simulate.hpp"

using namespace zp::planner;

namespace {

using zp::test::error_of;

// A GPT-2 shaped family (GPT-2's vocabulary and 1024 positions) of width C: the models of the
// ZeRO-Offload paper's experiments (GPT-2 like, sec. 6.1).
zp::models::ModelSpec gpt(int64_t L, int64_t C, int64_t NH) {
  auto m = zp::models::load_model("gpt2");
  m.name = "gpt-family";
  m.n_layer = L;
  m.n_embd = C;
  m.n_head = NH;
  m.n_kv_head = NH;
  m.head_dim = C / NH;
  m.n_inner = 4 * C;
  return m;
}

// The V100 preset with fp16 (V100 has no bf16) and the search narrowed to one strategy family.
FitRequest v100_request(zp::models::ModelSpec m, int64_t gpus, bool offload) {
  FitRequest r;
  r.model = std::move(m);
  r.hw = load_hardware("v100-32g");
  r.gpus = gpus;
  r.base.precision = Precision::fp16;
  r.mps = {1};
  if (offload) {  // ZeRO-Offload: ZeRO-2 with the optimizer on the CPU (paper sec. 4)
    r.stages = {2};
    r.offload_optimizer = {Offload::cpu};
  } else {  // plain data parallel PyTorch: everything on the GPU
    r.stages = {0};
    r.offload_optimizer = {Offload::none};
  }
  r.offload_param = {Offload::none};
  return r;
}

Hardware unit_hardware() {
  Hardware hw = load_hardware("v100-32g");
  hw.gpus_per_node = 8;
  hw.gpu_tflops = 1;     // 1e12 FLOP/s
  hw.hbm_gbps = 1;       // 1e9 B/s
  hw.nvlink_gbps = 1;
  hw.internode_gbps = 1;
  hw.h2d_gbps = 1;
  hw.d2h_gbps = 1;
  hw.cpu_adam_gparams = 0.0005;  // 5e5 parameters per second
  return hw;
}

// Three groups (embed, one block, head): forward 1, 2, 1 s and backward 2, 4, 2 s at 1e12.
StepCosts unit_costs() {
  StepCosts c;
  c.fwd_flops = {1e12, 2e12, 1e12};
  c.bwd_flops = {2e12, 4e12, 2e12};
  c.fwd_bytes = {0, 0, 0};
  c.bwd_bytes = {0, 0, 0};
  c.group_params = {1'000'000, 2'000'000, 1'000'000};
  c.n_params = 4'000'000;
  c.flops_executed = 12e12;
  c.flops_model = 12e12;
  c.tokens = 1024;
  c.n_layer = 1;
  return c;
}

}  // namespace

TEST_CASE("placement: the min cut gives ZeRO-Offload's placement and 4M bytes per step") {
  // Paper sec. 3 and 4.1: 16M bytes of model states do not fit on the GPU but 2M do.
  PlacementInput in;
  in.gpu_bytes_per_param = 6.0;
  const Placement p = place(in);
  CHECK(p.of(State::p16) == Tier::gpu);
  CHECK(p.of(State::g16) == Tier::cpu);
  CHECK(p.of(State::p32) == Tier::cpu);
  CHECK(p.of(State::m32) == Tier::cpu);
  CHECK(p.of(State::v32) == Tier::cpu);
  CHECK(p.update == Tier::cpu);
  CHECK(p.float2half == Tier::cpu);
  CHECK(p.down_bytes_per_param == doctest::Approx(2.0));  // fp16 gradients, 2M
  CHECK(p.up_bytes_per_param == doctest::Approx(2.0));    // fp16 parameters, 2M
  CHECK(p.pcie_bytes(13'000'000'000) == 4 * 13'000'000'000ULL);
  CHECK(p.gpu_state_bytes_per_param == doctest::Approx(2.0));
  CHECK(p.fits);

  SUBCASE("everything fits: nothing moves") {
    in.gpu_bytes_per_param = 16.0;
    const Placement q = place(in);
    for (State s : kStates) CHECK(q.of(s) == Tier::gpu);
    CHECK(q.pcie_bytes(1'000'000) == 0);
  }
  SUBCASE("not even the fp16 parameters fit: they are streamed (ZeRO-Infinity)") {
    in.gpu_bytes_per_param = 1.0;
    const Placement q = place(in);
    CHECK(q.of(State::p16) == Tier::cpu);
    // Forward and backward each read them (2 x 2), gradients go down (2).
    CHECK(q.up_bytes_per_param == doctest::Approx(4.0));
    CHECK(q.down_bytes_per_param == doctest::Approx(2.0));
  }
  SUBCASE("the host holds only 6 bytes per parameter: optimizer states go to NVMe") {
    in.cpu_bytes_per_param = 6.0;
    const Placement q = place(in);
    CHECK(q.of(State::m32) == Tier::nvme);
    CHECK(q.of(State::v32) == Tier::nvme);
    CHECK(q.cpu_state_bytes_per_param <= 6.0);
    // Adam reads and writes each moment: 4 + 4 bytes each way per parameter.
    CHECK(q.nvme_read_bytes_per_param >= 8.0);
    CHECK(q.nvme_write_bytes_per_param >= 8.0);
  }
  SUBCASE("no GPU or CPU room: everything on NVMe, unless NVMe is short too") {
    in.gpu_bytes_per_param = 0.0;
    in.cpu_bytes_per_param = 0.0;
    const Placement q = place(in);
    for (State s : kStates) CHECK(q.of(s) == Tier::nvme);
    CHECK(q.fits);
    in.nvme_bytes_per_param = 10.0;
    CHECK_FALSE(place(in).fits);
  }
}

TEST_CASE("simulate: ring collectives and a step worked by hand") {
  // Ring: all-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n of the bytes.
  CHECK(allreduce_seconds(8e9, 4, 100) == doctest::Approx(8e9 * 1.5 / 100e9));
  CHECK(reduce_scatter_seconds(8e9, 4, 100) == doctest::Approx(8e9 * 0.75 / 100e9));
  CHECK(allgather_seconds(8e9, 1, 100) == 0.0);

  const Hardware hw = unit_hardware();
  const StepCosts c = unit_costs();
  Strategy s;
  s.precision = Precision::fp16;
  s.dp = 2;
  SUBCASE("stage 0: forward 4 s + backward 8 s + one all-reduce + Adam on the GPU") {
    const Timeline t = simulate(c, s, hw, Cluster{2, 1});
    // all-reduce of 4e6 x 2 bytes: 8e6 x 2(1)/2 / 1e9 = 0.008 s; Adam: 4e6 x 28 B / 1e9.
    CHECK(t.step_seconds == doctest::Approx(12.0 + 0.008 + 0.112));
    CHECK(t.tflops_per_gpu == doctest::Approx(12.0 / 12.12));
    CHECK_FALSE(t.critical_path.empty());
  }
  SUBCASE("stage 0 with Pa+cpu: the block's checkpoint goes to the host and back, blocking") {
    // One block, its checkpoint boundary_bytes = 2e8 bytes at 1 GB/s each way: 0.2 s after
    // its forward and 0.2 s before its backward, on top of the stage-0 step.
    StepCosts ck = c;
    ck.boundary_bytes = 200'000'000;
    s.checkpointing = Checkpointing::full;
    s.partition_activations = true;
    s.cpu_checkpointing = true;
    const Timeline t = simulate(ck, s, hw, Cluster{2, 1});
    int d2h = 0, h2d = 0;
    for (const Task& k : t.tasks) {
      if (std::string(k.kind) == "checkpoint d2h") ++d2h;
      if (std::string(k.kind) == "checkpoint h2d") ++h2d;
    }
    CHECK(d2h == h2d);
    CHECK(d2h > 0);
    CHECK(t.step_seconds == doctest::Approx(12.0 + 0.008 + 0.112 + 0.4));
  }
  SUBCASE("stage 2, small buckets, overlap_comm: reductions overlap backward; the last one does not") {
    s.stage = 2;
    s.overlap_comm = true;
    s.buffers.reduce_bucket_size = 1'000'000;
    const Timeline t = simulate(c, s, hw, Cluster{2, 1});
    // last bucket (embed, 1e6 x 2 B x 1/2) 0.001 s; Adam on the 2e6 partition 0.056 s;
    // all-gather of the updated 4e6 x 2 B x 1/2: 0.004 s.
    CHECK(t.step_seconds == doctest::Approx(12.0 + 0.001 + 0.056 + 0.004));
  }
  SUBCASE("stage 2, small buckets, without overlap_comm (its default): compute waits for each") {
    s.stage = 2;
    s.buffers.reduce_bucket_size = 1'000'000;
    const Timeline t = simulate(c, s, hw, Cluster{2, 1});
    // Every bucket's reduction in turn with backward: head 1e6 and block 2e6 elements (0.001 s
    // and 0.002 s) before the next compute, then embed's 0.001 s, Adam and all-gather as above.
    CHECK(t.step_seconds == doctest::Approx(12.0 + 0.001 + 0.002 + 0.001 + 0.056 + 0.004));
  }
  SUBCASE("stage 3: gathers prefetched with overlap_comm (its default), in turn without") {
    s.stage = 3;
    // All-gathers of 1e6, 2e6, 1e6 16-bit parameters on 2 ranks: 0.001, 0.002, 0.001 s;
    // one reduce-scatter of all 4e6 after backward 0.004 s; Adam on the 2e6 partition 0.056 s.
    // The first gather of a step waits for the previous step's Adam.
    // Prefetched (depth 25 groups): only the first forward gather is exposed (0.001 s); the
    // backward ones start with the last forward compute and are done before they are needed
    // (head's 0.001 s waits: the block's and embed's are hidden behind head's compute).
    const Timeline on = simulate(c, s, hw, Cluster{2, 1});
    CHECK(on.step_seconds == doctest::Approx(0.001 + 4.0 + 0.001 + 8.0 + 0.004 + 0.056));
    // Without overlap every gather is waited for: 2 x (0.001 + 0.002 + 0.001) s exposed.
    s.overlap_comm = false;
    const Timeline off = simulate(c, s, hw, Cluster{2, 1});
    CHECK(off.step_seconds == doctest::Approx(0.008 + 12.0 + 0.004 + 0.056));
  }
  SUBCASE("ZeRO-Offload on one GPU: CPU Adam after backward, or hidden by DPU") {
    s.dp = 1;
    s.stage = 2;
    s.offload_optimizer = Offload::cpu;
    const Timeline t = simulate(c, s, hw, Cluster{1, 1});
    // d2h 4e6 x 2 B = 0.008 s, CPU Adam 4e6 / 5e5 = 8 s, copy back in one chunk 0.008 s.
    CHECK(t.step_seconds == doctest::Approx(12.0 + 0.008 + 8.0 + 0.008));
    s.dpu = true;
    const Timeline d = simulate(c, s, hw, Cluster{1, 1});
    // The update of step k overlaps step k+1's compute: the GPU's 12 s bound the step.
    CHECK(d.step_seconds == doctest::Approx(12.0).epsilon(0.002));
    CHECK(d.busy_seconds[static_cast<std::size_t>(Resource::cpu)] == doctest::Approx(8.0));
  }
  SUBCASE("parameters on NVMe: shard reads issued ahead through the swap buffers overlap compute") {
    // Stage 3 on one GPU, the optimizer on the host (4 ms), gathers one group ahead of compute
    // (prefetch bucket of 1 element). Four groups: a long first forward (20 s) then groups
    // with large shards. NVMe at 1e6 B/s reads the 2e6-byte shards in 2 s and the 8e6-byte
    // ones in 8 s. Reading on demand (depth 0), the last group's read waits for its
    // predecessor's staging, which waits for the 20 s forward: the drive idles meanwhile.
    // Read ahead, it follows the previous read at once.
    StepCosts c4 = c;
    c4.group_params = {1'000'000, 1'000'000, 4'000'000, 4'000'000};
    c4.fwd_flops = {20e12, 1e12, 1e12, 1e12};
    c4.bwd_flops = {2e12, 2e12, 2e12, 2e12};
    c4.fwd_bytes = c4.bwd_bytes = {0, 0, 0, 0};
    c4.n_params = 10'000'000;
    c4.n_layer = 2;
    s.dp = 1;
    s.stage = 3;
    s.offload_optimizer = Offload::cpu;
    s.offload_param = Offload::nvme;
    s.buffers.prefetch_bucket_size = 1;
    Hardware h = hw;
    h.nvme_read_gbps = 1e6 / 1e9;
    h.cpu_adam_gparams = 2.5;
    auto run = [&](uint64_t depth, uint64_t count, uint64_t size) {
      Strategy x = s;
      x.buffers.param_swap_prefetch_depth = depth;
      x.buffers.param_swap_buffer_count = count;
      x.buffers.param_swap_buffer_size = size;
      return simulate(c4, x, h, Cluster{1, 1});
    };
    const Timeline on_demand = run(0, 5, 100'000'000);
    const Timeline ahead = run(4, 5, 100'000'000);
    // One buffer of 1000 elements (thousands of pieces a shard) cannot hold a shard ahead:
    // the schedule of reading on demand.
    const Timeline small = run(4, 1, 1000);
    CHECK(ahead.step_seconds < on_demand.step_seconds - 5.0);
    CHECK(small.step_seconds == doctest::Approx(on_demand.step_seconds));
    // Each gather reads its shard once: 4 groups forward and backward, in both steps simulated.
    int reads = 0;
    for (const Task& t : ahead.tasks) reads += std::string_view(t.kind) == "nvme read params";
    CHECK(reads == 2 * 4 * 2);
    // Read ahead, the step still holds the reads of 20e6 B per pass at 1e6 B/s: >= 40 s.
    CHECK(ahead.step_seconds >= 40.0);
  }
  SUBCASE("the trace opens as Chrome trace events") {
    const nlohmann::json j = trace_json(simulate(c, s, hw, Cluster{2, 1}));
    REQUIRE(j.contains("traceEvents"));
    int complete = 0;
    for (const auto& e : j["traceEvents"])
      if (e["ph"] == "X") {
        ++complete;
        CHECK(e["dur"].get<double>() >= 0);
      }
    CHECK(complete > 6);
  }
}

TEST_CASE("fit: cached memory equals estimate() exactly under the fsdp profile") {
  // Each setting that sizes FSDP's states or buffers, one at a time and together: the cache
  // must tell them apart.
  const auto m = zp::models::load_model("gpt2");
  PlanOptions o;
  o.profile = Profile::fsdp;
  FitEvaluator ev(m, o);
  for (int64_t dp : {1, 3, 8})
    for (bool reshard : {true, false})
      for (bool fused : {false, true})
        for (Precision reduce : {Precision::fp32, Precision::bf16})
          for (bool pure : {false, true}) {
            Strategy s;
            s.stage = 3;
            s.dp = dp;
            s.micro_batch = 2;
            s.reshard_after_forward = reshard;
            s.fused_optimizer = fused;
            s.reduce_precision = reduce;
            if (pure) s.master_precision = s.optimizer_precision = Precision::bf16;
            s = resolve_for_model(s, m);
            CAPTURE(dp);
            CAPTURE(reshard);
            CAPTURE(fused);
            CAPTURE(pure);
            CAPTURE(static_cast<int>(reduce));
            CHECK(ev.memory(s) == estimate(m, s, nullptr, o).per_device);
          }
}

TEST_CASE("fit: cached memory tells apart FSDP's version, alignment, hybrid sharding and offload") {
  const auto m = zp::models::load_model("gpt2");
  PlanOptions o;
  o.profile = Profile::fsdp;
  FitEvaluator ev(m, o);
  for (int version : {1, 2})
    for (bool orig : {false, true})
      for (int64_t shard : {0, 2})
        for (Offload off : {Offload::none, Offload::cpu})
          for (Precision reduce : {Precision::fp32, Precision::bf16}) {
            if (version == 2 && orig) continue;
            Strategy s;
            s.stage = 3;
            s.dp = 8;
            s.micro_batch = 2;
            s.fsdp_version = version;
            s.fsdp_use_orig_params = orig;
            s.fsdp_shard_size = shard;
            s.offload_param = off;
            s.reduce_precision = reduce;
            s = resolve_for_model(s, m);
            CAPTURE(version);
            CAPTURE(orig);
            CAPTURE(shard);
            CAPTURE(static_cast<int>(off));
            CAPTURE(static_cast<int>(reduce));
            CHECK(ev.memory(s) == estimate(m, s, nullptr, o).per_device);
          }
}

TEST_CASE("fit: cached memory equals estimate() exactly under the pytorch profile") {
  const auto m = zp::models::load_model("gpt2");
  PlanOptions o;
  o.profile = Profile::pytorch;
  FitEvaluator ev(m, o);
  for (int64_t dp : {1, 3})
    for (bool fused : {false, true})
      for (bool pure : {false, true}) {
        Strategy s;
        s.dp = dp;
        s.micro_batch = 2;
        s.fused_optimizer = fused;
        if (pure) s.master_precision = s.optimizer_precision = Precision::bf16;
        else s.precision = Precision::fp32;
        s = resolve_for_model(s, m);
        CAPTURE(dp);
        CAPTURE(fused);
        CAPTURE(pure);
        CHECK(ev.memory(s) == estimate(m, s, nullptr, o).per_device);
      }
}

TEST_CASE("fit: cached memory equals estimate() exactly") {
  const auto m = zp::models::load_model("gpt2");
  const auto medium = zp::models::load_model("gpt2-medium");
  for (Profile prof : {Profile::zeroplan, Profile::deepspeed}) {
    PlanOptions o;
    o.profile = prof;
    FitEvaluator ev(m, o);
    for (int stage : {0, 1, 2, 3})
      for (Offload oo : {Offload::none, Offload::cpu, Offload::nvme})
        for (int64_t dp : {1, 3, 8})
          for (Checkpointing ck : {Checkpointing::none, Checkpointing::full,
                                   Checkpointing::selective_op}) {
            if (oo != Offload::none && stage == 0) continue;
            Strategy s;
            s.stage = stage;
            s.offload_optimizer = oo;
            s.dp = dp;
            s.micro_batch = 2;
            s.checkpointing = ck;
            s = resolve_for_model(s, m);
            CAPTURE(describe(s));
            CHECK(ev.memory(s) == estimate(m, s, nullptr, o).per_device);
            // The same strategy with the delayed update, in fp32, and (stage 3) with the
            // parameters on the host: each changes what the cache keys must tell apart.
            if (oo == Offload::none) continue;
            Strategy d = s;
            d.dpu = true;
            CAPTURE(describe(d));
            CAPTURE(static_cast<int>(prof));
            CHECK(ev.memory(d) == estimate(m, d, nullptr, o).per_device);
            if (oo == Offload::nvme) {
              // The delayed update holds the optimizer's swap buffers with the states: their
              // count changes the states the cache must tell apart.
              Strategy b = d;
              b.buffers.optimizer_swap_buffer_count = 2;
              CAPTURE(describe(b));
              CHECK(ev.memory(b) == estimate(m, b, nullptr, o).per_device);
            }
            if (oo == Offload::nvme) {
              // Smaller swap chunks: smaller swap buffers and offload tiles.
              Strategy c = s;
              c.buffers.optimizer_swap_chunk_size = 16384;
              CAPTURE(describe(c));
              CHECK(ev.memory(c) == estimate(m, c, nullptr, o).per_device);
            }
            Strategy f = s;
            f.precision = Precision::fp32;
            f = resolve_for_model(f, m);
            CAPTURE(describe(f));
            CHECK(ev.memory(f) == estimate(m, f, nullptr, o).per_device);
            if (stage == 3) {
              Strategy p = s;
              p.offload_param = Offload::cpu;
              CAPTURE(describe(p));
              CHECK(ev.memory(p) == estimate(m, p, nullptr, o).per_device);
              // On NVMe: the host swap buffers change with their count and size, the dynamic
              // replay must not keep them.
              for (uint64_t count : {uint64_t{5}, uint64_t{2}}) {
                Strategy n = s;
                n.offload_param = Offload::nvme;
                n.buffers.param_swap_buffer_count = count;
                n.buffers.param_swap_buffer_size = count == 5 ? 100'000'000 : 1'000'000;
                CAPTURE(describe(n));
                CAPTURE(count);
                CHECK(ev.memory(n) == estimate(m, n, nullptr, o).per_device);
              }
            }
          }
    // overlap_comm both ways: gpt2-medium with checkpointing and the optimizer on the host,
    // whose gpu peak falls late in backward, where overlap_comm's second bucket is alive
    // (gpt2's peak is its logits, before any bucket is reduced: it tells the two apart nowhere).
    FitEvaluator med(medium, o);
    for (int stage : {2, 3})
      for (int64_t dp : {1, 8}) {
        Strategy s;
        s.stage = stage;
        s.dp = dp;
        s.checkpointing = Checkpointing::full;
        s.offload_optimizer = Offload::cpu;
        s.buffers.reduce_bucket_size = 50'000'000;
        s = resolve_for_model(s, medium);
        PerDevice got[2];
        for (bool overlap : {false, true}) {
          Strategy v = s;
          v.overlap_comm = overlap;
          CAPTURE(describe(v));
          CAPTURE(static_cast<int>(prof));
          got[overlap] = med.memory(v);
          CHECK(got[overlap] == estimate(medium, v, nullptr, o).per_device);
        }
        // The second bucket, in our engine's plan: only with more than one rank to reduce to.
        if (prof == Profile::zeroplan && dp > 1) CHECK(got[1].peak(Tier::gpu) > got[0].peak(Tier::gpu));
        // With one rank our engine holds no second bucket; DeepSpeed's stage 2 allocates its
        // second ipg buffer all the same (stage_1_and_2.py setup_buckets), stage 3 none.
        if (dp == 1 && (prof == Profile::zeroplan || stage == 3)) CHECK(got[1] == got[0]);
        if (dp == 1 && prof == Profile::deepspeed && stage == 2)
          CHECK(got[1][Tier::gpu][Category::buffers] > got[0][Tier::gpu][Category::buffers]);
      }
  }
}

// Where the settings below come from. The claims are the abstract of Ren et al. 2021,
// "ZeRO-Offload: Democratizing Billion-Scale Model Training" (arXiv 2101.06840,
// https://huggingface.co/papers/2101.06840), and seed 002: "over 13 billion parameters on a
// single GPU", "30TF using PyTorch alone for a 1.4B parameter model, the largest that can be
// trained without running out of memory", "near linear speedup on up to 128 GPUs", "over 70
// billion parameters on a single DGX-2 box" with model parallelism. The model settings of the
// 10B GPT-2 are DeepSpeed's own:
//   [tutorial] https://www.deepspeed.ai/tutorials/zero-offload/ (deepspeedai/DeepSpeed
//     docs/_tutorials/zero-offload.md): a 10B GPT-2 on one 32 GB V100 with --model-parallel-size 1
//     --num-layers 50 --hidden-size 4096 --num-attention-heads 32 --batch-size 10
//     --checkpoint-activations, ZeRO stage 2 with offload_optimizer cpu;
//   [script] microsoft/DeepSpeedExamples Megatron-LM/scripts/
//     ds_zero-offload_10B_pretrain_gpt2_model_parallel.sh: the same flags with --seq-length 1024
//     (the family's context length, resolved by default here), --fp16 and --cpu-optimizer.
// The paper's own table of model settings (its table 3: widths, batch sizes and model-parallel
// degrees per size) is not in the sources this project could reach; the settings marked
// "unverified" below are the previous recollection of it, kept because nothing sourced
// replaces them, and they are not tuned to the planner.
TEST_CASE("fit: headline results of ZeRO-Offload on V100s (seed 002), within 15%") {
  auto within = [](double got, double paper) {
    CAPTURE(got);
    CAPTURE(paper);
    CHECK(got >= 0.85 * paper);
    CHECK(got <= 1.15 * paper);
  };
  SUBCASE("the tutorial's 10B GPT-2 trains on one 32 GB V100 with ZeRO-Offload") {
    // [tutorial], [script]: 50 layers, hidden 4096, 32 heads, batch 10, checkpointing.
    const auto m = gpt(50, 4096, 32);
    within(static_cast<double>(zp::models::count_params(m).total), 10e9);
    FitRequest r = v100_request(m, 1, true);
    r.micro_batches = {10};
    r.checkpointing = {Checkpointing::full};
    CHECK_FALSE(fit(r).candidates.empty());
  }
  SUBCASE("about 13B parameters on one 32 GB V100 with ZeRO-Offload") {
    // The tutorial's width, heads, batch 10 and checkpointing ([tutorial], [script]), more
    // layers: the planner finds 58 layers, 11.9B (-8.5%). The paper's 13B used a smaller
    // batch per GPU (unverified recollection of its table 3: 4); at 4 the planner finds 14.3B.
    FitRequest r = v100_request(gpt(50, 4096, 32), 1, true);
    r.micro_batches = {10};
    r.checkpointing = {Checkpointing::full};
    const auto mm = max_model(r);
    REQUIRE(mm);
    within(static_cast<double>(mm->params), 13e9);
  }
  SUBCASE("about 1.4B parameters on one 32 GB V100 without offload (plain PyTorch)") {
    // Unverified (recollection of the paper's table 3): hidden 2048, 16 heads, batch 32 per
    // GPU, checkpointing. The batch decides the answer: the planner's largest model is 2.07B
    // at batch 1 or 2 (+48%), 1.92B at 8, 1.87B at 10 (the tutorial's), 1.77B at 16 and 1.41B
    // at 32, so the paper's 1.4B is the limit at batch 32, and no smaller batch is within 15%
    // of it. The abstract states no batch for it.
    FitRequest r = v100_request(gpt(20, 2048, 16), 1, false);
    r.micro_batches = {32};
    r.checkpointing = {Checkpointing::full};
    const auto mm = max_model(r);
    REQUIRE(mm);
    within(static_cast<double>(mm->params), 1.4e9);
  }
  SUBCASE("about 70B parameters on 16 V100s (one DGX-2) with model parallelism") {
    // Unverified (recollection of the paper's table 3): hidden 9216, 72 heads, 8-way Megatron
    // model parallelism, batch 8, checkpointing. The planner finds 79.0B (+12.8%).
    FitRequest r = v100_request(gpt(60, 9216, 72), 16, true);
    r.mps = {8};
    r.micro_batches = {8};
    r.checkpointing = {Checkpointing::full};
    const auto mm = max_model(r);
    REQUIRE(mm);
    within(static_cast<double>(mm->params), 70e9);
  }
  SUBCASE("near-linear scaling to 128 GPUs (the tutorial's 10B model, ZeRO-Offload)") {
    // [tutorial], [script]: 50 layers, hidden 4096, 32 heads, batch 10 per GPU.
    for (bool dpu : {false, true}) {
      auto tput = [&](int64_t gpus) {
        FitRequest r = v100_request(gpt(50, 4096, 32), gpus, true);
        r.micro_batches = {10};
        r.checkpointing = {Checkpointing::full};
        r.dpu = {dpu};
        const FitResult f = fit(r);
        REQUIRE_FALSE(f.candidates.empty());
        return f.candidates.front().tokens_per_second;
      };
      const double one = tput(1), many = tput(128);
      CAPTURE(dpu);
      CHECK(many >= 0.85 * 128 * one);  // "near linear"
      CHECK(many <= 1.5 * 128 * one);
    }
  }
}

TEST_CASE("fit: overlap_comm searched both ways at stages 2-3 with dp > 1, one way when pinned") {
  FitRequest r;
  r.model = zp::models::load_model("gpt2");
  r.hw = load_hardware("a100-80g");
  r.gpus = 8;
  r.offload_optimizer = {Offload::none};
  r.offload_param = {Offload::none};
  r.micro_batches = {4};
  r.checkpointing = {Checkpointing::none};
  r.dpu = {false};
  r.base.buffers.reduce_bucket_size = 10'000'000;  // several buckets per backward pass
  r.top = 100;
  const FitResult f = fit(r);
  // Stages 0 and 1 once, stages 2 and 3 with and without overlap.
  CHECK(f.n_searched == 6);
  for (int stage : {2, 3}) {
    CAPTURE(stage);
    const Candidate* by[2] = {nullptr, nullptr};
    for (const Candidate& c : f.candidates)
      if (c.strategy.stage == stage) {
        REQUIRE(c.strategy.overlap_comm.has_value());
        by[*c.strategy.overlap_comm ? 1 : 0] = &c;
      }
    REQUIRE(by[0] != nullptr);
    REQUIRE(by[1] != nullptr);
    // Each is what estimate() and simulate() say of that strategy on its own.
    for (const Candidate* c : by) {
      CHECK(c->per_device == estimate(r.model, c->strategy, nullptr, r.options).per_device);
      const auto g = zp::models::build_training_graph(r.model, graph_options(r.model, c->strategy, r.options));
      const Timeline t = simulate(step_costs(g), c->strategy, r.hw, Cluster{8, 1});
      CHECK(c->step_seconds == doctest::Approx(t.step_seconds));
    }
    // Overlap hides collectives (never slower) and holds a second bucket (never smaller).
    CHECK(by[1]->step_seconds < by[0]->step_seconds);
    CHECK(by[1]->per_device.peak(Tier::gpu) >= by[0]->per_device.peak(Tier::gpu));
  }
  r.base.overlap_comm = false;  // --no-overlap-comm: the only value searched
  const FitResult pinned = fit(r);
  CHECK(pinned.n_searched == 4);
  for (const Candidate& c : pinned.candidates) CHECK(c.strategy.overlap_comm == false);
}

TEST_CASE("fit: ranking, reasons, and what is missing when nothing fits") {
  FitRequest r;
  r.model = zp::models::load_model("gpt2");
  r.hw = load_hardware("a100-80g");
  r.gpus = 8;
  const FitResult f = fit(r);
  REQUIRE(f.candidates.size() == 5);
  CHECK(f.n_searched >= f.n_fit);
  for (std::size_t i = 1; i < f.candidates.size(); ++i) {
    CHECK(f.candidates[i - 1].tokens_per_second >= f.candidates[i].tokens_per_second * 0.999);
    CHECK_FALSE(f.candidates[i].why.empty());
  }
  CHECK(f.candidates.front().why.find("fastest") != std::string::npos);
  const nlohmann::json j = to_json(f, r);
  CHECK(j["schema"] == "zero-plan/fit/v1");
  CHECK(j["candidates"][0].contains("step_seconds"));
  CHECK(j["candidates"][0].contains("tflops_per_gpu"));

  // A 175B-parameter model on one V100 node: the host memory is what is missing.
  FitRequest big = r;
  big.model = zp::models::load_model("gpt3-175b");
  big.hw = load_hardware("v100-32g");
  big.hw.nvme_bytes = 0;
  big.gpus = 1;
  big.mps = {1};
  big.micro_batches = {1};
  big.checkpointing = {Checkpointing::full};
  const FitResult none = fit(big);
  CHECK(none.candidates.empty());
  REQUIRE(none.closest);
  REQUIRE_FALSE(none.closest->shortfalls.empty());
  CHECK(none.closest->shortfalls.front().find("needs") != std::string::npos);
  CHECK(none.closest->shortfalls.front().find("has") != std::string::npos);
}

TEST_CASE("fit: the threaded search gives the one-thread answer, candidate for candidate") {
  FitRequest r;
  r.model = zp::models::load_model("gpt2");
  r.hw = load_hardware("v100-32g");
  r.gpus = 16;
  r.mps = {1, 2, 4};
  r.top = 1000;
  r.threads = 1;
  const FitResult one = fit(r);
  REQUIRE(one.n_fit > 100);
  for (unsigned threads : {2u, 3u, 0u}) {
    r.threads = threads;
    const FitResult many = fit(r);
    CAPTURE(threads);
    CHECK(many.n_searched == one.n_searched);
    CHECK(many.n_fit == one.n_fit);
    CHECK(many.n_shapes == one.n_shapes);
    REQUIRE(many.candidates.size() == one.candidates.size());
    for (std::size_t i = 0; i < one.candidates.size(); ++i) {
      const Candidate& a = one.candidates[i];
      const Candidate& b = many.candidates[i];
      CHECK(describe(b.strategy) == describe(a.strategy));
      CHECK(b.per_device == a.per_device);
      CHECK(b.step_seconds == a.step_seconds);
      CHECK(b.why == a.why);
    }
  }
  // Nothing fits: the same closest miss, whatever the thread count.
  FitRequest big = r;
  big.model = zp::models::load_model("gpt3-175b");
  big.hw.nvme_bytes = 0;
  big.gpus = 1;
  big.mps = {1};
  big.threads = 1;
  const FitResult none1 = fit(big);
  big.threads = 2;
  const FitResult none2 = fit(big);
  REQUIRE(none1.closest);
  REQUIRE(none2.closest);
  CHECK(describe(none2.closest->strategy) == describe(none1.closest->strategy));
  CHECK(none2.closest->shortfalls == none1.closest->shortfalls);
}

// The plain search for the largest depth, as max_model did before it extrapolated: doubling
// from the family's depth, then bisection, every probe the whole search (fit()) at that depth.
// 0: not even one layer fits.
int64_t plain_max_layers(const FitRequest& r) {
  auto fits = [&](int64_t L) {
    FitRequest q = r;
    q.model.n_layer = L;
    return !fit(q).candidates.empty();
  };
  int64_t lo = 0, hi = 0;
  const int64_t l = std::max<int64_t>(1, r.model.n_layer);
  if (fits(l)) {
    lo = l;
    hi = 2 * l;
    while (fits(hi)) {
      lo = hi;
      hi *= 2;
    }
  } else {
    hi = l;
    if (!fits(1)) return 0;
    lo = 1;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

TEST_CASE("fit --max-model: the extrapolated search gives plain bisection's depth") {
  // Small memories, so that the answers are tens to hundreds of layers and plain bisection
  // (a whole search per probe) stays affordable. The V100 preset's speeds.
  auto small_hw = [](uint64_t gpu_gib, uint64_t host_gib, uint64_t nvme_gib, int64_t per_node) {
    Hardware hw = load_hardware("v100-32g");
    hw.name = "small";
    hw.gpu_memory_bytes = gpu_gib << 30;
    hw.host_memory_bytes = host_gib << 30;
    hw.nvme_bytes = nvme_gib << 30;
    hw.gpus_per_node = per_node;
    return hw;
  };
  struct Case {
    std::string name;
    FitRequest r;
  };
  std::vector<Case> cases;
  auto add = [&](std::string name, zp::models::ModelSpec m, Hardware hw, int64_t gpus) {
    FitRequest r;
    r.model = std::move(m);
    r.hw = std::move(hw);
    r.gpus = gpus;
    r.micro_batches = {1, 4};
    r.checkpointing = {Checkpointing::none, Checkpointing::full};
    r.threads = 2;
    cases.push_back({std::move(name), std::move(r)});
    return &cases.back().r;
  };
  // Offload everywhere: the host or the drive is the limit, past the GPU's.
  add("narrow, every offload", gpt(4, 256, 4), small_hw(2, 2, 4, 1), 1);
  add("gpt2 width, host and drive small", gpt(12, 768, 12), small_hw(4, 8, 16, 1), 1);
  // Two GPUs on a node share its host memory and drive; dp 2 halves the states.
  add("two ranks per node", gpt(12, 768, 12), small_hw(4, 8, 16, 2), 2);
  // No drive: the host holds the offloaded states.
  add("no NVMe", gpt(8, 512, 8), small_hw(2, 6, 0, 1), 1);
  // The GPU is the limit: stage 3 with everything offloaded keeps only activations growing.
  {
    FitRequest* r = add("activations bound, stage 3", gpt(4, 256, 4), small_hw(6, 64, 256, 1), 1);
    r->stages = {3};
    r->offload_optimizer = {Offload::nvme};
    r->offload_param = {Offload::nvme};
    r->micro_batches = {1};
    r->checkpointing = {Checkpointing::none};
  }
  // Answers below 16 and between 16 and 64 layers: the small depths searched plainly.
  add("a few layers", gpt(4, 1024, 16), small_hw(2, 4, 0, 1), 1);
  add("tens of layers", gpt(4, 512, 8), small_hw(2, 2, 0, 1), 1);
  // Nothing fits, not even one layer.
  add("nothing fits", gpt(4, 4096, 32), small_hw(1, 1, 0, 1), 1);
  // The deepspeed profile (whole replays, the caching allocator's rounding).
  {
    FitRequest* r = add("deepspeed profile", gpt(12, 768, 12), small_hw(4, 8, 16, 1), 1);
    r->options.profile = Profile::deepspeed;
  }
  for (const Case& c : cases) {
    CAPTURE(c.name);
    const int64_t plain = plain_max_layers(c.r);
    std::vector<MaxModelProbe> probes;
    const auto mm = max_model(c.r, [&](const MaxModelProbe& p) { probes.push_back(p); });
    CHECK(probes.size() == (mm ? mm->n_probes : probes.size()));
    if (plain == 0) {
      CHECK_FALSE(mm);
      continue;
    }
    REQUIRE(mm);
    CHECK(mm->model.n_layer == plain);
    CHECK(mm->model.n_embd == c.r.model.n_embd);
    CHECK(mm->params == static_cast<uint64_t>(zp::models::count_params(mm->model).total));
    // The search at the answer is fit()'s, and its best is the answer's best.
    FitRequest q = c.r;
    q.model.n_layer = plain;
    const FitResult f = fit(q);
    REQUIRE_FALSE(f.candidates.empty());
    CHECK(describe(mm->best.strategy) == describe(f.candidates.front().strategy));
    CHECK(mm->best.per_device == f.candidates.front().per_device);
    CHECK(mm->search.n_fit == f.n_fit);
    // Every configuration of the search was evaluated exactly one layer deeper, and none fit.
    uint64_t deeper = 0;
    for (const MaxModelProbe& p : probes) {
      CAPTURE(p.n_layer);
      CHECK(p.n_search == f.n_searched);
      CHECK(p.params == static_cast<uint64_t>(zp::models::count_params(gpt(p.n_layer, c.r.model.n_embd, c.r.model.n_head)).total));
      if (p.n_layer == plain + 1) {
        CHECK_FALSE(p.fits);
        deeper += p.n_configurations;
      }
    }
    CHECK(deeper >= f.n_searched);
  }
}

TEST_CASE("fit: the DeepSpeed config reads back to the same strategy") {
  Strategy s;
  s.stage = 3;
  s.dp = 8;
  s.micro_batch = 4;
  s.grad_accum = 2;
  s.precision = Precision::fp16;
  s.offload_optimizer = Offload::nvme;
  s.offload_param = Offload::cpu;
  s.buffers.prefetch_bucket_size = 12'345'678;
  const Strategy back = apply_deepspeed_config(Strategy{}, deepspeed_config(s), "ds.json");
  CHECK(back.stage == 3);
  CHECK(back.micro_batch == 4);
  CHECK(back.grad_accum == 2);
  CHECK(back.precision == Precision::fp16);
  CHECK(back.offload_optimizer == Offload::nvme);
  CHECK(back.offload_param == Offload::cpu);
  CHECK(back.buffers == s.buffers);
  CHECK(deepspeed_config(s)["train_batch_size"] == 64);
  // Parameters on NVMe, buffers not DeepSpeed's defaults: the counts and size come back.
  s.offload_param = Offload::nvme;
  s.buffers.optimizer_swap_buffer_count = 6;
  s.buffers.param_swap_buffer_count = 7;
  s.buffers.param_swap_buffer_size = 20'000'000;
  const Strategy nv = apply_deepspeed_config(Strategy{}, deepspeed_config(s), "ds.json");
  CHECK(nv.offload_param == Offload::nvme);
  CHECK(nv.buffers == s.buffers);
  // The activation_checkpointing section: DeepSpeed's keys for P_a, Pa+cpu and the contiguous
  // buffers read back to the same strategy. The model code, not the config, turns
  // checkpointing on, so the base the config is read into says --checkpointing full, as the
  // user says it beside --ds-config.
  for (bool cpu : {false, true})
    for (bool contiguous : {false, true}) {
      Strategy c = s;
      c.checkpointing = Checkpointing::full;
      c.partition_activations = true;
      c.cpu_checkpointing = cpu;
      c.contiguous_memory_optimization = contiguous;
      c.number_checkpoints = contiguous ? 48 : 0;
      c.overlap_comm = overlaps_comm(c);  // the config says it explicitly
      Strategy base = c;
      base.partition_activations = base.cpu_checkpointing = base.contiguous_memory_optimization = false;
      base.number_checkpoints = 0;
      const nlohmann::json ds = deepspeed_config(c);
      CAPTURE(ds.dump());
      CHECK(ds["activation_checkpointing"]["partition_activations"] == true);
      CHECK(ds["activation_checkpointing"]["cpu_checkpointing"] == cpu);
      CHECK(ds["activation_checkpointing"]["contiguous_memory_optimization"] == contiguous);
      CHECK(apply_deepspeed_config(base, ds, "ds.json") == c);
    }
}

TEST_CASE("fit: the cache tells DeepSpeed's contiguous checkpoint buffers apart") {
  const auto m = zp::models::load_model("gpt2");
  PlanOptions o;
  o.profile = Profile::deepspeed;
  FitEvaluator ev(m, o);
  Strategy s;
  s.stage = 2;
  s.dp = 4;
  s.checkpointing = Checkpointing::full;
  s.partition_activations = true;
  s = resolve_for_model(s, m);
  for (int64_t n : {0, 12, 20}) {
    Strategy c = s;
    c.contiguous_memory_optimization = n > 0;
    c.number_checkpoints = n;
    CAPTURE(n);
    CHECK(ev.memory(c) == estimate(m, c, nullptr, o).per_device);
  }
}

TEST_CASE("DeepSpeed's estimators, values computed by hand from its formulas") {
  // zero2, offload: gpu 2P; cpu P * max(4 * gpus, 16) * 1.5.
  auto z2 = ds_estimate_zero2(1'000'000'000, 8, 1, true);
  CHECK(z2.gpu_bytes == 2'000'000'000ULL);
  CHECK(z2.cpu_bytes == 48'000'000'000ULL);          // 1e9 * 32 * 1.5
  CHECK(ds_estimate_zero2(1'000'000'000, 1, 1, true).cpu_bytes == 24'000'000'000ULL);  // max(4,16)
  // zero2, no offload: gpu 4P + int(16P / gpus); cpu P * 4 * gpus_per_node * 1.5.
  z2 = ds_estimate_zero2(1'000'000'000, 8, 1, false);
  CHECK(z2.gpu_bytes == 6'000'000'000ULL);
  CHECK(z2.cpu_bytes == 48'000'000'000ULL);
  CHECK(ds_estimate_zero2(10, 3, 1, false).gpu_bytes == 40 + 53);  // int(160 / 3) = 53

  // zero3: largest layer 4 * 1e8 on the GPU in every offload setting.
  auto z3 = ds_estimate_zero3(1'000'000'000, 100'000'000, 8, 1, true, true, true);
  CHECK(z3.gpu_bytes == 400'000'000ULL);
  CHECK(z3.cpu_bytes == 27'000'000'000ULL);          // 1e9 * 18 * 1 * 1.5
  CHECK(ds_estimate_zero3(1'000'000'000, 100'000'000, 8, 2, true, true, true).cpu_bytes ==
        13'500'000'000ULL);                           // gpus_factor 1/2
  CHECK(ds_estimate_zero3(1'000'000'000, 100'000'000, 8, 1, true, true, false).cpu_bytes ==
        48'000'000'000ULL);                           // max(4 * 8, 18) * 1.5
  z3 = ds_estimate_zero3(1'000'000'000, 100'000'000, 8, 1, true, false, true);
  CHECK(z3.gpu_bytes == 650'000'000ULL);             // 4e8 + int(2e9 / 8)
  CHECK(z3.cpu_bytes == 24'000'000'000ULL);          // 1e9 * 16 * 1.5
  z3 = ds_estimate_zero3(1'000'000'000, 100'000'000, 8, 1, false, false, true);
  CHECK(z3.gpu_bytes == 2'650'000'000ULL);           // 4e8 + int(18e9 / 8)
  CHECK(z3.cpu_bytes == 4'800'000'000ULL);           // 1e8 * 4 * 8 * 1.5
  CHECK(ds_estimate_zero3(1'000'000'000, 100'000'000, 8, 1, false, false, false).cpu_bytes ==
        48'000'000'000ULL);
  CHECK(ds_estimate_zero3(10, 0, 3, 1, true, false, true).gpu_bytes == 6);  // int(20 / 3)
}

TEST_CASE("hardware: presets carry every speed with a source; bad files name the field") {
  for (const std::string& name : hardware_preset_names()) {
    const Hardware hw = load_hardware(name);
    CAPTURE(name);
    for (const char* field : {"gpu_tflops", "hbm_gbps", "h2d_gbps", "d2h_gbps", "nvlink_gbps",
                              "internode_gbps", "cpu_adam_gparams", "nvme_read_gbps",
                              "nvme_write_gbps", "gpu_memory_bytes", "host_memory_bytes"})
      CHECK(hw.sources.contains(field));
    CHECK(hw.gpu_tflops > 0);
    CHECK(hw.cpu_adam_gparams > 0);
  }
  nlohmann::json j = to_json(load_hardware("a100-80g"));
  j.erase("gpu_tflops");
  CHECK(error_of([&] { parse_hardware(j, "hw.json"); }).find("gpu_tflops") != std::string::npos);
  j = to_json(load_hardware("a100-80g"));
  j["hbm_gbps"] = -5;
  CHECK(error_of([&] { parse_hardware(j, "hw.json"); }).find("'hbm_gbps' must be a positive number") !=
        std::string::npos);
}
