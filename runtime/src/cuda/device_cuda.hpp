// device_cuda.hpp (internal): the CUDA Device, declared for comm_nccl.cpp, which needs its GPU,
// its streams and the ordering between them. Not public: users see zp/runtime/cuda.hpp.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>

#include "zp/runtime/async_watch.hpp"
#include "zp/runtime/cuda.hpp"
#include "zp/runtime/device.hpp"
#include "kernels.hpp"

namespace zp::runtime::cuda {

// Streams, each with its own ordering event. Kernels and device-to-device copies run on
// compute; host-to-device and device-to-host copies on h2d and d2h; NCCL on comm.
enum class Stream : uint8_t { compute, h2d, d2h, comm };
inline constexpr std::size_t kStreams = 4;

class CudaDevice final : public Device {
 public:
  CudaDevice(const DeviceConfig& cfg, const CudaOptions& opt);
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  std::string_view name() const override { return "cuda"; }
  int device_index() const { return device_; }
  cudaStream_t stream(Stream s) const { return streams_[static_cast<std::size_t>(s)]; }
  // `waiter` waits (on the GPU, the host does not block) for all work enqueued on `signaller`.
  void order(Stream waiter, Stream signaller);
  // Whether p points into device memory (the gpu arena, or any cudaMalloc'd block).
  bool on_device(const void* p) const;
  // The host blocks until the stream's (the event's) work is done, polling; between polls it
  // asks the watch (the communicator's asynchronous errors, set by NcclComm) so that a dead
  // peer ends in a zp::Error instead of a wait forever. Without a watch: a plain synchronize.
  void host_wait(cudaStream_t s);
  void host_wait(cudaEvent_t e);
  void set_async_watch(AsyncWatch* watch) { watch_ = watch; }
  CudaMemoryInfo memory_info() const;

  void zero(void* p, uint64_t bytes) override;
  void copy(void* dst, const void* src, uint64_t bytes) override;
  void copy_to_device_async(void* dst, const void* src, uint64_t bytes, int slot) override;
  void wait_copy(int slot) override;
  void synchronize() override;

