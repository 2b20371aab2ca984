// budgets.cpp: reading budgets files, checking predictions against them, and rendering the
// verdict (zero-plan check).
#include "zp/reports/budgets.hpp"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/checked.hpp"
#include "zp/error.hpp"
#include "zp/json_fields.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/reports/junit.hpp"
#include "zp/units.hpp"

namespace zp::reports {

using nlohmann::json;
using planner::Tier;

namespace {

constexpr std::string_view kSchema = "zero-plan/budgets/v1";
constexpr std::string_view kLimitHint =
    "write bytes as \"30 GiB\", \"40GB\" or 32212254720, or a share of the device as "
    "\"90% of device\"";

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::size_t tier_index(Tier t) { return static_cast<std::size_t>(t); }

// "--model: unknown model 'x'" -> "unknown model 'x'": the flag means nothing in a file.
std::string without_flag(const std::string& msg) {
  if (msg.rfind("--", 0) == 0) {
    const auto colon = msg.find(": ");
    if (colon != std::string::npos) return msg.substr(colon + 2);
  }
  return msg;
}

// Runs f; a zp::Error from it is re-thrown naming `where` (unless it already names the file).
template <typename F>
auto naming(const std::string& where, const std::string& path, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (msg.rfind(path, 0) == 0) throw;
    throw Error(fmt::format("{}: {}", where, without_flag(msg)), e.hint());
  }
}

// A path written in the budgets file, relative to its directory; names stay names.
std::string resolve_path(const std::string& value, const std::filesystem::path& dir) {
  const bool looks_like_path = value.find('/') != std::string::npos || value.ends_with(".json");
  if (!looks_like_path || std::filesystem::path(value).is_absolute()) return value;
  return (dir / value).lexically_normal().string();
}

void reject_unknown(const json& obj, const std::set<std::string_view>& known,
                    const std::string& where, std::string_view what) {
  for (const auto& [key, value] : obj.items())
    if (!known.contains(key))
      throw Error(fmt::format("{}: unknown field '{}'", where, key),
                  fmt::format("{} fields are: {}", what, fmt::join(known, ", ")));
}

double growth_pct(const json& obj, std::string_view key, const std::string& where, double fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0)
    throw Error(fmt::format("{}.{}: must be a number of percent >= 0, got {}", where, key, json_excerpt(*it)),
                fmt::format("e.g. \"{}\": 1 fails a tier that grew by more than 1%", key));
  return it->get<double>();
}

std::string signed_bytes(int64_t b) {
  const uint64_t magnitude = b < 0 ? static_cast<uint64_t>(-(b + 1)) + 1 : static_cast<uint64_t>(b);
  return fmt::format("{}{}", b < 0 ? '-' : '+', format_bytes(magnitude));
}

// predicted - accepted, signed.
int64_t change_bytes(const TierCheck& t) {
  return t.predicted >= *t.accepted ? static_cast<int64_t>(t.predicted - *t.accepted)
                                    : -static_cast<int64_t>(*t.accepted - t.predicted);
}

}  // namespace

TierLimit parse_limit(const json& v, const std::string& where) {
  TierLimit l;
  if (v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0)) {
    l.bytes = v.get<uint64_t>();
    l.text = format_bytes(l.bytes);
    return l;
  }
  if (!v.is_string())
    throw Error(fmt::format("{}: must be a size or a share of the device, got {}", where, json_excerpt(v)),
                std::string(kLimitHint));
  l.text = v.get<std::string>();
  std::string_view s = trim(l.text);
  if (s.ends_with("of device")) s = trim(s.substr(0, s.size() - 9));
  if (s.ends_with('%')) {
    s = trim(s.substr(0, s.size() - 1));
    double pct = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), pct);
    if (ec != std::errc() || end != s.data() + s.size() || s.empty() || !(pct > 0 && pct <= 100))
      throw Error(fmt::format("{}: '{}' is not a share of the device in (0%, 100%]", where, l.text),
                  std::string(kLimitHint));
    l.pct_of_device = pct;
    return l;
  }
  try {
    l.bytes = parse_bytes(l.text, where);
  } catch (const Error&) {
    throw Error(fmt::format("{}: '{}' is not a size or a share of the device", where, l.text),
                std::string(kLimitHint));
  }
  return l;
}

