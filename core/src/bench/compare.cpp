#include "spmdx/bench/compare.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <map>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "spmdx/files.h"
#include "spmdx/text.h"

namespace spmdx::bench {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Quantile q of sorted samples, interpolating linearly between order statistics (numpy's
// default, "linear"; Hyndman & Fan's type 7).
double quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const std::size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return quantile(v, 0.5);
}

Summary summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.size(), quantile(v, 0.5), quantile(v, 0.25), quantile(v, 0.75)};
}

// The percentile bootstrap of median(b) / median(a): each resample draws len(a) from a and
// len(b) from b with replacement.
std::pair<double, double> bootstrap_ratio(const std::vector<double>& a, const std::vector<double>& b, const CompareOptions& o,
                                          std::uint64_t stream) {
  std::mt19937_64 rng(o.seed ^ (stream * 0x9e3779b97f4a7c15ULL));
  std::vector<double> ratios;
  ratios.reserve(static_cast<std::size_t>(o.resamples));
  std::vector<double> ra(a.size()), rb(b.size());
  auto draw = [&rng](const std::vector<double>& from, std::vector<double>& to) {
    for (double& x : to) x = from[static_cast<std::size_t>(rng() % from.size())];
  };
  for (int i = 0; i < o.resamples; ++i) {
    draw(a, ra);
    draw(b, rb);
    const double ma = median_of(ra);
    if (ma != 0) ratios.push_back(median_of(rb) / ma);
  }
  std::sort(ratios.begin(), ratios.end());
  const double tail = (1.0 - o.confidence) / 2;
  return {quantile(ratios, tail), quantile(ratios, 1.0 - tail)};
}

Measure measure(std::string name, std::string unit, bool lower_is_better, const std::vector<double>& a, const std::vector<double>& b,
                const CompareOptions& o, std::uint64_t stream) {
  Measure m;
  m.name = std::move(name);
  m.unit = std::move(unit);
  m.lower_is_better = lower_is_better;
  m.available = !a.empty() && !b.empty();
  if (!m.available) return m;
  m.a = summarize(a);
  m.b = summarize(b);
  m.ratio = m.a.median != 0 ? m.b.median / m.a.median : 0;
  std::tie(m.ci_low, m.ci_high) = bootstrap_ratio(a, b, o, stream);
  return m;
}

fs::path resolve(const fs::path& p) {
  std::error_code ec;
  if (fs::is_directory(p, ec)) {
    const fs::path m = p / "metrics.jsonl";
    if (!fs::exists(m, ec)) throw CompareInputError(p.string() + ": a folder without metrics.jsonl (give a run's job.dump_folder, its metrics.jsonl, or a bench comm output)");
    return m;
  }
  if (!fs::exists(p, ec)) throw CompareInputError(p.string() + ": no such file");
  return p;
}

