// zp/planner/pipeline.hpp: pipeline-parallel schedules. The order in which each pipeline stage
// runs its forward and backward passes (GPipe, 1F1B, interleaved 1F1B), an event-driven timing
// of that order (makespan, per-stage busy and idle time, the bubble), and the number of
// micro-batches whose activations each stage holds at once ("in flight").
// Not a memory model (a stage's bytes are in flight x a micro-batch's activations, which the
// graph sizes) and not a network model (a send is one fixed latency, t_p2p).
//
// Example usage:
//   auto order = pipeline_order(PipelineSchedule::one_f_one_b, /*p=*/4, /*m=*/8, /*v=*/1);
//   PipelineTiming t = time_pipeline(order, 4, 1, /*t_forward=*/1.0, /*t_backward=*/2.0);
//   // t.makespan == (8 + 4 - 1) * 3.0; t.in_flight == {4, 3, 2, 1}
//   int64_t first = in_flight_closed_form(PipelineSchedule::one_f_one_b, 4, 8, 1, /*stage=*/0);
//
// Letters, as Narayanan et al. 2021 use them: p pipeline stages (ranks, --pp), m micro-batches
// per optimizer step (--grad-accum), v model chunks per rank (virtual stages, --vp); a stage
// holds L/p layers, a chunk L/(p v). Position of chunk c on stage s in the model: c*p + s.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace zp::planner {

// gpipe: all forwards, then all backwards (Huang et al. 2019, "GPipe", sec. 2.2, fig. 2c).
// one_f_one_b ("1f1b"): PipeDream-Flush as Megatron-LM runs it (Narayanan et al. 2021 sec.
//   2.2.1; megatron/core/pipeline_parallel/schedules.py
//   forward_backward_pipelining_without_interleaving).
// interleaved: interleaved 1F1B with v model chunks per rank (Narayanan et al. 2021 sec.
//   2.2.2; schedules.py forward_backward_pipelining_with_interleaving).
enum class PipelineSchedule { gpipe, one_f_one_b, interleaved };

std::string_view to_string(PipelineSchedule s);  // "gpipe", "1f1b", "interleaved"
std::optional<PipelineSchedule> pipeline_schedule_from_string(std::string_view s);

// One pass of one micro-batch through one model chunk of a stage.
struct PipelinePass {
  int64_t microbatch = 0;  // 0 .. m-1
  int64_t chunk = 0;       // 0 .. v-1 (0 without interleaving)
  bool forward = true;
  bool operator==(const PipelinePass&) const = default;
};

// order[s]: the passes stage s runs, in the order it runs them (2 m v each).
using PipelineOrder = std::vector<std::vector<PipelinePass>>;

// Checks p, m, v for schedule s; zp::Error naming --pp, --vp or --grad-accum (micro-batches)
// with a hint otherwise. pipeline_order and in_flight_closed_form call it.
void validate_pipeline(PipelineSchedule s, int64_t p, int64_t m, int64_t v);

// The order each stage runs its passes; see pipeline.cpp for each schedule's rule and source.
// Requires p >= 1, m >= 1; v == 1 except interleaved, which needs v >= 2, p >= 2 and m a
// multiple of p (Megatron's default microbatch_group_size_per_vp_stage = p). Refuses orders
// of more than 2^24 passes in all (use in_flight_closed_form for large searches).
PipelineOrder pipeline_order(PipelineSchedule s, int64_t p, int64_t m, int64_t v);

// Per stage, the largest number of (micro-batch, chunk) forwards whose backward has not yet
// run, counted along the stage's own order: the activations it holds at its peak.
std::vector<int64_t> in_flight(const PipelineOrder& order);

// The same count from formulas alone (O(1), for the fit search); stage in [0, p):
//   gpipe:       m                                       (every forward precedes every backward)
//   1f1b:        min(p - stage, m)                       (Narayanan et al. 2021 sec. 2.2.1)
//   interleaved: min(2 (p - stage - 1) + (v - 1) p + 1, m v) chunks
//                (Megatron's warmup count plus the steady state's one forward; on stage 0
//                 that is v p + p - 1 chunks = theoretical_memory_usage.py's penalty
//                 1 + (p - 1) / (p v) times p micro-batches of the stage's L/p layers)
int64_t in_flight_closed_form(PipelineSchedule s, int64_t p, int64_t m, int64_t v, int64_t stage);

