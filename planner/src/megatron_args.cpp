// megatron_args.cpp: Megatron-LM's command line -> Strategy (and a model): shell splitting,
// argparse's way of taking values, the generated table of Megatron's flags, then the flags
// whose memory zeroplan models. Not a launcher's flags (torchrun's), and not Megatron's
// validation beyond the checks that decide a size (argparse choices, divisibility).
// Megatron's own behaviour cited below is megatron/training/arguments.py (parse_args,
// validate_args) at the commit megatron_flags.inc names, unless another file is named.
#include "zp/planner/megatron_args.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "zp/checked.hpp"
#include "zp/error.hpp"

namespace zp::planner {
namespace {

using nlohmann::json;

// ---- the generated table -------------------------------------------------------------------

enum class MegatronValue { any, integer, real };
struct MegatronFlag {
  std::string_view name;
  int min_values, max_values;  // argparse's nargs: 0 (store_true), 1, 0-1 (?), 1+ (-1), N
  MegatronValue type;
};
constexpr MegatronFlag kFlags[] = {
#include "megatron_flags.inc"
};

const MegatronFlag* find_flag(std::string_view name) {
  const auto it = std::lower_bound(std::begin(kFlags), std::end(kFlags), name,
                                   [](const MegatronFlag& f, std::string_view n) { return f.name < n; });
  return it != std::end(kFlags) && it->name == name ? it : nullptr;
}

std::vector<std::string_view> closest_flags(std::string_view name, std::size_t n) {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> out;
    for (const MegatronFlag& f : kFlags) out.push_back(f.name);
    return out;
  }();
  // A suggestion is a likely typo: a third of the name's characters changed at most (the
  // flags share long stems, so anything further is noise, and a garbage name costs little).
  return models::closest_names(name, names, n, false, std::max<std::size_t>(2, name.size() / 3));
}

// ---- values as Python reads them -----------------------------------------------------------

// int(): an optional sign, digits, single underscores between digits.
std::optional<int64_t> python_int(std::string_view v) {
  std::size_t i = 0;
  bool negative = false;
  if (i < v.size() && (v[i] == '+' || v[i] == '-')) negative = v[i++] == '-';
  if (i == v.size()) return std::nullopt;
  uint64_t x = 0;
  bool digit_before = false;
  for (; i < v.size(); ++i) {
    if (v[i] == '_' && digit_before && i + 1 < v.size() && std::isdigit(static_cast<unsigned char>(v[i + 1]))) {
      digit_before = false;
      continue;
    }
    if (!std::isdigit(static_cast<unsigned char>(v[i]))) return std::nullopt;
    digit_before = true;
    const uint64_t d = static_cast<uint64_t>(v[i] - '0');
    if (x > (static_cast<uint64_t>(INT64_MAX) - d) / 10) return std::nullopt;  // too large for us
    x = x * 10 + d;
  }
  return negative ? -static_cast<int64_t>(x) : static_cast<int64_t>(x);
}

// float(): what strtod reads, whole, without C's hexadecimal form.
std::optional<double> python_float(std::string_view v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i)
    if (v[i] != '_' || (i > 0 && i + 1 < v.size() && std::isdigit(static_cast<unsigned char>(v[i - 1])) &&
                        std::isdigit(static_cast<unsigned char>(v[i + 1]))))
      s += v[i];
  if (s.empty() || s.find_first_of("xX") != std::string::npos) return std::nullopt;
  char* end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return std::nullopt;
  return d;
}

// argparse takes a word starting with '-' as a flag, unless it looks like a negative number
// (_negative_number_matcher '^-\d+$|^-\d*\.\d+$'; Megatron has no flag that looks like one).
bool looks_like_flag(std::string_view w) {
  if (w.size() < 2 || w[0] != '-') return false;
  std::string_view r = w.substr(1);
  const std::size_t dot = r.find('.');
  auto digits = [](std::string_view d) {
    return std::all_of(d.begin(), d.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
  };
  if (dot == std::string_view::npos) return !digits(r);
  return !(digits(r.substr(0, dot)) && dot + 1 < r.size() && digits(r.substr(dot + 1)));
}

}  // namespace

// ---- shell words ---------------------------------------------------------------------------

std::vector<std::string> split_shell_words(std::string_view text, std::string_view flag) {
  std::vector<std::string> words;
  std::string word;
  bool in_word = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == ' ' || c == '\t' || c == '\n') {
      if (in_word) words.push_back(std::move(word));
      word.clear();
      in_word = false;
    } else if (c == '#' && !in_word) {  // a comment, to the end of the line
      while (i + 1 < text.size() && text[i + 1] != '\n') ++i;
    } else if (c == '\\') {
      if (i + 1 == text.size())
        throw Error(fmt::format("{}: ends in a backslash", flag),
                    "a backslash escapes the character after it; write \\\\ for a backslash");
      if (text[++i] != '\n') {  // backslash-newline: the line goes on
        word += text[i];
        in_word = true;
      }
    } else if (c == '\'' || c == '"') {
      const std::size_t open = i;
      in_word = true;
      for (++i; i < text.size() && text[i] != c; ++i) {
        if (c == '"' && text[i] == '\\' && i + 1 < text.size() &&
            std::string_view("$`\"\\\n").find(text[i + 1]) != std::string_view::npos) {
          if (text[++i] != '\n') word += text[i];
        } else {
          word += text[i];
        }
      }
      if (i == text.size())
        throw Error(fmt::format("{}: unterminated {} quote (opened at character {})", flag,
                                c == '"' ? "double" : "single", open + 1),
                    fmt::format("close the quote; the text is split into words as a shell does"));
    } else {
      word += c;
      in_word = true;
    }
  }
  if (in_word) words.push_back(std::move(word));
  return words;
}

// ---- parsing -------------------------------------------------------------------------------

std::optional<std::string> MegatronArgs::value(std::string_view flag) const {
  const auto it = given.find(flag);
  if (it == given.end() || it->second.empty()) return std::nullopt;
  return it->second.back();
}
std::optional<int64_t> MegatronArgs::integer(std::string_view flag) const {
  const auto v = value(flag);
  return v ? python_int(*v) : std::nullopt;
}
std::optional<double> MegatronArgs::real(std::string_view flag) const {
  const auto v = value(flag);
  return v ? python_float(*v) : std::nullopt;
}

std::vector<std::string_view> megatron_flag_names() {
  std::vector<std::string_view> out;
  for (const MegatronFlag& f : kFlags) out.push_back(f.name);
  return out;
}

