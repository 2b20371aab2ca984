// data.cpp: byte-level sequences from a file or the embedded text, at seeded positions.
#include "zp/runtime/data.hpp"

#include <fmt/format.h>

#include "zp/error.hpp"
#include "zp/json_fields.hpp"
#include "zp/runtime/rng.hpp"

namespace zp::runtime {

namespace {

// The default corpus: plain English about the thing being trained, enough for a small model
// to learn byte statistics and for the loss to fall visibly within a few steps.
constexpr const char* kEmbeddedText = R"text(
Training a large model is mostly a question of memory. Every parameter costs bytes several
times over: once for the sixteen-bit copy that forward and backward read, once for its
gradient, four bytes for the master copy the optimizer keeps in full precision, and eight more
for the two moments of Adam. Data parallelism keeps a whole replica of all of this on every
device, which is simple and fast but wasteful. The Zero Redundancy Optimizer removes the
waste in three stages. The first stage splits the optimizer states among the ranks, so each
rank updates only its own slice and then shares the new parameters. The second stage also
splits the gradients: during the backward pass each gradient is reduced straight to the rank
that owns it, and the others free their copy. The third stage splits the parameters too, and
gathers each layer's weights just before the layer runs, then lets them go again.

Memory that the model states do not take is taken by activations. Every layer keeps what its
backward pass will need: the inputs of its matrix products, the attention probabilities, the
outputs of its normalisations. For long sequences the attention probabilities grow with the
square of the sequence length and soon dominate. Recomputation trades time for memory: keep
only the input of each layer and run the layer again when the backward pass reaches it.
Selective recomputation keeps everything but the attention core, which is cheap to redo and
expensive to keep. Buffers come on top: the buckets that gather gradients before they are
reduced, the parameters gathered ahead of their use, the logits of the language model head.
And the allocator itself keeps memory it cannot use, because freed blocks rarely fit the next
request exactly.

Offloading moves what the device does not need to hold. The optimizer step touches every
parameter once and does little arithmetic per byte, so it runs well on the host processor
while the device computes the next forward and backward pass. The gradients stream to the
host as the backward pass produces them; the new parameters stream back before they are
needed. With fast drives even the host is not the limit: optimizer states and parameters can
live in swap files and be read ahead of their use, a chunk at a time, while the previous
chunk is being written back.

A plan that predicts all of this before any hardware is rented is worth having only if it is
right. So the plan is executed for real, every byte is counted as it is allocated, and the
prediction is held against the measurement. When they disagree, one of them is wrong, and the
difference says where to look.
)text";

}  // namespace

TokenData TokenData::load(const std::string& path) {
  TokenData d;
  if (path.empty()) {
    d.bytes_ = kEmbeddedText;
    d.origin_ = "embedded text";
  } else {
    d.bytes_ = read_text_file(path);
    d.origin_ = path;
  }
  if (d.bytes_.size() < 2)
    throw Error(fmt::format("{}: {} bytes is too little data to train on", d.origin_, d.bytes_.size()),
                "give a text file of at least a few kilobytes (--data)");
  return d;
}

void TokenData::fill(int32_t* tokens, int32_t* targets, int64_t B, int64_t T, uint64_t seed,
                     int64_t step, int64_t micro, int64_t first_seq) const {
  const uint64_t n = bytes_.size();
  if (n < static_cast<uint64_t>(T) + 1)
    throw Error(fmt::format("{}: {} bytes is shorter than one sequence of {} tokens plus its "
                            "target", origin_, n, T),
                "use a longer file or a shorter --seq");
  const uint64_t span = n - static_cast<uint64_t>(T);  // start positions 0 .. n-T-1
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t q = static_cast<uint64_t>(first_seq + b);
    const uint64_t key = mix64(mix64(mix64(seed ^ 0x5eedda7aULL) + static_cast<uint64_t>(step)) +
                               static_cast<uint64_t>(micro) * 0x10001ULL + q);
    const uint64_t start = key % span;
    for (int64_t t = 0; t < T; ++t) {
      const uint64_t at = start + static_cast<uint64_t>(t);
      if (tokens != nullptr) tokens[b * T + t] = static_cast<unsigned char>(bytes_[at]);
      if (targets != nullptr) targets[b * T + t] = static_cast<unsigned char>(bytes_[at + 1]);
    }
  }
}

}  // namespace zp::runtime
