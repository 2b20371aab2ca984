// The step simulator under tensor, sequence and pipeline parallelism, against hand arithmetic:
// Megatron's all-reduces a layer (Shoeybi et al. 2019 sec. 3) and sequence parallelism's
// all-gathers and reduce-scatters (Korthikanti et al. 2022 sec. 4.2.2) at a preset's link
// speed, the pipeline bubble formulas of Narayanan et al. 2021 sec. 2.2 against the event-
// driven timing of pipeline.hpp, and Megatron's rank layout deciding which links cross nodes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "error_of.hpp"
#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/fit.hpp"
#include "zp/planner/pipeline.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/simulate.hpp"

using namespace zp::planner;

namespace {

using zp::test::error_of;

// GPT-2 small (C 768, 12 heads, F 3072, V 50257, 12 layers, tied embeddings), B = 1, T = 1024,
// bf16: one (B, T, C) activation is 1 x 1024 x 768 x 2 = 1,572,864 bytes.
constexpr double kAct = 1.0 * 1024 * 768 * 2;

Strategy gpt2_strategy(int64_t tp, bool sp) {
  Strategy s;
  s.mp = tp;
  s.sp = sp;
  s.seq = 1024;
  s.micro_batch = 1;
  s.precision = Precision::bf16;
  return s;
}

StepCosts gpt2_costs(const Strategy& s, int64_t stage = 0) {
  const auto m = zp::models::load_model("gpt2");
  zp::models::GraphOptions go = graph_options(m, resolve_for_model(s, m), {});
  go.pp_stage = stage;
  return step_costs(zp::models::build_training_graph(m, go));
}

// The h100-80g preset's numbers, written out (planner/hardware/h100-80g.json and its sources).
constexpr double kNvlink = 450e9;    // B/s per direction per GPU (NVLink 4: 900 GB/s both ways)
constexpr double kNic = 400e9 / 8;   // B/s per GPU: 8 x 400 Gb/s NDR per node of 8 GPUs
constexpr double kFlops = 514e12;    // FLOP/s (52% of 989 dense bf16)

Hardware h100() {
  const Hardware hw = load_hardware("h100-80g");
  REQUIRE(hw.nvlink_gbps == 450.0);
  REQUIRE(hw.internode_gbps == 400.0);
  REQUIRE(hw.gpus_per_node == 8);
  REQUIRE(hw.gpu_tflops == 514.0);
  return hw;
}

double sum_seconds(const std::vector<TpCollective>& ks, CollectiveKind kind) {
  double n = 0;
  for (const TpCollective& k : ks) n += k.kind == kind ? 1 : 0;
  return n;
}

// One micro-batch's passes of `stages` equal stages on the unit machine of test_fit.cpp (1e12
// FLOP/s, 1e9 B/s): each stage's one block forward 1 s, backward 2 s, 1e6 parameters.
std::vector<StepCosts> uniform_stages(int64_t p, int64_t v) {
  std::vector<StepCosts> out;
  for (int64_t i = 0; i < p; ++i) {
    StepCosts c;
    c.fwd_flops = {0, 1e12, 0};
    c.bwd_flops = {0, 2e12, 0};
    c.fwd_bytes = c.bwd_bytes = {0, 0, 0};
    c.group_params = {0, 1'000'000, 0};
    c.n_params = 1'000'000;
    c.flops_executed = c.flops_model = 3e12;
    c.tokens = 1000;
    c.n_layer = 1;
    c.pp = p;
    c.pp_stage = i;
    c.pp_chunks = v;
    out.push_back(c);
  }
  return out;
}

Hardware unit_hardware() {
  Hardware hw = load_hardware("v100-32g");
  hw.gpus_per_node = 8;
  hw.gpu_tflops = 1;
  hw.hbm_gbps = 1;
  hw.nvlink_gbps = 1;
  hw.internode_gbps = 1;
  hw.h2d_gbps = hw.d2h_gbps = 1;
  return hw;
}

}  // namespace