MegatronArgs parse_megatron_args(std::string_view text, std::string origin) {
  MegatronArgs a;
  a.origin = std::move(origin);
  const std::vector<std::string> words = split_shell_words(text, a.origin);
  const MegatronFlag* previous = nullptr;
  for (std::size_t i = 0; i < words.size();) {
    const std::string& w = words[i++];
    if (w == "--" || !looks_like_flag(w)) {
      std::string hint = "Megatron-LM takes no positional arguments; give flags and their values";
      if (previous != nullptr && previous->max_values == 0)
        hint = fmt::format("{} takes no value: it is a switch, on when given", previous->name);
      else if (previous != nullptr)
        hint = fmt::format("{} takes {} value{}", previous->name,
                           previous->max_values < 0 ? "at least one" : std::to_string(previous->max_values),
                           previous->max_values == 1 ? "" : "s");
      throw Error(fmt::format("{}: '{}' is not a flag", a.origin, w), hint);
    }
    const std::size_t eq = w.find('=');
    const std::string name = w.substr(0, eq);
    const MegatronFlag* f = find_flag(name);
    if (f == nullptr) {
      std::string hint;
      if (name == "--virtual-pipeline-model-parallel-size")
        hint = "Megatron-LM named it so for four days in February 2021 (dd88906 to dcef906); "
               "its flags are --num-virtual-stages-per-pipeline-rank N (model chunks per "
               "pipeline rank) and --num-layers-per-virtual-pipeline-stage N";
      else if (name.find("deepspeed") != std::string::npos || name == "--zero-stage")
        hint = "Megatron-DeepSpeed's DeepSpeed flags are not Megatron-LM's: give the DeepSpeed "
               "config with --ds-config and leave them out";
      else if (const auto near = closest_flags(name, 3); !near.empty())
        hint = fmt::format("not a Megatron-LM flag (megatron/training/arguments.py); closest: {}",
                           fmt::join(near, ", "));
      else
        hint = "not a Megatron-LM flag (megatron/training/arguments.py), nor close to one";
      throw Error(fmt::format("{}: unknown flag {}", a.origin, name), hint);
    }
    std::vector<std::string> values;
    if (eq != std::string::npos) {
      if (f->max_values == 0)
        throw Error(fmt::format("{}: {} takes no value, got '{}'", a.origin, name, w.substr(eq + 1)),
                    fmt::format("{} is a switch, on when given: write {} alone", name, name));
      values.push_back(w.substr(eq + 1));
    } else {
      while (i < words.size() && !looks_like_flag(words[i]) && words[i] != "--" &&
             (f->max_values < 0 || static_cast<int>(values.size()) < f->max_values))
        values.push_back(words[i++]);
    }
    if (static_cast<int>(values.size()) < f->min_values)
      throw Error(fmt::format("{}: {} is missing its value{}", a.origin, name,
                              f->min_values > 1 ? "s" : ""),
                  f->min_values > 1 ? fmt::format("{} takes {} values", name, f->min_values)
                                    : fmt::format("e.g. {} 8", name));
    for (const std::string& v : values) {
      if (f->type == MegatronValue::integer && !python_int(v))
        throw Error(fmt::format("{}: {} expects an integer, got '{}'", a.origin, name, v),
                    fmt::format("Megatron reads {} with int()", name));
      if (f->type == MegatronValue::real && !python_float(v))
        throw Error(fmt::format("{}: {} expects a number, got '{}'", a.origin, name, v),
                    fmt::format("Megatron reads {} with float()", name));
    }
    a.given[name] = std::move(values);
    previous = f;
  }
  return a;
}

// ---- the strategy --------------------------------------------------------------------------

