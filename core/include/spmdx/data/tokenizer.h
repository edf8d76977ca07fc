// Tokenizers: UTF-8 text <-> token ids, for the data pipeline. No LibTorch, no JSON library here.
//
// Two kinds: ByteTokenizer (one id per byte, nothing to load) and HuggingFaceTokenizer, which
// reads a Hugging Face `tokenizer.json` and gives the same ids as the `tokenizers` library's
// `Tokenizer.from_file(path).encode(text).ids` (as torchtitan's HuggingFaceTokenizer uses it).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace spmdx::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// The ids of `text` (UTF-8), each in [0, vocab_size()). No BOS/EOS is added here, except
  /// what a tokenizer.json's own post-processor adds (as `tokenizers` does by default).
  virtual std::vector<std::int64_t> encode(std::string_view text) const = 0;
  /// The text of `ids`; ids the tokenizer does not know are skipped.
  virtual std::string decode(std::span<const std::int64_t> ids) const = 0;
  /// One more than the largest id: the number of rows an embedding table needs.
  virtual std::int64_t vocab_size() const = 0;
  virtual std::optional<std::int64_t> bos_id() const = 0;
  virtual std::optional<std::int64_t> eos_id() const = 0;
};

/// Id i (0..255) is the byte i of the UTF-8 text; vocab_size 256; no BOS/EOS, no special tokens.
/// decode() returns the bytes as they are (invalid UTF-8 when ids split a character).
class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<std::int64_t> encode(std::string_view text) const override;
  std::string decode(std::span<const std::int64_t> ids) const override;
  std::int64_t vocab_size() const override { return 256; }
  std::optional<std::int64_t> bos_id() const override { return std::nullopt; }
  std::optional<std::int64_t> eos_id() const override { return std::nullopt; }
};

/// A Hugging Face tokenizer.json. Supported: model BPE (merge ranks, unk_token, fuse_unk,
/// byte_fallback, continuing_subword_prefix, end_of_word_suffix, ignore_merges), normalizer
/// null, pre-tokenizer null or ByteLevel (GPT-2 regex and bytes_to_unicode alphabet),
/// added/special tokens (lstrip, rstrip, single_word), post-processor null, ByteLevel or
/// TemplateProcessing (its "single" template), decoder null or ByteLevel.
/// bos_id()/eos_id() come from "bos_token"/"eos_token" in the tokenizer_config.json beside
/// the file, when there is one (its added_tokens_decoder is not used, as in `tokenizers`).
/// decode() skips special tokens, as `tokenizers`' decode() does by default.
/// Text that is not valid UTF-8 is accepted: an invalid sequence counts as punctuation.
/// Throws std::runtime_error naming the file, the reason and what to do when a file is
/// missing, not JSON, or uses a model, normalizer, pre-tokenizer, post-processor or decoder
/// type that is not supported.
class HuggingFaceTokenizer final : public Tokenizer {
 public:
  explicit HuggingFaceTokenizer(const std::string& tokenizer_json);
  ~HuggingFaceTokenizer() override;
  std::vector<std::int64_t> encode(std::string_view text) const override;
  std::string decode(std::span<const std::int64_t> ids) const override;
  std::int64_t vocab_size() const override;
  std::optional<std::int64_t> bos_id() const override;
  std::optional<std::int64_t> eos_id() const override;
  /// The id of a token's text (an added token, else the model's vocabulary), as token_to_id.
  std::optional<std::int64_t> token_to_id(std::string_view token) const;

 private:
  struct Impl;
  std::unique_ptr<const Impl> impl_;
};

/// "byte" -> ByteTokenizer; otherwise a path to a tokenizer.json, or to a folder holding one.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec);

}  // namespace spmdx::data
