// zp/planner/placement.hpp: where each model state lives and where the optimizer runs, derived
// as a minimum cut of ZeRO-Offload's dataflow graph (Ren et al. 2021, sec. 3) with
// Boost.Graph's max-flow, first GPU | host, then (ZeRO-Infinity) CPU | NVMe inside the host.
// Per parameter and per step; not a memory schedule (schedule.hpp) and not timing (simulate.hpp).
//
// Example usage:
//   PlacementInput in;                       // mixed-precision Adam, 1 micro-step
//   in.gpu_bytes_per_param = 6.0;            // what the GPU can give the model states
//   Placement p = place(in);                 // the paper's: p16 on gpu, the rest on cpu
//   uint64_t moved = p.pcie_bytes(13'000'000'000);   // 4M: 2M down (g16), 2M up (p16)
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "zp/planner/memory.hpp"

namespace zp::planner {

// The dataflow graph's data: the ZeRO-Offload paper's edges, here vertices so that each has a
// place (a tensor lives on one side; traffic is paid where a consumer or producer is across).
enum class State { p16, g16, p32, m32, v32 };
inline constexpr std::array kStates = {State::p16, State::g16, State::p32, State::m32, State::v32};
std::string_view to_string(State s);

// Computations: FWD-BWD (pinned to the GPU), the parameter update (Adam), float2half.
enum class Compute { fwd_bwd, update, float2half };

struct PlacementInput {
  // Bytes of each state per parameter: the paper's mixed-precision Adam (2, 2, 4, 4, 4).
  std::array<double, kStates.size()> bytes_per_param{2, 2, 4, 4, 4};
  // Bytes per parameter the GPU and the host can give to the states (capacity minus
  // activations, buffers and everything else, divided by the parameters of the rank).
  double gpu_bytes_per_param = 1e30;
  double cpu_bytes_per_param = 1e30;
  double nvme_bytes_per_param = 1e30;  // checked, not optimized: NVMe is the last tier
  // Forward and backward each read the 16-bit parameters: when p16 lives off the GPU it
  // crosses twice per micro-step (three times with recomputation).
  int reads_of_p16 = 2;
};

struct Placement {
  std::array<Tier, kStates.size()> tier{};  // per State
  Tier update = Tier::gpu;                  // where Adam runs
  Tier float2half = Tier::gpu;
  // Bytes per parameter per step across each link, as derived from the cut.
  double down_bytes_per_param = 0;       // GPU -> host (PCIe device-to-host)
  double up_bytes_per_param = 0;         // host -> GPU
  double nvme_read_bytes_per_param = 0;  // NVMe -> CPU
  double nvme_write_bytes_per_param = 0; // CPU -> NVMe
  double gpu_state_bytes_per_param = 0;  // states left on the GPU
  double cpu_state_bytes_per_param = 0;
  double nvme_state_bytes_per_param = 0;
  bool fits = true;  // false when even the least GPU-hungry cut passes a capacity

  Tier of(State s) const { return tier[static_cast<std::size_t>(s)]; }
  uint64_t pcie_bytes(uint64_t n_params) const;  // down + up, for n parameters
  std::string describe() const;  // "p16 gpu; g16 cpu; p32 cpu; m32 cpu; v32 cpu; update cpu"
};

// Two minimum cuts (Boost.Graph boykov_kolmogorov_max_flow):
//  1. GPU | host: FWD-BWD on the GPU side; edge weights are the bytes that cross per step when
//     their ends are apart; each state costs lambda x bytes on the GPU side. lambda is the
//     smallest price of GPU memory (bisection; the cut is monotone in lambda) at which the
//     states left on the GPU fit gpu_bytes_per_param: the least traffic that fits, and among
//     equal traffic the least GPU memory (the paper's sec. 3.3 then 3.4).
//  2. CPU | NVMe among the host-side states, the same way with the host's capacity; update and
//     float2half stay on the CPU (NVMe computes nothing).
Placement place(const PlacementInput& in);

}  // namespace zp::planner
