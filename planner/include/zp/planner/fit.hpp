// zp/planner/fit.hpp: the search behind `zero-plan fit`: every stage x offload x micro-batch x
// checkpointing x DPU (x expert-parallel degree for Mixture-of-Experts models; x model-parallel
// degree when nothing fits without it; with `parallel`, x tensor x sequence x pipeline x
// virtual-stage x context parallelism in one round, screened for deep models) on a machine,
// what fits, ranked by simulated throughput, with the reason each wins or loses; the largest
// model of a family that fits; the winner as a DeepSpeed config; DeepSpeed's own estimators.
// Not a memory model of its own: memory is estimate.hpp's, decomposed so that the graph and
// its replay are built once per shape and reused (the search must stay in milliseconds).
//
// Example usage:
//   FitRequest r;
//   r.model = models::load_model("gpt2-xl");
//   r.hw = load_hardware("v100-32g");
//   r.gpus = 16;
//   FitResult f = fit(r);
//   for (const Candidate& c : f.candidates) fmt::print("{}: {}\n", describe(c.strategy), c.why);
//   write(deepspeed_config(f.candidates.front().strategy).dump(2));
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "zp/models/model_spec.hpp"
#include "zp/planner/hardware.hpp"
#include "zp/planner/memory.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/simulate.hpp"
#include "zp/planner/strategy.hpp"

