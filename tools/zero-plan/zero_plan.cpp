// zero_plan.cpp: zero-plan's subcommands (table, models, estimate, plan; fit and check have
// files of their own) and what each computes. Thin: parse, call the planner, render through
// reports; no planning logic lives here.
#include "zero_plan.hpp"

#include <algorithm>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/model_states.hpp"
#include "zp/planner/plan.hpp"
#include "zp/reports/html.hpp"
#include "zp/reports/planner_reports.hpp"
#include "zp/reports/report_file.hpp"
#include "zp/units.hpp"

namespace zp::cli {

namespace {

std::vector<uint64_t> parse_list(const std::string& text, const std::string& flag) {
  std::vector<uint64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(parse_count(item, flag));
  if (out.empty()) throw Error(fmt::format("{}: empty list", flag), "e.g. " + flag + " 1,4,16");
  return out;
}

}  // namespace

ZeroPlan::ZeroPlan(bool plan_output_required)
    : app_{
          "zero-plan: will this ZeRO training run fit, where should each byte live?\n"
          "Predicts per-device memory for ZeRO stages 0-3, ZeRO-Offload and ZeRO-Infinity.",
          "zero-plan"} {
  CLI::App& app = app_;
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
      "  zero-plan serve                                   # the same in a browser page\n"
      "Exit codes: 0 ok, 1 a check failed, 2 bad usage or input (with 'error:' and 'hint:').\n"
      "From Python: import zeroplan; zeroplan.estimate(\"gpt2-xl\", stage=2, dp=8) (python/).");

  table_ = app.add_subcommand("table", "the ZeRO paper's model-state table, plus stage 0");
  table_->add_option("--params", table_params_, "model sizes, comma-separated [7.5e9,128e9,1e12]");
  table_->add_option("--dp", table_dp_, "data-parallel degrees [1,4,16,64,256,1024]");
  table_->add_option("--k", table_k_,
                     "optimizer bytes per parameter (12: mixed-precision Adam) [12]");
  add_format_flag(*table_, table_format_);
  table_->footer(
      "Text prints GB (1e9 bytes) rounded as the paper prints; json gives exact bytes.\n"
      "Example: zero-plan table --params 175e9 --dp 8,64,512");

  models_ = app.add_subcommand("models", "the model catalog, or one model's parameter inventory");
  models_->add_option("model", models_name_, "a catalog name or config.json: list its tensors");
  add_format_flag(*models_, models_format_);
  models_->footer("Examples:\n  zero-plan models\n  zero-plan models llama-2-70b --format csv");

  estimate_ = app.add_subcommand("estimate", "per-device memory for one model and strategy");
  CLI::App& est = *estimate_;
  est.add_option("--model", est_model_,
                 "catalog name (zero-plan models) or a HF config.json "
                 "[the model --megatron-args describes]");
  est.add_option("--hardware", est_hw_,
                 "preset (v100-32g, a100-40g, a100-80g, h100-80g, h200-141g) "
                 "or a hardware JSON file: adds the fits verdict");
  add_strategy_flags(est, est_flags_);
  add_target_flags(est, est_target_, "cuda");
  add_format_flag(est, est_format_);
  est.add_option("-o,--output", est_output_, "write to this file (atomically) instead of stdout");
  est.add_option("--timeline", est_timeline_,
                 "write the memory timeline of one step as a Chrome trace (open in Perfetto)");
  est.add_option(
      "--report", est_report_,
      "also write a report file: .html (charts, self-contained), .json, .md, .csv or .txt");
  est.footer(
      "Examples:\n"
      "  zero-plan estimate --model gpt2-xl --stage 2 --dp 8\n"
      "  zero-plan estimate --model llama-2-70b --stage 3 --dp 64 --offload-optimizer cpu "
      "--hardware a100-80g\n"
      "  zero-plan estimate --model llama-2-7b --ds-config ds_config.json --dp 8 --format json");

