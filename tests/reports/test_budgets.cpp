// Budgets (zero-plan check's library side) and JUnit escaping: limits as written, the share of
// a device, strict reading with the field named, the over-budget and growth rules at their
// boundaries, and --update's rewrite. Predictions come from planner::estimate (tested in
// tests/planner); here they are only the input the rules are applied to.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "process.hpp"
#include "zp/error.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/reports/budgets.hpp"
#include "zp/reports/junit.hpp"

using namespace zp::reports;
using zp::planner::Tier;
using json = nlohmann::json;

namespace {
std::string error_of(const json& j, const std::string& path = "b.json") {
  try {
    parse_budgets(j, path);
  } catch (const zp::Error& e) {
    CHECK(!e.hint().empty());
    return e.what();
  }
  return "";
}
json one_case(json c) {
  return {{"schema", "zero-plan/budgets/v1"}, {"cases", json::array({std::move(c)})}};
}
uint64_t predicted_gpu(const std::string& model, int stage, int64_t dp) {
  zp::planner::Strategy s;
  s.stage = stage;
  s.dp = dp;
  return zp::planner::estimate(zp::models::load_model(model), s, nullptr).per_device.peak(Tier::gpu);
}
}  // namespace

TEST_CASE("limits: bytes in any unit, or a share of the device") {
  CHECK(parse_limit("30 GiB", "x").bytes == 30ULL << 30);
  CHECK(parse_limit("40GB", "x").bytes == 40'000'000'000ULL);
  CHECK(parse_limit("5e8", "x").bytes == 500'000'000ULL);
  CHECK(parse_limit(json(32212254720ULL), "x").bytes == 32212254720ULL);
  const TierLimit l = parse_limit("90% of device", "x");
  CHECK(l.bytes == 0);
  CHECK(l.pct_of_device == 90.0);
  CHECK(parse_limit(" 12.5 % ", "x").pct_of_device == 12.5);
  for (const json& bad : {json("30 GB of device"), json("0%"), json("150% of device"), json("abc"),
                          json(-1), json(true), json("% of device")}) {
    CAPTURE(bad.dump());
    try {
      parse_limit(bad, "b.json: cases[0].budget.gpu");
      FAIL("accepted");
    } catch (const zp::Error& e) {
      CHECK(std::string(e.what()).rfind("b.json: cases[0].budget.gpu: ", 0) == 0);
      CHECK(e.hint().find("90% of device") != std::string::npos);
    }
  }
}

TEST_CASE("device capacity: one GPU, or the node's host memory and drives shared by its ranks") {
  zp::planner::Hardware hw;
  hw.gpu_memory_bytes = 80ULL << 30;
  hw.gpus_per_node = 8;
  hw.host_memory_bytes = 1ULL << 40;
  hw.nvme_bytes = 4ULL << 40;
  zp::planner::Strategy s;
  s.dp = 4;
  CHECK(device_capacity(hw, s, Tier::gpu) == 80ULL << 30);
  CHECK(device_capacity(hw, s, Tier::cpu) == (1ULL << 40) / 4);
  s.dp = 64;  // 8 ranks on a node
  CHECK(device_capacity(hw, s, Tier::cpu) == (1ULL << 40) / 8);
  CHECK(device_capacity(hw, s, Tier::nvme) == (4ULL << 40) / 8);
  s.dp = 2;
  s.mp = 2;
  CHECK(device_capacity(hw, s, Tier::nvme) == (4ULL << 40) / 4);
}

TEST_CASE("budgets files are read strictly; errors name the file and the field") {
  const json ok = {{"model", "gpt2-tiny"}, {"budget", {{"gpu", "4 MiB"}}}};
  CHECK(error_of(one_case(ok)) == "");
  CHECK(error_of(json::array()).find("b.json: a budgets file is a JSON object") == 0);
  CHECK(error_of({{"cases", json::array({ok})}}).find("field 'schema'") != std::string::npos);
  CHECK(error_of({{"schema", "zero-plan/budgets/v1"}, {"cases", json::array()}})
            .find("'cases' must be a non-empty array") != std::string::npos);
  CHECK(error_of({{"schema", "zero-plan/budgets/v1"}, {"case", json::array({ok})}})
            .find("unknown field 'case'") != std::string::npos);

  auto with = [&](const char* key, json v) {
    json c = ok;
    c[key] = std::move(v);
    return error_of(one_case(c));
  };
  CHECK(with("budgt", 1) == "b.json: cases[0]: unknown field 'budgt'");
  CHECK(with("budget", {{"tpu", "1 GiB"}}).find("cases[0].budget: unknown tier 'tpu'") != std::string::npos);
  CHECK(with("budget", {{"gpu", "lots"}}).find("cases[0].budget.gpu: 'lots' is not a size") != std::string::npos);
  CHECK(with("budget", {{"gpu", "90% of device"}}).find("needs the case's hardware") != std::string::npos);
  CHECK(with("budget", json::object()).find("cases[0].budget: missing") != std::string::npos);
  CHECK(with("accepted", {{"gpu", -5}}).find("cases[0].accepted.gpu: must be bytes") != std::string::npos);
  CHECK(with("max_growth_pct", -1).find("cases[0].max_growth_pct: must be a number") != std::string::npos);
  CHECK(with("model", "gpt-7").find("b.json: cases[0].model: unknown model 'gpt-7'") == 0);
  CHECK(with("model", "missing/config.json").find("cases[0].model: cannot read") != std::string::npos);
  CHECK(with("hardware", "tpu-v4").find("b.json: cases[0].hardware: unknown hardware 'tpu-v4'") == 0);
  CHECK(with("strategy", {{"stage", 5}}).find("b.json: cases[0]") == 0);
  CHECK(with("strategy", {{"stag", 1}}).find("unknown field 'strategy.stag'") != std::string::npos);
  CHECK(with("profile", "torch").find("field 'cases[0].profile' must be") != std::string::npos);
  // Two cases with one name: JUnit and the table could not tell them apart.
  CHECK(error_of({{"schema", "zero-plan/budgets/v1"}, {"cases", json::array({ok, ok})}})
            .find("cases[1].name: 'gpt2-tiny stage 0 dp 1' names an earlier case too") != std::string::npos);
}

TEST_CASE("paths in a budgets file are relative to its directory") {
  zp::test::TempDir dir;
  std::system(("mkdir -p '" + dir.file("sub") + "'").c_str());
  dir.write("sub/hw.json", R"({"name": "tiny-box", "gpu_memory_bytes": 1073741824,
                               "gpus_per_node": 2, "host_memory_bytes": 4294967296,
                               "gpu_tflops": 10, "hbm_gbps": 500, "h2d_gbps": 10, "d2h_gbps": 10,
                               "nvlink_gbps": 50, "internode_gbps": 10, "cpu_adam_gparams": 1,
                               "nvme_read_gbps": 1, "nvme_write_gbps": 1})");
  dir.write("sub/ds.json", R"({"zero_optimization": {"stage": 3}, "bf16": {"enabled": true}})");
  dir.write("sub/b.json", one_case({{"model", "gpt2-tiny"}, {"hardware", "hw.json"}, {"ds_config", "ds.json"},
                                    {"strategy", {{"dp", 2}}},
                                    {"budget", {{"gpu", "50% of device"}}}})
                              .dump());
  const Budgets b = load_budgets(dir.file("sub/b.json"));
  REQUIRE(b.cases.size() == 1);
  CHECK(b.cases[0].hardware->name == "tiny-box");
  CHECK(b.cases[0].strategy.stage == 3);  // from the DeepSpeed config
  CHECK(b.cases[0].strategy.dp == 2);     // from the case
  const CheckReport r = check_budgets(b);
  REQUIRE(r.cases[0].tiers.size() == 1);
  CHECK(*r.cases[0].tiers[0].limit == (1ULL << 30) / 2);
}

