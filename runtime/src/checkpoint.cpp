// checkpoint.cpp: the checkpoint directory's protocol and manifest (zp/runtime/checkpoint.hpp).
// Crash safety rests on POSIX's atomic rename and on fsync ordering: a file's data is fsynced
// before its rename, a directory is fsynced after a rename inside it, the step directory's
// manifest is in place before the directory is renamed into view, and `latest` is replaced
// only after that rename is durable.
#include "zp/runtime/checkpoint.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/json_fields.hpp"
#include "zp/runtime/io_check.hpp"

namespace zp::runtime {

namespace fs = std::filesystem;
using nlohmann::json;

// ---- fault injection ------------------------------------------------------------------------

namespace {

struct FaultPlan {
  enum Kind { none, kill, enospc, count } kind = none;
  uint64_t at = 0;
  int rank = 0;
};

std::atomic<int> g_rank{0};
std::atomic<uint64_t> g_points{0};

const FaultPlan& fault_plan() {
  static const FaultPlan plan = [] {
    FaultPlan p;
    const char* spec = std::getenv("ZP_CHECKPOINT_FAULT");
    if (spec == nullptr || *spec == '\0') return p;
    if (const char* r = std::getenv("ZP_CHECKPOINT_FAULT_RANK")) p.rank = std::atoi(r);
    const std::string s(spec);
    if (s == "count") {
      p.kind = FaultPlan::count;
    } else if (s.rfind("kill@", 0) == 0) {
      p.kind = FaultPlan::kill;
      p.at = std::strtoull(s.c_str() + 5, nullptr, 10);
    } else if (s.rfind("enospc@", 0) == 0) {
      p.kind = FaultPlan::enospc;
      p.at = std::strtoull(s.c_str() + 7, nullptr, 10);
    }
    return p;
  }();
  return plan;
}

}  // namespace

void CheckpointFaults::set_rank(int rank) { g_rank = rank; }
uint64_t CheckpointFaults::points() { return g_points; }

void CheckpointFaults::report() {
  if (fault_plan().kind == FaultPlan::count)
    std::fprintf(stderr, "rank %d: checkpoint I/O points so far: %llu\n", g_rank.load(),
                 static_cast<unsigned long long>(g_points.load()));
}

bool CheckpointFaults::point(const char* what, const std::string& file) {
  const uint64_t n = ++g_points;
  const FaultPlan& p = fault_plan();
  if (p.kind == FaultPlan::none || p.kind == FaultPlan::count || g_rank != p.rank || n != p.at)
    return false;
  if (p.kind == FaultPlan::kill) {
    std::fprintf(stderr, "zp fault injection: rank %d killed at checkpoint I/O point %llu (%s %s)\n",
                 g_rank.load(), static_cast<unsigned long long>(n), what, file.c_str());
    std::fflush(stderr);
    std::raise(SIGKILL);
  }
  return true;
}

namespace {

// A fault point before a syscall on `file`: ENOSPC injected as that call's failure.
void io_point(const char* what, const std::string& file) {
  if (CheckpointFaults::point(what, file))
    detail::throw_io_error(ENOSPC, fmt::format("{} {}", what, file),
                           "free space on the checkpoint's drive, or give --save-checkpoint another "
                           "directory; the last complete checkpoint is kept",
                           "fault injection", __FILE__, __LINE__);
}

void checked_fsync(int fd, const std::string& file) {
  io_point("fsync", file);
  errno = 0;
  const int r = ::fsync(fd);
  if (r != 0) detail::throw_io_error(detail::io_error_code(r, errno), "fsync " + file, "", "fsync", __FILE__, __LINE__);
}

void checked_rename(const std::string& from, const std::string& to) {
  io_point("rename", to);
  errno = 0;
  const int r = std::rename(from.c_str(), to.c_str());
  if (r != 0)
    detail::throw_io_error(detail::io_error_code(r, errno), fmt::format("rename {} to {}", from, to),
                           "", "rename", __FILE__, __LINE__);
}

}  // namespace

// ---- files ----------------------------------------------------------------------------------

CheckpointFile::CheckpointFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  errno = 0;
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0)
    detail::throw_io_error(detail::io_error_code(fd_, errno), "create " + tmp_,
                           "check that the checkpoint directory is writable", "open", __FILE__, __LINE__);
}

