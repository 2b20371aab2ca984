// device.cpp: the tagged arena and the cpu backend (host memory regions, cpu_kernels.hpp).
#include "zp/runtime/device.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "zp/error.hpp"
#include "zp/runtime/cpu_kernels.hpp"
#include "zp/units.hpp"

namespace zp::runtime {

// ---- Arena ---------------------------------------------------------------------------------

Arena::Arena(Tier tier, std::byte* base, uint64_t capacity)
    : tier_(tier), base_(base), capacity_(capacity),
      model_(planner::kArenaAlignment, capacity) {}

void* Arena::alloc(uint64_t bytes, Category c, std::string_view name) {
  planner::BlockId id = 0;
  const auto off = model_.try_alloc(bytes, &id);
  if (!off) {
    const uint64_t need = planner::round_up(std::max<uint64_t>(bytes, 1), planner::kArenaAlignment);
    throw Error(
        fmt::format("out of {} memory allocating {} ({}, {}): {} in use of {}, largest free block "
                    "{}; short by {}",
                    planner::to_string(tier_), name, planner::to_string(c), format_bytes(bytes),
                    format_bytes(in_use_), format_bytes(capacity_),
                    format_bytes(model_.largest_free()),
                    format_bytes(need > model_.largest_free() ? need - model_.largest_free() : need)),
        tier_ == Tier::gpu ? "give the device more memory (--device-memory) or plan a strategy "
                             "that fits (zero-plan estimate --hardware ...)"
                           : "give the host tier more memory (--host-memory)");
  }
  // An address space hands out kArenaAlignment + offset: never null, never dereferenced.
  void* p = base_ != nullptr ? static_cast<void*>(base_ + *off)
                             : reinterpret_cast<void*>(static_cast<uintptr_t>(planner::kArenaAlignment + *off));
  live_.emplace(p, Live{id, c});
  const uint64_t size = model_.size(id);
  const std::size_t k = static_cast<std::size_t>(c);
  cur_[k] += size;
  high_[k] = std::max(high_[k], cur_[k]);
  in_use_ += size;
  peak_in_use_ = std::max(peak_in_use_, in_use_);
  return p;
}

void Arena::free(void* p) {
  auto it = live_.find(p);
  if (it == live_.end())
    throw Error(fmt::format("{} arena: free of a pointer it does not hold", planner::to_string(tier_)));
  const uint64_t size = model_.size(it->second.id);
  cur_[static_cast<std::size_t>(it->second.category)] -= size;
  in_use_ -= size;
  model_.free(it->second.id);
  live_.erase(it);
}

uint64_t Arena::offset_of(const void* p) const {
  const uintptr_t origin = base_ != nullptr ? reinterpret_cast<uintptr_t>(base_) : planner::kArenaAlignment;
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p) - origin);
}

planner::Breakdown Arena::high_water() const {
  planner::Breakdown b;
  for (Category c : planner::kCategories) b[c] = high_[static_cast<std::size_t>(c)];
  b[Category::overhead] = model_.peak_reserved() - peak_in_use_;
  return b;
}

planner::PerDevice Device::measured() const {
  planner::PerDevice d;
  for (Tier t : planner::kTiers) {
    const auto& a = arenas_[static_cast<std::size_t>(t)];
    if (!a) continue;
    d[t] = a->high_water();
    d.set_peak(t, a->peak_reserved());
  }
  return d;
}

void Device::check_copy_slot(int slot) {
  if (slot < 0 || slot >= kCopySlots)
    throw Error(fmt::format("asynchronous copy slot {}: must be 0 to {}", slot, kCopySlots - 1),
                "the double-buffered copies alternate between two slots");
}

// ---- cpu backend ---------------------------------------------------------------------------

namespace {

// A lazily committed anonymous mapping: pages cost memory only once touched.
class Region {
 public:
  explicit Region(uint64_t bytes, std::string_view what) : bytes_(bytes) {
    if (bytes == 0) return;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw Error(fmt::format("cannot reserve {} for the {} arena: {}", format_bytes(bytes), what,
                              std::strerror(errno)),
                  "ask for less memory (--device-memory / --host-memory)");
    base_ = static_cast<std::byte*>(p);
  }
  ~Region() {
    if (base_ != nullptr) munmap(base_, bytes_);
  }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  std::byte* base() const { return base_; }