namespace zp::planner {

struct FitRequest {
  models::ModelSpec model;
  Hardware hw;
  int64_t gpus = 1;                  // all GPUs of the job
  int64_t nodes = 0;                 // 0: as few as hold the GPUs
  Strategy base;                     // precision, optimizer, seq, grad_accum, buffers, flash
  PlanOptions options;               // profile (zeroplan | deepspeed); backend is cuda
  // The search space. A dimension the user pins (--stage 3) holds one value.
  std::vector<int> stages = {0, 1, 2, 3};
  std::vector<Offload> offload_optimizer = {Offload::none, Offload::cpu, Offload::nvme};
  std::vector<Offload> offload_param = {Offload::none, Offload::cpu, Offload::nvme};
  std::vector<int64_t> micro_batches = {1, 2, 4, 8, 16, 32};
  // (zero-plan fit adds selective_op under the fsdp profile: torchtitan's default)
  std::vector<Checkpointing> checkpointing = {Checkpointing::none, Checkpointing::selective,
                                              Checkpointing::full};
  std::vector<bool> dpu = {false, true};
  // overlap_comm for stages 2-3 with more than one data-parallel rank (it holds a second
  // gradient bucket and hides the reductions and gathers behind compute); a base.overlap_comm
  // the user set (--overlap-comm, --no-overlap-comm, a DeepSpeed config) is the only value.
  std::vector<bool> overlap_comm = {false, true};
  std::vector<int64_t> grad_accums;  // empty: base.grad_accum only
  // Model-parallel degrees. Empty: 1, and only when nothing fits, the powers of two up to a
  // node's GPUs that divide the GPUs and the heads, smallest first.
  std::vector<int64_t> mps;
  // Expert-parallel degrees (Mixture-of-Experts models). Empty: every divisor of the
  // data-parallel degree that divides the expert count (1 for a dense model); given values
  // are used where they divide the data-parallel degree.
  std::vector<int64_t> eps;
  // Tensor, sequence, pipeline and context parallelism. A dimension given here holds those
  // values; an empty one holds the base's (base.sp, base.pp, base.vp, base.cp) unless
  // `parallel` searches it, together with the tensor-parallel degrees (mps, or every degree
  // the model-parallel rounds would try) in one round: sp off and on with tp > 1 (where the
  // model's blocks take it), pp every divisor of the layer count that divides the GPUs left,
  // vp 1 and 2 (the interleaved schedule), cp 1, 2, 4 and 8 where the sequence divides into
  // 2 cp halves (base.cp_kind; the ring needs flash attention). Pipelines hold ZeRO stages 0-1
  // (validate()).
  bool parallel = false;
  std::vector<bool> sps;
  std::vector<int64_t> pps, vps, cps;
  // Sequences per optimizer step over the whole job (Megatron's --global-batch-size): each
  // configuration's grad_accum is global_batch / (micro_batch x dp), and those it does not
  // divide are left out. 0: grad_accums (or base.grad_accum) for every configuration.
  int64_t global_batch = 0;
  // Every configuration evaluated exactly (all of its graphs, replays and a simulated step).
  // Otherwise a `parallel` search of a model whose blocks are all alike is screened first
  // (fit.cpp "Screening": each configuration's memory extrapolated from its stages' graphs at
  // two small depths, its step simulated on their costs at full depth) and only the
  // configurations that can still reach the top are evaluated exactly; the candidates
  // reported are always exact.
  bool exhaustive = false;
  std::size_t top = 5;
  // Threads that build the per-shape graphs and replays and simulate the candidates;
  // 0: std::thread::hardware_concurrency(). The result does not depend on it.
  unsigned threads = 0;
};

struct Candidate {
  Strategy strategy;
  PerDevice per_device;
  std::vector<std::string> shortfalls;  // empty when it fits
  double step_seconds = 0;
  double tflops_per_gpu = 0;
  double tokens_per_second = 0;         // whole job
  std::array<double, kResources> busy_seconds{};  // per resource, one step (Timeline's)
  std::string why;
};

struct FitResult {
  std::vector<Candidate> candidates;  // those that fit, best first, at most `top`
  uint64_t n_searched = 0;            // configurations evaluated
  // Configurations that fit: exactly where evaluated exactly (every one without screening),
  // by the screen's extrapolation for the others.
  uint64_t n_fit = 0;
  uint64_t n_exact = 0;               // configurations evaluated exactly (n_searched unscreened)
  uint64_t n_simulated = 0;           // screened: configurations simulated on full-depth costs
  bool screened = false;              // the search was screened (FitRequest::exhaustive)
  uint64_t n_shapes = 0;              // graphs built (model x micro-batch x checkpointing x mp)
  // When nothing fits: the configuration that misses by the least, and what it lacks.
  std::optional<Candidate> closest;
  int64_t gpus = 1, nodes = 1;
};

class Screen;  // fit.cpp: the screening of a parallel search (FitRequest::exhaustive)

// Per-device memory of one strategy from cached pieces; equals estimate(...).per_device.
// Kept as a class so benchmarks and tests can reuse one cache over many strategies.
class FitEvaluator {
 public:
  FitEvaluator(models::ModelSpec model, PlanOptions options);
  ~FitEvaluator();
  FitEvaluator(FitEvaluator&&) noexcept;
  // s: seq resolved (resolve_for_model). With pp > 1 the most loaded stage's, as estimate().
  PerDevice memory(const Strategy& s);
  // Pipeline stage `stage`'s memory (the only one without pipelining).
  PerDevice stage_memory(const Strategy& s, int64_t stage);
  // Per (micro-batch, checkpointing, tp, sp, ...; a pipeline's stage).
  const StepCosts& costs(const Strategy& s, int64_t stage = 0);
  // Every strategy's memory, what it lacks on `hw` and, when it fits, its simulated step, in
  // the order given. Tensor, sequence and pipeline parallelism included: a pipeline's memory
  // is its most loaded stage's (every stage's shortfalls listed, the others' named), its step
  // simulate_pipeline's over every stage's costs. Strategies are grouped by shape and each shape (its graph, replays and
  // simulations) is worked by one of `threads` threads, so the result is the same as
  // evaluating them one by one, whatever the thread count. keep_graphs false: each shape's
  // graph is freed once its strategies are done (memory() and costs() build it again), so a
  // deep model holds only the graphs being worked on, not every shape's.
  std::vector<Candidate> evaluate(const std::vector<Strategy>& ss, const Hardware& hw,
                                  const Cluster& cl, unsigned threads, bool keep_graphs = true);
  uint64_t n_shapes() const;
  // Frees every shape's graph; its caches stay (memory() and costs() build it again).
  void release_graphs();
 private:
  friend class Screen;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

FitResult fit(const FitRequest& r);

// The screen's view of one configuration (fit.cpp "Screening"; FitRequest::exhaustive): the
// most loaded stage's memory on the line through its graphs at two small depths, the floor
// under its peaks it is screened by, and its step simulated on its stages' costs at full
// depth (copies of a block's). For tests and benchmarks; s: seq resolved (resolve_for_model).
struct ScreenEstimate {
  PerDevice per_device;  // the most loaded stage's: the deeper depth's overhead, the larger buckets
  PerDevice least;       // per tier, the largest stage's peak without either (a floor)
  double min_step_seconds = 0;  // the least the step can take (its GPU stream, ZeRO-3's gathers)
  Timeline step;         // simulated on the stages' costs at full depth (its numbers; no tasks)
};
ScreenEstimate screen_estimate(const models::ModelSpec& model, const Strategy& s,
                               const Hardware& hw, const Cluster& cl,
                               const PlanOptions& options = {});

struct MaxModel {
  models::ModelSpec model;   // the family's shape with the largest n_layer that fits
  uint64_t params = 0;
  Candidate best;            // the fastest configuration for it
  FitResult search;          // fit() at that depth (best == search.candidates.front())
  uint64_t n_probes = 0;     // exact evaluations at other depths on the way
};
// One exact evaluation of max_model's, at one depth, as it finishes.
struct MaxModelProbe {
  int64_t n_layer = 0;
  uint64_t params = 0;           // of the family at that depth
  bool fits = false;             // some of the configurations evaluated fits
  uint64_t n_configurations = 0; // configurations evaluated at that depth
  uint64_t n_search = 0;         // configurations of the whole search
  double seconds = 0;
};
using MaxModelProgress = std::function<void(const MaxModelProbe&)>;
// Largest n_layer (the family's width kept) for which some configuration of `r` fits: the L
// where fit() finds a fit at L and none at L + 1. nullopt when not even one layer does.
// Extrapolates each configuration's memory from two small depths and confirms exactly
// (fit.cpp explains how); `progress`, when set, hears of every exact evaluation, on the
// calling thread.
std::optional<MaxModel> max_model(const FitRequest& r, const MaxModelProgress& progress = {});

// The winner as a DeepSpeed config (fields apply_deepspeed_config reads back to the same
// strategy). Recomputation and DPU are not DeepSpeed config fields: see notes.
nlohmann::json deepspeed_config(const Strategy& s);
std::vector<std::string> deepspeed_notes(const Strategy& s);

// {"schema":"zero-plan/fit/v1","candidates":[{"strategy":..,"per_device":..,"step_seconds":..,
//  "tflops_per_gpu":..,"why":..}],...} (DESIGN.md)
nlohmann::json to_json(const FitResult& f, const FitRequest& r);
nlohmann::json to_json(const MaxModel& m, const models::ParamInventory& inv);

// DeepSpeed's estimators of model-state memory, as DeepSpeed evaluates them (Python ints and
// floats, truncated by int()): deepspeed/runtime/zero/stage_1_and_2.py
// estimate_zero2_model_states_mem_needs and stage3.py estimate_zero3_model_states_mem_needs.
struct DsEstimate {
  uint64_t cpu_bytes = 0;            // per node
  uint64_t gpu_bytes = 0;            // per GPU
  uint64_t largest_layer_bytes = 0;  // zero3 only
};
DsEstimate ds_estimate_zero2(uint64_t total_params, int64_t gpus_per_node, int64_t nodes,
                             bool cpu_offload, double additional_buffer_factor = 1.5);
DsEstimate ds_estimate_zero3(uint64_t total_params, uint64_t largest_layer_params,
                             int64_t gpus_per_node, int64_t nodes, bool cpu_offload,
                             bool cpu_offload_params, bool zero_init,
                             double additional_buffer_factor = 1.5);

}  // namespace zp::planner
