#include "spmdx/options.h"

#include <cmath>
#include <stdexcept>

#include "spmdx/text.h"

namespace spmdx {

OptionReader::OptionReader(std::string owner, Options options) : owner_(std::move(owner)), options_(std::move(options)) {}

const std::string* OptionReader::find(const std::string& key) {
  read_.insert(key);
  auto it = options_.find(key);
  return it == options_.end() ? nullptr : &it->second;
}

void OptionReader::bad(const std::string& key, const std::string& value, const std::string& expected) {
  problems_.push_back(owner_ + " " + key + " = \"" + value + "\": expected " + expected);
}

bool OptionReader::get_bool(const std::string& key, bool fallback) {
  const std::string* v = find(key);
  if (v == nullptr) return fallback;
  if (*v == "true") return true;
  if (*v == "false") return false;
  bad(key, *v, "true or false");
  return fallback;
}

double OptionReader::get_double(const std::string& key, double fallback, double min, double max) {
  const std::string* v = find(key);
  if (v == nullptr) return fallback;
  const std::string range = "a number from " + std::to_string(min) + " to " + std::to_string(max);
  try {
    std::size_t used = 0;
    const double x = std::stod(*v, &used);
    if (used == v->size() && std::isfinite(x) && x >= min && x <= max) return x;
  } catch (const std::logic_error&) {
  }
  bad(key, *v, range);
  return fallback;
}

std::int64_t OptionReader::get_int(const std::string& key, std::int64_t fallback, std::int64_t min, std::int64_t max) {
  const std::string* v = find(key);
  if (v == nullptr) return fallback;
  const std::string range = "an integer from " + std::to_string(min) + " to " + std::to_string(max);
  try {
    std::size_t used = 0;
    const long long x = std::stoll(*v, &used);
    if (used == v->size() && x >= min && x <= max) return x;
  } catch (const std::logic_error&) {
  }
  bad(key, *v, range);
  return fallback;
}

std::string OptionReader::get_string(const std::string& key, const std::string& fallback, const std::vector<std::string>& choices) {
  const std::string* v = find(key);
  if (v == nullptr) return fallback;
  if (choices.empty()) return *v;
  for (const auto& c : choices) {
    if (c == *v) return *v;
  }
  bad(key, *v, "one of " + join(choices));
  return fallback;
}

double OptionReader::get_bytes(const std::string& key, double fallback) {
  const std::string* v = find(key);
  if (v == nullptr) return fallback;
  try {
    return static_cast<double>(parse_bytes(*v));
  } catch (const std::invalid_argument&) {
    bad(key, *v, "a size such as 4GiB, 512M, 1.5GB or 1048576 (K, M, G, KiB, ...: powers of 1024; KB, MB, GB: of 1000)");
  }
  return fallback;
}

void OptionReader::done() const {
  std::vector<std::string> problems = problems_;
  for (const auto& [key, value] : options_) {
    if (read_.count(key) > 0) continue;
    const std::string best = nearest_word(key, std::vector<std::string>(read_.begin(), read_.end()), 2);
    problems.push_back(owner_ + " " + key + ": unknown option" + (best.empty() ? "" : "; did you mean '" + best + "'?") + " (known: " + join(read_) + ")");
  }
  std::string all;
  for (const auto& p : problems) all += (all.empty() ? "" : "\n") + p;
  if (!all.empty()) throw std::invalid_argument(all);
}

}  // namespace spmdx
