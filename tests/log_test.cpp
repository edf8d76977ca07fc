#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "spmdx/core/log.h"
#include "spmdx/core/text.h"

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
  EXPECT_THAT(err, HasSubstr("[warning] [rank 3] peer 2 is slow"));
  EXPECT_THAT(err, HasSubstr("[error] no prefix"));
  EXPECT_FALSE(log::enabled(log::Level::debug));
  EXPECT_TRUE(log::enabled(log::Level::warn));
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
}

}  // namespace
}  // namespace spmdx
