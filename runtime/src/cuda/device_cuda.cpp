// device_cuda.cpp: the CUDA Device: the arenas (one cudaMalloc for the gpu tier, one pinned
// cudaHostAlloc for the cpu tier), four streams ordered by events, copies, cuBLAS SGEMMs for the
// linear layers, the launchers of kernels.cu for the rest, and the check functions behind
// ZP_CUDA_CHECK / ZP_CUBLAS_CHECK. Not NCCL (comm_nccl.cpp) and not the ZeRO logic.
#include "device_cuda.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "cuda_check.hpp"
#include "kernels.hpp"
#include "zp/error.hpp"
#include "zp/runtime/cpu_kernels.hpp"
#include "zp/units.hpp"

namespace zp::runtime {

namespace cuda {

void throw_cuda_error(cudaError_t rc, const char* call, const char* file, int line) {
  cudaGetLastError();  // clear a sticky launch error so the message is about this call
  throw Error(fmt::format("{} failed at {}:{}: {} ({})", call, file, line, cudaGetErrorString(rc),
                          cudaGetErrorName(rc)),
              rc == cudaErrorMemoryAllocation
                  ? "the GPU is out of memory: give a smaller --device-memory, or check nvidia-smi "
                    "for other processes"
                  : "see the CUDA error above; CUDA_LAUNCH_BLOCKING=1 pins it to the failing kernel");
}

void throw_cublas_error(cublasStatus_t rc, const char* call, const char* file, int line) {
  throw Error(fmt::format("{} failed at {}:{}: {} ({})", call, file, line,
                          cublasGetStatusString(rc), cublasGetStatusName(rc)),
              "cuBLAS needs a working GPU and some memory outside the arena for its workspace");
}

namespace {

constexpr const char* kNoDeviceHint = "run on a GPU node or use --device cpu";

// The rank's index among the ranks of its node, as the launcher tells it (Open MPI first).
int local_rank_from_env() {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const char* s = std::getenv(var); s != nullptr && *s != '\0') {
      char* end = nullptr;
      const long v = std::strtol(s, &end, 10);
      if (*end == '\0' && v >= 0 && v <= INT_MAX) return static_cast<int>(v);
    }
  return 0;
}

int blas_dim(int64_t n, const char* what) {
  if (n < 0 || n > INT_MAX)
    throw Error(fmt::format("cuda {}: dimension {} does not fit cuBLAS's 32-bit int", what, n),
                "split the matrix (e.g. fewer tokens per micro-batch)");
  return static_cast<int>(n);
}

}  // namespace

CudaDevice::CudaDevice(const DeviceConfig& cfg, const CudaOptions& opt) : tf32_(opt.tf32) {
  // The host's share of the work (the offloaded CPU Adam, the host-tier paths) uses this rank's
  // cores only: with 8 ranks on a node, each takes an eighth (zero-run's n_threads), as the cpu
  // backend does; 0 leaves OpenMP's and OpenBLAS's defaults.
  if (cfg.n_threads > 0) cpu::set_threads(cfg.n_threads);
  const CudaAvailability avail = cuda_devices();
  if (avail.n_devices == 0) throw Error("no CUDA device visible: " + avail.reason, kNoDeviceHint);
  device_ = opt.device_index >= 0
                ? opt.device_index
                : (opt.local_rank >= 0 ? opt.local_rank : local_rank_from_env()) % avail.n_devices;
  if (device_ >= avail.n_devices)
    throw Error(fmt::format("CUDA device {} asked for, {} visible", device_, avail.n_devices),
                "one rank per GPU: run at most as many ranks per node as GPUs, or set "
                "CUDA_VISIBLE_DEVICES");
  try {
    ZP_CUDA_CHECK(cudaSetDevice(device_));
    ZP_CUDA_CHECK(cudaFree(nullptr));  // creates the primary context now, before measuring
    std::size_t free_b = 0, total_b = 0;
    ZP_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    free_at_start_bytes_ = free_b;
    total_bytes_ = total_b;
    if (cfg.gpu_bytes > 0) {
      void* p = nullptr;
      const cudaError_t rc = cudaMalloc(&p, cfg.gpu_bytes);
      if (rc == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        throw Error(fmt::format("cannot reserve {} for the device arena on GPU {}: {} free of {}",
                                format_bytes(cfg.gpu_bytes), device_, format_bytes(free_b),
                                format_bytes(total_b)),
                    "ask for less (--device-memory), or plan a smaller footprint");
      }
      ZP_CUDA_CHECK(rc);
      gpu_base_ = static_cast<std::byte*>(p);
      gpu_capacity_ = arena_bytes_ = cfg.gpu_bytes;
    }
    if (cfg.cpu_bytes > 0) {
      void* p = nullptr;
      const cudaError_t rc = cudaHostAlloc(&p, cfg.cpu_bytes, cudaHostAllocDefault);
      if (rc == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        throw Error(fmt::format("cannot pin {} of host memory for the host arena",
                                format_bytes(cfg.cpu_bytes)),
                    "ask for less (--host-memory): pinned host memory cannot be paged out, and "
                    "the machine (or its container) may allow less of it than it has");
      }
      ZP_CUDA_CHECK(rc);
      host_base_ = static_cast<std::byte*>(p);
    }
    ZP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scratch_), sizeof(Scratch)));
    ZP_CUDA_CHECK(cudaMemset(scratch_, 0, sizeof(Scratch)));
    ZP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&readback_), sizeof(Scratch), cudaHostAllocDefault));
    ZP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&partials_), cuda::kSumBlocks * sizeof(double)));
    for (std::size_t i = 0; i < kStreams; ++i) {
      ZP_CUDA_CHECK(cudaStreamCreateWithFlags(&streams_[i], cudaStreamNonBlocking));
      ZP_CUDA_CHECK(cudaEventCreateWithFlags(&events_[i], cudaEventDisableTiming));
    }
    for (cudaEvent_t& e : copy_events_)
      ZP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    ZP_CUBLAS_CHECK(cublasCreate(&blas_));
    ZP_CUBLAS_CHECK(cublasSetStream(blas_, compute()));
    // Pedantic: fp32 products and sums throughout (no TF32, no reduced-precision reductions).
    math_mode_ = tf32_ ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_PEDANTIC_MATH;
    ZP_CUBLAS_CHECK(cublasSetMathMode(blas_, math_mode_));
    ZP_CUDA_CHECK(cudaDeviceSynchronize());  // setup only: the memsets are done
  } catch (...) {
    release();
    throw;
  }
  arenas_[static_cast<std::size_t>(Tier::gpu)] = std::make_unique<Arena>(Tier::gpu, gpu_base_, cfg.gpu_bytes);
  arenas_[static_cast<std::size_t>(Tier::cpu)] = std::make_unique<Arena>(Tier::cpu, host_base_, cfg.cpu_bytes);
  // The nvme tier is an address space for swap files (no memory behind it), as on the cpu.
  arenas_[static_cast<std::size_t>(Tier::nvme)] = std::make_unique<Arena>(Tier::nvme, nullptr, cfg.nvme_bytes);
}