TEST_CASE("over budget when predicted > limit; growth beyond max_growth_pct fails") {
  const uint64_t p = predicted_gpu("gpt2-tiny", 2, 2);
  REQUIRE(p > 10'000);
  auto check_one = [&](json budget, std::optional<uint64_t> accepted, double growth) {
    json c = {{"model", "gpt2-tiny"}, {"strategy", {{"stage", 2}, {"dp", 2}}}, {"budget", budget},
              {"max_growth_pct", growth}};
    if (accepted) c["accepted"] = {{"gpu", *accepted}};
    return check_budgets(parse_budgets(one_case(c), "b.json")).cases.at(0);
  };
  // At the limit is within budget; one byte less is over.
  CaseCheck c = check_one({{"gpu", p}}, std::nullopt, 1);
  CHECK(c.passed());
  CHECK(c.tiers[0].predicted == p);
  CHECK(*c.tiers[0].headroom_bytes() == 0);
  c = check_one({{"gpu", p - 1}}, std::nullopt, 1);
  CHECK(!c.passed());
  CHECK(c.tiers[0].over_budget);
  CHECK(*c.tiers[0].headroom_bytes() == -1);
  REQUIRE(c.failures.size() == 1);
  CHECK(c.failures[0].find("gpu predicted") != std::string::npos);
  CHECK(c.failures[0].find("over its budget") != std::string::npos);

  // Growth from accepted a = p - 1000 is 1000 / a * 100 percent.
  const uint64_t a = p - 1000;
  const double g = 1000.0 / static_cast<double>(a) * 100.0;
  c = check_one({{"gpu", "1 GiB"}}, a, g * 1.001);
  CHECK(c.passed());
  CHECK(*c.tiers[0].change_pct() == doctest::Approx(g).epsilon(1e-12));
  c = check_one({{"gpu", "1 GiB"}}, a, g * 0.999);
  CHECK(!c.passed());
  CHECK(c.tiers[0].grew);
  CHECK(!c.tiers[0].over_budget);
  REQUIRE(c.failures.size() == 1);
  CHECK(c.failures[0].find("grew +") != std::string::npos);
  // Shrinking never fails; 0 allowed growth fails any growth.
  CHECK(check_one({{"gpu", "1 GiB"}}, p + 5000, 0).passed());
  CHECK(check_one({{"gpu", "1 GiB"}}, p, 0).passed());
  CHECK(!check_one({{"gpu", "1 GiB"}}, p - 1, 0).passed());
  // A tier with only an accepted value is still checked for growth.
  json c2 = {{"model", "gpt2-tiny"}, {"strategy", {{"stage", 2}, {"dp", 2}}},
             {"budget", {{"cpu", "1 GiB"}}}, {"accepted", {{"gpu", p / 2}}}};
  const CaseCheck cc = check_budgets(parse_budgets(one_case(c2), "b.json")).cases.at(0);
  REQUIRE(cc.tiers.size() == 2);
  CHECK(cc.tiers[0].tier == Tier::gpu);
  CHECK(!cc.tiers[0].limit);
  CHECK(cc.tiers[0].grew);
}

TEST_CASE("--update rewrites accepted values and keeps the rest of the file") {
  const uint64_t p = predicted_gpu("gpt2-tiny", 2, 2);
  const std::string text = R"({
  "schema": "zero-plan/budgets/v1",
  "cases": [{"name": "tiny", "model": "gpt2-tiny", "strategy": {"stage": 2, "dp": 2},
             "budget": {"gpu": "4 MiB", "cpu": "1 GiB"}, "accepted": {"gpu": 1, "nvme": 7},
             "max_growth_pct": 2}],
  "max_growth_pct": 0.5
})";
  const CheckReport r = check_budgets(parse_budgets(json::parse(text), "b.json"));
  const std::string out = with_accepted(text, r, "b.json");
  const json j = json::parse(out);
  CHECK(j["cases"][0]["accepted"] == json{{"gpu", p}, {"cpu", 0}, {"nvme", 0}});
  CHECK(j["cases"][0]["budget"] == json{{"gpu", "4 MiB"}, {"cpu", "1 GiB"}});
  CHECK(j["max_growth_pct"] == 0.5);
  // Key order is the file's, not alphabetical.
  CHECK(out.find("\"schema\"") < out.find("\"cases\""));
  CHECK(out.find("\"cases\"") < out.find("\"max_growth_pct\": 0.5"));
  CHECK(out.find("\"name\"") < out.find("\"model\""));
  // After the update nothing grew.
  CHECK(check_budgets(parse_budgets(j, "b.json")).passed());
  CHECK_THROWS_AS(with_accepted("{\"cases\": []}", r, "b.json"), zp::Error);
}

