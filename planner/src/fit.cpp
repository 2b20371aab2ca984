// fit.cpp: the configuration search of `zero-plan fit`, the largest model that fits, the
// DeepSpeed config of the winner and DeepSpeed's own estimators. Not a second memory model:
// memory comes from the schedule replay of schedule.cpp, cached per shape.
#include "zp/planner/fit.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <set>
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

// The last: sequence parallelism, the pipeline stage (pp, pp_stage, pp_chunks: a pipeline's
// strategy has one shape per stage) and context parallelism (cp, Ulysses or the ring).
using ShapeKey = std::tuple<int64_t, int64_t, uint32_t, bool, int, bool, int64_t, bool, uint32_t, bool,
                            int64_t, bool, int64_t, double, bool, bool, bool,
                            std::tuple<bool, int64_t, int64_t, int64_t, int64_t, bool>>;
ShapeKey shape_key(const models::GraphOptions& g) {
  return {g.batch, g.seq, g.act_bytes, g.dropout, static_cast<int>(g.recompute), g.flash_attention,
          g.tp, g.partition_checkpoints, g.param_bytes, g.f32_weight_scratch,
          g.ep, g.moe_worst_case, g.seq_target, g.moe_capacity_factor, g.hf_modeling,
          g.autocast, g.softmax_keeps_input,
          {g.sp, g.pp, g.pp_stage, g.pp_chunks, g.cp, g.cp_ulysses}};
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
  PerDevice memory(Shape& sh, const Strategy& s);
  // Of that, the step's replay without the persistent states and host buffers (zeroplan
  // profile), or the whole replay (the others); `part`: the rank's ZeRO partition.
  PerDevice dynamic(Shape& sh, const Strategy& s, uint64_t part) const;
};

FitEvaluator::FitEvaluator(models::ModelSpec model, PlanOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->model = std::move(model);
  impl_->options = options;
}
FitEvaluator::~FitEvaluator() = default;
FitEvaluator::FitEvaluator(FitEvaluator&&) noexcept = default;

uint64_t FitEvaluator::n_shapes() const { return impl_->shapes.size(); }

void FitEvaluator::release_graphs() {
  for (auto& [k, sh] : impl_->shapes) Impl::release(sh);
}

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
  for (int64_t st = 0; st < s.pp; ++st) stages.push_back(stage_memory(s, st));
  return most_loaded(stages, s, nullptr).per_device;
}

PerDevice FitEvaluator::stage_memory(const Strategy& s, int64_t stage) {
  return impl_->memory(impl_->shape(s, stage), s);
}

namespace {

// The ZeRO partition of a rank's groups (schedule.hpp's partition_elems; expert parameters
// over dp/ep): for a stage >= 1 what the rank keeps of them, else all n_params over dp.
uint64_t partition_of(const std::vector<uint64_t>& groups, const std::vector<uint64_t>& experts,
                      uint64_t n_params, const Strategy& s) {
  // ZeRO's group: the data- and context-parallel ranks (zero_dp; schedule.cpp's dp_).
  const uint64_t dp = static_cast<uint64_t>(zero_dp(s));
  return s.stage >= 1 ? partition_elems(groups, experts, s.stage, dp, static_cast<uint64_t>(expert_dp(s)))
                      : zp::partition_elems(n_params, dp);
}

// The zeroplan profile's persistent states of a rank holding n_params parameters, partition
// `part`, replayed alone (cached by StatesKey: one cache per n_params).
PerDevice states_memory(std::map<StatesKey, PerDevice>& cache, uint64_t n_params, uint64_t part,
                        const Strategy& s, uint32_t p_bytes, std::optional<uint64_t> per_tensor,
                        const PlanOptions& o) {
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
  auto st = cache.find(skey);
  if (st == cache.end()) {
    MemorySchedule states_only;
    // Stage 0 hands the optimizer the model's tensors: Adafactor's and 8-bit Adam's bytes
    // follow their shapes (the stage and optimizer are in the key).
    append_model_states(states_only, n_params, part, s, p_bytes, StateLayout::zero, per_tensor);
    st = cache.emplace(skey, replay(states_only, o).per_device).first;
  }
  return st->second;
}

// The host tier's offload buffers (append_offload_buffers) of partition `part`, replayed alone.
PerDevice host_memory(std::map<HostKey, PerDevice>& cache, const Strategy& s, uint64_t part,
                      uint32_t p_bytes, const PlanOptions& o) {
  const HostKey hkey{offload_tile_bytes(s, part, p_bytes),
                     s.offload_optimizer == Offload::nvme && !s.dpu
                         ? optimizer_swap_buffer_bytes(s, part)
                         : 0};
  auto hb = cache.find(hkey);
  if (hb == cache.end()) {
    MemorySchedule host_only;
    append_offload_buffers(host_only, 0, s, part, p_bytes);
    hb = cache.emplace(hkey, replay(host_only, o).per_device).first;
  }
  return hb->second;
}

}  // namespace

