// The LibTorch (ATen) the executor builds on is the one scripts/setup installed, and computes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

TEST(ATen, MatmulAndReductionGiveKnownValues) {
  at::Tensor a = at::arange(6, at::kDouble).reshape({2, 3});  // [[0,1,2],[3,4,5]]
  at::Tensor b = at::arange(6, at::kDouble).reshape({3, 2});  // [[0,1],[2,3],[4,5]]
  at::Tensor c = at::matmul(a, b);
  EXPECT_EQ(c.sizes(), (at::IntArrayRef{2, 2}));
  EXPECT_DOUBLE_EQ(c[0][0].item<double>(), 10.0);
  EXPECT_DOUBLE_EQ(c[0][1].item<double>(), 13.0);
  EXPECT_DOUBLE_EQ(c[1][0].item<double>(), 28.0);
  EXPECT_DOUBLE_EQ(c[1][1].item<double>(), 40.0);
  EXPECT_DOUBLE_EQ(at::log_softmax(at::zeros({4}, at::kDouble), 0)[0].item<double>(), -std::log(4.0));
}
