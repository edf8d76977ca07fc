#include "spmdx/text.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <utility>
#include <vector>

namespace spmdx {

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string nearest_word(const std::string& word, const std::vector<std::string>& known, std::size_t max_distance) {
  auto lower = [](std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return s;
  };
  const std::string w = lower(word);
  std::string best;
  std::size_t best_d = max_distance + 1;
  for (const auto& k : known) {
    const std::size_t d = edit_distance(w, lower(k));
    if (d < best_d) best_d = d, best = k;
  }
  return best;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", b, units[u]);
  return buf;
}

std::uint64_t parse_bytes(std::string_view text) {
  const std::string t(text);
  const std::string examples = "'" + t + "' is not a size (examples: 262144, 256K, 4MiB, 1.5GB)";
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(t, &used);
  } catch (const std::logic_error&) {
    throw std::invalid_argument(examples);
  }
  std::string unit = t.substr(used);
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  static const std::pair<const char*, double> units[] = {
      {"", 1}, {"B", 1}, {"K", 1024.0}, {"k", 1024.0}, {"M", 1048576.0}, {"G", 1073741824.0}, {"T", 1099511627776.0},
      {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
      {"KB", 1e3}, {"kB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}};
  for (const auto& [name, scale] : units) {
    if (unit != name) continue;
    if (!std::isfinite(v) || v < 0 || v * scale > 1.8e19) throw std::invalid_argument("'" + t + "' is not a size in bytes: it must be between 0 and 16 EiB");
    return static_cast<std::uint64_t>(v * scale);
  }
  throw std::invalid_argument("'" + t + "': unknown unit '" + unit + "' (K, M, G, T or KiB, MiB, GiB, TiB for powers of 1024; KB, MB, GB, TB for powers of 1000)");
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  std::vector<std::string> names;
  for (int r : ranks) names.push_back(std::to_string(r));
  s += join(names);
  return (ranks.size() == 1 ? "rank " : "ranks ") + s;
}

std::string seconds_text(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", std::round(seconds * 10) / 10);
  return buf;
}

std::vector<std::string> split_lines(std::string_view text) {
  std::vector<std::string> out;
  for (std::size_t start = 0;;) {
    const auto nl = text.find('\n', start);
    out.emplace_back(text.substr(start, nl == std::string_view::npos ? std::string_view::npos : nl - start));
    if (nl == std::string_view::npos) return out;
    start = nl + 1;
  }
}

std::string fnv1a_hex(std::string_view bytes) {
  std::uint64_t h = 14695981039346656037ULL;
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ULL;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

void check_json_nesting(std::string_view json_text) {
  std::size_t depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < json_text.size(); ++i) {
    const char c = json_text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonNesting) {
        throw std::invalid_argument("JSON nested more than " + std::to_string(kMaxJsonNesting) + " arrays or objects deep (at byte " + std::to_string(i) +
                                    "); no file spmdx reads nests so deep: is it the file meant, as written?");
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
}

}  // namespace spmdx