PerDevice FitEvaluator::Impl::dynamic(Shape& sh, const Strategy& s, uint64_t part) const {
  const PlanOptions& o = options;
  const bool whole = o.profile != Profile::zeroplan;  // PyTorch: replayed whole
  const uint32_t p_bytes = sh.graph.options.param_bytes;
  // Stages 0 and 1 differ only in states (both keep whole gradients, no buckets): one replay.
  const DynKey key{whole || s.stage >= 2 ? s.stage : 1,
                   s.stage == 3 || whole ? zero_dp(s) : 0,
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
  return it->second;
}

PerDevice FitEvaluator::Impl::memory(Shape& sh, const Strategy& s) {
  const uint64_t part = partition_of(sh.group_elems, sh.group_expert_elems, sh.costs.n_params, s);
  const PerDevice dyn = dynamic(sh, s, part);
  if (options.profile != Profile::zeroplan) return dyn;  // replayed whole
  const uint32_t p_bytes = sh.graph.options.param_bytes;
  const PerDevice states = states_memory(sh.states, sh.costs.n_params, part, s, p_bytes,
                                         per_tensor_optimizer_bytes(sh.graph, s, options), options);
  return add(add(states, host_memory(sh.host_buffers, s, part, p_bytes, options)), dyn);
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
  const double ranks = static_cast<double>(std::min<int64_t>(world_size(s), hw.gpus_per_node));
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

// Whether the model's graph takes a strategy's tensor, sequence, pipeline and context
// parallelism (graph.cpp refuses by name what it does not model: sequence parallelism of MoE
// or post-norm blocks, context parallelism of encoder-decoder models, a tp that does not
// divide the heads, ...): one block per model chunk of the first and last stage is built.
// Cached per combination.
class ParallelProbe {
 public:
  ParallelProbe(const models::ModelSpec& m, const PlanOptions& o) : model_(m), options_(o) {}
  bool accepts(const Strategy& s) {
    const auto key = std::make_tuple(s.mp, s.sp, s.cp, static_cast<int>(s.cp_kind), s.pp, s.vp, s.ep);
    auto it = known_.find(key);
    if (it != known_.end()) return it->second;
    bool ok = true;
    try {
      models::ModelSpec m = model_;
      // Up to 8 blocks per model chunk: the layers' kinds (dense or MoE, sliding or global)
      // as the model mixes them, at a fraction of a deep model's graph.
      if (!m.encoder_decoder())
        m.n_layer = s.pp * s.vp * std::min<int64_t>(8, m.n_layer / (s.pp * s.vp));
      models::GraphOptions go = graph_options(m, s, options_);
      go.batch = 1;
      for (int64_t st : {int64_t{0}, s.pp - 1}) {
        go.pp_stage = st;
        (void)models::build_training_graph(m, go);
      }
    } catch (const Error&) {
      ok = false;
    }
    known_.emplace(key, ok);
    return ok;
  }

 private:
  models::ModelSpec model_;
  PlanOptions options_;
  std::map<std::tuple<int64_t, bool, int64_t, int, int64_t, int64_t, int64_t>, bool> known_;
};

// The search space of `r`, round by round: the model-parallel degrees are tried in rounds
// (1 first; the next only when nothing fits), each round's configurations in search order.
// A `parallel` search is one round of every tensor, sequence, pipeline and context parallel
// combination (FitRequest).
std::vector<std::vector<Strategy>> configurations(const FitRequest& r, const Cluster2& cl2) {
  Strategy base = resolve_for_model(r.base, r.model);
  // PyTorch FSDP: FULL_SHARD with and without resharding after forward (SHARD_GRAD_OP), with
  // and without its CPU offload (--offload-param cpu: parameters, gradients and the step on
  // the host), hybrid sharding as the base asks; no optimizer-only or NVMe offload, no tensor
  // or expert parallelism (check_profile).
  const bool fsdp = r.options.profile == Profile::fsdp;
  const bool pytorch = r.options.profile == Profile::pytorch;  // stage 0 only
  const bool parallel = r.parallel && !fsdp && !pytorch;
  std::vector<int64_t> tps;  // every tensor-parallel degree the rounds would try
  for (int64_t mp = 2; mp <= r.hw.gpus_per_node; mp *= 2)
    if (cl2.gpus % mp == 0 && r.model.n_head % mp == 0 && r.model.n_kv_head % mp == 0 &&
        r.model.n_inner % mp == 0)
      tps.push_back(mp);
  std::vector<std::vector<int64_t>> mp_rounds;
  if (fsdp || pytorch) {
    mp_rounds.push_back({1});
  } else if (!r.mps.empty()) {
    mp_rounds.push_back(r.mps);
  } else if (parallel) {
    mp_rounds.push_back({1});
    mp_rounds.front().insert(mp_rounds.front().end(), tps.begin(), tps.end());
  } else {
    mp_rounds.push_back({1});
    for (int64_t mp : tps) mp_rounds.push_back({mp});
  }
  // Sequence, pipeline and context parallelism: as given, searched, or the base's.
  const int64_t T = base.seq;
  std::vector<bool> sps = !r.sps.empty() ? r.sps
                          : parallel     ? std::vector<bool>{false, true}
                                         : std::vector<bool>{base.sp};
  std::vector<int64_t> pps = r.pps, vps = r.vps, cps = r.cps;
  if (pps.empty() && parallel) {
    for (int64_t pp = 1; pp <= r.model.n_blocks(); ++pp)
      if (r.model.n_blocks() % pp == 0 && cl2.gpus % pp == 0) pps.push_back(pp);
  } else if (pps.empty()) {
    pps = {base.pp};
  }
  if (vps.empty()) vps = parallel ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{base.vp};
  if (cps.empty() && parallel) {
    for (int64_t cp : {1, 2, 4, 8})
      if (cp == 1 || (T % (2 * cp) == 0 && (base.cp_kind == CpKind::ulysses || base.flash_attention)))
        cps.push_back(cp);
  } else if (cps.empty()) {
    cps = {base.cp};
  }
  ParallelProbe probe(r.model, r.options);
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
  // The ZeRO side of one parallel layout (`shape`: tp, sp, pp, vp, cp, ep, dp): every stage x
  // offload x DPU x micro-batch x checkpointing x gradient accumulation x overlap_comm.
  auto add_configurations = [&](const Strategy& shape, bool split, std::vector<Strategy>& round) {
    const int64_t dp = shape.dp;
    for (int64_t mb : r.micro_batches)
      for (Checkpointing ck : r.checkpointing)
        for (int stage : r.stages)
          for (Offload oo : r.offload_optimizer)
            for (Offload op : r.offload_param)
              for (bool dpu : r.dpu)
                for (int64_t ga0 : accums) {
                  if (fsdp && (stage != 3 || oo != Offload::none || op == Offload::nvme || dpu))
                    continue;
                  if (pytorch && (stage != 0 || oo != Offload::none || op != Offload::none || dpu))
                    continue;
                  if (op != Offload::none && stage != 3) continue;
                  if (ck == Checkpointing::selective_op && shape.ep > 1) continue;  // validate()
                  if (oo != Offload::none && stage == 0) continue;
                  if (dpu && oo == Offload::none) continue;
                  if (shape.pp > 1 && stage >= 2) continue;  // validate(): DeepSpeed's PipelineEngine
                  int64_t ga = ga0;
                  if (r.global_batch > 0) {
                    if (ga0 != accums.front()) continue;  // one count: the global batch's
                    if (r.global_batch % (mb * dp) != 0) continue;
                    ga = r.global_batch / (mb * dp);
                  }
                  Strategy s = shape;
                  s.stage = stage;
                  s.offload_optimizer = oo;
                  s.offload_param = op;
                  s.dpu = dpu;
                  s.grad_accum = ga;
                  s.micro_batch = mb;
                  s.checkpointing = ck;
                  if (ck != Checkpointing::full)  // DeepSpeed's section needs a checkpoint
                    s.partition_activations = s.cpu_checkpointing =
                        s.contiguous_memory_optimization = false;
                  if (split) {
                    // What else the strategy's checks refuse (an interleaved schedule's
                    // micro-batches, fp32 gradients beside ZeRO-2, ...).
                    try {
                      validate(s);
                    } catch (const Error&) {
                      continue;
                    }
                  }
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
                  if (stage < 2 || zero_dp(s) == 1 || base.overlap_comm) {
                    round.push_back(s);
                    continue;
                  }
                  for (bool ov : r.overlap_comm) {
                    s.overlap_comm = ov;
                    round.push_back(s);
                  }
                }
  };
  std::vector<std::vector<Strategy>> rounds;
  for (const auto& mps : mp_rounds) {
    std::vector<Strategy>& round = rounds.emplace_back();
    for (int64_t mp : mps) {
      if (cl2.gpus % mp != 0)
        throw Error(fmt::format("--tp {}: does not divide --gpus {}", mp, cl2.gpus),
                    "the data-parallel degree is gpus / mp");
      for (bool sp : sps)
        for (int64_t pp : pps)
          for (int64_t vp : vps)
            for (int64_t cp : cps) {
              // Sequence parallelism splits the tensor-parallel ranks' sequence: none without them.
              if ((sp && mp == 1) || pp < 1 || vp < 1 || cp < 1) continue;
              if (cl2.gpus % (mp * pp * cp) != 0 || (vp > 1 && pp == 1)) continue;
              if (r.model.n_blocks() % (pp * vp) != 0) continue;
              const bool split = sp || pp > 1 || cp > 1;  // beyond what the rounds searched before
              Strategy shape = base;
              shape.mp = mp;
              shape.sp = sp;
              shape.pp = pp;
              shape.vp = vp;
              shape.cp = cp;
              shape.dp = cl2.gpus / (mp * pp * cp);
              shape.pp_schedule = pp == 1   ? PipelineSchedule::one_f_one_b
                                  : vp > 1 ? PipelineSchedule::interleaved
                                  : base.pp_schedule == PipelineSchedule::interleaved
                                      ? PipelineSchedule::one_f_one_b
                                      : base.pp_schedule;
              for (int64_t ep : eps_for(shape.dp)) {
                shape.ep = ep;
                if (split && !probe.accepts(shape)) continue;
                add_configurations(shape, split, round);
              }
            }
    }
  }
  return rounds;
}

// Screening (FitRequest::exhaustive off; a parallel search of a model whose blocks are all
// alike). A configuration's pipeline stage holds M = L / (pp vp) blocks per model chunk, and
// what it needs grows with M. Its first stage, stage 1 (of the middle stages the one with
// the most micro-batches in flight under every schedule pipeline.hpp knows: in_flight_closed_
// form does not grow with the stage; the middle stages are otherwise alike) and its last are
// built at two small depths, lo and hi blocks per chunk (the model cut to pp vp lo and pp vp hi
// layers; a stage's graph holds its own blocks only), lo past the depth where ZeRO's buffers
// are full (gradient buckets, stage 3's live parameters: below it they grow with the depth).
// From them, for the stage at M:
//  - the model states and host buffers exactly: the partition of the stage's groups (its
//    embedding's and head's, and M vp copies of a block's) replayed as FitEvaluator does;
//  - the step's replay on the line through the two depths: what is allocated at its peak
//    grows by the same bytes a block, but for the allocator's overhead (the holes fewer blocks
//    leave fill up with more) and ZeRO's buffers (bounded, their flushes falling differently
//    at every depth), so `least` leaves both out, a floor under the peak, and per_device adds
//    the deeper depth's overhead and the larger buffers (which err high);
//  - the step costs exactly: the graph's groups at M are its embedding's, its head's and M vp
//    copies of its blocks' (all alike, checked), which simulate() and simulate_pipeline()
//    time as they time the whole graph's.
// A configuration whose floor misses a capacity by more than kScreenSlack is taken not to fit
// (and counted so in n_fit); the others are simulated, and evaluated exactly (every stage's
// whole graph, its replays, its simulated step) fastest first, until the next one's throughput
// cannot reach the top (to the search's 0.1% buckets). So the result is the exhaustive
// search's unless a floor is more than kScreenSlack above its exact peak; test_fit_parallel.cpp
// compares the two searches, and the floor and the step with exact ones.
constexpr int64_t kScreenLow = 1, kScreenHigh = 2;  // blocks per model chunk, at least
constexpr double kScreenSlack = 0.05;

bool uniform_blocks(const models::ModelSpec& m) {
  return !m.encoder_decoder() &&
         (m.window.size == 0 || (m.window.pattern.empty() && m.window.from_layer == 0)) &&
         (!m.is_moe() || (m.moe.first_dense == 0 && m.moe.step == 1 && m.moe.dense_layers.empty()));
}

// The line through (lo, a) and (hi, b), read at x.
double line(double a, double b, int64_t lo, int64_t hi, int64_t x) {
  return b + (b - a) * static_cast<double>(x - hi) / static_cast<double>(hi - lo);
}
uint64_t line_bytes(uint64_t a, uint64_t b, int64_t lo, int64_t hi, int64_t x) {
  const double v = line(static_cast<double>(a), static_cast<double>(b), lo, hi, x);
  return v <= 0 ? 0 : v >= 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(std::llround(v));
}
// A replay's memory at depth x from depths lo < hi: what is allocated at the peak on the line,
// but for two parts that are not: the allocator's overhead (the allocations of more blocks
// fill the holes fewer leave: llama-3.1-8b at stage 3 with full recomputation, 715 MB at 4
// blocks, 447 MB at 8, 111 MB from 16 on, while the allocated bytes grow by 121.6 MB a block
// throughout) and ZeRO's buffers (buckets whose flushes fall differently with every depth:
// at stage 2 with dp x cp 16 and overlap_comm, 2.80, 3.23, 2.44, 2.30 and 2.88 GB at 4, 5, 6,
// 8 and 32 blocks). The estimate (with_extras) adds the deeper depth's overhead and the larger
// depth's buffers; the floor adds neither, both being at least 0.
PerDevice line(const PerDevice& a, const PerDevice& b, int64_t lo, int64_t hi, int64_t x,
               bool with_extras) {
  PerDevice d;
  for (Tier t : kTiers) {
    uint64_t extras[2] = {0, 0};  // at lo, at hi
    for (const PerDevice* p : {&a, &b}) {
      uint64_t& e = extras[p == &b];
      e = std::min((*p)[t][Category::overhead] + (*p)[t][Category::buffers], p->peak(t));
    }
    for (Category c : kCategories)
      d[t][c] = c == Category::overhead ? (with_extras ? b[t][c] : 0)
                : c == Category::buffers ? (with_extras ? std::max(a[t][c], b[t][c]) : 0)
                                         : line_bytes(a[t][c], b[t][c], lo, hi, x);
    const uint64_t extra = with_extras ? checked_add(b[t][Category::overhead],
                                                     std::max(a[t][Category::buffers], b[t][Category::buffers]),
                                                     "bytes")
                                       : 0;
    d.set_peak(t, checked_add(line_bytes(a.peak(t) - extras[0], b.peak(t) - extras[1], lo, hi, x),
                              extra, "bytes"));
  }
  return d;
}

bool same_collectives(const std::vector<TpCollective>& a, const std::vector<TpCollective>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].kind != b[i].kind || a[i].bytes != b[i].bytes || a[i].overlap_flops != b[i].overlap_flops)
      return false;
  return true;
}
bool same_group(const StepCosts& c, std::size_t i, std::size_t j) {
  auto at = [](const auto& v, std::size_t k) { return k < v.size() ? v[k] : decltype(v[k]){}; };
  return c.fwd_flops[i] == c.fwd_flops[j] && c.bwd_flops[i] == c.bwd_flops[j] &&
         c.fwd_bytes[i] == c.fwd_bytes[j] && c.bwd_bytes[i] == c.bwd_bytes[j] &&
         c.group_params[i] == c.group_params[j] && at(c.group_expert_params, i) == at(c.group_expert_params, j) &&
         at(c.a2a_fwd_bytes, i) == at(c.a2a_fwd_bytes, j) && at(c.a2a_bwd_bytes, i) == at(c.a2a_bwd_bytes, j) &&
         same_collectives(c.tp_fwd[i], c.tp_fwd[j]) && same_collectives(c.tp_bwd[i], c.tp_bwd[j]) &&
         (c.cp_fwd.empty() || (same_collectives(c.cp_fwd[i], c.cp_fwd[j]) &&
                               same_collectives(c.cp_bwd[i], c.cp_bwd[j])));
}

