// simulate.cpp: per-group costs read off the training graph, and the list-scheduled simulation
// of ZeRO steps on FIFO resources. Not a cycle-accurate GPU model: compute is a roofline of
// achievable FLOP/s and HBM bandwidth; links are bandwidths without latency.
#include "zp/planner/simulate.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/planner/schedule.hpp"

namespace zp::planner {

using models::OpKind;
using models::Phase;
using models::TensorId;

std::string_view to_string(Resource r) {
  switch (r) {
    case Resource::gpu: return "gpu";
    case Resource::h2d: return "h2d";
    case Resource::d2h: return "d2h";
    case Resource::net: return "net";
    case Resource::cpu: return "cpu";
    case Resource::nvme_read: return "nvme_read";
    case Resource::nvme_write: return "nvme_write";
  }
  return "?";
}

namespace {

// Communication: the time is the collective's or the send's, not HBM traffic.
bool communication(OpKind k) {
  return k == OpKind::pp_recv || k == OpKind::pp_send || k == OpKind::sp_all_gather ||
         k == OpKind::sp_reduce_scatter || k == OpKind::cp_all_to_all;
}

bool compute_bound(OpKind k) {
  switch (k) {
    case OpKind::matmul: case OpKind::matmul_bwd:
    case OpKind::attn_scores: case OpKind::attn_scores_bwd:
    case OpKind::attn_values: case OpKind::attn_values_bwd:
    case OpKind::flash_attention: case OpKind::flash_attention_bwd:
      return true;
    default:
      return false;
  }
}

}  // namespace

StepCosts step_costs(const models::TrainingGraph& g) {
  StepCosts c;
  const int64_t L = g.model.n_layer;
  const std::size_t n = static_cast<std::size_t>(L + 2);
  c.n_layer = L;
  c.fwd_flops.assign(n, 0);
  c.bwd_flops.assign(n, 0);
  c.fwd_bytes.assign(n, 0);
  c.bwd_bytes.assign(n, 0);
  c.group_params.assign(n, 0);
  c.group_expert_params.assign(n, 0);
  c.a2a_fwd_bytes.assign(n, 0);
  c.a2a_bwd_bytes.assign(n, 0);
  // Groups: embedding (layer -1) -> 0, block l -> l + 1, final norm and head (layer L) -> L + 1.
  auto group = [&](int32_t layer) { return static_cast<std::size_t>(std::clamp<int64_t>(layer + 1, 0, L + 1)); };
  for (const models::Tensor& t : g.tensors)
    if (t.kind == models::TensorKind::param) {
      c.group_params[group(t.layer)] += t.bytes / t.elem_bytes;
      c.n_params += t.bytes / t.elem_bytes;
      if (is_expert_tensor(t)) {
        c.group_expert_params[group(t.layer)] += t.bytes / t.elem_bytes;
        c.n_expert_params += t.bytes / t.elem_bytes;
      }
    }
  // Tensor parallelism (simulate.hpp step_costs has where each collective comes from).
  const int64_t tp = g.options.tp;
  c.tp = tp;
  c.sp = g.options.sp && tp > 1;
  c.tp_fwd.assign(n, {});
  c.tp_bwd.assign(n, {});
  // Context parallelism (simulate.hpp TpCollective: ring exchanges, Ulysses' all-to-alls).
  c.cp = g.options.cp;
  if (c.cp > 1) {
    c.cp_fwd.assign(n, {});
    c.cp_bwd.assign(n, {});
  }
  const bool placed = tp > 1 && !c.sp;  // Megatron's all-reduces, placed by the graph's structure
  const int64_t C = g.model.n_embd;
  auto bytes_of = [&](TensorId id) { return static_cast<double>(g.tensor(id).bytes); };
  auto residual_width = [&](TensorId id) {  // a (B, T, C) tensor
    const std::vector<int64_t>& sh = g.tensor(id).shape;
    return sh.size() == 3 && sh.back() == C;
  };
  std::vector<char> normalized(g.tensors.size(), 0);  // (B, T, C) outputs of a norm
  // f: per (group, normalized tensor) the all-reduce of its gradient, in tp_bwd[group].
  std::map<std::pair<std::size_t, TensorId>, std::size_t> f_of;
  // Sequence parallelism's backward: a column-parallel input gathered again, waiting for the
  // input-gradient GEMM it overlaps (group, index); the last backward GEMM's FLOPs.
  std::pair<std::size_t, std::size_t> regather{SIZE_MAX, 0};
  double last_gemm_flops = 0;
  // Pipeline parallelism.
  c.pp = g.options.pp;
  c.pp_stage = g.options.pp_stage;
  c.pp_chunks = g.options.pp_chunks;
  for (const models::Op& op : g.ops) {
    // A recomputation's read of SAC's storage moves nothing.
    if (op.phase == Phase::optimizer || op.kind == OpKind::sac_reuse) continue;
    const std::size_t i = group(op.layer);
    const bool fwd = op.phase == Phase::forward;
    const bool block = i > 0 && i + 1 < n;
    std::vector<TpCollective>& pass = fwd ? c.tp_fwd[i] : c.tp_bwd[i];
    if ((op.kind == OpKind::layernorm || op.kind == OpKind::rmsnorm) && op.phase != Phase::backward)
      for (TensorId o : op.outputs)
        if (residual_width(o)) normalized[static_cast<std::size_t>(o)] = 1;
    if (placed) {
      const bool forward_like = op.phase != Phase::backward;  // forward or its recomputation
      // g: row-parallel outputs (and an MoE layer's combine), the vocabulary-parallel lookup.
      const bool row_parallel =
          forward_like && block &&
          ((op.kind == OpKind::matmul && residual_width(op.outputs.front()) &&
            !normalized[static_cast<std::size_t>(op.inputs.front())]) ||
           (op.kind == OpKind::moe_combine && residual_width(op.outputs.front())));
      if (row_parallel || (op.kind == OpKind::embedding && residual_width(op.outputs.front())))
        pass.push_back({CollectiveKind::all_reduce, bytes_of(op.outputs.front()), 0.0});
      // f: the column-parallel linears' input gradient, overlapping their weight gradients.
      if (op.kind == OpKind::matmul_bwd && op.inputs.size() >= 2 &&
          normalized[static_cast<std::size_t>(op.inputs[1])]) {
        auto [it, fresh] = f_of.try_emplace({i, op.inputs[1]}, pass.size());
        if (fresh) pass.push_back({CollectiveKind::all_reduce, bytes_of(op.outputs.front()), 0.0});
        pass[it->second].overlap_flops += op.flops / 2;
      }
    }
    if (c.sp && op.kind == OpKind::sp_all_gather) {
      pass.push_back({CollectiveKind::all_gather, bytes_of(op.outputs.front()), 0.0});
      if (op.phase == Phase::backward &&
          g.tensor(op.inputs.front()).kind != models::TensorKind::act_grad)
        regather = {i, pass.size() - 1};
    }
    if (c.sp && op.kind == OpKind::sp_reduce_scatter)
      pass.push_back({CollectiveKind::reduce_scatter, bytes_of(op.inputs.front()),
                      op.phase == Phase::backward ? last_gemm_flops / 2 : 0.0});
    if (op.kind == OpKind::matmul_bwd) {
      last_gemm_flops = op.flops;
      if (regather.first != SIZE_MAX) {  // the input gathered for this GEMM's weight gradient
        c.tp_bwd[regather.first][regather.second].overlap_flops = op.flops / 2;
        regather.first = SIZE_MAX;
      }
    }
    if (c.cp > 1) {
      auto& cps = fwd ? c.cp_fwd[i] : c.cp_bwd[i];
      if (op.kind == OpKind::cp_all_to_all)
        cps.push_back({CollectiveKind::all_to_all, bytes_of(op.outputs.front()), 0.0});
      else if (op.comm_bytes > 0 && op.kind == OpKind::flash_attention)
        cps.push_back({CollectiveKind::ring_exchange,
                       static_cast<double>(op.comm_bytes / static_cast<uint64_t>(c.cp)), op.flops});
      else if (op.comm_bytes > 0 && op.kind == OpKind::flash_attention_bwd)
        cps.push_back({CollectiveKind::ring_exchange, static_cast<double>(op.comm_bytes / 2), op.flops});
    }
    if (op.kind == OpKind::pp_recv)
      c.p2p_bytes = std::max<uint64_t>(c.p2p_bytes, g.tensor(op.outputs.front()).bytes);
    if (op.kind == OpKind::pp_send)
      c.p2p_bytes = std::max<uint64_t>(c.p2p_bytes, g.tensor(op.inputs.front()).bytes);
    if (communication(op.kind)) continue;
    if (compute_bound(op.kind)) {
      (fwd ? c.fwd_flops : c.bwd_flops)[i] += op.flops;
    } else {
      // Memory bound: every tensor it reads and writes crosses HBM once.
      double bytes = 0;
      for (auto t : op.inputs) bytes += static_cast<double>(g.tensor(t).bytes);
      for (auto t : op.outputs) bytes += static_cast<double>(g.tensor(t).bytes);
      (fwd ? c.fwd_bytes : c.bwd_bytes)[i] += bytes;
    }
    // The routed rows each all-to-all moves: the dispatch's output and the combine's input
    // (R, C), and their gradients in backward.
    TensorId routed = -1;
    switch (op.kind) {
      case OpKind::moe_dispatch: routed = op.outputs.front(); break;
      case OpKind::moe_combine: routed = op.inputs.front(); break;
      case OpKind::moe_combine_bwd: routed = op.outputs.front(); break;
      case OpKind::moe_dispatch_bwd: routed = op.inputs.front(); break;
      default: break;
    }
    if (routed >= 0)
      (fwd ? c.a2a_fwd_bytes : c.a2a_bwd_bytes)[i] += static_cast<double>(g.tensor(routed).bytes);
    c.flops_executed += op.flops;
    if (op.phase != Phase::recompute) c.flops_model += op.flops;
  }
  c.tokens = g.options.batch * g.options.seq;
  c.boundary_bytes = static_cast<uint64_t>(c.tokens) * static_cast<uint64_t>(g.model.n_embd) *
                     g.options.act_bytes;
  // Tied embeddings across a pipeline: the first stage's word embeddings ("wte") and the last
  // stage's copy of them as its output layer ("lm_head", graph.hpp GraphOptions::pp).
  if (c.pp > 1 && g.model.tied_embeddings && (c.pp_stage == 0 || c.pp_stage == c.pp - 1))
    for (const models::Tensor& x : g.tensors)
      if (x.kind == models::TensorKind::param &&
          x.name == (c.pp_stage == c.pp - 1 ? "lm_head" : "wte"))
        c.tied_embedding_params = x.bytes / x.elem_bytes;
  return c;
}

double allreduce_seconds(double bytes, int64_t n, double bus_gbps) {
  if (n <= 1) return 0;
  return bytes * 2.0 * static_cast<double>(n - 1) / static_cast<double>(n) / (bus_gbps * 1e9);
}
double reduce_scatter_seconds(double bytes, int64_t n, double bus_gbps) {
  if (n <= 1) return 0;
  return bytes * static_cast<double>(n - 1) / static_cast<double>(n) / (bus_gbps * 1e9);
}
double allgather_seconds(double bytes, int64_t n, double bus_gbps) {
  return reduce_scatter_seconds(bytes, n, bus_gbps);
}

double bus_gbps(const Hardware& hw, int64_t ranks, const Cluster& c) {
  // Model parallelism stays inside a node (Megatron's layout), so data-parallel groups span
  // the nodes: one node, NVLink; more, the slower of NVLink and the node's NICs (NCCL runs
  // one ring per NIC, each crossing the network once per node).
  if (ranks <= 1 || c.nodes <= 1) return hw.nvlink_gbps;
  return std::min(hw.nvlink_gbps, hw.internode_gbps);
}

double alltoall_seconds(double bytes, int64_t n, double gbps) {
  if (n <= 1) return 0;
  return bytes * static_cast<double>(n - 1) / static_cast<double>(n) / (gbps * 1e9);
}

double alltoall_gbps(const Hardware& hw, int64_t ep, int64_t mp, const Cluster& c) {
  if (c.nodes <= 1 || ep * mp <= hw.gpus_per_node) return hw.nvlink_gbps;
  return std::min(hw.nvlink_gbps, hw.internode_gbps / static_cast<double>(hw.gpus_per_node));
}

int64_t node_gpus(const Hardware& hw, const Cluster& c) {
  const int64_t per = c.nodes >= 1 ? c.gpus / c.nodes : c.gpus;
  return std::clamp<int64_t>(per, 1, std::max<int64_t>(1, hw.gpus_per_node));
}

double group_bus_gbps(const Hardware& hw, const Cluster& c, int64_t n, int64_t stride) {
  const int64_t G = node_gpus(hw, c);
  stride = std::max<int64_t>(1, stride);
  // Groups lie in aligned blocks of n x stride consecutive ranks (parallel_state.py
  // generate_masked_orthogonal_rank_groups); such a block inside one node when it divides it.
  if (n <= 1 || (n * stride <= G && G % (n * stride) == 0)) return hw.nvlink_gbps;
  const int64_t k = std::clamp<int64_t>(G / stride, 1, n);
  return std::min(hw.nvlink_gbps,
                  hw.internode_gbps * static_cast<double>(k) / static_cast<double>(G));
}

bool pipeline_link_crosses_nodes(const Strategy& s, const Hardware& hw, const Cluster& c,
                                 int64_t a, int64_t b) {
  if (a > b) std::swap(a, b);
  const int64_t G = node_gpus(hw, c);
  const int64_t S = s.mp * s.cp * s.dp;  // ranks per stage
  return (a * S) / G != ((b + 1) * S - 1) / G;
}

double p2p_gbps(const Strategy& s, const Hardware& hw, const Cluster& c, int64_t a, int64_t b) {
  if (!pipeline_link_crosses_nodes(s, hw, c, a, b)) return hw.nvlink_gbps;
  return std::min(hw.nvlink_gbps, hw.internode_gbps / static_cast<double>(node_gpus(hw, c)));
}

std::string Task::name() const {
  return fmt::format("{} {} (step {}, micro {})", kind, index, step, micro);
}

namespace {

double collective_seconds(const TpCollective& k, int64_t t, double gbps) {
  switch (k.kind) {
    case CollectiveKind::all_reduce: return allreduce_seconds(k.bytes, t, gbps);
    case CollectiveKind::all_gather: return allgather_seconds(k.bytes, t, gbps);
    case CollectiveKind::reduce_scatter: return reduce_scatter_seconds(k.bytes, t, gbps);
    case CollectiveKind::ring_exchange:
      return t <= 1 ? 0.0 : static_cast<double>(t - 1) * k.bytes / (gbps * 1e9);
    case CollectiveKind::all_to_all: return alltoall_seconds(k.bytes, t, gbps);
  }
  return 0;
}

// Whether this rank holds group i: a pipeline stage's graph has the other stages' groups empty.
bool holds(const StepCosts& c, std::size_t i) {
  return c.group_params[i] > 0 || c.fwd_flops[i] > 0 || c.bwd_flops[i] > 0 || c.fwd_bytes[i] > 0 ||
         c.bwd_bytes[i] > 0;
}

void check_costs(const StepCosts& c, const Strategy& s) {
  if (c.group_params.empty()) throw Error("simulate: empty step costs", "build them with step_costs(graph)");
  if (c.cp != s.cp)
    throw Error(fmt::format("simulate: the costs are of a --cp {} graph, the strategy's --cp is {}",
                            c.cp, s.cp),
                "build the graph with graph_options(model, strategy, ...)");
  if (c.tp != s.mp)
    throw Error(fmt::format("simulate: the costs are of a --tp {} graph, the strategy's --tp is {}",
                            c.tp, s.mp),
                "build the graph with graph_options(model, strategy, ...)");
}

}  // namespace

PassSeconds pass_seconds(const StepCosts& c, const Strategy& s, const Hardware& hw,
                         const Cluster& cl, std::size_t i, bool forward) {
  PassSeconds p;
  const double flops_per_s = hw.gpu_tflops * 1e12;
  p.compute = (forward ? c.fwd_flops[i] : c.bwd_flops[i]) / flops_per_s +
              (forward ? c.fwd_bytes[i] : c.bwd_bytes[i]) / (hw.hbm_gbps * 1e9);
  const auto& tp = forward ? c.tp_fwd : c.tp_bwd;
  if (i < tp.size() && !tp[i].empty()) {
    // The tensor-parallel group: tp consecutive ranks (simulate.hpp's layout).
    const double gbps = group_bus_gbps(hw, cl, c.tp, 1);
    for (const TpCollective& k : tp[i]) {
      const double x = collective_seconds(k, c.tp, gbps);
      p.tp += x;
      p.tp_exposed += k.overlap_flops > 0 ? std::max(0.0, x - k.overlap_flops / flops_per_s) : x;
    }
  }
  const auto& cps = forward ? c.cp_fwd : c.cp_bwd;
  if (i < cps.size() && !cps[i].empty()) {
    // The context-parallel group: cp ranks at stride tp (simulate.hpp's layout).
    const double gbps = group_bus_gbps(hw, cl, c.cp, c.tp);
    for (const TpCollective& k : cps[i]) {
      const double x = collective_seconds(k, c.cp, gbps);
      p.cp += x;
      p.cp_exposed += k.overlap_flops > 0 ? std::max(0.0, x - k.overlap_flops / flops_per_s) : x;
    }
  }
  const auto& a2a = forward ? c.a2a_fwd_bytes : c.a2a_bwd_bytes;
  if (s.ep > 1 && i < a2a.size())
    p.a2a = alltoall_seconds(a2a[i], s.ep, alltoall_gbps(hw, s.ep, s.mp, cl));
  return p;
}

namespace {

// Every group's passes (zero for the groups a pipeline stage does not hold), computed once
// per stage and strategy.
struct GroupPasses {
  std::vector<PassSeconds> fwd, bwd;
};
GroupPasses group_passes(const StepCosts& c, const Strategy& s, const Hardware& hw, const Cluster& cl) {
  GroupPasses out;
  const std::size_t n = c.group_params.size();
  out.fwd.resize(n);
  out.bwd.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (c.pp > 1 && !holds(c, i)) continue;
    out.fwd[i] = pass_seconds(c, s, hw, cl, i, true);
    out.bwd[i] = pass_seconds(c, s, hw, cl, i, false);
  }
  return out;
}

StagePass stage_pass(const StepCosts& c, const Strategy& s, const Hardware& hw, const Cluster& cl,
                     const GroupPasses& gp) {
  StagePass out;
  for (std::size_t i = 0; i < c.group_params.size(); ++i) {
    out.forward += gp.fwd[i].total();
    out.backward += gp.bwd[i].total();
  }
  // ZeRO-R Pa+cpu: each block's checkpoint to the host after its forward, back before its
  // recomputation, both blocking (simulate()'s checkpoint copies).
  if (s.cpu_checkpointing && s.checkpointing == Checkpointing::full) {
    const double bytes = static_cast<double>(c.boundary_bytes) /
                         static_cast<double>(s.partition_activations ? s.mp : 1);
    double blocks = 0;
    for (std::size_t i = 1; i + 1 < c.group_params.size(); ++i) blocks += c.fwd_flops[i] > 0 ? 1 : 0;
    out.forward += blocks * bytes / (hw.d2h_gbps * 1e9);
    out.backward += blocks * bytes / (hw.h2d_gbps * 1e9);
  }
  if (c.pp > 1 && c.p2p_bytes > 0) {
    // Per chunk, the exchange with the neighbouring virtual stages: chunk k of stage i is
    // virtual stage k pp + i of pp vp (graph.hpp GraphOptions::pp).
    const int64_t p = c.pp, v = c.pp_chunks, last = p * v - 1;
    const double bytes = static_cast<double>(c.p2p_bytes);
    const bool overlapped = s.pp_schedule == PipelineSchedule::interleaved;
    const double fwd = out.forward, bwd = out.backward, vd = static_cast<double>(v);
    if (overlapped) out.forward = out.backward = 0;
    for (int64_t k = 0; k < v; ++k) {
      const int64_t vs = k * p + c.pp_stage;
      double x = 0;
      if (vs > 0) x = std::max(x, bytes / (p2p_gbps(s, hw, cl, (vs - 1) % p, c.pp_stage) * 1e9));
      if (vs < last) x = std::max(x, bytes / (p2p_gbps(s, hw, cl, c.pp_stage, (vs + 1) % p) * 1e9));
      out.p2p += x;
      if (overlapped) {  // each chunk's pass (1/v of the stage's) beside its exchange
        out.forward += std::max(fwd / vd, x);
        out.backward += std::max(bwd / vd, x);
      }
    }
    if (!overlapped) {
      out.forward += out.p2p;
      out.backward += out.p2p;
    }
  }
  return out;
}

}  // namespace