namespace {

[[noreturn]] void refuse(const MegatronArgs& a, const std::string& what, const std::string& hint) {
  throw Error(fmt::format("{}: {}", a.origin, what), hint);
}

// A flag that must be >= 1 when given.
std::optional<int64_t> positive(const MegatronArgs& a, std::string_view flag) {
  const auto v = a.integer(flag);
  if (v && *v < 1) refuse(a, fmt::format("{} must be >= 1, got {}", flag, *v), "e.g. 1, 2, 8");
  return v;
}

// One of `choices` (argparse's choices=), or nullopt when not given.
std::optional<std::string> choice(const MegatronArgs& a, std::string_view flag,
                                  std::initializer_list<std::string_view> choices) {
  const auto v = a.value(flag);
  if (v && std::find(choices.begin(), choices.end(), *v) == choices.end())
    refuse(a, fmt::format("{}: invalid choice '{}'", flag, *v),
           fmt::format("Megatron accepts {}", fmt::join(choices, ", ")));
  return v;
}

// Flags Megatron reads whose memory zeroplan does not model: refused when given (with a value
// other than `neutral`, where one is given), so no plan silently leaves them out.
struct Unmodelled {
  std::string_view flag, neutral, what, hint;
};
constexpr std::string_view kDropIt = "leave it out to plan the run without it";
constexpr Unmodelled kUnmodelled[] = {
    {"--fp8-format", "", "FP8 training (TransformerEngine's FP8 GEMMs and their saved inputs)",
     "zeroplan plans fp32, fp16 and bf16; leave out the FP8 flags to plan the bf16 run"},
    {"--fp4-format", "", "FP4 training", "zeroplan plans fp32, fp16 and bf16; leave out the FP4 flags"},
    {"--fp8-param-gather", "", "FP8 parameters", "zeroplan plans fp32, fp16 and bf16 parameters"},
    {"--fp4-param-gather", "", "FP4 parameters", "zeroplan plans fp32, fp16 and bf16 parameters"},
    {"--optimizer-cpu-offload", "", "Megatron's hybrid CPU optimizer (HybridDeviceOptimizer)",
     "zeroplan models DeepSpeed's ZeRO-Offload: --profile deepspeed --offload-optimizer cpu"},
    {"--use-torch-fsdp2", "", "PyTorch FSDP2 inside Megatron",
     "plan FSDP with --profile fsdp --stage 3 (torchtitan's fully_shard)"},
    {"--use-megatron-fsdp", "", "Megatron-FSDP", "plan FSDP with --profile fsdp --stage 3"},
    {"--num-distributed-optimizer-instances", "1",
     "several distributed-optimizer instances (partial sharding of the data-parallel group)",
     "zeroplan shards over the whole data-parallel group: leave it out"},
    {"--decoder-first-pipeline-num-layers", "", "an uneven pipeline split",
     "zeroplan splits the layers evenly over the pipeline stages; leave it out"},
    {"--decoder-last-pipeline-num-layers", "", "an uneven pipeline split",
     "zeroplan splits the layers evenly over the pipeline stages; leave it out"},
    {"--pipeline-model-parallel-layout", "", "a custom pipeline layout",
     "zeroplan splits the layers evenly over the pipeline stages; leave it out"},
    {"--account-for-embedding-in-pipeline-split", "", "the embedding counted as a layer of the split",
     "zeroplan splits the blocks evenly over the pipeline stages; leave it out"},
    {"--account-for-loss-in-pipeline-split", "", "the loss counted as a layer of the split",
     "zeroplan splits the blocks evenly over the pipeline stages; leave it out"},
    {"--cpu-offloading-num-layers", "0", "activation and weight offloading to the CPU", kDropIt},
    {"--hierarchical-context-parallel-sizes", "", "hierarchical context parallelism (a2a+p2p)",
     "zeroplan models ring (--cp-comm-type p2p) and Ulysses (a2a) context parallelism"},
    {"--main-params-dtype", "fp32", "the precision-aware optimizer's main parameters in 16 bits",
     "zeroplan keeps fp32 master weights (or bf16 with --master-weights bf16)"},
    {"--main-grads-dtype", "fp32", "16-bit main gradients", kDropIt},
    {"--exp-avg-dtype", "fp32", "16- or 8-bit Adam moments",
     "bf16 moments need bf16 master weights in zeroplan: --master-weights bf16 "
     "--optimizer-states bf16"},
    {"--exp-avg-sq-dtype", "fp32", "16- or 8-bit Adam moments",
     "bf16 moments need bf16 master weights in zeroplan: --master-weights bf16 "
     "--optimizer-states bf16"},
    {"--mtp-num-layers", "0", "multi-token prediction layers", "zeroplan does not plan MTP modules; leave it out"},
    {"--hybrid-layer-pattern", "", "hybrid (Mamba) layer patterns", "zeroplan plans transformer blocks only"},
    {"--heterogeneous-layers-config-path", "", "heterogeneous layers", "zeroplan plans uniform blocks only"},
    {"--yaml-cfg", "", "arguments read from a YAML file", "give the arguments themselves"},
    {"--use-checkpoint-args", "", "model arguments read from a checkpoint",
     "give the model's size flags (or --model) instead"},
    // Deprecated: validate_args asserts these are not given, or exits.
    {"--model-parallel-size", "", "--model-parallel-size is no longer valid (Megatron refuses it)",
     "use --tensor-model-parallel-size"},
    {"--batch-size", "", "--batch-size is no longer valid (Megatron refuses it)", "use --micro-batch-size"},
    {"--checkpoint-activations", "", "--checkpoint-activations is no longer valid (Megatron exits)",
     "use --recompute-activations, or --recompute-granularity full with --recompute-method"},
    {"--warmup", "", "--warmup is no longer valid (Megatron refuses it)", "use --lr-warmup-fraction"},
};

void refuse_unmodelled(const MegatronArgs& a) {
  for (const Unmodelled& u : kUnmodelled) {
    if (!a.has(u.flag)) continue;
    const auto v = a.value(u.flag);
    if (!u.neutral.empty() && v && (*v == u.neutral || (python_int(u.neutral) && python_int(*v) == python_int(u.neutral))))
      continue;
    refuse(a, fmt::format("{}{}: {}, which zeroplan does not model", u.flag, v ? " " + *v : "", u.what),
           std::string(u.hint));
  }
}

// Whether a DeepSpeed config given beside sets a field (Megatron-DeepSpeed takes both).
const json* ds_field(const json* ds, std::initializer_list<const char*> path) {
  if (ds == nullptr) return nullptr;
  const json* j = ds;
  for (const char* k : path) {
    if (!j->is_object() || !j->contains(k)) return nullptr;
    j = &(*j)[k];
  }
  return j;
}

// Activation recomputation (megatron/core/transformer/transformer_config.py checks,
// megatron/core/recompute.py runs it). `chunk_layers`: the layers of one model chunk (what
// Megatron's TransformerBlock calls num_layers_per_pipeline_rank), 0 when unknown.
void read_recompute(Strategy& s, const MegatronArgs& a, int64_t chunk_layers) {
  auto granularity = choice(a, "--recompute-granularity", {"full", "selective"});
  if (a.has("--recompute-activations")) granularity = "selective";  // validate_args
  const auto method = choice(a, "--recompute-method", {"uniform", "block"});
  const auto n = positive(a, "--recompute-num-layers");
  if (a.has("--distribute-saved-activations") && granularity != "full")
    refuse(a, "--distribute-saved-activations needs --recompute-granularity full",
           "Megatron distributes the checkpoints full recomputation keeps (validate_args asserts it)");
  if (!granularity) return;  // --recompute-method and -num-layers alone change nothing
  if (*granularity == "selective") {
    if (method)
      refuse(a, fmt::format("--recompute-method {} with selective recomputation", *method),
             "Megatron refuses a recompute method for selective recomputation; leave it out");
    if (n)
      refuse(a, "--recompute-num-layers with selective recomputation",
             "TransformerConfig refuses it: selective recomputation covers every layer");
    if (const auto it = a.given.find("--recompute-modules");
        it != a.given.end() && it->second != std::vector<std::string>{"core_attn"})
      refuse(a, fmt::format("--recompute-modules {}: zeroplan's selective recomputation is the "
                            "attention core's (core_attn)", fmt::join(it->second, " ")),
             "leave out --recompute-modules (Megatron's default is core_attn), or use "
             "--recompute-granularity full");
    s.checkpointing = Checkpointing::selective;  // Korthikanti et al. 2022 sec. 5
    return;
  }
  // Full: Megatron wants a method and a count (TransformerConfig.__post_init__). zeroplan's
  // full checkpoints every layer's input and recomputes one layer at a time; Megatron does
  // the same with uniform chunks of 1 layer, or block covering every layer of the chunk.
  if (!method)
    refuse(a, "--recompute-granularity full needs --recompute-method",
           "Megatron refuses full recomputation without it; --recompute-method uniform "
           "--recompute-num-layers 1 recomputes each layer");
  if (!n)
    refuse(a, "--recompute-granularity full needs --recompute-num-layers",
           "Megatron refuses full recomputation without it; --recompute-num-layers 1 with "
           "--recompute-method uniform recomputes each layer");
  if (*method == "uniform" && *n != 1)
    refuse(a, fmt::format("--recompute-num-layers {} with --recompute-method uniform: one "
                          "checkpoint per {} layers, recomputed {} at a time, which zeroplan "
                          "does not model", *n, *n, *n),
           "--recompute-num-layers 1 checkpoints and recomputes each layer (zeroplan's full)");
  if (*method == "block") {
    if (chunk_layers == 0)
      refuse(a, "--recompute-method block needs the layer count",
             "add --num-layers to the Megatron arguments, or give --model");
    if (*n < chunk_layers)
      refuse(a, fmt::format("--recompute-num-layers {} with --recompute-method block: {} of "
                            "the {} layers of each pipeline stage recomputed, the rest not, "
                            "which zeroplan does not model", *n, *n, chunk_layers),
             fmt::format("--recompute-num-layers {} recomputes every layer (zeroplan's full)",
                         chunk_layers));
  }
  s.checkpointing = Checkpointing::full;
  // distribute_saved_activations: each checkpoint split over the tensor-parallel ranks
  // (megatron/core/tensor_parallel/random.py CheckpointFunction), ZeRO-R's P_a.
  if (a.has("--distribute-saved-activations")) s.partition_activations = true;
}

}  // namespace