TEST_CASE("tensor parallelism: Megatron's 4 all-reduces of (B, T, C) a layer, the backward's behind the weight gradients") {
  const Hardware hw = h100();
  const Cluster cl{2, 1};
  const Strategy s = gpt2_strategy(2, false);
  const StepCosts c = gpt2_costs(s);
  // Block h.0 (group 1): forward, the g all-reduces after attention's output projection and
  // the MLP's down projection; backward, the f all-reduces of the inputs' gradients of q|k|v
  // and the MLP's up projection (Shoeybi et al. 2019 fig. 3: two each way).
  REQUIRE(c.tp_fwd[1].size() == 2);
  REQUIRE(c.tp_bwd[1].size() == 2);
  for (const auto* pass : {&c.tp_fwd[1], &c.tp_bwd[1]})
    for (const TpCollective& k : *pass) {
      CHECK(k.kind == CollectiveKind::all_reduce);
      CHECK(k.bytes == kAct);
    }
  // Forward: the stream waits. Backward: each overlaps its linears' weight-gradient GEMM,
  // 2 B T C n_out FLOPs: q|k|v's n_out = 3 C / t = 1152, the up projection's 4 C / t = 1536.
  CHECK(c.tp_fwd[1][0].overlap_flops == 0);
  CHECK(c.tp_bwd[1][0].overlap_flops == doctest::Approx(2.0 * 1024 * 768 * 1536));  // MLP first
  CHECK(c.tp_bwd[1][1].overlap_flops == doctest::Approx(2.0 * 1024 * 768 * 1152));
  // Ring all-reduce over t = 2 on NVLink: 2 (t - 1) / t x 1,572,864 B / 450e9 B/s.
  const double ar = 2.0 * (2 - 1) / 2 * kAct / kNvlink;
  CHECK(ar == doctest::Approx(3.4953e-6).epsilon(1e-4));
  const PassSeconds f = pass_seconds(c, s, hw, cl, 1, true), b = pass_seconds(c, s, hw, cl, 1, false);
  CHECK(f.tp + b.tp == doctest::Approx(4 * ar));  // a layer's collective time
  CHECK(f.tp_exposed == doctest::Approx(2 * ar));
  // The weight gradients take 2 x 1024 x 768 x 1152 / 514e12 = 3.525e-6 s and 4.700e-6 s, both
  // longer than an all-reduce: hidden.
  CHECK(b.tp_exposed == 0);
  // The vocabulary-parallel embedding all-reduces its lookup in forward; the vocabulary-parallel
  // head's input gradient is all-reduced in backward, behind the head's weight gradient.
  REQUIRE(c.tp_fwd[0].size() == 1);
  CHECK(c.tp_fwd[0][0].bytes == kAct);
  const std::size_t head = 13;
  REQUIRE(c.tp_bwd[head].size() == 1);
  CHECK(c.tp_bwd[head][0].overlap_flops == doctest::Approx(2.0 * 1024 * 768 * 25129));  // V/t rows
  CHECK(c.tp_fwd[head].empty());

  SUBCASE("t = 4: the weight gradients are shorter than the all-reduces, the rest is exposed") {
    const Strategy s4 = gpt2_strategy(4, false);
    const StepCosts c4 = gpt2_costs(s4);
    const double ar4 = 2.0 * (4 - 1) / 4 * kAct / kNvlink;  // 5.243e-6 s
    const double qkv = 2.0 * 1024 * 768 * 576 / kFlops;   // 1.763e-6 s (3 C / 4 = 576)
    const double up = 2.0 * 1024 * 768 * 768 / kFlops;    // 2.350e-6 s (4 C / 4 = 768)
    const PassSeconds b4 = pass_seconds(c4, s4, hw, Cluster{4, 1}, 1, false);
    CHECK(b4.tp == doctest::Approx(2 * ar4));
    CHECK(b4.tp_exposed == doctest::Approx((ar4 - qkv) + (ar4 - up)));
  }
  SUBCASE("full recomputation all-reduces the recomputed forward's outputs again") {
    Strategy r = s;
    r.checkpointing = Checkpointing::full;
    const StepCosts cr = gpt2_costs(r);
    REQUIRE(cr.tp_bwd[1].size() == 4);
    CHECK(sum_seconds(cr.tp_bwd[1], CollectiveKind::all_reduce) == 4);
    const PassSeconds br = pass_seconds(cr, r, hw, cl, 1, false);
    CHECK(br.tp == doctest::Approx(4 * ar));
    CHECK(br.tp_exposed == doctest::Approx(2 * ar));  // the recomputation's g, waited for
  }
  SUBCASE("a tensor-parallel group across nodes rides the network") {
    // t = 16 over two nodes of 8: each node's 8 ranks of the ring have 8 rails of 50 GB/s.
    CHECK(group_bus_gbps(hw, Cluster{16, 2}, 16, 1) == doctest::Approx(400.0));
    CHECK(group_bus_gbps(hw, Cluster{16, 2}, 8, 1) == doctest::Approx(450.0));
  }
}

