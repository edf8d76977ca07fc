// `spmdx bench compare` as a user runs it, on metrics.jsonl and bench comm outputs written here
// with known values: a run against itself passes, a slowed one fails under --max-slowdown, a
// difference inside the noise is none, the medians and quartiles are numpy's and the bootstrap
// interval is the one computed by hand, and bad input exits 2 naming the file and line. (What a
// real slowdown of the main job measures is a benchmark, bench/overlap_compare.sh, not a test:
// no test here depends on how fast anything runs.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <sstream>
#include <tuple>
#include <vector>

#include "test_util.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

test::CommandResult compare(const std::string& args) { return test::run_command("'" SPMDX_EXE "' bench compare " + args); }

// A metrics.jsonl of `steps` rows: step time base * scale plus a fixed wobble (+-3%), as
// `spmdx run` writes them (the first two rows slow: warm-up).
fs::path metrics(const test::TempDir& dir, const std::string& name, int steps, double scale, double base = 100.0) {
  fs::create_directories(dir / name);
  std::ostringstream out;
  for (int s = 1; s <= steps; ++s) {
    const double wobble = 1.0 + 0.03 * std::sin(1.7 * s);
    const double ms = (s <= 2 ? 3.0 : 1.0) * base * scale * wobble;
    nlohmann::json row{{"step", s}, {"step_ms", ms}, {"tokens_per_s", 4096.0 / ms * 1e3}, {"exposed_comm_ms", 10.0 * scale},
                       {"comm_ms", 20.0}, {"peak_mem_bytes", 1 << 20}, {"loss", 2.0}};
    out << row.dump() << "\n";
  }
  test::write_file(dir / name / "metrics.jsonl", out.str());
  return dir / name;
}

std::string q(const fs::path& p) { return "'" + p.string() + "'"; }

TEST(BenchCompare, ARunAgainstItselfPassesAndASlowedOneFails) {
  test::TempDir dir;
  const fs::path a = metrics(dir, "a", 20, 1.0), slow = metrics(dir, "slow", 20, 1.3), fast = metrics(dir, "fast", 20, 0.8),
                 near = metrics(dir, "near", 20, 1.02);
  auto r = compare(q(a) + " " + q(a) + " --max-slowdown 5%");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("step_ms: no difference beyond the noise: +0.0%"));
  EXPECT_THAT(r.output, HasSubstr("metrics, 18 vs 18 steps after warm-up"));

  r = compare(q(a) + " " + q(slow) + " --max-slowdown 5%");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("step_ms: B is slower: +30.0%"));
  EXPECT_THAT(r.output, HasSubstr("allowed slowdown 5.0%: REGRESSION (exit 1)"));
  r = compare(q(a) + " " + q(slow));  // without a threshold: said, not judged
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("B is slower"));
  r = compare(q(a) + " " + q(near) + " --max-slowdown 0.05");  // 2% slower, 5% allowed
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = compare(q(a) + " " + q(fast) + " --max-slowdown 0.05");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("step_ms: B is faster: -20.0%"));
}

// Series whose bootstrap interval is known without running the bootstrap: ten measured steps,
// five at 90 ms and five at 110 (median 100), B each of them times `scale`. A resample's
// median (of ten draws) is then 90, 100 or 110 times its scale; the lowest ratio, B's 90 over
// A's 110, comes with probability 0.377^2 = 14% (at least six of ten draws at 90 in B, at least
// six at 110 in A), far above the 2.5% tail, and so does the highest: the 95% interval is
// exactly [90 s / 110, 110 s / 90], whatever the seed. Steps 1-2 (warm-up, 10x slower) must be
// dropped, or they would be in every median.
fs::path two_level(const test::TempDir& dir, const std::string& name, double scale) {
  std::ostringstream out;
  for (int s = 1; s <= 12; ++s) {
    const double ms = s <= 2 ? 1000.0 : (s % 2 ? 90.0 : 110.0);
    out << nlohmann::json{{"step", s}, {"step_ms", ms * scale}}.dump() << "\n";
  }
  test::write_file(dir / (name + ".jsonl"), out.str());
  return dir / (name + ".jsonl");
}

// The judged measure of `compare --json`.
nlohmann::json step_measure(const std::string& args) {
  const auto r = compare(args + " --json");
  const auto j = nlohmann::json::parse(r.output);
  return j["measures"][0];
}

