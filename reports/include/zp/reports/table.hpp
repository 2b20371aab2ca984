// zp/reports/table.hpp: one table type rendered as aligned text, Markdown or CSV, the output
// formats every command shares; and atomic file writes (temp file + rename), so no output is
// ever half-written. JSON is not here: each value type has its own to_json.
//
// Example usage:
//   zp::reports::Table t({"category", "bytes"}, {Align::left, Align::right});
//   t.add({"params", "13.48 GiB"});
//   std::string out = t.render(zp::reports::Format::markdown);
//   zp::reports::write_file_atomic("out.md", out);
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace zp::reports {

enum class Format { text, markdown, json, csv };
std::optional<Format> format_from_string(std::string_view s);
std::string_view to_string(Format f);

enum class Align { left, right };

class Table {
 public:
  Table(std::vector<std::string> header, std::vector<Align> align);
  void add(std::vector<std::string> row);     // must have one cell per column
  void add_rule();                             // a horizontal rule (text and Markdown only)
  std::string render(Format f) const;          // text, markdown or csv (not json)
  std::size_t size() const { return rows_.size(); }

 private:
  std::vector<std::string> header_;
  std::vector<Align> align_;
  std::vector<std::vector<std::string>> rows_;  // an empty row is a rule
};

// Quotes a CSV field when it holds a comma, quote or newline (RFC 4180).
std::string csv_field(std::string_view s);

// Writes `content` to `path` through a temporary file in the same directory and a rename.
// zp::Error naming the path when it cannot; the target is untouched on failure.
void write_file_atomic(const std::string& path, std::string_view content);

}  // namespace zp::reports
