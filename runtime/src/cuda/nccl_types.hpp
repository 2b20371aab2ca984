// nccl_types.hpp (internal): the NCCL element type of each storage type, and ZP_NCCL_CHECK, the
// one check macro for NCCL calls (the call as written, file:line, NCCL's words, zp::Error).
// Host-only and device-free, so a test can check the mapping on a machine without a GPU.
#pragma once

#include <nccl.h>

#include "zp/runtime/dtype.hpp"

namespace zp::runtime::cuda {

// fp16 and bf16 sums add in the element type, pair by pair, as the MPI backend's fp16/bf16
// reduction ops do (fp32 add, one rounding per pair).
constexpr ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::fp32: return ncclFloat32;
    case DType::fp16: return ncclFloat16;
    default: return ncclBfloat16;
  }
}

[[noreturn]] void throw_nccl_error(ncclResult_t rc, const char* call, const char* file, int line);

}  // namespace zp::runtime::cuda

#define ZP_NCCL_CHECK(call)                                                         \
  do {                                                                              \
    const ncclResult_t zp_nccl_rc_ = (call);                                        \
    if (zp_nccl_rc_ != ncclSuccess)                                                 \
      ::zp::runtime::cuda::throw_nccl_error(zp_nccl_rc_, #call, __FILE__, __LINE__); \
  } while (0)