  void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe,
                         DType t, int64_t B, int64_t T, int64_t C) override;
  void embedding_backward(void* dwte, void* dwpe, const void* dout, const int32_t* tokens,
                          DType t, int64_t B, int64_t T, int64_t C) override;
  void layernorm_forward(void* out, float* stats, const void* inp, const void* weight,
                         const void* bias, DType t, int64_t N, int64_t C) override;
  void layernorm_backward(void* dinp, void* dweight, void* dbias, const void* dout,
                          const void* inp, const void* weight, const float* stats, DType t,
                          int64_t N, int64_t C) override;
  void matmul_forward(void* out, DType out_t, const void* inp, const void* weight,
                      const void* bias, DType t, int64_t N, int64_t C, int64_t OC) override;
  void matmul_backward(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                       const void* weight, DType t, int64_t N, int64_t C, int64_t OC) override;
  void attention_scores(void* preatt, const void* qkv, DType t, int64_t B, int64_t T, int64_t C,
                        int64_t NH) override;
  void attention_softmax(void* att, const void* preatt, DType t, int64_t B, int64_t NH,
                         int64_t T) override;
  void attention_values(void* out, const void* att, const void* qkv, DType t, int64_t B,
                        int64_t T, int64_t C, int64_t NH) override;
  void attention_values_backward(void* datt, void* dqkv, const void* dout, const void* att,
                                 const void* qkv, DType t, int64_t B, int64_t T, int64_t C,
                                 int64_t NH) override;
  void attention_softmax_backward(void* dpreatt, const void* datt, const void* att, DType t,
                                  int64_t B, int64_t NH, int64_t T) override;
  void attention_scores_backward(void* dqkv, const void* dpreatt, const void* qkv, DType t,
                                 int64_t B, int64_t T, int64_t C, int64_t NH) override;
  // LLaMA-family blocks: not on the GPU yet; each throws zp::Error naming the op.
  void rmsnorm_forward(void*, float*, const void*, const void*, float, DType, int64_t, int64_t) override;
  void rmsnorm_backward(void*, void*, const void*, const void*, const void*, const float*, DType,
                        int64_t, int64_t) override;
  void rope_forward(void*, const float*, float, DType, int64_t, int64_t, int64_t, int64_t, int64_t,
                    int64_t) override;
  void rope_backward(void*, const float*, float, DType, int64_t, int64_t, int64_t, int64_t, int64_t,
                     int64_t) override;
  void swiglu_forward(void*, const void*, const void*, DType, int64_t) override;
  void swiglu_backward(void*, const void*, const void*, const void*, DType, int64_t, int64_t) override;
  void gqa_scores(void*, const QkvIn&, DType, int64_t, int64_t, const Heads&) override;
  void gqa_softmax(void*, const void*, DType, int64_t, int64_t, const Heads&) override;
  void gqa_softmax_backward(void*, const void*, const void*, DType, int64_t, int64_t,
                            const Heads&) override;
  void gqa_values(void*, const void*, const QkvIn&, DType, int64_t, int64_t, const Heads&) override;
  void gqa_values_backward(void*, void*, const void*, const void*, const QkvIn&, DType, int64_t,
                           int64_t, const Heads&) override;
  void gqa_scores_backward(void*, const void*, const QkvIn&, DType, int64_t, int64_t,
                           const Heads&) override;
  void flash_attention_forward(void*, float*, const QkvIn&, DType, int64_t, int64_t, const Heads&,
                               float, uint64_t) override;
  void flash_attention_backward(void*, float*, float*, const void*, const QkvIn&, const void*,
                                const float*, DType, int64_t, int64_t, const Heads&, float,
                                uint64_t) override;
  void head_rmsnorm_forward(void*, float*, const QkvIn&, const void*, float, DType, int64_t,
                            const Heads&) override;
  void moe_route_forward(float*, ExpertIdx, float*, const void*, DType, int64_t, int64_t, int64_t,
                         bool) override;
  void moe_route_backward(void*, DType, const float*, const float*, ExpertIdx, const float*,
                          int64_t, int64_t, int64_t, bool) override;
  void moe_route_stats(ExpertIdx, const float*, int64_t, int64_t, int64_t, int64_t*,
                       double*) override;
  void moe_dispatch(void*, const void*, ExpertIdx, DType, int64_t, int64_t, int64_t,
                    int64_t) override;
  void moe_dispatch_backward(void*, const void*, ExpertIdx, DType, int64_t, int64_t, int64_t,
                             int64_t) override;
  void moe_combine(void*, const void*, const float*, ExpertIdx, DType, int64_t, int64_t,
                   int64_t, int64_t) override;
  void moe_combine_backward(void*, float*, const void*, const void*, const float*, ExpertIdx,
                            DType, int64_t, int64_t, int64_t, int64_t) override;
  void gate_mul_forward(void*, const void*, const void*, DType, int64_t, int64_t) override;
  void gate_mul_backward(void*, void*, const void*, const void*, const void*, DType, int64_t,
                         int64_t) override;
  void head_rmsnorm_backward(void*, void*, const QkvIn&, const void*, const float*, DType, int64_t,
                             const Heads&) override;
  void gelu_forward(void* out, const void* inp, DType t, int64_t n) override;
  void gelu_backward(void* dinp, const void* inp, const void* dout, DType t, int64_t n) override;
  void residual_forward(void* out, const void* a, const void* b, DType t, int64_t n) override;
  void dropout_forward(void* out, uint8_t* mask, const void* inp, DType t, float p, uint64_t key,
                       int64_t n) override;
  void dropout_backward(void* dinp, const void* dout, const uint8_t* mask, DType t, float p,
                        int64_t n) override;
  void crossentropy_forward(float* logits, float* losses, const int32_t* targets, int64_t N,
                            int64_t V) override;
  void crossentropy_backward(void* dlogits, DType t, const float* probs, const int32_t* targets,
                             float dloss, int64_t N, int64_t V) override;
  void to_f32(float* dst, const void* src, DType t, int64_t n) override;
  void accumulate_to(void* dst, const float* src, DType t, int64_t n) override;
  void add(void* dst, const void* src, DType t, int64_t n) override;
  void add_f32(float* dst, const void* src, DType t, int64_t n) override;
  double sum(const float* p, int64_t n) override;
  void loss_accumulate(const float* p, int64_t n) override;
  double loss_take() override;
  void upload(void* dst, const void* src, uint64_t bytes) override;
  GradSumSquares grad_sum_squares(const void* grads, DType t, uint64_t n) override;
  void adam_step(const AdamConfig& cfg, const AdamStepArgs& step, const AdamTensors& ts) override;
  void sgd_step(float* master, float* momentum_buf, const void* grads, DType grad_dtype,
                void* param_out, DType param_dtype, float lr, float momentum, float weight_decay,
                float grad_scale, uint64_t n) override;