TEST_CASE("sequence parallelism: the same bytes as all-gather + reduce-scatter, the inputs gathered again in backward") {
  const Hardware hw = h100();
  const Cluster cl{2, 1};
  const Strategy s = gpt2_strategy(2, true), plain = gpt2_strategy(2, false);
  const StepCosts c = gpt2_costs(s), p = gpt2_costs(plain);
  // Forward of h.0: all-gather before q|k|v and the up projection, reduce-scatter after the
  // output and down projections (Korthikanti et al. 2022 fig. 5), each of a (B, T, C) tensor.
  CHECK(sum_seconds(c.tp_fwd[1], CollectiveKind::all_gather) == 2);
  CHECK(sum_seconds(c.tp_fwd[1], CollectiveKind::reduce_scatter) == 2);
  // Backward: the output gradients gathered (2), the column-parallel inputs gathered again
  // for their weight gradients (2), their input gradients reduce-scattered (2).
  CHECK(sum_seconds(c.tp_bwd[1], CollectiveKind::all_gather) == 4);
  CHECK(sum_seconds(c.tp_bwd[1], CollectiveKind::reduce_scatter) == 2);
  for (const auto* pass : {&c.tp_fwd[1], &c.tp_bwd[1]})
    for (const TpCollective& k : *pass) CHECK(k.bytes == kAct);
  // An all-gather or reduce-scatter moves (t - 1) / t of the bytes, half an all-reduce.
  const double ag = (2.0 - 1) / 2 * kAct / kNvlink, ar = 2 * ag;
  const PassSeconds f = pass_seconds(c, s, hw, cl, 1, true), b = pass_seconds(c, s, hw, cl, 1, false);
  const PassSeconds pf = pass_seconds(p, plain, hw, cl, 1, true), pb = pass_seconds(p, plain, hw, cl, 1, false);
  CHECK(f.tp == doctest::Approx(pf.tp));          // 2 AG + 2 RS = 2 AR
  CHECK(f.tp == doctest::Approx(2 * ar));
  CHECK(b.tp == doctest::Approx(pb.tp + 2 * ag));  // plus the two inputs gathered again
  // Waited for: forward all; backward the output gradients' gathers (the reduce-scatter's
  // backward); the re-gathers hide behind the input-gradient GEMMs, the reduce-scatters behind
  // the weight-gradient GEMMs (each >= 3.5e-6 s > 1.75e-6 s).
  CHECK(f.tp_exposed == doctest::Approx(2 * ar));
  CHECK(b.tp_exposed == doctest::Approx(2 * ag));
  // The matmuls run the same FLOPs; the norms, dropouts and residuals between the regions run
  // on T/t tokens (their HBM traffic shrinks), nothing else changes.
  for (std::size_t i = 0; i < c.fwd_flops.size(); ++i) {
    CHECK(c.fwd_flops[i] == p.fwd_flops[i]);
    CHECK(c.bwd_flops[i] == p.bwd_flops[i]);
    CHECK(c.fwd_bytes[i] <= p.fwd_bytes[i]);
  }
  CHECK(c.fwd_bytes[1] < p.fwd_bytes[1]);
  // Over the whole graph: the plain run's (4 L + 2) all-reduces (embedding, head, 4 a layer)
  // against sequence parallelism's same volume plus 2 L + 1 all-gathers (the re-gathers, the
  // head's input again).
  double total = 0, total_plain = 0;
  for (std::size_t i = 0; i < c.fwd_flops.size(); ++i) {
    total += pass_seconds(c, s, hw, cl, i, true).tp + pass_seconds(c, s, hw, cl, i, false).tp;
    total_plain += pass_seconds(p, plain, hw, cl, i, true).tp + pass_seconds(p, plain, hw, cl, i, false).tp;
  }
  CHECK(total_plain == doctest::Approx((4 * 12 + 2) * ar));
  CHECK(total == doctest::Approx((4 * 12 + 2) * ar + (2 * 12 + 1) * ag));
}

