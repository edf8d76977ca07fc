// A text data set for language-model training: files cut into documents, each tokenized with
// BOS before and EOS after (encode_document), packed one after another into one stream of ids
// (BOS doc EOS BOS doc EOS ...), from which each step takes a batch of windows at seeded random
// positions. No LibTorch here.
//
// torchtitan packs the same stream (its HuggingFaceDataset encodes each sample with
// add_bos=True, add_eos=True and appends it to a buffer), but cuts it into consecutive rows of
// seq_len + 1 tokens in order. spmdx cuts each row at a seeded random position instead, so that
// a step's global batch depends on (data.seed, sample index) alone: the same for any world size
// and after a resume on another mesh. A row may therefore span a document boundary, as a
// torchtitan row does; attention is not masked at boundaries in either.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/data/tokenizer.h"

namespace spmdx::data {

struct TextDatasetOptions {
  /// Plain text files (one document each, unless document_separator splits them) or JSON Lines
  /// files (one document per line, in its "text" field; blank lines are skipped). A ".jsonl" or
  /// ".ndjson" file is JSON Lines, a ".txt" file plain text; any other is JSON Lines when its
  /// first non-blank line is a JSON object.
  std::vector<std::string> paths;
  std::int64_t batch_size = 8;  ///< global rows per step, over all ranks
  std::int64_t seq_len = 2048;  ///< tokens per row
  std::uint64_t seed = 0;
  int rank = 0;  ///< data-parallel rank: gets rows [rank*B/W, (rank+1)*B/W) of each global batch
  int world_size = 1;
  /// data.document_separator: when not empty, a plain text file is split into documents at each
  /// occurrence of it (exactly as Python's str.split, the separator dropped), e.g. "%\n" for
  /// the fortune files (/usr/share/games/fortunes/*, whose fortunes are separated by a line
  /// holding "%"). JSON Lines records are documents as they are and are not split.
  std::string document_separator = {};
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
  /// Reads every file and cuts it into documents (each JSON Lines record, each text file or,
  /// with document_separator, each piece of one); each non-empty document becomes
  /// encode_document(tokenizer, text) = [BOS] ids [EOS] (see tokenizer.h), appended to the
  /// stream in file order. Empty documents (an empty file, "text": "", two separators in a row or
  /// one at the end of a file) are skipped, where torchtitan would pack a lone BOS EOS. Throws std::runtime_error naming the file (and line, for JSON Lines)
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

  /// How many times document_separator occurred in the plain text files (-1: there are none,
  /// only JSON Lines). 0 with a separator set usually means it was mistyped.
  std::int64_t separators() const { return separators_; }

  TextDatasetState state() const { return state_; }
  void restore(const TextDatasetState& state) { state_ = state; }

  /// The whole token stream, int64 ids: BOS doc EOS BOS doc EOS ... (as the tokenizer has them).
  const std::vector<std::int64_t>& stream() const { return stream_; }
  const TextDatasetOptions& options() const { return options_; }

 private:
  TextDatasetOptions options_;
  std::vector<std::int64_t> stream_;
  TextDatasetState state_;
  std::int64_t separators_ = -1;
};

}  // namespace spmdx::data
