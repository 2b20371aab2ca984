// zero-run: executes a plan for real on every MPI rank (the cpu backend emulates the device
// in host memory), measures memory per rank, tier and category, and holds the measurement
// against the plan's prediction. Thin: parse, build the engine, resume, loop, checkpoint,
// report. Not a trainer for real workloads (no evaluation, no learning-rate schedule).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <cstdio>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "zp/error.hpp"
#include "zp/json_fields.hpp"
#include "zp/models/graph.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/plan.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/reports/comparison.hpp"
#include "zp/reports/report_file.hpp"
#include "zp/runtime/checkpoint.hpp"
#include "zp/runtime/comm.hpp"
#include "zp/runtime/cuda.hpp"
#include "zp/runtime/data.hpp"
#include "zp/runtime/device.hpp"
#include "zp/runtime/engine.hpp"
#include "zp/units.hpp"

namespace {

// MemAvailable of /proc/meminfo, in bytes; 0 where it cannot be read (then nothing is checked).
uint64_t available_host_bytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::sscanf(line, "MemAvailable: %lu kB", &kib) == 1) break;
  std::fclose(f);
  return kib * 1024;
}


using namespace zp;

struct Args {
  std::string plan_path, model, data, report, format, save_weights, device = "cpu";
  std::string steps = "10", seed = "1234", tolerance = "2", device_memory, host_memory;
  std::string lr = "1e-3", weight_decay, grad_clip = "0", dpu_warmup, nvme_path;
  std::string save_checkpoint, checkpoint_every, keep_checkpoints, resume;
  cli::StrategyFlags flags;
};

double parse_number(const std::string& s, const char* what, double lo) {
  try {
    std::size_t used = 0;
    const double v = std::stod(s, &used);
    if (used == s.size() && std::isfinite(v) && v >= lo) return v;
  } catch (const std::exception&) {
  }
  throw Error(fmt::format("{}: '{}' is not a number >= {}", what, s, lo),
              fmt::format("e.g. {} {}", what, lo > 0 ? "0.5" : "0.01"));
}

// What the run needs, resolved identically on every rank.
struct Setup {
  planner::Plan plan;
  runtime::EngineOptions opt;
  int64_t steps = 10;
  double tolerance = 2;
  uint64_t gpu_bytes = 0, cpu_bytes = 0, nvme_bytes = 0;
  // Checkpoints: where to save, every how many steps (0: at the end only), how many to keep
  // (0: all); the checkpoint resumed from.
  std::string save_dir;
  int64_t every = 0, keep = 0;
  std::string resume_dir;
  std::optional<runtime::CheckpointManifest> resume;
};

// What differs between the model a checkpoint was saved from and this run's, for the refusal:
// the first config field with another value; "" when they are the same.
std::string model_difference(const std::string& saved, const std::string& here) {
  const nlohmann::json a = nlohmann::json::parse(saved, nullptr, false);
  const nlohmann::json b = nlohmann::json::parse(here, nullptr, false);
  if (a.is_object() && b.is_object()) {
    for (const auto& [k, v] : a.items())
      if (!b.contains(k) || b.at(k) != v)
        return fmt::format("{}: {} in the checkpoint, {} here", k, json_excerpt(v),
                           b.contains(k) ? json_excerpt(b.at(k)) : "absent");
    for (const auto& [k, v] : b.items())
      if (!a.contains(k)) return fmt::format("{}: absent in the checkpoint, {} here", k, json_excerpt(v));
    return {};
  }
  return a == b ? std::string{} : "the configs differ";
}

// nvme_path of a DeepSpeed config's offload_optimizer or offload_param section (for the
// sections that offload to NVMe), or "". zero-run keeps every swap file of a rank in one
// directory: two different paths are refused.
std::string ds_nvme_path(const std::string& ds_config, const planner::Strategy& st) {
  if (ds_config.empty()) return {};
  const nlohmann::json ds = parse_json_text(read_text_file(ds_config), ds_config);
  const auto zo = ds.find("zero_optimization");
  if (zo == ds.end() || !zo->is_object()) return {};
  auto path_of = [&](const char* section) {
    const auto o = zo->find(section);
    if (o == zo->end() || !o->is_object()) return std::string{};
    const auto p = o->find("nvme_path");
    return p != o->end() && p->is_string() ? p->get<std::string>() : std::string{};
  };
  const std::string opt =
      st.offload_optimizer == planner::Offload::nvme ? path_of("offload_optimizer") : "";
  const std::string par =
      st.offload_param == planner::Offload::nvme ? path_of("offload_param") : "";
  if (!opt.empty() && !par.empty() && opt != par)
    throw Error(fmt::format("{}: offload_optimizer.nvme_path {} and offload_param.nvme_path {} "
                            "differ; zero-run keeps a rank's swap files in one directory",
                            ds_config, opt, par),
                "give both the same nvme_path, or pass --nvme-path DIR");
  return !opt.empty() ? opt : par;
}