// The costs of stage `st` of a strategy at L layers from the same stage's graph at fewer
// (hi, whose held blocks are alike; lo for the totals' line): its embedding and head groups
// as they are, every block it holds at L a copy of hi's first. nullopt when hi's blocks differ.
std::optional<StepCosts> costs_at(const StepCosts& lo, const StepCosts& hi, const Strategy& s,
                                  int64_t st, int64_t L) {
  const std::size_t n_hi = hi.group_params.size();
  std::size_t rep = 0;
  int64_t held_lo = 0, held_hi = 0;
  for (std::size_t i = 1; i + 1 < n_hi; ++i) {
    if (hi.group_params[i] == 0) continue;
    if (rep == 0) rep = i;
    else if (!same_group(hi, rep, i)) return std::nullopt;
    ++held_hi;
  }
  for (std::size_t i = 1; i + 1 < lo.group_params.size(); ++i) held_lo += lo.group_params[i] > 0;
  if (rep == 0 || held_hi == held_lo) return std::nullopt;
  const std::size_t n = static_cast<std::size_t>(L + 2);
  StepCosts c = hi;  // scalars and per-stage fields; the groups below
  auto resize = [&](auto& v) {
    using V = std::decay_t<decltype(v)>;
    if (v.empty()) return;
    V out(n);
    out[0] = v[0];
    out[n - 1] = v[n_hi - 1];
    for (const auto& [a, e] : models::stage_blocks(L, s.pp, s.vp, st))
      for (int64_t j = a; j < e; ++j) out[static_cast<std::size_t>(j + 1)] = v[rep];
    v = std::move(out);
  };
  resize(c.fwd_flops);
  resize(c.bwd_flops);
  resize(c.fwd_bytes);
  resize(c.bwd_bytes);
  resize(c.group_params);
  resize(c.group_expert_params);
  resize(c.a2a_fwd_bytes);
  resize(c.a2a_bwd_bytes);
  resize(c.tp_fwd);
  resize(c.tp_bwd);
  resize(c.cp_fwd);
  resize(c.cp_bwd);
  c.n_params = c.n_expert_params = 0;
  for (uint64_t p : c.group_params) c.n_params += p;
  for (uint64_t p : c.group_expert_params) c.n_expert_params += p;
  const int64_t held = s.vp * (L / (s.pp * s.vp));
  auto total = [&](double a, double b) {
    return b + (b - a) * static_cast<double>(held - held_hi) / static_cast<double>(held_hi - held_lo);
  };
  c.flops_executed = total(lo.flops_executed, hi.flops_executed);
  c.flops_model = total(lo.flops_model, hi.flops_model);
  c.pp_stage = st;
  c.n_layer = L;
  return c;
}

