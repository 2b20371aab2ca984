// The doctest main of GPU-only tests: without a visible CUDA device (or a build without the
// CUDA backend) it prints "skipped: no CUDA device (why)" and exits 77, which CTest reports as
// skipped (SKIP_RETURN_CODE, set by zp_add_test(... GPU)); with one it runs every test case.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "zp/runtime/cuda.hpp"

int main(int argc, char** argv) {
  const zp::runtime::CudaAvailability a = zp::runtime::cuda_devices();
  if (a.n_devices == 0) {
    std::printf("skipped: no CUDA device (%s)\n", a.reason.c_str());
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
