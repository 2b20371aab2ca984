// zp/runtime/cuda.hpp: the CUDA backend behind the Device and Comm seams: one cudaMalloc arena
// for the gpu tier, pinned host memory (cudaHostAlloc) for the cpu tier, streams ordered by
// events, cuBLAS and CUDA kernels for a GPT-2 step; and NCCL collectives bootstrapped over MPI.
// Not the ZeRO logic (engine.hpp). The header needs no CUDA headers, and every function here
// exists in every build: without CUDA (ZP_ENABLE_CUDA=OFF or no toolkit) cuda_built() is false,
// cuda_devices() reports none and the factories throw zp::Error.
//
// Example usage (one rank per GPU under mpirun):
//   MpiSession mpi(&argc, &argv);
//   auto mpi_comm = make_mpi_comm();
//   if (CudaAvailability a = cuda_devices(); a.n_devices == 0) { /* a.reason; use --device cpu */ }
//   auto dev = make_cuda_device({.gpu_bytes = 8ULL << 30, .cpu_bytes = 1ULL << 30}, {});
//   auto comm = make_nccl_comm(*dev, *mpi_comm);     // ncclCommInitRank, id broadcast over MPI
//   Engine engine(plan, *dev, *comm, TokenData::load(""), EngineOptions{});
//   CudaMemoryInfo mem = cuda_memory_info(*dev);     // context and library bytes beside the arena
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "zp/runtime/comm.hpp"
#include "zp/runtime/device.hpp"

namespace zp::runtime {

// Whether this build contains the CUDA backend.
bool cuda_built();

// The CUDA devices this process can see. Never throws: no driver, no device, a driver older
// than the runtime all give n_devices = 0 and the CUDA runtime's words in `reason`.
struct CudaAvailability {
  int n_devices = 0;
  std::string reason;  // empty when n_devices > 0
  // No device usable, yet an NVIDIA GPU's driver is on this machine (/dev/nvidiactl or
  // /proc/driver/nvidia): a driver older than the CUDA runtime, say. Tests fail on it rather
  // than skip.
  bool unusable = false;
};
CudaAvailability cuda_devices();

struct CudaOptions {
  // Which visible device this rank uses; -1: the rank's local index on its node (Open MPI's
  // OMPI_COMM_WORLD_LOCAL_RANK, else MPI_LOCALRANKID, SLURM_LOCALID, else 0) modulo the
  // number of visible devices: one rank per GPU.
  int device_index = -1;
  // This rank's index among the node's ranks as MPI knows it (Comm::local_rank(), from
  // MPI_Comm_split_type), preferred to the launcher's variables when given (>= 0): a launcher
  // that sets none of them (MVAPICH, some PMIx ones) would put every rank on GPU 0.
  int local_rank = -1;
  // The Device seam hands fp32 activations and fp32 weights, so the GEMMs are cuBLAS SGEMMs;
  // false keeps TF32 off (CUBLAS_PEDANTIC_MATH), the faithful twin of the CPU backend; true
  // lets them use TF32 tensor cores (about 1e-3 relative error per product).
  bool tf32 = false;
};

// cfg.gpu_bytes is one cudaMalloc on the chosen device, cfg.cpu_bytes one cudaHostAlloc;
// cfg.n_threads > 0 sets the host threads (OpenMP, OpenBLAS) of the CPU-side work, as on the
// cpu backend. zp::Error (with a hint) when no device is visible, the index is
// out of range, or an allocation fails.
std::unique_ptr<Device> make_cuda_device(const DeviceConfig& cfg, const CudaOptions& opt = {});

// NCCL over the ranks of `mpi` (MPI_COMM_WORLD), on `dev`'s GPU and its communication stream:
// rank 0's ncclUniqueId is broadcast over MPI, then ncclCommInitRank. Data collectives on
// device buffers run in NCCL (fp32/fp16/bf16), ordered after the compute stream's work and
// before its next; gather_u64, the double all-reduce, barrier and abort (and any collective on
// host memory) go over `mpi`, which must outlive the result. `dev` must come from
// make_cuda_device, and outlive the result too: destroy the Comm first, on every rank
// together (ncclCommDestroy is collective in recent NCCL). While it lives, the device's host
// waits poll NCCL's asynchronous errors (async_watch.hpp): a dead peer is a zp::Error naming
// the rank, not a wait forever.
std::unique_ptr<Comm> make_nccl_comm(Device& dev, Comm& mpi);

// Device memory outside the arenas, from cudaMemGetInfo (whole-GPU figures: another process
// on the same GPU counts too). Measured once the context exists (before the arena), and now.
struct CudaMemoryInfo {
  uint64_t total_bytes = 0;            // the GPU's memory
  uint64_t free_at_start_bytes = 0;    // free right after the context was created
  uint64_t free_now_bytes = 0;
  uint64_t arena_bytes = 0;            // the gpu-tier cudaMalloc
  int compute_capability_major = 0;    // 9 for Hopper: NVLink SHARP (NVLS) possible
  // total - free_at_start: the CUDA context (and anything else already on the GPU).
  uint64_t context_bytes() const { return total_bytes - free_at_start_bytes; }
  // free_at_start - free_now - arena: cuBLAS and NCCL buffers, module images, pinned mappings
  // (0 if the difference is negative, e.g. memory another process freed meanwhile).
  uint64_t libraries_bytes() const {
    const uint64_t used = free_at_start_bytes > free_now_bytes ? free_at_start_bytes - free_now_bytes : 0;
    return used > arena_bytes ? used - arena_bytes : 0;
  }
};
// zp::Error unless `dev` is a CUDA device.
CudaMemoryInfo cuda_memory_info(Device& dev);

}  // namespace zp::runtime