struct Screened {
  PerDevice per_device;  // the most loaded stage's (gpu peak), on the line
  PerDevice least;       // per tier, the largest stage's peak without any overhead: a floor
  bool candidate = false;  // the floor fits within kScreenSlack
  // (candidates) every stage's costs at full depth, shared by the family's configurations,
  // and the least the step can take: its passes on the GPU's stream (their compute and the
  // collectives they wait for) for every micro-batch, or through the schedule's makespan.
  std::shared_ptr<const std::vector<StepCosts>> costs;
  double min_step = 0;
};

// The simulated step of a configuration whose costs the screen built (only its numbers: the
// tasks' storage goes back for the next simulation).
Timeline step_of(const std::vector<StepCosts>& stages, const Strategy& s, const Hardware& hw,
                 const Cluster& cl, Profile profile) {
  Timeline t = simulate_pipeline(stages, s, hw, cl, profile);
  Timeline tasks;
  tasks.tasks = std::move(t.tasks);
  recycle(std::move(tasks));
  t.critical_path.clear();
  return t;
}

}  // namespace

class Screen {
 public:
  Screen(const models::ModelSpec& m, const PlanOptions& o, const Hardware& hw, const Cluster& cl)
      : model_(m), options_(o), hw_(hw), cl_(cl) {
    loose_ = hw;
    auto widen = [](uint64_t b) {
      return static_cast<uint64_t>(std::min(1.8e19, static_cast<double>(b) * (1.0 + kScreenSlack)));
    };
    loose_.gpu_memory_bytes = widen(hw.gpu_memory_bytes);
    loose_.host_memory_bytes = widen(hw.host_memory_bytes);
    loose_.nvme_bytes = widen(hw.nvme_bytes);
  }