  plan_ = app.add_subcommand("plan", "write a plan file that zero-run executes and checks");
  CLI::App& plan = *plan_;
  plan.add_option("--model", plan_model_,
                  "catalog name or a HF config.json [the model --megatron-args describes]");
  add_strategy_flags(plan, plan_flags_);
  add_target_flags(plan, plan_target_, "cpu");
  plan.add_option("--seed", plan_seed_, "seed of the weights and the data order [1234]");
  plan.add_option("-o,--output", plan_output_, "plan file to write (atomically)")
      ->required(plan_output_required);
  plan.footer(
      "Example:\n  zero-plan plan --model gpt2-tiny --stage 2 --dp 2 -o plan.json\n"
      "  mpirun -np 2 zero-run plan.json");

  add_fit_command(app, fit_);
  check_ = add_check_command(app);
  add_serve_command(app, serve_);
}

void ZeroPlan::set_model_json(std::string text, std::string origin) {
  for (StrategyFlags* f : {&est_flags_, &plan_flags_, &fit_.flags}) {
    f->model_json = text;
    f->model_json_origin = origin;
  }
}

void ZeroPlan::set_ds_config(nlohmann::json config, std::string origin) {
  for (StrategyFlags* f : {&est_flags_, &plan_flags_, &fit_.flags}) {
    f->ds_config_json = config;
    f->ds_config_origin = origin;
  }
}

Output ZeroPlan::execute(std::optional<reports::Format> format) {
  auto format_of = [&](const std::string& flag) { return format ? *format : parse_format(flag); };
  if (table_->parsed()) {
    const auto fmt_ = format_of(table_format_);
    const auto params = parse_list(table_params_, "--params");
    const auto dps = parse_list(table_dp_, "--dp");
    const uint64_t k = parse_count(table_k_, "--k");
    return {
        kExitOk, reports::render_zero_table(planner::zero_table(params, dps, k), k, fmt_), "", {}};
  }
  if (models_->parsed()) {
    const auto fmt_ = format_of(models_format_);
    return {kExitOk,
            models_name_.empty()
                ? reports::render_catalog(fmt_)
                : reports::render_inventory(models::load_model(models_name_), fmt_),
            "",
            {}};
  }
  if (estimate_->parsed()) {
    const auto fmt_ = format_of(est_format_);
    const auto m = load_model(est_model_, est_flags_);
    const auto o = est_target_.resolve(planner::Backend::cuda, &est_flags_);
    std::vector<std::string> assumed;
    const auto s = est_flags_.resolve(o, &assumed);
    std::optional<planner::Hardware> hw;
    if (!est_hw_.empty()) hw = planner::load_hardware(est_hw_);
    const auto e = planner::estimate(m, s, hw ? &*hw : nullptr, o, std::move(assumed));
    if (!est_timeline_.empty())
      emit(est_timeline_, planner::timeline_trace(e.schedule, e.memory).dump() + "\n");
    if (!est_report_.empty()) {
      const auto kind = reports::report_kind(est_report_);
      if (kind == reports::ReportKind::html)
        emit(est_report_, reports::render_html(reports::comparison_from_estimate(e)));
      else if (const auto tf = reports::table_format(kind))
        emit(est_report_, reports::render_estimate(e, *tf));
      else
        throw Error(
            fmt::format("--report {}: an estimate has no JUnit report", est_report_),
            "use .html, .json, .md, .csv or .txt; zero-run and zero-plan check write JUnit");
    }
    Output out{kExitOk, reports::render_estimate(e, fmt_), est_output_, {}};
    if (want_report_) out.report = reports::html_data(reports::comparison_from_estimate(e));
    return out;
  }
  if (fit_.parsed()) {
    std::string text;
    const int code = fit_.execute(format_of(fit_.format), text);
    return {code, std::move(text), fit_.output, {}};
  }
  if (plan_->parsed()) {
    const auto m = load_model(plan_model_, plan_flags_);
    const auto o = plan_target_.resolve(planner::Backend::cpu, &plan_flags_);
    const auto p =
        planner::make_plan(m, plan_flags_.resolve(o), o, parse_count(plan_seed_, "--seed"));
    const std::string text = planner::to_json(p).dump(2) + "\n";
    // The plan file is the output; on the command line nothing else is printed.
    if (!plan_output_.empty()) emit(plan_output_, text);
    return {kExitOk, format ? text : std::string(), "", {}};
  }
  if (check_->app->parsed()) {
    std::string text;
    const int code = check_->execute(format_of(check_->format), text);
    return {code, std::move(text), "", {}};
  }
  if (serve_.parsed()) return {serve_.run(), "", "", {}};
  return {};
}

