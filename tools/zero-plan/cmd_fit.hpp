// cmd_fit.hpp: the `zero-plan fit` subcommand (flags, search, printing), kept apart from
// main.cpp so that each subcommand is one file. No search logic: that is planner/fit.hpp.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "cli.hpp"

namespace zp::cli {

struct FitCommand {
  CLI::App* app = nullptr;
  std::string model, hardware, gpus = "1", nodes, top = "5", format, output, emit_deepspeed,
      emit_megatron, trace, global_batch;
  bool max_model = false;
  bool parallel = false;    // --parallel: tp x sp x pp x vp x cp searched in one round
  bool exhaustive = false;  // --exhaustive: no screening
  bool progress = false;  // --progress: max-model's probes on stderr even when not a terminal
  StrategyFlags flags;
  TargetFlags target;

  bool parsed() const { return app != nullptr && app->parsed(); }
  // The search; writes --emit-deepspeed, --emit-megatron and --trace, and puts what goes to
  // --output (or stdout) in `out`. Exit code: 0 something fits, 1 nothing does (sets
  // flags.n_layer).
  int execute(reports::Format f, std::string& out);
};

// Registers `fit` on `app`; `cmd` must outlive the parse.
void add_fit_command(CLI::App& app, FitCommand& cmd);

}  // namespace zp::cli
