// swapper.cpp: the NVMe swapper. Requests are queued under one mutex and cut into
// block_size I/Os by whichever backend runs: one io_uring completion thread that keeps
// queue_depth I/Os in flight and sleeps in io_uring_wait_cqe (woken for new work by an
// eventfd poll inside the same ring), or queue_depth pread/pwrite threads. Callers sleep on a
// condition variable. Not an allocator and not a cache: it never copies the caller's bytes.
#include "zp/runtime/swapper.hpp"

#include <fcntl.h>
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "zp/checked.hpp"

namespace zp::runtime {

namespace {

constexpr uint64_t kMaxBlockBytes = uint64_t{1} << 30;  // io_uring lengths are 32-bit
constexpr uint32_t kMaxQueueDepth = 1024;
constexpr uint64_t kWakeTag = ~uint64_t{0};  // user_data of the eventfd poll in the ring

std::string errno_text(int code) {
  return std::generic_category().message(code);
}

// What to do about a failed open/fallocate/read/write, by errno.
std::string io_hint(int code) {
  switch (code) {
    case ENOSPC:
    case EDQUOT:
      return "the drive under --nvme-path is full: free space there or point --nvme-path at a "
             "drive with room for every rank's swap files";
    case EFBIG:
      return "the file is larger than the file-size limit (ulimit -f) or the file system's "
             "maximum: raise the limit or use another drive";
    case EIO:
      return "the drive reported an I/O error: check dmesg and the drive's health";
    case EINVAL:
      return "O_DIRECT refused the request: the file system may not support direct I/O (tmpfs "
             "before Linux 6.6, some network file systems) or its logical block is larger than "
             "4096 bytes; point --nvme-path at a local ext4 or xfs drive";
    case EACCES:
    case EPERM:
    case EROFS:
      return "--nvme-path must be a directory this user can write to";
    case EMFILE:
    case ENFILE:
      return "too many open files: raise ulimit -n";
    case EEXIST:
      return "a swap file of that name exists: another run with the same --nvme-path and rank "
             "is using it, or a killed run left it behind; remove it or choose another "
             "--nvme-path";
    default:
      return "check --nvme-path: it should be a local NVMe drive with room for the swap files";
  }
}

constexpr const char* kShortReadHint =
    "the swap file is shorter than the swapper made it: something truncated or replaced it "
    "underneath; the files in --nvme-path belong to this run alone";
constexpr const char* kShortWriteHint =
    "the file system took only part of the write: it is full or the file-size limit (ulimit -f) "
    "was reached; free space or point --nvme-path at a larger drive";

uint64_t round_up(uint64_t n, uint64_t to) {
  return checked_add(n, (to - n % to) % to, "swap bytes rounded up to 4096");
}

// Removes `path` if it is still the file (device, inode) we created. Returns 0, the errno of
// stat/unlink, or EEXIST when another file has taken the name (then it is left alone).
int remove_if_ours(const std::string& path, dev_t dev, ino_t ino) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return errno;
  if (st.st_dev != dev || st.st_ino != ino) return EEXIST;
  return ::unlink(path.c_str()) == 0 ? 0 : errno;
}

// Every swap file of this process that is still open, so that exit() removes them even when no
// destructor runs (std::exit from anywhere). Entries carry the pid: a forked child that exits
// must not remove its parent's files. Leaked on purpose: it must outlive static destructors.
class LiveFiles {
 public:
  static LiveFiles& get() {
    static LiveFiles* live = [] {
      auto* p = new LiveFiles;
      std::atexit(&LiveFiles::remove_all_at_exit);
      return p;
    }();
    return *live;
  }
  uint64_t add(const std::string& path, dev_t dev, ino_t ino) {
    std::lock_guard lk(mu_);
    files_.emplace(next_key_, Entry{path, dev, ino, ::getpid()});
    return next_key_++;
  }
  void remove(uint64_t key) {
    std::lock_guard lk(mu_);
    files_.erase(key);
  }

 private:
  struct Entry {
    std::string path;
    dev_t dev;
    ino_t ino;
    pid_t pid;
  };
  static void remove_all_at_exit() {
    LiveFiles& self = get();
    std::lock_guard lk(self.mu_);
    for (const auto& [key, e] : self.files_)
      if (e.pid == ::getpid()) remove_if_ours(e.path, e.dev, e.ino);
    self.files_.clear();
  }
  std::mutex mu_;
  std::map<uint64_t, Entry> files_;
  uint64_t next_key_ = 1;
};

enum class Op : uint8_t { read, write };
const char* op_name(Op op) {
  return op == Op::read ? "read" : "write";
}

bool valid_name(std::string_view name) {
  if (name.empty() || name == "." || name == "..") return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
}

}  // namespace