CudaDevice::~CudaDevice() {
  for (cudaStream_t s : streams_)
    if (s != nullptr) cudaStreamSynchronize(s);
  release();
}

void CudaDevice::release() noexcept {
  if (blas_ != nullptr) cublasDestroy(blas_);
  for (cudaEvent_t& e : events_)
    if (e != nullptr) cudaEventDestroy(std::exchange(e, nullptr));
  for (cudaEvent_t& e : copy_events_)
    if (e != nullptr) cudaEventDestroy(std::exchange(e, nullptr));
  for (cudaStream_t& s : streams_)
    if (s != nullptr) cudaStreamDestroy(std::exchange(s, nullptr));
  for (Staging& b : staging_) {
    if (b.done != nullptr) cudaEventDestroy(std::exchange(b.done, nullptr));
    if (b.host != nullptr) cudaFreeHost(std::exchange(b.host, nullptr));
    b.capacity = 0;
    b.pending = false;
  }
  if (readback_ != nullptr) cudaFreeHost(readback_);
  if (scratch_ != nullptr) cudaFree(scratch_);
  if (partials_ != nullptr) cudaFree(std::exchange(partials_, nullptr));
  if (moe_ != nullptr) cudaFree(std::exchange(moe_, nullptr));
  if (host_base_ != nullptr) cudaFreeHost(host_base_);
  if (gpu_base_ != nullptr) cudaFree(gpu_base_);
  blas_ = nullptr;
  readback_ = scratch_ = nullptr;
  host_base_ = gpu_base_ = nullptr;
  cudaGetLastError();
}

namespace {
// Waits for a stream's or an event's work: a plain synchronize without a watch, else polls
// (query(x) answers cudaErrorNotReady until done), asking the watch between polls.
template <class X>
void wait_for(X x, AsyncWatch* watch, cudaError_t (*sync)(X), cudaError_t (*query)(X),
              const char* sync_name) {
  if (watch == nullptr) {
    if (const cudaError_t rc = sync(x); rc != cudaSuccess) throw_cuda_error(rc, sync_name, __FILE__, __LINE__);
    return;
  }
  wait_until([&] {
    const cudaError_t rc = query(x);
    if (rc == cudaErrorNotReady) return false;
    if (rc != cudaSuccess) throw_cuda_error(rc, "query while waiting", __FILE__, __LINE__);
    return true;
  }, watch);
}
}  // namespace

void CudaDevice::host_wait(cudaStream_t s) {
  wait_for<cudaStream_t>(s, watch_, cudaStreamSynchronize, cudaStreamQuery, "cudaStreamSynchronize");
}

void CudaDevice::host_wait(cudaEvent_t e) {
  wait_for<cudaEvent_t>(e, watch_, cudaEventSynchronize, cudaEventQuery, "cudaEventSynchronize");
}

void CudaDevice::order(Stream waiter, Stream signaller) {
  if (waiter == signaller) return;
  cudaEvent_t e = events_[static_cast<std::size_t>(signaller)];
  ZP_CUDA_CHECK(cudaEventRecord(e, stream(signaller)));
  ZP_CUDA_CHECK(cudaStreamWaitEvent(stream(waiter), e, 0));
}

bool CudaDevice::on_device(const void* p) const {
  if (p == nullptr) return false;
  const auto* b = static_cast<const std::byte*>(p);
  if (gpu_base_ != nullptr && b >= gpu_base_ && b < gpu_base_ + gpu_capacity_) return true;
  if (scratch_ != nullptr && p == static_cast<const void*>(scratch_)) return true;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

CudaMemoryInfo CudaDevice::memory_info() const {
  std::size_t free_b = 0, total_b = 0;
  ZP_CUDA_CHECK(cudaSetDevice(device_));
  ZP_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  int major = 0;
  ZP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_));
  return {.total_bytes = total_bytes_, .free_at_start_bytes = free_at_start_bytes_,
          .free_now_bytes = free_b, .arena_bytes = arena_bytes_, .compute_capability_major = major};
}

// ---- memory ----------------------------------------------------------------------------------

void CudaDevice::zero(void* p, uint64_t bytes) {
  if (bytes == 0) return;
  if (on_device(p)) ZP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, compute()));
  else std::memset(p, 0, bytes);
}

// Copies touching host memory return only once complete: the caller may reuse or read its
// host buffer at once, as with the cpu backend. They run on their own stream after the
// compute stream's earlier work (which may still write the source or read the destination);
// later compute work is enqueued after the host wait, so it is ordered after the copy.
void CudaDevice::copy_across(void* dst, const void* src, uint64_t bytes, Stream s,
                             cudaMemcpyKind kind) {
  order(s, Stream::compute);
  ZP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream(s)));
  host_wait(stream(s));
}

void CudaDevice::copy(void* dst, const void* src, uint64_t bytes) {
  if (bytes == 0) return;
  const bool dst_dev = on_device(dst), src_dev = on_device(src);
  if (dst_dev && src_dev)
    ZP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, compute()));
  else if (dst_dev)
    copy_across(dst, src, bytes, Stream::h2d, cudaMemcpyHostToDevice);
  else if (src_dev)
    copy_across(dst, src, bytes, Stream::d2h, cudaMemcpyDeviceToHost);
  else
    std::memmove(dst, src, bytes);
}

// The double-buffered parameter tiles: the copy is queued on the h2d stream (after the
// compute stream's earlier work, which may still read the destination) and its slot's event
// recorded behind it; the host returns at once and fills the other tile meanwhile. Pinned
// source memory (the cpu tier is cudaHostAlloc'd) is what makes cudaMemcpyAsync truly
// asynchronous with respect to the host. The destination is in the host tier too under
// offload_param cpu (the parameters live there): cudaMemcpyDefault lets the runtime take the
// direction from the pointers (unified addressing) instead of claiming HostToDevice for a
// host-to-host copy, which the API leaves undefined; the ordering is the same either way.
void CudaDevice::copy_to_device_async(void* dst, const void* src, uint64_t bytes, int slot) {
  check_copy_slot(slot);
  if (bytes == 0) return;
  order(Stream::h2d, Stream::compute);
  ZP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream(Stream::h2d)));
  const auto i = static_cast<std::size_t>(slot);
  ZP_CUDA_CHECK(cudaEventRecord(copy_events_[i], stream(Stream::h2d)));
  copy_pending_[i] = true;
}