// The timing of an order when every chunk takes t_forward / t_backward per micro-batch on
// every stage (time_pipeline's doc in pipeline.cpp has the dependencies).
struct PipelineTiming {
  double makespan = 0;             // first forward's start to the last backward's end
  std::vector<double> busy;        // per stage: sum of its passes' times
  std::vector<double> idle;        // per stage: makespan - busy
  double bubble_time = 0;          // mean idle over stages
  double bubble_fraction = 0;      // bubble_time / makespan
  double bubble_over_ideal = 0;    // bubble_time / mean busy: Narayanan et al.'s (p-1)/m
  std::vector<int64_t> in_flight;  // per stage, as in_flight(order)
  std::vector<double> end;         // per stage: when its last pass ends
};

// Runs each stage's list in order; a pass starts when its stage is free and its dependency
// has ended (plus t_p2p when the dependency ran on another stage):
//   forward (mb, c) on stage s waits for the forward of (mb) at the previous position: stage
//     s-1, chunk c; for s = 0 and c > 0, stage p-1, chunk c-1; none for s = 0, c = 0.
//   backward (mb, c) on stage s waits for the backward at the next position: stage s+1, chunk
//     c; for s = p-1 and c < v-1, stage 0, chunk c+1; for the last position (s = p-1,
//     c = v-1), its own forward.
// zp::Error when the order is malformed (a stage count other than p, a chunk outside [0, v))
// or deadlocks (a stage waits on a pass that waits on it).
PipelineTiming time_pipeline(const PipelineOrder& order, int64_t p, int64_t v, double t_forward,
                             double t_backward, double t_p2p = 0);
// The same with stages of their own speeds: stage s's chunks take t_forward[s] / t_backward[s]
// per micro-batch (p entries each).
PipelineTiming time_pipeline(const PipelineOrder& order, int64_t p, int64_t v,
                             const std::vector<double>& t_forward,
                             const std::vector<double>& t_backward, double t_p2p = 0);

// The makespan of schedule s from formulas alone (O(p), for the fit search and the step-time
// simulator), when stage i takes f_i forward and b_i backward per micro-batch (all its v chunks
// together, each chunk f_i / v and b_i / v):
//   gpipe:       sum f + sum b + (m - 1)(max f + max b)
//   1f1b:        sum (f + b) + (m - 1) max (f + b)
//   interleaved: (sum (f + b) + (m v - 1) max (f + b)) / v
// and stage i's last pass ends at makespan - (b_0 + ... + b_{i-1}) / v (stage 0 ends last:
// the last micro-batch's backward walks back to it).
// With equal stages these are Narayanan et al. 2021's (m + p - 1)(f + b) (sec. 2.2.1; GPipe's
// too, Huang et al. 2019's bubble (K - 1)/(M + K - 1)) and (m v + p - 1)(f + b) / v (sec.
// 2.2.2). They equal time_pipeline on pipeline_order exactly for GPipe whatever the stages
// (two flow shops of identical jobs in a row), and for 1F1B and interleaving whenever one
// stage is the slowest both forward and backward (equal stages; a last stage that also holds
// the head, a first that holds the embedding). Over random stage times (forward 0.5-2,
// backward 1-4 times it; p 2-8, m 1-32, v 2-4) 1F1B's is an upper bound at most 20% long,
// the interleaved one within 10% either way (test_simulate_parallel.cpp). Checks p, m, v as
// pipeline_order does.
struct PipelineMakespan {
  double makespan = 0;
  std::vector<double> end;  // per stage: when its last pass ends
};
PipelineMakespan makespan_closed_form(PipelineSchedule s, int64_t p, int64_t m, int64_t v,
                                      const std::vector<double>& t_forward,
                                      const std::vector<double>& t_backward);

}  // namespace zp::planner
