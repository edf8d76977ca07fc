// Small text helpers shared by the error messages of the config, the registry and the
// strategies ("did you mean ...").
#pragma once

#include <cstddef>
#include <string>

namespace spmdx {

/// Levenshtein distance: the fewest single-character insertions, deletions and substitutions
/// that turn `a` into `b`.
std::size_t edit_distance(const std::string& a, const std::string& b);

/// "1.5 MiB": bytes in binary units (B, KiB, MiB, GiB, TiB), one decimal.
std::string human_bytes(double bytes);

}  // namespace spmdx
