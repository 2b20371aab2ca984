// cmd_fit.cpp: `zero-plan fit`: flags -> FitRequest, the search, and its text/markdown/csv/json
// output; --max-model, --emit-deepspeed and --trace. Printing only; the search is planner/fit.
#include "cmd_fit.hpp"

#include <chrono>
#include <iostream>

#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/models/graph.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/fit.hpp"
#include "zp/planner/megatron_args.hpp"
#include "zp/planner/simulate.hpp"
#include "zp/units.hpp"

namespace zp::cli {

using planner::Candidate;
using planner::Tier;

void add_fit_command(CLI::App& app, FitCommand& c) {
  c.app = app.add_subcommand(
      "fit", "the fastest configurations that fit a machine, and the largest model that does");
  CLI::App& f = *c.app;
  f.add_option("--model", c.model, "catalog name (zero-plan models) or a HF config.json [the model "
               "--megatron-args describes]");
  f.add_option("--hardware", c.hardware,
               "preset (v100-32g, a100-40g, a100-80g, h100-80g, h200-141g) or a hardware JSON file")
      ->required();
  f.add_option("--gpus", c.gpus, "GPUs of the job [1]");
  f.add_option("--nodes", c.nodes, "nodes they are spread over [as few as hold them]");
  f.add_option("--top", c.top, "candidates to print [5]");
  f.add_flag("--max-model", c.max_model,
             "find the largest model of the family (the --model's width, more or fewer layers) "
             "that fits");
  f.add_flag("--progress", c.progress,
             "with --max-model: one line per probed depth on stderr [on when stderr is a terminal]");
  f.add_flag("--parallel", c.parallel,
             "search tensor, sequence, pipeline and context parallelism with ZeRO: tp (powers of "
             "two up to a node's GPUs) x sp off/on x pp (divisors of the layer count) x vp 1, 2 x "
             "cp 1, 2, 4, 8 x ep x dp x stage x offload x micro-batch x checkpointing in one round; "
             "--tp, --sp, --pp, --vp, --cp pin one [off: data parallelism first, tensor "
             "parallelism only when nothing fits]");
  f.add_option("--global-batch", c.global_batch,
               "sequences per optimizer step over the job (Megatron's --global-batch-size): each "
               "configuration accumulates global / (micro-batch x dp) micro-batches, a pipeline's "
               "micro-batches in flight; those it does not divide are left out [--grad-accum for "
               "every configuration]");
  f.add_flag("--exhaustive", c.exhaustive,
             "with --parallel: evaluate every configuration exactly instead of screening them "
             "(memory on a line through two small depths, a bound on the step; the reported "
             "candidates are exact either way) [screened for models whose blocks are alike]");
  f.add_option("--emit-deepspeed", c.emit_deepspeed, "write the winner as a DeepSpeed config");
  f.add_option("--emit-megatron", c.emit_megatron,
               "write the winner as Megatron-LM arguments (one line for pretrain_gpt.py); the search "
               "keeps to what Megatron-LM runs: stages 0-1 (its distributed optimizer), nothing "
               "offloaded. With --emit-deepspeed too: Megatron-DeepSpeed's arguments beside that "
               "DeepSpeed config (--deepspeed --deepspeed_config FILE --zero-stage N; every ZeRO "
               "stage and offload searched, context parallelism as DeepSpeed-Ulysses)");
  f.add_option("--trace", c.trace, "write the winner's simulated step as a Chrome trace (Perfetto)");
  f.add_option("-o,--output", c.output, "write to this file (atomically) instead of stdout");
  add_strategy_flags(f, c.flags);
  add_target_flags(f, c.target, "cuda");
  add_format_flag(f, c.format);
  f.footer(
      "Strategy flags pin one dimension of the search (--stage 3 searches only stage 3); the\n"
      "others are searched: stage x offload x micro-batch x checkpointing x DPU x overlap_comm\n"
      "(stages 2-3 with more than one rank; 'overlap' in the table), and the model-parallel\n"
      "degree when nothing fits without it. --parallel searches tensor, sequence, pipeline and\n"
      "context parallelism with them in one round (a deep model's search screened: memory from\n"
      "two small depths, steps on full-depth costs, the fastest evaluated exactly).\n"
      "Exit codes: 0 something fits, 1 nothing does (the closest miss is printed), 2 bad input.\n"
      "Examples:\n"
      "  zero-plan fit --model gpt2-xl --hardware v100-32g --gpus 16\n"
      "  zero-plan fit --model llama-2-7b --hardware a100-80g --gpus 8 --emit-deepspeed ds.json\n"
      "  zero-plan fit --model llama-2-7b --hardware a100-80g --gpus 8 --stage 1 --emit-megatron args.txt\n"
      "  zero-plan fit --model gpt2-xl --hardware v100-32g --max-model --offload-optimizer cpu\n"
      "  zero-plan fit --model llama-3.1-70b --hardware h100-80g --gpus 256 --parallel --global-batch 1024 \\\n"
      "      --seq 8192 --flash-attention --emit-megatron args.txt");
}

namespace {

int64_t count_flag(const std::string& text, const char* flag) {
  const uint64_t v = parse_count(text, flag);
  if (v > (uint64_t{1} << 40)) throw Error(fmt::format("{}: '{}' is too large", flag, text));
  return static_cast<int64_t>(v);
}

std::string row_strategy(const planner::Strategy& s, planner::Profile profile) {
  // FSDP's names for its sharding: FULL_SHARD reshards after forward, SHARD_GRAD_OP does not;
  // their hybrid forms shard over fewer ranks than dp (HSDP under FSDP2).
  const bool fsdp = profile == planner::Profile::fsdp;
  const bool hybrid = fsdp && planner::fsdp_replicas(s) > 1;
  std::string out = !fsdp ? fmt::format("stage {}", s.stage)
                    : hybrid ? fmt::format("{} {}x{}",
                                           s.reshard_after_forward ? "HYBRID_SHARD" : "_HYBRID_SHARD_ZERO2",
                                           planner::fsdp_replicas(s), s.fsdp_shard_size)
                             : std::string(s.reshard_after_forward ? "FULL_SHARD" : "SHARD_GRAD_OP");
  if (fsdp && s.fsdp_version == 1) out += " FSDP1";
  if (s.mp > 1) out += fmt::format(" tp {}", s.mp);
  if (s.sp && s.mp > 1) out += " sp";
  if (s.pp > 1) out += fmt::format(" pp {}", s.pp);
  if (s.vp > 1) out += fmt::format(" vp {}", s.vp);
  if (s.cp > 1)
    out += fmt::format(" cp {}{}", s.cp, s.cp_kind == planner::CpKind::ulysses ? " ulysses" : "");
  out += fmt::format(" dp {}", s.dp);
  if (s.ep > 1) out += fmt::format(" ep {}", s.ep);
  out += fmt::format(" B={}", s.micro_batch);
  if (s.checkpointing != planner::Checkpointing::none)
    out += fmt::format(" ckpt {}", planner::to_string(s.checkpointing));
  if (s.offload_optimizer != planner::Offload::none)
    out += fmt::format(" opt->{}", planner::to_string(s.offload_optimizer));
  if (s.offload_param != planner::Offload::none)
    out += fmt::format(" params->{}", planner::to_string(s.offload_param));
  if (s.dpu) out += " dpu";
  if (!fsdp && s.stage >= 2 && planner::zero_dp(s) > 1 && planner::overlaps_comm(s)) out += " overlap";
  if (s.pp > 1 || s.grad_accum > 1) out += fmt::format(" ga {}", s.grad_accum);
  return out;
}

std::string render_text(const planner::FitResult& f, const planner::FitRequest& r,
                        reports::Format fmt_, double seconds) {
  std::string out;
  if (fmt_ == reports::Format::text)
    out += fmt::format("{} on {} x {} ({} node{}), profile {}: searched {} configurations "
                       "({} graphs) in {:.2f} s, {} fit{}\n\n",
                       r.model.name, f.gpus, r.hw.name, f.nodes, f.nodes > 1 ? "s" : "",
                       planner::to_string(r.options.profile), f.n_searched, f.n_shapes, seconds,
                       f.n_fit,
                       f.screened ? fmt::format(" (screened: {} evaluated exactly, the rest "
                                                "extrapolated from two small depths)", f.n_exact)
                                  : "");
  reports::Table t({"#", "strategy", "gpu peak", "cpu/node", "step s", "tokens/s", "TFLOP/s",
                    "why"},
                   {reports::Align::right, reports::Align::left, reports::Align::right,
                    reports::Align::right, reports::Align::right, reports::Align::right,
                    reports::Align::right, reports::Align::left});
  const int64_t ranks = std::min<int64_t>(f.gpus, r.hw.gpus_per_node);
  for (std::size_t i = 0; i < f.candidates.size(); ++i) {
    const Candidate& c = f.candidates[i];
    t.add({std::to_string(i + 1), row_strategy(c.strategy, r.options.profile),
           format_bytes(c.per_device.peak(Tier::gpu)),
           format_bytes(c.per_device.peak(Tier::cpu) * static_cast<uint64_t>(ranks)),
           fmt::format("{:.3f}", c.step_seconds), fmt::format("{:.0f}", c.tokens_per_second),
           fmt::format("{:.1f}", c.tflops_per_gpu), c.why});
  }
  if (!f.candidates.empty()) out += t.render(fmt_);
  if (f.closest) {
    out += fmt::format("nothing fits. Closest: {}\n", planner::describe(f.closest->strategy));
    for (const std::string& s : f.closest->shortfalls) out += fmt::format("  {}\n", s);
  }
  return out;
}

// DeepSpeed's own estimators for the winner (stage 2 or 3), as --profile deepspeed reports.
nlohmann::json ds_estimator(const planner::Strategy& s, const models::ParamInventory& inv,
                            const planner::FitResult& f, const planner::Hardware& hw) {
  const int64_t per_node = std::min<int64_t>(f.gpus, hw.gpus_per_node);
  const uint64_t total = static_cast<uint64_t>(inv.total);
  if (s.stage == 2 || s.stage == 1) {
    const auto e = planner::ds_estimate_zero2(total, per_node, f.nodes,
                                              s.offload_optimizer != planner::Offload::none);
    return {{"function", "estimate_zero2_model_states_mem_needs"},
            {"cpu_bytes_per_node", e.cpu_bytes}, {"gpu_bytes", e.gpu_bytes}};
  }
  if (s.stage == 3) {
    const auto e = planner::ds_estimate_zero3(
        total, static_cast<uint64_t>(inv.largest_module_params), per_node, f.nodes,
        s.offload_optimizer != planner::Offload::none, s.offload_param != planner::Offload::none,
        true);
    return {{"function", "estimate_zero3_model_states_mem_needs"},
            {"cpu_bytes_per_node", e.cpu_bytes}, {"gpu_bytes", e.gpu_bytes},
            {"largest_layer_bytes", e.largest_layer_bytes}};
  }
  return nullptr;
}

}  // namespace

int FitCommand::execute(reports::Format fmt_, std::string& out) {
  planner::FitRequest r;
  r.model = load_model(model, flags);
  r.hw = planner::load_hardware(hardware);
  r.gpus = count_flag(gpus, "--gpus");
  if (r.gpus < 1) throw Error("--gpus: must be >= 1, got 0", "e.g. --gpus 8");
  if (!nodes.empty()) {
    r.nodes = count_flag(nodes, "--nodes");
    if (r.nodes < 1) throw Error("--nodes: must be >= 1, got 0", "leave it out to use as few as hold the GPUs");
    if (r.nodes > r.gpus)
      throw Error(fmt::format("--nodes {} is more than --gpus {}", r.nodes, r.gpus),
                  "every node runs at least one GPU");
  }
  r.top = static_cast<std::size_t>(count_flag(top, "--top"));
  r.options = target.resolve(planner::Backend::cuda, &flags);
  if (r.options.backend != planner::Backend::cuda)
    throw Error("--device cpu: fit plans GPU training", "leave out --device");
  const planner::Strategy s = flags.resolve_for_gpus(r.gpus, r.options);
  r.base = s;
  // What the Megatron arguments state is pinned as the flags saying it would be.
  const auto mg = flags.given("--megatron-args") ? planner::parse_megatron_args(flags.megatron_args)
                                                 : planner::MegatronArgs{};
  if (flags.given("--stage") || mg.has("--use-distributed-optimizer")) r.stages = {s.stage};
  if (flags.given("--offload-optimizer") || flags.has_ds_config()) r.offload_optimizer = {s.offload_optimizer};
  if (flags.given("--offload-param") || flags.has_ds_config() || !flags.fsdp_config.empty())
    r.offload_param = {s.offload_param};
  if (flags.given("--micro-batch") || mg.has("--micro-batch-size")) r.micro_batches = {s.micro_batch};
  if (flags.given("--checkpointing") || mg.has("--recompute-granularity") || mg.has("--recompute-activations"))
    r.checkpointing = {s.checkpointing};
  // torchtitan, whose runs the fsdp profile predicts, checkpoints per op by default.
  else if (r.options.profile == planner::Profile::fsdp)
    r.checkpointing.push_back(planner::Checkpointing::selective_op);
  if (flags.dpu) r.dpu = {true};
  // A winner to run with Megatron-DeepSpeed (--emit-megatron with --emit-deepspeed): its
  // context parallelism is DeepSpeed-Ulysses, its MoE flags are not written.
  const bool megatron_deepspeed = !emit_megatron.empty() && !emit_deepspeed.empty();
  if (megatron_deepspeed) {
    if (!flags.given("--cp-kind") && r.options.profile != planner::Profile::fsdp)
      r.base.cp_kind = planner::CpKind::ulysses;
    if (!flags.given("--ep") && !mg.has("--expert-model-parallel-size")) r.eps = {1};
  }
  // A winner to run with Megatron-LM: the search keeps to what it runs (its distributed
  // optimizer, stage 1, or plain data parallelism; nothing offloaded), unless pinned otherwise.
  if (!emit_megatron.empty() && !megatron_deepspeed) {
    if (!flags.given("--stage") && !mg.has("--use-distributed-optimizer")) r.stages = {0, 1};
    if (!flags.given("--offload-optimizer") && !flags.has_ds_config()) r.offload_optimizer = {planner::Offload::none};
    if (!flags.given("--offload-param") && !flags.has_ds_config()) r.offload_param = {planner::Offload::none};
    if (!flags.dpu) r.dpu = {false};
  }
  if (flags.given("--tp") || mg.has("--tensor-model-parallel-size")) r.mps = {s.mp};
  if (flags.given("--sp") || mg.has("--sequence-parallel")) r.sps = {s.sp};
  if (flags.given("--pp") || mg.has("--pipeline-model-parallel-size")) r.pps = {s.pp};
  if (flags.given("--vp") || mg.has("--num-layers-per-virtual-pipeline-stage") ||
      mg.has("--num-virtual-stages-per-pipeline-rank"))
    r.vps = {s.vp};
  if (flags.given("--cp") || mg.has("--context-parallel-size")) r.cps = {s.cp};
  r.parallel = parallel;
  r.exhaustive = exhaustive;
  if (!global_batch.empty()) {
    r.global_batch = count_flag(global_batch, "--global-batch");
    if (r.global_batch < 1) throw Error("--global-batch: must be >= 1, got 0", "e.g. --global-batch 1024");
    if (flags.given("--grad-accum"))
      throw Error("--global-batch and --grad-accum: give one of them",
                  "with --global-batch each configuration's grad_accum is global / (micro-batch x dp)");
  } else if (mg.has("--global-batch-size")) {
    r.global_batch = s.micro_batch * s.dp * s.grad_accum;
  }
  if (max_model && parallel)
    throw Error("--max-model with --parallel: the largest model is searched over ZeRO, data, "
                "tensor and expert parallelism",
                "leave out --parallel (or pin --pp/--cp to plan them)");
  if (flags.given("--ep") || mg.has("--expert-model-parallel-size")) r.eps = {s.ep};
  if (flags.given("--dp")) {
    if (planner::world_size(s) != r.gpus)
      throw Error(fmt::format("--dp {} x --tp {} x --pp {} x --cp {} = {} GPUs, but --gpus is {}",
                              s.dp, s.mp, s.pp, s.cp, planner::world_size(s), r.gpus),
                  "fit derives dp from --gpus / (tp x pp x cp); leave out --dp");
  }

  const auto t0 = std::chrono::steady_clock::now();
  planner::FitResult f;
  std::optional<planner::MaxModel> mm;
  if (max_model) {
    // One line per exact evaluation at one depth, on stderr only (stdout carries the result),
    // when a person is watching or --progress asks.
    planner::MaxModelProgress on_probe;
    if (progress || isatty(STDERR_FILENO) == 1)
      on_probe = [](const planner::MaxModelProbe& p) {
        std::cerr << fmt::format("max-model: {} layers ({} params): {}, {:.1f} s ({} of {} configurations)\n",
                                 p.n_layer, format_count(p.params), p.fits ? "fits" : "does not fit",
                                 p.seconds, p.n_configurations, p.n_search)
                  << std::flush;
      };
    mm = planner::max_model(r, on_probe);
    if (mm) {
      r.model = mm->model;
      f = mm->search;
    } else {
      planner::FitRequest q = r;
      q.model.n_layer = 1;
      f = planner::fit(q);
      r = q;
    }
  } else {
    f = planner::fit(r);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const models::ParamInventory inv_final = models::count_params(r.model);

  if (fmt_ == reports::Format::json) {
    nlohmann::json j = planner::to_json(f, r);
    j["search_seconds"] = seconds;
    if (max_model) j["max_model"] = mm ? planner::to_json(*mm, inv_final) : nlohmann::json(nullptr);
    if (r.options.profile == planner::Profile::deepspeed)
      for (std::size_t i = 0; i < f.candidates.size(); ++i)
        j["candidates"][i]["deepspeed_estimator"] = ds_estimator(f.candidates[i].strategy, inv_final, f, r.hw);
    out = j.dump(2) + "\n";
  } else {
    if (max_model) {
      out += mm ? fmt::format("largest model that fits: {} layers x {} wide, {} parameters ({})\n",
                              mm->model.n_layer, mm->model.n_embd, format_count(mm->params), mm->params)
                : std::string("not even one layer of this family fits\n");
    }
    out += render_text(f, r, fmt_, seconds);
    if (r.options.profile == planner::Profile::deepspeed && !f.candidates.empty()) {
      const nlohmann::json e = ds_estimator(f.candidates.front().strategy, inv_final, f, r.hw);
      if (!e.is_null())
        out += fmt::format("DeepSpeed's {} for #1: {} per GPU, {} per node of CPU memory\n",
                           e["function"].get<std::string>(), format_bytes(e["gpu_bytes"].get<uint64_t>()),
                           format_bytes(e["cpu_bytes_per_node"].get<uint64_t>()));
    }
  }
  if (!f.candidates.empty()) {
    const planner::Strategy& win = f.candidates.front().strategy;
    // Settled before anything is written: a winner Megatron-LM cannot run writes nothing.
    const std::string megatron =
        emit_megatron.empty()    ? ""
        : emit_deepspeed.empty() ? planner::megatron_command_line(win)
                                 : planner::megatron_deepspeed_command_line(win, r.model.n_layer, emit_deepspeed);
    if (!emit_megatron.empty()) emit(emit_megatron, megatron + "\n");
    if (!emit_deepspeed.empty()) {
      emit(emit_deepspeed, planner::deepspeed_config(win).dump(2) + "\n");
      for (const std::string& n : planner::deepspeed_notes(win)) std::cerr << "note: " << n << "\n";
    }
    if (!trace.empty()) {
      // Every pipeline stage's graph, under the plan's profile (as the search simulated it).
      const auto tl = planner::simulate_model(r.model, win, r.hw, {f.gpus, f.nodes}, r.options);
      emit(trace, planner::trace_json(tl).dump() + "\n");
    }
  }
  return f.candidates.empty() ? kExitCheckFailed : kExitOk;
}

}  // namespace zp::cli