  // simulate: time the step of a candidate (of any configuration when `always`).
  Screened at(const Strategy& s, bool always = false) {
    const int64_t L = model_.n_layer;
    std::vector<int64_t> stages = {0};
    if (s.pp >= 3) stages.push_back(1);
    if (s.pp >= 2) stages.push_back(s.pp - 1);
    Screened out;
    bool first = true;
    for (int64_t st : stages) {
      Stage& x = stage(s, st);
      PerDevice whole;
      if (x.whole) whole = at_depth(L).stage_memory(s, st);
      const auto [d, least] = x.whole ? std::make_pair(whole, whole) : memory_on_line(s, x);
      if (first || d.peak(Tier::gpu) > out.per_device.peak(Tier::gpu)) out.per_device = d;
      for (Tier t : kTiers)
        if (first || least.peak(t) > out.least.peak(t)) out.least.set_peak(t, least.peak(t));
      first = false;
    }
    out.candidate = shortfalls(out.least, s, loose_).empty();
    if (!out.candidate && !always) return out;
    out.costs = family_costs(s);
    // The passes' least time: per stage its groups' forward and backward on the stream.
    std::vector<double> f, b;
    for (const StepCosts& c : *out.costs) {
      const auto [x, y] = pass_sums(c, s);
      f.push_back(x);
      b.push_back(y);
    }
    double least = s.pp == 1 ? static_cast<double>(s.grad_accum) * (f[0] + b[0])
                             : makespan_closed_form(s.pp_schedule, s.pp, s.grad_accum, s.vp, f, b).makespan;
    // ZeRO-3: the network runs every group's all-gather, in forward and, with resharding, again
    // in backward, one after another (so the step takes at least as long); without
    // overlap_comm each also waits for the compute before it and its compute for it
    // (simulate.cpp: "gathers and compute take turns").
    if (s.stage == 3 && s.pp == 1 && zero_dp(s) > 1 && options_.profile != Profile::fsdp) {
      const double gathers = static_cast<double>(s.grad_accum) * (s.reshard_after_forward ? 2.0 : 1.0) *
                             gather_seconds(out.costs->front(), s);
      least = overlaps_comm(s) ? std::max(least, gathers) : least + gathers;
    }
    out.min_step = least * (1.0 - 1e-9);  // the sums' rounding: a hair below
    return out;
  }
  // Drops the family's graphs and caches (no other family has its shapes); the states' and
  // host buffers' replays stay (they depend on the partition alone).
  void release() {
    for (const auto& [d, e] : depths_) n_shapes_ += e->n_shapes();
    depths_.clear();
    stages_.clear();
    costs_.clear();
    passes_.clear();
  }
  uint64_t n_shapes() const {
    uint64_t n = n_shapes_;
    for (const auto& [d, e] : depths_) n += e->n_shapes();
    return n;
  }

