// engine_nvme.cpp: ZeRO-Infinity in the engine. The optimizer on NVMe (offload_optimizer=nvme):
// the fp32 master weights and moments of the owned partition live in this rank's swap files,
// and the optimizer step streams them through a fixed set of host buffers, chunk by chunk
// (read k+1 || CPU Adam on k || write k-1; ChunkPipeline in lockstep over the files). The
// parameters on NVMe (offload_param=nvme, stage 3): the 16-bit partition lives in its own swap
// file; each gather's shard is read through a ring of host buffers, issued gathers ahead, and
// staged to the device; the optimizer's new parameters are written back through the same
// ring. Not the swapper (swapper.cpp) and not the host-tier ZeRO-Offload step (engine.cpp
// offload_update).
//
// Memory, as the planner predicts it (planner/src/schedule.cpp, optimizer_swap_buffer_bytes
// and param_swap_buffer_bytes): each swap file is an nvme-arena range of its size rounded up
// to 4096 (O_DIRECT); the optimizer's host buffers are one cpu-tier allocation (category
// buffers) made at the optimizer op and freed after it, aligned to 4096 inside the arena; then
// the two 16-bit parameter tiles of a chunk. The parameter swap buffers are one cpu-tier
// allocation (category buffers) held from the model states on; the device staging buffer of a
// gathered shard is offload_param=cpu's.
#include <algorithm>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "zp/checked.hpp"
#include "zp/error.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/runtime/cpu_kernels.hpp"
#include "zp/runtime/engine.hpp"
#include "engine_internal.hpp"

