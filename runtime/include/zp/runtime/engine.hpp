// zp/runtime/engine.hpp: the ZeRO engine. It executes a plan's training step on one rank:
// walks the step's training graph in order, allocating every tensor from the device's tagged
// arenas when it is first used and freeing it after its last use, runs each op's kernel, and
// applies ZeRO: stage 0 all-reduces gradients, stage 1 partitions the optimizer states, stage
// 2 reduces gradients to their owners in buckets during backward, stage 3 also partitions the
// parameters and all-gathers each module group before its use (with prefetch). With
// overlap_comm (planner::overlaps_comm) those reductions and prefetched all-gathers are
// non-blocking: a bucket is completed when the next is flushed, a gather when its run starts.
// The kernels store activations as the graph says: fp32 (the planner's cpu graph, 16-bit
// weights converted into fp32 scratch per op) or the training precision (its cuda graph, with
// dropout masks drawn from dropout_key).
// Written once for every backend: it only talks to the Device and Comm seams. Not the
// planner: it reads the plan's model and strategy and measures what it did.
//
// Example usage:
//   Engine engine(plan, *device, *comm, TokenData::load(""), EngineOptions{});
//   for (int i = 0; i < 10; ++i) fmt::print("loss {}\n", engine.step().loss);
//   planner::PerDevice measured = device->measured();
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "zp/models/graph.hpp"
#include "zp/planner/plan.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/runtime/checkpoint.hpp"
#include "zp/runtime/comm.hpp"
#include "zp/runtime/data.hpp"
#include "zp/runtime/device.hpp"
#include "zp/runtime/rope.hpp"
#include "zp/runtime/swapper.hpp"

namespace zp::runtime {

struct EngineOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float weight_decay = 0.0f;   // L2 for adam, decoupled for adamw
  float momentum = 0.9f;       // sgd
  float grad_clip = 0.0f;      // clip the global gradient norm to this; 0: no clipping
  // fp16 dynamic loss scaling, DeepSpeed's defaults: 2^16 to start, halve on overflow (and
  // skip the step), double after 1000 steps without one.
  float initial_loss_scale = 65536.0f;
  int loss_scale_window = 1000;
  // The delayed parameter update (plans with dpu): plain offloaded steps before it starts
  // (the ZeRO-Offload paper turns it on only once the early, fast-changing steps are over),
  // and whether the CPU step runs on its own thread (false: the same delayed schedule run
  // inline, the reference the threaded run must equal bit for bit).
  int64_t dpu_warmup_steps = 10;
  bool dpu_threaded = true;
  // --offload-optimizer nvme and --offload-param nvme: the directory of this rank's swap files
  // (zero-run --nvme-path, or nvme_path of a DeepSpeed config) and DeepSpeed's aio settings
  // for the swapper.
  std::string nvme_path;
  AioConfig aio;
  // A test mode: on one rank, run every collective anyway (the bucket reductions, the stage
  // 0-1 all-reduce, the stage 1-2 parameter all-gather, the norm and loss sums) through the
  // communicator, where they change nothing, so a one-GPU machine executes NCCL's calls.
  // Memory and results are those of the one-rank plan: a bucket is still freed at once.
  bool collectives_at_one_rank = false;
};

// A step that failed on one rank in a way every rank learns of together (the swapped
// optimizer step agrees on failure before the next collective): every rank throws it, so the
// caller may end normally with a non-zero exit instead of aborting the job. origin(): this
// rank's own failure (its message names the file and operation); otherwise the message says
// which rank failed.
class StepFailed : public Error {
 public:
  StepFailed(std::string message, std::string hint, bool origin)
      : Error(std::move(message), std::move(hint)), origin_(origin) {}
  bool origin() const { return origin_; }

 private:
  bool origin_;
};

struct StepStats {
  int64_t step = 0;            // 1-based
  double loss = 0;             // mean over the global batch
  double grad_norm = 0;        // global, of the unscaled gradient
  double seconds = 0;
  float loss_scale = 1;
  bool skipped = false;        // fp16 overflow: no update
};