StagePass stage_pass(const StepCosts& c, const Strategy& s, const Hardware& hw, const Cluster& cl) {
  check_costs(c, s);
  return stage_pass(c, s, hw, cl, group_passes(c, s, hw, cl));
}

namespace {

// The list scheduler: resources are FIFO in issue order; deps are earlier tasks.
class Schedule {
 public:
  explicit Schedule(std::vector<Task>& tasks) : tasks_(tasks) { free_at_.fill(0); last_.fill(-1); }

  int add(const char* kind, int index, Resource r, double seconds, std::initializer_list<int> deps,
          const std::vector<int>* more = nullptr) {
    Task t;
    t.kind = kind;
    t.index = index;
    t.resource = r;
    t.seconds = seconds;
    t.step = step;
    t.micro = micro;
    const std::size_t ri = static_cast<std::size_t>(r);
    t.start = free_at_[ri];
    t.waited_on = last_[ri];
    auto dep = [&](int d) {
      if (d < 0) return;
      const double e = tasks_[static_cast<std::size_t>(d)].end;
      if (e > t.start) {
        t.start = e;
        t.waited_on = d;
      }
    };
    for (int d : deps) dep(d);
    if (more != nullptr)
      for (int d : *more) dep(d);
    t.end = t.start + seconds;
    free_at_[ri] = t.end;
    const int id = static_cast<int>(tasks_.size());
    last_[ri] = id;
    tasks_.push_back(t);
    return id;
  }
  int step = 0, micro = 0;

