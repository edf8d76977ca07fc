// The job config: one TOML file with torchtitan's section and key names where torchtitan has
// them, checked against a schema before anything runs. Every error names file:line:column,
// the key, what was expected, and the nearest known key for a typo.
//
//   [job] dump_folder, seed          [model] name, flavor, tokenizer, path, inputs, loss
//   [training] steps, global_batch_size, local_batch_size, seq_len, max_norm, device
//   [optimizer] name, lr, beta1, beta2, eps, weight_decay
//   [lr_scheduler] warmup_steps, decay_ratio, decay_type, min_lr_factor
//   [data] paths, seed               [parallelism] data_parallel_replicate_degree,
//   data_parallel_shard_degree, tensor_parallel_degree, fsdp_reshard_after_forward,
//   [parallelism.tp_plan] (parameter glob -> colwise | rowwise | replicate | shard(d)),
//   [parallelism.strategies] (mesh dim -> strategy plugin: dp_replicate = "data_parallel", ...)
//   [comm] backend, timeout_seconds, swap_at_step, swap_to, bucket_cap_mb, first_bucket_cap_mb,
//   overlap, prefetch
//   [hooks] enable, [hooks.<name>]   [checkpoint] enable, folder, interval, load_step
//   [metrics] log_freq               [plugins] paths
//   [debug] dump_batches, dump_initial_weights
// The full list, with types, defaults and ranges: `spmdx run --print-config` or schema().
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <set>
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

/// `s` as a TOML basic string, quoted: quotes, backslashes and control characters escaped (a
/// separator such as "%\n" prints back as the value it is).
std::string toml_string(const std::string& s);

/// Every key the config knows, in file order.
const std::vector<KeySpec>& schema();

/// "; did you mean 'x'?" for the word of `known` nearest to `word`, only when it is a plausible
/// typo (1 edit for words of up to 3 characters, 2 up to 8, 3 beyond); "" otherwise. The hint of
/// every config message, and of the command line's (an unknown command).
std::string did_you_mean(const std::string& word, const std::vector<std::string>& known);

/// A bad config: `what()` is "FILE:LINE:COLUMN: message".
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Config {
 public:
  /// All defaults.
  Config();
  /// Reads a TOML file and then "--section.key value" (or "--section.key=value") command-line
  /// overrides, as torchtitan's, and checks all of it: TOML syntax, unknown sections and keys
  /// (a hint only for the same name in another section or a plausible typo in the same one),
  /// types and ranges. torchtitan's keys are read as torchtitan means them: its names for
  /// spmdx's keys and values (checkpoint.enable_checkpoint, model.name = "llama3") are
  /// accepted; keys that change nothing spmdx computes are ignored (ignored()); features spmdx
  /// does not have yet are refused unless switched off. Throws one ConfigError listing every
  /// problem (file:line:column each) and what is ignored, unless `throw_on_problems` is false:
  /// then problems() lists them and bad keys keep their defaults. A missing or unreadable
  /// file, or TOML that does not parse, throws at once.
  static Config load(const std::string& path, const std::vector<std::string>& overrides = {}, bool throw_on_problems = true);
  /// The same from TOML text; `source` names it in messages.
  static Config parse(const std::string& text, const std::string& source, bool throw_on_problems = true);

  /// Applies one override, value parsed by the key's type ("a,b" for lists). Throws
  /// ConfigError ("command line: --key: ...") for its problem.
  void override_value(const std::string& key, const std::string& value);

  /// The problems found ("file:line:col: message"), when loaded without throwing.
  const std::vector<std::string>& problems() const noexcept { return problems_; }
  /// The torchtitan keys read and ignored ("file:line:col: key = value: why"), in file order.
  std::vector<std::string> ignored() const;
  /// How `key` was given, for messages: "model.hf_assets_path (torchtitan's name for
  /// model.tokenizer)" when set under torchtitan's name, else the key itself.
  std::string given_as(const std::string& key) const;
  /// Whether a key starting with `prefix` ("parallelism.", "model.tokenizer") had a problem.
  bool has_problem(const std::string& prefix) const;
  /// Throws one ConfigError listing problems() and `more` (later checks' messages), and what
  /// is ignored; returns when there are none.
  void check(const std::vector<std::string>& more = {}) const;
  /// That message ("" without problems).
  std::string report(const std::vector<std::string>& more = {}) const;
  /// The ignored keys as one message ("" when none), for a warning before a run.
  std::string ignored_text() const;

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
  /// Whether the file or the command line set `key` (under any of its names).
  bool is_set(const std::string& key) const { return positions_.count(key) > 0 || overrides_.count(key) > 0; }
  /// The file it came from ("" for defaults).
  const std::string& source() const noexcept { return source_; }
  /// Where the values of `keys` come from, to start an error message with: the file ("config"
  /// for defaults; "file:line:column" for one key the file sets), or the command line for those
  /// given there:
  /// "configs/llama_debug.toml", "command line --training.steps 5",
  /// "configs/llama_debug.toml with command line --parallelism.tensor_parallel_degree 3".
  std::string where(const std::vector<std::string>& keys) const;

 private:
  struct Checker;
  const Value& get(const std::string& key) const;
  std::map<std::string, Value> values_;
  std::vector<std::string> problems_;
  std::vector<std::array<std::string, 3>> ignored_;  // where, "key = value", why
  std::vector<std::pair<long, long>> problem_order_, ignored_order_;  // (line, column) of each
  std::set<std::string> problem_keys_;
  std::map<std::string, std::string> given_as_;  // spmdx key -> torchtitan's name it was set under
  std::map<std::string, std::map<std::string, std::string>> plugin_options_;
  std::string source_;
  std::map<std::string, std::string> overrides_;  // key -> "name value" as given on the command line (name: the key, or torchtitan's)
  std::map<std::string, std::string> positions_;  // key -> "file:line:column" where the file set it
};

}  // namespace spmdx::config
