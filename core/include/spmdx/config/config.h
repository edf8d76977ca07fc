// The job config: one TOML file with torchtitan's section and key names where torchtitan has
// them, checked against a schema before anything runs. Every error names file:line:column,
// the key, what was expected, and the nearest known key for a typo.
//
//   [job] dump_folder, seed          [model] name, flavor, tokenizer
//   [training] steps, global_batch_size, local_batch_size, seq_len, max_norm, device
//   [optimizer] name, lr, beta1, beta2, eps, weight_decay
//   [lr_scheduler] warmup_steps, decay_type, min_lr_factor
//   [data] paths, seed               [parallelism] data_parallel_replicate_degree,
//   data_parallel_shard_degree, tensor_parallel_degree, fsdp_reshard_after_forward
//   [comm] backend, timeout_seconds, swap_at_step, swap_to, bucket_cap_mb, first_bucket_cap_mb,
//   overlap, prefetch
//   [hooks] enable, [hooks.<name>]   [checkpoint] enable, folder, interval, load_step
//   [metrics] log_freq               [plugins] paths
// The full list, with types, defaults and ranges: `spmdx run --print-config` or schema().
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace spmdx::config {

using Value = std::variant<std::int64_t, double, bool, std::string, std::vector<std::string>>;

enum class Type { integer, floating, boolean, string, string_list };

struct KeySpec {
  std::string key;  ///< "section.name"
  Type type;
  Value default_value;
  std::string help;
  double min = -1e300;                  ///< numbers: the smallest allowed
  double max = 1e300;                   ///< numbers: the largest allowed
  std::vector<std::string> choices;     ///< strings: the allowed values, when fixed
};

/// Every key the config knows, in file order.
const std::vector<KeySpec>& schema();

/// A bad config: `what()` is "FILE:LINE:COLUMN: message".
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Config {
 public:
  /// All defaults.
  Config();
  /// Reads and checks a TOML file. Throws ConfigError for a missing or unreadable file, TOML
  /// syntax, an unknown section or key (with "did you mean"), a wrong type or an out-of-range
  /// value.
  static Config load(const std::string& path);
  /// The same from TOML text; `source` names it in messages.
  static Config parse(const std::string& text, const std::string& source);

  /// Applies "--section.key value" overrides (as torchtitan's command line), value parsed by
  /// the key's type ("a,b" for lists). Throws ConfigError ("command line: ...") like load().
  void override_value(const std::string& key, const std::string& value);

  std::int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  const std::string& get_string(const std::string& key) const;
  const std::vector<std::string>& get_list(const std::string& key) const;

  /// A plugin's options table, e.g. plugin_options("hooks.timeline") for [hooks.timeline]
  /// (or --hooks.timeline.<option> value): option -> value as written (numbers and booleans
  /// as TOML prints them). The plugin checks its own options. Empty when absent.
  const std::map<std::string, std::string>& plugin_options(const std::string& table) const;
  /// Every plugin options table given: "hooks.timeline" -> its options.
  const std::map<std::string, std::map<std::string, std::string>>& plugin_option_tables() const noexcept { return plugin_options_; }

  /// The effective config as TOML, every key, in schema order.
  std::string to_toml() const;
  /// The effective config as key -> value in TOML's notation: every schema key, and
  /// "hooks.<name>.<option>" for plugin options (what ranks compare at rendezvous).
  std::map<std::string, std::string> settings() const;
  /// The file it came from ("" for defaults).
  const std::string& source() const noexcept { return source_; }
  /// Where the values of `keys` come from, to start an error message with: the file ("config"
  /// for defaults), or the command line for those given there:
  /// "configs/llama_debug.toml", "command line --training.steps 5",
  /// "configs/llama_debug.toml with command line --parallelism.tensor_parallel_degree 3".
  std::string where(const std::vector<std::string>& keys) const;

 private:
  const Value& get(const std::string& key) const;
  std::map<std::string, Value> values_;
  std::map<std::string, std::map<std::string, std::string>> plugin_options_;
  std::string source_;
  std::map<std::string, std::string> overrides_;  // key -> the text given on the command line
};

}  // namespace spmdx::config