std::string_view to_string(SwapBackend b) {
  switch (b) {
    case SwapBackend::automatic:
      return "automatic";
    case SwapBackend::io_uring:
      return "io_uring";
    case SwapBackend::thread_pool:
      return "thread_pool";
  }
  return "?";
}

uint64_t Swapper::padded_bytes(uint64_t bytes) {
  return round_up(bytes, kSwapAlignBytes);
}

// ---------------------------------------------------------------------------------------------
// The shared core: files, tickets, the queue of requests.

struct Swapper::Impl {
  struct FileState {
    std::string path;
    int fd = -1;
    uint64_t size_bytes = 0;
    dev_t dev = 0;
    ino_t ino = 0;
    uint64_t live_key = 0;
    uint64_t n_incomplete = 0;  // its requests not yet complete
    bool open = false;
  };
  // One read or write as the caller asked for it; cut into blocks as the backend takes them.
  struct Request {
    uint64_t ticket;
    uint32_t file;
    Op op;
    std::byte* buf;
    uint64_t offset;
    uint64_t io_bytes;        // padded_bytes(bytes)
    uint64_t next_bytes = 0;  // bytes already handed to the backend
  };
  struct TicketState {
    uint32_t file = 0;
    uint64_t n_unfinished_blocks = 0;
    bool failed = false;
    int code = 0;
    std::string message, hint;
  };
  // One block-sized I/O handed to the backend.
  struct Block {
    uint64_t ticket = 0;
    uint32_t file = 0;
    int fd = -1;
    Op op = Op::read;
    std::byte* buf = nullptr;
    uint64_t offset = 0;
    uint32_t len = 0;
  };

  SwapperOptions opt;
  SwapBackend backend = SwapBackend::thread_pool;

  io_uring ring{};
  bool ring_ok = false;
  int wake_fd = -1;
  std::vector<std::thread> threads;

  mutable std::mutex mu;
  std::condition_variable cv_done;  // callers: a ticket completed
  std::condition_variable cv_work;  // pool threads: work queued, or stop
  std::deque<Request> pending;
  std::map<uint64_t, TicketState> tickets;  // not yet waited for
  uint64_t next_ticket = 1;
  uint64_t n_incomplete = 0;    // tickets not yet complete
  std::deque<FileState> files;  // a deque: path() hands out references that must stay valid
  SwapStats stats;
  bool stop = false;
  std::string broken;  // why the io_uring thread gave up; new requests are refused

  explicit Impl(SwapperOptions o) : opt(std::move(o)) {}
  ~Impl() { shutdown(); }

  void start();
  void init_ring();
  void shutdown() noexcept;
  void wake();

  FileState& file_locked(SwapFile f, const char* what);
  SwapTicket enqueue(Op op, SwapFile f, uint64_t offset, std::byte* buf, uint64_t bytes);
  bool next_block_locked(Block& b);
  void finish_block_locked(const Block& b, int res);
  void fail_locked(TicketState& t, int code, std::string message, std::string hint);
  void block_done_locked(TicketState& t, uint64_t n_blocks);

  void uring_loop();
  void pool_loop();
};

void Swapper::Impl::start() {
  const AioConfig& a = opt.aio;
  if (a.block_size < kSwapAlignBytes || a.block_size % kSwapAlignBytes != 0 ||
      a.block_size > kMaxBlockBytes)
    throw Error(fmt::format("aio.block_size: {} is not a multiple of 4096 between 4096 and {}",
                            a.block_size, kMaxBlockBytes),
                "use DeepSpeed's default 1048576 or another power of two >= 4096");
  if (a.queue_depth < 1 || a.queue_depth > kMaxQueueDepth)
    throw Error(fmt::format("aio.queue_depth: {} is outside 1..{}", a.queue_depth, kMaxQueueDepth),
                "use DeepSpeed's default 8");
  if (opt.dir.empty())
    throw Error("--nvme-path: empty", "name a directory on a local NVMe drive, e.g. /mnt/nvme");
  struct stat st {};
  ZP_IO_CHECK(::stat(opt.dir.c_str(), &st), fmt::format("--nvme-path {}", opt.dir),
              "create the directory, or point --nvme-path at a mounted NVMe drive");
  if (!S_ISDIR(st.st_mode))
    throw Error(fmt::format("--nvme-path {}: not a directory", opt.dir),
                "point --nvme-path at a directory; the swapper creates its files there");

  if (opt.backend != SwapBackend::thread_pool) {
    try {
      init_ring();
      backend = SwapBackend::io_uring;
    } catch (const IoError& e) {
      const bool refused = e.code() == ENOSYS || e.code() == EPERM || e.code() == EACCES;
      if (opt.backend != SwapBackend::automatic || !refused) throw;
      static std::once_flag logged;
      std::call_once(logged, [&] {
        std::fprintf(stderr,
                     "zp swapper: io_uring unavailable (%s); using a pread/pwrite thread pool "
                     "of %u threads\n",
                     e.what(), a.queue_depth);
      });
      backend = SwapBackend::thread_pool;
    }
  }
  if (backend == SwapBackend::io_uring) {
    threads.emplace_back([this] { uring_loop(); });
  } else {
    for (uint32_t i = 0; i < a.queue_depth; ++i) threads.emplace_back([this] { pool_loop(); });
  }
}

