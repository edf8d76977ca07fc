// Reading a plugin's options (its config table, all values as strings) with checks: every
// getter names the plugin, the key and what was expected; done() rejects keys nobody read.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "spmdx/plugin.h"

namespace spmdx {

class OptionReader {
 public:
  /// `owner` names the options in messages, e.g. "[hooks.timeline]".
  OptionReader(std::string owner, Options options);
  /// "true" or "false". Throws std::invalid_argument otherwise.
  bool get_bool(const std::string& key, bool fallback);
  /// A finite number in [min, max]. Throws std::invalid_argument otherwise.
  double get_double(const std::string& key, double fallback, double min, double max);
  /// An integer in [min, max]. Throws std::invalid_argument otherwise.
  std::int64_t get_int(const std::string& key, std::int64_t fallback, std::int64_t min, std::int64_t max);
  /// One of `choices` (any string when empty). Throws std::invalid_argument otherwise.
  std::string get_string(const std::string& key, const std::string& fallback, const std::vector<std::string>& choices = {});
  /// A size in bytes: "1048576", "512MiB", "4GiB", "1.5GB" (KiB/MiB/GiB/TiB are powers of
  /// 1024, KB/MB/GB/TB of 1000). Throws std::invalid_argument otherwise.
  double get_bytes(const std::string& key, double fallback);
  /// Throws std::invalid_argument naming a key no getter asked for (with "did you mean").
  void done() const;

 private:
  const std::string* find(const std::string& key);
  [[noreturn]] void bad(const std::string& key, const std::string& value, const std::string& expected) const;
  std::string owner_;
  Options options_;
  std::set<std::string> read_;
};

}  // namespace spmdx
