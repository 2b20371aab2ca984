// cmd_check.hpp: `zero-plan check budgets.json`, the CI memory-budget gate, as a subcommand
// that main.cpp registers and dispatches to. Parsing and printing only; reading budgets and
// checking them is zp/reports/budgets.hpp.
#pragma once

#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "zp/reports/table.hpp"

namespace zp::cli {

struct CheckCommand {
  CLI::App* app = nullptr;
  std::string file, junit, format;
  bool update = false;
  // 0 every case within budget and growth, 1 a case failed, 2 bad input (via zp::Error).
  // Writes --junit and the --update'd file; what goes to stdout is appended to `out`.
  int execute(reports::Format f, std::string& out) const;
};

// Adds the `check` subcommand to `parent`; the returned object holds its flags.
std::unique_ptr<CheckCommand> add_check_command(CLI::App& parent);

}  // namespace zp::cli