void Swapper::Impl::init_ring() {
  // queue_depth I/Os plus the eventfd poll that wakes the completion thread for new work.
  const unsigned entries = opt.aio.queue_depth + 1;
  ZP_IO_CHECK(io_uring_queue_init(entries, &ring, 0),
              fmt::format("io_uring_queue_init({} entries)", entries),
              errno == ENOMEM ? "raise the locked-memory limit (ulimit -l), or run with the "
                                "thread-pool backend"
                              : "this kernel or container refuses io_uring (seccomp, "
                                "kernel.io_uring_disabled, Linux < 5.1); use the automatic or "
                                "thread-pool backend");
  ring_ok = true;
  wake_fd = ZP_IO_CHECK(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC),
                        "eventfd for the io_uring completion thread", "raise ulimit -n");
}

void Swapper::Impl::wake() {
  if (backend == SwapBackend::io_uring) {
    ZP_IO_CHECK(::eventfd_write(wake_fd, 1), "wake the io_uring completion thread", "");
  } else {
    cv_work.notify_all();
  }
}

// Waits for everything in flight, stops the threads, closes the ring, removes the files.
void Swapper::Impl::shutdown() noexcept {
  {
    std::unique_lock lk(mu);
    cv_done.wait(lk, [&] { return n_incomplete == 0; });
    stop = true;
  }
  if (!threads.empty()) {
    if (backend == SwapBackend::io_uring) {
      ::eventfd_write(wake_fd, 1);
    } else {
      cv_work.notify_all();
    }
    for (auto& t : threads) t.join();
    threads.clear();
  }
  if (ring_ok) io_uring_queue_exit(&ring);
  ring_ok = false;
  if (wake_fd >= 0) ::close(wake_fd);
  wake_fd = -1;
  for (auto& f : files) {
    if (!f.open) continue;
    ::close(f.fd);
    remove_if_ours(f.path, f.dev, f.ino);
    LiveFiles::get().remove(f.live_key);
    f.open = false;
  }
}

Swapper::Impl::FileState& Swapper::Impl::file_locked(SwapFile f, const char* what) {
  if (f.id >= files.size() || !files[f.id].open)
    throw Error(fmt::format("{}: swap file #{} is not open", what, f.id),
                "use a SwapFile returned by this swapper's open(), before close()");
  return files[f.id];
}

SwapTicket Swapper::Impl::enqueue(Op op, SwapFile f, uint64_t offset, std::byte* buf,
                                  uint64_t bytes) {
  std::unique_lock lk(mu);
  if (!broken.empty())
    throw IoError(broken, "the kernel's io_uring failed; run with the thread-pool backend", EIO);
  FileState& fs = file_locked(f, op_name(op));
  const auto where = [&] {
    return fmt::format("{} {} at offset {}", op_name(op), fs.path, offset);
  };
  const char* align_hint =
      "O_DIRECT needs 4096-aligned buffers and offsets: allocate swap buffers from the arena "
      "(or AlignedBuffer in tests) and place partitions at multiples of 4096";
  if (offset % kSwapAlignBytes != 0)
    throw Error(fmt::format("{}: the offset is not a multiple of 4096", where()), align_hint);
  if (const auto addr = reinterpret_cast<uintptr_t>(buf); addr % kSwapAlignBytes != 0)
    throw Error(fmt::format("{}: buffer {} is not 4096-byte aligned (address % 4096 = {})", where(),
                            static_cast<const void*>(buf), addr % kSwapAlignBytes),
                align_hint);
  if (offset > fs.size_bytes || bytes > fs.size_bytes - offset)
    throw Error(fmt::format("{}: {} bytes run past the end of the file ({} bytes)", where(), bytes,
                            fs.size_bytes),
                "open the swap file with the partition's full size");

  const uint64_t id = next_ticket++;
  const uint64_t io_bytes = padded_bytes(bytes);
  const uint64_t n_blocks = io_bytes / opt.aio.block_size + (io_bytes % opt.aio.block_size != 0);
  TicketState& t = tickets[id];
  t.file = f.id;
  t.n_unfinished_blocks = n_blocks;
  if (op == Op::read) {
    ++stats.n_reads;
    stats.bytes_read += bytes;
  } else {
    ++stats.n_writes;
    stats.bytes_written += bytes;
  }
  if (n_blocks == 0) return SwapTicket{id};  // zero bytes: complete already
  ++n_incomplete;
  ++fs.n_incomplete;
  pending.push_back(Request{id, f.id, op, buf, offset, io_bytes});
  lk.unlock();
  wake();
  return SwapTicket{id};
}