uint64_t device_capacity(const planner::Hardware& hw, const planner::Strategy& s, Tier t) {
  if (t == Tier::gpu) return hw.gpu_memory_bytes;
  const int64_t ranks = std::max<int64_t>(
      1, std::min<int64_t>(checked_mul(s.dp, s.mp, "ranks"), hw.gpus_per_node));
  const uint64_t node = t == Tier::cpu ? hw.host_memory_bytes : hw.nvme_bytes;
  return node / static_cast<uint64_t>(ranks);
}

Budgets parse_budgets(const json& j, const std::string& path) {
  if (!j.is_object())
    throw Error(fmt::format("{}: a budgets file is a JSON object", path),
                fmt::format("start from {{\"schema\": \"{}\", \"cases\": [...]}}", kSchema));
  reject_unknown(j, {"schema", "max_growth_pct", "cases"}, path, "top-level");
  Fields top(j, path);
  if (!top.has("schema") || !j["schema"].is_string() || j["schema"].get<std::string>() != kSchema)
    throw Error(fmt::format("{}: field 'schema' must be \"{}\", got {}", path, kSchema,
                            top.has("schema") ? json_excerpt(j["schema"]) : "nothing"),
                fmt::format("add \"schema\": \"{}\" at the top of the file", kSchema));
  const double default_growth = growth_pct(j, "max_growth_pct", path, 1.0);
  if (!j.contains("cases") || !j["cases"].is_array() || j["cases"].empty())
    throw Error(fmt::format("{}: field 'cases' must be a non-empty array", path),
                "each case names a model, a strategy and a budget per tier");
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();

  Budgets b;
  b.path = path;
  std::set<std::string> names;
  for (std::size_t i = 0; i < j["cases"].size(); ++i) {
    const json& c = j["cases"][i];
    const std::string where = fmt::format("{}: cases[{}]", path, i);
    if (!c.is_object())
      throw Error(fmt::format("{}: must be an object, got {}", where, json_excerpt(c)),
                  "e.g. {\"model\": \"gpt2\", \"budget\": {\"gpu\": \"8 GiB\"}}");
    reject_unknown(c,
                   {"name", "model", "strategy", "ds_config", "hardware", "profile", "device",
                    "budget", "accepted", "max_growth_pct"},
                   where, "case");
    Fields f(c, path, fmt::format("cases[{}].", i));
    BudgetCase bc;
    bc.model = f.string("model");
    bc.spec = naming(where + ".model", path,
                     [&] { return models::load_model(resolve_path(bc.model, dir)); });
    // Strategy: defaults, then the DeepSpeed config, then the case's own fields.
    json sj = json::object();
    if (f.has("ds_config")) {
      const std::string ds = resolve_path(f.string("ds_config"), dir);
      sj = planner::to_json(naming(where + ".ds_config", path, [&] {
        return planner::apply_deepspeed_config({}, parse_json_text(read_text_file(ds), ds), ds);
      }));
    }
    if (const json* s = f.object("strategy")) sj.merge_patch(*s);
    bc.strategy = naming(where, path, [&] {
      return planner::resolve_for_model(planner::strategy_from_json(sj, where), bc.spec);
    });
    if (f.has("hardware")) {
      const std::string hw = f.string("hardware");
      bc.hardware = naming(where + ".hardware", path,
                           [&] { return planner::load_hardware(resolve_path(hw, dir)); });
    }
    const std::string profile = f.string("profile", "zeroplan");
    const std::string device = f.string("device", "cuda");
    const auto p = planner::profile_from_string(profile);
    if (!p) f.fail("profile", "\"zeroplan\" or \"deepspeed\"");
    const auto d = planner::backend_from_string(device);
    if (!d) f.fail("device", "\"cpu\" or \"cuda\"");
    bc.options = {*p, *d};

    const json* budget = f.object("budget");
    if (budget == nullptr || budget->empty())
      throw Error(fmt::format("{}.budget: missing; give a limit for at least one tier", where),
                  "e.g. \"budget\": {\"gpu\": \"90% of device\"}");
    for (const auto& [key, value] : budget->items()) {
      const auto t = planner::tier_from_string(key);
      if (!t)
        throw Error(fmt::format("{}.budget: unknown tier '{}'", where, key), "tiers are gpu, cpu and nvme");
      TierLimit l = parse_limit(value, fmt::format("{}.budget.{}", where, key));
      if (l.pct_of_device > 0 && !bc.hardware)
        throw Error(fmt::format("{}.budget.{}: '{}' needs the case's hardware", where, key, l.text),
                    "add \"hardware\": \"a100-80g\" (a preset or a hardware JSON file) to the case");
      bc.budget[tier_index(*t)] = std::move(l);
    }
    if (const json* acc = f.object("accepted")) {
      for (const auto& [key, value] : acc->items()) {
        const auto t = planner::tier_from_string(key);
        if (!t)
          throw Error(fmt::format("{}.accepted: unknown tier '{}'", where, key), "tiers are gpu, cpu and nvme");
        if (!(value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0)))
          throw Error(fmt::format("{}.accepted.{}: must be bytes as an integer >= 0, got {}", where,
                                  key, json_excerpt(value)),
                      "zero-plan check --update writes the accepted values");
        bc.accepted[tier_index(*t)] = value.get<uint64_t>();
      }
    }
    bc.max_growth_pct = growth_pct(c, "max_growth_pct", where, default_growth);
    bc.name = f.has("name") ? f.string("name")
                            : fmt::format("{} stage {} dp {}{}", bc.model, bc.strategy.stage,
                                          bc.strategy.dp, bc.hardware ? ", " + bc.hardware->name : "");
    if (!names.insert(bc.name).second)
      throw Error(fmt::format("{}.name: '{}' names an earlier case too", where, bc.name),
                  "give every case its own \"name\"");
    b.cases.push_back(std::move(bc));
  }
  return b;
}

