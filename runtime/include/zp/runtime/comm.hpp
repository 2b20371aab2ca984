// zp/runtime/comm.hpp: the collectives the ZeRO engine needs, across the data-parallel ranks:
// all-reduce, reduce to one rank, all-gather, broadcast, barrier. The mpi backend is Open MPI
// (also what bootstraps NCCL); 16-bit sums use an MPI reduction op that adds in fp32 and
// rounds once per pair. No home-made transport: ranks across machines are MPI's job.
//
// Example usage:
//   MpiSession mpi(&argc, &argv);                // MPI_Init .. MPI_Finalize
//   auto comm = make_mpi_comm();
//   comm->all_reduce_sum(grads, n, DType::bf16); // in place, every rank gets the sum
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "zp/runtime/dtype.hpp"

namespace zp::runtime {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Ranks on this machine (to share its cores).
  virtual int local_size() const = 0;

  // In place: every rank ends with the element-wise sum.
  virtual void all_reduce_sum(void* buf, uint64_t n, DType t) = 0;
  // The sum lands in `root`'s buf (in place there); other ranks' buf is left as it was.
  virtual void reduce_sum(void* buf, uint64_t n, DType t, int root) = 0;
  // recv (size * n elements) gets every rank's `send` block in rank order.
  virtual void all_gather(const void* send, void* recv, uint64_t n, DType t) = 0;
  // In place: rank r's block of counts[r] elements sits at the sum of counts before r.
  virtual void all_gather_in_place(void* buf, const std::vector<uint64_t>& counts, DType t) = 0;
  virtual void broadcast(void* buf, uint64_t bytes, int root) = 0;
  // Rank 0 receives every rank's `n` values, in rank order (send of n, recv of size * n).
  virtual void gather_u64(const uint64_t* send, uint64_t* recv, int n) = 0;
  virtual double all_reduce_sum(double v) = 0;
  virtual void barrier() = 0;
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
