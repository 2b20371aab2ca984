// The doctest main of GPU-only tests. It runs every test case when at least ZP_MIN_GPUS CUDA
// devices are visible (1 unless the test's CMake target says 2). Otherwise: where the machine
// has no GPU (or the build no CUDA backend) it prints "skipped: ..." and exits 77, which CTest
// reports as skipped (SKIP_RETURN_CODE, set by zp_add_test(... GPU)); where an NVIDIA driver
// is present but CUDA cannot use the GPU (a driver older than the CUDA runtime), it fails:
// a GPU machine must never report its GPU tests as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "zp/runtime/cuda.hpp"

#ifndef ZP_MIN_GPUS
#define ZP_MIN_GPUS 1
#endif

int main(int argc, char** argv) {
  const zp::runtime::CudaAvailability a = zp::runtime::cuda_devices();
  if (a.n_devices == 0 && a.unusable) {
    std::fprintf(stderr, "FAILED: an NVIDIA driver is here, but CUDA cannot use the GPU: %s\n",
                 a.reason.c_str());
    return 1;
  }
  if (a.n_devices == 0) {
    std::printf("skipped: no CUDA device (%s)\n", a.reason.c_str());
    return 77;
  }
  if (a.n_devices < ZP_MIN_GPUS) {
    std::printf("skipped: these tests need %d GPUs, %d visible\n", ZP_MIN_GPUS, a.n_devices);
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
