// fit.cpp: the configuration search of `zero-plan fit`, the largest model that fits, the
// DeepSpeed config of the winner and DeepSpeed's own estimators. Not a second memory model:
// memory comes from the schedule replay of schedule.cpp, cached per shape.
#include "zp/planner/fit.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <map>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/checked.hpp"
#include "zp/error.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/model_states.hpp"
#include "zp/units.hpp"

namespace zp::planner {

namespace {

bool is_state(Category c) {
  return c == Category::params || c == Category::grads || c == Category::master ||
         c == Category::optimizer;
}

PerDevice add(const PerDevice& a, const PerDevice& b) {
  PerDevice d;
  for (Tier t : kTiers) {
    for (Category c : kCategories) d[t][c] = checked_add(a[t][c], b[t][c], "bytes");
    d.set_peak(t, checked_add(a.peak(t), b.peak(t), "bytes"));
  }
  return d;
}

// The last: sequence parallelism and the pipeline stage (pp, pp_stage, pp_chunks): a
// pipeline's strategy has one shape per stage.
using ShapeKey = std::tuple<int64_t, int64_t, uint32_t, bool, int, bool, int64_t, bool, uint32_t, bool,
                            int64_t, bool, int64_t, double, bool, bool, bool,
                            std::tuple<bool, int64_t, int64_t, int64_t>>;
ShapeKey shape_key(const models::GraphOptions& g) {
  return {g.batch, g.seq, g.act_bytes, g.dropout, static_cast<int>(g.recompute), g.flash_attention,
          g.tp, g.partition_checkpoints, g.param_bytes, g.f32_weight_scratch,
          g.ep, g.moe_worst_case, g.seq_target, g.moe_capacity_factor, g.hf_modeling,
          g.autocast, g.softmax_keeps_input, {g.sp, g.pp, g.pp_stage, g.pp_chunks}};
}

// What the dynamic part of the schedule depends on beyond the shape. zeroplan's arena puts
// the persistent states first, so the rest of the step is the same layout shifted: only the
// stage's buffers matter (stage 3: the gather groups' padding, which depends on dp).
// PyTorch's caching allocator can reuse the tail of a state's segment, so the deepspeed
// profile replays each strategy whole.
// The host tier's buffers of an offloaded optimizer (append_offload_buffers) are replayed on
// their own, keyed by their sizes, so offload settings do not multiply the dynamic replays;
// parameters offloaded to the host add device staging buffers, hence offload_param.
// The deepspeed profile replays whole schedules: they differ with the delayed update, the
// parameter swap buffers (--offload-param nvme), the optimizer's swap buffers and the
// offload tiles too.
// overlap_comm changes how long gradient buckets live (schedule.cpp flush_if_full).
// The last field (state_dtypes below): the dtypes and FSDP settings that size states and
// buffers (master and moments, reduce dtype, reshard after forward, fused optimizer, FSDP's
// version, use_orig_params and hybrid shard size) and the optimizer kind.
// Then DeepSpeed's contiguous checkpoint buffers (their count; 0 without them), and a
// pipeline stage's micro-batches in flight (schedule.cpp's pp.in_flight; 1 without pipelining).
using DynKey = std::tuple<int, int64_t, int, int, uint64_t, uint64_t, uint64_t, uint64_t, int, bool,
                          uint64_t, uint64_t, uint64_t, bool, int64_t,
                          std::tuple<uint64_t, uint64_t, int64_t, uint64_t, int64_t, double>, int64_t,
                          int64_t>;
using HostKey = std::pair<uint64_t, uint64_t>;  // tile bytes, swap buffer bytes
// What the persistent states depend on within one shape (model_state_bytes and
// append_model_states): the partition, the stage, the precision and optimizer, where the
// optimizer and parameters live, the delayed update's host buffers, and the swap buffers held
// with the states (the delayed update's optimizer swap buffers on NVMe, the parameter
// swapper's buffers).
using StatesKey = std::tuple<uint64_t, int, int, int, int, int, bool, uint64_t, uint64_t, int64_t>;

// DeepSpeed stage 3's per-parameter settings (schedule.cpp deepspeed_stage3_tensors) and hpZ;
// what DeepSpeed's gradient reduction depends on (schedule.cpp deepspeed_reduce_hook):
// contiguous gradients, overlap_comm (two ipg buffers at stages 1-2, the reduction in the
// hooks at stage 1) and earlier micro-steps (the gradients they accumulated).
// And partial offload's ratio, and how the model reaches deepspeed.initialize.
std::tuple<uint64_t, uint64_t, int64_t, uint64_t, int64_t, double> deepspeed_settings(const Strategy& s) {
  const uint64_t flags = uint64_t{s.contiguous_gradients} | uint64_t{overlaps_comm(s)} << 1 |
                         uint64_t{builds_partitioned(s)} << 2 |
                         (s.load_on_gpu ? uint64_t{1} + static_cast<uint64_t>(*s.load_on_gpu) : 0) << 3 |
                         uint64_t{s.quantized_weights} << 6;
  return {s.buffers.sub_group_size, s.buffers.param_persistence_threshold,
          s.hpz_partition_size * 1'000'000 + s.deepspeed_version, flags, s.grad_accum,
          s.offload_optimizer_ratio};
}

int64_t state_dtypes(const Strategy& s) {
  return static_cast<int64_t>(s.master_precision) | static_cast<int64_t>(s.optimizer_precision) << 2 |
         static_cast<int64_t>(s.reduce_precision) << 4 | int64_t{s.reshard_after_forward} << 6 |
         int64_t{s.fused_optimizer} << 7 | static_cast<int64_t>(s.optimizer) << 8 |
         int64_t{s.cpu_checkpointing} << 12 | static_cast<int64_t>(s.optimizer_impl) << 13 |
         int64_t{s.fsdp_version} << 16 | int64_t{s.fsdp_use_orig_params} << 18 |
         (s.fsdp_shard_size + 1) << 19;
}

}  // namespace

struct FitEvaluator::Impl {
  models::ModelSpec model;
  PlanOptions options;
  struct Shape {
    models::GraphOptions go;
    bool built = false;
    models::TrainingGraph graph;
    StepCosts costs;
    std::vector<uint64_t> group_elems;
    std::vector<uint64_t> group_expert_elems;  // of group_elems, routed experts' (MoE)
    std::map<DynKey, PerDevice> dynamic;
    std::map<HostKey, PerDevice> host_buffers;
    std::map<StatesKey, PerDevice> states;
  };
  std::map<ShapeKey, Shape> shapes;

