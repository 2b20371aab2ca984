// placement.cpp: ZeRO-Offload's placement as two parametric minimum cuts (Boost.Graph max-flow)
// of the step's dataflow graph. Not DeepSpeed's placement code: the placement is derived here
// from bytes and capacities, and tests check it against the paper.
#include "zp/planner/placement.hpp"

// GCC 12 reports -Wmaybe-uninitialized inside Boost.Graph's edge iterators when max-flow is
// instantiated (a false positive in the library headers).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cmath>
#include <vector>

#include <boost/graph/adjacency_list.hpp>
#include <boost/graph/boykov_kolmogorov_max_flow.hpp>
#include <fmt/format.h>

namespace zp::planner {

std::string_view to_string(State s) {
  switch (s) {
    case State::p16: return "p16";
    case State::g16: return "g16";
    case State::p32: return "p32";
    case State::m32: return "m32";
    case State::v32: return "v32";
  }
  return "?";
}

namespace {

// Vertices: the two terminals, the three computations, the five states.
enum V : int { kSource, kSink, kFwd, kUpdate, kF2h, kFirstState, kCount = kFirstState + 5 };
constexpr int vertex(State s) { return kFirstState + static_cast<int>(s); }

// One data movement per step: `bytes_per_param` from `src` to `dst` (paper fig. 2's edges:
// p16 -> FWD-BWD (once per pass), float2half -> p16, FWD-BWD -> g16, g16 -> update,
// p32/m32/v32 <-> update (read and written), p32 -> float2half).
struct Transfer {
  int src, dst;
  double bytes_per_param;
};

std::vector<Transfer> transfers(const PlacementInput& in) {
  auto b = [&](State s) { return in.bytes_per_param[static_cast<std::size_t>(s)]; };
  return {
      {vertex(State::p16), kFwd, in.reads_of_p16 * b(State::p16)},
      {kF2h, vertex(State::p16), b(State::p16)},
      {kFwd, vertex(State::g16), b(State::g16)},
      {vertex(State::g16), kUpdate, b(State::g16)},
      {vertex(State::p32), kUpdate, b(State::p32)},
      {kUpdate, vertex(State::p32), b(State::p32)},
      {vertex(State::m32), kUpdate, b(State::m32)},
      {kUpdate, vertex(State::m32), b(State::m32)},
      {vertex(State::v32), kUpdate, b(State::v32)},
      {kUpdate, vertex(State::v32), b(State::v32)},
      {vertex(State::p32), kF2h, b(State::p32)},
  };
}

using Traits = boost::adjacency_list_traits<boost::vecS, boost::vecS, boost::directedS>;
using FlowGraph = boost::adjacency_list<
    boost::vecS, boost::vecS, boost::directedS,
    boost::property<boost::vertex_color_t, boost::default_color_type,
                    boost::property<boost::vertex_distance_t, int64_t,
                                    boost::property<boost::vertex_predecessor_t,
                                                    Traits::edge_descriptor>>>,
    boost::property<boost::edge_capacity_t, int64_t,
                    boost::property<boost::edge_residual_capacity_t, int64_t,
                                    boost::property<boost::edge_reverse_t,
                                                    Traits::edge_descriptor>>>>;

// Integer capacities (max-flow on doubles is fragile): bytes per parameter x kScale.
constexpr double kScale = 1e6;
constexpr int64_t kInfinite = int64_t{1} << 50;

class CutGraph {
 public:
  CutGraph() : g_(kCount) {}
  void add(int u, int v, int64_t cap) {
    if (cap <= 0) return;
    auto cap_map = boost::get(boost::edge_capacity, g_);
    auto rev = boost::get(boost::edge_reverse, g_);
    auto e = boost::add_edge(static_cast<std::size_t>(u), static_cast<std::size_t>(v), g_).first;
    auto r = boost::add_edge(static_cast<std::size_t>(v), static_cast<std::size_t>(u), g_).first;
    cap_map[e] = cap;
    cap_map[r] = 0;
    rev[e] = r;
    rev[r] = e;
  }
  // True per vertex when it ends on the source side of the minimum cut.
  std::vector<bool> source_side() {
    boost::boykov_kolmogorov_max_flow(g_, kSource, kSink);
    auto color = boost::get(boost::vertex_color, g_);
    std::vector<bool> out(kCount);
    // Boykov-Kolmogorov colours the source tree black; everything else is the sink side.
    for (int v = 0; v < kCount; ++v)
      out[static_cast<std::size_t>(v)] =
          color[static_cast<std::size_t>(v)] == boost::black_color;
    return out;
  }

