// zp/runtime/checkpoint.hpp: training checkpoints on disk (zero-run --save-checkpoint,
// --resume): the directory layout, the manifest, the crash-safe file protocol, and the fault
// injection its tests use. The states themselves are streamed by the Engine
// (engine_checkpoint.cpp), which knows where each one lives (device, host tier, swap file).
// Not a model export: --save-weights writes the fp32 weights alone.
//
// A checkpoint root DIR holds:
//   DIR/step-00000008/rank0.bin ...   each writing rank's owned elements of every state
//   DIR/step-00000008/manifest.json   the model, the strategy, the step and the loss scaler,
//                                     and per file its size, CRC-32 and what lies where
//   DIR/latest                        "step-00000008": the newest complete checkpoint
// Every file is written under a temporary name, fsynced and renamed; a step directory is
// assembled as .step-00000008.tmp and appears by one rename once its manifest is in it, so a
// step-* directory is always whole; `latest` is replaced after it. A process killed at any
// point leaves the previous checkpoint loadable. The elements are indexed in the model's flat
// order, so a checkpoint saved at one data-parallel degree or ZeRO stage resumes at another
// (each rank reads the pieces of its new partition from whichever files hold them).
//
// Example usage:
//   const std::string dir = resolve_checkpoint("ckpt");        // ckpt/step-00000008
//   const CheckpointManifest m = read_manifest(dir);
//   engine.load_checkpoint(dir, m);                            // every rank
//   ... engine.step() ...
//   engine.save_checkpoint("ckpt", /*keep=*/3);                // every rank
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "zp/runtime/dtype.hpp"

namespace zp::runtime {

// Elements [flat, flat + n) of a state (in the model's flat order), stored at `offset` bytes
// of their file as n values of `dtype`.
struct CheckpointEntry {
  std::string state;  // "params", "master", "exp_avg", "exp_avg_sq", "momentum", "params.dpu"
  DType dtype = DType::fp32;
  uint64_t flat = 0, n = 0, offset = 0;
};

struct CheckpointShard {
  std::string file;  // in the step directory: rank<r>.bin
  int rank = 0;
  uint64_t bytes = 0;
  uint32_t crc32 = 0;  // zlib's CRC-32 of the whole file
  std::vector<CheckpointEntry> entries;
};

struct CheckpointManifest {
  // What the states belong to: a resume with another model, precision or optimizer is refused.
  std::string model;         // the model's name
  std::string model_config;  // its config (models::to_hf_config), as JSON text; an object in the file
  std::string precision, optimizer;
  uint64_t n_params = 0;
  // Where the states came from (a resume may change them: the partitions are re-cut).
  int stage = 0;
  int64_t dp = 1;
  // The training state beyond the tensors. Data order and dropout masks are functions of
  // (seed, step, micro-step, sequence) (data.hpp, Engine::dropout_key): the seed and the next
  // step are all of their state.
  int64_t step = 0;          // optimizer steps taken; the next is step + 1
  int64_t good_steps = 0;    // fp16: steps since the loss scale last changed
  double loss_scale = 1;
  bool dpu_pending = false;  // a delayed update computed but not yet applied ("params.dpu")
  uint64_t seed = 0;
  std::string data_origin;   // the training text (a path, or "embedded")
  uint64_t data_bytes = 0;
  int64_t sequences_per_step = 0;  // the global batch (micro-batch x dp x grad_accum)
  // The optimizer's settings, taken on resume unless given again.
  double lr = 0, weight_decay = 0, grad_clip = 0;
  int64_t dpu_warmup = 0;
  std::vector<CheckpointShard> shards;
};

nlohmann::json to_json(const CheckpointManifest& m);
// zp::Error naming the file and the field for anything missing, mistyped or unknown.
CheckpointManifest manifest_from_json(const nlohmann::json& j, const std::string& origin);

// "step-00000008".
std::string checkpoint_dir_name(int64_t step);
// The step directory to resume from: `dir` itself when it holds a manifest.json, else the one
// DIR/latest names, else (a kill between a step directory's rename and latest's) the newest
// complete step-* directory. zp::Error with a hint when there is none.
std::string resolve_checkpoint(const std::string& dir);
// The manifest of a step directory, checked: zp::Error naming the file.
CheckpointManifest read_manifest(const std::string& step_dir);
// Every shard's size and CRC-32 against the manifest: zp::Error naming the first file that is
// missing, truncated or corrupted.
void verify_shard(const std::string& step_dir, const CheckpointShard& s, void* buffer,
                  uint64_t buffer_bytes);

// Crash-safe writing. Each I/O call is a numbered fault point (see CheckpointFaults).
class CheckpointFile {
 public:
  // Creates `path`.tmp (truncating a leftover); IoError naming it when it cannot.
  explicit CheckpointFile(std::string path);
  ~CheckpointFile();  // closes; removes the temporary unless committed
  CheckpointFile(const CheckpointFile&) = delete;
  CheckpointFile& operator=(const CheckpointFile&) = delete;
  void append(const void* data, uint64_t bytes);  // IoError (ENOSPC, EIO, ...) naming the file
  void commit();  // fsync, close, rename to `path`
  uint64_t bytes() const { return bytes_; }
  uint32_t crc32() const { return crc_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t bytes_ = 0;
  uint32_t crc_ = 0;
  bool committed_ = false;
};

// `text` to `path` through a temporary file, fsynced and renamed.
void write_file_durably(const std::string& path, const std::string& text);
// fsync of a directory (its entries: a rename is durable after it).
void fsync_dir(const std::string& dir);
// Removes leftover temporary step directories, readies DIR/.<name>.tmp, empty.
void prepare_checkpoint_dir(const std::string& root, const std::string& name);
// Makes DIR/.<name>.tmp (holding its manifest) DIR/<name>, points DIR/latest at it, and keeps
// the `keep` newest complete step directories (0: all).
void commit_checkpoint_dir(const std::string& root, const std::string& name, int64_t keep);
// Removes DIR/.<name>.tmp (a checkpoint that failed part-way); never throws.
void discard_checkpoint_dir(const std::string& root, const std::string& name) noexcept;

// Fault injection for the tests (ZP_CHECKPOINT_FAULT in the environment of one rank, or of
// the rank ZP_CHECKPOINT_FAULT_RANK names): "kill@N" raises SIGKILL at this rank's N-th
// checkpoint I/O point (every write, fsync, rename and directory fsync, counted from the
// start of the process), "enospc@N" makes the N-th such point a write that fails with ENOSPC,
// "count" prints each save's count of points on stderr. Unset: nothing happens.
struct CheckpointFaults {
  // The point about to happen (`what`: the call and the file); SIGKILL or true (fail it
  // with ENOSPC) when it is the one asked for.
  static bool point(const char* what, const std::string& file);
  static uint64_t points();  // points so far in this process
  static void report();      // "count": "checkpoint I/O points so far: N" on stderr
  static void set_rank(int rank);
};

}  // namespace zp::runtime
