// Small text helpers shared by the error messages of the config, the registry and the
// strategies ("did you mean ...").
// A host service of the plugin ABI (plugin.h): declared here, defined in libspmdx_host,
// versioned with SPMDX_ABI_MAJOR.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace spmdx {

/// Levenshtein distance: the fewest single-character insertions, deletions and substitutions
/// that turn `a` into `b`.
std::size_t edit_distance(const std::string& a, const std::string& b);

/// The word of `known` nearest to `word` by edit_distance (the first of equally near ones),
/// when at most `max_distance` edits away; "" otherwise. Letter case is not an edit: "ONEDNN"
/// is 0 edits from "onednn". For "did you mean" hints.
std::string nearest_word(const std::string& word, const std::vector<std::string>& known, std::size_t max_distance);

/// "1.5 MiB": bytes in binary units (B, KiB, MiB, GiB, TiB), one decimal.
std::string human_bytes(double bytes);

/// "rank 3" or "ranks 0, 1, 3", in the order given (for messages naming ranks).
std::string rank_list(const std::vector<int>& ranks);

/// Seconds to one decimal, without trailing zeros: "20", "1.5" (for messages naming waits).
std::string seconds_text(double seconds);

/// `text` cut at each '\n' (which is dropped): n newlines give n + 1 lines, so "" gives one
/// empty line and "a\n" gives "a" and "". For messages that say one problem per line.
std::vector<std::string> split_lines(std::string_view text);

/// The items joined by `separator`: join({"a", "b"}) is "a, b"; an empty list gives "".
/// For messages that list names.
template <class Range>
std::string join(const Range& items, std::string_view separator = ", ") {
  std::string out;
  bool first = true;
  for (const auto& item : items) {
    if (!first) out += separator;
    out += item;
    first = false;
  }
  return out;
}

/// A size in bytes as people write it: a non-negative number, optionally a space, then a unit:
/// none or B (bytes); K, M, G, T or KiB, MiB, GiB, TiB (powers of 1024, as nccl-tests' -b 4K);
/// KB, MB, GB, TB (powers of 1000, SI). "262144", "256K", "4MiB", "1.5GB", "64 M". The result is
/// rounded down to whole bytes. Throws std::invalid_argument naming the text and giving examples.
std::uint64_t parse_bytes(std::string_view text);

/// The most arrays and objects a JSON document spmdx reads may nest (toml++'s limit for TOML,
/// TOML_MAX_NESTED_VALUES, is the same). The deepest spmdx or torch.export writes is about 10.
inline constexpr std::size_t kMaxJsonNesting = 256;

/// Refuses JSON text nesting arrays and objects more than kMaxJsonNesting deep, before it is
/// parsed: nlohmann::json parses any depth, but copying, comparing or dumping a value recurses
/// once a level, and a file nesting 100,000 deep overflows the stack (a crash, not an error).
/// A scan of `json_text` (bytes; strings and their escapes skipped), not a validation: text
/// that is not JSON passes, for the parser to refuse. Throws std::invalid_argument saying how
/// deep and at which byte; the caller names the file.
void check_json_nesting(std::string_view json_text);

/// FNV-1a, 64 bits (Fowler, Noll, Vo), of `bytes` as 16 lowercase hex digits: the same on
/// every machine and build, unlike std::hash. A fingerprint, not a cryptographic hash.
std::string fnv1a_hex(std::string_view bytes);

}  // namespace spmdx
