// comm_mpi.cpp: the Comm seam over Open MPI. Counts above INT_MAX are sent in chunks; fp16 and
// bf16 sums use user-defined MPI reduction ops (fp32 add, round to nearest even). Reduce and
// all-gather are MPI's nonblocking collectives; their requests wait with MPI_Waitall.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "zp/error.hpp"
#include "zp/runtime/comm.hpp"

namespace zp::runtime {

// The default group: each segment's own request, all completed at the group's wait.
CommRequest Comm::ireduce_sum_group(const std::vector<ReduceSegment>& segs, DType t) {
  auto reqs = std::make_shared<std::vector<CommRequest>>();
  reqs->reserve(segs.size());
  for (const ReduceSegment& g : segs) reqs->push_back(ireduce_sum(g.buf, g.n, t, g.root));
  return CommRequest([reqs] {
    for (CommRequest& r : *reqs) r.wait();
  });
}

// Communicators without sub-groups or all-to-all (NCCL's, for now; test doubles) refuse them.
std::unique_ptr<Comm> Comm::split(int, int) {
  throw Error("this communicator cannot be split into sub-groups",
              "expert parallelism runs over MPI (the cpu backend) so far");
}
void Comm::all_to_all_v(const void*, const std::vector<uint64_t>&, void*, const std::vector<uint64_t>&,
                        DType) {
  throw Error("this communicator has no all-to-all", "expert parallelism runs over MPI (the cpu backend) so far");
}
void Comm::all_to_all_u64(const uint64_t*, uint64_t*, int) {
  throw Error("this communicator has no all-to-all", "expert parallelism runs over MPI (the cpu backend) so far");
}

namespace {

// One check for every MPI call: the call as written, where, and MPI's own message.
void mpi_check(int rc, const char* call, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw Error(fmt::format("{} failed at {}:{}: {}", call, file, line, msg),
              "a rank may have died; see the other ranks' errors");
}
#define ZP_MPI_CHECK(call) mpi_check((call), #call, __FILE__, __LINE__)

template <uint16_t (*Store)(float), float (*Load)(uint16_t)>
void sum16(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Store(Load(a[i]) + Load(b[i]));
}

class MpiComm final : public Comm {
 public:
  // MPI_COMM_WORLD, or (owned) a communicator split from it.
  explicit MpiComm(MPI_Comm comm = MPI_COMM_WORLD, bool owned = false) : comm_(comm), owned_(owned) {
    ZP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    ZP_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    ZP_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    MPI_Comm local;
    ZP_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local));
    ZP_MPI_CHECK(MPI_Comm_size(local, &local_size_));
    ZP_MPI_CHECK(MPI_Comm_rank(local, &local_rank_));
    ZP_MPI_CHECK(MPI_Comm_free(&local));
    ZP_MPI_CHECK(MPI_Op_create(&sum16<fp32_to_fp16, fp16_to_fp32>, 1, &sum_fp16_));
    ZP_MPI_CHECK(MPI_Op_create(&sum16<fp32_to_bf16, bf16_to_fp32>, 1, &sum_bf16_));
  }
  ~MpiComm() override {
    MPI_Op_free(&sum_fp16_);
    MPI_Op_free(&sum_bf16_);
    if (owned_) MPI_Comm_free(&comm_);
  }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  std::unique_ptr<Comm> split(int color, int key) override {
    if (color < 0)
      throw Error(fmt::format("Comm::split: color {} is negative", color), "pass a color >= 0");
    MPI_Comm out = MPI_COMM_NULL;
    ZP_MPI_CHECK(MPI_Comm_split(comm_, color, key, &out));
    return std::make_unique<MpiComm>(out, true);
  }

