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
//   Timeline p = simulate_model(model, s_with_pp, hw, cl);  // a pipeline: every stage's graph
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

// A collective over the t ranks of the tensor-parallel group in one pass of one micro-batch.
// ring_exchange and all_to_all are context parallelism's (below).
enum class CollectiveKind : uint8_t { all_reduce, all_gather, reduce_scatter, ring_exchange, all_to_all };
struct TpCollective {
  CollectiveKind kind = CollectiveKind::all_reduce;
  double bytes = 0;  // the whole (B, T, w) tensor (ring formulas below)
  // FLOPs of the GEMM it overlaps: Megatron issues it with async_op=True just before that GEMM
  // and waits after it, so only its time beyond the GEMM's is exposed. 0: the stream waits.
  double overlap_flops = 0;
};
// Context parallelism's exchanges have the same shape, over the cp ranks of the context-
// parallel group (stride tp in Megatron's order: group_bus_gbps(hw, cl, cp, tp)):
// - ring (TransformerEngine's AttnFuncWithCPAndKVP2P, Megatron's default cp_comm_type p2p):
//   ring_exchange, cp - 1 steps in each of which every rank sends `bytes` to the next and
//   receives as much from the one before, (cp - 1) bytes / bandwidth in all, issued beside
//   the attention's blockwise compute (overlap_flops: the attention op's FLOPs) so only what
//   exceeds it is exposed. Forward one key|value block per step (the attention op's
//   comm_bytes / cp), backward the block and its gradient (comm_bytes / 2: the graph holds
//   two of each for the double buffering);
// - DeepSpeed-Ulysses: all_to_all of each cp_all_to_all op's tensor (alltoall_seconds), the
//   stream waiting for it (deepspeed/sequence/layer.py _SeqAllToAll is synchronous).

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
  uint64_t boundary_bytes = 0;               // one (B, T, C) activation (Pa+cpu's checkpoint)
  // Tensor parallelism (tp > 1): the collectives of each group's forward and backward (the
  // backward's including those of the recomputed forward), in op order; step_costs says where
  // each comes from. Empty for tp = 1.
  int64_t tp = 1;
  bool sp = false;
  std::vector<std::vector<TpCollective>> tp_fwd, tp_bwd;
  // Context parallelism (cp > 1): each group's exchanges, forward and backward (recomputation
  // with the backward), ring_exchange or all_to_all (above). Empty for cp = 1.
  int64_t cp = 1;
  std::vector<std::vector<TpCollective>> cp_fwd, cp_bwd;
  // Pipeline parallelism: the stage this graph is (pp, pp_stage, pp_chunks of GraphOptions),
  // the bytes of one p2p message (the (B, T, C) activation a chunk sends on, (B, T/t, C) under
  // sequence parallelism, and its gradient coming back; 0 when pp = 1), and with tied
  // embeddings the word embeddings' elements on this rank that the first and last stage keep
  // equal (0 on the other stages and without pipelining).
  int64_t pp = 1, pp_stage = 0, pp_chunks = 1;
  uint64_t p2p_bytes = 0;
  uint64_t tied_embedding_params = 0;
  double flops_executed = 0;                 // forward + backward + recompute, one micro-step
  double flops_model = 0;                    // forward + backward
  int64_t tokens = 0;                        // B x T of one micro-step
  int64_t n_layer = 0;
};
// Reads the costs off one rank's graph (one pipeline stage's with pp > 1). Tensor-parallel
// collectives, as Megatron-LM places them:
// - without sequence parallelism (Shoeybi et al. 2019 sec. 3, fig. 3: the conjugate f and g
//   operators), the graph has no communication ops, so they are placed by its structure:
//   g, an all-reduce of the (B, T, C) output of every row-parallel linear (a block matmul
//   writing a (B, T, C) tensor from an input no norm wrote: attention's output projection,
//   the MLP's down projection; an MoE layer's combine of tensor-split experts) and of the
//   vocabulary-parallel embedding's lookup, in forward and again in a recomputed forward
//   (megatron/core/tensor_parallel/mappings.py reduce_from_tensor_model_parallel_region; the
//   stream waits for it); f, an all-reduce of the input gradient of the column-parallel
//   linears reading each normalized (B, T, C) tensor (q|k|v, the MLP's up projection, the
//   router, the vocabulary-parallel head), in backward, issued asynchronously before the
//   linears' weight-gradient GEMM and waited for after it (tensor_parallel/layers.py
//   LinearWithGradAccumulationAndAsyncCommunication.backward, allreduce_dgrad;
//   TransformerEngine's pytorch/module/linear.py _Linear.backward does the same), so it
//   overlaps that GEMM (half the linear's backward FLOPs). Two g and two f per block: 4
//   all-reduces of (B, T, C) a layer, Shoeybi et al.'s count. The vocabulary-parallel loss's
//   all-reduces of (B, T) maxima and sums are left out (1/C of these).
// - with sequence parallelism the graph's sp_all_gather and sp_reduce_scatter ops (Korthikanti
//   et al. 2022 sec. 4.2.2): in forward and recomputation the stream waits for each; in
//   backward a column-parallel linear's input is all-gathered again asynchronously before its
//   input-gradient GEMM (overlapping it) and its input gradient reduce-scattered before its
//   weight-gradient GEMM (overlapping that), layers.py as above; the all-gather of a row-
//   parallel linear's output gradient (the reduce-scatter's backward, mappings.py
//   _ReduceScatterToSequenceParallelRegion) is waited for.
// Megatron's tp_comm_overlap (TransformerEngine's userbuffers, off by default:
// model_parallel_config.py) is not modelled. Communication ops (sp, pp, cp) cost no HBM
// traffic here: their time is the collective's or the send's. Context parallelism's
// exchanges are read off the attention ops' comm_bytes (ring) and the cp_all_to_all ops
// (Ulysses) into cp_fwd / cp_bwd (TpCollective above says how they are timed).
StepCosts step_costs(const models::TrainingGraph& g);