class Engine {
 public:
  // zp::Error when the plan asks for what this engine cannot run (check() says what) or its
  // data-parallel degree differs from the ranks. Either of the planner's graphs runs on any
  // device: its cpu graph in fp32 without dropout, its cuda graph in the training precision
  // with dropout.
  Engine(const planner::Plan& plan, Device& dev, Comm& comm, TokenData data, EngineOptions opt);
  // The same refusals without a device or a communicator (zero-run asks before sizing
  // memory): a family, an architecture detail or a strategy this engine does not execute
  // (tensor parallelism, expert parallelism off the cpu backend or with offload, Megatron's
  // partitioned activations, an optimizer other than
  // Adam, AdamW or SGD, another profile's plan, ...), or `ranks` other than the plan's dp.
  // `device`: the backend's name, "cpu" or "cuda".
  static void check(const planner::Plan& plan, std::string_view device, int ranks);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // One optimizer step: grad_accum micro-steps of forward and backward, then the update.
  StepStats step();

  // With the delayed parameter update, waits for the CPU step in flight and applies it, so the
  // parameters reflect every step taken (collective: every rank calls it). save_weights
  // calls it; nothing to do otherwise.
  void flush();

  // Every rank writes the weights it owns (fp32 master, or the fp32 params) into one file of
  // n_params fp32 values in the model's flat order; the file appears whole (temp + rename).
  void save_weights(const std::string& path);

  // Training checkpoints (engine_checkpoint.cpp; the protocol in checkpoint.hpp). Collective:
  // every rank calls them together, between steps.
  // save_checkpoint writes each rank's owned elements of every model state to
  // root/step-<steps_done()>, through a host staging buffer (cpu tier, category buffers,
  // planner::checkpoint_staging_bytes; the plan counts it with strategy.save_checkpoint). A
  // delayed update in flight is waited for and saved as it stands, not applied, so the run
  // goes on exactly as if it had not stopped. An I/O error on any rank (ENOSPC, EIO) is
  // StepFailed on every rank, naming the file; the last complete checkpoint stays as it was.
  // `keep`: the newest checkpoints kept (0: all).
  void save_checkpoint(const std::string& root, int64_t keep);
  // Loads a checkpoint of this model saved at any data-parallel degree, ZeRO stage or offload:
  // each rank reads its owned elements from the files that hold them (checked against the
  // manifest's sizes and CRC-32s) and the step, loss scaler and delayed update go on from
  // where it stopped. StepFailed on every rank, before any step (origin() on the ranks that
  // found the fault), when it does not fit this engine (another model, precision or optimizer;
  // a delayed update in flight without --dpu) or a file is missing, truncated or corrupted.
  // Call it before the first step.
  void load_checkpoint(const std::string& step_dir, const CheckpointManifest& m);
  int64_t steps_done() const { return step_; }

  // Bytes in use per tier and category at each op of the first micro-step, at the op's high
  // point (after its allocations, before its frees), as the planner's timeline samples it;
  // position -1 holds the model states alone.
  const std::vector<planner::TimelineSample>& timeline() const { return timeline_; }

  uint64_t n_params() const { return n_params_; }  // this rank's (E/ep experts with --ep)
  uint64_t model_params() const { return canon_params_; }  // the model's, every expert
  uint64_t partition_elems() const { return part_; }

  // The key of dropout site `site` (its mask tensor's name) in micro-step `micro` of step
  // `step` (0-based), for kernel_math.hpp's dropout_keep: rank r's mask of n elements is
  // elements [r n, (r + 1) n) of the key's stream, the mask one rank would draw for the
  // global batch. A recomputed forward uses the same key, so it redraws the same mask.
  static uint64_t dropout_key(uint64_t seed, std::string_view site, int64_t step, int64_t micro);