 private:
  std::vector<Task>& tasks_;
  std::array<double, kResources> free_at_{};
  std::array<int, kResources> last_{};
};

}  // namespace

namespace {

// One pipeline stage's rank (simulate_pipeline): its passes before its last micro-batch's
// backward take `before` seconds from the step's start; then that backward per group, and
// with tied embeddings an all-reduce of the word embeddings' gradient with the other end of
// the pipeline (`embedding_sync` seconds) before the optimizer.
struct PipelineRank {
  double before = 0;
  double embedding_sync = 0;
};

// Task storage handed back by recycle(), reused by the next simulation on this thread.
thread_local std::vector<Task> spare_tasks;

// simulate() and, with `pipe`, one pipeline stage's rank.
Timeline simulate_rank(const StepCosts& c, const Strategy& s, const Hardware& hw, const Cluster& cl,
                       Profile profile, const PipelineRank* pipe, const GroupPasses& gp) {
  check_costs(c, s);
  Timeline tl;
  tl.tasks = std::move(spare_tasks);
  tl.tasks.clear();
  spare_tasks = {};
  tl.n_layer = c.n_layer;
  const int64_t dp = s.dp, mp = s.mp;
  const int64_t per_node = std::max<int64_t>(1, std::min<int64_t>(world_size(s), hw.gpus_per_node));
  const double hbm = hw.hbm_gbps * 1e9;
  const double h2d = hw.h2d_gbps * 1e9, d2h = hw.d2h_gbps * 1e9;
  // (A pipeline stage's copies are in its passes: stage_pass.)
  const bool ckpt_cpu = s.cpu_checkpointing && s.checkpointing == Checkpointing::full && pipe == nullptr;
  const double ckpt_bytes = static_cast<double>(c.boundary_bytes) /
                            static_cast<double>(s.partition_activations ? s.mp : 1);
  // Host resources are shared by the ranks of a node.
  const double cpu_rate = hw.cpu_adam_gparams * 1e9 / static_cast<double>(per_node);
  const double nvme_r = hw.nvme_read_gbps * 1e9 / static_cast<double>(per_node);
  const double nvme_w = hw.nvme_write_gbps * 1e9 / static_cast<double>(per_node);
  // PyTorch FSDP (simulate.hpp): units sharded over the shard group, replicated (hybrid)
  // over the rest; a shard group within a node talks over NVLink.
  const bool fsdp = profile == Profile::fsdp && s.stage == 3;
  // ZeRO's group: dp x cp ranks (strategy.hpp zero_dp), at stride tp (simulate.hpp's layout:
  // the context- and data-parallel ranks are next to each other in Megatron's order).
  const int64_t shard_ranks = fsdp ? fsdp_shard_world(s) : zero_dp(s);
  const int64_t replicas = fsdp ? fsdp_replicas(s) : 1;
  const double dp_bus = fsdp ? (replicas > 1 && shard_ranks <= hw.gpus_per_node ? hw.nvlink_gbps
                                                                              : bus_gbps(hw, dp, cl))
                             : group_bus_gbps(hw, cl, shard_ranks, mp);
  const double replica_gbps =
      cl.nodes <= 1 ? hw.nvlink_gbps
                    : std::min(hw.nvlink_gbps,
                               hw.internode_gbps / static_cast<double>(std::max<int64_t>(1, hw.gpus_per_node)));
  // Expert parameters: the expert-data-parallel group of dp/ep ranks (DeepSpeed-MoE); FSDP
  // shards them with the rest.
  const int64_t edp = fsdp ? shard_ranks : expert_dp(s);
  // The expert grid (tp-ep-dp-pp): dp/ep ranks at stride tp ep.
  const double edp_bus = fsdp ? dp_bus : group_bus_gbps(hw, cl, edp, mp * s.ep);
  auto expert_of = [&](std::size_t i) {
    return c.group_expert_params.empty() ? uint64_t{0} : c.group_expert_params[i];
  };
  // Each group's passes (pass_seconds): compute with tensor parallelism's exposed collectives
  // on the stream, then expert parallelism's all-to-alls as tasks of their own.
  const std::size_t n = c.group_params.size();
  auto a2a_seconds = [&](std::size_t i, bool fwd) { return (fwd ? gp.fwd : gp.bwd)[i].a2a; };
  auto compute_seconds = [&](std::size_t i, bool fwd) {
    const PassSeconds& x = (fwd ? gp.fwd : gp.bwd)[i];
    return x.compute + x.tp_exposed + x.cp_exposed;
  };
  // A collective over the group's parameters: the dense ones over dp, the experts' over dp/ep.
  auto split_seconds = [&](double (*coll)(double, int64_t, double), double dense_bytes,
                           double expert_bytes) {
    return coll(dense_bytes, shard_ranks, dp_bus) +
           (expert_bytes > 0 ? coll(expert_bytes, edp, edp_bus) : 0.0);
  };
  const double pbytes = s.precision == Precision::fp32 ? 4.0 : 2.0;
  // FSDP: the sharded weights' bytes (fp32 under mixed precision: what crosses PCIe when
  // offloaded) and the reduce dtype's (what the reduce-scatter moves).
  const double wbytes = weights_in_compute_dtype(s) ? pbytes : 4.0;
  // ZeRO reduces the gradients in their dtype (Megatron's fp32 main_grad: --grad-precision).
  const double rbytes = !fsdp ? static_cast<double>(grad_bytes(s))
                        : s.precision == Precision::fp32 ? 4.0
                        : s.reduce_precision == Precision::bf16 ? 2.0 : 4.0;
  // The groups this rank holds, in forward order: all of them, or a pipeline stage's (its
  // graph has the others' groups empty).
  std::vector<std::size_t> held;
  held.reserve(n);
  for (std::size_t i = 0; i < n; ++i)
    if (pipe == nullptr || holds(c, i)) held.push_back(i);
  const int n_groups = static_cast<int>(held.size());
  // Stage 3 prefetch depth: groups gathered ahead of the one in use.
  uint64_t largest = 1;
  for (uint64_t p : c.group_params) largest = std::max(largest, p);
  const int depth = static_cast<int>(std::min<uint64_t>(s.buffers.prefetch_bucket_size / largest, 64));
  // Optimizer: elements each rank updates, bytes of fp32 states per element.
  const uint64_t n_dense = c.n_params - c.n_expert_params;
  const uint64_t part = s.stage >= 1 ? (n_dense + static_cast<uint64_t>(shard_ranks) - 1) / static_cast<uint64_t>(shard_ranks) +
                                           (c.n_expert_params + static_cast<uint64_t>(edp) - 1) /
                                               static_cast<uint64_t>(edp)
                                     : c.n_params;
  // The weights the step updates (fp32 master, or bf16 with --master-weights bf16) and the
  // optimizer's states per element (model_states.hpp bytes_per_param: Adam 8, or 4 in bf16;
  // SGD and Lion 4; plain SGD 0; Adafactor 4 on a flat partition; 8-bit Adam 2).
  const BytesPerParam bpp =
      bytes_per_param(s.precision, s.optimizer, s.master_precision, s.optimizer_precision);
  const double state_bytes =
      static_cast<double>(bpp.optimizer) + (s.master_precision == Precision::bf16 ? 2.0 : 4.0);
  // FSDP's CPU offload steps on the host as ZeRO-Offload does, without copying back.
  const bool fsdp_offload = fsdp && s.offload_param == Offload::cpu;
  const bool offload_opt = s.offload_optimizer != Offload::none || fsdp_offload;
  const bool offload_p = s.stage == 3 && s.offload_param != Offload::none;

  const int n_steps = s.dpu ? 3 : 2;
  const int64_t G = s.grad_accum;
  tl.tasks.reserve(static_cast<std::size_t>(n_steps) *
                   (static_cast<std::size_t>(pipe != nullptr ? 1 : G) * held.size() * 6 + 64));
  Schedule sch(tl.tasks);
  std::vector<std::vector<int>> update_done(static_cast<std::size_t>(n_steps));
  std::vector<int> pass_compute, grads_done;
  pass_compute.reserve(n);

  // --offload-param nvme reads each gather's shard through param_swap_buffer_count host
  // buffers of param_swap_buffer_elems elements (schedule.hpp), issued up to
  // param_swap_prefetch_depth gathers ahead of the one being staged (engine_nvme.cpp): the
  // read for the gather at position q of a micro-step waits for the gather `ahead` positions
  // before it to be staged, ahead = min(depth + 1, buffers / pieces of the shard), at least
  // 1; not for compute. The first micro-step's reads wait for the previous update (its
  // parameters are written back to the file).
  const bool nvme_p = offload_p && s.offload_param == Offload::nvme;
  const uint32_t pbytes_int = s.precision == Precision::fp32 ? 4 : 2;
  const uint64_t swap_elems = nvme_p ? param_swap_buffer_elems(s, part, pbytes_int) : 1;
  auto reads_ahead = [&](std::size_t i) {
    const uint64_t x = expert_of(i);
    const uint64_t w = static_cast<uint64_t>(shard_ranks);
    const uint64_t shard = (c.group_params[i] - x + w - 1) / w +
                           (x + static_cast<uint64_t>(edp) - 1) / static_cast<uint64_t>(edp);
    const uint64_t pieces = std::max<uint64_t>(1, (shard + swap_elems - 1) / swap_elems);
    const uint64_t by_buffers = s.buffers.param_swap_buffer_count / pieces;
    return static_cast<int>(std::clamp<uint64_t>(by_buffers, 1, s.buffers.param_swap_prefetch_depth + 1));
  };
  std::vector<int> staged;  // by position in the micro-step: the gather's h2d task

  // Stage 3: bring group i's 16-bit parameters: (NVMe ->) host -> GPU partition, all-gather.
  auto gather = [&](std::size_t i, int after, const std::vector<int>* ready) -> int {
    if (s.stage != 3) return -1;
    const double x = static_cast<double>(expert_of(i)) * pbytes;
    const double dense = static_cast<double>(c.group_params[i]) * pbytes - x;
    const double part_bytes = (dense / static_cast<double>(shard_ranks) + x / static_cast<double>(edp)) *
                              (fsdp ? wbytes / pbytes : 1.0);
    int dep = after;
    if (offload_p) {
      const int q = static_cast<int>(staged.size());
      int read = -1;
      if (nvme_p) {
        const int a = reads_ahead(i);
        read = sch.add("nvme read params", static_cast<int>(i), Resource::nvme_read, part_bytes / nvme_r,
                       {q >= a ? staged[static_cast<std::size_t>(q - a)] : -1}, ready);
      }
      dep = sch.add("h2d params", static_cast<int>(i), Resource::h2d, part_bytes / h2d, {dep, read},
                    ready);
      staged.push_back(dep);
    }
    // The first micro-step's gathers move the parameters of the update they wait for (ready).
    if (shard_ranks > 1)
      dep = sch.add("all-gather", static_cast<int>(i), Resource::net,
                    split_seconds(allgather_seconds, dense, x), {dep}, ready);
    return dep;
  };
  // overlap_comm (DeepSpeed's zero_optimization.overlap_comm; unset: on for stage 3 only):
  // with it, bucket reductions run on the network while backward goes on and stage-3
  // all-gathers are prefetched `depth` groups ahead of compute. Without it every collective
  // is waited for where it is issued (the engine's flush_if_full and gather; DeepSpeed's
  // reduction hooks without the separate reduction stream): the next backward compute waits
  // for the bucket's reduction (and its copy to the host), and a group's gather starts only
  // once the compute before it is done, so gathers and compute take turns.
  // Stages 0-1 reduce after backward in the engine whatever overlap_comm says.
  const bool overlap = s.stage >= 2 && overlaps_comm(s);
  // The compute task a prefetching gather for pass position p waits for.
  auto prefetch_after = [&](int p, int before_pass) {
    const int q = overlap ? p - 2 - depth : p - 1;
    return q >= 0 ? pass_compute[static_cast<std::size_t>(q)] : before_pass;
  };

  for (int st = 0; st < n_steps; ++st) {
    sch.step = st;
    const int wait_step = st - 1 - (s.dpu ? 1 : 0);
    const std::vector<int>* params_ready =
        wait_step >= 0 ? &update_done[static_cast<std::size_t>(wait_step)] : nullptr;
    grads_done.clear();
    int last_gpu = -1;
    int reduced = -1;  // the last bucket's reduction (without overlap_comm, waited for)
    // A pipeline stage: its passes up to its last micro-batch's backward as one task, after
    // the update it computes with.
    for (int64_t m = pipe != nullptr ? G - 1 : 0; m < G; ++m) {
      sch.micro = static_cast<int>(m);
      const bool last_micro = m + 1 == G;
      // Forward.
      pass_compute.clear();
      staged.clear();
      const std::vector<int>* reads_wait = m == 0 ? params_ready : nullptr;
      const int before_fwd = last_gpu;
      int ckpt_copy = -1;  // Pa+cpu: the previous block's checkpoint copy, waited for
      if (pipe != nullptr)
        pass_compute.push_back(sch.add("pipeline", 0, Resource::gpu, pipe->before, {}, params_ready));
      for (int p = 0; p < n_groups && pipe == nullptr; ++p) {
        const std::size_t i = held[static_cast<std::size_t>(p)];
        const int g = gather(i, prefetch_after(p, before_fwd), reads_wait);
        int t = sch.add("fwd", static_cast<int>(i), Resource::gpu, compute_seconds(i, true),
                        {g, overlap || p > 0 ? -1 : reduced, ckpt_copy},
                        p == 0 && m == 0 ? params_ready : nullptr);
        if (const double a = a2a_seconds(i, true); a > 0)
          t = sch.add("all-to-all", static_cast<int>(i), Resource::gpu, a, {t});
        // ZeRO-R Pa+cpu: the block's checkpoint (one (B, T, C) activation, 1/mp of it
        // partitioned) goes to the host after its forward; DeepSpeed's copy is a blocking
        // .cpu() (activation_checkpointing/checkpointing.py), so the next block waits for it.
        if (ckpt_cpu && p > 0 && p + 1 < n_groups) {
          t = sch.add("checkpoint d2h", static_cast<int>(i), Resource::d2h, ckpt_bytes / d2h, {t});
          ckpt_copy = t;
        }
        pass_compute.push_back(t);
      }
      // Backward, with bucketed reduction.
      const int before_bwd = pass_compute.back();
      pass_compute.clear();
      uint64_t bucket = 0, bucket_expert = 0;
      int n_bucket = 0;
      for (int p = 0; p < n_groups; ++p) {
        const std::size_t i = held[static_cast<std::size_t>(n_groups - 1 - p)];
        // FSDP's SHARD_GRAD_OP (reshard_after_forward false) keeps forward's gathered
        // parameters for backward: no second all-gather.
        int g = s.reshard_after_forward ? gather(i, prefetch_after(p, before_bwd), reads_wait) : -1;
        // Pa+cpu: the checkpoint comes back before the block is recomputed (blocking).
        if (ckpt_cpu && p > 0 && p + 1 < n_groups)
          g = sch.add("checkpoint h2d", static_cast<int>(i), Resource::h2d, ckpt_bytes / h2d,
                      {g, pass_compute.empty() ? before_bwd : pass_compute.back()});
        int t = sch.add("bwd", static_cast<int>(i), Resource::gpu, compute_seconds(i, false),
                        {g, overlap ? -1 : reduced});
        if (const double a = a2a_seconds(i, false); a > 0)
          t = sch.add("all-to-all", static_cast<int>(i), Resource::gpu, a, {t});
        pass_compute.push_back(t);
        last_gpu = t;
        bucket += c.group_params[i];
        bucket_expert += expert_of(i);
        // FSDP reduces each unit on its own after its backward.
        if (!fsdp && bucket < s.buffers.reduce_bucket_size && p + 1 < n_groups) continue;
        int done = t;
        // The rank's share of the bucket, in elements.
        const double shard = static_cast<double>(bucket - bucket_expert) / static_cast<double>(shard_ranks) +
                             static_cast<double>(bucket_expert) / static_cast<double>(edp);
        if (shard_ranks > 1 && (s.stage >= 2 || last_micro)) {
          // Expert gradients are reduced over their dp/ep expert-data-parallel ranks.
          const double xb = static_cast<double>(bucket_expert) * rbytes;
          const double db = static_cast<double>(bucket) * rbytes - xb;
          done = s.stage == 0 ? sch.add("all-reduce", n_bucket, Resource::net,
                                        split_seconds(allreduce_seconds, db, xb), {t})
                              : sch.add("reduce-scatter", n_bucket, Resource::net,
                                        split_seconds(reduce_scatter_seconds, db, xb), {t});
        }
        if (replicas > 1 && (s.stage >= 2 || last_micro))  // hybrid: the shard over the replicas
          done = sch.add("all-reduce", n_bucket, Resource::net,
                         allreduce_seconds(shard * rbytes, replicas, replica_gbps), {done});
        if (offload_opt)  // the rank's share goes to the host: 16 bits, FSDP's in its weights' dtype
          done = sch.add("d2h grads", n_bucket, Resource::d2h, shard * (fsdp ? wbytes : pbytes) / d2h,
                         {done});
        grads_done.push_back(done);
        reduced = done;
        bucket = 0;
        bucket_expert = 0;
        ++n_bucket;
      }
    }
    // Tied embeddings on a pipeline's first and last stage: their gradients summed.
    if (pipe != nullptr && pipe->embedding_sync > 0 && !grads_done.empty())
      grads_done.push_back(sch.add("embedding all-reduce", 0, Resource::net, pipe->embedding_sync,
                                   {}, &grads_done));
    // Optimizer step, after every gradient.
    std::vector<int>& upd = update_done[static_cast<std::size_t>(st)];
    if (!offload_opt) {
      // Adam on the GPU: reads g16, p32, m, v (2 + 12), writes p32, m, v, p16 (12 + 2).
      const int a = sch.add("gpu adam", 0, Resource::gpu,
                            static_cast<double>(part) * (2 * pbytes + 2 * state_bytes) / hbm, {}, &grads_done);
      int done = a;
      if (shard_ranks > 1 && (s.stage == 1 || s.stage == 2))
        done = sch.add("all-gather params", 0, Resource::net,
                       split_seconds(allgather_seconds, static_cast<double>(n_dense) * pbytes,
                                     static_cast<double>(c.n_expert_params) * pbytes),
                       {a});
      upd.push_back(done);
    } else {
      // CPU Adam in chunks, pipelined with the NVMe traffic and the copy back.
      const uint64_t n_chunks = std::clamp<uint64_t>((part + 99'999'999) / 100'000'000, 1, 16);
      const double chunk = static_cast<double>(part) / static_cast<double>(n_chunks);
      int last_copy = -1, last = -1;
      for (uint64_t k = 0; k < n_chunks; ++k) {
        const int ki = static_cast<int>(k);
        int dep = -1;
        if (s.offload_optimizer == Offload::nvme)
          dep = sch.add("nvme read states", ki, Resource::nvme_read, chunk * state_bytes / nvme_r, {}, &grads_done);
        const int a = sch.add("cpu adam", ki, Resource::cpu, chunk / cpu_rate, {dep}, &grads_done);
        last = a;
        if (s.offload_optimizer == Offload::nvme)
          last = sch.add("nvme write states", ki, Resource::nvme_write, chunk * state_bytes / nvme_w, {a});
        if (s.offload_param == Offload::nvme && s.stage == 3)
          last = sch.add("nvme write params", ki, Resource::nvme_write, chunk * pbytes / nvme_w, {a, last});
        if (!offload_p) last_copy = sch.add("h2d updated params", ki, Resource::h2d, chunk * pbytes / h2d, {a});
      }
      int done = last_copy >= 0 ? last_copy : last;
      if (shard_ranks > 1 && (s.stage == 1 || s.stage == 2))
        done = sch.add("all-gather params", 0, Resource::net,
                       split_seconds(allgather_seconds, static_cast<double>(n_dense) * pbytes,
                                     static_cast<double>(c.n_expert_params) * pbytes),
                       {done});
      upd.push_back(done);
      upd.push_back(last);
    }
  }

  // Steady state: the last step's end minus the one before.
  std::vector<double> step_end(static_cast<std::size_t>(n_steps), 0);
  std::vector<int> step_last(static_cast<std::size_t>(n_steps), -1);
  for (std::size_t i = 0; i < tl.tasks.size(); ++i) {
    const Task& t = tl.tasks[i];
    const std::size_t si = static_cast<std::size_t>(t.step);
    if (t.end >= step_end[si]) {
      step_end[si] = t.end;
      step_last[si] = static_cast<int>(i);
    }
  }
  const double window_start = step_end[static_cast<std::size_t>(n_steps - 2)];
  tl.step_seconds = step_end.back() - window_start;
  tl.stage = c.pp_stage;
  tl.tflops_per_gpu = c.flops_executed * static_cast<double>(G) / tl.step_seconds / 1e12;
  tl.tokens_per_second = static_cast<double>(c.tokens) * static_cast<double>(G) *
                         static_cast<double>(dp) / tl.step_seconds;
  for (int t = step_last.back(); t >= 0 && tl.tasks[static_cast<std::size_t>(t)].end > window_start;
       t = tl.tasks[static_cast<std::size_t>(t)].waited_on)
    tl.critical_path.push_back(t);
  std::reverse(tl.critical_path.begin(), tl.critical_path.end());
  for (const Task& t : tl.tasks)
    if (t.step == n_steps - 1) tl.busy_seconds[static_cast<std::size_t>(t.resource)] += t.seconds;
  return tl;
}

}  // namespace