 private:
  // Every stage's costs at full depth (the middle stages' from stage 1's), once per family.
  std::shared_ptr<const std::vector<StepCosts>> family_costs(const Strategy& s) {
    models::GraphOptions go = graph_options(model_, s, options_);
    const ShapeKey key = shape_key(go);
    auto it = costs_.find(key);
    if (it != costs_.end()) return it->second;
    auto all = std::make_shared<std::vector<StepCosts>>();
    const int64_t L = model_.n_layer;
    for (int64_t st = 0; st < s.pp; ++st) {
      const int64_t like = st == 0 || st == s.pp - 1 ? st : 1;
      Stage& x = stage(s, like);
      if (x.whole) {
        all->push_back(at_depth(L).costs(s, st));
      } else if (st == like) {
        all->push_back(x.costs);
      } else {
        std::optional<StepCosts> c = costs_at(x.lo->costs, x.hi->costs, s, st, L);
        all->push_back(std::move(*c));  // like's were built: the blocks are alike
      }
    }
    return costs_.emplace(key, std::move(all)).first->second;
  }
  // Every group's stage-3 all-gather, as simulate() times it: its dense parameters over the
  // ZeRO group (dp x cp at stride tp), its experts' over the expert-data-parallel group.
  double gather_seconds(const StepCosts& c, const Strategy& s) const {
    const double pbytes = s.precision == Precision::fp32 ? 4.0 : 2.0;
    const int64_t zdp = zero_dp(s), edp = expert_dp(s);
    const double bus = group_bus_gbps(hw_, cl_, zdp, s.mp);
    const double ebus = group_bus_gbps(hw_, cl_, edp, s.mp * s.ep);
    double t = 0;
    for (std::size_t i = 0; i < c.group_params.size(); ++i) {
      if (c.group_params[i] == 0) continue;
      const double x = c.group_expert_params.empty() ? 0.0 : static_cast<double>(c.group_expert_params[i]) * pbytes;
      t += allgather_seconds(static_cast<double>(c.group_params[i]) * pbytes - x, zdp, bus) +
           (x > 0 ? allgather_seconds(x, edp, ebus) : 0.0);
    }
    return t;
  }
  // A stage's passes on the stream, forward and backward, summed over its groups: compute and
  // the collectives the stream waits for (PassSeconds); once per costs.
  std::pair<double, double> pass_sums(const StepCosts& c, const Strategy& s) {
    auto it = passes_.find(&c);
    if (it != passes_.end()) return it->second;
    double f = 0, b = 0;
    for (std::size_t i = 0; i < c.group_params.size(); ++i) {
      const PassSeconds x = pass_seconds(c, s, hw_, cl_, i, true);
      const PassSeconds y = pass_seconds(c, s, hw_, cl_, i, false);
      f += x.compute + x.tp_exposed + x.cp_exposed;
      b += y.compute + y.tp_exposed + y.cp_exposed;
    }
    return passes_.emplace(&c, std::make_pair(f, b)).first->second;
  }
  // One stage of a family (a shape at full depth): its graphs at the two depths, or whole.
  struct Stage {
    bool whole = true;
    int64_t lo_depth = 0, hi_depth = 0, M = 0;
    FitEvaluator::Impl::Shape* lo = nullptr;
    FitEvaluator::Impl::Shape* hi = nullptr;
    FitEvaluator* lo_e = nullptr;
    FitEvaluator* hi_e = nullptr;
    StepCosts costs;  // at full depth
  };
  Stage& stage(const Strategy& s, int64_t st) {
    models::GraphOptions go = graph_options(model_, s, options_);
    go.pp_stage = st;
    // The depths depend on the buffers' sizes too (stage, ZeRO buckets).
    const auto key = std::make_tuple(shape_key(go), s.stage, s.buffers.reduce_bucket_size,
                                     s.buffers.allgather_bucket_size, s.buffers.prefetch_bucket_size,
                                     s.buffers.max_live_parameters);
    auto [it, fresh] = stages_.try_emplace(key);
    Stage& x = it->second;
    if (!fresh) return x;
    const int64_t chunks = s.pp * s.vp;
    x.M = model_.n_layer / chunks;
    // ZeRO's buffers fill up to their sizes (gradient buckets, stage 3's live and prefetched
    // parameters): both depths past the depth where they are full, where the rest of the
    // replay is on a line (line() keeps the buffers themselves off it).
    int64_t lo_depth = kScreenLow;
    const bool buckets = s.stage >= 2 || (s.stage == 1 && options_.profile != Profile::zeroplan);
    if (buckets) {
      const FitEvaluator::Impl::Shape& probe = at_depth(chunks * kScreenLow).impl_->shape(s, st);
      uint64_t block = 0;
      for (std::size_t i = 1; i + 1 < probe.group_elems.size() && block == 0; ++i) block = probe.group_elems[i];
      if (block == 0) return x;
      uint64_t cap = std::max(s.buffers.reduce_bucket_size, s.buffers.allgather_bucket_size);
      if (s.stage == 3)
        cap = std::max({cap, s.buffers.prefetch_bucket_size, s.buffers.max_live_parameters});
      lo_depth = std::max<int64_t>(kScreenLow, static_cast<int64_t>(std::min<uint64_t>(cap / block, 1 << 20)) + 2);
    }
    const int64_t hi_depth = lo_depth + (kScreenHigh - kScreenLow);
    if (x.M <= hi_depth) return x;  // shallow enough to take whole
    x.lo_e = &at_depth(chunks * lo_depth);
    x.hi_e = &at_depth(chunks * hi_depth);
    x.lo = &x.lo_e->impl_->shape(s, st);
    x.hi = &x.hi_e->impl_->shape(s, st);
    std::optional<StepCosts> c = costs_at(x.lo->costs, x.hi->costs, s, st, model_.n_layer);
    if (!c) return x;  // blocks not alike: whole
    x.costs = std::move(*c);
    x.whole = false;
    x.lo_depth = lo_depth;
    x.hi_depth = hi_depth;
    return x;
  }
  // The stage's memory at M: states and host buffers of its partition exactly, the replay on
  // the line (line() says what it adds to the estimate and leaves out of the floor).
  // Both: {the estimate, the floor}.
  std::pair<PerDevice, PerDevice> memory_on_line(const Strategy& s, Stage& x) {
    FitEvaluator::Impl::Shape& lo = *x.lo;
    FitEvaluator::Impl::Shape& hi = *x.hi;
    if (!lo.built) FitEvaluator::Impl::build(lo, x.lo_e->impl_->model);
    if (!hi.built) FitEvaluator::Impl::build(hi, x.hi_e->impl_->model);
    const PerDevice a =
        x.lo_e->impl_->dynamic(lo, s, partition_of(lo.group_elems, lo.group_expert_elems, lo.costs.n_params, s));
    const PerDevice b =
        x.hi_e->impl_->dynamic(hi, s, partition_of(hi.group_elems, hi.group_expert_elems, hi.costs.n_params, s));
    std::pair<PerDevice, PerDevice> out{line(a, b, x.lo_depth, x.hi_depth, x.M, true),
                                        line(a, b, x.lo_depth, x.hi_depth, x.M, false)};
    if (options_.profile != Profile::zeroplan) return out;  // replayed whole
    const uint64_t part = partition_of(x.costs.group_params, x.costs.group_expert_params, x.costs.n_params, s);
    const uint32_t p_bytes = hi.graph.options.param_bytes;
    const std::optional<uint64_t> pa = per_tensor_optimizer_bytes(lo.graph, s, options_);
    const std::optional<uint64_t> pb = per_tensor_optimizer_bytes(hi.graph, s, options_);
    std::optional<uint64_t> per_tensor;
    if (pa && pb) per_tensor = line_bytes(*pa, *pb, x.lo_depth, x.hi_depth, x.M);
    const PerDevice fixed =
        add(states_memory(states_[x.costs.n_params], x.costs.n_params, part, s, p_bytes, per_tensor, options_),
            host_memory(host_, s, part, p_bytes, options_));
    return {add(fixed, out.first), add(fixed, out.second)};
  }