// How many GPUs take part (the strategy's world: dp x tp x pp x cp) and on how many nodes.
struct Cluster {
  int64_t gpus = 1;
  int64_t nodes = 1;
};

// Where the ranks sit. Megatron-LM numbers them tensor-parallel first, then context, expert,
// data and pipeline parallel (megatron/core/parallel_state.py initialize_model_parallel,
// order "tp-cp-ep-dp-pp"; RankGenerator): global rank = tp_rank + tp (cp_rank + cp (dp_rank +
// dp pp_rank)), the expert grid tp-ep-dp-pp alike (dp/ep expert-data-parallel ranks at stride
// tp ep), and consecutive ranks fill a node. So a group of n ranks at stride k spans n k
// consecutive ranks: the tensor-parallel group (stride 1) sits in one node when tp divides
// the node's GPUs, the data-parallel group (stride tp cp) spans tp cp dp ranks, and pipeline
// stages are tp cp dp ranks apart.
// GPUs of one node the job uses: gpus / nodes, at most the hardware's gpus_per_node.
int64_t node_gpus(const Hardware& hw, const Cluster& c);
// Bus bandwidth per rank of a ring collective over n ranks at stride k: NVLink when every
// such group lies in one node; otherwise the ring crosses the network, where the group's
// ranks on a node (G / k of them, at least 1, at most n; G = node_gpus) have as many of the
// node's rails, each a 1/G share of internode_gbps (every rank of the node runs the same
// collective in its own group at once); at most NVLink. With k = 1 and n >= G that is the
// node's whole network, as bus_gbps says of a data-parallel group without model parallelism.
double group_bus_gbps(const Hardware& hw, const Cluster& c, int64_t n, int64_t stride);
// Whether the ranks of pipeline stages a < b (stride tp cp dp apart) are on different nodes
// for some of them: the ranks [a S, (b + 1) S) of both do not all lie in one node.
bool pipeline_link_crosses_nodes(const Strategy& s, const Hardware& hw, const Cluster& c,
                                 int64_t a, int64_t b);
// Bandwidth per GPU of a p2p send between those stages: NVLink within a node, else the GPU's
// share of its node's network (internode_gbps / G: every GPU of a stage sends at once),
// at most NVLink.
double p2p_gbps(const Strategy& s, const Hardware& hw, const Cluster& c, int64_t a, int64_t b);

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
  // Pipeline parallelism (simulate_pipeline): the tasks above are the slowest stage's, whose
  // forward and backward passes of all but its last micro-batch backward are one "pipeline"
  // task; per stage, one micro-batch's forward and backward (all its chunks, with their
  // collectives and p2p sends) and the stage's step; the passes' makespan (bubbles included)
  // and the mean idle fraction of the stages within it.
  int64_t stage = 0;
  std::vector<double> stage_forward, stage_backward, stage_seconds;
  double pipeline_seconds = 0;
  double bubble_fraction = 0;
};

