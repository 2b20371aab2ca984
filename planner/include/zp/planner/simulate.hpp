// zp/planner/simulate.hpp: the step-time simulator. One training step of one rank as tasks on
// parallel resources (GPU compute, host-to-device, device-to-host, the collective network,
// CPU Adam, NVMe read and write), with the ZeRO schedule's dependencies; outputs the step
// time, TFLOP/s per GPU, the critical path and a Perfetto trace. Not a memory model
// (schedule.hpp) and not a network simulator: collectives are ring formulas on one bandwidth.
//
// Example usage:
//   auto g = models::build_training_graph(model, graph_options(model, s, {}));
//   StepCosts c = step_costs(g);                     // once per (model, B, checkpointing, mp)
//   Timeline t = simulate(c, s, load_hardware("v100-32g"), Cluster{16, 1});
//   fmt::print("{:.3f} s, {:.1f} TFLOP/s\n", t.step_seconds, t.tflops_per_gpu);
//   write(trace_json(t).dump());                     // open in https://ui.perfetto.dev
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "zp/models/graph.hpp"
#include "zp/planner/hardware.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/planner/strategy.hpp"

namespace zp::planner {

// What one micro-step costs on one rank, per ZeRO-3 gather group in forward order (embed,
// h.0 .. h.L-1, head), read off the training graph once and reused for every strategy that
// shares its shape. Matmul-like ops are compute bound (FLOPs), the rest memory bound (bytes
// read and written), so a hardware's roofline prices them without the graph.
struct StepCosts {
  std::vector<double> fwd_flops, bwd_flops;  // per group; bwd includes recomputation
  std::vector<double> fwd_bytes, bwd_bytes;  // HBM bytes of memory-bound ops, per group
  std::vector<uint64_t> group_params;        // parameters per group on this rank (after mp)
  uint64_t n_params = 0;                     // sum of group_params
  // Mixture of experts: of group_params, the routed experts' (this rank's E/ep), which ZeRO
  // partitions and reduces over the dp/ep expert-data-parallel ranks instead of dp.
  std::vector<uint64_t> group_expert_params;
  uint64_t n_expert_params = 0;
  // Bytes of the routed rows (rows x C x activation bytes, the graph's (R, C) tensor) that
  // each all-to-all of the group moves with expert parallelism, summed over the group's
  // all-to-alls: forward (dispatch + combine), backward (the same again, and the recomputed
  // forward's under full recomputation). 0 without MoE layers.
  std::vector<double> a2a_fwd_bytes, a2a_bwd_bytes;
  uint64_t boundary_bytes = 0;               // one (B, T, C) activation: Megatron's all-reduces
  double flops_executed = 0;                 // forward + backward + recompute, one micro-step
  double flops_model = 0;                    // forward + backward
  int64_t tokens = 0;                        // B x T of one micro-step
  int64_t n_layer = 0;
};
StepCosts step_costs(const models::TrainingGraph& g);

// How many GPUs take part (dp x mp of the strategy) and on how many nodes.
struct Cluster {
  int64_t gpus = 1;
  int64_t nodes = 1;
};

enum class Resource { gpu, h2d, d2h, net, cpu, nvme_read, nvme_write };
inline constexpr int kResources = 7;
std::string_view to_string(Resource r);

struct Task {
  const char* kind = "";  // "fwd", "bwd", "all-gather", "reduce-scatter", "cpu adam", ...
  int index = 0;          // the group, bucket or chunk it works on
  Resource resource = Resource::gpu;
  double seconds = 0;
  int step = 0;           // which simulated step it belongs to
  int micro = 0;          // which micro-step
  double start = 0, end = 0;
  int waited_on = -1;     // the task whose end decided this start (a dep or the resource)
  std::string name() const;  // "fwd h.3 (step 1)" style, for traces and reports
};

struct Timeline {
  std::vector<Task> tasks;
  int64_t n_layer = 0;          // to name groups (embed, h.i, head)
  double step_seconds = 0;      // steady state: end of the last step minus end of the one before
  double tflops_per_gpu = 0;    // executed FLOPs (recomputation included) / step time
  double tokens_per_second = 0; // whole cluster
  // The chain of tasks, first to last, whose ends decided the measured step's end (clipped to
  // the step's window). With DPU the chain runs through work that overlaps the next step, so
  // the bottleneck is better read from busy_seconds.
  std::vector<int> critical_path;
  std::array<double, kResources> busy_seconds{};  // per resource, the measured step's tasks
};

// Collective times on the ring algorithm (Patarasuk and Yuan 2009; NCCL's busbw): all-reduce
// moves 2(n-1)/n of the data per rank, reduce-scatter and all-gather (n-1)/n; `bytes` is the
// whole buffer, bus_gbps the per-rank bus bandwidth.
double allreduce_seconds(double bytes, int64_t n, double bus_gbps);
double reduce_scatter_seconds(double bytes, int64_t n, double bus_gbps);
double allgather_seconds(double bytes, int64_t n, double bus_gbps);

// Bus bandwidth of a collective over `ranks` ranks: NVLink inside one node; across nodes the
// ring crosses the network, so the node's NICs (one ring per NIC) bound it.
double bus_gbps(const Hardware& hw, int64_t ranks, const Cluster& c);

// Expert parallelism's all-to-all: each of the n ranks keeps 1/n of its `bytes` and sends the
// rest, so (n-1)/n of them cross the links (and as many arrive), at `gbps` per rank.
double alltoall_seconds(double bytes, int64_t n, double gbps);
// Bandwidth per rank of an all-to-all over an expert-parallel group of `ep` data-parallel
// ranks (each mp GPUs wide: the group spans ep x mp consecutive GPUs): NVLink when they sit in
// one node, otherwise each GPU's share of its node's network (internode_gbps / gpus_per_node;
// every GPU of the node exchanges at once), at most NVLink.
double alltoall_gbps(const Hardware& hw, int64_t ep, int64_t mp, const Cluster& c);

// Simulates steady-state steps: tasks issue in program order, each resource runs them first
// come first served (a CUDA stream, a copy engine, the CPU's Adam threads, the NVMe queue), a
// task starts when its dependencies are done and its resource is free. The dependencies:
// - forward per group, then backward in reverse; Megatron's two all-reduces per block and
//   pass (mp > 1) block the GPU stream; so do expert parallelism's all-to-alls (ep > 1; an
//   "all-to-all" task after the group's compute: the experts wait for their rows), forward
//   dispatch + combine and backward the same again, alltoall_seconds of each one's routed
//   rows over the ep ranks at alltoall_gbps;
// - expert parameters (MoE) are gathered, reduced and partitioned over the dp/ep ranks of
//   their expert-data-parallel group, the others over dp;
// - stage 3: each group is all-gathered before use, prefetch_bucket_size elements ahead; with
//   offload_param the partition first crosses PCIe (and is read from NVMe);
// - gradients reduced per reduce_bucket_size bucket as soon as the bucket is full, overlapping
//   the rest of the backward pass (stages 2-3 every micro-step, 0-1 on the last); with an
//   offloaded optimizer each reduced partition crosses to the host (2 bytes per element);
// - the optimizer after the last gradient (the norm and overflow check need them all): Adam
//   on the GPU (28 bytes of HBM traffic per element), or on the CPU in chunks pipelined with
//   the NVMe reads and writes of the states and the 16-bit parameters' copy back; stages 1-2
//   all-gather the updated parameters;
// - without DPU the next step's forward waits for the update; with DPU (ZeRO-Offload sec.
//   5.2) it waits for the update of the step before, so the CPU work overlaps a whole step.
// PyTorch FSDP (profile fsdp) differs (torch/distributed/fsdp; schedule.cpp's FSDP section):
// - each group (unit) is gathered from and reduce-scattered over its shard group
//   (fsdp_shard_world: dp, or the hybrid shard size, whose ranks sit in one node: NVLink), one
//   unit at a time (no reduce_bucket_size), the gradients in the reduce dtype;
// - hybrid sharding (fsdp_replicas > 1): each unit's reduced shard is all-reduced over the
//   replicas (foreach_reduce's all_reduce; FSDP1's _reduce_grad), at each GPU's share of its
//   node's network (every GPU of the node all-reduces at once) when they span nodes;
// - CPU offload (--offload-param cpu): a unit's shard crosses PCIe before its all-gather in
//   the weights' dtype (4 bytes per element under mixed precision), its reduced gradient
//   shard crosses back after the reduction, and the optimizer steps on the host (cpu
//   adam, at the hardware's cpu_adam_gparams: DeepSpeed's CPU Adam rate, an optimistic
//   bound for torch.optim's host step, which is not measured here), nothing to copy back
//   (the next gathers read the host shards).
Timeline simulate(const StepCosts& c, const Strategy& s, const Hardware& hw, const Cluster& cl,
                  Profile profile = Profile::zeroplan);

// Chrome Trace Event JSON, one track per resource, critical-path tasks marked; opens in Perfetto.
nlohmann::json trace_json(const Timeline& t);

}  // namespace zp::planner