  // The shape's cache entry (pipeline stage `stage`'s), not yet built when new. Inserting is
  // the only step that changes `shapes` itself: evaluate() inserts every shape before its
  // threads fill them in.
  Shape& slot(const Strategy& s, int64_t stage = 0) {
    models::GraphOptions go = graph_options(model, s, options);
    go.pp_stage = stage;
    auto [it, inserted] = shapes.try_emplace(shape_key(go));
    if (inserted) it->second.go = go;
    return it->second;
  }
  static void build(Shape& sh, const models::ModelSpec& model) {
    if (sh.built) return;
    sh.graph = models::build_training_graph(model, sh.go);
    sh.costs = step_costs(sh.graph);
    sh.group_elems = sh.costs.group_params;
    sh.group_expert_elems = sh.costs.group_expert_params;
    sh.built = true;
  }
  // Frees the shape's graph (hundreds of MB at thousands of layers); its caches stay, and the
  // next strategy that needs the graph builds it again.
  static void release(Shape& sh) {
    sh.graph = models::TrainingGraph{};
    sh.built = false;
  }
  Shape& shape(const Strategy& s, int64_t stage = 0) {
    Shape& sh = slot(s, stage);
    build(sh, model);
    return sh;
  }
  // Touches `sh` and reads the rest: threads working on different shapes do not meet.
  PerDevice memory(Shape& sh, const Strategy& s) const;
};

FitEvaluator::FitEvaluator(models::ModelSpec model, PlanOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->model = std::move(model);
  impl_->options = options;
}
FitEvaluator::~FitEvaluator() = default;
FitEvaluator::FitEvaluator(FitEvaluator&&) noexcept = default;

uint64_t FitEvaluator::n_shapes() const { return impl_->shapes.size(); }

const StepCosts& FitEvaluator::costs(const Strategy& s, int64_t stage) {
  return impl_->shape(s, stage).costs;
}

namespace {

// Pipeline parallelism: the most loaded stage's memory (the largest gpu peak, the first of
// equals), as estimate() reports it, and every stage's shortfalls, the others' named.
struct StagesMemory {
  PerDevice per_device;
  std::vector<std::string> shortfalls;
};
StagesMemory most_loaded(const std::vector<PerDevice>& stages, const Strategy& s, const Hardware* hw) {
  StagesMemory out;
  std::size_t worst = 0;
  for (std::size_t i = 1; i < stages.size(); ++i)
    if (stages[i].peak(Tier::gpu) > stages[worst].peak(Tier::gpu)) worst = i;
  out.per_device = stages[worst];
  if (hw == nullptr) return out;
  out.shortfalls = shortfalls(out.per_device, s, *hw);
  for (std::size_t i = 0; i < stages.size(); ++i)
    if (i != worst)
      for (const std::string& why : shortfalls(stages[i], s, *hw))
        out.shortfalls.push_back(fmt::format("pipeline stage {}: {}", i, why));
  return out;
}

}  // namespace

PerDevice FitEvaluator::memory(const Strategy& s) {
  std::vector<PerDevice> stages;
  for (int64_t st = 0; st < s.pp; ++st) stages.push_back(impl_->memory(impl_->shape(s, st), s));
  return most_loaded(stages, s, nullptr).per_device;
}

PerDevice FitEvaluator::Impl::memory(Shape& sh, const Strategy& s) const {
  const PlanOptions& o = options;
  const bool whole = o.profile != Profile::zeroplan;  // PyTorch: replayed whole
  // Expert parameters partition over dp/ep (schedule.hpp's partition_elems).
  const uint64_t part = s.stage >= 1
                            ? partition_elems(sh.group_elems, sh.group_expert_elems, s.stage,
                                              static_cast<uint64_t>(s.dp),
                                              static_cast<uint64_t>(expert_dp(s)))
                            : zp::partition_elems(sh.costs.n_params, static_cast<uint64_t>(s.dp));
  const uint32_t p_bytes = sh.graph.options.param_bytes;
  // Stages 0 and 1 differ only in states (both keep whole gradients, no buckets): one replay.
  const DynKey key{whole || s.stage >= 2 ? s.stage : 1,
                   s.stage == 3 || whole ? s.dp : 0,
                   whole ? static_cast<int>(s.offload_optimizer) : 0,
                   whole ? static_cast<int>(s.offload_param) : 0,
                   s.buffers.reduce_bucket_size,
                   s.buffers.allgather_bucket_size,
                   s.buffers.prefetch_bucket_size,
                   s.buffers.max_live_parameters,
                   static_cast<int>(s.offload_param),
                   whole && s.dpu,
                   whole && s.stage == 3 && s.offload_param == Offload::nvme
                       ? param_swap_buffer_bytes(s, part, p_bytes)
                       : 0,
                   whole && s.offload_optimizer == Offload::nvme
                       ? optimizer_swap_buffer_bytes(s, part)
                       : 0,
                   whole ? offload_tile_bytes(s, part, p_bytes) : 0,
                   holds_buckets_in_flight(s),
                   whole ? state_dtypes(s) : 0,
                   whole ? deepspeed_settings(s)
                         : std::tuple<uint64_t, uint64_t, int64_t, uint64_t, int64_t, double>{},
                   whole && s.contiguous_memory_optimization ? s.number_checkpoints : 0,
                   pipeline_in_flight(s, sh.go.pp_stage)};
  auto it = sh.dynamic.find(key);
  if (it == sh.dynamic.end()) {
    MemorySchedule sch = build_schedule(sh.graph, s, o);
    if (!whole) {
      // Drop, in place, the persistent states (allocated before the first op, never freed),
      // the parameter swap buffers held with them (host tier, position -1;
      // append_model_states replays them below) and the optimizer's host buffers (the only
      // host-tier allocations during the step).
      std::erase_if(sch.events, [&](const MemEvent& e) {
        const MemBuffer& b = sch.buffers[e.buffer];
        return (e.pos == -1 && (is_state(b.category) || b.tier != Tier::gpu)) ||
               (e.pos >= 0 && b.tier == Tier::cpu);
      });
    }
    it = sh.dynamic.emplace(key, replay(sch, o).per_device).first;
  }
  if (whole) return it->second;
  const StatesKey skey{part,
                       s.stage,
                       static_cast<int>(s.precision),
                       static_cast<int>(s.optimizer),
                       static_cast<int>(s.offload_optimizer),
                       static_cast<int>(s.offload_param),
                       s.dpu,
                       s.dpu && s.offload_optimizer == Offload::nvme
                           ? optimizer_swap_buffer_bytes(s, part)
                           : 0,
                       s.stage == 3 && s.offload_param == Offload::nvme
                           ? param_swap_buffer_bytes(s, part, p_bytes)
                           : 0,
                       state_dtypes(s)};
  auto st = sh.states.find(skey);
  if (st == sh.states.end()) {
    MemorySchedule states_only;
    // Stage 0 hands the optimizer the model's tensors: Adafactor's and 8-bit Adam's bytes
    // follow their shapes (the stage and optimizer are in the key).
    append_model_states(states_only, sh.costs.n_params, part, s, p_bytes, StateLayout::zero,
                        per_tensor_optimizer_bytes(sh.graph, s, o));
    st = sh.states.emplace(skey, replay(states_only, o).per_device).first;
  }
  const PerDevice& states = st->second;
  const HostKey hkey{offload_tile_bytes(s, part, p_bytes),
                     s.offload_optimizer == Offload::nvme && !s.dpu
                         ? optimizer_swap_buffer_bytes(s, part)
                         : 0};
  auto hb = sh.host_buffers.find(hkey);
  if (hb == sh.host_buffers.end()) {
    MemorySchedule host_only;
    append_offload_buffers(host_only, 0, s, part, p_bytes);
    hb = sh.host_buffers.emplace(hkey, replay(host_only, o).per_device).first;
  }
  return add(add(states, hb->second), it->second);
}

std::vector<Candidate> FitEvaluator::evaluate(const std::vector<Strategy>& ss, const Hardware& hw,
                                             const Cluster& cl, unsigned threads,
                                             bool keep_graphs) {
  Impl& im = *impl_;
  // Group the strategies by shape, shapes in first-seen order (one thread builds a shape's
  // graph and its replays; its strategies are then evaluated on the same thread). A
  // pipeline's strategy is a member of each of its stages' shapes; its stages' memories are
  // put together, and its step simulated, once every shape is done.
  struct Member {
    std::size_t strategy;
    int64_t stage;
  };
  std::vector<Impl::Shape*> shapes;
  std::vector<std::vector<Member>> members;
  std::map<const Impl::Shape*, std::size_t> index;
  std::vector<std::vector<PerDevice>> stage_memory(ss.size());
  for (std::size_t i = 0; i < ss.size(); ++i) {
    if (ss[i].pp > 1) stage_memory[i].resize(static_cast<std::size_t>(ss[i].pp));
    for (int64_t st = 0; st < ss[i].pp; ++st) {
      Impl::Shape* sh = &im.slot(ss[i], st);
      auto [it, inserted] = index.try_emplace(sh, shapes.size());
      if (inserted) {
        shapes.push_back(sh);
        members.emplace_back();
      }
      members[it->second].push_back({i, st});
    }
  }
  std::vector<Candidate> out(ss.size());
  std::vector<std::exception_ptr> errors(shapes.size());
  std::vector<std::size_t> failed_at(shapes.size(), ss.size());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t u = next++; u < shapes.size(); u = next++) {
      try {
        Impl::Shape& sh = *shapes[u];
        Impl::build(sh, im.model);
        for (const auto [i, st] : members[u]) {
          failed_at[u] = i;
          if (ss[i].pp > 1) {  // a pipeline's stage: its memory now, the rest below
            stage_memory[i][static_cast<std::size_t>(st)] = im.memory(sh, ss[i]);
            continue;
          }
          Candidate& c = out[i];
          c.strategy = ss[i];
          c.per_device = im.memory(sh, ss[i]);
          c.shortfalls = shortfalls(c.per_device, ss[i], hw);
          if (!c.shortfalls.empty()) continue;
          const Timeline t = simulate(sh.costs, ss[i], hw, cl, im.options.profile);
          c.step_seconds = t.step_seconds;
          c.tflops_per_gpu = t.tflops_per_gpu;
          c.tokens_per_second = t.tokens_per_second;
          c.busy_seconds = t.busy_seconds;
        }
        if (!keep_graphs) Impl::release(sh);
        failed_at[u] = ss.size();
      } catch (...) {
        errors[u] = std::current_exception();
      }
    }
  };
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  const std::size_t n_threads = std::min<std::size_t>(threads, shapes.size());
  std::vector<std::thread> pool;
  for (std::size_t t = 1; t < n_threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  // The error of the first failing strategy in the order given, as one thread would meet it.
  std::size_t first = shapes.size();
  for (std::size_t u = 0; u < shapes.size(); ++u)
    if (errors[u] && (first == shapes.size() || failed_at[u] < failed_at[first])) first = u;
  if (first < shapes.size()) std::rethrow_exception(errors[first]);
  // Pipelines: the most loaded stage's memory, every stage's shortfalls, and, when they fit,
  // simulate_pipeline over the stages' costs (kept when a shape's graph is released).
  for (std::size_t i = 0; i < ss.size(); ++i) {
    if (ss[i].pp <= 1) continue;
    Candidate& c = out[i];
    c.strategy = ss[i];
    StagesMemory m = most_loaded(stage_memory[i], ss[i], &hw);
    c.per_device = m.per_device;
    c.shortfalls = std::move(m.shortfalls);
    if (!c.shortfalls.empty()) continue;
    std::vector<StepCosts> costs;
    for (int64_t st = 0; st < ss[i].pp; ++st) costs.push_back(im.slot(ss[i], st).costs);
    const Timeline t = simulate_pipeline(costs, ss[i], hw, cl, im.options.profile);
    c.step_seconds = t.step_seconds;
    c.tflops_per_gpu = t.tflops_per_gpu;
    c.tokens_per_second = t.tokens_per_second;
    c.busy_seconds = t.busy_seconds;
  }
  return out;
}

