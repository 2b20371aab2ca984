// The NVMe swapper: bit-exact round trips at awkward sizes on both backends, checked against
// plain buffered reads and writes of the same files; faults (full drive, short write, file
// size limit, truncated or removed file) each giving one clear error; file hygiene (mode
// 0600, removal by close, destructor, unwinding and exit()); the chunk pipeline. Not a speed
// test: speed is tools/bench/bench_swapper.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "aligned_buffer.hpp"
#include "process.hpp"
#include "zp/runtime/swapper.hpp"

using namespace zp::runtime;
using zp::test::AlignedBuffer;
using zp::test::TempDir;

namespace {

constexpr uint64_t KiB = 1024, MiB = 1024 * 1024;

// SwapperOptions field by field (g++ 12 warns about the fields designated initializers omit).
SwapperOptions opts(const std::string& dir, SwapBackend backend = SwapBackend::automatic,
                    uint64_t block_size = AioConfig{}.block_size,
                    uint32_t queue_depth = AioConfig{}.queue_depth, int rank = 0) {
  SwapperOptions o;
  o.dir = dir;
  o.rank = rank;
  o.aio.block_size = block_size;
  o.aio.queue_depth = queue_depth;
  o.backend = backend;
  return o;
}

// The error a callable throws, as "message | hint"; empty if it throws nothing.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const zp::Error& e) {
    return std::string(e.what()) + " | " + e.hint();
  }
  return {};
}

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().string());
  return out;
}

std::vector<std::byte> random_bytes(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng() & 0xff);
  return v;
}

// The oracle: ordinary buffered I/O on the same path, through the page cache, with no
// alignment at all. O_DIRECT reads and writes keep the page cache coherent for these.
std::vector<std::byte> pread_plain(const std::string& path, uint64_t offset, uint64_t n) {
  std::vector<std::byte> v(n);
  const int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  REQUIRE(::pread(fd, v.data(), n, static_cast<off_t>(offset)) == static_cast<ssize_t>(n));
  ::close(fd);
  return v;
}
void pwrite_plain(const std::string& path, uint64_t offset, const std::vector<std::byte>& v) {
  const int fd = ::open(path.c_str(), O_WRONLY);
  REQUIRE(fd >= 0);
  REQUIRE(::pwrite(fd, v.data(), v.size(), static_cast<off_t>(offset)) ==
          static_cast<ssize_t>(v.size()));
  REQUIRE(::fsync(fd) == 0);
  ::close(fd);
}

// Why io_uring cannot be used here, or nothing.
std::optional<std::string> io_uring_unavailable() {
  TempDir dir;
  try {
    Swapper s(opts(dir.path, SwapBackend::io_uring));
  } catch (const zp::Error& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

// The backends to test: io_uring only where the kernel lets us (else reported as skipped).
std::vector<SwapBackend> backends_to_test() {
  if (const auto why = io_uring_unavailable()) {
    MESSAGE("skipped: the io_uring backend, this kernel refuses it: " << *why);
    return {SwapBackend::thread_pool};
  }
  return {SwapBackend::io_uring, SwapBackend::thread_pool};
}

// Runs fn in a forked child (stderr captured); fn returns "" on success or what went wrong.
struct ChildResult {
  int exit_code = -1;
  std::string failure, err;
};
template <class F>
ChildResult run_in_child(F fn) {
  TempDir tmp;
  const std::string err_path = tmp.file("stderr"), msg_path = tmp.file("failure");
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    if (!std::freopen(err_path.c_str(), "w", stderr)) std::_Exit(99);
    std::string failure;
    try {
      failure = fn();
    } catch (const std::exception& e) {
      failure = std::string("unexpected exception: ") + e.what();
    }
    std::ofstream(msg_path) << failure;
    std::fflush(nullptr);
    std::_Exit(failure.empty() ? 0 : 1);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  ChildResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.failure = zp::test::slurp(msg_path);
  r.err = zp::test::slurp(err_path);
  return r;
}

// Writes every size at once (all in flight), checks the file with buffered reads, then
// rewrites the file with buffered writes and reads every size back at once.
void round_trip(const SwapperOptions& opt, const std::vector<uint64_t>& sizes, uint32_t seed) {
  Swapper s(opt);
  uint64_t total = 0;
  std::vector<uint64_t> offsets;
  for (const uint64_t n : sizes) {
    offsets.push_back(total);
    total += Swapper::padded_bytes(n);
  }
  const SwapFile f = s.open("rt", total);
  const std::string path = s.path(f);

  std::vector<std::vector<std::byte>> want;
  std::vector<std::unique_ptr<AlignedBuffer>> bufs;
  std::vector<SwapTicket> tickets;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    want.push_back(random_bytes(sizes[i], seed + static_cast<uint32_t>(i)));
    bufs.push_back(std::make_unique<AlignedBuffer>(sizes[i]));
    std::memcpy(bufs[i]->data(), want[i].data(), sizes[i]);
    tickets.push_back(s.write(f, offsets[i], bufs[i]->data(), sizes[i]));
  }
  for (const auto t : tickets) s.wait(t);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CAPTURE(sizes[i]);
    CHECK(pread_plain(path, offsets[i], sizes[i]) == want[i]);
  }

  for (std::size_t i = 0; i < sizes.size(); ++i) {
    want[i] = random_bytes(sizes[i], seed + 1000 + static_cast<uint32_t>(i));
    pwrite_plain(path, offsets[i], want[i]);
    std::memset(bufs[i]->data(), 0xAB, bufs[i]->capacity_bytes());
    s.read(f, offsets[i], bufs[i]->data(), sizes[i]);
  }
  s.wait_all();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CAPTURE(sizes[i]);
    CHECK(std::memcmp(bufs[i]->data(), want[i].data(), sizes[i]) == 0);
  }
  uint64_t sum = 0;
  for (const uint64_t n : sizes) sum += n;
  const SwapStats st = s.stats();
  CHECK(st.n_writes == sizes.size());
  CHECK(st.n_reads == sizes.size());
  CHECK(st.bytes_written == sum);
  CHECK(st.bytes_read == sum);
}

