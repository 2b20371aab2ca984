// zp/runtime/async_watch.hpp: host waits that cannot hang on a dead peer. A collective library
// (NCCL) records a peer's or the network's failure asynchronously while its kernel keeps
// spinning, so a plain cudaStreamSynchronize behind it never returns. Every host wait of the
// CUDA device therefore polls: it asks the stream or event whether it is done and, between
// polls, asks the watch whether the communicator failed; on a failure the watch aborts the
// communicator once (which lets the spinning kernels end) and throws a zp::Error naming the
// rank, so zero-run's error path ends the job instead of hanging it. The pieces are plain
// functions, so a fake probe tests the path on a machine without a GPU.
//
// Example usage:
//   AsyncWatch watch(rank, "NCCL", [&] { return nccl_async_error(comm); },
//                    [&] { ncclCommAbort(comm); });
//   wait_until([&] { return cudaStreamQuery(s) == cudaSuccess; }, &watch);
#pragma once

#include <functional>
#include <string>

namespace zp::runtime {

class AsyncWatch {
 public:
  // probe(): "" while the communicator is healthy, else what failed (the library's words).
  // abort(): tears the communicator down; called at most once, before check() throws.
  AsyncWatch(int rank, std::string library, std::function<std::string()> probe,
             std::function<void()> abort);

  // Throws zp::Error ("rank R: <library> failed asynchronously: <what>", with a hint) once the
  // probe reports a failure, after aborting; later calls throw the same error again.
  void check();
  bool failed() const { return !failure_.empty(); }
  int polls() const { return polls_; }

 private:
  int rank_;
  std::string library_;
  std::function<std::string()> probe_;
  std::function<void()> abort_;
  std::string failure_;
  int polls_ = 0;
};

// Returns once ready() is true. While it is not, it yields the core between polls and asks
// watch->check() (when a watch is given) at the first poll that finds it not ready, then at
// most every poll_interval_us; ready() may throw its own errors.
void wait_until(const std::function<bool()>& ready, AsyncWatch* watch, int poll_interval_us = 200);

}  // namespace zp::runtime