 private:
  struct Group {           // a unit of partitioning: all parameters (stages 0-2) or one
    std::string name;      // ZeRO-3 gather group; with expert parallelism (stages 0-2) the
                           // dense parameters and the experts' apart (flat: dense first)
    uint64_t flat_off = 0, elems = 0;
    uint64_t shard = 0;    // elements each rank owns (ceil(elems / ranks)); elems when replicated
    uint64_t part_off = 0; // where this rank's shard starts in the partition buffers
    Comm* comm = nullptr;  // the ranks that share it: all, or the expert-data-parallel group
    int grank = 0, gsize = 1;  // this rank's place among them, and their number
    bool expert = false;
  };
  // The group a parameter (or its gradient) belongs to.
  const Group& group_of(models::TensorId t) const;
  // Stage 3 with expert parallelism: a gather group's experts are a Group of their own
  // (partitioned over the expert-data-parallel group), indexed here by the gather group's name;
  // its dense part keeps the name. The gathered buffer holds the dense part's shards, then the
  // experts' (schedule.cpp gathered_bytes).
  std::map<std::string, std::size_t> expert_group_index_;
  const Group* expert_part(const std::string& grp) const;
  uint64_t gather_elems(const std::string& grp) const;  // both parts' elements
  struct Run {             // ZeRO-3: consecutive ops using one group's weights
    std::string group;
    int32_t start = 0, end = 0;
  };

  planner::Plan plan_;
  Device& dev_;
  Comm& comm_;
  TokenData data_;
  EngineOptions opt_;
  const models::TrainingGraph g_;
  const models::Liveness lv_;
  DType pdt_ = DType::bf16;   // params and grads
  uint64_t pbytes_ = 2;
  DType adt_ = DType::fp32;   // what the kernels store activations (and read weights) as
  int stage_ = 0, rank_ = 0, dp_ = 1;
  int64_t B_ = 1, T_ = 1, C_ = 0, NH_ = 0;
  // LLaMA-family blocks (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU): the
  // heads, the rotated dims, the frequency table and the norm epsilon.
  bool llama_ = false;
  Device::Heads heads_;
  int64_t rot_ = 0;
  RopeTable rope_;
  float norm_eps_ = 1e-5f;
  // Mixture of experts: E experts, top K, renormalised weights; per layer, where each expert's
  // dispatched rows start (E + 1, set by the layer's dispatch, read by its expert GEMMs); the
  // load-balancing loss's coefficient, and over the MoE layers of the current micro-step the
  // top-k choices and the probabilities' sums per expert (host bookkeeping, E values each).
  int64_t n_experts_ = 0, top_k_ = 0, n_moe_layers_ = 0;
  bool moe_renorm_ = false;
  double aux_coef_ = 0, aux_sum_ = 0;
  std::vector<std::vector<int64_t>> expert_off_;
  std::vector<double> aux_counts_, aux_psum_;
  std::vector<float> aux_dprob_;
  // Expert parallelism (ep > 1; the cpu backend, no offload): the E / ep experts of ep-group
  // position ep_rank_ are this rank's; ep_comm_ holds the ep ranks that exchange tokens
  // (consecutive world ranks), edp_comm_ the dp / ep ranks holding the same experts (DeepSpeed-MoE's
  // expert-data-parallel group). Per MoE layer, the rows this rank receives from each source
  // for each of its experts (ep x E/ep, source-major as they arrive) and the rows it sends to
  // each destination (ep): set by the layer's dispatch, used by its expert GEMMs, its combine
  // and their backwards.
  int ep_ = 1, ep_rank_ = 0;
  int64_t local_experts_ = 0;
  std::unique_ptr<Comm> ep_comm_, edp_comm_;
  std::vector<std::vector<uint64_t>> ep_recv_, ep_send_;
  // A routed row's dispatch order per layer: (first row, rows, local expert) segments of the
  // expert GEMMs' input, in order (ep 1: one per expert, from expert_off_).
  struct ExpertSegment {
    int64_t row = 0, rows = 0, expert = 0;
  };
  std::vector<std::vector<ExpertSegment>> expert_segs_;
  // Where each parameter tensor's values sit in the flat order of the model with every expert
  // (ep 1): its initial values are drawn there, and save_weights writes them there.
  std::vector<uint64_t> canon_off_;
  uint64_t canon_params_ = 0;
  std::vector<models::TensorId> param_ids_;  // the param tensors, in flat order
  void* a2a_ = nullptr;                      // this op's all-to-all buffer (ep > 1)
  // torchtitan's per-op recomputation: the tensors this micro-step's recomputations read back
  // from SAC's storage (sac_reuse ops) rather than compute again.
  std::set<models::TensorId> sac_reused_;
  uint64_t n_params_ = 0, part_ = 0;
  int32_t n_pos_ = 0, opt_pos_ = -1, last_bwd_ = -1;
  std::vector<Group> groups_;
  std::map<std::string, std::size_t> group_index_;
  std::vector<uint64_t> flat_off_;   // by tensor: flat offset of a param (and its grad)

