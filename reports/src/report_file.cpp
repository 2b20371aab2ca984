// report_file.cpp: --report extension dispatch.
#include "zp/reports/report_file.hpp"

#include <fmt/format.h>

#include "zp/error.hpp"
#include "zp/reports/html.hpp"

namespace zp::reports {

ReportKind report_kind(const std::string& path) {
  auto ends = [&](std::string_view e) {
    return path.size() > e.size() && path.compare(path.size() - e.size(), e.size(), e) == 0;
  };
  if (ends(".json")) return ReportKind::json;
  if (ends(".md")) return ReportKind::markdown;
  if (ends(".csv")) return ReportKind::csv;
  if (ends(".txt")) return ReportKind::text;
  if (ends(".html") || ends(".htm")) return ReportKind::html;
  if (ends(".xml")) return ReportKind::junit;
  throw Error(fmt::format("--report {}: unknown extension", path),
              "use .html (charts), .json, .md, .csv, .txt or .xml (JUnit)");
}

std::optional<Format> table_format(ReportKind k) {
  switch (k) {
    case ReportKind::text: return Format::text;
    case ReportKind::markdown: return Format::markdown;
    case ReportKind::json: return Format::json;
    case ReportKind::csv: return Format::csv;
    case ReportKind::html:
    case ReportKind::junit: return std::nullopt;
  }
  return std::nullopt;
}

std::string render_report(const Comparison& c, ReportKind k) {
  if (k == ReportKind::html) return render_html(c);
  if (k == ReportKind::junit) return render_comparison_junit(c);
  return render_comparison(c, *table_format(k));
}

}  // namespace zp::reports
