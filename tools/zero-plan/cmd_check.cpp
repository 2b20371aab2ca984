// cmd_check.cpp: zero-plan check: predict every case of a budgets file, print the table, write
// JUnit, accept new predictions with --update (the file is rewritten atomically).
#include "cmd_check.hpp"

#include <fmt/format.h>

#include "cli.hpp"
#include "zp/json_fields.hpp"
#include "zp/reports/budgets.hpp"

namespace zp::cli {

std::unique_ptr<CheckCommand> add_check_command(CLI::App& parent) {
  auto c = std::make_unique<CheckCommand>();
  c->app = parent.add_subcommand("check", "hold predictions against memory budgets (for CI)");
  c->app->add_option("budgets", c->file, "a budgets file (schema zero-plan/budgets/v1)")->required();
  c->app->add_option("--junit", c->junit, "also write JUnit XML here, one testcase per case");
  c->app->add_flag("--update", c->update,
                   "accept the current predictions: rewrite each case's \"accepted\" values "
                   "(atomically); budgets are never changed");
  add_format_flag(*c->app, c->format);
  c->app->footer(
      "A budgets file lists cases (model, strategy, hardware) with a limit per tier (\"30 GiB\" or\n"
      "\"90% of device\") and the last accepted prediction. Exit 1 when a case is over its budget\n"
      "or grew more than max_growth_pct (default 1%) since the accepted value; 0 otherwise.\n"
      "With --update, growth is accepted and only budgets fail. Example:\n"
      "  zero-plan check tests/budgets/catalog.json --junit check.xml\n"
      "  zero-plan check tests/budgets/catalog.json --update && git diff tests/budgets");
  return c;
}

int CheckCommand::execute(reports::Format f, std::string& out) const {
  const reports::Budgets b = reports::load_budgets(file);
  const reports::CheckReport r = reports::check_budgets(b);
  // The file is read again just before it is replaced, so a concurrent edit is noticed rather
  // than overwritten with stale content.
  std::string updated;
  if (update) updated = reports::with_accepted(read_text_file(file), r, file);
  if (!junit.empty()) emit(junit, reports::render_check_junit(r));
  out += reports::render_check(r, f);
  if (update) {
    emit(file, updated);
    if (f == reports::Format::text || f == reports::Format::markdown)
      out += fmt::format("updated {}: accepted the predictions of {} case{}\n", file,
                         r.cases.size(), r.cases.size() == 1 ? "" : "s");
    return r.over_budget() ? kExitCheckFailed : kExitOk;
  }
  return r.passed() ? kExitOk : kExitCheckFailed;
}

}  // namespace zp::cli