Budgets load_budgets(const std::string& path) {
  return parse_budgets(parse_json_text(read_text_file(path), path), path);
}

std::optional<int64_t> TierCheck::headroom_bytes() const {
  if (!limit) return std::nullopt;
  return *limit >= predicted ? static_cast<int64_t>(*limit - predicted)
                             : -static_cast<int64_t>(predicted - *limit);
}

std::optional<double> TierCheck::change_pct() const {
  if (!accepted) return std::nullopt;
  if (*accepted == 0) return predicted == 0 ? 0.0 : HUGE_VAL;
  return (static_cast<double>(predicted) - static_cast<double>(*accepted)) /
         static_cast<double>(*accepted) * 100.0;
}

bool CheckReport::passed() const {
  return std::all_of(cases.begin(), cases.end(), [](const CaseCheck& c) { return c.passed(); });
}

bool CheckReport::over_budget() const {
  for (const CaseCheck& c : cases)
    for (const TierCheck& t : c.tiers)
      if (t.over_budget) return true;
  return false;
}

CheckReport check_budgets(const Budgets& b) {
  CheckReport r;
  r.path = b.path;
  for (std::size_t i = 0; i < b.cases.size(); ++i) {
    const BudgetCase& bc = b.cases[i];
    const auto t0 = std::chrono::steady_clock::now();
    const planner::Estimate e = naming(fmt::format("{}: cases[{}] ({})", b.path, i, bc.name), b.path, [&] {
      return planner::estimate(bc.spec, bc.strategy, bc.hardware ? &*bc.hardware : nullptr, bc.options);
    });
    CaseCheck cc;
    cc.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cc.name = bc.name;
    cc.model = bc.model;
    cc.hardware = bc.hardware ? bc.hardware->name : "";
    cc.strategy = e.strategy;
    cc.max_growth_pct = bc.max_growth_pct;
    for (Tier t : planner::kTiers) {
      const auto& limit = bc.budget[tier_index(t)];
      const auto& accepted = bc.accepted[tier_index(t)];
      if (!limit && !accepted) continue;
      TierCheck tc;
      tc.tier = t;
      tc.predicted = e.per_device.peak(t);
      tc.accepted = accepted;
      if (limit) {
        // pct% of the capacity, rounded down to whole bytes.
        tc.limit = limit->pct_of_device > 0
                       ? static_cast<uint64_t>(std::floor(
                             static_cast<double>(device_capacity(*bc.hardware, e.strategy, t)) *
                             limit->pct_of_device / 100.0))
                       : limit->bytes;
        tc.limit_text = limit->text;
        tc.over_budget = tc.predicted > *tc.limit;
        if (tc.over_budget)
          cc.failures.push_back(fmt::format(
              "{}: {} predicted {} is over its budget {}{} by {}", bc.name, to_string(t),
              format_bytes(tc.predicted), format_bytes(*tc.limit),
              limit->pct_of_device > 0 ? fmt::format(" ({})", limit->text) : std::string(),
              format_bytes(tc.predicted - *tc.limit)));
      }
      const auto change = tc.change_pct();
      tc.grew = change && *change > bc.max_growth_pct;
      if (tc.grew)
        cc.failures.push_back(fmt::format(
            "{}: {} grew {} since the accepted {} ({}), more than the allowed {}%", bc.name,
            to_string(t), std::isinf(*change) ? std::string("from nothing") : fmt::format("{:+.2f}%", *change),
            format_bytes(*tc.accepted), signed_bytes(change_bytes(tc)), bc.max_growth_pct));
      cc.tiers.push_back(tc);
    }
    r.cases.push_back(std::move(cc));
  }
  return r;
}

