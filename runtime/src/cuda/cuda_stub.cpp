// cuda_stub.cpp: zp/runtime/cuda.hpp in a build without the CUDA backend (ZP_ENABLE_CUDA=OFF,
// or AUTO on a machine without nvcc or NCCL): no devices, and factories that say why. Not a
// fallback: nothing here computes.
#include "zp/error.hpp"
#include "zp/runtime/cuda.hpp"

namespace zp::runtime {

namespace {
constexpr const char* kWhy = "this build has no CUDA backend (configured without nvcc and NCCL)";
constexpr const char* kHint =
    "rebuild with -DZP_ENABLE_CUDA=ON where the CUDA toolkit and NCCL are installed, or use "
    "--device cpu";
}  // namespace

bool cuda_built() { return false; }

CudaAvailability cuda_devices() { return {0, kWhy}; }

std::unique_ptr<Device> make_cuda_device(const DeviceConfig&, const CudaOptions&) {
  throw Error(kWhy, kHint);
}

std::unique_ptr<Comm> make_nccl_comm(Device&, Comm&) { throw Error(kWhy, kHint); }

CudaMemoryInfo cuda_memory_info(Device&) { throw Error(kWhy, kHint); }

}  // namespace zp::runtime
