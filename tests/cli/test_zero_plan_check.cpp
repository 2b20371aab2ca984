// zero-plan check as CI meets it: exit 0 within budget, 1 over budget or grown, 2 on bad input
// (one error line naming the field, a hint, nothing on stdout); JUnit XML that a real XML
// parser (Python's xml.etree) reads back with every special character intact; and --update
// replacing the file whole (a new inode by rename, no temp file left, never a torn read).
#include <doctest/doctest.h>

#include <sys/stat.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include <nlohmann/json.hpp>

#include "process.hpp"

using json = nlohmann::json;
using zp::test::Result;

namespace {
const std::string kBin = std::string(ZP_BIN_DIR) + "/zero-plan";

Result zero_plan(std::vector<std::string> args) {
  args.insert(args.begin(), kBin);
  return zp::test::run(args);
}

json one_case(json c) {
  return {{"schema", "zero-plan/budgets/v1"}, {"cases", json::array({std::move(c)})}};
}

// gpt2-tiny stage 2 dp 2's predicted gpu peak, from zero-plan estimate's JSON contract.
uint64_t tiny_gpu_peak() {
  const Result r = zero_plan({"estimate", "--model", "gpt2-tiny", "--stage", "2", "--dp", "2", "--format", "json"});
  REQUIRE(r.rc == 0);
  return json::parse(r.out)["per_device"]["gpu"]["total"].get<uint64_t>();
}

json tiny(json budget) {
  return {{"name", "tiny"}, {"model", "gpt2-tiny"}, {"strategy", {{"stage", 2}, {"dp", 2}}},
          {"budget", std::move(budget)}};
}

void check_bad_input(const Result& r, const std::string& needle) {
  CAPTURE(r.err);
  CHECK(r.rc == 2);
  CHECK(r.out.empty());
  CHECK(r.err.rfind("error: ", 0) == 0);
  CHECK(r.err.find(needle) != std::string::npos);
  CHECK(r.err.find("\nhint: ") != std::string::npos);
}

ino_t inode(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return st.st_ino;
}
}  // namespace

TEST_CASE("exit 0 within budget, 1 over budget, 1 grown beyond the allowed percent") {
  zp::test::TempDir dir;
  const uint64_t p = tiny_gpu_peak();

  std::string f = dir.write("ok.json", one_case(tiny({{"gpu", p}})).dump());
  Result r = zero_plan({"check", f});
  CAPTURE(r.out);
  CAPTURE(r.err);
  CHECK(r.rc == 0);
  CHECK(r.out.find("case  tier  predicted") == 0);
  CHECK(r.out.find("ok: 1 case within budget") != std::string::npos);

  f = dir.write("over.json", one_case(tiny({{"gpu", p - 1}})).dump());
  r = zero_plan({"check", f});
  CHECK(r.rc == 1);
  CHECK(r.err.empty());
  CHECK(r.out.find("OVER BUDGET") != std::string::npos);
  CHECK(r.out.find("tiny: gpu predicted") != std::string::npos);
  CHECK(r.out.find("FAILED: 1 of 1 case") != std::string::npos);

  json c = tiny({{"gpu", "1 GiB"}});
  c["accepted"] = {{"gpu", p * 100 / 102}};  // grew ~2%, more than the default 1%
  f = dir.write("grew.json", one_case(c).dump());
  r = zero_plan({"check", f});
  CHECK(r.rc == 1);
  CHECK(r.out.find("GREW") != std::string::npos);
  CHECK(r.out.find("more than the allowed 1%") != std::string::npos);
  c["max_growth_pct"] = 3;
  r = zero_plan({"check", dir.write("grew3.json", one_case(c).dump())});
  CHECK(r.rc == 0);

  // JSON: the same verdict, exact bytes.
  r = zero_plan({"check", f, "--format", "json"});
  CHECK(r.rc == 1);
  const json j = json::parse(r.out);
  CHECK(j["schema"] == "zero-plan/check/v1");
  CHECK(j["passed"] == false);
  CHECK(j["cases"][0]["tiers"][0]["predicted"] == p);
  CHECK(j["cases"][0]["tiers"][0]["accepted"] == p * 100 / 102);
  CHECK(j["cases"][0]["tiers"][0]["grew"] == true);
}

TEST_CASE("exit 2 on bad input, naming the field") {
  zp::test::TempDir dir;
  check_bad_input(zero_plan({"check", dir.file("none.json")}), "none.json");
  check_bad_input(zero_plan({"check", dir.write("trunc.json", "{\"schema\": \"zero-plan/bud")}),
                  "trunc.json");
  check_bad_input(zero_plan({"check", dir.write("s.json", R"({"cases": []})")}), "field 'schema'");
  json c = tiny({{"gpu", "30 GB of device"}});
  check_bad_input(zero_plan({"check", dir.write("l.json", one_case(c).dump())}),
                  "cases[0].budget.gpu: '30 GB of device' is not a size or a share of the device");
  c = tiny({{"gpu", "90% of device"}});
  check_bad_input(zero_plan({"check", dir.write("h.json", one_case(c).dump())}),
                  "cases[0].budget.gpu: '90% of device' needs the case's hardware");
  c = tiny({{"gpu", "1 GiB"}});
  c["model"] = "gpt-tiny";
  check_bad_input(zero_plan({"check", dir.write("m.json", one_case(c).dump())}),
                  "cases[0].model: unknown model 'gpt-tiny'");
  c = tiny({{"gpu", "1 GiB"}});
  c["strategy"]["seq"] = 4096;  // gpt2-tiny has 64 positions: caught when predicting
  check_bad_input(zero_plan({"check", dir.write("seq.json", one_case(c).dump())}), "cases[0]");
  check_bad_input(zero_plan({"check", dir.write("f.json", one_case(tiny({{"gpu", 1}})).dump()),
                             "--format", "yaml"}),
                  "--format");
  // A usage error (no file) is exit 2 as well.
  const Result r = zero_plan({"check"});
  CHECK(r.rc == 2);
}