// --device cuda needs a build with the CUDA backend and a visible GPU; refused up front (exit 2)
// on every rank, before anything is allocated.
void check_device(const std::string& device) {
  if (device == "cpu") return;
  if (device != "cuda") throw Error(fmt::format("--device: unknown value '{}'", device), "expected cpu or cuda");
  if (!runtime::cuda_built())
    throw Error("--device cuda: this zero-run was built without the CUDA backend",
                "rebuild with -DZP_ENABLE_CUDA=ON where nvcc and NCCL are installed, or use --device cpu");
  const runtime::CudaAvailability avail = runtime::cuda_devices();
  if (avail.n_devices == 0)
    throw Error(fmt::format("no CUDA device visible ({})", avail.reason),
                "run on a GPU node or use --device cpu");
}

Setup resolve(const Args& a, const CLI::App& app, int n_ranks) {
  Setup s;
  check_device(a.device);
  const bool flags_given = [&] {
    for (const char* f : {"--stage", "--dp", "--micro-batch", "--seq", "--grad-accum",
                          "--precision", "--optimizer", "--checkpointing", "--ds-config",
                          "--offload-optimizer", "--offload-param", "--dpu", "--megatron-args"})
      if (app.count(f) > 0) return true;
    return false;
  }();
  if (!a.plan_path.empty()) {
    if (flags_given)
      throw Error("strategy flags given with a plan file: the plan already holds the strategy",
                  "run 'zero-run plan.json' alone, or 'zero-run --model ... [strategy flags]'");
    const std::string text = read_text_file(a.plan_path);
    s.plan = planner::plan_from_json(parse_json_text(text, a.plan_path), a.plan_path);
    if (!a.model.empty()) {
      const auto m = models::load_model(a.model);
      if (models::to_hf_config(m) != models::to_hf_config(s.plan.model))
        throw Error(fmt::format("{} is a plan for {}, not for --model {}", a.plan_path,
                                s.plan.model.name, a.model),
                    "make a plan for this model with zero-plan plan --model ... -o plan.json");
    }
  } else {
    if (a.model.empty() && app.count("--megatron-args") == 0)
      throw Error("nothing to run: give a plan file or --model",
                  "zero-run plan.json, or zero-run --model gpt2-tiny --stage 2 --dp 2");
    cli::StrategyFlags flags = a.flags;  // load_model notes the layers for the Megatron flags
    const models::ModelSpec model = cli::load_model(a.model, flags);
    // Without --dp, the ranks that are running are the data-parallel degree (--ep is checked
    // against it).
    const bool dp_given = app.count("--dp") > 0;
    planner::Strategy st = dp_given ? flags.resolve() : flags.resolve_for_gpus(n_ranks);
    if (!dp_given) st.dp = n_ranks;
    // The graph of the device that runs it: cpu computes in fp32 without dropout (fast on a
    // CPU), cuda in the training precision with dropout (what training on GPUs does). A plan
    // file runs on either device.
    const planner::Backend backend = a.device == "cuda" ? planner::Backend::cuda : planner::Backend::cpu;
    s.plan = planner::make_plan(model, st,
                                {planner::Profile::zeroplan, backend}, parse_count(a.seed, "--seed"));
  }
  if (app.count("--seed") > 0 && !a.plan_path.empty()) s.plan.seed = parse_count(a.seed, "--seed");
  // 0 steps is allowed: it initialises and measures (and --save-weights writes the start).
  s.steps = a.steps == "0" ? 0 : static_cast<int64_t>(parse_count(a.steps, "--steps"));
  s.tolerance = parse_number(a.tolerance, "--tolerance", 0);
  s.opt.lr = static_cast<float>(parse_number(a.lr, "--lr", 0));
  s.opt.weight_decay = a.weight_decay.empty()
                           ? (s.plan.strategy.optimizer == planner::OptimizerKind::adamw ? 0.01f : 0.0f)
                           : static_cast<float>(parse_number(a.weight_decay, "--weight-decay", 0));
  s.opt.grad_clip = static_cast<float>(parse_number(a.grad_clip, "--grad-clip", 0));

  // Checkpoints. Saving or resuming puts the staging buffer in the plan (a plan file made
  // without --checkpoint is made again with it, from its own model, strategy and seed).
  if (a.save_checkpoint.empty() && (!a.checkpoint_every.empty() || !a.keep_checkpoints.empty()))
    throw Error(fmt::format("{} needs --save-checkpoint DIR",
                            !a.checkpoint_every.empty() ? "--checkpoint-every" : "--keep-checkpoints"),
                "e.g. --save-checkpoint ckpt --checkpoint-every 100 --keep-checkpoints 3");
  s.save_dir = a.save_checkpoint;
  if (!s.save_dir.empty()) {  // said now, not after the steps
    std::error_code ec;
    std::filesystem::create_directories(s.save_dir, ec);
    if (ec || !std::filesystem::is_directory(s.save_dir))
      throw Error(fmt::format("--save-checkpoint: cannot create the directory {}: {}", s.save_dir,
                              ec ? ec.message() : "a file is in the way"),
                  "give a directory that can be created and written");
  }
  if (!a.checkpoint_every.empty()) s.every = static_cast<int64_t>(parse_count(a.checkpoint_every, "--checkpoint-every"));
  if (!a.keep_checkpoints.empty()) s.keep = static_cast<int64_t>(parse_count(a.keep_checkpoints, "--keep-checkpoints"));
  if (!a.resume.empty()) {
    s.resume_dir = runtime::resolve_checkpoint(a.resume);
    s.resume = runtime::read_manifest(s.resume_dir);
    const runtime::CheckpointManifest& m = *s.resume;
    const std::string hint = "resume with the model, --precision and --optimizer the checkpoint was saved with";
    if (const std::string diff = model_difference(m.model_config, models::to_hf_config(s.plan.model));
        !diff.empty())
      throw Error(fmt::format("--resume {}: a checkpoint of another model ({})", a.resume, diff),
                  hint);
    if (m.precision != planner::to_string(s.plan.strategy.precision))
      throw Error(fmt::format("--resume {}: saved in {}, this run trains in {}", a.resume, m.precision,
                              planner::to_string(s.plan.strategy.precision)),
                  hint);
    if (m.optimizer != planner::to_string(s.plan.strategy.optimizer))
      throw Error(fmt::format("--resume {}: holds {} states, this run's optimizer is {}", a.resume,
                              m.optimizer, planner::to_string(s.plan.strategy.optimizer)),
                  hint);
    if (m.dpu_pending && !s.plan.strategy.dpu)
      throw Error(fmt::format("--resume {}: a delayed parameter update is in flight in it, this "
                              "run has no --dpu", a.resume),
                  "resume with --dpu (and --offload-optimizer cpu or nvme)");
    // The data order and dropout go on from the checkpoint's seed; the optimizer's settings
    // are the checkpoint's unless given again.
    if (app.count("--seed") > 0 && parse_count(a.seed, "--seed") != m.seed)
      throw Error(fmt::format("--seed {} differs from the checkpoint's seed {}", a.seed, m.seed),
                  "drop --seed: a resumed run continues the checkpoint's data order");
    s.plan.seed = m.seed;
    if (app.count("--lr") == 0) s.opt.lr = static_cast<float>(m.lr);
    if (app.count("--weight-decay") == 0) s.opt.weight_decay = static_cast<float>(m.weight_decay);
    if (app.count("--grad-clip") == 0) s.opt.grad_clip = static_cast<float>(m.grad_clip);
    if (a.dpu_warmup.empty() && s.plan.strategy.dpu) s.opt.dpu_warmup_steps = m.dpu_warmup;
  }
  if ((!s.save_dir.empty() || s.resume) && s.plan.strategy.ep > 1)
    throw Error(fmt::format("{}: checkpoints of expert-parallel runs (--ep {}) are not supported yet",
                            !s.save_dir.empty() ? "--save-checkpoint" : "--resume", s.plan.strategy.ep),
                "run with --ep 1 to save or resume a checkpoint");
  if ((!s.save_dir.empty() || s.resume) && !s.plan.strategy.save_checkpoint) {
    planner::Strategy st = s.plan.strategy;
    st.save_checkpoint = true;
    s.plan = planner::make_plan(s.plan.model, st, s.plan.options, s.plan.seed);
  }
  if (!a.dpu_warmup.empty()) {
    if (!s.plan.strategy.dpu)
      throw Error("--dpu-warmup: the plan has no delayed parameter update",
                  "add --dpu (with --offload-optimizer cpu), or drop --dpu-warmup");
    s.opt.dpu_warmup_steps = a.dpu_warmup == "0" ? 0 : static_cast<int64_t>(parse_count(a.dpu_warmup, "--dpu-warmup"));
  }

  const planner::Strategy& st = s.plan.strategy;
  if (st.offload_optimizer == planner::Offload::nvme ||
      st.offload_param == planner::Offload::nvme) {
    const char* which = st.offload_optimizer == planner::Offload::nvme ? "optimizer" : "param";
    s.opt.nvme_path = !a.nvme_path.empty() ? a.nvme_path : ds_nvme_path(a.flags.ds_config, st);
    if (s.opt.nvme_path.empty())
      throw Error(
          fmt::format("--offload-{} nvme needs --nvme-path DIR (a directory on the NVMe drive)",
                      which),
          fmt::format("e.g. --nvme-path /local_nvme (or nvme_path in the DeepSpeed config's "
                      "offload_{} section); each rank keeps its swap files there",
                      which));
  } else if (!a.nvme_path.empty()) {
    throw Error("--nvme-path: the plan offloads nothing to NVMe",
                "add --offload-optimizer nvme or --offload-param nvme, or drop --nvme-path");
  }

  // Arena capacities: what the plan predicts with room to spare, or what the user gives, in
  // which case a plan that does not fit is refused before anything runs.
  const uint64_t gpu_pred = s.plan.predicted.peak(planner::Tier::gpu);
  const uint64_t cpu_pred = s.plan.predicted.peak(planner::Tier::cpu);
  auto with_room = [](uint64_t b) { return b + b / 2 + (64ULL << 20); };
  s.gpu_bytes = with_room(gpu_pred);
  s.cpu_bytes = with_room(cpu_pred);
  s.nvme_bytes = with_room(s.plan.predicted.peak(planner::Tier::nvme));  // an address space
  // What the engine cannot execute is said before what memory it would need.
  runtime::Engine::check(s.plan, a.device, n_ranks);
  if (!a.device_memory.empty()) {
    s.gpu_bytes = parse_bytes(a.device_memory, "--device-memory");
    if (gpu_pred > s.gpu_bytes)
      throw Error(fmt::format("the plan needs {} on the device, --device-memory gives {}",
                              format_bytes(gpu_pred), format_bytes(s.gpu_bytes)),
                  "give more memory, or plan a smaller footprint (higher --stage, "
                  "--checkpointing full, smaller --micro-batch)");
  }
  if (!a.host_memory.empty()) {
    s.cpu_bytes = parse_bytes(a.host_memory, "--host-memory");
    if (cpu_pred > s.cpu_bytes)
      throw Error(fmt::format("the plan needs {} on the host, --host-memory gives {}",
                              format_bytes(cpu_pred), format_bytes(s.cpu_bytes)),
                  "give more host memory");
  }
  // The cpu backend holds the device tier in host memory too: a plan larger than the memory
  // this machine has available would be killed part-way (the arenas are reserved lazily), so
  // it is refused here, per rank.
  if (a.device == "cpu") {
    const uint64_t avail = available_host_bytes();
    if (avail > 0 && gpu_pred + cpu_pred > avail)
      throw Error(fmt::format("the cpu backend needs {} of host memory for this rank ({} device tier "
                              "+ {} host tier), the machine has {} available",
                              format_bytes(gpu_pred + cpu_pred), format_bytes(gpu_pred),
                              format_bytes(cpu_pred), format_bytes(avail)),
                  "run a smaller config on the cpu backend (e.g. gpt2-tiny), fewer ranks per "
                  "machine, or the plan on GPUs (--device cuda)");
  }
  return s;
}