// A small file system to fill: tmpfs (O_DIRECT needs Linux >= 6.6 there), else an ext4 image
// on a loop device. Needs root and mount(2); why_not says why when neither works.
struct SmallFs {
  TempDir parent;
  std::string dir, image, kind, why_not;
  bool mounted = false;

  explicit SmallFs(uint64_t bytes) {
    dir = parent.file("mnt");
    image = parent.file("fs.img");
    ::mkdir(dir.c_str(), 0700);
    if (::geteuid() != 0) {
      why_not = "mounting a small file system needs root";
      return;
    }
    const std::string opts = "size=" + std::to_string(bytes);
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, opts.c_str()) == 0) {
      if (odirect_works()) {
        mounted = true;
        kind = "tmpfs";
        return;
      }
      ::umount2(dir.c_str(), MNT_DETACH);
      why_not = "tmpfs refuses O_DIRECT on this kernel; ";
    } else {
      why_not = std::string("mount tmpfs: ") + std::strerror(errno) + "; ";
    }
    const std::string mk = "truncate -s " + std::to_string(std::max<uint64_t>(bytes, 8 * MiB)) +
                           " '" + image + "' && mkfs.ext4 -q -F '" + image +
                           "' >/dev/null 2>&1 && mount -o loop '" + image + "' '" + dir +
                           "' 2>/dev/null";
    if (std::system(mk.c_str()) == 0) {
      mounted = true;
      kind = "ext4 on a loop device";
      return;
    }
    why_not += "mkfs.ext4 + mount -o loop failed too";
  }
  ~SmallFs() {
    if (mounted) ::umount2(dir.c_str(), MNT_DETACH);
  }
  bool odirect_works() const {
    const std::string p = dir + "/probe";
    const int fd = ::open(p.c_str(), O_CREAT | O_RDWR | O_DIRECT, 0600);
    ::unlink(p.c_str());
    if (fd < 0) return false;
    ::close(fd);
    return true;
  }
  uint64_t free_bytes() const {
    struct statvfs v {};
    REQUIRE(::statvfs(dir.c_str(), &v) == 0);
    return static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
  }
};

}  // namespace

TEST_CASE("swapper: DeepSpeed's aio defaults") {
  // deepspeed/runtime/swap_tensor/constants.py: AIO_BLOCK_SIZE_DEFAULT 1048576,
  // AIO_QUEUE_DEPTH_DEFAULT 8, AIO_SINGLE_SUBMIT_DEFAULT False, AIO_OVERLAP_EVENTS_DEFAULT True.
  const AioConfig a;
  CHECK(a.block_size == 1048576);
  CHECK(a.queue_depth == 8);
  CHECK_FALSE(a.single_submit);
  CHECK(a.overlap_events);
  CHECK(Swapper::padded_bytes(1) == 4096);
  CHECK(Swapper::padded_bytes(4096) == 4096);
  CHECK(Swapper::padded_bytes(4097) == 8192);
}

