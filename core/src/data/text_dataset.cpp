#include "spmdx/data/text_dataset.h"

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "spmdx/files.h"
#include "spmdx/text.h"

namespace spmdx::data {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::uint64_t kGamma = 0x9E3779B97F4A7C15ull;

// splitmix64 (Steele, Lea & Flood 2014): one step from state x.
std::uint64_t splitmix64(std::uint64_t x) {
  x += kGamma;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::string read_file(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw std::runtime_error("text data set: '" + path + "' does not exist. Check the data path (plain text or .jsonl).");
  }
  try {
    return read_file_bytes(path);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error("text data set: cannot read '" + path + "': " + e.what() + ". Name a text or JSON Lines file this user may read.");
  }
}

std::string_view trim(std::string_view line) {
  const auto first = line.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return {};
  return line.substr(first, line.find_last_not_of(" \t\r\n") - first + 1);
}

bool is_json_lines(const std::string& path, const std::string& text) {
  const std::string ext = fs::path(path).extension().string();
  if (ext == ".jsonl" || ext == ".ndjson") return true;
  if (ext == ".txt") return false;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const std::string_view t = trim(line);
    if (t.empty()) continue;
    if (t.front() != '{') return false;
    try {
      check_json_nesting(t);
    } catch (const std::invalid_argument&) {
      return true;  // a JSON object, to be refused as a line of JSON Lines
    }
    const json j = json::parse(t, nullptr, /*allow_exceptions=*/false);
    return j.is_object();
  }
  return false;
}

// Calls `document` with each document's text: a JSON Lines record, or a plain text file cut
// at `separator` (when not empty).
// Returns how many separators a plain text file held (-1 for JSON Lines).
template <class F>
std::int64_t for_each_document(const std::string& path, const std::string& text, const std::string& separator, F&& document) {
  if (!is_json_lines(path, text)) {
    if (separator.empty()) {
      document(std::string_view(text));
      return 0;
    }
    const std::string_view all(text);
    std::size_t begin = 0;
    std::int64_t found = 0;
    for (std::size_t at; (at = all.find(separator, begin)) != std::string_view::npos; begin = at + separator.size(), ++found) {
      document(all.substr(begin, at - begin));
    }
    document(all.substr(begin));
    return found;
  }
  std::istringstream lines(text);
  std::size_t number = 0;
  for (std::string line; std::getline(lines, line);) {
    ++number;
    if (trim(line).empty()) continue;
    const std::string where = "text data set: '" + path + "' line " + std::to_string(number);
    json j;
    try {
      check_json_nesting(line);
      j = json::parse(line);
    } catch (const std::exception& e) {
      throw std::runtime_error(where + " is not valid JSON (" + e.what() + "). Each line of a JSON Lines file must be one JSON object.");
    }
    if (!j.is_object() || !j.contains("text")) {
      throw std::runtime_error(where + " has no \"text\" field. Each line must be an object like {\"text\": \"...\"}.");
    }
    if (!j["text"].is_string()) throw std::runtime_error(where + ": \"text\" is not a string.");
    document(std::string_view(j["text"].get_ref<const std::string&>()));
  }
  return -1;
}

}  // namespace

TextDataset::TextDataset(const TextDatasetOptions& options, const Tokenizer& tokenizer) : options_(options) {
  const auto& o = options_;
  if (o.batch_size < 1 || o.seq_len < 1) {
    throw std::invalid_argument("text data set: batch_size (" + std::to_string(o.batch_size) + ") and seq_len (" +
                                std::to_string(o.seq_len) + ") must be at least 1");
  }
  if (o.world_size < 1 || o.world_size > o.batch_size || o.rank < 0 || o.rank >= o.world_size) {
    throw std::invalid_argument("text data set: rank " + std::to_string(o.rank) + " of world size " +
                                std::to_string(o.world_size) + " with batch_size " + std::to_string(o.batch_size) +
                                ": need 0 <= rank < world_size <= batch_size");
  }
  if (o.paths.empty()) throw std::invalid_argument("text data set: no files given. Set the data path.");
  std::int64_t text_files = 0, separators = 0;
  for (const std::string& path : o.paths) {
    const std::int64_t found = for_each_document(path, read_file(path), o.document_separator, [&](std::string_view text) {
      if (text.empty()) return;
      const std::vector<std::int64_t> ids = encode_document(tokenizer, text);
      stream_.insert(stream_.end(), ids.begin(), ids.end());
    });
    if (found >= 0) ++text_files, separators += found;
  }
  std::string files;
  for (const std::string& path : o.paths) files += (files.empty() ? "'" : ", '") + path + "'";
  separators_ = text_files > 0 ? separators : -1;
  const std::string hold = o.paths.size() == 1 ? " holds " : " hold ";
  if (stream_.empty()) throw std::runtime_error("text data set: " + files + hold + "no text (0 tokens). Point the data path at non-empty files.");
  if (static_cast<std::int64_t>(stream_.size()) < o.seq_len + 1) {
    throw std::runtime_error("text data set: " + files + hold + std::to_string(stream_.size()) +
                             " tokens, but a sample needs seq_len + 1 = " + std::to_string(o.seq_len + 1) +
                             " (its labels reach one token further). Use a shorter seq_len or more data.");
  }
}

std::int64_t TextDataset::sample_start(std::uint64_t sample) const {
  const std::uint64_t r = splitmix64(splitmix64(options_.seed) + sample * kGamma);
  const auto starts = static_cast<std::uint64_t>(static_cast<std::int64_t>(stream_.size()) - options_.seq_len);
  return static_cast<std::int64_t>((static_cast<unsigned __int128>(r) * starts) >> 64);
}

Batch TextDataset::next_batch() {
  const auto& o = options_;
  const std::int64_t first = o.rank * o.batch_size / o.world_size;
  const std::int64_t last = (o.rank + 1) * o.batch_size / o.world_size;
  Batch batch{last - first, o.seq_len, {}, {}};
  batch.tokens.reserve(static_cast<std::size_t>(batch.rows * o.seq_len));
  batch.labels.reserve(batch.tokens.capacity());
  for (std::int64_t row = first; row < last; ++row) {
    const auto start = stream_.begin() + sample_start(state_.samples + static_cast<std::uint64_t>(row));
    batch.tokens.insert(batch.tokens.end(), start, start + o.seq_len);
    batch.labels.insert(batch.labels.end(), start + 1, start + o.seq_len + 1);
  }
  state_.samples += static_cast<std::uint64_t>(o.batch_size);
  return batch;
}

}  // namespace spmdx::data
