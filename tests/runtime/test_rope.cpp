// Rotary frequency tables (runtime/rope.hpp) against PyTorch's, computed as transformers'
// modeling_rope_utils.py computes them (tools/fixtures/rope_fixture.py wrote
// tests/data/rope_tables.json with Debian's python3-torch): default, linear, dynamic, llama3
// and yarn, each within 2 ulp of fp32 (PyTorch's vectorised pow against libm's); and the
// RopeSpec read from config.json fields.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/runtime/rope.hpp"

using namespace zp;

namespace {

double from_hex(const std::string& s) { return std::strtod(s.c_str(), nullptr); }

// Distance in units in the last place of fp32 (both finite, same sign here).
int64_t ulps(float a, float b) {
  int32_t ia = 0, ib = 0;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  return std::llabs(static_cast<int64_t>(ia) - static_cast<int64_t>(ib));
}

}  // namespace

TEST_CASE("rope tables equal PyTorch's for every scaling type zero-run computes") {
  std::ifstream in(std::string(ZP_TEST_DATA) + "/rope_tables.json");
  REQUIRE(in);
  std::stringstream ss;
  ss << in.rdbuf();
  const auto j = nlohmann::json::parse(ss.str());
  int n_cases = 0;
  for (const auto& c : j["cases"]) {
    models::RopeSpec r;
    r.type = c["type"].get<std::string>();
    r.theta = c["theta"].get<double>();
    r.factor = c.value("factor", 1.0);
    r.low_freq_factor = c.value("low_freq_factor", 1.0);
    r.high_freq_factor = c.value("high_freq_factor", 4.0);
    r.original_max_positions = c.value("original_max_positions", int64_t{0});
    r.attention_factor = c.value("attention_factor", 0.0);
    r.beta_fast = c.value("beta_fast", 32.0);
    r.beta_slow = c.value("beta_slow", 1.0);
    const int64_t dim = c["dim"].get<int64_t>();
    CAPTURE(r.type);
    CAPTURE(dim);
    const runtime::RopeTable tab = runtime::rope_table(r, dim, c["max_positions"].get<int64_t>());
    const auto& want = c["inv_freq"];
    REQUIRE(tab.inv_freq.size() == want.size());
    int64_t worst = 0;
    for (std::size_t i = 0; i < want.size(); ++i)
      worst = std::max(worst, ulps(tab.inv_freq[i], static_cast<float>(from_hex(want[i].get<std::string>()))));
    MESSAGE(r.type << " dim " << dim << ": largest difference " << worst << " ulp");
    CHECK(worst <= 2);
    CHECK(tab.attention_factor == static_cast<float>(from_hex(c["attention_factor_out"].get<std::string>())));
    ++n_cases;
  }
  CHECK(n_cases == 8);
}

TEST_CASE("rope tables: what is not computed is refused by name") {
  models::RopeSpec r;
  r.type = "longrope";
  CHECK_THROWS_WITH_AS(runtime::rope_table(r, 64, 4096), doctest::Contains("longrope"), Error);
  r.type = "default";
  CHECK_THROWS_AS(runtime::rope_table(r, 7, 4096), Error);
  r.type = "llama3";  // without original_max_position_embeddings
  CHECK_THROWS_AS(runtime::rope_table(r, 64, 4096), Error);
}

TEST_CASE("RopeSpec and norm eps from config.json: rope_scaling, rope_parameters, rms_norm_eps") {
  const std::string base = R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, )";
  const models::ModelSpec a = models::parse_hf_config(
      base + R"("rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192, "rope_type": "llama3"}})", "llama31.json");
  CHECK(a.norm_eps == 1e-5);
  CHECK(a.rope.theta == 500000.0);
  CHECK(a.rope.type == "llama3");
  CHECK(a.rope.factor == 8.0);
  CHECK(a.rope.original_max_positions == 8192);
  // transformers v5 writes rope_parameters, rope_theta inside.
  const models::ModelSpec b = models::parse_hf_config(
      base + R"("rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
      "beta_fast": 16.0}})", "v5.json");
  CHECK(b.rope.type == "yarn");
  CHECK(b.rope.theta == 1000000.0);
  CHECK(b.rope.beta_fast == 16.0);
  CHECK(b.rope.beta_slow == 1.0);
  // The old "type" key, and null.
  CHECK(models::parse_hf_config(base + R"("rope_scaling": {"type": "linear", "factor": 2.0}})", "x")
            .rope.type == "linear");
  CHECK(models::parse_hf_config(base + R"("rope_scaling": null})", "x").rope.type == "default");
  CHECK_THROWS_WITH_AS(models::parse_hf_config(base + R"("rope_scaling": {"type": "linear", "factor": "2"}})", "x"),
                       doctest::Contains("rope_scaling.factor"), Error);
}