void recycle(Timeline&& t) {
  if (t.tasks.capacity() > spare_tasks.capacity()) spare_tasks = std::move(t.tasks);
}

Timeline simulate(const StepCosts& c, const Strategy& s, const Hardware& hw, const Cluster& cl,
                  Profile profile) {
  if (s.pp > 1 || c.pp > 1)
    throw Error(fmt::format("simulate: --pp {}: a pipeline's step needs every stage's costs", s.pp),
                "use simulate_pipeline with each stage's step_costs, or simulate_model");
  check_costs(c, s);
  return simulate_rank(c, s, hw, cl, profile, nullptr, group_passes(c, s, hw, cl));
}

namespace {

// Whether stages a and b end their step alike after their last backward: the same groups'
// parameters and last backward, in order, and no embeddings to sync. Then b's step is a's,
// shifted by when each one's last backward ends (simulate_pipeline times one of them).
bool same_tail(const StepCosts& a, const GroupPasses& pa, const StepCosts& b, const GroupPasses& pb) {
  if (a.n_params != b.n_params || a.n_expert_params != b.n_expert_params ||
      a.tied_embedding_params != 0 || b.tied_embedding_params != 0)
    return false;
  std::size_t i = 0, j = 0;
  const std::size_t n = a.group_params.size();
  for (;; ++i, ++j) {
    while (i < n && !holds(a, i)) ++i;
    while (j < n && !holds(b, j)) ++j;
    if (i == n || j == n) return i == n && j == n;
    const PassSeconds &x = pa.bwd[i], &y = pb.bwd[j];
    auto experts = [](const StepCosts& c, std::size_t g) {
      return c.group_expert_params.empty() ? uint64_t{0} : c.group_expert_params[g];
    };
    if (a.group_params[i] != b.group_params[j] || experts(a, i) != experts(b, j) || x.compute != y.compute ||
        x.tp_exposed != y.tp_exposed || x.cp_exposed != y.cp_exposed || x.a2a != y.a2a)
      return false;
  }
}

}  // namespace