namespace zp::runtime {

using detail::ArenaGuard;
using detail::at;
using detail::swap_aligned;

// One file of part_ fp32 elements per state, in the planner's order (master, then the
// moments); each takes Swapper::padded_bytes of the nvme tier.
void Engine::open_swap_files() {
  static_assert(planner::kSwapBlockBytes == kSwapAlignBytes, "planner and swapper block sizes");
  const uint64_t bytes = checked_mul(part_, 4, "swap file bytes");
  auto state = [&](const char* name, Category c) {
    swap_files_.push_back(swapper_->open(name, bytes));
    held_.emplace_back(Tier::nvme, alloc(Tier::nvme, Swapper::padded_bytes(bytes), c, name));
  };
  state("master", Category::master);
  if (plan_.strategy.optimizer == planner::OptimizerKind::sgd) {
    state("momentum", Category::optimizer);
  } else {
    state("exp_avg", Category::optimizer);
    state("exp_avg_sq", Category::optimizer);
  }
}

// The delayed update holds its buffers for the run (dpu_swap_buffers_); a step without it
// allocates them at the optimizer op and frees them after.
void* Engine::alloc_swap_buffers(std::vector<HostBuffer>& buffers) {
  if (dpu_) {
    buffers = dpu_swap_buffers_;
    return nullptr;
  }
  void* block = alloc(Tier::cpu, planner::optimizer_swap_buffer_bytes(plan_.strategy, part_),
                      Category::buffers, "swap_buffers");
  carve_swap_buffers(block, buffers);
  return block;
}

void Engine::carve_swap_buffers(void* block, std::vector<HostBuffer>& buffers) const {
  const auto& s = plan_.strategy;
  const uint64_t chunk_bytes = planner::optimizer_swap_chunk_elems(s, part_) * 4;
  const uint64_t n = s.buffers.optimizer_swap_buffer_count * planner::optimizer_swap_files(s);
  std::byte* first = swap_aligned(block);
  buffers.clear();
  for (uint64_t i = 0; i < n; ++i) buffers.push_back({first + i * chunk_bytes, chunk_bytes});
}

// Initial values (engine.cpp init_range: they depend only on the seed and the flat index) for
// the master file, zeros for the moments, through the same pipeline and buffers as a step.
void Engine::init_swapped_states() {
  std::vector<HostBuffer> buffers;
  ArenaGuard guard{dev_.arena(Tier::cpu), {}};
  guard.held.push_back(alloc_swap_buffers(buffers));
  const uint32_t nf = static_cast<uint32_t>(swap_files_.size());
  ChunkPipeline pipe(*swapper_, buffers.front().capacity_bytes, nf, buffers);
  std::vector<SwapRegion> regions;
  for (SwapFile f : swap_files_) regions.push_back({f, 0});
  pipe.run(regions, part_ * 4, [&](std::span<const std::span<std::byte>> chunks, uint64_t off) {
    const uint64_t e0 = off / 4, m = chunks[0].size() / 4;
    float* master = reinterpret_cast<float*>(chunks[0].data());
    std::fill(master, master + m, 0.0f);  // padding elements of stage-3 groups stay 0
    for (std::size_t f = 1; f < chunks.size(); ++f) std::memset(chunks[f].data(), 0, chunks[f].size());
    for (const Group& gr : groups_) {
      const auto [lo, hi] = owned(gr);
      const uint64_t a = std::max(e0, gr.part_off), b = std::min(e0 + m, gr.part_off + (hi - lo));
      if (a >= b) continue;
      const uint64_t flat0 = gr.flat_off + lo + (a - gr.part_off);
      init_range(flat0, flat0 + (b - a), master + (a - e0));
    }
  });
}

// The CPU Adam (or SGD) of engine.cpp offload_update, chunk by chunk: chunk k of the master
// and moment files is in host memory together; the owned elements of each group inside it are
// updated from host_grads_[g_buf], and the new parameters go to the device (16-bit through
// the two alternating tiles; fp32 straight from the master chunk) before the chunk is
// written back. An I/O error on any rank fails the step on every rank together (StepFailed),
// before any rank starts the next collective.
//
// Without `to_device` (the delayed update, on its own thread or inline during its warmup) the
// new parameters go to the host copy dpu_params_ (16-bit straight from the Adam, fp32 copied
// from the master chunk), nothing touches the device, an arena or the communicator, and an
// I/O error is kept in dpu_failure_ for the main thread to fail the step with.
void Engine::nvme_update(int g_buf, double inv_scale, double clip, int64_t t, bool to_device) {
  const auto kind = plan_.strategy.optimizer;
  const AdamConfig adam{.lr = opt_.lr, .beta1 = opt_.beta1, .beta2 = opt_.beta2, .eps = opt_.eps,
                        .weight_decay = opt_.weight_decay,
                        .adamw = kind == planner::OptimizerKind::adamw};
  const AdamStepArgs args{.step = t, .inv_loss_scale = inv_scale, .clip_coef = clip};
  float* grads = host_grads_[g_buf];
  const bool mixed = pdt_ != DType::fp32;
  std::string failure, hint;
  {
    std::vector<HostBuffer> buffers;
    ArenaGuard guard{dev_.arena(Tier::cpu), {}};
    guard.held.push_back(alloc_swap_buffers(buffers));
    const uint64_t chunk_bytes = buffers.front().capacity_bytes;
    void* tiles[2] = {nullptr, nullptr};
    if (mixed && to_device) {
      const uint64_t tile = std::min(chunk_bytes / 4, part_) * pbytes_;
      guard.held.push_back(tiles[0] = alloc(Tier::cpu, tile, Category::buffers, "param_tile.0"));
      guard.held.push_back(tiles[1] = alloc(Tier::cpu, tile, Category::buffers, "param_tile.1"));
    }
    // t, not step_: on the delayed update's thread the main thread is already counting the
    // step (to_device is false there, and step_ is not read).
    if (to_device && t == first_step_ + 1) sample(opt_pos_);
    int next = 0;
    try {
      ChunkPipeline pipe(*swapper_, chunk_bytes, static_cast<uint32_t>(swap_files_.size()), buffers);
      std::vector<SwapRegion> regions;
      for (SwapFile f : swap_files_) regions.push_back({f, 0});
      pipe.run(regions, part_ * 4, [&](std::span<const std::span<std::byte>> chunks, uint64_t off) {
        const uint64_t e0 = off / 4, m = chunks[0].size() / 4;
        float* master = reinterpret_cast<float*>(chunks[0].data());
        float* m1 = reinterpret_cast<float*>(chunks[1].data());
        float* m2 = chunks.size() > 2 ? reinterpret_cast<float*>(chunks[2].data()) : nullptr;
        for (const Group& gr : groups_) {
          const auto [lo, hi] = owned(gr);
          const uint64_t a = std::max(e0, gr.part_off), b = std::min(e0 + m, gr.part_off + (hi - lo));
          if (a >= b) continue;
          const uint64_t i = a - e0, n = b - a;
          void* out = !mixed ? nullptr : to_device ? at(tiles[next], i, pbytes_) : at(dpu_params_, a, pbytes_);
          if (kind == planner::OptimizerKind::sgd) {
            cpu::sgd_step(master + i, m1 + i, grads + a, DType::fp32, out, pdt_, opt_.lr,
                          opt_.momentum, opt_.weight_decay, static_cast<float>(inv_scale * clip),
                          static_cast<int64_t>(n));
          } else {
            cpu_adam_step(adam, args,
                          AdamTensors{.n = n, .master = master + i, .exp_avg = m1 + i,
                                      .exp_avg_sq = m2 + i, .grads = grads + a,
                                      .grad_dtype = DType::fp32, .param_out = out,
                                      .param_out_dtype = pdt_});
          }
          if (!to_device) {  // fp32: the master weights are the parameters
            if (!mixed) std::memcpy(at(dpu_params_, a, 4), master + i, n * 4);
            continue;
          }
          const uint64_t p0 = (stage_ >= 3 ? gr.part_off : gr.flat_off + lo) + (a - gr.part_off);
          const void* src = mixed ? out : static_cast<const void*>(master + i);
          to_params(p0, src, n);  // the device, or offload_param=nvme's write-back
        }
        next ^= 1;
      });
      if (param_nvme_ && to_device) end_param_write();
    } catch (const Error& e) {
      failure = e.what();
      hint = e.hint();
      if (param_nvme_ && to_device) drain_param_io();
    }
  }
  std::memset(grads, 0, part_ * 4);
  if (!to_device) {
    dpu_failure_ = failure;
    dpu_hint_ = hint;
    return;
  }
  fail_together(failure, hint, "the swapped optimizer step");
}

// Agree before anyone moves on: a rank that failed would otherwise leave the others waiting
// in the next collective.
void Engine::fail_together(const std::string& failure, const std::string& hint, const char* what) {
  const double n_failed = dp_ > 1 ? comm_.all_reduce_sum(failure.empty() ? 0.0 : 1.0)
                                  : (failure.empty() ? 0.0 : 1.0);
  if (!failure.empty()) throw StepFailed(failure, hint, true);
  if (n_failed > 0)
    throw StepFailed(fmt::format("rank {}: {} failed on {} other rank{}", rank_, what, n_failed,
                                 n_failed > 1 ? "s" : ""),
                     "see the failing rank's error", false);
}

// ---- offload_param=nvme ----------------------------------------------------------------------

// One file of part_ 16-bit (fp32 in fp32 training) elements, Swapper::padded_bytes of the
// nvme tier, category params: the planner's model state on that tier.
void Engine::open_param_file() {
  const uint64_t bytes = checked_mul(part_, pbytes_, "params swap file bytes");
  param_file_ = param_swapper_->open("params", bytes);
  held_.emplace_back(Tier::nvme,
                     alloc(Tier::nvme, Swapper::padded_bytes(bytes), Category::params, "params"));
}

// The parameter swapper's host buffers, held for the run, each 4096-aligned inside one block
// (planner::param_swap_buffer_bytes has the slack).
void Engine::alloc_param_buffers() {
  const auto& s = plan_.strategy;
  const auto pb = static_cast<uint32_t>(pbytes_);
  void* block = alloc(Tier::cpu, planner::param_swap_buffer_bytes(s, part_, pb), Category::buffers,
                      "param_swap_buffers");
  held_.emplace_back(Tier::cpu, block);
  const uint64_t cap = planner::param_swap_buffer_capacity(s, part_, pb);
  std::byte* first = swap_aligned(block);
  for (uint64_t i = 0; i < s.buffers.param_swap_buffer_count; ++i)
    param_bufs_.push_back({first + i * cap, cap});
  param_tickets_.assign(param_bufs_.size(), std::nullopt);
  param_buf_elems_ = planner::param_swap_buffer_elems(s, part_, pb);
}

// The gathers of a micro-step are the same every time (the runs and the prefetch rules of
// start_run/end_run depend on the graph and the buffer sizes only): a dry run of them gives
// their order, and each gather's shard is cut into pieces of at most one buffer.
void Engine::plan_param_reads() {
  planning_gathers_ = true;
  for (int32_t r = 0; r < static_cast<int32_t>(runs_.size()); ++r) {
    start_run(r);
    end_run(r);
  }
  planning_gathers_ = false;
  holder_.clear();
  live_gathered_elems_ = 0;
  const uint64_t e = std::max<uint64_t>(
      1, planner::param_swap_buffer_elems(plan_.strategy, part_, static_cast<uint32_t>(pbytes_)));
  for (std::size_t k = 0; k < gather_order_.size(); ++k) {
    first_piece_.push_back(pieces_.size());
    // The dense shard, then (expert parallelism) the experts' shard after it in the staging
    // buffer, as gather lays them out.
    const Group& gr = groups_[gather_order_[k]];
    uint64_t stage_off = 0;
    for (const Group* part : {&gr, expert_part(gr.name)}) {
      if (part == nullptr) continue;
      for (uint64_t o = 0; o < part->shard; o += e)
        pieces_.push_back({static_cast<uint32_t>(k), part->part_off + o, stage_off + o,
                           std::min(e, part->shard - o)});
      stage_off += part->shard;
    }
  }
  first_piece_.push_back(pieces_.size());
}

// Issue the reads of the next pieces while a buffer is free (its previous piece was used) and
// the piece belongs to a gather at most param_swap_prefetch_depth past the current one. A
// piece's bytes start anywhere in a block: the read starts at the block and the piece sits at
// that skew inside the buffer (param_swap_buffer_capacity has the block for it).
void Engine::issue_param_reads() {
  const std::size_t n_buf = param_bufs_.size();
  const std::size_t depth = plan_.strategy.buffers.param_swap_prefetch_depth;
  while (next_read_ < pieces_.size() && next_read_ < next_use_ + n_buf &&
         pieces_[next_read_].entry <= entry_ + depth) {
    const ParamPiece& p = pieces_[next_read_];
    const std::size_t b = next_read_ % n_buf;
    const uint64_t a = p.part_off * pbytes_, skew = a % kSwapAlignBytes;
    try {
      param_tickets_[b] =
          param_swapper_->read(param_file_, a - skew, param_bufs_[b].data, skew + p.n * pbytes_);
    } catch (const Error& e) {
      if (param_failure_.empty()) {
        param_failure_ = e.what();
        param_hint_ = e.hint();
      }
    }
    ++next_read_;
  }
}

// The shard of the current gather (group `gi`, and its experts' part after it) into the device
// staging buffer, piece by piece as its reads complete, refilling the ring behind each. A
// failed read leaves its piece zero and is remembered: optimizer_step fails the step on every rank before any update, so the
// collectives of this step still run in step on every rank.
void Engine::read_shard(std::size_t gi, void* stage) {
  if (entry_ >= gather_order_.size() || gather_order_[entry_] != gi)
    throw Error(fmt::format("internal: gather {} of group {} is not the planned one", entry_,
                            groups_[gi].name));
  const std::size_t n_buf = param_bufs_.size();
  for (std::size_t k = first_piece_[entry_]; k < first_piece_[entry_ + 1]; ++k) {
    issue_param_reads();
    const ParamPiece& p = pieces_[k];
    const std::size_t b = k % n_buf;
    void* dst = at(stage, p.stage_off, pbytes_);
    bool ok = false;
    if (param_tickets_[b]) {
      try {
        wait_param_io(b);
        ok = true;
      } catch (const Error& e) {
        if (param_failure_.empty()) {
          param_failure_ = e.what();
          param_hint_ = e.hint();
        }
      }
    }
    const uint64_t skew = p.part_off * pbytes_ % kSwapAlignBytes;
    if (ok)
      dev_.copy(dst, param_bufs_[b].data + skew, p.n * pbytes_);
    else
      dev_.zero(dst, p.n * pbytes_);
    ++next_use_;
  }
  ++entry_;
  issue_param_reads();  // the next gathers' shards, while this one is all-gathered and used
}

void Engine::wait_param_io(std::size_t b) {
  const SwapTicket t = *param_tickets_[b];
  param_tickets_[b].reset();
  param_swapper_->wait(t);
}

void Engine::drain_param_io() {
  for (std::size_t b = 0; b < param_tickets_.size(); ++b) {
    if (!param_tickets_[b]) continue;
    try {
      wait_param_io(b);
    } catch (const Error&) {
      // The first error was already reported; this one ends with it.
    }
  }
  write_chunk_ = UINT64_MAX;
}

// Writing the partition back: chunk c holds partition elements [c W, (c + 1) W), W being a
// buffer's bytes less its skew block, a multiple of 4096 bytes, so every write starts on a
// block; chunk c goes through buffer c mod buffer_count, once that buffer's previous write is
// done. Elements never put (stage-3 padding) are written as zeros; end_param_write writes the
// chunks not yet written and waits for all.
namespace {
uint64_t write_chunk_elems(const HostBuffer& b, uint64_t elem_bytes) {
  return (b.capacity_bytes - kSwapAlignBytes) / elem_bytes;
}
}  // namespace

void Engine::put_params(uint64_t part_elem, const void* src, uint64_t n) {
  const uint64_t w = write_chunk_elems(param_bufs_.front(), pbytes_);
  const std::size_t n_buf = param_bufs_.size();
  auto start = [&](uint64_t c) {
    const std::size_t b = c % n_buf;
    if (param_tickets_[b]) wait_param_io(b);
    std::memset(param_bufs_[b].data, 0, w * pbytes_);
  };
  auto flush = [&](uint64_t c) {
    const std::size_t b = c % n_buf;
    const uint64_t bytes = std::min(w, part_ - c * w) * pbytes_;
    param_tickets_[b] = param_swapper_->write(param_file_, c * w * pbytes_, param_bufs_[b].data, bytes);
  };
  const std::byte* s = static_cast<const std::byte*>(src);
  // part_elem == part_ (with n == 0) finishes: every chunk up to the end is written.
  const uint64_t n_chunks = (part_ + w - 1) / w;
  const uint64_t target = n == 0 ? n_chunks : part_elem / w;
  if (write_chunk_ != target) {
    uint64_t c = 0;
    if (write_chunk_ != UINT64_MAX) {
      if (target < write_chunk_) throw Error("internal: parameters written back out of order");
      flush(write_chunk_);
      c = write_chunk_ + 1;
    }
    for (; c < target; ++c) {
      start(c);
      flush(c);
    }
    write_chunk_ = target;
    if (target < n_chunks) start(target);
  }
  while (n > 0) {
    const uint64_t c = part_elem / w;
    if (c != write_chunk_) {  // the put runs into the next chunk
      flush(write_chunk_);
      start(c);
      write_chunk_ = c;
    }
    const uint64_t m = std::min(n, (c + 1) * w - part_elem);
    std::memcpy(param_bufs_[c % n_buf].data + (part_elem - c * w) * pbytes_, s, m * pbytes_);
    part_elem += m;
    s += m * pbytes_;
    n -= m;
  }
}

void Engine::end_param_write() {
  put_params(part_, nullptr, 0);
  write_chunk_ = UINT64_MAX;
  for (std::size_t b = 0; b < param_tickets_.size(); ++b)
    if (param_tickets_[b]) wait_param_io(b);
}

// The owned elements of the master file, through the first swap buffer (visit_state):
// fn(first flat element, count, values).
void Engine::read_swapped_master(const std::function<void(uint64_t, uint64_t, std::byte*)>& fn) {
  std::vector<HostBuffer> buffers;
  ArenaGuard guard{dev_.arena(Tier::cpu), {}};
  guard.held.push_back(alloc_swap_buffers(buffers));
  StateRef master;
  master.name = "master";
  master.swapper = swapper_.get();
  master.file = swap_files_.front();
  visit_state(master, false, buffers.front().data, buffers.front().capacity_bytes, fn);
}

}  // namespace zp::runtime