Strategy apply_megatron_args(Strategy s, const MegatronArgs& a, int64_t n_layer, const json* ds) {
  refuse_unmodelled(a);
  const int64_t layers = a.integer("--num-layers").value_or(a.integer("--encoder-num-layers").value_or(n_layer));

  // Parallelism. Megatron's data-parallel degree is world / (tp x pp x cp) (validate_args);
  // the caller settles it from --dp or the GPUs.
  const int64_t tp = positive(a, "--tensor-model-parallel-size").value_or(1);
  s.mp = tp;
  s.pp = positive(a, "--pipeline-model-parallel-size").value_or(1);
  s.cp = positive(a, "--context-parallel-size").value_or(1);
  s.ep = positive(a, "--expert-model-parallel-size").value_or(1);
  // validate_args turns sequence parallelism off at tp 1.
  s.sp = a.has("--sequence-parallel") && tp > 1;
  if (const auto etp = positive(a, "--expert-tensor-parallel-size"); etp && *etp != tp)
    refuse(a, fmt::format("--expert-tensor-parallel-size {} differs from "
                          "--tensor-model-parallel-size {}", *etp, tp),
           "zeroplan splits the experts over the tensor-parallel ranks as Megatron does by "
           "default; leave it out");
  if (const auto g = positive(a, "--tensor-parallel-num-weight-shards"); g && *g != tp)
    refuse(a, fmt::format("--tensor-parallel-num-weight-shards {}: weights sharded over more "
                          "ranks than --tensor-model-parallel-size {}, which zeroplan does not "
                          "model", *g, tp), "leave it out");
  if (const auto it = a.given.find("--cp-comm-type"); it != a.given.end()) {
    // One type, or one per layer: zeroplan plans one kind for every layer.
    const std::vector<std::string>& kinds = it->second;
    if (std::adjacent_find(kinds.begin(), kinds.end(), std::not_equal_to<>()) != kinds.end())
      refuse(a, fmt::format("--cp-comm-type {}: a different kind per layer", fmt::join(kinds, " ")),
             "zeroplan plans one kind for every layer: p2p (ring) or a2a (Ulysses)");
    if (kinds.front() == "p2p") s.cp_kind = CpKind::ring;        // ring attention through TE
    else if (kinds.front() == "a2a") s.cp_kind = CpKind::ulysses;  // DeepSpeed-Ulysses' all-to-all
    else
      refuse(a, fmt::format("--cp-comm-type {}: not modelled", kinds.front()),
             kinds.front() == "allgather" || kinds.front() == "a2a+p2p"
                 ? "zeroplan models p2p (ring attention, --cp-kind ring) and a2a "
                   "(DeepSpeed-Ulysses, --cp-kind ulysses)"
                 : "Megatron's kinds are p2p, a2a, allgather and a2a+p2p");
  }
  if (layers > 0 && layers % s.pp != 0)
    refuse(a, fmt::format("{} layers do not split into --pipeline-model-parallel-size {} stages",
                          layers, s.pp),
           "Megatron asserts that pp divides the layers (zeroplan plans even stages too)");
  // Interleaved pipelining: model chunks per pipeline rank, given, or from the layers per
  // chunk (validate_args: vp = (L / pp) / that, each division exact).
  const auto vstages = positive(a, "--num-virtual-stages-per-pipeline-rank");
  const auto vlayers = positive(a, "--num-layers-per-virtual-pipeline-stage");
  if (vstages && vlayers)
    refuse(a, "--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage "
              "together", "Megatron takes one of them; give one");
  if (vstages) s.vp = *vstages;
  if (vlayers) {
    if (layers == 0)
      refuse(a, "--num-layers-per-virtual-pipeline-stage needs the layer count",
             "add --num-layers to the Megatron arguments, or give --model; or give "
             "--num-virtual-stages-per-pipeline-rank");
    if ((layers / s.pp) % *vlayers != 0)
      refuse(a, fmt::format("--num-layers-per-virtual-pipeline-stage {} does not divide the {} "
                            "layers of a pipeline stage", *vlayers, layers / s.pp),
             "Megatron asserts it; choose a divisor");
    s.vp = layers / s.pp / *vlayers;
  }
  // megatron/core/pipeline_parallel/schedules.py get_forward_backward_func: the interleaved
  // 1F1B schedule with virtual stages, 1F1B without; Megatron has no GPipe.
  s.pp_schedule = s.vp > 1 ? PipelineSchedule::interleaved : PipelineSchedule::one_f_one_b;

  // Batch and sequence. --global-batch-size waits for dp (settle_megatron_batch).
  if (const auto b = positive(a, "--micro-batch-size")) s.micro_batch = *b;
  if (a.has("--seq-length") && a.has("--encoder-seq-length"))
    refuse(a, "--seq-length and --encoder-seq-length together", "Megatron asserts one of them; give --seq-length");
  if (const auto t = positive(a, "--seq-length")) s.seq = *t;
  else if (const auto te = positive(a, "--encoder-seq-length")) s.seq = *te;
  if (s.cp > 1 && s.seq > 0 && s.seq % (2 * s.cp) != 0)
    refuse(a, fmt::format("--seq-length {} is not a multiple of 2 x --context-parallel-size {}",
                          s.seq, s.cp),
           "Megatron asserts it (each rank holds two chunks of the sequence, for load balance)");

  // Precision: params_dtype is fp16 with --fp16, bf16 with --bf16, else fp32 (validate_args).
  if (a.has("--fp16") && a.has("--bf16"))
    refuse(a, "--fp16 and --bf16 together", "Megatron asserts one of them; give one");
  const Precision p = a.has("--bf16") ? Precision::bf16 : a.has("--fp16") ? Precision::fp16 : Precision::fp32;
  const json* ds_fp16 = ds_field(ds, {"fp16", "enabled"});
  const json* ds_bf16 = ds_field(ds, {"bf16", "enabled"});
  if ((ds_fp16 != nullptr && ds_fp16->is_boolean()) || (ds_bf16 != nullptr && ds_bf16->is_boolean())) {
    if (s.precision != p)
      refuse(a, fmt::format("{} contradicts the DeepSpeed config's {}",
                            p == Precision::fp32 ? "neither --bf16 nor --fp16 (fp32)"
                                                 : fmt::format("--{}", to_string(p)),
                            to_string(s.precision)),
             "Megatron-DeepSpeed needs the same precision in both; fix one of them");
  }
  s.precision = p;
  // The gradients: Megatron's DDP buffer (main_grad) is fp32 with --bf16 unless
  // --grad-reduce-in-bf16 or --main-grads-dtype bf16, and with --fp16 only under
  // --accumulate-allreduce-grads-in-fp32 (arguments.py validate_args). Under Megatron-
  // DeepSpeed (a DeepSpeed config beside) DeepSpeed's engine holds the gradients instead.
  if (ds != nullptr) {
    // the DeepSpeed config's
  } else if (p == Precision::bf16 && !a.has("--grad-reduce-in-bf16") && a.value("--main-grads-dtype").value_or("fp32") == "fp32")
    s.grad_precision = Precision::fp32;
  else if (p == Precision::fp16 && a.has("--accumulate-allreduce-grads-in-fp32"))
    s.grad_precision = Precision::fp32;

  // The distributed optimizer: ZeRO stage 1 over the data-parallel group. Megatron's
  // DistributedOptimizer (megatron/core/optimizer/distrib_optimizer.py; docs/source/
  // api-guide/dist_optimizer.md) shards the fp32 main parameters and the Adam moments over
  // the data-parallel ranks and keeps every gradient whole in the DDP grad buffer until its
  // reduce-scatter: the optimizer states partitioned, gradients and 16-bit parameters not.
  const json* ds_stage = ds_field(ds, {"zero_optimization", "stage"});
  if (a.has("--use-distributed-optimizer")) {
    if (ds_stage != nullptr)
      refuse(a, "--use-distributed-optimizer with the DeepSpeed config's zero_optimization.stage",
             "Megatron-DeepSpeed shards through DeepSpeed's ZeRO; leave out "
             "--use-distributed-optimizer");
    s.stage = 1;
  } else if (ds_stage == nullptr) {
    s.stage = 0;  // Megatron's DDP: every rank holds the whole optimizer
  }

  if (const auto b = a.integer("--micro-batch-size"); b && ds != nullptr) {
    const json* ds_b = ds_field(ds, {"train_micro_batch_size_per_gpu"});
    if (ds_b != nullptr && ds_b->is_number_integer() && ds_b->get<int64_t>() != *b)
      refuse(a, fmt::format("--micro-batch-size {} contradicts the DeepSpeed config's "
                            "train_micro_batch_size_per_gpu {}", *b, ds_b->get<int64_t>()),
             "Megatron-DeepSpeed needs the same micro-batch in both; fix one of them");
  }

  // Optimizer (megatron/core/optimizer/__init__.py): adam is TE's or Apex's FusedAdam with
  // adam_w_mode=decoupled_weight_decay, True by default: AdamW. sgd keeps a momentum buffer
  // unless --sgd-momentum 0.
  if (ds_field(ds, {"optimizer"}) == nullptr) {
    const auto opt = choice(a, "--optimizer", {"adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"})
                         .value_or("adam");
    if (opt == "adam") s.optimizer = OptimizerKind::adamw;
    else if (opt == "lion") s.optimizer = OptimizerKind::lion;
    else if (opt == "sgd") s.optimizer = a.real("--sgd-momentum").value_or(0.9) == 0 ? OptimizerKind::sgd_plain
                                                                                     : OptimizerKind::sgd;
    else
      refuse(a, fmt::format("--optimizer {}: not modelled", opt),
             "zeroplan models Adam/AdamW, SGD, Lion, Adafactor and 8-bit Adam");
  }

  read_recompute(s, a, layers > 0 && layers % (s.pp * s.vp) == 0 ? layers / (s.pp * s.vp) : 0);

  // Attention. TransformerEngine's (transformer_impl's default) --attention-backend auto, flash
  // or fused keep no T x T tensor; unfused and local, and the local transformer_impl's
  // DotProductAttention, keep the softmax. --use-flash-attn (FlashAttention in Megatron's
  // older models and in Megatron-DeepSpeed) is read by nothing at this commit, but says flash.
  const auto backend = choice(a, "--attention-backend", {"flash", "fused", "unfused", "local", "auto"})
                           .value_or("auto");
  const auto impl = choice(a, "--transformer-impl", {"local", "transformer_engine", "inference_optimized"})
                        .value_or("transformer_engine");
  s.flash_attention = a.has("--use-flash-attn") ||
                      (impl != "local" && (backend == "flash" || backend == "fused" || backend == "auto"));

  // DDP's gradient reduction overlapped with backward (megatron/core/distributed/
  // distributed_data_parallel.py, overlap_grad_reduce): bucketed, as overlap_comm.
  if (a.has("--overlap-grad-reduce")) s.overlap_comm = true;
  return s;
}

