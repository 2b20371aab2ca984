// zero-plan: capacity estimates and plans for ZeRO training. A thin CLI: it parses flags,
// calls the planner and prints through reports; no planning logic lives here.
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "cmd_fit.hpp"
#include "cmd_check.hpp"
#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/model_states.hpp"
#include "zp/planner/plan.hpp"
#include "zp/reports/html.hpp"
#include "zp/reports/planner_reports.hpp"
#include "zp/reports/report_file.hpp"
#include "zp/units.hpp"

namespace {

using namespace zp;

std::vector<uint64_t> parse_list(const std::string& text, const std::string& flag) {
  std::vector<uint64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(parse_count(item, flag));
  if (out.empty()) throw Error(fmt::format("{}: empty list", flag), "e.g. " + flag + " 1,4,16");
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"zero-plan: will this ZeRO training run fit, where should each byte live?\n"
               "Predicts per-device memory for ZeRO stages 0-3, ZeRO-Offload and ZeRO-Infinity.",
               "zero-plan"};
  app.require_subcommand(1);
  app.footer(
      "Examples:\n"
      "  zero-plan table                                   # the ZeRO paper's table\n"
      "  zero-plan models                                  # the model catalog\n"
      "  zero-plan estimate --model llama-2-7b --stage 3 --dp 8 --hardware a100-80g\n"
      "  zero-plan estimate --model ./config.json --ds-config ds.json --format json\n"
      "  zero-plan fit --model gpt2-xl --hardware v100-32g --gpus 16   # fastest that fits\n"
      "  zero-plan estimate --model gpt2-xl --stage 2 --dp 8 --report gpt2-xl.html\n"
      "  zero-plan check tests/budgets/catalog.json --junit check.xml\n"
      "Exit codes: 0 ok, 1 a check failed, 2 bad usage or input (with 'error:' and 'hint:').");

  // table
  std::string table_params = "7.5e9,128e9,1e12", table_dp = "1,4,16,64,256,1024", table_k = "12";
  std::string table_format;
  auto* table = app.add_subcommand("table", "the ZeRO paper's model-state table, plus stage 0");
  table->add_option("--params", table_params, "model sizes, comma-separated [7.5e9,128e9,1e12]");
  table->add_option("--dp", table_dp, "data-parallel degrees [1,4,16,64,256,1024]");
  table->add_option("--k", table_k, "optimizer bytes per parameter (12: mixed-precision Adam) [12]");
  zp::cli::add_format_flag(*table, table_format);
  table->footer("Text prints GB (1e9 bytes) rounded as the paper prints; json gives exact bytes.\n"
                "Example: zero-plan table --params 175e9 --dp 8,64,512");

  // models
  std::string models_name, models_format;
  auto* models = app.add_subcommand("models", "the model catalog, or one model's parameter inventory");
  models->add_option("model", models_name, "a catalog name or config.json: list its tensors");
  zp::cli::add_format_flag(*models, models_format);
  models->footer("Examples:\n  zero-plan models\n  zero-plan models llama-2-70b --format csv");

  // estimate
  std::string est_model, est_hw, est_format, est_output, est_timeline, est_report;
  zp::cli::StrategyFlags est_flags;
  zp::cli::TargetFlags est_target;
  auto* est = app.add_subcommand("estimate", "per-device memory for one model and strategy");
  est->add_option("--model", est_model, "catalog name (zero-plan models) or a HF config.json "
                  "[the model --megatron-args describes]");
  est->add_option("--hardware", est_hw, "preset (v100-32g, a100-40g, a100-80g, h100-80g, h200-141g) "
                  "or a hardware JSON file: adds the fits verdict");
  zp::cli::add_strategy_flags(*est, est_flags);
  zp::cli::add_target_flags(*est, est_target, "cuda");
  zp::cli::add_format_flag(*est, est_format);
  est->add_option("-o,--output", est_output, "write to this file (atomically) instead of stdout");
  est->add_option("--timeline", est_timeline,
                  "write the memory timeline of one step as a Chrome trace (open in Perfetto)");
  est->add_option("--report", est_report,
                  "also write a report file: .html (charts, self-contained), .json, .md, .csv or .txt");
  est->footer("Examples:\n"
              "  zero-plan estimate --model gpt2-xl --stage 2 --dp 8\n"
              "  zero-plan estimate --model llama-2-70b --stage 3 --dp 64 --offload-optimizer cpu "
              "--hardware a100-80g\n"
              "  zero-plan estimate --model llama-2-7b --ds-config ds_config.json --dp 8 --format json");