Timeline simulate_pipeline(const std::vector<StepCosts>& stages, const Strategy& s,
                           const Hardware& hw, const Cluster& cl, Profile profile) {
  const int64_t p = s.pp, m = s.grad_accum, v = s.vp;
  if (static_cast<int64_t>(stages.size()) != p)
    throw Error(fmt::format("simulate_pipeline: {} stages' costs for --pp {}", stages.size(), p),
                "one step_costs per pipeline stage, stage 0 first");
  if (p == 1) return simulate(stages.front(), s, hw, cl, profile);
  std::vector<double> f, b;
  std::vector<GroupPasses> gps;
  for (std::size_t i = 0; i < stages.size(); ++i) {
    const StepCosts& c = stages[i];
    if (c.pp != p || c.pp_stage != static_cast<int64_t>(i) || c.pp_chunks != v)
      throw Error(fmt::format("simulate_pipeline: costs {} are of stage {} of --pp {} --vp {}, not "
                              "stage {} of --pp {} --vp {}",
                              i, c.pp_stage, c.pp, c.pp_chunks, i, p, v),
                  "build stage i's graph with GraphOptions pp_stage = i");
    check_costs(c, s);
    gps.push_back(group_passes(c, s, hw, cl));
    const StagePass x = stage_pass(c, s, hw, cl, gps.back());
    f.push_back(x.forward);
    b.push_back(x.backward);
  }
  const PipelineMakespan mk = makespan_closed_form(s.pp_schedule, p, m, v, f, b);
  // Tied embeddings: first and last stage all-reduce the word embeddings' gradient (2 ranks).
  const double sync_gbps = p2p_gbps(s, hw, cl, 0, p - 1);
  Timeline out;
  std::vector<double> seconds(stages.size(), 0);
  double flops = 0, busy = 0;
  std::size_t timed = 0;  // the last stage simulated
  for (std::size_t i = 0; i < stages.size(); ++i) {
    const StepCosts& c = stages[i];
    flops += c.flops_executed;
    busy += static_cast<double>(m) * (f[i] + b[i]);
    // Equal middle stages end their last backward earlier the later they are, then do the same:
    // the first of them is the slowest.
    if (i > 0 && same_tail(stages[timed], gps[timed], c, gps[i])) {
      seconds[i] = seconds[timed] - (mk.end[timed] - mk.end[i]);
      continue;
    }
    PipelineRank rank;
    // The last micro-batch's backward, as simulate_rank issues it.
    double last = 0;
    for (std::size_t g = 0; g < c.group_params.size(); ++g)
      last += gps[i].bwd[g].total();
    rank.before = std::max(0.0, mk.end[i] - last);
    rank.embedding_sync = allreduce_seconds(static_cast<double>(c.tied_embedding_params) *
                                                static_cast<double>(grad_bytes(s)),
                                            2, sync_gbps);
    Timeline t = simulate_rank(c, s, hw, cl, profile, &rank, gps[i]);
    seconds[i] = t.step_seconds;
    timed = i;
    if (i == 0 || t.step_seconds > out.step_seconds) std::swap(out, t);
    recycle(std::move(t));
  }
  out.stage_seconds = std::move(seconds);
  out.stage_forward = f;
  out.stage_backward = b;
  out.pipeline_seconds = mk.makespan;
  out.bubble_fraction = mk.makespan > 0 ? 1.0 - busy / static_cast<double>(p) / mk.makespan : 0.0;
  // Per GPU: the stages' executed FLOPs over the pipeline's GPUs; tokens of the whole job.
  out.tflops_per_gpu = flops * static_cast<double>(m) / static_cast<double>(p) / out.step_seconds / 1e12;
  out.tokens_per_second = static_cast<double>(stages.front().tokens) * static_cast<double>(m) *
                          static_cast<double>(s.dp) / out.step_seconds;
  return out;
}

