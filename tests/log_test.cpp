#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "spmdx/core/log.h"
#include "spmdx/text.h"

namespace spmdx {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(Log, LevelFiltersAndRankPrefixes) {
  log::set_level(log::Level::info);
  log::set_rank(3);
  testing::internal::CaptureStderr();
  SPMDX_DEBUG("hidden " << 1);
  SPMDX_WARN("peer " << 2 << " is slow");
  log::set_rank(-1);
  SPMDX_ERROR("no prefix");
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, Not(HasSubstr("hidden")));
  // One form for every line: the rank once, the level as compilers say it, no timestamp.
  EXPECT_EQ(err, "[rank 3] warning: peer 2 is slow\nerror: no prefix\n");
  EXPECT_FALSE(log::enabled(log::Level::debug));
  EXPECT_TRUE(log::enabled(log::Level::warn));
}

TEST(Log, FormatSaysTheLevelAsCompilersDo) {
  EXPECT_EQ(log::format(log::Level::info, 0, "step 1"), "[rank 0] step 1");
  EXPECT_EQ(log::format(log::Level::info, -1, "step 1"), "step 1");
  EXPECT_EQ(log::format(log::Level::warn, -1, "slow"), "warning: slow");
  EXPECT_EQ(log::format(log::Level::error, 2, "gone"), "[rank 2] error: gone");
  EXPECT_EQ(log::format(log::Level::debug, -1, "x"), "debug: x");
  EXPECT_EQ(log::format(log::Level::trace, -1, "x"), "trace: x");
}

// A ThreadLevel silences its own thread below its level, for its lifetime only, and never
// lowers the level set: other threads log as before.
TEST(Log, ThreadLevelSilencesOnlyItsThreadWhileItLives) {
  log::set_level(log::Level::info);
  {
    const log::ThreadLevel quiet(log::Level::error);
    EXPECT_FALSE(log::enabled(log::Level::warn));
    EXPECT_TRUE(log::enabled(log::Level::error));
    bool other = false;
    std::thread([&] { other = log::enabled(log::Level::info); }).join();
    EXPECT_TRUE(other);
    {
      const log::ThreadLevel looser(log::Level::debug);  // nested: never louder than the outer one
      EXPECT_FALSE(log::enabled(log::Level::warn));
    }
    EXPECT_FALSE(log::enabled(log::Level::info));
  }
  EXPECT_TRUE(log::enabled(log::Level::info));
  EXPECT_FALSE(log::enabled(log::Level::debug));
}

TEST(Log, ParsesLevelNames) {
  EXPECT_EQ(log::parse_level("debug"), log::Level::debug);
  EXPECT_EQ(log::parse_level("warning"), log::Level::warn);
  EXPECT_EQ(log::parse_level("loud"), std::nullopt);
}

TEST(Text, Fnv1aHexMatchesThePublishedVectors) {
  // Test vectors from the FNV reference (Landon Curt Noll, isthe.com/chongo/tech/comp/fnv).
  EXPECT_EQ(fnv1a_hex(""), "cbf29ce484222325");
  EXPECT_EQ(fnv1a_hex("a"), "af63dc4c8601ec8c");
  EXPECT_EQ(fnv1a_hex("foobar"), "85944171f73967e8");
  EXPECT_EQ(fnv1a_hex(std::string("\0", 1)), "af63bd4c8601b7df");
}

// One size grammar for every option and flag: K/M/G/T and KiB..TiB are powers of 1024,
// KB..TB powers of 1000 (so "1MB" and "1M" both work and mean what they say).
TEST(Text, ParseBytesReadsBinaryAndDecimalUnits) {
  EXPECT_EQ(parse_bytes("262144"), 262144u);
  EXPECT_EQ(parse_bytes("256K"), 262144u);
  EXPECT_EQ(parse_bytes("4MiB"), 4u << 20);
  EXPECT_EQ(parse_bytes("64 M"), 64u << 20);
  EXPECT_EQ(parse_bytes("1MB"), 1000000u);
  EXPECT_EQ(parse_bytes("1.5GB"), 1500000000u);
  EXPECT_EQ(parse_bytes("2T"), 2ull << 40);
  EXPECT_EQ(parse_bytes("0"), 0u);
  for (const char* bad : {"", "K", "-1", "4Q", "1e30", "nan", "4 Mi"}) EXPECT_THROW(parse_bytes(bad), std::invalid_argument) << bad;
  try {
    parse_bytes("4Q");
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("unknown unit 'Q'"));
  }
}

TEST(Text, JoinListsWithTheSeparator) {
  EXPECT_EQ(join(std::vector<std::string>{}), "");
  EXPECT_EQ(join(std::vector<std::string>{"a"}), "a");
  EXPECT_EQ(join(std::vector<std::string>{"", "b", "c"}), ", b, c");
  EXPECT_EQ(join(std::set<std::string>{"y", "x"}, " | "), "x | y");
}

TEST(Text, SplitLinesKeepsEveryPiece) {
  EXPECT_EQ(split_lines("a\nb"), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(split_lines("a\n\nb\n"), (std::vector<std::string>{"a", "", "b", ""}));
  EXPECT_EQ(split_lines(""), (std::vector<std::string>{""}));
}

TEST(Text, NearestWordIsTheFirstOfTheNearestWithinTheDistance) {
  const std::vector<std::string> known{"timeline", "graphviz", "flight_recorder"};
  EXPECT_EQ(nearest_word("timelin", known, 2), "timeline");
  EXPECT_EQ(nearest_word("grapvhiz", known, 2), "graphviz");  // a swap is two edits
  EXPECT_EQ(nearest_word("grapvhiz", known, 1), "");
  EXPECT_EQ(nearest_word("consistency", known, 3), "");
  EXPECT_EQ(nearest_word("ab", {"ax", "ay"}, 1), "ax");
  EXPECT_EQ(nearest_word("TIMELINE", known, 1), "timeline");  // case is not an edit
  EXPECT_EQ(nearest_word("Grapviz", known, 1), "graphviz");
}

}  // namespace
}  // namespace spmdx