// The host blocks on the slot's event only (the tile may then be rewritten or freed); the
// compute stream waits for it on the GPU, so later kernels and, through the compute stream,
// collectives see the new parameters. No device-wide synchronisation.
void CudaDevice::wait_copy(int slot) {
  check_copy_slot(slot);
  const auto i = static_cast<std::size_t>(slot);
  if (!copy_pending_[i]) return;
  host_wait(copy_events_[i]);
  ZP_CUDA_CHECK(cudaStreamWaitEvent(compute(), copy_events_[i], 0));
  copy_pending_[i] = false;
}

CudaDevice::Scratch CudaDevice::read_scratch() {
  ZP_CUDA_CHECK(cudaMemcpyAsync(readback_, scratch_, sizeof(Scratch), cudaMemcpyDeviceToHost, compute()));
  host_wait(compute());
  const Scratch s = *readback_;
  if (s.bad_target != 0) {
    ZP_CUDA_CHECK(cudaMemsetAsync(&scratch_->bad_target, 0, sizeof(int64_t), compute()));
    throw Error(fmt::format("cuda crossentropy: the target at row {} is outside the vocabulary",
                            s.bad_target - 1),
                "targets must be token ids below the vocabulary size");
  }
  return s;
}

void CudaDevice::synchronize() {
  for (cudaStream_t s : streams_) host_wait(s);
  copy_pending_.fill(false);  // the h2d stream is drained: every slot's copy is done
  read_scratch();
}

double CudaDevice::sum(const float* p, int64_t n) {
  cuda::sum(compute(), &scratch_->sum, partials_, p, n);
  return read_scratch().sum;
}

void CudaDevice::loss_accumulate(const float* p, int64_t n) {
  cuda::sum(compute(), &scratch_->loss, partials_, p, n, /*accumulate=*/true);
}

double CudaDevice::loss_take() {
  const double loss = read_scratch().loss;
  ZP_CUDA_CHECK(cudaMemsetAsync(&scratch_->loss, 0, sizeof(double), compute()));
  return loss;
}

// The host's bytes go into a pinned block of the ring (once that block's previous copy is
// done, normally long since), and from there to dst on the compute stream: ordered among the
// kernels, with no host wait for them. A block grows (cudaHostAlloc) to the largest upload.
void CudaDevice::upload(void* dst, const void* src, uint64_t bytes) {
  if (bytes == 0) return;
  if (!on_device(dst)) {  // host memory the compute stream may still use: wait, then copy
    host_wait(compute());
    std::memmove(dst, src, bytes);
    return;
  }
  Staging& b = staging_[next_staging_];
  next_staging_ = (next_staging_ + 1) % kStagingBlocks;
  if (b.pending) host_wait(b.done);
  b.pending = false;
  if (b.capacity < bytes) {
    if (b.host != nullptr) ZP_CUDA_CHECK(cudaFreeHost(std::exchange(b.host, nullptr)));
    b.capacity = 0;
    ZP_CUDA_CHECK(cudaHostAlloc(&b.host, bytes, cudaHostAllocDefault));
    b.capacity = bytes;
  }
  if (b.done == nullptr) ZP_CUDA_CHECK(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming));
  std::memcpy(b.host, src, bytes);
  ZP_CUDA_CHECK(cudaMemcpyAsync(dst, b.host, bytes, cudaMemcpyHostToDevice, compute()));
  ZP_CUDA_CHECK(cudaEventRecord(b.done, compute()));
  b.pending = true;
}

// ---- GEMMs: row-major out = inp @ W^T as column-major out^T = W^T... (see each call) --------

namespace {
cudaDataType_t cuda_type(DType t) {
  return t == DType::fp32 ? CUDA_R_32F : (t == DType::fp16 ? CUDA_R_16F : CUDA_R_16BF);
}
}  // namespace

// C (ldc, stored as c_t) = op(A) op(B) + beta C, A and B stored as ab_t, summed in fp32
// (CUBLAS_COMPUTE_32F; cublasGemmEx takes 16-bit A and B with a 16-bit or fp32 C). The math
// mode follows the inputs: fp32 keeps fp32 products and sums (CUBLAS_PEDANTIC_MATH; TF32 only
// with CudaOptions::tf32); 16-bit inputs run on tensor cores (CUBLAS_DEFAULT_MATH) with
// CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION, which keeps split-K partial sums in the
// compute type rather than the 16-bit output type (cuBLAS documentation, cublasMath_t;
// PyTorch sets it too unless allow_bf16/fp16_reduced_precision_reduction): one rounding per
// output element, as the cpu backend's panels.
void CudaDevice::set_math_mode(DType ab_t) {
  const cublasMath_t mode =
      ab_t == DType::fp32
          ? (tf32_ ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_PEDANTIC_MATH)
          : static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
  if (mode != math_mode_) {
    ZP_CUBLAS_CHECK(cublasSetMathMode(blas_, mode));
    math_mode_ = mode;
  }
}

void CudaDevice::gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
                      const void* a, int64_t lda, const void* b, int64_t ldb, float beta, void* c,
                      int64_t ldc, DType ab_t, DType c_t, const char* what) {
  set_math_mode(ab_t);
  const float alpha = 1.0f;
  ZP_CUBLAS_CHECK(cublasGemmEx(blas_, ta, tb, blas_dim(m, what), blas_dim(n, what), blas_dim(k, what),
                               &alpha, a, cuda_type(ab_t), blas_dim(lda, what), b, cuda_type(ab_t),
                               blas_dim(ldb, what), &beta, c, cuda_type(c_t), blas_dim(ldc, what),
                               ab_t == DType::fp32 && tf32_ ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                            : CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT));
}

// `batch` products at once, matrix i of each operand `stride_*` elements after matrix i - 1
// (cublasGemmStridedBatchedEx): c = alpha a b + beta c, in fp32, one rounding into c's type.
void CudaDevice::gemm_batched(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n,
                              int64_t k, float alpha, const void* a, int64_t lda, int64_t stride_a,
                              const void* b, int64_t ldb, int64_t stride_b, float beta, void* c,
                              int64_t ldc, int64_t stride_c, int64_t batch, DType t,
                              const char* what) {
  set_math_mode(t);
  ZP_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      blas_, ta, tb, blas_dim(m, what), blas_dim(n, what), blas_dim(k, what), &alpha, a,
      cuda_type(t), blas_dim(lda, what), stride_a, b, cuda_type(t), blas_dim(ldb, what), stride_b,
      &beta, c, cuda_type(t), blas_dim(ldc, what), stride_c, blas_dim(batch, what),
      t == DType::fp32 && tf32_ ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT));
}

