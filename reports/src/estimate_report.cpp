// estimate_report.cpp: rendering of zero-plan's table, models and estimate outputs.
#include <algorithm>
#include <cmath>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/reports/planner_reports.hpp"
#include "zp/units.hpp"

namespace zp::reports {

using planner::Category;
using planner::Tier;

std::string short_count(uint64_t n) {
  struct S {
    double scale;
    const char* suffix;
  };
  for (S s : {S{1e12, "T"}, S{1e9, "B"}, S{1e6, "M"}, S{1e3, "K"}}) {
    const double v = static_cast<double>(n) / s.scale;
    if (v >= 1.0) {
      std::string t = fmt::format("{:.3f}", v);
      while (t.back() == '0') t.pop_back();
      if (t.back() == '.') t.pop_back();
      return t + s.suffix;
    }
  }
  return fmt::format("{}", n);
}

namespace {
const char* kStageNames[] = {"baseline", "P_os", "P_os+g", "P_os+g+p"};
}

std::string render_zero_table(const std::vector<planner::TableRow>& rows, uint64_t k, Format f) {
  if (f == Format::json) {
    nlohmann::json j = {{"schema", "zero-plan/table/v1"}, {"k", k}, {"rows", nlohmann::json::array()}};
    for (const auto& r : rows)
      j["rows"].push_back({{"params", r.params},
                           {"dp", r.dp},
                           {"stage", r.stage},
                           {"bytes_per_device", r.bytes_per_device}});
    return j.dump(2) + "\n";
  }
  if (f == Format::csv) {
    Table t({"params", "dp", "stage", "bytes_per_device", "gb"}, {});
    for (const auto& r : rows)
      t.add({fmt::format("{}", r.params), fmt::format("{}", r.dp), fmt::format("{}", r.stage),
             fmt::format("{}", r.bytes_per_device), planner::paper_gb(r.bytes_per_device)});
    return t.render(f);
  }
  // Paper layout: one row per DP degree, columns per (model size, stage).
  std::vector<uint64_t> params, dps;
  for (const auto& r : rows) {
    if (std::find(params.begin(), params.end(), r.params) == params.end()) params.push_back(r.params);
    if (std::find(dps.begin(), dps.end(), r.dp) == dps.end()) dps.push_back(r.dp);
  }
  std::vector<std::string> header = {"DP"};
  std::vector<Align> align = {Align::right};
  for (uint64_t p : params)
    for (const char* s : kStageNames) {
      header.push_back(fmt::format("{} {}", short_count(p), s));
      align.push_back(Align::right);
    }
  Table t(header, align);
  for (uint64_t dp : dps) {
    std::vector<std::string> cells = {fmt::format("{}", dp)};
    for (uint64_t p : params)
      for (int stage = 0; stage < 4; ++stage)
        for (const auto& r : rows)
          if (r.params == p && r.dp == dp && r.stage == stage)
            cells.push_back(planner::paper_gb(r.bytes_per_device));
    t.add(cells);
  }
  std::string title = fmt::format(
      "ZeRO model-state memory per device in GB (1e9 bytes): fp16 params and grads (2 + 2 "
      "bytes) and K = {} bytes of optimizer state per parameter (ZeRO paper, table 1)\n",
      k);
  if (f == Format::markdown) title = "**" + title.substr(0, title.size() - 1) + "**\n\n";
  return title + t.render(f);
}

std::string render_catalog(Format f) {
  if (f == Format::json) {
    nlohmann::json j = {{"schema", "zero-plan/models/v1"}, {"models", nlohmann::json::array()}};
    for (const auto& e : models::catalog()) {
      const auto m = models::parse_hf_config(e.config, e.name);
      const auto inv = models::count_params(m);
      auto mj = planner::model_json(m, inv);
      mj["description"] = e.description;
      j["models"].push_back(mj);
    }
    return j.dump(2) + "\n";
  }
  Table t({"name", "family", "params", "layers", "hidden", "heads", "context", "description"},
          {Align::left, Align::left, Align::right, Align::right, Align::right, Align::right,
           Align::right, Align::left});
  for (const auto& e : models::catalog()) {
    const auto m = models::parse_hf_config(e.config, e.name);
    const auto inv = models::count_params(m);
    const std::string heads = m.n_kv_head == m.n_head
                                  ? fmt::format("{}", m.n_head)
                                  : fmt::format("{} ({} kv)", m.n_head, m.n_kv_head);
    t.add({e.name, m.family_name(),
           f == Format::csv ? fmt::format("{}", inv.total) : format_count(inv.total),
           m.encoder_decoder() ? fmt::format("{}+{}", m.n_layer, m.n_decoder_layer)
                               : fmt::format("{}", m.n_layer),
           fmt::format("{}", m.n_embd), heads,
           fmt::format("{}", m.n_positions), e.description});
  }
  return t.render(f);
}

std::string render_inventory(const models::ModelSpec& m, Format f) {
  const auto inv = models::count_params(m);
  if (f == Format::json) {
    nlohmann::json j = {{"schema", "zero-plan/inventory/v1"}, {"model", planner::model_json(m, inv)},
                        {"tensors", nlohmann::json::array()}};
    for (const auto& t : inv.tensors)
      j["tensors"].push_back({{"name", t.name}, {"shape", t.shape}, {"numel", t.numel}, {"layer", t.layer}});
    return j.dump(2) + "\n";
  }
  // Tensors that differ only in their block or expert index are one row, "*" standing for the
  // index, with how many there are (MoE and dense layers, T5's encoder and decoder, the first
  // layer's relative bias each get their own rows).
  auto pattern = [](const std::string& name) {
    std::string out;
    std::size_t i = 0;
    while (i < name.size()) {
      const std::size_t dot = name.find('.', i);
      const std::string part = name.substr(i, dot == std::string::npos ? std::string::npos : dot - i);
      const bool index = !part.empty() && part.find_first_not_of("0123456789") == std::string::npos;
      out += index ? "*" : part;
      if (dot == std::string::npos) break;
      out += '.';
      i = dot + 1;
    }
    return out;
  };
  struct Row {
    std::string name, shape;
    int64_t numel = 0, count = 0;
  };
  std::vector<Row> rows;
  std::map<std::pair<std::string, std::string>, std::size_t> row_of;
  for (const auto& x : inv.tensors) {
    std::string shape = "(";
    for (std::size_t i = 0; i < x.shape.size(); ++i) shape += fmt::format("{}{}", i ? ", " : "", x.shape[i]);
    shape += ")";
    const auto key = std::make_pair(pattern(x.name), shape);
    const auto it = row_of.find(key);
    if (it == row_of.end()) {
      row_of[key] = rows.size();
      rows.push_back({x.name, shape, x.numel, 1});
    } else {
      // "*" where the members differ (the block, the expert), their common name elsewhere.
      Row& r = rows[it->second];
      std::string merged;
      std::size_t i = 0, j = 0;
      while (i <= r.name.size() && j <= x.name.size()) {
        const std::size_t di = std::min(r.name.find('.', i), r.name.size());
        const std::size_t dj = std::min(x.name.find('.', j), x.name.size());
        const std::string a = r.name.substr(i, di - i), b = x.name.substr(j, dj - j);
        merged += a == b ? a : "*";
        if (di == r.name.size()) break;
        merged += '.';
        i = di + 1;
        j = dj + 1;
      }
      r.name = merged;
      ++r.count;
    }
  }
  Table t({"tensor", "shape", "params", "repeats"},
          {Align::left, Align::left, Align::right, Align::right});
  for (const Row& r : rows)
    t.add({r.name, r.shape, fmt::format("{}", r.numel),
           r.count > 1 ? fmt::format("x {}", r.count) : "1"});
  std::string out = t.render(f);
  if (f != Format::csv)
    out += fmt::format("\ntotal {} parameters ({}); per block {}; largest module {} ({} params)\n",
                       inv.total, format_count(inv.total), inv.per_layer, inv.largest_module,
                       inv.largest_module_params);
  return out;
}

std::string render_estimate(const planner::Estimate& e, Format f) {
  if (f == Format::json) return planner::to_json(e).dump(2) + "\n";
  if (f == Format::csv) {
    Table t({"tier", "category", "bytes"}, {});
    for (Tier tier : planner::kTiers) {
      for (Category c : planner::kCategories)
        t.add({std::string(to_string(tier)), std::string(to_string(c)),
               fmt::format("{}", e.per_device[tier][c])});
      t.add({std::string(to_string(tier)), "total", fmt::format("{}", e.per_device.peak(tier))});
    }
    return t.render(f);
  }
  const bool md = f == Format::markdown;
  std::string out;
  const auto& m = e.model;
  // MoE models: the parameters a token passes (k of the E routed experts per MoE layer).
  const std::string active =
      m.is_moe() ? fmt::format(" ({} active)", format_count(static_cast<uint64_t>(e.params.active)))
                 : "";
  out += fmt::format("{}model:{}     {} ({}), {} params{}, L={} C={} NH={}{}\n", md ? "- **" : "",
                     md ? "**" : "", m.name, m.family_name(), format_count(e.params.total), active,
                     m.encoder_decoder() ? fmt::format("{}+{}", m.n_layer, m.n_decoder_layer)
                                         : fmt::format("{}", m.n_layer),
                     m.n_embd, m.n_head,
                     m.n_kv_head != m.n_head ? fmt::format(" KVH={}", m.n_kv_head) : "");
  out += fmt::format("{}strategy:{}  {}\n", md ? "- **" : "", md ? "**" : "",
                     planner::describe(e.strategy));
  if (m.is_moe()) {
    // The routed rows a rank's experts process per MoE layer and micro-step (graph.cpp's
    // routed_rows): balanced, as many as it sends (k*B*T); worst, with ep > 1, every token of
    // the ep group sending this rank min(k, E/ep) of its choices.
    const auto& s = e.strategy;
    const int64_t tokens = s.micro_batch * s.seq, local = m.moe.n_experts / s.ep;
    const auto go = planner::graph_options(m, s, e.options);
    const int64_t rows = models::routed_rows(m, go, tokens);
    const std::string routing =
        s.moe_capacity_factor > 0
            ? fmt::format("capacity factor {} ({} rows per expert, tokens beyond dropped)",
                          s.moe_capacity_factor, models::moe_capacity(m, go, tokens))
            : fmt::format("dropless, {} routing", planner::to_string(s.moe_routing));
    out += fmt::format(
        "{}experts:{}   {} routed, top {}; ep {} ({} per rank), expert states partitioned over "
        "dp/ep = {} ranks; {}: {} rows per rank per MoE layer\n",
        md ? "- **" : "", md ? "**" : "", m.moe.n_experts, m.moe.top_k, s.ep, local,
        planner::expert_dp(s), routing, rows);
  }
  // Every default the plan took rather than the user (left-out flags, a DeepSpeed config's
  // "auto" values, the sequence length).
  if (!e.assumed.empty()) {
    out += fmt::format("{}assumed:{}   ", md ? "- **" : "", md ? "**" : "");
    for (std::size_t i = 0; i < e.assumed.size(); ++i)
      out += (i == 0 ? "" : md ? "; " : ";\n           ") + e.assumed[i];
    out += "\n";
  }
  if (e.hardware)
    out += fmt::format("{}hardware:{}  {}: {}\n", md ? "- **" : "", md ? "**" : "",
                       e.hardware->name, e.hardware->description);
  // What the config reader accepted without modelling it (quantization, ignored fields, the
  // MTP module), and a context longer than the config's.
  for (const std::string& note : m.notes)
    out += fmt::format("{}note:{}      {}\n", md ? "- **" : "", md ? "**" : "", note);
  out += "\n";
  Table t({"per device (one rank)", "gpu", "cpu", "nvme"},
          {Align::left, Align::right, Align::right, Align::right});
  for (Category c : planner::kCategories)
    t.add({std::string(to_string(c)), format_bytes(e.per_device[Tier::gpu][c]),
           format_bytes(e.per_device[Tier::cpu][c]), format_bytes(e.per_device[Tier::nvme][c])});
  t.add_rule();
  t.add({"peak", format_bytes(e.per_device.peak(Tier::gpu)), format_bytes(e.per_device.peak(Tier::cpu)),
         format_bytes(e.per_device.peak(Tier::nvme))});
  out += t.render(f);
  // The categories peak at different moments: each row is its own high-water, the peak is
  // the high-water of the sum (plus the allocator's overhead), and here is where it happens.
  const auto& mem = e.memory;
  const bool cuda = e.options.backend == planner::Backend::cuda;
  if (mem.peak_pos >= 0 && static_cast<std::size_t>(mem.peak_pos) < e.schedule.op_names.size())
    out += fmt::format("\ngpu peak at op {}", e.schedule.op_names[static_cast<std::size_t>(mem.peak_pos)]);
  else if (mem.peak_pos < 0 && mem.peak_allocated[0] > mem.after_init[0])
    out += "\ngpu peak before the first op (initialization: the model whole beside its flat copy "
           "or partitions)";
  // The three figures a user can measure, each named by what measures it (PyTorch's
  // counters and nvidia-smi for the deepspeed profile; our arena and its bound for zeroplan).
  if (!cuda) {
    out += fmt::format(" ({} in use, {} reserved)\n", format_bytes(mem.peak_allocated[0]),
                       format_bytes(mem.peak_reserved[0]));
  } else {
    const auto& d = mem.device;
    const bool torch = e.options.profile != planner::Profile::zeroplan;
    out += fmt::format(
        "\ngpu: {} allocated{}, {} reserved{}, {} on the device ({}: + context {}, cuBLAS "
        "workspace {}, NCCL {})\n",
        format_bytes(mem.peak_allocated[0]), torch ? " (max_memory_allocated)" : "",
        format_bytes(d.reserved), torch ? " (max_memory_reserved)" : " (arena)",
        format_bytes(d.total()), torch ? "nvidia-smi" : "at most", format_bytes(d.context),
        format_bytes(d.cublas_workspace), format_bytes(d.nccl));
  }
  // A model built whole: what deepspeed.initialize held at once (the gpu line's peak has it).
  if (cuda && e.options.profile == planner::Profile::deepspeed && mem.init_peak[0] > mem.after_init[0])
    out += fmt::format("init: {} allocated at most in deepspeed.initialize, {} after it\n",
                       format_bytes(mem.init_peak[0]), format_bytes(mem.after_init[0]));
  // Per block: the first block of the stage described (every block without pipelining).
  const std::size_t b0 =
      e.stages.empty() ? 0 : static_cast<std::size_t>(e.stages[static_cast<std::size_t>(e.stage)].blocks.front().first);
  if (b0 < e.activations.saved_per_layer.size())
    out += fmt::format("saved for backward at the end of forward: {} ({} per block)\n",
                       format_bytes(e.activations.saved_total),
                       format_bytes(e.activations.saved_per_layer[b0] +
                                    e.activations.stats_per_layer[b0]));
  if (const auto& c = e.checkpoint) {
    out += fmt::format("checkpoint: {}{} on disk per rank ({} per element owned), {} in all from "
                       "{} rank{}; a {} host staging buffer, in the cpu peak\n",
                       c->writers == 1 ? "" : "at most ", format_bytes(c->rank_bytes),
                       format_bytes(c->bytes_per_element), format_bytes(c->total_bytes), c->writers,
                       c->writers == 1 ? "" : "s", format_bytes(c->staging_bytes));
  }
  if (!e.stages.empty()) {
    // Pipeline parallelism: the table above is the most loaded stage's; each stage's peaks.
    out += fmt::format("\npipeline: {} stages{}, {}, {} micro-batches per step; the table above "
                       "is stage {} (the most loaded)\n",
                       e.strategy.pp, e.strategy.vp > 1 ? fmt::format(" x {} chunks", e.strategy.vp) : "",
                       planner::to_string(e.strategy.pp_schedule), e.strategy.grad_accum, e.stage);
    Table ps({"stage", "blocks", "in flight", "params", "activations", "gpu peak", "cpu peak"},
             {Align::right, Align::left, Align::right, Align::right, Align::right, Align::right,
              Align::right});
    for (const planner::PipelineStage& s : e.stages) {
      std::string blocks;
      for (const auto& [a, b] : s.blocks) blocks += fmt::format("{}{}-{}", blocks.empty() ? "" : ",", a, b - 1);
      ps.add({fmt::format("{}", s.stage), blocks,
              fmt::format("{}", s.in_flight), format_count(s.n_params),
              format_bytes(s.per_device[Tier::gpu][Category::activations]),
              format_bytes(s.per_device.peak(Tier::gpu)), format_bytes(s.per_device.peak(Tier::cpu))});
    }
    out += ps.render(f);
  }
  if (e.fits.has_value()) {
    out += "\n";
    if (*e.fits) {
      out += fmt::format("fits {}: yes (gpu {} of {})\n", e.hardware->name,
                         format_bytes(e.per_device.peak(Tier::gpu)),
                         format_bytes(e.hardware->gpu_memory_bytes));
    } else {
      out += fmt::format("fits {}: no\n", e.hardware->name);
      for (const auto& s : e.shortfalls) out += fmt::format("  {}\n", s);
    }
  }
  return out;
}

}  // namespace zp::reports