CheckpointFile::~CheckpointFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void CheckpointFile::append(const void* data, uint64_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t left = bytes;
  while (left > 0) {
    const uint64_t m = std::min<uint64_t>(left, uint64_t{1} << 30);
    io_point("write", tmp_);
    errno = 0;
    const ssize_t w = ::write(fd_, p, m);
    if (w <= 0)
      detail::throw_io_error(w == 0 ? EIO : detail::io_error_code(w, errno), "write " + tmp_,
                             "free space on the checkpoint's drive, or give --save-checkpoint "
                             "another directory; the last complete checkpoint is kept",
                             "write", __FILE__, __LINE__);
    crc_ = static_cast<uint32_t>(::crc32_z(crc_, p, static_cast<std::size_t>(w)));
    p += w;
    left -= static_cast<uint64_t>(w);
  }
  bytes_ += bytes;
}

void CheckpointFile::commit() {
  checked_fsync(fd_, tmp_);
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0)
    detail::throw_io_error(errno, "close " + tmp_, "", "close", __FILE__, __LINE__);
  checked_rename(tmp_, path_);
  committed_ = true;
}

void write_file_durably(const std::string& path, const std::string& text) {
  CheckpointFile f(path);
  f.append(text.data(), text.size());
  f.commit();
}

void fsync_dir(const std::string& dir) {
  errno = 0;
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) detail::throw_io_error(detail::io_error_code(fd, errno), "open directory " + dir, "", "open", __FILE__, __LINE__);
  try {
    checked_fsync(fd, dir);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

std::string checkpoint_dir_name(int64_t step) { return fmt::format("step-{:08d}", step); }

namespace {

// The step of a "step-NNNNNNNN" name, or -1.
int64_t step_of(const std::string& name) {
  if (name.size() < 6 || name.rfind("step-", 0) != 0) return -1;
  int64_t v = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (std::numeric_limits<int64_t>::max() - 9) / 10) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

// The complete step directories of `root`, newest first.
std::vector<std::pair<int64_t, std::string>> complete_steps(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    const int64_t s = step_of(name);
    if (s >= 0 && fs::exists(e.path() / "manifest.json", ec)) out.emplace_back(s, name);
  }
  std::sort(out.begin(), out.end(), std::greater<>());
  return out;
}

void remove_tree(const fs::path& p) noexcept {
  std::error_code ec;
  fs::remove(p / "manifest.json", ec);  // first: a half-removed directory is never "complete"
  fs::remove_all(p, ec);
}

}  // namespace

void prepare_checkpoint_dir(const std::string& root, const std::string& name) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec || !fs::is_directory(root))
    throw Error(fmt::format("--save-checkpoint: cannot create the directory {}: {}", root,
                            ec ? ec.message() : "a file is in the way"),
                "give a directory that can be created and written");
  // Leftovers of runs killed while writing are never checkpoints.
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 1 && n[0] == '.' && (n.ends_with(".tmp") || n.ends_with(".old")) &&
        step_of(n.substr(1, n.size() - 5)) >= 0)
      remove_tree(e.path());
  }
  const fs::path tmp = fs::path(root) / ("." + name + ".tmp");
  if (!fs::create_directory(tmp, ec) || ec)
    detail::throw_io_error(ec ? ec.value() : EEXIST, "create directory " + tmp.string(),
                           "check that the checkpoint directory is writable", "mkdir", __FILE__, __LINE__);
}

void commit_checkpoint_dir(const std::string& root, const std::string& name, int64_t keep) {
  const fs::path dir = fs::path(root) / name, tmp = fs::path(root) / ("." + name + ".tmp");
  fsync_dir(tmp.string());  // the shards' and the manifest's renames inside it
  // A checkpoint of this step already there (a run resumed from an older one): moved aside,
  // replaced, then removed.
  std::error_code ec;
  const fs::path old = fs::path(root) / ("." + name + ".old");
  const bool replacing = fs::exists(dir, ec);
  if (replacing) checked_rename(dir.string(), old.string());
  checked_rename(tmp.string(), dir.string());
  fsync_dir(root);
  write_file_durably((fs::path(root) / "latest").string(), name + "\n");
  fsync_dir(root);
  if (replacing) remove_tree(old);
  if (keep > 0) {
    const auto steps = complete_steps(root);
    for (std::size_t i = static_cast<std::size_t>(keep); i < steps.size(); ++i)
      if (steps[i].second != name) remove_tree(fs::path(root) / steps[i].second);
  }
}

void discard_checkpoint_dir(const std::string& root, const std::string& name) noexcept {
  remove_tree(fs::path(root) / ("." + name + ".tmp"));
}