TEST_CASE("swapper: bad configuration and bad requests are clear errors") {
  TempDir dir;
  CHECK(error_of([&] {
          Swapper s(opts(dir.path, SwapBackend::automatic, 1000));
        }).find("aio.block_size: 1000 is not a multiple of 4096") != std::string::npos);
  CHECK(error_of([&] {
          Swapper s(opts(dir.path, SwapBackend::automatic, MiB, 0));
        }).find("aio.queue_depth: 0 is outside") != std::string::npos);
  const std::string missing = dir.file("nope");
  const std::string e_missing = error_of([&] { Swapper s(opts(missing)); });
  CHECK(e_missing.find("--nvme-path " + missing + ": No such file or directory") !=
        std::string::npos);
  CHECK(e_missing.find("[::stat(") != std::string::npos);  // the check macro's call
  CHECK(e_missing.find("swapper.cpp:") != std::string::npos);
  const std::string regular = dir.write("regular", "x");
  CHECK(error_of([&] { Swapper s(opts(regular)); }).find("not a directory") != std::string::npos);

  Swapper s(opts(dir.path, SwapBackend::automatic, MiB, 8, 3));
  CHECK(error_of([&] { s.open("a/b", 10); }).find("swap file name 'a/b'") != std::string::npos);
  CHECK(error_of([&] { s.open("zero", 0); }).find("size 0 bytes") != std::string::npos);
  const SwapFile f = s.open("master", 3 * 4096 + 5);
  CHECK(s.path(f) == dir.path + "/rank3.master.swp");
  const std::string e_dup = error_of([&] { s.open("master", 10); });
  CHECK(e_dup.find("open " + dir.path + "/rank3.master.swp: File exists") != std::string::npos);
  CHECK(e_dup.find("another run") != std::string::npos);

  AlignedBuffer buf(8 * 4096);
  const std::string e_align = error_of([&] { s.write(f, 0, buf.data() + 16, 100); });
  CHECK(e_align.find("write " + s.path(f) + " at offset 0: buffer") != std::string::npos);
  CHECK(e_align.find("is not 4096-byte aligned (address % 4096 = 16)") != std::string::npos);
  CHECK(error_of([&] {
          s.read(f, 512, buf.data(), 100);
        }).find("at offset 512: the offset is not a multiple of 4096") != std::string::npos);
  // The file holds 3 * 4096 + 5 bytes: reading 6 bytes at 3 * 4096 runs past its end.
  CHECK(error_of([&] {
          s.read(f, 3 * 4096, buf.data(), 6);
        }).find("6 bytes run past the end of the file (12293 bytes)") != std::string::npos);
  s.wait(s.read(f, 3 * 4096, buf.data(), 5));  // the last 5 bytes are fine
  CHECK(error_of([&] {
          s.wait(SwapTicket{12345});
        }).find("ticket 12345 is unknown or was already waited for") != std::string::npos);
  s.close(f);
  CHECK(error_of([&] { s.read(f, 0, buf.data(), 1); }).find("is not open") != std::string::npos);
  CHECK(files_in(dir.path) == std::vector<std::string>{regular});
}

TEST_CASE("swapper: bit-exact round trips at sizes that are not multiples of the block") {
  const std::vector<uint64_t> sizes = {1,        4095,           4096, 4097,       65536 + 1,
                                       MiB + 13, 3 * MiB + 4099, 777,  5 * MiB + 1};
  for (const SwapBackend backend : backends_to_test()) {
    CAPTURE(to_string(backend));
    TempDir dir;
    SUBCASE("DeepSpeed defaults: 1 MiB blocks, queue depth 8") {
      round_trip(opts(dir.path, backend), sizes, 1);
    }
    SUBCASE("64 KiB blocks, queue depth 3: many blocks per request, more requests than slots") {
      round_trip(opts(dir.path, backend, 64 * KiB, 3), sizes, 2);
    }
    SUBCASE("single_submit, no overlap_events, queue depth 1") {
      SwapperOptions o = opts(dir.path, backend, 16 * KiB, 1);
      o.aio.single_submit = true;
      o.aio.overlap_events = false;
      round_trip(o, sizes, 3);
    }
    CHECK(files_in(dir.path).empty());
  }
}

TEST_CASE("swapper: the backend asked for is the one used") {
  TempDir dir;
  CHECK(Swapper(opts(dir.path, SwapBackend::thread_pool)).backend() == SwapBackend::thread_pool);
  if (const auto why = io_uring_unavailable()) {
    MESSAGE("skipped: io_uring checks, this kernel refuses it: " << *why);
    return;
  }
  CHECK(Swapper(opts(dir.path)).backend() == SwapBackend::io_uring);
  CHECK(Swapper(opts(dir.path, SwapBackend::io_uring)).backend() == SwapBackend::io_uring);
}