  FitEvaluator& at_depth(int64_t n_layer) {
    auto it = depths_.find(n_layer);
    if (it == depths_.end()) {
      models::ModelSpec m = model_;
      m.n_layer = n_layer;
      it = depths_.emplace(n_layer, std::make_unique<FitEvaluator>(m, options_)).first;
    }
    return *it->second;
  }
  models::ModelSpec model_;
  PlanOptions options_;
  Hardware hw_, loose_;
  Cluster cl_;
  std::map<int64_t, std::unique_ptr<FitEvaluator>> depths_;
  std::map<std::tuple<ShapeKey, int, uint64_t, uint64_t, uint64_t, uint64_t>, Stage> stages_;
  std::map<uint64_t, std::map<StatesKey, PerDevice>> states_;  // per n_params
  std::map<HostKey, PerDevice> host_;
  std::map<ShapeKey, std::shared_ptr<const std::vector<StepCosts>>> costs_;
  std::map<const StepCosts*, std::pair<double, double>> passes_;
  uint64_t n_shapes_ = 0;  // of the families released
};

namespace {

// Search order's rank of throughput: 0.1% buckets of log(tokens/s), as search() sorts.
int64_t throughput_bucket(double tps) { return std::llround(std::log(std::max(tps, 1e-30)) * 1000.0); }

// The screened search of one round (the Screening notes above): fits (exact) and the counts.
struct ScreenedRound {
  std::vector<std::pair<std::size_t, Candidate>> fits;  // (index in the round, exact), round order
  uint64_t n_fit = 0, n_exact = 0, n_shapes = 0, n_simulated = 0;
  std::optional<Candidate> closest;
  double closest_ratio = 1e300;
};
ScreenedRound screened_round(const FitRequest& r, FitEvaluator& ev, const std::vector<Strategy>& round,
                             const Cluster& cl) {
  PlanOptions options = r.options;
  options.gpu_capacity = r.hw.gpu_memory_bytes;
  // Families: configurations with the same graphs (stage 0's shape key at full depth), each
  // screened by one thread with its own Screen, so the result does not depend on the threads.
  std::map<ShapeKey, std::size_t> family_of;
  std::vector<std::vector<std::size_t>> families;
  for (std::size_t i = 0; i < round.size(); ++i) {
    const ShapeKey k = shape_key(graph_options(r.model, round[i], options));
    auto [it, fresh] = family_of.try_emplace(k, families.size());
    if (fresh) families.emplace_back();
    families[it->second].push_back(i);
  }
  std::vector<Screened> screened(round.size());
  std::vector<std::exception_ptr> errors(families.size());
  std::atomic<std::size_t> next{0};
  std::atomic<uint64_t> shapes{0};
  auto work = [&] {
    Screen screen(r.model, options, r.hw, cl);
    for (std::size_t f = next++; f < families.size(); f = next++) {
      try {
        for (std::size_t i : families[f]) screened[i] = screen.at(round[i]);
      } catch (...) {
        errors[f] = std::current_exception();
      }
      screen.release();
    }
    shapes += screen.n_shapes();
  };
  const unsigned threads = r.threads == 0 ? std::max(1u, std::thread::hardware_concurrency()) : r.threads;
  const std::size_t n_threads = std::min<std::size_t>(threads, families.size());
  std::vector<std::thread> pool;
  for (std::size_t t = 1; t < n_threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);

  ScreenedRound out;
  out.n_shapes = shapes;
  // Candidates, fastest first (then search order).
  std::vector<std::size_t> cands;
  std::vector<char> fits_by_line(round.size(), 0);
  std::size_t closest = round.size();
  for (std::size_t i = 0; i < round.size(); ++i) {
    const Strategy& s = round[i];
    fits_by_line[i] = shortfalls(screened[i].per_device, s, r.hw).empty();
    if (screened[i].candidate) {
      cands.push_back(i);
      continue;
    }
    const double ratio = overshoot(screened[i].per_device, s, r.hw);
    if (ratio < out.closest_ratio) {
      out.closest_ratio = ratio;
      closest = i;
    }
  }
  // Candidates by the most their throughput can be (tokens of a step over the job, as simulate
  // counts them, over the least the step can take), then search order.
  auto bound = [&](std::size_t i) {
    const Strategy& s = round[i];
    const double tokens = static_cast<double>(s.micro_batch) * static_cast<double>(s.seq) *
                          static_cast<double>(s.grad_accum) * static_cast<double>(s.dp);
    return throughput_bucket(screened[i].min_step > 0 ? tokens / screened[i].min_step : 1e300);
  };
  std::stable_sort(cands.begin(), cands.end(),
                   [&](std::size_t a, std::size_t b) { return bound(a) > bound(b); });
  // Simulated (a batch at a time, on the threads), then evaluated exactly (a batch at a time:
  // evaluate's threads work the batch's shapes) once no configuration still to simulate can
  // be faster, until nothing left can reach the top.
  std::vector<char> exact(round.size(), 0);
  std::vector<char> fits_exactly(round.size(), 0);
  auto top_bucket = [&]() -> std::optional<int64_t> {
    if (r.top == 0) return std::numeric_limits<int64_t>::max();  // nothing to show
    if (out.fits.size() < r.top) return std::nullopt;
    std::vector<int64_t> b;
    for (const auto& [i, c] : out.fits) b.push_back(throughput_bucket(c.tokens_per_second));
    std::nth_element(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(r.top - 1), b.end(), std::greater<>());
    return b[r.top - 1];
  };
  std::set<std::pair<int64_t, std::size_t>> pending;  // simulated: (-bucket, index)
  constexpr std::size_t batch_size = 16;  // the same batches whatever the threads
  std::size_t k = 0;
  for (;;) {
    const std::optional<int64_t> bar = top_bucket();
    const std::optional<int64_t> next_bound = k < cands.size() ? std::optional<int64_t>(bound(cands[k])) : std::nullopt;
    if (bar) {  // what cannot reach the top is done with
      while (!pending.empty() && -std::prev(pending.end())->first < *bar) pending.erase(std::prev(pending.end()));
      if (next_bound && *next_bound < *bar) k = cands.size();
    }
    const std::optional<int64_t> unsimulated = k < cands.size() ? next_bound : std::nullopt;
    std::vector<std::size_t> which;
    while (!pending.empty() && (!unsimulated || -pending.begin()->first >= *unsimulated) &&
           which.size() < 8) {
      which.push_back(pending.begin()->second);
      pending.erase(pending.begin());
    }
    if (!which.empty()) {
      std::vector<Strategy> batch;
      for (std::size_t i : which) batch.push_back(round[i]);
      std::vector<Candidate> got = ev.evaluate(batch, r.hw, cl, r.threads, true);
      for (std::size_t j = 0; j < got.size(); ++j) {
        exact[which[j]] = 1;
        ++out.n_exact;
        if (!got[j].shortfalls.empty()) {
          const double ratio = overshoot(got[j].per_device, got[j].strategy, r.hw);
          if (ratio < out.closest_ratio) {
            out.closest_ratio = ratio;
            out.closest = got[j];
            closest = round.size();
          }
          continue;
        }
        fits_exactly[which[j]] = 1;
        out.fits.emplace_back(which[j], std::move(got[j]));
      }
      continue;
    }
    if (!unsimulated) break;
    // Simulate the next batch.
    const std::size_t end = std::min(cands.size(), k + batch_size);
    std::vector<double> tps(end - k);
    std::atomic<std::size_t> at{k};
    auto simulate_some = [&] {
      for (std::size_t u = at++; u < end; u = at++) {
        const std::size_t i = cands[u];
        tps[u - k] = step_of(*screened[i].costs, round[i], r.hw, cl, options.profile).tokens_per_second;
      }
    };
    std::vector<std::thread> sims;
    for (std::size_t t = 1; t < std::min<std::size_t>(threads, end - k); ++t) sims.emplace_back(simulate_some);
    simulate_some();
    for (std::thread& t : sims) t.join();
    for (std::size_t u = k; u < end; ++u) {
      ++out.n_simulated;
      pending.insert({-throughput_bucket(tps[u - k]), cands[u]});
    }
    k = end;
  }
  ev.release_graphs();  // kept while the batches were worked: the same shapes come back
  for (std::size_t i = 0; i < round.size(); ++i)
    out.n_fit += exact[i] ? fits_exactly[i] : fits_by_line[i];
  // Nothing fits: the closest miss by the line, then exactly (unless one evaluated exactly was
  // closer).
  if (out.fits.empty() && closest < round.size()) {
    std::vector<Candidate> got = ev.evaluate({round[closest]}, r.hw, cl, r.threads, false);
    ++out.n_exact;
    if (got.front().shortfalls.empty()) {
      out.fits.emplace_back(closest, std::move(got.front()));
      out.n_fit += fits_by_line[closest] ? 0 : 1;
    } else {
      out.closest = std::move(got.front());
    }
  }
  std::sort(out.fits.begin(), out.fits.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

FitResult search(const FitRequest& r, FitEvaluator& ev, bool keep_graphs) {
  const Cluster2 cl2 = resolve_cluster(r);
  const Cluster cl{cl2.gpus, cl2.nodes};
  FitResult out;
  out.gpus = cl2.gpus;
  out.nodes = cl2.nodes;
  // (FSDP and plain PyTorch take no model parallelism: their search is not a parallel one.)
  out.screened = r.parallel && !r.exhaustive && uniform_blocks(r.model) &&
                 r.model.n_layer > 2 * kScreenHigh && r.options.profile != Profile::fsdp &&
                 r.options.profile != Profile::pytorch;
  std::vector<Candidate> fits;
  uint64_t n_fit = 0;
  double closest_ratio = 1e300;
  for (const std::vector<Strategy>& round : configurations(r, cl2)) {
    out.n_searched += round.size();
    if (out.screened) {
      ScreenedRound sr = screened_round(r, ev, round, cl);
      out.n_exact += sr.n_exact;
      out.n_simulated += sr.n_simulated;
      out.n_shapes += sr.n_shapes;
      n_fit += sr.n_fit;
      for (auto& [i, c] : sr.fits) fits.push_back(std::move(c));
      if (sr.closest && sr.closest_ratio < closest_ratio) {
        closest_ratio = sr.closest_ratio;
        out.closest = std::move(sr.closest);
      }
      if (!fits.empty() && r.mps.empty()) break;
      continue;
    }
    // Every configuration of the round at once, on the evaluator's threads, then read in
    // search order as if evaluated one by one.
    std::vector<Candidate> evaluated = ev.evaluate(round, r.hw, cl, r.threads, keep_graphs);
    out.n_exact += round.size();
    for (std::size_t i = 0; i < round.size(); ++i) {
      Candidate c = std::move(evaluated[i]);
      if (!c.shortfalls.empty()) {
        const double ratio = overshoot(c.per_device, c.strategy, r.hw);
        if (ratio < closest_ratio) {
          closest_ratio = ratio;
          out.closest = c;
        }
        continue;
      }
      ++n_fit;
      fits.push_back(std::move(c));
    }
    if (!fits.empty() && r.mps.empty()) break;
  }
  out.n_fit = n_fit;
  out.n_shapes += ev.n_shapes();
  // Best first: throughput (to 0.1%), then the smaller GPU peak, then search order.
  auto bucket = throughput_bucket;
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

ScreenEstimate screen_estimate(const models::ModelSpec& model, const Strategy& s,
                               const Hardware& hw, const Cluster& cl, const PlanOptions& options) {
  PlanOptions o = options;
  if (o.gpu_capacity == 0) o.gpu_capacity = hw.gpu_memory_bytes;
  Screen screen(model, o, hw, cl);
  const Screened x = screen.at(s, true);
  return {x.per_device, x.least, x.min_step, step_of(*x.costs, s, hw, cl, o.profile)};
}

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
  if (r.parallel)
    throw Error("max_model: the largest model is searched over ZeRO, data, tensor and expert "
                "parallelism, not a parallel search",
                "leave out --parallel (pin --pp or --cp to plan them)");
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
  // DeepSpeed-Ulysses' degree (apply_deepspeed_config reads it back as --cp-kind ulysses).
  if (s.cp > 1 && s.cp_kind == CpKind::ulysses) j["sequence_parallel_size"] = s.cp;
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
  if (s.mp > 1 || s.pp > 1)
    n.push_back(fmt::format("the tensor- and pipeline-parallel degrees ({}, {}) come from the "
                            "Megatron launcher (mpu), not from this config",
                            s.mp, s.pp));
  if (s.cp > 1 && s.cp_kind == CpKind::ring)
    n.push_back(fmt::format("ring context parallelism ({}) is Megatron-LM's "
                            "(--context-parallel-size), not DeepSpeed's", s.cp));
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
            {"n_exact", f.n_exact},
            {"n_simulated", f.n_simulated},
            {"screened", f.screened},
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
