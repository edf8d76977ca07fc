// `spmdx bench compare RUN_A RUN_B`: is run B slower than run A, beyond the noise?
//
// Reads two runs' `metrics.jsonl` (one JSON object per step, as `spmdx run` writes them) or two
// `spmdx bench comm` outputs, and compares each measure as a ratio B / A with a noise estimate:
// per run the median and interquartile range of the steps after warm-up, and a bootstrap
// confidence interval of the ratio of medians (Efron & Tibshirani 1993, the percentile
// interval: both runs resampled with replacement, `resamples` times, from a fixed seed, so the
// same inputs always give the same answer).
//
// A regression is a slowdown whose whole confidence interval lies above the allowed one:
// step time's interval low end > 1 + max_slowdown (for bench comm, the time of every size
// together). Tokens/s, exposed communication and peak memory are reported, not judged.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace spmdx::bench {

/// Bad input: a file that is missing, is neither form, has a malformed line (named as
/// "FILE:LINE: ..."), too few measured steps, or two runs of different kinds.
class CompareInputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct CompareOptions {
  /// Steps dropped from the front of each metrics.jsonl (allocator, caches, first plans).
  int warmup = 2;
  /// Allowed slowdown of B against A, a fraction (0.05 = 5%); unset: report only, never fail.
  std::optional<double> max_slowdown;
  int resamples = 2000;
  double confidence = 0.95;
  std::uint64_t seed = 0x5eed;
};

/// One run's samples of one measure after warm-up.
struct Summary {
  std::size_t n = 0;
  double median = 0, q1 = 0, q3 = 0;  ///< quartiles by linear interpolation (numpy's default)
};

struct Measure {
  std::string name;  ///< "step_ms", "tokens_per_s", "exposed_comm_ms", "peak_mem_bytes", or "size N time_us ..."
  std::string unit;  ///< "ms", "tokens/s", "B", "us", "GB/s"
  bool lower_is_better = true;
  bool judged = false;  ///< the measure --max-slowdown applies to
  bool available = false;  ///< both runs have it
  Summary a, b;
  double ratio = 0, ci_low = 0, ci_high = 0;  ///< median B / median A and its interval
};

struct Comparison {
  std::string kind;  ///< "metrics" or "bench comm"
  std::string a_label, b_label;  ///< the files read
  std::vector<Measure> measures;
  std::optional<double> max_slowdown;
  bool regressed = false;  ///< slower than allowed, or B's bench comm had wrong results
  bool wrong_results = false;
  std::vector<std::string> notes;  ///< what could not be compared, and why
};

/// Compares run B against run A (each a metrics.jsonl, a folder holding one, or a bench comm
/// output). Throws CompareInputError on bad input.
Comparison compare_runs(const std::filesystem::path& a, const std::filesystem::path& b, const CompareOptions& options);

/// Human-readable table: one line per measure with both medians, IQRs, the ratio and its
/// interval, then the verdict.
std::string to_text(const Comparison& c);
/// The same as a JSON document (schema "spmdx.bench.compare/1").
std::string to_json(const Comparison& c);

/// "5%" or "0.05" as a fraction; a bare number above 1 ("5") is refused as ambiguous.
/// Throws CompareInputError.
double parse_fraction(const std::string& text);

}  // namespace spmdx::bench