// The next block of the oldest request; drops the rest of a request whose ticket has failed.
bool Swapper::Impl::next_block_locked(Block& b) {
  const uint64_t block = opt.aio.block_size;
  while (!pending.empty()) {
    Request& r = pending.front();
    TicketState& t = tickets.at(r.ticket);
    const uint64_t left = r.io_bytes - r.next_bytes;
    if (t.failed) {
      const uint64_t n_dropped = left / block + (left % block != 0);
      pending.pop_front();
      block_done_locked(t, n_dropped);
      continue;
    }
    const uint64_t len = std::min(block, left);
    b = Block{r.ticket,
              r.file,
              files[r.file].fd,
              r.op,
              r.buf + r.next_bytes,
              r.offset + r.next_bytes,
              static_cast<uint32_t>(len)};
    r.next_bytes += len;
    if (r.next_bytes == r.io_bytes) pending.pop_front();
    return true;
  }
  return false;
}

void Swapper::Impl::fail_locked(TicketState& t, int code, std::string message, std::string hint) {
  if (t.failed) return;  // the first failure of a request is the one reported
  t.failed = true;
  t.code = code;
  t.message = std::move(message);
  t.hint = std::move(hint);
}

void Swapper::Impl::block_done_locked(TicketState& t, uint64_t n_blocks) {
  t.n_unfinished_blocks -= n_blocks;
  if (t.n_unfinished_blocks != 0) return;
  --files[t.file].n_incomplete;
  --n_incomplete;
  cv_done.notify_all();
}

// res: bytes moved, or -errno.
void Swapper::Impl::finish_block_locked(const Block& b, int res) {
  TicketState& t = tickets.at(b.ticket);
  const char* call = backend == SwapBackend::io_uring
                         ? (b.op == Op::read ? "io_uring_prep_read" : "io_uring_prep_write")
                         : (b.op == Op::read ? "pread" : "pwrite");
  const std::string& path = files[b.file].path;
  if (res < 0) {
    fail_locked(t, -res,
                fmt::format("{} {} at offset {}: {} [{}]", op_name(b.op), path, b.offset,
                            errno_text(-res), call),
                io_hint(-res));
  } else if (static_cast<uint32_t>(res) != b.len) {
    fail_locked(t, 0,
                fmt::format("{} {} at offset {}: short {}, {} of {} bytes [{}]", op_name(b.op),
                            path, b.offset, op_name(b.op), res, b.len, call),
                b.op == Op::read ? kShortReadHint : kShortWriteHint);
  }
  block_done_locked(t, 1);
}

// ---------------------------------------------------------------------------------------------
// io_uring backend: one thread owns the ring. It takes up to queue_depth blocks from the
// queue, submits them, and sleeps in io_uring_wait_cqe until something completes: an I/O, or
// the eventfd poll that enqueue() fires when new work arrives.