TEST_CASE("swapper: swap files are 0600, reserved on disk, removed by close and destructor") {
  TempDir dir;
  {
    Swapper s(opts(dir.path, SwapBackend::automatic, MiB, 8, 1));
    const SwapFile a = s.open("master", MiB + 13);
    const SwapFile b = s.open("optimizer.exp_avg", 5000);
    struct stat st {};
    REQUIRE(::stat(s.path(a).c_str(), &st) == 0);
    CHECK((st.st_mode & 07777) == 0600);
    CHECK(S_ISREG(st.st_mode));
    CHECK(static_cast<uint64_t>(st.st_size) == MiB + 4096);  // padded to 4096
    // fallocate reserved the blocks: st_blocks counts 512-byte units actually allocated.
    CHECK(static_cast<uint64_t>(st.st_blocks) * 512 >= MiB + 4096);
    REQUIRE(::stat(s.path(b).c_str(), &st) == 0);
    CHECK((st.st_mode & 07777) == 0600);
    CHECK(files_in(dir.path).size() == 2);
    const std::string path_a = s.path(a);
    s.close(a);
    CHECK(!std::filesystem::exists(path_a));
    CHECK(files_in(dir.path).size() == 1);
  }
  CHECK(files_in(dir.path).empty());
}

TEST_CASE("swapper: files are removed when an error unwinds the swapper") {
  TempDir dir;
  AlignedBuffer buf(4096);
  CHECK_THROWS_AS(
      [&] {
        Swapper s(opts(dir.path));
        const SwapFile f = s.open("master", 3 * 4096);
        s.open("optimizer", 4096);
        s.write(f, 4096, buf.data(), 4096);  // in flight when the error below unwinds
        s.write(f, 100, buf.data(), 10);     // misaligned offset: throws
      }(),
      zp::Error);
  CHECK(files_in(dir.path).empty());
}

TEST_CASE("swapper: files are removed at exit() without any destructor, not by forked children") {
  TempDir dir;
  // A child that leaks its swapper and calls std::exit: the atexit hook removes its files.
  std::fflush(nullptr);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    auto* s = new Swapper(opts(dir.path, SwapBackend::automatic, MiB, 8, 7));
    s->open("master", 4096);
    s->open("params", 3 * MiB);
    std::exit(::access((dir.path + "/rank7.master.swp").c_str(), F_OK) == 0 ? 0 : 3);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);  // the file existed right before exit
  CHECK(files_in(dir.path).empty());

  // A forked child of a process with live swap files must not remove them when it exits.
  Swapper s(opts(dir.path));
  const SwapFile f = s.open("master", 4096);
  std::fflush(nullptr);
  pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) std::exit(0);
  ::waitpid(pid, &status, 0);
  CHECK(std::filesystem::exists(s.path(f)));
}

TEST_CASE("swapper: a file truncated underneath gives a clear read error, not garbage") {
  for (const SwapBackend backend : backends_to_test()) {
    CAPTURE(to_string(backend));
    TempDir dir;
    {
      Swapper s(opts(dir.path, backend, 64 * KiB));
      const SwapFile f = s.open("master", 3 * 64 * KiB);
      AlignedBuffer buf(3 * 64 * KiB);
      std::memset(buf.data(), 0x5A, buf.capacity_bytes());
      s.wait(s.write(f, 0, buf.data(), 3 * 64 * KiB));
      REQUIRE(::truncate(s.path(f).c_str(), 4096) == 0);

      // One block, cut short by the truncation: the error names the file, the operation, the
      // offset and how much came back.
      const std::string e1 = error_of([&] { s.wait(s.read(f, 0, buf.data(), 64 * KiB)); });
      CHECK(e1.find("read " + s.path(f) + " at offset 0: short read, 4096 of 65536 bytes") !=
            std::string::npos);
      CHECK(e1.find("truncated or replaced it underneath") != std::string::npos);
      // Several blocks past the end, in flight at once: one error for the request.
      const std::string e2 = error_of([&] { s.wait(s.read(f, 0, buf.data(), 3 * 64 * KiB)); });
      CHECK(e2.find("read " + s.path(f) + " at offset ") != std::string::npos);
      CHECK(e2.find(": short read, ") != std::string::npos);
      // wait_all reports the first of several failed requests and counts the rest.
      s.read(f, 64 * KiB, buf.data(), 4096);
      s.read(f, 128 * KiB, buf.data() + 64 * KiB, 4096);
      const std::string e3 = error_of([&] { s.wait_all(); });
      CHECK(e3.find("read " + s.path(f) + " at offset 65536: short read, 0 of 4096 bytes") !=
            std::string::npos);
      CHECK(e3.find("(and 1 more failed requests)") != std::string::npos);
      s.wait_all();  // nothing left
    }
    CHECK(files_in(dir.path).empty());  // removed after the errors too
  }
}