// One pass of one group (one micro-batch), in seconds on the GPU's stream: the roofline's
// compute, the tensor-parallel collectives (all of them, and what the stream waits for: the
// blocking ones plus each overlapped one's time beyond its GEMM's), context parallelism's
// exchanges (likewise, beyond the attention's compute), expert parallelism's all-to-alls.
struct PassSeconds {
  double compute = 0;
  double tp = 0;          // every tensor-parallel collective's time
  double tp_exposed = 0;  // of that, what the stream waits for
  double a2a = 0;
  double cp = 0;          // every context-parallel exchange's time
  double cp_exposed = 0;  // of that, what the stream waits for
  double total() const { return compute + tp_exposed + cp_exposed + a2a; }
};
PassSeconds pass_seconds(const StepCosts& c, const Strategy& s, const Hardware& hw,
                         const Cluster& cl, std::size_t group, bool forward);
// One micro-batch through one pipeline stage (all its groups and chunks), and its p2p
// exchanges: per chunk and pass, the send and the receive of one p2p_bytes message run
// together, on the links to the neighbouring virtual stages (p2p_gbps), at the slower one's
// pace. Megatron's 1F1B waits for them (p2p_communication.py _communicate: batch_isend_irecv,
// then wait; arguments.py turns overlap_p2p_comm off without interleaving), so they add to
// the pass; the interleaved schedule overlaps them with the chunk's compute (overlap_p2p_comm,
// on by default: --no-overlap-p2p-communication), so the pass takes the longer of the two;
// GPipe (torch.distributed.pipelining's ScheduleGPipe waits for each receive before the
// forward or backward that reads it) adds them.
struct StagePass {
  double forward = 0, backward = 0;  // with p2p
  double p2p = 0;                    // of each, the exchanges' time
};
StagePass stage_pass(const StepCosts& c, const Strategy& s, const Hardware& hw, const Cluster& cl);

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
// - forward per group, then backward in reverse, each as pass_seconds has it: tensor
//   parallelism's collectives (step_costs) in the pass; expert parallelism's all-to-alls (ep > 1; an
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

// Hands a timeline's task storage back to be reused by the next simulation on this thread
// (fit's search simulates thousands of steps and keeps only their times).
void recycle(Timeline&& t);

// Pipeline parallelism: stages[i] is stage i's costs (its graph's step_costs). Each stage's
// micro-batch (stage_pass) feeds makespan_closed_form (pipeline.hpp) with the strategy's
// schedule (pp_schedule, grad_accum micro-batches, vp chunks): the passes of the step with
// their bubbles, and when each stage's last backward ends. From there each stage goes on as
// simulate() has it after a last micro-step's backward (stages 0-1: pipelining refuses 2-3):
// its gradients reduced over ZeRO's dp x cp ranks (group_bus_gbps at stride tp), with
// tied embeddings the first and last stage's word-embedding gradients all-reduced together
// (megatron/core/distributed/finalize_model_grads.py _allreduce_word_embedding_grads), the
// optimizer, stage 1's all-gather; the step is the slowest stage's (the next step's passes
// wait for every stage's update: a pipeline flush, Narayanan et al. 2021 sec. 2.2). The
// timeline returned is that stage's, its passes before its last micro-batch's backward one
// task. simulate() with pp > 1 refuses: it holds one graph.
Timeline simulate_pipeline(const std::vector<StepCosts>& stages, const Strategy& s,
                           const Hardware& hw, const Cluster& cl,
                           Profile profile = Profile::zeroplan);

// The graph of each stage (one without pipelining) built from the model, then
// simulate_pipeline: what fit's evaluator does per configuration, for one strategy.
Timeline simulate_model(const models::ModelSpec& model, const Strategy& s, const Hardware& hw,
                        const Cluster& cl, const PlanOptions& o = {});

// Chrome Trace Event JSON, one track per resource, critical-path tasks marked; opens in Perfetto.
nlohmann::json trace_json(const Timeline& t);

}  // namespace zp::planner