std::vector<std::string> read_lines(const fs::path& p) {
  if (const std::string why = unreadable_file(p); !why.empty()) throw CompareInputError(p.string() + ": " + why);  // a FIFO would block
  std::ifstream in(p);
  if (!in) throw CompareInputError(p.string() + ": cannot be read");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

// "[rank 0] " as spmdx run's launcher prefixes lines.
std::string unprefixed(const std::string& line) {
  std::string s = trim(line);
  if (s.rfind("[rank ", 0) == 0) {
    const auto close = s.find(']');
    if (close != std::string::npos) s = trim(s.substr(close + 1));
  }
  return s;
}

bool is_bench_comm(const std::vector<std::string>& lines) {
  for (const auto& l : lines) {
    if (unprefixed(l).rfind("# spmdx bench comm:", 0) == 0) return true;
  }
  return false;
}

// The metrics compared, step_ms the one judged.
struct MetricKey {
  const char* key;
  const char* unit;
  bool lower_is_better, judged;
};
constexpr MetricKey kMetricKeys[] = {{"step_ms", "ms", true, true},
                                     {"tokens_per_s", "tokens/s", false, false},
                                     {"exposed_comm_ms", "ms", true, false},
                                     {"comm_ms", "ms", true, false},
                                     {"peak_mem_bytes", "B", true, false}};

// metrics.jsonl: per key, the values of the steps after warm-up, in step order.
struct Metrics {
  std::map<std::string, std::vector<double>> values;
  std::size_t steps = 0;
};

Metrics read_metrics(const fs::path& file, const std::vector<std::string>& lines, int warmup) {
  std::vector<json> rows;
  std::vector<std::pair<double, std::size_t>> steps_seen;  // (step, line)
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (trim(lines[i]).empty()) continue;
    json row;
    try {
      check_json_nesting(lines[i]);
      row = json::parse(lines[i]);
    } catch (const std::exception& e) {
      throw CompareInputError(file.string() + ":" + std::to_string(i + 1) + ": not a JSON object (" + e.what() + ")");
    }
    const std::string at = file.string() + ":" + std::to_string(i + 1) + ": ";
    if (!row.is_object() || !row.contains("step") || !row["step"].is_number_integer() || !row.contains("step_ms") || !row["step_ms"].is_number()) {
      throw CompareInputError(at + "a metrics row needs a whole-number \"step\" and a numeric \"step_ms\"");
    }
    if (!(row["step_ms"].get<double>() > 0)) throw CompareInputError(at + "step_ms must be a positive time, got " + row["step_ms"].dump());
    for (const MetricKey& k : kMetricKeys) {  // a compared value that is not a number would drop the row out of its measure
      if (row.contains(k.key) && !row[k.key].is_number()) throw CompareInputError(at + k.key + " must be a number, got " + row[k.key].dump().substr(0, 60));
    }
    for (const auto& [key, v] : row.items()) {
      if (v.is_number() && v.get<double>() < 0 && key != "loss") throw CompareInputError(at + key + " must not be negative, got " + v.dump());
      // 1e300 ms made a ratio of 300 digits; no step, time, byte count or loss comes near 1e18.
      if (v.is_number() && !(std::abs(v.get<double>()) <= 1e18)) throw CompareInputError(at + key + " is " + v.dump() + ": not a measurement (over 1e18)");
    }
    rows.push_back(std::move(row));
    steps_seen.emplace_back(rows.back()["step"].get<double>(), i + 1);
  }
  std::sort(steps_seen.begin(), steps_seen.end());
  for (std::size_t k = 1; k < steps_seen.size(); ++k) {
    if (steps_seen[k].first == steps_seen[k - 1].first) {
      throw CompareInputError(file.string() + ":" + std::to_string(steps_seen[k].second) + ": step " + std::to_string(static_cast<long long>(steps_seen[k].first)) +
                              " again (line " + std::to_string(steps_seen[k - 1].second) + "): two runs in one file? compare one run's metrics.jsonl");
    }
  }
  if (rows.empty()) throw CompareInputError(file.string() + ": no steps (neither a metrics.jsonl with rows nor a bench comm output)");
  std::stable_sort(rows.begin(), rows.end(), [](const json& x, const json& y) { return x["step"].get<double>() < y["step"].get<double>(); });
  if (rows.size() <= static_cast<std::size_t>(warmup) + 1) {
    throw CompareInputError(file.string() + ": " + std::to_string(rows.size()) + (rows.size() == 1 ? " step, " : " steps, ") + std::to_string(warmup) +
                            " of them warm-up: at least 2 measured steps are needed (run more steps, or lower --warmup)");
  }
  Metrics m;
  m.steps = rows.size() - static_cast<std::size_t>(warmup);
  for (std::size_t i = static_cast<std::size_t>(warmup); i < rows.size(); ++i) {
    for (const auto& [key, v] : rows[i].items()) {
      if (v.is_number()) m.values[key].push_back(v.get<double>());
    }
  }
  return m;
}

// A bench comm output: per size (bytes), the out-of-place and in-place time in us and busbw.
struct CommRow {
  double oop_us = NAN, oop_busbw = NAN, ip_us = NAN, ip_busbw = NAN;
  double wrong = 0;  // #wrong of both forms
};
struct CommRun {
  std::string op, ranks;
  std::map<std::uint64_t, CommRow> sizes;
};

