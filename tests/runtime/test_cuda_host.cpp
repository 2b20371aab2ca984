// The CUDA backend's host side, on any machine: what cuda_devices() reports, that asking for a
// GPU where none is visible is a zp::Error with a hint (never a crash), that zero-run
// --device cuda then exits 2 with one error line and a hint, and (in a CUDA build) that each
// storage type maps to the NCCL type of the same encoding. Not the kernels: test_cuda_ops and
// test_cuda_engine (label gpu) need a GPU.
#include <doctest/doctest.h>

#include <string>

#include "process.hpp"
#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/plan.hpp"
#include "zp/runtime/cuda.hpp"
#include "zp/runtime/engine.hpp"

#ifdef ZP_TEST_NCCL_TYPES
#include "nccl_types.hpp"
#endif

using namespace zp::runtime;

namespace {
const std::string kRun = std::string(ZP_BIN_DIR) + "/zero-run";
// Open MPI's singleton start refuses root unless told (CI runs as root).
const std::vector<std::string> kEnv = {"OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"};

int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}
}  // namespace

TEST_CASE("cuda_devices: a count, or none with the reason") {
  const CudaAvailability a = cuda_devices();
  CHECK(a.n_devices >= 0);
  // A reason exactly when nothing is usable, so a caller can always say why.
  CHECK(a.reason.empty() == (a.n_devices > 0));
  if (!cuda_built()) CHECK(a.n_devices == 0);
}

TEST_CASE("without a visible GPU the CUDA factories throw zp::Error with a hint") {
  if (cuda_devices().n_devices > 0) {
    MESSAGE("a GPU is visible: test_cuda_ops and test_cuda_engine exercise the device");
    return;
  }
  DeviceConfig dc;
  dc.gpu_bytes = 1 << 20;
  try {
    make_cuda_device(dc);
    FAIL("make_cuda_device returned without a device");
  } catch (const zp::Error& e) {
    CHECK(std::string(e.what()).find(cuda_built() ? "no CUDA device visible" : "no CUDA backend") !=
          std::string::npos);
    CHECK(std::string(e.hint()).find("--device cpu") != std::string::npos);
  }
}

TEST_CASE("zero-run --device cuda without a GPU exits 2 with one error line and a hint") {
  if (cuda_devices().n_devices > 0) {
    MESSAGE("a GPU is visible: --device cuda runs (test_cuda_engine)");
    return;
  }
  const zp::test::Result r =
      zp::test::run({kRun, "--model", "gpt2-tiny", "--device", "cuda", "--steps", "1"}, kEnv, 120);
  CHECK(r.rc == 2);
  CHECK(r.out.find("step") == std::string::npos);  // nothing ran
  CAPTURE(r.err);
  CHECK(count_lines(r.err) == 2);
  CHECK(r.err.rfind("error: ", 0) == 0);
  if (cuda_built()) {
    CHECK(r.err.find("error: no CUDA device visible (") != std::string::npos);
    CHECK(r.err.find("hint: run on a GPU node or use --device cpu") != std::string::npos);
  } else {
    CHECK(r.err.find("built without the CUDA backend") != std::string::npos);
    CHECK(r.err.find("hint: rebuild with -DZP_ENABLE_CUDA=ON") != std::string::npos);
  }
  // The same input on the cpu backend runs: the refusal is about the device alone.
  const zp::test::Result cpu =
      zp::test::run({kRun, "--model", "gpt2-tiny", "--device", "cpu", "--steps", "1", "--seq", "16"}, kEnv, 300);
  CHECK(cpu.rc == 0);
}

#ifdef ZP_TEST_NCCL_TYPES
TEST_CASE("NCCL types: fp32, fp16 and bf16 map to the NCCL types of the same encoding") {
  using zp::runtime::cuda::nccl_type;
  // nccl.h names the encodings: ncclFloat32 (IEEE binary32), ncclFloat16 (IEEE binary16,
  // alias ncclHalf), ncclBfloat16 (bfloat16).
  CHECK(nccl_type(DType::fp32) == ncclFloat32);
  CHECK(nccl_type(DType::fp16) == ncclFloat16);
  CHECK(nccl_type(DType::fp16) == ncclHalf);
  CHECK(nccl_type(DType::bf16) == ncclBfloat16);
  // Sums: no integer or 8-bit type sneaks in for a floating type.
  for (DType t : {DType::fp32, DType::fp16, DType::bf16}) {
    CHECK(nccl_type(t) != ncclUint8);
    CHECK(nccl_type(t) != ncclFloat64);
  }
}
#endif

TEST_CASE("the CUDA backend refuses more than 16 experts per token before allocating, naming it") {
  // kernels_moe.cu's combine holds a token's rows in registers: top-k at most 16 on a GPU.
  const zp::models::ModelSpec m = zp::models::parse_hf_config(
      R"({"model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 24,
      "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 128, "rms_norm_eps": 1e-05, "num_local_experts": 32,
      "num_experts_per_tok": 20, "tie_word_embeddings": false})",
      "wide.json");
  zp::planner::Strategy s;
  s.seq = 32;
  const zp::planner::Plan plan = zp::planner::make_plan(m, s, {zp::planner::Profile::zeroplan, zp::planner::Backend::cpu}, 1);
  CHECK_THROWS_WITH_AS(Engine::check(plan, "cuda", 1),
                       doctest::Contains("20 experts per token; zero-run's cuda backend takes at most 16"),
                       zp::Error);
  CHECK_NOTHROW(Engine::check(plan, "cpu", 1));
}