TEST_CASE("pipeline: 1F1B p 4, m 8 of equal stages: (m + p - 1)(t_f + t_b), bubble (p - 1)/(m + p - 1)") {
  const Hardware hw = unit_hardware();
  Strategy s;
  s.pp = 4;
  s.grad_accum = 8;
  const Cluster cl{4, 1};
  const Timeline t = simulate_pipeline(uniform_stages(4, 1), s, hw, cl);
  // t_f = 1e12 / 1e12 = 1 s, t_b = 2 s: (8 + 4 - 1) x 3 = 33 s; bubble 3 / 11 of it.
  CHECK(t.pipeline_seconds == doctest::Approx(33.0));
  CHECK(t.bubble_fraction == doctest::Approx(3.0 / 11.0));
  CHECK(t.pipeline_seconds ==
        doctest::Approx(time_pipeline(pipeline_order(PipelineSchedule::one_f_one_b, 4, 8, 1), 4, 1, 1.0, 2.0).makespan));
  // Then the optimizer: stage 0's last backward ends last (33 s); Adam on the GPU reads and
  // writes 1e6 x (2 + 2 + 2 x 12) = 28e6 bytes at 1e9 B/s: 0.028 s (no data parallelism).
  CHECK(t.step_seconds == doctest::Approx(33.028));
  CHECK(t.stage == 0);
  // Stage 3's last backward ends 3 backwards (6 s) earlier.
  REQUIRE(t.stage_seconds.size() == 4);
  CHECK(t.stage_seconds[3] == doctest::Approx(27.028));
  // 3e12 FLOPs a micro-batch on each of the 4 stages, 8 micro-batches, per GPU per second.
  CHECK(t.tflops_per_gpu == doctest::Approx(3.0 * 8 / 33.028));

  SUBCASE("GPipe: the same makespan") {
    s.pp_schedule = PipelineSchedule::gpipe;
    CHECK(simulate_pipeline(uniform_stages(4, 1), s, hw, cl).pipeline_seconds == doctest::Approx(33.0));
  }
  SUBCASE("interleaved, v 2: (m v + p - 1)(t_f + t_b) / v") {
    s.pp_schedule = PipelineSchedule::interleaved;
    s.vp = 2;
    const Timeline i = simulate_pipeline(uniform_stages(4, 2), s, hw, cl);
    CHECK(i.pipeline_seconds == doctest::Approx((16 + 3) * 3.0 / 2));  // 28.5 s
    CHECK(i.pipeline_seconds ==
          doctest::Approx(time_pipeline(pipeline_order(PipelineSchedule::interleaved, 4, 8, 2), 4, 2, 0.5, 1.0).makespan));
    CHECK(i.bubble_fraction == doctest::Approx(1 - 24.0 / 28.5));
  }
  SUBCASE("data parallelism: the reduction after the last backward") {
    // dp 2 on NVLink (1e9 B/s here): stage 0 all-reduces 1e6 bf16 gradients, 2 x 1/2 x 2e6 B.
    s.dp = 2;
    const Timeline d = simulate_pipeline(uniform_stages(4, 1), s, hw, Cluster{8, 1});
    CHECK(d.step_seconds == doctest::Approx(33.0 + 0.002 + 0.028));
    CHECK(d.tokens_per_second == doctest::Approx(1000.0 * 8 * 2 / d.step_seconds));
  }
}

TEST_CASE("pipeline: the closed forms against the event-driven timing of each schedule's order") {
  std::mt19937 rng(20);
  std::uniform_real_distribution<double> u(0.5, 2.0);
  // Per schedule, over random stage times: how far below and above time_pipeline.
  std::map<PipelineSchedule, std::pair<double, double>> off;
  int cases = 0;
  for (PipelineSchedule sch : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b, PipelineSchedule::interleaved})
    for (int64_t p = 2; p <= 8; ++p)
      for (int64_t m = 1; m <= 32; ++m)
        for (int64_t v = 1; v <= 4; ++v) {
          if ((sch == PipelineSchedule::interleaved) != (v > 1) || (v > 1 && m % p != 0)) continue;
          const PipelineOrder order = pipeline_order(sch, p, m, v);
          const std::size_t n = static_cast<std::size_t>(p);
          auto per_chunk = [&](std::vector<double> x) {
            for (double& y : x) y /= static_cast<double>(v);
            return x;
          };
          // Equal stages: Narayanan et al.'s formulas.
          const double mv = static_cast<double>(m * v), vd = static_cast<double>(v);
          CHECK(makespan_closed_form(sch, p, m, v, std::vector<double>(n, 1.0), std::vector<double>(n, 2.0)).makespan ==
                doctest::Approx((mv + static_cast<double>(p) - 1) * 3.0 / vd).epsilon(1e-12));
          // Equal middle stages, a first stage a little heavier (the embedding) and a last one
          // heavier both ways (the head): exact, and so are the stages' last ends.
          std::vector<double> f(n, 1.0), b(n, 2.0);
          f[0] += 0.05 * u(rng);
          b[0] += 0.05 * u(rng);
          f[n - 1] += 0.1 + 0.5 * u(rng);
          b[n - 1] += 0.2 + 0.5 * u(rng);
          const PipelineMakespan cf = makespan_closed_form(sch, p, m, v, f, b);
          const PipelineTiming ev = time_pipeline(order, p, v, per_chunk(f), per_chunk(b));
          CHECK(cf.makespan == doctest::Approx(ev.makespan).epsilon(1e-12));
          for (std::size_t i = 0; i < n; ++i) CHECK(cf.end[i] == doctest::Approx(ev.end[i]).epsilon(1e-12));
          // Random stages: forward 0.5-2, backward 1-4 times that.
          for (std::size_t i = 0; i < n; ++i) {
            f[i] = u(rng);
            b[i] = f[i] * 2 * u(rng);
          }
          const double x = makespan_closed_form(sch, p, m, v, f, b).makespan;
          const double y = time_pipeline(order, p, v, per_chunk(f), per_chunk(b)).makespan;
          auto& [below, above] = off[sch];
          below = std::max(below, (y - x) / y);
          above = std::max(above, (x - y) / y);
          ++cases;
        }
  CHECK(cases == 2 * 7 * 32 + 159);  // interleaved: m a multiple of p, v 2-4
  for (const auto& [sch, o] : off)
    MESSAGE(to_string(sch) << ": the closed form is up to " << o.first << " below and " << o.second
                           << " above the event timing");
  // GPipe: exact whatever the stages (two flow shops of identical jobs in a row). 1F1B: never
  // below (an upper bound), above by at most a fifth when the forward's and the backward's
  // slowest stages differ. Interleaved: within a tenth either way.
  CHECK(off[PipelineSchedule::gpipe].first < 1e-12);
  CHECK(off[PipelineSchedule::gpipe].second < 1e-12);
  CHECK(off[PipelineSchedule::one_f_one_b].first < 1e-12);
  CHECK(off[PipelineSchedule::one_f_one_b].second < 0.2);
  CHECK(off[PipelineSchedule::interleaved].first < 0.1);
  CHECK(off[PipelineSchedule::interleaved].second < 0.1);
}