double number_or_nan(const std::string& s) {
  if (s == "n/a") return NAN;
  std::size_t used = 0;
  const double v = std::stod(s, &used);
  if (used != s.size()) throw std::invalid_argument(s);
  return v;
}

CommRun read_bench_comm(const fs::path& file, const std::vector<std::string>& lines) {
  CommRun run;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const std::string s = unprefixed(lines[i]);
    if (s.rfind("# spmdx bench comm:", 0) == 0) {
      std::string rest = trim(s.substr(19));
      run.op = rest.substr(0, rest.find(','));
      const auto comma = rest.find(',');
      if (comma != std::string::npos) run.ranks = trim(rest.substr(comma + 1, rest.find(',', comma + 1) - comma - 1));
      continue;
    }
    if (s.empty() || s[0] == '#') continue;
    std::istringstream in(s);
    std::vector<std::string> f;
    for (std::string w; in >> w;) f.push_back(w);
    if (f.size() != 12) continue;  // the launcher's own lines, warnings
    try {
      CommRow r{number_or_nan(f[4]), number_or_nan(f[6]), number_or_nan(f[8]), number_or_nan(f[10]), 0};
      for (double w : {number_or_nan(f[7]), number_or_nan(f[11])}) r.wrong += std::isnan(w) ? 0 : w;
      for (double t : {r.oop_us, r.ip_us}) {
        if (!std::isnan(t) && !(t > 0)) throw std::invalid_argument("time");
      }
      run.sizes[static_cast<std::uint64_t>(std::stoull(f[0]))] = r;
    } catch (const std::exception&) {
      throw CompareInputError(file.string() + ":" + std::to_string(i + 1) + ": a bench comm row must be 12 columns, size count type redop "
                              "time algbw busbw #wrong time algbw busbw #wrong, times positive; got: " + s);
    }
  }
  if (run.sizes.empty()) throw CompareInputError(file.string() + ": a bench comm output without any size row");
  return run;
}

Comparison compare_metrics(Comparison c, const fs::path& fa, const fs::path& fb, const std::vector<std::string>& la,
                           const std::vector<std::string>& lb, const CompareOptions& o) {
  const Metrics a = read_metrics(fa, la, o.warmup), b = read_metrics(fb, lb, o.warmup);
  c.kind = "metrics";
  std::uint64_t stream = 0;
  for (const MetricKey& k : kMetricKeys) {
    auto get = [&](const Metrics& m) {
      auto it = m.values.find(k.key);
      return it == m.values.end() ? std::vector<double>{} : it->second;
    };
    Measure m = measure(k.key, k.unit, k.lower_is_better, get(a), get(b), o, ++stream);
    m.judged = k.judged;
    if (!m.available) c.notes.push_back(std::string(k.key) + ": not in both runs' metrics");
    c.measures.push_back(std::move(m));
  }
  return c;
}

