// zp/runtime/device.hpp: where the runtime's bytes live and how its kernels run. An Arena is
// one tier's memory on one rank: a single region, sub-allocated best-fit by the same rules the
// planner models (planner::ArenaModel), with every allocation tagged by category and a
// high-water mark per category. A Device owns the arenas of its tiers and runs the step's
// kernels; the cpu backend is host memory and the kernels of cpu_kernels.hpp. Not the ZeRO
// logic (engine.hpp) and not communication (comm.hpp).
//
// Example usage:
//   auto dev = make_cpu_device({.gpu_bytes = 1 << 30, .cpu_bytes = 1 << 30});
//   float* x = static_cast<float*>(dev->arena(Tier::gpu).alloc(4096, Category::activations, "x"));
//   dev->arena(Tier::gpu).free(x);
//   planner::PerDevice measured = dev->measured();   // high-water per tier and category
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>

#include "zp/planner/allocator.hpp"
#include "zp/planner/memory.hpp"
#include "zp/runtime/cpu_adam.hpp"
#include "zp/runtime/dtype.hpp"

namespace zp::runtime {

using planner::Category;
using planner::Tier;

class Arena {
 public:
  // base: `capacity` bytes owned by the caller (the Device), aligned to planner::kArenaAlignment.
  // base nullptr: an address space with no memory behind it (the nvme tier, whose
  // allocations are byte ranges of swap files): alloc returns opaque non-null handles that
  // are never dereferenced; offset_of gives the offset each stands for.
  Arena(Tier tier, std::byte* base, uint64_t capacity);
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // `bytes` rounded up to the arena's alignment; zp::Error naming the tensor, its category and
  // the shortfall when the region cannot hold it.
  void* alloc(uint64_t bytes, Category c, std::string_view name);
  void free(void* p);

  uint64_t offset_of(const void* p) const;
  Tier tier() const { return tier_; }
  uint64_t capacity() const { return capacity_; }
  uint64_t in_use() const { return in_use_; }
  uint64_t peak_in_use() const { return peak_in_use_; }
  uint64_t peak_reserved() const { return model_.peak_reserved(); }
  uint64_t in_use(Category c) const { return cur_[static_cast<std::size_t>(c)]; }
  // High-water per category; `overhead` = reserved beyond the bytes in use at the peak.
  planner::Breakdown high_water() const;

 private:
  struct Live {
    planner::BlockId id;
    Category category;
  };
  Tier tier_;
  std::byte* base_;
  uint64_t capacity_;
  planner::ArenaModel model_;
  std::unordered_map<const void*, Live> live_;
  std::array<uint64_t, planner::kCategories.size()> cur_{}, high_{};
  uint64_t in_use_ = 0, peak_in_use_ = 0;
};

struct DeviceConfig {
  uint64_t gpu_bytes = 0;   // capacity of the device tier (emulated on the cpu backend)
  uint64_t cpu_bytes = 0;   // capacity of the host tier (offloaded states and buffers)
  uint64_t nvme_bytes = 0;  // capacity of the nvme tier (an address space for swap files)
  int n_threads = 0;        // compute threads; 0: the cores divided among the node's ranks
  // Test hook (cpu backend): the copy thread sleeps this long before each asynchronous copy,
  // so a caller that rewrites a source before wait_copy sends the new bytes, not the old.
  uint32_t async_copy_delay_us = 0;
};

// The compute seam: every op of a GPT-2 step, on pointers into this device's arenas. The cpu
// backend forwards to cpu_kernels.hpp (same names, same semantics: backward kernels
// accumulate); the cuda backend runs the same math on the GPU (cuBLAS for the GEMMs, 16-bit
// inputs with fp32 accumulation).
class Device {
 public:
  virtual ~Device() = default;
  virtual std::string_view name() const = 0;

