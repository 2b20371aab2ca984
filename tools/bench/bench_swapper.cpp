// bench_swapper: sequential write and read throughput of one swap file through the NVMe
// swapper, for both backends, and the optimizer's chunk pipeline; counter "GB" is shown per
// second (10^9 bytes/s). Each benchmark checks the bytes it moved. The baseline is fio with
// the same block size, queue depth and directory: tools/bench/compare_swapper.sh runs both.
// Not a file-system benchmark suite: one file, sequential, O_DIRECT, like ZeRO-Infinity's.
//
// Environment (defaults in brackets): ZP_SWAP_BENCH_DIR [/var/tmp], ZP_SWAP_BENCH_BYTES
// [1073741824], ZP_SWAP_BENCH_BLOCK [1048576, DeepSpeed's aio.block_size],
// ZP_SWAP_BENCH_QD [8, aio.queue_depth], ZP_SWAP_BENCH_CHUNK [67108864, pipeline chunk].
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "aligned_buffer.hpp"
#include "zp/runtime/swapper.hpp"

namespace {

using namespace zp::runtime;

uint64_t env_u64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 0) : fallback;
}

struct Setup {
  std::string dir =
      std::getenv("ZP_SWAP_BENCH_DIR") ? std::getenv("ZP_SWAP_BENCH_DIR") : "/var/tmp";
  uint64_t bytes = env_u64("ZP_SWAP_BENCH_BYTES", uint64_t{1} << 30);
  uint64_t block = env_u64("ZP_SWAP_BENCH_BLOCK", AioConfig{}.block_size);
  uint32_t qd = static_cast<uint32_t>(env_u64("ZP_SWAP_BENCH_QD", AioConfig{}.queue_depth));
  uint64_t chunk = env_u64("ZP_SWAP_BENCH_CHUNK", uint64_t{64} << 20);

  SwapperOptions options(SwapBackend backend) const {
    SwapperOptions o;
    o.dir = dir;
    o.aio.block_size = block;
    o.aio.queue_depth = qd;
    o.backend = backend;
    return o;
  }
};

// A pattern no stale or misplaced block can match: word i holds i * an odd constant + seed.
void fill(std::byte* p, uint64_t bytes, uint64_t seed) {
  auto* w = reinterpret_cast<uint64_t*>(p);
  for (uint64_t i = 0; i < bytes / 8; ++i) w[i] = i * 0x9E3779B97F4A7C15ULL + seed;
}
bool matches(const std::byte* p, uint64_t bytes, uint64_t seed) {
  const auto* w = reinterpret_cast<const uint64_t*>(p);
  for (uint64_t i = 0; i < bytes / 8; ++i)
    if (w[i] != i * 0x9E3779B97F4A7C15ULL + seed) return false;
  return true;
}

// The swapper for one benchmark, or null (and the benchmark skipped) if the backend cannot
// start here, e.g. io_uring refused by the kernel.
std::unique_ptr<Swapper> start(benchmark::State& state, const Setup& s, SwapBackend backend) {
  try {
    auto swapper = std::make_unique<Swapper>(s.options(backend));
    state.SetLabel(std::string(to_string(swapper->backend())));
    return swapper;
  } catch (const zp::Error& e) {
    state.SkipWithError(e.what());
    return nullptr;
  }
}

void report(benchmark::State& state, uint64_t bytes_per_iteration, const Setup& s) {
  const double total =
      static_cast<double>(bytes_per_iteration) * static_cast<double>(state.iterations());
  state.counters["GB"] = benchmark::Counter(total / 1e9, benchmark::Counter::kIsRate);
  state.counters["MiB"] = static_cast<double>(s.bytes) / (1 << 20);
  state.counters["block_KiB"] = static_cast<double>(s.block) / 1024;
  state.counters["qd"] = s.qd;
}

// One write of the whole file: the swapper cuts it into block_size I/Os, qd in flight.
void BM_SwapWrite(benchmark::State& state, SwapBackend backend) {
  const Setup s;
  const auto owned = start(state, s, backend);
  if (!owned) return;
  Swapper& swapper = *owned;
  const SwapFile f = swapper.open("bench", s.bytes);
  zp::test::AlignedBuffer buf(s.bytes);
  fill(buf.data(), s.bytes, 1);
  for (auto _ : state) swapper.wait(swapper.write(f, 0, buf.data(), s.bytes));
  // Check what landed: read it back into a cleared buffer (untimed).
  std::memset(buf.data(), 0, buf.capacity_bytes());
  swapper.wait(swapper.read(f, 0, buf.data(), s.bytes));
  if (!matches(buf.data(), s.bytes, 1))
    state.SkipWithError("the file does not hold what was written");
  report(state, s.bytes, s);
}
BENCHMARK_CAPTURE(BM_SwapWrite, io_uring, SwapBackend::io_uring)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_SwapWrite, thread_pool, SwapBackend::thread_pool)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_SwapRead(benchmark::State& state, SwapBackend backend) {
  const Setup s;
  const auto owned = start(state, s, backend);
  if (!owned) return;
  Swapper& swapper = *owned;
  const SwapFile f = swapper.open("bench", s.bytes);
  zp::test::AlignedBuffer buf(s.bytes);
  fill(buf.data(), s.bytes, 2);
  swapper.wait(swapper.write(f, 0, buf.data(), s.bytes));
  std::memset(buf.data(), 0, buf.capacity_bytes());
  for (auto _ : state) swapper.wait(swapper.read(f, 0, buf.data(), s.bytes));
  if (!matches(buf.data(), s.bytes, 2)) state.SkipWithError("read back wrong bytes");
  report(state, s.bytes, s);
}
BENCHMARK_CAPTURE(BM_SwapRead, io_uring, SwapBackend::io_uring)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_SwapRead, thread_pool, SwapBackend::thread_pool)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// The optimizer's loop over the whole file: read chunk k+1 || add 1 to every word of chunk k
// || write chunk k-1, through 3 buffers. GB/s counts the bytes read plus written.
void BM_SwapPipeline(benchmark::State& state, SwapBackend backend) {
  const Setup s;
  const auto owned = start(state, s, backend);
  if (!owned) return;
  Swapper& swapper = *owned;
  const uint64_t chunk = std::min(s.chunk, Swapper::padded_bytes(s.bytes));
  const SwapFile f = swapper.open("bench", s.bytes);
  zp::test::AlignedBuffer init(s.bytes);
  fill(init.data(), s.bytes, 3);
  swapper.wait(swapper.write(f, 0, init.data(), s.bytes));
  zp::test::AlignedBuffer b0(chunk), b1(chunk), b2(chunk);
  ChunkPipeline pipe(swapper, chunk, {b0.host(), b1.host(), b2.host()});
  uint64_t n_passes = 0;
  for (auto _ : state) {
    pipe.run(f, 0, s.bytes, [](std::span<std::byte> c, uint64_t) {
      auto* w = reinterpret_cast<uint64_t*>(c.data());
      for (uint64_t i = 0; i < c.size() / 8; ++i) w[i] += 1;
    });
    ++n_passes;
  }
  swapper.wait(swapper.read(f, 0, init.data(), s.bytes));
  if (!matches(init.data(), s.bytes, 3 + n_passes))
    state.SkipWithError("the pipeline did not add 1 per pass to every word");
  report(state, 2 * s.bytes, s);
}
BENCHMARK_CAPTURE(BM_SwapPipeline, io_uring, SwapBackend::io_uring)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_SwapPipeline, thread_pool, SwapBackend::thread_pool)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
