// Tokenizers: UTF-8 text <-> token ids, for the data pipeline. No LibTorch, no JSON library here.
//
// Two kinds: ByteTokenizer (one id per byte, plus BOS and EOS; nothing to load) and
// HuggingFaceTokenizer, which reads a Hugging Face `tokenizer.json` and gives the same ids as the
// `tokenizers` library's `Tokenizer.from_file(path).encode(text).ids` (as torchtitan's
// HuggingFaceTokenizer uses it). encode_document() is what the data set trains on: one
// document's ids with BOS before and EOS after, as torchtitan's loader encodes each sample.
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
  /// The id that begins a document / ends one, when the tokenizer has one.
  virtual std::optional<std::int64_t> bos_id() const = 0;
  virtual std::optional<std::int64_t> eos_id() const = 0;
};

/// One document's ids as the data set trains on them: encode(text), with bos_id() put in front
/// and eos_id() after, each only when the tokenizer has it and encode() does not already add it
/// (a tokenizer.json post-processor that puts it in the ids of the empty text, e.g. Llama 3's
/// TemplateProcessing single = ["<|begin_of_text|>", "$A"] adds BOS, so only EOS is added).
/// This is torchtitan's HuggingFaceTokenizer.encode(text, add_bos=True, add_eos=True)
/// (torchtitan/components/tokenizer.py: hf_adds_bos/hf_adds_eos from encode("")), which its
/// text data sets call for every sample. Byte tokenizer: [256, bytes..., 257].
std::vector<std::int64_t> encode_document(const Tokenizer& tokenizer, std::string_view text);

/// Id i (0..255) is the byte i of the UTF-8 text; id 256 is BOS and 257 EOS (kBos, kEos), which
/// encode() never gives (encode_document() adds them); ids 258..263 are never used: vocab_size
/// 264 pads the vocabulary to a multiple of 8, so that tensor parallelism of degree 2, 4 or 8
/// splits the embedding and output rows evenly (Megatron pads its vocabulary likewise,
/// --make-vocab-size-divisible-by). Before documents kept
/// their boundaries the byte tokenizer had 256 ids and no BOS/EOS: a checkpoint of that time
/// (tokenizer "byte" in its metadata) is refused on resume, as its embeddings have 256 rows.
/// decode() returns the bytes as they are (invalid UTF-8 when ids split a character), and skips
/// BOS, EOS and unknown ids.
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr std::int64_t kBos = 256;
  static constexpr std::int64_t kEos = 257;
  std::vector<std::int64_t> encode(std::string_view text) const override;
  std::string decode(std::span<const std::int64_t> ids) const override;
  std::int64_t vocab_size() const override { return 264; }
  std::optional<std::int64_t> bos_id() const override { return kBos; }
  std::optional<std::int64_t> eos_id() const override { return kEos; }
};

/// A Hugging Face tokenizer.json. Supported: model BPE (merge ranks, unk_token, fuse_unk,
/// byte_fallback, continuing_subword_prefix, end_of_word_suffix, ignore_merges), normalizer
/// null, pre-tokenizer null or ByteLevel (GPT-2 regex and bytes_to_unicode alphabet),
/// added/special tokens (lstrip, rstrip, single_word), post-processor null, ByteLevel or
/// TemplateProcessing (its "single" template), decoder null or ByteLevel.
/// bos_id()/eos_id() come from "bos_token"/"eos_token" in the tokenizer_config.json beside
/// the file, when there is one (its added_tokens_decoder is not used, as in `tokenizers`);
/// without one the tokenizer has no BOS/EOS and encode_document() adds only what the
/// post-processor adds.
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
