// Strategy validation and DeepSpeed config reading.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "error_of.hpp"
#include "zp/error.hpp"
#include "zp/json_fields.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/strategy.hpp"

using namespace zp::planner;

namespace {
Strategy from_ds(const char* text) {
  return apply_deepspeed_config(Strategy{}, zp::parse_json_text(text, "ds.json"), "ds.json");
}
using zp::test::error_of;
}  // namespace

TEST_CASE("DeepSpeed config fills the strategy") {
  const Strategy s = from_ds(R"({
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
    "train_batch_size": "auto", "gradient_clipping": 1.0,
    "fp16": {"enabled": true, "loss_scale": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true},
                          "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
                          "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": "auto",
                          "overlap_comm": true}})");
  CHECK(s.micro_batch == 4);
  CHECK(s.grad_accum == 8);
  CHECK(s.precision == Precision::fp16);
  CHECK(s.optimizer == OptimizerKind::adamw);
  CHECK(s.stage == 3);
  CHECK(s.offload_optimizer == Offload::cpu);
  CHECK(s.offload_param == Offload::nvme);
  CHECK(s.buffers.reduce_bucket_size == 50'000'000);
  // "auto": the Trainer sets it from the hidden size; 0 until the model is known.
  CHECK(s.buffers.prefetch_bucket_size == 0);
  CHECK(from_ds("{}").precision == Precision::fp32);  // DeepSpeed's default
  CHECK(from_ds(R"({"bf16": {"enabled": true}})").precision == Precision::bf16);
}

TEST_CASE("DeepSpeed config: \"auto\" values are said, and the model settles the buckets") {
  std::vector<std::string> assumed;
  const Strategy s = apply_deepspeed_config(
      Strategy{},
      zp::parse_json_text(R"({"train_micro_batch_size_per_gpu": "auto",
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto"}})",
                          "ds.json"),
      "ds.json", &assumed);
  // Both formats "auto": the plan keeps its bf16 (not DeepSpeed's fp32 of a config without
  // either section) and says which flag settles it.
  CHECK(s.precision == Precision::bf16);
  REQUIRE(assumed.size() == 2);
  CHECK(assumed[0].find("train_micro_batch_size_per_gpu \"auto\"") == 0);
  CHECK(assumed[1].find("fp16.enabled and bf16.enabled \"auto\"") == 0);
  CHECK(assumed[1].find("--precision") != std::string::npos);
  // One format enabled, the other "auto": the enabled one.
  CHECK(from_ds(R"({"fp16": {"enabled": true}, "bf16": {"enabled": "auto"}})").precision ==
        Precision::fp16);
  // The Trainer's sizes for gpt2-tiny (hidden 64): reduce 64^2 = 4096, prefetch 0.9 x 4096
  // = 3686.4, which the Trainer truncates to 3686.
  const Strategy r = resolve_for_model(s, zp::models::load_model("gpt2-tiny"), &assumed);
  CHECK(r.buffers.reduce_bucket_size == 4096);
  CHECK(r.buffers.prefetch_bucket_size == 3686);
  CHECK(assumed.back().find("stage3_prefetch_bucket_size \"auto\"") != std::string::npos);
  // Left out, --seq is the context up to 4096 tokens: gpt2-tiny's 64, llama-3.1-8b's 4096 of
  // 131072 (and the headline says which).
  CHECK(r.seq == 64);
  const Strategy l = resolve_for_model(Strategy{}, zp::models::load_model("llama-3.1-8b"), &assumed);
  CHECK(l.seq == 4096);
  CHECK(assumed.back().find("--seq 4096 (the model's context is 131072") == 0);
}