TEST_CASE("pipeline: GPT-2 in 4 stages, each stage's graph timed, the makespan as pipeline.hpp's timing has it") {
  const Hardware hw = h100();
  Strategy s = gpt2_strategy(2, false);
  s.pp = 4;
  s.grad_accum = 8;
  s.stage = 1;
  const auto m = zp::models::load_model("gpt2");
  const Timeline t = simulate_model(m, resolve_for_model(s, m), hw, Cluster{8, 1});
  REQUIRE(t.stage_forward.size() == 4);
  // Middle stages hold 3 blocks each and the same links; the last adds the head and the loss.
  CHECK(t.stage_forward[1] == doctest::Approx(t.stage_forward[2]));
  CHECK(t.stage_forward[3] > t.stage_forward[1]);
  CHECK(t.stage_backward[3] > t.stage_backward[1]);
  const PipelineTiming ev = time_pipeline(pipeline_order(PipelineSchedule::one_f_one_b, 4, 8, 1), 4, 1,
                                          t.stage_forward, t.stage_backward);
  CHECK(t.pipeline_seconds == doctest::Approx(ev.makespan).epsilon(1e-12));
  CHECK(t.step_seconds > t.pipeline_seconds);
  // Tied embeddings: the first and last stage all-reduce the word embeddings' gradient,
  // ceil(50257 / 2) x 768 bf16 elements over 2 ranks of one node: 25129 x 768 x 2 B / 450e9.
  const StepCosts last = gpt2_costs(resolve_for_model(s, m), 3);
  CHECK(last.tied_embedding_params == 25129u * 768u);
  CHECK(gpt2_costs(resolve_for_model(s, m), 1).tied_embedding_params == 0);
  int syncs = 0;
  for (const Task& k : t.tasks)
    if (std::string_view(k.kind) == "embedding all-reduce" && k.step == 1) {
      ++syncs;
      CHECK(k.seconds == doctest::Approx(25129.0 * 768 * 2 / kNvlink));
    }
  CHECK(syncs == 1);
  // The single-graph simulator refuses a pipeline.
  CHECK(error_of([&] { simulate(last, resolve_for_model(s, m), hw, Cluster{8, 1}); }).find("--pp 4") !=
        std::string::npos);
}

