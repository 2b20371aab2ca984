// zp/planner/allocator.hpp: models of the two allocators whose behaviour decides how much
// memory a step really reserves: zeroplan's own arena (best-fit sub-allocation of one
// region) and PyTorch's CUDA caching allocator (what DeepSpeed runs on). Bookkeeping only:
// offsets and sizes, never memory. Replaying a step's alloc/free sequence through a model
// predicts reserved vs allocated bytes and fragmentation.
//
// Example usage:
//   ArenaModel arena(kArenaAlignment);
//   auto a = arena.alloc(1000);           // offset 0, 1024 bytes with the alignment
//   auto b = arena.alloc(10);             // offset 1024
//   arena.free(a);
//   uint64_t reserved = arena.peak_reserved();   // 1280: the extent both needed
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <vector>

namespace zp::planner {

// Every arena allocation is rounded up to this many bytes (cudaMalloc's own granularity for
// tensor alignment; also a multiple of every SIMD width and of the 4096-byte O_DIRECT blocks'
// divisor 256). The runtime's arena uses this constant, so planner and runtime round alike.
inline constexpr uint64_t kArenaAlignment = 256;

inline uint64_t round_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

// Handle of one allocation in a model.
using BlockId = uint32_t;

// zeroplan's arena: one region, best fit among free blocks (smallest that fits; among equal
// sizes the lowest offset), the remainder split off, neighbours coalesced on free; when no
// free block fits, the region grows at its end. "Reserved" is the extent: the highest end
// offset ever in use, which is what must fit in the arena's capacity.
class ArenaModel {
 public:
  explicit ArenaModel(uint64_t alignment = kArenaAlignment,
                      uint64_t capacity = UINT64_MAX);

  // Offset of a new block of `bytes` (rounded to the alignment; 0 bytes take one unit), or
  // nullopt when it would pass the capacity.
  std::optional<uint64_t> try_alloc(uint64_t bytes, BlockId* id = nullptr);
  BlockId alloc(uint64_t bytes);  // throws zp::Error when the capacity is exceeded
  void free(BlockId id);

  uint64_t offset(BlockId id) const;
  uint64_t size(BlockId id) const;  // rounded size
  uint64_t allocated() const { return allocated_; }
  uint64_t reserved() const { return extent_; }  // current highest end in use or free below
  uint64_t peak_allocated() const { return peak_allocated_; }
  uint64_t peak_reserved() const { return peak_extent_; }
  uint64_t largest_free() const;

 private:
  uint64_t alignment_, capacity_;
  uint64_t allocated_ = 0, extent_ = 0, peak_allocated_ = 0, peak_extent_ = 0;
  std::map<uint64_t, uint64_t> free_by_offset_;              // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;     // (size, offset)
  std::vector<std::pair<uint64_t, uint64_t>> blocks_;        // id -> (offset, size); size 0 = freed
  void insert_free(uint64_t off, uint64_t size);
  void erase_free(uint64_t off, uint64_t size);
};

// PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), the rules that decide
// memory (one stream, no expandable segments, default max_split_size):
// - sizes round up to 512 bytes (kMinBlockSize), at least 512;
// - requests <= 1 MiB (kSmallSize) come from the small pool, larger from the large pool;
// - a new segment (one cudaMalloc) is 2 MiB (kSmallBuffer) for small requests, 20 MiB
//   (kLargeBuffer) for large requests under 10 MiB (kMinLargeAlloc), else the request rounded
//   up to 2 MiB (kRoundLarge);
// - best fit: the smallest cached free block of the pool that fits (ties: lowest address);
// - a block is split when the rest is >= 512 bytes (small pool) or > 1 MiB (large pool);
// - freed blocks merge with free neighbours of the same segment and stay cached;
// - when a new segment would pass the capacity, fully free segments are released
//   (cudaFree) and the allocation retried, as the allocator does before reporting OOM.
// reserved = sum of segment sizes (torch.cuda.memory_reserved), allocated = sum of block
// sizes in use (torch.cuda.memory_allocated).
class CachingAllocatorModel {
 public:
  static constexpr uint64_t kMinBlockSize = 512;
  static constexpr uint64_t kSmallSize = 1 << 20;
  static constexpr uint64_t kSmallBuffer = 2 << 20;
  static constexpr uint64_t kLargeBuffer = 20 << 20;
  static constexpr uint64_t kMinLargeAlloc = 10 << 20;
  static constexpr uint64_t kRoundLarge = 2 << 20;

  explicit CachingAllocatorModel(uint64_t capacity = UINT64_MAX) : capacity_(capacity) {}

  static uint64_t round_size(uint64_t bytes);
  static uint64_t segment_size(uint64_t rounded);

  BlockId alloc(uint64_t bytes);  // zp::Error when even releasing the cache does not help
  void free(BlockId id);

  uint64_t allocated() const { return allocated_; }
  uint64_t reserved() const { return reserved_; }
  uint64_t peak_allocated() const { return peak_allocated_; }
  uint64_t peak_reserved() const { return peak_reserved_; }
  std::size_t n_segments() const;
  uint64_t block_size(BlockId id) const { return blocks_[id].size; }
  // torch.cuda.empty_cache(): every cached segment with no block in use goes back.
  void empty_cache() { release_free_segments(); }
  // Past the capacity, after releasing the cache as PyTorch does when cudaMalloc fails, go on
  // instead of throwing: a plan's replay, whose caller reports the shortfall.
  void allow_over_capacity(bool v) { over_capacity_ok_ = v; }
  uint64_t block_address(BlockId id) const { return blocks_[id].addr; }

 private:
  struct Block {
    uint64_t addr = 0, size = 0;
    uint32_t segment = 0;
    bool small = false, in_use = false;
  };
  struct Segment {
    uint64_t addr = 0, size = 0;
    bool small = false, released = false;
  };
  uint64_t capacity_;
  bool over_capacity_ok_ = false;
  uint64_t next_addr_ = 0;  // segments get disjoint synthetic addresses
  uint64_t allocated_ = 0, reserved_ = 0, peak_allocated_ = 0, peak_reserved_ = 0;
  std::vector<Block> blocks_;
  std::vector<Segment> segments_;
  std::set<std::pair<uint64_t, uint64_t>> free_small_, free_large_;  // (size, addr)
  std::map<uint64_t, BlockId> by_addr_;  // every live or cached block, by address
  std::set<std::pair<uint64_t, uint64_t>>& pool(bool small) { return small ? free_small_ : free_large_; }
  std::optional<BlockId> take_cached(uint64_t rounded, bool small);
  void release_free_segments();
};

}  // namespace zp::planner