TEST_CASE("DeepSpeed config: the offload sections' buffer settings") {
  // offload_optimizer.buffer_count becomes the optimizer swap pipeline's buffer sets;
  // offload_param.buffer_count and buffer_size the parameter swap buffers (max_in_cpu is
  // type-checked, not modelled).
  const Strategy s = from_ds(R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 6},
      "offload_param": {"device": "nvme", "nvme_path": "/x", "buffer_count": 7,
                        "buffer_size": 5e5, "max_in_cpu": 1e9}}})");
  CHECK(s.buffers.optimizer_swap_buffer_count == 6);
  CHECK(s.buffers.param_swap_buffer_count == 7);
  CHECK(s.buffers.param_swap_buffer_size == 500'000);
  // Absent: zeroplan's 3 buffer sets; DeepSpeed's parameter defaults, 5 of 1e8 elements.
  const Strategy d = from_ds(R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}})");
  CHECK(d.buffers.optimizer_swap_buffer_count == 3);
  CHECK(d.buffers.param_swap_buffer_count == 5);
  CHECK(d.buffers.param_swap_buffer_size == 100'000'000);
  // The plan file keeps them, and the offloaded parameter tile's size.
  CHECK(strategy_from_json(to_json(s), "plan.json") == s);
  Strategy tiled = s;
  tiled.buffers.offload_tile_size = 1024;
  CHECK(to_json(tiled)["buffers"]["offload_tile_size"] == 1024);
  CHECK(strategy_from_json(to_json(tiled), "plan.json") == tiled);
  for (const uint64_t bad : {uint64_t{0}, uint64_t{1000}}) {
    tiled.buffers.offload_tile_size = bad;
    CHECK(error_of([&] { validate(tiled); })
              .find("offload_tile_size " + std::to_string(bad) + ": not a positive multiple of 256 elements") !=
          std::string::npos);
  }
  CHECK(error_of([] {
          from_ds(
              R"({"zero_optimization": {"offload_param": {"device": "nvme", "buffer_count": 0}}})");
        })
            .find("'zero_optimization.offload_param.buffer_count' must be a count from 1 to 64, "
                  "got 0") != std::string::npos);
  CHECK(
      error_of([] {
        from_ds(
            R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "buffer_count": 1}}})");
      }).find("'zero_optimization.offload_optimizer.buffer_count' must be a count from 2 to 64") !=
      std::string::npos);
  CHECK(error_of([] {
          from_ds(
              R"({"zero_optimization": {"offload_param": {"device": "nvme", "buffer_size": 0}}})");
        }).find("'zero_optimization.offload_param.buffer_size' must be at least 1") !=
        std::string::npos);
  CHECK(error_of([] {
          from_ds(
              R"({"zero_optimization": {"offload_param": {"device": "nvme", "max_in_cpu": -1}}})");
        }).find("offload_param.max_in_cpu") != std::string::npos);
  Strategy v;
  v.buffers.param_swap_buffer_count = 65;
  CHECK(error_of([&] { validate(v); }).find("param_swap_buffer_count 65: must be 1 to 64") !=
        std::string::npos);
  v = Strategy{};
  v.buffers.param_swap_prefetch_depth = 100;
  CHECK(error_of([&] { validate(v); }).find("param_swap_prefetch_depth 100") != std::string::npos);
}

TEST_CASE("DeepSpeed config: stage 3's per-parameter settings, hpZ and Pa+cpu are read") {
  const Strategy s = from_ds(R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e8,
      "stage3_param_persistence_threshold": 4096, "zero_hpz_partition_size": 1},
      "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": true}})");
  CHECK(s.buffers.sub_group_size == 100'000'000);
  CHECK(s.buffers.param_persistence_threshold == 4096);
  CHECK(s.hpz_partition_size == 1);
  CHECK(s.partition_activations);
  CHECK(s.cpu_checkpointing);
  // "auto" persistence: the Trainer's 10 x hidden size, once the model is known (gpt2-tiny: 640).
  Strategy a = from_ds(R"({"zero_optimization": {"stage": 3,
      "stage3_param_persistence_threshold": "auto"}})");
  CHECK(a.buffers.param_persistence_threshold == kPersistenceAuto);
  a = resolve_for_model(a, zp::models::load_model("gpt2-tiny"));
  CHECK(a.buffers.param_persistence_threshold == 640);
  // The plan file keeps them (the model's code asks for the recomputation DeepSpeed's
  // section configures).
  Strategy full = s;
  full.checkpointing = Checkpointing::full;
  CHECK(strategy_from_json(to_json(full), "plan.json") == full);
  // hpZ must divide the data-parallel degree.
  Strategy h = s;
  h.dp = 8;
  h.hpz_partition_size = 3;
  CHECK(error_of([&] { validate(h); }).find("--hpz-partition-size 3: must divide --dp 8") == 0);
}

TEST_CASE("--deepspeed-version: releases as numbers, current as 0, the plan file keeps it") {
  CHECK(deepspeed_version_from_string("0.4.0") == 400u);
  CHECK(deepspeed_version_from_string("0.3.17") == 317u);
  CHECK(deepspeed_version_from_string("0.16") == 1600u);
  CHECK(deepspeed_version_from_string("current") == 0u);
  for (const char* bad : {"1.0.0", "0", "0.x", "0.4.", "0.0.0", "", "0.100.1"}) {
    CAPTURE(bad);
    CHECK_FALSE(deepspeed_version_from_string(bad).has_value());
  }
  CHECK(deepspeed_version_string(317) == "0.3.17");
  Strategy s;
  s.deepspeed_version = 1603;
  CHECK(strategy_from_json(to_json(s), "plan.json").deepspeed_version == 1603u);
}

