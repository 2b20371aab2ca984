// comm_nccl.cpp: the Comm seam over NCCL for the CUDA device. Bootstrap: rank 0's ncclUniqueId
// goes to every rank over MPI, then ncclCommInitRank (the standard way; mpirun across nodes
// just works). Collectives on device buffers run on the device's comm stream, which waits for
// the compute stream's earlier work, and the compute stream waits for them in turn: the host
// never blocks. ireduce_sum and iall_gather leave the compute stream free until their
// request's wait (the compute stream then waits on an event recorded after the collective),
// so backward overlaps the gradient reduction and forward the prefetched all-gathers; the
// blocking forms are the same plus wait. Host-side collectives (the double all-reduce,
// gather_u64, barrier, abort, and any buffer in host memory) go over MPI. Not a transport of
// our own.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cuda_check.hpp"
#include "device_cuda.hpp"
#include "nccl_types.hpp"
#include "zp/error.hpp"
#include "zp/runtime/async_watch.hpp"

namespace zp::runtime {

namespace cuda {

void throw_nccl_error(ncclResult_t rc, const char* call, const char* file, int line) {
  const char* last = ncclGetLastError(nullptr);
  throw Error(fmt::format("{} failed at {}:{}: {}{}{}", call, file, line, ncclGetErrorString(rc),
                          last && *last ? ": " : "", last ? last : ""),
              rc == ncclSystemError || rc == ncclRemoteError
                  ? "a peer or the network failed: NCCL_DEBUG=INFO shows which (check "
                    "NCCL_SOCKET_IFNAME / NCCL_IB_HCA on multi-node runs)"
                  : "NCCL_DEBUG=INFO shows what NCCL saw");
}

namespace {

// What failed asynchronously on comm, or "" while it is healthy (ncclInProgress is a
// non-blocking communicator's normal state, not a failure).
std::string nccl_async_error(ncclComm_t comm) {
  ncclResult_t r = ncclSuccess;
  const ncclResult_t q = ncclCommGetAsyncError(comm, &r);
  if (q != ncclSuccess) r = q;
  if (r == ncclSuccess || r == ncclInProgress) return {};
  const char* last = ncclGetLastError(comm);
  return fmt::format("{}{}{}", ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "");
}

// ncclCommAbort ends this rank's NCCL kernels, so the streams behind them drain. Since NCCL
// 2.16 it can itself block on peers of the node (NVIDIA/nccl#863): it runs on a thread of its
// own, and after 10 s the rank goes on to report its error anyway (MPI then ends the job).
void abort_bounded(ncclComm_t comm) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> f = done->get_future();
  std::thread([comm, done] {
    ncclCommAbort(comm);
    done->set_value();
  }).detach();
  f.wait_for(std::chrono::seconds(10));
}

// ncclGroupStart .. ncclGroupEnd: an error between them still closes the group (else every
// later NCCL call of the thread would queue into a group never launched).
class GroupGuard {
 public:
  GroupGuard() { ZP_NCCL_CHECK(ncclGroupStart()); }
  ~GroupGuard() {
    if (open_) ncclGroupEnd();
  }
  GroupGuard(const GroupGuard&) = delete;
  GroupGuard& operator=(const GroupGuard&) = delete;
  void end() {
    open_ = false;
    ZP_NCCL_CHECK(ncclGroupEnd());
  }