  void all_to_all_v(const void* send, const std::vector<uint64_t>& send_counts, void* recv,
                    const std::vector<uint64_t>& recv_counts, DType t) override {
    const auto n = static_cast<std::size_t>(size_);
    if (send_counts.size() != n || recv_counts.size() != n)
      throw Error(fmt::format("all_to_all_v: {} send and {} receive counts for {} ranks",
                              send_counts.size(), recv_counts.size(), size_),
                  "pass one count per rank of the communicator");
    // MPI_Alltoallv takes int counts and displacements (in elements): refuse what does not fit.
    auto ints = [&](const std::vector<uint64_t>& counts, std::vector<int>& cnt, std::vector<int>& dsp) {
      uint64_t at = 0;
      for (std::size_t r = 0; r < n; ++r) {
        if (counts[r] > static_cast<uint64_t>(INT_MAX) || at > static_cast<uint64_t>(INT_MAX))
          throw Error(fmt::format("all_to_all_v: {} elements at offset {} pass MPI's int range",
                                  counts[r], at),
                      "fewer tokens per micro-batch, or more expert-parallel ranks");
        cnt[r] = static_cast<int>(counts[r]);
        dsp[r] = static_cast<int>(at);
        at += counts[r];
      }
    };
    std::vector<int> sc(n), sd(n), rc(n), rd(n);
    ints(send_counts, sc, sd);
    ints(recv_counts, rc, rd);
    ZP_MPI_CHECK(MPI_Alltoallv(send, sc.data(), sd.data(), type(t), recv, rc.data(), rd.data(), type(t),
                               comm_));
  }

