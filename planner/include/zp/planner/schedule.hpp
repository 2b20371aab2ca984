// zp/planner/schedule.hpp: the memory schedule of one training step on one rank: every
// buffer the step holds (model states, ZeRO buffers, the graph's activations and
// workspaces), when it is allocated and freed, and the replay of that sequence through an
// allocator model into peaks per tier and category and a timeline. This is the planner's
// prediction; the runtime follows the same rules and measures them.
//
// Example usage:
//   auto g = models::build_training_graph(model, graph_options(model, s, opts));
//   MemorySchedule sch = build_schedule(g, s, opts);
//   MemoryReport r = replay(sch, opts);
//   uint64_t gpu_peak = r.per_device.peak(Tier::gpu);
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "zp/models/graph.hpp"
#include "zp/planner/memory.hpp"
#include "zp/planner/model_states.hpp"
#include "zp/planner/strategy.hpp"

namespace zp::planner {

// Whose allocations are predicted: zeroplan's runtime (its arena, its buffers), DeepSpeed on
// PyTorch (its buffers, the caching allocator), PyTorch FSDP (fully_shard as torchtitan runs
// it: per-unit all-gathers and reduce-scatters, the caching allocator), or plain PyTorch (one
// GPU, or DistributedDataParallel: the Hugging Face Trainer or accelerate without DeepSpeed or
// FSDP; stage 0).
enum class Profile { zeroplan, deepspeed, fsdp, pytorch };
// Where the runtime computes: the CPU backend stores activations in fp32; CUDA in the
// training precision.
enum class Backend { cpu, cuda };
std::string_view to_string(Profile p);
std::string_view to_string(Backend b);
std::optional<Profile> profile_from_string(std::string_view s);
std::optional<Backend> backend_from_string(std::string_view s);

// Whose modeling code runs the model: zeroplan's fused kernels (zero-run; also Megatron's and
// torchtitan's fused paths keep the same tensors), or Hugging Face transformers' (what
// DeepSpeed and FSDP users mostly train; GraphOptions::hf_modeling).
enum class ModelCode { fused, transformers };
std::string_view to_string(ModelCode c);
std::optional<ModelCode> model_code_from_string(std::string_view s);

struct PlanOptions {
  Profile profile = Profile::zeroplan;
  Backend backend = Backend::cuda;
  ModelCode model_code = ModelCode::fused;
  // The GPU's memory in bytes, for what DeepSpeed decides from the free memory it sees
  // (stage 1-2 flatten the model on the GPU only when the copy fits beside it); 0: unknown,
  // taken as room enough. estimate() and fit() set it from the hardware.
  uint64_t gpu_capacity = 0;
  bool operator==(const PlanOptions&) const = default;
};

// The graph options a strategy implies (batch, sequence, activation bytes, recomputation,
// flash attention, tensor parallelism, P_a).
models::GraphOptions graph_options(const models::ModelSpec& m, const Strategy& s,
                                   const PlanOptions& o);

// What the graph of graph_options computes in, for a run's headline: "fp32 activations", or
// "bf16 activations, dropout" (dropout where the model has a probability above 0 and the
// graph keeps it).
std::string describe_compute(const models::ModelSpec& m, const Strategy& s, const PlanOptions& o);

// One buffer of the step: a graph tensor, a model state, or a ZeRO buffer.
struct MemBuffer {
  std::string name;
  Tier tier = Tier::gpu;
  Category category = Category::activations;
  uint64_t bytes = 0;
  int32_t layer = -1;  // for activations: the block it belongs to
};

struct MemEvent {
  int32_t pos = -1;   // index into the graph's execution order; -1 before the first op, the
                      // op count after the last (a checkpoint between steps)
  bool alloc = true;  // allocate or free
  uint32_t buffer = 0;
  // torch.cuda.empty_cache() (DeepSpeed calls it around its flatten): the caching allocator
  // releases its unused segments. alloc is false and buffer names a 0-byte marker.
  bool empty_cache = false;
};

// What one GPU holds in nvidia-smi's view: the allocator's reserved peak, and what the
// process holds outside it. The deepspeed profile (PyTorch): the CUDA context with the
// kernels (kCudaContextBytes), cuBLAS's workspace (kCublasWorkspaceBytes; PyTorch takes it
// from its caching allocator at the first GEMM, a single block the schedule does not list),
// and NCCL's buffers with dp > 1 (kTorchNcclBytes). The zeroplan profile on CUDA: the upper
// bound of cuda_outside_arena_bound (what the runtime measures beside its arena). On the cpu
// backend there is no device: all zero.
struct DeviceTotal {
  uint64_t reserved = 0, context = 0, cublas_workspace = 0, nccl = 0;
  uint64_t outside() const { return context + cublas_workspace + nccl; }
  uint64_t total() const { return reserved + outside(); }
};

struct MemorySchedule {
  std::vector<MemBuffer> buffers;
  std::vector<MemEvent> events;     // in execution order
  uint64_t n_params = 0;            // Psi on this rank (after tensor parallelism)
  uint64_t partition_elems = 0;     // elements of each partitioned state a rank owns
  uint64_t n_expert_params = 0;     // of n_params, routed-expert elements (this rank's E/ep)
  uint64_t expert_partition_elems = 0;  // of partition_elems, expert elements (over dp/ep)
  std::vector<std::pair<std::string, uint64_t>> groups;  // ZeRO-3 gather groups, elements
  std::vector<std::string> op_names;  // by position, for the timeline
  // GPU memory outside the allocator that replay() adds to the peak: outside_allocator()
  // under the deepspeed profile, nothing under zeroplan (whose device total is reported
  // apart, as a bound). Empty for schedules of model states alone (fit's partial replays).
  DeviceTotal outside;
};

// Partitioned elements a rank owns: stages 1-2 split the flat parameter buffer (padded to a
// multiple of dp, as DeepSpeed's stage 1/2 flat groups); stage 3 splits each gather group
// separately (so each group all-gathers as equal blocks). 0 for stage 0.
uint64_t partition_elems(const std::vector<uint64_t>& group_elems, int stage, uint64_t dp);

// The same for a Mixture-of-Experts model under DeepSpeed-MoE's grouping (Rajbhandari et al.
// 2022, "DeepSpeed-MoE", sec. 4; deepspeed/moe/utils.py
// split_params_into_different_moe_groups_for_optimizer): `expert_elems[i]` of group i's
// `group_elems[i]` elements are routed-expert parameters (this rank's E/ep experts), the rest
// are dense. Dense elements are partitioned over the dp ranks, expert elements over the
// expert-data-parallel group of edp = dp/ep ranks (the ranks holding the same experts):
//   stages 1-2: DeepSpeed keeps the expert parameters in optimizer param groups of their own
//     (one flat buffer each, partitioned over its own group: stage_1_and_2.py gives a MoE
//     group the expert-data-parallel process group), so
//       part = ceil(sum dense / dp) + ceil(sum expert / edp);
//   stage 3: every parameter is partitioned over its own group (stage3.py: an expert
//     parameter's ds_process_group is its expert-data-parallel group), per gather group
//       part = sum_i ceil(dense_i / dp) + ceil(expert_i / edp).
// A dense model (every expert_elems 0) gives partition_elems(group_elems, stage, dp).
uint64_t partition_elems(const std::vector<uint64_t>& group_elems,
                         const std::vector<uint64_t>& expert_elems, int stage, uint64_t dp,
                         uint64_t edp);

// Whether a graph tensor holds routed-expert parameters (or their gradients): the graph names
// them h.<l>.moe.experts.fc / .proj (ParamTensor::expert in the inventory).
bool is_expert_tensor(const models::Tensor& t);

// Pipeline parallelism: the micro-batches whose activations stage `stage` (0-based) of s.pp
// holds at once under the step's schedule (1 without pipelining). schedule.cpp has the source.
int64_t pipeline_in_flight(const Strategy& s, int64_t stage);

// Elements of one pinned host tile through which an offloaded optimizer returns the updated
// 16-bit parameters (two tiles, alternating): DeepSpeed's CPU Adam TILE, 128 Mi elements,
// the default of Strategy::buffers.offload_tile_size.
inline constexpr uint64_t kOffloadTileElems = uint64_t{128} * 1024 * 1024;
static_assert(kOffloadTileElems == BufferSizes{}.offload_tile_size);

// Bytes of one of those tiles for this strategy (min(buffers.offload_tile_size, partition)
// elements, or one swap chunk with the optimizer on NVMe): 0 without an offloaded optimizer,
// with the delayed update (it writes a host copy of the partition instead) or in fp32
// training.
uint64_t offload_tile_bytes(const Strategy& s, uint64_t partition_elems, uint32_t param_bytes);

// Appends, at position `pos` (the optimizer op), the host buffers an offloaded optimizer
// holds during its step and frees after it: the NVMe swap buffers, then the two parameter
// tiles (neither with the delayed update: it holds its swap buffers with the model states).
// The fit search replays them alone, as it does the model states.
void append_offload_buffers(MemorySchedule& out, int32_t pos, const Strategy& s,
                            uint64_t partition_elems, uint32_t param_bytes);

// The optimizer's state bytes on one rank where they depend on the shapes of the tensors it
// is handed (Adafactor's factoring, 8-bit Adam's blocks and min_8bit_size), for
// model_state_bytes and append_model_states; std::nullopt where the flat formula over the
// rank's elements is exact: every other optimizer (bytes linear in elements), and stages 1-3
// of the zeroplan and deepspeed profiles, whose optimizer is handed flat 1-D partitions
// (model_states.hpp). The tensors are the model's (models::count_params), as this rank holds
// them:
//   stage 0 (DDP, one GPU, the Hugging Face Trainer with optim="adafactor"; DeepSpeed's
//     stage 0 too: with fp16/bf16 it wraps any optimizer but its FusedAdam in
//     FP16_UnfusedOptimizer, which keeps one fp32 copy per tensor, runtime/fp16/
//     unfused_optimizer.py; in fp32 the optimizer gets the model's parameters): each tensor
//     with tensor parallelism's split (column: the output features, dim -2 or a bias's dim 0;
//     row: the input features, dim -1; vocab: ceil(V/t) rows) and E/ep routed experts;
//   the fsdp profile (stage 3, FSDP2's fully_shard): each parameter's local shard,
//     ceil(d0/dp) rows of dim 0 (torch.chunk in _fsdp_param.py), taken as a plain tensor of
//     that shape (an assumption: how each optimizer's state follows a DTensor is not checked).
//     8-bit Adam is refused there: bitsandbytes' 8-bit optimizers do not run on FSDP2's
//     DTensor parameters (bitsandbytes issue #1633, open). FSDP1 with use_orig_params=False
//     (one flat parameter per unit) would be flat: not modelled.
// Moments are fp32, or bf16 with --optimizer-states bf16 (zeroplan and deepspeed profiles),
// in the sharded parameters' dtype under fsdp (torch's zeros_like).
std::optional<uint64_t> per_tensor_optimizer_bytes(const models::TrainingGraph& g,
                                                   const Strategy& s, const PlanOptions& o);

// PyTorch FSDP (the fsdp profile): one wrapped unit's sizes in elements, on one rank of a
// shard group of W = fsdp_shard_world(s) ranks. Units are the graph's gather groups (each
// transformer block, the embedding, the final norm with the head), except that FSDP1 puts the
// embedding and the head in one root unit (the outer FullyShardedDataParallel's own
// parameters, as accelerate's transformer-layer auto-wrap leaves them):
//   FSDP2 (fully_shard, _fsdp_param.py FSDPParam._init_sharded_param): each parameter is
//     chunked along dim 0 and every rank's chunk padded to chunk 0's, ceil(d0/W) rows of
//     numel/d0 elements; shard = the sum over the unit's parameters, largest = the largest of
//     them (a parameter's own shard), flat = W x shard (the all-gather output); a
//     shard_placement_fn (torchtitan's Shard(1) for experts when W exceeds their count) is
//     not modelled;
//   FSDP1 (FlatParamHandle, _flat_param.py): the unit's parameters flattened into one
//     FlatParameter of flat elements: their sum, and with use_orig_params each parameter
//     first padded to a multiple of 16 / (compute dtype bytes) elements and the total to a
//     multiple of W (_init_flat_param_and_metadata, _get_aligned_numel); shard = ceil(flat/W)
//     (_get_shard pads the last rank's chunk), largest = shard.
// elems: the unit's parameters, unpadded. The parameters are the inventory's
// (models::count_params), checked against the graph's groups.
struct FsdpUnit {
  uint64_t elems = 0, flat = 0, shard = 0, largest = 0;
};
std::map<std::string, FsdpUnit> fsdp_units(const models::TrainingGraph& g, const Strategy& s);
// The unit a gather group belongs to ("root" for FSDP1's embedding and head).
std::string fsdp_unit_of(const std::string& group, const Strategy& s);

// Appends the persistent model states (allocated before the first op, position -1) in the
// order the runtime allocates them: per tier params, grads, master, moments; then the
// delayed update's second fp32 gradient partition, host parameter copy and (optimizer on
// NVMe) swap buffers; then the parameter swap buffers of --offload-param nvme (cpu tier,
// category buffers). build_schedule
// starts with these; the fit search replays them alone. `optimizer_bytes`: as for
// model_state_bytes (per_tensor_optimizer_bytes). The moments' buffers are named after the
// states they stand for: exp_avg and exp_avg_sq (Adam; 8-bit Adam's state1/absmax1 and
// state2/absmax2), momentum (SGD), exp_avg (Lion), exp_avg_sq (Adafactor: the row and column
// factors, or the full second moment); plain SGD has none.
void append_model_states(MemorySchedule& out, uint64_t n_params, uint64_t partition_elems,
                         const Strategy& s, uint32_t param_bytes,
                         StateLayout layout = StateLayout::zero,
                         std::optional<uint64_t> optimizer_bytes = std::nullopt,
                         uint64_t gpu_step_elems = 0);
// --offload-optimizer nvme (ZeRO-Infinity). Swap files are O_DIRECT and move whole blocks of
// kSwapBlockBytes, so each state's file takes its bytes rounded up to a block on the nvme
// tier (the runtime's Swapper::padded_bytes; one file per state: master, exp_avg, exp_avg_sq
// or momentum). The optimizer step streams the files in lockstep through
// optimizer_swap_buffer_count host buffer sets of one chunk per file: one cpu-tier
// allocation (category buffers) during the optimizer op, aligned to a block inside the arena
// (whose alignment is kArenaAlignment), then the two 16-bit parameter tiles of one chunk.
inline constexpr uint64_t kSwapBlockBytes = 4096;
uint64_t swap_file_bytes(uint64_t bytes);  // bytes rounded up to kSwapBlockBytes
// Elements per chunk: optimizer_swap_chunk_size, or the partition rounded up to 1024
// elements (a block of fp32) where that is smaller.
uint64_t optimizer_swap_chunk_elems(const Strategy& s, uint64_t partition_elems);
// Files: the master and one per moment buffer (append_model_states): 3 for Adam and 8-bit
// Adam, 2 for SGD, Lion and Adafactor, 1 for plain SGD. Each buffer set holds a chunk of fp32
// per file, so 8-bit Adam's (whose states are a quarter of that) is an upper bound.
uint64_t optimizer_swap_files(const Strategy& s);
// buffer_count x files x chunk x 4 bytes, plus kSwapBlockBytes - kArenaAlignment to align.
uint64_t optimizer_swap_buffer_bytes(const Strategy& s, uint64_t partition_elems);

// --offload-param nvme (ZeRO-Infinity; stage 3). The 16-bit partition is one swap file of
// swap_file_bytes(partition x param bytes) on the nvme tier (category params). Shards are read
// from it into param_swap_buffer_count host buffers (DeepSpeed's offload_param.buffer_count),
// one cpu-tier allocation (category buffers) made with the model states and held for the run,
// aligned to a block inside the arena like the optimizer's. A buffer holds
// param_swap_buffer_elems elements: param_swap_buffer_size (DeepSpeed's buffer_size), or the
// partition rounded up to a block of elements where that is smaller. A piece of a shard starts
// anywhere in a block, so a buffer is that many elements' bytes rounded up to a block, plus
// one block for the piece's offset into its first block. Each gathered shard is then staged
// into a device buffer, as with offload_param=cpu; the updated parameters are written back
// after the optimizer step through the same host buffers (no other memory).
uint64_t param_swap_buffer_elems(const Strategy& s, uint64_t partition_elems, uint32_t param_bytes);
// round_up(elems x param_bytes, kSwapBlockBytes) + kSwapBlockBytes.
uint64_t param_swap_buffer_capacity(const Strategy& s, uint64_t partition_elems,
                                    uint32_t param_bytes);
// buffer_count x capacity, plus kSwapBlockBytes - kArenaAlignment to align.
uint64_t param_swap_buffer_bytes(const Strategy& s, uint64_t partition_elems, uint32_t param_bytes);

// A training checkpoint (zero-run --save-checkpoint, runtime/src/checkpoint.cpp): every rank
// writes the elements it owns of each model state (stage 0: rank 0 all of them) into one
// file, in pieces through a host staging buffer of checkpoint_chunk_elems fp32 elements (a
// multiple of kSwapBlockBytes elements, so a piece of any state starts on a block of its swap
// file: the same buffer reads ZeRO-Infinity's swapped states with O_DIRECT), allocated in
// the host tier after the step and freed when the checkpoint is written. DeepSpeed's
// save_checkpoint instead torch.saves each state dict, copying every tensor to the host
// whole; the staging buffer keeps the host's extra bytes to one piece.
inline constexpr uint64_t kCheckpointChunkElems = uint64_t{1} << 22;  // 16 MiB of fp32
uint64_t checkpoint_chunk_elems(uint64_t held_elems);  // min(kCheckpointChunkElems, held), rounded up
uint64_t checkpoint_staging_bytes(uint64_t held_elems);  // chunk x 4 + kSwapBlockBytes - kArenaAlignment
struct CheckpointCost {
  uint64_t bytes_per_element = 0;  // of the states a rank writes, for one element it owns
  uint64_t rank_bytes = 0;         // on disk, the rank that writes the most (rank 0 at stage 0)
  uint64_t total_bytes = 0;        // on disk, every rank's files together
  uint64_t staging_bytes = 0;      // host tier, per rank, while a checkpoint is written or read
  int writers = 1;                 // ranks that write a file
};
// `n_params`: the model's elements; `partition_elems`: a rank's owned elements (padded, as
// the schedule's); the states: the 16-bit (or fp32) parameters, fp32 master weights where the
// step keeps them (mixed precision, an offloaded optimizer), the optimizer's moments, and with
// the delayed parameter update the host copy of the update in flight (at most).
CheckpointCost checkpoint_cost(const Strategy& s, uint64_t n_params, uint64_t partition_elems,
                               uint32_t param_bytes);

MemorySchedule build_schedule(const models::TrainingGraph& g, const Strategy& s,
                              const PlanOptions& o);

struct TimelineSample {
  int32_t pos = -1;
  std::array<std::array<uint64_t, kCategories.size()>, kTiers.size()> bytes{};  // in use
};

struct MemoryReport {
  PerDevice per_device;               // high-water per category; peak = reserved high-water
                                      // plus, on the gpu tier, what is outside the allocator
  std::array<uint64_t, kTiers.size()> peak_allocated{};  // high-water of bytes in use
                                                         // (torch.cuda.max_memory_allocated)
  std::array<uint64_t, kTiers.size()> peak_reserved{};   // high-water of the allocator's
                                                         // reservation (max_memory_reserved)
  DeviceTotal device;                 // the gpu tier as nvidia-smi sees it
  // Bytes allocated per tier before the first op: what the states and buffers of
  // initialization hold (DeepSpeed's see_memory_usage "MA" after deepspeed.initialize).
  std::array<uint64_t, kTiers.size()> after_init{};
  // The high-water of bytes in use before the first op (deepspeed.initialize, with a model
  // built whole: schedule.cpp deepspeed_model_arrives); the peaks above include it.
  std::array<uint64_t, kTiers.size()> init_peak{};
  std::vector<TimelineSample> timeline;  // per position, at its high point (after its
                                         // allocations, before its frees)
  int32_t peak_pos = -1;              // where the gpu tier peaked
};

// GPU memory a PyTorch process holds before its first tensor: the CUDA context and the
// kernels of PyTorch and its CUDA libraries, loaded with the context. Hugging Face measured it
// (transformers docs, "Model training anatomy", docs/source/en/model_memory_anatomy.md):
// after torch.ones((1, 1)).to("cuda") nvidia-smi reports 1343 MiB used on a Tesla V100-SXM2
// 16 GB (driver 460.91, CUDA 11.2), "the kernels alone take up 1.3GB"; the same page says it
// is 1-2 GB in general. It is what DeepSpeed on PyTorch pays on top of what the caching
// allocator reserves. CUDA's lazy module loading (CUDA_MODULE_LOADING=LAZY, the default from
// CUDA 12.2) loads kernels on first use and shrinks it; the eager figure is kept as the bound.
// Our own runtime's arena lives in the process's context too, but its prediction (the
// zeroplan profile) is the cpu backend's arena, which has no CUDA context.
inline constexpr uint64_t kCudaContextBytes = uint64_t{1343} << 20;

// --device cuda (zeroplan profile): GPU memory our runtime's process holds outside its arena,
// predicted as an upper bound (the runtime measures it with cudaMemGetInfo: the context, then
// everything else beyond the arena; reports show both). Three parts, each a documented size:
// - The CUDA context with the module images of our kernels and cuBLAS's: at most
//   kCudaContextBytes, Hugging Face's eager figure for a PyTorch process, whose context holds
//   the kernels of PyTorch and all its CUDA libraries (ours loads a few dozen kernels and
//   cuBLAS's, lazily with CUDA_MODULE_LOADING=LAZY, CUDA's default since 12.2).
// - cuBLAS's workspace: the cuBLAS documentation (cublasSetWorkspace) recommends 32 MiB on
//   Hopper and 4 MiB on other architectures for the workspace its default handle allocates;
//   the larger is the bound.
// - NCCL's buffers (dp > 1; one rank has no peers), for NCCL 2.28 at its defaults (the version
//   the CUDA backend is built with). Per channel and connection, one buffer per protocol:
//   SIMPLE NCCL_BUFFSIZE, default 4 MiB (NCCL's environment-variable docs); LL 8 lines x 512
//   threads x 8 steps x 16 B = 512 KiB and LL128 120 elements x 640 threads x 8 steps x 8 B =
//   4,915,200 B (src/init.cc DEFAULT_LL_BUFFSIZE and DEFAULT_LL128_BUFFSIZE), each connection
//   counted with its whole set whichever GPU holds it; at most 64 channels (src/include/
//   device.h MAXCHANNELS in NCCL 2.2x; 32 in older releases). The runtime's collectives
//   (comm_nccl.cpp): all-reduce at stages 0-1, reduce, broadcast and all-gather otherwise.
//   - Rings, every collective: the two connections to the ring's neighbours.
//   - Trees, only an all-reduce may pick them (stages 0-1): the up peer and at most
//     NCCL_MAX_TREE_ARITY = 3 down peers (device.h), both ways: 8 connections.
//   - NVLS (NVLink SHARP), all-reduce and all-gather, where the node's GPUs are joined by
//     NVSwitch with multicast (compute capability 9.0 or newer; NCCL enables it with more than
//     two GPUs in the node, src/transport/nvls.cc): each GPU binds nvlsTotalSize = channels x
//     2 x buffSize x heads, buffSize = NCCL_NVLS_CHUNKSIZE (128 KiB) x NCCL_STEPS (8) = 1 MiB,
//     channels at most NVLS_NCHANNELS_SM100 = 32 (16 on Hopper), one head per GPU of the node
//     (nvls.cc ncclNvlsBufferSetup; 8 H100s log nvlsTotalSize 268435456 = 16 x 2 x 1 MiB x 8).
//   Not counted: CollNet (needs a network plugin the runtime does not load) and PAT (NCCL's
//   all-gather for one GPU per node across nodes). NCCL connects most of these lazily, on the
//   first collective of each algorithm (NCCL_RUNTIME_CONNECT), so a run usually holds less.
inline constexpr uint64_t kCublasWorkspaceBytes = uint64_t{32} << 20;
inline constexpr uint64_t kNcclBytesPerConnection =
    (uint64_t{4} << 20) + 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8;  // SIMPLE + LL + LL128
inline constexpr uint64_t kNcclMaxChannels = 64;
inline constexpr uint64_t kNcclRingConnections = 2;
inline constexpr uint64_t kNcclTreeConnections = 2 * (3 + 1);
inline constexpr uint64_t kNcclNvlsChannels = 32;
inline constexpr uint64_t kNcclNvlsBufferBytes = uint64_t{128} << 10 << 3;  // chunk x 8 steps

// What only the running process knows of its node: how many ranks share it, and whether its
// GPU could join NVLS (compute capability 9.0 or newer).
struct NcclNode {
  int local_ranks = 1;
  bool nvls_capable = false;
};

struct CudaOutsideArenaBound {
  uint64_t context = 0, cublas_workspace = 0, nccl_buffers = 0, nccl_nvls = 0;
  uint64_t total() const { return context + cublas_workspace + nccl_buffers + nccl_nvls; }
};
inline CudaOutsideArenaBound cuda_outside_arena_bound(const Strategy& s, const NcclNode& node = {}) {
  const bool peers = s.dp > 1;
  const uint64_t connections =
      peers ? kNcclRingConnections + (s.stage <= 1 ? kNcclTreeConnections : 0) : 0;
  const bool nvls = peers && node.nvls_capable && node.local_ranks > 2;
  return {.context = kCudaContextBytes,
          .cublas_workspace = kCublasWorkspaceBytes,
          .nccl_buffers = kNcclMaxChannels * connections * kNcclBytesPerConnection,
          .nccl_nvls = nvls ? kNcclNvlsChannels * 2 * kNcclNvlsBufferBytes *
                                  static_cast<uint64_t>(node.local_ranks)
                            : 0};
}

// NCCL's device memory in a PyTorch process, as measured: on 2 GPUs, the device memory in use
// rose from 0.55 GiB after `import torch.distributed` to 2.00 GiB after the first
// `dist.barrier()` (+1.45 GiB: the communicator's buffers and NCCL's kernels), and fell to
// 1.28 GiB after destroy_process_group (stas00/ml-engineering, training/performance/
// README.md, "torch.distributed memory usage"). Used for the deepspeed profile's device total
// with more than one data-parallel rank; NCCL allocates it with cudaMalloc, outside PyTorch's
// caching allocator, so max_memory_reserved never sees it but nvidia-smi does.
// torch.nn.parallel.DistributedDataParallel's gradient buckets: with its default
// gradient_as_bucket_view=False the reducer's flat buckets hold a second copy of every
// gradient ("gradient_as_bucket_view ... the saved memory size will be equal to the total
// gradients size", torch/nn/parallel/distributed.py DistributedDataParallel docstring). The
// pytorch profile holds them, in the gradients' dtype, with dp > 1.

inline constexpr uint64_t kTorchNcclBytes = uint64_t{1450} * (uint64_t{1} << 30) / 1000;

DeviceTotal outside_allocator(const Strategy& s, const PlanOptions& o);

// Replays the schedule: the gpu tier through the arena (zeroplan) or the caching allocator
// (deepspeed); cpu and nvme tiers count bytes (their allocators round but do not fragment).
// Under the deepspeed profile the gpu tier's overhead (and peak) also holds what the process
// holds outside the allocator (MemorySchedule::outside, set by build_schedule), so its peak
// is the device total a user sees in nvidia-smi.
MemoryReport replay(const MemorySchedule& s, const PlanOptions& o);

// Chrome Trace Event JSON ("ph":"C" counters, one series per category and tier, "ph":"X" ops)
// that opens in Perfetto.
nlohmann::json timeline_trace(const MemorySchedule& s, const MemoryReport& r);

// Activation accounting for reports and tests.
struct ActivationSummary {
  std::vector<uint64_t> saved_per_layer;        // bytes of saved tensors alive at the end of
                                                // forward, per block (stats excluded)
  std::vector<uint64_t> stats_per_layer;        // the per-token statistics, per block
  uint64_t saved_total = 0;                     // everything alive at the end of forward
                                                // (autocast's weight casts excluded)
  uint64_t weight_casts = 0;                    // autocast's cached 16-bit weight casts alive
                                                // at the end of forward (models::Tensor::source)
  uint64_t peak = 0;                            // peak of activations + act grads + logits
  int32_t peak_pos = -1;                        // where it sits: a position in g.order
};
ActivationSummary summarize_activations(const models::TrainingGraph& g);

}  // namespace zp::planner