 private:
  FlowGraph g_;
};

int64_t scaled(double bytes_per_param) {
  return static_cast<int64_t>(std::llround(bytes_per_param * kScale));
}

// One cut: `pinned` vertices forced to the source side; `priced` states pay lambda x bytes
// when on the source side. Returns the source side.
std::vector<bool> cut(const PlacementInput& in, const std::vector<int>& pinned,
                      const std::vector<State>& priced, double lambda) {
  CutGraph g;
  for (const Transfer& t : transfers(in)) {
    // Either end may be on either side: the cut pays the bytes once whichever way they cross.
    g.add(t.src, t.dst, scaled(t.bytes_per_param));
    g.add(t.dst, t.src, scaled(t.bytes_per_param));
  }
  for (int v : pinned) g.add(kSource, v, kInfinite);
  for (State s : priced)
    g.add(vertex(s), kSink, scaled(lambda * in.bytes_per_param[static_cast<std::size_t>(s)]));
  return g.source_side();
}

double bytes_on_side(const PlacementInput& in, const std::vector<bool>& side,
                     const std::vector<State>& states) {
  double b = 0;
  for (State s : states)
    if (side[static_cast<std::size_t>(vertex(s))]) b += in.bytes_per_param[static_cast<std::size_t>(s)];
  return b;
}

// Smallest price lambda (bisection on a grid of 1e-6) at which the priced states left on the
// source side fit `capacity`; the cut at that price. `fits` is false when none does.
std::vector<bool> cheapest_fitting_cut(const PlacementInput& in, const std::vector<int>& pinned,
                                       const std::vector<State>& priced, double capacity,
                                       bool& fits) {
  auto fits_at = [&](double lambda, std::vector<bool>& side) {
    side = cut(in, pinned, priced, lambda);
    return bytes_on_side(in, side, priced) <= capacity + 1e-9;
  };
  std::vector<bool> side;
  if (fits_at(0.0, side)) return side;
  // Past lambda = (largest traffic any state can cause) / (its bytes) everything that can
  // leave has left; 1e4 bytes of traffic per byte of memory is far beyond that.
  double lo = 0.0, hi = 1e4;
  std::vector<bool> best;
  fits = fits_at(hi, best);
  if (!fits) return best;
  for (int i = 0; i < 60 && hi - lo > 1e-6; ++i) {
    const double mid = 0.5 * (lo + hi);
    std::vector<bool> s;
    if (fits_at(mid, s)) {
      hi = mid;
      best = std::move(s);
    } else {
      lo = mid;
    }
  }
  return best;
}

}  // namespace

uint64_t Placement::pcie_bytes(uint64_t n_params) const {
  return static_cast<uint64_t>(
      std::llround((down_bytes_per_param + up_bytes_per_param) * static_cast<double>(n_params)));
}

std::string Placement::describe() const {
  std::string out;
  for (State s : kStates) out += fmt::format("{} {}; ", to_string(s), to_string(of(s)));
  out += fmt::format("update {}", to_string(update));
  return out;
}

Placement place(const PlacementInput& in) {
  Placement p;
  const std::vector<State> all(kStates.begin(), kStates.end());
  // 1. GPU | host.
  bool fits_gpu = true;
  const std::vector<bool> gpu =
      cheapest_fitting_cut(in, {kFwd}, all, in.gpu_bytes_per_param, fits_gpu);
  // 2. CPU | NVMe among the host-side states: computations and GPU-side states are pinned
  //    to the CPU side (anything they exchange with an NVMe state crosses the NVMe link).
  std::vector<int> pinned = {kFwd, kUpdate, kF2h};
  std::vector<State> host_states;
  for (State s : kStates) {
    if (gpu[static_cast<std::size_t>(vertex(s))]) pinned.push_back(vertex(s));
    else host_states.push_back(s);
  }
  bool fits_cpu = true;
  const std::vector<bool> cpu =
      cheapest_fitting_cut(in, pinned, host_states, in.cpu_bytes_per_param, fits_cpu);
  p.fits = fits_gpu && fits_cpu;

  auto tier_of = [&](int v) {
    if (gpu[static_cast<std::size_t>(v)]) return Tier::gpu;
    return cpu[static_cast<std::size_t>(v)] ? Tier::cpu : Tier::nvme;
  };
  for (State s : kStates) {
    const Tier t = tier_of(vertex(s));
    p.tier[static_cast<std::size_t>(s)] = t;
    const double b = in.bytes_per_param[static_cast<std::size_t>(s)];
    (t == Tier::gpu ? p.gpu_state_bytes_per_param
     : t == Tier::cpu ? p.cpu_state_bytes_per_param
                      : p.nvme_state_bytes_per_param) += b;
  }
  p.update = tier_of(kUpdate);
  p.float2half = tier_of(kF2h);
  // Traffic: every transfer whose ends are on different tiers. NVMe data reaches the GPU
  // through the CPU: it pays the NVMe link and the PCIe link.
  for (const Transfer& t : transfers(in)) {
    const Tier a = tier_of(t.src), b = tier_of(t.dst);
    if (a == b) continue;
    if (a == Tier::nvme) p.nvme_read_bytes_per_param += t.bytes_per_param;
    if (b == Tier::nvme) p.nvme_write_bytes_per_param += t.bytes_per_param;
    if (a == Tier::gpu) p.down_bytes_per_param += t.bytes_per_param;
    if (b == Tier::gpu) p.up_bytes_per_param += t.bytes_per_param;
  }
  if (p.nvme_state_bytes_per_param > in.nvme_bytes_per_param + 1e-9) p.fits = false;
  return p;
}

}  // namespace zp::planner