void Swapper::Impl::uring_loop() {
  const AioConfig& a = opt.aio;
  std::vector<Block> slots(a.queue_depth);
  std::vector<uint32_t> free_slots(a.queue_depth), to_submit, retry;
  for (uint32_t i = 0; i < a.queue_depth; ++i) free_slots[i] = a.queue_depth - 1 - i;
  std::vector<std::pair<uint32_t, int>> done;  // (slot, res)
  uint32_t n_in_flight = 0;
  bool wake_armed = false;
  std::string fatal;

  const auto prep = [&](uint32_t slot) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);  // never null: the ring has qd + 1 entries
    const Block& b = slots[slot];
    if (b.op == Op::read)
      io_uring_prep_read(sqe, b.fd, b.buf, b.len, b.offset);
    else
      io_uring_prep_write(sqe, b.fd, b.buf, b.len, b.offset);
    io_uring_sqe_set_data64(sqe, slot);
  };
  const auto submit = [&]() -> bool {
    while (io_uring_sq_ready(&ring) > 0) {
      const int r = io_uring_submit(&ring);
      if (r >= 0 || r == -EINTR) continue;
      fatal = fmt::format("io_uring_submit: {}", errno_text(-r));
      return false;
    }
    return true;
  };

  while (fatal.empty()) {
    to_submit.clear();
    {
      std::lock_guard lk(mu);
      if (stop && n_in_flight == 0 && pending.empty()) break;
      // overlap_events: refill on every completion; otherwise only once the batch is done.
      if (a.overlap_events || n_in_flight == 0) {
        Block b;
        while (!free_slots.empty() && next_block_locked(b)) {
          slots[free_slots.back()] = b;
          to_submit.push_back(free_slots.back());
          free_slots.pop_back();
        }
      }
    }
    if (!wake_armed) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      io_uring_prep_poll_add(sqe, wake_fd, POLLIN);
      io_uring_sqe_set_data64(sqe, kWakeTag);
      wake_armed = true;
    }
    for (const uint32_t slot : retry) prep(slot);
    retry.clear();
    for (const uint32_t slot : to_submit) {
      prep(slot);
      ++n_in_flight;
      if (a.single_submit && !submit()) break;
    }
    if (!submit()) break;

    io_uring_cqe* cqe = nullptr;
    const int r = io_uring_wait_cqe(&ring, &cqe);
    if (r == -EINTR || r == -EAGAIN || r == -ETIME) continue;
    if (r < 0) {
      fatal = fmt::format("io_uring_wait_cqe: {}", errno_text(-r));
      break;
    }
    unsigned head = 0, n_seen = 0;
    done.clear();
    io_uring_for_each_cqe(&ring, head, cqe) {
      ++n_seen;
      const uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kWakeTag) {
        eventfd_t ignored = 0;
        ::eventfd_read(wake_fd, &ignored);  // reset the counter; EAGAIN if already zero
        wake_armed = false;
      } else if (cqe->res == -EAGAIN || cqe->res == -EINTR) {
        retry.push_back(static_cast<uint32_t>(tag));  // transient: submit the same I/O again
      } else {
        done.emplace_back(static_cast<uint32_t>(tag), cqe->res);
      }
    }
    io_uring_cq_advance(&ring, n_seen);
    if (!done.empty()) {
      std::lock_guard lk(mu);
      for (const auto& [slot, res] : done) {
        finish_block_locked(slots[slot], res);
        free_slots.push_back(slot);
        --n_in_flight;
      }
    }
  }
  if (fatal.empty()) return;
  // The ring itself failed (never seen in practice): fail every request, queued or in flight,
  // so no caller waits forever. ~Impl's io_uring_queue_exit cancels what the kernel still has.
  std::lock_guard lk(mu);
  broken = fatal;
  for (uint32_t slot = 0; slot < a.queue_depth; ++slot) {
    if (std::find(free_slots.begin(), free_slots.end(), slot) != free_slots.end()) continue;
    TicketState& t = tickets.at(slots[slot].ticket);
    fail_locked(t, EIO, fatal, "the kernel's io_uring failed; run with the thread-pool backend");
    block_done_locked(t, 1);
  }
  for (auto& [id, t] : tickets)
    if (t.n_unfinished_blocks != 0)
      fail_locked(t, EIO, fatal, "the kernel's io_uring failed; run with the thread-pool backend");
  Block b;
  while (next_block_locked(b)) block_done_locked(tickets.at(b.ticket), 1);
}

// ---------------------------------------------------------------------------------------------
// Thread-pool backend: queue_depth threads, each one blocking pread/pwrite at a time.

void Swapper::Impl::pool_loop() {
  for (;;) {
    Block b;
    {
      std::unique_lock lk(mu);
      cv_work.wait(lk, [&] { return stop || !pending.empty(); });
      if (!next_block_locked(b)) {
        if (stop && pending.empty()) return;
        continue;
      }
    }
    ssize_t n = 0;
    do {
      n = b.op == Op::read ? ::pread(b.fd, b.buf, b.len, static_cast<off_t>(b.offset))
                           : ::pwrite(b.fd, b.buf, b.len, static_cast<off_t>(b.offset));
    } while (n < 0 && errno == EINTR);
    const int res = n < 0 ? -errno : static_cast<int>(n);
    std::lock_guard lk(mu);
    finish_block_locked(b, res);
  }
}

