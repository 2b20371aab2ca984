// Table rendering and atomic writes.
#include <doctest/doctest.h>

#include <filesystem>

#include "process.hpp"
#include "zp/error.hpp"
#include "zp/reports/table.hpp"

using namespace zp::reports;

TEST_CASE("text, markdown and csv renderings") {
  Table t({"name", "bytes"}, {Align::left, Align::right});
  t.add({"params", "12"});
  t.add({"a,b \"q\"", "3456"});
  CHECK(t.render(Format::text) == "name     bytes\n"
                                  "--------------\n"
                                  "params      12\n"
                                  "a,b \"q\"   3456\n");
  CHECK(t.render(Format::markdown) == "| name    | bytes |\n"
                                      "| ------- | ----: |\n"
                                      "| params  |    12 |\n"
                                      "| a,b \"q\" |  3456 |\n");
  CHECK(t.render(Format::csv) == "name,bytes\nparams,12\n\"a,b \"\"q\"\"\",3456\n");
  CHECK_THROWS_AS(t.add({"one cell"}), zp::Error);
}

TEST_CASE("atomic write replaces the file whole, or leaves it alone") {
  zp::test::TempDir dir;
  const std::string path = dir.file("out.txt");
  write_file_atomic(path, "first");
  CHECK(zp::test::slurp(path) == "first");
  write_file_atomic(path, "second");
  CHECK(zp::test::slurp(path) == "second");
  CHECK_THROWS_AS(write_file_atomic(dir.file("missing/dir/out.txt"), "x"), zp::Error);
  // No temporary files are left behind.
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path)) ++n;
  CHECK(n == 1);
}