TEST_CASE("swapper: a file removed or replaced underneath") {
  TempDir dir;
  Swapper s(opts(dir.path));
  const SwapFile f = s.open("master", 8192);
  AlignedBuffer in(8192), out(8192);
  const auto want = random_bytes(8192, 9);
  std::memcpy(in.data(), want.data(), 8192);
  s.wait(s.write(f, 0, in.data(), 8192));
  const std::string path = s.path(f);
  REQUIRE(::unlink(path.c_str()) == 0);
  // The open file keeps its blocks: the data read back is still right.
  s.wait(s.read(f, 0, out.data(), 8192));
  CHECK(std::memcmp(out.data(), want.data(), 8192) == 0);
  const std::string e = error_of([&] { s.close(f); });
  CHECK(e.find("remove " + path + ": the swap file was removed underneath") != std::string::npos);

  // Another file has taken the name: close leaves it alone and says so.
  const SwapFile g = s.open("params", 4096);
  const std::string gpath = s.path(g);
  REQUIRE(::unlink(gpath.c_str()) == 0);
  std::ofstream(gpath) << "someone else's";
  CHECK(error_of([&] { s.close(g); }).find("another file has taken the swap file's name") !=
        std::string::npos);
  CHECK(zp::test::slurp(gpath) == "someone else's");
}

TEST_CASE("swapper: a full drive fails at open, naming the file; reserved space stays usable") {
  SmallFs fs(2 * MiB);
  if (!fs.mounted) {
    MESSAGE("skipped: no small file system to fill: " << fs.why_not);
    return;
  }
  MESSAGE("filling a small " << fs.kind);
  for (const SwapBackend backend : backends_to_test()) {
    CAPTURE(to_string(backend));
    {
      Swapper s(opts(fs.dir, backend, 64 * KiB));
      const uint64_t half = fs.free_bytes() / 2 / 4096 * 4096;
      const SwapFile a = s.open("master", half);
      const std::string e = error_of([&] { s.open("optimizer", 2 * half + 4096); });
      CHECK(e.find("fallocate " + fs.dir + "/rank0.optimizer.swp") != std::string::npos);
      CHECK(e.find(": No space left on device") != std::string::npos);
      CHECK(e.find("the drive under --nvme-path is full") != std::string::npos);
      CHECK(!std::filesystem::exists(fs.dir + "/rank0.optimizer.swp"));

      // Fill the rest of the drive with someone else's file, then use every reserved byte.
      {
        std::ofstream filler(fs.dir + "/filler", std::ios::binary);
        const std::vector<char> junk(64 * KiB, 'j');
        while (filler.write(junk.data(), static_cast<std::streamsize>(junk.size())) &&
               filler.flush()) {
        }
      }
      AlignedBuffer buf(half), back(half);
      const auto want = random_bytes(half, 4);
      std::memcpy(buf.data(), want.data(), half);
      s.wait(s.write(a, 0, buf.data(), half));
      s.wait(s.read(a, 0, back.data(), half));
      CHECK(std::memcmp(back.data(), want.data(), half) == 0);
    }
    ::unlink((fs.dir + "/filler").c_str());
    for (const auto& p : files_in(fs.dir)) CHECK(p.find(".swp") == std::string::npos);
  }
}

TEST_CASE("swapper: a file-size limit gives a short write, then EFBIG, then a fallocate error") {
  // RLIMIT_FSIZE in a forked child stands in for a drive that takes only part of a write:
  // the kernel cuts a write that crosses the limit short and refuses one that starts past it.
  for (const SwapBackend backend : backends_to_test()) {
    CAPTURE(to_string(backend));
    TempDir dir;
    const ChildResult r = run_in_child([&]() -> std::string {
      std::signal(SIGXFSZ, SIG_IGN);  // else the kernel's SIGXFSZ kills the child
      Swapper s(opts(dir.path, backend, 16 * KiB));
      const SwapFile f = s.open("master", 4 * 16 * KiB);  // reserved before the limit
      const rlimit lim{3 * 4096, 3 * 4096};
      if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return "setrlimit failed";
      AlignedBuffer buf(16 * KiB);
      const std::string path = s.path(f);
      std::string out;
      const auto expect = [&](const std::string& e, const std::string& part) {
        if (e.find(part) == std::string::npos) out += "\n  '" + part + "' not in: " + e;
      };
      const std::string e1 = error_of([&] { s.wait(s.write(f, 0, buf.data(), 16 * KiB)); });
      expect(e1, "write " + path + " at offset 0: short write, 12288 of 16384 bytes");
      expect(e1, "the file-size limit");
      const std::string e2 = error_of([&] { s.wait(s.write(f, 16 * KiB, buf.data(), 16 * KiB)); });
      expect(e2, "write " + path + " at offset 16384: File too large");
      const std::string e3 = error_of([&] { s.open("optimizer", 4 * 16 * KiB); });
      expect(e3, "fallocate " + dir.path + "/rank0.optimizer.swp (65536 bytes): File too large");
      expect(e3, "ulimit -f");
      return out;
    });
    CHECK_MESSAGE(r.exit_code == 0, r.failure);
    CHECK(files_in(dir.path).empty());
  }
}