  // plan
  std::string plan_model, plan_output, plan_seed = "1234";
  zp::cli::StrategyFlags plan_flags;
  zp::cli::TargetFlags plan_target;
  auto* plan = app.add_subcommand("plan", "write a plan file that zero-run executes and checks");
  plan->add_option("--model", plan_model, "catalog name or a HF config.json [the model --megatron-args describes]");
  zp::cli::add_strategy_flags(*plan, plan_flags);
  zp::cli::add_target_flags(*plan, plan_target, "cpu");
  plan->add_option("--seed", plan_seed, "seed of the weights and the data order [1234]");
  plan->add_option("-o,--output", plan_output, "plan file to write (atomically)")->required();
  plan->footer("Example:\n  zero-plan plan --model gpt2-tiny --stage 2 --dp 2 -o plan.json\n"
               "  mpirun -np 2 zero-run plan.json");

  zp::cli::FitCommand fit_cmd;
  zp::cli::add_fit_command(app, fit_cmd);
  // check (cmd_check.cpp)
  const auto check = zp::cli::add_check_command(app);

  return zp::cli::run(app, argc, argv, [&]() -> int {
    if (table->parsed()) {
      const auto fmt_ = zp::cli::parse_format(table_format);
      const auto params = parse_list(table_params, "--params");
      const auto dps = parse_list(table_dp, "--dp");
      const uint64_t k = parse_count(table_k, "--k");
      zp::cli::emit("", zp::reports::render_zero_table(planner::zero_table(params, dps, k), k, fmt_));
    } else if (models->parsed()) {
      const auto fmt_ = zp::cli::parse_format(models_format);
      if (models_name.empty()) zp::cli::emit("", zp::reports::render_catalog(fmt_));
      else zp::cli::emit("", zp::reports::render_inventory(models::load_model(models_name), fmt_));
    } else if (est->parsed()) {
      const auto fmt_ = zp::cli::parse_format(est_format);
      const auto m = zp::cli::load_model(est_model, est_flags);
      const auto o = est_target.resolve(planner::Backend::cuda, &est_flags);
      std::vector<std::string> assumed;
      const auto s = est_flags.resolve(o, &assumed);
      std::optional<planner::Hardware> hw;
      if (!est_hw.empty()) hw = planner::load_hardware(est_hw);
      const auto e = planner::estimate(m, s, hw ? &*hw : nullptr, o, std::move(assumed));
      if (!est_timeline.empty())
        zp::cli::emit(est_timeline, planner::timeline_trace(e.schedule, e.memory).dump() + "\n");
      if (!est_report.empty()) {
        const auto kind = zp::reports::report_kind(est_report);
        if (kind == zp::reports::ReportKind::html)
          zp::cli::emit(est_report, zp::reports::render_html(zp::reports::comparison_from_estimate(e)));
        else if (const auto tf = zp::reports::table_format(kind))
          zp::cli::emit(est_report, zp::reports::render_estimate(e, *tf));
        else
          throw Error(fmt::format("--report {}: an estimate has no JUnit report", est_report),
                      "use .html, .json, .md, .csv or .txt; zero-run and zero-plan check write JUnit");
      }
      zp::cli::emit(est_output, zp::reports::render_estimate(e, fmt_));
    } else if (fit_cmd.parsed()) {
      return fit_cmd.run();
    } else if (plan->parsed()) {
      const auto m = zp::cli::load_model(plan_model, plan_flags);
      const auto o = plan_target.resolve(planner::Backend::cpu, &plan_flags);
      const auto p = planner::make_plan(m, plan_flags.resolve(o), o,
                                        parse_count(plan_seed, "--seed"));
      zp::cli::emit(plan_output, planner::to_json(p).dump(2) + "\n");
    } else if (check->app->parsed()) {
      return check->run();
    }
    return zp::cli::kExitOk;
  });
}