 private:
  // Small device buffers outside the arena (counted as library overhead by memory_info): the
  // double a reduction lands in, and the flag a bad cross-entropy target sets.
  struct Scratch {
    double sum;
    int64_t bad_target;
    double loss;  // loss_accumulate's running total
  };
  // Mixture-of-experts scratch (device, 20 KiB, made at the first MoE op; outside the arena as
  // Scratch is): the per-expert row offsets the kernels compute for themselves, the count of
  // indices outside [0, E), the load-balancing loss's gradient per expert (uploaded from the
  // engine's host vector) and the probabilities' column sums read back with the offsets.
  struct MoeScratch {
    int64_t offsets[cuda::kMoeMaxExperts + 1];
    int64_t bad;
    float dprob[cuda::kMoeMaxExperts];
    double psum[cuda::kMoeMaxExperts];
  };
  MoeScratch* moe_ = nullptr;
  MoeScratch* moe_scratch();
  // The offsets of idx's pairs into moe_->offsets (device), for the expert-major kernels.
  const int64_t* moe_offsets(ExpertIdx idx, int64_t N, int64_t K, int64_t E);
  // upload's pinned staging: a ring of blocks, each reused once its last copy is done.
  struct Staging {
    void* host = nullptr;  // cudaHostAlloc
    uint64_t capacity = 0;
    cudaEvent_t done = nullptr;
    bool pending = false;
  };
  static constexpr std::size_t kStagingBlocks = 4;  // tokens and targets of two micro-steps
  std::array<Staging, kStagingBlocks> staging_{};
  std::size_t next_staging_ = 0;
  int device_ = 0;
  bool tf32_ = false;
  uint64_t total_bytes_ = 0, free_at_start_bytes_ = 0, arena_bytes_ = 0;
  std::byte* gpu_base_ = nullptr;    // cudaMalloc, the gpu tier
  std::byte* host_base_ = nullptr;   // cudaHostAlloc, the cpu tier
  uint64_t gpu_capacity_ = 0;
  Scratch* scratch_ = nullptr;       // device
  Scratch* readback_ = nullptr;      // pinned host
  std::array<cudaStream_t, kStreams> streams_{};
  std::array<cudaEvent_t, kStreams> events_{};
  // copy_to_device_async: each slot's last copy on the h2d stream, and whether it is unwaited.
  std::array<cudaEvent_t, kCopySlots> copy_events_{};
  std::array<bool, kCopySlots> copy_pending_{};
  double* partials_ = nullptr;       // device, cuda::kSumBlocks doubles: the sums' first pass
  AsyncWatch* watch_ = nullptr;      // NcclComm's, while it lives
  cublasHandle_t blas_ = nullptr;
  // The handle's math mode, set per GEMM by its input type (see gemm); fp32's to start.
  cublasMath_t math_mode_ = CUBLAS_PEDANTIC_MATH;

  cudaStream_t compute() const { return stream(Stream::compute); }
  // A host-memory copy either way, on its stream, ordered after compute; returns once done.
  void copy_across(void* dst, const void* src, uint64_t bytes, Stream s, cudaMemcpyKind kind);
  // Reads scratch_ back (after the compute stream's work) and throws on a bad target.
  Scratch read_scratch();
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
            const void* a, int64_t lda, const void* b, int64_t ldb, float beta, void* c,
            int64_t ldc, DType ab_t, DType c_t, const char* what);
  void set_math_mode(DType ab_t);
  void gemm_batched(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
                    float alpha, const void* a, int64_t lda, int64_t stride_a, const void* b,
                    int64_t ldb, int64_t stride_b, float beta, void* c, int64_t ldc,
                    int64_t stride_c, int64_t batch, DType t, const char* what);
  void release() noexcept;
};

}  // namespace zp::runtime::cuda
