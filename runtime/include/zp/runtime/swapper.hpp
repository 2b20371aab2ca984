// zp/runtime/swapper.hpp: NVMe swapping for ZeRO-Infinity. O_DIRECT swap files per rank,
// asynchronous reads and writes of caller-owned aligned host buffers through io_uring
// (liburing), a pread/pwrite thread pool where io_uring is unavailable, and the chunk
// pipeline of the pipelined optimizer swapper. Not an allocator: every host byte it reads
// into or writes from belongs to the caller (the runtime's tagged arena); it keeps only its
// own bookkeeping (queues, tickets, the ring).
//
// Example usage:
//   zp::runtime::SwapperOptions opt;
//   opt.dir = "/mnt/nvme";                          // zero-run --nvme-path
//   opt.rank = rank;                                // opt.aio: DeepSpeed's "aio" section
//   zp::runtime::Swapper swapper(opt);
//   auto f = swapper.open("master", n_bytes);       // /mnt/nvme/rank0.master.swp, mode 0600
//   auto g = swapper.open("exp_avg", m_bytes);
//   // buffers: 4096-aligned, capacity >= Swapper::padded_bytes(bytes) (from the arena)
//   auto t1 = swapper.write(f, 0, buf_a, n_bytes);  // returns at once; the I/O is in flight
//   auto t2 = swapper.read(g, 0, buf_b, m_bytes);   // several requests may be in flight
//   swapper.wait(t1);                               // throws IoError if the write failed
//   swapper.wait_all();
//
//   // The optimizer's loop: read chunk k+1 || update chunk k || write chunk k-1 back.
//   const uint64_t need = ChunkPipeline::host_bytes(chunk_bytes);  // exact, for the planner
//   ChunkPipeline pipe(swapper, chunk_bytes, {{p0, chunk_bytes}, {p1, chunk_bytes},
//                                             {p2, chunk_bytes}});
//   pipe.run(f, 0, n_bytes, [&](std::span<std::byte> chunk, uint64_t offset_in_region) {
//     adam_step(reinterpret_cast<float*>(chunk.data()), chunk.size() / 4, offset_in_region);
//   });
//   // files are removed by close(f), by ~Swapper (also after an error) and at exit().
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zp/runtime/io_check.hpp"

namespace zp::runtime {

// O_DIRECT needs buffer addresses, file offsets and lengths aligned to the device's logical
// block (512 or 4096 bytes); 4096 serves both.
inline constexpr uint64_t kSwapAlignBytes = 4096;

// DeepSpeed's "aio" config section, same names and defaults
// (deepspeed/runtime/swap_tensor/constants.py: AIO_BLOCK_SIZE_DEFAULT 1048576,
// AIO_QUEUE_DEPTH_DEFAULT 8, AIO_SINGLE_SUBMIT_DEFAULT False, AIO_OVERLAP_EVENTS_DEFAULT True).
// DeepSpeed's thread_count (intra_op_parallelism in later versions) has no counterpart: one
// io_uring keeps queue_depth requests in flight, which is what DeepSpeed's threads are for.
struct AioConfig {
  uint64_t block_size = 1048576;  // bytes per I/O request: a multiple of 4096, at most 1 GiB
  uint32_t queue_depth = 8;       // requests in flight at once (threads, for the thread pool)
  bool single_submit = false;     // io_uring: one submit syscall per request, not per batch
  bool overlap_events = true;     // io_uring: refill the queue on every completion, rather
                                  // than waiting for the whole batch of queue_depth requests
};

// automatic: io_uring, or the thread pool (logged once on stderr) where io_uring_queue_init
// fails with ENOSYS, EPERM or EACCES (old kernels, seccomp, io_uring_disabled). The other two
// force a backend; a forced io_uring that cannot start is an IoError.
enum class SwapBackend : uint8_t { automatic, io_uring, thread_pool };
std::string_view to_string(SwapBackend b);

struct SwapperOptions {
  std::string dir;  // an existing directory on the NVMe drive (zero-run --nvme-path)
  int rank = 0;     // names the files: <dir>/rank<rank>.<name>.swp
  AioConfig aio;
  SwapBackend backend = SwapBackend::automatic;
};

struct SwapFile {
  uint32_t id = 0;
};
struct SwapTicket {
  uint64_t id = 0;
};

// Requests and logical bytes handed to the swapper so far (what the runtime reports as NVMe
// traffic). A read or write counts once, however many block-sized I/Os it takes.
struct SwapStats {
  uint64_t n_reads = 0, n_writes = 0;
  uint64_t bytes_read = 0, bytes_written = 0;
};

class Swapper {
 public:
  // Checks the config and the directory and starts the backend (one io_uring completion
  // thread, or queue_depth pool threads).
  explicit Swapper(SwapperOptions options);
  // Waits for every request in flight (errors are dropped: a destructor cannot report
  // them), then removes every swap file it still has open.
  ~Swapper();
  Swapper(const Swapper&) = delete;
  Swapper& operator=(const Swapper&) = delete;

