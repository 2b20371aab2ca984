// zero_plan.hpp: the whole `zero-plan` command line as one object: its subcommands and flags,
// and what each one computes. The zero-plan binary (main.cpp) parses argv into it and prints;
// the Python module (python/src/module.cpp) and `zero-plan serve`'s page (cmd_serve.cpp) call
// run_keywords(), which parses flags built from keyword arguments into the same object and
// takes the JSON contract's text back. One parser, one code path for all three.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "cmd_check.hpp"
#include "cmd_fit.hpp"
#include "cmd_serve.hpp"

namespace zp::cli {

// What a subcommand produced: its exit code (DESIGN.md), and the text that goes to its
// -o/--output file, or to stdout where it has none.
struct Output {
  int code = kExitOk;
  std::string text;
  std::string path;  // "" for stdout
  // estimate, when asked for: what the HTML report draws (reports::html_data), else null.
  nlohmann::json report;
};

class ZeroPlan {
 public:
  // plan_output_required: `plan` insists on -o (the command line); the Python module returns
  // the plan and writes a file only when asked.
  explicit ZeroPlan(bool plan_output_required = true);
  ZeroPlan(const ZeroPlan&) = delete;
  ZeroPlan& operator=(const ZeroPlan&) = delete;

  CLI::App& app() { return app_; }

  // Inputs held in memory rather than named on the command line (the Python module's dicts):
  // a model config's JSON text stands for --model, a DeepSpeed config for --ds-config, in
  // whichever of estimate, plan and fit is parsed. `origin` names them in errors.
  void set_model_json(std::string text, std::string origin);
  void set_ds_config(nlohmann::json config, std::string origin);

  // Runs the parsed subcommand. Side files (--report, --timeline, --junit, --emit-*, a plan's
  // -o) are written as on the command line; the result's text is returned, not printed.
  // `format` overrides every --format (the Python module asks for json).
  Output execute(std::optional<reports::Format> format = std::nullopt);

  // estimate: also fill Output::report (the page draws it).
  void set_want_report(bool on) { want_report_ = on; }

 private:
  CLI::App app_;
  CLI::App *table_ = nullptr, *models_ = nullptr, *estimate_ = nullptr, *plan_ = nullptr;
  std::string table_params_ = "7.5e9,128e9,1e12", table_dp_ = "1,4,16,64,256,1024", table_k_ = "12",
              table_format_;
  std::string models_name_, models_format_;
  std::string est_model_, est_hw_, est_format_, est_output_, est_timeline_, est_report_;
  StrategyFlags est_flags_;
  TargetFlags est_target_;
  std::string plan_model_, plan_output_, plan_seed_ = "1234";
  StrategyFlags plan_flags_;
  TargetFlags plan_target_;
  FitCommand fit_;
  std::unique_ptr<CheckCommand> check_;
  ServeCommand serve_;
  bool want_report_ = false;
};

// A keyword argument: a flag's long name with '_' for '-' ("offload_optimizer"), and its value
// spelled as on the command line ("cpu", "7500000000", "1,4,16"), or a bool for a switch
// (True: --name; False: --no-name where the switch has one, else its default).
using Keyword = std::pair<std::string, std::variant<bool, std::string>>;

// One zero-plan subcommand called with keyword arguments instead of argv.
struct KeywordCall {
  std::string command;  // estimate, plan, fit, table, check or models
  std::string caller;   // how errors name it: "zeroplan.estimate()"
  std::vector<std::string> positional;
  std::vector<Keyword> keywords;
  std::string model_json, model_origin = "model";  // a config in memory, for --model
  nlohmann::json ds_config;                        // a DeepSpeed config in memory; null: none
  bool want_report = false;                        // estimate: Output::report too
};

// Parses the call with zero-plan's flag definitions and runs it with --format json: the result's
// text is the JSON contract, written to its -o/--output file too where one was given. Bad input
// (an unknown keyword, with the closest names; a value for a switch; every error of the command
// line) throws zp::Error.
Output run_keywords(const KeywordCall& call);

// main() of the zero-plan binary: parse, execute, print; exit codes of DESIGN.md.
int zero_plan_main(int argc, char** argv);

}  // namespace zp::cli
