// Pipeline schedules: each stage's pass order drawn by hand from the papers and Megatron-LM's
// code (written out literally below), in-flight micro-batches against Narayanan et al. 2021 and
// Megatron's theoretical_memory_usage.py, makespans against the bubble formulas and against
// timelines drawn by hand, and bad input refused.
//
// Notation in the strings: "F3" is micro-batch 3's forward, "B3" its backward; with model
// chunks, "F3.1" is micro-batch 3 on chunk 1. p stages, m micro-batches, v chunks per stage.
#include <doctest/doctest.h>

#include <cmath>
#include <sstream>
#include <string>

#include "zp/error.hpp"
#include "zp/planner/pipeline.hpp"

using namespace zp::planner;

namespace {

// "F0 F1.1 B0" -> passes; the chunk is 0 when no ".c" is written.
std::vector<PipelinePass> passes(const std::string& text) {
  std::vector<PipelinePass> out;
  std::istringstream in(text);
  std::string tok;
  while (in >> tok) {
    REQUIRE((tok[0] == 'F' || tok[0] == 'B'));
    const auto dot = tok.find('.');
    PipelinePass x;
    x.forward = tok[0] == 'F';
    x.microbatch = std::stoll(tok.substr(1, dot == std::string::npos ? std::string::npos : dot - 1));
    x.chunk = dot == std::string::npos ? 0 : std::stoll(tok.substr(dot + 1));
    out.push_back(x);
  }
  return out;
}

PipelineOrder order_of(const std::vector<std::string>& stages) {
  PipelineOrder o;
  for (const auto& s : stages) o.push_back(passes(s));
  return o;
}

// The message and hint of the zp::Error fn throws ("" and "" if it throws none).
template <typename Fn>
std::pair<std::string, std::string> error_of(Fn fn) {
  try {
    fn();
  } catch (const zp::Error& e) {
    return {e.what(), e.hint()};
  }
  return {"", ""};
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("schedule names") {
  CHECK(to_string(PipelineSchedule::gpipe) == "gpipe");
  CHECK(to_string(PipelineSchedule::one_f_one_b) == "1f1b");
  CHECK(to_string(PipelineSchedule::interleaved) == "interleaved");
  for (auto s : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b,
                 PipelineSchedule::interleaved})
    CHECK(pipeline_schedule_from_string(to_string(s)) == s);
  CHECK_FALSE(pipeline_schedule_from_string("1F1B").has_value());
  CHECK_FALSE(pipeline_schedule_from_string("pipedream").has_value());
}

// GPipe (Huang et al. 2019 sec. 2.2, fig. 2c): all m forwards, then all m backwards, on every
// stage; backwards in micro-batch order as torch.distributed.pipelining's ScheduleGPipe runs
// them. p = 2, m = 4:
//   stage 0: F0 F1 F2 F3 B0 B1 B2 B3
//   stage 1: F0 F1 F2 F3 B0 B1 B2 B3
TEST_CASE("GPipe p=2 m=4: the order drawn by hand") {
  const auto o = pipeline_order(PipelineSchedule::gpipe, 2, 4, 1);
  CHECK(o == order_of({"F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3"}));
  // All m = 4 forwards precede the first backward: 4 held on each stage.
  CHECK(in_flight(o) == std::vector<int64_t>{4, 4});
}

// 1F1B as Megatron-LM's forward_backward_pipelining_without_interleaving runs stage s:
// warmup W = min(p - s - 1, m) forwards, then m - W times (forward W+i, backward i), then the
// W last backwards. p = 2, m = 4: W = 1 on stage 0, 0 on stage 1:
//   stage 0: F0 | F1 B0 | F2 B1 | F3 B2 | B3
//   stage 1:    | F0 B0 | F1 B1 | F2 B2 | F3 B3
TEST_CASE("1F1B p=2 m=4: the order drawn by hand") {
  const auto o = pipeline_order(PipelineSchedule::one_f_one_b, 2, 4, 1);
  CHECK(o == order_of({"F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"}));
  // Stage 0 holds F0, F1 before B0: 2 = min(p - 0, m); stage 1 one: 1 = min(p - 1, m).
  CHECK(in_flight(o) == std::vector<int64_t>{2, 1});
}

// p = 4, m = 8: W = 3, 2, 1, 0 on stages 0..3.
//   stage 0: F0 F1 F2 | F3 B0 | F4 B1 | F5 B2 | F6 B3 | F7 B4 | B5 B6 B7
//   stage 1: F0 F1    | F2 B0 | F3 B1 | F4 B2 | F5 B3 | F6 B4 | F7 B5 | B6 B7
//   stage 2: F0       | F1 B0 | F2 B1 | F3 B2 | F4 B3 | F5 B4 | F6 B5 | F7 B6 | B7
//   stage 3:          | F0 B0 | F1 B1 | F2 B2 | F3 B3 | F4 B4 | F5 B5 | F6 B6 | F7 B7
TEST_CASE("1F1B p=4 m=8: the order drawn by hand") {
  const auto o = pipeline_order(PipelineSchedule::one_f_one_b, 4, 8, 1);
  CHECK(o == order_of({"F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
                       "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
                       "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
                       "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"}));
  // Narayanan et al. 2021 sec. 2.2.1: PipeDream-Flush keeps at most p micro-batches in flight;
  // stage i holds min(p - i, m) = 4, 3, 2, 1 (warmup W plus the steady state's one forward).
  CHECK(in_flight(o) == std::vector<int64_t>{4, 3, 2, 1});
}

// Interleaved 1F1B as Megatron-LM's forward_backward_pipelining_with_interleaving runs it,
// p = 2, m = 4, v = 2 (microbatch_group_size_per_vp_stage n = p = 2).
// get_schedule_table: groups of n micro-batches, chunk 0 then chunk 1 over each group:
//   k           0   1   2   3   4   5   6   7
//   (mb, chunk) 0.0 1.0 0.1 1.1 2.0 3.0 2.1 3.1
// (model_parallel_config.py's docstring for PP=2 VP=2, group size 2, m = 4 shows the same
// micro-batch sequence: "rank 0 | 0 1 0 1 2 3 2 3".)
// Forward k is table[k]; backward k is table[k]'s micro-batch on chunk v-1-chunk
// (get_model_chunk_id(k, forward=False)). Warmup W = 2 (p - s - 1) + (v - 1) n, capped at m v:
//   stage 0: W = 2*1 + 1*2 = 4: F(0..3); then F(4) B(0), F(5) B(1), F(6) B(2), F(7) B(3);
//            then B(4..7)
//     F0.0 F1.0 F0.1 F1.1 | F2.0 B0.1 | F3.0 B1.1 | F2.1 B0.0 | F3.1 B1.0 | B2.1 B3.1 B2.0 B3.0
//   stage 1: W = 2*0 + 1*2 = 2: F(0..1); then F(k+2) B(k) for k = 0..5; then B(6), B(7)
//     F0.0 F1.0 | F0.1 B0.1 | F1.1 B1.1 | F2.0 B0.0 | F3.0 B1.0 | F2.1 B2.1 | F3.1 B3.1 | B2.0 B3.0
TEST_CASE("interleaved 1F1B p=2 m=4 v=2: the order drawn by hand") {
  const auto o = pipeline_order(PipelineSchedule::interleaved, 2, 4, 2);
  CHECK(o == order_of({"F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 "
                       "B2.1 B3.1 B2.0 B3.0",
                       "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 "
                       "F3.1 B3.1 B2.0 B3.0"}));
  // Stage 0 holds its 4 warmup chunks plus F2.0 before B0.1: 5 (micro-batch, chunk) pairs;
  // stage 1 its 2 plus F0.1: 3.
  CHECK(in_flight(o) == std::vector<int64_t>{5, 3});
  // The forwards' micro-batches on each stage: Megatron's docstring "0 1 0 1 2 3 2 3".
  for (const auto& stage : o) {
    std::vector<int64_t> fwd;
    for (const auto& x : stage)
      if (x.forward) fwd.push_back(x.microbatch);
    CHECK(fwd == std::vector<int64_t>{0, 1, 0, 1, 2, 3, 2, 3});
  }
}

TEST_CASE("in flight: GPipe holds m, 1F1B min(p - i, m)") {
  // GPipe: every forward precedes every backward, so each stage holds all m.
  for (int64_t p : {1, 2, 4})
    for (int64_t m : {1, 3, 8}) {
      CAPTURE(p);
      CAPTURE(m);
      CHECK(in_flight(pipeline_order(PipelineSchedule::gpipe, p, m, 1)) ==
            std::vector<int64_t>(static_cast<size_t>(p), m));
    }
  // 1F1B with fewer micro-batches than stages, p = 4, m = 2: min(4, 2), min(3, 2), min(2, 2),
  // min(1, 2) = 2, 2, 2, 1 (Megatron caps the warmup at m: all of stage 0's and 1's forwards
  // run before their backwards). theoretical_memory_usage.py compute_activation_memory counts
  // min(m, p) = 2 on stage 0, the same.
  CHECK(in_flight(pipeline_order(PipelineSchedule::one_f_one_b, 4, 2, 1)) ==
        std::vector<int64_t>{2, 2, 2, 1});
}

// Megatron-LM's megatron/training/theoretical_memory_usage.py, compute_activation_memory,
// sizes stage 0's activations as p micro-batches of the stage's L/p layers (num_layers x one
// micro-batch) times interleaved_schedule_memory_penalty = 1 + (p - 1) / (p v). In chunks of
// L/(p v) layers that is p v (1 + (p - 1)/(p v)) = p v + p - 1.
TEST_CASE("in flight: interleaved stage 0 equals Megatron's theoretical memory accounting") {
  struct Case {
    int64_t p, m, v;
  };
  for (const Case c : {Case{2, 4, 2}, Case{4, 8, 2}, Case{4, 8, 3}, Case{8, 16, 4}}) {
    CAPTURE(c.p);
    CAPTURE(c.v);
    const double penalty = 1.0 + static_cast<double>(c.p - 1) / static_cast<double>(c.p * c.v);
    const double chunks = penalty * static_cast<double>(c.p) * static_cast<double>(c.v);
    const auto f = in_flight(pipeline_order(PipelineSchedule::interleaved, c.p, c.m, c.v));
    CHECK(static_cast<double>(f[0]) == doctest::Approx(chunks).epsilon(1e-12));
  }
  // Written out, p = 2, v = 2: penalty 1 + 1/4 = 1.25, x p = 2.5 micro-batches of L/2 layers
  // = 2.5 x 2 = 5 chunks; p = 4, v = 2: 1 + 3/8 = 1.375, x 4 = 5.5, x 2 = 11 chunks.
  CHECK(in_flight(pipeline_order(PipelineSchedule::interleaved, 2, 4, 2))[0] == 5);
  // The other stages, from Megatron's warmup count W = 2 (p - s - 1) + (v - 1) p plus the
  // steady state's forward, p = 4, m = 8, v = 2: s = 0: 6 + 4 + 1 = 11; s = 1: 4 + 4 + 1 = 9;
  // s = 2: 2 + 4 + 1 = 7; s = 3: 0 + 4 + 1 = 5.
  CHECK(in_flight(pipeline_order(PipelineSchedule::interleaved, 4, 8, 2)) ==
        std::vector<int64_t>{11, 9, 7, 5});
  // m = p: the warmup covers all m v passes on stage 0 (W = 2*1 + 1*2 = 4 = m v for p 2, m 2,
  // v 2), which then holds all 4; stage 1: W = 2, holds 3.
  CHECK(in_flight(pipeline_order(PipelineSchedule::interleaved, 2, 2, 2)) ==
        std::vector<int64_t>{4, 3});
}

TEST_CASE("in flight: the closed form equals the count along the order") {
  int64_t checked = 0;
  for (int64_t p = 1; p <= 8; ++p)
    for (int64_t m = 1; m <= 32; ++m) {
      for (auto s : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
        const auto f = in_flight(pipeline_order(s, p, m, 1));
        for (int64_t i = 0; i < p; ++i) {
          CAPTURE(p);
          CAPTURE(m);
          CAPTURE(i);
          CHECK(in_flight_closed_form(s, p, m, 1, i) == f[static_cast<size_t>(i)]);
          ++checked;
        }
      }
      for (int64_t v = 2; v <= 4; ++v) {
        if (p < 2 || m % p != 0) continue;  // refused (the "bad input" case below)
        const auto f = in_flight(pipeline_order(PipelineSchedule::interleaved, p, m, v));
        for (int64_t i = 0; i < p; ++i) {
          CAPTURE(p);
          CAPTURE(m);
          CAPTURE(v);
          CAPTURE(i);
          CHECK(in_flight_closed_form(PipelineSchedule::interleaved, p, m, v, i) ==
                f[static_cast<size_t>(i)]);
          ++checked;
        }
      }
    }
  // 2 schedules x sum_{p=1..8} 32 p = 2 x 32 x 36 = 2304; interleaved: p = 2..8, the m in
  // 1..32 divisible by p (16, 10, 8, 6, 5, 4, 4), 3 values of v, p stages each:
  // 3 x (2*16 + 3*10 + 4*8 + 5*6 + 6*5 + 7*4 + 8*4) = 3 x 214 = 642.
  CHECK(checked == 2304 + 642);
}

// 1F1B, p = 2, m = 4, t_f = 1, t_b = 2, drawn by hand (each pass starts when its stage is free
// and its dependency has ended):
//   stage 0: F0 [0,1] F1 [1,2] . B0 [4,6] (after stage 1's B0) F2 [6,7] B1 [7,9] F3 [9,10]
//            B2 [10,12] . B3 [13,15]
//   stage 1: . F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] F2 [7,8] B2 [8,10] F3 [10,11] B3 [11,13]
// makespan 15 = (m + p - 1)(t_f + t_b) = 5 x 3; each stage busy 4 x 3 = 12, idle 3.
TEST_CASE("1F1B p=2 m=4: the timeline drawn by hand") {
  const auto t = time_pipeline(pipeline_order(PipelineSchedule::one_f_one_b, 2, 4, 1), 2, 1,
                               1.0, 2.0);
  CHECK(t.makespan == 15.0);
  CHECK(t.busy == std::vector<double>{12.0, 12.0});
  CHECK(t.idle == std::vector<double>{3.0, 3.0});
  CHECK(t.bubble_time == 3.0);
  CHECK(t.bubble_fraction == doctest::Approx(3.0 / 15.0));
  CHECK(t.bubble_over_ideal == doctest::Approx(3.0 / 12.0));  // (p - 1)/m = 1/4
  CHECK(t.in_flight == std::vector<int64_t>{2, 1});
}

// Interleaved, p = 2, m = 4, v = 2, per-chunk t_f = 1, t_b = 2, drawn by hand along the orders
// above (positions: stage 0 chunk 0, stage 1 chunk 0, stage 0 chunk 1, stage 1 chunk 1):
//   stage 1: F0.0 [1,2] F1.0 [2,3] F0.1 [3,4] B0.1 [4,6] F1.1 [6,7] B1.1 [7,9] F2.0 [9,10]
//            B0.0 [10,12] F3.0 [12,13] B1.0 [13,15] F2.1 [15,16] B2.1 [16,18] F3.1 [18,19]
//            B3.1 [19,21] B2.0 [21,23] B3.0 [23,25]
//   stage 0: F0.0 [0,1] F1.0 [1,2] F0.1 [2,3] F1.1 [3,4] F2.0 [4,5] B0.1 [6,8] F3.0 [8,9]
//            B1.1 [9,11] F2.1 [11,12] B0.0 [12,14] F3.1 [14,15] B1.0 [15,17] B2.1 [18,20]
//            B3.1 [21,23] B2.0 [23,25] B3.0 [25,27]
// makespan 27 = (m v + p - 1)(t_f + t_b) = 9 x 3; busy 8 x 3 = 24 per stage; bubble 3 =
// (p - 1)(t_f + t_b) per chunk = (p - 1)(T_f + T_b)/v with the stage's T = v t = 2, 4
// (Narayanan et al. 2021 sec. 2.2.2: 1 x 6 / 2 = 3).
TEST_CASE("interleaved p=2 m=4 v=2: the timeline drawn by hand") {
  const auto t = time_pipeline(pipeline_order(PipelineSchedule::interleaved, 2, 4, 2), 2, 2,
                               1.0, 2.0);
  CHECK(t.makespan == 27.0);
  CHECK(t.busy == std::vector<double>{24.0, 24.0});
  CHECK(t.idle == std::vector<double>{3.0, 3.0});
  CHECK(t.in_flight == std::vector<int64_t>{5, 3});
}

// With a send time c per cross-stage hop, by hand:
//   GPipe p = 2, m = 1, t_f = 1, t_b = 2, c = 0.5: F0 on stage 0 [0,1], on stage 1 [1.5,2.5],
//   B0 on stage 1 [2.5,4.5] (its own forward, no hop), on stage 0 [5,7]: 7 = 2 x 3 + 2 x 0.5.
//   1F1B p = 2, m = 2, same times: stage 0 F0 [0,1], F1 [1,2]; stage 1 F0 [1.5,2.5],
//   B0 [2.5,4.5], F1 [4.5,5.5] (stage 0's F1 arrived at 2.5), B1 [5.5,7.5]; stage 0 B0 [5,7],
//   B1 [8,10]: 10.
TEST_CASE("send time per hop, drawn by hand") {
  CHECK(time_pipeline(pipeline_order(PipelineSchedule::gpipe, 2, 1, 1), 2, 1, 1.0, 2.0, 0.5)
            .makespan == 7.0);
  const auto t =
      time_pipeline(pipeline_order(PipelineSchedule::one_f_one_b, 2, 2, 1), 2, 1, 1.0, 2.0, 0.5);
  CHECK(t.makespan == 10.0);
  CHECK(t.busy == std::vector<double>{6.0, 6.0});
  CHECK(t.idle == std::vector<double>{4.0, 4.0});
}

// Narayanan et al. 2021 sec. 2.2.1: GPipe's and PipeDream-Flush's bubble is (p - 1)(t_f + t_b)
// per step, a fraction (p - 1)/m of the ideal m (t_f + t_b); sec. 2.2.2: interleaving with v
// chunks divides it by v: (p - 1)(T_f + T_b)/v with whole-stage times T = v t, i.e. (p - 1)
// (t_f + t_b) in per-chunk times, against an ideal m v (t_f + t_b). Our event timing gives
// these exactly (not only asymptotically) for every case below, equal stages and no send time.
TEST_CASE("makespan: the bubble formulas of Narayanan et al. 2021") {
  struct Times {
    double f, b;
  };
  for (const Times tt : {Times{1, 2}, Times{1, 1}, Times{2, 1}, Times{0.5, 1.5}}) {
    const double tfb = tt.f + tt.b;
    for (int64_t p = 1; p <= 8; ++p)
      for (int64_t m = 1; m <= 32; ++m) {
        CAPTURE(p);
        CAPTURE(m);
        for (auto s : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
          const auto t = time_pipeline(pipeline_order(s, p, m, 1), p, 1, tt.f, tt.b);
          const double mm = static_cast<double>(m), pp = static_cast<double>(p);
          CHECK(t.makespan == doctest::Approx((mm + pp - 1) * tfb));
          CHECK(t.bubble_time == doctest::Approx((pp - 1) * tfb));
          CHECK(t.bubble_over_ideal == doctest::Approx((pp - 1) / mm));
          CHECK(t.bubble_fraction == doctest::Approx((pp - 1) / (mm + pp - 1)));
        }
        for (int64_t v = 2; v <= 4; ++v) {
          if (p < 2 || m % p != 0) continue;
          CAPTURE(v);
          const auto t =
              time_pipeline(pipeline_order(PipelineSchedule::interleaved, p, m, v), p, v, tt.f,
                            tt.b);
          const double mv = static_cast<double>(m * v), pp = static_cast<double>(p);
          // Whole-stage times T = v t: bubble (p - 1)(T_f + T_b)/v.
          const double big_tfb = static_cast<double>(v) * tfb;
          CHECK(t.bubble_time == doctest::Approx((pp - 1) * big_tfb / static_cast<double>(v)));
          CHECK(t.makespan == doctest::Approx((mv + pp - 1) * tfb));
          CHECK(t.bubble_over_ideal ==
                doctest::Approx((pp - 1) / (static_cast<double>(m) * static_cast<double>(v))));
        }
      }
  }
}

TEST_CASE("bad input is refused, naming the flag") {
  using S = PipelineSchedule;
  struct Case {
    S s;
    int64_t p, m, v;
    const char* flag;
  };
  for (const Case c : {Case{S::one_f_one_b, 0, 4, 1, "--pp"},
                       Case{S::gpipe, -2, 4, 1, "--pp"},
                       Case{S::one_f_one_b, 4, 0, 1, "--grad-accum"},
                       Case{S::gpipe, 4, 1, 0, "--vp"},
                       Case{S::one_f_one_b, 4, 8, 2, "--vp"},      // chunks without interleaving
                       Case{S::gpipe, 4, 8, 2, "--vp"},
                       Case{S::interleaved, 4, 8, 1, "--vp"},      // Megatron runs this as 1F1B
                       Case{S::interleaved, 1, 8, 2, "--pp"},      // one stage: nothing to interleave
                       Case{S::interleaved, 4, 6, 2, "--grad-accum"},  // 6 % 4 != 0
                       Case{S::interleaved, 4, 2, 2, "--grad-accum"}}) {  // m < p
    CAPTURE(to_string(c.s));
    CAPTURE(c.p);
    CAPTURE(c.m);
    CAPTURE(c.v);
    const auto [msg, hint] = error_of([&] { pipeline_order(c.s, c.p, c.m, c.v); });
    CHECK(contains(msg, c.flag));
    CHECK_FALSE(hint.empty());
    CHECK(error_of([&] { in_flight_closed_form(c.s, c.p, c.m, c.v, 0); }).first == msg);
  }
  // The interleaved refusal of m = 6 on p = 4 suggests the next multiple of p, 8.
  CHECK(contains(error_of([] { pipeline_order(S::interleaved, 4, 6, 2); }).second,
                 "--grad-accum 8"));
  // A stage outside [0, p).
  CHECK(contains(error_of([] { in_flight_closed_form(S::one_f_one_b, 4, 8, 1, 4); }).first,
                 "--pp 4"));
  CHECK_THROWS_AS(in_flight_closed_form(S::one_f_one_b, 4, 8, 1, -1), zp::Error);
  // Too many passes to draw: 2 x 4096 x 4096 x 1 > 2^24.
  CHECK(contains(error_of([] { pipeline_order(S::gpipe, 4096, 4096, 1); }).first, "--pp 4096"));
}

TEST_CASE("malformed orders are refused by the timing") {
  // Stage count other than p.
  CHECK(contains(error_of([] {
                   time_pipeline(order_of({"F0 B0"}), 2, 1, 1, 1);
                 }).first,
                 "--pp is 2"));
  // A chunk outside [0, v).
  CHECK(contains(error_of([] {
                   time_pipeline(order_of({"F0.1 B0.1"}), 1, 1, 1, 1);
                 }).first,
                 "--vp 1"));
  // A stage that runs a pass twice and another not at all.
  CHECK_THROWS_AS(time_pipeline(order_of({"F0 F1 B0 B0", "F0 B0 F1 B1"}), 2, 1, 1, 1),
                  zp::Error);
  // Deadlock: stage 0 runs B0 first, which waits on stage 1's B0, which waits on stage 1's F0,
  // which waits on stage 0's F0, queued behind B0.
  CHECK(contains(error_of([] {
                   time_pipeline(order_of({"B0 F0", "F0 B0"}), 2, 1, 1, 1);
                 }).first,
                 "deadlock"));
  // Negative and non-finite times.
  CHECK_THROWS_AS(time_pipeline(order_of({"F0 B0"}), 1, 1, -1, 1), zp::Error);
  CHECK_THROWS_AS(time_pipeline(order_of({"F0 B0"}), 1, 1, 1, 1, std::nan("")), zp::Error);
}