namespace {

struct Cluster2 {
  int64_t gpus, nodes;
};

Cluster2 resolve_cluster(const FitRequest& r) {
  if (r.gpus < 1) throw Error(fmt::format("--gpus: must be >= 1, got {}", r.gpus), "e.g. --gpus 8");
  if (r.nodes < 0) throw Error(fmt::format("--nodes: must be >= 1, got {}", r.nodes), "e.g. --nodes 2");
  const int64_t per = r.hw.gpus_per_node;
  const int64_t nodes = r.nodes > 0 ? r.nodes : (r.gpus + per - 1) / per;
  if (r.gpus > nodes * per)
    throw Error(fmt::format("--gpus {} do not fit on {} node(s) of {} ({} GPUs per node)", r.gpus,
                            nodes, r.hw.name, per),
                fmt::format("use --nodes {} or more", (r.gpus + per - 1) / per));
  if (r.gpus % nodes != 0)
    throw Error(fmt::format("--gpus {} cannot be spread evenly over --nodes {}", r.gpus, nodes),
                "give a GPU count that is a multiple of the node count");
  return {r.gpus, nodes};
}

// How far a configuration is from fitting: the largest need / capacity over the tiers.
double overshoot(const PerDevice& d, const Strategy& s, const Hardware& hw) {
  const double ranks = static_cast<double>(std::min<int64_t>(s.dp * s.mp, hw.gpus_per_node));
  double r = static_cast<double>(d.peak(Tier::gpu)) / static_cast<double>(hw.gpu_memory_bytes);
  r = std::max(r, static_cast<double>(d.peak(Tier::cpu)) * ranks / static_cast<double>(hw.host_memory_bytes));
  if (d.peak(Tier::nvme) > 0)
    r = std::max(r, hw.nvme_bytes == 0 ? 1e30
                                       : static_cast<double>(d.peak(Tier::nvme)) * ranks /
                                             static_cast<double>(hw.nvme_bytes));
  return r;
}

std::string resource_label(Resource r) {
  switch (r) {
    case Resource::gpu: return "GPU compute";
    case Resource::h2d: return "host-to-device copies";
    case Resource::d2h: return "device-to-host copies";
    case Resource::net: return "collectives";
    case Resource::cpu: return "CPU Adam";
    case Resource::nvme_read: return "NVMe reads";
    case Resource::nvme_write: return "NVMe writes";
  }
  return "?";
}

// "GPU compute 0.30 s (bottleneck), CPU Adam 0.25 s, collectives 0.01 s": busy time per
// resource in one step; the busiest bounds the step, the others overlap it or add to it.
std::string busy_summary(const Candidate& c) {
  std::vector<std::pair<double, Resource>> parts;
  for (int r = 0; r < kResources; ++r)
    if (c.busy_seconds[static_cast<std::size_t>(r)] >= 0.0005)
      parts.emplace_back(c.busy_seconds[static_cast<std::size_t>(r)], static_cast<Resource>(r));
  std::sort(parts.rbegin(), parts.rend());
  std::string out;
  for (std::size_t i = 0; i < parts.size() && i < 3; ++i) {
    if (!out.empty()) out += ", ";
    out += fmt::format("{} {:.3f} s", resource_label(parts[i].second), parts[i].first);
  }
  return out;
}

void explain(std::vector<Candidate>& c) {
  if (c.empty()) return;
  const Candidate& best = c.front();
  c.front().why = fmt::format("fastest that fits: {:.0f} tokens/s, {:.1f} TFLOP/s per GPU, step {:.3f} s; busy: {}",
                              best.tokens_per_second, best.tflops_per_gpu, best.step_seconds,
                              busy_summary(best));
  for (std::size_t i = 1; i < c.size(); ++i) {
    Candidate& x = c[i];
    const double slower = 100.0 * (best.tokens_per_second / x.tokens_per_second - 1.0);
    Resource worst = Resource::gpu;
    double worst_diff = -1e300;
    for (int r = 0; r < kResources; ++r) {
      const double d = x.busy_seconds[static_cast<std::size_t>(r)] -
                       best.busy_seconds[static_cast<std::size_t>(r)];
      if (d > worst_diff) {
        worst_diff = d;
        worst = static_cast<Resource>(r);
      }
    }
    if (slower < 0.05) {
      x.why = fmt::format("as fast as #1 but needs {} of GPU memory (#1: {})",
                          format_bytes(x.per_device.peak(Tier::gpu)),
                          format_bytes(best.per_device.peak(Tier::gpu)));
    } else {
      x.why = fmt::format("{:.1f}% slower than #1: {:+.1f} ms of {} per step; busy: {}", slower,
                          worst_diff * 1e3, resource_label(worst), busy_summary(x));
    }
  }
}

// The search space of `r`, round by round: the model-parallel degrees are tried in rounds
// (1 first; the next only when nothing fits), each round's configurations in search order.
std::vector<std::vector<Strategy>> configurations(const FitRequest& r, const Cluster2& cl2) {
  Strategy base = resolve_for_model(r.base, r.model);
  // PyTorch FSDP: FULL_SHARD with and without resharding after forward (SHARD_GRAD_OP), with
  // and without its CPU offload (--offload-param cpu: parameters, gradients and the step on
  // the host), hybrid sharding as the base asks; no optimizer-only or NVMe offload, no tensor
  // or expert parallelism (check_profile).
  const bool fsdp = r.options.profile == Profile::fsdp;
  const bool pytorch = r.options.profile == Profile::pytorch;  // stage 0 only
  std::vector<std::vector<int64_t>> mp_rounds;
  if (fsdp || pytorch) {
    mp_rounds.push_back({1});
  } else if (!r.mps.empty()) {
    mp_rounds.push_back(r.mps);
  } else {
    mp_rounds.push_back({1});
    for (int64_t mp = 2; mp <= r.hw.gpus_per_node; mp *= 2)
      if (cl2.gpus % mp == 0 && r.model.n_head % mp == 0 && r.model.n_kv_head % mp == 0 &&
          r.model.n_inner % mp == 0)
        mp_rounds.push_back({mp});
  }
  const std::vector<int64_t> accums = r.grad_accums.empty() ? std::vector<int64_t>{base.grad_accum}
                                                            : r.grad_accums;
  // Expert-parallel degrees for a data-parallel degree: those given (when they divide it), or
  // for a Mixture-of-Experts model every divisor of dp that divides the expert count; 1 for a
  // dense model.
  auto eps_for = [&](int64_t dp) {
    std::vector<int64_t> out;
    if (!r.eps.empty()) {
      for (int64_t ep : r.eps)
        if (ep >= 1 && dp % ep == 0) out.push_back(ep);
      return out;
    }
    if (!r.model.is_moe() || fsdp || pytorch) return std::vector<int64_t>{1};
    for (int64_t ep = 1; ep <= dp; ++ep)
      if (dp % ep == 0 && r.model.moe.n_experts % ep == 0) out.push_back(ep);
    return out;
  };
  std::vector<std::vector<Strategy>> rounds;
  for (const auto& mps : mp_rounds) {
    std::vector<Strategy>& round = rounds.emplace_back();
    for (int64_t mp : mps) {
      if (cl2.gpus % mp != 0)
        throw Error(fmt::format("--tp {}: does not divide --gpus {}", mp, cl2.gpus),
                    "the data-parallel degree is gpus / mp");
      const std::vector<int64_t> eps = eps_for(cl2.gpus / mp);
      for (int64_t ep : eps)
      for (int64_t mb : r.micro_batches)
        for (Checkpointing ck : r.checkpointing)
          for (int stage : r.stages)
            for (Offload oo : r.offload_optimizer)
              for (Offload op : r.offload_param)
                for (bool dpu : r.dpu)
                  for (int64_t ga : accums) {
                  if (fsdp && (stage != 3 || oo != Offload::none || op == Offload::nvme || dpu))
                    continue;
                  if (pytorch && (stage != 0 || oo != Offload::none || op != Offload::none || dpu))
                    continue;
                  if (op != Offload::none && stage != 3) continue;
                  if (ck == Checkpointing::selective_op && ep > 1) continue;  // validate()
                  if (oo != Offload::none && stage == 0) continue;
                  if (dpu && oo == Offload::none) continue;
                  Strategy s = base;
                  s.stage = stage;
                  s.offload_optimizer = oo;
                  s.offload_param = op;
                  s.dpu = dpu;
                  s.grad_accum = ga;
                  s.micro_batch = mb;
                  s.checkpointing = ck;
                  s.mp = mp;
                  s.dp = cl2.gpus / mp;
                  s.ep = ep;
                  if (ck != Checkpointing::full)  // DeepSpeed's section needs a checkpoint
                    s.partition_activations = s.cpu_checkpointing =
                        s.contiguous_memory_optimization = false;
                  if (fsdp) {
                    // Hybrid sharding as the base asks (a node: the hardware's GPUs per node,
                    // resolve_for_hardware), where it divides this dp.
                    if (base.fsdp_shard_size == kFsdpShardNode)
                      s.fsdp_shard_size = std::min<int64_t>(r.hw.gpus_per_node, s.dp);
                    if (s.fsdp_shard_size > 0 && s.dp % s.fsdp_shard_size != 0) continue;
                    for (bool reshard : {true, false}) {
                      s.reshard_after_forward = reshard;
                      round.push_back(s);
                    }
                    continue;
                  }
                  if (stage < 2 || s.dp == 1 || base.overlap_comm) {
                    round.push_back(s);
                    continue;
                  }
                  for (bool ov : r.overlap_comm) {
                    s.overlap_comm = ov;
                    round.push_back(s);
                  }
                }
    }
  }
  return rounds;
}

FitResult search(const FitRequest& r, FitEvaluator& ev, bool keep_graphs) {
  // The search's per-shape caches hold one graph per shape; a pipeline's stages are several.
  if (r.base.pp > 1 || r.base.cp > 1 || (r.base.sp && r.base.mp > 1))
    throw Error(fmt::format("fit: {} is not searched yet",
                            r.base.pp > 1 ? "--pp" : r.base.cp > 1 ? "--cp" : "--sp"),
                "estimate a pipeline with `zero-plan estimate --pp N` (every stage, the most "
                "loaded named); fit searches ZeRO, data, tensor and expert parallelism");
  const Cluster2 cl2 = resolve_cluster(r);
  const Cluster cl{cl2.gpus, cl2.nodes};
  FitResult out;
  out.gpus = cl2.gpus;
  out.nodes = cl2.nodes;
  std::vector<Candidate> fits;
  double closest_ratio = 1e300;
  for (const std::vector<Strategy>& round : configurations(r, cl2)) {
    // Every configuration of the round at once, on the evaluator's threads, then read in
    // search order as if evaluated one by one.
    std::vector<Candidate> evaluated = ev.evaluate(round, r.hw, cl, r.threads, keep_graphs);
    for (std::size_t i = 0; i < round.size(); ++i) {
      ++out.n_searched;
      Candidate c = std::move(evaluated[i]);
      if (!c.shortfalls.empty()) {
        const double ratio = overshoot(c.per_device, c.strategy, r.hw);
        if (ratio < closest_ratio) {
          closest_ratio = ratio;
          out.closest = c;
        }
        continue;
      }
      fits.push_back(std::move(c));
    }
    if (!fits.empty() && r.mps.empty()) break;
  }
  out.n_fit = fits.size();
  out.n_shapes = ev.n_shapes();
  // Best first: throughput (to 0.1%), then the smaller GPU peak, then search order.
  auto bucket = [](double tps) { return std::llround(std::log(std::max(tps, 1e-30)) * 1000.0); };
  std::stable_sort(fits.begin(), fits.end(), [&](const Candidate& a, const Candidate& b) {
    const auto ka = bucket(a.tokens_per_second), kb = bucket(b.tokens_per_second);
    if (ka != kb) return ka > kb;
    return a.per_device.peak(Tier::gpu) < b.per_device.peak(Tier::gpu);
  });
  if (fits.size() > r.top) fits.resize(r.top);
  explain(fits);
  out.candidates = std::move(fits);
  if (!out.candidates.empty()) out.closest.reset();
  return out;
}

}  // namespace

