// pipeline.cpp: the per-stage pass orders of GPipe, 1F1B and interleaved 1F1B, their timing by
// events, and the in-flight micro-batch counts (from an order, and in closed form).
#include "zp/planner/pipeline.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "zp/checked.hpp"
#include "zp/error.hpp"

namespace zp::planner {

namespace {

constexpr std::array<std::pair<std::string_view, PipelineSchedule>, 3> kSchedules = {
    {{"gpipe", PipelineSchedule::gpipe},
     {"1f1b", PipelineSchedule::one_f_one_b},
     {"interleaved", PipelineSchedule::interleaved}}};

// pipeline_order materialises 2 p m v passes; a fit search over large (p, m, v) uses
// in_flight_closed_form instead.
constexpr int64_t kMaxPasses = int64_t{1} << 24;

// Megatron-LM's schedule table for the interleaved schedule (schedules.py get_schedule_table):
// the k-th "virtual micro-batch" a rank runs forward is (micro-batch, chunk) with micro-batches
// taken in groups of n (microbatch_group_size_per_vp_stage); inside a group, chunk 0 runs the
// group's micro-batches, then chunk 1, ..., then chunk v-1; the last group absorbs the rest.
// Example (the comment in forward_backward_pipelining_with_interleaving), p 2, n 3, m 5, v 2:
//   k          0 1 2 3 4 5 6 7 8 9
//   microbatch 0 1 2 0 1 2 3 4 3 4
//   chunk      0 0 0 1 1 1 0 0 1 1
std::vector<std::pair<int64_t, int64_t>> schedule_table(int64_t m, int64_t v, int64_t n) {
  std::vector<std::pair<int64_t, int64_t>> table;
  table.reserve(static_cast<size_t>(m * v));
  for (int64_t first = 0; first < m; first += n) {
    const int64_t last = first + n >= m ? m : first + n;  // the last group takes the rest
    for (int64_t c = 0; c < v; ++c)
      for (int64_t mb = first; mb < last; ++mb) table.emplace_back(mb, c);
    if (last == m) break;
  }
  return table;
}

// Forward passes a stage runs before its first backward (its warmup), and the formulas'
// sources:
//   1f1b: min(p - s - 1, m) (schedules.py forward_backward_pipelining_without_interleaving:
//     num_warmup_microbatches = total_stages - current_stage - 1, capped at num_microbatches).
//   interleaved: min(2 (p - s - 1) + (v - 1) n, m v) with n = microbatch_group_size_per_vp_stage
//     = p by default (schedules.py get_pp_rank_microbatches; model_parallel_config.py
//     __post_init__ sets the group size to pipeline_model_parallel_size when unset).
int64_t warmup_1f1b(int64_t p, int64_t m, int64_t s) { return std::min(p - s - 1, m); }
int64_t warmup_interleaved(int64_t p, int64_t m, int64_t v, int64_t s) {
  const int64_t raw = checked_add(checked_mul(int64_t{2}, p - s - 1, "pipeline warmup"),
                                  checked_mul(v - 1, p, "pipeline warmup"), "pipeline warmup");
  return std::min(raw, checked_mul(m, v, "micro-batches x --vp"));
}

}  // namespace

std::string_view to_string(PipelineSchedule s) {
  for (const auto& [name, value] : kSchedules)
    if (value == s) return name;
  return "?";
}

std::optional<PipelineSchedule> pipeline_schedule_from_string(std::string_view s) {
  for (const auto& [name, value] : kSchedules)
    if (name == s) return value;
  return std::nullopt;
}

void validate_pipeline(PipelineSchedule s, int64_t p, int64_t m, int64_t v) {
  if (p < 1)
    throw Error(fmt::format("--pp: must be >= 1, got {}", p),
                "the number of pipeline stages, 1 without pipeline parallelism, e.g. --pp 4");
  if (m < 1)
    throw Error(fmt::format("--grad-accum: the number of micro-batches must be >= 1, got {}", m),
                "each optimizer step runs --grad-accum micro-batches through the pipeline, "
                "e.g. --grad-accum 8");
  if (v < 1)
    throw Error(fmt::format("--vp: must be >= 1, got {}", v),
                "model chunks (virtual stages) per pipeline rank: 1, or 2 and more with the "
                "interleaved schedule");
  if (s != PipelineSchedule::interleaved) {
    if (v != 1)
      throw Error(fmt::format("--vp {}: the {} schedule runs one model chunk per rank", v,
                              to_string(s)),
                  "virtual stages need the interleaved schedule; or leave --vp at 1");
    return;
  }
  // Megatron-LM runs one chunk per rank as the plain 1F1B schedule: arguments.py sets
  // virtual_pipeline_model_parallel_size to None when it is 1.
  if (v < 2)
    throw Error(fmt::format("--vp {}: the interleaved schedule needs 2 or more model chunks per "
                            "rank", v),
                "one chunk per rank is the 1f1b schedule (Megatron-LM runs --vp 1 so); or pass "
                "--vp 2 or more");
  // arguments.py: "When interleaved schedule is used, pipeline-model-parallel size should be
  // greater than 1" (greater than 2 without p2p overlap, which is on by default).
  if (p < 2)
    throw Error(fmt::format("--pp {}: the interleaved schedule needs 2 or more pipeline stages",
                            p),
                "Megatron-LM refuses interleaving on one stage; pass --pp 2 or more, or --vp 1");
  // forward_backward_pipelining_with_interleaving refuses a group size n outside [p, m] and a
  // last group of fewer than p micro-batches (m % n in (0, p)); with its default n = p that is
  // m >= p and m % p == 0. Other group sizes (--microbatch-group-size-per-virtual-pipeline-
  // stage) are not modelled.
  if (m % p != 0)
    throw Error(fmt::format("--grad-accum {}: the interleaved schedule runs a multiple of --pp {} "
                            "micro-batches (--vp {})", m, p, v),
                fmt::format("Megatron-LM runs each model chunk over groups of --pp micro-batches "
                            "(microbatch_group_size_per_vp_stage, default --pp) and refuses a "
                            "partial group; e.g. --grad-accum {}",
                            (m / p + 1) * p));
}

// GPipe (Huang et al. 2019 sec. 2.2, fig. 2c): every stage runs the m forwards, then the m
// backwards. The backwards in micro-batch order, as torch.distributed.pipelining runs GPipe
// (schedules.py ScheduleGPipe._step_microbatches and _get_pipeline_order); with equal pass
// times the order of the backwards changes neither the makespan nor the in-flight count.
//
// 1F1B (PipeDream-Flush; Narayanan et al. 2021 sec. 2.2.1), as Megatron-LM's
// forward_backward_pipelining_without_interleaving runs it on stage s: W = min(p - s - 1, m)
// warmup forwards; then m - W steps of forward W+i followed by backward i; then the W
// remaining backwards (cooldown).
//
// Interleaved 1F1B (Narayanan et al. 2021 sec. 2.2.2), as forward_backward_pipelining_
// with_interleaving runs it on stage s, over the m v virtual micro-batches of schedule_table:
// W = warmup_interleaved forwards F(0..W-1); then steps k = 0 .. mv-W-1 of forward F(W+k)
// followed by backward B(k); then B(mv-W .. mv-1). F(k) is table[k]; B(k) is table[k]'s
// micro-batch on chunk v-1-table[k].chunk (get_model_chunk_id(k, forward=False)): backwards
// walk the chunks from the model's end. Without p2p overlap and with it the computation order
// is the same (forward_backward_helper_wrapper runs the forward, then the backward).
PipelineOrder pipeline_order(PipelineSchedule s, int64_t p, int64_t m, int64_t v) {
  validate_pipeline(s, p, m, v);
  const int64_t per_stage = checked_mul(checked_mul(int64_t{2}, m, "pipeline passes"), v,
                                        "pipeline passes");
  if (checked_mul(per_stage, p, "pipeline passes") > kMaxPasses)
    throw Error(fmt::format("--pp {} x --grad-accum {} x --vp {}: {} pipeline passes, more than "
                            "the {} an explicit schedule is drawn for",
                            p, m, v, per_stage * p, kMaxPasses),
                "fewer micro-batches or stages; in-flight counts of larger pipelines come from "
                "in_flight_closed_form");
  PipelineOrder order(static_cast<size_t>(p));
  for (int64_t st = 0; st < p; ++st) {
    auto& o = order[static_cast<size_t>(st)];
    o.reserve(static_cast<size_t>(per_stage));
    switch (s) {
      case PipelineSchedule::gpipe:
        for (int64_t i = 0; i < m; ++i) o.push_back({i, 0, true});
        for (int64_t i = 0; i < m; ++i) o.push_back({i, 0, false});
        break;
      case PipelineSchedule::one_f_one_b: {
        const int64_t w = warmup_1f1b(p, m, st);
        for (int64_t i = 0; i < w; ++i) o.push_back({i, 0, true});
        for (int64_t i = 0; i < m - w; ++i) {
          o.push_back({w + i, 0, true});
          o.push_back({i, 0, false});
        }
        for (int64_t i = m - w; i < m; ++i) o.push_back({i, 0, false});
        break;
      }
      case PipelineSchedule::interleaved: {
        const auto table = schedule_table(m, v, /*n=*/p);
        const int64_t total = m * v;
        const int64_t w = warmup_interleaved(p, m, v, st);
        auto fwd = [&](int64_t k) {
          const auto& [mb, c] = table[static_cast<size_t>(k)];
          return PipelinePass{mb, c, true};
        };
        auto bwd = [&](int64_t k) {
          const auto& [mb, c] = table[static_cast<size_t>(k)];
          return PipelinePass{mb, v - 1 - c, false};
        };
        for (int64_t k = 0; k < w; ++k) o.push_back(fwd(k));
        for (int64_t k = 0; k < total - w; ++k) {
          o.push_back(fwd(w + k));
          o.push_back(bwd(k));
        }
        for (int64_t k = total - w; k < total; ++k) o.push_back(bwd(k));
        break;
      }
    }
  }
  return order;
}

std::vector<int64_t> in_flight(const PipelineOrder& order) {
  std::vector<int64_t> out;
  out.reserve(order.size());
  for (const auto& stage : order) {
    int64_t held = 0, peak = 0;
    for (const PipelinePass& pass : stage) {
      held += pass.forward ? 1 : -1;
      peak = std::max(peak, held);
    }
    out.push_back(peak);
  }
  return out;
}

// Each stage holds one more than its warmup: the steady state's forward runs before its
// backward, so the count peaks at W + 1 after the first steady forward (or at all m v passes
// when the warmup covers them, W = m v). GPipe holds all m. The 1F1B count is Narayanan et al.
// 2021 sec. 2.2.1's "in-flight micro-batches limited to the pipeline depth" and Megatron's
// theoretical_memory_usage.py compute_activation_memory (min(m, p) micro-batches on stage 0);
// the interleaved count on stage 0, 2 (p - 1) + (v - 1) p + 1 = v p + p - 1 chunks of L/(p v)
// layers, equals that function's interleaved_schedule_memory_penalty 1 + (p - 1)/(p v) times
// p micro-batches of the stage's L/p layers: (1 + (p - 1)/(p v)) p v = p v + p - 1.
int64_t in_flight_closed_form(PipelineSchedule s, int64_t p, int64_t m, int64_t v, int64_t stage) {
  validate_pipeline(s, p, m, v);
  if (stage < 0 || stage >= p)
    throw Error(fmt::format("pipeline stage {}: outside 0 .. {} (--pp {})", stage, p - 1, p),
                "stages are numbered from 0, the first, to --pp - 1, the last");
  switch (s) {
    case PipelineSchedule::gpipe:
      return m;
    case PipelineSchedule::one_f_one_b:
      return std::min(warmup_1f1b(p, m, stage) + 1, m);
    case PipelineSchedule::interleaved:
      return std::min(warmup_interleaved(p, m, v, stage) + 1, m * v);
  }
  return 0;
}

PipelineTiming time_pipeline(const PipelineOrder& order, int64_t p, int64_t v, double t_forward,
                             double t_backward, double t_p2p) {
  if (p < 1) throw Error(fmt::format("--pp: must be >= 1, got {}", p), "e.g. --pp 4");
  const std::size_t n = static_cast<std::size_t>(p);
  return time_pipeline(order, p, v, std::vector<double>(n, t_forward),
                       std::vector<double>(n, t_backward), t_p2p);
}

PipelineTiming time_pipeline(const PipelineOrder& order, int64_t p, int64_t v,
                             const std::vector<double>& t_forward,
                             const std::vector<double>& t_backward, double t_p2p) {
  if (p < 1) throw Error(fmt::format("--pp: must be >= 1, got {}", p), "e.g. --pp 4");
  if (v < 1) throw Error(fmt::format("--vp: must be >= 1, got {}", v), "e.g. --vp 1");
  if (static_cast<int64_t>(order.size()) != p)
    throw Error(fmt::format("pipeline order: {} stages, --pp is {}", order.size(), p),
                "pass the order pipeline_order built for the same --pp");
  if (static_cast<int64_t>(t_forward.size()) != p || static_cast<int64_t>(t_backward.size()) != p)
    throw Error(fmt::format("pipeline timing: {} forward and {} backward times for {} stages",
                            t_forward.size(), t_backward.size(), p),
                "one forward and one backward time per stage");
  std::vector<double> times(t_forward);
  times.insert(times.end(), t_backward.begin(), t_backward.end());
  times.push_back(t_p2p);
  for (double t : times)
    if (!std::isfinite(t) || t < 0)
      throw Error(fmt::format("pipeline timing: pass and send times must be finite and >= 0, got "
                              "{}", t),
                  "times per chunk and micro-batch, in any one unit");

  // m from the order; every stage must run each (micro-batch, chunk) forward and backward
  // exactly once, so the end-time table below is no larger than the order itself.
  int64_t m = 0;
  for (const auto& stage : order)
    for (const PipelinePass& x : stage) {
      if (x.chunk < 0 || x.chunk >= v || x.microbatch < 0)
        throw Error(fmt::format("pipeline order: pass (micro-batch {}, chunk {}) outside "
                                "micro-batches >= 0 and chunks 0 .. {} (--vp {})",
                                x.microbatch, x.chunk, v - 1, v),
                    "pass the order pipeline_order built for the same --vp");
      m = std::max(m, x.microbatch + 1);
    }
  const int64_t per_stage = 2 * m * v;
  for (const auto& stage : order)
    if (static_cast<int64_t>(stage.size()) != per_stage)
      throw Error(fmt::format("pipeline order: a stage runs {} passes, not 2 x {} micro-batches x "
                              "{} chunks",
                              stage.size(), m, v),
                  "every stage runs each micro-batch's forward and backward on each chunk once");

  // end[key]: when the pass ended, < 0 until it has run. key = ((s * v + c) * m + mb) * 2 + b.
  const auto key = [&](int64_t s, int64_t c, int64_t mb, bool fwd) {
    return static_cast<size_t>(((s * v + c) * m + mb) * 2 + (fwd ? 0 : 1));
  };
  std::vector<double> end(static_cast<size_t>(p * per_stage), -1.0);
  std::vector<size_t> next(static_cast<size_t>(p), 0);  // per stage: its next pass
  std::vector<double> free_at(static_cast<size_t>(p), 0.0);
  PipelineTiming t;
  t.busy.assign(static_cast<size_t>(p), 0.0);

  // The pass each pass waits on (time_pipeline's doc in pipeline.hpp), as (stage, chunk,
  // forward); nullopt for the first position's forward.
  struct Dep {
    int64_t stage, chunk;
    bool forward;
  };
  const auto dependency = [&](int64_t s, const PipelinePass& x) -> std::optional<Dep> {
    if (x.forward) {
      if (s > 0) return Dep{s - 1, x.chunk, true};
      if (x.chunk > 0) return Dep{p - 1, x.chunk - 1, true};
      return std::nullopt;
    }
    if (s < p - 1) return Dep{s + 1, x.chunk, false};
    if (x.chunk < v - 1) return Dep{0, x.chunk + 1, false};
    return Dep{s, x.chunk, true};  // the last position: its own forward
  };
  // The stage whose pass waits on (s, x): the mirror of dependency.
  const auto dependent_stage = [&](int64_t s, const PipelinePass& x) -> int64_t {
    if (x.forward) {
      if (s < p - 1) return s + 1;
      return x.chunk < v - 1 ? 0 : s;
    }
    if (s > 0) return s - 1;
    return x.chunk > 0 ? p - 1 : -1;
  };

  // Each stage runs ahead until a pass's dependency has not ended; finishing a pass wakes the
  // stage that waits on it. Every pass runs once and wakes one stage: O(passes).
  std::vector<int64_t> ready;
  for (int64_t s = p - 1; s >= 0; --s) ready.push_back(s);
  int64_t done = 0;
  while (!ready.empty()) {
    const int64_t s = ready.back();
    ready.pop_back();
    const auto& stage = order[static_cast<size_t>(s)];
    auto& i = next[static_cast<size_t>(s)];
    while (i < stage.size()) {
      const PipelinePass& x = stage[i];
      double start = free_at[static_cast<size_t>(s)];
      if (const auto d = dependency(s, x)) {
        const double dep_end = end[key(d->stage, d->chunk, x.microbatch, d->forward)];
        if (dep_end < 0) break;  // woken again when it ends
        start = std::max(start, dep_end + (d->stage != s ? t_p2p : 0.0));
      }
      const double dt = x.forward ? t_forward[static_cast<size_t>(s)] : t_backward[static_cast<size_t>(s)];
      double& e = end[key(s, x.chunk, x.microbatch, x.forward)];
      if (e >= 0)
        throw Error(fmt::format("pipeline order: stage {} runs micro-batch {} chunk {}'s {} twice",
                                s, x.microbatch, x.chunk, x.forward ? "forward" : "backward"),
                    "every stage runs each pass once");
      e = start + dt;
      free_at[static_cast<size_t>(s)] = e;
      t.busy[static_cast<size_t>(s)] += dt;
      ++i;
      ++done;
      if (const int64_t w = dependent_stage(s, x); w >= 0 && w != s) ready.push_back(w);
    }
  }
  if (done != p * per_stage)
    throw Error(fmt::format("pipeline order: deadlock after {} of {} passes (each stage waits "
                            "on a pass that waits on it)",
                            done, p * per_stage),
                "a stage must run a micro-batch's forward before the passes that depend on it");

  t.makespan = *std::max_element(free_at.begin(), free_at.end());
  t.end = free_at;
  double idle_sum = 0, busy_sum = 0;
  for (int64_t s = 0; s < p; ++s) {
    t.idle.push_back(t.makespan - t.busy[static_cast<size_t>(s)]);
    idle_sum += t.idle.back();
    busy_sum += t.busy[static_cast<size_t>(s)];
  }
  t.bubble_time = idle_sum / static_cast<double>(p);
  t.bubble_fraction = t.makespan > 0 ? t.bubble_time / t.makespan : 0;
  t.bubble_over_ideal = busy_sum > 0 ? t.bubble_time / (busy_sum / static_cast<double>(p)) : 0;
  t.in_flight = in_flight(order);
  return t;
}

// Why the formulas hold (equal stages; pipeline.hpp has them): along the critical path the
// first micro-batch's forward crosses the p stages, the slowest stage then runs its m (m v
// chunks) passes back to back, and the last micro-batch's backward crosses back. With stages
// of their own speeds the path crosses each stage once each way and waits on the slowest,
// which holds when one stage is the slowest forward and backward; GPipe's forwards and
// backwards are two such pipelines in a row.
PipelineMakespan makespan_closed_form(PipelineSchedule s, int64_t p, int64_t m, int64_t v,
                                      const std::vector<double>& t_forward,
                                      const std::vector<double>& t_backward) {
  validate_pipeline(s, p, m, v);
  if (static_cast<int64_t>(t_forward.size()) != p || static_cast<int64_t>(t_backward.size()) != p)
    throw Error(fmt::format("pipeline timing: {} forward and {} backward times for {} stages",
                            t_forward.size(), t_backward.size(), p),
                "one forward and one backward time per stage");
  double sum_f = 0, sum_b = 0, max_f = 0, max_b = 0, max_fb = 0;
  for (std::size_t i = 0; i < static_cast<std::size_t>(p); ++i) {
    const double f = t_forward[i], b = t_backward[i];
    if (!std::isfinite(f) || !std::isfinite(b) || f < 0 || b < 0)
      throw Error(fmt::format("pipeline timing: stage {}'s pass times must be finite and >= 0, "
                              "got {} and {}", i, f, b),
                  "times per micro-batch, in any one unit");
    sum_f += f;
    sum_b += b;
    max_f = std::max(max_f, f);
    max_b = std::max(max_b, b);
    max_fb = std::max(max_fb, f + b);
  }
  const double md = static_cast<double>(m), vd = static_cast<double>(v);
  PipelineMakespan out;
  switch (s) {
    case PipelineSchedule::gpipe:
      out.makespan = sum_f + sum_b + (md - 1) * (max_f + max_b);
      break;
    case PipelineSchedule::one_f_one_b:
      out.makespan = sum_f + sum_b + (md - 1) * max_fb;
      break;
    case PipelineSchedule::interleaved:
      out.makespan = (sum_f + sum_b + (md * vd - 1) * max_fb) / vd;
      break;
  }
  out.end.reserve(static_cast<std::size_t>(p));
  double before = 0;
  for (std::size_t i = 0; i < static_cast<std::size_t>(p); ++i) {
    out.end.push_back(out.makespan - before / vd);
    before += t_backward[i];
  }
  return out;
}

}  // namespace zp::planner
