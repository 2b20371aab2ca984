// zp/reports/junit.hpp: JUnit XML, the test-report format CI systems (GitLab, Jenkins, GitHub
// test reporters) display: suites of test cases, each passed or failed with a message. A writer
// only, with XML escaping; not a general XML library and not a reader.
//
// Example usage:
//   JunitSuite s{"zero-plan check", {}};
//   s.cases.push_back({"gpt2-xl stage 2", "budgets.json", 0.01, {"gpu over budget by 1 GiB"}, ""});
//   write_file_atomic("check.xml", render_junit({s}));
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace zp::reports {

struct JunitCase {
  std::string name;
  std::string classname;              // the group it belongs to (the budgets file, the run)
  double seconds = 0;
  std::vector<std::string> failures;  // empty: passed; else one <failure> holding them all
  std::string system_out;             // details shown next to the case; may be empty
};

struct JunitSuite {
  std::string name;
  std::vector<JunitCase> cases;
};

// <?xml ...?><testsuites tests= failures=><testsuite name= tests= failures= errors="0"
// time=><testcase name= classname= time=><failure message= type="failure">...</failure>
// <system-out>...</system-out></testcase>...
std::string render_junit(const std::vector<JunitSuite>& suites);

// Escapes & < > " ' for XML text and attribute values; characters XML 1.0 forbids (controls
// other than tab, newline, carriage return) become '?'.
std::string xml_escape(std::string_view s);

}  // namespace zp::reports