 private:
  std::byte* base_ = nullptr;
  uint64_t bytes_ = 0;
};

// The cpu backend's host-to-device stream: one thread, started at the first copy, that runs
// the queued copies in the order they were issued (as a CUDA stream would), so the engine's
// double buffering really overlaps and a missing wait shows. Copies are numbered; a slot is
// done once the copy thread has finished the slot's last-issued number.
class CopyStream {
 public:
  explicit CopyStream(uint32_t delay_us) : delay_us_(delay_us) {}
  ~CopyStream() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();  // it finishes the queued copies first
  }
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  void push(void* dst, const void* src, uint64_t bytes, int slot) {
    std::lock_guard lock(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    jobs_.push_back({dst, src, bytes, ++issued_});
    last_issued_[static_cast<std::size_t>(slot)] = issued_;
    cv_.notify_all();
  }
  void wait(int slot) {
    std::unique_lock lock(mu_);
    const uint64_t want = last_issued_[static_cast<std::size_t>(slot)];
    cv_.wait(lock, [&] { return done_ >= want; });
  }
  void wait_all() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_ >= issued_; });
  }

 private:
  struct Job {
    void* dst;
    const void* src;
    uint64_t bytes;
    uint64_t seq;
  };
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and nothing left to copy
      const Job j = jobs_.front();
      jobs_.pop_front();
      lock.unlock();
      if (delay_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
      std::memcpy(j.dst, j.src, j.bytes);
      lock.lock();
      done_ = j.seq;
      cv_.notify_all();
    }
  }

  const uint32_t delay_us_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  std::array<uint64_t, Device::kCopySlots> last_issued_{};
  uint64_t issued_ = 0, done_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(const DeviceConfig& cfg)
      : gpu_(cfg.gpu_bytes, "device"), cpu_(cfg.cpu_bytes, "host"), copies_(cfg.async_copy_delay_us) {
    arenas_[static_cast<std::size_t>(Tier::gpu)] = std::make_unique<Arena>(Tier::gpu, gpu_.base(), cfg.gpu_bytes);
    arenas_[static_cast<std::size_t>(Tier::cpu)] = std::make_unique<Arena>(Tier::cpu, cpu_.base(), cfg.cpu_bytes);
    arenas_[static_cast<std::size_t>(Tier::nvme)] = std::make_unique<Arena>(Tier::nvme, nullptr, cfg.nvme_bytes);
    const int n = cfg.n_threads > 0 ? cfg.n_threads
                                    : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    cpu::set_threads(n);
  }
  std::string_view name() const override { return "cpu"; }

  void zero(void* p, uint64_t bytes) override { std::memset(p, 0, bytes); }
  void copy(void* dst, const void* src, uint64_t bytes) override { std::memmove(dst, src, bytes); }
  void copy_to_device_async(void* dst, const void* src, uint64_t bytes, int slot) override {
    check_copy_slot(slot);
    if (bytes > 0) copies_.push(dst, src, bytes, slot);
  }
  void wait_copy(int slot) override {
    check_copy_slot(slot);
    copies_.wait(slot);
  }
  void synchronize() override { copies_.wait_all(); }

  void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe,
                         DType t, int64_t B, int64_t T, int64_t C) override {
    cpu::embedding_forward(out, tokens, wte, wpe, t, B, T, C);
  }
  void embedding_backward(void* dwte, void* dwpe, const void* dout, const int32_t* tokens,
                          DType t, int64_t B, int64_t T, int64_t C) override {
    cpu::embedding_backward(dwte, dwpe, dout, tokens, t, B, T, C);
  }
  void layernorm_forward(void* out, float* stats, const void* inp, const void* weight,
                         const void* bias, DType t, int64_t N, int64_t C) override {
    cpu::layernorm_forward(out, stats, inp, weight, bias, t, N, C);
  }
  void layernorm_backward(void* dinp, void* dweight, void* dbias, const void* dout,
                          const void* inp, const void* weight, const float* stats, DType t,
                          int64_t N, int64_t C) override {
    cpu::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, stats, t, N, C);
  }
  void matmul_forward(void* out, DType out_t, const void* inp, const void* weight,
                      const void* bias, DType t, int64_t N, int64_t C, int64_t OC) override {
    cpu::matmul_forward(out, out_t, inp, weight, bias, t, N, C, OC, gemm_panels_.data());
  }
  void matmul_backward(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                       const void* weight, DType t, int64_t N, int64_t C, int64_t OC) override {
    cpu::matmul_backward(dinp, dweight, dbias, dout, inp, weight, t, N, C, OC, gemm_panels_.data());
  }
  void attention_scores(void* preatt, const void* qkv, DType t, int64_t B, int64_t T, int64_t C,
                        int64_t NH) override {
    cpu::attention_scores(preatt, qkv, t, B, T, C, NH);
  }
  void attention_softmax(void* att, const void* preatt, DType t, int64_t B, int64_t NH,
                         int64_t T) override {
    cpu::attention_softmax(att, preatt, t, B, NH, T);
  }
  void attention_values(void* out, const void* att, const void* qkv, DType t, int64_t B,
                        int64_t T, int64_t C, int64_t NH) override {
    cpu::attention_values(out, att, qkv, t, B, T, C, NH);
  }
  void attention_values_backward(void* datt, void* dqkv, const void* dout, const void* att,
                                 const void* qkv, DType t, int64_t B, int64_t T, int64_t C,
                                 int64_t NH) override {
    cpu::attention_values_backward(datt, dqkv, dout, att, qkv, t, B, T, C, NH);
  }
  void attention_softmax_backward(void* dpreatt, const void* datt, const void* att, DType t,
                                  int64_t B, int64_t NH, int64_t T) override {
    cpu::attention_softmax_backward(dpreatt, datt, att, t, B, NH, T);
  }
  void attention_scores_backward(void* dqkv, const void* dpreatt, const void* qkv, DType t,
                                 int64_t B, int64_t T, int64_t C, int64_t NH) override {
    cpu::attention_scores_backward(dqkv, dpreatt, qkv, t, B, T, C, NH);
  }
  // LLaMA-family blocks: fp32 (the planner's cpu graph) or 16-bit (its cuda graph).
  void rmsnorm_forward(void* out, float* stats, const void* inp, const void* weight, float eps,
                       DType t, int64_t N, int64_t C) override {
    cpu::rmsnorm_forward(out, stats, inp, weight, eps, t, N, C);
  }
  void rmsnorm_backward(void* dinp, void* dweight, const void* dout, const void* inp,
                        const void* weight, const float* stats, DType t, int64_t N,
                        int64_t C) override {
    cpu::rmsnorm_backward(dinp, dweight, dout, inp, weight, stats, t, N, C);
  }
  void rope_forward(void* x, const float* inv_freq, float mscale, DType t, int64_t B, int64_t T,
                    int64_t row, int64_t n_heads, int64_t HS, int64_t rot) override {
    cpu::rope_forward(x, inv_freq, mscale, t, B, T, row, n_heads, HS, rot);
  }
  void rope_backward(void* dx, const float* inv_freq, float mscale, DType t, int64_t B, int64_t T,
                     int64_t row, int64_t n_heads, int64_t HS, int64_t rot) override {
    cpu::rope_backward(dx, inv_freq, mscale, t, B, T, row, n_heads, HS, rot);
  }
  void swiglu_forward(void* out, const void* gate, const void* up, DType t, int64_t n) override {
    cpu::swiglu_forward(out, gate, up, t, n);
  }
  void swiglu_backward(void* dgate_up, const void* dout, const void* gate, const void* up, DType t,
                       int64_t N, int64_t F) override {
    cpu::swiglu_backward(dgate_up, dout, gate, up, t, N, F);
  }
  void gqa_scores(void* preatt, const QkvIn& in, DType t, int64_t B, int64_t T,
                  const Heads& h) override {
    cpu::attention_scores(preatt, qkv(in), t, shape(B, T, h));
  }
  void gqa_softmax(void* att, const void* preatt, DType t, int64_t B, int64_t T,
                   const Heads& h) override {
    cpu::attention_softmax(att, preatt, t, shape(B, T, h));
  }
  void gqa_softmax_backward(void* dpreatt, const void* datt, const void* att, DType t, int64_t B,
                            int64_t T, const Heads& h) override {
    cpu::attention_softmax_backward(dpreatt, datt, att, t, shape(B, T, h));
  }
  void gqa_values(void* out, const void* att, const QkvIn& in, DType t, int64_t B, int64_t T,
                  const Heads& h) override {
    cpu::attention_values(out, att, qkv(in), t, shape(B, T, h));
  }
  void gqa_values_backward(void* datt, void* dqkv, const void* dout, const void* att,
                           const QkvIn& in, DType t, int64_t B, int64_t T, const Heads& h) override {
    cpu::attention_values_backward(datt, dqkv, dout, att, qkv(in), t, shape(B, T, h));
  }
  void gqa_scores_backward(void* dqkv, const void* dpreatt, const QkvIn& in, DType t, int64_t B,
                           int64_t T, const Heads& h) override {
    cpu::attention_scores_backward(dqkv, dpreatt, qkv(in), t, shape(B, T, h));
  }
  void flash_attention_forward(void* out, float* lse, const QkvIn& in, DType t, int64_t B,
                               int64_t T, const Heads& h, float p, uint64_t key) override {
    cpu::flash_attention_forward(out, lse, qkv(in), t, shape(B, T, h), p, key);
  }
  void flash_attention_backward(void* dqkv, float* dq_acc, float* dsum, const void* dout,
                                const QkvIn& in, const void* out, const float* lse, DType t,
                                int64_t B, int64_t T, const Heads& h, float p,
                                uint64_t key) override {
    cpu::flash_attention_backward(dqkv, dq_acc, dsum, dout, qkv(in), out, lse, t, shape(B, T, h), p,
                                  key);
  }
  void moe_route_forward(float* probs, ExpertIdx idx, float* weights, const void* logits, DType t,
                         int64_t N, int64_t E, int64_t K, bool renormalize) override {
    cpu::moe_route_forward(probs, idx, weights, logits, t, N, E, K, renormalize);
  }
  void moe_route_backward(void* dlogits, DType t, const float* dweights, const float* probs,
                          ExpertIdx idx, const float* dprob_all, int64_t N, int64_t E, int64_t K,
                          bool renormalize) override {
    cpu::moe_route_backward(dlogits, t, dweights, probs, idx, dprob_all, N, E, K, renormalize);
  }
  void moe_route_stats(ExpertIdx idx, const float* probs, int64_t N, int64_t E, int64_t K,
                       int64_t* offsets, double* psum) override {
    cpu::moe_expert_counts(idx, N, K, E, offsets);
    if (psum == nullptr) return;
    std::fill(psum, psum + E, 0.0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) psum[e] += probs[n * E + e];
  }
  void moe_dispatch(void* xe, const void* in, ExpertIdx idx, DType t, int64_t N, int64_t K,
                    int64_t E, int64_t C) override {
    cpu::moe_dispatch(xe, in, idx, t, N, K, E, C);
  }
  void moe_dispatch_backward(void* din, const void* dxe, ExpertIdx idx, DType t, int64_t N,
                             int64_t K, int64_t E, int64_t C) override {
    cpu::moe_dispatch_backward(din, dxe, idx, t, N, K, E, C);
  }
  void moe_combine(void* out, const void* ye, const float* weights, ExpertIdx idx, DType t,
                   int64_t N, int64_t K, int64_t E, int64_t C) override {
    cpu::moe_combine(out, ye, weights, idx, t, N, K, E, C);
  }
  void moe_combine_backward(void* dye, float* dweights, const void* dout, const void* ye,
                            const float* weights, ExpertIdx idx, DType t, int64_t N, int64_t K,
                            int64_t E, int64_t C) override {
    cpu::moe_combine_backward(dye, dweights, dout, ye, weights, idx, t, N, K, E, C);
  }
  void gate_mul_forward(void* out, const void* x, const void* g, DType t, int64_t N,
                        int64_t C) override {
    cpu::gate_mul_forward(out, x, g, t, N, C);
  }
  void gate_mul_backward(void* dx, void* dg, const void* dout, const void* x, const void* g, DType t,
                         int64_t N, int64_t C) override {
    cpu::gate_mul_backward(dx, dg, dout, x, g, t, N, C);
  }
  void head_rmsnorm_forward(void* out, float* stats, const QkvIn& in, const void* weight, float eps,
                            DType t, int64_t N, const Heads& h) override {
    cpu::head_rmsnorm_forward(out, stats, qkv(in), weight, eps, t, N, h.NH, h.KVH, h.HS);
  }
  void head_rmsnorm_backward(void* dqkv, void* dweight, const QkvIn& in, const void* weight,
                             const float* stats, DType t, int64_t N, const Heads& h) override {
    cpu::head_rmsnorm_backward(dqkv, (h.NH + 2 * h.KVH) * h.HS, dweight, qkv(in), weight, stats, t, N,
                               h.NH, h.KVH, h.HS);
  }
  void gelu_forward(void* out, const void* inp, DType t, int64_t n) override {
    cpu::gelu_forward(out, inp, t, n);
  }
  void gelu_backward(void* dinp, const void* inp, const void* dout, DType t, int64_t n) override {
    cpu::gelu_backward(dinp, inp, dout, t, n);
  }
  void residual_forward(void* out, const void* a, const void* b, DType t, int64_t n) override {
    cpu::residual_forward(out, a, b, t, n);
  }
  void dropout_forward(void* out, uint8_t* mask, const void* inp, DType t, float p, uint64_t key,
                       int64_t n) override {
    cpu::dropout_forward(out, mask, inp, t, p, key, n);
  }
  void dropout_backward(void* dinp, const void* dout, const uint8_t* mask, DType t, float p,
                        int64_t n) override {
    cpu::dropout_backward(dinp, dout, mask, t, p, n);
  }
  void crossentropy_forward(float* logits, float* losses, const int32_t* targets, int64_t N,
                            int64_t V) override {
    cpu::crossentropy_forward(logits, losses, targets, N, V);
  }
  void crossentropy_backward(void* dlogits, DType t, const float* probs, const int32_t* targets,
                             float dloss, int64_t N, int64_t V) override {
    cpu::crossentropy_backward(dlogits, t, probs, targets, dloss, N, V);
  }
  void to_f32(float* dst, const void* src, DType t, int64_t n) override {
    cpu::to_f32(dst, src, t, n);
  }
  void accumulate_to(void* dst, const float* src, DType t, int64_t n) override {
    cpu::accumulate_to(dst, src, t, n);
  }
  void add(void* dst, const void* src, DType t, int64_t n) override {
    for (int64_t i = 0; i < n; ++i)
      store_from_f32(dst, static_cast<std::size_t>(i), t,
                     load_as_f32(dst, static_cast<std::size_t>(i), t) +
                         load_as_f32(src, static_cast<std::size_t>(i), t));
  }
  void add_f32(float* dst, const void* src, DType t, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) dst[i] += load_as_f32(src, static_cast<std::size_t>(i), t);
  }
  double sum(const float* p, int64_t n) override {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += p[i];
    return s;
  }
  void loss_accumulate(const float* p, int64_t n) override { loss_acc_ += sum(p, n); }
  double loss_take() override { return std::exchange(loss_acc_, 0.0); }
  void upload(void* dst, const void* src, uint64_t bytes) override { std::memmove(dst, src, bytes); }
  GradSumSquares grad_sum_squares(const void* grads, DType t, uint64_t n) override {
    return zp::runtime::grad_sum_squares(grads, t, n);
  }
  void adam_step(const AdamConfig& cfg, const AdamStepArgs& step, const AdamTensors& ts) override {
    cpu_adam_step(cfg, step, ts);
  }
  void sgd_step(float* master, float* momentum_buf, const void* grads, DType grad_dtype,
                void* param_out, DType param_dtype, float lr, float momentum, float weight_decay,
                float grad_scale, uint64_t n) override {
    cpu::sgd_step(master, momentum_buf, grads, grad_dtype, param_out, param_dtype, lr, momentum,
                  weight_decay, grad_scale, static_cast<int64_t>(n));
  }

 private:
  Region gpu_, cpu_;
  // The 16-bit GEMMs' fp32 panels (cpu_kernels.hpp kGemmWorkspaceFloats, 768 KiB): kernel
  // scratch of fixed size outside the arenas, as OpenBLAS's packing buffers are, not a tensor.
  std::vector<float> gemm_panels_ = std::vector<float>(cpu::kGemmWorkspaceFloats);
  double loss_acc_ = 0.0;  // loss_accumulate's running total
  static cpu::AttnShape shape(int64_t B, int64_t T, const Heads& h) {
    return {B, T, h.NH, h.KVH, h.HS, h.window};
  }
  static cpu::QkvT qkv(const QkvIn& in) { return {in.q, in.k, in.v, in.q_row, in.k_row, in.v_row}; }
  CopyStream copies_;  // declared last: its destructor finishes copies into the regions
};

}  // namespace

std::unique_ptr<Device> make_cpu_device(const DeviceConfig& cfg) {
  return std::make_unique<CpuDevice>(cfg);
}

}  // namespace zp::runtime