FitResult fit(const FitRequest& r) {
  if (r.options.backend != Backend::cuda)
    throw Error("fit: the search plans GPU training", "leave out --device or use --device cuda");
  PlanOptions options = r.options;
  options.gpu_capacity = r.hw.gpu_memory_bytes;  // DeepSpeed's init looks at the free memory
  FitEvaluator ev(r.model, options);
  return search(r, ev, false);  // the evaluator ends here: no graph is needed twice
}

// --max-model: the largest n_layer for which some configuration of the search fits,
// fits(L) = "some configuration of some model-parallel round fits at depth L", exactly as
// fit() decides it at that depth. The answer is the depth L with fits(L) and not fits(L+1).
//
// Probing depths by plain doubling and bisection builds the graph of every shape at every
// probed depth, and with offloading the answer is thousands of layers deep (minutes). A strategy
// is the same L identical blocks plus a fixed head and tail, so each tier's peak is close to
// affine in L, a + b*L, but not exactly (measured on gpt2, every strategy of the search at 1..128
// layers): the GPU arena's fragmentation (the `overhead` category of the best-fit replay) moves
// with L, by up to ~130 MB below 16 layers for stage 3 with offloaded parameters and by under
// ~1 MB past 24 layers, and can even make the GPU peak shrink by a few KB from one depth to the
// next; buffers grow with L up to a cap, so peaks are affine only piecewise (gpt2, stage 3,
// parameters on NVMe, B=1: the GPU's buffers are 0.59 GB at 16 layers, 1.27 GB at 64, 3.09 GB
// from some hundreds of layers on; the host's swap buffers stop growing at 9 layers);
// partitions are rounded to alignments. So the extrapolation only says where to look, and every answer is
// confirmed by exact evaluations:
//   1. every configuration exactly at kBaseLayers and at kSlopeLayers;
//   2. per configuration, the deepest L its affine extrapolation fits (shortfalls() on the
//      extrapolated peaks); the deepest of them, D;
//   3. the configurations extrapolated past D/4 exactly at D, each extrapolated again from its
//      last two exact depths (secant steps), the probe moved to the new estimate, until it
//      stays; those extrapolated well short of the deepest drop out (to step 5);
//   4. exact probes of the remaining ones around the estimate: steps of 1, 2, 4, ... until
//      the boundary is bracketed, then bisection: lo fits, lo + 1 does not;
//   5. confirmation with the whole search at lo + 1 (every other configuration, exactly):
//      nothing fits. When something does (a configuration the extrapolation misjudged), the plain
//      doubling and bisection with the whole search goes on from there.
// Depths below kSlopeLayers are searched by plain bisection with the whole search (cheap).
// The answer is the same as plain doubling and bisection's whenever fits(L) is monotone in L
// (the assumption plain bisection makes too); tests/planner/test_fit.cpp compares the two.
namespace {

constexpr int64_t kBaseLayers = 16;
constexpr int64_t kSlopeLayers = 64;
constexpr int64_t kTopFraction = 4;     // configurations extrapolated past 1/4 of the deepest
constexpr int kMaxRefinements = 8;      // secant steps before exact probing takes over
constexpr int64_t kKeepFraction = 8;    // after a secant step, those within 1/8 of the deepest

class DepthProber {
 public:
  DepthProber(const FitRequest& r, const Cluster& cl, const MaxModelProgress& progress,
              std::size_t n_configurations)
      : r_(r), cl_(cl), progress_(progress), n_configurations_(n_configurations) {}