std::string megatron_command_line(const Strategy& s) {
  auto cannot = [](const std::string& what, const std::string& hint) {
    throw Error(fmt::format("Megatron-LM arguments: {} has no Megatron-LM flag", what), hint);
  };
  if (s.stage >= 2 || s.offload_optimizer != Offload::none || s.offload_param != Offload::none)
    cannot(s.stage >= 2 ? fmt::format("ZeRO stage {}", s.stage) : std::string("offloading"),
           "Megatron-LM's distributed optimizer is stage 1; run the strategy with Megatron-"
           "DeepSpeed and the DeepSpeed config (--emit-deepspeed)");
  if (s.checkpointing == Checkpointing::selective_op)
    cannot("torchtitan's per-op recomputation (selective-op)",
           "Megatron recomputes full layers or the attention core (selective)");
  std::vector<std::string> w;
  auto flag = [&](const std::string& f, auto v) { w.push_back(fmt::format("{} {}", f, v)); };
  flag("--tensor-model-parallel-size", s.mp);
  if (s.sp && s.mp > 1) w.push_back("--sequence-parallel");
  flag("--pipeline-model-parallel-size", s.pp);
  if (s.vp > 1) flag("--num-virtual-stages-per-pipeline-rank", s.vp);
  if (s.pp > 1 && s.pp_schedule == PipelineSchedule::gpipe)
    cannot("the GPipe schedule", "Megatron-LM runs 1F1B, interleaved with virtual stages");
  flag("--context-parallel-size", s.cp);
  if (s.cp > 1) flag("--cp-comm-type", s.cp_kind == CpKind::ulysses ? "a2a" : "p2p");
  if (s.ep > 1) flag("--expert-model-parallel-size", s.ep);
  flag("--micro-batch-size", s.micro_batch);
  flag("--global-batch-size",
       checked_mul(checked_mul(s.micro_batch, s.dp, "global batch"), s.grad_accum, "global batch"));
  if (s.seq > 0) flag("--seq-length", s.seq);
  // Precision, and the gradients' dtype as validate_args derives it: fp32 main_grad with
  // --bf16 unless --grad-reduce-in-bf16, with --fp16 only under
  // --accumulate-allreduce-grads-in-fp32.
  const bool fp32_grads = s.grad_precision == Precision::fp32;
  if (s.precision == Precision::bf16) {
    w.push_back("--bf16");
    if (!fp32_grads) w.push_back("--grad-reduce-in-bf16");
  } else if (s.precision == Precision::fp16) {
    w.push_back("--fp16");
    if (fp32_grads) w.push_back("--accumulate-allreduce-grads-in-fp32");
  }
  if (s.stage == 1) w.push_back("--use-distributed-optimizer");
  switch (s.checkpointing) {
    case Checkpointing::none: break;
    case Checkpointing::full:
      w.push_back("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1");
      break;
    case Checkpointing::selective: w.push_back("--recompute-granularity selective"); break;
    case Checkpointing::selective_op: break;  // refused above
  }
  flag("--attention-backend", s.flash_attention ? "flash" : "unfused");
  switch (s.optimizer) {
    case OptimizerKind::adam:
    case OptimizerKind::adamw: flag("--optimizer", "adam"); break;  // FusedAdam, decoupled decay
    case OptimizerKind::sgd: flag("--optimizer", "sgd"); break;
    case OptimizerKind::sgd_plain: w.push_back("--optimizer sgd --sgd-momentum 0"); break;
    case OptimizerKind::lion: flag("--optimizer", "lion"); break;
    default: cannot(fmt::format("--optimizer {}", to_string(s.optimizer)), "Megatron-LM runs adam, sgd or lion");
  }
  if (overlaps_comm(s) && s.dp > 1) w.push_back("--overlap-grad-reduce");
  std::string out;
  for (const std::string& x : w) out += (out.empty() ? "" : " ") + x;
  return out;
}