// A known 50% slowdown with +-10% noise: ratio 1.5, interval [135/110, 165/90] = +22.7% ..
// +83.3%, all above 1: slower. --max-slowdown judges the interval's low end, not the ratio:
// 20% allowed is exceeded (exit 1), 25% is not (1.227 < 1.25), though the ratio is 1.5.
TEST(BenchCompare, AKnownSlowdownIsReportedWithItsIntervalAndFailsPastTheAllowedOne) {
  test::TempDir dir;
  const fs::path a = two_level(dir, "a", 1.0), b = two_level(dir, "b", 1.5);
  auto r = compare(q(a) + " " + q(b) + " --max-slowdown 20%");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("metrics, 10 vs 10 steps after warm-up"));
  EXPECT_THAT(r.output, HasSubstr("100.0 [90.0, 110.0]"));
  EXPECT_THAT(r.output, HasSubstr("150.0 [135.0, 165.0]"));
  EXPECT_THAT(r.output, HasSubstr("1.500    [1.227, 1.833]"));
  EXPECT_THAT(r.output, HasSubstr("step_ms: B is slower: +50.0% (interval +22.7% .. +83.3%); allowed slowdown 20.0%: REGRESSION (exit 1)"));
  r = compare(q(a) + " " + q(b) + " --max-slowdown 25%");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("step_ms: B is slower: +50.0% (interval +22.7% .. +83.3%); allowed slowdown 25.0%: ok"));
  const auto m = step_measure(q(a) + " " + q(b));
  EXPECT_DOUBLE_EQ(m["a"]["median"].get<double>(), 100.0);
  EXPECT_DOUBLE_EQ(m["b"]["median"].get<double>(), 150.0);
  EXPECT_DOUBLE_EQ(m["ratio"].get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(m["interval"][0].get<double>(), 90.0 * 1.5 / 110.0);
  EXPECT_DOUBLE_EQ(m["interval"][1].get<double>(), 110.0 * 1.5 / 90.0);
  // The same slowdown the other way round is a speedup, and never a regression.
  r = compare(q(b) + " " + q(a) + " --max-slowdown 0%");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("step_ms: B is faster: -33.3% (interval -45.5% .. -18.5%); allowed slowdown 0.0%: ok"));
}

// A run against an identical one: ratio 1 and the interval of the noise alone, [90/110,
// 110/90]; with no noise at all the interval closes on 1. Neither is a difference, even with
// no slowdown allowed.
TEST(BenchCompare, IdenticalSeriesAreNoDifference) {
  test::TempDir dir;
  const fs::path a = two_level(dir, "a", 1.0), same = two_level(dir, "same", 1.0);
  auto r = compare(q(a) + " " + q(same) + " --max-slowdown 0%");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("step_ms: no difference beyond the noise: +0.0% (interval -18.2% .. +22.2%); allowed slowdown 0.0%: ok"));
  const auto m = step_measure(q(a) + " " + q(same));
  EXPECT_DOUBLE_EQ(m["ratio"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(m["interval"][0].get<double>(), 90.0 / 110.0);
  EXPECT_DOUBLE_EQ(m["interval"][1].get<double>(), 110.0 / 90.0);
  std::ostringstream flat;
  for (int s = 1; s <= 6; ++s) flat << nlohmann::json{{"step", s}, {"step_ms", 250.0}}.dump() << "\n";
  test::write_file(dir / "flat.jsonl", flat.str());
  r = compare(q(dir / "flat.jsonl") + " " + q(dir / "flat.jsonl") + " --max-slowdown 0%");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("step_ms: no difference beyond the noise: +0.0% (interval +0.0% .. +0.0%); allowed slowdown 0.0%: ok"));
}

// B 5% slower in its median, but the steps vary by +-10%: the interval [94.5/110, 115.5/90] =
// -14.1% .. +28.3% holds 1, so it is noise, not a slowdown: exit 0 even with none allowed.
TEST(BenchCompare, ADifferenceInsideTheNoiseIsNoDifference) {
  test::TempDir dir;
  const fs::path a = two_level(dir, "a", 1.0), b = two_level(dir, "b", 1.05);
  auto r = compare(q(a) + " " + q(b) + " --max-slowdown 0%");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("step_ms: no difference beyond the noise: +5.0% (interval -14.1% .. +28.3%); allowed slowdown 0.0%: ok"));
  const auto m = step_measure(q(a) + " " + q(b));
  EXPECT_DOUBLE_EQ(m["ratio"].get<double>(), 105.0 / 100.0);
  EXPECT_DOUBLE_EQ(m["interval"][0].get<double>(), 90.0 * 1.05 / 110.0);
  EXPECT_DOUBLE_EQ(m["interval"][1].get<double>(), 110.0 * 1.05 / 90.0);
}

