// The memory outside the arena on the cuda backend (cudaMemGetInfo) in the run report: the
// measured context and library bytes beside the planner's bound, in text and in the
// zero-run/report/v1 JSON. The numbers are given here; no GPU is involved.
#include <doctest/doctest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "zp/reports/comparison.hpp"
#include "zp/reports/table.hpp"

using namespace zp;

namespace {

reports::Comparison one_rank(const reports::OutsideArena& o) {
  reports::Comparison c;
  c.model = "gpt2-tiny";
  c.device = "cuda";
  reports::RankMemory r;
  r.outside_arena = o;
  c.ranks.push_back(r);
  return c;
}

}  // namespace

TEST_CASE("outside the arena: measured beside the bound, in text and JSON") {
  // 80 GiB GPU; context 512 MiB, libraries 40 MiB: 552 MiB measured under a 1375 MiB bound.
  reports::OutsideArena o{.gpu_total_bytes = 80ULL << 30,
                          .context_bytes = 512ULL << 20,
                          .libraries_bytes = 40ULL << 20,
                          .predicted_at_most_bytes = 1375ULL << 20};
  {
    const std::string text = reports::render_comparison(one_rank(o), reports::Format::text);
    CHECK(text.find("rank 0: outside the arena (cudaMemGetInfo): measured 552.0 MiB (CUDA context "
                    "512.0 MiB, libraries 40.00 MiB), predicted at most 1.34 GiB, of 80.00 GiB on "
                    "the GPU\n") != std::string::npos);
    const nlohmann::json j = reports::to_json(one_rank(o));
    const auto& oj = j["ranks"][0]["outside_arena"];
    CHECK(oj["gpu_total"] == 85899345920ULL);
    CHECK(oj["context"] == 536870912ULL);
    CHECK(oj["libraries"] == 41943040ULL);
    CHECK(oj["measured"] == 578813952ULL);
    CHECK(oj["predicted_at_most"] == 1441792000ULL);
    CHECK(oj["within_bound"] == true);
  }
  // Above the bound: said so in both.
  o.libraries_bytes = 900ULL << 20;  // 1412 MiB in all
  {
    const std::string text = reports::render_comparison(one_rank(o), reports::Format::text);
    CHECK(text.find("measured 1.38 GiB") != std::string::npos);
    CHECK(text.find("predicted at most 1.34 GiB (ABOVE the bound)") != std::string::npos);
    CHECK(reports::to_json(one_rank(o))["ranks"][0]["outside_arena"]["within_bound"] == false);
  }
  // No bound given: "not predicted", and no bound fields in the JSON.
  o.predicted_at_most_bytes = 0;
  {
    const std::string text = reports::render_comparison(one_rank(o), reports::Format::text);
    CHECK(text.find("), not predicted, of 80.00 GiB") != std::string::npos);
    const auto oj = reports::to_json(one_rank(o))["ranks"][0]["outside_arena"];
    CHECK_FALSE(oj.contains("predicted_at_most"));
    CHECK_FALSE(oj.contains("within_bound"));
  }
}
