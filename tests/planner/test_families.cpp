// Every family the models layer reads goes through every planner path: estimate under each
// ZeRO stage and recomputation, fit's cached evaluator (equal to estimate), and a fit search;
// and the context-length rule (a learned table refuses longer sequences, other positions
// plan them with a note). The models are the PyTorch reference's small configs (one or two per
// family) and the catalog's published shapes.
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/fit.hpp"

using namespace zp::planner;
namespace models = zp::models;

namespace {

std::vector<models::ModelSpec> reference_models() {
  std::ifstream f(std::string(ZP_TEST_DATA) + "/models/torch_reference.json");
  REQUIRE(f.good());
  const auto j = nlohmann::json::parse(f);
  std::vector<models::ModelSpec> out;
  for (const auto& c : j["configs"])
    out.push_back(models::parse_hf_config(c["config"].dump(), c["name"].get<std::string>()));
  return out;
}

}  // namespace

TEST_CASE("every family: estimates at each stage and recomputation, fit's evaluator agrees") {
  for (const models::ModelSpec& m : reference_models()) {
    CAPTURE(m.name);
    FitEvaluator ev(m, PlanOptions{});
    for (int stage = 0; stage <= 3; ++stage)
      for (Checkpointing c : {Checkpointing::none, Checkpointing::selective, Checkpointing::full})
        for (bool flash : {false, true}) {
          Strategy s;
          s.stage = stage;
          s.dp = 4;
          s.micro_batch = 2;
          s.seq = 16;
          s.checkpointing = c;
          s.flash_attention = flash;
          if (m.is_moe()) s.ep = 2;
          CAPTURE(describe(s));
          const Estimate e = estimate(m, s, nullptr);
          // The model states alone: ZeRO's formula on this rank's partition, which the peak
          // must exceed (activations come on top).
          const uint64_t states = e.per_device[Tier::gpu][Category::params] +
                                  e.per_device[Tier::gpu][Category::grads] +
                                  e.per_device[Tier::gpu][Category::master] +
                                  e.per_device[Tier::gpu][Category::optimizer];
          CHECK(e.per_device.peak(Tier::gpu) > states);
          CHECK(e.per_device[Tier::gpu][Category::activations] > 0);
          CHECK(ev.memory(resolve_for_model(s, m)) == e.per_device);
        }
  }
}

TEST_CASE("every family: a fit search finds configurations") {
  const Hardware hw = load_hardware("h100-80g");
  for (const models::ModelSpec& m : reference_models()) {
    CAPTURE(m.name);
    FitRequest r;
    r.model = m;
    r.hw = hw;
    r.gpus = 8;
    r.base.seq = 16;
    r.micro_batches = {1, 4};
    r.threads = 1;
    const FitResult f = fit(r);
    REQUIRE(!f.candidates.empty());
    CHECK(f.candidates.front().shortfalls.empty());
    CHECK(f.candidates.front().step_seconds > 0);
  }
}

TEST_CASE("every catalog model estimates at stage 3 on 64 GPUs") {
  std::set<std::string> types;
  for (const auto& c : models::catalog()) {
    CAPTURE(c.name);
    const models::ModelSpec m = models::load_model(c.name);
    types.insert(m.model_type);
    Strategy s;
    s.stage = 3;
    s.dp = 64;
    s.seq = std::min<int64_t>(512, m.n_positions);
    s.checkpointing = Checkpointing::full;
    const Estimate e = estimate(m, s, nullptr);
    // Stage 3 keeps (2 + 2 + 12) bytes of each parameter's partition (ZeRO paper fig. 1),
    // each allocation rounded up to the arena's 256-byte blocks (at most one block more per
    // state and gather group).
    const uint64_t states = e.per_device[Tier::gpu][Category::params] +
                            e.per_device[Tier::gpu][Category::grads] +
                            e.per_device[Tier::gpu][Category::master] +
                            e.per_device[Tier::gpu][Category::optimizer];
    CHECK(states >= 16 * e.schedule.partition_elems);
    CHECK(states <= 16 * e.schedule.partition_elems + 4 * 256 * e.schedule.groups.size());
  }
  CHECK(types.size() >= 10);
}

TEST_CASE("longer sequences than the config's positions: tables refuse, others are noted") {
  Strategy s;
  s.seq = 2048;
  try {
    (void)estimate(models::load_model("gpt2"), s, nullptr);  // 1024 learned positions
    FAIL("expected an error");
  } catch (const zp::Error& e) {
    CHECK(std::string(e.what()).find("--seq: 2048 is longer than gpt2's 1024 positions") !=
          std::string::npos);
  }
  s.seq = 8192;
  const Estimate e = estimate(models::load_model("llama-2-7b"), s, nullptr);  // 4096, rotary
  CHECK(e.strategy.seq == 8192);
  REQUIRE(!e.model.notes.empty());
  CHECK(e.model.notes.back().find("rotary positions have no table") != std::string::npos);
}
