// One op, one record (issue 45, item 4): every op defined in core/src/ops/ is complete. Its
// gradient against LibTorch autograd is checked by vjp_test (Vjp.EveryForwardOp*), its sharding
// rules on 2, 3 and 2 x 2 ranks by sharding_rules_test (ShardingRules.EveryClaimedStrategy*),
// both from the record's samples; here, that each record has what those tests and the passes
// need: samples, a kernel, an in-place kernel exactly when it says it writes in place, sharding
// rules that answer for its samples, and a cost, a scratch and a layout the planner can ask for.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "spmdx/exec/executor.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/ir/ops.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/sharding/cost_model.h"
#include "spmdx/sharding/redistribute.h"
#include "spmdx/sharding/rules.h"

namespace spmdx {
namespace {

// A graph holding one node of the sample.
const ir::Node& sample_node(ir::Graph& g, const std::string& op, const ir::Sample& s) {
  std::vector<ir::Value*> in;
  for (std::size_t i = 0; i < s.inputs.size(); ++i) {
    const auto fill = s.inputs[i].fill;
    const bool integer = fill == ir::SampleInput::Fill::indices || fill == ir::SampleInput::Fill::offsets;
    const auto dtype = s.inputs[i].dtype ? *s.inputs[i].dtype : integer ? ir::DType::i64 : ir::DType::f32;
    in.push_back(g.add_input("in" + std::to_string(i), {s.inputs[i].shape, dtype, "cpu", false}));
  }
  return *g.add_node(op, in, s.attrs);
}

TEST(OpsConformance, EveryRecordIsComplete) {
  int records = 0;
  for (const auto& op : ir::OpRegistry::global().names()) {
    const ir::OpSchema& s = *ir::OpRegistry::global().find(op);
    ++records;
    SCOPED_TRACE("op " + op);
    EXPECT_TRUE(s.defined_by_record) << "every op of the registry is a record of core/src/ops/ (SPMDX_OP)";
    // The collectives and send / recv run in the comm layer (exec/distributed.cpp), without a kernel.
    const bool comm_layer = sharding::is_collective(op) || op == "send" || op == "recv";
    EXPECT_EQ(exec::find_kernel(op) != nullptr, !comm_layer) << "a kernel (SPMDX_KERNEL) for each op but those of the comm layer";
    EXPECT_EQ(exec::find_in_place_kernel(op) != nullptr, !s.in_place.empty()) << "in_place inputs and an in-place kernel go together";
    EXPECT_EQ(plan::in_place_ops().count(op) > 0, !s.in_place.empty());
    if (sharding::is_communication(op) || comm_layer) continue;  // placed by the rewriter, checked by the comm tests
    ASSERT_FALSE(s.samples.empty()) << "no conformance sample";
    for (const auto& sample : s.samples) {
      ir::Graph g;
      const ir::Node& n = sample_node(g, op, sample);
      std::vector<sharding::Shape> in, out;
      for (const ir::Value* v : n.inputs()) in.push_back(v->meta().shape);
      for (const ir::Value* v : n.outputs()) out.push_back(v->meta().shape);
      const auto strategies = sharding::op_strategies(n, in, out, 2);
      ASSERT_FALSE(strategies.empty()) << sample.label;
      EXPECT_TRUE(strategies[0].inputs.size() == in.size() && strategies[0].outputs.size() == out.size()) << sample.label;
      const double flops = sharding::node_flops(n);
      EXPECT_TRUE(std::isfinite(flops) && flops >= 0) << sample.label << ": " << flops << " FLOPs";
      EXPECT_EQ(sample.gradient && s.vjp != nullptr, sample.gradient) << sample.label << " asks for a gradient test but the op has no VJP";
    }
  }
  std::printf("%d op records checked\n", records);
  EXPECT_GT(records, 0);
}

// The MoE ops' data-dependent inputs (core/src/ops/moe.cpp) are checked when the kernel runs:
// an expert id outside bincount's bins, offs that decrease or pass the rows. The error names
// the node and what to change.
std::string run_error(const std::string& op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, const ir::Attributes& attrs) {
  ir::Graph g;
  std::vector<ir::Value*> in;
  exec::TensorMap feed;
  for (const at::Tensor& t : {a, b, c}) {
    if (!t.defined()) continue;
    const std::string name = "in" + std::to_string(in.size());
    in.push_back(g.add_input(name, {t.sizes().vec(), exec::from_aten(t.scalar_type()), "cpu", false}));
    feed[name] = t;
  }
  g.add_output("out", g.add(op, in, attrs));
  try {
    exec::Executor(g).run(feed);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

TEST(MoeOps, OutOfRangeIdsAndBadOffsetsAreRefusedWhenTheKernelRuns) {
  const std::string ids = run_error("bincount", at::tensor({0, 3, 4}, at::kLong), {}, {}, {{"minlength", std::int64_t{4}}});
  EXPECT_NE(ids.find("(bincount) failed: bincount: ids must lie in [0, 4) (minlength bins), got ids from 0 to 4"), std::string::npos) << ids;
  const at::Tensor x = at::randn({6, 4}), w = at::randn({2, 4, 3});
  const std::string decreasing = run_error("grouped_mm", x, w, at::tensor({4, 2}, at::kInt), {});
  EXPECT_NE(decreasing.find("grouped_mm: offs must be nondecreasing group end rows in [0, 6], got [4, 2] (group 1)"), std::string::npos) << decreasing;
  const std::string past = run_error("grouped_mm_weight_grad", x, at::randn({6, 3}), at::tensor({2, 7}, at::kLong), {});
  EXPECT_NE(past.find("got [2, 7] (group 1)"), std::string::npos) << past;
  EXPECT_EQ(run_error("bincount", at::tensor({0, 3}, at::kInt), {}, {}, {{"minlength", std::int64_t{4}}}), "");
}

// grouped_mm is the product of each group's rows with its weight, rows past the last group zero,
// empty groups skipped; where this LibTorch's at::_grouped_mm runs on the CPU (float32, i32
// offs, rows of 16-byte multiples) it gives the same numbers on the grouped rows.
TEST(MoeOps, GroupedMmIsEachGroupsProduct) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({10, 8}), w = at::randn({3, 8, 4}), offs = at::tensor({2, 2, 7}, at::kInt);
  ir::Graph g;
  ir::Node* n = g.add_node("grouped_mm", {g.add_input("x", {{10, 8}, ir::DType::f32, "cpu", false}), g.add_input("w", {{3, 8, 4}, ir::DType::f32, "cpu", false}),
                                          g.add_input("offs", {{3}, ir::DType::i32, "cpu", false})});
  const at::Tensor got = (*exec::find_kernel("grouped_mm"))(*n, {x, w, offs})[0];
  const at::Tensor want = at::cat({at::mm(x.narrow(0, 0, 2), w[0]), at::mm(x.narrow(0, 2, 5), w[2]), at::zeros({3, 4})});
  EXPECT_TRUE(at::allclose(got, want, 1e-6, 1e-6));
  try {
    const at::Tensor aten = at::_grouped_mm(x, w, offs);
    EXPECT_TRUE(at::allclose(got.narrow(0, 0, 7), aten.narrow(0, 0, 7), 1e-5, 1e-5));
  } catch (const c10::Error&) {
    // not on this CPU build: the loop is the only kernel
  }
}

}  // namespace
}  // namespace spmdx