// A row-major (R, K) matrix is a column-major (K, R) one with leading dimension K, so every
// row-major product X = P @ Q becomes the column-major X^T = Q^T P^T.
void CudaDevice::matmul_forward(void* out, DType out_t, const void* inp, const void* weight,
                                const void* bias, DType t, int64_t N, int64_t C, int64_t OC) {
  if (out_t != t && !(out_t == DType::fp32 && t != DType::fp32))
    throw Error(fmt::format("cuda matmul_forward: {} inputs with a {} output", to_string(t),
                            to_string(out_t)),
                "the output is stored as the inputs, or as fp32");
  if (N == 0 || OC == 0) return;
  float beta = 0.0f;
  if (bias != nullptr) {
    cuda::broadcast_rows(compute(), out, out_t, bias, t, N, OC);
    beta = 1.0f;
  }
  // out^T (OC,N) = W (OC,C) [col-major (C,OC), transposed] @ inp^T (C,N) [col-major (C,N)]
  // For the LM head OC is the vocabulary, 50257 for GPT-2: an odd leading dimension, on which
  // cuBLAS takes its unaligned kernels (cutlass ..._align1: 21 ms of a 562 ms profiled gpt2
  // step at B=8, ncu 2026-11-27; review finding 11). Padding the vocabulary to a multiple of
  // 64 (llm.c's 50304) would change the graph, the planner's bytes and the parameter count
  // together; not done here.
  gemm(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, C, inp, C, beta, out, OC, t, out_t,
       "matmul_forward");
}

void CudaDevice::matmul_backward(void* dinp, void* dweight, void* dbias, const void* dout,
                                 const void* inp, const void* weight, DType t, int64_t N,
                                 int64_t C, int64_t OC) {
  if (N == 0 || OC == 0 || C == 0) return;
  // dinp (N,C) += dout (N,OC) @ W (OC,C):  dinp^T (C,N) += W^T (C,OC) @ dout^T (OC,N)
  gemm(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight, C, dout, OC, 1.0f, dinp, C, t, t,
       "matmul_backward dinp");
  // dweight (OC,C) += dout^T (OC,N) @ inp (N,C):  dweight^T (C,OC) += inp^T (C,N) @ dout (N,OC)
  gemm(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, inp, C, dout, OC, 1.0f, dweight, C, t, t,
       "matmul_backward dweight");
  if (dbias != nullptr) cuda::column_sums_add(compute(), dbias, dout, t, N, OC);
}

// ---- the other ops: kernels.cu on the compute stream ------------------------------------------

void CudaDevice::embedding_forward(void* out, const int32_t* tokens, const void* wte,
                                   const void* wpe, DType t, int64_t B, int64_t T, int64_t C) {
  cuda::embedding_forward(compute(), out, tokens, wte, wpe, t, B, T, C);
}
void CudaDevice::embedding_backward(void* dwte, void* dwpe, const void* dout,
                                    const int32_t* tokens, DType t, int64_t B, int64_t T,
                                    int64_t C) {
  cuda::embedding_backward(compute(), dwte, dwpe, dout, tokens, t, B, T, C);
}
void CudaDevice::layernorm_forward(void* out, float* stats, const void* inp, const void* weight,
                                   const void* bias, DType t, int64_t N, int64_t C) {
  cuda::layernorm_forward(compute(), out, stats, inp, weight, bias, t, N, C);
}
void CudaDevice::layernorm_backward(void* dinp, void* dweight, void* dbias, const void* dout,
                                    const void* inp, const void* weight, const float* stats,
                                    DType t, int64_t N, int64_t C) {
  cuda::layernorm_backward(compute(), dinp, dweight, dbias, dout, inp, weight, stats, t, N, C);
}
// ---- attention's products on cuBLAS: one strided-batched GEMM per sequence over its heads --
// Row-major (T, HS) head slices of qkv (row stride 3C), of out/dout (row stride C) and the
// (T, T) score matrices, as column-major operands (see matmul_forward). The score products
// (attention_scores, datt) fill whole T x T matrices, above the diagonal too (unspecified
// there: softmax and its backward read only t2 <= t); the products over t2 read att and
// dpreatt whole, which softmax and its backward leave zero above the diagonal. The summation
// order is cuBLAS's, not the cpu loops' (kReorder / one rounding in test_cuda_ops).
namespace {
int64_t head_size(int64_t C, int64_t NH) {
  if (NH <= 0 || C % NH != 0)
    throw Error(fmt::format("cuda attention: C = {} is not a multiple of NH = {}", C, NH),
                "the model's n_embd must divide evenly into n_head heads");
  return C / NH;
}
}  // namespace