Comparison compare_comm(Comparison c, const fs::path& fa, const fs::path& fb, const std::vector<std::string>& la,
                        const std::vector<std::string>& lb, const CompareOptions& o) {
  const CommRun a = read_bench_comm(fa, la), b = read_bench_comm(fb, lb);
  c.kind = "bench comm";
  if (a.op != b.op) throw CompareInputError("bench comm of different collectives: " + fa.string() + " times " + a.op + ", " + fb.string() + " times " + b.op);
  if (a.ranks != b.ranks) c.notes.push_back("A ran on " + a.ranks + ", B on " + b.ranks);
  // Each size's time ratio is one sample (bench comm prints one average per size): the
  // judged measure is the median of them, bootstrapped over sizes.
  std::vector<double> ra, rb;
  std::uint64_t stream = 100;
  for (const auto& [bytes, x] : a.sizes) {
    auto it = b.sizes.find(bytes);
    if (it == b.sizes.end()) {
      c.notes.push_back("size " + std::to_string(bytes) + " B: only in A");
      continue;
    }
    const CommRow& y = it->second;
    for (const auto& [mode, ta, tb, ba, bb] : {std::tuple{"out-of-place", x.oop_us, y.oop_us, x.oop_busbw, y.oop_busbw},
                                               std::tuple{"in-place", x.ip_us, y.ip_us, x.ip_busbw, y.ip_busbw}}) {
      if (std::isnan(ta) || std::isnan(tb)) continue;
      Measure m = measure(std::to_string(bytes) + " B " + mode + " time", "us", true, {ta}, {tb}, o, ++stream);
      c.measures.push_back(m);
      if (!std::isnan(ba) && !std::isnan(bb)) c.measures.push_back(measure(std::to_string(bytes) + " B " + mode + " busbw", "GB/s", false, {ba}, {bb}, o, ++stream));
      ra.push_back(1.0);
      rb.push_back(tb / ta);
    }
  }
  for (const auto& [bytes, y] : b.sizes) {
    if (!a.sizes.count(bytes)) c.notes.push_back("size " + std::to_string(bytes) + " B: only in B");
  }
  for (const auto& [run, label] : {std::pair{&a, "A"}, std::pair{&b, "B"}}) {
    double wrong = 0;
    for (const auto& [bytes, row] : run->sizes) wrong += row.wrong;
    if (wrong > 0) {
      c.notes.push_back(std::string(label) + " has " + std::to_string(static_cast<long long>(wrong)) + " wrong results: its backend computed wrong sums, whatever its speed");
      if (std::string(label) == "B") c.wrong_results = true;
    }
  }
  if (rb.empty()) throw CompareInputError("bench comm outputs " + fa.string() + " and " + fb.string() + " share no size");
  Measure all = measure("time, all sizes (median of per-size ratios)", "x", true, ra, rb, o, 1);
  all.a = summarize(ra);
  all.judged = true;
  c.measures.insert(c.measures.begin(), all);
  if (rb.size() < 3) c.notes.push_back("fewer than 3 size/mode samples: the interval of the time ratio is no noise estimate");
  return c;
}

std::string fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

std::string value(double v, const std::string& unit) {
  if (unit == "B") return human_bytes(v);
  if (unit == "tokens/s") return fixed(v, 0);
  if (unit == "x") return fixed(v, 3);
  return fixed(v, unit == "GB/s" ? 3 : 1);
}

std::string percent(double ratio) {
  const double p = (ratio - 1.0) * 100.0;
  return (p >= 0 ? "+" : "") + fixed(p, 1) + "%";
}

}  // namespace

double parse_fraction(const std::string& text) {
  std::string s = trim(text);
  const bool pct = !s.empty() && s.back() == '%';
  if (pct) s.pop_back();
  double v = 0;
  try {
    std::size_t used = 0;
    v = std::stod(s, &used);
    if (used != s.size()) throw std::invalid_argument(s);
  } catch (const std::exception&) {
    throw CompareInputError("--max-slowdown '" + text + "': give a percentage or a fraction, e.g. 5% or 0.05");
  }
  if (pct) v /= 100.0;
  else if (v > 1) {
    throw CompareInputError("--max-slowdown '" + text + "': a bare number is a fraction (0.05 = 5%); for " + s + " percent write " + s + "%");
  }
  if (!(v >= 0) || v > 10) throw CompareInputError("--max-slowdown '" + text + "': must be from 0% to 1000%");
  return v == 0 ? 0.0 : v;  // -0 -> 0
}

Comparison compare_runs(const fs::path& a, const fs::path& b, const CompareOptions& o) {
  if (o.warmup < 0) throw CompareInputError("--warmup must be 0 or more");
  const fs::path fa = resolve(a), fb = resolve(b);
  const auto la = read_lines(fa), lb = read_lines(fb);
  const bool ca = is_bench_comm(la), cb = is_bench_comm(lb);
  if (ca != cb) {
    throw CompareInputError("one run of each kind: " + (ca ? fa : fb).string() + " is a bench comm output, " + (ca ? fb : fa).string() +
                            " a metrics.jsonl; compare like with like");
  }
  Comparison c;
  c.a_label = fa.string();
  c.b_label = fb.string();
  c.max_slowdown = o.max_slowdown;
  c = ca ? compare_comm(std::move(c), fa, fb, la, lb, o) : compare_metrics(std::move(c), fa, fb, la, lb, o);
  if (c.wrong_results) c.regressed = true;  // wrong results fail the comparison, threshold or not
  if (o.max_slowdown) {
    for (const Measure& m : c.measures) {
      if (m.judged && m.available && m.ci_low > 1.0 + *o.max_slowdown) c.regressed = true;
    }
  }
  return c;
}