// ---------------------------------------------------------------------------------------------
// The public face.

Swapper::Swapper(SwapperOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->start();
}

Swapper::~Swapper() = default;

SwapFile Swapper::open(std::string_view name, uint64_t size_bytes) {
  Impl& m = *impl_;
  if (!valid_name(name))
    throw Error(fmt::format("swap file name '{}': use letters, digits, '.', '_' and '-'", name),
                "name swap files after what they hold, e.g. 'master' or 'optimizer.exp_avg'");
  const std::string path = fmt::format("{}/rank{}.{}.swp", m.opt.dir, m.opt.rank, name);
  if (size_bytes == 0)
    throw Error(fmt::format("open {}: size 0 bytes", path), "swap only non-empty partitions");
  const uint64_t disk_bytes = padded_bytes(size_bytes);
  if (disk_bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max()))
    throw Error(fmt::format("open {}: {} bytes do not fit a file offset", path, size_bytes),
                "check the partition size");

  // O_EXCL: never clobber another run's file. A failed O_DIRECT open may still have created
  // the file (the check comes after creation), so any failure but EEXIST removes it again.
  int fd = -1;
  try {
    fd = ZP_IO_CHECK(::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600),
                     fmt::format("open {}", path), io_hint(errno));
  } catch (const IoError& e) {
    if (e.code() != EEXIST) ::unlink(path.c_str());
    throw;
  }
  struct stat st {};
  try {
    ZP_IO_CHECK(::fchmod(fd, 0600), fmt::format("chmod 0600 {}", path), io_hint(errno));
    // Reserve the blocks now, so a full drive is an error here and not in the middle of a step.
    try {
      ZP_IO_CHECK(::fallocate(fd, 0, 0, static_cast<off_t>(disk_bytes)),
                  fmt::format("fallocate {} ({} bytes)", path, disk_bytes), io_hint(errno));
    } catch (const IoError& e) {
      if (e.code() != EOPNOTSUPP) throw;
      // A file system without fallocate: size the file sparse; a full drive then shows up as
      // a write error naming the file and offset.
      ZP_IO_CHECK(::ftruncate(fd, static_cast<off_t>(disk_bytes)),
                  fmt::format("ftruncate {} ({} bytes)", path, disk_bytes), io_hint(errno));
    }
    ZP_IO_CHECK(::fstat(fd, &st), fmt::format("fstat {}", path), "");
  } catch (...) {
    ::close(fd);
    ::unlink(path.c_str());
    throw;
  }
  const uint64_t key = LiveFiles::get().add(path, st.st_dev, st.st_ino);
  std::lock_guard lk(m.mu);
  m.files.push_back(Impl::FileState{path, fd, size_bytes, st.st_dev, st.st_ino, key, 0, true});
  return SwapFile{static_cast<uint32_t>(m.files.size() - 1)};
}

void Swapper::close(SwapFile file) {
  Impl& m = *impl_;
  Impl::FileState fs;
  {
    std::lock_guard lk(m.mu);
    Impl::FileState& live = m.file_locked(file, "close");
    if (live.n_incomplete != 0)
      throw Error(
          fmt::format("close {}: {} requests still in flight", live.path, live.n_incomplete),
          "wait for every ticket of the file before closing it");
    fs = live;
    live.open = false;
  }
  ::close(fs.fd);
  LiveFiles::get().remove(fs.live_key);
  const int code = remove_if_ours(fs.path, fs.dev, fs.ino);
  if (code == ENOENT)
    throw IoError(fmt::format("remove {}: the swap file was removed underneath", fs.path),
                  "the files in --nvme-path belong to this run alone; do not clean the directory "
                  "while a run is going",
                  ENOENT);
  if (code == EEXIST)
    throw IoError(fmt::format("remove {}: another file has taken the swap file's name; left it "
                              "alone",
                              fs.path),
                  "two runs share this --nvme-path and rank; give each run its own directory",
                  EEXIST);
  if (code != 0)
    throw IoError(fmt::format("remove {}: {}", fs.path, errno_text(code)), io_hint(code), code);
}

const std::string& Swapper::path(SwapFile file) const {
  std::lock_guard lk(impl_->mu);
  return impl_->file_locked(file, "path").path;
}

