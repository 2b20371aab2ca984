// zp/reports/html.hpp: the HTML report: one self-contained file (inline CSS, JavaScript and
// SVG; nothing fetched from the network) drawn from a Comparison: per-device memory by
// category as stacked bars (predicted next to measured), the memory timeline over a step, and
// the ZeRO table as bytes per device against DP degree. Rendering only; no numbers are made
// here except the ZeRO curves, which are the planner's model-state formulas.
//
// Example usage:
//   Comparison c = comparison_from_estimate(planner::estimate(model, strategy, &hw));
//   write_file_atomic("report.html", render_html(c));
//
// The page draws with its embedded script; after drawing, <body data-zp-status="ok"> (or
// "error: ..."). Every chart is an <svg data-chart="memory|timeline|zero"> carrying its plot
// geometry (data-left, data-top, data-plot-width, data-plot-height, data-max-bytes) so a test
// can hold each drawn shape against the data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "zp/reports/comparison.hpp"

namespace zp::reports {

// The ZeRO table of one model as curves: model-state bytes per device on the gpu tier for
// stages 0-3 at each DP degree (planner::model_state_bytes with the comparison's precision and
// optimizer, no offload, no model parallelism).
struct ZeroCurve {
  int stage = 0;
  std::vector<uint64_t> dp, bytes_per_device;
};
// DP degrees 1, 2, 4, ..., 1024, plus the strategy's own degree.
std::vector<ZeroCurve> zero_curves(const Comparison& c);

// What the page draws: {"report": to_json(c), "zero": {"dp":[...],"current":{"stage","dp"},
// "curves":[{"stage":s,"bytes":[...]}]}}.
nlohmann::json html_data(const Comparison& c);

// The whole page.
std::string render_html(const Comparison& c);

// zero-plan serve's page: a form (a catalog model, or a config.json pasted or uploaded; the
// strategy; profile, hardware and GPUs) above the report's sections, which its script redraws
// with the report's own drawing code from what /api/estimate answers, and a table of what
// /api/fit answers. Its inputs live in the query string (a pasted config as base64url), so a
// URL shares them. <body data-zp-serve="busy|ready|error"> says where it stands. `models`: the
// catalog's names (gpt2-xl selected first); `hardware`: the preset names.
std::string render_serve_page(const std::vector<std::string>& models,
                              const std::vector<std::string>& hardware);

}  // namespace zp::reports
