// engine_nvme.cpp: ZeRO-Infinity's optimizer on NVMe (offload_optimizer=nvme) in the engine:
// the fp32 master weights and moments of the owned partition live in this rank's swap files,
// and the optimizer step streams them through a fixed set of host buffers, chunk by chunk
// (read k+1 || CPU Adam on k || write k-1; ChunkPipeline in lockstep over the files). Not the
// swapper (swapper.cpp) and not the host-tier ZeRO-Offload step (engine.cpp offload_update).
//
// Memory, as the planner predicts it (planner/src/schedule.cpp, optimizer_swap_buffer_bytes):
// each swap file is an nvme-arena range of its size rounded up to 4096 (O_DIRECT); the host
// buffers are one cpu-tier allocation (category buffers) made at the optimizer op and freed
// after it, aligned to 4096 inside the arena; then the two 16-bit parameter tiles of a chunk.
#include <algorithm>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "zp/checked.hpp"
#include "zp/error.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/runtime/cpu_kernels.hpp"
#include "zp/runtime/engine.hpp"

namespace zp::runtime {

namespace {

std::byte* at(void* base, uint64_t elem, uint64_t elem_bytes) {
  return static_cast<std::byte*>(base) + elem * elem_bytes;
}

// Frees arena allocations when a scope ends, also when an exception leaves it.
struct ArenaGuard {
  Arena& arena;
  std::vector<void*> held;
  ~ArenaGuard() {
    for (auto it = held.rbegin(); it != held.rend(); ++it) arena.free(*it);
  }
};

}  // namespace

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

void* Engine::alloc_swap_buffers(std::vector<HostBuffer>& buffers) {
  const auto& s = plan_.strategy;
  const uint64_t chunk_bytes = planner::optimizer_swap_chunk_elems(s, part_) * 4;
  const uint64_t n = s.buffers.optimizer_swap_buffer_count * planner::optimizer_swap_files(s);
  void* block = alloc(Tier::cpu, planner::optimizer_swap_buffer_bytes(s, part_), Category::buffers,
                      "swap_buffers");
  // The arena aligns to kArenaAlignment; O_DIRECT needs 4096: the planned slack covers it.
  const uintptr_t addr = reinterpret_cast<uintptr_t>(block);
  std::byte* first = static_cast<std::byte*>(block) + ((kSwapAlignBytes - addr % kSwapAlignBytes) % kSwapAlignBytes);
  buffers.clear();
  for (uint64_t i = 0; i < n; ++i) buffers.push_back({first + i * chunk_bytes, chunk_bytes});
  return block;
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
      init_range(flat0, flat0 + (b - a), [&](uint64_t flat, float v) { master[a - e0 + flat - flat0] = v; });
    }
  });
}

// The CPU Adam (or SGD) of engine.cpp offload_update, chunk by chunk: chunk k of the master
// and moment files is in host memory together; the owned elements of each group inside it are
// updated from host_grads_[cur_], and the new parameters go to the device (16-bit through
// the two alternating tiles; fp32 straight from the master chunk) before the chunk is
// written back. An I/O error on any rank fails the step on every rank together (StepFailed),
// before any rank starts the next collective.
void Engine::nvme_update(double inv_scale, double clip, int64_t t) {
  const auto kind = plan_.strategy.optimizer;
  const AdamConfig adam{.lr = opt_.lr, .beta1 = opt_.beta1, .beta2 = opt_.beta2, .eps = opt_.eps,
                        .weight_decay = opt_.weight_decay,
                        .adamw = kind == planner::OptimizerKind::adamw};
  const AdamStepArgs args{.step = t, .inv_loss_scale = inv_scale, .clip_coef = clip};
  float* grads = host_grads_[cur_];
  const bool mixed = pdt_ != DType::fp32;
  std::string failure, hint;
  {
    std::vector<HostBuffer> buffers;
    ArenaGuard guard{dev_.arena(Tier::cpu), {}};
    guard.held.push_back(alloc_swap_buffers(buffers));
    const uint64_t chunk_bytes = buffers.front().capacity_bytes;
    void* tiles[2] = {nullptr, nullptr};
    if (mixed) {
      const uint64_t tile = std::min(chunk_bytes / 4, part_) * pbytes_;
      guard.held.push_back(tiles[0] = alloc(Tier::cpu, tile, Category::buffers, "param_tile.0"));
      guard.held.push_back(tiles[1] = alloc(Tier::cpu, tile, Category::buffers, "param_tile.1"));
    }
    if (step_ == 0) sample(opt_pos_);
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
          void* out = mixed ? at(tiles[next], i, pbytes_) : nullptr;
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
          const uint64_t p0 = (stage_ >= 3 ? gr.part_off : gr.flat_off + lo) + (a - gr.part_off);
          const void* src = mixed ? out : static_cast<const void*>(master + i);
          dev_.copy(at(params_, p0, pbytes_), src, n * pbytes_);
        }
        next ^= 1;
      });
    } catch (const Error& e) {
      failure = e.what();
      hint = e.hint();
    }
  }
  std::memset(grads, 0, part_ * 4);
  // Agree before anyone moves on: a rank that failed would otherwise leave the others
  // waiting in the next step's collectives.
  const double n_failed = dp_ > 1 ? comm_.all_reduce_sum(failure.empty() ? 0.0 : 1.0)
                                  : (failure.empty() ? 0.0 : 1.0);
  if (!failure.empty()) throw StepFailed(failure, hint, true);
  if (n_failed > 0)
    throw StepFailed(fmt::format("rank {}: the swapped optimizer step failed on {} other rank{}",
                                 rank_, n_failed, n_failed > 1 ? "s" : ""),
                     "see the failing rank's error", false);
}

// The owned partition of the master file, chunk by chunk: fn(values, first element, count).
void Engine::read_swapped_master(const std::function<void(const float*, uint64_t, uint64_t)>& fn) {
  std::vector<HostBuffer> buffers;
  ArenaGuard guard{dev_.arena(Tier::cpu), {}};
  guard.held.push_back(alloc_swap_buffers(buffers));
  const uint64_t chunk_bytes = buffers.front().capacity_bytes;
  for (uint64_t off = 0; off < part_ * 4; off += chunk_bytes) {
    const uint64_t len = std::min(chunk_bytes, part_ * 4 - off);
    swapper_->wait(swapper_->read(swap_files_.front(), off, buffers.front().data, len));
    fn(reinterpret_cast<const float*>(buffers.front().data), off / 4, len / 4);
  }
}

}  // namespace zp::runtime