uint64_t Swapper::size_bytes(SwapFile file) const {
  std::lock_guard lk(impl_->mu);
  return impl_->file_locked(file, "size_bytes").size_bytes;
}

SwapTicket Swapper::write(SwapFile file, uint64_t offset, const void* buffer, uint64_t bytes) {
  // The backend only reads the buffer; the cast serves the shared request type.
  return impl_->enqueue(Op::write, file, offset, static_cast<std::byte*>(const_cast<void*>(buffer)),
                        bytes);
}

SwapTicket Swapper::read(SwapFile file, uint64_t offset, void* buffer, uint64_t bytes) {
  return impl_->enqueue(Op::read, file, offset, static_cast<std::byte*>(buffer), bytes);
}

void Swapper::wait(SwapTicket ticket) {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  auto it = m.tickets.find(ticket.id);
  if (it == m.tickets.end())
    throw Error(fmt::format("wait: ticket {} is unknown or was already waited for", ticket.id),
                "wait for each ticket once (wait_all also consumes every ticket)");
  m.cv_done.wait(lk, [&] {
    it = m.tickets.find(ticket.id);
    return it == m.tickets.end() || it->second.n_unfinished_blocks == 0;
  });
  if (it == m.tickets.end())
    throw Error(fmt::format("wait: ticket {} was waited for by another thread", ticket.id),
                "wait for each ticket once");
  const Impl::TicketState t = std::move(it->second);
  m.tickets.erase(it);
  lk.unlock();
  if (t.failed) throw IoError(t.message, t.hint, t.code);
}

void Swapper::wait_all() {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  m.cv_done.wait(lk, [&] { return m.n_incomplete == 0; });
  const Impl::TicketState* first = nullptr;
  uint64_t n_failed = 0;
  for (const auto& [id, t] : m.tickets) {
    if (!t.failed) continue;
    if (!first) first = &t;
    ++n_failed;
  }
  if (!first) {
    m.tickets.clear();
    return;
  }
  IoError e(n_failed == 1
                ? first->message
                : fmt::format("{} (and {} more failed requests)", first->message, n_failed - 1),
            first->hint, first->code);
  m.tickets.clear();
  throw e;
}

SwapBackend Swapper::backend() const {
  return impl_->backend;
}
const AioConfig& Swapper::aio() const {
  return impl_->opt.aio;
}
SwapStats Swapper::stats() const {
  std::lock_guard lk(impl_->mu);
  return impl_->stats;
}

// ---------------------------------------------------------------------------------------------
// The chunk pipeline.

uint64_t ChunkPipeline::host_bytes(uint64_t chunk_bytes, uint32_t n_buffers, uint32_t n_files) {
  // n_buffers x n_files x chunk_bytes: chunk_bytes is a multiple of 4096, so a short last
  // chunk's padding fits inside its buffer and nothing else is needed.
  return checked_mul(checked_mul(uint64_t{n_buffers}, uint64_t{n_files}, "pipeline buffers"),
                     chunk_bytes, "pipeline host bytes");
}

ChunkPipeline::ChunkPipeline(Swapper& swapper, uint64_t chunk_bytes,
                             std::vector<HostBuffer> buffers)
    : ChunkPipeline(swapper, chunk_bytes, 1, std::move(buffers)) {}

ChunkPipeline::ChunkPipeline(Swapper& swapper, uint64_t chunk_bytes, uint32_t n_files,
                             std::vector<HostBuffer> buffers)
    : swapper_(swapper), chunk_bytes_(chunk_bytes), n_files_(n_files), buffers_(std::move(buffers)) {
  const char* hint =
      "give the pipeline n_buffers sets of n_files 4096-aligned buffers of chunk_bytes each, "
      "ChunkPipeline::host_bytes(chunk_bytes, n_buffers, n_files) bytes in all";
  if (chunk_bytes == 0 || chunk_bytes % kSwapAlignBytes != 0)
    throw Error(
        fmt::format("pipeline chunk_bytes {}: not a positive multiple of 4096", chunk_bytes),
        "round the chunk up to a multiple of 4096 bytes (1024 fp32 elements)");
  if (n_files_ == 0 || buffers_.size() % n_files_ != 0)
    throw Error(fmt::format("pipeline: {} buffers for {} files; it needs whole sets of one "
                            "buffer per file",
                            buffers_.size(), n_files_),
                hint);
  if (buffers_.size() / n_files_ < 2)
    throw Error(fmt::format("pipeline: {} buffers; it needs at least 2 (3 to overlap reads, the "
                            "callback and writes)",
                            buffers_.size() / n_files_),
                hint);
  for (std::size_t i = 0; i < buffers_.size(); ++i) {
    const HostBuffer& b = buffers_[i];
    if (reinterpret_cast<uintptr_t>(b.data) % kSwapAlignBytes != 0)
      throw Error(fmt::format("pipeline buffer {}: {} is not 4096-byte aligned", i,
                              static_cast<const void*>(b.data)),
                  hint);
    if (b.capacity_bytes < chunk_bytes)
      throw Error(fmt::format("pipeline buffer {}: capacity {} bytes < chunk_bytes {}", i,
                              b.capacity_bytes, chunk_bytes),
                  hint);
  }
}

