// What a training checkpoint costs (strategy.save_checkpoint): the bytes on disk against the
// ZeRO paper's K-factor accounting (sec. 3.1: 2 Psi fp16 parameters plus K = 12 bytes of fp32
// master weights and Adam moments per parameter; a checkpoint holds all but the gradients),
// per rank by the partition, and the staging buffer in the host tier's peak, nowhere else.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/schedule.hpp"

using namespace zp;
using namespace zp::planner;

TEST_CASE("checkpoint cost: 2 + K bytes per parameter (ZeRO sec. 3.1), split over the ranks") {
  const models::ModelSpec m = models::load_model("gpt2");
  Strategy s;
  s.stage = 2;
  s.dp = 8;
  s.micro_batch = 1;
  s.seq = 256;
  s.save_checkpoint = true;
  const Estimate e = estimate(m, s, nullptr);
  REQUIRE(e.checkpoint.has_value());
  const uint64_t psi = e.schedule.n_params;
  CHECK(psi == 124'439'808);  // GPT-2 small, tied embeddings
  CHECK(e.checkpoint->bytes_per_element == 2 + 12);
  CHECK(e.checkpoint->total_bytes == psi * 14);
  CHECK(e.checkpoint->writers == 8);
  CHECK(e.checkpoint->rank_bytes == e.schedule.partition_elems * 14);
  CHECK(e.schedule.partition_elems * 8 >= psi);
  CHECK(e.schedule.partition_elems * 8 < psi + 8 * 4096);  // padding only
  // The staging buffer: 4 Mi fp32 elements and the slack to align it for O_DIRECT; it is the
  // host tier's only allocation here, so the host peak is exactly it (in whole arena units).
  CHECK(e.checkpoint->staging_bytes == (uint64_t{4} << 22) + 4096 - 256);
  CHECK(e.per_device.peak(Tier::cpu) == e.checkpoint->staging_bytes);
  CHECK(e.per_device[Tier::cpu][Category::buffers] == e.checkpoint->staging_bytes);
  // Nothing moves on the GPU, and without the flag the host tier is empty.
  Strategy plain = s;
  plain.save_checkpoint = false;
  const Estimate p = estimate(m, plain, nullptr);
  CHECK(!p.checkpoint.has_value());
  CHECK(p.per_device.peak(Tier::cpu) == 0);
  CHECK(p.per_device.peak(Tier::gpu) == e.per_device.peak(Tier::gpu));
  CHECK(p.memory.timeline.size() == e.memory.timeline.size());
  const nlohmann::json j = to_json(e);
  CHECK(j["checkpoint"]["total_bytes"] == psi * 14);
  CHECK(j["strategy"]["save_checkpoint"] == true);
}

TEST_CASE("checkpoint cost: stage 0 is one writer; fp32, SGD and the delayed update") {
  const models::ModelSpec m = models::load_model("gpt2-tiny");
  Strategy s;
  s.dp = 4;
  s.micro_batch = 1;
  s.seq = 32;
  s.save_checkpoint = true;
  const uint64_t psi = estimate(m, s, nullptr).schedule.n_params;
  CHECK(psi == 120'576);
  // Stage 0: rank 0 writes the whole model; a small model's staging is the model rounded to
  // 4096 elements.
  Estimate e = estimate(m, s, nullptr);
  CHECK(e.checkpoint->writers == 1);
  CHECK(e.checkpoint->rank_bytes == psi * 14);
  CHECK(e.checkpoint->staging_bytes == (psi + 4095) / 4096 * 4096 * 4 + 4096 - 256);
  // fp32 without offload: the parameters are the master weights (4 + 8).
  s.stage = 1;
  s.precision = Precision::fp32;
  CHECK(estimate(m, s, nullptr).checkpoint->bytes_per_element == 12);
  // ... offloaded, the host keeps its own fp32 master copy (4 + 4 + 8).
  s.offload_optimizer = Offload::cpu;
  CHECK(estimate(m, s, nullptr).checkpoint->bytes_per_element == 16);
  // bf16 SGD with momentum: 2 + 4 + 4; with the delayed update its 2-byte parameters in flight.
  s.precision = Precision::bf16;
  s.optimizer = OptimizerKind::sgd;
  s.offload_optimizer = Offload::none;
  CHECK(estimate(m, s, nullptr).checkpoint->bytes_per_element == 10);
  s.optimizer = OptimizerKind::adam;
  s.offload_optimizer = Offload::cpu;
  s.dpu = true;
  CHECK(estimate(m, s, nullptr).checkpoint->bytes_per_element == 16);
}