// Steps 3..12 of 100, 101, ... 109 ms: numpy's median 104.5 and quartiles 102.25 / 106.75; B
// twice as slow everywhere: ratio 2, its interval around 2 (the runs are resampled apart, as
// two unpaired runs are) and above the allowed 1.5.
TEST(BenchCompare, JsonGivesMediansQuartilesAndTheIntervalOfTheRatio) {
  test::TempDir dir;
  std::ostringstream a, b;
  for (int s = 1; s <= 12; ++s) {
    const double ms = s <= 2 ? 500.0 : 100.0 + (s - 3);
    a << nlohmann::json{{"step", s}, {"step_ms", ms}, {"peak_mem_bytes", 1000}}.dump() << "\n";
    b << nlohmann::json{{"step", s}, {"step_ms", 2 * ms}, {"peak_mem_bytes", 1500}}.dump() << "\n";
  }
  test::write_file(dir / "a.jsonl", a.str());
  test::write_file(dir / "b.jsonl", b.str());
  auto r = compare(q(dir / "a.jsonl") + " " + q(dir / "b.jsonl") + " --json --max-slowdown 50%");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["schema"], "spmdx.bench.compare/1");
  EXPECT_EQ(j["regressed"], true);
  const auto& step = j["measures"][0];
  EXPECT_EQ(step["name"], "step_ms");
  EXPECT_EQ(step["a"]["n"], 10);
  EXPECT_DOUBLE_EQ(step["a"]["median"].get<double>(), 104.5);
  EXPECT_DOUBLE_EQ(step["a"]["q1"].get<double>(), 102.25);
  EXPECT_DOUBLE_EQ(step["a"]["q3"].get<double>(), 106.75);
  EXPECT_DOUBLE_EQ(step["ratio"].get<double>(), 2.0);
  EXPECT_GT(step["interval"][0].get<double>(), 1.85);
  EXPECT_LT(step["interval"][0].get<double>(), 2.0);
  EXPECT_GT(step["interval"][1].get<double>(), 2.0);
  EXPECT_LT(step["interval"][1].get<double>(), 2.15);
  const auto& peak = j["measures"][4];
  EXPECT_EQ(peak["name"], "peak_mem_bytes");
  EXPECT_DOUBLE_EQ(peak["ratio"].get<double>(), 1.5);
  EXPECT_EQ(peak["judged"], false);
  // tokens_per_s is in neither file: said, not invented.
  EXPECT_EQ(j["measures"][1]["available"], false);
}

// Two saved `spmdx bench comm` outputs (as the launcher prints them, "[rank 0] " first): the
// judged measure is the median of the per-size time ratios.
TEST(BenchCompare, BenchCommOutputsAreComparedSizeBySize) {
  test::TempDir dir;
  auto comm = [&](const std::string& name, const std::string& op, double slow, int wrong = 0) {
    std::ostringstream out;
    out << "[rank 0] # spmdx bench comm: " << op << ", 4 ranks, ucx (UCX_TLS=shm,self) rank 0/4\n"
        << "[rank 0] #       size        count   type  redop  time(us)    algbw    busbw #wrong  time(us)    algbw    busbw #wrong\n";
    for (int k = 0; k < 6; ++k) {
      const long bytes = 1024L << (2 * k);
      const double us = (10.0 + bytes / 1000.0) * slow * (1.0 + 0.01 * k);
      out << "[rank 0] " << bytes << " " << bytes / 4 << " float sum " << us << " " << bytes / us / 1e3 << " " << 1.5 * bytes / us / 1e3
          << " 0 " << us * 0.9 << " " << bytes / us / 900 << " " << 1.5 * bytes / us / 900 << " " << (k == 3 ? wrong : 0) << "\n";
    }
    out << "[rank 0] # wrong results: 0\n";
    test::write_file(dir / name, out.str());
    return dir / name;
  };
  const fs::path a = comm("a.txt", "all_reduce", 1.0), slow = comm("slow.txt", "all_reduce", 1.25), other = comm("ag.txt", "all_gather", 1.0);
  auto r = compare(q(a) + " " + q(a) + " --max-slowdown 5%");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("bench comm, 12 vs 12 size/mode samples"));
  r = compare(q(a) + " " + q(slow) + " --max-slowdown 5%");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("time, all sizes (median of per-size ratios): B is slower: +25.0%"));
  EXPECT_THAT(r.output, HasSubstr("1048576 B in-place busbw (GB/s)"));
  // Wrong sums in B fail the comparison, however fast.
  const fs::path wrong = comm("wrong.txt", "all_reduce", 0.5, 3);
  r = compare(q(a) + " " + q(wrong));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("note: B has 3 wrong results"));
  EXPECT_THAT(r.output, HasSubstr("B's bench comm has wrong results: FAIL (exit 1)"));
  r = compare(q(a) + " " + q(other));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("bench comm of different collectives"));
}

