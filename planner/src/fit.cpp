// fit.cpp: the configuration search of `zero-plan fit`, the largest model that fits, the
// DeepSpeed config of the winner and DeepSpeed's own estimators. Not a second memory model:
// memory comes from the schedule replay of schedule.cpp, cached per shape.
#include "zp/planner/fit.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <map>
#include <thread>
#include <tuple>
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

using ShapeKey = std::tuple<int64_t, int64_t, uint32_t, bool, int, bool, int64_t, bool, uint32_t, bool>;
ShapeKey shape_key(const models::GraphOptions& g) {
  return {g.batch, g.seq, g.act_bytes, g.dropout, static_cast<int>(g.recompute), g.flash_attention,
          g.tp, g.partition_checkpoints, g.param_bytes, g.f32_weight_scratch};
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
using DynKey = std::tuple<int, int64_t, int, int, uint64_t, uint64_t, uint64_t, uint64_t, int, bool,
                          uint64_t, uint64_t, uint64_t>;
using HostKey = std::pair<uint64_t, uint64_t>;  // tile bytes, swap buffer bytes
// What the persistent states depend on within one shape (model_state_bytes and
// append_model_states): the partition, the stage, the precision and optimizer, where the
// optimizer and parameters live, the delayed update's host buffers, and the swap buffers held
// with the states (the delayed update's optimizer swap buffers on NVMe, the parameter
// swapper's buffers).
using StatesKey = std::tuple<uint64_t, int, int, int, int, int, bool, uint64_t, uint64_t>;

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
    std::map<DynKey, PerDevice> dynamic;
    std::map<HostKey, PerDevice> host_buffers;
    std::map<StatesKey, PerDevice> states;
  };
  std::map<ShapeKey, Shape> shapes;

  // The shape's cache entry, not yet built when new. Inserting is the only step that changes
  // `shapes` itself: evaluate() inserts every shape before its threads fill them in.
  Shape& slot(const Strategy& s) {
    const models::GraphOptions go = graph_options(model, s, options);
    auto [it, inserted] = shapes.try_emplace(shape_key(go));
    if (inserted) it->second.go = go;
    return it->second;
  }
  static void build(Shape& sh, const models::ModelSpec& model) {
    if (sh.built) return;
    sh.graph = models::build_training_graph(model, sh.go);
    sh.costs = step_costs(sh.graph);
    sh.group_elems = sh.costs.group_params;
    sh.built = true;
  }
  Shape& shape(const Strategy& s) {
    Shape& sh = slot(s);
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

const StepCosts& FitEvaluator::costs(const Strategy& s) { return impl_->shape(s).costs; }

PerDevice FitEvaluator::memory(const Strategy& s) { return impl_->memory(impl_->shape(s), s); }

PerDevice FitEvaluator::Impl::memory(Shape& sh, const Strategy& s) const {
  const PlanOptions& o = options;
  const bool whole = o.profile == Profile::deepspeed;
  const uint64_t part = s.stage >= 1
                            ? partition_elems(sh.group_elems, s.stage, static_cast<uint64_t>(s.dp))
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
                   whole ? offload_tile_bytes(s, part, p_bytes) : 0};
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
                           : 0};
  auto st = sh.states.find(skey);
  if (st == sh.states.end()) {
    MemorySchedule states_only;
    append_model_states(states_only, sh.costs.n_params, part, s, p_bytes);
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
                                             const Cluster& cl, unsigned threads) {
  Impl& im = *impl_;
  // Group the strategies by shape, shapes in first-seen order (one thread builds a shape's
  // graph and its replays; its strategies are then evaluated on the same thread).
  std::vector<Impl::Shape*> shapes;
  std::vector<std::vector<std::size_t>> members;
  std::map<const Impl::Shape*, std::size_t> index;
  for (std::size_t i = 0; i < ss.size(); ++i) {
    Impl::Shape* sh = &im.slot(ss[i]);
    auto [it, inserted] = index.try_emplace(sh, shapes.size());
    if (inserted) {
      shapes.push_back(sh);
      members.emplace_back();
    }
    members[it->second].push_back(i);
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
        for (std::size_t i : members[u]) {
          failed_at[u] = i;
          Candidate& c = out[i];
          c.strategy = ss[i];
          c.per_device = im.memory(sh, ss[i]);
          c.shortfalls = shortfalls(c.per_device, ss[i], hw);
          if (!c.shortfalls.empty()) continue;
          const Timeline t = simulate(sh.costs, ss[i], hw, cl);
          c.step_seconds = t.step_seconds;
          c.tflops_per_gpu = t.tflops_per_gpu;
          c.tokens_per_second = t.tokens_per_second;
          c.busy_seconds = t.busy_seconds;
        }
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

FitResult search(const FitRequest& r, FitEvaluator& ev, bool stop_at_first_fit) {
  const Cluster2 cl2 = resolve_cluster(r);
  const Cluster cl{cl2.gpus, cl2.nodes};
  Strategy base = resolve_for_model(r.base, r.model);
  FitResult out;
  out.gpus = cl2.gpus;
  out.nodes = cl2.nodes;
  std::vector<std::vector<int64_t>> mp_rounds;
  if (!r.mps.empty()) {
    mp_rounds.push_back(r.mps);
  } else {
    mp_rounds.push_back({1});
    for (int64_t mp = 2; mp <= r.hw.gpus_per_node; mp *= 2)
      if (cl2.gpus % mp == 0 && r.model.n_head % mp == 0 && r.model.n_kv_head % mp == 0 &&
          r.model.n_inner % mp == 0)
        mp_rounds.push_back({mp});
  }
  std::vector<Candidate> fits;
  double closest_ratio = 1e300;
  const std::vector<int64_t> accums = r.grad_accums.empty() ? std::vector<int64_t>{base.grad_accum}
                                                            : r.grad_accums;
  for (const auto& mps : mp_rounds) {
    std::vector<Strategy> round;  // this round's configurations, in search order
    for (int64_t mp : mps) {
      if (cl2.gpus % mp != 0)
        throw Error(fmt::format("--mp {}: does not divide --gpus {}", mp, cl2.gpus),
                    "the data-parallel degree is gpus / mp");
      for (int64_t mb : r.micro_batches)
        for (Checkpointing ck : r.checkpointing)
          for (int stage : r.stages)
            for (Offload oo : r.offload_optimizer)
              for (Offload op : r.offload_param)
                for (bool dpu : r.dpu)
                  for (int64_t ga : accums) {
                  if (op != Offload::none && stage != 3) continue;
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
                  if (ck != Checkpointing::full) s.partition_activations = false;
                  round.push_back(s);
                }
    }
    // The first fit (--max-model's probes): one at a time, stopping there. The whole search:
    // every configuration of the round at once, on the evaluator's threads, then read in
    // search order as if evaluated one by one.
    std::vector<Candidate> evaluated;
    if (!stop_at_first_fit) evaluated = ev.evaluate(round, r.hw, cl, r.threads);
    for (std::size_t i = 0; i < round.size(); ++i) {
      ++out.n_searched;
      Candidate c;
      if (stop_at_first_fit) {
        c.strategy = round[i];
        c.per_device = ev.memory(c.strategy);
        c.shortfalls = shortfalls(c.per_device, c.strategy, r.hw);
        if (c.shortfalls.empty()) {
          const Timeline t = simulate(ev.costs(c.strategy), c.strategy, r.hw, cl);
          c.step_seconds = t.step_seconds;
          c.tflops_per_gpu = t.tflops_per_gpu;
          c.tokens_per_second = t.tokens_per_second;
          c.busy_seconds = t.busy_seconds;
        }
      } else {
        c = std::move(evaluated[i]);
      }
      if (!c.shortfalls.empty()) {
        const double ratio = overshoot(c.per_device, c.strategy, r.hw);
        if (ratio < closest_ratio) {
          closest_ratio = ratio;
          out.closest = c;
        }
        continue;
      }
      fits.push_back(std::move(c));
      if (stop_at_first_fit) {
        out.n_fit = 1;
        out.candidates = std::move(fits);
        out.n_shapes = ev.n_shapes();
        return out;
      }
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
  FitEvaluator ev(r.model, r.options);
  return search(r, ev, false);
}

std::optional<MaxModel> max_model(const FitRequest& r) {
  auto fits = [&](int64_t layers) {
    FitRequest q = r;
    q.model.n_layer = layers;
    FitEvaluator ev(q.model, q.options);
    return search(q, ev, true).n_fit > 0;
  };
  int64_t lo = 0, hi = 0;  // fits at lo (0: none known), not at hi
  int64_t l = std::max<int64_t>(1, r.model.n_layer);
  if (fits(l)) {
    lo = l;
    hi = l * 2;
    while (fits(hi)) {
      lo = hi;
      if (hi > (int64_t{1} << 20))
        throw Error("--max-model: more than a million layers fit", "check the hardware file");
      hi *= 2;
    }
  } else {
    hi = l;
    if (!fits(1)) return std::nullopt;
    lo = 1;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  MaxModel m;
  m.model = r.model;
  m.model.n_layer = lo;
  m.params = static_cast<uint64_t>(models::count_params(m.model).total);
  FitRequest q = r;
  q.model = m.model;
  q.top = 1;
  FitResult f = fit(q);
  m.best = f.candidates.front();
  return m;
}

nlohmann::json deepspeed_config(const Strategy& s) {
  using nlohmann::json;
  json j = {{"train_micro_batch_size_per_gpu", s.micro_batch},
            {"gradient_accumulation_steps", s.grad_accum},
            {"train_batch_size", s.micro_batch * s.grad_accum * s.dp}};
  if (s.precision == Precision::fp16) j["fp16"] = {{"enabled", true}};
  if (s.precision == Precision::bf16) j["bf16"] = {{"enabled", true}};
  j["optimizer"] = {{"type", s.optimizer == OptimizerKind::adam    ? "Adam"
                             : s.optimizer == OptimizerKind::adamw ? "AdamW"
                                                                   : "SGD"}};
  json zo = {{"stage", s.stage},
             {"overlap_comm", true},
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
  if (s.checkpointing != Checkpointing::none)
    j["activation_checkpointing"] = {{"partition_activations", s.partition_activations}};
  return j;
}

std::vector<std::string> deepspeed_notes(const Strategy& s) {
  std::vector<std::string> n;
  if (s.checkpointing != Checkpointing::none)
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