 private:
  bool open_ = true;
};

class NcclComm final : public Comm {
 public:
  NcclComm(CudaDevice& dev, Comm& mpi) : dev_(dev), mpi_(mpi) {
    // Rank 0's ncclGetUniqueId result travels with the id: when it fails (a wrong
    // NCCL_SOCKET_IFNAME, say), every rank throws the same error here instead of the others
    // waiting in the broadcast for an id that never comes.
    struct {
      int32_t rc = ncclSuccess;
      ncclUniqueId id{};
    } boot;
    if (mpi.rank() == 0) boot.rc = ncclGetUniqueId(&boot.id);
    mpi.broadcast(&boot, sizeof(boot), 0);  // host memory: over MPI
    if (boot.rc != ncclSuccess)
      throw_nccl_error(static_cast<ncclResult_t>(boot.rc), "ncclGetUniqueId (on rank 0)", __FILE__,
                       __LINE__);
    // Every rank has its id before any enters the blocking ncclCommInitRank (with HCOLL, a
    // broadcast not yet progressed on a peer can otherwise deadlock it; NVIDIA/cuDecomp#24).
    mpi.barrier();
    ZP_CUDA_CHECK(cudaSetDevice(dev.device_index()));
    ZP_NCCL_CHECK(ncclCommInitRank(&comm_, mpi.size(), boot.id, mpi.rank()));
    watch_ = std::make_unique<AsyncWatch>(
        mpi.rank(), "NCCL", [c = comm_] { return nccl_async_error(c); },
        [c = comm_] { abort_bounded(c); });
    dev_.set_async_watch(watch_.get());
  }
  ~NcclComm() override {
    dev_.set_async_watch(nullptr);
    bool aborted = watch_->failed();
    if (!aborted) {
      try {  // the comm stream's last collectives, polled: a dead peer must not hang the exit
        wait_until([&] { return cudaStreamQuery(dev_.stream(Stream::comm)) != cudaErrorNotReady; },
                   watch_.get());
      } catch (const std::exception&) {
        aborted = true;  // the watch aborted the communicator
      }
    }
    if (!aborted) ncclCommDestroy(comm_);
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return mpi_.rank(); }
  int size() const override { return mpi_.size(); }
  int local_size() const override { return mpi_.local_size(); }
  int local_rank() const override { return mpi_.local_rank(); }

  void all_reduce_sum(void* buf, uint64_t n, DType t) override {
    if (!dev_.on_device(buf)) return mpi_.all_reduce_sum(buf, n, t);
    ordered([&](cudaStream_t s) {
      ZP_NCCL_CHECK(ncclAllReduce(buf, buf, n, nccl_type(t), ncclSum, comm_, s));
    });
  }

  // In place on the root; NCCL only reads the other ranks' buffers. Non-blocking: the
  // compute stream waits for it at the request's wait().
  CommRequest ireduce_sum(void* buf, uint64_t n, DType t, int root) override {
    if (!dev_.on_device(buf)) return mpi_.ireduce_sum(buf, n, t, root);
    return issued([&](cudaStream_t s) {
      ZP_NCCL_CHECK(ncclReduce(buf, buf, n, nccl_type(t), ncclSum, root, comm_, s));
    });
  }

  // A bucket's reductions in one NCCL group on the comm stream, behind one event. Segments in
  // host memory (none in the engine's use) go over MPI, each with its own request.
  CommRequest ireduce_sum_group(const std::vector<ReduceSegment>& segs, DType t) override {
    const bool device = std::all_of(segs.begin(), segs.end(),
                                    [&](const ReduceSegment& g) { return dev_.on_device(g.buf); });
    if (!device) return Comm::ireduce_sum_group(segs, t);
    return issued([&](cudaStream_t s) {
      GroupGuard group;
      for (const ReduceSegment& g : segs)
        ZP_NCCL_CHECK(ncclReduce(g.buf, g.buf, g.n, nccl_type(t), ncclSum, g.root, comm_, s));
      group.end();
    });
  }

  CommRequest iall_gather(const void* send, void* recv, uint64_t n, DType t) override {
    if (!dev_.on_device(recv)) return mpi_.iall_gather(send, recv, n, t);
    return issued([&](cudaStream_t s) {
      ZP_NCCL_CHECK(ncclAllGather(send, recv, n, nccl_type(t), comm_, s));
    });
  }

  // Equal blocks: NCCL's in-place all-gather (send = recv + rank * n). Unequal blocks (NCCL
  // has no all-gather-v): one in-place broadcast per rank from its block, in one group.
  void all_gather_in_place(void* buf, const std::vector<uint64_t>& counts, DType t) override {
    if (counts.size() != static_cast<std::size_t>(size()))
      throw Error(fmt::format("all_gather_in_place: {} counts for {} ranks", counts.size(), size()));
    if (!dev_.on_device(buf)) return mpi_.all_gather_in_place(buf, counts, t);
    const std::size_t eb = dtype_bytes(t);
    auto* base = static_cast<std::byte*>(buf);
    const bool equal =
        std::all_of(counts.begin(), counts.end(), [&](uint64_t c) { return c == counts[0]; });
    ordered([&](cudaStream_t s) {
      if (equal) {
        ZP_NCCL_CHECK(ncclAllGather(base + static_cast<uint64_t>(rank()) * counts[0] * eb, buf,
                                    counts[0], nccl_type(t), comm_, s));
        return;
      }
      GroupGuard group;
      uint64_t off = 0;
      for (std::size_t r = 0; r < counts.size(); ++r) {
        std::byte* block = base + off * eb;
        if (counts[r] > 0)
          ZP_NCCL_CHECK(ncclBroadcast(block, block, counts[r], nccl_type(t), static_cast<int>(r),
                                      comm_, s));
        off += counts[r];
      }
      group.end();
    });
  }

