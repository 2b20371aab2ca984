// zp/reports/planner_reports.hpp: what zero-plan prints for `table`, `models` and `estimate`,
// in every format (text, markdown, json, csv). Rendering only; the numbers come from the
// planner and the models library.
#pragma once

#include <string>
#include <vector>

#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/model_states.hpp"
#include "zp/reports/table.hpp"

namespace zp::reports {

// The ZeRO table: text/markdown lay it out as the paper does (a row per DP degree, GB with the
// paper's rounding); json is {"schema":"zero-plan/table/v1","rows":[...]} with exact bytes.
std::string render_zero_table(const std::vector<planner::TableRow>& rows, uint64_t k, Format f);

// The catalog, one model per row.
std::string render_catalog(Format f);

// One model's parameter inventory: every tensor of the first block (the others repeat it),
// the tensors outside the blocks, the total and the largest module.
std::string render_inventory(const models::ModelSpec& m, Format f);

// One estimate: per-device bytes per tier and category, and the fit verdict.
std::string render_estimate(const planner::Estimate& e, Format f);

// "7.5B", "128B", "1T", "350M": a parameter count as people write it in tables.
std::string short_count(uint64_t n);

}  // namespace zp::reports