  // Each configuration of `ss` evaluated exactly at depth L (memory and shortfalls; the step
  // of those that fit is simulated too, as fit() does).
  std::vector<Candidate> at(int64_t L, const std::vector<Strategy>& ss) {
    const auto t0 = std::chrono::steady_clock::now();
    models::ModelSpec m = r_.model;
    m.n_layer = L;
    PlanOptions options = r_.options;
    options.gpu_capacity = r_.hw.gpu_memory_bytes;
    FitEvaluator ev(m, options);
    std::vector<Candidate> c = ev.evaluate(ss, r_.hw, cl_, r_.threads, false);
    ++n_probes_;
    if (progress_) {
      MaxModelProbe p;
      p.n_layer = L;
      p.params = static_cast<uint64_t>(models::count_params(m).total);
      p.fits = std::any_of(c.begin(), c.end(), [](const Candidate& x) { return x.shortfalls.empty(); });
      p.n_configurations = ss.size();
      p.n_search = n_configurations_;
      p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      progress_(p);
    }
    return c;
  }
  bool any_fits(int64_t L, const std::vector<Strategy>& ss) {
    const std::vector<Candidate> c = at(L, ss);
    return std::any_of(c.begin(), c.end(), [](const Candidate& x) { return x.shortfalls.empty(); });
  }
  uint64_t n_probes() const { return n_probes_; }