namespace {

// "28.57 GiB", or "28.57 GiB (90% of device)" when written as a share.
std::string budget_cell(const TierCheck& t) {
  if (!t.limit) return "-";
  if (t.limit_text.find('%') != std::string::npos)
    return fmt::format("{} ({})", format_bytes(*t.limit), t.limit_text);
  return format_bytes(*t.limit);
}

std::string headroom_cell(const TierCheck& t) {
  const auto h = t.headroom_bytes();
  if (!h) return "-";
  const double pct = *t.limit == 0 ? 0.0 : static_cast<double>(*h) / static_cast<double>(*t.limit) * 100.0;
  return fmt::format("{} ({:.1f}%)", *h >= 0 ? format_bytes(static_cast<uint64_t>(*h)) : signed_bytes(*h), pct);
}

std::string change_cell(const TierCheck& t) {
  const auto pct = t.change_pct();
  if (!pct) return "none accepted";
  if (t.predicted == *t.accepted) return "unchanged";
  if (std::isinf(*pct)) return signed_bytes(change_bytes(t)) + " (new)";
  return fmt::format("{} ({:+.2f}%)", signed_bytes(change_bytes(t)), *pct);
}

std::string status_cell(const TierCheck& t) {
  if (t.over_budget && t.grew) return "OVER BUDGET, GREW";
  if (t.over_budget) return "OVER BUDGET";
  if (t.grew) return "GREW";
  return "ok";
}

}  // namespace

