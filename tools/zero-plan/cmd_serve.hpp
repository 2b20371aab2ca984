// cmd_serve.hpp: `zero-plan serve`, one page on localhost over the same code as the command
// line: the page (reports::render_serve_page) posts its inputs to /api/estimate and /api/fit,
// which run them as keyword calls (zero_plan.hpp run_keywords) and answer with the JSON
// contracts' data, or the CLI's error and hint.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace zp::cli {

struct ServeCommand {
  CLI::App* app = nullptr;
  std::string host = "127.0.0.1", port = "8765";
  bool parsed() const { return app != nullptr && app->parsed(); }
  // Serves until the process is stopped; 2 (bad input) when it cannot listen.
  int run() const;
};

void add_serve_command(CLI::App& app, ServeCommand& cmd);

}  // namespace zp::cli
