#include <gtest/gtest.h>

#include <spmdx/placement.h>
#include <spmdx/sharding/spec.h>

#include <unordered_set>

namespace spmdx {
namespace {

TEST(Placement, PrintsShortAndLongFormsAsDTensor) {
  EXPECT_EQ(Placement::shard(0).str(), "S(0)");
  EXPECT_EQ(Placement::shard(2).repr(), "Shard(dim=2)");
  EXPECT_EQ(Placement::replicate().str(), "R");
  EXPECT_EQ(Placement::replicate().repr(), "Replicate()");
  EXPECT_EQ(Placement::partial().str(), "P(sum)");
  EXPECT_EQ(Placement::partial(ReduceOp::avg).repr(), "Partial(avg)");
  EXPECT_EQ(to_string({Placement::shard(0), Placement::replicate()}), "S(0)R");
}

// The printed form read back (checkpoint metadata, spmdx diff's dumps): to_string's inverse;
// anything else is refused, a shard dim too large for an int included.
TEST(Placement, ParsePlacementsReadsWhatToStringWrites) {
  const std::vector<Placement> all{Placement::shard(0), Placement::replicate(), Placement::partial(ReduceOp::avg), Placement::shard(12)};
  EXPECT_EQ(sharding::parse_placements(to_string(all)), all);
  EXPECT_EQ(sharding::parse_placements(""), std::vector<Placement>{});
  for (const char* bad : {"Q(1)", "S()", "S(-1)", "S(1", "S(9999999)", "P(mean)", "RR ", "a/b", "S(0)x"}) EXPECT_EQ(sharding::parse_placements(bad), std::nullopt) << bad;
}

TEST(Placement, EqualityAndHashFollowKindDimAndOp) {
  EXPECT_EQ(Placement::shard(1), Placement::shard(1));
  EXPECT_NE(Placement::shard(0), Placement::shard(1));
  EXPECT_NE(Placement::shard(0), Placement::replicate());
  EXPECT_NE(Placement::partial(ReduceOp::sum), Placement::partial(ReduceOp::max));
  EXPECT_EQ(Placement::partial(ReduceOp::min), Placement::partial(ReduceOp::min));
  std::unordered_set<Placement> set{Placement::shard(0), Placement::shard(0), Placement::replicate(),
                                    Placement::partial(), Placement::partial(ReduceOp::avg)};
  EXPECT_EQ(set.size(), 4u);
  EXPECT_EQ(Placement::shard(3).dim(), 3);
  EXPECT_EQ(Placement::replicate().dim(), -1);
  EXPECT_EQ(Placement::partial(ReduceOp::prod).reduce_op(), ReduceOp::prod);
}

}  // namespace
}  // namespace spmdx