namespace {

// Makes io_uring_setup fail with `code` in this thread and the threads it starts (seccomp).
bool refuse_io_uring(int code) {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (static_cast<uint32_t>(code) & 0xffff)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

}  // namespace

TEST_CASE("swapper: where io_uring is refused, the automatic backend falls back and says so once") {
  if (const auto why = io_uring_unavailable()) {
    MESSAGE("skipped: io_uring is refused here already, so refusing it cannot be staged: " << *why);
    return;
  }
  for (const int code : {ENOSYS, EPERM}) {
    CAPTURE(code);
    TempDir dir;
    const ChildResult r = run_in_child([&]() -> std::string {
      if (!refuse_io_uring(code)) return "skip";
      std::string out;
      for (int i = 0; i < 2; ++i) {
        Swapper s(opts(dir.path));
        if (s.backend() != SwapBackend::thread_pool) out += "\n  automatic did not fall back";
        const SwapFile f = s.open("master", 4097);
        AlignedBuffer a(4097), b(4097);
        std::memset(a.data(), 0x3C, 4097);
        s.wait(s.write(f, 0, a.data(), 4097));
        s.wait(s.read(f, 0, b.data(), 4097));
        if (std::memcmp(a.data(), b.data(), 4097) != 0) out += "\n  fallback round trip wrong";
      }
      const std::string forced =
          error_of([&] { Swapper s(opts(dir.path, SwapBackend::io_uring)); });
      const std::string want = std::string("io_uring_queue_init(9 entries): ") +
                               std::strerror(code) + " [io_uring_queue_init(";
      if (forced.find(want) == std::string::npos)
        out += "\n  forced io_uring: '" + want + "' not in: " + forced;
      return out;
    });
    if (r.failure == "skip") {
      MESSAGE("skipped: seccomp is not available to stage a refused io_uring");
      continue;
    }
    CHECK_MESSAGE(r.exit_code == 0, r.failure);
    // Two swappers fell back; the log says so once, on one line.
    const std::string line = "zp swapper: io_uring unavailable (";
    const auto first = r.err.find(line);
    REQUIRE(first != std::string::npos);
    CHECK(r.err.find(line, first + 1) == std::string::npos);
    CHECK(r.err.find(std::strerror(code)) != std::string::npos);
    CHECK(r.err.find("using a pread/pwrite thread pool of 8 threads\n") != std::string::npos);
    CHECK(files_in(dir.path).empty());
  }
}

// ---------------------------------------------------------------------------------------------
// The chunk pipeline.

namespace {

// A region of n floats with value i at element i (exact in fp32 below 2^24), placed at a
// 4096-aligned offset inside a file with sentinel bytes on both sides, written and checked by
// buffered I/O only.
struct FloatRegion {
  static constexpr uint64_t kOffset = 8192;
  uint64_t n;
  uint64_t bytes() const { return n * 4; }
  uint64_t file_bytes() const { return kOffset + bytes() + 4096; }

  void fill(const std::string& path) const {
    std::vector<std::byte> all(file_bytes(), std::byte{0xEE});
    for (uint64_t i = 0; i < n; ++i) {
      const float v = static_cast<float>(i);
      std::memcpy(all.data() + kOffset + 4 * i, &v, 4);
    }
    pwrite_plain(path, 0, all);
  }
  // Elements [0, n_done) must be i + 1, the rest i; sentinels untouched. Returns mismatches.
  uint64_t count_wrong(const std::string& path, uint64_t n_done) const {
    const auto all = pread_plain(path, 0, file_bytes());
    uint64_t wrong = 0;
    for (uint64_t i = 0; i < kOffset; ++i) wrong += all[i] != std::byte{0xEE};
    for (uint64_t i = kOffset + bytes(); i < file_bytes(); ++i) wrong += all[i] != std::byte{0xEE};
    for (uint64_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, all.data() + kOffset + 4 * i, 4);
      wrong += v != static_cast<float>(i) + (i < n_done ? 1.0f : 0.0f);
    }
    return wrong;
  }
};

void add_one(std::span<std::byte> chunk) {
  REQUIRE(chunk.size() % 4 == 0);
  auto* f = reinterpret_cast<float*>(chunk.data());
  for (std::size_t i = 0; i < chunk.size() / 4; ++i) f[i] += 1.0f;
}

}  // namespace