TEST_CASE("--junit: one testcase per case; Python's XML parser reads every name and message back") {
  zp::test::TempDir dir;
  const uint64_t p = tiny_gpu_peak();
  const std::string odd = "tiny <stage 2> & \"dp\" 'two' \x01";
  json c1 = tiny({{"gpu", p - 4096}});  // over budget
  c1["name"] = odd;
  json c2 = tiny({{"gpu", "1 GiB"}});
  c2["name"] = "fine";
  const std::string f = dir.write("b.json", json{{"schema", "zero-plan/budgets/v1"},
                                                 {"cases", json::array({c1, c2})}}.dump());
  const std::string xml = dir.file("out.xml");
  const Result r = zero_plan({"check", f, "--junit", xml});
  CHECK(r.rc == 1);
  const std::string script = dir.write("read.py", R"(import json, sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
out = {"tag": root.tag, "tests": root.get("tests"), "failures": root.get("failures"), "cases": []}
for tc in root.iter("testcase"):
    out["cases"].append({"name": tc.get("name"),
                         "failures": [f.get("message") for f in tc.findall("failure")],
                         "text": [f.text for f in tc.findall("failure")]})
print(json.dumps(out))
)");
  const Result py = zp::test::run({ZP_PYTHON, script, xml});
  CAPTURE(py.err);
  CAPTURE(zp::test::slurp(xml));
  REQUIRE(py.rc == 0);
  const json j = json::parse(py.out);
  CHECK(j["tag"] == "testsuites");
  CHECK(j["tests"] == "2");
  CHECK(j["failures"] == "1");
  REQUIRE(j["cases"].size() == 2);
  // The control character is not allowed in XML 1.0: written as '?'.
  CHECK(j["cases"][0]["name"] == "tiny <stage 2> & \"dp\" 'two' ?");
  REQUIRE(j["cases"][0]["failures"].size() == 1);
  const std::string msg = j["cases"][0]["failures"][0];
  CHECK(msg.rfind("tiny <stage 2> & \"dp\" 'two' ?: gpu predicted", 0) == 0);
  CHECK(msg.find("over its budget") != std::string::npos);
  CHECK(j["cases"][0]["text"][0] == msg);
  CHECK(j["cases"][1]["name"] == "fine");
  CHECK(j["cases"][1]["failures"].empty());
}

TEST_CASE("--update: accepted values replaced atomically; growth accepted, budgets still fail") {
  zp::test::TempDir dir;
  const uint64_t p = tiny_gpu_peak();
  json c = tiny({{"gpu", "1 GiB"}});
  c["accepted"] = {{"gpu", p / 2}};
  const std::string f = dir.write("b.json", one_case(c).dump(2));
  CHECK(zero_plan({"check", f}).rc == 1);  // grew 100%

  // A hard link keeps the old file: rename gives the path a new inode, an in-place write would not.
  REQUIRE(::link(f.c_str(), dir.file("old.json").c_str()) == 0);
  const std::string before = zp::test::slurp(f);
  const ino_t ino = inode(f);
  Result r = zero_plan({"check", f, "--update"});
  CAPTURE(r.out);
  CAPTURE(r.err);
  CHECK(r.rc == 0);
  CHECK(r.out.find("updated " + f) != std::string::npos);
  CHECK(inode(f) != ino);
  CHECK(zp::test::slurp(dir.file("old.json")) == before);
  CHECK(json::parse(zp::test::slurp(f))["cases"][0]["accepted"]["gpu"] == p);
  for (const auto& e : std::filesystem::directory_iterator(dir.path))
    CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
  CHECK(zero_plan({"check", f}).rc == 0);

  // Over budget: --update records the prediction but still fails; the budget is not touched.
  c = tiny({{"gpu", p - 1}});
  const std::string g = dir.write("over.json", one_case(c).dump(2));
  r = zero_plan({"check", g, "--update"});
  CHECK(r.rc == 1);
  const json after = json::parse(zp::test::slurp(g));
  CHECK(after["cases"][0]["accepted"]["gpu"] == p);
  CHECK(after["cases"][0]["budget"]["gpu"] == p - 1);

  // Bad input: the file is left byte for byte.
  json bad = tiny({{"gpu", "1 GiB"}});
  bad["strategy"]["stage"] = 9;
  const std::string h = dir.write("bad.json", one_case(bad).dump(2));
  const std::string bad_before = zp::test::slurp(h);
  check_bad_input(zero_plan({"check", h, "--update"}), "bad.json");
  CHECK(zp::test::slurp(h) == bad_before);

  // Readers never see a partial file while updates run: every read parses.
  std::atomic<bool> done{false};
  std::atomic<int> reads{0}, torn{0};
  std::thread reader([&] {
    while (!done) {
      const std::string text = zp::test::slurp(f);
      if (!json::accept(text)) ++torn;
      ++reads;
    }
  });
  for (int i = 0; i < 20; ++i) CHECK(zero_plan({"check", f, "--update"}).rc == 0);
  done = true;
  reader.join();
  CHECK(reads > 0);
  CHECK(torn == 0);
}