  // Model states (null when not held).
  void* params_ = nullptr;     // full flat (stages 0-2) or this rank's partition (stage 3)
  void* grads_ = nullptr;      // full flat (stages 0-1) or partition (stages 2-3)
  float* master_ = nullptr;    // fp32 master of the owned elements (mixed precision)
  float* exp_avg_ = nullptr;   // Adam moments, or SGD momentum in exp_avg_
  float* exp_avg_sq_ = nullptr;
  // ZeRO-Offload (optimizer states in the host tier): the fp32 gradient partition (two with
  // the delayed update, filled alternately), and the host copy of the 16-bit parameter
  // partition that a delayed update writes.
  bool offload_ = false, dpu_ = false;
  bool overlap_ = false;  // overlap_comm at stages 2-3 (planner::overlaps_comm)
  bool collectives_ = false;  // run the collectives: dp > 1, or opt_.collectives_at_one_rank
  bool buckets_in_flight_ = false;  // and dp > 1 (planner::holds_buckets_in_flight)
  float* host_grads_[2] = {nullptr, nullptr};
  int cur_ = 0;                 // which host_grads_ the backward pass fills
  void* dpu_params_ = nullptr;
  std::thread dpu_thread_;
  bool dpu_pending_ = false;    // an update computed (or in flight) but not yet applied

  // ZeRO-Infinity, offload_optimizer=nvme (engine_nvme.cpp): master weights and moments live
  // in this rank's swap files (one per state, each an nvme-arena range of its padded size);
  // the optimizer step streams them through the pipeline's host buffers.
  // With the delayed update the CPU step (and its pipeline) runs on the update's thread through
  // swap buffers held for the run, and writes the new parameters to dpu_params_; its I/O
  // error is kept for the main thread, which fails the step on every rank at flush().
  bool nvme_ = false;
  std::unique_ptr<Swapper> swapper_;
  std::vector<SwapFile> swap_files_;  // master, then exp_avg and exp_avg_sq (or momentum)
  std::vector<HostBuffer> dpu_swap_buffers_;
  std::string dpu_failure_, dpu_hint_;

  // ZeRO-Infinity, offload_param=nvme (engine_nvme.cpp; stage 3): the 16-bit partition lives in
  // the swap file rank<r>.params.swp (params_ stays null). Every micro-step gathers groups in
  // the same order (gather_order_, found by a dry run of the gather logic); each gather's
  // shard is read in pieces of at most param_buf_elems_ elements through the ring of
  // param_bufs_, up to param_swap_prefetch_depth gathers ahead, and staged to the device. The
  // optimizer's new parameters are written back in order through the same buffers.
  struct ParamPiece {
    uint32_t entry = 0;            // index into gather_order_
    uint64_t part_off = 0;         // partition element of its first
    uint64_t stage_off = 0;        // its place in the gather's staging buffer
    uint64_t n = 0;                // elements
  };
  bool param_nvme_ = false, planning_gathers_ = false;
  std::unique_ptr<Swapper> param_swapper_;  // its own: the update's thread uses swapper_
  SwapFile param_file_;
  std::vector<HostBuffer> param_bufs_;
  std::vector<std::optional<SwapTicket>> param_tickets_;  // by buffer: its I/O in flight
  uint64_t param_buf_elems_ = 0;
  std::vector<std::size_t> gather_order_;  // group indices, one micro-step's gathers
  std::vector<ParamPiece> pieces_;         // their shards' pieces, in order
  std::vector<std::size_t> first_piece_;   // by gather entry, and one past the last
  std::size_t next_read_ = 0, next_use_ = 0, entry_ = 0;
  std::string param_failure_, param_hint_;  // the first I/O error of the step, if any
  uint64_t write_chunk_ = UINT64_MAX;       // partition chunk being filled for write-back