  Arena& arena(Tier t) { return *arenas_[static_cast<std::size_t>(t)]; }
  const Arena& arena(Tier t) const { return *arenas_[static_cast<std::size_t>(t)]; }
  // What this rank holds per tier: category high-water marks, and the reserved peak.
  planner::PerDevice measured() const;

  virtual void zero(void* p, uint64_t bytes) = 0;
  virtual void copy(void* dst, const void* src, uint64_t bytes) = 0;
  // Host tier to gpu tier, returning before the copy is done: double buffering. `slot` (0 or
  // 1) names the host buffer; the caller must not write `src` again, nor free it, before
  // wait_copy(slot). Copies run in the order they were issued, after the device's earlier
  // compute work. wait_copy(slot) returns once the slot's copies are done, and orders the
  // device's later compute work after them; it returns at once when none is pending.
  // synchronize() waits for every slot too.
  static constexpr int kCopySlots = 2;
  virtual void copy_to_device_async(void* dst, const void* src, uint64_t bytes, int slot) = 0;
  virtual void wait_copy(int slot) = 0;
  virtual void synchronize() = 0;

  // Kernels. Every 16-bit-or-fp32 buffer of a call is stored as `t` (void*), except those
  // typed float (LayerNorm statistics, losses, the fp32 logits and probabilities) and a
  // matmul's output, stored as `out_t`. Kernels load as fp32, compute in fp32 and store each
  // output element rounded once (to nearest even); a backward kernel's accumulation
  // (out += ...) is one rounding of out + the fp32 sum. t is fp32 for the planner's cpu graph
  // (fp32 activations, fp32 scratch copies of 16-bit weights) and the training precision for
  // its cuda graph (16-bit activations, weights and gradients as stored).
  virtual void embedding_forward(void* out, const int32_t* tokens, const void* wte,
                                 const void* wpe, DType t, int64_t B, int64_t T, int64_t C) = 0;
  virtual void embedding_backward(void* dwte, void* dwpe, const void* dout,
                                  const int32_t* tokens, DType t, int64_t B, int64_t T,
                                  int64_t C) = 0;
  virtual void layernorm_forward(void* out, float* stats, const void* inp, const void* weight,
                                 const void* bias, DType t, int64_t N, int64_t C) = 0;
  virtual void layernorm_backward(void* dinp, void* dweight, void* dbias, const void* dout,
                                  const void* inp, const void* weight, const float* stats,
                                  DType t, int64_t N, int64_t C) = 0;
  // out_t: t, or fp32 (the LM head writes fp32 logits from 16-bit inputs).
  virtual void matmul_forward(void* out, DType out_t, const void* inp, const void* weight,
                              const void* bias, DType t, int64_t N, int64_t C, int64_t OC) = 0;
  virtual void matmul_backward(void* dinp, void* dweight, void* dbias, const void* dout,
                               const void* inp, const void* weight, DType t, int64_t N,
                               int64_t C, int64_t OC) = 0;
  // Causal attention in three steps over (B, NH, T, T) score matrices whose row t holds keys
  // 0..t. attention_scores and the datt of attention_values_backward define only the entries
  // on and below the diagonal (the cpu backend leaves those above alone, a GPU's batched GEMMs
  // write them); the softmax and its backward read only those and write zeros above the
  // diagonal, and the products over keys (attention_values, the dv of its backward,
  // attention_scores_backward) take att and dpreatt to be zero there, as those write them.
  virtual void attention_scores(void* preatt, const void* qkv, DType t, int64_t B, int64_t T,
                                int64_t C, int64_t NH) = 0;
  virtual void attention_softmax(void* att, const void* preatt, DType t, int64_t B, int64_t NH,
                                 int64_t T) = 0;
  virtual void attention_values(void* out, const void* att, const void* qkv, DType t, int64_t B,
                                int64_t T, int64_t C, int64_t NH) = 0;
  virtual void attention_values_backward(void* datt, void* dqkv, const void* dout,
                                         const void* att, const void* qkv, DType t, int64_t B,
                                         int64_t T, int64_t C, int64_t NH) = 0;
  virtual void attention_softmax_backward(void* dpreatt, const void* datt, const void* att,
                                          DType t, int64_t B, int64_t NH, int64_t T) = 0;
  virtual void attention_scores_backward(void* dqkv, const void* dpreatt, const void* qkv,
                                         DType t, int64_t B, int64_t T, int64_t C,
                                         int64_t NH) = 0;
  // LLaMA-family blocks, as cpu_kernels.hpp states them (the fused q|k|v rows of grouped-query
  // attention: NH query heads, then KVH key and KVH value heads, each HS wide). Both backends
  // run them with t fp32, fp16 or bf16 (the contract above; cpu_kernels.hpp states each op's
  // sums and roundings; the CUDA backend's two exceptions, a shared key/value head's 16-bit
  // gradient in the three steps and the dispatch's 16-bit backward, round once per query head
  // of the group and once per slot: kernels_moe.cu, device_cuda.cpp). A backend throws
  // zp::Error naming an op it cannot run (zero-run refuses such plans before anything runs).
  struct Heads {
    int64_t NH = 0, KVH = 0, HS = 0;
    int64_t window = 0;  // a sliding window's keys (cpu::AttnShape::window); 0: none
  };
  // Where an attention reads q, k and v (cpu::Qkv's layout; rows in elements of the storage
  // type): the fused q|k|v rows, Qwen3's normed q|k apart from v, or three projections.
  struct QkvIn {
    const void* q = nullptr;
    const void* k = nullptr;
    const void* v = nullptr;
    int64_t q_row = 0, k_row = 0, v_row = 0;
  };
  virtual void rmsnorm_forward(void* out, float* stats, const void* inp, const void* weight,
                               float eps, DType t, int64_t N, int64_t C) = 0;
  virtual void rmsnorm_backward(void* dinp, void* dweight, const void* dout, const void* inp,
                                const void* weight, const float* stats, DType t, int64_t N,
                                int64_t C) = 0;
  // inv_freq: rot / 2 values in host memory (the cpu backend's).
  virtual void rope_forward(void* x, const float* inv_freq, float mscale, DType t, int64_t B,
                            int64_t T, int64_t row, int64_t n_heads, int64_t HS, int64_t rot) = 0;
  virtual void rope_backward(void* dx, const float* inv_freq, float mscale, DType t, int64_t B,
                             int64_t T, int64_t row, int64_t n_heads, int64_t HS, int64_t rot) = 0;
  virtual void swiglu_forward(void* out, const void* gate, const void* up, DType t, int64_t n) = 0;
  virtual void swiglu_backward(void* dgate_up, const void* dout, const void* gate, const void* up,
                               DType t, int64_t N, int64_t F) = 0;
  virtual void gqa_scores(void* preatt, const QkvIn& in, DType t, int64_t B, int64_t T,
                          const Heads& h) = 0;
  virtual void gqa_softmax(void* att, const void* preatt, DType t, int64_t B, int64_t T,
                           const Heads& h) = 0;
  virtual void gqa_softmax_backward(void* dpreatt, const void* datt, const void* att, DType t,
                                    int64_t B, int64_t T, const Heads& h) = 0;
  virtual void gqa_values(void* out, const void* att, const QkvIn& in, DType t, int64_t B,
                          int64_t T, const Heads& h) = 0;
  virtual void gqa_values_backward(void* datt, void* dqkv, const void* dout, const void* att,
                                   const QkvIn& in, DType t, int64_t B, int64_t T,
                                   const Heads& h) = 0;
  virtual void gqa_scores_backward(void* dqkv, const void* dpreatt, const QkvIn& in, DType t,
                                   int64_t B, int64_t T, const Heads& h) = 0;
  // Flash attention over the same q|k|v rows (cpu_kernels.hpp flash_attention_forward and
  // _backward; GPT-2's heads are {NH, NH, C / NH}): out and lse (fp32, (B,NH,T)); the backward
  // adds into dqkv and overwrites its two fp32 workspaces, dq_acc (B,T,NH*HS) and dsum
  // (B,NH,T). Attention dropout p with the three steps' mask under `key`. Both backends run
  // it with fp32 or 16-bit storage (fp32 running sums, each output stored once).
  virtual void flash_attention_forward(void* out, float* lse, const QkvIn& in, DType t, int64_t B,
                                       int64_t T, const Heads& h, float p, uint64_t key) = 0;
  virtual void flash_attention_backward(void* dqkv, float* dq_acc, float* dsum, const void* dout,
                                        const QkvIn& in, const void* out, const float* lse,
                                        DType t, int64_t B, int64_t T, const Heads& h, float p,
                                        uint64_t key) = 0;
  // Mixture of experts (cpu_kernels.hpp moe_*): probabilities, top-k weights and their
  // gradients fp32, top-k indices int32, the rest stored as t. moe_route_stats writes host
  // memory: offsets (E + 1), where each expert's dispatched rows start, and psum (E, if not
  // null), the column sums of probs in float64; dprob_all (E, or null) is host memory too.
  virtual void moe_route_forward(float* probs, ExpertIdx idx, float* weights, const void* logits,
                                 DType t, int64_t N, int64_t E, int64_t K, bool renormalize) = 0;
  virtual void moe_route_backward(void* dlogits, DType t, const float* dweights, const float* probs,
                                  ExpertIdx idx, const float* dprob_all, int64_t N, int64_t E,
                                  int64_t K, bool renormalize) = 0;
  virtual void moe_route_stats(ExpertIdx idx, const float* probs, int64_t N, int64_t E,
                               int64_t K, int64_t* offsets, double* psum) = 0;
  virtual void moe_dispatch(void* xe, const void* in, ExpertIdx idx, DType t, int64_t N,
                            int64_t K, int64_t E, int64_t C) = 0;
  virtual void moe_dispatch_backward(void* din, const void* dxe, ExpertIdx idx, DType t,
                                     int64_t N, int64_t K, int64_t E, int64_t C) = 0;
  virtual void moe_combine(void* out, const void* ye, const float* weights, ExpertIdx idx,
                           DType t, int64_t N, int64_t K, int64_t E, int64_t C) = 0;
  virtual void moe_combine_backward(void* dye, float* dweights, const void* dout, const void* ye,
                                    const float* weights, ExpertIdx idx, DType t, int64_t N,
                                    int64_t K, int64_t E, int64_t C) = 0;
  virtual void gate_mul_forward(void* out, const void* x, const void* g, DType t, int64_t N,
                                int64_t C) = 0;
  virtual void gate_mul_backward(void* dx, void* dg, const void* dout, const void* x, const void* g,
                                 DType t, int64_t N, int64_t C) = 0;
  // Per-head RMSNorm of q and k (cpu_kernels.hpp head_rmsnorm_forward / _backward), reading
  // the q and k of `in`; the backward's dqkv is the fused gradient, rows of (NH + 2 KVH) HS.
  virtual void head_rmsnorm_forward(void* out, float* stats, const QkvIn& in, const void* weight,
                                    float eps, DType t, int64_t N, const Heads& h) = 0;
  virtual void head_rmsnorm_backward(void* dqkv, void* dweight, const QkvIn& in, const void* weight,
                                     const float* stats, DType t, int64_t N, const Heads& h) = 0;
  virtual void gelu_forward(void* out, const void* inp, DType t, int64_t n) = 0;
  virtual void gelu_backward(void* dinp, const void* inp, const void* dout, DType t,
                             int64_t n) = 0;
  virtual void residual_forward(void* out, const void* a, const void* b, DType t, int64_t n) = 0;
  // Inverted dropout with the counter-based mask of kernel_math.hpp: mask[i] = 1 where element
  // i is kept (dropout_keep(key, i, dropout_threshold(p))), out = inp * mask / (1 - p). out may
  // equal inp. 0 <= p < 1.
  virtual void dropout_forward(void* out, uint8_t* mask, const void* inp, DType t, float p,
                               uint64_t key, int64_t n) = 0;
  // dinp = dout * mask / (1 - p); overwrites, and dinp may equal dout.
  virtual void dropout_backward(void* dinp, const void* dout, const uint8_t* mask, DType t,
                                float p, int64_t n) = 0;
  virtual void crossentropy_forward(float* logits, float* losses, const int32_t* targets,
                                    int64_t N, int64_t V) = 0;
  // dlogits (stored as t) = (probs - onehot(target)) * dloss; overwrites. In place (dlogits ==
  // probs) when t is fp32; a 16-bit graph gives the LM head's backward a 16-bit gradient.
  virtual void crossentropy_backward(void* dlogits, DType t, const float* probs,
                                     const int32_t* targets, float dloss, int64_t N,
                                     int64_t V) = 0;
  virtual void to_f32(float* dst, const void* src, DType t, int64_t n) = 0;
  virtual void accumulate_to(void* dst, const float* src, DType t, int64_t n) = 0;
  // dst += src for two buffers of the same storage type (adding in fp32, rounding once).
  virtual void add(void* dst, const void* src, DType t, int64_t n) = 0;
  // dst += src as fp32, dst an fp32 buffer in the host tier (an offloaded gradient partition;
  // on a GPU the source is device memory and the add streams over the host link).
  virtual void add_f32(float* dst, const void* src, DType t, int64_t n) = 0;
  // Sum of a device buffer of fp32 values, read back to the host (the host waits for it).
  virtual double sum(const float* p, int64_t n) = 0;
  // The step's loss without a host wait per micro-step: loss_accumulate adds sum(p, n) to the
  // device's running total, where it stays; loss_take returns the total (the host waits here,
  // once per step) and starts a new one. The same bits as adding sum()'s results on the host
  // in the same order. A bad cross-entropy target is reported by loss_take at the latest.
  virtual void loss_accumulate(const float* p, int64_t n) = 0;
  virtual double loss_take() = 0;
  // Host memory (any) into a buffer of this device, ordered after the device's earlier compute
  // work and before its later, without the host waiting for that work (a micro-step's tokens
  // and targets); src may be reused at once: a GPU first copies it into pinned staging memory
  // of its own (a few KiB per input, outside the arenas).
  virtual void upload(void* dst, const void* src, uint64_t bytes) = 0;

  // The optimizer on buffers of this device's gpu tier (states not offloaded): the same
  // contracts as cpu_adam.hpp's grad_sum_squares and cpu_adam_step, and cpu::sgd_step.
  // Offloaded states live in the host tier and are updated by the CPU Adam directly.
  virtual GradSumSquares grad_sum_squares(const void* grads, DType t, uint64_t n) = 0;
  virtual void adam_step(const AdamConfig& cfg, const AdamStepArgs& step, const AdamTensors& ts) = 0;
  virtual void sgd_step(float* master, float* momentum_buf, const void* grads, DType grad_dtype,
                        void* param_out, DType param_dtype, float lr, float momentum,
                        float weight_decay, float grad_scale, uint64_t n) = 0;

 protected:
  // zp::Error unless 0 <= slot < kCopySlots.
  static void check_copy_slot(int slot);

  std::array<std::unique_ptr<Arena>, planner::kTiers.size()> arenas_;
};

// Host memory for both tiers (the device tier emulated), OpenBLAS and OpenMP kernels.
std::unique_ptr<Device> make_cpu_device(const DeviceConfig& cfg);

}  // namespace zp::runtime
