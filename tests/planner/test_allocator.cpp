// The allocator models on hand-built alloc/free traces. Every expected offset and size below
// is worked out by hand from the rules in allocator.hpp (for the caching allocator: PyTorch's
// c10/cuda/CUDACachingAllocator.cpp rules quoted there), not read back from the code.
#include <doctest/doctest.h>

#include "zp/error.hpp"
#include "zp/planner/allocator.hpp"

using namespace zp::planner;

namespace {
constexpr uint64_t MiB = 1ULL << 20;
}

TEST_CASE("arena: alignment, best fit, growth at the end, coalescing") {
  ArenaModel a(256);
  const BlockId x = a.alloc(1000);  // 1024 bytes at 0
  const BlockId y = a.alloc(10);    // 256 bytes at 1024
  CHECK(a.offset(x) == 0);
  CHECK(a.size(x) == 1024);
  CHECK(a.offset(y) == 1024);
  CHECK(a.reserved() == 1280);
  a.free(x);                        // hole [0, 1024)
  const BlockId z = a.alloc(512);   // best fit: the hole, at 0; [512, 1024) stays free
  const BlockId w = a.alloc(600);   // 768 bytes: the 512-byte hole is too small -> the end
  CHECK(a.offset(z) == 0);
  CHECK(a.offset(w) == 1280);
  CHECK(a.size(w) == 768);
  CHECK(a.reserved() == 2048);
  CHECK(a.peak_allocated() == 512 + 256 + 768);
  CHECK(a.peak_reserved() == 2048);
  a.free(w);                        // the top block: the extent falls back to 1280
  CHECK(a.reserved() == 1280);
  a.free(y);                        // [512, 1280) merges with [512,1024) and the tail
  CHECK(a.reserved() == 512);
  CHECK(a.allocated() == 512);
  CHECK(a.peak_reserved() == 2048);
  CHECK_THROWS_AS(a.free(y), zp::Error);  // double free
}

TEST_CASE("arena: among equal holes the lowest offset wins; zero bytes take one unit") {
  ArenaModel a(256);
  std::vector<BlockId> b;
  for (int i = 0; i < 5; ++i) b.push_back(a.alloc(256));
  a.free(b[3]);
  a.free(b[1]);
  const BlockId n = a.alloc(200);
  CHECK(a.offset(n) == 256);
  const BlockId e = a.alloc(0);
  CHECK(a.size(e) == 256);
  CHECK(a.offset(e) == 768);
}

TEST_CASE("arena: capacity is a hard limit with a clear error") {
  ArenaModel a(256, 2048);
  const BlockId x = a.alloc(2048);
  CHECK_FALSE(a.try_alloc(1).has_value());
  CHECK_THROWS_AS(a.alloc(1), zp::Error);
  a.free(x);
  CHECK(a.try_alloc(2000).has_value());
}

TEST_CASE("caching allocator: rounding and segment sizes") {
  using C = CachingAllocatorModel;
  CHECK(C::round_size(1) == 512);
  CHECK(C::round_size(512) == 512);
  CHECK(C::round_size(513) == 1024);
  CHECK(C::round_size(MiB) == MiB);
  CHECK(C::segment_size(1024) == 2 * MiB);           // small pool: 2 MiB segments
  CHECK(C::segment_size(MiB) == 2 * MiB);            // 1 MiB is still small
  CHECK(C::segment_size(MiB + 512) == 20 * MiB);     // large, under 10 MiB: 20 MiB
  CHECK(C::segment_size(10 * MiB - 512) == 20 * MiB);
  CHECK(C::segment_size(10 * MiB) == 10 * MiB);      // from 10 MiB: rounded to 2 MiB
  CHECK(C::segment_size(11 * MiB) == 12 * MiB);
}

TEST_CASE("caching allocator: small pool splits and reuses the best fit") {
  CachingAllocatorModel c;
  const BlockId a = c.alloc(1000);  // 1024 from a new 2 MiB segment, the rest cached
  CHECK(c.reserved() == 2 * MiB);
  CHECK(c.allocated() == 1024);
  const BlockId b = c.alloc(3000);  // 3072 from the cached rest, right after a
  CHECK(c.block_address(b) == c.block_address(a) + 1024);
  c.free(a);                        // [0, 1024) cached; b still in use
  const BlockId d = c.alloc(600);   // best fit is the 1024 hole, not the big remainder
  CHECK(c.block_address(d) == c.block_address(a));
  CHECK(c.block_size(d) == 1024);
  CHECK(c.n_segments() == 1);
  CHECK(c.allocated() == 1024 + 3072);
}

TEST_CASE("caching allocator: a large block is not split for a remainder of 1 MiB or less") {
  CachingAllocatorModel c;
  const BlockId a = c.alloc(5 * MiB);   // new 20 MiB segment, 15 MiB cached
  const BlockId b = c.alloc(12 * MiB);  // from the 15 MiB block; 3 MiB (> 1 MiB) split off
  CHECK(c.reserved() == 20 * MiB);
  const BlockId x = c.alloc(4 * MiB);   // 3 MiB cached does not fit: second 20 MiB segment
  CHECK(c.reserved() == 40 * MiB);
  CHECK(c.allocated() == 21 * MiB);
  c.free(b);                            // merges with the free 3 MiB: one 15 MiB block
  const BlockId d = c.alloc(14 * MiB);  // rest 1 MiB is not > 1 MiB: the whole 15 MiB
  CHECK(c.block_size(d) == 15 * MiB);
  CHECK(c.allocated() == (5 + 4 + 15) * MiB);
  CHECK(c.reserved() == 40 * MiB);
  // Fragmentation the model predicts: reserved - allocated.
  CHECK(c.reserved() - c.allocated() == 16 * MiB);
  (void)a;
  (void)x;
}

TEST_CASE("caching allocator: cached segments are reused, and released only at OOM") {
  CachingAllocatorModel c(40 * MiB);
  const BlockId a = c.alloc(30 * MiB);  // exactly 30 MiB, no split
  CHECK(c.reserved() == 30 * MiB);
  c.free(a);
  const BlockId b = c.alloc(10 * MiB);  // reuses the cached 30 MiB block, split (20 MiB left)
  CHECK(c.reserved() == 30 * MiB);
  CHECK(c.block_size(b) == 10 * MiB);
  c.free(b);
  // 35 MiB: nothing cached fits; a 36 MiB segment would pass 40 MiB, so the free 30 MiB
  // segment is released first (cudaFree), as PyTorch does before reporting OOM.
  // The 1 MiB left in that segment is not > 1 MiB: not split, the block is all 36 MiB.
  const BlockId d = c.alloc(35 * MiB);
  CHECK(c.block_size(d) == 36 * MiB);
  CHECK(c.reserved() == 36 * MiB);
  CHECK(c.n_segments() == 1);
  CHECK(c.peak_reserved() == 36 * MiB);
  CHECK_THROWS_AS(c.alloc(10 * MiB), zp::Error);  // 36 + 20 > 40 and nothing is free
}