void CudaDevice::attention_scores(void* preatt, const void* qkv, DType t, int64_t B, int64_t T,
                                  int64_t C, int64_t NH) {
  if (B * T * C == 0) return;
  const int64_t HS = head_size(C, NH), eb = static_cast<int64_t>(dtype_bytes(t));
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  for (int64_t b = 0; b < B; ++b) {
    const auto* q = static_cast<const std::byte*>(qkv) + b * T * 3 * C * eb;
    // S (T,T) = Q K^T * scale:  S^T = K Q^T  [K: col-major (HS,T), transposed]
    gemm_batched(CUBLAS_OP_T, CUBLAS_OP_N, T, T, HS, scale, q + C * eb, 3 * C, HS, q, 3 * C, HS,
                 0.0f, static_cast<std::byte*>(preatt) + b * NH * T * T * eb, T, T * T, NH, t,
                 "attention_scores");
  }
}
void CudaDevice::attention_softmax(void* att, const void* preatt, DType t, int64_t B, int64_t NH,
                                   int64_t T) {
  cuda::attention_softmax(compute(), att, preatt, t, B, NH, T);
}
void CudaDevice::attention_values(void* out, const void* att, const void* qkv, DType t, int64_t B,
                                  int64_t T, int64_t C, int64_t NH) {
  if (B * T * C == 0) return;
  const int64_t HS = head_size(C, NH), eb = static_cast<int64_t>(dtype_bytes(t));
  for (int64_t b = 0; b < B; ++b) {
    const auto* v = static_cast<const std::byte*>(qkv) + (b * T * 3 * C + 2 * C) * eb;
    // O (T,HS) = A (T,T) V (T,HS):  O^T = V^T A^T
    gemm_batched(CUBLAS_OP_N, CUBLAS_OP_N, HS, T, T, 1.0f, v, 3 * C, HS,
                 static_cast<const std::byte*>(att) + b * NH * T * T * eb, T, T * T, 0.0f,
                 static_cast<std::byte*>(out) + b * T * C * eb, C, HS, NH, t, "attention_values");
  }
}
void CudaDevice::attention_values_backward(void* datt, void* dqkv, const void* dout,
                                           const void* att, const void* qkv, DType t, int64_t B,
                                           int64_t T, int64_t C, int64_t NH) {
  if (B * T * C == 0) return;
  const int64_t HS = head_size(C, NH), eb = static_cast<int64_t>(dtype_bytes(t));
  for (int64_t b = 0; b < B; ++b) {
    const auto* v = static_cast<const std::byte*>(qkv) + (b * T * 3 * C + 2 * C) * eb;
    auto* dv = static_cast<std::byte*>(dqkv) + (b * T * 3 * C + 2 * C) * eb;
    const auto* g = static_cast<const std::byte*>(dout) + b * T * C * eb;
    const auto* a = static_cast<const std::byte*>(att) + b * NH * T * T * eb;
    // dA (T,T) += dO V^T:  dA^T += V dO^T  [V: col-major (HS,T), transposed]
    gemm_batched(CUBLAS_OP_T, CUBLAS_OP_N, T, T, HS, 1.0f, v, 3 * C, HS, g, C, HS, 1.0f,
                 static_cast<std::byte*>(datt) + b * NH * T * T * eb, T, T * T, NH, t,
                 "attention_values_backward datt");
    // dV (T,HS) += A^T dO:  dV^T += dO^T A  [A: col-major (T,T) = A^T, transposed back]
    gemm_batched(CUBLAS_OP_N, CUBLAS_OP_T, HS, T, T, 1.0f, g, C, HS, a, T, T * T, 1.0f, dv, 3 * C,
                 HS, NH, t, "attention_values_backward dv");
  }
}
void CudaDevice::attention_softmax_backward(void* dpreatt, const void* datt, const void* att,
                                            DType t, int64_t B, int64_t NH, int64_t T) {
  cuda::attention_softmax_backward(compute(), dpreatt, datt, att, t, B, NH, T);
}
void CudaDevice::attention_scores_backward(void* dqkv, const void* dpreatt, const void* qkv,
                                           DType t, int64_t B, int64_t T, int64_t C, int64_t NH) {
  if (B * T * C == 0) return;
  const int64_t HS = head_size(C, NH), eb = static_cast<int64_t>(dtype_bytes(t));
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  for (int64_t b = 0; b < B; ++b) {
    const auto* q = static_cast<const std::byte*>(qkv) + b * T * 3 * C * eb;
    auto* dq = static_cast<std::byte*>(dqkv) + b * T * 3 * C * eb;
    const auto* d = static_cast<const std::byte*>(dpreatt) + b * NH * T * T * eb;
    // dQ (T,HS) += dS K * scale:  dQ^T += K^T dS^T
    gemm_batched(CUBLAS_OP_N, CUBLAS_OP_N, HS, T, T, scale, q + C * eb, 3 * C, HS, d, T, T * T,
                 1.0f, dq, 3 * C, HS, NH, t, "attention_scores_backward dq");
    // dK (T,HS) += dS^T Q * scale:  dK^T += Q^T dS  [dS: col-major (T,T) = dS^T, transposed]
    gemm_batched(CUBLAS_OP_N, CUBLAS_OP_T, HS, T, T, scale, q, 3 * C, HS, d, T, T * T, 1.0f,
                 dq + C * eb, 3 * C, HS, NH, t, "attention_scores_backward dk");
  }
}
void CudaDevice::gelu_forward(void* out, const void* inp, DType t, int64_t n) {
  cuda::gelu_forward(compute(), out, inp, t, n);
}
void CudaDevice::gelu_backward(void* dinp, const void* inp, const void* dout, DType t, int64_t n) {
  cuda::gelu_backward(compute(), dinp, inp, dout, t, n);
}
void CudaDevice::residual_forward(void* out, const void* a, const void* b, DType t, int64_t n) {
  cuda::residual_forward(compute(), out, a, b, t, n);
}
void CudaDevice::dropout_forward(void* out, uint8_t* mask, const void* inp, DType t, float p,
                                 uint64_t key, int64_t n) {
  cuda::dropout_forward(compute(), out, mask, inp, t, p, key, n);
}
void CudaDevice::dropout_backward(void* dinp, const void* dout, const uint8_t* mask, DType t,
                                  float p, int64_t n) {
  cuda::dropout_backward(compute(), dinp, dout, mask, t, p, n);
}
void CudaDevice::crossentropy_forward(float* logits, float* losses, const int32_t* targets,
                                      int64_t N, int64_t V) {
  cuda::crossentropy_forward(compute(), logits, losses, targets, N, V, &scratch_->bad_target);
}
void CudaDevice::crossentropy_backward(void* dlogits, DType t, const float* probs,
                                       const int32_t* targets, float dloss, int64_t N, int64_t V) {
  if (t != DType::fp32 && static_cast<const void*>(dlogits) == static_cast<const void*>(probs))
    throw Error("cuda crossentropy_backward: a 16-bit gradient cannot replace fp32 probabilities in place",
                "give the gradient its own buffer (the 16-bit graph's logits.d)");
  cuda::crossentropy_backward(compute(), dlogits, t, probs, targets, dloss, N, V,
                              &scratch_->bad_target);
}
void CudaDevice::to_f32(float* dst, const void* src, DType t, int64_t n) {
  cuda::to_f32(compute(), dst, src, t, n);
}
void CudaDevice::accumulate_to(void* dst, const float* src, DType t, int64_t n) {
  cuda::accumulate_to(compute(), dst, src, t, n);
}
void CudaDevice::add(void* dst, const void* src, DType t, int64_t n) {
  cuda::add(compute(), dst, src, t, n);
}
// The host fp32 partition of an offloaded optimizer (pinned, device-addressable) gains a
// reduced device segment; a host source is added on the host after the stream drains.
void CudaDevice::add_f32(float* dst, const void* src, DType t, int64_t n) {
  if (on_device(src)) {
    cuda::add_f32(compute(), dst, src, t, n);
    return;
  }
  host_wait(compute());
  for (int64_t i = 0; i < n; ++i) dst[i] += load_as_f32(src, static_cast<std::size_t>(i), t);
}

// ---- LLaMA-family blocks: kernels_llama.cu, and grouped-query attention on cuBLAS ----------