std::string to_text(const Comparison& c) {
  std::ostringstream out;
  out << "A: " << c.a_label << "\nB: " << c.b_label << "\n";
  std::size_t n_a = 0, n_b = 0;
  for (const Measure& m : c.measures) {
    if (m.available && m.judged) n_a = m.a.n, n_b = m.b.n;
  }
  out << c.kind << ", " << n_a << " vs " << n_b << (c.kind == "metrics" ? " steps after warm-up" : " size/mode samples")
      << "; medians, [IQR], ratio B/A with its " << "bootstrap interval\n";
  out << std::left << std::setw(44) << "measure" << std::right << std::setw(31) << "A" << std::setw(31) << "B" << std::setw(8) << "B/A"
      << std::setw(18) << "interval" << "\n";
  for (const Measure& m : c.measures) {
    if (!m.available) continue;
    auto cell = [&](const Summary& s) {
      return value(s.median, m.unit) + (s.n > 1 ? " [" + value(s.q1, m.unit) + ", " + value(s.q3, m.unit) + "]" : "");
    };
    const bool one_sample = m.a.n < 2 && m.b.n < 2;  // a bench comm size: one average per run, no spread to resample
    out << std::left << std::setw(44) << (m.name + (m.unit == "x" || m.unit == "B" ? "" : " (" + m.unit + ")")) << std::right << " "
        << std::setw(30) << cell(m.a) << " " << std::setw(30) << cell(m.b) << std::setw(8) << fixed(m.ratio, 3) << std::setw(18)
        << (one_sample ? std::string("-") : "[" + fixed(m.ci_low, 3) + ", " + fixed(m.ci_high, 3) + "]") << "\n";
  }
  for (const auto& note : c.notes) out << "note: " << note << "\n";
  for (const Measure& m : c.measures) {
    if (!m.judged || !m.available) continue;
    std::string verdict;
    if (m.ci_low > 1.0) verdict = "B is slower: " + percent(m.ratio) + " (interval " + percent(m.ci_low) + " .. " + percent(m.ci_high) + ")";
    else if (m.ci_high < 1.0) verdict = "B is faster: " + percent(m.ratio) + " (interval " + percent(m.ci_low) + " .. " + percent(m.ci_high) + ")";
    else verdict = "no difference beyond the noise: " + percent(m.ratio) + " (interval " + percent(m.ci_low) + " .. " + percent(m.ci_high) + ")";
    out << m.name << ": " << verdict;
    if (c.max_slowdown) {
      out << "; allowed slowdown " << fixed(*c.max_slowdown * 100, 1) << "%: " << (c.regressed ? "REGRESSION (exit 1)" : "ok");
    }
    out << "\n";
  }
  if (c.wrong_results) out << "B's bench comm has wrong results: FAIL (exit 1)\n";
  return out.str();
}

std::string to_json(const Comparison& c) {
  json j{{"schema", "spmdx.bench.compare/1"}, {"kind", c.kind}, {"a", c.a_label}, {"b", c.b_label}, {"regressed", c.regressed}, {"wrong_results", c.wrong_results}, {"notes", c.notes}};
  j["max_slowdown"] = c.max_slowdown ? json(*c.max_slowdown) : json(nullptr);
  j["measures"] = json::array();
  for (const Measure& m : c.measures) {
    json x{{"name", m.name}, {"unit", m.unit}, {"lower_is_better", m.lower_is_better}, {"judged", m.judged}, {"available", m.available}};
    if (m.available) {
      auto s = [](const Summary& v) { return json{{"n", v.n}, {"median", v.median}, {"q1", v.q1}, {"q3", v.q3}}; };
      x["a"] = s(m.a);
      x["b"] = s(m.b);
      x["ratio"] = m.ratio;
      x["interval"] = {m.ci_low, m.ci_high};
    }
    j["measures"].push_back(std::move(x));
  }
  return j.dump(2) + "\n";
}

}  // namespace spmdx::bench
