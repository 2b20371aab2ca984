// junit.cpp: JUnit XML writing with escaping.
#include "zp/reports/junit.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace zp::reports {

std::string xml_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        // XML 1.0 allows #x9 | #xA | #xD among the controls (section 2.2, production Char).
        if (c < 0x20 && c != '\t' && c != '\n' && c != '\r') out += '?';
        else out += ch;
    }
  }
  return out;
}

std::string render_junit(const std::vector<JunitSuite>& suites) {
  std::size_t n_tests = 0, n_failures = 0;
  for (const JunitSuite& s : suites)
    for (const JunitCase& c : s.cases) {
      ++n_tests;
      n_failures += c.failures.empty() ? 0 : 1;
    }
  std::string out = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  out += fmt::format("<testsuites tests=\"{}\" failures=\"{}\" errors=\"0\">\n", n_tests, n_failures);
  for (const JunitSuite& s : suites) {
    std::size_t failed = 0;
    double seconds = 0;
    for (const JunitCase& c : s.cases) {
      failed += c.failures.empty() ? 0 : 1;
      seconds += c.seconds;
    }
    out += fmt::format("  <testsuite name=\"{}\" tests=\"{}\" failures=\"{}\" errors=\"0\" "
                       "skipped=\"0\" time=\"{:.3f}\">\n",
                       xml_escape(s.name), s.cases.size(), failed, seconds);
    for (const JunitCase& c : s.cases) {
      out += fmt::format("    <testcase name=\"{}\" classname=\"{}\" time=\"{:.3f}\"",
                         xml_escape(c.name), xml_escape(c.classname), c.seconds);
      if (c.failures.empty() && c.system_out.empty()) {
        out += "/>\n";
        continue;
      }
      out += ">\n";
      // One <failure> per testcase (the Ant JUnit schema allows no more): every message, in
      // the attribute joined by "; ", in the body one per line.
      if (!c.failures.empty())
        out += fmt::format("      <failure message=\"{}\" type=\"failure\">{}</failure>\n",
                           xml_escape(fmt::format("{}", fmt::join(c.failures, "; "))),
                           xml_escape(fmt::format("{}", fmt::join(c.failures, "\n"))));
      if (!c.system_out.empty())
        out += fmt::format("      <system-out>{}</system-out>\n", xml_escape(c.system_out));
      out += "    </testcase>\n";
    }
    out += "  </testsuite>\n";
  }
  out += "</testsuites>\n";
  return out;
}

}  // namespace zp::reports