TEST_CASE("XML escaping (XML 1.0 sec. 2.4 and 2.2)") {
  CHECK(xml_escape("a<b>&\"c\"'d'") == "a&lt;b&gt;&amp;&quot;c&quot;&apos;d&apos;");
  CHECK(xml_escape(std::string("tab\tnl\ncr\rbell\x07nul") + '\0' + "end") ==
        "tab\tnl\ncr\rbell?nul?end");
  CHECK(xml_escape("µ ü 🙂") == "µ ü 🙂");  // UTF-8 passes through
  const std::string x = render_junit({{"s<1>", {{"c&1", "k", 0.5, {"m \"q\""}, "out<"}, {"c2", "k", 0, {}, ""}}}});
  CHECK(x.find("<testsuites tests=\"2\" failures=\"1\" errors=\"0\">") != std::string::npos);
  CHECK(x.find("<testsuite name=\"s&lt;1&gt;\" tests=\"2\" failures=\"1\"") != std::string::npos);
  CHECK(x.find("<testcase name=\"c&amp;1\" classname=\"k\" time=\"0.500\">") != std::string::npos);
  CHECK(x.find("<failure message=\"m &quot;q&quot;\" type=\"failure\">m &quot;q&quot;</failure>") !=
        std::string::npos);
  CHECK(x.find("<system-out>out&lt;</system-out>") != std::string::npos);
  CHECK(x.find("<testcase name=\"c2\" classname=\"k\" time=\"0.000\"/>") != std::string::npos);
  // Two failures: one <failure>, messages joined.
  const std::string y = render_junit({{"s", {{"c", "k", 0, {"one", "two"}, ""}}}});
  CHECK(y.find("<failure message=\"one; two\" type=\"failure\">one\ntwo</failure>") != std::string::npos);
  CHECK(y.find("<failure", y.find("</failure>")) == std::string::npos);
}
