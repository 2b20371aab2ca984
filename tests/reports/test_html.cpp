// The HTML report in a real browser: headless Chromium loads the file, runs its script, and
// dumps the DOM; every drawn shape is held against the data it came from (bar heights and
// stacking, timeline points, ZeRO curve points against the paper's formulas). The page must be
// self-contained, and a page whose data is broken must say so (the check can fail).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include <nlohmann/json.hpp>

#include "process.hpp"
#include "zp/reports/comparison.hpp"
#include "zp/reports/html.hpp"
#include "zp/reports/table.hpp"

using namespace zp::reports;
using zp::planner::Category;
using zp::planner::Tier;
using json = nlohmann::json;

namespace {

const std::vector<std::string> kEnv = {"OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"};
const char* kCats[] = {"params", "grads", "master", "optimizer", "activations", "buffers", "workspace", "overhead"};

// $ZP_CHROMIUM, or chromium / chromium-browser / google-chrome on PATH.
std::string find_browser() {
  if (const char* e = std::getenv("ZP_CHROMIUM"); e != nullptr && *e != '\0') return e;
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin";
  for (const char* name : {"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"}) {
    std::size_t start = 0;
    while (start <= dirs.size()) {
      const std::size_t end = std::min(dirs.find(':', start), dirs.size());
      const std::string candidate = dirs.substr(start, end - start) + "/" + name;
      if (::access(candidate.c_str(), X_OK) == 0) return candidate;
      start = end + 1;
    }
  }
  return "";
}

// The test's own probe, run after the page's script: asks the browser's layout for the box of
// every drawn shape, so a shape that is not real SVG (or not laid out) shows as such.
constexpr const char* kProbe = R"(<script>
for (const e of document.querySelectorAll("[data-category],[data-series],circle[data-stage]")) {
  const r = e.getBoundingClientRect();
  e.setAttribute("data-probe-svg", String(e instanceof SVGGraphicsElement));
  e.setAttribute("data-probe-w", String(r.width));
  e.setAttribute("data-probe-h", String(r.height));
}
</script>
)";

// The DOM after the page's scripts (and the probe) ran, from a copy of the page.
std::string dump_dom(const std::string& page_path) {
  std::string page = zp::test::slurp(page_path);
  const std::size_t body_end = page.rfind("</body>");
  REQUIRE(body_end != std::string::npos);
  page.insert(body_end, kProbe);
  const std::string html_path = page_path + ".probed.html";
  std::ofstream(html_path, std::ios::binary) << page;
  const std::string browser = find_browser();
  INFO("no Chromium found: tools/test.sh installs it (Debian package 'chromium'), or set ZP_CHROMIUM");
  REQUIRE(!browser.empty());
  zp::test::TempDir profile;
  const zp::test::Result r =
      zp::test::run({browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                     "--disable-dev-shm-usage", "--user-data-dir=" + profile.path, "--dump-dom",
                     "file://" + html_path},
                    {}, 120);
  CAPTURE(r.err.substr(0, 2000));
  REQUIRE(r.rc == 0);
  REQUIRE(r.out.find("</html>") != std::string::npos);
  return r.out;
}

using Attrs = std::map<std::string, std::string>;