  // Per-step state.
  std::vector<void*> buf_;                   // by tensor: its arena buffer, or null
  std::vector<std::pair<Tier, void*>> held_;  // buffers to free at destruction (model states)
  std::vector<models::TensorId> pending_;    // final gradients not yet reduced
  std::vector<models::TensorId> in_flight_;  // overlap_comm: the bucket being reduced
  std::vector<CommRequest> in_flight_reqs_;  //   and its reductions
  // overlap_comm: all-gathers not waited for, and (offload_param) the staging buffer each
  // sends from, freed with the frees of the op that waits.
  struct Gathering {
    CommRequest req;
    void* stage = nullptr;
  };
  std::map<std::string, Gathering> gathering_;
  std::vector<Run> runs_;
  std::vector<int32_t> run_at_;              // by position: run index or -1
  std::map<std::string, int32_t> holder_;    // gathered group -> last run it is held for
  std::map<std::string, void*> gathered_;
  std::vector<void*> staged_;  // offload_param=cpu: this op's gather staging buffers
  uint64_t live_gathered_elems_ = 0;
  std::vector<float*> w32_;                            // per op: fp32 copies of its weights
  std::vector<std::pair<models::TensorId, float*>> dw32_;  // and its fp32 weight gradients
  std::vector<planner::TimelineSample> timeline_;
  double loss_sum_ = 0;
  int64_t step_ = 0, micro_ = 0, good_steps_ = 0;
  float loss_scale_ = 1;

  // Checkpoints (engine_checkpoint.cpp): a model state and where it lives (memory of either
  // tier, or a swap file), indexed by partition (part_off + i - lo) or, for whole copies
  // (the parameters below stage 3, every state at stage 0), by flat element.
  struct StateRef {
    std::string name;
    DType dtype = DType::fp32;
    void* mem = nullptr;
    Swapper* swapper = nullptr;
    SwapFile file;
    bool flat_index = false;
  };
  std::vector<StateRef> checkpoint_states() const;
  // The entries of rank r's file (state-major, groups in order), at their offsets.
  std::vector<CheckpointEntry> checkpoint_entries(int r, const std::vector<StateRef>& states) const;
  // The owned elements of `st` through the staging buffer `buf` (cap bytes, 4096-aligned, a
  // multiple of 4096): fn(first flat element, count, values) reads them (save) or fills them
  // (load, written back after).
  void visit_state(const StateRef& st, bool load, std::byte* buf, uint64_t cap,
                   const std::function<void(uint64_t, uint64_t, std::byte*)>& fn);
  void join_dpu();  // the delayed update's thread done (and its I/O agreed), nothing applied
  int64_t first_step_ = 0;  // the first step this engine runs (a resumed run: the checkpoint's)

  void layout();
  void allocate_states();
  void init_weights();
  // out[i - lo] = the initial value of flat element i, for i in [lo, hi).
  void init_range(uint64_t lo, uint64_t hi, float* out) const;
  void find_runs();

  void* alloc(Tier t, uint64_t bytes, Category c, const std::string& name);
  void touch(models::TensorId t);
  void* ptr(models::TensorId t) const;
  void alloc_grad(models::TensorId gt);
  void flush_if_full(bool end_of_backward);
  struct Segment;
  Segment segment(models::TensorId gt, int owner) const;
  void reduce_segments(models::TensorId gt, std::vector<ReduceSegment>& segs) const;
  void add_reduced(models::TensorId gt);
  void complete_in_flight();
  void gather(const std::string& grp, int32_t hold_until);
  void wait_gathered(const std::string& grp);
  void start_run(int32_t r);
  void end_run(int32_t r);