TEST_CASE("pipeline: a stage's step is its last backward's end, then its ZeRO-1 reduction and update") {
  // GPT-2, tp 2, dp 2, pp 4, ZeRO-1, 8 micro-batches on two nodes of 8 H100s: each data-
  // parallel pair sits in one node (stride tp = 2, 2 ranks), so NVLink. After stage i's last
  // backward (makespan_closed_form's end) its gradients (one bucket: 3 blocks are far below
  // 500M elements) are reduce-scattered, Adam updates its half, the halves are all-gathered:
  //   RS: P x 2 B x (2 - 1) / 2 / 450e9, Adam: ceil(P / 2) x 28 B / 3350e9, AG: as RS.
  const Hardware hw = h100();
  Strategy s = gpt2_strategy(2, false);
  s.dp = 2;
  s.pp = 4;
  s.stage = 1;
  s.grad_accum = 8;
  const Cluster cl{16, 2};
  std::vector<StepCosts> c;
  for (int64_t i = 0; i < 4; ++i) c.push_back(gpt2_costs(s, i));
  const Timeline t = simulate_pipeline(c, s, hw, cl);
  const PipelineMakespan mk =
      makespan_closed_form(PipelineSchedule::one_f_one_b, 4, 8, 1, t.stage_forward, t.stage_backward);
  CHECK(t.pipeline_seconds == mk.makespan);
  // Stages 1 and 2 hold the same 3 blocks: the same tail, stage 2's from an earlier end.
  CHECK(c[1].n_params == c[2].n_params);
  for (std::size_t i : {1u, 2u}) {
    const double P = static_cast<double>(c[i].n_params);
    const double rs = P * 2 * (2 - 1) / 2 / kNvlink;
    const double adam = std::ceil(P / 2) * 28 / 3350e9;
    CHECK(t.stage_seconds[i] == doctest::Approx(mk.end[i] + rs + adam + rs).epsilon(1e-9));
  }
  CHECK(t.step_seconds == doctest::Approx(*std::max_element(t.stage_seconds.begin(), t.stage_seconds.end())));
}

TEST_CASE("pipeline: Megatron's rank order puts stages tp x dp ranks apart; a boundary across nodes pays the network") {
  const Hardware hw = h100();
  // tp 2, dp 2, pp 4 on two nodes of 8: stage i holds ranks 4i .. 4i + 3 (tp-cp-ep-dp-pp), so
  // stages 0-1 share node 0, 2-3 node 1, and only the 1 -> 2 boundary crosses.
  Strategy s = gpt2_strategy(2, false);
  s.dp = 2;
  s.pp = 4;
  s.grad_accum = 8;
  const Cluster cl{16, 2};
  CHECK_FALSE(pipeline_link_crosses_nodes(s, hw, cl, 0, 1));
  CHECK(pipeline_link_crosses_nodes(s, hw, cl, 1, 2));
  CHECK_FALSE(pipeline_link_crosses_nodes(s, hw, cl, 2, 3));
  CHECK(pipeline_link_crosses_nodes(s, hw, cl, 3, 0));  // the interleaved schedule's wrap
  CHECK(p2p_gbps(s, hw, cl, 0, 1) == 450.0);
  CHECK(p2p_gbps(s, hw, cl, 1, 2) == doctest::Approx(50.0));  // a GPU's NIC: 400 GB/s / 8
  // One p2p message: the (B, T, C) activation each tensor-parallel rank sends, 1,572,864 B.
  std::vector<StepCosts> c;
  for (int64_t i = 0; i < 4; ++i) c.push_back(gpt2_costs(s, i));
  CHECK(c[1].p2p_bytes == kAct);
  CHECK(stage_pass(c[0], s, hw, cl).p2p == doctest::Approx(kAct / kNvlink));
  CHECK(stage_pass(c[1], s, hw, cl).p2p == doctest::Approx(kAct / kNic));  // its send crosses
  CHECK(stage_pass(c[2], s, hw, cl).p2p == doctest::Approx(kAct / kNic));  // its receive
  CHECK(stage_pass(c[3], s, hw, cl).p2p == doctest::Approx(kAct / kNvlink));
  // 1F1B waits for the exchange: it adds to each pass.
  double fwd = 0;
  for (std::size_t g = 0; g < c[1].group_params.size(); ++g) fwd += pass_seconds(c[1], s, hw, cl, g, true).total();
  CHECK(stage_pass(c[1], s, hw, cl).forward == doctest::Approx(fwd + kAct / kNic));
  // All stages in one node (one rank each): NVLink everywhere.
  Strategy one = s;
  one.mp = 1;
  one.dp = 1;
  CHECK_FALSE(pipeline_link_crosses_nodes(one, hw, Cluster{4, 1}, 1, 2));
  // Sequence parallelism sends the (B, T/t, C) shard: half.
  Strategy sp = s;
  sp.sp = true;
  CHECK(gpt2_costs(sp, 1).p2p_bytes == kAct / 2);
  // The data-parallel group: dp ranks at stride tp cp. tp 8 leaves one rank of each
  // data-parallel group per node: one NIC (50 GB/s); tp 1 fills the node (all 8 rails).
  CHECK(group_bus_gbps(hw, Cluster{16, 2}, 2, 8) == doctest::Approx(50.0));
  CHECK(group_bus_gbps(hw, Cluster{16, 2}, 16, 1) == doctest::Approx(400.0));
  CHECK(group_bus_gbps(hw, Cluster{16, 2}, 2, 2) == 450.0);  // stride 2, 2 ranks: in one node
}