void settle_megatron_batch(Strategy& s, const MegatronArgs& a) {
  if (a.has("--global-batch-size") && a.has("--step-batch-size-schedule"))
    refuse(a, "--global-batch-size and --step-batch-size-schedule together",
           "Megatron refuses both ('Cannot specify both'); give one");
  std::optional<int64_t> global = positive(a, "--global-batch-size");
  if (const auto sched = a.value("--step-batch-size-schedule")) {
    // "THRESHOLD:BS THRESHOLD:BS ...": the batch grows to its largest, the step that holds the
    // most micro-batches.
    for (const std::string& item : split_shell_words(*sched, "--step-batch-size-schedule")) {
      const std::size_t colon = item.find(':');
      const auto bs = colon == std::string::npos ? std::nullopt : python_int(item.substr(colon + 1));
      if (!bs || *bs < 1)
        refuse(a, fmt::format("--step-batch-size-schedule: '{}' is not THRESHOLD:BATCH", item),
               "e.g. \"0:768 250B:1536\"");
      global = std::max(global.value_or(0), *bs);
    }
  }
  if (!global) return;
  const int64_t per_step = checked_mul(s.micro_batch, s.dp, "micro-batch x dp");
  int64_t g = *global;
  if (a.has("--decrease-batch-size-if-needed")) g = g / per_step * per_step;
  if (g % per_step != 0)
    refuse(a, fmt::format("global batch {} is not divisible by micro-batch {} x data-parallel "
                          "degree {} = {}", *global, s.micro_batch, s.dp, per_step),
           "Megatron asserts it (num_microbatches_calculator.py); the data-parallel degree is "
           "the GPUs / (tp x pp x cp), or --dp");
  if (g / per_step < 1)
    refuse(a, fmt::format("global batch {} is smaller than micro-batch {} x data-parallel degree {}",
                          *global, s.micro_batch, s.dp),
           "Megatron asserts at least one micro-batch per step");
  s.grad_accum = g / per_step;
}

// ---- the model -----------------------------------------------------------------------------

namespace {

constexpr std::string_view kModelFlags[] = {
    "--num-layers", "--encoder-num-layers", "--hidden-size", "--ffn-hidden-size",
    "--num-attention-heads", "--group-query-attention", "--num-query-groups", "--kv-channels",
    "--max-position-embeddings", "--padded-vocab-size", "--vocab-size", "--swiglu",
    "--normalization", "--untie-embeddings-and-output-weights", "--position-embedding-type",
    "--use-rotary-position-embeddings", "--num-experts", "--moe-router-topk",
    "--moe-ffn-hidden-size", "--disable-bias-linear", "--add-qkv-bias"};

// The model's sizes as Megatron derives them from its flags (validate_args and
// core_transformer_config_from_args), before choosing a family.
struct Shape {
  int64_t layers = 0, hidden = 0, heads = 0, groups = 0, kv_channels = 0, ffn = 0, positions = 0;
  int64_t experts = 0, topk = 0, moe_ffn = 0;
  std::string norm = "LayerNorm", position = "learned_absolute";
  bool swiglu = false, untie = false, bias_linear = true, qkv_bias = true;
};

int64_t required(const MegatronArgs& a, std::string_view flag, std::string_view why) {
  const auto v = positive(a, flag);
  if (!v)
    refuse(a, fmt::format("{} is missing: without --model the Megatron arguments describe the "
                          "model", flag),
           fmt::format("add {} ({}), or give --model", flag, why));
  return *v;
}

Shape read_shape(const MegatronArgs& a, bool for_building) {
  Shape m;
  m.layers = a.integer("--num-layers").value_or(a.integer("--encoder-num-layers").value_or(0));
  m.hidden = a.integer("--hidden-size").value_or(0);
  m.heads = a.integer("--num-attention-heads").value_or(0);
  if (for_building) {
    if (m.layers == 0) m.layers = required(a, "--num-layers", "Megatron requires it");
    m.hidden = required(a, "--hidden-size", "Megatron requires it");
    m.heads = required(a, "--num-attention-heads", "Megatron requires it");
    m.positions = required(a, "--max-position-embeddings", "Megatron requires it");
  }
  m.swiglu = a.has("--swiglu");
  // ffn_hidden_size's default (validate_args): 4h, or for SwiGLU int(4h x 2/3 / 64) x 64.
  m.ffn = positive(a, "--ffn-hidden-size")
              .value_or(m.swiglu ? static_cast<int64_t>(4.0 * static_cast<double>(m.hidden) * 2 / 3 / 64) * 64
                                 : 4 * m.hidden);
  if (m.heads > 0 && a.integer("--kv-channels") == std::nullopt && m.hidden % m.heads != 0)
    refuse(a, fmt::format("--hidden-size {} is not divisible by --num-attention-heads {}", m.hidden, m.heads),
           "Megatron asserts it unless --kv-channels gives the head size");
  m.kv_channels = positive(a, "--kv-channels").value_or(m.heads > 0 ? m.hidden / m.heads : 0);
  // num_query_groups counts only with --group-query-attention (its argparse default is 1);
  // otherwise every head has its own keys and values.
  m.groups = a.has("--group-query-attention") ? positive(a, "--num-query-groups").value_or(1) : m.heads;
  if (m.heads > 0 && m.groups > 0 && m.heads % m.groups != 0)
    refuse(a, fmt::format("--num-attention-heads {} is not divisible by --num-query-groups {}", m.heads, m.groups),
           "each key/value group serves a whole number of query heads");
  if (const auto p = positive(a, "--max-position-embeddings")) m.positions = *p;
  m.norm = choice(a, "--normalization", {"LayerNorm", "RMSNorm"}).value_or("LayerNorm");
  m.position = choice(a, "--position-embedding-type",
                      {"learned_absolute", "rope", "yarn", "mrope", "relative", "none"})
                   .value_or("learned_absolute");
  if (a.has("--use-rotary-position-embeddings")) m.position = "rope";  // validate_args
  m.untie = a.has("--untie-embeddings-and-output-weights");
  m.bias_linear = !a.has("--disable-bias-linear");
  m.qkv_bias = m.bias_linear || a.has("--add-qkv-bias");
  m.experts = a.integer("--num-experts").value_or(0);  // 0 is None (validate_args)
  if (m.experts < 0) refuse(a, fmt::format("--num-experts must be >= 0, got {}", m.experts), "e.g. 8");
  m.topk = positive(a, "--moe-router-topk").value_or(2);  // TransformerConfig's moe_router_topk
  m.moe_ffn = positive(a, "--moe-ffn-hidden-size").value_or(m.ffn);  // validate_args
  return m;
}

double dropout(const MegatronArgs& a, std::string_view flag) {
  const double p = a.real(flag).value_or(0.1);  // TransformerConfig: hidden_ and attention_dropout
  if (!(p >= 0 && p <= 1)) refuse(a, fmt::format("{} must be from 0 to 1, got {}", flag, p), "e.g. 0.0 or 0.1");
  return p;
}

}  // namespace

bool describes_model(const MegatronArgs& a) {
  return std::any_of(std::begin(kModelFlags), std::end(kModelFlags),
                     [&](std::string_view f) { return a.has(f); });
}

