// zp/runtime/comm.hpp: the collectives the ZeRO engine needs, across the data-parallel ranks:
// all-reduce, reduce to one rank, all-gather, broadcast, barrier. The mpi backend is Open MPI
// (also what bootstraps NCCL); 16-bit sums use an MPI reduction op that adds in fp32 and
// rounds once per pair. No home-made transport: ranks across machines are MPI's job.
// Reduce and all-gather also come non-blocking (ireduce_sum, iall_gather): they return a
// CommRequest, and the result is there only after its wait(); the blocking forms are issue +
// wait, so both give the same bits.
//
// Example usage:
//   MpiSession mpi(&argc, &argv);                // MPI_Init .. MPI_Finalize
//   auto comm = make_mpi_comm();
//   comm->all_reduce_sum(grads, n, DType::bf16); // in place, every rank gets the sum
//   CommRequest r = comm->ireduce_sum(bucket, n, DType::bf16, 0);
//   ...                                          // compute that does not touch bucket
//   r.wait();                                    // now rank 0's bucket holds the sum
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "zp/runtime/dtype.hpp"

namespace zp::runtime {

// A collective in flight. Until wait() returns, its buffers must stay alive and untouched (no
// reads of the result, no writes of the input, no free): the backend may still be reading or
// writing them. wait() completes it: the mpi backend blocks until MPI is done (MPI_Waitall);
// the nccl backend makes the device's compute stream wait for it (no host synchronisation),
// so work enqueued afterwards sees the result. Waiting twice is a no-op; a default-made
// request is complete. A request destroyed while in flight is waited for (its errors
// dropped): a collective is never abandoned under a buffer that goes back to the arena.
class CommRequest {
 public:
  CommRequest() = default;
  // `complete` runs once, at the first wait() (or destruction).
  explicit CommRequest(std::function<void()> complete) : complete_(std::move(complete)) {}
  CommRequest(CommRequest&& o) noexcept : complete_(std::exchange(o.complete_, nullptr)) {}
  CommRequest& operator=(CommRequest&& o) noexcept {
    if (this != &o) {
      drop();
      complete_ = std::exchange(o.complete_, nullptr);
    }
    return *this;
  }
  CommRequest(const CommRequest&) = delete;
  CommRequest& operator=(const CommRequest&) = delete;
  ~CommRequest() { drop(); }

  void wait() {
    if (auto f = std::exchange(complete_, nullptr)) f();
  }
  bool pending() const { return static_cast<bool>(complete_); }

 private:
  std::function<void()> complete_;
  void drop() noexcept {
    try {
      wait();
    } catch (...) {  // already failing: the first error is the one reported
    }
  }
};

// One reduction of a group: buf[0, n) summed into rank `root`'s buf.
struct ReduceSegment {
  void* buf = nullptr;
  uint64_t n = 0;
  int root = 0;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Ranks on this machine (to share its cores), and this rank's index among them (which GPU
  // of the node it takes).
  virtual int local_size() const = 0;
  virtual int local_rank() const = 0;

  // In place: every rank ends with the element-wise sum.
  virtual void all_reduce_sum(void* buf, uint64_t n, DType t) = 0;
  // The sum lands in `root`'s buf (in place there); other ranks' buf is left as it was.
  void reduce_sum(void* buf, uint64_t n, DType t, int root) { ireduce_sum(buf, n, t, root).wait(); }
  // recv (size * n elements) gets every rank's `send` block in rank order.
  void all_gather(const void* send, void* recv, uint64_t n, DType t) {
    iall_gather(send, recv, n, t).wait();
  }
  // The same, non-blocking: done at the request's wait(), buffers untouched until then (see
  // CommRequest). Every rank issues the same collectives in the same order.
  virtual CommRequest ireduce_sum(void* buf, uint64_t n, DType t, int root) = 0;
  virtual CommRequest iall_gather(const void* send, void* recv, uint64_t n, DType t) = 0;
  // Several reductions issued together (a gradient bucket's segments, each to its owner),
  // all done at the one request's wait(). This default issues them one by one through
  // ireduce_sum; NCCL launches them as one group with one completion event.
  virtual CommRequest ireduce_sum_group(const std::vector<ReduceSegment>& segs, DType t);
  // In place: rank r's block of counts[r] elements sits at the sum of counts before r.
  virtual void all_gather_in_place(void* buf, const std::vector<uint64_t>& counts, DType t) = 0;
  virtual void broadcast(void* buf, uint64_t bytes, int root) = 0;
  // Rank 0 receives every rank's `n` values, in rank order (send of n, recv of size * n).
  virtual void gather_u64(const uint64_t* send, uint64_t* recv, int n) = 0;
  virtual double all_reduce_sum(double v) = 0;
  virtual void barrier() = 0;
  // Sub-communicators (MPI_Comm_split): the ranks that pass the same color, ranked by key (ties
  // by rank here). Every rank of this communicator calls it. Expert parallelism's groups:
  // color rank / ep (the ep ranks that share tokens) and rank % ep (the dp / ep ranks that hold
  // the same experts, DeepSpeed-MoE's expert-data-parallel group).
  virtual std::unique_ptr<Comm> split(int color, int key);
  // All-to-all with per-rank counts (MPI_Alltoallv): send_counts[r] elements go to rank r,
  // taken from `send` at the sum of the counts before r; recv_counts[r] elements arrive from
  // rank r, placed in rank order. Both count vectors have size() entries.
  virtual void all_to_all_v(const void* send, const std::vector<uint64_t>& send_counts, void* recv,
                            const std::vector<uint64_t>& recv_counts, DType t);
  // n values to every rank, n from every rank: recv[r n, (r + 1) n) from rank r (MPI_Alltoall).
  virtual void all_to_all_u64(const uint64_t* send, uint64_t* recv, int n);
  // Ends every rank of the job with `code` (after an error on one rank).
  [[noreturn]] virtual void abort(int code) = 0;
};

// MPI_Init_thread / MPI_Finalize for the life of main(); a process started without mpirun is
// a job of one rank.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
};

std::unique_ptr<Comm> make_mpi_comm();

}  // namespace zp::runtime
