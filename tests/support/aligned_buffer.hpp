// aligned_buffer.hpp (tests and benchmarks only): an RAII 4096-aligned host buffer for the
// swapper, whose API takes caller-owned memory. Not for the runtime, which allocates every
// host byte through its tagged arena.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "zp/runtime/swapper.hpp"

namespace zp::test {

class AlignedBuffer {
 public:
  // Capacity: bytes rounded up to 4096 (Swapper::padded_bytes), zero-filled.
  explicit AlignedBuffer(uint64_t bytes)
      : capacity_bytes_(zp::runtime::Swapper::padded_bytes(bytes == 0 ? 1 : bytes)) {
    data_ =
        static_cast<std::byte*>(std::aligned_alloc(zp::runtime::kSwapAlignBytes, capacity_bytes_));
    if (!data_) throw std::bad_alloc();
    std::memset(data_, 0, capacity_bytes_);
  }
  ~AlignedBuffer() { std::free(data_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  std::byte* data() const { return data_; }
  uint64_t capacity_bytes() const { return capacity_bytes_; }
  zp::runtime::HostBuffer host() const { return {data_, capacity_bytes_}; }

 private:
  uint64_t capacity_bytes_;
  std::byte* data_;
};

}  // namespace zp::test
