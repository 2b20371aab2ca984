// table.cpp: text/Markdown/CSV rendering and atomic writes.
#include "zp/reports/table.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "zp/error.hpp"

namespace zp::reports {

std::optional<Format> format_from_string(std::string_view s) {
  if (s == "text") return Format::text;
  if (s == "markdown" || s == "md") return Format::markdown;
  if (s == "json") return Format::json;
  if (s == "csv") return Format::csv;
  return std::nullopt;
}

std::string_view to_string(Format f) {
  switch (f) {
    case Format::text: return "text";
    case Format::markdown: return "markdown";
    case Format::json: return "json";
    case Format::csv: return "csv";
  }
  return "?";
}

Table::Table(std::vector<std::string> header, std::vector<Align> align)
    : header_(std::move(header)), align_(std::move(align)) {
  align_.resize(header_.size(), Align::left);
}

void Table::add(std::vector<std::string> row) {
  if (row.size() != header_.size())
    throw Error(fmt::format("table row has {} cells, expected {}", row.size(), header_.size()));
  rows_.push_back(std::move(row));
}

void Table::add_rule() { rows_.emplace_back(); }

std::string csv_field(std::string_view s) {
  if (s.find_first_of(",\"\n\r") == std::string_view::npos) return std::string(s);
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

namespace {
// Display width in columns: counts UTF-8 code points, not bytes.
std::size_t width(std::string_view s) {
  std::size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}
std::string pad(std::string_view s, std::size_t w, Align a) {
  const std::string fill(w > width(s) ? w - width(s) : 0, ' ');
  return a == Align::left ? std::string(s) + fill : fill + std::string(s);
}
}  // namespace

std::string Table::render(Format f) const {
  std::string out;
  if (f == Format::csv) {
    auto line = [&](const std::vector<std::string>& cells) {
      for (std::size_t i = 0; i < cells.size(); ++i) {
        if (i > 0) out += ',';
        out += csv_field(cells[i]);
      }
      out += '\n';
    };
    line(header_);
    for (const auto& r : rows_)
      if (!r.empty()) line(r);
    return out;
  }
  std::vector<std::size_t> w(header_.size());
  for (std::size_t i = 0; i < header_.size(); ++i) w[i] = width(header_[i]);
  for (const auto& r : rows_)
    for (std::size_t i = 0; i < r.size(); ++i) w[i] = std::max(w[i], width(r[i]));
  if (f == Format::markdown) {
    auto line = [&](const std::vector<std::string>& cells) {
      out += "|";
      for (std::size_t i = 0; i < cells.size(); ++i) {
        std::string cell = cells[i];
        for (std::size_t p = 0; (p = cell.find('|', p)) != std::string::npos; p += 2)
          cell.replace(p, 1, "\\|");
        out += fmt::format(" {} |", pad(cell, w[i], align_[i]));
      }
      out += '\n';
    };
    line(header_);
    out += "|";
    for (std::size_t i = 0; i < w.size(); ++i) {
      const std::size_t dashes = std::max<std::size_t>(w[i], 3);
      out += fmt::format(" {:-<{}}{} |", "", align_[i] == Align::right ? dashes - 1 : dashes,
                         align_[i] == Align::right ? ":" : "");
    }
    out += '\n';
    for (const auto& r : rows_)
      if (!r.empty()) line(r);
    return out;
  }
  // text: columns separated by two spaces, a dashed rule under the header.
  auto line = [&](const std::vector<std::string>& cells) {
    std::string l;
    for (std::size_t i = 0; i < cells.size(); ++i) {
      if (i > 0) l += "  ";
      l += pad(cells[i], w[i], align_[i]);
    }
    while (!l.empty() && l.back() == ' ') l.pop_back();
    out += l + '\n';
  };
  std::size_t total = 0;
  for (std::size_t x : w) total += x;
  total += 2 * (w.size() - 1);
  line(header_);
  out += std::string(total, '-') + '\n';
  for (const auto& r : rows_) {
    if (r.empty()) out += std::string(total, '-') + '\n';
    else line(r);
  }
  return out;
}

void write_file_atomic(const std::string& path, std::string_view content) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::string tmpl = (dir / fmt::format(".{}.tmp.XXXXXX", target.filename().string())).string();
  const int fd = ::mkstemp(tmpl.data());
  if (fd < 0)
    throw Error(fmt::format("cannot write '{}': {}", path, std::strerror(errno)),
                "check that the directory exists and is writable");
  auto fail = [&](const char* op) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmpl.c_str());
    throw Error(fmt::format("cannot write '{}': {} failed: {}", path, op, std::strerror(err)),
                "check free space and permissions");
  };
  std::size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write");
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) fail("fsync");
  if (::fchmod(fd, 0644) != 0) fail("fchmod");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmpl.c_str());
    throw Error(fmt::format("cannot write '{}': close failed: {}", path, std::strerror(err)));
  }
  if (::rename(tmpl.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmpl.c_str());
    throw Error(fmt::format("cannot write '{}': rename failed: {}", path, std::strerror(err)));
  }
}

}  // namespace zp::reports
