// cmd_serve.cpp: `zero-plan serve`: cpp-httplib's server, the page, and the two calls it makes.
// A request body is {"model": name | "config": text, "keywords": {flag: value}}; the answer
// {"result": <estimate or fit JSON>, "report": <what the report draws>} or, for bad input,
// HTTP 400 with {"error": ..., "hint": ...}, the CLI's two lines. Calls run one at a time (the
// server's threads share one planner lock). A request can write no file (the keywords that
// would are refused) and must be application/json, so another site cannot post to it.
#include "cmd_serve.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "zero_plan.hpp"
#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/hardware.hpp"
#include "zp/reports/html.hpp"
#include "zp/units.hpp"

namespace zp::cli {

void add_serve_command(CLI::App& app, ServeCommand& c) {
  c.app = app.add_subcommand("serve",
                             "an interactive page on localhost: memory bars, the step's "
                             "timeline and the fit table, redrawn as inputs change");
  c.app->add_option("--port", c.port, "TCP port; 0 picks a free one (printed) [8765]");
  c.app->add_option("--host", c.host,
                    "address to listen on; anything but 127.0.0.1 or ::1 lets other machines use "
                    "the page [127.0.0.1]");
  c.app->footer(
      "Open the printed URL in a browser: pick a catalog model or paste/upload a config.json, set\n"
      "the strategy, profile and hardware; the URL in the address bar holds every input, so it\n"
      "shares the view. Bad input shows the CLI's error and hint. Ctrl-C stops the server.\n"
      "Example:\n  zero-plan serve --port 8080");
}

namespace {

// The page's JSON body as a keyword call of `command`.
KeywordCall call_of(const std::string& command, const std::string& body) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(body);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("request body: not JSON ({})", e.what()), "the page sends JSON");
  }
  if (!j.is_object()) throw Error("request body: not a JSON object", "the page sends one");
  KeywordCall call;
  call.command = command;
  call.caller = "the page";
  call.want_report = command == "estimate";
  if (j.contains("config") && j["config"].is_string() && !j["config"].get<std::string>().empty()) {
    call.model_json = j["config"].get<std::string>();
    call.model_origin = "config";
  } else if (j.contains("model") && j["model"].is_string()) {
    call.keywords.emplace_back("model", j["model"].get<std::string>());
  }
  if (j.contains("keywords")) {
    if (!j["keywords"].is_object()) throw Error("request body: keywords is not an object");
    for (const auto& [k, v] : j["keywords"].items()) {
      // Nothing a request says may write a file on this machine.
      for (const char* writes :
           {"output", "report", "timeline", "emit_deepspeed", "emit_megatron", "trace"})
        if (k == writes) {
          std::string flag = k;
          std::replace(flag.begin(), flag.end(), '_', '-');
          throw Error(
              fmt::format("{}: the page writes no files", k),
              fmt::format("zero-plan {} --{} ... on the command line writes it", command, flag));
        }
      if (v.is_boolean())
        call.keywords.emplace_back(k, v.get<bool>());
      else if (v.is_string())
        call.keywords.emplace_back(k, v.get<std::string>());
      else if (v.is_number_integer())
        call.keywords.emplace_back(k, v.dump());
      else
        throw Error(fmt::format("{}: expected a string, a whole number or a bool", k));
    }
  }
  return call;
}

void reply(httplib::Response& res, int status, const nlohmann::json& j) {
  res.status = status;
  res.set_content(j.dump(), "application/json");
}

}  // namespace

int ServeCommand::run() const {
  const uint64_t p = port == "0" ? 0 : parse_count(port, "--port");  // 0: any free port
  if (p > 65535)
    throw Error(fmt::format("--port: {} is not a TCP port", port),
                "0 to 65535; 0 picks a free one");
  const std::string page = reports::render_serve_page(
      [] {
        std::vector<std::string> names;
        for (const auto& e : models::catalog()) names.push_back(e.name);
        return names;
      }(),
      planner::hardware_preset_names());

  httplib::Server server;
  std::mutex planner_lock;
  server.set_payload_max_length(16 << 20);  // a config.json is kilobytes; a pasted one may be more
  server.Get("/", [&](const httplib::Request&, httplib::Response& res) {
    res.set_content(page, "text/html; charset=utf-8");
  });
  for (const std::string command : {"estimate", "fit"}) {
    server.Post("/api/" + command, [&, command](const httplib::Request& req,
                                                httplib::Response& res) {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        // JSON only: another site's page in the same browser cannot send this type without a
        // CORS preflight, which the server never grants.
        if (!req.get_header_value("Content-Type").starts_with("application/json"))
          throw Error("request: Content-Type must be application/json", "the page sends JSON");
        const KeywordCall call = call_of(command, req.body);
        Output out;
        {
          std::lock_guard<std::mutex> hold(planner_lock);
          out = run_keywords(call);
        }
        reply(res, 200, {{"result", nlohmann::json::parse(out.text)}, {"report", out.report}});
      } catch (const Error& e) {
        reply(res, 400, {{"error", e.what()}, {"hint", e.hint()}});
      } catch (const std::exception& e) {
        reply(res, 500, {{"error", fmt::format("internal error: {}", e.what())}, {"hint", ""}});
      }
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "%s %s %d (%.0f ms)\n", req.method.c_str(), req.path.c_str(), res.status,
                   ms);
      std::fflush(stderr);
    });
  }
  const int bound =
      p == 0 ? server.bind_to_any_port(host)
             : (server.bind_to_port(host, static_cast<int>(p)) ? static_cast<int>(p) : -1);
  if (bound < 0)
    throw Error(
        fmt::format("--port {}: cannot listen on {}:{} (in use, or not this machine's address)",
                    port, host, port),
        "--port 0 picks a free port");
  const bool ipv6 = host.find(':') != std::string::npos;
  std::printf("zero-plan serve: http://%s%s%s:%d/ (Ctrl-C stops it)\n", ipv6 ? "[" : "",
              host.c_str(), ipv6 ? "]" : "", bound);
  if (host != "127.0.0.1" && host != "::1" && host != "localhost")
    std::printf("zero-plan serve: listening on %s: other machines can use this page\n",
                host.c_str());
  std::fflush(stdout);
  server.listen_after_bind();
  return kExitOk;
}

}  // namespace zp::cli
