// zp/planner/model_states.hpp: bytes of the model states (16-bit params, grads, fp32 master,
// optimizer moments) per device under ZeRO stages 0-3 and ZeRO-Offload/Infinity placement,
// and the ZeRO paper's table. Activations, buffers and fragmentation are not here (graph
// planner); these are the "model states" of the ZeRO paper sec. 3.1.
//
// Example usage:
//   Strategy s; s.stage = 2; s.dp = 64;
//   PerDevice d = model_state_bytes(7'500'000'000, s);   // paper: 16.6 GB on the gpu tier
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "zp/planner/memory.hpp"
#include "zp/planner/strategy.hpp"

namespace zp::planner {

// Bytes each parameter costs in each state, before partitioning.
struct BytesPerParam {
  uint64_t params = 0;     // working copy used by forward/backward: 2 (fp16/bf16) or 4 (fp32)
  uint64_t grads = 0;      // same dtype as the working params
  uint64_t master = 0;     // fp32 master copy: 4 with mixed precision, else 0
  // Adam: 8 (momentum + variance, fp32); SGD, Lion: 4 (momentum); plain SGD: 0; Adafactor:
  // 4 (an unfactored second moment, as on a flat partition); 8-bit Adam: 2 (two uint8). The
  // per-tensor terms (8-bit's absmax and small-tensor fallback, Adafactor's factoring) are
  // optimizer_state_bytes's; model_state_bytes applies them.
  uint64_t optimizer = 0;
  uint64_t k() const { return master + optimizer; }  // the ZeRO paper's K
};

// Mixed-precision Adam: 2 + 2 + 12 (ZeRO paper sec. 3.1: "K = 12"); fp32 Adam: 4 + 4 + 8.
// A bf16 master (DeepSpeed's bf16_master_weights_and_grads) takes 2 bytes instead of 4, and
// bf16 moments (bf16_optimizer_states) 2 bytes each (Adam's, SGD's and Lion's momentum,
// Adafactor's second moment; 8-bit Adam's states are uint8 whatever it is asked).
BytesPerParam bytes_per_param(Precision p, OptimizerKind o,
                              Precision master = Precision::fp32,
                              Precision moments = Precision::fp32);

// bitsandbytes' 8-bit optimizers (bitsandbytes/optim/optimizer.py, Optimizer2State and
// Optimizer1State.init_state): a tensor of fewer than min_8bit_size = 4096 elements keeps its
// states in fp32; a larger one keeps uint8 states and one fp32 absmax per block of 256
// elements per state (blocksize = 256 since 0.44.0, commit aa57bd89; 2048 up to 0.43.x).
inline constexpr uint64_t k8bitMinSize = 4096;
inline constexpr uint64_t k8bitBlock = 256;

// Bytes of optimizer state for one tensor the optimizer is handed, of shape `shape` (a flat
// partition is one dimension, {elements}), with moments of `moment_bytes` each (4 fp32, 2
// bf16). n = the product of the shape; for 2+ dimensions R = shape[-2], C = shape[-1].
//   adam, adamw  2*n*m   exp_avg, exp_avg_sq zeros_like the param (torch/optim/adam.py)
//   sgd          n*m     momentum_buffer (torch/optim/sgd.py, momentum != 0)
//   sgd-plain    0       torch.optim.SGD's default momentum=0 keeps no state
//   lion         n*m     exp_avg zeros_like the param (lucidrains/lion-pytorch; DeepSpeed's
//                        FusedLion, deepspeed/ops/lion/fused_lion.py; bitsandbytes' Lion)
//   adafactor    m*(n/C + n/R) + 4 for 2+ dims, m*n + 4 for one: transformers'
//                Adafactor (src/transformers/optimization.py) with its default beta1=None
//                keeps no exp_avg; a factored tensor (len(shape) >= 2) keeps exp_avg_sq_row
//                (shape[:-1]) and exp_avg_sq_col (shape[:-2] + shape[-1:]), another
//                exp_avg_sq (zeros_like); fp32, as it upcasts bf16/fp16 gradients first; the
//                4 is state["RMS"], a 0-d fp32 tensor on the device. torch.optim.Adafactor
//                keeps the same row/col/variance in the gradient's dtype (bf16 moments here)
//                and no RMS.
//   adam8bit     n >= 4096: 2*n + 2*4*ceil(n/256)   (state1, state2 uint8; absmax1, absmax2)
//                n <  4096: 2*4*n                   (both states fp32, whatever the param)
//                bitsandbytes' Adam8bit/AdamW8bit, moment_bytes ignored. Not counted: the
//                two 256-entry fp32 quantization maps shared by all tensors (2 KiB).
uint64_t optimizer_state_bytes(OptimizerKind o, std::span<const int64_t> shape,
                               uint64_t moment_bytes);

// How the model states are laid out: ZeRO's (DeepSpeed and zeroplan: a 16-bit working copy
// of the parameters beside the fp32 master partition), or PyTorch FSDP's (the sharded
// parameters kept in the model's dtype are what the optimizer updates, and the 16-bit
// compute copy exists only all-gathered, per unit, during forward and backward):
//   FSDP, mixed precision (MixedPrecisionPolicy(param_dtype=bf16), fp32 model): sharded fp32
//     parameters (category master) 4, sharded fp32 gradients 4, AdamW's moments zeros_like the
//     sharded parameters 8: 16 bytes per owned element, no 16-bit params at rest
//     (torch/distributed/fsdp/_fully_shard/_fsdp_api.py, MixedPrecisionPolicy docstring: "the
//     optimizer step uses the sharded parameter in the original dtype");
//   FSDP, pure bf16 (--master-weights bf16: a bf16 model, no policy, torchtune's default) or
//     fp32 training: the sharded parameters are the compute dtype (category params), with
//     gradients and moments in the same dtype: 2 + 2 + 4 (bf16) or 4 + 4 + 8 (fp32);
//   FSDP with --offload-param cpu (CPUOffload(offload_params=True), CPUOffloadPolicy): the
//     same bytes, all on the cpu tier (pinned host memory), none on the gpu.
enum class StateLayout { zero, fsdp };

// Under PyTorch's own layout (StateLayout::fsdp: the fsdp and pytorch profiles), whether the
// weights are kept in the compute dtype (fp32 training, or a 16-bit model: --master-weights
// bf16) rather than in fp32 under a 16-bit compute policy. Their gradients, moments and
// foreach temporaries take the same dtype.
inline bool weights_in_compute_dtype(const Strategy& s) {
  return s.precision == Precision::fp32 || s.master_precision == Precision::bf16;
}

// Per-device bytes of each state, all on one device, for `n` parameters of which a rank owns
// `part` elements of each partitioned state.
Breakdown stage_bytes(uint64_t n, uint64_t part, int stage, const BytesPerParam& b);

// Per-device bytes of each model state for `n_params` parameters, stage and dp of `s`:
//   stage 0:  (2 + 2 + K) * Psi
//   stage 1:  2*Psi + 2*Psi + K*Psi/Nd           (P_os)
//   stage 2:  2*Psi + (2 + K)*Psi/Nd             (P_os+g)
//   stage 3:  (2 + 2 + K)*Psi/Nd                 (P_os+g+p)          ZeRO paper, fig. 1
// with Psi/Nd taken as ceil(Psi/Nd) whole elements (each rank's padded partition).
// Offload moves categories off the gpu tier as DeepSpeed does:
//   offload_optimizer=cpu|nvme: master and moments go to that tier (4 + 8 bytes per owned
//     element even when training in fp32); each rank's gradient partition lives on the cpu
//     in fp32 (4 bytes per owned element), and with stage >= 2 no gradient stays on the gpu
//     beyond the reduce buckets (ZeRO-Offload paper sec. 4.1; seed 002).
//   offload_param=cpu|nvme (stage 3): the 16-bit parameter partition goes to that tier
//     (ZeRO-Infinity paper sec. 5; seed 003).
// The optimizer's states are optimizer_state_bytes of what it is handed. Without
// `optimizer_bytes`, that is one flat tensor of the elements the rank updates (its partition
// from stage 1, all n_params at stage 0): exact for stages 1-3, where DeepSpeed hands the
// optimizer flat 1-D fp32 partitions (stage_1_and_2.py: param_group['params'] =
// [single_partition_of_fp32_groups[i]]; stage3.py: fp32_partitioned_groups_flat per
// sub-group; bf16_optimizer.py likewise), so Adafactor is not factored there and 8-bit blocks
// run over the partition. Where the optimizer is handed the model's own tensors (stage 0,
// FSDP2's per-parameter shards), the caller gives their sum (schedule.hpp
// per_tensor_optimizer_bytes); for Adam and SGD the two agree.
PerDevice model_state_bytes(uint64_t n_params, const Strategy& s);
// The same with the partition size given (zeroplan's stage 3 partitions each gather group
// separately, and a Mixture-of-Experts model partitions its expert parameters over dp/ep
// ranks: see schedule.hpp's partition_elems), and the optimizer's bytes when known per tensor.
// With the optimizer offloaded, `gpu_step_elems` of the partition's elements are stepped on
// the GPU instead (DeepSpeed's offload_optimizer.ratio, Strategy::offload_optimizer_ratio):
// their master, moments and fp32 gradient stay on the gpu tier, the rest go to the host.
PerDevice model_state_bytes(uint64_t n_params, uint64_t partition_elems, const Strategy& s,
                            StateLayout layout = StateLayout::zero,
                            std::optional<uint64_t> optimizer_bytes = std::nullopt,
                            uint64_t gpu_step_elems = 0);

// The ZeRO paper's table (sec. 5, table 1 and seed 004), extended with stage 0.
struct TableRow {
  uint64_t params = 0;
  uint64_t dp = 0;
  int stage = 0;
  uint64_t bytes_per_device = 0;
};
// Rows for every (params, dp, stage 0..3) with K bytes of optimizer state per parameter and
// 2 + 2 bytes of fp16 params and grads.
std::vector<TableRow> zero_table(const std::vector<uint64_t>& params,
                                 const std::vector<uint64_t>& dps, uint64_t k);

// The paper's printed rounding of a GB (1e9 bytes) value: values of 100 GB and more are
// truncated to whole GB (4187.5 prints as 4187, 513.5 as 513); smaller values are rounded
// half-up to at most 3 significant figures and at most 2 decimals (41.25 -> 41.3,
// 0.46875 -> 0.47), trailing zeros dropped.
std::string paper_gb(uint64_t bytes);

}  // namespace zp::planner