models::ModelSpec megatron_model(const MegatronArgs& a) {
  // Architecture flags no family built here has: with them, the model needs its config.
  for (std::string_view f : {"--qk-layernorm", "--multi-latent-attention", "--moe-shared-expert-intermediate-size",
                             "--window-size", "--squared-relu", "--quick-geglu", "--decoder-num-layers"})
    if (a.has(f))
      refuse(a, fmt::format("{}: an architecture zeroplan builds from Megatron's flags does not have", f),
             "give --model with the model's config.json (the flags' sizes are checked against it)");
  if (const auto freq = a.value("--moe-layer-freq"); freq && *freq != "1")
    refuse(a, fmt::format("--moe-layer-freq {}: dense and MoE layers mixed", *freq),
           "give --model with the model's config.json");
  const Shape m = read_shape(a, true);
  // The vocabulary: --padded-vocab-size, or the tokenizer's padded to a multiple of
  // --make-vocab-size-divisible-by x tp (megatron/core/tokenizers/utils/build_tokenizer.py,
  // vocab_size_with_padding).
  int64_t vocab = 0;
  if (const auto pv = positive(a, "--padded-vocab-size")) {
    vocab = *pv;
  } else {
    const int64_t v = required(a, "--vocab-size", "the tokenizer's vocabulary; Megatron reads it from the tokenizer");
    const int64_t multiple = checked_mul(positive(a, "--make-vocab-size-divisible-by").value_or(128),
                                         positive(a, "--tensor-model-parallel-size").value_or(1), "vocab padding");
    vocab = checked_mul((v + multiple - 1) / multiple, multiple, "padded vocab size");
  }
  const double attn_drop = dropout(a, "--attention-dropout"), hidden_drop = dropout(a, "--hidden-dropout");
  const double eps = a.real("--norm-epsilon").value_or(1e-5);

  json j;
  const bool gpt2 = m.norm == "LayerNorm" && !m.swiglu && m.position == "learned_absolute";
  const bool llama = m.norm == "RMSNorm" && m.swiglu && m.position == "rope";
  if (gpt2) {
    // GPT-2's block (HF GPT2Model): LayerNorm with bias, GELU MLP, learned positions, biases
    // on every linear, one key/value head per query head of C / NH channels.
    if (!m.bias_linear)
      refuse(a, "--disable-bias-linear with LayerNorm, GELU and learned positions (a GPT-2 block "
                "without biases)", "give --model with the model's config.json");
    if (m.groups != m.heads || m.kv_channels * m.heads != m.hidden)
      refuse(a, "grouped-query attention or --kv-channels with LayerNorm, GELU and learned "
                "positions (GPT-2's block has neither)", "give --model with the model's config.json");
    if (m.experts > 0)
      refuse(a, "--num-experts with LayerNorm, GELU and learned positions",
             "zeroplan builds MoE models from Megatron's flags as Mixtral's (RMSNorm, --swiglu, rope); "
             "give --model otherwise");
    j = {{"model_type", "gpt2"}, {"n_layer", m.layers}, {"n_embd", m.hidden}, {"n_head", m.heads},
         {"n_inner", m.ffn}, {"n_positions", m.positions}, {"vocab_size", vocab},
         {"tie_word_embeddings", !m.untie},
         // Megatron's gelu is F.gelu (erf); --openai-gelu the tanh approximation.
         {"activation_function", a.has("--openai-gelu") ? "gelu_new" : "gelu"},
         {"attn_pdrop", attn_drop}, {"resid_pdrop", hidden_drop}, {"embd_pdrop", hidden_drop},
         {"layer_norm_epsilon", eps}};
  } else if (llama) {
    // LLaMA's block: RMSNorm, SwiGLU, rotary positions. Its HF family has no dropout after the
    // attention and MLP (Megatron's hidden dropout, 0.1 unless set).
    if (hidden_drop != 0)
      refuse(a, fmt::format("--hidden-dropout {} with RMSNorm, --swiglu and rope: the LLaMA-family "
                            "block zeroplan builds has no dropout after attention and MLP",
                            hidden_drop),
             "LLaMA-style Megatron runs set --hidden-dropout 0.0 (Megatron's default is 0.1); "
             "or give --model");
    const bool all_bias = m.bias_linear, qkv_only = !m.bias_linear && m.qkv_bias;
    if (m.experts > 0 && (all_bias || qkv_only))
      refuse(a, "--num-experts with linear biases (Mixtral's experts and attention have none)",
             "add --disable-bias-linear, or give --model");
    if (m.experts > 0 && m.topk > m.experts)
      refuse(a, fmt::format("--moe-router-topk {} is larger than --num-experts {}", m.topk, m.experts),
             "each token is routed to at most every expert once");
    const std::string type = m.experts > 0 ? "mixtral" : qkv_only ? "qwen2" : "llama";
    j = {{"model_type", type}, {"num_hidden_layers", m.layers}, {"hidden_size", m.hidden},
         {"num_attention_heads", m.heads}, {"num_key_value_heads", m.groups},
         {"head_dim", m.kv_channels}, {"intermediate_size", m.experts > 0 ? m.moe_ffn : m.ffn},
         {"max_position_embeddings", m.positions}, {"vocab_size", vocab},
         {"tie_word_embeddings", !m.untie}, {"attention_dropout", attn_drop},
         {"rms_norm_eps", eps}, {"rope_theta", a.real("--rotary-base").value_or(10000.0)}};
    if (type == "llama") {
      j["attention_bias"] = all_bias;  // q, k, v and o
      j["mlp_bias"] = all_bias;
    }
    if (type == "mixtral") {
      j["num_local_experts"] = m.experts;
      j["num_experts_per_tok"] = m.topk;
      j["sliding_window"] = nullptr;
    }
  } else {
    refuse(a, fmt::format("--normalization {}{}, --position-embedding-type {}: zeroplan builds "
                          "GPT-2-style (LayerNorm, GELU, learned_absolute) and LLaMA-style "
                          "(RMSNorm, --swiglu, rope) models from Megatron's flags",
                          m.norm, m.swiglu ? " with --swiglu" : " without --swiglu", m.position),
           "give --model with the model's config.json");
  }
  return models::parse_hf_config(j.dump(), "megatron");
}