namespace {

// The keywords a subcommand takes: its flags' long names with '_' for '-'.
std::vector<std::string> keyword_names(const CLI::App& sub) {
  std::vector<std::string> names;
  for (const CLI::Option* o : sub.get_options())
    for (std::string n : o->get_lnames())
      if (n != "help" && !n.starts_with("no-")) {
        std::replace(n.begin(), n.end(), '-', '_');
        names.push_back(std::move(n));
      }
  return names;
}

std::vector<std::string> keyword_args(const CLI::App& sub, const std::string& caller,
                                      const std::vector<Keyword>& keywords) {
  std::vector<std::string> args;
  for (const auto& [name, value] : keywords) {
    std::string lname = name;
    std::replace(lname.begin(), lname.end(), '_', '-');
    const CLI::Option* opt = lname.starts_with("no-") || lname == "help"
                                 ? nullptr
                                 : sub.get_option_no_throw("--" + lname);
    if (opt == nullptr || opt->get_lnames().empty()) {
      const auto names = keyword_names(sub);
      const auto near =
          models::closest_names(name, std::vector<std::string_view>(names.begin(), names.end()), 3);
      throw Error(fmt::format("{}: not an argument of {}", name, caller),
                  near.empty() ? fmt::format("zero-plan {} --help lists them", sub.get_name())
                               : fmt::format("closest: {}", fmt::join(near, ", ")));
    }
    const bool is_switch = opt->get_items_expected_max() == 0;  // a flag takes no value
    if (const bool* b = std::get_if<bool>(&value)) {
      if (!is_switch)
        throw Error(fmt::format("{}: takes a value, not {}", name, *b ? "True" : "False"),
                    fmt::format("e.g. {}=... as zero-plan's --{} takes", name, lname));
      if (*b)
        args.push_back("--" + lname);
      else if (opt->check_lname("no-" + lname))
        args.push_back("--no-" + lname);
    } else {
      if (is_switch)
        throw Error(fmt::format("{}: a switch, give True or False", name),
                    fmt::format("e.g. {}=True", name));
      args.push_back("--" + lname);
      args.push_back(std::get<std::string>(value));
    }
  }
  return args;
}

}  // namespace

Output run_keywords(const KeywordCall& call) {
  ZeroPlan z(/*plan_output_required=*/false);
  CLI::App* sub = nullptr;
  for (CLI::App* c : z.app().get_subcommands({}))
    if (c->get_name() == call.command) sub = c;
  if (sub == nullptr) throw Error(fmt::format("zero-plan has no command '{}'", call.command));
  std::vector<std::string> args = {call.command};
  args.insert(args.end(), call.positional.begin(), call.positional.end());
  const auto flags = keyword_args(*sub, call.caller, call.keywords);
  args.insert(args.end(), flags.begin(), flags.end());
  if (!call.model_json.empty()) z.set_model_json(call.model_json, call.model_origin);
  if (!call.ds_config.is_null()) z.set_ds_config(call.ds_config, "strategy");
  z.set_want_report(call.want_report);
  std::reverse(args.begin(), args.end());  // CLI11 takes the vector last argument first
  try {
    z.app().parse(args);
  } catch (const CLI::ParseError& e) {
    throw Error(e.what(), fmt::format("{} takes zero-plan {}'s flags as keywords", call.caller,
                                      call.command));
  }
  Output out = z.execute(reports::Format::json);
  if (!out.path.empty()) emit(out.path, out.text);
  return out;
}

int zero_plan_main(int argc, char** argv) {
  ZeroPlan z;
  return run(z.app(), argc, argv, [&]() -> int {
    const Output out = z.execute();
    if (!out.text.empty() || !out.path.empty()) emit(out.path, out.text);
    return out.code;
  });
}

}  // namespace zp::cli