TEST_CASE("pipeline: bad stage costs are refused by name") {
  Strategy s;
  s.pp = 4;
  s.grad_accum = 8;
  const Hardware hw = unit_hardware();
  auto st = uniform_stages(4, 1);
  CHECK(error_of([&] { simulate_pipeline({st[0], st[1]}, s, hw, Cluster{4, 1}); }).find("2 stages' costs for --pp 4") !=
        std::string::npos);
  std::swap(st[1], st[2]);
  CHECK(error_of([&] { simulate_pipeline(st, s, hw, Cluster{4, 1}); }).find("stage 2 of --pp 4") != std::string::npos);
  Strategy tp = s;
  tp.mp = 2;
  CHECK(error_of([&] { simulate_pipeline(uniform_stages(4, 1), tp, hw, Cluster{8, 1}); }).find("--tp 1 graph") !=
        std::string::npos);
  // Costs of a graph without context parallelism do not time a --cp strategy's exchanges.
  Strategy cp;
  cp.cp = 2;
  CHECK(error_of([&] { simulate(uniform_stages(1, 1)[0], cp, hw, Cluster{2, 1}); }).find("--cp 1 graph") !=
        std::string::npos);
}

TEST_CASE("context parallelism: the ring's key/value exchanges hide behind the attention, Ulysses' all-to-alls wait") {
  // GPT-2 small at T 1024, cp 2, flash attention: each rank holds 512 tokens. Ring: every block's
  // attention passes one key|value block of its 512 tokens, 1 x 512 x 2 x 12 heads x 64 x 2 bytes
  // = 1,572,864 bytes (kAct), cp - 1 = 1 time in forward, beside the attention's 2 B NH (T/cp) T
  // (HS + VS) = 2 x 12 x 512 x 1024 x 128 FLOPs; backward the block and its gradient (2 kAct)
  // beside the backward's 2.5 times those FLOPs.
  const auto m = zp::models::load_model("gpt2");
  Strategy s = gpt2_strategy(1, false);
  s.cp = 2;
  s.flash_attention = true;
  const StepCosts c = gpt2_costs(s);
  REQUIRE(c.cp == 2);
  const double attn_flops = 2.0 * 12 * 512 * 1024 * 128;
  for (std::size_t g = 1; g <= 12; ++g) {
    REQUIRE(c.cp_fwd[g].size() == 1);
    CHECK(c.cp_fwd[g][0].kind == CollectiveKind::ring_exchange);
    CHECK(c.cp_fwd[g][0].bytes == kAct);
    CHECK(c.cp_fwd[g][0].overlap_flops == attn_flops);
    REQUIRE(c.cp_bwd[g].size() == 1);
    CHECK(c.cp_bwd[g][0].bytes == 2 * kAct);
    CHECK(c.cp_bwd[g][0].overlap_flops == 2.5 * attn_flops);
  }
  CHECK(c.cp_fwd[0].empty());
  CHECK(c.cp_fwd[13].empty());
  const Hardware hw = h100();
  // One node: NVLink. Forward 1.572864e6 / 450e9 = 3.495 us against 1.610e9 / 514e12 = 3.133 us
  // of attention: 0.362 us exposed; backward 6.991 us against 7.833 us: hidden.
  const PassSeconds f = pass_seconds(c, resolve_for_model(s, m), hw, Cluster{2, 1}, 1, true);
  CHECK(f.cp == doctest::Approx(kAct / kNvlink));
  CHECK(f.cp_exposed == doctest::Approx(kAct / kNvlink - attn_flops / kFlops));
  const PassSeconds b = pass_seconds(c, resolve_for_model(s, m), hw, Cluster{2, 1}, 1, false);
  CHECK(b.cp == doctest::Approx(2 * kAct / kNvlink));
  CHECK(b.cp_exposed == 0);
  CHECK(f.total() == doctest::Approx(f.compute + f.cp_exposed));
  // tp 4, cp 2 on 8 GPUs over 2 nodes of 4: the pair of ranks 4 apart sits on two nodes, on one
  // of a node's 4 rails, 400 / 4 = 100 GB/s. Each rank has 3 of the 12 heads: a block of kAct / 4,
  // a quarter of the FLOPs. Forward 3.932 us against 0.783 us: 3.149 us exposed.
  Strategy wide = s;
  wide.mp = 4;
  const StepCosts cw = gpt2_costs(wide);
  REQUIRE(cw.cp_fwd[1].size() == 1);
  CHECK(cw.cp_fwd[1][0].bytes == kAct / 4);
  const PassSeconds fw = pass_seconds(cw, resolve_for_model(wide, m), hw, Cluster{8, 2}, 1, true);
  CHECK(fw.cp == doctest::Approx(kAct / 4 / 100e9));
  CHECK(fw.cp_exposed == doctest::Approx(kAct / 4 / 100e9 - attn_flops / 4 / kFlops));

  // DeepSpeed-Ulysses, cp 2: forward all-to-alls of q, k and v (3 C wide) and of the attention's
  // output (C wide), each 1 x 512 x w x 2 bytes before and 1 x 1024 x w/2 x 2 after:
  // 512 x 4 C x 2 = 2 kAct in all, (cp - 1)/cp = 1/2 of them over NVLink, nothing overlapped;
  // backward the same again.
  Strategy u = s;
  u.cp_kind = CpKind::ulysses;
  const StepCosts cu = gpt2_costs(u);
  double fwd_bytes = 0, bwd_bytes = 0;
  for (const TpCollective& k : cu.cp_fwd[1]) {
    CHECK(k.kind == CollectiveKind::all_to_all);
    CHECK(k.overlap_flops == 0);
    fwd_bytes += k.bytes;
  }
  for (const TpCollective& k : cu.cp_bwd[1]) bwd_bytes += k.bytes;
  CHECK(fwd_bytes == 2 * kAct);
  CHECK(bwd_bytes == 2 * kAct);
  const PassSeconds fu = pass_seconds(cu, resolve_for_model(u, m), hw, Cluster{2, 1}, 1, true);
  CHECK(fu.cp == doctest::Approx(2 * kAct / 2 / kNvlink));
  CHECK(fu.cp_exposed == fu.cp);
  // And a whole step runs: the exchanges make it slower than the same graph's without them.
  const Timeline t = simulate(c, resolve_for_model(s, m), hw, Cluster{2, 1});
  StepCosts quiet = c;
  for (auto& v : quiet.cp_fwd) v.clear();
  for (auto& v : quiet.cp_bwd) v.clear();
  CHECK(t.step_seconds > simulate(quiet, resolve_for_model(s, m), hw, Cluster{2, 1}).step_seconds);
}

