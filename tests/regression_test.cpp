// The timed check issue 20 asks of `spmdx bench compare`: the main job with overlap, bucketing
// and prefetch off is reported slower than with them on. Its own executable, run by CTest with
// RUN_SERIAL: under `ctest -j 2` another test sharing the two cores during one run of the pair
// and not the other hid the difference (CI: +10.3%, interval -3.4% .. +35.4%).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "test_util.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// The main job (the README's first command), 40 steps. Measured alone on this 2-core machine:
// B/A 1.085 (interval 1.041 .. 1.135) and 1.117 (1.062 .. 1.245); with 16 steps the interval was
// twice as wide. A timing on a shared machine: the pair is run again, up to three times, while
// it is inside the noise.
TEST(BenchCompare, TheMainJobWithOverlapAndBucketingOffIsReportedSlower) {
  test::TempDir dir;
  test::CommandResult r;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::string common = "'" SPMDX_EXE "' run '" SPMDX_SOURCE_DIR
                               "/configs/llama_debug.toml' --nproc 4 --training.steps 40 --metrics.log_freq 1000 --job.dump_folder '";
    const fs::path on = dir / ("on" + std::to_string(attempt)), off = dir / ("off" + std::to_string(attempt));
    auto run_on = test::run_command(common + on.string() + "'");
    ASSERT_EQ(run_on.exit_code, 0) << run_on.output;
    auto run_off = test::run_command(common + off.string() + "' --comm.overlap false --comm.bucket_cap_mb 0 --comm.prefetch false");
    ASSERT_EQ(run_off.exit_code, 0) << run_off.output;
    r = test::run_command("'" SPMDX_EXE "' bench compare '" + on.string() + "' '" + off.string() + "' --max-slowdown 0%");
    std::printf("attempt %d:\n%s", attempt + 1, r.output.c_str());
    if (r.exit_code == 1) break;
  }
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("step_ms: B is slower: +"));
  EXPECT_THAT(r.output, HasSubstr("REGRESSION (exit 1)"));
}

}  // namespace
}  // namespace spmdx
