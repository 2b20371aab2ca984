// cuda_check.hpp (internal): the check macros of the CUDA runtime and cuBLAS. Each stringifies
// the failing call, names file:line and the library's own words, and throws zp::Error. Not for
// NCCL (ZP_NCCL_CHECK lives in comm_nccl.cpp, the only file that calls NCCL).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

namespace zp::runtime::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t rc, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t rc, const char* call, const char* file, int line);

}  // namespace zp::runtime::cuda

#define ZP_CUDA_CHECK(call)                                                        \
  do {                                                                             \
    const cudaError_t zp_cuda_rc_ = (call);                                        \
    if (zp_cuda_rc_ != cudaSuccess)                                                \
      ::zp::runtime::cuda::throw_cuda_error(zp_cuda_rc_, #call, __FILE__, __LINE__); \
  } while (0)

#define ZP_CUBLAS_CHECK(call)                                                          \
  do {                                                                                 \
    const cublasStatus_t zp_cublas_rc_ = (call);                                       \
    if (zp_cublas_rc_ != CUBLAS_STATUS_SUCCESS)                                        \
      ::zp::runtime::cuda::throw_cublas_error(zp_cublas_rc_, #call, __FILE__, __LINE__); \
  } while (0)