std::string render_check(const CheckReport& r, Format f) {
  if (f == Format::json) {
    json cases = json::array();
    for (const CaseCheck& c : r.cases) {
      json tiers = json::array();
      for (const TierCheck& t : c.tiers) {
        const auto h = t.headroom_bytes();
        const auto pct = t.change_pct();
        tiers.push_back({{"tier", to_string(t.tier)},
                         {"predicted", t.predicted},
                         {"budget", t.limit ? json(*t.limit) : json(nullptr)},
                         {"headroom", h ? json(*h) : json(nullptr)},
                         {"accepted", t.accepted ? json(*t.accepted) : json(nullptr)},
                         {"change_bytes", t.accepted ? json(change_bytes(t)) : json(nullptr)},
                         {"change_pct", pct && std::isfinite(*pct) ? json(*pct) : json(nullptr)},
                         {"over_budget", t.over_budget},
                         {"grew", t.grew}});
      }
      cases.push_back({{"name", c.name},
                       {"model", c.model},
                       {"strategy", planner::to_json(c.strategy)},
                       {"hardware", c.hardware.empty() ? json(nullptr) : json(c.hardware)},
                       {"max_growth_pct", c.max_growth_pct},
                       {"tiers", tiers},
                       {"failures", c.failures},
                       {"passed", c.passed()}});
    }
    return json{{"schema", "zero-plan/check/v1"}, {"file", r.path}, {"cases", cases},
                {"passed", r.passed()}}
               .dump(2) +
           "\n";
  }
  if (f == Format::csv) {
    Table t({"case", "tier", "predicted", "budget", "headroom", "accepted", "change_pct", "status"}, {});
    for (const CaseCheck& c : r.cases)
      for (const TierCheck& tc : c.tiers) {
        const auto h = tc.headroom_bytes();
        const auto pct = tc.change_pct();
        t.add({c.name, std::string(to_string(tc.tier)), fmt::format("{}", tc.predicted),
               tc.limit ? fmt::format("{}", *tc.limit) : "", h ? fmt::format("{}", *h) : "",
               tc.accepted ? fmt::format("{}", *tc.accepted) : "",
               pct && std::isfinite(*pct) ? fmt::format("{:.4f}", *pct) : "", status_cell(tc)});
      }
    return t.render(f);
  }
  Table t({"case", "tier", "predicted", "budget", "headroom", "change since accepted", "status"},
          {Align::left, Align::left, Align::right, Align::right, Align::right, Align::right, Align::left});
  for (const CaseCheck& c : r.cases)
    for (const TierCheck& tc : c.tiers)
      t.add({c.name, std::string(to_string(tc.tier)), format_bytes(tc.predicted), budget_cell(tc),
             headroom_cell(tc), change_cell(tc), status_cell(tc)});
  std::string out = t.render(f);
  std::size_t n_failed = 0;
  for (const CaseCheck& c : r.cases) n_failed += c.passed() ? 0 : 1;
  out += "\n";
  if (n_failed == 0) {
    out += fmt::format("ok: {} case{} within budget\n", r.cases.size(), r.cases.size() == 1 ? "" : "s");
    return out;
  }
  for (const CaseCheck& c : r.cases)
    for (const std::string& msg : c.failures) out += (f == Format::markdown ? "- " : "") + msg + "\n";
  out += fmt::format("\nFAILED: {} of {} case{} ({})\n", n_failed, r.cases.size(),
                     r.cases.size() == 1 ? "" : "s", r.path);
  out += fmt::format("if the change is intended, raise the budget or accept the new predictions with "
                     "'zero-plan check {} --update' and commit the file\n", r.path);
  return out;
}

std::string render_check_junit(const CheckReport& r) {
  JunitSuite s{fmt::format("zero-plan check {}", r.path), {}};
  for (const CaseCheck& c : r.cases) {
    JunitCase jc;
    jc.name = c.name;
    jc.classname = r.path;
    jc.seconds = c.seconds;
    jc.failures = c.failures;
    for (const TierCheck& t : c.tiers)
      jc.system_out += fmt::format("{}: predicted {}, budget {}, headroom {}, change {}\n",
                                   to_string(t.tier), format_bytes(t.predicted), budget_cell(t),
                                   headroom_cell(t), change_cell(t));
    s.cases.push_back(std::move(jc));
  }
  return render_junit({s});
}

std::string with_accepted(std::string_view original_text, const CheckReport& r,
                          const std::string& origin) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(original_text, nullptr, false);
  if (j.is_discarded() || !j.contains("cases") || !j["cases"].is_array() ||
      j["cases"].size() != r.cases.size())
    throw Error(fmt::format("{}: changed while it was being checked; not updated", origin),
                "run zero-plan check --update again");
  for (std::size_t i = 0; i < r.cases.size(); ++i) {
    nlohmann::ordered_json acc = nlohmann::ordered_json::object();
    for (const TierCheck& t : r.cases[i].tiers) acc[std::string(to_string(t.tier))] = t.predicted;
    j["cases"][i]["accepted"] = acc;
  }
  return j.dump(2) + "\n";
}

}  // namespace zp::reports
