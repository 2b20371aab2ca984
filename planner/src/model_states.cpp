// model_states.cpp: ZeRO model-state bytes per device, each optimizer's state bytes, and the
// paper's table.
#include "zp/planner/model_states.hpp"

#include <cmath>

#include <fmt/format.h>

#include "zp/checked.hpp"

namespace zp::planner {

BytesPerParam bytes_per_param(Precision p, OptimizerKind o, Precision master, Precision moments) {
  BytesPerParam b;
  const bool mixed = p != Precision::fp32;
  b.params = mixed ? 2 : 4;
  b.grads = b.params;
  // In fp32 the working params are the master weights.
  b.master = mixed ? (master == Precision::bf16 ? 2 : 4) : 0;
  const uint64_t state = moments == Precision::bf16 ? 2 : 4;
  switch (o) {
    case OptimizerKind::adam:
    case OptimizerKind::adamw: b.optimizer = 2 * state; break;  // momentum and variance
    case OptimizerKind::sgd:
    case OptimizerKind::lion: b.optimizer = state; break;       // momentum
    case OptimizerKind::adafactor: b.optimizer = state; break;  // unfactored second moment
    case OptimizerKind::sgd_plain: b.optimizer = 0; break;
    case OptimizerKind::adam8bit: b.optimizer = 2; break;       // two uint8 states
  }
  return b;
}

uint64_t optimizer_state_bytes(OptimizerKind o, std::span<const int64_t> shape,
                               uint64_t moment_bytes) {
  uint64_t n = 1;
  for (int64_t d : shape) n = checked_mul(n, static_cast<uint64_t>(d), "optimizer state elements");
  if (n == 0) return 0;
  const uint64_t m = moment_bytes;
  switch (o) {
    case OptimizerKind::adam:
    case OptimizerKind::adamw: return checked_mul(2 * m, n, "bytes of optimizer states");
    case OptimizerKind::sgd:
    case OptimizerKind::lion: return checked_mul(m, n, "bytes of optimizer states");
    case OptimizerKind::sgd_plain: return 0;
    case OptimizerKind::adafactor: {
      constexpr uint64_t kRms = 4;  // state["RMS"], a 0-d fp32 tensor
      if (shape.size() < 2) return checked_add(checked_mul(m, n, "exp_avg_sq"), kRms, "rms");
      // exp_avg_sq_row: shape[:-1], n/C elements; exp_avg_sq_col: shape[:-2] + shape[-1:], n/R.
      const uint64_t c = static_cast<uint64_t>(shape[shape.size() - 1]);
      const uint64_t r = static_cast<uint64_t>(shape[shape.size() - 2]);
      return checked_add(checked_mul(m, n / c + n / r, "exp_avg_sq_row and _col"), kRms, "rms");
    }
    case OptimizerKind::adam8bit: {
      // 2 + 2*4/256 bytes per element above min_8bit_size: 2*n + 8*ceil(n/256).
      if (n < k8bitMinSize) return checked_mul(2 * 4, n, "fp32 states of a small tensor");
      const uint64_t blocks = (n + k8bitBlock - 1) / k8bitBlock;
      return checked_add(checked_mul(2, n, "uint8 states"), checked_mul(2 * 4, blocks, "absmax"),
                         "bytes of 8-bit states");
    }
  }
  return 0;
}

Breakdown stage_bytes(uint64_t n, uint64_t part, int stage, const BytesPerParam& b) {
  Breakdown out;
  // Parameters partitioned from stage 3 (P_p), gradients from stage 2 (P_g), optimizer
  // states (master + moments) from stage 1 (P_os); a rank holds `part` elements of each.
  auto held = [&](bool partitioned) { return partitioned ? part : n; };
  out[Category::params] = checked_mul(b.params, held(stage >= 3), "bytes of params");
  out[Category::grads] = checked_mul(b.grads, held(stage >= 2), "bytes of grads");
  out[Category::master] = checked_mul(b.master, held(stage >= 1), "bytes of master");
  out[Category::optimizer] =
      checked_mul(b.optimizer, held(stage >= 1), "bytes of optimizer states");
  return out;
}

PerDevice model_state_bytes(uint64_t n, const Strategy& s) {
  return model_state_bytes(n, partition_elems(n, static_cast<uint64_t>(s.dp)), s);
}

PerDevice model_state_bytes(uint64_t n, uint64_t part, const Strategy& s, StateLayout layout,
                            std::optional<uint64_t> optimizer_bytes, uint64_t gpu_step_elems) {
  BytesPerParam b =
      bytes_per_param(s.precision, s.optimizer, s.master_precision, s.optimizer_precision);
  b.grads = grad_bytes(s);  // fp32 with Megatron's main_grad (Strategy::grad_precision)
  // Without per-tensor bytes: one flat tensor of the `held` elements the optimizer updates.
  auto flat = [&](uint64_t held, uint64_t moment_bytes) {
    const int64_t shape[] = {static_cast<int64_t>(held)};
    return optimizer_bytes.value_or(optimizer_state_bytes(s.optimizer, shape, moment_bytes));
  };
  PerDevice d;
  Breakdown& gpu = d[Tier::gpu];
  if (layout == StateLayout::fsdp) {
    // model_states.hpp: the sharded parameters in the model's dtype are the weights; their
    // gradients and the moments (zeros_like the parameters) share that dtype.
    // FSDP's CPU offload (CPUOffload(offload_params=True), CPUOffloadPolicy) keeps all three
    // on the host, pinned: the sharded parameters, their gradients (FSDP1's _cpu_grad, FSDP2's
    // gradients copied out after each reduce-scatter) and the optimizer's states, which the
    // step creates zeros_like the host parameters.
    const bool pure = weights_in_compute_dtype(s);
    const uint64_t w = pure ? b.params : 4;
    const uint64_t held = s.stage >= 3 ? part : n;
    Breakdown& at = s.offload_param == Offload::cpu ? d[Tier::cpu] : gpu;
    at[pure ? Category::params : Category::master] = checked_mul(w, held, "bytes of params");
    at[Category::grads] = checked_mul(w, held, "bytes of grads");
    at[Category::optimizer] = flat(held, w);
    return d;
  }
  gpu = stage_bytes(n, part, s.stage, b);
  const uint64_t moment = s.optimizer_precision == Precision::bf16 ? 2 : 4;
  gpu[Category::optimizer] = flat(s.stage >= 1 ? part : n, moment);

  if (s.offload_param != Offload::none) {
    const Tier t = s.offload_param == Offload::cpu ? Tier::cpu : Tier::nvme;
    d[t][Category::params] = gpu[Category::params];
    gpu[Category::params] = 0;
  }
  if (s.offload_optimizer != Offload::none) {
    // ZeRO-Offload: fp32 master (4 bytes, even in fp32 training: the CPU optimizer keeps its
    // own copy) and moments of the owned partition on the offload tier; the fp32 gradient
    // partition on the cpu; the 16-bit gradients stay whole on the gpu only under stage 1.
    const Tier t = s.offload_optimizer == Offload::cpu ? Tier::cpu : Tier::nvme;
    const uint64_t m = s.master_precision == Precision::bf16 ? 2 : 4;
    // Partial offload (stage3.py _create_fp32_partitions, initialize_optimizer_states): the
    // GPU's sub-groups keep the master converted on the GPU, their fp32 gradient buffer moved
    // there, and the GPU AdamW's moments (zeros_like the master).
    const uint64_t on_gpu = std::min(gpu_step_elems, part), host = part - on_gpu;
    d[t][Category::master] = checked_mul(m, host, "bytes of master");
    d[t][Category::optimizer] = on_gpu > 0 ? flat(host, moment) : gpu[Category::optimizer];
    d[Tier::cpu][Category::grads] = checked_mul(m, host, "bytes of fp32 grads");
    gpu[Category::master] = checked_mul(m, on_gpu, "bytes of master");
    gpu[Category::optimizer] = on_gpu > 0 ? flat(on_gpu, moment) : 0;
    if (s.stage >= 2) gpu[Category::grads] = 0;
    gpu[Category::grads] = checked_add(gpu[Category::grads], checked_mul(m, on_gpu, "fp32 grads"),
                                       "bytes of grads");
  }
  return d;
}

std::vector<TableRow> zero_table(const std::vector<uint64_t>& params,
                                 const std::vector<uint64_t>& dps, uint64_t k) {
  // The paper's setting: fp16 params and grads (2 + 2 bytes) and K bytes of optimizer state.
  const BytesPerParam b{.params = 2, .grads = 2, .master = 0, .optimizer = k};
  std::vector<TableRow> rows;
  rows.reserve(params.size() * dps.size() * 4);
  for (uint64_t n : params)
    for (uint64_t dp : dps)
      for (int stage = 0; stage < 4; ++stage)
        rows.push_back({n, dp, stage, stage_bytes(n, partition_elems(n, dp), stage, b).total()});
  return rows;
}

std::string paper_gb(uint64_t bytes) {
  const double gb = static_cast<double>(bytes) / 1e9;
  if (gb >= 100.0) return fmt::format("{}", static_cast<uint64_t>(std::floor(gb)));
  // 3 significant figures, at most 2 decimals, half-up (the small epsilon keeps 41.25 from
  // falling to 41.2 through binary representation).
  int decimals = gb >= 10.0 ? 1 : 2;
  const double scale = std::pow(10.0, decimals);
  const double rounded = std::floor(gb * scale + 0.5 + 1e-9) / scale;
  std::string s = fmt::format("{:.{}f}", rounded, decimals);
  while (s.find('.') != std::string::npos && (s.back() == '0' || s.back() == '.')) {
    const bool dot = s.back() == '.';
    s.pop_back();
    if (dot) break;
  }
  return s;
}

}  // namespace zp::planner