  void micro_step();
  void sample(int32_t pos);
  void run_op(const models::Op& op, const std::vector<float*>& w32);
  std::pair<float, uint64_t> flash_dropout(const models::Op& op) const;
  void expert_matmul(const models::Op& op, void* w);
  void expert_matmul_backward(const models::Op& op, void* w, void* dw);
  void moe_route_done(const models::Op& op);
  // Expert parallelism's pieces (engine.cpp): the all-to-all buffer of an op (allocated as the
  // planner's schedule does, after the op's scratch), the layer's dispatch (rows counted,
  // exchanged and sent to their experts' ranks), and the returns (expert rows back to the
  // ranks whose tokens they are, or gradients out to the experts).
  uint64_t a2a_bytes(const models::Op& op) const;
  void moe_dispatch_ep(const models::Op& op);
  void ep_exchange(const void* src, void* dst, int layer, bool to_experts);
  const void* rows_home(const void* expert_rows, int layer);
  std::pair<Device::QkvIn, std::size_t> qkv_in(const models::Op& op, std::size_t first) const;
  std::pair<int64_t, int64_t> projection_rows(const models::Op& op) const;
  ExpertIdx expert_idx(models::TensorId t) const;
  double aux_loss() const;
  StepStats optimizer_step();
  // Pieces of the optimizer step. The owned gradient of a group: (pointer, count, dtype).
  struct OwnedGrads {
    void* ptr;
    uint64_t n;
    DType dtype;
  };
  OwnedGrads owned_grads(const Group& gr) const;
  // The offloaded update of every owned element from host_grads_[g_buf] (engine.cpp).
  void offload_update(int g_buf, double inv_scale, double clip, int64_t t, bool to_device);
  void apply_host_params(const void* host_params);  // host partition -> params_, + gather
  void gather_params();                             // stages 1-2: share updated slices
  // engine_nvme.cpp: the swap files and their nvme-arena ranges; initial master weights and
  // zero moments written to them; the pipelined update of every owned element from
  // host_grads_[g_buf], new parameters to the device (or, for the delayed update, to
  // dpu_params_); the owned swapped master weights, flat piece by piece (visit_state).
  void open_swap_files();
  void init_swapped_states();
  void nvme_update(int g_buf, double inv_scale, double clip, int64_t t, bool to_device);
  void* alloc_swap_buffers(std::vector<HostBuffer>& buffers);  // cpu tier; free the result
  void carve_swap_buffers(void* block, std::vector<HostBuffer>& buffers) const;
  void read_swapped_master(const std::function<void(uint64_t, uint64_t, std::byte*)>& fn);
  // offload_param=nvme: the file and host buffers; the gather order and pieces; a gather's
  // shard into the device staging buffer; reads issued ahead. Writing the partition back:
  // put_params in increasing partition order (gaps are zero), end_param_write to finish.
  // Parameters go to the device partition or, with offload_param=nvme, to the file.
  void open_param_file();
  void alloc_param_buffers();  // cpu tier, held with the model states
  void plan_param_reads();
  void read_shard(std::size_t group, void* stage);
  void issue_param_reads();
  void put_params(uint64_t part_elem, const void* src, uint64_t n);
  void end_param_write();
  void to_params(uint64_t part_elem, const void* src, uint64_t n);
  void wait_param_io(std::size_t buffer);  // the buffer's I/O; its ticket is gone after
  void drain_param_io();                   // after an error: wait for all, drop the errors
  // Every rank learns whether any rank's I/O failed (a collective, called at the same points
  // on every rank); StepFailed on all of them if so.
  void fail_together(const std::string& failure, const std::string& hint, const char* what);
  // The owned range of a group for this rank, in group-local elements.
  std::pair<uint64_t, uint64_t> owned(const Group& gr) const;
};

}  // namespace zp::runtime