void check_megatron_model(const MegatronArgs& a, const models::ModelSpec& m) {
  const Shape f = read_shape(a, false);
  auto contradicts = [&](std::string_view flag, const std::string& said, const std::string& has) {
    throw Error(fmt::format("{}: {}{} contradicts --model {} ({})", a.origin, flag,
                            said.empty() ? "" : " " + said, m.name, has),
                "leave the size flags out of the Megatron arguments (the model's config gives "
                "the sizes), or leave out --model to plan the model the flags describe");
  };
  auto same = [&](std::string_view flag, int64_t model_value, std::string_view what) {
    if (const auto v = a.integer(flag); v && *v != model_value)
      contradicts(flag, std::to_string(*v), fmt::format("{} {}", what, model_value));
  };
  if (a.has("--num-layers")) same("--num-layers", m.n_layer, "layers");
  else same("--encoder-num-layers", m.n_layer, "layers");
  same("--hidden-size", m.n_embd, "hidden size");
  same("--num-attention-heads", m.n_head, "attention heads");
  same("--kv-channels", m.head_dim, "head size");
  same("--ffn-hidden-size", m.n_inner, "MLP width");
  same("--vocab-size", m.vocab_size, "vocabulary");
  same("--padded-vocab-size", m.vocab_size, "vocabulary");
  if (m.positions == models::Positions::learned)  // rotary positions hold no parameters
    same("--max-position-embeddings", m.n_positions, "learned positions");
  if (a.has("--group-query-attention") || a.has("--num-attention-heads"))
    if (f.groups != m.n_kv_head)
      contradicts(a.has("--group-query-attention") ? "--num-query-groups" : "--num-attention-heads",
                  std::to_string(a.has("--group-query-attention") ? f.groups : f.heads) +
                      (a.has("--group-query-attention") ? "" : " without --group-query-attention"),
                  fmt::format("{} key/value heads", m.n_kv_head));
  if (a.has("--num-experts") && f.experts != m.moe.n_experts)
    contradicts("--num-experts", std::to_string(f.experts), fmt::format("{} experts", m.moe.n_experts));
  if (m.is_moe()) {
    same("--moe-router-topk", m.moe.top_k, "experts per token");
    same("--moe-ffn-hidden-size", m.moe.expert_inner, "expert MLP width");
  }
  if (a.has("--swiglu") && m.mlp != models::Mlp::swiglu) contradicts("--swiglu", "", "a GELU MLP");
  if (a.has("--normalization") &&
      (f.norm == "RMSNorm") != (m.norm == models::Norm::rmsnorm))
    contradicts("--normalization", f.norm, m.norm == models::Norm::rmsnorm ? "RMSNorm" : "LayerNorm");
  if (a.has("--untie-embeddings-and-output-weights") && m.tied_embeddings)
    contradicts("--untie-embeddings-and-output-weights", "", "a head tied to the embedding");
  if (a.has("--position-embedding-type") || a.has("--use-rotary-position-embeddings")) {
    const bool rotary = f.position == "rope" || f.position == "yarn" || f.position == "mrope";
    if ((rotary && m.positions != models::Positions::rotary) ||
        (f.position == "learned_absolute" && m.positions != models::Positions::learned))
      contradicts("--position-embedding-type", f.position,
                  m.positions == models::Positions::rotary ? "rotary positions" : "other positions");
  }
  if (a.has("--disable-bias-linear") && (m.out_bias || m.mlp_bias || (m.qkv_bias && !a.has("--add-qkv-bias"))))
    contradicts("--disable-bias-linear", "", "linear layers with biases");
  if (a.has("--add-qkv-bias") && !m.qkv_bias) contradicts("--add-qkv-bias", "", "q, k, v without biases");
}

std::string megatron_deepspeed_command_line(const Strategy& s, int64_t n_layer,
                                            const std::string& deepspeed_config) {
  auto cannot = [](const std::string& what, const std::string& hint) {
    throw Error(fmt::format("Megatron-DeepSpeed arguments: {} has no Megatron-DeepSpeed flag", what),
                hint);
  };
  if (s.cp > 1 && s.cp_kind == CpKind::ring)
    cannot("ring context parallelism (--cp-kind ring)",
           "Megatron-DeepSpeed splits sequences with DeepSpeed-Ulysses (--cp-kind ulysses); ring "
           "attention is Megatron-LM's (--emit-megatron alone)");
  if (s.ep > 1)
    cannot("expert parallelism", "DeepSpeed-MoE's flags (--num-experts, --moe-expert-parallel-size) "
                                 "are not written; pass them by hand");
  if (s.checkpointing == Checkpointing::selective_op)
    cannot("torchtitan's per-op recomputation (selective-op)",
           "Megatron-DeepSpeed recomputes full layers or the attention core (selective)");
  if (s.pp > 1 && s.stage >= 2)
    cannot(fmt::format("ZeRO stage {} with a pipeline", s.stage),
           "DeepSpeed's PipelineEngine takes ZeRO stages 0-1; use --pp 1");
  if (s.pp > 1 && s.pp_schedule == PipelineSchedule::gpipe)
    cannot("the GPipe schedule", "DeepSpeed's PipelineEngine runs 1F1B");
  std::vector<std::string> w = {"--deepspeed", fmt::format("--deepspeed_config {}", deepspeed_config),
                                fmt::format("--zero-stage {}", s.stage)};
  auto flag = [&](const std::string& f, auto v) { w.push_back(fmt::format("{} {}", f, v)); };
  flag("--tensor-model-parallel-size", s.mp);
  if (s.sp && s.mp > 1) w.push_back("--sequence-parallel");
  if (s.pp > 1) {
    flag("--pipeline-model-parallel-size", s.pp);
    if (s.vp > 1) flag("--num-layers-per-virtual-pipeline-stage", n_layer / (s.pp * s.vp));
  } else {
    w.push_back("--no-pipeline-parallel");
  }
  if (s.cp > 1) flag("--ds-sequence-parallel-size", s.cp);
  flag("--micro-batch-size", s.micro_batch);
  flag("--global-batch-size",
       checked_mul(checked_mul(s.micro_batch, s.dp, "global batch"), s.grad_accum, "global batch"));
  if (s.seq > 0) flag("--seq-length", s.seq);
  if (s.precision == Precision::bf16) w.push_back("--bf16");
  if (s.precision == Precision::fp16) w.push_back("--fp16");
  switch (s.checkpointing) {
    case Checkpointing::none: break;
    case Checkpointing::full:
      if (s.partition_activations) {
        // ZeRO-R's P_a (and Pa+cpu, contiguous buffers) are DeepSpeed's checkpointing.
        w.push_back("--deepspeed-activation-checkpointing --recompute-granularity full "
                    "--recompute-method uniform --partition-activations");
        if (s.cpu_checkpointing) w.push_back("--checkpoint-in-cpu");
        if (s.contiguous_memory_optimization) w.push_back("--contigious-checkpointing");
      } else {
        w.push_back("--recompute-granularity full --recompute-method uniform");
      }
      break;
    case Checkpointing::selective: w.push_back("--recompute-granularity selective"); break;
    case Checkpointing::selective_op: break;  // refused above
  }
  if (s.flash_attention) w.push_back("--use-flash-attn-v2");
  switch (s.optimizer) {
    case OptimizerKind::adam:
    case OptimizerKind::adamw: flag("--optimizer", "adam"); break;
    case OptimizerKind::sgd:
    case OptimizerKind::sgd_plain: flag("--optimizer", "sgd"); break;
    default:
      cannot(fmt::format("--optimizer {}", to_string(s.optimizer)), "Megatron-DeepSpeed runs adam or sgd");
  }
  // An offloaded optimizer steps with DeepSpeed's CPU Adam (megatron/optimizer/__init__.py:
  // --cpu-optimizer builds DeepSpeedCPUAdam, and asserts Adam).
  if (s.offload_optimizer != Offload::none) {
    if (s.optimizer != OptimizerKind::adam && s.optimizer != OptimizerKind::adamw)
      cannot(fmt::format("an offloaded --optimizer {}", to_string(s.optimizer)),
             "Megatron-DeepSpeed's --cpu-optimizer is Adam");
    w.push_back("--cpu-optimizer");
  }
  std::string out;
  for (const std::string& x : w) out += (out.empty() ? "" : " ") + x;
  return out;
}

}  // namespace zp::planner
