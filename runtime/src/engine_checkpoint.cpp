// engine_checkpoint.cpp: training checkpoints in the engine. Each rank streams the elements it
// owns of every model state (the parameters, fp32 master weights, the optimizer's moments, a
// delayed update's parameters in flight) from wherever the plan put them (the device, the
// host tier, ZeRO-Infinity's swap files) through one host staging buffer into its file of the
// checkpoint; loading reads a rank's new partition back from whichever files hold it, so the
// data-parallel degree, the stage and the offload may change between runs. The directory
// protocol and the manifest are checkpoint.cpp's.
//
// Memory: the staging buffer is one cpu-tier allocation (category buffers) of
// planner::checkpoint_staging_bytes, made after a step and freed when the checkpoint is
// written (the plan's "checkpoint_staging" with strategy.save_checkpoint); loading uses the
// same buffer before the first step.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine_internal.hpp"
#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/runtime/checkpoint.hpp"
#include "zp/runtime/engine.hpp"

namespace zp::runtime {

namespace fs = std::filesystem;
using detail::ArenaGuard;
using detail::at;
using detail::swap_aligned;

namespace {

// Closes the files a load opened, also when it throws.
struct Fds {
  std::map<std::size_t, int> fd;
  ~Fds() {
    for (const auto& [k, f] : fd) ::close(f);
  }
};

}  // namespace

std::vector<Engine::StateRef> Engine::checkpoint_states() const {
  std::vector<StateRef> out;
  StateRef p;
  p.name = "params";
  p.dtype = pdt_;
  if (param_nvme_) {
    p.swapper = param_swapper_.get();
    p.file = param_file_;
  } else {
    p.mem = params_;
    p.flat_index = stage_ < 3;  // the whole flat copy below stage 3
  }
  out.push_back(p);
  const bool sgd = plan_.strategy.optimizer == planner::OptimizerKind::sgd;
  const std::vector<std::string> names =
      sgd ? std::vector<std::string>{"master", "momentum"}
          : std::vector<std::string>{"master", "exp_avg", "exp_avg_sq"};
  for (std::size_t k = 0; k < names.size(); ++k) {
    StateRef s;
    s.name = names[k];
    s.flat_index = stage_ == 0;
    if (nvme_) {
      s.swapper = swapper_.get();
      s.file = swap_files_[k];
    } else {
      s.mem = k == 0 ? static_cast<void*>(master_) : k == 1 ? static_cast<void*>(exp_avg_) : exp_avg_sq_;
      if (s.mem == nullptr) continue;  // fp32 training on the device: no master weights
    }
    out.push_back(s);
  }
  // The delayed update in flight: its new parameters, in partition order (offload_update).
  if (dpu_pending_ && dpu_params_ != nullptr) {
    StateRef d;
    d.name = "params.dpu";
    d.dtype = pdt_;
    d.mem = dpu_params_;
    out.push_back(d);
  }
  return out;
}

std::vector<CheckpointEntry> Engine::checkpoint_entries(int r, const std::vector<StateRef>& states) const {
  std::vector<CheckpointEntry> out;
  if (stage_ == 0 && r != 0) return out;  // replicated: rank 0 writes
  uint64_t offset = 0;
  for (const StateRef& st : states) {
    const uint64_t eb = dtype_bytes(st.dtype);
    for (const Group& gr : groups_) {
      const uint64_t lo = stage_ == 0 ? 0 : std::min(gr.elems, static_cast<uint64_t>(r) * gr.shard);
      const uint64_t hi = stage_ == 0 ? gr.elems : std::min(gr.elems, lo + gr.shard);
      if (hi <= lo) continue;
      out.push_back({st.name, st.dtype, gr.flat_off + lo, hi - lo, offset});
      offset += (hi - lo) * eb;
    }
  }
  return out;
}

void Engine::visit_state(const StateRef& st, bool load, std::byte* buf, uint64_t cap,
                         const std::function<void(uint64_t, uint64_t, std::byte*)>& fn) {
  const uint64_t eb = dtype_bytes(st.dtype);
  if (st.swapper == nullptr) {
    const uint64_t per = cap / eb;
    for (const Group& gr : groups_) {
      const auto [lo, hi] = owned(gr);
      for (uint64_t c = lo; c < hi; c += per) {
        const uint64_t m = std::min(per, hi - c);
        std::byte* p = at(st.mem, st.flat_index ? gr.flat_off + c : gr.part_off + (c - lo), eb);
        if (!load) dev_.copy(buf, p, m * eb);
        fn(gr.flat_off + c, m, buf);
        if (load) dev_.copy(p, buf, m * eb);
      }
    }
    return;
  }
  // A swap file holds the partition (padding included): whole chunks, read or written with
  // O_DIRECT; a load writes the padding as zeros, as the engine initialised it.
  const uint64_t total = part_ * eb;
  for (uint64_t off = 0; off < total; off += cap) {
    const uint64_t len = std::min(cap, total - off);
    if (load) std::memset(buf, 0, len);
    else st.swapper->wait(st.swapper->read(st.file, off, buf, len));
    const uint64_t e0 = off / eb, m = len / eb;
    for (const Group& gr : groups_) {
      const auto [lo, hi] = owned(gr);
      const uint64_t a = std::max(e0, gr.part_off), b = std::min(e0 + m, gr.part_off + (hi - lo));
      if (a < b) fn(gr.flat_off + lo + (a - gr.part_off), b - a, buf + (a - e0) * eb);
    }
    if (load) st.swapper->wait(st.swapper->write(st.file, off, buf, len));
  }
}

void Engine::join_dpu() {
  if (!dpu_pending_) return;
  if (dpu_thread_.joinable()) dpu_thread_.join();
  if (nvme_) fail_together(std::exchange(dpu_failure_, {}), std::exchange(dpu_hint_, {}),
                           "the delayed swapped optimizer step");
}

void Engine::save_checkpoint(const std::string& root, int64_t keep) {
  CheckpointFaults::set_rank(rank_);
  if (ep_ > 1)
    throw Error("checkpoints of expert-parallel runs are not supported yet",
                "drop --save-checkpoint, or run with --ep 1");
  join_dpu();
  const std::string name = checkpoint_dir_name(step_);
  const fs::path tmp = fs::path(root) / ("." + name + ".tmp");
  std::string failure, hint;
  auto note = [&](const Error& e) {
    if (failure.empty()) {
      failure = e.what();
      hint = e.hint();
    }
  };
  // Every rank learns of a failure on any before going on; rank 0 removes the partial
  // directory. The last complete checkpoint is not touched until the new one is whole.
  auto agree = [&](const char* what) {
    try {
      fail_together(std::exchange(failure, {}), std::exchange(hint, {}), what);
    } catch (const StepFailed&) {
      if (rank_ == 0) discard_checkpoint_dir(root, name);
      throw;
    }
  };
  if (rank_ == 0) {
    try {
      prepare_checkpoint_dir(root, name);
    } catch (const Error& e) {
      note(e);
    }
  }
  agree("preparing the checkpoint directory");

  const std::vector<StateRef> states = checkpoint_states();
  const uint64_t held = stage_ == 0 ? n_params_ : part_;
  uint64_t mine[2] = {0, 0};  // this rank's file: bytes, CRC-32
  {
    ArenaGuard guard{dev_.arena(Tier::cpu), {}};
    try {
      void* block = alloc(Tier::cpu, planner::checkpoint_staging_bytes(held), Category::buffers,
                          "checkpoint_staging");
      guard.held.push_back(block);
      const std::vector<CheckpointEntry> entries = checkpoint_entries(rank_, states);
      if (!entries.empty()) {
        std::byte* buf = swap_aligned(block);
        const uint64_t cap = planner::checkpoint_chunk_elems(held) * 4;
        CheckpointFile file((tmp / fmt::format("rank{}.bin", rank_)).string());
        std::size_t k = 0;
        for (const StateRef& st : states) {
          const uint64_t eb = dtype_bytes(st.dtype);
          visit_state(st, false, buf, cap, [&](uint64_t flat, uint64_t n, std::byte* v) {
            // The pieces come in the entries' order: each where its entry puts it.
            if (k >= entries.size() || entries[k].state != st.name || flat < entries[k].flat ||
                file.bytes() != entries[k].offset + (flat - entries[k].flat) * eb)
              throw Error(fmt::format("internal: checkpoint piece {} of {} out of order", flat, st.name));
            file.append(v, n * eb);
            if (flat + n == entries[k].flat + entries[k].n) ++k;
          });
        }
        file.commit();
        mine[0] = file.bytes();
        mine[1] = file.crc32();
      }
    } catch (const Error& e) {
      note(e);
    }
  }
  agree("writing the checkpoint");

  std::vector<uint64_t> all(static_cast<std::size_t>(2 * dp_));
  if (dp_ > 1) comm_.gather_u64(mine, all.data(), 2);
  else std::copy(mine, mine + 2, all.begin());
  if (rank_ == 0) {
    try {
      CheckpointManifest m;
      m.model = plan_.model.name;
      m.model_config = models::to_hf_config(plan_.model);
      m.precision = std::string(planner::to_string(plan_.strategy.precision));
      m.optimizer = std::string(planner::to_string(plan_.strategy.optimizer));
      m.n_params = canon_params_;
      m.stage = stage_;
      m.dp = dp_;
      m.step = step_;
      m.good_steps = good_steps_;
      m.loss_scale = loss_scale_;
      m.dpu_pending = dpu_pending_;
      m.seed = plan_.seed;
      m.data_origin = data_.origin();
      m.data_bytes = data_.size_bytes();
      m.sequences_per_step = B_ * dp_ * plan_.strategy.grad_accum;
      m.lr = opt_.lr;
      m.weight_decay = opt_.weight_decay;
      m.grad_clip = opt_.grad_clip;
      m.dpu_warmup = opt_.dpu_warmup_steps;
      for (int r = 0; r < dp_; ++r) {
        std::vector<CheckpointEntry> entries = checkpoint_entries(r, states);
        if (entries.empty()) continue;
        m.shards.push_back({fmt::format("rank{}.bin", r), r, all[2 * static_cast<std::size_t>(r)],
                            static_cast<uint32_t>(all[2 * static_cast<std::size_t>(r) + 1]),
                            std::move(entries)});
      }
      write_file_durably((tmp / "manifest.json").string(), to_json(m).dump(1) + "\n");
      commit_checkpoint_dir(root, name, keep);
    } catch (const Error& e) {
      note(e);
    }
  }
  agree("committing the checkpoint");
  CheckpointFaults::report();
}

void Engine::load_checkpoint(const std::string& step_dir, const CheckpointManifest& m) {
  CheckpointFaults::set_rank(rank_);
  std::string failure, hint;
  const std::string manifest = (fs::path(step_dir) / "manifest.json").string();
  try {
    const std::string refuse_hint = "resume with the model, precision and optimizer it was saved with";
    if (ep_ > 1)
      throw Error("resuming expert-parallel runs is not supported yet", "run with --ep 1");
    if (m.n_params != canon_params_ ||
        nlohmann::json::parse(m.model_config, nullptr, false) !=
            nlohmann::json::parse(models::to_hf_config(plan_.model), nullptr, false))
      throw Error(fmt::format("{} is a checkpoint of {} ({} parameters), this run trains {} ({})",
                              manifest, m.model, m.n_params, plan_.model.name, canon_params_),
                  refuse_hint);
    if (m.precision != planner::to_string(plan_.strategy.precision))
      throw Error(fmt::format("{} was saved in {}, this run trains in {}", manifest, m.precision,
                              planner::to_string(plan_.strategy.precision)),
                  refuse_hint);
    if (m.optimizer != planner::to_string(plan_.strategy.optimizer))
      throw Error(fmt::format("{} holds {} states, this run's optimizer is {}", manifest,
                              m.optimizer, planner::to_string(plan_.strategy.optimizer)),
                  refuse_hint);
    if (m.dpu_pending && !dpu_)
      throw Error(fmt::format("{} holds a delayed parameter update in flight; this run has no --dpu",
                              manifest),
                  "resume with --dpu (and an offloaded optimizer), or from a checkpoint saved "
                  "before the delayed update started");
    dpu_pending_ = m.dpu_pending;  // checkpoint_states() then includes params.dpu
    const std::vector<StateRef> states = checkpoint_states();

    // Where each state's elements are: (flat, n, shard, offset), by flat.
    struct Piece {
      uint64_t flat, n;
      std::size_t shard;
      uint64_t offset;
      DType dtype;
    };
    std::map<std::string, std::vector<Piece>> where;
    for (std::size_t s = 0; s < m.shards.size(); ++s)
      for (const CheckpointEntry& e : m.shards[s].entries)
        where[e.state].push_back({e.flat, e.n, s, e.offset, e.dtype});
    for (auto& [k, v] : where)
      std::sort(v.begin(), v.end(), [](const Piece& a, const Piece& b) { return a.flat < b.flat; });
    // A state the checkpoint lacks but holds equal values of: fp32 master weights are the
    // fp32 parameters; an fp32 delayed update's parameters are its master weights.
    auto source = [&](const StateRef& st) -> const std::vector<Piece>& {
      for (const char* name : {st.name.c_str(),
                               st.name == "master" && pdt_ == DType::fp32 ? "params" : "",
                               st.name == "params.dpu" && pdt_ == DType::fp32 ? "master" : ""})
        if (auto it = where.find(name); it != where.end()) return it->second;
      throw Error(fmt::format("{} holds no '{}' state, which this run needs", manifest, st.name),
                  refuse_hint);
    };

    ArenaGuard guard{dev_.arena(Tier::cpu), {}};
    const uint64_t held = stage_ == 0 ? n_params_ : part_;
    void* block = alloc(Tier::cpu, planner::checkpoint_staging_bytes(held), Category::buffers,
                        "checkpoint_staging");
    guard.held.push_back(block);
    std::byte* buf = swap_aligned(block);
    const uint64_t cap = planner::checkpoint_chunk_elems(held) * 4;

    // The files this rank reads, checked whole before any is used.
    std::set<std::size_t> needed;
    for (const StateRef& st : states) {
      const auto& pieces = source(st);
      for (const Group& gr : groups_) {
        const auto [lo, hi] = owned(gr);
        for (const Piece& p : pieces)
          if (p.flat < gr.flat_off + hi && p.flat + p.n > gr.flat_off + lo) needed.insert(p.shard);
      }
    }
    for (std::size_t s : needed) verify_shard(step_dir, m.shards[s], buf, cap);

    Fds fds;
    auto fd_of = [&](std::size_t s) {
      if (auto it = fds.fd.find(s); it != fds.fd.end()) return it->second;
      const std::string path = (fs::path(step_dir) / m.shards[s].file).string();
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) throw Error(fmt::format("checkpoint file {}: {}", path, std::strerror(errno)));
      return fds.fd[s] = fd;
    };
    for (const StateRef& st : states) {
      const auto& pieces = source(st);
      const uint64_t eb = dtype_bytes(st.dtype);
      visit_state(st, true, buf, cap, [&](uint64_t flat, uint64_t n, std::byte* v) {
        uint64_t covered = 0;
        for (const Piece& p : pieces) {
          const uint64_t a = std::max(flat, p.flat), b = std::min(flat + n, p.flat + p.n);
          if (a >= b) continue;
          if (p.dtype != st.dtype)
            throw Error(fmt::format("{}: state '{}' is {}, this run keeps it in {}", manifest,
                                    st.name, to_string(p.dtype), to_string(st.dtype)),
                        refuse_hint);
          const uint64_t bytes = (b - a) * eb;
          const ssize_t r = ::pread(fd_of(p.shard), v + (a - flat) * eb, bytes,
                                    static_cast<off_t>(p.offset + (a - p.flat) * eb));
          if (r != static_cast<ssize_t>(bytes))
            throw Error(fmt::format("checkpoint file {}: short read", m.shards[p.shard].file));
          covered += b - a;
        }
        if (covered != n)
          throw Error(fmt::format("{}: elements {} to {} of state '{}' are in no file (or in two)",
                                  manifest, flat, flat + n, st.name),
                      "the checkpoint is incomplete: resume from another one");
      });
    }
  } catch (const Error& e) {
    failure = e.what();
    hint = e.hint();
  }
  // Every rank agrees before the collectives below: a failure is an input error everywhere.
  const double n_failed = dp_ > 1 ? comm_.all_reduce_sum(failure.empty() ? 0.0 : 1.0)
                                  : (failure.empty() ? 0.0 : 1.0);
  if (!failure.empty()) throw StepFailed(failure, hint, true);
  if (n_failed > 0)
    throw StepFailed(fmt::format("rank {}: loading the checkpoint failed on {} other rank{}", rank_,
                                 n_failed, n_failed > 1 ? "s" : ""),
                     "see the failing rank's error", false);
  step_ = m.step;
  first_step_ = m.step;
  good_steps_ = m.good_steps;
  loss_scale_ = static_cast<float>(m.loss_scale);
  gather_params();  // stages 1-2: every rank's slice of the parameters to all
}

}  // namespace zp::runtime