  // The buffer capacity an I/O of `bytes` needs, and the disk bytes a swap file of `bytes`
  // takes: `bytes` rounded up to 4096. O_DIRECT moves whole 4096-byte blocks, so the last
  // block of a request that is not a multiple of 4096 is padded inside the caller's buffer:
  // a write stores the buffer's bytes in [bytes, padded_bytes) to the file as they are, a
  // read overwrites them. Only [0, bytes) round-trips; the caller owns the padding.
  static uint64_t padded_bytes(uint64_t bytes);

  // Creates <dir>/rank<rank>.<name>.swp (O_EXCL, mode 0600, O_DIRECT) and reserves
  // padded_bytes(size_bytes) on disk with fallocate, so a full drive fails here rather than
  // in the middle of a step. name: letters, digits, '.', '_', '-'.
  SwapFile open(std::string_view name, uint64_t size_bytes);
  // Removes the file. Its requests must be complete (waited for). Throws IoError if the
  // file was removed or replaced underneath (a path it no longer owns is left alone).
  void close(SwapFile file);
  const std::string& path(SwapFile file) const;
  uint64_t size_bytes(SwapFile file) const;

  // Start an I/O of `bytes` at `offset` and return at once. offset and buffer: multiples of
  // 4096; offset + bytes <= size_bytes(file); the buffer's capacity >= padded_bytes(bytes)
  // and it must stay alive and untouched until the ticket is waited for.
  SwapTicket write(SwapFile file, uint64_t offset, const void* buffer, uint64_t bytes);
  SwapTicket read(SwapFile file, uint64_t offset, void* buffer, uint64_t bytes);
  // Block (on a condition variable, no spinning) until the request is done; throws its
  // IoError ("read <path> at offset N: ...") if it failed. A ticket is waited for once.
  void wait(SwapTicket ticket);
  // Wait for every request not yet waited for; throws the first failure, if any.
  void wait_all();

  SwapBackend backend() const;  // io_uring or thread_pool, never automatic
  const AioConfig& aio() const;
  SwapStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A caller-owned host buffer: data 4096-aligned, capacity in bytes.
struct HostBuffer {
  std::byte* data = nullptr;
  uint64_t capacity_bytes = 0;
};

// One file's region in a lockstep pipeline run: offset_bytes a multiple of 4096.
struct SwapRegion {
  SwapFile file;
  uint64_t offset_bytes = 0;
};

// ZeRO-Infinity's pipelined optimizer swapper (Rajbhandari et al. 2021, "overlap-centric
// design"; DeepSpeed's pipelined_optimizer_swapper.py with pipeline_read and pipeline_write):
// streams regions of swap files through a fixed set of host buffers, chunk by chunk, so
// that with 3 buffer sets chunk k+1 is read while the callback processes chunk k while chunk
// k-1 is written back. With n sets, reads run max(1, n - 2) chunks ahead; with 2, reads still
// overlap the callback but a write must end before the next read may reuse its buffers.
// Several files run in lockstep (the optimizer's master weights and both Adam moments): a
// buffer set holds one buffer per file, and the callback sees chunk k of every file at once.
class ChunkPipeline {
 public:
  static constexpr uint32_t kDefaultBuffers = 3;
  using ChunkFn = std::function<void(std::span<std::byte> chunk, uint64_t offset_in_region)>;
  // chunks[f]: chunk k of regions[f]; all the same length.
  using LockstepFn =
      std::function<void(std::span<const std::span<std::byte>> chunks, uint64_t offset_in_region)>;

  // The host bytes the pipeline needs, exactly: n_buffers sets of n_files buffers of
  // chunk_bytes each (chunk_bytes is a multiple of 4096, so no padding). Nothing else is
  // allocated per chunk.
  static uint64_t host_bytes(uint64_t chunk_bytes, uint32_t n_buffers = kDefaultBuffers,
                             uint32_t n_files = 1);

  // One file: chunk_bytes a multiple of 4096; buffers: at least 2, each 4096-aligned with
  // capacity >= chunk_bytes. The swapper and the buffers must outlive the pipeline.
  ChunkPipeline(Swapper& swapper, uint64_t chunk_bytes, std::vector<HostBuffer> buffers);
  // n_files in lockstep: buffers set-major, buffers[set * n_files + file], at least 2 sets.
  ChunkPipeline(Swapper& swapper, uint64_t chunk_bytes, uint32_t n_files,
                std::vector<HostBuffer> buffers);

  // Streams [region_offset, region_offset + region_bytes) of `file` (region_offset a multiple
  // of 4096; the last chunk may be short). Each chunk is read, passed to fn, and written back
  // in place. If fn or an I/O throws, every request in flight is waited for before the
  // exception leaves (the buffers are never left under the kernel). Needs n_files() == 1.
  void run(SwapFile file, uint64_t region_offset, uint64_t region_bytes, const ChunkFn& fn);
  // The same over n_files() regions of region_bytes each, in lockstep.
  void run(std::span<const SwapRegion> regions, uint64_t region_bytes, const LockstepFn& fn);

  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint32_t n_buffers() const { return static_cast<uint32_t>(buffers_.size() / n_files_); }
  uint32_t n_files() const { return n_files_; }

 private:
  Swapper& swapper_;
  uint64_t chunk_bytes_;
  uint32_t n_files_;
  std::vector<HostBuffer> buffers_;
};

}  // namespace zp::runtime