namespace {
cuda::QkvRows rows_of(const Device::QkvIn& in) {
  return {in.q, in.k, in.v, in.q_row, in.k_row, in.v_row};
}
cuda::AttnDims dims_of(int64_t B, int64_t T, const Device::Heads& h) {
  return {B, T, h.NH, h.KVH, h.HS, h.window};
}
void check_gqa(const Device::QkvIn& in, const Device::Heads& h, const char* what) {
  if (h.NH <= 0 || h.KVH <= 0 || h.HS <= 0 || h.NH % h.KVH != 0 || h.window < 0 ||
      in.q_row < h.NH * h.HS || in.k_row < h.KVH * h.HS || in.v_row < h.KVH * h.HS)
    throw Error(fmt::format("cuda {}: {} query heads, {} key/value heads of {}, rows of {}, {}, {}",
                            what, h.NH, h.KVH, h.HS, in.q_row, in.k_row, in.v_row),
                "the query heads must be a positive multiple of the key/value heads, and each row "
                "must hold all of its heads");
}
}  // namespace

void CudaDevice::rmsnorm_forward(void* out, float* stats, const void* inp, const void* weight,
                                 float eps, DType t, int64_t N, int64_t C) {
  cuda::rmsnorm_forward(compute(), out, stats, inp, weight, eps, t, N, C);
}
void CudaDevice::rmsnorm_backward(void* dinp, void* dweight, const void* dout, const void* inp,
                                  const void* weight, const float* stats, DType t, int64_t N,
                                  int64_t C) {
  cuda::rmsnorm_backward(compute(), dinp, dweight, dout, inp, weight, stats, t, N, C);
}
void CudaDevice::rope_forward(void* x, const float* inv_freq, float mscale, DType t, int64_t B,
                              int64_t T, int64_t row, int64_t n_heads, int64_t HS, int64_t rot) {
  cuda::rope(compute(), true, x, inv_freq, mscale, t, B, T, row, n_heads, HS, rot);
}
void CudaDevice::rope_backward(void* dx, const float* inv_freq, float mscale, DType t, int64_t B,
                               int64_t T, int64_t row, int64_t n_heads, int64_t HS, int64_t rot) {
  cuda::rope(compute(), false, dx, inv_freq, mscale, t, B, T, row, n_heads, HS, rot);
}
void CudaDevice::swiglu_forward(void* out, const void* gate, const void* up, DType t, int64_t n) {
  cuda::swiglu_forward(compute(), out, gate, up, t, n);
}
void CudaDevice::swiglu_backward(void* dgate_up, const void* dout, const void* gate, const void* up,
                                 DType t, int64_t N, int64_t F) {
  cuda::swiglu_backward(compute(), dgate_up, dout, gate, up, t, N, F);
}

// Grouped-query attention's products, as attention_scores & co. above, with query head h
// reading key/value head h / G (G = NH / KVH): per sequence and key/value head, one
// strided-batched GEMM over the group's G query heads whose key (or value) operand has stride 0,
// so the group shares it without a copy. The gradients of a shared key/value head are sums over
// the group's query heads: G GEMMs in head order, each adding into it (beta = 1), so a 16-bit
// dk or dv is rounded G times where the cpu rounds the fp32 sum once (the heads' operands are
// not one strided matrix, so one GEMM cannot sum them; test_cuda_ops bounds it by G roundings). The score
// products fill whole T x T matrices (unspecified outside each row's keys: the softmax and its
// backward read only first_key(t)..t and write zeros elsewhere).
void CudaDevice::gqa_scores(void* preatt, const QkvIn& in, DType t, int64_t B, int64_t T,
                            const Heads& h) {
  check_gqa(in, h, "gqa_scores");
  if (B * T == 0) return;
  const int64_t G = h.NH / h.KVH, HS = h.HS, eb = static_cast<int64_t>(dtype_bytes(t));
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kv = 0; kv < h.KVH; ++kv) {
      const auto* q = static_cast<const std::byte*>(in.q) + (b * T * in.q_row + kv * G * HS) * eb;
      const auto* k = static_cast<const std::byte*>(in.k) + (b * T * in.k_row + kv * HS) * eb;
      // S_h (T,T) = Q_h K^T * scale:  S^T = K Q^T  [K: col-major (HS,T), transposed]
      gemm_batched(CUBLAS_OP_T, CUBLAS_OP_N, T, T, HS, scale, k, in.k_row, 0, q, in.q_row, HS, 0.0f,
                   static_cast<std::byte*>(preatt) + (b * h.NH + kv * G) * T * T * eb, T, T * T, G, t,
                   "gqa_scores");
    }
}
void CudaDevice::gqa_softmax(void* att, const void* preatt, DType t, int64_t B, int64_t T,
                             const Heads& h) {
  cuda::attention_softmax(compute(), att, preatt, t, B, h.NH, T, h.window);
}
void CudaDevice::gqa_softmax_backward(void* dpreatt, const void* datt, const void* att, DType t,
                                      int64_t B, int64_t T, const Heads& h) {
  cuda::attention_softmax_backward(compute(), dpreatt, datt, att, t, B, h.NH, T, h.window);
}
void CudaDevice::gqa_values(void* out, const void* att, const QkvIn& in, DType t, int64_t B,
                            int64_t T, const Heads& h) {
  check_gqa(in, h, "gqa_values");
  if (B * T == 0) return;
  const int64_t G = h.NH / h.KVH, HS = h.HS, O = h.NH * HS, eb = static_cast<int64_t>(dtype_bytes(t));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kv = 0; kv < h.KVH; ++kv) {
      const auto* v = static_cast<const std::byte*>(in.v) + (b * T * in.v_row + kv * HS) * eb;
      // O_h (T,HS) = A_h (T,T) V (T,HS):  O^T = V^T A^T
      gemm_batched(CUBLAS_OP_N, CUBLAS_OP_N, HS, T, T, 1.0f, v, in.v_row, 0,
                   static_cast<const std::byte*>(att) + (b * h.NH + kv * G) * T * T * eb, T, T * T,
                   0.0f, static_cast<std::byte*>(out) + (b * T * O + kv * G * HS) * eb, O, HS, G, t,
                   "gqa_values");
    }
}
void CudaDevice::gqa_values_backward(void* datt, void* dqkv, const void* dout, const void* att,
                                     const QkvIn& in, DType t, int64_t B, int64_t T,
                                     const Heads& h) {
  check_gqa(in, h, "gqa_values_backward");
  if (B * T == 0) return;
  const int64_t G = h.NH / h.KVH, HS = h.HS, O = h.NH * HS, R = (h.NH + 2 * h.KVH) * HS;
  const int64_t eb = static_cast<int64_t>(dtype_bytes(t));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kv = 0; kv < h.KVH; ++kv) {
      const auto* v = static_cast<const std::byte*>(in.v) + (b * T * in.v_row + kv * HS) * eb;
      const auto* g = static_cast<const std::byte*>(dout) + (b * T * O + kv * G * HS) * eb;
      // dA_h (T,T) += dO_h V^T:  dA^T += V dO^T  [V: col-major (HS,T), transposed]
      gemm_batched(CUBLAS_OP_T, CUBLAS_OP_N, T, T, HS, 1.0f, v, in.v_row, 0, g, O, HS, 1.0f,
                   static_cast<std::byte*>(datt) + (b * h.NH + kv * G) * T * T * eb, T, T * T, G, t,
                   "gqa_values_backward datt");
      // dV (T,HS) += A_h^T dO_h over the group's heads in order:  dV^T += dO_h^T A_h
      auto* dv = static_cast<std::byte*>(dqkv) + (b * T * R + (h.NH + h.KVH) * HS + kv * HS) * eb;
      for (int64_t j = 0; j < G; ++j)
        gemm_batched(CUBLAS_OP_N, CUBLAS_OP_T, HS, T, T, 1.0f, g + j * HS * eb, O, HS,
                     static_cast<const std::byte*>(att) + (b * h.NH + kv * G + j) * T * T * eb, T,
                     T * T, 1.0f, dv, R, HS, 1, t, "gqa_values_backward dv");
    }
}
void CudaDevice::gqa_scores_backward(void* dqkv, const void* dpreatt, const QkvIn& in, DType t,
                                     int64_t B, int64_t T, const Heads& h) {
  check_gqa(in, h, "gqa_scores_backward");
  if (B * T == 0) return;
  const int64_t G = h.NH / h.KVH, HS = h.HS, R = (h.NH + 2 * h.KVH) * HS;
  const int64_t eb = static_cast<int64_t>(dtype_bytes(t));
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kv = 0; kv < h.KVH; ++kv) {
      const auto* q = static_cast<const std::byte*>(in.q) + (b * T * in.q_row + kv * G * HS) * eb;
      const auto* k = static_cast<const std::byte*>(in.k) + (b * T * in.k_row + kv * HS) * eb;
      const auto* d = static_cast<const std::byte*>(dpreatt) + (b * h.NH + kv * G) * T * T * eb;
      auto* dq = static_cast<std::byte*>(dqkv) + (b * T * R + kv * G * HS) * eb;
      auto* dk = static_cast<std::byte*>(dqkv) + (b * T * R + h.NH * HS + kv * HS) * eb;
      // dQ_h (T,HS) += dS_h K * scale:  dQ^T += K^T dS^T
      gemm_batched(CUBLAS_OP_N, CUBLAS_OP_N, HS, T, T, scale, k, in.k_row, 0, d, T, T * T, 1.0f,
                   dq, R, HS, G, t, "gqa_scores_backward dq");
      // dK (T,HS) += dS_h^T Q_h * scale over the group's heads in order:  dK^T += Q_h^T dS_h
      for (int64_t j = 0; j < G; ++j)
        gemm_batched(CUBLAS_OP_N, CUBLAS_OP_T, HS, T, T, scale, q + j * HS * eb, in.q_row, HS,
                     d + j * T * T * eb, T, T * T, 1.0f, dk, R, HS, 1, t, "gqa_scores_backward dk");
    }
}

