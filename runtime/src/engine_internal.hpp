// engine_internal.hpp: small helpers the engine's source files share (engine.cpp,
// engine_nvme.cpp, engine_checkpoint.cpp). Not part of the runtime's interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "zp/runtime/device.hpp"
#include "zp/runtime/swapper.hpp"

namespace zp::runtime::detail {

// Element `elem` of a buffer of `elem_bytes`-byte elements.
inline std::byte* at(void* base, uint64_t elem, uint64_t elem_bytes) {
  return static_cast<std::byte*>(base) + elem * elem_bytes;
}

// Frees arena allocations when a scope ends, also when an exception leaves it.
struct ArenaGuard {
  Arena& arena;
  std::vector<void*> held;  // null entries (nothing allocated) are skipped
  ~ArenaGuard() {
    for (auto it = held.rbegin(); it != held.rend(); ++it)
      if (*it != nullptr) arena.free(*it);
  }
};

// The first O_DIRECT-aligned byte of an arena block: the arena aligns to kArenaAlignment
// only; the planned sizes carry the slack.
inline std::byte* swap_aligned(void* block) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(block);
  return static_cast<std::byte*>(block) + (kSwapAlignBytes - addr % kSwapAlignBytes) % kSwapAlignBytes;
}

}  // namespace zp::runtime::detail