TEST_CASE("pipeline: host bytes are exact: enough, and nothing to spare") {
  CHECK(ChunkPipeline::host_bytes(64 * KiB) == 3 * 64 * KiB);
  CHECK(ChunkPipeline::host_bytes(64 * KiB, 5) == 5 * 64 * KiB);
  TempDir dir;
  Swapper s(opts(dir.path));
  AlignedBuffer a(64 * KiB), b(64 * KiB), c(64 * KiB), small(60 * KiB);
  // host_bytes / n_buffers per buffer is accepted; 4096 bytes less is refused.
  CHECK_NOTHROW(ChunkPipeline(s, 64 * KiB, {a.host(), b.host(), c.host()}));
  const std::string e = error_of([&] {
    ChunkPipeline(s, 64 * KiB, {a.host(), small.host(), c.host()});
  });
  CHECK(e.find("pipeline buffer 1: capacity 61440 bytes < chunk_bytes 65536") != std::string::npos);
  CHECK(e.find("ChunkPipeline::host_bytes") != std::string::npos);
  CHECK(error_of([&] { ChunkPipeline(s, 64 * KiB, {a.host()}); }).find("1 buffers") !=
        std::string::npos);
  CHECK(error_of([&] {
          ChunkPipeline(s, 1000, {a.host(), b.host()});
        }).find("chunk_bytes 1000: not a positive multiple of 4096") != std::string::npos);
  CHECK(error_of([&] {
          ChunkPipeline(s, 4096, {a.host(), {b.data() + 64, 8192}});
        }).find("pipeline buffer 1:") != std::string::npos);
}