void ChunkPipeline::run(SwapFile file, uint64_t region_offset, uint64_t region_bytes,
                        const ChunkFn& fn) {
  if (n_files_ != 1)
    throw Error(fmt::format("pipeline of {} files run over one file", n_files_),
                "run it with one SwapRegion per file");
  const SwapRegion region{file, region_offset};
  run(std::span<const SwapRegion>(&region, 1), region_bytes,
      [&](std::span<const std::span<std::byte>> chunks, uint64_t offset) { fn(chunks[0], offset); });
}

void ChunkPipeline::run(std::span<const SwapRegion> regions, uint64_t region_bytes,
                        const LockstepFn& fn) {
  if (regions.size() != n_files_)
    throw Error(fmt::format("pipeline of {} files run over {} regions", n_files_, regions.size()),
                "give one SwapRegion per file the pipeline was built for");
  for (const SwapRegion& r : regions)
    if (r.offset_bytes % kSwapAlignBytes != 0)
      throw Error(fmt::format("pipeline over {}: region offset {} is not a multiple of 4096",
                              swapper_.path(r.file), r.offset_bytes),
                  "place swapped partitions at multiples of 4096 bytes");
  const uint64_t n = n_buffers(), nf = n_files_;
  const uint64_t n_chunks = region_bytes / chunk_bytes_ + (region_bytes % chunk_bytes_ != 0);
  const uint64_t lookahead = n > 2 ? n - 2 : 1;  // reads in flight ahead of the callback
  const auto chunk_len = [&](uint64_t k) {
    return std::min(chunk_bytes_, region_bytes - k * chunk_bytes_);
  };
  const auto buffer = [&](uint64_t set, uint64_t f) { return buffers_[set * nf + f].data; };
  // Per buffer set: the reads filling it, or the writes draining it (never both). A ticket
  // leaves its list before it is waited for: each is waited for once, also on the error path.
  std::vector<std::vector<SwapTicket>> reading(n), writing(n);
  const auto wait_list = [&](std::vector<SwapTicket>& list) {
    while (!list.empty()) {
      const SwapTicket t = list.back();
      list.pop_back();
      swapper_.wait(t);
    }
  };
  const auto issue_read = [&](uint64_t k) {
    const uint64_t b = k % n;
    wait_list(writing[b]);  // the set still drains chunk k - n
    for (uint64_t f = 0; f < nf; ++f)
      reading[b].push_back(swapper_.read(regions[f].file, regions[f].offset_bytes + k * chunk_bytes_,
                                         buffer(b, f), chunk_len(k)));
  };
  std::vector<std::span<std::byte>> chunks(nf);
  try {
    uint64_t next_read = 0;
    for (uint64_t k = 0; k < n_chunks; ++k) {
      while (next_read < n_chunks && next_read <= k + lookahead) issue_read(next_read++);
      const uint64_t b = k % n;
      wait_list(reading[b]);
      for (uint64_t f = 0; f < nf; ++f) chunks[f] = std::span<std::byte>(buffer(b, f), chunk_len(k));
      fn(std::span<const std::span<std::byte>>(chunks), k * chunk_bytes_);
      for (uint64_t f = 0; f < nf; ++f)
        writing[b].push_back(swapper_.write(regions[f].file, regions[f].offset_bytes + k * chunk_bytes_,
                                            buffer(b, f), chunk_len(k)));
    }
    for (auto& w : writing) wait_list(w);
  } catch (...) {
    // Never hand the buffers back while the kernel may still use them.
    for (auto* lists : {&reading, &writing})
      for (auto& list : *lists)
        for (const SwapTicket t : list) {
          try {
            swapper_.wait(t);
          } catch (...) {  // the first error is the one already on its way out
          }
        }
    throw;
  }
}

}  // namespace zp::runtime