  void all_to_all_u64(const uint64_t* send, uint64_t* recv, int n) override {
    ZP_MPI_CHECK(MPI_Alltoall(send, n, MPI_UINT64_T, recv, n, MPI_UINT64_T, comm_));
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_size() const override { return local_size_; }
  int local_rank() const override { return local_rank_; }

  void all_reduce_sum(void* buf, uint64_t n, DType t) override {
    chunked(buf, n, t, [&](void* p, int count) {
      ZP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, p, count, type(t), op(t), comm_));
    });
  }

  // MPI_Ireduce / MPI_Iallgather, one per chunk; the request's wait is MPI_Waitall. The
  // blocking reduce_sum and all_gather are these plus wait, so overlapped and blocking runs
  // reduce in the same order (the user-defined 16-bit ops work with nonblocking collectives).
  CommRequest ireduce_sum(void* buf, uint64_t n, DType t, int root) override {
    std::vector<MPI_Request> reqs;
    chunked(buf, n, t, [&](void* p, int count) {
      MPI_Request r = MPI_REQUEST_NULL;
      if (rank_ == root)
        ZP_MPI_CHECK(MPI_Ireduce(MPI_IN_PLACE, p, count, type(t), op(t), root, comm_, &r));
      else
        ZP_MPI_CHECK(MPI_Ireduce(p, nullptr, count, type(t), op(t), root, comm_, &r));
      reqs.push_back(r);
    });
    return waiting_for(std::move(reqs));
  }

  CommRequest iall_gather(const void* send, void* recv, uint64_t n, DType t) override {
    std::vector<MPI_Request> reqs;
    if (n <= kMaxCount) {
      MPI_Request r = MPI_REQUEST_NULL;
      ZP_MPI_CHECK(MPI_Iallgather(send, static_cast<int>(n), type(t), recv, static_cast<int>(n),
                                  type(t), comm_, &r));
      reqs.push_back(r);
      return waiting_for(std::move(reqs));
    }
    // Large blocks: one all-gather per chunk into a strided view of recv. Freeing a datatype
    // while a collective uses it is allowed: MPI frees it once that collective is done.
    const std::size_t eb = dtype_bytes(t);
    for (uint64_t off = 0; off < n; off += kMaxCount) {
      const int count = static_cast<int>(std::min<uint64_t>(kMaxCount, n - off));
      MPI_Datatype block, strided;
      ZP_MPI_CHECK(MPI_Type_contiguous(count, type(t), &block));
      ZP_MPI_CHECK(MPI_Type_create_resized(block, 0, static_cast<MPI_Aint>(n * eb), &strided));
      ZP_MPI_CHECK(MPI_Type_commit(&strided));
      MPI_Request r = MPI_REQUEST_NULL;
      ZP_MPI_CHECK(MPI_Iallgather(static_cast<const std::byte*>(send) + off * eb, count, type(t),
                                  static_cast<std::byte*>(recv) + off * eb, 1, strided,
                                  comm_, &r));
      reqs.push_back(r);
      ZP_MPI_CHECK(MPI_Type_free(&strided));
      ZP_MPI_CHECK(MPI_Type_free(&block));
    }
    return waiting_for(std::move(reqs));
  }

  void all_gather_in_place(void* buf, const std::vector<uint64_t>& counts, DType t) override {
    const std::size_t eb = dtype_bytes(t);
    std::vector<uint64_t> displs(counts.size(), 0);
    for (std::size_t r = 1; r < counts.size(); ++r) displs[r] = displs[r - 1] + counts[r - 1];
    // Chunk so every count and displacement fits an int: round c covers elements
    // [c*kMaxCount, (c+1)*kMaxCount) of each rank's block.
    const uint64_t longest = *std::max_element(counts.begin(), counts.end());
    for (uint64_t off = 0; off < std::max<uint64_t>(longest, 1); off += kMaxCount) {
      std::vector<int> cnt(counts.size()), dsp(counts.size());
      MPI_Datatype elem = type(t);
      // Displacements in bytes via a 1-byte type when they pass INT_MAX elements.
      for (std::size_t r = 0; r < counts.size(); ++r) {
        const uint64_t c = counts[r] > off ? std::min<uint64_t>(kMaxCount, counts[r] - off) : 0;
        cnt[r] = static_cast<int>(c);
        const uint64_t d = displs[r] + std::min(off, counts[r]);
        if (d > static_cast<uint64_t>(INT_MAX))
          throw Error(fmt::format("all-gather of {} elements: displacement {} passes MPI's int "
                                  "range", displs.back() + counts.back(), d),
                      "split the parameters over more ranks");
        dsp[r] = static_cast<int>(d);
      }
      ZP_MPI_CHECK(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, cnt.data(), dsp.data(),
                                  elem, comm_));
    }
    (void)eb;
  }

  void broadcast(void* buf, uint64_t bytes, int root) override {
    chunked(buf, bytes, DType::fp32, [&](void* p, int count) {
      ZP_MPI_CHECK(MPI_Bcast(p, count, MPI_BYTE, root, comm_));
    }, 1);
  }

  void gather_u64(const uint64_t* send, uint64_t* recv, int n) override {
    ZP_MPI_CHECK(MPI_Gather(send, n, MPI_UINT64_T, recv, n, MPI_UINT64_T, 0, comm_));
  }

  double all_reduce_sum(double v) override {
    double out = 0;
    ZP_MPI_CHECK(MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_SUM, comm_));
    return out;
  }

  void barrier() override { ZP_MPI_CHECK(MPI_Barrier(comm_)); }

  [[noreturn]] void abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);  // the whole job, whichever group failed
    std::_Exit(code);
  }

 private:
  static constexpr uint64_t kMaxCount = 1ULL << 30;
  MPI_Comm comm_ = MPI_COMM_WORLD;
  bool owned_ = false;
  int rank_ = 0, size_ = 1, local_size_ = 1, local_rank_ = 0;
  MPI_Op sum_fp16_ = MPI_OP_NULL, sum_bf16_ = MPI_OP_NULL;

  static CommRequest waiting_for(std::vector<MPI_Request> reqs) {
    return CommRequest([reqs = std::move(reqs)]() mutable {
      ZP_MPI_CHECK(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE));
    });
  }
  static MPI_Datatype type(DType t) { return t == DType::fp32 ? MPI_FLOAT : MPI_UINT16_T; }
  MPI_Op op(DType t) const {
    return t == DType::fp32 ? MPI_SUM : (t == DType::fp16 ? sum_fp16_ : sum_bf16_);
  }
  // Calls f(pointer, count) on pieces of at most kMaxCount elements of `elem_bytes` each.
  template <class F>
  void chunked(void* buf, uint64_t n, DType t, F&& f, std::size_t elem_bytes = 0) {
    const std::size_t eb = elem_bytes ? elem_bytes : dtype_bytes(t);
    for (uint64_t off = 0; off < n; off += kMaxCount)
      f(static_cast<std::byte*>(buf) + off * eb, static_cast<int>(std::min(kMaxCount, n - off)));
  }
};

}  // namespace

MpiSession::MpiSession(int* argc, char*** argv) {
  int provided = 0;
  ZP_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

std::unique_ptr<Comm> make_mpi_comm() { return std::make_unique<MpiComm>(); }

}  // namespace zp::runtime