TEST_CASE("pipeline: every chunk is read, transformed and written back, in overlapped order") {
  const uint64_t chunk = 64 * KiB;
  const FloatRegion region{100'003};  // 400012 bytes: 6 full chunks and a short one
  const uint64_t n_chunks = 7;
  for (const SwapBackend backend : backends_to_test()) {
    for (const uint32_t n_buffers : {2u, 3u, 5u}) {
      CAPTURE(to_string(backend));
      CAPTURE(n_buffers);
      TempDir dir;
      Swapper s(opts(dir.path, backend, 16 * KiB, 4));
      const SwapFile f = s.open("master", region.file_bytes());
      region.fill(s.path(f));

      std::vector<std::unique_ptr<AlignedBuffer>> owned;
      std::vector<HostBuffer> bufs;
      for (uint32_t i = 0; i < n_buffers; ++i) {
        owned.push_back(std::make_unique<AlignedBuffer>(chunk));
        bufs.push_back(owned.back()->host());
      }
      ChunkPipeline pipe(s, chunk, bufs);
      const SwapStats before = s.stats();
      // Reads run max(1, n - 2) chunks ahead of the callback; chunk k - 1's write was issued.
      const uint64_t lookahead = n_buffers > 2 ? n_buffers - 2 : 1;
      std::vector<uint64_t> seen_offsets, seen_sizes;
      uint64_t n_schedule_wrong = 0;
      pipe.run(f, FloatRegion::kOffset, region.bytes(),
               [&](std::span<std::byte> c, uint64_t offset_in_region) {
                 const uint64_t k = offset_in_region / chunk;
                 const SwapStats now = s.stats();
                 n_schedule_wrong +=
                     now.n_reads - before.n_reads != std::min(k + 1 + lookahead, n_chunks);
                 n_schedule_wrong += now.n_writes - before.n_writes != k;
                 seen_offsets.push_back(offset_in_region);
                 seen_sizes.push_back(c.size());
                 add_one(c);
               });
      CHECK(n_schedule_wrong == 0);
      CHECK(seen_offsets ==
            std::vector<uint64_t>{0, chunk, 2 * chunk, 3 * chunk, 4 * chunk, 5 * chunk, 6 * chunk});
      CHECK(seen_sizes == std::vector<uint64_t>{chunk, chunk, chunk, chunk, chunk, chunk,
                                                region.bytes() - 6 * chunk});
      CHECK(s.stats().bytes_read - before.bytes_read == region.bytes());
      CHECK(s.stats().bytes_written - before.bytes_written == region.bytes());
      CHECK(region.count_wrong(s.path(f), region.n) == 0);
      // A second pass adds one more: the pipeline can be run again over the same buffers.
      pipe.run(f, FloatRegion::kOffset, region.bytes(), [](std::span<std::byte> c, uint64_t) {
        add_one(c);
        add_one(c);
      });
      const auto all = pread_plain(s.path(f), FloatRegion::kOffset + 4 * 99'999, 4);
      float v;
      std::memcpy(&v, all.data(), 4);
      CHECK(v == 99'999.0f + 3.0f);
    }
  }
}

TEST_CASE("pipeline: an exception in the callback leaves nothing in flight") {
  const uint64_t chunk = 16 * KiB;
  const FloatRegion region{40'000};  // 160000 bytes: 10 chunks
  for (const SwapBackend backend : backends_to_test()) {
    CAPTURE(to_string(backend));
    TempDir dir;
    Swapper s(opts(dir.path, backend, 4096, 2));
    const SwapFile f = s.open("master", region.file_bytes());
    region.fill(s.path(f));
    AlignedBuffer a(chunk), b(chunk), c(chunk);
    ChunkPipeline pipe(s, chunk, {a.host(), b.host(), c.host()});
    CHECK_THROWS_WITH_AS(pipe.run(f, FloatRegion::kOffset, region.bytes(),
                                  [&](std::span<std::byte> x, uint64_t off) {
                                    if (off == 3 * chunk) throw std::runtime_error("boom");
                                    add_one(x);
                                  }),
                         "boom", std::runtime_error);
    CHECK_NOTHROW(s.wait_all());
    // Chunks 0-2 were written back with +1; chunk 3 and later are as they were.
    CHECK(region.count_wrong(s.path(f), 3 * chunk / 4) == 0);
  }
}

TEST_CASE("pipeline: several files in lockstep see the same chunk of each, at different offsets") {
  // Three files stand in for master, exp_avg and exp_avg_sq: the callback combines chunk k of
  // all three (m += g; g *= 2; v = m), which is right only if the chunks correspond.
  const uint64_t chunk = 16 * KiB;
  const uint64_t n = 20'003;  // 80012 bytes: 4 full chunks and a short one
  const uint64_t offsets[3] = {0, 8192, 4096};
  const char* names[3] = {"master", "exp_avg", "exp_avg_sq"};
  for (const SwapBackend backend : backends_to_test()) {
    for (const uint32_t n_sets : {2u, 3u}) {
      CAPTURE(to_string(backend));
      CAPTURE(n_sets);
      TempDir dir;
      Swapper s(opts(dir.path, backend, 4 * KiB, 4));
      std::vector<SwapRegion> regions;
      for (int f = 0; f < 3; ++f) {
        const SwapFile file = s.open(names[f], offsets[f] + n * 4);
        std::vector<std::byte> init(offsets[f] + n * 4, std::byte{0});
        for (uint64_t i = 0; i < n; ++i) {
          const float v = static_cast<float>(i * (f + 1));  // file f holds i * (f + 1)
          std::memcpy(init.data() + offsets[f] + 4 * i, &v, 4);
        }
        pwrite_plain(s.path(file), 0, init);
        regions.push_back({file, offsets[f]});
      }
      std::vector<std::unique_ptr<AlignedBuffer>> owned;
      std::vector<HostBuffer> bufs;
      for (uint32_t i = 0; i < n_sets * 3; ++i) {
        owned.push_back(std::make_unique<AlignedBuffer>(chunk));
        bufs.push_back(owned.back()->host());
      }
      CHECK(ChunkPipeline::host_bytes(chunk, n_sets, 3) == n_sets * 3 * chunk);
      ChunkPipeline pipe(s, chunk, 3, bufs);
      CHECK(pipe.n_buffers() == n_sets);
      CHECK(pipe.n_files() == 3);
      uint64_t n_calls = 0;
      pipe.run(regions, n * 4, [&](std::span<const std::span<std::byte>> c, uint64_t off) {
        REQUIRE(c.size() == 3);
        ++n_calls;
        auto* m = reinterpret_cast<float*>(c[0].data());
        auto* g = reinterpret_cast<float*>(c[1].data());
        auto* v = reinterpret_cast<float*>(c[2].data());
        CHECK(c[0].size() == c[2].size());
        CHECK(m[0] == static_cast<float>(off / 4));
        for (std::size_t i = 0; i < c[0].size() / 4; ++i) {
          m[i] += g[i];
          g[i] *= 2;
          v[i] = m[i];
        }
      });
      CHECK(n_calls == 5);
      uint64_t wrong = 0;
      for (int f = 0; f < 3; ++f) {
        const auto all = pread_plain(s.path(regions[static_cast<std::size_t>(f)].file), offsets[f], n * 4);
        for (uint64_t i = 0; i < n; ++i) {
          float x;
          std::memcpy(&x, all.data() + 4 * i, 4);
          const float want = f == 1 ? static_cast<float>(4 * i) : static_cast<float>(3 * i);
          wrong += x != want;
        }
      }
      CHECK(wrong == 0);
      // A single-file run of a 3-file pipeline, or the wrong number of regions, is refused.
      CHECK(error_of([&] { pipe.run(regions[0].file, 0, 4096, [](std::span<std::byte>, uint64_t) {}); })
                .find("pipeline of 3 files run over one file") != std::string::npos);
      CHECK(error_of([&] {
              pipe.run(std::span<const SwapRegion>(regions.data(), 2), 4096,
                       [](std::span<const std::span<std::byte>>, uint64_t) {});
            }).find("run over 2 regions") != std::string::npos);
      CHECK(error_of([&] { ChunkPipeline(s, chunk, 3, {bufs[0], bufs[1]}); }).find("2 buffers for 3 files") !=
            std::string::npos);
    }
  }
}
