// torchtitan's config keys that spmdx does not have under the same name: each is an alias of an
// spmdx key (torchtitan's older or newer name for the same setting), ignored with a reason (it
// changes nothing spmdx computes, or is an option of a feature that is off), or a feature spmdx
// does not have yet (accepted only at the value that turns it off). From torchtitan's JobConfig
// (torchtitan/config/job_config.py) and its TOML configs, 2024 to 2025.
#pragma once

#include <string>
#include <vector>

namespace spmdx::config {

struct TitanKey {
  enum class Kind { alias, ignored, unsupported };
  std::string key;       ///< "section.name", or "section.*" for a whole section
  Kind kind;
  std::string target;    ///< alias: the spmdx key; unsupported: the feature ("pipeline parallelism")
  std::vector<std::string> off;  ///< unsupported: the values (as TOML writes them) that turn it off
  std::string why;       ///< ignored: the reason; unsupported: what to do instead (may be "")
};

/// The entry for `key` ("section.name"; nested tables dotted), exact keys before "section.*";
/// null when torchtitan has no such key.
const TitanKey* find_titan_key(const std::string& key);

/// Sections torchtitan has and spmdx has not ("profiling", "activation_checkpoint", ...).
bool is_titan_section(const std::string& section);

}  // namespace spmdx::config