std::string resolve_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw Error(fmt::format("--resume: {} is not a directory", dir),
                "give the directory --save-checkpoint wrote (or one of its step-* directories)");
  if (fs::exists(fs::path(dir) / "manifest.json", ec)) return dir;
  const fs::path latest = fs::path(dir) / "latest";
  if (fs::exists(latest, ec)) {
    std::string name = read_text_file(latest.string());
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (step_of(name) >= 0 && fs::exists(fs::path(dir) / name / "manifest.json", ec))
      return (fs::path(dir) / name).string();
  }
  const auto steps = complete_steps(dir);
  if (steps.empty())
    throw Error(fmt::format("--resume: no complete checkpoint in {}", dir),
                "a checkpoint is a step-* directory with a manifest.json, written by zero-run "
                "--save-checkpoint");
  return (fs::path(dir) / steps.front().second).string();
}

// ---- manifest -------------------------------------------------------------------------------

namespace {

DType dtype_from(const std::string& s, const Fields& f, std::string_view key) {
  if (s == "fp32") return DType::fp32;
  if (s == "fp16") return DType::fp16;
  if (s == "bf16") return DType::bf16;
  f.fail(key, "\"fp32\", \"fp16\" or \"bf16\"");
}

constexpr const char* kSchema = "zero-run/checkpoint/v1";

}  // namespace

json to_json(const CheckpointManifest& m) {
  json shards = json::array();
  for (const CheckpointShard& s : m.shards) {
    json entries = json::array();
    for (const CheckpointEntry& e : s.entries)
      entries.push_back({{"state", e.state}, {"dtype", std::string(to_string(e.dtype))},
                         {"flat", e.flat}, {"n", e.n}, {"offset", e.offset}});
    shards.push_back({{"file", s.file}, {"rank", s.rank}, {"bytes", s.bytes},
                      {"crc32", s.crc32}, {"entries", entries}});
  }
  return {{"schema", kSchema},
          {"model", m.model},
          {"model_config", json::parse(m.model_config, nullptr, false)},
          {"precision", m.precision},
          {"optimizer", m.optimizer},
          {"n_params", m.n_params},
          {"stage", m.stage},
          {"dp", m.dp},
          {"step", m.step},
          {"good_steps", m.good_steps},
          {"loss_scale", m.loss_scale},
          {"dpu_pending", m.dpu_pending},
          {"seed", m.seed},
          {"data", {{"origin", m.data_origin}, {"bytes", m.data_bytes},
                    {"sequences_per_step", m.sequences_per_step}}},
          {"optimizer_settings", {{"lr", m.lr}, {"weight_decay", m.weight_decay},
                                  {"grad_clip", m.grad_clip}, {"dpu_warmup", m.dpu_warmup}}},
          {"shards", shards}};
}