// ---- Mixture of experts: kernels_moe.cu -----------------------------------------------------------

CudaDevice::MoeScratch* CudaDevice::moe_scratch() {
  if (moe_ == nullptr) {
    ZP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&moe_), sizeof(MoeScratch)));
    ZP_CUDA_CHECK(cudaMemsetAsync(moe_, 0, sizeof(MoeScratch), compute()));
  }
  return moe_;
}

const int64_t* CudaDevice::moe_offsets(ExpertIdx idx, int64_t N, int64_t K, int64_t E) {
  MoeScratch* m = moe_scratch();
  cuda::moe_offsets(compute(), m->offsets, &m->bad, idx, N, K, E);
  return m->offsets;
}

void CudaDevice::moe_route_forward(float* probs, ExpertIdx idx, float* weights, const void* logits,
                                   DType t, int64_t N, int64_t E, int64_t K, bool renormalize) {
  cuda::moe_route_forward(compute(), probs, idx, weights, logits, t, N, E, K, renormalize);
}

// dprob_all is the engine's host vector: uploaded (a pageable copy, done before this returns)
// into the scratch, in stream order before the kernel.
void CudaDevice::moe_route_backward(void* dlogits, DType t, const float* dweights, const float* probs,
                                    ExpertIdx idx, const float* dprob_all, int64_t N, int64_t E,
                                    int64_t K, bool renormalize) {
  const float* dprob = nullptr;
  if (dprob_all != nullptr) {
    if (E <= 0 || E > cuda::kMoeMaxExperts)
      throw Error(fmt::format("cuda moe_route_backward: {} experts", E),
                  fmt::format("the GPU kernels take 1 to {} experts", cuda::kMoeMaxExperts));
    MoeScratch* m = moe_scratch();
    ZP_CUDA_CHECK(cudaMemcpyAsync(m->dprob, dprob_all, static_cast<std::size_t>(E) * sizeof(float),
                                  cudaMemcpyHostToDevice, compute()));
    dprob = m->dprob;
  }
  cuda::moe_route_backward(compute(), dlogits, t, dweights, probs, idx, dprob, N, E, K, renormalize);
}

