// consumer: links zeroplan::planner from an installed zeroplan and checks two numbers against
// sources outside zeroplan: the ZeRO paper's table 1 and GPT-2 XL's parameter count.
#include <cstdint>
#include <cstdio>

#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/model_states.hpp"

int main() {
  // ZeRO paper (Rajbhandari et al. 2020), table 1: 7.5B parameters at Nd = 64 under
  // P_os+g+p need (2 + 2 + 12) x 7.5e9 / 64 bytes = 1.875e9 (printed 1.88 GB).
  const auto rows = zp::planner::zero_table({7'500'000'000}, {64}, 12);
  uint64_t stage3 = 0;
  for (const auto& r : rows)
    if (r.stage == 3) stage3 = r.bytes_per_device;
  // GPT-2 XL (48 layers, width 1600, 50257 tokens, 1024 positions): embeddings + positions +
  // 48 x (12 d^2 + 13 d) + the final LayerNorm's 2 d, the tied head counted once.
  const int64_t d = 1600;
  const int64_t want = 50257 * d + 1024 * d + 48 * (12 * d * d + 13 * d) + 2 * d;
  const int64_t got = zp::models::count_params(zp::models::load_model("gpt2-xl")).total;
  std::printf("zero_table 7.5B dp 64 stage 3: %llu bytes (paper: 1875000000)\n",
              static_cast<unsigned long long>(stage3));
  std::printf("gpt2-xl parameters: %lld (by hand: %lld)\n", static_cast<long long>(got),
              static_cast<long long>(want));
  try {
    zp::models::load_model("gpt2-xxl");
    std::puts("no error for an unknown model");
    return 1;
  } catch (const zp::Error& e) {
    std::printf("unknown model: %s (hint: %s)\n", e.what(), e.hint().c_str());
  }
  return stage3 == 1'875'000'000 && got == want ? 0 : 1;
}
