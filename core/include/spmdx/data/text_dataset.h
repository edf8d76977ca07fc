// A text data set for language-model training: files tokenized into one stream of ids, from
// which each step takes a batch of windows at seeded random positions. No LibTorch here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/data/tokenizer.h"

namespace spmdx::data {

struct TextDatasetOptions {
  /// Plain text files (one document each) or JSON Lines files (one document per line, in its
  /// "text" field; blank lines are skipped). A ".jsonl" or ".ndjson" file is JSON Lines, a ".txt"
  /// file plain text; any other is JSON Lines when its first non-blank line is a JSON object.
  std::vector<std::string> paths;
  std::int64_t batch_size = 8;  ///< global rows per step, over all ranks
  std::int64_t seq_len = 2048;  ///< tokens per row
  std::uint64_t seed = 0;
  int rank = 0;  ///< data-parallel rank: gets rows [rank*B/W, (rank+1)*B/W) of each global batch
  int world_size = 1;
};

/// One rank's rows of a step. tokens and labels: int64 ids, row-major [rows, seq_len];
/// labels[r][t] is the token after tokens[r][t] in the stream (next-token targets, as torchtitan).
struct Batch {
  std::int64_t rows = 0;
  std::int64_t seq_len = 0;
  std::vector<std::int64_t> tokens;
  std::vector<std::int64_t> labels;
};

/// Where the data set is, for checkpoints: the number of global rows (samples) taken so far.
/// It does not depend on rank or world size, so a run may resume on another mesh.
struct TextDatasetState {
  std::uint64_t samples = 0;
  friend bool operator==(const TextDatasetState&, const TextDatasetState&) = default;
};

class TextDataset {
 public:
  /// Reads and tokenizes every file; each non-empty document is followed by the tokenizer's EOS
  /// (when it has one). Throws std::runtime_error naming the file (and line, for JSON Lines)
  /// when a file is missing or unreadable, a line is not JSON or has no string "text", the
  /// data holds no tokens, or the stream is shorter than seq_len + 1 tokens; and
  /// std::invalid_argument for batch_size or seq_len < 1, world_size < 1 or > batch_size, or
  /// rank outside [0, world_size).
  TextDataset(const TextDatasetOptions& options, const Tokenizer& tokenizer);

  /// The next step's rows for this rank. Global sample s starts at a position drawn from
  /// (seed, s) alone: splitmix64 (Steele et al. 2014) of splitmix64(seed) + s * 0x9E3779B97F4A7C15,
  /// mapped to [0, n_tokens - seq_len) by a 128-bit multiply (Lemire 2019). The same on every
  /// platform, and the same global batch for any world size.
  Batch next_batch();

  /// Where global sample `sample` starts in stream(): its tokens are [start, start + seq_len).
  std::int64_t sample_start(std::uint64_t sample) const;

  TextDatasetState state() const { return state_; }
  void restore(const TextDatasetState& state) { state_ = state; }

  /// The whole token stream, int64 ids.
  const std::vector<std::int64_t>& stream() const { return stream_; }
  const TextDatasetOptions& options() const { return options_; }

 private:
  TextDatasetOptions options_;
  std::vector<std::int64_t> stream_;
  TextDatasetState state_;
};

}  // namespace spmdx::data