// The offsets (and column sums) are computed on the GPU and read back: the host waits here, as
// the engine needs the experts' row counts for their GEMMs.
void CudaDevice::moe_route_stats(ExpertIdx idx, const float* probs, int64_t N, int64_t E, int64_t K,
                                 int64_t* offsets, double* psum) {
  MoeScratch* m = moe_scratch();
  cuda::moe_offsets(compute(), m->offsets, &m->bad, idx, N, K, E);
  if (psum != nullptr) cuda::moe_psum(compute(), m->psum, probs, N, E);
  int64_t bad = 0;
  ZP_CUDA_CHECK(cudaMemcpyAsync(&bad, &m->bad, sizeof bad, cudaMemcpyDeviceToHost, compute()));
  ZP_CUDA_CHECK(cudaMemcpyAsync(offsets, m->offsets, static_cast<std::size_t>(E + 1) * sizeof(int64_t),
                                cudaMemcpyDeviceToHost, compute()));
  if (psum != nullptr)
    ZP_CUDA_CHECK(cudaMemcpyAsync(psum, m->psum, static_cast<std::size_t>(E) * sizeof(double),
                                  cudaMemcpyDeviceToHost, compute()));
  host_wait(compute());
  if (bad != 0)
    throw Error(fmt::format("cuda moe_route_stats: {} expert indices outside [0, {})", bad, E),
                "the top-k indices come from moe_route_forward");
}
void CudaDevice::moe_dispatch(void* xe, const void* in, ExpertIdx idx, DType t, int64_t N, int64_t K,
                              int64_t E, int64_t C) {
  cuda::moe_dispatch(compute(), xe, in, idx, moe_offsets(idx, N, K, E), t, N, K, E, C);
}
void CudaDevice::moe_dispatch_backward(void* din, const void* dxe, ExpertIdx idx, DType t, int64_t N,
                                       int64_t K, int64_t E, int64_t C) {
  cuda::moe_dispatch_backward(compute(), din, dxe, idx, moe_offsets(idx, N, K, E), t, N, K, E, C);
}
void CudaDevice::moe_combine(void* out, const void* ye, const float* weights, ExpertIdx idx, DType t,
                             int64_t N, int64_t K, int64_t E, int64_t C) {
  cuda::moe_combine(compute(), out, ye, weights, idx, moe_offsets(idx, N, K, E), t, N, K, E, C);
}
void CudaDevice::moe_combine_backward(void* dye, float* dweights, const void* dout, const void* ye,
                                      const float* weights, ExpertIdx idx, DType t, int64_t N,
                                      int64_t K, int64_t E, int64_t C) {
  cuda::moe_combine_backward(compute(), dye, dweights, dout, ye, weights, idx,
                             moe_offsets(idx, N, K, E), t, N, K, E, C);
}
void CudaDevice::gate_mul_forward(void* out, const void* x, const void* g, DType t, int64_t N,
                                  int64_t C) {
  cuda::gate_mul_forward(compute(), out, x, g, t, N, C);
}
void CudaDevice::gate_mul_backward(void* dx, void* dg, const void* dout, const void* x, const void* g,
                                   DType t, int64_t N, int64_t C) {
  cuda::gate_mul_backward(compute(), dx, dg, dout, x, g, t, N, C);
}
void CudaDevice::head_rmsnorm_forward(void* out, float* stats, const QkvIn& in, const void* weight,
                                      float eps, DType t, int64_t N, const Heads& h) {
  cuda::head_rmsnorm_forward(compute(), out, stats, rows_of(in), weight, eps, t, N, h.NH, h.KVH, h.HS);
}
void CudaDevice::head_rmsnorm_backward(void* dqkv, void* dweight, const QkvIn& in, const void* weight,
                                       const float* stats, DType t, int64_t N, const Heads& h) {
  cuda::head_rmsnorm_backward(compute(), dqkv, (h.NH + 2 * h.KVH) * h.HS, dweight, rows_of(in), weight,
                              stats, t, N, h.NH, h.KVH, h.HS);
}
void CudaDevice::flash_attention_forward(void* out, float* lse, const QkvIn& in, DType t, int64_t B,
                                         int64_t T, const Heads& h, float p, uint64_t key) {
  cuda::flash_attention_forward(compute(), out, lse, rows_of(in), t, dims_of(B, T, h), p, key);
}
void CudaDevice::flash_attention_backward(void* dqkv, float* dq_acc, float* dsum, const void* dout,
                                          const QkvIn& in, const void* out, const float* lse, DType t,
                                          int64_t B, int64_t T, const Heads& h, float p,
                                          uint64_t key) {
  cuda::flash_attention_backward(compute(), dqkv, dq_acc, dsum, dout, rows_of(in), out, lse, t,
                                 dims_of(B, T, h), p, key);
}

// ---- the optimizer ---------------------------------------------------------------------------

GradSumSquares CudaDevice::grad_sum_squares(const void* grads, DType t, uint64_t n) {
  if (n == 0) return {};
  if (!on_device(grads)) {  // offloaded gradients in the host tier: the CPU pass
    host_wait(compute());
    return zp::runtime::grad_sum_squares(grads, t, n);
  }
  cuda::sum_squares(compute(), &scratch_->sum, partials_, grads, t, n);
  const double s = read_scratch().sum;
  // Every square of a finite value is exact in double and their sum cannot overflow, so the
  // sum is finite exactly when every gradient is (cpu_adam.hpp's argument).
  return {s, std::isfinite(s)};
}

void CudaDevice::adam_step(const AdamConfig& cfg, const AdamStepArgs& step, const AdamTensors& ts) {
  detail::check_adam_args(cfg, step, ts);
  if (ts.n == 0) return;
  if (!on_device(ts.master)) {  // offloaded states in the host tier: the CPU Adam
    host_wait(compute());
    cpu_adam_step(cfg, step, ts);
    return;
  }
  cuda::adam_step(compute(), detail::adam_coeffs(cfg, step), ts);
}

void CudaDevice::sgd_step(float* master, float* momentum_buf, const void* grads, DType grad_dtype,
                          void* param_out, DType param_dtype, float lr, float momentum,
                          float weight_decay, float grad_scale, uint64_t n) {
  if (n == 0) return;
  if (!on_device(master)) {
    host_wait(compute());
    cpu::sgd_step(master, momentum_buf, grads, grad_dtype, param_out, param_dtype, lr, momentum,
                  weight_decay, grad_scale, static_cast<int64_t>(n));
    return;
  }
  cuda::sgd_step(compute(), master, momentum_buf, grads, grad_dtype, param_out, param_dtype, lr,
                 momentum, weight_decay, grad_scale, n);
}

}  // namespace cuda

// ---- public entry points (zp/runtime/cuda.hpp) -------------------------------------------------

bool cuda_built() { return true; }

CudaAvailability cuda_devices() {
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string where = visible ? fmt::format(" (CUDA_VISIBLE_DEVICES='{}')", visible) : "";
  if (rc != cudaSuccess) {
    cudaGetLastError();
    // Without an NVIDIA driver at all the runtime says "insufficient driver": say both.
    const char* plain = rc == cudaErrorInsufficientDriver ? "no NVIDIA driver, or one older than this CUDA runtime: "
                        : rc == cudaErrorNoDevice         ? "no CUDA-capable GPU: "
                                                          : "";
    std::error_code ec;
    const bool driver_here = std::filesystem::exists("/dev/nvidiactl", ec) ||
                             std::filesystem::exists("/proc/driver/nvidia/version", ec);
    return {0, fmt::format("{}{} ({}){}", plain, cudaGetErrorString(rc), cudaGetErrorName(rc), where),
            rc != cudaErrorNoDevice && driver_here};
  }
  if (n == 0) return {0, "the CUDA runtime sees 0 devices" + where};
  return {n, ""};
}

std::unique_ptr<Device> make_cuda_device(const DeviceConfig& cfg, const CudaOptions& opt) {
  return std::make_unique<cuda::CudaDevice>(cfg, opt);
}

CudaMemoryInfo cuda_memory_info(Device& dev) {
  auto* d = dynamic_cast<cuda::CudaDevice*>(&dev);
  if (d == nullptr)
    throw Error(fmt::format("cuda_memory_info: the {} device is not a CUDA device", dev.name()),
                "ask a device made by make_cuda_device");
  return d->memory_info();
}

}  // namespace zp::runtime