// Opening tags named `name` in `dom`, with their attributes.
std::vector<Attrs> tags(const std::string& dom, const std::string& name) {
  std::vector<Attrs> out;
  const std::regex tag("<" + name + R"(\b([^>]*)>)");
  const std::regex attr(R"(([\w:-]+)="([^"]*)\")");
  for (auto it = std::sregex_iterator(dom.begin(), dom.end(), tag); it != std::sregex_iterator(); ++it) {
    Attrs a;
    const std::string body = (*it)[1];
    for (auto at = std::sregex_iterator(body.begin(), body.end(), attr); at != std::sregex_iterator(); ++at)
      a[(*at)[1]] = (*at)[2];
    out.push_back(std::move(a));
  }
  return out;
}

// The <svg data-chart=chart data-tier=tier> element's markup (charts are not nested).
std::string chart(const std::string& dom, const std::string& chart, const std::string& tier) {
  std::size_t at = 0;
  while ((at = dom.find("<svg", at)) != std::string::npos) {
    const std::size_t end = dom.find("</svg>", at);
    const std::string open = dom.substr(at, dom.find('>', at) - at);
    if (open.find("data-chart=\"" + chart + "\"") != std::string::npos &&
        open.find("data-tier=\"" + tier + "\"") != std::string::npos)
      return dom.substr(at, end - at);
    at = end;
  }
  return "";
}

double num(const Attrs& a, const std::string& key) {
  auto it = a.find(key);
  REQUIRE_MESSAGE(it != a.end(), "missing attribute " << key);
  return std::stod(it->second);
}

std::vector<std::pair<double, double>> points(const std::string& s) {
  std::vector<std::pair<double, double>> out;
  std::stringstream ss(s);
  std::string p;
  while (ss >> p) {
    const auto comma = p.find(',');
    out.emplace_back(std::stod(p.substr(0, comma)), std::stod(p.substr(comma + 1)));
  }
  return out;
}

struct Geometry {
  double left, top, pw, ph, max_bytes;
};
Geometry geometry(const std::string& svg) {
  const Attrs a = tags(svg, "svg").at(0);
  return {num(a, "data-left"), num(a, "data-top"), num(a, "data-plot-width"),
          num(a, "data-plot-height"), num(a, "data-max-bytes")};
}

zp::planner::Breakdown breakdown(std::array<uint64_t, 8> b) {
  zp::planner::Breakdown out;
  out.bytes = b;
  return out;
}

zp::planner::TimelineSample sample(int32_t pos, std::array<uint64_t, 8> gpu, std::array<uint64_t, 8> cpu) {
  zp::planner::TimelineSample s;
  s.pos = pos;
  s.bytes[0] = gpu;
  s.bytes[1] = cpu;
  return s;
}

// Two ranks, gpu and cpu tiers, a measurement that differs a little, a 4-op timeline.
Comparison sample_comparison() {
  Comparison c;
  c.model = "test-model <&>";
  c.n_params = 7'500'000'000ULL;  // the ZeRO paper's 7.5B model
  c.strategy.stage = 2;
  c.strategy.dp = 64;
  c.device = "cpu";
  for (int r = 0; r < 2; ++r) {
    RankMemory m;
    m.rank = r;
    m.predicted[Tier::gpu] = breakdown({1000, 2000, 0, 4000, 3000, 500, 0, 100});
    m.predicted.set_peak(Tier::gpu, 9000);
    m.predicted[Tier::cpu] = breakdown({0, 0, 0, 8000, 0, 0, 0, 0});
    m.measured = m.predicted;
    m.measured[Tier::gpu][Category::activations] = r == 0 ? 3300 : 2900;
    m.measured.set_peak(Tier::gpu, r == 0 ? 9300 : 8900);
    c.ranks.push_back(m);
  }
  c.op_names = {"a.fwd", "b.fwd", "b.bwd", "optimizer"};
  const std::array<uint64_t, 8> cpu = {0, 0, 0, 8000, 0, 0, 0, 0};
  for (auto [pos, act] : std::vector<std::pair<int, uint64_t>>{{-1, 0}, {0, 1000}, {1, 3000}, {2, 2000}, {3, 0}}) {
    c.predicted_timeline.push_back(sample(pos, {1000, 0, 0, 0, act, 0, 0, 0}, cpu));
    c.measured_timeline.push_back(sample(pos, {1000, 0, 0, 0, act + (pos == 1 ? 300 : 0), 0, 0, 0}, cpu));
  }
  return c;
}

// Bars of a memory chart: (rank, kind) -> rects in category order.
void check_memory_chart(const std::string& svg, const Comparison& c, Tier tier) {
  const Geometry g = geometry(svg);
  uint64_t max = 0;
  std::size_t n_expected = 0;
  for (const RankMemory& r : c.ranks)
    for (const auto* d : {&r.predicted, &r.measured}) {
      max = std::max({max, (*d)[tier].total(), d->peak(tier)});
      for (uint64_t b : (*d)[tier].bytes) n_expected += b > 0;
    }
  CHECK(g.max_bytes == static_cast<double>(max));
  const auto rects = tags(svg, "rect");
  CHECK(rects.size() == n_expected);
  const auto lines = tags(svg, "line");
  for (const RankMemory& r : c.ranks)
    for (const char* kind : {"predicted", "measured"}) {
      const auto& d = std::string(kind) == "predicted" ? r.predicted : r.measured;
      double bottom = g.top + g.ph;  // the stack grows up from the plot's floor
      for (std::size_t ci = 0; ci < 8; ++ci) {
        const uint64_t b = d[tier].bytes[ci];
        std::vector<Attrs> found;
        for (const Attrs& a : rects)
          if (a.at("data-rank") == std::to_string(r.rank) && a.at("data-kind") == kind &&
              a.at("data-category") == kCats[ci])
            found.push_back(a);
        CAPTURE(kind);
        CAPTURE(kCats[ci]);
        if (b == 0) {
          CHECK(found.empty());
          continue;
        }
        REQUIRE(found.size() == 1);
        CHECK(num(found[0], "data-bytes") == static_cast<double>(b));
        const double h = static_cast<double>(b) / static_cast<double>(max) * g.ph;
        CHECK(num(found[0], "height") == doctest::Approx(h).epsilon(1e-9));
        // Laid out by the browser as an SVG rect of that size (CSS pixels; layout units are
        // 1/64 px, so a few hundredths of slack).
        CHECK(found[0].at("data-probe-svg") == "true");
        CHECK(std::fabs(num(found[0], "data-probe-h") - h) < 0.05);
        CHECK(std::fabs(num(found[0], "data-probe-w") - num(found[0], "width")) < 0.05);
        CHECK(num(found[0], "y") + num(found[0], "height") == doctest::Approx(bottom).epsilon(1e-9));
        bottom = num(found[0], "y");
      }
      bool peak_found = false;
      for (const Attrs& a : lines)
        if (a.count("data-peak-bytes") && a.at("data-rank") == std::to_string(r.rank) && a.at("data-kind") == kind) {
          peak_found = true;
          CHECK(num(a, "data-peak-bytes") == static_cast<double>(d.peak(tier)));
          CHECK(num(a, "y1") == doctest::Approx(g.top + g.ph - static_cast<double>(d.peak(tier)) /
                                                                   static_cast<double>(max) * g.ph));
        }
      CHECK(peak_found);
    }
}

uint64_t total(const zp::planner::TimelineSample& s, Tier t) {
  uint64_t sum = 0;
  for (uint64_t b : s.bytes[static_cast<std::size_t>(t)]) sum += b;
  return sum;
}

void check_timeline_chart(const std::string& svg, const Comparison& c, Tier tier, std::size_t n_areas) {
  const Geometry g = geometry(svg);
  uint64_t max = 0;
  for (const auto* tl : {&c.predicted_timeline, &c.measured_timeline})
    for (const auto& s : *tl) max = std::max(max, total(s, tier));
  CHECK(g.max_bytes == static_cast<double>(max));
  CHECK(tags(svg, "polygon").size() == n_areas);
  const auto lines = tags(svg, "polyline");
  for (const auto& [series, tl] : {std::pair{"predicted-total", &c.predicted_timeline},
                                   std::pair{"measured-total", &c.measured_timeline}}) {
    CAPTURE(series);
    const Attrs* line = nullptr;
    for (const Attrs& a : lines)
      if (a.at("data-series") == series) line = &a;
    REQUIRE(line != nullptr);
    const auto pts = points(line->at("points"));
    REQUIRE(pts.size() == tl->size());
    CHECK(line->at("data-probe-svg") == "true");
    CHECK(num(*line, "data-probe-w") > 0.5 * g.pw);  // spans the step
    for (std::size_t i = 0; i < pts.size(); ++i) {
      const double x = g.left + static_cast<double>((*tl)[i].pos + 1) / static_cast<double>(c.op_names.size()) * g.pw;
      const double y = g.top + g.ph - static_cast<double>(total((*tl)[i], tier)) / static_cast<double>(max) * g.ph;
      CHECK(pts[i].first == doctest::Approx(x));
      CHECK(pts[i].second == doctest::Approx(y));
    }
  }
}

}  // namespace

TEST_CASE("HTML report: every chart drawn from the data, in headless Chromium") {
  const Comparison c = sample_comparison();
  zp::test::TempDir dir;
  const std::string page = render_html(c);
  write_file_atomic(dir.file("r.html"), page);

  // Self-contained: nothing to fetch. The SVG namespace name is the only URL.
  for (const char* fetch : {"src=", "href=", "url(", "@import", "<link", "fetch(", "XMLHttpRequest"})
    CHECK(page.find(fetch) == std::string::npos);
  std::size_t n_http = 0, n_ns = 0;
  for (std::size_t at = 0; (at = page.find("http", at)) != std::string::npos; ++at) ++n_http;
  for (std::size_t at = 0; (at = page.find("http://www.w3.org/2000/svg", at)) != std::string::npos; ++at) ++n_ns;
  CHECK(n_http == n_ns);

  const std::string dom = dump_dom(dir.file("r.html"));
  REQUIRE(dom.find("data-zp-status=\"ok\"") != std::string::npos);
  // The model name is text, not markup.
  CHECK(dom.find("zeroplan report: test-model &lt;&amp;&gt; (7.50 B params)") != std::string::npos);
  CHECK(dom.find("MISMATCH: a peak is 3.33% off the prediction (tolerance 2.00%)") != std::string::npos);

  {  // stacked bars per tier, predicted next to measured
    check_memory_chart(chart(dom, "memory", "gpu"), c, Tier::gpu);
    check_memory_chart(chart(dom, "memory", "cpu"), c, Tier::cpu);
    CHECK(chart(dom, "memory", "nvme").empty());
  }
  {  // timeline: stacked prediction, predicted and measured totals
    check_timeline_chart(chart(dom, "timeline", "gpu"), c, Tier::gpu, 2);  // params, activations
    check_timeline_chart(chart(dom, "timeline", "cpu"), c, Tier::cpu, 1);  // optimizer
  }
  {  // ZeRO curves: the paper's model-state formulas at Nd = 1 .. 1024
    const std::string svg = chart(dom, "zero", "gpu");
    const Geometry g = geometry(svg);
    const auto dots = tags(svg, "circle");
    REQUIRE(dots.size() == 4 * 11);
    const uint64_t psi = c.n_params;
    // ZeRO paper sec. 5.1 / fig. 1 with K = 12, each rank's partition ceil(Psi / Nd):
    auto expected = [&](int stage, uint64_t nd) -> uint64_t {
      const uint64_t part = (psi + nd - 1) / nd;
      switch (stage) {
        case 0: return (2 + 2 + 12) * psi;
        case 1: return 2 * psi + 2 * psi + 12 * part;
        case 2: return 2 * psi + (2 + 12) * part;
        default: return (2 + 2 + 12) * part;
      }
    };
    const double lmin = std::log10(static_cast<double>(expected(3, 1024)));
    const double lmax = std::log10(static_cast<double>(expected(0, 1)));
    int n_current = 0;
    for (const Attrs& a : dots) {
      const int stage = static_cast<int>(num(a, "data-stage"));
      const auto nd = static_cast<uint64_t>(num(a, "data-dp"));
      const double b = static_cast<double>(expected(stage, nd));
      CAPTURE(stage);
      CAPTURE(nd);
      CHECK(num(a, "data-bytes") == b);
      CHECK(a.at("data-probe-svg") == "true");
      CHECK(num(a, "data-probe-w") == doctest::Approx(2 * num(a, "r")).epsilon(0.05));
      CHECK(num(a, "cx") == doctest::Approx(g.left + std::log2(static_cast<double>(nd)) / 10.0 * g.pw));
      CHECK(num(a, "cy") == doctest::Approx(g.top + g.ph * (1 - (std::log10(b) - lmin) / (lmax - lmin))));
      if (a.at("data-current") == "1") {
        ++n_current;
        CHECK(stage == 2);
        CHECK(nd == 64);
      }
    }
    CHECK(n_current == 1);
    // The formula against the paper's table 1 row for 7.5B at Nd = 64: 31.4, 16.6, 1.88 GB.
    CHECK(static_cast<double>(expected(1, 64)) / 1e9 == doctest::Approx(31.4).epsilon(0.002));
    CHECK(static_cast<double>(expected(2, 64)) / 1e9 == doctest::Approx(16.6).epsilon(0.003));
    CHECK(static_cast<double>(expected(3, 64)) / 1e9 == doctest::Approx(1.88).epsilon(0.003));
  }
}

TEST_CASE("a page whose data is broken reports it instead of drawing") {
  zp::test::TempDir dir;
  std::string page = render_html(sample_comparison());
  const std::string open = "<script type=\"application/json\" id=\"zp-data\">";
  const std::size_t from = page.find(open) + open.size();
  page.replace(from, page.find("</script>", from) - from, "{}");
  write_file_atomic(dir.file("broken.html"), page);
  const std::string dom = dump_dom(dir.file("broken.html"));
  CHECK(dom.find("data-zp-status=\"error: ") != std::string::npos);
  CHECK(dom.find("data-zp-status=\"ok\"") == std::string::npos);
  CHECK(tags(dom, "rect").empty());
}

TEST_CASE("zero-plan estimate --report and zero-run --report write pages that draw their numbers") {
  zp::test::TempDir dir;
  const std::string bin = ZP_BIN_DIR;
  zp::test::Result r = zp::test::run({bin + "/zero-plan", "estimate", "--model", "gpt2-tiny", "--stage", "2",
                                      "--dp", "2", "--format", "json", "--report", dir.file("e.html")});
  REQUIRE(r.rc == 0);
  const json est = json::parse(r.out);
  std::string dom = dump_dom(dir.file("e.html"));
  REQUIRE(dom.find("data-zp-status=\"ok\"") != std::string::npos);
  std::string svg = chart(dom, "memory", "gpu");
  std::size_t n = 0;
  for (const char* cat : kCats) {
    const uint64_t b = est["per_device"]["gpu"]["breakdown"][cat];
    n += b > 0;
    for (const Attrs& a : tags(svg, "rect"))
      if (a.at("data-category") == cat) CHECK(num(a, "data-bytes") == static_cast<double>(b));
  }
  CHECK(tags(svg, "rect").size() == n);
  CHECK(dom.find("data-kind=\"measured\"") == std::string::npos);  // a prediction alone
  CHECK(dom.find("data-series=\"predicted-total\"") != std::string::npos);

  r = zp::test::run({bin + "/zero-plan", "estimate", "--model", "gpt2-tiny", "--report", dir.file("e.pdf")});
  CHECK(r.rc == 2);
  CHECK(r.err.find("--report") != std::string::npos);

  // One rank (no mpirun needed); the JSON report of the same deterministic run gives the
  // measured numbers the page must draw.
  for (const char* ext : {"html", "json"}) {
    r = zp::test::run({bin + "/zero-run", "--model", "gpt2-tiny", "--stage", "1", "--steps", "1",
                       "--report", dir.file(std::string("run.") + ext)},
                      kEnv);
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
  }
  const json run = json::parse(zp::test::slurp(dir.file("run.json")));
  dom = dump_dom(dir.file("run.html"));
  REQUIRE(dom.find("data-zp-status=\"ok\"") != std::string::npos);
  svg = chart(dom, "memory", "gpu");
  n = 0;
  for (const char* cat : kCats) {
    const uint64_t b = run["ranks"][0]["measured"]["gpu"]["breakdown"][cat];
    n += b > 0;
    for (const Attrs& a : tags(svg, "rect"))
      if (a.at("data-category") == cat && a.at("data-kind") == "measured")
        CHECK(num(a, "data-bytes") == static_cast<double>(b));
  }
  std::size_t n_measured = 0;
  for (const Attrs& a : tags(svg, "rect")) n_measured += a.at("data-kind") == "measured";
  CHECK(n_measured == n);
  // The measured timeline has a sample at every position the predicted one has.
  svg = chart(dom, "timeline", "gpu");
  std::size_t n_pred = 0, n_meas = 0;
  for (const Attrs& a : tags(svg, "polyline")) {
    if (a.at("data-series") == "predicted-total") n_pred = points(a.at("points")).size();
    if (a.at("data-series") == "measured-total") n_meas = points(a.at("points")).size();
  }
  CHECK(n_pred > 10);
  CHECK(n_meas == n_pred);
}
