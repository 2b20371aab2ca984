// zp/reports/report_file.hpp: which rendering a --report path asks for, by its extension
// (.txt .md .json .csv .html .xml), shared by zero-plan estimate and zero-run. Dispatch only;
// the renderings live with their value types.
//
// Example usage:
//   write_file_atomic(path, render_report(comparison, report_kind(path)));
#pragma once

#include <optional>
#include <string>

#include "zp/reports/comparison.hpp"
#include "zp/reports/table.hpp"

namespace zp::reports {

enum class ReportKind { text, markdown, json, csv, html, junit };

// zp::Error naming the path and the extensions when it has none of them.
ReportKind report_kind(const std::string& path);

// The table format of a kind; nullopt for html and junit.
std::optional<Format> table_format(ReportKind k);

// A run's comparison in any kind: render_comparison, render_html or render_comparison_junit.
std::string render_report(const Comparison& c, ReportKind k);

}  // namespace zp::reports