CheckpointManifest manifest_from_json(const json& j, const std::string& origin) {
  if (!j.is_object()) throw Error(fmt::format("{}: not a checkpoint manifest (not a JSON object)", origin));
  Fields f(j, origin);
  const std::string hint = "a manifest.json as zero-run --save-checkpoint writes it";
  f.only({"schema", "model", "model_config", "precision", "optimizer", "n_params", "stage", "dp",
          "step", "good_steps", "loss_scale", "dpu_pending", "seed", "data", "optimizer_settings",
          "shards"},
         hint);
  if (f.string("schema") != kSchema) f.fail("schema", fmt::format("\"{}\"", kSchema));
  CheckpointManifest m;
  m.model = f.string("model");
  if (const json* c = f.object("model_config")) m.model_config = c->dump();
  else f.fail("model_config", "the model's config (an object)");
  m.precision = f.string("precision");
  m.optimizer = f.string("optimizer");
  m.n_params = static_cast<uint64_t>(f.positive_int("n_params"));
  m.stage = static_cast<int>(f.nonneg_int("stage", 0));
  if (m.stage > 3) f.fail("stage", "0 to 3");
  m.dp = f.positive_int("dp");
  m.step = f.nonneg_int("step", 0);
  m.good_steps = f.nonneg_int("good_steps", 0);
  m.loss_scale = f.positive_number("loss_scale");
  m.dpu_pending = f.boolean("dpu_pending", false);
  m.seed = static_cast<uint64_t>(f.nonneg_int("seed", 0));
  if (const json* d = f.object("data")) {
    Fields fd(*d, origin, "data.");
    fd.only({"origin", "bytes", "sequences_per_step"}, hint);
    m.data_origin = fd.string("origin");
    m.data_bytes = static_cast<uint64_t>(fd.nonneg_int("bytes", 0));
    m.sequences_per_step = fd.nonneg_int("sequences_per_step", 0);
  }
  if (const json* o = f.object("optimizer_settings")) {
    Fields fo(*o, origin, "optimizer_settings.");
    fo.only({"lr", "weight_decay", "grad_clip", "dpu_warmup"}, hint);
    m.lr = fo.nonneg_number("lr", 0);
    m.weight_decay = fo.nonneg_number("weight_decay", 0);
    m.grad_clip = fo.nonneg_number("grad_clip", 0);
    m.dpu_warmup = fo.nonneg_int("dpu_warmup", 0);
  }
  if (!f.has("shards") || !j.at("shards").is_array()) f.fail("shards", "an array of files");
  const json& shards = j.at("shards");
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const std::string p = fmt::format("shards[{}].", i);
    if (!shards[i].is_object()) f.fail(p.substr(0, p.size() - 1), "an object");
    Fields fs_(shards[i], origin, p);
    fs_.only({"file", "rank", "bytes", "crc32", "entries"}, hint);
    CheckpointShard s;
    s.file = fs_.string("file");
    // A file name inside the step directory, never a path out of it.
    if (s.file.empty() || s.file.find('/') != std::string::npos || s.file == "." || s.file == "..")
      fs_.fail("file", "a file name in the checkpoint's directory");
    s.rank = static_cast<int>(fs_.nonneg_int("rank", 0));
    s.bytes = static_cast<uint64_t>(fs_.nonneg_int("bytes", 0));
    const int64_t crc = fs_.nonneg_int("crc32", 0);
    if (crc > 0xffffffffLL) fs_.fail("crc32", "a 32-bit CRC");
    s.crc32 = static_cast<uint32_t>(crc);
    if (!fs_.has("entries") || !shards[i].at("entries").is_array()) fs_.fail("entries", "an array");
    const json& es = shards[i].at("entries");
    for (std::size_t k = 0; k < es.size(); ++k) {
      const std::string q = fmt::format("{}entries[{}].", p, k);
      if (!es[k].is_object()) fs_.fail(fmt::format("entries[{}]", k), "an object");
      Fields fe(es[k], origin, q);
      fe.only({"state", "dtype", "flat", "n", "offset"}, hint);
      CheckpointEntry e;
      e.state = fe.string("state");
      e.dtype = dtype_from(fe.string("dtype"), fe, "dtype");
      e.flat = static_cast<uint64_t>(fe.nonneg_int("flat", 0));
      e.n = static_cast<uint64_t>(fe.positive_int("n"));
      e.offset = static_cast<uint64_t>(fe.nonneg_int("offset", 0));
      // Inside the model and inside the file, without overflow.
      if (e.flat > m.n_params || e.n > m.n_params - e.flat) fe.fail("n", fmt::format("elements within the model's {}", m.n_params));
      const uint64_t eb = dtype_bytes(e.dtype);
      if (e.offset > s.bytes || e.n > (s.bytes - e.offset) / eb)
        fe.fail("offset", fmt::format("a range inside the file's {} bytes", s.bytes));
      s.entries.push_back(std::move(e));
    }
    m.shards.push_back(std::move(s));
  }
  return m;
}

CheckpointManifest read_manifest(const std::string& step_dir) {
  const std::string path = (fs::path(step_dir) / "manifest.json").string();
  return manifest_from_json(parse_json_text(read_text_file(path), path), path);
}

void verify_shard(const std::string& step_dir, const CheckpointShard& s, void* buffer,
                  uint64_t buffer_bytes) {
  const std::string path = (fs::path(step_dir) / s.file).string();
  const std::string hint =
      "the checkpoint is damaged: resume from an older one (give its step-* directory to --resume)";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("checkpoint file {}: {}", path, std::strerror(errno)), hint);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != s.bytes) {
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    ::close(fd);
    throw Error(fmt::format("checkpoint file {} has {} bytes, its manifest says {} (truncated or "
                            "overwritten)", path, size, s.bytes), hint);
  }
  uint32_t crc = 0;
  for (uint64_t off = 0; off < s.bytes;) {
    const ssize_t r = ::pread(fd, buffer, std::min(buffer_bytes, s.bytes - off), static_cast<off_t>(off));
    if (r <= 0) {
      const int e = errno;
      ::close(fd);
      throw Error(fmt::format("checkpoint file {}: read at byte {}: {}", path, off,
                              r == 0 ? "unexpected end" : std::strerror(e)), hint);
    }
    crc = static_cast<uint32_t>(::crc32_z(crc, static_cast<const unsigned char*>(buffer), static_cast<std::size_t>(r)));
    off += static_cast<uint64_t>(r);
  }
  ::close(fd);
  if (crc != s.crc32)
    throw Error(fmt::format("checkpoint file {} is corrupted: CRC-32 {:08x}, its manifest says {:08x}",
                            path, crc, s.crc32), hint);
}

}  // namespace zp::runtime
