// kernel_common.cuh (internal): what the .cu files of the CUDA backend share: launch shapes,
// warp and block reductions, typed loads and stores (storage type D a compile-time constant),
// the owner-thread accumulation Acc, and the launch macros. Device code only; each .cu keeps
// its kernels in an anonymous namespace of its own.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda_check.hpp"
#include "zp/error.hpp"
#include "zp/runtime/dtype.hpp"
#include "zp/runtime/kernel_math.hpp"

namespace zp::runtime::cuda::common {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr unsigned kFullMask = 0xffffffffu;

// Blocks for n independent items, one per thread; grid-stride loops cover the rest beyond
// the cap (the x dimension allows 2^31 - 1 blocks; 2^20 keeps every loop index in int64).
inline unsigned blocks_for(int64_t n, int64_t per_block = kThreads) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + per_block - 1) / per_block, 1, int64_t{1} << 20));
}

#define ZP_LAUNCH_CHECK() ZP_CUDA_CHECK(cudaGetLastError())

__device__ inline int64_t global_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// The first key query t sees (cpu::AttnShape::first_key): t - window + 1 under a sliding
// window of `window` keys, else 0.
__host__ __device__ inline int64_t first_key(int64_t t, int64_t window) {
  return window > 0 && t >= window ? t - window + 1 : 0;
}

template <typename F>
__device__ F warp_sum(F v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// A one-warp-per-row kernel's row (this thread's warp across the grid) and the thread's lane.
__device__ inline int64_t warp_row() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
}
__device__ inline int lane_id() { return static_cast<int>(threadIdx.x % kWarp); }

// Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
template <typename F>
__device__ F block_sum(F v) {
  __shared__ F partial[kWarp];
  v = warp_sum(v);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  __syncthreads();  // a previous call's readers are done with `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / kWarp) ? partial[lane] : F(0);
  return warp_sum(v);
}
__device__ inline float block_max(float v) {
  __shared__ float partial[kWarp];
  v = warp_max(v);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / kWarp) ? partial[lane] : -INFINITY;
  return warp_max(v);
}

// Loads and stores of storage type D (a compile-time constant: the switch in load_as_f32 /
// store_from_f32 folds away).
template <DType D>
__device__ __forceinline__ float ld(const void* p, int64_t i) {
  return load_as_f32(p, static_cast<std::size_t>(i), D);
}
template <DType D>
__device__ __forceinline__ void st(void* p, int64_t i, float v) {
  store_from_f32(p, static_cast<std::size_t>(i), D, v);
}

// An accumulation into one output element by its one owner thread, in the order of the CPU
// kernels of the same type: fp32 from the old value on, one addition at a time (the in-place
// updates of cpu_kernels.cpp's fp32 kernels); 16-bit as the fp32 sum of the contributions,
// added to the old value once and rounded once (its 16-bit kernels).
template <DType D>
struct Acc {
  float s;
  __device__ Acc(const void* p, int64_t i) : s(D == DType::fp32 ? ld<D>(p, i) : 0.0f) {}
  __device__ void add(float v) { s += v; }
  __device__ void store(void* p, int64_t i) const {
    st<D>(p, i, D == DType::fp32 ? s : ld<D>(p, i) + s);
  }
};

inline unsigned rows_blocks(int64_t n_rows) { return blocks_for(n_rows, kWarpsPerBlock); }

// Rows per launch of the one-warp-per-row kernels: rows_blocks caps the grid at 2^20 blocks.
inline void check_rows(int64_t n_rows, const char* what) {
  if (n_rows > (int64_t{1} << 20) * kWarpsPerBlock)
    throw Error(std::string("cuda ") + what + ": " + std::to_string(n_rows) + " rows exceed one launch",
                "use fewer tokens per micro-batch");
}

}  // namespace zp::runtime::cuda::common

// Runs the statement with the storage type t as the compile-time constant D.
#define ZP_TYPED(t, ...) \
  dispatch_dtype((t), [&](auto zp_type_tag_) { constexpr DType D = decltype(zp_type_tag_)::value; __VA_ARGS__; })