TEST(BenchCompare, BadInputExitsTwoNamingTheFileAndLine) {
  test::TempDir dir;
  const fs::path a = metrics(dir, "a", 10, 1.0);
  auto r = compare(q(a) + " " + q(dir / "missing"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr((dir / "missing").string() + ": no such file"));
  fs::create_directories(dir / "empty_run");
  r = compare(q(a) + " " + q(dir / "empty_run"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("a folder without metrics.jsonl"));
  test::write_file(dir / "bad.jsonl", "{\"step\": 1, \"step_ms\": 5}\n{\"step\": 2, \"step_ms\": 5\n");
  r = compare(q(a) + " " + q(dir / "bad.jsonl"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr((dir / "bad.jsonl").string() + ":2: not a JSON object"));
  test::write_file(dir / "nostep.jsonl", "{\"loss\": 1}\n");
  r = compare(q(a) + " " + q(dir / "nostep.jsonl"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("nostep.jsonl:1: a metrics row needs a whole-number \"step\" and a numeric \"step_ms\""));
  const fs::path short_run = metrics(dir, "short", 3, 1.0);
  r = compare(q(a) + " " + q(short_run));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("3 steps, 2 of them warm-up: at least 2 measured steps are needed"));
  r = compare(q(a) + " " + q(short_run) + " --warmup 0");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  test::write_file(dir / "comm.txt", "# spmdx bench comm: all_reduce, 2 ranks, ucx\n 1024 256 float sum 10 0.1 0.1 0 9 0.1 0.1 0\n");
  r = compare(q(a) + " " + q(dir / "comm.txt"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("one run of each kind"));
  for (const auto& [name, text, message] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"zero.jsonl", "{\"step\": 1, \"step_ms\": 0}\n", "zero.jsonl:1: step_ms must be a positive time, got 0"},
           {"negative.jsonl", "{\"step\": 1, \"step_ms\": 5, \"peak_mem_bytes\": -3}\n", "negative.jsonl:1: peak_mem_bytes must not be negative"},
           {"text.jsonl", "{\"step\": 1, \"step_ms\": 5, \"comm_ms\": \"a/b\"}\n", "text.jsonl:1: comm_ms must be a number, got \"a/b\""},
           {"stepstr.jsonl", "{\"step\": \"three\", \"step_ms\": 5}\n", "stepstr.jsonl:1: a metrics row needs a whole-number \"step\""},
           {"stephalf.jsonl", "{\"step\": 4.5, \"step_ms\": 5}\n", "stephalf.jsonl:1: a metrics row needs a whole-number \"step\""},
           {"huge.jsonl", "{\"step\": 1, \"step_ms\": 1e300}\n", "huge.jsonl:1: step_ms is 1e+300: not a measurement (over 1e18)"},
           {"twice.jsonl", "{\"step\": 1, \"step_ms\": 5}\n{\"step\": 2, \"step_ms\": 5}\n{\"step\": 1, \"step_ms\": 5}\n",
            "twice.jsonl:3: step 1 again (line 1): two runs in one file?"}}) {
    test::write_file(dir / name, text);
    r = compare(q(a) + " " + q(dir / name));
    EXPECT_EQ(r.exit_code, 2) << name << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(message)) << name;
  }
  for (const std::string bad : {"5", "''", "1.5"}) {
    r = compare(q(a) + " " + q(a) + " --max-slowdown " + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.output;
  }
  EXPECT_THAT(compare(q(a) + " " + q(a) + " --max-slowdown 5").output, HasSubstr("a bare number is a fraction (0.05 = 5%); for 5 percent write 5%"));
  r = compare(q(a) + " " + q(a) + " --max-slowdown fast");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("--max-slowdown 'fast': give a percentage or a fraction, e.g. 5% or 0.05"));
}

}  // namespace
}  // namespace spmdx