  void broadcast(void* buf, uint64_t bytes, int root) override {
    if (!dev_.on_device(buf)) return mpi_.broadcast(buf, bytes, root);
    ordered([&](cudaStream_t s) { ZP_NCCL_CHECK(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, s)); });
  }

  void gather_u64(const uint64_t* send, uint64_t* recv, int n) override { mpi_.gather_u64(send, recv, n); }
  double all_reduce_sum(double v) override { return mpi_.all_reduce_sum(v); }
  void barrier() override { mpi_.barrier(); }

  // MPI ends every rank, this one's NCCL work with it; no ncclCommAbort first, which can block
  // on the node's peers (NVIDIA/nccl#863).
  [[noreturn]] void abort(int code) override {
    mpi_.abort(code);
    std::_Exit(code);  // not reached: MPI's abort ends the process
  }

 private:
  // One collective's ordering: the comm stream waits for the compute stream's work so far
  // (which may still write the buffer), and the compute stream's later work waits for it. The
  // compute stream so waits for every collective queued before, prefetched all-gathers too,
  // not only this one; kept (the blocking collectives are the stage 0-2 all-reduce and
  // all-gather at the step's end, where nothing else is in flight).
  template <class F>
  void ordered(F&& enqueue) {
    dev_.order(Stream::comm, Stream::compute);
    enqueue(dev_.stream(Stream::comm));
    dev_.order(Stream::compute, Stream::comm);
  }

  // A non-blocking collective: the comm stream waits for the compute stream's work so far
  // (recorded now, at issue), runs it, and records an event after it; the request's wait
  // makes the compute stream wait for that event (cudaStreamWaitEvent: the host never
  // blocks). Until then compute runs on beside the collective, which is why its buffers must
  // stay untouched until wait (CommRequest).
  template <class F>
  CommRequest issued(F&& enqueue) {
    // The event first: once the collective is enqueued, nothing may fail before a request
    // owns its completion (else the engine frees buffers a collective still uses).
    cudaEvent_t done = nullptr;
    ZP_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    try {
      dev_.order(Stream::comm, Stream::compute);
      enqueue(dev_.stream(Stream::comm));
    } catch (...) {
      cudaEventDestroy(done);
      throw;
    }
    const cudaStream_t s = dev_.stream(Stream::comm);
    const cudaStream_t compute = dev_.stream(Stream::compute);
    // The request owns the event from here (a failed record below still destroys it).
    CommRequest req([done, compute] {
      const cudaError_t rc = cudaStreamWaitEvent(compute, done, 0);
      cudaEventDestroy(done);  // CUDA releases it once the wait enqueued above is resolved
      if (rc != cudaSuccess)
        throw_cuda_error(rc, "cudaStreamWaitEvent(compute, done, 0)", __FILE__, __LINE__);
    });
    ZP_CUDA_CHECK(cudaEventRecord(done, s));
    return req;
  }

  CudaDevice& dev_;
  Comm& mpi_;
  ncclComm_t comm_ = nullptr;
  std::unique_ptr<AsyncWatch> watch_;
};

}  // namespace
}  // namespace cuda

std::unique_ptr<Comm> make_nccl_comm(Device& dev, Comm& mpi) {
  auto* d = dynamic_cast<cuda::CudaDevice*>(&dev);
  if (d == nullptr)
    throw Error(fmt::format("make_nccl_comm: the {} device is not a CUDA device", dev.name()),
                "NCCL runs on GPUs: use make_mpi_comm for the cpu backend");
  return std::make_unique<cuda::NcclComm>(*d, mpi);
}

}  // namespace zp::runtime
