// simulate.cpp: per-group costs read off the training graph, and the list-scheduled simulation
// of ZeRO steps on FIFO resources. Not a cycle-accurate GPU model: compute is a roofline of
// achievable FLOP/s and HBM bandwidth; links are bandwidths without latency.
#include "zp/planner/simulate.hpp"

#include <algorithm>
#include <array>
#include <cmath>

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
  for (const models::Op& op : g.ops) {
    // A recomputation's read of SAC's storage moves nothing.
    if (op.phase == Phase::optimizer || op.kind == OpKind::sac_reuse) continue;
    const std::size_t i = group(op.layer);
    const bool fwd = op.phase == Phase::forward;
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

std::string Task::name() const {
  return fmt::format("{} {} (step {}, micro {})", kind, index, step, micro);
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

Timeline simulate(const StepCosts& c, const Strategy& s, const Hardware& hw, const Cluster& cl,
                  Profile profile) {
  if (c.group_params.empty()) throw Error("simulate: empty step costs", "build them with step_costs(graph)");
  Timeline tl;
  tl.n_layer = c.n_layer;
  const int64_t dp = s.dp, mp = s.mp;
  const int64_t per_node = std::max<int64_t>(1, std::min<int64_t>(dp * mp, hw.gpus_per_node));
  const double flops_per_s = hw.gpu_tflops * 1e12, hbm = hw.hbm_gbps * 1e9;
  const double h2d = hw.h2d_gbps * 1e9, d2h = hw.d2h_gbps * 1e9;
  const bool ckpt_cpu = s.cpu_checkpointing && s.checkpointing == Checkpointing::full;
  const double ckpt_bytes = static_cast<double>(c.boundary_bytes) /
                            static_cast<double>(s.partition_activations ? s.mp : 1);
  // Host resources are shared by the ranks of a node.
  const double cpu_rate = hw.cpu_adam_gparams * 1e9 / static_cast<double>(per_node);
  const double nvme_r = hw.nvme_read_gbps * 1e9 / static_cast<double>(per_node);
  const double nvme_w = hw.nvme_write_gbps * 1e9 / static_cast<double>(per_node);
  // PyTorch FSDP (simulate.hpp): units sharded over the shard group, replicated (hybrid)
  // over the rest; a shard group within a node talks over NVLink.
  const bool fsdp = profile == Profile::fsdp && s.stage == 3;
  const int64_t shard_ranks = fsdp ? fsdp_shard_world(s) : dp;
  const int64_t replicas = fsdp ? fsdp_replicas(s) : 1;
  const double dp_bus = replicas > 1 && shard_ranks <= hw.gpus_per_node ? hw.nvlink_gbps
                                                                       : bus_gbps(hw, dp, cl);
  const double replica_gbps =
      cl.nodes <= 1 ? hw.nvlink_gbps
                    : std::min(hw.nvlink_gbps,
                               hw.internode_gbps / static_cast<double>(std::max<int64_t>(1, hw.gpus_per_node)));
  // Expert parameters: the expert-data-parallel group of dp/ep ranks (DeepSpeed-MoE); FSDP
  // shards them with the rest.
  const int64_t edp = fsdp ? shard_ranks : expert_dp(s);
  const double edp_bus = fsdp ? dp_bus : bus_gbps(hw, edp, cl);
  const double a2a_gbps = alltoall_gbps(hw, s.ep, mp, cl);
  auto expert_of = [&](std::size_t i) {
    return c.group_expert_params.empty() ? uint64_t{0} : c.group_expert_params[i];
  };
  auto a2a_seconds = [&](std::size_t i, bool fwd) {
    if (s.ep <= 1 || c.a2a_fwd_bytes.empty()) return 0.0;
    return alltoall_seconds(fwd ? c.a2a_fwd_bytes[i] : c.a2a_bwd_bytes[i], s.ep, a2a_gbps);
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
  const double rbytes = !fsdp ? pbytes
                        : s.precision == Precision::fp32 ? 4.0
                        : s.reduce_precision == Precision::bf16 ? 2.0 : 4.0;
  const std::size_t n = c.group_params.size();
  const int n_groups = static_cast<int>(n);
  // Megatron: two all-reduces of a (B, T, C) activation per block and pass, on the stream.
  const double tp_seconds = mp > 1 ? 2 * allreduce_seconds(static_cast<double>(c.boundary_bytes),
                                                           mp, hw.nvlink_gbps)
                                   : 0.0;
  auto compute_seconds = [&](std::size_t i, bool fwd) {
    const bool block = i > 0 && i + 1 < n;
    return (fwd ? c.fwd_flops[i] : c.bwd_flops[i]) / flops_per_s +
           (fwd ? c.fwd_bytes[i] : c.bwd_bytes[i]) / hbm + (block ? tp_seconds : 0.0);
  };
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
  tl.tasks.reserve(static_cast<std::size_t>(n_steps) * (static_cast<std::size_t>(G) * n * 6 + 64));
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
    const uint64_t shard = (c.group_params[i] - x + static_cast<uint64_t>(dp) - 1) / static_cast<uint64_t>(dp) +
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
    for (int64_t m = 0; m < G; ++m) {
      sch.micro = static_cast<int>(m);
      const bool last_micro = m + 1 == G;
      // Forward.
      pass_compute.clear();
      staged.clear();
      const std::vector<int>* reads_wait = m == 0 ? params_ready : nullptr;
      const int before_fwd = last_gpu;
      int ckpt_copy = -1;  // Pa+cpu: the previous block's checkpoint copy, waited for
      for (int p = 0; p < n_groups; ++p) {
        const std::size_t i = static_cast<std::size_t>(p);
        const int g = gather(i, prefetch_after(p, before_fwd), reads_wait);
        int t = sch.add("fwd", p, Resource::gpu, compute_seconds(i, true),
                        {g, overlap || p > 0 ? -1 : reduced, ckpt_copy},
                        p == 0 && m == 0 ? params_ready : nullptr);
        if (const double a = a2a_seconds(i, true); a > 0)
          t = sch.add("all-to-all", p, Resource::gpu, a, {t});
        // ZeRO-R Pa+cpu: the block's checkpoint (one (B, T, C) activation, 1/mp of it
        // partitioned) goes to the host after its forward; DeepSpeed's copy is a blocking
        // .cpu() (activation_checkpointing/checkpointing.py), so the next block waits for it.
        if (ckpt_cpu && p > 0 && p + 1 < n_groups) {
          t = sch.add("checkpoint d2h", p, Resource::d2h, ckpt_bytes / d2h, {t});
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
        const std::size_t i = static_cast<std::size_t>(n_groups - 1 - p);
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
        if (!fsdp && bucket < s.buffers.reduce_bucket_size && i != 0) continue;
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
    // Optimizer step, after every gradient.
    std::vector<int>& upd = update_done[static_cast<std::size_t>(st)];
    if (!offload_opt) {
      // Adam on the GPU: reads g16, p32, m, v (2 + 12), writes p32, m, v, p16 (12 + 2).
      const int a = sch.add("gpu adam", 0, Resource::gpu,
                            static_cast<double>(part) * (2 * pbytes + 2 * state_bytes) / hbm, {}, &grads_done);
      int done = a;
      if (dp > 1 && (s.stage == 1 || s.stage == 2))
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
      if (dp > 1 && (s.stage == 1 || s.stage == 2))
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
