// allocator.cpp: the arena and caching-allocator models (offsets and sizes only).
#include "zp/planner/allocator.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "zp/error.hpp"
#include "zp/units.hpp"

namespace zp::planner {

// ---- ArenaModel ----------------------------------------------------------------------------

ArenaModel::ArenaModel(uint64_t alignment, uint64_t capacity)
    : alignment_(alignment), capacity_(capacity / alignment * alignment) {
  insert_free(0, capacity_);
}

void ArenaModel::insert_free(uint64_t off, uint64_t size) {
  free_by_offset_.emplace(off, size);
  free_by_size_.emplace(size, off);
}

void ArenaModel::erase_free(uint64_t off, uint64_t size) {
  free_by_offset_.erase(off);
  free_by_size_.erase({size, off});
}

std::optional<uint64_t> ArenaModel::try_alloc(uint64_t bytes, BlockId* id) {
  const uint64_t size = round_up(std::max<uint64_t>(bytes, 1), alignment_);
  auto it = free_by_size_.lower_bound({size, 0});
  if (it == free_by_size_.end()) return std::nullopt;
  const auto [block_size, off] = *it;
  erase_free(off, block_size);
  if (block_size > size) insert_free(off + size, block_size - size);
  blocks_.emplace_back(off, size);
  if (id != nullptr) *id = static_cast<BlockId>(blocks_.size() - 1);
  allocated_ += size;
  extent_ = std::max(extent_, off + size);
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  peak_extent_ = std::max(peak_extent_, extent_);
  return off;
}

BlockId ArenaModel::alloc(uint64_t bytes) {
  BlockId id = 0;
  if (!try_alloc(bytes, &id))
    throw Error(fmt::format("arena: cannot allocate {} (capacity {}, in use {}, largest free "
                            "block {})",
                            format_bytes(bytes), format_bytes(capacity_), format_bytes(allocated_),
                            format_bytes(largest_free())));
  return id;
}

void ArenaModel::free(BlockId id) {
  auto& [off, size] = blocks_.at(id);
  if (size == 0) throw Error(fmt::format("arena: block {} freed twice", id));
  allocated_ -= size;
  uint64_t start = off, len = size;
  size = 0;
  // Coalesce with the free neighbours on both sides.
  auto next = free_by_offset_.lower_bound(start);
  if (next != free_by_offset_.end() && next->first == start + len) {
    const uint64_t nlen = next->second;
    erase_free(next->first, nlen);
    len += nlen;
  }
  auto prev = free_by_offset_.lower_bound(start);
  if (prev != free_by_offset_.begin()) {
    --prev;
    if (prev->first + prev->second == start) {
      const uint64_t poff = prev->first, plen = prev->second;
      erase_free(poff, plen);
      start = poff;
      len += plen;
    }
  }
  insert_free(start, len);
  // The extent shrinks when the top block is freed: it is the start of the free block that
  // runs to the capacity, or the capacity when none does.
  auto last = free_by_offset_.rbegin();
  extent_ = (last != free_by_offset_.rend() && last->first + last->second == capacity_)
                ? last->first
                : capacity_;
}

uint64_t ArenaModel::offset(BlockId id) const { return blocks_.at(id).first; }
uint64_t ArenaModel::size(BlockId id) const { return blocks_.at(id).second; }

uint64_t ArenaModel::largest_free() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

// ---- CachingAllocatorModel -----------------------------------------------------------------

uint64_t CachingAllocatorModel::round_size(uint64_t bytes) {
  if (bytes < kMinBlockSize) return kMinBlockSize;
  return round_up(bytes, kMinBlockSize);
}

uint64_t CachingAllocatorModel::segment_size(uint64_t rounded) {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return round_up(rounded, kRoundLarge);
}

std::size_t CachingAllocatorModel::n_segments() const {
  return static_cast<std::size_t>(std::count_if(segments_.begin(), segments_.end(),
                                                [](const Segment& s) { return !s.released; }));
}

std::optional<BlockId> CachingAllocatorModel::take_cached(uint64_t rounded, bool small) {
  auto& p = pool(small);
  auto it = p.lower_bound({rounded, 0});
  if (it == p.end()) return std::nullopt;
  const uint64_t addr = it->second;
  p.erase(it);
  return by_addr_.at(addr);
}

void CachingAllocatorModel::release_free_segments() {
  for (uint32_t s = 0; s < segments_.size(); ++s) {
    Segment& seg = segments_[s];
    if (seg.released) continue;
    auto it = by_addr_.find(seg.addr);
    if (it == by_addr_.end()) continue;
    const Block& b = blocks_[it->second];
    if (b.in_use || b.size != seg.size) continue;  // in use, or split: not wholly free
    pool(seg.small).erase({b.size, b.addr});
    by_addr_.erase(it);
    reserved_ -= seg.size;
    seg.released = true;
  }
}

BlockId CachingAllocatorModel::alloc(uint64_t bytes) {
  const uint64_t rounded = round_size(bytes);
  const bool small = rounded <= kSmallSize;
  std::optional<BlockId> found = take_cached(rounded, small);
  if (!found) {
    const uint64_t seg = segment_size(rounded);
    if (reserved_ + seg > capacity_) release_free_segments();
    if (reserved_ + seg > capacity_ && !over_capacity_ok_)
      throw Error(fmt::format("caching allocator: out of memory allocating {} (reserved {}, "
                              "allocated {}, capacity {})",
                              format_bytes(rounded), format_bytes(reserved_),
                              format_bytes(allocated_), format_bytes(capacity_)));
    segments_.push_back({next_addr_, seg, small, false});
    blocks_.push_back({next_addr_, seg, static_cast<uint32_t>(segments_.size() - 1), small, false});
    found = static_cast<BlockId>(blocks_.size() - 1);
    by_addr_[next_addr_] = *found;
    next_addr_ += seg;
    reserved_ += seg;
    peak_reserved_ = std::max(peak_reserved_, reserved_);
  }
  BlockId id = *found;
  const uint64_t remaining = blocks_[id].size - rounded;
  const bool split = small ? remaining >= kMinBlockSize : remaining > kSmallSize;
  if (split) {
    Block rest = blocks_[id];
    rest.addr += rounded;
    rest.size = remaining;
    rest.in_use = false;
    blocks_.push_back(rest);
    const BlockId rest_id = static_cast<BlockId>(blocks_.size() - 1);
    by_addr_[rest.addr] = rest_id;
    pool(small).emplace(rest.size, rest.addr);
    blocks_[id].size = rounded;
  }
  blocks_[id].in_use = true;
  allocated_ += blocks_[id].size;
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  return id;
}

void CachingAllocatorModel::free(BlockId id) {
  Block& b = blocks_.at(id);
  if (!b.in_use) throw Error(fmt::format("caching allocator: block {} freed twice", id));
  b.in_use = false;
  allocated_ -= b.size;
  BlockId cur = id;
  // Merge with the next and previous blocks of the same segment when they are free.
  auto merge = [&](BlockId into, BlockId gone) {
    Block& a = blocks_[into];
    Block& g = blocks_[gone];
    pool(g.small).erase({g.size, g.addr});
    by_addr_.erase(g.addr);
    if (g.addr < a.addr) {
      by_addr_.erase(a.addr);
      a.addr = g.addr;
      by_addr_[a.addr] = into;
    }
    a.size += g.size;
    g.size = 0;
  };
  auto it = by_addr_.find(blocks_[cur].addr);
  auto next = std::next(it);
  if (next != by_addr_.end()) {
    const Block& n = blocks_[next->second];
    if (!n.in_use && n.segment == blocks_[cur].segment) merge(cur, next->second);
  }
  it = by_addr_.find(blocks_[cur].addr);
  if (it != by_addr_.begin()) {
    auto prev = std::prev(it);
    const Block& p = blocks_[prev->second];
    if (!p.in_use && p.segment == blocks_[cur].segment) {
      const BlockId pid = prev->second;
      // Keep the earlier block's record; the freed one merges into it.
      pool(p.small).erase({p.size, p.addr});
      Block& pb = blocks_[pid];
      pb.size += blocks_[cur].size;
      by_addr_.erase(blocks_[cur].addr);
      blocks_[cur].size = 0;
      cur = pid;
    }
  }
  pool(blocks_[cur].small).emplace(blocks_[cur].size, blocks_[cur].addr);
}

}  // namespace zp::planner