TEST_CASE("DeepSpeed config errors name the field") {
  CHECK(error_of([] { from_ds(R"({"zero_optimization": {"stage": 4}})"); })
            .find("'zero_optimization.stage' must be 0, 1, 2 or 3, got 4") != std::string::npos);
  CHECK(error_of([] { from_ds(R"({"zero_optimization": {"stage": "2"}})"); })
            .find("'zero_optimization.stage' must be a non-negative integer") != std::string::npos);
  CHECK(error_of([] { from_ds(R"({"zero_optimisation": {}})"); })
            .find("unknown field 'zero_optimisation'") != std::string::npos);
  CHECK(error_of([] { from_ds(R"({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})"); })
            .find("offload_optimizer.device") != std::string::npos);
  CHECK(error_of([] { from_ds(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})"); })
            .find("both true") != std::string::npos);
  CHECK(error_of([] { from_ds(R"({"train_micro_batch_size_per_gpu": 0})"); })
            .find("'train_micro_batch_size_per_gpu' must be a positive integer") != std::string::npos);
  // qwZ is modelled (test_deepspeed_options.cpp); qgZ is not.
  CHECK(error_of([] { from_ds(R"({"zero_optimization": {"zero_quantized_gradients": true}})"); })
            .find("not modelled") != std::string::npos);
  CHECK(error_of([] { from_ds(R"({"optimizer": {"type": "Lamb"}})"); })
            .find("optimizer.type 'Lamb'") != std::string::npos);
  CHECK(error_of([] { from_ds(R"({"zero_optimization": {"overlap_comm": "yes"}})"); })
            .find("'zero_optimization.overlap_comm' must be true or false") != std::string::npos);
  CHECK(error_of([] { from_ds(R"({"zero_optimization": {"overlap_comm": 1}})"); })
            .find("'zero_optimization.overlap_comm' must be true or false") != std::string::npos);
}

TEST_CASE("overlap_comm: DeepSpeed's default per stage unless the config or the plan says") {
  // Unset: false for stages 0-2, true for stage 3 (DeepSpeed's defaults).
  for (int stage = 0; stage <= 3; ++stage) {
    Strategy s;
    s.stage = stage;
    CHECK(!s.overlap_comm.has_value());
    CHECK(overlaps_comm(s) == (stage == 3));
  }
  const Strategy on = from_ds(R"({"zero_optimization": {"stage": 2, "overlap_comm": true}})");
  CHECK(on.overlap_comm == std::optional<bool>(true));
  CHECK(overlaps_comm(on));
  const Strategy off = from_ds(R"({"zero_optimization": {"stage": 3, "overlap_comm": false}})");
  CHECK(!overlaps_comm(off));
  CHECK(!from_ds(R"({"zero_optimization": {"stage": 3, "overlap_comm": "auto"}})")
             .overlap_comm.has_value());
  // The plan file keeps set and unset apart.
  CHECK(strategy_from_json(to_json(on), "plan.json") == on);
  CHECK(strategy_from_json(to_json(off), "plan.json") == off);
  CHECK(to_json(Strategy{})["overlap_comm"].is_null());
  CHECK(strategy_from_json(to_json(Strategy{}), "plan.json") == Strategy{});
}

TEST_CASE("validation refuses contradictions") {
  Strategy s;
  s.stage = 2;
  s.offload_param = Offload::cpu;
  CHECK(error_of([&] { validate(s); }).find("needs --stage 3") != std::string::npos);
  s = Strategy{};
  s.offload_optimizer = Offload::cpu;
  CHECK(error_of([&] { validate(s); }).find("needs --stage 1, 2 or 3") != std::string::npos);
  s = Strategy{};
  s.dpu = true;
  CHECK(error_of([&] { validate(s); }).find("--dpu") != std::string::npos);
  s = Strategy{};
  s.dp = 0;
  CHECK(error_of([&] { validate(s); }) == "--dp: must be >= 1, got 0");
  s = Strategy{};
  s.stage = 4;
  CHECK(error_of([&] { validate(s); }).find("--stage") != std::string::npos);
}

TEST_CASE("strategy JSON round-trips") {
  Strategy s;
  s.stage = 3;
  s.dp = 16;
  s.precision = Precision::fp16;
  s.checkpointing = Checkpointing::selective;
  s.offload_optimizer = Offload::nvme;
  s.dpu = true;
  s.buffers.max_live_parameters = 123;
  CHECK(strategy_from_json(to_json(s), "plan.json") == s);
}

TEST_CASE("estimate resolves seq and checks it against the model") {
  const auto m = zp::models::load_model("gpt2");
  Strategy s;
  CHECK(estimate(m, s, nullptr).strategy.seq == 1024);
  s.seq = 2048;
  CHECK(error_of([&] { estimate(m, s, nullptr); }).find("--seq: 2048 is longer") != std::string::npos);
}

TEST_CASE("fit verdict names the tier that does not fit") {
  const auto m = zp::models::load_model("gpt2-xl");
  const auto hw = load_hardware("v100-32g");
  // Stage 0: 16 bytes x 1.56 B = 24.9 GB of model states; with full recomputation the
  // activations at T=1024 stay under 1 GB, so it fits 32 GB.
  Strategy s;
  s.checkpointing = Checkpointing::full;
  auto e = estimate(m, s, &hw);
  REQUIRE(e.fits.has_value());
  CHECK(*e.fits);
  const auto big = zp::models::load_model("megatron-8.3b");
  e = estimate(big, s, &hw);
  CHECK_FALSE(*e.fits);
  REQUIRE(e.shortfalls.size() == 1);
  CHECK(e.shortfalls[0].rfind("gpu: needs", 0) == 0);
}

TEST_CASE("DeepSpeed config: fields zeroplan does not model are still type-checked") {
  // What DeepSpeed's own readers accept passes: the Trainer's "auto", the monitors, nulls.
  CHECK_NOTHROW(from_ds(R"({"gradient_clipping": "auto", "wall_clock_breakdown": false,
    "steps_per_print": 2000, "seed": 42, "prescale_gradients": false,
    "communication_data_type": null, "gradient_predivide_factor": 1.0,
    "tensorboard": {"enabled": true, "output_path": "logs/", "job_name": "run"},
    "wandb": {"enabled": false, "team": null, "project": "p"},
    "comet": {"enabled": false, "online": null, "samples_log_interval": 50},
    "comms_logger": {"enabled": true, "prof_ops": ["all_reduce"], "verbose": false},
    "flops_profiler": {"enabled": true, "profile_step": 1, "module_depth": -1,
                       "top_modules": 1, "detailed": true, "output_file": null}})"));
  CHECK_NOTHROW(from_ds(R"({"gradient_clipping": 1.0, "communication_data_type": "bf16"})"));
  // What DeepSpeed would refuse, or trip over at its first step, is refused naming the field.
  auto refused = [](const char* text) { return error_of([&] { from_ds(text); }); };
  CHECK(refused(R"({"gradient_clipping": "x"})").find("field 'gradient_clipping' must be a number >= 0, got \"x\"") != std::string::npos);
  CHECK(refused(R"({"gradient_clipping": -1})").find("field 'gradient_clipping'") != std::string::npos);
  CHECK(refused(R"({"wall_clock_breakdown": [1, 2]})").find("field 'wall_clock_breakdown' must be true or false, got [1,2]") != std::string::npos);
  CHECK(refused(R"({"steps_per_print": "10"})").find("field 'steps_per_print'") != std::string::npos);
  CHECK(refused(R"({"seed": 1.5})").find("field 'seed'") != std::string::npos);
  CHECK(refused(R"({"communication_data_type": "int8"})").find("field 'communication_data_type' must be \"fp16\", \"bf16\", \"fp32\" or null") != std::string::npos);
  CHECK(refused(R"({"tensorboard": {"enabled": "yes"}})").find("field 'tensorboard.enabled' must be true or false") != std::string::npos);
  CHECK(refused(R"({"tensorboard": {"outpath": "x"}})").find("unknown field 'tensorboard.outpath'") != std::string::npos);
  CHECK(refused(R"({"wandb": {"project": 3}})").find("field 'wandb.project' must be a string") != std::string::npos);
  CHECK(refused(R"({"comms_logger": {"prof_ops": "all_reduce"}})").find("field 'comms_logger.prof_ops' must be a list") != std::string::npos);
  CHECK(refused(R"({"flops_profiler": {"profile_step": 1.5}})").find("field 'flops_profiler.profile_step' must be an integer") != std::string::npos);
  CHECK(refused(R"({"tensorboard": [1]})").find("tensorboard") != std::string::npos);
}
