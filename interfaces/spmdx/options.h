// Reading a plugin's options (its config table, all values as strings) with checks: a getter
// given a bad value notes the problem (naming the plugin, the key and what was expected) and
// returns the fallback; done() throws every problem noted and every key nobody read, one line
// each, so that a user sees all of them at once. Call done() after the getters.
// A host service of the plugin ABI (plugin.h): declared here, defined in libspmdx_host,
// versioned with SPMDX_ABI_MAJOR.
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
  /// "true" or "false". Otherwise a problem for done(), and the fallback.
  bool get_bool(const std::string& key, bool fallback);
  /// A finite number in [min, max]. Otherwise a problem for done(), and the fallback.
  double get_double(const std::string& key, double fallback, double min, double max);
  /// An integer in [min, max]. Otherwise a problem for done(), and the fallback.
  std::int64_t get_int(const std::string& key, std::int64_t fallback, std::int64_t min, std::int64_t max);
  /// One of `choices` (any string when empty). Otherwise a problem for done(), and the fallback.
  std::string get_string(const std::string& key, const std::string& fallback, const std::vector<std::string>& choices = {});
  /// A size in bytes: "1048576", "512MiB", "4GiB", "1.5GB" (KiB/MiB/GiB/TiB are powers of
  /// 1024, KB/MB/GB/TB of 1000). Otherwise a problem for done(), and the fallback.
  double get_bytes(const std::string& key, double fallback);
  /// Throws std::invalid_argument listing, a line each, every bad value the getters met and
  /// every key no getter asked for (with "did you mean").
  void done() const;

 private:
  const std::string* find(const std::string& key);
  void bad(const std::string& key, const std::string& value, const std::string& expected);
  std::string owner_;
  Options options_;
  std::set<std::string> read_;
  std::vector<std::string> problems_;
};

}  // namespace spmdx
