// zp/runtime/data.hpp: training data for zero-run: byte-level tokens (vocabulary 256) from any
// file, or an embedded default text, cut into sequences at positions that depend only on the
// seed, the step and the sequence's index in the global batch. So a run on N ranks sees the
// same global batch as a run on one rank with N times the micro-batch. Not a tokenizer.
//
// Example usage:
//   TokenData data = TokenData::load("");          // the embedded text; or a file path
//   data.fill(tokens, targets, B, T, seed, step, micro, rank * B);
#pragma once

#include <cstdint>
#include <string>

namespace zp::runtime {

class TokenData {
 public:
  // "" gives the embedded default text; otherwise the file's bytes (zp::Error when it cannot
  // be read or holds fewer than 2 bytes).
  static TokenData load(const std::string& path);

  const std::string& origin() const { return origin_; }
  uint64_t size_bytes() const { return bytes_.size(); }

  // tokens/targets (B,T): B sequences, numbered first_seq.. in the global batch of micro-step
  // `micro` of optimizer step `step`; targets are the tokens shifted by one (either pointer
  // may be null: tokens and targets are allocated at different ops). zp::Error when the
  // data is shorter than T + 1 bytes.
  void fill(int32_t* tokens, int32_t* targets, int64_t B, int64_t T, uint64_t seed, int64_t step,
            int64_t micro, int64_t first_seq) const;

 private:
  std::string bytes_, origin_;
};

}  // namespace zp::runtime