Timeline simulate_model(const models::ModelSpec& model, const Strategy& s, const Hardware& hw,
                        const Cluster& cl, const PlanOptions& o) {
  models::GraphOptions go = graph_options(model, s, o);
  std::vector<StepCosts> stages;
  for (int64_t st = 0; st < s.pp; ++st) {
    go.pp_stage = st;
    stages.push_back(step_costs(models::build_training_graph(model, go)));
  }
  return simulate_pipeline(stages, s, hw, cl, o.profile);
}

nlohmann::json trace_json(const Timeline& t) {
  using nlohmann::json;
  json ev = json::array();
  ev.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 1},
                {"args", {{"name", "zeroplan step simulation (one rank)"}}}});
  for (int r = 0; r < kResources; ++r)
    ev.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 1}, {"tid", r + 1},
                  {"args", {{"name", std::string(to_string(static_cast<Resource>(r)))}}}});
  std::vector<bool> critical(t.tasks.size(), false);
  for (int i : t.critical_path) critical[static_cast<std::size_t>(i)] = true;
  auto group_name = [&](int i) -> std::string {
    if (i == 0) return "embed";
    if (i == t.n_layer + 1) return "head";
    return fmt::format("h.{}", i - 1);
  };
  for (std::size_t i = 0; i < t.tasks.size(); ++i) {
    const Task& k = t.tasks[i];
    const std::string_view kind = k.kind;
    const bool per_group = kind == "fwd" || kind == "bwd" || kind == "all-gather" || kind == "all-to-all" ||
                           kind == "h2d params" || kind == "nvme read params";
    const std::string what = per_group ? fmt::format("{} {}", k.kind, group_name(k.index))
                                       : fmt::format("{} {}", k.kind, k.index);
    ev.push_back({{"name", what},
                  {"ph", "X"},
                  {"pid", 1},
                  {"tid", static_cast<int>(k.resource) + 1},
                  {"ts", k.start * 1e6},
                  {"dur", k.seconds * 1e6},
                  {"args", {{"step", k.step}, {"micro", k.micro}, {"critical", critical[i]}}}});
  }
  return {{"traceEvents", ev}, {"displayTimeUnit", "ms"}};
}

}  // namespace zp::planner