 private:
  const FitRequest& r_;
  Cluster cl_;
  const MaxModelProgress& progress_;
  std::size_t n_configurations_;
  uint64_t n_probes_ = 0;
};

// Bisection between a depth that fits (lo) and one that does not (hi): the last that fits.
template <typename Fits>
int64_t bisect(int64_t lo, int64_t hi, Fits&& fits) {
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

// The deepest L below cap at which `s` fits (0: none), its peaks extrapolated on the line
// through its exact peaks pa at depth la and pb at depth lb (la < lb): per tier
// peak(L) = pb + (pb - pa) * (L - lb) / (lb - la), a negative slope (fragmentation) taken as 0;
// cap when it still fits there.
int64_t extrapolated_depth(const Strategy& s, const Hardware& hw, int64_t la, const PerDevice& pa,
                           int64_t lb, const PerDevice& pb, int64_t cap) {
  auto fits_at = [&](int64_t L) {
    PerDevice d;
    for (Tier t : kTiers) {
      const double slope = std::max(0.0, (static_cast<double>(pb.peak(t)) - static_cast<double>(pa.peak(t))) /
                                             static_cast<double>(lb - la));
      const double peak = static_cast<double>(pb.peak(t)) + slope * static_cast<double>(L - lb);
      d.set_peak(t, peak >= 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(std::max(0.0, std::ceil(peak))));
    }
    return shortfalls(d, s, hw).empty();
  };
  if (fits_at(cap)) return cap;
  if (!fits_at(1)) return 0;
  return bisect(1, cap, fits_at);
}

}  // namespace

std::optional<MaxModel> max_model(const FitRequest& r, const MaxModelProgress& progress) {
  const Cluster2 cl2 = resolve_cluster(r);
  const Cluster cl{cl2.gpus, cl2.nodes};
  std::vector<Strategy> all;  // every configuration of every model-parallel round
  for (const std::vector<Strategy>& round : configurations(r, cl2))
    all.insert(all.end(), round.begin(), round.end());
  DepthProber probe(r, cl, progress, all.size());
  auto fits = [&](int64_t L) { return probe.any_fits(L, all); };

  // Plain doubling from the family's own depth l calls it an error when a depth past a million
  // layers fits: the first of 2l, 4l, ... above 2^20, `limit`; under monotonicity, exactly when
  // the answer is `limit` or more.
  const int64_t l = std::max<int64_t>(1, r.model.n_layer);
  int64_t limit = 2 * l;
  while (limit <= (int64_t{1} << 20)) limit *= 2;
  auto too_deep = [] {
    return Error("--max-model: more than a million layers fit", "check the hardware file");
  };

  int64_t lo = 0;  // the answer: fits(lo), not fits(lo + 1)
  // 1. Every configuration exactly at kBaseLayers and kSlopeLayers.
  const std::vector<Candidate> base = probe.at(kBaseLayers, all);
  auto none_fit = [](const std::vector<Candidate>& c) {
    return std::none_of(c.begin(), c.end(), [](const Candidate& x) { return x.shortfalls.empty(); });
  };
  if (none_fit(base)) {
    if (!fits(1)) return std::nullopt;
    lo = bisect(1, kBaseLayers, fits);
  } else {
    const std::vector<Candidate> slope = probe.at(kSlopeLayers, all);
    std::vector<std::size_t> deeper;  // indices into all of those that fit at kSlopeLayers
    for (std::size_t i = 0; i < slope.size(); ++i)
      if (slope[i].shortfalls.empty()) deeper.push_back(i);
    if (deeper.empty()) {
      lo = bisect(kBaseLayers, kSlopeLayers, fits);
    } else {
      // 2. The extrapolation from the two small depths.
      int64_t d = kSlopeLayers;
      std::vector<int64_t> guess(all.size(), 0);
      for (std::size_t i : deeper) {
        guess[i] = extrapolated_depth(all[i], r.hw, kBaseLayers, base[i].per_device, kSlopeLayers,
                                      slope[i].per_device, limit);
        d = std::max(d, guess[i]);
      }
      if (d >= limit) throw too_deep();
      // 3. The promising configurations exactly at d, extrapolated again from their last two
      // exact depths, until the estimate stays (a secant iteration per configuration: the
      // peaks are piecewise affine, e.g. stage 3's prefetch buffers grow with L up to their
      // cap, so the slope of small depths can be far from the slope near the answer).
      std::vector<Strategy> top;
      std::vector<std::size_t> top_index;  // into all
      std::vector<bool> in_top(all.size(), false);
      std::vector<PerDevice> prev_peaks, last_peaks;  // per top configuration, at the last two
                                                      // depths probed (older_depth, last_depth)
      for (std::size_t i : deeper)
        if (guess[i] >= d / kTopFraction) {
          top.push_back(all[i]);
          in_top[i] = true;
          top_index.push_back(i);
          prev_peaks.push_back(base[i].per_device);
          last_peaks.push_back(slope[i].per_device);
        }
      std::map<int64_t, bool> fits_top_at;  // exact probes of `top`
      int64_t last_depth = kSlopeLayers, older_depth = kBaseLayers;
      int64_t estimate = d;
      for (int k = 0; k < kMaxRefinements && estimate > kSlopeLayers && !fits_top_at.contains(estimate); ++k) {
        const int64_t at = estimate;
        const std::vector<Candidate> c = probe.at(at, top);
        bool any = false;
        estimate = kSlopeLayers;
        for (std::size_t j = 0; j < top.size(); ++j) {
          any = any || c[j].shortfalls.empty();
          prev_peaks[j] = std::exchange(last_peaks[j], c[j].per_device);
        }
        fits_top_at[at] = any;
        older_depth = std::exchange(last_depth, at);
        std::vector<int64_t> e(top.size());
        for (std::size_t j = 0; j < top.size(); ++j) {
          e[j] = extrapolated_depth(top[j], r.hw, older_depth, prev_peaks[j], last_depth,
                                    last_peaks[j], limit);
          estimate = std::max(estimate, e[j]);
        }
        // Those now extrapolated well short of the deepest, and not fitting here, leave `top`
        // for the confirmation of step 5. A probe that fit may have fit by them: forgotten.
        std::size_t kept = 0;
        for (std::size_t j = 0; j < top.size(); ++j) {
          if (e[j] < estimate - estimate / kKeepFraction && !c[j].shortfalls.empty()) {
            in_top[top_index[j]] = false;
            continue;
          }
          top[kept] = top[j];
          top_index[kept] = top_index[j];
          prev_peaks[kept] = prev_peaks[j];
          last_peaks[kept] = last_peaks[j];
          ++kept;
        }
        if (kept < top.size()) {
          top.resize(kept);
          top_index.resize(kept);
          prev_peaks.resize(kept);
          last_peaks.resize(kept);
          std::erase_if(fits_top_at, [&](const auto& kv) { return kv.second && kv.first != at; });
        }
      }
      if (estimate >= limit) throw too_deep();
      // 4. Exact probes of the promising configurations around the estimate. They fit at
      // kSlopeLayers (exactly), which bounds the walk down.
      auto fits_top = [&](int64_t L) {
        if (L <= kSlopeLayers) return true;
        auto [it, inserted] = fits_top_at.try_emplace(L, false);
        if (inserted) it->second = probe.any_fits(L, top);
        return it->second;
      };
      int64_t hi = 0;
      if (fits_top(estimate)) {
        lo = estimate;
        for (int64_t step = 1;; step *= 2) {
          hi = lo + step;
          if (hi >= limit) {
            if (fits_top(limit)) throw too_deep();
            hi = limit;
            break;
          }
          if (!fits_top(hi)) break;
          lo = hi;
        }
      } else {
        hi = estimate;
        for (int64_t step = 1;; step *= 2) {
          lo = std::max(kSlopeLayers, hi - step);
          if (fits_top(lo)) break;
          hi = lo;
        }
      }
      lo = bisect(lo, hi, fits_top);
      // 5. Confirmation with the whole search at lo + 1: `top` does not fit there (probed), the
      // others are evaluated now. When one fits (the extrapolation set it aside wrongly), plain
      // doubling and bisection with the whole search goes on from there.
      std::vector<Strategy> rest;
      for (std::size_t i = 0; i < all.size(); ++i)
        if (!in_top[i]) rest.push_back(all[i]);
      if (fits_top(lo + 1) || (!rest.empty() && probe.any_fits(lo + 1, rest))) {
        lo = lo + 1;
        for (int64_t step = 1;; step *= 2) {
          const int64_t next = lo + step;
          if (next >= limit) {
            if (fits(limit)) throw too_deep();
            lo = bisect(lo, limit, fits);
            break;
          }
          if (!fits(next)) {
            lo = bisect(lo, next, fits);
            break;
          }
          lo = next;
        }
      }
    }
  }
  if (lo >= limit) throw too_deep();
  MaxModel m;
  m.model = r.model;
  m.model.n_layer = lo;
  m.params = static_cast<uint64_t>(models::count_params(m.model).total);
  FitRequest q = r;
  q.model = m.model;
  m.search = fit(q);
  m.best = m.search.candidates.front();
  m.n_probes = probe.n_probes();
  return m;
}

nlohmann::json deepspeed_config(const Strategy& s) {
  using nlohmann::json;
  json j = {{"train_micro_batch_size_per_gpu", s.micro_batch},
            {"gradient_accumulation_steps", s.grad_accum},
            {"train_batch_size", s.micro_batch * s.grad_accum * s.dp}};
  if (s.precision == Precision::fp16) j["fp16"] = {{"enabled", true}};
  if (s.precision == Precision::bf16) j["bf16"] = {{"enabled", true}};
  // The optimizer by the name DeepSpeed builds it from (apply_deepspeed_config reads it
  // back): Lion is its FusedLion, SGD and Adafactor are torch.optim's (SGD's momentum defaults
  // to 0). bitsandbytes' 8-bit Adam is a client optimizer given to deepspeed.initialize, with
  // no optimizer section (deepspeed_notes). ZeRO takes an optimizer outside its tested list
  // (deepspeed/runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS: Adam, AdamW, Adagrad, Lion and
  // their fused and CPU kernels) only with zero_allow_untested_optimizer.
  switch (s.optimizer) {
    case OptimizerKind::adam: j["optimizer"] = {{"type", "Adam"}}; break;
    case OptimizerKind::adamw: j["optimizer"] = {{"type", "AdamW"}}; break;
    case OptimizerKind::sgd:
      j["optimizer"] = {{"type", "SGD"}, {"params", {{"momentum", 0.9}}}};
      break;
    case OptimizerKind::sgd_plain: j["optimizer"] = {{"type", "SGD"}}; break;
    case OptimizerKind::lion: j["optimizer"] = {{"type", "Lion"}}; break;
    case OptimizerKind::adafactor: j["optimizer"] = {{"type", "Adafactor"}}; break;
    case OptimizerKind::adam8bit: break;
  }
  const bool zero_tested = s.optimizer == OptimizerKind::adam ||
                           s.optimizer == OptimizerKind::adamw || s.optimizer == OptimizerKind::lion;
  if (s.stage >= 1 && !zero_tested) j["zero_allow_untested_optimizer"] = true;
  json zo = {{"stage", s.stage},
             // what the prediction assumed (two buckets alive with it on)
             {"overlap_comm", overlaps_comm(s)},
             {"contiguous_gradients", true},
             {"reduce_bucket_size", s.buffers.reduce_bucket_size},
             {"allgather_bucket_size", s.buffers.allgather_bucket_size}};
  auto offload = [](Offload o) {
    json x = {{"device", std::string(to_string(o))}, {"pin_memory", true}};
    if (o == Offload::nvme) x["nvme_path"] = "/local_nvme";
    return x;
  };
  // The swap buffers under DeepSpeed's names: the optimizer pipeline's buffer sets, the
  // parameter swapper's buffer count and size.
  if (s.offload_optimizer != Offload::none) {
    zo["offload_optimizer"] = offload(s.offload_optimizer);
    if (s.offload_optimizer == Offload::nvme)
      zo["offload_optimizer"]["buffer_count"] = s.buffers.optimizer_swap_buffer_count;
  }
  if (s.offload_param != Offload::none) {
    zo["offload_param"] = offload(s.offload_param);
    if (s.offload_param == Offload::nvme) {
      zo["offload_param"]["buffer_count"] = s.buffers.param_swap_buffer_count;
      zo["offload_param"]["buffer_size"] = s.buffers.param_swap_buffer_size;
    }
  }
  if (s.stage == 3) {
    zo["stage3_prefetch_bucket_size"] = s.buffers.prefetch_bucket_size;
    zo["stage3_max_live_parameters"] = s.buffers.max_live_parameters;
  }
  j["zero_optimization"] = zo;
  // The activation_checkpointing section as the plan took it (DeepSpeed's keys and defaults,
  // deepspeed/runtime/activation_checkpointing/config.py; apply_deepspeed_config reads it
  // back): what deepspeed.checkpointing.configure(mpu, deepspeed_config=...) sets up for the
  // checkpointing the model code asks for.
  if (s.checkpointing != Checkpointing::none) {
    json ac = {{"partition_activations", s.partition_activations},
               {"cpu_checkpointing", s.cpu_checkpointing},
               {"contiguous_memory_optimization", s.contiguous_memory_optimization},
               {"synchronize_checkpoint_boundary", false},
               {"profile", false}};
    if (s.number_checkpoints > 0) ac["number_checkpoints"] = s.number_checkpoints;
    j["activation_checkpointing"] = ac;
  }
  return j;
}

std::vector<std::string> deepspeed_notes(const Strategy& s) {
  std::vector<std::string> n;
  if (s.optimizer == OptimizerKind::adam8bit)
    n.push_back("8-bit Adam has no DeepSpeed optimizer type: create bitsandbytes.optim."
                "AdamW8bit (or Adam8bit) and pass it as deepspeed.initialize(optimizer=...)");
  if (s.checkpointing == Checkpointing::selective_op)
    n.push_back("activation checkpointing (selective-op) is torchtitan's per-op policy, applied "
                "in the model code (torch.utils.checkpoint with create_selective_checkpoint_"
                "contexts), not by this config");
  else if (s.checkpointing != Checkpointing::none)
    n.push_back(fmt::format("activation checkpointing ({}) is switched on in the model code "
                            "(deepspeed.checkpointing.checkpoint or Hugging Face's "
                            "gradient_checkpointing_enable()), not by this config",
                            to_string(s.checkpointing)));
  if (s.dpu)
    n.push_back("the delayed parameter update (DPU) has no DeepSpeed config field; without it "
                "the step is slower than predicted here");
  if (s.offload_optimizer == Offload::nvme || s.offload_param == Offload::nvme)
    n.push_back("nvme_path is a placeholder (/local_nvme): point it at the NVMe mount");
  if (s.mp > 1)
    n.push_back(fmt::format("the model-parallel degree ({}) comes from the Megatron launcher "
                            "(mpu), not from this config",
                            s.mp));
  if (s.flash_attention) n.push_back("flash attention is chosen in the model code");
  if (s.ep > 1)
    n.push_back(fmt::format("the expert-parallel degree ({}) has no DeepSpeed config field: it is "
                            "deepspeed.moe.layer.MoE(ep_size={}) in the model code, and the "
                            "optimizer needs its expert param groups "
                            "(deepspeed.moe.utils.split_params_into_different_moe_groups_for_"
                            "optimizer)",
                            s.ep, s.ep));
  return n;
}

nlohmann::json to_json(const FitResult& f, const FitRequest& r) {
  using nlohmann::json;
  auto cand = [&](const Candidate& c) {
    json busy = json::object();
    for (int k = 0; k < kResources; ++k)
      busy[std::string(to_string(static_cast<Resource>(k)))] = c.busy_seconds[static_cast<std::size_t>(k)];
    json j = {{"strategy", to_json(c.strategy)},
              {"per_device", to_json(c.per_device)},
              {"fits", c.shortfalls.empty()},
              {"shortfalls", c.shortfalls}};
    if (c.shortfalls.empty()) {
      j["step_seconds"] = c.step_seconds;
      j["tflops_per_gpu"] = c.tflops_per_gpu;
      j["tokens_per_second"] = c.tokens_per_second;
      j["busy_seconds"] = busy;
      j["why"] = c.why;
    }
    return j;
  };
  json cs = json::array();
  for (const Candidate& c : f.candidates) cs.push_back(cand(c));
  json j = {{"schema", "zero-plan/fit/v1"},
            {"model", model_json(r.model, models::count_params(r.model))},
            {"hardware", r.hw.name},
            {"gpus", f.gpus},
            {"nodes", f.nodes},
            {"profile", to_string(r.options.profile)},
            {"n_searched", f.n_searched},
            {"n_fit", f.n_fit},
            {"candidates", cs}};
  if (f.closest) j["closest"] = cand(*f.closest);
  return j;
}

nlohmann::json to_json(const MaxModel& m, const models::ParamInventory& inv) {
  nlohmann::json cfg = nlohmann::json::parse(models::to_hf_config(m.model));
  return {{"params", inv.total},
          {"n_layer", m.model.n_layer},
          {"config", cfg},
          {"strategy", to_json(m.best.strategy)},
          {"step_seconds", m.best.step_seconds},
          {"tflops_per_gpu", m.best.tflops_per_gpu}};
}

// DeepSpeed's arithmetic, operation for operation: Python's int * int is exact, int * float
// and true division round to double, int() truncates.
DsEstimate ds_estimate_zero2(uint64_t total_params, int64_t gpus_per_node, int64_t nodes,
                             bool cpu_offload, double additional_buffer_factor) {
  const uint64_t total_gpus = static_cast<uint64_t>(nodes * gpus_per_node);
  DsEstimate e;
  if (cpu_offload) {
    // gpu_mem = 2 * total_params
    // cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    e.gpu_bytes = 2 * total_params;
    e.cpu_bytes = static_cast<uint64_t>(
        static_cast<double>(total_params * std::max<uint64_t>(4 * total_gpus, 16)) *
        additional_buffer_factor);
  } else {
    // gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)
    // cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    e.gpu_bytes = 4 * total_params + static_cast<uint64_t>(static_cast<double>(16 * total_params) /
                                                           static_cast<double>(total_gpus));
    e.cpu_bytes = static_cast<uint64_t>(
        static_cast<double>(total_params * 4 * static_cast<uint64_t>(gpus_per_node)) *
        additional_buffer_factor);
  }
  return e;
}