std::string progress_bar(int64_t done, int64_t total) {
  const int width = 20;
  const int filled = static_cast<int>(done * width / std::max<int64_t>(total, 1));
  return "[" + std::string(static_cast<std::size_t>(filled), '#') +
         std::string(static_cast<std::size_t>(width - filled), '.') + "]";
}

constexpr int kPacked = static_cast<int>(planner::kTiers.size() * (planner::kCategories.size() + 1));
std::vector<uint64_t> pack(const planner::PerDevice& d) {
  std::vector<uint64_t> v;
  for (auto t : planner::kTiers) {
    for (auto c : planner::kCategories) v.push_back(d[t][c]);
    v.push_back(d.peak(t));
  }
  return v;
}
planner::PerDevice unpack(const uint64_t* v) {
  planner::PerDevice d;
  for (auto t : planner::kTiers) {
    for (auto c : planner::kCategories) d[t][c] = *v++;
    d.set_peak(t, *v++);
  }
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  // A file-size limit (ulimit -f) on the swap files is then an error naming the file (EFBIG),
  // not a kill by the kernel's SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  runtime::MpiSession mpi(&argc, &argv);
  std::unique_ptr<runtime::Comm> comm;
  try {
    comm = runtime::make_mpi_comm();
  } catch (const Error& e) {
    cli::say_error(e);
    return cli::kExitBadInput;
  }
  const int rank = comm->rank();
  const std::string at_rank = fmt::format("rank {}: ", rank);
  const bool lead = rank == 0;
  if (!lead) {  // one voice: only rank 0 prints help and usage errors
    std::fclose(stdout);
  }

  Args a;
  CLI::App app{"zero-run: execute a zeroplan plan on every MPI rank, measure memory per rank, "
               "tier and category, and check it against the prediction.\n"
               "Run N ranks with: mpirun -np N zero-run plan.json (a single process is one rank)."};
  app.name("zero-run");
  app.add_option("plan", a.plan_path, "a plan file from 'zero-plan plan -o plan.json'");
  app.add_option("--model", a.model, "catalog name or HF config.json (instead of a plan file)");
  cli::add_strategy_flags(app, a.flags);
  app.add_option("--steps", a.steps, "optimizer steps to run [10]");
  app.add_option("--data", a.data, "a text file to train on, byte by byte [an embedded text]");
  app.add_option("--seed", a.seed, "seed of the weights and the data order [the plan's, 1234]");
  app.add_option("--lr", a.lr, "learning rate [1e-3]");
  app.add_option("--weight-decay", a.weight_decay, "weight decay [0; adamw 0.01]");
  app.add_option("--grad-clip", a.grad_clip, "clip the global gradient norm to this [0: off]");
  app.add_option("--dpu-warmup", a.dpu_warmup,
                 "with --dpu: plain offloaded steps before the delayed update starts [10]");
  app.add_option("--device", a.device,
                 "cpu (the device tier emulated in host memory) or cuda [cpu]. With --model the plan "
                 "is made for it: cpu computes in fp32 without dropout, cuda in the training "
                 "precision with dropout (16-bit activations, cuBLAS 16-bit GEMMs). A plan file "
                 "runs on either: a --device cuda plan on the cpu backend runs the GPU's graph "
                 "(slower), as CI tests it");
  app.add_option("--device-memory", a.device_memory,
                 "device arena size, e.g. 2GiB; a plan that needs more is refused [prediction + 50%]");
  app.add_option("--host-memory", a.host_memory, "host arena size [prediction + 50%]");
  app.add_option("--nvme-path", a.nvme_path,
                 "with --offload-optimizer nvme or --offload-param nvme: a directory on the NVMe "
                 "drive for the swap files [nvme_path of --ds-config]");
  app.add_option("--report", a.report,
                 "write the predicted-vs-measured report: .html (charts), .json, .md, .csv, .txt or "
                 ".xml (JUnit)");
  app.add_option("--tolerance", a.tolerance, "largest allowed error of a measured peak, percent [2]");
  app.add_option("--save-weights", a.save_weights, "write the final fp32 weights (flat, n_params floats)");
  app.add_option("--save-checkpoint", a.save_checkpoint,
                 "save a training checkpoint to this directory at the end (and with "
                 "--checkpoint-every): every rank's states, the step, the loss scaler; DIR/latest "
                 "names the newest. On several nodes DIR must be shared storage");
  app.add_option("--checkpoint-every", a.checkpoint_every,
                 "with --save-checkpoint: also every N steps [0: at the end only]");
  app.add_option("--keep-checkpoints", a.keep_checkpoints,
                 "with --save-checkpoint: keep the K newest checkpoints, remove older ones [0: all]");
  app.add_option("--resume", a.resume,
                 "continue from a checkpoint (its directory or one of its step-* directories), at "
                 "any --dp or --stage: --steps still counts from the start of training");
  cli::add_format_flag(app, a.format);
  app.footer(
      "Examples:\n"
      "  zero-run --model gpt2-tiny --stage 2 --steps 5\n"
      "  zero-plan plan --model gpt2-tiny --stage 3 --dp 4 -o plan.json && mpirun -np 4 zero-run "
      "plan.json\n"
      "  mpirun -np 2 zero-run --model gpt2-tiny --stage 1 --checkpointing full --report run.json\n"
      "  zero-run --model gpt2-tiny --stage 2 --offload-optimizer nvme --nvme-path /local_nvme\n"
      "  zero-run --model gpt2-tiny --stage 3 --offload-optimizer cpu --offload-param nvme "
      "--nvme-path /local_nvme\n"
      "  zero-plan plan --model gpt2 --stage 2 --device cuda -o gpu.json && zero-run gpu.json "
      "--steps 2   # the GPU's bf16 graph, on the cpu\n"
      "  mpirun -np 4 zero-run --model gpt2-tiny --stage 2 --steps 100 --save-checkpoint ckpt "
      "--checkpoint-every 20 --keep-checkpoints 2\n"
      "  mpirun -np 2 zero-run --model gpt2-tiny --stage 3 --steps 200 --resume ckpt   # from "
      "step 100, now at dp 2\n"
      "Exit codes: 0 measured within tolerance, 1 a peak is off by more than the tolerance,\n"
      "2 bad input (one error line and a hint).");

  // Parse and resolve on every rank (same argv, same answer); agree on failure before any
  // rank starts a collective, so a bad input never leaves ranks waiting.
  // A bad input is said once: the other ranks hold their messages back and say them only when
  // rank 0 had none to say (an input that fails on some ranks only, e.g. a file missing from
  // one node's disk), each line then naming its rank.
  std::optional<Setup> setup;
  std::ostringstream held;
  std::streambuf* const own_err = lead ? nullptr : std::cerr.rdbuf(held.rdbuf());
  int rc = cli::run(app, argc, argv, [&]() -> int {
    setup = resolve(a, app, comm->size());
    return cli::kExitOk;
  });
  if (own_err != nullptr) std::cerr.rdbuf(own_err);
  if (rc == cli::kExitOk && !setup) return cli::kExitOk;  // --help
  const bool bad = rc != cli::kExitOk || !setup;
  const double failed = comm->all_reduce_sum(bad ? 1.0 : 0.0);
  if (failed > 0) {
    const bool lead_said = comm->all_reduce_sum(lead && bad ? 1.0 : 0.0) > 0;
    if (!lead && !lead_said) {
      std::istringstream lines(held.str());
      for (std::string line; std::getline(lines, line);) std::cerr << fmt::format("rank {}: {}\n", rank, line);
    }
    return rc != cli::kExitOk ? rc : cli::kExitBadInput;
  }

  const Setup& s = *setup;
  std::unique_ptr<runtime::Device> dev;
  std::unique_ptr<runtime::Comm> nccl;  // --device cuda: the engine's comm (destroyed before dev)
  std::unique_ptr<runtime::Engine> engine;
  reports::Comparison cmp;
  std::optional<Error> setup_error;
  // Errors after this point may strike one rank only (an arena running out): that rank
  // reports and ends the whole job, so no rank hangs in a collective.
  auto fail = [&](const Error& e, int code) {
    cli::say_error(e, at_rank);
    comm->abort(code);
  };
  const bool cuda = a.device == "cuda";
  try {
    runtime::DeviceConfig dc;
    dc.gpu_bytes = s.gpu_bytes;
    dc.cpu_bytes = s.cpu_bytes;
    dc.nvme_bytes = s.nvme_bytes;
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    dc.n_threads = static_cast<int>(std::max(1u, cores / static_cast<unsigned>(comm->local_size())));
    // A GPU's arena may fail on one rank only (memory taken by another process): every rank
    // learns of it before NCCL's initialisation, which would wait for the missing rank.
    std::optional<Error> device_error;
    try {
      runtime::CudaOptions co;
      co.local_rank = comm->local_rank();  // one rank per GPU of the node, as MPI sees the node
      dev = cuda ? runtime::make_cuda_device(dc, co) : runtime::make_cpu_device(dc);
    } catch (const Error& e) {
      device_error = e;
    }
    if (comm->all_reduce_sum(device_error ? 1.0 : 0.0) > 0) {
      if (device_error) {
        cli::say_error(*device_error, at_rank);
      }
      return cli::kExitBadInput;
    }
    if (cuda) nccl = runtime::make_nccl_comm(*dev, *comm);
    engine = std::make_unique<runtime::Engine>(s.plan, *dev, nccl ? *nccl : *comm,
                                               runtime::TokenData::load(a.data), s.opt);
  } catch (const Error& e) {
    setup_error = e;
  }
  // Resuming: every rank loads its partition once every rank has an engine. load_checkpoint
  // agrees on failure itself: the ranks that found a damaged file say so (each may read it),
  // and every rank exits 2.
  if (s.resume && comm->all_reduce_sum(setup_error ? 1.0 : 0.0) == 0) {
    try {
      engine->load_checkpoint(s.resume_dir, *s.resume);
    } catch (const runtime::StepFailed& e) {
      if (e.origin()) {
        cli::say_error(e, at_rank);
      }
      engine.reset();
      return cli::kExitBadInput;
    }
  }
  // Setup errors are mostly the same on every rank (the plan, the data): rank 0 speaks for
  // all. One that strikes some ranks only (a swap file that cannot be created) is said by
  // each of them. Every rank exits 2, none waits in a collective.
  const double n_failed = comm->all_reduce_sum(setup_error ? 1.0 : 0.0);
  if (n_failed > 0) {
    const bool lead_failed = comm->all_reduce_sum(lead && setup_error ? 1.0 : 0.0) > 0;
    if (setup_error && (lead || !lead_failed)) {
      cli::say_error(*setup_error, lead ? "" : at_rank);
    }
    engine.reset();
    return cli::kExitBadInput;
  }

  if (lead) {
    // A MoE model: its experts and routing, and the load-balancing loss when it is trained with one.
    std::string moe;
    if (const auto& m = s.plan.model; m.is_moe()) {
      moe = fmt::format(", {} experts top {}{}", m.moe.n_experts, m.moe.top_k,
                        models::hf_topk_renorm(m) ? " renormalised" : "");
      if (const double c = models::moe_aux_loss_coef(m); c > 0) moe += fmt::format(" + load-balancing loss x {:g}", c);
    }
    // With expert parallelism a rank holds E/ep of the experts: its parameters, then the model's.
    const std::string params =
        engine->n_params() == engine->model_params()
            ? format_count(engine->n_params()) + " parameters"
            : fmt::format("{} parameters per rank ({} in the model)", format_count(engine->n_params()),
                          format_count(engine->model_params()));
    std::printf("zero-run: %s%s, %s, %lld rank%s, %s backend, %s, %s\n",
                s.plan.model.name.c_str(), moe.c_str(), planner::describe(s.plan.strategy).c_str(),
                static_cast<long long>(comm->size()), comm->size() == 1 ? "" : "s", dev->name().data(),
                planner::describe_compute(s.plan.model, s.plan.strategy, s.plan.options).c_str(),
                params.c_str());
    if (s.resume)
      std::printf("resumed from %s at step %lld (saved at dp %lld, stage %d)%s\n", s.resume_dir.c_str(),
                  static_cast<long long>(s.resume->step), static_cast<long long>(s.resume->dp),
                  s.resume->stage,
                  s.resume->step >= s.steps ? fmt::format("; --steps {} already reached, nothing to run",
                                                          s.steps).c_str()
                                            : "");
  }
  const int64_t start = engine->steps_done();
  int64_t saved_at = -1;
  auto save = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    engine->save_checkpoint(s.save_dir, s.keep);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    saved_at = engine->steps_done();
    if (lead) {
      std::printf("checkpoint: %s/%s (written in %.3f s)\n", s.save_dir.c_str(),
                  runtime::checkpoint_dir_name(saved_at).c_str(), secs);
      std::fflush(stdout);
    }
  };
  try {
    for (int64_t i = start; i < s.steps; ++i) {
      const runtime::StepStats st = engine->step();
      cmp.steps.push_back({st.step, st.loss, st.seconds, st.grad_norm, st.loss_scale, st.skipped});
      if (lead) {
        std::printf("%s step %lld/%lld  loss %.4f  %.3f s%s\n", progress_bar(i + 1, s.steps).c_str(),
                    static_cast<long long>(st.step), static_cast<long long>(s.steps), st.loss,
                    st.seconds, st.skipped ? "  (fp16 overflow: step skipped, loss scale halved)" : "");
        std::fflush(stdout);
      }
      if (!s.save_dir.empty() && s.every > 0 && st.step % s.every == 0) save();
    }
    if (!s.save_dir.empty() && saved_at != engine->steps_done()) save();
    if (!a.save_weights.empty()) engine->save_weights(a.save_weights);
  } catch (const runtime::StepFailed& e) {
    // Every rank is here together: the failing rank says why, all remove their swap files
    // (the engine's destructor) and exit 1 without aborting the job.
    if (e.origin()) {
      cli::say_error(e, at_rank);
    }
    engine.reset();
    return cli::kExitCheckFailed;
  } catch (const Error& e) {
    engine.reset();  // its swap files, before the job ends
    fail(e, 1);
  }

  // Every rank's measurement to rank 0.
  const std::vector<uint64_t> mine = pack(dev->measured());
  std::vector<uint64_t> all(static_cast<std::size_t>(kPacked * comm->size()));
  comm->gather_u64(mine.data(), all.data(), kPacked);
  // cuda: the context and library bytes outside the arena, per rank, and what its bound needs
  // to know of the rank's node (ranks on it, whether NVLS can engage).
  constexpr int kOutside = 5;
  std::vector<uint64_t> outside(static_cast<std::size_t>(kOutside * comm->size()));
  if (cuda) {
    const runtime::CudaMemoryInfo m = runtime::cuda_memory_info(*dev);
    const uint64_t v[kOutside] = {m.total_bytes, m.context_bytes(), m.libraries_bytes(),
                                  static_cast<uint64_t>(comm->local_size()),
                                  m.compute_capability_major >= 9 ? 1u : 0u};
    comm->gather_u64(v, outside.data(), kOutside);
  }
  int exit_code = cli::kExitOk;
  if (lead) {
    cmp.model = s.plan.model.name;
    cmp.n_params = engine->n_params();
    cmp.strategy = s.plan.strategy;
    cmp.device = std::string(dev->name());
    cmp.tolerance_pct = s.tolerance;
    // Without a step there is nothing to hold against the step's prediction.
    if (engine->steps_done() > start)
      for (int r = 0; r < comm->size(); ++r)
      {
        cmp.ranks.push_back({r, s.plan.predicted, unpack(all.data() + r * kPacked), std::nullopt});
        const uint64_t* o = outside.data() + r * kOutside;
        if (cuda) {
          const planner::NcclNode node{.local_ranks = static_cast<int>(o[3]), .nvls_capable = o[4] != 0};
          cmp.ranks.back().outside_arena = reports::OutsideArena{
              o[0], o[1], o[2], planner::cuda_outside_arena_bound(s.plan.strategy, node).total()};
        }
      }
    else
      std::printf("no step ran: memory not compared\n");
    try {
      std::printf("\n%s", reports::render_comparison(cmp, cli::parse_format(a.format)).c_str());
      if (!a.report.empty()) {
        const auto kind = reports::report_kind(a.report);
        if (kind == reports::ReportKind::html && engine->steps_done() > start) {
          // The timeline chart: the planner's replay of the plan next to rank 0's first micro-step.
          const auto e = planner::estimate(s.plan.model, s.plan.strategy, nullptr, s.plan.options);
          cmp.predicted_timeline = e.memory.timeline;
          cmp.op_names = e.schedule.op_names;
          cmp.measured_timeline = engine->timeline();
        }
        reports::write_file_atomic(a.report, reports::render_report(cmp, kind));
      }
    } catch (const Error& e) {
      cli::say_error(e);
      exit_code = cli::kExitBadInput;
    }
    if (exit_code == cli::kExitOk && !cmp.within_tolerance()) exit_code = cli::kExitCheckFailed;
  }
  // Every rank leaves with rank 0's verdict.
  exit_code = static_cast<int>(comm->all_reduce_sum(static_cast<double>(exit_code)));
  engine.reset();
  return exit_code;
}