TEST_CASE("fit's evaluator takes tensor, sequence and pipeline parallel strategies: memory as estimate(), steps as simulate_model") {
  const auto m = zp::models::load_model("gpt2");
  const Hardware hw = h100();
  const PlanOptions o{Profile::zeroplan, Backend::cuda, ModelCode::fused};
  // Pipelines of 4 stages differing only in the micro-batches in flight (m 2: 2 on stage 0;
  // m 8: 4), sequence parallelism, interleaving: one evaluator, each as estimate() has it.
  std::vector<Strategy> ss;
  for (int64_t ga : {2, 8}) {
    Strategy s = gpt2_strategy(2, false);
    s.stage = 1;
    s.dp = 2;
    s.pp = 4;
    s.grad_accum = ga;
    ss.push_back(resolve_for_model(s, m));
  }
  Strategy sp = ss[1];
  sp.sp = true;
  ss.push_back(sp);
  Strategy vp = ss[1];
  vp.vp = 3;
  vp.pp_schedule = PipelineSchedule::interleaved;
  ss.push_back(vp);
  ss.push_back(resolve_for_model(gpt2_strategy(2, true), m));  // sp without a pipeline
  FitEvaluator ev(m, o);
  const Cluster cl{16, 2};
  const std::vector<Candidate> c = ev.evaluate(ss, hw, cl, 2, false);
  REQUIRE(c.size() == ss.size());
  for (std::size_t i = 0; i < ss.size(); ++i) {
    CAPTURE(describe(ss[i]));
    const Estimate e = estimate(m, ss[i], &hw, o);
    CHECK(c[i].per_device == e.per_device);
    CHECK(c[i].shortfalls == e.shortfalls);
    const Timeline t = simulate_model(m, ss[i], hw, cl, o);
    CHECK(c[i].step_seconds == doctest::Approx(t.step_seconds).epsilon(1e-12));
    CHECK(c[i].tokens_per_second == doctest::Approx(t.tokens_per_second).epsilon(1e-12));
  }
  CHECK(c[0].per_device.peak(Tier::gpu) < c[1].per_device.peak(Tier::gpu));  // 2 in flight, not 4
  // More micro-batches amortize the bubble: (m + p - 1) / m passes' worth per micro-batch.
  CHECK(c[1].tokens_per_second > c[0].tokens_per_second);
}