DsEstimate ds_estimate_zero3(uint64_t total_params, uint64_t largest_layer_params,
                             int64_t gpus_per_node, int64_t nodes, bool cpu_offload,
                             bool cpu_offload_params, bool zero_init,
                             double additional_buffer_factor) {
  const uint64_t total_gpus = static_cast<uint64_t>(nodes * gpus_per_node);
  const double gpus_factor = 1.0 / static_cast<double>(nodes);
  const uint64_t largest_layer_memory = 4 * largest_layer_params;
  const double tp = static_cast<double>(total_params);
  // max(4 * num_gpus_per_node, k * gpus_factor): an int or a float, whichever is larger.
  auto cold = [&](uint64_t k) {
    const uint64_t a = 4 * static_cast<uint64_t>(gpus_per_node);
    const double b = static_cast<double>(k) * gpus_factor;
    const double prod = static_cast<double>(a) >= b ? static_cast<double>(total_params * a) : tp * b;
    return static_cast<uint64_t>(prod * additional_buffer_factor);
  };
  DsEstimate e;
  e.largest_layer_bytes = largest_layer_memory;
  if (cpu_offload) {
    if (cpu_offload_params) {
      // gpu_mem = largest_layer_memory; cpu_mem = total_params * 18 * gpus_factor * factor
      e.gpu_bytes = largest_layer_memory;
      e.cpu_bytes = zero_init ? static_cast<uint64_t>(static_cast<double>(total_params * 18) *
                                                      gpus_factor * additional_buffer_factor)
                              : cold(18);
    } else {
      // gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
      e.gpu_bytes = largest_layer_memory +
                    static_cast<uint64_t>(static_cast<double>(2 * total_params) / static_cast<double>(total_gpus));
      e.cpu_bytes = zero_init ? static_cast<uint64_t>(static_cast<double>(total_params * 16) *
                                                      gpus_factor * additional_buffer_factor)
                              : cold(16);
    }
  } else {
    // gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
    e.gpu_bytes = largest_layer_memory +
                  static_cast<uint64_t>(static_cast<double>(18 * total_params) / static_cast<double>(total_gpus));
    e.cpu_bytes = zero_init
                      ? static_cast<uint64_t>(static_cast<double>(largest_layer_params * 4 *
                                                                  static_cast<uint64_t>(gpus_per_node)) *
                                              additional_buffer_factor)
                      : static_cast<uint64_t>(static_cast<double>(total_params * 4 *
                                                                  static_cast<uint64_t>(gpus_per_node)) *
                                              additional_buffer_factor);
  }
  return e;
}

}  // namespace zp::planner
